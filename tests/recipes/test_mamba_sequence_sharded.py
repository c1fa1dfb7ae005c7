"""The Mamba recipe with its sequence sharded over 8 virtual CPU devices: the convolution's halo,
and five AdamW steps against the recipe on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from orchestrator.bench._scan_ring import mamba_losses
from recipes import Mamba, MambaConfig
from recipes.mamba import CausalConv1d


def test_convolution_reads_the_previous_devices_last_tokens():
    x = jax.random.normal(jax.random.key(0), (2, 64, 8))
    conv = CausalConv1d(4)
    params = conv.init(jax.random.key(1), x)
    mesh = Mesh(np.array(jax.devices()), ("context",))
    sharded = CausalConv1d(4, sequence_axis="context")
    spec = PartitionSpec(None, "context")
    apply = jax.shard_map(lambda p, x: sharded.apply(p, x), mesh=mesh, in_specs=(PartitionSpec(), spec), out_specs=spec)
    np.testing.assert_allclose(apply(params, x), conv.apply(params, x), rtol=1e-6, atol=1e-6)


def test_five_steps_equal_the_recipe_on_one_device():
    sharded, written = mamba_losses(8, 1024, steps=5)
    assert written[-1] < written[0]
    np.testing.assert_allclose(sharded, written, rtol=1e-5, atol=0)


def test_sharded_model_without_a_carrying_scan_is_refused():
    mesh = Mesh(np.array(jax.devices()[:2]), ("context",))
    model = Mamba(MambaConfig(vocab_size=16, num_layers=1, d_model=8, d_state=2), sequence_axis="context")
    tokens = jnp.zeros((1, 16), jnp.int32)
    init = jax.shard_map(
        lambda t: model.init(jax.random.key(0), t),
        mesh=mesh,
        in_specs=PartitionSpec(None, "context"),
        out_specs=PartitionSpec(),
    )
    with pytest.raises(ValueError, match="passes the state between devices"):
        init(tokens)
