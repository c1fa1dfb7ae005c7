"""Measure each distinct layer of a captured step on the local device.

Every distinct layer signature is cut out of the step three times (forward,
backward, optimizer pieces; see ``_slice``), compiled, warmed up and timed:
the median of ``repeats`` runs. A piece writes its outputs over the inputs
that are dead after it, as the whole step does inside one program (the
optimizer over the donated state, the tied embedding's gradient over the
head's): timed into fresh buffers instead, the CPU's page faults made
gpt2-small's embedding update 2.4× and its backward 7× slower than in the step.
Results go to the disk cache keyed by
signature, device kind and jax version, so a second profile is instant.

With ``fixed_from`` (the same step's arguments at a smaller batch), each layer's
forward and backward are also timed there, and the line through the two times,
read at batch 0, is the part that does not shrink with the batch
(``LayerTiming.forward_fixed_s``): per-call and per-op costs, which on the
2-core development machine are 6–20% of gpt-tiny's forward and backward at
batch 16 (a block 4–20%, the embedding 32–66%; session 20). Without it, the
cost model scaled a layer linearly to the microbatch, and the pipeline stages
at 4 samples ran 15–96% slower than predicted.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import jax
import numpy as np

from integrations.flax._slice import PieceRun, SlicedStep
from orchestrator.coarsen import LayerGraph
from orchestrator.graph import OpGraph
from orchestrator.profile import LayerTiming, TimingCache

PHASES = ("forward", "backward", "optimizer")


def profile_layers(
    fn: Callable,
    *args,
    graph: OpGraph,
    layers: LayerGraph,
    repeats: int = 5,
    cache: TimingCache | None = None,
    progress: Callable[[str], None] | None = None,
    fixed_from: tuple | None = None,
) -> dict[str, LayerTiming]:
    """Timings of every distinct layer, by signature: the medians of ``repeats`` rounds of
    :class:`LayerProfiler` after one warm-up round (layers in the cache are not measured again).

    ``fixed_from``: ``fn``'s arguments at a smaller batch (same structure, same layers); each
    layer's fixed part is then measured too (see the module docstring).
    """
    if fixed_from is not None:
        _smaller_ratio(args, fixed_from)  # bad input fails before the cache is read
    device_kind = jax.devices()[0].device_kind
    cache = cache if cache is not None else TimingCache(jax_version=jax.__version__)
    timings: dict[str, LayerTiming] = {}
    for layer in layers:
        cached = cache.get(layer.signature, device_kind)
        if cached is not None and (fixed_from is None or cached.forward_fixed_s is not None):
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
    forward and backward at the smaller batch too), compiled once, timed one round at a time.

    A round (:meth:`sample`) runs each piece once, in turn, so that a change of the machine's
    speed during the profile falls on every layer alike, and so that the rounds can be
    interleaved with other measurements (the executor bench times a plan's stages between them:
    a layer's pieces and the stage that runs it then see the same machine, and on the 2-core
    development machine their ratio held to ±5% over 6 rounds where separate profiles a minute
    apart moved a block by 1.8×, session 23).

    Args:
      fn, *args: the step and its arguments.
      graph, layers: the captured step and its layers.
      fixed_from: ``fn``'s arguments at a smaller batch.
      signatures: only the layers with these signatures (all if None).
    """

    def __init__(
        self,
        fn: Callable,
        *args,
        graph: OpGraph,
        layers: LayerGraph,
        fixed_from: tuple | None = None,
        signatures: Collection[str] | None = None,
        progress: Callable[[str], None] | None = None,
    ):
        self.device_kind = jax.devices()[0].device_kind
        distinct: dict[str, tuple[int, object]] = {}
        for index, layer in enumerate(layers):
            if signatures is None or layer.signature in signatures:
                distinct.setdefault(layer.signature, (index, layer))
        self.names = {signature: layer.name for signature, (_, layer) in distinct.items()}
        small = _smaller_batch(fn, args, fixed_from, layers) if fixed_from is not None else None
        self.ratio = small[2] if small else None
        sliced = SlicedStep(fn, *args, graph=graph)
        self.runs: dict[tuple[str, str, bool], PieceRun | None] = {}
        for signature, (index, layer) in distinct.items():
            if progress:
                progress(layer.name)
            for phase in PHASES:
                self.runs[(signature, phase, False)] = _piece_run(sliced, layer, phase)
            if small is not None:
                small_sliced, small_layers, _ = small
                for phase in ("forward", "backward"):
                    self.runs[(signature, phase, True)] = _piece_run(small_sliced, small_layers[index], phase)

    def sample(self) -> dict[tuple[str, str, bool], float]:
        """One run of every piece: seconds by (signature, phase, at the smaller batch); 0 for an empty phase."""
        return {key: run() if run is not None else 0.0 for key, run in self.runs.items()}

    def timings(self, samples: Sequence[Mapping[tuple[str, str, bool], float]]) -> dict[str, LayerTiming]:
        """Each layer's timing from the medians of ``samples`` (rounds of :meth:`sample`)."""
        if not samples:
            raise ValueError("LayerProfiler.timings needs at least one sample")
        median = {key: float(np.median([s[key] for s in samples])) for key in self.runs}
        out = {}
        for signature, name in self.names.items():
            fixed = {}
            if self.ratio is not None:
                fixed = {
                    f"{phase}_fixed_s": _intercept(
                        median[(signature, phase, False)], median[(signature, phase, True)], self.ratio
                    )
                    for phase in ("forward", "backward")
                }
            out[signature] = LayerTiming(
                signature=signature,
                name=name,
                device_kind=self.device_kind,
                forward_s=median[(signature, "forward", False)],
                backward_s=median[(signature, "backward", False)],
                optimizer_s=median[(signature, "optimizer", False)],
                **fixed,
            )
        return out


def _piece_run(sliced: SlicedStep, layer, phase: str) -> PieceRun | None:
    """``layer``'s ``phase`` as one compiled piece (None for an empty phase)."""
    ops = sliced.layer_phase_ops(layer.ops, (phase,))
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
