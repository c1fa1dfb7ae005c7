"""Capturing the 175B GPT train step: under 30 s and 2 GiB peak RSS (issue 2)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from recipes import get_recipe


def get_recipe_param_count() -> int:
    return get_recipe("gpt-175b").config.param_count()


ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, re, time
t0 = time.perf_counter()

def peak_rss_bytes():
    # VmHWM: this program's own peak. ru_maxrss would carry the parent's peak across fork + exec.
    with open("/proc/self/status") as status:
        return int(re.search(r"VmHWM:\s+(\d+) kB", status.read())[1]) * 1024

from integrations.flax import capture
from orchestrator.coarsen import coarsen
from recipes import get_recipe
recipe = get_recipe("gpt-175b")
state = recipe.abstract_state()
graph = capture(recipe.train_step, state, recipe.batch_spec())
layers = coarsen(graph)
print(json.dumps({
    "seconds": time.perf_counter() - t0,
    "peak_rss_bytes": peak_rss_bytes(),
    "ops": len(graph), "layers": len(layers), "param_bytes": graph.param_bytes,
}))
"""


def test_capture_175b_is_fast_and_small():
    # a clean environment: what earlier tests exported (XLA dump flags and the like) must not leak in
    env = {k: os.environ[k] for k in ("PATH", "HOME", "PYTHONPATH") if k in os.environ}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, env=env, cwd=ROOT
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    print(result)
    assert result["layers"] == 96 + 2
    assert result["param_bytes"] == 4 * get_recipe_param_count()
    assert result["seconds"] < 30
    assert result["peak_rss_bytes"] < 2 * 1024**3
