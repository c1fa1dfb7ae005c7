"""``orchestrator bench executor``: executed plans against single-device training and the cost model.

:func:`run` gives every case (parity, collectives, stage times, the step-time ranking) and the
stage-timing controls; :func:`check_plan` builds the fixed plans the cases run.
"""

from orchestrator.bench.executor._cases import (
    communication_cases,
    kendall_tau,
    parity_cases,
    ranking_case,
    run,
    self_agreement,
    timing_cases,
)
from orchestrator.bench.executor._communication import measured_collectives, predicted_collectives
from orchestrator.bench.executor._controls import control_cases, one_layer_stages
from orchestrator.bench.executor._host import HostCosts, SlowdownRun, measure_host_costs
from orchestrator.bench.executor._parity import PLAN_NAMES, Parity, check_plan, parity
from orchestrator.bench.executor._setup import SMALLER_BATCH_DIVISORS, Setup, setup

__all__ = [
    "PLAN_NAMES",
    "SMALLER_BATCH_DIVISORS",
    "HostCosts",
    "Parity",
    "Setup",
    "SlowdownRun",
    "check_plan",
    "communication_cases",
    "control_cases",
    "kendall_tau",
    "measure_host_costs",
    "measured_collectives",
    "one_layer_stages",
    "parity",
    "parity_cases",
    "predicted_collectives",
    "ranking_case",
    "run",
    "self_agreement",
    "setup",
    "timing_cases",
]
