"""A min-heap with O(1) lazy removal, shared by the score-based policies.

Entries are ``(key, seq, block_id)``; ``seq`` is a per-push stamp. An entry is live when it is the block's
latest stamp and the block is still in the heap. Dead entries are skipped at pop time and the heap is
rebuilt when they outnumber live ones, so every operation stays O(log n) amortized.
"""

from __future__ import annotations

import heapq


class LazyHeap:
    __slots__ = ("_heap", "_live", "_seq", "_stamp")

    def __init__(self, num_blocks: int) -> None:
        self._heap: list[tuple[float, int, int]] = []
        self._stamp: list[int] = [0] * num_blocks
        self._live: set[int] = set()
        self._seq = 0

    def push(self, block_id: int, key: float) -> None:
        self._seq += 1
        self._stamp[block_id] = self._seq
        self._live.add(block_id)
        heapq.heappush(self._heap, (key, self._seq, block_id))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._compact()

    def remove(self, block_id: int) -> None:
        self._live.remove(block_id)
        self._stamp[block_id] = 0

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._live

    def peek(self) -> tuple[float, int] | None:
        """``(key, block_id)`` of the minimum, without removing it."""
        heap = self._heap
        stamp = self._stamp
        while heap:
            key, seq, bid = heap[0]
            if stamp[bid] == seq:
                return key, bid
            heapq.heappop(heap)
        return None

    def pop(self) -> tuple[float, int] | None:
        top = self.peek()
        if top is not None:
            heapq.heappop(self._heap)
            self._live.remove(top[1])
            self._stamp[top[1]] = 0
        return top

    def _compact(self) -> None:
        stamp = self._stamp
        self._heap = [e for e in self._heap if stamp[e[2]] == e[1]]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._live)

    def ids(self) -> set[int]:
        return set(self._live)
