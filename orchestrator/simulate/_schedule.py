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
"""

from __future__ import annotations

from typing import Literal

Phase = Literal["forward", "backward"]
Step = tuple[Phase, int]  # (phase, microbatch)


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


def peak_in_flight(steps: list[Step]) -> int:
    """The most microbatches whose forward has run and whose backward has not, over ``steps``."""
    live = peak = 0
    for phase, _ in steps:
        live += 1 if phase == "forward" else -1
        peak = max(peak, live)
    return peak
