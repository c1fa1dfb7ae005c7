"""Device groups a stage may use, drawn from the cluster's hosts.

A group is ``n`` devices of one type: a power of two that fits in one host
(part of a host or a whole host), or a power-of-two number of whole hosts, or
all hosts of the type. (Powers of two keep the candidate set logarithmic in
the fleet size; the planner's optimality is over this set.) Its tensor-
parallel degree ``tp`` divides ``n`` and stays inside a host (tensor
parallelism all-reduces every layer: it belongs on the fastest links); the
rest, ``dp = n / tp``, is data parallelism. Hosts of one type are treated as
interchangeable counts, so the candidates grow with device types and sizes,
not with devices.

A *mixed* group joins whole hosts of two types, the same number of hosts of
each (so the candidates grow with type pairs × host counts, not with their
product), under one ``tp``: its data-parallel replicas sit on different
types, and each type's replicas take their own batch share (``CostTable.shares``),
the fast type more samples per microbatch. Its name is the types joined by
"+" (``"a100+v100"``), which is also its key wherever a type is looked up,
so code that expects one type fails loudly on it rather than using one part.

A group of one type may also split each sequence over ``cp`` devices (context parallelism, its
attention as ring or all-gather attention): ``size = tp · cp · dp``, the ``cp`` ranks of a replica
holding its parameters and its samples. Under the cost model a device then does the work of
m/cp samples, as data parallelism over cp more replicas would, plus the ring's communication,
so context parallelism pays only where data parallelism cannot go: where a layer does not fit
one device even at one sample per microbatch. :func:`context_parallel_configs` offers it there
alone (docs/planner.md, "Context parallelism"), so the space elsewhere is the space without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.cluster import Cluster, Link


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupConfig:
    device_type: str
    size: int
    tp: int
    recompute: bool
    parts: tuple[tuple[str, int], ...] = ()  # a mixed group's (type, devices), in type order
    cp: int = 1  # context-parallel degree: the devices each sequence is split over
    # (groups key the cost table's millions of lookups: the hash is computed once)
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fields = (self.device_type, self.size, self.tp, self.recompute, self.parts, self.cp)
        object.__setattr__(self, "_hash", hash(fields))

    def __hash__(self) -> int:
        return self._hash

    @property
    def dp(self) -> int:
        return self.size // (self.tp * self.cp)

    @property
    def mixed(self) -> bool:
        return bool(self.parts)

    @property
    def by_type(self) -> dict[str, int]:
        """Devices of each type."""
        return dict(self.parts) if self.parts else {self.device_type: self.size}


def stage_group(stage) -> GroupConfig:
    """The group a plan's :class:`~orchestrator.planner.Stage` runs on."""
    return GroupConfig(
        device_type=stage.device_type,
        size=stage.tp * stage.cp * stage.dp,
        tp=stage.tp,
        recompute=stage.recompute,
        parts=tuple(stage.parts),
        cp=stage.cp,
    )


MEMORY_HEADROOM = 0.10
"""The share of each device's memory a plan leaves free unless told otherwise: what the cost model does
not see (the framework's own buffers, allocator fragmentation, a compiler's temporaries) must fit there."""


def usable_memory_bytes(capacity_bytes: float, headroom: float) -> float:
    """What a plan may fill of a device of ``capacity_bytes``: capacity × (1 − headroom).

    Example:
      >>> usable_memory_bytes(80e9, 0.1)
      72000000000.0
    """
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"memory headroom must be in [0, 1), got {headroom!r}")
    return capacity_bytes * (1.0 - headroom)


@dataclass(frozen=True, slots=True, kw_only=True)
class TypeInfo:
    """What the planner needs to know of one device type's hosts."""

    name: str
    devices: int  # in service
    per_host: int
    memory_bytes: float  # what a plan may fill per device: the capacity less the headroom (usable_memory_bytes)
    capacity_bytes: float  # the device's whole memory
    intra_link: Link
    inter_link: Link  # between two of its hosts (the slowest such)


def type_infos(cluster: Cluster, *, memory_headroom: float = MEMORY_HEADROOM) -> dict[str, TypeInfo]:
    """What the planner needs of each device type in service; each device's memory less ``memory_headroom``."""
    infos = {}
    devices = cluster.devices()
    first_in_host = _first_in_each_host(devices)
    for name, dtype in cluster.device_types.items():
        mine = [d for d in devices if d.device_type == name]
        if not mine:
            continue
        hosts = [h for h in cluster.hosts if h.device_type == name]
        per_host = min(h.count for h in hosts)
        firsts = [first_in_host[h.name] for h in hosts if h.name in first_in_host]
        inter = cluster.slowest_link(firsts) if len(firsts) > 1 else hosts[0].intra_link
        infos[name] = TypeInfo(
            name=name,
            devices=len(mine),
            per_host=per_host,
            memory_bytes=usable_memory_bytes(dtype.memory_bytes, memory_headroom),
            capacity_bytes=dtype.memory_bytes,
            intra_link=hosts[0].intra_link,
            inter_link=inter,
        )
    return infos


def _first_in_each_host(devices) -> dict:
    """Each host's first device in service among ``devices``, by host name, in host order."""
    firsts: dict = {}
    for device in devices:
        firsts.setdefault(device.host, device)
    return firsts


def group_configs(
    infos: dict[str, TypeInfo],
    *,
    max_size: int | None = None,
    recompute: bool = True,
    tensor_parallel: bool = True,
    global_batch: int | None = None,
) -> list[GroupConfig]:
    """Groups of one type: a power of two within a host, or h whole hosts for h a power of two,
    all the type's hosts, or (given ``global_batch``) any h whose data-parallel degree h·per_host/tp
    divides the batch for some tp, as published runs use (DP 24 on 192 A100s); with
    ``global_batch``, a group whose data-parallel degree does not divide it is left out, since no
    microbatch count can feed it."""
    configs = []
    for info in infos.values():
        sizes, n = [], 1
        while n <= info.per_host:
            sizes.append(n)
            n *= 2
        hosts = info.devices // info.per_host
        counts = {2**k for k in range(1, hosts.bit_length()) if 2**k < hosts} | ({hosts} if hosts > 1 else set())
        if global_batch:
            tps = [t for t in (2**k for k in range(info.per_host.bit_length())) if info.per_host % t == 0]
            counts |= {h for h in range(2, hosts + 1) if any(global_batch % (h * info.per_host // t) == 0 for t in tps)}
        sizes += [h * info.per_host for h in sorted(counts)]
        for size in sizes:
            if size > info.devices or (max_size and size > max_size):
                continue
            tp = 1
            while tp <= min(size, info.per_host) and (tensor_parallel or tp == 1):
                if size % tp == 0 and not (global_batch and global_batch % (size // tp)):
                    for rc in (False, True) if recompute else (False,):
                        configs.append(GroupConfig(device_type=info.name, size=size, tp=tp, recompute=rc))
                tp *= 2
    return configs


def context_parallel_configs(
    infos: dict[str, TypeInfo],
    *,
    seq_len: int,
    device_types: set[str],
    global_batch: int | None = None,
    recompute: bool = True,
    tensor_parallel: bool = True,
) -> list[GroupConfig]:
    """Context-parallel groups on ``device_types``: each (size, tp) of :func:`group_configs` with
    every power of two cp ≥ 2 such that tp·cp divides the size, 2·cp divides ``seq_len`` (the
    zigzag layout cuts each sequence into 2·cp chunks) and the data-parallel degree
    size / (tp·cp) divides ``global_batch``; tp > 1 only with ``tensor_parallel``. A replica's
    tp·cp devices are cp ring positions of tp tensor-parallel ranks each (Llama 3's TP 8 × CP 16).

    Example:
      >>> from orchestrator.cluster import load_cluster
      >>> infos = type_infos(load_cluster("a100x8"))
      >>> groups = context_parallel_configs(infos, seq_len=64, device_types={"a100"}, global_batch=1, recompute=False)
      >>> sorted((g.size, g.tp, g.cp) for g in groups)
      [(2, 1, 2), (4, 1, 4), (4, 2, 2), (8, 1, 8), (8, 2, 4), (8, 4, 2)]
    """
    mine = {name: info for name, info in infos.items() if name in device_types}
    configs = []
    for group in group_configs(mine, recompute=recompute, tensor_parallel=tensor_parallel):
        cp = 2
        while group.tp * cp <= group.size:
            dp, rest = divmod(group.size, group.tp * cp)
            if not rest and seq_len % (2 * cp) == 0 and not (global_batch and global_batch % dp):
                configs.append(
                    GroupConfig(
                        device_type=group.device_type, size=group.size, tp=group.tp, recompute=group.recompute, cp=cp
                    )
                )
            cp *= 2
    return configs


def mixed_group_configs(
    infos: dict[str, TypeInfo], *, recompute: bool = True, tensor_parallel: bool = True
) -> list[GroupConfig]:
    """Mixed groups: for each pair of types, h whole hosts of each (h a power of two, or all
    hosts of the type with fewer), every tp dividing both types' hosts."""
    configs = []
    names = sorted(infos)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            a, b = infos[first], infos[second]
            most = min(a.devices // a.per_host, b.devices // b.per_host)
            counts = sorted({2**k for k in range(most.bit_length()) if 2**k <= most} | {most})
            for hosts in counts:
                parts = ((first, hosts * a.per_host), (second, hosts * b.per_host))
                tp = 1
                while tp <= min(a.per_host, b.per_host) and (tensor_parallel or tp == 1):
                    if a.per_host % tp == 0 and b.per_host % tp == 0:
                        for rc in (False, True) if recompute else (False,):
                            configs.append(
                                GroupConfig(
                                    device_type=f"{first}+{second}",
                                    size=parts[0][1] + parts[1][1],
                                    tp=tp,
                                    recompute=rc,
                                    parts=parts,
                                )
                            )
                    tp *= 2
    return configs


def group_links(config: GroupConfig, info: TypeInfo) -> tuple[Link, Link]:
    """(tensor-parallel link, data-parallel link) of a group of one type."""
    dp_link = info.intra_link if config.size <= info.per_host else info.inter_link
    return info.intra_link, dp_link


def context_link(config: GroupConfig, info: TypeInfo) -> Link:
    """The link between neighbours of a group's context-parallel ring: in ring order
    (``orchestrator.cluster.ring_order``) a ring inside a host never leaves it, and one over
    hosts crosses their slowest link."""
    return info.intra_link if config.tp * config.cp <= info.per_host else info.inter_link


def slowest(links) -> Link:
    return min(links, key=lambda link: (link.bandwidth_bytes_per_s, -link.latency_s))


def with_mixed_links(links: dict[tuple[str, str], Link], groups: list[GroupConfig]) -> dict[tuple[str, str], Link]:
    """``links`` (by type pair) extended to the mixed groups' names: the slowest link between
    any type of one and any type of the other, as for two types."""
    kinds = {g.device_type: tuple(g.by_type) for g in groups}
    kinds.update({t: (t,) for pair in links for t in pair})
    return {(k, k2): slowest(links[t, t2] for t in kinds[k] for t2 in kinds[k2]) for k in kinds for k2 in kinds}


def pair_links(cluster: Cluster, infos: dict[str, TypeInfo]) -> dict[tuple[str, str], Link]:
    """The link between consecutive stages on types (t, t2): within a type, its slowest
    host-to-host link (its intra-host link if it has one host); across types, the slowest
    link between a host of t and a host of t2. Pessimistic, so a plan never relies on the
    allocation landing on a better pair."""
    firsts: dict[str, list] = {}
    for device in _first_in_each_host(cluster.devices()).values():
        firsts.setdefault(device.device_type, []).append(device)
    links = {}
    for t in infos:
        for t2 in infos:
            if t == t2:
                links[t, t2] = infos[t].inter_link
            else:
                links[t, t2] = slowest(cluster.link(a, b) for a in firsts[t] for b in firsts[t2])
    return links
