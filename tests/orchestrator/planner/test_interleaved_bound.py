"""The capacity LP at v_max against enumeration of interleaved 1F1B plans: never above the best plan
with v ≤ v_max chunks a stage, where the plain bound (v = 1) can be."""

import itertools
import math
import random

from orchestrator.bench._synthetic import SyntheticCosts, SyntheticLayer, synthetic_cluster
from orchestrator.planner._capacity import capacity_bound_s
from orchestrator.planner._evaluate import evaluate
from orchestrator.planner._ilp import Run
from orchestrator.planner._interleaved_bound import interleaved_bound_s, interleaved_coverage, max_virtual_stages
from orchestrator.planner._make_plan import virtual_stage_counts
from orchestrator.planner._space import search_space

BATCH, STAGES = 12, 3


def _instance(seed: int, *, tight: bool) -> SyntheticCosts:
    """An embedding-like layer, 4 or 6 identical blocks, a head; one or two device types of two devices.
    ``tight``: six blocks and a light embedding and head on three devices of three types of one speed
    (no group of two: one device a stage), small outputs on a fast network, so the best plans are
    balanced pipelines where the capacity LP's rows are nearly exact and the bubble is what separates
    plain from interleaved plans."""
    rng = random.Random(seed)

    def layer(output: float) -> SyntheticLayer:
        return SyntheticLayer(rng.uniform(1, 8) * 1e12, rng.uniform(0.2, 4) * 1e9, rng.uniform(0.05, 1) * 1e9, output)

    if tight:  # six blocks between a light embedding and head: three stages of two blocks balance
        block, ends = layer(1e3), SyntheticLayer(1e9, 1e6, 1e6, 1e3)
        layers = [ends, *[block] * 6, ends]
    else:
        block = layer(rng.uniform(0.01, 0.2) * 1e9)
        layers = [
            layer(rng.uniform(0.01, 0.2) * 1e9),
            *[block] * rng.choice([4, 6]),
            layer(rng.uniform(0.01, 0.2) * 1e9),
        ]
    if tight:
        tflops = rng.choice([10.0, 20.0, 40.0])
        types = {name: (tflops, 64.0) for name in ("a", "b", "c")}
        return SyntheticCosts(layers, synthetic_cluster(types, per_host=1, network_gbps=400.0))
    types = {"fast": (rng.choice([10.0, 20.0, 40.0]), rng.choice([16.0, 32.0, 64.0]))}
    if rng.random() < 0.5:
        types["slow"] = (rng.choice([5.0, 10.0]), rng.choice([16.0, 32.0, 64.0]))
    return SyntheticCosts(layers, synthetic_cluster(types, network_gbps=rng.choice([1.0, 10.0, 50.0])))


def _partitions(n: int, S: int):
    for cuts in itertools.combinations(range(1, n), S - 1):
        ends = (0, *cuts, n)
        yield [list(range(ends[i], ends[i + 1])) for i in range(S)]


def _best_interleaved(space, M: int) -> float:
    """The best closed-form step over every interleaved plan of 2..STAGES stages at M (inf if none fits):
    each split whose stages hold a multiple of v blocks, each group per stage, each such v > 1."""
    best = math.inf
    valid = [g for g in space.groups if space.table.microbatch(g, M) is not None]
    for S in range(2, STAGES + 1):
        for stages in _partitions(space.layers, S):
            for v in virtual_stage_counts(space.runs, stages, M):
                for chosen in itertools.product(valid, repeat=S):
                    ev = evaluate(
                        stages, list(chosen), M, table=space.table, infos=space.infos, schedule="1f1b",
                        links=space.links, virtual_stages=v,
                    )  # fmt: skip
                    if ev.feasible:
                        best = min(best, ev.iteration_s)
    return best


def test_the_interleaved_bound_never_exceeds_the_best_interleaved_plan():
    """On random instances (two thirds with links, outputs and memory drawn at random, a third tight),
    the capacity LP at v_max and at most 3 stages stays at or below the best interleaved plan of each M,
    with and without a cutoff just above it, and at or below the plain LP (α_v falls as v grows).
    On the tight ones the plain LP (α at v = 1) lies above the best interleaved plan: a bound over plain
    schedules does not hold over interleaved ones, which is why the space needs its own. (The closed
    form prices each plan: a lower bound on its schedule, so the truth compared with is the least one.)"""
    compared = above_plain = 0
    for seed in range(18):
        model = _instance(seed, tight=seed % 3 == 0)
        space = search_space(model, BATCH, recompute=False, mixed=False)
        v_max = max_virtual_stages(space.runs)
        assert v_max == (len(model.layers) - 2) // 2
        for M in (2, 3, 4, 6):
            best = _best_interleaved(space, M)
            if best == math.inf:
                continue
            args = (space.runs, space.groups, space.table, space.infos, M, "1f1b")
            bound = capacity_bound_s(*args, max_stages=STAGES, virtual_stages=v_max)
            assert bound <= best * (1 + 1e-6), f"seed {seed}, M={M}: {bound} > {best}"
            capped = capacity_bound_s(*args, max_stages=STAGES, below_s=best * 1.001, virtual_stages=v_max)
            assert capped <= best * (1 + 1e-6), f"seed {seed}, M={M}: {capped} > {best} (cutoff)"
            plain = capacity_bound_s(*args, max_stages=STAGES)
            assert bound <= plain * (1 + 1e-9)
            assert interleaved_bound_s(space, [M, BATCH], STAGES, v_max) <= bound * (1 + 1e-9)  # least over M
            compared += 1
            above_plain += plain > best * (1 + 1e-6)
    assert compared >= 20
    # (each tight instance at M = 3 and 6: three stages of two blocks at v = 2 beat α(3)·Σ_s c_s)
    assert above_plain >= 12, f"the plain bound misses the best interleaved plan on only {above_plain}"


def test_v_max_is_the_most_chunks_a_plan_can_take():
    """Interleaving needs two stages of at least v blocks each: 8 blocks give v ≤ 4, a model without
    repeated layers none; the coverage then names 1..v_max."""
    from orchestrator.planner import Coverage

    assert max_virtual_stages([Run(0, 1), Run(1, 8), Run(9, 1)]) == 4
    assert virtual_stage_counts([Run(0, 1), Run(1, 8), Run(9, 1)], [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], 8) == [2, 4]
    assert max_virtual_stages([Run(0, 1), Run(1, 1), Run(2, 1)]) == 1
    assert max_virtual_stages([Run(0, 1), Run(1, 126), Run(127, 1)]) == 63  # Llama 3 405B's blocks
    covered = Coverage(microbatches=(4,), max_stages=2, groups=(("a", 1, 1, False),))
    widened = interleaved_coverage(covered, 4)
    assert widened.virtual_stages == (1, 2, 3, 4)
    stages = [("a", 1, 1, False)] * 2
    assert all(widened.contains(microbatches=4, stages=stages, virtual_stages=v) for v in (1, 2, 3, 4))
    assert not widened.contains(microbatches=4, stages=stages, virtual_stages=5)
