"""PieceWorkers: solves of one model on two threads open a second session; results come back
on the caller's thread, written to the variables only there; at the deadline a solve still
running is left behind."""

import threading
import time
from dataclasses import dataclass, field

import pulp
import pytest

from orchestrator.planner._workers import PieceWorkers
from orchestrator.solver import HighsSession, solve
from tests.orchestrator.solver.test_session import multi_knapsack


@dataclass
class Model:
    lp: pulp.LpProblem


@dataclass
class Piece:
    model: Model
    sessions: list = field(default_factory=list)
    limit_s: float = 10.0


def test_two_pieces_of_one_model_run_at_once_on_two_sessions_and_record_on_the_callers_thread():
    lp = multi_knapsack(items=22, seed=3)
    optimum = solve(multi_knapsack(items=22, seed=3), time_limit_s=20, gap=0.0).objective
    sessions = [HighsSession(lp)]
    pieces = [Piece(Model(lp), sessions), Piece(Model(lp), sessions)]
    recorded = []

    def record(piece, result):
        recorded.append((piece, result.objective, threading.current_thread() is threading.main_thread()))
        assert pulp.value(lp.objective) == pytest.approx(result.objective)  # written back before record

    def prepare(session):
        return lambda: session.solve(time_limit_s=20, gap=0.0)

    with PieceWorkers(2, record) as workers:
        for piece in pieces:
            assert workers.can_start(piece)
            workers.start(piece, prepare)
        assert workers.full and workers.is_running(pieces[0]) and not workers.can_start(pieces[0])
        assert len(sessions) == 2  # the first was busy, so the second piece loaded the model again
        assert {id(p) for p in workers.drain()} == {id(p) for p in pieces}
    assert sorted(id(p) for p, _, _ in recorded) == sorted(id(p) for p in pieces)
    assert all(objective == pytest.approx(optimum) and on_main for _, objective, on_main in recorded)


def test_a_solve_still_running_at_the_deadline_is_left_behind_unrecorded():
    lp = multi_knapsack(items=22, seed=3)
    piece, recorded, release = Piece(Model(lp), [HighsSession(lp)]), [], threading.Event()

    def prepare(session):
        def slow():  # a solve that overruns its limit, as a root LP does
            release.wait(10)
            return session.solve(time_limit_s=20, gap=0.0)

        return slow

    with PieceWorkers(1, lambda p, result: recorded.append(p)) as workers:
        workers.start(piece, prepare)
        assert workers.drain(until=time.perf_counter() + 0.2) == []
        assert workers.is_running(piece)
        (left_behind,) = workers.running
    assert not left_behind.done()  # leaving did not wait for it: it cannot end before ``release``
    assert piece.sessions[0]._stopped  # and told its session to stop
    release.set()
    assert recorded == []
