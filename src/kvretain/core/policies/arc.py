"""``arc``: Adaptive Replacement Cache (Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement
Cache", FAST'03).

Resident blocks sit in two LRU lists: T1 (used once since they entered the cache: recency) and T2 (used
at least twice: frequency). Two ghost lists remember the hashes evicted from each, B1 and B2. A target
``p`` (0..c, c = the pool's blocks) is the size T1 should have; it adapts on every ghost hit::

    insert  (on_cached)  hash in B1: p += max(1, |B2| / |B1|)   (T1 was too small), enter T2
                         hash in B2: p -= max(1, |B1| / |B2|)   (T2 was too small), enter T2
                         otherwise: enter T1 (first trimming the directory: when |T1| + |B1| reaches c the
                         LRU entry of B1 goes, else when the directory reaches 2c the LRU entry of B2)
    access  (a hit's release)          T1 -> T2 (MRU end); a T2 block goes to T2's MRU end
    evict   (pop, ARC's REPLACE)       |T1| > p: T1's LRU block, its hash to B1's MRU end;
                                       otherwise T2's LRU block, its hash to B2 (the other list when the
                                       chosen one has no evictable block)

so that |T1| + |T2| <= c (the pool), |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c (the directory)
hold throughout. What insert, access and ghost hit mean in the pool, and that a block enters its list
at its release (the MRU end, as ``lru`` does), is in :mod:`kvretain.core.policies._classic`.

NOTE: ARC's REPLACE also evicts from T1 when ``|T1| == p`` and the missed page is in B2; the pool evicts
before it registers the new content (``pop`` comes before ``on_cached``), so the policy cannot know that
page yet and the tie goes to T2. |T1| and |T2| count the blocks in use too (they are resident); only the
evictable ones are in the LRU lists, so a block in use is skipped until its release puts it back (at the MRU
end, where an access puts it anyway). Every operation is O(1).

On the Mooncake conversation trace this gives 0.0505 / 0.1144 / 0.2894 at 875 / 5,000 / 20,000 blocks
against 0.0488 / 0.1124 / 0.2892 for textbook ARC in the field notes' simplified replay. A separate ARC
driven in the pool's sequence reproduces 0.0505 and 0.1144 exactly. The gap is the release order: a
request releases its blocks deepest first, so a chain's head is the newest entry of its list (the same
sequence in request order gives 0.0488 and 0.1133); at 5,000 blocks the pool's refusal to register a chain
below a block cached elsewhere (an orphan left by an evicted parent) takes 0.0014 back.
"""

from __future__ import annotations

from collections import OrderedDict

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

    def __init__(self, num_blocks: int, config: PolicyConfig | None = None) -> None:
        self._meta = [_Block(i) for i in range(num_blocks)]
        super().__init__(num_blocks, config, self._meta)
        # evictable blocks of T1 and T2 (index by _T1 / _T2), LRU first; OrderedDicts are O(1) linked lists in C
        self._lists: tuple[OrderedDict[int, None], ...] = (OrderedDict(), OrderedDict(), OrderedDict())
        self._size = [0, 0, 0]  # |T1|, |T2|: resident blocks of each list, in use or not
        self._b1: OrderedDict[BlockHash, None] = OrderedDict()
        self._b2: OrderedDict[BlockHash, None] = OrderedDict()
        self.p = 0.0

    # ------------------------------------------------------------------ insert / access
    def on_cached(self, block_id: int, block_hash: BlockHash, depth: int, now: float) -> None:
        b = self._meta[block_id]
        b.content = block_hash
        b.fresh = True
        b1 = self._b1
        b2 = self._b2
        size = self._size
        c = self.num_blocks
        if block_hash in b1:
            self.p = min(float(c), self.p + max(1.0, len(b2) / len(b1)))
            del b1[block_hash]
            b.lst = _T2
        elif block_hash in b2:
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
        ghost[b.content] = None  # type: ignore[index]
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
