"""Build the substitute for one match: the kernel call plus the layout glue around it."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from conductor.decide import Decision
from conductor.jaxpr import Substitution
from conductor.kernels import attention, selective_scan, selective_scan_chunk
from conductor.match import Match
from conductor.rewrite._fuse import fused


def substitution(match: Match, decision: Decision) -> Substitution:
    """The :class:`Substitution` that runs ``match`` as the kernel ``decision`` chose."""
    if match.pattern == "attention":
        return _attention(match, decision)
    if match.pattern == "linear_recurrence":
        return _recurrence(match)
    return _scan(match, decision)


def kernel_substitution(match: Match, decision: Decision) -> Substitution:
    """The kernel alone, without the equations :func:`substitution` fuses around it (what it stands in for)."""
    return _scan_core(match, decision) if match.pattern == "selective_scan" else substitution(match, decision)


def _attention(match: Match, decision: Decision) -> Substitution:
    r = match.region
    lay = r["layout"]
    out_var = match.level.eqns[match.anchor].outvars[0]
    n_batch = len(lay["batch"])
    extras = lay["extras"]
    extra_sizes = [r["extra_sizes"][lab] for lab in extras]
    causal, scale, mask = r["causal"], r["scale"], r["mask"]

    def fn(q, k, v):
        # query → (B*, T, G, D): batch dims, then extra query dims as heads; keys/values → (B*, S, 1, D)
        q = jnp.transpose(q, lay["q_dims"])
        bflat, t, d = q.shape[:n_batch], q.shape[-2], q.shape[-1]
        q = q.reshape(-1, math.prod(extra_sizes), t, d).transpose(0, 2, 1, 3)
        k = jnp.transpose(k, lay["k_dims"])
        k = k.reshape(-1, k.shape[-2], 1, k.shape[-1])
        v = jnp.transpose(v, lay["v_dims"])
        v = v.reshape(-1, v.shape[-2], 1, v.shape[-1])
        o = attention(
            q,
            k,
            v,
            causal=causal,
            window=mask["window"],
            prefix=mask["prefix"],
            scale=scale,
            block_sizes=decision.block_sizes,
            implementation=decision.implementation,
        )
        o = o.transpose(0, 2, 1, 3).reshape(*bflat, *extra_sizes, t, o.shape[-1])
        labels = [f"b{i}" for i in range(n_batch)] + extras + [lay["t_label"], "dv"]
        out_labels = lay["out_labels"]
        # size-1 dims the written form drops or inserts between its products (a squeezed batch of one)
        kept = [lab for lab in labels if lab in out_labels]
        inserted = [lab for lab in out_labels if lab not in labels]
        o = o.reshape([n for lab, n in zip(labels, o.shape) if lab in out_labels] + [1] * len(inserted))
        o = jnp.transpose(o, [(kept + inserted).index(lab) for lab in out_labels])
        return [o.astype(out_var.aval.dtype)]

    return Substitution(anchor=match.anchor, inputs=(r["q"], r["k"], r["v"]), outvars=(out_var,), fn=fn)


def _scan_core(match: Match, decision: Decision) -> Substitution:
    sel = match.region["selective"]
    ys = sel["ys"]

    def fn(dt, a, v, b, c):
        y = selective_scan(
            dt, a, v, b, c, block_sizes=decision.block_sizes, implementation=decision.implementation
        )  # (B, T, D)
        # the scan emitted it time-major; named so that the fused island keeps it for its backward
        return [checkpoint_name(jnp.swapaxes(y, 0, 1).astype(ys.aval.dtype), "conductor_scan_out")]

    inputs = (sel["dt"], sel["a"], sel["v"], sel["b"], sel["c"])
    return Substitution(anchor=match.anchor, inputs=inputs, outvars=(ys,), fn=fn)


def _scan(match: Match, decision: Decision) -> Substitution:
    core = _scan_core(match, decision)
    # only the XLA kernel runs its chunks as a loop the island can join; around the Pallas kernel's
    # custom VJP a checkpoint would run its forward kernel again in the backward
    if decision.implementation != "xla_chunked":
        return core
    per_chunk = {"chunk_core": selective_scan_chunk, "seq": match.shapes["seq"], "chunk": decision.block_sizes.chunk}
    # a low-rank projection feeding the scan (Mamba's x_proj to Δ, B, C, of width D/32 + 2N; dt_proj
    # from rank D/32) is recomputed with the island: at rank ≤ D/8 that costs at most an eighth of
    # the block's input projection (d_model = D/2 to 2D); the full-width projections stay outside
    return fused(match.level, core, max_rank=match.shapes["d_inner"] // 8, per_chunk=per_chunk)


def _recurrence(match: Match) -> Substitution:
    """h_t = a_t ⊙ h_{t−1} + b_t by ``lax.associative_scan`` with (a₁, b₁)∘(a₂, b₂) = (a₁a₂, a₂b₁ + b₂);
    the rest of the body then runs for all t at once (vmapped) on h_{t−1}."""
    scan = match.level.eqns[match.anchor]
    p = scan.params
    body, n_consts = p["jaxpr"], p["num_consts"]
    rec = match.region
    a_idx, b_idx = rec["a_xs"] - n_consts - 1, rec["b_xs"] - n_consts - 1  # positions among the xs

    def fn(*invals):
        from conductor.jaxpr import evaluate

        consts, h0, xs = invals[:n_consts], invals[n_consts], invals[n_consts + 1 :]
        a, b = xs[a_idx], xs[b_idx]  # (T, *state)
        a = jnp.concatenate([jnp.ones_like(a[:1]), a])  # prepend (1, h0): then h_t is the prefix product
        b = jnp.concatenate([h0[None], b])

        def combine(x, y):
            return x[0] * y[0], y[0] * x[1] + y[1]

        _, h = jax.lax.associative_scan(combine, (a, b))  # h[t] = h_t, h[0] = h0
        h_prev, h_last = h[:-1], h[-1]

        def step(hp, x):
            return evaluate(body.jaxpr, body.consts, [*consts, hp, *x])[1:]

        ys = jax.vmap(step)(h_prev, list(xs)) if xs else []
        return [h_last, *ys]

    return Substitution(anchor=match.anchor, inputs=tuple(scan.invars), outvars=tuple(scan.outvars), fn=fn)
