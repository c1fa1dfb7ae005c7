"""Cutting the layers anew for fixed device sets: the least bottleneck, against every cut."""

import itertools
import math
import random

from orchestrator.bench._synthetic import random_instance
from orchestrator.planner._evaluate import summarize_stage
from orchestrator.planner._ilp import in_flight
from orchestrator.planner._rebalance import Rebalancer
from orchestrator.planner._space import search_space

BATCH = 8


def _least_bottleneck(space, rebalancer, groups, M, schedule):
    """Every contiguous cut into len(groups) stages × every variant per stage: the least slowest
    stage compute that fits in memory (inf when none fits)."""
    L, S = space.layers, len(groups)
    best = math.inf
    for ends in itertools.combinations(range(1, L), S - 1):
        bounds = (0, *ends, L)
        slowest = 0.0
        for s, group in enumerate(groups):
            layers = list(range(bounds[s], bounds[s + 1]))
            options = []
            for variant in rebalancer.variants[(group.device_type, group.size, group.tp)]:
                summary = summarize_stage(
                    layers, variant, None, M, in_flight(schedule, M, S, s), table=space.table, links=space.links
                )
                if summary is not None and summary.fits:
                    options.append(sum(space.table.entry(layer, variant, M).time_s for layer in layers))
            if not options:
                slowest = math.inf
                break
            slowest = max(slowest, min(options))
        best = min(best, slowest)
    return best


def test_rebalance_finds_the_least_bottleneck_of_every_cut():
    rng = random.Random(0)
    compared = empty = 0
    for seed in range(20):
        model = random_instance(seed)
        space = search_space(model, BATCH, recompute=True, mixed=False)
        for schedule in ("1f1b", "gpipe"):
            rebalancer = Rebalancer(space.table, space.groups, space.layers, schedule)
            for _ in range(3):
                M = rng.choice([1, 2, 4])
                S = rng.randint(1, min(3, space.layers))
                candidates = [g for g in space.groups if space.table.microbatch(g, M) is not None]
                groups = [rng.choice(candidates) for _ in range(S)]  # devices may repeat: the cut does not care
                truth = _least_bottleneck(space, rebalancer, groups, M, schedule)
                found = rebalancer.rebalance(groups, M, above_s=1e9)
                if truth == math.inf:
                    assert found is None, f"seed {seed}: a cut where none fits"
                    empty += 1
                    continue
                stages, chosen = found
                assert [layer for stage in stages for layer in stage] == list(range(space.layers))
                assert all(stages) and len(stages) == S
                slowest = 0.0
                for s, (layers, variant) in enumerate(zip(stages, chosen)):
                    assert (variant.device_type, variant.size, variant.tp) == (
                        groups[s].device_type,
                        groups[s].size,
                        groups[s].tp,
                    )
                    summary = summarize_stage(
                        layers, variant, None, M, in_flight(schedule, M, S, s), table=space.table, links=space.links
                    )
                    assert summary.fits, f"seed {seed}: stage {s} does not fit"
                    slowest = max(slowest, sum(space.table.entry(layer, variant, M).time_s for layer in layers))
                assert truth <= slowest <= truth * (1 + 1e-6), f"seed {seed}: {slowest} against {truth}"
                # nothing below the least bottleneck: a bracket under it finds no cut
                assert rebalancer.rebalance(groups, M, above_s=truth * (1 - 1e-6)) is None
                compared += 1
    assert compared >= 60 and empty >= 1, (compared, empty)


def test_reorders_keep_the_device_sets_cover_every_layer_and_never_slow_the_bottleneck():
    from orchestrator.planner._polish import _Moves
    from orchestrator.planner.baselines import BASELINES

    checked = 0
    for seed in range(16):
        model = random_instance(seed)
        start = BASELINES["uniform"](model, global_batch=BATCH, microbatch_candidates=(1, 2, 4), max_stages=3)
        if start is None:
            continue
        space = search_space(model, BATCH, recompute=True)
        moves = _Moves(space, [4, 2, 1], 3, "1f1b")
        candidate = (tuple(tuple(s) for s in start.stages), tuple(start.groups), start.microbatches)
        before = moves.rebalancer.bottleneck_s(*candidate)
        sets = sorted((g.device_type, g.size, g.tp) for g in start.groups)
        for stages, groups, M in moves.reorders(candidate):
            assert M == start.microbatches
            assert [layer for stage in stages for layer in stage] == list(range(space.layers))
            assert all(stages) and sorted((g.device_type, g.size, g.tp) for g in groups) == sets
            assert moves.rebalancer.bottleneck_s(stages, groups, M) <= before * (1 + 1e-9)
            checked += 1
    assert checked >= 20, checked
