"""Recency against frequency: which of the two would hit more on this traffic, measured on the controller's
sample, sets how much ``unified``'s value counts a block's uses.

``unified``'s value grows with a block's use count as ``uses ** alpha``. Frequency keeps re-used content
(shared system prompts, long conversations) through scans of one-off blocks; when the pool holds most of the
working set, or when reuse comes in bursts (agents returning after a pause), old counts keep blocks whose reuse
is over, and plain recency does better. ARC (Megiddo and Modha, FAST'03) adapts its split between a recency and
a frequency list from hits in their ghosts; here the two candidates are simulated side by side on a spatial
sample of the traffic (a sub-sample of the controller's, ``BALANCE_SAMPLE`` blocks: the two are compared on the
same references, so a small sample resolves their difference), each as large as the sampled pool:

- an LRU shadow (``alpha = 0``: GreedyDual with equal values is LRU);
- a GreedyDual-Frequency shadow (``alpha = frequency_exponent``, use counts remembered across eviction as the
  pool remembers them, no priorities).

Their hits ``E`` (LRU) and ``G`` (frequency) are summed over the controller's window, and the recency share
``p`` in [0, 1] (``alpha = frequency_exponent * (1 - p)``) integrates ``(E - G) / max(E, G)``, at a rate that
crosses the range in one window when the two differ by the reuse margin (``max_reuse_loss``: the difference
the controller is built to resolve). The same two candidates' hits are also summed over protected lookups
alone (``E_p``, ``G_p``: the requests at or above the controller's ``protect_threshold``), and the share
integrates the larger of the two relative differences, ``max((E - G) / max(E, G), (E_p - G_p) / max(E_p,
G_p))``: the order moves towards frequency only as far as both all traffic and protected traffic gain from it,
and back towards recency as soon as either would hit more with recency. Frequency that raises overall reuse by
taking protected traffic's hits works against the protection the controller pays for, and the controller
cannot undo it: lowering protection then costs protected traffic more (the grid measured it: on the
multi-tenant cells where LRU already gives class 0 its isolated hits, class 0 ended up to 0.4% below LRU's
with the all-traffic comparison alone; 13 cells against 7 with this rule, docs/results.md). ``p`` starts at
``START_SHARE`` (0.5); ``alpha`` is quantized to ``1 / ALPHA_STEPS`` of it so the value table is rebuilt only
when it moves a step.

**One class.** While every lookup so far has asked for one retention priority (no priorities in play: the
operator runs ``unified`` as a plain prefix cache), there is no protection to pay for and the promise is the
stock engine's own: no fewer hits than LRU. The order then starts at recency (``p = 1``: LRU, the order that
promise is measured against) and leaves it only on evidence: it moves towards frequency only by the part of
frequency's lead ``G - E`` that stands above ``one_class_z`` standard errors of the two candidates' paired
difference (``sqrt(D)``, ``D`` the decayed sum over lookups of ``(e_hits - g_hits) ** 2``: a lookup's blocks
hit or miss together, so lookups are the independent units, as in :mod:`kvretain.core.policies.evidence`),
and back towards recency on any lead of recency. ``one_class_z`` is 1.645 (``ONE_CLASS_Z`` in
:mod:`kvretain.core.policies.protection`): a one-sided test at 95%, the textbook level, not a value chosen on
the grid (its sensitivity is in docs/results.md). Why not the midpoint start and the plain integrator there: the
two candidates often differ by less than their noise (the grid's multi-tenant traces at small pools: LRU
1.8% ahead over the whole trace, frequency ahead in stretches), and the integrator, whose gain crosses the
range at a 2% difference, swung the share between its ends on that noise; the pool, which follows the order
with a lag of about a turnover, lost up to 0.5% against LRU on 13 of 80 one-class grid runs. The rule for
mixed traffic (above) runs alongside from the first lookup, and at the first lookup of a second retention
priority the order takes its share: from then on it is the mixed rule alone, at the share that rule reached
from the first lookup (only the blocks released before that lookup were keyed at recency). With classes the
midpoint start stays: starting mixed traffic at recency cost the reuse floor on 7 grid cells, down to 0.966x
lru (protection already moves the order away from LRU's, and the frequency term is much of what earns the floor
back).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvretain.core.hashing import BlockHash
from kvretain.core.policies.evidence import MIN_TOLERANCE
from kvretain.core.policies.rules import HALF_USE
from kvretain.core.policies.shadow import GDShadow, LRUShadow

ALPHA_STEPS = 32
"""Quantization of ``alpha`` (the frequency table is rebuilt when it moves by one step)."""
START_SHARE = 0.5
"""The recency share before any evidence: halfway between the two candidates (with nothing known about the
traffic, the midpoint bounds the early loss against whichever of the two turns out better)."""


class FrequencyBalance:
    """The frequency exponent of a value order, set by which of recency and frequency hits more (module
    docstring)."""

    __slots__ = (
        "_d2",
        "_e",
        "_ep",
        "_exp",
        "_g",
        "_gain",
        "_gp",
        "_lru",
        "_mixed",
        "_shadow",
        "_tracked",
        "_z",
        "level",
        "one_class",
        "share",
    )

    def __init__(
        self,
        tracked: int,
        exponent: float,
        cap: int,
        ghost_factor: float,
        margin: float,
        one_class_z: float = 1.645,
    ) -> None:
        self._exp = exponent
        self._shadow = GDShadow(tracked, exponent, cap, int(ghost_factor * tracked))
        self._lru = LRUShadow(tracked)
        self._tracked = tracked
        self._gain = 1.0 / max(margin, MIN_TOLERANCE)
        self._e = 0.0
        self._g = 0.0
        self._ep = 0.0
        self._gp = 0.0
        self._d2 = 0.0  # decayed sum over lookups of (LRU hits - frequency hits) ** 2: the paired noise
        self._z = one_class_z
        # ``share`` is the recency share the order follows; ``_mixed`` the mixed-traffic rule's, run alongside
        # while the traffic is one class (module docstring)
        self.one_class = True
        self._mixed = START_SHARE
        self.share = 1.0
        self.level = 0

    @property
    def alpha(self) -> float:
        return self._exp * self.level / ALPHA_STEPS

    def see(self, sampled: Sequence[BlockHash], lru_hits: int | None = None) -> tuple[int, int]:
        """Reference one lookup's ``sampled`` blocks (prefix order) in both candidates; their hits (recency,
        frequency). ``lru_hits``: the hits of an LRU shadow of this size that has seen every lookup the
        balance has (the controller's, when it samples the same blocks), in place of the balance's own."""
        e_hits = self._lru.reference(sampled) if lru_hits is None else lru_hits
        return e_hits, self._shadow.reference(sampled)

    def update(
        self,
        n: int,
        e_hits: int,
        g: int,
        decay: float,
        window: float,
        protected: bool,
        one_class: bool = False,
    ) -> bool:
        """Account one lookup of ``n`` sampled blocks whose candidates hit ``e_hits`` (recency) and ``g``
        (frequency), from a ``protected`` request or not (:meth:`see`); ``decay`` is the controller's for this
        lookup and ``window`` its window in these references. ``one_class``: every lookup so far (this one
        included) asked for one retention priority; once False it is never True again. Returns True when
        ``alpha`` moved a step."""
        self._e = e = self._e * decay + e_hits
        self._g = gg = self._g * decay + g
        if self.one_class:
            if one_class:  # (the paired noise is the one-class rule's alone)
                self._d2 = self._d2 * decay + (e_hits - g) * (e_hits - g)
            else:  # a second retention priority ends the one-class rule: the mixed rule's share from now on
                self.one_class = False
                self.share = self._mixed
        m = e if e > gg else gg
        if m <= 0.0:
            return self._set_level()
        u = (e - gg) / m
        # protected traffic's own preference: towards recency if either prefers it (see the module docstring)
        self._ep = ep = self._ep * decay + (e_hits if protected else 0)
        self._gp = gp = self._gp * decay + (g if protected else 0)
        mp = ep if ep > gp else gp
        if mp > 0.0:
            up = (ep - gp) / mp
            if up > u:
                u = up
        step = self._gain * n / window
        p = self._mixed + step * u
        self._mixed = p = 0.0 if p < 0.0 else (1.0 if p > 1.0 else p)
        if self.one_class:  # the one-class rule: towards frequency only by its lead beyond the noise
            if e >= gg:
                u = (e - gg) / m
            else:
                lead = gg - e - self._z * math.sqrt(self._d2)
                u = -lead / m if lead > 0.0 else 0.0
            p = self.share + step * u
            p = 0.0 if p < 0.0 else (1.0 if p > 1.0 else p)
        self.share = p
        return self._set_level()

    def _set_level(self) -> bool:
        """``level`` from ``share``; True when it moved a step."""
        level = round(ALPHA_STEPS * (1.0 - self.share))
        if level != self.level:
            self.level = level
            return True
        return False

    def table(self, cap: int) -> list[float]:
        """``uses ** alpha`` for uses 0..cap (0 uses count as ``HALF_USE``)."""
        a = self.alpha
        return [HALF_USE if u == 0 else float(u) ** a for u in range(cap + 1)]
