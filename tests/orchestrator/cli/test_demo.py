"""``orchestrator demo``'s pieces on small instances: the plan against the baselines, and the dispatch count.

The demo itself (a gpt-1.3b plan and a local pipeline run, minutes) is what ``make demo`` runs.
"""

import io
import re

from rich.console import Console

from orchestrator.bench._synthetic import SyntheticCosts, SyntheticLayer, synthetic_cluster
from orchestrator.cli._executor import _against_baselines, _DispatchClock
from orchestrator.planner import plan

BLOCK = SyntheticLayer(flops=4e12, param_bytes=2e9, activation_per_sample=0.5e9, output_per_sample=0.05e9)


def test_the_plan_is_shown_next_to_the_baselines_with_the_speedup_over_each():
    # a twice-as-fast type beside a slow one: the best plan is a pipeline across both
    cluster = synthetic_cluster({"fast": (40.0, 1000.0), "slow": (20.0, 1000.0)}, per_host=1, network_gbps=1e6)
    model = SyntheticCosts([BLOCK] * 12, cluster)
    found = plan(model, global_batch=32, time_limit_s=30)
    assert len(found.stages) > 1 and {s.device_type for s in found.stages} == {"fast", "slow"}
    out = io.StringIO()
    _against_baselines(Console(file=out, width=200), found, model, 32)
    text = out.getvalue()
    rows = {
        name: row
        for name in ("orchestrator (ILP)", "Alpa-style", "uniform")
        for row in text.splitlines()
        if name in row
    }
    assert set(rows) == {"orchestrator (ILP)", "Alpa-style", "uniform"}
    for name in ("Alpa-style", "uniform"):
        speedup = float(re.search(r"([0-9.]+)×", rows[name])[1])
        assert speedup >= 1.0  # no baseline beats the planner on its own cost model


def test_the_dispatch_clock_counts_each_steps_calls_and_their_host_time():
    clock = _DispatchClock()
    for calls in (3, 5):
        clock.on_step_begin(2)
        for _ in range(calls):
            clock.on_dispatch(None)
            clock.on_dispatched(None, None)
        clock.on_step_end()
    assert clock.calls == [3, 5]
    assert all(t >= 0 for t in clock.host_s)
