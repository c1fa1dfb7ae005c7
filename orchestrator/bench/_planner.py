"""``orchestrator bench planner``: the ILP against the baselines and, where enumerable, the optimum.

Instances:
* 30 random layer chains on one or two device types (``_synthetic``), small enough to enumerate;
* captured recipes on the cluster presets: gpt2-small and mamba-130m on ``a100x8``, gpt-1.3b
  on ``h100x16``, and every GPT and Mamba shape on every mixed preset (``mixed-a100-v100``,
  ``mixed-4type-64``, ``mixed-4type-512``) except gpt-175b below 512 devices, where it does
  not fit: gpt2-small and mamba-130m at batch 64 × 1024, gpt-1.3b at 256 × 2048, gpt-13b at
  512 × 2048, gpt-175b at 1536 × 2048.

Each instance is planned with the suite's time limit (default 30 s, the planner's own
default) except GPT-175B, held to the 10 s its issue sets. The limit is a budget of counted solver
work (``orchestrator.solver.work``), so two runs of the suite give the same plans and gaps however
busy the machine is; only ``solve_s`` (wall-clock) differs. GPT-13B and GPT-175B plan (and
their baselines run) with ZeRO-1, as models of that size are trained: memory binds there, and
the optimizer state, split, lets the fast types hold more layers; the smaller instances keep the
planner's default (off).

Per instance: the ILP's step time, bound, gap and solve time; each baseline's step time;
the exhaustive optimum (or None); and, when the simulator is present, the simulated step
time of the ILP's plan.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

from orchestrator.bench._synthetic import random_instance
from orchestrator.planner import PlanInfeasible, PlanNotFound, plan
from orchestrator.planner.baselines import BASELINES, exhaustive_plan

RANDOM = {"global_batch": 8, "microbatch_candidates": (1, 2, 4), "max_stages": 3}

# (recipe, cluster, global batch, sequence); GPT-175B is held to the 10 s whatever the suite's limit
TIME_CAPS = {"gpt-175b": 10.0}
ZERO = ("gpt-13b", "gpt-175b")
PRESETS = (
    ("gpt2-small", "a100x8", 64, 1024),
    ("gpt2-small", "mixed-a100-v100", 64, 1024),
    ("mamba-130m", "a100x8", 64, 1024),
    ("mamba-130m", "mixed-a100-v100", 64, 1024),
    ("gpt-1.3b", "h100x16", 256, 2048),
    ("gpt-1.3b", "mixed-a100-v100", 256, 2048),
    ("gpt-13b", "mixed-4type-64", 512, 2048),
    ("gpt-175b", "mixed-4type-512", 1536, 2048),
    # the rest of every shape × mixed preset
    ("gpt2-small", "mixed-4type-64", 64, 1024),
    ("mamba-130m", "mixed-4type-64", 64, 1024),
    ("gpt-1.3b", "mixed-4type-64", 256, 2048),
    ("gpt2-small", "mixed-4type-512", 64, 1024),
    ("mamba-130m", "mixed-4type-512", 64, 1024),
    ("gpt-1.3b", "mixed-4type-512", 256, 2048),
    ("gpt-13b", "mixed-a100-v100", 512, 2048),
    ("gpt-13b", "mixed-4type-512", 512, 2048),
)


def captured_model(recipe_name: str, cluster_name: str, seq: int):
    """The cost model of a recipe's training step (captured at batch 1) on a preset."""
    from integrations.flax import capture
    from orchestrator.cluster import load_cluster
    from orchestrator.coarsen import coarsen
    from orchestrator.costs import CostModel
    from recipes import get_recipe

    recipe = get_recipe(recipe_name)
    graph = capture(recipe.train_step, recipe.abstract_state(), recipe.batch_spec(1, seq))
    return CostModel(graph, coarsen(graph), load_cluster(cluster_name), batch_size=1, param_axes=recipe.param_axes())


def instances(*, quick: bool = False) -> Iterator[tuple[str, Callable, dict, str | None]]:
    """(name, model builder, planner settings, cluster preset — None for the enumerable random chains)."""
    for seed in range(6 if quick else 30):
        yield f"random seed={seed}", lambda s=seed: random_instance(s), RANDOM, None
    for recipe, cluster, batch, seq in PRESETS[: 2 if quick else None]:
        yield (
            f"{recipe} × {cluster} (batch {batch}, seq {seq})",
            lambda r=recipe, c=cluster, q=seq: captured_model(r, c, q),
            {"global_batch": batch, **({"zero": True} if recipe in ZERO else {})},
            cluster,
        )


def _simulated(found, model) -> float | None:
    try:
        from orchestrator.simulate import compare
    except ImportError:
        return None
    return compare(found, model)[1]


def run_suite(*, time_limit_s: float = 30.0, quick: bool = False, progress=None) -> list[dict]:
    rows = []
    for name, build, settings, preset in instances(quick=quick):
        enumerable = preset is None
        if progress:
            progress(name)
        model = build()
        started = time.perf_counter()
        try:
            limit = min(time_limit_s, next((c for r, c in TIME_CAPS.items() if name.startswith(r)), time_limit_s))
            found = plan(model, time_limit_s=limit, gap=1e-2 if not enumerable else 1e-6, **settings)
        except (PlanInfeasible, PlanNotFound) as error:
            rows.append(
                {
                    "name": name,
                    "preset": preset,
                    "ilp": None,
                    "infeasible": str(error),
                    "baselines": {},
                    "exhaustive": None,
                }
            )
            continue
        elapsed = time.perf_counter() - started
        baselines = {}
        for baseline, run in BASELINES.items():
            result = run(model, **settings)
            baselines[baseline] = result.iteration_s if result else None
        truth = exhaustive_plan(model, **settings) if enumerable else None
        rows.append(
            {
                "name": name,
                "preset": preset,
                "ilp": {
                    "objective": found.iteration_s,
                    "bound": found.bound,
                    "gap": found.gap if math.isfinite(found.gap) else None,
                    "solve_s": elapsed,
                    "stages": len(found.stages),
                    "microbatches": found.microbatches,
                    "zero": settings.get("zero", False),
                },
                "baselines": baselines,
                "exhaustive": truth.iteration_s if truth else None,
                "simulated": _simulated(found, model),
                "mixed": len({s.device_type for s in found.stages}) > 1 or len(model.cluster.device_types) > 1,
            }
        )
    return rows
