"""The executor bench's stage timing: prediction and measurement interleaved, sample by sample."""

import math

import pytest


@pytest.fixture(scope="module")
def timed():
    from orchestrator.bench.executor import setup, timing_cases

    su = setup("gpt-tiny", 16, 8, host=True)
    return su, timing_cases(su, plans=("DP2", "4 stages TP 1/2/4/1"), rounds=2, repeats=2)


def test_every_stage_of_every_plan_gets_a_case_with_its_rounds(timed):
    _, cases = timed
    assert [c["name"] for c in cases] == ["gpt-tiny DP2 stage 0"] + [
        f"gpt-tiny 4 stages TP 1/2/4/1 stage {s}" for s in range(4)
    ]
    for case in cases:
        assert case["predicted"] > 0 and case["measured"] > 0
        assert case["rel_err"] == pytest.approx(case["predicted"] / case["measured"] - 1)
        assert case["ok"] == (abs(case["rel_err"]) <= 0.15)
        assert len(case["round_errors"]) == 2 and all(math.isfinite(e) for e in case["round_errors"])
        assert math.isfinite(case["repeat_err"]) and case["measured_spread"] >= 0
        assert len(case["slowdown_rounds"]) == 2 and all(s > 0 for s in case["slowdown_rounds"])
    # s(1) = 1: the 4-stage plan's first and last stages run on one device each
    assert cases[1]["slowdown_rounds"] == cases[4]["slowdown_rounds"] == [1.0, 1.0]


def test_the_profile_behind_a_prediction_has_every_smaller_batch(timed):
    from integrations.flax._profile import LayerProfiler
    from orchestrator.bench.executor import SMALLER_BATCH_DIVISORS

    su, _ = timed
    abstract = su.recipe.abstract_state()
    profiler = LayerProfiler(
        su.recipe.train_step,
        abstract,
        su.recipe.batch_spec(16, 8),
        graph=su.graph,
        layers=su.layers,
        fixed_from=[(abstract, su.recipe.batch_spec(16 // d, 8)) for d in SMALLER_BATCH_DIVISORS],
        boundary=True,
    )
    profiler.sample()  # compiles
    samples = [profiler.sample() for _ in range(3)]
    timings = profiler.timings(samples)
    # the whole step's forward and backward at the smallest batch, against its 4 layers' pieces there
    assert sorted(profiler.whole) == [("backward", 1 / 16), ("forward", 1 / 16)]
    boundary = profiler.boundary_seconds(samples)
    assert math.isfinite(boundary) and boundary >= 0
    host_s = profiler.boundary_seconds(samples, host_s=lambda n: 1e-5 + n * 1e-6)
    assert math.isfinite(host_s) and host_s >= 0
    assert len(timings) == len({layer.signature for layer in su.layers})
    for timing in timings.values():
        assert [r for r, _ in timing.forward_at] == sorted(1 / d for d in SMALLER_BATCH_DIVISORS)
        assert 0 <= timing.forward_fixed_s <= timing.forward_at[0][1]
        assert timing.forward_s > 0 and timing.backward_s > 0
    with pytest.raises(ValueError, match="at least one sample"):
        profiler.timings([])


def test_controls_time_each_stage_twice_and_sum_its_layers_run_as_stages_on_its_devices(timed):
    from orchestrator.bench.executor import control_cases

    su, _ = timed
    rows = control_cases(su, plans=("2 stages (3+1) x 4 mb",), rounds=2, repeats=2)
    assert [r["name"] for r in rows] == [f"gpt-tiny 2 stages (3+1) x 4 mb stage {s}" for s in range(2)]
    for row in rows:
        assert row["stage_ms"] > 0 and 0 < row["warm_over_cold"] < math.inf
    # stage 0 has 3 layers: its layers, run alone as one-layer stages, are summed; stage 1 has one
    assert math.isfinite(rows[0]["layers_over_stage"])
    assert "layers_over_stage" not in rows[1]


def test_one_layer_stages_keep_each_stage_s_devices_and_degrees():
    from orchestrator.bench.executor import check_plan, one_layer_stages

    plan = check_plan("2 stages (3+1) x 4 mb", global_batch=16)
    split, sizes = one_layer_stages(plan)
    assert sizes == [3, 1]
    assert [s.layers for s in split.stages] == [(0,), (1,), (2,), (3,)]
    for s, parent in zip(split.stages, [0, 0, 0, 1]):
        original = plan.stages[parent]
        assert (s.devices, s.tp, s.dp, s.microbatch_size) == (
            original.devices,
            original.tp,
            original.dp,
            original.microbatch_size,
        )


def test_controls_need_the_host_costs():
    from orchestrator.bench.executor import control_cases, setup

    with pytest.raises(ValueError, match="host=True"):
        control_cases(setup("gpt-tiny", 16, 8))


def test_the_boundary_needs_the_whole_step_and_every_layer(timed):
    from integrations.flax._profile import LayerProfiler

    su, _ = timed
    args = (su.recipe.abstract_state(), su.recipe.batch_spec(16, 8))
    plain = LayerProfiler(su.recipe.train_step, *args, graph=su.graph, layers=su.layers)
    with pytest.raises(ValueError, match="boundary=True"):
        plain.boundary_seconds([plain.sample()])
    with pytest.raises(ValueError, match="every layer"):
        LayerProfiler(su.recipe.train_step, *args, graph=su.graph, layers=su.layers, signatures=set(), boundary=True)
