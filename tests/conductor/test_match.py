"""Attention is found in every spelling, a classifier softmax is not; scans, kernels and nesting."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import conductor
from orchestrator.bench._conductor import max_abs_diff

FORCE = conductor.Policy(attention="force", selective_scan="force")
B, T, H, D = 2, 32, 4, 16


@jax.custom_jvp
def custom_softmax(x):  # the custom_jvp spelling (jax.nn.softmax before jax 0.4.x, many codebases)
    e = jnp.exp(x - jax.lax.stop_gradient(x.max(-1, keepdims=True)))
    return e / e.sum(-1, keepdims=True)


@custom_softmax.defjvp
def _custom_softmax_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    y = custom_softmax(x)
    return y, y * (t - (y * t).sum(-1, keepdims=True))


def inline_softmax(x):
    e = jnp.exp(x - x.max(-1, keepdims=True))
    return e / jnp.sum(e, axis=-1, keepdims=True)


def causal_where(s):
    t = s.shape[-1]
    return jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)


def einsum_mha(q, k, v):  # (B, T, H, D), heads as batch dims, jax.nn.softmax, causal via tril/where
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(causal_where(s), axis=-1), v)


def matmul_inline(q, k, v):  # (B, H, T, D) with @, inline softmax, iota comparison mask, scale by mul
    s = (q @ jnp.swapaxes(k, -1, -2)) * (1 / np.sqrt(D))
    rows = jax.lax.broadcasted_iota(jnp.int32, (T, T), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (T, T), 1)
    s = jnp.where(cols <= rows, s, -1e30)
    return inline_softmax(s) @ v


def dot_general_custom(q, k, v):  # explicit dot_general, custom_jvp softmax, additive mask, no causal
    s = jax.lax.dot_general(q, k, (((3,), (3,)), ((0, 1), (0, 1))))  # (B, H, T, T)
    return jax.lax.dot_general(custom_softmax(s * 0.25), v, (((3,), (2,)), ((0, 1), (0, 1))))


def gqa_grouped(q, k, v):  # q (B, T, Hkv, G, D), k, v (B, T, Hkv, D): the group as an extra query dim
    s = jnp.einsum("btkgd,bskd->bkgts", q, k) * 0.25
    return jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(causal_where(s), axis=-1), v)


def gqa_repeat(q, k, v):  # MQA/GQA by repeating K and V
    return einsum_mha(q, jnp.repeat(k, H // k.shape[2], axis=2), jnp.repeat(v, H // v.shape[2], axis=2))


def _inputs(shape_q, shape_kv, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(ks[0], shape_q),
        jax.random.normal(ks[1], shape_kv),
        jax.random.normal(ks[2], shape_kv),
    )


SPELLINGS = {
    "einsum_mha": (einsum_mha, (B, T, H, D), (B, T, H, D), True),
    "matmul_inline": (matmul_inline, (B, H, T, D), (B, H, T, D), True),
    "dot_general_custom": (dot_general_custom, (B, H, T, D), (B, H, T, D), False),
    "gqa_grouped": (gqa_grouped, (B, T, 2, 2, D), (B, T, 2, D), True),
    "mqa_repeat": (gqa_repeat, (B, T, H, D), (B, T, 1, D), True),
}


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_attention_spellings_are_found_and_rewritten_exactly(name):
    fn, shape_q, shape_kv, causal = SPELLINGS[name]
    args = _inputs(shape_q, shape_kv)
    found = conductor.inspect(fn, *args, policy=FORCE)
    assert [(m.pattern, m.rewritable, m.details["causal"]) for m, _ in found] == [("attention", True, causal)]
    assert found[0][1].rewrite
    fast = conductor.optimize(fn, policy=FORCE)
    assert max_abs_diff(fast(*args), fn(*args)) <= 2e-6
    w = jax.random.normal(jax.random.key(9), fn(*args).shape)

    def grads(f):
        return jax.grad(lambda *xs: jnp.sum(f(*xs) * w), argnums=(0, 1, 2))(*args)

    assert max_abs_diff(jax.jit(functools.partial(grads, fast))(), grads(fn)) <= 1e-5


def test_a_classifier_softmax_is_not_attention():
    def classify(params, x):
        logits = x @ params["w"]  # (batch, classes)
        probs = jax.nn.softmax(logits, axis=-1)
        return jnp.sum(probs * jax.nn.one_hot(jnp.arange(x.shape[0]) % 10, 10))

    params = {"w": jnp.ones((16, 10))}
    assert conductor.inspect(classify, params, jnp.ones((8, 16))) == []


def test_a_mask_from_inputs_is_reported_but_not_rewritten():
    def padded(q, k, v, keep):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        s = jnp.where(keep[:, None, None, :], s, -1e30)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    args = (*_inputs((B, T, H, D), (B, T, H, D)), jnp.ones((B, T), bool))
    ((match, decision),) = conductor.inspect(padded, *args, policy=FORCE)
    assert match.pattern == "attention" and not match.rewritable and not decision.rewrite
    assert match.details["problems"] == (
        "mask computed from inputs: it depends on the data (e.g. a padding mask), which no kernel here takes",
    )


def test_an_unmatched_candidate_says_why():
    def soft_capped(q, k, v):  # the logits are capped with tanh, which no kernel here does
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        s = 30.0 * jnp.tanh(s / 30.0)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    ((match, decision),) = conductor.inspect(soft_capped, *_inputs((B, T, H, D), (B, T, H, D)), policy=FORCE)
    assert match.pattern == "attention" and not match.rewritable and not decision.rewrite
    assert decision.reason == "not matched: the scores pass through tanh between Q·Kᵀ and the softmax"


def test_a_constant_mask_too_large_to_fold_says_so():
    seq = 8192  # traced only

    def cumsum_mask(q, k, v):  # a causal mask, but through a cumulative sum: folding it builds it whole
        keep = jnp.cumsum(jnp.eye(seq, dtype=jnp.int32), axis=0) > 0
        s = jnp.where(keep, jnp.einsum("bqhd,bkhd->bhqk", q, k), -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    spec = jax.ShapeDtypeStruct((1, seq, 2, 8), jnp.float32)
    ((match, decision),) = conductor.inspect(cumsum_mask, spec, spec, spec, policy=FORCE)
    assert not match.rewritable and not decision.rewrite
    assert match.details["problems"] == (f"mask is a constant cumsum of {seq * seq} elements, too large to fold",)


def test_matching_recurses_into_jit_remat_and_scan():
    inner = jax.checkpoint(jax.jit(einsum_mha))

    def layers(q, k, v):
        def body(x, _):
            return inner(x, k, v), None

        return jax.lax.scan(body, q, None, length=2)[0]

    args = _inputs((B, T, H, D), (B, T, H, D))
    found = conductor.inspect(layers, *args, policy=FORCE)
    assert [(m.pattern, m.path) for m, _ in found] == [("attention", ("scan", "remat"))]
    fast = conductor.optimize(layers, policy=FORCE)
    assert max_abs_diff(fast(*args), layers(*args)) <= 2e-6
    assert "f32[2,4,32,32]" in str(jax.make_jaxpr(layers)(*args))  # the written form builds the scores
    assert "f32[2,4,32,32]" not in str(jax.make_jaxpr(fast)(*args))  # the rewrite never does


def test_existing_pallas_call_is_reported_and_left_alone():
    def double(x_ref, o_ref):
        o_ref[...] = 2 * x_ref[...]

    def fn(x):
        return pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)

    ((match, decision),) = conductor.inspect(fn, jnp.ones((8, 8)))
    assert match.pattern == "pallas_call" and not decision.rewrite
    np.testing.assert_array_equal(conductor.optimize(fn)(jnp.ones((8, 8))), 2 * jnp.ones((8, 8)))


def test_plain_linear_recurrence_goes_parallel_only_where_it_pays():
    def ema(a, b, w):  # h_t = a_t h_{t-1} + b_t, time-major, with a per-step readout
        def body(h, x):
            h = x[0] * h + x[1]
            return h, jnp.tanh(h) * w

        return jax.lax.scan(body, jnp.ones(a.shape[1:]), (a, b))

    ks = jax.random.split(jax.random.key(0), 3)
    args = (
        jax.random.uniform(ks[0], (128, 4, 8)),
        jax.random.normal(ks[1], (128, 4, 8)),
        jax.random.normal(ks[2], (4, 8)),
    )
    ((match, on_cpu),) = conductor.inspect(ema, *args)
    assert match.pattern == "linear_recurrence" and not on_cpu.rewrite and on_cpu.scan_form == "sequential"
    tpu = conductor.Policy(device="tpu")
    ((_, on_tpu),) = conductor.inspect(ema, *args, policy=tpu)
    assert on_tpu.rewrite and on_tpu.scan_form == "parallel"
    parallel = conductor.optimize(ema, policy=tpu)  # the TPU's choice, run here on the CPU
    assert " scan[" not in str(jax.make_jaxpr(parallel)(*args))
    assert max_abs_diff(parallel(*args), ema(*args)) <= 1e-5


def test_attention_inside_custom_vjp_is_reported_not_rewritten():
    @jax.custom_vjp
    def user_attention(q, k, v):
        return einsum_mha(q, k, v)

    user_attention.defvjp(
        lambda q, k, v: (einsum_mha(q, k, v), (q, k, v)), lambda res, g: jax.vjp(einsum_mha, *res)[1](g)
    )
    args = _inputs((B, T, H, D), (B, T, H, D))
    ((match, decision),) = conductor.inspect(user_attention, *args, policy=FORCE)
    assert match.path == ("custom_vjp",) and not decision.rewrite
    assert "inside a custom_vjp body" in decision.reason
