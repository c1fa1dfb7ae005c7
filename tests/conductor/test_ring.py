"""Ring and all-gather attention on 8 virtual CPU devices against full attention, fp32, forward and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from conductor.kernels import AttentionBlockSizes
from conductor.kernels.ring import context_parallel_attention_shard, from_layout, ring_attention, to_layout
from orchestrator.bench._ring import full_attention

BLOCKS = AttentionBlockSizes(block_q=256, block_k=256)


def _inputs(t, heads, kv_heads, head_dim=16, batch=1):
    ks = jax.random.split(jax.random.key(t + 10 * heads + kv_heads), 4)
    q = jax.random.normal(ks[0], (batch, t, heads, head_dim))
    k = jax.random.normal(ks[1], (batch, t, kv_heads, head_dim))
    v = jax.random.normal(ks[2], (batch, t, kv_heads, head_dim))
    return q, k, v, jax.random.normal(ks[3], q.shape)


def _value_and_grads(attend, w):
    @jax.jit
    def run(q, k, v):
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(w)

    return run


def ring_errors(*, n, t, causal, heads, kv_heads, layout="zigzag", form="ring", implementation="xla_chunked"):
    """Largest |ring − full| of the output and of dQ, dK, dV (gradients of Σ out ⊙ w)."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("context",))
    q, k, v, w = _inputs(t, heads, kv_heads)

    def ring(q, k, v):
        q, k, v = (to_layout(x, n, layout) for x in (q, k, v))
        out = ring_attention(
            q,
            k,
            v,
            mesh=mesh,
            causal=causal,
            layout=layout,
            form=form,
            block_sizes=BLOCKS,
            implementation=implementation,
        )
        return from_layout(out, n, layout)

    out, grads = _value_and_grads(ring, w)(q, k, v)
    ref, ref_grads = _value_and_grads(lambda q, k, v: full_attention(q, k, v, causal=causal), w)(q, k, v)
    return float(jnp.max(jnp.abs(out - ref))), [float(jnp.max(jnp.abs(g - r))) for g, r in zip(grads, ref_grads)]


# T = 8192 for every CP degree; the other combinations of causal/not, MHA/GQA, the contiguous
# layout and the all-gather form at T = 1024, where the same code runs with fewer blocks per chunk
CASES = [
    dict(n=2, t=8192, causal=True, heads=2, kv_heads=1),
    dict(n=4, t=8192, causal=False, heads=2, kv_heads=1),
    dict(n=8, t=8192, causal=True, heads=2, kv_heads=2),
    dict(n=2, t=1024, causal=False, heads=2, kv_heads=2),
    dict(n=4, t=1024, causal=True, heads=4, kv_heads=1, layout="contiguous"),
    dict(n=8, t=1024, causal=False, heads=4, kv_heads=1),
    dict(n=8, t=1024, causal=True, heads=2, kv_heads=1, form="all_gather"),
    dict(n=2, t=1024, causal=False, heads=4, kv_heads=2, form="all_gather", layout="contiguous"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_ring_attention_equals_full_attention(case):
    out_err, grad_errs = ring_errors(**case)
    assert out_err <= 1e-5
    assert max(grad_errs) <= 1e-5, grad_errs


@pytest.mark.parametrize(
    "case",
    [dict(n=4, causal=True, heads=4, kv_heads=2), dict(n=2, causal=False, heads=2, kv_heads=1, form="all_gather")],
    ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()),
)
def test_each_chunk_pair_may_run_the_pallas_kernel(case):
    """The same ring with Pallas flash kernels per chunk pair (interpreted on CPU, so a short sequence)."""
    out_err, grad_errs = ring_errors(t=1024, implementation="pallas", **case)
    assert out_err <= 1e-5
    assert max(grad_errs) <= 1e-5, grad_errs


def test_inside_a_shard_map_of_data_and_context_axes():
    """An executor's own shard_map (type-checked carries, the default) with a data axis beside the context axis."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "context"))
    spec = PartitionSpec("data", "context")
    q, k, v, w = _inputs(512, 4, 2, batch=2)  # one sequence per data shard

    def sharded(q, k, v):
        def local(q, k, v):
            return context_parallel_attention_shard(q, k, v, axis_name="context", causal=True, block_sizes=BLOCKS)

        q, k, v = (to_layout(x, 4) for x in (q, k, v))
        return from_layout(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q, k, v), 4)

    out, grads = _value_and_grads(sharded, w)(q, k, v)
    ref, ref_grads = _value_and_grads(lambda q, k, v: full_attention(q, k, v, causal=True), w)(q, k, v)
    assert float(jnp.max(jnp.abs(out - ref))) <= 1e-5
    assert max(float(jnp.max(jnp.abs(g - r))) for g, r in zip(grads, ref_grads)) <= 1e-5


def test_ring_attention_checks_its_arguments():
    mesh = Mesh(np.array(jax.devices()[:2]), ("context",))
    q = jnp.ones((1, 64, 2, 16))
    with pytest.raises(ValueError, match="layout="):
        ring_attention(q, q, q, mesh=mesh, layout="striped")
    with pytest.raises(ValueError, match="form="):
        ring_attention(q, q, q, mesh=mesh, form="tree")
    with pytest.raises(ValueError, match="divisible"):
        ring_attention(q, q[:, :, :1].repeat(3, 2), q[:, :, :1].repeat(3, 2), mesh=mesh)
    with pytest.raises(ValueError, match="blocks"):
        ring_attention(q, q, q, mesh=mesh, causal=True, block_sizes=AttentionBlockSizes(block_q=12, block_k=12))
