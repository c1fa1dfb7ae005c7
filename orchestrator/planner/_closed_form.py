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

**Interleaved 1F1B** (v ≥ 2 virtual stages; Narayanan et al. 2021, §2.2.2). Stage s runs v
chunks, each f'_s = f_s/v forward and b'_s = b_s/v backward, c'_s = f'_s + b'_s; chunk c of
stage s is virtual stage k = c·S + s of a chain of V = v·S, so a microbatch crosses every
boundary s → s + 1 v times and the wrap S − 1 → 0 (P_{S−1}: the last stage's output of a chunk
to the first stage) v − 1 times. Along the chain: φ_k = f'_{k mod S}, β_k = b'_{k mod S},
π_k = P_{k mod S} (π_{V−1} = 0); microbatch 0 reaches k's forward after A_k = Σ_{k'<k} (φ_k' +
π_k'), and from the end of a forward at k to the start of its backward there are at least

    R_k = Σ_{k'>k} (φ_k' + β_k') + 2·Σ_{k≤k'<V−1} π_k'

Stage s runs N = v·M chunk steps in Megatron-LM's order (``simulate.chunk_order``; M a
multiple of S): forward step i is virtual stage κ(i) = ((i // S) mod v)·S + s, backward step j
that of chunk v − 1 − (j // S) mod v, whose forward is step φ(j) = (j // vS)·vS + (v − 1 −
(j // S) mod v)·S + j mod S; w_s = min(2(S − s − 1) + (v − 1)·S, N) forwards, then one forward
and one backward at a time. With F_i the end of forward step i and T_j of backward step j:

    F_i ≥ max(F_{i−1}, A_κ(i)) + f'_s                    (i ≤ w_s: the warm-up; F_{−1} = 0)
    F_i ≥ max(T_{i−w_s−1}, A_κ(i)) + f'_s                (i > w_s: after backward i − w_s − 1)
    T_j ≥ max(F_{w_s+j} if w_s + j < N else T_{j−1},  F_φ(j) + R_κ'(j)) + b'_s

(κ'(j) the virtual stage of backward step j). The recurrence is the in-flight cycle of plain
1F1B followed through the chunks, O(v·M) per stage; every term is a path of the schedule, so
each T_j is a lower bound on its backward's end. Then B_s = T_0 − b'_s, and

    E_s ≥ T_{N−1}                                         (its last backward, of chunk 0)
    E_s ≥ A_s + c'_s + 2N·P_s    (s < S−1),    E_{S−1} ≥ A_{S−1} + c'_{S−1} + 2(v−1)M·P_{S−1}
                                                          (its outgoing link, the wrap for the last)

The drain is W = max_s (E_s + Σ_{s'<s} (b'_s' + P_s')); the gradient-sync flow shop runs behind
the last backward (chunk 0) with each layer's share scaled by 1/v (the simulator's model: a
stage's buckets follow its last backward, whichever chunk they belong to). With equal stages
and no transfers this gives M·c + (S − 1)·c/v: the bubble shrinks v-fold, while each link
carries v times the transfers. v = 1 is the plain 1F1B rows above. The ILP does not write
these rows: the planner picks v after it (docs/planner.md, "Virtual stages").
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


def interleaved_in_flight(microbatches: int, stages: int, stage: int, virtual_stages: int) -> float:
    """The microbatches' worth of activations ``stage`` holds at its peak under interleaved 1F1B:
    min(w_s + 1, v·M) chunks of 1/v of its layers each (w_s its warm-up forwards, as Megatron-LM
    counts them); for stage 0, S + (S − 1)/v when M is large, against S under plain 1F1B."""
    v, S, M = virtual_stages, stages, microbatches
    return min(2 * (S - stage - 1) + (v - 1) * S + 1, v * M) / v


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
    virtual_stages: int = 1,
) -> StepTime:
    """The closed form above for stages in pipeline order. ``backward`` and ``sync`` hold each
    stage's per-layer times, in layer order; ``send[-1]`` is the wrap transfer from the last stage
    to the first under ``virtual_stages`` v > 1 (interleaved 1F1B), ignored with v = 1."""
    S, M, v = len(forward), microbatches, virtual_stages
    if v > 1:
        return _interleaved(forward, backward, send, sync, optimizer, M, schedule, v)
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
    return _tail(starts, ends, forward_end, up_b, backward, sync, optimizer, fill=sum(c) + 2 * sum(P))


def _tail(starts, ends, forward_end, up_b, backward, sync, optimizer, *, fill: float) -> StepTime:
    """The drain, each stage's gradient-sync flow shop and optimizer, and the breakdown (``backward``:
    the per-layer shares of each stage's last backward step)."""
    S = len(ends)
    pipeline = max(ends[s] + up_b[s] for s in range(S))
    ends[0] = max(ends[0], pipeline)
    tails = [sync_end(ends[s], backward[s], sync[s]) + optimizer[s] for s in range(S)]
    step = max(pipeline, *tails)
    last = max(range(S), key=lambda s: tails[s])
    optimizer_s = min(step - pipeline, optimizer[last])
    breakdown = {
        "fill_drain_s": fill,
        "steady_s": pipeline - fill,
        "gradient_sync_s": step - pipeline - optimizer_s,
        "optimizer_s": optimizer_s,
    }
    return StepTime(step, pipeline, tuple(starts), tuple(ends), forward_end, breakdown)


def _interleaved(forward, backward, send, sync, optimizer, M: int, schedule: str, v: int) -> StepTime:
    """The interleaved 1F1B rows of the module docstring (v ≥ 2)."""
    S = len(forward)
    if schedule != "1f1b" or S < 2 or M % S:
        raise ValueError(
            f"virtual stages need the 1f1b schedule, at least 2 stages and microbatches divisible by them, "
            f"got {schedule}, {S} stage(s), {M} microbatches"
        )
    f = [x / v for x in forward]
    b = [sum(layers) / v for layers in backward]
    P = list(send[:S])
    V, N = v * S, v * M
    phi = [f[k % S] for k in range(V)]
    beta = [b[k % S] for k in range(V)]
    pi = [P[k % S] for k in range(V - 1)] + [0.0]
    A = [0.0] * V  # microbatch 0 reaches virtual stage k's forward
    for k in range(1, V):
        A[k] = A[k - 1] + phi[k - 1] + pi[k - 1]
    R = [0.0] * V  # from the end of k's forward to the start of its backward
    for k in range(V - 2, -1, -1):
        R[k] = R[k + 1] + phi[k + 1] + beta[k + 1] + 2 * pi[k]
    starts, ends = [0.0] * S, [0.0] * S
    for s in range(S):
        warm = min(2 * (S - s - 1) + (v - 1) * S, N)

        def chunk_stage(i: int, backward_step: bool, s: int = s) -> int:
            """The virtual stage of stage s's forward (or backward) step i."""
            group = (i // S) % v
            return (v - 1 - group if backward_step else group) * S + s

        F, T = [0.0] * N, [0.0] * N
        for i in range(min(warm + 1, N)):
            F[i] = max(F[i - 1] if i else 0.0, A[chunk_stage(i, False)]) + f[s]
        for j in range(N):
            if j >= 1 and warm + j < N:
                F[warm + j] = max(T[j - 1], A[chunk_stage(warm + j, False)]) + f[s]
            before = F[warm + j] if warm + j < N else (T[j - 1] if j else F[N - 1])
            mine = (j // (v * S)) * v * S + (v - 1 - (j // S) % v) * S + j % S
            T[j] = max(before, F[mine] + R[chunk_stage(j, True)]) + b[s]
        starts[s] = T[0] - b[s]
        crossings = N if s < S - 1 else (v - 1) * M
        ends[s] = max(T[N - 1], A[s] + f[s] + b[s] + 2 * crossings * P[s])
    up_b = [sum(b[:s]) + sum(P[:s]) for s in range(S)]
    shares = [[x / v for x in layers] for layers in backward]
    fill = sum(forward) + sum(sum(layers) for layers in backward) + 2 * sum(pi)
    return _tail(starts, ends, 0.0, up_b, shares, sync, optimizer, fill=fill)
