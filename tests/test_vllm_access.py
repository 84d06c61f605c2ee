"""Access limits (kvretain.integrations.vllm.access / .middleware) and the metrics side channel, without vLLM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
from types import SimpleNamespace
from typing import Any

import pytest

from kvretain.core.retention import PriorityMapping
from kvretain.integrations.vllm import metrics
from kvretain.integrations.vllm.access import (
    AccessConfigError,
    AccessDenied,
    AccessPolicy,
)
from kvretain.integrations.vllm.middleware import AccessLimits

KEYS = {
    "keys": [
        {"key": "sk-admin-000", "name": "admin", "scopes": ["*"]},
        {
            "key": "sk-bob-00000",
            "name": "bob",
            "min_request_priority": 1,
            "max_retention_priority": 50,
            "max_duration_s": 60,
            "scopes": ["bob", "bob-*"],
            "cache_salt": "salt-bob",
        },
        {
            "key": "sk-carol-000",
            "name": "carol",
            "min_request_priority": 1,
            "max_retention_priority": 25,
            "mode": "clamp",
        },
    ]
}
POLICY = AccessPolicy.from_json(KEYS)
ADMIN, BOB, CAROL = POLICY.keys


def _d(priority, duration=None, start=0):
    return json.dumps([{"start": start, "end": None, "priority": priority, "duration": duration}])


def _denied(fn, status):
    with pytest.raises(AccessDenied) as e:
        fn()
    assert e.value.status == status, e.value.message
    return e.value.message


def test_config_errors_name_the_field():
    for raw, words in [
        ({"keys": [{"key": "short"}]}, "at least 8"),
        ({"keys": [{"key": "sk-12345678", "max_retention_priority": 101}]}, "max_retention_priority"),
        ({"keys": [{"key": "sk-12345678", "scopes": "all"}]}, "scopes"),
        ({"keys": [{"key": "sk-12345678", "pin": 1}]}, "unknown field"),
        ({"keys": [{"key": "sk-12345678"}, {"key": "sk-12345678"}]}, "twice"),
        ({"mode": "soft"}, "mode"),
        ({"kees": []}, "unknown field"),
    ]:
        with pytest.raises(AccessConfigError, match=words):
            AccessPolicy.from_json(raw)
    with pytest.raises(AccessConfigError, match="not valid JSON"):
        AccessPolicy.from_env({"KVRETAIN_API_KEYS": "{keys"})
    assert AccessPolicy.from_env({}).is_open


def test_authentication():
    assert POLICY.authenticate("Bearer sk-bob-00000") is BOB
    _denied(lambda: POLICY.authenticate(None), 401)
    _denied(lambda: POLICY.authenticate("Bearer sk-nobody-0"), 401)
    _denied(lambda: POLICY.authenticate("Basic abc"), 401)
    assert AccessPolicy().authenticate(None) is None


def test_request_priority_refused_defaulted_or_clamped():
    assert "priority 1 or higher" in _denied(lambda: POLICY.check({"priority": 0}, BOB), 403)
    assert "got -4" in _denied(lambda: POLICY.check({}, BOB, header_priority="-4"), 403)
    d = POLICY.check({}, BOB)
    assert d.body["priority"] == 1 and d.priority == 1
    d = POLICY.check({"priority": -7}, CAROL)
    assert d.body["priority"] == 1 and d.notes
    d = POLICY.check({}, ADMIN, header_priority="-3")
    assert d.body["priority"] == -3  # folded into the body (the header is dropped when forwarded)
    _denied(lambda: POLICY.check({"priority": "1"}, ADMIN), 400)
    _denied(lambda: POLICY.check({"priority": 2**70}, ADMIN), 400)


def test_retention_limits():
    msg = _denied(
        lambda: POLICY.check({"priority": 1, "vllm_xargs": {"retention_directives": _d(90, 10)}}, BOB), 403
    )
    assert "up to 50; got 90" in msg
    msg = _denied(
        lambda: POLICY.check({"priority": 1, "vllm_xargs": {"retention_directives": _d(40)}}, BOB), 403
    )
    assert "at most 60 s; got no duration" in msg
    d = POLICY.check({"priority": 1, "vllm_xargs": {"retention_directives": _d(90)}}, CAROL)
    assert json.loads(d.body["vllm_xargs"]["retention_directives"])[0]["priority"] == 25
    # top-level retention fields move into vllm_xargs
    d = POLICY.check({"retention_directives": json.loads(_d(40, 5)), "retention_scope": "bob-7"}, BOB)
    assert "retention_directives" not in d.body and d.body["vllm_xargs"]["retention_scope"] == "bob-7"
    assert "does not own" in _denied(lambda: POLICY.check({"retention_scope": "alice"}, BOB), 403)
    assert POLICY.check({"retention_scope": "anyone"}, ADMIN)
    assert "at most 1024" in _denied(
        lambda: POLICY.check(
            {
                "vllm_xargs": {
                    "retention_directives": json.dumps(
                        [{"start": 2 * i, "end": 2 * i + 1, "priority": 1} for i in range(2000)]
                    )
                }
            },
            ADMIN,
        ),
        400,
    )
    assert "finite" in _denied(
        lambda: POLICY.check(
            {"vllm_xargs": {"retention_directives": '[{"priority": 1, "duration": 1e999}]'}}, None
        ),
        400,
    )
    assert "not valid JSON" in _denied(
        lambda: POLICY.check({"vllm_xargs": {"retention_directives": "[{"}}, None), 400
    )
    assert "not valid JSON" in _denied(  # nested deeper than the parser goes: a RecursionError before
        lambda: POLICY.check({"vllm_xargs": {"retention_directives": "[" * 100_000}}, None), 400
    )
    assert "unknown retention field" in _denied(
        lambda: POLICY.check({"vllm_xargs": {"retention_scop": "x"}}, None), 400
    )
    # the top-level convenience: a misspelt field went on to vLLM, which drops unknown fields with a debug line
    assert "in the request body (did you mean 'retention_scope'?)" in _denied(
        lambda: POLICY.check({"retention_scop": "x"}, None), 400
    )
    assert (
        POLICY.check({"prompt_cache_retention": "24h"}, None).body["prompt_cache_retention"] == "24h"
    )  # OpenAI's


@pytest.mark.parametrize("where", ["top", "xargs"])
def test_the_directive_limit_holds_for_a_list_too(where):
    """Only a JSON string was counted: 20,000 directives as a list (top level or in vllm_xargs) went through."""
    dirs = [{"start": 2 * i, "end": 2 * i + 1, "priority": 1} for i in range(20_000)]
    body = (
        {"retention_directives": dirs} if where == "top" else {"vllm_xargs": {"retention_directives": dirs}}
    )
    for key in (None, ADMIN):
        assert "20000 directives; at most 1024" in _denied(lambda k=key: POLICY.check(dict(body), k), 400)
    low = AccessPolicy.from_json({"max_directives": 3})
    assert "4 directives; at most 3" in _denied(
        lambda: low.check({"retention_directives": dirs[:4]}, None), 400
    )
    assert low.check({"retention_directives": dirs[:3]}, None).changed
    # a server limit above the engine's would let through requests the engine refuses
    with pytest.raises(AccessConfigError, match=r"max_directives must be an integer in \[0, 1024\]"):
        AccessPolicy.from_json({"max_directives": 1025})


@pytest.mark.parametrize("where", ["top", "xargs"])
def test_a_json_string_inside_a_json_string_is_not_a_way_past_the_limit(where):
    """Parsed once and counted only when that gave a list: a doubly encoded list went on as a string, the
    plugin's parser read it a second time, and 500 directives passed a limit of 4 (session 45)."""
    dirs = [{"start": 16 * i, "end": 16 * i + 16, "priority": 40} for i in range(500)]
    twice = json.dumps(json.dumps(dirs))
    body = (
        {"retention_directives": twice} if where == "top" else {"vllm_xargs": {"retention_directives": twice}}
    )
    low = AccessPolicy.from_json({"max_directives": 4})
    for policy, key in ((low, None), (POLICY, ADMIN)):
        msg = _denied(lambda p=policy, k=key: p.check(json.loads(json.dumps(body)), k), 400)
        assert "retention_directives must be a list" in msg, msg
    once = {"retention_directives": json.dumps(dirs[:4])}
    assert low.check(once, None) is not None  # (a list sent once as a JSON string: as before)


def test_decode_retention_is_limited_as_a_directive_is():
    xa = {"retention_decode_priority": 90, "retention_decode_duration": 10}
    assert "retention_decode_priority: key 'bob' may ask for retention priority up to 50; got 90" in _denied(
        lambda: POLICY.check({"priority": 1, "vllm_xargs": dict(xa)}, BOB), 403
    )
    assert "at most 60 s; got no duration" in _denied(
        lambda: POLICY.check({"priority": 1, "vllm_xargs": {"retention_decode_priority": 40}}, BOB), 403
    )
    d = POLICY.check({"priority": 1, "vllm_xargs": dict(xa)}, CAROL)  # clamped to carol's cap
    assert d.body["vllm_xargs"]["retention_decode_priority"] == 25 and d.notes
    assert d.body["vllm_xargs"]["retention_decode_duration"] == 10
    # a top-level field moves into vllm_xargs, as the others do
    d = POLICY.check({"priority": 1, "retention_decode_priority": 40, "retention_decode_duration": 5}, BOB)
    assert d.body["vllm_xargs"] == {"retention_decode_priority": 40, "retention_decode_duration": 5}
    assert "finite" in _denied(
        lambda: POLICY.check(
            {"vllm_xargs": {"retention_decode_priority": 40, "retention_decode_duration": float("inf")}}, None
        ),
        400,
    )
    assert "retention_decode_priority" in _denied(
        lambda: POLICY.check({"vllm_xargs": {"retention_decode_priority": 900}}, None), 400
    )


def test_a_decode_duration_alone_is_limited_too():
    # without retention_decode_priority, the generated tokens' blocks keep the mapped priority for the duration;
    # the duration is still a retention duration: the same limits hold (it went through unchecked before), and
    # a duration's messages and notes name retention_decode_duration, not the priority field
    xa = {"retention_decode_duration": 1e9}
    assert "retention_decode_duration: duration 1e+09 s is over this server's limit" in _denied(
        lambda: POLICY.check({"vllm_xargs": dict(xa)}, None), 400
    )
    assert "retention_decode_duration: duration must be a finite" in _denied(
        lambda: POLICY.check({"vllm_xargs": {"retention_decode_duration": float("inf")}}, None), 400
    )
    assert "retention_decode_duration: key 'bob' may retain for at most 60 s; got 100 s" in _denied(
        lambda: POLICY.check({"priority": 1, "vllm_xargs": {"retention_decode_duration": 100}}, BOB), 403
    )
    assert "retention_decode_duration: key 'bob' may retain for at most 60 s; got no duration" in _denied(
        lambda: POLICY.check({"priority": 1, "vllm_xargs": {"retention_decode_priority": 40}}, BOB), 403
    )
    clamping = AccessPolicy.from_json({**KEYS, "mode": "clamp"})
    d = clamping.check({"priority": 1, "vllm_xargs": {"retention_decode_duration": 100}}, clamping.keys[1])
    assert d.body["vllm_xargs"] == {"retention_decode_duration": 60.0}
    assert len(d.notes) == 1 and d.notes[0].startswith("retention_decode_duration 100")
    assert POLICY.check({"priority": 1, "vllm_xargs": {"retention_decode_duration": 30}}, BOB)


def test_a_top_level_null_is_not_forwarded_into_vllm_xargs():
    # null is "not given" for every retention field (a duration's own error says "or null"); vLLM's vllm_xargs
    # takes no null (400 "vllm_xargs.retention_decode_duration: Input should be a valid string"), so a field moved
    # from the top level must not arrive there as null
    body = {"priority": 1, "retention_decode_priority": 40, "retention_decode_duration": None}
    d = POLICY.check(dict(body), ADMIN)
    assert d.body["vllm_xargs"] == {"retention_decode_priority": 40}
    d = POLICY.check({**body, "retention_decode_priority": 90, "retention_scope": None}, CAROL)  # clamped
    assert d.body["vllm_xargs"] == {"retention_decode_priority": 25}
    assert "retention_decode_duration" not in d.body and "retention_scope" not in d.body


def test_mapped_retention_is_capped_too():
    # carol's cap 25 is the default mapping of priority 1; a key with cap 35 and no priority floor gets floor 0
    pol = AccessPolicy.from_json({"keys": [{"key": "sk-12345678", "max_retention_priority": 35}]})
    assert "priority 0 or higher" in _denied(lambda: pol.check({"priority": -1}, pol.keys[0]), 403)


def test_a_table_mapping_cannot_lift_a_request_over_the_keys_cap():
    """The cap bounded the request priority through a floor, which assumes a monotonic mapping: under the table
    1:80, 2:35, 3:10 (0 -> 35 and -1 -> 45 by the default rule) a cap of 50 gave floor -1, and priority 1 (80) went
    through. Refused now, or clamped to the nearest priority within the cap (the less important on a tie)."""
    mapping = PriorityMapping.parse("1:80,2:35,3:10")
    keys = [
        {"key": "sk-refuse-001", "max_retention_priority": 50},
        {"key": "sk-clamp-0001", "max_retention_priority": 50, "mode": "clamp"},
    ]
    pol = AccessPolicy.from_json({"keys": keys}, mapping=mapping)
    refuse, clamp = pol.keys
    assert "request priority 1 maps to 80" in _denied(lambda: pol.check({"priority": 1}, refuse), 403)
    assert pol.check({"priority": 0}, refuse).priority == 0
    d = pol.check({"priority": 1}, clamp)
    assert d.priority == d.body["priority"] == 2 and d.notes  # 0 and 2 both map to 35: the less important
    for key in (refuse, clamp):
        for prio in range(-20, 20):
            try:
                d = pol.check({"priority": prio}, key)
            except AccessDenied:
                assert key is refuse
                continue
            assert mapping.retention_for(d.priority) <= 50, (key.name, prio, d.priority)
    # a key with a floor: clamped to the nearest priority within the cap; its default stays its floor
    pol = AccessPolicy.from_json(
        {"keys": [{**keys[1], "min_request_priority": 1}]}, mapping=PriorityMapping.parse("1:35,2:80")
    )
    assert pol.check({"priority": 2}, pol.keys[0]).priority == 3
    assert pol.check({}, pol.keys[0]).priority == 1


def test_salts_are_bound_and_reserved():
    d = POLICY.check({}, BOB)
    assert d.body["cache_salt"] == "salt-bob"
    assert "bound to its own" in _denied(lambda: POLICY.check({"cache_salt": "other"}, BOB), 403)
    assert "bound to another key" in _denied(lambda: POLICY.check({"cache_salt": "salt-bob"}, ADMIN), 403)
    assert "cache_salt" not in POLICY.check({"priority": 1, "cache_salt": "salt-bob"}, CAROL).body


def _client(chunks):
    """A fake ASGI client sending ``chunks`` as one body: ``receive``, ``send``, the messages sent and how many
    chunks had been read when each was sent."""
    left, read, sent = list(chunks), [0], []

    async def receive():
        read[0] += 1
        part = left.pop(0)
        return {"type": "http.request", "body": part, "more_body": bool(left)}

    async def send(msg):
        sent.append((msg, read[0]))

    return receive, send, sent


def _asgi(policy, body, headers=(), path="/v1/chat/completions"):
    seen = {}

    async def app(scope, receive, send):
        raw = b""
        more = True
        while more:
            msg = await receive()
            raw += msg.get("body", b"")
            more = msg.get("more_body", False)
        seen["raw"] = raw
        with contextlib.suppress(ValueError):
            seen["body"] = json.loads(raw)
        seen["headers"] = dict(scope["headers"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    receive, send, sent = _client([raw[: len(raw) // 2], raw[len(raw) // 2 :]])
    scope = {"type": "http", "method": "POST", "path": path, "headers": list(headers)}
    asyncio.run(AccessLimits(app, policy, max_body_bytes=4096)(scope, receive, send))
    status = sent[0][0]["status"]
    reply = json.loads(sent[1][0]["body"]) if status != 200 else None
    return status, reply, seen


def test_middleware_rewrites_and_refuses():
    status, _, seen = _asgi(
        POLICY, {"messages": []}, [(b"authorization", b"Bearer sk-bob-00000"), (b"x-vllm-priority", b"3")]
    )
    assert status == 200
    assert seen["body"]["priority"] == 3 and seen["body"]["cache_salt"] == "salt-bob"
    assert b"x-vllm-priority" not in seen["headers"]
    assert int(seen["headers"][b"content-length"]) == len(json.dumps(seen["body"]))
    status, reply, _ = _asgi(POLICY, {"priority": 0}, [(b"authorization", b"Bearer sk-bob-00000")])
    assert status == 403 and "priority 1" in reply["error"]["message"] and reply["error"]["code"] == 403
    assert _asgi(POLICY, {"priority": 0})[0] == 401
    assert _asgi(AccessPolicy(), b"{bad")[0] == 400
    deep = b"[" * 1500 + b"]" * 1500  # valid JSON, nested deeper than Python's parser goes (RecursionError)
    status, reply, _ = _asgi(AccessPolicy(), deep)
    assert status == 400 and "not valid JSON" in reply["error"]["message"]
    assert _asgi(AccessPolicy(), b"x" * 5000)[0] == 413


def _refusal_after(policy, chunks, headers=()):
    """The middleware on a body sent in ``chunks``: the status it answered and how many chunks it had read
    when it started answering."""

    async def app(scope, receive, send):  # (never reached: every case is refused)
        raise AssertionError("the request reached the app")

    receive, send, sent = _client(chunks)
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": list(headers)}
    asyncio.run(AccessLimits(app, policy, max_body_bytes=4096)(scope, receive, send))
    return sent[0][0]["status"], sent[0][1]


def test_a_refusal_reads_the_rest_of_the_body_before_answering(monkeypatch):
    # answering while the client still sends makes the server's close a reset that can destroy the answer (a
    # 9 MiB body got "connection reset" instead of its 413 in the serve tests); the rest is read first, up to
    # DRAIN_BYTES past which the connection is cut as before
    from kvretain.integrations.vllm import middleware

    big = [b"x" * 1024] * 12  # 12 KiB against a 4 KiB limit: over it at the 5th chunk
    assert _refusal_after(AccessPolicy(), big) == (413, 12)
    assert _refusal_after(POLICY, [b"{}"] * 3) == (401, 3)  # (a missing key, refused before the body is read)
    assert _refusal_after(AccessPolicy(), [b"{bad"]) == (400, 1)  # (read whole: nothing more is asked for)
    monkeypatch.setattr(middleware, "DRAIN_BYTES", 2048)
    assert _refusal_after(AccessPolicy(), big) == (413, 7)  # 5 read, then 2 KiB drained


GENERATING = [
    "/invocations",
    "/v1/responses",
    "/v1/messages",
    "/v1/chat/completions/batch",
    "/cohere/v2/chat",
]


def _many(n, duration=None):
    return json.dumps(
        [{"start": 2 * i, "end": 2 * i + 1, "priority": 50, "duration": duration} for i in range(n)]
    )


@pytest.mark.parametrize("path", [*GENERATING, "/inference/v1/generate"])
def test_the_global_limits_hold_on_every_generating_endpoint(path):
    """Only completions and chat completions were checked: vLLM 0.32-0.33 also generate at /invocations,
    /v1/responses, /v1/messages (and more), where any number of directives or durations over the server's limit
    went through on a server without keys (or for an unlimited key)."""
    ctype = (b"content-type", b"application/json")
    limits = {"max_directives": 8, "max_duration_s": 3600}
    policy_open = AccessPolicy.from_json(limits)
    policy_keys = AccessPolicy.from_json({**KEYS, **limits})

    def body(directives, top=False):
        if path == "/inference/v1/generate":  # vLLM's token-in API: the SamplingParams themselves
            xargs = {"retention_directives": directives}
            return {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1, "extra_args": xargs}}
        if top:
            return {"model": "m", "input": "hi", "retention_directives": json.loads(directives)}
        return {"model": "m", "input": "hi", "vllm_xargs": {"retention_directives": directives}}

    admin = [ctype, (b"authorization", b"Bearer sk-admin-000")]
    for policy, headers in ((policy_open, [ctype]), (policy_keys, admin)):
        status, reply, _ = _asgi(policy, body(_many(9)), headers, path)
        assert status == 400 and "9 directives; at most 8" in reply["error"]["message"], (path, status)
        status, reply, _ = _asgi(policy, body(_many(1, duration=7200)), headers, path)
        assert status == 400 and "over this server's limit of 3600 s" in reply["error"]["message"]
        if path != "/inference/v1/generate":
            assert _asgi(policy, body(_many(9), top=True), headers, path)[0] == 400
    # within the limits: forwarded (a top-level list goes into vllm_xargs as the JSON string vLLM takes)
    status, _, seen = _asgi(policy_open, body(_many(3)), [ctype, (b"x-vllm-priority", b"2")], path)
    assert status == 200 and seen["headers"][b"x-vllm-priority"] == b"2"  # (vLLM reads it there itself)
    assert int(seen["headers"][b"content-length"]) == len(seen["raw"])
    if path != "/inference/v1/generate":
        status, _, seen = _asgi(policy_open, body(_many(3), top=True), [ctype], path)
        assert (
            status == 200 and json.loads(seen["body"]["vllm_xargs"]["retention_directives"])[2]["start"] == 4
        )
    # a limited key is still refused there; an oversized body too; a body that is no JSON goes to vLLM as it came
    assert (
        _asgi(policy_keys, body(_many(3)), [ctype, (b"authorization", b"Bearer sk-bob-00000")], path)[0]
        == 403
    )
    assert _asgi(policy_open, b"x" * 5000, [ctype], path)[0] == 413
    assert _asgi(policy_open, b"{bad", [ctype], path)[2]["raw"] == b"{bad"


def test_form_bodies_and_harmless_posts_pass_as_they_came():
    form = b"--x\r\nContent-Disposition: form-data; name=vllm_xargs\r\n\r\n{}\r\n--x--" + b" " * 5000
    status, _, seen = _asgi(
        AccessPolicy(),
        form,
        [(b"content-type", b"multipart/form-data; boundary=x")],
        "/v1/audio/transcriptions",
    )
    assert status == 200 and seen["raw"] == form
    status, _, seen = _asgi(
        POLICY, {"prompt": "x"}, [(b"authorization", b"Bearer sk-bob-00000")], "/tokenize"
    )
    assert status == 200 and seen["body"] == {"prompt": "x"}


def test_metrics_side_channel(tmp_path):
    snap = {
        "pid": os.getpid(),
        "by_priority": {"0": {"query_tokens": 10, "hit_tokens": 4}},
        "gauges": {"pool_blocks": 32, "protected_blocks": 8},
    }
    (tmp_path / "engine-1.json").write_text(json.dumps({**snap, "pid": os.getpid()}))
    (tmp_path / "engine-2.json").write_text("{half a file")
    assert metrics.read_snapshots(tmp_path, skip_pid=os.getpid()) == []
    snaps = metrics.read_snapshots(tmp_path)
    by_prio, gauges = metrics.merge([*snaps, snap])
    assert by_prio == {"0": {"query_tokens": 20.0, "hit_tokens": 8.0}}
    assert gauges["protected_block_share"] == 0.25


def test_metrics_collector_families(tmp_path, monkeypatch):
    pytest.importorskip("prometheus_client")
    snap = {
        "pid": os.getpid(),
        "by_priority": {"1": {"query_tokens": 7, "evicted_blocks": 2}},
        "gauges": {"pool_blocks": 4},
    }
    (tmp_path / "engine-9.json").write_text(json.dumps(snap))
    monkeypatch.setattr(metrics, "read_snapshots", lambda d, skip_pid=None: [snap])
    monkeypatch.setattr(metrics, "local_snapshot", lambda: None)  # (not this process's, from earlier tests)
    fams = {f.name: f for f in metrics.Collector(tmp_path).collect()}
    assert fams["kvretain:prefix_cache_queries"].samples[0].value == 7
    assert fams["kvretain:evicted_blocks"].samples[0].labels == {"priority": "1"}


def test_a_retention_cap_alone_does_not_raise_the_default_request_priority():
    # README's alice: max_retention_priority 90 and no min_request_priority. Priority -5 maps to 85 (within the
    # cap), so she may ask for it; a request without a priority ran at -5 anyway (the floor was filled in),
    # ahead of every other tenant's default priority-0 traffic. It runs at vLLM's default 0, as asked.
    pol = AccessPolicy.from_json({"keys": [{"key": "sk-alice-0123", "max_retention_priority": 90}]})
    alice = pol.keys[0]
    d = pol.check({"messages": []}, alice)
    assert d.priority == 0 and d.body.get("priority", 0) == 0
    assert pol.check({"priority": -5}, alice).priority == -5  # still allowed when asked for
    assert "priority -5 or higher" in _denied(lambda: pol.check({"priority": -6}, alice), 403)
    # a floor above the default is still filled in (the key may not run at 0) ...
    assert POLICY.check({}, BOB).priority == 1
    capped = AccessPolicy.from_json({"keys": [{"key": "sk-low-01234", "max_retention_priority": 20}]})
    assert capped.check({}, capped.keys[0]).body["priority"] == 2  # 35 - 10 * 2 = 15 <= 20
    # ... and an explicit min_request_priority is the key's default, as documented
    vip = AccessPolicy.from_json({"keys": [{"key": "sk-vip-01234", "min_request_priority": -3}]})
    assert vip.check({}, vip.keys[0]).body["priority"] == -3


def test_directives_given_as_a_list_in_vllm_xargs_are_forwarded_as_json():
    # vLLM's vllm_xargs takes strings, numbers and flat lists only: a list of directive objects there got six
    # pydantic errors from vLLM; the middleware already re-serializes top-level directives, so it does these too
    dirs = [{"start": 0, "end": None, "priority": 40, "duration": 30}]
    d = POLICY.check({"priority": 1, "vllm_xargs": {"retention_directives": dirs}}, BOB)
    assert d.changed and isinstance(d.body["vllm_xargs"]["retention_directives"], str)
    assert json.loads(d.body["vllm_xargs"]["retention_directives"]) == dirs
    d = AccessPolicy().check({"vllm_xargs": {"retention_directives": dirs}}, None)
    assert json.loads(d.body["vllm_xargs"]["retention_directives"]) == dirs
    as_text = {"vllm_xargs": {"retention_directives": json.dumps(dirs)}}
    assert not AccessPolicy().check(as_text, None).changed  # a JSON string passes as it came


@pytest.mark.parametrize(
    ("xargs", "param"),
    [
        ({"retention_scope": 5}, "retention_scope"),
        ({"retention_decode_priority": "80"}, "retention_decode_priority"),
        ({"retention_decode_duration": -1}, "retention_decode_duration"),
        ({"retention_directives": "[{"}, "retention_directives"),
        ({"retention_directives": '[{"priority": 200}]'}, "retention_directives"),
    ],
)
def test_an_invalid_retention_field_is_named_in_the_error_param(xargs, param):
    with pytest.raises(AccessDenied) as info:
        AccessPolicy().check({"vllm_xargs": xargs}, None)
    assert info.value.status == 400 and info.value.param == param, info.value.message


def test_a_client_cannot_grow_the_per_priority_series_without_bound(monkeypatch):
    # vLLM takes any 64-bit request priority, and each distinct one was a ClassStats in the engine, a key in every
    # metrics snapshot and 6 series in /metrics (two histograms of 22 and 21 buckets more with ClassLatency): one request per
    # priority grew them without bound. Past MAX_PRIORITY_CLASSES, new priorities share one "other" class.
    from kvretain.integrations.vllm import _runtime

    counters = _runtime.Counters()
    cap = _runtime.MAX_PRIORITY_CLASSES
    for p in range(cap + 500):
        counters.get(p).requests += 1
    counters.get(0).requests += 1
    snap = counters.snapshot()
    assert len(snap) == cap + 1 and snap[_runtime.OTHER_PRIORITY]["requests"] == 500
    assert snap[0]["requests"] == 2 and list(snap)[-1] == _runtime.OTHER_PRIORITY
    assert counters.get(10**6) is counters.get(-(10**6))  # both "other", counted together
    assert len(_runtime.Counters().snapshot()) == 0  # no "other" until it is used
    # the per-class latency histograms' labels (API server side) likewise
    labels = metrics.PriorityLabels(limit=3)
    assert [labels.of(p) for p in (0, 1, 0, 2, 7, -9, 1)] == ["0", "1", "0", "2", "other", "other", "1"]


def test_the_other_priority_class_reaches_metrics(tmp_path, monkeypatch):
    pytest.importorskip("prometheus_client")
    snap = {
        "pid": os.getpid(),
        "by_priority": {"1": {"requests": 2}, "-3": {"requests": 1}, "other": {"requests": 5}},
        "gauges": {"pool_blocks": 4},
    }
    monkeypatch.setattr(metrics, "read_snapshots", lambda d, skip_pid=None: [snap])
    monkeypatch.setattr(metrics, "local_snapshot", lambda: None)  # (not this process's, from earlier tests)
    fams = {f.name: f for f in metrics.Collector(tmp_path).collect()}
    samples = fams["kvretain:prefix_cache_requests"].samples
    got = [(s.labels["priority"], s.value) for s in samples if s.name.endswith("_total")]
    assert got == [("-3", 1), ("1", 2), ("other", 5)]


def test_a_priority_is_counted_under_one_label_across_engine_processes():
    """Each engine process (vLLM's data parallel) labels the first 64 priorities it sees and counts the rest under
    ``other``: priority 100 was a label in one engine and inside the other's ``other``, and the merged series split
    its counts between the two. A label an engine that overflowed lacks is merged into ``other`` now."""
    from kvretain.integrations.vllm import _runtime

    a, b = _runtime.Counters(), _runtime.Counters()
    for p in range(_runtime.MAX_PRIORITY_CLASSES):  # engine A: 64 priorities, then 100 (under other)
        a.get(p).record_lookup(10, 0, False)
    a.get(100).record_lookup(10, 5, False)
    b.get(100).record_lookup(10, 5, False)  # engine B: 100 first (a label)
    b.get(0).record_lookup(10, 1, False)

    def snap(c):
        return {"pid": 1, "time": 0.0, "by_priority": {str(p): v for p, v in c.snapshot().items()}}

    by_prio, _ = metrics.merge([snap(a), snap(b)])
    assert "100" not in by_prio and by_prio["other"]["requests"] == 2 and by_prio["other"]["hit_tokens"] == 10
    assert by_prio["0"]["requests"] == 2  # (a label both engines have stays)
    by_prio, _ = metrics.merge([snap(b)])  # (no engine overflowed: every label stays)
    assert by_prio["100"]["requests"] == 1 and "other" not in by_prio


def test_the_label_cap_holds_on_the_merged_engines_and_nothing_counted_is_lost(tmp_path, monkeypatch):
    """Two engine processes (vLLM's data parallel), 40 priorities each and neither past its own cap: the merged
    series had 80 labels, over the cap of 64 that bounds /metrics. The first 64 keep a label and the rest are
    counted under ``other``; the collector keeps its labels across scrapes, so a priority labelled once is never
    moved into ``other`` by one that shows up later (its counter would drop)."""
    from kvretain.integrations.vllm import _runtime

    cap = _runtime.MAX_PRIORITY_CLASSES

    def snap(prios, pid=1):
        return {"pid": pid, "by_priority": {str(p): {"requests": 1, "hit_tokens": p + 1} for p in prios}}

    a, b = snap(range(10, 50)), snap(range(50, 90))
    by_prio, _ = metrics.merge([a, b])
    assert len(by_prio) == cap + 1 and set(by_prio) - {"other"} == {str(p) for p in range(10, 10 + cap)}
    assert by_prio["other"]["requests"] == 80 - cap
    for key, total in (("requests", 80), ("hit_tokens", sum(range(11, 91)))):
        assert sum(c[key] for c in by_prio.values()) == total
    # across scrapes: priorities 0..9 seen later go under other; the labels already given stay
    pytest.importorskip("prometheus_client")
    monkeypatch.setattr(metrics, "local_snapshot", lambda: None)  # (not this process's, from earlier tests)
    seen = [[a, b]]
    monkeypatch.setattr(metrics, "read_snapshots", lambda d, skip_pid=None: seen[-1])
    collector = metrics.Collector(tmp_path)

    def requests():
        fams = {f.name: f for f in collector.collect()}
        samples = fams["kvretain:prefix_cache_requests"].samples
        return {s.labels["priority"]: s.value for s in samples if s.name.endswith("_total")}

    first = requests()
    assert len(first) == cap + 1
    seen.append([snap(range(10)), a, b])
    later = requests()
    assert {k for k in later if k != "other"} == {k for k in first if k != "other"}
    assert later["other"] == first["other"] + 10 and sum(later.values()) == 90


def test_every_counter_of_the_plugin_reaches_metrics():
    """``/metrics`` exports each per-priority counter ``plugin.stats()`` has (the resumes' query and hit tokens were
    missing: no resume hit ratio could be shown)."""
    from kvretain.integrations.vllm import _runtime

    assert {k for k, _, _ in metrics.COUNTER_KEYS} == {name for _, name in _runtime.STATS_KEYS}


def _reach(policy, scope, headers=()):
    """What an ASGI request with ``scope`` gets through the middleware: the app's 200, the middleware's error
    status, or for a websocket the close code it was refused with (None: it reached the app)."""
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

    sent = []
    body = (
        [{"type": "websocket.connect"}]
        if scope["type"] == "websocket"
        else [{"type": "http.request", "body": b"{}", "more_body": False}]
    )

    async def receive():
        return body.pop(0) if body else {"type": "http.disconnect"}

    async def send(msg):
        sent.append(msg)

    scope = {"method": "GET", "root_path": "", **scope, "headers": list(headers)}
    asyncio.run(AccessLimits(app, policy)(scope, receive, send))
    if scope["type"] == "websocket":
        return None if reached else sent[0]["code"]
    return sent[0]["status"]


def test_paths_behind_a_root_path_are_checked_as_without_it():
    # behind a path-prefix proxy (vLLM --root-path /api) the middleware matched "/api/health" and
    # "/api/v1/chat/completions" against its path lists: health probes got 401, completions 403 for limited keys
    bob = [(b"authorization", b"Bearer sk-bob-00000")]
    assert _reach(POLICY, {"type": "http", "path": "/api/health", "root_path": "/api"}) == 200
    post = {"type": "http", "method": "POST", "path": "/api/v1/chat/completions", "root_path": "/api"}
    assert _reach(POLICY, post, bob) == 200
    assert _reach(POLICY, {**post, "path": "/api/v1/embeddings"}, bob) == 403  # (not open to limited keys)
    assert _reach(POLICY, {"type": "http", "path": "/health"}) == 200


def test_a_cors_preflight_passes_and_a_websocket_needs_a_key():
    # OPTIONS (a browser's preflight, no credentials) got 401; a websocket went to the app with no key at all
    assert _reach(POLICY, {"type": "http", "method": "OPTIONS", "path": "/v1/chat/completions"}) == 200
    ws = {"type": "websocket", "path": "/v1/realtime"}
    assert _reach(POLICY, ws) == 1008
    assert (
        _reach(POLICY, ws, [(b"authorization", b"Bearer sk-bob-00000")]) == 1008
    )  # (limited: no body to check)
    assert _reach(POLICY, ws, [(b"authorization", b"Bearer sk-admin-000")]) is None
    assert _reach(AccessPolicy(), ws) is None  # (an open server)


def test_gauges_of_a_per_block_queue_read_its_policy():
    # KVRETAIN_GRANULARITY=block: the queue has no stats() of its own, so the controller's gauges read 0
    # (and the frequency exponent 0, "LRU order", for a policy without a balance, where -1 means none)
    from types import SimpleNamespace

    from kvretain.core.policy import PolicyConfig, make_policy

    unified = make_policy("unified", 12, PolicyConfig(block_size=16))
    g = metrics.queue_gauges([SimpleNamespace(policy=unified, pool_blocks=range(12))])
    want = unified.stats()
    assert g["protected_target_blocks"] == want["protected_target"] > 0
    assert g["protection_level"] == want["protection_level"] == 1.0
    strict = make_policy("priority", 12, PolicyConfig(block_size=16))
    assert (
        metrics.queue_gauges([SimpleNamespace(policy=strict, pool_blocks=range(12))])[
            "frequency_exponent_now"
        ]
        == -1
    )


def test_engine_snapshots_sum_counts_and_average_the_controllers_ratios(tmp_path):
    # two engine processes (data parallel) at hit ratio 0.7 and level 0.8 read 1.4 and 1.6
    g = {"pool_blocks": 10, "protected_blocks": 4, "hit_ratio_window": 0.7, "protection_level": 0.8}
    _, merged = metrics.merge([{"gauges": g}, {"gauges": {**g, "protection_level": 0.4}}])
    assert merged["pool_blocks"] == 20 and merged["protected_block_share"] == 0.4
    assert merged["hit_ratio_window"] == pytest.approx(0.7) and merged["protection_level"] == pytest.approx(
        0.6
    )
    assert merged["frequency_exponent_now"] == -1  # (no engine has a balance)


def test_a_damaged_snapshot_file_is_skipped_not_fatal_to_metrics(tmp_path):
    # valid JSON of another shape made collect() raise (and vLLM's own series were lost with /metrics); a
    # file without a pid was counted forever (os.kill(-1, 0) succeeds)
    good = {"pid": os.getpid(), "by_priority": {"0": {"query_tokens": 3}}, "gauges": {"pool_blocks": 4}}
    for name, body in [
        ("engine-1.json", [1, 2]),
        ("engine-2.json", {"pid": "abc"}),
        ("engine-3.json", {"by_priority": {}, "gauges": {}}),
        ("engine-4.json", {"pid": 4, "by_priority": {"0": 5}}),
        ("engine-5.json", {"pid": os.getpid(), "gauges": {"pool_blocks": "x"}}),
        ("engine-6.json", good),
    ]:
        (tmp_path / name).write_text(json.dumps(body))
    assert metrics.read_snapshots(tmp_path) == [good]


def test_a_snapshot_file_past_what_json_numbers_and_labels_allow_is_skipped_not_fatal(tmp_path, monkeypatch):
    # each of these made read_snapshots (and so collect(), and vLLM's whole /metrics) raise: a pid past a C long
    # (os.kill: OverflowError), a count no float holds (math.isfinite: OverflowError), JSON nested past the
    # parser's depth (RecursionError); a lone surrogate in a label passed the check and made prometheus_client's
    # UTF-8 encoding of the page raise
    pid = os.getppid()  # (alive, and not this process, which the collector reads directly)
    good = {"pid": pid, "by_priority": {"-2": {"requests": 3}, "other": {"requests": 1}}, "gauges": {}}
    for name, text in [
        ("engine-1.json", json.dumps({"pid": 10**20, "by_priority": {}, "gauges": {}})),
        ("engine-2.json", json.dumps({"pid": pid, "by_priority": {"0": {"requests": 10**400}}})),
        ("engine-3.json", json.dumps({"pid": pid, "by_priority": {}, "gauges": {"pool_blocks": 10**400}})),
        ("engine-4.json", "[" * 100_000),
        ("engine-5.json", json.dumps({"pid": pid, "by_priority": {"\ud800": {"requests": 1}}})),
        ("engine-6.json", json.dumps({"pid": pid, "by_priority": {"007": {"requests": 1}}})),
        ("engine-7.json", json.dumps(good)),
    ]:
        (tmp_path / name).write_text(text)
    assert metrics.read_snapshots(tmp_path) == [good]
    prometheus_client = pytest.importorskip("prometheus_client")
    monkeypatch.setattr(metrics, "local_snapshot", lambda: None)  # (not this process's, from earlier tests)
    registry = prometheus_client.CollectorRegistry()
    registry.register(metrics.Collector(tmp_path))
    page = prometheus_client.generate_latest(registry).decode()
    assert 'kvretain:prefix_cache_requests_total{priority="-2"} 3.0' in page


def test_a_snapshot_left_by_a_killed_engine_is_not_read_when_its_pid_is_reused(tmp_path):
    # an engine killed (OOM) leaves its snapshot; once its pid is reused by a live process (a restart in a
    # container's pid namespace), the dead engine's counts and pool blocks were summed into /metrics for good
    pid = os.getppid()  # (a live process that publishes nothing)
    snap = {"pid": pid, "by_priority": {"0": {"requests": 5}}, "gauges": {"pool_blocks": 64}}
    old, fresh = tmp_path / "engine-1.json", tmp_path / "engine-2.json"
    old.write_text(json.dumps(snap))
    fresh.write_text(json.dumps({**snap, "gauges": {"pool_blocks": 32}}))
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    assert [s["gauges"]["pool_blocks"] for s in metrics.read_snapshots(tmp_path)] == [32]


def test_a_key_that_could_never_authenticate_is_refused_at_start():
    # accepted, and every request with it got 401: a non-ASCII key (headers arrive as latin-1), a key with a
    # surrounding or inner space (the token is read stripped)
    for key in ("sk-ключ-1234", "sk-kkkkkkkk ", " sk-kkkkkkkk", "sk-kk kkkkk", "sk-kkkk\tkkk"):
        with pytest.raises(
            AccessConfigError, match=r"KVRETAIN_API_KEYS: keys\[0\]: 'key' must be printable ASCII"
        ):
            AccessPolicy.from_json({"keys": [{"key": key}]})


def test_a_bad_key_file_is_one_line_naming_the_variable(tmp_path):
    # invalid UTF-8 and JSON nested deeper than Python's parser went through as UnicodeDecodeError and
    # RecursionError tracebacks naming neither the variable nor the file
    bad = tmp_path / "keys.json"
    for content, words in [
        (b'{"keys": [{"key": "sk-\xff\xfe-12345"}]}', "not UTF-8 text"),
        (b"[" * 5000 + b"]" * 5000, "not valid JSON"),
        (b'{"keys": [{"key": "short"}]}', r"keys\[0\]: 'key' must be a string of at least 8"),
    ]:
        bad.write_bytes(content)
        with pytest.raises(AccessConfigError, match=rf"^KVRETAIN_API_KEYS_FILE={bad}: .*{words}"):
            AccessPolicy.from_env({"KVRETAIN_API_KEYS_FILE": str(bad)})
    bad.write_bytes(
        b'\xef\xbb\xbf{"keys": [{"key": "sk-12345678"}]}'
    )  # (a byte-order mark, as editors write)
    assert len(AccessPolicy.from_env({"KVRETAIN_API_KEYS_FILE": str(bad)}).keys) == 1


def test_a_bad_key_setting_stops_the_server_with_one_line():
    import subprocess
    import sys

    env = {**os.environ, "KVRETAIN_API_KEYS": '{"keys": [{"key": "short"}]}'}
    code = "import kvretain.integrations.vllm.middleware"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "kvretain access limits: KVRETAIN_API_KEYS: keys[0]: 'key' must be a string of at least 8 characters"
    )


def test_a_clamped_duration_is_logged_as_the_other_clamps():
    # the server's log read "retention_directives[0].duration None -> 0" for a directive without a duration, and
    # "60.0 -> 0" where every other clamp reads "95 -> 25" or "1e+06 -> 604800"
    policy = AccessPolicy.from_json(
        {
            "mode": "clamp",
            "keys": [{"key": "sk-batch-01234567", "max_retention_priority": 25, "max_duration_s": 0}],
        }
    )
    key = policy.keys[0]
    never = policy.check({"vllm_xargs": {"retention_directives": '[{"start": 0, "priority": 20}]'}}, key)
    assert never.notes == ["retention_directives[0].duration none (never lapses) -> 0"]
    sixty = policy.check({"retention_directives": [{"start": 0, "priority": 95, "duration": 60}]}, key)
    assert sixty.notes == [
        "retention_directives[0].priority 95 -> 25",
        "retention_directives[0].duration 60 -> 0",
    ]


def test_a_misspelt_key_variable_does_not_open_the_server(tmp_path):
    # KVRETAIN_API_KEY_FILE=keys.json (one letter off) started the server open to every client, its only trace a
    # warning among vLLM's start-up lines: a name close to a key variable, with no key variable set, stops it
    keys = tmp_path / "keys.json"
    keys.write_text('{"keys": [{"key": "sk-12345678"}]}')
    for name, meant in [
        ("KVRETAIN_API_KEY_FILE", "KVRETAIN_API_KEYS_FILE"),
        ("KVRETAIN_KEYS_FILE", "KVRETAIN_API_KEYS_FILE"),
        ("KVRETAIN_API_KEY", "KVRETAIN_API_KEYS"),
    ]:
        with pytest.raises(
            AccessConfigError, match=rf"^'{name}' is not a kvretain setting \(did you mean {meant}\?\)"
        ):
            AccessPolicy.from_env({name: str(keys)})
    # a key variable set: the stray name is only warned about (by the plugin's register()); other misspellings
    # and the test scripts' own variables do not touch the limits
    assert (
        len(AccessPolicy.from_env({"KVRETAIN_API_KEYS_FILE": str(keys), "KVRETAIN_API_KEY": "x"}).keys) == 1
    )
    for env in ({"KVRETAIN_POLICY_OPTION": "budget=1"}, {"KVRETAIN_SERVE_MODEL": "m"}, {}):
        assert AccessPolicy.from_env(env).is_open


def test_a_misspelt_key_variable_stops_the_server_with_one_line():
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRETAIN_API_KEYS")}
    env["KVRETAIN_API_KEY_FILE"] = "keys.json"
    code = "import kvretain.integrations.vllm.middleware"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "kvretain access limits: 'KVRETAIN_API_KEY_FILE' is not a kvretain setting (did you mean "
            "KVRETAIN_API_KEYS_FILE?); without KVRETAIN_API_KEYS_FILE the server would be open to every client"
        )
    )


def test_a_retention_cap_allows_exactly_the_priorities_the_mapping_puts_within_it():
    # the floor was found by walking 256 priorities up from 0: README's own table (0:80,1:35,2:10) with a cap of
    # 50 refused priority -1 (45 by the formula); normal=300 refused 400 (which maps to 0); a cap no priority
    # meets (step=0: everything maps to 35) was accepted at start and refused every request
    key = {"key": "sk-dave-0000", "name": "dave", "max_retention_priority": 50}
    readme = AccessPolicy.from_json({"keys": [key]}, mapping=PriorityMapping.parse("0:80,1:35,2:10"))
    dave = readme.keys[0]
    assert readme.check({"priority": -1}, dave).priority == -1
    assert "maps to 80" in _denied(lambda: readme.check({"priority": 0}, dave), 403)
    assert "may ask for request priority -1 or higher" in _denied(
        lambda: readme.check({"priority": -2}, dave), 403
    )
    far = {**key, "max_retention_priority": 10}
    shifted = AccessPolicy.from_json({"keys": [far]}, mapping=PriorityMapping.parse("normal=300,step=1"))
    assert shifted.check({"priority": 400}, shifted.keys[0]).priority == 400
    assert "325 or higher" in _denied(lambda: shifted.check({"priority": 0}, shifted.keys[0]), 403)
    clamp = AccessPolicy.from_json(
        {"keys": [{**far, "mode": "clamp"}]}, mapping=PriorityMapping.parse("normal=300,step=1")
    )
    assert clamp.check({"priority": 0}, clamp.keys[0]).priority == 325
    with pytest.raises(AccessConfigError, match="max_retention_priority 30: no request priority maps"):
        AccessPolicy.from_json(
            {"keys": [{**key, "max_retention_priority": 30}]}, mapping=PriorityMapping(step=0)
        )


def test_a_huge_priority_is_not_echoed_whole():
    # a 5,000-character priority came back whole in the 400 message
    msg = _denied(lambda: POLICY.check({"priority": "p" * 5000}, ADMIN), 400)
    assert len(msg) < 200 and "(5002 characters)" in msg  # (its repr, quotes included)


@pytest.mark.parametrize("header", ["", "abc", "9" * 2 + "x" * 5000, "9" * 5000, "1.5"])
def test_a_priority_header_vllm_ignores_is_ignored(header: str) -> None:
    """vLLM reads ``X-Vllm-Priority`` with ``int()`` and, where that fails, the body's priority: the limits do the
    same (they refused such a header with a 400 that vLLM would not give), and check the body's priority."""
    d = POLICY.check({"priority": 2}, BOB, header)
    assert d.priority == 2 and d.body["priority"] == 2
    assert "priority 1" in _denied(lambda: POLICY.check({"priority": 0}, BOB, header), 403)
    bob = (b"authorization", b"Bearer sk-bob-00000")
    status, _, seen = _asgi(POLICY, {"priority": 2}, [bob, (b"x-vllm-priority", header.encode())])
    assert status == 200 and seen["body"]["priority"] == 2
    assert b"x-vllm-priority" not in seen["headers"]
    assert POLICY.check({}, BOB, " 3 ").priority == 3  # (an integer, as int() reads it: it counts)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [], "cache_salt": "salt-bob"}),
        ("/v1/responses", {"model": "m", "input": "hi", "cache_salt": "salt-bob"}),
        ("/v1/messages", {"model": "m", "messages": [], "max_tokens": 1, "cache_salt": "salt-bob"}),
        ("/invocations", {"messages": [], "cache_salt": "salt-bob"}),
        ("/v1/embeddings", {"model": "m", "input": "hi", "cache_salt": "salt-bob"}),
        ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {}, "cache_salt": "salt-bob"}),
    ],
)
def test_another_keys_salt_is_reserved_on_every_endpoint(path: str, body: dict[str, Any]) -> None:
    """A key without limits may call every endpoint, but not with a salt bound to another key (it would share, and
    could probe, that key's cache): refused wherever vLLM reads a ``cache_salt``, as on chat completions (elsewhere
    the check ran only on bodies carrying retention fields)."""
    admin = (b"authorization", b"Bearer sk-admin-000")
    status, reply, seen = _asgi(POLICY, body, [admin], path)
    assert status == 403 and "bound to another key" in reply["error"]["message"], path
    assert "raw" not in seen  # (never reached vLLM)
    status, _, seen = _asgi(POLICY, {**body, "cache_salt": "admin-own"}, [admin], path)
    assert status == 200 and seen["body"]["cache_salt"] == "admin-own"


def test_a_bound_salt_vllm_would_refuse_is_refused_at_load() -> None:
    """The server writes a key's bound salt into each of its requests; one vLLM refuses (over 128 characters, or
    with '@', '/', '\\' or NUL) made every request of the key fail with a 400 about a field it never sent."""
    for salt in ("tenant/alice", "alice@corp", "a\\b", "a\x00b", "s" * 129):
        with pytest.raises(AccessConfigError, match="'cache_salt' must be at most 128 characters"):
            AccessPolicy.from_json({"keys": [{"key": "sk-alice-000", "cache_salt": salt}]})
    AccessPolicy.from_json({"keys": [{"key": "sk-alice-000", "cache_salt": "s" * 128}]})
    try:  # (the rule is vLLM's: where it is installed, the two agree)
        from vllm.entrypoints.generate.base.protocol import validate_cache_salt
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return
    for salt in ("tenant/alice", "alice@corp", "a\\b", "a\x00b", "s" * 129):
        with pytest.raises(VLLMValidationError):
            validate_cache_salt(salt)
    validate_cache_salt("s" * 128)


def test_scopes_are_names_or_prefixes_and_null_owns_none() -> None:
    """An inner '*' is no pattern (only a trailing one is): refused at load, not read as a literal name; ``null``
    scopes own none, as the documentation says of a field left out."""
    with pytest.raises(AccessConfigError, match="'\\*' may only end a prefix"):
        AccessPolicy.from_json({"keys": [{"key": "sk-alice-000", "scopes": ["alice-*-prod"]}]})
    key = AccessPolicy.from_json({"keys": [{"key": "sk-alice-000", "scopes": None}]}).keys[0]
    assert key.scopes == () and not key.owns("alice")
    key = AccessPolicy.from_json({"keys": [{"key": "sk-alice-000", "scopes": ["alice-*", "*"]}]}).keys[0]
    assert key.owns("alice-1") and key.owns("anything")


def test_a_root_path_of_slash_routes_as_starlette_does() -> None:
    """With ``--root-path /`` vLLM's router serves ``/v1/chat/completions`` as chat (Starlette strips a root path
    only where it ends at a '/'); the limits read the same route (a plain prefix removal read
    ``v1/chat/completions``: a limited key's legal request was refused, and the health check needed a key)."""
    from kvretain.integrations.vllm.config import route_path

    assert route_path({"path": "/v1/chat/completions", "root_path": "/"}) == "/v1/chat/completions"
    assert route_path({"path": "/api/v1/chat/completions", "root_path": "/api"}) == "/v1/chat/completions"
    assert route_path({"path": "/apiv1/chat/completions", "root_path": "/api"}) == "/apiv1/chat/completions"
    assert route_path({"path": "/api", "root_path": "/api"}) == ""
    assert _reach(POLICY, {"type": "http", "path": "/health", "root_path": "/"}) == 200
    post = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "root_path": "/"}
    assert _reach(POLICY, post, [(b"authorization", b"Bearer sk-bob-00000")]) == 200


def _recorded_latencies(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Replace the latency histograms with fakes; the list they fill with (histogram, priority label)."""
    seen: list[tuple[str, str]] = []

    class Histogram:
        def __init__(self, name: str) -> None:
            self.name = name

        def labels(self, label: str) -> Any:
            name = self.name

            class Series:
                def observe(self, seconds: float) -> None:
                    seen.append((name, label))

            return Series()

    monkeypatch.setattr(
        metrics, "latency_histograms", lambda: {"ttft": Histogram("ttft"), "e2e": Histogram("e2e")}
    )
    return seen


def test_class_latency_counts_requests_behind_a_root_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # behind a path-prefix proxy (--root-path /api, the prefix kept in the path) the access limits read the route
    # without the prefix, but the latency middleware compared the raw path and recorded nothing
    seen = _recorded_latencies(monkeypatch)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def request(path: str, root: str) -> None:
        msgs = [{"type": "http.request", "body": b'{"priority": 3}', "more_body": False}]

        async def receive() -> Any:
            return msgs.pop(0)

        async def send(msg: Any) -> None:
            return None

        scope = {"type": "http", "method": "POST", "path": path, "root_path": root, "headers": []}
        await metrics.ClassLatency(app)(scope, receive, send)

    asyncio.run(request("/v1/chat/completions", ""))
    asyncio.run(request("/api/v1/chat/completions", "/api"))
    asyncio.run(request("/api/v1/models", "/api"))  # (not a generation: not timed)
    assert len(seen) == 2 and seen[0] == seen[1] and seen[0][0] == "e2e"


def test_class_latency_times_the_first_token_of_a_reasoning_or_tool_call_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vLLM streams a reasoning model's first tokens as "reasoning" deltas and a tool call's as "tool_calls" ones
    # (no "content"): the TTFT was taken at the first answer token after the whole reasoning, or never
    now = [0.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])
    seen: list[tuple[str, float]] = []

    class Histogram:
        def __init__(self, name: str) -> None:
            self.name = name

        def labels(self, label: str) -> Any:
            return SimpleNamespace(observe=lambda s: seen.append((self.name, s)))

    monkeypatch.setattr(
        metrics, "latency_histograms", lambda: {"ttft": Histogram("ttft"), "e2e": Histogram("e2e")}
    )
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    reasoning = b'data: {"choices":[{"index":0,"delta":{"reasoning":"Okay"}}]}\n\n'
    tool = b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"id":"c1","index":0,"function":{"name":"f"}}]}}]}\n\n'
    answer = b'data: {"choices":[{"index":0,"delta":{"content":"Paris"}}]}\n\n'

    def app_streaming(*chunks: bytes) -> Any:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            await receive()
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            for c in chunks:
                now[0] += 1  # (each chunk a second later)
                await send({"type": "http.response.body", "body": c, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

        return app

    async def request(app: Any) -> None:
        msgs = [{"type": "http.request", "body": b'{"stream": true}', "more_body": False}]

        async def receive() -> Any:
            return msgs.pop(0)

        async def send(msg: Any) -> None:
            return None

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
        await metrics.ClassLatency(app)(scope, receive, send)

    # arrival at 0, chunks at 1, 2, 3, 4: the first token is the reasoning at 2, not the answer at 4
    asyncio.run(request(app_streaming(role, reasoning, reasoning, answer)))
    assert seen == [("ttft", 2), ("e2e", 4)]
    seen.clear()
    asyncio.run(request(app_streaming(role, tool)))
    assert [name for name, _ in seen] == ["ttft", "e2e"]
    # a token that decodes to no text yet (a special token, part of a character): "content": "" without the role,
    # a completion's "text": ""; vLLM's benchmark (_choice_has_streamed_output) and engine take the TTFT there.
    # It was taken at the next token with text
    seen.clear()
    empty = b'data: {"choices":[{"index":0,"delta":{"content":""},"finish_reason":null}]}\n\n'
    asyncio.run(request(app_streaming(role, empty, answer)))
    assert seen == [("ttft", 2), ("e2e", 3)]
    seen.clear()
    no_text = b'data: {"choices":[{"index":0,"text":"","logprobs":null,"finish_reason":null}]}\n\n'
    text = b'data: {"choices":[{"index":0,"text":"Paris","logprobs":null,"finish_reason":null}]}\n\n'
    asyncio.run(request(app_streaming(no_text, text)))
    assert seen == [("ttft", 1), ("e2e", 2)]


# ---------------------------------------------------------------- review of the operator surface (session 42)
def test_an_empty_key_file_stops_the_server_instead_of_opening_it(tmp_path):
    # an empty (or blank) KVRETAIN_API_KEYS_FILE opened the server to every client, and the warning said the
    # variables were unset; a broken file already stopped the server
    empty = tmp_path / "keys.json"
    for content in ("", "  \n"):
        empty.write_text(content)
        with pytest.raises(AccessConfigError, match=rf"^KVRETAIN_API_KEYS_FILE={empty}: the file is empty"):
            AccessPolicy.from_env({"KVRETAIN_API_KEYS_FILE": str(empty)})
    assert not AccessPolicy.from_env({}).configured
    listed_none = AccessPolicy.from_env({"KVRETAIN_API_KEYS": '{"keys": [], "max_duration_s": 60}'})
    assert listed_none.is_open and listed_none.configured  # (global limits only: open, and said so)


def test_the_announcement_says_why_the_server_is_open(caplog):
    from kvretain.integrations.vllm import middleware

    with caplog.at_level("WARNING", logger=middleware.logger.name):
        middleware._announce(AccessPolicy())
        middleware._announce(AccessPolicy.from_json({"keys": []}))
    said = [r.getMessage() for r in caplog.records]
    assert "KVRETAIN_API_KEYS_FILE / KVRETAIN_API_KEYS unset" in said[0]
    assert "the configuration lists none" in said[1] and "unset" not in said[1]


def test_the_servers_duration_limit_suggests_no_expiry_only_where_the_key_may_have_it():
    limits = {"max_duration_s": 60}
    body = {"vllm_xargs": {"retention_directives": '[{"start": 0, "priority": 50, "duration": 120}]'}}
    with pytest.raises(AccessDenied, match=r"limit of 60 s \(omit duration to retain without expiry\)"):
        AccessPolicy.from_json(limits).check(body, None)
    keyed = AccessPolicy.from_json({**KEYS, **limits})
    bob = next(k for k in keyed.keys if k.name == "bob")  # (max_duration_s 60: no duration is refused too)
    with pytest.raises(AccessDenied) as refused:
        keyed.check({**body, "priority": 1}, bob)
    assert "limit of 60 s" in str(refused.value) and "omit" not in str(refused.value)


def test_an_infinite_duration_is_refused_by_the_engine_as_by_the_access_limits():
    # the access limits refused JSON's 1e400 (inf) as "not finite", the engine took it as no expiry: a client
    # without the access middleware (offline, or a server without it) got what the server refused
    from kvretain.core.retention import RetentionError
    from kvretain.integrations.vllm.config import retention_from_extra_args, validation_message

    for xargs, field in [
        (
            {"retention_directives": '[{"start": 0, "priority": 50, "duration": 1e400}]'},
            "retention_directives[0]",
        ),
        ({"retention_decode_duration": float("inf")}, "retention_decode_duration"),
    ]:
        with pytest.raises(RetentionError, match=rf"^{re.escape(field)}: duration must be a finite number"):
            retention_from_extra_args(xargs)
        assert "omit it to retain without expiry" in (validation_message(xargs) or "")
        with pytest.raises(AccessDenied, match="finite"):
            AccessPolicy.from_json({"max_duration_s": 60}).check({"vllm_xargs": xargs}, None)


def test_class_latency_labels_a_priority_as_vllm_reads_it():
    # vLLM's request models read priority as a pydantic int (lax): "3", 3.0 and true run at 3, 3 and 1, and
    # ClassLatency (without AccessLimits, which refuses them) observed those requests under priority 0
    for raw, want in [
        ('{"priority": "3"}', 3),
        ('{"priority": " -2 "}', -2),
        ('{"priority": 3.0}', 3),
        ('{"priority": "4.0"}', 4),
        ('{"priority": true}', 1),
        ('{"priority": 7}', 7),
        ('{"priority": 2.5}', 0),  # (vLLM refuses these: no 200, nothing observed)
        ('{"priority": "x"}', 0),
        ('{"priority": null}', 0),
        ('{"priority": 1e999}', 0),
    ]:
        assert metrics._priority_of(raw.encode(), {"headers": []}) == want, raw


def test_a_clients_huge_values_are_shortened_in_the_reply():
    keyed = AccessPolicy.from_json(KEYS)
    bob = next(k for k in keyed.keys if k.name == "bob")
    cases = [
        {"priority": 10**4000},
        {"priority": 1, "vllm_xargs": {"retention_scope": "x" * 100_000}},
        {"priority": 1, "vllm_xargs": {"retention_" + "y" * 100_000: 1}},
        {"priority": 1, "vllm_xargs": {f"retention_a{i}": 1 for i in range(500)}},
    ]
    for body in cases:
        with pytest.raises(AccessDenied) as refused:
            keyed.check(body, bob)
        assert len(str(refused.value)) < 400 and len(refused.value.param or "") <= 40, str(refused.value)[
            :100
        ]
    with pytest.raises(
        AccessDenied, match=r"\['retention_a0', 'retention_a1', 'retention_a10'\] and 497 more"
    ):
        keyed.check(cases[-1], bob)


def test_gauges_without_a_balance_read_minus_one_for_both_balance_fields():
    # balance_start read 0 ("a start at frequency") for lru / priority / lfu queues, where -1 means no balance
    from types import SimpleNamespace

    from kvretain.core.policy import PolicyConfig, make_policy

    strict = make_policy("priority", 12, PolicyConfig(block_size=16))
    g = metrics.queue_gauges([SimpleNamespace(policy=strict, pool_blocks=range(12))])
    assert (g["frequency_exponent_now"], g["balance_start"]) == (-1.0, -1.0)
    _, merged = metrics.merge([{"pid": 1, "by_priority": {}, "gauges": {"pool_blocks": 12.0}}])
    assert (merged["frequency_exponent_now"], merged["balance_start"]) == (-1.0, -1.0)


# ---------------------------------------------------------------- an adversarial pass (session 45)
def test_a_key_named_twice_in_the_limits_is_a_config_error():
    # json.loads kept the last: a second "keys": [] opened the server, a second cap of null lifted the first
    for text, field in [
        ('{"keys": [{"key": "sk-aaaaaaaa"}], "keys": []}', "keys"),
        (
            '{"keys": [{"key": "sk-aaaaaaaa", "max_retention_priority": 10, "max_retention_priority": null}]}',
            "max_retention_priority",
        ),
        ('{"mode": "reject", "keys": [{"key": "sk-aaaaaaaa"}], "mode": "clamp"}', "mode"),
    ]:
        with pytest.raises(AccessConfigError, match=rf"not valid JSON \(the key '{field}' is given twice"):
            AccessPolicy.from_env({"KVRETAIN_API_KEYS": text})


@pytest.mark.parametrize("name", ["KVRETAIN_API_KEYS_FILE", "KVRETAIN_API_KEYS"])
def test_a_limits_variable_of_blanks_is_a_config_error(name):
    # read as unset: the server opened to every client and its warning said the variable was unset
    with pytest.raises(AccessConfigError, match=rf"^{name} holds only blanks"):
        AccessPolicy.from_env({name: "  "})


def test_a_body_nested_past_the_parser_is_priority_0_for_the_latency_classes():
    # json.loads raised RecursionError in ClassLatency's receive: a 500 and a traceback instead of the request
    assert metrics._priority_of(b"[" * 200_000, {"headers": []}) == 0
    assert metrics._priority_of(b'{"priority": 3}', {"headers": []}) == 3


def test_an_exact_scope_owns_only_that_name_and_no_scopes_owns_none():
    pol = AccessPolicy.from_json(
        {
            "keys": [
                {"key": "sk-exact-0001", "name": "exact", "scopes": ["alice"]},
                {"key": "sk-noscope-01", "name": "noscope"},
            ]
        }
    )
    exact, noscope = pol.keys
    assert pol.check({"retention_scope": "alice"}, exact).body["vllm_xargs"]["retention_scope"] == "alice"
    for scope in ("alice-2", "alicex", "alic"):
        assert "does not own" in _denied(lambda s=scope: pol.check({"retention_scope": s}, exact), 403)
    for scope in ("alice", "anyone"):
        assert "it owns: none" in _denied(lambda s=scope: pol.check({"retention_scope": s}, noscope), 403)


def test_only_the_whole_key_with_the_bearer_scheme_authenticates():
    assert POLICY.authenticate("bearer sk-bob-00000") is BOB  # (the scheme in any case)
    for header in ("Basic sk-bob-00000", "Token sk-bob-00000", "Bearer sk-bob-0000", "Bearer sk-bob"):
        _denied(lambda h=header: POLICY.authenticate(h), 401)


def test_a_request_priority_that_maps_exactly_to_the_cap_is_allowed():
    # the default mapping puts priority 0 at 35: a cap of 35 allows it (and -1, at 45, not)
    pol = AccessPolicy.from_json({"keys": [{"key": "sk-12345678", "max_retention_priority": 35}]})
    d = pol.check({"priority": 0}, pol.keys[0])
    assert d.priority == 0 and not d.notes
    assert pol.check({}, pol.keys[0]).priority == 0


def test_a_cap_whose_priorities_lie_past_int64_is_a_config_error():
    # normal = the int64 maximum: retention 10 needs a priority past it, which no request can carry
    mapping = PriorityMapping.parse(f"normal={2**63 - 1},step=1")
    with pytest.raises(AccessConfigError, match="no request priority"):
        AccessPolicy.from_json(
            {"keys": [{"key": "sk-12345678", "max_retention_priority": 10}]}, mapping=mapping
        )


def test_zero_limits_are_limits_not_unlimited():
    # max_retention_priority 0 and max_duration_s 0 (the docstring's batch key) hold as any other value
    keys = [
        {"key": "sk-zero-0001", "name": "zero", "max_retention_priority": 0, "max_duration_s": 0},
        {
            "key": "sk-zeroc-001",
            "name": "zeroc",
            "max_retention_priority": 0,
            "max_duration_s": 0,
            "mode": "clamp",
        },
    ]
    pol = AccessPolicy.from_json({"keys": keys})
    refuse, clamp = pol.keys
    body = {"priority": 10, "vllm_xargs": {"retention_directives": _d(1, 0)}}
    assert "up to 0; got 1" in _denied(lambda: pol.check(dict(body), refuse), 403)
    body = {"priority": 10, "vllm_xargs": {"retention_directives": _d(0, 5)}}
    assert "at most 0 s; got 5 s" in _denied(lambda: pol.check(dict(body), refuse), 403)
    body = {"priority": 10, "vllm_xargs": {"retention_directives": _d(0)}}
    assert "got no duration" in _denied(lambda: pol.check(dict(body), refuse), 403)
    d = pol.check({"priority": 10, "vllm_xargs": {"retention_directives": _d(60)}}, clamp)
    (dv,) = json.loads(d.body["vllm_xargs"]["retention_directives"])
    assert dv["priority"] == 0 and dv["duration"] == 0


def test_the_servers_duration_limit_holds_to_the_second():
    pol = AccessPolicy.from_json({"max_duration_s": 60})
    pol.check({"vllm_xargs": {"retention_directives": _d(50, 60)}}, None)
    assert "over this server's limit of 60 s" in _denied(
        lambda: pol.check({"vllm_xargs": {"retention_directives": _d(50, 60.5)}}, None), 400
    )


def test_a_clamp_key_bound_to_a_salt_replaces_any_salt_it_sends():
    pol = AccessPolicy.from_json(
        {
            "keys": [
                {"key": "sk-dave-0001", "name": "dave", "cache_salt": "salt-dave", "mode": "clamp"},
                {"key": "sk-erin-0001", "name": "erin", "cache_salt": "salt-erin"},
            ]
        }
    )
    dave = pol.keys[0]
    for given in ("salt-erin", "other"):
        d = pol.check({"cache_salt": given}, dave)
        assert d.body["cache_salt"] == "salt-dave" and d.changed


def test_a_key_owning_no_scopes_is_limited_on_the_other_endpoints():
    # no limit fields but no scopes either: it may not name a scope, so it is a limited key (only ["*"] is not)
    pol = AccessPolicy.from_json(
        {"keys": [{"key": "sk-plain-001", "name": "plain"}, {"key": "sk-star-0001", "scopes": ["*"]}]}
    )
    plain = [(b"authorization", b"Bearer sk-plain-001")]
    star = [(b"authorization", b"Bearer sk-star-0001")]
    status, reply, _ = _asgi(pol, {"prompt": "x"}, plain, "/invocations")
    assert status == 403 and "not open to limited API keys" in reply["error"]["message"]
    assert _asgi(pol, {"prompt": "x"}, star, "/invocations")[0] == 200


def test_the_body_limit_admits_a_body_of_exactly_that_size():
    def body(size):
        raw = json.dumps({"messages": [], "pad": ""}).encode()
        return json.dumps({"messages": [], "pad": "x" * (size - len(raw))}).encode()

    assert len(body(4096)) == 4096
    assert _asgi(AccessPolicy(), body(4096))[0] == 200
    assert _asgi(AccessPolicy(), body(4097))[0] == 413


def test_class_latency_reads_a_chunked_bodys_priority_and_times_successes_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the priority is read from the whole body, however many chunks it came in; a response other than 200 is
    # not timed (an error's latency is no request's latency)
    seen = _recorded_latencies(monkeypatch)

    def app_with(status: int) -> Any:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            await receive()
            await receive()
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

        return app

    async def request(status: int) -> None:
        msgs = [
            {"type": "http.request", "body": b'{"priority": ', "more_body": True},
            {"type": "http.request", "body": b"3}", "more_body": False},
        ]

        async def receive() -> Any:
            return msgs.pop(0)

        async def send(msg: Any) -> None:
            return None

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "root_path": "", "headers": []}
        await metrics.ClassLatency(app_with(status))(scope, receive, send)

    asyncio.run(request(200))
    assert seen == [("e2e", metrics._LABELS.of(3))]
    asyncio.run(request(500))
    assert len(seen) == 1


def test_a_snapshot_of_pid_zero_is_skipped():
    # local_snapshot writes its own process id (> 0); pid 0 would make the liveness check signal the process group
    assert not metrics._snapshot_ok({"pid": 0, "by_priority": {}, "gauges": {}})
    assert metrics._snapshot_ok({"pid": 1, "by_priority": {}, "gauges": {}})


def test_a_queues_balance_gauges_read_its_values_not_their_absent_marker():
    # frequency_exponent_now and balance_start read -1 until a queue reports them; then they read its value
    from types import SimpleNamespace

    q = SimpleNamespace(
        stats=lambda: {"frequency_exponent_now": 2.0, "balance_start": 0.5}, pool_blocks=range(4)
    )
    g = metrics.queue_gauges([q])
    assert g["frequency_exponent_now"] == 2.0 and g["balance_start"] == 0.5


def test_the_metrics_side_channel_logs_through_vllms_logger(monkeypatch, caplog):
    # the plugin logs under vLLM's own logger (``vllm.kvretain``), which vLLM configures in every process it starts;
    # the side channel's warning went to an unconfigured ``kvretain.integrations.vllm`` logger instead
    from kvretain.integrations.vllm import _runtime

    def unavailable() -> None:
        raise OSError("no metrics directory")

    def no_collector(directory: Any) -> None:
        raise RuntimeError("no registry")

    monkeypatch.setattr(metrics, "_installed", {})
    monkeypatch.setattr(metrics, "metrics_dir", unavailable)
    monkeypatch.setattr(metrics, "Collector", no_collector)
    with caplog.at_level("DEBUG", logger=_runtime.LOGGER_NAME):
        metrics.install()
    said = {r.getMessage(): r.name for r in caplog.records}
    under = _runtime.LOGGER_NAME + "."
    assert said["kvretain: per-priority metrics side channel unavailable"].startswith(under)
    assert said["kvretain: prometheus collector not registered"].startswith(under)


def test_class_latency_times_no_e2e_for_a_stream_the_client_left(monkeypatch: pytest.MonkeyPatch) -> None:
    # a client that disconnects mid-stream (its own timeout, under load) got an e2e observation at the moment it
    # left, where vLLM's own vllm:e2e_request_latency_seconds leaves an aborted request out; its first token, once
    # streamed, is still a TTFT (vLLM's TTFT histogram observes it at the first token too)
    seen = _recorded_latencies(monkeypatch)
    token = b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'

    def app_leaving(how: str) -> Any:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            await receive()
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": token, "more_body": True})
            if how == "full":
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            elif how == "send fails":  # (Starlette under ASGI 2.4: the last send raises, ClientDisconnect)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            # "cancelled": Starlette's task group cancelled at http.disconnect, the app returns, no last body

        return app

    async def request(how: str) -> None:
        msgs = [{"type": "http.request", "body": b'{"stream": true}', "more_body": False}]

        async def receive() -> Any:
            return msgs.pop(0)

        async def send(msg: Any) -> None:
            if how == "send fails" and msg["type"] == "http.response.body" and not msg.get("more_body"):
                raise OSError("client gone")

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
        with contextlib.suppress(OSError):
            await metrics.ClassLatency(app_leaving(how))(scope, receive, send)

    asyncio.run(request("full"))
    assert [name for name, _ in seen] == ["ttft", "e2e"]
    for how in ("cancelled", "send fails"):
        seen.clear()
        asyncio.run(request(how))
        assert [name for name, _ in seen] == ["ttft"], how


def _vllm_app(cors: dict[str, Any], plugin: bool, api_key: list[str] | None = None) -> Any:
    """A FastAPI app with vLLM's own middleware (``init_entrypoints_middleware``: CORS from ``cors``, its API-key
    check when ``api_key``) and, with ``plugin``, the access limits where ``--middleware`` puts them (added last:
    outermost); two routes standing for vLLM's endpoints."""
    pytest.importorskip("fastapi")
    register = pytest.importorskip("vllm.entrypoints.serve.middleware.register")
    from argparse import Namespace

    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat() -> dict[str, int]:
        return {"ok": 1}

    @app.post("/v1/embeddings")
    async def embeddings() -> dict[str, int]:
        return {"ok": 1}

    args = {"allow_credentials": False, "allowed_methods": ["*"], "allowed_headers": ["*"], **cors}
    ns = Namespace(**args, api_key=api_key, enable_request_id_headers=False, middleware=[])
    register.init_entrypoints_middleware(ns, app, ("generate",))
    if plugin:
        app.add_middleware(AccessLimits, policy=POLICY, max_body_bytes=4096)  # type: ignore[arg-type]
    return app


def _cors_headers(r: Any) -> dict[str, str]:
    return {k: v for k, v in r.headers.items() if k.startswith("access-control-") or k == "vary"}


@pytest.mark.parametrize(
    "cors",
    [
        {"allowed_origins": ["https://ui.example"]},
        {"allowed_origins": ["*"], "allow_credentials": True},
        {"allowed_origins": []},  # (vLLM's default: no cross-origin access)
    ],
)
def test_a_refusal_carries_the_cors_headers_of_vllms_own_errors(cors: dict[str, Any]) -> None:
    # the access middleware runs outside vLLM's CORSMiddleware (--middleware is added last): its refusals had no
    # CORS headers, so a browser page of an allowed origin read a network error, not the 401/403
    _vllm_app(cors, plugin=False)  # (skips without vLLM)
    from starlette.testclient import TestClient

    plugin = TestClient(_vllm_app(cors, plugin=True))
    stock = TestClient(_vllm_app(cors, plugin=False))
    for origin in ("https://ui.example", "https://elsewhere.example"):
        o = {"Origin": origin, "Cookie": "session=1"}
        admin = {**o, "Authorization": "Bearer sk-admin-000"}
        # vLLM's own error for the same request (a route it does not have), under the same settings
        want = _cors_headers(stock.post("/v1/nope", json={}, headers=admin))
        allowed = origin in cors["allowed_origins"] or cors["allowed_origins"] == ["*"]
        assert ("access-control-allow-origin" in want) is allowed
        refusals = [
            (401, plugin.post("/v1/chat/completions", json={}, headers=o)),
            (
                403,
                plugin.post("/v1/embeddings", json={}, headers={**o, "Authorization": "Bearer sk-bob-00000"}),
            ),
            (400, plugin.post("/v1/chat/completions", content=b"{", headers=admin)),
            (413, plugin.post("/v1/chat/completions", content=b" " * 5000, headers=admin)),
        ]
        for status, r in refusals:
            assert r.status_code == status and r.json()["error"]["code"] == status
            assert _cors_headers(r) == want, (status, origin)
        # a preflight passes the access limits to vLLM's CORS middleware, as without them
        pre = {
            **o,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization",
        }
        got, ref = (c.options("/v1/chat/completions", headers=pre) for c in (plugin, stock))
        assert (got.status_code, _cors_headers(got)) == (ref.status_code, _cors_headers(ref))
    # and without an Origin (no browser's cross-origin request) the headers vLLM's own errors get then
    want = _cors_headers(stock.post("/v1/nope", json={}, headers={"Authorization": "Bearer sk-admin-000"}))
    assert "access-control-allow-origin" not in want
    assert _cors_headers(plugin.post("/v1/chat/completions", json={})) == want


def test_vllms_own_api_key_refusal_carries_no_cors_headers() -> None:
    # what the plugin's refusals go beyond: vLLM's --api-key check (AuthenticationMiddleware) also runs outside
    # CORS, so its 401 is unreadable to a browser page even of an allowed origin (vLLM 0.32 / 0.33)
    app = _vllm_app({"allowed_origins": ["https://ui.example"]}, plugin=False, api_key=["sk-vllm-000"])
    from starlette.testclient import TestClient

    r = TestClient(app).post("/v1/chat/completions", json={}, headers={"Origin": "https://ui.example"})
    assert r.status_code == 401 and _cors_headers(r) == {}
