import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recipes import RECIPES, RecipeRun, get_recipe, synthetic_batch


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_preset_parameter_counts_are_exact(name):
    recipe = get_recipe(name)
    state = recipe.abstract_state()
    count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(state.params))
    assert count == recipe.config.param_count()


def test_gpt2_small_has_124m_parameters():
    assert get_recipe("gpt2-small").config.param_count() == 124_439_808


def test_unknown_recipe_lists_the_known_ones():
    with pytest.raises(KeyError, match="gpt2-small"):
        get_recipe("gpt-5")


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "mamba-tiny"])
def test_tiny_recipe_learns_the_synthetic_task(name):
    recipe = get_recipe(name)
    state = recipe.create_state(jax.random.key(0), learning_rate=3e-3)
    step = jax.jit(recipe.train_step)
    losses = []
    for i in range(200):
        batch = synthetic_batch(jax.random.key(i), 16, 32, recipe.config.vocab_size)
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    losses = [float(loss) for loss in losses]
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    print(f"{name}: loss {first:.3f} -> {last:.3f}")
    assert first > 0.9 * np.log(recipe.config.vocab_size)
    assert last < 0.25 * first


def test_mamba_selective_scan_matches_a_python_loop():
    from recipes.mamba import selective_scan

    k = jax.random.split(jax.random.key(0), 3)
    a = jax.random.uniform(k[0], (2, 5, 3, 4))
    bx = jax.random.normal(k[1], (2, 5, 3, 4))
    c = jax.random.normal(k[2], (2, 5, 4))
    h = jnp.zeros((2, 3, 4))
    ys = []
    for t in range(5):
        h = a[:, t] * h + bx[:, t]
        ys.append(jnp.einsum("bdn,bn->bd", h, c[:, t]))
    np.testing.assert_allclose(selective_scan(a, bx, c), jnp.stack(ys, 1), rtol=1e-6)


def test_gpt_refuses_too_long_sequences():
    recipe = get_recipe("gpt-tiny")
    state = recipe.create_state(jax.random.key(0))
    with pytest.raises(ValueError, match="max_seq_len"):
        state.apply_fn({"params": state.params}, jnp.zeros((1, 65), jnp.int32))


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "mamba-tiny"])
def test_param_axes_are_the_logical_axes_integrations_reads(name):
    from integrations.flax import param_logical_axes

    recipe = get_recipe(name)
    boxed = jax.eval_shape(recipe.model().init, jax.random.key(0), jax.ShapeDtypeStruct((1, 8), jnp.int32))
    assert recipe.param_axes() == param_logical_axes(boxed["params"])


def test_a_recipe_run_is_a_pure_function_of_its_json():
    run = RecipeRun(recipe="gpt-tiny", global_batch=4, seq_len=16, seed=3)
    again = RecipeRun.from_json(run.to_json())
    assert again == run
    np.testing.assert_array_equal(run.batch(5)["inputs"], again.batch(5)["inputs"])
    assert run.batch(5)["inputs"].shape == (4, 16)
    jax.tree.map(np.testing.assert_array_equal, run.init_state().params, again.init_state().params)
    assert run.param_axes()["blocks_0/mlp/c_fc/kernel"] == ("embed", "mlp")
    assert RecipeRun(recipe="mamba-tiny", global_batch=4, seq_len=16).param_axes() is None


def test_a_recipe_run_refuses_bad_fields():
    with pytest.raises(KeyError, match="gpt2-small"):
        RecipeRun(recipe="gpt-5", global_batch=4, seq_len=16)
    with pytest.raises(ValueError, match="global_batch"):
        RecipeRun(recipe="gpt-tiny", global_batch=0, seq_len=16)
    with pytest.raises(TypeError):
        RecipeRun.from_json({"recipe": "gpt-tiny", "global_batch": 4})


def test_llama_presets_have_their_published_parameter_counts():
    """Llama 3 8B and 405B (Dubey et al. 2024): 8.0B and 405.9B parameters with untied heads."""
    assert get_recipe("llama3-8b").config.param_count() == 8_030_261_248
    assert round(get_recipe("llama3-405b").config.param_count() / 1e9, 1) == 405.9


def test_grouped_query_attention_equals_jax_attention_with_shared_kv_heads():
    from recipes.gpt import grouped_causal_attention

    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, 16, 8, 4))
    k, v = (jax.random.normal(key, (2, 16, 2, 4)) for key in (kk, kv))
    expected = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(grouped_causal_attention(q, k, v), expected, rtol=1e-5, atol=1e-6)


def test_rotary_scores_depend_on_the_distance_between_positions_only():
    """⟨rot(q, m), rot(k, n)⟩ is a function of m − n: the same q and k at every position give
    scores constant along each diagonal; rotation keeps norms."""
    from recipes.gpt import rotary

    q = jnp.broadcast_to(jax.random.normal(jax.random.key(1), (8,)), (1, 12, 1, 8))
    k = jnp.broadcast_to(jax.random.normal(jax.random.key(2), (8,)), (1, 12, 1, 8))
    rq, rk = rotary(q, 10_000.0), rotary(k, 10_000.0)
    scores = np.asarray(jnp.einsum("bqhd,bkhd->qk", rq, rk))
    for offset in range(-11, 12):
        diagonal = np.diagonal(scores, offset)
        np.testing.assert_allclose(diagonal, diagonal[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(jnp.linalg.norm(rq, axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-5)


def test_gpt_options_of_the_llama_architecture_need_llama():
    from recipes import GPTConfig

    with pytest.raises(ValueError, match="llama=True"):
        GPTConfig(vocab_size=8, max_seq_len=8, num_layers=1, num_heads=2, d_model=8, num_kv_heads=1)
    with pytest.raises(ValueError, match="divisible by num_kv_heads"):
        GPTConfig(vocab_size=8, max_seq_len=8, num_layers=1, num_heads=4, d_model=8, llama=True, num_kv_heads=3)


@pytest.mark.parametrize("name", ["gpt-tiny", "mamba-tiny"])
def test_the_abstract_state_is_create_states_and_shares_one_abstract_init_with_the_axes(name, monkeypatch):
    """``abstract_state`` has ``create_state``'s leaves (paths, shapes, dtypes); it and ``param_axes``
    trace the model's init once between them (a large model's init takes seconds to trace)."""
    import dataclasses

    import flax.linen as nn

    recipe = dataclasses.replace(get_recipe(name), batch_size=3)  # (a recipe no earlier test has read)
    traced, init = [], nn.Module.init

    def counted(self, *args, **kwargs):
        traced.append(type(self).__name__)
        return init(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "init", counted)
    state, axes, again = recipe.abstract_state(), recipe.param_axes(), recipe.abstract_state(learning_rate=1e-3)
    assert len(traced) == 1
    made = jax.eval_shape(recipe.create_state, jax.random.key(0))
    for ours, theirs in (state, made), (again, made):
        ours, theirs = jax.tree_util.tree_flatten_with_path(ours)[0], jax.tree_util.tree_flatten_with_path(theirs)[0]
        assert [(p, x.shape, x.dtype) for p, x in ours] == [(p, x.shape, x.dtype) for p, x in theirs]
    assert set(axes) == {
        "/".join(str(k.key) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(made.params)[0]
    }
