"""Property-based stateful tests: random request lifecycles through a small BlockPool, one machine per policy.

Each step either starts a request (longest cached prefix touched, misses allocated, full blocks cached),
starts one without a prefix lookup (duplicate content: blocks that stay unhashed, parents held by others),
finishes a live request with a random retention plan, advances the clock (so durations lapse) or resets the
prefix cache. After every step the pool's own invariants hold and every block's reference count equals the
number of live requests holding it.
"""

from __future__ import annotations

import random
from typing import ClassVar

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvretain.core import BlockHasher, BlockPool, BlockRetention, PolicyConfig, make_policy
from kvretain.core.block_pool import NO_PARENT
from kvretain.core.hashing import BlockHash
from kvretain.core.policies import ARCPolicy, S3FIFOPolicy

BLOCK_SIZE = 2
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=12)  # up to 6 blocks, prefixes often shared
MAX_LIVE = 4  # enough to fill the pool sometimes, few enough that most starts must evict
LEAF_ONLY = ["lfu", "priority", "unified", "belady"]
SCOPES = st.sampled_from([None, "a", "b"])
DURATIONS = st.one_of(st.none(), st.sampled_from([0.0, 0.5, 1.0, 3.0, 10.0]))


def belady_next_use(h: BlockHash) -> float:
    """A deterministic pseudo-random next use per hash (seeded by the hash itself)."""
    return float(random.Random(h).randrange(1000))


class PoolMachine(RuleBasedStateMachine):
    POLICY: ClassVar[str] = "lru"
    CONFIG: ClassVar[PolicyConfig | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.n = 12
        self.pool = BlockPool(self.n, make_policy(self.POLICY, self.n, self.CONFIG), clock=lambda: self.now)
        self.hasher = BlockHasher(BLOCK_SIZE)
        self.live: dict[int, list[int]] = {}
        self.next_id = 0

    # ------------------------------------------------------------ helpers
    def _state(self) -> tuple[object, ...]:
        p = self.pool
        return (
            list(p.ref_cnt),
            list(p.block_hash),
            dict(p.cached),
            p.get_num_free_blocks(),
            p.policy.evictable_ids(),
            p.num_evictions,
        )

    def _obtainable(self) -> int:
        """Blocks an allocation can really obtain, computed from the parent links: free blocks, except cached
        ones that are ancestors of a block in use (a leaf-only policy could never evict those)."""
        p = self.pool
        pinned: set[int] = set()
        for b in range(self.n):
            if p.ref_cnt[b] > 0:
                a = p.parent[b]
                while a != NO_PARENT and a not in pinned:
                    pinned.add(a)
                    a = p.parent[a]
        return sum(1 for b in range(self.n) if p.ref_cnt[b] == 0 and b not in pinned)

    def _allocate(self, num_blocks: int) -> list[int] | None:
        pool = self.pool
        obtainable = self._obtainable()
        # no free block is pinned under a block in use: every free block can be obtained
        assert obtainable == pool.get_num_free_blocks()
        before = self._state()
        refs = list(pool.ref_cnt)
        new = pool.get_new_blocks(num_blocks)
        if new is None:
            assert num_blocks > obtainable, (
                f"None although {obtainable} >= {num_blocks} blocks are obtainable"
            )
            assert self._state() == before, "a failed allocation changed the pool"
            assert pool.ref_cnt == refs
            event("allocation refused")
            return None
        if pool.num_evictions > before[-1]:  # type: ignore[operator]
            event("allocation evicted")
        assert num_blocks <= obtainable
        assert len(set(new)) == len(new)
        for b in new:
            assert pool.ref_cnt[b] == 1 and pool.block_hash[b] is None
        return new

    # ------------------------------------------------------------ rules
    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(tokens=TOKENS, base=st.sampled_from([15, 25, 35, 45]))
    def start_request(self, tokens: list[int], base: int) -> None:
        pool = self.pool
        hashes = self.hasher.hash_blocks(tokens)
        num_blocks = -(-len(tokens) // BLOCK_SIZE)  # the last block may be partial (never hashed)
        k = 0
        while k < len(hashes) and hashes[k] in pool.cached:
            k += 1
        hits = [pool.cached[h] for h in hashes[:k]]
        pool.policy.on_lookup(hashes, k, base)
        pool.touch(hits)
        new = self._allocate(num_blocks - k)
        if new is None:
            pool.free_blocks(hits)
            return
        ids = hits + new
        pool.cache_blocks(ids, hashes, k, len(hashes))
        for i in range(len(hashes)):
            # every full block is now served from the cache (by this request's block or an earlier copy)
            assert hashes[i] in pool.cached or (i > 0 and hashes[i - 1] not in pool.cached)
        for i, h in enumerate(hashes[:k]):
            assert pool.cached[h] == ids[i]
        self.live[self.next_id] = ids
        self.next_id += 1

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(tokens=TOKENS)
    def start_without_lookup(self, tokens: list[int]) -> None:
        hashes = self.hasher.hash_blocks(tokens)
        num_blocks = -(-len(tokens) // BLOCK_SIZE)
        new = self._allocate(num_blocks)
        if new is None:
            return
        self.pool.cache_blocks(new, hashes, 0, len(hashes))
        self.live[self.next_id] = new
        self.next_id += 1

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        ids = self.live.pop(rid)
        n = len(ids)
        with_plan = data.draw(st.booleans())
        if with_plan:
            prios = data.draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))
            durs = data.draw(st.lists(DURATIONS, min_size=n, max_size=n))
            base = data.draw(st.sampled_from([0, 25, 35, 45, 100]))
            retention = BlockRetention(prios, durs, data.draw(SCOPES), 0, base)
            self.pool.free_blocks(ids, retention)
        else:
            self.pool.free_blocks(ids)

    @rule(dt=st.sampled_from([0.0, 0.25, 1.0, 2.5, 10.0]))
    def advance_clock(self, dt: float) -> None:
        self.now += dt

    @rule()
    def reset_prefix_cache(self) -> None:
        ok = self.pool.reset_prefix_cache()
        assert ok == (not self.live)
        if ok:
            assert self.pool.cached == {} and self.pool.get_num_free_blocks() == self.n

    # ------------------------------------------------------------ invariants
    @invariant()
    def integrity(self) -> None:
        self.pool.check_integrity()

    @invariant()
    def holders_of_a_block_hold_its_parent(self) -> None:
        parent = self.pool.parent
        for ids in self.live.values():
            held = set(ids)
            for b in ids:
                assert parent[b] == NO_PARENT or parent[b] in held

    @invariant()
    def reference_counts_match_live_requests(self) -> None:
        expect = [0] * self.n
        for ids in self.live.values():
            for b in ids:
                expect[b] += 1
        assert self.pool.ref_cnt == expect
        held = sum(1 for c in expect if c)
        assert self.pool.get_num_free_blocks() == self.n - held


def _hashed(pool: BlockPool) -> int:
    """The cached blocks: one per hash in the index, and the copies (content computed twice)."""
    return len(pool.cached) + sum(map(len, pool.copies.values()))


SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None, database=None)


class LRUMachine(PoolMachine):
    POLICY = "lru"


class LFUMachine(PoolMachine):
    POLICY = "lfu"
    CONFIG = PolicyConfig(frequency_cap=3, ghost_factor=0.5)


class PriorityMachine(PoolMachine):
    POLICY = "priority"


class UnifiedMachine(PoolMachine):
    POLICY = "unified"
    CONFIG = PolicyConfig(budget=0.5, isolation_goal=0.9, cost_scale_tokens=8.0, block_size=BLOCK_SIZE)


class UnifiedFixedBudgetMachine(PoolMachine):
    POLICY = "unified"
    CONFIG = PolicyConfig(budget=0.25, isolation_goal=None, frequency_exponent=0.5)


class BeladyMachine(PoolMachine):
    POLICY = "belady"
    CONFIG = PolicyConfig(next_use=belady_next_use)


class S3FIFOMachine(PoolMachine):
    POLICY = "s3fifo"

    @invariant()
    def queues_hold_the_cached_blocks(self) -> None:
        s = self.pool.policy.stats()
        assert s["small"] + s["main"] == _hashed(self.pool)
        assert s["ghost"] <= self.n - max(1, self.n // 10)

    @invariant()
    def the_ghost_remembers_only_content_that_left(self) -> None:
        # (a copy evicted while its content stays cached is not a departure of the content)
        pol = self.pool.policy
        assert isinstance(pol, S3FIFOPolicy)
        assert not set(pol._ghost) & set(self.pool.cached)


class ARCMachine(PoolMachine):
    POLICY = "arc"

    @invariant()
    def directory_bounds(self) -> None:
        s = self.pool.policy.stats()
        assert s["t1"] + s["t2"] == _hashed(self.pool) <= self.n
        assert s["t1"] + s["b1"] <= self.n
        assert s["t1"] + s["t2"] + s["b1"] + s["b2"] <= 2 * self.n
        assert 0 <= s["p"] <= self.n

    @invariant()
    def the_ghosts_remember_only_content_that_left_once(self) -> None:
        pol = self.pool.policy
        assert isinstance(pol, ARCPolicy)
        assert not (set(pol._b1) | set(pol._b2)) & set(self.pool.cached)
        assert not set(pol._b1) & set(pol._b2)


TestLRU = LRUMachine.TestCase
TestLFU = LFUMachine.TestCase
TestPriority = PriorityMachine.TestCase
TestUnified = UnifiedMachine.TestCase
TestUnifiedFixedBudget = UnifiedFixedBudgetMachine.TestCase
TestBelady = BeladyMachine.TestCase
TestS3FIFO = S3FIFOMachine.TestCase
TestARC = ARCMachine.TestCase
for _case in (
    TestLRU,
    TestLFU,
    TestPriority,
    TestUnified,
    TestUnifiedFixedBudget,
    TestBelady,
    TestS3FIFO,
    TestARC,
):
    _case.settings = SETTINGS
del _case


# ---------------------------------------------------------------- regression examples found by the machines


@pytest.mark.parametrize("policy", [*LEAF_ONLY, "lru", "s3fifo", "arc"])
def test_duplicate_prefix_pins_nothing(policy: str) -> None:
    """A request that computed a cached 2-block prefix again (no lookup) registers copies (vLLM's duplicates),
    never its third block under the other request's block: that block, once free, would be pinned under a
    block in use, and a leaf-only policy could never evict it although the pool counts it as free."""
    pool = BlockPool(6, make_policy(policy, 6, PolicyConfig(next_use=belady_next_use)))
    r1 = pool.get_new_blocks(2)
    assert r1 == [0, 1]
    pool.cache_blocks(r1, [1, 2], 0, 2)
    r2 = pool.get_new_blocks(3)
    assert r2 == [2, 3, 4]
    pool.cache_blocks(r2, [1, 2, 3], 0, 3)
    if pool.policy.leaf_only:  # a block after a copy is not linked to it (see BlockPool.cache_blocks)
        assert pool.cached == {1: 0, 2: 1} and pool.copies == {1: [2]}
    else:
        assert pool.cached == {1: 0, 2: 1, 3: 4} and pool.copies == {1: [2], 2: [3]}
    pool.free_blocks(r1)
    r3 = pool.get_new_blocks(1)
    assert r3 == [5]
    pool.cache_blocks(r3, [9], 0, 1)
    pool.free_blocks(r3)
    pool.check_integrity()
    assert pool.get_num_free_blocks() == 3
    evicted: list[int] = []
    pool.on_evict = lambda bid, h: evicted.append(bid)
    got = pool.get_new_blocks(3)
    assert got is not None and sorted(got) == [0, 1, 5]
    assert sorted(evicted) == [0, 1, 5]
    pool.check_integrity()
    # the copies took the index
    assert pool.cached == ({1: 2} if pool.policy.leaf_only else {1: 2, 2: 3, 3: 4}) and pool.copies == {}
