"""The selective scan sharded along the sequence over 8 virtual CPU devices: numerics against the
one-device scan, the carry's collectives in the compiled HLO, and the per-device temp memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from conductor.kernels.scan import (
    ScanBlockSizes,
    scan_carry_bytes,
    scan_state_bytes,
    selective_scan,
    sequence_sharded_scan,
    sequence_sharded_scan_shard,
)
from orchestrator.bench._scan_ring import (
    D_INNER,
    D_STATE,
    carry_sent_bytes,
    collectives,
    compiled_one_device_grad,
    compiled_scan_grad,
    scan_errors,
    scan_inputs,
)

SHARDS = (2, 4, 8)


@pytest.mark.parametrize("n", SHARDS)
def test_outputs_and_gradients_equal_the_one_device_scan(n):
    errors = scan_errors(n, 2048)
    assert max(errors.values()) <= 1e-5, errors


def test_pallas_form_equals_the_one_device_scan():
    # the Pallas kernel runs interpreted on CPU, so a shorter sequence
    errors = scan_errors(4, 512, implementation="pallas")
    assert max(errors.values()) <= 1e-5, errors


def test_shard_function_runs_inside_a_shard_map_with_a_batch_axis():
    (dt, a, v, b, c), _ = scan_inputs(1024, batch=4)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "context"))
    tokens = PartitionSpec("data", "context", None)

    def shard(dt, a, v, b, c):
        return sequence_sharded_scan_shard(dt, a, v, b, c, axis_name="context", block_sizes=ScanBlockSizes(chunk=64))

    specs = (tokens, PartitionSpec(), tokens, tokens, tokens)
    y = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=specs, out_specs=tokens))(dt, a, v, b, c)
    ref = selective_scan(dt, a, v, b, c, implementation="xla_chunked")
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(ref))))


def test_bad_input_is_one_line():
    (dt, a, v, b, c), _ = scan_inputs(256)
    mesh = Mesh(np.array(jax.devices()[:2]), ("context",))
    with pytest.raises(ValueError, match="implementation="):
        sequence_sharded_scan(dt, a, v, b, c, mesh=mesh, implementation="reference")
    with pytest.raises(ValueError, match="must divide"):
        sequence_sharded_scan(dt, a, v, b, c, mesh=mesh, block_sizes=ScanBlockSizes(chunk=48))


@pytest.fixture(scope="module")
def compiled():
    return {n: compiled_scan_grad(n, 8192) for n in SHARDS}


@pytest.mark.parametrize("n", SHARDS)
def test_compiled_collectives_carry_the_predicted_state_bytes(compiled, n):
    found = collectives(compiled[n].as_text())
    state = scan_state_bytes(1, D_INNER, D_STATE)
    # forward: one all-gather of every device's packed state; backward: its transpose, a reduce-scatter;
    # and the sum of ∂loss/∂A over the axis, as for any replicated parameter
    assert sorted(found) == sorted(
        [("all-gather", n * state), ("reduce-scatter", state), ("all-reduce", 4 * D_INNER * D_STATE)]
    )
    assert carry_sent_bytes(found, n) == scan_carry_bytes(1, D_INNER, D_STATE, n, backward=True) == 2 * (n - 1) * state


def test_temp_memory_per_device_falls_with_n(compiled):
    temp = [compiled[n].memory_analysis().temp_size_in_bytes for n in SHARDS]
    assert temp[0] > temp[1] > temp[2], temp
    for n, held in zip(SHARDS, temp):
        # the one-device chunked kernel's level on the device's slice: the final-state pass adds
        # input-sized buffers (its cotangents of Δ, v, B), nothing of size (B, T/n, D, N)
        alone = compiled_one_device_grad(8192 // n).memory_analysis().temp_size_in_bytes
        assert held <= 2.5 * alone, (n, held, alone)


def test_carry_bytes_arithmetic():
    assert scan_state_bytes(2, 1536, 16) == 2 * 1536 * 17 * 4
    assert scan_carry_bytes(2, 1536, 16, 1, backward=True) == 0
    assert scan_carry_bytes(2, 1536, 16, 4, 2) == 3 * 2 * 1536 * 17 * 2
