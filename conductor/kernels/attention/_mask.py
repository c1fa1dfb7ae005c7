"""Masks that are functions of positions only: a band of diagonals plus a prefix of keys.

Query i keeps key j iff

    (i − left ≤ j ≤ i + right)  or  (j < prefix)

with ``left``/``right`` None for an unbounded side. Causal is right = 0; a causal sliding
window of w keys is (left, right) = (w − 1, 0); a symmetric band |i − j| < w is (w − 1, w − 1);
prefix-LM (bidirectional over the first p tokens, causal after) is right = 0, prefix = p.

Because the kept set of a query block is an interval of keys (plus the prefix), the kernels loop
over the key blocks that meet it and nothing else (``key_blocks``); the backward's loop over query
blocks per key block is its transpose (``query_blocks``). Bounds are computed with ``lax.div`` on
non-negative operands only, so they lower in Pallas on every platform.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclass(frozen=True, slots=True, kw_only=True)
class Band:
    """The keys each query keeps (see the module docstring); hashable, a static kernel argument.

    Example:
        >>> Band.of(causal=True, window=64, seq_q=1024, seq_k=1024)
        Band(left=63, right=0, prefix=0)
        >>> Band.of(causal=True, window=64, seq_q=1024, seq_k=1024).visited_blocks(1024, 1024, 64, 64)
        31
    """

    left: int | None = None
    right: int | None = None
    prefix: int = 0

    @classmethod
    def of(cls, *, causal: bool, window=None, prefix: int = 0, seq_q: int, seq_k: int) -> Band:
        """The band of :func:`conductor.kernels.attention`'s ``causal``/``window``/``prefix`` arguments."""
        return band(causal=causal, window=window, prefix=prefix, seq_q=seq_q, seq_k=seq_k)

    @property
    def masked(self) -> bool:
        return self.left is not None or self.right is not None

    @property
    def width(self) -> int | None:
        """Keys in one query's band (left + right + 1), None when a side is unbounded."""
        return None if self.left is None or self.right is None else self.left + self.right + 1

    def keep(self, rows, cols):
        """Boolean (rows × cols) kept pairs, for broadcastable integer position arrays."""
        keep = None
        if self.left is not None:
            keep = cols >= rows - self.left
        if self.right is not None:
            upper = cols <= rows + self.right
            keep = upper if keep is None else keep & upper
        if keep is not None and self.prefix:
            keep = keep | (cols < self.prefix)
        return keep

    def key_blocks(self, i, bq: int, bk: int, nk: int):
        """(n, block): the number of key blocks query block ``i`` visits and the j-th of them, in
        order (the prefix's blocks first, then the band's, none twice)."""
        if not self.masked:
            return nk, lambda j: j
        n_pre = min(-(-self.prefix // bk), nk)
        lo = 0 if self.left is None else lax.div(jnp.maximum(i * bq - self.left, 0), bk)
        hi = nk if self.right is None else jnp.minimum(lax.div((i + 1) * bq + self.right + bk - 1, bk), nk)
        lo = jnp.maximum(lo, n_pre)
        n = n_pre + jnp.maximum(hi - lo, 0)
        return n, lambda j: lax.select(j < n_pre, _i32(j), _i32(lo + j - n_pre))  # lax: no jit inside Pallas

    def query_blocks(self, j, bq: int, bk: int, nq: int):
        """(lo, hi): the query blocks key block ``j`` meets (all of them when it holds prefix keys)."""
        if not self.masked:
            return 0, nq
        lo = 0 if self.right is None else lax.div(jnp.maximum(j * bk - self.right, 0), bq)
        hi = nq if self.left is None else jnp.minimum(lax.div((j + 1) * bk + self.left + bq - 1, bq), nq)
        if self.prefix:
            in_prefix = j * bk < self.prefix
            lo, hi = lax.select(in_prefix, _i32(0), _i32(lo)), lax.select(in_prefix, _i32(nq), _i32(hi))
        return lo, hi

    def kept_pairs(self, t: int, s: int) -> int:
        """Number of kept (query, key) pairs for ``t`` queries over ``s`` keys."""
        i = np.arange(t)
        lo = np.zeros(t, int) if self.left is None else np.maximum(i - self.left, 0)
        hi = np.full(t, s - 1) if self.right is None else np.minimum(i + self.right, s - 1)
        band = np.maximum(hi - lo + 1, 0)
        p = min(self.prefix, s)
        # prefix keys outside the band: below it, and above it when the band ends inside the prefix
        extra = np.minimum(lo, p) + np.maximum(p - hi - 1, 0)
        return int(np.sum(band + extra))

    def visited_blocks(self, t: int, s: int, bq: int, bk: int) -> int:
        """(query block, key block) tiles the forward computes (the rest are skipped)."""
        return int(sum(int(self.key_blocks(i, bq, bk, s // bk)[0]) for i in range(t // bq)))


def _i32(x):
    return lax.convert_element_type(x, jnp.int32)


def as_band(causal, mask: Band | None = None) -> Band:
    """``mask``, else the plain (causal or full) band; ``causal`` may itself be a :class:`Band`."""
    if mask is not None:
        return mask
    return causal if isinstance(causal, Band) else Band(right=0) if causal else Band()


def band(*, causal: bool, window=None, prefix: int = 0, seq_q: int, seq_k: int) -> Band:
    """The :class:`Band` of the kernels' ``causal``/``window``/``prefix`` arguments.

    ``window`` w (an int) keeps the w most recent keys i − w < j ≤ i when causal, |i − j| < w
    otherwise; (left, right) keeps i − left ≤ j ≤ i + right. ``causal`` also caps right at 0.

    Raises:
      ValueError: a window or prefix that is not a non-negative int (w ≥ 1), or one with seq_q ≠ seq_k.
    """
    left = right = None
    if window is not None:
        if isinstance(window, int | np.integer) and not isinstance(window, bool):
            if window < 1:
                raise ValueError(f"window={window}; it counts the keys a query keeps and must be ≥ 1")
            left, right = int(window) - 1, (None if causal else int(window) - 1)
        elif isinstance(window, tuple) and len(window) == 2 and all(isinstance(w, int | np.integer) for w in window):
            left, right = int(window[0]), int(window[1])
            if left < 0 or right < 0:
                raise ValueError(f"window={window}; left and right must be ≥ 0 (every query keeps its own key)")
        else:
            raise ValueError(f"window={window!r}; give an int (keys kept) or a (left, right) pair of ints")
    if causal:
        right = 0 if right is None else min(right, 0)
    if not isinstance(prefix, int | np.integer) or prefix < 0:
        raise ValueError(f"prefix={prefix!r}; give the number of leading keys every query keeps (an int ≥ 0)")
    if left is None and right is None:
        prefix = 0  # every key is kept already
    result = Band(left=left, right=right, prefix=int(prefix))
    if result.masked and seq_q != seq_k:
        raise ValueError(f"a causal, window or prefix mask needs seq_q == seq_k; got {seq_q} and {seq_k}")
    return result
