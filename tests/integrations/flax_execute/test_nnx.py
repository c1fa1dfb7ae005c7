"""flax.nnx models with nnx.Optimizer run under a plan like on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from integrations.flax import compile_step, from_nnx, shard
from integrations.flax._shard import leaf_params
from orchestrator.bench.executor import check_plan


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(8, 32, rngs=rngs)
        self.b = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.b(nnx.gelu(self.a(x)))


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"])[:, 0] - batch["y"]) ** 2)


def test_nnx_model_trains_under_dp4xtp2_like_one_device():
    model = MLP(nnx.Rngs(0))
    state, step = from_nnx(model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param), loss_fn)
    owners = dict(
        zip([jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]], leaf_params(state))
    )
    assert owners["['opt_state'][1]['opt_state'][0]['mu']['a']['kernel'].value"] == ("0/a/kernel/value", False)
    x = jax.random.normal(jax.random.key(1), (16, 8))
    batch = {"x": x, "y": jnp.sin(x.sum(-1))}
    reference, ref_losses = state, []
    ref_step = jax.jit(step)
    plan = check_plan("DP4xTP2", global_batch=16)
    placed = shard(plan, state)
    planned = compile_step(plan, step, placed)
    losses = []
    for _ in range(3):
        reference, metrics = ref_step(reference, batch)
        ref_losses.append(float(metrics["loss"]))
        placed, metrics = planned(placed, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    for a, b in zip(jax.tree.leaves(placed["params"]), jax.tree.leaves(reference["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
