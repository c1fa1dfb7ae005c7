"""The executor's check plans and the parity run: a plan's training against one device.

Five plans over the 8 local devices (layers index the 4 coarsened layers of
the tiny recipes: embedding, two blocks, head):

* ``DP8``, ``TP8``, ``DP2xTP4``: one stage;
* ``2 stages (3+1) x 4 mb``: layers 0–2 on DP2×TP2, layer 3 on DP4, 1F1B, 4 microbatches;
* ``4 stages TP 1/2/4/1``: one layer per stage on 1, 2, 4 and 1 devices, GPipe, 4 microbatches.

Parity: the same initial state trained for a few steps under the plan and
under a plain ``jax.jit`` on one device; reports the largest relative loss
difference and the largest absolute parameter difference.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import jax
import numpy as np

PLAN_NAMES = ("DP8", "TP8", "DP2xTP4", "2 stages (3+1) x 4 mb", "4 stages TP 1/2/4/1")


def _stage(layers, devices, *, tp: int, dp: int, microbatch: int, device_type: str, host: str = "localhost"):
    from orchestrator.planner import Stage

    return Stage(
        layers=tuple(layers),
        device_type=device_type,
        devices=tuple(f"{host}/{i}" for i in devices),
        tp=tp,
        dp=dp,
        recompute=False,
        microbatch_size=microbatch,
        time_s=0.0,
        memory_bytes=0.0,
    )


def check_plan(name: str, *, global_batch: int, device_type: str = "cpu", host: str = "localhost"):
    """A :class:`~orchestrator.planner.Plan` for a 4-layer model on the first devices of 8.

    ``name`` is one of :data:`PLAN_NAMES` or any single-stage ``DP<a>``, ``TP<b>``, ``DP<a>xTP<b>`` (a·b ≤ 8).
    """
    from orchestrator.planner import Plan

    if global_batch % 16:
        raise ValueError(
            f"the check plans need a global batch divisible by 16 (4 microbatches × DP4), got {global_batch}"
        )
    b = global_batch // 4
    single = re.fullmatch(r"(?:DP(\d+))?x?(?:TP(\d+))?", name)
    if single and any(single.groups()):
        dp, tp = int(single.group(1) or 1), int(single.group(2) or 1)
        if dp * tp > 8:
            raise ValueError(f"plan {name!r} needs {dp * tp} devices; there are 8")
        stage = _stage(range(4), range(dp * tp), tp=tp, dp=dp, microbatch=global_batch // dp, device_type=device_type)
        return Plan(stages=(stage,), schedule="gpipe", microbatches=1, global_batch=global_batch, iteration_s=0.0)
    if name == "2 stages (3+1) x 4 mb":
        stages = (
            _stage((0, 1, 2), range(4), tp=2, dp=2, microbatch=b // 2, device_type=device_type, host=host),
            _stage((3,), range(4, 8), tp=1, dp=4, microbatch=b // 4, device_type=device_type, host=host),
        )
        return Plan(stages=stages, schedule="1f1b", microbatches=4, global_batch=global_batch, iteration_s=0.0)
    if name == "4 stages TP 1/2/4/1":
        stages = (
            _stage((0,), [0], tp=1, dp=1, microbatch=b, device_type=device_type, host=host),
            _stage((1,), [1, 2], tp=2, dp=1, microbatch=b, device_type=device_type, host=host),
            _stage((2,), [3, 4, 5, 6], tp=4, dp=1, microbatch=b, device_type=device_type, host=host),
            _stage((3,), [7], tp=1, dp=1, microbatch=b, device_type=device_type, host=host),
        )
        return Plan(stages=stages, schedule="gpipe", microbatches=4, global_batch=global_batch, iteration_s=0.0)
    raise ValueError(f"unknown check plan {name!r}; choose one of: {', '.join(PLAN_NAMES)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Parity:
    """Plan-executed training vs single-device training.

    Attributes:
      losses, reference_losses: per step.
      loss_rel_err: max over steps of |loss / reference − 1|.
      param_abs_err: max over parameters of |final − reference final|.
    """

    losses: tuple[float, ...]
    reference_losses: tuple[float, ...]
    loss_rel_err: float
    param_abs_err: float


@functools.cache
def _reference(recipe_name: str, steps: int, global_batch: int, seq_len: int):
    """(initial state, batches, losses, final params, param axes, layers) of single-device training."""
    from integrations.flax import capture
    from orchestrator.coarsen import coarsen
    from recipes import get_recipe, synthetic_batch

    recipe = get_recipe(recipe_name)
    vocab = recipe.config.vocab_size
    batches = [synthetic_batch(jax.random.key(i), global_batch, seq_len, vocab) for i in range(steps)]
    state = jax.jit(recipe.create_state)(jax.random.key(0))  # jitted: eager init costs seconds of dispatch
    reference = jax.jit(recipe.train_step)
    ref_state, ref_losses = state, []
    for batch in batches:
        ref_state, metrics = reference(ref_state, batch)
        ref_losses.append(float(metrics["loss"]))
    layers = coarsen(capture(recipe.train_step, recipe.abstract_state(), recipe.batch_spec(global_batch, seq_len)))
    return state, batches, ref_losses, ref_state.params, recipe.param_axes(), layers


def parity(recipe_name: str, plan, *, steps: int = 5, global_batch: int = 16, seq_len: int = 16) -> Parity:
    """Train ``steps`` steps of a recipe under ``plan`` and on one device, from the same state and batches.

    The single-device run is cached per (recipe, steps, batch, sequence length).
    """
    from integrations.flax import compile_step, shard
    from recipes import get_recipe

    recipe = get_recipe(recipe_name)
    state, batches, ref_losses, ref_params, axes, layers = _reference(recipe_name, steps, global_batch, seq_len)
    placed = shard(plan, state, param_axes=axes, layers=layers)
    step = compile_step(plan, recipe.train_step, placed, param_axes=axes, layers=layers)
    losses = []
    for batch in batches:
        placed, metrics = step(placed, batch)
        losses.append(float(metrics["loss"]))
    loss_err = float(np.max(np.abs(np.array(losses) / np.array(ref_losses) - 1)))
    param_err = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(placed.params), jax.tree.leaves(ref_params))
    )
    return Parity(
        losses=tuple(losses), reference_losses=tuple(ref_losses), loss_rel_err=loss_err, param_abs_err=param_err
    )
