"""Shadow directories: block identities kept in a policy's order without their data, to tell what that policy
would hit on the same references (SHARDS-style estimates, :mod:`kvretain.core.policies.protection`). ``LRUShadow``
is stock LRU (vLLM's order); ``GDShadow`` is GreedyDual-Frequency (the frequency candidate of
:mod:`kvretain.core.policies.balance`).

NOTE: both run on every sampled block of every request (the controller's hot path: at its arrival, on vLLM's
input thread, or inside the scheduler's step when nothing arrived first): their per-block work is done by C-level iterators (``map``, ``filterfalse``) over the dict's own
methods where the order of operations allows it, with the same result as one Python loop per block
(``tests/test_shadow.py`` compares them with straightforward reference implementations).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from itertools import filterfalse, repeat

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
            while len(entries) > self.capacity:
                entries.popitem(last=False)
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


class GDShadow:
    """A directory of block identities under GreedyDual-Frequency: key ``L + uses ** exponent``, ``L`` the key
    of the last victim; ``capacity`` entries, use counts of evicted ones remembered (``ghost`` entries). The
    victim is the entry of least key, the least recently used among equal keys.

    NOTE: the queue is a bucket per distinct key (FIFO, so in use order) and a heap of the keys, not one heap
    entry per use: the live keys lie in ``[L, L + cap ** exponent]``, a few dozen distinct values at integer
    exponents, so a use costs a deque append instead of a push through a heap of every entry. A use of a
    resident block leaves its earlier queue entry behind (skipped when it comes up; dropped in bulk when such
    entries outnumber the live ones).
    """

    __slots__ = (
        "L",
        "_buckets",
        "_ghost",
        "_keys",
        "_next",
        "_serial",
        "_stale",
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
        self.entries: dict[BlockHash, tuple[int, int]] = {}  # hash -> (uses, serial)
        self._buckets: dict[float, deque[tuple[int, BlockHash]]] = {}  # key -> (serial, hash), oldest first
        self._keys: list[float] = []  # heap of the buckets' keys
        self._serial = 0
        self._stale = 0  # queue entries of blocks used again since
        self._ghost = GhostTable(ghost)
        self.L = 0.0

    def reference(self, sampled: Sequence[BlockHash]) -> int:
        """Look up ``sampled`` (prefix order), count those resident, then use them, deepest first."""
        entries = self.entries
        hits = sum(map(entries.__contains__, sampled))
        buckets = self._buckets
        bucket = buckets.get
        keys = self._keys
        get = entries.get
        nxt = self._next
        terms = self._terms
        L = self.L
        serial = self._serial
        take = self._ghost.take_or if self._ghost.capacity else None  # (an empty table remembers nothing)
        before = len(entries)
        for h in reversed(sampled):
            got = get(h)
            if got is not None:
                uses = nxt[got[0]]
            elif take is not None:
                uses = nxt[take(h, 0)]
            else:
                uses = 1
            key = L + terms[uses]
            serial += 1
            entries[h] = (uses, serial)
            q = bucket(key)
            if q is None:
                buckets[key] = q = deque()
                heapq.heappush(keys, key)
            q.append((serial, h))
        # a use of a resident block leaves its earlier queue entry behind: every use that inserted nothing
        self._stale += len(sampled) - (len(entries) - before)
        self._serial = serial
        if len(entries) > self.capacity:
            self._evict()
        if self._stale > 4 * self.capacity + 64:
            self._compact()
        return hits

    def _evict(self) -> None:
        entries = self.entries
        capacity = self.capacity
        buckets = self._buckets
        keys = self._keys
        ghost = self._ghost
        gcap = ghost.capacity
        if gcap:
            ring = ghost.ring
            table = ghost.table
            drop = table.pop
            pos = ghost.pos
        L = self.L
        stale = self._stale
        key = keys[0]
        q = buckets[key]
        pop = q.popleft
        while len(entries) > capacity:
            while not q:
                del buckets[key]
                heapq.heappop(keys)
                key = keys[0]
                q = buckets[key]
                pop = q.popleft
            serial, h = pop()
            got = entries.get(h)
            if got is None or got[1] != serial:
                stale -= 1  # (the block was used again since)
                continue
            del entries[h]
            if gcap:  # (GhostTable.put, inlined: once per eviction)
                old = ring[pos]
                if old is not None:
                    drop(old, None)
                ring[pos] = h
                table[h] = got[0]
                pos += 1
                if pos == gcap:
                    pos = 0
            if key > L:
                L = key
        if gcap:
            ghost.pos = pos
        if not q:
            del buckets[key]
            heapq.heappop(keys)
        self.L = L
        self._stale = stale

    def _compact(self) -> None:
        entries = self.entries
        kept: dict[float, deque[tuple[int, BlockHash]]] = {}
        for key, q in self._buckets.items():
            live = deque(e for e in q if (got := entries.get(e[1])) is not None and got[1] == e[0])
            if live:
                kept[key] = live
        self._buckets = kept
        self._keys = sorted(kept)
        self._stale = 0
