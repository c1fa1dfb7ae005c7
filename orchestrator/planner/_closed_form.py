"""The step time of a pipeline plan in closed form: the critical paths of the schedule.

Per stage s = 0..S−1 (pipeline order) and microbatch: forward f_s, backward b_s (with
recompute and tensor-parallel all-reduces), c_s = f_s + b_s; P_s one point-to-point
transfer from s to s + 1 (P_{S−1} = 0); gradient sync y_s and optimizer o_s once per step.
Transfers run beside compute (asynchronous sends) on their own link; M microbatches.

Upstream of s, the first forward arrives after U^f_s = Σ_{s'<s} (f_s' + P_s'), and the
last backward leaving s reaches the front after U^b_s = Σ_{s'<s} (b_s' + P_s').

**1F1B** (stage s keeps K_s = S − s microbatches in flight; it runs min(M, K_s) forwards
before its first backward, then alternates). Its first backward starts at

    B_s ≥ U^f_s + L_s − b_s              (the first microbatch's round trip)
    B_s ≥ U^f_s + min(M, K_s)·f_s        (its own warm-up forwards)

with the round trip L_s = Σ_{s'≥s} c_s' + 2·Σ_{s≤s'<S−1} P_s'. Its forward of microbatch
i + K_s waits for backward i, so backward i + K_s starts ≥ L_s after backward i; and
backward i + 1 starts ≥ c_s after backward i (one forward and one backward in between).
With M − 1 = q_s·K_s + r_s, its last backward ends at

    E_s ≥ B_s + q_s·L_s + r_s·(c_s if q_s ≥ 1 else b_s) + b_s     (the in-flight cycle)
    E_s ≥ B_s + M·b_s + (M − min(M, K_s))·f_s                      (all its own work)
    E_s ≥ U^f_s + c_s + 2M·P_s                                     (its outgoing link)

**GPipe** (all forwards, then all backwards): two flow shops of identical jobs, whose
makespan is exact: forwards end at F = Σ_s (f_s + P_s) + (M − 1)·max_s max(f_s, P_s), and

    E_s ≥ F + Σ_{s'≥s} b_s' + Σ_{s≤s'<S−1} P_s' + (M − 1)·max_{s'≥s} max(b_s', P_s'·[s' < S−1]).

**Pipeline and tail.** The pipeline drains at W = max_s (E_s + U^b_s); the first stage's
last backward is the drain (E_0 = W). A stage's gradient sync runs per layer bucket: its
last backward visits the layers i = 1..n in reverse order, taking b_i each, and bucket i's
all-reduce (y_i) may start once that share is done and the previous bucket's all-reduce has
finished (one ring). That is a two-machine flow shop in a fixed order, whose makespan is

    Y_s = E_s − b_s + max_k ( Σ_{i≤k} b_i + Σ_{i≥k} y_i )       (i, k in backward order)

(Σ_i b_i = b_s, Σ_i y_i = y_s); its optimizer follows. The step:

    step = max( W,  max_s Y_s + o_s )

Each row is a lower bound on the schedule it describes (one per critical path); their max
is the estimate. Equal one-layer stages without transfers give the textbook
(S + M − 1)·c + y + o.
``StageModel`` (``_ilp``) writes the same rows with variables for B, E, W and the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepTime:
    """The closed form of one plan; ``breakdown`` sums to ``step_s``.

    Attributes:
      step_s: the predicted step time.
      pipeline_s: W, when the last backward of the first stage ends.
      backward_start_s, backward_end_s: B_s (1F1B only; GPipe: 0) and E_s per stage.
      forward_end_s: GPipe's F (1F1B: 0).
      breakdown: ``fill_drain_s`` (one microbatch through every stage and link),
        ``steady_s`` (the rest of the pipeline), ``gradient_sync_s`` (sync not hidden
        behind the backward pass), ``optimizer_s``.
    """

    step_s: float
    pipeline_s: float
    backward_start_s: tuple[float, ...]
    backward_end_s: tuple[float, ...]
    forward_end_s: float
    breakdown: dict


def in_flight_cycle(microbatches: int, in_flight: int) -> tuple[int, int]:
    """(q, r) with M − 1 = q·K + r."""
    return divmod(microbatches - 1, in_flight)


def sync_end(backward_end: float, backward: Sequence[float], sync: Sequence[float]) -> float:
    """Y: when a stage's last gradient bucket is synchronised, for per-layer backward and sync
    times in layer (chain) order; the backward pass visits them last layer first."""
    ready = backward_end - sum(backward)
    done = ready
    for b, y in zip(reversed(backward), reversed(sync)):
        ready += b
        done = max(done, ready) + y
    return max(done, backward_end)


def step_time(
    forward: Sequence[float],
    backward: Sequence[Sequence[float]],
    send: Sequence[float],
    sync: Sequence[Sequence[float]],
    optimizer: Sequence[float],
    microbatches: int,
    schedule: str,
) -> StepTime:
    """The closed form above for stages in pipeline order (``send[-1]`` is ignored).
    ``backward`` and ``sync`` hold each stage's per-layer times, in layer order."""
    S, M = len(forward), microbatches
    f, b = list(forward), [sum(layers) for layers in backward]
    P = [*send[: S - 1], 0.0]
    c = [fs + bs for fs, bs in zip(f, b)]
    up_f = [sum(f[:s]) + sum(P[:s]) for s in range(S)]
    up_b = [sum(b[:s]) + sum(P[:s]) for s in range(S)]
    starts, ends, forward_end = [0.0] * S, [0.0] * S, 0.0
    if schedule == "gpipe":
        forward_end = sum(f) + sum(P) + (M - 1) * max(max(f), max(P))
        for s in range(S):
            down = range(s, S)
            slowest = max(max(b[k] for k in down), max(P[k] for k in down))
            ends[s] = forward_end + sum(b[k] + P[k] for k in down) + (M - 1) * slowest
    else:
        for s in range(S):
            K = S - s
            q, r = in_flight_cycle(M, K)
            warm = min(M, K)
            loop = sum(c[s:]) + 2 * sum(P[s:])
            starts[s] = max(up_f[s] + loop - b[s], up_f[s] + warm * f[s])
            ends[s] = max(
                starts[s] + q * loop + r * (c[s] if q >= 1 else b[s]) + b[s],
                starts[s] + M * b[s] + (M - warm) * f[s],
                up_f[s] + c[s] + 2 * M * P[s],
            )
    pipeline = max(ends[s] + up_b[s] for s in range(S))
    ends[0] = max(ends[0], pipeline)
    tails = [sync_end(ends[s], backward[s], sync[s]) + optimizer[s] for s in range(S)]
    step = max(pipeline, *tails)
    fill = sum(c) + 2 * sum(P)
    last = max(range(S), key=lambda s: tails[s])
    optimizer_s = min(step - pipeline, optimizer[last])
    breakdown = {
        "fill_drain_s": fill,
        "steady_s": pipeline - fill,
        "gradient_sync_s": step - pipeline - optimizer_s,
        "optimizer_s": optimizer_s,
    }
    return StepTime(step, pipeline, tuple(starts), tuple(ends), forward_end, breakdown)
