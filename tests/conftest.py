"""Test set-up: 8 virtual CPU devices stand in for a cluster.

XLA_FLAGS must be set before jax is imported anywhere. The profile cache is a fresh folder per
test run: a test never reads timings an earlier run on the same machine left behind, so it plans
from the same timings as on a fresh clone (a stale cache can change a plan, as the Replanner's does).

XLA's compiled programs are kept in a fresh folder per test process (jax's persistent compilation
cache): many tests compile the same step from a new closure (a recipe's train step under the same
plan, a profiler's layer pieces), which jit's in-memory cache cannot tell are the same program; the
disk cache keys on the program itself, so the second compile is a read. A cached executable is the
compiled one, so what a test checks (numbers, HLO collectives, memory analysis) is unchanged. It is
set through ``jax.config``, not the environment, so subprocesses a test starts (killed runs, other
processes of a distributed run) compile on their own and never read an entry another process is
still writing.
"""

import os
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["ORCHESTRATOR_CACHE"] = tempfile.mkdtemp(prefix="orchestrator-test-cache-")

import jax  # after XLA_FLAGS

jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="orchestrator-test-xla-cache-"))
# every program, however quick to compile: on the CI's 2 cores most of a test's compiles take under a second
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_configure(config):
    # an entry that does not serialise or read back is compiled instead, as jax intends: not a test failure
    config.addinivalue_line("filterwarnings", "ignore:Error (reading|writing) persistent compilation cache entry")
