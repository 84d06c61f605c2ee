"""``arc``: Adaptive Replacement Cache (Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement
Cache", FAST'03).

Resident blocks sit in two LRU lists: T1 (used once since they entered the cache: recency) and T2 (used
at least twice: frequency). Two ghost lists remember the hashes evicted from each, B1 and B2. A target
``p`` (0..c, c = the pool's blocks) is the size T1 should have; it adapts on every ghost hit::

    ghost hit (on_lookup, the request's missed hashes, before its allocation evicts)
                         hash in B1: p += max(1, |B2| / |B1|)   (T1 was too small)
                         hash in B2: p -= max(1, |B1| / |B2|)   (T2 was too small)
    insert  (on_cached)  hash in B1 or B2: leave the ghost list, enter T2 (p adapted here instead when no
                         lookup saw the miss: a resume after preemption, or vLLM, whose lookup hook runs
                         after the allocation)
                         otherwise: enter T1 (first trimming the directory: when |T1| + |B1| reaches c the
                         LRU entry of B1 goes, else when the directory reaches 2c the LRU entry of B2)
    access  (a hit's release)          T1 -> T2 (MRU end); a T2 block goes to T2's MRU end
    evict   (pop, ARC's REPLACE)       |T1| > p: T1's LRU block, its hash to B1's MRU end;
                                       otherwise T2's LRU block, its hash to B2 (the other list when the
                                       chosen one has no evictable block); no ghost entry while a copy of
                                       its content is still cached

so that |T1| + |T2| <= c (the pool), |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c (the directory)
hold throughout. What insert, access and ghost hit mean in the pool, and that a block enters its list
at its release (the MRU end, as ``lru`` does), is in :mod:`kvretain.core.policies._classic`.

FAST'03 adapts ``p`` on a ghost hit *before* REPLACE chooses the victim (Cases II and III). The pool evicts
before it registers the new content (``pop`` comes before ``on_cached``), so the adaptation is done at the
request's lookup (``on_lookup``, which the core manager and ``replay`` call before allocating) and the ghost
entry is marked adapted (its value in B1 / B2) so that ``on_cached`` does not adapt again. NOTE: ARC's
REPLACE also evicts from T1 when ``|T1| == p`` and the missed page is in B2; ``pop`` is not told which page
it makes room for (a request may miss several), and the tie goes to T2. |T1| and |T2| count the blocks in
use too (they are resident); only the evictable ones are in the LRU lists, so a block in use is skipped
until its release puts it back (at the MRU end, where an access puts it anyway). Every operation is O(1).

On the Mooncake conversation trace this gives 0.0505 / 0.1151 / 0.2895 at 875 / 5,000 / 20,000 blocks
against 0.0488 / 0.1124 / 0.2892 for textbook ARC in the field notes' simplified replay. (Before ``p`` was
adapted at the lookup it was adapted at registration, after the victim was chosen: 0.0505 / 0.1144 /
0.2894; the analysis that followed was made on those figures.) The gap is the release order: a request
releases its blocks deepest first, so a chain's head is the newest entry of its list (with the old
adaptation, the same sequence in request order gave 0.0488 and 0.1133); and the pool registers a chain below
a block whose content another block still holds (an orphan left by an evicted parent, computed again: a copy,
as vLLM registers it): 0.1129 at 5,000 blocks while the pool refused to register such chains, 0.1145 once it
registered them (f84b17c), 0.1151 with the pool's later changes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvretain.core.hashing import BlockHash
from kvretain.core.policies._classic import ClassicBlock, ClassicPolicy
from kvretain.core.policy import POLICIES, PolicyConfig

_NONE = 0
_T1 = 1
_T2 = 2


class _Block(ClassicBlock):
    __slots__ = ("lst",)

    def __init__(self, block_id: int) -> None:
        super().__init__(block_id)
        self.lst = _NONE  # T1 or T2 (_NONE: not resident)


@POLICIES.register("arc", "ARC (FAST'03): recency and frequency lists, their split adapted from ghost hits")
class ARCPolicy(ClassicPolicy[_Block]):
    name = "arc"

    def __init__(
        self, num_blocks: int, config: PolicyConfig | None = None, *, capacity: int | None = None
    ) -> None:
        self._meta = [_Block(i) for i in range(num_blocks)]
        super().__init__(num_blocks, config, self._meta, capacity=capacity)
        # evictable blocks of T1 and T2 (index by _T1 / _T2), LRU first; OrderedDicts are O(1) linked lists in C
        self._lists: tuple[OrderedDict[int, None], ...] = (OrderedDict(), OrderedDict(), OrderedDict())
        self._size = [0, 0, 0]  # |T1|, |T2|: resident blocks of each list, in use or not
        # ghost lists, LRU first; the value is True once a lookup adapted p for that ghost hit (on_lookup)
        self._b1: OrderedDict[BlockHash, bool] = OrderedDict()
        self._b2: OrderedDict[BlockHash, bool] = OrderedDict()
        self.p = 0.0

    # ------------------------------------------------------------------ insert / access
    def on_cached(self, block_id: int, block_hash: BlockHash, depth: int, now: float) -> None:
        b = self._meta[block_id]
        b.content = block_hash
        b.fresh = True
        self._cache_content(block_hash)
        b1 = self._b1
        b2 = self._b2
        size = self._size
        c = self.capacity
        if block_hash in b1:
            if not b1[block_hash]:  # no lookup adapted p for this ghost hit
                self.p = min(float(c), self.p + max(1.0, len(b2) / len(b1)))
            del b1[block_hash]
            b.lst = _T2
        elif block_hash in b2:
            if not b2[block_hash]:
                self.p = max(0.0, self.p - max(1.0, len(b1) / len(b2)))
            del b2[block_hash]
            b.lst = _T2
        else:
            # the block is resident already, so |T1| + |T2| <= c - 1 before it joins: when |T1| + |B1| == c,
            # B1 is not empty, and when the directory is 2c, B2 is not (ARC's case IV)
            if size[_T1] + len(b1) >= c:
                if b1:
                    b1.popitem(last=False)
            elif size[_T1] + size[_T2] + len(b1) + len(b2) >= 2 * c and b2:
                b2.popitem(last=False)
            b.lst = _T1
        size[b.lst] += 1

    def on_lookup(
        self, hashes: Sequence[BlockHash], num_hits: int, retention: int, seen: object | None = None
    ) -> None:
        """FAST'03 Cases II / III: a missed hash found in B1 or B2 adapts ``p`` now, before the request's
        allocation evicts (REPLACE with the adapted ``p``); the ghost entry is marked so that its
        ``on_cached`` does not adapt again (a second request missing the same ghost before it is registered
        does not adapt twice either)."""
        b1 = self._b1
        b2 = self._b2
        if not b1 and not b2:
            return
        c = float(self.capacity)
        for i in range(num_hits, len(hashes)):
            h = hashes[i]
            marked = b1.get(h)
            if marked is not None:
                if not marked:
                    self.p = min(c, self.p + max(1.0, len(b2) / len(b1)))
                    b1[h] = True  # (assigning an existing key keeps its place in the LRU order)
                continue
            marked = b2.get(h)
            if marked is not None and not marked:
                self.p = max(0.0, self.p - max(1.0, len(b1) / len(b2)))
                b2[h] = True

    def _access(self, b: _Block) -> None:
        if b.lst == _T1:
            size = self._size
            size[_T1] -= 1
            size[_T2] += 1
            b.lst = _T2

    # ------------------------------------------------------------------ evictable set
    def push(self, block_id: int, now: float) -> None:
        b = self._meta[block_id]
        b.offered = True
        self._n += 1
        self._lists[b.lst][block_id] = None

    def remove(self, block_id: int) -> None:
        b = self._meta[block_id]
        if not b.offered:
            raise KeyError(block_id)
        b.offered = False
        self._n -= 1
        del self._lists[b.lst][block_id]

    # ------------------------------------------------------------------ eviction
    def pop(self, now: float) -> int | None:
        t1 = self._lists[_T1]
        t2 = self._lists[_T2]
        if t1 and (self._size[_T1] > self.p or not t2):
            bid = t1.popitem(last=False)[0]
            ghost = self._b1
        elif t2:
            bid = t2.popitem(last=False)[0]
            ghost = self._b2
        else:
            return None
        b = self._meta[bid]
        h = b.content
        assert h is not None
        if self._drop_content(h):  # (its last copy: the content leaves)
            ghost[h] = False
        self._size[b.lst] -= 1
        self._n -= 1
        b.lst = _NONE
        b.content = None
        b.offered = False
        b.fresh = False
        return bid

    def on_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        # dropped other than by pop (pop forgets its victims itself): no ghost entry
        b = self._meta[block_id]
        if b.lst == _NONE:
            return
        self._drop_content(block_hash)
        if b.offered:
            del self._lists[b.lst][block_id]
            self._n -= 1
        self._size[b.lst] -= 1
        b.lst = _NONE
        b.content = None
        b.offered = False
        b.fresh = False

    def stats(self) -> dict[str, float]:
        s = self._size
        return {"p": self.p, "t1": s[_T1], "t2": s[_T2], "b1": len(self._b1), "b2": len(self._b2)}
