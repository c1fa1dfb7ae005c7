"""Measured layer times and their on-disk cache."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerTiming:
    """Median measured seconds of one distinct layer's pieces on one device kind.

    ``forward_at`` and ``backward_at``, when measured (``profile_layers(..., fixed_from=...)``),
    are the times at smaller batches: (batch / this profile's batch, seconds), ascending.
    ``forward_fixed_s`` and ``backward_fixed_s`` are then the parts of ``forward_s`` and
    ``backward_s`` that do not shrink with the batch: the line through the two smallest
    batches' times, read at batch 0 (clamped to [0, the smallest batch's time]). None: not measured.
    """

    signature: str
    name: str  # the first layer with this signature
    device_kind: str
    forward_s: float
    backward_s: float
    optimizer_s: float
    forward_fixed_s: float | None = None
    backward_fixed_s: float | None = None
    forward_at: tuple[tuple[float, float], ...] = ()
    backward_at: tuple[tuple[float, float], ...] = ()

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s


def cache_dir() -> Path:
    """``$ORCHESTRATOR_CACHE`` or ``~/.cache/orchestrator``, with a ``profiles`` folder."""
    root = Path(os.environ.get("ORCHESTRATOR_CACHE", Path.home() / ".cache" / "orchestrator"))
    return root / "profiles"


METHOD = 4
"""Version of how layers are timed, part of the cache key: 3 = pieces write over inputs dead after them;
4 = pieces timed round-robin, times at smaller batches kept (``forward_at``)."""


class TimingCache:
    """Layer timings on disk, keyed by layer signature, device kind, jax version and timing method."""

    def __init__(self, directory: Path | None = None, *, jax_version: str):
        self.directory = directory or cache_dir()
        self.jax_version = jax_version

    def _path(self, signature: str, device_kind: str) -> Path:
        safe_kind = "".join(c if c.isalnum() else "_" for c in device_kind)
        return self.directory / f"jax-{self.jax_version}" / f"method-{METHOD}" / safe_kind / f"{signature}.json"

    def get(self, signature: str, device_kind: str) -> LayerTiming | None:
        path = self._path(signature, device_kind)
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            for curve in ("forward_at", "backward_at"):
                data[curve] = tuple(tuple(point) for point in data.get(curve, ()))
            return LayerTiming(**data)
        except (ValueError, TypeError):
            return None  # a damaged entry is measured again

    def put(self, timing: LayerTiming) -> None:
        path = self._path(timing.signature, timing.device_kind)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(timing)))
