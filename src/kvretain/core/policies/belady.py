"""``belady``: the offline oracle, for trace replay only.

Evicts the evictable block whose next use is farthest in the future (never used again first). It needs
``PolicyConfig.next_use``, a function from a block hash to the time (e.g. request index) of its next use,
which a replay can answer because it knows the whole trace. A block's next use can only change when it is
used again, and then it is pushed again, so the key computed at push time stays valid (the replay releases
every hit, a request longer than the pool's included).
"""

from __future__ import annotations

from kvretain.core.hashing import BlockHash
from kvretain.core.policies._lazyheap import HeapOrderedPolicy
from kvretain.core.policy import POLICIES, PolicyConfig

_NEVER = 1e9  # next-use times (request indices, seconds) stay below this; keeps depth exact in the key
_DEPTHS = 1 << 20
"""Depths the tie-break orders (deeper ones tie): ``_NEVER * _DEPTHS`` < 2**53, so the key is exact in a float.

NOTE: the key was ``next use * 4096 + depth``: a chain of 4,096 blocks or more mixed its depth into the next use
(a leaf at depth 4,100 used at request j sorted as if used after j + 1)."""


@POLICIES.register("belady", "offline oracle: evict the block whose next use is farthest (replay only)")
class BeladyPolicy(HeapOrderedPolicy):
    name = "belady"
    tracks_uses = False

    def __init__(
        self, num_blocks: int, config: PolicyConfig | None = None, *, capacity: int | None = None
    ) -> None:
        super().__init__(num_blocks, config, capacity=capacity)
        if self.config.next_use is None:
            raise ValueError(
                "policy 'belady' is an offline oracle: it needs PolicyConfig(next_use=...) and works only in "
                "trace replay (kvretain replay), not in online serving"
            )
        self._next_use = self.config.next_use
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._depth = [0] * num_blocks

    def on_cached(self, block_id: int, block_hash: BlockHash, depth: int, now: float) -> None:
        self._hash[block_id] = block_hash
        self._depth[block_id] = depth

    def _key(self, block_id: int, now: float) -> float:
        h = self._hash[block_id]
        assert h is not None
        # farthest next use first; among blocks never used again (next use capped to a finite horizon so the
        # tie-break survives), the deepest first
        return -min(self._next_use(h), _NEVER) * _DEPTHS - min(self._depth[block_id], _DEPTHS - 1)

    def on_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        self._hash[block_id] = None
