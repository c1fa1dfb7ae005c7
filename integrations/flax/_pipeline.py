"""Run a multi-stage plan as an MPMD pipeline: one jitted forward and backward per stage, each on its own mesh.

**Stages** are cut from the user's traced train step (:func:`~integrations.flax.cut_stages`):
a stage's forward is its forward equations, closed over the parameters, batch leaves and
earlier stages' activations they read; its outputs are what later stages read, and the loss.

**Backward and update.** Each stage's backward is ``jax.vjp`` of its forward:
the forward program returns the VJP residuals (or, under ``recompute``, the
backward program recomputes them), the backward program takes the cotangents
of its outputs (``1/M`` for the loss of each of the M microbatches, so the
gradient is the mean over microbatches) and returns parameter gradients and
the cotangents of its inputs, which go back to the stages that produced them.
Gradients are summed over microbatches per stage; a parameter read by several
stages has its partial gradients moved to its owner and added. Each stage then
applies ``state.apply_gradients`` to the parameters and optimizer-state leaves
it owns (other leaves masked out as ``None``), which equals the single-program
update for any optimizer that acts leaf by leaf (AdamW, SGD, Adam; not a global
gradient-norm clip: :mod:`integrations.flax._stagewise` tells them apart, and a step
whose update does not split is refused here and planned on one stage by ``orchestrate``).

**Schedule.** Each stage runs its forwards and backwards in the order
:func:`orchestrator.simulate.chunk_order` gives, the one the simulator replays
(GPipe: all forwards, then all backwards; 1F1B: ``min(S − s − 1, M)`` warm-up
forwards, then one forward and one backward in turn, then the drain). The
per-stage lists are merged into one dispatch order that respects dependencies;
jax dispatches asynchronously, so stages on disjoint devices overlap.

**Virtual stages** (interleaved 1F1B, ``plan.virtual_stages`` = v > 1; Narayanan et al. 2021,
§2.2.2): the step is cut into v·S model chunks (:func:`~integrations.flax._stages.chunk_layers`),
chunk c of stage s (virtual stage c·S + s) compiled for stage s's mesh and options, and each
stage runs its (phase, microbatch, chunk) steps in Megatron-LM's interleaved order, the one
:func:`orchestrator.simulate.chunk_order` gives and the planner prices.

**Data parallelism inside a stage** with dp > 1: the stage is cut from the step traced at the
per-replica microbatch (b/dp samples) and runs under ``jax.shard_map`` over ``"data"``
(:mod:`integrations.flax._programs`); batch-major activations cross stages split over ``"data"``.

**FSDP inside a stage** (``stage.fsdp``, dp > 1): the stage stores its parameters and optimizer
moments split over ``"data"`` (:func:`~integrations.flax._shard.stored_spec`); once a step, one
program all-gathers every parameter its programs read (a tied table read by a later stage too, on
that stage) and the stage keeps them whole for its microbatches, as Llama 3's pipelines run FSDP
(parameters not resharded after the forward; Dubey et al. 2024, §3.3.2); its update sums the
replicas' gradients straight into the stored shards (a reduce-scatter). These are the bytes the
cost model prices for ``fsdp``: each layer's parameters gathered and its gradients
reduce-scattered once a step.

**Code.** :class:`~integrations.flax._programs.PipelineBuilder` builds what a step dispatches
(meshes, shardings, each stage's compiled programs per batch shape);
:class:`~integrations.flax._runner.StepRun` dispatches one step in schedule order. Observers
(:class:`~integrations.flax.PipelineObserver`) see every dispatch; the executor measures nothing
itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from integrations.flax._observe import Dispatch, PipelineObserver
from integrations.flax._programs import Built, PipelineBuilder
from integrations.flax._runner import StepRun
from integrations.flax._stages import StageProgram, cut_stages
from integrations.flax._stagewise import why_not_stagewise

__all__ = ["Pipeline", "StageProgram", "cut_stages"]


class Pipeline:
    """``step(state, batch) -> (state, {"loss": mean over microbatches})`` for a multi-stage plan.

    Args:
      plan: the plan (stages, schedule, microbatches).
      train_step: the user's step (``value_and_grad`` of a mean loss, then ``state.apply_gradients``).
      state: the state placed by :func:`~integrations.flax.shard` with the same ``layers``.
      layers: the coarsened layers of the step the plan was made for.
      param_axes: logical axis names by parameter path (tensor parallelism inside stages).
      axis_rules: ``(logical axis name, mesh axis or None)`` pairs, as for :func:`~integrations.flax.shard`.
      cluster: resolves the plan's device refs.
      observers: :class:`~integrations.flax.PipelineObserver` s that see every step's dispatches
        (timing, counting, fault injection); ``observers`` is a list, so they can be added later.

    Attributes:
      builder: the stages' meshes, shardings and compiled programs.
      observers: the observers, in the order they are called.
    """

    def __init__(
        self,
        plan,
        train_step: Callable,
        state,
        *,
        layers,
        param_axes=None,
        cluster=None,
        observers: Sequence[PipelineObserver] = (),
        axis_rules=None,
    ):
        why = why_not_stagewise(state)
        if why is not None:
            raise ValueError(
                f"a multi-stage plan updates each stage apart, and this step cannot: {why}; plan it with max_stages=1"
            )
        self.plan = plan
        self.builder = PipelineBuilder(
            plan, train_step, state, layers=layers, param_axes=param_axes, cluster=cluster, axis_rules=axis_rules
        )
        self.observers: list[PipelineObserver] = list(observers)

    def build(self, state, batch) -> Built:
        """The stages' cut and compiled programs for ``batch``'s shape (built on first use)."""
        return self.builder.build(state, batch)

    def __call__(self, state, batch):
        return StepRun(self.builder, self.build(state, batch), state, batch, self.observers).run()

    def collective_bytes(self, state, batch) -> tuple[list[dict[str, int]], object]:
        """Per stage, the collective operand bytes (per device, by kind) of one step, and the new state.

        Runs one step and compiles what it dispatched: each stage's forward and
        backward programs (each chunk's, under virtual stages) count M times, its update once.
        Transfers between stages are device-to-device copies, not collectives, and are not counted.
        """
        from integrations.flax._xla import hlo_collective_bytes

        recorder = _Recorder(self.plan.microbatches)
        self.observers.append(recorder)
        try:
            state, _ = self(state, batch)
        finally:
            self.observers.remove(recorder)
        per_stage = [
            dict.fromkeys(("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all"), 0)
            for _ in self.plan.stages
        ]
        for s, per_step, low in [(s, k, fn.lower(*args)) for s, k, fn, args in recorder.calls]:
            for kind, nbytes in hlo_collective_bytes(low.compile().as_text()).items():
                per_stage[s][kind] += nbytes * per_step
        return per_stage, state


class _Recorder:
    """Records each distinct program a step calls, with abstract arguments (several are donated
    while the step runs), and how many times a step calls it: a forward or backward once per
    microbatch, the rest once."""

    def __init__(self, microbatches: int):
        self.calls: list[tuple[int, int, Callable, tuple]] = []
        self.microbatches = microbatches

    def on_step_begin(self, stages: int) -> None:
        self.calls = []

    def on_dispatch(self, dispatch: Dispatch) -> None:
        if dispatch.kind in ("forward", "backward") and dispatch.microbatch == 0:
            self._record(dispatch, per_step=self.microbatches)
        elif dispatch.kind in ("gather", "sum", "update"):
            self._record(dispatch, per_step=1)

    def _record(self, dispatch: Dispatch, per_step: int) -> None:
        spec = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
            dispatch.args,
        )
        self.calls.append((dispatch.stage, per_step, dispatch.fn, spec))

    def on_dispatched(self, dispatch: Dispatch, outputs) -> None:
        pass

    def on_step_end(self) -> None:
        pass
