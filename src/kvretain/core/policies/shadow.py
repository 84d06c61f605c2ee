"""Shadow directories: block identities kept in a policy's order without their data, to tell what that policy
would hit on the same references (SHARDS-style estimates, :mod:`kvretain.core.policies.protection`). ``LRUShadow``
is stock LRU (vLLM's order); ``GDShadow`` is GreedyDual-Frequency (the frequency candidate of
:mod:`kvretain.core.policies.balance`)."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from kvretain.core.hashing import BlockHash
from kvretain.core.policies.lfu import GhostTable


class LRUShadow:
    """A directory of block identities in LRU order, ``capacity`` entries (no data: a shadow of a cache)."""

    __slots__ = ("capacity", "entries")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.entries: OrderedDict[BlockHash, None] = OrderedDict()

    def reference(self, sampled: Sequence[BlockHash]) -> int:
        """Look up ``sampled`` (one request's tracked blocks, in prefix order), count those resident, then
        make them the most recent, deepest first (a request's blocks are released deepest first, so its
        prefix stays behind its tail in LRU order)."""
        entries = self.entries
        hits = 0
        for h in sampled:
            if h in entries:
                hits += 1
        move = entries.move_to_end
        for i in range(len(sampled) - 1, -1, -1):
            h = sampled[i]
            if h in entries:
                move(h)
            else:
                entries[h] = None
        cap = self.capacity
        while len(entries) > cap:
            entries.popitem(last=False)
        return hits


class GDShadow:
    """A directory of block identities under GreedyDual-Frequency: key ``L + uses ** exponent``, ``L`` the key
    of the last victim; ``capacity`` entries, use counts of evicted ones remembered (``ghost`` entries)."""

    __slots__ = ("L", "_exp", "_ghost", "_heap", "_serial", "cap", "capacity", "entries")

    def __init__(self, capacity: int, exponent: float, cap: int, ghost: int) -> None:
        self.capacity = max(1, capacity)
        self._exp = exponent
        self.cap = cap
        self.entries: dict[BlockHash, tuple[float, int, int]] = {}  # hash -> (key, uses, serial)
        self._heap: list[tuple[float, int, BlockHash]] = []
        self._serial = 0
        self._ghost = GhostTable(ghost)
        self.L = 0.0

    def reference(self, sampled: Sequence[BlockHash]) -> int:
        """Look up ``sampled`` (prefix order), count those resident, then use them, deepest first."""
        entries = self.entries
        hits = 0
        for h in sampled:
            if h in entries:
                hits += 1
        heap = self._heap
        exp = self._exp
        for i in range(len(sampled) - 1, -1, -1):
            h = sampled[i]
            got = entries.get(h)
            uses = (got[1] if got is not None else self._ghost.take(h)) + 1
            if uses > self.cap:
                uses = self.cap
            key = self.L + float(uses) ** exp
            self._serial += 1
            entries[h] = (key, uses, self._serial)
            heapq.heappush(heap, (key, self._serial, h))  # ties: the older first
        while len(entries) > self.capacity:
            key, serial, h = heapq.heappop(heap)
            got = entries.get(h)
            if got is None or got[2] != serial:
                continue  # a stale entry (the block was used again since)
            del entries[h]
            self._ghost.put(h, got[1])
            if key > self.L:
                self.L = key
        if len(heap) > 4 * self.capacity + 64:  # drop stale entries
            self._heap = [(k, s, h) for k, s, h in heap if h in entries and entries[h][2] == s]
            heapq.heapify(self._heap)
        return hits
