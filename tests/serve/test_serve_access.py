"""Access limits over HTTP (vLLM's --middleware): a key that may not raise priority or retention cannot; a key
bound to a cache salt never hits another tenant's cache; scopes cannot be spoofed."""

from __future__ import annotations

import time

import openai
import pytest
from _client import chat, flood, user

from conftest import ADMIN, ORIGIN

ALICE, BOB, CAROL = "sk-alice-0123456789", "sk-bob-0123456789", "sk-carol-0123456789"
HIGH = [{"start": 0, "end": None, "priority": 90}]


def _refused(fn, status=403):
    with pytest.raises(openai.APIStatusError) as e:
        fn()
    assert e.value.status_code == status, e.value
    return e.value.message


def _requests_by_priority(srv):
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(srv.metrics_text()):
        if fam.name == "kvretain:prefix_cache_requests":
            for s in fam.samples:
                out[s.labels["priority"]] = s.value
    return out


def _wait_requests(srv, before, want, timeout=10.0):
    """Poll /metrics until the per-priority request counts moved by ``want`` (the snapshot is 0.5 s behind)."""
    deadline = time.monotonic() + timeout
    while True:
        now = _requests_by_priority(srv)
        delta = {p: now.get(p, 0) - before.get(p, 0) for p in set(now) | set(before)}
        delta = {p: v for p, v in delta.items() if v}
        if delta == want or time.monotonic() > deadline:
            return delta
        time.sleep(0.3)


def test_a_limited_key_cannot_raise_request_priority(servers, text):
    srv = servers["plugin"]
    bob = srv.as_key(BOB)
    prompt = user(text("bob-prio", 20))
    msg = _refused(lambda: chat(bob, srv.model, prompt, priority=0))
    assert "request priority 1 or higher" in msg, msg
    msg = _refused(lambda: chat(bob, srv.model, prompt, headers={"X-Vllm-Priority": "-5"}))
    assert "got -5" in msg, msg
    # without a priority it runs at the key's own (1); clamp mode (carol) lowers an over-limit one: the engine
    # sees priority 1 in both cases
    before = _requests_by_priority(srv)
    chat(bob, srv.model, prompt)
    chat(srv.as_key(CAROL), srv.model, prompt, priority=-3)
    assert _wait_requests(srv, before, {"1": 2}) == {"1": 2}


def test_a_retention_capped_key_runs_at_the_default_priority(servers, text):
    # alice (max_retention_priority 90, no min_request_priority, as README's keys.json) may ask for priority -5
    # (retention 85); without a priority her requests ran at -5 all the same, ahead of everyone's default 0
    srv = servers["plugin"]
    alice = srv.as_key(ALICE)
    before = _requests_by_priority(srv)
    chat(alice, srv.model, user(text("alice-default", 20)))
    chat(alice, srv.model, user(text("alice-asks", 20)), priority=-5)
    assert _wait_requests(srv, before, {"0": 1, "-5": 1}) == {"0": 1, "-5": 1}


def test_directives_as_a_list_in_vllm_xargs_are_taken(servers, text):
    # vLLM's vllm_xargs takes no list of objects (six pydantic errors); the middleware forwards them as JSON
    srv = servers["plugin"]
    prompt = user(text("alice-xargs-list", 20))
    xargs = {"retention_directives": [{"start": 0, "end": None, "priority": 80, "duration": 60}]}
    assert chat(srv.as_key(ALICE), srv.model, prompt, xargs=xargs).completion_tokens > 0
    msg = _refused(lambda: chat(srv.as_key(BOB), srv.model, prompt, xargs=xargs))
    assert "retention priority up to 25; got 80" in msg, msg


def test_a_limited_key_cannot_raise_retention(servers, text):
    srv = servers["plugin"]
    bob = srv.as_key(BOB)
    prompt = user(text("bob-ret", 120))
    msg = _refused(lambda: chat(bob, srv.model, prompt, directives=HIGH))
    assert "retention priority up to 25; got 90" in msg, msg
    msg = _refused(
        lambda: chat(bob, srv.model, prompt, directives=[{"start": 0, "priority": 20, "duration": 5}])
    )
    assert "at most 0 s" in msg, msg
    msg = _refused(lambda: chat(bob, srv.model, prompt, xargs={"retention_decode_priority": 90}))
    assert "retention_decode_priority: key 'bob' may ask for retention priority up to 25; got 90" in msg, msg
    # clamp mode: carol's directive 90 becomes 25 (her priority-1 mapping): a priority-1 flood evicts it, while
    # the admin's identical request keeps its blocks (the control)
    for key, name, want_kept in ((CAROL, "carol", False), (ADMIN, "admin", True)):
        srv.reset_cache()
        client = srv.as_key(key)
        p = user(text(f"{name}-clamp", 120))
        chat(client, srv.model, p, priority=1, directives=HIGH)
        flood(srv.client, srv.model, text, f"{name}-cflood")
        cached = chat(client, srv.model, p, priority=1).cached_tokens
        assert (cached >= 96) is want_kept, (name, cached)


def test_scopes_cannot_be_spoofed(servers, text):
    srv = servers["plugin"]
    prompt = user(text("spoof", 20))
    msg = _refused(lambda: chat(srv.as_key(BOB), srv.model, prompt, scope="alice"))
    assert "does not own retention_scope 'alice'" in msg, msg
    chat(
        srv.as_key(ALICE),
        srv.model,
        prompt,
        scope="alice-session-7",
        directives=[{"start": 0, "priority": 90, "duration": 60}],
    )  # a prefix it owns


def test_a_salt_bound_key_never_hits_another_tenants_cache(servers, text):
    srv = servers["plugin"]
    srv.reset_cache()
    alice, bob = srv.as_key(ALICE), srv.as_key(BOB)
    prompt = user(text("tenant", 120))
    chat(alice, srv.model, prompt)
    assert chat(alice, srv.model, prompt).cached_tokens >= 96
    assert chat(bob, srv.model, prompt).cached_tokens == 0
    assert chat(srv.client, srv.model, prompt).cached_tokens == 0  # the admin (no salt) neither
    assert chat(srv.client, srv.model, prompt, salt="x").cached_tokens == 0
    msg = _refused(lambda: chat(bob, srv.model, prompt, salt="tenant-alice"))
    assert "bound to its own cache_salt" in msg, msg
    msg = _refused(lambda: chat(srv.client, srv.model, prompt, salt="tenant-alice"))  # even the admin's
    assert "bound to another key" in msg, msg
    # clamp mode drops a salt bound to another key instead: still no hit on alice's cache
    fresh = user(text("tenant-2", 120))
    chat(alice, srv.model, fresh)
    assert chat(srv.as_key(CAROL), srv.model, fresh, salt="tenant-alice").cached_tokens == 0


def test_keys_are_required_and_an_open_server_says_so(servers):
    srv = servers["plugin"]
    _refused(lambda: srv.as_key("sk-nobody-000000").models.list(), status=401)
    assert srv.as_key(BOB).models.list().data
    assert "API key(s) (admin, alice, bob, carol)" in srv.proc.log_text()
    assert "open to every client" in servers["inproc"].proc.log_text()


def _raw(srv, method, path, headers):
    """Status and headers of a bare HTTP request (urllib: no client of its own adds or reads anything)."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(srv.url + path, data=b"{}" if method == "POST" else None, method=method)
    for k, v in headers.items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        e.read()
        return e.code, {k.lower(): v for k, v in e.headers.items()}


def _cors(h):
    return {k: v for k, v in h.items() if k.startswith("access-control-") or k == "vary"}


def test_a_browser_page_of_an_allowed_origin_can_read_a_refusal(servers):
    # the servers allow ORIGIN (--allowed-origins); the plugin's refusals carry the CORS headers that vLLM's own
    # errors carry there (a stock server's 404), so a page can read the 401 / 403; a preflight is vLLM's
    plugin, stock = servers["plugin"], servers["stock"]
    o = {"Origin": ORIGIN, "Content-Type": "application/json"}
    status, want = _raw(stock, "POST", "/v1/no-such-endpoint", o)
    assert status == 404 and _cors(want)["access-control-allow-origin"] == ORIGIN
    for key, path, code in (("sk-nobody-000000", "/v1/chat/completions", 401), (BOB, "/v1/embeddings", 403)):
        status, got = _raw(plugin, "POST", path, {**o, "Authorization": f"Bearer {key}"})
        assert (status, _cors(got)) == (code, _cors(want))
    status, got = _raw(plugin, "POST", "/v1/chat/completions", {**o, "Origin": "https://elsewhere.example"})
    assert status == 401 and "access-control-allow-origin" not in got
    pre = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization",
    }
    (s1, h1), (s2, h2) = (_raw(srv, "OPTIONS", "/v1/chat/completions", pre) for srv in (plugin, stock))
    assert s1 == s2 == 200 and _cors(h1) == _cors(h2) and h1["access-control-allow-origin"] == ORIGIN
