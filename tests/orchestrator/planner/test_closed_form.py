"""The closed-form step time: textbook cases, a hand-computed 1F1B cycle, and the replay."""

import pytest

from orchestrator.bench._synthetic import random_instance
from orchestrator.planner import Plan, PlanInfeasible, Stage, plan
from orchestrator.planner._closed_form import step_time
from orchestrator.simulate import compare, simulate

SETTINGS = {"global_batch": 8, "microbatch_candidates": (1, 2, 4), "max_stages": 3}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("S", "M"), [(1, 1), (2, 4), (4, 8), (3, 2)])
def test_equal_stages_without_transfers_give_the_textbook_formula(schedule, S, M):
    f, b, y, o = 1.0, 2.0, 0.5, 0.25
    closed = step_time([f] * S, [[b]] * S, [0.0] * S, [[y]] * S, [o] * S, M, schedule)
    # one layer per stage: its one bucket is ready when the last backward ends
    assert closed.step_s == pytest.approx((S + M - 1) * (f + b) + y + o)
    assert sum(closed.breakdown.values()) == pytest.approx(closed.step_s)
    assert closed.breakdown["gradient_sync_s"] == pytest.approx(y)


@pytest.mark.parametrize(
    ("backward", "sync", "exposed"),
    [
        # two layers, sync shorter than backward: only the first layer's bucket shows
        ([1.0, 1.0], [0.5, 0.5], 0.5),
        # sync longer than backward: the ring starts after the last layer's share and never idles
        ([1.0, 1.0], [1.5, 1.5], 1.0 + 3.0 - 2.0),
        # a big first layer (an embedding): its bucket is visited last and exposed whole
        ([0.5, 1.5], [2.0, 0.5], 2.0),
    ],
)
def test_gradient_sync_is_a_flow_shop_behind_the_last_backward(backward, sync, exposed):
    """Buckets in reverse layer order, each after its layer's backward share, one at a time:
    the makespan of a two-machine flow shop in a fixed order."""
    closed = step_time([1.0], [backward], [0.0], [sync], [0.0], 1, "1f1b")
    assert closed.breakdown["gradient_sync_s"] == pytest.approx(exposed)


def _two_stage_plan(schedule: str, send_s: float) -> Plan:
    stage = dict(layers=(0,), device_type="x", tp=1, dp=1, recompute=False, microbatch_size=1, memory_bytes=0.0)
    stages = (
        Stage(devices=("h/0",), time_s=3.0 + 2 * send_s, forward_s=1.0, send_s=send_s, **stage),
        Stage(devices=("h/1",), time_s=3.0, forward_s=1.0, **{**stage, "layers": (1,)}),
    )
    closed = step_time([1.0, 1.0], [[2.0], [2.0]], [send_s, 0.0], [[0.0], [0.0]], [0.0, 0.0], 4, schedule)
    return Plan(
        stages=stages, schedule=schedule, microbatches=4, global_batch=4, iteration_s=closed.step_s, breakdown={}
    )


def test_the_1f1b_in_flight_cycle_by_hand():
    """Two stages (f, b) = (1, 2) s, transfers of 1 s, M = 4. The first stage keeps 2 microbatches
    in flight; one round trip is L = 3 + 1 + 3 + 1 = 8 s, so its backward i + 2 starts 8 s after
    backward i: B1 at 6 (L − b), B2 at 9 (B1 + 3), B3 at 14, B4 at 17, done at 19 s — not the
    (S + M − 1)·(c + 2·send) = 25 s of the old accounting, nor 2·1 + 4·3 + … = 17 s of a pipeline
    that ignores the cycle."""
    closed = step_time([1.0, 1.0], [[2.0], [2.0]], [1.0, 0.0], [[0.0], [0.0]], [0.0, 0.0], 4, "1f1b")
    assert closed.backward_start_s[0] == 6.0
    assert closed.step_s == 19.0
    replay = simulate(_two_stage_plan("1f1b", 1.0))
    assert replay.iteration_s == pytest.approx(19.0)


def test_gpipe_flow_shops_by_hand():
    """Same stages under GPipe: forwards end at 1 + 1 + 1 + 3·1 = 6 s (forward pace 1 s), the
    backwards at 6 + 2 + 1 + 2 + 3·2 = 17 s."""
    closed = step_time([1.0, 1.0], [[2.0], [2.0]], [1.0, 0.0], [[0.0], [0.0]], [0.0, 0.0], 4, "gpipe")
    assert closed.forward_end_s == 6.0
    assert closed.step_s == 17.0
    assert simulate(_two_stage_plan("gpipe", 1.0)).iteration_s == pytest.approx(17.0)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_ilp_objective_is_the_closed_form_and_the_replay_agrees(schedule):
    """On random chains (2 device types, links priced, DP sync and optimizer): the ILP's optimum
    equals enumeration under the closed form (1F1B: also ``test_exact``), and the event replay is
    within 5% of it."""
    from orchestrator.planner.baselines import exhaustive_plan

    checked, worst = 0, 0.0
    for seed in range(10):
        model = random_instance(seed)
        try:
            found = plan(model, time_limit_s=20, gap=1e-6, schedule=schedule, **SETTINGS)
        except PlanInfeasible:
            continue
        if schedule == "gpipe":
            truth = exhaustive_plan(model, schedule=schedule, **SETTINGS)
            assert found.iteration_s == pytest.approx(truth.iteration_s, rel=1e-3), f"seed {seed}"
        *_, rel = compare(found, model)
        worst = max(worst, abs(rel))
        checked += 1
    print(f"{schedule}: {checked} plans, largest |simulated / closed − 1| = {worst:.3%}")
    assert checked >= 8
    assert worst <= 0.05
