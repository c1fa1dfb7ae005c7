"""The conductor bench's recipe-step numerics: splitting the batch into samples computes the batch's step."""

import jax
import pytest

from orchestrator.bench._conductor import norm_rel_diff, recipe_step_grads, recipe_step_numerics_cases, rel_diff
from recipes import get_recipe

# the split is the same for every form; the rewrite's own numerics are the bench's to measure
FORMS = {"written": ("float32", False, False), "written64": ("float64", False, False)}


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole_step", "layerwise"])
def test_per_sample_split_gives_the_batch_loss_and_gradients(layerwise):
    # the loss is a mean over batch and tokens, so the samples' mean is the batch's step: float32
    # gradients round the two sums apart by a few ulps, float64 ones agree to float64 rounding; the
    # loss itself is float32 in every form (the cross-entropy runs on float32 logits)
    data = get_recipe("mamba-tiny").batch_for_step(0, 0, 2, 64)
    assert (data["inputs"][0] != data["inputs"][1]).any()  # two samples, so the mean is a real one
    heard = []
    whole = recipe_step_grads("mamba-tiny", batch=2, seq=64, forms=FORMS, layerwise=layerwise)
    split = recipe_step_grads(
        "mamba-tiny", batch=2, seq=64, forms=FORMS, layerwise=layerwise, per_sample=True, progress=heard.append
    )
    for name in FORMS:
        tol = 1e-12 if name.endswith("64") else 2e-6
        (loss, grads), (split_loss, split_grads) = whole[name], split[name]
        assert jax.tree.structure(split_grads) == jax.tree.structure(grads)
        assert abs(split_loss - loss) <= 1e-6 * abs(loss), name
        assert rel_diff(split_grads, grads) <= tol, name
        assert norm_rel_diff(split_grads, grads) <= tol, name
    if layerwise:  # each sample of each form reports its blocks' backward passes (mamba-tiny: 2 blocks)
        assert "mamba-tiny T=64 written64 sample 1 block 0 backward done" in heard
        assert len(heard) == len(FORMS) * 2 * 2


def test_float64_claims_need_the_floor():
    with pytest.raises(ValueError, match="floor=False needs float64=False"):
        recipe_step_numerics_cases("mamba-tiny", batch=2, seq=64, floor=False)


def test_the_written_scan_in_channel_slices_is_the_written_scan():
    # the same function (float64 to rounding); float32 sums the channels' parts into B's and C's
    # gradients group by group, a few ulps apart
    whole = recipe_step_grads("mamba-tiny", batch=1, seq=64, forms=FORMS, layerwise=True)
    sliced = recipe_step_grads("mamba-tiny", batch=1, seq=64, forms=FORMS, layerwise=True, written_slices=4)
    for name in FORMS:
        tol = 1e-12 if name.endswith("64") else 2e-6
        (loss, grads), (sliced_loss, sliced_grads) = whole[name], sliced[name]
        assert abs(sliced_loss - loss) <= 1e-6 * abs(loss), name
        assert rel_diff(sliced_grads, grads) <= tol, name
        assert norm_rel_diff(sliced_grads, grads) <= tol, name
