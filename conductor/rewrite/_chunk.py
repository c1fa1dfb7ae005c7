"""Run a selective scan's island one time chunk at a time, inside the scan's own loop over chunks.

XLA's CPU pipeline drops optimisation barriers, so a ``jax.checkpoint`` around straight-line code
does not hold there: the recomputation is merged with the forward pass or scheduled before the
backward one, and every intermediate of the island stays alive. Only a loop keeps the two apart.
So the island's equations (projections, convolution, softplus, the Δ·x product, skip and gate)
run per chunk of L steps in the body of a ``lax.scan`` over chunks, checkpointed, with the chunk's
sequential scan in the middle. The forward pass keeps the island's inputs (cut into chunk windows)
and the state at each chunk boundary; the backward pass recomputes one chunk's island and states
at a time. This is what Mamba's fused CUDA kernel keeps, too.

Every equation must be local in time. Each time-indexed value has a time axis; an equation maps
row t of its inputs to row t of its outputs, except ``slice`` and ``pad`` along the time axis,
which shift rows (a causal convolution written as shifted slices of a padded input). A value whose
consumers need rows before the chunk gets a window of L + halo rows, [cL + s, cL + L + e); the
island's inputs are cut into such overlapping windows, and ``pad`` puts its padding value on the
rows that fall outside its input. Anything else (a reduction or contraction over time, ``iota``
along time, a halo longer than a chunk) leaves the island as it is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

_CALLS = {"custom_jvp_call": "call_jaxpr", "pjit": "jaxpr", "jit": "jaxpr"}
# row t of the output from row t of the inputs (slice and pad: from a shifted row, see ``windows``)
_ROWWISE = frozenset(
    """
    add sub mul div neg exp exp2 log log1p expm1 logistic tanh max min abs sign sqrt rsqrt square
    integer_pow pow select_n eq ne lt le gt ge and or not convert_element_type stop_gradient copy
    slice pad custom_jvp_call pjit jit
    """.split()
)


class Unsupported(Exception):
    """An equation of the island is not local in time."""


def _timed(x, tax: dict) -> bool:
    return isinstance(x, jcore.Var) and x in tax


def _shape(v):
    return tuple(v.aval.shape)


def _same_time(x, t, out):
    """Whether operand ``x`` carries ``out``'s time axis ``t`` (same rank, same length there)."""
    return len(_shape(x)) == len(_shape(out)) and _shape(x)[t] == _shape(out)[t] and _shape(out)[t] != 1


def _forward(eqn, tax) -> list:
    """Time axes of ``eqn``'s outputs from those of its inputs (None: no time axis)."""
    name, p = eqn.primitive.name, eqn.params
    timed = [(i, tax[v]) for i, v in enumerate(eqn.invars) if isinstance(v, jcore.Var) and v in tax]
    if not timed:
        return [None] * len(eqn.outvars)
    i, t = timed[0]
    if name == "broadcast_in_dim":
        return [p["broadcast_dimensions"][t]]
    if name == "reshape":
        if _shape(eqn.invars[0])[: t + 1] != tuple(p["new_sizes"])[: t + 1]:
            raise Unsupported("reshape across the time axis")
        return [t]
    if name == "squeeze":
        if t in p["dimensions"]:
            raise Unsupported("squeeze of the time axis")
        return [t - sum(d < t for d in p["dimensions"])]
    if name == "transpose":
        return [list(p["permutation"]).index(t)]
    if name in ("split", "concatenate"):
        if p.get("axis", p.get("dimension")) == t:
            raise Unsupported(f"{name} along time")
        return [t] * len(eqn.outvars)
    if name == "dot_general":
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        if len(timed) > 1 or t in (lc if i == 0 else rc) or t in (lb if i == 0 else rb):
            raise Unsupported("contraction over time")
        ln, rn = len(_shape(eqn.invars[0])), len(_shape(eqn.invars[1]))
        lfree = [d for d in range(ln) if d not in lc and d not in lb]
        rfree = [d for d in range(rn) if d not in rc and d not in rb]
        return [len(lb) + lfree.index(t)] if i == 0 else [len(lb) + len(lfree) + rfree.index(t)]
    if name not in _ROWWISE:
        raise Unsupported(f"{name} of a time-indexed value")
    for _, t2 in timed[1:]:
        if t2 != t:
            raise Unsupported(f"{name} of values with different time axes")
    return [t if len(_shape(o)) == len(_shape(eqn.invars[i])) else None for o in eqn.outvars]


def _backward(eqn, out_tax: int) -> list:
    """Time axes of ``eqn``'s inputs given its (first timed) output's time axis."""
    name, p = eqn.primitive.name, eqn.params
    out = eqn.outvars[0]
    ins = eqn.invars
    if name == "broadcast_in_dim":
        dims = list(p["broadcast_dimensions"])
        if out_tax in dims and _shape(ins[0])[dims.index(out_tax)] == _shape(out)[out_tax]:
            return [dims.index(out_tax)]
        return [None]
    if name == "reshape":
        kept = _shape(ins[0])[: out_tax + 1] == _shape(out)[: out_tax + 1]
        return [out_tax if kept else None] + [None] * (len(ins) - 1)
    if name == "squeeze":
        kept = [d for d in range(len(_shape(ins[0]))) if d not in p["dimensions"]]
        return [kept[out_tax]]
    if name == "transpose":
        return [p["permutation"][out_tax]]
    if name == "dot_general":
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        ln, rn = len(_shape(ins[0])), len(_shape(ins[1]))
        lfree = [d for d in range(ln) if d not in lc and d not in lb]
        rfree = [d for d in range(rn) if d not in rc and d not in rb]
        if out_tax < len(lb):
            raise Unsupported("time as a batch dimension of a contraction")
        k = out_tax - len(lb)
        return [lfree[k], None] if k < len(lfree) else [None, rfree[k - len(lfree)]]
    if name == "concatenate":
        return [out_tax] * len(ins)
    if name in ("slice", "pad"):  # the same axes, the time axis longer or shorter
        return [out_tax] + [None] * (len(ins) - 1)
    return [out_tax if isinstance(x, jcore.Var) and _same_time(x, out_tax, out) else None for x in ins]


def _settle(tax: dict, v, t: int) -> None:
    if tax.setdefault(v, t) != t:
        raise Unsupported("a value with two time axes")


def time_axes(eqns, known: dict) -> dict:
    """Time axis of every time-indexed value of ``eqns`` (in program order), from ``known`` ones."""
    tax = dict(known)
    size = -1
    while size != len(tax):
        size = len(tax)
        for eqn in eqns:
            for o, t in zip(eqn.outvars, _forward(eqn, tax)):
                if t is not None:
                    _settle(tax, o, t)
            timed_out = [tax[o] for o in eqn.outvars if o in tax]
            if timed_out and eqn.invars:
                for x, t in zip(eqn.invars, _backward(eqn, timed_out[0])):
                    if t is not None and isinstance(x, jcore.Var):
                        _settle(tax, x, t)
    for eqn in eqns:
        if any(o in tax for o in eqn.outvars) and not any(_timed(x, tax) for x in eqn.invars):
            if eqn.primitive.name != "broadcast_in_dim":  # a constant broadcast along time is the same in every chunk
                raise Unsupported(f"{eqn.primitive.name} makes a time axis from nothing")
        if eqn.primitive.name in _CALLS and any(_timed(x, tax) for x in eqn.invars):
            inner = eqn.params[_CALLS[eqn.primitive.name]].jaxpr
            inner_tax = time_axes(inner.eqns, {v: tax[x] for v, x in zip(inner.invars, eqn.invars) if _timed(x, tax)})
            if any(e.primitive.name in ("slice", "pad") and _timed(e.invars[0], inner_tax) for e in inner.eqns):
                raise Unsupported(f"a shift in time inside {eqn.primitive.name}")
    return tax


def windows(eqns, tax: dict, outputs, chunk: int, core) -> dict:
    """Rows (s, e) each time-indexed value needs around a chunk: [cL + s, cL + L + e).

    ``core``: (equation, inputs, outputs) of the chunk's scan, which reads and writes exactly its chunk.
    """
    need: dict = {v: (0, 0) for v in outputs}
    for eqn in reversed(eqns):
        if eqn is core[0]:
            if any(need.get(v, (0, 0)) != (0, 0) for v in core[2]):
                raise Unsupported("the scan's output is needed beyond its chunk")
            for x in core[1]:
                if x in tax:
                    old = need.get(x, (0, 0))
                    need[x] = (min(old[0], 0), max(old[1], 0))
            continue
        got = [need[o] for o in eqn.outvars if o in need]
        if not got:
            continue
        s, e = min(g[0] for g in got), max(g[1] for g in got)
        for o in eqn.outvars:
            if o in tax:
                need[o] = (s, e)
        shift = 0
        if eqn.primitive.name == "slice" and _timed(eqn.invars[0], tax):
            t = tax[eqn.invars[0]]
            if eqn.params["strides"] not in (None, (1,) * len(eqn.params["start_indices"])):
                raise Unsupported("strided slice along time")
            shift = eqn.params["start_indices"][t]
        if eqn.primitive.name == "pad" and _timed(eqn.invars[0], tax):
            lo, _, interior = eqn.params["padding_config"][tax[eqn.invars[0]]]
            if interior:
                raise Unsupported("interior padding along time")
            shift = -lo
        for x in eqn.invars:
            if _timed(x, tax):
                old = need.get(x, (s + shift, e + shift))
                need[x] = (min(old[0], s + shift), max(old[1], e + shift))
    for s, e in need.values():
        if e - s > chunk:
            raise Unsupported("a halo longer than a chunk")
    return need


def chunk_windows(x, t: int, s: int, e: int, chunk: int, n_chunks: int):
    """(n_chunks, …) windows of rows [cL + s, cL + L + e) of ``x`` along axis ``t`` (zeros outside it)."""
    width = chunk + e - s
    config = [(0, 0, 0)] * x.ndim
    config[t] = (-s, (n_chunks + 1) * chunk - x.shape[t] + s, 0)  # row i of xp is row i + s of x
    xp = lax.pad(x, jnp.zeros((), x.dtype), config)

    def split(y):  # (…, n_chunks·L, …) → (n_chunks, …, L, …)
        y = y.reshape(*y.shape[:t], n_chunks, chunk, *y.shape[t + 1 :])
        return jnp.moveaxis(y, t, 0)

    main = split(lax.slice_in_dim(xp, 0, n_chunks * chunk, axis=t))
    if width == chunk:
        return main
    extra = split(lax.slice_in_dim(xp, chunk, (n_chunks + 1) * chunk, axis=t))
    return jnp.concatenate([main, lax.slice_in_dim(extra, 0, width - chunk, axis=t + 1)], axis=t + 1)


def unchunk(y, t: int):
    """(n_chunks, …, L, …) → (…, n_chunks·L, …) along axis ``t``."""
    y = jnp.moveaxis(y, 0, t)
    return y.reshape(*y.shape[:t], y.shape[t] * y.shape[t + 1], *y.shape[t + 2 :])


def run_chunk(eqns, env: dict, tax: dict, need: dict, c, chunk: int, core=None):
    """Evaluate ``eqns`` for chunk ``c`` into ``env`` (time-indexed values hold their window only).

    ``core``: (anchor equation, inputs, outputs, fn) evaluated in place of that equation, fn taking
    and returning arrays of one chunk.
    """

    def read(v, s=None, e=None):
        if isinstance(v, jcore.Literal):
            return v.val
        x = env[v]
        if not _timed(v, tax) or s is None:
            return x
        s0 = need[v][0]
        return lax.slice_in_dim(x, s - s0, s - s0 + chunk + e - s, axis=tax[v])

    for eqn in eqns:
        if core is not None and eqn is core[0]:
            _, inputs, outvars, fn = core
            outs = fn(*[read(v, 0, 0) for v in inputs])
            env.update(zip(outvars, outs))
            continue
        s, e = next((need[o] for o in eqn.outvars if o in need), (0, 0))
        width = chunk + e - s
        name, params = eqn.primitive.name, dict(eqn.params)
        t_out = next((tax[o] for o in eqn.outvars if o in tax), None)
        x0 = eqn.invars[0] if eqn.invars else None
        if name == "slice" and _timed(x0, tax):
            t = tax[x0]
            k = params["start_indices"][t]
            x = read(x0, s + k, e + k)
            start, limit = list(params["start_indices"]), list(params["limit_indices"])
            start[t], limit[t] = 0, width
            outs = [lax.slice(x, start, limit)]
        elif name == "pad" and _timed(x0, tax):
            t = tax[x0]
            config = [tuple(cfg) for cfg in params["padding_config"]]
            lo = config[t][0]
            n_in = _shape(x0)[t]
            config[t] = (0, 0, 0)
            value = read(eqn.invars[1])
            y = lax.pad(read(x0, s - lo, e - lo), value, config)
            rows = c * chunk + s - lo + jnp.arange(width)  # the input row each output row reads
            inside = (rows >= 0) & (rows < n_in)
            outs = [jnp.where(inside.reshape([-1 if d == t else 1 for d in range(y.ndim)]), y, value)]
        elif name in _CALLS and any(_timed(x, tax) for x in eqn.invars):
            closed = params[_CALLS[name]]
            inner = closed.jaxpr
            args = [read(x, s, e) if _timed(x, tax) else read(x) for x in eqn.invars]
            inner_tax = time_axes(inner.eqns, {v: tax[x] for v, x in zip(inner.invars, eqn.invars) if _timed(x, tax)})
            inner_env = dict(zip(inner.constvars, closed.consts))
            inner_env.update(zip(inner.invars, args))
            inner_need = {v: (s, e) for v in inner_tax}
            run_chunk(inner.eqns, inner_env, inner_tax, inner_need, c, chunk)
            outs = [inner_env[v] if isinstance(v, jcore.Var) else v.val for v in inner.outvars]
        else:
            args = [read(x, s, e) if _timed(x, tax) else read(x) for x in eqn.invars]
            if name == "broadcast_in_dim" and t_out is not None:
                shape = list(params["shape"])
                shape[t_out] = width
                params["shape"] = tuple(shape)
            elif name == "reshape" and t_out is not None:
                sizes = list(params["new_sizes"])
                sizes[t_out] = width
                params["new_sizes"] = tuple(sizes)
            outs = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(params))
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update((v, x) for v, x in zip(eqn.outvars, outs) if not isinstance(v, jcore.DropVar))


def chunked_island(body_eqns, inputs, outputs, core_eqn, core_inputs, core_outvars, chunk_core, seq: int, chunk: int):
    """``fn(*inputs) -> outputs`` running ``body_eqns`` one chunk at a time around ``chunk_core``.

    Args:
      body_eqns: the island's equations in program order (``core_eqn`` among them).
      inputs, outputs: the island's input and output variables.
      core_eqn, core_inputs, core_outvars: the scan equation the kernel replaces, the kernel's
        inputs (Δ, A, v, B, C; batch-major) and its output (y, time-major).
      chunk_core: ``(h, dt, a, v, b, c) -> (h, y)`` over one chunk: (B, L, ·) in, y (L, B, D) out.
      seq, chunk: sequence length T and chunk length L (L divides T).
    Raises:
      Unsupported: an equation is not local in time (the caller then keeps the island whole).
    """
    live, kept = set(outputs), []
    for eqn in reversed(body_eqns):  # only what the outputs need: the written (B, T, D, N) region drops out
        if eqn is core_eqn or any(o in live for o in eqn.outvars):
            kept.append(eqn)
            live.update(x for x in (core_inputs if eqn is core_eqn else eqn.invars) if isinstance(x, jcore.Var))
    body_eqns = kept[::-1]
    known = {v: 1 for v in core_inputs if len(_shape(v)) == 3}
    known.update({v: 0 for v in core_outvars})
    tax = time_axes([e for e in body_eqns if e is not core_eqn], known)
    if core_inputs[1] in tax:
        raise Unsupported("A varies in time")
    for v in outputs:
        if v not in tax or _shape(v)[tax[v]] != seq:
            raise Unsupported("an island output without the time axis")
    need = windows(body_eqns, tax, outputs, chunk, (core_eqn, core_inputs, core_outvars))
    n_chunks = seq // chunk
    timed = [v for v in inputs if v in need]
    steady = [v for v in inputs if v not in tax]
    h_shape = (_shape(core_inputs[0])[0], *_shape(core_inputs[1]))
    h_dtype = jnp.result_type(*(v.aval.dtype for v in core_inputs[:4]))

    def fn(*xs):
        by_var = dict(zip(inputs, xs))
        wins = [chunk_windows(by_var[v], tax[v], *need[v], chunk, n_chunks) for v in timed]
        consts = [by_var[v] for v in steady]

        @jax.checkpoint  # the backward pass recomputes the chunk; the loop keeps that apart from the forward
        def body(h, step):
            c, ws = step
            env = dict(zip(timed, ws))
            env.update(zip(steady, consts))
            carry = {}

            def core_fn(dt, a, v, b, cc):
                carry["h"], y = chunk_core(h, dt, a, v, b, cc)
                return [y.astype(core_outvars[0].aval.dtype)]

            run_chunk(body_eqns, env, tax, need, c, chunk, core=(core_eqn, core_inputs, core_outvars, core_fn))
            return carry["h"], [env[v] for v in outputs]

        h0 = jnp.zeros(h_shape, h_dtype)
        _, ys = lax.scan(body, h0, (jnp.arange(n_chunks), wins))
        return [unchunk(y, tax[v]) for y, v in zip(ys, outputs)]

    return fn


__all__ = ["Unsupported", "chunked_island"]
