"""The search budgeted by counted work: the same plan and gap beside a competing CPU-bound process,
the per-group transfer floors its bounds read never above a real transfer, and the bounds that use
them never above a plan they bound; a cheap preset certified within 1%."""

import functools
import itertools
import math
import random
import subprocess
import sys

import pytest

from orchestrator.bench._synthetic import SyntheticCosts, SyntheticLayer, random_instance, synthetic_cluster
from orchestrator.planner import plan
from orchestrator.planner._evaluate import evaluate, summary_cache
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
            summary = summary_cache()
            for S in (2, 3):
                least = math.inf
                for stages, chosen in _plans(space, M, S):
                    ev = evaluate(
                        stages,
                        chosen,
                        M,
                        table=space.table,
                        infos=space.infos,
                        schedule=schedule,
                        links=space.links,
                        summarize=summary,
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


def test_a_lane_reads_its_own_work_and_is_folded_into_the_clock_in_start_order():
    from concurrent.futures import ThreadPoolExecutor

    with work.work_budget():
        work.charge(1.0)
        lanes = [work.lane(), work.lane()]

        def job(seconds: float) -> float:
            work.charge(seconds)
            return work.now()

        with ThreadPoolExecutor(2) as pool:
            seen = [
                pool.submit(work.counted_on, lane, functools.partial(job, s)).result()
                for lane, s in zip(lanes, (0.5, 0.25))
            ]
        assert seen == [1.5, 1.25] and work.now() == 1.0  # (each lane from the wave's start; the clock waits)
        work.fold(lanes)
        assert work.now() == 1.75
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


def _column_search(delay_first: bool):
    """``column_bounds`` of the deep instance under a work budget, from its slowest one-stage plan,
    with the plans of every first MIP of a wave offered late (``delay_first``) or of every second:
    the bounds, the incumbent, the work counted, the most MIPs seen running at once, the start's
    step time and the plans offered."""
    import threading
    import time

    from orchestrator.planner import _paths
    from orchestrator.planner._bounds import column_bounds
    from orchestrator.planner._incumbent import Best, Incumbent
    from orchestrator.planner._options import SearchOptions
    from orchestrator.planner._scope import Scope

    space = search_space(_deep_instance(), 32, recompute=False)
    candidates = [32, 16, 8, 4, 2, 1]
    best = Best(space, "1f1b", migration=None, keys=[])
    one_stage = [list(range(space.layers))]
    fitting = [
        (ev, g, M)
        for M in candidates
        for g in space.groups
        if space.table.microbatch(g, M) is not None and (ev := best.evaluate(one_stage, [g], M)).feasible
    ]
    ev, group, M = max(fitting, key=lambda plan: plan[0].iteration_s)
    best.keep(Incumbent(ev.iteration_s, ev, one_stage, [group], M))
    scope = Scope(space=space, candidates=candidates, max_stages=6, gap=1e-9, options=SearchOptions())
    real = _paths.StageColumns.integer_bound_s
    running, most, lock, calls, offered = [0], [0], threading.Lock(), [0], [0]

    def watched(self, stages, **settings):
        with lock:
            calls[0] += 1
            running[0] += 1
            most[0] = max(most[0], running[0])
            first = calls[0] % 2 == 1
        price, pause = settings.pop("price"), 0.05 if first == delay_first else 0.0

        def slowed(*plan):  # (which solve of a wave offers its plans first)
            time.sleep(pause)
            offered[0] += 1
            return price(*plan)

        try:
            return real(self, stages, price=slowed, **settings)
        finally:
            with lock:
                running[0] -= 1

    _paths.StageColumns.integer_bound_s = watched
    try:
        with work.work_budget():
            found = column_bounds(scope, best, deadline=work.now() + 30.0)
            spent = work.now()
    finally:
        _paths.StageColumns.integer_bound_s = real
    current = best.current
    incumbent = (current.score, current.microbatches, current.stages, list(current.groups))
    return found, incumbent, spent, most[0], ev.iteration_s, offered[0]


def test_the_column_mips_run_two_at_once_and_take_the_same_steps_whichever_ends_first():
    """Counting work, the column solves run in waves of two, each on a lane of the clock and
    offering its plans to a fork of the incumbent: delaying the first or the second solve of every
    wave changes which ends first, and nothing else — the bounds, the incumbent and the work counted
    are equal (exactly), and the MIPs did improve on the start. (Offering to the incumbent itself,
    the solve that offers second reads the first's cutoff, and the bounds differ.)"""
    early, late = _column_search(delay_first=False), _column_search(delay_first=True)
    assert early[:3] == late[:3] and early[5] == late[5] > 0
    assert early[3] == late[3] == 2  # (two MIPs at once)
    assert early[1][0] < early[4]  # (their plans reached the incumbent)
