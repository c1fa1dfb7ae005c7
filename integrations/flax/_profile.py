"""Measure each distinct layer of a captured step on the local device.

Every distinct layer signature is cut out of the step three times (forward,
backward, optimizer pieces; see ``_slice``), compiled, warmed up and timed:
the median of ``repeats`` runs. A piece writes its outputs over the inputs
that are dead after it, as the whole step does inside one program (the
optimizer over the donated state, the tied embedding's gradient over the
head's): timed into fresh buffers instead, the CPU's page faults make a large
embedding's update and backward several times slower than in the step. Results
go to the disk cache keyed by signature, device kind and jax version, so a
second profile is instant.

With ``fixed_from`` (the same step's arguments at a smaller batch, or a list of them at several),
each layer's forward and backward are also timed there (``LayerTiming.forward_at``), and the line
through the two smallest batches' times, read at batch 0, is the part that does not shrink with
the batch (``LayerTiming.forward_fixed_s``): per-call and per-op costs, a large share of a small
layer's time at a small batch, which a layer scaled linearly to the microbatch leaves out. The
time is not one line in the batch either (a line through two larger batches overestimates the
smallest), so the cost model interpolates between every measured batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence

import jax
import numpy as np

from integrations.flax._slice import PieceRun, SlicedStep
from orchestrator.coarsen import LayerGraph
from orchestrator.graph import OpGraph
from orchestrator.profile import LayerTiming, TimingCache

PHASES = ("forward", "backward", "optimizer")
WHOLE = "<whole step>"  # sample keys (WHOLE, phase, batch ratio): the whole step's phase as one piece


def profile_layers(
    fn: Callable,
    *args,
    graph: OpGraph,
    layers: LayerGraph,
    repeats: int = 5,
    cache: TimingCache | None = None,
    progress: Callable[[str], None] | None = None,
    fixed_from: tuple | list[tuple] | None = None,
) -> dict[str, LayerTiming]:
    """Timings of every distinct layer, by signature: the medians of ``repeats`` rounds of
    :class:`LayerProfiler` after one warm-up round (layers in the cache are not measured again).

    ``fixed_from``: ``fn``'s arguments at a smaller batch (same structure, same layers), or a list
    of them at several smaller batches; each layer's times there and its fixed part are then
    measured too (see the module docstring).
    """
    # bad input fails before the cache is read
    ratios = sorted(_smaller_ratio(args, small_args) for small_args in _as_list(fixed_from))
    device_kind = jax.devices()[0].device_kind
    cache = cache if cache is not None else TimingCache(jax_version=jax.__version__)
    timings: dict[str, LayerTiming] = {}
    for layer in layers:
        cached = cache.get(layer.signature, device_kind)
        if cached is not None and (fixed_from is None or [r for r, _ in cached.forward_at] == ratios):
            timings[layer.signature] = cached
    missing = {layer.signature for layer in layers} - set(timings)
    if not missing:
        return timings
    profiler = LayerProfiler(
        fn, *args, graph=graph, layers=layers, fixed_from=fixed_from, signatures=missing, progress=progress
    )
    profiler.sample()  # warm-up: the first run of each piece
    for timing in profiler.timings([profiler.sample() for _ in range(repeats)]).values():
        cache.put(timing)
        timings[timing.signature] = timing
    return timings


class LayerProfiler:
    """The pieces of every distinct layer (forward, backward, optimizer; with ``fixed_from``, the
    forward and backward at each smaller batch too), compiled once, timed one round at a time.

    A round (:meth:`sample`) runs each piece once, in turn, so that a change of the machine's
    speed during the profile falls on every layer alike, and so that the rounds can be
    interleaved with other measurements (the executor bench times a plan's stages between them:
    a layer's pieces and the stage that runs it then see the same machine: on shared cores their
    ratio holds where separate profiles taken one after another drift apart).

    Args:
      fn, *args: the step and its arguments.
      graph, layers: the captured step and its layers.
      fixed_from: ``fn``'s arguments at a smaller batch, or a list of them at several.
      signatures: only the layers with these signatures (all if None).
      boundary: also compile the whole step's forward and its backward, each as one piece, at the
        smallest batch, for :meth:`boundary_seconds` (needs every layer: no ``signatures``).
    """

    def __init__(
        self,
        fn: Callable,
        *args,
        graph: OpGraph,
        layers: LayerGraph,
        fixed_from: tuple | list[tuple] | None = None,
        signatures: Collection[str] | None = None,
        progress: Callable[[str], None] | None = None,
        boundary: bool = False,
    ):
        if boundary and signatures is not None:
            raise ValueError("LayerProfiler(boundary=True) needs every layer: leave signatures unset")
        self.device_kind = jax.devices()[0].device_kind
        self.layer_counts = Counter(layer.signature for layer in layers)
        distinct: dict[str, tuple[int, object]] = {}
        for index, layer in enumerate(layers):
            if signatures is None or layer.signature in signatures:
                distinct.setdefault(layer.signature, (index, layer))
        self.names = {signature: layer.name for signature, (_, layer) in distinct.items()}
        smaller = sorted(
            (_smaller_batch(fn, args, small_args, layers) for small_args in _as_list(fixed_from)), key=lambda s: s[2]
        )
        self.ratios = [ratio for _, _, ratio in smaller]  # ascending
        steps = [(SlicedStep(fn, *args, graph=graph), layers, 1.0), *smaller]
        # by (signature, phase, batch ratio): 1.0 the profile's batch
        self.runs: dict[tuple[str, str, float], PieceRun | None] = {}
        for signature, (index, layer) in distinct.items():
            if progress:
                progress(layer.name)
            for sliced, step_layers, ratio in steps:
                for phase in PHASES if ratio == 1.0 else ("forward", "backward"):
                    self.runs[(signature, phase, ratio)] = _piece_run(sliced, step_layers[index].ops, phase)
        # by (phase, batch ratio): the whole step's phase as one piece, at the smallest batch
        self.whole: dict[tuple[str, float], PieceRun] = {}
        if boundary:
            sliced, step_layers, ratio = steps[1] if smaller else steps[0]
            every_op = [op for layer in step_layers for op in layer.ops]
            for phase in ("forward", "backward"):
                self.whole[(phase, ratio)] = _piece_run(sliced, every_op, phase)

    def sample(self) -> dict[tuple[str, str, float], float]:
        """One run of every piece: seconds by (signature, phase, batch / the profile's batch); 0 for
        an empty phase."""
        times = {key: run() if run is not None else 0.0 for key, run in self.runs.items()}
        return times | {(WHOLE, *key): run() for key, run in self.whole.items()}

    def boundary_seconds(
        self, samples: Sequence[Mapping[tuple, float]], *, host_s: Callable[[int], float] | None = None
    ) -> float:
        """What cutting one program in two costs on one device: the layers' forward and backward
        pieces, summed over every layer, less the whole step's forward and backward pieces, per cut
        (one fewer than the layers), at the smallest batch; medians of ``samples``, each piece less
        ``host_s`` of its buffers (see :meth:`timings`). At least 0.

        A cut ends one program and starts another: the call's own costs on the device, and the
        fusion across it that XLA loses. It shows at the smallest batch, where the devices' work is
        small; at larger batches it is lost in the noise.
        """
        if not self.whole:
            raise ValueError("boundary_seconds needs LayerProfiler(..., boundary=True)")
        if not samples:
            raise ValueError("LayerProfiler.boundary_seconds needs at least one sample")

        pieces = whole = 0.0
        for (phase, ratio), run in self.whole.items():
            whole += _median_less_host(samples, (WHOLE, phase, ratio), run, host_s)
            for signature, count in self.layer_counts.items():
                key = (signature, phase, ratio)
                pieces += count * _median_less_host(samples, key, self.runs[key], host_s)
        cuts = sum(self.layer_counts.values()) - 1
        return max(0.0, (pieces - whole) / cuts) if cuts else 0.0

    def timings(
        self, samples: Sequence[Mapping[tuple[str, str, float], float]], *, host_s: Callable[[int], float] | None = None
    ) -> dict[str, LayerTiming]:
        """Each layer's timing from the medians of ``samples`` (rounds of :meth:`sample`).

        ``host_s(n)``: the host's seconds for a call that takes and returns n buffers, taken off
        each piece's time (so that a stage's prediction, which adds its own calls' host time, does
        not count the pieces' too)."""
        if not samples:
            raise ValueError("LayerProfiler.timings needs at least one sample")
        median = {}
        for key, run in self.runs.items():
            median[key] = _median_less_host(samples, key, run, host_s)
        out = {}
        for signature, name in self.names.items():
            smaller = {}
            if self.ratios:
                for phase in ("forward", "backward"):
                    curve = tuple((r, median[(signature, phase, r)]) for r in self.ratios)
                    (r0, t0), (r1, t1) = (*curve, (1.0, median[(signature, phase, 1.0)]))[:2]
                    smaller[f"{phase}_at"] = curve
                    smaller[f"{phase}_fixed_s"] = _intercept(t1, t0, r0 / r1)
            out[signature] = LayerTiming(
                signature=signature,
                name=name,
                device_kind=self.device_kind,
                forward_s=median[(signature, "forward", 1.0)],
                backward_s=median[(signature, "backward", 1.0)],
                optimizer_s=median[(signature, "optimizer", 1.0)],
                **smaller,
            )
        return out


def _as_list(fixed_from) -> list[tuple]:
    """``fixed_from`` as a list of argument tuples (one tuple: one smaller batch)."""
    if fixed_from is None:
        return []
    return list(fixed_from) if isinstance(fixed_from, list) else [fixed_from]


def _median_less_host(samples, key, run: PieceRun | None, host_s: Callable[[int], float] | None) -> float:
    """The median of ``key`` over ``samples``, less ``host_s`` of the piece's buffers (at least 0);
    an empty phase (``run`` None) is 0 in every sample."""
    seconds = float(np.median([s[key] for s in samples]))
    return max(0.0, seconds - host_s(run.buffers)) if host_s and run is not None else seconds


def _piece_run(sliced: SlicedStep, layer_ops, phase: str) -> PieceRun | None:
    """The ``phase`` ops among ``layer_ops`` as one compiled piece (None for an empty phase)."""
    ops = sliced.layer_phase_ops(layer_ops, (phase,))
    if not ops:
        return None
    closed, avals = sliced.piece(ops)
    return PieceRun(closed, avals, donate=sliced.reusable_inputs(ops, closed))


def _batch_of(args) -> int:
    """The leading dimension of the first leaf with one under a ``batch``-like argument (the last argument)."""
    leaves = [leaf for leaf in jax.tree.leaves(args[-1]) if getattr(leaf, "shape", ())]
    if not leaves:
        raise ValueError("fixed_from needs a batch argument (the step's last) with a leading batch dimension")
    return leaves[0].shape[0]


def _smaller_batch(fn: Callable, args: tuple, small_args: tuple, layers: LayerGraph):
    """(sliced step, layers, small batch / batch) of ``fn`` at ``small_args``, checked to have the same layers."""
    from integrations.flax._capture import capture
    from orchestrator.coarsen import coarsen

    ratio = _smaller_ratio(args, small_args)
    graph = capture(fn, *small_args)
    small_layers = coarsen(graph)
    if [layer.name for layer in small_layers] != [layer.name for layer in layers]:
        raise ValueError("fixed_from gives other layers than the profiled step: pass the same step at a smaller batch")
    return SlicedStep(fn, *small_args, graph=graph), small_layers, ratio


def _smaller_ratio(args: tuple, small_args: tuple) -> float:
    """The smaller batch over the profile's, checked to be in (0, 1)."""
    batch, small = _batch_of(args), _batch_of(small_args)
    if not 0 < small < batch:
        raise ValueError(f"fixed_from needs a smaller batch than the profile's {batch}, got {small}")
    return small / batch


def _intercept(at_batch: float, at_small: float, ratio: float) -> float:
    """The line through (1, at_batch) and (ratio, at_small), at 0, clamped to [0, at_small]."""
    slope = (at_batch - at_small) / (1 - ratio)
    return min(max(at_small - ratio * slope, 0.0), at_small)
