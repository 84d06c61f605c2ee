"""``arc``: Adaptive Replacement Cache (Megiddo and Modha, "ARC: A Self-Tuning, Low Overhead Replacement
Cache", FAST'03).

Resident blocks sit in two LRU lists: T1 (used once since they entered the cache: recency) and T2 (used
at least twice: frequency). Two ghost lists remember the hashes evicted from each, B1 and B2. A target
``p`` (0..c, c = the pool's blocks) is the size T1 should have; it adapts on every ghost hit::

    ghost hit (on_lookup, the request's missed hashes, before its allocation evicts)
                         hash in B1: p += max(1, |B2| / |B1|)   (T1 was too small)
                         hash in B2: p -= max(1, |B1| / |B2|)   (T2 was too small)
    insert  (on_cached)  hash in B1 or B2: leave the ghost list, enter T2 (p adapted here instead when no
                         lookup saw the miss: a resume after preemption, or vLLM when the admission evicted
                         nothing, whose lookup the plugin then gives after the allocation)
                         otherwise: enter T1 (first trimming the directory: when |T1| + |B1| reaches c the
                         LRU entry of B1 goes, else when the directory reaches 2c the LRU entry of B2)
    access  (a hit's release)          T1 -> T2 (MRU end); a T2 block goes to T2's MRU end
    evict   (pop, ARC's REPLACE)       |T1| > p, or |T1| == p and the page x the victim makes room for
                                       is in B2: T1's LRU block, its hash to B1's MRU end; otherwise T2's
                                       LRU block, its hash to B2 (the other list when the chosen one has
                                       no evictable block); no ghost entry while a copy of its content is
                                       still cached

so that |T1| + |T2| <= c (the pool), |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c (the directory)
hold throughout. What insert, access and ghost hit mean in the pool, and that a block enters its list
at its release (the MRU end, as ``lru`` does), is in :mod:`kvretain.core.policies._classic`.

FAST'03 adapts ``p`` on a ghost hit *before* REPLACE chooses the victim (Cases II and III). The pool evicts
before it registers the new content (``pop`` comes before ``on_cached``), so the adaptation is done at the
request's lookup (``on_lookup``, which the core manager and ``replay`` call before allocating) and the ghost
entry is marked adapted (its value in B1 / B2) so that ``on_cached`` does not adapt again. |T1| and |T2|
count the blocks in use too (they are resident); only the evictable ones are in the LRU lists, so a block
in use is skipped until its release puts it back (at the MRU end, where an access puts it anyway).

REPLACE's tie (``|T1| == p``: T1 when the missed page x is in B2, else T2) needs x, and ``pop`` is not told
it. The lookup keeps the request's hashes (a reference, and its hits); the pool announces the allocation that
follows (``on_allocate``: it hands out its empty blocks first, then one victim per further block, and the core
manager and ``replay`` give a request's blocks after its hits in that order), so the i-th pop of that
allocation makes room for the hash ``hits + empty + i``, the content its victim block is allocated for (the
paper's order too: the first misses fill the free slots, each later one calls REPLACE). "x in B2" is read at
the pop, whether a lookup marked the entry or not: an entry leaves B2 only at a registration (its content's,
as the paper moves x to T2 after REPLACE, or the directory's trim), never during an allocation (and a hash
that an earlier pop of the same allocation sent to B2 is in B2). Where no page is known the tie goes to T2, as
for a page in no list: any allocation but the first after a lookup (decode blocks, the later chunks of a
chunked prefill, a resume after preemption, whose lookup the manager does not give the policy), a pop past the
request's hashes (its partial last block; all of them when the lookup's hits include the last full block that
the scheduler's cap recomputes), and the vLLM plugin, whose queues announce no allocation (the plugin gives
the lookup at the admission's first eviction, but how vLLM's allocation maps blocks to hashes, its unhashed
blocks first and its KV cache groups, is not told to the policy). NOTE: a caller that touches fewer hits than
the lookup reported (the manager's ``new_computed_blocks`` a shorter prefix than ``get_computed_blocks``
returned; kvretain's scheduler passes them all) shifts the pages. Every operation is O(1): the lookup keeps a
reference, ``on_allocate`` three numbers, and a pop reads its page only at a tie (its index from the evictable
count, which each pop lowers by one).

On the Mooncake conversation trace this gives 0.0505 / 0.1151 / 0.2895 at 875 / 5,000 / 20,000 blocks (the
same hits to the block with REPLACE's tie and without it: |T1| == p with both lists evictable at 86 / 1,197 /
5,897 of 273,059 / 250,283 / 184,993 pops, none of them for a page in B2) against 0.0488 / 0.1124 / 0.2892 for
textbook ARC in the field notes' simplified replay. (Before ``p`` was adapted at the lookup it was adapted at
registration, after the victim was chosen: 0.0505 / 0.1144 / 0.2894; the analysis that followed was made on
those figures.) The gap is the release order: a request releases its blocks deepest first, so a chain's head
is the newest entry of its list (with the old adaptation, the same sequence in request order gave 0.0488 and
0.1133); and the pool registers a chain below a block whose content another block still holds (an orphan left
by an evicted parent, computed again: a copy, as vLLM registers it): 0.1129 at 5,000 blocks while the pool
refused to register such chains, 0.1145 once it registered them (f84b17c), 0.1151 with the pool's later
changes.
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
    hears_allocations = True

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
        # REPLACE's page x (module docstring): the latest lookup's hashes and hits, until an allocation takes
        # them; then the pages of the current allocation's pops: its i-th pop, which finds _n == _x_n - i, makes
        # room for _x_pages[_x_first + i] (None: no page known)
        self._lookup_pages: Sequence[BlockHash] | None = None
        self._lookup_hits = 0
        self._x_pages: Sequence[BlockHash] | None = None
        self._x_first = 0
        self._x_n = 0

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
        does not adapt twice either). The missed hashes are also kept for the allocation that follows
        (:meth:`on_allocate`): the page each of its pops makes room for."""
        self._lookup_pages = hashes
        self._lookup_hits = num_hits
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
    def on_allocate(self, n: int, empty: int) -> None:
        """The allocation that follows a lookup is that request's: its blocks are the request's blocks after
        the lookup's hits, in order, the empty ones first, so its i-th pop makes room for the missed hash
        ``min(n, empty) + i`` places after the hits. Any other allocation (no lookup since the last one) knows
        no page."""
        pages = self._x_pages = self._lookup_pages
        if pages is not None:
            self._lookup_pages = None
            self._x_first = self._lookup_hits + min(n, empty)
            self._x_n = self._n

    def _page_in_b2(self) -> bool:
        """Whether the page the current pop makes room for is in B2 now, marked by a lookup or not (the paper
        moves x to T2 after REPLACE; this module when x is registered); False where no page is known."""
        pages = self._x_pages
        if pages is None:
            return False
        # (each pop takes one block out of _n, and nothing else changes it during an allocation)
        i = self._x_first + self._x_n - self._n
        return i < len(pages) and pages[i] in self._b2

    def pop(self, now: float) -> int | None:
        t1 = self._lists[_T1]
        t2 = self._lists[_T2]
        # (the tie is tested only where T2 would win without it: a pop from T1 reads as before)
        if t1 and (self._size[_T1] > self.p or not t2 or (self._size[_T1] == self.p and self._page_in_b2())):
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
