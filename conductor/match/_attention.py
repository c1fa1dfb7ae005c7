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

import math

import numpy as np

from conductor.kernels.attention import Band
from conductor.match._graph import CHECK_CHUNK, Const, Graph

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


def _truthy(x):
    return np.asarray(x).astype(bool)


def _falsy(x):
    return ~np.asarray(x).astype(bool)


def _removes_or_keeps(bias: Const) -> bool:
    """Every entry of ``bias`` is 0 (keep the key) or at most ``_MASKED`` (remove it)."""
    return all(bool(np.all((x == 0) | (x <= _MASKED))) for _, x in bias.sweep())


def _walk_to_scores(g: Graph, s):
    """Back from the softmax input to the Q·Kᵀ ``dot_general``.

    Returns (dot eqn, steps, problems, scale), or a string saying where the walk stopped.
    """
    steps, problems, scale = [], [], 1.0
    v = s
    while True:
        e = g.eqn(v)
        if e is None:
            return "the softmax input is not computed from a Q·Kᵀ product in this body"
        name = e.primitive.name
        shape = e.outvars[0].aval.shape
        if name == "dot_general":
            return e, steps, problems, scale
        if name == "transpose":
            steps.append(("transpose", e.params["permutation"]))
            v = e.invars[0]
        elif (units := _unit_map(e)) is not None:
            steps.append(("units", units))
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
            mask = g.const(pred)
            if mask is None:
                why = g.why_not_const(pred)
                if "input" in why:  # positions passed in, or data (padding): _describe tells which
                    steps.append(("input mask", g, pred, _truthy if k == 1 else _falsy, shape))
                else:
                    problems.append(f"mask is {why}")
            elif fills[1 - k] is None or fills[1 - k] > _MASKED:
                problems.append("select fills with a value that does not remove keys")
            else:
                keep = mask.map(_truthy if k == 1 else _falsy)
                steps.append(("mask", keep.fit(shape), shape))
            v = cases[k]
        elif name in ("add", "sub"):
            consts = [g.const(x) for x in e.invars]
            k = 1 if consts[1] is not None or name == "sub" else 0
            if name == "add" and consts[0] is None and consts[1] is None:  # scores + bias in either order
                k = 1 if isinstance(_walk_to_scores(g, e.invars[0]), tuple) else 0
            bias = consts[k]
            if bias is None:
                steps.append(("input bias", g, e.invars[k], np.negative if name == "sub" else None, shape))
            else:
                bias = (bias if name == "add" else bias.map(np.negative)).fit(shape)
                if _removes_or_keeps(bias):
                    steps.append(("mask", bias.map(lambda x: x > _MASKED), shape))
                else:
                    problems.append("additive bias (not a mask)")
            v = e.invars[1 - k]
        else:
            return f"the scores pass through {name} between Q·Kᵀ and the softmax"


def _unit_map(e):
    """For an equation that only inserts or drops size-1 dims: the input dim of each output dim
    (None for an inserted one), else None."""
    name = e.primitive.name
    src, dst = tuple(e.invars[0].aval.shape), tuple(e.outvars[0].aval.shape)
    if name == "broadcast_in_dim":
        dims = e.params["broadcast_dimensions"]
        if any(src[k] != dst[d] for k, d in enumerate(dims)) or any(
            dst[d] != 1 for d in range(len(dst)) if d not in dims
        ):
            return None
        return [dims.index(d) if d in dims else None for d in range(len(dst))]
    if name == "squeeze":
        dropped = {d % len(src) for d in e.params["dimensions"]}
        return [d for d in range(len(src)) if d not in dropped]
    if name == "reshape" and e.params.get("dimensions") is None:
        mapping, i = [], 0
        for n in dst:
            while i < len(src) and src[i] == 1 and n != 1:
                i += 1
            if i < len(src) and src[i] == n:
                mapping.append(i)
                i += 1
            elif n == 1:
                mapping.append(None)
            else:
                return None
        return mapping if all(src[j] == 1 for j in range(i, len(src))) else None
    return None


def _through_units(g: Graph, v):
    """(source, mapping): ``v`` is ``source`` with size-1 dims inserted or dropped and dtype casts;
    mapping[i] is the source dim of ``v``'s dim i (None for an inserted one)."""
    mapping = list(range(len(v.aval.shape)))
    while (e := g.eqn(v)) is not None:
        if e.primitive.name == "convert_element_type":
            v = e.invars[0]
            continue
        step = _unit_map(e)
        if step is None:
            break
        mapping = [None if m is None else step[m] for m in mapping]
        v = e.invars[0]
    return v, mapping


def match_attention(g: Graph, index: int) -> dict | None:
    """The attention whose P·V product is equation ``index``, as a description dict, or None.

    A softmax contracted over its axis with another tensor is a candidate: when the rest does not
    match, the dict says why in ``problems`` (and has no kernel layout).
    """
    pv = g.jaxpr.eqns[index]
    (lc, rc), (lb, rb) = pv.params["dimension_numbers"]
    unmatched = None
    for side in (0, 1):
        p_source, p_map = _through_units(g, pv.invars[side])
        pc, vc, pb, vb = (lc, rc, lb, rb) if side == 0 else (rc, lc, rb, lb)
        found = softmax_input(g, p_source)
        if found is None or len(pc) != 1 or p_map[pc[0]] != found[1]:
            continue
        if len(vc) != 1:
            unmatched = unmatched or "V is contracted over more than one dim"
            continue
        walk = _walk_to_scores(g, found[0])
        if isinstance(walk, str):
            unmatched = unmatched or walk
            continue
        described = _describe(walk, pv, side, p_map, pc[0], pb, vb, vc)
        if isinstance(described, dict):
            return described
        unmatched = unmatched or described
    if unmatched is None:
        return None
    return {
        "shapes": {},
        "causal": False,
        "mask": {"kind": "unsupported", "window": None, "prefix": 0},
        "scale": 1.0,
        "problems": [f"not matched: {unmatched}"],
    }


def _describe(walk, pv, side, p_map, pc, pb, vb, vc):
    """The kernel layout of a matched attention (a dict), or why it does not fit one (a string)."""
    qk, steps, problems, scale = walk
    (lc, rc), (lb, rb) = qk.params["dimension_numbers"]
    if len(lc) != 1:
        return f"Q·Kᵀ contracts {len(lc)} dims (one head dim expected)"
    lhs, rhs = qk.invars
    l_free = [d for d in range(lhs.aval.ndim) if d not in lc and d not in lb]
    r_free = [d for d in range(rhs.aval.ndim) if d not in rc and d not in rb]
    labels = [f"b{i}" for i in range(len(lb))] + [f"L{d}" for d in l_free] + [f"R{d}" for d in r_free]
    sizes = dict(zip(labels, qk.outvars[0].aval.shape))

    def unit_label():
        sizes[f"u{len(sizes)}"] = 1
        return f"u{len(sizes) - 1}"

    masks, inputs = [], []
    for step in reversed(steps):  # from Q·Kᵀ forward: the label of each score dim
        if step[0] == "transpose":
            labels = [labels[p] for p in step[1]]
        elif step[0] == "units":
            labels = [labels[m] if m is not None else unit_label() for m in step[1]]
        elif step[0] == "mask":
            masks.append((step[1], list(labels)))
        else:
            inputs.append((step, list(labels)))
    key = labels[p_map[pc]]  # the softmax axis
    if key.startswith("R") and len(r_free) == 1:
        q, k, qc, kc, qb, kb, q_free = lhs, rhs, lc[0], rc[0], lb, rb, l_free
        q_label = "L"
    elif key.startswith("L") and len(l_free) == 1:
        q, k, qc, kc, qb, kb, q_free = rhs, lhs, rc[0], lc[0], rb, lb, r_free
        q_label = "R"
    else:
        return "the softmax axis is not the only free dim of one side of Q·Kᵀ (the keys)"
    s_dim = next(d for d in range(k.aval.ndim) if d != kc and d not in kb)
    v_var = pv.invars[1 - side]
    v_free = [d for d in range(v_var.aval.ndim) if d not in vc and d not in vb]
    # the labels of P as the P·V product sees it (size-1 dims may be inserted or dropped on the way)
    p_labels = [labels[m] if m is not None else unit_label() for m in p_map]
    if sorted(p_labels[d] for d in pb) != sorted(f"b{i}" for i in range(len(qb))):
        return "the batch dims of P·V are not those of Q·Kᵀ"
    if len(v_free) != 1:
        return f"V has {len(v_free)} free dims (one head dim expected)"
    q_labels = [f"{q_label}{d}" for d in q_free]
    if not q_labels:
        return "Q has no free dim for the query sequence"
    seq_q, seq_k = [q.aval.shape[d] for d in q_free], k.aval.shape[s_dim]
    t_label, mask = _band(masks, q_labels, key, sizes, problems)
    problems.extend(_input_mask_problem(step, labels, masks, q_labels, key, sizes) for step, labels in inputs)
    described = _describe_mask(mask, seq_k) if not inputs else {"kind": "from_inputs", "window": None, "prefix": 0}
    v_batch = {p_labels[pd]: vd for pd, vd in zip(pb, vb)}
    p_free = [p_labels[d] for d in range(len(p_labels)) if d not in pb and d != pc]
    out_labels = [p_labels[d] for d in pb] + ([*p_free, "dv"] if side == 0 else ["dv", *p_free])
    if any(sizes[lab] != 1 for lab in q_labels if lab not in out_labels):
        return "P·V drops a query dim"
    batch = [q.aval.shape[d] for d in qb]
    heads = int(np.prod([q.aval.shape[int(lab[1:])] for lab in q_labels if lab != t_label], dtype=int))
    head_dim, dv = q.aval.shape[qc], v_var.aval.shape[v_free[0]]
    if dv != head_dim:
        problems.append(f"value head dim {dv} differs from query head dim {head_dim}")
    return {
        "q": q,
        "k": k,
        "v": v_var,
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
        "causal": mask is not None and mask.right == 0,
        "mask": described,
        "scale": scale,
        "problems": problems,
        "extra_sizes": {lab: q.aval.shape[int(lab[1:])] for lab in q_labels},
    }


def _band(masks, q_labels, key, sizes, problems) -> tuple[str, Band | None]:
    """(query-sequence label, the :class:`Band` the constant masks keep) on the score axes.

    None (and a reason in ``problems``) when the masks are not a band of diagonals plus a prefix
    of keys. The masks are read a chunk of query rows at a time over the axes they depend on, so
    the reading costs O(T·S) time at any length and never builds a (T, S) array whole.
    """
    if not masks:
        return q_labels[-1], Band()
    candidates = [t for t in reversed(q_labels) if sizes[t] == sizes[key]]
    reason = "the mask is not a function of the query and key positions"
    for t in candidates:
        found = _read_band(masks, t, key, sizes)
        if isinstance(found, Band):
            return t, found
        reason = found
    if _keeps_all(masks, key, sizes):
        return q_labels[-1], Band()
    problems.append(f"mask is not causal, a window, a band or a prefix: {reason}")
    return q_labels[-1], None


def _grid(masks, axes, spans, sizes):
    """The combined keep-mask at the points ``spans`` (one index range per label in ``axes``; other
    labels at 0), laid out in the order of ``axes``."""
    order = sorted(sizes)
    index = {lab: np.zeros((1,) * len(order), int) for lab in order}
    for lab, span in zip(axes, spans):
        index[lab] = span.reshape([-1 if o == lab else 1 for o in order])
    grid = np.broadcast_shapes(*(i.shape for i in index.values()))
    keep = np.ones(grid, bool)
    for c, labels in masks:
        keep &= np.broadcast_to(np.asarray(c.at(tuple(index[lab] for lab in labels)), bool), grid)
    return keep.transpose([order.index(lab) for lab in axes] + [d for d, o in enumerate(order) if o not in axes])


def _swept(masks, sizes):
    return sorted({labels[d] for c, labels in masks for d in c.depends if sizes[labels[d]] > 1})


def _keeps_all(masks, key, sizes) -> bool:
    axes = sorted(set(_swept(masks, sizes)) | {key})
    step = max(1, CHECK_CHUNK // max(math.prod(sizes[lab] for lab in axes[1:]), 1))
    n = sizes[axes[0]]
    spans = lambda start: [np.arange(start, min(start + step, n))] + [np.arange(sizes[lab]) for lab in axes[1:]]  # noqa: E731
    return all(_grid(masks, axes, spans(start), sizes).all() for start in range(0, n, step))


def _read_band(masks, t, key, sizes) -> Band | str:
    """The band the masks keep with ``t`` as the query axis, or why they are none.

    Keep(i, j) must be the same along every other axis; then p is the run of leading key columns
    kept by every query, and every diagonal d = i − j (over keys j ≥ p) must be kept whole or
    dropped whole, the kept ones forming one interval [−right, left]. Keep is then exactly
    (i − left ≤ j ≤ i + right) or (j < p), so the kernel's band reproduces it.
    """
    others = [lab for lab in _swept(masks, sizes) if lab not in (t, key)]
    n_t, n_s = sizes[t], sizes[key]
    rest = n_s * math.prod(sizes[lab] for lab in others)
    step = max(1, CHECK_CHUNK // max(rest, 1))
    columns = np.ones(n_s, bool)  # key j kept by every query
    kept = np.zeros(n_t + n_s - 1)  # per diagonal d = i − j + n_s − 1: kept pairs, all pairs
    total = np.zeros(n_t + n_s - 1)
    cols = np.arange(n_s)
    for start in range(0, n_t, step):
        rows = np.arange(start, min(start + step, n_t))
        spans = [rows, cols] + [np.arange(sizes[lab]) for lab in others]
        keep = _grid(masks, [t, key, *others], spans, sizes).reshape(len(rows), n_s, -1)
        if not np.array_equal(keep.all(-1), keep.any(-1)):
            return f"it varies along {', '.join(others)}"
        keep = keep[..., 0]
        columns &= keep.all(0)
        diagonal = (rows[:, None] - cols[None, :] + n_s - 1).ravel()
        kept += np.bincount(diagonal, weights=keep.ravel(), minlength=len(kept))
        total += np.bincount(diagonal, minlength=len(total))
    prefix = int(np.argmin(columns)) if not columns.all() else n_s
    if prefix == n_s:
        return Band()
    # the prefix columns' pairs lie on diagonals −j … n_t − 1 − j: take them out of the counts
    shift = np.zeros(len(kept) + 1)
    np.add.at(shift, n_s - 1 - np.arange(prefix), 1)
    np.add.at(shift, n_s - 1 - np.arange(prefix) + n_t, -1)
    in_prefix = np.cumsum(shift)[:-1]
    kept, total = kept - in_prefix, total - in_prefix
    whole, none = (total > 0) & (kept == total), (total > 0) & (kept == 0)
    if np.any((total > 0) & ~whole & ~none):
        return "some diagonal i − j is kept in part (not a function of i − j)"
    d = np.arange(len(kept)) - (n_s - 1)
    if not whole.any():
        return "it keeps only a prefix of keys" if prefix else "it keeps no key"
    lo, hi = int(d[whole].min()), int(d[whole].max())
    if np.any(none & (d > lo) & (d < hi)):
        return "the kept diagonals i − j are not one interval"
    if lo > 0 or hi < 0:
        return "it removes the diagonal (a query would not see its own key)"
    left = None if not np.any(none & (d > hi)) else hi
    right = None if not np.any(none & (d < lo)) else -lo
    if left is None and (right is None or right >= prefix - 1):
        prefix = 0  # the band already keeps every prefix key
    return Band(left=left, right=right, prefix=prefix)


def _describe_mask(mask: Band | None, seq_k: int) -> dict:
    """The mask as ``kind`` (full, causal, sliding_window, band, prefix_lm; unsupported when it is none
    of these), ``window`` and ``prefix``, ``window`` given as :func:`conductor.kernels.attention` takes it."""
    if mask is None:
        return {"kind": "unsupported", "window": None, "prefix": 0}
    if not mask.masked:
        return {"kind": "full", "window": None, "prefix": 0}
    left, right, prefix = mask.left, mask.right, mask.prefix
    if left is None:
        if right == 0:
            return {"kind": "prefix_lm" if prefix else "causal", "window": None, "prefix": prefix}
        return {"kind": "band", "window": (seq_k - 1, right), "prefix": prefix}
    if right == 0:
        return {"kind": "sliding_window", "window": left + 1, "prefix": prefix}
    right = seq_k - 1 if right is None else right
    window = left + 1 if left == right else (left, right)
    return {"kind": "band", "window": window, "prefix": prefix}


def _input_mask_problem(step, labels, masks, q_labels, key, sizes) -> str:
    """Why a mask computed from inputs is not rewritten: positions passed in, a whole mask passed in, or data.

    The question asked is what the mask would be if the inputs it reads along the sequence were
    positions 0, 1, …: a band means a position-only mask whose positions the step takes as an input.
    Such a mask is not rewritten, because nothing proves the input holds 0, 1, … and the kernels
    derive every mask from the block indices.
    """
    kind, g, var, fn, shape = step
    n = sizes[key]
    probe = g.assuming(
        {
            v: Const(
                tuple(v.aval.shape), lambda index, d=v.aval.ndim - 1: np.asarray(index[d]), frozenset({v.aval.ndim - 1})
            )
            for v in g.inputs_of(var)
            if v.aval.ndim and v.aval.shape[-1] == n and not np.issubdtype(v.aval.dtype, np.bool_)
        }
    )
    value = probe.const(var)
    band = None
    if value is not None:
        if kind == "input mask":
            keep = value.map(fn).fit(shape)
        else:
            bias = (value.map(fn) if fn else value).fit(shape)
            keep = bias.map(lambda x: x > _MASKED) if _removes_or_keeps(bias) else None
        if keep is not None:
            band = _band([*masks, (keep, labels)], q_labels, key, sizes, [])[1]
    if band is not None and band.masked and not (band.left == band.right == 0):
        described = _describe_mask(band, n)
        what = described["kind"].replace("_", " ") + (f" (window {described['window']})" if described["window"] else "")
        return (
            f"mask computed from inputs: a {what} over positions passed in as an input of the step, "
            "not provably 0, 1, …; compute the positions in the step (jnp.arange) to have it rewritten"
        )
    what = "mask" if kind == "input mask" else "bias"
    if any(v.aval.ndim >= 2 and tuple(v.aval.shape[-2:]) == (n, n) for v in g.inputs_of(var)):
        return (
            f"{what} computed from inputs: a whole (T, S) {what} passed in (to the step, or to the scan body "
            "it sits in) is not read; build it in the same body from positions (jnp.arange, jnp.tril)"
        )
    if kind == "input bias":
        return "bias computed from inputs: a learned or data-dependent bias, which no kernel here takes"
    return "mask computed from inputs: it depends on the data (e.g. a padding mask), which no kernel here takes"
