"""Event-level replay of one training iteration of a plan.

Model (S stages, M microbatches; per stage s: forward f_s, backward b_s,
gradient sync y_s, optimizer o_s, from the plan — see ``_inputs``):

* **Compute streams.** Each stage is one in-order stream (its tp·dp devices
  run in lockstep) executing ``_schedule.stage_order``. F(s, i) waits for the
  activation of microbatch i from stage s − 1; B(s, i) waits for the gradient
  from stage s + 1. After its last backward a stage waits for its gradient
  sync, then runs the optimizer.
* **Virtual stages** (``plan.virtual_stages`` = v > 1, interleaved 1F1B): each
  stage runs v chunks in ``_schedule.chunk_order``, each taking 1/v of its
  forward and backward; chunk c of stage s is virtual stage c·S + s, so
  F(s, c, i) waits for F(s − 1, c, i), or on the first stage for
  F(S − 1, c − 1, i), whose activation crosses the wrap link from the last
  stage to the first (the last stage's ``to_next``); B waits likewise for the
  gradient from the next virtual stage. The gradient-sync buckets follow the
  stage's last backward (of chunk 0), spread over it as below.
* **Transfers.** When F(s, i) ends, its activation is sent to s + 1; when
  B(s + 1, i) ends, the gradient is sent back. A message takes its link's
  latency, then its bytes at the link's bandwidth. **Contention:** messages
  on one link resource share it equally (processor sharing): with n moving,
  each progresses at 1/n of the bandwidth; a message on several resources
  (a gradient-sync ring) moves at its slowest share. With
  ``overlap_p2p=True`` transfers run beside compute (asynchronous sends, as
  ``jax.device_put`` is); with ``False`` the sender's stream is held for an
  activation and the receiver's for a gradient, which is how the planner's
  ``time_s`` counts them (``2 · send_s`` per microbatch on the stage).
* **Gradient sync.** A stage's all-reduce is split into per-layer buckets
  (with the cost model) that start, one after another on the stage's
  communication stream, as the last microbatch's backward passes each layer
  (``overlap_dp_sync=True``); without the cost model, one bucket after the
  stage's last backward. With ``False`` every stage syncs after the whole
  pipeline has drained, as the closed form assumes. Sync traffic shares the
  links of its ring with point-to-point messages.
* **Memory** per device: static + (microbatches in flight) · activation bytes,
  plus transient bytes while a forward or backward runs; an activation is
  held from the start of its forward to the end of its backward.

The planner's closed form (``orchestrator.planner._closed_form``) is the max
over the critical paths of this same schedule — transfers beside compute on
their own link, the 1F1B in-flight cycle, each stage's per-layer sync buckets
behind its last backward (a two-machine flow shop, exact for these buckets) —
each a lower bound on the replay. It differs by design when:

* the plan's devices sit on faster links than the pessimistic one the planner
  prices a transfer on, or the data-parallel replicas of a stage send their
  shares over several links at once — shorter; contention on a shared link
  (point-to-point beside a sync ring) — longer;
* several critical paths nearly tie, so delays add up — longer.

``orchestrator bench planner`` reports the replay's step time beside the
closed form's for each plan it finds. With ``overlap_p2p=False,
overlap_dp_sync=False``, no cost model and equal stages, the replay is the
textbook ``(S + M − 1)·t + y + o`` with ``t`` counting both transfers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orchestrator.simulate._inputs import Piece, StageInputs, stage_inputs
from orchestrator.simulate._schedule import chunk_order
from orchestrator.simulate._timeline import Event, LinkStats, MemorySeries, StageStats, Timeline

if TYPE_CHECKING:  # plans are read, never built: the planner's solver is not imported at run time
    from orchestrator.planner import Plan


@dataclass(eq=False)
class _Message:
    piece: Piece
    start_s: float
    active_s: float  # latency over: starts moving
    remaining_s: float
    transfer: _Transfer
    moving: bool = False


@dataclass(eq=False)
class _Transfer:
    kind: str
    stage: int
    microbatch: int | None
    on_done: object  # callable() -> None
    blocking: bool = False
    layer: int | None = None
    resources: tuple[str, ...] = ()
    open: int = 0
    messages: list = field(default_factory=list)
    chunk: int = 0


class _Engine:
    def __init__(self, plan: Plan, inputs: list[StageInputs], *, overlap_p2p: bool, overlap_dp_sync: bool):
        self.plan, self.inputs = plan, inputs
        self.S, self.M = len(inputs), plan.microbatches
        self.V = plan.virtual_stages
        self.overlap_p2p, self.overlap_dp_sync = overlap_p2p, overlap_dp_sync
        self.t = 0.0
        scale = sum(
            (x.forward_s + x.backward_s) * self.M + x.optimizer_s + sum(b[2] for b in x.buckets) for x in inputs
        )
        scale += sum(p.work_s + p.latency_s for x in inputs for p in (*x.to_next, *x.to_previous)) * self.M * self.V
        self.eps = 1e-12 * max(scale, 1e-30)
        # (op, microbatch, chunk) per stage
        self.ops: list[list[tuple[str, int | None, int]]] = []
        for s in range(self.S):
            ops: list[tuple[str, int | None, int]] = []
            for phase, i, c in chunk_order(plan.schedule, self.S, self.M, s, self.V):
                sends = self.successor(s, c) is not None and not overlap_p2p
                if phase == "backward" and sends:
                    ops.append(("recv", i, c))
                ops.append((phase, i, c))
                if phase == "forward" and sends:
                    ops.append(("send", i, c))
            ops.append(("optimizer", None, 0))
            self.ops.append(ops)
        self.last_backward = [max(k for k, (p, *_) in enumerate(ops) if p == "backward") for ops in self.ops]
        self.next_op = [0] * self.S
        # (op, microbatch, chunk, start, end)
        self.running: list[tuple[str, int | None, int, float, float] | None] = [None] * self.S
        self.blocked: list[tuple[str, int, float] | None] = [None] * self.S  # a stream held by a transfer
        chunks = range(self.V)
        self.act_ready = [[[self.predecessor(s, c) is None] * self.M for c in chunks] for s in range(self.S)]
        self.grad_ready = [[[self.successor(s, c) is None] * self.M for c in chunks] for s in range(self.S)]
        self.backward_done = [[[False] * self.M for _ in chunks] for _ in range(self.S)]
        self.buckets_ready: list[list[float] | None] = [None] * self.S  # ready times, once known
        self.bucket_next = [0] * self.S
        self.bucket_busy = [False] * self.S
        self.messages: list[_Message] = []
        self.events: list[Event] = []
        self.stream_holds: list[tuple[int, float, float]] = []  # (stage, start, end) of blocking transfers
        self.moving: list[tuple[str, float, float, float]] = []  # (resource, start, end, bytes) of moving messages

    # -- virtual stages ----------------------------------------------------------
    def successor(self, s: int, c: int) -> tuple[int, int] | None:
        """(stage, chunk) of the virtual stage after chunk c of stage s (virtual stage c·S + s)."""
        if s < self.S - 1:
            return s + 1, c
        return (0, c + 1) if c < self.V - 1 else None

    def predecessor(self, s: int, c: int) -> tuple[int, int] | None:
        """(stage, chunk) of the virtual stage before chunk c of stage s."""
        if s > 0:
            return s - 1, c
        return (self.S - 1, c - 1) if c > 0 else None

    # -- transfers -------------------------------------------------------------
    def _send(self, transfer: _Transfer, pieces: tuple[Piece, ...]) -> None:
        pieces = tuple(p for p in pieces if p.work_s + p.latency_s > 0)
        if not pieces:
            self._finish_transfer(transfer, [])
            return
        transfer.open = len(pieces)
        for p in pieces:
            message = _Message(p, self.t, self.t + p.latency_s, p.work_s, transfer)
            transfer.messages.append(message)
            self.messages.append(message)

    def _finish_transfer(self, transfer: _Transfer, messages: list[_Message]) -> None:
        if transfer.kind == "dp_sync":
            start = min((m.start_s for m in messages), default=self.t)
            self.events.append(
                Event(
                    kind="dp_sync",
                    stage=transfer.stage,
                    microbatch=None,
                    start_s=start,
                    end_s=self.t,
                    resources=transfer.resources,
                    layer=transfer.layer,
                )
            )
        transfer.on_done()

    def _rates(self) -> dict[int, float]:
        load: dict[str, int] = {}
        for m in self.messages:
            if m.moving:
                for r in self._resources(m):
                    load[r] = load.get(r, 0) + 1
        return {id(m): min((1.0 / load[r] for r in self._resources(m)), default=1.0) for m in self.messages if m.moving}

    @staticmethod
    def _resources(m: _Message) -> tuple[str, ...]:
        return m.transfer.resources if m.transfer.kind == "dp_sync" else (m.piece.resource,)

    # -- streams ---------------------------------------------------------------
    def _ready(self, s: int, op: str, i: int | None, c: int) -> bool:
        if op == "forward":
            return self.act_ready[s][c][i]
        if op == "backward":
            return self.grad_ready[s][c][i]
        if op == "recv":
            s2, c2 = self.successor(s, c)  # type: ignore[misc]
            return self.backward_done[s2][c2][i]
        if op == "optimizer":
            return self.buckets_ready[s] is not None and self.bucket_next[s] == len(self.inputs[s].buckets)
        return True  # send: right after its forward

    def _start_ops(self) -> bool:
        changed = False
        for s in range(self.S):
            if self.running[s] or self.blocked[s] or self.next_op[s] == len(self.ops[s]):
                continue
            op, i, c = self.ops[s][self.next_op[s]]
            if not self._ready(s, op, i, c):
                continue
            changed = True
            x = self.inputs[s]
            if op in ("send", "recv"):
                self.blocked[s] = (op, i, self.t)
                self.next_op[s] += 1
                if op == "send":
                    self._send(self._transfer("send_activation", s, i, c, blocking=True), x.to_next)
                else:
                    self._send(self._transfer("send_gradient", s, i, c, blocking=True), x.to_previous)
                continue
            # a chunk's forward and backward take 1/v of the stage's
            chunk = {"forward": x.forward_s / self.V, "backward": x.backward_s / self.V}
            duration = chunk.get(op, x.optimizer_s)
            self.running[s] = (op, i, c, self.t, self.t + duration)
            if op == "backward" and self.next_op[s] == self.last_backward[s] and self.overlap_dp_sync:
                cumulative, ready = 0.0, []
                for _, fraction, _ in x.buckets:
                    cumulative += fraction
                    ready.append(self.t + duration * min(cumulative, 1.0))
                ready[-1] = self.t + duration
                self.buckets_ready[s] = ready
            self.next_op[s] += 1
        return changed

    def _transfer(self, kind: str, s: int, i: int | None, c: int, *, blocking: bool) -> _Transfer:
        """Between chunk c of stage s and the next virtual stage: the activation forward, or the
        gradient back to (s, c)."""

        def done() -> None:
            if kind == "send_activation":
                s2, c2 = self.successor(s, c)  # type: ignore[misc]
                self.act_ready[s2][c2][i] = True
            else:
                self.grad_ready[s][c][i] = True
            if blocking:
                _, _, start = self.blocked[s]
                self.stream_holds.append((s, start, self.t))
                self.blocked[s] = None

        return _Transfer(kind=kind, stage=s, microbatch=i, on_done=done, blocking=blocking, chunk=c)

    def _finish_ops(self) -> bool:
        changed = False
        for s in range(self.S):
            run = self.running[s]
            if run is None or run[4] > self.t + self.eps:
                continue
            op, i, c, start, end = run
            self.t = max(self.t, end)
            self.running[s] = None
            changed = True
            if op != "optimizer" or end > start:  # a stage without optimizer work shows none
                event = Event(kind=op, stage=s, microbatch=i, start_s=start, end_s=end, chunk=c)  # type: ignore[arg-type]
                self.events.append(event)
            if op == "forward" and self.successor(s, c) is not None and self.overlap_p2p:
                self._send(self._transfer("send_activation", s, i, c, blocking=False), self.inputs[s].to_next)
            if op == "backward":
                self.backward_done[s][c][i] = True
                back = self.predecessor(s, c)
                if back is not None and self.overlap_p2p:
                    s0, c0 = back
                    self._send(self._transfer("send_gradient", s0, i, c0, blocking=False), self.inputs[s0].to_previous)
                if not self.overlap_dp_sync and all(all(all(row) for row in rows) for rows in self.backward_done):
                    for k in range(self.S):
                        self.buckets_ready[k] = [self.t] * len(self.inputs[k].buckets)
        return changed

    def _start_syncs(self) -> bool:
        changed = False
        for s in range(self.S):
            ready, k = self.buckets_ready[s], self.bucket_next[s]
            if ready is None or self.bucket_busy[s] or k == len(ready) or ready[k] > self.t + self.eps:
                continue
            layer, _, work = self.inputs[s].buckets[k]
            changed = True
            if work <= 0:  # nothing to synchronise (DP 1): no event
                self.bucket_next[s] += 1
                continue
            self.bucket_busy[s] = True

            def done(s: int = s) -> None:
                self.bucket_busy[s] = False
                self.bucket_next[s] += 1

            transfer = _Transfer(
                kind="dp_sync", stage=s, microbatch=None, on_done=done, layer=layer,
                resources=self.inputs[s].sync_resources,
            )  # fmt: skip
            self._send(transfer, (Piece(resource="", latency_s=0.0, work_s=work, nbytes=None),))
        return changed

    def _progress_messages(self) -> bool:
        changed = False
        for m in self.messages:
            if not m.moving and m.active_s <= self.t + self.eps:
                m.moving, m.active_s = True, max(m.active_s, m.start_s)
                changed = True
        done = [m for m in self.messages if m.moving and m.remaining_s <= self.eps]
        for m in done:
            self.messages.remove(m)
            for r in self._resources(m):
                self.moving.append((r, m.active_s, self.t, m.piece.nbytes or 0.0))
            transfer = m.transfer
            if transfer.kind != "dp_sync":
                self.events.append(
                    Event(
                        kind=transfer.kind,  # type: ignore[arg-type]
                        stage=transfer.stage,
                        microbatch=transfer.microbatch,
                        chunk=transfer.chunk,
                        start_s=m.start_s,
                        end_s=self.t,
                        resources=(m.piece.resource,),
                        blocking=transfer.blocking,
                        nbytes=m.piece.nbytes,
                    )
                )
            transfer.open -= 1
            if transfer.open == 0:
                self._finish_transfer(transfer, transfer.messages)
            changed = True
        return changed

    # -- the loop ------------------------------------------------------------
    def run(self) -> None:
        for _ in range(10_000_000):
            while self._finish_ops() | self._progress_messages() | self._start_syncs() | self._start_ops():
                pass
            if all(n == len(ops) for n, ops in zip(self.next_op, self.ops)) and not any(self.running):
                if not self.messages:
                    return
            rates = self._rates()
            candidates = [run[4] for run in self.running if run]
            candidates += [m.active_s for m in self.messages if not m.moving]
            candidates += [self.t + m.remaining_s / rates[id(m)] for m in self.messages if m.moving]
            for s in range(self.S):
                ready, k = self.buckets_ready[s], self.bucket_next[s]
                if ready is not None and not self.bucket_busy[s] and k < len(ready):
                    candidates.append(ready[k])
            if not candidates:
                stuck = [
                    f"stage {s} at {self.ops[s][self.next_op[s]]}"
                    for s in range(self.S)
                    if self.next_op[s] < len(self.ops[s])
                ]
                raise RuntimeError(f"simulation deadlocked at t={self.t:.6g} s: {', '.join(stuck)}")
            t_next = max(min(candidates), self.t)
            dt = t_next - self.t
            for m in self.messages:
                if m.moving:
                    finish = self.t + m.remaining_s / rates[id(m)]
                    # messages finishing at t_next finish exactly (no rounding residue)
                    m.remaining_s = 0.0 if finish <= t_next + self.eps else m.remaining_s - dt * rates[id(m)]
            self.t = t_next
        raise RuntimeError("simulation did not finish in 10^7 steps")


def simulate(plan: Plan, model=None, *, overlap_p2p: bool = True, overlap_dp_sync: bool = True) -> Timeline:
    """Replay one training iteration of ``plan`` event by event (see the module docstring).

    Args:
      plan: a plan from :func:`orchestrator.planner.plan` or ``Plan.load``.
      model: the :class:`orchestrator.costs.CostModel` the plan was made
        with, or None. With it: transfers in bytes over the plan devices'
        actual links, per-layer gradient-sync overlap and memory in bytes.
        Without it: transfers of ``send_s`` seconds, whole-stage syncs, and
        memory as microbatches in flight only.
      overlap_p2p: transfers run beside compute (True, as the closed form
        counts them) or hold the compute stream (False: blocking sends).
      overlap_dp_sync: gradient sync starts during the last backward (True,
        as the closed form) or after the whole pipeline (False).

    Returns:
      The :class:`Timeline`.

    Raises:
      ValueError: an inconsistent plan, or a plan that does not match ``model``.

    Example:
      >>> from orchestrator.planner import Plan, Stage
      >>> stage = dict(layers=(0,), device_type="x", tp=1, dp=1, recompute=False, microbatch_size=1,
      ...              time_s=3.0, forward_s=1.0, memory_bytes=0.0)
      >>> plan = Plan(stages=(Stage(devices=("h/0",), **stage), Stage(devices=("h/1",), **stage)),
      ...             schedule="1f1b", microbatches=4, global_batch=4, iteration_s=15.0)
      >>> simulate(plan).iteration_s, simulate(plan).bubble_fraction
      (15.0, 0.2)
    """
    inputs = stage_inputs(plan, model)
    engine = _Engine(plan, inputs, overlap_p2p=overlap_p2p, overlap_dp_sync=overlap_dp_sync)
    engine.run()
    return _timeline(
        plan, inputs, engine, overlap_p2p=overlap_p2p, overlap_dp_sync=overlap_dp_sync, with_costs=model is not None
    )


def compare(plan: Plan, model=None) -> tuple[float, float, float]:
    """(the plan's closed-form step time, the simulated one, (simulated − closed) / closed).

    The simulation uses the defaults of :func:`simulate` (transfers and
    gradient sync overlapped, real links with contention); see the module
    docstring for where and why the two differ.

    Args:
      plan: the plan (its ``iteration_s`` is the closed form).
      model: its cost model, or None (see :func:`simulate`).

    Returns:
      ``(closed_form_s, simulated_s, rel_diff)``.
    """
    timeline = simulate(plan, model)
    return timeline.closed_form_s, timeline.iteration_s, timeline.rel_diff


def _sweep(intervals: list[tuple[float, float]]) -> tuple[float, float, int]:
    """(time covered by ≥ 1 interval, by ≥ 2, most at once)."""
    points = sorted(
        [(a, 1) for a, b in intervals if b > a] + [(b, -1) for a, b in intervals if b > a], key=lambda p: (p[0], p[1])
    )
    covered = shared = 0.0
    live = peak = 0
    last = 0.0
    for t, delta in points:
        if live >= 1:
            covered += t - last
        if live >= 2:
            shared += t - last
        live += delta
        peak = max(peak, live)
        last = t
    return covered, shared, peak


def _timeline(plan: Plan, inputs: list[StageInputs], engine: _Engine, **options) -> Timeline:
    events = sorted(engine.events, key=lambda e: (e.start_s, e.stage, e.kind, e.microbatch or 0))
    iteration = max((e.end_s for e in events), default=0.0)
    pipeline = max((e.end_s for e in events if e.kind == "backward"), default=0.0)
    stats, memory = [], []
    weighted_bubble = weighted_span = 0.0
    for s, (stage, x) in enumerate(zip(plan.stages, inputs)):
        mine = [e for e in events if e.stage == s and e.kind in ("forward", "backward", "optimizer")]
        holds = sum(b - a for k, a, b in engine.stream_holds if k == s)
        pipe_busy = sum(e.duration_s for e in mine if e.kind != "optimizer") + holds
        busy = sum(e.duration_s for e in mine) + holds
        series = _memory(s, stage.devices, mine, x, plan.virtual_stages)
        stats.append(
            StageStats(
                stage=s,
                devices=stage.devices,
                busy_s=busy,
                idle_s=iteration - busy,
                bubble_s=pipeline - pipe_busy,
                peak_in_flight=max(series.in_flight),
                peak_memory_bytes=max(series.bytes) if series.bytes else None,
                predicted_memory_bytes=stage.memory_bytes,
            )
        )
        memory.append(series)
        weighted_bubble += len(stage.devices) * (pipeline - pipe_busy)
        weighted_span += len(stage.devices) * pipeline
    by_resource: dict[str, list[tuple[float, float, float]]] = {}
    for r, a, b, nbytes in engine.moving:
        by_resource.setdefault(r, []).append((a, b, nbytes))
    links = []
    for name in sorted(by_resource):
        covered, shared, peak = _sweep([(a, b) for a, b, _ in by_resource[name]])
        links.append(
            LinkStats(
                name=name,
                busy_s=covered,
                utilisation=covered / iteration if iteration else 0.0,
                contended_s=shared,
                peak_messages=peak,
                nbytes=sum(n for _, _, n in by_resource[name]),
            )
        )
    return Timeline(
        schedule=plan.schedule,
        stages=len(plan.stages),
        microbatches=plan.microbatches,
        events=tuple(events),
        iteration_s=iteration,
        pipeline_s=pipeline,
        closed_form_s=plan.iteration_s,
        bubble_fraction=weighted_bubble / weighted_span if weighted_span else 0.0,
        stage_stats=tuple(stats),
        link_stats=tuple(links),
        memory=tuple(memory),
        **options,
    )


def _memory(s: int, devices: tuple[str, ...], events: list[Event], x: StageInputs, chunks: int) -> MemorySeries:
    """In flight: (chunk, microbatch) pairs, each holding 1/``chunks`` of the stage's activation bytes."""
    # at one instant, frees (ends) before allocations (starts)
    changes = []
    for e in events:
        if e.kind == "optimizer":
            continue
        changes.append((e.start_s, 1, e.kind, "start"))
        changes.append((e.end_s, 0, e.kind, "end"))
    changes.sort(key=lambda c: (c[0], c[1]))
    times, in_flight, transient = [0.0], [0], [False]
    live, running = 0, False
    for t, _, kind, edge in changes:
        if edge == "start":
            running = True
            live += kind == "forward"
        else:
            running = False
            live -= kind == "backward"
        if times[-1] == t:
            in_flight[-1], transient[-1] = live, running
        else:
            times.append(t)
            in_flight.append(live)
            transient.append(running)
    nbytes = None
    if x.static_bytes is not None:
        nbytes = tuple(
            x.static_bytes + k * x.activation_bytes / chunks + (x.transient_bytes if busy else 0.0)
            for k, busy in zip(in_flight, transient)
        )
    return MemorySeries(stage=s, devices=devices, times_s=tuple(times), in_flight=tuple(in_flight), bytes=nbytes)
