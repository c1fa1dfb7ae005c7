"""The planner: pipeline stages, device groups, TP/DP degrees, microbatches and recompute from one ILP per (S, M).

Layers inside the package, top to bottom; a module imports only from the layers below its own
(modules in one layer, separated by "|", never import each other), so the search never reaches
back up and the baselines never reach into it:

    _replan                                            re-planning, through plan()
    _driver                                            plan(): composes the steps below
    _starts | _bounds | _models                        first incumbent; column and packing bounds;
                                                       each M's model cut into pieces
    _solve                                             the pieces' first pass and rounds
    _pieces | _make_plan | _scope                      pieces and their certificate; the Plan;
                                                       what every step of one search reads
    baselines                                          the balanced heuristic and the baselines
                                                       (inside: _baselines → _exhaustive → _sweep)
    _polish | _paths | _packing | _workers | _diagnose | _options
                                                       local search, column and packing LPs,
                                                       solver threads, diagnosis, tuning options
    _rebalance | _incumbent                            cuts for given devices; the incumbent
    _space | _split | _migration | _evaluate           search space, chain splits, pricing a plan
    _ilp                                               the stage ILP
    _closed_form | _table                              the step time's closed form; the cost table
    _groups | _plan | _deadline | _progress            device groups; the Plan type; the hard time limit;
                                                       what a search reports as it goes

Outside the package, only the names below are public; ``orchestrator.planner.baselines`` is
public to the benches (its ``__all__``).
"""

from orchestrator.planner._deadline import Deadline, DeadlineExceeded
from orchestrator.planner._driver import plan
from orchestrator.planner._groups import MEMORY_HEADROOM, GroupConfig, usable_memory_bytes
from orchestrator.planner._options import SearchOptions
from orchestrator.planner._plan import Coverage, Plan, PlanInfeasible, PlanNotFound, Stage
from orchestrator.planner._progress import SearchProgress
from orchestrator.planner._replan import cached_plan, fingerprint, replan

__all__ = [
    "MEMORY_HEADROOM",
    "Coverage",
    "Deadline",
    "DeadlineExceeded",
    "GroupConfig",
    "Plan",
    "PlanInfeasible",
    "PlanNotFound",
    "SearchOptions",
    "SearchProgress",
    "Stage",
    "cached_plan",
    "fingerprint",
    "plan",
    "replan",
    "usable_memory_bytes",
]
