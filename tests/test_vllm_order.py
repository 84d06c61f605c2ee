"""The plugin's free queues list and walk their free blocks in eviction order, as vLLM's own queue does.

vLLM's ``FreeKVCacheBlockQueue.get_all_free_blocks()`` (used by vLLM's tests) and ``iter_blocks_after(cursor)``
(walked by vLLM's lazy CPU offload to store the blocks about to be evicted) follow the order the queue evicts
in. Each policy and both ``unified`` granularities are driven through vLLM 0.33's real ``KVCacheManager`` with
random requests (shared prefixes, hits, evictions, a moving clock, directives that lapse), then the listing is
compared with what the queue actually evicts when every free block is taken (``popleft_n``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is tested in .venv-vllm (scripts/test_vllm.sh)")

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

import kvretain.integrations.vllm as plugin
from kvretain.core.retention import PriorityMapping
from kvretain.integrations.vllm.config import PluginConfig, parse_options

BLOCK = 4
QUEUES = [
    ("lru", "block"),
    ("priority", "block"),
    ("lfu", "block"),
    ("unified", "block"),
    ("unified", "run"),
]


@pytest.fixture
def clock() -> Iterator[list[float]]:
    t = [0.0]
    plugin.set_clock(lambda: t[0])
    yield t
    plugin.set_clock(None)
    plugin.disable()
    plugin.reset_stats()


def manager(policy: str, granularity: str, num_blocks: int, options: str = "") -> KVCacheManager:
    plugin.disable()
    plugin.enable(
        PluginConfig(
            policy=policy, options=parse_options(options), mapping=PriorityMapping(), granularity=granularity
        )
    )
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32),
            )
        ],
    )
    kvm = KVCacheManager(
        config, max_model_len=256, scheduler_block_size=BLOCK, hash_block_size=BLOCK, enable_caching=True
    )
    assert type(kvm.block_pool.free_block_queue).__name__ != "FreeKVCacheBlockQueue"
    return kvm


def make_request(rid: str, prompt: list[int], priority: int, extra: dict[str, Any] | None = None) -> Request:
    init_none_hash(sha256)
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=4, extra_args=extra),
        pooling_params=None,
        priority=priority,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def admit(kvm: KVCacheManager, req: Request) -> bool:
    hit, num_hit, _ = kvm.get_computed_blocks(req)
    new = req.num_tokens - num_hit
    if kvm.allocate_slots(req, new, num_hit, hit) is None:
        return False
    req.num_computed_tokens = req.num_tokens
    return True


def workload(kvm: KVCacheManager, rng: random.Random, clock: list[float], steps: int) -> list[Request]:
    """Random admissions and releases over a few shared prefixes; returns the requests still running."""
    running: list[Request] = []
    for step in range(steps):
        clock[0] += rng.choice([0.0, 0.5, 2.0])
        if running and (rng.random() < 0.45 or len(running) > 3):
            kvm.free(running.pop(rng.randrange(len(running))))
            continue
        session = rng.randrange(4)
        prompt = [1000 * session + i for i in range(BLOCK * rng.randint(0, 6))]
        prompt += [rng.randrange(50_000, 60_000) for _ in range(rng.randint(1, 3 * BLOCK))]
        extra = None
        if rng.random() < 0.25:
            extra = {
                "retention_directives": [
                    {"start": 0, "end": 2 * BLOCK, "priority": rng.choice([10, 60, 90]), "duration": 1.0}
                ],
                "retention_scope": f"s{session}",
            }
        req = make_request(f"r{step}", prompt, rng.choice([-1, 0, 1, 2]), extra)
        if admit(kvm, req):
            running.append(req)
    return running


@pytest.mark.parametrize(("policy", "granularity"), QUEUES)
@pytest.mark.parametrize("seed", range(12))
def test_listing_and_walk_follow_the_eviction_order(
    policy: str, granularity: str, seed: int, clock: list[float]
) -> None:
    rng = random.Random(seed)
    # a small protection budget and an adaptive target: both tiers compete for the last places
    kvm = manager(policy, granularity, 41, "budget=0.3,isolation_goal=0.9")
    workload(kvm, rng, clock, 60)
    q = kvm.block_pool.free_block_queue
    q.check()
    listed = [b.block_id for b in q.get_all_free_blocks()]
    assert len(listed) == len(set(listed)) == q.num_free_blocks
    assert [b.block_id for b in q.iter_blocks_after(None)] == listed
    for i in sorted(
        rng.sample(range(len(listed)), min(5, len(listed)))
    ):  # a cursor anywhere resumes after it
        assert [b.block_id for b in q.iter_blocks_after(kvm.block_pool.blocks[listed[i]])] == listed[i + 1 :]
    q.check()  # (walking changes nothing)
    assert [b.block_id for b in q.popleft_n(q.num_free_blocks)] == listed


@pytest.mark.parametrize(("policy", "granularity"), [qg for qg in QUEUES if qg[1] == "block"])
def test_per_block_queues_evict_the_listing_one_block_at_a_time(
    policy: str, granularity: str, clock: list[float]
) -> None:
    """Per block, the order does not depend on how many blocks one call takes."""
    rng = random.Random(7)
    kvm = manager(policy, granularity, 41, "budget=0.3,isolation_goal=0.9")
    workload(kvm, rng, clock, 80)
    q = kvm.block_pool.free_block_queue
    listed = [b.block_id for b in q.get_all_free_blocks()]
    got = []
    while q.num_free_blocks:
        got += [b.block_id for b in q.popleft_n(min(q.num_free_blocks, rng.randint(1, 3)))]
    assert got == listed


def test_a_stale_cursor_ends_the_walk(clock: list[float]) -> None:
    kvm = manager("unified", "run", 21)
    req = make_request("a", list(range(3 * BLOCK + 1)), 0)
    assert admit(kvm, req)
    q = kvm.block_pool.free_block_queue
    in_use = kvm.coordinator.get_blocks("a")[0][0]
    assert in_use.ref_cnt == 1
    assert list(q.iter_blocks_after(in_use)) == []
    kvm.free(req)
    cached = [b for b in q.get_all_free_blocks() if b.block_hash is not None]
    assert [b.block_id for b in cached] == [b.block_id for b in reversed(kvm.block_pool.blocks[1:4])], (
        "a request's cached blocks go deepest first, after the unhashed ones"
    )


def test_the_listing_turns_to_unprotected_blocks_once_the_protected_ones_fall_to_the_target(
    clock: list[float],
) -> None:
    """Over the protected target the tiers compete on release order; a protected victim that brings them down
    to the target hands the next places to the unprotected tier (the walk counts the protected ones it takes)."""
    # target 0.1 x 21 = 2.1 blocks; flat weights: every key the same, so only the tiers' turn decides
    kvm = manager("unified", "block", 21, "budget=0.1,isolation_goal=0,priority_weight=1,adapt_frequency=0")
    protected = make_request("p", list(range(3 * BLOCK + 1)), 0)  # retention 35: protected
    unprotected = make_request("u", list(range(100, 100 + 3 * BLOCK + 1)), 1)  # retention 25
    assert admit(kvm, protected) and admit(kvm, unprotected)
    p_ids = [b.block_id for b in kvm.coordinator.get_blocks("p")[0][:3]]
    u_ids = [b.block_id for b in kvm.coordinator.get_blocks("u")[0][:3]]
    kvm.free(protected)
    kvm.free(unprotected)
    q = kvm.block_pool.free_block_queue
    cached = [b.block_id for b in q.get_all_free_blocks() if b.block_hash is not None]
    # three protected blocks are over the target: the oldest release (p's deepest) goes first; the other two
    # are within it, so u's chain goes before them
    assert cached == [p_ids[2], *reversed(u_ids), p_ids[1], p_ids[0]]
    assert [b.block_id for b in q.popleft_n(q.num_free_blocks) if b.block_id in cached] == cached


def test_blocked_blocks_evicted_anyway_are_listed_once_each(clock: list[float]) -> None:
    """A blocked parent evicted anyway (the policy has nothing left) leaves its children's links stale: when its
    blocked child follows it, the walk must not count that child against it and list the parent again."""
    kvm = manager("unified", "block", 21)
    req = make_request("a", list(range(3 * BLOCK + 1)), 0)
    assert admit(kvm, req)
    kvm.free(req)
    q = kvm.block_pool.free_block_queue
    b0, b1, b2 = kvm.block_pool.blocks[1:4]
    assert [b.block_hash is not None for b in (b0, b1, b2)] == [True, True, True]
    for b in (b1, b2):  # hits on the chain's tail alone (duplicate blocks): b0 stays blocked
        q.remove(b)
        b.ref_cnt = 1
    b1.ref_cnt = 0
    q.append_n([b1])  # b1 goes back blocked (b2 is in use), after b0
    q.check()
    cached = [b.block_id for b in q.get_all_free_blocks() if b.block_hash is not None]
    assert cached == [b0.block_id, b1.block_id], "blocked blocks go last, in the order they were blocked"
    assert [b.block_id for b in q.popleft_n(q.num_free_blocks) if b.block_id in cached] == cached


def cached_and_free(policy: str, granularity: str, num_blocks: int, prompt_blocks: int) -> KVCacheManager:
    """A manager of ``num_blocks`` (one of them vLLM's null block) after one request of ``prompt_blocks`` whole
    blocks ran and finished: its blocks cached and free."""
    kvm = manager(policy, granularity, num_blocks)
    req = make_request("a", list(range(prompt_blocks * BLOCK)), 0)
    assert admit(kvm, req)
    kvm.free(req)
    return kvm


@pytest.mark.parametrize(("policy", "granularity"), QUEUES)
def test_evict_blocks_keeps_the_queue_with_what_vllm_stripped_for_a_negative_or_refused_id(
    policy: str, granularity: str, clock: list[float]
) -> None:
    # a KV connector's bad id: vLLM's evict_blocks indexes ``blocks[-1]`` (the last block) and stops at an id it
    # refuses (its assertion, ``bid < len``) with the blocks before it already stripped; the queue must follow
    # both (it kept ranking the last block as cached after ``{-1}``, and lost the stripped ones after a refusal)
    kvm = cached_and_free(policy, granularity, 6, 5)
    pool = kvm.block_pool
    q = pool.free_block_queue
    last = pool.blocks[-1]
    assert last.block_hash is not None
    pool.evict_blocks({-1})
    assert last.block_hash is None
    q.check()
    assert last.block_id in [b.block_id for b in q.get_all_free_blocks()]  # free, unhashed

    ids = [b.block_id for b in pool.blocks if b.block_hash is not None]
    refused = len(pool.blocks) + 1
    bad = {
        ids[0],
        refused,
    }  # (small ints of a small set iterate in value order: the cached id, then the refused)
    assert list(bad) == [ids[0], refused]
    with pytest.raises(AssertionError, match="Invalid block_id"):
        pool.evict_blocks(bad)
    assert pool.blocks[ids[0]].block_hash is None  # vLLM stripped it before refusing the other
    q.check()
    assert q.num_free_blocks == len(pool.blocks) - 1  # (the null block) nothing lost


@pytest.mark.parametrize(("policy", "granularity"), QUEUES)
def test_evict_blocks_vllm_fails_part_way_leaves_the_blocks_it_did_not_reach_in_the_order(
    policy: str, granularity: str, clock: list[float]
) -> None:
    # vLLM's loop fails for a reason of its own (here its metrics collector, on the second block): the blocks it
    # stripped before are free and unhashed, the ones it did not reach keep their hash and their place among the
    # cached free blocks (they went to the unhashed list, to be reused first, as if stripped)
    kvm = cached_and_free(policy, granularity, 8, 6)
    pool = kvm.block_pool
    q = pool.free_block_queue
    ids = [b.block_id for b in pool.blocks if b.block_hash is not None][:3]

    class Collector:
        seen = 0

        def on_block_evicted(self, block: Any) -> None:
            Collector.seen += 1
            if Collector.seen == 2:
                raise RuntimeError("collector failed")

        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: None

    pool.metrics_collector = Collector()
    with pytest.raises(RuntimeError, match="collector failed"):
        pool.evict_blocks(ids)  # (a list: vLLM's order is the list's)
    assert pool.blocks[ids[0]].block_hash is None and pool.blocks[ids[2]].block_hash is not None
    assert all(b.block_hash is None for b in q.unhashed_blocks())
    q.check()
    assert q.num_free_blocks == len(pool.blocks) - 1  # (the null block) nothing lost


@pytest.mark.parametrize(("policy", "granularity"), QUEUES)
def test_evict_blocks_of_a_one_shot_iterable_strips_what_it_names(
    policy: str, granularity: str, clock: list[float]
) -> None:
    # the hook and vLLM both read the ids: a generator used up by the hook left vLLM nothing to strip, and the
    # block, still hashed, on the unhashed list
    kvm = cached_and_free(policy, granularity, 8, 6)
    pool = kvm.block_pool
    bid = next(b.block_id for b in pool.blocks if b.block_hash is not None)
    pool.evict_blocks(i for i in [bid])
    assert pool.blocks[bid].block_hash is None
    pool.free_block_queue.check()
