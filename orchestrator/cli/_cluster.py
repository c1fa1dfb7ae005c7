"""``orchestrator cluster list`` and ``orchestrator cluster show PRESET|FILE``."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from orchestrator.cli._common import cluster_or_fail, si

cluster_app = typer.Typer(help="Inspect cluster presets and files.", no_args_is_help=True)


@cluster_app.command("list")
def list_presets(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON [{name, devices, device_types, hosts}].")] = False,
) -> None:
    """List the cluster presets: devices by type, hosts; ``local`` is this machine's jax devices."""
    import json
    import sys

    from orchestrator.cluster import load_cluster, preset_names

    rows = []
    for name in preset_names():
        if name == "local":  # measuring it starts jax and times a matmul: described, not loaded
            rows.append({"name": name, "devices": None, "device_types": {}, "hosts": None})
            continue
        cluster = load_cluster(name)
        rows.append(
            {
                "name": name,
                "devices": len(cluster.devices()),
                "device_types": cluster.counts_by_type(),
                "hosts": len(cluster.hosts),
            }
        )
    if as_json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    table = Table(title="cluster presets (orchestrator cluster show NAME for the details)")
    for column in ("name", "devices", "device types", "hosts"):
        table.add_column(column, justify="right" if column in ("devices", "hosts") else "left")
    for row in rows:
        if row["devices"] is None:
            table.add_row(row["name"], "", "this machine's jax devices, measured", "1")
        else:
            types = ", ".join(f"{n} × {kind}" for kind, n in row["device_types"].items())
            table.add_row(row["name"], str(row["devices"]), types, str(row["hosts"]))
    Console().print(table)


@cluster_app.command("show")
def show(
    name: Annotated[str, typer.Argument(help="A preset name (a100x8, mixed-a100-v100, local, ...) or a YAML file.")],
) -> None:
    """Print a cluster's device types, hosts and network levels."""
    cluster = cluster_or_fail(name)
    out = Console()
    types = Table(title=f"{cluster.name}: device types")
    for column in ("type", "devices", "peak FLOP/s by dtype", "memory", "memory bandwidth"):
        types.add_column(column)
    counts = cluster.counts_by_type()
    for dtype in cluster.device_types.values():
        peaks = ", ".join(f"{k} {si(v, 'FLOP/s')}" for k, v in dtype.peak_flops.items())
        types.add_row(
            dtype.name,
            str(counts.get(dtype.name, 0)),
            peaks,
            si(dtype.memory_bytes, "B"),
            si(dtype.memory_bandwidth_bytes_per_s, "B/s"),
        )
    out.print(types)
    hosts = Table(title="hosts")
    for column in ("host", "type", "devices", "rack", "intra-host link"):
        hosts.add_column(column)
    for host in cluster.hosts:
        down = sum(1 for ref in cluster.unavailable if ref.startswith(f"{host.name}/"))
        count = f"{host.count - down}/{host.count}" if down else str(host.count)
        link = f"{si(host.intra_link.bandwidth_bytes_per_s, 'B/s')}, {host.intra_link.latency_s * 1e6:g} µs"
        hosts.add_row(host.name, host.device_type, count, host.rack, link)
    out.print(hosts)
    for level, link in (("rack", cluster.rack_link), ("cluster", cluster.cluster_link)):
        if link is not None:
            out.print(
                f"{level} level: {si(link.bandwidth_bytes_per_s, 'B/s')} per direction, {link.latency_s * 1e6:g} µs"
            )
    for pair, link in cluster.overrides.items():
        out.print(
            f"override {' <-> '.join(sorted(pair))}: {si(link.bandwidth_bytes_per_s, 'B/s')}, {link.latency_s * 1e6:g} µs"
        )
    if cluster.shared_cores:
        out.print(f"all devices share {cluster.shared_cores} CPU cores")
    out.print(f"{len(cluster.devices())} devices in service")
