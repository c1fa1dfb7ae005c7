"""``orchestrator bench torch``: the PyTorch/XLA path against one device and against the planner.

Runs ``python -m orchestrator.bench._torch`` in a fresh process (torch_xla
must start with ``PJRT_DEVICE=CPU``, ``CPU_NUM_DEVICES=4`` and an HLO dump
directory, before any other XLA work) and prints, for DP, TP, DP×TP and DP
with ZeRO: loss and parameter agreement with eager single-device training,
and the all-reduce bytes in the compiled HLO against the planner's
prediction (for ZeRO the collectives are shown, not compared). Exit code 1
when a tolerance is missed, 2 on a usage error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Annotated

import typer

LOSS_TOLERANCE = 1e-5
PARAM_TOLERANCE = 1e-5
BYTES_TOLERANCE = 0.01
FLOPS_TOLERANCE = 0.02


def checks(result: dict) -> list[dict]:
    """One row per check of a ``_bench`` result: what was compared, the error, the tolerance and whether it holds."""
    rows = []
    cap = result.get("capture")
    if cap:
        for metric, ours, theirs in (
            ("FLOPs vs Flax", cap["torch_flops"], cap["flax_flops"]),
            ("matmul FLOPs vs flop_counter", cap["torch_matmul_flops"], cap["flop_counter_flops"]),
        ):
            rows.append(_row("capture", metric, ours, theirs, ours / theirs - 1, FLOPS_TOLERANCE))
        same = [layer[2] for layer in cap["layers"]] == [layer[2] for layer in cap["flax_layers"]]
        rows.append(
            _row(
                "capture",
                "layers = Flax's",
                len(cap["layers"]),
                len(cap["flax_layers"]),
                0.0 if same else 1.0,
                0.0,
            )
        )
    for config in result["configs"]:
        name = config["name"].split()[1]  # "gpt-tiny DPxTP (dp=2, tp=2), ..." → "DPxTP"
        rows.append(
            _row(
                name,
                "loss rel. err",
                config["losses"][-1],
                config["reference_losses"][-1],
                config["loss_rel_err"],
                LOSS_TOLERANCE,
            )
        )
        rows.append(_row(name, "param rel. L2 err", None, None, config["param_rel_err_global"], PARAM_TOLERANCE))
        measured = config["hlo_collective_bytes"]
        predicted = config["predicted_all_reduce_bytes"]
        if config.get("zero"):
            kinds = ", ".join(f"{k} {v}" for k, v in measured.items() if v)
            rows.append(_row(name, f"collectives: {kinds}", predicted, sum(measured.values()), None, None))
            continue
        rows.append(
            _row(
                name,
                "all-reduce bytes",
                predicted,
                measured["all-reduce"],
                predicted / measured["all-reduce"] - 1 if measured["all-reduce"] else float("inf"),
                BYTES_TOLERANCE,
            )
        )
        others = sum(v for k, v in measured.items() if k != "all-reduce")
        rows.append(
            _row(
                name,
                "other collectives",
                0,
                others,
                0.0 if others == 0 else float("inf"),
                BYTES_TOLERANCE,
            )
        )
    return rows


def _row(case: str, metric: str, predicted, measured, error: float | None, tolerance: float | None) -> dict:
    """A check row; ``tolerance`` None marks an informational row that passes or fails nothing."""
    ok = None if tolerance is None else abs(error) <= tolerance
    return {
        "case": case,
        "metric": metric,
        "predicted": predicted,
        "measured": measured,
        "rel_err": error,
        "tolerance": tolerance,
        "ok": ok,
    }


def torch_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON {capture, configs, checks}.")] = False,
    preset: Annotated[
        str, typer.Option(help="GPT preset to train (small ones only: it runs on the CPU).")
    ] = "gpt-tiny",
    batch: Annotated[int, typer.Option(min=4, help="Global batch; divisible by 4.")] = 8,
    seq: Annotated[int, typer.Option(min=1, help="Sequence length.")] = 64,
    steps: Annotated[int, typer.Option(min=2, help="AdamW steps.")] = 5,
) -> None:
    """Train the torch GPT under DP, TP, DP×TP, DP+ZeRO on 4 CPU XLA devices; compare with one device and the planner."""
    from rich.console import Console
    from rich.table import Table

    if batch % 4:
        Console(stderr=True).print(f"error: --batch {batch} must divide by 4 (the data-parallel degrees are 4 and 2)")
        raise typer.Exit(code=2)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_DEVICE", "CPU_NUM_DEVICES")}
    cmd = [
        sys.executable,
        "-m",
        "orchestrator.bench._torch",
        "--preset",
        preset,
        "--batch",
        str(batch),
        "--seq",
        str(seq),
        "--steps",
        str(steps),
    ]
    with Console(stderr=True).status("training on 4 CPU XLA devices (DP, TP, DP×TP, DP with ZeRO)"):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        last = [line for line in proc.stderr.splitlines() if line.strip()][-1:] or ["(no output)"]
        Console(stderr=True).print(f"error: bench torch failed: {last[0]}")
        raise typer.Exit(code=2 if "usage:" in proc.stderr else 1)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = checks(result)
    if as_json:
        json.dump({**result, "checks": rows}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        table = Table(title=f"torch_xla path: {preset}, batch {batch}×{seq}, {steps} AdamW steps, 4 CPU devices")
        for column in ("case", "metric", "ours / planner", "reference / HLO", "error", "tol.", "ok"):
            table.add_column(column)
        for r in rows:
            table.add_row(
                r["case"],
                r["metric"],
                "" if r["predicted"] is None else f"{r['predicted']:.8g}",
                "" if r["measured"] is None else f"{r['measured']:.8g}",
                "" if r["rel_err"] is None else f"{r['rel_err']:+.3g}",
                "" if r["tolerance"] is None else f"{r['tolerance']:.0e}" if r["tolerance"] else "0",
                "info" if r["ok"] is None else "[green]yes[/green]" if r["ok"] else "[red]no[/red]",
            )
        console = Console()
        console.print(table)
        checked = [r for r in rows if r["ok"] is not None]
        console.print(f"{sum(r['ok'] for r in checked)}/{len(checked)} within tolerance")
    if not all(r["ok"] for r in rows if r["ok"] is not None):
        raise typer.Exit(code=1)
