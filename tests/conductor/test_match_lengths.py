"""Attention is found in every supported spelling at every sequence length, and rewriting it keeps the gradients.

Matching needs only tracing, so lengths far past the point where the written scores stop fitting in
memory cost nothing here: the inputs are ``jax.ShapeDtypeStruct``s.
"""

import jax
import jax.numpy as jnp
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import conductor
from orchestrator.bench._conductor import ATTENTION_SPELLINGS, max_abs_diff

FORCE = conductor.Policy(attention="force")
HEADS, HEAD_DIM = 4, 8


def _specs(seq, kv_heads, dtype):
    q = jax.ShapeDtypeStruct((1, seq, HEADS, HEAD_DIM), dtype)
    kv = jax.ShapeDtypeStruct((1, seq, kv_heads, HEAD_DIM), dtype)
    return q, kv, kv


@pytest.mark.parametrize("name", list(ATTENTION_SPELLINGS))
@settings(max_examples=5, deadline=None, derandomize=True)
@given(seq=st.integers(1, 10_000), kv_heads=st.sampled_from([HEADS, 1, 2]), bf16=st.booleans())
@example(seq=4096, kv_heads=HEADS, bf16=False)
@example(seq=4097, kv_heads=2, bf16=True)
@example(seq=6144, kv_heads=HEADS, bf16=False)
@example(seq=8192, kv_heads=2, bf16=False)
def test_every_spelling_is_found_at_every_length(name, seq, kv_heads, bf16):
    fn, causal = ATTENTION_SPELLINGS[name]
    specs = _specs(seq, kv_heads, jnp.bfloat16 if bf16 else jnp.float32)
    found = conductor.inspect(fn, *specs, policy=FORCE)
    causal = causal and seq > 1  # one query over one key: the causal mask keeps everything
    assert [(m.pattern, m.rewritable, m.details["causal"]) for m, _ in found] == [("attention", True, causal)]
    match = found[0][0]
    assert match.shapes["q"][1] == match.shapes["k"][1] == seq


@pytest.mark.parametrize("kv_heads", [HEADS, 2])
@pytest.mark.parametrize("name", list(ATTENTION_SPELLINGS))
def test_rewrite_keeps_outputs_and_gradients(name, kv_heads):
    fn, _ = ATTENTION_SPELLINGS[name]
    ks = jax.random.split(jax.random.key(kv_heads), 4)
    q = jax.random.normal(ks[0], (1, 48, HEADS, HEAD_DIM))
    k, v = (jax.random.normal(key, (1, 48, kv_heads, HEAD_DIM)) for key in ks[1:3])
    w = jax.random.normal(ks[3], q.shape)
    fast = conductor.optimize(fn, policy=conductor.Policy(attention="force", guard=False))
    assert [d.rewrite for _, d in fast.inspect(q, k, v)] == [True]

    def loss_and_grads(f):
        return jax.jit(jax.value_and_grad(lambda *xs: jnp.sum(f(*xs) * w), argnums=(0, 1, 2)))(q, k, v)

    (loss, grads), (written_loss, written_grads) = loss_and_grads(fast), loss_and_grads(fn)
    assert abs(float(loss - written_loss)) <= 1e-4
    assert max_abs_diff(grads, written_grads) <= 1e-5
