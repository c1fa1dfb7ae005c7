"""Masks that are functions of positions only: the kernels' windows and prefixes, and their rewriting.

Kernels: causal, sliding-window, banded and prefix masks against the materialised reference, forward
and gradients, and the blocks each loop visits are exactly those the mask meets. Rewriting: such masks
in several spellings are read into (kind, window, prefix) and rewritten exactly, with less memory;
a mask from inputs is reported as positions passed in or as data.
"""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import conductor
from conductor.kernels import AttentionBlockSizes, attention
from conductor.kernels.attention import Band
from conductor.kernels.attention._mask import band
from orchestrator.bench._conductor import max_abs_diff, temp_bytes

BLOCKS = AttentionBlockSizes(block_q=16, block_k=16)
FORCE = conductor.Policy(attention="force")
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


# The written forms. Each builds its mask from positions only: iota, jnp.arange, tril/triu.
SEQ, WINDOW = 1024, 64


def _scores(q, k):
    return jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])


def _attend(s, v):
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def window_arange(q, k, v):  # positions from jnp.arange, difference compared with the window
    pos = jnp.arange(q.shape[1])
    diff = pos[:, None] - pos[None, :]
    return _attend(jnp.where((diff >= 0) & (diff < WINDOW), _scores(q, k), -jnp.inf), v)


def window_tril(q, k, v):  # causal band as tril(ones, 0) − tril(ones, −window), i.e. tril ∧ triu
    ones = jnp.ones((q.shape[1], q.shape[1]), bool)
    keep = jnp.tril(ones) & jnp.triu(ones, -(WINDOW - 1))
    return _attend(jnp.where(keep, _scores(q, k), -1e30), v)


def window_iota(q, k, v):  # broadcasted iotas, an additive mask, flax's fill value, a (B, 1, T, T) mask
    t = q.shape[1]
    rows = jax.lax.broadcasted_iota(jnp.int32, (1, 1, t, t), 2)
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, 1, t, t), 3)
    keep = jnp.logical_and(cols <= rows, cols > rows - WINDOW)
    return _attend(_scores(q, k) + jnp.where(keep, 0.0, jnp.finfo(jnp.float32).min), v)


def window_flax(q, k, v):  # flax's mask helpers over positions broadcast to (B, T)
    pos = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
    local = nn.make_attention_mask(pos, pos, lambda i, j: i - j < WINDOW)
    return nn.dot_product_attention(q, k, v, mask=nn.combine_masks(nn.make_causal_mask(pos), local))


def symmetric_band(q, k, v):  # |i − j| < w, no causality (an encoder's local attention)
    pos = jnp.arange(q.shape[1])
    return _attend(jnp.where(jnp.abs(pos[:, None] - pos[None, :]) < 8, _scores(q, k), -jnp.inf), v)


def prefix_lm(q, k, v):  # bidirectional over the first 40 tokens, causal after
    pos = jnp.arange(q.shape[1])
    keep = (pos[None, :] <= pos[:, None]) | (pos[None, :] < 40)
    return _attend(jnp.where(keep, _scores(q, k), -jnp.inf), v)


def window_from_positions(q, k, v, positions):  # the band over positions the step takes as an input
    diff = positions[:, None] - positions[None, :]
    return _attend(jnp.where((diff >= 0) & (diff < WINDOW), _scores(q, k), -jnp.inf), v)


def padded(q, k, v, keep):  # a padding mask from the batch: data, not positions
    return _attend(jnp.where(keep[:, None, None, :], _scores(q, k), -jnp.inf), v)


def _grads(fn, q, k, v, w):
    return jax.grad(lambda *xs: jnp.sum(fn(*xs) * w), argnums=(0, 1, 2))(q, k, v)


def test_sliding_window_is_rewritten_exactly_and_uses_less_memory():
    q, k, v, w = _qkvw(seq=SEQ, heads=2, kv_heads=2, head_dim=16)
    ((match, decision),) = conductor.inspect(window_arange, q, k, v)  # the default policy
    assert match.rewritable and decision.rewrite
    assert (match.details["kind"], match.details["window"], match.details["prefix"]) == ("sliding_window", WINDOW, 0)
    fast = conductor.optimize(window_arange)
    assert max_abs_diff(fast(q, k, v), window_arange(q, k, v)) <= 2e-6
    assert max_abs_diff(jax.jit(lambda *xs: _grads(fast, *xs))(q, k, v, w), _grads(window_arange, q, k, v, w)) <= 1e-5
    written = temp_bytes(lambda *xs: _grads(window_arange, *xs), q, k, v, w)
    rewritten = temp_bytes(lambda *xs: _grads(fast, *xs), q, k, v, w)
    assert rewritten < written


@pytest.mark.parametrize(
    ("fn", "kind", "window", "prefix"),
    [
        (window_tril, "sliding_window", WINDOW, 0),
        (window_iota, "sliding_window", WINDOW, 0),
        (window_flax, "sliding_window", WINDOW, 0),
        (symmetric_band, "band", 8, 0),
        (prefix_lm, "prefix_lm", None, 40),
    ],
)
def test_position_masks_in_every_spelling_are_read_and_rewritten(fn, kind, window, prefix):
    q, k, v, w = _qkvw(seq=256, heads=2, kv_heads=2, head_dim=16)
    ((match, decision),) = conductor.inspect(fn, q, k, v, policy=FORCE)
    assert match.rewritable and decision.rewrite
    assert (match.details["kind"], match.details["window"], match.details["prefix"]) == (kind, window, prefix)
    fast = conductor.optimize(fn, policy=FORCE)
    assert max_abs_diff(fast(q, k, v), fn(q, k, v)) <= 2e-6
    assert max_abs_diff(jax.jit(lambda *xs: _grads(fast, *xs))(q, k, v, w), _grads(fn, q, k, v, w)) <= 1e-5


def test_a_mask_from_inputs_says_whether_it_is_positions_or_data():
    q, k, v, _ = _qkvw(seq=256, heads=2, kv_heads=2, head_dim=16)
    ((match, decision),) = conductor.inspect(window_from_positions, q, k, v, jnp.arange(256), policy=FORCE)
    assert not match.rewritable and not decision.rewrite and match.details["kind"] == "from_inputs"
    assert decision.reason == (
        f"mask computed from inputs: a sliding window (window {WINDOW}) over positions passed in as an input of "
        "the step, not provably 0, 1, …; compute the positions in the step (jnp.arange) to have it rewritten"
    )
    ((match, decision),) = conductor.inspect(padded, q, k, v, jnp.ones((1, 256), bool), policy=FORCE)
    assert not match.rewritable and not decision.rewrite
    assert decision.reason == (
        "mask computed from inputs: it depends on the data (e.g. a padding mask), which no kernel here takes"
    )


def test_a_mask_that_is_no_band_says_why():
    def strided(q, k, v):  # every other key: a function of positions, but not of i − j in one interval
        pos = jnp.arange(q.shape[1])
        keep = (pos[None, :] <= pos[:, None]) & (pos[None, :] % 2 == 0)
        return _attend(jnp.where(keep, _scores(q, k), -jnp.inf), v)

    q, k, v, _ = _qkvw(seq=64, heads=2, kv_heads=2, head_dim=16)
    ((match, decision),) = conductor.inspect(strided, q, k, v, policy=FORCE)
    assert not match.rewritable and not decision.rewrite and match.details["kind"] == "unsupported"
    assert decision.reason.startswith("mask is not causal, a window, a band or a prefix: ")


def test_a_whole_mask_passed_in_is_reported_as_such():
    def given_mask(q, k, v, keep):  # (T, S) keep-mask built by the caller
        return _attend(jnp.where(keep, _scores(q, k), -jnp.inf), v)

    q, k, v, _ = _qkvw(seq=64, heads=2, kv_heads=2, head_dim=16)
    ((match, decision),) = conductor.inspect(given_mask, q, k, v, jnp.tril(jnp.ones((64, 64), bool)), policy=FORCE)
    assert not match.rewritable and not decision.rewrite
    assert decision.reason.startswith("mask computed from inputs: a whole (T, S) mask passed in")


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    seq=st.integers(2, 80),
    left=st.one_of(st.none(), st.integers(0, 90)),
    right=st.one_of(st.none(), st.integers(0, 90)),
    prefix=st.integers(0, 90),
)
def test_the_band_read_from_a_mask_keeps_exactly_its_pairs(seq, left, right, prefix):
    written = Band(left=left, right=right, prefix=prefix)
    pos = np.arange(seq)
    keep = written.keep(pos[:, None], pos[None, :])
    keep = np.ones((seq, seq), bool) if keep is None else np.asarray(keep)

    def masked(q, k, v):
        return _attend(jnp.where(keep, _scores(q, k), -jnp.inf), v)

    spec = jax.ShapeDtypeStruct((1, seq, 2, 8), jnp.float32)
    ((match, _),) = conductor.inspect(masked, spec, spec, spec, policy=FORCE)
    assert match.rewritable, match.details["problems"]
    d = match.details
    read = Band.of(causal=d["causal"], window=d["window"], prefix=d["prefix"], seq_q=seq, seq_k=seq)
    kept = read.keep(pos[:, None], pos[None, :])
    np.testing.assert_array_equal(np.ones((seq, seq), bool) if kept is None else np.asarray(kept), keep)


def test_a_mask_built_outside_a_scan_or_remat_body_is_read_inside():
    def layers(q, k, v):  # the band is built once, outside the scanned and rematerialised block
        pos = jnp.arange(q.shape[1])
        diff = pos[:, None] - pos[None, :]
        keep = (diff >= 0) & (diff < WINDOW)

        @jax.checkpoint
        def block(x, keep):
            return _attend(jnp.where(keep, _scores(x, k), -jnp.inf), v)

        return jax.lax.scan(lambda x, _: (block(x, keep), None), q, None, length=2)[0]

    q, k, v, w = _qkvw(seq=256, heads=2, kv_heads=2, head_dim=16)
    ((match, decision),) = conductor.inspect(layers, q, k, v, policy=FORCE)
    assert match.path == ("scan", "remat") and match.rewritable and decision.rewrite
    assert (match.details["kind"], match.details["window"]) == ("sliding_window", WINDOW)
    fast = conductor.optimize(layers, policy=FORCE)
    assert max_abs_diff(fast(q, k, v), layers(q, k, v)) <= 2e-6
    assert max_abs_diff(jax.jit(lambda *xs: _grads(fast, *xs))(q, k, v, w), _grads(layers, q, k, v, w)) <= 1e-5


def test_a_learned_bias_is_reported_as_such():
    def alibi(q, k, v, slopes):  # per-head slopes (parameters) times the distance: a bias, not a mask
        pos = jnp.arange(q.shape[1])
        bias = -slopes[:, None, None] * jnp.abs(pos[:, None] - pos[None, :])
        return _attend(_scores(q, k) + bias, v)

    q, k, v, _ = _qkvw(seq=64, heads=2, kv_heads=2, head_dim=16)
    ((match, decision),) = conductor.inspect(alibi, q, k, v, jnp.ones(2), policy=FORCE)
    assert not match.rewritable and not decision.rewrite
    assert decision.reason == "bias computed from inputs: a learned or data-dependent bias, which no kernel here takes"
