"""Per-layer costs: time, memory and communication for each device type and parallel configuration.

For layer ℓ captured with batch B, run with microbatch m on a device of type d
under tensor-parallel degree t and data-parallel degree p (see ``_sharding``
for which ops tensor parallelism splits, ``_liveness`` for activation memory):

    time_phase(ℓ, d)  = Σ_{op ∈ ℓ, phase} t_d(op) · (1/t if op is split) · (m/B if op works on the batch)
    backward          += forward  when the layer recomputes its forward pass
                      += forward of its core attention under selective recompute (``_recompute``)
    TP communication  = Σ_{all-reduced op ∈ ℓ} AR(bytes(op) · m/B, t)       (forward again under recompute)
    context parallel  = under degree n (``ParallelConfig.context_parallel``) each device holds T/n of every
                        sequence: every op working on the batch does the work of m/n samples, keeps m/n samples'
                        activations and sends m/n samples' output; the attention's T × T work runs as the
                        ring's blockwise kernels instead, the tiles a causal mask keeps (``_context``);
                        attention layers pass K/V around the ring
                        and expose what the block computation does not hide (``_context``); the gathered
                        or arriving K/V blocks add to the transient memory; a layer with a sequential
                        scan over the sequence (``scan_state``) passes its carry instead, all-gathered
                        forward and reduce-scattered backward, exposed whole
    DP gradient sync  = AR(G, p)  or  RS(G, p) + AG(P, p)   with G = local gradient bytes, one per
                        contribution (a tied parameter read by two layers counts in both; a table read at
                        batch-independent rows only those rows, see ``_gradients``), P = parameters
                        (in the dtype the forward casts them to under ``weights_once``); p = dp·n, since the
                        n context-parallel ranks hold the same parameters and reduce their gradients too
    parameters        = Σ_params bytes · (1/t if TP-sharded);   gradients the same
    optimizer state   = parameters · (optimizer bytes / parameter bytes) · (1/p under ZeRO, p = dp·n)
    under weights_once (a mixed-precision optimizer, as Megatron-LM's): the parameters held are the
                        compute-dtype copy the forward reads (bf16: 2 bytes each), the float32
                        masters of the cast ones join the optimizer state (split 1/p under ZeRO
                        with it), gradients stay float32: 2 + 4 + 12 bytes per bf16-cast
                        parameter under Adam, 2 + 4 + 12/p under ZeRO-1
    activations       = bytes live at the forward→backward boundary, per in-flight microbatch
                        (only the layer's input under recompute, 1/t of it under SP; without the core attention's
                        values under selective recompute; under weights_once without values
                        computed from parameters alone, which are the step's one compute copy)
    transient         = peak of the layer's own forward+backward temporaries (its outputs apart) minus the above
                        (on CPU clusters, ``shared_cores`` set, with XLA:CPU's YNNPACK size rule; on
                        the others with XLA:GPU's fusion rules, ``_liveness``)

An op works on the batch if its output depends on it or it reads a value that
does: a weight gradient x^T·dy has a parameter's shape, but its FLOPs grow with
the batch it contracts over, so a block's backward costs about twice its
forward at any microbatch. Memory scales by the first only: a weight
gradient's buffer is one parameter's size at any batch.

Identical layers (same signature) share every entry: costs are cached by
(signature, device type, configuration, links).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Literal

from orchestrator.cluster import Cluster, Link
from orchestrator.coarsen import LayerGraph
from orchestrator.costs import _collectives as coll
from orchestrator.costs._context import (
    BACKWARD_RATIO,
    ContextParallelChoice,
    Form,
    blockwise_attention_s,
    context_parallel_cost,
    ring_attention_work,
    scan_carry_cost,
    square_ops,
    unmaterialized_ops,
)
from orchestrator.costs._gradients import batch_independent_ops, synced_gradient_bytes
from orchestrator.costs._liveness import YNN_MIN_ELEMENTS, liveness, traffic_bytes
from orchestrator.costs._recompute import AttentionCore, attention_core
from orchestrator.costs._roofline import Efficiency, op_time_s
from orchestrator.costs._sharding import (
    DEFAULT_LOGICAL_AXIS_RULES,
    LogicalAxisRules,
    TensorParallelTraits,
    tensor_parallel_axes,
    tensor_parallel_traits,
)
from orchestrator.graph import OpGraph, dtype_itemsize

DataParallelSync = Literal["all_reduce", "reduce_scatter"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    """How one layer (or stage) runs: tensor/data-parallel degrees, microbatch, recompute, ZeRO.

    ``accumulate_gradients``: the stage sums its gradients over microbatches
    into full-size buffers and syncs those (as the pipeline executor does);
    otherwise the sync reads the backward pass's own gradients, and a table
    read at batch-independent rows syncs only those rows (``_gradients``).

    ``sequence_parallel``: under TP, the work tensor parallelism leaves replicated on the batch
    (LayerNorms, residual adds, dropout) splits over the TP ranks along the sequence, and each
    all-reduce becomes a reduce-scatter and an all-gather of the same ring bytes (Korthikanti et
    al., 2022); the gradients of the parameters that work reads (LayerNorm scales) are then
    partial per rank and all-reduced over the TP group (``sequence_parallel_grad_bytes``).

    ``selective_recompute``: the backward pass rebuilds the layer's core attention (scores, mask,
    softmax, product with V; ``_recompute``) instead of keeping it (Korthikanti et al., 2022, §4);
    ``recompute`` (the whole forward) takes precedence.

    ``overlap_param_gather``: under ZeRO (or a reduce-scatter sync), each layer's parameter
    all-gather runs while the next step's first microbatch computes the layers before it
    (Megatron-Core's ``--overlap-param-gather``): only the part longer than the layer's own
    forward is exposed.

    ``fsdp``: ZeRO-3 (fully sharded data parallelism): parameters, gradients and optimizer state
    are all split over the data-parallel replicas; each layer's parameters are all-gathered where
    it runs and its gradients reduce-scattered, so the sync is priced as under ``zero``, the
    stored state is 1/p, and the gathered parameters and full-size gradients are transient.

    ``context_parallel``: n, the devices each sequence is split over (the zigzag layout, attention
    as ring or all-gather attention, ``_context``); the group holds tp·n·dp devices, the n ranks of
    a replica the same parameters and samples.
    """

    tp: int = 1
    dp: int = 1
    microbatch_size: int = 1
    recompute: bool = False
    zero: bool = False
    dp_sync: DataParallelSync = "all_reduce"
    accumulate_gradients: bool = False
    sequence_parallel: bool = False
    selective_recompute: bool = False
    overlap_param_gather: bool = False
    fsdp: bool = False
    context_parallel: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "microbatch_size", "context_parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelConfig.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerCost:
    """Costs of one layer on one device of a given type under one configuration (per microbatch)."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    tp_comm_s: float
    dp_sync_s: float
    tp_allreduce_bytes: float  # per device per microbatch, forward + backward
    dp_sync_bytes: float  # local gradient bytes synchronised per step
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float  # kept per in-flight microbatch
    transient_bytes: float
    output_activation_bytes: float  # sent to the next layer per microbatch
    # of forward_s + backward_s, the part that does not shrink with the microbatch or the TP degree
    # (measured per-call and per-op costs, ``LayerTiming.forward_fixed_s``); 0 where not measured
    fixed_s: float = 0.0
    # context parallelism's exposed K/V communication (forward + backward) and the form it runs in
    cp_comm_s: float = 0.0
    cp_form: Form | None = None
    breakdown: Mapping[str, float] = field(default_factory=dict)

    def memory_bytes(self, in_flight_microbatches: int = 1) -> float:
        """Per-device memory with ``in_flight_microbatches`` activations kept."""
        static = self.param_bytes + self.grad_bytes + self.optimizer_bytes
        return static + self.activation_bytes * in_flight_microbatches + self.transient_bytes


class CostModel:
    """Costs every layer of a captured step on every device type of a cluster.

    Args:
      graph: the captured training step.
      layers: its layers (:func:`orchestrator.coarsen.coarsen`).
      cluster: device types and links.
      batch_size: samples in the captured step (what ``m / B`` scales by).
      param_axes: logical axis names per parameter path (enables TP > 1).
      axis_rules: ``(logical axis name, mesh axis or None)`` pairs that say which
        parameter dims the tensor-parallel mesh axis ``"model"`` splits
        (:data:`~orchestrator.costs.DEFAULT_LOGICAL_AXIS_RULES` if None); the
        executors must run with the same rules.
      efficiency: per device type.
      default_efficiency: for device types not in ``efficiency`` (for example
        the local device's calibrated one, to project absent types by their
        datasheet peaks); :class:`Efficiency`'s defaults if None.
      measured: layer timings by signature (:mod:`orchestrator.profile`). For
        the device type they were measured on, a layer's time is the measured
        one, scaled from the profiled batch to the configuration by the
        model's own ratio x = modelled(config) / modelled(profile); other types
        are projected. Where a timing has a fixed part f (measured at smaller
        batches), t(config) is the piecewise-linear curve through (0, f), each
        smaller batch's (batch / profiled batch, time) and (1, t), read at x
        (its last piece extended beyond 1); without one, t(config) = t · x.
      measured_batch_size: the batch the timings were measured with.
      weights_once: price the work on parameters alone in the forward and backward passes (casting
        float32 weights to the bf16 compute dtype, transposing a tied table) once per step, in
        ``optimizer_s``, as Megatron-LM runs it (its mixed-precision optimizer refreshes a bf16 copy
        of the weights after each update) and as XLA runs a gradient-accumulation loop (it hoists
        loop-invariant casts out of the loop). The ZeRO parameter all-gather then moves that
        compute-dtype copy, as Megatron-LM's distributed optimizer does. False (the default): once
        per microbatch, as the per-microbatch stage programs of ``integrations.flax.Pipeline`` run
        it. A measured layer's forward and backward keep their measured times either way.
        Memory follows the same split: the compute-dtype copy is held once per step (not once
        per in-flight microbatch), the float32 masters are optimizer state (module docstring).
      shard_grad_op: data parallelism under ZeRO as PyTorch FSDP's ``SHARD_GRAD_OP`` runs it,
        Llama 3's (arXiv:2407.21783, §3.3.2: optimizer states and gradients sharded, parameters
        not resharded after the forward): every microbatch all-gathers each layer's parameters
        before its forward and reduce-scatters its gradients after its backward, in the gradients'
        stored dtype (float32 parameters: float32, as Llama 3 reduce-scatters them), into a
        1/p shard (PyTorch's ``ShardingStrategy.SHARD_GRAD_OP``, torch/distributed/fsdp/api.py at
        acd8c9e7d691ee02408b5c0bb3e072fcb6705c13: it unshards the parameters before the forward
        and reshards them after the backward, and reduce-scatters the gradients after it).
        The gather runs beside the layer's forward and the reduce-scatter beside its backward
        (FSDP prefetches one and reduces the other asynchronously): the part of either longer than
        the phase's own work is exposed, per microbatch, in ``forward_s`` and ``backward_s``, and
        nothing is left to sync per step. Gradients are held as the 1/p shard, plus the layer's
        full-size gradient while its backward runs; the gathered parameters are held whole.
    """

    def __init__(
        self,
        graph: OpGraph,
        layers: LayerGraph,
        cluster: Cluster,
        *,
        batch_size: int,
        param_axes: Mapping[str, Sequence[str | None]] | None = None,
        axis_rules: LogicalAxisRules | None = None,
        efficiency: Mapping[str, Efficiency] | None = None,
        default_efficiency: Efficiency | None = None,
        measured: Mapping[str, object] | None = None,
        measured_batch_size: int | None = None,
        weights_once: bool = False,
        shard_grad_op: bool = False,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.graph, self.layers, self.cluster = graph, layers, cluster
        self.batch_size = batch_size
        self.efficiency = dict(efficiency or {})
        self.default_efficiency = default_efficiency or Efficiency()
        self.measured = dict(measured or {})
        self.measured_batch_size = measured_batch_size or batch_size
        self.weights_once = weights_once
        self.shard_grad_op = shard_grad_op
        self.param_axes = dict(param_axes or {})
        self.axis_rules = tuple(axis_rules) if axis_rules is not None else DEFAULT_LOGICAL_AXIS_RULES
        tensor_parallel_axes(self.axis_rules)  # a malformed table fails here, not at the first priced layer
        self._op_traits: dict = {}  # the ops' tensor-parallel tags per parameters' tags (graph-derived)
        self.traits = tensor_parallel_traits(graph, self.param_axes, self.axis_rules, cache=self._op_traits)
        self.tensor_parallel = bool(param_axes)
        self._constant_ops = batch_independent_ops(graph)
        param_shapes = {spec.shape for spec in graph.params.values()}
        self._batch_dependent = {
            op.name: op.phase != "optimizer"
            and not self.traits.is_param_derived(op.name)
            and op.outputs[:1] != ()
            and op.outputs[0].shape not in param_shapes
            for op in graph.ops()
        }
        # work that grows with the microbatch: batch-dependent outputs, and ops reading them
        self._batch_work = {
            op.name: op.phase != "optimizer"
            and (
                self._batch_dependent[op.name] or any(self._batch_dependent[p] for p in graph.nx.predecessors(op.name))
            )
            for op in graph.ops()
        }
        self.traffic = traffic_bytes(graph)
        opt_bytes = float(graph.meta.get("optimizer_state_bytes", 0))
        self.optimizer_ratio = opt_bytes / graph.param_bytes if graph.param_bytes else 0.0
        # memo tables: what depends on the graph alone (shared by ``with_cluster`` copies), and
        # op times, which also depend on the device types
        self._graph_memo: dict = {}
        self._time_memo: dict = {}

    def with_cluster(self, cluster: Cluster) -> CostModel:
        """This model on another cluster (devices lost or added, links changed), sharing every
        graph-derived table, so re-planning does not redo them (seconds on a large model). Op times
        are shared too while the device types are unchanged."""
        other = copy.copy(self)
        other.cluster = cluster
        if cluster.device_types != self.cluster.device_types:
            other._time_memo = {}
        return other

    def _memo(self, table: dict, key, compute):
        if key not in table:
            table[key] = compute()
        return table[key]

    # -- helpers ------------------------------------------------------------
    def efficiency_of(self, device_type: str) -> Efficiency:
        return self.efficiency.get(device_type, self.default_efficiency)

    def default_link(self, device_type: str) -> Link:
        for host in self.cluster.hosts:
            if host.device_type == device_type:
                return host.intra_link
        raise KeyError(f"no host of device type {device_type!r} in cluster {self.cluster.name!r}")

    def traits_for(self, tp: int) -> TensorParallelTraits:
        """Tensor-parallel tags under degree ``tp``: a dim tp does not divide stays replicated."""
        return self._memo(
            self._graph_memo,
            ("traits", tp),
            lambda: tensor_parallel_traits(self.graph, self.param_axes, self.axis_rules, tp, cache=self._op_traits),
        )

    def _scale(self, name: str, tp: int, microbatch: float, sp: bool = False) -> float:
        traits = self.traits_for(tp)
        if self.weights_once and traits.is_param_derived(name):
            return 0.0  # the step's compute copy of the weights: ``param_bytes``, not a per-microbatch buffer
        split = name in traits.split_ops or traits.roles[name] == "sharded"
        s = 1.0 / tp if split or (sp and self._batch_dependent[name]) else 1.0
        if self._batch_dependent[name]:
            s *= microbatch / self.batch_size
        return s

    def sequence_split_ops(self, tp: int) -> frozenset[str]:
        """The ops sequence parallelism splits over the ``tp`` ranks along the sequence: those
        tensor parallelism leaves whole that work on the batch (as ``_scale`` prices them)."""
        traits = self.traits_for(tp)
        return self._memo(
            self._graph_memo,
            ("sequence split", tp),
            lambda: frozenset(
                name
                for name, batch in self._batch_dependent.items()
                if batch and name not in traits.split_ops and traits.roles[name] != "sharded"
            ),
        )

    def sequence_parallel_grad_bytes(self, index: int, tp: int) -> float:
        """Bytes of the gradients sequence parallelism leaves partial on each of the ``tp`` ranks,
        all-reduced over them: parameters tensor parallelism keeps whole that layer ``index``'s
        sequence-split ops read, directly or through a reshape or cast (LayerNorm scales and
        biases, the bias after a row-split matmul, a positional table), whole, as Megatron-LM
        all-reduces them."""
        split, traits = self.sequence_split_ops(tp), self.traits_for(tp)
        read: set[str] = set()
        for name in self.layers[index].ops:
            if name not in split:
                continue
            read.update(self.graph.op(name).param_reads)
            for pred in self.graph.nx.predecessors(name):
                if traits.is_param_derived(pred):
                    read.update(self.graph.op(pred).param_reads)
        whole = [p for p in read if p in self.graph.params and traits.param_roles[p] not in ("column", "row")]
        return float(sum(self.graph.params[p].nbytes for p in whole))

    def _representative(self, index: int) -> int:
        """The first layer with the same signature: identical layers share every cache entry."""
        signature = self.layers[index].signature
        return self._memo(
            self._graph_memo,
            ("representative", index),
            lambda: next(layer.index for layer in self.layers if layer.signature == signature),
        )

    def _phase_times(self, index: int, device_type: str, tp: int) -> dict[tuple[str, bool, bool], float]:
        """Unscaled op times summed by (phase, split by TP, works on the batch)."""
        return self._memo(
            self._time_memo, (index, device_type, tp), lambda: self._compute_phase_times(index, device_type, tp)
        )

    def _compute_phase_times(self, index: int, device_type: str, tp: int) -> dict[tuple[str, bool, bool], float]:
        device = self.cluster.device_types[device_type]
        eff = self.efficiency_of(device_type)
        split_ops = self.traits_for(tp).split_ops
        times: dict[tuple[str, bool, bool], float] = defaultdict(float)
        for name in self.layers[index].ops:
            op = self.graph.op(name)
            key = (op.phase, name in split_ops, self._batch_work[name])
            times[key] += op_time_s(op, device, eff, self.traffic[name])
        return dict(times)

    def _modelled_time(
        self,
        index: int,
        device_type: str,
        phase: str,
        tp: int,
        microbatch: float,
        *,
        weights_only: bool = False,
        sp: bool = False,
    ) -> float:
        """Modelled seconds of a phase's ops; with ``weights_once``, the forward and backward leave out
        the work on parameters alone, which ``weights_only=True`` returns instead. ``sp``: sequence
        parallelism splits the batch work tensor parallelism leaves whole."""
        total = 0.0
        for (ph, split, batch_dep), t in self._phase_times(self._representative(index), device_type, tp).items():
            on_weights = self.weights_once and not batch_dep and ph != "optimizer"
            if ph == phase and on_weights == weights_only:
                divided = split or (sp and batch_dep)
                total += t * (1 / tp if divided else 1) * (microbatch / self.batch_size if batch_dep else 1)
        return total

    def _phase_time(
        self, index: int, device_type: str, phase: str, tp: int, microbatch: float, sp: bool = False
    ) -> float:
        modelled = self._modelled_time(index, device_type, phase, tp, microbatch, sp=sp)
        timing = self._measured_on(index, device_type)
        if timing is None:
            return modelled
        at_profile = self._modelled_time(index, device_type, phase, 1, self.measured_batch_size)
        measured = getattr(timing, f"{phase}_s")
        if at_profile <= 0:
            return measured
        fixed = self._fixed_time(index, device_type, phase)
        curve = ((0.0, fixed), *getattr(timing, f"{phase}_at", ()), (1.0, measured))
        return _piecewise_linear(curve, modelled / at_profile)

    def _measured_on(self, index: int, device_type: str):
        """Layer ``index``'s measured timing if it was measured on ``device_type``, else None."""
        timing = self.measured.get(self.layers[index].signature)
        return timing if timing is not None and getattr(timing, "device_kind", None) == device_type else None

    def _fixed_time(self, index: int, device_type: str, phase: str) -> float:
        """The measured part of a phase's time that does not scale (``LayerTiming.forward_fixed_s``), else 0."""
        return getattr(self._measured_on(index, device_type), f"{phase}_fixed_s", None) or 0.0

    def tp_allreduce_bytes(self, index: int, microbatch: float, tp: int) -> dict[str, float]:
        """Per-device operand bytes of the layer's all-reduces under tensor-parallel degree ``tp``, by phase."""
        allreduce_ops = self.traits_for(tp).allreduce_ops
        out: dict[str, float] = defaultdict(float)
        for name in self.layers[index].ops:
            if name in allreduce_ops:
                op = self.graph.op(name)
                out[op.phase] += sum(t.nbytes for t in op.outputs) * self._scale_batch(name, microbatch)
        return dict(out)

    def _scale_batch(self, name: str, microbatch: float) -> float:
        return microbatch / self.batch_size if self._batch_dependent[name] else 1.0

    def local_param_bytes(self, index: int, tp: int) -> float:
        return self._local_bytes(self.layers[index].params, tp)

    def _local_fraction(self, path: str, tp: int) -> float:
        return 1 / tp if self.traits_for(tp).param_roles[path] in ("column", "row") else 1.0

    def _gathered_param_bytes(self, index: int, tp: int, *, reads: bool = False) -> float:
        """Per-device bytes of layer ``index``'s parameters a ZeRO all-gather moves: as stored, or
        with ``weights_once`` in the dtype the forward casts them to. ``reads``: every parameter
        the layer reads (FSDP gathers each where it is used: a tied table once per reading layer)."""
        paths = self.gradient_contributions(index) if reads else self.layers[index].params
        if not self.weights_once:
            return self._local_bytes(paths, tp)
        itemsize = self._memo(self._graph_memo, "compute_itemsize", self._compute_itemsizes)
        return sum(
            self.graph.params[path].size
            * itemsize.get(path, dtype_itemsize(self.graph.params[path].dtype))
            * self._local_fraction(path, tp)
            for path in paths
        )

    def _compute_itemsizes(self) -> dict[str, int]:
        """Bytes per element of each parameter the forward casts to a narrower dtype."""
        out: dict[str, int] = {}
        for op in self.graph.ops():
            if op.phase == "forward" and op.primitive == "convert_element_type" and len(op.param_reads) == 1:
                (path,) = op.param_reads
                size = dtype_itemsize(op.outputs[0].dtype)
                if path in self.graph.params and size < dtype_itemsize(self.graph.params[path].dtype):
                    out[path] = min(size, out.get(path, size))
        return out

    def _master_bytes(self, index: int, tp: int) -> float:
        """Per-device bytes of the parameters of layer ``index`` the forward casts to a narrower
        dtype, as stored: under ``weights_once``, the masters a mixed-precision optimizer keeps."""
        itemsize = self._memo(self._graph_memo, "compute_itemsize", self._compute_itemsizes)
        return self._local_bytes([path for path in self.layers[index].params if path in itemsize], tp)

    def _local_bytes(self, paths, tp: int) -> float:
        return sum(self.graph.params[path].nbytes * self._local_fraction(path, tp) for path in paths)

    def dp_sync_bytes(self, index: int, tp: int, *, accumulate_gradients: bool = False) -> float:
        """Per-device gradient bytes layer ``index`` contributes to the data-parallel sync (``_gradients``)."""
        total = 0.0
        for path in self.gradient_contributions(index):
            if accumulate_gradients:
                nbytes = float(self.graph.params[path].nbytes)
            else:
                layer = self._representative(index)
                nbytes = self._memo(
                    self._graph_memo,
                    ("synced", layer, path),
                    lambda layer=layer, path=path: synced_gradient_bytes(
                        self.graph, self.layers[layer].ops, path, self._constant_ops
                    ),
                )
            total += nbytes * self._local_fraction(path, tp)
        return total

    def gradient_contributions(self, index: int) -> tuple[str, ...]:
        """Parameters whose gradient layer ``index`` produces: its own and every parameter its
        forward ops read. A tied parameter (GPT's token embedding, read again by the head)
        contributes once per reading layer, and XLA all-reduces each contribution separately
        under data parallelism, in JAX and torch_xla alike (``tests/integrations/torch_xla/test_apply.py``
        checks it against the compiled HLO)."""
        return self._memo(self._graph_memo, ("contributions", index), lambda: self._contributions(index))

    def _contributions(self, index: int) -> tuple[str, ...]:
        reads = set(self.layers[index].params)
        for name in self.layers[index].ops:
            op = self.graph.op(name)
            if op.phase == "forward":
                reads.update(op.param_reads)
        return tuple(sorted(p for p in reads if p in self.graph.params))

    def _memory(
        self, index: int, tp: int, microbatch: float, sp: bool = False, selective: bool = False, blockwise: bool = False
    ) -> tuple[float, float]:
        return self._memory_of(self._representative(index), tp, microbatch, sp, selective, blockwise)

    def _memory_of(
        self, index: int, tp: int, microbatch: float, sp: bool = False, selective: bool = False, blockwise: bool = False
    ) -> tuple[float, float]:
        """(activation bytes kept per microbatch, transient bytes) from liveness; with ``blockwise``, the
        attention's score-shaped tensors unwritten, as the context-parallel blockwise kernels run it
        (``_context.unmaterialized_ops``)."""
        return self._memo(
            self._graph_memo,
            ("memory", index, tp, microbatch, sp, selective, blockwise),
            lambda: self._compute_memory(index, tp, microbatch, sp, selective, blockwise),
        )

    def attention_core(self, index: int) -> AttentionCore:
        """The ops of layer ``index`` that selective recompute rebuilds (``_recompute``)."""
        index = self._representative(index)
        return self._memo(
            self._graph_memo,
            ("core", index),
            lambda: attention_core(self.graph, self.layers[index].ops, lambda n: self._batch_dependent[n]),
        )

    def _core_time(
        self, index: int, device_type: str, tp: int, microbatch: float, ops=None, phase: str = "forward"
    ) -> float:
        """Seconds of layer ``index``'s core attention forward (or of its ``ops`` in ``phase``), modelled;
        a measured layer's scaled by its measured-to-modelled ratio of that phase."""
        core = self.attention_core(index).ops if ops is None else ops
        if not core:
            return 0.0
        index = self._representative(index)
        device, eff = self.cluster.device_types[device_type], self.efficiency_of(device_type)
        split_ops = self.traits_for(tp).split_ops
        modelled = sum(
            op_time_s(self.graph.op(n), device, eff, self.traffic[n])
            * (1 / tp if n in split_ops else 1)
            * (microbatch / self.batch_size if self._batch_work[n] else 1)
            for n in core
        )
        forward = self._modelled_time(index, device_type, phase, tp, microbatch)
        if self._measured_on(index, device_type) is None or forward <= 0:
            return modelled
        return modelled * self._phase_time(index, device_type, phase, tp, microbatch) / forward

    def _compute_memory(
        self, index: int, tp: int, microbatch: float, sp: bool = False, selective: bool = False, blockwise: bool = False
    ) -> tuple[float, float]:
        ops = [n for n in self.layers[index].ops if self.graph.op(n).phase != "optimizer"]
        core = self.attention_core(index)
        unwritten = (
            unmaterialized_ops(self.graph, ops, core, self._constant_ops) if blockwise and core.starts else frozenset()
        )
        result = liveness(
            self.graph,
            ops,
            scale=lambda n: 0.0 if n in unwritten else self._scale(n, tp, microbatch, sp),
            allreduced=self.traits_for(tp).allreduce_ops if tp > 1 else frozenset(),
            # XLA:CPU's YNNPACK rule on CPU clusters; XLA:GPU's fusion rules on the others
            row_fusion_elements=YNN_MIN_ELEMENTS if self.cluster.shared_cores is not None else None,
            xla_gpu=self.cluster.shared_cores is None,
            recomputed=self.attention_core(index).dropped if selective else frozenset(),
        )
        kept = result.boundary_bytes
        return kept, max(0.0, result.peak_bytes - kept)

    # -- the entry point ------------------------------------------------------
    def layer_cost(
        self,
        index: int,
        device_type: str,
        config: ParallelConfig,
        *,
        tp_link: Link | None = None,
        dp_link: Link | None = None,
        cp_link: Link | None = None,
    ) -> LayerCost:
        """Costs of layer ``index`` on one ``device_type`` device under ``config``; ``cp_link`` joins
        the context-parallel ring's neighbours (the device type's intra-host link by default)."""
        if config.tp > 1 and not self.tensor_parallel:
            raise ValueError("tensor parallelism needs param_axes (logical axis names of the parameters)")
        if device_type not in self.cluster.device_types:
            raise KeyError(f"unknown device type {device_type!r}; the cluster has {sorted(self.cluster.device_types)}")
        tp_link = tp_link or self.default_link(device_type)
        dp_link = dp_link or self.default_link(device_type)
        t, cp = config.tp, config.context_parallel
        m = config.microbatch_size / cp  # the samples' worth of tokens one device holds
        sp = config.sequence_parallel and t > 1
        replicas = config.dp * cp  # the ranks that hold the same parameters
        forward = self._phase_time(index, device_type, "forward", t, m, sp)
        backward = self._phase_time(index, device_type, "backward", t, m, sp)
        optimizer = self._phase_time(index, device_type, "optimizer", t, m)
        zero = config.zero or config.fsdp
        if zero:
            optimizer /= replicas
        weights = (
            sum(self._modelled_time(index, device_type, ph, t, m, weights_only=True) for ph in ("forward", "backward"))
            if self._measured_on(index, device_type) is None
            else 0.0
        )
        optimizer += weights
        fixed = self._fixed_time(index, device_type, "forward") + self._fixed_time(index, device_type, "backward")
        ring = self.context_parallel_choice(index, device_type, config, cp_link)
        if ring:  # the ring's blockwise kernels run the attention's T × T work (``_context``)
            square_f, square_b = self._square_ops(index)
            forward += ring.chosen.compute_forward_s - self._core_time(index, device_type, t, m, square_f)
            backward += ring.chosen.compute_backward_s - self._core_time(index, device_type, t, m, square_b, "backward")
        selective = config.selective_recompute and not config.recompute
        if config.recompute:
            backward += forward
            fixed += self._fixed_time(index, device_type, "forward")
        elif selective:
            backward += ring.chosen.compute_forward_s if ring else self._core_time(index, device_type, t, m)
        ar = self.tp_allreduce_bytes(index, m, t) if t > 1 else {}
        tp_fwd, tp_bwd = ar.get("forward", 0.0), ar.get("backward", 0.0)
        if config.recompute:
            tp_bwd += tp_fwd
        tp_comm = coll.all_reduce_s(tp_fwd, t, tp_link) + coll.all_reduce_s(tp_bwd, t, tp_link)
        sp_grads = self.sequence_parallel_grad_bytes(index, t) if sp else 0.0
        tp_comm += coll.all_reduce_s(sp_grads, t, tp_link)
        cp_fwd, cp_bwd = (ring.chosen.exposed_forward_s, ring.chosen.exposed_backward_s) if ring else (0.0, 0.0)
        carry = self._scan_carry(index, config.microbatch_size, cp, cp_link or self.default_link(device_type))
        if carry:
            cp_fwd, cp_bwd = cp_fwd + carry.forward_s, cp_bwd + carry.backward_s
        if config.recompute or selective:  # the rebuilt attention passes its K/V around again, a scan its carry
            cp_bwd += cp_fwd
        params = self.local_param_bytes(index, t)
        # ZeRO and reduce-scatter sync full-size gradients, as accumulation does
        # (FSDP's one program reduce-scatters the backward's own gradients: a table's rows read)
        whole = config.accumulate_gradients or config.zero or config.dp_sync != "all_reduce"
        gradients = self.dp_sync_bytes(index, t, accumulate_gradients=whole)
        gathered, exposed_forward, exposed_backward = 0.0, 0.0, 0.0
        per_microbatch = self.shard_grad_op and zero and not config.fsdp and replicas > 1
        if per_microbatch:  # FSDP's SHARD_GRAD_OP: both collectives every microbatch, beside its phase
            gathered = self._gathered_param_bytes(index, t)
            tp_forward_s = coll.all_reduce_s(tp_fwd, t, tp_link)
            exposed_forward = max(0.0, coll.all_gather_s(gathered, replicas, dp_link) - forward - tp_forward_s)
            exposed_backward = max(
                0.0, coll.reduce_scatter_s(gradients, replicas, dp_link) - backward - (tp_comm - tp_forward_s)
            )
            dp_sync = 0.0
        elif config.dp_sync == "all_reduce" and not zero:
            dp_sync = coll.all_reduce_s(gradients, replicas, dp_link)
        else:
            gathered = self._gathered_param_bytes(index, t, reads=config.fsdp)
            gather = coll.all_gather_s(gathered, replicas, dp_link)
            if config.overlap_param_gather:
                gather = max(0.0, gather - forward)
            dp_sync = coll.reduce_scatter_s(gradients, replicas, dp_link) + gather
        kept, transient = self._memory(index, t, m, sp, selective, blockwise=ring is not None)
        if ring:
            transient += ring.chosen.extra_memory_bytes
        if carry:
            transient += carry.extra_memory_bytes
        layer = self.layers[index]
        if config.recompute:
            transient += kept
            # the layer's input, which sequence parallelism splits over the TP ranks (Korthikanti et al., 2022, §4)
            kept = self._input_bytes(index) * m / self.batch_size / (t if sp else 1)
        held, masters = params, 0.0
        if self.weights_once:  # the compute copy held, its float32 masters with the optimizer
            held = self._gathered_param_bytes(index, t)
            masters = self._master_bytes(index, t)
        optimizer_bytes = (params * self.optimizer_ratio + masters) / (replicas if zero else 1)
        if config.fsdp:  # the layer's gathered parameters and its full-size gradient, while it runs
            transient += held + params
        grad_bytes = params / (replicas if config.fsdp else 1)
        if per_microbatch:  # the gradient's shard, and its full size while the layer's backward runs
            grad_bytes = params / replicas
            transient += params
        shard = replicas if config.fsdp else 1
        return LayerCost(
            forward_s=forward + exposed_forward,
            backward_s=backward + exposed_backward,
            optimizer_s=optimizer,
            tp_comm_s=tp_comm,
            dp_sync_s=dp_sync,
            tp_allreduce_bytes=tp_fwd + tp_bwd,
            dp_sync_bytes=gradients if replicas > 1 else 0.0,
            param_bytes=held / shard,
            grad_bytes=grad_bytes,
            optimizer_bytes=optimizer_bytes,
            activation_bytes=kept,
            transient_bytes=transient,
            output_activation_bytes=layer.activation_bytes * m / self.batch_size,
            fixed_s=fixed,
            cp_comm_s=cp_fwd + cp_bwd,
            cp_form=ring.form if ring else None,
            breakdown={
                "tp_forward_bytes": tp_fwd,
                "tp_backward_bytes": tp_bwd,
                "dp_gather_bytes": gathered if replicas > 1 else 0.0,
                "dp_exposed_forward_s": exposed_forward,
                "dp_exposed_backward_s": exposed_backward,
                "sp_grad_bytes": sp_grads,
                "weights_once_s": weights,
                "cp_forward_s": cp_fwd,
                "cp_backward_s": cp_bwd,
                "cp_attention_forward_s": ring.chosen.compute_forward_s if ring else 0.0,
                "cp_attention_backward_s": ring.chosen.compute_backward_s if ring else 0.0,
                "cp_bytes": (float(ring.chosen.bytes_sent) if ring else 0.0)
                + (float(carry.bytes_sent) if carry else 0.0),
            },
        )

    def attention_length(self) -> int | None:
        """T, the sequence length the model's attention sees (the dim its ``Q·Kᵀ`` scores hold twice,
        queries and keys, wherever grouped-query attention puts its group; else their last dim), or
        None if no layer has attention: what context parallelism splits."""
        return self._memo(self._graph_memo, "attention_length", self._attention_length)

    def _attention_length(self) -> int | None:
        shapes = [
            self.graph.op(name).outputs[0].shape
            for index in range(len(self.layers))
            for name in self.attention_core(index).starts
        ]
        return max((max((d for d in s if s.count(d) > 1), default=s[-1]) for s in shapes), default=None)

    def context_length(self) -> int | None:
        """T, the sequence length context parallelism splits: the attention's (:meth:`attention_length`),
        else the longest scan's (:meth:`scan_state`); None if the model has neither."""
        lengths = [self.attention_length()] + [
            state[0] for index in range(len(self.layers)) if (state := self.scan_state(index)) is not None
        ]
        return max((length for length in lengths if length is not None), default=None)

    def scan_state(self, index: int) -> tuple[int, int, int] | None:
        """(T, D, N) of the sequential scan over the sequence in layer ``index`` (a selective scan's
        ``lax.scan`` over time, its state h of shape (B, D, N)), or None if it has none.

        The state is the largest rank-3 output, batch first, of a forward op that runs more than once
        per step (a loop body, ``Op.repeats``); T is that op's trip count.
        """
        index = self._representative(index)
        return self._memo(self._graph_memo, ("scan", index), lambda: self._scan_state(index))

    def _scan_state(self, index: int) -> tuple[int, int, int] | None:
        states = [
            (spec.size, op.repeats, spec.shape)
            for op in map(self.graph.op, self.layers[index].ops)
            if op.phase == "forward" and op.repeats > 1
            for spec in op.outputs
            if len(spec.shape) == 3 and spec.shape[0] == self.batch_size
        ]
        if not states:
            return None
        _, length, (_, d_inner, d_state) = max(states)
        return length, d_inner, d_state

    def _scan_carry(self, index: int, batch: int, cp: int, link: Link):
        """The carry exchange of layer ``index``'s scan split over ``cp`` devices at ``batch`` samples per
        device (each holds every sample's state); None without context parallelism or a scan."""
        state = self.scan_state(index) if cp > 1 else None
        if state is None:
            return None
        _, d_inner, d_state = state
        return scan_carry_cost(batch=batch, d_inner=d_inner, d_state=d_state, n=cp, link=link)

    def kv_bytes(self, index: int, tp: int) -> tuple[float, int]:
        """(bytes, elements) of layer ``index``'s K and V over the whole captured batch and sequence,
        per tensor-parallel rank: the smaller operand of each ``Q·Kᵀ`` (K) and ``P·V`` (V)."""
        core = self.attention_core(index)
        split = self.traits_for(tp).split_ops
        nbytes, elements = 0.0, 0
        for name in sorted(core.starts | core.ends):
            operand = min(self.graph.op(name).inputs, key=lambda spec: spec.nbytes)
            share = tp if name in split else 1
            nbytes += operand.nbytes / share
            elements += operand.size // share
        return nbytes, elements

    def context_parallel_choice(
        self, index: int, device_type: str, config: ParallelConfig, link: Link | None = None
    ) -> ContextParallelChoice | None:
        """Both forms' prices (ring and all-gather) for layer ``index``'s attention under ``config``'s
        context parallelism, and the one :meth:`layer_cost` takes; None without context parallelism
        or attention. ``link``: between ring neighbours (the type's intra-host link by default)."""
        cp = config.context_parallel
        if cp < 2 or not self.attention_core(index).starts:
            return None
        link = link or self.default_link(device_type)
        return self._context_parallel(index, device_type, config.tp, config.microbatch_size / cp, cp, link)

    def _context_parallel(self, index: int, device_type: str, tp: int, samples: float, cp: int, link: Link):
        """The ring-or-gather price of layer ``index``'s attention over ``cp`` devices, each holding
        ``samples`` samples' worth of tokens, its block steps run by the blockwise kernels."""
        nbytes, elements = self.kv_bytes(index, tp)
        share = samples / self.batch_size  # of the captured batch and whole sequence, per device
        split = self.traits_for(tp).split_ops
        work = ring_attention_work(
            self.graph, self.attention_core(index), self._constant_ops, self.attention_length(), cp,
            lambda name: share / tp if name in split else share,
        )  # fmt: skip
        device = self.cluster.device_types[device_type]
        step = blockwise_attention_s(**work, device=device, efficiency=self.efficiency_of(device_type)) / cp
        return context_parallel_cost(
            n=cp,
            kv_bytes=nbytes * share,
            grad_bytes=elements * 4 * share,  # dK/dV accumulate in fp32
            step_forward_s=step,
            step_backward_s=BACKWARD_RATIO * step,
            link=link,
            memory_budget_bytes=self.cluster.device_types[device_type].memory_bytes,
        )

    def _square_ops(self, index: int) -> tuple[frozenset[str], frozenset[str]]:
        """Layer ``index``'s forward and backward ops on its attention's T × T scores (``_context.square_ops``)."""
        index = self._representative(index)
        core = self.attention_core(index)
        key = ("square", index)
        return self._memo(self._graph_memo, key, lambda: square_ops(self.graph, self.layers[index].ops, core, self._constant_ops))  # fmt: skip

    def _input_bytes(self, index: int) -> float:
        return float(sum(d["bytes"] for _, _, d in self.layers.nx.in_edges(index, data=True)))


def _piecewise_linear(points, x: float) -> float:
    """The piecewise-linear curve through ``points`` ((x, y), x ascending) at ``x``; beyond the
    last point, its last piece extended."""
    for (x0, y0), (x1, y1) in pairwise(points):
        if x <= x1 or (x1, y1) == points[-1]:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return points[-1][1]
