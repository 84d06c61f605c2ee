"""kvretain.sched + kvretain.core schedule exactly as vLLM 0.33's scheduler + KV cache manager.

``bench/sched_equivalence.py``'s two drivers on a small synthetic workload that exercises chunked prefill,
prefix hits, evictions and preemptions (fcfs and priority; ``lru`` against stock vLLM, ``unified`` against
the plugin). Needs vLLM: run by ``scripts/test_vllm.sh``.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed in this environment; scripts/test_vllm.sh runs these tests in .venv-vllm",
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import _vllm_harness as harness
import sched_equivalence as eq

BLOCK = 16


def workload(n: int = 80) -> list[eq.Spec]:
    """Four shared system prompts, conversations that come back with their history, two classes, bursts."""
    rng = random.Random(3)
    systems = [[rng.randrange(1, 1000) for _ in range(4 * BLOCK)] for _ in range(4)]
    history: dict[int, list[int]] = {}
    specs = []
    for i in range(n):
        conv = rng.randrange(12)
        prompt = history.get(conv) or list(systems[conv % 4])
        prompt = prompt + [rng.randrange(1, 1000) for _ in range(rng.randrange(10, 120))]
        history[conv] = prompt[:400]
        step = i // 4
        specs.append(
            eq.Spec(
                rid=f"r{i:03d}",
                prompt=prompt[:400],
                max_tokens=rng.randrange(2, 40),
                priority=0 if conv % 3 == 0 else 1,
                arrival_s=step * 0.05,
                arrival_step=step,
            )
        )
    return specs


def args(policy: str, granularity: str = "block") -> argparse.Namespace:
    return argparse.Namespace(
        policy=policy,
        granularity=granularity,
        block_size=BLOCK,
        pool_blocks=64,
        max_num_seqs=8,
        max_batched_tokens=128,
        max_model_len=512,
        step_ms=50.0,
        max_steps=20_000,
    )


def run_both(tmp_path: Path, a: argparse.Namespace, queue: str) -> dict[str, object]:
    specs = workload()
    model_dir = harness.write_tiny_model(tmp_path, vocab_size=1000, max_len=a.max_model_len)
    k = eq.run_kvretain(specs, a, queue)
    v = eq.run_vllm(specs, a, queue, model_dir)
    assert v.preemptions > 0 and v.hit_tokens > 0, "the workload must preempt and hit"
    return eq.compare(k, v)


@pytest.mark.parametrize("queue", ["fcfs", "priority"])
def test_lru_matches_stock_vllm_on_every_step(tmp_path: Path, queue: str) -> None:
    res = run_both(tmp_path, args("lru"), queue)
    assert res["first_divergence"] is None, res
    assert res["identical_steps"] == res["steps"]


@pytest.mark.parametrize("queue", ["fcfs", "priority"])
@pytest.mark.parametrize("granularity", ["run", "block"])
def test_unified_hits_match_the_plugin(tmp_path: Path, granularity: str, queue: str) -> None:
    """Not step-identical on this workload (it diverges by one block's hit after 140-232 steps, except
    block granularity under fcfs): the run queue ranks runs, not blocks, and this workload computes
    duplicate blocks (two requests computing the same uncached prefix at once), which vLLM registers and
    kvretain's pool does not. Hit tokens stay within 2%."""
    res = run_both(tmp_path, args("unified", granularity), queue)
    assert 0.98 <= res["hit_tokens_vs_vllm"] <= 1.02, res  # type: ignore[operator]
