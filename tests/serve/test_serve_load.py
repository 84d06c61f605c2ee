"""A bounded load test: 64 concurrent streaming clients of two priorities against the plugin server."""

from __future__ import annotations

import asyncio
import random
import time

import openai
from _client import metric_first, metric_samples, user

from conftest import BLOCK, MAX_MODEL_LEN, NUM_BLOCKS
from kvretain.integrations.vllm.launch import stream_chat

CLIENTS = 64
DURATION_S = 20.0
"""Clients start requests for this long, then finish the ones in flight (each is 16 tokens)."""
MAX_TOKENS = 16
PROMPTS_PER_CLASS = 8
# One request runs at a time: a prompt of more than half the usable pool (NUM_BLOCKS - 1: vLLM keeps a null block)
# leaves no room to admit a second distinct one, and the prompt and its output fit the model's length. More of the
# 64 clients' requests then wait in the scheduler's queue, where priority acts (its mean length is reported: 7-38
# in session 17's runs); the rest of their wait is the API server and this client on the shared host, alike for
# both classes (see the assertions). At three running requests (~260-token prompts), with the host busy, one run
# served 201 class-0 and 197 class-1 requests at client p50 TTFTs of 2.96 and 2.99 s
MIN_PROMPT_TOKENS = BLOCK * ((NUM_BLOCKS - 1) // 2) + 1
MAX_PROMPT_TOKENS = MAX_MODEL_LEN - MAX_TOKENS


async def _stream(client, model, prompt, priority):
    got = await stream_chat(client, model, prompt, priority, MAX_TOKENS)
    return got.ttft, got.text, got.usage.completion_tokens if got.usage else None


def _p99(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def test_64_streaming_clients_of_two_priorities(servers, text):
    srv = servers["plugin"]
    srv.reset_cache()
    prompts = {
        c: [_one_at_a_time(srv, text, f"load-{c}-{i}") for i in range(PROMPTS_PER_CLASS)] for c in (0, 1)
    }
    results: list[tuple[int, int, float | None, str, int | None]] = []
    errors: list[str] = []

    async def client_loop(k: int, deadline: float) -> None:
        cls = k % 2
        rng = random.Random(k)
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=srv.key, max_retries=0, timeout=120)
        try:
            while time.monotonic() < deadline:
                i = rng.randrange(PROMPTS_PER_CLASS)
                try:
                    ttft, out, n = await _stream(client, srv.model, prompts[cls][i], cls)
                except openai.APIError as exc:  # a clean error is allowed; it is reported
                    errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                results.append((cls, i, ttft, out, n))
        finally:
            await client.close()

    waiting: list[float] = []

    async def watch(deadline: float) -> None:  # the scheduler's waiting queue, as vLLM's metrics report it
        while time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            got = metric_first(await asyncio.to_thread(metric_samples, srv), "vllm:num_requests_waiting")
            if got is not None:
                waiting.append(got)

    async def main() -> None:
        deadline = time.monotonic() + DURATION_S
        loops = [client_loop(k, deadline) for k in range(CLIENTS)]
        await asyncio.wait_for(asyncio.gather(watch(deadline), *loops), 300)

    before = _server_ttft(srv)
    asyncio.run(main())
    after = _server_ttft(srv)
    server_mean = {c: (after[c][0] - before[c][0]) / max(1.0, after[c][1] - before[c][1]) for c in (0, 1)}
    assert srv.proc.alive() and srv.healthy()
    assert len(results) >= CLIENTS, (len(results), errors[:3])
    assert all(n == MAX_TOKENS for *_, n in results), [r for r in results if r[-1] != MAX_TOKENS][:3]
    assert not errors, errors[:3]
    # streamed text == non-streamed greedy text (no token lost or duplicated)
    ref = {}
    for cls in (0, 1):
        for i, p in enumerate(prompts[cls]):
            r = srv.client.chat.completions.create(
                model=srv.model,
                messages=p,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            ref[cls, i] = r.choices[0].message.content
    mismatched = [(c, i, out, ref[c, i]) for c, i, _, out, _ in results if out != ref[c, i]]
    assert not mismatched, mismatched[:3]
    # every block goes back: KV cache usage returns to zero
    deadline = time.monotonic() + 15
    usage = None
    while time.monotonic() < deadline:
        usage = _kv_usage(srv)
        if usage == 0:
            break
        time.sleep(0.5)
    assert usage == 0, usage
    ttft = {c: [t for cls, _, t, _, _ in results if cls == c and t is not None] for c in (0, 1)}
    p99 = {c: _p99(ttft[c]) for c in (0, 1)}
    p50 = {c: sorted(ttft[c])[len(ttft[c]) // 2] for c in (0, 1)}
    _report(
        {
            "clients": CLIENTS,
            "requests": {c: len(ttft[c]) for c in (0, 1)},
            "ttft_p50_s": p50,
            "ttft_p99_s": p99,
            "server_ttft_mean_s": server_mean,
            "scheduler_waiting_mean": sum(waiting) / len(waiting) if waiting else None,
        }
    )
    # priority scheduling shows in the time each class waits at the server and in the service each class gets
    # (closed-loop clients: a shorter wait is more requests). NOTE: the server's TTFT (the plugin's per-class
    # histograms: arrival at the API server to the first token), not the clients': this one Python process
    # parsing 64 streams on the shared 2-core host adds seconds to both classes alike (measured with the host
    # busy: client p50 3.54 / 3.66 s, server mean 0.94 / 1.85 s). Not the p99 either: class 1's tail is the
    # drain after the deadline, and it flipped once with three requests running (3.20 vs 3.03 s)
    assert server_mean[0] < server_mean[1], server_mean
    assert len(ttft[0]) > len(ttft[1]), {c: len(ttft[c]) for c in (0, 1)}


def _one_at_a_time(srv, text, seed):
    """A prompt of MIN_PROMPT_TOKENS..MAX_PROMPT_TOKENS tokens as the server counts them (chat template included;
    the words are one token each)."""
    target = (MIN_PROMPT_TOKENS + MAX_PROMPT_TOKENS) // 2
    n = target
    for _ in range(4):
        messages = user(text(seed, n))
        status, body = srv.post("/tokenize", {"model": srv.model, "messages": messages})
        assert status == 200, body
        count = body["count"]
        if MIN_PROMPT_TOKENS <= count <= MAX_PROMPT_TOKENS:
            return messages
        n += target - count
    raise AssertionError(f"no prompt of {MIN_PROMPT_TOKENS}-{MAX_PROMPT_TOKENS} tokens: {count} at {n} words")


def _report(figures):
    import json
    import os
    from pathlib import Path

    logs = os.environ.get("KVRETAIN_SERVE_LOGS")
    if logs:
        Path(logs, "load.json").write_text(json.dumps(figures))
    print("load:", json.dumps(figures))


def _server_ttft(srv):
    """The plugin's per-class TTFT histograms (arrival at the API server to the first token): (sum, count)."""
    s = metric_samples(srv)
    name = "kvretain:time_to_first_token_seconds"
    return {
        c: [metric_first(s, f"{name}_{part}", priority=str(c)) or 0.0 for part in ("sum", "count")]
        for c in (0, 1)
    }


def _kv_usage(srv):
    return metric_first(metric_samples(srv), "vllm:kv_cache_usage_perc")
