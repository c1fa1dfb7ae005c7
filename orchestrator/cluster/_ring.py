"""The order of devices around a ring (context-parallel attention, ring all-reduce) on a cluster's links.

A ring over k groups of devices crosses between groups at least k times (each group is entered
and left once); keeping each host's devices contiguous, and each rack's hosts contiguous, meets
that bound at every level at once: a ring over h hosts in r racks crosses host boundaries h
times and rack boundaries r times (0 for a single host or rack). Two hosts: exactly twice. Which
host follows which inside a rack (and which rack follows which) matters only where per-pair
overrides make some links faster; there the next one is the unvisited one behind the fastest
link from the current one (highest bandwidth, then lowest latency).
"""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.cluster._model import LEVELS, Cluster, Device, Level


def _greedy(groups: list[list[Device]], cluster: Cluster) -> list[list[Device]]:
    """Groups in nearest-neighbour order along the fastest link, from the first."""
    order, rest = [groups[0]], groups[1:]
    while rest:
        last = order[-1][-1]

        def speed(group: list[Device], last: Device = last) -> tuple[float, float]:
            link = cluster.link(last, group[0])
            return (-link.bandwidth_bytes_per_s, link.latency_s)

        best = min(rest, key=speed)  # min keeps the first of equals: the cluster file's order
        order.append(best)
        rest.remove(best)
    return order


def ring_order(cluster: Cluster, devices: Sequence[Device] | None = None) -> list[Device]:
    """``devices`` (default: all in service) in ring order: hosts contiguous, racks contiguous.

    Args:
      cluster: the cluster the devices belong to.
      devices: the ring's members, any order.
    Returns:
      The devices so that each one's successor (the last's is the first) shares the fastest link
      the grouping allows; device i of the list is position i of the ring (a mesh axis's order).
    Raises:
      ValueError: a device listed twice or not in ``cluster``.

    Example:
      >>> from orchestrator.cluster import load_cluster, ring_order
      >>> cluster = load_cluster("mixed-a100-v100")
      >>> [d.ref for d in ring_order(cluster, cluster.devices()[6:10])]
      ['a100-0/6', 'a100-0/7', 'a100-1/0', 'a100-1/1']
    """
    members = list(cluster.devices() if devices is None else devices)
    known = {d.ref for d in cluster.all_devices()}
    refs = [d.ref for d in members]
    if len(set(refs)) != len(refs) or not set(refs) <= known:
        bad = next(r for i, r in enumerate(refs) if r not in known or r in refs[:i])
        raise ValueError(f"device {bad} is listed twice or is not in cluster {cluster.name!r}")
    if not members:
        return []
    by_host: dict[str, list[Device]] = {}
    for device in sorted(members, key=lambda d: d.id):
        by_host.setdefault(device.host, []).append(device)
    by_rack: dict[str, list[list[Device]]] = {}
    for host, host_devices in by_host.items():
        by_rack.setdefault(cluster.host(host).rack, []).append(host_devices)
    racks = [[d for host in _greedy(hosts, cluster) for d in host] for hosts in by_rack.values()]
    return [d for rack in _greedy(racks, cluster) for d in rack]


def ring_crossings(cluster: Cluster, order: Sequence[Device]) -> dict[Level, int]:
    """How many of the ring's links (the last device back to the first included) are at each level."""
    counts: dict[Level, int] = dict.fromkeys(LEVELS, 0)
    if len(order) < 2:
        return counts
    for a, b in zip(order, [*order[1:], order[0]]):
        counts[cluster.level(a, b)] += 1
    return counts
