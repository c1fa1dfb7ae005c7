"""Cut a traced step into runnable pieces along its layers (and phases).

The step's jaxpr is flattened — jit, remat and custom-derivative calls are
inlined, loops and conditionals stay whole — and each flat equation is walked
by the same :class:`~integrations.flax._capture._Walker` that capture uses, so
it lands on exactly the op names of the captured graph. A piece is then the
equations whose ops belong to chosen layers and phases, closed over the values
it reads from outside (its inputs) and the values read after it (its outputs).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from integrations.flax._capture import _CALLS, _NOWHERE, _join, _Walker
from integrations.flax._trace import trace
from orchestrator.graph import OpGraph, Phase


@dataclass(frozen=True, slots=True)
class _FlatEqn:
    eqn: object  # a JaxprEqn whose variables live in the flat jaxpr
    stack: str  # full name stack


def _flatten(jaxpr, env: dict, stack: str, out: list[_FlatEqn], consts: dict) -> None:
    """Append ``jaxpr``'s equations to ``out`` with calls inlined; ``env`` maps its vars to flat atoms."""

    def read(atom):
        return atom if isinstance(atom, jcore.Literal) else env[atom]

    for eqn in jaxpr.eqns:
        eqn_stack = _join(stack, str(eqn.source_info.name_stack))
        name = eqn.primitive.name
        key = _CALLS.get(name)
        if key in eqn.params:
            sub = eqn.params[key]
            closed = sub if isinstance(sub, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(sub, ())
            inner = {}
            for var, value in zip(closed.jaxpr.constvars, closed.consts):
                flat = jcore.Var(var.aval)
                consts[flat] = value
                inner[var] = flat
            inner.update(zip(closed.jaxpr.invars, [read(a) for a in eqn.invars]))
            _flatten(closed.jaxpr, inner, eqn_stack, out, consts)
            for outer_var, inner_atom in zip(eqn.outvars, closed.jaxpr.outvars):
                if not isinstance(outer_var, jcore.DropVar):
                    env[outer_var] = inner_atom if isinstance(inner_atom, jcore.Literal) else inner[inner_atom]
            continue
        outvars = []
        for var in eqn.outvars:
            flat = jcore.Var(var.aval)
            if not isinstance(var, jcore.DropVar):
                env[var] = flat
            outvars.append(flat)
        out.append(_FlatEqn(eqn.replace(invars=[read(a) for a in eqn.invars], outvars=outvars), eqn_stack))


class SlicedStep:
    """A traced step, flattened, with each flat equation tied to its captured ops.

    Args:
      fn, *args: what :func:`~integrations.flax.capture` took.
      graph: the graph ``capture(fn, *args)`` returned (used for op phases).
    """

    def __init__(self, fn: Callable, *args, graph: OpGraph):
        closed = trace(fn, *args)
        self.consts: dict = {}
        env: dict = {}
        for var, value in zip(closed.jaxpr.constvars, closed.consts):
            flat = jcore.Var(var.aval)
            self.consts[flat] = value
            env[var] = flat
        self.invars = [jcore.Var(v.aval) for v in closed.jaxpr.invars]
        env.update(zip(closed.jaxpr.invars, self.invars))
        self.flat: list[_FlatEqn] = []
        _flatten(closed.jaxpr, env, "", self.flat, self.consts)
        self.outvars = [a if isinstance(a, jcore.Literal) else env[a] for a in closed.jaxpr.outvars]
        self.graph = graph
        self.ops_of: list[tuple[str, ...]] = self._name_ops()

    def _name_ops(self) -> list[tuple[str, ...]]:
        scratch = OpGraph(params=self.graph.params)
        walker = _Walker(scratch, list(self.graph.params))
        names = []
        for item in self.flat:
            before = len(scratch)
            sources = [_NOWHERE] * len(item.eqn.invars)
            walker.eqn(item.eqn, sources, stack=item.stack, repeats=1)
            names.append(tuple(list(scratch.nx.nodes)[before:]))
        captured = [op.name for op in self.graph.ops()]
        flat_names = [n for group in names for n in group]
        if flat_names != captured:
            raise AssertionError("flattened step does not reproduce the captured op names")
        return names

    def _chosen(self, ops: Collection[str]) -> list[int]:
        """Indices of the flat equations whose ops are all in ``ops``."""
        wanted = set(ops)
        return [i for i, names in enumerate(self.ops_of) if names and set(names) <= wanted]

    def piece(self, ops: Collection[str]) -> tuple[jcore.ClosedJaxpr, list]:
        """A closed jaxpr of the flat equations producing ``ops``, and its input avals.

        Its inputs are every value it reads from outside (step inputs, constants
        it does not own, values other pieces compute); its outputs are the values
        it computes that anything after it reads, plus step outputs.
        """
        chosen = self._chosen(ops)
        chosen_set = set(chosen)
        produced, inputs, seen = set(), [], set()
        for i in chosen:
            for atom in self.flat[i].eqn.invars:
                if isinstance(atom, jcore.Literal) or atom in produced or atom in seen:
                    continue
                seen.add(atom)
                inputs.append(atom)
            produced.update(self.flat[i].eqn.outvars)
        read_later = {
            a
            for j, item in enumerate(self.flat)
            if j not in chosen_set
            for a in item.eqn.invars
            if not isinstance(a, jcore.Literal)
        }
        read_later.update(a for a in self.outvars if not isinstance(a, jcore.Literal))
        outputs = [v for i in chosen for v in self.flat[i].eqn.outvars if v in read_later]
        const_inputs = [a for a in inputs if a in self.consts]
        var_inputs = [a for a in inputs if a not in self.consts]
        debug = jcore.DebugInfo(
            "orchestrator piece",
            "layer piece",
            tuple(f"in{i}" for i in range(len(var_inputs))),
            tuple(f"out{i}" for i in range(len(outputs))),
        )
        jaxpr = jcore.Jaxpr(const_inputs, var_inputs, outputs, [self.flat[i].eqn for i in chosen], debug_info=debug)
        closed = jcore.ClosedJaxpr(jaxpr, [self.consts[a] for a in const_inputs])
        return closed, [a.aval for a in var_inputs]

    def reusable_inputs(self, ops: Collection[str], closed: jcore.ClosedJaxpr) -> tuple[int, ...]:
        """Inputs of the piece of ``ops`` whose buffers its outputs may take, as in the whole step.

        Inside one compiled step XLA writes a result over an operand that is
        dead after it (same shape and dtype): the optimizer writes the new
        state over the donated old one, and the tied embedding's gradient is
        scattered into the head's gradient in place. A piece timed apart
        would instead write a fresh buffer, and on a CPU the first write to
        each fresh page faults, which dominates the backward of a large
        embedding that writes a fresh gradient table. So an input is
        reusable when nothing after the piece reads it (its last reader is
        in the piece and it is not a step output) and an output of its
        shape and dtype is left to take it; step inputs (the donated state)
        are matched first.
        """
        chosen = set(self._chosen(ops))
        last_reader: dict = {}
        for j, item in enumerate(self.flat):
            for a in item.eqn.invars:
                if not isinstance(a, jcore.Literal):
                    last_reader[a] = j
        step_outputs = {a for a in self.outvars if not isinstance(a, jcore.Literal)}
        free: dict[tuple, int] = {}
        for aval in closed.out_avals:
            key = (tuple(aval.shape), str(aval.dtype))
            free[key] = free.get(key, 0) + 1
        step_inputs = set(self.invars)
        invars = list(enumerate(closed.jaxpr.invars))
        ordered = [iv for iv in invars if iv[1] in step_inputs] + [iv for iv in invars if iv[1] not in step_inputs]
        out = []
        for i, var in ordered:
            key = (tuple(var.aval.shape), str(var.aval.dtype))
            dead = last_reader.get(var) in chosen and var not in step_outputs
            if dead and var.aval.shape and free.get(key, 0) > 0:
                free[key] -= 1
                out.append(i)
        return tuple(sorted(out))

    def layer_phase_ops(self, layer_ops: Collection[str], phases: Collection[Phase]) -> list[str]:
        return [n for n in layer_ops if self.graph.op(n).phase in phases]


def example_inputs(avals, seed: int = 0) -> list:
    """Concrete inputs for a piece: small normal floats, zero integers, true booleans."""
    rng = np.random.default_rng(seed)
    out = []
    for aval in avals:
        dtype = np.dtype(aval.dtype) if not str(aval.dtype).startswith("key") else None
        if dtype is None:
            out.append(jax.random.key(seed))
        elif np.issubdtype(dtype, np.floating) or str(aval.dtype) == "bfloat16":
            out.append(jnp.asarray(rng.normal(0, 0.02, aval.shape), dtype=aval.dtype))
        elif dtype == np.bool_:
            out.append(jnp.ones(aval.shape, bool))
        else:
            out.append(jnp.zeros(aval.shape, aval.dtype))
    return out


class PieceRun:
    """A piece compiled once, with example inputs, that times one run per call.

    ``donate``: inputs whose buffers the piece may reuse, as the optimizer part of
    a step whose state is donated updates it in place (see
    :meth:`SlicedStep.reusable_inputs`); they get fresh copies per run, made
    outside the timing. Without donation every output is a new buffer, and on a
    CPU the first write to each fresh page faults, which makes a large optimizer
    update several times slower into fresh buffers than in place.
    """

    def __init__(self, closed: jcore.ClosedJaxpr, avals, *, donate: tuple[int, ...] = ()):
        self.compiled = jax.jit(jcore.jaxpr_as_fun(closed), donate_argnums=donate)
        self.inputs = example_inputs(avals)
        self.buffers = len(avals) + len(closed.out_avals)  # the call takes and returns
        self.donate = frozenset(donate)

    def __call__(self) -> float:
        """Wall seconds of one run, waited for."""
        args = [jnp.copy(x) if i in self.donate else x for i, x in enumerate(self.inputs)]
        jax.block_until_ready(args)
        start = time.perf_counter()
        jax.block_until_ready(self.compiled(*args))
        return time.perf_counter() - start


def time_piece(
    closed: jcore.ClosedJaxpr, avals, *, repeats: int = 5, warmup: int = 1, donate: tuple[int, ...] = ()
) -> float:
    """Median wall time (s) of the compiled piece on the default device (:class:`PieceRun`)."""
    run = PieceRun(closed, avals, donate=donate)
    for _ in range(warmup):
        run()
    return float(np.median([run() for _ in range(repeats)]))


def piece_flops(closed: jcore.ClosedJaxpr, avals) -> float:
    """XLA's FLOP count of a piece (loop bodies once; see ``xla_flops``)."""
    compiled = (
        jax.jit(jcore.jaxpr_as_fun(closed)).lower(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]).compile()
    )
    return float(compiled.cost_analysis()["flops"])
