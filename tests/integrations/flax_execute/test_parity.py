"""Plans executed on the 8 virtual devices train exactly like one device (fp32).

Tiny GPT runs every check plan; tiny Mamba (no logical axis names, so TP
shards none of its parameters) the two pipelines. The full matrix is
``orchestrator bench executor``.
"""

import pytest

from integrations.flax._parity import PLAN_NAMES, check_plan, parity

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
