"""Alpha-beta times of collectives over p devices (α = link latency, β = bandwidth).

Ring algorithms (Patarasuk & Yuan 2009; Thakur et al. 2005), n = bytes per device:

    all-reduce       ring: 2(p−1)·α + 2(p−1)/p · n/β     tree: 2⌈log₂p⌉·α + 2·n/β
    reduce-scatter   (p−1)·α + (p−1)/p · n/β              (n = the full input)
    all-gather       (p−1)·α + (p−1)/p · n/β              (n = the full output)
    point-to-point   α + n/β

All-reduce takes the faster of ring and tree: the tree wins for small
messages, where latency dominates.
"""

from __future__ import annotations

import math

from orchestrator.cluster import Link


def all_reduce_s(nbytes: float, p: int, link: Link) -> float:
    if p <= 1 or nbytes <= 0:
        return 0.0
    ring = 2 * (p - 1) * link.latency_s + 2 * (p - 1) / p * nbytes / link.bandwidth_bytes_per_s
    tree = 2 * math.ceil(math.log2(p)) * link.latency_s + 2 * nbytes / link.bandwidth_bytes_per_s
    return min(ring, tree)


def reduce_scatter_s(nbytes: float, p: int, link: Link) -> float:
    if p <= 1 or nbytes <= 0:
        return 0.0
    return (p - 1) * link.latency_s + (p - 1) / p * nbytes / link.bandwidth_bytes_per_s


def all_gather_s(nbytes: float, p: int, link: Link) -> float:
    return reduce_scatter_s(nbytes, p, link)


def p2p_s(nbytes: float, link: Link) -> float:
    return 0.0 if nbytes <= 0 else link.time_s(nbytes)
