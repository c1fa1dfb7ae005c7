"""Helpers shared by the CLI commands."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import typer

# The largest sizes the commands accept: past them a value is a typo, and planning for it would only burn
# time (a cost table with a row per batch share, a capture of a sequence no model was built for).
MAX_GLOBAL_BATCH = 65536  # samples per step; the largest published global batches (LARS, LAMB) are 64k
MAX_SEQ = 1 << 20  # tokens per sample
MAX_STAGES = 64
MAX_TIME_LIMIT_S = 86400.0

# the exit code of a command whose time limit ran out before it had an answer (a user mistake is 2)
OUT_OF_TIME = 3

# set by the entry point for the length of a command run with --json: its errors go to stdout as JSON too,
# so a script reading stdout sees an answer whatever happened
_JSON_ERRORS: ContextVar[bool] = ContextVar("json_errors", default=False)


@contextlib.contextmanager
def json_errors(enabled: bool) -> Iterator[None]:
    """Within the block, :func:`fail` also prints ``{"error": message}`` on stdout when ``enabled``."""
    token = _JSON_ERRORS.set(enabled)
    try:
        yield
    finally:
        _JSON_ERRORS.reset(token)


def report_error(message: str, *, as_json: bool) -> None:
    """One line ``error: message`` on stderr, and ``{"error": message}`` on stdout if ``as_json``."""
    message = " ".join(str(message).split())  # one line, whatever the message held
    if as_json:
        sys.stdout.write(json.dumps({"error": message}) + "\n")
        sys.stdout.flush()
    typer.echo(f"error: {message}", err=True)


def fail(message: str, *, code: int = 2) -> NoReturn:
    """End the command with a one-line error on stderr and exit ``code`` (2: a user mistake;
    :data:`OUT_OF_TIME`), and ``{"error": message}`` on stdout under --json."""
    report_error(message, as_json=_JSON_ERRORS.get())
    raise typer.Exit(code=code)


DTYPES = ("float32", "bfloat16")


def recipe_or_fail(name: str, dtype: str | None = None):
    """The recipe called ``name``, computing in ``dtype`` (None: the recipe's own; parameters stay
    float32, as mixed-precision training keeps them), or a one-line error naming the recipes or
    dtypes there are."""
    import dataclasses

    from recipes import RECIPES

    if not isinstance(name, str) or name not in RECIPES:
        fail(f"unknown recipe {name!r}; choose one of: {', '.join(RECIPES)}")
    if dtype is None:
        return RECIPES[name]
    if dtype not in DTYPES:
        fail(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    spec = RECIPES[name]
    return dataclasses.replace(spec, config=dataclasses.replace(spec.config, dtype=dtype))


def seq_or_fail(spec, seq: int | None, flag: str = "--seq") -> int:
    """``seq`` (the recipe's own if None), or a one-line error if the recipe's model cannot take it."""
    seq = seq or spec.seq_len
    limit = getattr(spec.config, "max_seq_len", None)
    if limit is not None and seq > limit:
        fail(f"{flag} {seq} exceeds {spec.name}'s max_seq_len {limit}; pass {flag} {limit} or less")
    if seq > MAX_SEQ:
        fail(f"{flag} {seq} is past the longest sequence accepted, {MAX_SEQ}")
    return seq


def plan_or_fail(path: str | Path):
    """The plan in the JSON file ``path``, or a one-line error saying why it is none."""
    from orchestrator.planner import Plan

    hint = "pass a file written by 'orchestrator plan --out'"
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        fail(f"no plan file {str(path)!r}; write one with 'orchestrator plan ... --out {path}'")
    except IsADirectoryError:
        fail(f"{path} is a directory; {hint}")
    except UnicodeDecodeError as error:
        fail(f"{path} is not UTF-8 text (byte {error.start}); {hint}")
    except (OSError, ValueError) as error:
        fail(f"{path}: cannot read it ({getattr(error, 'strerror', None) or error}); {hint}")
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:
        fail(f"{path} is not JSON ({error}); {hint}")
    try:
        if not isinstance(data, dict):
            raise TypeError(f"expected a JSON object, got {type(data).__name__}")
        return Plan.from_json(data)
    except (TypeError, KeyError, AttributeError, ValueError, RecursionError) as error:
        fail(f"{path} is not a plan file ({error}); {hint}")


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanSource:
    """What a plan file says it was made for: the recipe, its sequence length, the cluster."""

    recipe: str
    seq: int | None
    cluster: object  # orchestrator.cluster.Cluster
    cluster_name: str  # as given to orchestrator plan: a preset name or a YAML path
    dtype: str | None = None  # the compute dtype it was planned in (None: the recipe's own)


def plan_source_or_fail(plan, plan_file) -> PlanSource:
    """The recipe, seq and cluster in ``plan.source``: the cluster embedded in the plan (``cluster_spec``), or,
    for a plan without one, the preset or file it names; a one-line error when they are not usable."""
    from orchestrator.cluster import ClusterError, parse_cluster

    source = plan.source
    recipe, seq, name = source.get("recipe"), source.get("seq"), source.get("cluster")
    if not isinstance(recipe, str) or not isinstance(name, str):
        fail(f"{plan_file}: source.recipe and source.cluster must be names, got {recipe!r} and {name!r}")
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq < 1):
        fail(f"{plan_file}: source.seq must be a whole number >= 1, got {seq!r}")
    dtype = source.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        fail(f"{plan_file}: source.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if "cluster_spec" in source:
        try:
            cluster = parse_cluster(source["cluster_spec"], f"{plan_file}: source.cluster_spec")
        except ClusterError as error:
            fail(str(error))
    else:
        cluster = cluster_or_fail(name)
    return PlanSource(recipe=recipe, seq=seq, cluster=cluster, cluster_name=name, dtype=dtype)


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
