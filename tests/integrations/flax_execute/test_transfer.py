"""Moving arrays between stage meshes: values and shardings kept, never through the host."""

import jax
import jax._src.array as jax_array
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from integrations.flax._transfer import transfer


@pytest.fixture
def meshes():
    devices = jax.devices()
    source = jax.make_mesh((2, 2), ("data", "model"), devices=devices[:4])
    target = jax.make_mesh((4,), ("data",), devices=devices[4:])
    return source, target


@pytest.fixture
def no_host_trip(monkeypatch):
    """Fail if any array is read back to the host (jax's resharding fallback does that)."""

    def refuse(self):
        raise AssertionError("an array went through the host")

    monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(refuse))


@pytest.mark.parametrize(
    "source_spec, target_spec",
    [
        (P("data"), P("data")),  # batch split in 2, wanted in 4: pieces of the source shards
        (P("data"), P()),
        (P(None, None, "model"), P()),  # tensor-parallel parameter wanted whole: gathered first
        (P("data", None, "model"), P(None, None, "data")),
    ],
)
def test_transfer_keeps_values_and_target_sharding(meshes, source_spec, target_spec, no_host_trip):
    source, target = meshes
    values = np.arange(8 * 6 * 4, dtype=np.float32).reshape(8, 6, 4)
    x = jax.device_put(values, NamedSharding(source, source_spec))
    y = transfer(x, NamedSharding(target, target_spec))
    assert y.sharding == NamedSharding(target, target_spec)
    jax.block_until_ready(y)
    for shard in y.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), values[shard.index])


def test_plain_device_put_would_go_through_the_host(meshes, no_host_trip):
    """The case ``transfer`` exists for: jax 0.10 reshards a 2-way batch into 4 ways on the host."""
    source, target = meshes
    x = jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(source, P("data")))
    with pytest.raises(AssertionError, match="through the host"):
        jax.device_put(x, NamedSharding(target, P("data")))
