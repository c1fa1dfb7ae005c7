"""Wall-clock timing of compiled JAX calls: the one timing helper every measurement uses.

It sits below every other package, so measuring the local cluster's devices and profiling
layers time their calls the same way.
"""

from __future__ import annotations

import time

import numpy as np

__all__ = ["median_seconds"]


def median_seconds(fn, *args, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn(*args)`` over ``repeats`` runs after ``warmup`` runs (waits for results).

    Example:
        >>> import jax.numpy as jnp
        >>> median_seconds(lambda x: x + 1, jnp.ones(4), repeats=3) > 0
        True
    """
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))
