"""The vLLM plugin's run queue (``RunFreeQueue``) driven directly, the way vLLM's ``BlockPool`` drives its free
queue: random admit (prefix lookup, hits, allocation with eviction, caching) / finish / ``evict_blocks`` /
prefix-cache reset / clock sequences, with the queue's consistency check and vLLM's free-count invariant after
every step; and the eviction order the queue promises."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip(
    "vllm.v1.core.kv_cache_utils", reason="vLLM 0.33 is tested in .venv-vllm (scripts/test_vllm.sh)"
)

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from vllm.v1.core.block_pool import BlockHashToBlockMap
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from kvretain.core.policy import PolicyConfig
from kvretain.core.retention import PriorityMapping
from kvretain.integrations.vllm import _runtime
from kvretain.integrations.vllm._patches import _index_entry
from kvretain.integrations.vllm._runs import RunFreeQueue

BLOCK = 16


class Pool:
    """What vLLM's ``BlockPool`` and ``KVCacheManager`` do to the free queue (block 0 is the null block)."""

    def __init__(self, num_blocks: int, cfg: PolicyConfig) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.q = RunFreeQueue(self.blocks[1:], self.blocks, cfg, PriorityMapping())
        self.cached: dict[bytes, KVCacheBlock] = {}  # what lookups find: the first block registered
        # vLLM's own index, every block registered (a duplicate's too): what the ghost reads, as installed
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.q.set_index(_index_entry(self))

    def cache(self, b: KVCacheBlock, h: bytes) -> None:
        """BlockPool.cache_full_blocks of one block: lookups keep finding a duplicate's first block."""
        b._block_hash = h
        self.cached.setdefault(h, b)
        self.cached_block_hash_to_block.insert(h, b)  # type: ignore[arg-type]

    def lookup(self, hashes: list[bytes]) -> list[KVCacheBlock]:
        hits = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def admit(self, req: Any, hashes: list[bytes], partial: bool) -> list[KVCacheBlock] | None:
        hits = self.lookup(hashes[:-1])  # never the whole prompt, as vLLM
        need = len(hashes) - len(hits) + (1 if partial else 0)
        if need + sum(1 for b in hits if b.ref_cnt == 0) > self.q.num_free_blocks:
            return None
        for b in hits:  # BlockPool.touch
            if b.ref_cnt == 0:
                self.q.remove(b)
            b.ref_cnt += 1
        new = self.q.popleft_n(need) if need else []
        for b in new:  # BlockPool.get_new_blocks: _maybe_evict_cached_block, then a reference
            assert b.ref_cnt == 0
            self._strip(b)
            b.ref_cnt = 1
        blocks = hits + new
        for i in range(len(hits), len(hashes)):  # BlockPool.cache_full_blocks
            self.cache(blocks[i], hashes[i])
        req.block_hashes = hashes
        return blocks

    def free_blocks(self, ordered: list[KVCacheBlock]) -> None:
        """vLLM 0.33's BlockPool.free_blocks: a reference less each; those whose last reference went are free,
        unhashed ones reused first (prepended), cached ones to the queue; the null block is not counted."""
        first: list[KVCacheBlock] = []
        last: list[KVCacheBlock] = []
        for b in ordered:
            if b.is_null:
                continue
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                (first if b.block_hash is None else last).append(b)
        self.q.prepend_n(first)
        self.q.append_n(last)

    def free(self, req: Any, blocks: list[KVCacheBlock]) -> None:
        """KVCacheManager.free with the plugin, the general path: the release hook, then BlockPool.free_blocks
        (deepest first)."""
        # num_cached: vLLM's count of the request's cached blocks (not updated when evict_blocks strips one)
        self.q.on_request_release(
            req, (blocks,), [BLOCK], freeing_now=True, num_cached=[len(req.block_hashes)]
        )
        self.free_blocks(list(reversed(blocks)))
        self.q._expect = -1

    def run(self, req: Any, hashes: list[bytes]) -> list[KVCacheBlock]:
        """A request that is admitted (it must fit) and ends: its blocks, freed."""
        blocks = self.admit(req, hashes, False)
        assert blocks is not None
        self.free(req, blocks)
        return blocks

    def free_fused(self, req: Any, blocks: list[KVCacheBlock]) -> None:
        """KVCacheManager.free with the plugin on a full-attention group: the release and the free in one pass."""
        self.q.free_request(req, blocks, BLOCK, len(req.block_hashes), self.free_blocks)

    def free_deferred(self, req: Any, blocks: list[KVCacheBlock]) -> None:
        """KVCacheManager.pop_blocks_for_free with the plugin (the release hook after vLLM popped the blocks,
        nothing placed), then BlockPool.free_blocks later: append_n places the blocks itself."""
        self.q.on_request_release(req, (blocks,), [BLOCK])
        self.free_blocks(list(reversed(blocks)))

    def state(self) -> tuple[Any, ...]:
        """Everything a later decision can depend on: blocks (references, hashes), the eviction order, the
        per-block retention and use counts, the protected count and the controller's level."""
        q = self.q
        return (
            [(b.ref_cnt, b.block_hash) for b in self.blocks],
            [b.block_id for b in q.get_all_free_blocks()],
            q.num_free_blocks,
            list(q._r),
            list(q._uses),
            q.stats(),
        )

    def evict_blocks(self, ids: set[int] | list[int]) -> None:
        """BlockPool.evict_blocks as patched: the queue forgets, vLLM strips the hashes, free ones move."""
        moved = [
            self.blocks[i]
            for i in ids
            if self.blocks[i].block_hash is not None and self.q.forget(self.blocks[i])
        ]
        for i in ids:
            self._strip(self.blocks[i])
        self.q.end_forget()
        if moved:
            self.q.put_unhashed(moved)

    def reset(self) -> None:
        for b in self.blocks:
            self._strip(b)
        self.q.drain()

    def _strip(self, b: KVCacheBlock) -> None:
        h = b._block_hash
        if h is not None:
            if self.cached.get(h) is b:
                del self.cached[h]
            self.cached_block_hash_to_block.pop(h, b.block_id)  # type: ignore[arg-type]
            b._block_hash = None


def request(rid: str, priority: int, extra: dict[str, Any] | None = None, tokens: int = 0) -> Any:
    return SimpleNamespace(
        request_id=rid,
        priority=priority,
        sampling_params=SimpleNamespace(extra_args=extra),
        num_prompt_tokens=tokens,
        num_tokens=tokens,
        num_preemptions=0,
        block_hashes=[],
    )


def chain(session: int, n: int, tail: int) -> list[bytes]:
    """A session's shared chain of ``n`` blocks, then ``tail`` blocks of this request only."""
    own = [b"s%d-%d" % (session, i) for i in range(n)]
    return own + [b"s%d-%d-t%d" % (session, n, i) for i in range(tail)]


class RunQueueMachine(RuleBasedStateMachine):
    """Two pools driven alike: requests end through the general path (release hook, then vLLM's free) on
    ``pools[0]`` and through the fused one (``free_request``) on ``pools[1]``; the two must stay identical."""

    def __init__(self) -> None:
        super().__init__()
        self.t = [0.0]
        _runtime.set_clock(lambda: self.t[0])
        cfg = PolicyConfig(budget=0.5, isolation_goal=0.9, block_size=BLOCK)
        self.pools = (Pool(41, cfg), Pool(41, cfg))
        self.running: list[tuple[Any, list[list[KVCacheBlock]]]] = []
        self.serial = 0

    def teardown(self) -> None:
        _runtime.set_clock(None)

    @rule(
        session=st.integers(0, 3),
        shared=st.integers(0, 12),
        tail=st.integers(1, 6),
        priority=st.integers(-1, 2),
        partial=st.booleans(),
        directive=st.sampled_from([None, "dur", "perm", "scoped-low", "decode", "low-dur"]),
    )
    def admit(
        self, session: int, shared: int, tail: int, priority: int, partial: bool, directive: str | None
    ) -> None:
        self.serial += 1
        extra: dict[str, Any] | None = None
        if directive == "dur":
            extra = {"retention_directives": [{"start": 0, "end": 4 * BLOCK, "priority": 90, "duration": 5}]}
        elif directive == "perm":
            extra = {"retention_directives": [{"start": 0, "end": None, "priority": 60}]}
        elif directive == "scoped-low":
            extra = {
                "retention_directives": [{"start": 0, "end": 2 * BLOCK, "priority": 10}],
                "retention_scope": f"s{session}",
            }
        elif directive == "decode":  # generated tokens' blocks above the prompt's for a while
            extra = {"retention_decode_priority": 80, "retention_decode_duration": 3}
        elif directive == "low-dur":  # new content lowered for a while (it holds), a child kept above it
            extra = {
                "retention_directives": [{"start": 0, "end": 3 * BLOCK, "priority": 10, "duration": 4}],
                "retention_decode_priority": 30,
            }
        hashes = chain(session, shared, tail)
        req = request(f"r{self.serial}", priority, extra, tokens=len(hashes) * BLOCK + (5 if partial else 0))
        if directive in ("decode", "low-dur"):  # its last blocks hold generated tokens
            req.num_prompt_tokens = max(1, req.num_tokens - (tail * BLOCK) // 2)
        got = [pool.admit(req, hashes, partial) for pool in self.pools]
        ids = [None if g is None else [b.block_id for b in g] for g in got]
        assert ids[0] == ids[1], "the two pools admit alike"
        if got[0] is not None and got[1] is not None:
            self.running.append((req, [got[0], got[1]]))

    @precondition(lambda self: self.running)
    @rule(which=st.integers(0, 100))
    def finish(self, which: int) -> None:
        req, blocks = self.running.pop(which % len(self.running))
        self.pools[0].free(req, blocks[0])
        self.pools[1].free_fused(req, blocks[1])

    @precondition(lambda self: self.running)
    @rule(which=st.integers(0, 100))
    def finish_deferred(self, which: int) -> None:
        req, blocks = self.running.pop(which % len(self.running))
        for pool, mine in zip(self.pools, blocks, strict=True):
            pool.free_deferred(req, mine)

    @rule(ids=st.sets(st.integers(1, 40), max_size=4))
    def evict_blocks(self, ids: set[int]) -> None:
        for pool in self.pools:
            pool.evict_blocks(ids)

    @precondition(lambda self: not self.running)
    @rule()
    def reset(self) -> None:
        for pool in self.pools:
            pool.reset()

    @rule(dt=st.sampled_from([0.5, 3.0, 10.0]))
    def tick(self, dt: float) -> None:
        self.t[0] += dt

    @invariant()
    def consistent(self) -> None:
        for pool in self.pools:
            q = pool.q
            q.check()
            free = [b for b in pool.blocks[1:] if b.ref_cnt == 0]
            assert q.num_free_blocks == len(free), (
                "vLLM's free count: every block with no reference, cached or not"
            )
            assert q._held == sum(1 for b in free if b.block_hash is not None), (
                "cached free blocks are in runs"
            )

    @invariant()
    def fused_free_is_the_release_then_vllms_free(self) -> None:
        assert self.pools[0].state() == self.pools[1].state()


TestRunQueueMachine = RunQueueMachine.TestCase
TestRunQueueMachine.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# ---------------------------------------------------------------------------- the order it promises
def fixed_pool(num_blocks: int = 17) -> Pool:
    # a fixed budget as large as the pool: unprotected blocks go first whenever there are any
    return Pool(num_blocks, PolicyConfig(budget=1.0, isolation_goal=None, block_size=BLOCK))


def test_unprotected_runs_go_first_and_each_run_tail_first() -> None:
    pool = fixed_pool()
    hi, lo = request("hi", 0), request("lo", 1)  # retention 35 (protected at the default threshold), 25
    hb = pool.admit(hi, chain(0, 4, 0), False)
    lb = pool.admit(lo, chain(1, 4, 0), False)
    assert hb is not None and lb is not None
    pool.free(hi, hb)
    pool.free(lo, lb)
    pool.q.popleft_n(16 - 8)  # the never-used blocks first (the unhashed list, as stock vLLM)
    got = [b.block_id for b in pool.q.popleft_n(5)]
    assert got == [b.block_id for b in reversed(lb)] + [hb[-1].block_id]
    pool.q.check()


def test_a_shared_prefix_keeps_the_highest_retention_of_its_users() -> None:
    pool = fixed_pool()
    hi, lo = request("hi", 0), request("lo", 1)
    hb = pool.admit(hi, chain(0, 3, 0), False)  # p0 p1 p2
    assert hb is not None
    pool.free(hi, hb)
    lb = pool.admit(lo, chain(0, 3, 2), False)  # hits p0 p1 p2 (retention 35), adds two blocks of its own
    assert lb is not None and lb[:3] == hb
    pool.free(lo, lb)
    q = pool.q
    assert [q._r[b.block_id] for b in lb] == [35, 35, 35, 25, 25]
    q.popleft_n(16 - 5)
    got = [b.block_id for b in q.popleft_n(5)]
    assert got == [b.block_id for b in reversed(lb)], "its own blocks (25) first, then the shared prefix (35)"
    q.check()


def test_a_lapsed_directive_falls_back_and_its_blocks_requeue() -> None:
    t = [0.0]
    _runtime.set_clock(lambda: t[0])
    try:
        pool = fixed_pool()
        d = {"retention_directives": [{"start": 0, "end": 2 * BLOCK, "priority": 90, "duration": 30}]}
        a, b = request("a", 1, d, tokens=3 * BLOCK), request("b", 1)
        ab = pool.admit(a, chain(0, 3, 0), False)
        bb = pool.admit(b, chain(1, 3, 0), False)
        assert ab is not None and bb is not None
        pool.free(b, bb)
        pool.free(a, ab)
        q = pool.q
        assert [q._r[x.block_id] for x in ab] == [90, 90, 25]
        assert q.stats()["protected_blocks"] == 2
        q.popleft_n(16 - 6)
        t[0] = 31.0  # the directive lapses: its two blocks fall back to 25 and queue behind the others
        got = [x.block_id for x in q.popleft_n(6)]
        assert got[:4] == [x.block_id for x in reversed(bb)] + [ab[2].block_id]
        assert got[4:] == [ab[1].block_id, ab[0].block_id]  # deepest first, as in their run
        assert q.stats()["protected_blocks"] == 0
        q.check()
    finally:
        _runtime.set_clock(None)


def test_a_directive_on_a_whole_prompt_schedules_one_lapse_per_release() -> None:
    """An agent's prompt held at 90 for 10 s: its blocks lapse together, from one scheduled entry per release (one
    heap entry per block cost the scheduler a push and a pop per block); a second release that extends the
    directive moves the lapse, and the first release's entry then lapses nothing."""
    t = [0.0]
    _runtime.set_clock(lambda: t[0])
    try:
        pool = fixed_pool(33)
        d = {"retention_directives": [{"start": 0, "priority": 90, "duration": 10}]}
        a = request("a", 1, d, tokens=8 * BLOCK)
        ab = pool.run(a, chain(0, 8, 0))
        q = pool.q
        assert len(q._expiries) == 1 and sorted(q._expiries[0][2]) == sorted(x.block_id for x in ab)
        t[0] = 5.0
        a2 = request("a2", 1, d, tokens=8 * BLOCK)
        ab2 = pool.admit(a2, chain(0, 8, 0), False)
        assert ab2 is not None and ab2[:7] == ab[:7]  # hits (never the last block of a prompt, as vLLM)
        pool.free(a2, ab2)
        assert [e[0] for e in sorted(q._expiries)] == [10.0, 15.0]
        q.check()
        q._expire(12.0)  # the first entry: only the block the second release did not use lapses at 10
        assert [q._r[x.block_id] for x in ab] == [90] * 7 + [25]
        assert q.stats()["protected_blocks"] == 8  # (ab2's last block, new content at 90 until 15)
        q._expire(15.0)
        assert [q._r[x.block_id] for x in ab2] == [25] * 8
        assert q.stats()["protected_blocks"] == 0 and not q._expiries
        q.check()
    finally:
        _runtime.set_clock(None)


def test_hits_leave_a_run_and_eviction_skips_them() -> None:
    pool = fixed_pool()
    a = request("a", 1)
    ab = pool.run(a, chain(0, 6, 0))
    b = request("b", 1)
    bb = pool.admit(b, chain(0, 3, 0), False)  # hits the first two (never the whole prompt), recomputes none
    assert bb is not None and bb[:2] == ab[:2]
    q = pool.q
    q.popleft_n(16 - 6)
    got = [x.block_id for x in q.popleft_n(q.num_free_blocks)]
    assert ab[0].block_id not in got and ab[1].block_id not in got
    q.check()


def test_a_more_important_user_raises_a_cached_prefix() -> None:
    pool = fixed_pool()
    lo, hi = request("lo", 1), request("hi", 0)
    lb = pool.run(lo, chain(0, 3, 0))
    assert [pool.q._r[b.block_id] for b in lb] == [25, 25, 25]
    hb = pool.admit(hi, chain(0, 3, 1), False)  # hits all three, adds one
    assert hb is not None and hb[:3] == lb
    pool.free(hi, hb)
    assert [pool.q._r[b.block_id] for b in hb] == [35, 35, 35, 35]
    assert pool.q.stats()["protected_blocks"] == 4
    pool.q.check()


def _retained(pool: Pool, asks: list[tuple[float, int, dict[str, Any] | None]]) -> list[int]:
    """Requests on one prefix (``chain(0, 2, 1)``), each admitted and finished at its time ``t`` with its priority
    and retention fields; the retention of the prefix's two blocks once an eviction has applied the lapses due."""
    t = [0.0]
    _runtime.set_clock(lambda: t[0])
    try:
        prefix: list[KVCacheBlock] = []
        for i, (at, prio, extra) in enumerate(asks):
            t[0] = at
            req = request(f"r{i}", prio, extra, tokens=3 * BLOCK)
            got = pool.admit(req, chain(0, 2, 1), False)
            assert got is not None
            prefix = got[:2]
            pool.free(req, got)
        t[0] += 10.0
        pool.q.popleft_n(pool.q.num_free_blocks - pool.q._held + 1)  # one eviction: lapses due are applied
        pool.q.check()
        return [pool.q._r[b.block_id] for b in prefix]
    finally:
        _runtime.set_clock(None)


def test_a_user_asking_a_directives_priority_keeps_it_after_the_directive_ends() -> None:
    # priority 0 (maps to 35) asks 45 for 2 s; a priority -1 request (maps to 45) then uses the prefix: 45 is
    # its users' own priority now, so the directive's end changes nothing (the pool: level 45, fallback 45)
    d = {"retention_directives": [{"start": 0, "priority": 45, "duration": 2}]}
    # (before the fix the prefix fell to 35 and its head went first: [-1 (evicted), 35])
    assert _retained(fixed_pool(), [(0.0, 0, d), (0.5, -1, None)]) == [45, 45]


def test_a_lapsed_lowering_falls_back_to_its_users_highest_priority() -> None:
    # scope S raises the prefix to 60 (and owns it), a priority -2 request (maps to 55) uses it, S lowers it to 10
    # for 1 s; once that lapsed, a priority 0 request (35) finds it back at 55, its users' highest, not at 35
    up = {"retention_directives": [{"start": 0, "priority": 60}], "retention_scope": "S"}
    down = {"retention_directives": [{"start": 0, "priority": 10, "duration": 1}], "retention_scope": "S"}
    asks = [(0.0, 0, up), (0.0, -2, None), (0.0, 0, down), (2.0, 0, None)]
    assert _retained(fixed_pool(), asks) == [55, 55]


def test_generated_tokens_blocks_take_the_decode_priority_and_lapse_to_the_mapped_one() -> None:
    # a priority 1 request (maps to 25) of a 2-block prompt and 2 blocks of generated tokens asks 90 for its
    # generated tokens' blocks for 30 s (retention_decode_priority / _duration); its prompt keeps 25
    t = [0.0]
    _runtime.set_clock(lambda: t[0])
    try:
        pool = fixed_pool()
        d = {"retention_decode_priority": 90, "retention_decode_duration": 30}
        a = request("a", 1, d, tokens=2 * BLOCK)
        ab = pool.run(a, chain(0, 4, 0))
        q = pool.q
        assert [q._r[x.block_id] for x in ab] == [25, 25, 90, 90]
        assert q.stats()["protected_blocks"] == 2
        t[0] = 31.0
        q.popleft_n(q.num_free_blocks - q._held + 1)  # one eviction applies the lapse
        # the generated tokens' blocks fell to 25; the victim is the deepest of them, as in the pool (leaves only:
        # the prompt's blocks wait for their child, whatever their own key)
        assert [q._r[x.block_id] for x in ab] == [25, 25, 25, -1]
        assert q.stats()["protected_blocks"] == 0
        q.check()
    finally:
        _runtime.set_clock(None)


def test_a_parent_kept_below_its_child_goes_after_it_as_in_the_pool() -> None:
    # a priority 1 request (maps to 25) keeps its prompt's first two blocks at 10: the pool evicts leaves only,
    # so those two wait for the two deeper blocks (25) and go right after them; the run queue ranks the head's
    # run at the deeper run's key (before: on its own lower key, first, leaving the deeper two unreachable)
    pool = fixed_pool()
    d = {"retention_directives": [{"start": 0, "end": 2 * BLOCK, "priority": 10}]}
    a = request("a", 1, d, tokens=4 * BLOCK)
    ab = pool.run(a, chain(0, 4, 0))
    q = pool.q
    assert [q._r[x.block_id] for x in ab] == [10, 10, 25, 25]
    q.popleft_n(16 - 4)
    assert [x.block_id for x in q.popleft_n(4)] == [x.block_id for x in reversed(ab)]
    q.check()


def test_a_prefix_freed_after_its_childs_run_waits_for_it_even_at_a_lower_key() -> None:
    # a (priority 2, 15) holds p0 p1 while b (priority 1, 25) hits them, keeps them at 10 by a directive and
    # ends: b's ten own blocks are queued, p0 p1 are not free yet. When a ends, p0 p1 (15: a lower key than the
    # child's, in the same tier) are freed by another release than their child's: the pool evicts leaves only,
    # so they still wait for b's blocks (the waiting child's key is their floor, not only its tier)
    pool = fixed_pool()
    low = {"retention_directives": [{"start": 0, "end": 2 * BLOCK, "priority": 10}]}
    a, b = request("a", 2), request("b", 1, low, tokens=12 * BLOCK)
    ab = pool.admit(a, chain(0, 2, 0), False)
    bb = pool.admit(b, chain(0, 2, 10), False)
    assert ab is not None and bb is not None and bb[:2] == ab
    pool.free(b, bb)
    pool.free(a, ab)
    q = pool.q
    assert [q._r[x.block_id] for x in bb] == [15, 15] + [25] * 10
    q.popleft_n(16 - 12)
    assert [x.block_id for x in q.popleft_n(12)] == [x.block_id for x in reversed(bb)]
    q.check()


def test_a_lifted_prompt_evicted_from_the_protected_tier_was_never_counted_protected() -> None:
    # a priority 1 request (25) with two generated tokens' blocks at 90: its prompt's run is queued in the
    # protected tier behind them (leaves only) but its blocks are not protected. Once the generated blocks are
    # gone by evict_blocks (no eviction relifts the prompt), evicting the prompt from the protected tier leaves
    # the protected count at the cached blocks at or above the threshold: none
    pool = fixed_pool()
    a = request("a", 1, {"retention_decode_priority": 90}, tokens=2 * BLOCK)
    ab = pool.run(a, chain(0, 4, 0))
    q = pool.q
    assert [q._r[x.block_id] for x in ab] == [25, 25, 90, 90]
    assert q.stats()["protected_blocks"] == 2
    pool.evict_blocks({ab[2].block_id, ab[3].block_id})
    assert q.stats()["protected_blocks"] == 0
    got = [x.block_id for x in q.popleft_n(q.num_free_blocks)][-2:]
    assert got == [ab[1].block_id, ab[0].block_id]
    assert q.stats()["protected_blocks"] == 0
    q.check()


def test_a_wait_behind_a_child_ends_with_the_content_it_was_for() -> None:
    # b (scoped: the full rules per block) ends while a still holds p1: b's blocks wait-link p1 behind them. p1's
    # content then goes while a holds it (evict_blocks), a ends, and the block id is reused by new content of c
    # and d (15): that content is no parent of b's blocks, so it is ranked on its own key, before b's (25)
    pool = fixed_pool()
    a, b = request("a", 2), request("b", 1, {"retention_scope": "s"})
    c, d = request("c", 2), request("d", 2)
    ab = pool.admit(a, chain(0, 2, 0), False)
    bb = pool.admit(b, chain(0, 2, 2), False)
    assert ab is not None and bb is not None
    pool.free(b, bb)
    pool.evict_blocks({ab[1].block_id})
    pool.free(a, ab)
    cb = pool.admit(c, chain(5, 1, 0), False)
    assert cb is not None and cb[0] is ab[1]  # (the unhashed block is reused first)
    pool.free(c, cb)
    db = pool.admit(d, chain(5, 1, 1), False)  # a hit on the reused block: its second release is a known one
    assert db is not None
    pool.free(d, db)
    q = pool.q
    order = [x.block_id for x in q.get_all_free_blocks()][-5:]
    assert order == [db[1].block_id, db[0].block_id, bb[3].block_id, bb[2].block_id, ab[0].block_id]
    q.check()


def test_keying_every_run_again_keeps_parents_behind_their_children() -> None:
    # the controller changed its tables (here: the same ones): every run is keyed again, and a run a deeper one
    # lifted is lifted again, into the protected tier (a prompt at 25 under its generated blocks at 90) or to
    # the deeper run's key (a head kept at 10 under blocks at 25); the eviction order stays what it was
    pool = fixed_pool()
    a = request("a", 1, {"retention_decode_priority": 90}, tokens=2 * BLOCK)
    low = {"retention_directives": [{"start": 0, "end": 2 * BLOCK, "priority": 10}]}
    b = request("b", 1, low, tokens=4 * BLOCK)
    ab = pool.admit(a, chain(0, 4, 0), False)
    bb = pool.admit(b, chain(1, 4, 0), False)
    assert ab is not None and bb is not None
    pool.free(a, ab)
    pool.free(b, bb)
    q = pool.q
    assert [q._r[x.block_id] for x in ab + bb] == [25, 25, 90, 90, 10, 10, 25, 25]
    before = [x.block_id for x in q.get_all_free_blocks()]
    assert before[-8:] == [x.block_id for x in reversed(bb)] + [x.block_id for x in reversed(ab)]
    q._rekey()
    assert [x.block_id for x in q.get_all_free_blocks()] == before
    q.check()


def test_the_listed_order_counts_the_protected_blocks_it_passes() -> None:
    # a fixed protected target of 4.25 blocks, 6 protected (p1, p2 at 35, released at L = 0) and u (25) released
    # after an eviction raised L past 0.5: over the target the tiers compete and p1 (the lower key) goes first;
    # then 3 protected blocks are left, within the target, so u goes before p2. The listed order (the walk
    # without evicting) passes p1 the same way: it goes over the target no longer
    pool = Pool(17, PolicyConfig(budget=0.25, isolation_goal=None, block_size=BLOCK))
    q = pool.q

    def run(req: Any, hashes: list[bytes]) -> list[KVCacheBlock]:
        got = pool.admit(req, hashes, False)
        assert got is not None
        pool.free(req, got)
        return got

    p1 = run(request("p1", 0), chain(0, 3, 0))
    p2 = run(request("p2", 0), chain(1, 3, 0))
    v = run(request("v", 1, {"retention_directives": [{"start": 0, "priority": 34}]}, BLOCK), chain(2, 1, 0))
    taken = q.popleft_n(q.num_free_blocks - q._held + 1)  # the never-used blocks, then one eviction: v
    assert taken[-1] is v[0] and q._L > 0.5
    for b in taken:  # a request took them and ends before caching anything (vLLM's get_new_blocks, free)
        pool._strip(b)
        b.ref_cnt = 1
    pool.free_blocks(list(reversed(taken)))
    u = run(request("u", 1), chain(3, 3, 0))
    listed = [x.block_id for x in q.get_all_free_blocks()][-9:]
    evicted = [x.block_id for x in q.popleft_n(q.num_free_blocks)][-9:]
    assert evicted == [x.block_id for blocks in (p1, u, p2) for x in reversed(blocks)]
    assert listed == evicted
    q.check()


def test_new_content_counts_this_use_plus_what_the_ghost_remembers_of_its_segment() -> None:
    # a 3-block prompt's new content is used once; evicted, the ghost keeps its segment head's count, so the
    # same content cached again counts that use and this one (the segment's blocks share the count)
    pool = fixed_pool()
    q = pool.q
    a = request("a", 1)
    ab = pool.run(a, chain(0, 3, 0))
    assert [q._uses[x.block_id] for x in ab] == [1, 1, 1]
    taken = q.popleft_n(q.num_free_blocks)  # every block, the cached ones evicted
    for x in taken:  # a request took them and ends before caching anything (vLLM's get_new_blocks, free)
        pool._strip(x)
        x.ref_cnt = 1
    pool.free_blocks(list(reversed(taken)))
    b = request("b", 1)
    bb = pool.run(b, chain(0, 3, 0))
    assert [q._uses[x.block_id] for x in bb] == [2, 2, 2]
    q.check()


def test_a_decode_duration_without_a_decode_priority_changes_nothing() -> None:
    # it asks the mapped priority for a while, which every release asks: the same retention, order and path as
    # no field at all (before: a per-block plan whose durations also stopped a parent's ranking behind its
    # child, so the lowered head below went before the deeper blocks)
    head = [{"start": 0, "end": BLOCK, "priority": 10}]
    orders = []
    for extra in (
        {"retention_directives": head},
        {"retention_directives": head, "retention_decode_duration": 5},
    ):
        pool = fixed_pool()
        a = request("a", 1, extra, tokens=2 * BLOCK)  # 2 prompt blocks, 2 of generated tokens
        ab = pool.run(a, chain(0, 4, 0))
        q = pool.q
        assert [q._r[x.block_id] for x in ab] == [10, 25, 25, 25]
        q.popleft_n(16 - 4)
        orders.append([ab.index(x) for x in q.popleft_n(4)])
        q.check()
    assert orders[0] == orders[1] == [3, 2, 1, 0]


def test_a_requests_retention_is_parsed_once_whatever_its_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every release parsed the request's retention fields again (up to 1024 directives in the engine's busy loop);
    a preempted request is released at each preemption. Parsed once now, and again only for other ``extra_args``."""
    from kvretain.integrations.vllm import _base

    parsed: list[object] = []
    real = _base.retention_from_extra_args

    def counting(extra: Any) -> Any:
        parsed.append(extra)
        return real(extra)

    monkeypatch.setattr(_base, "retention_from_extra_args", counting)
    pool = fixed_pool()
    d = {"retention_directives": [{"start": 0, "end": BLOCK, "priority": 90}]}
    a = request("a", 1, d, tokens=3 * BLOCK)
    for _ in range(3):  # admitted, preempted (released), admitted again...
        ab = pool.run(a, chain(0, 3, 0))
        assert pool.q._r[ab[0].block_id] == 90
    assert len(parsed) == 1
    a.sampling_params = SimpleNamespace(extra_args={"retention_directives": [{"start": 0, "priority": 10}]})
    ab = pool.run(a, chain(1, 3, 0))
    assert len(parsed) == 2 and pool.q._r[ab[0].block_id] == 10
    pool.q.check()


def _lapsing_requests(steps: int) -> tuple[list[Any], list[int]]:
    """Requests of 4 blocks (every third shares a 2-block prefix) on a 16-block pool, directives of a week, 3 s or
    none, a clock moving 1 s a request, freed alternately through the fused and the general path: the queue's
    state after each, and the ids its scheduled lapses hold."""
    t = [0.0]
    _runtime.set_clock(lambda: t[0])
    try:
        pool = fixed_pool()
        states: list[Any] = []
        pending: list[int] = []
        for i in range(steps):
            d = {"start": 0, "priority": 80 if i % 2 else 10, "duration": (7 * 24 * 3600.0, 3.0, None)[i % 3]}
            req = request(f"r{i}", i % 3 - 1, {"retention_directives": [d]}, tokens=4 * BLOCK)
            own = [b"u%d-%d" % (i, k) for k in range(4)]
            blocks = pool.admit(req, chain(0, 2, 0) + own[:2] if i % 3 == 0 else own, False)
            assert blocks is not None
            (pool.free_fused if i % 2 else pool.free)(req, blocks)
            t[0] += 1.0
            pool.q.check()
            states.append(pool.state())
            pending.append(pool.q._pending)
        states.append([b.block_id for b in pool.q.popleft_n(pool.q.num_free_blocks)])
        return states, pending
    finally:
        _runtime.set_clock(None)


def test_scheduled_lapses_grow_with_the_pool_not_the_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run queue's scheduled lapses (one entry per release and expiry time) kept the ids of evicted or
    re-released blocks until their time came: with week-long durations they grew with the releases. Compacted now
    (ids whose block's expiry is still the entry's are kept), within twice the pool plus a constant, deciding the
    same (the whole state after every request, and the final eviction order)."""
    from kvretain.core.policies import rules

    states, pending = _lapsing_requests(300)
    assert max(pending) <= 2 * 16 + rules.LAPSE_SLACK, max(pending)
    monkeypatch.setattr(rules, "lapse_limit", lambda kept: 10**9)  # never compacted
    never, grown = _lapsing_requests(300)
    assert states == never
    assert max(grown) > 2 * 16 + rules.LAPSE_SLACK


@pytest.mark.parametrize("granularity", ["run", "block"])
def test_distinct_request_priorities_do_not_grow_the_queues_state(granularity: str) -> None:
    """The queue kept the mapped retention of every request priority it ever saw (a client picks any 64-bit
    integer): one entry per distinct priority, never dropped, not even at a prefix-cache reset. At most
    MAX_PRIORITY_CLASSES now; the others are mapped again, to the same retention."""
    from kvretain.core.policy import make_policy
    from kvretain.integrations.vllm._queue import RetentionFreeQueue

    pool = fixed_pool()
    if granularity == "block":
        n = len(pool.blocks)
        pool.q = RetentionFreeQueue(
            pool.blocks[1:],
            pool.blocks,
            lambda c: make_policy("unified", n, PolicyConfig(), capacity=c),
            PriorityMapping(),
        )
    q = pool.q
    try:
        for i in range(500):
            req = request(f"p{i}", 10**12 + i, tokens=2 * BLOCK)
            blocks = pool.admit(req, chain(i, 2, 0), False)
            assert blocks is not None
            q.on_lookup(req, 0, BLOCK)
            pool.free(req, blocks)
    finally:
        _runtime.COUNTERS.reset()  # (process-wide)
    assert len(q._mapped) <= _runtime.MAX_PRIORITY_CLASSES
    assert q._mapped_for(-5) == 85 and q._mapped_for(2**62) == 0  # (past the limit: mapped all the same)
    pool.reset()
    assert not q._mapped
    q.check()


def test_a_duplicate_evicted_while_its_content_stays_cached_leaves_no_ghost_entry() -> None:
    # vLLM registers content that two running requests computed twice (a duplicate; its index keeps the first).
    # The duplicate evicted while the first block still holds the content is no eviction of the content: a ghost
    # entry then gives the next duplicate of it the evicted one's use count
    pool = fixed_pool()
    q = pool.q
    h0 = chain(0, 1, 0)[0]
    a = request("a", 1)
    ab = pool.admit(a, [h0, b"a-tail"], False)
    assert ab is not None
    b = request("b", 1)  # computed the same first block at the same time as a: a duplicate of it
    bb = q.popleft_n(2)
    for x in bb:
        pool._strip(x)
        x.ref_cnt = 1
    pool.cache(bb[0], h0)  # (vLLM's index now holds two blocks under h0)
    pool.cache(bb[1], b"b-tail")
    b.block_hashes = [h0, b"b-tail"]
    assert pool.cached[h0] is ab[0]
    pool.free(b, bb)
    pool.free(a, ab)
    unhashed = q.num_free_blocks - 4
    taken = q.popleft_n(unhashed + 2)  # the empty blocks, then b's run, tail first: its duplicate goes
    assert {x.block_id for x in taken[unhashed:]} == {bb[0].block_id, bb[1].block_id}
    for x in taken:
        pool._strip(x)
    assert pool.cached[h0] is ab[0]  # the content is still cached
    assert h0 not in q._ghost.table
    taken = q.popleft_n(2)  # a's run: the last copy goes, and the content with it
    assert {x.block_id for x in taken} == {ab[0].block_id, ab[1].block_id}
    for x in taken:
        pool._strip(x)
    assert q._ghost.table.get(h0) == 1  # (remembered: the content's one use)


def duplicated_pool() -> tuple[Pool, bytes, list[KVCacheBlock], list[KVCacheBlock]]:
    """Two requests that computed the same first block at once, both released: the pool, that content, and
    the two requests' blocks (each: that block, then a tail of its own)."""
    pool = fixed_pool()
    q = pool.q
    h0 = chain(0, 1, 0)[0]
    a, b = request("a", 1), request("b", 1)
    ab = pool.admit(a, [h0, b"a-tail"], False)
    assert ab is not None
    bb = q.popleft_n(2)
    for x in bb:
        pool._strip(x)
        x.ref_cnt = 1
    pool.cache(bb[0], h0)
    pool.cache(bb[1], b"b-tail")
    b.block_hashes = [h0, b"b-tail"]
    pool.free(b, bb)
    pool.free(a, ab)
    return pool, h0, ab, bb


def test_evict_blocks_leaves_a_ghost_entry_only_with_the_contents_last_copy() -> None:
    # the ``_drop`` path (BlockPool.evict_blocks): the queue forgets a block before vLLM strips its hash
    pool, h0, ab, bb = duplicated_pool()
    q = pool.q
    pool.evict_blocks({bb[0].block_id})  # a's block keeps the content
    assert h0 not in q._ghost.table
    pool.evict_blocks({ab[0].block_id})  # the last copy
    assert q._ghost.table.get(h0) == 1
    q.check()


def test_both_copies_evicted_at_once_leave_one_ghost_entry() -> None:
    # vLLM strips each victim after popleft_n / forget returned: the index still lists every one of them
    pool, h0, ab, bb = duplicated_pool()
    q = pool.q
    pool.evict_blocks({bb[0].block_id, ab[0].block_id})
    assert q._ghost.table.get(h0) == 1
    q.check()
    pool, h0, ab, bb = duplicated_pool()
    q = pool.q
    taken = q.popleft_n(q.num_free_blocks)  # everything: both copies in one eviction
    for x in taken:
        pool._strip(x)
    assert q._ghost.table.get(h0) == 1


def test_evict_blocks_taking_a_copy_in_use_with_a_free_one_leaves_one_ghost_entry() -> None:
    # evict_blocks (a KV connector's failed load) strips every block it names, in use or not: taking both copies
    # of content at once, one of them in use again (a hit), the content leaves the cache and leaves one entry, in
    # either order of the two (each sees the other listed in vLLM's index until the call ends)
    for in_use_first in (True, False):
        pool, h0, ab, bb = duplicated_pool()
        q = pool.q
        hit = pool.lookup([h0])
        assert hit == [ab[0]]
        q.remove(ab[0])  # BlockPool.touch: a request hits it and holds it
        ab[0].ref_cnt = 1
        order = [ab[0].block_id, bb[0].block_id]
        pool.evict_blocks(order if in_use_first else order[::-1])
        assert h0 not in pool.cached_block_hash_to_block._cache
        assert q._ghost.table.get(h0) == 1, in_use_first
        ab[0].ref_cnt = 0
        q.check()
        pool, h0, ab, bb = duplicated_pool()  # no entry while a copy the call does not name stays
        q = pool.q
        q.remove(ab[0])
        ab[0].ref_cnt = 1
        pool.evict_blocks([bb[0].block_id])
        assert h0 not in q._ghost.table


def test_a_hit_block_a_copys_endpoint_still_holds_is_charged_to_the_last_request_that_released_it() -> None:
    # A partial hit's copy-on-write keeps the block it hit referenced until the copy has run; the scheduler frees
    # it after the request's own release (vLLM's append_n places it then). Its eviction is charged to its last
    # releasing request, ``b`` (class 1), also when that release took the shared-prefix path (content known at a
    # retention at least b's, another reference left), not to ``a`` (class 0), which released it before b hit it
    pool = fixed_pool()
    q = pool.q
    _runtime.COUNTERS.reset()  # (process-wide)
    try:
        a, b = request("a", 0), request("b", 1)  # retention 35 and 25
        pool.run(a, chain(0, 2, 0))
        bb = pool.admit(b, chain(0, 2, 1), False)  # hits both of a's blocks
        assert bb is not None
        bb[1].ref_cnt += 1  # the copy's endpoint (the scheduler holds the block hit until the copy has run)
        pool.free(b, bb)
        assert bb[1].ref_cnt == 1
        pool.free_blocks([bb[1]])  # the scheduler's free, after the copy ran
        q.check()
        taken = q.popleft_n(q.num_free_blocks)
        for x in taken:
            pool._strip(x)
        evicted = {
            p: c["evicted_blocks"] for p, c in _runtime.COUNTERS.snapshot().items() if c["evicted_blocks"]
        }
    finally:
        _runtime.COUNTERS.reset()
    assert evicted == {1: 3}
