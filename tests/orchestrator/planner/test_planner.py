"""The planner ILP against exhaustive enumeration, and its plans' validity."""

import pytest

from integrations.flax import capture
from orchestrator.cluster import parse_cluster
from orchestrator.coarsen import coarsen
from orchestrator.costs import CostModel
from orchestrator.planner import Plan, PlanInfeasible, plan
from orchestrator.planner.baselines import exhaustive_plan
from recipes import get_recipe


def _cluster(types: dict[str, tuple[float, int]], hosts_per_type: int = 1, per_host: int = 2):
    """Device types by (TFLOP/s, memory bytes); hosts of ``per_host`` devices."""
    return parse_cluster(
        {
            "name": "tiny",
            "device_types": {
                name: {"peak_tflops": {"float32": tflops}, "memory_bytes": memory, "memory_bandwidth_gbps": 1000}
                for name, (tflops, memory) in types.items()
            },
            "hosts": [
                {
                    "name": f"{name}-{i}",
                    "device_type": name,
                    "count": per_host,
                    "rack": "r",
                    "intra_link": {"bandwidth_gbps": 100, "latency_us": 2},
                }
                for name in types
                for i in range(hosts_per_type)
            ],
            "network": {"rack": {"bandwidth_gbps": 10, "latency_us": 5}},
        }
    )


@pytest.fixture(scope="module")
def tiny():
    recipe = get_recipe("gpt-tiny")
    graph = capture(recipe.train_step, recipe.abstract_state(), recipe.batch_spec(8, 64))
    return recipe, graph, coarsen(graph)


CLUSTERS = {
    "one type, ample memory": {"fast": (10.0, 2**34)},
    "two speeds": {"fast": (20.0, 2**34), "slow": (5.0, 2**34)},
    "tight memory": {"small": (10.0, 3_000_000)},
}


@pytest.mark.parametrize("name", sorted(CLUSTERS))
def test_ilp_equals_exhaustive(tiny, name):
    recipe, graph, layers = tiny
    model = CostModel(graph, layers, _cluster(CLUSTERS[name]), batch_size=8, param_axes=recipe.param_axes())
    kwargs = {"global_batch": 8, "microbatch_candidates": (1, 2, 4), "max_stages": 3}
    truth = exhaustive_plan(model, **kwargs)
    if truth is None:
        with pytest.raises(PlanInfeasible):
            plan(model, **kwargs)
        return
    found = plan(model, time_limit_s=60, gap=1e-6, **kwargs)
    assert found.iteration_s == pytest.approx(truth.iteration_s, rel=1e-3)
    # valid: every layer once, stages contiguous, no device twice, memory within capacity
    assert [l for s in found.stages for l in s.layers] == list(range(len(layers)))
    devices = [d for s in found.stages for d in s.devices]
    assert len(devices) == len(set(devices))
    for stage in found.stages:
        assert len(stage.devices) == stage.tp * stage.dp
        assert stage.memory_bytes <= model.cluster.device_types[stage.device_type].memory_bytes
    # the certified gap covers the space searched, which holds the plan itself
    own = [(s.device_type, s.tp * s.dp, s.tp, s.recompute) for s in found.stages]
    assert found.space.microbatches == (4, 2, 1)
    assert found.space.max_stages == min(3, len(model.cluster.devices()))
    assert found.space.contains(microbatches=found.microbatches, stages=own)
    assert Plan.from_json(found.to_json()) == found


def test_infeasible_when_nothing_fits(tiny):
    recipe, graph, layers = tiny
    model = CostModel(graph, layers, _cluster({"tiny": (10.0, 10_000)}), batch_size=8, param_axes=recipe.param_axes())
    with pytest.raises(PlanInfeasible, match="exceeds device memory"):
        plan(model, global_batch=8, microbatch_candidates=(1, 2), max_stages=2)


def test_plan_cli_json_and_explain(tmp_path):
    import json

    from typer.testing import CliRunner

    from orchestrator.cli import app

    out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        app,
        [
            "plan",
            "--recipe",
            "gpt-tiny",
            "--cluster",
            "a100x8",
            "--batch",
            "16",
            "--max-stages",
            "2",
            "--out",
            str(out),
            "--trace",
            str(tmp_path / "trace.json"),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [l for s in payload["stages"] for l in s["layers"]] == [0, 1, 2, 3]
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert any(event.get("ph") == "X" for event in trace["traceEvents"])
    saved = Plan.load(out)
    assert saved.to_json() == payload
    text = saved.explain()
    assert "predicted step" in text and "a100" in text
    bad = CliRunner().invoke(app, ["plan", "--recipe", "gpt-tiny", "--cluster", "nope"])
    assert bad.exit_code == 2 and "unknown cluster preset 'nope'" in bad.stderr


def test_balanced_heuristic_may_use_the_whole_heuristic_window(tiny, monkeypatch):
    """The balanced heuristic gets the whole window of the first incumbent, not a share of it: on
    the largest clusters it needs most of that window to find any plan; the baselines share what
    it leaves."""
    import time

    import orchestrator.planner.baselines as baselines
    from orchestrator.planner._space import search_space
    from orchestrator.planner._starts import heuristic

    _, graph, layers = tiny
    model = CostModel(graph, layers, _cluster({"fast": (10.0, 2**34)}), batch_size=8)
    real, given = baselines.balanced, []

    def recorded_balanced(model, *, deadline=None, **settings):
        given.append(deadline)
        return real(model, **settings)

    monkeypatch.setattr(baselines, "balanced", recorded_balanced)
    monkeypatch.setattr(baselines, "BASELINES", {f"b{i}": lambda model, **settings: None for i in range(5)})
    space = search_space(model, 8, recompute=True)
    window = time.perf_counter() + 1000.0
    found = heuristic(model, space, 8, "1f1b", [4, 2, 1], 4, True, deadline=window)
    assert given == [window]
    assert found is not None and found.iteration_s > 0
