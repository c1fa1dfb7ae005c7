"""Re-planning after each host of a four-type cluster is lost in turn: a plan always comes back, as good as a cold solve.

The cluster has the shape of ``mixed-4type-64`` (four device types, two hosts of each) at a size
the exact solve proves quickly: every stage of the plan spans the two hosts of its type, so losing
a host loses a stage, and re-placing it on the freed devices alone is worse than re-planning.
Losing both hosts of a type leaves no freed device a group fits: the repair has to drop a stage.
"""

import dataclasses

import pytest

from orchestrator.bench._synthetic import SyntheticCosts, SyntheticLayer, synthetic_cluster
from orchestrator.planner import plan, replan

BLOCK = SyntheticLayer(flops=4e12, param_bytes=2e9, activation_per_sample=0.5e9, output_per_sample=0.05e9)
# (TFLOP/s, memory GB): the fastest types hold twice the memory, as H100/A100 against V100/L4
TYPES = {"h100": (60.0, 80.0), "a100": (20.0, 80.0), "v100": (15.0, 40.0), "l4": (30.0, 40.0)}
SETTINGS = {"microbatch_candidates": (1, 2, 4, 8, 16), "max_stages": 8, "mixed_stages": False, "gap": 1e-6}
GLOBAL_BATCH = 16


@pytest.fixture(scope="module")
def planned():
    model = SyntheticCosts([BLOCK] * 8, synthetic_cluster(TYPES, hosts_per_type=2, per_host=2))
    return model, plan(model, global_batch=GLOBAL_BATCH, time_limit_s=60, **SETTINGS)


def _without(model, hosts):
    cluster = model.cluster
    gone = frozenset(d.ref for d in cluster.devices() if d.host in hosts)
    return SyntheticCosts(model.layers, dataclasses.replace(cluster, unavailable=cluster.unavailable | gone))


LOSSES = [(f"{kind}-{i}",) for kind in TYPES for i in range(2)] + [(f"{kind}-0", f"{kind}-1") for kind in TYPES]


@pytest.mark.parametrize("hosts", LOSSES, ids="+".join)
def test_losing_hosts_re_plans_within_the_cold_solves_gap(planned, hosts):
    model, before = planned
    # the loss touches the plan
    assert any(d.split("/")[0] in hosts for s in before.stages for d in s.devices)
    after = _without(model, hosts)
    cold = plan(after, global_batch=GLOBAL_BATCH, time_limit_s=60, **SETTINGS)
    # the fast path: a repair it cannot certify, or none, makes it widen by itself
    warm = replan(before, after, time_limit_s=60, widen=False, horizon_steps=None, **SETTINGS)
    alive = {d.ref for d in after.cluster.devices()}
    assert all(d in alive for s in warm.stages for d in s.devices)
    assert warm.iteration_s <= cold.iteration_s * (1 + cold.gap) + 1e-12
    assert warm.bound <= cold.iteration_s * (1 + 1e-9)  # certified against a true lower bound
    lost = ", ".join(f"host {host} (2 devices)" for host in hosts)
    assert warm.notes[0].startswith(f"re-planned after losing {lost}: ")
    assert f"→ {warm.iteration_s:.4g} s" in warm.notes[0]
