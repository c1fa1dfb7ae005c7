"""Place a TrainState on the devices a :class:`~orchestrator.planner.Plan` names.

Every stage gets a 2-D mesh ``("data", "model")`` of shape ``(dp, tp)`` over
its devices (a context-parallel stage a 3-D one, ``("data", "context", "model")``, over which
the state is replicated along ``"context"``: :mod:`integrations.flax._context`). A parameter is placed on the mesh of the stage that owns it (the
stage holding the layer that first reads it, ``Layer.params``); its
``PartitionSpec`` comes from its logical axis names and the logical axis rules
(``axis_rules=``, :data:`orchestrator.costs.DEFAULT_LOGICAL_AXIS_RULES` by default):

    dim i  → "model"   for the first dim whose logical name the rules map to
                       ``"model"`` and whose size tp divides
    dim i  → None      otherwise (replicated over "data": plain data parallelism)

which is Megatron's column/row split for the recipes' kernels; it is
:func:`orchestrator.costs.logical_to_mesh_axes`, the rule the cost model prices. Optimizer-state
leaves whose key path ends with a parameter's key path and have its shape
(AdamW's ``mu``, ``nu``) follow that parameter; with ``zero=True`` (ZeRO-1) they are
additionally split over ``"data"`` on their first free dimension that dp divides, or, where dp
divides no dimension tensor parallelism leaves whole (a column-parallel bias), over
``("model", "data")`` on the first split one that tp·dp divides; on a context-parallel stage over
``("data", "context")`` alike, the dp·cp ranks that hold the same parameters (as the cost model
prices the moments, and as Megatron's distributed optimizer shards over its data × context group). On a stage whose plan says
``fsdp`` (ZeRO-3) the parameters are split the same way too: each is stored 1/dp per replica, as the cost model
prices it. In a one-stage plan XLA's partitioner all-gathers a parameter where a matmul reads it
and reduce-scatters its gradient (on XLA:CPU an all-reduce of the gradient sliced to the
replica's shard, the same operand bytes); a pipeline stage gathers its parameters once a step
(:mod:`integrations.flax._pipeline`). Every other leaf (step counters) is replicated on the
first stage's mesh. A batch is split over ``"data"`` on its first dimension.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from integrations.flax._capture import is_param_path, param_path_name
from integrations.flax._stages import chunk_layers
from orchestrator.costs import MODEL_AXIS, LogicalAxisRules, logical_to_mesh_axes

DATA, CONTEXT, MODEL = "data", "context", MODEL_AXIS


def device_map(cluster=None) -> dict[str, jax.Device]:
    """Device ref (``host/index``) → jax device.

    With a cluster, its in-service devices are matched to ``jax.devices()`` in
    order (the ``local`` cluster is built from ``jax.devices()``, so ref
    ``localhost/i`` is ``jax.devices()[i]``). Without one, ``<anything>/i`` is
    ``jax.devices()[i]``.

    Raises:
      ValueError: the cluster has a different number of devices than jax sees.
    """
    devices = jax.devices()
    if cluster is None:
        return {f"localhost/{i}": d for i, d in enumerate(devices)}
    refs = [d.ref for d in cluster.all_devices()]
    if len(refs) != len(devices):
        how = (
            f"; on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={len(refs)} before jax starts"
            if devices[0].platform == "cpu"
            else ""
        )
        raise ValueError(
            f"cluster {cluster.name!r} has {len(refs)} devices but jax sees {len(devices)}; "
            f"plan for load_cluster('local') or start jax with as many devices{how}"
        )
    return dict(zip(refs, devices))


def _lookup(devices: Mapping[str, jax.Device], ref: str) -> jax.Device:
    if ref in devices:
        return devices[ref]
    index = ref.rsplit("/", 1)[-1]
    if index.isdigit() and int(index) < len(jax.devices()) and not any(r.endswith(f"/{index}") for r in devices):
        return jax.devices()[int(index)]
    raise ValueError(f"plan names device {ref!r}, which is not among this process's devices ({len(devices)} known)")


def stage_mesh(stage, devices: Mapping[str, jax.Device] | None = None) -> Mesh:
    """The ``(dp, tp)`` mesh ``("data", "model")`` over a stage's devices, in the plan's order.

    Raises:
      ValueError: the stage lists a different number of devices than tp·dp.
    """
    devices = devices if devices is not None else device_map()
    if len(stage.devices) != stage.tp * stage.dp:
        raise ValueError(f"stage has {len(stage.devices)} devices but tp·dp = {stage.tp}·{stage.dp}")
    grid = np.array([_lookup(devices, r) for r in stage.devices], dtype=object).reshape(stage.dp, stage.tp)
    return Mesh(grid, (DATA, MODEL))


def param_spec(
    shape: Sequence[int],
    axes: Sequence[str | None] | None,
    tp: int,
    axis_rules: LogicalAxisRules | None = None,
) -> P:
    """The PartitionSpec of one parameter under tensor-parallel degree ``tp`` (see module docstring)."""
    return P(*logical_to_mesh_axes(shape, axes, tp, axis_rules))


def stored_spec(
    stage,
    shape: Sequence[int],
    axes: Sequence[str | None] | None,
    axis_rules: LogicalAxisRules | None = None,
    *,
    moment: bool = False,
    zero: bool = False,
) -> P:
    """The PartitionSpec a parameter (or, ``moment``, one of its optimizer moments) is stored with
    on ``stage``'s mesh: its tensor-parallel spec, split over ``"data"`` too where the stage says
    ``fsdp`` or, for a moment, ``zero`` (see module docstring)."""
    spec = param_spec(shape, axes, stage.tp, axis_rules)
    replicas = stage.dp * stage.cp  # (the ranks holding the same parameters: a ring's too)
    if (stage.fsdp or (moment and (zero or stage.zero))) and replicas > 1:
        over = (DATA, CONTEXT) if stage.cp > 1 else (DATA,)
        spec = _zero_spec(spec, shape, replicas, stage.tp, over)
    return spec


def _zero_spec(spec: P, shape: Sequence[int], replicas: int, tp: int, over: tuple[str, ...]) -> P:
    entries = list(spec) + [None] * (len(shape) - len(spec))
    split = over[0] if len(over) == 1 else over
    for i, (entry, size) in enumerate(zip(entries, shape)):
        if entry is None and size % replicas == 0:
            entries[i] = split
            return P(*entries)
    # the replicas divide no dim tensor parallelism leaves whole (a column-parallel bias): split a split one further
    for i, (entry, size) in enumerate(zip(entries, shape)):
        if entry == MODEL and size % (tp * replicas) == 0:
            entries[i] = (MODEL, *over)
            return P(*entries)
    return spec


def _names(path) -> tuple[str, ...]:
    from integrations.flax._capture import _key_name

    return tuple(_key_name(k) for k in path)


def leaf_params(state) -> list[tuple[str | None, bool]]:
    """Per leaf of ``state``: (the parameter path it belongs to or None, whether it is that parameter).

    A parameter belongs to itself; an optimizer-state leaf belongs to the
    parameter whose key path (below ``params``, or that path without its
    leading names) is the longest suffix of its own and whose shape it has
    (AdamW's ``mu``/``nu``); anything else to none.
    """
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    params = {}  # key names below "params" → (path string, shape)
    for path, leaf in leaves:
        if is_param_path(path):
            name = param_path_name(path)
            params[tuple(name.split("/"))] = (name, tuple(leaf.shape))
    out = []
    for path, leaf in leaves:
        if is_param_path(path):
            out.append((param_path_name(path), True))
            continue
        names = _names(path)
        best = None
        for full, (name, shape) in params.items():
            # the whole key, or (nnx: ``0/a/kernel/value``) the key without leading containers, ≥ 2 names
            for key in (full[i:] for i in range(max(1, len(full) - 1))):
                if len(names) > len(key) and names[-len(key) :] == key and shape == tuple(leaf.shape):
                    if best is None or len(key) > len(best[0]):
                        best = (key, name)
        out.append((None if best is None else best[1], False))
    return out


def param_owners(plan, layers) -> dict[str, int]:
    """Parameter path → index of the stage that owns it (holds the layer that first reads it; under
    virtual stages, in the chunk of that layer: :func:`~integrations.flax._stages.chunk_layers`)."""
    owners = {}
    for k, chunk in enumerate(chunk_layers(plan, layers)):
        for index in chunk:
            for path in layers[index].params:
                owners[path] = k % len(plan.stages)
    return owners


def state_shardings(
    plan,
    state,
    *,
    param_axes: Mapping[str, Sequence[str | None]] | None = None,
    owners: Mapping[str, int] | None = None,
    cluster=None,
    zero: bool = False,
    axis_rules: LogicalAxisRules | None = None,
    meshes: Sequence[Mesh] | None = None,
):
    """A pytree of ``NamedSharding`` mirroring ``state`` (see module docstring).

    Args:
      plan: the plan; stage ``s`` runs on ``stage_mesh(plan.stages[s])``.
      state: a TrainState (arrays or ``ShapeDtypeStruct``s) or any pytree with parameters under ``params``.
      param_axes: logical axis names by parameter path (:func:`param_logical_axes`); none → TP shards nothing.
      owners: parameter path → stage; required when the plan has several stages.
      cluster: resolves device refs (:func:`device_map`).
      zero: shard optimizer moments over ``"data"`` too (a stage whose plan says ``zero`` does anyway).
      axis_rules: ``(logical axis name, mesh axis or None)`` pairs; the cost model's default if not given.
      meshes: each stage's mesh (default: :func:`stage_mesh`; a context-parallel stage's has a
        ``"context"`` axis too, over which the state is replicated).

    Raises:
      ValueError: a multi-stage plan without ``owners``, or a parameter no stage owns.
    """
    if meshes is None:
        devices = device_map(cluster)
        meshes = [stage_mesh(s, devices) for s in plan.stages]
    if len(plan.stages) > 1 and owners is None:
        raise ValueError("a multi-stage plan needs owners= (parameter path → stage; see param_owners)")
    param_axes = param_axes or {}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    belongs = leaf_params(state)

    def owner_of(name: str) -> int:
        if owners is None:
            return 0
        if name not in owners:
            raise ValueError(f"parameter {name!r} belongs to no stage of the plan")
        return owners[name]

    def param_sharding(name: str, shape, *, moment: bool) -> NamedSharding:
        s = owner_of(name)
        spec = stored_spec(plan.stages[s], shape, param_axes.get(name), axis_rules, moment=moment, zero=zero)
        return NamedSharding(meshes[s], spec)

    out = []
    for (_, leaf), (name, is_param) in zip(leaves, belongs):
        if name is None:
            out.append(NamedSharding(meshes[0], P()))
        else:
            out.append(param_sharding(name, leaf.shape, moment=not is_param))
    return jax.tree_util.tree_unflatten(treedef, out)


def batch_sharding(batch, mesh: Mesh):
    """Each batch leaf split over ``"data"`` on its first dimension (replicated if dp does not divide it)."""
    dp = mesh.shape[DATA]

    def one(leaf):
        shape = np.shape(leaf)
        return NamedSharding(mesh, P(DATA) if shape and shape[0] % dp == 0 else P())

    return jax.tree.map(one, batch)


def shard(
    plan,
    state,
    *,
    param_axes=None,
    layers=None,
    cluster=None,
    zero: bool = False,
    axis_rules: LogicalAxisRules | None = None,
):
    """``state`` as ``jax.Array``s placed per ``plan`` (see module docstring).

    Args:
      plan: an :class:`~orchestrator.planner.Plan`.
      state: the TrainState (concrete arrays).
      param_axes: logical axis names by parameter path; enables tensor parallelism.
      layers: the coarsened layers the plan's stages index (needed for several stages).
      cluster: the cluster the plan was made for (resolves device refs).
      zero: ZeRO-1 — optimizer moments also split over ``"data"`` (on every stage; a stage whose
        plan says ``zero`` is split without it).
      axis_rules: ``(logical axis name, mesh axis or None)`` pairs, as the plan was priced with
        (:data:`orchestrator.costs.DEFAULT_LOGICAL_AXIS_RULES` by default).

    Returns:
      The same pytree with every leaf a ``jax.Array`` carrying its ``NamedSharding``.

    Example:
      >>> sharded = shard(plan, state, param_axes=recipe.param_axes())  # doctest: +SKIP
    """
    meshes = None
    if any(stage.cp > 1 for stage in plan.stages):  # the sequence split: replicated over "context" (_context)
        from integrations.flax._context import stage_context_mesh

        devices = device_map(cluster)
        meshes = [
            stage_context_mesh(stage, devices, cluster) if stage.cp > 1 else stage_mesh(stage, devices)
            for stage in plan.stages
        ]
    owners = param_owners(plan, layers) if layers is not None else None
    shardings = state_shardings(
        plan,
        state,
        param_axes=param_axes,
        owners=owners,
        cluster=cluster,
        zero=zero,
        axis_rules=axis_rules,
        meshes=meshes,
    )
    # The compiled step donates the placed state: copy, so the caller's arrays survive.
    placed = jax.device_put(state, shardings, may_alias=False)
    return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, placed)
