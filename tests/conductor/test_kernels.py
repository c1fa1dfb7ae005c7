"""Kernels vs their references, forward and gradients, fp32 (Pallas runs interpreted on CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conductor.kernels import AttentionBlockSizes, ScanBlockSizes, attention, selective_scan
from orchestrator.bench._conductor import max_abs_diff, scan_inputs

BLOCKS = AttentionBlockSizes(block_q=16, block_k=16)


def _qkvw(heads, kv_heads, head_dim, seq=32, batch=1):
    ks = jax.random.split(jax.random.key(heads * 7 + kv_heads + head_dim), 4)
    q = jax.random.normal(ks[0], (batch, seq, heads, head_dim))
    k = jax.random.normal(ks[1], (batch, seq, kv_heads, head_dim))
    v = jax.random.normal(ks[2], (batch, seq, kv_heads, head_dim))
    return q, k, v, jax.random.normal(ks[3], q.shape)


def _attention_grads(implementation, causal, q, k, v, w):
    def loss(q, k, v):
        out = attention(q, k, v, causal=causal, implementation=implementation, block_sizes=BLOCKS)
        return jnp.sum(out * w)

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize(
    ("implementation", "causal", "heads", "kv_heads", "head_dim"),
    [
        ("pallas", True, 2, 1, 64),
        ("pallas", False, 2, 2, 128),
        ("xla_chunked", True, 2, 2, 128),
        ("xla_chunked", False, 2, 1, 64),
    ],
)
def test_attention_matches_reference(implementation, causal, heads, kv_heads, head_dim):
    q, k, v, w = _qkvw(heads, kv_heads, head_dim)
    out = attention(q, k, v, causal=causal, implementation=implementation, block_sizes=BLOCKS)
    ref = attention(q, k, v, causal=causal, implementation="reference")
    assert max_abs_diff(out, ref) <= 2e-6
    grads = _attention_grads(implementation, causal, q, k, v, w)
    ref_grads = _attention_grads("reference", causal, q, k, v, w)
    assert max_abs_diff(grads, ref_grads) <= 1e-5


def test_causal_mask_is_applied():
    q, k, v, _ = _qkvw(2, 2, 64)
    causal = attention(q, k, v, causal=True, implementation="xla_chunked", block_sizes=BLOCKS)
    full = attention(q, k, v, causal=False, implementation="xla_chunked", block_sizes=BLOCKS)
    np.testing.assert_allclose(causal[:, -1], full[:, -1], atol=1e-6)  # the last query sees every key
    assert max_abs_diff(causal[:, 0], v[:, 0]) < 1e-6  # the first sees only itself
    assert max_abs_diff(causal, full) > 0.1


@pytest.mark.parametrize("implementation", ["pallas", "xla_chunked"])
def test_selective_scan_matches_reference(implementation):
    """The fp32 kernels against the written form in float64 (the fp32 written form is itself ~5e-6 off)."""
    dt, a, v, b, c, w = scan_inputs(2, 32, 16, 4)
    sizes = ScanBlockSizes(chunk=8, block_d=8)

    def grads(impl, xs):
        def loss(*xs):
            return jnp.sum(selective_scan(*xs, implementation=impl, block_sizes=sizes) * w.astype(xs[0].dtype))

        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(*xs)

    xs = (dt, a, v, b, c)
    out = selective_scan(*xs, implementation=implementation, block_sizes=sizes)
    kernel_grads = grads(implementation, xs)
    with jax.enable_x64(True):
        xs64 = tuple(jnp.asarray(np.asarray(x), jnp.float64) for x in xs)
        ref = selective_scan(*xs64, implementation="reference")
        ref_grads = grads("reference", xs64)
    assert max_abs_diff(out, ref) <= 1e-5
    assert max_abs_diff(kernel_grads, ref_grads) <= 1e-5


def test_bad_arguments_name_the_problem():
    q, k, v, _ = _qkvw(2, 2, 64)
    with pytest.raises(ValueError, match="implementation"):
        attention(q, k, v, implementation="cuda")
    with pytest.raises(ValueError, match="divide"):
        attention(q, k, v, block_sizes=AttentionBlockSizes(block_q=24, block_k=16), implementation="xla_chunked")
    with pytest.raises(ValueError, match="kv heads"):
        attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))
    dt, a, v2, b, c, _ = scan_inputs(1, 32, 8, 4)
    with pytest.raises(ValueError, match="chunk"):
        selective_scan(dt, a, v2, b, c, block_sizes=ScanBlockSizes(chunk=12), implementation="xla_chunked")
