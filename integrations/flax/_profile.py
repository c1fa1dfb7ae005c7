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
) -> dict[str, LayerTiming]:
    """Timings of every distinct layer, by signature."""
    device_kind = jax.devices()[0].device_kind
    cache = cache if cache is not None else TimingCache(jax_version=jax.__version__)
    distinct = {}
    for layer in layers:
        distinct.setdefault(layer.signature, layer)
    timings: dict[str, LayerTiming] = {}
    sliced = None
    for signature, layer in distinct.items():
        cached = cache.get(signature, device_kind)
        if cached is not None:
            timings[signature] = cached
            continue
        if sliced is None:
            sliced = SlicedStep(fn, *args, graph=graph)
        if progress:
            progress(layer.name)
        seconds = {}
        for phase in PHASES:
            ops = sliced.layer_phase_ops(layer.ops, (phase,))
            if not ops:
                seconds[phase] = 0.0
                continue
            closed, avals = sliced.piece(ops)
            donate = sliced.reusable_inputs(ops, closed)
            seconds[phase] = time_piece(closed, avals, repeats=repeats, donate=donate)
        timing = LayerTiming(
            signature=signature,
            name=layer.name,
            device_kind=device_kind,
            forward_s=seconds["forward"],
            backward_s=seconds["backward"],
            optimizer_s=seconds["optimizer"],
        )
        cache.put(timing)
        timings[signature] = timing
    return timings
