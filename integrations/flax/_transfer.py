"""Move an array between two meshes device to device, without a trip through the host.

``jax.device_put(x, sharding)`` copies device to device only when every shard
the destination wants is already a shard of ``x`` (same slices, other
devices). Between two pipeline stages with different data-parallel degrees
that is not so — a batch split in 2 on one mesh, wanted in 4 on the next — and
jax 0.10 then reads the whole array to the host (``Array._value``) and
scatters it again: the host waits for the producing stage to finish, so the
executor stops dispatching ahead, and each such transfer costs the host
milliseconds.

:func:`transfer` cuts each destination shard out of a source shard that holds
it, on that shard's device, and copies the piece to its destination device:
every step stays asynchronous. When no single source shard holds a destination
shard (a tensor-parallel parameter wanted whole on another stage: the tied
embedding), the array is first gathered on its own mesh by a jitted all-gather.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import NamedSharding, Sharding
from jax.sharding import PartitionSpec as P


def _key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


@functools.cache
def _slicer(start: tuple[int, ...], limit: tuple[int, ...]):
    return jax.jit(lambda x: jax.lax.slice(x, start, limit))


@functools.cache
def _same_placement(a: Sharding, b: Sharding, ndim: int) -> bool:
    """``P('model')`` and ``P('model', None)`` on one mesh: the same shards on the same devices."""
    return a.is_equivalent_to(b, ndim)


@functools.cache
def _replicator(source: Sharding):
    """Every device of ``source`` gets the whole array (an all-gather, device to device)."""
    return jax.jit(lambda x: x, out_shardings=NamedSharding(source.mesh, P()))


def _source_for(bounds, sources):
    """A (source bounds, single-device array) whose slice contains ``bounds``, or None."""
    for held, data in sources:
        if all(h0 <= b0 and b1 <= h1 for (h0, h1), (b0, b1) in zip(held, bounds)):
            return held, data
    return None


def transfer(x: jax.Array, sharding: Sharding) -> jax.Array:
    """``x`` placed per ``sharding``, copied device to device (see the module docstring)."""
    if not isinstance(x, jax.Array) or not x.is_fully_addressable or not isinstance(x.sharding, NamedSharding):
        return jax.device_put(x, sharding)
    if x.sharding == sharding or _same_placement(x.sharding, sharding, x.ndim):
        return x  # already there (a stage's own parameters, every step)
    shape = x.shape
    sources = [(_key(s.index, shape), s.data) for s in x.addressable_shards]
    held = {bounds for bounds, _ in sources}
    wanted = {d: _key(index, shape) for d, index in sharding.addressable_devices_indices_map(shape).items()}
    if all(bounds in held for bounds in wanted.values()):
        return jax.device_put(x, sharding)  # jax's own path is device to device here
    found = {device: _source_for(bounds, sources) for device, bounds in wanted.items()}
    if any(f is None for f in found.values()):  # a piece spans source shards: gather on the source mesh first
        x = _replicator(x.sharding)(x)
        return transfer(x, sharding)
    pieces = []
    for device, bounds in wanted.items():
        source_bounds, data = found[device]
        start = tuple(b0 - h0 for (b0, _), (h0, _) in zip(bounds, source_bounds))
        limit = tuple(b1 - h0 for (_, b1), (h0, _) in zip(bounds, source_bounds))
        if start != (0,) * len(shape) or limit != data.shape:
            data = _slicer(start, limit)(data)
        pieces.append(jax.device_put(data, device))
    return jax.make_array_from_single_device_arrays(shape, sharding, pieces)
