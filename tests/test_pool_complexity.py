"""Every pool operation is O(1) or O(log n) in the pool size: the Python-level work per block operation (bytecodes
executed, a deterministic count) must not grow with the pool.

The operation mix is ``bench/pool_ops.py``'s (hot sessions under a shared system prompt plus one-shot chains;
lookups, touches, allocations with eviction, caching and deepest-first release), run by that script's own driver
with its bytecode counter, on pools 16x apart. An accidental scan of the pool or of a queue on a hot path
multiplies the count by up to 16; work done inside one C call (a dict probe, a heap sift) counts as one
bytecode, so this catches Python-level growth only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import pool_ops


def _bytecodes_per_op(policy: str, num_blocks: int, timed_block_ops: int = 3000) -> float:
    warm_requests = int(2.5 * num_blocks / 25)  # the pool filled twice over, as the bench does
    seq = pool_ops.make_sequence(warm_requests + timed_block_ops // 25, 0, num_blocks)
    counter = pool_ops.OpcodeCounter()
    _, ops = pool_ops.run_kvretain(policy, num_blocks, seq[:warm_requests], seq[warm_requests:], counter)
    assert ops >= timed_block_ops // 2
    return counter.count / ops


@pytest.mark.parametrize("policy", ["lru", "lfu", "priority", "unified", "s3fifo", "arc"])
def test_work_per_block_op_does_not_grow_with_the_pool(policy: str) -> None:
    small = _bytecodes_per_op(policy, 512)
    large = _bytecodes_per_op(policy, 8192)
    assert small > 20  # the counter saw the pool's code
    assert 0.9 < large / small < 1.1, f"{policy}: {small:.1f} -> {large:.1f} bytecodes per block op"
