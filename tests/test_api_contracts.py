"""The core API's contracts at its edges, as an adversarial pass over it found them broken (session 45): a refused
call changes nothing whatever iterable carries the ids, a policy orders one pool, a plan cannot be changed after
its checks, bad arguments get a clear exception. Each test fails on the code before its fix."""

from __future__ import annotations

import math

import pytest

from kvretain.core.block_pool import BlockPool
from kvretain.core.policy import make_policy
from kvretain.core.retention import BlockRetention, RetentionConfig, RetentionError

POOL_POLICIES = ["lru", "lfu", "priority", "unified", "s3fifo", "arc"]


def _pool(policy: str, n: int = 4) -> BlockPool:
    return BlockPool(n, make_policy(policy, n), clock=lambda: 0.0)


def _state(pool: BlockPool) -> tuple[object, ...]:
    return (
        list(pool.ref_cnt),
        dict(pool.cached),
        pool.get_num_free_blocks(),
        sorted(pool.policy.evictable_ids()),
    )


@pytest.mark.parametrize("policy", POOL_POLICIES)
@pytest.mark.parametrize("kind", [iter, tuple, lambda ids: (b for b in ids)])
def test_a_refused_touch_through_any_iterable_changes_nothing(policy: str, kind: object) -> None:
    # an iterator that held an empty block left the first block's reference taken and the free count wrong:
    # the undo walked the ids again (len() of an iterator)
    pool = _pool(policy)
    ids = pool.get_new_blocks(1)
    assert ids == [0]
    pool.cache_blocks(ids, [b"a"], 0, 1)
    pool.free_blocks(ids)
    before = _state(pool)
    with pytest.raises(ValueError, match="block 3 is empty"):
        pool.touch(kind([0, 3]))  # type: ignore[operator]
    assert _state(pool) == before
    pool.check_integrity()
    pool.touch(iter([0]))  # (a valid iterator is taken as before)
    assert pool.ref_count(0) == 1


@pytest.mark.parametrize("policy", POOL_POLICIES)
def test_free_blocks_takes_any_iterable_and_a_refused_one_changes_nothing(policy: str) -> None:
    pool = _pool(policy)
    ids = pool.get_new_blocks(2)
    assert ids == [0, 1]
    pool.cache_blocks(ids, [b"a", b"b"], 0, 2)
    before = _state(pool)
    with pytest.raises(ValueError, match="block id 7 is not a block"):
        pool.free_blocks(iter([0, 1, 7]))  # (the message named None for a set)
    assert _state(pool) == before
    pool.free_blocks(b for b in ids)
    assert pool.ref_cnt[:2] == [0, 0]
    pool.check_integrity()


@pytest.mark.parametrize("policy", POOL_POLICIES)
def test_a_policy_orders_one_pool(policy: str) -> None:
    # a second pool on the same policy shared its block states (or its order) with the first: each corrupted the
    # other's counts
    pol = make_policy(policy, 4)
    BlockPool(4, pol)
    with pytest.raises(ValueError, match="already orders another pool's blocks"):
        BlockPool(4, pol)


def test_priority_schedules_one_lapse_per_block_however_often_it_is_released() -> None:
    # the strict priority policy pushed an expiry entry per release: with an infinite duration (documented as no
    # expiry), or again at the same clock reading, the heap grew without bound (its compaction keeps entries that
    # match their block's expiry, duplicates too)
    for duration in (math.inf, 5.0):
        pool = _pool("priority", 1)
        ids = pool.get_new_blocks(1)
        assert ids is not None
        pool.cache_blocks(ids, [b"a"], 0, 1)
        plan = BlockRetention([90], [duration])
        for _ in range(2_000):
            pool.free_blocks(ids, plan)
            pool.touch(ids)
        assert len(pool.policy._expiries) == (0 if duration == math.inf else 1)  # type: ignore[attr-defined]
        pool.free_blocks(ids, plan)
        assert pool.policy.retention_of(0, 0.0) == 90
        assert pool.policy.retention_of(0, 6.0) == (90 if duration == math.inf else 35)


def test_a_plan_cannot_change_after_its_checks() -> None:
    # the lists were checked when the plan was built and could be changed after: a priority of 500 reached the
    # policies (unified indexed its weights out of range after the pool had already counted the release)
    plan = BlockRetention([50, 60], [None, 1.0])
    assert plan.priorities == (50, 60) and plan.durations == (None, 1.0)
    with pytest.raises(TypeError):
        plan.priorities[1] = 500  # type: ignore[index]
    with pytest.raises(RetentionError, match="priorities must be a list of per-block values, got int"):
        BlockRetention(5)  # type: ignore[arg-type]


def test_free_blocks_names_a_retention_that_is_not_a_plan() -> None:
    pool = _pool("unified")
    ids = pool.get_new_blocks(1)
    assert ids is not None
    before = _state(pool)
    with pytest.raises(TypeError, match="retention must be a BlockRetention or None, got dict"):
        pool.free_blocks(ids, {"priorities": [90]})  # type: ignore[arg-type]
    assert _state(pool) == before


class _Index:
    """An integer that is not an int (a numpy integer, say): ``__index__`` only."""

    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v


def test_get_new_blocks_takes_any_integer_as_block_ids_are() -> None:
    pool = _pool("lru")
    assert pool.get_new_blocks(_Index(2)) == [0, 1]  # type: ignore[arg-type]
    for bad in (_Index(-1), True, 1.0, "1"):
        with pytest.raises(ValueError, match="get_new_blocks: cannot allocate"):
            pool.get_new_blocks(bad)  # type: ignore[arg-type]
    pool.check_integrity()


def test_block_plan_refuses_a_block_size_that_is_not_positive() -> None:
    cfg = RetentionConfig.from_request_fields([{"start": 0, "end": 8, "priority": 90}])
    for size in (0, -16):
        with pytest.raises(RetentionError, match="block_size must be > 0"):
            cfg.block_plan(4, size, 64, 35)
    assert cfg.block_plan(4, 16, 64, 35) == ([90, 35, 35, 35], [None, None, None, None])


def test_a_policy_setting_past_any_bound_is_shown_shortened() -> None:
    # the one error line of a plugin setting (KVRETAIN_POLICY_OPTIONS=frequency_cap=1e300) held all 301 digits
    from kvretain.core.policy import PolicyConfig

    with pytest.raises(
        ValueError, match=r"frequency_cap must be an integer .*got 1000.*\(301 characters\)$"
    ) as e:
        PolicyConfig(frequency_cap=10**300)
    assert len(str(e.value)) < 200
