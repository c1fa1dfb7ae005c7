"""The whole-stage column bounds against enumeration: for every stage count S, never above the best
plan of exactly S stages (LP and MIP), +inf only when no such plan fits, the cutoff only when none is
below it, the optimum itself when the MIP prices its plans; and tighter than the packing bound."""

import itertools
import math
import statistics

import numpy as np
import pytest

from orchestrator.bench._synthetic import SyntheticCosts, SyntheticLayer, random_instance, synthetic_cluster
from orchestrator.planner._evaluate import evaluate, summary_cache
from orchestrator.planner._ilp import Run
from orchestrator.planner._packing import PackingBound
from orchestrator.planner._paths import StageColumns, stage_shapes
from orchestrator.planner._space import search_space
from orchestrator.planner.baselines._exhaustive import _partitions

BATCH = 8


def _best_of_exactly(space, M: int, S: int, schedule: str):
    """The least step time of the plans with exactly S stages at M microbatches (None: none fits)."""
    valid = [g for g in space.groups if space.table.microbatch(g, M) is not None]
    summary = summary_cache()  # (each stage summarised once: the same prices, sooner)
    best = None
    for stages in _partitions(space.layers, S):
        for chosen in itertools.product(valid, repeat=S):
            ev = evaluate(
                list(stages),
                list(chosen),
                M,
                table=space.table,
                infos=space.infos,
                schedule=schedule,
                links=space.links,
                summarize=summary,
            )
            if ev.feasible and (best is None or ev.iteration_s < best):
                best = ev.iteration_s
    return best


def _columns(space, M: int, schedule: str) -> StageColumns:
    groups = [g for g in space.groups if space.table.microbatch(g, M) is not None]
    return StageColumns(space, groups, microbatches=M, schedule=schedule)


def test_shapes_are_the_contiguous_slices_of_the_runs():
    runs = [Run(0, 1), Run(1, 3), Run(4, 1)]  # embedding, three identical blocks, head
    counts, starts, ends = stage_shapes(runs)
    slices = {tuple(row) for row in counts}
    chain = [0, 1, 1, 1, 2]  # the run of each layer
    expected = {tuple(np.bincount(chain[a:b], minlength=3)) for a in range(5) for b in range(a + 1, 6)}
    assert slices == expected and len(counts) == len(slices)
    for row, first, last in zip(counts, starts, ends):
        assert first == (row[0] == 1)  # starts at layer 0 only by holding the embedding
        assert last == (row[2] == 1)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_column_bounds_never_exceed_the_best_plan_of_each_stage_count(schedule):
    compared, empty, chained, priced, ratios = 0, 0, 0, 0, []
    for seed in range(14):
        space = search_space(random_instance(seed), BATCH, recompute=True)
        for M in (1, 2, 4):
            columns = _columns(space, M, schedule)
            for S in range(1, min(3, space.layers) + 1):
                truth = _best_of_exactly(space, M, S, schedule)
                bound = columns.bound_s(S)
                if truth is None:
                    empty += bound == math.inf
                    assert columns.integer_bound_s(S, cutoff_s=math.inf, time_limit_s=math.inf)[0] >= bound
                    continue
                assert bound <= truth * (1 + 1e-6), f"seed {seed}, M={M}, S={S}: LP {bound} > {truth}"
                # just above the optimum, neither may claim the piece closed; the MIP is at least the LP
                cutoff = truth * 1.001
                assert columns.bound_s(S, cutoff_s=cutoff) < cutoff
                whole, chosen, decided = columns.integer_bound_s(S, cutoff_s=cutoff, time_limit_s=math.inf)
                assert decided  # (no time limit: each MIP runs until it decides)
                assert bound * (1 - 1e-6) <= whole <= truth * (1 + 1e-6), f"seed {seed}, M={M}, S={S}: MIP {whole}"
                if chosen is not None:  # its solution, laid out as a plan: S contiguous stages, priced above it
                    stages, groups = [layers for layers, _ in chosen], [group for _, group in chosen]
                    assert list(itertools.chain(*stages)) == list(range(space.layers)) and len(stages) == S
                    ev = evaluate(
                        stages, groups, M, table=space.table, infos=space.infos, schedule=schedule, links=space.links
                    )
                    assert not ev.feasible or ev.iteration_s >= whole * (1 - 1e-6)
                    chained += 1
                # priced: each MIP plan below the cutoff is priced, then excluded, until none is left
                # below it; the optimum (or a plan priced no higher) is among them, so the bound is exact
                prices = []

                def price(stages, groups, M=M, space=space, prices=prices, cutoff=cutoff):
                    ev = evaluate(
                        stages, groups, M, table=space.table, infos=space.infos, schedule=schedule, links=space.links
                    )
                    prices.append(ev.iteration_s if ev.feasible else math.inf)
                    return prices[-1], cutoff

                exact, handed, decided = columns.integer_bound_s(S, cutoff_s=cutoff, time_limit_s=math.inf, price=price)
                assert decided and handed is None
                assert exact == pytest.approx(truth, rel=1e-6), f"seed {seed}, M={M}, S={S}: priced {exact} vs {truth}"
                assert min(prices) == pytest.approx(truth, rel=1e-6) and min(prices) >= truth * (1 - 1e-9)
                priced += len(prices) > 1
                # just below it, the MIP may close it: then at the cutoff exactly
                below, _, _ = columns.integer_bound_s(S, cutoff_s=truth * 0.999, time_limit_s=math.inf)
                assert below <= truth * 0.999 * (1 + 1e-9)
                compared += 1
                ratios.append(whole / truth)
    assert compared >= 60 and empty >= 1 and chained >= compared // 2, (compared, empty, chained)
    assert priced >= 1, "no MIP priced more than one plan: the exclusions went untested"
    # tight on these chains: the MIP's and the LP's bounds are within 1% of the optimum at the median
    assert statistics.median(ratios) >= 0.99, sorted(ratios)[:10]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_columns_own_bound_never_exceeds_a_plan_that_holds_it(schedule):
    """Every plan of S stages, fitting or not, takes at least the own bound of each of its stages' columns
    at its position (what the bisection closes a column by), and some own bounds exceed M·c."""
    checked = above = 0
    for seed in range(8):
        space = search_space(random_instance(seed), BATCH, recompute=True)
        for M in (1, 4):
            columns = _columns(space, M, schedule)
            shape_of = {tuple(row): v for v, row in enumerate(columns.counts)}
            run_of = {layer: r for r, run in enumerate(space.runs) for layer in run.layers}
            for S in range(1, min(3, space.layers) + 1):
                own = [columns.own_ms(p, S) for p in range(S)]
                for stages in _partitions(space.layers, S):
                    shapes = [shape_of[tuple(np.bincount([run_of[l] for l in layers], minlength=len(space.runs)))]
                              for layers in stages]  # fmt: skip
                    for chosen in itertools.product(columns.groups, repeat=S):
                        ev = evaluate(
                            list(stages), list(chosen), M, table=space.table, infos=space.infos,
                            schedule=schedule, links=space.links, report_infeasible=False,
                        )  # fmt: skip
                        for s, (v, group) in enumerate(zip(shapes, chosen)):
                            g = columns.groups.index(group)
                            bound = own[S - 1 - s][v, g]
                            assert bound <= ev.iteration_s * 1e3 * (1 + 1e-6), (seed, M, S, s, bound, ev.iteration_s)
                            checked += 1
                            above += bound > M * columns.time[v, g] * (1 + 1e-6)
    assert checked > 1000 and above > checked // 10, (checked, above)


def test_column_lp_is_at_least_the_packing_bound_of_its_stage_count():
    """Each column LP is the packing LP restricted to whole stages, one per position: never weaker."""
    checked = stronger = 0
    for seed in range(10):
        space = search_space(random_instance(seed), BATCH, recompute=True)
        for M in (1, 4):
            groups = [g for g in space.groups if space.table.microbatch(g, M) is not None]
            columns = _columns(space, M, "1f1b")
            for S in range(1, min(3, space.layers) + 1):
                packing = PackingBound(space, groups, microbatches=M, max_stages=S, schedule="1f1b")
                below = packing.bound_s(S)
                ours = columns.bound_s(S)
                if below == math.inf:
                    continue
                assert ours >= below * (1 - 2e-3), f"seed {seed}, M={M}, S={S}: {ours} < packing {below}"
                checked += 1
                stronger += ours > below * 1.01
    assert checked >= 20 and stronger >= checked // 4, (checked, stronger)


def test_a_price_dominated_column_never_prices_a_plan_lower_than_its_dominator():
    """``_price_dominance``'s claim, plan by plan: swapping the dominating group in at any stage of
    any plan, where it fits, never raises the closed form's price (what lets a priced MIP exclude a
    plan for all the plans it stands for)."""
    from orchestrator.planner._ilp import in_flight

    swaps = 0
    for seed in range(12):
        space = search_space(random_instance(seed), BATCH, recompute=True)
        run_of = [r for r, run in enumerate(space.runs) for _ in range(run.count)]
        for M in (1, 4):
            columns = _columns(space, M, "1f1b")
            g2, beaten, onto = columns._price_dominance()
            first = onto.indices  # each pair's dominated group
            index = {group: g for g, group in enumerate(columns.groups)}
            shape = {tuple(row): v for v, row in enumerate(columns.counts)}
            summary = summary_cache()
            for S in range(1, min(3, space.layers) + 1):
                for stages in _partitions(space.layers, S):
                    for chosen in itertools.product(columns.groups, repeat=S):
                        price = evaluate(list(stages), list(chosen), M, table=space.table, infos=space.infos,
                                         schedule="1f1b", links=space.links, summarize=summary)  # fmt: skip
                        if not price.feasible:
                            continue
                        for s, layers in enumerate(stages):
                            v = shape[tuple(np.bincount([run_of[l] for l in layers], minlength=len(space.runs)))]
                            fits = columns.most_in_flight[v] >= in_flight("1f1b", M, S, s)
                            for pair in np.nonzero(beaten[v] & (first == index[chosen[s]]) & fits[g2])[0]:
                                swapped = list(chosen)
                                swapped[s] = columns.groups[g2[pair]]
                                after = evaluate(list(stages), swapped, M, table=space.table, infos=space.infos,
                                                 schedule="1f1b", links=space.links, summarize=summary)  # fmt: skip
                                assert after.feasible and after.iteration_s <= price.iteration_s * (1 + 1e-9), (
                                    f"seed {seed}, M={M}: {chosen[s]} → {swapped[s]} at stage {s} of {stages}"
                                )
                                swaps += 1
    assert swaps >= 100, swaps


def test_the_first_lp_alone_bounds_each_piece_and_its_bisection_gives_the_whole_bound():
    """``first_bound_s``: its first LP is a bound (at most the bisection's, never above the best plan);
    it closes a piece exactly where the whole bound does; and the bisection it hands back is the
    whole bound."""
    checked = closed = tightened = 0
    for seed in range(8):
        space = search_space(random_instance(seed), BATCH, recompute=True)
        for M in (1, 4):
            for S in range(1, min(3, space.layers) + 1):
                truth = _best_of_exactly(space, M, S, "1f1b")
                if truth is None:
                    continue
                for cutoff in (truth * 1.001, truth * 0.98):
                    first, refine = _columns(space, M, "1f1b").first_bound_s(S, cutoff_s=cutoff)
                    whole = _columns(space, M, "1f1b").bound_s(S, cutoff_s=cutoff)
                    assert first <= truth * (1 + 1e-6) or first == cutoff
                    if refine is None:  # closed by the first LP: the whole bound closes it too
                        assert first == cutoff and whole == cutoff
                        closed += 1
                        continue
                    assert first < cutoff and first <= whole * (1 + 1e-9)
                    assert refine() == pytest.approx(whole, rel=1e-9)
                    tightened += refine() > first * (1 + 1e-6)
                    checked += 1
    assert checked >= 10 and closed >= 5 and tightened >= 1, (checked, closed, tightened)


def test_the_rows_at_a_plans_columns_never_exceed_its_price():
    """Every step row, read at the columns of one plan of S stages (up to 5, so the in-flight cycle goes
    round and the first stage's sync follows the drain of another stage), is at most that plan's
    closed-form price: the LP with its columns fixed at 1 and every other at 0 bounds it."""
    import highspy

    from orchestrator.planner._paths import _PositionsLP

    rng = np.random.default_rng(0)
    checked, tight = 0, []
    for seed in range(60):
        space = search_space(random_instance(seed), BATCH, recompute=True)
        run_of = [r for r, run in enumerate(space.runs) for _ in range(run.count)]
        for M in (2, 4, 8):
            columns = _columns(space, M, "1f1b")
            shape = {tuple(row): v for v, row in enumerate(columns.counts)}
            for S in range(2, min(5, space.layers) + 1):
                lp = _PositionsLP(columns, S, cutoff_ms=math.inf)
                if lp.empty:
                    continue
                at = {(int(p), int(v), int(g)): i for i, (p, v, g) in enumerate(zip(lp.position, lp.shape, lp.group))}
                partitions = list(_partitions(space.layers, S))
                for _ in range(40):
                    stages = partitions[rng.integers(len(partitions))]
                    chosen = [columns.groups[g] for g in rng.integers(len(columns.groups), size=S)]
                    ev = evaluate(list(stages), chosen, M, table=space.table, infos=space.infos, schedule="1f1b",
                                  links=space.links)  # fmt: skip
                    keys = [
                        (S - 1 - s, shape[tuple(np.bincount([run_of[l] for l in layers], minlength=len(space.runs)))],
                         columns.groups.index(group))
                        for s, (layers, group) in enumerate(zip(stages, chosen))
                    ]  # fmt: skip
                    if not ev.feasible or any(key not in at for key in keys):  # (a column dominated or not fitting)
                        continue
                    X = len(lp.position)
                    upper = np.zeros(X)
                    upper[[at[key] for key in keys]] = 1.0
                    lp.highs.changeColsBounds(X, np.arange(X, dtype=np.int32), upper, upper)
                    lp.highs.run()
                    assert lp.highs.getModelStatus() == highspy.HighsModelStatus.kOptimal
                    rows = lp.highs.getInfo().objective_function_value
                    price = ev.iteration_s * 1e3
                    assert rows <= price * (1 + 1e-6), f"seed {seed}, M={M}, S={S}: rows {rows} > price {price}"
                    checked += 1
                    tight.append(rows / price)
    assert checked >= 300, checked
    # the rows follow the closed form: at the median a plan is priced within 1% of its rows
    assert statistics.median(tight) >= 0.99, statistics.median(tight)


def test_a_mips_plan_is_excluded_with_its_reorders_and_the_priced_bound_stays_exact(monkeypatch):
    """With four or more stages the MIP prices and excludes, with each plan, every order of its inner
    stages that chains (``StageColumns._reorders``): its priced bound is the one it reaches excluding
    one plan at a time and, on one instance, the best plan of exactly S stages found
    by enumeration."""
    import orchestrator.planner._paths as paths

    def priced_bound(columns, space, M, cutoff):
        prices = []

        def price(stages, groups):
            ev = evaluate(stages, groups, M, table=space.table, infos=space.infos, schedule="1f1b", links=space.links)
            prices.append((tuple(map(tuple, stages)), tuple(map(id, groups))))
            return (ev.iteration_s if ev.feasible else math.inf), cutoff

        bound, _, decided = columns.integer_bound_s(4, cutoff_s=cutoff, time_limit_s=math.inf, price=price)
        assert decided and len(set(prices)) == len(prices), "a plan was priced twice: its exclusion did not hold"
        return bound, prices

    checked = reordered = enumerated = 0
    for seed in range(40):
        space = search_space(random_instance(seed), BATCH, recompute=True)
        if space.layers < 4:
            continue
        for M in (2, 4):
            columns = _columns(space, M, "1f1b")
            _, chosen, _ = columns.integer_bound_s(4, cutoff_s=math.inf, time_limit_s=math.inf)
            if chosen is None:
                continue
            stages, groups = [layers for layers, _ in chosen], [group for _, group in chosen]
            first = evaluate(
                stages, groups, M, table=space.table, infos=space.infos, schedule="1f1b", links=space.links
            )
            cutoff = first.iteration_s * 1.001  # (a plan's price: the MIP prices every plan below it)
            with monkeypatch.context() as patch:  # (below a cutoff, so the MIP goes on after its first plan)
                patch.setattr(paths, "REORDERS", 0)
                one_at_a_time, _ = priced_bound(columns, space, M, cutoff)
            bound, prices = priced_bound(columns, space, M, cutoff)
            assert bound == pytest.approx(one_at_a_time, rel=1e-9), (seed, M, bound, one_at_a_time)
            checked += 1
            swapped = any(a[1][1:3] == b[1][2:0:-1] and a[1][0] == b[1][0] for a in prices for b in prices if a != b)
            reordered += swapped
            if swapped and not enumerated and space.layers == 4:  # (one partition to enumerate)
                assert bound == pytest.approx(_best_of_exactly(space, M, 4, "1f1b"), rel=1e-6)
                enumerated += 1
    assert checked >= 10 and reordered >= 2 and enumerated, (checked, reordered)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_no_row_holds_more_than_a_few_step_columns_however_many_stages(schedule):
    """HiGHS's cut separation walks every row it aggregates, so the MIP of a deep pipeline spends its
    root in rows that each read O(S) step columns (C_p, F_p, E_p, Q_p, Z, W and the partial sums).
    The sums over the positions ahead and behind are columns of their own, so every row reads at
    most 8 of them, at 3 stages as at 12."""
    import highspy
    from scipy.sparse import csc_matrix, csr_matrix

    from orchestrator.planner._paths import _PositionsLP

    block = SyntheticLayer(4e12, 1e9, 0.2e9, 0.05e9)
    model = SyntheticCosts([block] * 14, synthetic_cluster({"a": (20.0, 40.0), "b": (10.0, 32.0)}, per_host=8))
    columns = _columns(search_space(model, BATCH, recompute=True), 4, schedule)
    widest = {}
    for S in (3, 12):
        lp = _PositionsLP(columns, S, cutoff_ms=math.inf)
        assert not lp.empty
        a, shape = lp.highs.getLp().a_matrix_, (lp.highs.getNumRow(), lp.highs.getNumCol())
        kind = csr_matrix if a.format_ == highspy.MatrixFormat.kRowwise else csc_matrix
        step = kind((a.value_, a.index_, a.start_), shape=shape).tocsr()[:, len(lp.position) :]  # (x come first)
        widest[S] = int(np.diff(step.indptr).max())
    assert widest[3] <= 8 and widest[12] <= 8, widest
