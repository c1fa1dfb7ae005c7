"""Find linear recurrences in ``lax.scan``: a carry updated as h = a ⊙ h + b.

A scan carry h whose new value is ``add(mul(a_t, h), b_t)`` (either operand
order) with a_t, b_t read from the scanned inputs is a linear recurrence; it
has an associative parallel form ((a₁, b₁)∘(a₂, b₂) = (a₁a₂, a₂b₁ + b₂)).
It is Mamba's selective scan when, outside the scan,

    a = exp(Δ[b,t,d] · A[d,n]),  b = v[b,t,d] · B[b,t,n]   (broadcasts of smaller tensors)

both fed time-major through a transpose, h starts at zero, and the scan emits
y_t = Σ_n h_t[·,·,n] C_t[·,n]. Then the whole region — the (B, T, D, N)
tensors included — becomes one fused scan of (Δ, A, v, B, C).
"""

from __future__ import annotations

from conductor.match._graph import Graph


def match_recurrence(g: Graph, index: int) -> dict | None:
    """The linear recurrence carried by scan equation ``index``, as a description dict, or None."""
    scan = g.jaxpr.eqns[index]
    body = scan.params["jaxpr"].jaxpr
    n_consts, n_carry = scan.params["num_consts"], scan.params["num_carry"]
    bg = Graph(body)
    for i in range(n_carry):
        h = body.invars[n_consts + i]
        add = bg.eqn(body.outvars[i])
        if add is None or add.primitive.name != "add":
            continue
        for j in (0, 1):
            mul = bg.eqn(add.invars[j])
            if mul is None or mul.primitive.name != "mul" or h not in mul.invars:
                continue
            a_t = mul.invars[1 - mul.invars.index(h)]
            b_t = add.invars[1 - j]
            xs = body.invars[n_consts + n_carry :]
            if a_t in xs and b_t in xs:
                found = {
                    "carry": i,
                    "a_xs": n_consts + n_carry + xs.index(a_t),
                    "b_xs": n_consts + n_carry + xs.index(b_t),
                    "state_shape": tuple(h.aval.shape),
                    "length": scan.params["length"],
                    "problems": [],
                }
                found["selective"] = _selective(g, bg, scan, found)
                found["parallel_ok"] = n_carry == 1 and not scan.params["reverse"]
                if not found["parallel_ok"]:
                    found["problems"].append("parallel form needs one forward carry")
                return found
    return None


def _selective(g: Graph, bg: Graph, scan, rec) -> dict | None:
    """Mamba's (Δ, A, v, B, C) feeding ``scan``, or None (with the reason in ``rec['problems']``)."""
    body = scan.params["jaxpr"].jaxpr
    n_consts, n_carry = scan.params["num_consts"], scan.params["num_carry"]
    problems = rec["problems"]
    if n_carry != 1 or scan.params["reverse"] or len(rec["state_shape"]) != 3:
        problems.append("not a single forward (batch, d, n) carry")
        return None
    if g.scalar(scan.invars[n_consts]) != 0:
        problems.append("initial state is not zero")
        return None
    if len(body.outvars) != 2:
        problems.append("the scan must emit exactly one output per step")
        return None
    y = bg.eqn(body.outvars[1])
    h_new = body.outvars[0]
    if y is None or y.primitive.name != "dot_general" or y.invars[0] is not h_new:
        problems.append("per-step output is not h·C")
        return None
    if y.params["dimension_numbers"] != (((2,), (1,)), ((0,), (0,))):
        problems.append("per-step output is not Σ_n h[b,d,n] C[b,n]")
        return None
    c_t = y.invars[1]
    xs = body.invars[n_consts + n_carry :]
    if c_t not in xs:
        problems.append("C is not a scanned input")
        return None
    outer = scan.invars
    a_full = _time_major_source(g, outer[rec["a_xs"]], 4)
    b_full = _time_major_source(g, outer[rec["b_xs"]], 4)
    c = _time_major_source(g, outer[n_consts + n_carry + xs.index(c_t)], 3)
    if a_full is None or b_full is None or c is None:
        problems.append("scanned inputs are not batch-major tensors transposed to time-major")
        return None
    exp = g.eqn(a_full)
    if exp is None or exp.primitive.name != "exp":
        problems.append("a is not exp(Δ·A)")
        return None
    dt_a = _outer_product(g, exp.invars[0], ((0, 1, 2), (2, 3)))
    v_b = _outer_product(g, b_full, ((0, 1, 2), (0, 1, 3)))
    if dt_a is None or v_b is None:
        problems.append("a or b is not a broadcast product of (B,T,D) with (D,N) / (B,T,N)")
        return None
    return {"dt": dt_a[0], "a": dt_a[1], "v": v_b[0], "b": v_b[1], "c": c, "ys": scan.outvars[n_carry]}


def _time_major_source(g: Graph, v, ndim):
    e = g.eqn(v)
    if e is None or e.primitive.name != "transpose":
        return None
    perm = e.params["permutation"]
    return e.invars[0] if tuple(perm) == (1, 0, *range(2, ndim)) else None


def _outer_product(g: Graph, v, dims):
    """(x, y) if ``v`` = broadcast(x) · broadcast(y) with x's dims at dims[0] and y's at dims[1]."""
    e = g.eqn(v)
    if e is None or e.primitive.name != "mul":
        return None
    roots = [g.broadcast_root(x) for x in e.invars]
    for order in ((0, 1), (1, 0)):
        (x, xd, _), (y, yd, _) = roots[order[0]], roots[order[1]]
        if xd == dims[0] and yd == dims[1]:
            return x, y
    return None
