"""Kind and cost of one ATen op, by XLA's ``HloCostAnalysis`` rules (as ``integrations.flax._primitives``).

Capture decomposes a step to core ATen ops (LayerNorm, GELU and softmax
included), so these rules see the same arithmetic the jaxpr rules see:

* ``mm``/``bmm``: 2 · |out| · K (one FMA = 2 FLOPs); ``addmm``/``baddbmm`` add |out| for the bias
* elementwise arithmetic, compares, ``where`` and dtype conversions: |out|;
  exp, log, tanh, rsqrt, sqrt, sigmoid, erf, non-integer ``pow``: transcendentals, not FLOPs
* ``pow`` by an integer y: ⌊log₂|y|⌋ + popcount(|y|) − 1 multiplies per element
* reductions: |in| − |out| (``mean`` adds |out| divides; ``var_mean`` is 4·|in|:
  two sums, a difference and a square per element)
* ``index_put(accumulate=True)``, ``scatter_add``, ``index_add``: one add per update element
* ``cumsum``, ``cumprod``: one add (multiply) per element, as a sequential scan
* views, copies, gathers, scatters into slices, concatenation, constants and allocations
  (``empty_permuted``, ``new_zeros``, random fills): 0
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from orchestrator.graph import OpKind

MATMUL = frozenset({"aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm"})
ELEMENTWISE = frozenset(
    """add sub mul div neg where ne eq lt le gt ge logical_and logical_or logical_not logical_xor
    maximum minimum clamp clamp_min clamp_max abs sign reciprocal masked_fill remainder fmod
    bitwise_and bitwise_or bitwise_not floor ceil round trunc lerp addcmul addcdiv square""".split()
)
TRANSCENDENTAL = frozenset("exp exp2 log log1p log2 expm1 tanh rsqrt sqrt sigmoid erf erfc sin cos tan atan2".split())
REDUCTION = frozenset("sum amax amin prod max min argmax argmin any all".split())
FREE = frozenset(
    """view _unsafe_view reshape permute transpose t squeeze unsqueeze expand clone alias slice select
    cat stack split split_with_sizes unbind index gather embedding arange full full_like zeros zeros_like
    ones ones_like empty empty_like empty_strided empty_permuted new_empty new_empty_strided new_zeros new_ones
    new_full scalar_tensor scatter slice_scatter select_scatter copy as_strided detach lift_fresh_copy
    constant_pad_nd flip roll repeat diagonal tril triu iota rand randn rand_like randn_like randint
    bernoulli""".split()
)
SCAN = frozenset({"cumsum", "cumprod"})
SCATTER_ADD = frozenset({"index_put", "scatter_add", "index_add"})
LOOKUPS = frozenset({"aten.index", "aten.embedding", "aten.gather"})  # XLA lowers each to a gather
SKIP = frozenset({"aten._assert_tensor_metadata", "aten._assert_scalar", "aten.sym_constrain_range_for_size"})


def _size(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _integer_pow_multiplies(y: int) -> int:
    magnitude = abs(y)
    if magnitude == 0:
        return 0
    return magnitude.bit_length() - 1 + bin(magnitude).count("1") - 1 + (1 if y < 0 else 0)


def cost(
    name: str, args: Sequence, in_shapes: Sequence[tuple[int, ...]], out_shapes: Sequence[tuple[int, ...]]
) -> tuple[OpKind, float, float] | None:
    """``(kind, flops, transcendentals)`` of one ATen op, or None if no rule knows it.

    Args:
      name: the op's overload packet, e.g. ``"aten.addmm"``.
      args: its positional arguments (tensors as shapes are not needed; scalars are read).
      in_shapes: shapes of its tensor inputs, in argument order.
      out_shapes: shapes of its tensor outputs.
    """
    out = sum(_size(s) for s in out_shapes)
    short = name.removeprefix("aten.").removesuffix("_")
    if name in MATMUL:
        contracted = in_shapes[-1][-2] if name in ("aten.addmm", "aten.baddbmm") else in_shapes[0][-1]
        bias = out if name in ("aten.addmm", "aten.baddbmm") else 0
        return "matmul", 2.0 * out * contracted + bias, 0.0
    if short == "pow":
        exponent = args[1] if len(args) > 1 else None
        if isinstance(exponent, (int, float)) and float(exponent).is_integer():
            return "elementwise", float(out * _integer_pow_multiplies(int(exponent))), 0.0
        if exponent == 0.5:
            return "elementwise", 0.0, float(out)
        return "elementwise", 0.0, float(out)
    if short in TRANSCENDENTAL:
        return "elementwise", 0.0, float(out)
    if short == "_to_copy":
        return "elementwise", float(out), 0.0  # a dtype conversion (XLA's convert)
    if short in ELEMENTWISE:
        return "elementwise", float(out), 0.0
    if short == "mean":
        return "reduction", float(_size(in_shapes[0]) - out + out), 0.0
    if short == "var_mean":
        return "reduction", 4.0 * _size(in_shapes[0]), 0.0
    if short in REDUCTION:
        return "reduction", float(_size(in_shapes[0]) - _size(out_shapes[0])), 0.0
    if short in SCAN:
        return "elementwise", float(out), 0.0
    if short in SCATTER_ADD:
        accumulate = short != "index_put" or (len(args) > 3 and bool(args[3]))
        return "data_movement", float(_size(in_shapes[-1])) if accumulate else 0.0, 0.0
    if short in FREE:
        return "data_movement", 0.0, 0.0
    return None


def conservative_cost(in_shapes: Sequence, out_shapes: Sequence) -> tuple[OpKind, float, float]:
    """One FLOP per element read and written: errs towards giving an unknown op more time."""
    return "other", float(sum(_size(s) for s in in_shapes) + sum(_size(s) for s in out_shapes)), 0.0
