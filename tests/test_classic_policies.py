"""The published behaviour of ``s3fifo`` (SOSP'23) and ``arc`` (FAST'03) on tiny pools, with exact expectations.

Hashes are plain ints. Most requests are one block long, so a request is one access of one block: a miss
inserts it, a hit accesses it (see ``kvretain.core.policies._classic`` for what the pool's calls mean).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

import kvretain.replay as replay_module
from kvretain.core import BlockPool, make_policy
from kvretain.core.hashing import BlockHash
from kvretain.core.kv_cache_manager import KVCacheManager
from kvretain.core.policies import ARCPolicy, S3FIFOPolicy
from kvretain.core.policies.s3fifo import FREQ_CAP
from kvretain.core.policy import PolicyConfig
from kvretain.replay import ReplayRequest, replay
from kvretain.sched import Request, RunnerOutput, Scheduler, SchedulerConfig


class Sim:
    """A pool driven one request at a time; integrity checked after every step."""

    def __init__(self, policy: str, n: int) -> None:
        self.pool = BlockPool(n, make_policy(policy, n))
        self.policy = self.pool.policy
        self.evicted: list[int] = []
        self.pool.on_evict = lambda bid, h: self.evicted.append(int(h))

    def run(self, *requests: Sequence[int]) -> int:
        """Serve each request (look up, touch hits, allocate misses, cache, release); return the hits."""
        pool = self.pool
        hits = 0
        for hashes in requests:
            k = 0
            while k < len(hashes) and hashes[k] in pool.cached:
                k += 1
            self.policy.lookup(hashes, k, 35)  # before the allocation, as the core manager and replay do
            hit_ids = [pool.cached[h] for h in hashes[:k]]
            pool.touch(hit_ids)
            new = pool.get_new_blocks(len(hashes) - k)
            assert new is not None
            ids = hit_ids + new
            pool.cache_blocks(ids, hashes, k, len(hashes))
            pool.free_blocks(ids)
            pool.check_integrity()
            hits += k
        return hits

    def evict(self, n: int = 1) -> list[int]:
        """Evict ``n`` blocks (allocating every empty block too, then giving them all back empty); the hashes
        evicted, in order."""
        pool = self.pool
        empty = sum(1 for b in range(pool.num_blocks) if pool.ref_count(b) == 0 and pool.hash_of(b) is None)
        start = len(self.evicted)
        ids = pool.get_new_blocks(empty + n)
        assert ids is not None
        pool.free_blocks(ids)
        pool.check_integrity()
        return self.evicted[start:]

    def evict_all(self) -> list[int]:
        out: list[int] = []
        while self.pool.cached:
            out += self.evict(len(self.pool.cached))
        return out


def singles(hashes: Sequence[int]) -> list[list[int]]:
    return [[h] for h in hashes]


def requests(blocks: Sequence[Sequence[int]]) -> list[ReplayRequest]:
    return [ReplayRequest(hashes=tuple(b), timestamp_s=float(i)) for i, b in enumerate(blocks)]


def scan_workload(working_set: int, rounds: int, scan: int) -> list[list[int]]:
    """A working set used ``rounds`` times, a scan of ``scan`` one-off blocks, then the working set again."""
    hot = singles(range(1, working_set + 1))
    return hot * rounds + singles(range(1000, 1000 + scan)) + hot


def test_policy_flags_and_registry() -> None:
    for name, cls in (("s3fifo", S3FIFOPolicy), ("arc", ARCPolicy)):
        p = make_policy(name, 10)
        assert type(p) is cls and p.name == name
        assert (p.leaf_only, p.tracks_uses, p.forgets_on_pop) == (False, True, True)


# ---------------------------------------------------------------- s3fifo


def test_s3fifo_queue_sizes_follow_the_paper() -> None:
    p = make_policy("s3fifo", 200)
    assert isinstance(p, S3FIFOPolicy)
    assert (p.small_target, p.ghost_capacity) == (20, 180)  # 10% small, ghost as large as main (90%)


def test_s3fifo_one_hit_wonders_go_before_an_older_reused_block() -> None:
    sim = Sim("s3fifo", 10)  # small queue: 1 block
    sim.run([1], [1], *singles(range(2, 11)))  # 1 is used twice, 2..10 once; the pool is full
    # 1 is the oldest block of the small queue but was accessed: it moves to main; 2 goes, to the ghost
    assert sim.evict() == [2]
    assert sim.policy.stats() == {"small": 8, "main": 1, "ghost": 1}
    # the rest of the small queue goes first (FIFO), then main
    assert sim.evict_all() == [3, 4, 5, 6, 7, 8, 9, 10, 1]
    lru = Sim("lru", 10)
    lru.run([1], [1], *singles(range(2, 11)))
    assert lru.evict_all() == list(range(1, 11))  # LRU drops the oldest first


def test_s3fifo_ghost_hit_enters_main_and_main_reinserts_with_frequency() -> None:
    sim = Sim("s3fifo", 10)
    sim.run([1], [1], *singles(range(2, 11)))
    assert sim.evict() == [2]  # 1 to main (its frequency cleared), 2 to the ghost
    sim.run(*[[1]] * 5)  # 1 accessed 5 times in main: frequency capped at 3
    assert sim.run([2]) == 0  # a miss, but a ghost hit: 2 is inserted straight into main
    assert sim.policy.stats() == {"small": 8, "main": 2, "ghost": 0}
    # the small queue still holds 8 blocks (>= its 1-block share): they go first; then main in FIFO order,
    # where 1 (frequency 3) is reinserted behind 2 (frequency 0)
    assert sim.evict_all() == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]


def test_s3fifo_frequency_is_capped_and_spent_one_per_reinsertion() -> None:
    sim = Sim("s3fifo", 10)
    sim.run([1], [1], *singles(range(2, 11)))
    sim.evict()  # 1 to main
    sim.run(*[[1]] * 5)
    pol = sim.policy
    assert isinstance(pol, S3FIFOPolicy)
    assert pol._meta[sim.pool.cached[1]].freq == FREQ_CAP == 3
    # refill main behind 1 through ghost hits: 2 (evicted above) and 3..5 (evicted now)
    assert sim.evict(3) == [3, 4, 5]
    assert sim.run([2], [3], [4], [5]) == 0
    assert pol.stats()["main"] == 5
    # main is evicted only once small is under its share: 6..10 leave small first; then 1 (frequency 3) is
    # reinserted behind the blocks of frequency 0 and goes last
    assert sim.evict_all() == [6, 7, 8, 9, 10, 2, 3, 4, 5, 1]


def test_s3fifo_main_reinsertion_spends_one_unit_of_frequency_not_all() -> None:
    sim = Sim("s3fifo", 10)  # small queue: 1 block
    sim.run([1], [1], *singles(range(2, 11)))
    assert sim.evict() == [2]  # 1 to main, 2 to the ghost
    sim.run([1], [1])  # 1 accessed twice in main: frequency 2
    assert sim.run([2]) == 0  # a ghost hit: 2 enters main behind 1
    assert sim.evict(8) == [3, 4, 5, 6, 7, 8, 9, 10]  # small empties first (3..10 to the ghost)
    # main: 1 (frequency 2) is reinserted with frequency 1, and 2 (frequency 0) goes
    assert sim.evict() == [2]
    assert sim.run([3]) == 0  # a ghost hit: 3 enters main behind 1
    # 1 still has a unit of frequency: reinserted once more, so 3 goes before it
    assert sim.evict() == [3]
    assert sim.evict() == [1]


def test_s3fifo_promotion_to_main_clears_the_frequency() -> None:
    sim = Sim("s3fifo", 10)  # small queue: 1 block
    sim.run([1], [1], [1], *singles(range(2, 11)))  # 1 accessed twice in small: frequency 2
    assert sim.evict() == [2]  # 1 moves to main with its frequency cleared; 2 to the ghost
    pol = sim.policy
    assert isinstance(pol, S3FIFOPolicy)
    assert pol._meta[sim.pool.cached[1]].freq == 0
    assert sim.run([2]) == 0  # a ghost hit: 2 enters main behind 1
    assert sim.evict(8) == [3, 4, 5, 6, 7, 8, 9, 10]
    # both in main with frequency 0: FIFO, 1 goes first (its accesses in small bought the move, nothing more)
    assert sim.evict_all() == [1, 2]


def test_s3fifo_ghost_holds_as_many_hashes_as_main_holds_blocks() -> None:
    sim = Sim("s3fifo", 10)  # ghost capacity: 9
    sim.run(*singles(range(1, 11)))
    assert sim.evict_all() == list(range(1, 11))  # one-hit wonders, all from small, all to the ghost
    assert sim.policy.stats() == {"small": 0, "main": 0, "ghost": 9}  # 1, the oldest, was dropped
    assert sim.run([2]) == 0  # the oldest hash kept: a ghost hit, straight into main
    assert sim.run([1]) == 0  # forgotten: a plain miss, into small
    assert sim.policy.stats() == {"small": 1, "main": 1, "ghost": 8}


def test_s3fifo_block_in_use_is_skipped_and_comes_back_at_the_old_end() -> None:
    sim = Sim("s3fifo", 4)  # small queue: 1 block
    sim.run([1], [2], [3], [4])
    pool = sim.pool
    held = pool.cached[1]
    pool.touch([held])  # 1 is in use by a request: the oldest block, but it cannot be evicted
    assert sim.evict() == [2]
    pool.free_blocks([held])  # the request ends: 1 was accessed, so it moves to main at the next look
    pool.check_integrity()
    assert sim.evict() == [3]
    assert sim.policy.stats() == {"small": 1, "main": 1, "ghost": 2}
    assert sim.evict_all() == [4, 1]


def test_s3fifo_blocks_set_aside_together_come_back_in_their_queue_order() -> None:
    # A chain enters the small queue tail first (its request releases deepest first): 3 2 1. A request that hits
    # the chain holds the three blocks while its allocation evicts past them: they stay in place, so they must
    # come back in that order. Each release put its block in front of the last one put back: 1 2 3, the chain
    # moved to main head first, and main then evicted the head 1 first, leaving 2 and 3 unreachable
    sim = Sim("s3fifo", 10)  # small queue: 1 block
    sim.run([1, 2, 3], *singles(range(4, 11)))  # small, oldest first: 3 2 1 4 5 ... 10
    assert sim.run([1, 2, 3, 11]) == 3  # 1..3 in use (set aside) while 4 is evicted
    assert sim.evicted == [4]
    # small: 3, 2, 1 (accessed: to main in that order), then 5..11 (one-hit wonders); main: 3, 2, 1
    assert sim.evict_all() == [5, 6, 7, 8, 9, 10, 11, 3, 2, 1]


class TextbookS3FIFO:
    """S3-FIFO as s3fifo.py states it, for one-block requests: a miss evicts one object when the cache is full
    (from S when |S| >= 10%, else from M), then enters M if its key is in G, else S; a hit counts up to 3; S's
    oldest moves to M when accessed (count cleared), else leaves to G (G as large as M); M's oldest is reinserted
    with its count minus one, or leaves."""

    def __init__(self, c: int) -> None:
        self.c = c
        self.small_target = max(1, c // 10)
        self.s: dict[int, None] = {}  # insertion-ordered: oldest first
        self.m: dict[int, None] = {}
        self.g: dict[int, None] = {}
        self.freq: dict[int, int] = {}
        self.evicted: list[int] = []

    def _from_small(self) -> bool:
        while self.s:
            x = next(iter(self.s))
            del self.s[x]
            if self.freq[x]:
                self.freq[x] = 0
                self.m[x] = None
                continue
            self.g[x] = None
            if len(self.g) > self.c - self.small_target:
                del self.g[next(iter(self.g))]
            del self.freq[x]
            self.evicted.append(x)
            return True
        return False

    def _from_main(self) -> bool:
        while self.m:
            x = next(iter(self.m))
            del self.m[x]
            if self.freq[x]:
                self.freq[x] -= 1
                self.m[x] = None
                continue
            del self.freq[x]
            self.evicted.append(x)
            return True
        return False

    def access(self, x: int) -> bool:
        if x in self.freq:
            self.freq[x] = min(self.freq[x] + 1, 3)
            return True
        if len(self.freq) == self.c:
            if len(self.s) >= self.small_target:
                self._from_small() or self._from_main()
            else:
                self._from_main() or self._from_small() or self._from_main()
        if x in self.g:
            del self.g[x]
            self.m[x] = None
        else:
            self.s[x] = None
        self.freq[x] = 0
        return False


@pytest.mark.parametrize("seed", range(4))
def test_s3fifo_matches_textbook_s3fifo_one_block_per_request(seed: int) -> None:
    rng = random.Random(seed)
    c = rng.choice([3, 10, 20, 37])
    trace = [rng.randrange(4 * c) if rng.random() < 0.7 else rng.randrange(c) for _ in range(1500)]
    ref = TextbookS3FIFO(c)
    want = [ref.access(x) for x in trace]
    sim = Sim("s3fifo", c)
    got = [sim.run([x]) == 1 for x in trace]
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    assert first is None, f"c={c}: first difference at access {first}"
    assert sim.evicted == ref.evicted
    stats = sim.policy.stats()
    assert (stats["small"], stats["main"], stats["ghost"]) == (len(ref.s), len(ref.m), len(ref.g))


def test_s3fifo_scan_does_not_flush_the_working_set_but_lru_does() -> None:
    reqs = requests(scan_workload(working_set=5, rounds=3, scan=40))
    tail = 5  # the last round of the working set
    before = {p: replay(reqs[:-tail], 20, p).hit_blocks for p in ("s3fifo", "lru")}
    after = {p: replay(reqs, 20, p, check_every=1).hit_blocks for p in ("s3fifo", "lru")}
    assert after["s3fifo"] - before["s3fifo"] == 5  # the whole working set survived the scan
    assert after["lru"] - before["lru"] == 0  # LRU: flushed


# ---------------------------------------------------------------- arc


def arc_stats(sim: Sim) -> dict[str, float]:
    return sim.policy.stats()


def test_arc_block_used_twice_moves_to_t2() -> None:
    sim = Sim("arc", 4)
    sim.run([1])
    assert arc_stats(sim) == {"p": 0.0, "t1": 1, "t2": 0, "b1": 0, "b2": 0}
    sim.run([1])  # its second use (first hit): recency list -> frequency list
    assert arc_stats(sim) == {"p": 0.0, "t1": 0, "t2": 1, "b1": 0, "b2": 0}
    sim.run([1])  # stays in T2
    assert arc_stats(sim)["t2"] == 1


def test_arc_target_grows_on_b1_ghost_hits_and_shrinks_on_b2_ghost_hits() -> None:
    sim = Sim("arc", 4)
    sim.run([1], [1], [2], [3], [4])  # T2: 1; T1: 2 3 4 (LRU first); p = 0
    assert sim.evict() == [2]  # |T1| = 3 > p: T1's LRU block, to B1
    assert sim.run([2]) == 0  # a B1 ghost hit: T1 was too small
    assert arc_stats(sim) == {"p": 1.0, "t1": 2, "t2": 2, "b1": 0, "b2": 0}  # p += max(1, 0/1)
    assert sim.evict() == [3]  # |T1| = 2 > p = 1: from T1
    assert sim.evict() == [1]  # |T1| = 1 = p: from T2 (1 is its LRU block), to B2
    assert sim.evict() == [2]  # T2 again
    assert arc_stats(sim) == {"p": 1.0, "t1": 1, "t2": 0, "b1": 1, "b2": 2}
    assert sim.run([1]) == 0  # a B2 ghost hit: p -= max(1, |B1| / |B2| = 0.5)
    assert arc_stats(sim)["p"] == 0.0
    sim.run([2])  # B2 hit again: p stays at 0 (its floor)
    assert arc_stats(sim) == {"p": 0.0, "t1": 1, "t2": 2, "b1": 1, "b2": 0}
    assert sim.evict() == [4]  # p = 0: T1 goes first
    assert sim.run([3]) == 0  # B1 ghost hit with |B2| / |B1| = 0 / 2: p += 1
    assert arc_stats(sim)["p"] == 1.0


def test_arc_b1_ghost_hit_grows_p_by_the_ghost_ratio() -> None:
    sim = Sim("arc", 4)
    sim.run([1], [1], [2], [2], [3], [3], [4])  # T2: 1 2 3; T1: 4
    assert sim.evict() == [4]  # |T1| = 1 > p = 0
    assert sim.evict(3) == [1, 2, 3]  # T1 empty: T2 in LRU order, to B2
    assert arc_stats(sim) == {"p": 0.0, "t1": 0, "t2": 0, "b1": 1, "b2": 3}
    sim.run([4])  # B1 hit: p += max(1, |B2| / |B1| = 3)
    assert arc_stats(sim)["p"] == 3.0
    sim.run([1])  # B2 hit: p -= max(1, |B1| / |B2| = 0 / 3)
    assert arc_stats(sim)["p"] == 2.0


class TextbookARC:
    """ARC(c) as Fig. 4 of FAST'03 writes it, for one-block requests (REPLACE's tie included: ``|T1| == p`` with
    the missed page in B2 evicts from T1)."""

    def __init__(self, c: int) -> None:
        self.c = c
        self.p = 0.0
        self.t1: dict[int, None] = {}  # insertion-ordered: LRU first
        self.t2: dict[int, None] = {}
        self.b1: dict[int, None] = {}
        self.b2: dict[int, None] = {}

    @staticmethod
    def _lru(d: dict[int, None]) -> int:
        x = next(iter(d))
        del d[x]
        return x

    def _replace(self, x: int) -> None:
        if self.t1 and (len(self.t1) > self.p or (x in self.b2 and len(self.t1) == self.p)):
            self.b1[self._lru(self.t1)] = None
        else:
            self.b2[self._lru(self.t2)] = None

    def access(self, x: int) -> bool:
        c = self.c
        if x in self.t1 or x in self.t2:  # Case I
            (self.t1 if x in self.t1 else self.t2).pop(x)
            self.t2[x] = None
            return True
        if x in self.b1:  # Case II: adapt, then REPLACE
            self.p = min(c, self.p + max(1.0, len(self.b2) / len(self.b1)))
            self._replace(x)
            del self.b1[x]
            self.t2[x] = None
            return False
        if x in self.b2:  # Case III
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
            self._replace(x)
            del self.b2[x]
            self.t2[x] = None
            return False
        if len(self.t1) + len(self.b1) == c:  # Case IV
            if len(self.t1) < c:
                self._lru(self.b1)
                self._replace(x)
            else:
                self._lru(self.t1)
        else:
            total = len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2)
            if total >= c:
                if total == 2 * c:
                    self._lru(self.b2)
                self._replace(x)
        self.t1[x] = None
        return False


def test_arc_adapts_p_on_a_ghost_hit_before_choosing_the_victim() -> None:
    """c = 2, accesses 2 0 0 1 2 0. At the 5th, 2 is in B1 (T1 = [1], T2 = [0], p = 0): Case II raises p to 1
    first, so REPLACE finds |T1| = 1 not > p and evicts T2's 0; the 6th access misses. Adapting p only when
    2 is registered (after the victim was chosen with p = 0) evicted 1 instead and hit the 6th."""
    trace = [2, 0, 0, 1, 2, 0]
    ref = TextbookARC(2)
    assert [ref.access(x) for x in trace] == [False, False, True, False, False, False]
    sim = Sim("arc", 2)
    assert [sim.run([x]) for x in trace] == [0, 0, 1, 0, 0, 0]
    assert arc_stats(sim)["p"] == ref.p  # 1 after the 5th access, back to 0 at the 6th (0 was in B2)
    assert replay(requests(singles(trace)), 2, "arc", block_tokens=1).hit_blocks == 1


@pytest.mark.parametrize("seed", range(4))
def test_arc_matches_textbook_arc_one_block_per_request(seed: int) -> None:
    rng = random.Random(seed)
    c = rng.choice([3, 5, 8])
    trace = [rng.randrange(4 * c) if rng.random() < 0.7 else rng.randrange(c) for _ in range(600)]
    ref = TextbookARC(c)
    want = [ref.access(x) for x in trace]
    sim = Sim("arc", c)
    got = [sim.run([x]) == 1 for x in trace]
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    assert first is None, f"c={c}: first difference at access {first}"
    assert arc_stats(sim)["p"] == ref.p
    assert replay(requests(singles(trace)), c, "arc", block_tokens=1).hit_blocks == sum(want)


TIE_SETUP = [0, 0, 1, 2, 3, 1, 2]
"""c = 3: T1 = [3], T2 = [1, 2] (LRU first), B1 = [], B2 = [0], p = 2 (two B1 hits), the pool full."""


def test_arc_tie_with_the_missed_page_in_b2_evicts_from_t1() -> None:
    """FAST'03's REPLACE evicts from T1 when ``|T1| > p`` or when ``|T1| == p`` and the missed page is in B2. After
    TIE_SETUP, 0 (in B2) comes back: Case III lowers p to 1 = |T1|, and the tie evicts T1's 3, not T2's 1 (which
    the next access then hits). Before the pops knew their page the tie went to T2: 1 was evicted and missed."""
    ref = TextbookARC(3)
    assert [ref.access(x) for x in TIE_SETUP] == [False, True, False, False, False, False, False]
    sim = Sim("arc", 3)
    assert sim.run(*singles(TIE_SETUP)) == 1
    assert sim.evicted == [1, 2, 0]
    assert arc_stats(sim) == {"p": 2.0, "t1": 1, "t2": 2, "b1": 0, "b2": 1}
    assert not ref.access(0) and sim.run([0]) == 0
    assert sim.evicted[-1] == 3  # T1's LRU block
    assert list(ref.b1) == [3]
    assert arc_stats(sim) == {"p": 1.0, "t1": 0, "t2": 3, "b1": 1, "b2": 0}
    assert ref.p == 1.0 and (len(ref.t1), len(ref.t2), len(ref.b2)) == (0, 3, 0)
    assert ref.access(1) and sim.run([1]) == 1
    assert replay(requests(singles([*TIE_SETUP, 0, 1])), 3, "arc", block_tokens=1).hit_blocks == 2


def test_arc_each_pop_of_a_request_knows_its_own_page() -> None:
    """A request of several missed blocks: its allocation takes the empty blocks first, then pops one victim per
    further block, in request order; the tie is decided by the page of that pop's own block. After TIE_SETUP (one
    more block, held unhashed by a decode and then freed: one empty block), [9, 5, 0] misses three blocks; 0 in
    B2 lowers p to 1 = |T1|. 9 takes the empty block; the pop for 5 (not in B2) evicts T2's 1, the pop for 0 (in
    B2) T1's 3. Reading the pages from the first missed block on (9 for the first pop, 5 for the second) gave
    T2's 1 and 2, as did the tie going to T2."""
    sim = Sim("arc", 4)
    pool = sim.pool
    held = pool.get_new_blocks(1)  # (a decode's block: in use, no hash)
    assert held is not None
    sim.run(*singles(TIE_SETUP))
    assert sim.evicted == [1, 2, 0]
    pool.free_blocks(held)  # empty again
    assert arc_stats(sim) == {"p": 2.0, "t1": 1, "t2": 2, "b1": 0, "b2": 1}
    sim.run([9, 5, 0])
    assert sim.evicted[3:] == [1, 3]
    s = arc_stats(sim)
    assert (s["p"], s["b1"], s["b2"]) == (1.0, 1, 1)  # B1: 3; B2: 1 (0 is resident again, in T2)


def test_arc_a_pop_without_a_known_page_keeps_the_tie_in_t2() -> None:
    """Only the first allocation after a lookup knows its pages: a later one (a decode block, a resume after
    preemption), also after an allocation that popped nothing or failed, decides the tie as for a page in no
    list (T2), as does a page that is no ghost."""
    for between in ("nothing", "an empty allocation", "a failed allocation"):
        sim = Sim("arc", 3)
        sim.run(*singles(TIE_SETUP))
        pool = sim.pool
        sim.policy.lookup([0], 0, 35)  # 0 in B2: p = 1 = |T1|
        if between == "an empty allocation":
            assert pool.get_new_blocks(0) == []
        elif between == "a failed allocation":
            assert pool.get_new_blocks(4) is None
        ids = pool.get_new_blocks(1)
        assert ids is not None
        assert sim.evicted[-1] == (3 if between == "nothing" else 1), between
        pool.free_blocks(ids)
    sim = Sim("arc", 3)
    sim.run(*singles(TIE_SETUP))
    sim.policy.lookup([7], 0, 35)  # 7 is no ghost: the tie goes to T2
    ids = sim.pool.get_new_blocks(1)
    assert ids is not None and sim.evicted[-1] == 1


class PageSpy(ARCPolicy):
    """``arc`` that records, for each victim, the page its pop made room for, and checks it against the hash the
    block is then registered under (a block an allocation takes empty forgets any earlier record)."""

    def __init__(self, num_blocks: int, config: PolicyConfig | None = None) -> None:
        super().__init__(num_blocks, config)
        self.page_of: dict[int, object] = {}
        self.empty_taken = 0
        self.pops = 0
        self.known = 0
        self.checked = 0

    def on_allocate(self, n: int, empty: int) -> None:
        super().on_allocate(n, empty)
        self.empty_taken = min(n, empty)

    def pop(self, now: float) -> int | None:
        pages = self._x_pages
        i = self._x_first + self._x_n - self._n
        page = pages[i] if pages is not None and i < len(pages) else None
        bid = super().pop(now)
        if bid is not None:
            self.pops += 1
            self.known += page is not None
            self.page_of[bid] = page
        return bid

    def on_cached(self, block_id: int, block_hash: BlockHash, depth: int, now: float) -> None:
        page = self.page_of.pop(block_id, None)
        if page is not None:
            assert page == block_hash, f"block {block_id}: popped for {page!r}, registered as {block_hash!r}"
            self.checked += 1
        super().on_cached(block_id, block_hash, depth, now)


def _spied(pool: BlockPool) -> PageSpy:
    spy = pool.policy
    assert isinstance(spy, PageSpy)
    get_new_blocks = pool.get_new_blocks

    def allocate(n: int) -> list[int] | None:
        out = get_new_blocks(n)
        for bid in out[: spy.empty_taken] if out else ():
            spy.page_of.pop(bid, None)
        return out

    pool.get_new_blocks = allocate  # type: ignore[method-assign]
    return spy


@pytest.mark.parametrize("seed", range(3))
def test_arc_pop_pages_are_the_blocks_they_allocate_in_replay(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In replay, the page each pop is told is the hash its victim block is registered under: chains over shared
    prefixes, some longer than the pool."""
    rng = random.Random(seed)
    c = 20
    blocks = [
        [d * 1000 + i for i in range(rng.randint(1, 8))] for d in (rng.randrange(12) for _ in range(300))
    ]
    blocks += [list(range(50_000, 50_000 + c + 3))]  # (longer than the pool: no allocation)
    spies: list[PageSpy] = []

    def make(name: str, n: int, cfg: PolicyConfig | None = None) -> PageSpy:
        spies.append(PageSpy(n, cfg))
        return spies[-1]

    def pool(n: int, policy: PageSpy, clock: object) -> BlockPool:
        p = BlockPool(n, policy, clock)  # type: ignore[arg-type]
        _spied(p)
        return p

    monkeypatch.setattr(replay_module, "make_policy", make)
    monkeypatch.setattr(replay_module, "BlockPool", pool)
    replay(requests(blocks), c, "arc", block_tokens=1, check_every=1)
    spy = spies[0]
    assert spy.pops > 100 and spy.known == spy.pops and spy.checked == spy.pops


@pytest.mark.parametrize("seed", range(3))
def test_arc_pop_pages_are_the_blocks_they_allocate_in_the_scheduler(seed: int) -> None:
    """The same through the scheduler and KVCacheManager: chunked prefill, decode blocks, partial blocks freed
    empty, preemption and its resumes. A pop whose block holds no page of the request's lookup (a decode block,
    a later chunk's block, a resume's) is told none."""
    rng = random.Random(seed)
    bs = 4
    spy = PageSpy(24)
    kv = KVCacheManager(24, block_size=bs, policy=spy)
    _spied(kv.pool)
    sched = Scheduler(kv, SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=4))
    docs = [[d * 10_000 + t for t in range(bs * 12)] for d in range(6)]
    for r in range(120):
        doc = docs[rng.randrange(len(docs))]
        prompt = [*doc[: rng.randint(1, 10) * bs + rng.randrange(bs)], 1_000_000 + r]
        sched.add_request(Request(f"r{r}", prompt, rng.randint(1, 9), arrival_time=float(r)))
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        sampled = tuple(c.request_id for c in out.chunks if c.samples)
        sched.update_from_output(out, RunnerOutput(sampled, tuple(7 for _ in sampled)))
        kv.check_integrity()
        steps += 1
        assert steps < 10_000
    assert spy.pops > 100 and 0 < spy.known < spy.pops and spy.checked > 50


def test_arc_scan_does_not_flush_the_working_set_but_lru_does() -> None:
    reqs = requests(scan_workload(working_set=5, rounds=2, scan=40))
    tail = 5
    before = {p: replay(reqs[:-tail], 20, p).hit_blocks for p in ("arc", "lru")}
    after = {p: replay(reqs, 20, p, check_every=1).hit_blocks for p in ("arc", "lru")}
    assert after["arc"] - before["arc"] == 5  # used twice: in T2, which the scan (all in T1) leaves alone
    assert after["lru"] - before["lru"] == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_arc_directory_invariants_under_random_traffic(seed: int) -> None:
    rng = random.Random(seed)
    c = 12
    sim = Sim("arc", c)
    for _ in range(400):
        # chains of up to 4 blocks over 40 contents: prefixes shared, ghosts hit often
        start = rng.randrange(40)
        sim.run([start * 100 + i for i in range(rng.randint(1, 4))])
        s = arc_stats(sim)
        assert s["t1"] + s["t2"] == len(sim.pool.cached) <= c
        assert s["t1"] + s["b1"] <= c
        assert s["t1"] + s["t2"] + s["b1"] + s["b2"] <= 2 * c
        assert 0.0 <= s["p"] <= c
    assert arc_stats(sim)["b1"] + arc_stats(sim)["b2"] > 0


def test_s3fifo_counts_under_random_traffic() -> None:
    rng = random.Random(3)
    sim = Sim("s3fifo", 20)
    pol = sim.policy
    assert isinstance(pol, S3FIFOPolicy)
    for _ in range(400):
        start = rng.randrange(60)
        sim.run([start * 100 + i for i in range(rng.randint(1, 4))])
        s = pol.stats()
        assert s["small"] + s["main"] == len(sim.pool.cached)
        assert s["ghost"] <= pol.ghost_capacity


# ---------------------------------------------------------------- copies (content computed twice)


def _copy(sim: Sim, hashes: Sequence[int]) -> list[int]:
    """A second request computes ``hashes`` again without a lookup (both were scheduled together): the pool
    registers the blocks as copies of the cached ones (vLLM's duplicates); released at once."""
    pool = sim.pool
    ids = pool.get_new_blocks(len(hashes))
    assert ids is not None
    pool.cache_blocks(ids, hashes, 0, len(hashes))
    pool.free_blocks(ids)
    pool.check_integrity()
    return ids


def test_s3fifo_a_copy_evicted_while_its_content_stays_leaves_no_ghost() -> None:
    # The ghost remembers content that left the cache. A copy evicted from the small queue while block 0 still
    # holds the same content (promoted to main) left its hash in the ghost, so when the content itself left main
    # (no ghost entry: main's victims are forgotten) and came back, it was taken for a ghost hit and entered main
    sim = Sim("s3fifo", 10)  # small queue: 1 block
    sim.run([1])
    assert _copy(sim, [1]) == [1] and sim.pool.copies == {1: [1]}
    sim.run([1], *singles(range(2, 10)))  # a hit on block 0 (the indexed copy), then the pool is full
    assert sim.evict() == [1]  # block 0 (accessed) moves to main; the copy (never accessed) goes
    assert sim.pool.cached[1] == 0  # the content is still cached
    assert sim.policy.stats() == {"small": 8, "main": 1, "ghost": 0}
    assert sim.evict_all() == [2, 3, 4, 5, 6, 7, 8, 9, 1]  # the small queue, then main: 1 leaves for good
    assert sim.policy.stats()["ghost"] == 8  # 2..9 from the small queue; nothing from main
    assert sim.run([1]) == 0
    assert sim.policy.stats() == {"small": 1, "main": 0, "ghost": 8}  # a new insertion, not a ghost hit


def test_s3fifo_content_leaves_the_cache_with_its_last_copy() -> None:
    sim = Sim("s3fifo", 10)
    sim.run([1])
    _copy(sim, [1])
    sim.run(*singles(range(2, 10)))
    # both copies are one-hit wonders of the small queue: the first one evicted leaves a copy behind (no ghost
    # entry), the second takes the content with it (a ghost entry)
    assert sim.evict() == [1] and sim.policy.stats()["ghost"] == 0
    assert sim.evict() == [1] and sim.policy.stats()["ghost"] == 1
    assert 1 not in sim.pool.cached
    assert sim.run([1]) == 0
    assert sim.policy.stats()["main"] == 1  # the content's ghost hit


def test_arc_a_copy_evicted_while_its_content_stays_leaves_no_ghost() -> None:
    # A copy evicted from T1 while block 0 holds the same content in T2 put the hash in B1; when the content
    # left T2 it went to B2 too: one hash in both ghost lists, and its return adapted p as a B1 hit (T1 too
    # small) where ARC's history says B2 (it was last evicted from T2)
    sim = Sim("arc", 10)
    sim.run([1])
    _copy(sim, [1])
    sim.run([1], *singles(range(2, 10)))  # block 0 used twice: T2; the copy and 2..9 in T1
    assert sim.evict() == [1]  # |T1| > p = 0: T1's LRU block, the copy
    assert arc_stats(sim) == {"p": 0.0, "t1": 8, "t2": 1, "b1": 0, "b2": 0}
    sim.evict_all()
    s = arc_stats(sim)
    assert (s["b1"], s["b2"]) == (8, 1)  # 2..9 from T1, 1 from T2: each hash in one list
    assert sim.run([1]) == 0
    assert arc_stats(sim)["p"] == 0.0  # a B2 hit lowers p (floored at 0); a B1 hit would have raised it


def test_arc_content_leaves_the_cache_with_its_last_copy() -> None:
    sim = Sim("arc", 10)
    sim.run([1])
    _copy(sim, [1])
    sim.run(*singles(range(2, 10)))
    assert sim.evict() == [1] and arc_stats(sim)["b1"] == 0
    assert sim.evict() == [1] and arc_stats(sim)["b1"] == 1
    assert sim.run([1]) == 0
    assert arc_stats(sim)["p"] == 1.0  # a B1 hit: p += max(1, |B2| / |B1|)


@pytest.mark.parametrize("policy", ["s3fifo", "arc"])
def test_a_prefix_cache_reset_leaves_no_ghost_entry(policy: str) -> None:
    # A reset drops every hash: nothing was evicted (``on_evicted``: "dropped other than by pop: no ghost entry";
    # the vLLM plugin starts a fresh policy at a reset). The pool emptied the order with ``pop``, each victim's hash
    # went to a ghost list, and the content's return after the reset was taken for ghost hits: s3fifo put it
    # straight into main, arc raised p by one per block
    sim = Sim(policy, 10)
    sim.run([1, 2, 3])
    assert sim.pool.reset_prefix_cache()
    sim.pool.check_integrity()
    assert sim.policy.stats() == (
        {"small": 0, "main": 0, "ghost": 0}
        if policy == "s3fifo"
        else {"p": 0.0, "t1": 0, "t2": 0, "b1": 0, "b2": 0}
    )
    sim.run([1, 2, 3])
    assert sim.policy.stats() == (
        {"small": 3, "main": 0, "ghost": 0}
        if policy == "s3fifo"
        else {"p": 0.0, "t1": 3, "t2": 0, "b1": 0, "b2": 0}
    )
