"""A read-only view of one jaxpr level: producers, consumers, constant folding."""

from __future__ import annotations

import jax
import numpy as np
from jax.extend import core as jcore

_PASS_THROUGH = ("broadcast_in_dim", "reshape", "stop_gradient", "convert_element_type", "squeeze", "copy")
_FOLD_LIMIT = 1 << 27  # elements; a (8192, 8192) mask is 2^26


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
        self._values: dict = {v: np.asarray(c) for v, c in zip(jaxpr.constvars, consts)}
        self._not_const: set = set(jaxpr.invars)

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

    def value(self, v):
        """``v``'s value if it depends on no input (iota, literals, constants), else None."""
        if isinstance(v, jcore.Literal):
            return np.asarray(v.val)
        if v in self._values:
            return self._values[v]
        if v in self._not_const:
            return None
        e = self.eqn(v)
        size = int(np.prod(v.aval.shape)) if hasattr(v.aval, "shape") else 1
        if e is None or e.effects or size > _FOLD_LIMIT or e.primitive.name in ("scan", "while", "pallas_call"):
            self._not_const.add(v)
            return None
        ins = [self.value(x) for x in e.invars]
        if any(x is None for x in ins):
            self._not_const.add(v)
            return None
        with jax.ensure_compile_time_eval():  # fold concretely even when called under an outer trace
            outs = e.primitive.bind(*ins, **e.primitive.get_bind_params(e.params))
        outs = outs if e.primitive.multiple_results else [outs]
        for o, x in zip(e.outvars, outs):
            self._values[o] = np.asarray(x)
        return self._values[v]

    def scalar(self, v):
        """``v``'s value as a Python float if it is a constant with one distinct value, else None."""
        x = self.value(v)
        if x is None or x.size == 0:
            return None
        flat = x.reshape(-1)
        return float(flat[0]) if np.all(flat == flat[0]) else None

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
        # drop size-1 source dims (keepdims-style sources) from the mapping
        shape = v.aval.shape
        return v, tuple(d for d, n in zip(dims, shape)), shape


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
