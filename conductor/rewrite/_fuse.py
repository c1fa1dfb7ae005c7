"""Fuse a kernel with the work around it, as a hand-written fused kernel does.

Mamba's CUDA kernel takes Δ before its softplus, x before the Δ·x product, and applies the D skip and
the SiLU(z) gate itself; its backward recomputes all of it (and the convolution before it) from
those inputs and keeps only the states at chunk boundaries. The same effect in JAX: the *island*
of cheap equations (elementwise, broadcasts, slices, pads, casts) and low-rank projections around
the kernel's region is recomputed in the backward pass instead of keeping every intermediate of
size (B, T, D). Where every equation of the island is local in time it runs one chunk at a time
inside the scan's loop over chunks (:mod:`conductor.rewrite._chunk`), the form that holds on every
XLA backend; otherwise it runs whole under ``jax.checkpoint`` with a policy that keeps only what the
kernel names (its chunk-boundary states and its output), which XLA's CPU pipeline does not honour.

Only the XLA kernel takes part: it has the loop to join and names its residuals
(``checkpoint_name``); the checkpoint policy cannot keep the residuals inside a ``custom_vjp``, so
around the Pallas kernel the backward would run its forward again.

The island grows backward from the kernel's inputs through cheap equations and low-rank
projections whose every output is used only inside it, and forward from the kernel's outputs
through cheap equations whose other inputs do not themselves depend on the kernel (so the island
stays one region that can be evaluated at a single point of the program).
"""

from __future__ import annotations

import math

import jax
from jax.extend import core as jcore

from conductor.jaxpr import Substitution, evaluate, replaced_by
from conductor.rewrite._chunk import Unsupported, chunked_island

SAVED_NAMES = ("conductor_scan_state", "conductor_scan_out")

_CHEAP = frozenset(
    """
    add sub mul div neg exp exp2 log log1p expm1 logistic tanh max min abs sign sqrt rsqrt square
    integer_pow pow select_n eq ne lt le gt ge and or not convert_element_type broadcast_in_dim
    reshape squeeze expand_dims transpose slice pad concatenate split stop_gradient copy iota
    """.split()
)


def _cheap(eqn) -> bool:
    name = eqn.primitive.name
    if name == "custom_jvp_call":  # softplus, silu: cheap when their body is
        return all(_cheap(e) for e in eqn.params["call_jaxpr"].jaxpr.eqns)
    if name in ("pjit", "jit"):
        return all(_cheap(e) for e in eqn.params["jaxpr"].jaxpr.eqns)
    return name in _CHEAP and not eqn.effects


def _low_rank(eqn, max_rank: int) -> bool:
    """A ``dot_general`` whose contraction or output features are at most ``max_rank`` wide."""
    if eqn.primitive.name != "dot_general" or not eqn.outvars[0].aval.shape:
        return False
    (contract, _), _ = eqn.params["dimension_numbers"]
    width = math.prod(eqn.invars[0].aval.shape[d] for d in contract)
    return min(width, eqn.outvars[0].aval.shape[-1]) <= max_rank


def island(jaxpr: jcore.Jaxpr, core: Substitution, max_rank: int = 0) -> tuple[set[int], list, list] | None:
    """(equations, inputs, outputs) of the island around ``core``, or None if it adds nothing.

    Besides cheap equations, the island takes in a low-rank projection that feeds it (a
    ``dot_general`` whose contraction or output features are at most ``max_rank`` wide).
    """
    eqns = jaxpr.eqns
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    users: dict = {}
    for i, e in enumerate(eqns):
        for v in e.invars:
            if isinstance(v, jcore.Var):
                users.setdefault(v, set()).add(i)
    level_outs = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
    inside = set(replaced_by(jaxpr, core)) | {core.anchor}
    # everything downstream of the kernel: an equation fed by one of these cannot be an island input
    downstream, frontier = set(core.outvars), list(core.outvars)
    while frontier:
        for i in users.get(frontier.pop(), ()):
            for o in eqns[i].outvars:
                if o not in downstream:
                    downstream.add(o)
                    frontier.append(o)

    def used_only_inside(i):
        return all(o not in level_outs and users.get(o, set()) <= inside for o in eqns[i].outvars)

    grew = True
    while grew:
        grew = False
        for v in _inputs(eqns, inside):  # backward
            i = producer.get(v)
            if (
                i is not None
                and i not in inside
                and (_cheap(eqns[i]) or _low_rank(eqns[i], max_rank))
                and used_only_inside(i)
            ):
                inside.add(i)
                grew = True
        for v in _outputs(eqns, inside, users, level_outs):  # forward
            after = users.get(v, set()) - inside
            if v in level_outs or not all(_cheap(eqns[i]) for i in after):
                continue
            feeds = [x for i in after for x in eqns[i].invars if isinstance(x, jcore.Var)]
            if all((x in downstream and producer.get(x) in inside) or x not in downstream for x in feeds):
                inside |= after
                grew = True
    outputs = _outputs(eqns, inside, users, level_outs)
    last = max(inside)
    if any(i < last for v in outputs for i in users.get(v, set()) - inside):
        return None  # an outside use comes before the island's last equation: no single point to run it
    if len(inside) == len(replaced_by(jaxpr, core)) + 1:
        return None
    return inside, _inputs(eqns, inside), outputs


def _inputs(eqns, inside) -> list:
    made = {v for i in inside for v in eqns[i].outvars}
    seen, out = set(), []
    for i in sorted(inside):
        for v in eqns[i].invars:
            if isinstance(v, jcore.Var) and v not in made and v not in seen:
                seen.add(v)
                out.append(v)
    return out


def _outputs(eqns, inside, users, level_outs) -> list:
    return [
        v
        for i in sorted(inside)
        for v in eqns[i].outvars
        if not isinstance(v, jcore.DropVar) and (v in level_outs or users.get(v, set()) - inside)
    ]


def fused(jaxpr: jcore.Jaxpr, core: Substitution, *, max_rank: int = 0, per_chunk: dict | None = None) -> Substitution:
    """``core`` grown over its island (``core`` itself if no island).

    With ``per_chunk`` (``chunk_core``, ``seq``, ``chunk``: see :func:`chunked_island`) the island runs
    one time chunk at a time inside the scan's loop where every equation of it is local in time;
    otherwise it runs whole under ``jax.checkpoint``.
    """
    found = island(jaxpr, core, max_rank)
    if found is None or jaxpr.debug_info is None:
        return core
    inside, inputs, outputs = found
    order = sorted(inside)
    if per_chunk is not None:
        try:
            fn = chunked_island(
                [jaxpr.eqns[i] for i in order],
                inputs,
                outputs,
                jaxpr.eqns[core.anchor],
                core.inputs,
                core.outvars,
                **per_chunk,
            )
            # traced once on abstract inputs: an equation whose parameters do not carry over to a
            # chunk fails here (a shape error), and the island then runs whole
            got = jax.eval_shape(fn, *(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in inputs))
        except (Unsupported, TypeError, ValueError):
            pass
        else:
            if [(x.shape, x.dtype) for x in got] == [(v.aval.shape, v.aval.dtype) for v in outputs]:
                return Substitution(anchor=order[-1], inputs=tuple(inputs), outvars=tuple(outputs), fn=fn)
    info = jaxpr.debug_info._replace(arg_names=("",) * len(inputs), result_paths=("",) * len(outputs))
    body = jcore.Jaxpr([], inputs, outputs, [jaxpr.eqns[i] for i in order], debug_info=info)
    inner = Substitution(anchor=order.index(core.anchor), inputs=core.inputs, outvars=core.outvars, fn=core.fn)

    def plan(level, path):
        return [inner] if level is body else ()

    policy = jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES)

    def fn(*xs):
        return jax.checkpoint(lambda *ys: evaluate(body, (), ys, plan=plan), policy=policy)(*xs)

    return Substitution(anchor=order[-1], inputs=tuple(inputs), outvars=tuple(outputs), fn=fn)
