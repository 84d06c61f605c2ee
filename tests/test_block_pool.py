"""BlockPool: reference counts, the hash index, free counts, misuse errors and vLLM 0.33's LRU order.

Pools are tiny (10 blocks unless said) and hashes are plain ints (one per block, as in trace replay). Every
helper runs ``check_integrity`` after the step it performs.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvretain.core import BlockPool, BlockRetention, make_policy
from kvretain.core.block_pool import NO_PARENT
from kvretain.core.policies import LRUPolicy

N = 10
LEAF_ONLY = ["lfu", "priority", "unified"]


def new_pool(policy: str = "lru", n: int = N) -> BlockPool:
    pool = BlockPool(n, make_policy(policy, n))
    pool.check_integrity()
    return pool


def start(pool: BlockPool, hashes: Sequence[int]) -> list[int] | None:
    """A request: touch its longest cached prefix, allocate and cache the rest. None: no room (no change)."""
    k = 0
    while k < len(hashes) and hashes[k] in pool.cached:
        k += 1
    hits = [pool.cached[h] for h in hashes[:k]]
    pool.touch(hits)
    new = pool.get_new_blocks(len(hashes) - k)
    if new is None:
        pool.free_blocks(hits)
        pool.check_integrity()
        return None
    ids = hits + new
    pool.cache_blocks(ids, hashes, k, len(hashes))
    pool.check_integrity()
    return ids


def finish(pool: BlockPool, ids: Sequence[int], retention: BlockRetention | None = None) -> None:
    pool.free_blocks(ids, retention)
    pool.check_integrity()


def run(pool: BlockPool, hashes: Sequence[int]) -> list[int]:
    ids = start(pool, hashes)
    assert ids is not None
    finish(pool, ids)
    return ids


def evictions(pool: BlockPool, n: int) -> list[int]:
    """Allocate ``n`` blocks and return the ids evicted to get them, in order."""
    out: list[int] = []
    pool.on_evict = lambda bid, h: out.append(bid)
    got = pool.get_new_blocks(n)
    assert got is not None
    pool.on_evict = None
    pool.check_integrity()
    return out


def snapshot(pool: BlockPool) -> tuple[object, ...]:
    return (
        list(pool.ref_cnt),
        list(pool.block_hash),
        dict(pool.cached),
        list(pool._empty),
        bytes(pool.evictable),
        pool.policy.evictable_ids(),
        pool.num_evictions,
        pool.get_num_free_blocks(),
    )


# ---------------------------------------------------------------- construction and counts


def test_constructor_errors() -> None:
    with pytest.raises(ValueError, match=r"num_blocks must be a positive integer.*got 0"):
        BlockPool(0, make_policy("lru", 0))
    with pytest.raises(ValueError, match="policy was built for 8 blocks, pool has 10"):
        BlockPool(10, make_policy("lru", 8))


def test_pool_keeps_its_state_in_the_policys_block_objects() -> None:
    from kvretain.core.policies.unified import UnifiedPolicy
    from kvretain.core.policy import BlockState

    pol = make_policy("unified", N)
    assert isinstance(pol, UnifiedPolicy)
    pool = BlockPool(N, pol)
    assert all(a is b for a, b in zip(pool._blocks, pol._meta, strict=True))  # one object per block
    run(pool, [1, 2])
    assert pool.ref_count(0) == 0 and pool.hash_of(1) == 2
    assert type(new_pool("lru")._blocks[0]) is BlockState

    class Short(type(make_policy("lru", N))):  # type: ignore[misc]
        def block_states(self) -> list[BlockState]:
            return [BlockState() for _ in range(N - 1)]

    with pytest.raises(ValueError, match="policy offered 9 block states for 10 blocks"):
        BlockPool(N, Short(N))


def test_fresh_pool_hands_out_lowest_ids_first() -> None:
    pool = new_pool()
    assert pool.get_num_free_blocks() == N and pool.usage() == 0.0
    assert pool.get_new_blocks(3) == [0, 1, 2]
    assert pool.ref_cnt[:4] == [1, 1, 1, 0]
    assert pool.get_num_free_blocks() == 7
    assert pool.usage() == pytest.approx(0.3)
    assert pool.get_new_blocks(0) == []
    with pytest.raises(ValueError, match="negative number of blocks"):
        pool.get_new_blocks(-1)
    pool.check_integrity()


@pytest.mark.parametrize("policy", ["lru", *LEAF_ONLY])
def test_cached_but_unused_blocks_count_as_free(policy: str) -> None:
    pool = new_pool(policy)
    ids = start(pool, [1, 2, 3])
    assert ids == [0, 1, 2]
    assert pool.get_num_free_blocks() == 7
    assert pool.cached == {1: 0, 2: 1, 3: 2}
    finish(pool, ids)
    assert pool.get_num_free_blocks() == N
    assert pool.usage() == 0.0
    assert pool.cached == {1: 0, 2: 1, 3: 2}
    assert pool.get_cached_block(2) == 1 and pool.get_cached_block(99) is None
    # a hit takes a reference on cached blocks: they stop being free
    again = start(pool, [1, 2, 4])
    assert again == [0, 1, 3]
    assert pool.ref_cnt[:4] == [1, 1, 0, 1]
    assert pool.get_num_free_blocks() == 7


@pytest.mark.parametrize("policy", ["lru", *LEAF_ONLY])
def test_get_new_blocks_none_changes_nothing(policy: str) -> None:
    pool = new_pool(policy)
    held = start(pool, [1, 2, 3, 4, 5, 6])
    assert held is not None
    run(pool, [7, 8])
    # 2 empty + 2 cached-free (a 2-block chain) = 4 free; 6 in use
    before = snapshot(pool)
    assert pool.get_new_blocks(5) is None
    assert snapshot(pool) == before
    pool.check_integrity()


def test_double_free_raises() -> None:
    pool = new_pool()
    ids = run(pool, [1, 2])
    with pytest.raises(ValueError, match=r"block 1 freed more times than it was taken \(double free\)"):
        pool.free_blocks(ids)
    plain = pool.get_new_blocks(1)
    assert plain is not None
    pool.free_blocks(plain)
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks(plain)


def _misuse_state(policy: str) -> tuple[BlockPool, dict[str, int]]:
    """A chain held by a request (a0 -> a1), a cached-free block (b), a block in use without a hash (p), the
    rest empty."""
    pool = new_pool(policy)
    a = start(pool, [1, 2])
    b = run(pool, [7])
    p = pool.get_new_blocks(1)
    assert a is not None and p is not None
    return pool, {"a0": a[0], "a1": a[1], "b": b[0], "p": p[0], "empty": 9}


def _drain(pool: BlockPool) -> list[int]:
    """Free everything still held, then evict every cached block; the hashes evicted, in order."""
    out: list[int] = []
    pool.on_evict = lambda bid, h: out.append(int(h))
    held = [b for b in range(pool.num_blocks) if pool.ref_count(b)]
    for b in reversed(held):  # (deepest first: a chain's blocks were handed out in order)
        pool.free_blocks([b] * pool.ref_count(b))
    pool.check_integrity()
    assert pool.get_new_blocks(pool.get_num_free_blocks()) is not None
    return out


@pytest.mark.parametrize("policy", ["lru", "lfu", "priority", "unified", "s3fifo", "arc"])
def test_a_refused_free_or_touch_changes_nothing(policy: str) -> None:
    # the checks used to come block by block: the blocks before the refused one had been released (or taken)
    # already, and the pool failed its integrity check after the error
    pool, ids = _misuse_state(policy)
    control, _ = _misuse_state(policy)
    before = snapshot(pool)
    a0, a1, b, p, empty = ids["a0"], ids["a1"], ids["b"], ids["p"], ids["empty"]
    plan = BlockRetention([80, 80], [None, 5.0], "s", 0, 35)
    refused: list[tuple[str, type[Exception], str | None]] = [
        ("free", ValueError, "double free"),  # b is stale, a1 (released first) is live
        ("free-plan", ValueError, "double free"),  # the same with a per-block plan (the policy's slow path)
        ("free-twice", ValueError, "double free"),  # p is held once, freed twice
        ("free-out-of-range", ValueError, "not a block of this pool"),
        ("touch", ValueError, "is empty"),  # b and a0 first: taken before the empty block is refused
        ("touch-out-of-range", ValueError, "not a block of this pool"),
    ]
    for what, exc, match in refused:
        with pytest.raises(exc, match=match):
            if what == "free":
                pool.free_blocks([b, a1])
            elif what == "free-plan":
                pool.free_blocks([b, a1], plan)
            elif what == "free-twice":
                pool.free_blocks([a0, p, p])
            elif what == "free-out-of-range":
                pool.free_blocks([99, a0, a1])
            elif what == "touch":  # (a leaf-only pool takes only a prefix: b, a root, then the empty block)
                pool.touch([b, empty] if pool.policy.leaf_only else [b, a0, p, empty])
            else:
                pool.touch([b, 99] if pool.policy.leaf_only else [b, a1, 99])
        assert snapshot(pool) == before, what
        pool.check_integrity()
    assert _drain(pool) == _drain(control)


def test_a_block_held_twice_may_be_freed_twice_in_one_call() -> None:
    pool = new_pool()
    ids = run(pool, [1])
    pool.touch(ids + ids)
    assert pool.ref_count(ids[0]) == 2
    pool.free_blocks(ids + ids)
    pool.check_integrity()
    assert pool.ref_count(ids[0]) == 0 and pool.get_num_free_blocks() == N


def test_touching_an_empty_block_raises() -> None:
    pool = new_pool()
    with pytest.raises(ValueError, match="block 4 is empty; only cached blocks can be touched"):
        pool.touch([4])
    pool.check_integrity()
    # a block in use may be touched even when unhashed (a shared running block)
    (b,) = pool.get_new_blocks(1) or []
    pool.touch([b])
    assert pool.ref_cnt[b] == 2


def test_cache_blocks_errors() -> None:
    pool = new_pool()
    ids = pool.get_new_blocks(2)
    assert ids is not None
    with pytest.raises(ValueError, match=r"cache_blocks: end=3 beyond 2 blocks / 3 hashes"):
        pool.cache_blocks(ids, [1, 2, 3], 0, 3)
    pool.cache_blocks(ids, [1, 2], 0, 2)
    pool.cache_blocks(ids, [1, 2], 0, 2)  # idempotent for the same hashes
    with pytest.raises(ValueError, match="block 1 already holds a different hash"):
        pool.cache_blocks(ids, [1, 9], 0, 2)
    with pytest.raises(ValueError, match="block 5 is not in use"):
        pool.cache_blocks([5], [7], 0, 1)
    pool.check_integrity()


def test_reset_prefix_cache() -> None:
    pool = new_pool("unified")
    ids = run(pool, [1, 2, 3])
    held = start(pool, [1, 4])
    assert held is not None
    assert pool.reset_prefix_cache() is False  # a block is in use
    assert pool.cached == {1: 0, 2: 1, 3: 2, 4: 3}
    finish(pool, held)
    dropped: list[tuple[int, int]] = []
    pool.on_evict = lambda bid, h: dropped.append((bid, int(h)))
    assert pool.reset_prefix_cache() is True
    pool.check_integrity()
    assert sorted(dropped) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert pool.cached == {} and len(pool.policy) == 0
    assert pool.get_num_free_blocks() == N
    assert pool.get_new_blocks(2) == [0, 1]  # back to a fresh pool's order
    assert ids == [0, 1, 2]


@pytest.mark.parametrize("policy", ["lru", *LEAF_ONLY])
def test_duplicate_content_is_registered_as_a_copy_as_vllm_does(policy: str) -> None:
    # vLLM 0.33 registers every newly full block, a block whose hash is cached already included (its
    # BlockHashToBlockMap keeps each copy; lookups find the first). Before, the copy stayed unhashed and so did
    # every later block of its request: their content was lost with no memory pressure at all, and the copies
    # went back to the empty stack (reused first) where vLLM queues them as cached blocks
    pool = new_pool(policy)
    a = start(pool, [1, 2])
    assert a == [0, 1]
    # a second request computes the same content without a lookup (e.g. both were scheduled together)
    b = pool.get_new_blocks(3)
    assert b == [2, 3, 4]
    pool.cache_blocks(b, [1, 2, 3], 0, 3)
    pool.check_integrity()
    if policy in LEAF_ONLY:
        # parent links: a block after a copy would be reached by lookups through the other copy (block 1), which
        # its holders do not hold: it stays unhashed, and so does the rest of its request
        assert pool.block_hash[2:5] == [1, None, None]
        assert pool.cached == {1: 0, 2: 1} and pool.copies == {1: [2]}
    else:
        assert pool.block_hash[2:5] == [1, 2, 3]
        assert pool.cached == {1: 0, 2: 1, 3: 4}  # lookups find the first registered block
        assert pool.copies == {1: [2], 2: [3]}
    finish(pool, b)
    assert pool.get_num_free_blocks() == N - 2
    # the empty blocks are reused first, then the cached ones: the copies are cached blocks (vLLM queues them
    # at the free queue's tail); only the unhashed ones went back to the empty stack
    if policy in LEAF_ONLY:
        assert pool.get_new_blocks(7) == [3, 4, 5, 6, 7, 8, 9]
    else:
        assert pool.get_new_blocks(5) == [5, 6, 7, 8, 9]
    finish(pool, a)
    cached = [0, 1, 2] if policy in LEAF_ONLY else [0, 1, 2, 3, 4]
    evicted: list[int] = []
    pool.on_evict = lambda bid, h: evicted.append(bid)
    got = pool.get_new_blocks(len(cached))
    assert got is not None and sorted(got) == cached and sorted(evicted) == cached
    pool.check_integrity()
    assert pool.cached == {} and pool.copies == {}


def test_the_first_copy_takes_the_index_when_the_indexed_block_goes() -> None:
    pool = new_pool()
    a = start(pool, [1])
    b = pool.get_new_blocks(1)
    assert (a, b) == ([0], [1])
    pool.cache_blocks(b, [1], 0, 1)
    finish(pool, a)  # block 0 is released first: LRU evicts it first
    assert pool.get_new_blocks(N - 2) is not None  # the empty blocks
    got = pool.get_new_blocks(1)
    assert got == [0]
    pool.check_integrity()
    assert pool.cached == {1: 1} and pool.copies == {}
    assert pool.get_cached_block(1) == 1  # a lookup of hash 1 finds the copy


def test_of_several_copies_the_earliest_registered_takes_the_index() -> None:
    # vLLM's BlockHashToBlockMap keeps the copies of a key in registration order: when the indexed block goes,
    # the next lookup finds the oldest remaining copy
    pool = new_pool()
    a = start(pool, [1])
    b = pool.get_new_blocks(1)
    c = pool.get_new_blocks(1)
    assert (a, b, c) == ([0], [1], [2])
    pool.cache_blocks(b, [1], 0, 1)
    pool.cache_blocks(c, [1], 0, 1)
    assert pool.copies == {1: [1, 2]}
    finish(pool, a)  # the indexed block is the only evictable one
    assert pool.get_new_blocks(N - 3) is not None  # the empty blocks
    assert evictions(pool, 1) == [0]
    assert pool.cached == {1: 1} and pool.copies == {1: [2]}


@pytest.mark.parametrize("policy", LEAF_ONLY)
def test_leaf_only_a_call_that_covers_a_copy_again_leaves_the_blocks_after_it_unhashed(policy: str) -> None:
    pool = new_pool(policy)
    start(pool, [1, 2])
    b = pool.get_new_blocks(3)
    assert b == [2, 3, 4]
    pool.cache_blocks(b, [1, 2, 3], 0, 1)  # block 2: a copy of hash 1
    assert pool.copies == {1: [2]}
    # the call covers the copy again: lookups would reach the blocks after it through block 0, not block 2
    pool.cache_blocks(b, [1, 2, 3], 0, 3)
    pool.check_integrity()
    assert pool.block_hash[2:5] == [1, None, None]
    assert pool.copies == {1: [2]}


@pytest.mark.parametrize("policy", LEAF_ONLY)
def test_a_refused_cache_blocks_gives_a_free_parent_back_to_the_order(policy: str) -> None:
    # a request may hold a block whose parent is free (hits that are not a prefix): registering a child takes
    # the parent out of the eviction order, and a refused call must put it back
    pool = new_pool(policy, 4)
    run(pool, [1])  # block 0: cached, free, evictable
    got = pool.get_new_blocks(2)
    assert got == [1, 2]
    before = snapshot(pool)
    with pytest.raises(ValueError, match="is None"):
        pool.cache_blocks([0, *got], [1, 2, None], 1, 3)  # type: ignore[list-item]
    assert snapshot(pool) == before
    pool.check_integrity()
    finish(pool, got)
    assert evictions(pool, 4) == [0]


@pytest.mark.parametrize("policy", LEAF_ONLY)
def test_leaf_only_a_later_call_does_not_register_blocks_after_a_copy(policy: str) -> None:
    # the request's next full block (decode) follows a copy: lookups of the copy's hash find block 0, so a
    # block registered under the copy would be reached through a parent its holders do not hold
    pool = new_pool(policy)
    start(pool, [1, 2])
    b = pool.get_new_blocks(2)
    assert b == [2, 3]
    pool.cache_blocks(b, [1, 2], 0, 1)  # block 2: a copy of hash 1
    pool.cache_blocks(b, [1, 2], 1, 2)
    pool.check_integrity()
    assert pool.block_hash[2:4] == [1, None]
    assert pool.copies == {1: [2]}


def test_block_whose_parent_is_not_cached_is_not_registered() -> None:
    pool = new_pool("lfu")
    ids = pool.get_new_blocks(3)
    assert ids is not None
    pool.cache_blocks(ids, [1, 2, 3], 1, 3)  # block 0 (hash 1) was never cached
    pool.check_integrity()
    assert pool.cached == {}
    pool.cache_blocks(ids, [1, 2, 3], 0, 3)
    assert pool.cached == {1: 0, 2: 1, 3: 2}
    assert pool.parent[:3] == [NO_PARENT, 0, 1]
    assert pool.num_children[:3] == [1, 1, 0]
    pool.check_integrity()


@pytest.mark.parametrize("policy", ["lru", *LEAF_ONLY])
def test_a_parent_hash_of_none_before_start_registers_nothing(policy: str) -> None:
    # the block before ``start`` holds no hash and its request's hash there is None: the blocks after it stay
    # unhashed for every policy (before, ``lru`` registered them under an unhashed parent and the leaf-only
    # policies raised a bare KeyError)
    pool = new_pool(policy)
    ids = pool.get_new_blocks(3)
    assert ids is not None
    pool.cache_blocks(ids, [None, 2, 3], 1, 3)  # type: ignore[list-item]
    pool.check_integrity()
    assert pool.cached == {}
    assert [pool.hash_of(b) for b in ids] == [None, None, None]


# ---------------------------------------------------------------- vLLM 0.33 LRU order


def test_lru_freed_blocks_go_to_the_tail_deepest_first() -> None:
    pool = new_pool()
    run(pool, [1, 2, 3])  # blocks 0, 1, 2
    run(pool, [4, 5])  # blocks 3, 4
    assert pool.get_new_blocks(5) == [5, 6, 7, 8, 9]  # empty blocks first: no eviction
    assert pool.num_evictions == 0
    # queue: 2, 1, 0 (first request, deepest first), then 4, 3
    assert evictions(pool, 4) == [2, 1, 0, 4]
    assert pool.cached == {4: 3}
    assert pool.num_evictions == 4


def test_lru_evicted_blocks_are_handed_out_in_eviction_order() -> None:
    pool = new_pool("lru", 4)
    run(pool, [1, 2])
    run(pool, [3, 4])
    # queue 1 0 3 2: the head of the second request (block 2, hash 3) is the last to go
    assert pool.get_new_blocks(3) == [1, 0, 3]
    assert pool.cached == {3: 2}


class _HearsAllocations(LRUPolicy):
    hears_allocations = True

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.calls: list[tuple[object, ...]] = []

    def on_allocate(self, n: int, empty: int) -> None:
        self.calls.append(("allocate", n, empty))

    def pop(self, now: float) -> int | None:
        self.calls.append(("pop",))
        return super().pop(now)


def test_a_policy_that_hears_allocations_is_told_of_each_before_its_pops() -> None:
    """``on_allocate(n, empty)`` before the first pop of every allocation (the empty blocks are handed out first),
    one that fails or pops nothing included; a bad clock refuses the call before it; other policies are not told
    (``hears_allocations`` False: the base class's no-op is never called)."""
    pol = _HearsAllocations(4)
    now = [0.0]
    pool = BlockPool(4, pol, clock=lambda: now[0])
    run(pool, [1, 2, 3])  # one block left empty
    assert pol.calls == [("allocate", 3, 4)]
    pol.calls.clear()
    assert pool.get_new_blocks(3) == [3, 2, 1]  # the empty block, then victims (LRU: deepest first)
    assert pol.calls == [("allocate", 3, 1), ("pop",), ("pop",)]
    pol.calls.clear()
    assert pool.get_new_blocks(4) is None and pool.get_new_blocks(0) == []
    now[0] = float("nan")
    with pytest.raises(ValueError, match="clock returned"):
        pool.get_new_blocks(1)
    assert pol.calls == [("allocate", 4, 0), ("allocate", 0, 0)]
    lru = new_pool("lru", 4)
    lru.policy.on_allocate = lambda n, empty: pytest.fail("told")  # type: ignore[method-assign]
    run(lru, [1, 2, 3, 4])
    run(lru, [5])


def test_lru_hit_does_not_refresh_recency_until_released() -> None:
    pool = new_pool()
    run(pool, [1, 2, 3])  # queue 2 1 0
    run(pool, [4, 5])  # queue 2 1 0 4 3
    held = start(pool, [4, 6])  # hit block 3: removed from the queue while in use
    assert held == [3, 5]
    filler = pool.get_new_blocks(4)  # take the remaining empty blocks 6..9
    assert filler == [6, 7, 8, 9]
    assert evictions(pool, 2) == [2, 1]
    finish(pool, held)  # queue now 0 4 | 5 3 (released deepest first, to the tail)
    assert evictions(pool, 4) == [0, 4, 5, 3]


def test_lru_repeated_hits_move_a_prefix_to_the_tail() -> None:
    pool = new_pool("lru", 6)
    run(pool, [1, 2])  # queue 1 0
    run(pool, [3, 4])  # queue 1 0 3 2
    run(pool, [1, 2])  # hit both, release: queue 3 2 1 0
    assert evictions(pool, 2) == []  # two empty blocks first
    assert evictions(pool, 4) == [3, 2, 1, 0]


def test_lru_partial_block_is_empty_and_reused_first() -> None:
    pool = new_pool("lru", 5)
    ids = pool.get_new_blocks(3)
    assert ids == [0, 1, 2]
    pool.cache_blocks(ids, [1, 2], 0, 2)  # the third block is partial: no hash
    finish(pool, ids)
    assert pool.get_num_free_blocks() == 5
    # block 2 went back to the empty stack; it and 3, 4 are handed out before any cached block is evicted
    assert pool.get_new_blocks(3) == [2, 3, 4]
    assert pool.num_evictions == 0
    assert evictions(pool, 1) == [1]


def test_lru_retention_is_ignored() -> None:
    pool = new_pool("lru", 4)
    ids = start(pool, [1, 2])
    assert ids is not None
    finish(pool, ids, BlockRetention([100, 100], [None, None]))
    run(pool, [3, 4])
    assert evictions(pool, 2) == [1, 0]


# ---------------------------------------------------------------- leaf-only policies


@pytest.mark.parametrize("policy", LEAF_ONLY)
def test_leaf_only_never_orphans_a_cached_descendant(policy: str) -> None:
    pool = new_pool(policy, 4)
    ids = start(pool, [1, 2, 3, 4])
    assert ids is not None
    # the head is released at the lowest priority, the tail at the highest: the tail still goes first
    finish(pool, ids, BlockRetention([0, 10, 20, 100], [None] * 4))
    assert pool.policy.evictable_ids() == {3}
    assert pool.get_num_free_blocks() == 4
    order: list[int] = []
    for _ in range(4):
        order += evictions(pool, 1)
    assert order == [3, 2, 1, 0]


@pytest.mark.parametrize("policy", LEAF_ONLY)
def test_leaf_only_parent_waits_for_a_branch_in_use(policy: str) -> None:
    pool = new_pool(policy, 6)
    run(pool, [1, 2])  # blocks 0 -> 1
    branch = start(pool, [1, 3])  # hit block 0, new block 2 under it, held
    assert branch == [0, 2]
    assert pool.num_children[0] == 2
    run(pool, [9])  # block 3
    assert pool.policy.evictable_ids() == {1, 3}
    assert pool.get_new_blocks(2) == [4, 5]
    got = evictions(pool, 2)
    assert sorted(got) == [1, 3]  # block 0 is in use, and would in any case wait for block 2
    assert pool.get_new_blocks(1) is None
    finish(pool, branch)
    assert pool.policy.evictable_ids() == {2}
    assert evictions(pool, 1) == [2]
    assert pool.policy.evictable_ids() == {0}


@pytest.mark.parametrize("policy", LEAF_ONLY)
def test_leaf_only_touching_a_parent_keeps_counts(policy: str) -> None:
    pool = new_pool(policy, 4)
    run(pool, [1, 2, 3])
    assert pool.get_num_free_blocks() == 4
    held = start(pool, [1, 5])  # touch block 0 (cached, free, not evictable: it has a child)
    assert held == [0, 3]
    assert pool.get_num_free_blocks() == 2
    assert pool.policy.evictable_ids() == {2}
    finish(pool, held)
    assert pool.policy.evictable_ids() == {2, 3}


@pytest.mark.parametrize("policy", LEAF_ONLY)
def test_leaf_only_can_allocate_every_free_block(policy: str) -> None:
    pool = new_pool(policy, 4)
    run(pool, [1, 2, 3, 4])
    assert pool.get_num_free_blocks() == 4
    assert pool.get_new_blocks(3) is not None  # lru returns [3, 2, 1]; leaf-only policies return None


# ---------------------------------------------------------------- the holder rule and ids (session 28's review)


@pytest.mark.parametrize("policy", LEAF_ONLY)
def test_a_free_block_held_behind_an_in_use_child_gives_none_not_a_broken_pool(policy: str) -> None:
    # a request that held a -> b and freed only a (a sliding window drops the head) left a free block that cannot
    # be evicted before b: the next allocation evicted a block, then died in PoolIntegrityError with the pool
    # corrupt (a block half taken, the free counter wrong)
    pool = new_pool(policy, 3)
    ab = start(pool, [1, 2])
    assert ab is not None
    c = run(pool, [3])
    pool.free_blocks([ab[0]])
    pool.check_integrity()
    assert pool.get_num_free_blocks() == 2
    evicted: list[int] = []
    pool.on_evict = lambda bid, h: evicted.append(bid)
    assert pool.get_new_blocks(2) is None  # c can go, a cannot before b
    pool.check_integrity()
    assert evicted == c and pool.num_evictions == 1
    assert pool.get_num_free_blocks() == 2 and pool.ref_count(c[0]) == 0  # c is empty now, a still cached
    got = pool.get_new_blocks(1)
    assert got == c
    pool.free_blocks(got)
    pool.free_blocks([ab[1]])  # the tail goes: a can be evicted after it
    assert pool.get_new_blocks(3) is not None
    pool.check_integrity()


@pytest.mark.parametrize("policy", ["lru", *LEAF_ONLY, "s3fifo", "arc"])
def test_ids_outside_the_pool_are_refused_and_change_nothing(policy: str) -> None:
    # a negative id used to stand for a real block (Python indexes from the end): freed, evicted, handed out
    pool = new_pool(policy, 4)
    ids = start(pool, [1, 2])
    assert ids is not None
    before = snapshot(pool)
    for call in (
        lambda: pool.free_blocks([-4, -3]),
        lambda: pool.free_blocks([4]),
        lambda: pool.touch([-4]),
        lambda: pool.touch([7]),
        lambda: pool.cache_blocks([ids[0], -1], [1, 99], 1, 2),
        lambda: pool.cache_blocks([ids[0], 9], [1, 99], 1, 2),
    ):
        with pytest.raises(ValueError, match="is not a block of this pool"):
            call()
        assert snapshot(pool) == before
        pool.check_integrity()
    with pytest.raises(ValueError, match="non-int"):
        pool.get_new_blocks(True)


@pytest.mark.parametrize("policy", ["lru", *LEAF_ONLY, "s3fifo", "arc"])
def test_a_bool_is_not_a_block_id_and_changes_nothing(policy: str) -> None:
    # True is an int to Python: touch([True]) took a reference on block 1, free_blocks([True]) released it,
    # cache_blocks registered it, ref_count(True) read it; False stood for block 0
    pool = new_pool(policy, 4)
    a = start(pool, [1, 2])  # blocks 0 and 1 held, hashed
    assert a == [0, 1]
    c = run(pool, [5])  # block 2 cached and free
    d = pool.get_new_blocks(1)  # block 3 in use, unhashed
    assert c == [2] and d == [3]
    before = snapshot(pool)
    for call in (
        lambda: pool.touch([True]),
        lambda: pool.touch([2, False]),
        lambda: pool.touch([0, 1, True]),  # (the ints taken first are given back)
        lambda: pool.free_blocks([True]),
        lambda: pool.free_blocks([False, 1]),
        lambda: pool.free_blocks([0, True], BlockRetention([80, 80], [None, 5.0], "s", 0, 35)),
        lambda: pool.cache_blocks([0, True, 3], [1, 2, 9], 2, 3),  # (the id before start: block 3's parent)
        lambda: pool.cache_blocks([0, 1, True], [1, 2, 9], 2, 3),
        lambda: pool.cache_blocks([False, 1], [1, 2], 0, 2),
    ):
        with pytest.raises(ValueError, match=r"block id (True|False) is a bool, not a block of this pool"):
            call()
        assert snapshot(pool) == before
        pool.check_integrity()
    for bad in (True, False):
        with pytest.raises(ValueError, match=rf"ref_count: block id {bad} is a bool"):
            pool.ref_count(bad)
        with pytest.raises(ValueError, match=rf"hash_of: block id {bad} is a bool"):
            pool.hash_of(bad)
    # the ints they stand for are blocks as before (0 and 1 take the type test, 2 and up do not)
    pool.touch([0, 1, 2])
    pool.free_blocks([0, 1, 2])
    pool.cache_blocks([0, 1, 3], [1, 2, 9], 2, 3)
    assert pool.ref_count(1) == 1 and pool.hash_of(3) == 9
    pool.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "unified"])
def test_a_refused_cache_blocks_registers_nothing(policy: str) -> None:
    # the checks came block by block: the blocks before the refused one stayed registered
    for hashes, ids_extra, s, e, exc, match in (
        ([1, 2, 3], [3], 0, 3, ValueError, "block 3 is not in use"),
        ([None, None], [], 0, 2, ValueError, "is None"),
        ([1, 2], [], -1, 2, ValueError, "0 <= start"),
        ([1, [2]], [], 0, 2, TypeError, "unhashable"),
        ([1, 2], "same", 0, 2, ValueError, "already holds a different hash"),
    ):
        pool = new_pool(policy, 4)
        got = pool.get_new_blocks(2)
        assert got is not None
        ids = [got[0], got[0]] if ids_extra == "same" else got + list(ids_extra)
        before = snapshot(pool)
        with pytest.raises(exc, match=match):
            pool.cache_blocks(ids, hashes, s, e)  # type: ignore[arg-type]
        assert snapshot(pool) == before, hashes
        pool.check_integrity()
        pool.free_blocks(got)
        pool.check_integrity()


@pytest.mark.parametrize("reading", [float("nan"), float("inf"), -float("inf")])
def test_a_clock_that_is_not_finite_is_refused(reading: float) -> None:
    # a NaN clock made a 1 s directive permanent (every expiry comparison false)
    now = [0.0]
    pool = BlockPool(4, make_policy("unified", 4), clock=lambda: now[0])
    ids = pool.get_new_blocks(1)
    assert ids is not None
    pool.cache_blocks(ids, [1], 0, 1)
    now[0] = reading
    before = snapshot(pool)
    with pytest.raises(ValueError, match="clock returned"):
        pool.free_blocks(ids, BlockRetention([90], [1.0], None, 0, 35))
    assert snapshot(pool) == before
    now[0] = 0.0
    pool.free_blocks(ids, BlockRetention([90], [1.0], None, 0, 35))
    assert pool.policy.retention_of(ids[0], 2.0) == 35
    pool.check_integrity()


def test_a_reset_counts_the_dropped_blocks_as_evictions() -> None:
    pool = new_pool()
    seen: list[int] = []
    pool.on_evict = lambda bid, h: seen.append(bid)
    run(pool, [1, 2, 3])
    assert pool.reset_prefix_cache()
    assert pool.num_evictions == len(seen) == 3


def test_a_reset_drops_every_copy_and_counts_each_as_an_eviction() -> None:
    pool = new_pool()
    a = start(pool, [1])
    b = pool.get_new_blocks(1)
    assert (a, b) == ([0], [1])
    pool.cache_blocks(b, [1], 0, 1)  # a copy of hash 1
    finish(pool, a)
    finish(pool, b)
    seen: list[tuple[int, int]] = []
    pool.on_evict = lambda bid, h: seen.append((bid, int(h)))
    assert pool.reset_prefix_cache()
    pool.check_integrity()
    assert sorted(seen) == [(0, 1), (1, 1)] and pool.num_evictions == 2
    assert pool.cached == {} and pool.copies == {}


@pytest.mark.parametrize("policy", ["lru", "lfu", "unified"])
def test_a_cached_block_between_new_ones_is_not_announced_again_nor_undone(policy: str) -> None:
    # a request may hold an already cached block after a new one (hits that are not a prefix): the registrations
    # around it are two runs. The pool used to treat them as one range [first, last]: it announced the cached
    # block to the policy as new content (resetting its metadata) and, when the call was refused, undid it too.
    pool = new_pool(policy, 8)
    y = run(pool, [20])[0]  # a cached root
    announced: list[tuple[int, object, int]] = []
    on_cached = pool.policy.on_cached
    pool.policy.on_cached = lambda b, h, d, now: (announced.append((b, h, d)), on_cached(b, h, d, now))[1]  # type: ignore[method-assign]
    new = pool.get_new_blocks(2)
    assert new is not None
    pool.touch([y])
    ids = [new[0], y, new[1]]
    pool.cache_blocks(ids, [10, 20, 30], 0, 3)
    pool.check_integrity()
    if policy == "unified":  # (announces runs through its own fused loop: its metadata shows it)
        meta = pool.policy._meta  # type: ignore[attr-defined]
        assert (meta[y].depth, meta[y].stamp != 0) == (0, True)  # still as its own request left it
        assert (meta[new[0]].depth, meta[new[1]].depth) == (0, 2)
    else:
        assert announced == [(new[0], 10, 0), (new[1], 30, 2)]
    assert pool.cached == {20: y, 10: new[0], 30: new[1]}
    finish(pool, ids)

    # refused on a later block: the cached one stays cached
    announced.clear()
    pool2 = new_pool(policy, 8)
    y = run(pool2, [20])[0]
    new = pool2.get_new_blocks(2)
    assert new is not None
    spare = pool2.get_new_blocks(1)
    assert spare is not None
    pool2.free_blocks(spare)  # (empty again: not in use)
    pool2.touch([y])
    before = snapshot(pool2)
    with pytest.raises(ValueError, match="not in use"):
        pool2.cache_blocks([new[0], y, new[1], spare[0]], [10, 20, 30, 40], 0, 4)
    assert snapshot(pool2) == before
    pool2.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "unified"])
def test_a_refused_id_equal_to_an_earlier_one_of_another_type_undoes_everything(policy: str) -> None:
    # touch([0, 0.0]) takes block 0, then refuses 0.0; the undo looked for the refused id by equality, found
    # 0 == 0.0 at index 0 and undid nothing: block 0 kept a reference and the free count was wrong
    pool = new_pool(policy, 4)
    ids = run(pool, [1])
    before = snapshot(pool)
    for call in (lambda: pool.touch([ids[0], float(ids[0])]), lambda: pool.touch([ids[0], None])):
        with pytest.raises(ValueError, match="is not a block of this pool"):
            call()
        assert snapshot(pool) == before
        pool.check_integrity()


class _Index:
    """An integer-like id that is not an ``int`` (as numpy's integers are)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value

    def __lt__(self, other: int) -> bool:
        return self.value < other


def test_the_refused_id_is_the_one_named() -> None:
    # an id that is an integer but not an int (numpy's) was named as the bad one, not the id refused
    pool = new_pool("lru", 4)
    ids = run(pool, [1])
    with pytest.raises(ValueError, match=r"block id -1 is not"):
        pool.touch([_Index(ids[0]), -1])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"block id -1 is not"):
        pool.free_blocks([_Index(ids[0]), -1])  # type: ignore[list-item]
    pool.check_integrity()


def test_cache_blocks_refuses_ids_that_are_not_integers_and_a_bad_parent_id_in_one_message() -> None:
    pool = new_pool("lru", 4)
    got = pool.get_new_blocks(2)
    assert got is not None
    before = snapshot(pool)
    for ids, s in (([got[0], None], 0), ([got[0], 1.0], 0), ([-1, got[1]], 1), ([9, got[1]], 1)):
        with pytest.raises(ValueError, match="is not a block of this pool"):
            pool.cache_blocks(ids, [10, 20], s, 2)  # type: ignore[arg-type]
        assert snapshot(pool) == before
    pool.check_integrity()
