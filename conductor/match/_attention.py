"""Find attention in one jaxpr level: Q·Kᵀ → [scale, mask, bias] → softmax → ·V.

Matched by meaning, not by spelling. From every ``dot_general`` we look for an
operand that is a softmax — the inline form exp(s − max s) / Σ exp(…) (with or
without the max, through broadcasts, ``stop_gradient`` and casts) or a
``custom_jvp`` whose body is one — contracted over the softmax axis. From the
softmax input we walk back through scalings, selects with a constant mask,
constant additive masks, casts and transposes to a ``dot_general`` with one
contracted dim (the head dim) whose other operand contributes exactly one free
dim, the softmax axis (the key sequence). Einsum and ``dot_general``/``@``
spellings, heads as batch dims or as extra query dims (GQA written with a group
axis) all reduce to labels on the score axes: ``b*`` (batch and head dims paired
between Q and K), ``q*`` (query free dims) and ``s`` (keys). Constant masks are
folded to arrays and compared with tril to recognise causal attention.
"""

from __future__ import annotations

import numpy as np

from conductor.match._graph import Graph

_MASKED = -1e9  # a fill or additive bias at or below this removes the key


def softmax_input(g: Graph, p):
    """(s, axis) if ``p`` = softmax(s, axis), else None."""
    e = g.eqn(g.through(p, ("convert_element_type",)))
    if e is None:
        return None
    if e.primitive.name == "custom_jvp_call":
        inner = e.params["call_jaxpr"]
        sub = Graph(inner.jaxpr, inner.consts)
        found = softmax_input(sub, inner.jaxpr.outvars[0])
        if found and sub.through(found[0]) is inner.jaxpr.invars[0]:
            return e.invars[0], found[1]
        return None
    if e.primitive.name != "div":
        return None
    num = g.through(e.invars[0], ("convert_element_type",))
    exp = g.eqn(num)
    total = g.eqn(g.through(e.invars[1]))
    if exp is None or exp.primitive.name != "exp" or total is None or total.primitive.name != "reduce_sum":
        return None
    if g.through(total.invars[0], ("convert_element_type",)) is not num or len(total.params["axes"]) != 1:
        return None
    axis = total.params["axes"][0]
    x = exp.invars[0]
    sub = g.eqn(x)
    if sub is not None and sub.primitive.name == "sub":
        m = g.eqn(_through_max(g, sub.invars[1]))
        if m is not None and m.primitive.name == "reduce_max" and g.through(m.invars[0]) is g.through(sub.invars[0]):
            return sub.invars[0], axis
    return x, axis


def _through_max(g: Graph, v):
    while True:
        v = g.through(v)
        e = g.eqn(v)
        if e is None or e.primitive.name != "max":
            return v
        const = [g.scalar(x) for x in e.invars]
        if const[0] is not None and const[0] == -np.inf:
            v = e.invars[1]
        elif const[1] is not None and const[1] == -np.inf:
            v = e.invars[0]
        else:
            return v


def _walk_to_scores(g: Graph, s):
    """Back from the softmax input to the Q·Kᵀ ``dot_general``: (dot eqn, steps, problems) or None."""
    steps, problems, scale = [], [], 1.0
    v = s
    while True:
        e = g.eqn(v)
        if e is None:
            return None
        name = e.primitive.name
        if name == "dot_general":
            return e, steps, problems, scale
        if name == "transpose":
            steps.append(("transpose", e.params["permutation"]))
            v = e.invars[0]
        elif name in ("convert_element_type", "copy", "reduce_precision"):
            v = e.invars[0]
        elif name in ("mul", "div"):
            consts = [g.scalar(x) for x in e.invars]
            if name == "div" and consts[1] is not None:
                scale /= consts[1]
                v = e.invars[0]
            elif name == "mul" and (consts[0] is not None or consts[1] is not None):
                k = 0 if consts[0] is not None else 1
                scale *= consts[k]
                v = e.invars[1 - k]
            else:
                problems.append(f"{name} by a tensor that is not a constant scalar")
                v = e.invars[0]
        elif name == "select_n" and len(e.invars) == 3:
            pred, *cases = e.invars
            fills = [g.scalar(c) for c in cases]
            k = 1 if fills[0] is not None else 0  # the case that carries the scores
            mask = g.value(pred)
            if mask is None:
                problems.append("mask computed from inputs")
            elif fills[1 - k] is None or fills[1 - k] > _MASKED:
                problems.append("select fills with a value that does not remove keys")
            else:
                steps.append(("mask", mask.astype(bool) if k == 1 else ~mask.astype(bool), e.outvars[0].aval.shape))
            v = cases[k]
        elif name in ("add", "sub"):
            values = [g.value(x) for x in e.invars]
            k = 1 if values[1] is not None or name == "sub" else 0
            bias = values[k]
            if bias is None:
                problems.append("bias computed from inputs")
            elif np.all((bias == 0) | (bias <= _MASKED) if name == "add" else bias == 0):
                steps.append(("mask", bias > _MASKED, e.outvars[0].aval.shape))
            else:
                problems.append("additive bias (not a mask)")
            v = e.invars[1 - k]
        else:
            return None


def match_attention(g: Graph, index: int) -> dict | None:
    """The attention whose P·V product is equation ``index``, as a description dict, or None."""
    pv = g.jaxpr.eqns[index]
    (lc, rc), (lb, rb) = pv.params["dimension_numbers"]
    for side in (0, 1):
        p_var, _v_var = pv.invars[side], pv.invars[1 - side]
        pc, vc, pb, vb = (lc, rc, lb, rb) if side == 0 else (rc, lc, rb, lb)
        found = softmax_input(g, p_var)
        if found is None or tuple(pc) != (found[1],) or len(vc) != 1:
            continue
        walk = _walk_to_scores(g, found[0])
        if walk is None:
            continue
        described = _describe(g, walk, found[1], pv, side, pb, vb, vc)
        if described is not None:
            return described
    return None


def _describe(g, walk, axis, pv, side, pb, vb, vc):
    qk, steps, problems, scale = walk
    (lc, rc), (lb, rb) = qk.params["dimension_numbers"]
    if len(lc) != 1:
        return None
    lhs, rhs = qk.invars
    l_free = [d for d in range(lhs.aval.ndim) if d not in lc and d not in lb]
    r_free = [d for d in range(rhs.aval.ndim) if d not in rc and d not in rb]
    labels = [f"b{i}" for i in range(len(lb))] + [f"L{d}" for d in l_free] + [f"R{d}" for d in r_free]
    masks = []
    for step in reversed(steps):
        if step[0] == "transpose":
            labels = [labels[p] for p in step[1]]
        else:
            masks.append((np.broadcast_to(step[1], step[2]), list(labels)))
    key = labels[axis]
    if key.startswith("R") and len(r_free) == 1:
        q, k, qc, kc, qb, kb, q_free = lhs, rhs, lc[0], rc[0], lb, rb, l_free
        q_label = "L"
    elif key.startswith("L") and len(l_free) == 1:
        q, k, qc, kc, qb, kb, q_free = rhs, lhs, rc[0], lc[0], rb, lb, r_free
        q_label = "R"
    else:
        return None
    s_dim = next(d for d in range(k.aval.ndim) if d != kc and d not in kb)
    v_free = [d for d in range(pv.invars[1 - side].aval.ndim) if d not in vc and d not in vb]
    p_labels = labels  # softmax keeps the layout of its input
    if sorted(p_labels[d] for d in pb) != sorted(f"b{i}" for i in range(len(qb))) or len(v_free) != 1:
        return None
    q_labels = [f"{q_label}{d}" for d in q_free]
    seq_q, seq_k = [q.aval.shape[d] for d in q_free], k.aval.shape[s_dim]
    t_label, causal = _causal(masks, q_labels, key, q, seq_k, problems)
    v_batch = {p_labels[pd]: vd for pd, vd in zip(pb, vb)}
    p_free = [p_labels[d] for d in range(len(p_labels)) if d not in pb and d != axis]
    out_labels = [p_labels[d] for d in pb] + ([*p_free, "dv"] if side == 0 else ["dv", *p_free])
    batch = [q.aval.shape[d] for d in qb]
    heads = int(np.prod([q.aval.shape[int(lab[1:])] for lab in q_labels if lab != t_label], dtype=int))
    head_dim, dv = q.aval.shape[qc], pv.invars[1 - side].aval.shape[v_free[0]]
    if dv != head_dim:
        problems.append(f"value head dim {dv} differs from query head dim {head_dim}")
    if not q_labels or t_label is None:
        return None
    return {
        "q": q,
        "k": k,
        "v": pv.invars[1 - side],
        "layout": {
            "q_dims": [*qb, *[int(lab[1:]) for lab in q_labels if lab != t_label], int(t_label[1:]), qc],
            "k_dims": [*kb, s_dim, kc],
            "v_dims": [*[v_batch[f"b{i}"] for i in range(len(qb))], vc[0], v_free[0]],
            "batch": batch,
            "extras": [lab for lab in q_labels if lab != t_label],
            "t_label": t_label,
            "out_labels": out_labels,
        },
        "shapes": {
            "q": (int(np.prod(batch, dtype=int)), seq_q[q_labels.index(t_label)], heads, head_dim),
            "k": (int(np.prod(batch, dtype=int)), seq_k, 1, head_dim),
        },
        "causal": causal,
        "scale": scale,
        "problems": problems,
        "extra_sizes": {lab: q.aval.shape[int(lab[1:])] for lab in q_labels},
    }


def _causal(masks, q_labels, key, q, seq_k, problems):
    """(query-sequence label, causal?) from the constant masks on the score axes."""
    if not masks:
        return q_labels[-1], False
    combined = None
    for mask, labels in masks:
        m = np.transpose(mask, [labels.index(lab) for lab in sorted(labels)])
        combined = m if combined is None else combined & m
    order = sorted(masks[0][1])
    if combined.all():
        return q_labels[-1], False
    for t in reversed(q_labels):
        if q.aval.shape[int(t[1:])] != seq_k:
            continue
        axes = [order.index(t), order.index(key)]
        moved = np.moveaxis(combined, axes, [-2, -1]).reshape(-1, seq_k, seq_k)
        if np.all(moved == np.tril(np.ones((seq_k, seq_k), bool))):
            return t, True
    problems.append("mask is neither causal nor empty")
    return q_labels[-1], False
