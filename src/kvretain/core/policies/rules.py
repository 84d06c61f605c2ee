"""The rules of ``unified``, once: what a release does to a block's retention, what a block is worth, which tier
it is in and how finely keys are ordered. Used by :class:`~kvretain.core.policies.unified.UnifiedPolicy`
(per-block objects in kvretain's pool) and by the vLLM plugin's run queue
(:mod:`kvretain.integrations.vllm._runs`: compact arrays over vLLM's blocks); a differential test drives both
with the same events and compares their victims.

A block's retention state is four values: ``level`` (its effective retention priority now, ``UNSET`` for
content no release has touched), ``base`` (the highest *mapped* request priority of the requests that
released it: where a lapsed directive falls back), ``expiry`` (when the level falls back to ``base``; ``INF``:
never) and ``owner`` (the ``retention_scope`` that set the level). A release asks for a level (a directive,
or its request priority mapped by :class:`~kvretain.core.retention.PriorityMapping`) for ``duration_s``:

1. ``base`` rises to the request's mapped priority if that is higher (highest wins among users);
2. a lapsed directive is applied first: ``level = base`` (so an old directive is never refreshed after it
   ended: a 1 s directive must not pin a block because it was reused late);
3. a higher ask raises the level (anyone may raise); a lower ask lowers it only when the request's scope is
   the owner's (RFC #37003: only the owner may lower), or on content no release has touched (its first
   releaser is the only user it has had: a request may ask to keep what it computed *less* than its priority
   would, TensorRT-LLM's low decode priority for example; any later user's release raises it again); either
   way the ask's duration starts now and the asker's scope becomes the owner (``None`` for a request without
   a scope: then no scope may lower the level, since none set it). A raise by anyone but the owner that
   would end before the level it displaces, and lapse to a ``base`` below that level, is not applied: since a
   lapse falls to ``base``, not to the level it displaced, a brief raise (90 for 0 s over an owner's 80 with no
   expiry) would otherwise lower the owner's level when it lapsed, and take the ownership with it. The other
   way round, a level below ``base`` (a lowering directive) is due to rise to ``base`` at its expiry: a raise
   that stays below ``base`` (a user of lower priority reusing the block) rises to its ask but keeps that
   expiry, and a lower ask that is refused still ends the level at the ask's own end (the asker's mapped
   priority, above the level, takes over then); otherwise a reuse would cancel the rise and leave the block
   below its users' highest mapped priority for good;
4. an equal ask with a later end refreshes the expiry (reuse at the same priority restarts its duration) of a
   level above ``base``; a level below ``base`` is extended only by its owner's directive (another user's
   reuse must not keep it low longer);
5. a level away from ``base`` with a finite expiry lapses back to ``base`` at the expiry, up or down;
6. a *plain* release (the request's own mapped priority, no duration: a block no directive covers) only
   raises: it never lowers a level, not even its own scope's (a later, less important request of a scope does
   not undo the scope's directive, nor pull the block below the priority of the requests that used it; to
   lower, a scope sends a directive). A directive at exactly the request's mapped priority with no duration is
   the same release and reads as plain.

NOTE: highest-wins (not TensorRT-LLM's last-writer-wins) keeps a prefix shared by important and unimportant
traffic from being downgraded by whoever touched it last.
"""

from __future__ import annotations

from collections.abc import Callable

from kvretain.core.policy import INF, PolicyConfig
from kvretain.core.retention import DEFAULT_RETENTION_PRIORITY, MAX_RETENTION_PRIORITY

UNSET = -1
"""``level`` / ``base`` of content that no release has touched yet."""
HALF_USE = 0.5
"""What a block that was never used is worth in the frequency term (less than one use; never 0, which would make
its key equal to the aging floor ``L`` and tie it with the next victim)."""


def release(
    level: int,
    base: int,
    expiry: float,
    owner: str | None,
    ask: int,
    duration_s: float | None,
    scope: str | None,
    now: float,
    mapped: int,
) -> tuple[int, int, float, str | None]:
    """The retention state ``(level, base, expiry, owner)`` after one release asking for ``ask`` (see the
    module docstring). ``mapped`` is the releasing request's mapped priority."""
    if mapped > base:
        base = mapped
    if level == UNSET:
        cur = base
    elif expiry <= now:
        cur = base
        expiry = INF
    else:
        cur = level
    end = INF if duration_s is None else now + duration_s
    owns = scope is not None and scope == owner
    plain = ask == mapped and duration_s is None  # the request's own priority, no directive (rule 6)
    if ask > cur and end < expiry and base < cur and not owns:
        pass  # a raise that would lapse below the level it displaces before that level ends: kept (rule 3)
    elif ask > cur or (ask < cur and (level == UNSET or owns) and not plain):
        if ask < base and end > expiry and (plain or not owns):
            end = expiry  # a raise still below the fallback keeps the lapse it displaces (rule 3)
        cur = ask
        expiry = end
        owner = scope  # the scope that set the level (None included: an unscoped raise leaves no owner)
    elif ask == cur and end > expiry and (cur > base or (owns and not plain)):
        expiry = end
    elif ask < cur < mapped and end < expiry:
        expiry = end  # a refused lower ask still falls back at its end, above the level it left (rule 3)
    if cur == base:
        expiry = INF  # nothing to fall back from
    return cur, base, expiry, owner


def lapses(level: int, base: int, expiry: float) -> bool:
    """Whether the state has a pending lapse (an expiry to schedule)."""
    return expiry != INF and level != base


LAPSE_SLACK = 64
"""Stale entries a heap of scheduled lapses may hold beyond twice its live ones (see :func:`lapse_limit`)."""


def lapse_limit(kept: int) -> int:
    """How many entries a heap of scheduled lapses may grow to before it is compacted, after a compaction kept
    ``kept`` live ones (whose block's pending expiry is still the entry's time).

    NOTE: an entry goes stale when a later release moves its block's expiry, or the block is evicted, but is
    dropped only when its time comes: with durations of days the heap grew with the releases, not the pool.
    Compacting when it doubles (plus :data:`LAPSE_SLACK`) keeps it within about twice the pool, costs amortized
    O(1) per entry, and drops only entries that would lapse nothing: decisions are unchanged."""
    return 2 * kept + LAPSE_SLACK


def effective(level: int, base: int, expiry: float, now: float) -> int:
    """The block's retention priority at ``now`` (lapse applied; ``UNSET`` content counts at the default)."""
    if level == UNSET:
        return DEFAULT_RETENTION_PRIORITY if base == UNSET else base
    if expiry <= now:
        return base
    return level


def retention_weights(priority_weight: float, scale: float = 1.0) -> list[float]:
    """The retention weight of every priority 0..100: ``priority_weight ** ((r - 35) / 10 * scale)`` (``scale``
    below 1 softens it: the protection controller's level below 0)."""
    return [
        priority_weight ** ((r - DEFAULT_RETENTION_PRIORITY) / 10.0 * scale)
        for r in range(MAX_RETENTION_PRIORITY + 1)
    ]


def frequency_terms(cfg: PolicyConfig) -> list[float]:
    """``uses ** frequency_exponent`` for uses 0..frequency_cap (0 uses count as ``HALF_USE``)."""
    e = cfg.frequency_exponent
    return [HALF_USE if u == 0 else float(u) ** e for u in range(cfg.frequency_cap + 1)]


def cost_per_block(cfg: PolicyConfig) -> float:
    """The recompute-cost term per block of depth (``block_size / cost_scale_tokens``; 0 when disabled)."""
    scale = cfg.cost_scale_tokens
    return (cfg.block_size / scale) if scale > 0 else 0.0


def value(weight: float, frequency: float, depth: int, cost: float) -> float:
    """What a block is worth: ``weight[r] * frequency[uses] * (1 + depth * cost)`` (GreedyDual's value; the
    key is ``L + value``)."""
    return weight * frequency * (1.0 + depth * cost)


def gd_key(since: float, weight: float, frequency: float, depth: int, cost: float) -> float:
    """A block's GreedyDual key: the aging floor ``L`` when it was released (``since``) plus its :func:`value`.

    NOTE: the key is set at a release from the tables of that moment (retention weights, the frequency term);
    when the tables change (the protection level softens or restores the weights, the recency/frequency balance
    moves the exponent) every cached block is keyed again from its ``since`` with the new tables. Keys set under
    other tables are not comparable: a block released at exponent 4 with 64 uses is worth 64 ** 4 = 16.7M
    one-off blocks, so after a fall to exponent 1 it would outlive every block released since for ~16.7M
    turnovers (an accidental pin). Measured on the held-out ``template-drift`` traffic (session 24), whose
    retired prompt templates were pinned that way: unified 0.959x lru overall at 906 blocks before, 1.03x with
    the keys set again (docs/history.md)."""
    return since + weight * frequency * (1.0 + depth * cost)


RELEASE_ORDER_WALK = 64
"""Within a key bucket both storages keep blocks (runs) in release order, as LRU orders blocks of one key, and the
tiers compete on (bucket, release order): the order one queue of both tiers would have, so that with flat
weights, recency and no protected share ``unified`` evicts exactly what ``lru`` evicts. A block is queued at its
release (the newest: the back) or as a parent exposed by its child's eviction (released with the child, right
after it: its bucket's first), O(1) both; a parent released alone later, a lapse or a tier change is placed by a
walk from the back of its bucket of at most this many links, so a push stays O(1) (beyond it, it goes there: a
little behind its place, kept a little longer than its release order says). Not a policy setting: a bound on
the work of one push (one release of a 64-block prompt costs as much). Measured walks (session 25): 1,111 on
a multi-tenant trace at 5,384 blocks, 1,735 on Mooncake at 32,000 (of millions of pushes), p99 400-730 links;
at 16 the multi-tenant replay in that setting is 0.9999x lru's hits, from 64 on 1.0000x."""


def release_order_place(n: int, stamp: int, stamp_at: Callable[[int], int]) -> int:
    """Where an entry released at ``stamp`` goes among ``n`` entries of a bucket in release order (``stamp_at(i)``:
    the i-th one's stamp): the back, the front, or found by a walk from the back of at most
    :data:`RELEASE_ORDER_WALK` entries (beyond it: there). The pool's linked buckets walk the same way."""
    if n == 0 or stamp_at(n - 1) < stamp:
        return n
    if stamp_at(0) > stamp:
        return 0
    i = n - 1
    for _ in range(RELEASE_ORDER_WALK):
        i -= 1
        if i < 0 or stamp_at(i) < stamp:
            break
    return i + 1


def protected(level: int, threshold: int) -> bool:
    """Blocks at or above ``protect_threshold`` are in the protected tier."""
    return level >= threshold


def buckets_per_key(cfg: PolicyConfig) -> float:
    """How many key buckets one unit of GreedyDual key holds: a bucket is half the smallest difference between
    two values of one block that differ by one use, at the lowest retention weight and cost 1, so two such values
    released at the same ``L`` never share a bucket, at any ``priority_weight`` or ``frequency_exponent``
    (blocks in one bucket leave in FIFO order: the order error is below one bucket, a relative error of at most
    half a use's difference at the lowest priority). The controller only softens weights towards 1, which
    widens the differences, so the bound holds at every protection level."""
    freq = frequency_terms(cfg)
    steps = [b - a for a, b in zip(freq, freq[1:], strict=False) if b > a]
    step = min(steps) if steps else HALF_USE
    low = min(retention_weights(cfg.priority_weight))
    low = min(low, 1.0)
    return 2.0 / (low * step)
