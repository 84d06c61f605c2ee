"""The plugin's retention end to end over HTTP: request priority, directives with durations, scopes, salts."""

from __future__ import annotations

import time

from _client import chat, flood, user

SYSTEM_WORDS = 120  # with the template: 4 full 32-token blocks of conversation prefix


def _conversation(srv, text, tag):
    """A priority-0 conversation of two turns; returns the messages of its next turn."""
    msgs = [{"role": "system", "content": text(f"{tag}-sys", SYSTEM_WORDS)}, *user(text(f"{tag}-u1", 8))]
    first = chat(srv.client, srv.model, msgs, priority=0, max_tokens=8)
    msgs += [{"role": "assistant", "content": first.text}, *user(text(f"{tag}-u2", 8))]
    second = chat(srv.client, srv.model, msgs, priority=0, max_tokens=8)
    assert second.cached_tokens >= 96, second  # the second turn hits the first's prefix
    msgs += [{"role": "assistant", "content": second.text}, *user(text(f"{tag}-u3", 8))]
    return msgs


def test_priority0_conversation_survives_a_priority1_flood_with_the_plugin_only(servers, text):
    kept = {}
    for name in ("stock", "plugin"):
        srv = servers[name]
        srv.reset_cache()
        msgs = _conversation(srv, text, "conv")
        flood(srv.client, srv.model, text, f"flood-{name}")
        kept[name] = chat(srv.client, srv.model, msgs, priority=0).cached_tokens
    assert kept["stock"] == 0, kept
    assert kept["plugin"] >= 128, kept


def test_a_directive_protects_its_range_until_its_duration_lapses(servers, text):
    srv = servers["plugin"]
    srv.reset_cache()
    duration = 15.0
    prompt = user(text("dir", SYSTEM_WORDS))
    keep = [{"start": 0, "end": None, "priority": 90, "duration": duration}]
    chat(srv.client, srv.model, prompt, priority=1, directives=keep)
    took = flood(srv.client, srv.model, text, "dflood-1")
    assert took < duration, f"the flood took {took:.1f} s, longer than the directive's {duration} s"
    t_release = time.monotonic()
    within = chat(srv.client, srv.model, prompt, priority=1, directives=keep)  # restarts the duration
    assert within.cached_tokens >= 96, within
    time.sleep(max(0.0, duration + 1.0 - (time.monotonic() - t_release)))
    flood(srv.client, srv.model, text, "dflood-2")
    after = chat(srv.client, srv.model, prompt, priority=1)
    assert after.cached_tokens == 0, after


def test_only_the_owning_scope_lowers_retention(servers, text):
    srv = servers["plugin"]
    srv.reset_cache()
    prompt = user(text("scope", SYSTEM_WORDS))
    high = [{"start": 0, "end": None, "priority": 90}]
    low = [{"start": 0, "end": None, "priority": 0}]
    chat(srv.client, srv.model, prompt, priority=1, directives=high, scope="alice")
    chat(srv.client, srv.model, prompt, priority=1, directives=low, scope="mallory")  # another scope
    chat(srv.client, srv.model, prompt, priority=1)  # no scope, mapped retention 25
    flood(srv.client, srv.model, text, "sflood-1")
    kept = chat(srv.client, srv.model, prompt, priority=1, directives=high, scope="alice")
    assert kept.cached_tokens >= 96, kept
    chat(srv.client, srv.model, prompt, priority=1, directives=low, scope="alice")  # the owner lowers it
    flood(srv.client, srv.model, text, "sflood-2")
    gone = chat(srv.client, srv.model, prompt, priority=1, directives=low, scope="alice")
    assert gone.cached_tokens == 0, gone


def test_different_cache_salts_never_share_cached_tokens(servers, text):
    for name in ("stock", "plugin"):
        srv = servers[name]
        srv.reset_cache()
        prompt = user(text("salt", SYSTEM_WORDS))
        chat(srv.client, srv.model, prompt, salt="tenant-a")
        assert chat(srv.client, srv.model, prompt, salt="tenant-a").cached_tokens >= 96
        assert chat(srv.client, srv.model, prompt, salt="tenant-b").cached_tokens == 0
        assert chat(srv.client, srv.model, prompt).cached_tokens == 0
        assert chat(srv.client, srv.model, prompt, salt="tenant-b").cached_tokens >= 96
