"""Re-planning when the cluster or the costs change: a plan cache, then repair, then a warm full solve.

``replan(previous, model)``:

1. **Cache.** Requests are keyed by a fingerprint of what the plan depends on — layer
   signatures and activation sizes, the cluster (device types, devices in service, links),
   the cost model's efficiencies and measured timings, and the planning settings. An
   identical request returns the cached plan without solving.
2. **Repair (fix untouched decisions first).** Stages whose devices all survive keep their
   device group and layers, and the lost stages' groups are re-chosen among those that fit
   the freed devices (enumerated; failing that, one ILP at the previous microbatch count that
   keeps the surviving stages' groups, with their layers and then without). Where no group
   fits the freed devices (a cluster whose every device was in use), the lost stages are
   dropped and the layers cut anew over the surviving stages (``_rebalance``), at every
   microbatch count. The best of these is the repair.
3. **Widen.** The full planner runs with the repair as its starting incumbent (handed to
   HiGHS as a MIP start through ``Highs.setSolution``) and surviving stages keep their
   concrete devices where their group still fits them, so their state does not move. Its
   certified bound is the one a cold solve proves, so the re-plan is as good as a cold solve
   in the same time; the repair only gives it a better start.
4. **Migration.** With ``horizon_steps`` the objective adds the parameters and optimizer
   state that must leave surviving stages, over the links they cross, amortised over that
   many steps (``_migration``), so a re-plan does not reshuffle everything for a tiny gain.

``widen=False`` returns the repair without the full search when the solve-free bound
(``simple_bound_s``) certifies it within ``gap``, which is what a running job wants first;
otherwise — no repair found, or one the bound cannot certify — it widens by itself, so a plan
comes back whenever one exists, and is as good as a cold solve's. The plan's first note says
what was lost, which path produced the plan and the predicted step time before and after.
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
from orchestrator.planner._groups import MEMORY_HEADROOM, GroupConfig, stage_group
from orchestrator.planner._ilp import in_flight, simple_bound_s
from orchestrator.planner._incumbent import Best, Incumbent
from orchestrator.planner._make_plan import make_plan
from orchestrator.planner._migration import Migration
from orchestrator.planner._options import SearchOptions
from orchestrator.planner._plan import Plan, PlanNotFound
from orchestrator.planner._rebalance import Rebalancer
from orchestrator.planner._space import microbatch_counts, search_space
from orchestrator.planner._split import min_bottleneck_split, stage_costs
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
        costs = [stage_costs(space, g, M) for g in groups]

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


def _drop_lost(previous: Plan, space, kept: list[int], candidates: list[int], score):
    """The surviving stages alone, in their order, the layers cut anew over them (``Rebalancer``:
    the least slowest stage) at every M in ``candidates``; the best feasible ``(stages, groups, M,
    evaluation)``, or None. This is the repair when no group fits the freed devices."""
    groups = [stage_group(previous.stages[s]) for s in kept]
    if not groups:
        return None
    rebalancer = Rebalancer(space.table, space.groups, space.layers, previous.schedule)
    best = None
    for M in candidates:
        found = rebalancer.rebalance(groups, M, math.inf)
        if found is None:
            continue
        stages, chosen = found
        ev = evaluate(stages, chosen, M, table=space.table, infos=space.infos, schedule=previous.schedule,
                      links=space.links)  # fmt: skip
        if ev.feasible and (best is None or score(ev, stages, chosen) < best.score):
            best = Incumbent(score(ev, stages, chosen), ev, stages, chosen, M)
    return None if best is None else (best.stages, best.groups, best.microbatches, best.evaluation)


def _repair(previous: Plan, model, space, candidates: list[int], time_limit_s: float, migration: Migration | None):
    """The previous plan with lost stages re-decided (see the module docstring), or None.

    Returns ``(stages, groups, M, evaluation, how)``, ``how`` a few words on what was re-decided.
    First only the lost stages' groups are re-decided, by enumeration (:func:`_replace_lost`);
    failing that, an ILP at the previous microbatch count keeps the surviving stages' groups
    (and, first, their layers). It only offers the kept groups and groups that fit the freed
    devices, so it is small and fast. Dropping the lost stages (:func:`_drop_lost`) competes with
    both: it is the only repair when the freed devices fit no group."""
    alive = model.cluster.devices()
    alive_refs = {d.ref for d in alive}
    S = len(previous.stages)
    kept = [s for s, stage in enumerate(previous.stages) if set(stage.devices) <= alive_refs]
    free = Counter(d.device_type for d in alive)
    for s in kept:
        free.subtract(stage_group(previous.stages[s]).by_type)
    keys = [(layer.signature, layer.activation_bytes) for layer in model.layers]
    score = Best(space, previous.schedule, migration=migration, keys=keys).score
    found = []
    replaced = _replace_lost(previous, space, kept, free, score)
    if replaced is not None:
        moved = f"the {S - len(kept)} lost stage(s) moved to freed devices" if len(kept) < S else "no stage lost"
        found.append((*replaced, f"{moved}, layers re-balanced"))
    else:
        found.append(_fixed_ilp(previous, space, kept, free, time_limit_s, migration))
    if len(kept) < S:
        dropped = _drop_lost(previous, space, kept, candidates, score)
        if dropped is not None:
            found.append((*dropped, f"the {S - len(kept)} lost stage(s) dropped, layers cut anew over {len(kept)}"))
    found = [f for f in found if f is not None]
    return min(found, key=lambda f: score(f[3], f[0], f[1])) if found else None


def _fixed_ilp(previous: Plan, space, kept: list[int], free: Counter, time_limit_s: float, migration):
    """One ILP at the previous M over the kept groups and those that fit ``free``, the surviving
    stages' groups fixed (and, first, their layers); ``(stages, groups, M, evaluation, how)`` or None."""
    M, S = previous.microbatches, len(previous.stages)
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
        for s in kept:
            j, group = S - 1 - s, stage_group(previous.stages[s])
            if group not in sub.groups:
                return None
            sub.lp += sub.u[j, sub.groups.index(group)] == 1, f"keep_group_{s}"
            if fix_layers:
                counts = Counter(run_of[layer] for layer in previous.stages[s].layers)
                for r in range(len(sub.runs)):
                    sub.lp += sub.z[r, j] == counts.get(r, 0), f"keep_layers_{s}_{r}"
        result = solve(sub.lp, time_limit_s=time_limit_s, gap=1e-3)
        if result.has_solution:
            stages, chosen = sub.read()
            ev = evaluate(
                stages, chosen, M, table=space.table, infos=space.infos, schedule=previous.schedule, links=space.links
            )
            if ev.feasible:
                how = "surviving stages' groups " + ("and layers kept" if fix_layers else "kept, layers re-split")
                return stages, chosen, M, ev, f"{how}, the rest re-solved (ILP at M={M})"
    return None


def _lost(previous: Plan, model) -> str:
    """What the cluster lost of ``previous``'s devices, by host: "host h100-0 (8 devices)"."""
    alive = {d.ref for d in model.cluster.devices()}
    host_of = {d.ref: d.host for d in model.cluster.all_devices()}
    gone = [ref for stage in previous.stages for ref in stage.devices if ref not in alive]
    if not gone:
        return "a change in costs"
    by_host = Counter(host_of.get(ref, ref.split("/")[0]) for ref in gone)
    in_service = Counter(d.host for d in model.cluster.devices())
    parts = [
        f"host {host} ({n} device{'s' * (n > 1)})" if not in_service[host] else f"{n} device(s) of host {host}"
        for host, n in sorted(by_host.items())
    ]
    return "losing " + ", ".join(parts)


def _shape(p: Plan) -> str:
    return f"{len(p.stages)} stage(s) at M={p.microbatches}"


def replan(
    previous: Plan,
    model,
    *,
    global_batch: int | None = None,
    microbatch_candidates: tuple[int, ...] | None = None,
    max_stages: int | None = None,
    time_limit_s: float = 30.0,
    gap: float = 1e-3,
    recompute: bool = True,
    horizon_steps: int | None = 1000,
    widen: bool = True,
    certify: bool = True,
    mixed_stages: bool | None = None,
    memory_headroom: float | None = None,
    virtual_stages: bool | None = None,
) -> Plan:
    """A new plan for ``model`` (a changed cluster or changed costs), reusing ``previous``.

    Returns the cached plan for an identical request; otherwise repairs ``previous`` and
    solves the full model warm-started from the repair (module docstring), within
    ``time_limit_s`` in all; its bound and gap are the ones a cold solve proves.
    ``widen=False`` returns the repair itself when the solve-free bound certifies it within
    ``gap`` (fast: only the lost stages are re-decided), and otherwise widens by itself, so
    the plan is never worse than a cold solve's; with ``certify=False`` as well it returns the
    repair uncertified (bound 0, gap 100%: the bound prices every group at every microbatch
    count) and widens only when the repair finds none. With ``horizon_steps`` the objective
    adds the state that must move off surviving stages, amortised over that many steps
    (``_migration``); None leaves it out. ``solve_s`` of the result covers the whole re-plan;
    its first note says what was lost, how the plan changed and the predicted step time
    before and after. ``mixed_stages`` as for :func:`plan` (the executor's callers pass False).
    ``memory_headroom`` as for :func:`plan`; None keeps the previous plan's (the one its
    ``source`` records, else ``MEMORY_HEADROOM``), so a re-plan fills devices no fuller than the
    plan it replaces. ``virtual_stages`` as for :func:`plan`; None: as the previous plan (on
    when it interleaves).

    Raises:
      PlanInfeasible, PlanNotFound: as :func:`plan`, when neither the repair nor the full
        search finds a plan.
    """
    mixed_stages = SearchOptions().offers_mixed(model.cluster, mixed_stages)
    if virtual_stages is None:
        virtual_stages = previous.virtual_stages > 1
    if memory_headroom is None:
        memory_headroom = previous.source.get("memory_headroom", MEMORY_HEADROOM)
    started = time.perf_counter()
    settings = {
        "global_batch": global_batch or previous.global_batch,
        "schedule": previous.schedule,
        "microbatch_candidates": None if microbatch_candidates is None else tuple(microbatch_candidates),
        "max_stages": max_stages,
        "gap": gap,
        "recompute": recompute,
        "zero": any(stage.zero for stage in previous.stages),  # the new plan trains as the old one did
        "mixed_stages": mixed_stages,
        "memory_headroom": memory_headroom,
        "virtual_stages": virtual_stages,
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
        model,
        settings["global_batch"],
        recompute=recompute,
        zero=settings["zero"],
        mixed=mixed_stages,
        memory_headroom=memory_headroom,
    )
    candidates = microbatch_counts(settings["global_batch"], microbatch_candidates)
    ordered = sorted(candidates, key=lambda m: (m != previous.microbatches, -m))  # the previous M first
    migration = Migration.from_plan(previous, model, space.links, horizon_steps) if horizon_steps else None
    repaired = _repair(previous, model, space, ordered, max(0.2, time_limit_s / 4), migration)
    alive = {d.ref for d in model.cluster.devices()}
    S = len(previous.stages)
    prefer = [previous.stages[S - 1 - j].devices if set(previous.stages[S - 1 - j].devices) <= alive else None
              for j in range(S)]  # fmt: skip
    keys = [(layer.signature, layer.activation_bytes) for layer in model.layers]

    def repair_plan(bound: float) -> Plan:
        stages, chosen, M, ev, _ = repaired
        moved = migration.step_cost_s(stages, chosen, space.table, keys) if migration else 0.0
        # surviving stages keep their devices: at their own positions, or in order when the lost were dropped
        kept = [stage.devices for stage in previous.stages if set(stage.devices) <= alive]
        mine = prefer if len(chosen) == S else kept[::-1]
        return make_plan(
            model, space, ev, stages, chosen, M,
            schedule=previous.schedule, global_batch=settings["global_batch"], bound=bound, gap=gap,
            started=started, prefer_devices=mine, objective=ev.iteration_s + moved, interleave=virtual_stages,
        )  # fmt: skip

    lost = _lost(previous, model)
    result = how = None
    if repaired is not None and not widen:
        bound = (
            min(simple_bound_s(space.runs, space.groups, space.table, space.infos, m) for m in candidates)
            if certify
            else 0.0
        )
        candidate = repair_plan(bound)
        if not certify:
            result, how = candidate, f"repair ({repaired[4]}), uncertified"
        elif candidate.objective - bound <= gap * candidate.objective:
            result, how = candidate, f"repair ({repaired[4]}), within {gap:.2%} of the solve-free bound"
        else:
            how = f"the repair ({repaired[4]}) is {1 - bound / candidate.objective:.1%} above the solve-free bound"
    if result is None:
        remaining = max(0.2, time_limit_s - (time.perf_counter() - started))
        start = repaired[:3] if repaired else None
        why = how or ("the repair found no plan" if repaired is None else f"repair ({repaired[4]})")
        try:
            result = plan(
                model, time_limit_s=remaining, start=start, prefer_devices=prefer, migration=migration, **settings
            )
        except PlanNotFound:
            if repaired is None:
                raise
            result, how = repair_plan(0.0), f"{why}; the full search found no plan in time: the repair, uncertified"
        else:
            how = f"{why}; widened to the full search from {'it' if repaired else 'scratch'}"
            if repaired is not None:
                # the full search's bound covers the repair too; keep whichever is better
                alone = repair_plan(result.bound)
                if alone.objective < result.objective * (1 - 1e-9):
                    result = alone
    note = (
        f"re-planned after {lost}: {how}; {_shape(previous)} → {_shape(result)}, "
        f"predicted step {previous.iteration_s:.4g} s → {result.iteration_s:.4g} s"
    )
    result = dataclasses.replace(
        result, solve_s=time.perf_counter() - started, source=previous.source, notes=(note, *result.notes)
    )
    _CACHE[key] = result
    return result
