"""The PNG charts: they decode, and their bars and lines are drawn in the colours the legend names."""

import io
import os
from pathlib import Path

import numpy as np
import pytest
from matplotlib import colors as mcolors
from matplotlib import image as mimage

from orchestrator.simulate import gantt_png, memory_png, simulate
from orchestrator.simulate._charts import COLORS
from tests.orchestrator.simulate._plans import hand_plan, tiny_model
from tests.orchestrator.simulate.test_engine import _plan, _stage


def _pixels(png: bytes, color: str) -> int:
    """Pixels of exactly ``color`` (anti-aliased edges aside)."""
    image = mimage.imread(io.BytesIO(png), format="png")[..., :3]
    target = np.array(mcolors.to_rgb(color))
    return int(np.sum(np.all(np.abs(image - target) < 2 / 255, axis=-1)))


def _out(tmp_path: Path, name: str) -> Path:
    """Write into $SIMULATE_CHARTS_DIR when set (to look at them), else the test's temporary directory."""
    folder = Path(os.environ.get("SIMULATE_CHARTS_DIR", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gantt_and_memory_charts_with_the_cost_model(tmp_path, schedule):
    model = tiny_model()
    timeline = simulate(hand_plan(model, schedule, microbatches=4), model)
    gantt = gantt_png(timeline, _out(tmp_path, f"gantt-{schedule}.png"))
    assert gantt[:8] == b"\x89PNG\r\n\x1a\n" and _out(tmp_path, f"gantt-{schedule}.png").read_bytes() == gantt
    height, width = mimage.imread(io.BytesIO(gantt), format="png").shape[:2]
    assert width == 1320 and height > 300
    for kind in ("forward", "backward", "optimizer", "send_activation", "send_gradient", "dp_sync"):
        assert _pixels(gantt, COLORS[kind]) > 50, kind  # each kind's bars (and legend patch) are drawn
    memory = memory_png(timeline, _out(tmp_path, f"memory-{schedule}.png"))
    assert _pixels(memory, "C0") > 200 and _pixels(memory, "C1") > 200  # one line per stage


def test_charts_without_the_cost_model(tmp_path):
    timeline = simulate(_plan([_stage("h/0", f=1.0, b=2.0, send=0.25), _stage("g/0", f=1.0, b=2.0)], 4, "1f1b"))
    gantt = gantt_png(timeline, _out(tmp_path, "gantt-textbook.png"))
    assert _pixels(gantt, COLORS["forward"]) > 1000 and _pixels(gantt, COLORS["dp_sync"]) == 0  # no sync: none drawn
    memory = memory_png(timeline, _out(tmp_path, "memory-textbook.png"))
    assert _pixels(memory, "C0") > 200
