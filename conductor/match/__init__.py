"""Pattern matching on traced steps: attention, linear recurrences, existing Pallas kernels.

``find(closed_jaxpr)`` walks a (jit-flattened) jaxpr and, recursively, the
bodies of scan, remat, custom_vjp and custom_jvp equations, and returns one
:class:`Match` per block found.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import jax
from jax.extend import core as jcore

from conductor.jaxpr import evaluate, scope_of
from conductor.match._attention import match_attention
from conductor.match._graph import Graph
from conductor.match._scan import match_recurrence

Pattern = Literal["attention", "selective_scan", "linear_recurrence", "pallas_call"]
PATTERNS: tuple[Pattern, ...] = ("attention", "selective_scan", "linear_recurrence", "pallas_call")


@dataclass(frozen=True, slots=True, kw_only=True)
class Match:
    """One block found in a traced step.

    Attributes:
      pattern: what it is.
      scope: module scope of the block (``GPT/blocks_0/attn``).
      path: where in nested bodies (``("scan",)``, ``("remat",)``; empty at top level).
      shapes: the kernel-layout shapes (attention: q (B, T, H, D), k (B, S, Hkv, D);
        selective scan: batch, seq, d_inner, d_state).
      details: causal, mask ``kind``/``window``/``prefix``, scale (attention), the reason it cannot
        be rewritten (``problems``).
      rewritable: whether a kernel can replace it exactly.
    """

    pattern: Pattern
    scope: str
    path: tuple[str, ...]
    shapes: dict
    details: dict
    rewritable: bool
    anchor: int = field(default=-1, compare=False, repr=False)
    region: dict = field(default_factory=dict, compare=False, repr=False)
    level: object = field(default=None, compare=False, repr=False)  # the jaxpr it was found in


def _strip_einsum(scope: str) -> str:
    return "/".join(part for part in scope.split("/") if "->" not in part)


def match_level(jaxpr: jcore.Jaxpr, consts=(), path: tuple[str, ...] = (), known: dict | None = None) -> list[Match]:
    """Matches at one jaxpr level (nested bodies not entered); ``known``: inputs of the level that
    are constants computed outside it (``Const`` s by var)."""
    g = Graph(jaxpr, consts).assuming(known) if known else Graph(jaxpr, consts)
    found: list[Match] = []
    for i, eqn in enumerate(jaxpr.eqns):
        name = eqn.primitive.name
        scope = _strip_einsum(scope_of(eqn))
        if name == "dot_general":
            att = match_attention(g, i)
            if att is not None:
                problems = att["problems"]
                found.append(
                    Match(
                        pattern="attention",
                        scope=scope,
                        path=path,
                        shapes=dict(att["shapes"]),
                        details={
                            "causal": att["causal"],
                            **att["mask"],  # kind, window, prefix
                            "scale": att["scale"],
                            "problems": tuple(problems),
                        },
                        rewritable=not problems,
                        anchor=i,
                        region=att,
                        level=jaxpr,
                    )
                )
        elif name == "scan":
            rec = match_recurrence(g, i)
            if rec is not None:
                sel = rec["selective"]
                if sel is not None:
                    b, t, d = sel["dt"].aval.shape
                    shapes = {"batch": b, "seq": t, "d_inner": d, "d_state": sel["a"].aval.shape[1]}
                    pattern: Pattern = "selective_scan"
                else:
                    shapes = {"seq": rec["length"], "state": rec["state_shape"]}
                    pattern = "linear_recurrence"
                found.append(
                    Match(
                        pattern=pattern,
                        scope=scope,
                        path=path,
                        shapes=shapes,
                        details={"problems": tuple(rec["problems"])},
                        rewritable=sel is not None or rec["parallel_ok"],
                        anchor=i,
                        region=rec,
                        level=jaxpr,
                    )
                )
        elif name == "pallas_call":
            found.append(
                Match(
                    pattern="pallas_call",
                    scope=scope,
                    path=path,
                    shapes={"outputs": tuple(tuple(v.aval.shape) for v in eqn.outvars)},
                    details={"name": str(eqn.params.get("name", "")), "problems": ("existing kernel, left alone",)},
                    rewritable=False,
                    anchor=i,
                )
            )
    return found


_BODIES = {
    "scan": ("jaxpr", "scan"),
    "checkpoint": ("jaxpr", "remat"),
    "remat2": ("jaxpr", "remat"),
    "custom_vjp_call": ("call_jaxpr", "custom_vjp"),
    "custom_jvp_call": ("call_jaxpr", "custom_jvp"),
    "jit": ("jaxpr", "jit"),
    "pjit": ("jaxpr", "jit"),
}


def _flattened(jaxpr, consts):
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars]
    flat = jax.make_jaxpr(lambda *xs: evaluate(jaxpr, consts, xs))(*avals)
    return flat.jaxpr, flat.consts


def find(closed: jcore.ClosedJaxpr) -> list[Match]:
    """All matches in ``closed`` and, recursively, in its scan/remat/custom_vjp/custom_jvp/jit bodies."""
    return _find(closed.jaxpr, closed.consts, ())


def _find(jaxpr, consts, path, known=None) -> list[Match]:
    found = match_level(jaxpr, consts, path, known)
    outer = None
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _BODIES:
            key, label = _BODIES[eqn.primitive.name]
            body = eqn.params.get(key)
            if body is None:
                continue
            inner, inner_consts = (body.jaxpr, body.consts) if hasattr(body, "jaxpr") else (body, ())
            if label in ("custom_vjp", "custom_jvp"):  # not flattened by the rewrite: inline its jits to match
                inner, inner_consts = _flattened(inner, inner_consts)
            inner_known = None
            if label in ("scan", "remat"):  # a mask built outside from iota stays a constant inside
                outer = outer or (Graph(jaxpr, consts).assuming(known) if known else Graph(jaxpr, consts))
                n = eqn.params["num_consts"] if label == "scan" else len(eqn.invars)
                pairs = zip(inner.invars[:n], eqn.invars[:n])
                inner_known = {v: c for v, x in pairs if (c := outer.const(x)) is not None}
            sub = _find(inner, inner_consts, (*path, label), inner_known)
            if label in ("custom_vjp", "custom_jvp"):  # reported; rewriting would drop the user's derivative rule
                sub = [
                    Match(
                        pattern=m.pattern,
                        scope=m.scope,
                        path=m.path,
                        shapes=m.shapes,
                        details={**m.details, "problems": (*m.details["problems"], f"inside a {label} body")},
                        rewritable=False,
                    )
                    for m in sub
                ]
            found.extend(sub)
    return found


__all__ = ["PATTERNS", "Match", "Pattern", "find", "match_level"]
