"""A GPU's efficiencies, fitted to transformer pieces measured on it.

``data/h100_layer_times.json`` holds the median forward and forward+backward seconds of one
tensor-parallel rank's GPT block and LM head on an H100, in bf16 compute, over hidden sizes 2048
to 12288, TP 1 to 8 and microbatches 1 to 4 (measured by ``gpu_layer_times.py``, the same
functions at the same shapes), the blocks with the scores materialised ("xla") and, at four
shapes, with cuDNN's fused attention ("flash"). ``data/h100_conductor_times.json`` adds cuDNN's
fused attention alone, forward and backward, at 8K to 128K tokens. Each piece is captured here on
the CPU (a fused kernel as the conductor's flash-attention kernels, as ``orchestrator bench
published`` captures the runs that use one), and :func:`orchestrator.profile.calibrate` fits the
roofline's efficiencies to the measured times, with ``other`` and ``transcendental`` held at 1
(fused elementwise kernels on a GPU are bound by their bytes, so their time belongs to
``memory``; left free, the fit trades the two against each other and ``other`` takes a value
that means nothing on another GPU). The fused kernels get their own ``attention`` efficiency:
a softmax between two products, tile by tile, reaches less of the peak than the GEMMs around it.

The fit is the model's efficiency for every GPU that has no measurements of its own: an
A100's kernels reach about the same fractions of its datasheet peaks (``orchestrator bench
published`` reports how well that holds against published A100 runs).
"""

from __future__ import annotations

import functools
import json
from importlib import resources

from orchestrator.costs import Efficiency

HELD = {"other": 1.0, "transcendental": 1.0}


def measured_pieces(name: str = "h100_layer_times.json") -> dict:
    """The packaged measurement file: device kind, JAX version, one row per piece and shape."""
    return json.loads(resources.files("orchestrator.bench").joinpath(f"data/{name}").read_text())


@functools.cache
def captured_pieces(name: str = "h100_layer_times.json") -> tuple:
    """(row, forward ops, backward ops, traffic) of every measured block (either attention) and head."""
    import jax

    import conductor
    from integrations.flax import capture
    from orchestrator.bench import gpu_layer_times as pieces
    from orchestrator.costs import traffic_bytes

    out = []
    for row in measured_pieces(name)["pieces"]:
        if row["piece"] not in ("block", "head") or "error" in row:
            continue
        args = pieces.piece_args(row["piece"], row["hidden"], row["tp"], row["batch"], row["seq"])
        loss = pieces.block_loss if row["piece"] == "block" else pieces.head_loss
        if row.get("attention") == "flash":
            # the measured piece calls cuDNN's fused kernels; the conductor rewrites the written
            # attention into the flash-attention kernels whose declared cost the capture reads, as
            # ``orchestrator bench published`` captures the runs that use fused attention
            policy = conductor.Policy(attention="force", implementation="pallas", guard=False)
            loss = conductor.optimize(loss, policy=policy)
        graph = capture(jax.value_and_grad(loss, argnums=(0, 1)), *args)
        forward = [op for op in graph.ops() if op.phase == "forward"]
        backward = [op for op in graph.ops() if op.phase != "forward"]
        out.append((row, forward, backward, traffic_bytes(graph)))
    return tuple(out)


@functools.cache
def captured_kernels(name: str = "h100_conductor_times.json") -> tuple:
    """(row, ops, traffic) of every measured fused attention kernel (cuDNN's, forward and backward
    of Llama 3 405B's heads on one of 8 TP ranks at long sequences), captured as the conductor's
    flash-attention kernels at the same shapes."""
    import jax
    import jax.numpy as jnp

    from conductor.kernels.attention import attention
    from integrations.flax import capture
    from orchestrator.costs import traffic_bytes

    out = []
    for row in measured_pieces(name)["cases"]:
        if row["case"] != "attention_cudnn" or "error" in row:
            continue

        def loss(q, k, v, causal=row["causal"]):
            return attention(q, k, v, causal=causal, implementation="pallas").astype(jnp.float32).sum()

        dtype = jnp.dtype(row["dtype"])
        q = jax.ShapeDtypeStruct((1, row["seq"], row["heads"], row["head_dim"]), dtype)
        kv = jax.ShapeDtypeStruct((1, row["seq"], row["kv_heads"], row["head_dim"]), dtype)
        graph = capture(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
        out.append((row, list(graph.ops()), traffic_bytes(graph)))
    return tuple(out)


@functools.cache
def gpu_efficiency(
    name: str = "h100_layer_times.json", kernels: str | None = "h100_conductor_times.json"
) -> Efficiency:
    """The efficiencies that best explain the measured pieces (and, with ``kernels``, the measured
    fused attention kernels) on the H100's datasheet peaks."""
    from orchestrator.bench._published import GPUS
    from orchestrator.cluster import DeviceType
    from orchestrator.profile import calibrate

    device = _device(GPUS["h100-sxm-80gb"], DeviceType)
    pieces, tables = [], []
    for row, forward, backward, traffic in captured_pieces(name):
        pieces += [(forward, row["forward_s"]), (backward, row["forward_backward_s"] - row["forward_s"])]
        tables += [traffic, traffic]
    for row, ops, traffic in captured_kernels(kernels) if kernels else ():
        pieces.append((ops, row["seconds"]))
        tables.append(traffic)
    return calibrate(pieces, device, tables, fixed=HELD)


def fit_report(name: str = "h100_layer_times.json", kernels: str | None = "h100_conductor_times.json") -> list[dict]:
    """Per measured piece and kernel: measured and modelled forward+backward seconds with the
    fitted efficiency. Blocks carry their ``attention`` ("xla": scores materialised; "flash":
    cuDNN's fused kernels), kernels (``piece`` "attention") their ``seq`` and ``causal``."""
    from orchestrator.bench._case import rel_err
    from orchestrator.bench._published import GPUS
    from orchestrator.cluster import DeviceType
    from orchestrator.profile import predict

    device = _device(GPUS["h100-sxm-80gb"], DeviceType)
    eff = gpu_efficiency(name, kernels)
    rows = []
    for row, forward, backward, traffic in captured_pieces(name):
        modelled = predict(forward, device, eff, traffic) + predict(backward, device, eff, traffic)
        rows.append(
            {
                **{k: row[k] for k in ("piece", "hidden", "tp", "batch")},
                "attention": row.get("attention") if row["piece"] == "block" else None,
                "measured_s": row["forward_backward_s"],
                "modelled_s": modelled,
                "error": rel_err(modelled, row["forward_backward_s"]),
            }
        )
    for row, ops, traffic in captured_kernels(kernels) if kernels else ():
        modelled = predict(ops, device, eff, traffic)
        rows.append(
            {
                "piece": "attention",
                **{k: row[k] for k in ("seq", "heads", "kv_heads", "causal")},
                "measured_s": row["seconds"],
                "modelled_s": modelled,
                "error": rel_err(modelled, row["seconds"]),
            }
        )
    return rows


def _device(gpu: dict, device_type):
    return device_type(
        name=gpu["type"],
        peak_flops={k: v * 1e12 for k, v in gpu["peak_tflops"].items()},
        memory_bytes=gpu["memory_bytes"],
        memory_bandwidth_bytes_per_s=gpu["memory_bandwidth_gbps"] * 1e9,
    )
