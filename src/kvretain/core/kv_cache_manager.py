"""A KV cache manager in vLLM's shape, over :class:`~kvretain.core.block_pool.BlockPool`.

The scheduler talks to the cache only through this contract::

    get_computed_blocks(req) -> (blocks, num_computed_tokens)   longest cached prefix, never the whole prompt
    allocate_slots(req, num_new_tokens, new_computed_blocks) -> list[int] | None    None: not enough blocks
    free(req)                                                  release (finish, abort or preemption)

Requests carry their request priority and retention config; the manager resolves them into per-block
retention at release time and keeps per-priority statistics (:mod:`kvretain.core.stats`: first lookups and
resumes after preemption apart, evictions by the class of the evicted block's last releaser).

Fast path: a request that has a ``block_hashes(block_size, num_blocks)`` method (see
:class:`HashingRequest`) supplies its own chained block hashes, and its tokens are never read (simulators
derive hashes from a prompt's structure instead of hashing millions of token ids).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, cast

from kvretain.core.block_pool import BlockPool
from kvretain.core.hashing import BlockHash, BlockHasher, ExtraKeys
from kvretain.core.policy import DEFAULT_BLOCK_SIZE, EvictionPolicy, PolicyConfig, make_policy
from kvretain.core.retention import (
    BlockRetention,
    PriorityMapping,
    RetentionConfig,
    check_request_priority,
    show_value,
)
from kvretain.core.stats import CacheStats, ClassStats


class CacheRequest(Protocol):
    """What the manager reads from a request (the scheduler's request type satisfies it)."""

    @property
    def request_id(self) -> str: ...
    @property
    def priority(self) -> int: ...
    @property
    def retention(self) -> RetentionConfig | None: ...
    @property
    def extra_keys(self) -> ExtraKeys: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def all_token_ids(self) -> Sequence[int]: ...
    @property
    def num_preemptions(self) -> int:
        """How often the request was preempted: a lookup with ``num_preemptions > 0`` is a resume."""
        ...


class HashingRequest(CacheRequest, Protocol):
    """A request that hashes its own blocks (optional fast path, found with ``getattr``)."""

    def block_hashes(self, block_size: int, num_blocks: int) -> Sequence[BlockHash]:
        """Chained hashes of at least the first ``num_blocks`` full blocks of ``all_token_ids``.

        Equal hashes must mean equal tokens, equal prefixes and equal extra keys. The manager may keep the
        returned sequence, so the request may only append to it, never change an entry.
        """
        ...


@dataclass(slots=True)
class _ReqState:
    req: object  # the request object it belongs to (another object under its id is another request)
    blocks: list[int] = field(default_factory=list)
    hashes: Sequence[BlockHash] = field(default_factory=list)
    num_cached: int = 0
    looked_up: bool = False  # admitted: its lookup is counted (a later lookup is not, until a resume)
    hit_blocks: int = -1  # the hits of its latest lookup before admission (-1: none yet)
    resident: int = 0  # of them, with the last full block when it is cached too (the cap below: the policy's)
    seen: object | None = None  # the policy's work at arrival, for the first lookup (on_arrival)


def _check_request(req: CacheRequest) -> None:
    """Refuse a request whose priority is not an int or whose retention is not a RetentionConfig or None."""
    check_request_priority(req.priority, f"request {req.request_id!r}: priority")
    ret = req.retention
    if ret is not None and not isinstance(ret, RetentionConfig):
        raise TypeError(
            f"request {req.request_id!r}: retention must be a RetentionConfig or None, got {show_value(ret)}"
        )


def _refuse_duplicate(request_id: str) -> None:
    raise ValueError(
        f"request id {request_id!r} belongs to another live request (another request object); give each "
        "request its own id, or free the first before reusing it"
    )


def _check_token_counts(req: CacheRequest, *counts: object) -> None:
    """Raise naming the first of ``allocate_slots``' token counts that is not an int >= 0 (a bool is not)."""
    names = ("num_new_tokens", "num_computed_tokens", "reserve_tokens")
    for name, value in zip(names, counts, strict=True):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"request {req.request_id!r}: {name} must be an integer number of tokens, got {show_value(value)}"
            )
        if value < 0:
            raise ValueError(f"request {req.request_id!r}: {name} must be >= 0, got {value}")


class KVCacheManager:
    """Prefix-cached paged KV allocation for one model replica."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        policy: str | EvictionPolicy = "lru",
        config: PolicyConfig | None = None,
        mapping: PriorityMapping | None = None,
        hash_algorithm: str = "sha256",
        clock: Callable[[], float] | None = None,
        enable_caching: bool = True,
    ) -> None:
        # (checked here: each was read only later, a mapping after its request's lookup was counted)
        if config is not None and not isinstance(config, PolicyConfig):
            raise TypeError(f"config must be a PolicyConfig or None, got {show_value(config)}")
        if mapping is not None and not isinstance(mapping, PriorityMapping):
            raise TypeError(f"mapping must be a PriorityMapping or None, got {show_value(mapping)}")
        if not isinstance(enable_caching, bool):  # ("no" is truthy)
            raise TypeError(f"enable_caching must be True or False, got {show_value(enable_caching)}")
        if isinstance(policy, str) and config is not None and config.block_size != block_size:
            # the default block size stands for "the pool's" (SimConfig's default policy_config, for one): it is
            # adopted; any other value that differs is a contradiction
            if config.block_size != DEFAULT_BLOCK_SIZE:
                raise ValueError(
                    f"config.block_size ({show_value(config.block_size)}) differs from the manager's block_size "
                    f"({show_value(block_size)}); leave it at its default or pass the manager's"
                )
            config = replace(config, block_size=block_size)
        if isinstance(policy, str):
            cfg = config or PolicyConfig(block_size=block_size)
            policy = make_policy(policy, num_blocks, cfg)
        else:  # a policy built by the caller carries its own config: one given beside it would be ignored
            if config is not None:
                raise ValueError(
                    "config is for a policy named by string; this policy object was built with its own "
                    "(make_policy(name, num_blocks, config))"
                )
            own = getattr(policy, "config", None)
            if isinstance(own, PolicyConfig) and own.block_size not in (block_size, DEFAULT_BLOCK_SIZE):
                raise ValueError(
                    f"the policy's config.block_size ({show_value(own.block_size)}) differs from the manager's "
                    f"block_size ({show_value(block_size)})"
                )
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, policy, clock)
        self.hasher = BlockHasher(block_size, hash_algorithm)
        self.mapping = mapping or PriorityMapping()
        self.enable_caching = enable_caching
        self.cache_stats = CacheStats(num_blocks)
        self._reqs: dict[str, _ReqState] = {}
        self.pool.on_evict_batch = self.cache_stats.evicted

    # ------------------------------------------------------------------ helpers
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def stats(self) -> dict[int, ClassStats]:
        """Per request-priority class statistics (:class:`~kvretain.core.stats.ClassStats`)."""
        return self.cache_stats.by_class

    def _state(self, req: CacheRequest) -> _ReqState:
        """The request's state; a request's first call checks its priority and retention (once per request),
        and a request under the id of another live request (another object) is refused."""
        rid = req.request_id
        st = self._reqs.get(rid)
        if st is None:
            _check_request(req)
            st = self._reqs[rid] = _ReqState(req)
        elif st.req is not req:
            _refuse_duplicate(rid)
        return st

    def _update_hashes(self, req: CacheRequest, st: _ReqState, num_tokens: int) -> None:
        n_full = num_tokens // self.block_size
        if len(st.hashes) < n_full:
            own = getattr(req, "block_hashes", None)
            if own is not None:
                st.hashes = own(self.block_size, n_full)
                return
            tokens = req.all_token_ids
            prefix = cast("Sequence[bytes]", st.hashes)
            extra = req.extra_keys
            if extra is not None and not isinstance(extra, ExtraKeys):
                raise TypeError(
                    f"request {req.request_id!r}: extra_keys must be an ExtraKeys or None, got {show_value(extra)}"
                )
            st.hashes = self.hasher.hash_blocks(tokens[: n_full * self.block_size], extra, prefix)

    def get_num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def usage(self) -> float:
        return self.pool.usage()

    def num_blocks_of(self, req: CacheRequest) -> int:
        st = self._reqs.get(req.request_id)
        return len(st.blocks) if st else 0

    # ------------------------------------------------------------------ contract
    def on_arrival(self, req: CacheRequest) -> None:
        """A request was taken in (the scheduler's ``add_request``): its blocks are hashed now and the policy
        does its per-request work ahead of the first lookup (``unified``: the controller's shadows), as the vLLM
        plugin does at vLLM's input processing, off the scheduler's step. Optional: without it the first lookup
        does that work."""
        if not self.enable_caching:
            return
        st = self._state(req)
        self._update_hashes(req, st, len(req.all_token_ids))
        if st.hashes and not st.looked_up:
            st.seen = self.pool.policy.on_arrival(st.hashes, self.mapping.retention_for(req.priority))

    def get_computed_blocks(self, req: CacheRequest) -> tuple[list[int], int]:
        """Longest run of cached leading blocks of the request's tokens; the hit is capped so that at least
        the last token is computed (its logits are needed).

        A lookup is counted when the request is admitted (its first successful :meth:`allocate_slots` since it
        arrived or was last preempted), with the hits of the lookup that admitted it, as vLLM 0.33 does
        ("record at admission so unscheduled lookups are not counted"): a request that waits for blocks is
        looked up again each step, and only the lookup it is admitted with counts. The first admission goes
        into its class's ``requests`` / ``query_tokens`` / ``hit_tokens``, one after a preemption
        (``req.num_preemptions > 0``) apart, as a resume (:mod:`kvretain.core.stats`). Only first admissions
        are fed to the policy's ``on_lookup``: unified's controller must not take the scheduler's recompute of
        a preempted request for reuse.
        """
        if not self.enable_caching:
            return [], 0
        st = self._state(req)
        num_tokens = len(req.all_token_ids)
        self._update_hashes(req, st, num_tokens)
        max_blocks = (num_tokens - 1) // self.block_size
        cached = self.pool.cached
        hits: list[int] = []
        for h in st.hashes[:max_blocks]:
            bid = cached.get(h)
            if bid is None:
                break
            hits.append(bid)
        if not st.looked_up and not st.blocks:  # (a request holding blocks would find its own)
            st.hit_blocks = st.resident = len(hits)
            # NOTE: the cap is the scheduler's (the last token's logits), not the cache's: a prompt of whole blocks
            # repeated finds its last block cached but cannot use it. The policy compares the pool with shadow
            # caches that count every cached block (unified's LRU estimate): it is told the blocks the pool held,
            # so that a pool that holds exactly what LRU holds reads as LRU (it read up to 1/n short for a
            # repeated n-block prompt, a reuse loss that was not one)
            if len(hits) == max_blocks < len(st.hashes) and st.hashes[max_blocks] in cached:
                st.resident += 1
        return hits, len(hits) * self.block_size

    def _admit(self, req: CacheRequest, st: _ReqState) -> None:
        """The request is admitted with the hits of its latest lookup: count that lookup (first or resume)
        and, for a first one, give it to the policy (before the allocation's evictions, as the lookup saw the
        pool)."""
        st.looked_up = True
        hit_blocks = st.hit_blocks
        num_tokens = len(req.all_token_ids)
        resumed = req.num_preemptions > 0
        self.cache_stats.record_lookup(req.priority, num_tokens, hit_blocks * self.block_size, resumed)
        self.on_admitted(req, hit_blocks)
        seen, st.seen = st.seen, None
        if not resumed:
            self.pool.policy.lookup(st.hashes, st.resident, self.mapping.retention_for(req.priority), seen)

    def on_admitted(self, req: CacheRequest, hit_blocks: int) -> None:
        """Called once per admission (first or resume) with the blocks it hit; for subclasses (the simulator
        counts the tokens it must recompute there)."""

    def allocate_slots(
        self,
        req: CacheRequest,
        num_new_tokens: int,
        num_computed_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        reserve_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` tokens after ``num_computed_tokens`` (which include prefix hits).

        ``new_computed_blocks`` are the hits from :meth:`get_computed_blocks` (or a prefix of them), passed on
        the first allocation only, while still cached (anything else is a ``ValueError``, before anything is
        counted); they are touched. Returns the newly allocated block ids, or ``None`` when the pool cannot supply
        them (nothing changes then). Blocks that are full once the new tokens are computed are registered in
        the prefix cache (their token ids must be known: prompt tokens, or generated tokens already appended).
        ``reserve_tokens``: succeed only if the free blocks could also hold the request's first
        ``reserve_tokens`` tokens (vLLM's ``full_sequence_must_fit`` admission gate); only the blocks for
        ``num_new_tokens`` are allocated.
        """
        if (
            type(num_new_tokens) is not int
            or type(num_computed_tokens) is not int
            or type(reserve_tokens) is not int
            or num_new_tokens < 0
            or num_computed_tokens < 0
            or reserve_tokens < 0
        ):
            _check_token_counts(req, num_new_tokens, num_computed_tokens, reserve_tokens)
        st = self._state(req)
        if new_computed_blocks:
            # checked before anything is counted or touched: the hits must be what this request's lookup found
            if st.blocks:
                raise ValueError(
                    f"request {req.request_id!r}: prefix hits can only be added on the first allocation"
                )
            k = len(new_computed_blocks)
            hashes = st.hashes
            if (
                k > len(hashes)
                or list(map(self.pool.cached.get, hashes[:k])) != list(new_computed_blocks)
                or bool in map(type, new_computed_blocks)  # ([True] == [1]: it would be block 1)
            ):
                raise ValueError(
                    f"request {req.request_id!r}: new_computed_blocks must be a prefix of the blocks its "
                    f"get_computed_blocks returned, still cached, got {show_value(new_computed_blocks)}"
                )
        known = min(num_computed_tokens + num_new_tokens, len(req.all_token_ids))
        if self.enable_caching:
            # hashed before anything changes: a token or extra key that cannot be hashed fails the call here, not
            # after its blocks were allocated
            self._update_hashes(req, st, known)
        n_new, n_check = self._blocks_needed(
            st, num_new_tokens, num_computed_tokens, new_computed_blocks, reserve_tokens
        )
        # touching free hits takes them out of the allocatable set: check both together
        ref_count = self.pool.ref_count
        free_hits = sum(1 for b in new_computed_blocks if ref_count(b) == 0)
        if n_check + free_hits > self.pool.get_num_free_blocks():
            return None
        if not st.looked_up and st.hit_blocks >= 0:
            self._admit(req, st)
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            st.blocks.extend(new_computed_blocks)
            st.num_cached = len(st.blocks)
        new = self.pool.get_new_blocks(n_new)
        if new is None:  # pragma: no cover - guarded above
            return None
        st.blocks.extend(new)
        if self.enable_caching:
            self._cache_full_blocks(st, known)
        return new

    def _blocks_needed(
        self,
        st: _ReqState,
        num_new_tokens: int,
        num_computed_tokens: int,
        new_computed_blocks: Sequence[int],
        reserve_tokens: int,
    ) -> tuple[int, int]:
        """The blocks :meth:`allocate_slots` allocates, and the free blocks it asks for (``reserve_tokens``)."""
        total_tokens = num_computed_tokens + num_new_tokens
        held = len(st.blocks) + len(new_computed_blocks)
        n_new = max(0, -(-total_tokens // self.block_size) - held)
        return n_new, max(n_new, -(-reserve_tokens // self.block_size) - held)

    def fits_after_freeing(
        self,
        req: CacheRequest,
        num_new_tokens: int,
        num_computed_tokens: int,
        new_computed_blocks: Sequence[int],
        reserve_tokens: int,
        candidates: Sequence[CacheRequest],
    ) -> int | None:
        """How many of ``candidates`` (distinct live requests, in the order they would be freed) must be freed,
        as a prefix of that order, before :meth:`allocate_slots` with these arguments succeeds: the shortest such
        prefix, 0 when it succeeds now; ``None`` when freeing all of them is not enough. A block counts as freed once every
        reference to it is among the freed requests'; a hit held only by them is free again, and taken back. Token
        counts that :meth:`allocate_slots` refuses are refused here too."""
        _check_token_counts(req, num_new_tokens, num_computed_tokens, reserve_tokens)
        st = self._state(req)
        _, n_check = self._blocks_needed(
            st, num_new_tokens, num_computed_tokens, new_computed_blocks, reserve_tokens
        )
        if bool in map(type, new_computed_blocks):  # (a set of {1, True} would drop the bool unseen)
            raise ValueError(
                f"request {req.request_id!r}: new_computed_blocks holds a bool, not a block id: "
                f"{show_value(new_computed_blocks)}"
            )
        ref_count = self.pool.ref_count
        dropped: dict[int, int] = {}  # block -> references the freed requests hold
        hits = set(new_computed_blocks)
        free = self.pool.get_num_free_blocks() - sum(1 for b in hits if ref_count(b) == 0)
        for k in range(len(candidates) + 1):
            if n_check <= free:
                return k
            if k == len(candidates):
                return None
            held = self._reqs.get(candidates[k].request_id)
            for b in held.blocks if held is not None else ():
                d = dropped[b] = dropped.get(b, 0) + 1
                if d == ref_count(b) and b not in hits:  # (a hit freed is touched again at once)
                    free += 1
        return None  # pragma: no cover - the loop returns

    def _cache_full_blocks(self, st: _ReqState, known: int) -> None:
        """Register the request's blocks that are full with its first ``known`` tokens (hashed already:
        :meth:`allocate_slots` hashes them before it allocates)."""
        n_full = min(known // self.block_size, len(st.blocks), len(st.hashes))
        if n_full > st.num_cached:
            self.pool.cache_blocks(st.blocks, st.hashes, st.num_cached, n_full)
            st.num_cached = n_full

    def free(self, req: CacheRequest) -> None:
        """Release the request's blocks (deepest first) with its retention; idempotent. A call that raises
        (bad priority or retention, another request under its id) keeps the request and its blocks: a
        corrected call can free them."""
        rid = req.request_id
        st = self._reqs.get(rid)
        if st is None:
            return
        if st.req is not req:
            _refuse_duplicate(rid)
        if not st.blocks:
            del self._reqs[rid]
            return
        # (checked at its first call; again here, where a value changed since would leak its blocks)
        _check_request(req)
        base = self.mapping.retention_for(req.priority)
        n = len(st.blocks)
        ret = req.retention
        if ret is None or not ret.needs_plan:
            plan = BlockRetention([], [], None if ret is None else ret.scope, req.priority, base)
        else:
            prios, durs = ret.block_plan(n, self.block_size, req.num_prompt_tokens, base)
            plan = BlockRetention(prios, durs, ret.scope, req.priority, base)
        self.pool.free_blocks(st.blocks, plan)
        self.cache_stats.released(st.blocks, req.priority, st.num_cached)
        del self._reqs[rid]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Pool invariants plus: reference counts equal the number of live requests holding each block."""
        self.pool.check_integrity()
        holders = [0] * self.pool.num_blocks
        for st in self._reqs.values():
            for b in st.blocks:
                holders[b] += 1
        refs = self.pool.ref_cnt
        if holders != refs:
            bad = [b for b in range(self.pool.num_blocks) if holders[b] != refs[b]]
            raise AssertionError(f"reference counts disagree with live requests on blocks {bad[:10]}")
