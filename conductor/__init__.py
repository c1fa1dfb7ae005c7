"""The conductor: finds attention and recurrent-scan blocks in a traced step and
rewrites them into kernels (flash attention, a fused chunked selective scan).

    >>> import conductor
    >>> fast_loss = conductor.optimize(loss_fn, policy=conductor.Policy())   # doctest: +SKIP
    >>> conductor.inspect(loss_fn, params, batch)                             # doctest: +SKIP
"""

from conductor.decide import Decision, DeviceProfile, Policy, decide, device_profile
from conductor.match import PATTERNS, Match, find
from conductor.rewrite import ConductorWarning, inspect, optimize

__all__ = [
    "PATTERNS",
    "ConductorWarning",
    "Decision",
    "DeviceProfile",
    "Match",
    "Policy",
    "decide",
    "device_profile",
    "find",
    "inspect",
    "optimize",
]
