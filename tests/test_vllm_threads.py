"""The plugin's hooks on vLLM's two engine-core threads (the input thread preprocesses a request, the busy loop
schedules, resets and evicts) and its error isolation (review 34). Needs vLLM 0.33 (.venv-vllm)."""

from __future__ import annotations

import random
import sys
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is tested in .venv-vllm (scripts/test_vllm.sh)")

from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.core import EngineCore

import kvretain.integrations.vllm as plugin
from kvretain.integrations.vllm._base import SIGHTING
from kvretain.integrations.vllm._runtime import OTHER_PRIORITY, PriorityLabels
from kvretain.integrations.vllm.config import PluginConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import _vllm_harness as harness

BLOCK = 16
GRANULARITY = pytest.mark.parametrize("granularity", ["run", "block"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return harness.write_tiny_model(tmp_path_factory.mktemp("tiny"), vocab_size=1000, max_len=4096)


@pytest.fixture(autouse=True)
def _plugin_off() -> Iterator[None]:
    plugin.disable()
    plugin.reset_stats()
    yield
    plugin.disable()
    plugin.reset_stats()


def _prompt() -> list[int]:
    rng = random.Random(zlib.crc32(b"shared"))
    return [rng.randrange(1, 1000) for _ in range(70)]  # 4 full blocks


def _engine(model_dir: str, granularity: str) -> tuple[Any, Any, Any]:
    plugin.enable(PluginConfig(policy="unified", granularity=granularity))
    sched = harness.build_scheduler(
        model_dir, num_blocks=64, block_size=BLOCK, max_num_seqs=8, max_batched_tokens=256, max_model_len=1024
    )
    core = SimpleNamespace(
        mm_receiver_cache=None,
        request_block_hasher=harness.block_hasher(BLOCK),
        structured_output_manager=None,
        scheduler=sched,
    )
    return sched, core, sched.kv_cache_manager.block_pool.free_block_queue


def _arrive(core: Any, rid: str, tokens: list[int] | None = None) -> Any:
    """EngineCore.preprocess_add_request, as vLLM's input thread runs it (patched by the plugin)."""
    ecr = EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=_prompt() if tokens is None else tokens,
        mm_features=None,
        sampling_params=SamplingParams(max_tokens=2, ignore_eos=True),
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )
    return EngineCore.preprocess_add_request(core, ecr)[0]


def _drive(sched: Any, req: Any) -> int:
    sched.add_request(req)
    hit = None
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for nr in out.scheduled_new_reqs:
            hit = nr.num_computed_tokens if hit is None else hit
        sched.update_from_output(out, harness.runner_output(sched, out))
    return int(hit or 0)


def _ctl(q: Any, granularity: str) -> Any:
    return q._ctl if granularity == "run" else q.policy._ctl


@GRANULARITY
def test_a_request_sighted_before_reset_prefix_cache_enters_the_new_controllers_shadows(
    model_dir: str, granularity: str
) -> None:
    """reset_prefix_cache (a utility call on the busy loop) rebuilds the controller; a request the input
    thread had already preprocessed carries the old controller's Sighting, which the new one accepts, so the new
    shadows never see its blocks and the next request with that prompt is an LRU-shadow miss although vLLM hits."""
    sched, core, q = _engine(model_dir, granularity)
    a = _arrive(core, "a")  # input thread
    assert sched.reset_prefix_cache()  # busy loop, before a is scheduled
    _drive(sched, a)
    assert (
        len(_ctl(q, granularity)._lru.entries) == 4
    )  # (it read 0: the new controller took the old one's sighting)
    b = _arrive(core, "b")
    seen = getattr(b, SIGHTING)
    assert _drive(sched, b) == 4 * BLOCK
    assert (
        seen.lru_hits == 4
    )  # (it read 0: the new controller took the old one's sighting) (the pool hit 4 blocks, LRU "would have hit" none)
    q.check()


@pytest.mark.parametrize(
    "hook,method", [("reset_prefix_cache", "_eviction_order"), ("evict_blocks", "forget")]
)
def test_an_error_in_the_reset_or_evict_hook_is_counted_not_raised_into_vllm(
    model_dir: str, hook: str, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection. README: errors inside the plugin's hooks never reach vLLM and are counted."""
    sched, core, q = _engine(model_dir, "run")
    _drive(sched, _arrive(core, "a"))
    cached = [b.block_id for b in sched.kv_cache_manager.block_pool.blocks if b.block_hash is not None]

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected")

    monkeypatch.setattr(type(q), method, boom)
    if hook == "reset_prefix_cache":
        sched.reset_prefix_cache()  # (it raised into vLLM's Scheduler.reset_prefix_cache)
    else:
        sched.kv_cache_manager.evict_blocks({cached[0]})  # (it raised: on the busy loop the engine dies)
    assert sum(plugin.stats()["hook_errors"].values()) == 1


def test_priority_labels_gives_one_label_per_priority_under_concurrent_first_use() -> None:
    """Latent (today every caller is serialised). Two threads' first ``of`` of one new priority, with one slot
    left: the second re-checks nothing inside the lock and files the priority under 'other'."""
    pl = PriorityLabels(limit=2)
    pl.of("x")
    release = threading.Event()

    class Gate(set):  # holds T1 between its membership test (False) and the lock
        def __contains__(self, k: object) -> bool:
            found = super().__contains__(k)
            if threading.current_thread().name == "T1":
                release.wait(2.0)
            return found

    pl.seen = Gate(pl.seen)
    out: dict[str, str] = {}
    t1 = threading.Thread(target=lambda: out.__setitem__("T1", pl.of("y")), name="T1")
    t1.start()
    out["T2"] = pl.of("y")
    release.set()
    t1.join()
    assert out == {"T1": "y", "T2": "y"}, out  # (T1 got "other")
    assert OTHER_PRIORITY not in out.values()


@GRANULARITY
def test_the_controller_measures_the_blocks_vllm_holds_not_its_last_token_cap(
    model_dir: str, granularity: str
) -> None:
    # two prompts of exactly 4 blocks, alternating: vLLM hits 3 (it computes the last token), the LRU shadow
    # counts 4; the controller read a 25% reuse loss that no pool could avoid (review 34)
    sched, core, q = _engine(model_dir, granularity)
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 1000) for _ in range(4 * BLOCK)] for _ in range(2)]
    for i in range(40):
        assert _drive(sched, _arrive(core, f"r{i}", prompts[i % 2])) in (0, 3 * BLOCK)
    st = _ctl(q, granularity).stats()
    assert st["hit_ratio_window"] == pytest.approx(st["lru_hit_ratio_estimate"], abs=0.02)
    assert st["reuse_floor_binds"] == 0.0
    q.check()
