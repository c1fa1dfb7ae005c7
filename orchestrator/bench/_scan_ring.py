"""The sequence-sharded selective scan's cases of ``orchestrator bench conductor``, on virtual CPU devices.

Outputs and gradients against the one-device chunked scan (fp32, relative to the values' scale),
the carry's collective bytes read from the compiled HLO against ``scan_carry_bytes``, the
per-device temp memory of the compiled gradient (``memory_analysis()``) by the number of shards,
and a tiny Mamba's training losses sequence-sharded against the recipe on one device.
"""

from __future__ import annotations

import re
from functools import partial
from itertools import pairwise

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from conductor.kernels.scan import ScanBlockSizes, scan_carry_bytes, selective_scan, sequence_sharded_scan
from orchestrator.bench._case import rel_err
from orchestrator.bench._conductor import Claim, rel_diff

SIZES = ScanBlockSizes(chunk=64)
BATCH, D_INNER, D_STATE = 2, 16, 8


def scan_inputs(seq: int, *, batch: int = BATCH, d_inner: int = D_INNER, d_state: int = D_STATE, seed: int = 0):
    """(dt, a, v, b, c) as Mamba makes them (Δ = softplus(·) > 0, v = Δ ⊙ x, A < 0) and a cotangent w."""
    ks = jax.random.split(jax.random.key(seed), 6)
    dt = jax.nn.softplus(jax.random.normal(ks[0], (batch, seq, d_inner)))
    v = dt * jax.random.normal(ks[1], (batch, seq, d_inner))
    b, c = (jax.random.normal(k, (batch, seq, d_state)) for k in ks[2:4])
    a = -jnp.exp(0.5 * jax.random.normal(ks[4], (d_inner, d_state)))
    return (dt, a, v, b, c), jax.random.normal(ks[5], dt.shape)


def _value_and_grads(scan, w):
    @jax.jit
    def run(*args):
        y, vjp = jax.vjp(scan, *args)
        return y, vjp(w)

    return run


def scan_errors(n: int, seq: int, *, implementation: str = "xla_chunked") -> dict[str, float]:
    """Relative error (max |x − y| / max |y|) of y and of the gradients in dt, a, v, b, c (of Σ y ⊙ w),
    the scan sharded over ``n`` devices against the one-device ``xla_chunked`` scan."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("context",))
    args, w = scan_inputs(seq)

    def sharded(*args):
        return sequence_sharded_scan(*args, mesh=mesh, block_sizes=SIZES, implementation=implementation)

    def whole(*args):
        return selective_scan(*args, block_sizes=SIZES, implementation="xla_chunked")

    out, grads = _value_and_grads(sharded, w)(*args)
    ref, ref_grads = _value_and_grads(whole, w)(*args)
    names = ("y", "dt", "a", "v", "b", "c")
    return {name: rel_diff(x, y) for name, x, y in zip(names, (out, *grads), (ref, *ref_grads))}


def compiled_scan_grad(n: int, seq: int, *, batch: int = 1, d_inner: int = D_INNER, d_state: int = D_STATE):
    """The compiled gradient (in every input) of Σ y of the scan sharded over ``n`` devices, from shapes only."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("context",))
    tokens = NamedSharding(mesh, PartitionSpec(None, "context"))

    def spec(*shape, sharding=tokens):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)

    def loss(*args):
        return jnp.sum(sequence_sharded_scan(*args, mesh=mesh, block_sizes=SIZES))

    a = spec(d_inner, d_state, sharding=NamedSharding(mesh, PartitionSpec()))
    x, bc = spec(batch, seq, d_inner), spec(batch, seq, d_state)
    return jax.jit(jax.grad(loss, argnums=range(5))).lower(x, a, x, bc, bc).compile()


def compiled_one_device_grad(seq: int, *, batch: int = 1, d_inner: int = D_INNER, d_state: int = D_STATE):
    """The compiled gradient of Σ y of the one-device ``xla_chunked`` scan at length ``seq``, from shapes only."""

    def loss(*args):
        return jnp.sum(selective_scan(*args, block_sizes=SIZES, implementation="xla_chunked"))

    x, bc = (jax.ShapeDtypeStruct((batch, seq, d), jnp.float32) for d in (d_inner, d_state))
    a = jax.ShapeDtypeStruct((d_inner, d_state), jnp.float32)
    return jax.jit(jax.grad(loss, argnums=range(5))).lower(x, a, x, bc, bc).compile()


def collectives(hlo: str) -> list[tuple[str, int]]:
    """(kind, result bytes) of each all-gather, reduce-scatter, all-reduce and collective-permute in
    optimized HLO text (fp32 results)."""
    found = []
    for line in hlo.splitlines():
        match = re.search(r"= f32\[([\d,]*)\]\S* (all-gather|reduce-scatter|all-reduce|collective-permute)\(", line)
        if match:
            elements = int(np.prod([int(d) for d in match.group(1).split(",") if d]))
            found.append((match.group(2), 4 * elements))
    return found


def carry_sent_bytes(found: list[tuple[str, int]], n: int) -> int:
    """Bytes one device sends for the carry: a ring all-gather sends (n − 1)/n of its result, a ring
    reduce-scatter (n − 1) times its result."""
    sent = 0
    for kind, size in found:
        if kind == "all-gather":
            sent += size * (n - 1) // n
        elif kind == "reduce-scatter":
            sent += size * (n - 1)
    return sent


def numerics_cases(seq: int, shards: tuple[int, ...]) -> list[Claim]:
    return [
        Claim(
            name=f"scan_sharded_numerics_n{n}_T{seq}",
            ok=max(errors.values()) <= 1e-5,
            figures={f"{name}_rel_err": error for name, error in errors.items()},
        )
        for n in shards
        for errors in [scan_errors(n, seq)]
    ]


def compiled_cases(seq: int, shards: tuple[int, ...]) -> list[Claim]:
    """The carry's collective bytes against the prediction (exact), and the temp memory by shard count."""
    temp, claims = {}, []
    for n in shards:
        compiled = compiled_scan_grad(n, seq)
        temp[n] = int(compiled.memory_analysis().temp_size_in_bytes)
        found = collectives(compiled.as_text())
        sent = carry_sent_bytes(found, n)
        predicted = scan_carry_bytes(1, D_INNER, D_STATE, n, backward=True)
        claims.append(
            Claim(
                name=f"scan_sharded_carry_bytes_n{n}_T{seq}",
                # besides the carry, only ∂loss/∂A (D·N) is summed over the axis, as any replicated parameter
                ok=sent == predicted
                and all(kind != "all-reduce" or size == 4 * D_INNER * D_STATE for kind, size in found),
                figures={
                    "compiled_bytes": sent,
                    "predicted_bytes": predicted,
                    "collectives": [f"{kind} {size}" for kind, size in found],
                },
            )
        )
    first = shards[0]
    # the one-device kernel on one device's slice alone: the level the sharded scan is held to
    alone = {n: int(compiled_one_device_grad(seq // n).memory_analysis().temp_size_in_bytes) for n in shards}
    claims.append(
        Claim(
            name=f"scan_sharded_temp_memory_T{seq}",
            ok=all(temp[a] > temp[b] for a, b in pairwise(shards)) and all(temp[n] <= 2.5 * alone[n] for n in shards),
            figures={
                **{f"temp_bytes_n{n}": temp[n] for n in shards},
                **{f"temp_x_n_vs_n{first}_n{n}": temp[n] * n / (temp[first] * first) for n in shards},
                **{f"one_device_temp_bytes_T{seq // n}": alone[n] for n in shards},
                **{f"temp_vs_one_device_on_slice_n{n}": temp[n] / alone[n] for n in shards},
            },
        )
    )
    return claims


def scan_ring_cases(*, quick: bool = False, progress=lambda name: None) -> list[Claim]:
    """Every sequence-sharded scan case; ``quick``: T = 1024 on 2 and 4 devices and no training run
    (seconds, for tests; ``tests/recipes`` trains)."""
    seq, shards = (1024, (2, 4)) if quick else (8192, (2, 4, 8))
    shards = tuple(n for n in shards if n <= len(jax.devices()))
    if not shards:
        return []
    progress(f"sequence-sharded scan numerics T={seq}")
    claims = numerics_cases(seq, shards)
    progress(f"sequence-sharded scan compiled T={seq}")
    claims += compiled_cases(seq, shards)
    if not quick:
        progress(f"sequence-sharded Mamba, {shards[-1]} devices")
        claims.append(mamba_case(shards[-1], 2048))
    return claims


def mamba_sequence_sharded_loss(model, mesh: Mesh, axis_name: str = "context"):
    """Mean next-token cross-entropy of a sequence-sharded Mamba: ``loss(params, batch)``.

    ``model`` is built with ``sequence_axis=axis_name``; the batch's inputs and targets (batch, seq)
    are split contiguously over ``axis_name``, the parameters replicated. Each device sums its
    tokens' losses and one ``psum`` adds the sums; the parameters' gradients are summed over the
    axis by the ``shard_map``'s transpose.
    """
    tokens = PartitionSpec(None, axis_name)

    def local(params, inputs, targets):
        logits = model.apply({"params": params}, inputs).astype(jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return jax.lax.psum(jnp.sum(losses), axis_name)

    def loss(params, batch):
        total = jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(), tokens, tokens), out_specs=PartitionSpec())
        return total(params, batch["inputs"], batch["targets"]) / batch["targets"].size

    return loss


def mamba_losses(n: int, seq: int, *, steps: int = 5) -> tuple[list[float], list[float]]:
    """Losses of ``steps`` AdamW steps of a tiny Mamba at length ``seq``: sequence-sharded over ``n``
    devices, and on one device with the recipe's written scan (the same initial parameters and batches)."""
    from flax.training.train_state import TrainState

    from conductor.kernels.scan import sequence_sharded_scan_shard
    from recipes import Mamba, MambaConfig
    from recipes.train import adamw, loss_fn, synthetic_batch

    config = MambaConfig(vocab_size=64, num_layers=2, d_model=16, d_state=4)
    mesh = Mesh(np.array(jax.devices()[:n]), ("context",))
    scan = partial(sequence_sharded_scan_shard, axis_name="context", block_sizes=ScanBlockSizes(chunk=64))
    sharded = Mamba(config, sequence_axis="context", scan=scan)
    written = Mamba(config)
    batches = [synthetic_batch(jax.random.key(step), 2, seq, config.vocab_size) for step in range(steps)]
    params = written.init(jax.random.key(0), batches[0]["inputs"])["params"]
    sharded_loss = mamba_sequence_sharded_loss(sharded, mesh)

    def written_loss(params, batch):
        return loss_fn(params, written.apply, batch)

    def run(loss, place):
        @jax.jit
        def step(state, batch):
            value, grads = jax.value_and_grad(loss)(state.params, batch)
            return state.apply_gradients(grads=grads), value

        state = TrainState.create(apply_fn=None, params=params, tx=adamw(1e-2))
        losses = []
        for batch in batches:
            state, value = step(state, place(batch))
            losses.append(float(value))
        return losses

    tokens = NamedSharding(mesh, PartitionSpec(None, "context"))
    return run(sharded_loss, lambda batch: jax.device_put(batch, tokens)), run(written_loss, lambda batch: batch)


def mamba_case(n: int, seq: int, *, steps: int = 5) -> Claim:
    """Five AdamW steps of a tiny Mamba sequence-sharded over ``n`` devices against the recipe on one
    device: every step's loss within 1e-5 relative."""
    sharded, written = mamba_losses(n, seq, steps=steps)
    worst = max(abs(rel_err(s, w)) for s, w in zip(sharded, written))
    return Claim(
        name=f"scan_sharded_mamba_steps_n{n}_T{seq}",
        ok=worst <= 1e-5 and written[-1] < written[0],
        figures={"sharded_losses": sharded, "one_device_losses": written, "max_loss_rel_err": worst},
    )
