"""``orchestrator profile --recipe R``: time each distinct layer on the local device."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from orchestrator.cli._common import MAX_GLOBAL_BATCH, MAX_SEQ, recipe_or_fail, seq_or_fail
from orchestrator.cli._progress import Progress


def profile_command(
    recipe: Annotated[str, typer.Option(help="Recipe name, e.g. gpt2-small.")] = "gpt2-small",
    batch_size: Annotated[int, typer.Option(min=1, max=MAX_GLOBAL_BATCH, help="Samples per profiled step.")] = 1,
    seq_len: Annotated[
        int | None, typer.Option(min=1, max=MAX_SEQ, help="Sequence length (default: the recipe's).")
    ] = None,
    repeats: Annotated[int, typer.Option(min=1, max=1000, help="Timed runs per piece (median taken).")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Measure forward/backward/optimizer time of every distinct layer (cached on disk) and calibrate efficiencies."""
    import jax

    from integrations.flax import capture, profile_layers
    from orchestrator.cluster import load_cluster
    from orchestrator.coarsen import coarsen
    from orchestrator.costs import EFFICIENCY_CLASSES, CostModel
    from orchestrator.profile import calibrate

    spec = recipe_or_fail(recipe)
    seq_len = seq_or_fail(spec, seq_len, "--seq-len")
    state, batch = spec.abstract_state(), spec.batch_spec(batch_size, seq_len)
    with Progress(f"capturing {recipe}") as shown:
        graph = capture(spec.train_step, state, batch)
        layers = coarsen(graph)
        distinct = len({layer.signature for layer in layers})
        done = 0
        shown.update("profiling", completed=done, total=distinct)

        def advance(name: str) -> None:  # called as each distinct layer's timing starts
            nonlocal done
            shown.update("profiling", completed=done, total=distinct, detail=f"timing {name}", force=True)
            done += 1

        timings = profile_layers(
            spec.train_step, state, batch, graph=graph, layers=layers, repeats=repeats, progress=advance
        )
    cluster = load_cluster("local")
    [device_type] = cluster.device_types
    traffic = CostModel(graph, layers, cluster, batch_size=batch_size).traffic
    pieces = []
    for t in timings.values():
        layer = next(layer for layer in layers if layer.signature == t.signature)
        for phase in ("forward", "backward", "optimizer"):
            pieces.append(([graph.op(n) for n in layer.ops if graph.op(n).phase == phase], getattr(t, f"{phase}_s")))
    efficiency = calibrate(pieces, cluster.device_types[device_type], traffic)
    rows = [
        {
            "signature": t.signature,
            "layer": t.name,
            "count": sum(1 for layer in layers if layer.signature == t.signature),
            "forward_s": t.forward_s,
            "backward_s": t.backward_s,
            "optimizer_s": t.optimizer_s,
        }
        for t in timings.values()
    ]
    if as_json:
        payload = {
            "recipe": recipe,
            "device_kind": jax.devices()[0].device_kind,
            "jax_version": jax.__version__,
            "layers": rows,
            "efficiency": {k: float(efficiency.of(k)) for k in EFFICIENCY_CLASSES},
        }
        json.dump(payload, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    table = Table(title=f"{recipe}: measured per distinct layer (batch {batch_size}, {jax.devices()[0].device_kind})")
    for column in ("layer", "×", "forward ms", "backward ms", "optimizer ms"):
        table.add_column(column, justify="left" if column == "layer" else "right")
    for row in rows:
        table.add_row(
            row["layer"],
            str(row["count"]),
            f"{row['forward_s'] * 1e3:.2f}",
            f"{row['backward_s'] * 1e3:.2f}",
            f"{row['optimizer_s'] * 1e3:.2f}",
        )
    Console().print(table)
    fractions = " · ".join(f"{k} {float(efficiency.of(k)):.3g}" for k in EFFICIENCY_CLASSES)
    Console().print(f"calibrated efficiency: {fractions}")
