"""The patches that put a kvretain policy inside vLLM 0.33 (imported only when the plugin is enabled).

vLLM keeps ownership of allocation, hashing, cache hits, KV events and metrics; only the order in which
cached free blocks are evicted changes, plus the retention information attached when a request releases
its blocks. Patched in place (classes are imported by name elsewhere in vLLM, so module attributes cannot
be swapped):

* ``BlockPool.__init__``: install the retention queue on plain prefix-caching pools: :class:`RunFreeQueue`
  (``unified`` at run granularity, the default) or :class:`RetentionFreeQueue` (any policy, per block).
* ``BlockPool.cache_full_blocks`` (per-block queue only): new content and parent/child links for the policy.
* ``BlockPool.cache_partial_block`` (run queue only; hybrid layouts that hash inside a block): a block in use whose
  partial entry vLLM grows or replaces, and, on a pool that has written one, a partial entry ``cache_full_blocks``
  promotes to the full block (a wrapper on that pool object alone): the block's old content leaves the queue as a
  drop (:meth:`RunFreeQueue.content_replaced`; the per-block queue sees it in its ``cache_full_blocks`` hook and at
  the release).
* ``BlockPool.reset_prefix_cache`` / ``evict_blocks``: keep the policy in step when hashes are dropped. vLLM's
  scheduler calls ``evict_blocks`` for a KV connector's failed loads (``Scheduler._handle_invalid_blocks``, under
  ``kv_load_failure_policy="fail"``) with blocks running requests hold, which those requests then free unhashed
  (to the front, as any empty block); a free cached block it names (a direct call) loses its hash where it lies in
  stock's one list: ``lru`` keeps it there, empty (:meth:`RetentionFreeQueue.stays_in_place`), every other policy
  moves it behind the empty blocks, ahead of every cached one (it holds nothing to keep).
* ``KVCacheManager.free`` / ``pop_blocks_for_free``: per-block retention of the releasing request (and, for
  the run queue, new content is registered there). For the run queue on a plain full-attention group, ``free``
  does the release and vLLM's ``BlockPool.free_blocks`` in one pass (:meth:`RunFreeQueue.free_request`).
* ``KVCacheManager.allocate_slots``: notes an admission vLLM looked up (its hits), whose lookup the queue gives
  the policy at the call's first eviction (:meth:`HookedFreeQueue.feed_pending`: kvretain's pool hears of a
  lookup before the admission evicts); on a hybrid model it also tells the queue the request (below).
* ``KVCacheManager.record_prefix_cache_stats``: per-priority hit counters, and the policy's lookup hook where
  the admission evicted nothing.
* ``SingleTypeKVCacheManager._remove_blocks_in_range`` (sliding-window and chunked-local attention free blocks
  mid-request), with the request ``allocate_slots`` names on a hybrid model (``KVCacheManager.__init__`` marks
  such a pool): the blocks freed there are released at their request's priority and retention
  (:meth:`HookedFreeQueue.release_skipped`).
* ``MambaManager.remove_skipped_blocks``: align-mode Mamba (the mode prefix caching uses) frees its retired state
  blocks mid-request by rules of its own, past the hook above; what it hands ``free_blocks`` during this call is
  released at the running request's priority and retention first (:meth:`HookedFreeQueue.release_freed`).
* ``Scheduler._connector_finished``: with a KV connector, vLLM frees a finished request's out-of-window blocks
  there (``KVCacheManager.remove_skipped_blocks``), outside ``allocate_slots``; the pool's queue is told the request
  during the call, as ``allocate_slots`` tells it, so the two hooks above release those blocks at its retention too.
* ``SingleTypeKVCacheManager._apply_cow`` (a partial, sub-block prefix hit on a hybrid model with align-mode Mamba,
  from ``allocate_slots``): the request's table takes a private copy in place of the cached block it hit, which
  the scheduler frees once the copy has run, outside any request; that block is released at the request's priority
  and retention here (:meth:`HookedFreeQueue.release_freed`), as the request's own free would have released it.
* ``BlockPool.move_block_hashes`` (align-mode Mamba's ``allocate_new_blocks``, from ``allocate_slots``, when a
  running request's own partial prompt-tail state was cached): the state's cache entry moves to a fresh block that
  holds a copy of it, in no request's table, which the scheduler frees once the copy has run; that block is
  released at the request's priority and retention here, at the state block's position in the request's group
  table (:meth:`HookedFreeQueue.release_freed`; found through ``KVCacheManager.__init__``, which names the manager
  to the queue on a hybrid model). Only on a move: a plain model never calls it.
* ``ChatCompletionRequest`` / ``CompletionRequest.to_sampling_params`` (OpenAI server, HTTP 400 before a stream
  starts), ``InputProcessor._validate_params`` (front end, HTTP 400) and ``EngineCore.preprocess_add_request``
  (engine core, a per-request ``validation_error``): reject bad retention directives; the latter, once vLLM has
  hashed the request's blocks, also hands the request to the queue's ``on_arrival`` (:func:`request_arrived`).

A patch never raises into vLLM's busy loop: a hook error is counted (``stats()["hook_errors"]``), logged (with its
traceback the first time) and the stock code path continues.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    MambaManager,
    SingleTypeKVCacheManager,
)
from vllm.v1.request import RequestStatus

from kvretain.core.policy import make_policy
from kvretain.integrations.vllm import metrics
from kvretain.integrations.vllm._queue import RetentionFreeQueue
from kvretain.integrations.vllm._runs import RunFreeQueue
from kvretain.integrations.vllm._runtime import HOOK_ERRORS, logger
from kvretain.integrations.vllm.config import PluginConfig, validation_message

_ORIGINALS: dict[tuple[type, str], Callable[..., Any]] = {}
_VLLM_FREE_BLOCKS = BlockPool.free_blocks
"""vLLM's ``BlockPool.free_blocks`` as the plugin found it (the fused free does what this does; a pool whose
``free_blocks`` is anything else keeps the general path)."""
_FOUND_VLLMS_FREE = _VLLM_FREE_BLOCKS.__module__ == "vllm.v1.core.block_pool"
"""False when something wrapped ``free_blocks`` before the plugin was imported (then never fused)."""
_active: PluginConfig | None = None


def _hook_failed(hook: str, msg: str) -> None:
    """In an ``except`` block of a patch: count and log the error (see :class:`._runtime.HookErrors`)."""
    HOOK_ERRORS.record(hook, msg)


def _patch(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    key = (cls, name)
    if key in _ORIGINALS:
        return
    orig = cls.__dict__[name]
    wrapper = make(orig)
    functools.update_wrapper(wrapper, orig)
    _ORIGINALS[key] = orig
    setattr(cls, name, wrapper)


QUEUE_TYPES = (RetentionFreeQueue, RunFreeQueue)


def _queue(pool: Any) -> RetentionFreeQueue | RunFreeQueue | None:
    q = getattr(pool, "free_block_queue", None)
    return q if type(q) in QUEUE_TYPES else None


def _served(q: Any, request_id: str) -> Any:
    """The request ``q``'s release hooks serve (``allocating``: set by ``KVCacheManager.allocate_slots`` and
    ``Scheduler._connector_finished``) when ``q`` is a retention queue and that request is ``request_id``; else
    None (another caller: its blocks are placed as before)."""
    if type(q) not in QUEUE_TYPES:
        return None
    request = q.allocating
    return request if request is not None and request.request_id == request_id else None


# ---------------------------------------------------------------- BlockPool
def _index_entry(pool: Any) -> Callable[[Any], Any]:
    """What ``pool``'s hash index holds under a key: None, a block, or a dict of blocks by id (vLLM's
    ``BlockHashToBlockMap`` keeps a duplicate's blocks in such a dict; an older vLLM's plain dict holds dicts).
    Read through ``pool`` at each call: ``reset_prefix_cache`` replaces the index."""

    def entry(key: Any) -> Any:
        index = pool.cached_block_hash_to_block
        cache = index if isinstance(index, dict) else getattr(index, "_cache", None)
        return cache.get(key) if isinstance(cache, dict) else None

    return entry


def install_queue(pool: Any, cfg: PluginConfig) -> RetentionFreeQueue | RunFreeQueue:
    """Replace ``pool``'s free queue (all blocks free but the null block) with a policy-backed one."""
    old = pool.free_block_queue
    free = old.get_all_free_blocks()
    num_blocks = len(pool.blocks)
    pcfg = cfg.policy_config(int(pool.hash_block_size))
    queue: RetentionFreeQueue | RunFreeQueue
    if cfg.uses_run_queue:
        queue = RunFreeQueue(free, pool.blocks, pcfg, cfg.mapping)
        if pcfg.ghost_factor > 0:  # (only the ghost reads it)
            queue.set_index(_index_entry(pool))
    else:
        queue = RetentionFreeQueue(
            free,
            pool.blocks,
            lambda capacity: make_policy(cfg.policy, num_blocks, pcfg, capacity=capacity),
            cfg.mapping,
        )
    pool.free_block_queue = queue
    metrics.register_queue(queue)  # per-priority series in /metrics (kvretain.integrations.vllm.metrics)
    return queue


def _make_pool_init(orig: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        cfg = _active
        if cfg is None or type(self) is not BlockPool:
            return
        if not self.enable_caching:
            # NOTE: vLLM builds the pool of a server without prefix caching (--no-enable-prefix-caching, or a model
            # it turns caching off for) all the same: the plugin said it was enabled and then did nothing, and
            # /metrics had no kvretain series, without a word
            logger.warning(
                "kvretain: prefix caching is off in this %d-block KV cache (--enable-prefix-caching): there are "
                "no cached blocks to retain; %s has no effect here",
                len(self.blocks),
                cfg.describe(),
            )
            return
        if self.get_num_free_blocks() != len(self.blocks) - 1:
            return  # not a fresh pool: leave it stock
        try:
            install_queue(self, cfg)
            logger.info(
                "kvretain: %s eviction policy installed on a %d-block prefix cache",
                cfg.describe(),
                len(self.blocks),
            )
        except Exception:
            _hook_failed("install", "kvretain: could not install the retention queue; this pool stays stock")

    return __init__


def _make_cache_full_blocks(orig: Callable[..., Any]) -> Callable[..., Any]:
    def cache_full_blocks(
        self: Any,
        request: Any,
        blocks: Any,
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Any = None,
    ) -> None:
        orig(
            self,
            request,
            blocks,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            block_mask,
        )
        q = self.free_block_queue
        if type(q) is RetentionFreeQueue:  # (the run queue registers content at release)
            try:
                q.on_blocks_cached(blocks, num_cached_blocks, num_full_blocks, block_mask, kv_cache_group_id)
            except Exception:
                _hook_failed("cache", "kvretain: cache_full_blocks hook failed (ignored)")

    return cache_full_blocks


def _make_cache_partial_block(orig: Callable[..., Any]) -> Callable[..., Any]:
    def cache_partial_block(self: Any, request: Any, block: Any, *args: Any, **kwargs: Any) -> Any:
        q = self.free_block_queue
        if type(q) is not RunFreeQueue:  # (the per-block queue sees new hashes where it registers content)
            return orig(self, request, block, *args, **kwargs)
        old = block.block_hash
        out = orig(self, request, block, *args, **kwargs)
        try:
            if "cache_full_blocks" not in vars(self):
                _follow_promotions(self, q)
            if old is not None and block.block_hash != old:
                q.content_replaced(block, old)
        except Exception:
            _hook_failed("cache", "kvretain: cache_partial_block hook failed (ignored)")
        return out

    return cache_partial_block


def _follow_promotions(pool: Any, q: RunFreeQueue) -> None:
    """On ``pool``, which has written a partial entry: ``cache_full_blocks`` tells the run queue of each block whose
    partial entry it promotes to the full block's (the only new full block vLLM finds hashed already). A wrapper
    on this pool object alone, so pools that never hash inside a block (every plain model) pay nothing."""
    orig = pool.cache_full_blocks  # (the class's, bound)

    def cache_full_blocks(
        request: Any, blocks: Any, num_cached_blocks: int, num_full_blocks: int, *args: Any, **kwargs: Any
    ) -> None:
        hashed = [
            (b, b.block_hash) for b in blocks[num_cached_blocks:num_full_blocks] if b.block_hash is not None
        ]
        orig(request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs)
        try:
            for b, old in hashed:
                if b.block_hash != old:
                    q.content_replaced(b, old)
        except Exception:
            _hook_failed("cache", "kvretain: cache_full_blocks hook failed (ignored)")

    pool.cache_full_blocks = cache_full_blocks


def _make_reset(orig: Callable[..., Any]) -> Callable[..., Any]:
    def reset_prefix_cache(self: Any) -> bool:
        ok = bool(orig(self))
        q = _queue(self)
        if ok and q is not None:
            try:
                q.drain()
            except Exception:  # (vLLM has dropped every hash: a block the queue still ranks evicts as empty)
                _hook_failed("reset", "kvretain: reset_prefix_cache hook failed (ignored)")
        return ok

    return reset_prefix_cache


def _make_evict_blocks(orig: Callable[..., Any]) -> Callable[..., Any]:
    def evict_blocks(self: Any, block_ids: set[int]) -> None:
        q = _queue(self)
        if q is None:
            orig(self, block_ids)
            return
        moved = []
        in_place = []
        if not isinstance(block_ids, (set, frozenset, list, tuple)):
            # (read twice, here and by vLLM: a one-shot iterable would be used up)
            block_ids = list(block_ids)
        try:
            # the blocks vLLM's loop reaches, in its order: ``self.blocks[bid]`` as it indexes (a negative id
            # counts from the end), up to the first id it refuses (its assertion, ``bid < len``, or the index's
            # own error), where its loop stops with the blocks before it already stripped
            n = len(self.blocks)
            for bid in block_ids:
                if not -n <= bid < n:
                    break
                blk = self.blocks[bid]
                if blk.block_hash is None:
                    continue
                if q.stays_in_place(blk):  # (lru: where stock's one list keeps it)
                    in_place.append(blk)
                elif q.forget(blk):
                    moved.append(blk)
        except (
            Exception
        ):  # (vLLM's own eviction still runs: vLLM calls this from its step, which must not die)
            _hook_failed("evict", "kvretain: evict_blocks hook failed (ignored)")
        try:
            orig(self, block_ids)
        finally:
            q.end_forget()
            # what vLLM stripped (all of it, or what it reached before raising) is free and unhashed; a block it
            # did not reach keeps its hash and goes back to the order (or, kept in place, stays as it was)
            if moved or in_place:
                try:
                    for b in in_place:
                        if b.block_hash is None:
                            q.emptied_in_place(b)
                    q.put_unhashed([b for b in moved if b.block_hash is None])
                    kept = [b for b in moved if b.block_hash is not None]
                    if kept:
                        q.append_n(kept)
                except Exception:
                    _hook_failed("evict", "kvretain: evict_blocks hook failed (ignored)")

    return evict_blocks


# ---------------------------------------------------------------- KVCacheManager
def _block_sizes(manager: Any) -> list[int]:
    return [int(m.block_size) for m in manager.coordinator.single_type_managers]


def _full_attention(manager: Any) -> Any:
    """The manager's one single-type manager when it is a plain full-attention group (no null blocks, no
    skipped blocks; ``num_cached_block`` counts its leading cached blocks); else ``None``."""
    managers = manager.coordinator.single_type_managers
    if len(managers) != 1 or type(managers[0]) is not FullAttentionManager:
        return None
    return managers[0]


def _group_of(manager: Any) -> int:
    """The KV cache group a single-type manager serves (the index of its group; 0 where vLLM names none)."""
    return int(getattr(manager, "kv_cache_group_id", 0))


def _hits_need_the_prefix(manager: Any) -> bool:
    """Whether a cache hit in this single-type manager's group needs every earlier block of the group: full
    attention's lookup (``FullAttentionManager.find_longest_cache_hit``, which its subclasses keep) walks the
    prefix from its first block; a sliding window's, chunked local attention's and Mamba's read only the blocks a
    hit ends on."""
    own = getattr(type(manager), "find_longest_cache_hit", None)
    return getattr(own, "__func__", own) is FullAttentionManager.find_longest_cache_hit.__func__


def _num_cached(manager: Any, request_id: str) -> list[int] | None:
    """How many leading blocks of the request vLLM has cached (they carry a hash), for a single full-attention
    group; ``None`` otherwise (sparse managers pad with null blocks or skip blocks)."""
    m = _full_attention(manager)
    return None if m is None else [int(m.num_cached_block.get(request_id, 0))]


def _fused_free(manager: Any, q: Any) -> Any:
    """The single-type manager whose ``free`` :meth:`RunFreeQueue.free_request` may do in one pass with the
    release: the run queue, a plain full-attention group on this pool, and vLLM's own ``free`` methods on the way
    (coordinator, manager, the pool's ``free_blocks``: nothing else hooked there); else ``None``."""
    if type(q) is not RunFreeQueue:
        return None
    m = _full_attention(manager)
    pool = manager.block_pool
    if (
        m is None
        or m.block_pool is not pool
        or type(pool) is not BlockPool
        # (the bound method's function, not the pool's __dict__: reading an object's __dict__ makes CPython
        # 3.11+ give up its inline attribute values, and every attribute read on the pool in vLLM's hot paths slows)
        or getattr(pool.free_blocks, "__func__", None) is not _VLLM_FREE_BLOCKS
        or not _FOUND_VLLMS_FREE
        or type(manager.coordinator).free is not KVCacheCoordinator.free
        or type(m).free is not SingleTypeKVCacheManager.free
        or type(m).pop_blocks_for_free is not SingleTypeKVCacheManager.pop_blocks_for_free
    ):
        return None
    return m


def _own_blocks(manager: Any, request_id: str) -> tuple[list[Any], ...]:
    """The request's blocks per KV cache group, with the groups whose blocks live in another pool left empty.

    NOTE: HiSparse gives its host group a pool of its own (``HiSparseSourceManager.bind_host_pool``) whose block
    ids overlap the device pool's: only the device pool's own blocks may enter its queue (group indices are
    kept, for the per-group block sizes and cached counts)."""
    pool = manager.block_pool
    coord = manager.coordinator
    return tuple(
        blocks if m.block_pool is pool else []
        for m, blocks in zip(coord.single_type_managers, coord.get_blocks(request_id), strict=True)
    )


def _make_free(orig: Callable[..., Any]) -> Callable[..., Any]:
    def free(self: Any, request: Any) -> None:
        q = self.block_pool.free_block_queue
        m = _fused_free(self, q)
        if m is not None:  # the release and vLLM's free of the blocks in one pass
            rid = request.request_id
            num_cached = int(m.num_cached_block.get(rid, 0))
            blocks = m.pop_blocks_for_free(rid)  # (vLLM's bookkeeping of the request, as its free does)
            try:
                q.free_request(request, blocks, int(m.block_size), num_cached, self.block_pool.free_blocks)
            except Exception:  # (every block is freed by then: free_request finishes vLLM's free first)
                _hook_failed("free", "kvretain: release hook failed (blocks released at default retention)")
            return
        if type(q) in QUEUE_TYPES:
            try:
                rid = request.request_id
                q.on_request_release(
                    request,
                    _own_blocks(self, rid),
                    _block_sizes(self),
                    freeing_now=True,
                    num_cached=_num_cached(self, rid),
                )
            except Exception:
                _hook_failed("free", "kvretain: release hook failed (blocks released at default retention)")
            try:
                orig(self, request)
            finally:
                q._expect = -1  # the fused release's placement is for this free only
            return
        orig(self, request)

    return free


def _make_pop_blocks_for_free(orig: Callable[..., Any]) -> Callable[..., Any]:
    def pop_blocks_for_free(self: Any, request: Any) -> Any:
        # NOTE: the release reads the request's per-group tables before vLLM pops them, as ``free`` does: what
        # vLLM returns is every group's blocks concatenated, each without its leading null blocks
        # (``trim_null_head``), so positions there are not token positions (a directive would land on the wrong
        # blocks) and the groups' block sizes cannot be told apart (directives were dropped)
        q = self.block_pool.free_block_queue
        read: tuple[tuple[list[Any], ...], list[int], list[int] | None] | None = None
        if type(q) in QUEUE_TYPES:
            try:
                rid = request.request_id
                read = (
                    tuple(list(g) for g in _own_blocks(self, rid)),
                    _block_sizes(self),
                    _num_cached(self, rid),
                )
            except Exception:
                _hook_failed("pop", "kvretain: release hook failed (blocks released at default retention)")
        blocks = orig(self, request)
        if read is not None and any(read[0]):
            try:
                q.on_request_release(request, read[0], read[1], num_cached=read[2])
            except Exception:
                _hook_failed("pop", "kvretain: release hook failed (blocks released at default retention)")
        return blocks

    return pop_blocks_for_free


def _make_manager_init(orig: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        try:
            q = self.block_pool.free_block_queue
            if type(q) in QUEUE_TYPES and _full_attention(self) is None:
                # a group may free blocks mid-request: release_skipped needs the request (allocate_slots sets
                # ``allocating`` where the pool has a manager)
                q.manager = weakref.ref(self)  # (for a moved cache entry: _make_move_block_hashes)
                q.unlinked_groups = frozenset(
                    _group_of(m)
                    for m in self.coordinator.single_type_managers
                    if not _hits_need_the_prefix(m)
                )
        except Exception:
            _hook_failed("manager", "kvretain: cannot follow a hybrid model's mid-request frees (ignored)")

    return __init__


def _make_allocate_slots(orig: Callable[..., Any]) -> Callable[..., Any]:
    def allocate_slots(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        q = self.block_pool.free_block_queue
        if type(q) not in QUEUE_TYPES:
            return orig(self, request, *args, **kwargs)
        try:
            if (
                request.num_computed_tokens == 0
                and request.status is not RequestStatus.RUNNING
                and self.prefix_cache_lookup_enabled(request)
            ):
                # an admission vLLM looked the prefix up for (the scheduler then records it with these hits):
                # its lookup goes to the policy before the call's first eviction (HookedFreeQueue.feed_pending).
                # NOTE: not a RUNNING request: the scheduler's running loop allocates for one whose
                # num_computed_tokens a failed synchronous KV load set to 0, and records no lookup for it
                hits = int(kwargs.get("num_new_computed_tokens", args[1] if len(args) > 1 else 0))
                bs = int(self.block_pool.hash_block_size)
                q.pending = (request, hits, bs, _resident_tokens(self, request, hits, bs))
        except Exception:
            _hook_failed("lookup", "kvretain: lookup hook failed (ignored)")
        hybrid = q.manager is not None
        if hybrid:
            q.allocating = request  # (for _remove_blocks_in_range, which vLLM calls from here)
        try:
            return orig(self, request, *args, **kwargs)
        finally:
            q.pending = None
            if hybrid:
                q.allocating = None

    return allocate_slots


def _make_remove_blocks_in_range(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _remove_blocks_in_range(self: Any, request_id: str, first_block: int, last_block: int) -> None:
        pool = self.block_pool
        q = pool.free_block_queue
        request = _served(q, request_id) if type(pool) is not _ReleasingPool else None  # (that one releases)
        if request is not None:
            try:
                q.release_skipped(
                    request,
                    self.req_to_blocks.get(request_id),
                    first_block,
                    last_block,
                    self.block_size,
                    _group_of(self),
                )
            except Exception:
                _hook_failed("skip", "kvretain: release hook failed (blocks released at default retention)")
        orig(self, request_id, first_block, last_block)

    return _remove_blocks_in_range


class _ReleasingPool:
    """What an align-mode ``MambaManager`` sees as its ``block_pool`` while ``remove_skipped_blocks`` serves the
    request ``KVCacheManager.allocate_slots`` is allocating for: the manager's pool, whose ``free_blocks`` first
    releases the request's blocks it is handed (:meth:`HookedFreeQueue.release_freed`; ``held``: the blocks the
    call may free, by position, as they stood before it).

    NOTE: vLLM 0.33's ``MambaManager`` in align mode frees blocks twice there, neither through
    ``SingleTypeKVCacheManager._remove_blocks_in_range`` (the window hook): its own ``_remove_blocks_in_range``
    (from ``_num_retired_blocks``, past null gaps: the range is noted as it begins, :meth:`note`) and the state
    block it kept, ``blocks[last_state_block_idx]`` (noted when the view is made). Whatever it hands
    ``free_blocks`` is what it frees, so its rules for what to free are not copied; only where it may free is
    read, so that the work per call is the range it frees, not the request's whole table (the call runs once per
    step for every running request)."""

    __slots__ = ("_block_size", "_group", "_pool", "_queue", "_request", "held")

    def __init__(
        self, pool: Any, queue: Any, request: Any, held: dict[int, Any], block_size: int, group: int
    ) -> None:
        self._pool = pool
        self._queue = queue
        self._request = request
        self.held = held
        self._block_size = block_size
        self._group = group

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def note(self, table: list[Any], lo: int, hi: int) -> None:
        """The blocks of ``table[lo:hi]`` (not null) may be freed now: their positions."""
        held = self.held
        for i in range(lo, hi):
            b = table[i]
            if not b.is_null:
                held[i] = b

    def free_blocks(self, ordered_blocks: Any) -> None:
        blocks = list(ordered_blocks)
        pool = self._pool
        try:
            self._queue.release_freed(
                self._request, self.held, blocks, self._block_size, pool.null_block, self._group
            )
        except Exception:
            _hook_failed("skip", "kvretain: release hook failed (blocks released at default retention)")
        pool.free_blocks(blocks)


def _releasing_pool(manager: Any, request_id: str) -> _ReleasingPool | None:
    """The pool view for an align-mode Mamba manager's ``remove_skipped_blocks`` of the request being allocated
    for (``KVCacheManager.allocate_slots``) or finished (``Scheduler._connector_finished``); ``None`` where the call
    keeps the manager's own pool (no retention queue, another mode, another caller: placed as before)."""
    pool = manager.block_pool
    q = pool.free_block_queue
    request = _served(q, request_id) if manager.mamba_cache_mode == "align" else None
    if request is None:
        return None
    table = manager.req_to_blocks.get(request_id)
    if not table:
        return None
    held: dict[int, Any] = {}
    kept = getattr(manager, "last_state_block_idx", {}).get(request_id)
    if kept is not None and 0 <= kept < len(table) and not table[kept].is_null:
        held[kept] = table[kept]
    return _ReleasingPool(pool, q, request, held, int(manager.block_size), _group_of(manager))


def _make_mamba_remove_skipped_blocks(orig: Callable[..., Any]) -> Callable[..., Any]:
    def remove_skipped_blocks(self: Any, request_id: str, *args: Any, **kwargs: Any) -> None:
        pool = self.block_pool
        try:
            view = _releasing_pool(self, request_id)
        except Exception:
            view = None
            _hook_failed("skip", "kvretain: release hook failed (blocks released at default retention)")
        if view is None:
            orig(self, request_id, *args, **kwargs)
            return
        self.block_pool = view
        try:
            orig(self, request_id, *args, **kwargs)
        finally:
            self.block_pool = pool

    return remove_skipped_blocks


def _make_mamba_remove_blocks_in_range(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _remove_blocks_in_range(self: Any, request_id: str, first_block: int, last_block: int) -> None:
        view = self.block_pool
        if type(view) is _ReleasingPool:
            try:
                # where align mode frees (vLLM 0.33: from the blocks it retired before, up to the table's end)
                table = self.req_to_blocks.get(request_id, [])
                lo = max(first_block, getattr(self, "_num_retired_blocks", {}).get(request_id, 0))
                view.note(table, lo, min(last_block, len(table)))
            except Exception:
                _hook_failed("skip", "kvretain: release hook failed (blocks released at default retention)")
        orig(self, request_id, first_block, last_block)

    return _remove_blocks_in_range


def _make_apply_cow(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _apply_cow(self: Any, request_id: str, block_idx: int, source_block: Any, cow_block: Any) -> None:
        orig(self, request_id, block_idx, source_block, cow_block)
        # NOTE: a partial (sub-block) prefix hit: the request's table now holds a private copy (``cow_block``, which
        # the request releases at its end) in place of the cached block it hit; that block keeps the request's hit
        # reference only until the copy has run, and the scheduler then frees it with ``BlockPool.free_blocks``,
        # outside any request. Released here once, at the request's retention and at the position it had in the
        # request's table, as the request's own free would have released it (its reference count is left to vLLM)
        pool = self.block_pool
        q = pool.free_block_queue
        request = _served(q, request_id)  # (allocate_slots, whose block allocation calls this)
        if request is not None:
            try:
                held = {block_idx: source_block}
                q.release_freed(
                    request,
                    held,
                    (source_block,),
                    int(self.block_size),
                    pool.null_block,
                    _group_of(self),
                )
            except Exception:
                _hook_failed(
                    "cow", "kvretain: release hook failed (the block hit is placed at its last retention)"
                )

    return _apply_cow


def _release_moved(pool: Any, q: Any, request: Any, src: Any, dst: Any) -> None:
    """``dst`` now carries the cache entries of ``src``, a block of ``request``'s (the one ``allocate_slots`` serves):
    released once at the request's retention, at the position ``src`` has in the request's group table (as if the
    request had released it there; its reference count is left to vLLM). Nothing when no group table of the
    request on this pool holds ``src`` (placed as before)."""
    ref = q.manager
    manager = ref() if ref is not None else None
    if manager is None:
        return
    rid = request.request_id
    for m in manager.coordinator.single_type_managers:
        table = m.req_to_blocks.get(rid) if m.block_pool is pool else None
        if not table:
            continue
        for i in range(len(table) - 1, -1, -1):  # (by identity: the state block sits near the table's end)
            if table[i] is src:
                q.release_freed(
                    request,
                    {i: dst},
                    (dst,),
                    int(m.block_size),
                    pool.null_block,
                    _group_of(m),
                )
                return


def _make_move_block_hashes(orig: Callable[..., Any]) -> Callable[..., Any]:
    def move_block_hashes(self: Any, src_block: Any, dst_block: Any) -> None:
        orig(self, src_block, dst_block)
        # NOTE: align-mode Mamba (vLLM 0.33's MambaManager.allocate_new_blocks, from allocate_slots) moves the cache
        # entry of a running request's own partial prompt-tail state to a fresh block, which holds a copy of it
        # once the copy has run; that block is in no request's table, and the scheduler frees it after the copy
        # (``BlockPool.free_blocks``), outside any request. Released here once, at the request's retention, as if
        # it had released the block at its state's position; a plain model never calls this
        q = self.free_block_queue
        if type(q) in QUEUE_TYPES:
            request = q.allocating  # (set by allocate_slots, hybrid models only)
            if request is not None:
                try:
                    _release_moved(self, q, request, src_block, dst_block)
                except Exception:
                    _hook_failed(
                        "move",
                        "kvretain: release hook failed (the block a cache entry moved to is placed at its last "
                        "retention)",
                    )

    return move_block_hashes


def _make_connector_finished(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _connector_finished(self: Any, request: Any) -> Any:
        # NOTE: with a KV connector, vLLM frees a finished request's out-of-window blocks here (the kv cache
        # manager's ``remove_skipped_blocks``), outside ``allocate_slots``: the pool's queue is told the request, as
        # allocate_slots tells it (one pool serves every group), so that the window and Mamba hooks release those
        # blocks at its retention
        if getattr(self, "connector", None) is None:  # (vLLM returns at once; getattr: never raise into vLLM)
            return orig(self, request)
        try:
            q = _queue(self.kv_cache_manager.block_pool)
        except Exception:
            q = None
            _hook_failed("connector", "kvretain: connector-finish hook failed (blocks placed as before)")
        if q is None:
            return orig(self, request)
        was, q.allocating = q.allocating, request
        try:
            return orig(self, request)
        finally:
            q.allocating = was

    return _connector_finished


def _resident_tokens(manager: Any, request: Any, num_hits: int, block_size: int) -> int:
    """The hit tokens the controller is told: ``num_hits``, and the request's last full block when vLLM's cap on a
    hit (the last token is computed: ``num_tokens - 1``) is what ended the hit and the pool held that block at
    the lookup (kvretain's ``KVCacheManager.get_computed_blocks`` applies the same rule): the controller compares
    the pool with shadow caches that count every cached block.

    vLLM records the lookup after ``allocate_slots`` has registered the request's own blocks: the block found
    must be another one (the first registered under the hash, held since before). Only on one KV cache group
    whose block size is the hash block size (a hybrid model's groups key their blocks at their own sizes: the
    hit is told as vLLM counts it)."""
    hashes = request.block_hashes
    k = num_hits // block_size
    if k >= len(hashes) or k != (request.num_tokens - 1) // block_size:
        return num_hits
    groups = manager.coordinator.single_type_managers
    if len(groups) != 1 or int(groups[0].block_size) != block_size:
        return num_hits
    found = manager.block_pool.get_cached_block(hashes[k], [0])
    if not found:
        return num_hits
    own = groups[0].req_to_blocks.get(request.request_id, ())
    return num_hits if k < len(own) and own[k] is found[0] else num_hits + block_size


def _make_record_stats(orig: Callable[..., Any]) -> Callable[..., Any]:
    def record_prefix_cache_stats(self: Any, request: Any, num_hits: int) -> None:
        orig(self, request, num_hits)
        pool = self.block_pool
        q = pool.free_block_queue
        if type(q) in QUEUE_TYPES and self.prefix_cache_lookup_enabled(request):
            try:
                bs = int(pool.hash_block_size)
                q.on_lookup(request, num_hits, bs, _resident_tokens(self, request, num_hits, bs))
            except Exception:
                _hook_failed("lookup", "kvretain: lookup hook failed (ignored)")

    return record_prefix_cache_stats


# ---------------------------------------------------------------- validation
def check_sampling_params(params: Any) -> None:
    """Raise ``VLLMValidationError`` (-> HTTP 400 / a per-request ``validation_error``) for bad retention
    fields in ``params.extra_args``."""
    msg = validation_message(getattr(params, "extra_args", None))
    if msg is not None:
        raise VLLMValidationError(msg, parameter="extra_args")


def _make_validate_params(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        if _active is not None:
            check_sampling_params(params)
        return orig(self, params, *args, **kwargs)

    return _validate_params


def _make_to_sampling_params(orig: Callable[..., Any]) -> Callable[..., Any]:
    def to_sampling_params(self: Any, *args: Any, **kwargs: Any) -> Any:
        params = orig(self, *args, **kwargs)
        if _active is not None:
            check_sampling_params(params)
        return params

    return to_sampling_params


def request_arrived(manager: Any, request: Any) -> None:
    """A request was taken in and its blocks hashed (``EngineCore.preprocess_add_request``, on vLLM's input
    thread when the engine core runs in its own process): the policy's per-request work ahead of the lookup
    runs here, outside the scheduler's step, as vLLM's own block hashing does (same process: it overlaps the
    step only while the busy loop waits on the model). A harness that builds requests itself calls this where
    the engine core would.

    Not for a streaming-input chunk (``resumable``): vLLM merges a later chunk into its session and drops its
    ``Request``, whose hashes start over at the chunk; such a session's first lookup does the work itself."""
    q: Any = getattr(getattr(manager, "block_pool", None), "free_block_queue", None)
    if type(q) not in QUEUE_TYPES or getattr(request, "resumable", False):
        return
    try:
        if manager.prefix_cache_lookup_enabled(request):
            q.on_arrival(request)
    except Exception:
        _hook_failed("arrival", "kvretain: arrival hook failed (the lookup does its work)")


def _make_preprocess(orig: Callable[..., Any]) -> Callable[..., Any]:
    def preprocess_add_request(self: Any, request: Any) -> Any:
        if _active is not None and getattr(request, "sampling_params", None) is not None:
            check_sampling_params(request.sampling_params)
        out = orig(self, request)
        manager = getattr(getattr(self, "scheduler", None), "kv_cache_manager", None)
        if _active is not None and manager is not None:
            request_arrived(manager, out[0] if isinstance(out, tuple) else out)
        return out

    return preprocess_add_request


# ---------------------------------------------------------------- install / remove
def install(cfg: PluginConfig) -> None:
    """Activate ``cfg`` for pools built from now on (patches are installed once per process)."""
    global _active
    _patch(BlockPool, "__init__", _make_pool_init)
    if not cfg.uses_run_queue:  # the run queue registers content at release
        _patch(BlockPool, "cache_full_blocks", _make_cache_full_blocks)
    _patch(BlockPool, "reset_prefix_cache", _make_reset)
    _patch(BlockPool, "evict_blocks", _make_evict_blocks)
    _patch(KVCacheManager, "free", _make_free)
    _patch(KVCacheManager, "pop_blocks_for_free", _make_pop_blocks_for_free)
    _patch(KVCacheManager, "record_prefix_cache_stats", _make_record_stats)
    _patch(KVCacheManager, "allocate_slots", _make_allocate_slots)
    _patch(KVCacheManager, "__init__", _make_manager_init)
    _patch(SingleTypeKVCacheManager, "_remove_blocks_in_range", _make_remove_blocks_in_range)
    _patch(MambaManager, "remove_skipped_blocks", _make_mamba_remove_skipped_blocks)
    _patch(MambaManager, "_remove_blocks_in_range", _make_mamba_remove_blocks_in_range)
    if "_apply_cow" in SingleTypeKVCacheManager.__dict__:  # (a vLLM without it copies no partial hits)
        _patch(SingleTypeKVCacheManager, "_apply_cow", _make_apply_cow)
    if "cache_partial_block" in BlockPool.__dict__:  # (a vLLM without it hashes whole blocks)
        _patch(BlockPool, "cache_partial_block", _make_cache_partial_block)
    if "move_block_hashes" in BlockPool.__dict__:  # (a vLLM without it moves no cache entries)
        _patch(BlockPool, "move_block_hashes", _make_move_block_hashes)
    try:
        from vllm.v1.core.sched.scheduler import Scheduler  # (the engine core imports it too)

        _patch(Scheduler, "_connector_finished", _make_connector_finished)
    except Exception:
        _hook_failed("connector", "kvretain: cannot follow a KV connector's finish (placed as before)")
    for modname, clsname, meth, make in (
        ("vllm.v1.engine.input_processor", "InputProcessor", "_validate_params", _make_validate_params),
        ("vllm.v1.engine.core", "EngineCore", "preprocess_add_request", _make_preprocess),
        # NOTE: the OpenAI server builds SamplingParams before it answers, but runs InputProcessor only when the
        # engine's generator is first iterated: inside the stream for stream=true, after HTTP 200. Checked here
        # too, a bad field is a 400 before the stream, as vLLM's own sampling-parameter errors are
        *(
            (f"vllm.entrypoints.openai.{mod}.protocol", cls, "to_sampling_params", _make_to_sampling_params)
            for mod, cls in (
                ("chat_completion", "ChatCompletionRequest"),
                ("completion", "CompletionRequest"),
            )
        ),
    ):
        try:
            import importlib

            cls = getattr(importlib.import_module(modname), clsname)
            _patch(cls, meth, make)
        except Exception:
            _hook_failed(f"validate-{clsname}", f"kvretain: cannot validate retention fields in {clsname}")
    _active = cfg


def uninstall() -> None:
    """Restore every patched method (pools already built keep their queue)."""
    global _active
    _active = None
    for (cls, name), orig in list(_ORIGINALS.items()):
        setattr(cls, name, orig)
    _ORIGINALS.clear()


def active() -> PluginConfig | None:
    return _active
