"""The planner: pipeline stages, device groups, TP/DP degrees, microbatches and recompute from one ILP per (S, M)."""

from orchestrator.planner._plan import Plan, PlanInfeasible, PlanNotFound, Stage
from orchestrator.planner._replan import cached_plan, fingerprint, replan
from orchestrator.planner._search import plan

__all__ = ["Plan", "PlanInfeasible", "PlanNotFound", "Stage", "cached_plan", "fingerprint", "plan", "replan"]
