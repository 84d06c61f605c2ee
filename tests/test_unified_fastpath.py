"""``UnifiedPolicy.pop_exposed`` evicts an exposed parent without queueing it; it must choose exactly the victim
that ``expose`` followed by ``pop`` would choose. Random request programs run through two pools, one with the
fused path and one with the contract's plain ``expose`` + ``pop``, and must evict the same blocks in the same
order, with the same cache afterwards.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvretain.core import BlockPool, BlockRetention, PolicyConfig, make_policy
from kvretain.core.policies import UnifiedPolicy, rules
from kvretain.core.policies.unified import _Meta, _Queue
from kvretain.core.policy import EvictionPolicy


class _Unfused(UnifiedPolicy):
    """``unified`` without the fused path: the contract's default ``pop_exposed``."""

    def pop_exposed(self, block_id: int, now: float) -> int | None:
        return EvictionPolicy.pop_exposed(self, block_id, now)


STEP = st.one_of(
    st.tuples(
        st.just("start"),
        st.builds(  # a chain: one of a few shared prefixes, then its own blocks
            lambda head, tail: head + tail,
            st.sampled_from([[0], [0, 1], [0, 1, 2], [3], [3, 4]]),
            st.lists(st.integers(0, 5), max_size=6),
        ),
        st.sampled_from([15, 25, 35, 45, 80]),  # retention priority of the release
        st.one_of(st.none(), st.sampled_from([0.5, 2.0])),  # duration
    ),
    st.tuples(st.just("finish"), st.just([]), st.integers(0, 7), st.none()),  # which live request
    st.tuples(st.just("tick"), st.just([]), st.just(0), st.none()),
)
CONFIGS = st.sampled_from(
    [
        PolicyConfig(budget=0.0, isolation_goal=None),  # tiers always compete on keys
        PolicyConfig(budget=0.3, isolation_goal=None),
        PolicyConfig(budget=1.0, isolation_goal=None),  # unprotected always first
        PolicyConfig(budget=0.5, isolation_goal=0.9, block_size=512),
        PolicyConfig(budget=0.0, isolation_goal=None, priority_weight=1.0),  # equal keys across the tiers
        PolicyConfig(budget=0.3, isolation_goal=None, priority_weight=1.0),
    ]
)


def _run(
    policy: EvictionPolicy, program: list[tuple[str, list[int], int, float | None]]
) -> tuple[list, dict]:
    n = policy.num_blocks
    now = [0.0]
    pool = BlockPool(n, policy, clock=lambda: now[0])
    evicted: list[int] = []
    pool.on_evict = lambda bid, h: evicted.append(int(h))
    live: list[tuple[list[int], int, float | None]] = []
    for op, chain, prio, dur in program:
        if op == "start":
            if len(live) >= 3:  # at most three requests run at once: the rest of the pool is cached
                ids0, prio0, dur0 = live.pop(0)
                pool.free_blocks(ids0, BlockRetention([prio0] * len(ids0), [dur0] * len(ids0), None, 0, 35))
            hashes = []
            h = 0
            for x in chain:  # chained: a block's hash depends on its whole prefix
                h = h * 7 + x + 1
                hashes.append(h)
            k = 0
            while k < len(hashes) and hashes[k] in pool.cached:
                k += 1
            hits = [pool.cached[x] for x in hashes[:k]]
            pool.touch(hits)
            new = pool.get_new_blocks(len(hashes) - k)
            if new is None:
                pool.free_blocks(hits)
                continue
            ids = hits + new
            pool.cache_blocks(ids, hashes, k, len(hashes))
            live.append((ids, prio, dur))
        elif op == "finish" and live:
            ids, prio, dur = live.pop(prio % len(live))  # (prio: the index drawn for this step)
            pool.free_blocks(ids, BlockRetention([prio] * len(ids), [dur] * len(ids), None, 0, 35))
        elif op == "tick":
            now[0] += 0.75
        pool.check_integrity()
    return evicted, dict(pool.cached)


@settings(max_examples=1500, deadline=None, database=None)
@given(program=st.lists(STEP, min_size=1, max_size=80), config=CONFIGS)
def test_fused_pop_exposed_evicts_exactly_what_expose_then_pop_would(
    program: list[tuple[str, list[int], int, float | None]], config: PolicyConfig
) -> None:
    fused = make_policy("unified", 12, config)
    assert type(fused) is UnifiedPolicy
    assert _run(fused, program) == _run(_Unfused(12, config), program)


class _Unbatched(UnifiedPolicy):
    """``unified`` told of each registration alone (as the vLLM plugin tells it), not of a request's run."""

    def on_cached_run(self, block_ids, hashes, start, end, now):  # type: ignore[no-untyped-def]
        for i in range(start, end):
            UnifiedPolicy.on_cached_run(self, {i: block_ids[i]}, {i: hashes[i]}, i, i + 1, now)


@settings(max_examples=500, deadline=None, database=None)
@given(program=st.lists(STEP, min_size=1, max_size=80), config=CONFIGS)
def test_a_run_of_registrations_sets_what_one_by_one_would(
    program: list[tuple[str, list[int], int, float | None]], config: PolicyConfig
) -> None:
    # the pool announces a request's registrations in one on_cached_run (a fused loop that carries a segment's
    # restored use count from block to block); one by one, the policy must end in the same state
    batched = make_policy("unified", 12, config)
    single = _Unbatched(12, config)
    assert _run(batched, program) == _run(single, program)
    meta = [(m.uses, m.depth, m.content, m.stamp) for m in batched._meta]  # type: ignore[attr-defined]
    assert meta == [(m.uses, m.depth, m.content, m.stamp) for m in single._meta]


# Programs where the exposed parent must wait although a child was just evicted, each against the one check of
# the fused path that makes it wait (the random programs above rarely build them). Hashes, as _run chains them:
# [0] -> 1, [0, 1] -> 9, [5] -> 6, [7] -> 8. _FILL needs 11 new blocks in a pool of 12 with 3 cached: two
# evictions, the second one right after the child's.
_FLAT = {"isolation_goal": None, "priority_weight": 1.0, "adapt_frequency": False}
_FILL = ("start", list(range(10, 21)), 35, None)
_END = ("finish", [], 0, None)
_WAITS = {
    # used twice, released last: the parent's bucket is above an older unprotected block's (the full check:
    # its own tier's first bucket)
    "released again later, own tier": (
        PolicyConfig(budget=0.0, **_FLAT),
        [("start", [0, 1], 15, None), _END, ("start", [7], 15, None), _END, ("start", [0], 15, None), _END],
        [9, 8],
    ),
    # ... above an older block of the other tier, which competes with it (no protected share)
    "released again later, protected parent": (
        PolicyConfig(budget=0.0, **_FLAT),
        [("start", [0, 1], 15, None), _END, ("start", [7], 15, None), _END, ("start", [0], 80, None), _END],
        [9, 8],
    ),
    "released again later, unprotected parent": (
        PolicyConfig(budget=0.0, **_FLAT),
        [("start", [0, 1], 15, None), _END, ("start", [7], 80, None), _END, ("start", [0], 15, None), _END],
        [9, 8],
    ),
    # ... in the same bucket (flat weights, recency): the parent's later release puts it behind the other block
    "released again later, same key": (
        PolicyConfig(budget=0.0, frequency_exponent=0.0, **_FLAT),
        [("start", [0, 1], 15, None), _END, ("start", [7], 15, None), _END, ("start", [0], 15, None), _END],
        [9, 8],
    ),
    # released right after the child but with a higher key (a second use): not the child's successor in the queue
    "right after the child, another key": (
        PolicyConfig(budget=0.0, **_FLAT),
        [("start", [0], 15, None), _END, ("start", [0, 1], 15, None), _END, ("start", [7], 15, None), _END],
        [9, 8],
    ),
    # released right after the child with the same key, but protected (an earlier release at 80; highest wins)
    # while the child went on the unprotected tier's turn: the protected tier's older block goes first
    "right after the child, another tier": (
        PolicyConfig(budget=1.0, frequency_exponent=0.0, **_FLAT),
        [("start", [5], 80, None), _END, ("start", [0], 80, None), _END, ("start", [0, 1], 15, None), _END],
        [9, 6],
    ),
}


@pytest.mark.parametrize("case", list(_WAITS))
def test_an_exposed_parent_that_is_not_next_waits(case: str) -> None:
    config, program, want = _WAITS[case]
    evicted, _ = _run(make_policy("unified", 12, config), [*program, _FILL])
    assert evicted == want
    assert _run(_Unfused(12, config), [*program, _FILL])[0] == want


def test_an_exposed_parent_waits_where_a_walk_left_its_bucket_out_of_release_order(monkeypatch) -> None:
    """A push whose walk runs out (``RELEASE_ORDER_WALK`` links, here 3) leaves its block behind later releases:
    that bucket is out of release order, and a parent exposed there goes where ``push``'s walk puts it, not first.
    Here x, released before the chain m <- v, is pushed back (its child xc evicted) behind v and three later
    blocks; the fused path took m, released right after v, before x (found by review; before the fix the fused
    run evicted [xc, a, v, m, x])."""
    monkeypatch.setattr(rules, "RELEASE_ORDER_WALK", 3)
    config = PolicyConfig(budget=0.0, isolation_goal=None, priority_weight=1.0, adapt_frequency=False)
    a, x, xc, m, v, ys = [1000], [2000], [2000, 1], [3000], [3000, 2], [[4000 + i] for i in range(3)]
    program: list[tuple[str, list[int], int, float | None]] = []
    for chains in ([a, x, m + v[1:], *ys], [a, xc, m + v[1:], *ys]):  # second uses: all but xc at two uses
        for chain in chains:
            program += [("start", chain, 15, None), _END]
    program.append(("start", [5000, 1, 2, 3, 4], 15, None))  # five evictions in one allocation
    hashes = {"a": 1001, "x": 2001, "xc": 2001 * 7 + 2, "m": 3001, "v": 3001 * 7 + 3}
    want = [hashes[k] for k in ("xc", "a", "v", "x", "m")]
    assert _run(make_policy("unified", 8, config), program)[0] == want
    assert _run(_Unfused(8, config), program)[0] == want


@pytest.mark.parametrize("fused", [True, False])
def test_a_parent_exposed_into_an_out_of_order_bucket_goes_where_push_puts_it(
    monkeypatch, fused: bool
) -> None:
    """The full check (a parent that is not the victim's successor) in a bucket a walk left out of order: its
    first block y1 is a later release than the parent m, but its last, x, an earlier one, so ``push`` puts m at
    the back and y1 goes first (without the ``late`` check the fused path took m)."""
    monkeypatch.setattr(rules, "RELEASE_ORDER_WALK", 3)
    config = PolicyConfig(budget=0.0, isolation_goal=None, priority_weight=1.0, adapt_frequency=False)
    config = dataclasses.replace(config, frequency_exponent=0.0)  # one bucket: every key L + 1
    pol = make_policy("unified", 8, config) if fused else _Unfused(8, config)
    h0, x, m, y1, y2, y3, y4 = range(7)
    for b in range(7):
        pol.on_cached(b, b.to_bytes(8, "little"), 0, 0.0)  # type: ignore[arg-type]
    for b in (h0, x, m, y1, y2, y3, y4):  # released in this order; m stays in use (a cached child)
        pol.on_release(b, 35, None, None, 0.0, 35)
        if b != m:
            pol.push(b, 0.0)
    pol.remove(x)
    pol.expose(x, 0.0)  # back at its release's place: the walk (3 links) runs out behind y1
    for b in (y2, y3, y4):
        pol.remove(b)
    assert pol.pop(0.0) == h0  # the bucket: y1, x
    assert pol.pop_exposed(m, 0.0) == y1
    assert [pol.pop(0.0), pol.pop(0.0), pol.pop(0.0)] == [x, m, None]


QUEUE_OPS = st.lists(
    st.one_of(
        # (op, block, key in 1/16 units (few values: buckets fill), an older release: its stamp back by this)
        st.tuples(st.just("push"), st.integers(0, 39), st.integers(0, 12), st.integers(0, 60)),
        st.tuples(st.just("unlink"), st.integers(0, 39), st.just(0), st.just(0)),
        st.tuples(st.just("pop"), st.just(0), st.just(0), st.just(0)),
    ),
    max_size=300,
)


@settings(max_examples=300, deadline=None)
@given(QUEUE_OPS)
def test_bucket_queue_matches_a_list_model(ops: list[tuple[str, int, int, int]]) -> None:
    """``unified``'s bucket queue pops by key bucket, in release order (``stamp``) inside a bucket, through any mix
    of pushes at the newest release and at older ones (an exposed parent, a lapse), removals (which empty buckets
    and trigger compactions) and pops; a block whose place is more than ``WALK`` links from the back goes
    ``WALK`` links from the back (``rules.release_order_place``, the run queue's rule; here ``WALK`` is 3, so
    that the bound is reached)."""
    saved = rules.RELEASE_ORDER_WALK
    rules.RELEASE_ORDER_WALK = 3
    try:
        q = _Queue(16.0)
        metas = [_Meta(i) for i in range(40)]
        model: dict[int, list[int]] = {}  # bucket -> block ids in pop order
        where: dict[int, int] = {}  # queued block -> bucket
        clock = 1000
        for op, b, key, older in ops:
            if op == "push" and b not in where:
                clock += 1
                m = metas[b]
                m.since = key / 16.0 + 0.01  # (its key: since + value)
                m.stamp = clock - older
                q.push(m)
                s = int(m.since * 16.0)
                bucket = model.setdefault(s, [])
                at = rules.release_order_place(len(bucket), m.stamp, lambda i, bk=bucket: metas[bk[i]].stamp)
                bucket.insert(at, b)
                where[b] = s
            elif op == "unlink" and b in where:
                q.unlink(metas[b])
                model[where.pop(b)].remove(b)
            elif op == "pop" and where:
                s = min(k for k, v in model.items() if v)
                want = model[s].pop(0)
                assert q.pop().block_id == want
                del where[want]
            assert q.n == len(where)
            assert all(metas[i].prev is not None for i in where)
        live = sorted(k for k, v in model.items() if v)
        assert len(q._buckets) <= len(live) + 64 + len(q._buckets) // 2
    finally:
        rules.RELEASE_ORDER_WALK = saved


def test_bucket_queue_compacts_buckets_emptied_by_removals() -> None:
    """A queue that is never popped while keys keep rising does not keep every bucket it ever opened."""
    q = _Queue(16.0)
    keep = _Meta(0)
    q.push(keep)  # (key 0: since + value)
    for i in range(1, 20_000):
        m = _Meta(i)
        m.since = float(i)
        q.push(m)
        q.unlink(m)
    assert len(q._buckets) < 200 and len(q._slots) == len(q._buckets)
    assert q.pop() is keep and q.n == 0


def test_a_release_keys_a_block_from_shared_values_and_again_when_the_tables_change() -> None:
    """A block's key is the ``L`` of its release plus its value under the current tables (``rules.gd_key``).
    Blocks released at one retention and use count share one value object (a release stores no float of its own:
    the one it replaced would be a cold object at 10^5-10^6 blocks), and a change of tables (the controller's
    level softening the weights) keys every cached block again from its release's ``L``."""
    pol = make_policy("unified", 8, PolicyConfig(budget=0.0, isolation_goal=None))
    assert isinstance(pol, UnifiedPolicy)
    pool = BlockPool(8, pol, clock=lambda: 0.0)
    held = []
    for chain, r in (([b"a", b"b"], 45), ([b"c", b"d"], 45), ([b"e"], 25)):
        ids = pool.get_new_blocks(len(chain))
        assert ids is not None
        pool.cache_blocks(ids, chain, 0, len(chain))
        pool.free_blocks(ids, BlockRetention(base_priority=r))
        held += ids
    meta = pol._meta

    def want(b: int) -> float:
        m = meta[b]
        return rules.gd_key(m.since, pol._weight[m.r], pol._F[m.uses], m.depth, pol._cost_per_block)

    assert meta[held[0]].value is meta[held[2]].value  # retention 45, one use: one shared value
    assert [pol.key_of(b) for b in held] == [want(b) for b in held]
    before = [pol.key_of(b) for b in held]
    pol._weight = rules.retention_weights(pol.config.priority_weight, 0.5)
    pol._rekey()
    assert [pol.key_of(b) for b in held] == [want(b) for b in held]
    after = [pol.key_of(b) for b in held]
    assert [k < k0 for k, k0 in zip(after, before, strict=True)] == [True, True, True, True, False]
