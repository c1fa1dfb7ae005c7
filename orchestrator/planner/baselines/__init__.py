"""Baseline planners (uniform, Alpa-style, PipeDream-style, greedy, exhaustive), scored by our cost model.

They stand below the planner's driver, which starts from the best of them and the balanced
heuristic, and they use only the planner's pricing primitives (the search space, the closed
form, the chain splits), never its search.
"""

from orchestrator.planner.baselines._baselines import (
    BASELINES,
    BaselinePlan,
    alpa,
    balanced,
    exhaustive,
    greedy,
    pipedream,
    uniform,
)
from orchestrator.planner.baselines._exhaustive import exhaustive_plan
from orchestrator.planner.baselines._fixed import fixed

__all__ = [
    "BASELINES",
    "BaselinePlan",
    "alpa",
    "balanced",
    "exhaustive",
    "exhaustive_plan",
    "fixed",
    "greedy",
    "pipedream",
    "uniform",
]
