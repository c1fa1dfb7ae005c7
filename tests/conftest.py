"""Test set-up: 8 virtual CPU devices stand in for a cluster.

XLA_FLAGS must be set before jax is imported anywhere. The profile cache is a fresh folder per
test session: a test never reads timings an earlier run on the same machine left behind (one did:
the Replanner's test planned differently from a stale cache than from a fresh one, as CI has).
"""

import os
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["ORCHESTRATOR_CACHE"] = tempfile.mkdtemp(prefix="orchestrator-test-cache-")
