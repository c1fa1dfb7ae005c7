"""The planner: pipeline stages, device groups, TP/DP degrees, microbatches and recompute from one ILP per (S, M).

Layers inside the package, top to bottom; a module imports only from the layers below it (and
from its own layer where the arrow says so), so the search never reaches back up:

1. ``_replan`` → ``_driver``: the entry points (``replan()`` re-plans through ``plan()``).
2. ``_starts``, ``_bounds``, ``_models`` → ``_solve`` → ``_pieces``, ``_make_plan``: the steps
   ``plan()`` composes (first incumbent; column and packing bounds; each M's model, cut into
   pieces and solved; the returned ``Plan``).
3. ``baselines`` (subpackage: ``_baselines`` → ``_exhaustive`` → ``_sweep``): the balanced
   heuristic and the baselines. It stands below every search step and imports only layers 5–6.
4. ``_polish`` → ``_rebalance``, ``_incumbent``; ``_paths``, ``_packing``, ``_workers``,
   ``_diagnose``, ``_options``: the search's tools (local search, column and packing bounds,
   solver threads, diagnosis, the incumbent, the tuning options).
5. ``_space``, ``_split``, ``_migration``, ``_evaluate``: the search space and pricing a plan.
6. ``_ilp`` → ``_closed_form``, ``_table`` → ``_groups``, ``_plan``: the model, its cost table,
   device groups and the ``Plan`` type.

Outside the package, only the names below are public; ``orchestrator.planner.baselines`` is
public to the benches (its ``__all__``).
"""

from orchestrator.planner._driver import plan
from orchestrator.planner._options import SearchOptions
from orchestrator.planner._plan import Plan, PlanInfeasible, PlanNotFound, Stage
from orchestrator.planner._replan import cached_plan, fingerprint, replan

__all__ = [
    "Plan",
    "PlanInfeasible",
    "PlanNotFound",
    "SearchOptions",
    "Stage",
    "cached_plan",
    "fingerprint",
    "plan",
    "replan",
]
