"""What every conductor kernel shares: the implementation switch and interpret-on-CPU."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

Implementation = Literal["pallas", "xla_chunked", "reference"]
IMPLEMENTATIONS: tuple[Implementation, ...] = ("pallas", "xla_chunked", "reference")

# Shared memory of one GPU streaming multiprocessor, where a Pallas kernel lowered through Triton
# keeps its tiles: 164 KiB on an A100, the smallest of the GPUs the kernels target (an H100 has 228 KiB).
GPU_SHARED_MEMORY_BYTES = 164 << 10


def check_implementation(implementation: str) -> Implementation:
    """``implementation`` itself, or a ``ValueError`` naming the allowed values."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; choose one of {', '.join(IMPLEMENTATIONS)}")
    return implementation  # type: ignore[return-value]


def on_gpu(platform: str | None) -> bool:
    """Whether ``platform`` (default: the local backend) is a GPU."""
    return (platform or jax.default_backend()) in ("gpu", "cuda", "rocm")


def interpret_default(interpret: bool | None) -> bool:
    """Pallas runs compiled on TPU/GPU; on CPU only the interpreter can run it."""
    if interpret is not None:
        return interpret
    return jax.default_backend() == "cpu"


def divisible_block(size: int, target: int) -> int:
    """The largest power-of-two block ≤ ``target`` that divides ``size`` (``size`` itself if it is smaller)."""
    if size <= target:
        return size
    block = 1 << (target.bit_length() - 1)
    while block > 1 and size % block:
        block //= 2
    return block


def compiler_params(platform: str | None):
    """Pallas compiler parameters for ``platform`` (default: the local backend).

    On GPUs, Triton: jax 0.10 otherwise picks Mosaic GPU, which lowers no ``dot_general``
    in ``pallas_call`` kernels. Elsewhere none (a TPU lowering refuses GPU parameters).
    """
    if not on_gpu(platform):
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=4, num_stages=2)


def full_varying(shape, value: float, *like):
    """fp32 ``value`` of ``shape``, varying over the mesh axes ``like`` varies over.

    Inside ``shard_map`` a loop carry must keep its type, and a constant varies over no axis
    while a carry computed from the inputs varies over theirs. Outside ``shard_map`` it is the
    constant (XLA folds the added zeros).
    """
    out = jnp.full(shape, value, jnp.float32)
    for x in like:
        out = out + jnp.zeros_like(x[(0,) * x.ndim], jnp.float32)
    return out
