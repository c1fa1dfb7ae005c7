"""Baseline planners, scored by the same cost model as the ILP.

Each fixes what the named system fixes and optimises the rest with our cost model, so the
comparison isolates the decision the system gets wrong:

- ``uniform``: S stages of equal layer counts on equal device blocks taken in listed order;
  each stage then gets its fastest fitting (tp, recompute).
- ``alpa``: Alpa's inter-operator pass — a dynamic program splits layers to minimise the
  bottleneck assuming every device is of the first listed type (Alpa profiles one mesh and
  treats devices as identical), on equal submeshes placed in listed order (by size only);
  the intra-operator choice (tp, recompute) is then made per stage on the real devices.
- ``pipedream``: PipeDream's partitioner — balanced split assuming identical devices,
  each stage replicated data-parallel over its block (no tensor parallelism).
- ``greedy``: a list scheduler in the spirit of HEFT: blocks ordered fastest first, layers
  added to the current stage in order while it stays within its speed-proportional share
  of the total work (earliest finish), then the next block opens.
- ``exhaustive``: every split × group × M (tiny instances only) — the ground truth.

Each sweeping baseline is written as what it proposes for S stages at M microbatches on S
equal device blocks in listed order (``@_baseline``); every one, and ``exhaustive``, is then
called alike, ``uniform(model, global_batch=..., ...)`` with the settings of
:class:`~orchestrator.planner.baselines._sweep.Sweep`. All searches range over stage counts
1..max_stages and the planner's microbatch candidates (largest M first); with a ``deadline``
the sweeps stop there and return their best so far.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

from orchestrator.costs import CostModel
from orchestrator.planner._ilp import in_flight
from orchestrator.planner._split import configs_for, equal_split, fastest_times, min_bottleneck_split, stage_costs
from orchestrator.planner.baselines._exhaustive import exhaustive_plan
from orchestrator.planner.baselines._sweep import BaselinePlan, Blocks, Proposal, Sweep


def _baseline(propose: Callable[[Sweep, int, int, Blocks], Iterator[Proposal]]):
    """A baseline from what it proposes for S stages at M on equal blocks: the best over its sweep,
    called as ``baseline(model, **settings)`` with the settings of :class:`Sweep`."""

    def run(model: CostModel, **settings) -> BaselinePlan | None:
        sweep = Sweep(model, **settings)
        return sweep.best(propose.__name__, functools.partial(propose, sweep))

    run.__name__ = run.__qualname__ = propose.__name__
    run.__doc__ = propose.__doc__
    return run


@_baseline
def uniform(search: Sweep, S: int, M: int, blocks: Blocks) -> Iterator[Proposal]:
    """Equal layer counts per stage, each stage's fastest fitting (tp, recompute)."""
    split = equal_split(search.space.layers, S)
    yield split, search.configure(blocks, split, M)


@_baseline
def alpa(search: Sweep, S: int, M: int, blocks: Blocks) -> Iterator[Proposal]:
    """Alpa's inter-operator split on identical devices, then the intra-operator choice per stage."""
    split = search.reference_split(blocks, M, tp=True)
    yield split, search.configure(blocks, split, M)


@_baseline
def pipedream(search: Sweep, S: int, M: int, blocks: Blocks) -> Iterator[Proposal]:
    """PipeDream's balanced split on identical devices, every stage data-parallel over its block."""
    split = search.reference_split(blocks, M, tp=False)
    yield split, search.configure(blocks, split, M, tp=False)


@_baseline
def greedy(search: Sweep, S: int, M: int, blocks: Blocks) -> Iterator[Proposal]:
    """Fastest blocks first, each stage filled in layer order up to its speed-proportional share."""
    L = search.space.layers
    speed = search.speed(blocks, M)
    order = sorted(blocks, key=lambda b: -speed[b[0]] * b[1])
    power = [speed[t] * n for t, n in order]
    split, start = [], 0
    for s, share in enumerate(power):
        left = S - s - 1
        quota = L * share / sum(power)
        end = start + 1
        while end < L - left and (end - start) + 1 <= quota + 0.5:
            end += 1
        if s == S - 1:
            end = L
        if end <= start:
            yield None, None
            return
        split.append(list(range(start, end)))
        start = end
    yield split, search.configure(order, split, M)


@_baseline
def balanced(search: Sweep, S: int, M: int, blocks: Blocks) -> Iterator[Proposal]:
    """Not a baseline: our own fast heuristic (true costs, speed-ordered blocks, bottleneck DP),
    used as the ILP's starting incumbent.

    Blocks go fastest first and, separately, fastest last: under 1F1B the last stages hold the
    fewest microbatches in flight, so a fast type whose memory binds holds more layers there."""
    space, schedule = search.space, search.schedule
    speed = search.speed(blocks, M)
    fastest_first = sorted(blocks, key=lambda b: -speed[b[0]] * b[1])
    for order in (fastest_first, fastest_first[::-1]):
        options = [[stage_costs(space, g, M) for g in configs_for(space, t, n, M)] for t, n in order]

        def stage_times(s, options=options):
            return fastest_times(options[s], space.layers, in_flight(schedule, M, S, s))

        split = min_bottleneck_split(space.layers, S, stage_times)
        yield split, search.configure(order, split, M)
        if fastest_first == fastest_first[::-1]:
            break


def exhaustive(model: CostModel, **settings) -> BaselinePlan | None:
    """The exact optimum by enumeration (only for tiny instances; ``exhaustive_plan``)."""
    ev = exhaustive_plan(model, **settings)
    return None if ev is None else BaselinePlan("exhaustive", [], [], 0, ev)


BASELINES = {"uniform": uniform, "alpa": alpa, "pipedream": pipedream, "greedy": greedy}
