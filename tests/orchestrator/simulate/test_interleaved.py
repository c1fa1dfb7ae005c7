"""Interleaved 1F1B (virtual stages): Megatron-LM's order, the textbook bubble, and the closed form
as a lower bound on the event replay for v = 1, 2, 4 on uneven stages."""

import random

import pytest

from orchestrator.planner import Plan, Stage
from orchestrator.planner._closed_form import interleaved_in_flight, step_time
from orchestrator.simulate import chunk_order, simulate, stage_order
from orchestrator.simulate._schedule import peak_in_flight


def _stage(s: int, f: float, b: float, send: float = 0.0, sync: float = 0.0, opt: float = 0.0) -> Stage:
    return Stage(
        layers=(s,),
        device_type="x",
        devices=(f"h{s}/0",),
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
    )


def _closed_and_replayed(f, b, send, M, v, sync=None, opt=None):
    """(closed form, event replay) of stages with forward f[s], backward b[s]; ``send[-1]`` is the
    wrap from the last stage to the first (used only with v > 1)."""
    S = len(f)
    sync, opt = sync or [0.0] * S, opt or [0.0] * S
    send = [*send[:-1], send[-1] if v > 1 else 0.0]
    closed = step_time(f, [[x] for x in b], send, [[y] for y in sync], opt, M, "1f1b", v)
    stages = tuple(_stage(s, f[s], b[s], send[s], sync[s], opt[s]) for s in range(S))
    plan = Plan(
        stages=stages, schedule="1f1b", microbatches=M, global_batch=M, iteration_s=closed.step_s, virtual_stages=v
    )
    return closed, simulate(plan)


@pytest.mark.parametrize(("S", "M"), [(2, 2), (2, 4), (4, 4), (4, 8), (3, 9)])
def test_each_chunk_of_each_microbatch_runs_forward_then_backward_once(S, M):
    for v in (1, 2, 4):
        for s in range(S):
            steps = chunk_order("1f1b", S, M, s, v)
            assert sorted(steps) == sorted(
                (p, i, c) for p in ("forward", "backward") for i in range(M) for c in range(v)
            )
            done = {(i, c) for p, i, c in steps if p == "forward"}
            seen: set = set()
            for phase, i, c in steps:
                if phase == "forward":
                    seen.add((i, c))
                else:
                    assert (i, c) in seen
            assert done == {(i, c) for i in range(M) for c in range(v)}
            # Megatron-LM's warm-up: min(2(S − s − 1) + (v − 1)·S, v·M) forwards, then 1F1B
            warm = min(2 * (S - s - 1) + (v - 1) * S, v * M) if v > 1 else min(S - s - 1, M)
            assert [p for p, *_ in steps[:warm]] == ["forward"] * warm
            if v > 1:
                assert peak_in_flight(steps) == round(interleaved_in_flight(M, S, s, v) * v)
        assert chunk_order("1f1b", S, M, 0, 1) == [(p, i, 0) for p, i in stage_order("1f1b", S, M, 0)]


def test_virtual_stages_need_1f1b_and_microbatches_divisible_by_the_stages():
    with pytest.raises(ValueError, match="1f1b"):
        chunk_order("gpipe", 2, 4, 0, 2)
    with pytest.raises(ValueError, match="divisible"):
        chunk_order("1f1b", 4, 6, 0, 2)
    with pytest.raises(ValueError, match="divisible"):
        step_time([1.0] * 4, [[1.0]] * 4, [0.0] * 4, [[0.0]] * 4, [0.0] * 4, 6, "1f1b", 2)


@pytest.mark.parametrize(("S", "M"), [(2, 2), (2, 4), (4, 4), (4, 8), (3, 6)])
@pytest.mark.parametrize("v", [1, 2, 4])
def test_equal_stages_without_transfers_give_the_interleaved_textbook(S, M, v):
    """Narayanan et al. 2021, §2.2.2: the bubble is (S − 1)·c / v, so the step is M·c + (S − 1)·c / v;
    the closed form and the replay both give it."""
    f, b = 1.0, 2.0
    closed, replay = _closed_and_replayed([f] * S, [b] * S, [0.0] * S, M, v)
    textbook = M * (f + b) + (S - 1) * (f + b) / v
    assert closed.step_s == pytest.approx(textbook, rel=1e-12)
    assert replay.iteration_s == pytest.approx(textbook, rel=1e-12)
    assert sum(closed.breakdown.values()) == pytest.approx(closed.step_s)
    peaks = [s.peak_in_flight for s in replay.stage_stats]
    expected = (
        [min(M, S - s) for s in range(S)]
        if v == 1
        else [round(interleaved_in_flight(M, S, s, v) * v) for s in range(S)]
    )
    assert peaks == expected


def test_two_stages_two_chunks_by_hand():
    """S = 2, v = 2, M = 2, f = 1 and b = 2 s per stage (0.5 and 1 s per chunk), transfers of 0.25 s.
    Microbatch 0 goes round the four virtual stages: 4 · 0.5 forward + 4 · 1 backward + 2 · 3 · 0.25
    transfers = 7.5 s; stage 0's warm-up is its 2·(2 − 0 − 1) + 2 = 4 forwards."""
    closed, replay = _closed_and_replayed([1.0, 1.0], [2.0, 2.0], [0.25, 0.25], 2, 2)
    assert closed.breakdown["fill_drain_s"] == pytest.approx(7.5)
    assert closed.step_s <= replay.iteration_s + 1e-12
    assert chunk_order("1f1b", 2, 2, 0, 2)[:5] == [
        ("forward", 0, 0), ("forward", 1, 0), ("forward", 0, 1), ("forward", 1, 1), ("backward", 0, 1)
    ]  # fmt: skip


@pytest.mark.parametrize("v", [1, 2, 4])
@pytest.mark.parametrize("transfers", [False, True])
def test_the_closed_form_bounds_the_replay_on_uneven_stages(v, transfers):
    """Stages up to 4× apart, with or without transfers, gradient sync and optimizer: every row is a
    path of the schedule, so the closed form never exceeds the replay; it stays within 10% of it."""
    rng = random.Random(v * 10 + transfers)
    worst = 0.0
    for _ in range(40):
        S = rng.choice([2, 3, 4])
        M = S * rng.choice([1, 2, 3])
        f = [rng.uniform(0.5, 2.0) for _ in range(S)]
        b = [2 * x * rng.uniform(0.8, 1.2) for x in f]
        send = [rng.uniform(0.0, 0.2) if transfers else 0.0 for _ in range(S)]
        sync = [rng.uniform(0.0, 1.0) for _ in range(S)]
        opt = [rng.uniform(0.0, 0.3) for _ in range(S)]
        closed, replay = _closed_and_replayed(f, b, send, M, v, sync, opt)
        assert closed.step_s <= replay.iteration_s * (1 + 1e-12), (S, M, f, b, send)
        worst = max(worst, replay.iteration_s / closed.step_s - 1)
    print(f"v = {v}, transfers {transfers}: largest replay / closed − 1 = {worst:.2%}")
    assert worst <= 0.10


def test_one_virtual_stage_is_plain_1f1b():
    """v = 1 takes the plain rows: the hand-computed 1F1B cycle of ``test_closed_form`` (19 s)."""
    args = ([1.0, 1.0], [[2.0], [2.0]], [1.0, 0.0], [[0.0], [0.0]], [0.0, 0.0], 4, "1f1b")
    assert step_time(*args, 1) == step_time(*args)
    assert step_time(*args, 1).step_s == 19.0


def test_interleaving_trades_bubble_for_transfers():
    """Equal stages with transfers: more chunks shrink the bubble, but each microbatch crosses every
    link v times, so once transfers dominate more chunks are slower."""
    f, b, S, M = 1.0, 2.0, 4, 8
    cheap = [_closed_and_replayed([f] * S, [b] * S, [0.01] * S, M, v)[0].step_s for v in (1, 2, 4)]
    assert cheap[0] > cheap[1] > cheap[2]
    dear = [_closed_and_replayed([f] * S, [b] * S, [2.0] * S, M, v)[0].step_s for v in (1, 2, 4)]
    assert dear[0] < dear[1] < dear[2]
