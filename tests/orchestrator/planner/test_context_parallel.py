"""Context-parallel groups: their arithmetic, where the planner offers them, and what the cost table prices."""

import pytest

from integrations.flax import capture
from orchestrator.cluster import load_cluster
from orchestrator.coarsen import coarsen
from orchestrator.costs import CostModel, ParallelConfig
from orchestrator.planner._groups import GroupConfig, context_link, context_parallel_configs, type_infos
from orchestrator.planner._space import search_space
from recipes import get_recipe


def test_groups_split_the_sequence_where_it_divides():
    infos = type_infos(load_cluster("a100x8"))
    groups = context_parallel_configs(infos, seq_len=64, device_types={"a100"}, recompute=False)
    # with tensor parallelism inside each ring position (tp·cp dividing the group), as Llama 3 runs
    eight = {(8, 1, 2), (8, 1, 4), (8, 1, 8), (8, 2, 2), (8, 2, 4), (8, 4, 2)}
    assert {(g.size, g.tp, g.cp) for g in groups if g.size == 8} == eight
    assert all(g.size == g.tp * g.cp * g.dp for g in groups)
    plain = context_parallel_configs(infos, seq_len=64, device_types={"a100"}, recompute=False, tensor_parallel=False)
    assert {(g.size, g.tp, g.cp) for g in plain if g.size == 8} == {(8, 1, 2), (8, 1, 4), (8, 1, 8)}
    # the zigzag layout needs 2·cp chunks: T = 12 takes cp 2 only
    assert {g.cp for g in context_parallel_configs(infos, seq_len=12, device_types={"a100"})} == {2}
    # a data-parallel degree the batch does not divide is left out
    assert all(g.dp == 1 for g in context_parallel_configs(infos, seq_len=64, device_types={"a100"}, global_batch=1))
    assert context_parallel_configs(infos, seq_len=64, device_types=set()) == []
    assert GroupConfig(device_type="a100", size=8, tp=2, recompute=False, cp=2).dp == 2


@pytest.fixture(scope="module")
def tiny():
    recipe = get_recipe("gpt-tiny")
    graph = capture(recipe.train_step, recipe.abstract_state(), recipe.batch_spec())
    return CostModel(graph, coarsen(graph), load_cluster("a100x8"), batch_size=8, param_axes=recipe.param_axes())


def test_ample_memory_offers_no_context_parallelism(tiny):
    """Where every layer fits a device without it, the space is the space without context parallelism."""
    space = search_space(tiny, 8, recompute=True)
    assert all(g.cp == 1 for g in space.groups)
    assert all(len(group) == 4 for group in space.coverage([8], 4).groups)


def test_the_table_prices_the_ring_into_the_stage_time(tiny):
    space = search_space(tiny, 8, recompute=False)
    plain = GroupConfig(device_type="a100", size=2, tp=1, recompute=False)
    split = GroupConfig(device_type="a100", size=2, tp=1, recompute=False, cp=2)
    block = 1
    a, b = space.table.entry(block, plain, 1), space.table.entry(block, split, 1)
    # plain: 2 replicas of 4 samples; split: one replica of 8 samples over 2 devices, 4 samples' work each
    cost = tiny.layer_cost(block, "a100", ParallelConfig(microbatch_size=8, context_parallel=2))
    # and the ring's blockwise kernels run the attention's T × T work in place of the captured ops
    square_f, square_b = tiny._square_ops(block)
    swap_f = cost.breakdown["cp_attention_forward_s"] - tiny._core_time(block, "a100", 1, 4, square_f)
    swap_b = cost.breakdown["cp_attention_backward_s"] - tiny._core_time(block, "a100", 1, 4, square_b, "backward")
    assert b.time_s == pytest.approx(a.time_s + cost.cp_comm_s + swap_f + swap_b)
    assert b.forward_s == pytest.approx(a.forward_s + cost.breakdown["cp_forward_s"] + swap_f)
    # 4 samples' activations each, less the scores the blockwise kernels never write
    assert b.activation_bytes == pytest.approx(cost.activation_bytes) and b.activation_bytes < a.activation_bytes
    assert cost.transient_bytes > tiny._memory(block, 1, 4, blockwise=True)[1]  # the K/V blocks in flight


def test_a_plan_names_a_known_attention_form():
    from orchestrator.planner import Plan, Stage

    stage = Stage(
        layers=(0,),
        device_type="a100",
        devices=("h/0", "h/1"),
        tp=1,
        dp=1,
        cp=2,
        cp_form="ring",
        recompute=False,
        microbatch_size=1,
        time_s=1.0,
        memory_bytes=1.0,
    )
    plan = Plan(stages=(stage,), schedule="1f1b", microbatches=1, global_batch=1, iteration_s=1.0)
    assert Plan.from_json(plan.to_json()) == plan
    data = plan.to_json()
    data["stages"][0]["cp_form"] = "spiral"
    with pytest.raises(ValueError, match="cp_form must be ring, all_gather or null"):
        Plan.from_json(data)
    data["stages"][0].update(cp_form="ring", cp=4)
    with pytest.raises(ValueError, match="tp·cp·dp = 4 device refs, got 2"):
        Plan.from_json(data)


def test_a_ring_inside_a_host_uses_its_link_and_one_over_hosts_the_slowest_between_them():
    infos = type_infos(load_cluster("h100x16"))  # two hosts of 8
    (info,) = infos.values()
    inside = GroupConfig(device_type=info.name, size=8, tp=1, recompute=False, cp=8)
    across = GroupConfig(device_type=info.name, size=16, tp=1, recompute=False, cp=16)
    assert context_link(inside, info) == info.intra_link
    assert context_link(across, info) == info.inter_link != info.intra_link


def test_a_fixed_configuration_may_split_each_sequence(tiny):
    """baselines.fixed(cp=) prices a published context-parallel configuration: the ring's sends add to
    the plain stage's time, on tp · cp · dp devices."""
    from orchestrator.planner.baselines import fixed

    layers = list(range(len(tiny.layers)))
    plain = fixed(
        tiny, stages=[layers], device_type="a100", tp=1, dp=2, recompute=False, microbatches=1, global_batch=8
    )
    split = fixed(
        tiny, stages=[layers], device_type="a100", tp=1, dp=2, recompute=False, microbatches=1, global_batch=8, cp=2
    )
    assert split.groups[0].cp == 2 and split.groups[0].size == 4
    assert split.evaluation.stage_time_s[0] > plain.evaluation.stage_time_s[0] / 2  # half the work, plus the ring
