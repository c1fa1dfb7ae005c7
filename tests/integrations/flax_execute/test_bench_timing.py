"""The executor bench's stage timing: prediction and measurement interleaved, sample by sample."""

import math

import pytest


@pytest.fixture(scope="module")
def timed():
    from integrations.flax._bench import setup, timing_cases

    su = setup("gpt-tiny", 16, 8, host=True)
    return su, timing_cases(su, plans=("DP2", "4 stages TP 1/2/4/1"), rounds=2, repeats=2)


def test_every_stage_of_every_plan_gets_a_case_with_its_rounds(timed):
    _, cases = timed
    assert [c["name"] for c in cases] == ["gpt-tiny DP2 stage 0"] + [
        f"gpt-tiny 4 stages TP 1/2/4/1 stage {s}" for s in range(4)
    ]
    for case in cases:
        assert case["predicted"] > 0 and case["measured"] > 0
        assert case["rel_err"] == pytest.approx(case["measured"] / case["predicted"] - 1)
        assert case["ok"] == (abs(case["rel_err"]) <= 0.15)
        assert len(case["round_errors"]) == 2 and all(math.isfinite(e) for e in case["round_errors"])
        assert math.isfinite(case["repeat_err"]) and case["measured_spread"] >= 0


def test_the_profile_behind_a_prediction_has_every_smaller_batch(timed):
    from integrations.flax._bench import SMALLER_BATCH_DIVISORS
    from integrations.flax._profile import LayerProfiler

    su, _ = timed
    abstract = su.recipe.abstract_state()
    profiler = LayerProfiler(
        su.recipe.train_step,
        abstract,
        su.recipe.batch_spec(16, 8),
        graph=su.graph,
        layers=su.layers,
        fixed_from=[(abstract, su.recipe.batch_spec(16 // d, 8)) for d in SMALLER_BATCH_DIVISORS],
    )
    samples = [profiler.sample() for _ in range(2)]
    timings = profiler.timings(samples)
    assert len(timings) == len({layer.signature for layer in su.layers})
    for timing in timings.values():
        assert [r for r, _ in timing.forward_at] == sorted(1 / d for d in SMALLER_BATCH_DIVISORS)
        assert 0 <= timing.forward_fixed_s <= timing.forward_at[0][1]
        assert timing.forward_s > 0 and timing.backward_s > 0
    with pytest.raises(ValueError, match="at least one sample"):
        profiler.timings([])
