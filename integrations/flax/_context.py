"""Context parallelism: a Flax train step whose sequences are split over devices, attention run as ring attention.

Each sequence of the batch is stored in the zigzag layout (``conductor.kernels.ring.to_layout``:
2n chunks, device r holding chunks r and 2n−1−r, which balances a causal mask) and sharded over
the mesh axis ``"context"``, whose device order is the ring order; the batch is split over
``"data"`` as usual, and the heads over ``"model"`` under tensor parallelism: the state is placed
as :mod:`integrations.flax._shard` places a tensor-parallel stage's (Megatron's column/row split
over ``"model"``), replicated over ``"data"`` and ``"context"``. Everything that works token by token —
embeddings, norms, MLPs, the residual stream, the loss (a mean over tokens, which no permutation
changes) — runs on the permuted sequence unchanged, XLA's SPMD partitioner splitting it along the
sequence. Two things read the order, and both are intercepted (``flax.linen.intercept_methods``)
while the step is traced:

    positions        an ``nn.Embed`` looked up at a vector of indices, one per place of the sequence
                     and shared by the batch (learned positions, ``wpe(arange(T))``), is looked up at
                     that vector in layout order instead (``layout_positions``); a module method
                     ``positions(seq)`` (rotary embeddings read it: ``recipes.gpt``'s Llama attention)
                     returns the layout's positions;
    core attention   a module method ``core_attention(q, k, v)``, causal softmax(QKᵀ/√d) V over
                     (batch, seq, heads, head_dim) arrays (``recipes.gpt.CausalSelfAttention`` has
                     one), runs as ring or all-gather attention (``conductor.kernels.ring``) under
                     ``jax.shard_map`` over the three axes (each device its samples, its tokens and,
                     under tensor parallelism, its heads: attention is head by head), K/V blocks
                     passed around the ring while each block computes.

A model with a selective scan (``recipes.mamba.Mixer``) keeps each sequence contiguous instead: the
scan's recurrence runs in token order, and a scan has no causal imbalance to even out. Its method

    core scan        ``core_scan(Δ, A, Δ ⊙ x, B, C)`` with (batch, seq, ·) arrays runs as the
                     sequence-sharded scan (``conductor.kernels.scan.sequence_sharded_scan_shard``)
                     under ``jax.shard_map`` over the two axes: each device scans its slice, one
                     all-gather passes the carry (the earlier slices' final states) forward, its
                     transpose passes the carry's gradient back;

the causal convolution before it reads the previous slice's last tokens through XLA's SPMD
partitioner (a halo exchange), as any shifted read along a sharded axis.

The form (ring or all-gather) is the cost model's choice (``orchestrator.costs.context_parallel_cost``,
recorded in a plan as ``Stage.cp_form``), passed in as ``form``.

Example:
    >>> mesh = context_mesh(jax.devices()[:8], context_parallel=4)  # doctest: +SKIP
    >>> step = context_parallel_step(recipe.train_step, mesh)  # doctest: +SKIP
    >>> state, metrics = step(replicate(state, mesh), context_batch(batch, mesh))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conductor.kernels import AttentionBlockSizes
from conductor.kernels.ring import Form, Layout, layout_positions, ring_attention, to_layout
from conductor.kernels.scan import ScanBlockSizes, sequence_sharded_scan
from integrations.flax._shard import CONTEXT, DATA, MODEL
from orchestrator.cluster import ring_order

CORE_ATTENTION, POSITIONS, CORE_SCAN = "core_attention", "positions", "core_scan"


def context_mesh(devices: Sequence, *, context_parallel: int, tensor_parallel: int = 1) -> Mesh:
    """The ``("data", "context", "model")`` mesh of ``devices``, replica-major: replica r is
    ``devices[r·n·t:(r+1)·n·t]`` (n = ``context_parallel``, t = ``tensor_parallel``), its ring
    position i the t devices ``i·t:(i+1)·t`` of it, the tensor-parallel ranks innermost (give each
    replica's positions in ring order: ``orchestrator.cluster.ring_order``)."""
    n, t = context_parallel, tensor_parallel
    if n < 1 or t < 1 or len(devices) % (n * t):
        how = f"rings of {n}" + (f" × tensor-parallel groups of {t}" if t > 1 else "")
        raise ValueError(f"{len(devices)} devices do not split into context-parallel {how}")
    grid = np.array(devices, dtype=object).reshape(len(devices) // (n * t), n, t)
    return Mesh(grid, (DATA, CONTEXT, MODEL))


def stage_context_mesh(stage, devices: Mapping[str, jax.Device], cluster=None) -> Mesh:
    """The :func:`context_mesh` of a plan's single-device-type stage with ``stage.cp`` > 1: its
    devices (refs looked up in ``devices``, ``device_map``), each replica's ring positions (its
    runs of ``stage.tp`` devices) in ring order on ``cluster`` (``orchestrator.cluster.ring_order``
    of each position's first device) when given."""
    refs, t, n = list(stage.devices), stage.tp, stage.cp
    if cluster is not None:
        by_ref = {d.ref: d for d in cluster.all_devices()}
        ordered = []
        for r in range(len(refs) // (n * t)):
            positions = [refs[(r * n + i) * t : (r * n + i + 1) * t] for i in range(n)]
            by_first = {position[0]: position for position in positions}
            ring = ring_order(cluster, [by_ref[position[0]] for position in positions])
            ordered += [ref for device in ring for ref in by_first[device.ref]]
        refs = ordered
    return context_mesh([devices[ref] for ref in refs], context_parallel=n, tensor_parallel=t)


def replicate(state, mesh: Mesh):
    """``state`` placed whole on every device of ``mesh`` (a copy: the step donates its state, and
    a placement may alias the caller's buffers)."""
    return jax.device_put(jax.tree.map(jnp.copy, state), NamedSharding(mesh, P()))


def context_batch(batch, mesh: Mesh, *, layout: Layout = "zigzag"):
    """Every (batch, seq) leaf of ``batch`` in natural order, reordered into ``layout`` over the
    mesh's ring and placed with its batch over ``"data"`` and its sequence over ``"context"``.

    Tokens and targets follow the same permutation, so each target still sits beside its input.
    """
    n = mesh.shape[CONTEXT]

    def place(leaf):
        leaf = to_layout(jnp.asarray(leaf), n, layout)
        return jax.device_put(leaf, NamedSharding(mesh, P(DATA, CONTEXT)))

    return jax.tree.map(place, batch)


def context_parallel_step(
    train_step: Callable,
    mesh: Mesh,
    *,
    form: Form = "ring",
    layout: Layout = "zigzag",
    causal: bool = True,
    block_sizes: AttentionBlockSizes | None = None,
    scan_block_sizes: ScanBlockSizes | None = None,
    state_shardings=None,
) -> Callable:
    """``train_step`` jitted to run on sequences split over ``mesh``'s ``"context"`` axis.

    Args:
      train_step: ``train_step(state, batch) -> (state, metrics)`` of a Flax model whose attention
        modules name their ``core_attention`` (module docstring).
      mesh: a :func:`context_mesh`.
      form: ``"ring"`` or ``"all_gather"`` attention.
      layout: how each sequence is stored; the batch must be in it (:func:`context_batch`).
      causal: whether ``core_attention`` masks later keys.
      block_sizes: tile lengths inside each chunk (default: the kernels' own, capped at the chunk).
      scan_block_sizes: the sequence-sharded scan's chunk (divides each device's slice; default:
        the kernel's own, capped at the slice). A model with a ``core_scan`` needs ``layout="contiguous"``
        (:func:`model_layout`).
      state_shardings: the state's shardings, kept by the step (default: as XLA propagates them).
    Returns:
      ``step(state, batch) -> (state, metrics)`` for a state placed on ``mesh`` (:func:`replicate`,
      or ``integrations.flax.shard`` under tensor parallelism) and a :func:`context_batch`-placed batch.
    """
    n, t = mesh.shape[CONTEXT], mesh.shape[MODEL]

    def interceptor(next_fun, args, kwargs, context):
        if isinstance(context.module, nn.Embed) and context.method_name == "__call__" and jnp.ndim(args[0]) == 1:
            (indices,) = args  # (seq,): one per place of the sequence, the batch's tokens being (batch, seq)
            return next_fun(jnp.take(indices, layout_positions(indices.shape[0], n, layout)), **kwargs)
        if context.method_name == POSITIONS and len(args) == 1 and isinstance(args[0], int):
            return jnp.asarray(layout_positions(args[0], n, layout))
        if context.method_name == CORE_ATTENTION:
            q, k, v = args
            heads = MODEL if t > 1 and q.shape[2] % t == 0 and k.shape[2] % t == 0 else None
            return ring_attention(
                q,
                k,
                v,
                mesh=mesh,
                axis_name=CONTEXT,
                batch_axis=DATA,
                head_axis=heads,
                causal=causal,
                layout=layout,
                form=form,
                block_sizes=block_sizes,
            )
        if context.method_name == CORE_SCAN:
            if layout != "contiguous":
                raise ValueError(f"a scan runs on contiguous slices of the sequence; got layout={layout!r}")
            return sequence_sharded_scan(
                *args, mesh=mesh, axis_name=CONTEXT, batch_axis=DATA, block_sizes=scan_block_sizes
            )
        return next_fun(*args, **kwargs)

    def step(state, batch):
        with nn.intercept_methods(interceptor):
            return train_step(state, batch)

    if state_shardings is None:
        return jax.jit(step, donate_argnums=(0,))
    return jax.jit(step, out_shardings=(state_shardings, NamedSharding(mesh, P())), donate_argnums=(0,))


def model_layout(train_step: Callable, state, batch) -> Layout:
    """``"contiguous"`` if ``train_step``'s model has a ``core_scan`` (its recurrence runs in token
    order), else ``"zigzag"`` (which balances causal attention); read from one abstract trace."""
    methods = set()

    def record(next_fun, args, kwargs, context):
        methods.add(context.method_name)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(train_step, state, batch)
    return "contiguous" if CORE_SCAN in methods else "zigzag"


class ContextParallelStep:
    """``step(state, batch) -> (state, metrics)`` for a plan whose one stage splits sequences (``cp`` > 1).

    Takes batches in natural order (it permutes them into the layout) and a state placed by
    :meth:`place` (or ``integrations.flax.shard``): split over ``"model"`` as tensor parallelism
    splits it, replicated over ``"data"`` and ``"context"``.

    Args:
      plan: a one-stage plan with ``cp`` > 1.
      train_step: as for :func:`context_parallel_step`.
      cluster: the cluster the plan was made for (device refs, ring order); None: the local devices.
      form: ``"ring"`` or ``"all_gather"``; None: the plan's (``Stage.cp_form``, the cost model's
        choice), else the ring.
      param_axes, axis_rules, zero: as for ``integrations.flax.shard`` (tensor parallelism, ZeRO-1).
    Raises:
      ValueError: a plan of several stages, or a stage without context parallelism or with FSDP.
    """

    def __init__(
        self,
        plan,
        train_step: Callable,
        *,
        cluster=None,
        form: Form | None = None,
        param_axes=None,
        axis_rules=None,
        zero: bool = False,
    ):
        from integrations.flax._shard import device_map

        if len(plan.stages) != 1 or plan.stages[0].cp < 2:
            raise ValueError("the context-parallel step runs a plan of one stage with cp > 1")
        if plan.stages[0].fsdp:
            raise ValueError("the context-parallel step keeps the parameters whole: plan it without fsdp")
        self.plan, self.train_step, self.cluster = plan, train_step, cluster
        self.param_axes, self.axis_rules, self.zero = param_axes, axis_rules, zero
        self.mesh = stage_context_mesh(plan.stages[0], device_map(cluster), cluster)
        self.form = form or plan.stages[0].cp_form or "ring"
        self.layout: Layout | None = None  # the model's (:func:`model_layout`), read at the first batch
        self.fn: Callable | None = None

    def place(self, state):
        """``state`` placed on the stage's mesh as ``integrations.flax.shard`` places it (a copy: the
        step donates it)."""
        from integrations.flax._shard import shard

        return shard(
            self.plan,
            state,
            param_axes=self.param_axes,
            cluster=self.cluster,
            zero=self.zero,
            axis_rules=self.axis_rules,
        )

    def compile_for(self, state, batch) -> Callable:
        """The jitted step for batches like ``batch`` (natural order), built once: the layout follows
        the model, and the step keeps ``state``'s shardings."""
        if self.fn is None:
            self.layout = model_layout(self.train_step, state, batch)
            shardings = jax.tree.map(lambda x: x.sharding, state)
            self.fn = context_parallel_step(
                self.train_step, self.mesh, form=self.form, layout=self.layout, state_shardings=shardings
            )
        return self.fn

    def __call__(self, state, batch):
        fn = self.compile_for(state, batch)
        return fn(state, context_batch(batch, self.mesh, layout=self.layout))
