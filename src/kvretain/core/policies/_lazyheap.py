"""A min-heap with O(1) lazy removal, shared by the score-based policies.

Entries are ``(key, seq, block_id)``; ``seq`` is a per-push stamp and ``stamp[block_id]`` the block's live
stamp (0: not in the heap). Dead entries are skipped at pop time and the heap is rebuilt when they outnumber
live ones, so every operation stays O(log n) amortized.
"""

from __future__ import annotations

import heapq
from abc import abstractmethod

from kvretain.core.policy import EvictionPolicy, PolicyConfig

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


class HeapOrderedPolicy(EvictionPolicy):
    """A policy whose order is one :class:`LazyHeap` keyed by :meth:`_key` (smallest evicted first)."""

    def __init__(
        self, num_blocks: int, config: PolicyConfig | None = None, *, capacity: int | None = None
    ) -> None:
        super().__init__(num_blocks, config, capacity=capacity)
        self._heap = LazyHeap(num_blocks)

    @abstractmethod
    def _key(self, block_id: int, now: float) -> float:
        """The block's eviction key when it becomes evictable."""

    def push(self, block_id: int, now: float) -> None:
        self._heap.push(block_id, self._key(block_id, now))

    def remove(self, block_id: int) -> None:
        self._heap.remove(block_id)

    def pop(self, now: float) -> int | None:
        top = self._heap.pop()
        return None if top is None else top[1]

    def __len__(self) -> int:
        return len(self._heap)

    def evictable_ids(self) -> set[int]:
        return self._heap.ids()
