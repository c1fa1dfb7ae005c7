"""Context parallelism for a recurrent model: a Mamba whose selective scan at T = 4096 does not fit one
small device is planned with the sequence split (CP > 1), and the plan trains 5 steps on 8 CPU devices,
each sequence contiguous and the scan run sequence-sharded (the carry passed between devices), with the
losses of one device at the same length."""

from pathlib import Path

import jax
import numpy as np
import pytest

from integrations.flax import capture, compile_step, shard
from integrations.flax._context import context_batch, context_mesh, context_parallel_step
from orchestrator.cluster import load_cluster
from orchestrator.coarsen import coarsen
from orchestrator.costs import CostModel, ParallelConfig
from orchestrator.planner import plan
from orchestrator.planner._groups import usable_memory_bytes
from recipes import MambaConfig, Recipe

CLUSTER = Path(__file__).parents[2] / "clusters" / "small-cpu-8.yaml"
CONFIG = MambaConfig(vocab_size=64, num_layers=2, d_model=32, d_state=4)
RECIPE = Recipe(name="mamba-long", config=CONFIG, batch_size=2, seq_len=4096)
STEPS = 5


@pytest.fixture(scope="module")
def planned():
    graph = capture(RECIPE.train_step, RECIPE.abstract_state(), RECIPE.batch_spec())
    model = CostModel(graph, coarsen(graph), load_cluster(CLUSTER), batch_size=RECIPE.batch_size)
    return model, plan(model, global_batch=RECIPE.batch_size, time_limit_s=10)


def test_a_sequence_whose_scan_does_not_fit_one_device_is_split(planned):
    model, found = planned
    usable = usable_memory_bytes(model.cluster.device_types["small"].memory_bytes, 0.1)
    block = next(i for i, layer in enumerate(model.layers) if "layers_" in layer.name)
    assert model.attention_length() is None and model.context_length() == RECIPE.seq_len
    assert model.scan_state(block) == (RECIPE.seq_len, CONFIG.d_inner, CONFIG.d_state)
    alone = model.layer_cost(block, "small", ParallelConfig(microbatch_size=1, recompute=True))
    assert alone.memory_bytes() > usable  # one sample's scan on one device: no plan without CP
    [stage] = found.stages
    assert stage.cp > 1 and stage.memory_bytes <= usable
    config = ParallelConfig(microbatch_size=stage.microbatch_size, dp=stage.dp, context_parallel=stage.cp)
    split = model.layer_cost(block, "small", config)
    assert split.breakdown["cp_bytes"] > 0 and split.cp_comm_s > 0  # the carry, priced
    assert split.cp_form is None  # no attention, no ring-or-gather choice


def test_the_plan_trains_with_the_scan_sharded_as_one_device_does(planned):
    _, found = planned
    [stage] = found.stages
    cluster = load_cluster(CLUSTER)
    state = shard(found, RECIPE.initial_state(0), cluster=cluster)
    step = compile_step(found, RECIPE.train_step, state, cluster=cluster)
    assert dict(step.mesh.shape) == {"data": stage.dp, "context": stage.cp, "model": 1}
    batches = [RECIPE.batch_for_step(0, i) for i in range(STEPS)]

    reference, alone = [], RECIPE.initial_state(0)
    one_device = jax.jit(RECIPE.train_step)
    for batch in batches:
        alone, metrics = one_device(alone, batch)
        reference.append(float(metrics["loss"]))

    fn = step.compile_for(state, batches[0])
    assert step.layout == "contiguous"  # the recurrence runs in token order
    lowered = fn.lower(state, context_batch(batches[0], step.mesh, layout="contiguous")).as_text()
    assert "all_gather" in lowered  # the carry: each device's final state, gathered
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert reference[-1] < reference[0]
    np.testing.assert_allclose(losses, reference, rtol=1e-5)


def test_a_scan_refuses_the_zigzag_layout():
    recipe = Recipe(name="mamba-short", config=CONFIG, batch_size=2, seq_len=256)
    mesh = context_mesh(jax.devices()[:8], context_parallel=4)
    step = context_parallel_step(recipe.train_step, mesh, layout="zigzag")
    with pytest.raises(ValueError, match="a scan runs on contiguous slices of the sequence"):
        step(recipe.initial_state(0), context_batch(recipe.batch_for_step(0, 0), mesh))
