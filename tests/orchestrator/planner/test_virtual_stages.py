"""Virtual stages in the planner: which counts a plan can take, the choice after the search, what the
certified gap covers, and the plan's round trip and replay."""

import functools
import time

import pytest

from orchestrator.planner import Coverage, Plan
from orchestrator.planner._evaluate import evaluate
from orchestrator.planner._groups import GroupConfig
from orchestrator.planner._ilp import Run
from orchestrator.planner._make_plan import make_plan, virtual_stage_counts
from orchestrator.planner._space import search_space
from orchestrator.simulate import compare

# embedding, 8 identical blocks, head
RUNS = [Run(0, 1), Run(1, 8), Run(9, 1)]
STAGES = [[0, 1, 2], [3, 4], [5, 6], [7, 8, 9]]


def test_virtual_stage_counts_divide_every_stages_blocks():
    assert virtual_stage_counts(RUNS, STAGES, 4) == [2]
    assert virtual_stage_counts(RUNS, [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], 8) == [2, 4]
    assert virtual_stage_counts(RUNS, [[0, 1, 2, 3, 4, 5, 6], [7, 8, 9]], 8) == [2]  # 6 and 2 blocks
    assert virtual_stage_counts(RUNS, [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]], 8) == []  # 3 and 5 blocks
    assert virtual_stage_counts(RUNS, STAGES, 6) == []  # M not a multiple of S
    assert virtual_stage_counts(RUNS, [list(range(10))], 8) == []  # one stage


@functools.cache
def _narrow_model():
    """A GPT of 8 blocks (10 layers: embedding, blocks, head) on the simulator tests' small cluster."""
    from integrations.flax import capture
    from orchestrator.coarsen import coarsen
    from orchestrator.costs import CostModel
    from recipes import GPTConfig, Recipe
    from tests.orchestrator.simulate._plans import small_cluster

    config = GPTConfig(vocab_size=256, max_seq_len=64, num_layers=8, num_heads=4, d_model=128)
    recipe = Recipe(name="narrow", config=config, batch_size=8, seq_len=64)
    graph = capture(recipe.train_step, recipe.abstract_state(), recipe.batch_spec(8, 64))
    return CostModel(graph, coarsen(graph), small_cluster(), batch_size=8, param_axes=recipe.param_axes())


@pytest.mark.parametrize("types", [("a", "a", "a", "a"), ("a", "a", "b", "b")])
@pytest.mark.parametrize("M", [4, 8])
def test_the_plan_takes_the_fastest_virtual_stages_and_its_bound_covers_every_v(types, M):
    """Four stages of two blocks each: v = 2 halves the bubble at twice the transfers, and is faster
    here. The plan keeps it, says so, and its space says which v the bound holds over: every v a plan
    of 8 blocks can take (v_max = 4), the plan's own v among them."""
    model = _narrow_model()
    space = search_space(model, 8, recompute=False, mixed=False)
    assert space.runs == RUNS
    groups = [GroupConfig(device_type=t, size=1, tp=1, recompute=False) for t in types]

    def priced(v):
        return evaluate(
            STAGES, groups, M, table=space.table, infos=space.infos, schedule="1f1b", links=space.links,
            virtual_stages=v,
        )  # fmt: skip

    plain, interleaved = priced(1), priced(2)
    assert interleaved.feasible and interleaved.iteration_s < plain.iteration_s
    # the wrap: the last stage sends its first chunk's output to the first stage
    assert plain.stage_send_s[-1] == 0.0 < interleaved.stage_send_s[-1]
    covered = space.coverage([M], 4)
    found = make_plan(
        model, space, plain, STAGES, groups, M, schedule="1f1b", global_batch=8, bound=plain.iteration_s,
        gap=0.01, started=time.perf_counter(), covered=covered,
    )  # fmt: skip
    assert found.virtual_stages == 2
    assert found.iteration_s == interleaved.iteration_s
    assert "2 virtual stages" in found.notes[-1]
    # the bound is the least of the plain one and the capacity LP's over v <= 4: the plan lies in its space
    assert found.space.virtual_stages == (1, 2, 3, 4)
    stages = [(g.device_type, g.size, g.tp, g.recompute) for g in groups]
    assert found.space.contains(microbatches=M, stages=stages)
    assert found.space.contains(microbatches=M, stages=stages, virtual_stages=2)
    assert not found.space.contains(microbatches=M, stages=stages, virtual_stages=5)
    assert found.bound <= interleaved.iteration_s < plain.iteration_s
    assert found.gap == pytest.approx((found.iteration_s - found.bound) / found.iteration_s)
    assert any("the gap covers v <= 4" in note for note in found.notes)
    # the plan beats the plain bound, so only the weaker bound over v <= 4 can leave the gap asked for
    assert found.status == ("Optimal" if found.gap <= 0.01 else "Optimal over plain schedules")
    gpipe = make_plan(
        model, space, plain, STAGES, groups, M, schedule="gpipe", global_batch=8, bound=plain.iteration_s,
        gap=0.01, started=time.perf_counter(), covered=covered,
    )  # fmt: skip
    assert gpipe.space.virtual_stages == (1,)  # GPipe does not interleave: its bound covers v = 1
    plain_plan = make_plan(
        model, space, plain, STAGES, groups, M, schedule="1f1b", global_batch=8, bound=0.0, gap=0.01,
        started=time.perf_counter(), interleave=False,
    )  # fmt: skip
    assert plain_plan.virtual_stages == 1 and plain_plan.iteration_s == plain.iteration_s

    # a plan is data: the JSON round trip keeps v, and the replay runs the interleaved order over
    # the plan's real links (within 10% of the closed form, which prices the slowest link)
    again = Plan.from_json(found.to_json())
    assert again.virtual_stages == 2 and again.space == found.space
    closed, _, rel = compare(again, model)
    assert closed == found.iteration_s
    assert abs(rel) <= 0.10


def test_a_plan_file_with_impossible_virtual_stages_or_space_is_refused_in_one_line():
    model = _narrow_model()
    space = search_space(model, 8, recompute=False, mixed=False)
    groups = [GroupConfig(device_type="a", size=1, tp=1, recompute=False)] * 4
    ev = evaluate(STAGES, groups, 4, table=space.table, infos=space.infos, schedule="1f1b", links=space.links)
    found = make_plan(
        model, space, ev, STAGES, groups, 4, schedule="1f1b", global_batch=8, bound=0.0, gap=0.01,
        started=time.perf_counter(),
    )  # fmt: skip
    data = found.to_json()
    space = {"microbatches": [4], "max_stages": 4, "groups": [["a", 1, 1, False]]}
    assert Plan.from_json({**data, "space": space}).space.groups == (("a", 1, 1, False),)
    for bad, match in (
        ({"virtual_stages": 0}, "virtual_stages"),
        ({"virtual_stages": 2, "microbatches": 6}, "divisible"),
        ({"space": {**space, "groups": [[float("inf"), 1, 1, False]]}}, "not a search space"),
        ({"space": {**space, "groups": [["a", 1.5, 1, False]]}}, "not a search space"),
        ({"space": {**space, "microbatches": [0]}}, "not a search space"),
        ({"space": {**space, "virtual_stages": [float("nan")]}}, "not a search space"),
        ({"space": {**space, "options": ["zero3"]}}, "not a search space"),
    ):
        with pytest.raises(ValueError, match=match) as err:
            Plan.from_json({**data, **bad})
        assert "\n" not in str(err.value)


def test_coverage_of_older_plans_holds_plain_schedules():
    covered = Coverage.from_json({"microbatches": [4], "max_stages": 2, "groups": [["a", 1, 1, False]]})
    assert covered.virtual_stages == (1,) and covered.options == ()
    assert covered.contains(microbatches=4, stages=[("a", 1, 1, False)] * 2)
    assert not covered.contains(microbatches=4, stages=[("a", 1, 1, False)] * 2, virtual_stages=2)


def test_coverage_records_the_options_its_stages_are_priced_with():
    """A configuration priced with other options (ZeRO, FSDP, sequence parallelism, selective
    recompute, the overlapped parameter gather) lies in another space; the plan file keeps them."""
    model = _narrow_model()
    space = search_space(model, 8, recompute=False, mixed=False, zero=True, sequence_parallel=True)
    covered = space.coverage([4], 4)
    assert covered.options == ("zero", "sequence_parallel")
    stages = [("a", 1, 1, False)] * 4
    assert covered.contains(microbatches=4, stages=stages, options=["sequence_parallel", "zero"])
    assert not covered.contains(microbatches=4, stages=stages)
    assert not covered.contains(microbatches=4, stages=stages, options=["zero"])
    assert not covered.contains(microbatches=4, stages=stages, options=["zero", "sequence_parallel", "fsdp"])
    with pytest.raises(ValueError, match="zero3") as err:
        covered.contains(microbatches=4, stages=stages, options=["zero3"])
    assert "\n" not in str(err.value)
    assert search_space(model, 8, recompute=False, mixed=False).coverage([4], 4).options == ()

    groups = [GroupConfig(device_type="a", size=1, tp=1, recompute=False)] * 4
    ev = evaluate(STAGES, groups, 4, table=space.table, infos=space.infos, schedule="1f1b", links=space.links)
    found = make_plan(
        model, space, ev, STAGES, groups, 4, schedule="1f1b", global_batch=8, bound=0.0, gap=0.01,
        started=time.perf_counter(), covered=covered, interleave=False,
    )  # fmt: skip
    assert Plan.from_json(found.to_json()).space == covered


def test_plan_interleaves_only_when_asked(monkeypatch):
    """plan() tries virtual stages only with virtual_stages=True (the Flax pipeline runs them:
    tests/integrations/flax_execute/test_interleaved.py)."""
    import orchestrator.planner._driver as driver
    from orchestrator.planner import plan

    model = _narrow_model()
    asked = []

    def spy(*args, interleave=True, **kwargs):
        asked.append(interleave)
        return make_plan(*args, interleave=interleave, **kwargs)

    monkeypatch.setattr(driver, "make_plan", spy)
    assert plan(model, global_batch=8, time_limit_s=5).virtual_stages == 1
    plan(model, global_batch=8, time_limit_s=5, virtual_stages=True)
    assert asked == [False, True]

    space = search_space(model, 8, recompute=False, mixed=False)
    groups = [GroupConfig(device_type="a", size=1, tp=1, recompute=False)] * 4
    plain = evaluate(STAGES, groups, 4, table=space.table, infos=space.infos, schedule="1f1b", links=space.links)
    found = make_plan(
        model, space, plain, STAGES, groups, 4, schedule="1f1b", global_batch=8, bound=0.0, gap=0.01,
        started=time.perf_counter(),
    )  # fmt: skip
    assert found.virtual_stages == 2
