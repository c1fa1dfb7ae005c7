"""The ``local`` cluster: this machine's jax devices, measured.

Virtual CPU devices (``--xla_force_host_platform_device_count``) share the
cores this process may run on (its CPU affinity, so ``taskset -c 0`` means one);
the cluster records that in ``shared_cores``. Peak FLOP/s and
memory bandwidth are measured once per process with a compiled matmul and a
copy on one device (medians of a few runs), and each of n virtual devices on
c cores is given its share when all run at once:

    peak_flops(device) = measured FLOP/s · min(1, c / n)
    bandwidth(device)  = measured bytes/s · min(1, c / n)
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from orchestrator.cluster._model import Cluster, DeviceType, Host, Link
from orchestrator.timing import median_seconds


@functools.cache
def measure_local_device(size: int = 1024, repeats: int = 9) -> tuple[float, float]:
    """(matmul FLOP/s, copy bytes/s) of the first local device, fp32.

    The copy (a 32 MiB array scaled in place) donates its input, so each call writes into the
    buffer it read, as the ops inside a compiled step write into buffers the program reuses.
    Into a fresh output instead, the CPU faults in every page of the output on each call, an
    order of magnitude slower than the reused buffer; the roofline would then price elementwise
    ops, which tensor parallelism repeats on every device, far above their cost in a step.
    """
    device = jax.devices()[0]
    a = jax.device_put(jnp.ones((size, size), jnp.float32), device)
    matmul = jax.jit(lambda x: x @ x)
    flops = 2 * size**3 / median_seconds(matmul, a)
    copy = jax.jit(lambda x: x * 1.0001, donate_argnums=0)
    buffer = [jax.device_put(jnp.ones((8 * size, size), jnp.float32), device)]

    def scale_in_place():
        buffer[0] = copy(buffer[0])
        return buffer[0]

    bandwidth = 2 * buffer[0].nbytes / median_seconds(scale_in_place, repeats=repeats, warmup=2)
    return flops, bandwidth


def last_level_cache_bytes() -> int | None:
    """Size of the CPU's last-level cache from Linux sysfs (e.g. ``32768K``), or None where it is not listed."""
    from pathlib import Path

    levels = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        number, unit = (size[:-1], units[size[-1]]) if size[-1:] in units else (size, 1)
        if number.isdigit():
            levels.append((level, int(number) * unit))
    return max(levels)[1] if levels else None


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (``taskset``, a container's CPU set), which
    can be fewer than the machine's ``os.cpu_count()``; that count where affinity is not reported."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def local_cluster() -> Cluster:
    devices = jax.devices()
    kind = devices[0].device_kind or devices[0].platform
    flops, bandwidth = measure_local_device()
    try:
        import psutil

        memory = psutil.virtual_memory().total
    except ImportError:  # pragma: no cover - psutil ships with our dependencies
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu = devices[0].platform == "cpu"
    cores = usable_cores()
    share = min(1.0, cores / len(devices)) if cpu else 1.0  # virtual CPU devices split the cores
    per_device_memory = memory // len(devices) if cpu else memory
    cache = last_level_cache_bytes() if cpu else None
    dtype = DeviceType(
        name=kind,
        peak_flops={"float32": flops * share},
        memory_bytes=int(per_device_memory),
        memory_bandwidth_bytes_per_s=bandwidth * share,
        cache_bytes=cache,
    )
    # Devices of one process exchange data through host memory.
    link = Link(bandwidth_bytes_per_s=bandwidth / 2, latency_s=5e-6)
    return Cluster(
        name="local",
        device_types={kind: dtype},
        hosts=(Host(name="localhost", device_type=kind, count=len(devices), rack="localhost", intra_link=link),),
        rack_link=None,
        cluster_link=None,
        shared_cores=cores if cpu else None,
    )
