"""The decision model: whether to rewrite a match, with which kernel and block sizes.

Device profile p: on-chip memory M (TPU VMEM, GPU shared memory per SM, CPU
L2), peak FLOP/s F, memory bandwidth W, and whether an associative scan's
O(log T) depth pays (many parallel lanes) or not (a few CPU cores, where its
extra work outweighs the shorter chain; ``orchestrator bench conductor``'s
``scan_form_cpu`` case checks which form is faster on the local CPU).

Attention, B·H heads of T queries over S keys, head dim D, fp32:
    scores as written = 2·B·H·T·S·4 bytes kept for the backward (S and P);
    rewritten keeps O and the log-sum-exp, B·H·T·(D + 1)·4 bytes.
    Rewrite iff one head's score matrix T·S·4 > M (else it fits on chip: leave it).
    Blocks: the largest power of two b ≤ 512 dividing T and S with
    (3·b·D + b² + b·D)·4 ≤ M/2 (Q tile, K and V tiles, score tile, accumulator; half for double buffering),
    and b ≤ the band's width (at least 64) for a sliding window, whose kernel skips tiles outside the band.
    Rewritten flops count only the (query, key) pairs the mask keeps.
    Time (roofline) = max(flops / F, bytes / W); written moves the T·S scores 4 times,
    rewritten reads K, V once per query block.

Selective scan, B·T·D·N state elements:
    as written = 3·B·T·D·N·4 bytes (Ā, B̄x and the saved states);
    rewritten (chunk L) = (T/L + L)·B·D·N·4 (boundary states + one chunk recomputed).
    Rewrite iff B·T·D·N·4 > M.  L = a power of two near √T dividing T.
    d-block: the largest power of two dividing D with L·d·N·4 ≤ M/2.
    Parallel (associative) form only where ``parallel_scan_pays``: the sequential
    scan is latency-bound when T · step latency exceeds the work B·D·N·T / lanes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Literal

import jax

from conductor.kernels import (
    GPU_SHARED_MEMORY_BYTES,
    AttentionBlockSizes,
    Implementation,
    ScanBlockSizes,
    divisible_block,
)
from conductor.kernels.attention import Band, attention_tile_bytes
from conductor.match import Match

DeviceKind = Literal["cpu", "gpu", "tpu"]
Choice = Literal["auto", "force", "forbid"]


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceProfile:
    """What the cost model needs to know about a device type."""

    kind: DeviceKind
    onchip_bytes: int
    peak_flops: float
    memory_bandwidth_bytes_per_s: float
    parallel_scan_pays: bool


# Datasheet figures: A100 (164 KiB shared memory per SM, 19.5 TFLOP/s fp32, 1.555 TB/s),
# TPU v4 (16 MiB VMEM per core, 275 TFLOP/s bf16, 1.2 TB/s); CPU: 1 MiB L2, a few cores.
PROFILES: dict[str, DeviceProfile] = {
    kind: DeviceProfile(
        kind=kind,
        onchip_bytes=onchip_bytes,
        peak_flops=peak_flops,
        memory_bandwidth_bytes_per_s=bandwidth,
        parallel_scan_pays=parallel_scan_pays,
    )
    for kind, onchip_bytes, peak_flops, bandwidth, parallel_scan_pays in (
        ("cpu", 1 << 20, 5e10, 1e10, False),
        ("gpu", GPU_SHARED_MEMORY_BYTES, 19.5e12, 1.555e12, True),
        ("tpu", 16 << 20, 275e12, 1.2e12, True),
    )
}


def device_profile(device=None) -> DeviceProfile:
    """The profile for ``device``: a profile, a kind (``"cpu"``, ``"gpu"``/``"cuda"``, ``"tpu"``), a cluster
    ``DeviceType`` (kind from its name, its peak and bandwidth), or None for the local backend.

    Raises:
      ValueError: a kind that is none of these.
    """
    if isinstance(device, DeviceProfile):
        return device
    if device is None:
        device = jax.default_backend()
    if hasattr(device, "peak_flops") and hasattr(device, "name"):  # orchestrator.cluster.DeviceType
        name = device.name.lower()
        kind = "tpu" if "tpu" in name else "cpu" if "cpu" in name else "gpu"
        return dataclasses.replace(
            PROFILES[kind],
            peak_flops=max(device.peak_flops.values()),
            memory_bandwidth_bytes_per_s=device.memory_bandwidth_bytes_per_s,
        )
    kind = {"cuda": "gpu", "rocm": "gpu"}.get(str(device).lower(), str(device).lower())
    if kind not in PROFILES:
        raise ValueError(f"unknown device {device!r}; use one of cpu, gpu, cuda, tpu or a DeviceProfile")
    return PROFILES[kind]


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """What the conductor may do.

    Attributes:
      attention, selective_scan, linear_recurrence: ``"auto"`` (the cost model decides), ``"force"``
        or ``"forbid"``. A plain linear recurrence is rewritten into an associative scan.
      exclude_scopes: fnmatch patterns on module scopes left alone (``"*/blocks_0/*"``).
      implementation: kernel implementation; None = Pallas on TPU/GPU, ``"xla_chunked"`` on CPU.
      device: the device type to decide for (see :func:`device_profile`); None = local backend.
      guard: on the first concrete call compare with the original and fall back on disagreement.
      guard_rtol, guard_atol: the guard's tolerance (``np.allclose``).
    """

    attention: Choice = "auto"
    selective_scan: Choice = "auto"
    linear_recurrence: Choice = "auto"
    exclude_scopes: tuple[str, ...] = ()
    implementation: Implementation | None = None
    device: object = None
    guard: bool = True
    guard_rtol: float = 1e-4
    guard_atol: float = 1e-4


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """The cost model's verdict on one match, with the estimates behind it.

    ``replaced`` lists, for a rewrite, each equation of the written form that no longer runs
    (``"exp f32[2,2048,1536,16]"``), in program order: exactly what the kernel stands in for.
    ``fused`` lists the equations around it that still run, but inside the kernel's region (for the
    selective scan: one time chunk at a time in its loop) and recomputed in the backward pass
    instead of kept (``"dot_general f32[2,2048,80]"``, Mamba's x_proj).
    """

    rewrite: bool
    reason: str
    implementation: Implementation | None = None
    block_sizes: AttentionBlockSizes | ScanBlockSizes | None = None
    scan_form: Literal["sequential", "parallel"] | None = None
    memory_bytes_written: int = 0
    memory_bytes_rewritten: int = 0
    time_s_written: float = 0.0
    time_s_rewritten: float = 0.0
    replaced: tuple[str, ...] = ()  # filled by the rewrite: the equations the kernel takes the place of
    fused: tuple[str, ...] = ()  # filled by the rewrite: the equations that run inside the kernel's region


def _pow2_fit(limit: int, divides: tuple[int, ...], fits) -> int | None:
    b = 512
    while b >= 8:
        if all(n % b == 0 for n in divides) and fits(b) and b <= limit:
            return b
        b //= 2
    return None


def _attention(m: Match, p: DeviceProfile, choice: Choice, impl: Implementation) -> Decision:
    batch, seq_q, heads, d = m.shapes["q"]
    seq_k = m.shapes["k"][1]
    bh = batch * heads
    flops = 4 * bh * seq_q * seq_k * d
    written_bytes = 2 * bh * seq_q * seq_k * 4
    mask = Band.of(
        causal=m.details["causal"],
        window=m.details.get("window"),
        prefix=m.details.get("prefix", 0),
        seq_q=seq_q,
        seq_k=seq_k,
    )
    # a block wider than a sliding window's band computes tiles that are mostly masked
    limit = max(seq_q, seq_k) if mask.width is None else max(64, 1 << (mask.width.bit_length() - 1))
    block = _pow2_fit(limit, (seq_q, seq_k), lambda b: 2 * attention_tile_bytes(b, d) <= p.onchip_bytes)
    rewritten_bytes = bh * seq_q * (d + 1) * 4
    traffic = bh * seq_k * d * 4 * 2 * (seq_q // block if block else 1) + 2 * bh * seq_q * d * 4
    estimates = dict(
        memory_bytes_written=written_bytes,
        memory_bytes_rewritten=rewritten_bytes,
        time_s_written=max(
            flops / p.peak_flops, (4 * written_bytes + 4 * bh * seq_q * d * 4) / p.memory_bandwidth_bytes_per_s
        ),
        time_s_rewritten=max(
            flops * mask.kept_pairs(seq_q, seq_k) / (seq_q * seq_k) / p.peak_flops,
            traffic / p.memory_bandwidth_bytes_per_s,
        ),
    )
    if block is None:
        block = divisible_block(math.gcd(seq_q, seq_k), 128)
        if block < 8 or choice != "force":
            return Decision(
                rewrite=False, reason=f"no block size ≥ 8 divides T={seq_q}, S={seq_k} and fits on chip", **estimates
            )
    sizes = AttentionBlockSizes(block_q=block, block_k=block)
    small = seq_q * seq_k * 4 <= p.onchip_bytes
    if small and choice == "auto":
        return Decision(
            rewrite=False,
            reason=f"one head's scores ({seq_q * seq_k * 4} B) fit on chip ({p.onchip_bytes} B)",
            **estimates,
        )
    return Decision(
        rewrite=True,
        reason="forced" if choice == "force" else "scores exceed on-chip memory",
        implementation=impl,
        block_sizes=sizes,
        **estimates,
    )


def _scan(m: Match, p: DeviceProfile, choice: Choice, impl: Implementation) -> Decision:
    b, t, d, n = (m.shapes[k] for k in ("batch", "seq", "d_inner", "d_state"))
    state = b * d * n * 4
    chunk = divisible_block(t, 1 << max(3, round(math.log2(max(t, 1)) / 2)))
    block_d = d
    while block_d > 8 and (block_d % 2 == 0) and chunk * block_d * n * 4 > p.onchip_bytes // 2:
        block_d //= 2
    flops = 6 * b * t * d * n
    estimates = dict(
        memory_bytes_written=3 * t * state,
        memory_bytes_rewritten=(t // chunk + chunk) * state,
        time_s_written=max(flops / p.peak_flops, 6 * t * state / p.memory_bandwidth_bytes_per_s),
        time_s_rewritten=max(flops / p.peak_flops, b * t * (3 * d + 2 * n) * 4 * 2 / p.memory_bandwidth_bytes_per_s),
    )
    form = "parallel" if p.parallel_scan_pays and t * n >= 4096 else "sequential"
    sizes = ScanBlockSizes(chunk=chunk, block_d=block_d)
    if choice == "auto" and t * state <= p.onchip_bytes:
        return Decision(rewrite=False, reason=f"states ({t * state} B) fit on chip", scan_form=form, **estimates)
    reason = "forced" if choice == "force" else "materialised (B,T,D,N) tensors exceed on-chip memory"
    return Decision(rewrite=True, reason=reason, implementation=impl, block_sizes=sizes, scan_form=form, **estimates)


def decide(match: Match, policy: Policy | None = None) -> Decision:
    """Whether and how to rewrite ``match`` under ``policy`` (see the module docstring for the model)."""
    policy = policy or Policy()
    p = device_profile(policy.device)
    impl: Implementation = policy.implementation or ("xla_chunked" if p.kind == "cpu" else "pallas")
    if not match.rewritable:
        return Decision(rewrite=False, reason="; ".join(match.details.get("problems", ())) or "not rewritable")
    if any(fnmatch(match.scope, pattern) for pattern in policy.exclude_scopes):
        return Decision(rewrite=False, reason="scope excluded by policy")
    choice: Choice = getattr(policy, match.pattern, "forbid")
    if choice == "forbid":
        return Decision(rewrite=False, reason=f"{match.pattern} forbidden by policy")
    if match.pattern == "attention":
        return _attention(match, p, choice, impl)
    if match.pattern == "linear_recurrence":
        return _recurrence(match, p, choice)
    return _scan(match, p, choice, impl)


def _recurrence(m: Match, p: DeviceProfile, choice: Choice) -> Decision:
    """Plain h = a ⊙ h + b: the associative scan (depth O(log T), ~2× the work) only where it pays."""
    pays = p.parallel_scan_pays and m.shapes["seq"] * math.prod(m.shapes["state"]) >= 4096
    form = "parallel" if pays else "sequential"
    if choice == "force" or (choice == "auto" and pays):
        return Decision(
            rewrite=True, reason="forced" if choice == "force" else "parallel scan pays here", scan_form="parallel"
        )
    return Decision(rewrite=False, reason=f"sequential scan is faster on {p.kind}", scan_form=form)
