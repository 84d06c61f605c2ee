"""What the plugin's two free queues share (imported only when the plugin is enabled: it imports vLLM).

Both keep vLLM's intrusive list for *unhashed* free blocks (reused first, exactly as stock vLLM) and order the
hashed (cached) free blocks themselves; ``num_free_blocks`` stays the total, so cached blocks count as free.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from operator import itemgetter
from typing import Any

from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

from kvretain.core.retention import PriorityMapping, RetentionConfig, RetentionError
from kvretain.integrations.vllm import _runtime
from kvretain.integrations.vllm._runtime import logger
from kvretain.integrations.vllm.config import retention_from_extra_args

SIGHTING = "_kvretain_sighting"
"""The attribute of a vLLM ``Request`` that carries the policy's arrival work to its first lookup."""
LOOKED_UP = "_kvretain_looked_up"
"""Set on a request at its first counted lookup: any later lookup of it is no first one (vLLM looks a request up
again, with ``num_preemptions`` still 0, after a KV connector's load failed under the recompute policy)."""
RETENTION = "_kvretain_retention"
"""The attribute of a vLLM ``Request`` that keeps its parsed retention: ``(extra_args, RetentionConfig | None)``."""


def _priority(request: Any) -> int:
    """A vLLM request's priority (0 when it has none)."""
    return int(getattr(request, "priority", 0) or 0)


class HookedFreeQueue(FreeKVCacheBlockQueue):  # type: ignore[misc]
    """A ``FreeKVCacheBlockQueue`` that the plugin's patches call into (see :mod:`._patches`)."""

    # NOTE: slots, not instance-dict entries: CPython 3.11 keeps at most 30 attributes of an object inline; past
    # that every attribute read goes through the instance dict (about 30% slower, measured), and the run queue
    # has 37. vLLM's own FreeKVCacheBlockQueue has no slots, so its attributes stay in a (small) dict.
    __slots__ = (
        "_expect",
        "_fed",
        "_held",
        "_mapped",
        "_warned",
        "allocating",
        "capacity",
        "counters",
        "manager",
        "mapping",
        "pending",
        "pool_blocks",
        "unlinked_groups",
    )

    def __init__(
        self, free_blocks: list[KVCacheBlock], pool_blocks: Sequence[KVCacheBlock], mapping: PriorityMapping
    ) -> None:
        super().__init__(free_blocks)
        self.pool_blocks = pool_blocks
        self.capacity = max(1, len(free_blocks))
        """The blocks that can hold cached content: those given free at the start (vLLM's pool keeps one as its
        null block), which size the policy's queues, ghosts and shadows (``EvictionPolicy.capacity``)."""
        # the admission KVCacheManager.allocate_slots is serving: (request, hit tokens, hash block size, resident
        # tokens), until its first eviction gives the lookup to the policy (feed_pending) or the call ends
        self.pending: tuple[Any, int, int, int] | None = None
        # the request whose lookup feed_pending gave the policy (its on_lookup then only counts)
        self._fed: Any = None
        self.mapping = mapping
        self.counters = _runtime.COUNTERS
        self._warned: set[str] = set()
        self._mapped: dict[int, int] = {}
        self._expect = -1  # blocks the fused release placed for the next append_n (-1: none)
        self._held = (
            0  # cached free blocks the queue orders (the rest of num_free_blocks is the unhashed list)
        )
        # the request KVCacheManager.allocate_slots is serving (hybrid models only) or Scheduler._connector_finished
        # is finishing: release_skipped's / release_freed's request
        self.allocating: Any = None
        # a weak reference to the KVCacheManager this pool serves (hybrid models only, set by its __init__): the
        # hook on a moved cache entry (BlockPool.move_block_hashes) finds the request's group tables through it
        self.manager: Any = None
        # the KV cache groups whose cache hits do not need every earlier block of the group (a sliding window,
        # chunked local attention, Mamba's states: vLLM's find_longest_cache_hit of such a group reads only the
        # blocks it ends on), set with ``manager`` on a hybrid model: no parent waits for a child there
        self.unlinked_groups: frozenset[int] = frozenset()

    # ------------------------------------------------------------ queue interface
    def popleft(self) -> KVCacheBlock:
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Unhashed blocks first (as stock vLLM), then cached ones in the queue's eviction order."""
        base = self.num_free_blocks - self._held
        if n <= base:
            return super().popleft_n(n)  # type: ignore[no-any-return]
        if n > self.num_free_blocks:
            raise ValueError("No free blocks available")
        ret: list[KVCacheBlock] = super().popleft_n(base) if base > 0 else []
        k = n - base
        self._held -= k
        self.num_free_blocks -= k
        if self.pending is not None:
            self.feed_pending()
        ids = self._evict(k, _runtime.now())
        if len(ids) == 1:
            ret.append(self.pool_blocks[ids[0]])
        else:  # (one C call for the whole batch)
            ret.extend(itemgetter(*ids)(self.pool_blocks))
        return ret

    def remove(self, block: KVCacheBlock) -> None:
        """A free block leaves the queue (a cache hit)."""
        if not self._leave(block.block_id):
            super().remove(block)

    def _leave(self, bid: int) -> bool:
        """Take cached free block ``bid`` out of the queue and the free count; False when it is not queued."""
        if not self._take_out(bid):
            return False
        self._held -= 1
        self.num_free_blocks -= 1
        return True

    def end_forget(self) -> None:
        """After ``BlockPool.evict_blocks`` stripped the hashes of the blocks :meth:`forget` was told of (the run
        queue's ghost reads vLLM's index until then)."""

    def stays_in_place(self, block: KVCacheBlock) -> bool:
        """Whether free cached ``block``, about to lose its hash in ``BlockPool.evict_blocks``, keeps its place in
        the queue's order (``lru``, the per-block queue's override); otherwise it moves to the unhashed list."""
        return False

    def emptied_in_place(self, block: KVCacheBlock) -> None:  # pragma: no cover - only where stays_in_place
        """``block`` (:meth:`stays_in_place`) lost its hash and stays where it is."""
        raise NotImplementedError

    def put_unhashed(self, blocks: list[KVCacheBlock]) -> None:
        super().append_n(blocks)

    def drain(self) -> None:
        """After a successful ``reset_prefix_cache`` (every hash is gone): move every queued block to the
        unhashed list, in the queue's eviction order, and start afresh. vLLM's own list keeps its order through
        the reset (its cached blocks, oldest first, behind the empty ones): ``lru`` then hands out the blocks stock
        vLLM does (the order walks the queue's own state, not vLLM's stripped hashes)."""
        ids = list(self._eviction_order())
        self.num_free_blocks -= len(ids)
        self._reset_state()
        self._mapped.clear()
        super().append_n([self.pool_blocks[i] for i in ids])

    def _placed_by_release(self, n: int) -> bool:
        """In ``append_n`` of ``n`` blocks: True when the fused release just before placed exactly these (the
        hashed ones whose last reference goes), so only the counts change."""
        expected = self._expect
        if expected < 0:
            return False
        self._expect = -1
        if expected != n:
            return False
        self._held += expected
        self.num_free_blocks += expected
        return True

    def _evict(self, k: int, now: float) -> list[int]:  # pragma: no cover - overridden
        """Take ``k`` cached free blocks out in eviction order; their ids."""
        raise NotImplementedError

    def _take_out(self, bid: int) -> bool:  # pragma: no cover - overridden
        """Take cached free block ``bid`` out of the queue; False when it is on the unhashed list."""
        raise NotImplementedError

    def _reset_state(self) -> None:  # pragma: no cover - overridden
        """Forget every queued block and all per-block state."""
        raise NotImplementedError

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    # prepend_n (unhashed blocks from BlockPool.free_blocks, reused first) is inherited.

    # ------------------------------------------------------------ eviction order
    def unhashed_blocks(self) -> list[KVCacheBlock]:
        """The free blocks on vLLM's list (no hash), in its order. O(n)."""
        return super().get_all_free_blocks()  # type: ignore[no-any-return]

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block in eviction order (the order ``popleft_n(num_free_blocks)`` would return them):
        the unhashed list, then the cached blocks in the queue's order. O(n); vLLM uses it in tests."""
        listed = self.unhashed_blocks()
        blocks = self.pool_blocks
        return listed + [blocks[i] for i in self._eviction_order()]

    def iter_blocks_after(self, cursor: KVCacheBlock | None) -> Iterator[KVCacheBlock]:
        """Free blocks in eviction order after ``cursor`` (``None``: from the first), as vLLM's queue walks its
        list; vLLM's lazy CPU offload walks this to store the blocks about to be evicted. The unhashed list
        comes first (reused first), then the cached blocks in the queue's order; a cursor among the cached
        blocks resumes after it (found by walking that order from its start). A cursor that is not free ends
        the walk at once, as a stale cursor of vLLM's own list does.

        NOTE: vLLM's list resumes in O(1); here starting a walk costs a snapshot of the queue's order (the runs'
        order for the run queue, every cached free block for the per-block queue) plus the blocks walked up to
        the cursor: fine for the offloader's once-per-step walk over small pools, linear in the cached free
        blocks on large ones."""
        if cursor is None or cursor.next_free_block is not None:  # (blocks on vLLM's list have a next block)
            yield from super().iter_blocks_after(cursor)
            walk = self._eviction_order()
        elif self._holds(cursor.block_id):
            walk = self._eviction_order()
            target = cursor.block_id
            for bid in walk:
                if bid == target:
                    break
        else:
            return
        blocks = self.pool_blocks
        for bid in walk:
            yield blocks[bid]

    def _eviction_order(self) -> Iterator[int]:  # pragma: no cover - overridden
        """The ids of the cached free blocks in the order the queue would evict them if every free block were
        taken at once (``popleft_n(num_free_blocks)``), without changing that order. Lapsed retention may be
        applied first (as the next eviction would). The queue must not change while the walk is under way."""
        raise NotImplementedError

    def _holds(self, bid: int) -> bool:  # pragma: no cover - overridden
        """Whether cached free block ``bid`` is queued (not on the unhashed list)."""
        raise NotImplementedError

    # ------------------------------------------------------------ hooks called by the patches
    def on_request_release(
        self,
        request: Any,
        groups: Sequence[Sequence[KVCacheBlock]],
        block_sizes: Sequence[int] | None,
        freeing_now: bool = False,
        num_cached: Sequence[int] | None = None,
        first: Sequence[int] | None = None,
        group_ids: Sequence[int] | None = None,
    ) -> None:
        """Before a request's blocks are freed: one release (a use) per hashed block, at the retention the
        request asks for (directives, else its mapped ``priority``), deepest block first (vLLM's free order).

        ``freeing_now``: the caller frees the blocks right after this call (``KVCacheManager.free``), so the
        blocks whose last reference goes are placed here and the ``append_n`` that follows only counts them.
        ``num_cached``: per group, how many leading blocks vLLM's manager has cached (full attention only; a
        hint the queue may use to skip hash reads). ``first``: per group, the position of the first block
        released (the ones before it are not; a group's blocks keep their positions, which directives and
        depths are reckoned by). ``group_ids``: the KV cache group of each of ``groups`` (default: its index), for
        :attr:`unlinked_groups`."""
        try:
            self._release(
                request, groups, block_sizes, freeing_now, num_cached, first=first, group_ids=group_ids
            )
        except Exception:
            if freeing_now:
                self._unplace(request, groups)  # the append_n that follows places the blocks
            raise

    def _release(
        self,
        request: Any,
        groups: Sequence[Sequence[KVCacheBlock]],
        block_sizes: Sequence[int] | None,
        freeing_now: bool,
        num_cached: Sequence[int] | None,
        *,
        first: Sequence[int] | None = None,
        group_ids: Sequence[int] | None = None,
    ) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def release_skipped(
        self,
        request: Any,
        blocks: Sequence[KVCacheBlock] | None,
        first: int,
        last: int,
        block_size: int,
        group: int = 0,
    ) -> None:
        """Before vLLM frees blocks of a running ``request`` that its attention no longer reads (a sliding
        window or chunked local attention moved past them: ``SingleTypeKVCacheManager._remove_blocks_in_range``
        of ``blocks``, the group's blocks, over ``[first, last)``): one release each, at the request's priority
        and retention, as its other blocks get when it ends. Without it vLLM's ``free_blocks`` placed them with no
        release, at the retention and class of whoever last released that block id. vLLM frees the blocks from
        ``last - 1`` down to the first null block (one an earlier call freed); so does this."""
        if not blocks:
            return
        last = min(last, len(blocks))
        lo = last
        while lo > first and not blocks[lo - 1].is_null:
            lo -= 1
        if lo < last:
            self.on_request_release(request, (blocks[:last],), (block_size,), first=(lo,), group_ids=(group,))

    def release_freed(
        self,
        request: Any,
        held: Mapping[int, KVCacheBlock],
        freed: Sequence[KVCacheBlock],
        block_size: int,
        null: KVCacheBlock,
        group: int = 0,
    ) -> None:
        """Before vLLM's ``free_blocks(freed)``, called by a group's manager while it serves a running ``request``
        (align-mode Mamba frees its retired state blocks this way, by rules of its own: see
        ``_patches._make_mamba_remove_skipped_blocks``; a partial hit's copy-on-write takes the cached block the
        request hit out of its table for the scheduler to free later, ``_patches._make_apply_cow``; align-mode Mamba
        moves a running request's own cache entry to a fresh block outside its table, which the scheduler frees
        later too, ``_patches._make_move_block_hashes``: a release leaves reference counts alone, vLLM's free
        places the block): one release for each block of ``freed`` that
        ``held`` (position -> block: the group's blocks the call may free, as they stood before it) names, at that
        position, as :meth:`release_skipped` does for a window. Other blocks are left to vLLM (placed as before);
        so are the group's other blocks, which this release masks with ``null`` (a release reads none below its
        first position)."""
        pos = {id(b): i for i, b in held.items()}
        at = {pos[id(b)]: b for b in freed if id(b) in pos}
        if not at:
            return
        blocks = [null] * (max(at) + 1)  # (still in use, or below the first released: not released)
        for i, b in at.items():
            blocks[i] = b
        self.on_request_release(request, (blocks,), (block_size,), first=(min(at),), group_ids=(group,))

    def _unplace(self, request: Any, groups: Sequence[Sequence[KVCacheBlock]]) -> None:
        """Undo the placement of a failed fused release: the ``append_n`` that follows places the blocks."""
        self._expect = -1
        for blocks in groups:
            for b in blocks:
                if b._block_hash is not None and b.ref_cnt == 1:
                    with contextlib.suppress(KeyError):  # (the release may have failed before placing it)
                        self._take_out(b.block_id)

    def _mapped_for(self, prio: int) -> int:
        """The retention priority request priority ``prio`` maps to (kept for the first
        :data:`~._runtime.MAX_PRIORITY_CLASSES` priorities seen since the last reset; any other is mapped again,
        which is cheap: a client picks its priority among 2**64, and keeping each one grew the engine's memory
        without bound)."""
        mapped = self._mapped.get(prio)
        if mapped is None:
            mapped = self.mapping.retention_for(prio)
            if len(self._mapped) < _runtime.MAX_PRIORITY_CLASSES:
                self._mapped[prio] = mapped
        return mapped

    def _request_retention(
        self, request: Any, block_sizes: Sequence[int] | None
    ) -> tuple[int, int, RetentionConfig | None, str | None, bool]:
        """What a release asks for: the request priority, its mapped retention, its directives (if any), its
        retention scope, and whether the directives need a per-block plan."""
        prio = _priority(request)
        ret = self._retention(request)
        use_plan = ret is not None and ret.needs_plan and block_sizes is not None
        return prio, self._mapped_for(prio), ret, ret.scope if ret is not None else None, use_plan

    def _retention(self, request: Any) -> RetentionConfig | None:
        """The request's retention fields, parsed at its first release and kept on the request with the
        ``extra_args`` they came from (parsed again only if vLLM gave the request other ones): a request released
        several times (preemption, a hybrid model's groups) is parsed once, up to 1024 directives."""
        sp = getattr(request, "sampling_params", None)
        extra = getattr(sp, "extra_args", None) if sp is not None else None
        if not extra:
            return None
        kept = getattr(request, RETENTION, None)
        if kept is not None and kept[0] is extra:
            return kept[1]  # type: ignore[no-any-return]
        try:
            ret = retention_from_extra_args(extra)
        except RetentionError as exc:  # validated at input; never fail the engine here
            self._warn_once("bad-retention", f"ignoring invalid retention fields: {exc}")
            ret = None
        setattr(request, RETENTION, (extra, ret))
        return ret

    def _arrival_retention(self, request: Any) -> int:
        """The retention a request's first lookup will be counted at (:meth:`_count_lookup`)."""
        return self._mapped_for(_priority(request))

    @staticmethod
    def _sighted(request: Any, seen: object | None) -> None:
        """Keep what the policy saw of ``request`` at its arrival for its first lookup (on the request: it goes
        with it, whether or not it is ever scheduled)."""
        if seen is not None:
            setattr(request, SIGHTING, seen)

    @staticmethod
    def _take_sighting(request: Any) -> object | None:
        """What :meth:`_sighted` kept for ``request`` (once: a resume is not a first lookup)."""
        seen = getattr(request, SIGHTING, None)
        if seen is not None:
            setattr(request, SIGHTING, None)
        return seen

    @staticmethod
    def _held_blocks(
        request: Any, num_hit_tokens: int, hash_block_size: int, resident_tokens: int | None
    ) -> int:
        """The leading blocks of ``request`` the policy is told the pool held at its lookup: vLLM's hit, or
        ``resident_tokens`` (with the last full block vLLM's cap kept out: ``_patches._resident_tokens``)."""
        held = num_hit_tokens if resident_tokens is None else resident_tokens
        return min(len(request.block_hashes), held // max(1, hash_block_size))

    def on_lookup(
        self, request: Any, num_hit_tokens: int, hash_block_size: int, resident_tokens: int | None = None
    ) -> None:
        """At admission (``record_prefix_cache_stats``, after ``allocate_slots``): per-priority counters
        (``num_hit_tokens``, vLLM's), and the policy's lookup unless the admission's first eviction gave it
        already (:meth:`feed_pending`); ``resident_tokens``: with the last full block when only vLLM's cap on a
        hit kept it out (``_patches._resident_tokens``)."""
        mapped = self._count_lookup(request, num_hit_tokens)
        if self._fed is request:
            self._fed = None
        elif mapped is not None:
            self._policy_lookup(
                request, mapped, self._held_blocks(request, num_hit_tokens, hash_block_size, resident_tokens)
            )

    def feed_pending(self) -> None:
        """The admission being allocated (:attr:`pending`) is about to evict: give the policy its lookup first.
        kvretain's ``KVCacheManager`` and replay give a lookup to the policy before the admission's evictions
        (ARC's adaptation precedes its REPLACE; a controller that changes its tables at this lookup keys the
        victims by them), while vLLM records a lookup only after ``allocate_slots`` has evicted: the plugin gives
        it here, at the first eviction of that call (an allocation that fails evicts nothing: vLLM checks the
        free blocks first), and :meth:`on_lookup` then only counts it.

        Never raises: it runs inside :meth:`popleft_n`, within vLLM's ``get_new_blocks``, once the free counts
        have been taken down; an error is a hook error (``lookup``), as one in :meth:`on_lookup` is, the
        eviction goes on, and the lookup is not given again at the record (the policy may have taken part of
        it)."""
        request, hits, block_size, resident = self.pending  # type: ignore[misc]
        self.pending = None
        try:
            mapped = self._first_lookup_retention(request)
            if mapped is not None:
                self._fed = request
                self._policy_lookup(request, mapped, self._held_blocks(request, hits, block_size, resident))
        except Exception:
            _runtime.HOOK_ERRORS.record("lookup", "kvretain: lookup hook failed (ignored)")

    def _policy_lookup(self, request: Any, mapped: int, held_blocks: int) -> None:  # pragma: no cover
        """Give the policy a request's first lookup: ``held_blocks`` leading blocks held, at retention ``mapped``."""
        raise NotImplementedError

    def _first_lookup_retention(self, request: Any) -> int | None:
        """The request's mapped retention when this admission is its first lookup, else ``None`` (a resume after
        preemption, or any other lookup after the request's first, see :meth:`_count_lookup`)."""
        if getattr(request, "num_preemptions", 0) > 0:
            return None
        if not getattr(request, "resumable", False) and getattr(request, LOOKED_UP, False):
            return None
        return self._mapped_for(_priority(request))

    def _count_lookup(self, request: Any, num_hit_tokens: int) -> int | None:
        """Per-priority counters of an admission; the request's mapped retention, or ``None`` for a resume
        after preemption, or any other lookup after the request's first (a KV connector's failed load puts it
        back to waiting unpreempted: :data:`LOOKED_UP`): its hits are counted apart, as vLLM does for a resume,
        and it is no new lookup. A streaming-input session's chunks (``resumable``) each count, as vLLM counts
        them."""
        mapped = self._first_lookup_retention(request)
        if not getattr(request, "resumable", False):
            setattr(request, LOOKED_UP, True)
        self.counters.get(_priority(request)).record_lookup(
            int(request.num_tokens), num_hit_tokens, mapped is None
        )
        return mapped

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg)
