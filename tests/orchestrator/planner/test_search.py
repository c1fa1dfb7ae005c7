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
