"""One of two processes of the multi-process test: DP2 across processes × TP2 within each.

Usage: python two_process_worker.py PORT PROCESS_ID STEPS. Prints one JSON line
with the losses and the parameters' sum of squares after training.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, process_id, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

import jax.numpy as jnp  # noqa: E402

from integrations.flax import compile_step, shard  # noqa: E402
from orchestrator.bench.executor._parity import _stage  # noqa: E402
from orchestrator.planner._plan import Plan  # noqa: E402
from recipes import get_recipe, synthetic_batch  # noqa: E402

BATCH, SEQ = 8, 16
recipe = get_recipe("gpt-tiny")
# Mesh rows are data-parallel replicas: devices 0, 1 (process 0) and 2, 3 (process 1).
stage = _stage(range(4), range(4), tp=2, dp=2, microbatch=BATCH // 2, device_type="cpu")
plan = Plan(stages=(stage,), schedule="gpipe", microbatches=1, global_batch=BATCH, iteration_s=0.0)
state = jax.jit(recipe.create_state)(jax.random.key(0))
axes = recipe.param_axes()
placed = shard(plan, state, param_axes=axes)
step = compile_step(plan, recipe.train_step, placed, param_axes=axes)
losses = []
for i in range(steps):
    placed, metrics = step(placed, synthetic_batch(jax.random.key(i), BATCH, SEQ, recipe.config.vocab_size))
    losses.append(float(metrics["loss"]))
squares = jax.jit(lambda p: sum(jnp.sum(x**2) for x in jax.tree.leaves(p)))(placed.params)
print(json.dumps({"process": process_id, "devices": jax.device_count(), "losses": losses, "sq": float(squares)}))
jax.distributed.shutdown()
