"""Capture of torch models into op-graphs: parity with the Flax recipe, flop_counter, scopes, errors."""

import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from integrations.flax import capture as capture_flax
from integrations.torch_xla import CaptureWarning, capture, scope_path
from orchestrator.coarsen import coarsen
from orchestrator.graph import OpGraph
from recipes import get_recipe
from recipes.torch_gpt import GPT, loss_fn, param_axes

BATCH, SEQ = 8, 64


@pytest.fixture(scope="module")
def graphs():
    recipe = get_recipe("gpt-tiny")
    with torch.device("meta"):
        model = GPT(recipe.config)
    tokens = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    torch_graph = capture(model, tokens, tokens, loss_fn=loss_fn)
    flax_graph = capture_flax(recipe.train_step, recipe.abstract_state(), recipe.batch_spec(BATCH, SEQ))
    return recipe, model, tokens, torch_graph, flax_graph


def test_flops_match_flax_capture(graphs):
    _, _, _, g, fg = graphs
    assert g.total_flops() == pytest.approx(fg.total_flops(), rel=0.02)
    for phase in ("forward", "backward"):
        assert g.total_flops(phase=phase) == pytest.approx(fg.total_flops(phase=phase), rel=0.02)
    assert g.total_flops(kind="matmul") == fg.total_flops(kind="matmul")


def test_matmul_flops_match_torch_flop_counter(graphs):
    _, model, tokens, g, _ = graphs
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(tokens), tokens).backward()
    assert g.total_flops(kind="matmul") == pytest.approx(counter.get_total_flops(), rel=0.02)


def test_parameters_exact_and_named_as_flax(graphs):
    recipe, _, _, g, fg = graphs
    assert g.param_bytes == 4 * recipe.config.param_count() == fg.param_bytes
    assert {p: s.shape for p, s in g.params.items()} == {p: s.shape for p, s in fg.params.items()}
    assert param_axes(recipe.config) == recipe.param_axes()
    assert sum(op.param_bytes for op in g.ops()) == g.param_bytes
    # AdamW: two fp32 moments per parameter plus a float32 step per tensor
    assert g.meta["optimizer_state_bytes"] == 2 * g.param_bytes + 4 * len(g.params)


def test_phases_and_scopes(graphs):
    _, _, _, g, _ = graphs
    assert set(g.flops_by("phase")) == {"forward", "backward", "optimizer"}
    assert g.is_dag()
    scopes = {op.scope for op in g.ops() if op.phase == "backward"}
    assert "GPT/blocks_1/mlp/c_fc" in scopes and "GPT/blocks_0/attn" in scopes
    updates = [op for op in g.ops() if op.phase == "optimizer"]
    assert len(updates) == len(g.params)
    assert all(g.nx.in_degree(op.name) == 1 for op in updates)  # fed by its gradient


def test_coarsening_finds_the_flax_layers(graphs):
    _, _, _, g, fg = graphs
    layers, flax_layers = coarsen(g), coarsen(fg)
    assert len(layers) == len(flax_layers) == 4
    assert [layer.name for layer in layers][:-1] == [layer.name for layer in flax_layers][:-1]
    assert layers[-1].name == "GPT/ln_f+head"  # Flax: "GPT/ln_f+wte.attend"
    assert [layer.param_bytes for layer in layers] == [layer.param_bytes for layer in flax_layers]
    assert [sorted(layer.params) for layer in layers] == [sorted(layer.params) for layer in flax_layers]
    for ours, theirs in zip(layers, flax_layers):
        # Flax's Embed looks up with jnp.take: negative indices wrap (integer lt/add/select per index)
        # and the gather is fill-mode (a bounds check per index, a select per element); torch's
        # embedding lookup runs neither
        lookup = sum(
            fg.op(n).flops
            for n in theirs.ops
            if fg.op(n).primitive == "gather" or fg.op(n).outputs[0].dtype.startswith(("int", "bool"))
        )
        assert ours.forward_flops + ours.backward_flops == pytest.approx(
            theirs.forward_flops + theirs.backward_flops - lookup, rel=0.02
        )
    assert list(layers.repeated().values()) == [[1, 2]] == list(flax_layers.repeated().values())


def test_json_round_trip(graphs):
    _, _, _, g, _ = graphs
    assert OpGraph.from_json(g.to_json()) == g


def test_scope_path():
    assert scope_path("blocks.3.attn.c_attn") == "blocks_3/attn/c_attn"
    assert scope_path("blocks.10.mlp.c_fc.kernel") == "blocks_10/mlp/c_fc/kernel"
    assert scope_path("") == ""


def test_forward_only_and_loss_errors():
    lin = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match="scalar loss"):
        capture(lin, torch.ones(3, 4))
    with pytest.raises(ValueError, match="optimizer"):
        capture(lin, torch.ones(3, 4), torch.ones(3, 2), loss_fn=torch.nn.functional.mse_loss, optimizer="lion")


def test_small_model_counts():
    lin = torch.nn.Linear(4, 2)
    g = capture(lin, torch.ones(3, 4), torch.ones(3, 2), loss_fn=torch.nn.functional.mse_loss, optimizer="sgd")
    # forward addmm: 2·3·2·4 + 3·2 (bias); backward: input gradient is not needed, weight gradient 2·2·4·3
    matmuls = [op for op in g.ops() if op.kind == "matmul"]
    assert [op.flops for op in matmuls] == [2 * 3 * 2 * 4 + 3 * 2, 2 * 2 * 4 * 3]
    assert [op.phase for op in matmuls] == ["forward", "backward"]
    assert g.total_flops(phase="optimizer") == 2 * (4 * 2 + 2)
    assert set(g.params) == {"weight", "bias"}


def test_unknown_op_warns_and_counts_conservatively():
    class ArcTangent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(5))

        def forward(self, x):
            return torch.atan(x * self.w).sum()

    with pytest.warns(CaptureWarning, match="atan"):
        g = capture(ArcTangent(), torch.ones(5))
    assert g.meta["unknown_primitives"]["aten.atan"] >= 1


def test_importing_orchestrator_does_not_import_torch():
    code = (
        "import sys, orchestrator, integrations, orchestrator.cli._app, orchestrator.cli._torch\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
