"""The search's bookkeeping (pieces whose bound already reaches the incumbent close unsolved) and its options."""

import dataclasses
import math

import pytest

from orchestrator.bench._synthetic import synthetic_cluster
from orchestrator.planner import SearchOptions
from orchestrator.planner._ilp import MS
from orchestrator.planner._incumbent import Incumbent, cutoff_ms
from orchestrator.planner._pieces import Piece, close_beaten


def test_pieces_whose_bound_reaches_the_cutoff_close_unsolved():
    best = Incumbent(score=1.0, evaluation=None, stages=None, groups=None, microbatches=8)
    cutoff = cutoff_ms(best, 0.01) / MS
    pieces = [Piece(None, [], S, bound_s=b) for S, b in enumerate((0.5, cutoff * 0.999, cutoff, 1.2), start=1)]
    assert close_beaten(pieces, best, 0.01) is pieces
    assert [p.done for p in pieces] == [False, False, True, True]


def test_without_an_incumbent_nothing_closes():
    pieces = [Piece(None, [], 2, bound_s=math.inf)]
    close_beaten(pieces, None, 0.01)
    assert not pieces[0].done


def test_options_are_frozen_keyword_only_and_offer_mixed_groups_by_host_count():
    options = SearchOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.tail_from = 3
    with pytest.raises(TypeError):
        SearchOptions(0.5)
    cluster = synthetic_cluster({"a": (20.0, 40.0)}, hosts_per_type=2, per_host=2)  # 2 hosts
    assert options.offers_mixed(cluster, None) and not SearchOptions(mixed_hosts=1).offers_mixed(cluster, None)
    assert options.offers_mixed(cluster, False) is False and SearchOptions(mixed_hosts=1).offers_mixed(cluster, True)
    assert options.mip_options() == {"presolve": "off"} and SearchOptions(first_pass_presolve=True).mip_options() == {}


def test_microbatch_counts_closed_by_their_first_packing_lp_get_no_whole_stage_lps(monkeypatch):
    """The first packing LP of every M runs before any whole-stage LP; the M it closes (bound at the
    cutoff) are left out of the whole-stage bounds, and the certified bound still holds."""
    from orchestrator.bench._synthetic import random_instance
    from orchestrator.planner import PlanInfeasible, _driver, plan
    from orchestrator.planner.baselines import exhaustive_plan

    real_packing, real_columns = _driver.packing_bounds, _driver.column_bounds
    seen = {}

    def packing(scope, best, candidates, **options):
        found = real_packing(scope, best, candidates, **options)
        if options.get("probe"):
            seen["probe"] = dict(found), best.cutoff_s(scope.gap)
        return found

    def columns(scope, best, candidates=None, **options):
        seen["columns"] = list(candidates)
        return real_columns(scope, best, candidates, **options)

    monkeypatch.setattr(_driver, "packing_bounds", packing)
    monkeypatch.setattr(_driver, "column_bounds", columns)
    closing = 0
    for seed in range(8):
        model = random_instance(seed)
        settings = {"global_batch": 8, "microbatch_candidates": (1, 2, 4, 8), "max_stages": 3}
        try:
            found = plan(model, gap=1e-2, time_limit_s=10, **settings)
        except PlanInfeasible:
            continue
        probe, cutoff = seen["probe"]
        closed = {M for M, bound in probe.items() if bound >= cutoff}
        assert not closed & set(seen["columns"])
        closing += bool(closed)
        assert found.bound <= exhaustive_plan(model, **settings).iteration_s * (1 + 1e-9)
    assert closing >= 2, closing
