"""Shadow directories: block identities kept in a policy's order without their data, to tell what that policy
would hit on the same references (SHARDS-style estimates, :mod:`kvretain.core.policies.protection`). ``LRUShadow``
is stock LRU (vLLM's order); ``TieredShadow`` is LRU with a protected tier (``unified`` at its full protection
level, flat weights, recency); ``GDShadow`` is GreedyDual-Frequency (the frequency candidate of
:mod:`kvretain.core.policies.balance`).

NOTE: both run on every sampled block of every request (the controller's hot path: at its arrival, on vLLM's
input thread, or inside the scheduler's step when nothing arrived first): their per-block work is done by C-level iterators (``map``, ``filterfalse``) over the dict's own
methods where the order of operations allows it, with the same result as one Python loop per block
(``tests/test_shadow.py`` compares them with straightforward reference implementations).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from itertools import compress, filterfalse, islice, repeat, takewhile

from kvretain.core.hashing import BlockHash
from kvretain.core.policies.lfu import GhostTable

_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend
"""Run an iterator for its side effects, in C."""


SHORT = 32
"""Lookups of up to this many tracked blocks take a plain loop per block (measured: below ~30 blocks setting up
the C-level iterators costs more than the loop)."""


class LRUShadow:
    """A directory of block identities in LRU order, ``capacity`` entries (no data: a shadow of a cache)."""

    __slots__ = ("capacity", "entries")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.entries: OrderedDict[BlockHash, None] = OrderedDict()

    def copy(self) -> LRUShadow:
        """A shadow of the same capacity holding the same blocks in the same order."""
        out = LRUShadow(self.capacity)
        out.entries = OrderedDict(self.entries)
        return out

    def reference(self, sampled: Sequence[BlockHash]) -> int:
        """Look up ``sampled`` (one request's tracked blocks, in prefix order), count those resident, then
        make them the most recent, deepest first (a request's blocks are released deepest first, so its
        prefix stays behind its tail in LRU order), and drop the least recent beyond ``capacity``."""
        entries = self.entries
        if len(sampled) <= SHORT:
            hits = 0
            for h in sampled:
                if h in entries:
                    hits += 1
            move = entries.move_to_end
            for h in reversed(sampled):
                if h in entries:
                    move(h)
                else:
                    entries[h] = None
            extra = len(entries) - self.capacity
            if extra == 1:
                entries.popitem(False)
            elif extra > 1:  # (in C: a Python loop per dropped block cost more from two of them)
                _consume(map(entries.popitem, repeat(False, extra)))
            return hits
        rev = sampled[::-1]
        # NOTE: "the absent ones join at the end, then every one moves to the end, deepest first" leaves the
        # same order as the loop above, which moves or inserts each in turn (a repeated identity ends where it
        # was last used either way), and the absent ones counted before any change are the misses
        absent = list(filterfalse(entries.__contains__, rev))
        if absent:
            entries.update(zip(absent, repeat(None)))
        _consume(map(entries.move_to_end, rev))
        extra = len(entries) - self.capacity
        if extra > 0:
            _consume(map(entries.popitem, repeat(False, extra)))
        return len(sampled) - len(absent)


class TieredShadow:
    """A directory of block identities in two LRU tiers, ``capacity`` entries: a block a protected request has
    referenced is protected until it leaves (the highest retention wins). Unprotected blocks leave first, least
    recent first, while the protected ones number at most ``protected_cap``; above it the two tiers compete on
    recency (the least recent of both leaves). This is the order of ``unified`` at its full protection level with
    flat weights and recency, block by block (without its rule that a block never goes before its cached
    descendants): what protected traffic would hit with protection at its top
    (:mod:`kvretain.core.policies.protection`)."""

    __slots__ = ("_clock", "capacity", "protected", "protected_cap", "unprotected")

    def __init__(self, capacity: int, protected_cap: float) -> None:
        self.capacity = max(1, capacity)
        self.protected_cap = protected_cap
        # hash -> the stamp of its last use, least recent first
        self.protected: OrderedDict[BlockHash, int] = OrderedDict()
        self.unprotected: OrderedDict[BlockHash, int] = OrderedDict()
        self._clock = 0

    @classmethod
    def of(cls, lru: LRUShadow, protected_cap: float) -> TieredShadow:
        """The tiered shadow of references that have all been protected (``lru`` saw them): the same blocks in
        the same order, every one protected."""
        out = cls(lru.capacity, protected_cap)
        out.protected = OrderedDict(zip(lru.entries, range(len(lru.entries)), strict=True))
        out._clock = len(lru.entries)
        return out

    def reference(self, sampled: Sequence[BlockHash], protected: bool) -> int:
        """Look up ``sampled`` (a request's tracked blocks, prefix order), count those resident, then make them
        the most recent of their tier, deepest first (as :meth:`LRUShadow.reference`): a protected request's
        blocks move to the protected tier, an unprotected request's stay in the tier they are in. Evicts beyond
        ``capacity``.

        NOTE: C-level iterators as in :meth:`LRUShadow.reference`: each block's stamp is its place in the
        request's deepest-first order (``update`` keeps a repeated identity's last, ``move_to_end`` in that order
        leaves it where it was last used), the same as one loop that moves or inserts each block in turn."""
        prot = self.protected
        unprot = self.unprotected
        hits = sum(map(prot.__contains__, sampled)) + sum(map(unprot.__contains__, sampled))
        rev = sampled[::-1]
        t = self._clock
        stamps = range(t + 1, t + 1 + len(rev))
        self._clock = t + len(rev)
        if protected:
            _consume(map(unprot.pop, rev, repeat(None)))
            prot.update(zip(rev, stamps, strict=True))
            _consume(map(prot.move_to_end, rev))
        else:
            # (no block changes tier during an unprotected request: which tier each is in is known up front)
            mask = bytes(map(prot.__contains__, rev))
            rest: Sequence[BlockHash]
            if 1 in mask:
                kept = list(compress(rev, mask))
                prot.update(zip(kept, compress(stamps, mask), strict=True))
                _consume(map(prot.move_to_end, kept))
                mask = mask.translate(_FLIP)
                rest = list(compress(rev, mask))
                unprot.update(zip(rest, compress(stamps, mask), strict=True))
            else:
                rest = rev
                unprot.update(zip(rest, stamps, strict=True))
            _consume(map(unprot.move_to_end, rest))
        extra = len(prot) + len(unprot) - self.capacity
        cap = self.protected_cap
        while extra > 0:
            over = len(prot) - cap
            if over > 0.0 and unprot:
                # above the cap the tiers compete on recency: the least recent leaves, taken in runs (the blocks of
                # one tier older than the other's least recent, the protected ones down to the cap at most)
                hp = next(iter(prot.values()))
                hu = next(iter(unprot.values()))
                if hp < hu:
                    k = math.ceil(over)
                    n = len(list(takewhile(hu.__gt__, islice(prot.values(), k if k < extra else extra))))
                    _consume(map(prot.popitem, repeat(False, n)))
                else:
                    n = len(list(takewhile(hp.__gt__, islice(unprot.values(), extra))))
                    _consume(map(unprot.popitem, repeat(False, n)))
                extra -= n
            elif over > 0.0:
                _consume(map(prot.popitem, repeat(False, extra)))
                extra = 0
            else:  # unprotected first
                k = extra if extra < len(unprot) else len(unprot)
                _consume(map(unprot.popitem, repeat(False, k)))
                _consume(map(prot.popitem, repeat(False, extra - k)))
                extra = 0
        return hits


_FLIP = bytes([1, 0]) + bytes(254)
"""``bytes.translate`` table swapping the bytes 0 and 1 (a mask's complement)."""


class GDShadow:
    """A directory of block identities under GreedyDual-Frequency: key ``L + uses ** exponent``, ``L`` the key
    of the last victim; ``capacity`` entries, use counts of evicted ones remembered (``ghost`` entries). The
    victim is the entry of least key, the least recently used among equal keys.

    ``entries`` maps each resident block to its bucket (the queue of its key), and the bucket to its use count:
    ``entries[h][h]``.

    NOTE: the queue is a bucket per distinct key and a heap of the keys, not one heap entry per use: the live
    keys lie in ``[L, L + cap ** exponent]``, a few dozen distinct values per value of ``L`` at integer exponents
    (a few hundred buckets live), so a use costs a dict insertion instead of a push through a heap of every
    entry. A bucket is an insertion-ordered dict (``hash -> uses``), so in use order, and a use of a resident
    block moves it out of its bucket (``pop``) into the new one: no stale queue entries, and the victims of one
    eviction are the first ones of the least bucket, taken with C-level iterators (``islice``, ``map``), with
    their ghost entries written in bulk (:func:`_remember`). Blocks used for the first time (most of a small
    pool's traffic) all go to the one bucket of ``L + 1``, looked up once per lookup.
    """

    __slots__ = (
        "L",
        "_buckets",
        "_fresh",
        "_ghost",
        "_keys",
        "_next",
        "_terms",
        "cap",
        "capacity",
        "entries",
    )

    def __init__(self, capacity: int, exponent: float, cap: int, ghost: int) -> None:
        self.capacity = max(1, capacity)
        self.cap = cap
        self._terms = [float(u) ** exponent for u in range(cap + 1)]  # uses -> uses ** exponent
        self._next = [u + 1 if u < cap else cap for u in range(cap + 1)]  # uses -> after one more, capped
        self.entries: dict[BlockHash, dict[BlockHash, int]] = {}  # hash -> its bucket (hash -> uses)
        self._buckets: dict[float, dict[BlockHash, int]] = {}  # key -> (hash -> uses), oldest use first
        self._keys: list[float] = []  # heap of the buckets' keys
        self._ghost = GhostTable(ghost)
        # the uses of a block the ghost table does not remember (``_next[0]`` but for a table that remembers
        # nothing, whose first use is 1 even at ``cap`` 0)
        self._fresh = self._next[0] if self._ghost.capacity else 1
        self.L = 0.0

    def reference(self, sampled: Sequence[BlockHash]) -> int:
        """Look up ``sampled`` (prefix order), count those resident, then use them, deepest first."""
        entries = self.entries
        hits = sum(map(entries.__contains__, sampled))
        buckets = self._buckets
        bucket = buckets.get
        get = entries.get
        nxt = self._next
        terms = self._terms
        L = self.L
        take = self._ghost.take_or if self._ghost.capacity else None  # (an empty table remembers nothing)
        fresh = self._fresh
        fresh_q: dict[BlockHash, int] | None = None  # the bucket of ``fresh`` uses, once one is used
        for h in reversed(sampled):
            q = get(h)
            if q is not None:
                uses = nxt[q.pop(h)]
            elif take is not None and (uses := take(h, 0)):
                uses = nxt[uses]
            else:
                # NOTE: a block neither resident nor remembered (most of them in a small pool): its bucket is
                # the same for the whole lookup (``L`` moves only at evictions, after the loop)
                if fresh_q is None:
                    fresh_q = self._bucket(L + terms[fresh])
                fresh_q[h] = fresh
                entries[h] = fresh_q
                continue
            key = L + terms[uses]
            q = bucket(key)
            if q is None:
                q = self._bucket(key)
            q[h] = uses
            entries[h] = q
        if len(entries) > self.capacity:
            self._evict()
        if len(self._keys) > 2 * len(entries) + 64:
            self._drop_empty()
        return hits

    def _drop_empty(self) -> None:
        """Forget the buckets every block has left (and their heap keys).

        NOTE: a bucket emptied by uses stays until its key reaches the top of the heap, which for a key far
        above ``L`` (a block at its capped use count, used again as ``L`` climbs: a new key each time) can take
        as many lookups as ``cap ** exponent`` is large; a long-running server would keep them all. Dropped
        once the keys outnumber twice the entries (at most one non-empty bucket per entry), so the work is
        amortized over at least as many bucket creations as there are entries."""
        self._buckets = {key: q for key, q in self._buckets.items() if q}
        self._keys = sorted(self._buckets)  # (a sorted list is a heap)

    def _bucket(self, key: float) -> dict[BlockHash, int]:
        """The bucket of ``key``, made (and its key pushed on the heap) if there is none."""
        q = self._buckets.get(key)
        if q is None:
            self._buckets[key] = q = {}
            heapq.heappush(self._keys, key)
        return q

    def _evict(self) -> None:
        entries = self.entries
        extra = len(entries) - self.capacity
        buckets = self._buckets
        keys = self._keys
        ghost = self._ghost
        L = self.L
        while extra > 0:
            key = keys[0]
            q = buckets[key]
            if len(q) <= extra:  # the whole bucket goes (or it was emptied by uses since)
                del buckets[key]
                heapq.heappop(keys)
                if not q:
                    continue
                victims = list(q)
                uses = list(q.values())
            else:  # its oldest ``extra``
                victims = list(islice(q, extra))
                uses = list(map(q.pop, victims))
            extra -= len(victims)
            if ghost.capacity:
                _remember(ghost, entries, victims, uses)  # (before they leave ``entries``: see there)
            _consume(map(entries.__delitem__, victims))
            if key > L:
                L = key
        self.L = L


def _remember(
    ghost: GhostTable,
    entries: dict[BlockHash, dict[BlockHash, int]],
    victims: list[BlockHash],
    uses: list[int],
) -> None:
    """``ghost.put(h, u)`` for each victim in turn (``victims`` still in ``entries``).

    NOTE: done in bulk (drop the ring's old hashes from the table, overwrite them, add the victims) when that
    leaves what the puts one by one would: unless a victim is one of the old hashes overwritten after its own
    put (it would then be dropped again). An old hash can be a victim only if it is resident: that check first
    (one lookup each), the exact one only when it fails; the rare rest (the ring wrapping inside the batch, a
    victim among the old hashes) goes one by one.
    """
    pos = ghost.pos
    end = pos + len(victims)
    if end <= ghost.capacity:
        ring = ghost.ring
        olds = ring[pos:end]
        if not any(map(entries.__contains__, olds)) or set(olds).isdisjoint(victims):
            table = ghost.table
            # (the ring's empty slots hold None, never a key: nothing to drop)
            _consume(map(table.pop, olds, repeat(None)))  # type: ignore[arg-type]
            ring[pos:end] = victims
            table.update(zip(victims, uses, strict=True))
            ghost.pos = 0 if end == ghost.capacity else end
            return
    _consume(map(ghost.put, victims, uses))
