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

4. **Migration.** With ``horizon_steps`` the objective adds the parameters and optimizer
   state that must leave surviving stages, over the links they cross, amortised over that
   many steps (``_migration``), so a re-plan does not reshuffle everything for a tiny gain.

``widen=False`` stops after the repair: only the lost stages' part is solved (the model
offers just the kept groups and groups that fit the freed devices), which is what a
running job wants first; its gap is certified against a solve-free bound.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import time
from collections import Counter

from orchestrator.planner._driver import plan
from orchestrator.planner._evaluate import evaluate
from orchestrator.planner._groups import GroupConfig, stage_group
from orchestrator.planner._ilp import in_flight, simple_bound_s
from orchestrator.planner._incumbent import Best, Incumbent
from orchestrator.planner._make_plan import make_plan
from orchestrator.planner._migration import Migration
from orchestrator.planner._options import SearchOptions
from orchestrator.planner._plan import Plan, PlanNotFound
from orchestrator.planner._space import DEFAULT_MICROBATCHES, search_space
from orchestrator.planner._split import StageCosts, min_bottleneck_split
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


def _fits(group: GroupConfig, free: Counter) -> bool:
    return all(n <= free[kind] for kind, n in group.by_type.items())


def _replace_lost(previous: Plan, space, kept: list[int], free: Counter, score, limit: int = 4096):
    """Every group of ``previous`` fixed but its lost stages', which are enumerated over the
    groups that fit the freed devices; for each choice the previous split and the split that
    balances the stages on those groups (``min_bottleneck_split``) are scored. Returns the best
    feasible ``(stages, groups, M, evaluation)``, or None (also beyond ``limit`` choices)."""
    M, S = previous.microbatches, len(previous.stages)
    lost = [s for s in range(S) if s not in kept]
    options = [[g for g in space.groups if _fits(g, free) and space.table.microbatch(g, M) is not None] for _ in lost]
    if math.prod(len(o) for o in options) > limit:
        return None
    previous_split = [list(stage.layers) for stage in previous.stages]
    best = None
    for choice in itertools.product(*options):
        use = Counter()
        for g in choice:
            use.update(g.by_type)
        if any(n > free[t] for t, n in use.items()):
            continue
        groups = [stage_group(stage) for stage in previous.stages]
        for s, g in zip(lost, choice):
            groups[s] = g
        costs = [StageCosts(space, g, M) for g in groups]

        def stage_times(s, costs=costs):
            return costs[s].times(in_flight(previous.schedule, M, S, s))

        for split in (previous_split, min_bottleneck_split(space.layers, S, stage_times)):
            if split is None:
                continue
            ev = evaluate(split, groups, M, table=space.table, infos=space.infos, schedule=previous.schedule,
                          links=space.links)  # fmt: skip
            if ev.feasible and (best is None or score(ev, split, groups) < best.score):
                best = Incumbent(score(ev, split, groups), ev, split, groups, M)
    return None if best is None else (best.stages, best.groups, best.microbatches, best.evaluation)


def _repair(previous: Plan, model, space, settings: dict, time_limit_s: float, migration: Migration | None):
    """The previous plan with lost stages re-decided (see the module docstring), or None.

    Returns ``(stages, groups, M, evaluation)``. First only the lost stages' groups are
    re-decided, by enumeration (:func:`_replace_lost`); failing that, an ILP at the previous
    microbatch count keeps the surviving stages' groups (and, first, their layers). It only
    offers the kept groups and groups that fit the freed devices, so it is small and fast."""
    alive = model.cluster.devices()
    alive_refs = {d.ref for d in alive}
    M, S = previous.microbatches, len(previous.stages)
    kept = [s for s, stage in enumerate(previous.stages) if set(stage.devices) <= alive_refs]
    free = Counter(d.device_type for d in alive)
    for s in kept:
        free.subtract(stage_group(previous.stages[s]).by_type)
    keys = [(layer.signature, layer.activation_bytes) for layer in model.layers]
    score = Best(space, previous.schedule, migration=migration, keys=keys).score
    replaced = _replace_lost(previous, space, kept, free, score)
    if replaced is not None:
        return replaced
    kept_groups = {stage_group(previous.stages[s]) for s in kept}
    groups = [g for g in space.groups if g in kept_groups or _fits(g, free)]
    for fix_layers in (True, False):
        sub = space.stage_model(M, S, previous.schedule, groups=groups)
        if not sub.groups:
            return None
        sub.build()
        if migration is not None:
            migration.add_to(sub)
        run_of = {layer: r for r, run in enumerate(sub.runs) for layer in run.layers}
        fixable = True
        for s in kept:
            j, group = S - 1 - s, stage_group(previous.stages[s])
            if group not in sub.groups:
                fixable = False
                break
            sub.lp += sub.u[j, sub.groups.index(group)] == 1, f"keep_group_{s}"
            if fix_layers:
                counts = Counter(run_of[layer] for layer in previous.stages[s].layers)
                for r in range(len(sub.runs)):
                    sub.lp += sub.z[r, j] == counts.get(r, 0), f"keep_layers_{s}_{r}"
        if not fixable:
            return None
        result = solve(sub.lp, time_limit_s=time_limit_s, gap=1e-3)
        if result.has_solution:
            stages, chosen = sub.read()
            ev = evaluate(
                stages, chosen, M, table=space.table, infos=space.infos, schedule=previous.schedule, links=space.links
            )
            if ev.feasible:
                return stages, chosen, M, ev
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
    horizon_steps: int | None = 1000,
    widen: bool = True,
    certify: bool = True,
    mixed_stages: bool | None = None,
) -> Plan:
    """A new plan for ``model`` (a changed cluster or changed costs), reusing ``previous``.

    Returns the cached plan for an identical request; otherwise repairs ``previous`` and,
    with ``widen``, solves the full model warm-started from the repair (module docstring).
    ``widen=False`` returns the repair itself (fast: only the lost stages are re-decided),
    with a solve-free certified bound, or with ``certify=False`` none (bound 0, gap 100%:
    computing the bound prices every group at every microbatch count, which on a large
    model takes longer than the repair). With ``horizon_steps`` the objective adds the state
    that must move off surviving stages, amortised over that many steps (``_migration``);
    None leaves it out. ``solve_s`` of the result covers the whole re-plan. ``mixed_stages`` as
    for :func:`plan` (the executor's callers pass False).

    Raises:
      PlanInfeasible, PlanNotFound: as :func:`plan` (``widen=False``: PlanNotFound when the
        repair finds nothing).
    """
    mixed_stages = SearchOptions().offers_mixed(model.cluster, mixed_stages)
    started = time.perf_counter()
    settings = {
        "global_batch": global_batch or previous.global_batch,
        "schedule": previous.schedule,
        "microbatch_candidates": tuple(microbatch_candidates),
        "max_stages": max_stages,
        "gap": gap,
        "recompute": recompute,
        "zero": any(stage.zero for stage in previous.stages),  # the new plan trains as the old one did
        "mixed_stages": mixed_stages,
    }
    key = fingerprint(
        model,
        {
            **settings,
            "previous": hashlib.sha256(json.dumps(previous.to_json(), sort_keys=True).encode()).hexdigest(),
            "horizon_steps": horizon_steps,
            "widen": widen,
            "certify": certify,
        },
    )
    if key in _CACHE:
        return _CACHE[key]
    space = search_space(
        model, settings["global_batch"], recompute=recompute, zero=settings["zero"], mixed=mixed_stages
    )
    migration = Migration.from_plan(previous, model, space.links, horizon_steps) if horizon_steps else None
    repaired = _repair(previous, model, space, settings, max(0.2, time_limit_s / 4), migration)
    alive = {d.ref for d in model.cluster.devices()}
    S = len(previous.stages)
    prefer = [previous.stages[S - 1 - j].devices if set(previous.stages[S - 1 - j].devices) <= alive else None
              for j in range(S)]  # fmt: skip
    if not widen:
        if repaired is None:
            raise PlanNotFound("the repair of the previous plan found no plan: re-plan with widen=True")
        stages, chosen, M, ev = repaired
        keys = [(layer.signature, layer.activation_bytes) for layer in model.layers]
        candidates = [m for m in microbatch_candidates if settings["global_batch"] % m == 0]
        bound = (
            min(simple_bound_s(space.runs, space.groups, space.table, space.infos, m) for m in candidates)
            if certify
            else 0.0
        )
        moved = migration.step_cost_s(stages, chosen, space.table, keys) if migration else 0.0
        result = make_plan(
            model, space, ev, stages, chosen, M,
            schedule=previous.schedule, global_batch=settings["global_batch"], bound=bound, gap=gap,
            started=started, prefer_devices=prefer, objective=ev.iteration_s + moved,
        )  # fmt: skip
    else:
        start = repaired[:3] if repaired else None
        remaining = max(0.2, time_limit_s - (time.perf_counter() - started))
        result = plan(
            model, time_limit_s=remaining, start=start, prefer_devices=prefer, migration=migration, **settings
        )
    result = dataclasses.replace(result, solve_s=time.perf_counter() - started, source=previous.source)
    _CACHE[key] = result
    return result
