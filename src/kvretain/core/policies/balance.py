"""Recency against frequency: which of the two would hit more on this traffic, measured on the controller's
sample, sets how much ``unified``'s value counts a block's uses.

``unified``'s value grows with a block's use count as ``uses ** alpha``. Frequency keeps re-used content
(shared system prompts, long conversations) through scans of one-off blocks; when the pool holds most of the
working set, or when reuse comes in bursts (agents returning after a pause), old counts keep blocks whose reuse
is over, and plain recency does better. ARC (Megiddo and Modha, FAST'03) adapts its split between a recency and
a frequency list from hits in their ghosts; here the two candidates are simulated side by side on a spatial
sample of the traffic (a sub-sample of the controller's, ``BALANCE_SAMPLE`` blocks: the candidates are compared
on the same references, so a small sample resolves their difference), each as large as the sampled pool:

- an LRU shadow (``alpha = 0``: GreedyDual with equal values is LRU);
- a ladder of GreedyDual-Frequency shadows (at ``frequency_exponent`` times each of ``RUNGS``: 1, 2 and 4; use
  counts remembered across eviction as the pool remembers them, no priorities). The frequency candidate is the
  rung that hits most over the window (``rung``): how strongly reuse should count is itself a property of the
  traffic. Where one-off content floods the pool (retrieval scans, the many single-turn requests of a
  conversation trace at small pools) only a strong frequency term keeps the reused content, as S3-FIFO's small
  queue and ARC's recency list do; where reuse comes in bursts, a weak one or none. With the configured exponent
  as the only candidate, ``unified`` with one class stayed at recency on the Mooncake traces at 500-1,641 blocks
  where S3-FIFO and ARC hit 1.1-1.5x LRU (docs/history.md, session 22).

Their hits ``E`` (LRU) and ``G`` (the best rung's) are summed over the controller's window, and the recency
share ``p`` in [0, 1] (``alpha = exponent of the rung * (1 - p)``) integrates ``(E - G) / max(E, G)``, at a rate that
crosses the range in one window when the two differ by the reuse margin (``max_reuse_loss``: the difference
the controller is built to resolve). The same two candidates' hits are also summed over protected lookups
alone (``E_p``, ``G_p``: the requests at or above the controller's ``protect_threshold``), and the share
integrates the larger of the two relative differences, ``max((E - G) / max(E, G), (E_p - G_p) / max(E_p,
G_p))``: the order moves towards frequency only as far as both all traffic and protected traffic gain from it,
and back towards recency as soon as either would hit more with recency. Frequency that raises overall reuse by
taking protected traffic's hits works against the protection the controller pays for, and the controller
cannot undo it: lowering protection then costs protected traffic more (the grid measured it: on the
multi-tenant cells where LRU already gives class 0 its isolated hits, class 0 ended up to 0.4% below LRU's
with the all-traffic comparison alone; 13 cells against 7 with this rule, docs/history.md). ``p`` starts at
``START_SHARE`` (0.5), and moves at the pool's first eviction to where the controller's warm-up measured it (below,
"The start"); ``alpha`` is quantized to ``1 / ALPHA_STEPS`` of it so the value table is rebuilt only
when it moves a step.

**One class.** While every lookup so far has asked for one retention priority (no priorities in play: the
operator runs ``unified`` as a plain prefix cache), there is no protection to pay for and the promise is the
stock engine's own: no fewer hits than LRU. The order then starts at recency (``p = 1``: LRU, the order that
promise is measured against) and leaves it only on evidence: it moves towards frequency only by the part of
frequency's lead ``G - E`` that stands above ``z`` standard errors of the two candidates' paired
difference (``sqrt(D)``, ``D`` the decayed sum over lookups of ``(e_hits - g_hits) ** 2`` for the best rung: a
lookup's blocks hit or miss together, so lookups are the independent units, as in
:mod:`kvretain.core.policies.evidence`), and back towards recency on any lead of recency. The test's sums
(``E``, ``G``, ``D`` of this rule alone) decay over the longer of the balance's window and the references that
resolve, at ``z``, the lead they measure (or the margin, if larger): :func:`~kvretain.core.policies.evidence.
needed_refs`, the rule that sizes the protection controller's window, so a small lead that persists is resolved
once enough lookups have shown it, and a large one from a fresh start as fast as the balance's window allows.
Read over the balance's window alone (until session 47) a lead of a few percent on lumpy traffic stayed near one
standard error however long it lasted, and the order kept LRU's where frequency hit more (Mooncake's
conversation trace at 500-906 blocks: 1.00x lru where the better of S3-FIFO and ARC read 1.10-1.29x; LMBench's
GMI trace at 500: 1.00x against 1.04-1.05x); it now leaves recency there (1.12-1.61x lru on the conversation
trace, 1.04x on GMI's). On a lead that is only noise it applies less frequency on average than before; the
price is adaptation: a window grown to resolve a small lead also remembers it, so after a phase change the
order takes longer to follow (measured in docs/results.md, "Three more public traces", with the faster variants
that gave the gains back; docs/history.md, session 47). ``one_class_z`` is
1.645 (``ONE_CLASS_Z`` in :mod:`kvretain.core.policies.protection`): a one-sided test at 95%, the textbook
level, not a value chosen on the grid (its sensitivity is in docs/results.md). The lead tested is the best of
the rungs' leads, so each is held to ``1 / len(RUNGS)`` of that level (Bonferroni, :func:`rung_z`: 2.128 for
three rungs), and noise alone moves the order off recency no more often than with one candidate. Why not the midpoint start and the plain integrator there: the
two candidates often differ by less than their noise (the grid's multi-tenant traces at small pools: LRU
1.8% ahead over the whole trace, frequency ahead in stretches), and the integrator, whose gain crosses the
range at a 2% difference, swung the share between its ends on that noise; the pool, which follows the order
with a lag of about a turnover, lost up to 0.5% against LRU on 13 of 80 one-class grid runs. The rule for
mixed traffic (above) runs alongside from the first lookup, and at the first lookup of a second retention
priority the order takes its share: from then on it is the mixed rule alone, at the share that rule reached
from the first lookup (only the blocks released before that lookup were keyed at recency). With classes the
midpoint start stays until evidence moves it: starting mixed traffic at recency everywhere cost the reuse floor on
7 grid cells, down to 0.966x lru (protection already moves the order away from LRU's, and the frequency term is
much of what earns the floor back).

**The start.** Until the pool first evicts, the candidates (as large as the sampled pool) have evicted nothing
and cannot tell recency from frequency, so the share sits at its midpoint whatever the traffic. The protection
controller's warm-up shadows (:mod:`kvretain.core.policies.protection`, "The start"), at half that size, evict
from the moment half the pool's worth of blocks has been referenced; with a balance they include its frequency
candidates at that size. At the pool's first eviction (:meth:`FrequencyBalance.start`) the mixed-traffic rule
starts at recency where plain LRU dominated the best frequency candidate there (no fewer hits in all and for
protected traffic, more in one): the same dominance, with no threshold, that chooses where the protection level
starts. Elsewhere it stays at the midpoint: LRU is the order the promise is measured against, so the start leaves
it only on the evidence the window gathers, as the one-class rule does. Starting at the frequency candidate
where it dominated too gave class 0 three more targets on the grid but resolved losses against lru's class 0 on
three held-out cells (none without it; docs/history.md, session 40).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

from kvretain.core.hashing import BlockHash
from kvretain.core.policies.evidence import MIN_TOLERANCE, needed_refs
from kvretain.core.policies.rules import HALF_USE
from kvretain.core.policies.shadow import GDShadow, LRUShadow
from kvretain.core.policy import FREQUENCY_RUNGS

ALPHA_STEPS = 32
"""Quantization of ``alpha`` (the frequency table is rebuilt when it moves by one step)."""
RUNGS = FREQUENCY_RUNGS
"""The frequency candidates: GreedyDual-Frequency at ``frequency_exponent`` times each of these (1, 2 and 4; the
one place they are set is :data:`kvretain.core.policy.FREQUENCY_RUNGS`, which also bounds the largest value a
configuration may reach). In GreedyDual a block's value is how long it outlives new content without being used
again (the aging floor ``L`` rises by about one new block's value per turnover), so at exponent ``a`` content
used twice outlives one-off content by ``2 ** a``: 2 at the configured exponent 1, the weak end; the strong end
is the first doubling of it at which twice-used content outlives one-off content by at least what S3-FIFO's
small queue gives it (a 10% probation queue: 9x), ``2 ** 4 = 16``; the rungs double the exponent (each squares
the ratio of two use counts' values). Without the middle rung (one shadow cheaper) mixed traffic jumped from 1
to 4 and missed the reuse floor on two grid cells (docs/history.md, session 22)."""
START_SHARE = 0.5
"""The recency share before any evidence (until the warm-up's, at the pool's first eviction, where it dominates):
halfway between the two candidates (with nothing known about the traffic, the midpoint bounds the early loss
against whichever of the two turns out better)."""


class FrequencyBalance:
    """The frequency exponent of a value order, set by which of recency and frequency hits more (module
    docstring)."""

    __slots__ = (
        "_d2",
        "_e",
        "_e1",
        "_ep",
        "_exps",
        "_g",
        "_g1",
        "_gain",
        "_gp",
        "_lru",
        "_margin",
        "_mixed",
        "_refs1",
        "_shadows",
        "_tracked",
        "_z",
        "level",
        "one_class",
        "rung",
        "share",
        "start_share",
    )

    def __init__(
        self,
        tracked: int,
        exponent: float,
        cap: int,
        ghost_factor: float,
        margin: float,
        one_class_z: float = 1.645,
        rungs: Sequence[float] | None = None,
    ) -> None:
        self._exps = [exponent * r for r in (RUNGS if rungs is None else rungs)]
        k = len(self._exps)
        ghost = int(ghost_factor * tracked)
        self._shadows = [GDShadow(tracked, x, cap, ghost) for x in self._exps]
        self._lru = LRUShadow(tracked)
        self._tracked = tracked
        self._gain = 1.0 / max(margin, MIN_TOLERANCE)
        self._margin = margin
        self._e = 0.0
        self._ep = 0.0
        # per rung: decayed hits (all traffic, protected traffic) and the decayed sum over lookups of (LRU hits -
        # the rung's hits) ** 2, the paired noise
        self._g = [0.0] * k
        self._gp = [0.0] * k
        self._d2 = [0.0] * k
        # the one-class test's own sums: recency's hits, each rung's, and the sampled references, decayed over the
        # test's window (:meth:`_one_class_sums`; ``_d2`` is its paired noise)
        self._e1 = 0.0
        self._g1 = [0.0] * k
        self._refs1 = 0.0
        self._z = rung_z(one_class_z, k)
        self.rung = 0  # the frequency candidate that hits most over the window: the share's frequency end
        # ``share`` is the recency share the order follows; ``_mixed`` the mixed-traffic rule's, run alongside
        # while the traffic is one class (module docstring)
        self.one_class = True
        self._mixed = self.start_share = START_SHARE
        self.share = 1.0
        self.level = 0

    @property
    def alpha(self) -> float:
        return self._exps[self.rung] * self.level / ALPHA_STEPS

    @property
    def exponents(self) -> list[float]:
        """The frequency candidates' exponents, one per rung."""
        return list(self._exps)

    def see(self, sampled: Sequence[BlockHash], lru_hits: int | None = None) -> tuple[int, tuple[int, ...]]:
        """Reference one lookup's ``sampled`` blocks (prefix order) in every candidate; their hits (recency; each
        frequency rung). ``lru_hits``: the hits of an LRU shadow of this size that has seen every lookup the
        balance has (the controller's, when it samples the same blocks), in place of the balance's own."""
        e_hits = self._lru.reference(sampled) if lru_hits is None else lru_hits
        return e_hits, tuple([sh.reference(sampled) for sh in self._shadows])

    def update(
        self,
        n: int,
        e_hits: int,
        g_hits: Sequence[int],
        decay: float,
        window: float,
        protected: bool,
        one_class: bool = False,
    ) -> bool:
        """Account one lookup of ``n`` sampled blocks whose candidates hit ``e_hits`` (recency) and ``g_hits``
        (each frequency rung), from a ``protected`` request or not (:meth:`see`); ``decay`` is the controller's
        for this lookup and ``window`` its window in these references. ``one_class``: every lookup so far (this
        one included) asked for one retention priority; once False it is never True again. Returns True when
        ``alpha`` moved."""
        self._e = e = self._e * decay + e_hits
        G, GP, D2 = self._g, self._gp, self._d2
        rungs = len(G)
        for k in range(rungs):
            G[k] = G[k] * decay + g_hits[k]
        if protected:
            for k in range(rungs):
                GP[k] = GP[k] * decay + g_hits[k]
        else:
            for k in range(rungs):
                GP[k] *= decay
        if self.one_class:
            if one_class:
                self._one_class_sums(n, e_hits, g_hits, decay, window)
            else:  # a second retention priority ends the one-class rule: the mixed rule's share from now on
                self.one_class = False
                self.share = self._mixed
        best = _best(G, self.rung)
        rung = _best(self._g1, self.rung) if self.one_class else best  # (the frequency end the order follows)
        moved = rung != self.rung and self.level > 0
        self.rung = rung
        gg = G[best]
        m = e if e > gg else gg
        if m <= 0.0:
            return self._set_level() or moved
        u = (e - gg) / m
        # protected traffic's own preference: towards recency if either prefers it (see the module docstring)
        self._ep = ep = self._ep * decay + (e_hits if protected else 0)
        gp = GP[best]
        mp = ep if ep > gp else gp
        if mp > 0.0:
            up = (ep - gp) / mp
            if up > u:
                u = up
        step = self._gain * n / window
        p = self._mixed + step * u
        self._mixed = p = 0.0 if p < 0.0 else (1.0 if p > 1.0 else p)
        if self.one_class:  # the one-class rule: towards frequency only by its lead beyond the noise
            e1, g1 = self._e1, self._g1[rung]
            m1 = e1 if e1 > g1 else g1
            if e1 >= g1:
                u = (e1 - g1) / m1 if m1 > 0.0 else 0.0
            else:
                lead = g1 - e1 - self._z * math.sqrt(D2[rung])
                u = -lead / m1 if lead > 0.0 else 0.0
            p = self.share + step * u
            p = 0.0 if p < 0.0 else (1.0 if p > 1.0 else p)
        self.share = p
        return self._set_level() or moved

    def _one_class_sums(
        self, n: int, e_hits: int, g_hits: Sequence[int], decay: float, window: float
    ) -> None:
        """Add one lookup to the one-class test's sums, decayed over the longer of the balance's ``window`` (whose
        ``decay`` it is) and the references that resolve, at the test's ``z``, the lead its sums measure (or the
        margin, if larger): :func:`~kvretain.core.policies.evidence.needed_refs`, the rule that sizes the
        protection controller's window (module docstring, "One class")."""
        G1, D2 = self._g1, self._d2
        b = _best(G1, self.rung)
        need = needed_refs(self._refs1, self._z * self._z * D2[b], self._e1, G1[b], self._margin)
        d = decay if need <= window else max(decay, math.exp(-n / need))  # (never faster than the balance's)
        self._refs1 = self._refs1 * d + n
        self._e1 = self._e1 * d + e_hits
        for k in range(len(G1)):
            G1[k] = G1[k] * d + g_hits[k]
            dk = e_hits - g_hits[k]
            D2[k] = D2[k] * d + dk * dk

    def start(self, share: float) -> bool:
        """The mixed-traffic rule starts at recency share ``share``, where the controller's warm-up measured it at
        the pool's first eviction (module docstring, "The start"); the order takes it unless the one-class rule
        still holds. True when ``alpha`` moved."""
        self._mixed = self.start_share = share
        if not self.one_class:
            self.share = share
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


def _best(hits: Sequence[float], current: int) -> int:
    """The rung with the most ``hits`` (``current`` on a tie with it: the order does not switch on equal hits)."""
    best = current
    for k in range(len(hits)):
        if hits[k] > hits[best]:
            best = k
    return best


def rung_z(z: float, rungs: int) -> float:
    """The one-class test's threshold per rung: ``z`` is the one-sided test for one candidate (1.645: 5%); with
    ``rungs`` candidates compared with recency, the lead of the best one is the largest of ``rungs`` noisy leads,
    so each is tested at ``1 / rungs`` of that level (Bonferroni), keeping the chance that noise alone moves the
    order off recency at most the single test's."""
    nd = NormalDist()
    return nd.inv_cdf(1.0 - (1.0 - nd.cdf(z)) / rungs) if rungs > 1 else z
