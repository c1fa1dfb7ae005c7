"""``orchestrator simulate PLAN.json`` and ``orchestrator report PLAN.json --html out.html``.

A plan written by ``orchestrator plan`` names its recipe and sequence length (or its
``--model``, imported again from the current directory) and embeds its cluster, so it is
simulated with its cost model (transfers in bytes over the real
links, memory in bytes) from any directory. For a plan without them, pass the same
``--recipe``/``--cluster`` (and ``--seq``) as to ``orchestrator plan``; without those the
simulation runs from the plan's own numbers.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from orchestrator.cli._common import (
    cluster_or_fail,
    fail,
    plan_or_fail,
    plan_source_or_fail,
    recipe_cost_model,
    recipe_or_fail,
    seq_or_fail,
)

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


def _model(recipe: str | None, cluster: str | None, seq: int | None):
    """The cost model ``orchestrator plan`` builds for (recipe, cluster), or None when neither is given."""
    if recipe is None and cluster is None:
        return None
    if recipe is None or cluster is None:
        fail("--recipe and --cluster go together (the ones the plan was made with)")
    return _capture(recipe_or_fail(recipe), cluster_or_fail(cluster), seq)


def _capture(spec, cluster, seq: int | None):
    from rich.console import Console

    seq_or_fail(spec, seq)
    with Console(stderr=True).status(f"capturing {spec.name} for its cost model"):
        return recipe_cost_model(spec, cluster, seq)


def _user_model(plan, plan_file: str):
    """The cost model of the plan's ``--model`` step on its embedded cluster, as ``orchestrator plan`` built it
    (the factory's module is imported from the current directory)."""
    from rich.console import Console

    from orchestrator.cli._user_model import user_cost_model, user_model_or_fail
    from orchestrator.cluster import ClusterError, parse_cluster

    if not isinstance(plan.source.get("cluster_spec"), dict):
        fail(f"{plan_file}: a plan for --model {plan.source['model']} needs its source.cluster_spec")
    try:
        spec_cluster = parse_cluster(plan.source["cluster_spec"], f"{plan_file}: source.cluster_spec")
    except ClusterError as error:
        fail(str(error))
    own = user_model_or_fail(plan.source["model"])
    with Console(stderr=True).status(f"capturing {own.spec} for its cost model"):
        return user_cost_model(own, spec_cluster)


def _simulate(plan_file: str, recipe, cluster, seq, blocking_p2p: bool, no_sync_overlap: bool):
    from orchestrator.simulate import simulate

    plan = plan_or_fail(plan_file)
    if recipe is None and cluster is None and plan.source.get("recipe") and plan.source.get("cluster"):
        # the plan names what it was made for; its cluster travels in the file, so any directory will do
        source = plan_source_or_fail(plan, plan_file)
        model = _capture(recipe_or_fail(source.recipe, source.dtype), source.cluster, seq or source.seq)
    elif recipe is None and cluster is None and isinstance(plan.source.get("model"), str):
        model = _user_model(plan, plan_file)
    else:
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
