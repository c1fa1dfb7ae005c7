"""The planner's tuning options: how ``plan()`` shares its time limit between its steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.cluster import Cluster


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchOptions:
    """How ``plan()`` spends its time limit. None of them changes what counts as a plan or the gap
    a returned plan is certified to; they change how soon the search closes that gap.

    Example:
      >>> from orchestrator.planner import SearchOptions
      >>> SearchOptions(column_share=0.8).tail_from
      5
    """

    start_share: float = 1 / 3
    """The balanced heuristic, the baselines and the one-stage enumeration each get at most this share
    of the time limit: the balanced heuristic is what finds a first plan wherever one fits, and on the
    largest clusters it needs most of this window."""

    polish_share: float = 0.001
    """The local search around the first incumbent (``_polish``) gets at most this share of the time
    limit: a token one. The whole-stage MIPs that certify the gap also find plans, and better ones
    where the local search is long (GPT-175B × mixed-4type-512 at 10 s: 433.14 s from the MIPs against
    436.66 s from a search given 1/6, which then leaves the bound at 15.8%), so their time is spent
    there."""

    polish_by: float = 1 / 2
    """The local search ends by this fraction of the time limit, so the bounds that certify the gap
    always get the other half."""

    first_packing_share: float = 0.5
    """Every M's first packing LP (``_packing``) gets at most this share of the time left after the
    local search, before the whole-stage bounds: it closes the microbatch counts that cannot beat the
    incumbent for one LP each, where their whole-stage LPs take at least one per stage count."""

    column_share: float = 0.99
    """The whole-stage bounds (``_paths``) get this share of the time left after the local search:
    their MIPs close most pieces, and the ILP's pieces seldom close in what is left where they do not."""

    column_mip_s: float = 1.0
    """Each stage count's whole-stage MIP, where its LP left the piece open, gets a fair share of the
    time left and at least this long: below it the open pieces of the largest clusters stop before
    their first incumbent-beating plan."""

    packing_share: float = 0.9
    """The packing bounds (``_packing``) get this share of the time left after the whole-stage bounds:
    they are needed only where the ILP's own pieces would not finish either, and a smaller share stops
    the weakest M's search short of the bound the certified gap reads."""

    coarse: float = 1e-2
    """The packing bounds' first pass stops each M's search this close (relative) to the most its
    bound could be; what is left then refines only the weakest M, the one the certified bound reads."""

    relaxation_s: float = 2.0
    """Each M's whole-model LP relaxation gets at most this long (and at most a fair share of the time
    left): on the large presets it takes up to a few seconds and bounds the M's pieces well above the
    capacity bound until their own solves do better; a longer one takes the time the pieces need."""

    tail_from: int = 5
    """Stage counts from this one on start as one tail piece per M, split into one piece per count
    when it does not close at once: deep pipelines are rarely the best plan, and one cut-off solve
    closes all of them together."""

    first_pass_s: float = 0.2
    """The first pass gives each (M, S) piece at most this long; most prove at once that they cannot
    beat the incumbent, and the rounds after share what is left among the others."""

    first_pass_presolve: bool = False
    """Whether the first pass's short solves run HiGHS's MIP presolve: on wide models the presolve takes
    longer than a short solve's limit before the root LP, so such a solve would end with no bound at
    all; without it the root bound comes first. The later rounds keep HiGHS's default."""

    retry_growth: float = 4.0
    """A piece or whole-stage MIP solved again gets at least this many times its last limit. Each try
    starts over, so a piece that needs t s wastes up to t/(growth − 1) on the tries before; a limit is
    only a cap, so a larger growth costs nothing where a piece closes sooner."""

    build_s_per_cell: float = 1e-4
    """Seconds to build an M's model per (group, run, stage) cell, the estimate used before one has been
    built: no model is built that could not be finished within the time limit."""

    finish_s: float = 0.1
    """The search ends this long (at most a hundredth of the limit) before the time limit, which is
    what building the plan (devices, explanation) takes at most on the largest presets."""

    mixed_hosts: int = 16
    """Mixed groups (two device types per stage) are offered by default on clusters of at most this many
    hosts: each mixed group is costed at every M, and on larger clusters their number takes the time
    that the bounds need."""

    def mip_options(self) -> dict[str, str]:
        """HiGHS options for the first pass's short solves (``first_pass_presolve``)."""
        return {} if self.first_pass_presolve else {"presolve": "off"}

    def offers_mixed(self, cluster: Cluster, mixed_stages: bool | None) -> bool:
        """``mixed_stages``, or when None whether ``cluster`` has at most ``mixed_hosts`` hosts."""
        if mixed_stages is None:
            return len({d.host for d in cluster.devices()}) <= self.mixed_hosts
        return mixed_stages
