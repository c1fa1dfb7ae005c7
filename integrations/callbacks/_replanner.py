"""``Replanner``: watch each stage's measured time, re-plan when one drifts, switch only when it pays.

**Measured.** A :class:`~integrations.callbacks._clock.StageClock`, which the Replanner adds to
the pipeline executor's observers, blocks on every program call and adds its time to its stage: ``b_s(t)``,
the busy seconds of stage s in step t, on one of two clocks: ``"wall"``, or ``"cpu"``, the
process's CPU seconds, which on virtual CPU devices is the work itself and does not change
when other processes take the cores (on a loaded machine the stage-to-stage CPU ratio holds
steady step to step while the wall-clock ratio swings).
``"auto"`` picks ``"cpu"`` on CPU devices and ``"wall"`` otherwise; step times, compile time
and the switch rule use the same clock. The prediction comes from the plan priced under the
current cost model (``price``): per microbatch stage time τ_s, send σ_s, optimizer u_s and
gradient sync g_s, over M microbatches,

    p_s = M · (τ_s − 2 σ_s) + u_s + g_s

**Smoothing.** Absolute times of virtual devices sharing a few cores are noisy and the cost
model has a standing bias per stage (dispatch, fusion); ratios and their changes are not:

    x_s(t) = b_s(t) / p_s                      measured over predicted
    x̄_s    = median of x_s over w calibration steps (after every switch)
    n_s(t) = x_s(t) / x̄_s                      change since calibration
    r_s(t) = n_s(t) / min_u n_u(t)             relative to the least-changed stage, so a load
                                               change that hits every stage (other processes) cancels
    D_s(t) = median of r_s over the last w steps (calibration steps count, r = 1 there)

A spike lasting fewer than ⌈w/2⌉ of the last w steps cannot move the median.

**Hysteresis.** With threshold θ and release level θ_r = 1 + (θ − 1)/2,

    streak_s ← streak_s + 1   if D_s(t) > θ
    streak_s ← 0              if D_s(t) < θ_r           (unchanged in between)

and stage s has drifted when ``streak_s ≥ patience``. A step whose raw r_s exceeds θ while
D_s does not is logged as an ``"outlier"`` and otherwise ignored. A slowdown by k > θ that
starts at step t₀ and stays is acted on at the end of step t₀ + ⌈w/2⌉ + patience − 2 (noise
permitting). After any re-plan decision the Replanner calibrates again (w steps), after a
switch only once the new step has compiled (its first step): that is the cool-down.

**Re-profile what drifted.** Slowness belongs to devices: each has a speed factor f_d (1 at
the start), and the devices of every drifted stage are updated with what was measured,

    f_d ← f_d · D_s(t)

which the planner sees as a cluster where those devices form a device type of their own
and a cost model that prices it as the original type with compute × f (``_slowed``). The
stage times measured in the run are the profile: nothing is re-run alone.

**Re-plan and switch.** ``orchestrator.planner.replan(current plan, slowed model)`` proposes
a plan (warm-started from the current one, time-limited). With T(P) the simulated step time
of plan P priced under the slowed model (both plans priced the same way), m̃ the median
measured step time of the last w steps, and H = ``horizon_steps``,

    gain = H · m̃ · (1 − T(new) / T(current))   seconds saved over the next H steps
    cost = C + B / β                             C: the current plan's measured compile time
                                                 (its first step minus a steady one), B: bytes
                                                 of parameters and optimizer state whose stage
                                                 devices change, β: the host link bandwidth

and the run switches (``OrchestratedTrainState.switch``: reshard, recompile) iff the plan
differs and gain > cost. Every decision is a :class:`Decision` in ``decisions`` and a log
line on the ``orchestrator.replanner`` logger, with its numbers.

A single-stage plan has nothing to compare its stage with: the Replanner then only times steps.
When something else switches the run's plan (another callback), the Replanner adopts it and
calibrates again.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections import deque
from collections.abc import Mapping
from typing import Literal

import jax

from integrations.callbacks._base import Callback
from integrations.callbacks._clock import StageClock
from integrations.callbacks._slowed import SlowedCosts, busy_s, moved_bytes, price, slowed_cluster, step_s, translate
from orchestrator.planner import replan

log = logging.getLogger("orchestrator.replanner")

Clock = Literal["auto", "cpu", "wall"]
Action = Literal["calibrate", "outlier", "suspect", "drift", "switch", "keep", "switched", "adopt"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """One decision of the :class:`Replanner`, with the numbers it was made on.

    Attributes:
      step: the step after which it was made.
      action: ``"calibrate"`` (baseline set), ``"outlier"`` (a raw ratio above θ, the median not),
        ``"suspect"`` (a smoothed ratio above θ, fewer than ``patience`` steps so far),
        ``"drift"`` (a stage drifted: re-plan), ``"switch"`` / ``"keep"`` (the re-plan's verdict),
        ``"switched"`` (the new plan compiled and calibrated: what the switch really cost),
        ``"adopt"`` (the plan was switched by someone else).
      message: the log line.
      drift: per stage, the smoothed ratio D_s (``outlier``: the raw r_s).
      stage_layers: per stage of the plan running when it was made, its layers.
      new_stage_layers: ``switch``/``keep``: the proposed plan's stages' layers.
      factors: device id → speed factor after the decision (``drift``).
      measured_step_s: median measured step time of the last w steps.
      predicted_current_s, predicted_new_s: T(current), T(new) under the slowed cost model.
      gain_s, cost_s: the switch rule's two sides; ``switched``: cost_s is the measured cost.
      replan_s: seconds the re-plan took.
    """

    step: int
    action: Action
    message: str
    drift: tuple[float, ...] = ()
    stage_layers: tuple[tuple[int, ...], ...] = ()
    new_stage_layers: tuple[tuple[int, ...], ...] = ()
    factors: Mapping[int, float] = dataclasses.field(default_factory=dict)
    measured_step_s: float | None = None
    predicted_current_s: float | None = None
    predicted_new_s: float | None = None
    gain_s: float | None = None
    cost_s: float | None = None
    replan_s: float | None = None


def _layers(plan) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(s.layers) for s in plan.stages)


def _shape(plan) -> tuple:
    """What executing ``plan`` depends on (not its predicted times)."""
    stages = tuple((s.layers, s.devices, s.tp, s.dp, s.recompute) for s in plan.stages)
    return stages, plan.microbatches, plan.schedule


# -- the callback ----------------------------------------------------------------------------------


class Replanner(Callback):
    """Moves layers off stages that became slow, when the predicted gain beats the switch cost.

    See the module docstring for the smoothing, hysteresis and switch rule.

    Args:
      run: the :class:`~integrations.flax.OrchestratedTrainState` to watch and switch.
      window: w, steps in the running medians (and in each calibration).
      threshold: θ, the smoothed relative drift that counts towards a re-plan.
      patience: consecutive steps above θ before re-planning.
      horizon_steps: H, the steps a switch has to pay for itself in.
      time_limit_s: for each re-plan.
      max_stages: passed to the planner.
      clock: ``"cpu"``, ``"wall"`` or ``"auto"`` (module docstring).

    Attributes:
      decisions: every :class:`Decision`, in order.
      step_times_s, step_cpu_s: step → measured wall time, CPU time of this process.
      stage_times_s: step → per-stage busy seconds on the clock.
      factors: device id → speed factor currently assumed.

    Example:
      >>> run = orchestrate(state, train_step, "local", batch=batch)  # doctest: +SKIP
      >>> replanner = Replanner(run, horizon_steps=1000)  # doctest: +SKIP
      >>> run.callbacks.callbacks.append(replanner)  # doctest: +SKIP
    """

    def __init__(
        self,
        run,
        *,
        window: int = 5,
        threshold: float = 1.3,
        patience: int = 3,
        horizon_steps: int = 1000,
        time_limit_s: float = 2.0,
        max_stages: int | None = None,
        clock: Clock = "auto",
    ):
        if window < 1 or patience < 1 or threshold <= 1:
            raise ValueError(f"need window ≥ 1, patience ≥ 1, threshold > 1; got {window}, {patience}, {threshold}")
        if clock not in ("auto", "cpu", "wall"):
            raise ValueError(f"clock must be 'auto', 'cpu' or 'wall', got {clock!r}")
        if clock == "auto":
            clock = "cpu" if jax.devices()[0].platform == "cpu" else "wall"
        self.clock = clock
        self.run, self.window, self.threshold, self.patience = run, window, threshold, patience
        self.release = 1 + (threshold - 1) / 2
        self.horizon_steps, self.time_limit_s, self.max_stages = horizon_steps, time_limit_s, max_stages
        self.decisions: list[Decision] = []
        self.step_times_s: dict[int, float] = {}
        self.step_cpu_s: dict[int, float] = {}
        self.stage_times_s: dict[int, list[float]] = {}
        self.factors: dict[int, float] = {}
        self._base_cluster, self._base_model = run.cluster, run.cost_model
        self._device_ids = [d.id for d in jax.devices()]
        self._refs = [d.ref for d in run.cluster.all_devices()]  # the running plan's ref namespace
        self._model, self._running = run.cost_model, run.plan
        self._clock = StageClock()
        run.pipeline_options["observers"] = [*run.pipeline_options.get("observers", ()), self._clock]
        if hasattr(run.step_fn, "observers"):  # a pipeline already built
            run.step_fn.observers.append(self._clock)
        self._compile_s = 0.0
        self._switch_reshard_s: float | None = None
        self._start = self._start_cpu = 0.0
        self._reset(compiling=True)

    # -- bookkeeping ------------------------------------------------------------------------------
    def _reset(self, *, compiling: bool) -> None:
        """Start a new calibration (after the step compiles, when ``compiling``)."""
        self._compiling = compiling
        self._first_s: float | None = None
        self._calibration: list[list[float]] = []
        self._baseline: list[float] | None = None
        self._ratios: deque[list[float]] = deque(maxlen=self.window)
        self._steps: deque[float] = deque(maxlen=self.window)
        self._streak = [0] * len(self.run.plan.stages)
        self._predicted = busy_s(price(self._plan_view(), self._model))

    def _plan_view(self):
        """The running plan as the current cost model names its devices."""
        refs = [d.ref for d in self._model.cluster.all_devices()]
        return translate(self.run.plan, self._model.cluster, self._refs, refs)

    def _decide(self, step: int, action: Action, message: str, *, drift=(), stage_layers=None, **numbers) -> Decision:
        """Record and log a :class:`Decision` (``stage_layers``: the running plan's, unless given)."""
        stage_layers = _layers(self.run.plan) if stage_layers is None else stage_layers
        decision = Decision(
            step=step, action=action, message=message, drift=tuple(drift), stage_layers=stage_layers, **numbers
        )
        self.decisions.append(decision)
        log.info(decision.message)
        return decision

    # -- hooks --------------------------------------------------------------------------------------
    def on_step_begin(self, step: int) -> None:
        if self.run.plan is not self._running:
            self._refs = [d.ref for d in self.run.cluster.all_devices()]
            self._model, self._running = self.run.cost_model, self.run.plan
            self._reset(compiling=True)
            self._decide(
                step, "adopt", f"step {step}: the run switched to stages {_layers(self.run.plan)}; calibrating again"
            )
        self._start, self._start_cpu = time.perf_counter(), time.process_time()

    def on_step_end(self, step: int, metrics: Mapping, *, state=None) -> None:
        jax.block_until_ready(metrics)
        self.step_times_s[step] = time.perf_counter() - self._start
        self.step_cpu_s[step] = time.process_time() - self._start_cpu
        elapsed = self.step_cpu_s[step] if self.clock == "cpu" else self.step_times_s[step]
        busy = list((self._clock.cpu_s if self.clock == "cpu" else self._clock.busy_s) or [elapsed])
        self._clock.clear()  # a single-stage step dispatches nothing it observes: [elapsed] then
        self.stage_times_s[step] = busy
        if self._compiling:  # the step that compiled: its excess over a steady step is the compile time
            self._compiling, self._first_s = False, elapsed
            return
        self._steps.append(elapsed)
        x = [b / p if p > 0 else 0.0 for b, p in zip(busy, self._predicted)]
        if self._baseline is None:
            self._calibrate(step, x)
            return
        n = [xi / bi if bi > 0 else 1.0 for xi, bi in zip(x, self._baseline)]
        floor = min(n)
        r = [ni / floor if floor > 0 else 1.0 for ni in n]
        self._ratios.append(r)
        drift = [statistics.median(rs[s] for rs in self._ratios) for s in range(len(r))]
        for s, d in enumerate(drift):
            if d > self.threshold:
                self._streak[s] += 1
            elif d < self.release:
                self._streak[s] = 0
        log.debug("step %d: busy %s s, ratios %s, smoothed %s", step, _fmt(busy), _fmt(r), _fmt(drift))
        drifted = [s for s in range(len(drift)) if self._streak[s] >= self.patience]
        if drifted:
            self._replan(step, drift, drifted)
        elif any(self._streak):
            self._decide(
                step,
                "suspect",
                f"step {step}: smoothed stage ratios {_fmt(drift)}, above {self.threshold:g} for "
                f"{max(self._streak)} of {self.patience} steps",
                drift=drift,
            )
        elif max(r) > self.threshold:
            self._decide(
                step,
                "outlier",
                f"step {step}: stage ratios {_fmt(r)} exceed {self.threshold:g} this step; smoothed {_fmt(drift)}: ignored",
                drift=r,
            )

    def _calibrate(self, step: int, x: list[float]) -> None:
        self._calibration.append(x)
        if len(self._calibration) < self.window:
            return
        self._baseline = [statistics.median(c[s] for c in self._calibration) for s in range(len(x))]
        self._ratios.extend([[1.0] * len(x)] * self.window)
        steady = statistics.median(self._steps)
        if self._first_s is not None:
            self._compile_s = max(0.0, self._first_s - steady)
        message = (
            f"step {step}: calibrated {len(x)} stage(s) over {self.window} steps: measured/predicted "
            f"{_fmt(self._baseline)}, steady step {steady * 1e3:.1f} ms, compile {self._compile_s:.2f} s ({self.clock})"
        )
        cost = None
        if self._switch_reshard_s is not None:
            cost = self._switch_reshard_s + self._compile_s
            message += f"; the switch cost {cost:.2f} s (reshard {self._switch_reshard_s:.3f} s + compile)"
            self._switch_reshard_s = None
        action = "switched" if cost is not None else "calibrate"
        self._decide(step, action, message, drift=self._baseline, measured_step_s=steady, cost_s=cost)

    def _replan(self, step: int, drift: list[float], drifted: list[int]) -> None:
        running = self.run.plan
        device_ids = {ref: i for i, ref in enumerate(self._refs)}
        for s in drifted:
            for ref in running.stages[s].devices:
                i = device_ids[ref]
                self.factors[i] = self.factors.get(i, 1.0) * drift[s]
        cluster, refs, slowed = slowed_cluster(self._base_cluster, self.factors)
        model = SlowedCosts(self._base_model, cluster, slowed)
        current = translate(running, cluster, self._refs, refs)
        self._decide(
            step,
            "drift",
            f"step {step}: stage(s) {drifted} drifted (smoothed {_fmt(drift)} > {self.threshold:g} "
            f"for {self.patience} steps): device speed factors now "
            f"{ {self._device_ids[i]: round(f, 2) for i, f in sorted(self.factors.items())} }; re-planning",
            drift=drift,
            stage_layers=_layers(running),
            factors={self._device_ids[i]: f for i, f in self.factors.items()},
        )
        started = time.perf_counter()
        proposed = replan(
            current,
            model,
            time_limit_s=self.time_limit_s,
            max_stages=self.max_stages,
            horizon_steps=self.horizon_steps,
            mixed_stages=False,  # the executor runs one device type per stage
        )
        replan_s = time.perf_counter() - started
        t_current, t_new = step_s(price(current, model), model), step_s(price(proposed, model), model)
        measured = statistics.median(self._steps)
        gain = self.horizon_steps * measured * (1 - t_new / t_current)
        link = cluster.hosts[0].intra_link
        reshard = moved_bytes(current, proposed, model) / link.bandwidth_bytes_per_s
        cost = self._compile_s + reshard
        same = _shape(proposed) == _shape(current)
        switch = not same and gain > cost
        numbers = (
            f"predicted step {t_current * 1e3:.1f} → {t_new * 1e3:.1f} ms under the slowed model, measured "
            f"{measured * 1e3:.1f} ms ({self.clock}): gain over {self.horizon_steps} steps {gain:.2f} s vs switch cost "
            f"{cost:.2f} s (compile {self._compile_s:.2f} s + reshard {reshard:.3f} s); re-plan {replan_s:.2f} s"
        )
        if proposed.notes and proposed.notes[0].startswith("re-planned"):  # what the re-plan did (``replan``)
            numbers += f" ({proposed.notes[0].split(': ', 1)[-1].rsplit('; ', 1)[0]})"
        verdict = (
            "same plan"
            if same
            else f"layers {_layers(current)} → {_layers(proposed)}" + ("" if switch else " rejected")
        )
        self._decide(
            step,
            "switch" if switch else "keep",
            f"step {step}: {'switch' if switch else 'keep'}: {verdict}; {numbers}",
            drift=drift,
            stage_layers=_layers(current),
            new_stage_layers=_layers(proposed),
            factors={self._device_ids[i]: f for i, f in self.factors.items()},
            measured_step_s=measured,
            predicted_current_s=t_current,
            predicted_new_s=t_new,
            gain_s=gain,
            cost_s=cost,
            replan_s=replan_s,
        )
        self._model = model
        if switch:
            self._switch_reshard_s = self.run.switch(proposed, cluster=cluster, cost_model=model)
            self._refs, self._running = refs, self.run.plan
        self._reset(compiling=switch)


def _fmt(values) -> str:
    return "[" + ", ".join(f"{v:.2f}" for v in values) + "]"
