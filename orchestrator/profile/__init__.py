"""Measured layer times, their disk cache, and efficiency calibration for the cost model.

Measuring itself is framework-specific: :func:`integrations.flax.profile_layers`
times each distinct layer of a captured JAX step on the local device.
"""

from orchestrator.profile._calibrate import calibrate, predict
from orchestrator.profile._records import LayerTiming, TimingCache, cache_dir

__all__ = ["LayerTiming", "TimingCache", "cache_dir", "calibrate", "predict"]
