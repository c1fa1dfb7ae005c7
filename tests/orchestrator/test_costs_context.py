"""Context parallelism in the cost model: the m/n rule, the ring's priced bytes against the compiled
kernel's collective-permutes, overlap with the block computation, and the gradient sync over DP×CP."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from conductor.kernels import AttentionBlockSizes
from conductor.kernels.ring import attention_flops_per_device, ring_attention
from integrations.flax import capture
from orchestrator.cluster import Link, load_cluster
from orchestrator.coarsen import coarsen
from orchestrator.costs import (
    CostModel,
    ParallelConfig,
    block_bytes,
    choose_context_parallel,
    context_parallel_cost,
    ring_permute_bytes,
)
from orchestrator.costs._context import (
    RING_BLOCK,
    blockwise_attention_s,
    masked_by_position,
    ring_attention_work,
    ring_tile_fraction,
)
from recipes import get_recipe

BLOCK = 1  # gpt-tiny's first transformer block (layer 0 is the embedding)


@pytest.fixture(scope="module")
def tiny():
    recipe = get_recipe("gpt-tiny")
    graph = capture(recipe.train_step, recipe.abstract_state(), recipe.batch_spec())
    model = CostModel(graph, coarsen(graph), load_cluster("a100x8"), batch_size=8, param_axes=recipe.param_axes())
    return recipe, model


def test_the_cost_model_picks_textbook_forms():
    long = dict(batch=1, seq_len=131072, heads=32, kv_heads=8, head_dim=128, n=8, causal=True, itemsize=2)
    fast = dict(flops_per_s=4e14, bandwidth_bytes_per_s=2.5e10, latency_s=5e-6)
    choice = choose_context_parallel(**long, **fast)
    assert choice.form == "ring"  # a step sends 67 MB of K/V twice and dK/dV once: 11 ms behind 19 ms of compute
    short = dict(long, seq_len=4096, kv_heads=1)
    assert choose_context_parallel(**short, **fast).form == "all_gather"  # tiny blocks: per-step overhead dominates
    tight = choose_context_parallel(**short, **fast, memory_budget_bytes=1024)
    assert tight.form == "ring"
    assert "exceeds the budget" in tight.reason
    assert choice.ring.bytes_sent > choice.all_gather.bytes_sent  # the ring sends dK/dV, the gather reduce-scatters
    with pytest.raises(ValueError, match="n >= 2"):
        choose_context_parallel(**dict(long, n=1), **fast)


def test_a_step_exposes_only_the_send_its_block_does_not_hide():
    link = Link(bandwidth_bytes_per_s=1e9, latency_s=0.0)
    kv, grads = 1e6, 2e6  # 1 ms and 2 ms on the link
    hidden = context_parallel_cost(
        n=4, kv_bytes=kv, grad_bytes=grads, step_forward_s=2e-3, step_backward_s=5e-3, link=link, step_overhead_s=0.0
    )
    assert hidden.ring.exposed_s == 0.0
    assert hidden.ring.time_s == pytest.approx(4 * 7e-3)
    slow = context_parallel_cost(
        n=4, kv_bytes=kv, grad_bytes=grads, step_forward_s=0.5e-3, step_backward_s=1e-3, link=link, step_overhead_s=0.0
    )
    # forward: 3 steps of (1 − 0.5) ms; backward: 3 steps of (1 + 2 − 1) ms
    assert slow.ring.exposed_forward_s == pytest.approx(3 * 0.5e-3)
    assert slow.ring.exposed_backward_s == pytest.approx(3 * 2e-3)
    # the all-gather hides behind the local block only: 3 ms of gather each way
    assert slow.all_gather.exposed_forward_s == pytest.approx(3e-3 - 0.5e-3)
    assert slow.ring.extra_memory_bytes == 2 * kv and slow.all_gather.extra_memory_bytes == 3 * kv


def test_each_device_does_the_work_of_m_over_n_samples(tiny):
    """Under CP n a layer's compute and activations are those of microbatch m/n on one device, its
    attention's T × T work run by the ring's blockwise kernels instead, which write no scores; an
    attention layer adds the ring's exposed communication and its K/V blocks' memory."""
    _, model = tiny
    whole = model.layer_cost(BLOCK, "a100", ParallelConfig(microbatch_size=4))
    split = model.layer_cost(BLOCK, "a100", ParallelConfig(microbatch_size=8, context_parallel=2))
    square_f, square_b = model._square_ops(BLOCK)
    rest_f = whole.forward_s - model._core_time(BLOCK, "a100", 1, 4, square_f)
    rest_b = whole.backward_s - model._core_time(BLOCK, "a100", 1, 4, square_b, "backward")
    assert 0 < rest_f < whole.forward_s and 0 < rest_b < whole.backward_s
    assert split.forward_s == pytest.approx(rest_f + split.breakdown["cp_attention_forward_s"])
    assert split.backward_s == pytest.approx(rest_b + split.breakdown["cp_attention_backward_s"])
    assert split.breakdown["cp_attention_backward_s"] == pytest.approx(2.5 * split.breakdown["cp_attention_forward_s"])
    kept, transient = model._memory(BLOCK, 1, 4, blockwise=True)  # m/n samples, no scores
    assert split.activation_bytes == pytest.approx(kept) and kept < whole.activation_bytes
    assert split.output_activation_bytes == pytest.approx(whole.output_activation_bytes)
    assert split.param_bytes == whole.param_bytes
    assert split.cp_form in ("ring", "all_gather") and split.cp_comm_s > 0.0  # κ per step at least
    extra = split.transient_bytes - transient
    kv = block_bytes(8, 64, 2, 4, 16, 4)  # microbatch 8, T = 64 over 2, 4 heads of 16, fp32
    assert extra == (2 * kv if split.cp_form == "ring" else kv)
    embedding = model.layer_cost(0, "a100", ParallelConfig(microbatch_size=8, context_parallel=2))
    assert embedding.cp_form is None and embedding.cp_comm_s == 0.0  # no attention: the tokens split, nothing moves


def test_a_devices_memory_under_context_parallelism_follows_its_tokens_not_the_sequence():
    """The blockwise kernels keep no T × T scores: a block's kept and transient bytes per device are
    those of its T/n tokens, the same at (T, n) = (128, 4) and (256, 8); written out, the scores would
    grow them with T."""
    from recipes import GPTConfig, Recipe

    def memory(T: int, n: int, blockwise: bool) -> tuple[float, float]:
        config = GPTConfig(vocab_size=64, max_seq_len=T, num_layers=1, num_heads=4, d_model=64)
        recipe = Recipe(name="cp-memory", config=config, batch_size=1, seq_len=T)
        graph = capture(recipe.train_step, recipe.abstract_state(), recipe.batch_spec(1, T))
        model = CostModel(graph, coarsen(graph), load_cluster("a100x8"), batch_size=1, param_axes=recipe.param_axes())
        attention = next(i for i in range(len(model.layers)) if model.attention_core(i).starts)
        cost = model.layer_cost(attention, "a100", ParallelConfig(microbatch_size=1, context_parallel=n))
        assert cost.activation_bytes == model._memory(attention, 1, 1 / n, blockwise=True)[0]
        return model._memory(attention, 1, 1 / n, blockwise=blockwise)

    short, long = memory(128, 4, True), memory(256, 8, True)
    assert long == pytest.approx(short, rel=1e-9)
    written_short, written_long = memory(128, 4, False), memory(256, 8, False)
    assert written_long[0] > 1.5 * written_short[0] and written_long[1] > 1.5 * written_short[1]


def test_the_block_steps_run_at_the_fused_attention_efficiency(tiny):
    """The ring's block steps are fused attention kernels: their products are priced at
    ``Efficiency.attention`` (a fused kernel's, below a GEMM's on a GPU), not at ``matmul``; unmeasured,
    attention reads as matmul."""
    from orchestrator.costs import Efficiency

    recipe, model = tiny
    graph = model.graph
    slow = CostModel(
        graph, coarsen(graph), load_cluster("a100x8"), batch_size=8, param_axes=recipe.param_axes(),
        efficiency={"a100": Efficiency(matmul=0.9, attention=0.45)},
    )  # fmt: skip
    fast = CostModel(
        graph, coarsen(graph), load_cluster("a100x8"), batch_size=8, param_axes=recipe.param_axes(),
        efficiency={"a100": Efficiency(matmul=0.9, attention=0.9)},
    )  # fmt: skip
    config = ParallelConfig(microbatch_size=8, context_parallel=2)
    slow_s = slow.layer_cost(BLOCK, "a100", config).breakdown["cp_attention_forward_s"]
    fast_s = fast.layer_cost(BLOCK, "a100", config).breakdown["cp_attention_forward_s"]
    work = ring_attention_work(graph, model.attention_core(BLOCK), model._constant_ops, 64, 2, lambda name: 1 / 2)
    peak = model.cluster.device_types["a100"].peak_flops[work["dtype"]]
    products_s = work["flops"] / (peak * 0.9)  # half the batch's tiles: one of the 2 block steps, at 0.9
    assert slow_s - fast_s == pytest.approx(products_s, rel=1e-9)  # twice as long at half the efficiency
    device = model.cluster.device_types["a100"]
    unmeasured = dict(work, device=device, efficiency=Efficiency(matmul=0.9))
    assert blockwise_attention_s(**unmeasured) == pytest.approx(
        blockwise_attention_s(**dict(unmeasured, efficiency=Efficiency(matmul=0.9, attention=0.9)))
    )


def test_the_ops_the_ring_replaces_are_the_attentions_alone(tiny):
    """The captured ops the blockwise kernels replace work on gpt-tiny's (8, 4, 64, 64) scores: the core,
    the mask built from positions, and the backward ops on a tensor holding T = 64 twice; its MLP's
    (8, 64, 256) activations have the scores' size but hold T once, and are not replaced."""
    _, model = tiny
    graph, core = model.graph, model.attention_core(BLOCK)
    square_f, square_b = model._square_ops(BLOCK)
    assert core.ops <= square_f and any(graph.op(name).primitive == "iota" for name in square_f - core.ops)
    assert square_b and all(graph.op(name).phase == "backward" for name in square_b)
    for name in square_b:
        op = graph.op(name)
        assert any(t.shape.count(64) == 2 for t in (*op.inputs, *op.outputs))
    mlp = [name for name in model.layers[BLOCK].ops if (8, 64, 256) in [t.shape for t in graph.op(name).outputs]]
    assert mlp and not set(mlp) & (square_f | square_b)


def test_gradients_sync_over_data_and_context_ranks(tiny):
    _, model = tiny
    link = Link(bandwidth_bytes_per_s=1e9, latency_s=1e-6)
    cp = model.layer_cost(BLOCK, "a100", ParallelConfig(microbatch_size=8, context_parallel=2), dp_link=link)
    dp = model.layer_cost(BLOCK, "a100", ParallelConfig(microbatch_size=8, dp=2), dp_link=link)
    assert cp.dp_sync_s == pytest.approx(dp.dp_sync_s) and cp.dp_sync_bytes == dp.dp_sync_bytes > 0
    zero = ParallelConfig(microbatch_size=8, dp=2, context_parallel=2, zero=True)
    assert model.layer_cost(BLOCK, "a100", zero).optimizer_bytes == pytest.approx(dp.optimizer_bytes / 4)


def test_recompute_passes_the_ring_again(tiny):
    _, model = tiny
    slow = Link(bandwidth_bytes_per_s=1e6, latency_s=1e-5)
    plain = model.layer_cost(BLOCK, "a100", ParallelConfig(microbatch_size=8, context_parallel=2), cp_link=slow)
    again = model.layer_cost(
        BLOCK, "a100", ParallelConfig(microbatch_size=8, context_parallel=2, recompute=True), cp_link=slow
    )
    assert again.breakdown["cp_backward_s"] == pytest.approx(
        plain.breakdown["cp_backward_s"] + plain.breakdown["cp_forward_s"]
    )


def test_the_model_reads_the_attention_length_and_kv_bytes(tiny):
    recipe, model = tiny
    assert model.attention_length() == recipe.seq_len
    nbytes, elements = model.kv_bytes(BLOCK, 1)
    assert nbytes == block_bytes(8, 64, 1, 4, 16, 4) and elements == nbytes // 4
    assert model.kv_bytes(BLOCK, 2)[0] == nbytes / 2  # TP splits the heads


def test_grouped_query_attention_is_split_along_its_sequence():
    """Llama's grouped-query scores are (B, H_kv, T, T, G), the group last: the model's T is the
    length they hold twice, and its ring prices the causal tiles of that T."""
    from recipes import GPTConfig, Recipe

    config = GPTConfig(
        vocab_size=256, max_seq_len=256, num_layers=2, num_heads=8, d_model=64, llama=True, num_kv_heads=2
    )
    recipe = Recipe(name="llama-gqa", config=config, batch_size=1, seq_len=256)
    graph = capture(recipe.train_step, recipe.abstract_state(), recipe.batch_spec(1, 256))
    model = CostModel(graph, coarsen(graph), load_cluster("a100x8"), batch_size=1, param_axes=recipe.param_axes())
    assert model.attention_length() == 256
    core = model.attention_core(BLOCK)
    work = ring_attention_work(graph, core, model._constant_ops, 256, 4, lambda name: 1 / 4)
    executed = attention_flops_per_device(
        256, 4, layout="zigzag", causal=True, batch=1, heads=8, head_dim=8, block_q=RING_BLOCK, block_k=RING_BLOCK
    )
    assert work["flops"] == pytest.approx(executed.max())


def test_priced_ring_bytes_are_the_compiled_kernels_permutes(tiny):
    """The bytes the cost model prices for gpt-tiny's attention over a ring of 2 are the bytes XLA's
    compiled ring attention (same shapes: B 8, T 64, 4 heads of 16, fp32) sends by collective-permute."""
    _, model = tiny
    n = 2
    nbytes, elements = model.kv_bytes(BLOCK, 1)
    priced = 2 * (n - 1) * nbytes / n + n * elements * 4 / n
    assert priced == ring_permute_bytes(8, 64, n, 4, 16, 4, backward=True)
    mesh = Mesh(np.array(jax.devices()[:n]), ("context",))
    spec = jax.ShapeDtypeStruct(
        (8, 64, 4, 16), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec(None, "context"))
    )

    def loss(q, k, v):
        blocks = AttentionBlockSizes(block_q=16, block_k=16)
        return jnp.sum(ring_attention(q, k, v, mesh=mesh, causal=True, block_sizes=blocks))

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, spec, spec).compile().as_text()
    sent = 0
    for line in hlo.splitlines():
        match = re.search(r"= f32\[([\d,]*)\]\S* collective-permute\(", line)
        if match:
            sent += 4 * int(np.prod([int(d) for d in match.group(1).split(",") if d]))
    assert sent == pytest.approx(priced, rel=0.01)


def test_priced_attention_work_per_device_is_the_ring_kernels_tiles(tiny):
    """1/n of the captured attention's matmul FLOPs are exactly the tiles the ring kernels run without
    a mask, on every device; gpt-tiny's attention is causal, and the FLOPs priced per device are those
    of the tiles the kernels run under its mask, at their default blocks (8 × 8 here: chunks of 8)."""
    _, model = tiny
    n, graph = 4, model.graph
    core = model.attention_core(BLOCK)
    matmuls = core.starts | core.ends
    unmasked = sum(graph.op(name).flops for name in matmuls) / n  # the whole batch of 8 at T = 64
    shapes = dict(layout="zigzag", batch=8, heads=4, head_dim=16, block_q=RING_BLOCK, block_k=RING_BLOCK)
    kernel = attention_flops_per_device(64, n, causal=False, **shapes)
    assert unmasked == pytest.approx(kernel[0]) and len(set(kernel.tolist())) == 1
    causal = attention_flops_per_device(64, n, causal=True, **shapes)
    assert len(set(causal.tolist())) == 1 and 0.5 < causal[0] / kernel[0] < 0.7  # balanced, about half
    assert masked_by_position(graph, core.ops, model._constant_ops)
    work = ring_attention_work(graph, core, model._constant_ops, 64, n, lambda name: 1 / n)  # T/n of each sample
    assert work["flops"] == pytest.approx(causal[0])


def test_the_ring_kernels_block_is_the_cost_models():
    assert AttentionBlockSizes().block_q == AttentionBlockSizes().block_k == RING_BLOCK


@pytest.mark.parametrize(("seq_len", "n", "block"), [(64, 4, 16), (8192, 8, 128), (131072, 16, 128), (4096, 2, 64)])
def test_the_causal_tile_fraction_is_the_executed_rings(seq_len, n, block):
    """ring_tile_fraction counts the tiles conductor.kernels.ring runs under a causal mask, over those
    it runs unmasked: just over half (the diagonal tiles are computed whole)."""
    shapes = dict(layout="zigzag", batch=1, heads=1, head_dim=1, block_q=block, block_k=block)
    causal = attention_flops_per_device(seq_len, n, causal=True, **shapes)
    unmasked = attention_flops_per_device(seq_len, n, causal=False, **shapes)
    fraction = ring_tile_fraction(seq_len, n, causal=True, block_q=block, block_k=block)
    assert fraction == pytest.approx(causal.max() / unmasked.max())
    assert 0.5 < fraction < 0.6
    assert ring_tile_fraction(seq_len, n, causal=False) == 1.0


def test_the_causal_ring_is_priced_at_about_half_the_unmasked_one():
    """At Llama 3 405B's 128K shapes per tensor-parallel rank (16 query heads, 1 K/V head) over a ring
    of 16, the block steps of a causal ring compute the executed tiles' FLOPs, about half the unmasked
    ring's; each ring's communication hides behind its steps, so its whole price halves too."""
    shapes = dict(batch=1, seq_len=131072, heads=16, kv_heads=1, head_dim=128, n=16, itemsize=2)
    fast = dict(flops_per_s=9e14, bandwidth_bytes_per_s=5e10, latency_s=5e-6)
    causal = choose_context_parallel(**shapes, causal=True, **fast)
    unmasked = choose_context_parallel(**shapes, causal=False, **fast)
    executed = attention_flops_per_device(
        131072, 16, layout="zigzag", causal=True, batch=1, heads=16, head_dim=128, block_q=128, block_k=128
    )
    assert causal.ring.compute_forward_s == pytest.approx(executed.max() / 9e14)
    assert causal.ring.compute_backward_s == pytest.approx(2.5 * causal.ring.compute_forward_s)
    assert causal.ring.compute_forward_s / unmasked.ring.compute_forward_s == pytest.approx(0.5, rel=0.01)
    assert causal.chosen.time_s / unmasked.chosen.time_s == pytest.approx(0.5, rel=0.05)


def test_priced_attention_per_rank_is_the_closed_form_under_gqa_and_tp():
    """A Llama block (8 query heads over 2 K/V heads of 8, T = 256) at TP 2 and CP 4, one sequence per
    microbatch: each rank runs its 8/2 query heads' T/4 queries against all T keys, the causal tiles
    alone, in its forward

        FLOPs = 4·B·(H/t)·(T/n)·T·D·f        exponentials = B·(H/t)·(T/n)·T·f

    (f the executed tiles' fraction), and reads its own Q, K, V and O slices once; the backward is 2.5
    times that. Without the fraction, the FLOPs are XLA's count of one rank's two attention products
    (its Q slice against the gathered K and V, as Llama 3's all-gather context parallelism runs them)."""
    from recipes import GPTConfig, Recipe

    B, T, H, H_kv, D, t, n = 1, 256, 8, 2, 8, 2, 4
    config = GPTConfig(
        vocab_size=256, max_seq_len=T, num_layers=2, num_heads=H, d_model=H * D, llama=True, num_kv_heads=H_kv
    )
    recipe = Recipe(name="llama-gqa", config=config, batch_size=B, seq_len=T)
    graph = capture(recipe.train_step, recipe.abstract_state(), recipe.batch_spec(B, T))
    model = CostModel(graph, coarsen(graph), load_cluster("a100x8"), batch_size=B, param_axes=recipe.param_axes())
    cost = model.layer_cost(BLOCK, "a100", ParallelConfig(tp=t, microbatch_size=B, context_parallel=n))

    f = ring_tile_fraction(T, n, causal=True)
    flops = 4 * B * (H // t) * (T // n) * T * D
    pairs = B * (H // t) * (T // n) * T
    io = B * (T // n) * D * (2 * H + 2 * H_kv) // t * 4  # Q, O and the local K, V slices, float32
    device = model.cluster.device_types["a100"]
    forward = blockwise_attention_s(
        flops=flops * f, exponentials=pairs * f, io_bytes=io, dtype="float32", device=device,
        efficiency=model.efficiency_of("a100"),
    )  # fmt: skip
    assert cost.breakdown["cp_attention_forward_s"] == pytest.approx(forward, rel=1e-9)
    assert cost.breakdown["cp_attention_backward_s"] == pytest.approx(2.5 * forward, rel=1e-9)

    def rank(q, k, v):  # (B, T/n, H_kv/t, G, D) against the gathered (B, T, H_kv/t, D)
        scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k)
        return jnp.einsum("bhgqk,bkhd->bqhgd", scores, v)

    q = jax.ShapeDtypeStruct((B, T // n, H_kv // t, H // H_kv, D), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, T, H_kv // t, D), jnp.float32)
    analysis = jax.jit(rank).lower(q, kv, kv).compile().cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    assert analysis["flops"] == pytest.approx(flops)
