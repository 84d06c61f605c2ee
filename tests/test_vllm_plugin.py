"""The kvretain vLLM plugin against vLLM 0.33.0's real scheduler and KV cache manager, on CPU.

No model and no hub access: a tiny Llama ``config.json`` in a temporary directory satisfies ``ModelConfig``,
and the model runner's output is built by hand each step (one sampled token for every request whose prefill
completes in the step or that is decoding). Run by ``scripts/test_vllm.sh`` in ``.venv-vllm``.
"""

from __future__ import annotations

import json
import random
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed in this environment; scripts/test_vllm.sh runs these tests in .venv-vllm",
)

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.request import Request

import kvretain.integrations.vllm as plugin
from kvretain.integrations.vllm._runtime import STATS_KEYS
from kvretain.integrations.vllm.config import PluginConfig, parse_options

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import _vllm_harness as harness

BLOCK = 16


# ---------------------------------------------------------------------------- harness
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return harness.write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), vocab_size=1000, max_len=4096)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Iterator[Clock]:
    c = Clock()
    plugin.set_clock(c)
    yield c
    plugin.set_clock(None)


@pytest.fixture(autouse=True)
def _plugin_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in (plugin.ENV_POLICY, plugin.ENV_OPTIONS, plugin.ENV_MAPPING):
        monkeypatch.delenv(var, raising=False)
    plugin.disable()
    plugin.reset_stats()
    yield
    plugin.disable()
    plugin.reset_stats()


def build_scheduler(
    model_dir: str,
    num_blocks: int,
    *,
    max_num_seqs: int = 8,
    max_batched: int = 256,
    max_model_len: int = 1024,
    kv_events: bool = False,
) -> Scheduler:
    return harness.build_scheduler(
        model_dir,
        num_blocks=num_blocks,
        block_size=BLOCK,
        max_num_seqs=max_num_seqs,
        max_batched_tokens=max_batched,
        max_model_len=max_model_len,
        kv_events=kv_events,
    )


@dataclass
class Spec:
    """A request to replay: built afresh for every run (vLLM requests are mutable)."""

    rid: str
    prompt: list[int]
    max_tokens: int = 4
    priority: int = 0
    extra_args: dict[str, Any] | None = None
    arrival_step: int = 0


_HASHER: dict[str, Any] = {}


def make_request(spec: Spec) -> Request:
    if "h" not in _HASHER:
        _HASHER["h"] = harness.block_hasher(BLOCK)
    return Request(
        request_id=spec.rid,
        prompt_token_ids=list(spec.prompt),
        sampling_params=SamplingParams(
            max_tokens=spec.max_tokens, ignore_eos=True, extra_args=spec.extra_args
        ),
        pooling_params=None,
        arrival_time=float(spec.arrival_step),
        priority=spec.priority,
        block_hasher=_HASHER["h"],
    )


@dataclass
class Run:
    steps: list[tuple[Any, ...]] = field(default_factory=list)
    hits: dict[str, int] = field(default_factory=dict)  # first-schedule hit tokens per request
    preemptions: int = 0
    queries: int = 0
    hit_tokens: int = 0
    events: list[Any] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)


def run(sched: Scheduler, specs: list[Spec], run_: Run | None = None, max_steps: int = 5000) -> Run:
    """Drive ``sched`` until every request finished; returns the per-step record."""
    out_run = run_ or Run()
    pending = sorted(specs, key=lambda s: s.arrival_step)
    publisher = getattr(sched, "kv_event_publisher", None)
    if publisher is not None and not getattr(publisher, "_kvretain_spy", False):
        publisher.publish = lambda batch: out_run.events.extend(batch.events)
        publisher._kvretain_spy = True
    step = 0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0].arrival_step <= step:
            harness.add_request(
                sched, make_request(pending.pop(0))
            )  # (as the engine core: input processing first)
        out = sched.schedule()
        for nr in out.scheduled_new_reqs:
            out_run.hits.setdefault(nr.req_id, nr.num_computed_tokens)
        outs = sched.update_from_output(out, harness.runner_output(sched, out))
        for eco in outs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    out_run.finished.add(o.request_id)
            st = eco.scheduler_stats
            if st is not None and st.prefix_cache_stats is not None:
                out_run.queries += st.prefix_cache_stats.queries
                out_run.hit_tokens += st.prefix_cache_stats.hits
        preempted = sorted(out.preempted_req_ids or [])
        out_run.preemptions += len(preempted)
        out_run.steps.append(
            (
                tuple(sorted(out.num_scheduled_tokens.items())),
                tuple(preempted),
                tuple(sorted((nr.req_id, nr.num_computed_tokens) for nr in out.scheduled_new_reqs)),
            )
        )
        step += 1
        assert step < max_steps, "no progress"
    return out_run


def tokens(seed: int, n: int) -> list[int]:
    """``n`` deterministic pseudo-random token ids (distinct seeds share no block in practice)."""
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def mixed_workload(n: int = 60) -> list[Spec]:
    """Shared system prompts, two priority classes, arrivals in bursts: hits, evictions and preemptions."""
    rng = random.Random(7)
    systems = [tokens(1000 + s, 64) for s in range(4)]
    specs = []
    for i in range(n):
        sysp = systems[i % 4]
        suffix = [rng.randrange(1, 999) for _ in range(rng.randrange(8, 90))]
        specs.append(
            Spec(
                rid=f"r{i:03d}",
                prompt=sysp + suffix,
                max_tokens=rng.randrange(2, 24),
                priority=0 if i % 3 == 0 else 1,
                arrival_step=i // 3,
            )
        )
    return specs


def queue_of(sched: Scheduler) -> Any:
    return sched.kv_cache_manager.block_pool.free_block_queue


def enable(policy: str = "unified", options: str = "", mapping: str = "", granularity: str = "run") -> None:
    from kvretain.core.retention import PriorityMapping

    plugin.enable(
        PluginConfig(
            policy=policy,
            options=parse_options(options),
            mapping=PriorityMapping.parse(mapping),
            granularity=granularity,
        )
    )


QUEUE_CLASS = {"run": "RunFreeQueue", "block": "RetentionFreeQueue"}
GRANULARITY = pytest.mark.parametrize("granularity", ["run", "block"])
"""``unified`` runs at both granularities: runs (the plugin's default) and per block (exact)."""


# ---------------------------------------------------------------------------- (a) off = stock
def test_plugin_off_is_identical_to_stock(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    specs = mixed_workload()
    stock = run(build_scheduler(model_dir, 48, max_num_seqs=8), specs)
    assert stock.preemptions > 0 and stock.hit_tokens > 0, "the recorded workload must exercise both"

    monkeypatch.delenv(plugin.ENV_POLICY, raising=False)
    plugin.register()  # the entry point, with the plugin not enabled
    plugin.register()  # idempotent
    assert not plugin.is_enabled()
    sched = build_scheduler(model_dir, 48, max_num_seqs=8)
    assert type(queue_of(sched)).__name__ == "FreeKVCacheBlockQueue"
    off = run(sched, specs)
    assert off.steps == stock.steps
    assert (off.preemptions, off.queries, off.hit_tokens) == (
        stock.preemptions,
        stock.queries,
        stock.hit_tokens,
    )

    # explicitly disabled values are inert too
    monkeypatch.setenv(plugin.ENV_POLICY, "off")
    plugin.register()
    assert not plugin.is_enabled()


def test_lru_policy_through_the_plugin_reproduces_stock(model_dir: str) -> None:
    """The queue machinery itself is transparent: kvretain's ``lru`` inside vLLM gives vLLM's own schedule."""
    specs = mixed_workload()
    stock = run(build_scheduler(model_dir, 48, max_num_seqs=8), specs)
    enable("lru")
    sched = build_scheduler(model_dir, 48, max_num_seqs=8)
    assert type(queue_of(sched)).__name__ == "RetentionFreeQueue"
    got = run(sched, specs)
    queue_of(sched).check()
    assert got.steps == stock.steps


def test_register_reads_environment_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugin.ENV_POLICY, "no-such-policy")
    plugin.register()
    assert not plugin.is_enabled()
    monkeypatch.setenv(plugin.ENV_POLICY, "unified")
    monkeypatch.setenv(plugin.ENV_OPTIONS, "budget=7")
    plugin.register()
    assert not plugin.is_enabled()
    monkeypatch.setenv(plugin.ENV_OPTIONS, "budget=0.8,isolation_goal=0.92")
    monkeypatch.setenv(plugin.ENV_MAPPING, "0:80,1:20")
    plugin.register()
    plugin.register()
    assert plugin.is_enabled()
    assert plugin.stats()["policy"] == "unified"


# ---------------------------------------------------------------------------- (b) priority protection
def flood(prefix: str, n: int, start_step: int, blocks: int = 5, priority: int = 1) -> list[Spec]:
    return [
        Spec(
            rid=f"{prefix}{i:03d}",
            prompt=tokens(1_000_000 + zlib.crc32(prefix.encode()) % 1000 * 1000 + i, blocks * BLOCK),
            max_tokens=3,
            priority=priority,
            arrival_step=start_step + i,
        )
        for i in range(n)
    ]


def protection_scenario(model_dir: str) -> tuple[Run, Scheduler]:
    system = tokens(1, 10 * BLOCK)
    first = Spec("hi-a", system + tokens(2, 20), priority=0, arrival_step=0)
    again = Spec("hi-b", system + tokens(3, 20), priority=0, arrival_step=200)
    sched = build_scheduler(model_dir, 64, max_num_seqs=4)
    return run(sched, [first, *flood("lo-", 40, 10), again]), sched


@GRANULARITY
def test_high_priority_prefix_survives_a_low_priority_flood(model_dir: str, granularity: str) -> None:
    stock, _ = protection_scenario(model_dir)
    assert stock.hits["hi-b"] == 0, "the flood must evict the prefix under stock vLLM"

    enable("unified", "budget=0.8,isolation_goal=0.92", granularity=granularity)
    got, sched = protection_scenario(model_dir)
    queue_of(sched).check()
    assert got.hits["hi-b"] == 10 * BLOCK
    # the flood itself is unaffected (unique prompts: no hits either way)
    assert sum(v for k, v in got.hits.items() if k.startswith("lo-")) == 0
    st = plugin.stats()["by_priority"]
    assert st[0]["hit_tokens"] == 10 * BLOCK and st[0]["requests"] == 2
    assert st[1]["evicted_blocks"] > 0 and st[0]["evicted_blocks"] == 0
    assert st[1]["hit_tokens"] == 0


# ---------------------------------------------------------------------------- (c) directives + duration
@GRANULARITY
def test_directive_duration_protects_until_it_lapses(model_dir: str, clock: Clock, granularity: str) -> None:
    enable("unified", granularity=granularity)
    sched = build_scheduler(model_dir, 64, max_num_seqs=4)
    system = tokens(11, 10 * BLOCK)
    directive = {"retention_directives": [{"start": 0, "end": 10 * BLOCK, "priority": 90, "duration": 30}]}
    # priority 1 maps to retention 25 (below the protection threshold): only the directive protects it
    owner = Spec("dir-a", system + tokens(12, 20), priority=1, extra_args=directive)
    rec = run(sched, [owner])
    clock.t = 10.0  # within the 30 s
    run(sched, flood("f1-", 40, 0), rec)
    probe1 = Spec("probe-1", system + tokens(13, 20), priority=1)
    run(sched, [probe1], rec)
    assert rec.hits["probe-1"] == 10 * BLOCK, "the directive's range must survive while its duration runs"

    clock.t = 100.0  # the 30 s have lapsed: the range falls back to its mapped priority (25)
    run(sched, flood("f2-", 60, 0), rec)
    probe2 = Spec("probe-2", system + tokens(14, 20), priority=1)
    run(sched, [probe2], rec)
    assert rec.hits["probe-2"] == 0, "after the duration lapses the range is evicted like any other"
    queue_of(sched).check()


def test_directive_without_plugin_does_not_protect(model_dir: str) -> None:
    """Control for the test above: stock vLLM ignores the directive and the flood evicts the range."""
    sched = build_scheduler(model_dir, 64, max_num_seqs=4)
    system = tokens(11, 10 * BLOCK)
    directive = {"retention_directives": [{"start": 0, "end": 10 * BLOCK, "priority": 90, "duration": 30}]}
    rec = run(sched, [Spec("dir-a", system + tokens(12, 20), priority=1, extra_args=directive)])
    run(sched, flood("f1-", 40, 0), rec)
    run(sched, [Spec("probe-1", system + tokens(13, 20), priority=1)], rec)
    assert rec.hits["probe-1"] == 0


@GRANULARITY
def test_directives_as_json_string_and_scope(model_dir: str, clock: Clock, granularity: str) -> None:
    """``vllm_xargs`` carries only strings/numbers: directives may come as a JSON string."""
    enable("unified", granularity=granularity)
    sched = build_scheduler(model_dir, 64, max_num_seqs=4)
    system = tokens(21, 6 * BLOCK)
    xargs = {
        "retention_directives": json.dumps([{"start": 0, "end": 6 * BLOCK, "priority": 95}]),
        "retention_scope": "session-1",
    }
    rec = run(sched, [Spec("s-a", system + tokens(22, 10), priority=1, extra_args=xargs)])
    run(sched, flood("f-", 40, 0), rec)
    run(sched, [Spec("s-b", system + tokens(23, 10), priority=1)], rec)
    assert rec.hits["s-b"] == 6 * BLOCK


# ---------------------------------------------------------------------------- (d) bad directives
BAD = [
    ({"retention_directives": [{"start": 0, "end": 64, "priority": 150}]}, "priority"),
    ({"retention_directives": [{"start": 64, "end": 32, "priority": 50}]}, "before end"),
    ({"retention_directives": "[{not json"}, "not valid JSON"),
    ({"retention_directives": [{"start": 0, "priority": 50, "ttl": 3}]}, "unknown field"),
    ({"retention_directives": {"start": 0}}, "must be a list"),
    ({"retention_scope": 42}, "retention_scope"),
    ({"retention_directives": [{"start": 0, "end": 64, "priority": 50, "duration": -1}]}, "duration"),
]


@pytest.mark.parametrize(("extra", "needle"), BAD)
def test_bad_directives_rejected_at_input(extra: dict[str, Any], needle: str) -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    enable("unified")
    params = SamplingParams(max_tokens=4, extra_args=extra)
    with pytest.raises(VLLMValidationError, match=needle) as err:
        InputProcessor._validate_params(object(), params, ("generate",))
    assert err.value.parameter == "extra_args"
    assert "retention" in str(err.value)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_bad_directives_rejected_before_a_stream_starts(kind: str) -> None:
    """The API server builds ``SamplingParams`` before it answers; ``InputProcessor`` only runs once the engine's
    generator is iterated, which for ``stream: true`` is inside the stream, after HTTP 200 (the client got an
    error event in a 200 stream and the server log a traceback). A bad retention field now fails where vLLM's
    own sampling-parameter errors do: a 400 before the stream."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    body: dict[str, Any] = {"model": "m", "stream": True, "vllm_xargs": {"retention_directives": "[{"}}
    if kind == "chat":
        req: Any = ChatCompletionRequest(**body, messages=[{"role": "user", "content": "hi"}])
    else:
        req = CompletionRequest(**body, prompt="hi")
    req.to_sampling_params(4, {})  # plugin off: vLLM's own behaviour
    enable("unified")
    with pytest.raises(VLLMValidationError, match="not valid JSON") as err:
        req.to_sampling_params(4, {})
    assert err.value.parameter == "extra_args"
    good = {"retention_directives": '[{"start": 0, "end": null, "priority": 80}]'}
    req.vllm_xargs = good
    assert req.to_sampling_params(4, {}).extra_args == good


def test_bad_directives_fail_only_their_request(model_dir: str) -> None:
    """Engine-core path: ``preprocess_add_request`` raises ``VLLMValidationError``, which EngineCoreProc turns
    into a per-request ``validation_error`` output; the other requests run to completion."""
    from types import SimpleNamespace

    from vllm.v1.engine.core import EngineCore

    enable("unified")
    sched = build_scheduler(model_dir, 64)
    make_request(Spec("warmup", [1]))  # initialises the hasher
    fake_core = SimpleNamespace(
        mm_receiver_cache=None, request_block_hasher=_HASHER["h"], structured_output_manager=None
    )
    good = {"retention_directives": [{"start": 0, "end": 32, "priority": 80, "duration": 5}]}
    incoming = [("ok-1", good), ("bad-1", BAD[0][0]), ("ok-2", None), ("bad-2", BAD[2][0]), ("ok-3", good)]
    errors: dict[str, str] = {}
    for rid, extra in incoming:
        ecr = EngineCoreRequest(
            request_id=rid,
            prompt_token_ids=tokens(zlib.crc32(rid.encode()), 70),
            mm_features=None,
            sampling_params=SamplingParams(max_tokens=3, ignore_eos=True, extra_args=extra),
            pooling_params=None,
            arrival_time=0.0,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )
        try:
            req, _wave = EngineCore.preprocess_add_request(fake_core, ecr)
        except VLLMValidationError as exc:  # what EngineCoreProc._handle_request_validation_error receives
            errors[rid] = str(exc)
            continue
        sched.add_request(req)
    assert set(errors) == {"bad-1", "bad-2"}
    assert "retention_directives[0]" in errors["bad-1"] and "[0, 100]" in errors["bad-1"]
    assert "JSON" in errors["bad-2"]
    rec = run(sched, [])
    assert rec.finished == {"ok-1", "ok-2", "ok-3"}


@GRANULARITY
def test_the_controller_sees_a_request_at_input_processing(
    model_dir: str, granularity: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM hashes a request's blocks at input processing (``EngineCore.preprocess_add_request``, on its input
    thread): the controller's shadows see them there and the first lookup only accounts for them; a failing
    arrival hook is counted and leaves that work to the lookup."""
    from types import SimpleNamespace

    from vllm.v1.engine.core import EngineCore

    from kvretain.integrations.vllm._base import SIGHTING

    enable("unified", granularity=granularity)
    sched = build_scheduler(model_dir, 64)
    make_request(Spec("warmup", [1]))  # initialises the hasher
    core = SimpleNamespace(
        mm_receiver_cache=None,
        request_block_hasher=_HASHER["h"],
        structured_output_manager=None,
        scheduler=sched,
    )
    q = queue_of(sched)
    ctl = q._ctl if granularity == "run" else q.policy._ctl

    def arrive(rid: str) -> Request:
        ecr = EngineCoreRequest(
            request_id=rid,
            prompt_token_ids=tokens(zlib.crc32(rid.encode()), 70),
            mm_features=None,
            sampling_params=SamplingParams(max_tokens=3, ignore_eos=True),
            pooling_params=None,
            arrival_time=0.0,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )
        req, _wave = EngineCore.preprocess_add_request(core, ecr)
        return req  # type: ignore[no-any-return]

    a = arrive("a")
    seen = getattr(a, SIGHTING)
    # (a 64-block pool: every block is tracked) the shadows hold a's 4 full blocks before any step
    assert seen.blocks == len(a.block_hashes) == 4 and len(ctl._lru.entries) == 4 and ctl._acc[4] == 0.0
    sched.add_request(a)
    assert run(sched, []).finished == {"a"}
    assert getattr(a, SIGHTING) is None and len(ctl._lru.entries) == 4 and ctl._acc[4] > 0.0  # accounted once

    def broken(request: Any) -> None:
        raise RuntimeError("arrival hook down")

    monkeypatch.setattr(type(q), "on_arrival", broken)
    b = arrive("b")
    assert getattr(b, SIGHTING, None) is None and len(ctl._lru.entries) == 4
    assert plugin.stats()["hook_errors"] == {"arrival": 1}
    sched.add_request(b)
    assert run(sched, []).finished == {"b"}
    assert len(ctl._lru.entries) == 8  # the lookup referenced b's blocks itself
    queue_of(sched).check()


def test_the_arrival_hook_skips_streaming_chunks_and_never_raises(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A streaming-input chunk (``resumable``) is merged into its session by vLLM's scheduler and its hashes
    start over at the chunk: the shadows must not see them. Whatever fails in the hook stays in it."""
    from kvretain.integrations.vllm._base import SIGHTING
    from kvretain.integrations.vllm._patches import request_arrived

    enable("unified")
    sched = build_scheduler(model_dir, 64)
    ctl = queue_of(sched)._ctl
    chunk = make_request(Spec("s", tokens(11, 70)))
    chunk.resumable = True
    request_arrived(sched.kv_cache_manager, chunk)
    assert getattr(chunk, SIGHTING, None) is None and not ctl._lru.entries

    def boom(request: Any) -> bool:
        raise RuntimeError("lookup check down")

    monkeypatch.setattr(sched.kv_cache_manager, "prefix_cache_lookup_enabled", boom)
    plain = make_request(Spec("p", tokens(12, 70)))
    request_arrived(sched.kv_cache_manager, plain)  # (no exception reaches vLLM's input thread)
    assert getattr(plain, SIGHTING, None) is None and plugin.stats()["hook_errors"] == {"arrival": 1}


@GRANULARITY
def test_invalid_directives_reaching_the_kv_manager_never_raise(model_dir: str, granularity: str) -> None:
    """Defence in depth: if a bad request bypasses validation, its blocks get default retention."""
    enable("unified", granularity=granularity)
    sched = build_scheduler(model_dir, 64)
    rec = run(sched, [Spec("sneaky", tokens(5, 70), extra_args=BAD[0][0]), Spec("fine", tokens(6, 70))])
    assert rec.finished == {"sneaky", "fine"}
    queue_of(sched).check()


def _free_order(sched: Scheduler) -> list[int]:
    return [b.block_id for b in queue_of(sched).get_all_free_blocks()]


def test_lru_keeps_vllms_free_order_through_a_prefix_cache_reset(model_dir: str) -> None:
    """``reset_prefix_cache`` strips every hash and vLLM's list keeps its order (its cached blocks, oldest first,
    behind the empty ones): ``lru`` keeps it too, so the blocks handed out after a reset are stock's. The queue
    moved its cached blocks to the empty list by block id, and every later request got other blocks than in stock
    vLLM (the same hits, other block tables)."""
    specs = mixed_workload()
    later = [Spec(f"after{i}", tokens(300 + i % 3, 40 + 9 * i), arrival_step=i) for i in range(12)]
    tables: dict[str, list[Any]] = {}
    for side in ("stock", "lru"):
        plugin.disable()
        if side == "lru":
            enable("lru")
        sched = build_scheduler(model_dir, 48, max_num_seqs=8)
        run(sched, specs)
        before = _free_order(sched)
        assert sched.reset_prefix_cache()
        rec = run(sched, later)
        tables[side] = [before, _free_order(sched), rec.steps]
        if side == "lru":
            queue_of(sched).check()
    assert tables["lru"][0] == tables["stock"][0]  # (the same order before the reset)
    assert tables["lru"] == tables["stock"]


# ---------------------------------------------------------------------------- (e) vLLM invariants
@GRANULARITY
def test_invariants_free_blocks_events_stats_and_reset(model_dir: str, granularity: str) -> None:
    enable("unified", granularity=granularity)
    num_blocks = 48
    sched = build_scheduler(model_dir, num_blocks, max_num_seqs=8, kv_events=True)
    kvm = sched.kv_cache_manager
    pool = kvm.block_pool
    q = queue_of(sched)
    assert type(q).__name__ == QUEUE_CLASS[granularity]
    assert pool.get_num_free_blocks() == num_blocks - 1  # everything but the null block

    rec = run(sched, mixed_workload())
    q.check()
    # all requests finished: every block (cached or empty) counts as free again, as in stock vLLM
    assert pool.get_num_free_blocks() == num_blocks - 1
    assert kvm.usage == pytest.approx(0.0)
    assert q._held > 0, "cached blocks are held by the policy and still count as free"
    assert rec.preemptions > 0 and rec.hit_tokens > 0 and rec.queries > 0

    stored = [h for e in rec.events if isinstance(e, BlockStored) for h in e.block_hashes]
    removed = [h for e in rec.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert stored and removed, "BlockStored and BlockRemoved events keep flowing"
    cached_now = {b.block_hash for b in pool.blocks if b.block_hash is not None}
    assert len(stored) - len(removed) == len(cached_now)
    assert len(pool.cached_block_hash_to_block) == len(cached_now)

    # cache hits: a repeat of a finished request's prompt hits its cached blocks
    prompt = tokens(1000, 64) + tokens(77, 40)
    rec2 = run(sched, [Spec("warm", prompt), Spec("again", prompt, arrival_step=30)])
    assert rec2.hits["again"] == 6 * BLOCK
    assert rec2.hit_tokens >= 6 * BLOCK  # prefix-cache stats (vllm:prefix_cache_hits) see the hits

    # reset_prefix_cache: all hashes gone, the policy is emptied, free count unchanged, AllBlocksCleared sent
    assert kvm.reset_prefix_cache()
    q.check()
    assert q._held == 0
    assert pool.get_num_free_blocks() == num_blocks - 1
    assert all(b.block_hash is None for b in pool.blocks)
    events = kvm.take_events()
    assert any(isinstance(e, AllBlocksCleared) for e in events)
    rec3 = run(sched, [Spec("after-reset", prompt)])
    assert rec3.hits["after-reset"] == 0
    run(sched, [Spec("after-reset-2", prompt)], rec3)
    assert rec3.hits["after-reset-2"] == 6 * BLOCK
    q.check()

    # reset refuses while blocks are in use, exactly like stock
    sched.add_request(make_request(Spec("busy", tokens(9, 40), max_tokens=50)))
    sched.schedule()
    assert not kvm.reset_prefix_cache()
    q.check()


@GRANULARITY
def test_evict_blocks_of_free_cached_blocks(model_dir: str, granularity: str) -> None:
    """The KV connector's ``evict_blocks`` path strips hashes of free blocks: they leave the policy."""
    enable("unified", granularity=granularity)
    sched = build_scheduler(model_dir, 32)
    run(sched, [Spec("x", tokens(3, 80))])
    pool = sched.kv_cache_manager.block_pool
    cached = [b.block_id for b in pool.blocks if b.block_hash is not None]
    assert cached
    sched.kv_cache_manager.evict_blocks(set(cached))
    q = queue_of(sched)
    q.check()
    assert q._held == 0 and pool.get_num_free_blocks() == 31
    rec = run(sched, [Spec("y", tokens(3, 80))])
    assert rec.hits["y"] == 0
    q.check()


@GRANULARITY
def test_evict_blocks_of_blocks_in_use_are_counted_as_vllm_removes_them(
    model_dir: str, granularity: str
) -> None:
    """``evict_blocks`` on blocks a running request holds (a KV connector's failed load): vLLM removes every hash
    (``BlockRemoved``). The run queue counted only content a release had registered, under a stale class: the
    running request's own new blocks were not counted at all, and a prefix it hit not under its last releaser."""
    enable("unified", granularity=granularity)
    sched = build_scheduler(model_dir, 32, kv_events=True)
    kvm = sched.kv_cache_manager
    prompt = tokens(3, 80)
    run(sched, [Spec("a", prompt, priority=3)])  # 5 full blocks cached, released by priority 3
    sched.add_request(make_request(Spec("b", prompt[:64] + tokens(4, 48), max_tokens=50, priority=5)))
    out = sched.schedule()  # b hits a's first 4 blocks and computes 3 of its own, and keeps running
    sched.update_from_output(out, harness.runner_output(sched, out))
    pool = kvm.block_pool
    held = {b.block_id for b in pool.blocks if b.block_hash is not None and b.ref_cnt > 0}
    assert len(held) == 7
    kvm.take_events()
    before = {p: c["evicted_blocks"] for p, c in plugin.stats()["by_priority"].items()}
    kvm.evict_blocks(held)
    removed = sum(len(e.block_hashes) for e in kvm.take_events() if isinstance(e, BlockRemoved))
    after = {p: c["evicted_blocks"] for p, c in plugin.stats()["by_priority"].items()}
    counted = {p: n - before.get(p, 0) for p, n in after.items() if n != before.get(p, 0)}
    assert removed == 7 and sum(counted.values()) == 7, counted
    assert counted.get(3) == 4, counted  # the prefix b hit: its last releaser's class
    queue_of(sched).check()


def build_hybrid(model_dir: str, num_blocks: int, second: str, window_blocks: int = 2) -> Scheduler:
    """A scheduler over two KV cache groups of one pool: full attention, and sliding-window or chunked-local
    attention (``window_blocks`` blocks), whose manager frees blocks while their request runs."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    model = ModelConfig(
        model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True, max_model_len=1024, dtype="float32"
    )
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=96, max_model_len=1024, is_encoder_decoder=False
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        device_config=DeviceConfig(device="cpu"),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    shape = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 16, "dtype": torch.float32}
    spec: Any = (
        SlidingWindowSpec(**shape, sliding_window=window_blocks * BLOCK)
        if second == "sliding_window"
        else ChunkedLocalAttentionSpec(**shape, attention_chunk_size=window_blocks * BLOCK)
    )
    groups = [
        KVCacheGroupSpec(["model.layers.0.self_attn"], FullAttentionSpec(**shape)),
        KVCacheGroupSpec(["model.layers.1.self_attn"], spec),
    ]
    return Scheduler(
        vllm_config=config,
        kv_cache_config=KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups),
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
        log_stats=True,
    )


@GRANULARITY
@pytest.mark.parametrize("second", ["sliding_window", "chunked_local"])
def test_blocks_a_window_frees_mid_request_take_their_requests_retention(
    model_dir: str, granularity: str, second: str
) -> None:
    """A sliding window (or an attention chunk) moving past a running request's blocks frees them through vLLM's
    ``free_blocks`` with no release: they were queued at class 0's default retention (35), charged to class 0,
    whoever computed them. Released at their request's priority and directives now."""
    enable("unified", granularity=granularity)
    sched = build_hybrid(model_dir, 61, second)
    q = queue_of(sched)
    window = sched.kv_cache_manager.coordinator.single_type_managers[1]
    # priority 5 maps to retention 0; a directive keeps its first 4 blocks at 90
    extra = {"retention_directives": [{"start": 0, "end": 4 * BLOCK, "priority": 90}]}
    sched.add_request(
        make_request(Spec("b", tokens(11, 12 * BLOCK), max_tokens=30, priority=5, extra_args=extra))
    )
    seen: dict[int, int] = {}  # position in the window group -> block id, while the request holds it
    freed: dict[int, int] = {}  # block id -> its position
    for _ in range(8):
        out = sched.schedule()
        sched.update_from_output(out, harness.runner_output(sched, out))
        for pos, b in enumerate(window.req_to_blocks.get("b", [])):
            if not b.is_null:
                seen[pos] = b.block_id
            elif pos in seen:
                freed[seen.pop(pos)] = pos
    assert len(freed) >= 6, freed
    for bid, pos in freed.items():
        if granularity == "run":
            run_ = q._run_of[bid]
            retention, cls = q._r[bid], run_.cls if run_ is not None else None
        else:
            retention, cls = q.policy.retention_of(bid, 0.0), q._cls[bid]
        assert (retention, cls) == (90 if pos < 4 else 0, 5), (bid, pos, retention, cls)
    q.check()
    assert plugin.stats()["hook_errors"] == {}


def _retentions(q: Any, granularity: str, ids: list[int]) -> list[tuple[int, Any]]:
    if granularity == "run":
        return [(q._r[i], q._run_of[i].cls if q._run_of[i] is not None else None) for i in ids]
    return [(q.policy.retention_of(i, 0.0), q._cls[i]) for i in ids]


@GRANULARITY
@pytest.mark.parametrize("second", ["sliding_window", "chunked_local"])
def test_a_deferred_free_releases_at_the_same_retention_as_free(
    model_dir: str, granularity: str, second: str
) -> None:
    """vLLM's deferred free (``pop_blocks_for_free``, then ``BlockPool.free_blocks`` later: a KV-consumer connector
    with async scheduling or pipeline parallelism) releases each block as ``free`` does. The hook read what vLLM
    returned, every group's blocks concatenated without their leading null blocks: positions were not token
    positions and, over two groups, the directives were dropped (every block at the mapped priority)."""
    extra = {
        "retention_directives": [
            {"start": 0, "end": 2 * BLOCK, "priority": 90},
            {"start": 4 * BLOCK, "end": 6 * BLOCK, "priority": 70},
        ]
    }
    seen = []
    for deferred in (False, True):
        enable("unified", granularity=granularity)
        sched = build_hybrid(model_dir, 61, second)
        sched.add_request(
            make_request(Spec("b", tokens(11, 6 * BLOCK + 3), max_tokens=30, priority=5, extra_args=extra))
        )
        for _ in range(2):
            out = sched.schedule()
            sched.update_from_output(out, harness.runner_output(sched, out))
        kvm = sched.kv_cache_manager
        req = sched.requests["b"]
        ids = sorted({b.block_id for g in kvm.coordinator.get_blocks("b") for b in g if not b.is_null})
        if deferred:
            popped = kvm.pop_blocks_for_free(req)
            kvm.block_pool.free_blocks(reversed(popped))
        else:
            kvm.free(req)
        q = queue_of(sched)
        q.check()
        assert plugin.stats()["hook_errors"] == {}
        seen.append(_retentions(q, granularity, ids))
        plugin.disable()
    assert {r for r, _ in seen[0]} >= {90, 70}, seen[0]
    assert seen[1] == seen[0]


def test_import_is_lazy() -> None:
    """``import kvretain.integrations.vllm`` must not import vLLM (checked in a fresh interpreter)."""
    import subprocess
    import sys

    code = (
        "import sys, kvretain, kvretain.integrations.vllm as p; p.register(); "
        "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if m.startswith('vllm'))"
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("KVRETAIN_")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# ---------------------------------------------------------------------------- honest counting, both forms
COUNTED = STATS_KEYS  # (ClassStats field, the plugin's name): every counter, compared field by field


def counting_workload(seed: int, n: int) -> list[tuple[str, list[int], int, int, int]]:
    """``n`` requests ``(id, prompt, max_tokens, priority, arrival step)``: three shared system prompts of 1-4 blocks
    and a tail of 1-60 tokens each (seeded)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 1000) for _ in range(BLOCK * rng.randint(1, 4))] for _ in range(3)]
    out, step = [], 0
    for i in range(n):
        step += rng.randint(0, 2)
        prompt = list(rng.choice(systems)) + [rng.randrange(1, 1000) for _ in range(rng.randint(1, 60))]
        out.append((f"r{i}", prompt, rng.randint(1, 40), rng.choice([0, 1, 2]), step))
    return out


def count_in_core(wl: list[Any], blocks: int, policy: str, budget: int, queue: str) -> tuple[dict, int]:
    """The workload through kvretain's own scheduler and cache: per-class counts, preemptions."""
    from kvretain.core.kv_cache_manager import KVCacheManager
    from kvretain.sched.config import SchedulerConfig
    from kvretain.sched.output import RunnerOutput
    from kvretain.sched.request import Request as CoreRequest
    from kvretain.sched.scheduler import Scheduler as CoreScheduler

    t = [0.0]
    pcfg = PluginConfig(policy=policy, granularity="block").policy_config(BLOCK)
    kv = KVCacheManager(blocks - 1, BLOCK, policy=policy, config=pcfg, clock=lambda: t[0])
    cfg = SchedulerConfig(
        policy=queue, max_num_batched_tokens=budget, max_num_seqs=8, enable_chunked_prefill=True
    )
    s = CoreScheduler(kv, cfg, clock=lambda: t[0])
    pending, step, preempted = list(wl), 0, 0
    while pending or s.has_unfinished():
        t[0] = step * 0.01
        while pending and pending[0][4] <= step:
            rid, prompt, max_tokens, prio, at = pending.pop(0)
            s.add_request(CoreRequest(rid, prompt, max_tokens, at * 0.01, prio))
        out = s.schedule()
        preempted += len(out.preempted)
        sampled = [c.request_id for c in out.chunks if c.samples]
        s.update_from_output(out, RunnerOutput(tuple(sampled), (harness.SAMPLED_TOKEN,) * len(sampled)))
        step += 1
        assert step < 5000
    counts = {c: tuple(getattr(v, f) for f, _ in COUNTED) for c, v in sorted(kv.stats.items())}
    return counts, preempted


def count_in_vllm(
    wl: list[Any], blocks: int, policy: str, budget: int, queue: str, model_dir: str, granularity: str
) -> tuple[dict, int, tuple[int, int]]:
    """The same workload through vLLM 0.33's scheduler with the plugin: per-class counts, preemptions and vLLM's
    own PrefixCacheStats (queries, hits)."""
    plugin.reset_stats()
    t = [0.0]
    plugin.set_clock(lambda: t[0])
    plugin.enable(PluginConfig(policy=policy, granularity=granularity))
    try:
        s = harness.build_scheduler(
            model_dir,
            num_blocks=blocks,
            block_size=BLOCK,
            max_num_seqs=8,
            max_batched_tokens=budget,
            max_model_len=1024,
            policy=queue,
        )
        hasher = harness.block_hasher(BLOCK)
        pending, step, preempted, queries, hits = list(wl), 0, 0, 0, 0
        while pending or s.has_unfinished_requests():
            t[0] = step * 0.01
            while pending and pending[0][4] <= step:
                rid, prompt, max_tokens, prio, at = pending.pop(0)
                sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
                req = Request(
                    request_id=rid,
                    prompt_token_ids=list(prompt),
                    sampling_params=sp,
                    pooling_params=None,
                    arrival_time=at * 0.01,
                    priority=prio,
                    block_hasher=hasher,
                )
                harness.add_request(s, req)
            out = s.schedule()
            preempted += len(out.preempted_req_ids or ())
            for eco in s.update_from_output(out, harness.runner_output(s, out)).values():
                st = eco.scheduler_stats
                if st is not None and st.prefix_cache_stats is not None:
                    queries += st.prefix_cache_stats.queries
                    hits += st.prefix_cache_stats.hits
            step += 1
            assert step < 5000
        by = plugin.stats()["by_priority"]
        return (
            {c: tuple(v[name] for _, name in COUNTED) for c, v in sorted(by.items())},
            preempted,
            (queries, hits),
        )
    finally:
        plugin.disable()
        plugin.set_clock(None)


@pytest.mark.parametrize(
    ("seed", "policy", "blocks", "budget", "queue", "granularity"),
    [
        (0, "lru", 24, 64, "priority", "block"),
        (1, "lru", 24, 64, "fcfs", "block"),
        (100, "unified", 24, 32, "priority", "block"),
        (101, "unified", 20, 48, "priority", "run"),
        (102, "lru", 18, 24, "priority", "run"),
    ],
)
def test_the_core_and_the_plugin_count_alike(
    model_dir: str, seed: int, policy: str, blocks: int, budget: int, queue: str, granularity: str
) -> None:
    """One seeded workload (three classes, shared prefixes, chunked prefill, preemptions) through kvretain's own
    scheduler and cache and through vLLM's with the plugin: the same per-class counts of first lookups, resumes,
    released cached blocks and evictions (the core counted a request's partial last block as released, the
    plugin only the blocks with content), and the plugin's lookups are vLLM's own PrefixCacheStats."""
    wl = counting_workload(seed, 50)
    core, core_preempted = count_in_core(wl, blocks, policy, budget, queue)
    vllm, vllm_preempted, (queries, hits) = count_in_vllm(
        wl, blocks, policy, budget, queue, model_dir, granularity
    )
    assert core_preempted == vllm_preempted > 0
    assert core == vllm
    assert sum(v[1] for v in vllm.values()) == queries  # (first lookups: vLLM counts resumes apart too)
    assert sum(v[2] for v in vllm.values()) == hits
    for v in vllm.values():
        assert v[2] <= v[1] and v[5] <= v[4]


def test_a_request_looked_up_again_after_a_failed_kv_load_is_no_second_first_lookup() -> None:
    """vLLM's sequence for a request whose asynchronous KV-connector load fails under the recompute policy: admitted
    (its lookup recorded), the load fails, its blocks are freed and it waits again with ``num_preemptions`` still 0,
    and its next admission is recorded again. That second lookup is no first lookup: counted as a resume, and not
    fed to the protection controller (it counted twice, in both)."""
    import torch
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvretain.integrations.vllm._patches import request_arrived

    def req(rid: str, prompt: list[int]) -> Request:
        init_none_hash(sha256)
        return Request(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=4),
            pooling_params=None,
            priority=1,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
        )

    plugin.reset_stats()
    plugin.enable(PluginConfig(policy="unified"))
    try:
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
        cfg = KVCacheConfig(
            num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)]
        )
        kvm = KVCacheManager(
            cfg, max_model_len=256, scheduler_block_size=BLOCK, hash_block_size=BLOCK, enable_caching=True
        )
        q = kvm.block_pool.free_block_queue
        warm = req("warm", list(range(48)))
        assert kvm.allocate_slots(warm, 48) is not None
        kvm.free(warm)
        r = req("r", list(range(48)) + [7] * 40)
        request_arrived(kvm, r)
        blocks, hit = kvm.get_computed_blocks(r)[:2]
        assert hit == 48
        assert (
            kvm.allocate_slots(r, 0, hit, blocks, num_external_computed_tokens=16, delay_cache_blocks=True)
            is not None
        )
        kvm.record_prefix_cache_stats(r, hit)  # (its admission)
        r.num_computed_tokens = 0  # the load failed: recompute, blocks freed, waiting again, not preempted
        kvm.free(r)
        assert r.num_preemptions == 0
        blocks, hit = kvm.get_computed_blocks(r)[:2]
        assert kvm.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
        kvm.record_prefix_cache_stats(r, hit)
        c = plugin.stats()["by_priority"][1]
        assert (c["requests"], c["query_tokens"], c["hit_tokens"]) == (1, 88, 48)
        assert (c["preempted_requests"], c["preempted_query_tokens"]) == (1, 88)
        assert q._ctl._lookups == 1
    finally:
        plugin.disable()
        plugin.reset_stats()


@pytest.mark.parametrize("granularity", ["run", "block"])
def test_the_queue_sizes_its_policy_by_the_blocks_that_can_hold_content(granularity: str) -> None:
    """vLLM's pool keeps one block as its null block, which never holds content: the protected budget and the
    controller's shadows are sized by the other blocks. Sized by every block id, the controller's LRU shadow
    modelled a cache one block larger than the pool, and on a small pool read the pool as short of plain LRU
    (the reuse floor bound, protection fell) where kvretain's pool of the same usable size did not."""
    from vllm.v1.core.block_pool import BlockPool

    from kvretain.core.policy import PolicyConfig
    from kvretain.integrations.vllm.metrics import _queue_stats

    plugin.enable(PluginConfig(policy="unified", granularity=granularity))
    pool = BlockPool(41, enable_caching=True, hash_block_size=BLOCK)
    q = pool.free_block_queue
    assert q.num_free_blocks == 40  # (the null block is taken out)
    assert q.capacity == 40
    assert _queue_stats(q)["protected_budget"] == pytest.approx(PolicyConfig().budget * 40)
    if granularity == "block":
        assert q.policy.num_blocks == 41 and q.policy.capacity == 40  # ids over the whole pool


def _failed_load_run(
    model_dir: str, side: str, direct: bool
) -> tuple[list[int], list[tuple[int, bool]], Run, list[Any]]:
    """A KV connector's failed load, on stock vLLM (``side`` "stock") or the plugin: a warm pool, then either
    vLLM's own path (two running requests that hit one cached prefix report its second block failed, under
    ``kv_load_failure_policy="fail"``: ``Scheduler._handle_invalid_blocks`` strips the hashes of their blocks
    from that one on with ``evict_blocks`` and fails both) or, ``direct``, ``evict_blocks`` on three free cached
    blocks from the middle of the order. Returns the stripped blocks, the free order after (each block with
    whether it is cached), and the run of later requests with their first block tables (the blocks each was
    given: the victims)."""
    from vllm.v1.outputs import KVConnectorOutput

    plugin.disable()
    if side != "stock":
        policy, _, granularity = side.partition("-")
        enable(policy, granularity=granularity or "run")
    plugin.reset_stats()
    sched = build_scheduler(model_dir, 48, max_num_seqs=8, kv_events=True)
    sched.recompute_kv_load_failures = False  # (what a connector's kv_load_failure_policy="fail" sets)
    kvm = sched.kv_cache_manager
    specs = mixed_workload(24)
    rec = run(sched, specs)
    if direct:
        cached = [b.block_id for b in queue_of(sched).get_all_free_blocks() if b.block_hash is not None]
        stripped = [cached[3], cached[7], cached[8]]
        kvm.evict_blocks(set(stripped))
    else:
        system = specs[1].prompt[:64]  # (a system prompt the warm-up left cached: 4 blocks)
        for rid, seed in (("fa", 1), ("fb", 2)):
            sched.add_request(make_request(Spec(rid, system + tokens(500 + seed, 30), max_tokens=20)))
        sched.add_request(make_request(Spec("ok", tokens(600, 40), max_tokens=20)))
        out = sched.schedule()
        assert {nr.req_id: nr.num_computed_tokens for nr in out.scheduled_new_reqs}["fa"] == 64
        table = kvm.get_block_ids("fa")[0]
        stripped = list(table[1:])
        assert kvm.get_block_ids("fb")[0][1] == table[1]
        ro = harness.runner_output(sched, out)
        ro.kv_connector_output = KVConnectorOutput(invalid_block_ids={table[1]})
        sched.update_from_output(out, ro)
        assert "fa" not in sched.requests and "fb" not in sched.requests and "ok" in sched.requests
    order = [(b.block_id, b.block_hash is not None) for b in queue_of(sched).get_all_free_blocks()]
    assert all(kvm.block_pool.blocks[b].block_hash is None for b in stripped)
    assert set(stripped) <= {b for b, _ in order}  # (all free now)
    if side != "stock":
        queue_of(sched).check()
    tables: list[Any] = []
    inner = sched.schedule

    def schedule() -> Any:
        out = inner()
        tables.extend((nr.req_id, nr.block_ids) for nr in out.scheduled_new_reqs)
        return out

    sched.schedule = schedule  # type: ignore[method-assign]
    later = [Spec(f"late{i}", tokens(700 + i % 4, 40 + 11 * i), arrival_step=i) for i in range(16)]
    run(sched, later, rec)  # (one record: every KV event of the whole sequence)
    if side != "stock":
        queue_of(sched).check()
    return stripped, order, rec, tables


@pytest.mark.parametrize("direct", [False, True], ids=["connector", "direct"])
def test_lru_treats_blocks_of_a_failed_kv_load_as_stock_vllm_does(model_dir: str, direct: bool) -> None:
    """Stock vLLM's ``BlockPool.evict_blocks`` (``_maybe_evict_cached_block``) drops a block's hash and nothing
    else: a free block stays where it lies in the one free list, to be handed out in its turn; a block in use
    (vLLM's own caller, ``Scheduler._handle_invalid_blocks``, names only running requests' blocks) is freed by
    its failed request unhashed, to the front. ``lru`` moved a free one ahead of every cached block instead
    (``put_unhashed``): other blocks handed out next than in stock vLLM."""
    stock = _failed_load_run(model_dir, "stock", direct)
    lru = _failed_load_run(model_dir, "lru", direct)
    assert lru[0] == stock[0]  # (the same blocks stripped)
    assert lru[1] == stock[1]  # the same free order
    assert lru[2].steps == stock[2].steps and lru[2].hits == stock[2].hits
    assert lru[3] == stock[3]  # the same blocks handed to every later request
    # and each hash vLLM removed (BlockRemoved: the stripped ones, the later victims) counted once as evicted
    removed = sum(len(e.block_hashes) for e in stock[2].events if isinstance(e, BlockRemoved))
    assert removed == sum(len(e.block_hashes) for e in lru[2].events if isinstance(e, BlockRemoved))
    assert sum(c["evicted_blocks"] for c in plugin.stats()["by_priority"].values()) == removed
    ids = [b for b, _ in stock[1]]
    before = [cached for _, cached in stock[1][: min(map(ids.index, stock[0]))]]
    assert any(before) is direct  # (a free one stays among the cached blocks; a freed one comes first)


@pytest.mark.parametrize("side", ["unified", "unified-block"])
@pytest.mark.parametrize("direct", [False, True], ids=["connector", "direct"])
def test_unified_reuses_blocks_of_a_failed_kv_load_before_any_cached_block(
    model_dir: str, side: str, direct: bool
) -> None:
    """``unified``'s rule for a block without content: it is reused before any cached block (it holds nothing
    to keep). A failed load's blocks in use come back unhashed at the front, as in stock vLLM; free ones whose
    hash ``evict_blocks`` stripped join the empty blocks, behind those already there."""
    stripped, order, _, _ = _failed_load_run(model_dir, side, direct)
    ids = [b for b, _ in order]
    first_cached = next(i for i, (_, cached) in enumerate(order) if cached)
    assert max(map(ids.index, stripped)) < first_cached
