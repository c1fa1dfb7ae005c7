"""What the host adds to a step on virtual CPU devices: dispatches, buffers, wake-ups and shared cores.

Five measurements on this machine, each a median over repeated runs:

* **dispatch** d(k): one tiny jitted call on inputs already placed on a k-device mesh, waited
  for. It depends on k: a multi-device program is launched on every device's thread and joined,
  so a call to 2, 4 or 8 devices costs an order of magnitude more than one to a single device;
* **wake-up** w(k): what the same tiny call costs more right after the recipe's forward and
  backward ran on all the devices than right after itself. A stage in a pipeline starts after
  other devices' work, so its first call pays it, and the bench times each stage alone right
  after that same work (:meth:`SlowdownRun.busy`);
* **buffer** b: host seconds per device buffer a call takes or returns (one call over 64 arrays
  against one over a single array);
* **blocking** β(k): the share of a multi-device program's run the dispatching thread is held
  for, beyond d(k) (a chain of 512² matmuls on k devices), so a pipeline's host issues its next
  call only after β × the last one's time;
* **slowdown** s(k): a workload (the bench gives the recipe's forward and backward) run as one
  program over k devices, each device on its own copy of the arguments (``jax.shard_map``),
  against one device alone. The ``local`` cluster's devices share the host's c cores, but one
  device alone already uses more than one core (XLA:CPU's intra-op threads), so s(k) is not
  max(1, k/c). It is one program over k devices because that is how a stage runs: k separate
  one-device programs dispatched in a loop are slower than one program over the k devices.

A stage whose k devices run alone then takes s(k) × its single-device time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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
    executor_s: float = 0.0  # the executor's own host seconds per dispatch (``_cases.executor_seconds``)
    wake_s: dict[int, float] = field(default_factory=dict)  # by mesh size; 0 where not measured
    # the cost of cutting one program in two on one device (``LayerProfiler.boundary_seconds``)
    boundary_s: float = 0.0

    def dispatch(self, devices: int) -> float:
        """d(k), from the nearest measured mesh size at or above ``devices``."""
        return _at_or_above(self.dispatch_s, devices)

    def wake(self, devices: int) -> float:
        """w(k), from the nearest measured mesh size at or above ``devices`` (0 if none was measured)."""
        return _at_or_above(self.wake_s, devices) if self.wake_s else 0.0

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
    from orchestrator.timing import median_seconds

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

    from orchestrator.timing import median_seconds

    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    sharding = NamedSharding(mesh, P())
    fn = jax.jit(lambda *xs: [x + 1 for x in xs])

    def seconds(n: int) -> float:
        xs = [jax.device_put(np.zeros((8, 8), np.float32), sharding) for _ in range(n)]
        return median_seconds(fn, *xs, repeats=repeats)

    return max(0.0, (seconds(64) - seconds(1)) / (63 * 2 * 2))  # 63 more arrays, in and out, 2 shards each


class SlowdownRun:
    """``step(*args)`` as one program over k devices, each device on its own copy of the arguments
    (``jax.shard_map`` over a leading axis of k copies), compiled once per k in ``counts`` and for
    one device, and timed one round at a time: a round (:meth:`sample`) runs it on 1 device and then
    on k devices for each k. Rounds can be interleaved with other measurements
    (``_cases.timing_cases``)."""

    def __init__(self, step, *args, counts=MESH_SIZES):
        self.counts = [k for k in counts if 1 < k <= len(jax.devices())]
        self.programs = {k: _on_each_device(step, args, k) for k in [1, *self.counts]}

    def seconds(self, k: int) -> float:
        """Wall seconds of one run on the first ``k`` devices, waited for."""
        program, copies = self.programs[k]
        start = time.perf_counter()
        jax.block_until_ready(program(*copies))
        return time.perf_counter() - start

    def busy(self) -> None:
        """One untimed run on all of the run's devices (its largest count), waited for: the state a
        stage in a pipeline starts from, other devices' work just done."""
        program, copies = self.programs[max(self.programs)]
        jax.block_until_ready(program(*copies))

    def sample(self, counts=None) -> dict[int, float]:
        """One round: seconds by device count, 1 and each of ``counts`` (default: all the run's).

        Each count runs twice back to back and the second run is timed, so that it does not start
        cold after whatever ran before it in the sample."""
        wanted = self.counts if counts is None else [k for k in self.counts if k in set(counts)]
        return {k: (self.seconds(k), self.seconds(k))[1] for k in [1, *wanted]}

    def slowdown(self, samples) -> dict[int, float]:
        """s(k) from rounds of :meth:`sample`: the median time on k devices over that on one."""
        alone = statistics.median(s[1] for s in samples)
        return {k: statistics.median(s[k] for s in samples) / alone for k in self.counts if k in samples[0]}


def _on_each_device(step, args, k: int):
    """(program, its arguments): ``step`` jitted over the first k devices, each running it on its own
    copy of ``args`` (stacked on a leading axis split over the devices); compiled and run once."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((k,), ("copy",), devices=jax.devices()[:k])
    copies = jax.device_put(
        jax.tree.map(lambda a: np.broadcast_to(np.asarray(a), (k, *np.shape(a))), args), NamedSharding(mesh, P("copy"))
    )

    def each(*stacked):
        out = step(*jax.tree.map(lambda a: a[0], stacked))
        return jax.tree.map(lambda a: a[None], out)

    program = jax.jit(jax.shard_map(each, mesh=mesh, in_specs=P("copy"), out_specs=P("copy")))
    jax.block_until_ready(program(*copies))
    return program, copies


def slowdown(step, *args, counts=MESH_SIZES, repeats: int = 9) -> dict[int, float]:
    """s(k) for each k in ``counts``: ``step(*args)`` as one program over k devices, each on its own
    copy of the arguments (:class:`SlowdownRun`), median wall time over that of one device alone."""
    counts = [k for k in counts if 1 < k <= len(jax.devices())]
    if not counts:  # s(1) = 1 by definition
        return {}
    return slowdown_of(SlowdownRun(step, *args, counts=counts), repeats=repeats)


def slowdown_of(run: SlowdownRun, repeats: int = 9) -> dict[int, float]:
    """s(k) for each of ``run``'s counts from ``repeats`` rounds after two warm-up rounds."""
    if not run.counts:
        return {}
    run.sample(), run.sample()
    return run.slowdown([run.sample() for _ in range(repeats)])


def wake_seconds(devices: int, busy: Callable[[], object], repeats: int = 20) -> float:
    """w(k): a tiny jitted call on ``devices`` devices right after ``busy()`` (waited for) against
    the same call right after itself, difference of the medians (at least 0).

    What ran before matters: a one-device stage takes longer right after an 8-device run than
    right after a 4-device one, so the timing case runs the same ``busy()`` before every stage it
    times."""
    x = _placed(devices, 1, 8, 0.0)
    tiny = jax.jit(lambda x: x + 1)
    jax.block_until_ready(tiny(x))
    cold, warm = [], []
    for _ in range(repeats):
        jax.block_until_ready(busy())
        for times in (cold, warm):
            start = time.perf_counter()
            jax.block_until_ready(tiny(x))
            times.append(time.perf_counter() - start)
    return max(0.0, statistics.median(cold) - statistics.median(warm))


def measure_host_costs(step, *args) -> HostCosts:
    """d(k), w(k) and β(k) for every mesh size up to the local device count, b, and s(k) for
    ``step(*args)`` (w(k) after ``step`` ran on all the devices)."""
    sizes = [k for k in MESH_SIZES if k <= len(jax.devices())]
    dispatch_s = {k: dispatch_seconds(k) for k in sizes}
    run = SlowdownRun(step, *args, counts=sizes)
    return HostCosts(
        dispatch_s=dispatch_s,
        buffer_s=buffer_seconds(),
        blocking={k: blocking_share(k, dispatch_s[k]) for k in sizes},
        slowdown=slowdown_of(run),
        wake_s={k: wake_seconds(k, run.busy) for k in sizes},
    )
