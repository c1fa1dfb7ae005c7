"""``orchestrator bench published``: published GPU training runs priced by the cost model.

Each run of ``data/published_runs.yaml`` (measured on A100 and H100 clusters, with its citation)
is rebuilt here as what the planner sees:

* the model: :class:`recipes.GPTConfig` of the run's shape in bf16 compute on float32 parameters,
  its train step captured at one sequence (abstract shapes, nothing allocated);
* the cluster: ``gpus / gpus_per_node`` hosts of the run's GPU (:data:`GPUS`: datasheet peaks and
  memory), NVLink inside a host, one InfiniBand NIC per GPU between hosts (:data:`LINKS`);
* the published configuration: PP stages of equal block counts (the embedding with the first,
  the head with the last, as Megatron-LM places them), each on TP·DP devices of one type, with
  M = B / (DP · microbatch) microbatches, the run's virtual stages (interleaved 1F1B) and its
  recompute, ZeRO, sequence-parallel and parameter-gather overlap settings.

The measured time per iteration is the published one, or the published TFLOP/s per GPU turned
into seconds by the source's own FLOP count (``data/README.md``). The run is then priced by the
planner's closed form (:func:`orchestrator.planner.evaluate_plan`) and, unless ``plan=False``,
planned from scratch on the same cluster.

A run with a gated MLP is the recipe's Llama architecture (RMSNorm, rotary positions,
grouped-query attention, its own MLP width; ``GPTConfig(llama=True)``). Runs the recipe does not
express (one of those features without the others) or that need context parallelism are reported
as not priced, with the reason.
"""

from __future__ import annotations

import functools
import re
import statistics
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

from orchestrator.bench._case import rel_err

# Datasheet figures of the GPUs the published runs used (dense, no sparsity); memory in bytes.
GPUS: dict[str, dict[str, Any]] = {
    "a100-80gb": {
        "type": "a100",
        "peak_tflops": {"float32": 19.5, "tfloat32": 156, "bfloat16": 312, "float16": 312},
        "memory_bytes": 80 * 2**30,
        "memory_bandwidth_gbps": 2039,
    },
    "a100-40gb": {
        "type": "a100",
        "peak_tflops": {"float32": 19.5, "tfloat32": 156, "bfloat16": 312, "float16": 312},
        "memory_bytes": 40 * 2**30,
        "memory_bandwidth_gbps": 1555,
    },
    "h100-sxm-80gb": {
        "type": "h100",
        "peak_tflops": {"float32": 67, "tfloat32": 494.5, "bfloat16": 989.5, "float16": 989.5, "float8": 1979},
        "memory_bytes": 80 * 2**30,
        "memory_bandwidth_gbps": 3350,
    },
}

# GB/s per direction per GPU: NVLink 3 (A100) 600 GB/s and NVLink 4 (H100) 900 GB/s both ways added;
# between hosts one HDR (A100 DGX, 200 Gb/s) or NDR (H100 DGX, 400 Gb/s) InfiniBand NIC per GPU.
LINKS: dict[str, dict[str, dict[str, float]]] = {
    "a100": {"intra": {"bandwidth_gbps": 300, "latency_us": 2}, "inter": {"bandwidth_gbps": 25, "latency_us": 5}},
    "h100": {"intra": {"bandwidth_gbps": 450, "latency_us": 2}, "inter": {"bandwidth_gbps": 50, "latency_us": 5}},
}


@dataclass(frozen=True, slots=True)
class PublishedRun:
    """One row of ``published_runs.yaml`` (see its README for the fields)."""

    id: str
    source: str
    model: dict
    cluster: dict
    parallel: dict
    global_batch: int
    precision: str | None
    measured: dict
    flops_convention: str

    @property
    def convention(self) -> str:
        return self.flops_convention.split(":", 1)[0].strip()

    @property
    def gpu_type(self) -> str:
        return GPUS[self.cluster["gpu"]]["type"]

    def flops_per_iteration(self) -> float:
        """F of the source's own convention (``data/README.md``)."""
        m = self.model
        B, s, L, h, V = self.global_batch, m["seq_len"], m["layers"], m["hidden"], m["vocab"]
        if self.convention == "megatron-sc21":
            return 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
        if self.convention == "megatron-model":
            return 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
        if self.convention == "palm-mfu":
            return B * s * (6 * m["params_billion"] * 1e9 + 12 * L * h * s)
        raise ValueError(f"run {self.id}: unknown FLOP convention {self.convention!r}")

    def measured_s(self) -> float:
        """Seconds per iteration: as published, or F / (GPUs · TFLOP/s per GPU)."""
        if self.measured.get("seconds_per_iteration"):
            return float(self.measured["seconds_per_iteration"])
        return self.flops_per_iteration() / (self.cluster["gpus"] * self.measured["tflops_per_gpu"] * 1e12)

    def unsupported(self) -> str | None:
        """Why the GPT recipe (or its Llama architecture) cannot express this run, or None."""
        m = self.model
        # a field the source leaves unpublished (null) is taken as the architecture's
        llama = m["mlp"] == "swiglu"
        expected = (
            (("norm", "rmsnorm"), ("position", "rope")) if llama else (("norm", "layernorm"), ("position", "learned"))
        )
        reasons = [f"{key} {m[key]} with mlp {m['mlp']}" for key, ours in expected if m[key] not in (None, ours)]
        if not llama and m["kv_heads"] != m["heads"]:
            reasons.append(f"grouped-query attention ({m['kv_heads']} of {m['heads']} heads) with mlp {m['mlp']}")
        if not llama and m["ffn_hidden"] != 4 * m["hidden"]:
            reasons.append(f"ffn {m['ffn_hidden']} ≠ 4·hidden")
        return "; ".join(reasons) or None


def load_runs() -> list[PublishedRun]:
    """Every run of the packaged ``data/published_runs.yaml``."""
    text = resources.files("orchestrator.bench").joinpath("data/published_runs.yaml").read_text()
    return [PublishedRun(**{k: row[k] for k in PublishedRun.__slots__}) for row in yaml.safe_load(text)["runs"]]


def run_cluster(run: PublishedRun):
    """The run's cluster: its hosts of one GPU type, NVLink inside, one NIC per GPU between hosts."""
    from orchestrator.cluster import parse_cluster

    gpu = GPUS[run.cluster["gpu"]]
    per_host = run.cluster["gpus_per_node"] or 8  # unpublished: DGX nodes of 8
    hosts, rest = divmod(run.cluster["gpus"], per_host)
    if rest:
        raise ValueError(f"run {run.id}: {run.cluster['gpus']} GPUs is not whole hosts of {per_host}")
    kind = gpu["type"]
    spec = {
        "name": re.sub(r"[^a-z0-9-]", "-", f"{run.id}-cluster"),
        "device_types": {kind: {k: v for k, v in gpu.items() if k != "type"}},
        "hosts": [
            {"name": f"{kind}-{i}", "device_type": kind, "count": per_host, "intra_link": LINKS[kind]["intra"]}
            for i in range(hosts)
        ],
        "network": {"cluster": LINKS[kind]["inter"]},
    }
    return parse_cluster(spec, source=run.id)


def gpt_config(model: dict):
    """The run's model as :class:`recipes.GPTConfig` in bf16: the Llama architecture where the
    source names a gated MLP, RMSNorm and rotary positions."""
    from recipes import GPTConfig

    llama = model["mlp"] == "swiglu"
    options = {"llama": True, "num_kv_heads": model["kv_heads"], "ffn_hidden": model["ffn_hidden"]} if llama else {}
    return GPTConfig(
        vocab_size=model["vocab"],
        max_seq_len=model["seq_len"],
        num_layers=model["layers"],
        num_heads=model["heads"],
        d_model=model["hidden"],
        dtype="bfloat16",
        **options,
    )


@functools.cache
def _graph(config, flash: bool):
    """The GPT's train step captured at one sequence; with ``flash``, its attention rewritten by the
    conductor into the flash-attention kernels (whose declared cost the capture reads), as runs
    through Transformer Engine compute it."""
    import conductor
    from integrations.flax import capture
    from orchestrator.coarsen import coarsen
    from recipes import Recipe

    recipe = Recipe(name="published", config=config, batch_size=1, seq_len=config.max_seq_len)
    step = recipe.train_step
    if flash:
        policy = conductor.Policy(attention="force", implementation="pallas", guard=False)
        step = conductor.optimize(step, policy=policy)
    graph = capture(step, recipe.abstract_state(), recipe.batch_spec(1, config.max_seq_len))
    return graph, coarsen(graph), recipe.param_axes()


def run_model(run: PublishedRun, efficiency=None):
    """The cost model of the run's GPT (bf16 compute, float32 parameters) on the run's cluster."""
    from orchestrator.costs import CostModel

    m = run.model
    # under context parallelism the attention is captured plain: the cost model prices its T × T work
    # as the ring's or the all-gather's blockwise kernels, which keep no scores, and their K/V traffic
    flash = m.get("attention") == "flash" and (run.parallel.get("cp") or 1) == 1
    graph, layers, axes = _graph(gpt_config(m), flash)
    eff = {run.gpu_type: efficiency} if efficiency else None
    # a run on FSDP (Llama 3's: optimizer states and gradients sharded, parameters kept from the
    # forward to the backward, arXiv:2407.21783 §3.3.2) gathers and reduce-scatters every microbatch
    return CostModel(
        graph,
        layers,
        run_cluster(run),
        batch_size=1,
        param_axes=axes,
        efficiency=eff,
        weights_once=True,
        shard_grad_op=bool(run.parallel.get("fsdp")),
    )


def published_stages(run: PublishedRun, n_layers: int) -> list[list[int]]:
    """Megatron-LM's layout: the blocks split evenly over PP stages (the first ones one longer when
    they do not divide), the embedding (layer 0) with the first and the head (the last layer) with
    the last. A run whose ``parallel.embedding_and_loss_as_layers`` is set counts the embedding and
    the head as one layer each in the split, as Megatron-LM's ``--account-for-embedding-in-pipeline-split``
    and ``--account-for-loss-in-pipeline-split`` do (megatron/training/arguments.py at
    307dcf37f03d44da131ba21999278abe4112d2ad) and as Llama 3 places them (arXiv:2407.21783, §3.3.2:
    one block fewer on the first and the last stage)."""
    import numpy as np

    if run.parallel.get("embedding_and_loss_as_layers"):
        return [[int(i) for i in part] for part in np.array_split(np.arange(n_layers), run.parallel["pp"])]
    stages = [[int(i) for i in part] for part in np.array_split(np.arange(1, n_layers - 1), run.parallel["pp"])]
    stages[0].insert(0, 0)
    stages[-1].append(n_layers - 1)
    return stages


def price(run: PublishedRun, model=None) -> dict:
    """The run's published configuration priced by the planner's closed form."""
    from orchestrator.planner.baselines import fixed

    model = model or run_model(run)
    p = run.parallel
    microbatch = p["microbatch_size"] or 1
    M = run.global_batch // (p["dp"] * microbatch)
    priced = fixed(
        model,
        stages=published_stages(run, len(model.layers)),
        device_type=run.gpu_type,
        tp=p["tp"],
        dp=p["dp"],
        recompute=p["recompute"] == "full",
        microbatches=M,
        global_batch=run.global_batch,
        # Llama 3's FSDP shards optimizer states and gradients (arXiv:2407.21783, §3.3.2): ZeRO, whose
        # collectives its model (``run_model``: ``shard_grad_op``) runs every microbatch
        zero=bool(p.get("zero")) or bool(p.get("fsdp")),
        sequence_parallel=bool(p.get("sequence_parallel")),
        selective_recompute=p["recompute"] == "selective",
        overlap_param_gather=bool(p.get("overlap_param_gather")),
        virtual_stages=p.get("virtual_stages") or 1,
        cp=p.get("cp") or 1,
    )
    ev = priced.evaluation
    return {
        "priced_s": ev.iteration_s,
        "fits": ev.feasible,
        # the fullest stage's priced peak per device (parameters, gradients, optimizer state,
        # activations of the microbatches it holds, transient), against the usable memory
        "peak_memory_gib": max(ev.stage_memory_bytes, default=0.0) / 2**30,
        "microbatches": M,
        "virtual_stages": p.get("virtual_stages") or 1,
        "breakdown": dict(ev.breakdown),
    }


def fitting_runs(runs: list[PublishedRun]) -> list[PublishedRun]:
    """The runs the A100 scale is fitted on: every other priced A100 run in file order (at most half
    of the priced runs); the rest, and every H100 run, are held out."""
    a100 = [run for run in runs if run.gpu_type == "a100" and not run.unsupported()]
    return a100[::2]


def efficiency_for(gpu_type: str, a100_scale: float = 1.0):
    """The H100-measured efficiency (``_gpu_efficiency``), scaled by ``a100_scale`` on an A100."""
    from orchestrator.bench._gpu_efficiency import gpu_efficiency
    from orchestrator.costs import EFFICIENCY_CLASSES, Efficiency

    eff = gpu_efficiency()
    if gpu_type != "a100" or a100_scale == 1.0:
        return eff
    scaled = ("matmul", "memory", "memory_streamed", "movement", "attention")
    return Efficiency(**{k: eff.of(k) * (a100_scale if k in scaled else 1.0) for k in EFFICIENCY_CLASSES})


def a100_scale(runs: list[PublishedRun], progress=None) -> float:
    """The factor on the H100's efficiencies that makes the fitting runs' priced times match their
    measured ones in the median (the priced time scales as its inverse)."""
    ratios = []
    for run in fitting_runs(runs):
        if progress:
            progress(f"{run.id}: fitting the A100 scale")
        priced = price(run, run_model(run, efficiency_for("a100")))["priced_s"]
        ratios.append(priced / run.measured_s())
    return statistics.median(ratios) if ratios else 1.0


def bench_published(*, plan: bool = True, time_limit_s: float = 60.0, progress=None) -> dict:
    """Measured vs priced (and planned) seconds per iteration of every published run, with the
    errors of the fitted and the held-out runs apart."""
    runs = load_runs()
    scale = a100_scale(runs, progress)
    fitted = {run.id for run in fitting_runs(runs)}
    rows = []
    for run in runs:
        row: dict[str, Any] = {
            "id": run.id,
            "gpus": run.cluster["gpus"],
            "gpu": run.cluster["gpu"],
            "published": "TP{tp} PP{pp} DP{dp}".format(**run.parallel)
            + (f" v{run.parallel['virtual_stages']}" if (run.parallel.get("virtual_stages") or 1) > 1 else ""),
            "measured_s": run.measured_s(),
            "role": "fitted" if run.id in fitted else "held_out",
        }
        why = run.unsupported()
        if why:
            rows.append({**row, "role": "not_priced", "not_priced": why})
            continue
        if progress:
            progress(f"{run.id}: pricing")
        model = run_model(run, efficiency_for(run.gpu_type, scale))
        row.update(price(run, model))
        row["error"] = rel_err(row["priced_s"], row["measured_s"])
        if plan:
            row.update(_planned(run, model, time_limit_s))
        rows.append(row)
    summary = {}
    for role in ("fitted", "held_out"):
        errors = [abs(r["error"]) for r in rows if r["role"] == role]
        if errors:
            summary[role] = {
                "runs": len(errors),
                "median_abs_error": statistics.median(errors),
                "max_abs_error": max(errors),
            }
    return {"a100_scale": scale, "rows": rows, "summary": summary}


def plan_options(run: PublishedRun) -> dict[str, Any]:
    """What :func:`_planned` passes to ``plan()`` beyond the model and the batch: the options the
    published configuration is priced with (as :func:`price` reads them: Llama 3's FSDP as ZeRO),
    each stage priced with them, and a pipeline at least as deep as the published one."""
    p = run.parallel
    return {
        "max_stages": max(16, p["pp"]),
        "zero": bool(p.get("zero")) or bool(p.get("fsdp")),
        "sequence_parallel": bool(p.get("sequence_parallel")),
        "selective_recompute": p["recompute"] == "selective",
        "overlap_param_gather": bool(p.get("overlap_param_gather")),
    }


def _planned(run: PublishedRun, model, time_limit_s: float) -> dict:
    """The planner's own plan of the run's model on the run's cluster, searched in the space of
    :func:`plan_options` from the published configuration as a start: the plan is priced no slower
    than that configuration on a plain schedule, and no slower than it interleaved where the planner
    can interleave its stages (each stage's block count a multiple of v, ``virtual_stage_counts``).
    ``space_contains_published`` says whether the space the plan's gap covers holds the configuration
    with its virtual stages and options (the planner interleaves, so that space holds every v ≤ v_max:
    docs/planner.md, "Virtual stages"), ``space_contains_published_plain`` whether it holds it at v = 1."""
    from orchestrator.planner import GroupConfig, PlanInfeasible, PlanNotFound, plan

    p = run.parallel
    M = run.global_batch // (p["dp"] * (p["microbatch_size"] or 1))
    cp = p.get("cp") or 1
    group = GroupConfig(
        device_type=run.gpu_type, size=p["tp"] * p["dp"] * cp, tp=p["tp"], recompute=p["recompute"] == "full", cp=cp
    )
    try:
        found = plan(
            model,
            global_batch=run.global_batch,
            time_limit_s=time_limit_s,
            start=(published_stages(run, len(model.layers)), [group] * p["pp"], M),
            virtual_stages=True,  # published runs interleave, so the planner may too
            **plan_options(run),
        )
    except (PlanInfeasible, PlanNotFound) as err:
        return {"planned_s": None, "plan_error": str(err).splitlines()[0]}
    stages = found.stages
    # the space names stages by (type, devices, tp, recompute), with the virtual-stage counts its bound
    # holds over and the options every stage is priced with; the published configuration is looked up
    # with its own, and as its plain counterpart (v = 1)
    published = {
        "microbatches": M,
        "stages": [(run.gpu_type, group.size, group.tp, group.recompute) + ((cp,) if cp > 1 else ())] * p["pp"],
        "options": [name for name, on in plan_options(run).items() if name != "max_stages" and on],
    }
    v = p.get("virtual_stages") or 1
    return {
        "planned_s": found.iteration_s,
        "planned_gap": found.gap,
        "space_contains_published": found.space is not None and found.space.contains(**published, virtual_stages=v),
        "space_contains_published_plain": found.space is not None and found.space.contains(**published),
        "planned": f"{len(stages)} stages, TP {'/'.join(str(s.tp) for s in stages)}, "
        f"DP {'/'.join(str(s.dp) for s in stages)}, "
        + (f"CP {'/'.join(str(s.cp) for s in stages)}, " if any(s.cp > 1 for s in stages) else "")
        + f"M {found.microbatches}, v {found.virtual_stages}",
    }
