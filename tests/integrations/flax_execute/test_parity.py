"""Plans executed on the 8 virtual devices train exactly like one device (fp32).

Tiny GPT runs every check plan; tiny Mamba (no logical axis names, so TP
shards none of its parameters) the two pipelines. The full matrix is
``orchestrator bench executor``.
"""

import pytest

from orchestrator.bench.executor import PLAN_NAMES, check_plan, parity

CASES = [("gpt-tiny", name) for name in PLAN_NAMES] + [
    ("mamba-tiny", name) for name in ("2 stages (3+1) x 4 mb", "4 stages TP 1/2/4/1")
]


@pytest.mark.parametrize(("recipe", "plan_name"), CASES)
def test_plan_trains_like_one_device(recipe, plan_name):
    result = parity(recipe, check_plan(plan_name, global_batch=16), steps=5)
    assert len(result.losses) == 5
    assert result.losses[-1] < result.losses[0]  # it trains
    assert result.loss_rel_err < 1e-5, (result.losses, result.reference_losses)
    assert result.param_abs_err < 1e-4


@pytest.mark.parametrize("plan_name", ["DP8", "2 stages (3+1) x 4 mb"])
def test_zero_plan_shards_the_moments_and_trains_like_one_device(plan_name):
    """A plan whose stages say ``zero`` (as ``plan(..., zero=True)`` gives) keeps each optimizer
    moment split over the stage's data-parallel replicas, and still trains like one device."""
    import dataclasses

    import jax

    from integrations.flax._shard import shard
    from orchestrator.bench.executor._parity import _reference

    plan = check_plan(plan_name, global_batch=16)
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, zero=s.dp > 1) for s in plan.stages))
    state, _, _, _, axes, layers = _reference("gpt-tiny", 5, 16, 16)
    placed = shard(plan, state, param_axes=axes, layers=layers)
    moments = [
        leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(placed.opt_state)[0]
        if any(getattr(k, "name", None) in ("mu", "nu") for k in path)
    ]

    def splittable(leaf) -> bool:  # a dimension tensor parallelism leaves whole that dp (2 or 4) divides
        spec = list(leaf.sharding.spec) + [None] * (leaf.ndim - len(leaf.sharding.spec))
        return any(entry is None and size % 4 == 0 for entry, size in zip(spec, leaf.shape))

    assert any(splittable(leaf) for leaf in moments)
    assert all("data" in str(leaf.sharding.spec) for leaf in moments if splittable(leaf))
    result = parity("gpt-tiny", plan, steps=5)
    assert result.loss_rel_err < 1e-5, (result.losses, result.reference_losses)
    assert result.param_abs_err < 1e-4
