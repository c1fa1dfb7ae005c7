"""apply(plan) on 4 CPU XLA devices: DP, TP and DP×TP against one device and against the planner.

The torch_xla part runs once, in a fresh process (``_xla_worker``): torch_xla
needs ``PJRT_DEVICE=CPU``, ``CPU_NUM_DEVICES=4`` and an HLO dump directory set
before it starts, and this process runs jax with 8 host devices.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from integrations.torch_xla import Callback, Checkpointer, PlanNotSupported, StepTimer, apply, fit, partition_spec
from orchestrator.bench._torch import _plan
from orchestrator.planner import Plan


@pytest.fixture(scope="module")
def worker():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_DEVICE", "CPU_NUM_DEVICES")}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integrations.torch_xla._xla_worker"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {record["name"].split()[1]: record for record in result["configs"]}


@pytest.mark.parametrize("config", ["DP", "TP", "DPxTP"])
def test_training_equals_single_device(worker, config):
    record = worker[config]
    assert len(record["losses"]) == 5
    assert record["loss_rel_err"] <= 1e-5
    assert record["param_rel_err_global"] <= 1e-5
    assert record["losses"][-1] < record["losses"][0]  # it trains


def test_tensor_parallel_collectives_match_the_planner(worker):
    record = worker["TP"]
    measured = record["hlo_collective_bytes"]
    assert measured["all-reduce"] == pytest.approx(record["predicted_all_reduce_bytes"], rel=0.01)
    assert sum(v for k, v in measured.items() if k != "all-reduce") == 0


@pytest.mark.parametrize("config", ["DP", "DPxTP"])
def test_data_parallel_collectives_match_the_planner(worker, config):
    """Including the tied embedding, whose two gradient contributions XLA all-reduces apart."""
    record = worker[config]
    measured = record["hlo_collective_bytes"]
    assert measured["all-reduce"] == pytest.approx(record["predicted_all_reduce_bytes"], rel=0.01)
    assert sum(v for k, v in measured.items() if k != "all-reduce") == 0


def test_checkpoint_round_trip(worker):
    checkpoint = worker["DP"]["checkpoint"]
    assert checkpoint["steps_saved"] == [4]
    assert checkpoint["restored_step"] == 4
    assert checkpoint["max_abs_after_zeroing"] == 0.0
    assert checkpoint["max_abs_diff_after_restore"] == 0.0


def test_step_timer_times_every_step(worker):
    # how the compiling steps compare is a timing claim: `orchestrator bench torch`
    times = worker["TP"]["step_times_s"]
    assert len(times) == 5 and all(t > 0 for t in times)


def test_pipeline_plans_are_refused():
    one = _plan(2, 1, 8, 4).stages[0]
    two = Plan(stages=(one, one), schedule="1f1b", microbatches=2, global_batch=8, iteration_s=0.0)
    with pytest.raises(PlanNotSupported, match="2 pipeline stages"):
        apply(two, torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))


@pytest.mark.parametrize("option", ["fsdp", "sequence_parallel", "selective_recompute"])
def test_options_torch_xla_does_not_run_are_refused(option):
    plan = _plan(2, 1, 8, 4)
    plan = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], **{option: True}),))
    with pytest.raises(PlanNotSupported, match=option):
        apply(plan, torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))


def test_tensor_parallel_needs_axes():
    with pytest.raises(PlanNotSupported, match="param_axes"):
        lin = torch.nn.Linear(2, 2)
        apply(_plan(1, 2, 8, 4), lin, torch.optim.SGD(lin.parameters(), lr=0.1))
    assert partition_spec(("embed", None, "heads", "kv"), (32, 3, 4, 8), 2) == (None, None, "model", None)
    assert partition_spec(("embed", "mlp"), (32, 128), 1) == (None, None)
    assert partition_spec(("vocab", "embed"), (64, 32), 4) == ("model", None)  # the default table splits vocab
    assert partition_spec(("vocab", "embed"), (64, 32), 4, (("vocab", None),)) == (None, None)


class _HeadsThenMlp(torch.nn.Module):
    """One (heads, mlp) = (6, 8) weight: tp = 4 does not divide its first tensor-parallel dim."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(6, 8))

    def forward(self, x):  # (batch, 6)
        return (x @ self.w).square().mean()


def test_a_dim_that_does_not_divide_is_skipped_alike_by_costs_flax_and_torch():
    from integrations.flax._shard import param_spec
    from integrations.torch_xla import capture
    from orchestrator.cluster import load_cluster
    from orchestrator.coarsen import coarsen
    from orchestrator.costs import CostModel, sharded_dim

    axes, shape, tp = ("heads", "mlp"), (6, 8), 4
    graph = capture(_HeadsThenMlp(), torch.ones(2, 6))
    model = CostModel(graph, coarsen(graph), load_cluster("a100x8"), batch_size=2, param_axes={"w": axes})
    assert sharded_dim(graph.params["w"].shape, axes, tp) == 1
    assert model.traits_for(tp).param_roles["w"] == "column"  # its later (mlp) dim is split
    assert tuple(param_spec(shape, axes, tp)) == (None, "model")
    assert partition_spec(axes, shape, tp) == (None, "model")


def test_fit_calls_hooks_in_order():
    events = []

    class Recorder(Callback):
        def on_train_begin(self, *, state=None, plan=None):
            events.append("begin")

        def on_step_begin(self, step):
            events.append(f"step {step}")

        def on_step_end(self, step, metrics, *, state=None):
            events.append(f"end {step} {metrics['loss']:.1f}")

        def on_train_end(self, *, state=None):
            events.append("done")

    timer = StepTimer()  # the first step (compilation) is not timed
    history = fit(lambda x: torch.tensor(x * 2.0), [(1.0,), (2.0,)], callbacks=[Recorder(), timer])
    assert history == [{"loss": 2.0}, {"loss": 4.0}]
    assert events == ["begin", "step 0", "end 0 2.0", "step 1", "end 1 4.0", "done"]
    assert len(timer.times_s) == 1 and timer.median_s == timer.times_s[0]
    assert StepTimer().median_s is None  # no step timed yet


def test_one_callback_protocol_for_both_frameworks():
    import integrations.callbacks as shared
    import integrations.torch_xla as tx

    assert (tx.Callback, tx.StepTimer, tx.Checkpointer) == (shared.Callback, shared.StepTimer, shared.Checkpointer)


def test_fit_hands_the_plan_to_the_callbacks():
    plan = _plan(1, 1, 8, 4)
    seen = []

    class PlanOf(Callback):
        def on_train_begin(self, *, state=None, plan=None):
            seen.append(plan)

    def step(x):
        return torch.tensor(x)

    step.plan = plan
    fit(step, [(1.0,)], [PlanOf()])
    assert seen == [plan]


def test_checkpointer_saves_on_schedule_through_a_store(tmp_path):
    class Store:  # a store that reads the live state itself, as the torch one does
        holds_state = True
        directory = tmp_path

        def __init__(self):
            self.saved = []

        def save(self, step, state):
            self.saved.append(step)

        def steps(self):
            return list(self.saved)

        def restore(self, step, target):
            return step

        def wait(self):
            pass

        def close(self):
            pass

    store = Store()
    checkpointer = Checkpointer(store=store, every=2)
    fit(lambda x: torch.tensor(x), [(1.0,)] * 5, [checkpointer])
    assert store.saved == [1, 3, 4]  # every second step, then the last one at the end
    assert checkpointer.restore() == 4
    with pytest.raises(FileNotFoundError, match="no checkpoint for step 7"):
        checkpointer.restore(step=7)
    with pytest.raises(ValueError, match="not both"):
        Checkpointer(tmp_path, store=store)
