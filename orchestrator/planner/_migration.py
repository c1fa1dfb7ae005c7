"""What moving state costs when a plan changes: the migration term of re-planning.

A layer whose parameters and optimizer state sit on a surviving stage of the previous plan
stays put when the new plan puts it at the same pipeline position (counted from the end)
with the same device group — that stage is then given the same devices. Any other such layer
moves its state, ``state_bytes`` (parameters + optimizer moments, unsharded), over the slowest
link from the old stage's device type to any type. Layers of lost stages come back from the
checkpoint wherever they go, so they cost the same in every plan and are left out.

Amortised over ``horizon_steps`` training steps, the term added to the step time is

    migration = Σ_{kept stage k} Σ_{run r} κ_{k,r} · (n_{k,r} − stay_{k,r}) / horizon_steps

with n_{k,r} the layers of run r on stage k, κ_{k,r} one such layer's state over that link,
and stay_{k,r} ≤ n_{k,r}, stay_{k,r} ≤ y[r, j_k, g_k] in the ILP (the layers of r the new
plan keeps at position j_k on group g_k); in a concrete plan stay = min of the two counts.
Positions, not devices, decide what stays: a kept group that shifts to another position is
charged as moved even when allocation happens to give it the same devices (an over-estimate
that only makes re-planning more conservative).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pulp

from orchestrator.planner._groups import GroupConfig, stage_group
from orchestrator.planner._ilp import MS, StageModel
from orchestrator.planner._plan import Plan


@dataclass(frozen=True, slots=True)
class KeptStage:
    """A previous stage whose devices all survive."""

    position: int  # from the end of the previous pipeline
    group: GroupConfig
    layers: tuple[int, ...]
    devices: tuple[str, ...]
    seconds_per_byte: float  # over the slowest link out of its device type

    @property
    def state_type(self) -> str:
        """A device type of the stage: its state's bytes (unsharded) are the same on any."""
        return next(iter(self.group.by_type))


@dataclass(frozen=True, slots=True)
class Migration:
    """The previous plan's surviving stages and the horizon the moves are amortised over."""

    kept: tuple[KeptStage, ...]
    horizon_steps: int

    @classmethod
    def from_plan(cls, previous: Plan, model, links, horizon_steps: int) -> Migration:
        """``links[(t, t2)]``: the slowest link from type t to type t2 (``pair_links``)."""
        if horizon_steps < 1:
            raise ValueError(f"horizon_steps must be >= 1, got {horizon_steps}")
        alive = {d.ref for d in model.cluster.devices()}
        S = len(previous.stages)
        kept = []
        for s, stage in enumerate(previous.stages):
            if not set(stage.devices) <= alive:
                continue
            out = [link for (t, _), link in links.items() if t == stage.device_type]
            if not out:
                continue
            slowest = min(out, key=lambda link: link.bandwidth_bytes_per_s)
            kept.append(
                KeptStage(
                    S - 1 - s, stage_group(stage), stage.layers, stage.devices, 1.0 / slowest.bandwidth_bytes_per_s
                )
            )
        return cls(tuple(kept), horizon_steps)

    def prefer_devices(self) -> list[tuple[str, ...] | None]:
        """Devices by position from the end: kept stages keep theirs."""
        prefer: list[tuple[str, ...] | None] = [None] * (max((k.position for k in self.kept), default=-1) + 1)
        for k in self.kept:
            prefer[k.position] = k.devices
        return prefer

    def step_cost_s(self, stages: list[list[int]], groups: list[GroupConfig], table, signatures: list) -> float:
        """The amortised term for a concrete plan (stages in pipeline order); ``signatures[layer]``
        tells identical layers (the ILP's runs), which are interchangeable."""
        S = len(stages)
        total = 0.0
        for k in self.kept:
            s = S - 1 - k.position
            same = 0 <= s < S and groups[s] == k.group
            now = Counter(signatures[layer] for layer in stages[s]) if same else Counter()
            for signature, count in Counter(signatures[layer] for layer in k.layers).items():
                layer = next(layer for layer in k.layers if signatures[layer] == signature)
                moved = count - min(count, now[signature])
                total += moved * table.state_bytes(layer, k.state_type) * k.seconds_per_byte
        return total / self.horizon_steps

    def add_to(self, sub: StageModel) -> None:
        """stay variables and the term in ``sub``'s objective (ms)."""
        run_of = {layer: r for r, run in enumerate(sub.runs) for layer in run.layers}
        term = []
        for k in self.kept:
            if k.position >= sub.J or k.group not in sub.groups:
                stay_possible = False
            else:
                stay_possible = True
                g = sub.groups.index(k.group)
            for r, count in Counter(run_of[layer] for layer in k.layers).items():
                first = sub.runs[r].first
                kappa = sub.table.state_bytes(first, k.state_type) * k.seconds_per_byte * MS / self.horizon_steps
                if not stay_possible:
                    term.append(kappa * count)
                    continue
                stay = sub.lp.add_variable(f"stay_{k.position}_{r}", 0, count)
                sub.lp += stay <= sub.y[r, k.position, g], f"stay_within_{k.position}_{r}"
                sub.stays.append((stay, sub.y[r, k.position, g], count))
                term.append(kappa * (count - stay))
        sub.migration = pulp.lpSum(term)
        sub.lp.setObjective(sub.step + sub.migration)
