"""The cluster file schema (pydantic), checked where user files come in.

Units are part of every field name:
  ``*_bytes``  bytes;  ``*_gbps``  gigabytes per second (10⁹ B/s, as GPU and
  interconnect datasheets quote GB/s);  ``*_us``  microseconds;
  ``peak_tflops``  10¹² floating-point operations per second, per dtype.

Example (a shortened ``mixed-a100-v100``)::

    name: mixed-a100-v100
    device_types:
      a100: {peak_tflops: {float32: 19.5, bfloat16: 312}, memory_bytes: 85899345920, memory_bandwidth_gbps: 2039}
    hosts:
      - {name: a100-0, device_type: a100, count: 8, rack: rack-a, intra_link: {bandwidth_gbps: 300, latency_us: 2}}
    network:
      rack: {bandwidth_gbps: 25, latency_us: 5}
      cluster: {bandwidth_gbps: 12.5, latency_us: 10}

Every number must be finite, and sizes are bounded by what hardware can be (the ``MAX_*``
constants): a value past them is a typo, and planning for it would only burn time. A device
type lists a floating-point peak, since models train in floating point.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_DEVICES_PER_HOST = 128  # an NVL72 rack treated as one host fits; 128 leaves room
MAX_DEVICES = 65536  # devices in one cluster file
MAX_MEMORY_BYTES = 2**50  # 1 PiB per device
MAX_TFLOPS = 1e6  # 1 EFLOP/s per device
MAX_GBPS = 1e6  # 1 PB/s, memory or link
MAX_LATENCY_US = 1e7  # 10 s
MAX_THREADS = 1024
FLOAT_DTYPES = ("float64", "float32", "tfloat32", "bfloat16", "float16", "float8")
DTYPES = (*FLOAT_DTYPES, "int8")


class _Strict(BaseModel):
    # inf and nan are refused everywhere: ``.inf`` parses as a float in YAML, and a link or a peak of
    # infinity would make every cost 0
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class LinkSpec(_Strict):
    """One link level: bandwidth per direction between two devices, and latency."""

    bandwidth_gbps: float = Field(gt=0, le=MAX_GBPS, description="GB/s per direction")
    latency_us: float = Field(ge=0, le=MAX_LATENCY_US, description="microseconds")


class DeviceTypeSpec(_Strict):
    peak_tflops: dict[str, float] = Field(min_length=1, description="TFLOP/s by dtype, e.g. {float32: 19.5}")
    memory_bytes: int = Field(gt=0, le=MAX_MEMORY_BYTES)
    memory_bandwidth_gbps: float = Field(gt=0, le=MAX_GBPS, description="GB/s")
    cache_bytes: int | None = Field(
        default=None,
        gt=0,
        le=MAX_MEMORY_BYTES,
        description="last-level cache; data larger than it streams from memory (optional)",
    )

    @field_validator("peak_tflops")
    @classmethod
    def _positive_and_known(cls, value: dict[str, float]) -> dict[str, float]:
        for dtype, tflops in value.items():
            if dtype not in DTYPES:
                raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
            if not 0 < tflops <= MAX_TFLOPS:
                raise ValueError(f"peak for {dtype} must be > 0 and <= {MAX_TFLOPS:g} TFLOP/s, got {tflops}")
        if not any(dtype in FLOAT_DTYPES for dtype in value):
            # without one, a float32 model would be priced at the int8 peak
            raise ValueError(
                f"needs a floating-point peak (one of {', '.join(FLOAT_DTYPES)}), got only {sorted(value)}"
            )
        return value


class HostSpec(_Strict):
    name: str = Field(min_length=1)
    device_type: str
    count: int = Field(gt=0, le=MAX_DEVICES_PER_HOST, description="devices on this host")
    rack: str | None = Field(default=None, description="hosts sharing a rack use the network's rack level")
    intra_link: LinkSpec
    threads_per_device: int = Field(
        default=1, gt=0, le=MAX_THREADS, description="jobs a device runs at once (function DAGs)"
    )


class OverrideSpec(_Strict):
    """A link between two named hosts or racks that differs from its level's default."""

    between: tuple[str, str]
    bandwidth_gbps: float = Field(gt=0, le=MAX_GBPS)
    latency_us: float = Field(ge=0, le=MAX_LATENCY_US)


class NetworkSpec(_Strict):
    rack: LinkSpec | None = Field(default=None, description="between hosts in the same rack")
    cluster: LinkSpec | None = Field(default=None, description="between hosts in different racks")
    overrides: list[OverrideSpec] = Field(default_factory=list)


class ClusterSpec(_Strict):
    name: str = Field(min_length=1)
    device_types: dict[str, DeviceTypeSpec] = Field(min_length=1)
    hosts: list[HostSpec] = Field(min_length=1, max_length=MAX_DEVICES)
    network: NetworkSpec = Field(default_factory=NetworkSpec)
    unavailable: list[str] = Field(default_factory=list, description='devices out of service, as "host/index"')
    shared_cores: int | None = Field(
        default=None,
        gt=0,
        le=MAX_DEVICES,
        description="set when all devices share this many CPU cores (virtual devices)",
    )
