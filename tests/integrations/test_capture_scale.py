"""Capturing the 175B GPT train step in a fresh process: every op lands in one of its 98 layers, the 96 blocks
share one signature, and the capture stays under 2 GiB of peak RSS (issue 2). Its time is a speed claim:
``orchestrator graph --recipe gpt-175b --no-xla --json`` reports it as ``capture_s``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipes import get_recipe


def get_recipe_param_count() -> int:
    return get_recipe("gpt-175b").config.param_count()


ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, re

def peak_rss_bytes():
    # VmHWM: this program's own peak. ru_maxrss would carry the parent's peak across fork + exec.
    with open("/proc/self/status") as status:
        return int(re.search(r"VmHWM:\s+(\d+) kB", status.read())[1]) * 1024

from integrations.flax import capture
from orchestrator.coarsen import coarsen
from recipes import get_recipe
recipe = get_recipe("gpt-175b")
state = recipe.abstract_state()
graph = capture(recipe.train_step, state, recipe.batch_spec())
layers = coarsen(graph)
grouped = [name for layer in layers for name in layer.ops]
print(json.dumps({
    "peak_rss_bytes": peak_rss_bytes(),
    "ops": len(graph), "grouped_ops": len(grouped), "distinct_grouped_ops": len(set(grouped)),
    "layers": len(layers), "block_signatures": len({layer.signature for layer in list(layers)[1:-1]}),
    "flops": graph.total_flops(), "layer_flops": sum(layer.flops for layer in layers),
    "param_bytes": graph.param_bytes,
}))
"""


def test_capture_175b_groups_every_op_and_stays_small():
    # a clean environment: what earlier tests exported (XLA dump flags and the like) must not leak in
    env = {k: os.environ[k] for k in ("PATH", "HOME", "PYTHONPATH") if k in os.environ}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, env=env, cwd=ROOT
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    print(result)
    assert result["layers"] == 96 + 2
    assert result["ops"] == result["grouped_ops"] == result["distinct_grouped_ops"]  # each op in exactly one layer
    assert result["block_signatures"] == 1  # the 96 blocks do the same work: costed once
    assert result["layer_flops"] == pytest.approx(result["flops"], rel=1e-9)
    assert result["param_bytes"] == 4 * get_recipe_param_count()
    assert result["peak_rss_bytes"] < 2 * 1024**3
