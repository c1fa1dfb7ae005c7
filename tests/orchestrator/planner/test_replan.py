"""Re-planning: cache hits, repair of a plan after a host is lost, warm solve equal to a cold one."""

import dataclasses

import pytest

from orchestrator.bench._synthetic import SyntheticCosts, SyntheticLayer, synthetic_cluster
from orchestrator.planner import cached_plan, plan, replan

BLOCK = SyntheticLayer(flops=4e12, param_bytes=2e9, activation_per_sample=0.5e9, output_per_sample=0.05e9)
SETTINGS = {"global_batch": 16, "microbatch_candidates": (1, 2, 4, 8), "max_stages": 4}
# the migration tests follow stages of one type (what the executor runs, and the Replanner re-plans);
# on the two-type model below the optimum would otherwise be one stage over both types
ONE_TYPE = {**SETTINGS, "mixed_stages": False}


def _without_host(model, host):
    cluster = model.cluster
    gone = frozenset(d.ref for d in cluster.devices() if d.host == host)
    return SyntheticCosts(model.layers, dataclasses.replace(cluster, unavailable=cluster.unavailable | gone))


def test_identical_requests_hit_the_cache(monkeypatch):
    from orchestrator.planner import _replan

    model = SyntheticCosts([BLOCK] * 6, synthetic_cluster({"a": (20.0, 40.0)}, hosts_per_type=2, per_host=2))
    first = cached_plan(model, time_limit_s=20, **SETTINGS)

    def no_solve(*args, **kwargs):
        raise AssertionError("an identical request was solved again")

    monkeypatch.setattr(_replan, "plan", no_solve)
    assert cached_plan(model, time_limit_s=20, **SETTINGS) is first


def test_replan_after_losing_a_host_matches_a_cold_solve():
    model = SyntheticCosts(
        [BLOCK] * 6, synthetic_cluster({"fast": (40.0, 40.0), "slow": (20.0, 40.0)}, hosts_per_type=2, per_host=2)
    )
    before = plan(model, time_limit_s=30, gap=1e-6, **SETTINGS)
    lost = next(s.devices[0] for s in before.stages).split("/")[0]
    after = _without_host(model, lost)
    cold = plan(after, time_limit_s=30, gap=1e-6, **SETTINGS)
    warm = replan(
        before, after, time_limit_s=30, gap=1e-6, **{k: v for k, v in SETTINGS.items() if k != "global_batch"}
    )
    assert warm.iteration_s == pytest.approx(cold.iteration_s, rel=1e-6)
    alive = {d.ref for d in after.cluster.devices()}
    assert all(d in alive for s in warm.stages for d in s.devices)
    # a stage that survived with an unchanged group keeps its devices
    kept = {s.devices for s in before.stages if set(s.devices) <= alive}
    same_groups = [s for s in warm.stages if any(len(k) == len(s.devices) for k in kept)]
    assert not same_groups or any(s.devices in kept for s in same_groups)
    assert (
        replan(before, after, time_limit_s=30, gap=1e-6, **{k: v for k, v in SETTINGS.items() if k != "global_batch"})
        is warm
    )


def test_out_of_time_without_a_plan_is_not_called_infeasible():
    from orchestrator.planner import PlanInfeasible, PlanNotFound

    model = SyntheticCosts([BLOCK] * 6, synthetic_cluster({"a": (20.0, 40.0)}, hosts_per_type=2, per_host=2))
    with pytest.raises(PlanNotFound, match="raise time_limit_s"):
        plan(model, time_limit_s=1e-4, **SETTINGS)
    assert not issubclass(PlanNotFound, PlanInfeasible)
    assert plan(model, time_limit_s=30, **SETTINGS).iteration_s > 0  # the same request has a plan


def _two_type_model():
    return SyntheticCosts(
        [BLOCK] * 6, synthetic_cluster({"fast": (40.0, 40.0), "slow": (20.0, 40.0)}, hosts_per_type=2, per_host=2)
    )


def _kept_layers_moved(before, after_plan, alive) -> int:
    """Layers of surviving stages that no longer sit on the same devices."""
    where = {layer: stage.devices for stage in after_plan.stages for layer in stage.layers}
    return sum(
        where[layer] != stage.devices
        for stage in before.stages
        if set(stage.devices) <= alive
        for layer in stage.layers
    )


def test_migration_term_keeps_surviving_state_in_place_when_moving_costs_more_than_it_gains():
    model = _two_type_model()
    before = plan(model, time_limit_s=30, gap=1e-6, **ONE_TYPE)
    lost = before.stages[0].devices[0].split("/")[0]
    after = _without_host(model, lost)
    alive = {d.ref for d in after.cluster.devices()}
    settings = {k: v for k, v in ONE_TYPE.items() if k != "global_batch"}
    free = replan(before, after, time_limit_s=30, gap=1e-6, horizon_steps=None, **settings)
    sticky = replan(before, after, time_limit_s=30, gap=1e-6, horizon_steps=1, **settings)
    assert _kept_layers_moved(before, free, alive) > 0  # without the term the optimum moves state
    # amortised over one step, moving a 2 GB layer (plus optimizer state) costs more than any gain
    assert _kept_layers_moved(before, sticky, alive) == 0
    assert sticky.objective >= sticky.iteration_s
    assert sticky.iteration_s >= free.iteration_s * (1 - 1e-9)
    # amortised over very many steps the term vanishes and the step time is the free optimum's
    patient = replan(before, after, time_limit_s=30, gap=1e-6, horizon_steps=10**9, **settings)
    assert patient.iteration_s == pytest.approx(free.iteration_s, rel=1e-6)


def test_fast_repair_re_decides_only_the_lost_stage():
    model = _two_type_model()
    before = plan(model, time_limit_s=30, gap=1e-6, **ONE_TYPE)
    lost = before.stages[-1].devices[0].split("/")[0]
    after = _without_host(model, lost)
    alive = {d.ref for d in after.cluster.devices()}
    settings = {k: v for k, v in ONE_TYPE.items() if k != "global_batch"}
    # uncertified, the repair comes back as found
    repaired = replan(before, after, time_limit_s=30, widen=False, certify=False, **settings)
    assert all(d in alive for s in repaired.stages for d in s.devices)
    assert _kept_layers_moved(before, repaired, alive) == 0
    assert "uncertified" in repaired.notes[0]
    cold = plan(after, time_limit_s=30, gap=1e-6, **ONE_TYPE)
    assert repaired.iteration_s >= cold.iteration_s * (1 - 1e-9)
    # certified, the bound of what comes back is a true lower bound and its gap holds
    certified = replan(before, after, time_limit_s=30, widen=False, horizon_steps=None, **settings)
    assert certified.bound <= cold.iteration_s * (1 + 1e-9)
    assert certified.iteration_s <= cold.iteration_s * (1 + 1e-3)


def test_fast_repair_stands_without_a_full_search_when_the_solve_free_bound_certifies_it():
    model = _two_type_model()
    before = plan(model, time_limit_s=30, gap=1e-6, **ONE_TYPE)
    after = _without_host(model, before.stages[-1].devices[0].split("/")[0])
    settings = {k: v for k, v in ONE_TYPE.items() if k != "global_batch"}
    uncertified = replan(before, after, time_limit_s=30, widen=False, certify=False, horizon_steps=None, **settings)
    # a gap loose enough for the capacity bound: the repair is certified as it is
    loose = replan(before, after, time_limit_s=30, widen=False, horizon_steps=None, gap=0.9, **settings)
    assert "of the solve-free bound" in loose.notes[0] and "widened" not in loose.notes[0]
    assert [s.layers for s in loose.stages] == [s.layers for s in uncertified.stages]
    assert 0 < loose.bound <= loose.iteration_s and loose.gap <= 0.9
    cold = plan(after, time_limit_s=30, gap=1e-6, **ONE_TYPE)
    assert loose.bound <= cold.iteration_s * (1 + 1e-9)
