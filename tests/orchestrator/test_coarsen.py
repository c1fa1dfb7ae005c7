import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training.train_state import TrainState
from hypothesis import given, settings
from hypothesis import strategies as st

from integrations.flax import capture
from orchestrator.coarsen import LayerGraph, coarsen
from orchestrator.graph import Op, OpGraph
from recipes import get_recipe


def _layers(name, batch=2, seq=64):
    recipe = get_recipe(name)
    graph = capture(recipe.train_step, recipe.abstract_state(), recipe.batch_spec(batch, seq))
    return recipe, graph, coarsen(graph)


def test_gpt2_small_is_embedding_twelve_blocks_and_head():
    _, graph, layers = _layers("gpt2-small")
    names = [layer.name for layer in layers]
    assert names == ["GPT/wte+wpe"] + [f"GPT/blocks_{i}" for i in range(12)] + ["GPT/ln_f+wte.attend"]
    assert list(layers.repeated().values()) == [list(range(1, 13))]
    assert layers.totals()["distinct_layers"] == 3
    assert sum(layer.param_bytes for layer in layers) == graph.param_bytes
    assert layers.totals()["flops"] == pytest.approx(graph.total_flops())
    assert layers.is_chain()
    # the residual stream (batch, seq, d_model) fp32 crosses every cut but the last
    assert layers.cut_bytes() == [2 * 64 * 768 * 4] * 13 + [0]


@pytest.mark.parametrize("name", ["mamba-tiny", "mamba-130m", "mamba-370m", "mamba-1.4b", "mamba-2.8b"])
def test_mamba_presets_find_their_blocks(name):
    recipe, _, layers = _layers(name, batch=1, seq=16)
    n = recipe.config.num_layers
    assert len(layers) == n + 2
    assert [layer.name for layer in layers[1:-1]] == [f"Mamba/layers_{i}" for i in range(n)]
    assert list(layers.repeated().values()) == [list(range(1, n + 1))]


def test_optimizer_update_lands_with_its_layer():
    _, _, layers = _layers("gpt-tiny")
    for layer in layers[1:-1]:
        assert layer.optimizer_flops > 0
        assert layer.backward_flops > layer.forward_flops


class ResidualMLP(nn.Module):
    depth: int = 4

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32, name="stem")(x)
        for i in range(self.depth):
            h = nn.Dense(64, name=f"res_{i}_up")(nn.LayerNorm(name=f"res_{i}_norm")(x))
            x = x + nn.Dense(32, name=f"res_{i}_down")(nn.gelu(h))
        return nn.Dense(10, name="readout")(x)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(2 * x.shape[-1])(x)))


class BlockMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32, name="stem")(x)
        for _ in range(3):
            x = Block()(x)  # auto-named Block_0, Block_1, Block_2
        return nn.Dense(10, name="readout")(x)


def _step_graph(model, features=16):
    x = jnp.ones((8, features))
    params = model.init(jax.random.key(0), x)["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))

    def step(state, x):
        grads = jax.grad(lambda p: (state.apply_fn({"params": p}, x) ** 2).mean())(state.params)
        return state.apply_gradients(grads=grads)

    return capture(step, state, x)


def test_auto_named_flax_blocks_are_layers():
    layers = coarsen(_step_graph(BlockMLP()))
    assert [layer.name for layer in layers] == [
        "BlockMLP/stem",
        "BlockMLP/Block_0",
        "BlockMLP/Block_1",
        "BlockMLP/Block_2",
        "BlockMLP/readout",
    ]
    assert list(layers.repeated().values()) == [[1, 2, 3]]


def test_numbered_unit_families_form_blocks():
    graph = _step_graph(ResidualMLP())
    layers = coarsen(graph)
    expected = ["stem"] + [f"res_{i}" for i in range(4)] + ["readout"]
    assert [layer.name for layer in layers] == [f"ResidualMLP/{n}" for n in expected]
    assert list(layers.repeated().values()) == [[1, 2, 3, 4]]
    assert sum(layer.param_bytes for layer in layers) == graph.param_bytes


class Unnumbered(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32, name="stem")(x)
        x = nn.Dense(32, name="middle")(nn.relu(x))
        return nn.Dense(10, name="readout")(nn.relu(x))


def test_without_blocks_every_unit_is_a_layer():
    layers = coarsen(_step_graph(Unnumbered()))
    assert [layer.name for layer in layers] == ["Unnumbered/stem", "Unnumbered/middle", "Unnumbered/readout"]


def test_unscoped_graph_falls_back_to_balanced_cuts():
    def f(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x.sum()

    ws = [jnp.ones((64, 64))] * 8
    graph = capture(jax.grad(f), ws, jnp.ones((4, 64)))
    layers = coarsen(graph, fallback_layers=4)
    assert [layer.name for layer in layers] == [f"layer_{i}" for i in range(4)]
    forward = [layer.forward_flops for layer in layers]
    assert max(forward) <= 1.5 * min(forward)
    assert sum(layer.flops for layer in layers) == pytest.approx(graph.total_flops())


def test_layer_graph_json_round_trip(tmp_path):
    _, _, layers = _layers("gpt-tiny")
    layers.save(tmp_path / "layers.json")
    again = LayerGraph.load(tmp_path / "layers.json")
    assert again.to_json() == layers.to_json()
    assert again.cut_bytes() == layers.cut_bytes()


def test_empty_graph_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        coarsen(OpGraph())


def test_single_op_graph_is_one_layer():
    g = OpGraph()
    g.add_op(Op(name="a", kind="matmul", primitive="dot_general", flops=1.0))
    layers = coarsen(g)
    assert len(layers) == 1 and layers[0].flops == 1.0


def _scoped_chain(scopes: list[str]) -> OpGraph:
    """A forward chain of one matmul per scope (backward mirrored), edges between neighbours."""
    g = OpGraph()
    names = []
    for phase, order in (("forward", scopes), ("backward", scopes[::-1])):
        for i, scope in enumerate(order):
            name = f"{phase}_{i}"
            g.add_op(Op(name=name, kind="matmul", primitive="dot_general", flops=2.0, scope=scope, phase=phase))
            if names:
                g.add_edge(names[-1], name, nbytes=4)
            names.append(name)
    return g


@pytest.mark.parametrize(
    ("before", "block", "after"),
    [
        (
            ["model/transformer/wte", "model/transformer/wpe"],
            "model/transformer/h_{}",
            ["model/transformer/ln_f", "lm_head"],
        ),
        (["encoder/embed"], "encoder/layers_{}", ["encoder/norm", "head"]),
        (["embed"], "layers_{}", ["head"]),
    ],
)
def test_blocks_are_found_at_any_depth(before, block, after):
    inner = [f"{block}/attn/q", f"{block}/attn/o", f"{block}/mlp"]
    scopes = before + [s.format(i) for i in range(6) for s in inner] + after
    layers = coarsen(_scoped_chain([f"Net/{s}" for s in scopes] + ["Net"]))
    names = [layer.name for layer in layers]
    assert names == ["Net/" + "+".join(before)] + [f"Net/{block.format(i)}" for i in range(6)] + [
        "Net/" + "+".join(after)
    ]
    assert list(range(1, 7)) in layers.repeated().values()


def test_a_family_inside_a_block_stays_in_the_block():
    """T5-style ``block_<n>/layer_<m>``: the outer family makes the layers."""
    scopes = ["embed"] + [f"encoder/block_{i}/layer_{j}" for i in range(3) for j in range(2)] + ["head"]
    layers = coarsen(_scoped_chain([f"Net/{s}" for s in scopes]))
    assert [layer.name for layer in layers] == ["Net/embed"] + [f"Net/encoder/block_{i}" for i in range(3)] + [
        "Net/head"
    ]


def test_glue_at_a_scope_enclosing_blocks_joins_a_neighbour():
    scopes = ["embed", "stack"] + [f"stack/layers_{i}" for i in range(3)] + ["stack", "head"]
    layers = coarsen(_scoped_chain([f"Net/{s}" for s in scopes]))
    assert [layer.name for layer in layers] == ["Net/embed"] + [f"Net/stack/layers_{i}" for i in range(3)] + [
        "Net/head"
    ]
    assert sum(len(layer.ops) for layer in layers) == 2 * len(scopes)


class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(3):
            x = x + nn.Dense(x.shape[-1], name=f"layers_{i}")(nn.gelu(x))
        return nn.LayerNorm(name="norm")(x)


class Nested(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32, name="embed")(x)
        return nn.Dense(10, name="head")(Stack(name="encoder")(x))


def test_flax_blocks_one_scope_deeper():
    layers = coarsen(_step_graph(Nested()))
    assert [layer.name for layer in layers] == (
        ["Nested/embed"] + [f"Nested/encoder/layers_{i}" for i in range(3)] + ["Nested/encoder/norm+head"]
    )
    assert list(layers.repeated().values()) == [[1, 2, 3]]


_NAMES = st.sampled_from(["model", "transformer", "encoder", "stack", "body"])


@settings(max_examples=40, deadline=None)
@given(
    path=st.lists(_NAMES, max_size=3),
    prefix=st.sampled_from(["h", "layers", "blocks", "block"]),
    count=st.integers(2, 6),
    inner=st.lists(st.sampled_from(["attn", "mlp", "norm"]), min_size=1, max_size=3, unique=True),
)
def test_blocks_at_any_depth_property(path, prefix, count, inner):
    """Embedding, ``count`` blocks wherever they sit, head: every op in exactly one layer."""
    parent = "/".join(path)
    at = f"{parent}/" if parent else ""
    blocks = [f"{at}{prefix}_{i}" for i in range(count)]
    scopes = [f"{at}wte"] + [f"{block}/{part}" for block in blocks for part in inner] + ["lm_head"]
    graph = _scoped_chain([f"Net/{s}" for s in scopes] + ["Net"])
    layers = coarsen(graph)
    assert [layer.name for layer in layers] == [f"Net/{at}wte"] + [f"Net/{b}" for b in blocks] + ["Net/lm_head"]
    assert sorted(op for layer in layers for op in layer.ops) == sorted(op.name for op in graph.ops())
