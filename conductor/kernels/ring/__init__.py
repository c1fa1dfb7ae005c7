"""Context parallelism: attention over a sequence sharded n ways, as a ring or an all-gather.

The sequence axis of Q, K and V is sharded over a mesh axis whose device order is the ring
order (neighbours share the fastest links: ``orchestrator.cluster.ring_order``). For causal
attention the sequence is stored in the zigzag layout (:func:`to_layout`), which balances the
work; everything else per token follows the same permutation (:func:`layout_positions`).

Which form runs (``form="ring"`` or ``"all_gather"``) is the caller's argument: the choice is
the cost model's (``orchestrator.costs.context_parallel_cost``, with the bytes each form moves),
as block sizes are, so the kernels hold no pricing formula and the conductor stays on JAX alone.

Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh
    >>> from conductor.kernels.ring import ring_attention, to_layout, from_layout
    >>> mesh = Mesh(np.array(jax.devices()[:2]), ("context",))
    >>> q = k = v = to_layout(jax.numpy.ones((1, 64, 2, 16)), 2)
    >>> out = ring_attention(q, k, v, mesh=mesh, causal=True)
    >>> from_layout(out, 2).shape
    (1, 64, 2, 16)
"""

from __future__ import annotations

from typing import Literal

import jax
from jax.sharding import Mesh, PartitionSpec

from conductor.kernels._common import interpret_default
from conductor.kernels.attention import AttentionBlockSizes, Blockwise
from conductor.kernels.ring._gather import all_gather_local
from conductor.kernels.ring._layout import (
    LAYOUTS,
    Layout,
    attention_flops_per_device,
    check_layout,
    chunks_per_device,
    from_layout,
    layout_positions,
    to_layout,
)
from conductor.kernels.ring._ring import ring_local
from conductor.kernels.ring._steps import Ring

Form = Literal["ring", "all_gather"]
FORMS: tuple[Form, ...] = ("ring", "all_gather")


def context_parallel_attention_shard(
    q,
    k,
    v,
    *,
    axis_name: str,
    causal: bool = False,
    layout: Layout = "zigzag",
    form: Form = "ring",
    scale: float | None = None,
    block_sizes: AttentionBlockSizes | None = None,
    implementation: Blockwise = "xla_chunked",
    interpret: bool | None = None,
):
    """Attention of one device's slice, to call inside ``jax.shard_map`` over ``axis_name``.

    Args:
      q: (batch, seq/n, heads, head_dim), this device's slice in ``layout`` order.
      k, v: (batch, seq/n, kv_heads, head_dim); ``heads`` must divide by ``kv_heads`` (GQA/MQA).
      axis_name: the mesh axis the sequence is sharded over; its order is the ring order.
      causal: mask key j > query i by global position (read from ``layout``).
      layout: ``"zigzag"`` (balanced under a causal mask) or ``"contiguous"``.
      form: ``"ring"`` (K/V blocks travel by ``ppermute``) or ``"all_gather"``.
      scale: score multiplier; default 1/√head_dim.
      block_sizes: tile lengths inside each chunk pair; each must divide the chunk length.
      implementation: the blockwise kernel each chunk pair runs (:func:`conductor.kernels.attention.flash_forward`):
        ``"xla_chunked"`` or ``"pallas"`` (interpreted on CPU unless ``interpret`` says otherwise;
        interpreted Pallas needs ``check_vma=False`` on the enclosing ``shard_map``, as
        :func:`ring_attention` passes, since jax's interpreter gives its loop carries no axis types).
    Returns:
      (batch, seq/n, heads, head_dim), differentiable (custom VJP: a second ring pass).
    Raises:
      ValueError: bad shapes or head counts, a chunk the blocks do not divide, an unknown layout or form.
    """
    layout = check_layout(layout)
    if form not in FORMS:
        raise ValueError(f"form={form!r}; choose one of {', '.join(FORMS)}")
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape[:-1] + k.shape[-1:]:
        raise ValueError(f"expected q (B,T,H,D) and k, v (B,T,Hkv,D); got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[2] % k.shape[2] or q.shape[1] != k.shape[1]:
        raise ValueError(f"q {q.shape} and k {k.shape} need equal local lengths and heads divisible by kv heads")
    n = jax.lax.axis_size(axis_name)
    sizes = block_sizes or AttentionBlockSizes()
    length = q.shape[1] // chunks_per_device(layout, causal)
    bq, bk = min(sizes.block_q, length), min(sizes.block_k, length)
    if q.shape[1] % chunks_per_device(layout, causal) or length % bq or length % bk:
        raise ValueError(
            f"local length {q.shape[1]} must split into chunks of {length} that blocks ({bq}, {bk}) divide"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if implementation not in ("xla_chunked", "pallas"):
        raise ValueError(f"implementation={implementation!r}; choose xla_chunked or pallas")
    ring = Ring(
        axis_name=axis_name,
        n=n,
        layout=layout,
        causal=causal,
        scale=scale,
        block_q=bq,
        block_k=bk,
        implementation=implementation,
        interpret=interpret_default(interpret),
    )
    b, t, h, d = q.shape
    hkv = k.shape[2]
    # (B, T, H, D) → (B, Hkv, G, T, D): query head h = kv_head · G + g
    qg = q.reshape(b, t, hkv, h // hkv, d).transpose(0, 2, 3, 1, 4)
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    local = ring_local if form == "ring" else all_gather_local
    o = local(ring, qg, kt, vt)
    return o.transpose(0, 3, 1, 2, 4).reshape(b, t, h, v.shape[-1])


def ring_attention(
    q,
    k,
    v,
    *,
    mesh: Mesh,
    axis_name: str = "context",
    causal: bool = False,
    layout: Layout = "zigzag",
    form: Form = "ring",
    scale: float | None = None,
    block_sizes: AttentionBlockSizes | None = None,
    batch_axis: str | None = None,
    head_axis: str | None = None,
    implementation: Blockwise = "xla_chunked",
    interpret: bool | None = None,
):
    """Context-parallel attention of whole (batch, seq, heads, head_dim) arrays whose seq is in ``layout`` order.

    Shards the sequence over ``mesh``'s ``axis_name`` (and optionally the batch over ``batch_axis``,
    the heads over ``head_axis``) and runs :func:`context_parallel_attention_shard` under
    ``jax.shard_map``. The other arguments are those of that function.
    """
    spec = PartitionSpec(batch_axis, axis_name, head_axis, None)

    def shard(q, k, v):
        return context_parallel_attention_shard(
            q,
            k,
            v,
            axis_name=axis_name,
            causal=causal,
            layout=layout,
            form=form,
            scale=scale,
            block_sizes=block_sizes,
            implementation=implementation,
            interpret=interpret,
        )

    # jax's Pallas interpreter gives its loop carries no mesh-axis types, which a type-checked
    # shard_map refuses; compiled Pallas kernels and the XLA kernels are checked
    checked = not (implementation == "pallas" and interpret_default(interpret))
    return jax.shard_map(shard, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=checked)(q, k, v)


__all__ = [
    "FORMS",
    "LAYOUTS",
    "Form",
    "Layout",
    "attention_flops_per_device",
    "context_parallel_attention_shard",
    "from_layout",
    "layout_positions",
    "ring_attention",
    "to_layout",
]
