"""``orchestrator bench executor``: parity, communication and timing of executed plans against predictions.

Three families of cases, each a :class:`~orchestrator.bench._case.Case`-like dict (``name``, ``ok``, figures):

* **parity** — tiny GPT and tiny Mamba, 5 steps under every check plan
  (:data:`~integrations.flax._parity.PLAN_NAMES`): loss within 1e-5 relative and
  parameters within 1e-4 of single-device training;
* **communication** — per plan, the all-reduce bytes (and every other
  collective kind) in the compiled programs vs the cost model (tolerance 1%);
* **timing** — every stage's forward + backward of one microbatch run alone
  vs its prediction (15%): the cost model's device time, slowed as below, plus
  the host's two dispatches and the buffers the two calls move (d and b below);
  and measured vs simulated step time over several tiny-GPT plans with
  Kendall's τ between them (target ≥ 0.8).

Predictions use the cost model with this machine's profiled layer times. The
cost model prices one device running alone; on the ``local`` cluster n
virtual devices share c cores, so here a stage whose k = tp·dp devices run at
once is slowed by max(1, k / c), and the simulated step is

    max( pipeline replay of the plan's schedule with those stage times,
         Σ_stages k_s · (M · (F_s + B_s) + U_s) / c )

the second term being the whole step's device-seconds spread over c cores
(F, B: forward and backward with TP all-reduces per microbatch, U: optimizer
update and gradient sync, all at single-device speed). The host dispatches
every program and transfer from one Python thread, on the same cores: with
D dispatches per step (counted on the executor: 3 for a single-stage step,
dozens for a pipeline) costing d each (measured: a tiny jitted call) and N
device buffers they take and return (one per shard, counted on the executor)
costing b each (measured: a call over 64 arrays against one over 1,
1.0–1.5 µs a buffer),

    host = D·d + N·b
    step = max( replay,  host,  (Σ_s k_s · (M · (F_s + B_s) + U_s) + host) / c )

Measured in session 6: gpt-tiny's pipelines are host-bound — the host takes
59 ms (2 stages) and 38 ms (4 stages) to issue a step that completes in 60 and
43 ms — and the model's host term accounts for about 18 ms of the 59: the rest
is the executor's own Python work per call, which it does not price. Session 7
moved stage-to-stage transfers off the host (``_transfer``): 44 and 41 ms.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax

from integrations.flax._parity import PLAN_NAMES, check_plan, parity

RANK_PLANS = ("DP1", "DP2", "DP8", "TP2", "DP4xTP2", "DP2xTP4", "2 stages (3+1) x 4 mb", "4 stages TP 1/2/4/1")


@dataclasses.dataclass(slots=True)
class Setup:
    recipe: object
    graph: object
    layers: object
    model: object
    device_type: str
    cores: int
    state: object
    batch: dict
    axes: dict


def setup(recipe_name: str, global_batch: int, seq_len: int) -> Setup:
    """Capture, coarsen, profile and cost ``recipe_name`` at (global_batch, seq_len) on the local cluster."""
    from integrations.flax._capture import capture
    from integrations.flax._profile import profile_layers
    from orchestrator.cluster import load_cluster
    from orchestrator.coarsen import coarsen
    from orchestrator.costs import CostModel
    from recipes import get_recipe, synthetic_batch

    recipe = get_recipe(recipe_name)
    abstract, spec = recipe.abstract_state(), recipe.batch_spec(global_batch, seq_len)
    graph = capture(recipe.train_step, abstract, spec)
    layers = coarsen(graph)
    timings = profile_layers(recipe.train_step, abstract, spec, graph=graph, layers=layers)
    cluster = load_cluster("local")
    [device_type] = cluster.device_types
    axes = recipe.param_axes() if recipe.family == "gpt" else {}
    model = CostModel(graph, layers, cluster, batch_size=global_batch, param_axes=axes or None, measured=timings)
    state = jax.jit(recipe.create_state)(jax.random.key(0))
    batch = synthetic_batch(jax.random.key(1), global_batch, seq_len, recipe.config.vocab_size)
    return Setup(recipe, graph, layers, model, device_type, cluster.shared_cores or 1, state, batch, axes)


def _stage_costs(plan, su: Setup):
    """Per stage: (forward s, backward s, update s, send s) per device at single-device speed, from the cost model."""
    from orchestrator.costs import ParallelConfig

    link = su.model.default_link(su.device_type)
    out = []
    for s, stage in enumerate(plan.stages):
        tp = stage.tp if su.model.tensor_parallel else 1  # no axis names: TP shards nothing
        config = ParallelConfig(
            tp=tp, dp=stage.dp, microbatch_size=stage.microbatch_size, accumulate_gradients=len(plan.stages) > 1
        )
        fwd = bwd = upd = 0.0
        for index in stage.layers:
            cost = su.model.layer_cost(index, su.device_type, config)
            share = cost.tp_comm_s / 2
            fwd += cost.forward_s + share
            bwd += cost.backward_s + share
            upd += cost.optimizer_s + cost.dp_sync_s
        last = su.layers[stage.layers[-1]]
        send = (
            0.0
            if s + 1 == len(plan.stages)
            else link.time_s(last.activation_bytes * stage.microbatch_size / plan.global_batch * stage.dp)
        )
        out.append((fwd, bwd, upd, send))
    return out


def predicted_stage_seconds(
    plan, su: Setup, *, buffers: list[int] | None = None, buffer_s: float = 0.0, dispatch_s: float = 0.0
) -> list[float]:
    """Per stage: predicted forward + backward of one microbatch, run alone, with its k devices sharing
    the cores, plus the host's part: two dispatches and ``buffers[s]`` device buffers taken and returned."""
    return [
        (f + b) * max(1.0, len(stage.devices) / su.cores) + 2 * dispatch_s + (buffers[s] if buffers else 0) * buffer_s
        for s, (stage, (f, b, _, _)) in enumerate(zip(plan.stages, _stage_costs(plan, su)))
    ]


def dispatch_overhead_s(repeats: int = 50) -> float:
    """Median host time of dispatching one small jitted program and one small transfer (half each)."""
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    sharding = NamedSharding(mesh, P("data"))
    fn = jax.jit(lambda x: x + 1)
    x = jax.device_put(np.zeros((2, 8), np.float32), sharding)
    jax.block_until_ready(fn(x))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        y = fn(jax.device_put(np.zeros((2, 8), np.float32), sharding))
        times.append((time.perf_counter() - start) / 2)
        jax.block_until_ready(y)
    return statistics.median(times)


def buffer_overhead_s(repeats: int = 30) -> float:
    """Host seconds per device buffer a call takes or returns: one jitted call over 64 arrays
    against one over a single array, each sharded over 2 devices (measured on this CPU: 1.0–1.5 µs
    per buffer)."""
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from orchestrator.profile import median_seconds

    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    sharding = NamedSharding(mesh, P())
    fn = jax.jit(lambda *xs: [x + 1 for x in xs])

    def seconds(n: int) -> float:
        xs = [jax.device_put(np.zeros((8, 8), np.float32), sharding) for _ in range(n)]
        return median_seconds(fn, *xs, repeats=repeats)

    return max(0.0, (seconds(64) - seconds(1)) / (63 * 2 * 2))  # 63 more arrays, in and out, 2 shards each


def simulated_step_s(
    plan, su: Setup, *, dispatches: int = 3, dispatch_s: float = 0.0, buffers: int = 0, buffer_s: float = 0.0
) -> float:
    """Predicted step time on the shared-core host (see module docstring)."""
    from integrations.callbacks._report import schedule_trace

    costs = _stage_costs(plan, su)
    timed = []
    busy = 0.0
    for stage, (f, b, u, send) in zip(plan.stages, costs):
        slow = max(1.0, len(stage.devices) / su.cores)
        timed.append(
            dataclasses.replace(
                stage,
                forward_s=f * slow,
                time_s=(f + b) * slow + 2 * send,
                send_s=send,
                optimizer_s=u * slow,
                dp_sync_s=0.0,
            )
        )
        busy += len(stage.devices) * (plan.microbatches * (f + b) + u)
    replay = schedule_trace(dataclasses.replace(plan, stages=tuple(timed)))
    makespan = max(e["ts"] + e["dur"] for e in replay["traceEvents"] if e["ph"] == "X") / 1e6
    host = dispatches * dispatch_s + buffers * buffer_s
    return max(makespan, host, (busy + host) / su.cores)


def measured_step_s(plans, su: Setup, *, rounds: int = 9, warmup: int = 2) -> list[tuple[float, int, int]]:
    """Per plan: (median wall time of a training step, host dispatches and device buffers per step).

    The plans take turns, one step each per round, so that load from other
    processes on the machine falls on all of them alike.
    """
    from integrations.flax._pipeline import Pipeline, shard_count
    from integrations.flax._shard import shard
    from integrations.flax._step import compile_step

    runs = []
    for plan in plans:
        layers = su.layers if len(plan.stages) > 1 else None
        placed = shard(plan, su.state, param_axes=su.axes, layers=layers)
        runs.append([compile_step(plan, su.recipe.train_step, placed, param_axes=su.axes, layers=layers), placed])
    times: list[list[float]] = [[] for _ in plans]
    buffers = [0] * len(plans)
    for r in range(warmup + rounds + 1):
        for i, run in enumerate(runs):
            counting = r == warmup + rounds  # one last, untimed step counts the buffers
            pipeline = isinstance(run[0], Pipeline)
            if counting:
                if pipeline:
                    run[0].count_buffers = True
                inputs = shard_count((run[1], su.batch))
            start = time.perf_counter()
            run[1], metrics = run[0](run[1], su.batch)
            jax.block_until_ready((run[1], metrics))
            if warmup <= r < warmup + rounds:
                times[i].append(time.perf_counter() - start)
            if counting and pipeline:
                buffers[i], run[0].count_buffers = run[0].buffers, False
            elif counting:  # one jitted call: the state and batch in, the state and metrics out
                buffers[i] = inputs + shard_count((run[1], metrics))
    return [
        (statistics.median(t), run[0].dispatches if isinstance(run[0], Pipeline) else 1 + len(su.batch), b)
        for t, run, b in zip(times, runs, buffers)
    ]


def measured_stage_seconds(plan, su: Setup, *, repeats: int = 7) -> tuple[list[float], list[int]]:
    """Per stage: measured forward + backward of one microbatch, run alone, and the device buffers its
    two calls take and return."""
    from integrations.flax._pipeline import Pipeline
    from integrations.flax._shard import shard

    placed = shard(plan, su.state, param_axes=su.axes, layers=su.layers)
    pipeline = Pipeline(plan, su.recipe.train_step, placed, layers=su.layers, param_axes=su.axes)
    return pipeline.stage_seconds(placed, su.batch, repeats=repeats), pipeline.stage_buffers


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
    from integrations.flax._communication import KINDS, measured_collectives, predicted_collectives
    from integrations.flax._shard import shard
    from integrations.flax._step import compile_step

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
                err = (m[kind] - p[kind]) / p[kind] if p[kind] else (0.0 if not m[kind] else float("inf"))
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


def timing_cases(su: Setup, progress=None, *, plans=PLAN_NAMES) -> list[dict]:
    name = su.recipe.name
    cases = []
    dispatch_s, buffer_s = dispatch_overhead_s(), buffer_overhead_s()
    for plan_name in plans:
        if progress:
            progress(f"stage times {name} {plan_name}")
        plan = check_plan(plan_name, global_batch=su.batch["inputs"].shape[0])
        measured, buffers = measured_stage_seconds(plan, su)
        predicted = predicted_stage_seconds(plan, su, buffers=buffers, buffer_s=buffer_s, dispatch_s=dispatch_s)
        for s, (m, p) in enumerate(zip(measured, predicted)):
            err = m / p - 1
            cases.append(
                _case(
                    f"{name} {plan_name} stage {s}",
                    "forward+backward s (alone)",
                    abs(err) <= 0.15,
                    predicted=p,
                    measured=m,
                    rel_err=err,
                )
            )
    return cases


def ranking_case(su: Setup, progress=None, *, plans=RANK_PLANS) -> tuple[dict, list[dict]]:
    if progress:
        progress(f"step times {su.recipe.name}, {len(plans)} plans")
    built = [check_plan(name, global_batch=su.batch["inputs"].shape[0]) for name in plans]
    measured = measured_step_s(built, su)
    dispatch_s, buffer_s = dispatch_overhead_s(), buffer_overhead_s()
    rows = [
        {
            "plan": name,
            "measured_s": seconds,
            "simulated_s": simulated_step_s(
                plan, su, dispatches=dispatches, dispatch_s=dispatch_s, buffers=buffers, buffer_s=buffer_s
            ),
            "dispatches": dispatches,
            "buffers": buffers,
        }
        for name, plan, (seconds, dispatches, buffers) in zip(plans, built, measured)
    ]
    tau = kendall_tau([r["measured_s"] for r in rows], [r["simulated_s"] for r in rows])
    case = _case(f"{su.recipe.name} {len(rows)} plans", "Kendall tau measured vs simulated", tau >= 0.8, tau=tau)
    return case, rows


def run(progress=None, *, quick: bool = False) -> dict:
    """Every case; ``quick`` skips Mamba parity and the timing cases (for tests)."""
    cases = parity_cases(progress, recipes=("gpt-tiny",) if quick else ("gpt-tiny", "mamba-tiny"))
    gpt = setup("gpt-tiny", 16, 16)
    cases += communication_cases(gpt, progress)
    rows = []
    if not quick:
        cases += communication_cases(setup("mamba-tiny", 16, 16), progress)
        timed = setup("gpt-tiny", 16, 64)
        cases += timing_cases(timed, progress)
        case, rows = ranking_case(timed, progress)
        cases.append(case)
    return {"cases": cases, "ranking": rows}
