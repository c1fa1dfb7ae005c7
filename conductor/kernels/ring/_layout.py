"""Where each device's slice of the sequence sits, which chunk pairs a causal ring computes, and their cost.

Layouts of a sequence of T tokens over n devices (the device order is the ring order):

    contiguous:  device r holds tokens [r·T/n, (r+1)·T/n)                      (one chunk)
    zigzag:      chunks of T/2n; device r holds chunks r and 2n−1−r, in that order (two chunks)

Under a causal mask, query chunk i sees key chunk j fully when j < i, half (the diagonal) when
j = i and not at all when j > i. Contiguous leaves device r with r full pairs and one diagonal:
the last device does 2n−1 halves of work, the first one. Zigzag pairs an early chunk with a late
one, so every device does 2n full-pair equivalents (Brandon et al. 2023, "Striped Attention";
Llama 3's context parallelism).
"""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp
import numpy as np

Layout = Literal["contiguous", "zigzag"]
LAYOUTS: tuple[Layout, ...] = ("contiguous", "zigzag")

SKIP, FULL, DIAGONAL = 0, 1, 2  # kinds of a (query chunk, key chunk) pair


def check_layout(layout: str) -> Layout:
    """``layout`` itself, or a ``ValueError`` naming the allowed values."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; choose one of {', '.join(LAYOUTS)}")
    return layout  # type: ignore[return-value]


def chunks_per_device(layout: Layout, causal: bool) -> int:
    """Chunks a device's slice is cut into; without a mask every pair is full, so one."""
    return 2 if causal and layout == "zigzag" else 1


def chunk_index(layout: Layout, n: int, device, chunk: int):
    """Global index (in units of the chunk length) of ``device``'s local ``chunk``."""
    if layout == "zigzag" and chunk == 1:
        return 2 * n - 1 - device
    return device


def pair_kind(query_chunk: int, key_chunk: int) -> int:
    """SKIP, FULL or DIAGONAL for a causal pair of global chunk indices."""
    if key_chunk > query_chunk:
        return SKIP
    return FULL if key_chunk < query_chunk else DIAGONAL


def _chunk_order(n: int, layout: Layout) -> np.ndarray:
    """Global chunk index at each layout position, chunks of T/2n for zigzag and T/n otherwise."""
    if layout == "contiguous":
        return np.arange(n)
    return np.array([c for r in range(n) for c in (r, 2 * n - 1 - r)])


def layout_positions(seq_len: int, n: int, layout: Layout = "zigzag") -> np.ndarray:
    """The global position of the token at each place of the layout, (seq_len,) int32.

    Rotary embeddings, learned positions and masks read these instead of ``arange(seq_len)``.

    Example:
        >>> layout_positions(8, 2).tolist()
        [0, 1, 6, 7, 2, 3, 4, 5]
    """
    layout = check_layout(layout)
    order = _chunk_order(n, layout)
    if seq_len % len(order):
        raise ValueError(f"sequence length {seq_len} must divide into {len(order)} chunks for {layout} over {n}")
    size = seq_len // len(order)
    return (order[:, None] * size + np.arange(size)[None, :]).reshape(-1).astype(np.int32)


def to_layout(x, n: int, layout: Layout = "zigzag", *, axis: int = 1):
    """Reorders ``x``'s sequence ``axis`` from natural order into ``layout`` over ``n`` devices.

    Everything that is per token (tokens, targets, positions, a loss mask) follows the same
    permutation, so the model runs on the layout order and nothing is reshuffled between layers.
    """
    return jnp.take(x, layout_positions(x.shape[axis], n, layout), axis=axis)


def from_layout(x, n: int, layout: Layout = "zigzag", *, axis: int = 1):
    """Inverse of :func:`to_layout`: ``layout`` order back to natural order."""
    return jnp.take(x, np.argsort(layout_positions(x.shape[axis], n, layout)), axis=axis)


def _diagonal_tiles(length: int, bq: int, bk: int) -> int:
    nk = length // bk
    return sum(min(((i + 1) * bq + bk - 1) // bk, nk) for i in range(length // bq))


def attention_flops_per_device(
    seq_len: int,
    n: int,
    *,
    layout: Layout,
    causal: bool,
    batch: int,
    heads: int,
    head_dim: int,
    block_q: int,
    block_k: int,
) -> np.ndarray:
    """Forward FLOPs each device of the ring executes: 4·B·H·D per (query, key) pair of each tile it computes.

    Counts the tiles the ring kernels run (the same pair kinds, skipped tiles above a diagonal
    excluded), so it is the work per device, not the unmasked area. The backward does 2.5× this.
    """
    layout = check_layout(layout)
    chunks = chunks_per_device(layout, causal)
    length = seq_len // (n * chunks)
    bq, bk = min(block_q, length), min(block_k, length)
    tile = 4 * batch * heads * head_dim * bq * bk
    full, diagonal = (length // bq) * (length // bk), _diagonal_tiles(length, bq, bk)
    flops = np.zeros(n, dtype=np.int64)
    for me in range(n):
        for src in range(n):
            for a in range(chunks):
                for b in range(chunks):
                    if not causal:
                        flops[me] += full * tile
                        continue
                    kind = pair_kind(chunk_index(layout, n, me, a), chunk_index(layout, n, src, b))
                    flops[me] += {SKIP: 0, FULL: full, DIAGONAL: diagonal}[kind] * tile
    return flops
