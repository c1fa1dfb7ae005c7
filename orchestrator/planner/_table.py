"""Per-(layer, group, microbatch count) costs from the cost model, in the form the ILP and enumeration read."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.costs import CostModel, ParallelConfig, all_reduce_s, p2p_s
from orchestrator.planner._groups import GroupConfig, TypeInfo, group_links


@dataclass(frozen=True, slots=True)
class Entry:
    """One layer in one group at one microbatch count, per microbatch and per device."""

    time_s: float  # forward + backward (+ recompute) + TP all-reduces
    forward_s: float  # the forward part of time_s, its TP all-reduces included
    static_bytes: float  # parameters, gradients, optimizer state
    activation_bytes: float  # kept per in-flight microbatch
    transient_bytes: float
    dp_sync_s: float
    optimizer_s: float


class CostTable:
    """Lazily filled table of :class:`Entry` by (layer, group, M). With ``zero``, every group with
    data parallelism shards its optimizer state over its replicas (ZeRO-1)."""

    def __init__(self, model: CostModel, infos: dict[str, TypeInfo], global_batch: int, *, zero: bool = False):
        self.model, self.infos, self.global_batch, self.zero = model, infos, global_batch, zero
        self._entries: dict = {}
        # identical layers (same signature and output size) share every entry
        first: dict = {}
        self._representative = [
            first.setdefault((layer.signature, layer.activation_bytes), index)
            for index, layer in enumerate(model.layers)
        ]

    def microbatch(self, group: GroupConfig, microbatches: int) -> int | None:
        """Samples per replica per microbatch, or None if the batch does not divide."""
        per_microbatch, rest = divmod(self.global_batch, microbatches)
        if rest or per_microbatch % group.dp:
            return None
        return per_microbatch // group.dp

    def entry(self, layer: int, group: GroupConfig, microbatches: int) -> Entry:
        layer = self._representative[layer]
        key = (layer, group, microbatches)
        if key not in self._entries:
            m = self.microbatch(group, microbatches)
            info = self.infos[group.device_type]
            tp_link, dp_link = group_links(group, info)
            config = ParallelConfig(
                tp=group.tp, dp=group.dp, microbatch_size=m, recompute=group.recompute, zero=self.zero and group.dp > 1
            )
            cost = self.model.layer_cost(layer, group.device_type, config, tp_link=tp_link, dp_link=dp_link)
            tp_forward_s = all_reduce_s(cost.breakdown.get("tp_forward_bytes", 0.0), group.tp, tp_link)
            self._entries[key] = Entry(
                time_s=cost.forward_s + cost.backward_s + cost.tp_comm_s,
                forward_s=cost.forward_s + tp_forward_s,
                static_bytes=cost.param_bytes + cost.grad_bytes + cost.optimizer_bytes,
                activation_bytes=cost.activation_bytes,
                transient_bytes=cost.transient_bytes,
                dp_sync_s=cost.dp_sync_s,
                optimizer_s=cost.optimizer_s,
            )
        return self._entries[key]

    def state_bytes(self, layer: int, device_type: str) -> float:
        """Parameters and optimizer state of ``layer``, unsharded: what moving it moves."""
        layer = self._representative[layer]
        key = ("state", layer, device_type)
        if key not in self._entries:
            group = GroupConfig(device_type=device_type, size=1, tp=1, recompute=False)
            tp_link, dp_link = group_links(group, self.infos[device_type])
            config = ParallelConfig(tp=1, dp=1, microbatch_size=1, recompute=False)
            cost = self.model.layer_cost(layer, device_type, config, tp_link=tp_link, dp_link=dp_link)
            self._entries[key] = cost.param_bytes + cost.optimizer_bytes
        return self._entries[key]

    def p2p_s(self, layer: int, microbatches: int, link) -> float:
        """Activation out of ``layer`` forward and its gradient back, for one microbatch."""
        return 2 * self.send_s(layer, microbatches, link)

    def send_s(self, layer: int, microbatches: int, link) -> float:
        """One direction: ``layer``'s output activation for one microbatch (the whole microbatch, all replicas)."""
        nbytes = self.model.layers[layer].activation_bytes * (self.global_batch / microbatches) / self.model.batch_size
        return p2p_s(nbytes, link)
