"""``lru``: vLLM 0.33's eviction order.

vLLM keeps free blocks in one queue: freed blocks go to the tail in release order (a request's blocks deepest
first), allocation pops the head. A cache hit removes the block from the queue; its recency is refreshed
only when it is released again. Parents are not protected from eviction before their children (vLLM does
not do it; with deepest-first release it rarely matters).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvretain.core.policy import POLICIES, EvictionPolicy, PolicyConfig


@POLICIES.register("lru", "vLLM 0.33 order: least recently released first, deepest block of a request first")
class LRUPolicy(EvictionPolicy):
    name = "lru"
    leaf_only = False
    tracks_uses = False

    def __init__(
        self, num_blocks: int, config: PolicyConfig | None = None, *, capacity: int | None = None
    ) -> None:
        super().__init__(num_blocks, config, capacity=capacity)
        self._queue: OrderedDict[int, None] = OrderedDict()

    def push(self, block_id: int, now: float) -> None:
        self._queue[block_id] = None

    def release_run(
        self,
        block_ids: Sequence[int],
        evictable_ids: Sequence[int],
        retention: int,
        scope: str | None,
        now: float,
        base: int,
    ) -> None:
        # no use counts: the blocks the release made evictable join the tail, in release order
        queue = self._queue
        for bid in evictable_ids:
            queue[bid] = None

    def remove(self, block_id: int) -> None:
        del self._queue[block_id]

    def pop(self, now: float) -> int | None:
        if not self._queue:
            return None
        return self._queue.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._queue)

    def evictable_ids(self) -> set[int]:
        return set(self._queue)
