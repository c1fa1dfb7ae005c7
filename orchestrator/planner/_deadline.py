"""A hard time limit: the instant a call must answer by, checked inside the loops that could outlast it.

The search's steps share their time limit softly (each stops at its share, ``_options``); what a
share cannot stop is work with no solver behind it: filling the cost table (a cost-model call per
layer, group and microbatch size), pricing plans in the closed form, building a model. The cost
table checks a :class:`Deadline` before every entry it computes, so a search that would outlast
its limit stops there with what it has (``_driver``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


class DeadlineExceeded(Exception):
    """A :class:`Deadline` passed while work it bounds was under way."""

    def __init__(self, limit_s: float):
        super().__init__(f"the time limit of {limit_s:g} s ran out")
        self.limit_s = limit_s


@dataclass(frozen=True, slots=True)
class Deadline:
    """The instant ``at`` (on ``clock``) by which a call of ``limit_s`` seconds must answer.

    ``clock`` is ``time.perf_counter`` unless a test gives another, so a test can pass a deadline
    without waiting for one.

    Example:
      >>> deadline = Deadline.after(5.0)
      >>> 0 < deadline.left() <= 5.0 and not deadline.expired()
      True
      >>> Deadline.after(5.0, clock=lambda: 0.0).earlier_by(5.0).expired()
      True
    """

    limit_s: float
    """The whole time limit, as the user gave it (what an answer that ran out of time names)."""
    at: float
    """The instant, on ``clock``, past which the call has run out of time."""
    clock: Callable[[], float] = field(default=time.perf_counter, compare=False)

    @classmethod
    def after(cls, limit_s: float, *, clock: Callable[[], float] = time.perf_counter) -> Deadline:
        """The deadline ``limit_s`` seconds from now on ``clock``."""
        return cls(limit_s=limit_s, at=clock() + limit_s, clock=clock)

    def left(self) -> float:
        """Seconds left (negative once it has passed)."""
        return self.at - self.clock()

    def expired(self) -> bool:
        return self.left() <= 0

    def check(self) -> None:
        """Raise :class:`DeadlineExceeded` once the deadline has passed."""
        if self.expired():
            raise DeadlineExceeded(self.limit_s)

    def earlier_by(self, seconds: float) -> Deadline:
        """This deadline moved ``seconds`` sooner (time kept for the work after the one it bounds)."""
        return Deadline(limit_s=self.limit_s, at=self.at - seconds, clock=self.clock)
