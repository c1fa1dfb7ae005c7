"""``orchestrator graph``: capture a recipe's (or ``--model``'s) train step and print its layers."""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from orchestrator.cli._common import MAX_GLOBAL_BATCH, recipe_or_fail, seq_or_fail, si
from orchestrator.cli._user_model import UserModelOption, user_model_or_fail


def graph_command(
    ctx: typer.Context,
    recipe: Annotated[str, typer.Option(help="Recipe name, e.g. gpt2-small, gpt-tiny, mamba-130m.")] = "gpt2-small",
    user_model: UserModelOption = None,
    batch_size: Annotated[
        int | None, typer.Option(min=1, max=MAX_GLOBAL_BATCH, help="Batch size (default: the recipe's).")
    ] = None,
    seq_len: Annotated[int | None, typer.Option(min=1, help="Sequence length (default: the recipe's).")] = None,
    dtype: Annotated[
        str | None, typer.Option(help="A recipe's compute dtype, float32 or bfloat16 (default: the recipe's).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    xla: Annotated[bool, typer.Option(help="Also compile the step and report XLA's own FLOP count.")] = True,
) -> None:
    """Capture a recipe's (or your --model's) training step and print its layers (FLOPs, params, activations)."""
    from integrations.flax import capture, xla_flops
    from orchestrator.coarsen import coarsen

    if user_model is not None:
        own = user_model_or_fail(user_model, ctx, recipe_options=("recipe", "batch_size", "seq_len", "dtype"))
        name, train_step, state, batch = user_model, own.train_step, own.state, own.batch
        batch_size, seq_len = own.batch_size, None
    else:
        spec = recipe_or_fail(recipe, dtype)
        seq_len = seq_or_fail(spec, seq_len, "--seq-len")
        name, train_step, state = recipe, spec.train_step, spec.abstract_state()
        batch = spec.batch_spec(batch_size, seq_len)
        batch_size = batch["inputs"].shape[0]
    console = Console(stderr=True)
    with console.status(f"capturing {name} train step"):
        start = time.perf_counter()
        graph = capture(train_step, state, batch, name=f"{name}/train_step")
        layers = coarsen(graph)
        capture_s = time.perf_counter() - start
    xla_count = None
    if xla:
        with console.status("compiling the step for XLA's FLOP count"):
            xla_count = xla_flops(train_step, state, batch).flops
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
            ("model" if user_model else "recipe"): name,
            "batch_size": batch_size,
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
    shape = f"batch {batch_size}" + (f" × seq {seq_len}" if seq_len else "")
    table = Table(title=f"{name} train step — {shape}")
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
