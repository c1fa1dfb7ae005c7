"""Controls for the executor bench's stage timing: what a stage's time is, measured two other ways.

The stage-timing cases (:func:`~._cases.timing_cases`) hold a prediction to 15% of a stage's time run
alone. These controls measure how far that time itself is from two things any per-layer cost
model rests on, with no model in between:

* **warm over cold**: each sample runs every stage twice back to back; the second run's median
  over the first's. The first run follows the recipe's forward and backward on all the devices
  (``SlowdownRun.busy``), as in the timing cases; the second follows itself. A stage for which this
  ratio is far from 1 has no one time "alone" for a prediction to meet: the timing case fixes
  what runs before it, and the prediction adds the wake-up w(k) that costs.
* **layers over stage**: a stage of L layers against the sum of its layers, each run alone as a
  one-layer stage on the same devices with the same tensor- and data-parallel degrees and
  microbatch (the same executor, the same calls), less the host time of the 2(L − 1) extra calls
  (d(k) each, and b per extra buffer they move). A cost model that prices a stage as the sum of its
  layers' costs, each measured under the stage's own configuration, is off by this ratio less 1
  even when every layer's measurement is exact.

Both are medians over rounds that take the plans in turn, 7 samples each by default.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

import jax

from orchestrator.bench.executor._alone import StageTimer
from orchestrator.bench.executor._host import SlowdownRun
from orchestrator.bench.executor._parity import PLAN_NAMES, check_plan
from orchestrator.bench.executor._setup import Setup, _gradients


def one_layer_stages(plan):
    """``plan`` with every stage cut into one stage per layer, each on the stage's devices with its
    degrees and microbatch; also the number of layers of each original stage."""
    stages = tuple(dataclasses.replace(stage, layers=(layer,)) for stage in plan.stages for layer in stage.layers)
    return dataclasses.replace(plan, stages=stages), [len(stage.layers) for stage in plan.stages]


def control_cases(
    su: Setup, progress: Callable[[str], None] | None = None, *, plans=PLAN_NAMES, rounds: int = 4, repeats: int = 7
) -> list[dict]:
    """Per stage of ``plans``: warm over cold and, for a stage of several layers, layers over stage
    (module docstring). ``su`` needs the host's costs (``setup(..., host=True)``)."""
    if su.host is None:
        raise ValueError("control_cases needs the host's costs: build the setup with setup(..., host=True)")
    batch = su.batch["inputs"].shape[0]
    slow = SlowdownRun(_gradients(su), su.state.params, su.batch, counts=(len(jax.devices()),))
    timers = {}
    for name in plans:
        plan = check_plan(name, global_batch=batch)
        split, sizes = one_layer_stages(plan)
        timers[name] = (plan, StageTimer(plan, su).runs(), StageTimer(split, su).runs(), sizes)
    cold: dict = {name: [] for name in plans}
    warm: dict = {name: [] for name in plans}
    layers: dict = {name: [] for name in plans}
    for r in range(rounds):
        for name, (_, (runs, _, _), (split_runs, _, _), _) in timers.items():
            if progress:
                progress(f"stage controls {su.recipe.name} {name}, round {r + 1} of {rounds}")
            samples = []
            for _ in range(repeats):
                first_second = [((slow.busy(), run())[1], run()) for run in runs]
                samples.append((first_second, [run() for run in split_runs]))
            cold[name].append([statistics.median(s[0][i][0] for s in samples) for i in range(len(runs))])
            warm[name].append([statistics.median(s[0][i][1] for s in samples) for i in range(len(runs))])
            layers[name].append([statistics.median(s[1][j] for s in samples) for j in range(len(split_runs))])
    out = []
    for name, (plan, (_, buffers, _), (_, split_buffers, _), sizes) in timers.items():
        first = 0
        for s, (stage, size) in enumerate(zip(plan.stages, sizes)):
            stage_s = statistics.median(rnd[s] for rnd in cold[name])
            row = {
                "name": f"{su.recipe.name} {name} stage {s}",
                "stage_ms": stage_s * 1e3,
                "warm_over_cold": statistics.median(w[s] / c[s] for w, c in zip(warm[name], cold[name])),
            }
            if size > 1:
                extra_calls = 2 * (size - 1) * su.host.dispatch(len(stage.devices))
                extra_buffers = (sum(split_buffers[first : first + size]) - buffers[s]) * su.host.buffer_s
                summed = statistics.median(sum(rnd[first : first + size]) for rnd in layers[name])
                row["layers_over_stage"] = (summed - extra_calls - extra_buffers) / stage_s
            out.append(row)
            first += size
    return out
