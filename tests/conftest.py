"""Test set-up: 8 virtual CPU devices stand in for a cluster.

XLA_FLAGS must be set before jax is imported anywhere. The profile cache is a fresh folder per
test run: a test never reads timings an earlier run on the same machine left behind, so it plans
from the same timings as on a fresh clone (a stale cache can change a plan, as the Replanner's does).
"""

import os
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["ORCHESTRATOR_CACHE"] = tempfile.mkdtemp(prefix="orchestrator-test-cache-")
