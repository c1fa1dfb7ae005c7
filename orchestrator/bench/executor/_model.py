"""The executor bench's model of a stage and a step on virtual CPU devices sharing the host's cores.

The cost model prices one device running alone. On the ``local`` cluster n virtual devices share
c cores, and the host's own costs are measured (:mod:`._host`): the slowdown s(k) of k devices
busy at once, the dispatch d(k) of a call to k devices, the wake-up w(k) of a call that follows
other devices' work, the host time b per device buffer a call moves, and the share β(k) of a
multi-device call's run the dispatching thread is held for. The profile gives one more: b_p,
what cutting a program in two costs on one device (the layers' pieces against the whole step's,
:meth:`~integrations.flax._profile.LayerProfiler.boundary_seconds`). A stage of L layers alone
is predicted as

    D = max(0, F + B − (L − 1) · b_p) · s(k),   D_f = D · F / (F + B),   D_b = D − D_f
    t = h_f + max(D_f, h_b) + D_b,   h_f = d(k) + w(k) + N_f · b,   h_b = d(k) + N_b · b

where F and B come from profiled pieces less their own calls' host time, the stage runs as one
forward and one backward program where its layers were profiled as L of each
(:func:`device_seconds`), every part of it is slowed by the k devices sharing the cores
(:func:`slowed_seconds`), and the host prepares the backward while the devices run the forward
(:func:`predicted_stage_seconds`). The simulated step (F, B: forward and backward with TP
all-reduces per microbatch, U: optimizer update and gradient sync, all at single-device speed;
W_s = D_s of stage s; D_k dispatches to k devices and N buffers per step, counted by observing
the executor) is

    host = Σ_k D_k · (d(k) + e) + N · b + Σ_s w(k_s)
    held = Σ_s β(k_s) · (M · W_s + s(k_s) · U_s)
    step = max( pipeline replay of the plan's schedule with stage times W_s,
                host + held,
                Σ_s k_s · (M · W_s / s(k_s) + U_s) · s(n) / n + host / c )

e is the executor's own host time per dispatch, its Python work around each call, which d(k) (a
bare jitted call) and b leave out (:func:`~._cases.executor_seconds`): fitted once per ranking
on the 2-stage plan at sequence length 1, where the devices have next to nothing to do, as the
median measured step less the simulated one, per dispatch. A pipeline makes tens of dispatches a
step where one stage makes 3, so without e it ranks below single-stage plans it is slower than.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax

from orchestrator.bench.executor._setup import Setup
from orchestrator.simulate import stage_order


def _stage_costs(plan, su: Setup):
    """Per stage: (forward s, backward s, update s, send s) per device at single-device speed, from the
    cost model."""
    from orchestrator.costs import ParallelConfig

    link = su.model.default_link(su.device_type)
    out = []
    for s, stage in enumerate(plan.stages):
        tp = stage.tp if su.model.tensor_parallel else 1  # no axis names: TP shards nothing
        config = ParallelConfig(
            tp=tp, dp=stage.dp, microbatch_size=stage.microbatch_size, accumulate_gradients=len(plan.stages) > 1
        )
        fwd = bwd = upd = 0.0
        for index in stage.layers:
            cost = su.model.layer_cost(index, su.device_type, config)
            share = cost.tp_comm_s / 2
            fwd += cost.forward_s + share
            bwd += cost.backward_s + share
            upd += cost.optimizer_s + cost.dp_sync_s
        last = su.layers[stage.layers[-1]]
        send = (
            0.0
            if s + 1 == len(plan.stages)
            else link.time_s(last.activation_bytes * stage.microbatch_size / plan.global_batch * stage.dp)
        )
        out.append((fwd, bwd, upd, send))
    return out


def device_seconds(work_s: float, stage, su: Setup) -> float:
    """A stage's forward + backward of one microbatch at one device's speed: its layers' pieces,
    ``work_s``, less the program boundaries they have and the stage does not (b_p each,
    ``HostCosts.boundary_s``): the stage runs as one forward and one backward program, its L layers
    were profiled as L of each, so max(0, work − (L − 1) · b_p)."""
    return max(0.0, work_s - (len(stage.layers) - 1) * su.host.boundary_s)


def slowed_seconds(work_s: float, stage, su: Setup) -> float:
    """A stage's forward + backward on its k devices busy at once: :func:`device_seconds` · s(k).

    Every part is slowed alike: what cutting the stage into per-layer programs adds is priced
    apart (:func:`device_seconds`), the profile covers the per-device batches the stages run, and
    s(k) is measured as one program over k devices, as a stage runs (:mod:`._host`).
    """
    return device_seconds(work_s, stage, su) * su.host.slow(len(stage.devices))


def predicted_stage_seconds(
    plan, su: Setup, *, buffers: list[int] | None = None, forward_buffers: list[int] | None = None
) -> list[float]:
    """Per stage: predicted forward + backward of one microbatch, run alone.

    The devices' time D is the single-device time slowed for k devices busy at once
    (:func:`slowed_seconds`), split into forward D_f and backward D_b as the cost model splits
    it. The host's time for a call is a dispatch to k devices d(k), the executor's own e (0 here
    unless set; the ranking fits it) and b per device buffer the call takes and returns: h_f for
    the forward's ``forward_buffers[s]``, h_b for the backward's (``buffers[s]`` less those; half
    each when not given). The forward, the stage's first call, also waits for its devices' threads
    to wake, w(k). The host prepares the backward while the devices run the forward, so

        t = h_f + max(D_f, h_b) + D_b,   h_f = d(k) + e + w(k) + N_f · b,   h_b = d(k) + e + N_b · b.

    Overlapping the two matters for the stages of many devices: each call moves thousands of buffers
    and their host time is a large share of the stage's.
    """
    host = su.host
    out = []
    for s, (stage, (f, b, _, _)) in enumerate(zip(plan.stages, _stage_costs(plan, su))):
        k = len(stage.devices)
        device = slowed_seconds(f + b, stage, su)
        device_f = device * f / (f + b) if f + b else 0.0
        n = buffers[s] if buffers else 0
        n_f = forward_buffers[s] if forward_buffers else n / 2
        call = host.dispatch(k) + host.executor_s
        # the stage's first call comes after other devices' work: its devices' threads wake first
        host_f, host_b = call + host.wake(k) + n_f * host.buffer_s, call + (n - n_f) * host.buffer_s
        out.append(host_f + max(device_f, host_b) + device - device_f)
    return out


def _orders(plan) -> list[list[tuple[str, int]]]:
    """Per stage, its ("F" | "B", microbatch) steps in the order :func:`orchestrator.simulate.stage_order` gives."""
    n = len(plan.stages)
    return [
        [("F" if phase == "forward" else "B", mb) for phase, mb in stage_order(plan.schedule, n, plan.microbatches, s)]
        for s in range(n)
    ]


def _replay(plan) -> dict:
    """The plan's stage times replayed in its schedule's order as Chrome trace events: stage s
    runs its (F | B, microbatch) steps in :func:`orchestrator.simulate.stage_order`, F(s, m) after
    F(s−1, m) plus ``send_s``, B(s, m) after B(s+1, m) plus ``send_s``, B lasting
    ``time_s − forward_s − 2·send_s``, the update after the last backward. Unlike
    :func:`orchestrator.simulate.simulate` no two sends share a link: on one host a send is a copy
    between virtual devices, not a message on a wire."""
    n = len(plan.stages)
    orders = _orders(plan)
    end: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * n
    position = [0] * n
    events = []
    while any(position[s] < len(orders[s]) for s in range(n)):
        progressed = False
        for s, stage in enumerate(plan.stages):
            if position[s] >= len(orders[s]):
                continue
            op, mb = orders[s][position[s]]
            if op == "F":
                dep = ("F", s - 1, mb) if s > 0 else None
                ready = end[dep] + plan.stages[s - 1].send_s if dep else 0.0
                duration = stage.forward_s
            else:
                dep = ("B", s + 1, mb) if s + 1 < n else ("F", s, mb)
                ready = end[dep] + (stage.send_s if s + 1 < n else 0.0) if dep in end else None
                duration = max(0.0, stage.time_s - stage.forward_s - 2 * stage.send_s)
            if dep is not None and dep not in end:
                continue
            start = max(clock[s], ready or 0.0)
            end[(op, s, mb)] = clock[s] = start + duration
            events.append(
                {"name": f"{op}{mb}", "ph": "X", "pid": 0, "tid": s, "ts": start * 1e6, "dur": duration * 1e6}
            )
            position[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {plan.schedule!r} deadlocked")
    for s, stage in enumerate(plan.stages):
        duration = stage.dp_sync_s + stage.optimizer_s
        events.append({"name": "update", "ph": "X", "pid": 0, "tid": s, "ts": clock[s] * 1e6, "dur": duration * 1e6})
    names = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": {"name": f"stage {s}"}} for s in range(n)]
    return {"traceEvents": names + events, "displayTimeUnit": "ms"}


def simulated_step_s(plan, su: Setup, *, dispatches: Mapping[int, int], buffers: int = 0) -> float:
    """Predicted step time on the shared-core host (see module docstring); ``dispatches`` counts the
    step's host dispatches by the number of devices each goes to."""
    costs = _stage_costs(plan, su)
    timed = []
    busy = held = 0.0
    for stage, (f, b, u, send) in zip(plan.stages, costs):
        slow = su.host.slow(len(stage.devices))
        both = slowed_seconds(f + b, stage, su)  # forward + backward of one microbatch
        held += su.host.blocked(len(stage.devices)) * (plan.microbatches * both + u * slow)
        timed.append(
            dataclasses.replace(
                stage,
                forward_s=both * f / (f + b) if f + b else 0.0,
                time_s=both + 2 * send,
                send_s=send,
                optimizer_s=u * slow,
                dp_sync_s=0.0,
            )
        )
        # the cores' work
        busy += len(stage.devices) * (plan.microbatches * device_seconds(f + b, stage, su) + u)
    replay = _replay(dataclasses.replace(plan, stages=tuple(timed)))
    makespan = max(e["ts"] + e["dur"] for e in replay["traceEvents"] if e["ph"] == "X") / 1e6
    dispatch_s = sum(n * (su.host.dispatch(k) + su.host.executor_s) for k, n in dispatches.items())
    # each stage's first call of the step follows other devices' work: its devices wake, once a step
    host = dispatch_s + buffers * su.host.buffer_s + sum(su.host.wake(len(stage.devices)) for stage in plan.stages)
    everyone = len(jax.devices())
    return max(makespan, host + held, busy * su.host.slow(everyone) / everyone + host / su.cores)
