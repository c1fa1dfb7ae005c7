"""``plan()``: solve the stage ILP for every stage count and microbatch count, keep the best.

The ILP (``_ilp``) fixes M so that in-flight activations (which depend on a stage's distance
from the end of the pipeline) stay linear, and each M's model is solved once per stage count S
(a *piece*, ``_pieces``), the pieces of one M in its HiGHS sessions, up to one solve per core at
once (``_workers``). The search runs in three steps, each in its share of the time limit
(:class:`~orchestrator.planner._options.SearchOptions`):

1. **A first incumbent** (``_starts``): the balanced heuristic, the baselines and the best
   one-stage plan, improved by a local search (``_polish``).
2. **Bounds** (``_bounds``): every M gets its first packing LP, the M farthest from the
   incumbent's first, which drops the M that cannot beat the incumbent for one LP each; every
   (M, S) piece of the others gets a bound from whole stages as columns (an LP, then a MIP where
   the LP leaves it open; every plan a MIP finds may become the incumbent), which closes most
   pieces before any ILP is built; every M not bounded for every S has its packing bound refined.
3. **Pieces** (``_models``, ``_solve``): every other M's model is built and cut into pieces;
   a first pass gives each piece (fewest stages first) a short, presolve-free solve, and most
   prove at once that they cannot beat the incumbent; rounds over the pieces still open, weakest
   bound first, share what is left.

Every solve asks only for plans ``gap`` better than the incumbent (``_incumbent``), and an M or
piece whose bound is within ``gap`` of it is closed: the plan returned is then certified within
``gap`` of the optimum, not necessarily optimal. The certified lower bound is the smallest bound
over all pieces and closed M (``_pieces.Certificate``), so the gap covers the whole search space.

The time limit is hard (``_deadline``): the cost table checks it before every entry it computes,
so work no solver's limit stops (pricing a huge batch's shares, a large cluster's groups) ends
there too; the search then stops with the incumbent it has, whose gap is unknown (its bound 0).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from orchestrator.costs import CostModel
from orchestrator.planner._bounds import column_bounds, packing_bounds
from orchestrator.planner._deadline import Deadline, DeadlineExceeded
from orchestrator.planner._diagnose import infeasibility_message
from orchestrator.planner._groups import MEMORY_HEADROOM, GroupConfig
from orchestrator.planner._incumbent import Best
from orchestrator.planner._make_plan import make_plan
from orchestrator.planner._migration import Migration
from orchestrator.planner._models import build_pieces
from orchestrator.planner._options import SearchOptions
from orchestrator.planner._pieces import Certificate, Piece, close_beaten
from orchestrator.planner._plan import Plan, PlanInfeasible, PlanNotFound
from orchestrator.planner._progress import Observer, SearchProgress
from orchestrator.planner._scope import Scope
from orchestrator.planner._solve import first_pass, rounds
from orchestrator.planner._space import SearchSpace, microbatch_counts, search_space
from orchestrator.planner._starts import first_incumbent
from orchestrator.planner._workers import PieceWorkers, default_workers
from orchestrator.solver import work

log = logging.getLogger(__name__)


def plan(
    model: CostModel,
    *,
    global_batch: int,
    schedule: str = "1f1b",
    microbatch_candidates: tuple[int, ...] | None = None,
    max_stages: int | None = None,
    time_limit_s: float = 30.0,
    gap: float = 1e-3,
    recompute: bool = True,
    start: tuple[list[list[int]], list[GroupConfig], int] | None = None,
    prefer_devices: list[tuple[str, ...] | None] | None = None,
    migration: Migration | None = None,
    zero: bool = False,
    mixed_stages: bool | None = None,
    memory_headroom: float = MEMORY_HEADROOM,
    virtual_stages: bool = False,
    sequence_parallel: bool = False,
    selective_recompute: bool = False,
    overlap_param_gather: bool = False,
    fsdp: bool = False,
    options: SearchOptions | None = None,
    deadline: Deadline | None = None,
    progress: Observer | None = None,
) -> Plan:
    """The best plan for ``model``'s layers on its cluster (see ``_ilp`` for the model).

    One ILP per microbatch count M decides the stage count (≤ ``max_stages``), the
    split, each stage's group and recompute; the certified lower bound is the smallest
    of the per-M bounds, so the reported gap covers the whole search space. An M whose
    packing bound or LP relaxation already reaches the incumbent is skipped (its bound is
    then above the incumbent and cannot lower the certified bound).

    Args:
      model: the cost model (it carries the layers and the cluster).
      global_batch: samples per step; M must divide it, and each stage's data-parallel
        degree must divide the microbatch.
      schedule: "1f1b" or "gpipe" (what in-flight activations each stage holds).
      microbatch_candidates: the M to consider (those dividing ``global_batch``); None: every
        divisor of ``global_batch``.
      max_stages: the largest pipeline depth (default: layers, at most 16).
      time_limit_s: the search's budget in seconds of counted work (simplex iterations, branch-and-
        bound nodes, plans priced, each at about an idle core's cost: ``orchestrator.solver.work``),
        so the same input gives the same plan and gap on an idle or a busy machine; the incumbent
        and its gap are returned when it runs out. The wall clock only caps it, at
        ``work.wall_cap_s(time_limit_s)`` (or ``deadline``).
      gap: relative gap at which each solve stops.
      recompute: also consider recomputing each stage's forward in its backward.
      start: a known plan (layers per stage, groups, M) to start from, e.g. the previous
        plan when re-planning; used when it fits and beats the heuristic. With ``virtual_stages``,
        it is interleaved too, and returned when that is faster than the incumbent interleaved.
      prefer_devices: devices for the stage at each position counted from the end of the
        pipeline (0 = last stage), used when its group still fits them (re-planning keeps
        surviving stages where they are, so their state need not move).
      migration: when re-planning, the cost of moving state off the previous plan's surviving
        stages, amortised per step and added to the objective (``_migration``); the plan's
        ``objective`` then includes it, its ``iteration_s`` does not.
      zero: plan with ZeRO-1: every stage with data parallelism shards its optimizer state
        over its replicas (less memory, and the update split; its gradient sync becomes a
        reduce-scatter and an all-gather, in the ring model the cost of the all-reduce it
        replaces). Off by default, as in the executor; the stages record it (``Stage.zero``).
      mixed_stages: also consider stages on hosts of two device types, each type's replicas
        with its own batch share (``_groups``, ``CostTable``). None (default): on clusters of at
        most ``options.mixed_hosts`` hosts. The executor runs one SPMD program per stage, which
        cannot give replicas uneven shares: plan with False to execute.
      memory_headroom: the share of each device's memory a plan leaves free (``MEMORY_HEADROOM``,
        10%): a stage may fill capacity × (1 − memory_headroom) per device.
      virtual_stages: also price the plan found under interleaved 1F1B with v > 1 model chunks
        per stage and keep the fastest (``_make_plan``); under 1F1B the gap then covers every v up to
        half the blocks, against the weaker bound of ``_interleaved_bound``. Off by default; the Flax pipeline runs v > 1 (``integrations.torch_xla`` runs one-stage plans only).
      sequence_parallel, selective_recompute, overlap_param_gather: price every stage with that
        option (``search_space``), as a published configuration is priced; off by default, as
        ``integrations.torch_xla.apply`` runs none of them.
      fsdp: price every stage with data parallelism as fully sharded (ZeRO-3/FSDP: parameters,
        gradients and optimizer state split over its replicas, each layer's parameters gathered
        and its gradients reduce-scattered once a step) and record it (``Stage.fsdp``); what
        maxtext runs by default and Llama 3 ran inside its pipelines. ``integrations.flax``
        runs it on one stage and in pipelines; ``integrations.torch_xla.apply`` refuses it. Off
        by default.
      options: how the search shares its time limit (:class:`SearchOptions`; default: its defaults).
      deadline: when given, the wall-clock cap of the call (a :class:`Deadline` that started
        earlier, e.g. with a command that captured the model first; the work budget is then at
        most its ``limit_s``); its ``limit_s`` is the limit an answer that ran out of time names.
      progress: called with a :class:`SearchProgress` as each step of the search starts and as
        each piece's solve ends (the incumbent, the bound, the gap), on this thread.

    Returns:
      The best plan found, with its certified lower bound and gap.

    Raises:
      PlanInfeasible: no plan fits (proven); the message names the binding constraint and
        the least extra memory per device that would make one exist.
      PlanNotFound: the time limit ran out before any plan was found and before the
        search space was proven empty (its message: "no plan found within N s ...").

    Example:
      >>> from orchestrator.planner import plan
      >>> found = plan(model, global_batch=8, time_limit_s=10)  # doctest: +SKIP
      >>> found.gap <= 1e-3 or found.status == "Time limit reached"  # doctest: +SKIP
      True
    """
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r}")
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    if not 0.0 <= memory_headroom < 1.0:
        raise ValueError(f"memory_headroom must be in [0, 1), got {memory_headroom!r}")
    # the steps share ``time_limit_s`` of counted solver work (``work``), the same steps however busy
    # the machine; the wall clock only caps it (``deadline``, or far above the budget)
    if deadline is not None:
        time_limit_s = min(time_limit_s, deadline.limit_s)
    deadline = deadline or Deadline.after(work.wall_cap_s(time_limit_s))
    started = time.perf_counter()
    options = options or SearchOptions()
    mixed = options.offers_mixed(model.cluster, mixed_stages)
    space = search_space(
        model,
        global_batch,
        recompute=recompute,
        zero=zero,
        mixed=mixed,
        memory_headroom=memory_headroom,
        sequence_parallel=sequence_parallel,
        selective_recompute=selective_recompute,
        overlap_param_gather=overlap_param_gather,
        fsdp=fsdp,
    )
    max_stages = min(max_stages or 16, space.layers, len(model.cluster.devices()))
    candidates = microbatch_counts(global_batch, microbatch_candidates)
    log.debug(
        "search space in %.2f s: %d groups, %d runs, M in %s",
        time.perf_counter() - started,
        len(space.groups),
        len(space.runs),
        candidates,
    )
    keys = [(layer.signature, layer.activation_bytes) for layer in model.layers]
    best = Best(space, schedule, migration=migration, keys=keys)
    certificate = Certificate(best, gap)

    scope = Scope(space=space, candidates=candidates, max_stages=max_stages, gap=gap, options=options)

    def report(step: str, **counts) -> None:
        if progress is not None:
            incumbent = None if best.current is None else best.current.evaluation.iteration_s
            progress(
                SearchProgress(step=step, elapsed_s=time.perf_counter() - started, incumbent_s=incumbent, **counts)
            )

    finish_s = min(options.finish_s, time_limit_s / 100)
    # the search ends a little early, so the plan (devices, explanation) is built within the limit
    hard = deadline.earlier_by(finish_s)
    try:
        with space.table.bounded(hard), work.work_budget():
            hard.check()
            _search(
                model,
                scope,
                certificate,
                global_batch=global_batch,
                recompute=recompute,
                start=start,
                migration=migration,
                started=started,
                time_limit_s=time_limit_s,
                finish_s=finish_s,
                report=report,
            )
        stopped = False
    except DeadlineExceeded:
        log.debug("the time limit stopped the search after %.2f s", time.perf_counter() - started)
        stopped = True
    if best.current is None:
        with space.table.bounded(deadline):
            _no_plan(model, space, certificate, candidates, max_stages, schedule, global_batch, deadline, stopped)
    found = best.current
    finals = [(found.evaluation, found.stages, found.groups, found.microbatches, found.score)]
    given = start is not None and (found.stages, found.groups, found.microbatches) != tuple(start)
    if virtual_stages and given and start[2] in candidates:
        # v is chosen after the search, so a given plan the incumbent beats plain may still win interleaved
        ev = best.evaluate(*start)
        if ev.feasible:
            finals.append((ev, *start, best.score(ev, start[0], start[1])))
    made = [
        make_plan(
            model,
            space,
            ev,
            stages,
            groups,
            M,
            schedule=schedule,
            global_batch=global_batch,
            bound=0.0 if stopped else certificate.lower,
            gap=gap,
            started=started,
            prefer_devices=prefer_devices,
            objective=score,
            covered=space.coverage(candidates, max_stages),
            interleave=virtual_stages,
        )
        for ev, stages, groups, M, score in finals
    ]
    result = min(made, key=lambda one: one.objective)
    report("done", bound_s=result.bound)
    return result


def _search(
    model: CostModel,
    scope: Scope,
    certificate: Certificate,
    *,
    global_batch: int,
    recompute: bool,
    start: tuple[list[list[int]], list[GroupConfig], int] | None,
    migration: Migration | None,
    started: float,
    time_limit_s: float,
    finish_s: float,
    report: Callable[..., None],
) -> None:
    """The three steps of the module docstring, each in its share of ``time_limit_s`` from ``started``,
    ending ``finish_s`` early; the incumbent goes into ``certificate.best``, what the search proves into
    ``certificate``, and ``report(step, **counts)`` hears of each step and each piece solved."""
    best, options, candidates, max_stages = certificate.best, scope.options, scope.candidates, scope.max_stages
    started = work.now()  # (the shares are of counted work)

    def left() -> float:
        return time_limit_s - (work.now() - started)

    # each step in its share of the time left: the first incumbent, the column bounds, the packing bounds
    report("first plan")
    one_stage_s = first_incumbent(
        model,
        scope,
        best,
        global_batch=global_batch,
        recompute=recompute,
        given=start,
        started=started,
        time_limit_s=time_limit_s,
    )
    report("bounds")
    # every M's first packing LP, the M farthest from the incumbent's first: one LP per M (where its
    # columns take at least one per stage count) closes the M that cannot beat the incumbent, most of
    # the few- and many-microbatch counts, before any of their columns is priced
    home = best.current.microbatches if best.current is not None else max(candidates, default=1)
    searches: dict = {}  # (each M's packing LPs, loaded once for both passes)
    coarse = packing_bounds(
        scope,
        best,
        sorted(candidates, key=lambda M: (-abs(math.log2(M / home)), M)),
        deadline=work.now() + options.first_packing_share * left(),
        probe=True,
        ordered=True,
        searches=searches,
    )
    near = [M for M in candidates if coarse[M] < best.cutoff_s(scope.gap)]
    columns = column_bounds(scope, best, near, deadline=work.now() + options.column_share * left())
    # an M with a column bound for every S needs no more packing: the least of them bounds it, and it
    # is at least as tight (each column LP is the packing LP restricted to whole stages, one per position)
    complete = {M: min(b.values()) for M, b in columns.items() if len(b) == max_stages}
    open_counts = [M for M in near if M not in complete and coarse[M] < best.cutoff_s(scope.gap)]
    packing = dict(coarse)
    packing.update(
        packing_bounds(
            scope,
            best,
            open_counts,
            deadline=work.now() + options.packing_share * left(),
            known=coarse,
            searches=searches,
        )
    )
    packing.update({M: max(bound, packing.get(M, 0.0)) for M, bound in complete.items()})
    report("models")
    pieces = build_pieces(
        scope,
        certificate,
        packing=packing,
        columns=columns,
        one_stage_s=one_stage_s,
        migration=migration,
        started=started,
        time_limit_s=time_limit_s,
    )
    _solve_pieces(pieces, certificate, deadline=started + time_limit_s - finish_s, options=options, report=report)


def _solve_pieces(
    pieces: list[Piece],
    certificate: Certificate,
    *,
    deadline: float,
    options: SearchOptions,
    report: Callable[..., None],
) -> None:
    """The first pass over ``pieces`` (fewest stages first), then rounds over those still open, until
    ``deadline``; every solve and every piece's final bound go into ``certificate``, and each solve's
    end to ``report`` (the pieces solved, and the bound so far: the least over the closed M and the
    pieces, a tail piece split in the first pass keeping the bound it had)."""
    best, gap = certificate.best, certificate.gap
    close_beaten(pieces, best.current, gap)  # none is gap better than the incumbent
    pieces.sort(key=lambda p: p.stages)
    built, solved = list(pieces), 0

    def current():
        return best.current

    def bound_s() -> float:
        return min([certificate.lower, *(p.bound_s for p in built)])

    def record(piece: Piece, result) -> None:
        nonlocal solved
        certificate.record(piece.model, result, piece)
        solved += 1
        report("pieces", bound_s=bound_s(), pieces_solved=solved, pieces=len(built))

    report("pieces", bound_s=bound_s(), pieces=len(built))
    with PieceWorkers(default_workers(), record) as workers:
        pieces = first_pass(pieces, workers, current, gap=gap, deadline=deadline, options=options)
        rounds(pieces, workers, current, gap=gap, deadline=deadline, options=options)
    certificate.settle(pieces)


def _no_plan(
    model: CostModel,
    space: SearchSpace,
    certificate: Certificate,
    candidates: list[int],
    max_stages: int,
    schedule: str,
    global_batch: int,
    deadline: Deadline,
    stopped: bool,
) -> None:
    """Raise why the search found no plan: out of time (``stopped`` by the deadline, or some M left
    open) before it proved none fits, or none fits (its diagnosis within what is left of ``deadline``)."""
    if stopped or certificate.unproven:
        open_counts = "the search stopped" if stopped else f"microbatch counts {sorted(certificate.unproven)} open"
        raise PlanNotFound(
            f"no plan found within {deadline.limit_s:g} s for {space.layers} layers on "
            f"{len(model.cluster.devices())} devices, and none proven impossible ({open_counts}): raise time_limit_s"
        )
    raise PlanInfeasible(
        infeasibility_message(model, space, candidates, max_stages, schedule, global_batch, deadline=deadline)
    )
