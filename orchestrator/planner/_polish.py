"""Local search from an incumbent: the plans one change away, priced exactly, until none is better.

The ILP's branch and bound finds good plans slowly where the search space is wide (64 devices
of four types take it minutes to improve on the heuristic by a sixth). Most of those better plans are a few changes away
from the heuristic's, so a local search reaches them in a fraction of a second and hands the
ILP a better incumbent, which cuts off more of its search.

A plan is (stages: contiguous layer ranges, groups: one per stage, M). Its neighbours:

    shift          move the boundary between two neighbouring stages by one layer
    regroup        give one stage any other group (type, size, tp, recompute, or a mixed
                   group) that the devices the other stages leave allow
    split          cut a stage in two at any layer: one part keeps its group, the other takes a
                   group from the free devices; or both take groups of its type within its
                   devices and the free ones
    merge          join two neighbouring stages onto one group from their devices and the free ones
    swap           exchange the groups of two stages
    microbatches   the same stages and groups at every other candidate M
    reorder        the stages' device sets in the same order or with two of them swapped, every
                   layer boundary cut anew for the least slowest stage (``_rebalance``), each
                   stage with recomputation on or off as suits it; tried only at a local optimum
                   of the moves above, first improvement (a 16-stage pipeline has about a hundred
                   orders, each cut in milliseconds before pricing)

Each neighbour is priced as ``evaluate`` prices a plan (its stages' summaries, each computed once) —
the closed form the ILP's objective is — and must fit in memory. Steepest descent takes the best
neighbour until none is better, then the reorders are tried, each better one descended from;
then an iterated local search kicks that local optimum by
``KICK`` random fitting moves and descends again, keeping the better of the two. It stops at the
deadline, after ``PATIENCE`` kicks in a row that find nothing better, or once the kicks have gone
without a better plan for longer than the search took to find the last one (plus a second).
It never returns a worse plan, and with a fixed seed it is deterministic up to where the deadline
falls.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable, Iterator

from orchestrator.planner._evaluate import Evaluation, evaluate, summary_cache
from orchestrator.planner._groups import GroupConfig
from orchestrator.planner._incumbent import Incumbent
from orchestrator.planner._rebalance import Rebalancer
from orchestrator.solver import work

log = logging.getLogger(__name__)

# random moves that kick a local optimum before the next descent
KICK = 2
# kicks in a row that find nothing better before the search stops: on the presets an improvement
# comes within 10 kicks of the last or not at all, and a larger patience spends the search's whole
# share where it finds nothing
PATIENCE = 20

Candidate = tuple[tuple[tuple[int, ...], ...], tuple[GroupConfig, ...], int]


def polish(
    stages: list[list[int]],
    groups: list[GroupConfig],
    microbatches: int,
    *,
    space,
    schedule: str,
    candidates: list[int],
    max_stages: int,
    score: Callable[[Evaluation, list[list[int]], list[GroupConfig]], float],
    deadline: float,
) -> Incumbent | None:
    """The local optimum reached from the plan (``stages``, ``groups``, ``microbatches``), or None
    when it does not fit. ``score`` is what is minimised (the step time, plus the migration when
    re-planning); ``deadline`` is a ``work.now()`` time."""
    # every plan priced: its score, None when it does not fit (scores only: GPT-175B's search prices
    # hundreds of thousands of plans)
    seen: dict[Candidate, float | None] = {}
    # a neighbour changes one or two stages: every stage's summary is priced once
    summary = summary_cache()

    def evaluation(candidate: Candidate) -> Evaluation:
        parts, chosen, M = candidate
        return evaluate(
            parts,
            chosen,
            M,
            table=space.table,
            infos=space.infos,
            schedule=schedule,
            links=space.links,
            summarize=summary,
            report_infeasible=False,
        )

    def price(candidate: Candidate) -> float | None:
        if candidate not in seen:
            ev = evaluation(candidate)
            parts, chosen, _ = candidate
            seen[candidate] = score(ev, [list(p) for p in parts], list(chosen)) if ev.feasible else None
        return seen[candidate]

    def descend(current: Candidate, priced: float) -> tuple[Candidate, float]:
        """Steepest descent from ``current`` (scored ``priced``) to a local optimum (or the deadline)."""
        while work.now() < deadline:
            best = None
            for neighbour in moves.around(current):
                found = price(neighbour)
                if found is not None and found < (priced if best is None else best) * (1 - 1e-12):
                    best, best_candidate = found, neighbour
                if work.now() >= deadline:
                    break
            if best is None:
                break
            current, priced = best_candidate, best
        return current, priced

    began = work.now()
    start: Candidate = (tuple(tuple(s) for s in stages), tuple(groups), microbatches)
    if price(start) is None:
        return None

    def reorder(current: Candidate, priced: float) -> tuple[Candidate, float]:
        """First improvement over the stages' device sets swapped two at a time, each with its
        layers cut anew (``_rebalance``), descending from every better plan found."""
        better = True
        while better and work.now() < deadline:
            better = False
            for neighbour in moves.reorders(current):
                found = price(neighbour)
                if found is not None and found < priced * (1 - 1e-12):
                    current, priced = descend(neighbour, found)
                    better = True
                    log.debug("polish: %.6g ms after a reorder", priced * 1e3)
                    break
                if work.now() >= deadline:
                    break
        return current, priced

    moves = _Moves(space, candidates, max_stages, schedule)
    current, priced = reorder(*descend(start, price(start)))
    # iterated local search: kick the local optimum by KICK random fitting moves and descend again,
    # keeping whichever is better, until the deadline
    rng = random.Random(0)
    kicks = since = 0
    improved = work.now()
    # stop after PATIENCE fruitless kicks, or once the kicks have gone without a better plan for
    # longer than the search took to find the last one (and a second)
    while (now := work.now()) < deadline and since < PATIENCE and now - improved <= improved - began + 1.0:
        kicks, since = kicks + 1, since + 1
        kicked = current
        for _ in range(KICK):
            neighbours = list(moves.around(kicked))
            rng.shuffle(neighbours)
            kicked = next((n for n in neighbours if price(n) is not None), kicked)
        if kicked == current:
            break
        found, found_priced = descend(kicked, price(kicked))
        if found_priced < priced * (1 - 1e-12):
            current, priced, since, improved = found, found_priced, 0, work.now()
            log.debug("polish: %.6g ms after %d kicks, %d plans priced", priced * 1e3, kicks, len(seen))
    parts, chosen, M = current
    return Incumbent(priced, evaluation(current), [list(p) for p in parts], list(chosen), M)


class _Moves:
    """The neighbours of a plan (see the module docstring)."""

    def __init__(self, space, candidates: list[int], max_stages: int, schedule: str):
        self.groups, self.candidates, self.max_stages = space.groups, candidates, max_stages
        self.rebalancer = Rebalancer(space.table, space.groups, space.layers, schedule)
        self.devices = {t: info.devices for t, info in space.infos.items()}
        self.of_type: dict[str, list[GroupConfig]] = {}
        for g in self.groups:
            if not g.mixed:
                self.of_type.setdefault(g.device_type, []).append(g)

    def fitting(self, free: Counter) -> Iterator[GroupConfig]:
        """Groups the free devices hold."""
        return (g for g in self.groups if all(free[t] >= n for t, n in g.by_type.items()))

    def free(self, groups) -> Counter:
        used = Counter()
        for g in groups:
            used.update(g.by_type)
        return Counter({t: n - used[t] for t, n in self.devices.items()})

    def around(self, candidate: Candidate) -> Iterator[Candidate]:
        parts, groups, M = candidate
        S = len(parts)
        for s in range(S - 1):  # shift
            if len(parts[s]) > 1:
                yield _with(parts, s, (parts[s][:-1], (parts[s][-1],) + parts[s + 1]), 2), groups, M
            if len(parts[s + 1]) > 1:
                yield _with(parts, s, (parts[s] + parts[s + 1][:1], parts[s + 1][1:]), 2), groups, M
        for s in range(S):  # regroup
            free = self.free(groups[:s] + groups[s + 1 :])
            for g in self.fitting(free):
                if g != groups[s]:
                    yield parts, _with(groups, s, (g,)), M
        for s in range(S):  # swap
            for s2 in range(s + 1, S):
                if groups[s] != groups[s2]:
                    yield parts, _with(_with(groups, s, (groups[s2],)), s2, (groups[s],)), M
        for M2 in self.candidates:  # microbatches
            if M2 != M:
                yield parts, groups, M2
        if S < self.max_stages:
            yield from self.splits(parts, groups, M)
        for s in range(S - 1):  # merge
            free = self.free(groups[:s] + groups[s + 2 :])
            merged = (parts[s] + parts[s + 1],)
            for g in self.fitting(free):
                yield _with(parts, s, merged, 2), _with(groups, s, (g,), 2), M

    def reorders(self, candidate: Candidate) -> Iterator[Candidate]:
        """The same device sets with the layers cut anew: in the same order, then with every two
        stages of different sets swapped (``_rebalance``; never a slower bottleneck)."""
        parts, groups, M = candidate
        bottleneck = self.rebalancer.bottleneck_s(parts, groups, M)
        orders = [groups] + [
            _with(_with(groups, s, (groups[s2],)), s2, (groups[s],))
            for s in range(len(groups))
            for s2 in range(s + 1, len(groups))
            if (groups[s].by_type, groups[s].tp) != (groups[s2].by_type, groups[s2].tp)
        ]
        for order in orders:
            found = self.rebalancer.rebalance(list(order), M, bottleneck * (1 + 1e-9))
            if found is not None:
                stages, chosen = found
                yield tuple(tuple(layers) for layers in stages), tuple(chosen), M

    def splits(self, parts, groups, M) -> Iterator[Candidate]:
        for s, (layers, group) in enumerate(zip(parts, groups)):
            if len(layers) < 2:
                continue
            cuts = [(layers[:c], layers[c:]) for c in range(1, len(layers))]
            free = self.free(groups)
            others = groups[:s] + groups[s + 1 :]
            for g in self.fitting(free):  # one part keeps the group
                for front, back in cuts:
                    yield _with(parts, s, (front, back)), _with(groups, s, (group, g)), M
                    yield _with(parts, s, (front, back)), _with(groups, s, (g, group)), M
            if group.mixed:
                continue
            # both parts on halves of its type's devices and the free ones (the largest size that
            # fits twice: every pair of sizes would multiply the neighbours by the sizes squared)
            room = self.free(others)[group.device_type]
            sizes = [g.size for g in self.of_type.get(group.device_type, []) if 2 * g.size <= room]
            halves = [g for g in self.of_type.get(group.device_type, []) if sizes and g.size == max(sizes)]
            for a in halves:
                for b in halves:
                    for front, back in cuts:
                        yield _with(parts, s, (front, back)), _with(groups, s, (a, b)), M


def _with(items: tuple, s: int, replacement: tuple, count: int = 1) -> tuple:
    """``items`` with its ``count`` entries from ``s`` on replaced by the entries of ``replacement``."""
    return items[:s] + replacement + items[s + count :]
