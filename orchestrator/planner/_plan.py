"""The result of planning: pipeline stages with their devices and parallel degrees, and the predicted time."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

Schedule = Literal["gpipe", "1f1b"]

PricingOption = Literal["zero", "fsdp", "sequence_parallel", "selective_recompute", "overlap_param_gather"]
PRICING_OPTIONS: tuple[PricingOption, ...] = (
    "zero",
    "fsdp",
    "sequence_parallel",
    "selective_recompute",
    "overlap_param_gather",
)
"""The options a search prices every stage with (``plan()``'s keywords of the same names)."""


class PlanInfeasible(ValueError):
    """No plan fits: the message names the binding constraint and what would make one exist."""


class PlanNotFound(RuntimeError):
    """The time limit ran out before a plan was found or proven impossible."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    """One pipeline stage.

    Attributes:
      layers: indices of its (contiguous) layers.
      device_type: the type of all its devices; for a stage on two types, their names joined
        by "+" (``"a100+v100"``), with ``parts`` and ``shares`` set.
      devices: device refs (``host/index``), tp·dp of them, replica-major: data-parallel
        replica r is ``devices[r·tp:(r+1)·tp]``, one tensor-parallel group inside one host
        (on two types: the first type's replicas, then the second's).
      tp, dp: tensor- and data-parallel degrees.
      cp: context-parallel degree: each replica splits its sequences over cp·tp devices,
        ``devices[r·tp·cp:(r+1)·tp·cp]``, the tensor-parallel groups of its ring positions in ring order.
      cp_form: under cp > 1, how its attention runs, ``"ring"`` or ``"all_gather"``: the form the
        cost model priced (``orchestrator.costs.context_parallel_cost``); None without attention or cp.
      recompute: whether it recomputes its forward pass in the backward pass.
      zero: whether its optimizer state is sharded over its data-parallel replicas (ZeRO-1).
      fsdp: whether its parameters, gradients and optimizer state are all sharded over its
        data-parallel replicas, each layer's parameters gathered where used (ZeRO-3).
      sequence_parallel: whether, under tensor parallelism, the work it leaves whole is split
        over the tensor-parallel ranks along the sequence.
      selective_recompute: whether its backward rebuilds each layer's core attention instead of
        keeping it (``recompute``, the whole forward, takes precedence).
      microbatch_size: samples per microbatch on each data-parallel replica (on two types: on
        each replica of the first).
      parts: on two types, ((type, devices), (type, devices)); else empty.
      shares: on two types, the samples per microbatch on each replica of each part (the faster
        type takes more); else empty.
      time_s: seconds per microbatch: forward + backward (compute and TP
        communication) + sending the activation to the next stage and
        receiving its gradient back (``2 · send_s``).
      memory_bytes: predicted peak per device.
      forward_s: the forward part of ``time_s`` (compute + TP all-reduces);
        the backward part is ``time_s − forward_s − 2 · send_s``.
      send_s: one point-to-point transfer of this stage's output activation
        (one microbatch) to the next stage; the gradient coming back costs the
        same. For the last stage: under virtual stages the transfer from its
        chunks to the first stage's next chunks (the wrap), else 0.
      dp_sync_s: data-parallel gradient synchronisation, once per step.
      optimizer_s: the optimizer update, once per step.
    """

    layers: tuple[int, ...]
    device_type: str
    devices: tuple[str, ...]
    tp: int
    dp: int
    recompute: bool
    microbatch_size: int
    time_s: float
    memory_bytes: float
    forward_s: float = 0.0
    send_s: float = 0.0
    dp_sync_s: float = 0.0
    optimizer_s: float = 0.0
    zero: bool = False
    cp: int = 1
    cp_form: str | None = None
    fsdp: bool = False
    sequence_parallel: bool = False
    selective_recompute: bool = False
    parts: tuple[tuple[str, int], ...] = ()
    shares: tuple[int, ...] = ()

    @property
    def devices_text(self) -> str:
        """``"16 × a100"``, or ``"8 × a100 + 8 × v100"`` on two types."""
        return " + ".join(f"{n} × {kind}" for kind, n in (self.parts or ((self.device_type, len(self.devices)),)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Coverage:
    """The search space a plan's certified gap covers: no plan in it is faster than ``Plan.bound``.

    Attributes:
      microbatches: the microbatch counts M searched.
      max_stages: the deepest pipeline searched.
      groups: every stage configuration searched, as (device type, devices, tp, recompute), with a
        fifth entry, cp, for a context-parallel one; a stage of a plan in the space is one of them,
        at any position.
      virtual_stages: the virtual-stage counts v (interleaved 1F1B chunks per stage) the bound
        holds over: (1,) where the search bounds plain schedules only (the ILP's rows), 1..v_max
        where the plan was asked to interleave under 1F1B, v_max the most chunks a plan of the model
        can take (its bound then is also below the capacity LP's over interleaved plans:
        ``_interleaved_bound``; docs/planner.md, "Virtual stages").
      options: the pricing options every stage of the space is priced with, in
        :data:`PRICING_OPTIONS` order (a stage applies each where it has the degree it needs: ZeRO and
        FSDP under data parallelism, sequence parallelism under tensor parallelism); a configuration
        priced with other options lies in another space.
    """

    microbatches: tuple[int, ...]
    max_stages: int
    groups: tuple[tuple[str, int, int, bool], ...]
    virtual_stages: tuple[int, ...] = (1,)
    options: tuple[PricingOption, ...] = ()

    def contains(
        self,
        *,
        microbatches: int,
        stages: Sequence[tuple[str, int, int, bool]],
        virtual_stages: int = 1,
        options: Sequence[str] = (),
    ) -> bool:
        """Whether a plan of ``stages`` (one (type, devices, tp, recompute) each) at ``microbatches``
        and ``virtual_stages``, priced with ``options`` (names of :data:`PRICING_OPTIONS`), lies in
        this space. ValueError names an option that is not a pricing option."""
        for name in options:
            _option(name, "options")
        known = set(self.groups)
        return (
            microbatches in self.microbatches
            and virtual_stages in self.virtual_stages
            and set(options) == set(self.options)
            and 1 <= len(stages) <= self.max_stages
            and all(tuple(stage) in known for stage in stages)
        )

    @classmethod
    def from_json(cls, data: dict) -> Coverage:
        """The space a plan file records; ValueError names a field that no search could have written."""
        for m in data["microbatches"]:
            _count(m, "microbatches")
        _count(data["max_stages"], "max_stages")
        for v in data.get("virtual_stages", (1,)):
            _count(v, "virtual_stages")
        for name in data.get("options", ()):
            _option(name, "options")
        for group in data["groups"]:
            if not 4 <= len(group) <= 5 or not isinstance(group[0], str) or not isinstance(group[3], bool):
                raise ValueError(f"groups: {group!r} is not [device type, devices, tp, recompute(, cp)]")
            for number in group[1:3] + group[4:]:
                _count(number, "groups")
        return cls(
            microbatches=tuple(data["microbatches"]),
            max_stages=data["max_stages"],
            groups=tuple((kind, size, tp, rc, *cp) for kind, size, tp, rc, *cp in data["groups"]),
            virtual_stages=tuple(data.get("virtual_stages", (1,))),
            options=tuple(name for name in PRICING_OPTIONS if name in data.get("options", ())),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A training-step plan and what it is predicted to cost.

    Attributes:
      stages: in pipeline order.
      schedule: "gpipe" or "1f1b".
      microbatches: M, microbatches per step.
      virtual_stages: v, model chunks per stage: 1, or interleaved 1F1B (Narayanan et al. 2021,
        §2.2.2; Megatron-LM's virtual pipeline stages) with v > 1, where stage s runs chunk c as
        virtual stage c·S + s, each chunk 1/v of its layers and of its per-microbatch time
        (``simulate.chunk_order`` gives the order; M must be a multiple of the stage count).
      global_batch: samples per step.
      iteration_s: predicted step time; ``breakdown`` splits it.
      solver, status, objective, bound, gap, solve_s: how the plan was found; ``bound`` holds over
        ``space`` and ``gap`` = (iteration_s − bound) / iteration_s. ``status`` is "Optimal" at or
        below the gap asked, "Optimal over plain schedules" where only the search's bound over
        v = 1 is (the space's holds v ≤ v_max, whose bound is weaker), else "Time limit reached".
      notes: which constraints bind and why each stage sits where it does.
      space: the search space the certified ``gap`` covers (:class:`Coverage`; None for a plan
        whose bound covers less, such as an uncertified repair).
      source: what the plan was made for, when known (``recipe``, ``cluster``, ``seq``, and
        ``cluster_spec``, the cluster itself as its YAML mapping), so ``orchestrator simulate``,
        ``report`` and ``train --plan`` can rebuild its cost model from any directory.
    """

    stages: tuple[Stage, ...]
    schedule: Schedule
    microbatches: int
    global_batch: int
    iteration_s: float
    virtual_stages: int = 1
    breakdown: dict[str, float] = field(default_factory=dict)
    solver: str = ""
    status: str = ""
    objective: float = 0.0
    bound: float = 0.0
    gap: float = 0.0
    solve_s: float = 0.0
    notes: tuple[str, ...] = ()
    space: Coverage | None = None
    source: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        data = asdict(self)
        data["stages"] = [
            {
                **asdict(s),
                "layers": list(s.layers),
                "devices": list(s.devices),
                "parts": [list(part) for part in s.parts],
                "shares": list(s.shares),
            }
            for s in self.stages
        ]
        data["notes"] = list(self.notes)
        if self.space is not None:
            data["space"] = {
                "microbatches": list(self.space.microbatches),
                "max_stages": self.space.max_stages,
                "groups": [list(group) for group in self.space.groups],
                "virtual_stages": list(self.space.virtual_stages),
                "options": list(self.space.options),
            }
        return data

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        stages = tuple(
            Stage(
                **{
                    **s,
                    "layers": tuple(s["layers"]),
                    "devices": tuple(s["devices"]),
                    "parts": tuple((kind, n) for kind, n in s.get("parts", ())),
                    "shares": tuple(s.get("shares", ())),
                }
            )
            for s in data["stages"]
        )
        try:
            space = Coverage.from_json(data["space"]) if data.get("space") else None
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"space: not a search space ({err!r})") from None
        notes = tuple(data.get("notes", ()))
        return _checked(cls(**{**data, "stages": stages, "notes": notes, "space": space}))

    def explain(self) -> str:
        """A table of the stages and the predicted step time, as text (rich renders it)."""
        from rich.console import Console
        from rich.table import Table

        schedule = (
            self.schedule if self.virtual_stages == 1 else f"interleaved 1f1b, {self.virtual_stages} virtual stages"
        )
        table = Table(title=f"{len(self.stages)} stage(s), {self.microbatches} microbatch(es), {schedule}")
        for column in (
            "stage",
            "layers",
            "devices",
            "tp",
            "dp",
            "recompute",
            "microbatch",
            "time/microbatch",
            "memory/device",
        ):
            table.add_column(column, justify="left" if column in ("layers", "devices") else "right")
        bottleneck = max(s.time_s for s in self.stages)
        for i, s in enumerate(self.stages):
            marker = " ◀ bottleneck" if s.time_s == bottleneck and len(self.stages) > 1 else ""
            table.add_row(
                str(i),
                f"{s.layers[0]}–{s.layers[-1]}" if len(s.layers) > 1 else str(s.layers[0]),
                s.devices_text,
                str(s.tp) if s.cp == 1 else f"{s.tp} (cp {s.cp})",
                f"{s.dp} (ZeRO)" if s.zero else str(s.dp),
                "yes" if s.recompute else "no",
                "/".join(map(str, s.shares)) if s.shares else str(s.microbatch_size),
                f"{s.time_s * 1e3:.2f} ms{marker}",
                f"{s.memory_bytes / 1e9:.2f} GB",
            )
        buffer = io.StringIO()
        console = Console(file=buffer, width=120)
        console.print(table)
        parts = ", ".join(f"{k.removesuffix('_s')} {v * 1e3:.1f} ms" for k, v in self.breakdown.items())
        console.print(f"predicted step {self.iteration_s * 1e3:.1f} ms ({parts})")
        console.print(
            f"{self.solver} {self.status}: objective {self.objective:.6g}, bound {self.bound:.6g}, "
            f"gap {self.gap:.2%}, {self.solve_s:.1f} s"
        )
        for note in self.notes:
            console.print(f"• {note}")
        return buffer.getvalue()

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(json.loads(Path(path).read_text()))


def _count(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


def _option(value, name: str) -> None:
    if value not in PRICING_OPTIONS:
        raise ValueError(f"{name}: {value!r} is not one of {', '.join(PRICING_OPTIONS)}")


def _amount(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _checked(plan: Plan) -> Plan:
    """``plan`` if every field read from JSON is what a plan can hold, else ValueError naming the field.

    JSON carries no types, and Python's parser reads ``Infinity`` and ``NaN``: a plan file edited by hand
    or cut short must fail here, in one line, not as a step time of nan or a mesh of 2.5 devices.
    """
    if plan.schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"schedule must be gpipe or 1f1b, got {plan.schedule!r}")
    _count(plan.microbatches, "microbatches")
    _count(plan.global_batch, "global_batch")
    _count(plan.virtual_stages, "virtual_stages")
    if plan.virtual_stages > 1 and (
        plan.schedule != "1f1b" or len(plan.stages) < 2 or plan.microbatches % len(plan.stages)
    ):
        raise ValueError(
            f"virtual_stages {plan.virtual_stages} needs the 1f1b schedule, at least 2 stages and microbatches "
            f"divisible by them, got {plan.schedule}, {len(plan.stages)} stage(s), {plan.microbatches} microbatches"
        )
    for name in ("iteration_s", "objective", "bound", "gap", "solve_s"):
        _amount(getattr(plan, name), name)
    if not isinstance(plan.breakdown, dict) or not isinstance(plan.source, dict):
        raise ValueError("breakdown and source must be JSON objects")
    for key, value in plan.breakdown.items():
        _amount(value, f"breakdown.{key}")
    if not plan.stages:
        raise ValueError("stages: a plan has at least one stage")
    seen: set[str] = set()
    for i, stage in enumerate(plan.stages):
        where = f"stages[{i}]"
        for name in ("tp", "dp", "cp", "microbatch_size"):
            _count(getattr(stage, name), f"{where}.{name}")
        for name in ("time_s", "memory_bytes", "forward_s", "send_s", "dp_sync_s", "optimizer_s"):
            _amount(getattr(stage, name), f"{where}.{name}")
        if not stage.layers or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in stage.layers):
            raise ValueError(f"{where}.layers must be a non-empty list of layer indices, got {list(stage.layers)!r}")
        if stage.cp_form not in (None, "ring", "all_gather"):
            raise ValueError(f"{where}.cp_form must be ring, all_gather or null, got {stage.cp_form!r}")
        size = stage.tp * stage.cp * stage.dp
        if not all(isinstance(ref, str) for ref in stage.devices) or len(stage.devices) != size:
            raise ValueError(f"{where}.devices must be tp·cp·dp = {size} device refs, got {len(stage.devices)}")
        if seen & set(stage.devices) or len(set(stage.devices)) != len(stage.devices):
            raise ValueError(f"{where}.devices: a device appears twice in the plan")
        seen |= set(stage.devices)
    return plan
