"""``s3fifo``: S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23).

Three FIFO queues: a small queue S (10% of the pool), a main queue M (the rest) and a ghost queue G of
evicted hashes (as many entries as M holds blocks: 90% of the pool). Every resident block carries a
frequency counter capped at 3 (two bits in the paper)::

    insert  (on_cached)   hash in G: leave G, enter M; otherwise enter S; frequency 0
    access  (a hit's release)            frequency = min(frequency + 1, 3)
    evict   (pop)         |S| >= 10% of the pool: from S, else from M (the other when that one is empty)
      from S: the oldest block of S, accessed at least once: moves to M (frequency cleared), try the next;
              never accessed (a one-hit wonder): evicted, its hash enters G (G drops its oldest past 90%)
              unless a copy of its content is still cached (the content has not left)
      from M: the oldest block of M, frequency > 0: reinserted at M's new end with frequency - 1 (FIFO
              reinsertion), try the next; frequency 0: evicted (no ghost entry)

What insert, access and ghost hit mean in the pool, and where a block enters its queue (its first release),
is in :mod:`kvretain.core.policies._classic`. A block promoted from S may leave M above its 90%; the next
evictions then come from M because S is below its 10%, so each ``pop`` evicts exactly one block, as the pool
asks.

NOTE: a block moves from S to M after one hit, the rule as the S3-FIFO write-ups state it ("moved to M if
accessed", access bits cleared on the move); libCacheSim's code defaults to two hits
(``move-to-main-threshold=2``) and evicts from S unless M is over its size or S is empty. On the Mooncake
conversation trace (the field notes' simplified replay, which a textbook S3-FIFO with these rules
reproduces exactly: 0.0551 / 0.1404 / 0.2502 at 875 / 5,000 / 20,000 blocks) two hits give 0.0547 / 0.1382
/ 0.2528: the choice is the published rule, and no figure hangs on it.

A block in use stays in its queue in place. When it reaches the old end of its queue it is set aside (out
of the queue, still counted in it); its release puts it back ahead of the queue, behind the blocks set aside
before it, so it is looked at where it would have been. (NOTE: each release used to put its block at the old
end, in front of those set aside before it: a request that held a chain as an eviction passed it put the
chain back head first, the reverse of its order, and main then evicted the head before the tail.) Each step of
an eviction drops a block, promotes one (once per insertion), sets one aside (once per hit) or spends one unit
of frequency (one per access): O(1) amortized per operation (O(log n) to put back a block set aside: a heap
keeps them in the order they were set aside), and the loop always ends (one evictable block suffices).
"""

from __future__ import annotations

from collections import OrderedDict
from heapq import heappop, heappush

from kvretain.core.hashing import BlockHash
from kvretain.core.policies._classic import ClassicBlock, ClassicPolicy
from kvretain.core.policy import POLICIES, PolicyConfig

SMALL_SHARE = 0.1
"""The small queue's share of the pool (the paper's 10%, which it found to generalize across traces)."""
FREQ_CAP = 3
"""Accesses counted up to this (two bits)."""
MOVE_TO_MAIN = 1
"""Accesses a block in S needs to move to M instead of being evicted ("accessed at least once")."""

_NONE = 0
_SMALL = 1
_MAIN = 2

_UNPLACED = 0  # inserted, not released yet: its first release places it at the new end
_QUEUED = 1  # in its queue's order (in use or not)
_ASIDE = 2  # in use when it reached the old end: out of the queue until its release
_BACK = 3  # set aside, then released: ahead of its queue, in the order the blocks were set aside


class _Block(ClassicBlock):
    __slots__ = ("aside", "freq", "pos", "queue")

    def __init__(self, block_id: int) -> None:
        super().__init__(block_id)
        self.queue = _NONE  # the queue it belongs to (_NONE: not resident)
        self.freq = 0
        self.pos = _UNPLACED
        self.aside = 0  # when it was set aside (a stamp), while it is _ASIDE or _BACK


@POLICIES.register(
    "s3fifo", "S3-FIFO (SOSP'23): small FIFO drops one-hit wonders, main FIFO reinserts, ghost"
)
class S3FIFOPolicy(ClassicPolicy[_Block]):
    name = "s3fifo"

    def __init__(
        self, num_blocks: int, config: PolicyConfig | None = None, *, capacity: int | None = None
    ) -> None:
        self._meta = [_Block(i) for i in range(num_blocks)]
        super().__init__(num_blocks, config, self._meta, capacity=capacity)
        # each queue holds its placed blocks, oldest first (in use or not); an OrderedDict is an O(1)
        # linked list in C
        self._small: OrderedDict[int, None] = OrderedDict()
        self._main: OrderedDict[int, None] = OrderedDict()
        self._ghost: OrderedDict[BlockHash, None] = OrderedDict()
        # the blocks set aside and released since, ahead of each queue: heaps of (stamp, block id), the oldest
        # set aside first (an entry whose block was dropped since is skipped)
        self._small_back: list[tuple[int, int]] = []
        self._main_back: list[tuple[int, int]] = []
        self._stamp = 0
        self.small_target = max(1, int(SMALL_SHARE * self.capacity))
        self.ghost_capacity = self.capacity - self.small_target  # the main queue's size
        self.n_small = 0  # blocks that belong to S (placed, set aside or not yet placed)
        self.n_main = 0

    # ------------------------------------------------------------------ insert / access
    def on_cached(self, block_id: int, block_hash: BlockHash, depth: int, now: float) -> None:
        b = self._meta[block_id]
        b.content = block_hash
        b.freq = 0
        b.fresh = True
        b.pos = _UNPLACED
        self._cache_content(block_hash)
        ghost = self._ghost
        if block_hash in ghost:
            del ghost[block_hash]
            b.queue = _MAIN
            self.n_main += 1
        else:
            b.queue = _SMALL
            self.n_small += 1

    def _access(self, b: _Block) -> None:
        if b.freq < FREQ_CAP:
            b.freq += 1

    # ------------------------------------------------------------------ evictable set
    def push(self, block_id: int, now: float) -> None:
        b = self._meta[block_id]
        b.offered = True
        self._n += 1
        pos = b.pos
        if pos == _UNPLACED:
            b.pos = _QUEUED
            (self._small if b.queue == _SMALL else self._main)[block_id] = None
        elif pos == _ASIDE:
            b.pos = _BACK
            heappush(self._small_back if b.queue == _SMALL else self._main_back, (b.aside, block_id))

    def remove(self, block_id: int) -> None:
        b = self._meta[block_id]
        if not b.offered:
            raise KeyError(block_id)
        b.offered = False  # stays in place in its queue
        self._n -= 1

    # ------------------------------------------------------------------ eviction
    def pop(self, now: float) -> int | None:
        if not self._n:
            return None
        if self.n_small >= self.small_target:
            victim = self._evict_small()
            if victim is None:
                victim = self._evict_main()
        else:
            victim = self._evict_main()
            if victim is None:
                # M had no evictable block; S's evictable ones were all accessed: they move to M and the
                # second look at M finds one
                victim = self._evict_small()
                if victim is None:
                    victim = self._evict_main()
        return victim

    def _next(self, q: OrderedDict[int, None], back: list[tuple[int, int]]) -> _Block | None:
        """The next evictable block from the old end of a queue (``back`` first), out of it; the blocks in use
        met on the way are set aside. None when the queue has no evictable block."""
        meta = self._meta
        while back:
            stamp, bid = heappop(back)
            b = meta[bid]
            if b.pos != _BACK or b.aside != stamp:
                continue  # (dropped since)
            if b.offered:
                b.pos = _QUEUED
                return b
            b.pos = _ASIDE  # in use again: set aside again, in its place
        while q:
            bid = q.popitem(last=False)[0]
            b = meta[bid]
            if b.offered:
                return b
            self._stamp += 1
            b.aside = self._stamp
            b.pos = _ASIDE
        return None

    def _evict_small(self) -> int | None:
        small = self._small
        back = self._small_back
        while True:
            b = self._next(small, back)
            if b is None:
                return None
            bid = b.block_id
            self.n_small -= 1
            if b.freq >= MOVE_TO_MAIN:
                b.queue = _MAIN
                b.freq = 0
                self.n_main += 1
                self._main[bid] = None
                continue
            h = b.content
            assert h is not None
            if self._forget(b):  # (the content's last copy: it leaves the cache)
                ghost = self._ghost
                ghost[h] = None
                if len(ghost) > self.ghost_capacity:
                    ghost.popitem(last=False)
            self._n -= 1
            return bid

    def _evict_main(self) -> int | None:
        main = self._main
        back = self._main_back
        while True:
            b = self._next(main, back)
            if b is None:
                return None
            bid = b.block_id
            if b.freq:
                b.freq -= 1
                main[bid] = None
                continue
            self.n_main -= 1
            self._forget(b)
            self._n -= 1
            return bid

    def _forget(self, b: _Block) -> bool:
        """``b`` (out of its queue and its queue's count) is no longer resident: True when it held its content's
        last copy."""
        assert b.content is not None
        gone = self._drop_content(b.content)
        b.queue = _NONE
        b.content = None
        b.offered = False
        b.fresh = False
        b.pos = _UNPLACED
        return gone

    def on_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        # dropped other than by pop (pop forgets its victims itself): no ghost entry
        b = self._meta[block_id]
        if b.queue == _NONE:
            return
        if b.queue == _SMALL:
            self.n_small -= 1
            q = self._small
        else:
            self.n_main -= 1
            q = self._main
        if b.pos == _QUEUED:
            del q[block_id]
        if b.offered:
            self._n -= 1
        self._forget(b)

    def stats(self) -> dict[str, float]:
        return {"small": self.n_small, "main": self.n_main, "ghost": len(self._ghost)}
