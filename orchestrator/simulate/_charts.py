"""PNG charts of a timeline (matplotlib's object API, no pyplot state): a Gantt chart and memory over time."""

from __future__ import annotations

import io
from pathlib import Path

from orchestrator.simulate._timeline import Timeline

COLORS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "optimizer": "#C44E52",
    "send_activation": "#55A868",
    "send_gradient": "#8172B3",
    "dp_sync": "#937860",
}
LABELS = {
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer",
    "send_activation": "activation →",
    "send_gradient": "← gradient",
    "dp_sync": "gradient sync",
}
MAX_LINK_ROWS = 12
MIN_WIDTH = 0.003  # of the step: narrower bars are widened to this to stay visible


def _scale(seconds: float) -> tuple[float, str]:
    for factor, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if seconds >= 2 * factor:
            return factor, unit
    return 1e-9, "ns"


def _save(figure, path: str | Path | None) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    data = buffer.getvalue()
    if path is not None:
        Path(path).write_bytes(data)
    return data


def _stage_label(timeline: Timeline, s: int) -> str:
    devices = timeline.stage_stats[s].devices
    shown = devices[0] if len(devices) == 1 else f"{devices[0]}…{devices[-1]}"
    return f"stage {s}\n{len(devices)} dev: {shown}"


def gantt_png(timeline: Timeline, path: str | Path | None = None) -> bytes:
    """A Gantt chart: one row per stage (all its devices run it), its gradient sync, and the busiest links.

    Bars are labelled with their microbatch where they are wide enough; bars
    shorter than 0.3% of the step are drawn 0.3% wide so they stay visible.

    Args:
      timeline: from :func:`orchestrator.simulate.simulate`.
      path: where to write the PNG (None: only return it).

    Returns:
      The PNG bytes.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    factor, unit = _scale(timeline.iteration_s)
    rows: list[tuple[str, list]] = []
    for s in range(timeline.stages):
        compute = [e for e in timeline.events if e.stage == s and e.kind in ("forward", "backward", "optimizer")]
        rows.append((_stage_label(timeline, s), compute))
    for s in range(timeline.stages):
        syncs = [e for e in timeline.events if e.stage == s and e.kind == "dp_sync"]
        if syncs:
            rows.append((f"stage {s} sync", syncs))
    links = sorted(timeline.link_stats, key=lambda x: -x.busy_s)
    transfers = [e for e in timeline.events if e.kind in ("send_activation", "send_gradient")]
    for link in links[:MAX_LINK_ROWS]:
        mine = [e for e in transfers if e.resources[0] == link.name]
        if mine:
            rows.append((f"{link.name}\n{link.utilisation:.0%} busy", mine))

    figure = Figure(figsize=(12, 1.0 + 0.55 * len(rows)), layout="constrained")
    ax = figure.add_subplot()
    span = timeline.iteration_s / factor
    for y, (_, events) in enumerate(rows):
        wide: dict[str, list[tuple[float, float]]] = {}
        thin: dict[str, list[tuple[float, float]]] = {}
        for e in events:  # one collection per (row, kind): thousands of bars stay fast
            width = e.duration_s / factor
            # bars under MIN_WIDTH of the step are drawn at MIN_WIDTH, without edges, so they stay visible
            (wide if width >= MIN_WIDTH * span else thin).setdefault(e.kind, []).append(
                (e.start_s / factor, max(width, MIN_WIDTH * span))
            )
        for kind, bars in wide.items():
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=COLORS[kind], edgecolor="white", linewidth=0.5)
        for kind, bars in thin.items():
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=COLORS[kind], edgecolor="none")
        for e in events:
            start, width = e.start_s / factor, e.duration_s / factor
            if e.microbatch is not None and width > 0.025 * span:
                ax.text(start + width / 2, y, str(e.microbatch), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, span * 1.01 if span else 1)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(
        f"{timeline.schedule}, {timeline.stages} stage(s), {timeline.microbatches} microbatch(es): "
        f"simulated {timeline.iteration_s / factor:.3g} {unit} (closed form {timeline.closed_form_s / factor:.3g} "
        f"{unit}), bubble {timeline.bubble_fraction:.1%}",
        fontsize=9,
    )
    kinds = [k for k in COLORS if any(e.kind == k for _, events in rows for e in events)]
    ax.legend(
        handles=[Patch(facecolor=COLORS[k], label=LABELS[k]) for k in kinds],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    return _save(figure, path)


def memory_png(
    timeline: Timeline, path: str | Path | None = None, *, capacity_bytes: dict[int, float] | None = None
) -> bytes:
    """Per-device memory of each stage over time (bytes with the cost model, else microbatches in flight).

    Dashed lines mark the plan's predicted peak per stage (and dotted ones
    the device capacity when ``capacity_bytes`` by stage is given).

    Returns:
      The PNG bytes.
    """
    from matplotlib.figure import Figure

    factor, unit = _scale(timeline.iteration_s)
    with_bytes = all(series.bytes is not None for series in timeline.memory)
    peak = max((max(series.bytes) for series in timeline.memory), default=1.0) if with_bytes else 1.0
    divisor, bytes_unit = next(((d, u) for d, u in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")) if peak >= d), (1.0, "B"))
    figure = Figure(figsize=(12, 4), layout="constrained")
    ax = figure.add_subplot()
    colors = [f"C{k % 10}" for k in range(timeline.stages)]
    for series, color in zip(timeline.memory, colors):
        times = [t / factor for t in series.times_s] + [timeline.iteration_s / factor]
        values = list(series.bytes) if with_bytes else list(series.in_flight)
        values = [v / divisor for v in values] if with_bytes else values
        ax.step(times, values + values[-1:], where="post", color=color, label=f"stage {series.stage}")
        if with_bytes:
            predicted = timeline.stage_stats[series.stage].predicted_memory_bytes / divisor
            ax.axhline(predicted, color=color, linestyle="--", linewidth=0.8, alpha=0.8)
            if capacity_bytes and series.stage in capacity_bytes:
                ax.axhline(capacity_bytes[series.stage] / divisor, color=color, linestyle=":", linewidth=0.8)
    ax.set_xlabel(f"time ({unit})")
    if with_bytes:
        ax.set_ylabel(f"memory per device ({bytes_unit})")
        ax.set_title("memory per device over one step (solid: simulated, dashed: plan's predicted peak)", fontsize=9)
    else:
        from matplotlib.ticker import MaxNLocator

        ax.set_ylabel("microbatches in flight")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title("activations held per stage (no cost model: memory in bytes unknown)", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return _save(figure, path)
