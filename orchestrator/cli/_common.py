"""Helpers shared by the CLI commands."""

from __future__ import annotations

from typing import NoReturn

import typer


def fail(message: str) -> NoReturn:
    """End the command with a one-line error on stderr and exit code 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def si(value: float, unit: str) -> str:
    """``1.23 GFLOP``-style formatting with SI prefixes."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}"
