"""Zigzag layout, the chunk pairs a causal ring computes, and its per-device work."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from conductor.kernels.ring import (
    attention_flops_per_device,
    from_layout,
    layout_positions,
    to_layout,
)
from conductor.kernels.ring._layout import chunk_index, pair_kind
from conductor.kernels.ring._steps import Ring, static_kinds


def test_zigzag_positions_and_round_trip():
    assert layout_positions(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert layout_positions(8, 2, "contiguous").tolist() == list(range(8))
    x = jnp.arange(2 * 48 * 3).reshape(2, 48, 3)
    for n, layout in itertools.product((2, 3, 4, 8), ("zigzag", "contiguous")):
        y = to_layout(x, n, layout)
        np.testing.assert_array_equal(y[:, :, 0] // 3 % 48, np.broadcast_to(layout_positions(48, n, layout), (2, 48)))
        np.testing.assert_array_equal(from_layout(y, n, layout), x)
    with pytest.raises(ValueError, match="divide into 8 chunks"):
        layout_positions(12, 4)
    with pytest.raises(ValueError, match="layout="):
        layout_positions(8, 2, "striped")


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_a_step_plan_depends_only_on_whether_the_block_comes_from_before_or_after(layout, causal):
    """The kernels pick a step's pairs from src < me; that must agree with the pairs' global positions."""
    for n in range(2, 9):
        ring = Ring(axis_name="c", n=n, layout=layout, causal=causal, scale=1.0, block_q=8, block_k=8)
        for me, src in itertools.product(range(n), repeat=2):
            relation = "self" if src == me else "before" if src < me else "after"
            for (a, b), kind in static_kinds(ring, relation).items():
                if causal:
                    assert kind == pair_kind(chunk_index(layout, n, me, a), chunk_index(layout, n, src, b))


def balance(n, layout):
    """Largest over smallest per-device causal forward FLOPs at T = 8192 (B=1, H=2, D=16, 256-tiles)."""
    flops = attention_flops_per_device(
        8192, n, layout=layout, causal=True, batch=1, heads=2, head_dim=16, block_q=256, block_k=256
    )
    return flops.max() / flops.min(), flops


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zigzag_balances_causal_work(n):
    balanced, flops = balance(n, "zigzag")
    unbalanced, _ = balance(n, "contiguous")
    assert balanced <= 1.05
    assert unbalanced > 2  # the last device of a contiguous ring does about 2n − 1 times the first's work
    # every device does its share of the lower triangle: half of T² plus the diagonal tiles
    full = attention_flops_per_device(
        8192, n, layout="zigzag", causal=False, batch=1, heads=2, head_dim=16, block_q=256, block_k=256
    )
    assert flops.sum() < 0.55 * full.sum()
