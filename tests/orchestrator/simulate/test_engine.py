"""The simulator on hand-built plans: textbook pipeline answers, the closed form's own accounting, contention."""

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.planner import Plan, Stage
from orchestrator.simulate import simulate, stage_order
from orchestrator.simulate._schedule import peak_in_flight

COMPUTE = ("forward", "backward", "optimizer")


def _stage(device: str, *, f: float, b: float, send: float = 0.0, sync: float = 0.0, opt: float = 0.0, **kw) -> Stage:
    return Stage(
        layers=kw.pop("layers", (0,)),
        device_type="x",
        devices=(device,),
        tp=1,
        dp=1,
        recompute=False,
        microbatch_size=1,
        time_s=f + b + 2 * send,
        forward_s=f,
        send_s=send,
        dp_sync_s=sync,
        optimizer_s=opt,
        memory_bytes=0.0,
        **kw,
    )


def closed_form(stages, M: int) -> float:
    """The planner's formula: Σ t_s + (M − 1)·max t_s + max sync + max optimizer."""
    t = [s.time_s for s in stages]
    return sum(t) + (M - 1) * max(t) + max(s.dp_sync_s for s in stages) + max(s.optimizer_s for s in stages)


def _plan(stages, M: int, schedule: str) -> Plan:
    stages = tuple(stages)
    return Plan(stages=stages, schedule=schedule, microbatches=M, global_batch=M, iteration_s=closed_form(stages, M))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_equal_stages_four_microbatches_textbook(schedule):
    f, b, S, M = 1.0, 2.0, 2, 4
    timeline = simulate(_plan([_stage(f"h/{s}", f=f, b=b) for s in range(S)], M, schedule))
    assert timeline.iteration_s == (M + S - 1) * (f + b)  # 15 s, exactly
    assert timeline.bubble_fraction == (S - 1) / (M + S - 1)  # 0.2, exactly
    for stats in timeline.stage_stats:
        assert stats.busy_s == M * (f + b)
        assert stats.bubble_s == (S - 1) * (f + b)
    in_flight = [s.peak_in_flight for s in timeline.stage_stats]
    assert in_flight == ([M] * S if schedule == "gpipe" else [min(M, S - s) for s in range(S)])


@pytest.mark.parametrize(("schedule", "S", "M"), list(itertools.product(["gpipe", "1f1b"], [1, 3, 4], [1, 2, 8])))
def test_equal_stages_match_textbook_for_any_depth(schedule, S, M):
    f, b = 0.25, 0.5
    timeline = simulate(_plan([_stage(f"h{s}/0", f=f, b=b) for s in range(S)], M, schedule))
    assert timeline.iteration_s == pytest.approx((M + S - 1) * (f + b), rel=1e-12)
    assert timeline.bubble_fraction == pytest.approx((S - 1) / (M + S - 1), rel=1e-12, abs=1e-12)
    expected = [M if schedule == "gpipe" else min(M, S - s) for s in range(S)]
    assert [s.peak_in_flight for s in timeline.stage_stats] == expected


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_closed_form_accounting_reproduces_the_closed_form(schedule):
    """Transfers holding the stream and sync after the drain: the planner's own formula, for equal stages.

    Equal means equal per phase: stage 0's forward + send equals stage 1's forward, and likewise backward.
    """
    f, b, send, M = 1.0, 1.5, 0.25, 4
    stages = [_stage("a/0", f=f, b=b, send=send, sync=0.5, opt=0.125), _stage("b/0", f=f + send, b=b + send)]
    plan = _plan(stages, M, schedule)
    timeline = simulate(plan, overlap_p2p=False, overlap_dp_sync=False)
    assert timeline.iteration_s == pytest.approx(plan.iteration_s, rel=1e-12)
    # overlapped transfers leave stage 0's stream; here stage 1 (f + b = t) stays the bottleneck
    overlapped = simulate(plan)
    assert timeline.stage_stats[0].busy_s == M * stages[0].time_s + 0.125
    assert overlapped.stage_stats[0].busy_s == M * (f + b) + 0.125
    assert overlapped.iteration_s == timeline.iteration_s


def test_two_messages_on_one_link_share_it():
    # forwards take no time: both activations leave at t = 0 on one link and each moves at half speed
    stages = [_stage("a/0", f=0.0, b=1.0, send=1.0), _stage("b/0", f=1.0, b=1.0)]
    timeline = simulate(_plan(stages, 2, "gpipe"))
    sends = [e for e in timeline.events if e.kind == "send_activation"]
    assert [(e.microbatch, e.start_s, e.end_s) for e in sends] == [(0, 0.0, 2.0), (1, 0.0, 2.0)]
    link = next(x for x in timeline.link_stats if x.name == "a→b")
    assert (link.busy_s, link.contended_s, link.peak_messages) == (2.0, 2.0, 2)
    forward = next(e for e in timeline.events if e.kind == "forward" and e.stage == 1 and e.microbatch == 0)
    assert forward.start_s == 2.0  # without contention it would start at 1.0


def test_transfers_on_different_links_do_not_share():
    stages = [_stage("a/0", f=0.0, b=1.0, send=1.0), _stage("b/0", f=0.0, b=1.0, send=1.0), _stage("c/0", f=1, b=1)]
    timeline = simulate(_plan(stages, 1, "1f1b"))
    assert {x.name: x.peak_messages for x in timeline.link_stats} == {"a→b": 1, "b→c": 1, "b→a": 1, "c→b": 1}


def test_gradient_sync_overlaps_other_stages_but_follows_its_own_backward():
    stages = [_stage("a/0", f=1.0, b=1.0, sync=3.0), _stage("b/0", f=1.0, b=1.0, sync=3.0)]
    plan = _plan(stages, 2, "1f1b")
    overlapped, after = simulate(plan), simulate(plan, overlap_dp_sync=False)
    last_backward = {
        s: max(e.end_s for e in overlapped.events if e.kind == "backward" and e.stage == s) for s in range(2)
    }
    syncs = {e.stage: e for e in overlapped.events if e.kind == "dp_sync"}
    assert syncs[0].start_s == last_backward[0] and syncs[1].start_s == last_backward[1]
    assert syncs[1].start_s < last_backward[0]  # the last stage syncs while stage 0 still computes
    assert after.iteration_s == after.pipeline_s + 3.0 and overlapped.iteration_s == after.iteration_s
    assert all(e.start_s == after.pipeline_s for e in after.events if e.kind == "dp_sync")


def test_every_step_runs_once_in_dependency_order():
    stages = [_stage(f"h{s}/0", f=0.5 + s, b=1.0 + 0.5 * s, send=0.1 * (s < 2)) for s in range(3)]
    timeline = simulate(_plan(stages, 5, "1f1b"))
    compute = [(e.stage, e.microbatch, e.kind) for e in timeline.events if e.kind in ("forward", "backward")]
    assert sorted(compute) == sorted(itertools.product(range(3), range(5), ["forward", "backward"]))
    at = {(e.stage, e.microbatch, e.kind): e for e in timeline.events if e.microbatch is not None}
    for s, i in itertools.product(range(3), range(5)):
        if s > 0:
            assert at[(s, i, "forward")].start_s >= at[(s - 1, i, "send_activation")].end_s
            assert at[(s - 1, i, "send_activation")].start_s >= at[(s - 1, i, "forward")].end_s
        if s < 2:
            assert at[(s, i, "backward")].start_s >= at[(s, i, "send_gradient")].end_s
            assert at[(s, i, "send_gradient")].start_s >= at[(s + 1, i, "backward")].end_s
    for s in range(3):  # one stream per stage: no two compute steps overlap
        mine = sorted((e.start_s, e.end_s) for e in timeline.events if e.stage == s and e.kind in COMPUTE)
        assert all(a[1] <= b[0] + 1e-12 for a, b in itertools.pairwise(mine))


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(["gpipe", "1f1b"]),
    st.lists(st.tuples(st.floats(0.1, 4), st.floats(0.1, 4), st.floats(0, 1)), min_size=1, max_size=5),
    st.integers(1, 8),
)
def test_simulated_time_is_bounded_by_work_and_critical_path(schedule, times, M):
    stages = [_stage(f"h{s}/0", f=f, b=b, send=c if s < len(times) - 1 else 0.0) for s, (f, b, c) in enumerate(times)]
    plan = _plan(stages, M, schedule)
    timeline = simulate(plan)
    # no faster than the busiest stage's work, nor than one microbatch's path through every stage
    busiest = max(M * (x.forward_s + x.time_s - x.forward_s - 2 * x.send_s) for x in stages)
    path = sum(x.time_s for x in stages)
    assert timeline.iteration_s >= max(busiest, path) * (1 - 1e-9)
    # holding the stream for transfers (one host per stage: no contention) costs each stage exactly M·t_s
    held = simulate(plan, overlap_p2p=False)
    for stats, x in zip(held.stage_stats, stages):
        assert stats.busy_s == pytest.approx(M * x.time_s, rel=1e-9)
    for stats, steps in zip(
        timeline.stage_stats, (stage_order(schedule, len(stages), M, s) for s in range(len(stages)))
    ):
        assert stats.peak_in_flight == peak_in_flight(steps)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"time_s": 0.5}, "time_s 0.5 < forward_s"),
        ({"devices": ("h/0", "h/1")}, "lists 2 devices but tp·dp = 1·1"),
        ({"devices": ("host0",)}, "without 'host/index'"),
    ],
)
def test_inconsistent_plans_are_named(change, message):
    stage = _stage("h/0", f=1.0, b=1.0)
    bad = dataclasses.replace(stage, **change)
    with pytest.raises(ValueError, match=message):
        simulate(_plan([bad], 1, "1f1b"))
    with pytest.raises(ValueError, match="schedule must be"):
        stage_order("interleaved", 2, 2, 0)
