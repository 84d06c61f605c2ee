"""A min-heap with O(1) lazy removal, shared by the score-based policies.

Entries are ``(key, seq, block_id)``; ``seq`` is a per-push stamp and ``stamp[block_id]`` the block's live
stamp (0: not in the heap). Dead entries are skipped at pop time and the heap is rebuilt when they outnumber
live ones, so every operation stays O(log n) amortized.
"""

from __future__ import annotations

import heapq
from collections import deque

_push = heapq.heappush
_pop = heapq.heappop


class LazyHeap:
    __slots__ = ("_heap", "_n", "_seq", "stamp")

    def __init__(self, num_blocks: int) -> None:
        self._heap: list[tuple[float, int, int]] = []
        self.stamp: list[int] = [0] * num_blocks
        self._n = 0
        self._seq = 0

    def push(self, block_id: int, key: float) -> None:
        self._seq += 1
        if not self.stamp[block_id]:
            self._n += 1
        self.stamp[block_id] = self._seq
        _push(self._heap, (key, self._seq, block_id))
        if len(self._heap) > 2 * self._n + 64:
            self._compact()

    def remove(self, block_id: int) -> None:
        if not self.stamp[block_id]:
            raise KeyError(block_id)
        self.stamp[block_id] = 0
        self._n -= 1

    def __contains__(self, block_id: int) -> bool:
        return self.stamp[block_id] != 0

    def peek(self) -> tuple[float, int] | None:
        """``(key, block_id)`` of the minimum, without removing it."""
        heap = self._heap
        stamp = self.stamp
        while heap:
            key, seq, bid = heap[0]
            if stamp[bid] == seq:
                return key, bid
            _pop(heap)
        return None

    def pop(self) -> tuple[float, int] | None:
        heap = self._heap
        stamp = self.stamp
        while heap:
            key, seq, bid = _pop(heap)
            if stamp[bid] == seq:
                stamp[bid] = 0
                self._n -= 1
                return key, bid
        return None

    def _compact(self) -> None:
        stamp = self.stamp
        self._heap = [e for e in self._heap if stamp[e[2]] == e[1]]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return self._n

    def ids(self) -> set[int]:
        return {b for b, s in enumerate(self.stamp) if s}


class BucketQueue:
    """A monotone-ish priority queue of blocks bucketed by key: amortized O(1) push/remove/pop.

    Keys are quantized to ``unit``; blocks in one bucket leave in push order (FIFO), so the order is exact up
    to ``unit``. Non-empty bucket indices sit in a small heap touched only when a bucket appears or empties,
    so per-block operations cost a dict lookup and a deque append/popleft instead of an O(log n) heap step.
    ``stamp`` is shared with the owner: ``stamp[b]`` is the sequence number of b's live entry (0: absent).
    """

    __slots__ = ("_buckets", "_entries", "_inv", "_slots", "n", "stamp")

    def __init__(self, stamp: list[int], unit: float) -> None:
        self.stamp = stamp
        self._inv = 1.0 / unit
        self._buckets: dict[int, deque[tuple[int, int]]] = {}
        self._slots: list[int] = []
        self._entries = 0  # live + dead entries held
        self.n = 0

    def push(self, block_id: int, key: float, seq: int) -> None:
        """Add ``block_id`` (its ``stamp`` must already be ``seq``)."""
        s = int(key * self._inv)
        q = self._buckets.get(s)
        if q is None:
            q = self._buckets[s] = deque()
            heapq.heappush(self._slots, s)
        q.append((seq, block_id))
        self.n += 1
        self._entries += 1
        if self._entries > 2 * self.n + 1024:
            self._compact()

    def _compact(self) -> None:
        stamp = self.stamp
        kept: dict[int, deque[tuple[int, int]]] = {}
        for s, q in self._buckets.items():
            live = deque(e for e in q if stamp[e[1]] == e[0])
            if live:
                kept[s] = live
        self._buckets = kept
        self._slots = sorted(kept)
        self._entries = sum(len(q) for q in kept.values())

    def head(self) -> tuple[int, int]:
        """``(bucket index, block id)`` of the first live entry (the queue must not be empty)."""
        buckets = self._buckets
        slots = self._slots
        stamp = self.stamp
        while True:
            s = slots[0]
            q = buckets[s]
            while q:
                seq, bid = q[0]
                if stamp[bid] == seq:
                    return s, bid
                q.popleft()
                self._entries -= 1
            del buckets[s]
            heapq.heappop(slots)

    def removed(self) -> None:
        """The owner cleared a live entry's stamp (lazy removal)."""
        self.n -= 1

    def pop(self) -> int:
        """Remove and return the first live block (the queue must not be empty)."""
        s, bid = self.head()
        q = self._buckets[s]
        q.popleft()
        self.stamp[bid] = 0
        self.n -= 1
        self._entries -= 1
        if not q:
            del self._buckets[s]
            heapq.heappop(self._slots)
        return bid
