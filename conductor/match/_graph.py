"""A read-only view of one jaxpr level: producers, consumers, and constants known by value.

A constant (an expression of iotas, literals and captured arrays that depends on
no input) is a :class:`Const`: a function from index points to values, so a
(T, T) causal mask broadcast to (B, H, T, T) is read at the points a check asks
for and never built whole. Only equations that mix elements (a reduction, a
product, a concatenation) are folded into arrays, and only up to ``FOLD_LIMIT``
elements; beyond that the reason is kept (``Graph.why_not_const``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np
from jax.extend import core as jcore

_PASS_THROUGH = ("broadcast_in_dim", "reshape", "stop_gradient", "convert_element_type", "squeeze", "copy")
FOLD_LIMIT = 1 << 24  # elements an equation that mixes elements may fold into an array
CHECK_CHUNK = 1 << 22  # index points evaluated at once when a check sweeps a constant

_BINARY = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "max": np.maximum,
    "min": np.minimum,
    "eq": np.equal,
    "ne": np.not_equal,
    "ge": np.greater_equal,
    "gt": np.greater,
    "le": np.less_equal,
    "lt": np.less,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
    "rem": np.fmod,  # lax.rem takes the sign of the dividend, as C's fmod
    "pow": np.power,
}
_UNARY = {
    "neg": np.negative,
    "not": np.invert,
    "abs": np.abs,
    "sign": np.sign,
    "exp": np.exp,
    "log": np.log,
    "floor": np.floor,
    "ceil": np.ceil,
    "stop_gradient": lambda x: x,
    "copy": lambda x: x,
    "reduce_precision": lambda x: x,
}


def _div(x, y):
    if np.issubdtype(np.result_type(x, y), np.integer):  # lax.div rounds integers toward zero
        q = np.abs(x) // np.abs(y)
        return np.where((x < 0) != (y < 0), -q, q).astype(np.result_type(x, y))
    return np.true_divide(x, y)


@dataclass(frozen=True, slots=True)
class Const:
    """A constant of ``shape``, read at index points.

    ``at(index)`` takes one integer array per dim, broadcastable against each other, and returns
    the values there (broadcastable to their common shape). ``depends`` holds the dims the value
    may vary along (a superset): along any other dim every slice is the same.
    """

    shape: tuple[int, ...]
    at: Callable
    depends: frozenset[int]

    def map(self, fn) -> Const:
        """The constant ``fn(self)`` for an elementwise ``fn``."""
        return Const(self.shape, lambda index: fn(self.at(index)), self.depends)

    def fit(self, shape) -> Const:
        """This constant read as an operand of ``shape`` (a scalar, or size-1 dims broadcast)."""
        shape = tuple(shape)
        if self.shape == shape:
            return self
        if self.shape == ():
            return Const(shape, lambda index: self.at(()), frozenset())
        ones = {d for d, n in enumerate(self.shape) if n == 1 and shape[d] != 1}

        def at(index):
            return self.at(tuple(0 if d in ones else i for d, i in enumerate(index)))

        return Const(shape, at, self.depends - ones)

    def first(self):
        """The value at index 0 of every dim (the only value when ``depends`` is empty)."""
        return np.asarray(self.at(tuple(np.zeros((1,) * len(self.shape), int) for _ in self.shape))).reshape(-1)[0]

    def sweep(self, dims: tuple[int, ...] | None = None):
        """Yield (index, values) over every point of ``dims`` (default: ``depends``), a chunk at a time;
        the other dims stay at 0."""
        dims = tuple(sorted(self.depends if dims is None else dims))
        rank = len(self.shape)
        sizes = [self.shape[d] for d in dims]
        rest = math.prod(sizes[1:])
        step = max(1, CHECK_CHUNK // max(rest, 1))
        lead = sizes[0] if dims else 1
        for start in range(0, lead, step):
            index = [np.zeros((1,) * rank, int) for _ in range(rank)]
            for k, d in enumerate(dims):
                span = np.arange(start, min(start + step, lead)) if k == 0 else np.arange(sizes[k])
                index[d] = span.reshape([-1 if j == d else 1 for j in range(rank)])
            shape = np.broadcast_shapes(*(i.shape for i in index))
            yield tuple(index), np.broadcast_to(np.asarray(self.at(tuple(index))), shape)

    def array(self) -> np.ndarray:
        """The whole value as an array (for constants small enough to fold)."""
        index = tuple(
            np.arange(n).reshape([-1 if j == d else 1 for j in range(len(self.shape))])
            for d, n in enumerate(self.shape)
        )
        return np.broadcast_to(np.asarray(self.at(index)), self.shape)


def _dense(x) -> Const:
    x = np.asarray(x)
    return Const(
        tuple(x.shape),
        lambda index: x[index] if x.ndim and index else x,
        frozenset(d for d, n in enumerate(x.shape) if n > 1),
    )


class Graph:
    """Producers and consumers of the variables of ``jaxpr`` (constants known by value)."""

    def __init__(self, jaxpr: jcore.Jaxpr, consts=()):
        self.jaxpr = jaxpr
        self.producer: dict = {}
        self.users: dict = {}
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.outvars:
                self.producer[v] = i
            for v in eqn.invars:
                if isinstance(v, jcore.Var):
                    self.users.setdefault(v, []).append(i)
        self.outputs = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
        self._consts: dict = {v: _dense(c) for v, c in zip(jaxpr.constvars, consts)}
        self._why: dict = {v: "an input of the step" for v in jaxpr.invars}

    def eqn(self, v):
        """The equation producing ``v`` (None for inputs, constants and literals)."""
        i = self.producer.get(v) if isinstance(v, jcore.Var) else None
        return None if i is None else self.jaxpr.eqns[i]

    def only_used_by(self, v, eqn_ids: set[int]) -> bool:
        return v not in self.outputs and all(i in eqn_ids for i in self.users.get(v, ()))

    def through(self, v, kinds=_PASS_THROUGH):
        """Follow ``v`` back through shape-only equations (broadcast, reshape, stop_gradient, casts)."""
        while (e := self.eqn(v)) is not None and e.primitive.name in kinds:
            v = e.invars[0]
        return v

    def const(self, v) -> Const | None:
        """``v`` as a :class:`Const` if it depends on no input (iota, literals, captured arrays), else None."""
        if isinstance(v, jcore.Literal):
            return _dense(v.val)
        if v in self._consts:
            return self._consts[v]
        if v in self._why:
            return None
        # iterative post-order over the producers, so a long chain of constant equations cannot overflow the stack
        stack = [v]
        while stack:
            top = stack[-1]
            e = self.eqn(top)
            if e is None:
                self._why[top] = "an input of the step"
                stack.pop()
                continue
            pending = [x for x in e.invars if isinstance(x, jcore.Var) and x not in self._consts and x not in self._why]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            if top in self._consts or top in self._why:
                continue
            self._const_of(e)
        return self._consts.get(v)

    def inputs_of(self, v) -> list:
        """The inputs of the step (this level's invars) that ``v`` is computed from."""
        inputs = set(self.jaxpr.invars)
        found, seen, stack = [], set(), [v]
        while stack:
            x = stack.pop()
            if not isinstance(x, jcore.Var) or x in seen:
                continue
            seen.add(x)
            e = self.eqn(x)
            if e is not None:
                stack.extend(e.invars)
            elif x in inputs and x not in self._consts:
                found.append(x)
        return found

    def assuming(self, values: dict) -> Graph:
        """This graph with the inputs in ``values`` taken as the given :class:`Const` s (a what-if)."""
        other = Graph.__new__(Graph)
        other.jaxpr, other.producer, other.users, other.outputs = self.jaxpr, self.producer, self.users, self.outputs
        other._consts = dict(self._consts) | dict(values)  # what is constant already stays so
        other._why = {v: "an input of the step" for v in self.jaxpr.invars if v not in values}
        return other

    def why_not_const(self, v) -> str:
        """Why ``v`` is not a constant: the input it is computed from or the fold that was refused."""
        self.const(v)
        return self._why.get(v, "it is a constant")

    def _const_of(self, e) -> None:
        ins = []
        for x in e.invars:
            c = self.const(x) if isinstance(x, jcore.Literal) else self._consts.get(x)
            if c is None:
                why = self._why.get(x, "")
                for o in e.outvars:
                    self._why[o] = "computed from inputs" if "input" in why else why
                return
            ins.append(c)
        if e.effects or e.primitive.name in ("scan", "while", "pallas_call", "cond"):
            for o in e.outvars:
                self._why[o] = f"produced by {e.primitive.name}"
            return
        out = e.outvars[0]
        shape = tuple(getattr(out.aval, "shape", ()))
        lazy = None if e.primitive.multiple_results else _lazy(e, ins, shape)
        if lazy is not None:
            self._consts[out] = lazy
            return
        sizes = [math.prod(c.shape) for c in ins] + [math.prod(getattr(o.aval, "shape", ())) for o in e.outvars]
        if max(sizes, default=0) > FOLD_LIMIT:
            for o in e.outvars:
                self._why[o] = f"a constant {e.primitive.name} of {max(sizes)} elements, too large to fold"
            return
        with jax.ensure_compile_time_eval():  # fold concretely even when called under an outer trace
            outs = e.primitive.bind(*[c.array() for c in ins], **e.primitive.get_bind_params(e.params))
        outs = outs if e.primitive.multiple_results else [outs]
        for o, x in zip(e.outvars, outs):
            self._consts[o] = _dense(x)

    def scalar(self, v):
        """``v``'s value as a Python float if it is a constant with one distinct value, else None."""
        c = self.const(v)
        if c is None:
            return None
        if not c.depends:
            return float(c.first())
        if math.prod(c.shape) > FOLD_LIMIT:
            return None
        flat = np.asarray(c.array()).reshape(-1)
        return float(flat[0]) if flat.size and np.all(flat == flat[0]) else None

    def broadcast_root(self, v):
        """(source var, dims): ``v`` is ``source`` broadcast with source dim i at output dim dims[i]."""
        dims = tuple(range(len(v.aval.shape)))
        while (e := self.eqn(v)) is not None:
            name = e.primitive.name
            if name == "broadcast_in_dim":
                src_dims = e.params["broadcast_dimensions"]
                dims = tuple(dims[d] for d in src_dims)
            elif name == "reshape" and _drops_unit_dims(e.invars[0].aval.shape, v.aval.shape) is not None:
                keep = _drops_unit_dims(e.invars[0].aval.shape, v.aval.shape)
                dims = tuple(dims[k] for k in keep)
            elif name in ("convert_element_type", "copy"):
                pass
            else:
                break
            v = e.invars[0]
        shape = v.aval.shape
        return v, tuple(d for d, n in zip(dims, shape)), shape


def _lazy(e, ins: list[Const], shape) -> Const | None:
    """The equation's output as a function of index points, for equations that move or map elements."""
    name, p = e.primitive.name, e.params
    rank = len(shape)
    if name == "iota":
        dim, dtype = p["dimension"], np.dtype(p["dtype"])
        return Const(shape, lambda index: np.asarray(index[dim]).astype(dtype), frozenset({dim}))
    if name == "broadcast_in_dim":
        (src,), dims = ins, p["broadcast_dimensions"]

        def at(index):
            return src.at(tuple(index[d] if src.shape[k] != 1 else 0 for k, d in enumerate(dims)))

        return Const(shape, at, frozenset(dims[k] for k in src.depends))
    if name == "transpose":
        (src,), perm = ins, p["permutation"]
        return Const(
            shape,
            lambda index: src.at(tuple(index[perm.index(j)] for j in range(rank))),
            frozenset(perm.index(j) for j in src.depends),
        )
    if name == "squeeze":
        (src,), dropped = ins, {d % len(ins[0].shape) for d in p["dimensions"]}
        kept = [d for d in range(len(src.shape)) if d not in dropped]

        def at(index):
            full, it = [], iter(index)
            for d in range(len(src.shape)):
                full.append(0 if d in dropped else next(it))
            return src.at(tuple(full))

        return Const(shape, at, frozenset(kept.index(d) for d in src.depends if d in kept))
    if name == "reshape" and p.get("dimensions") is None:
        (src,) = ins
        out_strides = [math.prod(shape[k + 1 :]) for k in range(rank)]
        in_strides = [math.prod(src.shape[k + 1 :]) for k in range(len(src.shape))]

        def at(index):
            flat = sum((np.asarray(i) * s for i, s in zip(index, out_strides)), np.zeros((), int))
            return src.at(tuple((flat // s) % n for s, n in zip(in_strides, src.shape)))

        return Const(shape, at, frozenset(d for d in range(rank) if shape[d] > 1))
    if name == "slice":
        (src,) = ins
        starts, strides = p["start_indices"], p["strides"] or (1,) * rank
        return Const(
            shape,
            lambda index: src.at(tuple(s + np.asarray(i) * k for i, s, k in zip(index, starts, strides))),
            src.depends,
        )
    if name == "rev":
        (src,), flipped = ins, set(p["dimensions"])
        return Const(
            shape,
            lambda index: src.at(
                tuple(n - 1 - np.asarray(i) if d in flipped else i for d, (i, n) in enumerate(zip(index, shape)))
            ),
            src.depends,
        )
    depends = frozenset().union(*(c.depends for c in ins)) if ins else frozenset()
    if name == "convert_element_type":
        (src,), dtype = ins, np.dtype(p["new_dtype"])
        return Const(shape, lambda index: np.asarray(src.at(index)).astype(dtype), depends)
    if not all(_fits(c.shape, shape) for c in ins):
        return None
    ins = [c.fit(shape) for c in ins]  # jax's elementwise ops broadcast size-1 dims
    if name == "select_n":
        pred, *cases = ins

        def at(index):
            which = np.asarray(pred.at(index))
            if len(cases) == 2:
                return np.where(which, cases[1].at(index), cases[0].at(index))
            return np.choose(which.astype(int), np.broadcast_arrays(*[c.at(index) for c in cases]))

        return Const(shape, at, depends)
    if name == "div":
        x, y = ins
        return Const(shape, lambda index: _div(x.at(index), y.at(index)), depends)
    if name in _BINARY and len(ins) == 2:
        fn, (x, y) = _BINARY[name], ins
        return Const(shape, lambda index: fn(x.at(index), y.at(index)), depends)
    if name in _UNARY and len(ins) == 1:
        fn, (x,) = _UNARY[name], ins
        return Const(shape, lambda index: fn(x.at(index)), depends)
    return None


def _fits(src, dst) -> bool:
    return src == () or (len(src) == len(dst) and all(n in (1, m) for n, m in zip(src, dst)))


def _drops_unit_dims(src, dst):
    """For a reshape that only inserts size-1 dims: where each src dim lands in dst (else None)."""
    out, j = [], 0
    for n in src:
        while j < len(dst) and dst[j] != n and dst[j] == 1:
            j += 1
        if j >= len(dst) or dst[j] != n:
            return None
        out.append(j)
        j += 1
    return out if all(d == 1 for d in dst[j:]) else None
