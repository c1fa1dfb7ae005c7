"""A sequence-sharded scan in the cost model: the carry's bytes (one formula with the conductor's),
its exposed time, and a Mamba layer's memory falling with the context-parallel degree."""

import pytest

from conductor.kernels.scan import scan_carry_bytes as conductor_carry_bytes
from conductor.kernels.scan import scan_state_bytes as conductor_state_bytes
from integrations.flax import capture
from orchestrator.cluster import Link, load_cluster
from orchestrator.coarsen import coarsen
from orchestrator.costs import (
    CostModel,
    ParallelConfig,
    scan_carry_bytes,
    scan_carry_cost,
    scan_state_bytes,
)
from recipes import MambaConfig, Recipe, get_recipe

CONFIG = MambaConfig(vocab_size=64, num_layers=2, d_model=16, d_state=4)
SEQ = 1024


@pytest.mark.parametrize("batch, d_inner, d_state", [(1, 1536, 16), (2, 32, 4), (3, 7, 5)])
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("backward", [False, True])
def test_the_carry_bytes_are_the_conductors(batch, d_inner, d_state, n, backward):
    assert scan_state_bytes(batch, d_inner, d_state) == conductor_state_bytes(batch, d_inner, d_state)
    mine = scan_carry_bytes(batch, d_inner, d_state, n, backward=backward)
    assert mine == conductor_carry_bytes(batch, d_inner, d_state, n, backward=backward)


def test_the_carry_is_one_all_gather_and_one_reduce_scatter_exposed_whole():
    link = Link(bandwidth_bytes_per_s=1e9, latency_s=1e-5)
    cost = scan_carry_cost(batch=2, d_inner=32, d_state=4, n=8, link=link)
    message = 2 * 32 * 5 * 4
    assert cost.forward_s == cost.backward_s == pytest.approx(7 * (1e-5 + message / 1e9))
    assert cost.bytes_sent == 2 * 7 * message and cost.extra_memory_bytes == 8 * message
    with pytest.raises(ValueError, match="n >= 2"):
        scan_carry_cost(batch=2, d_inner=32, d_state=4, n=1, link=link)


@pytest.fixture(scope="module")
def mamba():
    recipe = Recipe(name="mamba-carry", config=CONFIG, batch_size=2, seq_len=SEQ)
    graph = capture(recipe.train_step, recipe.abstract_state(), recipe.batch_spec())
    return CostModel(graph, coarsen(graph), load_cluster("tests/clusters/small-cpu-8.yaml"), batch_size=2)


def test_a_mamba_layer_prices_its_carry_and_holds_1_over_n_of_its_scan(mamba):
    block = next(i for i, layer in enumerate(mamba.layers) if "layers_" in layer.name)
    assert mamba.scan_state(block) == (SEQ, CONFIG.d_inner, CONFIG.d_state)
    assert mamba.scan_state(0) is None  # the embedding loops over nothing
    assert mamba.context_length() == SEQ and mamba.attention_length() is None
    link = mamba.default_link("small")
    whole = mamba.layer_cost(block, "small", ParallelConfig(microbatch_size=2, recompute=True))
    assert whole.cp_comm_s == 0 and whole.breakdown["cp_bytes"] == 0
    dynamic = {1: whole.activation_bytes + whole.transient_bytes}
    for n in (2, 4, 8):
        config = ParallelConfig(microbatch_size=2, recompute=True, context_parallel=n)
        split = mamba.layer_cost(block, "small", config)
        carry = scan_carry_cost(batch=2, d_inner=CONFIG.d_inner, d_state=CONFIG.d_state, n=n, link=link)
        assert split.breakdown["cp_bytes"] == scan_carry_bytes(2, CONFIG.d_inner, CONFIG.d_state, n, backward=True)
        # recomputing, the rebuilt forward gathers the carry again
        assert split.cp_comm_s == pytest.approx(2 * carry.forward_s + carry.backward_s)
        assert split.cp_form is None
        dynamic[n] = split.activation_bytes + split.transient_bytes - carry.extra_memory_bytes
    # the scan's working set, (B, T, D, N) per tensor, falls as 1/n: memory is w/n + f, where f, a
    # few per-layer buffers of parameter shape, is under 0.1% of w
    scaled, fixed = 2 * (dynamic[1] - dynamic[2]), 2 * dynamic[2] - dynamic[1]
    assert 0 <= fixed < 1e-3 * scaled
    for n in (4, 8):
        assert dynamic[n] == pytest.approx(scaled / n + fixed, rel=1e-6)


def test_an_attention_model_has_no_scan():
    recipe = get_recipe("gpt-tiny")
    graph = capture(recipe.train_step, recipe.abstract_state(), recipe.batch_spec())
    model = CostModel(graph, coarsen(graph), load_cluster("a100x8"), batch_size=8)
    assert all(model.scan_state(i) is None for i in range(len(model.layers)))
    assert model.context_length() == model.attention_length() == recipe.seq_len
