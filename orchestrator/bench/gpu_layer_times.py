"""Measured times of one tensor-parallel rank's transformer pieces on a real GPU.

Runs as a script on a machine with a GPU and JAX alone (it imports nothing of
Orchestrator, so the machine needs no other package)::

    python orchestrator/bench/gpu_layer_times.py --out h100.json

and writes, per piece and shape, the median seconds of its forward pass and of
its forward plus backward pass. The pieces are the per-rank work of a
Megatron-style GPT (Shoeybi et al., 2019) under tensor parallelism ``t``, in
bf16 compute on float32 parameters (mixed precision, as the published runs in
``orchestrator/bench/data/published_runs.yaml`` train):

    block:  x + Attn(LN(x)) then + MLP(LN(·))   with n/t heads of 128 and a 4h/t MLP
            attention "xla": softmax(QKᵀ/√d + causal) V with the scores materialised,
                             softmax in float32 (Megatron's fused scale-mask-softmax)
            attention "flash": ``jax.nn.dot_product_attention(..., implementation="cudnn")``
    head:   LN(x) Eᵀ over V/t vocabulary rows, then cross-entropy in float32
    adamw:  one optax AdamW update of a float32 parameter vector

:func:`block_loss`, :func:`head_loss` and :func:`piece_args` are what
``orchestrator bench gpu-calibration`` captures on the CPU to fit the GPU's
efficiencies to these times, so the measured and the modelled work are the
same functions at the same shapes.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp

HEAD_DIM = 128
SEQ_LEN = 2048
VOCAB = 51200


def layer_norm(x, scale, bias):
    """LayerNorm in float32, returned in the input's dtype."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias).astype(x.dtype)


def _dense(x, w, b):
    return x @ w.astype(x.dtype) + b.astype(x.dtype)


def _attention(q, k, v, kind: str):
    """Causal attention of (batch, seq, heads, head_dim) tensors."""
    if kind == "flash":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    seq = q.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def block_loss(params, x, attention: str = "xla"):
    """Sum of one transformer block's output (a scalar to differentiate); x: (batch, seq, hidden) bf16."""
    p = params
    b, s, _ = x.shape
    heads = p["w_o"].shape[0] // HEAD_DIM
    qkv = _dense(layer_norm(x, p["ln1_s"], p["ln1_b"]), p["w_qkv"], p["b_qkv"]).reshape(b, s, 3, heads, HEAD_DIM)
    out = _attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], attention).reshape(b, s, heads * HEAD_DIM)
    x = x + _dense(out, p["w_o"], p["b_o"])
    u = jax.nn.gelu(_dense(layer_norm(x, p["ln2_s"], p["ln2_b"]), p["w_1"], p["b_1"]))
    x = x + _dense(u, p["w_2"], p["b_2"])
    return x.astype(jnp.float32).sum()


def head_loss(params, x, targets):
    """Mean cross-entropy of the LM head over this rank's V/t vocabulary rows."""
    logits = layer_norm(x, params["ln_s"], params["ln_b"]) @ params["emb"].astype(x.dtype).T
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, (targets % logits.shape[-1])[..., None], axis=-1)[..., 0]
    return (jax.nn.logsumexp(logits, axis=-1) - picked).mean()


def piece_args(piece: str, hidden: int, tp: int, batch: int, seq: int = SEQ_LEN, vocab: int = VOCAB):
    """``ShapeDtypeStruct`` arguments of ``piece`` ("block" or "head") for one TP rank."""
    f32, bf16 = jnp.float32, jnp.bfloat16

    def s(*shape, dtype=f32):
        return jax.ShapeDtypeStruct(shape, dtype)

    x = s(batch, seq, hidden, dtype=bf16)
    if piece == "head":
        params = {"ln_s": s(hidden), "ln_b": s(hidden), "emb": s(vocab // tp, hidden)}
        return params, x, s(batch, seq, dtype=jnp.int32)
    width = hidden // tp  # heads·head_dim on this rank
    params = {
        "ln1_s": s(hidden),
        "ln1_b": s(hidden),
        "w_qkv": s(hidden, 3 * width),
        "b_qkv": s(3 * width),
        "w_o": s(width, hidden),
        "b_o": s(hidden),
        "ln2_s": s(hidden),
        "ln2_b": s(hidden),
        "w_1": s(hidden, 4 * width),
        "b_1": s(4 * width),
        "w_2": s(4 * width, hidden),
        "b_2": s(hidden),
    }
    return params, x


def _materialise(args, key):
    leaves, tree = jax.tree_util.tree_flatten(args)
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, leaf in zip(keys, leaves):
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            out.append(jax.random.randint(k, leaf.shape, 0, VOCAB, leaf.dtype))
        else:
            out.append((0.02 * jax.random.normal(k, leaf.shape, jnp.float32)).astype(leaf.dtype))
    return jax.tree_util.tree_unflatten(tree, out)


def _median_s(fn, args, repeats: int) -> float:
    """Median seconds of ``fn(*args)`` after two warm-up calls (``orchestrator.timing`` does the same,
    but this script must run where only JAX is installed)."""
    jax.block_until_ready(fn(*args))  # compile and warm up
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _shapes(smoke: bool) -> Iterator[dict]:
    if smoke:
        yield {"piece": "block", "hidden": 256, "tp": 1, "batch": 1, "seq": 128, "attention": "xla"}
        yield {"piece": "head", "hidden": 256, "tp": 1, "batch": 1, "seq": 128}
        yield {"piece": "adamw", "params": 1 << 16}
        return
    for hidden, batches in ((2048, (1, 4)), (4096, (1, 4)), (8192, (1, 2)), (12288, (1, 2)), (6144, (1,))):
        for tp in (1, 2, 4, 8):
            for batch in batches:
                yield {"piece": "block", "hidden": hidden, "tp": tp, "batch": batch, "seq": SEQ_LEN, "attention": "xla"}
        for tp in (1, 8):
            yield {"piece": "head", "hidden": hidden, "tp": tp, "batch": 1, "seq": SEQ_LEN}
    for n in (1 << 24, 1 << 27):
        yield {"piece": "adamw", "params": n}
    for hidden in (4096, 12288):
        for tp in (1, 8):
            yield {"piece": "block", "hidden": hidden, "tp": tp, "batch": 1, "seq": SEQ_LEN, "attention": "flash"}


def measure(shape: dict, repeats: int, key) -> dict:
    """Median forward and forward+backward seconds of one piece at one shape."""
    if shape["piece"] == "adamw":
        import optax

        tx = optax.adamw(1e-4)
        params = jnp.zeros((shape["params"],), jnp.float32)
        grads = 1e-3 * jax.random.normal(key, params.shape)
        state = tx.init(params)

        @jax.jit
        def update(p, g, st):
            upd, st = tx.update(g, st, p)
            return optax.apply_updates(p, upd), st

        return {**shape, "update_s": _median_s(update, (params, grads, state), repeats)}
    args = piece_args(shape["piece"], shape["hidden"], shape["tp"], shape["batch"], shape["seq"])
    args = _materialise(args, key)
    if shape["piece"] == "block":
        loss = functools.partial(block_loss, attention=shape["attention"])
        argnums = (0, 1)
    else:
        loss, argnums = head_loss, (0, 1)
    forward = jax.jit(loss)
    both = jax.jit(jax.value_and_grad(loss, argnums=argnums))
    flops = (forward.lower(*args).compile().cost_analysis() or {}).get("flops")
    return {
        **shape,
        "forward_s": _median_s(forward, args, repeats),
        "forward_backward_s": _median_s(both, args, repeats),
        "xla_forward_flops": flops,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write (rewritten after every shape)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script on a CPU")
    parser.add_argument("--skip", type=int, default=0, help="start after this many shapes of the sweep")
    ns = parser.parse_args(argv)
    device = jax.devices()[0]
    result = {"device_kind": device.device_kind, "platform": device.platform, "jax": jax.__version__, "pieces": []}
    key = jax.random.key(0)
    for shape in list(_shapes(ns.smoke))[ns.skip :]:
        key, sub = jax.random.split(key)
        try:
            row = measure(shape, ns.repeats, sub)
        except Exception as err:  # out of memory or an unsupported kernel: recorded, the sweep goes on
            row = {**shape, "error": f"{type(err).__name__}: {str(err)[:200]}"}
        result["pieces"].append(row)
        print(json.dumps(row), flush=True)
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
