"""What XLA compiles ring attention into: per-device temp memory by ring size and the collective-permutes' bytes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from conductor.kernels import AttentionBlockSizes
from conductor.kernels.ring import ring_attention
from orchestrator.costs import block_bytes, ring_permute_bytes

T, HEADS, KV_HEADS, HEAD_DIM = 8192, 8, 2, 64
RINGS = (2, 4, 8)


def compiled_step(n):
    """The compiled gradient of causal zigzag ring attention (GQA, fp32) over ``n`` devices, from shapes only."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("context",))
    sharding = NamedSharding(mesh, PartitionSpec(None, "context"))
    q = jax.ShapeDtypeStruct((1, T, HEADS, HEAD_DIM), jnp.float32, sharding=sharding)
    kv = jax.ShapeDtypeStruct((1, T, KV_HEADS, HEAD_DIM), jnp.float32, sharding=sharding)
    blocks = AttentionBlockSizes(block_q=128, block_k=128)

    def loss(q, k, v):
        return jnp.sum(ring_attention(q, k, v, mesh=mesh, causal=True, block_sizes=blocks))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()


@pytest.fixture(scope="module")
def compiled():
    return {n: compiled_step(n) for n in RINGS}


def permutes(hlo: str):
    """(bytes, inside the step loop) of each collective-permute in optimized HLO text."""
    found = []
    for line in hlo.splitlines():
        match = re.search(r"= f32\[([\d,]*)\]\S* collective-permute\(", line)
        if match:
            elements = int(np.prod([int(d) for d in match.group(1).split(",") if d]))
            found.append((4 * elements, "/while/body/" in line))
    return found


def test_temp_memory_falls_as_one_over_n(compiled):
    temp = {n: compiled[n].memory_analysis().temp_size_in_bytes for n in RINGS}
    for n in RINGS[1:]:
        # temp · n stays what it is on two devices: the attention's working set is O(T/n)
        assert 0.8 <= temp[n] * n / (temp[2] * 2) <= 1.25, temp


@pytest.mark.parametrize("n", RINGS)
def test_collective_permutes_carry_the_predicted_block_bytes(compiled, n):
    found = permutes(compiled[n].as_text())
    kv_block = block_bytes(1, T, n, KV_HEADS, HEAD_DIM, 4)
    # the forward sends K and V as two permutes; the backward sends them joined, and dK, dV joined
    assert {size for size, _ in found} == {kv_block // 2, kv_block}
    # steps 1 … n−2 run in a loop; step 0, the last step and the final dK/dV send are peeled off it
    sent = sum(size * (n - 2 if in_loop else 1) for size, in_loop in found)
    predicted = ring_permute_bytes(1, T, n, KV_HEADS, HEAD_DIM, 4, backward=True)
    assert abs(sent - predicted) <= 0.01 * predicted
