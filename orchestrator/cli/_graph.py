"""``orchestrator graph``: capture a recipe's train step and print its layers."""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from orchestrator.cli._common import MAX_GLOBAL_BATCH, recipe_or_fail, seq_or_fail, si


def graph_command(
    recipe: Annotated[str, typer.Option(help="Recipe name, e.g. gpt2-small, gpt-tiny, mamba-130m.")] = "gpt2-small",
    batch_size: Annotated[
        int | None, typer.Option(min=1, max=MAX_GLOBAL_BATCH, help="Batch size (default: the recipe's).")
    ] = None,
    seq_len: Annotated[int | None, typer.Option(min=1, help="Sequence length (default: the recipe's).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    xla: Annotated[bool, typer.Option(help="Also compile the step and report XLA's own FLOP count.")] = True,
) -> None:
    """Capture a recipe's training step and print its layers (FLOPs, params, activations)."""
    from integrations.flax import capture, xla_flops
    from orchestrator.coarsen import coarsen

    spec = recipe_or_fail(recipe)
    seq_len = seq_or_fail(spec, seq_len, "--seq-len")
    state = spec.abstract_state()
    batch = spec.batch_spec(batch_size, seq_len)
    console = Console(stderr=True)
    with console.status(f"capturing {recipe} train step"):
        start = time.perf_counter()
        graph = capture(spec.train_step, state, batch, name=f"{recipe}/train_step")
        layers = coarsen(graph)
        capture_s = time.perf_counter() - start
    xla_count = None
    if xla:
        with console.status("compiling the step for XLA's FLOP count"):
            xla_count = xla_flops(spec.train_step, state, batch).flops
    totals = {
        "flops": graph.total_flops(),
        "xla_flops": xla_count,
        "param_bytes": graph.param_bytes,
        "ops": len(graph),
        "layers": len(layers),
        "distinct_layers": layers.totals()["distinct_layers"],
        "capture_s": round(capture_s, 3),
    }
    if as_json:
        payload = {
            "recipe": recipe,
            "batch_size": batch["inputs"].shape[0],
            "seq_len": seq_len,
            "layers": [
                {
                    "name": layer.name,
                    "flops": layer.flops,
                    "param_bytes": layer.param_bytes,
                    "activation_bytes": layer.activation_bytes,
                    "signature": layer.signature,
                }
                for layer in layers
            ],
            "totals": totals,
        }
        json.dump(payload, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    table = Table(title=f"{recipe} train step — batch {batch['inputs'].shape[0]} × seq {seq_len}")
    for column in ("#", "layer", "FLOPs", "params", "activation out", "signature"):
        table.add_column(column, justify="right" if column not in ("layer", "signature") else "left")
    for layer in layers:
        table.add_row(
            str(layer.index),
            layer.name,
            si(layer.flops, "FLOP"),
            si(layer.param_bytes, "B"),
            si(layer.activation_bytes, "B"),
            layer.signature[:8],
        )
    out = Console()
    out.print(table)
    xla_text = (
        "" if xla_count is None else f" (XLA: {si(xla_count, 'FLOP')}, {graph.total_flops() / xla_count - 1:+.2%})"
    )
    out.print(
        f"total {si(totals['flops'], 'FLOP')}{xla_text}, params {si(graph.param_bytes, 'B')}, "
        f"{totals['ops']} ops in {totals['layers']} layers ({totals['distinct_layers']} distinct), "
        f"captured in {capture_s:.1f} s"
    )
