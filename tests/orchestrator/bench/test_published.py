"""``orchestrator bench published``: which runs are fitted, and a published configuration priced."""

import pytest

from orchestrator.bench._gpu_efficiency import fit_report, gpu_efficiency
from orchestrator.bench._published import (
    efficiency_for,
    fitting_runs,
    load_runs,
    price,
    published_stages,
    run_cluster,
    run_model,
)
from orchestrator.planner._table import CostTable


def test_at_most_half_of_the_priced_runs_are_fitted_and_no_h100_run():
    runs = load_runs()
    priced = [run for run in runs if not run.unsupported()]
    fitted = fitting_runs(runs)
    assert 0 < len(fitted) <= len(priced) / 2
    assert all(run.gpu_type == "a100" for run in fitted)
    assert any(run.gpu_type == "h100" for run in priced)  # held out: their efficiency is measured, not fitted


def test_the_h100_efficiency_explains_the_large_measured_pieces():
    """Fitted to the per-rank blocks and heads measured on an H100, the model reproduces those at
    hidden ≥ 6144 within 10% (small shapes are launch-bound: reported, not asserted)."""
    eff = gpu_efficiency()
    assert 0.5 < eff.matmul <= 1.0
    large = [row for row in fit_report() if row["hidden"] >= 6144]
    assert large and max(abs(row["error"]) for row in large) < 0.1


def test_megatron_layout_puts_the_embedding_first_and_the_head_last():
    run = next(r for r in load_runs() if r.id == "megatron-sc21-gpt-39.1b")  # PP 2
    stages = published_stages(run, 50)
    assert [s[0] for s in stages] == [0, 25] and stages[-1][-1] == 49
    assert sorted(layer for stage in stages for layer in stage) == list(range(50))


def test_a_published_configuration_is_priced_near_its_measured_time():
    """Megatron-LM's GPT 1.7B on 32 A100 (SC'21, Table 1), priced with the H100-measured efficiency
    before any A100 fit: within 20% of the published time."""
    run = next(r for r in load_runs() if r.id == "megatron-sc21-gpt-1.7b")
    priced = price(run, run_model(run, efficiency_for("a100")))
    assert priced["fits"]
    assert priced["priced_s"] == pytest.approx(run.measured_s(), rel=0.2)


def test_an_inter_stage_transfer_spreads_over_the_senders_links():
    run = next(r for r in load_runs() if r.id == "megatron-sc21-gpt-1.7b")
    model = run_model(run, efficiency_for("a100"))
    from orchestrator.planner._groups import type_infos

    table = CostTable(model, type_infos(model.cluster), 512)
    link = model.cluster.cluster_link
    one, eight = table.send_s(1, 32, link), table.send_s(1, 32, link, 8)
    assert eight - link.latency_s == pytest.approx((one - link.latency_s) / 8)


@pytest.mark.parametrize("run_id", ["megatron-sc21-gpt-145.6b", "megatron-sc21-gpt-310.1b", "korthikanti-175b"])
def test_the_planners_space_contains_the_published_configuration(run_id):
    """DP 24 and DP 15 on whole hosts, M = 48 and 144 (not powers of two), PP up to 16: in the space
    the planner searches by default for that batch on that cluster (the model's width does not
    change the space, so a narrow GPT of the run's depth stands in for it)."""
    import dataclasses

    from integrations.flax import capture
    from orchestrator.coarsen import coarsen
    from orchestrator.costs import CostModel
    from orchestrator.planner._space import microbatch_counts, search_space
    from recipes import GPTConfig, Recipe

    run = next(r for r in load_runs() if r.id == run_id)
    p = run.parallel
    config = GPTConfig(vocab_size=64, max_seq_len=16, num_layers=run.model["layers"], num_heads=2, d_model=16)
    recipe = Recipe(name="narrow", config=config, batch_size=1, seq_len=16)
    graph = capture(recipe.train_step, recipe.abstract_state(), recipe.batch_spec(1, 16))
    model = CostModel(graph, coarsen(graph), run_cluster(run), batch_size=1, param_axes=recipe.param_axes())
    space = search_space(model, run.global_batch, recompute=True, zero=bool(p["zero"]), mixed=False)
    max_stages = min(16, space.layers, len(model.cluster.devices()))  # plan()'s default
    covered = space.coverage(microbatch_counts(run.global_batch), max_stages)
    stage = (run.gpu_type, p["tp"] * p["dp"], p["tp"], p["recompute"] == "full")
    M = run.global_batch // (p["dp"] * p["microbatch_size"])
    assert covered.contains(microbatches=M, stages=[stage] * p["pp"])
    assert not covered.contains(microbatches=M, stages=[stage] * (max_stages + 1))
    assert not dataclasses.replace(covered, microbatches=(1, 2, 4)).contains(microbatches=M, stages=[stage])


def test_a_run_is_priced_with_its_virtual_stages():
    """Korthikanti et al.'s 175B layout (PP 8, 3 virtual stages, M 64) on its cluster, a narrow GPT
    of 16 blocks standing in for the model: interleaving shrinks the bubble of plain 1F1B."""
    import dataclasses

    from integrations.flax import capture
    from orchestrator.coarsen import coarsen
    from orchestrator.costs import CostModel
    from recipes import GPTConfig, Recipe

    run = next(r for r in load_runs() if r.id == "korthikanti-175b")
    assert run.parallel["virtual_stages"] == 3
    config = GPTConfig(vocab_size=64, max_seq_len=16, num_layers=16, num_heads=2, d_model=16)
    recipe = Recipe(name="narrow", config=config, batch_size=1, seq_len=16)
    graph = capture(recipe.train_step, recipe.abstract_state(), recipe.batch_spec(1, 16))
    model = CostModel(graph, coarsen(graph), run_cluster(run), batch_size=1, param_axes=recipe.param_axes())
    interleaved = price(run, model)
    plain = price(dataclasses.replace(run, parallel={**run.parallel, "virtual_stages": 1}), model)
    assert interleaved["virtual_stages"] == 3 and plain["virtual_stages"] == 1
    assert interleaved["priced_s"] < plain["priced_s"]
    assert interleaved["breakdown"]["steady_s"] < plain["breakdown"]["steady_s"]
