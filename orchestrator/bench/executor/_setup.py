"""What every executor bench case starts from: a recipe captured, profiled and costed on the local cluster.

A :class:`Setup` holds the recipe's op-graph, layers, cost model, state and batch, and, for the
timing cases, the host's measured costs (:mod:`._host`). On a machine whose cores are shared the
same measurement drifts by tens of percent from one minute to the next, so the timing cases
profile afresh (:func:`recalibrated`, never from the disk cache) and interleave prediction and
measurement. The layers are also profiled at smaller batches (``SMALLER_BATCH_DIVISORS``) so that
every per-device microbatch the check plans' stages run is measured, not extrapolated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from orchestrator.bench.executor._host import HostCosts, measure_host_costs

# the layers' times at smaller batches (``profile_layers(fixed_from=...)``): batch / 2, 4, 8 and 16, at
# gpt-tiny's 16 every per-device microbatch of the check plans' stages (8, 4, 2 and 1 samples): a line
# through fewer points misprices the per-device batches between them
SMALLER_BATCH_DIVISORS = (2, 4, 8, 16)


@dataclasses.dataclass(slots=True)
class Setup:
    recipe: object
    graph: object
    layers: object
    model: object
    device_type: str
    cores: int
    state: object
    batch: dict
    axes: dict
    host: HostCosts | None  # measured for the timing cases only


def setup(recipe_name: str, global_batch: int, seq_len: int, *, host: bool = False) -> Setup:
    """Capture, coarsen, profile and cost ``recipe_name`` at (global_batch, seq_len) on the local cluster;
    with ``host``, also measure the host's costs for the timing cases."""
    from integrations.flax import capture, profile_layers
    from orchestrator.cluster import load_cluster
    from orchestrator.coarsen import coarsen
    from orchestrator.costs import CostModel
    from recipes import get_recipe, synthetic_batch

    recipe = get_recipe(recipe_name)
    abstract, spec = recipe.abstract_state(), recipe.batch_spec(global_batch, seq_len)
    graph = capture(recipe.train_step, abstract, spec)
    layers = coarsen(graph)
    # with ``host``, :func:`recalibrated` profiles afresh below, never from the disk cache: cached
    # layer times describe the machine as it was when they were measured
    timings = None if host else profile_layers(recipe.train_step, abstract, spec, graph=graph, layers=layers)
    cluster = load_cluster("local")
    [device_type] = cluster.device_types
    axes = recipe.param_axes() if recipe.family == "gpt" else {}
    model = CostModel(graph, layers, cluster, batch_size=global_batch, param_axes=axes or None, measured=timings)
    state = jax.jit(recipe.create_state)(jax.random.key(0))
    batch = synthetic_batch(jax.random.key(1), global_batch, seq_len, recipe.config.vocab_size)
    su = Setup(recipe, graph, layers, model, device_type, cluster.shared_cores or 1, state, batch, axes, None)
    return recalibrated(su) if host else su


def _smaller_batches(recipe, abstract, batch: int, seq_len: int) -> list[tuple]:
    """The step's arguments at each smaller batch the layers are also profiled at (at least 1 sample)."""
    sizes = sorted({max(1, batch // d) for d in SMALLER_BATCH_DIVISORS} - {batch})
    return [(abstract, recipe.batch_spec(size, seq_len)) for size in sizes]


def _gradients(su: Setup):
    """The work a stage does alone, whose slowdown s(k) is measured: forward and backward, no update."""
    from recipes.train import loss_fn

    return lambda params, batch: jax.value_and_grad(loss_fn)(params, su.state.apply_fn, batch)


def recalibrated(su: Setup) -> Setup:
    """``su`` with the layers profiled again (not from the disk cache) and the host's costs measured
    again.

    On a machine whose cores are shared the same measurement drifts from one minute to the next,
    so each comparison is calibrated just before it is measured, and repeated.
    """
    profiler = _layer_profiler(su)
    profiler.sample()  # warm-up: compiles
    samples = [profiler.sample() for _ in range(5)]
    host = measure_host_costs(_gradients(su), su.state.params, su.batch)
    host = dataclasses.replace(host, boundary_s=profiler.boundary_seconds(samples, host_s=_piece_host(host)))
    return dataclasses.replace(
        su, model=_remodelled(su, profiler.timings(samples, host_s=_piece_host(host))), host=host
    )


def _piece_host(host: HostCosts) -> Callable[[int], float]:
    """The host's seconds for a profiled piece's call with n buffers: d(1) + n · b."""
    return lambda n: host.dispatch(1) + n * host.buffer_s


def _layer_profiler(su: Setup):
    """The layers of ``su``'s step, compiled for profiling at its batch and at each smaller batch
    (:class:`~integrations.flax.LayerProfiler`; never read from the disk cache)."""
    from integrations.flax import LayerProfiler

    batch, seq_len = su.batch["inputs"].shape
    abstract = su.recipe.abstract_state()
    return LayerProfiler(
        su.recipe.train_step,
        abstract,
        su.recipe.batch_spec(batch, seq_len),
        graph=su.graph,
        layers=su.layers,
        fixed_from=_smaller_batches(su.recipe, abstract, batch, seq_len),
        boundary=True,
    )


def _remodelled(su: Setup, timings):
    """``su``'s cost model with the layers' measured times replaced by ``timings``."""
    from orchestrator.costs import CostModel

    old = su.model
    return CostModel(
        old.graph, old.layers, old.cluster, batch_size=old.batch_size, param_axes=su.axes or None, measured=timings
    )
