"""optimize on the recipes: training matches, escape hatches, the numerics guard, decisions."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conductor
from recipes._registry import get_recipe
from recipes.train import synthetic_batch, train_step

FORCE = conductor.Policy(attention="force", selective_scan="force")


@pytest.mark.parametrize(("recipe", "pattern"), [("gpt-tiny", "attention"), ("mamba-tiny", "selective_scan")])
def test_recipe_trains_20_steps_with_the_conductor_like_without(recipe, pattern):
    r = get_recipe(recipe)
    state = r.create_state(jax.random.key(0), learning_rate=1e-3)
    fast_apply = conductor.optimize(state.apply_fn, policy=FORCE)
    batch = synthetic_batch(jax.random.key(1), 2, 32, r.config.vocab_size)
    found = fast_apply.inspect({"params": state.params}, batch["inputs"])
    assert [m.pattern for m, d in found if d.rewrite] == [pattern] * r.config.num_layers
    step = jax.jit(train_step)
    plain, fast = state, state.replace(apply_fn=fast_apply)
    losses_plain, losses_fast = [], []
    for i in range(20):
        batch = synthetic_batch(jax.random.key(i), 2, 32, r.config.vocab_size)
        plain, m_plain = step(plain, batch)
        fast, m_fast = step(fast, batch)
        losses_plain.append(float(m_plain["loss"]))
        losses_fast.append(float(m_fast["loss"]))
    np.testing.assert_allclose(losses_fast, losses_plain, rtol=0, atol=1e-4)
    assert losses_plain[-1] < losses_plain[0] - 0.3  # it trained


def _attn(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def test_policy_forbids_and_excludes_scopes():
    r = get_recipe("gpt-tiny")
    state = r.create_state(jax.random.key(0))
    tokens = jnp.zeros((1, 64), jnp.int32)
    excluded = conductor.inspect(
        state.apply_fn,
        {"params": state.params},
        tokens,
        policy=conductor.Policy(attention="force", exclude_scopes=("*/blocks_0/*",)),
    )
    assert [(m.scope, d.rewrite) for m, d in excluded] == [
        ("GPT/blocks_0/attn/attn.core_attention", False),
        ("GPT/blocks_1/attn/attn.core_attention", True),
    ]
    forbidden = conductor.inspect(
        state.apply_fn, {"params": state.params}, tokens, policy=conductor.Policy(attention="forbid")
    )
    assert [d.reason for _, d in forbidden] == ["attention forbidden by policy"] * 2


def test_guard_falls_back_with_a_warning_when_outputs_disagree():
    q = jax.random.normal(jax.random.key(0), (1, 64, 2, 16))
    strict = conductor.Policy(attention="force", guard_rtol=0.0, guard_atol=0.0)  # rounding differences fail
    fast = conductor.optimize(_attn, policy=strict)
    with pytest.warns(conductor.ConductorWarning, match="using the original"):
        out = fast(q, q, q)
    np.testing.assert_array_equal(out, _attn(q, q, q))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(fast(q, q, q), _attn(q, q, q))  # fallback sticks, no second warning
    lenient = conductor.optimize(_attn, policy=conductor.Policy(attention="force"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not np.array_equal(lenient(q, q, q), _attn(q, q, q))  # the kernel ran (rounding differs)


def test_decisions_follow_the_cost_model():
    spec = jax.ShapeDtypeStruct
    short = conductor.inspect(_attn, *[spec((1, 128, 8, 64), jnp.float32)] * 3)
    assert not short[0][1].rewrite and "fit on chip" in short[0][1].reason
    long = conductor.inspect(_attn, *[spec((1, 8192, 8, 64), jnp.float32)] * 3)
    decision = long[0][1]
    assert decision.rewrite and decision.implementation == "xla_chunked"
    assert decision.memory_bytes_written > 30 * decision.memory_bytes_rewritten
    on_tpu = conductor.inspect(_attn, *[spec((1, 8192, 8, 64), jnp.float32)] * 3, policy=conductor.Policy(device="tpu"))
    on_gpu = conductor.inspect(
        _attn, *[spec((1, 8192, 8, 64), jnp.float32)] * 3, policy=conductor.Policy(device="cuda")
    )
    assert on_tpu[0][1].implementation == on_gpu[0][1].implementation == "pallas"
    # blocks fit the device's on-chip memory: 16 MiB of VMEM takes bigger tiles than 164 KiB of shared memory
    assert on_tpu[0][1].block_sizes.block_q > on_gpu[0][1].block_sizes.block_q


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_kernel_called_without_blocks_on_a_gpu_uses_the_blocks_the_decision_model_picks(head_dim):
    """128 × 128 float32 tiles at head_dim 64 ask Triton for more shared memory than an H100 SM has
    (measured: 257 KiB requested, 227 KiB available); the default on a GPU is the decision model's block."""
    from conductor.kernels.attention import AttentionBlockSizes, default_block_sizes

    spec = jax.ShapeDtypeStruct((1, 8192, 8, head_dim), jnp.float32)
    on_gpu = conductor.inspect(_attn, spec, spec, spec, policy=conductor.Policy(device="cuda"))[0][1]
    assert default_block_sizes(head_dim, "cuda") == on_gpu.block_sizes
    assert default_block_sizes(head_dim, "cuda").block_q < 128
    assert default_block_sizes(head_dim, "cpu") == default_block_sizes(head_dim, "tpu") == AttentionBlockSizes()


def test_parallel_scan_form_only_where_it_pays():
    r = get_recipe("mamba-tiny")
    state = r.abstract_state()
    tokens = jax.ShapeDtypeStruct((2, 4096), jnp.int32)
    for device, form in (("cpu", "sequential"), ("tpu", "parallel"), ("gpu", "parallel")):
        found = conductor.inspect(
            state.apply_fn, {"params": state.params}, tokens, policy=conductor.Policy(device=device)
        )
        assert {(m.pattern, d.rewrite, d.scan_form) for m, d in found} == {("selective_scan", True, form)}


def test_unknown_device_is_one_line_error():
    with pytest.raises(ValueError, match="unknown device 'ipu'"):
        conductor.device_profile("ipu")


def test_capture_of_the_rewritten_step_sees_the_kernel_costs():
    """What ``orchestrate(..., conductor=True)`` relies on: capture traces the rewritten step, scopes intact."""
    from integrations.flax import capture
    from orchestrator.coarsen import coarsen

    r = get_recipe("gpt-tiny")
    state, batch = r.abstract_state(), r.batch_spec()
    fast = state.replace(apply_fn=conductor.optimize(state.apply_fn, policy=FORCE))
    plain_layers, fast_layers = (
        coarsen(capture(r.train_step, state, batch)),
        coarsen(capture(r.train_step, fast, batch)),
    )
    assert [layer.name for layer in fast_layers.layers] == [layer.name for layer in plain_layers.layers]
    plain_block, fast_block = plain_layers.layers[1], fast_layers.layers[1]
    assert fast_block.backward_flops > plain_block.backward_flops  # flash recomputes the scores in the backward


def test_optimize_of_a_train_step_rewrites_the_model_inside():
    r = get_recipe("gpt-tiny")
    state = r.create_state(jax.random.key(0))
    batch = synthetic_batch(jax.random.key(1), 2, 64, r.config.vocab_size)
    fast_step = conductor.optimize(train_step, policy=FORCE)
    assert "f32[2,4,64,64]" in str(jax.make_jaxpr(train_step)(state, batch))  # (batch, heads, T, T) scores
    assert "f32[2,4,64,64]" not in str(jax.make_jaxpr(fast_step)(state, batch))
    _, plain = jax.jit(train_step)(state, batch)
    new_state, fast = jax.jit(fast_step)(state, batch)
    assert new_state.apply_fn is state.apply_fn  # the caller's state structure comes back
    np.testing.assert_allclose(float(fast["loss"]), float(plain["loss"]), atol=1e-5)


def test_inspect_of_a_train_step_reports_what_each_rewrite_replaces():
    r = get_recipe("mamba-tiny")
    state, batch = r.abstract_state(), r.batch_spec(2, 256)
    found = conductor.inspect(train_step, state, batch)  # the model's scans, as optimize(train_step) rewrites them
    assert [(m.pattern, m.scope, d.rewrite) for m, d in found] == [
        ("selective_scan", f"Mamba/layers_{i}/mixer/mixer.core_scan", True) for i in range(r.config.num_layers)
    ]
    b, t, di, n = 2, 256, r.config.d_inner, r.config.d_state
    for _, decision in found:  # the (B, T, D, N) discretisation and the scan over time are what goes
        assert f"exp float32[{b},{t},{di},{n}]" in decision.replaced
        assert any(e.startswith("scan ") for e in decision.replaced)
        assert not any(e.startswith("dot_general") for e in decision.replaced)  # the projections stay


def test_the_fused_scan_keeps_no_state_and_fewer_activations_for_the_backward():
    from recipes.train import loss_fn

    r = get_recipe("mamba-tiny")
    state, batch = r.abstract_state(), r.batch_spec(2, 256)
    b, t, di, n = 2, 256, r.config.d_inner, r.config.d_state

    def kept(apply):  # the shapes the backward pass keeps from the forward
        def residuals(params, data):
            return jax.tree.leaves(jax.vjp(lambda p: loss_fn(p, apply, data), params)[1])

        found = jax.eval_shape(residuals, state.params, batch)
        return [tuple(a.shape) for a in found]

    written, fused = kept(state.apply_fn), kept(conductor.optimize(state.apply_fn))
    assert (b, t, di, n) in written and (b, t, di, n) not in fused  # no (B, T, D, N) tensor is kept
    activations = (b, t, di)  # the softplus, Δ·x, the skip and the gate are recomputed, not kept
    assert fused.count(activations) < written.count(activations) - 3, (written.count(activations), fused)


def test_the_pallas_scan_runs_its_forward_kernel_once_per_layer():
    import re

    from recipes.train import loss_fn

    r = get_recipe("mamba-tiny")
    state, batch = r.abstract_state(), r.batch_spec(2, 256)
    fast = conductor.optimize(state.apply_fn, policy=conductor.Policy(implementation="pallas"))
    text = str(jax.make_jaxpr(jax.grad(lambda p, b: loss_fn(p, fast, b)))(state.params, batch))
    assert len(re.findall("name=conductor_scan_fwd", text)) == r.config.num_layers  # not again in the backward
    assert len(re.findall("name=conductor_scan_bwd", text)) == r.config.num_layers
