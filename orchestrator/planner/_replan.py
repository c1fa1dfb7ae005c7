"""Re-planning when the cluster or the costs change: a plan cache, then repair, then a warm full solve.

``replan(previous, model)``:

1. **Cache.** Requests are keyed by a fingerprint of what the plan depends on — layer
   signatures and activation sizes, the cluster (device types, devices in service, links),
   the cost model's efficiencies and measured timings, and the planning settings. An
   identical request returns the cached plan without solving.
2. **Repair (fix untouched decisions first).** Stages whose devices all survive keep their
   device group and layers; one ILP at the previous microbatch count decides only the rest
   (which groups replace lost stages, and how their layers split). If that is infeasible,
   the surviving stages keep only their groups; if that fails too, nothing is fixed.
3. **Widen.** The full planner runs with the repaired plan as its starting incumbent (handed
   to HiGHS as a MIP start through ``Highs.setSolution``) and surviving stages keep their
   concrete devices where their group still fits them, so their state does not move.

Not modelled yet: a migration term in the objective (bytes of parameters and optimizer
state that must move, over the links they cross).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time

from orchestrator.planner._evaluate import evaluate
from orchestrator.planner._groups import GroupConfig
from orchestrator.planner._ilp import StageModel
from orchestrator.planner._plan import Plan
from orchestrator.planner._search import DEFAULT_MICROBATCHES, plan, search_space
from orchestrator.solver import solve

_CACHE: dict[str, Plan] = {}


def fingerprint(model, settings: dict) -> str:
    """A stable hash of everything a plan depends on."""
    cluster = model.cluster
    payload = {
        "layers": [[layer.signature, float(layer.activation_bytes)] for layer in model.layers],
        "batch_size": model.batch_size,
        "device_types": {name: repr(kind) for name, kind in sorted(cluster.device_types.items())},
        "devices": [[d.ref, d.device_type] for d in cluster.devices()],
        "hosts": [repr(host) for host in cluster.hosts],
        "network": [repr(cluster.rack_link), repr(cluster.cluster_link), sorted(map(repr, cluster.overrides.items()))],
        "efficiency": repr(sorted(getattr(model, "efficiency", {}).items())),
        "default_efficiency": repr(getattr(model, "default_efficiency", None)),
        "measured": repr(sorted(getattr(model, "measured", {}).items())),
        "settings": {k: repr(v) for k, v in sorted(settings.items())},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def cached_plan(model, **settings) -> Plan:
    """``plan(model, **settings)``, answered from the cache when an identical request was solved."""
    key = fingerprint(model, settings)
    if key not in _CACHE:
        _CACHE[key] = plan(model, **settings)
    return _CACHE[key]


def _group_of(stage) -> GroupConfig:
    return GroupConfig(device_type=stage.device_type, size=stage.tp * stage.dp, tp=stage.tp, recompute=stage.recompute)


def _repair(previous: Plan, model, settings: dict, time_limit_s: float):
    """The previous plan with lost stages re-decided (see the module docstring), or None."""
    alive = {d.ref for d in model.cluster.devices()}
    space = search_space(model, settings["global_batch"], recompute=settings.get("recompute", True))
    M, S = previous.microbatches, len(previous.stages)
    kept = [s for s, stage in enumerate(previous.stages) if set(stage.devices) <= alive]
    for fix_layers in (True, False):
        sub = StageModel(
            runs=space.runs,
            max_stages=S,
            microbatches=M,
            groups=space.groups,
            table=space.table,
            infos=space.infos,
            schedule=previous.schedule,
            links=space.links,
        )
        if not sub.groups:
            return None
        sub.build()
        run_of = {layer: r for r, run in enumerate(sub.runs) for layer in run.layers}
        for s in kept:
            j, group = S - 1 - s, _group_of(previous.stages[s])
            if group not in sub.groups:
                break
            sub.lp += sub.u[j, sub.groups.index(group)] == 1, f"keep_group_{s}"
            if fix_layers:
                counts: dict[int, int] = {}
                for layer in previous.stages[s].layers:
                    counts[run_of[layer]] = counts.get(run_of[layer], 0) + 1
                for r in range(len(sub.runs)):
                    sub.lp += sub.z[r, j] == counts.get(r, 0), f"keep_layers_{s}_{r}"
        result = solve(sub.lp, time_limit_s=time_limit_s, gap=1e-3)
        if result.has_solution:
            stages, groups = sub.read()
            ev = evaluate(
                stages, groups, M, table=space.table, infos=space.infos, schedule=previous.schedule, links=space.links
            )
            if ev.feasible:
                return stages, groups, M
    return None


def replan(
    previous: Plan,
    model,
    *,
    global_batch: int | None = None,
    microbatch_candidates: tuple[int, ...] = DEFAULT_MICROBATCHES,
    max_stages: int | None = None,
    time_limit_s: float = 30.0,
    gap: float = 1e-3,
    recompute: bool = True,
) -> Plan:
    """A new plan for ``model`` (a changed cluster or changed costs), reusing ``previous``.

    Returns the cached plan for an identical request; otherwise repairs ``previous`` and
    solves the full model warm-started from the repair (module docstring). ``solve_s`` of
    the result covers the whole re-plan.
    """
    started = time.perf_counter()
    settings = {
        "global_batch": global_batch or previous.global_batch,
        "schedule": previous.schedule,
        "microbatch_candidates": tuple(microbatch_candidates),
        "max_stages": max_stages,
        "gap": gap,
        "recompute": recompute,
    }
    key = fingerprint(model, settings)
    if key in _CACHE:
        return _CACHE[key]
    start = _repair(previous, model, settings, time_limit_s=max(0.2, time_limit_s / 4))
    alive = {d.ref for d in model.cluster.devices()}
    prefer = [stage.devices if set(stage.devices) <= alive else None for stage in previous.stages]
    remaining = max(0.2, time_limit_s - (time.perf_counter() - started))
    result = plan(model, time_limit_s=remaining, start=start, prefer_devices=prefer, **settings)
    result = dataclasses.replace(result, solve_s=time.perf_counter() - started, source=previous.source)
    _CACHE[key] = result
    return result
