"""``orchestrator plan --recipe R --cluster C --batch B``: capture, cost and plan a recipe's step (or ``--model``'s)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Annotated

import typer

from orchestrator.cli._common import (
    MAX_GLOBAL_BATCH,
    MAX_SEQ,
    MAX_STAGES,
    MAX_TIME_LIMIT_S,
    OUT_OF_TIME,
    cluster_or_fail,
    fail,
    recipe_cost_model,
    recipe_or_fail,
    seq_or_fail,
)
from orchestrator.cli._progress import Progress, show_search
from orchestrator.cli._user_model import UserModelOption, explicit, user_cost_model, user_model_or_fail

# the clock --time-limit-s runs on (a test gives a fake one, so it can run out of time without waiting)
clock = time.perf_counter


def plan_command(
    ctx: typer.Context,
    recipe: Annotated[str, typer.Option(help="Recipe name, e.g. gpt2-small.")] = "gpt2-small",
    user_model: UserModelOption = None,
    cluster: Annotated[str, typer.Option(help="Cluster preset or YAML file.")] = "a100x8",
    batch: Annotated[int, typer.Option(min=1, max=MAX_GLOBAL_BATCH, help="Global batch (samples per step).")] = 64,
    seq: Annotated[
        int | None, typer.Option(min=1, max=MAX_SEQ, help="Sequence length (default: the recipe's).")
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            help="A recipe's compute dtype, float32 or bfloat16 (default: the recipe's); weights stay float32."
        ),
    ] = None,
    schedule: Annotated[str, typer.Option(help="1f1b or gpipe.")] = "1f1b",
    max_stages: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=MAX_STAGES,
            help="Largest number of pipeline stages to consider (default: the layers, at most 16).",
        ),
    ] = None,
    time_limit_s: Annotated[
        float,
        typer.Option(
            min=0.1,
            max=MAX_TIME_LIMIT_S,
            help="Wall-clock limit for the whole command (capture, cost table, search); past it, the best plan "
            "found with its gap, or exit 3. The search itself is budgeted by counted solver work (simplex "
            "iterations, branch-and-bound nodes, plans priced), at most 30 s of an idle core's worth, so a busy "
            "machine gives the same plan and gap unless this limit stops it first.",
        ),
    ] = 60.0,
    zero: Annotated[
        bool, typer.Option(help="ZeRO-1: shard optimizer state over each stage's data-parallel replicas.")
    ] = False,
    memory_headroom: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            max=90.0,
            help="Percent of each device's memory a plan leaves free, for what the cost model does not see "
            "(default: the planner's MEMORY_HEADROOM, 10).",
        ),
    ] = None,
    virtual_stages: Annotated[
        bool,
        typer.Option(
            help="Also try interleaved 1F1B (virtual stages) on the plan found and keep the fastest; under 1F1B the "
            "certified gap then covers every v up to half the blocks (a weaker bound). train --plan runs it in the "
            "Flax pipeline.",
        ),
    ] = False,
    output: Annotated[str | None, typer.Option("--out", help="Write the plan as JSON to this file.")] = None,
    trace: Annotated[
        str | None, typer.Option("--trace", help="Simulate the plan and write a Perfetto trace (JSON) here.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Plan a recipe's (or your --model's) training step on a cluster: stages, devices, TP/DP, microbatches, with a
    certified gap."""
    from orchestrator.planner import MEMORY_HEADROOM, Deadline, PlanInfeasible, PlanNotFound, plan

    deadline = Deadline.after(time_limit_s, clock=clock)  # the capture counts against the limit too
    headroom = MEMORY_HEADROOM if memory_headroom is None else memory_headroom / 100

    if user_model is not None:
        own = user_model_or_fail(user_model, ctx, recipe_options=("recipe", "seq", "dtype"))
        batch = batch if explicit(ctx, "batch") else own.batch_size
    else:
        spec = recipe_or_fail(recipe, dtype)
        seq_or_fail(spec, seq)
    if schedule not in ("1f1b", "gpipe"):
        fail(f"--schedule must be 1f1b or gpipe, got {schedule!r}")
    spec_cluster = cluster_or_fail(cluster)
    with Progress(f"capturing {user_model or recipe}") as shown:
        model = user_cost_model(own, spec_cluster) if user_model else recipe_cost_model(spec, spec_cluster, seq)
        shown.update(f"planning {len(model.layers)} layers on {spec_cluster.name}")
        try:
            result = plan(
                model,
                global_batch=batch,
                schedule=schedule,
                max_stages=max_stages,
                zero=zero,
                memory_headroom=headroom,
                virtual_stages=virtual_stages,
                deadline=deadline,
                progress=show_search(shown),
            )
        except PlanInfeasible as error:
            fail(str(error))
        except PlanNotFound as error:
            fail(str(error).replace("raise time_limit_s", "raise --time-limit-s"), code=OUT_OF_TIME)
    from orchestrator.cluster import cluster_to_dict

    # the cluster travels in the plan, so simulate, report and train --plan read it from any directory
    source = {
        "recipe": recipe,
        "cluster": cluster,
        "seq": seq,
        "cluster_spec": cluster_to_dict(spec_cluster),
        "memory_headroom": headroom,
    }
    if dtype is not None:
        source["dtype"] = dtype
    if user_model is not None:
        source = {"model": user_model, **{k: v for k, v in source.items() if k not in ("recipe", "seq", "dtype")}}
    result = dataclasses.replace(result, source=source)
    if output:
        result.save(output)
    if trace:
        from orchestrator.simulate import simulate, write_trace

        write_trace(simulate(result, model), trace)
    if as_json:
        json.dump(result.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(result.explain())
