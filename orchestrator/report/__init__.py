"""Self-contained HTML reports of a plan and its simulated timeline."""

from orchestrator.report._html import render_html, write_html

__all__ = ["render_html", "write_html"]
