"""``orchestrator bench fidelity``: predictions against XLA and measurements."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

bench_app = typer.Typer(help="Check predictions against external truth.", no_args_is_help=True)


def _print_json(key: str, rows: list) -> None:
    json.dump({key: rows}, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _run(suite, verb: str, **options) -> list:
    """``suite(progress=..., **options)`` under a spinner on stderr that names the case it is at."""
    with Console(stderr=True).status(verb) as status:
        return suite(progress=lambda name: status.update(f"{verb} {name}"), **options)


def _table(title: str, first: str, columns) -> Table:
    """A table whose first column names the row and whose other columns are right-aligned figures."""
    table = Table(title=title)
    table.add_column(first)
    for column in columns:
        table.add_column(column, justify="right")
    return table


def _cell(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def _report(title: str, cases, as_json: bool) -> None:
    if as_json:
        _print_json("cases", [c.to_json() for c in cases])
    else:
        table = Table(title=title)
        for column in ("case", "metric", "predicted", "measured", "rel. error", "tolerance", "ok"):
            table.add_column(column)
        for c in cases:
            table.add_row(
                c.name,
                c.metric,
                f"{c.predicted:.6g}",
                f"{c.measured:.6g}",
                f"{c.rel_err:+.2%}",
                f"{c.tolerance:.0%}",
                "[green]yes[/green]" if c.ok else "[red]no[/red]",
            )
        Console().print(table)
        missed = sum(not c.ok for c in cases)
        Console().print(f"{len(cases) - missed}/{len(cases)} within tolerance")
    if not all(c.ok for c in cases):
        raise typer.Exit(code=1)


@bench_app.command("fidelity")
def fidelity(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON {cases: [...]}.")] = False,
    compute: Annotated[
        bool, typer.Option(help="Also profile gpt2-small and compare layer times (about a minute).")
    ] = True,
) -> None:
    """Cost model vs XLA (collective bytes, peak memory) and vs profiled time; exit 1 if a tolerance is missed."""
    from orchestrator.cli._executor import _need_devices

    _need_devices(8)  # the shardings compared: DP8, DP4×TP2, DP2×TP4
    from orchestrator.bench import compute_cases, fidelity_cases

    console = Console(stderr=True)
    with console.status("compiling sharded gpt2-small blocks") as status:
        cases = fidelity_cases(progress=lambda name: status.update(f"compiling {name}"))
        if compute:
            cases += compute_cases(progress=lambda name: status.update(f"profiling {name}"))
    _report("fidelity: predicted vs XLA / measured", cases, as_json)


@bench_app.command("torch")
def torch_bench(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON {capture, configs, checks}.")] = False,
    preset: Annotated[str, typer.Option(help="GPT preset to train (a small one: it runs on the CPU).")] = "gpt-tiny",
    batch: Annotated[int, typer.Option(min=4, help="Global batch; divisible by 4.")] = 8,
    seq: Annotated[int, typer.Option(min=1, help="Sequence length.")] = 64,
    steps: Annotated[int, typer.Option(min=2, help="AdamW steps.")] = 5,
) -> None:
    """Torch GPT under DP, TP, DP×TP on 4 CPU XLA devices vs one device and the planner; exit 1 on a miss."""
    from orchestrator.cli._torch import torch_command

    torch_command(as_json=as_json, preset=preset, batch=batch, seq=seq, steps=steps)


@bench_app.command("dag")
def dag(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON {instances: [...]}.")] = False,
    time_limit_s: Annotated[float, typer.Option(min=0.1, help="MILP time limit per instance.")] = 10.0,
    quick: Annotated[bool, typer.Option(help="A smaller suite (for tests).")] = False,
) -> None:
    """MILP makespan, bound and gap vs HEFT, CPOP and (where small) exhaustive search."""
    import statistics

    from orchestrator.bench import run_dag_suite

    rows = _run(run_dag_suite, "scheduling", time_limit_s=time_limit_s, quick=quick)
    if as_json:
        _print_json("instances", rows)
        return
    columns = ("MILP", "bound", "gap", "s", "HEFT", "CPOP", "exhaustive", "vs HEFT")
    table = _table("function-DAG scheduling: MILP vs list schedulers", "instance", columns)
    for r in rows:
        m = r["milp"]
        table.add_row(
            r["name"],
            f"{m['makespan']:.2f}",
            f"{m['bound']:.2f}",
            "-" if m["gap"] is None else f"{m['gap']:.1%}",
            f"{m['solve_s']:.1f}",
            f"{r['heft']:.2f}",
            f"{r['cpop']:.2f}",
            "-" if r["exhaustive"] is None else f"{r['exhaustive']:.2f}",
            f"{r['heft'] / m['makespan']:.3f}×",
        )
    out = Console()
    out.print(table)
    gains = [r["heft"] / r["milp"]["makespan"] - 1 for r in rows]
    out.print(
        f"improvement over HEFT: median {statistics.median(gains):.1%}, max {max(gains):.1%}, min {min(gains):.1%}"
    )


@bench_app.command("planner")
def planner(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON {instances: [...]}.")] = False,
    time_limit_s: Annotated[
        float,
        typer.Option(
            min=0.1,
            help="Search budget per instance, in seconds of counted solver work (simplex iterations, "
            "branch-and-bound nodes, plans priced, each at about an idle core's cost), not wall-clock: the "
            "plans and gaps are the same on a busy machine, which only takes longer (wall-clock caps a "
            "search at 10x its budget + 30 s). The planner's default; GPT-175B: at most 10 s.",
        ),
    ] = 30.0,
    quick: Annotated[bool, typer.Option(help="A smaller suite (for tests).")] = False,
) -> None:
    """ILP step time, bound and gap vs the baselines and (where small) enumeration."""
    import statistics

    from orchestrator.bench import run_planner_suite

    rows = _run(run_planner_suite, "planning", time_limit_s=time_limit_s, quick=quick)
    if as_json:
        _print_json("instances", rows)
        return
    names = ("uniform", "alpa", "pipedream", "greedy")
    columns = ("ILP", "bound", "gap", "solve s", *names, "exhaustive", "simulated", "vs alpa")
    table = _table("planner: ILP vs baselines (predicted step time, s)", "instance", columns)

    for r in rows:
        ilp = r["ilp"]
        if ilp is None:
            table.add_row(r["name"], "infeasible", *["-"] * (len(names) + 7))
            continue
        alpa = r["baselines"].get("alpa")
        table.add_row(
            r["name"],
            _cell(ilp["objective"]),
            _cell(ilp["bound"]),
            "-" if ilp["gap"] is None else f"{ilp['gap']:.2%}",
            f"{ilp['solve_s']:.1f}",
            *(_cell(r["baselines"].get(n)) for n in names),
            _cell(r["exhaustive"]),
            _cell(r.get("simulated")),
            "-" if alpa is None else f"{alpa / ilp['objective']:.3f}×",
        )
    out = Console(width=220)
    out.print(table)
    speedups = [
        r["baselines"]["alpa"] / r["ilp"]["objective"]
        for r in rows
        if r["ilp"] and (r["preset"] or "").startswith("mixed") and r["baselines"].get("alpa")
    ]
    if speedups:
        out.print(
            f"speedup over Alpa-style on the mixed presets: median {statistics.median(speedups):.3f}×, "
            f"min {min(speedups):.3f}×, max {max(speedups):.3f}× ({len(speedups)} instances)"
        )


@bench_app.command("replan")
def replan_bench(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON {cases: [...]}.")] = False,
    time_limit_s: Annotated[float, typer.Option(min=0.1, help="Time limit of each cold solve.")] = 10.0,
    quick: Annotated[bool, typer.Option(help="Only the small synthetic cases (for tests).")] = False,
    runtime: Annotated[
        bool, typer.Option(help="Also train: SIGKILL then resume, lose 4 of 8 devices (8 jax devices, minutes).")
    ] = True,
) -> None:
    """Re-planning: cache hits, warm vs cold after losing a host, the migration term, and recovery of real
    training runs; exit 1 on a miss."""
    if runtime and not quick:
        from orchestrator.cli._executor import _need_devices

        _need_devices(8)  # before anything imports jax
    from orchestrator.bench import run_replan_suite

    with Console(stderr=True).status("re-planning") as status:
        cases = run_replan_suite(quick=quick, time_limit_s=time_limit_s, runtime=runtime, progress=status.update)
    if as_json:
        _print_json("cases", cases)
    else:
        columns = ("warm_s", "cold_s", "objective_warm", "objective_cold", "gap_cold", "max_abs_diff")
        table = _table("re-planning: warm vs cold (step times in s)", "case", (*columns, "ok"))

        for case in cases:
            ok = "[green]yes[/green]" if case["ok"] else "[red]no[/red]"
            table.add_row(case["name"], *(_cell(case.get(c)) for c in columns), ok)
        Console(width=200).print(table)
    if not all(case["ok"] for case in cases):
        raise typer.Exit(code=1)


@bench_app.command("replanner")
def replanner_bench(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON {cases: [...]}.")] = False,
) -> None:
    """The Replanner on a real pipeline with a slowed stage (8 jax devices, minutes): the fastest slowed
    step before the switch vs after the new plan compiled, on the CPU and wall clocks; exit 1 unless
    after < 0.8 × before on both."""
    from orchestrator.cli._executor import _need_devices

    _need_devices(8)  # before anything imports jax
    from orchestrator.bench import run_replanner_suite

    with Console(stderr=True).status("training") as status:
        cases = run_replanner_suite(progress=lambda what: status.update(f"training: {what}"))["cases"]
    if as_json:
        _print_json("cases", cases)
    else:
        columns = ("switch_step", "before_s", "after_s", "ratio", "limit")
        table = _table("Replanner: a slowed stage, step time before vs after the switch", "case", (*columns, "ok"))
        for case in cases:
            ok = "[green]yes[/green]" if case["ok"] else "[red]no[/red]"
            table.add_row(case["name"], *(_cell(case.get(c)) for c in columns), ok)
        Console(width=200).print(table)
        for case in cases:
            if "error" in case:
                Console().print(f"[red]{case['error']}[/red]")
    if not all(case["ok"] for case in cases):
        raise typer.Exit(code=1)


@bench_app.command("executor")
def executor(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON {cases: [...], ranking: [...]}.")] = False,
    quick: Annotated[bool, typer.Option(help="Tiny GPT parity and collectives only.")] = False,
) -> None:
    """Executed plans: parity with one device, collectives and stage times vs the cost model, step-time ranking."""
    from orchestrator.cli._executor import bench_executor_command

    bench_executor_command(as_json=as_json, quick=quick)


@bench_app.command("conductor")
def conductor(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON {cases: [{name, ok, ...figures}]}.")] = False,
    quick: Annotated[bool, typer.Option(help="Small sizes only (for tests).")] = False,
) -> None:
    """Conductor rewrites: compiled memory, numerics, CPU time, TPU/CUDA lowering; exit 1 on a miss."""
    from orchestrator.cli._conductor import conductor_command

    conductor_command(as_json=as_json, quick=quick)


@bench_app.command("published")
def published(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON {a100_scale, rows, summary}.")] = False,
    plan: Annotated[bool, typer.Option(help="Also plan each model on its cluster from scratch.")] = False,
    time_limit_s: Annotated[float, typer.Option(min=0.1, help="Planner time limit per run (with --plan).")] = 60.0,
) -> None:
    """Published GPU training runs (Megatron-LM, Korthikanti et al., Megatron-Core, Llama 3): measured
    vs priced seconds per iteration, fitted and held-out runs reported apart; exit 1 if a priced run
    is off by more than 20% or the held-out median by more than 10%."""
    from orchestrator.bench import bench_published

    out = _run(bench_published, "pricing", plan=plan, time_limit_s=time_limit_s)
    if as_json:
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        columns = (
            "GPUs",
            "published",
            "role",
            "measured s",
            "priced s",
            "error",
            *(("planned s", "plan") if plan else ()),
        )
        table = _table("published runs: seconds per iteration", "run", columns)
        for r in out["rows"]:
            priced = "error" in r
            table.add_row(
                r["id"],
                str(r["gpus"]),
                r["published"],
                r["role"],
                _cell(r["measured_s"]),
                _cell(r.get("priced_s")),
                f"{r['error']:+.1%}" if priced else r.get("not_priced", "-"),
                *((_cell(r.get("planned_s")), r.get("planned", r.get("plan_error", "-"))) if plan else ()),
            )
        console = Console(width=220)
        console.print(table)
        console.print(f"A100 efficiency: the H100-measured one × {out['a100_scale']:.3f} (fitted on the 'fitted' runs)")
        for role, s in out["summary"].items():
            console.print(
                f"{role}: {s['runs']} runs, median |error| {s['median_abs_error']:.1%}, max {s['max_abs_error']:.1%}"
            )
    errors = [abs(r["error"]) for r in out["rows"] if "error" in r]
    held = out["summary"].get("held_out", {})
    if any(e > 0.2 for e in errors) or held.get("median_abs_error", 0.0) > 0.1:
        raise typer.Exit(code=1)
