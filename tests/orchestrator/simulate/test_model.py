"""The simulator with the cost model: real plans, bytes on links, per-layer gradient sync, memory in bytes."""

import itertools

import pytest

from orchestrator.simulate import compare, simulate
from tests.orchestrator.simulate._plans import GLOBAL_BATCH, hand_plan, planner_plan, small_cluster, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_simulated_memory_peak_is_the_plans_prediction(model, schedule):
    for cost_model, plan in ((model, hand_plan(model, schedule)), planner_plan(schedule)):
        timeline = simulate(plan, cost_model)
        S, M = len(plan.stages), plan.microbatches
        for s, (stats, stage) in enumerate(zip(timeline.stage_stats, plan.stages)):
            assert stats.peak_memory_bytes == pytest.approx(stage.memory_bytes, rel=1e-9)
            assert stats.peak_in_flight == (M if schedule == "gpipe" else min(M, S - s))
            series = timeline.memory[s]
            assert series.bytes[0] >= 0 and series.in_flight[-1] == 0  # every activation freed by the end
            assert min(series.bytes) > 0  # static bytes stay


def test_point_to_point_bytes_add_up_and_follow_the_replicas(model):
    plan = hand_plan(model, "1f1b", microbatches=4)
    timeline = simulate(plan, model)
    nbytes = model.layers[1].activation_bytes * (GLOBAL_BATCH / plan.microbatches) / model.batch_size
    for kind, i in itertools.product(("send_activation", "send_gradient"), range(plan.microbatches)):
        messages = [e for e in timeline.events if e.kind == kind and e.microbatch == i]
        # DP 2 → DP 2: each replica sends its half to its counterpart, over its own host pair
        assert sum(e.nbytes for e in messages) == pytest.approx(nbytes, rel=1e-12)
        expected = {"a-0→b-0", "a-1→b-1"} if kind == "send_activation" else {"b-0→a-0", "b-1→a-1"}
        assert {e.resources[0] for e in messages} == expected
    moved = {x.name: x.nbytes for x in timeline.link_stats if x.nbytes}
    assert moved == pytest.approx(
        {r: plan.microbatches * nbytes / 2 for r in ("a-0→b-0", "a-1→b-1", "b-0→a-0", "b-1→a-1")}
    )


def test_gradient_sync_runs_per_layer_during_the_last_backward(model):
    plan = hand_plan(model, "gpipe", microbatches=2)
    timeline = simulate(plan, model)
    for s, stage in enumerate(plan.stages):
        buckets = sorted((e for e in timeline.events if e.kind == "dp_sync" and e.stage == s), key=lambda e: e.start_s)
        assert [e.layer for e in buckets] == list(reversed(stage.layers))  # the backward reaches the last layer first
        last_backward = max(e.end_s for e in timeline.events if e.kind == "backward" and e.stage == s)
        assert buckets[0].start_s < last_backward  # overlapped with the backward pass
        assert sum(e.duration_s for e in buckets) >= stage.dp_sync_s * (1 - 1e-9)  # contention only adds
        host = "a" if s == 0 else "b"
        assert set(buckets[0].resources) == {f"{host}-0→{host}-1", f"{host}-1→{host}-0"}  # the ring over two hosts
    after = simulate(plan, model, overlap_dp_sync=False)
    assert after.iteration_s > timeline.iteration_s


def test_compare_reports_closed_form_and_simulation(model):
    closed, simulated, rel = [], [], []
    for cost_model, plan in [(model, hand_plan(model, s, m)) for s in ("gpipe", "1f1b") for m in (1, 2, 4)] + [
        planner_plan("gpipe"),
        planner_plan("1f1b"),
    ]:
        c, t, r = compare(plan, cost_model)
        assert c == plan.iteration_s
        assert t == simulate(plan, cost_model).iteration_s
        assert r == pytest.approx((t - c) / c)
        closed.append(c)
        simulated.append(t)
        rel.append(r)
    print("closed-form vs simulated (rel):", [f"{x:+.2%}" for x in rel])


def test_a_plan_for_another_model_or_cluster_is_refused(model):
    plan = hand_plan(model)
    other = tiny_model()
    other.cluster = small_cluster()  # same devices: accepted
    simulate(plan, other)
    from orchestrator.cluster import load_cluster

    other.cluster = load_cluster("a100x8")
    with pytest.raises(ValueError, match="uses device 'a-0/0', which cluster 'a100x8' does not have"):
        simulate(plan, other)
    short = type(plan)(**{**{f: getattr(plan, f) for f in plan.__dataclass_fields__}, "stages": plan.stages[:1]})
    with pytest.raises(ValueError, match="the plan was made for another model"):
        simulate(short, model)
