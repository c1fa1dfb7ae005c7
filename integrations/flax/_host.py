"""What the host adds to a step on virtual CPU devices: dispatches, buffers, and shared cores.

Four measurements on this machine, each a median over repeated runs (the ranges below are
what session 8 saw on the 2-core development machine):

* **dispatch** d(k): one tiny jitted call on inputs already placed on a k-device
  mesh, waited for. It depends on k: 5–9 µs on one device, 57–135 µs on 2, 4
  or 8 (a multi-device program is launched on every device's thread and joined);
* **buffer** b: host seconds per device buffer a call takes or returns (one
  call over 64 arrays against one over a single array; 0.8–1.5 µs);
* **blocking** β(k): the share of a multi-device program's run the dispatching
  thread is held for, beyond d(k) (a chain of 512² matmuls on k devices: 0.5–0.8
  of the run on 2, 4 and 8 devices, 0.01–0.03 on one), so a pipeline's host
  issues its next call only after β × the last one's time;
* **slowdown** s(k): a workload (the bench gives the recipe's forward and
  backward) run on k devices at once, each on its own copy of the arguments,
  against one device alone. The ``local`` cluster's devices share the host's c
  cores, but one device alone already uses more than one core (XLA:CPU's
  intra-op threads), so s(k) is not max(1, k/c): measured for tiny GPT's forward
  and backward at batch 16 × 64, s = 1.3–1.6, 2.2–2.8 and 4.3–5.2 at k = 2, 4
  and 8 with c = 2, where max(1, k/c) says 1, 2 and 4.

A stage whose k devices run alone then takes s(k) × its single-device time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from itertools import pairwise

import jax
import numpy as np

MESH_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True, slots=True)
class HostCosts:
    dispatch_s: dict[int, float]  # by mesh size
    buffer_s: float
    blocking: dict[int, float]  # by mesh size
    slowdown: dict[int, float]  # by number of devices busy at once
    executor_s: float = 0.0  # the executor's own host seconds per dispatch (``_bench.executor_seconds``)

    def dispatch(self, devices: int) -> float:
        """d(k), from the nearest measured mesh size at or above ``devices``."""
        return _at_or_above(self.dispatch_s, devices)

    def blocked(self, devices: int) -> float:
        """β(k), from the nearest measured mesh size at or above ``devices``."""
        return _at_or_above(self.blocking, devices)

    def slow(self, devices: int) -> float:
        """s(k), linear in k between measured counts (s(1) = 1), proportional beyond the last."""
        points = sorted({1: 1.0, **self.slowdown}.items())
        for (k0, s0), (k1, s1) in pairwise(points):
            if devices <= k1:
                return s0 + (s1 - s0) * (devices - k0) / (k1 - k0)
        k, s = points[-1]
        return s * devices / k


def _at_or_above(by_size: dict[int, float], devices: int) -> float:
    """The entry of the smallest measured size ≥ ``devices`` (the largest beyond them all)."""
    return by_size[min((k for k in by_size if k >= devices), default=max(by_size))]


def _placed(devices: int, rows: int, cols: int, fill: float) -> jax.Array:
    """A (devices · rows, cols) array split over the first ``devices`` devices."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    return jax.device_put(np.full((devices * rows, cols), fill, np.float32), NamedSharding(mesh, P("data")))


def dispatch_seconds(devices: int, repeats: int = 100) -> float:
    """d(k): median host time of one tiny jitted call on inputs placed on ``devices`` devices, waited for."""
    from orchestrator.profile import median_seconds

    return median_seconds(jax.jit(lambda x: x + 1), _placed(devices, 1, 8, 0.0), repeats=repeats)


def blocking_share(devices: int, dispatch_s: float, n: int = 512, repeats: int = 20) -> float:
    """β(k): the time a call of a chain of n × n matmuls on each of ``devices`` devices takes to
    return, less ``dispatch_s`` (d(k)), over the time until its result is ready."""
    x = _placed(devices, n, n, 1.0)
    chain = jax.jit(lambda x: jax.vmap(lambda y: (y @ y) @ y)(x.reshape(devices, n, n)).reshape(devices * n, n))
    jax.block_until_ready(chain(x))
    issued, ready = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        y = chain(x)
        issued.append(time.perf_counter() - start)
        jax.block_until_ready(y)
        ready.append(time.perf_counter() - start)
    return min(1.0, max(0.0, (statistics.median(issued) - dispatch_s) / statistics.median(ready)))


def buffer_seconds(repeats: int = 30) -> float:
    """Host seconds per device buffer a call takes or returns: one jitted call over 64 arrays
    against one over a single array, each on 2 devices."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from orchestrator.profile import median_seconds

    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    sharding = NamedSharding(mesh, P())
    fn = jax.jit(lambda *xs: [x + 1 for x in xs])

    def seconds(n: int) -> float:
        xs = [jax.device_put(np.zeros((8, 8), np.float32), sharding) for _ in range(n)]
        return median_seconds(fn, *xs, repeats=repeats)

    return max(0.0, (seconds(64) - seconds(1)) / (63 * 2 * 2))  # 63 more arrays, in and out, 2 shards each


class SlowdownRun:
    """``step(*args)`` jitted once, its own copy of the arguments on each device, timed one round
    at a time: a round (:meth:`sample`) runs it on 1 device and then on k devices at once for each
    k in ``counts``. Rounds can be interleaved with other measurements (``_bench.timing_cases``)."""

    def __init__(self, step, *args, counts=MESH_SIZES):
        self.counts = [k for k in counts if 1 < k <= len(jax.devices())]
        self.jitted = jax.jit(step)
        self.copies = [jax.device_put(args, device) for device in jax.devices()[: max(self.counts, default=1)]]

    def seconds(self, k: int) -> float:
        """Wall seconds of one run on the first ``k`` devices at once, waited for."""
        start = time.perf_counter()
        jax.block_until_ready([self.jitted(*copy) for copy in self.copies[:k]])
        return time.perf_counter() - start

    def sample(self, counts=None) -> dict[int, float]:
        """One round: seconds by device count, 1 and each of ``counts`` (default: all the run's).

        Each count runs twice back to back and the second run is timed, so that it does not start
        cold after whatever ran before it in the sample. (Session 23's two bench runs measured
        s(k) this way; what it changes alone was not measured.)"""
        wanted = self.counts if counts is None else [k for k in self.counts if k in set(counts)]
        return {k: (self.seconds(k), self.seconds(k))[1] for k in [1, *wanted]}

    def slowdown(self, samples) -> dict[int, float]:
        """s(k) from rounds of :meth:`sample`: the median time on k devices over that on one."""
        alone = statistics.median(s[1] for s in samples)
        return {k: statistics.median(s[k] for s in samples) / alone for k in self.counts if k in samples[0]}


def slowdown(step, *args, counts=MESH_SIZES, repeats: int = 9) -> dict[int, float]:
    """s(k) for each k in ``counts``: ``step(*args)`` jitted on each of k devices at once, its
    own copy of the arguments on each, median wall time over the time of one device alone."""
    from orchestrator.profile import median_seconds

    run = SlowdownRun(step, *args, counts=counts)
    if not run.counts:  # s(1) = 1 by definition
        return {}
    alone = median_seconds(lambda: run.seconds(1), repeats=repeats, warmup=2)
    return {k: median_seconds(lambda k=k: run.seconds(k), repeats=repeats, warmup=2) / alone for k in run.counts}


def measure_host_costs(step, *args) -> HostCosts:
    """d(k) and β(k) for every mesh size up to the local device count, b, and s(k) for ``step(*args)``."""
    sizes = [k for k in MESH_SIZES if k <= len(jax.devices())]
    dispatch_s = {k: dispatch_seconds(k) for k in sizes}
    return HostCosts(
        dispatch_s=dispatch_s,
        buffer_s=buffer_seconds(),
        blocking={k: blocking_share(k, dispatch_s[k]) for k in sizes},
        slowdown=slowdown(step, *args, counts=sizes),
    )
