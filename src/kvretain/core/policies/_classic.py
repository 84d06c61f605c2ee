"""What the classic cache algorithms' events mean in a block pool, shared by ``s3fifo`` and ``arc``.

Published cache algorithms see one stream of requests for objects: a *miss* inserts the object, a *hit*
accesses it, and an object evicted earlier may come back while the algorithm still remembers its key (a
*ghost hit*). A :class:`~kvretain.core.block_pool.BlockPool` reports blocks differently, and the two classic
policies read its calls the same way:

- **insert** = ``on_cached``: a request computed new content and registered it under a hash. A hash the
  policy remembers as evicted is a **ghost hit** at this moment (``arc``, whose victim choice depends on
  the ghost hit, already adapts at the lookup that missed the hash, before the allocation evicts).
- **access** = a release of the block by a request that found it cached (a hit: ``touch`` then, when the
  request ends, ``release``). The release by the request that inserted the block is part of the insertion,
  not an access, so a block's accesses are its releases minus one, whichever request releases first.
  NOTE: counted at release, not at lookup: ``on_lookup`` names hashes, not block ids, and in the pool a hit
  block is in use (unevictable) until that release anyway.
- **position**: a block enters its queue at its first release, not at ``on_cached``: a request releases its
  blocks deepest first (vLLM's order), so the tail of a chain is older than its head and goes first, and a
  long-running request's blocks do not age while they are in use (``lru`` counts recency the same way).

A request's misses are evicted for (``get_new_blocks``) before any of them is inserted, so a size test that
the published algorithms make per object (S3-FIFO's "small queue at 10%", ARC's "|T1| > p") does not count the
request's own pending insertions: with requests of many blocks and a small pool they evict from the main queue
(``M``, ``T2``) more than the per-object algorithm would (a review measured -0.4 to -3.6 points of hit ratio at
16-block requests in pools of 50-200 blocks, none at one-block requests, where both equal reference
implementations access by access). A lookup whose request then caches nothing (longer than the pool) has still
adapted ``arc``'s ``p`` on its ghost hits.

A *copy* (content two requests computed at once, registered twice by the pool, as vLLM does) is a block of its
own in the algorithm's queues, but the content leaves the cache only with its last copy: only then may a ghost
list remember its hash (:meth:`ClassicPolicy._cache_content`, :meth:`ClassicPolicy._drop_content`). A ghost entry
made while another block still held the content would turn the content's later return into a ghost hit that no
eviction caused (and ARC's two ghost lists could hold one hash).

Only *evictable* blocks may be popped: a block in use stays in the algorithm's bookkeeping (its queue, its
counts) and is skipped until it is released. Both policies are not ``leaf_only``, like ``lru`` and the
published algorithms, which know nothing of prefix chains: an evicted parent leaves its cached descendants
unreachable, and they age out.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Generic, TypeVar, cast

from kvretain.core.hashing import BlockHash
from kvretain.core.policy import BlockState, EvictionPolicy, PolicyConfig


class ClassicBlock(BlockState):
    """A block's state for a classic policy, in the same object as the pool's state of the block."""

    __slots__ = ("block_id", "content", "fresh", "offered")

    def __init__(self, block_id: int) -> None:
        super().__init__()
        self.block_id = block_id
        self.content: BlockHash | None = None  # the hash the policy knows (None: not resident)
        self.fresh = False  # inserted, and the release that belongs to the insertion has not come yet
        self.offered = False  # evictable: pushed by the pool and not removed since


B = TypeVar("B", bound=ClassicBlock)


class ClassicPolicy(EvictionPolicy, Generic[B]):
    """The release rule above (an access is every release but the inserting one) and the evictable count;
    subclasses keep their queues and say what an access does (:meth:`_access`)."""

    leaf_only = False
    tracks_uses = True
    forgets_on_pop = True

    def __init__(
        self,
        num_blocks: int,
        config: PolicyConfig | None,
        blocks: Sequence[B],
        *,
        capacity: int | None = None,
    ) -> None:
        super().__init__(num_blocks, config, capacity=capacity)
        self._blocks = blocks  # one object per block, of the subclass's own ClassicBlock subclass
        self._n = 0  # offered blocks
        self._held: dict[BlockHash, int] = {}  # resident blocks per content (more than one: copies)

    def _cache_content(self, block_hash: BlockHash) -> None:
        """A block now holds ``block_hash`` (``on_cached``)."""
        held = self._held
        held[block_hash] = held.get(block_hash, 0) + 1

    def _drop_content(self, block_hash: BlockHash) -> bool:
        """A block holding ``block_hash`` left the cache; True when it was the last one (the content left: a ghost
        list may remember it), False when a copy still holds it."""
        held = self._held
        n = held[block_hash] - 1
        if n:
            held[block_hash] = n
            return False
        del held[block_hash]
        return True

    @abstractmethod
    def _access(self, b: B) -> None:
        """A request that hit ``b`` released it (``b`` is in use: not evictable, ``push`` may follow)."""

    def on_release(
        self,
        block_id: int,
        retention: int,
        duration_s: float | None,
        scope: str | None,
        now: float,
        base: int,
    ) -> None:
        b = self._blocks[block_id]
        if b.fresh:
            b.fresh = False
        else:
            self._access(b)

    def release_run(
        self,
        block_ids: Sequence[int],
        evictable_ids: Sequence[int],
        retention: int,
        scope: str | None,
        now: float,
        base: int,
    ) -> None:
        blocks = self._blocks
        access = self._access
        for bid in block_ids:
            b = blocks[bid]
            if b.fresh:
                b.fresh = False
            else:
                access(b)
        push = self.push
        for bid in evictable_ids:
            push(bid, now)

    def block_states(self) -> list[BlockState]:
        # the policy's own objects hold the pool's state too (one object per block)
        return cast(list[BlockState], self._blocks)

    def __len__(self) -> int:
        return self._n

    def evictable_ids(self) -> set[int]:
        return {b.block_id for b in self._blocks if b.offered}
