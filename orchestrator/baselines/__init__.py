"""Baseline planners (uniform, Alpa-style, PipeDream-style, greedy, exhaustive), scored by our cost model."""

from orchestrator.baselines._baselines import (
    BASELINES,
    BaselinePlan,
    alpa,
    balanced,
    exhaustive,
    greedy,
    pipedream,
    uniform,
)

__all__ = ["BASELINES", "BaselinePlan", "alpa", "balanced", "exhaustive", "greedy", "pipedream", "uniform"]
