"""``linear``, the one-pass expression builder of the stage ILP, against PuLP's own lpSum."""

import random

import pulp

from orchestrator.planner._ilp import linear


def test_linear_equals_lpsum_of_products_with_repeats_and_zeros():
    rng = random.Random(0)
    problem = pulp.LpProblem("linear")
    variables = [problem.add_variable(f"x{i}") for i in range(6)]
    for _ in range(50):
        pairs = [(rng.choice(variables), rng.choice([0, 0.0, -1.5, 2, rng.uniform(-3, 3)])) for _ in range(12)]
        ours = linear(pairs)
        theirs = pulp.lpSum(c * v for v, c in pairs)
        assert [(v.name, c) for v, c in ours.items()] == [(v.name, c) for v, c in theirs.items()]
        assert ours.constant == theirs.constant == 0
