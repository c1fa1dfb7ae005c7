"""Whether a state's update can run stage by stage, as the pipeline runs it.

A multi-stage plan updates each stage's parameters and optimizer moments on
that stage's devices, with ``state.apply_gradients`` and every other stage's
leaves masked out (:mod:`integrations.flax._runner`). That equals the one
update of a single program only when each parameter's new value and moments
depend on that parameter's own leaves (its value, gradient and moments) and
on the shared counters alone: true of SGD, momentum, Adam, AdamW, Lion; false
of a global-norm clip, whose norm spans every gradient, or of a skip on a
non-finite gradient anywhere. The test traces ``apply_gradients`` once on
shapes and follows, through its jaxpr, which parameter each output leaf reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from integrations.flax._capture import _CALLS
from integrations.flax._shard import leaf_params

_NONE: frozenset = frozenset()


def _reads(jaxpr, inputs: list[frozenset]) -> list[frozenset]:
    """Per output of ``jaxpr``: the owners (parameter names) of the inputs it depends on."""
    env = dict(zip(jaxpr.invars, inputs))

    def read(atom) -> frozenset:
        return _NONE if isinstance(atom, jcore.Literal) else env.get(atom, _NONE)

    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        sub = eqn.params.get(_CALLS.get(eqn.primitive.name, ""))
        inner = getattr(sub, "jaxpr", sub)
        if inner is not None and len(inner.invars) == len(ins):
            outs = _reads(inner, ins)
        else:  # any other primitive (loops, conditionals included): each output may read every input
            outs = [_NONE.union(*ins)] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs))
    return [read(a) for a in jaxpr.outvars]


def why_not_stagewise(state) -> str | None:
    """Why ``state``'s update cannot be split by pipeline stage, or None when it can.

    Args:
      state: a Flax ``TrainState`` (arrays or ``jax.ShapeDtypeStruct``), or any other training state.

    Returns:
      None when ``state.apply_gradients`` updates every parameter from its own leaves and shared
      counters; otherwise a reason, naming the parameter whose update reads another's.
    """
    if not callable(getattr(state, "apply_gradients", None)):
        return f"its state ({type(state).__name__}) has no apply_gradients to run each stage's update with"
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), state)
    closed = jax.make_jaxpr(lambda s, g: s.apply_gradients(grads=g))(abstract, abstract.params)
    leaves = leaf_params(abstract)
    owners = [name for name, _ in leaves]  # the new state's leaves are the state's, in order
    param_owners = [name for name, is_param in leaves if is_param]  # the gradients'
    inputs = [_NONE if o is None else frozenset([o]) for o in (*owners, *param_owners)]
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    for path, owner, reads in zip(paths, owners, _reads(closed.jaxpr, inputs)):
        foreign = reads - {owner}
        if foreign:
            what = f"parameter {owner}" if owner is not None else f"the shared leaf {jax.tree_util.keystr(path)}"
            return (
                f"its optimizer updates {what} from the gradient or state of {sorted(foreign)[0]} "
                "(a global-norm clip or another transform across parameters)"
            )
    return None
