"""Piece solves on a few threads at once, each on a HiGHS session of its own.

highspy releases the GIL inside ``Highs.run``, so two HiGHS instances solve side by side, each
on a core of its own. A session is busy while it solves, so two pieces of one microbatch count
need two sessions of its model: a piece takes an idle one of its M or loads another (a tenth of
a second for a model of a few thousand columns). Jobs are prepared on the caller's thread (a start
writes the model's variables), solved on a worker (which touches only its session), and
their results written back and folded in (``record``) on the caller's thread again, in the
order they finish.

At the search's deadline the solves still running are left behind: their pieces keep the
bounds they had, and the threads end when HiGHS next checks its interrupt. HiGHS does not
check it before its root LP iterates, so a solve on a large model may run well past its limit;
the search starts no solve it cannot finish before its deadline (``overrun_s``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from orchestrator.solver import HighsSession, work

# at most this many solves at once (and never more than the machine's cores)
MAX_WORKERS = 4
# solves at once in a wave while the clock counts work (``work.lane``): a fixed number, not the
# machine's cores, so the same input takes the same steps on any machine
WAVE = 2


def default_workers() -> int:
    """Solves at once: one while the clock counts work (``work``), so the search takes its steps in
    one order whatever finishes first; else one per core, at most ``MAX_WORKERS``."""
    if work.counting():
        return 1
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


class PieceWorkers:
    """Solve pieces (with ``model.lp``, ``limit_s`` and a shared ``sessions`` list per model) on ``workers``
    threads; :meth:`finish_one` waits for the next to end and hands (piece, result) to
    ``record``. A job is ``prepare(session) -> solve()``: ``prepare`` runs at :meth:`start`,
    ``solve`` on a worker."""

    def __init__(self, workers: int, record: Callable[[object, object], None]):
        self.workers = workers
        self.record = record
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="orchestrator-solve")
        self.running: dict[Future, tuple[object, HighsSession]] = {}
        # the most a solve has run past its time limit (s): HiGHS honours its interrupt only once
        # the root LP iterates; the search starts no solve it cannot finish before its deadline
        self.overrun_s = 0.0

    def __enter__(self) -> PieceWorkers:
        return self

    def __exit__(self, *exc) -> None:
        # solves still running were left behind at the deadline: they stop at HiGHS's next
        # interrupt check (with any relaxation they would run after), and no one waits for them
        for _, session in self.running.values():
            session.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)

    @property
    def full(self) -> bool:
        return len(self.running) >= self.workers

    def is_running(self, piece) -> bool:
        return any(p is piece for p, _ in self.running.values())

    def can_start(self, piece) -> bool:
        return not self.full and not self.is_running(piece)

    def _idle_session(self, piece) -> HighsSession:
        busy = [session for _, session in self.running.values()]
        for session in piece.sessions:
            if all(session is not other for other in busy):
                return session
        session = HighsSession(piece.model.lp)
        piece.sessions.append(session)
        return session

    def start(self, piece, prepare: Callable[[HighsSession], Callable[[], object]]) -> None:
        session = self._idle_session(piece)
        self.running[self.pool.submit(prepare(session))] = (piece, session)

    def finish_one(self, until: float | None = None) -> list:
        """Wait for at least one solve to end, or until ``until`` (``work.now()``); write
        back and record each that did; return their pieces."""
        if not self.running:
            return []
        # (counting work, the clock stands still while a solve runs: wait for it to end)
        timeout = None if until is None or work.counting() else max(0.0, until - work.now())
        done, _ = wait(self.running, timeout=timeout, return_when=FIRST_COMPLETED)
        finished = []
        for future in done:
            piece, session = self.running.pop(future)
            result = future.result()
            self.overrun_s = max(self.overrun_s, result.solve_s - piece.limit_s)
            session.assign(result)
            self.record(piece, result)
            finished.append(piece)
        return finished

    def drain(self, until: float | None = None) -> list:
        """Wait for every solve under way, or until ``until``; return the pieces that finished."""
        finished = []
        while self.running and (until is None or work.now() < until):
            finished += self.finish_one(until)
        return finished
