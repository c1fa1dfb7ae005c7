"""Run a single-stage plan with PyTorch/XLA SPMD: one mesh, shardings from the plan, a step function.

A plan stage with tensor-parallel degree t and data-parallel degree p becomes
the mesh ``("data", "model") = (p, t)`` over all t·p devices. A parameter is
split over ``"model"`` on the dim :func:`orchestrator.costs.logical_to_mesh_axes`
names, by the logical axis rules the cost model priced the plan with
(``axis_rules=``; Megatron's attention heads, MLP columns and vocabulary by
default, a dim that t does not divide skipped; XLA's SPMD partitioner then
all-reduces the row-parallel outputs and the column-parallel input
gradients), every other dimension is replicated, and the batch dimension of
the inputs is split over ``"data"`` (XLA all-reduces the gradients over it).
With ``zero=True`` the optimizer moments are in addition split over
``"data"`` along their first replicated dimension that divides by p.

Pipeline plans (more than one stage) are refused: torch_xla's SPMD mode
compiles one program over one mesh that spans every device of the process
(``xs.Mesh`` requires it), so stage submodules on disjoint device subsets
cannot be expressed in it. Run a pipeline plan with the JAX executor, or
re-plan with one stage.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from integrations.torch_xla._capture import scope_path
from orchestrator.costs import LogicalAxisRules, logical_to_mesh_axes, tensor_parallel_axes
from orchestrator.planner import Plan


class PlanNotSupported(ValueError):
    """The plan asks for something this executor cannot run; the message says what and what to do."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """The mesh and per-parameter partition specs a plan was applied with.

    Attributes:
      dp, tp: mesh shape (``"data"``, ``"model"``).
      param_specs: partition spec per torch parameter name (``None`` = replicated dim).
      microbatches: gradient-accumulation steps per optimizer step.
    """

    dp: int
    tp: int
    param_specs: Mapping[str, tuple[str | None, ...]]
    microbatches: int


def partition_spec(
    axes: Sequence[str | None] | None,
    shape: Sequence[int],
    tp: int,
    axis_rules: LogicalAxisRules | None = None,
) -> tuple[str | None, ...]:
    """The partition spec of one parameter: :func:`orchestrator.costs.logical_to_mesh_axes`, the cost model's rule.

    ``"model"`` on the first dim whose logical axis the rules map to
    ``"model"`` and whose size ``tp`` divides; every other dim replicated.

    Example:
      >>> partition_spec(("embed", "mlp"), (32, 128), 4)
      (None, 'model')
    """
    return logical_to_mesh_axes(shape, axes, tp, axis_rules)


def apply(
    plan: Plan,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    loss_fn: Callable | None = None,
    param_axes: Mapping[str, Sequence[str | None]] | None = None,
    axis_rules: LogicalAxisRules | None = None,
    zero: bool = False,
) -> Callable[..., torch.Tensor]:
    """Shard ``module`` and ``optimizer`` per ``plan`` on the local XLA devices; return a step function.

    Call it before any tensor is placed on an XLA device: it switches
    torch_xla to SPMD mode (``torch_xla.runtime.use_spmd()``), moves the module
    to the XLA device (a parameter several submodules share, such as a head
    tied to its embedding, stays one parameter) and repoints ``optimizer`` at
    the moved parameters. If
    the process runs a backward pass before (eager CPU training,
    :func:`~integrations.torch_xla.capture`), start the XLA runtime first
    (``torch_xla.runtime.use_spmd(); torch_xla.runtime.global_runtime_device_count()``):
    the autograd engine sizes its per-device queues at the first backward pass.

    Args:
      plan: a one-stage plan (``orchestrator.planner.Plan``) whose stage has
        tp·dp devices, as many as torch_xla sees (``CPU_NUM_DEVICES`` on CPU).
      module: the model, on the CPU.
      optimizer: built over ``module.parameters()``; its state moves along.
      loss_fn: ``loss_fn(module(*inputs), target)``; None if the module returns the loss.
      param_axes: logical axis names per parameter in Flax form
        (``blocks_0/mlp/c_fc/kernel``: ``("embed", "mlp")``); needed for tp > 1.
      axis_rules: ``(logical axis name, mesh axis or None)`` pairs saying which
        dims ``"model"`` splits; the ones the plan was priced with
        (``CostModel(axis_rules=)``, :data:`orchestrator.costs.DEFAULT_LOGICAL_AXIS_RULES` by default).
      zero: also split the optimizer moments over ``"data"`` (ZeRO stage 1).

    Returns:
      ``step(*inputs, target)`` (or ``step(*inputs)`` without ``loss_fn``):
      one optimizer step over the plan's microbatches, returning the mean loss
      as a 0-d XLA tensor. ``step.layout`` is the :class:`Layout` used,
      ``step.plan`` the plan (what :func:`~integrations.torch_xla.fit` hands the callbacks).

    Raises:
      PlanNotSupported: a pipeline plan, a stage asking for FSDP, sequence parallelism or
        selective recompute, a device count that differs from the local one, or tp > 1
        without ``param_axes``.
      ValueError: a malformed ``axis_rules`` table.
    """
    if len(plan.stages) != 1:
        raise PlanNotSupported(
            f"the plan has {len(plan.stages)} pipeline stages; integrations.torch_xla runs one-stage plans only "
            "(torch_xla SPMD compiles one program over a mesh of all devices): re-plan with one stage"
        )
    [stage] = plan.stages
    asked = [name for name in ("fsdp", "sequence_parallel", "selective_recompute") if getattr(stage, name)]
    if asked:
        raise PlanNotSupported(
            f"the plan's stage asks for {' and '.join(asked)}, which integrations.torch_xla does not run: "
            "plan without it (plan()'s default) or run the step with integrations.flax"
        )
    tp, dp = stage.tp, stage.dp
    tensor_parallel_axes(axis_rules)  # a malformed table fails before torch_xla starts
    if tp > 1 and not param_axes:
        raise PlanNotSupported(f"tp={tp} needs param_axes= (logical axis names of the parameters)")
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    devices = xr.global_runtime_device_count()
    if tp * dp != devices:
        raise PlanNotSupported(
            f"the plan's stage uses tp·dp = {tp}·{dp} = {tp * dp} devices but torch_xla sees {devices}; "
            f"set CPU_NUM_DEVICES={tp * dp} (PJRT_DEVICE=CPU) or re-plan for {devices} devices"
        )
    mesh = xs.Mesh(np.arange(devices), (dp, tp), ("data", "model"))
    device = torch_xla.device()

    names = {id(p): n for n, p in module.named_parameters()}
    _init_state(optimizer)
    _move(module, device)
    moved = dict(module.named_parameters())
    _repoint(optimizer, names, moved, device)
    specs = {}
    for name, param in moved.items():
        specs[name] = partition_spec((param_axes or {}).get(scope_path(name)), param.shape, tp, axis_rules)
        xs.mark_sharding(param, mesh, specs[name])
    for name, param in moved.items():
        for value in optimizer.state.get(param, {}).values():
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                xs.mark_sharding(value, mesh, _zero_spec(specs[name], param.shape, dp) if zero else specs[name])
    layout = Layout(dp=dp, tp=tp, param_specs=specs, microbatches=plan.microbatches)

    def step(*batch: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        total = None
        for micro in _microbatches(batch, plan.microbatches):
            micro = [_to_mesh(t, device, mesh, xs) for t in micro]
            out = module(*micro[:-1]) if loss_fn is not None else module(*micro)
            loss = (loss_fn(out, micro[-1]) if loss_fn is not None else out) / plan.microbatches
            try:
                loss.backward()
            except RuntimeError as error:
                if "device_ready_queues_" not in str(error):
                    raise
                raise RuntimeError(
                    "the autograd engine started before the XLA runtime: call "
                    "torch_xla.runtime.use_spmd() and torch_xla.runtime.global_runtime_device_count() "
                    "before the first backward pass of the process (eager training or capture)"
                ) from None
            total = loss.detach() if total is None else total + loss.detach()
        optimizer.step()
        torch_xla.sync()
        return total

    step.layout, step.plan = layout, plan
    return step


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state on the CPU with one zero-gradient, zero-learning-rate step.

    torch optimizers create their state in their first step; creating it here
    lets it be sharded before the first XLA step, and makes the first step's
    program the steady-state one (compiled once, not twice). For Adam, AdamW
    and SGD with momentum (no dampening) that step leaves parameters, moments
    and buffers at their initial values; step counters are reset to 0.
    """
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if all(p in optimizer.state for p in params):
        return
    rates = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    for p in params:
        p.grad = None
        state = optimizer.state.get(p, {})
        if "step" in state:
            state["step"] = torch.zeros_like(state["step"]) if isinstance(state["step"], torch.Tensor) else 0


def _move(module: nn.Module, device) -> None:
    """``module.to(device)``, keeping a tensor that several submodules share one tensor.

    ``Module.to`` converts each submodule's parameters on their own, so a
    parameter two modules hold (a language model head tied to its embedding,
    ``lm_head.weight is wte.weight``) would come back as two parameters: the
    optimizer would update one, the forward pass would read both.
    """
    holders: dict[int, list[tuple[dict, str]]] = defaultdict(list)
    for owner in module.modules():
        for table in (owner._parameters, owner._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    holders[id(tensor)].append((table, name))
    module.to(device)
    for shared in holders.values():
        table, name = shared[0]  # the first holder, the one named_parameters() names
        for other_table, other_name in shared[1:]:
            other_table[other_name] = table[name]


def _zero_spec(spec: tuple[str | None, ...], shape: Sequence[int], dp: int) -> tuple[str | None, ...]:
    """``spec`` with ``"data"`` on the first replicated dim that divides by ``dp`` (unchanged if none does)."""
    for dim, (axis, size) in enumerate(zip(spec, shape)):
        if axis is None and size % dp == 0 and dp > 1:
            return (*spec[:dim], "data", *spec[dim + 1 :])
    return spec


def _microbatches(batch: Sequence[torch.Tensor], count: int) -> list[list[torch.Tensor]]:
    size = batch[0].shape[0]
    if size % count:
        raise PlanNotSupported(f"batch of {size} does not split into {count} microbatches")
    chunks = [t.chunk(count, dim=0) for t in batch]
    return [[c[i] for c in chunks] for i in range(count)]


def _to_mesh(tensor: torch.Tensor, device, mesh, xs) -> torch.Tensor:
    """The tensor on the XLA device with its batch dim split over ``"data"``."""
    tensor = tensor.to(device)
    xs.mark_sharding(tensor, mesh, ("data",) + (None,) * (tensor.dim() - 1))
    return tensor


def _repoint(optimizer: torch.optim.Optimizer, names: dict[int, str], moved: dict[str, nn.Parameter], device) -> None:
    """Replace the optimizer's parameters (and state keys) by the moved ones; moves non-scalar state along."""
    for group in optimizer.param_groups:
        old = group["params"]
        try:
            group["params"] = [moved[names[id(p)]] for p in old]
        except KeyError:
            raise PlanNotSupported("the optimizer holds tensors that are not parameters of the module") from None
        for before, after in zip(old, group["params"]):
            if before in optimizer.state:
                optimizer.state[after] = {
                    k: v.to(device) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                    for k, v in optimizer.state.pop(before).items()
                }
