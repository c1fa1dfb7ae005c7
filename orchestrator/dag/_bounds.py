"""Proven lower bounds on the makespan, computed without a solver.

Heads and tails with communication. For a task t and a device d it may use,

    H[t,d] ≤ S_t          in every feasible schedule that runs t on d
    Q[t,d] ≤ C − F_t      (C the makespan, F_t = S_t + w[t,d] the finish of t)

Heads, in topological order. Take b on d and its predecessors a. In a
schedule, each a either runs on d ("local") or on some d' ≠ d ("remote"):

* a remote on d' delivers its output at F_a + c(a→b, d', d) ≥ H[a,d'] + w[a,d'] + c(a→b, d', d);
  the least of these over d' ≠ d is r_a, a bound that holds wherever a runs off d.
* the local predecessors L all run on d's slots (k = slots(d)) before b starts,
  each no earlier than H[a,d]. Their work after any time τ can only be done
  after τ, so the last of them finishes no earlier than

      seq(L) = max( max_{a ∈ L} H[a,d] + w[a,d],  max_{τ} τ + Σ_{a ∈ L, H[a,d] ≥ τ} w[a,d] / k )

  (τ ranging over the heads; the preemptive single-machine bound, work spread over k slots).

So S_b ≥ max(max_{a ∉ L} r_a, seq(L)) for the L that the schedule chose, and
H[b,d] = min over L of that is a bound. The minimum is found among k + 1 sets:
seq grows with L, so for the optimal L, every a with r_a above the best remote
term max_{a ∉ L} r_a is in L too — L is a prefix of the predecessors sorted by
decreasing r_a (predecessors that cannot run on d are always remote, those that
can run nowhere else always local). Tails are the same recursion on the
reversed graph (successors local to d run after t, on d, each followed by at
least Q[s,d] more). Entry heads and exit tails are 0.

Every task t runs on some d, so C ≥ min_d H[t,d] + w[t,d] + Q[t,d] for every t:
the path bound. It replaces the usual critical path (each task at its fastest
device, communication ignored), which it never falls below, and which it lifts
wherever joins and forks make a schedule either pay a transfer or serialise.

Load: the work Σ_t min_d w[t,d] must fit on the Σ_d slots(d) slots before C.
Each used slot's work starts no earlier than the head of its first task and
ends no later than C minus the tail of its last, so with n slots used,
n·C ≥ Σ_t min_d w[t,d] + (n smallest min_d H) + (n smallest min_d Q); the bound
takes the least value over n = 1 … Σ slots, so it holds whichever n is used.

Refutation (destructive bounds). Suppose some schedule has makespan ≤ T.
Its task t runs on a device d with H[t,d] + w[t,d] + Q[t,d] ≤ T, so devices
failing that test can be dropped from t's allowed set; heads and tails
recomputed over the smaller sets are still bounds for that schedule (the
recursion above only ever ranges over devices the tasks may use), and so on
until nothing changes. If a task is left without a device, or the load
bound over the remaining devices exceeds T, no schedule has makespan ≤ T, so
T is a lower bound. A bisection between the bounds above and a known
makespan finds the largest T refuted this way (to a tolerance). The MILP
uses the device sets, heads and tails left at its own horizon T = U.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.dag._problem import ScheduleProblem

Bounds = dict[str, tuple[float, ...]]
Allowed = dict[str, list[int]]


def _serial(items: Sequence[tuple[float, float]], slots: int) -> float:
    """Lower bound on when ``slots`` machines finish jobs of (release, duration)."""
    if not items:
        return 0.0
    best = max(r + w for r, w in items)
    work = 0.0
    for release, duration in sorted(items, reverse=True):
        work += duration
        best = max(best, release + work / slots)
    return best


def _sweep(problem: ScheduleProblem, allowed: Allowed, *, reverse: bool) -> Bounds:
    """Heads (predecessors first) or, with ``reverse``, tails (successors first) over ``allowed`` devices."""
    n = len(problem.devices)
    order = reversed(problem.tasks) if reverse else problem.tasks
    out: Bounds = {}
    for b in order:
        row = [math.inf] * n
        neighbours = []  # (a, finish bound of a on each device, transfer between a on e and b on d)
        for a in problem.succs(b) if reverse else problem.preds(b):
            finish = [out[a][e] + problem.exec_s[a][e] for e in range(n)]
            matrix = problem.transfers[(b, a)] if reverse else problem.transfers[(a, b)]
            if reverse:  # b on d sends to a on e: matrix[d][e]
                neighbours.append((a, finish, [[matrix[d][e] for d in range(n)] for e in range(n)]))
            else:
                neighbours.append((a, finish, matrix))
        for d in allowed[b]:
            forced_remote, forced_local, either = 0.0, [], []
            for a, finish, transfer in neighbours:
                remote = min((finish[e] + transfer[e][d] for e in allowed[a] if e != d), default=math.inf)
                if d not in allowed[a]:
                    forced_remote = max(forced_remote, remote)
                elif not math.isfinite(remote):
                    forced_local.append((out[a][d], problem.exec_s[a][d]))
                else:
                    either.append((remote, (out[a][d], problem.exec_s[a][d])))
            either.sort(key=lambda item: -item[0])
            best = math.inf
            for k in range(len(either) + 1):
                remote_term = either[k][0] if k < len(either) else 0.0
                if max(forced_remote, remote_term) >= best:
                    continue
                local_term = _serial(forced_local + [item for _, item in either[:k]], problem.slots[d])
                best = min(best, max(forced_remote, remote_term, local_term))
            row[d] = best
        out[b] = tuple(row)
    return out


def _all_devices(problem: ScheduleProblem) -> Allowed:
    return {t: problem.allowed(t) for t in problem.tasks}


def heads(problem: ScheduleProblem, allowed: Allowed | None = None) -> Bounds:
    """H[t][d]: a lower bound on the start of t in any schedule that runs t on device d (inf where not allowed)."""
    return _sweep(problem, allowed or _all_devices(problem), reverse=False)


def tails(problem: ScheduleProblem, allowed: Allowed | None = None) -> Bounds:
    """Q[t][d]: a lower bound on makespan − finish of t in any schedule that runs t on device d."""
    return _sweep(problem, allowed or _all_devices(problem), reverse=True)


def path_bound(problem: ScheduleProblem, head: Bounds, tail: Bounds, allowed: Allowed | None = None) -> float:
    """max over tasks of the least head + execution + tail over its devices."""
    allowed = allowed or _all_devices(problem)
    return max(
        min((head[t][d] + problem.exec_s[t][d] + tail[t][d] for d in allowed[t]), default=math.inf)
        for t in problem.tasks
    )


def load_bound(problem: ScheduleProblem, head: Bounds, tail: Bounds, allowed: Allowed | None = None) -> float:
    """The least, over how many slots are used, of (work + first heads + last tails) / slots."""
    allowed = allowed or _all_devices(problem)
    work = sum(min((problem.exec_s[t][d] for d in allowed[t]), default=math.inf) for t in problem.tasks)
    first = sorted(min((head[t][d] for d in allowed[t]), default=math.inf) for t in problem.tasks)
    last = sorted(min((tail[t][d] for d in allowed[t]), default=math.inf) for t in problem.tasks)
    total = min(sum(problem.slots), len(problem.tasks))
    return min((work + sum(first[:n]) + sum(last[:n])) / n for n in range(1, total + 1))


@dataclass(frozen=True, slots=True, kw_only=True)
class Windows:
    """What holds in every schedule of makespan ≤ ``horizon``: devices per task, heads and tails.

    ``refuted``: there is no such schedule.
    """

    horizon: float
    allowed: Allowed
    head: Bounds
    tail: Bounds
    refuted: bool


def propagate(problem: ScheduleProblem, horizon: float) -> Windows:
    """Drop devices that cannot meet ``horizon`` and recompute heads and tails, until nothing changes."""
    allowed = _all_devices(problem)
    while True:
        head, tail = heads(problem, allowed), tails(problem, allowed)
        kept = {
            t: [d for d in allowed[t] if head[t][d] + problem.exec_s[t][d] + tail[t][d] <= horizon]
            for t in problem.tasks
        }
        if any(not devices for devices in kept.values()):
            return Windows(horizon=horizon, allowed=allowed, head=head, tail=tail, refuted=True)
        if kept == allowed:
            refuted = load_bound(problem, head, tail, kept) > horizon
            return Windows(horizon=horizon, allowed=kept, head=head, tail=tail, refuted=refuted)
        allowed = kept


def lower_bound(
    problem: ScheduleProblem,
    *,
    upper: float | None = None,
    time_limit_s: float = 1.0,
    tolerance: float = 1e-3,
) -> float:
    """A proven lower bound on the optimal makespan (proofs in the module docstring).

    The path and load bounds; with ``upper`` (a known makespan), raised by
    refuting horizons between them and ``upper`` for up to ``time_limit_s``,
    until the interval is narrower than ``tolerance`` · ``upper``.

    Example:
        >>> from orchestrator.dag import problem_from_costs
        >>> p = problem_from_costs({"a": [2, 3], "b": [2, 3], "c": [1, 1]}, {("a", "c"): 5, ("b", "c"): 5})
        >>> lower_bound(p)  # c waits for a transfer or for a and b in turn on one device
        5.0
    """
    deadline = time.perf_counter() + time_limit_s
    head, tail = heads(problem), tails(problem)
    low = max(path_bound(problem, head, tail), load_bound(problem, head, tail))
    if upper is None:
        return low
    high = upper
    while high - low > tolerance * upper and time.perf_counter() < deadline:
        middle = (low + high) / 2
        if propagate(problem, middle).refuted:
            low = middle
        else:
            high = middle
    return min(low, upper)
