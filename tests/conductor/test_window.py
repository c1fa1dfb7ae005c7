"""Masks that are functions of positions only: the kernels' windows and prefixes, and their rewriting.

Kernels: causal, sliding-window, banded and prefix masks against the materialised reference, forward
and gradients, and the blocks each loop visits are exactly those the mask meets.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conductor.kernels import AttentionBlockSizes, attention
from conductor.kernels.attention._mask import band
from orchestrator.bench._conductor import max_abs_diff

BLOCKS = AttentionBlockSizes(block_q=16, block_k=16)
MASKS = {
    "causal_window": dict(causal=True, window=8),
    "causal_window_wide": dict(causal=True, window=20),
    "band": dict(window=5),
    "asymmetric": dict(window=(3, 17)),
    "prefix_lm": dict(causal=True, prefix=20),
    "window_and_prefix": dict(causal=True, window=4, prefix=10),
}


def _qkvw(seq=64, heads=2, kv_heads=1, head_dim=16):
    ks = jax.random.split(jax.random.key(seq + heads), 4)
    q = jax.random.normal(ks[0], (1, seq, heads, head_dim))
    k = jax.random.normal(ks[1], (1, seq, kv_heads, head_dim))
    v = jax.random.normal(ks[2], (1, seq, kv_heads, head_dim))
    return q, k, v, jax.random.normal(ks[3], q.shape)


def _out_and_grads(implementation, mask, q, k, v, w):
    def run(q, k, v):
        return attention(q, k, v, implementation=implementation, block_sizes=BLOCKS, **mask)

    return run(q, k, v), jax.grad(lambda *xs: jnp.sum(run(*xs) * w), argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize("implementation", ["xla_chunked", "pallas"])
@pytest.mark.parametrize("name", list(MASKS))
def test_windowed_kernels_match_reference(implementation, name):
    q, k, v, w = _qkvw()
    out, grads = _out_and_grads(implementation, MASKS[name], q, k, v, w)
    ref, ref_grads = _out_and_grads("reference", MASKS[name], q, k, v, w)
    assert max_abs_diff(out, ref) <= 2e-6
    assert max_abs_diff(grads, ref_grads) <= 1e-5


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize(("bq", "bk"), [(16, 16), (8, 32), (32, 8)])
def test_loops_visit_exactly_the_blocks_the_mask_meets(name, bq, bk):
    seq = 64
    mask = band(seq_q=seq, seq_k=seq, **{"causal": False, **MASKS[name]})
    keep = np.asarray(mask.keep(np.arange(seq)[:, None], np.arange(seq)[None, :]))
    assert keep.sum() == mask.kept_pairs(seq, seq)
    nq, nk = seq // bq, seq // bk
    meets = {
        (i, j)
        for i, j in itertools.product(range(nq), range(nk))
        if keep[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].any()
    }
    by_query = set()
    for i in range(nq):
        n, block = mask.key_blocks(jnp.int32(i), bq, bk, nk)
        by_query |= {(i, int(block(jnp.int32(s)))) for s in range(int(n))}
        assert int(n) == len({j for ii, j in by_query if ii == i})  # no block twice
    by_key = set()
    for j in range(nk):
        lo, hi = mask.query_blocks(jnp.int32(j), bq, bk, nq)
        by_key |= {(i, j) for i in range(int(lo), int(hi))}
    assert by_query == meets == by_key


def test_bad_window_or_prefix_names_the_problem():
    q, k, v, _ = _qkvw(seq=32)
    with pytest.raises(ValueError, match="window=0"):
        attention(q, k, v, causal=True, window=0)
    with pytest.raises(ValueError, match="left and right"):
        attention(q, k, v, window=(-1, 3))
    with pytest.raises(ValueError, match="prefix"):
        attention(q, k, v, causal=True, prefix=-2)
    with pytest.raises(ValueError, match="seq_q == seq_k"):
        attention(q[:, :16], k, v, window=4)
