"""Published configurations priced as fitting the 80 GB GPUs they ran on (``docs/costs.md``, Memory)."""

import dataclasses

import pytest

from orchestrator.bench._published import load_runs, price, run_model
from orchestrator.costs import ParallelConfig
from orchestrator.planner import MEMORY_HEADROOM


def test_the_fullest_published_configuration_fits_where_it_ran():
    """Korthikanti et al.'s 1T model at TP 8, PP 64 on 80 GB A100s, the fullest of the published
    rows (its first stage holds 64 microbatches): within the planner's usable memory."""
    run = next(r for r in load_runs() if r.id == "korthikanti-1t")
    priced = price(run, run_model(run))
    assert priced["fits"]
    assert priced["peak_memory_gib"] <= 80 * (1 - MEMORY_HEADROOM)


def test_a_block_keeps_korthikantis_activations_with_the_recipes_gelu():
    """Under sequence parallelism and selective recompute a block keeps s·b·h·34/t bytes
    (Korthikanti et al., 2022, Eq. 6); the recipe has no dropout (its two 1-byte masks) and XLA:GPU
    keeps its GELU's bf16 tanh (8 bytes): 40/t. GPT-3 175B's block, two of them captured."""
    run = next(r for r in load_runs() if r.id == "korthikanti-175b")
    model = run_model(dataclasses.replace(run, model={**run.model, "layers": 2}))
    s, h, t = run.model["seq_len"], run.model["hidden"], run.parallel["tp"]
    config = ParallelConfig(tp=t, microbatch_size=1, sequence_parallel=True, selective_recompute=True)
    block = model.layer_cost(1, run.gpu_type, config)
    assert block.activation_bytes == pytest.approx((34 - 2 + 8) * s * h / t, rel=0.01)


def test_llama_at_8k_is_priced_with_a_fused_attention_that_keeps_no_scores():
    """Llama 3 405B at 8K, whose scores cannot have fit (its attention derived as ``flash`` in the
    data), is captured with the fused kernel: a block at TP 8 keeps less than one of the scores
    (16 heads of 8,192 × 8,192 in bf16) it would keep two of in memory. Two blocks captured."""
    run = next(r for r in load_runs() if r.id == "llama3-405b-8k-16384gpu")
    assert run.model["attention"] == "flash"
    config = ParallelConfig(tp=run.parallel["tp"], microbatch_size=1)
    scores = run.model["heads"] // config.tp * run.model["seq_len"] ** 2 * 2
    fused = run_model(dataclasses.replace(run, model={**run.model, "layers": 2}))
    assert any(op.primitive == "pallas_call" for op in fused.graph.ops())
    assert fused.layer_cost(1, run.gpu_type, config).activation_bytes < scores
    plain = run_model(dataclasses.replace(run, model={**run.model, "layers": 2, "attention": None}))
    assert plain.layer_cost(1, run.gpu_type, config).activation_bytes > 2 * scores
