"""How many blocks protected traffic may hold: the protection controller of ``unified`` (and of the vLLM
plugin's run queue, which uses this class as it is).

Protection is a trade: blocks kept for important (protected) requests are blocks the rest of the traffic
cannot reuse. The controller measures both sides online and moves the protected target between them:

- **what protected traffic would hit alone**: an LRU shadow directory of the protected requests' lookups,
  as large as the pool (the isolation reference: the hits they would get with the pool to themselves);
- **what all traffic would hit under plain LRU**: an LRU shadow directory of every request's lookups, as
  large as the pool (vLLM's own order: the reuse a stock engine would get from this pool);
- **which way protection moves protected hits**: a tiered shadow of every request's lookups, protected blocks
  kept first (protection at its top; below).

The shadows are *spatially sampled* as SHARDS (Waldspurger et al., FAST'15) samples for miss-ratio curves: a
block is tracked when a hash of its identity falls below ``rate``, and each shadow holds ``rate`` x the pool.
The rate is ``min(1, SHARDS_SAMPLE / pool)``: exact for pools up to 8,192 blocks, 8,192 tracked blocks above
(SHARDS's fixed-size variant, whose published error at that size is well under 1% of the miss ratio). The
pool's own hits are counted on the same sample, so each comparison is between two counts of the same
sampled blocks.

Per block reference the controller keeps decayed sums of: the pool's hits ``A`` and the LRU shadow's hits
``E`` over all traffic, and the pool's hits ``A_p``, the isolated shadow's hits ``E_p``, the LRU shadow's
``L_p`` and the tiered shadow's ``T_p`` over protected
traffic. Two relative errors follow::

    reuse slack   s = (A - (1 - max_reuse_loss) * E) / max(A, E)      # > 0: overall reuse above its floor
    isolation gap g = (W - A_p) / max(A_p, E_p, W),  W = max(isolation_goal * E_p, L_p)   # > 0: protected short

where ``L_p`` is the LRU shadow's hits of protected traffic: the goal never asks for less than what protected
traffic gets from plain LRU in the shared pool (where LRU already gives it most of its isolated hits, a goal
of 0.9 of them would otherwise let the controller give protected traffic less than no protection at all).

and one actuator, the *protection level* ``lam`` in [-1, 1], integrates:

- while protected traffic is short of its goal (``g > 0``), the sign of the move comes from a third shadow,
  the *tiered* one (:class:`~kvretain.core.policies.shadow.TieredShadow`: every request's lookups, protected
  blocks kept before unprotected ones up to the budget; ``unified`` at its full protection level), whose hits of
  protected traffic ``T_p`` tell what protection at its top would give it:

  - towards the end of the actuator that gives protected traffic more, while that end gives it more than the
    pool does now: the top (``T_p``) while ``T_p > A_p`` and ``T_p > L_p``, the level rising by the tighter of
    the gap and the slack, each at its gain (below): it rises while overall reuse has room above its floor,
    more slowly close to it, and falls as soon as the floor is crossed; else the bottom (level -1, no bias:
    plain LRU's ``L_p`` where the base order is recency) while ``L_p > A_p``, the level falling by the relative
    shortfall ``(A_p - L_p) / L_p``;
  - else (the pool already gives protected traffic more than either end) the level holds (the floor, ``s``,
    still pulls it down once overall reuse is below its floor).

  Where the shadows cannot tell the ends apart (``T_p == L_p``: a cold pool, whose shadows have evicted
  nothing that protected traffic comes back for; always with ``budget`` 0, whose tiered shadow is plain LRU,
  since it models the top's protected tier and not the retention weights that also bias the order above level
  0) the rule the level had before it measured the sign applies: it rises, unless plain LRU gives every request
  and protected traffic more (``A < E`` and ``A_p < L_p``), and then falls by the smaller of the two relative
  shortfalls, ``max((A - E) / max(A, E), (A_p - L_p) / L_p)`` (the level starts at 1 for the same reason
  unless the warm-up measured otherwise: "The start", below). The sign is read from the two estimates as they stand:
  the window is sized for the pool-vs-LRU difference, not for ``T_p - L_p``, so where the two ends are within
  that difference's noise of each other (the grid's last cells below lru) the direction can change from one
  lookup to the next.

  Where protected traffic's hits come partly from blocks other traffic brings in (the multi-tenant grid's
  longest-conversations rule) more protection means fewer of them. Until session 23 the level rose regardless
  and held the pool where LRU dominated it; sessions 23-34 let it fall only where the pool also hit less than
  LRU overall (``A < E``), so where it hit more the rise went on and class 0 ended 0.02-0.25% below lru's on
  six grid cells. The tiered shadow measures the sign instead of assuming it (docs/history.md, session 35);
- beyond the goal (``g <= 0``): while the pool hits less than the LRU shadow (protection costs reuse), the
  larger of the excess and that cost, ``min(g, (A - E) / max(A, E))``, so protection nobody needs is given
  back; while the pool hits at least as much as LRU, nothing (protection that costs no reuse is kept: giving it
  back would lower protected hits and gain nothing measurable); the floor, ``s``, still caps it.

The level sets everything by which priority bends the order::

    lam in [0, 1]:   protected target = lam x budget x pool, full retention weights
    lam in [-1, 0]:  protected target = 0, retention weights priority_weight ** ((r - 35) / 10 x (1 + lam))

so at ``lam = -1`` retention priority no longer changes the order at all (the base value order alone), and the
reuse floor can always be kept as far as the base order keeps it. A target above the protected blocks the pool holds
decides no eviction (protected blocks are exempt while they number at most the target, however far below it
they are): while the level falls, it first falls to the target the pool's protected blocks fill, so a give-back
acts on the next eviction instead of after crossing that dead range (anti-windup, as a saturated actuator's
integrator is held in control practice). The count is the most protected blocks held at a lookup, decayed over
the window (a dip, blocks in use released and evicted in between, is not taken for the level), told by the pool
once it has evicted (before that it still grows towards the target), and the jump is scaled by the confidence
as every step is. Measured (docs/history.md, session 15): Mooncake's second half at 32,000 blocks, where the level spent
half the trace crossing 1 -> 0.4 with no effect, 0.978x -> 0.984x lru. Which term is the smaller is reported as
the binding constraint.

The start. Until the pool first evicts, nothing it holds shows what protection costs, and the shadows above, as
large as the pool, fill with it. Two *warm-up* shadows at ``WARMUP_SCALE`` (half) of their size, a plain LRU one
and a tiered one (protection at its top), see the same sampled references and evict from the moment half the
pool's worth of blocks has been referenced. At the pool's first eviction they have measured, on this traffic at
half the pool, both ends of the level on both sides: every request's hits with no bias (``E_w``) and with
protection at its top (``T_w``), and protected traffic's (``L_w``, ``T_w,p``). The level starts at the end the
other does not dominate:

- the bottom (-1, no bias) where the top gives protected traffic no more than the bottom (``T_w,p <= L_w``) and
  every request fewer hits (``T_w < E_w``): protection there is pure cost (protected traffic re-reads nothing that
  protection keeps, as a high-priority stream of one-off documents: at the top its blocks push out the reuse of
  every other class at the first evictions, before the window has measured the cost, and the loss lasts until
  the evicted working sets are brought back by misses; adversarial traffic, docs/results.md, session 39);
- else the top, where the level stands from its construction (1): a client's priorities are honoured, and
  where protection pays, it pays from the first eviction (a start at the bottom everywhere gave class 0 less than
  lru's on 13 grid cells instead of 4, and missed its target on 5 more: session 38).

With a recency/frequency balance the warm-up also holds its frequency candidates at the same size, and the
balance starts by the same dominance: at recency where the warm-up's LRU shadow dominated the best of them, else
at its midpoint (:mod:`kvretain.core.policies.balance`, "The start").

Then the warm-up shadows are dropped and the rule above moves the level. Dominance needs no threshold; what is
chosen is the scale (:data:`WARMUP_SCALE`, its reason there; its sensitivity in docs/results.md, "Knob
sensitivity").

Where the per-block work runs: the sample of a request's blocks and their references in every shadow need
nothing but the request's block identities, so :meth:`ProtectionController.on_arrival` does them when the engine
hashes the request (vLLM: its input processing, outside the scheduler's step) and hands the hits to the
request's first lookup, which adds the pool's own hits and moves the level
(:meth:`~ProtectionController.on_lookup`; without an arrival it does both). The shadows then see requests in
arrival order.

Windows and gains, from the pool size, the observed hits and the margin (no constant chosen because it
passed):

- the sums decay with a time constant, in sampled block references, of the longer of two windows: (a)
  ``WINDOW_TURNOVERS`` = 1 pool turnover (``rate x pool`` references): a target change shows in the hits only
  after the blocks it keeps or drops have been re-referenced, about a turnover (the plant's delay; a shorter
  window reads the effect of a change before it can show); (b) the references it takes for the *paired*
  difference between the pool's and the LRU shadow's hits (the same sampled blocks of the same lookups) to be
  resolved: with ``D`` the sum over lookups of ``(pool hits - LRU hits)**2`` and ``M = max(A, E)``, the
  relative noise of ``A - E`` is ``sqrt(D) / M``, and the window must bring it below the error to be resolved,
  the reuse margin ``max_reuse_loss`` or the measured ``|A - E| / M`` when that is larger (a large error is
  acted on as soon as it is above the noise, a small one waits for the evidence that resolves it). Counting
  lookups' hits in pairs matters: a request's prefix hits or misses together, so N hits of a few lookups carry
  the information of a few, not of N (16-token blocks: hundreds of sampled blocks a lookup). The rule, once:
  :mod:`kvretain.core.policies.evidence`;
- the gain lets the level cross half its range in one window at an error as large as the constraint's own
  tolerance: ``1 - isolation_goal`` (10% by default) for the isolation gap and the cost beyond the goal,
  ``max_reuse_loss`` (2%) for the floor (the floor is the harder promise, so an error of its size moves the
  level as fast as an error of the goal's size). The goal's gain is never above the floor's (its tolerance is
  at least ``max_reuse_loss``): a goal closer to 1 than the floor's margin would otherwise raise the level
  faster than the floor pulls it back. The two terms compete as moves (error x gain), so the floor caps a
  rise, never speeds it up; below the floor its move, at its own gain, pulls the level down. One exception, by
  what the level moves: below level 0 it moves the retention weights, and a new weight table re-keys every cached
  block at once, so the whole pool's order steps, and what the step costs shows in the hits a turnover later (the
  plant's delay, (a) above); a rise there capped at the floor's gain (5x the goal's at the defaults) overshot the
  floor by what it moved in that turnover, and the level cycled about the floor with its mean below it (five
  request priorities whose most re-used traffic had the lowest retention, 20% pool: overall 0.968x lru; session
  36, docs/history.md). So while the level is below 0 and above the floor, the room left caps a rise as an
  *error* at the rise's own gain (``min(g, s)`` x the goal's gain): the weights approach the floor no faster
  than the gap alone would move them, more slowly the closer they get. Above level 0 the level moves the
  protected target, which the pool reaches only as blocks are released and evicted: the turnover already paces
  it, and the same cap there cut ``bench/vllm_plugin.py``'s class-0 hit tokens from 2.55x to 1.91x stock's
  (overall 1.077x -> 1.025x) and the simulator's class-0 p99 TTFT gain (seed 0: 0.599x -> 0.674x lru). While
  the window holds less than (b) asks (a cold start), the step is scaled down by that share (the confidence).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from itertools import compress
from operator import itemgetter

from kvretain.core.hashing import BlockHash
from kvretain.core.policies.balance import FrequencyBalance
from kvretain.core.policies.evidence import MIN_TOLERANCE, confidence, needed_refs
from kvretain.core.policies.rules import frequency_terms, retention_weights
from kvretain.core.policies.shadow import GDShadow, LRUShadow, TieredShadow
from kvretain.core.policy import PolicyConfig

SHARDS_SAMPLE = 8192
"""Tracked blocks per shadow directory above which the shadows are sampled (SHARDS's fixed-size variant)."""
WARMUP_SCALE = 0.5
"""The warm-up shadows' size, as a share of the controller's shadows (module docstring, "The start"). They must
evict before the pool does, so they are smaller; their evidence covers the references after they fill, ``1 -
WARMUP_SCALE`` of the warm-up, at a size ``WARMUP_SCALE`` of the pool's. Half is where the two are even: a
smaller shadow has more evidence, about a pool further from this one (protection matters more in a smaller
pool), a larger one less evidence about a nearer pool."""
BIAS_STEPS = 64
"""Quantization of the retention weights' exponent below level 0 (the weight table is rebuilt per step)."""
WINDOW_TURNOVERS = 1.0
"""The controller's measurement window in pool turnovers (see the module docstring)."""
BALANCE_TURNOVERS = 4.0
"""The recency/frequency balance's shortest window, in pool turnovers: longer than the protection target's one
turnover because a change of the frequency exponent shows only once blocks have been re-used several times
(their counts), and because its two candidates differ by a few percent, which a short window reads as noise
(at one turnover, 20 of 80 one-class grid runs fell below lru). Four is the value it had before the
controller's window was shortened, kept; its sensitivity is in docs/results.md."""
ONE_CLASS_Z = 1.645
"""While every lookup has one retention priority, the recency/frequency balance leaves recency only on a lead of
frequency beyond this many standard errors of the candidates' paired difference (a one-sided test at 95%;
:mod:`kvretain.core.policies.balance`, "One class"; its sensitivity is in docs/results.md)."""
BALANCE_SAMPLE = 2048
"""Tracked blocks of the recency/frequency candidates' shadows (:mod:`kvretain.core.policies.balance`): they are
compared with each other on the same references, so a smaller sample than the controller's resolves them."""
_KEYS = 1 << 16
_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: spreads sequential int ids (trace hash ids) over the range


def spatial_key(block_hash: BlockHash) -> int:
    """A 16-bit value of a block's identity, uniform and the same in every process (SHARDS's hash): the block
    is sampled at rate ``R`` when it is below ``R * 2**16``. Digests use their first two bytes; ints are
    mixed."""
    if isinstance(block_hash, int):
        return ((block_hash * _MIX) >> 48) & 0xFFFF
    return block_hash[0] | (block_hash[1] << 8)


def _cut(num_blocks: int, sample: int) -> int:
    """Keys below this are sampled: ``min(1, sample / num_blocks)`` of them, at least one key in 2**16."""
    return max(1, min(_KEYS, math.ceil(_KEYS * sample / max(1, num_blocks))))


_SECOND = itemgetter(1)
_LOW64 = (1 << 64) - 1


class SpatialCut:
    """The blocks whose :func:`spatial_key` is below ``cut`` (see :func:`spatial_sample`)."""

    __slots__ = ("_lo", "_table", "cut", "int_limit")

    def __init__(self, cut: int) -> None:
        self.cut = cut
        # an int's key is below the cut when its mixed 64 low bits are below the cut's top 16 bits
        self.int_limit = cut << 48
        hi, self._lo = divmod(cut, 256)
        # by a digest's second byte: 1 below the cut's (sampled), 2 equal to it (the first byte decides), 0 above
        self._table = bytes(1 if b < hi else (2 if b == hi and self._lo else 0) for b in range(256))

    def digest_mask(self, second: bytes, hashes: Sequence[BlockHash]) -> bytes | bytearray:
        """One byte per digest of ``hashes`` (their second bytes are ``second``): 1 when it is sampled."""
        mask = second.translate(self._table)
        if 2 not in mask:
            return mask
        lo = self._lo
        fixed = bytearray(mask)
        i = fixed.find(2)
        while i >= 0:
            fixed[i] = 1 if hashes[i][0] < lo else 0  # type: ignore[index]
            i = fixed.find(2, i + 1)
        return fixed


def _second_bytes(hashes: Sequence[BlockHash], one_size: bool) -> bytes:
    """The second byte of each digest of ``hashes`` (all digests; see :func:`spatial_sample`)."""
    size = len(hashes[0])  # type: ignore[arg-type]
    if size >= 2:
        if one_size:
            joined = b"".join(hashes)  # type: ignore[arg-type]
            if len(joined) == size * len(hashes):
                return joined[1::size]
        elif list(map(len, hashes)).count(size) == len(hashes):  # type: ignore[arg-type]
            # NOTE: digests of one length (one hash function's, as an engine's are): their second bytes are
            # a strided slice of the concatenation (C calls only, no Python-level call per block)
            return b"".join(hashes)[1::size]  # type: ignore[arg-type]
    return bytes(map(_SECOND, hashes))  # type: ignore[arg-type]


def spatial_mask(
    hashes: Sequence[BlockHash], cut: SpatialCut | None, sub_cut: SpatialCut | None, one_size: bool = False
) -> tuple[Sequence[BlockHash], bytes | bytearray | None, list[BlockHash] | None]:
    """:func:`spatial_sample` before the lookup's hits are known: the sampled blocks, one byte per block of
    ``hashes`` (1: sampled; ``None`` when ``cut`` is ``None``: every block is) from which :func:`sampled_hits`
    counts the sampled hits of any lookup of these blocks, and the blocks below ``sub_cut``."""
    if cut is None:
        every, _, below = spatial_sample(hashes, 0, None, sub_cut, one_size)
        return every, None, below
    mask: bytes | bytearray
    try:
        if isinstance(hashes[0], int):
            lim = cut.int_limit
            mask = bytes([(h * _MIX) & _LOW64 < lim for h in hashes])  # type: ignore[operator]
        else:
            mask = cut.digest_mask(_second_bytes(hashes, one_size), hashes)
    except (TypeError, OverflowError):  # mixed identities (see spatial_sample)
        mask = bytes([spatial_key(h) < cut.cut for h in hashes])
    sampled = list(compress(hashes, mask))
    sub: list[BlockHash] | None = None
    if sub_cut is not None:  # (the finer cut's blocks are among the sampled ones: the same rule on fewer)
        sub = list(spatial_sample(sampled, 0, sub_cut, None, one_size)[0]) if sampled else []
    return sampled, mask, sub


def sampled_hits(mask: bytes | bytearray | None, num_blocks: int, num_hits: int) -> int:
    """How many sampled blocks (``mask`` of :func:`spatial_mask`) are among the first ``num_hits`` of a lookup of
    ``num_blocks``."""
    k = num_hits if num_hits > 0 else 0
    if mask is None:
        return k if k < num_blocks else num_blocks
    return mask.count(1, 0, k) if k else 0


def spatial_sample(
    hashes: Sequence[BlockHash],
    num_hits: int,
    cut: SpatialCut | None,
    sub_cut: SpatialCut | None,
    one_size: bool = False,
) -> tuple[Sequence[BlockHash], int, list[BlockHash] | None]:
    """The blocks of a lookup (``hashes``, the first ``num_hits`` hit) with a :func:`spatial_key` below ``cut``
    (``None``: all of them), in their order; how many of those hit; and those of them below ``sub_cut`` (``None``
    when not asked), the same as ``spatial_key`` block by block.

    ``one_size``: the caller guarantees that ``hashes`` are digests of one length when they are digests (one hash
    function's, as vLLM's ``Request.block_hashes``); the length of each is then not checked (the check is half
    of this function's cost on a long lookup), only their total.

    NOTE: the controller's hot path (every block of every request, at its arrival or, without one, inside vLLM's
    scheduler step; :func:`spatial_mask` shares it): for digests
    the second bytes are gathered and classified in C (a strided slice of the digests' concatenation when they
    have one length, else ``bytes(map(...))``; ``translate``, ``compress``) and only
    the blocks whose second byte equals a cut's (1 in 256) read their first byte; for ints the key test is
    one expression, no call. A list that mixes ints and digests takes ``spatial_key`` block by block.
    """
    k = num_hits if num_hits > 0 else 0
    if k > len(hashes):
        k = len(hashes)  # (a lookup hits at most its blocks: the arrival path's sampled_hits clamps alike)
    sampled: Sequence[BlockHash] = hashes
    hits = k
    sub: list[BlockHash] | None = None
    try:
        if isinstance(hashes[0], int):
            if cut is not None:
                lim = cut.int_limit
                picked = [h for h in hashes[:k] if (h * _MIX) & _LOW64 < lim]  # type: ignore[operator]
                hits = len(picked)
                picked += [h for h in hashes[k:] if (h * _MIX) & _LOW64 < lim]  # type: ignore[operator]
                sampled = picked
            if sub_cut is not None:
                lim = sub_cut.int_limit
                sub = [h for h in sampled if (h * _MIX) & _LOW64 < lim]  # type: ignore[operator]
        else:
            second = _second_bytes(hashes, one_size)
            if cut is not None:
                mask = cut.digest_mask(second, hashes)
                sampled = list(compress(hashes, mask))
                hits = mask.count(1, 0, k) if k else 0
            if sub_cut is not None:  # (a subset of the sampled blocks, in their order)
                sub = list(compress(hashes, sub_cut.digest_mask(second, hashes)))
    except (TypeError, OverflowError):  # mixed identities (an int times a digest is a repetition)
        keys = [spatial_key(h) for h in hashes]
        if cut is not None:
            sampled = [h for h, key in zip(hashes, keys, strict=True) if key < cut.cut]
            hits = sum(1 for key in keys[:k] if key < cut.cut)
        if sub_cut is not None:
            sub = [h for h, key in zip(hashes, keys, strict=True) if key < sub_cut.cut]
    return sampled, hits, sub


class Warmup:
    """The warm-up shadows (module docstring, "The start"): a plain LRU and a tiered shadow of ``tracked``
    blocks, and their hits: every request's under each (``e``, ``t``), protected traffic's (``lp``, ``tp``); with
    a recency/frequency balance, its frequency candidates at the same size (GreedyDual-Frequency at each of
    ``exponents``, use counts up to ``cap``, ghosts ``ghost_factor`` x ``tracked``) and theirs (``g``, ``gp``)."""

    __slots__ = ("e", "g", "gd", "gp", "lp", "lru", "t", "top", "tp")

    def __init__(
        self,
        tracked: int,
        budget: float,
        exponents: Sequence[float] = (),
        cap: int = 0,
        ghost_factor: float = 0.0,
    ) -> None:
        self.lru = LRUShadow(tracked)
        self.top = TieredShadow(tracked, budget * tracked)
        self.gd = [GDShadow(tracked, x, cap, int(ghost_factor * tracked)) for x in exponents]
        self.e = self.t = self.lp = self.tp = 0
        self.g = [0] * len(self.gd)
        self.gp = [0] * len(self.gd)

    def see(self, sampled: Sequence[BlockHash], protected: bool) -> None:
        """One request's sampled blocks, in every warm-up shadow."""
        e = self.lru.reference(sampled)
        t = self.top.reference(sampled, protected)
        self.e += e
        self.t += t
        if protected:
            self.lp += e
            self.tp += t
        g, gp = self.g, self.gp
        for k, sh in enumerate(self.gd):
            h = sh.reference(sampled)
            g[k] += h
            if protected:
                gp[k] += h

    def bottom_dominates(self) -> bool:
        """Whether no bias beats protection at its top: no fewer protected hits, and more hits in all."""
        return self.tp <= self.lp and self.t < self.e

    def recency_dominates(self) -> bool:
        """Whether plain LRU dominates the best frequency candidate: no fewer hits in all and for protected
        traffic, and more in one (False without candidates)."""
        if not self.gd:
            return False
        g = self.g
        best = max(range(len(g)), key=g.__getitem__)
        e, ep, f, fp = self.e, self.lp, g[best], self.gp[best]
        return e >= f and ep >= fp and (e > f or ep > fp)


class Sighting:
    """What the shadows saw of one request's blocks (:meth:`ProtectionController.on_arrival`): the number of
    blocks, which were sampled (``mask``, see :func:`spatial_mask`), whether the request was protected, and per
    shadow the sampled hits: the LRU shadow's, the isolated shadow's (0 unless protected and the controller has an
    isolation goal) and, on the balance's share of the sample (``balanced`` blocks), its recency and frequency
    candidates'."""

    __slots__ = (
        "balanced",
        "blocks",
        "e_hits",
        "g_hits",
        "iso_hits",
        "lru_hits",
        "mask",
        "n",
        "owner",
        "protected",
        "top_hits",
    )

    def __init__(
        self,
        blocks: int,
        mask: bytes | bytearray | None,
        protected: bool,
        n: int,
        lru_hits: int,
        iso_hits: int,
        balanced: int,
        e_hits: int = 0,
        g_hits: tuple[int, ...] = (),
    ) -> None:
        self.blocks = blocks
        self.mask = mask
        self.protected = protected
        self.n = n
        self.lru_hits = lru_hits
        self.iso_hits = iso_hits
        self.balanced = balanced
        self.e_hits = e_hits
        self.g_hits = g_hits
        self.top_hits = 0  # the tiered shadow's (protection at its top), for a protected request
        self.owner: object = None  # the controller whose shadows made it


class ProtectionController:
    """The protected target of ``unified``: see the module docstring.

    ``target`` is ``budget`` x pool when ``isolation_goal`` is None (a fixed share), else the controlled
    value, in blocks. ``on_lookup`` must be called once per request, at its first lookup (a resume after
    preemption is not new demand).
    """

    __slots__ = (
        "_acc",
        "_balance_cut",
        "_balance_refs",
        "_balance_share",
        "_balance_takes_lru",
        "_bias_step",
        "_cap",
        "_cut_at",
        "_floor_refs",
        "_gain",
        "_gain_floor",
        "_goal",
        "_held",
        "_iso",
        "_iso_is_lru",
        "_keep",
        "_lock",
        "_lookups",
        "_lru",
        "_margin",
        "_one_retention",
        "_pw",
        "_rate_cut",
        "_sighted",
        "_sub_cut",
        "_top",
        "_warmup",
        "balance",
        "binding",
        "frequency",
        "goal_met",
        "level",
        "max_target",
        "rate",
        "start",
        "target",
        "threshold",
        "weights",
    )

    def __init__(self, num_blocks: int, cfg: PolicyConfig) -> None:
        self._cap = cfg.frequency_cap
        self.threshold = cfg.protect_threshold
        self.max_target = cfg.budget * num_blocks
        self._goal = cfg.isolation_goal
        self._keep = 1.0 - cfg.max_reuse_loss
        self._margin = 1.0 - self._keep  # (as the floor computes it)
        self.level = 1.0
        self.target = self.max_target
        # retention weight of every priority 0..100 at the current level (full weights for lam >= 0)
        self._bias_step = BIAS_STEPS
        self.weights = retention_weights(cfg.priority_weight)
        self._pw = cfg.priority_weight
        self._rate_cut = cut = _cut(num_blocks, SHARDS_SAMPLE)
        self.rate = rate = cut / _KEYS
        tracked = max(1, round(rate * num_blocks))
        self._lru = LRUShadow(tracked)
        self._iso = LRUShadow(tracked)
        self._top = TieredShadow(tracked, cfg.budget * tracked)
        self._balance_cut = bcut = min(cut, _cut(num_blocks, BALANCE_SAMPLE))
        self._balance_share = bcut / cut  # of the controller's sampled references
        self.balance = (
            FrequencyBalance(
                max(1, round(bcut / _KEYS * num_blocks)),
                cfg.frequency_exponent,
                cfg.frequency_cap,
                cfg.ghost_factor,
                cfg.max_reuse_loss,
                ONE_CLASS_Z,
            )
            if cfg.adapt_frequency and cfg.frequency_exponent > 0.0
            else None
        )
        # the warm-up shadows, until the pool first evicts (None after, or without a goal); where they started the
        # level and the balance
        self._warmup: Warmup | None = (
            Warmup(
                max(1, round(WARMUP_SCALE * tracked)),
                cfg.budget,
                self.balance.exponents if self.balance is not None else (),
                cfg.frequency_cap,
                cfg.ghost_factor,
            )
            if self._goal is not None
            else None
        )
        self.start = 0.0  # (0: not chosen yet)
        # the spatial cuts of a lookup: the controller's (None: every block), the balance's finer one (None: the
        # same blocks, or no balance)
        self._cut_at = SpatialCut(cut) if cut < _KEYS else None
        self._sub_cut = SpatialCut(bcut) if bcut < cut and self.balance is not None else None
        # NOTE: speed, same figures. The isolated shadow sees the protected lookups, the LRU shadow every lookup:
        # while no lookup has been unprotected (one class) the two hold the same blocks in the same order, so the
        # isolated one starts as a copy of the LRU one at the first unprotected lookup. The balance's LRU
        # candidate sees the controller's sample at the controller's size when its cut is the controller's: it
        # takes the controller's LRU hits.
        self._iso_is_lru = True
        self._one_retention = -2  # the retention priority of every lookup so far (-2: none yet; -1: several)
        self._balance_takes_lru = bcut == cut
        # uses -> the frequency term of the value (the balance may move its exponent)
        self.frequency = (
            self.balance.table(cfg.frequency_cap) if self.balance is not None else frequency_terms(cfg)
        )
        self._floor_refs = WINDOW_TURNOVERS * tracked
        self._balance_refs = BALANCE_TURNOVERS * tracked
        tolerance = 1.0 - self._goal if self._goal is not None else 1.0
        self._gain = 1.0 / max(
            tolerance, cfg.max_reuse_loss, MIN_TOLERANCE
        )  # level per window at an error of 1
        self._gain_floor = 1.0 / max(
            cfg.max_reuse_loss, MIN_TOLERANCE
        )  # the same, at the floor's own tolerance
        # decayed sums: pool hits and LRU-shadow hits (all traffic); pool hits and isolated-shadow hits
        # (protected traffic); sampled references of each; LRU-shadow hits of protected traffic; the sum of
        # squared per-lookup differences between the pool's and the LRU shadow's hits (the paired noise)
        self._acc = [0.0] * 9
        self.binding = "none"
        self.goal_met = False
        self._lock = threading.Lock()  # (the shadows: on_arrival may run on an engine's input thread)
        self._lookups = 0  # first lookups the controller took; of them, with their arrival's sighting
        self._sighted = 0
        self._held = 0.0  # the most protected blocks the pool held at a lookup, decayed over the window

    def on_arrival(
        self, hashes: Sequence[BlockHash], retention: int, one_size: bool = False
    ) -> Sighting | None:
        """A request at ``retention`` whose blocks are ``hashes`` (its full blocks, prefix order) has arrived: its
        sampled blocks enter the shadow directories now, and :meth:`on_lookup` at its first lookup, given the
        returned :class:`Sighting`, only accounts for them. ``None`` when the controller has nothing to do.

        The shadows then see requests in the order their identities became known, not the order of their
        lookups: an engine that hashes a request's blocks when it takes the request in (vLLM: its input
        processing, on the engine core's input thread) can do the controller's per-block work there too. That
        thread shares the process (and Python's lock) with the scheduler's: the work overlaps the step only while
        the busy loop waits (on the model's forward pass); it leaves the step, not the CPU. Safe to call from
        another thread than :meth:`on_lookup`'s (the shadows are referenced under a lock)."""
        if not hashes or (self._goal is None and self.balance is None):
            return None
        sampled, mask, sub = spatial_mask(hashes, self._cut_at, self._sub_cut, one_size)
        return self._see(sampled, mask, len(hashes), sub, retention >= self.threshold)

    def on_lookup(
        self,
        hashes: Sequence[BlockHash],
        num_hits: int,
        retention: int,
        one_size: bool = False,
        seen: Sighting | None = None,
        protected_blocks: float | None = None,
    ) -> bool:
        """A request at ``retention`` looked up ``hashes`` (its full blocks, prefix order) and hit the first
        ``num_hits`` of them in the pool. Returns True when :attr:`weights` or :attr:`frequency` changed
        (callers that keep a reference to the lists take the new ones). ``one_size``: see :func:`spatial_sample`.
        ``seen``: what :meth:`on_arrival` returned for these blocks (their shadow references are then not made
        again); without it, or when it was for another number of blocks, the references are made now.
        ``protected_blocks``: the protected blocks the pool holds now, once it has evicted (None: not known; the
        level then falls through the target range the pool does not fill; module docstring)."""
        if not hashes or (self._goal is None and self.balance is None):
            return False
        self._lookups += 1
        if seen is not None and seen.owner is self and seen.blocks == len(hashes):
            self._sighted += 1
            protected = seen.protected
            hits = sampled_hits(seen.mask, seen.blocks, num_hits)
        else:  # (a sighting of other blocks: these are referenced now; its own references stay in the shadows)
            protected = retention >= self.threshold
            sampled, hits, sub = spatial_sample(hashes, num_hits, self._cut_at, self._sub_cut, one_size)
            seen = self._see(sampled, None, len(hashes), sub, protected)
        n = seen.n
        if not n:
            return False
        lru_hits = seen.lru_hits
        window, d = self._observe(n, hits, lru_hits)
        changed = False
        if self.balance is not None and self._balance_update(seen, n, window, d, retention, protected):
            self.frequency = self.balance.table(self._cap)
            changed = True
        if self._goal is None:
            return changed
        if protected:
            acc = self._acc
            acc[2] += hits
            acc[3] += seen.iso_hits
            acc[5] += n
            acc[6] += lru_hits
            acc[8] += seen.top_hits
        if protected_blocks is not None:
            held = self._held * d
            self._held = held = protected_blocks if protected_blocks > held else held
            if self._warmup is not None and self._start():
                changed = True
        else:
            held = None
        return self._steer(n, window, held) or changed

    def _start(self) -> bool:
        """The pool has evicted: the level, and the recency/frequency balance, start where the warm-up shadows
        say (module docstring, "The start"), and they are dropped. True when the weights or the frequency
        terms changed."""
        with self._lock:  # (on_arrival may be referencing them on another thread)
            warmup, self._warmup = self._warmup, None
        assert warmup is not None
        changed = False
        if warmup.bottom_dominates():
            self.start = -1.0
            changed = self._set_level(-1.0)
        else:
            self.start = 1.0
        b = self.balance
        if b is not None and warmup.recency_dominates() and b.start(1.0):
            self.frequency = b.table(self._cap)
            changed = True
        return changed

    def _see(
        self,
        sampled: Sequence[BlockHash],
        mask: bytes | bytearray | None,
        blocks: int,
        sub: Sequence[BlockHash] | None,
        protected: bool,
    ) -> Sighting:
        """Reference a request's ``sampled`` blocks (``sub``: the balance's share of them) in every shadow. The
        sighting names this controller: one built since (vLLM's ``reset_prefix_cache``) does not take it."""
        with self._lock:
            if not sampled:
                seen = Sighting(blocks, mask, protected, 0, 0, 0, 0, 0)
                seen.owner = self
                return seen
            if not protected and self._iso_is_lru:
                self._iso = self._lru.copy()
                self._top = TieredShadow.of(self._lru, self._top.protected_cap)
                self._iso_is_lru = False
            lru_hits = self._lru.reference(sampled)
            if self._warmup is not None:
                self._warmup.see(sampled, protected)
            iso_hits = top_hits = 0
            if self._goal is not None:
                if self._iso_is_lru:
                    iso_hits = top_hits = lru_hits  # (every lookup so far protected: all three alike)
                else:
                    top_hits = self._top.reference(sampled, protected)
                    if protected:
                        iso_hits = self._iso.reference(sampled)
            balanced = sampled if sub is None else sub
            e_hits = 0
            g_hits: tuple[int, ...] = ()
            if self.balance is not None and balanced:
                e_hits, g_hits = self.balance.see(balanced, lru_hits if self._balance_takes_lru else None)
            else:
                balanced = ()
            seen = Sighting(
                blocks, mask, protected, len(sampled), lru_hits, iso_hits, len(balanced), e_hits, g_hits
            )
            seen.top_hits = top_hits if protected else 0
            seen.owner = self
            return seen

    def _observe(self, n: int, hits: int, lru_hits: int) -> tuple[float, float]:
        """Decay the sums over ``n`` more sampled references and add all traffic's: the pool's ``hits``, the LRU
        shadow's ``lru_hits`` and their paired squared difference. Returns the window and its decay factor."""
        acc = self._acc
        # the window: the longer of the turnover floor and the references the paired difference needs
        window = self._floor_refs
        need = needed_refs(acc[4], acc[7], acc[0], acc[1], self._margin)
        if need > window:
            window = need
        d = math.exp(-n / window)
        for i in range(9):
            acc[i] *= d
        acc[0] += hits
        acc[1] += lru_hits
        acc[4] += n
        acc[7] += (hits - lru_hits) * (hits - lru_hits)
        return window, d

    def _balance_update(
        self, seen: Sighting, n: int, window: float, d: float, retention: int, protected: bool
    ) -> bool:
        """The recency/frequency balance takes its candidates' hits on its share of the sample (``seen``) over
        its own window: at least ``BALANCE_TURNOVERS`` turnovers. True when its exponent moved."""
        assert self.balance is not None
        bw = self._balance_refs if self._balance_refs > window else window
        bd = d if bw == window else math.exp(-n / bw)
        if self._one_retention != retention:  # (the first lookup sets it; a second retention ends it)
            self._one_retention = retention if self._one_retention == -2 else -1
        one = self._one_retention >= 0
        return bool(seen.balanced) and self.balance.update(
            seen.balanced, seen.e_hits, seen.g_hits, bd, bw * self._balance_share, protected, one
        )

    def _steer(self, n: int, window: float, held: float | None) -> bool:
        """The control law (module docstring): move the level by the binding constraint's error over ``n``
        more references of a ``window`` (``held``: the pool's protected blocks, decayed peak; None: not known); set
        the target and the retention weights from it. True when the weights changed."""
        acc = self._acc
        a, e, ap, ep, lp, tp = acc[0], acc[1], acc[2], acc[3], acc[6], acc[8]
        # the goal: isolation_goal of what protected traffic would hit alone, and never less than what plain
        # LRU gives it in the shared pool (protection must not leave it worse off than no protection at all)
        goal = self._goal
        assert goal is not None
        want = goal * ep
        if lp > want:
            want = lp
        # relative to the larger count, so that both errors lie in [-1, 1] (and a shadow that hits nothing
        # leaves full room, not a division by zero); the gap's count includes what it is a gap to (short of what
        # LRU gives protected traffic while it hits nothing alone is short, not beyond the goal)
        m = e if e > a else a
        slack = (a - self._keep * e) / m if m > 0.0 else 0.0
        mp = ep if ep > ap else ap
        if want > mp:
            mp = want
        gap = (want - ap) / mp if mp > 0.0 else -1.0
        if gap > 0.0:
            # short: towards the end of the actuator that gives protected traffic more, as long as it gives more
            # than the pool does now (the top: protection at its full level, the tiered shadow; the bottom: no
            # bias, plain LRU), else hold. Where the shadows cannot tell the ends apart (a cold pool; with
            # ``budget`` 0 the tiered shadow is plain LRU) the prior rule: rise, unless plain LRU gives every
            # request and protected traffic more
            if tp == lp:
                u = max((a - e) / m, (ap - lp) / lp) if a < e and ap < lp else gap
            elif tp > ap and tp > lp:
                u = gap  # (as far as the floor allows)
            elif lp > ap:
                u = (ap - lp) / lp
            else:
                u = 0.0
        else:  # beyond the goal: give back while protection costs reuse against LRU (excess or cost), else hold
            u = 0.0
            if a < e:
                cost = (a - e) / m
                u = gap if gap < cost else cost
        gain = self._gain
        # the floor (module docstring, the gains): its move at its own gain where that is the smaller; but while
        # the level moves the weights (below 0) and the pool is above the floor, the room left caps a rise as an
        # error at the rise's gain (a step of the weights re-keys the pool at once, and a rise at the floor's gain
        # overshot the floor by the turnover its cost takes to show)
        if slack < 0.0 or self.level >= 0.0:  # the floor's move at its own gain where it is the smaller
            floor = self._gain_floor * slack < gain * u
            if floor:
                u, gain = slack, self._gain_floor
        else:  # above it, moving the weights: the room left caps a rise, at the rise's own gain
            floor = slack < u
            if floor:
                u = slack
        # (nothing hit, in the pool or the shadow: no reuse to hold a floor on, nothing binds)
        self.binding = (
            "reuse" if m > 0.0 and (floor or slack <= 0.0) else ("isolation" if gap <= 0.0 else "none")
        )
        self.goal_met = gap <= 0.0 and acc[5] > 0.0  # (independent of which term moved the level)
        # confidence: the share of the needed window the sums hold (1 once the paired noise is below the margin)
        conf = confidence(acc[7], a, e, self._margin)
        lam = self.level
        if u < 0.0 and held is not None and lam > 0.0 and held < lam * self.max_target:
            # the target above what the protected blocks fill decides nothing: start the give-back there
            lam -= conf * (lam - held / self.max_target)
        lam += gain / window * conf * u * n
        return self._set_level(-1.0 if lam < -1.0 else (1.0 if lam > 1.0 else lam))

    def _set_level(self, lam: float) -> bool:
        """Put the level at ``lam`` (in [-1, 1]) and the target and the retention weights where it says (module
        docstring: what the level sets). True when the weights changed."""
        self.level = lam
        self.target = lam * self.max_target if lam > 0.0 else 0.0
        step = BIAS_STEPS if lam >= 0.0 else round(BIAS_STEPS * (1.0 + lam))
        if step == self._bias_step:
            return False
        self._bias_step = step
        self.weights = retention_weights(self._pw, step / BIAS_STEPS)
        return True

    def stats(self) -> dict[str, float]:
        """The controller's state: the target, both estimates (hit ratios over the window), whether the
        overall-reuse floor binds (``reuse_floor_binds`` 1: the floor's term moved the level last, or the pool is
        at or below its floor), whether protected traffic meets its goal (``isolation_goal_met`` 1: at or above
        it, 0: short, or no protected traffic yet; the two are reported apart: both may hold), the goal set
        (``isolation_goal``; 0: a fixed share, which neither constraint moves), the balance's frequency
        exponent (-1: no balance), whether its one-class rule still holds (``balance_one_class``), the level the
        warm-up chose at the pool's first eviction (``start_level``: 1 the top, -1 the bottom; 0 before it, or
        with a fixed share), the balance's recency share it started at (``balance_start``: 1 recency, 0.5
        the midpoint; -1 before it, without a balance or with a fixed share) and the share of first lookups whose
        shadows' work ran at the request's arrival (``lookups_seen_at_arrival``)."""
        acc = self._acc
        return {
            "protection_level": self.level,
            "protected_target": self.target,
            "protected_budget": self.max_target,
            "sample_rate": self.rate,
            "hit_ratio_window": acc[0] / acc[4] if acc[4] else 0.0,
            "lru_hit_ratio_estimate": acc[1] / acc[4] if acc[4] else 0.0,
            "protected_hit_ratio_window": acc[2] / acc[5] if acc[5] else 0.0,
            "isolated_hit_ratio_estimate": acc[3] / acc[5] if acc[5] else 0.0,
            "lru_protected_hit_ratio_estimate": acc[6] / acc[5] if acc[5] else 0.0,
            "top_protected_hit_ratio_estimate": acc[8] / acc[5] if acc[5] else 0.0,
            "reuse_floor_binds": 1.0 if self.binding == "reuse" else 0.0,
            "frequency_exponent_now": self.balance.alpha if self.balance is not None else -1.0,
            "balance_one_class": 1.0 if self.balance is not None and self.balance.one_class else 0.0,
            "isolation_goal_met": 1.0 if self.goal_met else 0.0,
            "isolation_goal": self._goal if self._goal is not None else 0.0,
            "start_level": self.start,
            "balance_start": self.balance.start_share if self.start and self.balance is not None else -1.0,
            "lookups_seen_at_arrival": self._sighted / self._lookups if self._lookups else 0.0,
        }
