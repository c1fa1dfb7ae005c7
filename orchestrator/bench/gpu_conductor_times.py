"""Measured times and memory of the conductor's kernels and rewrites on a real GPU.

Runs as a script on a machine with a GPU, JAX and Flax (it imports ``conductor`` and ``recipes``,
which stand on JAX and Flax alone, and nothing of ``orchestrator``)::

    PYTHONPATH=. python orchestrator/bench/gpu_conductor_times.py --out h100_conductor.json

and writes, per case, the median seconds of a forward-plus-backward pass (``jax.value_and_grad``
of a sum) and XLA's temp memory for it (``memory_analysis()``), or the error a form raised (an
out-of-memory is a result: the form does not fit the device). Cases, in the order they run:

    scan:             Mamba's selective scan written (``recipes.mamba.selective_scan``: the
                      (B, T, D, N) tensors, sequential scan) vs ``conductor.kernels.selective_scan``
    attention_cudnn:  ``jax.nn.dot_product_attention(..., implementation="cudnn")``, bf16, causal
                      and not, at long T: what a fused kernel's causal mask saves (the tiles it skips)
    attention:        written (einsum scores, ``jnp.tril`` mask, softmax, einsum) vs
                      ``conductor.kernels.attention`` as Pallas (Triton) and as blockwise XLA
    recipe_step:      a recipe's whole train step as written vs ``conductor.optimize(train_step)``
                      with the default policy, and (``kernel_scan``) the Mamba model built with the
                      Pallas scan the conductor substitutes

The script stops starting new cases once ``--budget`` seconds have passed and writes what it has
after every case, so a run cut short keeps its results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp


def _median_seconds(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _grad_of_sum(f, argnums):
    def loss(*xs):
        return jnp.sum(f(*xs).astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=argnums))


def _measure(fn, args, repeats: int) -> dict:
    compiled = fn.lower(*args).compile()
    memory = compiled.memory_analysis()
    return {
        "temp_bytes": int(memory.temp_size_in_bytes) if memory is not None else None,
        "seconds": _median_seconds(compiled, args, repeats),
    }


def written_attention(q, k, v):
    """The causal attention most people write: einsum scores, a tril mask, softmax, einsum."""
    heads, kv_heads = q.shape[2], k.shape[2]
    k, v = jnp.repeat(k, heads // kv_heads, axis=2), jnp.repeat(v, heads // kv_heads, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    seq = q.shape[1]
    mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    weights = jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(scores.dtype).min), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def _attention_inputs(seq, heads, kv_heads, head_dim, dtype, batch=1):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim), dtype)
    return q, k, v


def attention_cudnn_cases(seqs, repeats):
    """Llama 3 405B's attention on one tensor-parallel rank of 8: 16 query heads over 1 key-value
    head of 128, bf16, causal and not."""
    for seq in seqs:
        args = _attention_inputs(seq, 16, 1, 128, jnp.bfloat16)
        for causal in (True, False):

            def f(q, k, v, causal=causal):
                return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")

            yield (
                {
                    "case": "attention_cudnn",
                    "seq": seq,
                    "heads": 16,
                    "kv_heads": 1,
                    "head_dim": 128,
                    "dtype": "bfloat16",
                    "causal": causal,
                },
                lambda f=f, args=args: _measure(_grad_of_sum(f, (0, 1, 2)), args, repeats),
            )


def attention_cases(seqs, repeats):
    """The conductor bench's attention: 8 heads of 64, B=1, causal, float32 and bfloat16. ``pallas`` and
    ``xla_chunked`` run the kernels at their default blocks (128 × 128)."""
    import conductor
    from conductor.kernels.attention import attention

    for dtype in (jnp.float32, jnp.bfloat16):
        for seq in seqs:
            args = _attention_inputs(seq, 8, 8, 64, dtype)
            forms = {
                "written": written_attention,
                # the blocks the decision model picks for this device
                "conductor": conductor.optimize(written_attention, policy=conductor.Policy(attention="force")),
                "pallas": lambda q, k, v: attention(q, k, v, causal=True, implementation="pallas"),
                "xla_chunked": lambda q, k, v: attention(q, k, v, causal=True, implementation="xla_chunked"),
            }
            for form, f in forms.items():
                yield (
                    {
                        "case": "attention",
                        "form": form,
                        "seq": seq,
                        "heads": 8,
                        "head_dim": 64,
                        "dtype": jnp.dtype(dtype).name,
                        "causal": True,
                    },
                    lambda f=f, args=args: _measure(_grad_of_sum(f, (0, 1, 2)), args, repeats),
                )


def scan_cases(seqs, repeats, *, batch=2, d_inner=1536, d_state=16):
    """Mamba-130m's selective scan (d_inner 1536, d_state 16), float32, written vs kernels."""
    from conductor.kernels import selective_scan
    from recipes.mamba import selective_scan as written_scan

    def written(dt, a, v, b, c):
        delta_a = jnp.exp(dt[..., None] * a)  # (B, T, D, N), as the Mamba recipe discretises
        delta_bx = v[..., None] * b[:, :, None, :]
        return written_scan(delta_a, delta_bx, c)

    for seq in seqs:
        keys = jax.random.split(jax.random.key(1), 5)
        dt = jax.nn.softplus(jax.random.normal(keys[0], (batch, seq, d_inner))) * 0.1
        a = -jnp.exp(jax.random.normal(keys[1], (d_inner, d_state)))
        v = jax.random.normal(keys[2], (batch, seq, d_inner))
        b = jax.random.normal(keys[3], (batch, seq, d_state))
        c = jax.random.normal(keys[4], (batch, seq, d_state))
        args = (dt, a, v, b, c)
        forms = {
            "written": written,
            "pallas": lambda *xs: selective_scan(*xs, implementation="pallas"),
            "xla_chunked": lambda *xs: selective_scan(*xs, implementation="xla_chunked"),
        }
        for form, f in forms.items():
            yield (
                {
                    "case": "scan",
                    "form": form,
                    "batch": batch,
                    "seq": seq,
                    "d_inner": d_inner,
                    "d_state": d_state,
                    "dtype": "float32",
                },
                lambda f=f, args=args: _measure(_grad_of_sum(f, (0, 1, 2, 3, 4)), args, repeats),
            )


def recipe_step_cases(shapes, repeats, forms=("written", "optimized")):
    """A recipe's train step (state and batch on the GPU), as written and through ``conductor.optimize``."""
    import dataclasses

    import conductor
    from conductor.kernels import selective_scan
    from recipes import Mamba, get_recipe

    for name, batch, seq in shapes:
        recipe = get_recipe(name)
        if hasattr(recipe.config, "max_seq_len") and recipe.config.max_seq_len < seq:
            recipe = dataclasses.replace(recipe, config=dataclasses.replace(recipe.config, max_seq_len=seq))
        for form in forms:

            def run(recipe=recipe, form=form, batch=batch, seq=seq):
                state = recipe.initial_state(0)
                data = recipe.batch_for_step(0, 0, batch, seq)
                step = recipe.train_step
                if form == "optimized":
                    step = conductor.optimize(recipe.train_step)
                elif form == "kernel_scan":  # the model built with the kernel the conductor substitutes
                    model = Mamba(recipe.config, scan=lambda *xs: selective_scan(*xs, implementation="pallas"))
                    state = state.replace(apply_fn=model.apply)
                return _measure(jax.jit(step), (state, data), repeats)

            yield {"case": "recipe_step", "recipe": name, "form": form, "batch": batch, "seq": seq}, run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=float, default=400.0, help="seconds after which no new case starts")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--only", default=None, help="comma-separated case kinds or forms to run (default: all)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script on a CPU")
    args = parser.parse_args(argv)
    if args.smoke:
        cases = [
            *attention_cases((256,), 2),
            *scan_cases((128,), 2, d_inner=64),
            *recipe_step_cases((("mamba-130m", 1, 64),), 1, forms=("written", "optimized", "kernel_scan")),
        ]
    else:
        cases = [
            *scan_cases((2048, 8192), args.repeats),
            *attention_cudnn_cases((8192, 32768, 131072), args.repeats),
            *recipe_step_cases((("mamba-130m", 2, 2048), ("gpt2-small", 1, 8192)), max(3, args.repeats // 2)),
            *attention_cases((4096, 16384), args.repeats),
            *recipe_step_cases((("mamba-130m", 2, 2048), ("mamba-130m", 2, 8192)), 3, forms=("kernel_scan",)),
        ]
    if args.only:
        kinds = set(args.only.split(","))
        cases = [(meta, run) for meta, run in cases if meta["case"] in kinds or meta.get("form") in kinds]
    result = {
        "device_kind": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
        "cases": [],
    }
    start = time.perf_counter()
    for meta, run in cases:
        if time.perf_counter() - start > args.budget:
            result["cases"].append({**meta, "skipped": "budget"})
            continue
        try:
            meta.update(run())
        except Exception as error:  # an out-of-memory or a lowering failure is a result to record
            meta["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
            if not args.smoke:
                traceback.print_exc(limit=2)
        print(json.dumps(meta), flush=True)
        result["cases"].append(meta)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
