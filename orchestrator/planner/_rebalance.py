"""Cut the layers anew for a given sequence of device sets: the least slowest stage.

The local search's moves change one or two stages at a time, so a plan whose stages would all
have to move at once to reach a better one stays where it is. GPT-175B × ``mixed-4type-512``
is such a case: its first incumbent runs 16 stages of 32 devices in type order (V100, A100, L4,
H100), and the better plans move the A100 stages to the end of the pipeline, where few
microbatches are in flight, so they hold five layers without recomputation instead of four with
it; every single change on the way is worse (``tests/orchestrator/planner/test_polish.py``).

``rebalance`` takes the stages' device sets in pipeline order (each a group's devices, its
tensor-parallel degree kept, its recomputation free) and the microbatch count M, and returns the
contiguous cut whose slowest stage computes the least per microbatch, with each stage on the
variant of its group that reaches furthest:

    minimise T  such that  stage s holds layers [e_{s−1}, e_s),  e_{−1} = 0,  e_{S−1} = L,
                           Σ_{ℓ∈s} τ(ℓ, g_s) ≤ T,
                           Σ_{ℓ∈s} (σ(ℓ, g_s) + K_s·α(ℓ, g_s)) + max_{ℓ∈s} ρ(ℓ, g_s) ≤ mem(g_s)

(τ time, σ static, α activation, ρ transient memory per device, K_s the microbatches in flight
at stage s). For a fixed T the stages taking as many layers as they can, front to back, is
exact: every row is monotone in the layers a stage holds, so a stage that reaches further
never hurts the ones after it. T is found by bisection. The bottleneck is not the step time
(fill, drain and sync count too), so the caller prices the cut with the closed form.
"""

from __future__ import annotations

from orchestrator.planner._groups import GroupConfig
from orchestrator.planner._ilp import in_flight
from orchestrator.planner._table import CostTable

# the bisection on the bottleneck stops when its bracket is this close (relative), or after STEPS
PRECISION = 1e-7
STEPS = 60


class Rebalancer:
    """Per-layer costs of every (group, M), read once from the table."""

    def __init__(self, table: CostTable, groups: list[GroupConfig], layers: int, schedule: str):
        self.table, self.layers, self.schedule = table, layers, schedule
        self.variants: dict[tuple, list[GroupConfig]] = {}
        for g in groups:
            if not g.mixed:
                self.variants.setdefault((g.device_type, g.size, g.tp), []).append(g)
        self._costs: dict[tuple[GroupConfig, int], tuple[list[float], list[float], list[float], list[float]]] = {}

    def costs(self, group: GroupConfig, M: int):
        """(τ, σ, α, ρ) per layer of ``group`` at ``M``."""
        key = (group, M)
        if key not in self._costs:
            entries = [self.table.entry(layer, group, M) for layer in range(self.layers)]
            self._costs[key] = (
                [e.time_s for e in entries],
                [e.static_bytes for e in entries],
                [e.activation_bytes for e in entries],
                [e.transient_bytes for e in entries],
            )
        return self._costs[key]

    def reach(self, group: GroupConfig, M: int, in_flight_microbatches: int, start: int, limit: int, T: float) -> int:
        """The end of the longest run of layers from ``start`` (before ``limit``) that ``group`` computes
        within T per microbatch and holds in memory."""
        time_s, static, activation, transient = self.costs(group, M)
        capacity = self.table.infos[group.device_type].memory_bytes
        spent = held = peak = 0.0
        end = start
        while end < limit:
            spent += time_s[end]
            held += static[end] + in_flight_microbatches * activation[end]
            peak = max(peak, transient[end])
            if spent > T or held + peak > capacity:
                break
            end += 1
        return end

    def cut(self, groups: list[GroupConfig], M: int, T: float) -> tuple[list[list[int]], list[GroupConfig]] | None:
        """Front to back, each stage on the variant that reaches furthest within T; None when the
        layers do not all fit."""
        S, L = len(groups), self.layers
        stages, chosen, start = [], [], 0
        for s, group in enumerate(groups):
            K = in_flight(self.schedule, M, S, s)
            limit = L - (S - s - 1)  # a layer left for each later stage
            best_end, best = start, None
            for variant in self.variants.get((group.device_type, group.size, group.tp), ()):
                if self.table.microbatch(variant, M) is None:
                    continue
                end = self.reach(variant, M, K, start, limit, T)
                if end > best_end:
                    best_end, best = end, variant
            if best is None:
                return None
            stages.append(list(range(start, best_end)))
            chosen.append(best)
            start = best_end
        return (stages, chosen) if start == L else None

    def rebalance(
        self, groups: list[GroupConfig], M: int, above_s: float
    ) -> tuple[list[list[int]], list[GroupConfig]] | None:
        """The cut of the least bottleneck for ``groups`` in this order, searched below ``above_s``
        (per microbatch); None when no cut within it fits, or a stage is on two types."""
        if any(g.mixed for g in groups) or len(groups) > self.layers:
            return None
        found = self.cut(groups, M, above_s)
        if found is None:
            return None
        lo, hi = 0.0, self.bottleneck_s(*found, M)
        for _ in range(STEPS):
            if hi - lo <= PRECISION * hi:
                break
            mid = (lo + hi) / 2
            attempt = self.cut(groups, M, mid)
            if attempt is None:
                lo = mid
            else:
                found = attempt
                hi = self.bottleneck_s(*found, M)
        return found

    def bottleneck_s(self, stages: list[list[int]], groups: list[GroupConfig], M: int) -> float:
        """The slowest stage's compute per microbatch."""
        return max(sum(self.costs(g, M)[0][layer] for layer in layers) for layers, g in zip(stages, groups))
