"""``orchestrator`` — the command-line entry point.

User mistakes (an unknown recipe, a bad file) end in one line on stderr and
exit code 2, never a traceback.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from typer.core import TyperGroup

try:  # typer vendors click from 0.22 on
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:
    from click.exceptions import ClickException, NoArgsIsHelpError

from orchestrator.cli._bench import bench_app
from orchestrator.cli._cluster import cluster_app
from orchestrator.cli._common import json_errors, report_error
from orchestrator.cli._executor import demo_command
from orchestrator.cli._graph import graph_command
from orchestrator.cli._plan import plan_command
from orchestrator.cli._profile import profile_command
from orchestrator.cli._run import resume_command, train_command
from orchestrator.cli._simulate import report_command, simulate_command


class _OneLineErrors(TyperGroup):
    """Reports a mistake in the command line itself (an option out of range, an unknown option) as every
    other user mistake: one line on stderr, exit 2, and ``{"error": ...}`` on stdout when ``--json`` is
    among the arguments."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        args = list(sys.argv[1:] if args is None else args)
        if "--verbose" in args[1:]:  # the root's option, accepted after the command too (plan ... --verbose)
            args.remove("--verbose")
            args.insert(0, "--verbose")
        as_json = "--json" in args
        try:
            with json_errors(as_json):
                code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except NoArgsIsHelpError as error:
            typer.echo(error.ctx.get_help())
            code = error.exit_code
        except ClickException as error:
            ctx = getattr(error, "ctx", None)
            where = f" (see: {ctx.command_path} --help)" if ctx is not None else ""
            report_error(error.format_message() + where, as_json=as_json)
            code = error.exit_code
        except typer.Abort:
            typer.echo("aborted", err=True)
            code = 1
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    name="orchestrator",
    cls=_OneLineErrors,
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
def _root(
    ctx: typer.Context,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose", help="Also show what the solver prints (HiGHS's banner), on stderr; also after the command."
        ),
    ] = False,
) -> None:
    """Plan and run training steps across mixed accelerator clusters."""
    if verbose:
        ctx.call_on_close(_show_solver_output)


def _show_solver_output() -> None:
    """HiGHS's banner, kept out of stdout while the command ran (see orchestrator.solver.solver_banner)."""
    if "orchestrator.solver" in sys.modules:  # no solver ran if it was never imported
        text = sys.modules["orchestrator.solver"].solver_banner().strip()
        if text:
            typer.echo(text, err=True)


def main() -> None:
    app()
