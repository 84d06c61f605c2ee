"""Malformed and hostile requests: each gets the intended 4xx with a message saying what is wrong, the server
neither crashes nor wedges, and a normal request succeeds after them."""

from __future__ import annotations

import json

import pytest
from _client import chat, user

D = "retention_directives"


def _xargs(directives, **more):
    return {"vllm_xargs": {D: directives if isinstance(directives, str) else json.dumps(directives), **more}}


def _body(extra):
    return {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2, **extra}


MANY = json.dumps([{"start": 2 * i, "end": 2 * i + 1, "priority": 50} for i in range(100_000)])

CASES = [
    # (id, extra body fields, status, words the message must contain)
    ("directives-not-json", _xargs("[{start: 0"), 400, "not valid JSON"),
    ("directives-an-object", _xargs({"start": 0, "priority": 90}), 400, "must be a list"),
    ("directives-nested", _xargs([[{"start": 0, "priority": 90}]]), 400, "expected an object"),
    ("priority-out-of-range", _xargs([{"start": 0, "priority": 150}]), 400, "out of range"),
    ("priority-negative", _xargs([{"start": 0, "priority": -1}]), 400, "out of range"),
    ("priority-a-string", _xargs([{"start": 0, "priority": "90"}]), 400, "must be an integer"),
    ("priority-missing", _xargs([{"start": 0, "end": 32}]), 400, "missing field 'priority'"),
    ("start-negative", _xargs([{"start": -5, "priority": 50}]), 400, "non-negative"),
    ("end-before-start", _xargs([{"start": 64, "end": 32, "priority": 50}]), 400, "must be before end"),
    ("end-a-string", _xargs([{"start": 0, "end": "all", "priority": 50}]), 400, "end must be"),
    (
        "overlapping",
        _xargs([{"start": 0, "end": 64, "priority": 50}, {"start": 32, "end": 96, "priority": 60}]),
        400,
        "overlap",
    ),
    ("unknown-directive-field", _xargs([{"start": 0, "priority": 50, "pin": True}]), 400, "unknown field"),
    ("1e5-directives", _xargs(MANY), 400, "at most 1024"),
    ("duration-negative", _xargs([{"start": 0, "priority": 50, "duration": -3}]), 400, ">= 0"),
    ("duration-infinite", _xargs('[{"start": 0, "priority": 50, "duration": 1e999}]'), 400, "finite"),
    (
        "duration-huge",
        _xargs([{"start": 0, "priority": 50, "duration": 1e12}]),
        400,
        "over this server's limit",
    ),
    ("duration-nan", _xargs('[{"start": 0, "priority": 50, "duration": NaN}]'), 400, "duration"),
    (
        "duration-a-string",
        _xargs([{"start": 0, "priority": 50, "duration": "30s"}]),
        400,
        "number of seconds",
    ),
    ("scope-a-number", {"vllm_xargs": {"retention_scope": 42}}, 400, "retention_scope must be a string"),
    (
        "decode-priority-out-of-range",
        {"vllm_xargs": {"retention_decode_priority": 150}},
        400,
        "retention_decode_priority: priority 150 is out of range",
    ),
    (
        "decode-duration-a-string",
        {"vllm_xargs": {"retention_decode_priority": 50, "retention_decode_duration": "5s"}},
        400,
        "retention_decode_duration must be a number of seconds",
    ),
    ("unknown-retention-field", {"vllm_xargs": {"retention_scop": "alice"}}, 400, "unknown retention field"),
    (
        "retention-twice",
        {"retention_scope": "a", "vllm_xargs": {"retention_scope": "a"}},
        400,
        "both at the top level and in vllm_xargs",
    ),
    ("request-priority-a-string", {"priority": "high"}, 400, "priority must be an integer"),
    ("request-priority-fractional", {"priority": 0.5}, 400, "priority must be an integer"),
    ("request-priority-huge", {"priority": 10**30}, 400, "64-bit"),
    ("vllm-xargs-not-an-object", {"vllm_xargs": "retention"}, 400, "valid dictionary"),
    ("cache-salt-empty", {"cache_salt": ""}, 400, "cache_salt"),
    ("max-tokens-negative", {"max_tokens": -1}, 400, "max_tokens"),
    (
        "prompt-beyond-model-length",
        {"messages": [{"role": "user", "content": "word " * 2000}]},
        400,
        "maximum context length",
    ),
]


@pytest.mark.parametrize(("extra", "status", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_gets_the_intended_4xx(servers, extra, status, words):
    srv = servers["plugin"]
    got, body = srv.post("/v1/chat/completions", {"model": srv.model, **_body(extra)})
    assert got == status, body
    message = body["error"]["message"] if isinstance(body, dict) else str(body)
    assert words in message, message
    assert srv.proc.alive()


def test_hostile_bodies_and_keys(servers):
    srv = servers["plugin"]
    cases = [
        (b"{not json", None, 400, "not valid JSON"),
        (b"[1, 2, 3]", None, 400, "JSON object"),
        (json.dumps({"model": srv.model, **_body({})}).encode(), "sk-wrong-key-000", 401, "invalid API key"),
        (json.dumps({"model": srv.model, **_body({})}).encode(), "", 401, "missing API key"),
        (b" " * (9 * 1024 * 1024), None, 413, "over"),
    ]
    import urllib.request

    for data, key, status, words in cases:
        req = urllib.request.Request(srv.url + "/v1/chat/completions", data=data, method="POST")
        req.add_header("Content-Type", "application/json")
        if key != "":
            req.add_header("Authorization", f"Bearer {key or srv.key}")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                got, msg = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            got, msg = e.code, json.loads(e.read())["error"]["message"]
        assert (got, words in msg) == (status, True), (status, msg)


def test_the_server_still_serves_after_the_bad_requests(servers, text):
    for srv in servers.values():
        assert srv.healthy(), srv.name
        r = chat(srv.client, srv.model, user(text("after", 20)), max_tokens=4)
        assert r.completion_tokens == 4
