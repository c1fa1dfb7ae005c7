"""``orchestrator`` — the command-line entry point.

User mistakes (an unknown recipe, a bad file) end in one line on stderr and
exit code 2, never a traceback.
"""

from __future__ import annotations

import typer

from orchestrator.cli._bench import bench_app
from orchestrator.cli._cluster import cluster_app
from orchestrator.cli._executor import demo_command
from orchestrator.cli._graph import graph_command
from orchestrator.cli._plan import plan_command
from orchestrator.cli._profile import profile_command
from orchestrator.cli._run import resume_command, train_command
from orchestrator.cli._simulate import report_command, simulate_command

app = typer.Typer(
    name="orchestrator",
    help="Plan and run training steps across mixed accelerator clusters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("graph")(graph_command)
app.add_typer(cluster_app, name="cluster")
app.command("profile")(profile_command)
app.command("plan")(plan_command)
app.command("simulate")(simulate_command)
app.command("report")(report_command)
app.add_typer(bench_app, name="bench")
app.command("demo")(demo_command)  # orchestrator.cli._executor imports jax only inside the command
app.command("train")(train_command)
app.command("resume")(resume_command)


@app.callback()
def _root() -> None:
    """Plan and run training steps across mixed accelerator clusters."""


def main() -> None:
    app()
