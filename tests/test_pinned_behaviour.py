"""Behaviour no test pinned down before a mutation pass (session 33: single mutations of the pool, the rules,
retention, stats, replay, `priority` and `belady`, each run against the tests that exercise its module; these
tests kill the mutants that survived, each by the rule its docstring or the README states)."""

from __future__ import annotations

import math

import pytest

from kvretain.core import BlockRetention, PolicyConfig
from kvretain.core.policies import rules
from kvretain.core.policy import INF
from kvretain.core.retention import RetentionConfig
from kvretain.core.stats import ClassStats, merge_class_stats
from kvretain.replay import ReplayRequest, replay
from test_block_pool import new_pool, run, snapshot, start
from test_policies import Sim


# ------------------------------------------------------------- block_pool
@pytest.mark.parametrize("policy", ["lru", "lfu", "unified"])
def test_unhashed_block_held_twice_is_not_freed_by_one_release(policy):
    pool = new_pool(policy, 4)
    (x,) = pool.get_new_blocks(1)
    pool.touch([x])  # a second holder of a partial (unhashed) block
    pool.free_blocks([x])
    pool.check_integrity()
    assert pool.ref_count(x) == 1 and pool.get_num_free_blocks() == 3
    assert x not in pool.get_new_blocks(3)  # never handed out while held


@pytest.mark.parametrize("policy", ["lru", "lfu", "unified"])
def test_refused_free_after_a_shared_unhashed_block_changes_nothing(policy):
    pool = new_pool(policy, 4)
    (x,) = pool.get_new_blocks(1)
    pool.touch([x])
    before = snapshot(pool)
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([3, x])  # block 3 is empty: refused after x was (provisionally) released
    assert snapshot(pool) == before
    pool.check_integrity()


def test_lfu_counts_a_use_for_a_release_that_leaves_the_block_in_use():
    sim = Sim("lfu", 2, PolicyConfig())
    pool = sim.pool
    a = sim.start([1])
    b = sim.start([1])  # two concurrent holders of block 1
    pool.free_blocks(a)  # uniform release; block still held: nothing becomes evictable, but it is a use
    pool.free_blocks(b)
    pool.free_blocks(sim.start([2]))  # one use, released after
    assert sim.evict(1) == [2]  # 2 uses beat 1 use (LFU: frequency, then recency)


def test_batch_observer_hears_only_the_victims():
    pool = new_pool("lru", 3)
    run(pool, [1])
    run(pool, [2])
    seen = []
    pool.on_evict_batch = lambda ids, hashes: seen.append((list(ids), list(hashes)))
    got = pool.get_new_blocks(2)  # one empty block, one eviction
    assert got is not None and len(seen) == 1
    ids, hashes = seen[0]
    assert len(ids) == len(hashes) == 1 and hashes == [1]


def test_batch_observer_on_a_short_allocation_hears_only_the_victims():
    pool = new_pool("lfu", 4)
    ab = start(pool, [1, 2])
    c = run(pool, [3])
    pool.free_blocks([ab[0]])  # a free block behind its in-use child
    seen = []
    pool.on_evict_batch = lambda ids, hashes: seen.append((list(ids), list(hashes)))
    assert pool.get_new_blocks(3) is None
    assert seen == [(c, [3])]


def test_a_free_parent_leaves_the_order_when_a_child_is_registered():
    pool = new_pool("lfu", 4)
    ids = pool.get_new_blocks(2)
    pool.cache_blocks(ids, [1, 2], 0, 1)
    pool.free_blocks([ids[0]])  # sliding window: the head goes, the tail is kept
    pool.cache_blocks(ids, [1, 2], 1, 2)  # the tail becomes full
    pool.check_integrity()
    assert not pool.evictable[ids[0]]


@pytest.mark.parametrize("policy", ["priority", "unified"])
def test_blocks_beyond_a_short_plan_take_the_mapped_priority(policy):
    sim = Sim(policy, 4, PolicyConfig(isolation_goal=None))
    ids = sim.start([1, 2])
    sim.pool.free_blocks(ids, BlockRetention([90], [None], None, 1, 25))
    sim.pool.check_integrity()
    assert sim.retention(1) == 90 and sim.retention(2) == 25


def test_scope_of_a_uniform_release_owns_the_level_it_raises():
    sim = Sim("unified", 4, PolicyConfig(isolation_goal=None))
    sim.run([1], base=25)  # priority 1: level 25
    ids = sim.start([1])
    sim.pool.free_blocks(ids, BlockRetention([], [], "s", -1, 45))  # uniform release: raises to 45, owner s
    sim.run([1], prio=10, scope="s", base=35)  # the owner lowers it
    assert sim.retention(1) == 10


# ------------------------------------------------------------- rules
def test_a_non_owners_equal_ask_does_not_shorten_the_owners_hold():
    state = rules.release(rules.UNSET, rules.UNSET, INF, None, 80, None, "alice", 0.0, 35)
    assert state == (80, 35, INF, "alice")
    assert rules.release(*state, 80, 5.0, "bob", 1.0, 35) == state


def test_a_release_at_the_expiry_sees_the_lapsed_level():
    state = rules.release(rules.UNSET, rules.UNSET, INF, None, 80, 10.0, "alice", 0.0, 35)
    assert state == (80, 35, 10.0, "alice")
    assert rules.effective(*state[:3], 10.0) == 35
    assert rules.release(*state, 50, None, "bob", 10.0, 35) == (50, 35, INF, "bob")


def test_cost_term_keeps_deep_blocks_longer():
    cfg = PolicyConfig(isolation_goal=None, adapt_frequency=False, cost_scale_tokens=16.0, block_size=16)
    assert rules.cost_per_block(cfg) == 1.0
    assert rules.value(1.0, 1.0, 3, 1.0) == 4.0 and rules.gd_key(10.0, 1.0, 1.0, 3, 1.0) == 14.0
    sim = Sim("unified", 5, cfg)
    sim.run([1, 2, 3, 4])  # leaf at depth 3 released first
    sim.run([9])  # depth 0, released later
    assert sim.evict(1) == [9]  # cheaper to recompute goes first


def test_threshold_is_inclusive():
    assert rules.protected(35, 35) and not rules.protected(34, 35)


# ------------------------------------------------------------- replay
def _req(ids, t, prio=0, retention=None, input_length=0):
    return ReplayRequest(tuple(ids), t, input_length, prio, retention)


def test_replay_advances_the_clock_so_durations_lapse():
    def hits(duration_s):
        fields = {"start": 0, "end": None, "priority": 90, "duration_s": duration_s}
        ret = RetentionConfig.from_request_fields([fields])
        reqs = [_req([101], 0.0, retention=ret), _req([102], 10.0), _req([103], 20.0), _req([101], 30.0)]
        return replay(reqs, 2, "priority", block_tokens=512, record_hits=True).request_hits

    assert hits(1) == [0, 0, 0, 0]  # 101 lapsed to 35 at t=1, was oldest at 35: evicted at t=20
    assert hits(100) == [0, 0, 0, 1]  # (not lapsed by t=30: kept at 90 over 102, and hit)


def test_replay_passes_the_scope_so_the_owner_may_lower():
    keep = RetentionConfig.from_request_fields([{"start": 0, "end": None, "priority": 90}], scope="s")
    drop = RetentionConfig.from_request_fields([{"start": 0, "end": None, "priority": 10}], scope="s")
    reqs = [
        _req([101], 0.0, retention=keep),
        _req([101], 1.0, retention=drop),
        _req([102], 2.0),
        _req([103], 3.0),
        _req([101], 4.0),
    ]
    res = replay(
        reqs, 2, "unified", config=PolicyConfig(isolation_goal=None, block_size=512), record_hits=True
    )
    assert res.request_hits[-1] == 0  # lowered to 10 by its owner: evicted before 102
    # the same lowering from another scope may not lower it: 101 stays at 90 and is hit
    reqs[1] = _req([101], 1.0, retention=RetentionConfig.from_request_fields([{"priority": 10}], scope="t"))
    other = replay(
        reqs, 2, "unified", config=PolicyConfig(isolation_goal=None, block_size=512), record_hits=True
    )
    assert other.request_hits[-1] == 1


def test_a_directive_past_the_prompt_covers_no_block():
    # 600-token prompt in 2 blocks of 512: [700, end) holds no prompt token, so block 1 keeps the mapping
    ret = RetentionConfig.from_request_fields([{"start": 700, "end": None, "priority": 90}])
    reqs = [
        _req([1, 2], 0.0, retention=ret, input_length=600),
        _req([3], 1.0),
        _req([4, 5], 2.0),
        _req([1, 2], 3.0),
    ]
    a = replay(reqs, 3, "priority", block_tokens=512, record_hits=True)
    assert a.request_hits[-1] == 0
    # the same directive from 512 (inside the prompt) covers block 1: the prompt comes back with a hit
    inside = RetentionConfig.from_request_fields([{"start": 512, "end": None, "priority": 90}])
    reqs[0] = _req([1, 2], 0.0, retention=inside, input_length=600)
    assert replay(reqs, 3, "priority", block_tokens=512, record_hits=True).request_hits[-1] == 1


def test_replay_default_config_uses_the_trace_block_size():
    from kvretain.replay import synthetic_conversations

    reqs = synthetic_conversations(60, seed=1)
    a = replay(reqs, 40, "unified")
    b = replay(reqs, 40, "unified", config=PolicyConfig(block_size=512))
    assert a.to_json() == b.to_json() and a.policy_stats == b.policy_stats


def test_block_tokens_zero_is_refused():
    with pytest.raises(ValueError, match="block-tokens"):
        replay([], 4, block_tokens=0)


# ------------------------------------------------------------- stats
def test_merge_sums_and_leaves_inputs_alone():
    a = {0: ClassStats(requests=2, query_tokens=10, hit_tokens=4)}
    b = {0: ClassStats(requests=3, query_tokens=20, hit_tokens=6), 1: ClassStats(requests=1)}
    m = merge_class_stats([a, b])
    assert (m[0].requests, m[0].query_tokens, m[0].hit_tokens, m[1].requests) == (5, 30, 10, 1)
    assert a[0].requests == 2 and b[1].requests == 1
    assert merge_class_stats([a, b])[0].requests == 5


def test_rates():
    s = ClassStats()
    assert s.hit_rate == 0.0 and s.resume_hit_rate == 0.0
    # JSON: no lookup (or no resume) is no ratio, null; `kvretain replay --json` read resume_hit_rate 0.0
    # on a run without a single resume (review 34)
    assert (s.to_json()["hit_rate"], s.to_json()["resume_hit_rate"]) == (None, None)
    s.record_lookup(300, 100, False)
    assert s.to_json()["resume_hit_rate"] is None and s.to_json()["hit_rate"] == 0.333333
    s = ClassStats()
    s.record_lookup(100, 40, True)
    s.record_lookup(300, 100, False)
    assert s.resume_hit_rate == 0.4 and s.hit_rate == pytest.approx(1 / 3)
    j = s.to_json()
    assert j["resume_hit_rate"] == 0.4 and j["hit_rate"] == 0.333333


def test_lookups_that_hit_nothing_read_a_zero_rate_not_null():
    # null means no lookup (or no resume); lookups that missed everything are a ratio of 0
    s = ClassStats()
    s.record_lookup(100, 0, True)
    s.record_lookup(300, 0, False)
    j = s.to_json()
    assert (j["hit_rate"], j["resume_hit_rate"]) == (0.0, 0.0)


# ------------------------------------------------------------- priority / belady
def test_strict_levels_hold_after_many_releases():
    n = 1200
    sim = Sim("priority", n + 1)
    sim.run([0], base=35)
    for h in range(1, n + 1):
        sim.run([h], base=25)
    assert sim.evict(n)[-1] == n and 0 in sim.pool.cached  # every 25 goes before the older 35


def test_far_next_uses_still_order():
    next_use = {1: 5000.0, 2: 2000.0, 3: math.inf}
    sim = Sim("belady", 3, PolicyConfig(next_use=lambda h: next_use[int(h)]))
    for h in (2, 1, 3):
        sim.run([h])
    assert sim.evict_all() == [3, 1, 2]


def test_deepest_first_among_ties_beyond_depth_15():
    sim = Sim("belady", 50, PolicyConfig(next_use=lambda h: 7.0))
    sim.run(list(range(200, 220)))  # leaf at depth 19
    sim.run(list(range(100, 130)))  # leaf at depth 29, released later
    assert sim.evict(1) == [129]


def test_an_owners_equal_ask_with_an_earlier_end_keeps_the_later_one() -> None:
    # rule 4: an equal ask refreshes only a later end (before: killed only by the vLLM-environment tests)
    state = rules.release(rules.UNSET, rules.UNSET, INF, None, 80, 20.0, "alice", 0.0, 35)
    assert rules.release(*state, 80, 5.0, "alice", 1.0, 35) == (80, 35, 20.0, "alice")


def test_a_level_at_its_users_mapped_priority_has_nothing_to_lapse_from() -> None:
    assert rules.release(rules.UNSET, rules.UNSET, INF, None, 35, 5.0, None, 0.0, 35) == (35, 35, INF, None)
    state = rules.release(rules.UNSET, rules.UNSET, INF, None, 80, 5.0, None, 0.0, 35)
    assert rules.release(*state, 80, None, None, 1.0, 80) == (80, 80, INF, None)
