"""``orchestrator bench conductor``: the conductor's memory, numerics, time and lowering evidence."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table


def _figure(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int) and value >= 1_000_000:
        return f"{value / 1e9:.3f} GB" if value >= 1e8 else f"{value:,}"
    return str(value)


def conductor_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON {cases: [{name, ok, ...figures}]}.")] = False,
    quick: Annotated[
        bool, typer.Option(help="Small sizes only (seconds, for tests); the claims need the full run.")
    ] = False,
) -> None:
    """Attention and selective-scan rewrites: compiled memory, numerics, CPU time, TPU/CUDA lowering; exit 1 on a miss."""
    import os

    flag = "--xla_force_host_platform_device_count"
    if "jax" not in sys.modules and flag not in os.environ.get("XLA_FLAGS", ""):
        # the ring-attention cases run on 8 virtual CPU devices (on fewer, the rings that fit)
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}=8".strip()
    from orchestrator.bench import conductor_claims

    console = Console(stderr=True)
    with console.status("conductor bench") as status:
        cases = conductor_claims(quick=quick, progress=lambda name: status.update(name))
    if as_json:
        json.dump({"cases": [c.to_json() for c in cases]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        table = Table(title="conductor: rewritten vs written (CPU; times are medians of repeated runs)")
        for column in ("case", "ok", "figures"):
            table.add_column(column)
        for c in cases:
            figures = ", ".join(f"{k}={_figure(v)}" for k, v in c.figures.items())
            table.add_row(c.name, "[green]yes[/green]" if c.ok else "[red]no[/red]", figures)
        Console().print(table)
        Console().print(f"{sum(c.ok for c in cases)}/{len(cases)} cases hold")
    if not all(c.ok for c in cases):
        raise typer.Exit(code=1)
