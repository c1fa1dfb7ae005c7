"""The published-runs data file: schema, parallel arithmetic, coverage, and transcription cross-checks.

The cross-checks recompute a figure the source prints from the other figures of the same row (the FLOP
conventions are in `orchestrator/bench/data/README.md`), so a mistyped batch, shape or time shows up.
"""

import importlib.resources
import math
from pathlib import Path

import pytest
import yaml

RUN_KEYS = {
    "id",
    "source",
    "url",
    "model",
    "cluster",
    "parallel",
    "global_batch",
    "precision",
    "measured",
    "flops_convention",
    "notes",
}
MODEL_KEYS = {
    "name",
    "params_billion",
    "layers",
    "hidden",
    "heads",
    "kv_heads",
    "ffn_hidden",
    "vocab",
    "seq_len",
    "mlp",
    "norm",
    "position",
    "attention",
}
CLUSTER_KEYS = {"gpu", "gpus", "gpus_per_node", "intra_node", "inter_node"}
PARALLEL_KEYS = {
    "tp",
    "pp",
    "dp",
    "cp",
    "virtual_stages",
    "microbatch_size",
    "sequence_parallel",
    "recompute",
    "zero",
    "fsdp",
    "overlap_param_gather",
}
# Keys a run may leave out (the data README marks them optional), each with its allowed values.
OPTIONAL_PARALLEL = {"embedding_and_loss_as_layers": {True, False}}
MEASURED_KEYS = {"tflops_per_gpu", "seconds_per_iteration", "tokens_per_second_per_gpu", "mfu"}

# Closed sets; None means the source does not publish the field.
ALLOWED = {
    ("model", "mlp"): {"gelu", "swiglu", None},
    ("model", "norm"): {"layernorm", "rmsnorm", None},
    ("model", "position"): {"learned", "rope", None},
    ("model", "attention"): {"flash", "materialized", None},
    ("cluster", "gpu"): {"a100-40gb", "a100-80gb", "h100-sxm-80gb"},
    ("parallel", "recompute"): {"none", "selective", "full", None},
    ("parallel", "zero"): {0, 1, 3, None},
    ("parallel", "overlap_param_gather"): {True, False, None},
}
PRECISIONS = {"fp16", "bf16", "fp8", None}
CONVENTIONS = {"megatron-sc21", "megatron-model", "palm-mfu"}

# Dense 16-bit tensor-core peaks, TFLOP/s: A100 312 (the figure the SC'21 and MLSys'23 papers divide by),
# H100 SXM 989.
PEAK_TFLOPS = {"a100-40gb": 312.0, "a100-80gb": 312.0, "h100-sxm-80gb": 989.0}


def _load() -> list[dict]:
    text = importlib.resources.files("orchestrator.bench").joinpath("data/published_runs.yaml").read_text()
    return yaml.safe_load(text)["runs"]


RUNS = _load()


def _by_id(run_id: str) -> dict:
    return next(r for r in RUNS if r["id"] == run_id)


def _convention(run: dict) -> str:
    return run["flops_convention"].split(":", 1)[0]


def flops_per_iteration(run: dict) -> float:
    """FLOPs of one iteration as the run's source counts them (README.md, "FLOP conventions")."""
    m = run["model"]
    batch, s, layers, h, vocab = run["global_batch"], m["seq_len"], m["layers"], m["hidden"], m["vocab"]
    convention = _convention(run)
    if convention == "megatron-sc21":  # Narayanan et al. 2021, Eq. 3: includes the recompute forward
        return 96 * batch * s * layers * h**2 * (1 + s / (6 * h) + vocab / (16 * layers * h))
    if convention == "megatron-model":  # Korthikanti et al. 2022, Eq. 7; Megatron-Core for MHA, 4h MLP
        return 72 * batch * s * layers * h**2 * (1 + s / (6 * h) + vocab / (12 * layers * h))
    if convention == "palm-mfu":  # Chowdhery et al. 2022, App. B: 6N + 12·l·h·s per token
        return batch * s * (6 * m["params_billion"] * 1e9 + 12 * layers * h * s)
    raise ValueError(f"unknown flops_convention {run['flops_convention']!r}")


def seconds_per_iteration(run: dict) -> float:
    """Measured seconds per iteration, or the time the published TFLOP/s per GPU implies."""
    measured = run["measured"]
    if measured["seconds_per_iteration"] is not None:
        return measured["seconds_per_iteration"]
    return flops_per_iteration(run) / (run["cluster"]["gpus"] * measured["tflops_per_gpu"] * 1e12)


def _ids(runs: list[dict]) -> list[str]:
    return [r["id"] for r in runs]


@pytest.mark.parametrize("run", RUNS, ids=_ids(RUNS))
def test_run_has_exactly_the_schema_keys(run):
    assert set(run) == RUN_KEYS
    assert set(run["model"]) == MODEL_KEYS
    assert set(run["cluster"]) == CLUSTER_KEYS
    assert PARALLEL_KEYS <= set(run["parallel"]) <= PARALLEL_KEYS | set(OPTIONAL_PARALLEL)
    for key, allowed in OPTIONAL_PARALLEL.items():
        assert run["parallel"].get(key, False) in allowed, ("parallel", key)
    assert set(run["measured"]) == MEASURED_KEYS
    for (section, key), allowed in ALLOWED.items():
        assert run[section][key] in allowed, (section, key)
    assert run["precision"] in PRECISIONS
    assert _convention(run) in CONVENTIONS
    assert run["source"] and run["url"].startswith("https://") and run["notes"]


@pytest.mark.parametrize("run", RUNS, ids=_ids(RUNS))
def test_run_publishes_a_measured_figure(run):
    measured = run["measured"]
    assert measured["tflops_per_gpu"] is not None or measured["seconds_per_iteration"] is not None
    assert all(v is None or v > 0 for v in measured.values())


def test_ids_are_unique_and_lowercase():
    ids = _ids(RUNS)
    assert len(ids) == len(set(ids))
    assert all(i == i.lower() for i in ids)


@pytest.mark.parametrize("run", RUNS, ids=_ids(RUNS))
def test_parallel_degrees_multiply_to_the_gpu_count(run):
    p = run["parallel"]
    assert p["tp"] * p["pp"] * p["dp"] * p["cp"] == run["cluster"]["gpus"]


WITH_MICROBATCH = [r for r in RUNS if r["parallel"]["microbatch_size"] is not None]


@pytest.mark.parametrize("run", WITH_MICROBATCH, ids=_ids(WITH_MICROBATCH))
def test_global_batch_splits_into_whole_microbatches(run):
    p = run["parallel"]
    assert run["global_batch"] % (p["dp"] * p["microbatch_size"]) == 0


GPU_MEMORY_BYTES = {"a100-40gb": 40 * 2**30, "a100-80gb": 80 * 2**30, "h100-sxm-80gb": 80 * 2**30}


def first_stage_scores_bytes(run: dict) -> float:
    """The bf16 scores the first pipeline stage of 1F1B keeps without recomputation (README.md):
    min(PP, M) microbatches of its l/PP layers, each (heads/TP)·(s/CP)·s per sequence."""
    m, p = run["model"], run["parallel"]
    microbatch = p["microbatch_size"] or 1
    in_flight = min(p["pp"], run["global_batch"] // (p["dp"] * microbatch))
    per_layer = microbatch * m["heads"] / p["tp"] * (m["seq_len"] / p["cp"]) * m["seq_len"] * 2
    return in_flight * m["layers"] / p["pp"] * per_layer


def test_no_run_keeps_scores_its_gpus_cannot_hold():
    """A run that recomputes nothing and whose scores alone exceed its GPUs' memory ran a fused
    attention kernel: the row says so (derived where the source names no kernel), so it is never
    priced with the scores in memory. Llama 3 405B at 8K keeps 252 GiB of them."""
    held = [r for r in RUNS if r["parallel"]["recompute"] in ("none", None)]
    over = [r for r in held if first_stage_scores_bytes(r) > GPU_MEMORY_BYTES[r["cluster"]["gpu"]]]
    assert over and all(r["model"]["attention"] == "flash" for r in over)
    assert first_stage_scores_bytes(_by_id("llama3-405b-8k-16384gpu")) == 252 * 2**30


def test_data_covers_sources_sizes_and_gpu_generations():
    assert len(RUNS) >= 10
    assert len({r["url"] for r in RUNS}) >= 3
    gpus = {r["cluster"]["gpu"] for r in RUNS}
    assert any(g.startswith("a100") for g in gpus)
    assert sum(r["cluster"]["gpu"].startswith("h100") for r in RUNS) >= 3
    sizes = [r["model"]["params_billion"] for r in RUNS]
    assert min(sizes) <= 2 and max(sizes) >= 500


def test_sc21_gpt_1_7b_takes_3_53_seconds_per_iteration():
    # 512 sequences on 32 A100 at 137 TFLOP/s per GPU (Table 1), counted with the paper's Eq. 3.
    assert seconds_per_iteration(_by_id("megatron-sc21-gpt-1.7b")) == pytest.approx(3.53, abs=0.05)


@pytest.mark.parametrize("run", RUNS, ids=_ids(RUNS))
def test_seconds_per_iteration_is_finite_and_positive(run):
    t = seconds_per_iteration(run)
    assert math.isfinite(t) and t > 0


KORTHIKANTI = [r for r in RUNS if r["id"].startswith("korthikanti-")]


@pytest.mark.parametrize("run", KORTHIKANTI, ids=_ids(KORTHIKANTI))
def test_korthikanti_mfu_follows_from_batch_shape_and_iteration_time(run):
    # Table 5's MFU is Eq. 7 model FLOPs over iteration time and the A100 peak.
    mfu = flops_per_iteration(run) / (
        run["measured"]["seconds_per_iteration"] * run["cluster"]["gpus"] * PEAK_TFLOPS["a100-80gb"] * 1e12
    )
    assert mfu == pytest.approx(run["measured"]["mfu"], abs=0.005)


BOTH = [r for r in RUNS if r["measured"]["tflops_per_gpu"] is not None and r["measured"]["mfu"] is not None]


@pytest.mark.parametrize("run", BOTH, ids=_ids(BOTH))
def test_published_mfu_is_tflops_over_the_dense_16_bit_peak(run):
    peak = PEAK_TFLOPS[run["cluster"]["gpu"]]
    assert run["measured"]["tflops_per_gpu"] / peak == pytest.approx(run["measured"]["mfu"], abs=0.01)


def test_readme_lists_every_run():
    readme = (Path(__file__).parents[3] / "orchestrator" / "bench" / "data" / "README.md").read_text()
    missing = [i for i in _ids(RUNS) if f"`{i}`" not in readme]
    assert not missing
