"""Slow devices as the planner sees them: a device type of their own, and plans priced under it.

The cost model knows device types, not devices. A device d that runs f_d times slower than
its type (f_d = 1: as profiled) is given a type of its own: devices of one host with equal
f ≠ 1 that follow each other become a host ``host[i:j]`` of type ``"<type> ×f"`` whose peaks
are the base type's ÷ f (``slowed_cluster``), and :class:`SlowedCosts` prices a layer on it
as on the base type with compute × f:

    forward_s, backward_s, optimizer_s  ← base · f        (communication unchanged)

Device refs change with the cluster (``localhost/5`` becomes ``localhost[4:8]/1``) but
positions do not, so ``translate`` renames a plan's devices by position and ``device_map``
still resolves them to the same jax devices. ``price`` recomputes a plan's stage times under
a model, so two plans can be compared under the same costs (``simulate`` replays them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from orchestrator.cluster import Cluster, DeviceType
from orchestrator.costs import ParallelConfig, all_reduce_s, p2p_s
from orchestrator.simulate import simulate


def slowed_cluster(
    base: Cluster, factors: Mapping[int, float]
) -> tuple[Cluster, list[str], dict[str, tuple[str, float]]]:
    """``base`` with each device's speed factor (by position in ``base.all_devices()``) as device types.

    Devices of one host with equal factors ≠ 1 that follow each other form a host of their own
    (``host[i:j]``, type ``"<type> ×f"``, peaks ÷ f); hosts split this way keep their link between
    the pieces. Devices keep their order, so ``device_map`` still matches them to jax's devices.

    Args:
      base: the cluster as profiled.
      factors: device position → how many times slower it runs than its type (missing: 1).

    Returns:
      ``(cluster, refs, slowed)``: the cluster, its device refs by position, and slowed type →
      (base type, factor).

    Example:
      >>> from orchestrator.cluster import load_cluster
      >>> cluster, refs, slowed = slowed_cluster(load_cluster("mixed-a100-v100"), {0: 2.0, 1: 2.0})
      >>> refs[:3], slowed, cluster.counts_by_type()
      (['a100-0[0:2]/0', 'a100-0[0:2]/1', 'a100-0[2:8]/0'], {'a100 ×2': ('a100', 2.0)}, {'a100 ×2': 2, 'a100': 14, 'v100': 16})
    """
    hosts, overrides, types, slowed, refs = [], dict(base.overrides), dict(base.device_types), {}, []
    position = 0
    for host in base.hosts:
        mine = [round(factors.get(position + i, 1.0), 3) for i in range(host.count)]
        if all(f == 1.0 for f in mine):
            hosts.append(host)
            refs += [f"{host.name}/{i}" for i in range(host.count)]
            position += host.count
            continue
        pieces, start = [], 0
        for i in range(1, host.count + 1):
            if i == host.count or mine[i] != mine[start]:
                pieces.append((start, i, mine[start]))
                start = i
        names = []
        for start, end, f in pieces:
            kind = host.device_type
            if f != 1.0:
                kind = f"{host.device_type} ×{f:g}"
                dtype = base.device_types[host.device_type]
                types[kind] = DeviceType(
                    name=kind,
                    peak_flops={k: v / f for k, v in dtype.peak_flops.items()},
                    memory_bytes=dtype.memory_bytes,
                    memory_bandwidth_bytes_per_s=dtype.memory_bandwidth_bytes_per_s / f,
                )
                slowed[kind] = (host.device_type, f)
            name = f"{host.name}[{start}:{end}]"
            names.append(name)
            hosts.append(dataclasses.replace(host, name=name, device_type=kind, count=end - start))
            refs += [f"{name}/{i}" for i in range(end - start)]
        for a in names:
            for b in names:
                if a < b:
                    overrides[frozenset((a, b))] = host.intra_link
        position += host.count
    old_refs = [d.ref for d in base.all_devices()]
    unavailable = frozenset(refs[old_refs.index(r)] for r in base.unavailable if r in old_refs)
    cluster = Cluster(
        name=base.name,
        device_types=types,
        hosts=tuple(hosts),
        rack_link=base.rack_link,
        cluster_link=base.cluster_link,
        overrides=overrides,
        unavailable=unavailable,
        shared_cores=base.shared_cores,
    )
    return cluster, refs, slowed


class SlowedCosts:
    """A cost model on a :func:`slowed_cluster`: slowed types cost their base type's time × factor.

    Everything but ``cluster``, ``layer_cost`` and ``default_link`` is the base model's.
    """

    def __init__(self, model, cluster, slowed: Mapping[str, tuple[str, float]]):
        self.base, self.cluster, self.slowed = model, cluster, dict(slowed)

    def __getattr__(self, name):
        if name == "base":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.base, name)

    def default_link(self, device_type: str):
        return next(h.intra_link for h in self.cluster.hosts if h.device_type == device_type)

    def layer_cost(self, index: int, device_type: str, config, *, tp_link=None, dp_link=None):
        base_type, f = self.slowed.get(device_type, (device_type, 1.0))
        tp_link = tp_link or self.default_link(device_type)
        dp_link = dp_link or self.default_link(device_type)
        cost = self.base.layer_cost(index, base_type, config, tp_link=tp_link, dp_link=dp_link)
        if f == 1.0:
            return cost
        return dataclasses.replace(
            cost, forward_s=cost.forward_s * f, backward_s=cost.backward_s * f, optimizer_s=cost.optimizer_s * f
        )


def translate(plan, cluster, refs_from: list[str], refs_to: list[str]):
    """``plan`` with device refs renamed by position and each stage's type read from ``cluster``."""
    rename = dict(zip(refs_from, refs_to))
    kinds = {d.ref: d.device_type for d in cluster.all_devices()}
    stages = []
    for stage in plan.stages:
        devices = tuple(rename[r] for r in stage.devices)
        types = {kinds[r] for r in devices}
        if len(types) != 1:
            raise ValueError(f"stage on {devices} would span device types {sorted(types)}")
        stages.append(dataclasses.replace(stage, devices=devices, device_type=types.pop()))
    return dataclasses.replace(plan, stages=tuple(stages))


def price(plan, model):
    """``plan`` with every stage's times recomputed from ``model`` (what ``simulate`` replays)."""
    devices = {d.ref: d for d in model.cluster.all_devices()}
    S, stages = len(plan.stages), []
    for s, stage in enumerate(plan.stages):
        link = model.default_link(stage.device_type)
        config = ParallelConfig(
            tp=stage.tp,
            dp=stage.dp,
            microbatch_size=stage.microbatch_size,
            recompute=stage.recompute,
            zero=stage.zero,
            accumulate_gradients=S > 1,
        )
        costs = [model.layer_cost(i, stage.device_type, config, tp_link=link, dp_link=link) for i in stage.layers]
        send = 0.0
        if s + 1 < S:
            nbytes = model.layers[stage.layers[-1]].activation_bytes * plan.global_batch / plan.microbatches
            hop = model.cluster.link(devices[stage.devices[0]], devices[plan.stages[s + 1].devices[0]])
            send = p2p_s(nbytes / model.batch_size, hop)
        tp_forward = sum(all_reduce_s(c.breakdown.get("tp_forward_bytes", 0.0), stage.tp, link) for c in costs)
        stages.append(
            dataclasses.replace(
                stage,
                time_s=sum(c.forward_s + c.backward_s + c.tp_comm_s for c in costs) + 2 * send,
                forward_s=sum(c.forward_s for c in costs) + tp_forward,
                send_s=send,
                optimizer_s=sum(c.optimizer_s for c in costs),
                dp_sync_s=sum(c.dp_sync_s for c in costs),
            )
        )
    return dataclasses.replace(plan, stages=tuple(stages))


def busy_s(plan) -> list[float]:
    """Per stage of a priced plan, its predicted busy seconds per step (p_s)."""
    return [plan.microbatches * (s.time_s - 2 * s.send_s) + s.optimizer_s + s.dp_sync_s for s in plan.stages]


def step_s(plan, model) -> float:
    """The step time of a priced plan, replayed event by event under ``model``."""
    return simulate(plan, model).iteration_s


def moved_bytes(old, new, model) -> float:
    """Parameters and optimizer state of the layers whose stage devices or degrees change."""

    def where(plan):
        return {i: (st.devices, st.tp, st.dp) for st in plan.stages for i in st.layers}

    before, after = where(old), where(new)
    kind = old.stages[0].device_type
    total = 0.0
    for i in before:
        if before[i] != after[i]:
            cost = model.layer_cost(i, kind, ParallelConfig())
            total += cost.param_bytes + cost.optimizer_bytes
    return total
