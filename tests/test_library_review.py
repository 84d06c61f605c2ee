"""The core and sched library API as an engine that embeds kvretain uses it: defects a review found (session 42),
each test failing on the code before its fix."""

from __future__ import annotations

import math
import time

import pytest

from kvretain.core import KVCacheManager, PolicyConfig
from kvretain.core.block_pool import BlockPool, PoolIntegrityError
from kvretain.core.policy import make_policy
from kvretain.core.retention import BlockRetention, RetentionConfig, RetentionError
from kvretain.sched.config import SchedulerConfig
from kvretain.sched.request import Request
from kvretain.sched.scheduler import Scheduler


def _cached_free_pool(policy: str = "lru", n: int = 4, clock: object = None) -> tuple[BlockPool, list[int]]:
    pool = BlockPool(n, make_policy(policy, n), clock=clock)  # type: ignore[arg-type]
    ids = pool.get_new_blocks(n)
    assert ids is not None
    pool.cache_blocks(ids, list(range(1, n + 1)), 0, n)
    pool.free_blocks(ids)
    return pool, ids


def test_durations_run_on_real_time_by_default() -> None:
    # the default clock read 0.0 forever: the README's "keep the system prompt 30 s" never lapsed
    kv = KVCacheManager(8, 4, policy="unified")
    assert kv.pool.clock is time.monotonic
    assert Scheduler(kv).clock is kv.pool.clock  # (one clock for the cache and the request times)
    ret = RetentionConfig.from_request_fields([{"start": 0, "end": 8, "priority": 90, "duration_s": 0.02}])
    req = Request("a", list(range(9)), 1, retention=ret)
    hits, n = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, 9, n, hits) is not None
    kv.free(req)
    policy = kv.pool.policy
    assert policy.retention_of(0, kv.pool.clock()) == 90
    time.sleep(0.05)
    assert policy.retention_of(0, kv.pool.clock()) == 35  # (lapsed to the request priority's mapping)


def test_priorities_without_durations_keep_their_priorities() -> None:
    # BlockRetention(priorities=[90, 90]) (durations left at their default, empty) released both blocks at 35
    pool = BlockPool(4, make_policy("unified", 4))
    ids = pool.get_new_blocks(2)
    assert ids is not None
    pool.cache_blocks(ids, [1, 2], 0, 2)
    plan = BlockRetention(priorities=[90, 90])
    assert plan.durations == (None, None)
    pool.free_blocks(ids, plan)
    assert [pool.policy.retention_of(b, pool.clock()) for b in ids] == [90, 90]
    with pytest.raises(RetentionError, match="got 2 priorities and 1 durations"):
        BlockRetention([90, 90], [None])
    with pytest.raises(RetentionError, match="got 0 priorities and 1 durations"):
        BlockRetention([], [5.0])


def test_a_request_the_manager_refuses_leaves_the_scheduler_working() -> None:
    # the request was queued before the manager checked it: every later schedule() raised its error
    sched = Scheduler(KVCacheManager(8, 4))
    assert sched.add_request(Request("good", [1, 2, 3, 4, 5], 2))
    with pytest.raises(ValueError, match=r"^request 'bad': token id 18446744073709551616 does not fit"):
        sched.add_request(Request("bad", [1, 2, 3, 2**64], 2))
    assert "bad" not in sched.requests and sched.kv.get_num_free_blocks() == 8
    out = sched.schedule()
    assert [c.request_id for c in out.chunks] == ["good"]
    assert sched.add_request(Request("bad", [1, 2, 3, 4], 2))  # (the id is free again)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"max_num_batched_tokens": math.nan}, "max_num_batched_tokens must be an integer >= 1, got nan"),
        ({"max_num_batched_tokens": 2.5}, "max_num_batched_tokens must be an integer >= 1, got 2.5"),
        ({"max_num_seqs": math.nan}, "max_num_seqs must be an integer >= 1"),
        ({"max_num_seqs": True}, "max_num_seqs must be an integer >= 1, got True"),
        ({"enable_chunked_prefill": "no"}, "enable_chunked_prefill must be True or False"),
    ],
)
def test_scheduler_settings_that_would_stall_or_crash_are_refused(
    kwargs: dict[str, object], words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        (
            {"arrival_time": math.nan},
            ValueError,
            "request 'r': arrival_time must be a finite number >= 0, got nan",
        ),
        ({"arrival_time": math.inf}, ValueError, "arrival_time must be a finite number >= 0, got inf"),
        ({"max_tokens": 1.5}, ValueError, "request 'r': max_tokens must be an integer >= 1, got 1.5"),
        ({"max_tokens": True}, ValueError, "request 'r': max_tokens must be an integer >= 1, got True"),
        ({"priority": None}, TypeError, "request 'r': priority must be an integer"),
        ({"priority": 1.5}, TypeError, "request 'r': priority must be an integer"),
    ],
)
def test_request_fields_that_break_the_queue_are_refused(
    kwargs: dict[str, object], error: type[Exception], words: str
) -> None:
    args: dict[str, object] = {"max_tokens": 1} | kwargs
    with pytest.raises(error, match=words):
        Request("r", [1, 2, 3], **args)  # type: ignore[arg-type]


def test_a_bad_clock_reading_takes_nothing() -> None:
    # the empty blocks were taken before the clock was read: a NaN lost them for good
    now = [0.0]
    pool, _ = _cached_free_pool(clock=lambda: now[0])
    empty = pool.get_new_blocks(0)
    assert empty == []
    pool.free_blocks(pool.get_new_blocks(0) or [])
    # two of four blocks empty, two cached-free: an allocation of three must evict, so it reads the clock
    ids = pool.get_new_blocks(2)
    assert ids is not None
    pool.free_blocks(ids)
    before = pool.get_num_free_blocks()
    now[0] = math.nan
    with pytest.raises(ValueError, match="clock returned nan"):
        pool.get_new_blocks(pool.get_num_free_blocks())
    assert pool.get_num_free_blocks() == before == 4
    pool.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "priority", "unified"])
def test_a_clock_reading_that_is_no_float_is_converted_or_refused_before_the_pool_changes(
    policy: str,
) -> None:
    """The pool checked only ``now - now != 0``: a Decimal, an int past a float's range or a complex passed, and
    the priority policies failed on it after the pool had released the blocks (integrity broken); a str or None
    failed with "unsupported operand type(s) for -"."""
    from decimal import Decimal

    now: list[object] = [Decimal("1.5")]
    pool = BlockPool(3, make_policy(policy, 3), clock=lambda: now[0])
    ids = pool.get_new_blocks(2)
    assert ids is not None
    pool.cache_blocks(ids, [1, 2], 0, 2)
    pool.free_blocks(ids, BlockRetention([80, 90], [1.0, 2.0]))  # (a Decimal is a number of seconds)
    pool.check_integrity()
    assert pool.touch(ids) is None
    for bad in (10**400, 1j, "1", None, True):
        now[0] = bad
        with pytest.raises(ValueError, match=r"the pool's clock returned .*; it must return a finite number"):
            pool.free_blocks(ids, BlockRetention([80, 90], [1.0, 2.0]))
        assert pool.ref_cnt[:2] == [1, 1]
        pool.check_integrity()
    now[0] = 3
    pool.free_blocks(ids)
    pool.check_integrity()


def test_an_observer_that_raises_leaves_the_pool_consistent() -> None:
    # an on_evict that raised mid-eviction left the victim in use with its hash dropped (integrity broken)
    for hook in ("on_evict", "on_evict_batch"):
        pool, _ = _cached_free_pool()

        def boom(*_: object) -> None:
            raise RuntimeError("observer failed")

        setattr(pool, hook, boom)
        with pytest.raises(RuntimeError, match="observer failed"):
            pool.get_new_blocks(2)
        pool.check_integrity()
        assert pool.get_num_free_blocks() == 4 and pool.ref_cnt == [0, 0, 0, 0]
        assert pool.num_evictions == 2  # (the content is gone; the allocation did not happen)
        setattr(pool, hook, None)
        assert pool.get_new_blocks(4) is not None
        pool2, _ = _cached_free_pool()
        setattr(pool2, hook, boom)
        with pytest.raises(RuntimeError):
            pool2.reset_prefix_cache()
        pool2.check_integrity()
        assert pool2.get_num_free_blocks() == 4 and not pool2.cached


def test_a_policy_object_with_a_config_beside_it_is_refused() -> None:
    with pytest.raises(ValueError, match="config is for a policy named by string"):
        KVCacheManager(8, 4, policy=make_policy("unified", 8), config=PolicyConfig(budget=0.1))
    with pytest.raises(
        ValueError, match=r"config.block_size \(32\) differs from the manager's block_size \(4\)"
    ):
        KVCacheManager(8, 4, policy=make_policy("unified", 8, PolicyConfig(block_size=32)))
    assert (
        KVCacheManager(8, 32, policy=make_policy("unified", 8, PolicyConfig(block_size=32))).block_size == 32
    )


def test_inspection_refuses_ids_outside_the_pool() -> None:
    pool, _ = _cached_free_pool()
    for bad in (-1, 4):
        with pytest.raises(ValueError, match=rf"ref_count: block id {bad} is not a block of this pool"):
            pool.ref_count(bad)
        with pytest.raises(ValueError, match=rf"hash_of: block id {bad} is not a block of this pool"):
            pool.hash_of(bad)
    assert pool.ref_count(3) == 0 and pool.hash_of(3) is not None
    with pytest.raises(PoolIntegrityError):  # (the check still finds real corruption)
        pool._num_cached_free += 1
        pool.check_integrity()
