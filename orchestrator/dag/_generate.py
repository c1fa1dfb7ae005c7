"""Random task graphs with the HEFT paper's parameters, and real workflow shapes from WfCommons.

Random graphs (Topcuoglu et al. 2002, §5.1): ``v`` tasks in ⌈√v / α⌉ levels
of about √v · α tasks (α < 1 tall, α > 1 wide); each task links to about
``out_degree`` tasks of later levels; the mean execution time w̄_i of a task
is uniform on [0, 2·w̄_DAG] and its time on device p uniform on
[w̄_i (1 − β/2), w̄_i (1 + β/2)] (β = heterogeneity); communication costs are
drawn around CCR · w̄_DAG, so CCR is the communication-to-computation ratio.
"""

from __future__ import annotations

import math

import numpy as np

from orchestrator.dag._problem import ScheduleProblem, problem_from_costs


def random_problem(
    *,
    tasks: int,
    devices: int,
    ccr: float = 1.0,
    alpha: float = 1.0,
    out_degree: int = 2,
    beta: float = 0.5,
    mean_exec: float = 50.0,
    seed: int = 0,
) -> ScheduleProblem:
    rng = np.random.default_rng(seed)
    height = max(1, round(math.sqrt(tasks) / alpha))
    levels: list[list[int]] = [[] for _ in range(height)]
    for t in range(tasks):
        levels[0 if t == 0 else int(rng.integers(0, height))].append(t)
    levels = [lvl for lvl in levels if lvl]
    names = [f"t{t}" for t in range(tasks)]
    comm: dict[tuple[str, str], float] = {}
    for i, level in enumerate(levels[:-1]):
        later = [t for lvl in levels[i + 1 :] for t in lvl]
        nxt = levels[i + 1]
        for t in level:
            k = max(1, min(len(later), int(rng.integers(1, 2 * out_degree))))
            targets = set(rng.choice(later, size=k, replace=False).tolist())
            targets.add(int(rng.choice(nxt)))  # every task reaches the next level
            for u in targets:
                comm[(names[t], names[u])] = float(rng.uniform(0, 2 * ccr * mean_exec))
    for lvl_index, level in enumerate(levels[1:], start=1):  # every task below the top has a parent
        for t in level:
            if not any(e[1] == names[t] for e in comm):
                parent = int(rng.choice(levels[lvl_index - 1]))
                comm[(names[parent], names[t])] = float(rng.uniform(0, 2 * ccr * mean_exec))
    exec_s = {}
    for t in range(tasks):
        mean = float(rng.uniform(0, 2 * mean_exec)) or mean_exec
        exec_s[names[t]] = [float(rng.uniform(mean * (1 - beta / 2), mean * (1 + beta / 2))) for _ in range(devices)]
    return problem_from_costs(exec_s, comm)


def wfcommons_problem(
    recipe: str, *, tasks: int, devices: int, beta: float = 0.5, ccr: float = 1.0, seed: int = 0
) -> ScheduleProblem:
    """A scientific workflow's shape (``"montage"``, ``"epigenomics"``, ``"cycles"``, ...) from WfCommons.

    Task runtimes come from the recipe (spread over devices by β); communication
    is scaled so the instance has the given CCR.
    """
    import wfcommons.wfchef.recipes as recipes
    from wfcommons import WorkflowGenerator

    classes = {
        name.removesuffix("Recipe").lower(): getattr(recipes, name) for name in dir(recipes) if name.endswith("Recipe")
    }
    if recipe not in classes:
        raise ValueError(f"unknown WfCommons recipe {recipe!r}; choose one of {sorted(classes)}")
    import random

    random.seed(seed)
    np.random.seed(seed)
    workflow = WorkflowGenerator(classes[recipe].from_num_tasks(tasks)).build_workflow()
    rng = np.random.default_rng(seed)
    runtime = {n: max(1e-3, float(workflow.nodes[n]["task"].runtime)) for n in workflow.nodes}
    mean_runtime = sum(runtime.values()) / len(runtime)
    sizes = {}
    for a, b in workflow.edges:
        files = {f.file_id for f in workflow.nodes[a]["task"].output_files} & {
            f.file_id for f in workflow.nodes[b]["task"].input_files
        }
        sizes[(a, b)] = sum(f.size for f in workflow.nodes[a]["task"].output_files if f.file_id in files) or 1.0
    mean_size = sum(sizes.values()) / max(1, len(sizes))
    comm = {e: ccr * mean_runtime * s / mean_size for e, s in sizes.items()}
    exec_s = {
        n: [float(rng.uniform(r * (1 - beta / 2), r * (1 + beta / 2))) for _ in range(devices)]
        for n, r in runtime.items()
    }
    return problem_from_costs(exec_s, comm)
