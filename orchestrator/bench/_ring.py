"""The ring-attention cases of ``orchestrator bench conductor``: context parallelism on virtual CPU devices.

Each claim's external truth is XLA's or exact arithmetic: outputs and gradients against full
attention computed whole (fp32), per-device temp memory from ``memory_analysis()`` of the compiled
gradient, the collective-permute bytes read from the compiled HLO against the kernels' own
prediction (``orchestrator.costs.ring_permute_bytes``), the causal work per device with and without the zigzag layout
(counted from the tiles the kernels run), and the ring order's link crossings on a two-host cluster.
"""

from __future__ import annotations

import re
from itertools import pairwise

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from conductor.kernels import AttentionBlockSizes
from conductor.kernels.ring import attention_flops_per_device, from_layout, ring_attention, to_layout
from orchestrator.bench._conductor import Claim
from orchestrator.bench._scan_ring import scan_ring_cases
from orchestrator.costs import block_bytes, ring_permute_bytes

BLOCKS = AttentionBlockSizes(block_q=128, block_k=128)
HEAD_DIM = 16


def full_attention(q, k, v, *, causal: bool):
    """softmax(QKᵀ/√D + mask) V computed whole, a query chunk at a time (exact; K/V heads shared)."""
    b, t, h, d = q.shape
    k, v = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
    chunk = min(t, 1024)

    @jax.checkpoint
    def rows(args):
        start, q_c = args
        s = jnp.einsum("bthd,bshd->bhts", q_c, k) * d**-0.5
        if causal:
            s = jnp.where(start + jnp.arange(chunk)[:, None] >= jnp.arange(t)[None, :], s, -jnp.inf)
        return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)

    q_chunks = q.reshape(b, t // chunk, chunk, h, d).transpose(1, 0, 2, 3, 4)
    out = jax.lax.map(rows, (jnp.arange(0, t, chunk), q_chunks))
    return out.transpose(1, 0, 2, 3, 4).reshape(b, t, h, d)


def _ring_fn(mesh, n: int, causal: bool):
    def ring(q, k, v):
        q, k, v = (to_layout(x, n) for x in (q, k, v))
        return from_layout(ring_attention(q, k, v, mesh=mesh, causal=causal, block_sizes=BLOCKS), n)

    return ring


def _value_and_grads(attend, w):
    @jax.jit
    def run(q, k, v):
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(w)

    return run


def numerics_case(n: int, seq: int, *, causal: bool, heads: int, kv_heads: int) -> Claim:
    """Ring attention (zigzag) vs full attention: output and gradients within 1e-5 (fp32)."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("context",))
    ks = jax.random.split(jax.random.key(seq + n), 4)
    q = jax.random.normal(ks[0], (1, seq, heads, HEAD_DIM))
    k, v = (jax.random.normal(key, (1, seq, kv_heads, HEAD_DIM)) for key in ks[1:3])
    w = jax.random.normal(ks[3], q.shape)
    out, grads = _value_and_grads(_ring_fn(mesh, n, causal), w)(q, k, v)
    ref, ref_grads = _value_and_grads(lambda q, k, v: full_attention(q, k, v, causal=causal), w)(q, k, v)
    errors = [float(jnp.max(jnp.abs(a - b))) for a, b in zip((out, *grads), (ref, *ref_grads))]
    kind = "gqa" if kv_heads < heads else "mha"
    return Claim(
        name=f"ring_numerics_cp{n}_T{seq}_{'causal' if causal else 'full'}_{kind}",
        ok=max(errors) <= 1e-5,
        figures=dict(zip(("out_max_abs_err", "dq_max_abs_err", "dk_max_abs_err", "dv_max_abs_err"), errors)),
    )


def _compiled_grad(n: int, seq: int, heads: int, kv_heads: int, head_dim: int):
    mesh = Mesh(np.array(jax.devices()[:n]), ("context",))
    sharding = NamedSharding(mesh, PartitionSpec(None, "context"))
    q = jax.ShapeDtypeStruct((1, seq, heads, head_dim), jnp.float32, sharding=sharding)
    kv = jax.ShapeDtypeStruct((1, seq, kv_heads, head_dim), jnp.float32, sharding=sharding)

    def loss(q, k, v):
        return jnp.sum(ring_attention(q, k, v, mesh=mesh, causal=True, block_sizes=BLOCKS))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()


def _sent_bytes(hlo: str, n: int) -> int:
    """Bytes one device sends through collective-permutes in a step: the ops inside the ring loop run
    n − 2 times, those peeled off it once."""
    sent = 0
    for line in hlo.splitlines():
        match = re.search(r"= f32\[([\d,]*)\]\S* collective-permute\(", line)
        if match:
            size = 4 * int(np.prod([int(d) for d in match.group(1).split(",") if d]))
            sent += size * (n - 2 if "/while/body/" in line else 1)
    return sent


def compiled_cases(seq: int, rings: tuple[int, ...], *, heads: int = 8, kv_heads: int = 2, head_dim: int = 64):
    """Per-device temp memory by ring size (falls as 1/n at T ≥ 8192) and the compiled
    collective-permute bytes against the prediction (within 1%), causal zigzag GQA in fp32."""
    temp, claims = {}, []
    for n in rings:
        compiled = _compiled_grad(n, seq, heads, kv_heads, head_dim)
        temp[n] = int(compiled.memory_analysis().temp_size_in_bytes)
        sent = _sent_bytes(compiled.as_text(), n)
        predicted = ring_permute_bytes(1, seq, n, kv_heads, head_dim, 4, backward=True)
        claims.append(
            Claim(
                name=f"ring_permute_bytes_cp{n}_T{seq}",
                ok=abs(sent - predicted) <= 0.01 * predicted,
                figures={
                    "compiled_bytes": sent,
                    "predicted_bytes": predicted,
                    "kv_block_bytes": block_bytes(1, seq, n, kv_heads, head_dim, 4),
                },
            )
        )
    first = rings[0]
    scaled = {n: temp[n] * n / (temp[first] * first) for n in rings}
    claims.append(
        Claim(
            name=f"ring_temp_memory_T{seq}",
            # the 1/n claim is for long sequences; at small T fixed buffers dominate and it only falls
            ok=all(0.8 <= s <= 1.25 for s in scaled.values())
            if seq >= 8192
            else all(temp[a] > temp[b] for a, b in pairwise(rings)),
            figures={
                **{f"temp_bytes_cp{n}": temp[n] for n in rings},
                **{f"temp_x_n_vs_cp{first}_cp{n}": scaled[n] for n in rings},
            },
        )
    )
    return claims


def balance_cases(seq: int, rings: tuple[int, ...]) -> list[Claim]:
    """Causal forward FLOPs per device: zigzag equal within 5%; the contiguous layout for contrast."""
    claims = []
    for n in rings:
        spread = {}
        for layout in ("zigzag", "contiguous"):
            flops = attention_flops_per_device(
                seq, n, layout=layout, causal=True, batch=1, heads=8, head_dim=64, block_q=128, block_k=128
            )
            spread[layout] = (int(flops.max()), int(flops.min()))
        (zmax, zmin), (cmax, cmin) = spread["zigzag"], spread["contiguous"]
        claims.append(
            Claim(
                name=f"ring_balance_cp{n}_T{seq}",
                ok=zmax <= 1.05 * zmin,
                figures={
                    "zigzag_max_over_min": zmax / zmin,
                    "contiguous_max_over_min": cmax / cmin,
                    "zigzag_flops_per_device": zmax,
                },
            )
        )
    return claims


def ring_order_case() -> Claim:
    """Two hosts of 4 devices given interleaved: the ring crosses the inter-host link exactly twice."""
    from orchestrator.cluster import parse_cluster, ring_crossings, ring_order

    a100 = {"peak_tflops": {"float32": 19.5}, "memory_bytes": 80 * 2**30, "memory_bandwidth_gbps": 2039}
    intra = {"bandwidth_gbps": 300, "latency_us": 2}
    cluster = parse_cluster(
        {
            "name": "two-hosts",
            "device_types": {"a100": a100},
            "hosts": [{"name": f"h{i}", "device_type": "a100", "count": 4, "intra_link": intra} for i in range(2)],
            "network": {"cluster": {"bandwidth_gbps": 25, "latency_us": 5}},
        }
    )
    devices = cluster.devices()
    interleaved = [d for pair in zip(devices[:4], devices[4:]) for d in pair]
    order = ring_order(cluster, interleaved)
    crossings = ring_crossings(cluster, order)
    between = sum(count for level, count in crossings.items() if level not in ("device", "host"))
    return Claim(
        name="ring_order_two_hosts",
        ok=between == 2,
        figures={
            "order": [d.ref for d in order],
            "inter_host_crossings": between,
            "interleaved_inter_host_crossings": sum(
                c for level, c in ring_crossings(cluster, interleaved).items() if level not in ("device", "host")
            ),
        },
    )


def ring_cases(*, quick: bool = False, progress=lambda name: None) -> list[Claim]:
    """Every ring case, the sequence-sharded scan's included; ``quick``: T = 1024 on rings of 2 and 4
    (seconds, for tests)."""
    seq, rings = (1024, (2, 4)) if quick else (8192, (2, 4, 8))
    rings = tuple(n for n in rings if n <= len(jax.devices()))
    claims = [ring_order_case()]
    if not rings:
        return claims
    for n in rings:
        for causal, heads, kv_heads in ((True, 2, 1), (False, 2, 2)):
            progress(f"ring attention numerics CP {n} T={seq}")
            claims.append(numerics_case(n, seq, causal=causal, heads=heads, kv_heads=kv_heads))
    progress(f"ring attention compiled T={seq}")
    claims += compiled_cases(seq, rings)
    claims += balance_cases(seq, rings)
    return claims + scan_ring_cases(quick=quick, progress=progress)
