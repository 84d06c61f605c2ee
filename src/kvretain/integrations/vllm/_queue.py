"""vLLM's free-block queue, with hashed (cached) free blocks ordered by a kvretain policy.

Imported only when the plugin is enabled (it imports vLLM).

``RetentionFreeQueue`` keeps vLLM's intrusive linked list for *unhashed* free blocks (reused first, exactly
as stock vLLM: initial blocks, blocks freed without a hash) and hands *hashed* free blocks to an
:class:`~kvretain.core.policy.EvictionPolicy`, which ranks them by block id. ``num_free_blocks`` stays the
total (list + policy), so ``BlockPool.get_num_free_blocks``, ``get_usage``, the admission checks of
``allocate_slots`` and the precondition of ``reset_prefix_cache`` are unchanged: cached blocks count as free.
Eviction still happens in vLLM's ``BlockPool.get_new_blocks`` (``_maybe_evict_cached_block``), so KV events
(``BlockRemoved``) and the metrics collector keep working.

Leaf-only policies need parent/child links: a block cached at index ``i`` of a request is the child of the
request's block ``i-1``. A free block with a cached child is *blocked* (not offered to the policy) until the
child goes. vLLM can register duplicate blocks for one hash, so a request may hold a child whose parent
block it does not hold; such a parent may be free and blocked while its child is in use. When the policy has
nothing left to offer, blocked blocks are evicted anyway (their children become unreachable, as in stock
vLLM), so every free block can always be obtained. Links carry a generation so that a reused parent id
never receives a stale child's decrement.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from kvretain.core.policy import EvictionPolicy
from kvretain.core.retention import PriorityMapping
from kvretain.integrations.vllm import _runtime
from kvretain.integrations.vllm._base import HookedFreeQueue
from kvretain.integrations.vllm._order import eviction_order

IN_LIST = 0
IN_POLICY = 1
BLOCKED = 2
NO_PARENT = -1


class RetentionFreeQueue(HookedFreeQueue):
    """A drop-in ``FreeKVCacheBlockQueue`` whose hashed blocks are ordered by a kvretain policy."""

    def __init__(
        self,
        free_blocks: list[KVCacheBlock],
        pool_blocks: Sequence[KVCacheBlock],
        policy_factory: Callable[[int], EvictionPolicy],
        mapping: PriorityMapping,
    ) -> None:
        super().__init__(free_blocks, pool_blocks, mapping)
        self._policy_factory = policy_factory
        self._reset_state()

    def _reset_state(self) -> None:
        n = len(self.pool_blocks)
        self.policy = self._policy_factory(self.capacity)  # (sized by the blocks that hold content)
        self._leaf_only = self.policy.leaf_only
        self._tracks = self.policy.tracks_uses
        # the policy's on_evicted after a pop, unless its pop already forgets the victim
        self._on_evicted_after_pop = None if self.policy.forgets_on_pop else self.policy.on_evicted
        self._expect = -1  # blocks the fused release placed for the next append_n (-1: none)
        self._where = bytearray(n)
        self._blocked: dict[int, None] = {}
        self._held = 0  # blocks in the policy or blocked (the rest of num_free_blocks is the list)
        self._hash: list[Any] = [None] * n  # the hash the policy knows the block under
        self._parent = [NO_PARENT] * n
        self._pgen = [0] * n
        self._gen = [0] * n
        self._children = [0] * n
        self._cls = [0] * n  # request priority of the block's last releaser (eviction counters)
        # ``lru`` only: free blocks whose hash ``BlockPool.evict_blocks`` stripped, kept at their place in the order
        # (as in stock vLLM's one list) with no content; their eviction was counted when the hash went
        self._emptied: set[int] = set()
        self._in_place = self.policy.name == "lru"

    # ------------------------------------------------------------ queue interface
    def _evict(self, k: int, now: float) -> list[int]:
        # NOTE: hot path (one iteration per evicted block): the unlink is inlined, locals only.
        policy = self.policy
        pop = policy.pop
        pop_exposed = policy.pop_exposed
        expose = policy.expose
        on_evicted = self._on_evicted_after_pop
        where = self._where
        known = self._hash
        parent = self._parent
        gen = self._gen
        pgen = self._pgen
        children = self._children
        blocked = self._blocked
        ids: list[int] = []
        append = ids.append
        exposed = NO_PARENT  # the last victim's parent, unblocked and not yet given to the policy
        last = k - 1
        for i in range(k):
            if exposed == NO_PARENT:
                bid = pop(now)
            else:
                bid = pop_exposed(exposed, now)
                exposed = NO_PARENT
            if bid is None:  # only blocked blocks are left (duplicates, see the module docstring)
                bid = next(iter(blocked))
                del blocked[bid]
                if on_evicted is None:  # (a policy that forgets its victims in pop never popped this one)
                    policy.on_evicted(bid, known[bid])
            where[bid] = IN_LIST
            if on_evicted is not None:
                on_evicted(bid, known[bid])
            known[bid] = None
            if children[bid]:  # a blocked block evicted anyway: its children's links go stale
                children[bid] = 0
                gen[bid] += 1
            p = parent[bid]
            if p >= 0:
                parent[bid] = NO_PARENT
                if gen[p] == pgen[bid]:
                    c = children[p] - 1
                    children[p] = c
                    if c == 0 and where[p] == BLOCKED:
                        del blocked[p]
                        where[p] = IN_POLICY
                        if i < last:
                            exposed = p
                        else:
                            expose(p, now)
            append(bid)
        get = self.counters.get
        counted = ids
        if self._emptied:  # (lru: blocks evict_blocks emptied in place; counted then)
            counted = [b for b in ids if b not in self._emptied]
            self._emptied.difference_update(ids)
        for c, cnt in Counter(map(self._cls.__getitem__, counted)).items():
            get(c).evicted_blocks += cnt
        return ids

    def _take_out(self, bid: int) -> bool:
        where = self._where
        w = where[bid]
        if w == IN_LIST:
            return False
        where[bid] = IN_LIST
        if w == IN_POLICY:
            self.policy.remove(bid)
            self._emptied.discard(bid)
        else:
            del self._blocked[bid]
        return True

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        if self._placed_by_release(len(blocks)):
            return
        plain: list[KVCacheBlock] = []
        now = -1.0
        policy = self.policy
        known = self._hash
        where = self._where
        children = self._children
        leaf_only = self._leaf_only
        held = 0
        for b in blocks:
            h = b._block_hash  # (the block_hash property, without the call)
            if h is None:
                plain.append(b)
                continue
            bid = b.block_id
            held += 1
            if where[bid] != IN_LIST:  # placed by the fused release in on_request_release
                continue
            k = known[bid]
            if k is not h and k != h:
                self._register(bid, h, b.block_hash_num_tokens or 0)
            if leaf_only and children[bid]:
                self._blocked[bid] = None
                where[bid] = BLOCKED
            else:
                if now < 0:
                    now = _runtime.now()
                policy.push(bid, now)
                where[bid] = IN_POLICY
        self._held += held
        self.num_free_blocks += held
        if plain:
            super().append_n(plain)

    def _eviction_order(self) -> Iterator[int]:
        return eviction_order(self, _runtime.now())

    def _holds(self, bid: int) -> bool:
        return self._where[bid] != IN_LIST

    # ------------------------------------------------------------ eviction
    def _drop(self, bid: int, now: float) -> None:
        """``bid``'s content goes (it is about to be evicted by vLLM)."""
        h = self._hash[bid]
        if h is None:
            return
        self.counters.get(self._cls[bid]).evicted_blocks += 1
        self._let_go(bid, h, now)

    def _let_go(self, bid: int, h: Any, now: float) -> None:
        """Content ``h`` leaves ``bid``: the policy forgets it as a drop (``on_evicted``), and ``bid``'s links go."""
        self.policy.on_evicted(bid, h)
        self._unlink(bid, now)

    def _unlink(self, bid: int, now: float) -> None:
        self._hash[bid] = None
        self._gen[bid] += 1
        self._children[bid] = 0  # children keep a link of an older generation: they never decrement it
        p = self._parent[bid]
        if p != NO_PARENT:
            self._parent[bid] = NO_PARENT
            if self._gen[p] == self._pgen[bid]:
                c = self._children[p] - 1
                self._children[p] = c
                if c == 0 and self._where[p] == BLOCKED:
                    del self._blocked[p]
                    self._where[p] = IN_POLICY
                    self.policy.expose(p, now)

    def _register(self, bid: int, h: Any, num_tokens: int, depth: int | None = None) -> None:
        """New content in ``bid`` (no parent link)."""
        now = _runtime.now()
        k = self._hash[bid]
        if k is not None:  # (content replaced without an eviction the queue saw: see on_blocks_cached)
            self._let_go(bid, k, now)
        self._hash[bid] = h
        if depth is None:
            depth = max(0, num_tokens // max(1, self._block_size_guess()) - 1)
        self.policy.on_cached(bid, h, depth, now)

    def _block_size_guess(self) -> int:
        return int(self.policy.config.block_size)

    # ------------------------------------------------------------ hooks called by the patches
    def on_blocks_cached(
        self,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_mask: Sequence[bool] | None,
        group: int = 0,
    ) -> None:
        """After ``BlockPool.cache_full_blocks`` of KV cache group ``group``: tell the policy about new content and
        link it to its parent (the request's previous block), unless a hit in that group needs no earlier block
        (``unlinked_groups``: a sliding window's blocks are reached without the blocks before them, so a parent
        there must not wait for its children, as it would behind a protected tier it does not belong to)."""
        if num_cached_blocks >= num_full_blocks:
            return
        # NOTE: hot path (one iteration per newly cached block): locals only, the link is inlined.
        now = _runtime.now()
        known = self._hash
        on_cached = self.policy.on_cached
        link = self._leaf_only and group not in self.unlinked_groups
        parent = self._parent
        pgen = self._pgen
        gen = self._gen
        children = self._children
        where = self._where
        pid = NO_PARENT
        if num_cached_blocks > 0 and link:
            prev = blocks[num_cached_blocks - 1]
            if prev._block_hash is not None and known[prev.block_id] is not None:
                pid = prev.block_id
        for i in range(num_cached_blocks, num_full_blocks):
            b = blocks[i]
            h = b._block_hash
            if h is None or (block_mask is not None and not block_mask[i - num_cached_blocks]):
                pid = NO_PARENT  # (null blocks carry no hash)
                continue
            bid = b.block_id
            k = known[bid]
            if k is not None:
                if k is h or k == h:
                    pid = bid
                    continue
                # new content in a block the policy knows under ``k`` (vLLM's partial->full promotion, its checkpoint
                # hashes): ``k`` left the block as a drop (no eviction counted: vLLM replaced it), so the policy's
                # per-content counts (lfu, unified: copies, ghost; unified: protected) let it go
                self._let_go(bid, k, now)
            known[bid] = h
            on_cached(bid, h, i, now)
            if pid >= 0 and link:
                parent[bid] = pid
                pgen[bid] = gen[pid]
                children[pid] += 1
                if where[pid] == IN_POLICY:  # only with duplicate blocks: the parent is free
                    self.policy.remove(pid)
                    self._blocked[pid] = None
                    where[pid] = BLOCKED
            pid = bid

    def _release(
        self,
        request: Any,
        groups: Sequence[Sequence[KVCacheBlock]],
        block_sizes: Sequence[int] | None,
        freeing_now: bool,
        num_cached: Sequence[int] | None,
        *,
        first: Sequence[int] | None = None,
        group_ids: Sequence[int] | None = None,  # (links come from cache_full_blocks: on_blocks_cached)
    ) -> None:
        prio, mapped, ret, scope, use_plan = self._request_retention(request, block_sizes)
        tracks = self._tracks
        fuse = freeing_now and tracks
        if freeing_now and not fuse:
            self._expect = -1
        now = _runtime.now()
        known = self._hash
        cls = self._cls
        policy = self.policy
        where = self._where
        children = self._children
        blocked = self._blocked
        leaf_only = self._leaf_only
        released = 0
        placed = 0
        run_ids: list[int] = []
        run_evs: list[int] = []  # the blocks of run_ids that became evictable
        batch = fuse and not use_plan  # the policy sees one release_run call per request
        for g, blocks in enumerate(groups):
            n = len(blocks)
            if not n:
                continue
            prios: list[int] | None = None
            durs: list[float | None] | None = None
            if use_plan:
                assert ret is not None and block_sizes is not None
                prios, durs = ret.block_plan(n, block_sizes[g], request.num_prompt_tokens, mapped)
            # NOTE: hot path (one iteration per released block), deepest block first
            for i in range(n - 1, (first[g] if first is not None else 0) - 1, -1):
                b = blocks[i]
                h = b._block_hash
                if h is None:  # (also the null block)
                    continue
                bid = b.block_id
                k = known[bid]
                if k is not h and k != h:
                    self._register(bid, h, 0, depth=i)
                cls[bid] = prio
                released += 1
                ev = False
                if fuse and b.ref_cnt == 1 and where[bid] == IN_LIST:  # the last reference goes now
                    placed += 1
                    if leaf_only and children[bid]:
                        blocked[bid] = None
                        where[bid] = BLOCKED
                    else:
                        where[bid] = IN_POLICY
                        ev = True
                if batch:
                    run_ids.append(bid)
                    if ev:
                        run_evs.append(bid)
                elif fuse:
                    if prios is None or durs is None:
                        policy.release(bid, mapped, None, scope, now, mapped, ev)
                    else:
                        policy.release(bid, prios[i], durs[i], scope, now, mapped, ev)
                elif tracks:
                    if prios is None or durs is None:
                        policy.on_release(bid, mapped, None, scope, now, mapped)
                    else:
                        policy.on_release(bid, prios[i], durs[i], scope, now, mapped)
        if run_ids:
            policy.release_run(run_ids, run_evs, mapped, scope, now, mapped)
        if fuse:
            self._expect = placed
        if released:
            self.counters.get(prio).released_blocks += released

    def on_arrival(self, request: Any) -> None:
        """At input processing (``EngineCore.preprocess_add_request``): the policy's per-request work ahead of
        the lookup (``unified``'s controller shadows), off the scheduler's step."""
        hashes = request.block_hashes
        if hashes and self._tracks:
            self._sighted(request, self.policy.on_arrival(hashes, self._arrival_retention(request)))

    def _policy_lookup(self, request: Any, mapped: int, held_blocks: int) -> None:
        if self._tracks:
            self.policy.lookup(request.block_hashes, held_blocks, mapped, self._take_sighting(request))

    def forget(self, block: KVCacheBlock) -> bool:
        """Before ``BlockPool.evict_blocks`` strips ``block``'s hash: take it out of the policy. Returns True
        when the block was free (the caller then puts it on the unhashed list). Content no hook registered (a
        partial entry, ``cache_partial_block``, in a block no release has freed since) is evicted too: counted
        under the block id's last releaser, as the run queue counts it."""
        bid = block.block_id
        queued = self._leave(bid)
        if self._hash[bid] is None:
            self.counters.get(self._cls[bid]).evicted_blocks += 1
        else:
            self._drop(bid, _runtime.now())
        return queued

    def stays_in_place(self, block: KVCacheBlock) -> bool:
        """Whether free cached ``block``, whose hash ``BlockPool.evict_blocks`` is about to strip, keeps its place
        in the order (then :meth:`emptied_in_place` follows, not :meth:`forget`): with ``lru`` only, which is
        stock vLLM's order. Stock's ``evict_blocks`` (``_maybe_evict_cached_block``) drops the hash and leaves
        the block where it is in its one free list, to be handed out when its turn comes; another policy moves it
        to the unhashed list (an empty block is reused before any cached one, as :meth:`forget` says)."""
        return self._in_place and self._where[block.block_id] == IN_POLICY

    def emptied_in_place(self, block: KVCacheBlock) -> None:
        """After ``evict_blocks`` stripped the hash of ``block`` (:meth:`stays_in_place`): its content is evicted
        (counted now, as vLLM emits ``BlockRemoved`` now) and the block stays in the order, empty."""
        bid = block.block_id
        self._drop(bid, _runtime.now())
        self._emptied.add(bid)

    def check(self) -> None:
        """Consistency check for tests: counts, positions and policy membership agree. O(n)."""
        in_policy = self.policy.evictable_ids()
        listed = self.unhashed_blocks()
        assert len(in_policy) == len(self.policy)
        assert self._held == len(in_policy) + len(self._blocked), "held count"
        assert self.num_free_blocks == len(listed) + self._held, "free count"
        for b in listed:
            assert self._where[b.block_id] == IN_LIST and b.block_hash is None, f"listed {b.block_id}"
            assert b.ref_cnt == 0
        for bid in in_policy:
            assert self._where[bid] == IN_POLICY, f"policy {bid}"
            b = self.pool_blocks[bid]
            assert b.ref_cnt == 0, f"policy block {bid} not free"
            if bid in self._emptied:  # (lru: emptied in place by evict_blocks)
                assert b.block_hash is None and self._hash[bid] is None, f"emptied block {bid} has content"
            else:
                assert b.block_hash is not None, f"policy block {bid} not cached"
        assert self._emptied <= in_policy, "emptied blocks out of the order"
        for bid in self._blocked:
            assert self._where[bid] == BLOCKED and self._children[bid] > 0
