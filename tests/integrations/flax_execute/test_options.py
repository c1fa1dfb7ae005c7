"""A plan's FSDP, sequence parallelism and selective recompute, run on the 8 virtual devices for
tiny GPT on one stage and in pipeline stages (FSDP under virtual stages too): five steps train like
one device, and the compiled programs communicate and hold what the cost model prices for the option."""

import dataclasses

import jax
import numpy as np
import pytest

from integrations.flax import capture, compile_step, hlo_collective_bytes, shard
from orchestrator.bench.executor import check_plan, parity
from orchestrator.bench.executor._parity import _reference
from orchestrator.cluster import load_cluster
from orchestrator.coarsen import coarsen
from orchestrator.costs import CostModel, ParallelConfig
from recipes import get_recipe, synthetic_batch


def _with(plan, **options):
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, **options) for s in plan.stages))


def _priced(plan, batch: int, seq: int, **options):
    """The cost model's layer costs for the plan's one stage with ``options`` (``ParallelConfig``)."""
    recipe = get_recipe("gpt-tiny")
    graph = capture(recipe.train_step, recipe.abstract_state(), recipe.batch_spec(batch, seq))
    cluster = load_cluster("local")
    [device_type] = cluster.device_types
    model = CostModel(graph, coarsen(graph), cluster, batch_size=batch, param_axes=recipe.param_axes())
    [stage] = plan.stages
    config = ParallelConfig(tp=stage.tp, dp=stage.dp, microbatch_size=stage.microbatch_size, **options)
    return [model.layer_cost(i, device_type, config) for i in range(len(model.layers))]


def _compiled(plan, batch: int, seq: int):
    """(collective bytes by kind, memory_analysis) of the plan's compiled step."""
    recipe = get_recipe("gpt-tiny")
    state, batches, _, _, axes, layers = _reference("gpt-tiny", 5, batch, seq)
    placed = shard(plan, state, param_axes=axes, layers=layers)
    step = compile_step(plan, recipe.train_step, placed, param_axes=axes, layers=layers)
    compiled = step.compiled(placed, batches[0])
    return hlo_collective_bytes(compiled.as_text()), compiled.memory_analysis()


def _peak(memory) -> int:
    return (
        memory.argument_size_in_bytes
        + memory.temp_size_in_bytes
        + memory.output_size_in_bytes
        - (memory.alias_size_in_bytes)
    )


def _priced_peak(costs) -> float:
    """A one-stage, one-microbatch plan's peak as the planner adds it up: every layer's state and
    kept activations, and the largest transient."""
    return sum(c.param_bytes + c.grad_bytes + c.optimizer_bytes + c.activation_bytes for c in costs) + max(
        c.transient_bytes for c in costs
    )


def _trains_like_one_device(plan, batch: int, seq: int):
    result = parity("gpt-tiny", plan, steps=5, global_batch=batch, seq_len=seq)
    assert result.losses[-1] < result.losses[0]
    assert result.loss_rel_err < 1e-5, (result.losses, result.reference_losses)
    assert result.param_abs_err < 1e-4


def test_fsdp_shards_parameters_and_moments_and_trains_like_one_device():
    plan = _with(check_plan("DP8", global_batch=16), fsdp=True)
    state, _, _, _, axes, layers = _reference("gpt-tiny", 5, 16, 16)
    placed = shard(plan, state, param_axes=axes, layers=layers)
    kernel = placed.params["blocks_0"]["mlp"]["c_fc"]["kernel"]
    assert "data" in str(kernel.sharding.spec)
    assert kernel.addressable_shards[0].data.shape[0] == kernel.shape[0] // 8
    _trains_like_one_device(plan, 16, 16)


def test_fsdp_communicates_and_stores_what_is_priced():
    """The gradient sync (an all-reduce sliced to the shard on XLA:CPU, a reduce-scatter on GPUs:
    the same operand bytes) and the per-use parameter gathers add up to the priced bytes within
    1%; the stored state (XLA's argument bytes) is the priced 1/8 of parameters and moments."""
    plain, fsdp = check_plan("DP8", global_batch=16), _with(check_plan("DP8", global_batch=16), fsdp=True)
    costs = _priced(fsdp, 16, 16, fsdp=True)
    measured, memory = _compiled(fsdp, 16, 16)
    _, plain_memory = _compiled(plain, 16, 16)
    sync = sum(c.dp_sync_bytes for c in costs)
    gathers = sum(c.breakdown["dp_gather_bytes"] for c in costs) / 8  # each device sends its shard
    assert measured["all-gather"] > 0 and measured["collective-permute"] == measured["all-to-all"] == 0
    assert sum(measured.values()) == pytest.approx(sync + gathers, rel=0.01), (measured, sync, gathers)
    stored = sum(c.param_bytes + c.optimizer_bytes for c in costs)
    assert memory.argument_size_in_bytes == pytest.approx(stored, rel=0.01)
    assert memory.argument_size_in_bytes < plain_memory.argument_size_in_bytes / 6


@pytest.mark.parametrize("plan_name", ["DP8", "DP2xTP4"])
def test_selective_recompute_trains_like_one_device(plan_name):
    _trains_like_one_device(_with(check_plan(plan_name, global_batch=16), selective_recompute=True), 16, 32)


def test_selective_recompute_holds_what_is_priced():
    """The core attention's values leave the forward: XLA's peak falls, and each peak is within
    10% of the priced one (as the block's memory is checked in tests/orchestrator/test_costs.py);
    the communication is the plain plan's."""
    plain = check_plan("DP8", global_batch=64)
    selective = _with(plain, selective_recompute=True)
    plain_bytes, plain_memory = _compiled(plain, 64, 64)
    measured, memory = _compiled(selective, 64, 64)
    assert measured == plain_bytes
    priced_plain = _priced_peak(_priced(plain, 64, 64))
    priced = _priced_peak(_priced(plain, 64, 64, selective_recompute=True))
    assert _peak(memory) < _peak(plain_memory) and priced < priced_plain
    assert _peak(plain_memory) == pytest.approx(priced_plain, rel=0.10)
    assert _peak(memory) == pytest.approx(priced, rel=0.10)


@pytest.mark.parametrize("option", ["sequence_parallel", "selective_recompute"])
def test_a_pipeline_runs_the_option_in_its_stages_and_trains_like_one_device(option):
    """Stage 0 of this plan is DP2×TP2 (sequence parallelism under ``shard_map``, the core
    attention under ``jax.checkpoint`` in its own backward program), stage 1 DP4."""
    _trains_like_one_device(_with(check_plan("2 stages (3+1) x 4 mb", global_batch=16), **{option: True}), 16, 32)


def _first_stage(plan, seq: int):
    """(stage 0's collective bytes per step, bytes its first forward program returns: outputs and
    the residuals its backward reads)."""
    from integrations.flax._pipeline import _Recorder

    recipe = get_recipe("gpt-tiny")
    state, batches, _, _, axes, layers = _reference("gpt-tiny", 5, 16, seq)
    placed = shard(plan, state, param_axes=axes, layers=layers)
    step = compile_step(plan, recipe.train_step, placed, param_axes=axes, layers=layers)
    recorder = _Recorder(plan.microbatches)
    step.observers.append(recorder)
    placed, _ = step(placed, batches[0])
    step.observers.remove(recorder)
    _, _, forward, args = next(call for call in recorder.calls if call[0] == 0)
    returned = forward.lower(*args).compile().memory_analysis().output_size_in_bytes
    per_stage, _ = step.collective_bytes(placed, batches[1])
    return per_stage[0], returned


def test_a_pipeline_stage_runs_what_its_options_say():
    """Sequence parallelism adds all-gathers to stage 0's programs; selective recompute shrinks
    what its forward hands its backward (the core's values are rebuilt there)."""
    plan = check_plan("2 stages (3+1) x 4 mb", global_batch=16)
    plain_bytes, plain_returned = _first_stage(plan, 32)
    sp_bytes, _ = _first_stage(_with(plan, sequence_parallel=True), 32)
    _, selective_returned = _first_stage(_with(plan, selective_recompute=True), 32)
    assert plain_bytes["all-gather"] == 0 and sp_bytes["all-gather"] > 0
    assert selective_returned < plain_returned


def _train_pipeline(recipe, plan, state, batches, layers):
    """(losses, final params on the host, per-stage collective bytes of one more step, and the
    layout of every state leaf, as (spec, elements per device, elements), placed and after the
    steps) of ``plan`` run from ``state``."""
    axes = recipe.param_axes()
    placed = shard(plan, state, param_axes=axes, layers=layers)
    stored = _layout(placed)
    step = compile_step(plan, recipe.train_step, placed, param_axes=axes, layers=layers)
    losses = []
    for batch in batches:
        placed, metrics = step(placed, batch)
        losses.append(float(metrics["loss"]))
    params = jax.tree.map(np.asarray, placed.params)  # the next step donates the state
    collectives, placed = step.collective_bytes(placed, batches[0])
    return losses, params, collectives, (stored, _layout(placed))


def _layout(state):
    return jax.tree.map(lambda x: (str(x.sharding.spec), x.addressable_shards[0].data.size, x.size), state)


def _is_layout(x) -> bool:
    return isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], str)


def _priced_fsdp(recipe, plan, layers, batch: int, seq: int) -> list[dict[str, float]]:
    """Per stage, the cost model's collective bytes per device per step under FSDP: the
    tensor-parallel all-reduces of every microbatch and the gradients' one reduce-scatter
    (accumulated: full-size gradients), operand bytes alike on XLA:CPU's all-reduce; and the one
    all-gather of every parameter its layers read, each device sending its 1/dp shard."""
    graph = capture(recipe.train_step, recipe.abstract_state(), recipe.batch_spec(batch, seq))
    cluster = load_cluster("local")
    [device_type] = cluster.device_types
    model = CostModel(graph, layers, cluster, batch_size=batch, param_axes=recipe.param_axes())
    out = []
    for stage in plan.stages:
        config = ParallelConfig(
            tp=stage.tp, dp=stage.dp, microbatch_size=stage.microbatch_size, fsdp=True, accumulate_gradients=True
        )
        costs = [model.layer_cost(i, device_type, config) for i in stage.layers]
        tensor = plan.microbatches * sum(c.tp_allreduce_bytes for c in costs)
        out.append(
            {
                "all-reduce": tensor + sum(c.dp_sync_bytes for c in costs),
                "all-gather": sum(c.breakdown["dp_gather_bytes"] for c in costs) / stage.dp,
            }
        )
    return out


def _assert_like_one_device(losses, params, reference_losses, reference_params):
    losses, reference = np.array(losses), np.array(reference_losses)
    assert losses[-1] < losses[0]
    assert np.max(np.abs(losses / reference - 1)) < 1e-5, (losses, reference)
    for ours, theirs in zip(jax.tree.leaves(params), jax.tree.leaves(reference_params)):
        np.testing.assert_allclose(ours, theirs, atol=1e-4)


def _assert_priced(collectives, priced):
    for measured, price in zip(collectives, priced, strict=True):
        assert measured["all-gather"] > 0
        for kind in ("all-reduce", "all-gather"):
            assert measured[kind] == pytest.approx(price[kind], rel=0.01), (kind, measured, price)
        assert measured["reduce-scatter"] == measured["collective-permute"] == measured["all-to-all"] == 0


@pytest.fixture(scope="module")
def fsdp_pipeline():
    """Stage 0 DP2×TP2, stage 1 DP4, both FSDP, 1F1B over 4 microbatches: five steps, then one
    more with its collectives counted."""
    plan = _with(check_plan("2 stages (3+1) x 4 mb", global_batch=16), fsdp=True)
    recipe = get_recipe("gpt-tiny")
    state, batches, reference_losses, reference_params, _, layers = _reference("gpt-tiny", 5, 16, 16)
    losses, params, collectives, layouts = _train_pipeline(recipe, plan, state, batches, layers)
    return {
        "plan": plan,
        "recipe": recipe,
        "layers": layers,
        "trained": (losses, params, reference_losses, reference_params),
        "collectives": collectives,
        "layouts": layouts,
    }


def test_a_pipeline_of_fsdp_stages_stores_shards_and_trains_like_one_device(fsdp_pipeline):
    """Each stage stores its parameters and moments split over its own replicas, before and after
    the steps (a block's kernel over stage 0's 2 tensor × 2 data ranks, the final LayerNorm over
    stage 1's 4 replicas: a quarter per device each), and the five steps are single-device training."""
    for layout in fsdp_pipeline["layouts"]:
        for spec, per_device, size in (
            layout.params["blocks_0"]["mlp"]["c_fc"]["kernel"],
            layout.params["ln_f"]["scale"],
        ):
            assert "data" in spec and per_device == size // 4
        moments = [
            spec
            for path, (spec, _, _) in jax.tree_util.tree_flatten_with_path(layout.opt_state, is_leaf=_is_layout)[0]
            if any(getattr(k, "name", None) in ("mu", "nu") for k in path)
        ]
        assert moments and all("data" in spec for spec in moments)
    _assert_like_one_device(*fsdp_pipeline["trained"])


def test_a_pipeline_of_fsdp_stages_communicates_what_is_priced(fsdp_pipeline):
    """Per stage, one all-gather a step of every parameter its layers read (the tied table on both
    stages) and one gradient sync (a reduce-scatter into the stored shards: on XLA:CPU an
    all-reduce sliced to the shard, the same operand bytes) beside the tensor-parallel all-reduces,
    each kind within 1% of the cost model's FSDP bytes."""
    plan, recipe, layers = fsdp_pipeline["plan"], fsdp_pipeline["recipe"], fsdp_pipeline["layers"]
    _assert_priced(fsdp_pipeline["collectives"], _priced_fsdp(recipe, plan, layers, 16, 16))


def test_an_interleaved_pipeline_of_fsdp_stages_trains_like_one_device_and_communicates_what_is_priced():
    """Virtual stages (tiny GPT of four blocks on 2 stages of DP2×TP2, 2 chunks each): a stage
    gathers what all its chunks read once a step, and syncs their gradients once."""
    from tests.integrations.flax_execute.test_interleaved import BATCH, RECIPE, SEQ, STEPS
    from tests.integrations.flax_execute.test_interleaved import _plan as interleaved_plan

    cluster = load_cluster("local")
    [device_type] = cluster.device_types
    plan = _with(interleaved_plan(device_type), fsdp=True)
    layers = coarsen(capture(RECIPE.train_step, RECIPE.abstract_state(), RECIPE.batch_spec(BATCH, SEQ)))
    batches = [synthetic_batch(jax.random.key(i), BATCH, SEQ, RECIPE.config.vocab_size) for i in range(STEPS)]
    state = jax.jit(RECIPE.create_state)(jax.random.key(0))
    reference, reference_state, reference_losses = jax.jit(RECIPE.train_step), state, []
    for batch in batches:
        reference_state, metrics = reference(reference_state, batch)
        reference_losses.append(float(metrics["loss"]))
    losses, params, collectives, _ = _train_pipeline(RECIPE, plan, state, batches, layers)
    _assert_like_one_device(losses, params, reference_losses, reference_state.params)
    _assert_priced(collectives, _priced_fsdp(RECIPE, plan, layers, BATCH, SEQ))


@pytest.mark.parametrize("plan_name", ["TP4", "DP2xTP4"])
def test_sequence_parallelism_trains_like_one_device(plan_name):
    _trains_like_one_device(_with(check_plan(plan_name, global_batch=16), sequence_parallel=True), 16, 32)


@pytest.mark.parametrize("plan_name", ["TP4", "DP2xTP4"])
def test_sequence_parallelism_communicates_what_is_priced(plan_name):
    """Each tensor-parallel all-reduce becomes a reduce-scatter of the same operand bytes (on
    XLA:CPU an all-reduce sliced to the sequence shard; GPUs fuse the two) and an all-gather of
    1/tp of them; the gradients of what the sequence split reads (LayerNorm scales, biases, the
    positional table) are all-reduced over the tensor ranks. Each kind within 1% of the price."""
    plain = check_plan(plan_name, global_batch=16)
    sp = _with(plain, sequence_parallel=True)
    [stage] = sp.stages
    costs = _priced(sp, 16, 32, sequence_parallel=True)
    tensor = sum(c.tp_allreduce_bytes for c in costs)
    assert tensor == sum(c.tp_allreduce_bytes for c in _priced(plain, 16, 32))
    reduced = tensor + sum(c.breakdown["sp_grad_bytes"] for c in costs) + sum(c.dp_sync_bytes for c in costs)
    measured, _ = _compiled(sp, 16, 32)
    plain_measured, _ = _compiled(plain, 16, 32)
    assert plain_measured["all-gather"] == 0 and measured["all-gather"] > 0
    assert measured["collective-permute"] == measured["all-to-all"] == 0
    # the data-parallel sync also all-reduces the 4-byte loss
    assert measured["all-reduce"] + measured["reduce-scatter"] == pytest.approx(reduced, rel=0.01)
    assert measured["all-gather"] == pytest.approx(tensor / stage.tp, rel=0.01)


def test_plan_with_fsdp_shards_every_data_parallel_stage_and_torch_xla_refuses_it_in_one_line():
    """``plan(fsdp=True)`` prices and records FSDP on every stage with replicas; the Flax executor
    runs such a stage (the tests above), ``integrations.torch_xla.apply`` says in one line it does not."""
    import torch

    from integrations.torch_xla import PlanNotSupported, apply
    from orchestrator.planner import plan

    recipe = get_recipe("gpt-tiny")
    graph = capture(recipe.train_step, recipe.abstract_state(), recipe.batch_spec(16, 16))
    model = CostModel(graph, coarsen(graph), load_cluster("local"), batch_size=16, param_axes=recipe.param_axes())
    found = plan(model, global_batch=16, fsdp=True, max_stages=1, time_limit_s=5)
    [stage] = found.stages
    assert stage.dp > 1 and stage.fsdp
    linear = torch.nn.Linear(2, 2)
    with pytest.raises(PlanNotSupported, match="fsdp") as error:
        apply(found, linear, torch.optim.SGD(linear.parameters(), lr=0.1))
    assert "\n" not in str(error.value)
