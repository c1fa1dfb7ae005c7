"""``orchestrator bench executor``: parity, communication and timing of executed plans against predictions.

Three families of cases, each a dict with ``name``, ``metric``, ``ok`` and its figures:

* **parity** — tiny GPT and tiny Mamba, 5 steps under every check plan
  (:data:`~._parity.PLAN_NAMES`): loss within 1e-5 relative and parameters within 1e-4 of
  single-device training;
* **communication** — per plan, the all-reduce bytes (and every other collective kind) in the
  compiled programs vs the cost model (tolerance 1%);
* **timing** — every stage's forward + backward of one microbatch run alone vs its prediction
  (:mod:`._model`, 15%); and measured vs simulated step time over several tiny-GPT plans with
  Kendall's τ between them (target ≥ 0.8). The timing comes with two controls that use no model
  (:mod:`._controls`): each stage warm against cold, and its layers run as one-layer stages on
  its devices, summed, against it.

Relative errors are ``predicted / measured − 1`` (:func:`~orchestrator.bench._case.rel_err`),
as in every bench. Predictions use the cost model with this machine's layer times, profiled
afresh at the batch and at every per-device microbatch the check plans run (:mod:`._setup`).

A machine whose cores are shared drifts: the same measurement moves by tens of percent from one
minute to the next. So each stage comparison interleaves its measurements: every sample runs the
layers' profiled pieces, the s(k) workload and the stages once each (:func:`timing_cases`), and
prediction and measurement come from the same samples. The ranking calibrates afresh
(:func:`~._setup.recalibrated`) 3 times over its 12 rounds and simulates each plan with the
median. It also reports the measurement's own repeatability: Kendall's τ between the medians of
the even and the odd rounds (the plans take turns, so both halves see the same machine). No model
ranks the plans better than that.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import Counter
from collections.abc import Callable

import jax

from orchestrator.bench._case import rel_err
from orchestrator.bench.executor._alone import StageTimer
from orchestrator.bench.executor._communication import KINDS, measured_collectives, predicted_collectives
from orchestrator.bench.executor._controls import control_cases
from orchestrator.bench.executor._host import SlowdownRun
from orchestrator.bench.executor._model import predicted_stage_seconds, simulated_step_s
from orchestrator.bench.executor._observers import DispatchCounter, shard_count
from orchestrator.bench.executor._parity import PLAN_NAMES, check_plan, parity
from orchestrator.bench.executor._setup import (
    Setup,
    _gradients,
    _layer_profiler,
    _piece_host,
    _remodelled,
    recalibrated,
    setup,
)

RANK_PLANS = ("DP1", "DP2", "DP8", "TP2", "DP4xTP2", "DP2xTP4", "2 stages (3+1) x 4 mb", "4 stages TP 1/2/4/1")


def measured_step_s(
    plans, su: Setup, *, rounds: int = 10, warmup: int = 2, between: Callable[[], None] | None = None, every: int = 0
) -> list[tuple[list[float], Counter[int], int]]:
    """Per plan: (wall time of a training step in each round, host dispatches by device count and
    device buffers per step).

    The plans take turns, one step each per round, so that load from other
    processes on the machine falls on all of them alike. ``between()`` is called before every
    ``every``-th timed round (the first included). One last, untimed step counts the dispatches
    and buffers (a pipeline's with a :class:`~._observers.DispatchCounter`).
    """
    from integrations.flax import compile_step, shard

    runs = []
    for plan in plans:
        layers = su.layers if len(plan.stages) > 1 else None
        placed = shard(plan, su.state, param_axes=su.axes, layers=layers)
        runs.append([compile_step(plan, su.recipe.train_step, placed, param_axes=su.axes, layers=layers), placed])
    times: list[list[float]] = [[] for _ in plans]
    for r in range(warmup + rounds):
        if between and every and r >= warmup and (r - warmup) % every == 0:
            between()
        for i, run in enumerate(runs):
            start = time.perf_counter()
            run[1], metrics = run[0](run[1], su.batch)
            jax.block_until_ready((run[1], metrics))
            if r >= warmup:
                times[i].append(time.perf_counter() - start)
    return [(t, *_counted_step(run, plan, su)) for t, run, plan in zip(times, runs, plans)]


def _counted_step(run: list, plan, su: Setup) -> tuple[Counter[int], int]:
    """One more step of ``run`` (step, state): its host dispatches by device count and the device
    buffers it moves. A pipeline's are observed; one jitted call makes the call and one transfer
    per batch leaf, all to the plan's devices, and moves the state and batch in, the state and
    metrics out."""
    from integrations.flax import Pipeline

    step = run[0]
    if not isinstance(step, Pipeline):
        inputs = shard_count((run[1], su.batch))
        run[1], metrics = step(run[1], su.batch)
        jax.block_until_ready((run[1], metrics))
        sizes = Counter({len(plan.stages[0].devices): 1 + len(jax.tree.leaves(su.batch))})
        return sizes, inputs + shard_count((run[1], metrics))
    counter = DispatchCounter()
    step.observers.append(counter)
    try:
        run[1], metrics = step(run[1], su.batch)
        jax.block_until_ready((run[1], metrics))
    finally:
        step.observers.remove(counter)
    return Counter(counter.sizes), counter.buffers


def kendall_tau(a, b) -> float:
    """Kendall's τ-b between two sequences."""
    from scipy.stats import kendalltau

    return float(kendalltau(a, b).statistic)


def _case(name: str, metric: str, ok: bool, **figures) -> dict:
    return {"name": name, "metric": metric, "ok": bool(ok), **figures}


def parity_cases(progress: Callable[[str], None] | None = None, *, recipes=("gpt-tiny", "mamba-tiny")) -> list[dict]:
    cases = []
    for recipe in recipes:
        for plan_name in PLAN_NAMES:
            if progress:
                progress(f"parity {recipe} {plan_name}")
            r = parity(recipe, check_plan(plan_name, global_batch=16), steps=5)
            cases.append(
                _case(
                    f"{recipe} {plan_name}",
                    "parity",
                    r.loss_rel_err < 1e-5 and r.param_abs_err < 1e-4,
                    loss_rel_err=r.loss_rel_err,
                    param_abs_err=r.param_abs_err,
                    final_loss=r.losses[-1],
                )
            )
    return cases


def communication_cases(su: Setup, progress=None) -> list[dict]:
    from integrations.flax import compile_step, shard

    name = su.recipe.name
    cases = []
    for plan_name in PLAN_NAMES:
        if progress:
            progress(f"collectives {name} {plan_name}")
        plan = check_plan(plan_name, global_batch=su.batch["inputs"].shape[0])
        layers = su.layers if len(plan.stages) > 1 else None
        placed = shard(plan, su.state, param_axes=su.axes, layers=layers)
        step = compile_step(plan, su.recipe.train_step, placed, param_axes=su.axes, layers=layers)
        measured, _ = measured_collectives(step, placed, su.batch)
        predicted = predicted_collectives(plan, su.model, su.device_type)
        for s, (m, p) in enumerate(zip(measured, predicted)):
            for kind in KINDS:
                if kind != "all-reduce" and not m[kind] and not p[kind]:
                    continue
                err = rel_err(p[kind], m[kind])
                cases.append(
                    _case(
                        f"{name} {plan_name} stage {s}",
                        f"{kind} bytes",
                        abs(err) <= 0.01,
                        predicted=p[kind],
                        measured=m[kind],
                        rel_err=err,
                    )
                )
    return cases


def timing_cases(su: Setup, progress=None, *, plans=PLAN_NAMES, rounds: int = 8, repeats: int = 7) -> list[dict]:
    """Every stage of ``plans`` timed alone against its prediction.

    The prediction's measurements and the stage's are interleaved: each of ``repeats`` samples
    runs every layer's profiled pieces once (:class:`~integrations.flax._profile.LayerProfiler`),
    the recipe's forward and backward on 1 and on k devices once for the plan's device counts
    (:class:`~._host.SlowdownRun`), then each stage once, each right after that forward and
    backward ran on all the devices (``SlowdownRun.busy``: the state a stage in a pipeline starts
    from, whose wake-up w(k) the prediction adds; what runs just before a stage changes its time).
    A plan's prediction comes from the medians of its own samples, its measurement from the
    stages' medians, so both see the machine in the same state (on shared cores a layer's time
    drifts from round to round while its ratio to the stage that runs it holds). ``rounds``
    rounds take the plans in turn; the medians over the rounds are compared, as
    ``rel_err = predicted / measured − 1`` (:func:`~orchestrator.bench._case.rel_err`). The
    measured times' spread over the rounds is reported, the measurement against itself
    (:func:`self_agreement`): no prediction can be checked to 15% on a stage whose own even and
    odd rounds differ by more; and the slowdown s(k) each round measured for the stage's device
    count (``slowdown_rounds``), which multiplies most of an 8-device stage's prediction."""

    name = su.recipe.name
    batch = su.batch["inputs"].shape[0]
    profiler = _layer_profiler(su)
    built = {plan_name: check_plan(plan_name, global_batch=batch) for plan_name in plans}
    counts = {
        plan_name: sorted({n for stage in plan.stages for n in (len(stage.devices), stage.tp)})
        for plan_name, plan in built.items()
    }
    slow = SlowdownRun(
        _gradients(su),
        su.state.params,
        su.batch,
        # all the devices too, for ``busy()``
        counts=sorted({len(jax.devices())} | {k for c in counts.values() for k in c}),
    )
    runs = {plan_name: StageTimer(plan, su).runs() for plan_name, plan in built.items()}
    profiler.sample(), slow.sample()  # warm-up: compiles
    measured = {plan_name: [[] for _ in plan.stages] for plan_name, plan in built.items()}
    predicted = {plan_name: [[] for _ in plan.stages] for plan_name, plan in built.items()}
    slowdowns = {plan_name: [[] for _ in plan.stages] for plan_name, plan in built.items()}  # s(k) by round
    for r in range(rounds):
        for plan_name, plan in built.items():
            if progress:
                progress(f"stage times {name} {plan_name}, round {r + 1} of {rounds}")
            stage_runs, buffers, forward_buffers = runs[plan_name]
            layer_samples, slow_samples, stage_samples = [], [], []
            for _ in range(repeats):
                layer_samples.append(profiler.sample())
                slow_samples.append(slow.sample(counts[plan_name]))
                stage_samples.append([(slow.busy(), run())[1] for run in stage_runs])
            host = dataclasses.replace(
                su.host,
                slowdown={**su.host.slowdown, **slow.slowdown(slow_samples)},
                boundary_s=profiler.boundary_seconds(layer_samples, host_s=_piece_host(su.host)),
            )
            timings = profiler.timings(layer_samples, host_s=_piece_host(su.host))
            now = dataclasses.replace(su, model=_remodelled(su, timings), host=host)
            prediction = predicted_stage_seconds(plan, now, buffers=buffers, forward_buffers=forward_buffers)
            for s, p in enumerate(prediction):
                measured[plan_name][s].append(statistics.median(sample[s] for sample in stage_samples))
                predicted[plan_name][s].append(p)
                slowdowns[plan_name][s].append(host.slow(len(plan.stages[s].devices)))
    cases = []
    for plan_name, plan in built.items():
        for s in range(len(plan.stages)):
            m, p = statistics.median(measured[plan_name][s]), statistics.median(predicted[plan_name][s])
            err = rel_err(p, m)
            cases.append(
                _case(
                    f"{name} {plan_name} stage {s}",
                    "forward+backward s (alone)",
                    abs(err) <= 0.15,
                    predicted=p,
                    measured=m,
                    rel_err=err,
                    round_errors=[rel_err(pr, mr) for mr, pr in zip(measured[plan_name][s], predicted[plan_name][s])],
                    measured_spread=(max(measured[plan_name][s]) - min(measured[plan_name][s])) / m,
                    repeat_err=self_agreement(measured[plan_name][s]),
                    slowdown_rounds=slowdowns[plan_name][s],
                )
            )
    return cases


def self_agreement(rounds: list[float]) -> float:
    """A measurement against itself: the median of the odd rounds over that of the even rounds, less 1.

    The rounds alternate with the other plans' rounds and with recalibrations, so both halves see
    the machine alike; on a machine whose timings repeat, this is near 0. Example:
    ``self_agreement([10.0, 12.0, 10.0, 12.0])`` is 0.2.
    """
    if len(rounds) < 2:
        raise ValueError(f"self_agreement needs at least 2 rounds, got {len(rounds)}")
    return statistics.median(rounds[1::2]) / statistics.median(rounds[0::2]) - 1


def executor_seconds(recipe_name: str, plan_name: str = "2 stages (3+1) x 4 mb", *, rounds: int = 8) -> float:
    """e: the executor's host seconds per dispatch that d(k) and the buffers leave out (its Python
    work around each call), fitted on one pipeline plan at sequence length 1, where the devices have
    next to nothing to compute: the median measured step less the simulated one, per dispatch."""
    su = setup(recipe_name, 16, 1, host=True)
    plan = check_plan(plan_name, global_batch=16)
    [(seconds, dispatches, buffers)] = measured_step_s([plan], su, rounds=rounds)
    simulated = simulated_step_s(plan, su, dispatches=dispatches, buffers=buffers)
    return max(0.0, (statistics.median(seconds) - simulated) / sum(dispatches.values()))


def ranking_case(
    su: Setup, progress=None, *, plans=RANK_PLANS, rounds: int = 12, calibrations: int = 3
) -> tuple[dict, list[dict]]:
    """Measured against simulated step time of ``plans``, and Kendall's τ between them. The host is
    calibrated (:func:`recalibrated`) ``calibrations`` times, spread over the ``rounds`` timed
    rounds; a plan's simulated time is the median over the calibrations."""
    if progress:
        progress(f"step times {su.recipe.name}, {len(plans)} plans")
    built = [check_plan(name, global_batch=su.batch["inputs"].shape[0]) for name in plans]
    executor_s = executor_seconds(su.recipe.name)
    calibrated: list[Setup] = []
    every = max(1, rounds // calibrations)

    def calibrate() -> None:
        now = recalibrated(su)
        calibrated.append(dataclasses.replace(now, host=dataclasses.replace(now.host, executor_s=executor_s)))

    measured = measured_step_s(built, su, rounds=rounds, between=calibrate, every=every)
    rows = [
        {
            "plan": name,
            "measured_s": statistics.median(seconds),
            "simulated_s": statistics.median(
                simulated_step_s(plan, now, dispatches=dispatches, buffers=buffers) for now in calibrated
            ),
            "dispatches": dict(dispatches),
            "buffers": buffers,
        }
        for name, plan, (seconds, dispatches, buffers) in zip(plans, built, measured)
    ]
    tau = kendall_tau([r["measured_s"] for r in rows], [r["simulated_s"] for r in rows])
    # the measurement against itself: medians of the even rounds against those of the odd rounds
    # (the plans took turns, so both halves saw the same machine); no model can rank better than this
    halves = [[statistics.median(seconds[h::2]) for seconds, _, _ in measured] for h in (0, 1)]
    case = _case(
        f"{su.recipe.name} {len(rows)} plans",
        "Kendall tau measured vs simulated",
        tau >= 0.8,
        tau=tau,
        repeat_tau=kendall_tau(*halves),
        executor_s=executor_s,
    )
    return case, rows


def run(progress=None, *, quick: bool = False) -> dict:
    """Every case, the ranking rows and the stage-timing controls (``_controls``); ``quick`` skips
    Mamba parity, the timing cases and the controls (for tests)."""
    cases = parity_cases(progress, recipes=("gpt-tiny",) if quick else ("gpt-tiny", "mamba-tiny"))
    gpt = setup("gpt-tiny", 16, 16)
    cases += communication_cases(gpt, progress)
    rows, controls = [], []
    if not quick:
        cases += communication_cases(setup("mamba-tiny", 16, 16), progress)
        timed = setup("gpt-tiny", 16, 64, host=True)
        cases += timing_cases(timed, progress)
        controls = control_cases(timed, progress)
        case, rows = ranking_case(timed, progress)
        cases.append(case)
    return {"cases": cases, "ranking": rows, "controls": controls}
