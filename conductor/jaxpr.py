"""Evaluate a jaxpr equation by equation with ``bind``, substituting chosen regions.

The conductor never edits a jaxpr in place: it re-traces. ``evaluate`` walks
the equations, binds each primitive (keeping its module scope, the name stack),
inlines ``jit`` calls, rebuilds ``scan`` and ``checkpoint`` (remat) through
their public APIs so their bodies are walked the same way, and where a
:class:`Substitution` anchors an equation it calls the substitute instead.
Only equations the outputs need are evaluated, so a region whose outputs are
all replaced disappears (its big intermediates are never built). Used under
``jax.make_jaxpr`` it returns a flattened jaxpr; under ``jax.grad`` the
substitutes' custom VJPs are what get differentiated.

This is the conductor's own jaxpr interpreter, shared by :mod:`conductor.match`
(which flattens a step before matching) and :mod:`conductor.rewrite` (which
re-traces it with substitutes). It is a public module so that those subpackages
import it by its public name; ``conductor`` does not re-export it, since users
reach it through ``conductor.optimize`` and ``conductor.inspect``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax

# The name stack (module scopes) of an equation is only reachable through this
# private module; jax.core.eval_jaxpr uses it the same way (checked on jax 0.10.2).
from jax._src import source_info_util
from jax.extend import core as jcore

JIT_PRIMITIVES = ("jit", "pjit")
REMAT_PRIMITIVES = ("checkpoint", "remat2")

__all__ = ["Planner", "Substitution", "evaluate", "flatten", "replaced_by", "scope_of"]


@dataclass(frozen=True, slots=True)
class Substitution:
    """Replace ``outvars`` of one jaxpr level by ``fn(*inputs)`` (evaluated at equation ``anchor``)."""

    anchor: int
    inputs: tuple
    outvars: tuple
    fn: Callable


Planner = Callable[[jcore.Jaxpr, tuple[str, ...]], Sequence[Substitution]]


def _no_substitutions(jaxpr, path):
    return ()


def scope_of(eqn) -> str:
    """The equation's module scope, e.g. ``GPT/blocks_0/attn`` (transforms like ``jvp(...)`` stripped)."""
    return "/".join(part.name for part in eqn.source_info.name_stack.stack if type(part).__name__ == "Scope")


def _needed(jaxpr, subs: dict[int, Substitution]) -> list[int]:
    """Per equation: 0 skip, 1 only its substitute is needed, 2 bind it (and its substitute if any)."""
    live = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
    keep = [0] * len(jaxpr.eqns)
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if i in subs:
            sub = subs[i]
            if any(v in live for v in sub.outvars):
                keep[i] = 1
                live.update(v for v in sub.inputs if isinstance(v, jcore.Var))
            if not any(v in live for v in eqn.outvars if v not in sub.outvars):
                continue
        if eqn.effects or any(v in live for v in eqn.outvars):
            keep[i] = 2
            live.update(v for v in eqn.invars if isinstance(v, jcore.Var))
    return keep


def replaced_by(jaxpr: jcore.Jaxpr, substitution: Substitution) -> list[int]:
    """The equations of ``jaxpr`` that are no longer evaluated once ``substitution`` is in place."""
    before, after = _needed(jaxpr, {}), _needed(jaxpr, {substitution.anchor: substitution})
    return [i for i, (b, a) in enumerate(zip(before, after)) if b and a != 2]


def evaluate(jaxpr: jcore.Jaxpr, consts, args, *, plan: Planner = _no_substitutions, path: tuple[str, ...] = ()):
    """Run ``jaxpr`` on ``args`` (values or tracers), substituting what ``plan(jaxpr, path)`` returns."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    subs = {s.anchor: s for s in plan(jaxpr, path)}
    keep = _needed(jaxpr, subs)
    for i, eqn in enumerate(jaxpr.eqns):
        if not keep[i]:
            continue
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
            if i in subs:
                sub = subs[i]
                outs = sub.fn(*map(read, sub.inputs))
                env.update(zip(sub.outvars, outs))
                if keep[i] == 1:
                    continue
            outs = _bind(eqn, list(map(read, eqn.invars)), plan, path)
        env.update((v, x) for v, x in zip(eqn.outvars, outs) if not isinstance(v, jcore.DropVar))
    return [read(v) for v in jaxpr.outvars]


def _bind(eqn, invals, plan, path):
    name = eqn.primitive.name
    params = eqn.params
    if name in JIT_PRIMITIVES:
        closed = params["jaxpr"]
        return evaluate(closed.jaxpr, closed.consts, invals, plan=plan, path=(*path, f"jit:{params.get('name', '')}"))
    if name == "scan":
        return _scan(eqn, invals, plan, path)
    if name in REMAT_PRIMITIVES:
        body = params["jaxpr"]

        def fn(*xs):
            return evaluate(body, (), xs, plan=plan, path=(*path, "remat"))

        return jax.checkpoint(fn, prevent_cse=params["prevent_cse"], policy=params["policy"])(*invals)
    outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
    return outs if eqn.primitive.multiple_results else [outs]


def _scan(eqn, invals, plan, path):
    p = eqn.params
    closed, n_consts, n_carry = p["jaxpr"], p["num_consts"], p["num_carry"]
    consts, carry, xs = invals[:n_consts], invals[n_consts : n_consts + n_carry], invals[n_consts + n_carry :]

    def body(c, x):
        outs = evaluate(closed.jaxpr, closed.consts, [*consts, *c, *x], plan=plan, path=(*path, "scan"))
        return outs[:n_carry], outs[n_carry:]

    carry_out, ys = jax.lax.scan(body, carry, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    return [*carry_out, *ys]


def flatten(fn: Callable, *args) -> tuple[jcore.ClosedJaxpr, object]:
    """The jaxpr of ``fn(*args)`` with every ``jit`` inlined (also inside scan and remat bodies), and the output tree."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    flat = jax.make_jaxpr(lambda *xs: evaluate(closed.jaxpr, closed.consts, xs))(*jax.tree.leaves(args))
    return flat, jax.tree.structure(out_shape)
