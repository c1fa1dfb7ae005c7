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

from collections.abc import Callable

import jax

from integrations.flax._slice import SlicedStep, time_piece
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
    """Timings of every distinct layer, by signature.

    ``fixed_from``: ``fn``'s arguments at a smaller batch (same structure, same layers); each
    layer's fixed part is then measured too (see the module docstring).
    """
    device_kind = jax.devices()[0].device_kind
    cache = cache if cache is not None else TimingCache(jax_version=jax.__version__)
    small = _smaller_batch(fn, args, fixed_from, layers) if fixed_from is not None else None
    distinct = {}
    for index, layer in enumerate(layers):
        distinct.setdefault(layer.signature, (index, layer))
    timings: dict[str, LayerTiming] = {}
    sliced = None
    for signature, (index, layer) in distinct.items():
        cached = cache.get(signature, device_kind)
        if cached is not None and (small is None or cached.forward_fixed_s is not None):
            timings[signature] = cached
            continue
        if sliced is None:
            sliced = SlicedStep(fn, *args, graph=graph)
        if progress:
            progress(layer.name)
        seconds = _phase_seconds(sliced, layer, PHASES, repeats)
        fixed = {}
        if small is not None:
            small_sliced, small_layers, ratio = small
            at_small = _phase_seconds(small_sliced, small_layers[index], ("forward", "backward"), repeats)
            fixed = {f"{phase}_fixed_s": _intercept(seconds[phase], at_small[phase], ratio) for phase in at_small}
        timing = LayerTiming(
            signature=signature,
            name=layer.name,
            device_kind=device_kind,
            forward_s=seconds["forward"],
            backward_s=seconds["backward"],
            optimizer_s=seconds["optimizer"],
            **fixed,
        )
        cache.put(timing)
        timings[signature] = timing
    return timings


def _phase_seconds(sliced: SlicedStep, layer, phases, repeats: int) -> dict[str, float]:
    """Median seconds of each of ``phases`` of ``layer``, each its own compiled piece (0 for an empty phase)."""
    seconds = {}
    for phase in phases:
        ops = sliced.layer_phase_ops(layer.ops, (phase,))
        if not ops:
            seconds[phase] = 0.0
            continue
        closed, avals = sliced.piece(ops)
        donate = sliced.reusable_inputs(ops, closed)
        seconds[phase] = time_piece(closed, avals, repeats=repeats, donate=donate)
    return seconds


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

    batch, small = _batch_of(args), _batch_of(small_args)
    if not 0 < small < batch:
        raise ValueError(f"fixed_from needs a smaller batch than the profile's {batch}, got {small}")
    graph = capture(fn, *small_args)
    small_layers = coarsen(graph)
    if [layer.name for layer in small_layers] != [layer.name for layer in layers]:
        raise ValueError("fixed_from gives other layers than the profiled step: pass the same step at a smaller batch")
    return SlicedStep(fn, *small_args, graph=graph), small_layers, small / batch


def _intercept(at_batch: float, at_small: float, ratio: float) -> float:
    """The line through (1, at_batch) and (ratio, at_small), at 0, clamped to [0, at_small]."""
    slope = (at_batch - at_small) / (1 - ratio)
    return min(max(at_small - ratio * slope, 0.0), at_small)
