"""Capture a JAX/Flax function into an :class:`~orchestrator.graph.OpGraph`.

The function is traced to a jaxpr with ``jax.make_jaxpr`` (abstract arguments
are fine, so a 175B model is never allocated), dead code is dropped as XLA
would drop it, and every remaining equation becomes an
:class:`~orchestrator.graph.Op`. Calls (jit, remat, custom_jvp/vjp) are walked
into; loop bodies (``scan``, ``while``) are walked once and their ops carry
``repeats`` = trip count, with FLOPs and bytes multiplied by it. ``while``
loops have no static trip count: their body is counted once and the number of
such loops is recorded in ``graph.meta["while_loops_counted_once"]``.

Scope and phase come from the equation's name stack, which Flax fills with
module paths (``jvp(GPT)/blocks_3/attn``): ops under ``transpose(...)`` are
backward; ops before the first backward op are forward; ops after it that are
not under ``jvp(...)`` belong to the optimizer update.
"""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.extend import core as jcore

from integrations.flax import _primitives
from integrations.flax._trace import trace
from orchestrator.graph import Op, OpGraph, Phase, TensorSpec


class CaptureWarning(UserWarning):
    """A primitive was costed conservatively because no rule knows it."""


_CALLS = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}
# Name-stack components that jax itself adds; they are not module scopes.
_JAX_SCOPES = frozenset({"checkpoint", "remat", "rematted_computation", "while", "body", "cond", "scan"})
_WRAPPER = re.compile(r"^[A-Za-z_][\w.]*\((.*)\)$")


@dataclass(frozen=True, slots=True)
class _Source:
    """Where a jaxpr value comes from: the op that wrote it and/or a parameter leaf."""

    producer: str | None = None
    param: int | None = None


_NOWHERE = _Source()


def parse_name_stack(stack: str) -> tuple[str, bool, bool]:
    """``(scope, under_transpose, under_jvp)`` of a jax name stack string.

    Flax names a module method other than ``__call__`` as ``module.method``
    (``wte.attend``); that name is kept, as it tells a tied embedding's use as
    the output head apart from its use as the input embedding.

    >>> parse_name_stack("transpose(jvp(GPT))/blocks_3/attn")
    ('GPT/blocks_3/attn', True, True)
    """
    parts = []
    for component in stack.split("/"):
        match = _WRAPPER.match(component)
        while match:
            component = match.group(1)
            match = _WRAPPER.match(component)
        if component and component not in _JAX_SCOPES and "->" not in component:  # einsum specs
            parts.append(component)
    return "/".join(parts), "transpose(" in stack, "jvp(" in stack


def _join(outer: str, inner: str) -> str:
    return f"{outer}/{inner}" if outer and inner else outer or inner


def _spec(aval) -> TensorSpec:
    shape = tuple(int(d) for d in getattr(aval, "shape", ()))
    return TensorSpec(shape=shape, dtype=str(getattr(aval, "dtype", "float32")))


class _Walker:
    """Walks a jaxpr and its sub-jaxprs, emitting ops into one graph."""

    def __init__(self, graph: OpGraph, param_paths: Sequence[str]):
        self.graph = graph
        self.param_paths = param_paths
        self.claimed: set[int] = set()
        self.counter: Counter[str] = Counter()
        self.unknown: Counter[str] = Counter()
        self.while_loops = 0
        self.seen_backward = False
        self.zeros: set[str] = set()  # ops that broadcast a literal 0
        self.sparse: set[str] = set()  # scatter-adds into zeros

    def phase(self, under_transpose: bool, under_jvp: bool) -> Phase:
        if under_transpose:
            self.seen_backward = True
            return "backward"
        if not self.seen_backward or under_jvp:
            return "forward"
        return "optimizer"

    def walk(self, jaxpr, in_sources: Sequence[_Source], *, stack: str, repeats: int) -> list[_Source]:
        """Emit the ops of ``jaxpr``; returns the sources of its outputs."""
        if isinstance(jaxpr, jcore.ClosedJaxpr):
            jaxpr = jaxpr.jaxpr
        env: dict = {}
        for var in jaxpr.constvars:
            env[var] = _NOWHERE
        if len(in_sources) != len(jaxpr.invars):
            raise AssertionError(f"{len(in_sources)} sources for {len(jaxpr.invars)} jaxpr inputs")
        env.update(zip(jaxpr.invars, in_sources))

        def read(atom) -> _Source:
            return _NOWHERE if isinstance(atom, jcore.Literal) else env.get(atom, _NOWHERE)

        for eqn in jaxpr.eqns:
            sources = [read(v) for v in eqn.invars]
            eqn_stack = _join(stack, str(eqn.source_info.name_stack))
            outs = self.eqn(eqn, sources, stack=eqn_stack, repeats=repeats)
            for var, src in zip(eqn.outvars, outs):
                if not isinstance(var, jcore.DropVar):
                    env[var] = src
        return [read(v) for v in jaxpr.outvars]

    # -- one equation -----------------------------------------------------
    def eqn(self, eqn, sources: list[_Source], *, stack: str, repeats: int) -> list[_Source]:
        name = eqn.primitive.name
        params = eqn.params
        if name in _CALLS and _CALLS[name] in params:
            return self.walk(params[_CALLS[name]], sources, stack=stack, repeats=repeats)
        if name == "scan":
            return self.walk(params["jaxpr"], sources, stack=stack, repeats=repeats * int(params["length"]))
        if name == "while":
            return self.while_loop(eqn, sources, stack=stack, repeats=repeats)
        if name == "cond":
            return self.cond(eqn, sources, stack=stack, repeats=repeats)
        if name == "shard_map":
            devices = math.prod(params["mesh"].shape.values())
            return self.walk(params["jaxpr"], sources, stack=stack, repeats=repeats * devices)
        if name == "pallas_call":
            return self.pallas_call(eqn, sources, stack=stack, repeats=repeats)
        rule = _primitives.cost(name, params, [v.aval for v in eqn.invars], [v.aval for v in eqn.outvars])
        if rule is None:
            subjaxprs = list(jcore.jaxprs_in_params(params))
            if len(subjaxprs) == 1 and len(subjaxprs[0].invars) == len(eqn.invars):
                return self.walk(subjaxprs[0], sources, stack=stack, repeats=repeats)
            rule = self.unknown_primitive(name, eqn)
        kind, flops, transcendentals = rule
        producers = [s.producer for s in sources]
        if name in ("add", "add_any") and any(p in self.sparse for p in producers):
            flops = 0.0  # XLA scatters the sparse updates into the other operand (see _primitives)
        outs = self.emit(
            eqn, sources, kind=kind, flops=flops, transcendentals=transcendentals, stack=stack, repeats=repeats
        )
        if name == "broadcast_in_dim" and _is_zero_literal(eqn.invars[0]):
            self.zeros.add(outs[0].producer)
        elif name in ("scatter-add", "scatter_add") and producers[0] in self.zeros:
            self.sparse.add(outs[0].producer)
        return outs

    def unknown_primitive(self, name: str, eqn) -> tuple:
        rule = _primitives.conservative_cost([v.aval for v in eqn.invars], [v.aval for v in eqn.outvars])
        if not self.unknown[name]:
            warnings.warn(
                f"capture: no cost rule for primitive {name!r}; counting it as 'other' with one "
                "FLOP per element read and written",
                CaptureWarning,
                stacklevel=2,
            )
        self.unknown[name] += 1
        return rule

    def while_loop(self, eqn, sources, *, stack: str, repeats: int) -> list[_Source]:
        params = eqn.params
        n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
        body_consts = sources[n_cond : n_cond + n_body]
        carry = sources[n_cond + n_body :]
        self.while_loops += 1
        self.walk(params["cond_jaxpr"], list(sources[:n_cond]) + carry, stack=stack, repeats=repeats)
        return self.walk(params["body_jaxpr"], body_consts + carry, stack=stack, repeats=repeats)

    def cond(self, eqn, sources, *, stack: str, repeats: int) -> list[_Source]:
        """Count the most expensive branch: a plan must fit the worst case."""
        branches = eqn.params["branches"]
        heaviest = max(branches, key=_jaxpr_flops)
        return self.walk(heaviest, sources[1:], stack=stack, repeats=repeats)

    def pallas_call(self, eqn, sources, *, stack: str, repeats: int) -> list[_Source]:
        params = eqn.params
        estimate = params.get("cost_estimate")
        if estimate is not None:
            flops, transcendentals = float(estimate.flops), float(estimate.transcendentals)
        else:
            grid = math.prod(params["grid_mapping"].grid) if "grid_mapping" in params else 1
            flops, transcendentals = _jaxpr_flops(params["jaxpr"]) * grid, 0.0
        label = str(params.get("name_and_src_info", params.get("name", ""))).lower()
        kind = "attention" if any(word in label for word in ("attention", "flash", "mha")) else "other"
        return self.emit(
            eqn, sources, kind=kind, flops=flops, transcendentals=transcendentals, stack=stack, repeats=repeats
        )

    def emit(self, eqn, sources, *, kind, flops, transcendentals, stack: str, repeats: int) -> list[_Source]:
        primitive = eqn.primitive.name
        op_name = f"{primitive}_{self.counter[primitive]}"
        self.counter[primitive] += 1
        scope, under_transpose, under_jvp = parse_name_stack(stack)
        inputs = tuple(_spec(v.aval) for v in eqn.invars)
        outputs = tuple(_spec(v.aval) for v in eqn.outvars)
        first_read = []
        for src in sources:
            if src.param is not None and src.param not in self.claimed:
                self.claimed.add(src.param)
                first_read.append(self.param_paths[src.param])
        self.graph.add_op(
            Op(
                name=op_name,
                kind=kind,
                primitive=primitive,
                inputs=inputs,
                outputs=outputs,
                flops=flops * repeats,
                transcendentals=transcendentals * repeats,
                bytes_read=sum(t.nbytes for t in inputs) * repeats,
                bytes_written=sum(t.nbytes for t in outputs) * repeats,
                param_bytes=sum(self.graph.params[path].nbytes for path in first_read),
                param_paths=tuple(first_read),
                param_reads=tuple(dict.fromkeys(self.param_paths[s.param] for s in sources if s.param is not None)),
                scope=scope,
                phase=self.phase(under_transpose, under_jvp),
                repeats=repeats,
            )
        )
        for src, spec in zip(sources, inputs):
            if src.producer is not None:
                self.graph.add_edge(src.producer, op_name, nbytes=spec.nbytes)
        return [_Source(producer=op_name) for _ in eqn.outvars]


def _is_zero_literal(atom) -> bool:
    if not isinstance(atom, jcore.Literal):
        return False
    value = np.asarray(atom.val)
    return value.ndim == 0 and value == 0


def _jaxpr_flops(jaxpr) -> float:
    """FLOPs of a jaxpr by the same rules, without building a graph (for cond branches)."""
    scratch = _Walker(OpGraph(), [])
    inner = jaxpr.jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jaxpr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CaptureWarning)
        scratch.walk(inner, [_NOWHERE] * len(inner.invars), stack="", repeats=1)
    return scratch.graph.total_flops()


def _key_name(key) -> str:
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def param_path_name(path: Sequence) -> str:
    """``"blocks_3/attn/c_attn/kernel"`` for a key path, dropping everything up to ``params``."""
    names = [_key_name(k) for k in path]
    if "params" in names:
        names = names[len(names) - names[::-1].index("params") :]
    return "/".join(names)


def is_param_path(path: Sequence) -> bool:
    """Default test for a parameter leaf: under a ``params`` key, not under ``opt_state``.

    Matches ``TrainState.params``, Flax variable dicts ``{"params": ...}`` and
    ``nnx.State`` filtered to ``nnx.Param``, and excludes optimizer moments.
    """
    names = [_key_name(k) for k in path]
    return "params" in names and "opt_state" not in names


def capture(
    fn: Callable,
    *example_args,
    name: str | None = None,
    is_param: Callable[[Sequence], bool] = is_param_path,
) -> OpGraph:
    """Capture ``fn(*example_args)`` as an op-graph.

    Args:
      fn: a JAX function: a whole training step (forward, backward and
        optimizer update) or a bare forward pass. May be jitted.
      *example_args: arrays or ``jax.ShapeDtypeStruct`` pytrees (for example
        from ``jax.eval_shape``); nothing is computed or allocated.
      name: graph name; defaults to the function's ``__name__``.
      is_param: given a leaf's key path, says whether it is a model parameter.
        Parameter bytes are credited to the first op that reads each one.

    Returns:
      The :class:`~orchestrator.graph.OpGraph`. ``graph.param_bytes`` is the
      exact byte count of all parameter leaves.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> g = capture(lambda w, x: jnp.tanh(x @ w), jnp.ones((4, 4)), jnp.ones((2, 4)))
      >>> g.total_flops()
      64.0
    """
    closed = trace(fn, *example_args)
    leaves_with_paths = jax.tree_util.tree_flatten_with_path(example_args)[0]
    params, sources, optimizer_state_bytes = {}, [], 0
    for path, leaf in leaves_with_paths:
        if "opt_state" in (_key_name(k) for k in path):
            optimizer_state_bytes += _spec(leaf).nbytes
        if is_param(path):
            sources.append(_Source(param=len(params)))
            name = param_path_name(path)
            params[name if name not in params else jax.tree_util.keystr(path)] = _spec(leaf)
        else:
            sources.append(_NOWHERE)
    if len(sources) != len(closed.jaxpr.invars):
        raise AssertionError("jaxpr inputs do not match the flattened arguments")
    graph = OpGraph(
        name=name or getattr(fn, "__name__", "fn"),
        params=params,
        meta={
            "framework": "jax",
            "jax_version": jax.__version__,
            "optimizer_state_bytes": optimizer_state_bytes,
        },
    )
    walker = _Walker(graph, list(params))
    walker.walk(closed.jaxpr, sources, stack="", repeats=1)
    graph.meta["unknown_primitives"] = dict(walker.unknown)
    graph.meta["while_loops_counted_once"] = walker.while_loops
    return graph


def param_logical_axes(boxed_params) -> dict[str, tuple[str | None, ...]]:
    """Logical axis names of every parameter, by path, from ``nn.Partitioned`` boxes.

    Pass what ``jax.eval_shape(model.init, ...)`` returns (boxes intact);
    unboxed parameters get ``()``.

    >>> import flax.linen as nn, jax, jax.numpy as jnp
    >>> dense = nn.Dense(4, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")))
    >>> param_logical_axes(jax.eval_shape(dense.init, jax.random.key(0), jnp.ones((1, 2)))["params"])
    {'bias': (), 'kernel': ('embed', 'mlp')}
    """
    import flax.linen as nn

    specs = nn.get_partition_spec(boxed_params)
    leaves = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))[0]
    return {param_path_name(path): tuple(spec) for path, spec in leaves}
