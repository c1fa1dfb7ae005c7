"""Profiling: slicing the step per layer, timing, the disk cache, and calibration."""

import jax
import numpy as np
import pytest
from typer.testing import CliRunner

from integrations.flax import SlicedStep, capture, profile_layers
from integrations.flax._slice import example_inputs, time_piece
from orchestrator.cli import app
from orchestrator.cluster import DeviceType
from orchestrator.coarsen import coarsen
from orchestrator.costs import EFFICIENCY_CLASSES, Efficiency
from orchestrator.graph import Op, TensorSpec
from orchestrator.profile import LayerTiming, TimingCache, calibrate, predict
from recipes import get_recipe


@pytest.fixture(scope="module")
def tiny():
    recipe = get_recipe("gpt-tiny")
    state, batch = recipe.abstract_state(), recipe.batch_spec(2, 32)
    graph = capture(recipe.train_step, state, batch)
    return recipe, state, batch, graph, coarsen(graph)


def test_sliced_pieces_reproduce_the_layer(tiny):
    recipe, state, batch, graph, layers = tiny
    sliced = SlicedStep(recipe.train_step, state, batch, graph=graph)
    assert sum(len(names) for names in sliced.ops_of) == len(graph)
    block = layers[1]
    forward = sliced.layer_phase_ops(block.ops, ("forward",))
    closed, avals = sliced.piece(forward)
    outputs = jax.jit(jax.extend.core.jaxpr_as_fun(closed))(*example_inputs(avals))
    assert len(outputs) >= 1
    # the block's forward piece reads the block's parameters and the residual stream
    assert any(a.shape == (2, 32, 64) for a in avals)
    assert all(np.isfinite(np.asarray(o)).all() for o in outputs if hasattr(o, "dtype"))


def _piece_and_reused(tiny, layer_index: int, phase: str):
    """(sliced step, piece ops, closed piece, its avals, inputs it may write over)."""
    recipe, state, batch, graph, layers = tiny
    sliced = SlicedStep(recipe.train_step, state, batch, graph=graph)
    ops = sliced.layer_phase_ops(layers[layer_index].ops, (phase,))
    closed, avals = sliced.piece(ops)
    return sliced, ops, closed, avals, sliced.reusable_inputs(ops, closed)


def test_optimizer_piece_updates_the_donated_state_in_place(tiny):
    graph = tiny[3]
    sliced, _, closed, avals, donated = _piece_and_reused(tiny, 1, "optimizer")
    leaves = sum(1 for p in graph.params if p.startswith("blocks_0/"))
    # params, AdamW's first and second moments: never the gradients, which the step computes
    assert len(donated) == 3 * leaves
    step_inputs = set(sliced.invars)
    assert all(closed.jaxpr.invars[i] in step_inputs for i in donated)
    assert time_piece(closed, avals, repeats=2, donate=donated) > 0


def test_tied_embedding_gradient_is_added_in_place(tiny):
    """The embedding's backward piece may write over the head's gradient of the tied table, as the step does."""
    recipe = tiny[0]
    sliced, ops, closed, avals, reused = _piece_and_reused(tiny, 0, "backward")
    table = (recipe.config.vocab_size, recipe.config.d_model)
    step_inputs = set(sliced.invars)
    intermediates = [i for i in reused if closed.jaxpr.invars[i] not in step_inputs]
    assert [tuple(avals[i].shape) for i in intermediates] == [table]
    # a value read again after the piece (the parameters, read by the optimizer) is never reused
    after = sliced.flat[max(sliced._chosen(ops)) + 1 :]
    readers_after = {a for item in after for a in item.eqn.invars if not isinstance(a, jax.extend.core.Literal)}
    assert not any(closed.jaxpr.invars[i] in readers_after for i in reused)
    assert time_piece(closed, avals, repeats=2, donate=reused) > 0


def test_profile_caches_by_signature(tiny, tmp_path):
    recipe, state, batch, graph, layers = tiny
    cache = TimingCache(tmp_path, jax_version=jax.__version__)
    seen = []
    first = profile_layers(
        recipe.train_step, state, batch, graph=graph, layers=layers, repeats=2, cache=cache, progress=seen.append
    )
    assert len(first) == len({layer.signature for layer in layers}) == 3
    assert seen == ["GPT/wte+wpe", "GPT/blocks_0", "GPT/ln_f+wte.attend"]
    assert all(t.forward_s > 0 and t.backward_s > 0 for t in first.values())
    again = []
    second = profile_layers(
        recipe.train_step, state, batch, graph=graph, layers=layers, cache=cache, progress=again.append
    )
    assert again == [] and second == first


def test_damaged_cache_entry_is_measured_again(tmp_path):
    cache = TimingCache(tmp_path, jax_version="0")
    timing = LayerTiming(signature="abc", name="x", device_kind="cpu", forward_s=1, backward_s=2, optimizer_s=0)
    cache.put(timing)
    assert cache.get("abc", "cpu") == timing
    next(tmp_path.rglob("abc.json")).write_text("{not json")
    assert cache.get("abc", "cpu") is None


def test_calibration_recovers_known_efficiencies():
    device = DeviceType(
        name="d", peak_flops={"float32": 1e12}, memory_bytes=1, memory_bandwidth_bytes_per_s=1e11, cache_bytes=2**20
    )
    truth = Efficiency(
        matmul=0.5, other=0.2, transcendental=0.05, memory=0.8, memory_streamed=0.4, movement=0.3, matmul_output=0.01
    )
    rng = np.random.default_rng(0)
    pieces = []
    for i in range(12):
        spec = TensorSpec(shape=(int(rng.integers(1, 1000)),), dtype="float32")
        ops = [
            Op(
                name=f"m{i}",
                kind="matmul",
                primitive="dot_general",
                flops=float(rng.uniform(1e9, 1e11)),
                inputs=(spec,),
                outputs=(TensorSpec(shape=(int(rng.integers(10**5, 10**7)),), dtype="float32"),),
            ),
            Op(
                name=f"e{i}",
                kind="elementwise",
                primitive="exp",
                flops=float(rng.uniform(1e7, 1e9)),
                transcendentals=float(rng.uniform(1e6, 1e8)),
                bytes_read=int(rng.uniform(1e6, 1e9)),
                # 40 kB to 4 MB: below and above the 1 MiB cache
                outputs=(TensorSpec(shape=(int(rng.integers(10**4, 10**6)),), dtype="float32"),),
            ),
            Op(name=f"g{i}", kind="data_movement", primitive="gather", bytes_read=int(rng.uniform(1e6, 1e9))),
        ]
        pieces.append((ops, predict(ops, device, truth)))
    fitted = calibrate(pieces, device)
    for name in EFFICIENCY_CLASSES:
        assert fitted.of(name) == pytest.approx(truth.of(name), rel=1e-3)


def test_profile_cli_json(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRATOR_CACHE", str(tmp_path))
    result = CliRunner().invoke(
        app, ["profile", "--recipe", "mamba-tiny", "--seq-len", "16", "--repeats", "1", "--json"]
    )
    assert result.exit_code == 0, result.output
    import json

    payload = json.loads(result.stdout)
    assert [row["layer"] for row in payload["layers"]] == [
        "Mamba/embedding",
        "Mamba/layers_0",
        "Mamba/norm_f+embedding.attend",
    ]
    assert payload["layers"][1]["count"] == 2
    assert set(payload["efficiency"]) == set(EFFICIENCY_CLASSES)
    assert any((tmp_path / "profiles").rglob("*.json"))


def test_profile_at_two_batches_measures_each_layers_fixed_part(tiny, tmp_path):
    recipe, state, batch, graph, layers = tiny
    cache = TimingCache(tmp_path, jax_version=jax.__version__)
    plain = profile_layers(recipe.train_step, state, batch, graph=graph, layers=layers, repeats=2, cache=cache)
    assert all(t.forward_fixed_s is None for t in plain.values())
    seen = []
    small = recipe.batch_spec(1, 32)
    timed = profile_layers(
        recipe.train_step,
        state,
        batch,
        graph=graph,
        layers=layers,
        repeats=2,
        cache=cache,
        progress=seen.append,
        fixed_from=(state, small),
    )
    assert len(seen) == 3  # cached timings without a fixed part are measured again
    assert all(0 <= t.forward_fixed_s and 0 <= t.backward_fixed_s for t in timed.values())
    assert all([r for r, _ in t.forward_at] == [0.5] and t.forward_at[0][1] > 0 for t in timed.values())
    again = profile_layers(
        recipe.train_step, state, batch, graph=graph, layers=layers, cache=cache, fixed_from=[(state, small)]
    )
    assert again == timed  # one smaller batch, as a list: the same profile, from the cache
    # per-call costs are never nothing on a CPU; one layer's two timings can cross under the other test
    # worker's load (a block once came out 0 and 0 in 1 of 5 parallel runs), so all layers together
    assert sum(t.forward_fixed_s + t.backward_fixed_s for t in timed.values()) > 0
    with pytest.raises(ValueError, match="smaller batch"):
        profile_layers(
            recipe.train_step, state, batch, graph=graph, layers=layers, cache=cache, fixed_from=(state, batch)
        )


def test_fixed_part_is_the_line_through_two_batches_at_zero():
    from integrations.flax._profile import _intercept

    assert _intercept(10.0, 4.0, 0.25) == pytest.approx(2.0)  # slope 8 per unit batch: 4 − 0.25 · 8
    assert _intercept(10.0, 1.0, 0.25) == 0.0  # super-linear: clamped at 0
    assert _intercept(10.0, 12.0, 0.25) == 12.0  # slower at the smaller batch: all of it is fixed
