"""Kind and cost of one jaxpr primitive, by XLA's ``HloCostAnalysis`` rules.

Each rule sees the equation's abstract inputs and outputs and returns
``(kind, flops, transcendentals)`` for ONE execution. The rules mirror how XLA
counts the HLO that jax lowers the primitive to, so that a captured total can
be checked against ``compiled.cost_analysis()["flops"]``:

* ``dot_general``: 2 · |out| · Π(contracting dims)   (one FMA = 2 FLOPs); with no
  contracting dims (an outer product) XLA rewrites it to a multiply: |out|
* ``conv_general_dilated``: 2 · |out| · Π(kernel spatial) · C_in / groups
* elementwise: |out|, except transcendentals (exp, log, tanh, logistic, sqrt,
  rsqrt, pow, sin, cos, erf, ...) which XLA counts apart as transcendentals
* ``integer_pow(y)``: lowered to repeated multiplication, ⌊log₂|y|⌋ + popcount(|y|) − 1
  multiplies per element (one more, a divide, for y < 0)
* reductions: |in| − |out|   (one add/max/... per element folded in)
* data movement (reshape, transpose, broadcast, slice, gather, pad, ...): 0,
  except scatter-add, which XLA counts at one FLOP per update element, and a
  gather in ``FILL_OR_DROP`` mode (``jnp.take``'s default, which
  ``flax.linen.Embed`` uses), which XLA lowers to the gather, a bounds check per index
  (two compares and an and: 3 FLOPs) and a select per gathered element;
* an add of a scatter-add into zeros (a sparse gradient, e.g. an embedding
  lookup's) to a dense value: 0 — XLA scatters the updates into the dense
  value instead, and the scatter-add already counts them (capture applies
  this rule, as it needs to know where the operands came from).

Where XLA's count differs, it is because XLA changes the program: it drops
dead code (capture drops it too), and it duplicates a cheap elementwise op
into every fusion that reads it, counting it once per copy. In a scan body of
only elementwise ops that duplication made XLA's count 1.67× ours (640 vs 384
FLOPs per iteration); in the recipes' train steps it is below 0.1%.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from orchestrator.graph import OpKind

ELEMENTWISE = frozenset(
    """add sub mul div rem max min neg sign floor ceil round is_finite abs select_n clamp
    convert_element_type eq ne lt le gt ge and or not xor shift_left shift_right_logical
    shift_right_arithmetic add_any square nextafter copysign real imag conj complex
    population_count clz reduce_precision erf_inv lgamma digamma igamma random_gamma_grad
    bessel_i0e bessel_i1e""".split()
)
TRANSCENDENTAL = frozenset(
    """exp exp2 log log1p expm1 tanh logistic sin cos tan atan2 asin acos atan sinh cosh
    asinh acosh atanh sqrt rsqrt cbrt erf erfc pow""".split()
)
REDUCTION = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin".split()
)
CUMULATIVE = frozenset("cumsum cumprod cummax cummin cumlogsumexp".split())
DATA_MOVEMENT = frozenset(
    """reshape transpose broadcast_in_dim squeeze expand_dims slice dynamic_slice
    dynamic_update_slice concatenate pad gather rev copy copy_p device_put iota split
    sharding_constraint stop_gradient select_and_gather_add scatter optimization_barrier
    mesh_cast reshard stack unstack""".split()
)
SCATTER_COMBINE = frozenset("scatter-add scatter_add scatter_mul scatter_min scatter_max".split())
COLLECTIVE = frozenset(
    """psum pmax pmin ppermute all_gather all_to_all reduce_scatter psum_scatter
    axis_index pbroadcast psum_invariant all_gather_invariant""".split()
)
OTHER_FREE = frozenset(
    # Pallas kernel bodies: ref loads and stores, grid queries
    "get swap addupdate load masked_load masked_swap program_id num_programs multiple_of "
    "random_bits random_seed random_wrap random_unwrap random_fold_in random_split threefry2x32 rng_bit_generator sort".split()
)

# Reducers that XLA implements with more than one HLO op per folded element:
# argmax/argmin use a variadic reduce comparing values and then indices.
_REDUCER_FLOPS = {"argmax": 4, "argmin": 4}


def _size(aval) -> int:
    return math.prod(aval.shape) if hasattr(aval, "shape") else 1


def _integer_pow_multiplies(y: int) -> int:
    magnitude = abs(int(y))
    if magnitude == 0:
        return 0
    count = magnitude.bit_length() - 1 + bin(magnitude).count("1") - 1
    return count + (1 if y < 0 else 0)


def cost(primitive: str, params: dict, in_avals: Sequence, out_avals: Sequence) -> tuple[OpKind, float, float] | None:
    """``(kind, flops, transcendentals)`` of one execution, or None if unknown."""
    out_size = sum(_size(a) for a in out_avals)
    if primitive == "dot_general":
        (lhs_contract, _), _ = params["dimension_numbers"]
        if not lhs_contract:  # an outer product: XLA rewrites it to a multiply
            return "elementwise", float(out_size), 0.0
        contracted = math.prod(in_avals[0].shape[d] for d in lhs_contract)
        return "matmul", 2.0 * out_size * contracted, 0.0
    if primitive == "conv_general_dilated":
        rhs = in_avals[1]
        spec = params["dimension_numbers"]
        out_feature_dim, in_feature_dim = spec.rhs_spec[0], spec.rhs_spec[1]
        kernel_per_output = math.prod(d for i, d in enumerate(rhs.shape) if i != out_feature_dim)
        del in_feature_dim  # the kernel's input-feature dim is already C_in / groups
        return "conv", 2.0 * out_size * kernel_per_output, 0.0
    if primitive in TRANSCENDENTAL:
        return "elementwise", 0.0, float(out_size)
    if primitive == "integer_pow":
        return "elementwise", float(out_size * _integer_pow_multiplies(params["y"])), 0.0
    if primitive in ELEMENTWISE:
        return "elementwise", float(out_size), 0.0
    if primitive in REDUCTION:
        folded = _size(in_avals[0]) - _size(out_avals[0])
        return "reduction", float(folded * _REDUCER_FLOPS.get(primitive, 1)), 0.0
    if primitive in CUMULATIVE:
        return "scan", float(_size(in_avals[0])), 0.0
    if primitive in SCATTER_COMBINE:
        return "data_movement", float(_size(in_avals[2])), 0.0
    if primitive == "gather" and "FILL_OR_DROP" in str(params.get("mode", "")):
        index_vectors = math.prod(in_avals[1].shape[:-1])
        return "data_movement", float(out_size + 3 * index_vectors), 0.0
    if primitive in DATA_MOVEMENT:
        return "data_movement", 0.0, 0.0
    if primitive in COLLECTIVE:
        return "collective", 0.0, 0.0
    if primitive in OTHER_FREE:
        return "other", 0.0, 0.0
    return None


def conservative_cost(in_avals: Sequence, out_avals: Sequence) -> tuple[OpKind, float, float]:
    """Cost of a primitive we have no rule for: one FLOP per element read and written.

    An over-estimate for data movement and most elementwise work, so a plan
    built on it errs towards giving the op more time, not less.
    """
    touched = sum(_size(a) for a in in_avals) + sum(_size(a) for a in out_avals)
    return "other", float(touched), 0.0
