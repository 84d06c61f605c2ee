"""Exact eviction orders of every policy on tiny pools, their retention semantics and configuration errors.

Hashes are plain ints (one per block). ``Sim`` drives a ``BlockPool`` with a manual clock and checks the
pool's integrity after every step.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest

from _switching import SWITCH_AT, SwitchingController
from kvretain.core import BlockPool, BlockRetention, PolicyConfig, make_policy, policy_names
from kvretain.core.policies import UnifiedPolicy, rules
from kvretain.core.policy import INF
from kvretain.core.retention import DEFAULT_RETENTION_PRIORITY


class Sim:
    def __init__(self, policy: str, n: int, config: PolicyConfig | None = None) -> None:
        self.now = 0.0
        self.pool = BlockPool(n, make_policy(policy, n, config), clock=lambda: self.now)
        self.policy = self.pool.policy

    def start(self, hashes: Sequence[int]) -> list[int]:
        pool = self.pool
        k = 0
        while k < len(hashes) and hashes[k] in pool.cached:
            k += 1
        hits = [pool.cached[h] for h in hashes[:k]]
        pool.touch(hits)
        new = pool.get_new_blocks(len(hashes) - k)
        assert new is not None
        ids = hits + new
        pool.cache_blocks(ids, hashes, k, len(hashes))
        pool.check_integrity()
        return ids

    def finish(
        self,
        ids: Sequence[int],
        prio: int | Sequence[int] | None = None,
        dur: float | Sequence[float | None] | None = None,
        scope: str | None = None,
        base: int = DEFAULT_RETENTION_PRIORITY,
    ) -> None:
        n = len(ids)
        prios = [base if prio is None else prio] * n if not isinstance(prio, Sequence) else list(prio)
        durs = list(dur) if isinstance(dur, Sequence) else [dur] * n
        self.pool.free_blocks(ids, BlockRetention(prios, durs, scope, 0, base))
        self.pool.check_integrity()

    def run(self, hashes: Sequence[int], *args: object, **kwargs: object) -> list[int]:
        ids = self.start(hashes)
        self.finish(ids, *args, **kwargs)  # type: ignore[arg-type]
        return ids

    def evict(self, n: int) -> list[int]:
        """Allocate ``n`` blocks; return the hashes evicted to get them, in order."""
        out: list[int] = []
        self.pool.on_evict = lambda bid, h: out.append(int(h))
        assert self.pool.get_new_blocks(n) is not None
        self.pool.on_evict = None
        self.pool.check_integrity()
        return out

    def evict_all(self) -> list[int]:
        out: list[int] = []
        while self.pool.get_num_free_blocks():
            out += self.evict(1)
        return out

    def retention(self, h: int) -> int:
        return self.policy.retention_of(self.pool.cached[h], self.now)


# ---------------------------------------------------------------- registry and configuration


def test_registry_names_and_unknown_policy() -> None:
    assert policy_names() == ["arc", "belady", "lfu", "lru", "priority", "s3fifo", "unified"]
    with pytest.raises(
        ValueError, match=r"unknown eviction policy 'lirs'; choose one of: arc, belady, lfu, lru, priority"
    ):
        make_policy("lirs", 4)


def test_policy_flags() -> None:
    lru = make_policy("lru", 4)
    assert (lru.name, lru.leaf_only, lru.tracks_uses) == ("lru", False, False)
    for name in ("lfu", "priority", "unified"):
        p = make_policy(name, 4)
        assert p.name == name and p.leaf_only and p.tracks_uses
    assert lru.retention_of(0, 0.0) == DEFAULT_RETENTION_PRIORITY
    assert lru.stats() == {}


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"budget": -0.1}, r"budget must be a finite number in \[0, 1\] \(a share of the pool\), got -0\.1"),
        ({"budget": 1.5}, r"budget must be a finite number in \[0, 1\] \(a share of the pool\), got 1\.5"),
        (
            {"isolation_goal": -0.1},
            r"isolation_goal must be a finite number in \[0, 1\] .* 0 or None: a fixed budget\), got -0\.1",
        ),
        ({"isolation_goal": 1.01}, r"isolation_goal must be a finite number in \[0, 1\]"),
        (
            {"frequency_cap": 0},
            r"frequency_cap must be an integer in \[1, 65536\] \(a count of uses; MAX_FREQUENCY_CAP\), got 0",
        ),
        ({"cost_scale_tokens": -1.0}, r"cost_scale_tokens must be a finite number >= 1 .* got -1\.0"),
        ({"ghost_factor": -1.0}, r"ghost_factor must be a finite number in \[0, 1000\] .* got -1\.0"),
    ],
)
def test_policy_config_validation(kwargs: dict[str, float], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        PolicyConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["false", "0", 0, 1, None, float("nan"), 0.5])
def test_adapt_frequency_must_be_a_bool(value: object) -> None:
    """A switch given as anything but a bool is refused: ``"false"`` (a config file's or an environment's
    string) is truthy and silently turned the balance on."""
    with pytest.raises(ValueError, match=r"adapt_frequency must be True or False, got "):
        PolicyConfig(adapt_frequency=value)  # type: ignore[arg-type]
    assert PolicyConfig(adapt_frequency=False).adapt_frequency is False


def test_cost_scale_tokens_refuses_both_bools() -> None:
    """``True`` was refused as a number of tokens but ``False`` passed as the "off" value 0 (``False == 0``)."""
    for value in (True, False):
        with pytest.raises(
            ValueError, match=r"cost_scale_tokens must be a finite number >= 1 .* got (True|False)"
        ):
            PolicyConfig(cost_scale_tokens=value)
    assert PolicyConfig(cost_scale_tokens=0).cost_scale_tokens == 0


def test_policy_config_edges_are_valid() -> None:
    low = PolicyConfig(budget=0.0, isolation_goal=None, frequency_cap=1, ghost_factor=0.0)
    assert (low.budget, low.isolation_goal, low.frequency_cap, low.ghost_factor) == (0.0, None, 1, 0.0)
    high = PolicyConfig(budget=1.0, isolation_goal=1.0)
    assert (high.budget, high.isolation_goal) == (1.0, 1.0)  # (a goal of 1 is kept: only 0 means "no goal")


@pytest.mark.parametrize("goal", [0, 0.0, None])
def test_isolation_goal_zero_is_the_fixed_share(goal: float | None) -> None:
    """0 is the command line's spelling of "no goal" (``--isolation-goal 0``), and the plugin's
    (``isolation_goal=0``): the config stores it as None, so every form reads one value for the fixed share."""
    cfg = PolicyConfig(isolation_goal=goal)
    assert cfg.isolation_goal is None
    assert cfg == PolicyConfig(isolation_goal=None)


# ---------------------------------------------------------------- lru (through the policy interface)


def test_lru_order_by_release() -> None:
    sim = Sim("lru", 4)
    sim.run([1, 2])
    sim.run([3])
    sim.run([4])
    sim.run([3])  # hit: released again, to the tail
    assert sim.evict_all() == [2, 1, 4, 3]


# ---------------------------------------------------------------- lfu


def test_lfu_frequency_then_recency() -> None:
    sim = Sim("lfu", 4)
    for _ in range(3):
        sim.run([1])
    sim.run([2])
    sim.run([3])
    sim.run([3])
    sim.run([4])
    # uses: 1 -> 3, 2 -> 1, 3 -> 2, 4 -> 1; among one-use blocks the older release goes first
    assert sim.evict_all() == [2, 4, 3, 1]


def test_lfu_frequency_cap() -> None:
    sim = Sim("lfu", 3, PolicyConfig(frequency_cap=2))
    for _ in range(5):
        sim.run([1])
    sim.run([2])
    sim.run([2])
    sim.run([3])
    # 1 has 5 uses but counts 2, like 2, and was released earlier
    assert sim.evict_all() == [3, 1, 2]


def test_lfu_ghost_history_restores_use_count() -> None:
    sim = Sim("lfu", 2)
    for _ in range(3):
        sim.run([1])
    sim.run([2])
    assert sim.evict(2) == [2, 1]  # the pool is now all in use, both hashes remembered
    sim.pool.free_blocks(list(range(2)))  # unhashed blocks: back to the empty stack
    sim.run([1])  # comes back with 3 + 1 uses
    sim.run([5])
    assert sim.evict_all() == [5, 1]


def test_lfu_without_ghost_forgets() -> None:
    sim = Sim("lfu", 2, PolicyConfig(ghost_factor=0.0))
    for _ in range(3):
        sim.run([1])
    sim.run([2])
    assert sim.evict(2) == [2, 1]
    sim.pool.free_blocks([0, 1])
    sim.run([1])
    sim.run([5])
    assert sim.evict_all() == [1, 5]


def test_lfu_a_parent_that_becomes_a_leaf_keeps_its_uses() -> None:
    sim = Sim("lfu", 3)
    sim.run([1, 2])
    sim.run([1])  # the head has 2 uses, the tail 1
    sim.run([7])
    sim.run([7])
    sim.run([7])
    assert sim.evict_all() == [2, 1, 7]


# ---------------------------------------------------------------- priority (strict, TensorRT-LLM-like)


def test_priority_lowest_level_first_lru_within() -> None:
    sim = Sim("priority", 6)
    for h, prio in [(1, 80), (2, 10), (3, 35), (4, 10), (5, 80), (6, 35)]:
        sim.run([h], prio)
    assert sim.evict_all() == [2, 4, 3, 6, 1, 5]


def test_priority_per_block_plan() -> None:
    sim = Sim("priority", 4)
    sim.run([1, 2], [90, 90])
    sim.run([3, 4], [90, 10])  # tail may go: it goes before everything, its head stays at 90
    assert sim.evict_all() == [4, 2, 1, 3]


def test_priority_without_retention_uses_the_default() -> None:
    sim = Sim("priority", 3)
    ids = sim.start([1])
    sim.pool.free_blocks(ids)  # no BlockRetention: released at 35
    sim.run([2], 30)
    sim.run([3], 40)
    assert sim.retention(1) == 35
    assert sim.evict_all() == [2, 1, 3]


def _priority_with_duration() -> Sim:
    sim = Sim("priority", 3)
    sim.now = 0.0
    sim.run([1], 80, 10.0)
    sim.now = 1.0
    sim.run([2], 50)
    sim.now = 2.0
    sim.run([3], 40)
    return sim


def test_priority_duration_holds_before_its_end() -> None:
    sim = _priority_with_duration()
    sim.now = 9.999
    assert sim.retention(1) == 80
    assert sim.evict_all() == [3, 2, 1]


def test_priority_duration_lapses_to_35_at_its_end() -> None:
    sim = _priority_with_duration()
    sim.now = 10.0
    assert sim.retention(1) == 35
    assert sim.evict_all() == [1, 3, 2]


def test_priority_lapsed_block_orders_by_release_within_35() -> None:
    sim = Sim("priority", 3)
    sim.run([1], 35)  # released first at 35
    sim.run([2], 90, 5.0)  # released second, lapses to 35
    sim.run([3], 35)
    sim.now = 6.0
    assert sim.evict_all() == [1, 2, 3]


def test_priority_low_priority_with_duration_lapses_up_to_35() -> None:
    sim = Sim("priority", 2)
    sim.run([1], 10, 5.0)
    sim.run([2], 20)
    assert sim.evict(1) == [1]
    sim2 = Sim("priority", 2)
    sim2.run([1], 10, 5.0)
    sim2.run([2], 20)
    sim2.now = 5.0
    assert sim2.evict_all() == [2, 1]


def test_priority_duration_lapses_to_the_requests_mapped_priority() -> None:
    # a priority -3 request (maps to 65) asks 90 for 1 s over block 1: it used to lapse to 35, below the
    # request's undirected block 2 and below a priority 0 request's block 3 (35, released later)
    sim = Sim("priority", 3)
    sim.run([1], 90, 1.0, base=65)
    sim.run([2], 65, base=65)
    sim.run([3], 35)
    sim.now = 2.0
    assert (sim.retention(1), sim.retention(2)) == (65, 65)
    assert sim.evict_all() == [3, 1, 2]


def test_priority_duration_restarts_on_reuse() -> None:
    sim = Sim("priority", 2)
    sim.run([1], 80, 10.0)
    sim.now = 8.0
    sim.run([1], 80, 10.0)  # expiry now 18
    sim.run([2], 50)
    sim.now = 12.0
    assert sim.retention(1) == 80
    assert sim.evict_all() == [2, 1]


def test_priority_last_writer_wins_on_shared_blocks() -> None:
    sim = Sim("priority", 3)
    a = sim.start([1])
    b = sim.start([1])
    assert a == b
    sim.finish(b, 90)
    sim.finish(a, 10)  # the last release overwrites the higher priority
    sim.run([2], 50)
    sim.run([3], 20)
    assert sim.retention(1) == 10
    assert sim.evict_all() == [1, 3, 2]


def test_priority_last_writer_can_raise() -> None:
    sim = Sim("priority", 2)
    a = sim.start([1])
    b = sim.start([1])
    sim.finish(a, 10)
    sim.finish(b, 90)
    sim.run([2], 50)
    assert sim.evict_all() == [2, 1]


# ---------------------------------------------------------------- unified

FIXED = {"isolation_goal": None, "adapt_frequency": False}  # exact orders at the configured exponent


def unified(n: int, budget: float, **kw: object) -> Sim:
    return Sim("unified", n, PolicyConfig(budget=budget, **{**FIXED, **kw}))  # type: ignore[arg-type]


def test_unified_protected_tier_survives_unprotected_traffic_under_budget() -> None:
    sim = unified(10, 0.5)  # target 5 protected blocks
    sim.run([1, 2, 3], 80)
    evicted: list[int] = []
    for h in range(100, 112):
        sim.pool.on_evict = lambda bid, hh: evicted.append(int(hh))
        sim.run([h], 25, base=25)
    assert {1, 2, 3} <= set(sim.pool.cached)
    assert evicted == [100, 101, 102, 103, 104]  # FIFO among equal-value unprotected blocks
    assert sim.policy.stats()["protected_blocks"] == 3.0
    assert sim.policy.stats()["protected_budget"] == 5.0
    assert sim.policy.stats()["protected_target"] == 5.0
    # the same traffic under lru loses the prefix
    lru = Sim("lru", 10)
    lru.run([1, 2, 3])
    for h in range(100, 112):
        lru.run([h])
    assert not {1, 2, 3} & set(lru.pool.cached)


def _two_tiers(budget: float) -> Sim:
    sim = unified(2, budget)
    sim.run([1], 35)  # protected (threshold 35): value 1 x 1 use
    for _ in range(4):
        sim.run([2], 25, base=25)  # unprotected: value 0.5 x 4 uses = 2
    return sim


def test_unified_budget_zero_tiers_compete_on_the_key() -> None:
    assert _two_tiers(0.0).evict_all() == [1, 2]


def test_unified_within_budget_unprotected_goes_first() -> None:
    assert _two_tiers(1.0).evict_all() == [2, 1]


def test_unified_over_budget_competes_until_back_under() -> None:
    sim = unified(4, 0.5)  # target 2
    sim.run([1], 35)
    sim.run([2], 35)
    sim.run([3], 35)
    for _ in range(4):
        sim.run([4], 25, base=25)
    assert sim.policy.stats()["protected_blocks"] == 3.0
    # 3 protected > 2: the lowest key overall (block 1, key 1 < 2) goes; then 2 protected: unprotected first
    assert sim.evict_all() == [1, 4, 2, 3]
    assert sim.policy.stats()["protected_blocks"] == 0.0


def test_unified_highest_wins_and_only_the_owner_may_lower() -> None:
    sim = unified(4, 1.0)
    sim.run([1], 80, scope="a")
    assert sim.retention(1) == 80
    sim.run([1], 20, scope="b")  # another scope cannot lower
    assert sim.retention(1) == 80
    sim.run([1], 20)  # nor can an unscoped request
    assert sim.retention(1) == 80
    sim.run([1], 20, scope="a")  # the owner can
    assert sim.retention(1) == 20
    sim.run([1], 90, scope="b")  # anyone may raise, and becomes the owner
    assert sim.retention(1) == 90
    sim.run([1], 30, scope="a")
    assert sim.retention(1) == 90
    sim.run([1], 30, scope="b")
    assert sim.retention(1) == 30


def test_unified_the_owner_is_the_scope_that_set_the_level_none_included() -> None:
    # an unscoped request that raises the level sets it: no scope owns it then, so none may lower it (the
    # scope that set the level before used to stay the owner and could lower the unscoped request's level)
    sim = unified(4, 1.0)
    sim.run([1], 80, scope="a")
    sim.run([1], 90)  # anyone may raise: an unscoped request sets 90
    assert sim.retention(1) == 90
    sim.run([1], 10, scope="a")  # "a" set 80, not 90
    assert sim.retention(1) == 90
    sim.run([1], 10)  # nor may an unscoped request lower it (it is not untouched content)
    assert sim.retention(1) == 90
    sim.run([1], 95, scope="b")  # a scoped raise owns it again
    sim.run([1], 50, scope="b")
    assert sim.retention(1) == 50
    # the same through a directive with a duration: the unscoped raise's lapse still falls back as before
    sim.run([2], 80, 10.0, scope="a")
    sim.run([2], 90, 20.0)
    sim.run([2], 10, scope="a")
    assert sim.retention(2) == 90
    sim.now = 21.0
    assert sim.retention(2) == 35


def test_unified_a_brief_raise_does_not_lower_the_owners_level() -> None:
    # a lapse falls to the users' mapped priority, not to the level a raise displaced: a non-owner raising an
    # owner's open-ended 80 to 90 for 0 s used to leave 35 behind it (and own the block), a lower by raising
    sim = unified(4, 1.0)
    sim.run([1], 80, scope="alice")
    sim.run([1], 50, scope="mallory")  # a direct lower is refused
    assert sim.retention(1) == 80
    sim.run([1], 90, 0.0, scope="mallory")
    sim.run([1], 81, 0.5, scope="mallory")
    sim.run([1], 95, 1.0)  # nor an unscoped one
    sim.now = 2.0
    assert sim.retention(1) == 80
    sim.run([1], 50, scope="alice")  # alice still owns it
    assert sim.retention(1) == 50
    # a raise that outlasts the level it displaces applies (and the raiser owns the block until it lapses)
    sim.run([3], 80, 10.0, scope="alice")
    sim.run([3], 90, 20.0, scope="mallory")
    sim.run([3], 40, scope="alice")
    assert sim.retention(3) == 90
    sim.now = 23.0
    assert sim.retention(3) == 35
    # the owner may raise briefly (it may lower anyway), and a raise over the users' own level always applies
    sim.run([4], 80, scope="alice")
    sim.run([4], 90, 1.0, scope="alice")
    assert sim.retention(4) == 90
    sim.run([5], 35)
    sim.run([5], 90, 1.0, scope="mallory")
    assert sim.retention(5) == 90
    sim.now = 25.0
    assert (sim.retention(4), sim.retention(5)) == (35, 35)


def test_rules_a_brief_raise_by_a_non_owner_keeps_the_displaced_level() -> None:
    state = rules.release(rules.UNSET, rules.UNSET, INF, None, 80, None, "alice", 0.0, 35)
    assert state == (80, 35, INF, "alice")
    assert rules.release(*state, 90, 0.0, "mallory", 10.0, 35) == state
    assert rules.release(*state, 90, 0.0, None, 10.0, 35) == state
    # a user whose mapped priority is the displaced level: its lapse falls back there, so the raise applies
    assert rules.release(*state, 90, 5.0, "mallory", 10.0, 80) == (90, 80, 15.0, "mallory")


def test_rules_a_lower_priority_reuse_keeps_the_rise_to_the_users_priority() -> None:
    # A (maps to 35, scope "a") computed the block asking 20 for 10 s: at 10 s it rises to 35, the highest
    # mapped priority of its users. B (maps to 25) reusing it at 1 s without a directive raises it to 25 until
    # then; before, B's release took the expiry with it and left 25 below 35 for good
    fresh = (rules.UNSET, rules.UNSET, INF, None)
    a = rules.release(*fresh, 20, 10.0, "a", 0.0, 35)
    assert a == (20, 35, 10.0, "a")
    b = rules.release(*a, 25, None, None, 1.0, 25)
    assert b == (25, 35, 10.0, None)
    assert [rules.effective(*b[:3], t) for t in (9.9, 10.0, 1e9)] == [25, 35, 35]
    # and a further plain reuse at 25 does not extend the low level (rule 4 refreshes only what is above base)
    assert rules.release(*b, 25, None, None, 2.0, 25) == b


def test_rules_a_refused_lower_ask_ends_at_its_own_end() -> None:
    # A (maps to 15) computed it; B (maps to 25) reuses it asking 0 for 0 s, refused (not the owner). B's range
    # falls back to B's mapped 25 once the 0 s are over, as if B had sent no directive; before: 15 forever
    fresh = (rules.UNSET, rules.UNSET, INF, None)
    a = rules.release(*fresh, 15, None, None, 0.0, 15)
    assert rules.effective(*rules.release(*a, 25, None, None, 0.0, 25)[:3], 1.0) == 25
    b = rules.release(*a, 0, 0.0, None, 0.0, 25)
    assert rules.effective(*b[:3], 0.0) == 25
    b = rules.release(*a, 0, 1.0, None, 0.0, 25)
    assert [rules.effective(*b[:3], t) for t in (0.5, 1.0)] == [15, 25]
    # a third user at 15 does not refresh the low level it finds (before: it kept it at 15 forever)
    c = rules.release(*b, 15, None, None, 0.5, 15)
    assert rules.effective(*c[:3], 1.0) == 25


def test_rules_a_plain_release_never_lowers_not_even_its_scopes_level() -> None:
    # scope "a" raised the block to 50 for 5 s (its request maps to 35); a later request of "a" that maps to 15
    # reuses it without a directive: that is no ask to lower, so 50 holds until 5 s, then 35. Before, the owner's
    # plain release lowered it to 15 for good, below the 35 of the request that computed it
    fresh = (rules.UNSET, rules.UNSET, INF, None)
    a = rules.release(*fresh, 50, 5.0, "a", 0.0, 35)
    b = rules.release(*a, 15, None, "a", 1.0, 15)
    assert b == a
    assert [rules.effective(*b[:3], t) for t in (4.0, 5.0)] == [50, 35]
    # a directive of "a" still lowers it, with or without a duration
    assert rules.release(*a, 10, None, "a", 1.0, 15)[0] == 10
    assert rules.release(*a, 15, 2.0, "a", 1.0, 15)[:3] == (15, 35, 3.0)
    # and "a"'s plain release below a level "a" lowered does not end that level's rise either
    low = rules.release(*fresh, 20, 10.0, "a", 0.0, 35)
    assert rules.release(*low, 25, None, "a", 1.0, 25)[:3] == (25, 35, 10.0)


def test_rules_an_owners_plain_release_at_its_lowered_level_does_not_extend_it() -> None:
    # rule 4: a level below base is extended only by its owner's directive; a plain release of the owner's scope
    # at that level (a less important request of the scope, mapping to 20) leaves the rise to base where it was
    fresh = (rules.UNSET, rules.UNSET, INF, None)
    low = rules.release(*fresh, 20, 10.0, "a", 0.0, 35)
    assert low == (20, 35, 10.0, "a")
    assert rules.release(*low, 20, None, "a", 1.0, 20) == low
    # the owner's directive at that level does extend it
    assert rules.release(*low, 20, 30.0, "a", 1.0, 35) == (20, 35, 31.0, "a")


def test_rules_a_refused_lower_ask_by_a_user_mapped_at_the_level_keeps_its_end() -> None:
    # rule 3: a refused lower ask ends the level at the ask's end only because the asker's mapped priority, above
    # the level, takes over then; a user mapped at the level itself takes over nothing, so the owner's hold stays
    fresh = (rules.UNSET, rules.UNSET, INF, None)
    low = rules.release(*fresh, 20, 10.0, "a", 0.0, 35)
    state = rules.release(*low, 5, 1.0, "b", 1.0, 20)
    assert state == low
    assert rules.effective(*state[:3], 5.0) == 20


def test_unified_pool_keeps_a_reused_block_at_its_users_highest_mapped_priority() -> None:
    # the rule above in the pool: the block rises to 35 at 10 s and outlives a one-use block of 35 by its uses
    sim = unified(2, 1.0)
    sim.run([1], 20, 10.0, scope="a")  # a request mapping to 35 asks 20 for 10 s
    sim.now = 1.0
    sim.run([1], base=25)  # a request mapping to 25 reuses it, no directive
    sim.run([2])  # one use at 35
    sim.now = 100.0
    assert sim.retention(1) == 35  # before: 25
    assert sim.evict_all() == [2, 1]


def test_unified_a_request_may_keep_what_it_computed_below_its_priority() -> None:
    # new content, no scope: its first release is its only user so far, so a lower ask holds (TensorRT-LLM's
    # low decode priority); before, the level stayed at the request's mapped priority and the ask was lost
    sim = unified(4, 1.0)
    sim.run([1], 10)  # a priority-0 request (maps to 35) asks 10
    sim.run([2], 35)
    assert sim.retention(1) == 10
    assert sim.evict_all() == [1, 2]
    sim = unified(4, 1.0)
    sim.run([3], 10, 5.0)  # for 5 s: then back to its users' mapped priority
    assert sim.retention(3) == 10
    sim.now = 6.0
    assert sim.retention(3) == 35
    sim.run([4], 10, scope="s")  # a scope lowering new content owns it: it may lower it again
    sim.run([4], 35)  # another user's release raises it: highest wins from then on
    assert sim.retention(4) == 35
    sim.run([4], 20, scope="s")  # "s" did not set 35: it cannot lower it
    assert sim.retention(4) == 35


def test_unified_shared_block_keeps_the_highest_whoever_releases_last() -> None:
    sim = unified(3, 1.0)
    a = sim.start([1])
    b = sim.start([1])
    sim.finish(b, 90)
    sim.finish(a, 10)
    sim.run([2], 50)
    assert sim.retention(1) == 90
    assert sim.evict_all() == [2, 1]


def _lapsing(now: float) -> Sim:
    sim = unified(2, 1.0)
    sim.run([1], 80, 5.0, base=25)  # a request of priority 1 (maps to 25) asks 80 for 5 s
    sim.run([2], 35)
    sim.now = now
    return sim


def test_unified_duration_holds_before_its_end() -> None:
    sim = _lapsing(4.9)
    assert sim.retention(1) == 80
    assert sim.evict_all() == [2, 1]  # both protected; block 1 has the higher value


def test_unified_lapse_falls_back_to_the_mapped_base() -> None:
    sim = _lapsing(5.0)
    assert sim.retention(1) == 25  # not 35: the request's own mapped priority
    assert sim.evict_all() == [1, 2]  # now unprotected, it goes first


def test_unified_lapse_falls_back_to_the_highest_base_of_its_users() -> None:
    sim = unified(2, 1.0)
    sim.run([1], 80, 5.0, base=25)
    sim.run([1], 45, base=45)  # a priority -1 request used it too, without a directive
    assert sim.retention(1) == 80
    sim.now = 5.0
    assert sim.retention(1) == 45


def test_unified_a_reuse_asking_the_current_level_still_raises_the_fallback() -> None:
    # highest wins among users: a request mapping to 45 that asks the block's level (25) is one of its users, so
    # a later lapse falls back to 45, not to the 25 of the block's earlier user
    sim = unified(2, 1.0)
    sim.run([1], 25, base=25)
    sim.run([1], 25, base=45)
    assert sim.retention(1) == 25
    sim.run([1], 60, 5.0, scope="a")
    sim.now = 5.0
    assert sim.retention(1) == 45


def test_unified_a_uniform_reuse_at_the_level_raises_the_fallback_to_it() -> None:
    # the same through a uniform release (no plan: the pool's batched call): a request mapping to 75 reuses a
    # block an owner raised to 75; the owner's later lowering lapses back to 75, its users' highest mapped priority
    sim = unified(2, 1.0)
    sim.run([1], 75, scope="a")
    ids = sim.start([1])
    sim.pool.free_blocks(ids, BlockRetention((), (), None, -4, 75))
    sim.run([1], 10, 5.0, scope="a")
    assert sim.retention(1) == 10
    sim.now = 5.0
    assert sim.retention(1) == 75


def _lapse_within_the_unprotected_tier(now: float) -> list[int]:
    sim = unified(2, 1.0)
    sim.run([1], 30, 1.0, base=20)  # unprotected at 30 for 1 s, then at its request's mapped 20
    sim.run([2], 25, base=25)  # unprotected at 25, released later
    sim.now = now
    return sim.evict_all()


def test_unified_a_lapse_within_a_tier_moves_the_block_to_its_new_key() -> None:
    assert _lapse_within_the_unprotected_tier(0.5) == [2, 1]  # 30 is worth more than 25
    assert _lapse_within_the_unprotected_tier(2.0) == [1, 2]  # lapsed to 20: worth less than 25


def test_unified_lapsed_directive_does_not_become_permanent_on_reuse() -> None:
    # Released at 90 for 1 s, then released again at 35 after 2 s, before any eviction ran the lapse: the
    # second release must see the lapse (back to 35), not refresh the 90 for ever.
    sim = unified(2, 1.0)
    sim.run([1], 90, 1.0)
    sim.now = 2.0
    sim.run([1], 35)
    assert sim.retention(1) == 35
    sim.now = 1e9
    assert sim.retention(1) == 35
    sim.run([2], 35)  # released later, used once
    assert sim.evict_all() == [2, 1]  # block 1 outlives block 2 by its two uses, not by a lapsed 90


def test_unified_lapsed_directive_reuse_then_new_directive_lapses_again() -> None:
    sim = unified(1, 1.0)
    sim.run([1], 90, 1.0)
    sim.now = 2.0
    sim.run([1], 80, 1.0)  # a new, shorter directive after the lapse
    assert sim.retention(1) == 80
    sim.now = 3.5
    assert sim.retention(1) == 35


def test_unified_frequency_raises_survival() -> None:
    sim = unified(2, 1.0)
    for _ in range(3):
        sim.run([1], 25, base=25)
    sim.run([2], 25, base=25)  # released last, but used once
    assert sim.evict_all() == [2, 1]


def test_unified_priority_weight_orders_unprotected_blocks() -> None:
    sim = unified(3, 1.0)
    sim.run([1], 30, base=30)
    sim.run([2], 10, base=10)
    sim.run([3], 20, base=20)
    assert sim.evict_all() == [2, 3, 1]


def test_unified_fixed_target_ignores_lookups() -> None:
    pol = make_policy("unified", 10, PolicyConfig(budget=0.5, isolation_goal=None))
    pol.on_lookup([1, 2], 0, 80)
    pol.on_lookup([1, 2], 0, 80)
    assert pol.stats()["protected_target"] == 5.0


def test_unified_ghost_keeps_frequency_across_eviction() -> None:
    sim = unified(2, 1.0)
    for _ in range(3):
        sim.run([1], 25, base=25)
    sim.run([2], 25, base=25)
    assert sim.evict(2) == [2, 1]
    sim.pool.free_blocks([0, 1])
    sim.run([1], 25, base=25)
    sim.run([3], 25, base=25)
    assert sim.evict_all() == [3, 1]


def _two_chains() -> Sim:
    sim = unified(6, 1.0)
    sim.run([1, 2, 3], 25, base=25)  # equal keys: one use each at the same priority
    sim.run([4, 5, 6], 25, base=25)
    return sim


def test_unified_evicts_a_chain_as_a_unit_tail_first() -> None:
    # an exposed parent goes first among equal keys: chain 1-2-3 goes whole before chain 4-5-6 starts
    assert _two_chains().evict_all() == [3, 2, 1, 6, 5, 4]


def test_unified_eviction_order_does_not_depend_on_allocation_batches() -> None:
    one_call = _two_chains().evict(6)
    two_calls = _two_chains()
    assert one_call == two_calls.evict(1) + two_calls.evict(4) + two_calls.evict(1)


def test_unified_exposed_parent_waits_behind_lower_keys() -> None:
    sim = unified(3, 1.0)
    sim.run([1, 2], 25, base=25)
    sim.run([1], 25, base=25)  # block 1: three uses, block 2: one
    sim.run([1], 25, base=25)
    sim.run([3], 25, base=25)  # one use
    assert sim.evict(3) == [2, 3, 1]  # exposed by 2, block 1 (key 3) waits behind block 3 (key 1)


def test_unified_protected_parent_is_not_taken_ahead_of_unprotected_blocks() -> None:
    sim = unified(4, 1.0)
    sim.run([1, 2], 35)  # protected chain
    sim.run([3], 25, base=25)
    sim.run([4], 25, base=25)
    # within the budget unprotected blocks go first, also when a protected victim exposed its parent
    assert sim.evict(4) == [3, 4, 2, 1]
    sim2 = unified(4, 0.0)  # no budget: the two tiers compete on their keys (35 is worth 2x 25)
    sim2.run([3], 25, base=25)
    sim2.run([1, 2], 35)
    sim2.run([4], 25, base=25)
    assert sim2.evict(4) == [3, 4, 2, 1]


def test_unified_an_exposed_protected_parent_waits_when_its_tier_is_back_at_the_target() -> None:
    sim = unified(3, 1 / 3)  # target 1 protected block
    sim.run([1, 2], 35)  # protected chain, keys 1
    for _ in range(4):
        sim.run([3], 25, base=25)  # unprotected, key 2
    assert sim.policy.stats()["protected_target"] == 1.0
    # 2 protected > 1: the tiers compete and 2 (key 1) goes; its parent 1 then leaves the protected tier at its
    # target, so unprotected 3 goes before it although 1 has the lower key
    assert sim.evict(3) == [2, 3, 1]


def _tie_across_tiers() -> Sim:
    sim = unified(3, 0.0, priority_weight=1.0)  # no budget: the tiers compete on keys; equal weights
    sim.run([1, 2], 35)  # protected chain: both keys 1
    sim.run([1], 35)  # block 1: two uses, key 2 (not queued: it has a cached child)
    sim.run([9], 25, base=25)
    sim.run([9], 25, base=25)  # unprotected block 9: key 2
    return sim


def test_unified_over_budget_a_tie_across_tiers_goes_by_place_in_the_bucket_also_for_an_exposed_parent() -> (
    None
):
    # 2 (key 1) goes first and exposes 1 (key 2, protected), which ties with 9 (key 2, unprotected): an exposed
    # parent goes first in its bucket, in either tier (the order one queue of both tiers has: its chain leaves
    # as a unit), whether the blocks are evicted in one allocation or one at a time
    assert _tie_across_tiers().evict(3) == [2, 1, 9]
    one_by_one = _tie_across_tiers()
    assert one_by_one.evict(1) + one_by_one.evict(1) + one_by_one.evict(1) == [2, 1, 9]


def test_unified_blocks_made_evictable_from_outside_leave_in_the_order_they_came() -> None:
    """``push`` without a release (vLLM's CPU offload pool frees blocks without a request, so the plugin's per-block
    queue hears of no release): the blocks are the newest in the release order, in the order pushed (before: they
    kept their unset release stamps and went in reverse, and vLLM's ``test_lru_eviction_order`` evicted the wrong
    request's blocks)."""
    pol = make_policy("unified", 6, PolicyConfig(budget=0.0, isolation_goal=None, adapt_frequency=False))
    for b in range(6):
        pol.on_cached(b, b.to_bytes(8, "little"), 0, 0.0)  # type: ignore[arg-type]
    order = [0, 4, 1, 5, 2, 3]
    for b in order:
        pol.push(b, 0.0)
    assert [pol.pop(0.0) for _ in order] == order


def test_unified_keys_a_block_made_evictable_without_a_release_as_released_now() -> None:
    """A block whose content no release keyed (the offload pool frees blocks without a request) is released at
    the default retention when it is pushed: it goes after a block released before it at that retention (before:
    it kept its previous content's key, or 0, and went first)."""
    pol = make_policy("unified", 4, PolicyConfig(budget=0.0, isolation_goal=None, adapt_frequency=False))
    for b in range(3):
        pol.on_cached(b, b.to_bytes(8, "little"), 0, 0.0)  # type: ignore[arg-type]
    pol.on_release(1, 35, None, None, 0.0, 35)
    pol.push(1, 0.0)
    pol.push(0, 1.0)  # no release
    pol.on_release(2, 35, None, None, 2.0, 35)
    pol.push(2, 2.0)
    assert [pol.pop(3.0) for _ in range(3)] == [1, 0, 2]
    assert pol.retention_of(0, 3.0) == 35


def test_unified_queues_a_block_freed_again_without_a_release_as_of_now() -> None:
    """Pushed, hit (removed) and pushed again with no release in between (the offload pool): the block is keyed
    from ``L`` now, as the run queue keys it, not from its first push (before: only its place moved, its key
    stayed below ``L`` and it went before a block pushed earlier). A parent no release keyed, exposed when its
    child goes, is released then at the default retention (before: key 0, first to go)."""
    pol = make_policy("unified", 5, PolicyConfig(budget=0.0, isolation_goal=None, adapt_frequency=False))
    for b in range(5):
        pol.on_cached(b, b.to_bytes(8, "little"), 0, 0.0)  # type: ignore[arg-type]
    pol.push(0, 0.0)
    pol.push(1, 0.0)
    assert pol.pop(1.0) == 0  # L rises to 0's key
    pol.push(2, 2.0)
    pol.remove(1)
    pol.push(1, 3.0)
    assert pol.pop(4.0) == 2  # (before: 1)
    pol.push(3, 5.0)
    pol.expose(4, 6.0)  # never released: its child went, it is queued now
    assert [pol.pop(7.0), pol.pop(7.0), pol.pop(7.0)] == [1, 3, 4]  # (before: 4 first)
    assert pol.retention_of(4, 7.0) == 35


RECENCY_END = {"budget": 0.0, "priority_weight": 1.0, "frequency_exponent": 0.0}
"""``unified`` at the end of its range that the controller falls to where protection and frequency do not pay
(its level -1: flat weights; its balance at recency; no protected share)."""


def _mixed_traffic(seed: int, n: int = 400) -> list[tuple[float, list[int], int, int | None, float | None]]:
    """Requests ``(time, hashes, class, directive level, duration)``: conversations on four shared system
    prompts that come back with their history, three classes, a fifth of them with a short directive, some
    prompts that end where another's block does (a parent released without a child)."""
    rng = random.Random(seed)
    systems = [[1000 * k + j for j in range(3)] for k in range(4)]
    hist: dict[int, list[int]] = {}
    nxt = 10_000
    out = []
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(2.0)
        conv = rng.randrange(30)
        prompt = hist.get(conv) or list(systems[conv % 4])
        if rng.random() < 0.1:
            prompt = prompt[: rng.randrange(1, len(prompt) + 1)]  # a strict prefix: no new block
        else:
            prompt = prompt + list(range(nxt, nxt + rng.randrange(1, 6)))
            nxt += 6
            hist[conv] = prompt[:40]
        directive = rng.random() < 0.2
        out.append(
            (t, prompt, conv % 3, 80 if directive else None, rng.uniform(0.5, 8.0) if directive else None)
        )
    return out


@pytest.mark.parametrize("seed", range(6))
def test_unified_at_its_recency_end_evicts_what_lru_evicts(seed: int) -> None:
    """With flat weights, recency and no protected share, ``unified`` is plain LRU: the same victims in the same
    order, whatever the classes' retention and their directives do to the tiers (before session 25: the tiers
    broke ties on raw keys instead of the queue's FIFO, and a lapse re-keyed its block as released at the lapse;
    0.9912x lru's hits on a multi-tenant trace in this setting)."""
    u = unified(48, **RECENCY_END)  # type: ignore[arg-type]
    lru = Sim("lru", 48)
    for t, prompt, cls, level, dur in _mixed_traffic(seed):
        victims = []
        for sim in (u, lru):
            sim.now = t
            evicted: list[int] = []
            sim.pool.on_evict = lambda bid, h, ev=evicted: ev.append(int(h))  # type: ignore[misc]
            ids = sim.start(prompt)
            sim.pool.on_evict = None
            mapped = DEFAULT_RETENTION_PRIORITY - 10 * cls
            sim.finish(ids, mapped if level is None else level, dur, base=mapped)
            victims.append(evicted)
        assert victims[0] == victims[1], (t, prompt)
    assert set(u.pool.cached) == set(lru.pool.cached)


def test_lfu_exposed_parent_keeps_its_release_order() -> None:
    # lfu's key fixes the release order: a parent released right after its child follows it
    sim = Sim("lfu", 6)
    sim.run([1, 2, 3])
    sim.run([4, 5, 6])
    assert sim.evict(6) == [3, 2, 1, 6, 5, 4]


def test_unified_ghost_keeps_one_use_count_per_256_token_segment() -> None:
    cfg = PolicyConfig(budget=1.0, isolation_goal=None, block_size=16)  # one sampled block per 16
    sim = Sim("unified", 20, cfg)
    pol = sim.policy
    assert isinstance(pol, UnifiedPolicy)
    chain = list(range(1000, 1020))  # 20 blocks: segment heads at depth 0 and 16
    for _ in range(3):
        sim.run(chain, 35)
    assert len(sim.evict_all()) == 20
    assert len(pol._ghost) == 2  # only the two segment heads are remembered
    sim.pool.free_blocks(list(range(20)))  # (evict_all holds the blocks it allocated)
    ids = sim.start(chain)  # the chain comes back: heads restore 3, the blocks after them inherit it
    assert [pol._meta[ids[d]].uses for d in (0, 1, 15, 16, 17, 19)] == [3, 3, 3, 3, 3, 3]
    # a block inside a segment that is not cached right after its predecessor starts from zero
    pol.on_cached(ids[7], 2000, 7, 0.0)
    assert pol._meta[ids[7]].uses == 0
    # exact for large blocks: every block has its own entry
    big = make_policy("unified", 8, PolicyConfig(isolation_goal=None, block_size=512))
    assert isinstance(big, UnifiedPolicy) and big._stride == 1


# ---------------------------------------------------------------- belady


def test_belady_needs_next_use() -> None:
    with pytest.raises(
        ValueError, match=r"policy 'belady' is an offline oracle: it needs PolicyConfig\(next_use="
    ):
        make_policy("belady", 4)


def test_belady_farthest_next_use_first() -> None:
    next_use = {1: 5.0, 2: math.inf, 3: 2.0, 4: 9.0}
    sim = Sim("belady", 4, PolicyConfig(next_use=lambda h: next_use[int(h)]))
    for h in (1, 2, 3, 4):
        sim.run([h])
    assert sim.evict_all() == [2, 4, 1, 3]


def test_belady_ties_go_deepest_first() -> None:
    sim = Sim("belady", 3, PolicyConfig(next_use=lambda h: 7.0))
    sim.run([9])
    sim.run([1, 2])
    assert sim.evict_all() == [2, 9, 1]


def test_belady_never_used_again_deepest_first() -> None:
    sim = Sim("belady", 3, PolicyConfig(next_use=lambda h: math.inf))
    sim.run([9])  # depth 0, released first
    sim.run([1, 2])  # hash 2 at depth 1
    assert sim.evict(1) == [2]


def test_belady_depth_does_not_leak_into_the_next_use_order() -> None:
    # a leaf 4,100 blocks deep used at request 5 against a root used at request 6: the root's use is farther
    uses = {"deep": 5.0, "root": 6.0}
    pol = make_policy("belady", 2, PolicyConfig(next_use=lambda h: uses[str(h)]))
    pol.on_cached(0, "deep", 4100, 0.0)  # type: ignore[arg-type]
    pol.on_cached(1, "root", 0, 0.0)  # type: ignore[arg-type]
    pol.push(0, 0.0)
    pol.push(1, 0.0)
    assert pol.pop(0.0) == 1


@pytest.mark.parametrize(
    "answer",
    [None, "7", b"7", True, [7], 2 + 1j, math.nan, -math.inf, -(10**400)],
    ids=["None", "str", "bytes", "bool", "list", "complex", "nan", "-inf", "-10**400"],
)
def test_belady_refuses_an_oracle_answer_that_is_not_a_number_naming_both(answer: object) -> None:
    # None or a string failed in the key's arithmetic: "'<' not supported between instances of 'float' and
    # 'NoneType'"; NaN was taken (every comparison false) and True stood for 1
    def oracle(h: object) -> object:
        return answer

    pol = make_policy("belady", 2, PolicyConfig(next_use=oracle))  # type: ignore[arg-type]
    pol.on_cached(0, 42, 0, 0.0)
    with pytest.raises(
        ValueError,
        match=r"policy 'belady': its next_use oracle .*oracle returned .+ for block hash 42; it must return a "
        r"number",
    ) as e:
        pol.push(0, 0.0)
    assert repr(answer)[:20] in str(e.value)


def test_belady_takes_any_real_number_as_a_next_use() -> None:
    # ints, a numpy-like number (a float subclass), Decimal-like (float() converts) and an int past a float's
    # range (never) order as their float values did
    from decimal import Decimal

    class Time(float):
        pass

    uses: dict[int, object] = {1: 5, 2: 10**400, 3: Decimal("2.5"), 4: Time(9.0), 5: math.inf}
    sim = Sim("belady", 5, PolicyConfig(next_use=lambda h: uses[int(h)]))  # type: ignore[arg-type,return-value]
    for h in (1, 2, 3, 4, 5):
        sim.run([h])
    assert sim.evict_all() == [2, 5, 4, 1, 3]  # (2 and 5 both never used again, at one depth: a tie)


# ---------------------------------------------------------------- key order at every setting


@pytest.mark.parametrize("weight", [1.0, 2.0, 8.0, 32.0])
@pytest.mark.parametrize("exponent", [0.5, 1.0, 2.0])
def test_unified_use_counts_stay_ordered_at_every_weight(weight: float, exponent: float) -> None:
    # Blocks of a low-priority (retention 10) request used 4, 3, 2 and 1 times, released in that order at the
    # same aging floor: the fewest uses go first, whatever the weight makes their values (at weight 8 and
    # 16 buckets per key unit all four values fell in one bucket and left in release order).
    sim = unified(4, 1.0, priority_weight=weight, frequency_exponent=exponent)
    for h, uses in ((1, 4), (2, 3), (3, 2), (4, 1)):
        for _ in range(uses):
            sim.run([h], 10, base=10)
    assert sim.evict_all() == [4, 3, 2, 1]


def test_unified_buckets_are_finer_than_the_smallest_value_step() -> None:
    from kvretain.core.policies import rules

    for weight in (1.0, 2.0, 8.0, 100.0):
        for exponent in (0.25, 1.0, 3.0):
            cfg = PolicyConfig(priority_weight=weight, frequency_exponent=exponent)
            scale = rules.buckets_per_key(cfg)
            w = min(rules.retention_weights(weight))
            f = rules.frequency_terms(cfg)
            smallest = min(w * (b - a) for a, b in zip(f, f[1:], strict=False))
            assert 1.0 / scale <= smallest / 2 * (1 + 1e-9)


def test_the_largest_value_check_counts_the_balances_top_rung() -> None:
    # with adapt_frequency the exponent may reach frequency_exponent x 4 (FREQUENCY_RUNGS): 64 ** 56 x 2 ** 6.5
    # overflows the bound that keeps GreedyDual keys finite, 64 ** 14 x 2 ** 6.5 does not
    PolicyConfig(frequency_exponent=14.0, adapt_frequency=False)
    with pytest.raises(ValueError, match=r"top rung.*64 \*\* 56\.0"):
        PolicyConfig(frequency_exponent=14.0)


def _lapsing_program(policy: str, n: int, steps: int) -> tuple[list[int], list[int]]:
    """Single-block requests on an ``n``-block pool, directives of a week, 3 s or none, a clock moving 1 s a
    request: what is evicted (in order) and the size of the scheduled-lapse heap after each request."""
    sim = Sim(policy, n, PolicyConfig(budget=0.5, isolation_goal=None))
    evicted: list[int] = []
    heap: list[int] = []
    sim.pool.on_evict = lambda bid, h: evicted.append(int(h))
    for i in range(steps):
        h = i % (3 * n)  # (some content comes back while cached, some after its eviction)
        ids = sim.start([1000 + h])
        sim.finish(ids, 80 if i % 2 else 10, (7 * 24 * 3600.0, 3.0, None)[i % 3])
        sim.now += 1.0
        heap.append(len(sim.policy._expiries))  # type: ignore[attr-defined]
    return evicted, heap


@pytest.mark.parametrize("policy", ["unified", "priority"])
def test_scheduled_lapses_grow_with_the_pool_not_the_releases(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lapse entry went stale when its block was released again or evicted, but left the heap only when its
    time came: with week-long durations the heap grew by one entry a release. Compacted now (entries whose
    block's expiry is still theirs are kept), within twice the pool plus a constant, deciding the same."""
    from kvretain.core.policies import rules

    n = 8
    evicted, heap = _lapsing_program(policy, n, 600)
    assert max(heap) <= 2 * n + rules.LAPSE_SLACK, max(heap)
    monkeypatch.setattr(rules, "lapse_limit", lambda kept: 10**9)  # never compacted
    never, grown = _lapsing_program(policy, n, 600)
    assert evicted == never and len(evicted) > 500
    assert max(grown) > 2 * n + rules.LAPSE_SLACK


def test_a_lapse_due_after_its_blocks_eviction_protects_nothing() -> None:
    # a block held at 90 for 1 s (falling back to 60, still protected) is evicted before its lapse, and its id is
    # now a block in use that is not full yet (no content); when the lapse comes due, the evicted content must not
    # count as protected again (the count steers what the pool evicts)
    sim = Sim("unified", 3, PolicyConfig(budget=0.5, isolation_goal=None))
    (held,) = sim.run([1], 90, 1.0, base=60)
    sim.run([2], 10)
    sim.run([3], 10)
    assert sim.policy.stats()["protected_blocks"] == 1.0
    sim.now = 0.5
    taken = sim.pool.get_new_blocks(3)  # (evicts all three; nothing cached in them yet)
    assert taken is not None and not sim.pool.cached
    assert sim.policy.stats()["protected_blocks"] == 0.0
    others = [b for b in taken if b != held]  # (the block that held 1 stays in use, still without content)
    sim.pool.free_blocks(others, BlockRetention([10, 10], [None, None], None, 0, 10))
    sim.run([5], 10)
    sim.run([6], 10)
    sim.now = 5.0
    sim.start([7])  # (evicts, which runs the lapses due)
    assert sim.policy.stats()["protected_blocks"] == 0.0  # (before: 1, for content the pool no longer holds)


def test_keys_set_under_other_tables_are_set_again_when_the_tables_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the frequency exponent falls from 4 to 1 at the 5th lookup. A's prefix, used 4 times before, was keyed at
    # 4 ** 4 = 256; B's, used 6 times after, at 6. Left as set, A's keys outlive B's (and, at 64 uses, every block
    # released since for ~16.7M turnovers: the pin that held retired prompt templates on the held-out
    # template-drift traffic); keyed again from the L of their release with the new tables (4 < 6), A's go first
    import kvretain.core.policies.unified as unified_module

    monkeypatch.setattr(unified_module, "ProtectionController", SwitchingController)
    sim = Sim("unified", 30, PolicyConfig(budget=1.0, isolation_goal=None, ghost_factor=0.0))
    lookups = 0
    for prefix, tails, times in (([1, 2], 100, 4), ([3, 4], 200, 6)):
        for k in range(times):
            hashes = [*prefix, tails + k]
            sim.policy.on_lookup(
                hashes, sum(1 for h in hashes if h in sim.pool.cached), DEFAULT_RETENTION_PRIORITY
            )
            lookups += 1
            sim.run(hashes)
    assert lookups > SWITCH_AT
    order = sim.evict_all()
    assert order[-4:] == [2, 1, 4, 3]
    assert sim.policy.stats()["rekeys"] == 1.0


@pytest.mark.parametrize("policy", ["lfu", "unified"])
def test_a_copy_evicted_while_its_content_stays_cached_leaves_no_ghost_entry(policy: str) -> None:
    # Two requests that compute the same content at once register it twice (a copy, as vLLM does). Evicting the
    # copy while the first block still holds the content is no eviction of the content: a use count remembered
    # for it then went to the next copy of the content registered while the first block still held it, which
    # outranked unique content released with it: the unique content was evicted and the redundant copy kept
    # (lfu and unified alike; s3fifo and arc already keep ghost entries for content that left with its last copy)
    # (blocks of 256 tokens: unified's ghost table keeps every block's count)
    cfg = PolicyConfig(adapt_frequency=False, isolation_goal=None, budget=0.0, block_size=256)
    pool = BlockPool(4, make_policy(policy, 4, cfg), clock=lambda: 0.0)
    ghost = pool.policy._ghost  # type: ignore[attr-defined]
    h, g = b"h", b"g"
    (a,) = pool.get_new_blocks(1)  # type: ignore[misc]
    pool.cache_blocks([a], [h], 0, 1)
    (b,) = pool.get_new_blocks(1)  # type: ignore[misc]
    pool.cache_blocks([b], [h], 0, 1)  # computed at the same time by another request: a copy
    assert pool.copies == {h: [b]}
    pool.free_blocks([b])
    pool.free_blocks([a])
    for _ in range(3):  # three hits on the block lookups find
        pool.touch([a])
        pool.free_blocks([a])
    fill = pool.get_new_blocks(3)  # the two empty blocks and one victim: the copy (one use, released first)
    assert fill is not None and b in fill and pool.cached == {h: a} and not pool.copies
    assert h not in ghost.table  # the content is still cached: nothing to remember
    pool.free_blocks(fill)
    # the content computed again while block a holds it (a copy, redundant), and new content, released after it
    (c,) = pool.get_new_blocks(1)  # type: ignore[misc]
    pool.cache_blocks([c], [h], 0, 1)
    (d,) = pool.get_new_blocks(1)  # type: ignore[misc]
    pool.cache_blocks([d], [g], 0, 1)
    pool.free_blocks([c])
    pool.free_blocks([d])
    # one use each, c released first: the redundant copy goes, the new content stays
    got = pool.get_new_blocks(2)
    assert got is not None and c in got and d not in got
    assert pool.cached == {h: a, g: d}
    assert h not in ghost.table  # (the second copy evicted: block a still holds the content)
    pool.check_integrity()
    # the content leaves with its last copy: then it is remembered
    pool.free_blocks(got)
    got = pool.get_new_blocks(4)
    assert got is not None and h in ghost.table and g in ghost.table
    # it comes back (taking its remembered count) in one block and leaves again: remembered again
    pool.free_blocks(got)
    (e,) = pool.get_new_blocks(1)  # type: ignore[misc]
    pool.cache_blocks([e], [h], 0, 1)
    assert h not in ghost.table
    pool.free_blocks([e])
    assert pool.get_new_blocks(4) is not None and h in ghost.table and not pool.cached


def test_a_policy_is_sized_by_its_capacity_and_indexed_by_every_block_id() -> None:
    """``capacity``: the blocks that can hold content (vLLM's pool keeps a null block), what sizes the queues,
    ghosts and shadows; block ids still run over ``num_blocks``."""
    from kvretain.core import PolicyConfig, make_policy

    cfg = PolicyConfig(block_size=16)
    for name in ("lru", "lfu", "priority", "belady", "s3fifo", "arc", "unified"):
        c = PolicyConfig(block_size=16, next_use=lambda h: 0.0) if name == "belady" else cfg  # (offline)
        pol = make_policy(name, 41, c, capacity=40)
        assert (pol.num_blocks, pol.capacity) == (41, 40)
        assert make_policy(name, 41, c).capacity == 41
    s3 = make_policy("s3fifo", 101, cfg, capacity=100)
    assert (s3.small_target, s3.ghost_capacity) == (10, 90)  # type: ignore[attr-defined]
    unified = make_policy("unified", 101, cfg, capacity=100)
    assert unified.stats()["protected_budget"] == pytest.approx(cfg.budget * 100)
    for bad in (0, 42, True, 1.5):
        with pytest.raises(ValueError, match="capacity must be an integer from 1 to num_blocks"):
            make_policy("lru", 41, cfg, capacity=bad)  # type: ignore[arg-type]
