"""The search's bookkeeping: pieces whose bound already reaches the incumbent close unsolved."""

import math

from orchestrator.planner._ilp import MS
from orchestrator.planner._search import _close_beaten, _cutoff_ms, _Piece


def test_pieces_whose_bound_reaches_the_cutoff_close_unsolved():
    best = (1.0, None, None, None, 8)  # (score s, evaluation, stages, groups, M)
    cutoff = _cutoff_ms(best, 0.01) / MS
    pieces = [_Piece(None, [], S, bound_s=b) for S, b in enumerate((0.5, cutoff * 0.999, cutoff, 1.2), start=1)]
    assert _close_beaten(pieces, best, 0.01) is pieces
    assert [p.done for p in pieces] == [False, False, True, True]


def test_without_an_incumbent_nothing_closes():
    pieces = [_Piece(None, [], 2, bound_s=math.inf)]
    _close_beaten(pieces, None, 0.01)
    assert not pieces[0].done
