"""``lfu``: least frequently used first, least recently released first among equals.

Uses are counted per request release, capped at ``frequency_cap``, and remembered for evicted hashes in a
bounded ghost table (``ghost_factor`` x pool size) so that content coming back keeps its history (content leaves
with its last copy: :class:`GhostTable`).
Leaves only: a block is never evicted while a cached descendant stays.
"""

from __future__ import annotations

from kvretain.core.hashing import BlockHash
from kvretain.core.policies._lazyheap import HeapOrderedPolicy
from kvretain.core.policy import POLICIES, PolicyConfig


class GhostTable:
    """Use counts of recently evicted hashes: a dict plus a ring of the last ``capacity`` insertions.

    Content leaves the cache with its last copy (a pool registers content that two requests computed at once
    twice, as vLLM does): ``held`` counts the resident blocks of each content the table is told of
    (:meth:`enter`), and :meth:`leave` remembers the count only when the last of them goes. A copy evicted while
    another block still holds the content leaves no entry (the next copy registered would take its count, and
    outrank unique content released beside it).

    NOTE: a plain dict and a ring are several times cheaper than an OrderedDict on the eviction path. When the
    ring wraps onto a hash that was taken and put again since, that newer entry is dropped early: the
    table is a heuristic, so this approximation is accepted.
    """

    __slots__ = ("capacity", "held", "pos", "ring", "table", "take_or")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self.table: dict[BlockHash, int] = {}
        self.ring: list[BlockHash | None] = [None] * self.capacity
        self.pos = 0
        self.take_or = self.table.pop
        """``take_or(hash, 0)`` is :meth:`take` without a Python call (the dict's own method, for hot loops)."""
        self.held: dict[BlockHash, int] = {}
        """Resident blocks per content (more than one: copies); a hot loop may do :meth:`enter`'s count inline."""

    def enter(self, block_hash: BlockHash) -> int:
        """A block now holds ``block_hash``: its remembered use count (0 if none), taken out of the table."""
        held = self.held
        held[block_hash] = held.get(block_hash, 0) + 1
        return self.table.pop(block_hash, 0)

    def leave(self, block_hash: BlockHash, uses: int) -> None:
        """A block that held ``block_hash`` (told to :meth:`enter`) is evicted with ``uses``: remembered only if
        no other block still holds the content."""
        held = self.held
        n = held.pop(block_hash, 1) - 1
        if n:
            held[block_hash] = n  # (a copy: the content stays cached)
        else:
            self.put(block_hash, uses)

    def put(self, block_hash: BlockHash, uses: int) -> None:
        if not self.capacity:
            return
        ring = self.ring
        pos = self.pos
        old = ring[pos]
        if old is not None:
            self.table.pop(old, None)
        ring[pos] = block_hash
        self.table[block_hash] = uses
        pos += 1
        self.pos = 0 if pos == self.capacity else pos

    def take(self, block_hash: BlockHash) -> int:
        return self.table.pop(block_hash, 0)

    def __len__(self) -> int:
        return len(self.table)


@POLICIES.register("lfu", "least frequently used first (uses remembered across eviction), LRU among equals")
class LFUPolicy(HeapOrderedPolicy):
    name = "lfu"

    def __init__(
        self, num_blocks: int, config: PolicyConfig | None = None, *, capacity: int | None = None
    ) -> None:
        super().__init__(num_blocks, config, capacity=capacity)
        self._uses = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._ghost = GhostTable(int(self.config.ghost_factor * self.capacity))
        self._cap = self.config.frequency_cap
        self._tick = 0
        self._released = [0] * num_blocks

    def on_cached(self, block_id: int, block_hash: BlockHash, depth: int, now: float) -> None:
        self._uses[block_id] = self._ghost.enter(block_hash)
        self._hash[block_id] = block_hash

    def on_release(
        self,
        block_id: int,
        retention: int,
        duration_s: float | None,
        scope: str | None,
        now: float,
        base: int,
    ) -> None:
        if self._uses[block_id] < self._cap:
            self._uses[block_id] += 1
        self._tick += 1
        self._released[block_id] = self._tick

    def _key(self, block_id: int, now: float) -> float:
        # key: uses first, then release order (fixed at release); ticks < 2**40 keep the float exact
        return self._uses[block_id] * 1099511627776.0 + self._released[block_id]

    def on_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        self._ghost.leave(block_hash, self._uses[block_id])
        self._uses[block_id] = 0
        self._hash[block_id] = None
