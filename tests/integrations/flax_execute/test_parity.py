"""Plans executed on the 8 virtual devices train exactly like one device (fp32)."""

import pytest

from integrations.flax._parity import PLAN_NAMES, check_plan, parity


@pytest.mark.parametrize("recipe", ["gpt-tiny", "mamba-tiny"])
@pytest.mark.parametrize("plan_name", PLAN_NAMES)
def test_plan_trains_like_one_device(recipe, plan_name):
    result = parity(recipe, check_plan(plan_name, global_batch=16), steps=5)
    assert len(result.losses) == 5
    assert result.losses[-1] < result.losses[0]  # it trains
    assert result.loss_rel_err < 1e-5, (result.losses, result.reference_losses)
    assert result.param_abs_err < 1e-4
