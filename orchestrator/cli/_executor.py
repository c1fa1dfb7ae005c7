"""``orchestrator bench executor`` and ``orchestrator demo``: run plans for real on the local devices."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from orchestrator.cli._common import fail


def _need_devices(n: int) -> None:
    """Ask for n virtual CPU devices if jax is not imported yet and XLA_FLAGS does not choose; else check."""
    import os

    flag = "--xla_force_host_platform_device_count"
    if "jax" not in sys.modules and flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={n}".strip()
    import jax

    if len(jax.devices()) < n:
        fail(
            f"this needs {n} jax devices, found {len(jax.devices())}: "
            f"set XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting"
        )


def _figure(value) -> str:
    """A case's figure for the table: floats to 4 significant digits, lists of them bracketed."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + " ".join(_figure(v) for v in value) + "]"
    return str(value)


def bench_executor_command(
    as_json: Annotated[
        bool, typer.Option("--json", help="Print JSON {cases: [...], ranking: [...], controls: [...]}.")
    ] = False,
    quick: Annotated[bool, typer.Option(help="Tiny GPT parity and collectives only (about a minute).")] = False,
) -> None:
    """Executed plans vs single-device training (parity), vs the cost model (collectives, stage times), and the
    rank correlation of measured and simulated step times; exit 1 if a case misses its tolerance."""
    _need_devices(8)  # before anything imports jax
    from orchestrator.bench.executor import run

    console = Console(stderr=True)
    with console.status("running plans") as status:
        result = run(progress=lambda what: status.update(what), quick=quick)
    cases = result["cases"]
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        out = Console()
        table = Table(title="executor: plans run on the local devices")
        for column in ("case", "metric", "figures", "ok"):
            table.add_column(column)
        for c in cases:
            figures = ", ".join(f"{k} {_figure(v)}" for k, v in c.items() if k not in ("name", "metric", "ok"))
            table.add_row(c["name"], c["metric"], figures, "[green]yes[/green]" if c["ok"] else "[red]no[/red]")
        out.print(table)
        if result["ranking"]:
            ranking = Table(title="step time: measured vs simulated")
            for column in ("plan", "measured ms", "simulated ms"):
                ranking.add_column(column, justify="left" if column == "plan" else "right")
            for row in result["ranking"]:
                ranking.add_row(row["plan"], f"{row['measured_s'] * 1e3:.2f}", f"{row['simulated_s'] * 1e3:.2f}")
            out.print(ranking)
        if result["controls"]:
            controls = Table(title="stage times measured two other ways (no model)")
            for column in ("stage", "ms", "warm / cold", "its layers / it"):
                controls.add_column(column, justify="left" if column == "stage" else "right")
            for row in result["controls"]:
                layers = row.get("layers_over_stage")
                controls.add_row(
                    row["name"],
                    f"{row['stage_ms']:.2f}",
                    f"{row['warm_over_cold']:.2f}",
                    "" if layers is None else f"{layers:.2f}",
                )
            out.print(controls)
        repeats = [c["repeat_err"] for c in cases if "repeat_err" in c]
        if repeats:
            agree = sum(abs(r) <= 0.15 for r in repeats)
            out.print(f"stage times that agree with themselves within 15% (odd vs even rounds): {agree}/{len(repeats)}")
        out.print(f"{sum(c['ok'] for c in cases)}/{len(cases)} cases within tolerance")
    if not all(c["ok"] for c in cases):
        raise typer.Exit(code=1)


def demo_command(
    recipe: Annotated[str, typer.Option(help="Recipe to capture, plan and train.")] = "gpt-tiny",
    cluster: Annotated[str, typer.Option(help="Built-in cluster preset to plan for first.")] = "mixed-a100-v100",
    batch: Annotated[int, typer.Option(min=1, help="Global batch for the mixed-cluster plan.")] = 64,
    local_batch: Annotated[int, typer.Option(min=1, help="Global batch for the local run.")] = 16,
    seq: Annotated[int, typer.Option(min=1, help="Sequence length of the local run.")] = 64,
    steps: Annotated[int, typer.Option(min=1, help="Training steps on the local devices.")] = 8,
    out: Annotated[Path, typer.Option(help="Directory for the plan, explanation and traces.")] = Path("demo-out"),
    time_limit_s: Annotated[float, typer.Option(min=0.1, help="Planner time budget per plan.")] = 20.0,
) -> None:
    """Capture a recipe, plan it on a mixed cluster (explanation + trace), then plan for the local devices and
    train a few steps under that plan: loss, measured vs predicted step time and memory."""
    _need_devices(8)
    import jax

    from integrations.callbacks import PlanReporter, StepTimer
    from integrations.flax import capture, orchestrate
    from orchestrator.cluster import ClusterError, load_cluster
    from orchestrator.coarsen import coarsen
    from orchestrator.costs import CostModel
    from orchestrator.planner import PlanInfeasible, plan
    from recipes import RECIPES, synthetic_batch

    if recipe not in RECIPES:
        fail(f"unknown recipe {recipe!r}; choose one of: {', '.join(RECIPES)}")
    spec = RECIPES[recipe]
    try:
        mixed = load_cluster(cluster)
    except ClusterError as error:
        fail(str(error))
    console, err = Console(), Console(stderr=True)
    out.mkdir(parents=True, exist_ok=True)

    console.rule(f"1. {recipe} planned on {mixed.name}")
    with err.status(f"capturing {recipe} and planning on {mixed.name}"):
        graph = capture(spec.train_step, spec.abstract_state(), spec.batch_spec())
        layers = coarsen(graph)
        model = CostModel(graph, layers, mixed, batch_size=spec.batch_size, param_axes=spec.param_axes())
        try:
            big = plan(model, global_batch=batch, time_limit_s=time_limit_s)
        except PlanInfeasible as error:
            fail(str(error))
    console.print(big.explain())
    big.save(out / f"plan-{mixed.name}.json")
    (out / f"plan-{mixed.name}.txt").write_text(big.explain())
    try:
        from orchestrator.simulate import simulate, write_trace

        write_trace(simulate(big, model), out / f"trace-{mixed.name}.json")
    except ImportError:  # the simulator (issue 5) is optional here
        from integrations.callbacks import schedule_trace

        (out / f"trace-{mixed.name}.json").write_text(json.dumps(schedule_trace(big)))
    console.print(f"wrote {out}/plan-{mixed.name}.json, .txt and trace-{mixed.name}.json")

    console.rule(f"2. {recipe} planned for and trained on the {len(jax.devices())} local devices")
    state = jax.jit(spec.create_state)(jax.random.key(0))
    data = [synthetic_batch(jax.random.key(i), local_batch, seq, spec.config.vocab_size) for i in range(steps)]
    axes = spec.param_axes() if spec.family == "gpt" else None
    timer = StepTimer(tolerance=float("inf"))
    with err.status("capturing, profiling and planning for the local devices"):
        try:
            run = orchestrate(
                state,
                spec.train_step,
                "local",
                batch=data[0],
                param_axes=axes,
                callbacks=[timer, PlanReporter(out / "local")],
                time_limit_s=time_limit_s,
            )
        except PlanInfeasible as error:
            fail(str(error))
    console.print(run.plan.explain())
    for i, batch_i in enumerate(data):
        start = time.perf_counter()
        metrics = run.step(batch_i)
        loss = float(metrics["loss"])
        console.print(f"step {i}: loss {loss:.4f}  ({(time.perf_counter() - start) * 1e3:.1f} ms)")
    run.close()
    predicted_memory = max(s.memory_bytes for s in run.plan.stages)
    measured_memory = _peak_device_bytes(run, data[0])
    console.print(
        f"step time: measured median {timer.median_s * 1e3:.2f} ms (after the first step), "
        f"predicted {run.plan.iteration_s * 1e3:.2f} ms ({timer.ratio:.2f}×)"
    )
    memory = f"{measured_memory / 1e6:.2f} MB" if measured_memory is not None else "not available for pipelines"
    console.print(f"memory per device: predicted {predicted_memory / 1e6:.2f} MB, XLA's compiled peak {memory}")
    console.print(f"wrote {out}/local/plan.json, plan.txt and trace.json")


def _peak_device_bytes(run, batch) -> float | None:
    """XLA's per-device peak for a single-stage step: arguments + temporaries + outputs − aliases."""
    compiled = getattr(run.step_fn, "compiled", None)
    if compiled is None:
        return None
    memory = compiled(run.state, batch).memory_analysis()
    return float(
        memory.argument_size_in_bytes
        + memory.temp_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
    )
