"""Load a cluster from a preset name, a YAML file, or ``local`` (this machine's jax devices).

Every user mistake becomes a :class:`ClusterError` whose one-line message
names the file, the YAML path of the bad field (``hosts[2].count``) and what
was expected.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import yaml
from pydantic import ValidationError

from orchestrator.cluster._model import Cluster, DeviceType, Host, Link
from orchestrator.cluster._spec import MAX_DEVICES, ClusterSpec, LinkSpec


class ClusterError(ValueError):
    """A cluster file or preset name that cannot be used, with a one-line reason."""


def preset_names() -> list[str]:
    files = resources.files("orchestrator.cluster") / "presets"
    return sorted([p.name.removesuffix(".yaml") for p in files.iterdir() if p.name.endswith(".yaml")] + ["local"])


def _yaml_path(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _first_error(source: str, error: ValidationError) -> ClusterError:
    err = error.errors()[0]
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    path = _yaml_path(loc)
    if err["type"] == "extra_forbidden":
        message = "unknown field (units belong in field names: *_bytes, *_gbps, *_us, peak_tflops)"
    elif err["type"] == "missing":
        message = "required field is missing"
    else:
        message = f"{err['msg']} (got {err.get('input')!r})"
    more = len(error.errors()) - 1
    suffix = f" [and {more} more problem{'s' * (more > 1)}]" if more else ""
    return ClusterError(f"{source}: {path}: {message}{suffix}")


def _link(spec: LinkSpec | None) -> Link | None:
    if spec is None:
        return None
    return Link(bandwidth_bytes_per_s=spec.bandwidth_gbps * 1e9, latency_s=spec.latency_us * 1e-6)


def cluster_from_spec(spec: ClusterSpec, source: str = "cluster") -> Cluster:
    """Check cross-references in a validated spec and build the :class:`Cluster`."""
    names = [h.name for h in spec.hosts]
    for i, host in enumerate(spec.hosts):
        if host.device_type not in spec.device_types:
            raise ClusterError(
                f"{source}: hosts[{i}].device_type: unknown device type {host.device_type!r}; "
                f"defined: {sorted(spec.device_types)}"
            )
        if names.index(host.name) != i:
            raise ClusterError(f"{source}: hosts[{i}].name: duplicate host name {host.name!r}")
    racks = {h.rack or h.name for h in spec.hosts}
    overrides = {}
    for i, override in enumerate(spec.network.overrides):
        for j, end in enumerate(override.between):
            if end not in names and end not in racks:
                raise ClusterError(f"{source}: network.overrides[{i}].between[{j}]: no host or rack named {end!r}")
        overrides[frozenset(override.between)] = Link(
            bandwidth_bytes_per_s=override.bandwidth_gbps * 1e9, latency_s=override.latency_us * 1e-6
        )
    counts = {h.name: h.count for h in spec.hosts}
    if sum(counts.values()) > MAX_DEVICES:
        raise ClusterError(
            f"{source}: hosts: {sum(counts.values())} devices in all; the largest cluster accepted has {MAX_DEVICES}"
        )
    for i, ref in enumerate(spec.unavailable):
        host, _, index = ref.partition("/")
        if host not in counts or not index.isdigit() or int(index) >= counts[host]:
            raise ClusterError(
                f"{source}: unavailable[{i}]: {ref!r} is not a device; expected 'host/index' with index < the host's count"
            )
    if len(set(spec.unavailable)) >= sum(counts.values()):
        raise ClusterError(f"{source}: unavailable: every device is unavailable; a cluster needs at least one device")
    if len({h.rack or h.name for h in spec.hosts}) > 1 and spec.network.cluster is None and not overrides:
        raise ClusterError(f"{source}: network.cluster: required when hosts sit in more than one rack")
    if len(spec.hosts) > 1 and spec.network.rack is None and spec.network.cluster is None:
        raise ClusterError(f"{source}: network: a cluster with several hosts needs a rack or cluster link")
    return Cluster(
        name=spec.name,
        device_types={
            name: DeviceType(
                name=name,
                peak_flops={dtype: tflops * 1e12 for dtype, tflops in dt.peak_tflops.items()},
                memory_bytes=dt.memory_bytes,
                memory_bandwidth_bytes_per_s=dt.memory_bandwidth_gbps * 1e9,
                cache_bytes=dt.cache_bytes,
            )
            for name, dt in spec.device_types.items()
        },
        hosts=tuple(
            Host(
                name=h.name,
                device_type=h.device_type,
                count=h.count,
                rack=h.rack or h.name,
                intra_link=_link(h.intra_link),
                threads_per_device=h.threads_per_device,
            )
            for h in spec.hosts
        ),
        rack_link=_link(spec.network.rack),
        cluster_link=_link(spec.network.cluster),
        overrides=overrides,
        unavailable=frozenset(spec.unavailable),
        shared_cores=spec.shared_cores,
    )


def _figure(value: float) -> float:
    """``value`` rounded to 12 significant digits, so a unit conversion there and back reads as written."""
    return float(f"{value:.12g}")


def _link_spec(link: Link) -> dict:
    return {"bandwidth_gbps": _figure(link.bandwidth_bytes_per_s / 1e9), "latency_us": _figure(link.latency_s * 1e6)}


def cluster_to_dict(cluster: Cluster) -> dict:
    """The cluster as the mapping a cluster YAML file holds: :func:`parse_cluster` reads it back.

    A plan embeds it, so the plan can be simulated, reported and run wherever its file goes.

    Example:
      >>> cluster = load_cluster("mixed-a100-v100")
      >>> parse_cluster(cluster_to_dict(cluster)) == cluster
      True
    """
    network: dict = {}
    if cluster.rack_link is not None:
        network["rack"] = _link_spec(cluster.rack_link)
    if cluster.cluster_link is not None:
        network["cluster"] = _link_spec(cluster.cluster_link)
    if cluster.overrides:
        network["overrides"] = [
            {"between": sorted(pair) * (2 if len(pair) == 1 else 1), **_link_spec(link)}
            for pair, link in cluster.overrides.items()
        ]
    data: dict = {
        "name": cluster.name,
        "device_types": {
            name: {
                "peak_tflops": {dtype: _figure(flops / 1e12) for dtype, flops in dt.peak_flops.items()},
                "memory_bytes": int(dt.memory_bytes),
                "memory_bandwidth_gbps": _figure(dt.memory_bandwidth_bytes_per_s / 1e9),
                **({} if dt.cache_bytes is None else {"cache_bytes": int(dt.cache_bytes)}),
            }
            for name, dt in cluster.device_types.items()
        },
        "hosts": [
            {
                "name": h.name,
                "device_type": h.device_type,
                "count": h.count,
                "rack": h.rack,
                "intra_link": _link_spec(h.intra_link),
                "threads_per_device": h.threads_per_device,
            }
            for h in cluster.hosts
        ],
        "network": network,
        "unavailable": sorted(cluster.unavailable),
    }
    if cluster.shared_cores is not None:
        data["shared_cores"] = cluster.shared_cores
    return data


def parse_cluster(data: object, source: str = "cluster") -> Cluster:
    if not isinstance(data, dict):
        raise ClusterError(f"{source}: (top level): expected a mapping with name, device_types and hosts")
    try:
        spec = ClusterSpec.model_validate(data)
    except ValidationError as error:
        raise _first_error(source, error) from None
    return cluster_from_spec(spec, source)


def read_text(path: Path, what: str, error: type[Exception]) -> str:
    """The UTF-8 text of the file ``path``, or ``error`` with one line saying why it cannot be read as ``what``."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except IsADirectoryError:
        raise error(f"{path} is a directory; expected {what}") from None
    except UnicodeDecodeError as decode:
        raise error(f"{path} is not UTF-8 text (byte {decode.start}); expected {what}") from None
    except (OSError, ValueError) as other:
        raise error(f"{path}: cannot read it ({getattr(other, 'strerror', None) or other})") from None


def load_cluster(name_or_path: str | Path) -> Cluster:
    """A cluster from a preset name (see :func:`preset_names`), a YAML file, or ``"local"``.

    Raises:
      ClusterError: with a one-line message naming the bad field.

    Example:
      >>> load_cluster("a100x8").counts_by_type()
      {'a100': 8}
    """
    text = str(name_or_path)
    if text == "local":
        from orchestrator.cluster._local import local_cluster

        return local_cluster()
    path = Path(text)
    try:
        exists = path.exists()
    except (OSError, ValueError):  # a name too long for the file system, or with a NUL byte
        exists = False
    if not path.suffix and not exists:
        preset = resources.files("orchestrator.cluster") / "presets" / f"{text}.yaml"
        if "/" in text or "\0" in text or not preset.is_file():
            raise ClusterError(
                f"unknown cluster preset {text!r}; presets: {', '.join(preset_names())}, or a YAML file path"
            )
        source, raw = f"preset {text}", preset.read_text()
    else:
        source, raw = str(path), read_text(path, "a cluster YAML file", ClusterError)
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ClusterError(f"{source}: not valid YAML{where}: {getattr(error, 'problem', error)}") from None
    except RecursionError:
        raise ClusterError(f"{source}: nested too deeply to be a cluster file") from None
    if _expanded_size(data, _MAX_VALUES) > _MAX_VALUES:
        # YAML aliases can repeat a block exponentially often; validating every copy would never end
        raise ClusterError(f"{source}: more than {_MAX_VALUES} values once YAML aliases are expanded")
    return parse_cluster(data, source)


_MAX_VALUES = 1_000_000


def _expanded_size(data: object, limit: int) -> int:
    """How many values ``data`` holds with every alias counted again, counting no further than ``limit`` + 1."""
    count, stack = 0, [data]
    while stack and count <= limit:
        node = stack.pop()
        count += 1
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return count
