"""Progress on stderr: plain periodic lines when piped, a live display on a terminal, stdout left to the answer."""

import io
import json
import subprocess
import sys
from types import SimpleNamespace

from rich.console import Console
from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.cli._progress import Progress, show_search, show_steps
from orchestrator.planner import SearchProgress

runner = CliRunner()


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _piped() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=False, width=200), out


def test_piped_progress_is_a_line_per_step_and_one_every_period_within_a_step():
    console, out = _piped()
    clock = FakeClock()
    with Progress("capturing", console=console, every_s=1000.0, clock=clock) as shown:
        shown.update("planning: bounds", detail="incumbent 1 ms")
        clock.now = 1.0
        shown.update("planning: bounds", detail="incumbent 0.9 ms")  # the same step, within the period
        clock.now = 1001.0
        shown.update("planning: pieces", completed=3, total=10, detail="gap 4.00%")
        shown.update("planning: pieces", completed=4, total=10, force=True)
    assert out.getvalue().splitlines() == [
        "capturing · 0.0 s",
        "planning: bounds · incumbent 1 ms · 0.0 s",
        "planning: pieces 3/10 · gap 4.00% · 1001.0 s",
        "planning: pieces 4/10 · gap 4.00% · 1001.0 s",  # what is not given stays
    ]


def test_on_a_terminal_progress_is_a_live_display_not_lines():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with Progress("capturing", console=console) as shown:
        assert shown.live
        shown.update("planning: pieces", completed=1, total=2, detail="gap 1.00%")
    assert "capturing · 0.0 s" not in out.getvalue()


def test_the_search_is_shown_with_its_incumbent_bound_and_gap():
    console, out = _piped()
    with Progress("planning", console=console, every_s=1000.0) as shown:
        observe = show_search(shown)
        observe(SearchProgress(step="bounds", elapsed_s=0.1, incumbent_s=0.0125))
        observe(
            SearchProgress(step="pieces", elapsed_s=0.2, incumbent_s=0.0125, bound_s=0.0120, pieces_solved=3, pieces=8)
        )
    lines = [line.rsplit(" · ", 1)[0] for line in out.getvalue().splitlines()]
    assert lines[1:] == [
        "planning: bounds · incumbent 12.5 ms",
        "planning: pieces 3/8 · incumbent 12.5 ms · bound 12 ms · gap 4.00%",
    ]


def test_training_steps_are_shown_with_loss_measured_and_predicted_time():
    import jax.numpy as jnp

    console, out = _piped()
    with Progress("capturing and placing the step", console=console, every_s=1000.0) as shown:
        steps = show_steps(shown, total=10)
        steps.on_train_begin(plan=SimpleNamespace(iteration_s=0.002))
        steps.on_step_begin(0)
        steps.on_step_end(0, {"loss": jnp.float32(1.5)})
        shown.update(force=True)
    last = out.getvalue().splitlines()[-1]
    assert last.startswith("training 1/10 · loss 1.5000 · step ") and " ms · predicted 2 ms · " in last, last


def test_plan_shows_its_search_on_stderr_and_keeps_stdout_the_answer():
    result = runner.invoke(app, ["plan", "--recipe", "gpt-tiny", "--batch", "8", "--time-limit-s", "60", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["stages"]
    assert "planning: done" in result.stderr


def test_plan_piped_to_a_file_has_progress_lines_and_no_solver_banner(tmp_path):
    log = tmp_path / "out.txt"
    with log.open("w") as out:
        args = ["plan", "--recipe", "gpt-tiny", "--batch", "8", "--time-limit-s", "30"]
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator", *args], stdout=out, stderr=subprocess.STDOUT, timeout=120
        )
    text = log.read_text()
    assert done.returncode == 0, text
    assert "capturing gpt-tiny" in text and "planning: first plan" in text and "planning: done" in text
    assert "HiGHS" not in text.replace("HiGHS Optimal", "").replace("HiGHS Time limit", "")
    assert "Copyright" not in text and "\x1b[" not in text  # no banner, no terminal control codes
