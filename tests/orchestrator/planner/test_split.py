"""The baselines' bottleneck split and interval costs, against brute force."""

import itertools
import random

import numpy as np

from orchestrator.bench._synthetic import random_instance
from orchestrator.planner._space import search_space
from orchestrator.planner._split import StageCosts, best_config, fastest_times, min_bottleneck_split, stage_costs


def _splits(layers: int, stages: int):
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = [0, *cuts, layers]
        yield [(bounds[s], bounds[s + 1]) for s in range(stages)]


def test_split_is_the_least_bottleneck_then_the_least_sum():
    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        layers, stages = rng.randint(1, 7), rng.randint(1, 4)
        times = []
        for _ in range(stages):  # integers, so that ties happen and must be broken by the sum
            m = np.array([[float(rng.randint(1, 6)) for _ in range(layers + 1)] for _ in range(layers + 1)])
            m[np.tril_indices(layers + 1)] = np.inf
            for i in range(layers + 1):  # (a stage that fits nowhere from some first layers)
                if rng.random() < 0.2:
                    m[i, :] = np.inf
            times.append(m)
        split = min_bottleneck_split(layers, stages, times.__getitem__)
        values = [
            (
                max(times[s][i, k] for s, (i, k) in enumerate(ranges)),
                sum(times[s][i, k] for s, (i, k) in enumerate(ranges)),
            )
            for ranges in _splits(layers, stages)
        ]
        best = min(values, default=None)
        if best is None or best[0] == np.inf:
            assert split is None
            continue
        assert split is not None and [layer for stage in split for layer in stage] == list(range(layers))
        ranges = [(stage[0], stage[-1] + 1) for stage in split]
        assert (
            max(times[s][i, k] for s, (i, k) in enumerate(ranges)),
            sum(times[s][i, k] for s, (i, k) in enumerate(ranges)),
        ) == best
        checked += 1
    assert checked >= 100, checked


def test_interval_matrices_match_the_scalar_costs():
    checked = 0
    for seed in range(8):
        space = search_space(random_instance(seed), 8, recompute=True)
        for M in (1, 2):
            options = [StageCosts(space, g, M) for g in space.groups if space.table.microbatch(g, M) is not None]
            for in_flight in (1, M):
                fastest = fastest_times(options, space.layers, in_flight)
                for i in range(space.layers):
                    for k in range(i + 1, space.layers + 1):
                        found = best_config(options, i, k, in_flight)
                        assert fastest[i, k] == (found.time_s(i, k) if found else np.inf)
                        for option in options:
                            expected = option.time_s(i, k) if option.fits(i, k, in_flight) else np.inf
                            assert option.times(in_flight)[i, k] == expected
                        checked += 1
                assert np.all(np.isinf(fastest[np.tril_indices(space.layers + 1)]))  # (k ≤ i: no stage)
    assert checked >= 50, checked


def test_stage_costs_are_built_once_per_cost_table_and_equal_a_fresh_build():
    space = search_space(random_instance(0), 8, recompute=True)
    other = search_space(random_instance(0), 8, recompute=True)  # (its own table)
    group = next(g for g in space.groups if space.table.microbatch(g, 2) is not None)
    kept = stage_costs(space, group, 2)
    assert stage_costs(space, group, 2) is kept and stage_costs(other, group, 2) is not kept
    fresh = StageCosts(space, group, 2)
    assert kept.time == fresh.time and np.array_equal(kept.times(2), fresh.times(2))
