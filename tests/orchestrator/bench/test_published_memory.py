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
