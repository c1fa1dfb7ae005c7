"""Interleaved 1F1B (virtual stages) run by the pipeline executor on the 8 virtual devices.

A GPT of four blocks (gpt-tiny's shape, twice the blocks: each of 2 stages needs 2 blocks for 2
chunks) planned on 2 stages of DP2×TP2 with 2 virtual stages each: five steps train like one
device, each stage runs its chunks in the order the simulator prices, and the compiled collectives
and the stage-to-stage transfers are the cost model's bytes.
"""

import dataclasses

import jax
import numpy as np
import pytest

from integrations.flax import capture, compile_step, shard
from integrations.flax._stages import chunk_layers
from orchestrator.bench.executor import predicted_collectives
from orchestrator.cluster import load_cluster
from orchestrator.coarsen import coarsen
from orchestrator.costs import CostModel
from orchestrator.planner import Plan, Stage
from orchestrator.simulate import chunk_order, simulate
from recipes import Recipe, synthetic_batch
from recipes.gpt import GPTConfig

RECIPE = Recipe(
    name="gpt-tiny-4",
    config=GPTConfig(vocab_size=256, max_seq_len=64, num_layers=4, num_heads=4, d_model=64),
    batch_size=16,
    seq_len=16,
)
BATCH, SEQ, STEPS, MICROBATCHES = 16, 16, 5, 4


def _plan(device_type: str, *, virtual_stages: int = 2, stages=((0, 1, 2), (3, 4, 5))) -> Plan:
    """(embedding, blocks 0–1 | blocks 2–3, head) on devices 0–3 and 4–7, each DP2×TP2, 1F1B over 4
    microbatches, read back from its JSON as ``orchestrator plan --virtual-stages --out`` writes it."""
    plan = Plan(
        stages=tuple(
            Stage(
                layers=layers,
                device_type=device_type,
                devices=tuple(f"localhost/{4 * s + i}" for i in range(4)),
                tp=2,
                dp=2,
                recompute=False,
                microbatch_size=BATCH // MICROBATCHES // 2,
                time_s=0.0,
                memory_bytes=0.0,
            )
            for s, layers in enumerate(stages)
        ),
        schedule="1f1b",
        microbatches=MICROBATCHES,
        global_batch=BATCH,
        iteration_s=0.0,
        virtual_stages=virtual_stages,
    )
    return Plan.from_json(plan.to_json())


class _Seen:
    """Per stage, its forward and backward dispatches of one step in order, and the bytes of the
    activations and gradients moved between programs (a device array placed for a microbatch;
    batch slices and the loss seed come from the host)."""

    def on_step_begin(self, stages: int) -> None:
        self.steps: list[list] = [[] for _ in range(stages)]
        self.moved = 0

    def on_dispatch(self, dispatch) -> None:
        if dispatch.kind in ("forward", "backward"):
            self.steps[dispatch.stage].append((dispatch.kind, dispatch.microbatch, dispatch.fn))
        elif (
            dispatch.kind == "transfer" and dispatch.microbatch is not None and isinstance(dispatch.args[0], jax.Array)
        ):
            self.moved += dispatch.args[0].nbytes

    def on_dispatched(self, dispatch, outputs) -> None:
        pass

    def on_step_end(self) -> None:
        pass


@pytest.fixture(scope="module")
def graph():
    return capture(RECIPE.train_step, RECIPE.abstract_state(), RECIPE.batch_spec(BATCH, SEQ))


@pytest.fixture(scope="module")
def layers(graph):
    return coarsen(graph)


@pytest.fixture(scope="module")
def run(graph, layers):
    """Five steps under the interleaved plan and on one device, from the same state and batches."""
    batches = [synthetic_batch(jax.random.key(i), BATCH, SEQ, RECIPE.config.vocab_size) for i in range(STEPS)]
    state = jax.jit(RECIPE.create_state)(jax.random.key(0))
    reference, ref_state, ref_losses = jax.jit(RECIPE.train_step), state, []
    for batch in batches:
        ref_state, metrics = reference(ref_state, batch)
        ref_losses.append(float(metrics["loss"]))

    cluster = load_cluster("local")
    [device_type] = cluster.device_types
    plan, axes = _plan(device_type), RECIPE.param_axes()
    placed = shard(plan, state, param_axes=axes, layers=layers)
    step = compile_step(plan, RECIPE.train_step, placed, param_axes=axes, layers=layers)
    seen = _Seen()
    step.observers.append(seen)
    losses = []
    for batch in batches:
        placed, metrics = step(placed, batch)
        losses.append(float(metrics["loss"]))
    step.observers.remove(seen)
    params = jax.tree.map(np.asarray, (placed.params, ref_state.params))  # the next step donates the state
    collectives, _ = step.collective_bytes(placed, batches[0])
    return {
        "plan": plan,
        "device_type": device_type,
        "losses": losses,
        "reference_losses": ref_losses,
        "params": params,
        "seen": seen,
        "fns": step.build(placed, batches[0]).fns,
        "collectives": collectives,
        "model": CostModel(graph, layers, cluster, batch_size=BATCH, param_axes=axes),
    }


def test_chunks_hold_the_blocks_of_their_stage_and_the_ends_ride_first_and_last(layers):
    names = [layer.name for layer in layers]
    assert names[0].endswith("wte+wpe") and all("blocks_" in name for name in names[1:5])
    assert chunk_layers(_plan("cpu"), layers) == [(0, 1), (2,), (3,), (4, 5)]
    assert chunk_layers(_plan("cpu", virtual_stages=1), layers) == [(0, 1, 2), (3, 4, 5)]


def test_an_interleaved_plan_trains_like_one_device(run):
    losses, reference = np.array(run["losses"]), np.array(run["reference_losses"])
    assert losses[-1] < losses[0]
    assert np.max(np.abs(losses / reference - 1)) < 1e-5, (losses, reference)
    for ours, theirs in zip(*(jax.tree.leaves(p) for p in run["params"])):
        np.testing.assert_allclose(ours, theirs, atol=1e-4)


def test_each_stage_runs_its_chunks_in_the_interleaved_order_the_simulator_prices(run):
    plan, S = run["plan"], len(run["plan"].stages)
    program = {id(getattr(f, phase)): k for k, f in enumerate(run["fns"]) for phase in ("forward", "backward")}
    for s, steps in enumerate(run["seen"].steps):
        ran = [(phase, mb, program[id(fn)] // S) for phase, mb, fn in steps]
        assert all(program[id(fn)] % S == s for _, _, fn in steps)
        assert ran == chunk_order("1f1b", S, plan.microbatches, s, plan.virtual_stages)


def test_collectives_and_stage_transfers_are_the_priced_bytes(run):
    """Per stage, the compiled all-reduces (tensor parallelism per microbatch, the gradient sync per
    step) within 1% of the cost model's; the activations and gradients moved between chunks per step
    (v per stage boundary and v − 1 wraps from the last stage to the first, each way) within 1% of
    the simulated transfers' bytes."""
    plan, model = run["plan"], run["model"]
    predicted = predicted_collectives(plan, model, run["device_type"])
    for measured, priced in zip(run["collectives"], predicted):
        assert measured["all-reduce"] == pytest.approx(priced["all-reduce"], rel=0.01), (measured, priced)
        assert {k: v for k, v in measured.items() if k != "all-reduce"} == dict.fromkeys(
            measured.keys() - {"all-reduce"}, 0
        )
    timeline = simulate(plan, model)
    sends = [e for e in timeline.events if e.kind in ("send_activation", "send_gradient")]
    wraps = [e for e in sends if e.stage == len(plan.stages) - 1]
    assert {e.chunk for e in wraps} == {0}  # the last stage hands chunk 0 over to the first stage's chunk 1
    assert run["seen"].moved == pytest.approx(sum(e.nbytes for e in sends), rel=0.01)


def test_virtual_stages_a_stage_cannot_split_are_refused_in_one_line(layers):
    uneven = _plan("cpu", stages=((0, 1), (2, 3, 4, 5)))
    with pytest.raises(ValueError, match="stage 0 holds 1 repeated layers") as error:
        compile_step(uneven, RECIPE.train_step, RECIPE.abstract_state(), layers=layers, param_axes=RECIPE.param_axes())
    assert "\n" not in str(error.value)
    one_stage = dataclasses.replace(_plan("cpu", virtual_stages=1), stages=_plan("cpu").stages[:1], virtual_stages=2)
    with pytest.raises(ValueError, match="virtual stages on one stage"):
        compile_step(one_stage, RECIPE.train_step, RECIPE.abstract_state(), layers=layers)
