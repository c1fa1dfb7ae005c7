"""Schedule any DAG of Python functions across a cluster, exactly where possible, and run it on Dask.

>>> from orchestrator.dag import problem_from_costs, heft, milp
>>> p = problem_from_costs({"a": [1, 2], "b": [2, 1]}, {("a", "b"): 5})
>>> heft(p).makespan, milp(p).makespan
(3.0, 3.0)
"""

from orchestrator.dag._exhaustive import exhaustive
from orchestrator.dag._generate import random_problem, wfcommons_problem
from orchestrator.dag._jobs import Instance, Job, JobGraph
from orchestrator.dag._list_scheduling import cpop, downward_ranks, heft, upward_ranks
from orchestrator.dag._milp import milp
from orchestrator.dag._problem import ScheduleProblem, problem_from_costs, uniform_links
from orchestrator.dag._run import Execution, JobFailed, TaskRecord, run
from orchestrator.dag._schedule import Placement, Schedule

__all__ = [
    "Execution",
    "Instance",
    "Job",
    "JobFailed",
    "JobGraph",
    "Placement",
    "Schedule",
    "ScheduleProblem",
    "TaskRecord",
    "cpop",
    "downward_ranks",
    "exhaustive",
    "heft",
    "milp",
    "problem_from_costs",
    "random_problem",
    "run",
    "uniform_links",
    "upward_ranks",
    "wfcommons_problem",
]
