"""``orchestrator bench published``: which runs are fitted, and a published configuration priced."""

import functools

import pytest

from orchestrator.bench._gpu_efficiency import fit_report, gpu_efficiency
from orchestrator.bench._published import (
    _planned,
    efficiency_for,
    fitting_runs,
    load_runs,
    plan_options,
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
    large = [row for row in fit_report() if row["piece"] in ("block", "head") and row["hidden"] >= 6144]
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


@functools.cache
def _narrow(blocks: int, seq_len: int = 16):
    """A narrow GPT of ``blocks`` blocks at ``seq_len`` tokens, captured: (graph, layers, param axes)."""
    from integrations.flax import capture
    from orchestrator.coarsen import coarsen
    from recipes import GPTConfig, Recipe

    config = GPTConfig(vocab_size=64, max_seq_len=seq_len, num_layers=blocks, num_heads=2, d_model=16)
    recipe = Recipe(name="narrow", config=config, batch_size=1, seq_len=seq_len)
    graph = capture(recipe.train_step, recipe.abstract_state(), recipe.batch_spec(1, seq_len))
    return graph, coarsen(graph), recipe.param_axes()


def _stand_in(run, blocks: int):
    """The cost model of a narrow GPT of ``blocks`` blocks on the run's cluster; at the run's
    sequence length where it splits sequences (context parallelism is offered where a layer's
    attention fits no device at one sample, which a narrow model's does only at that length)."""
    from orchestrator.costs import CostModel

    long = (run.parallel.get("cp") or 1) > 1
    graph, layers, axes = _narrow(blocks, run.model["seq_len"] if long else 16)
    return CostModel(graph, layers, run_cluster(run), batch_size=1, param_axes=axes)


@pytest.mark.parametrize("run_id", [run.id for run in load_runs() if not run.unsupported()])
def test_the_planners_space_contains_the_published_configuration(run_id):
    """Every priced run's configuration (DP 24, 15, 9 on whole hosts; M = 48, 144 and other counts
    that are not powers of two; PP up to 64; Llama 3's TP 8 × CP 16) lies in the space ``bench published`` plans it in: the
    groups ``search_space`` offers with the run's options (``plan_options``), every divisor of the
    batch as M, and ``plan()``'s depth limit at the run's own depth (embedding, blocks, head). The
    groups do not depend on the model's width or depth, so two narrow blocks stand in for the model.
    The space records the options its stages are priced with, which are the run's as its row states
    them (FSDP priced as ZeRO), and the virtual-stage counts its bound holds over: the search's space
    holds plain schedules, and the space of a plan asked to interleave (as ``bench published`` asks)
    holds every v ≤ v_max, v_max from the run's own block count, so a run that interleaves lies in it
    at its own v. Context-parallel groups depend on the sequence: a run that splits it is stood in for
    at its own length."""
    import dataclasses

    from orchestrator.planner._ilp import Run
    from orchestrator.planner._interleaved_bound import interleaved_coverage, max_virtual_stages
    from orchestrator.planner._space import microbatch_counts, search_space

    run = next(r for r in load_runs() if r.id == run_id)
    p = run.parallel
    options = plan_options(run)
    model = _stand_in(run, 2)
    space = search_space(
        model,
        run.global_batch,
        recompute=True,
        mixed=False,
        **{k: v for k, v in options.items() if k != "max_stages"},
    )
    depth = run.model["layers"] + 2
    max_stages = min(options["max_stages"], depth, len(model.cluster.devices()))  # as plan() limits it
    covered = space.coverage(microbatch_counts(run.global_batch), max_stages)
    cp = p.get("cp") or 1
    assert any(len(group) == 5 for group in covered.groups) == (cp > 1)  # CP only where needed
    stage = (run.gpu_type, p["tp"] * p["dp"] * cp, p["tp"], p["recompute"] == "full") + ((cp,) if cp > 1 else ())
    M = run.global_batch // (p["dp"] * (p["microbatch_size"] or 1))
    stated = {
        "zero": bool(p["zero"] or p["fsdp"]),
        "sequence_parallel": bool(p["sequence_parallel"]),
        "selective_recompute": p["recompute"] == "selective",
        "overlap_param_gather": bool(p["overlap_param_gather"]),
    }
    options = [name for name, on in stated.items() if on]
    v = p["virtual_stages"] or 1
    assert p["pp"] <= max_stages
    assert covered.contains(microbatches=M, stages=[stage] * p["pp"], options=options)
    assert covered.contains(microbatches=M, stages=[stage] * p["pp"], options=options, virtual_stages=v) == (v == 1)
    # embedding, the blocks, head: the stand-in's runs, at the run's own block count
    blocks = run.model["layers"]
    assert space.runs == [Run(0, 1), Run(1, 2), Run(3, 1)]
    widened = interleaved_coverage(covered, max_virtual_stages([Run(0, 1), Run(1, blocks), Run(blocks + 1, 1)]))
    assert widened.contains(microbatches=M, stages=[stage] * p["pp"], options=options, virtual_stages=v)
    assert not covered.contains(microbatches=M, stages=[stage] * (max_stages + 1), options=options)
    others = tuple(m for m in covered.microbatches if m != M)
    assert not dataclasses.replace(covered, microbatches=others).contains(
        microbatches=M, stages=[stage], options=options
    )
    for name in stated:  # one option more or fewer is another space
        toggled = sorted(set(options) ^ {name})
        assert not covered.contains(microbatches=M, stages=[stage] * p["pp"], options=toggled)


def test_the_plan_of_a_published_run_is_no_slower_and_its_space_holds_the_run():
    """Korthikanti et al.'s 175B (PP 8, v 3, sequence parallelism, selective recompute, M 64), a narrow
    GPT of 16 blocks standing in: the plan ``bench published`` makes starts from the published
    configuration, so it is priced no slower, and the space its gap covers holds that configuration
    with its options, at v = 3 (the bound holds over v ≤ 8) and on a plain schedule."""
    run = next(r for r in load_runs() if r.id == "korthikanti-175b")
    model = _stand_in(run, 16)
    published = price(run, model)
    planned = _planned(run, model, time_limit_s=1.0)
    assert planned["space_contains_published_plain"]
    assert planned["space_contains_published"]
    assert 0.0 <= planned["planned_gap"] < 1.0
    assert planned["planned_s"] <= published["priced_s"]


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


def test_llama_3_counts_the_embedding_and_the_head_as_layers_of_the_split():
    """Llama 3 405B (126 blocks, PP 16, v 8; arXiv:2407.21783 §3.3.2): one block fewer on the first
    and the last stage, so every stage holds 8 layers and every chunk one."""
    run = next(r for r in load_runs() if r.id == "llama3-405b-8k-8192gpu")
    stages = published_stages(run, 128)
    assert [len(s) for s in stages] == [8] * 16
    assert stages[0][0] == 0 and stages[-1][-1] == 127
    assert sorted(layer for stage in stages for layer in stage) == list(range(128))
