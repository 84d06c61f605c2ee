"""``priority``: strict retention priority, TensorRT-LLM-like.

All evictable blocks of the lowest retention priority go before any block of the next priority; least
recently released first within a level. A block released with a duration drops back to its releasing request's
mapped priority (:class:`~kvretain.core.retention.PriorityMapping`; 35, TensorRT-LLM's default, for vLLM's default
priority 0) once the duration has passed since its release (checked lazily, through an expiry heap drained on
each eviction). Shared blocks take the priority of the request that released them last, much as in
TensorRT-LLM, where a later request's directive overwrites (there when a request takes the block,
``claimBlock`` at its admission, so of two requests holding a block at once the later admitted one's stands;
here the later released one's); here a request's mapped priority is an implicit directive over its whole
prompt, so a release without any directive overwrites too (TensorRT-LLM leaves a reused block's priority as it
was when no range of the request covers it). A lapsed block keeps its place by release time in its new level
(TensorRT-LLM's ``LRUEvictionPolicy::refresh`` queues it at the back of the default level, as if just
released). Leaves only; a parent that becomes a leaf keeps its release time.

NOTE: a lapse used to fall to 35 whatever the request's mapped priority: a priority -3 request (65) asking 90
for 1 s over part of its prompt left that part at 35, below its undirected blocks.
"""

from __future__ import annotations

import heapq

from kvretain.core.policies import rules
from kvretain.core.policies._lazyheap import HeapOrderedPolicy
from kvretain.core.policy import INF, POLICIES, PolicyConfig
from kvretain.core.retention import DEFAULT_RETENTION_PRIORITY

_LEVEL = float(1 << 44)  # release ticks stay below 2**44, so level * _LEVEL + tick is exact in a float


@POLICIES.register(
    "priority", "strict retention priority (TensorRT-LLM-like): lowest level first, LRU within"
)
class StrictPriorityPolicy(HeapOrderedPolicy):
    name = "priority"

    def __init__(
        self, num_blocks: int, config: PolicyConfig | None = None, *, capacity: int | None = None
    ) -> None:
        super().__init__(num_blocks, config, capacity=capacity)
        self._prio = [DEFAULT_RETENTION_PRIORITY] * num_blocks
        self._expiry = [INF] * num_blocks
        self._base = [DEFAULT_RETENTION_PRIORITY] * num_blocks  # where a lapse falls: the releaser's mapping
        self._released = [0] * num_blocks
        self._expiries: list[tuple[float, int]] = []
        self._lapse_limit = rules.lapse_limit(0)  # compact _expiries past this many entries
        self._tick = 0

    def on_cached(self, block_id: int, block_hash: object, depth: int, now: float) -> None:
        self._prio[block_id] = DEFAULT_RETENTION_PRIORITY
        self._expiry[block_id] = INF

    def on_release(
        self,
        block_id: int,
        retention: int,
        duration_s: float | None,
        scope: str | None,
        now: float,
        base: int,
    ) -> None:
        self._tick += 1
        self._released[block_id] = self._tick
        self._prio[block_id] = retention
        self._base[block_id] = base
        exp = INF if duration_s is None or retention == base else now + duration_s
        if exp != self._expiry[block_id]:
            # NOTE: a lapse is scheduled only when the expiry moves to a finite time: a block released again at
            # the same time (a simulator step), or with an infinite duration, kept one heap entry per release
            # (the compaction below keeps every entry that matches its block's expiry, duplicates included)
            self._expiry[block_id] = exp
            if exp == INF:
                return
            heapq.heappush(self._expiries, (exp, block_id))
            if len(self._expiries) > self._lapse_limit:  # (see rules.lapse_limit)
                expiry = self._expiry
                self._expiries[:] = [e for e in self._expiries if expiry[e[1]] == e[0]]
                heapq.heapify(self._expiries)
                self._lapse_limit = rules.lapse_limit(len(self._expiries))

    def retention_of(self, block_id: int, now: float) -> int:
        return self._base[block_id] if self._expiry[block_id] <= now else self._prio[block_id]

    def _key(self, block_id: int, now: float) -> float:
        return self.retention_of(block_id, now) * _LEVEL + self._released[block_id]

    def _expire(self, now: float) -> None:
        exp = self._expiries
        while exp and exp[0][0] <= now:
            t, bid = heapq.heappop(exp)
            if self._expiry[bid] != t:
                continue  # re-released since: a newer expiry (or none) applies
            self._expiry[bid] = INF
            self._prio[bid] = self._base[bid]
            if bid in self._heap:
                self._heap.remove(bid)
                self.push(bid, now)

    def pop(self, now: float) -> int | None:
        if self._expiries and self._expiries[0][0] <= now:
            self._expire(now)
        return super().pop(now)
