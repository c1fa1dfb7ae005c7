"""``orchestrator simulate PLAN.json`` and ``orchestrator report PLAN.json --html out.html``.

A plan file holds stage times but not the model it was made for; pass the
same ``--recipe``/``--cluster`` (and ``--seq``) as to ``orchestrator plan`` to
simulate with the cost model (transfers in bytes over the real links, memory
in bytes). Without them the simulation runs from the plan's own numbers.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from orchestrator.cli._common import cluster_or_fail, fail, recipe_cost_model, recipe_or_fail

PlanFile = Annotated[str, typer.Argument(help="A plan written by 'orchestrator plan --out PLAN.json'.")]
Recipe = Annotated[
    str | None, typer.Option(help="The recipe the plan was made for: simulate with its cost model (memory in bytes).")
]
Cluster = Annotated[str | None, typer.Option(help="The cluster preset or YAML the plan was made for (with --recipe).")]
Seq = Annotated[int | None, typer.Option(min=1, help="Sequence length the plan was made with (default: the recipe's).")]
Blocking = Annotated[
    bool,
    typer.Option(
        "--blocking-p2p", help="Transfers hold the compute stream (blocking sends; the planner lets them overlap)."
    ),
]
NoSyncOverlap = Annotated[
    bool,
    typer.Option(
        "--no-sync-overlap", help="Gradient sync after the whole pipeline (the planner hides it behind the backward)."
    ),
]


def _load(path: str):
    from orchestrator.planner import Plan

    try:
        return Plan.load(path)
    except FileNotFoundError:
        fail(f"no plan file {path!r}; write one with 'orchestrator plan ... --out {path}'")
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        fail(f"{path} is not JSON ({error}); pass a file written by 'orchestrator plan --out'")
    except (TypeError, KeyError, AttributeError) as error:
        fail(f"{path} is not a plan file ({error}); pass a file written by 'orchestrator plan --out'")


def _model(recipe: str | None, cluster: str | None, seq: int | None):
    """The cost model ``orchestrator plan`` builds for (recipe, cluster), or None when neither is given."""
    if recipe is None and cluster is None:
        return None
    if recipe is None or cluster is None:
        fail("--recipe and --cluster go together (the ones the plan was made with)")
    from rich.console import Console

    spec, spec_cluster = recipe_or_fail(recipe), cluster_or_fail(cluster)
    with Console(stderr=True).status(f"capturing {recipe} for its cost model"):
        return recipe_cost_model(spec, spec_cluster, seq)


def _simulate(plan_file: str, recipe, cluster, seq, blocking_p2p: bool, no_sync_overlap: bool):
    from orchestrator.simulate import simulate

    plan = _load(plan_file)
    if recipe is None and cluster is None and plan.source.get("recipe") and plan.source.get("cluster"):
        recipe, cluster = plan.source["recipe"], plan.source["cluster"]
        seq = seq or plan.source.get("seq")
    model = _model(recipe, cluster, seq)
    try:
        timeline = simulate(plan, model, overlap_p2p=not blocking_p2p, overlap_dp_sync=not no_sync_overlap)
    except ValueError as error:
        fail(f"{plan_file}: {error}")
    return plan, timeline


def simulate_command(
    plan_file: PlanFile,
    trace: Annotated[str | None, typer.Option(help="Write a Perfetto/Chrome trace (JSON) here.")] = None,
    png: Annotated[str | None, typer.Option(help="Write a Gantt chart (PNG) here.")] = None,
    memory_png: Annotated[str | None, typer.Option("--memory-png", help="Write the memory chart (PNG) here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the timeline as JSON.")] = False,
    recipe: Recipe = None,
    cluster: Cluster = None,
    seq: Seq = None,
    blocking_p2p: Blocking = False,
    no_sync_overlap: NoSyncOverlap = False,
) -> None:
    """Replay one training step of a plan event by event: step time, bubbles, link use, memory."""
    from orchestrator.simulate import gantt_png, write_trace
    from orchestrator.simulate import memory_png as write_memory_png

    _, timeline = _simulate(plan_file, recipe, cluster, seq, blocking_p2p, no_sync_overlap)
    try:
        if trace:
            write_trace(timeline, trace)
        if png:
            gantt_png(timeline, png)
        if memory_png:
            write_memory_png(timeline, memory_png)
    except OSError as error:
        fail(f"cannot write output: {error}")
    if as_json:
        json.dump(timeline.to_json(), sys.stdout)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(timeline.summary())


def report_command(
    plan_file: PlanFile,
    html: Annotated[str, typer.Option("--html", help="Write the self-contained HTML report here.")],
    recipe: Recipe = None,
    cluster: Cluster = None,
    seq: Seq = None,
    blocking_p2p: Blocking = False,
    no_sync_overlap: NoSyncOverlap = False,
) -> None:
    """Write one HTML page: the plan table and explanation, Gantt and memory charts, the predicted breakdown."""
    from orchestrator.report import write_html

    plan, timeline = _simulate(plan_file, recipe, cluster, seq, blocking_p2p, no_sync_overlap)
    title = f"Plan {plan_file}" + (f" — {recipe} on {cluster}" if recipe else "")
    try:
        write_html(plan, timeline, html, title=title)
    except OSError as error:
        fail(f"cannot write {html}: {error}")
    typer.echo(f"wrote {html}", err=True)
