"""What the simulator needs per stage, read from a Plan and (optionally) the cost model it was made with.

Durations of compute always come from the plan (the planner's own per-stage
numbers): forward ``forward_s``, backward ``time_s − forward_s − 2·send_s``,
optimizer ``optimizer_s``, gradient sync ``dp_sync_s``. The cost model, when
given, adds what the plan does not carry:

* the bytes of each point-to-point transfer — the last layer's output
  activation for one microbatch, ``activation_bytes(ℓ) · (global_batch / M) / B``
  — split by the samples each data-parallel replica holds and sent over the
  links the plan's devices actually cross (``Cluster.link``); without it a
  transfer is one message of ``send_s`` seconds between the stages' first
  devices. Under virtual stages the last stage sends to the first (the wrap
  between chunks): the output of its first chunk's last layer;
* per-layer shares of the backward pass and of the gradient sync, so a
  layer's gradients can be synchronised while the last microbatch's backward
  is still running through earlier layers;
* memory per device: static bytes (parameters + gradients + optimizer
  state), activation bytes kept per in-flight microbatch and transient bytes,
  summed over the stage's layers as the planner sums them.

Link resources: a transfer between two devices of one host occupies the
directed device pair (an NVSwitch-like fabric gives each pair its own
bandwidth); a transfer between hosts occupies the directed host pair (one
network path per pair of hosts). Links are full duplex: activations forward
and gradients back do not share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the simulator reads plans; it never needs the planner's solver at run time
    from orchestrator.planner import Plan, Stage


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece:
    """One message of a transfer: over ``resource``, ``latency_s`` then ``work_s`` at the link's full bandwidth."""

    resource: str
    latency_s: float
    work_s: float
    nbytes: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class StageInputs:
    forward_s: float
    backward_s: float
    optimizer_s: float
    # (layer or None, fraction of the backward pass, gradient-sync seconds), in backward (reverse layer) order
    buckets: tuple[tuple[int | None, float, float], ...]
    sync_resources: tuple[str, ...]
    to_next: tuple[Piece, ...]  # activation to stage s+1 (empty for the last stage)
    to_previous: tuple[Piece, ...]  # gradient of this stage's input, back from stage s+1 to s: stored on s
    static_bytes: float | None
    activation_bytes: float | None
    transient_bytes: float | None


def resource(a: str, b: str) -> str:
    """The link resource a message from device ref ``a`` to device ref ``b`` occupies."""
    host_a, host_b = a.split("/")[0], b.split("/")[0]
    return f"{a}→{b}" if host_a == host_b else f"{host_a}→{host_b}"


def replicas(stage: Stage) -> list[tuple[str, ...]]:
    """The stage's data-parallel replicas, each ``tp·cp`` consecutive devices (replica-major order)."""
    size = stage.tp * stage.cp
    return [stage.devices[r * size : (r + 1) * size] for r in range(stage.dp)]


def sync_ring(stage: Stage) -> tuple[str, ...]:
    """Link resources of the data-parallel rings (replica r's rank j → replica r+1's rank j)."""
    if stage.dp < 2:
        return ()
    reps = replicas(stage)
    links = {resource(a[j], b[j]) for a, b in zip(reps, [*reps[1:], reps[0]]) for j in range(stage.tp)}
    return tuple(sorted(links))


def replica_bounds(stage: Stage) -> list[tuple[float, float]]:
    """The part of the microbatch each data-parallel replica holds, as [start, end) fractions:
    equal parts, or on two device types each part's replicas their share (``Stage.shares``)."""
    if not stage.shares:
        return [(r / stage.dp, (r + 1) / stage.dp) for r in range(stage.dp)]
    samples = [b for (_, n), b in zip(stage.parts, stage.shares) for _ in range(n // stage.tp)]
    total, start, out = sum(samples), 0, []
    for b in samples:
        out.append((start / total, (start + b) / total))
        start += b
    return out


def device_types(stage: Stage) -> list[str]:
    """The type each of the stage's devices should be (``devices`` order)."""
    return (
        [kind for kind, n in stage.parts for _ in range(n)] if stage.parts else [stage.device_type] * len(stage.devices)
    )


def _pairs(a: Stage, b: Stage) -> list[tuple[str, str, float]]:
    """(device of a, device of b, fraction of the microbatch) for every replica pair that shares samples."""
    out = []
    for ra, (a_lo, a_hi) in zip(replicas(a), replica_bounds(a)):
        for rb, (b_lo, b_hi) in zip(replicas(b), replica_bounds(b)):
            lo, hi = max(a_lo, b_lo), min(a_hi, b_hi)
            if hi > lo:
                out.append((ra[0], rb[0], hi - lo))
    return out


def check(plan: Plan) -> None:
    """Raise ValueError naming the first inconsistent stage of ``plan``."""
    if not plan.stages:
        raise ValueError("the plan has no stages")
    if plan.microbatches < 1:
        raise ValueError(f"the plan has {plan.microbatches} microbatches; it needs at least 1")
    for s, st in enumerate(plan.stages):
        if len(st.devices) != st.tp * st.cp * st.dp:
            ring = f" · cp {st.cp}" if st.cp > 1 else ""
            raise ValueError(f"stage {s} lists {len(st.devices)} devices but tp·dp = {st.tp}·{st.dp}{ring}")
        if any("/" not in d for d in st.devices):
            raise ValueError(f"stage {s} has a device ref without 'host/index': {st.devices}")
        backward = st.time_s - st.forward_s - 2 * st.send_s
        if st.forward_s < 0 or backward < -1e-12 * max(1.0, st.time_s):
            raise ValueError(
                f"stage {s}: time_s {st.time_s:.6g} < forward_s {st.forward_s:.6g} + 2·send_s {st.send_s:.6g}"
            )


def stage_inputs(plan: Plan, model=None) -> list[StageInputs]:
    """Per-stage inputs of the simulation (see the module docstring); ``model`` is a CostModel or None."""
    check(plan)
    S = len(plan.stages)
    if model is not None:
        _check_model(plan, model)
    out = []
    for s, st in enumerate(plan.stages):
        backward = max(0.0, st.time_s - st.forward_s - 2 * st.send_s)
        # under virtual stages the last stage's chunks hand over to the first stage's next chunks
        nxt = plan.stages[s + 1] if s + 1 < S else (plan.stages[0] if plan.virtual_stages > 1 else None)
        if model is None:
            buckets = ((None, 1.0, st.dp_sync_s),)
            memory = (None, None, None)
            if nxt is None:
                fwd, bwd = (), ()
            else:
                fwd = (
                    Piece(
                        resource=resource(st.devices[0], nxt.devices[0]), latency_s=0.0, work_s=st.send_s, nbytes=None
                    ),
                )
                bwd = (
                    Piece(
                        resource=resource(nxt.devices[0], st.devices[0]), latency_s=0.0, work_s=st.send_s, nbytes=None
                    ),
                )
        else:
            buckets, memory = _layer_costs(plan, st, model)
            last = st.layers[len(st.layers) // plan.virtual_stages - 1] if s == S - 1 else st.layers[-1]
            fwd, bwd = _transfers(plan, st, nxt, model, last) if nxt is not None else ((), ())
        out.append(
            StageInputs(
                forward_s=st.forward_s,
                backward_s=backward,
                optimizer_s=st.optimizer_s,
                buckets=buckets,
                sync_resources=sync_ring(st),
                to_next=fwd,
                to_previous=bwd,
                static_bytes=memory[0],
                activation_bytes=memory[1],
                transient_bytes=memory[2],
            )
        )
    return out


def _check_model(plan: Plan, model) -> None:
    layers = [layer for st in plan.stages for layer in st.layers]
    if sorted(layers) != list(range(len(model.layers))):
        raise ValueError(
            f"the plan's stages hold {len(layers)} layer slot(s) ({min(layers)}–{max(layers)}) but the cost model "
            f"has layers 0–{len(model.layers) - 1}: the plan was made for another model"
        )
    devices = {d.ref: d for d in model.cluster.all_devices()}
    for s, st in enumerate(plan.stages):
        for ref, kind in zip(st.devices, device_types(st)):
            if ref not in devices:
                raise ValueError(f"stage {s} uses device {ref!r}, which cluster {model.cluster.name!r} does not have")
            if devices[ref].device_type != kind:
                raise ValueError(
                    f"stage {s} expects {kind!r} devices but {ref} of cluster {model.cluster.name!r} "
                    f"is a {devices[ref].device_type!r}: the plan was made for another cluster"
                )


def _links(st: Stage, model):
    """(tensor-parallel link, data-parallel link) of the stage's actual devices."""
    devices = {d.ref: d for d in model.cluster.all_devices()}
    reps = replicas(st)
    tp_link = model.cluster.slowest_link([devices[r] for r in reps[0]]) if st.tp > 1 else None
    dp_link = model.cluster.slowest_link([devices[r[0]] for r in reps]) if st.dp > 1 else None
    return tp_link, dp_link


def _layer_costs(plan: Plan, st: Stage, model):
    """Per-layer backward shares and gradient-sync buckets, and memory per device. On two device
    types each layer takes the slower part's backward and sync, and each memory term the larger
    part's (a bound on both parts' peaks)."""
    from orchestrator.costs import ParallelConfig, all_reduce_s

    tp_link, dp_link = _links(st, model)
    parts = st.parts or ((st.device_type, len(st.devices)),)
    shares = st.shares or (st.microbatch_size,)
    per_part = []
    for (kind, _), samples in zip(parts, shares):
        config = ParallelConfig(
            tp=st.tp, dp=st.dp, microbatch_size=samples, recompute=st.recompute, zero=st.zero, context_parallel=st.cp
        )
        per_part.append(
            [model.layer_cost(layer, kind, config, tp_link=tp_link, dp_link=dp_link) for layer in st.layers]
        )
    costs = [max(layer, key=lambda c: c.backward_s + c.tp_comm_s) for layer in zip(*per_part)]
    backward = []
    for cost in costs:
        tp_forward = all_reduce_s(cost.breakdown.get("tp_forward_bytes", 0.0), st.tp, tp_link) if tp_link else 0.0
        backward.append(cost.backward_s + cost.tp_comm_s - tp_forward)
    total_backward = sum(backward) or 1.0
    total_sync = sum(c.dp_sync_s for c in costs)
    buckets = tuple(
        (
            layer,
            b / total_backward if sum(backward) else 1.0 / len(costs),
            st.dp_sync_s * (c.dp_sync_s / total_sync) if total_sync else st.dp_sync_s / len(costs),
        )
        for layer, b, c in reversed(list(zip(st.layers, backward, costs)))
    )
    static = max(sum(c.param_bytes + c.grad_bytes + c.optimizer_bytes for c in part) for part in per_part)
    activation = max(sum(c.activation_bytes for c in part) for part in per_part)
    transient = max(c.transient_bytes for part in per_part for c in part)
    return buckets, (static, activation, transient)


def _transfers(plan: Plan, st: Stage, nxt: Stage, model, layer: int) -> tuple[tuple[Piece, ...], tuple[Piece, ...]]:
    """The messages of ``layer``'s output from ``st`` to ``nxt`` and of its gradient back."""
    devices = {d.ref: d for d in model.cluster.all_devices()}
    # (bytes of the layer's output per captured batch) scaled to one microbatch of the whole pipeline
    nbytes = model.layers[layer].activation_bytes * (plan.global_batch / plan.microbatches) / model.batch_size
    fwd: list[Piece] = []
    bwd: list[Piece] = []
    if nbytes <= 0:
        return (), ()
    for a, b, share in _pairs(st, nxt):
        for src, dst, out in ((a, b, fwd), (b, a, bwd)):
            link = model.cluster.link(devices[src], devices[dst])
            out.append(
                Piece(
                    resource=resource(src, dst),
                    latency_s=link.latency_s,
                    work_s=nbytes * share / link.bandwidth_bytes_per_s,
                    nbytes=nbytes * share,
                )
            )
    return tuple(fwd), tuple(bwd)
