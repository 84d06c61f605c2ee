"""Every pool operation is O(1) or O(log n) in the pool size: the Python-level work per block operation (bytecodes
executed, a deterministic count) must not grow with the pool.

The operation mix is that of ``bench/pool_ops.py`` (hot sessions under a shared system prompt plus one-shot
chains; lookups, touches, allocations with eviction, caching and deepest-first release) on pools 16x apart.
An accidental scan of the pool or of a queue on a hot path multiplies the count by up to 16; work done inside
one C call (a dict probe, a heap sift) counts as one bytecode, so this catches Python-level growth only.
"""

from __future__ import annotations

import random
import sys
from types import FrameType
from typing import Any

import pytest

from kvretain.core.block_pool import BlockPool
from kvretain.core.policy import PolicyConfig, make_policy
from kvretain.core.retention import BlockRetention


def _sequence(num_requests: int, num_blocks: int, seed: int) -> list[tuple[list[bytes], int]]:
    rng = random.Random(seed)
    counter = 0

    def fresh(n: int) -> list[bytes]:
        nonlocal counter
        counter += n
        return [b"b-%d" % (counter - n + i) for i in range(n)]

    system = [b"sys-%d" % i for i in range(4)]
    hot = [system + fresh(rng.randint(12, 28)) for _ in range(max(4, num_blocks // 10 // 24))]
    out = []
    for _ in range(num_requests):
        if rng.random() < 0.5:
            out.append((rng.choice(hot) + fresh(rng.randint(2, 8)), 0))
        else:
            out.append((system + fresh(rng.randint(8, 40)), 1))
    return out


def _bytecodes_per_op(policy: str, num_blocks: int, timed_requests: int = 120) -> float:
    warm_requests = int(2.5 * num_blocks / 25)
    seq = _sequence(warm_requests + timed_requests, num_blocks, seed=0)
    now = [0.0]
    pool = BlockPool(num_blocks, make_policy(policy, num_blocks, PolicyConfig()), clock=lambda: now[0])

    def one(chain: list[bytes], prio: int) -> int:
        hits = []
        for h in chain:
            b = pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        pool.touch(hits)
        new = pool.get_new_blocks(len(chain) - len(hits))
        assert new is not None
        ids = hits + new
        pool.cache_blocks(ids, chain, len(hits), len(chain))
        pool.free_blocks(ids, BlockRetention([], [], None, prio, 35 - 10 * prio))
        now[0] += 0.001
        return len(chain)

    for chain, prio in seq[:warm_requests]:
        one(chain, prio)
    count = 0

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "opcode":
            count += 1
        return local

    def global_trace(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return local

    ops = 0
    previous = sys.gettrace()
    sys.settrace(global_trace)
    try:
        for chain, prio in seq[warm_requests:]:
            ops += one(chain, prio)
    finally:
        sys.settrace(previous)
    pool.check_integrity()
    assert pool.num_evictions > 0
    return count / ops


@pytest.mark.parametrize("policy", ["lru", "lfu", "priority", "unified"])
def test_work_per_block_op_does_not_grow_with_the_pool(policy: str) -> None:
    small = _bytecodes_per_op(policy, 512)
    large = _bytecodes_per_op(policy, 8192)
    assert small > 20  # the counter saw the pool's code
    assert 0.9 < large / small < 1.1, f"{policy}: {small:.1f} -> {large:.1f} bytecodes per block op"
