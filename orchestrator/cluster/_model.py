"""The cluster as the rest of Orchestrator sees it: devices, their types, and links.

Links follow the hierarchy device → host → rack → cluster. Two devices on one
host talk over the host's ``intra_link``; two hosts in one rack over the
network's rack level; hosts in different racks over its cluster level; a
per-pair override between two hosts (or two racks) replaces its level. A
transfer of n bytes over a link costs ``latency + n / bandwidth`` (the
alpha-beta model).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

Level = Literal["device", "host", "rack", "cluster"]
LEVELS: tuple[Level, ...] = ("device", "host", "rack", "cluster")


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    bandwidth_bytes_per_s: float
    latency_s: float

    def time_s(self, nbytes: float) -> float:
        """Alpha-beta time of one message of ``nbytes``."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceType:
    name: str
    peak_flops: dict[str, float]  # FLOP/s by dtype
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    cache_bytes: int | None = None  # last-level cache; None: every byte priced at memory bandwidth

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``; ``KeyError`` naming the dtypes listed if there is none."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        raise KeyError(f"device type {self.name!r} has no peak for {dtype}; it lists {sorted(self.peak_flops)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Host:
    name: str
    device_type: str
    count: int
    rack: str
    intra_link: Link
    threads_per_device: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    id: int
    host: str
    index: int  # position on its host
    device_type: str

    @property
    def ref(self) -> str:
        return f"{self.host}/{self.index}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """A (possibly mixed) cluster of devices joined by a hierarchy of links.

    Build one with :func:`orchestrator.cluster.load_cluster`.
    """

    name: str
    device_types: dict[str, DeviceType]
    hosts: tuple[Host, ...]
    rack_link: Link | None
    cluster_link: Link | None
    overrides: dict[frozenset[str], Link] = field(default_factory=dict)
    unavailable: frozenset[str] = frozenset()
    shared_cores: int | None = None

    def all_devices(self) -> list[Device]:
        devices, next_id = [], 0
        for host in self.hosts:
            for index in range(host.count):
                devices.append(Device(id=next_id, host=host.name, index=index, device_type=host.device_type))
                next_id += 1
        return devices

    def devices(self) -> list[Device]:
        """Devices in service, in host order."""
        return [d for d in self.all_devices() if d.ref not in self.unavailable]

    def host(self, name: str) -> Host:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(f"no host {name!r} in cluster {self.name!r}")

    def level(self, a: Device, b: Device) -> Level:
        if a.id == b.id:
            return "device"
        if a.host == b.host:
            return "host"
        if self.host(a.host).rack == self.host(b.host).rack:
            return "rack"
        return "cluster"

    def link(self, a: Device, b: Device) -> Link:
        """The link a transfer from ``a`` to ``b`` crosses."""
        level = self.level(a, b)
        if level == "device":
            return Link(bandwidth_bytes_per_s=float("inf"), latency_s=0.0)
        if level == "host":
            return self.host(a.host).intra_link
        ha, hb = self.host(a.host), self.host(b.host)
        for pair in (frozenset((ha.name, hb.name)), frozenset((ha.rack, hb.rack))):
            if pair in self.overrides:
                return self.overrides[pair]
        link = self.rack_link if level == "rack" else self.cluster_link
        if link is None:
            raise ValueError(f"cluster {self.name!r} defines no {level}-level network link between {a.ref} and {b.ref}")
        return link

    def slowest_link(self, devices: Sequence[Device]) -> Link:
        """The bottleneck link of a ring over ``devices`` (lowest bandwidth, then highest latency)."""
        if len(devices) < 2:
            return Link(bandwidth_bytes_per_s=float("inf"), latency_s=0.0)
        links = [self.link(a, b) for a, b in zip(devices, [*devices[1:], devices[0]])]
        return min(links, key=lambda link: (link.bandwidth_bytes_per_s, -link.latency_s))

    def counts_by_type(self, devices: Iterable[Device] | None = None) -> dict[str, int]:
        counts: dict[str, int] = {}
        for device in self.devices() if devices is None else devices:
            counts[device.device_type] = counts.get(device.device_type, 0) + 1
        return counts
