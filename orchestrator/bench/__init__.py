"""Benchmarks that check Orchestrator's predictions against external truth (XLA, measurements)."""

from orchestrator.bench._case import Case, rel_err
from orchestrator.bench._conductor import Claim, all_cases
from orchestrator.bench._dag import run_suite as run_dag_suite
from orchestrator.bench._fidelity import compute_cases, fidelity_cases
from orchestrator.bench._planner import run_suite as run_planner_suite
from orchestrator.bench._published import bench_published, load_runs
from orchestrator.bench._replan import run_suite as run_replan_suite
from orchestrator.bench._replan_live import run as run_replanner_suite
from orchestrator.bench._ring import ring_cases


def conductor_claims(*, quick: bool = False, progress=lambda name: None) -> list[Claim]:
    """Every case of ``orchestrator bench conductor``: the rewrites on one device, then ring
    attention across the local devices; ``quick`` uses small sizes (for tests)."""
    return all_cases(quick=quick, progress=progress) + ring_cases(quick=quick, progress=progress)


__all__ = [
    "Case",
    "bench_published",
    "compute_cases",
    "conductor_claims",
    "fidelity_cases",
    "load_runs",
    "rel_err",
    "run_dag_suite",
    "run_planner_suite",
    "run_replan_suite",
    "run_replanner_suite",
]
