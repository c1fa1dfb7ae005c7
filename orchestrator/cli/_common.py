"""Helpers shared by the CLI commands."""

from __future__ import annotations

from typing import NoReturn

import typer


def fail(message: str) -> NoReturn:
    """End the command with a one-line error on stderr and exit code 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def recipe_or_fail(name: str):
    """The recipe called ``name``, or a one-line error naming the recipes there are."""
    from recipes import RECIPES

    if name not in RECIPES:
        fail(f"unknown recipe {name!r}; choose one of: {', '.join(RECIPES)}")
    return RECIPES[name]


def cluster_or_fail(name: str):
    """The cluster preset or YAML file ``name``, or its loader's one-line error."""
    from orchestrator.cluster import ClusterError, load_cluster

    try:
        return load_cluster(name)
    except ClusterError as error:
        fail(str(error))


def recipe_cost_model(spec, cluster, seq: int | None):
    """The cost model of a recipe's training step on ``cluster``, as ``orchestrator plan`` prices it: captured
    at the recipe's own batch size and ``seq`` (None: the recipe's)."""
    from integrations.flax import capture
    from orchestrator.coarsen import coarsen
    from orchestrator.costs import CostModel

    graph = capture(spec.train_step, spec.abstract_state(), spec.batch_spec(spec.batch_size, seq))
    return CostModel(graph, coarsen(graph), cluster, batch_size=spec.batch_size, param_axes=spec.param_axes())


def si(value: float, unit: str) -> str:
    """``1.23 GFLOP``-style formatting with SI prefixes."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}"
