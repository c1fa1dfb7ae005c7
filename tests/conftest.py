"""Test set-up: 8 virtual CPU devices stand in for a cluster.

XLA_FLAGS must be set before jax is imported anywhere.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
