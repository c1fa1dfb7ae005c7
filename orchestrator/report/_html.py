"""One self-contained HTML page for a plan: its table and explanation, the simulated timeline's charts and numbers.

Everything is inline (CSS in a ``<style>`` block, charts as base64 PNG data
URIs), so the file can be mailed or attached to an issue and opens offline. It reads at
1400 px: a stage's devices are summarised by host ("8 × a100 (a100-0)"), headers wrap, and a
table wider than the page scrolls inside its own box rather than widening the page.
"""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.simulate import Timeline, gantt_png, memory_png

if TYPE_CHECKING:
    from orchestrator.planner import Plan

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; padding: 0 1em; max-width: 1300px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
.wide { max-width: 100%; overflow-x: auto; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 3px 6px; text-align: right; }
td { white-space: nowrap; } th { white-space: normal; vertical-align: bottom; }
th { background: #f3f3f3; } td.l, th.l { text-align: left; }
pre { background: #f8f8f8; padding: 0.8em; overflow-x: auto; font-size: 0.8em; }
img { max-width: 100%; border: 1px solid #eee; }
.note { color: #555; font-size: 0.9em; }
"""


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms"


def _bytes(n: float | None) -> str:
    if n is None:
        return "—"
    for factor, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(n) >= factor:
            return f"{n / factor:.3f} {unit}"
    return f"{n:.0f} B"


def _table(header: list[str], rows: list[list[str]], left: int = 0) -> str:
    """An HTML table; the first ``left`` columns are left-aligned. Cells are escaped."""

    def cell(tag: str, k: int, text: str) -> str:
        return f"<{tag}{' class=l' if k < left else ''}>{html.escape(text)}</{tag}>"

    head = "".join(cell("th", k, h) for k, h in enumerate(header))
    body = "".join("<tr>" + "".join(cell("td", k, c) for k, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _devices(devices: tuple[str, ...], text: str) -> str:
    """A stage's devices as its count and type and the hosts they sit on: ``8 × a100 (a100-0)``; the hosts
    of a long list are summarised too (``16 × a100 (a100-0 … a100-3, 4 hosts)``)."""
    hosts = list(dict.fromkeys(ref.rsplit("/", 1)[0] for ref in devices))  # refs are host/index, in order
    where = ", ".join(hosts) if len(hosts) <= 3 else f"{hosts[0]} … {hosts[-1]}, {len(hosts)} hosts"
    return f"{text} ({where})" if hosts else text


def _capacities(plan: Plan) -> dict[int, float]:
    """Each stage's device memory (the smaller of its two types'), from the cluster the plan embeds; none
    without one."""
    from orchestrator.cluster import ClusterError, parse_cluster

    spec = plan.source.get("cluster_spec")
    if not isinstance(spec, dict):
        return {}
    try:
        memory = {name: t.memory_bytes for name, t in parse_cluster(spec, "the plan's cluster").device_types.items()}
    except ClusterError:
        return {}
    kinds = {k: stage.device_type.split("+") for k, stage in enumerate(plan.stages)}
    return {k: min(memory[t] for t in types) for k, types in kinds.items() if all(t in memory for t in types)}


def _image(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def render_html(plan: Plan, timeline: Timeline, *, title: str = "Orchestrator plan") -> str:
    """The report page as a string.

    Args:
      plan: the plan.
      timeline: :func:`orchestrator.simulate.simulate` of it.
      title: the page heading.

    Returns:
      A complete HTML document with no external references.
    """
    stats = {s.stage: s for s in timeline.stage_stats}
    stage_rows = []
    for k, st in enumerate(plan.stages):
        layers = f"{st.layers[0]}–{st.layers[-1]}" if len(st.layers) > 1 else str(st.layers[0])
        backward = st.time_s - st.forward_s - 2 * st.send_s
        stage_rows.append(
            [
                str(k),
                layers,
                _devices(st.devices, st.devices_text),
                str(st.tp) if st.cp == 1 else f"{st.tp} (cp {st.cp})",
                str(st.dp),
                "yes" if st.recompute else "no",
                "/".join(map(str, st.shares)) if st.shares else str(st.microbatch_size),
                _ms(st.forward_s),
                _ms(backward),
                _ms(st.send_s),
                _ms(st.time_s),
                _ms(st.dp_sync_s),
                _ms(st.optimizer_s),
                _bytes(st.memory_bytes),
                _bytes(stats[k].peak_memory_bytes),
                str(stats[k].peak_in_flight),
                _ms(stats[k].busy_s),
                _ms(stats[k].bubble_s),
            ]
        )
    capacities = _capacities(plan)
    headroom = plan.source.get("memory_headroom")
    memory_note = "Solid: simulated memory per device; dashed: the plan's predicted peak"
    if capacities:
        memory_note += "; dotted: the device's memory"
        if isinstance(headroom, float) and math.isfinite(headroom) and 0 < headroom < 1:
            memory_note += (
                f", of which the plan fills at most {1 - headroom:.0%} ({headroom:.0%} kept free as headroom)"
            )
    plan_table = _table(
        [
            "stage",
            "layers",
            "devices",
            "tp",
            "dp",
            "recompute",
            "microbatch",
            "forward",
            "backward",
            "send",
            "time/microbatch",
            "grad sync",
            "optimizer",
            "memory (plan)",
            "memory (simulated)",
            "in flight",
            "busy",
            "bubble",
        ],
        stage_rows,
        left=3,
    )
    breakdown_rows = [[k.removesuffix("_s").replace("_", " "), _ms(v)] for k, v in plan.breakdown.items()]
    breakdown_rows.append(["closed form (plan.iteration_s)", _ms(plan.iteration_s)])
    simulated_rows = [
        ["pipeline (last backward ends)", _ms(timeline.pipeline_s)],
        ["gradient sync + optimizer tail", _ms(timeline.iteration_s - timeline.pipeline_s)],
        ["simulated step", _ms(timeline.iteration_s)],
        ["simulated − closed form", f"{timeline.rel_diff:+.2%}"],
        ["bubble fraction", f"{timeline.bubble_fraction:.1%}"],
    ]
    link_rows = [
        [
            link.name,
            f"{link.utilisation:.1%}",
            _ms(link.busy_s),
            _ms(link.contended_s),
            str(link.peak_messages),
            _bytes(link.nbytes) if link.nbytes else "—",
        ]
        for link in sorted(timeline.link_stats, key=lambda x: -x.utilisation)
    ]
    how = (
        f"transfers {'overlap compute' if timeline.overlap_p2p else 'hold the compute stream'}; "
        f"gradient sync {'overlaps the backward pass' if timeline.overlap_dp_sync else 'after the pipeline drains'}; "
        + (
            "bytes over the plan devices' actual links, from the cost model"
            if timeline.with_costs
            else "no cost model: transfers last the plan's send_s, memory is shown as microbatches in flight"
        )
    )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<p>{html.escape(plan.schedule)}, {len(plan.stages)} stage(s), {plan.microbatches} microbatch(es), "
        f"global batch {plan.global_batch}: closed form {_ms(plan.iteration_s)}, simulated "
        f"{_ms(timeline.iteration_s)} ({timeline.rel_diff:+.2%}), bubble {timeline.bubble_fraction:.1%}.</p>",
        "<h2>Stages</h2>",
        f'<div class="wide">{plan_table}</div>',
        "<h2>Predicted breakdown</h2>",
        '<div style="display:flex; gap:3em">',
        "<div><b>closed form (planner)</b>" + _table(["term", "time"], breakdown_rows, left=1) + "</div>",
        "<div><b>simulation</b>" + _table(["term", "time"], simulated_rows, left=1) + "</div>",
        "</div>",
        f'<p class="note">Simulation: {html.escape(how)}.</p>',
        "<h2>Timeline</h2>",
        _image(gantt_png(timeline), "Gantt chart"),
        "<h2>Memory</h2>",
        _image(memory_png(timeline, capacity_bytes=capacities or None), "memory over time"),
        f'<p class="note">{html.escape(memory_note)}.</p>',
        "<h2>Links</h2>",
        _table(["link", "utilisation", "busy", "shared", "peak messages", "bytes"], link_rows, left=1)
        if link_rows
        else "<p>No traffic between devices.</p>",
        "<h2>Explanation</h2>",
        f"<pre>{html.escape(plan.explain())}</pre>",
        "</body></html>",
    ]
    return "\n".join(parts)


def write_html(plan: Plan, timeline: Timeline, path: str | Path, **kwargs) -> None:
    """Write :func:`render_html` to ``path``."""
    Path(path).write_text(render_html(plan, timeline, **kwargs), encoding="utf-8")
