"""The result of a simulation: every event of one training iteration and what follows from them."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

EventKind = Literal["forward", "backward", "send_activation", "send_gradient", "dp_sync", "optimizer"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """One interval of work.

    Attributes:
      kind: what runs. Compute (``forward``, ``backward``, ``optimizer``) runs
        on every device of ``stage``; transfers and ``dp_sync`` run on links.
      stage: the stage that computes, or that sends (activations go
        ``stage → stage + 1``, gradients ``stage + 1 → stage``: both carry the
        lower stage's number, whose ``send_s`` they cost).
      microbatch: None for ``dp_sync`` and ``optimizer``.
      start_s, end_s: seconds from the start of the iteration.
      resources: link resources a transfer or sync occupies ("a→b"); empty for compute.
      blocking: a transfer that also held its stage's compute stream (``overlap_p2p=False``).
      layer: the layer whose gradients a ``dp_sync`` bucket synchronises (None: the whole stage).
      nbytes: bytes of a transfer when the cost model is known.
      chunk: the model chunk of a forward, backward or transfer under virtual stages (0 without);
        the activation of the last stage's chunk c < v − 1 goes to the first stage's chunk c + 1.
    """

    kind: EventKind
    stage: int
    microbatch: int | None
    start_s: float
    end_s: float
    resources: tuple[str, ...] = ()
    blocking: bool = False
    layer: int | None = None
    nbytes: float | None = None
    chunk: int = 0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, slots=True, kw_only=True)
class StageStats:
    """One stage; each of its devices runs the same timeline.

    Attributes:
      busy_s: compute-stream time (forward, backward, optimizer, and blocking transfers).
      idle_s: ``iteration_s − busy_s``.
      bubble_s: idle time of the compute stream before the pipeline ends
        (``pipeline_s − `` its forward, backward and blocking-transfer time).
      peak_in_flight: most microbatches whose activations it held at once.
      peak_memory_bytes: simulated peak per device (None without the cost model).
      predicted_memory_bytes: the plan's ``memory_bytes``.
    """

    stage: int
    devices: tuple[str, ...]
    busy_s: float
    idle_s: float
    bubble_s: float
    peak_in_flight: int
    peak_memory_bytes: float | None
    predicted_memory_bytes: float


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkStats:
    """One link resource (a directed device pair inside a host, or a directed host pair).

    Attributes:
      busy_s: time with at least one message moving on it.
      utilisation: ``busy_s / iteration_s``.
      contended_s: time with two or more messages sharing it.
      peak_messages: most messages at once.
      nbytes: point-to-point bytes moved (gradient syncs are counted in time only).
    """

    name: str
    busy_s: float
    utilisation: float
    contended_s: float
    peak_messages: int
    nbytes: float


@dataclass(frozen=True, slots=True, kw_only=True)
class MemorySeries:
    """Per-device memory of one stage over time, as a step function.

    Attributes:
      times_s: change points (the value holds until the next one).
      in_flight: microbatches whose activations are held.
      bytes: per-device bytes (static + in_flight·activation + transient while
        a forward or backward runs); None without the cost model.
    """

    stage: int
    devices: tuple[str, ...]
    times_s: tuple[float, ...]
    in_flight: tuple[int, ...]
    bytes: tuple[float, ...] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeline:
    """One simulated training iteration of a plan.

    Attributes:
      schedule, stages, microbatches: the plan's.
      events: every event, by start time.
      iteration_s: the simulated step time (the last event's end).
      pipeline_s: when the last backward ends.
      closed_form_s: the plan's own ``iteration_s``.
      bubble_fraction: idle share of the compute streams before the pipeline
        ends, weighted by devices: ``Σ_s n_s·bubble_s / (Σ_s n_s · pipeline_s)``.
      stage_stats, link_stats, memory: see the types.
      overlap_p2p, overlap_dp_sync, with_costs: how it was simulated.
    """

    schedule: str
    stages: int
    microbatches: int
    events: tuple[Event, ...]
    iteration_s: float
    pipeline_s: float
    closed_form_s: float
    bubble_fraction: float
    stage_stats: tuple[StageStats, ...]
    link_stats: tuple[LinkStats, ...]
    memory: tuple[MemorySeries, ...]
    overlap_p2p: bool
    overlap_dp_sync: bool
    with_costs: bool

    @property
    def rel_diff(self) -> float:
        """``(simulated − closed form) / closed form``."""
        return (self.iteration_s - self.closed_form_s) / self.closed_form_s if self.closed_form_s else 0.0

    def device_stats(self) -> dict[str, tuple[float, float]]:
        """(busy_s, idle_s) for every device of the plan."""
        return {d: (s.busy_s, s.idle_s) for s in self.stage_stats for d in s.devices}

    def to_json(self) -> dict:
        """Everything but the events' bulk as plain JSON types; ``events`` included as a list of dicts."""
        data = asdict(self)
        data["rel_diff"] = self.rel_diff
        data["devices"] = {d: {"busy_s": b, "idle_s": i} for d, (b, i) in self.device_stats().items()}
        return data

    def summary(self) -> str:
        """A few lines of text: step time against the closed form, bubble, busiest links, memory peaks."""
        lines = [
            f"simulated step {self.iteration_s * 1e3:.3f} ms vs closed form {self.closed_form_s * 1e3:.3f} ms "
            f"({self.rel_diff:+.2%}); pipeline {self.pipeline_s * 1e3:.3f} ms, bubble {self.bubble_fraction:.1%} "
            f"({self.schedule}, {self.stages} stage(s), {self.microbatches} microbatch(es))"
        ]
        for st in self.stage_stats:
            memory = (
                f", peak memory {st.peak_memory_bytes / 1e9:.3f} GB (plan {st.predicted_memory_bytes / 1e9:.3f} GB)"
                if st.peak_memory_bytes is not None
                else f", plan memory {st.predicted_memory_bytes / 1e9:.3f} GB"
            )
            lines.append(
                f"  stage {st.stage} ({len(st.devices)} device(s)): busy {st.busy_s * 1e3:.3f} ms, idle "
                f"{st.idle_s * 1e3:.3f} ms, bubble {st.bubble_s * 1e3:.3f} ms, in flight ≤ {st.peak_in_flight}{memory}"
            )
        for link in sorted(self.link_stats, key=lambda x: -x.utilisation)[:5]:
            lines.append(
                f"  link {link.name}: {link.utilisation:.1%} busy, {link.contended_s * 1e3:.3f} ms shared, "
                f"≤ {link.peak_messages} message(s) at once"
            )
        return "\n".join(lines) + "\n"
