"""The plugin inside vLLM 0.33: HiSparse's host pool, the supported versions and the log it writes, hook errors,
the counters under concurrent reads, how lookups are counted per request, the blocks a sliding window or
align-mode Mamba frees mid-request or when a KV connector's request finishes, the block a partial hit copies
on write, and the block a running request's own cache entry moves to.

(The eviction order the queues list and walk is in ``test_vllm_order.py``.) Run by ``scripts/test_vllm.sh``.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is tested in .venv-vllm (scripts/test_vllm.sh)")

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import SupportsHMA
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.hisparse.coordinator import get_hisparse_coordinator
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus

import kvretain.integrations.vllm as plugin
from kvretain.integrations.vllm import _runtime
from kvretain.integrations.vllm._queue import BLOCKED
from kvretain.integrations.vllm.config import PluginConfig, check_vllm_version

BLOCK = 16


@pytest.fixture(autouse=True)
def _plugin_off() -> Iterator[None]:
    plugin.disable()
    plugin.reset_stats()
    yield
    plugin.disable()
    plugin.reset_stats()


def make_request(
    rid: str, prompt: list[int], priority: int = 0, extra_args: dict[str, Any] | None = None
) -> Request:
    init_none_hash(sha256)
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=4, extra_args=extra_args),
        pooling_params=None,
        priority=priority,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


# ---------------------------------------------------------------------------- (a) HiSparse's host pool
def hisparse_manager(num_blocks: int, host_blocks: int) -> KVCacheManager:
    """A HiSparse layout: a host-resident source group (its own pool, block ids from 1 like the device
    pool's), an indexer group, and the resident and hot groups on the device."""
    source = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    paged = {"block_size": BLOCK, "page_size": 4 * BLOCK}
    groups = [
        KVCacheGroupSpec(["source"], source, role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True),
        KVCacheGroupSpec(["indexer"], source, role=KVCacheGroupRole.HISPARSE_INDEXER),
        KVCacheGroupSpec(["resident"], HiSparseResidentSpec(**paged)),
        KVCacheGroupSpec(["hot"], HiSparseHotSpec(**paged, blocks_per_request=2), enable_kv_transfer=False),
    ]
    config = KVCacheConfig(
        num_blocks=num_blocks,
        hisparse_host_num_blocks=host_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
    )
    kvm = KVCacheManager(
        config, max_model_len=128, scheduler_block_size=BLOCK, hash_block_size=BLOCK, enable_caching=True
    )
    get_hisparse_coordinator(kvm)  # binds the host pool
    return kvm


def schedule(kvm: KVCacheManager, req: Request) -> None:
    assert kvm.allocate_slots(req, req.num_tokens) is not None
    req.num_computed_tokens = req.num_tokens
    coord = get_hisparse_coordinator(kvm)
    coord.advance_scheduled([(req.request_id, req.num_tokens)])
    command = coord.build_offload_command()  # the host pages are written back: they publish their hashes
    acks = {spill.transfer_id: 1 for spill in command.page_transfers}
    coord.update_spills(acks, acks)


@pytest.mark.parametrize(
    ("policy", "granularity"), [("unified", "run"), ("unified", "block"), ("lfu", "block")]
)
def test_hisparse_host_blocks_never_enter_the_device_queue(policy: str, granularity: str) -> None:
    """Freeing a request passes only the device pool's own blocks to its queue: the host group's blocks carry
    ids of the host pool, which name other (here: in-use) blocks of the device pool."""
    plugin.enable(PluginConfig(policy=policy, granularity=granularity))
    kvm = hisparse_manager(32, 16)
    device = kvm.block_pool
    queue = device.free_block_queue
    assert type(queue).__name__ != "FreeKVCacheBlockQueue"
    a = make_request("a", list(range(64)))
    b = make_request("b", list(range(1000, 1064)))
    schedule(kvm, b)  # b's device blocks come first: a's host ids (after b's in the host pool) name them
    schedule(kvm, a)
    host = kvm.coordinator.single_type_managers[0].block_pool
    assert host is not device
    host_ids = {blk.block_id for blk in kvm.coordinator.get_blocks("a")[0]}
    held_by_b = {
        blk.block_id for group in kvm.coordinator.get_blocks("b")[1:] for blk in group if not blk.is_null
    }
    assert host_ids & held_by_b, "the layout must make a host id name a device block another request holds"
    kvm.free(a)
    queue.check()  # every queued block is free and cached in the device pool
    in_use = [blk.block_id for blk in queue.get_all_free_blocks() if blk.ref_cnt > 0]
    assert in_use == []
    free_before = device.get_num_free_blocks()
    taken = device.get_new_blocks(free_before)  # vLLM asserts ref_cnt == 0 on every block it hands out
    assert len({blk.block_id for blk in taken}) == free_before
    assert not {blk.block_id for blk in taken} & held_by_b
    device.free_blocks(taken)
    kvm.free(b)
    queue.check()
    assert device.get_num_free_blocks() == 31


# ---------------------------------------------------------------------------- versions and the server's log
@pytest.mark.parametrize(
    ("version", "env", "ok"),
    [
        ("0.33.0", {}, True),
        ("0.32.0", {}, True),
        ("0.32.0+cpu", {}, True),
        ("0.34.0", {}, False),
        ("0.33.0rc1", {}, False),
        ("0.33.1.dev4+g1234", {}, False),
        ("0.31.1", {"KVRETAIN_ALLOW_UNSUPPORTED_VLLM": "1"}, True),
    ],
)
def test_version_check(version: str, env: dict[str, str], ok: bool) -> None:
    msg = check_vllm_version(version, env)
    assert (msg is None) == ok
    if not ok:
        assert msg is not None and version in msg and "0.32.0, 0.33.0" in msg
        assert "KVRETAIN_ALLOW_UNSUPPORTED_VLLM=1" in msg


def test_an_unsupported_vllm_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with pytest.raises(plugin.PluginConfigError, match=r"vLLM 0\.34\.0 is not supported"):
        plugin.enable(PluginConfig())
    assert not plugin.is_enabled()
    monkeypatch.setenv(plugin.ENV_ALLOW_VERSION, "1")
    plugin.enable(PluginConfig())
    assert plugin.is_enabled()


SERVER_LOG = r"""
import logging, os, sys
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())  # what vLLM's API server and engine core do at start
import vllm
if len(sys.argv) > 1:
    vllm.__version__ = sys.argv[1]
import kvretain.integrations.vllm as plugin
plugin.register()
logging.getLogger("kvretain").info("NOT-SHOWN")  # (lost: vLLM configures only its own logger)
if plugin.is_enabled():
    from vllm.v1.core.block_pool import BlockPool
    BlockPool(12, enable_caching=True, hash_block_size=16)
"""


def server_log(env: dict[str, str], *args: str) -> str:
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith("KVRETAIN_")} | env
    full.setdefault("VLLM_TARGET_DEVICE", "cpu")
    out = subprocess.run(
        [sys.executable, "-c", SERVER_LOG, *args], env=full, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout + out.stderr


def test_the_server_log_says_which_policy_was_installed() -> None:
    import vllm

    log = server_log({"KVRETAIN_POLICY": "unified", "KVRETAIN_GRANULARITY": "block"})
    lines = [line for line in log.splitlines() if "kvretain" in line]
    assert any(
        "INFO" in line
        and f"kvretain vLLM plugin enabled in vLLM {vllm.__version__}:" in line
        and "unified (block granularity)" in line
        for line in lines
    ), log[-3000:]
    assert any(
        "unified (block granularity) eviction policy installed on a 12-block" in line for line in lines
    )
    assert "NOT-SHOWN" not in log


def test_the_server_log_says_why_the_plugin_refused() -> None:
    log = server_log({"KVRETAIN_POLICY": "lfu"}, "0.30.0")
    assert any(
        "ERROR" in line and "kvretain vLLM plugin disabled: vLLM 0.30.0 is not supported" in line
        for line in log.splitlines()
    ), log[-3000:]
    assert "installed on a" not in log
    log = server_log({"KVRETAIN_POLICY": "bogus"})
    assert "kvretain vLLM plugin disabled: KVRETAIN_POLICY='bogus': unknown policy" in log


def test_a_pool_without_prefix_caching_says_the_plugin_has_nothing_to_do(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A server without prefix caching builds its pool all the same: the log said the plugin was enabled, then
    nothing (no queue, no kvretain series in /metrics). It says why now, and the pool stays stock."""
    from vllm.v1.core.block_pool import BlockPool

    caplog.set_level(logging.INFO, logger=_runtime.LOGGER_NAME)
    plugin.enable(PluginConfig())
    pool = BlockPool(12, enable_caching=False, hash_block_size=BLOCK)
    assert type(pool.free_block_queue).__name__ == "FreeKVCacheBlockQueue"  # (stock)
    said = [r for r in caplog.records if "prefix caching is off" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]
    assert "12-block" in said[0].getMessage() and "unified (run granularity)" in said[0].getMessage()
    caplog.clear()
    BlockPool(12, enable_caching=True, hash_block_size=BLOCK)
    assert not any("prefix caching is off" in r.getMessage() for r in caplog.records)
    plugin.disable()
    BlockPool(12, enable_caching=False, hash_block_size=BLOCK)  # (a stock server: not a word)
    assert not any("prefix caching is off" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------- hook errors, counters
def test_hook_errors_are_counted_and_logged_again_with_the_count(caplog: pytest.LogCaptureFixture) -> None:
    from kvretain.integrations.vllm import _patches

    caplog.set_level(logging.INFO, logger=_runtime.LOGGER_NAME)
    for _ in range(100):
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            _patches._hook_failed("free", "kvretain: release hook failed")
    assert plugin.stats()["hook_errors"] == {"free": 100}
    records = [r for r in caplog.records if "release hook failed" in r.getMessage()]
    assert len(records) == 3  # the first (with its traceback), the 10th and the 100th
    assert records[0].exc_info is not None and "100 times so far" in records[2].getMessage()
    plugin.reset_stats()
    assert plugin.stats()["hook_errors"] == {}


@pytest.mark.parametrize(("policy", "granularity"), [("unified", "block"), ("lfu", "block")])
def test_a_failing_release_hook_is_counted_and_the_engine_goes_on(
    monkeypatch: pytest.MonkeyPatch, policy: str, granularity: str
) -> None:
    from kvretain.integrations.vllm._base import HookedFreeQueue

    plugin.enable(PluginConfig(policy=policy, granularity=granularity))
    kvm = plain_manager()
    req = make_request("a", list(range(40)))
    assert kvm.allocate_slots(req, req.num_tokens) is not None

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(HookedFreeQueue, "on_request_release", broken)
    kvm.free(req)
    assert plugin.stats()["hook_errors"] == {"free": 1}
    kvm.block_pool.free_block_queue.check()
    assert kvm.block_pool.get_num_free_blocks() == 15


def test_a_free_vllm_fails_before_freeing_leaves_no_placement_for_a_later_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The per-block queue's release places the blocks whose last reference goes and vLLM's ``append_n`` that
    follows only counts them. When vLLM's free raises before that ``append_n``, the placement is for that free
    only: the next ``append_n`` (a deferred free's, which no release places) queues its blocks. Taken as placed
    there, they were counted free but never queued (lost to the pool)."""
    plugin.enable(PluginConfig(policy="unified", granularity="block"))
    kvm = plain_manager()
    q = kvm.block_pool.free_block_queue
    a = make_request("a", list(range(2 * BLOCK)))
    b = make_request("b", list(range(100, 100 + 2 * BLOCK)))  # as many hashed blocks as a
    for req in (a, b):
        assert kvm.allocate_slots(req, req.num_tokens) is not None
    ids_b = {blk.block_id for blk in kvm.coordinator.single_type_managers[0].req_to_blocks["b"]}

    def fails(request_id: str) -> None:
        raise RuntimeError("vLLM's free failed")

    with monkeypatch.context() as m, pytest.raises(RuntimeError):
        m.setattr(kvm.coordinator, "free", fails)
        kvm.free(a)
    kvm.block_pool.free_blocks(reversed(kvm.pop_blocks_for_free(b)))  # a deferred free
    assert ids_b <= {blk.block_id for blk in q.get_all_free_blocks()}
    kvm.free(a)  # (again: it goes through this time)
    q.check()
    assert len(q.get_all_free_blocks()) == kvm.block_pool.get_num_free_blocks() == 15


def _two_users() -> tuple[KVCacheManager, Request, list[Any]]:
    """A pool where ``a`` (priority -1: 2 full blocks and a partial one) has ended and ``b`` (priority -2) holds
    a's 2 blocks (hits), 2 new ones and a partial one; b's blocks in allocation order."""
    kvm = plain_manager()
    a = make_request("a", list(range(40)), priority=-1)
    assert kvm.allocate_slots(a, a.num_tokens) is not None
    kvm.free(a)
    b = make_request("b", list(range(32)) + list(range(100, 140)), priority=-2)
    hit, num_hit, _ = kvm.get_computed_blocks(b)
    assert num_hit == 2 * BLOCK
    assert kvm.allocate_slots(b, b.num_tokens - num_hit, num_hit, hit) is not None
    held = list(kvm.coordinator.single_type_managers[0].req_to_blocks["b"])
    assert len(held) == 5 and all(blk.ref_cnt == 1 for blk in held)
    return kvm, b, held


def _queue_state(kvm: KVCacheManager) -> tuple[Any, ...]:
    q = kvm.block_pool.free_block_queue
    blocks = kvm.block_pool.blocks
    return (
        [(blk.ref_cnt, blk.block_hash) for blk in blocks],
        [blk.block_id for blk in q.get_all_free_blocks()],
        list(q._r),
        list(q._uses),
        list(q._cls),
        q.stats(),
    )


def _fail_run(monkeypatch: pytest.MonkeyPatch, at: int) -> list[int]:
    """Make the ``at``-th run the queue opens from now on raise; returns the count of runs asked for."""
    from kvretain.integrations.vllm import _runs

    made = [0]
    real_run = _runs._Run

    def failing_run(*args: Any) -> Any:
        made[0] += 1
        if made[0] == at:
            raise RuntimeError("boom")
        return real_run(*args)

    monkeypatch.setattr(_runs, "_Run", failing_run)
    return made


@pytest.mark.parametrize("fail_at_run", [1, 2])
def test_a_failing_fused_release_frees_every_block_and_the_engine_goes_on(
    monkeypatch: pytest.MonkeyPatch, fail_at_run: int
) -> None:
    """The run queue frees a full-attention request in one pass with its release (``free_request``). When that
    pass fails part-way (here the run it opens: the first, before any block is freed, or the second, after the
    new blocks were), the blocks it had not reached are freed as vLLM frees them (queued under the releasing
    request's class), the error is counted, and the queue stays consistent (free counts,
    reference counts, the protected count)."""
    plugin.enable(PluginConfig(policy="unified"))
    kvm, b, held = _two_users()
    made = _fail_run(monkeypatch, fail_at_run)
    kvm.free(b)
    assert made[0] >= fail_at_run  # (the blocks freed after the error open runs of their own)
    assert plugin.stats()["hook_errors"] == {"free": 1}
    assert all(blk.ref_cnt == 0 for blk in held)
    q = kvm.block_pool.free_block_queue
    q.check()
    assert kvm.block_pool.get_num_free_blocks() == 15
    assert (
        q.stats()["protected_blocks"] == 4
    )  # a's 2 blocks, b's 2 new ones: every hashed block, priority < 0
    # a's 2 blocks, which the loop had not reached: freed by vLLM's free into the queue, as b's (its class)
    first, second = held[0].block_id, held[1].block_id
    assert q._holds(first) and q._holds(second)
    assert q._cls[first] == q._cls[second] == -2


def test_a_fused_release_failing_before_any_block_leaves_what_the_general_path_leaves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failure at the fused release's first run (nothing freed yet) ends as the general path's failure does
    (its release hook fails, vLLM frees every block): the same blocks, order, per-block state and counts."""
    from kvretain.integrations.vllm import _patches

    states = []
    for fused in (True, False):
        plugin.disable()
        plugin.reset_stats()
        plugin.enable(PluginConfig(policy="unified"))
        with monkeypatch.context() as mp:
            if not fused:
                mp.setattr(_patches, "_fused_free", lambda manager, q: None)
            kvm, b, _ = _two_users()
            _fail_run(mp, 1)
            kvm.free(b)
        assert plugin.stats()["hook_errors"] == {"free": 1}
        kvm.block_pool.free_block_queue.check()
        states.append(_queue_state(kvm))
    assert states[0] == states[1]


@pytest.mark.parametrize("where", ["retention", "queueing"])
def test_a_fused_release_failing_outside_its_loop_frees_every_block(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Before the loop (reading the request's retention) or after it (queueing its runs), a failure still leaves
    every block of the request freed and the queue consistent."""
    from kvretain.integrations.vllm import _runs

    plugin.enable(PluginConfig(policy="unified"))
    kvm, b, held = _two_users()

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    if where == "retention":
        monkeypatch.setattr(_runs.RunFreeQueue, "_request_retention", broken)
    else:
        push = _runs._RunQueue.push
        calls = [0]

        def failing_push(self: Any, run: Any) -> None:
            calls[0] += 1
            if calls[0] == 1:
                raise RuntimeError("boom")
            push(self, run)

        monkeypatch.setattr(_runs._RunQueue, "push", failing_push)
    kvm.free(b)
    assert plugin.stats()["hook_errors"] == {"free": 1}
    assert all(blk.ref_cnt == 0 for blk in held)
    q = kvm.block_pool.free_block_queue
    q.check()
    assert kvm.block_pool.get_num_free_blocks() == 15
    assert q._held == sum(1 for blk in kvm.block_pool.blocks[1:] if blk.ref_cnt == 0 and blk.block_hash)


def test_extra_args_that_are_not_a_mapping_carry_no_retention_and_free_normally() -> None:
    """vLLM's ``extra_args`` is a dict by its contract; anything else has no retention fields for the plugin (it
    passes validation), and its release must not fail (it did: the blocks of such a request were lost)."""
    plugin.enable(PluginConfig(policy="unified"))
    kvm = plain_manager()
    req = make_request("a", list(range(40)))
    req.sampling_params = SamplingParams(max_tokens=4, extra_args=["not", "a", "mapping"])  # type: ignore[arg-type]
    assert kvm.allocate_slots(req, req.num_tokens) is not None
    held = list(kvm.coordinator.single_type_managers[0].req_to_blocks["a"])
    kvm.free(req)
    assert plugin.stats()["hook_errors"] == {}
    assert all(blk.ref_cnt == 0 for blk in held)
    assert kvm.block_pool.get_num_free_blocks() == 15
    kvm.block_pool.free_block_queue.check()


def test_a_pool_whose_free_blocks_is_wrapped_is_freed_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused free does what vLLM's own ``BlockPool.free_blocks`` does; a pool whose ``free_blocks`` something
    else wraps keeps the general path, so the wrapper sees every block."""
    from vllm.v1.core.block_pool import BlockPool

    seen: list[int] = []
    orig = BlockPool.free_blocks

    def spy(self: Any, ordered: Any) -> None:
        blocks = list(ordered)
        seen.extend(blk.block_id for blk in blocks)
        orig(self, blocks)

    monkeypatch.setattr(BlockPool, "free_blocks", spy)
    plugin.enable(PluginConfig(policy="unified"))
    kvm = plain_manager()
    req = make_request("a", list(range(40)))
    assert kvm.allocate_slots(req, req.num_tokens) is not None
    held = list(kvm.coordinator.single_type_managers[0].req_to_blocks["a"])
    kvm.free(req)
    assert sorted(seen) == sorted(blk.block_id for blk in held)
    assert kvm.block_pool.get_num_free_blocks() == 15


def plain_manager() -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(
        num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)]
    )
    return KVCacheManager(
        config, max_model_len=256, scheduler_block_size=BLOCK, hash_block_size=BLOCK, enable_caching=True
    )


def test_counters_snapshot_while_the_engine_inserts_priorities(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_runtime, "MAX_PRIORITY_CLASSES", 10**9)  # every priority apart: inserts all along
    counters = _runtime.Counters()
    stop = threading.Event()
    errors: list[BaseException] = []

    def scrape() -> None:
        while not stop.is_set():
            try:
                counters.snapshot()
            except BaseException as exc:  # (a dict changing size during iteration)
                errors.append(exc)
                return

    t = threading.Thread(target=scrape)
    t.start()
    try:
        for p in range(200_000):
            counters.get(p).requests += 1
    finally:
        stop.set()
        t.join()
    assert errors == []
    assert len(counters.snapshot()) == 200_000


# ---------------------------------------------------------------------------- lookups per request
def logged_plain_manager() -> KVCacheManager:
    """A plain manager that records prefix-cache stats (as the scheduler's, with ``log_stats``)."""
    return KVCacheManager(
        plain_manager().kv_cache_config,
        max_model_len=256,
        scheduler_block_size=BLOCK,
        hash_block_size=BLOCK,
        enable_caching=True,
        log_stats=True,
    )


def counting_manager() -> KVCacheManager:
    """:func:`logged_plain_manager` under ``unified``."""
    plugin.enable(PluginConfig(policy="unified"))
    return logged_plain_manager()


def test_a_request_counts_its_first_lookup_and_its_resumes_apart() -> None:
    """A preempted request looks the cache up again when it resumes: that is counted apart (``preempted_*``),
    not as another request of its class (vLLM's own prefix-cache metrics do the same)."""
    kvm = counting_manager()
    warm = make_request("warm", list(range(48)), priority=1)
    assert kvm.allocate_slots(warm, 48) is not None
    kvm.free(warm)
    req = make_request("r", list(range(48)) + [7] * 8, priority=1)
    for _ in range(3):
        _, hits, _ = kvm.get_computed_blocks(req)
        kvm.record_prefix_cache_stats(req, hits)  # what the scheduler records at admission
        assert hits == 48
        blocks = kvm.get_computed_blocks(req)[0]
        assert kvm.allocate_slots(req, req.num_tokens - hits, hits, blocks) is not None
        kvm.free(req)  # preempted (by recompute)
        req.num_preemptions += 1
    c = plugin.stats()["by_priority"][1]
    assert (c["requests"], c["query_tokens"], c["hit_tokens"]) == (1, 56, 48)
    assert (c["preempted_requests"], c["preempted_query_tokens"], c["preempted_hit_tokens"]) == (2, 112, 96)


def test_a_request_that_skips_the_prefix_cache_lookup_is_not_counted() -> None:
    """vLLM's scheduler records the lookup of every first admission, a request that skips reading the prefix cache
    (prompt logprobs) included, and its own counters leave that one out: so do the plugin's counters and the
    policy's lookup hook (it was counted as a request of its class that hit nothing)."""
    kvm = counting_manager()
    init_none_hash(sha256)
    looked_up = []
    for rid, params in (
        ("skip", SamplingParams(max_tokens=4, prompt_logprobs=1)),
        ("plain", SamplingParams(max_tokens=4)),
    ):
        req = Request(
            request_id=rid,
            prompt_token_ids=list(range(48)),
            sampling_params=params,
            pooling_params=None,
            priority=2,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
        )
        _, hits, _ = kvm.get_computed_blocks(req)
        kvm.record_prefix_cache_stats(req, hits)  # what the scheduler records at admission
        looked_up.append(plugin.stats()["by_priority"].get(2, {}).get("requests", 0))
    assert kvm.prefix_cache_stats is not None and kvm.prefix_cache_stats.requests == 1  # (vLLM's own)
    assert looked_up == [0, 1]


def test_the_plugin_counts_with_the_cores_one_per_class_type() -> None:
    """Issue 11, item 14: the plugin had its own counters type; it counts with ``kvretain.core.stats`` (the
    type and the rules of the core manager, replay and simulator), under its own public names."""
    from kvretain.core.stats import ClassStats

    plugin.enable(PluginConfig(policy="unified"))
    kvm = plain_manager()
    req = make_request("r", list(range(48)), priority=3)
    kvm.get_computed_blocks(req)
    assert kvm.allocate_slots(req, 48) is not None
    kvm.free(req)
    st = _runtime.COUNTERS.by_priority[3]
    assert type(st) is ClassStats and st.released_blocks == 3
    snap = plugin.stats()["by_priority"][3]
    assert snap == {name: getattr(st, f) for f, name in _runtime.STATS_KEYS}
    assert set(snap) >= {
        "requests",
        "query_tokens",
        "hit_tokens",
        "preempted_requests",
        "preempted_hit_tokens",
        "released_blocks",
        "evicted_blocks",
    }


def test_the_controller_is_told_the_last_block_only_when_the_pool_held_it() -> None:
    # a prompt of two whole blocks, again: vLLM's cap hits one (the last token is computed); the controller is
    # told two when the pool held the second at the lookup, one when it had been evicted. vLLM records the
    # lookup after allocate_slots has registered the request's own copy: that one does not count (it did, in
    # the first version of the rule: the pool looked as if it held every such block; review 34)
    from kvretain.integrations.vllm import _patches

    init_none_hash(sha256)
    plugin.enable(PluginConfig(policy="unified"))
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
    cfg = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])

    def run(evict_last: bool) -> tuple[int, int]:
        kvm = KVCacheManager(
            cfg,
            max_model_len=256,
            scheduler_block_size=16,
            hash_block_size=16,
            enable_caching=True,
            log_stats=True,
        )
        a = make_request("a", list(range(32)))
        assert kvm.allocate_slots(a, 32) is not None
        last = kvm.coordinator.single_type_managers[0].req_to_blocks["a"][1]
        kvm.free(a)
        if evict_last:
            kvm.block_pool.evict_blocks({last.block_id})
        b = make_request("b", list(range(32)))
        blocks, hits, *_ = kvm.get_computed_blocks(b)
        assert kvm.allocate_slots(b, 32 - hits, hits, blocks) is not None
        return hits, _patches._resident_tokens(kvm, b, hits, 16)

    assert run(evict_last=False) == (16, 32)
    assert run(evict_last=True) == (16, 16)


def full_plain_manager() -> KVCacheManager:
    """A plain model's manager (16 blocks, one of them vLLM's null block) whose 15 usable blocks are all cached
    and free: an admission evicts."""
    kvm = logged_plain_manager()
    for i in range(3):
        warm = make_request(f"w{i}", list(range(1000 * i, 1000 * i + 80)))
        assert kvm.allocate_slots(warm, 80) is not None
        kvm.free(warm)
    return kvm


@pytest.mark.parametrize("granularity", ["run", "block"])
def test_a_failing_lookup_at_the_first_eviction_is_counted_and_the_allocation_goes_on(
    monkeypatch: pytest.MonkeyPatch, granularity: str
) -> None:
    # an admission's lookup goes to the policy inside the queue's popleft_n (feed_pending), within vLLM's
    # get_new_blocks, after the free counts were taken down: an error there raised out of allocate_slots into the
    # scheduler and left the queue's counts short of its blocks ('held count'); it is a hook error, the lookup is
    # not given again at the record, and the allocation completes
    plugin.enable(PluginConfig(policy="unified", granularity=granularity))
    kvm = full_plain_manager()
    q = kvm.block_pool.free_block_queue
    calls = []

    def broken(*args: Any) -> None:
        calls.append(args)
        raise RuntimeError("boom")

    monkeypatch.setattr(type(q), "_policy_lookup", broken)
    req = make_request("r", list(range(5000, 5100)))
    blocks, hits, *_ = kvm.get_computed_blocks(req)
    assert kvm.allocate_slots(req, req.num_tokens - hits, hits, blocks) is not None  # (evicts 7 blocks)
    kvm.record_prefix_cache_stats(req, hits)
    assert plugin.stats()["hook_errors"] == {"lookup": 1} and len(calls) == 1
    q.check()
    assert kvm.block_pool.get_num_free_blocks() == 8
    assert plugin.stats()["by_priority"][0]["requests"] == 1


def test_a_running_request_allocated_from_zero_computed_tokens_gives_the_policy_no_lookup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vLLM sets a RUNNING request's num_computed_tokens to 0 when a synchronous KV load failed at its first block
    # (Scheduler._update_requests_with_invalid_blocks); the running loop's allocate_slots then sees 0 computed
    # tokens, as an admission would, but the scheduler records no lookup for it. A streaming-input session
    # (resumable: every lookup of it is a first one) was given a second lookup of 0 hits there, and the request
    # stayed noted as fed, so that its next real lookup would have been counted without reaching the policy
    plugin.enable(PluginConfig(policy="unified", granularity="block"))
    kvm = full_plain_manager()  # (each allocation below evicts)
    q = kvm.block_pool.free_block_queue
    given: list[str] = []
    inner = type(q)._policy_lookup

    def spy(self: Any, request: Any, mapped: int, held: int) -> None:
        given.append(request.request_id)
        inner(self, request, mapped, held)

    monkeypatch.setattr(type(q), "_policy_lookup", spy)
    init_none_hash(sha256)
    req = Request(
        request_id="s",
        prompt_token_ids=list(range(5000, 5064)),
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
        resumable=True,
    )
    blocks, hits, *_ = kvm.get_computed_blocks(req)
    assert kvm.allocate_slots(req, 32, hits, blocks) is not None  # the admission (its first chunk)
    kvm.record_prefix_cache_stats(req, hits)
    assert given == ["s"] and q._fed is None
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = 0  # (the failed load)
    assert kvm.allocate_slots(req, 64) is not None  # the running loop's allocation: evicts
    assert given == ["s"] and q._fed is None


# ---------------------------------------------------------------------------- blocks freed mid-request
def window_manager(num_blocks: int) -> KVCacheManager:
    """A hybrid layout: full attention and a sliding window of two blocks."""
    shape: dict[str, Any] = {"block_size": BLOCK, "num_kv_heads": 1, "head_size": 1, "dtype": torch.float32}
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["full"], FullAttentionSpec(**shape)),
            KVCacheGroupSpec(["window"], SlidingWindowSpec(**shape, sliding_window=2 * BLOCK)),
        ],
    )
    return KVCacheManager(
        config, max_model_len=256, scheduler_block_size=BLOCK, hash_block_size=BLOCK, enable_caching=True
    )


@pytest.mark.parametrize("granularity", ["run", "block"])
def test_the_skipped_block_hook_releases_what_vllms_remove_blocks_in_range_frees(granularity: str) -> None:
    """``SingleTypeKVCacheManager._remove_blocks_in_range(first, last)`` caps ``last`` at the request's table (its
    callers may pass more: the default ``remove_skipped_blocks`` caps first, R-SWA's gap does not) and frees from
    ``last - 1`` down to the first null block (one an earlier call freed). The hook releases those blocks and no
    others, at the request's class: not the ones under the null block, still in use, nor a hook error past the
    table's end. (vLLM 0.33's own callers keep a window's nulls below its blocks and ``last`` within the table.)"""
    plugin.enable(PluginConfig(policy="unified", granularity=granularity))
    kvm = window_manager(40)
    q = kvm.block_pool.free_block_queue
    req = make_request("a", list(range(6 * BLOCK)), priority=5)
    assert kvm.allocate_slots(req, req.num_tokens) is not None
    window = kvm.coordinator.single_type_managers[1]
    table = window.req_to_blocks["a"]
    ids = [blk.block_id for blk in table]
    assert len(ids) == 6 and all(blk.block_hash is not None for blk in table)
    q.allocating = req  # (as KVCacheManager.allocate_slots sets it around vLLM's calls)
    try:
        window._remove_blocks_in_range("a", 2, 3)  # a null block at 2
        window._remove_blocks_in_range("a", 0, 10)  # past the table's end: 5, 4, 3 go; 1 and 0 stay in use
    finally:
        q.allocating = None
    assert [None if blk.is_null else blk.block_id for blk in table] == ids[:2] + [None] * 4
    assert plugin.stats()["hook_errors"] == {}
    assert plugin.stats()["by_priority"][5]["released_blocks"] == 4
    q.check()


def mamba_manager(num_blocks: int, size: int = BLOCK, max_model_len: int = 512) -> KVCacheManager:
    """A hybrid layout as prefix caching runs it for a Mamba model: full attention, and Mamba states in align mode
    (one state block per block of tokens, the older ones freed while the request runs), in blocks of ``size``
    tokens hashed every ``BLOCK``."""
    shape: dict[str, Any] = {"block_size": size, "num_kv_heads": 1, "head_size": 1, "dtype": torch.float32}
    mamba = MambaSpec(block_size=size, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align")
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["full"], FullAttentionSpec(**shape)),
            KVCacheGroupSpec(["mamba"], mamba),
        ],
    )
    return KVCacheManager(
        config,
        max_model_len=max_model_len,
        scheduler_block_size=size,
        hash_block_size=BLOCK,
        enable_caching=True,
    )


def _placed_at(q: Any, bid: int) -> tuple[int, Any]:
    """A cached free block's retention and the class it is queued (charged) under."""
    if type(q).__name__ == "RunFreeQueue":
        run_ = q._run_of[bid]
        return q._r[bid], run_.cls if run_ is not None else None
    return q.policy.retention_of(bid, 0.0), q._cls[bid]


def run_chunks(
    kvm: KVCacheManager, req: Request, steps: int, before_step: Any = None
) -> list[tuple[int, int, tuple[int, Any]]]:
    """Prefill ``req`` two blocks a step, then decode. The hashed Mamba state blocks freed while it runs, as
    (step, block id, where the queue placed it right after that step)."""
    mamba = kvm.coordinator.single_type_managers[1]
    q = kvm.block_pool.free_block_queue
    held: set[int] = set()
    freed = []
    for step in range(steps):
        if req.num_computed_tokens >= req.num_tokens:
            req.append_output_token_ids(7)
        n = min(2 * BLOCK, req.num_tokens - req.num_computed_tokens)
        if before_step is not None:
            before_step(step)
        assert kvm.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
        table = mamba.req_to_blocks[req.request_id]
        for bid in sorted(held - {b.block_id for b in table}):
            blk = kvm.block_pool.blocks[bid]
            if blk.block_hash is not None and blk.ref_cnt == 0:
                freed.append((step, bid, _placed_at(q, bid)))
        held = {b.block_id for b in table if b.block_hash is not None}
        q.check()
    return freed


def released_by_a(kvm: KVCacheManager) -> set[int]:
    """Request ``a`` (priority 0) prefills and frees an 8-block prompt first: the ids of the blocks it leaves cached
    (each queued at a's retention, so a later request's block on one of them shows whether its own was set)."""
    a = make_request("a", list(range(8 * BLOCK)))
    run_chunks(kvm, a, 5)
    kvm.free(a)
    return {b.block_id for b in kvm.block_pool.blocks if b.block_hash is not None}


@pytest.mark.parametrize("granularity", ["run", "block"])
def test_the_state_blocks_align_mode_mamba_frees_mid_request_take_their_requests_retention(
    granularity: str,
) -> None:
    """Align-mode Mamba frees a running request's older state blocks (hashed: they are its prefix-cache states)
    through its own ``_remove_blocks_in_range``, past the window hook: they were queued at the retention and class
    of whoever last released those block ids (here request ``a``, class 0), not at the request that computed them.
    Released at the running request's priority now, before vLLM frees them."""
    plugin.enable(PluginConfig(policy="unified", granularity=granularity))
    kvm = mamba_manager(14)
    q = kvm.block_pool.free_block_queue
    by_a = released_by_a(kvm)
    b = make_request("b", list(range(1000, 1000 + 8 * BLOCK)), priority=-5)
    freed = run_chunks(kvm, b, 6)
    ids = {bid for _, bid, _ in freed}
    assert len(freed) >= 3 and ids & by_a, (freed, by_a)  # (ids a released before: their retention is stale)
    want = (q.mapping.retention_for(-5), -5)
    assert want[0] != q.mapping.retention_for(0)
    assert [placed for *_, placed in freed] == [want] * len(freed), freed
    assert plugin.stats()["by_priority"][-5]["released_blocks"] == len(freed)
    assert plugin.stats()["hook_errors"] == {}
    q.check()


@pytest.mark.parametrize("granularity", ["run", "block"])
def test_the_last_state_block_mamba_frees_itself_takes_its_requests_retention(granularity: str) -> None:
    """``MambaManager.remove_skipped_blocks`` (align mode) also frees ``blocks[last_state_block_idx]`` with
    ``free_blocks`` directly. In vLLM 0.33 its ``_remove_blocks_in_range`` retires every state below the same bound
    first, so that free finds a null block; here the retirement mark is set past the state block (as if a retired
    slot had been written again) so that the direct free is the one that frees it: released at the request's
    priority too, exactly that block."""
    plugin.enable(PluginConfig(policy="unified", granularity=granularity))
    kvm = mamba_manager(14)
    q = kvm.block_pool.free_block_queue
    mamba: Any = kvm.coordinator.single_type_managers[1]
    a = make_request("a", list(range(8 * BLOCK)))
    run_chunks(kvm, a, 5)
    kvm.free(a)
    b = make_request("b", list(range(1000, 1000 + 8 * BLOCK)), priority=-5)

    def retire_past_the_state(step: int) -> None:
        if step == 2:
            idx = mamba.last_state_block_idx["b"]
            assert not mamba.req_to_blocks["b"][idx].is_null
            mamba._num_retired_blocks["b"] = idx + 1

    freed = run_chunks(kvm, b, 4, retire_past_the_state)
    assert [step for step, *_ in freed] == [2, 3], freed  # the direct free at step 2, the range at step 3
    want = (q.mapping.retention_for(-5), -5)
    assert [placed for *_, placed in freed] == [want] * 2, freed
    assert plugin.stats()["by_priority"][-5]["released_blocks"] == 2
    assert plugin.stats()["hook_errors"] == {}
    q.check()


def test_a_failing_mamba_release_is_counted_and_vllm_frees_the_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The release before align-mode Mamba's free fails: counted as a hook error, and vLLM's free goes on (the
    blocks placed as before the hook, at their last releaser's retention); the manager keeps its own pool."""
    plugin.enable(PluginConfig(policy="unified"))
    kvm = mamba_manager(14)
    q = kvm.block_pool.free_block_queue

    def fail(*args: Any) -> None:
        raise RuntimeError("release")

    monkeypatch.setattr(q, "release_freed", fail)
    freed = run_chunks(kvm, make_request("b", list(range(8 * BLOCK)), priority=-5), 4)
    assert [placed for *_, placed in freed] == [(q.mapping.retention_for(0), 0)] * 2, freed
    assert plugin.stats()["hook_errors"] == {"skip": 2}
    assert kvm.coordinator.single_type_managers[1].block_pool is kvm.block_pool
    q.check()


@pytest.mark.parametrize("granularity", ["run", "block"])
def test_release_freed_releases_only_the_freed_blocks_of_the_table(granularity: str) -> None:
    """``release_freed`` releases the blocks it is handed that the table holds, at their positions, and no other:
    not the table's blocks between them, nor a block the table does not hold."""
    plugin.enable(PluginConfig(policy="unified", granularity=granularity))
    kvm = mamba_manager(24)
    q = kvm.block_pool.free_block_queue
    req = make_request("b", list(range(6 * BLOCK)), priority=-5)
    assert kvm.allocate_slots(req, req.num_tokens) is not None
    table = kvm.coordinator.single_type_managers[0].req_to_blocks["b"]
    assert all(b.block_hash is not None for b in table)
    other = kvm.block_pool.get_new_blocks(1)
    held = {i: b for i, b in enumerate(table)}  # (what the call may free: the whole table here)
    q.release_freed(req, held, [table[4], other[0], table[1]], BLOCK, kvm.block_pool.null_block)
    assert plugin.stats()["by_priority"][-5]["released_blocks"] == 2
    kvm.block_pool.free_blocks(other)
    q.check()


# ---------------------------------------------------------------------------- blocks freed at a KV connector's finish
class _FinishingConnector(SupportsHMA):
    """A KV connector that takes none of a finished request's blocks over (hybrid models need ``SupportsHMA``:
    ``Scheduler._connector_finished`` calls its ``request_finished_all_groups``)."""

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        return False, None


def connector_finished(kvm: KVCacheManager, req: Request, connector: Any = None) -> None:
    """vLLM's own ``Scheduler._connector_finished`` for ``req``, on a stand-in scheduler: what the method reads (a KV
    connector, no KV transfer config, ``kvm``)."""
    sched = SimpleNamespace(
        connector=_FinishingConnector() if connector is None else connector,
        vllm_config=SimpleNamespace(kv_transfer_config=None),
        kv_cache_manager=kvm,
    )
    assert Scheduler._connector_finished(sched, req) == (False, None)


def computed_prompt(kvm: KVCacheManager) -> tuple[Request, list[Any]]:
    """A priority -5 request whose 6-block prompt is allocated and computed, and its sliding-window group's table."""
    req = make_request("a", list(range(6 * BLOCK)), priority=-5)
    assert kvm.allocate_slots(req, req.num_tokens) is not None
    req.num_computed_tokens = req.num_tokens
    return req, list(kvm.coordinator.single_type_managers[1].req_to_blocks["a"])


@pytest.mark.parametrize("granularity", ["run", "block"])
def test_the_blocks_a_window_frees_at_a_connectors_finish_take_their_requests_retention(
    granularity: str,
) -> None:
    """With a KV connector, vLLM frees a finished request's out-of-window blocks in ``Scheduler._connector_finished``
    (``remove_skipped_blocks`` on the processed tokens), outside ``allocate_slots``: they were placed at the retention
    their block ids last had (here the default, class 0). Released at the request's priority now."""
    plugin.enable(PluginConfig(policy="unified", granularity=granularity))
    kvm = window_manager(40)
    q = kvm.block_pool.free_block_queue
    req, table = computed_prompt(kvm)
    assert all(blk.block_hash is not None for blk in table)
    connector_finished(kvm, req)
    freed = [blk.block_id for blk in table if blk.ref_cnt == 0]
    assert len(freed) == 4, [blk.ref_cnt for blk in table]  # (the last two stay in the window, until free)
    want = (q.mapping.retention_for(-5), -5)
    assert want[0] != q.mapping.retention_for(0)
    assert [_placed_at(q, bid) for bid in freed] == [want] * 4
    assert plugin.stats()["by_priority"][-5]["released_blocks"] == 4
    assert plugin.stats()["hook_errors"] == {}
    assert q.allocating is None
    kvm.free(req)
    q.check()


@pytest.mark.parametrize("granularity", ["run", "block"])
def test_the_state_block_align_mode_mamba_frees_at_a_connectors_finish_takes_its_requests_retention(
    granularity: str,
) -> None:
    """The same for align-mode Mamba: at a KV connector's finish it retires the state block it kept, an id that
    request ``a`` (class 0) released before; released at the finishing request's priority now."""
    plugin.enable(PluginConfig(policy="unified", granularity=granularity))
    kvm = mamba_manager(14)
    q = kvm.block_pool.free_block_queue
    by_a = released_by_a(kvm)
    b = make_request("b", list(range(1000, 1000 + 8 * BLOCK)), priority=-5)
    run_chunks(kvm, b, 4)  # (the prompt, two blocks a step)
    table = list(kvm.coordinator.single_type_managers[1].req_to_blocks["b"])
    released = plugin.stats()["by_priority"][-5]["released_blocks"]
    connector_finished(kvm, b)
    freed = [blk.block_id for blk in table if not blk.is_null and blk.ref_cnt == 0]
    assert len(freed) == 1 and freed[0] in by_a, (freed, by_a)
    assert kvm.block_pool.blocks[freed[0]].block_hash is not None
    want = (q.mapping.retention_for(-5), -5)
    assert _placed_at(q, freed[0]) == want
    assert plugin.stats()["by_priority"][-5]["released_blocks"] == released + 1
    assert plugin.stats()["hook_errors"] == {}
    kvm.free(b)
    q.check()


def test_a_failing_release_at_a_connectors_finish_is_counted_and_vllm_frees_the_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The release at a KV connector's finish fails: counted as a hook error, vLLM frees the blocks (placed as
    before the hook) and the connector is still asked; the queue's request is what it was before the call. With
    no connector, vLLM returns at once and the queue is not touched."""
    plugin.enable(PluginConfig(policy="unified"))
    kvm = window_manager(40)
    q = kvm.block_pool.free_block_queue
    req, table = computed_prompt(kvm)

    def fail(*args: Any) -> None:
        raise RuntimeError("release")

    monkeypatch.setattr(q, "release_skipped", fail)
    asked = []

    class Connector(_FinishingConnector):
        def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, None]:
            asked.append(request.request_id)
            return False, None

    earlier = make_request("other", [1, 2, 3])
    q.allocating = earlier
    no_connector = SimpleNamespace(connector=None)
    assert Scheduler._connector_finished(no_connector, req) == (False, None)
    assert all(blk.ref_cnt == 1 for blk in table)
    connector_finished(kvm, req, Connector())
    assert q.allocating is earlier
    q.allocating = None
    freed = [blk.block_id for blk in table if blk.ref_cnt == 0]
    assert asked == ["a"] and len(freed) == 4
    assert [_placed_at(q, bid) for bid in freed] == [(q.mapping.retention_for(0), 0)] * 4
    assert plugin.stats()["hook_errors"] == {"skip": 1}  # (one range freed)
    kvm.free(req)
    q.check()


# ---------------------------------------------------------------------------- a partial hit's copy-on-write
def cow_manager(num_blocks: int) -> KVCacheManager:
    """A hybrid layout with sub-block prefix hits: full attention and align-mode Mamba in 64-token blocks, hashed
    every 16 tokens (vLLM then lets a hit end inside a block, and copies that block on write)."""
    kvm = mamba_manager(num_blocks, 4 * BLOCK, max_model_len=1024)
    assert kvm.coordinator.enable_partial_hash_hits
    return kvm


def free_cow_retained(kvm: KVCacheManager, blocks: list[Any], deferred: bool, while_held: Any = None) -> None:
    """vLLM's own ``Scheduler._free_cow_retained_blocks`` of a step's copy endpoints, on a stand-in scheduler: at
    once, or (``deferred``, async scheduling) held back until the step that runs the copy is processed and freed
    by ``Scheduler._drain_deferred_frees`` (``while_held()`` is called before that)."""
    sched = SimpleNamespace(
        defer_block_free=deferred, processed_step_seq=0, deferred_frees=deque(), kv_cache_manager=kvm
    )
    Scheduler._free_cow_retained_blocks(sched, blocks, 1)
    if deferred:
        assert all(blk.ref_cnt > 0 for blk in blocks)
        if while_held is not None:
            while_held()
        sched.processed_step_seq = 1
        Scheduler._drain_deferred_frees(sched)
        assert not sched.deferred_frees


def cow_step(
    kvm: KVCacheManager, req: Request, n: int, deferred: bool, hit: bool = False, while_held: Any = None
) -> list[Any]:
    """One scheduler step of ``req`` (``n`` tokens; ``hit``: its admission, after its prefix-cache lookup): its
    copy-on-write endpoints (source, copy, ...), freed as the scheduler frees them (``while_held``: see
    :func:`free_cow_retained`)."""
    kvm.new_step_starts()
    if hit:
        blocks, num_hit, _ = kvm.get_computed_blocks(req)
        assert kvm.allocate_slots(req, n, num_hit, blocks) is not None
        req.num_computed_tokens += num_hit
    else:
        assert kvm.allocate_slots(req, n) is not None
    req.num_computed_tokens += n
    _, retained = kvm.take_kv_cache_block_copies()
    if retained:
        free_cow_retained(kvm, retained, deferred, while_held)
    return retained


def hit_mid_block(
    kvm: KVCacheManager,
    priority: int,
    deferred: bool,
    before_hit: Any = None,
    extra_args: dict[str, Any] | None = None,
    *,
    a_priority: int = 0,
    a_finishes: bool = True,
    while_copying: Any = None,
) -> tuple[Request, list[Any], list[Any]]:
    """Request ``a`` (``a_priority``) computes a 100-token prompt (its prefill ends at the 96-token checkpoint) and
    finishes (``a_finishes``; else it stays running); ``b`` (``priority``), with the same first 100 tokens, hits 96
    of them, inside the second 64-token block: both groups copy that block on write (``before_hit()`` is called just
    before; ``while_copying(a, b)`` while the scheduler holds the copy's endpoints back, ``deferred`` only). Returns
    ``b`` (admitted), the blocks it hit that were copied (one per group), and their copies."""
    a = make_request("a", list(range(100)), priority=a_priority)
    for n in (4 * BLOCK, 2 * BLOCK, 4):
        cow_step(kvm, a, n, deferred)
    if a_finishes:
        kvm.free(a)
    b = make_request("b", [*range(100), *range(9000, 9100)], priority=priority, extra_args=extra_args)
    if before_hit is not None:
        before_hit()
    held = None if while_copying is None else lambda: while_copying(a, b)
    retained = cow_step(kvm, b, 2 * BLOCK, deferred, hit=True, while_held=held)
    assert b.num_computed_tokens == 8 * BLOCK and len(retained) == 4, retained
    return b, retained[0::2], retained[1::2]


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("granularity", ["run", "block"])
def test_the_block_a_partial_hit_copies_on_write_takes_the_hitting_requests_retention(
    granularity: str, deferred: bool
) -> None:
    """On a partial (sub-block) prefix hit, ``SingleTypeKVCacheManager._apply_cow`` puts a private copy in the
    request's table in place of the cached block it hit; that block keeps the hit's reference until the copy has run,
    and the scheduler frees it then, outside any request: it was queued at the retention of its last release (request
    ``a``, class 0), never at the request that hit it. Released at the hitting request's priority now, once each
    (the copies, which the request releases at its end, were right already)."""
    plugin.enable(PluginConfig(policy="unified", granularity=granularity))
    kvm = cow_manager(40)
    q = kvm.block_pool.free_block_queue
    b, hit, copies = hit_mid_block(kvm, -5, deferred)
    tables = [m.req_to_blocks["b"] for m in kvm.coordinator.single_type_managers]
    assert [table[1] for table in tables] == copies  # (the copies replaced the blocks hit, in both groups)
    # (freed by the scheduler, still cached)
    assert all(blk.ref_cnt == 0 and blk.block_hash is not None for blk in hit)
    want = (q.mapping.retention_for(-5), -5)
    assert want[0] != q.mapping.retention_for(0)
    assert [_placed_at(q, blk.block_id) for blk in hit] == [want] * 2
    assert plugin.stats()["by_priority"][-5]["released_blocks"] == 2
    while b.num_computed_tokens < b.num_tokens:
        cow_step(kvm, b, min(4 * BLOCK, b.num_tokens - b.num_computed_tokens), deferred)
    kvm.free(b)
    assert [_placed_at(q, blk.block_id) for blk in hit + copies] == [want] * 4
    assert plugin.stats()["hook_errors"] == {}
    q.check()


def evicted_by_class(kvm: KVCacheManager) -> dict[int, int]:
    """Evict every cached free block (vLLM's ``get_new_blocks`` of the whole free count): the blocks evicted per
    request class, as the plugin's counters charge them."""
    pool = kvm.block_pool
    pool.get_new_blocks(pool.get_num_free_blocks())
    return {
        prio: c["evicted_blocks"]
        for prio, c in plugin.stats()["by_priority"].items()
        if c.get("evicted_blocks")
    }


@pytest.mark.parametrize("granularity", ["run", "block"])
def test_a_copy_freed_after_its_request_is_charged_to_that_request(granularity: str) -> None:
    """A partial hit's copy (``cow_block``) takes a second reference until the copy has run; when the request's free
    (``KVCacheManager.free``) comes first, while the scheduler still holds the copy's endpoints back, that free leaves
    the copy in use, and the scheduler's free places it later. An eviction is charged to the block's last releaser
    (the per-block queue's rule, which the run queue counts alike): the copy goes under ``b``'s class, as its other
    blocks do, not under the class last noted for that block id (0 here: an id no request had released)."""
    plugin.enable(PluginConfig(policy="unified", granularity=granularity))
    kvm = cow_manager(40)
    q = kvm.block_pool.free_block_queue
    _, hit, copies = hit_mid_block(kvm, -5, True, while_copying=lambda a, b: kvm.free(b))
    assert all(blk.ref_cnt == 0 and blk.block_hash is not None for blk in hit + copies)
    want = (q.mapping.retention_for(-5), -5)
    assert [_placed_at(q, blk.block_id) for blk in hit + copies] == [want] * 4
    q.check()
    # (b released 5 blocks: the 2 it hit, its 2 copies, the first block it hit whole; class 0: the one a released that
    # b did not, a's Mamba state at 64 tokens)
    assert plugin.stats()["by_priority"][-5]["released_blocks"] == 5
    assert evicted_by_class(kvm) == {-5: 5, 0: 1}
    assert plugin.stats()["hook_errors"] == {}


@pytest.mark.parametrize("granularity", ["run", "block"])
def test_a_block_hit_and_copied_that_another_request_frees_last_is_charged_to_that_request(
    granularity: str,
) -> None:
    """The block a partial hit copies may be held by another request too (``a``, class 3, which computed it and still
    runs): the hitting request ``b`` releases it first (the copy-on-write hook), ``a`` frees it next while async
    scheduling holds the copy's endpoints back (a's last step was processed, b's copy step not yet), and the
    scheduler's free places it later. Its retention is the
    highest asked (``b``'s), and its eviction is charged to its last releaser, ``a``, as the per-block queue charges
    it; the Mamba block ``b`` hit, which ``a`` no longer held, goes under ``b``'s class."""
    plugin.enable(PluginConfig(policy="unified", granularity=granularity))
    kvm = cow_manager(40)
    q = kvm.block_pool.free_block_queue
    b, hit, _ = hit_mid_block(
        kvm, -5, True, a_priority=3, a_finishes=False, while_copying=lambda a, b: kvm.free(a)
    )
    retention = q.mapping.retention_for(-5)
    assert retention > q.mapping.retention_for(3)
    assert [_placed_at(q, blk.block_id) for blk in hit] == [(retention, 3), (retention, -5)]
    q.check()
    kvm.free(b)
    # (class 3: that block and a's Mamba state at 64 tokens, which b did not hit; class -5: b's other 4 blocks)
    assert evicted_by_class(kvm) == {-5: 4, 3: 2}
    assert plugin.stats()["hook_errors"] == {}


def test_a_failing_release_of_a_copied_block_is_counted_and_vllm_copies_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The release of the block a partial hit copies fails: counted as a hook error, and vLLM's copy goes on (the
    request's table holds the copy; the block hit is placed as before the hook, at its last release's retention)."""
    plugin.enable(PluginConfig(policy="unified"))
    kvm = cow_manager(40)
    q = kvm.block_pool.free_block_queue

    def fail(*args: Any) -> None:
        raise RuntimeError("release")

    b, hit, copies = hit_mid_block(kvm, -5, False, lambda: monkeypatch.setattr(q, "release_freed", fail))
    assert plugin.stats()["hook_errors"] == {"cow": 2}
    assert [m.req_to_blocks["b"][1] for m in kvm.coordinator.single_type_managers] == copies
    assert [_placed_at(q, blk.block_id) for blk in hit] == [(q.mapping.retention_for(0), 0)] * 2
    monkeypatch.undo()
    kvm.free(b)
    q.check()


# ---------------------------------------------------------------------------- a running request's moved cache entry
def produce_partial_tail(
    kvm: KVCacheManager,
    priority: int,
    deferred: bool,
    before_move: Any = None,
    extra_args: dict[str, Any] | None = None,
) -> tuple[Request, Any, Any, set[int]]:
    """Request ``a`` (priority 0) computes and frees another prompt first (its block ids carry its retention; in a
    10-block pool p's blocks reuse them); then ``p`` (``priority``) prefills a 100-token prompt, 64 + 32 tokens:
    align-mode Mamba caches p's own state at the 96-token boundary, inside its second 64-token block; at p's next step
    ``MambaManager.allocate_new_blocks`` moves that cache entry to a fresh block (``BlockPool.move_block_hashes``)
    that the copy fills, and the scheduler frees the copy's endpoints (``before_move()`` is called just before that
    step). Returns ``p``, its state block (still in its table), the block now carrying the entry, and the ids of
    the blocks ``a`` released cached."""
    a = make_request("a", list(range(5000, 5200)))
    for n in (8 * BLOCK, 4 * BLOCK, 8):
        cow_step(kvm, a, n, deferred)
    kvm.free(a)
    by_a = {blk.block_id for blk in kvm.block_pool.blocks if blk.block_hash is not None}
    p = make_request("p", list(range(100)), priority=priority, extra_args=extra_args)
    cow_step(kvm, p, 4 * BLOCK, deferred)
    assert cow_step(kvm, p, 2 * BLOCK, deferred) == []
    mamba = kvm.coordinator.single_type_managers[1]
    state = mamba.req_to_blocks["p"][1]
    # (p's own partial entry, on its state block)
    assert state.block_hash is not None and state.block_hash_num_tokens == 6 * BLOCK
    if before_move is not None:
        before_move()
    retained = cow_step(kvm, p, 4, deferred)
    assert len(retained) == 2 and retained[0] is state, retained  # (one copy: p's state into a fresh block)
    moved = retained[1]
    assert mamba.req_to_blocks["p"][1] is state and state.block_hash is None
    assert moved.block_hash is not None and moved.block_hash_num_tokens == 6 * BLOCK
    assert all(moved is not blk for m in kvm.coordinator.single_type_managers for blk in m.req_to_blocks["p"])
    assert moved.ref_cnt == 0  # (freed by the scheduler, never released by a request)
    return p, state, moved, by_a


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("granularity", ["run", "block"])
def test_the_block_a_running_requests_partial_tail_entry_moves_to_takes_its_retention(
    granularity: str, deferred: bool
) -> None:
    """When a running request's own partial prompt-tail state is cached, align-mode Mamba moves that cache entry to a
    fresh block (``BlockPool.move_block_hashes``, from ``MambaManager.allocate_new_blocks``) which the copy fills; the
    block is in no request's table and the scheduler frees it once the copy has run: it was queued at the retention
    of its last release (35, class 0), never at the request that computed the state. Released once at the producing
    request's priority now, at its state's position; it is the block the next request with that prefix hits."""
    plugin.enable(PluginConfig(policy="unified", granularity=granularity))
    kvm = cow_manager(10)  # (small: the block the entry moves to is one a released)
    q = kvm.block_pool.free_block_queue
    p, _, moved, by_a = produce_partial_tail(kvm, -5, deferred)
    assert moved.block_id in by_a  # (an id a released: its last retention is a's)
    want = (q.mapping.retention_for(-5), -5)
    assert want[0] != q.mapping.retention_for(0)
    assert _placed_at(q, moved.block_id) == want
    # (p's first state block, which align mode retires at the same step: its own hook; and the moved entry's block)
    assert plugin.stats()["by_priority"][-5]["released_blocks"] == 2
    for _ in range(2):  # (decode on: no other copy)
        p.append_output_token_ids(7)
        assert cow_step(kvm, p, 1, deferred) == []
    kvm.free(p)
    assert _placed_at(q, moved.block_id) == want
    c = make_request("c", [*range(100), *range(9000, 9100)])
    blocks, num_hit, _ = kvm.get_computed_blocks(c)
    assert num_hit == 6 * BLOCK and blocks.blocks[1][-1] is moved  # (the block the next request hits)
    assert plugin.stats()["hook_errors"] == {}
    q.check()


def test_a_failing_release_of_a_moved_cache_entry_is_counted_and_vllm_moves_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The release of the block a running request's cache entry moves to fails: counted as a hook error, and vLLM's
    move and copy go on (the block carries the entry, the request keeps its state block, the scheduler frees the
    copy's endpoints; the block is placed as before the hook, 35, class 0)."""
    plugin.enable(PluginConfig(policy="unified"))
    kvm = cow_manager(10)
    q = kvm.block_pool.free_block_queue

    def fail(*args: Any) -> None:
        raise RuntimeError("release")

    p, state, moved, _ = produce_partial_tail(
        kvm, -5, False, lambda: monkeypatch.setattr(q, "release_freed", fail)
    )
    # (and the release of p's first state block, which align mode retires at the same step: its own hook)
    assert plugin.stats()["hook_errors"] == {"move": 1, "skip": 1}
    assert state.ref_cnt == 1 and moved.ref_cnt == 0
    assert _placed_at(q, moved.block_id) == (q.mapping.retention_for(0), 0)
    monkeypatch.undo()
    kvm.free(p)
    q.check()


@pytest.mark.parametrize("what", ["cow", "move"])
@pytest.mark.parametrize("granularity", ["run", "block"])
def test_the_copied_and_the_moved_block_are_released_at_their_position_in_the_group(
    granularity: str, what: str
) -> None:
    """The block a partial hit copies on write and the block a running request's own cache entry moves to are
    released at the position their source has in the request's group table, in that group's block size: a
    directive on prompt tokens [64, 100) (the second 64-token block; the 16-token hash blocks it spans are 4..6)
    gives them its priority, and no other position or block size does."""
    plugin.enable(PluginConfig(policy="unified", granularity=granularity))
    directive = {"retention_directives": [{"start": 64, "end": 100, "priority": 60}]}
    if what == "cow":
        kvm = cow_manager(40)
        _, blocks, _ = hit_mid_block(kvm, -5, False, extra_args=directive)
    else:
        kvm = cow_manager(10)
        _, _, moved, _ = produce_partial_tail(kvm, -5, False, extra_args=directive)
        blocks = [moved]
    q = kvm.block_pool.free_block_queue
    assert 60 not in (q.mapping.retention_for(-5), q.mapping.retention_for(0))
    assert [_placed_at(q, blk.block_id) for blk in blocks] == [(60, -5)] * len(blocks)
    assert plugin.stats()["hook_errors"] == {}
    q.check()


@pytest.mark.parametrize("policy", ["lfu", "unified"])
def test_content_a_block_loses_to_a_rehash_leaves_with_it(policy: str) -> None:
    """vLLM gives a block that the per-block queue knows with content ``k`` new content without evicting it (a
    partial->full promotion in ``cache_full_blocks``, as its checkpoint hashes do): ``k`` leaves the block as a drop.
    The policy's count of blocks holding ``k`` lets it go, so when ``k`` comes back in another block and is evicted
    there, its use count is remembered (the ghost entry), as for content that left with its last copy; ``unified``'s
    protected count loses the block's old protection at once (not at the block's next release)."""
    plugin.enable(PluginConfig(policy=policy, granularity="block"))
    kvm = plain_manager()
    pool = kvm.block_pool
    q = pool.free_block_queue
    prompt = list(range(17))  # one full block
    a = make_request("a", prompt, priority=-5)
    assert kvm.allocate_slots(a, a.num_tokens) is not None
    x = kvm.coordinator.single_type_managers[0].req_to_blocks["a"][0]
    k = x.block_hash
    assert k is not None and q._hash[x.block_id] == k
    b = make_request("b", prompt)
    hit, num_hit, _ = kvm.get_computed_blocks(b)
    assert num_hit == BLOCK
    assert kvm.allocate_slots(b, b.num_tokens - num_hit, num_hit, hit) is not None
    kvm.free(a)  # x stays in use (b holds it), released at a's retention
    assert x.ref_cnt == 1
    if policy == "unified":
        assert q.policy._num_protected == 1
    # the promotion: x's 16-token entry becomes the 32-token entry of another prompt (vLLM's own path)
    c = make_request("c", list(range(100, 140)))
    pool.cache_full_blocks(c, [pool.null_block, x], 1, 2, BLOCK, 0)
    assert x.block_hash != k and q._hash[x.block_id] == x.block_hash
    assert k not in q.policy._ghost.held
    if policy == "unified":
        assert q.policy._num_protected == 0
    # k comes back in another block (vLLM's cache lost it with the promotion), is released and evicted there: its
    # count (a's release, the one it was remembered with, then d's) is remembered
    d = make_request("d", prompt)
    assert kvm.get_computed_blocks(d)[1] == 0
    assert kvm.allocate_slots(d, d.num_tokens) is not None
    z = kvm.coordinator.single_type_managers[0].req_to_blocks["d"][0]
    assert z is not x and z.block_hash == k
    kvm.free(d)
    kvm.free(b)
    q.check()
    assert evicted_by_class(kvm) == {0: 2}  # (z and x: the promotion is no eviction)
    assert k not in q.policy._ghost.held
    assert q.policy._ghost.table.get(k) == 2
    assert plugin.stats()["hook_errors"] == {}


@pytest.mark.parametrize("in_use_first", [True, False])
@pytest.mark.parametrize(
    ("policy", "granularity", "options"),
    [("lfu", "block", {}), ("unified", "block", {}), ("unified", "run", {"ghost_factor": 1.0})],
)
def test_evict_blocks_taking_both_copies_one_in_use_remembers_the_content(
    policy: str, granularity: str, options: dict[str, Any], in_use_first: bool
) -> None:
    """Two requests computed the same block at once (vLLM registers it twice); a third hits the first copy and holds
    it; ``evict_blocks`` (a KV connector's failed load) then strips both copies in one call, in either order: the
    content leaves the cache, and its use count is remembered (the ghost entry), as when its last copy is evicted
    alone."""
    plugin.enable(PluginConfig(policy=policy, granularity=granularity, options=options))
    kvm = plain_manager()
    pool = kvm.block_pool
    q = pool.free_block_queue
    prompt = list(range(17))  # one full block
    a, b = make_request("a", prompt), make_request("b", prompt)
    assert kvm.get_computed_blocks(b)[1] == 0  # (b looks before a has cached it)
    assert kvm.allocate_slots(a, a.num_tokens) is not None
    assert kvm.allocate_slots(b, b.num_tokens) is not None
    blocks = kvm.coordinator.single_type_managers[0].req_to_blocks
    xa, xb = blocks["a"][0], blocks["b"][0]
    k = xa.block_hash
    assert xa is not xb and k is not None and xb.block_hash == k
    kvm.free(b)
    kvm.free(a)
    c = make_request("c", prompt)
    hit, num_hit, _ = kvm.get_computed_blocks(c)
    assert num_hit == BLOCK
    assert kvm.allocate_slots(c, c.num_tokens - num_hit, num_hit, hit) is not None
    assert xa.ref_cnt == 1 and xb.ref_cnt == 0  # (lookups find the first copy)
    ids = [xa.block_id, xb.block_id]
    pool.evict_blocks(ids if in_use_first else ids[::-1])
    assert xa.block_hash is None and xb.block_hash is None
    ghost = q.policy._ghost if granularity == "block" else q._ghost
    assert ghost.table.get(k) == 1
    assert plugin.stats()["hook_errors"] == {}
    q.check()


@pytest.mark.parametrize("policy", ["lfu", "unified"])
def test_a_release_of_a_block_whose_hash_changed_unseen_lets_the_old_content_go(policy: str) -> None:
    """A block the per-block queue knows with content ``k`` comes back (its request's release, then vLLM's
    ``free_blocks``) carrying another hash that no hook reported (a vLLM path the plugin does not patch): the queue
    registers the new content and lets ``k`` go as a drop (the policy forgets it; its count is remembered, as for
    content that left with its last copy), not as an eviction."""
    plugin.enable(PluginConfig(policy=policy, granularity="block"))
    kvm = plain_manager()
    q = kvm.block_pool.free_block_queue
    prompt = list(range(17))  # one full block
    a = make_request("a", prompt)
    assert kvm.allocate_slots(a, a.num_tokens) is not None
    x = kvm.coordinator.single_type_managers[0].req_to_blocks["a"][0]
    k = x.block_hash
    assert k is not None and q._hash[x.block_id] == k
    kvm.free(a)  # k: one release
    assert q.policy._ghost.held.get(k) == 1
    b = make_request("b", prompt)
    hit, num_hit, _ = kvm.get_computed_blocks(b)
    assert num_hit == BLOCK
    assert kvm.allocate_slots(b, b.num_tokens - num_hit, num_hit, hit) is not None
    other = make_request("o", list(range(500, 517))).block_hashes[0]
    x._block_hash = other  # (unseen by the queue)
    kvm.free(b)
    assert q._hash[x.block_id] == other
    assert k not in q.policy._ghost.held and q.policy._ghost.held.get(other) == 1
    assert q.policy._ghost.table.get(k) == 1  # (a's release; b's counts for the content it released)
    assert evicted_by_class(kvm) == {0: 1}  # x, with the new content: k's departure was no eviction
    assert plugin.stats()["hook_errors"] == {}
    q.check()


def partial_entry_in_use() -> tuple[KVCacheManager, Request, Any]:
    """A hybrid pool (``cow_manager``) where request ``a`` has computed 40 tokens: its first 64-token block holds a
    partial prefix-cache entry of 32 tokens (``cache_partial_block``). The manager, ``a`` and that block."""
    kvm = cow_manager(40)
    a = make_request("a", list(range(40)))
    for n in (2 * BLOCK, 8):
        cow_step(kvm, a, n, False)
    return kvm, a, kvm.coordinator.single_type_managers[0].req_to_blocks["a"][0]


@pytest.mark.parametrize(
    ("policy", "granularity"), [("lfu", "block"), ("unified", "block"), ("unified", "run")]
)
def test_evict_blocks_stripping_a_partial_entry_in_use_counts_one_eviction(
    policy: str, granularity: str
) -> None:
    """A running request's block holds a partial prefix-cache entry (``cache_partial_block``: hybrid layouts hash
    inside a block), which no release has registered with the queue yet; ``evict_blocks`` strips it (vLLM emits
    ``BlockRemoved``): one eviction, counted under the block id's last releaser by both queues."""
    plugin.enable(PluginConfig(policy=policy, granularity=granularity))
    kvm, _, x = partial_entry_in_use()
    pool = kvm.block_pool
    q = pool.free_block_queue
    assert x.block_hash is not None and x.ref_cnt == 1
    pool.evict_blocks({x.block_id})
    assert x.block_hash is None
    evicted = {
        prio: c["evicted_blocks"]
        for prio, c in plugin.stats()["by_priority"].items()
        if c.get("evicted_blocks")
    }
    assert evicted == {0: 1}
    assert plugin.stats()["hook_errors"] == {}
    q.check()


@pytest.mark.parametrize("grown", [False, True])
@pytest.mark.parametrize(
    ("policy", "granularity"), [("lfu", "block"), ("unified", "block"), ("unified", "run")]
)
def test_a_partial_entry_promoted_to_the_full_block_starts_as_new_content(
    policy: str, granularity: str, grown: bool
) -> None:
    """A running request's block holds a partial prefix-cache entry ``k``; another request hits it mid-block (a copy
    on write) and releases it at its own, higher retention; the first request then fills the block, and vLLM
    promotes the entry to the full block's hash ``k2`` (``cache_full_blocks``), dropping ``k``'s entries (``grown``:
    the entry grows to 48 tokens first, ``cache_partial_block``). ``k`` leaves as a drop: its use count is
    remembered under ``k``, and ``k2`` starts afresh, at the retention of the one request that released it (both
    queues; the run queue kept ``k``'s count and the hitting request's retention for ``k2`` before)."""
    plugin.enable(PluginConfig(policy=policy, granularity=granularity, options={"ghost_factor": 16.0}))
    kvm, a, x = partial_entry_in_use()
    pool = kvm.block_pool
    q = pool.free_block_queue
    k = x.block_hash
    assert k is not None and x.block_hash_num_tokens == 2 * BLOCK  # (a partial entry of the 64-token block)
    b = make_request("b", [*range(40), *range(9000, 9100)], priority=-5)
    cow_step(
        kvm, b, 2 * BLOCK, False, hit=True
    )  # b hits 32 tokens of x, copies it, releases x at its retention
    assert x.ref_cnt == 1
    for i in range(24):  # a decodes to 64 tokens: x is full, its entry promoted
        a.append_output_token_ids(7)
        cow_step(kvm, a, 1, False)
        if grown and i == 7:  # (48 tokens computed)
            pool.cache_partial_block(a, x, 3 * BLOCK, 0, 4 * BLOCK)
            assert x.block_hash_num_tokens == 3 * BLOCK and x.block_hash != k
    k2 = x.block_hash
    assert k2 is not None and k2 != k and x.block_hash_num_tokens == 4 * BLOCK
    kvm.free(a)
    assert _placed_at(q, x.block_id) == (q.mapping.retention_for(0), 0)
    kvm.free(b)
    q.check()
    evicted_by_class(kvm)
    ghost = q._ghost if granularity == "run" else q.policy._ghost
    assert ghost.table.get(k) == 1 and ghost.table.get(k2) == 1
    assert plugin.stats()["hook_errors"] == {}


FIXED_SHARE = {"isolation_goal": None, "adapt_frequency": False, "ghost_factor": 0.0}
"""``unified`` with its fixed protected share and no adaptive parts: the two queues' decisions compared alone."""


def window_pressure(granularity: str) -> tuple[dict[int, int], list[int]]:
    """A class -5 request (retention 85, protected) ends; a class 1 request (25) runs through 8 blocks, its sliding
    window freeing its early window blocks while it runs; then an allocation evicts all but 2 cached blocks. The
    blocks evicted per class, and the class-1 window blocks freed mid-request that the queue holds back."""
    plugin.enable(PluginConfig(policy="unified", granularity=granularity, options=FIXED_SHARE))
    kvm = window_manager(40)
    h = make_request("h", list(range(7000, 7000 + 3 * BLOCK)), priority=-5)
    a = make_request("a", list(range(8 * BLOCK)), priority=1)
    for req, chunk in ((h, 3 * BLOCK), (a, 2 * BLOCK)):
        while req.num_computed_tokens < req.num_tokens:
            assert kvm.allocate_slots(req, chunk) is not None
            req.num_computed_tokens += chunk
        if req is h:
            kvm.free(h)
    q = kvm.block_pool.free_block_queue
    freed = [b for b in q.get_all_free_blocks() if b.block_hash is not None and q._cls[b.block_id] == 1]
    assert len(freed) == 4  # (positions 0-3 of a's window group)
    held_back = [b.block_id for b in freed if granularity == "block" and q._where[b.block_id] == BLOCKED]
    pool = kvm.block_pool
    pool.get_new_blocks(pool.get_num_free_blocks() - 2)
    assert plugin.stats()["hook_errors"] == {}
    q.check()
    evicted = {
        prio: c["evicted_blocks"]
        for prio, c in plugin.stats()["by_priority"].items()
        if c.get("evicted_blocks")
    }
    plugin.disable()
    plugin.reset_stats()
    return evicted, held_back


def test_sliding_window_blocks_freed_mid_request_wait_for_no_child() -> None:
    """A sliding window's hit reads only the blocks it ends on, so a window block freed mid-request must not wait
    behind its children (the per-block queue linked the window group's blocks as full attention's and held the
    freed ones back until every other block had gone, protected ones included: a class-1 block at 25 outlived
    class -5 blocks at 85). Both queues now evict the unprotected window blocks first, alike."""
    run = window_pressure("run")
    block = window_pressure("block")
    assert block[1] == [] and run[1] == []
    assert run[0] == block[0]
    assert run[0].get(1) == 4  # every freed class-1 window block went


def test_a_mamba_state_above_a_null_gap_is_lifted_by_nothing() -> None:
    """Align-mode Mamba keeps a state block every other position (null between); a scope's directive lowers the
    head (positions 0-1) to 10 under a protected request (35). The state at position 1 has no child across the
    null block, so the run queue must not lift it to the run of the state at position 3 (protected, 35): both
    queues place it at 10, unprotected, and evict it first."""
    lower_head = {
        "retention_directives": [{"start": 0, "end": 2 * BLOCK, "priority": 10}],
        "retention_scope": "s",
    }
    seen = []
    for granularity in ("run", "block"):
        plugin.enable(PluginConfig(policy="unified", granularity=granularity, options=FIXED_SHARE))
        kvm = mamba_manager(40)
        q = kvm.block_pool.free_block_queue
        a = make_request("a", list(range(4 * BLOCK)), priority=0, extra_args=lower_head)
        for _ in range(2):
            assert kvm.allocate_slots(a, 2 * BLOCK) is not None
            a.num_computed_tokens += 2 * BLOCK
        states = kvm.coordinator.single_type_managers[1].req_to_blocks["a"]
        assert [b.is_null for b in states] == [True, False, True, False]
        s1 = states[1].block_id
        kvm.free(a)
        q.check()
        tier = q._run_of[s1].tier if granularity == "run" else q.policy._meta[s1].tier
        placed = _placed_at(q, s1)
        pool = kvm.block_pool
        unhashed = sum(1 for b in q.get_all_free_blocks() if b.block_hash is None)
        victim = pool.get_new_blocks(unhashed + 1)[-1].block_id
        assert plugin.stats()["hook_errors"] == {}
        seen.append((placed, tier, victim == s1))
        plugin.disable()
        plugin.reset_stats()
    assert seen == [((10, 0), 1, True)] * 2


def test_a_sliding_window_block_below_a_raised_one_waits_for_nothing() -> None:
    """A directive raises a request's last block to 90 (protected); the block before it stays at 35. In the
    full-attention group that block leads to the raised one, so it goes only after it (the pool's leaf-only
    eviction), in both queues. In the sliding-window group it leads to nothing a hit needs: both queues evict it
    first of the four (the run queue lifted it into the raised block's protected run before)."""
    raise_last = {"retention_directives": [{"start": 7 * BLOCK, "end": 8 * BLOCK, "priority": 90}]}
    for granularity in ("run", "block"):
        plugin.enable(PluginConfig(policy="unified", granularity=granularity, options=FIXED_SHARE))
        kvm = window_manager(40)
        pool = kvm.block_pool
        a = make_request("a", list(range(8 * BLOCK)), extra_args=raise_last)
        while a.num_computed_tokens < a.num_tokens:
            assert kvm.allocate_slots(a, 2 * BLOCK) is not None
            a.num_computed_tokens += 2 * BLOCK
        full, window = (m.req_to_blocks["a"] for m in kvm.coordinator.single_type_managers)
        assert window[0].is_null and not (window[6].is_null or window[7].is_null)  # (the window moved on)
        f6, f7, w6, w7 = (b.block_id for b in (full[6], full[7], window[6], window[7]))
        kvm.free(a)
        pool.free_block_queue.check()
        victims = [b.block_id for b in pool.get_new_blocks(pool.get_num_free_blocks())]
        order = [bid for bid in victims if bid in (f6, f7, w6, w7)]
        assert order[0] == w6, granularity
        assert order.index(f7) < order.index(f6), granularity
        assert plugin.stats()["hook_errors"] == {}
        plugin.disable()
        plugin.reset_stats()
