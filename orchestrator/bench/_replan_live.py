"""``orchestrator bench replanner``: the Replanner on a real pipeline, a slowed stage loses layers.

One run of a 4-layer GPT (embedding, two blocks, head) on 8 jax devices, starting from an explicit
plan: layers 0–1 on devices 0–3, layers 2–3 on devices 4–7. The slowdown is real extra work:
every forward of a stage on devices 0–3 runs ``EXTRA`` more times (:class:`SlowDevices`, an
observer of the pipeline), about 1 + EXTRA/3 times the stage's work. Timeline:

    step 0            compile
    steps 1–5         calibration
    step SPIKE        slowdown for this step only
    steps ONSET–…     slowdown from here on: the Replanner must switch within BOUND steps
    switch + 1        the new plan compiles; then calibration and AFTER more steps

:func:`run_scenario` runs it and returns the record; ``tests/integrations/flax_execute/test_replanner.py``
checks its correctness (when and why the switch happens, where the work goes, losses and states).
:func:`run` is the speed claim: on both clocks, the fastest slowed step before the switch against
the fastest step after the new plan compiled (other load on the machine only adds time, so each
window's minimum is compared); ok when after < ``SPEEDUP`` × before.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np

from integrations.callbacks import Callback, Replanner
from integrations.flax import orchestrate
from orchestrator.planner import Plan, Stage
from recipes import Recipe, synthetic_batch
from recipes.gpt import GPTConfig

BATCH, SEQ, MICROBATCHES = 32, 32, 2
EXTRA = 12
# The injected slowdown makes stage 0 about 5x slower; on a 2-core machine with other work running,
# noise alone can lift the smoothed ratio well above 1.3 before the onset, so the threshold sits
# between the two.
WINDOW, THRESHOLD, PATIENCE = 5, 1.6, 3
SPIKE, ONSET = 7, 12
BOUND = math.ceil(WINDOW / 2) + PATIENCE  # steps from the onset to the switch decision, 2 of them slack
AFTER = WINDOW + 3  # steps run after the new plan compiled
SLOWED = 4  # the first SLOWED devices (jax order, which is the local cluster's order) are slowed
SPEEDUP = 0.8  # the bench's claim: after the switch a step takes under this share of a slowed one


class SlowDevices:
    """Fault injection: each forward of a stage using a device in ``extra`` (device id → runs) runs
    again that many more times (the most any of its devices asks for), waited for, results
    discarded, so the stage really does more work. Read at every dispatch: change the mapping to
    start or stop it."""

    def __init__(self, extra: dict[int, int]):
        self.extra = extra

    def on_step_begin(self, stages):
        pass

    def on_dispatch(self, dispatch):
        pass

    def on_dispatched(self, dispatch, outputs):
        if dispatch.kind != "forward" or not self.extra:
            return
        for _ in range(max(self.extra.get(d.id, 0) for d in dispatch.devices)):
            jax.block_until_ready(dispatch.fn(*dispatch.args))

    def on_step_end(self):
        pass


def stage(layers, devices) -> Stage:
    """A data-parallel stage of ``layers`` on local devices ``devices`` (4 of them), unpriced."""
    return Stage(
        layers=tuple(layers),
        device_type=jax.devices()[0].device_kind,
        devices=tuple(f"localhost/{i}" for i in devices),
        tp=1,
        dp=4,
        recompute=False,
        microbatch_size=BATCH // MICROBATCHES // 4,
        time_s=0.0,
        memory_bytes=0.0,
    )


@dataclass
class Scenario:
    """What one run of the scenario leaves behind.

    Attributes:
      recipe, batches: the model and the 4 batches it cycles through (step s trains on ``batches[s % 4]``).
      run: the orchestrated run (its plan is the one it ended with).
      replanner: the Replanner that acts (a 200-step horizon); its ``decisions``, ``step_cpu_s``
        and ``step_times_s`` (wall) are the record of every step.
      cautious: a Replanner with a one-step horizon on the same run, which never pays for a recompile.
      messages: what the ``orchestrator.replanner`` logger said.
      losses, layers_on_slowed, work_on_slowed: per step, the loss, and the layers and forward
        FLOPs held by stages on a slowed device after the step.
      switch: the step after which the plan changed; None if it never did.
      states: host copies of the state: ``"before"`` (what the old plan's last step returned),
        ``"switched"`` (resharded onto the new plan), ``"after"`` (after the new plan's first step).
    """

    recipe: Recipe
    batches: list
    run: object
    replanner: Replanner
    cautious: Replanner
    messages: list[str] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    layers_on_slowed: list[int] = field(default_factory=list)
    work_on_slowed: list[float] = field(default_factory=list)
    switch: int | None = None
    states: dict = field(default_factory=dict)

    @property
    def decisions(self):
        return self.replanner.decisions

    @property
    def step_cpu_s(self) -> dict[int, float]:
        return self.replanner.step_cpu_s

    @property
    def step_wall_s(self) -> dict[int, float]:
        return self.replanner.step_times_s


class _LastState(Callback):
    def on_step_end(self, step, metrics, *, state=None):
        self.state = state


class _Records(logging.Handler):
    def __init__(self, messages: list[str]):
        super().__init__(logging.INFO)
        self.messages = messages

    def emit(self, record):
        self.messages.append(record.getMessage())


def even_plan() -> Plan:
    """The scenario's starting plan: layers 0–1 on devices 0–3, layers 2–3 on devices 4–7, 1F1B."""
    return Plan(
        stages=(stage((0, 1), range(4)), stage((2, 3), range(4, 8))),
        schedule="1f1b",
        microbatches=MICROBATCHES,
        global_batch=BATCH,
        iteration_s=0.0,
    )


def run_scenario(progress: Callable[[str], None] | None = None) -> Scenario:
    """Run the scenario of the module docstring on the local devices (at least 8 jax devices)."""
    config = GPTConfig(vocab_size=256, max_seq_len=SEQ, num_layers=2, num_heads=4, d_model=256)
    recipe = Recipe(name="gpt-replan", config=config, batch_size=BATCH, seq_len=SEQ)
    state = jax.jit(recipe.create_state)(jax.random.key(0))
    batches = [synthetic_batch(jax.random.key(i), BATCH, SEQ, config.vocab_size) for i in range(4)]
    plan = even_plan()
    slowdown: dict[int, int] = {}
    run = orchestrate(
        state,
        recipe.train_step,
        "local",
        batch=batches[0],
        param_axes=recipe.param_axes(),
        plan=plan,
        pipeline_options={"observers": [SlowDevices(slowdown)]},
    )
    slowed = {d.id for d in jax.devices()[:SLOWED]}
    slowed_refs = {d.ref for d in run.cluster.all_devices()[:SLOWED]}  # the same devices, as plan refs
    # Same drift, same numbers; a one-step horizon never pays for a recompile. At most 2 stages: the
    # planner's `local` model has no host costs (the executor bench's simulated step does), so it
    # prices plans of more, smaller stages faster than they run here, where a step is host-bound
    # (8 devices on 2 cores) and 3 or 4 stages take as long as the current plan.
    options = {"window": WINDOW, "threshold": THRESHOLD, "patience": PATIENCE, "max_stages": 2}
    cautious = Replanner(run, horizon_steps=1, **options)
    replanner = Replanner(run, horizon_steps=200, **options)
    last = _LastState()
    run.callbacks.callbacks += [last, cautious, replanner]
    out = Scenario(recipe=recipe, batches=batches, run=run, replanner=replanner, cautious=cautious)
    records = _Records(out.messages)
    logger = logging.getLogger("orchestrator.replanner")
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        for step in range(ONSET + BOUND + 2 + AFTER):
            if progress:
                progress(f"step {step}")
            slowdown.clear()
            if step == SPIKE or step >= ONSET:
                slowdown.update(dict.fromkeys(slowed, EXTRA))
            plan_before = run.plan
            out.losses.append(float(run.step(batches[step % 4])["loss"]))
            held = [s for s in run.plan.stages if set(s.devices) & slowed_refs]
            out.layers_on_slowed.append(sum(len(s.layers) for s in held))
            out.work_on_slowed.append(sum(run.layers[i].forward_flops for s in held for i in s.layers))
            if out.switch is None and run.plan is not plan_before:
                out.switch = step
                out.states["before"] = _host(last.state)  # what the old plan's step returned
                out.states["switched"] = _host(run.state)  # resharded onto the new plan
            if out.switch is not None and step == out.switch + 1:
                out.states["after"] = _host(run.state)
            if out.switch is not None and step >= out.switch + 1 + AFTER:
                break
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    return out


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def speedup_rows(record: Scenario) -> list[dict]:
    """One row per clock: the fastest slowed step from the onset to the switch (``before_s``) against
    the fastest of the AFTER steps after the new plan compiled (``after_s``); ok when
    after < SPEEDUP × before. One failed row when the plan never changed."""
    if record.switch is None:
        return [{"name": "switch", "ok": False, "error": "the Replanner kept the slowed plan"}]
    switch, rows = record.switch, []
    for clock, times in (("cpu", record.step_cpu_s), ("wall", record.step_wall_s)):
        before = min(times[s] for s in range(ONSET, switch + 1))
        after = min(times[s] for s in range(switch + 2, switch + 2 + AFTER) if s in times)
        rows.append(
            {
                "name": f"slowed step, {clock} clock",
                "clock": clock,
                "switch_step": switch,
                "before_s": before,
                "after_s": after,
                "ratio": after / before,
                "limit": SPEEDUP,
                "ok": after < SPEEDUP * before,
            }
        )
    return rows


@contextlib.contextmanager
def _fresh_profile_cache():
    """Profile into an empty cache: the plan the Replanner switches to depends on the profiled
    timings, so the bench starts from the ones a fresh clone measures, not from an earlier run's."""
    previous = os.environ.get("ORCHESTRATOR_CACHE")
    with tempfile.TemporaryDirectory(prefix="orchestrator-bench-cache-") as cache:
        os.environ["ORCHESTRATOR_CACHE"] = cache
        try:
            yield
        finally:
            if previous is None:
                del os.environ["ORCHESTRATOR_CACHE"]
            else:
                os.environ["ORCHESTRATOR_CACHE"] = previous


def run(progress: Callable[[str], None] | None = None) -> dict:
    """The scenario once, in a fresh profile cache: ``{"cases": speedup_rows(...)}``."""
    with _fresh_profile_cache():
        return {"cases": speedup_rows(run_scenario(progress))}
