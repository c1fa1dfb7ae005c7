"""Two processes under jax.distributed (gloo collectives) train like one device."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from recipes import get_recipe, synthetic_batch

STEPS = 3
WORKER = Path(__file__).with_name("two_process_worker.py")
ROOT = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_agree_with_one_device():
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(port), str(i), str(STEPS)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    assert [o["devices"] for o in outputs] == [4, 4]  # one global mesh over both processes
    assert outputs[0]["losses"] == outputs[1]["losses"]
    assert outputs[0]["sq"] == outputs[1]["sq"]

    recipe = get_recipe("gpt-tiny")
    state = jax.jit(recipe.create_state)(jax.random.key(0))
    step = jax.jit(recipe.train_step)
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, synthetic_batch(jax.random.key(i), 8, 16, recipe.config.vocab_size))
        losses.append(float(metrics["loss"]))
    squares = float(sum(jnp.sum(x**2) for x in jax.tree.leaves(state.params)))
    np.testing.assert_allclose(outputs[0]["losses"], losses, rtol=1e-5)
    np.testing.assert_allclose(outputs[0]["sq"], squares, rtol=1e-5)
