"""Shadow directories: block identities kept in a policy's order without their data, to tell what that policy
would hit on the same references (SHARDS-style estimates, :mod:`kvretain.core.policies.protection`). ``LRUShadow``
is stock LRU (vLLM's order); ``GDShadow`` is GreedyDual-Frequency (the frequency candidate of
:mod:`kvretain.core.policies.balance`).

NOTE: both run on every sampled block of every lookup (the controller's hot path, inside vLLM's scheduler
step): their per-block work is done by C-level iterators (``map``, ``filterfalse``) over the dict's own
methods where the order of operations allows it, with the same result as one Python loop per block
(``tests/test_shadow.py`` compares them with straightforward reference implementations).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import filterfalse, repeat

from kvretain.core.hashing import BlockHash
from kvretain.core.policies.lfu import GhostTable

_consume = deque(maxlen=0).extend
"""Run an iterator for its side effects, in C."""


class LRUShadow:
    """A directory of block identities in LRU order, ``capacity`` entries (no data: a shadow of a cache)."""

    __slots__ = ("capacity", "entries")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.entries: OrderedDict[BlockHash, None] = OrderedDict()

    def reference(self, sampled: Sequence[BlockHash]) -> int:
        """Look up ``sampled`` (one request's tracked blocks, in prefix order), count those resident, then
        make them the most recent, deepest first (a request's blocks are released deepest first, so its
        prefix stays behind its tail in LRU order), and drop the least recent beyond ``capacity``."""
        entries = self.entries
        rev = sampled[::-1]
        # NOTE: "the absent ones join at the end, then every one moves to the end, deepest first" leaves the
        # same order as one pass that moves or inserts each in turn (a repeated identity ends where it was
        # last used either way), and the absent ones counted before any change are the misses
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
    of the last victim; ``capacity`` entries, use counts of evicted ones remembered (``ghost`` entries)."""

    __slots__ = ("L", "_ghost", "_heap", "_serial", "_terms", "cap", "capacity", "entries")

    def __init__(self, capacity: int, exponent: float, cap: int, ghost: int) -> None:
        self.capacity = max(1, capacity)
        self.cap = cap
        self._terms = [float(u) ** exponent for u in range(cap + 1)]  # uses -> uses ** exponent
        self.entries: dict[BlockHash, tuple[float, int, int]] = {}  # hash -> (key, uses, serial)
        self._heap: list[tuple[float, int, BlockHash]] = []
        self._serial = 0
        self._ghost = GhostTable(ghost)
        self.L = 0.0

    def reference(self, sampled: Sequence[BlockHash]) -> int:
        """Look up ``sampled`` (prefix order), count those resident, then use them, deepest first."""
        entries = self.entries
        hits = sum(map(entries.__contains__, sampled))
        heap = self._heap
        push = heapq.heappush
        get = entries.get
        cap = self.cap
        terms = self._terms
        L = self.L
        serial = self._serial
        ghost = self._ghost
        take = ghost.take if ghost.capacity else None  # (an empty table remembers nothing)
        for h in reversed(sampled):
            got = get(h)
            if got is not None:
                uses = got[1] + 1
            elif take is not None:
                uses = take(h) + 1
            else:
                uses = 1
            if uses > cap:
                uses = cap
            key = L + terms[uses]
            serial += 1
            entries[h] = (key, uses, serial)
            push(heap, (key, serial, h))  # ties: the older first
        self._serial = serial
        if len(entries) > self.capacity:
            self._evict(heap)
        if len(heap) > 4 * self.capacity + 64:  # drop stale entries
            self._heap = [(k, s, h) for k, s, h in heap if h in entries and entries[h][2] == s]
            heapq.heapify(self._heap)
        return hits

    def _evict(self, heap: list[tuple[float, int, BlockHash]]) -> None:
        entries = self.entries
        capacity = self.capacity
        pop = heapq.heappop
        put = self._ghost.put if self._ghost.capacity else None
        L = self.L
        while len(entries) > capacity:
            key, serial, h = pop(heap)
            got = entries.get(h)
            if got is None or got[2] != serial:
                continue  # a stale entry (the block was used again since)
            del entries[h]
            if put is not None:
                put(h, got[1])
            if key > L:
                L = key
        self.L = L
