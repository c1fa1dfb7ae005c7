"""One definition of a relative error for every bench: predicted / measured − 1."""

import math

from orchestrator.bench import Case, rel_err


def test_rel_err_is_predicted_over_measured_less_one():
    assert rel_err(3.0, 2.0) == 0.5  # the prediction is too high: positive
    assert rel_err(1.0, 2.0) == -0.5
    assert rel_err(0.0, 0.0) == 0.0
    assert math.isinf(rel_err(1.0, 0.0))
    case = Case(name="x", metric="s", predicted=1.1, measured=1.0, tolerance=0.15)
    assert case.rel_err == rel_err(1.1, 1.0) and case.ok
