"""Trace a function to the jaxpr that XLA would actually run."""

from __future__ import annotations

from collections.abc import Callable

import jax

# jax has no public dead-code elimination for jaxprs: this private one is what
# jax's own partial evaluation uses (checked against jax 0.10.x, which we pin).
from jax._src.interpreters.partial_eval import dce_jaxpr
from jax.extend import core as jcore


def trace(fn: Callable, *args) -> jcore.ClosedJaxpr:
    """``jax.make_jaxpr(fn)(*args)`` with dead code removed.

    Dead code is removed because XLA removes it too: a forward value that only
    feeds a dropped output (say, a loss computed but not returned) never runs.
    The inputs are kept, so the jaxpr's inputs still match ``args`` leaf for leaf.
    """
    closed = jax.make_jaxpr(fn)(*args)
    used = [True] * len(closed.jaxpr.outvars)
    jaxpr, _ = dce_jaxpr(closed.jaxpr, used, instantiate=True)
    return jcore.ClosedJaxpr(jaxpr, closed.consts)
