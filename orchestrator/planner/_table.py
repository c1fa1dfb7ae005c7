"""Per-(layer, group, microbatch count) costs from the cost model, in the form the ILP and enumeration read."""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from orchestrator.cluster import Link
from orchestrator.costs import CostModel, ParallelConfig, all_reduce_s, p2p_s
from orchestrator.planner._deadline import Deadline
from orchestrator.planner._groups import GroupConfig, TypeInfo, context_link, group_links, slowest


@dataclass(frozen=True, slots=True)
class Entry:
    """One layer in one group at one microbatch count, per microbatch and per device."""

    time_s: float  # forward + backward (+ recompute) + TP all-reduces + exposed context-parallel sends
    forward_s: float  # the forward part of time_s, its TP all-reduces and ring sends included
    static_bytes: float  # parameters, gradients, optimizer state
    activation_bytes: float  # kept per in-flight microbatch
    transient_bytes: float
    dp_sync_s: float
    optimizer_s: float
    # a mixed group's entry: one entry per part (its own memory, on its own type); the group's
    # memory fields are then NaN, so a reader that forgets the parts fails instead of using one
    parts: tuple[Entry, ...] = ()
    cp_form: str | None = None  # under context parallelism, an attention layer's ring or all-gather


class CostTable:
    """Lazily filled table of :class:`Entry` by (layer, group, M). With ``zero``, every group with
    data parallelism shards its optimizer state over its replicas (ZeRO-1).

    A mixed group's replicas on type k each take b_k samples of a microbatch of P samples
    (Σ_k dp_k·b_k = P, every b_k ≥ 1), chosen to balance the whole model's time Σ_ℓ τ_k(ℓ, b_k)
    between the two parts (``_balanced_shares``). Its parts meet after each layer's forward and after its backward, so
    a layer's forward is the slower part's forward, likewise the backward, and the time is their
    sum (an over-estimate where the parts would run apart; exact when one part is the slower in
    every layer). Gradient sync spans all its replicas over the slowest link between its types;
    memory is each part's own, on its own type.

    Within :meth:`bounded`, every entry it has to compute first checks the deadline: filling the
    table is the one part of a search no solver's time limit stops.
    """

    def __init__(
        self,
        model: CostModel,
        infos: dict[str, TypeInfo],
        global_batch: int,
        *,
        zero: bool = False,
        links: dict[tuple[str, str], Link] | None = None,
        sequence_parallel: bool = False,
        selective_recompute: bool = False,
        overlap_param_gather: bool = False,
        fsdp: bool = False,
    ):
        """``links``: the slowest link between two types (``pair_links``), needed for mixed groups;
        ``sequence_parallel``: every group with TP prices it (``ParallelConfig.sequence_parallel``);
        ``selective_recompute``, ``overlap_param_gather``: every group prices them (``ParallelConfig``);
        ``fsdp``: every group with data parallelism (``ParallelConfig.fsdp``)."""
        self.model, self.infos, self.global_batch, self.zero = model, infos, global_batch, zero
        self.sequence_parallel, self.selective_recompute = sequence_parallel, selective_recompute
        self.overlap_param_gather, self.fsdp = overlap_param_gather, fsdp
        self.links = links or {}
        self._entries: dict = {}
        self._shares: dict = {}
        # values computed from this table's entries alone, kept as long as the table (each keyed by
        # the module that builds it, e.g. ``_split.stage_costs``)
        self.derived: dict = {}
        self.deadline: Deadline | None = None
        # identical layers (same signature and output size) share every entry
        first: dict = {}
        self._representative = [
            first.setdefault((layer.signature, layer.activation_bytes), index)
            for index, layer in enumerate(model.layers)
        ]

    @contextlib.contextmanager
    def bounded(self, deadline: Deadline | None) -> Iterator[None]:
        """Within the block, computing an entry past ``deadline`` raises ``DeadlineExceeded``
        (entries already computed are still read)."""
        outer, self.deadline = self.deadline, deadline
        try:
            yield
        finally:
            self.deadline = outer

    def microbatch(self, group: GroupConfig, microbatches: int) -> int | None:
        """Samples per replica per microbatch (a mixed group's first part's), or None if the
        batch does not divide."""
        shares = self.shares(group, microbatches)
        return None if shares is None else shares[0]

    def shares(self, group: GroupConfig, microbatches: int) -> tuple[int, ...] | None:
        """Samples per replica per microbatch on each part of the group (one for a group of one
        type), or None if the batch does not divide."""
        per_microbatch, rest = divmod(self.global_batch, microbatches)
        if rest:
            return None
        if not group.mixed:
            return None if per_microbatch % group.dp else (per_microbatch // group.dp,)
        key = (group, microbatches)
        if key not in self._shares:
            self._shares[key] = self._balanced_shares(group, per_microbatch)
        return self._shares[key]

    def _balanced_shares(self, group: GroupConfig, samples: int) -> tuple[int, ...] | None:
        """The (b0, b1) with dp0·b0 + dp1·b1 = samples, both ≥ 1, that balances the two parts' time
        over the whole model: each part's time per sample is read at the equal split, b0 is
        set in proportion to the speeds, and of the valid b0 just below and above it (they step
        by dp1 / gcd(dp0, dp1)) the one whose slower part is faster is kept."""
        (first, n0), (second, n1) = group.parts
        dp0, dp1 = n0 // group.tp, n1 // group.tp
        valid = [b0 for b0 in range(1, samples // dp0 + 1) if (samples - dp0 * b0) % dp1 == 0 and samples > dp0 * b0]
        if not valid:
            return None
        counts = Counter(self._representative)  # identical layers cost the same: one call per kind

        def time_s(kind: str, b: int) -> float:
            return sum(n * self._compute_s(layer, group, kind, b) for layer, n in counts.items())

        even = max(1, samples // (dp0 + dp1))
        per_sample = [time_s(kind, even) / even for kind in (first, second)]
        ideal = samples / (dp0 + dp1 * per_sample[0] / per_sample[1]) if per_sample[1] > 0 else valid[-1]
        below = [b0 for b0 in valid if b0 <= ideal]
        above = [b0 for b0 in valid if b0 > ideal]
        nearby = ([below[-1]] if below else []) + ([above[0]] if above else [])

        def slower(b0: int) -> float:
            return max(time_s(first, b0), time_s(second, (samples - dp0 * b0) // dp1))

        best = min(nearby, key=lambda b0: (slower(b0), b0))
        return best, (samples - dp0 * best) // dp1

    def _compute_s(self, layer: int, group: GroupConfig, kind: str, samples: int) -> float:
        """Forward + backward + TP all-reduces of one layer on one part: independent of the data-parallel
        degree, so shared by every mixed group with the same tp and recompute."""
        key = ("compute", layer, kind, group.tp, group.recompute, samples)
        if key not in self._entries:
            single = GroupConfig(device_type=kind, size=group.tp, tp=group.tp, recompute=group.recompute)
            self._entries[key] = self._part(layer, single, kind, samples).time_s
        return self._entries[key]

    def entry(self, layer: int, group: GroupConfig, microbatches: int) -> Entry:
        layer = self._representative[layer]
        key = (layer, group, microbatches)
        if key not in self._entries:
            shares = self.shares(group, microbatches)
            if not group.mixed:
                self._entries[key] = self._part(layer, group, group.device_type, shares[0])
            else:
                parts = tuple(self._part(layer, group, kind, b) for (kind, _), b in zip(group.parts, shares))
                forward = max(p.forward_s for p in parts)
                nan = math.nan
                self._entries[key] = Entry(
                    time_s=forward + max(p.time_s - p.forward_s for p in parts),
                    forward_s=forward,
                    static_bytes=nan,
                    activation_bytes=nan,
                    transient_bytes=nan,
                    dp_sync_s=max(p.dp_sync_s for p in parts),
                    optimizer_s=max(p.optimizer_s for p in parts),
                    parts=parts,
                )
        return self._entries[key]

    def memory_parts(self, layer: int, group: GroupConfig, microbatches: int) -> list[tuple[float, Entry]]:
        """(device memory, entry) of each part of the group: one pair for a group of one type."""
        entry = self.entry(layer, group, microbatches)
        if not group.mixed:
            return [(self.infos[group.device_type].memory_bytes, entry)]
        return [(self.infos[kind].memory_bytes, part) for (kind, _), part in zip(group.parts, entry.parts)]

    def _part(self, layer: int, group: GroupConfig, kind: str, samples: int) -> Entry:
        """One device type's replicas of ``group`` at ``samples`` per replica per microbatch."""
        key = ("part", self._representative[layer], group, kind, samples)
        if key in self._entries:
            return self._entries[key]
        if self.deadline is not None:
            self.deadline.check()
        info = self.infos[kind]
        if group.mixed:  # tensor parallelism within a host; the replicas span both types
            tp_link = info.intra_link
            dp_link = slowest([self.links[t, t2] for t in group.by_type for t2 in group.by_type])
        else:
            tp_link, dp_link = group_links(group, info)
        # a ring's link only where there is a ring: stand-in cost models (the bench's synthetic one) take no cp_link
        links = {"tp_link": tp_link, "dp_link": dp_link} | (
            {"cp_link": context_link(group, info)} if group.cp > 1 else {}
        )
        config = ParallelConfig(
            tp=group.tp,
            dp=group.dp,
            microbatch_size=samples,
            recompute=group.recompute,
            zero=self.zero and group.dp > 1,
            fsdp=self.fsdp and group.dp > 1,
            sequence_parallel=self.sequence_parallel and group.tp > 1,
            selective_recompute=self.selective_recompute,
            overlap_param_gather=self.overlap_param_gather,
            context_parallel=group.cp,
        )
        cost = self.model.layer_cost(layer, kind, config, **links)
        tp_forward_s = all_reduce_s(cost.breakdown.get("tp_forward_bytes", 0.0), group.tp, tp_link)
        self._entries[key] = Entry(
            time_s=cost.forward_s + cost.backward_s + cost.tp_comm_s + cost.cp_comm_s,
            forward_s=cost.forward_s + tp_forward_s + cost.breakdown.get("cp_forward_s", 0.0),
            static_bytes=cost.param_bytes + cost.grad_bytes + cost.optimizer_bytes,
            activation_bytes=cost.activation_bytes,
            transient_bytes=cost.transient_bytes,
            dp_sync_s=cost.dp_sync_s,
            optimizer_s=cost.optimizer_s,
            cp_form=cost.cp_form,
        )
        return self._entries[key]

    def needs_context_parallel(self, groups: list[GroupConfig]) -> set[str]:
        """The device types on which some layer fits no device of any of ``groups`` (one type, no
        context parallelism) at one sample per microbatch: where only splitting the sequence can
        help. Priced per kind of layer and type until a (tp, recompute) fits, straight from the cost
        model: these prices are no entries of the table."""
        options: dict[str, set[tuple[int, bool]]] = {}
        for group in groups:
            if not group.mixed and group.cp == 1:
                options.setdefault(group.device_type, set()).add((group.tp, group.recompute))
        needed = set()
        for kind, choices in options.items():
            # the likeliest fit first (the most tensor parallelism, recomputing): most layers stop there
            order = sorted(choices, key=lambda choice: (-choice[0], not choice[1]))
            for layer in sorted(set(self._representative)):
                if not any(self._fits_alone(layer, kind, tp, recompute) for tp, recompute in order):
                    needed.add(kind)
                    break
        return needed

    def _fits_alone(self, layer: int, kind: str, tp: int, recompute: bool) -> bool:
        """Whether ``layer`` fits one ``kind`` device at one sample per microbatch under ``tp`` and ``recompute``."""
        if self.deadline is not None:
            self.deadline.check()
        info = self.infos[kind]
        config = ParallelConfig(tp=tp, microbatch_size=1, recompute=recompute)
        cost = self.model.layer_cost(layer, kind, config, tp_link=info.intra_link, dp_link=info.intra_link)
        return cost.memory_bytes() <= info.memory_bytes

    def state_bytes(self, layer: int, device_type: str) -> float:
        """Parameters and optimizer state of ``layer``, unsharded: what moving it moves."""
        layer = self._representative[layer]
        key = ("state", layer, device_type)
        if key not in self._entries:
            if self.deadline is not None:
                self.deadline.check()
            group = GroupConfig(device_type=device_type, size=1, tp=1, recompute=False)
            tp_link, dp_link = group_links(group, self.infos[device_type])
            config = ParallelConfig(tp=1, dp=1, microbatch_size=1, recompute=False)
            cost = self.model.layer_cost(layer, device_type, config, tp_link=tp_link, dp_link=dp_link)
            self._entries[key] = cost.param_bytes + cost.optimizer_bytes
        return self._entries[key]

    def p2p_s(self, layer: int, microbatches: int, link, devices: int = 1) -> float:
        """Activation out of ``layer`` forward and its gradient back, for one microbatch."""
        return 2 * self.send_s(layer, microbatches, link, devices)

    def send_s(self, layer: int, microbatches: int, link, devices: int = 1) -> float:
        """One direction: ``layer``'s output activation for one microbatch, sent by ``devices`` devices at once.

        Each data-parallel replica sends its own samples and, split over its tensor-parallel ranks
        (Megatron-LM's scatter before the send, gather after it), each rank its 1/tp of them, every
        device over its own link: the microbatch's bytes / ``devices`` cross one link. ``devices``
        is the smaller of the two stages' device counts (the side with fewer links sets the pace).
        """
        nbytes = self.model.layers[layer].activation_bytes * (self.global_batch / microbatches) / self.model.batch_size
        return p2p_s(nbytes / devices, link)


def per_run(table: CostTable, runs, groups: list[GroupConfig], microbatches: int, field: str) -> np.ndarray:
    """[r, g]: ``field`` of the :class:`Entry` of run r's layers (all alike) on group g at M microbatches."""
    return np.array(
        [[getattr(table.entry(run.first, g, microbatches), field) for g in groups] for run in runs], dtype=float
    ).reshape(len(runs), len(groups))
