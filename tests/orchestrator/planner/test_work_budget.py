"""The search budgeted by counted work: the same plan and gap beside a competing CPU-bound process,
the per-group transfer floors its bounds read never above a real transfer, and the bounds that use
them never above a plan they bound; a cheap preset certified within 1%."""

import itertools
import math
import random
import subprocess
import sys

import pytest

from orchestrator.bench._synthetic import SyntheticCosts, SyntheticLayer, random_instance, synthetic_cluster
from orchestrator.planner import plan
from orchestrator.planner._evaluate import evaluate
from orchestrator.planner._ilp import transfer_floors_s
from orchestrator.planner._packing import PackingBound
from orchestrator.planner._paths import StageColumns
from orchestrator.planner._space import search_space
from orchestrator.planner.baselines._exhaustive import _partitions
from orchestrator.solver import work

BATCH = 8


def _wide_instance(seed: int) -> SyntheticCosts:
    """Two types on two hosts of four devices each, over a slow network: groups of 1 to 8 devices,
    whose transfers differ by up to eight times."""
    chain = random_instance(seed)
    layers = [
        SyntheticLayer(l.flops, l.param_bytes, l.activation_per_sample, l.output_per_sample * 40) for l in chain.layers
    ]
    cluster = synthetic_cluster({"fast": (40.0, 64.0), "slow": (10.0, 32.0)}, hosts_per_type=2, per_host=4,
                                network_gbps=1.0)  # fmt: skip
    return SyntheticCosts(layers[:4], cluster)


def _plans(space, M: int, S: int):
    valid = [g for g in space.groups if space.table.microbatch(g, M) is not None]
    for stages in _partitions(space.layers, S):
        for chosen in itertools.product(valid, repeat=S):
            yield list(stages), list(chosen)


def test_every_transfer_is_at_least_both_sides_floors():
    space = search_space(_wide_instance(0), BATCH, recompute=False)
    M = 2
    groups = [g for g in space.groups if space.table.microbatch(g, M) is not None]
    send, receive = transfer_floors_s(space.runs, groups, space.table, space.links, M)
    run_of = {layer: r for r, run in enumerate(space.runs) for layer in range(run.first, run.first + run.count)}
    checked = narrow = 0
    for stages, chosen in _plans(space, M, 2):
        ev = evaluate(stages, chosen, M, table=space.table, infos=space.infos, schedule="1f1b", links=space.links)
        r, g, g2 = run_of[stages[0][-1]], groups.index(chosen[0]), groups.index(chosen[1])
        assert ev.stage_send_s[0] >= max(send[r, g], receive[r, g2]) * (1 - 1e-12)
        checked += 1
        narrow += send[r, g] > send[r].min() * 2  # a narrow sender pays more than the widest group
    assert checked > 100 and narrow > 0


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_column_and_packing_bounds_stay_below_every_plan_on_wide_groups(schedule):
    compared = 0
    for seed in range(3):
        space = search_space(_wide_instance(seed), BATCH, recompute=False)
        for M in (1, 4):
            groups = [g for g in space.groups if space.table.microbatch(g, M) is not None]
            columns = StageColumns(space, groups, microbatches=M, schedule=schedule)
            for S in (2, 3):
                least = math.inf
                for stages, chosen in _plans(space, M, S):
                    ev = evaluate(
                        stages, chosen, M, table=space.table, infos=space.infos, schedule=schedule, links=space.links
                    )
                    if ev.feasible:
                        least = min(least, ev.iteration_s)
                if least == math.inf:
                    continue
                assert columns.bound_s(S) <= least * (1 + 1e-6), f"seed {seed}, M={M}, S={S}"
                exact, _, decided = columns.integer_bound_s(S, cutoff_s=least * 1.001, time_limit_s=math.inf)
                assert decided and exact <= least * (1 + 1e-6)
                packing = PackingBound(space, groups, microbatches=M, max_stages=S, schedule=schedule)
                assert packing.bound_s(S) <= least * (1 + 1e-6)
                compared += 1
    assert compared >= 6


def test_the_planners_bound_is_below_every_priced_plan_on_wide_groups():
    for seed in range(3):
        space_model = _wide_instance(seed)
        found = plan(space_model, global_batch=BATCH, microbatch_candidates=(1, 2, 4), max_stages=3, gap=1e-6)
        space = search_space(space_model, BATCH, recompute=True)
        for M in (1, 2, 4):
            for S in (1, 2):
                for stages, chosen in _plans(space, M, S):
                    ev = evaluate(
                        stages, chosen, M, table=space.table, infos=space.infos, schedule="1f1b", links=space.links
                    )
                    assert not ev.feasible or found.bound <= ev.iteration_s * (1 + 1e-6)


def test_limits_are_work_only_inside_a_budget():
    assert work.limits(1.0) == {} and not work.counting()
    with work.work_budget():
        before = work.now()
        work.charge(0.25)
        assert work.now() - before == pytest.approx(0.25)
        assert work.limits(1.0)["mip_max_nodes"] >= 1
        assert work.wall_limit_s(1.0) > 1.0
    assert not work.counting()


def _key(found):
    return (
        found.iteration_s,
        found.bound,
        found.gap,
        found.microbatches,
        [(tuple(s.layers), s.device_type, s.tp, s.dp, s.recompute) for s in found.stages],
    )


def _deep_instance() -> SyntheticCosts:
    """Ten distinct layers on three types of two hosts each, over a slow network: a search whose
    budget ends it early at 0.8 s of work (its first plan, gap unproven), and which closes within 2 s."""
    rng = random.Random(3)
    layers = [
        SyntheticLayer(rng.uniform(1, 8) * 1e12, rng.uniform(0.2, 4) * 1e9, rng.uniform(0.05, 1) * 1e9,
                       rng.uniform(0.4, 8) * 1e9)
        for _ in range(10)
    ]  # fmt: skip
    types = {"fast": (40.0, 64.0), "slow": (10.0, 32.0), "mid": (20.0, 16.0)}
    return SyntheticCosts(layers, synthetic_cluster(types, hosts_per_type=2, per_host=4, network_gbps=1.0))


@pytest.mark.parametrize("budget_s", [0.8, 2.0])
def test_the_same_input_gives_the_same_plan_and_gap_beside_busy_processes(budget_s):
    """Planned alone, then beside two processes that keep every core busy: the budget is work, so
    the search takes the same steps and ends at the same point (exact equality, no tolerance)."""
    model = _deep_instance()
    settings = {"global_batch": 32, "max_stages": 6, "gap": 1e-9, "time_limit_s": budget_s}
    quiet = _key(plan(model, **settings))
    assert (quiet[2] > 1e-3) == (budget_s < 1.0)  # the small budget ends the search, the large one lets it close
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        loaded = _key(plan(model, **settings))
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert loaded == quiet


def test_a_cheap_preset_is_certified_within_one_percent():
    from orchestrator.bench._planner import captured_model

    model = captured_model("gpt2-small", "mixed-a100-v100", 1024)
    found = plan(model, global_batch=64, gap=1e-2)
    assert found.gap <= 1e-2 + 1e-9 and found.bound <= found.iteration_s
