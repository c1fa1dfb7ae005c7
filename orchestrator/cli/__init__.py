"""The ``orchestrator`` command line (typer + rich)."""

from orchestrator.cli._app import app, main

__all__ = ["app", "main"]
