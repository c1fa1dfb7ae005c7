"""``optimize``: the same function, with its matched blocks running as kernels.

The function is traced once per argument signature, flattened (``jit``
inlined), matched and decided; each call then re-evaluates the flattened
jaxpr with ``bind``, calling the kernels in place of the matched regions.
Because the result is ordinary traceable JAX, ``jax.jit`` and ``jax.grad``
compose with it and the backward pass uses the kernels' custom VJPs.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

from conductor.decide import Decision, Policy, decide
from conductor.jaxpr import evaluate, flatten, replaced_by
from conductor.match import Match, find
from conductor.rewrite._substitute import kernel_substitution, substitution


class ConductorWarning(UserWarning):
    """The numerics guard found the rewritten function disagreeing with the original."""


@dataclass(slots=True)
class _Entry:
    closed: object
    out_tree: object
    chosen: list[tuple[Match, Decision]]
    all: list[tuple[Match, Decision]]
    guarded: bool = False
    fallback: bool = False

    def plan(self, jaxpr, path):
        if self.fallback:
            return ()
        return [substitution(m, d) for m, d in self.chosen if m.level is jaxpr]


def _is_array(x) -> bool:
    return isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct) or isinstance(x, jax.core.Tracer)


def _is_train_state(x) -> bool:
    return callable(getattr(x, "apply_fn", None)) and hasattr(x, "replace") and hasattr(x, "params")


def _split(args, kwargs):
    leaves, tree = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]
    static = tuple((i, x) for i, x in enumerate(leaves) if i not in set(dynamic))
    return leaves, tree, dynamic, static


def optimize(fn: Callable, *, policy: Policy | None = None) -> Callable:
    """``fn`` with its attention and selective scans rewritten into kernels where the policy allows.

    Args:
      fn: any JAX function of arrays (a loss of (params, batch), a Flax ``apply``, a forward), or a
        train step taking a flax ``TrainState``: then the state's ``apply_fn`` is what gets rewritten
        (a traced step already holds its backward pass, which re-tracing cannot swap for a kernel's VJP).
        Non-array leaves of the arguments are treated as static.
      policy: what may be rewritten and how (:class:`conductor.Policy`).
    Returns:
      A function with ``fn``'s signature. ``.inspect(*args)`` on it lists the matches and decisions.
    Raises:
      ConductorWarning (as a warning): the first concrete call disagreed with ``fn``; ``fn`` is used from then on.

    Example:
      >>> import jax, jax.numpy as jnp, conductor
      >>> def attn(q, k, v):
      ...     return jax.nn.softmax(q @ k.T / 8.0) @ v
      >>> fast = conductor.optimize(attn, policy=conductor.Policy(attention="force"))
      >>> x = jnp.ones((64, 64))
      >>> bool(jnp.allclose(fast(x, x, x), attn(x, x, x), atol=1e-5))
      True
    """
    policy = policy or Policy()
    cache: dict = {}

    def entry_for(args, kwargs) -> tuple[_Entry, list]:
        leaves, tree, dynamic, static = _split(args, kwargs)
        avals = tuple(jax.ShapeDtypeStruct(np.shape(leaves[i]), leaves[i].dtype) for i in dynamic)
        key = (tree, static, avals)
        if key not in cache:

            def pure(*xs):
                full = list(leaves)
                for i, x in zip(dynamic, xs):
                    full[i] = x
                a, kw = jax.tree.unflatten(tree, full)
                return fn(*a, **kw)

            closed, out_tree = flatten(pure, *avals)
            found = [(m, _with_replaced(m, decide(m, policy))) for m in find(closed)]
            chosen = [(m, d) for m, d in found if d.rewrite]
            cache[key] = _Entry(closed, out_tree, chosen, found)
        return cache[key], [leaves[i] for i in dynamic]

    apply_cache: dict = {}

    def with_optimized_apply(x):
        # A flax TrainState: rewrite the model (apply_fn), so the step's own jax.grad runs the kernels' VJPs.
        if apply_cache.get("fn") is not x.apply_fn:
            apply_cache["fn"], apply_cache["optimized"] = x.apply_fn, optimize(x.apply_fn, policy=policy)
        return x.replace(apply_fn=apply_cache["optimized"])

    @functools.wraps(fn)
    def optimized(*args, **kwargs):
        if any(_is_train_state(a) for a in args):
            out = fn(*[with_optimized_apply(a) if _is_train_state(a) else a for a in args], **kwargs)

            def restore(x):  # hand back states with the caller's apply_fn: same pytree metadata in and out
                if _is_train_state(x) and x.apply_fn is apply_cache.get("optimized"):
                    return x.replace(apply_fn=apply_cache["fn"])
                return x

            return jax.tree.map(restore, out, is_leaf=_is_train_state)
        entry, xs = entry_for(args, kwargs)
        closed = entry.closed
        outs = evaluate(closed.jaxpr, closed.consts, xs, plan=entry.plan)
        if policy.guard and entry.chosen and not entry.guarded and not entry.fallback:
            if not any(isinstance(x, jax.core.Tracer) for x in xs):
                entry.guarded = True
                expected = jax.tree.leaves(fn(*args, **kwargs))
                bad = [
                    i
                    for i, (a, b) in enumerate(zip(outs, expected))
                    if not np.allclose(np.asarray(a), np.asarray(b), rtol=policy.guard_rtol, atol=policy.guard_atol)
                ]
                if bad:
                    entry.fallback = True
                    worst = max(float(np.max(np.abs(np.asarray(outs[i]) - np.asarray(expected[i])))) for i in bad)
                    warnings.warn(
                        f"conductor: rewritten {fn.__name__} differs from the original by up to {worst:.3g} "
                        f"(rtol={policy.guard_rtol}, atol={policy.guard_atol}); using the original",
                        ConductorWarning,
                        stacklevel=2,
                    )
                    outs = expected
        return jax.tree.unflatten(entry.out_tree, outs)

    def inspect_calls(*args, **kwargs) -> list[tuple[Match, Decision]]:
        if not any(_is_train_state(a) for a in args):
            return list(entry_for(args, kwargs)[0].all)
        # a train step: what gets rewritten is the state's apply_fn, so report its calls in the step
        found: list[tuple[Match, Decision]] = []

        def recording(x):
            fast_apply = with_optimized_apply(x).apply_fn

            def apply(*a, **kw):
                found.extend(fast_apply.inspect(*a, **kw))
                return fast_apply(*a, **kw)

            return x.replace(apply_fn=apply)

        def step(*a, **kw):
            return fn(*[recording(x) if _is_train_state(x) else x for x in a], **kw)

        jax.eval_shape(step, *args, **kwargs)
        return found

    optimized.inspect = inspect_calls  # type: ignore[attr-defined]
    return optimized


def _with_replaced(match: Match, decision: Decision) -> Decision:
    if not decision.rewrite or match.level is None:
        return decision
    eqns = match.level.eqns
    removed = replaced_by(match.level, substitution(match, decision))
    by_kernel = set(replaced_by(match.level, kernel_substitution(match, decision)))

    def described(indices):
        return tuple(
            f"{eqns[i].primitive.name} {' '.join(v.aval.str_short() for v in eqns[i].outvars)}" for i in indices
        )

    return dataclasses.replace(
        decision,
        replaced=described(i for i in removed if i in by_kernel),
        fused=described(i for i in removed if i not in by_kernel),
    )


def inspect(fn: Callable, *args, policy: Policy | None = None, **kwargs) -> list[tuple[Match, Decision]]:
    """The matches in ``fn(*args, **kwargs)`` (arrays or ``jax.ShapeDtypeStruct``s) with the decision on each.

    Each entry is (:class:`Match`, :class:`Decision`): scope, pattern, shapes, the estimated memory
    and time as written vs rewritten on the policy's device, and for each rewrite the equations the
    kernel replaces (``Decision.replaced``) and those that run inside its region, recomputed in the
    backward pass (``Decision.fused``). For a train step taking a Flax ``TrainState`` the entries are
    those of the state's ``apply_fn`` as the step calls it, which is what :func:`optimize` rewrites.
    """
    return optimize(fn, policy=policy).inspect(*args, **kwargs)
