"""Wall-clock timing of compiled JAX calls."""

from __future__ import annotations

import time

import numpy as np


def median_seconds(fn, *args, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn(*args)`` over ``repeats`` runs after ``warmup`` runs (waits for results)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))
