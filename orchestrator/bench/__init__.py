"""Benchmarks that check Orchestrator's predictions against external truth (XLA, measurements)."""

from orchestrator.bench._case import Case
from orchestrator.bench._fidelity import compute_cases, fidelity_cases

__all__ = ["Case", "compute_cases", "fidelity_cases"]
