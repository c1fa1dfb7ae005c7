"""The order in which each pipeline stage runs its (microbatch, phase) steps.

GPipe (Huang et al. 2019, as ``torch.distributed.pipelining.ScheduleGPipe``
runs it): every stage runs all M forwards, then all M backwards, both in
microbatch order; a stage holds M microbatches' activations at its peak.

1F1B (PipeDream-Flush, Narayanan et al. 2021; Megatron-LM's non-interleaved
schedule): stage s of S first runs ``w = min(S − s − 1, M)`` warm-up
forwards, then alternates one forward and one backward until its forwards
are done, then runs the remaining backwards. Its activations in flight peak
at ``min(M, S − s)``.

With equal stage times f + b and free transfers both take
``(M + S − 1) · (f + b)`` and idle a fraction ``(S − 1) / (M + S − 1)`` of
it; 1F1B only lowers memory.

Interleaved 1F1B (Narayanan et al. 2021, §2.2.2; Megatron-LM's
``--num-layers-per-virtual-pipeline-stage``): each stage runs v model chunks,
chunk c of stage s being virtual stage c·S + s of a pipeline of v·S, so a
microbatch passes every stage v times (from the last stage back to the first
between chunks). Stage s counts its v·M (chunk, microbatch) steps in groups of
S microbatches: forward step k is chunk ``(k // S) mod v`` of microbatch
``(k // (v·S))·S + k mod S``, backward step k the same microbatch of chunk
``v − 1 − (k // S) mod v``. It runs ``w = min(2·(S − s − 1) + (v − 1)·S, v·M)``
warm-up forwards, then alternates one forward and one backward, then runs the
remaining backwards — Megatron-LM's order, which needs M divisible by S. With
equal stages and free transfers it takes ``M·(f + b) + (S − 1)·(f + b)/v``:
the bubble shrinks v-fold, at v times the point-to-point transfers.
"""

from __future__ import annotations

from typing import Literal

Phase = Literal["forward", "backward"]
Step = tuple[Phase, int]  # (phase, microbatch)
ChunkStep = tuple[Phase, int, int]  # (phase, microbatch, chunk)


def stage_order(schedule: str, stages: int, microbatches: int, stage: int) -> list[Step]:
    """The (phase, microbatch) steps of ``stage`` in the order it runs them.

    Args:
      schedule: "gpipe" or "1f1b".
      stages: S, pipeline stages.
      microbatches: M, microbatches per step.
      stage: s in 0..S−1.

    Returns:
      2·M steps, each microbatch's forward before its backward.

    Raises:
      ValueError: an unknown schedule or a stage outside 0..S−1.

    Example:
      >>> stage_order("1f1b", 2, 3, 0)
      [('forward', 0), ('forward', 1), ('backward', 0), ('forward', 2), ('backward', 1), ('backward', 2)]
    """
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is outside 0..{stages - 1}")
    M = microbatches
    if schedule == "gpipe":
        return [("forward", i) for i in range(M)] + [("backward", i) for i in range(M)]
    if schedule == "1f1b":
        warmup = min(stages - stage - 1, M)
        steps: list[Step] = [("forward", i) for i in range(warmup)]
        for i in range(M - warmup):
            steps += [("forward", warmup + i), ("backward", i)]
        steps += [("backward", i) for i in range(M - warmup, M)]
        return steps
    raise ValueError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r} (interleaved 1F1B needs virtual stages)")


def interleaved_warmup(stages: int, microbatches: int, stage: int, virtual_stages: int) -> int:
    """w: the forwards stage ``stage`` runs before its first backward step under interleaved 1F1B,
    less one (Megatron-LM's ``num_warmup_microbatches``)."""
    return min(2 * (stages - stage - 1) + (virtual_stages - 1) * stages, virtual_stages * microbatches)


def chunk_order(schedule: str, stages: int, microbatches: int, stage: int, virtual_stages: int = 1) -> list[ChunkStep]:
    """The (phase, microbatch, chunk) steps of ``stage`` in the order it runs them.

    Args:
      schedule: "gpipe" or "1f1b".
      stages: S, pipeline stages.
      microbatches: M, microbatches per step.
      stage: s in 0..S−1.
      virtual_stages: v, model chunks per stage (interleaved 1F1B when > 1).

    Returns:
      2·v·M steps; with v = 1, :func:`stage_order` with chunk 0.

    Raises:
      ValueError: as :func:`stage_order`; v > 1 with GPipe, with one stage, or with M not
        divisible by S.

    Example:
      >>> chunk_order("1f1b", 2, 2, 1, virtual_stages=2)[:4]
      [('forward', 0, 0), ('forward', 1, 0), ('forward', 0, 1), ('backward', 0, 1)]
    """
    v, S, M = virtual_stages, stages, microbatches
    if v == 1:
        return [(phase, i, 0) for phase, i in stage_order(schedule, S, M, stage)]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"virtual_stages must be a whole number >= 1, got {v!r}")
    if schedule != "1f1b":
        raise ValueError(f"virtual stages need the 1f1b schedule, got {schedule!r}")
    if S < 2 or M % S:
        raise ValueError(
            f"interleaved 1F1B needs at least 2 stages and microbatches divisible by them, got S {S}, M {M}"
        )
    if not 0 <= stage < S:
        raise ValueError(f"stage {stage} is outside 0..{S - 1}")

    def step(phase: Phase, k: int) -> ChunkStep:
        group = (k // S) % v
        return (phase, (k // (v * S)) * S + k % S, group if phase == "forward" else v - 1 - group)

    total = v * M
    warmup = interleaved_warmup(S, M, stage, v)
    steps = [step("forward", k) for k in range(warmup)]
    for k in range(total - warmup):
        steps += [step("forward", warmup + k), step("backward", k)]
    steps += [step("backward", k) for k in range(total - warmup, total)]
    return steps


def peak_in_flight(steps: list[Step] | list[ChunkStep]) -> int:
    """The most (chunk, microbatch) pairs whose forward has run and whose backward has not, over ``steps``."""
    live = peak = 0
    for phase, *_ in steps:
        live += 1 if phase == "forward" else -1
        peak = max(peak, live)
    return peak
