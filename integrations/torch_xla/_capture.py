"""Capture a PyTorch module's training step into an :class:`~orchestrator.graph.OpGraph`.

1. ``torch.export.export`` the module with its loss (ATen ops; every node
   carries ``nn_module_stack``).
2. Run the exported program node by node under ``make_fx`` with the core-ATen
   decompositions (plus LayerNorm, GELU and softmax, so they are costed as the
   arithmetic they are), then ``torch.autograd.grad`` of the loss: the traced
   graph is the joint forward + backward program. Forward ops take the scope of
   the exported node they come from; backward ops take the scope of the forward
   node whose autograd function produced them (a pre-hook on every autograd
   node marks where its backward ops start).
3. The optimizer update is derived by rule, one op per parameter (torch's
   optimizers run outside autograd and are not exported): AdamW/Adam
   ``13`` FLOPs + 1 square root per element (decay 1, first moment 3, second
   moment 4, bias-corrected denominator 2, update 3), reading parameter,
   gradient and two moments and writing parameter and moments; SGD 2 FLOPs.

Scopes take the Flax form (``GPT/blocks_3/attn``): the root module's class
name, then the module path with ``ModuleList`` indices joined by ``_``, so
coarsening groups a torch model as it groups the same Flax model. Parameter
paths take the same form (``blocks_3/attn/c_attn/kernel``). Matmuls are
recorded under the primitive name ``dot_general`` and lookups (``index``,
``embedding``, ``gather``) under ``gather``, the names jaxprs give them (the
cost model's tensor-parallel rules and memory traffic key on them); every
other op keeps its ATen name.

Tensors may live on the CPU, an XLA device or the ``meta`` device: the step is
traced on the meta device in every case, so nothing is allocated or computed.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from integrations.torch_xla import _aten
from orchestrator.graph import Op, OpGraph, Phase, TensorSpec

Optimizer = Literal["adamw", "adam", "sgd"]
# per element: (FLOPs, transcendentals, moment tensors kept)
_OPTIMIZER_RULES: dict[str, tuple[int, int, int]] = {"adamw": (13, 1, 2), "adam": (13, 1, 2), "sgd": (2, 0, 0)}


class CaptureWarning(UserWarning):
    """An ATen op was costed conservatively because no rule knows it."""


def scope_path(module_path: str) -> str:
    """``blocks.3.attn`` → ``blocks_3/attn``: a torch module or parameter path in Flax form."""
    parts: list[str] = []
    for part in module_path.split("."):
        if part.isdigit() and parts:
            parts[-1] = f"{parts[-1]}_{part}"
        elif part:
            parts.append(part)
    return "/".join(parts)


class _WithLoss(nn.Module):
    """``loss_fn(module(*inputs), target)``, or ``module(*inputs)`` when there is no loss function."""

    def __init__(self, module: nn.Module, loss_fn: Callable | None):
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn

    def forward(self, *inputs):
        if self.loss_fn is None:
            return self.module(*inputs)
        return self.loss_fn(self.module(*inputs[:-1]), inputs[-1])


def _spec(value) -> TensorSpec:
    return TensorSpec(shape=tuple(int(d) for d in value.shape), dtype=str(value.dtype).removeprefix("torch."))


def _tensors(value) -> list:
    return [v for v in torch.utils._pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


class _Marks:
    """Where each scope starts in the traced graph: ``(node count, scope, phase)`` in trace order."""

    def __init__(self):
        self.marks: list[tuple[int, str, Phase]] = []

    def add(self, scope: str, phase: Phase) -> None:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        mode = get_proxy_mode()
        count = len(mode.tracer.graph.nodes) if mode is not None else 0
        self.marks.append((count, scope, phase))


def _scoped_interpreter(gm: torch.fx.GraphModule, marks: _Marks, grad_scopes: dict, root: str):
    """An fx interpreter that marks each exported node's scope and tags the autograd nodes it creates."""

    class Interpreter(torch.fx.Interpreter):
        def run_node(self, node):
            stack = node.meta.get("nn_module_stack") or {}
            paths = [path for path, _ in stack.values() if path]
            inner = scope_path(paths[-1].removeprefix("module").lstrip(".")) if paths else ""
            scope = f"{root}/{inner}" if inner else root
            marks.add(scope, "forward")
            out = super().run_node(node)
            for tensor in _tensors(out):
                _tag(tensor.grad_fn, scope, grad_scopes)
            return out

    return Interpreter(gm)


class _Run(nn.Module):
    """Runs the exported graph module through the scope-marking interpreter."""

    def __init__(self, gm: torch.fx.GraphModule, marks: _Marks, grad_scopes: dict, root: str):
        super().__init__()
        self.gm = gm
        self._interpreter = (marks, grad_scopes, root)

    def forward(self, *inputs):
        return _scoped_interpreter(self.gm, *self._interpreter).run(*inputs)


def _on_meta(tensor: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of ``tensor``'s shape, strides and dtype on the meta device."""
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")


def _devices_to_meta(gm: torch.fx.GraphModule) -> None:
    """Point every device argument of the exported graph (``to(device=cpu)``, ``arange(device=...)``) at meta."""
    meta = torch.device("meta")

    def swap(value):
        return meta if isinstance(value, torch.device) else value

    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                node.args = torch.utils._pytree.tree_map(swap, node.args)
                node.kwargs = torch.utils._pytree.tree_map(swap, node.kwargs)
            module.recompile()


def _constants(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """Every tensor the exported graph reads by attribute but a parameter: buffers and lifted constants."""
    params = {id(p) for p in gm.parameters()}
    found = dict(gm.named_buffers())
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target not in found:
            value = gm
            for part in node.target.split("."):
                value = getattr(value, part)
            if isinstance(value, torch.Tensor) and id(value) not in params:
                found[node.target] = value
    return found


def _tag(fn, scope: str, grad_scopes: dict) -> None:
    """Give ``fn`` and the untagged autograd nodes behind it (created by the same exported node) ``scope``."""
    todo = [fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in grad_scopes or type(fn).__name__ == "AccumulateGrad":
            continue
        grad_scopes[fn] = scope
        todo.extend(next_fn for next_fn, _ in fn.next_functions)


def capture(
    module: nn.Module,
    *example_inputs: torch.Tensor,
    loss_fn: Callable | None = None,
    optimizer: Optimizer | None = "adamw",
    name: str | None = None,
) -> OpGraph:
    """Capture one training step (forward, backward, optimizer) of ``module`` as an op-graph.

    Args:
      module: the model. Build it under ``torch.device("meta")`` to capture
        without allocating weights.
      *example_inputs: the model's inputs, then (with ``loss_fn``) the target;
        meta tensors are enough.
      loss_fn: ``loss_fn(module(*inputs), target)`` → scalar loss. Without it,
        ``module(*example_inputs)`` must return the scalar loss itself.
      optimizer: the update derived per parameter (see the module docstring);
        None captures forward and backward only.
      name: graph name; defaults to the module's class name.

    Returns:
      The op-graph; ``graph.params`` holds every trainable parameter by Flax-form
      path with its exact shape and dtype, ``graph.meta["optimizer_state_bytes"]``
      the optimizer's state (two moments and a float32 step per parameter for Adam/AdamW).

    Raises:
      ValueError: if the step does not produce a scalar loss, or ``optimizer`` is unknown.

    Example:
      >>> lin = torch.nn.Linear(4, 2)
      >>> g = capture(lin, torch.ones(3, 4), torch.ones(3, 2), loss_fn=torch.nn.functional.mse_loss)
      >>> g.total_flops(phase="forward") >= 2 * 3 * 2 * 4
      True
    """
    from torch._decomp import core_aten_decompositions, get_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    if optimizer is not None and optimizer not in _OPTIMIZER_RULES:
        raise ValueError(f"optimizer={optimizer!r} is not one of {sorted(_OPTIMIZER_RULES)} or None")
    root = type(module).__name__
    exported = torch.export.export(_WithLoss(module, loss_fn), tuple(example_inputs))
    gm = exported.module()
    named = [(n, p) for n, p in gm.named_parameters() if p.requires_grad]
    paths = [scope_path(n.removeprefix("module.")) for n, _ in named]
    marks, grad_scopes = _Marks(), {}

    runner = _Run(gm, marks, grad_scopes, root)
    # Traced on the meta device whatever the inputs' device: only shapes matter, nothing is
    # computed, and every device traces alike (a CPU kernel may return strides that the
    # export's fake tensors did not predict, and the exported graph's ``view`` then fails).
    _devices_to_meta(gm)
    constants = {f"gm.{n}": _on_meta(t) for n, t in _constants(gm).items()}

    def step(params, *inputs):
        tensors = {**constants, **{f"gm.{n}": p for (n, _), p in zip(named, params)}}
        loss = torch.func.functional_call(runner, tensors, inputs)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("capture needs a scalar loss: pass loss_fn=, or let the module return the loss")
        for fn, scope in grad_scopes.items():
            fn.register_prehook(lambda grads, scope=scope: marks.add(scope, "backward"))
        marks.add("", "backward")
        return loss, torch.autograd.grad(loss, params, allow_unused=True)

    aten = torch.ops.aten
    table = {
        **core_aten_decompositions(),
        **get_decompositions([aten.native_layer_norm, aten.native_layer_norm_backward, aten.gelu, aten._softmax]),
        **get_decompositions([aten._log_softmax, aten.gelu_backward, aten._softmax_backward_data]),
    }
    params = [_on_meta(p).requires_grad_() for _, p in named]
    inputs = [_on_meta(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    traced = make_fx(step, decomposition_table=table)(params, *inputs)
    graph = OpGraph(
        name=name or root,
        params={path: _spec(p) for path, (_, p) in zip(paths, named)},
        meta={"framework": "torch", "torch_version": torch.__version__, "optimizer": optimizer},
    )
    grads = _build(graph, traced, paths, marks.marks)
    if optimizer is not None:
        _add_optimizer(graph, optimizer, grads)
    return graph


def _build(graph: OpGraph, traced: torch.fx.GraphModule, paths: list[str], marks: list) -> dict[str, str | None]:
    """Emit the traced ops into ``graph``; returns each parameter's gradient-producing op."""
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    param_of = {node: path for node, path in zip(placeholders, paths)}
    producer: dict = {}  # fx node → op name whose output it is
    claimed: set[str] = set()
    counter: Counter[str] = Counter()
    unknown: Counter[str] = Counter()
    sparse: set[str] = set()  # accumulating index_puts into zeros: a lookup's gradient
    mark_index, scope, phase = 0, "", "forward"
    for index, node in enumerate(traced.graph.nodes):
        while mark_index < len(marks) and marks[mark_index][0] <= index:
            _, scope, phase = marks[mark_index]
            mark_index += 1
        if node.op != "call_function":
            continue
        if node.target.__name__ == "getitem":  # one output of a multi-output op
            producer[node] = producer.get(node.args[0])
            continue
        name = str(node.target.overloadpacket) if hasattr(node.target, "overloadpacket") else str(node.target)
        if name in _aten.SKIP:
            continue
        inputs = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        in_specs = tuple(_spec(a.meta["val"]) for a in inputs)
        out_specs = tuple(_spec(v) for v in _tensors(node.meta.get("val")))
        args = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
        rule = _aten.cost(name, args, [s.shape for s in in_specs], [s.shape for s in out_specs])
        if rule is None:
            if not unknown[name]:
                warnings.warn(
                    f"capture: no cost rule for ATen op {name!r}; counting it as 'other' with one "
                    "FLOP per element read and written",
                    CaptureWarning,
                    stacklevel=3,
                )
            unknown[name] += 1
            rule = _aten.conservative_cost([s.shape for s in in_specs], [s.shape for s in out_specs])
        kind, flops, transcendentals = rule
        if name == "aten.add" and any(producer.get(a) in sparse for a in inputs):
            flops = 0.0  # XLA scatters the sparse updates into the other operand (as in the Flax capture)
        primitive = "dot_general" if kind == "matmul" else "gather" if name in _aten.LOOKUPS else name
        op_name = f"{name.removeprefix('aten.')}_{counter[name]}"
        counter[name] += 1
        reads = [param_of[a] for a in inputs if a in param_of]
        first = [p for p in dict.fromkeys(reads) if p not in claimed]
        claimed.update(first)
        graph.add_op(
            Op(
                name=op_name,
                kind=kind,
                primitive=primitive,
                inputs=in_specs,
                outputs=out_specs,
                flops=flops,
                transcendentals=transcendentals,
                bytes_read=sum(t.nbytes for t in in_specs),
                bytes_written=sum(t.nbytes for t in out_specs),
                param_bytes=sum(graph.params[p].nbytes for p in first),
                param_paths=tuple(first),
                param_reads=tuple(dict.fromkeys(reads)),
                scope=scope,
                phase=phase,
            )
        )
        for a, spec in zip(inputs, in_specs):
            if producer.get(a) is not None:
                graph.add_edge(producer[a], op_name, nbytes=spec.nbytes)
        producer[node] = op_name
        if name == "aten.index_put" and _accumulates_into_zeros(node):
            sparse.add(op_name)
    graph.meta["unknown_primitives"] = dict(unknown)
    [output] = [n for n in traced.graph.nodes if n.op == "output"]
    grad_nodes = output.args[0][1:]  # (loss, *grads), flattened by make_fx
    return {path: producer.get(g) if isinstance(g, torch.fx.Node) else None for path, g in zip(paths, grad_nodes)}


def _accumulates_into_zeros(node: torch.fx.Node) -> bool:
    """``index_put(full(shape, 0), indices, values, accumulate=True)``: how an embedding's gradient is built."""
    base = node.args[0]
    accumulate = len(node.args) > 3 and bool(node.args[3])
    is_zeros = (
        isinstance(base, torch.fx.Node)
        and str(getattr(base.target, "overloadpacket", base.target)) == "aten.full"
        and len(base.args) > 1
        and base.args[1] == 0
    )
    return accumulate and is_zeros


def _add_optimizer(graph: OpGraph, optimizer: str, grads: dict[str, str | None]) -> None:
    """One update op per parameter, after the gradient that feeds it (the rule in the module docstring)."""
    flops, transcendentals, moments = _OPTIMIZER_RULES[optimizer]
    for index, (path, spec) in enumerate(graph.params.items()):
        size, nbytes = spec.size, spec.nbytes
        op_name = f"{optimizer}_update_{index}"
        graph.add_op(
            Op(
                name=op_name,
                kind="elementwise",
                primitive=f"{optimizer}_update",
                inputs=(spec,) * (2 + moments),
                outputs=(spec,) * (1 + moments),
                flops=float(flops * size),
                transcendentals=float(transcendentals * size),
                bytes_read=nbytes * (2 + moments),
                bytes_written=nbytes * (1 + moments),
                param_reads=(path,),
                phase="optimizer",
            )
        )
        if grads.get(path) is not None:
            graph.add_edge(grads[path], op_name, nbytes=nbytes)
    step_bytes = 4 * len(graph.params) if moments else 0  # torch keeps a float32 step per parameter
    graph.meta["optimizer_state_bytes"] = moments * graph.param_bytes + step_bytes
    graph.meta["optimizer_flops_per_element"] = flops
