"""Workloads: token sequences, trace loaders, priority rules, the multi-tenant and template-drift generators,
working sets."""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kvretain.engine.sim.catalog import builtin_catalog
from kvretain.engine.sim.costmodel import CostModel
from kvretain.workloads import (
    PRIORITY_RULES,
    WORKLOADS,
    MultiTenantConfig,
    RetentionDirective,
    TokenSeq,
    WorkloadError,
    WorkloadRequest,
    generate_multi_tenant,
    load_azure,
    load_mooncake,
    tag_priorities,
    working_set,
)
from kvretain.workloads.template_drift import TemplateDriftConfig, generate_template_drift
from kvretain.workloads.tokens import Chunk

# --- TokenSeq -----------------------------------------------------------------------------------------


def test_seeded_tokens_are_deterministic_and_prefix_consistent() -> None:
    a = TokenSeq.seeded(7, 512).materialize()
    assert a == TokenSeq.seeded(7, 512).materialize()
    assert TokenSeq.seeded(7, 100).materialize() == a[:100]
    assert a != TokenSeq.seeded(8, 512).materialize()
    assert all(0 <= t < 1 << 16 for t in a)


@pytest.mark.parametrize("block_size", [1, 7, 16, 512])
def test_blocks_cover_the_sequence(block_size: int) -> None:
    seq = TokenSeq.seeded(1, 100) + TokenSeq.of(range(13)) + TokenSeq.seeded(2, 300)
    tokens = seq.materialize()
    assert len(seq) == len(tokens) == 413
    full = list(seq.blocks(block_size))
    assert all(len(b) == block_size for b in full)
    assert [t for b in full for t in b] == tokens[: len(full) * block_size]
    with_tail = list(seq.blocks(block_size, partial=True))
    assert [t for b in with_tail for t in b] == tokens


# --- Mooncake -----------------------------------------------------------------------------------------


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


MOONCAKE = [
    {"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 250, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 3]},
    {"timestamp": 500, "input_length": 300, "output_length": 7, "hash_ids": [0]},
    {
        "timestamp": 1000,
        "input_length": 2048,
        "output_length": 1,
        "hash_ids": [0, 4, 5, 6],
        "priority": 3,
        "session_id": "s1",
        "cache_salt": "tenant-a",
        "retention": [{"start": 0, "end": None, "priority": 80, "duration_s": 12.5}],
    },
]


def test_mooncake_lengths_and_fields(tmp_path: Path) -> None:
    reqs = load_mooncake(write_jsonl(tmp_path / "t.jsonl", MOONCAKE))
    assert [r.prompt_len for r in reqs] == [1500, 1100, 300, 2048]
    assert [len(r.prompt.materialize()) for r in reqs] == [1500, 1100, 300, 2048]
    assert [r.arrival_s for r in reqs] == [0.0, 0.25, 0.5, 1.0]
    assert reqs[0].block_ids == (0, 1, 2) and reqs[0].output_len == 10
    last = reqs[3]
    assert (last.priority, last.session_id, last.cache_salt) == (3, "s1", "tenant-a")
    assert last.retention == (RetentionDirective(0, None, 80, 12.5),)
    assert reqs[0].priority == 0 and reqs[0].retention is None


@pytest.mark.parametrize("block_size", [16, 512])
def test_mooncake_prefix_sharing(tmp_path: Path, block_size: int) -> None:
    r0, r1, r2, r3 = load_mooncake(write_jsonl(tmp_path / "t.jsonl", MOONCAKE))
    b0, b1, b2, b3 = (list(r.prompt.blocks(block_size, partial=True)) for r in (r0, r1, r2, r3))
    per_id = 512 // block_size
    # r0 and r1 share hash ids [0, 1]: exactly 2 x 512 tokens, then differ.
    assert b0[: 2 * per_id] == b1[: 2 * per_id]
    assert b0[2 * per_id] != b1[2 * per_id]
    t0, t1 = r0.prompt.materialize(), r1.prompt.materialize()
    assert t0[:1024] == t1[:1024] and t0[1024] != t1[1024]
    # Every request starts with block 0; r2 (300 tokens) is a prefix of block 0.
    assert b0[:per_id] == b3[:per_id]
    assert r2.prompt.materialize() == t0[:300]
    assert b2[0] == b0[0][:300]


def test_mooncake_limit_and_time_scale(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", MOONCAKE)
    reqs = load_mooncake(path, limit=2, time_scale=0.5)
    assert [r.arrival_s for r in reqs] == [0.0, 0.125]
    assert [r.request_id for r in reqs] == ["mooncake-1", "mooncake-2"]


@pytest.mark.parametrize(
    ("patch", "match"),
    [
        ({"input_length": "x"}, "field 'input_length'"),
        ({"hash_ids": [0, 1]}, "field 'hash_ids' has 2 ids but input_length 1500 needs 3"),
        ({"hash_ids": [0, "a", 2]}, r"field 'hash_ids' item 1 must be an integer in \[0, 2\*\*64\)"),
        ({"timestamp": -1}, "field 'timestamp'"),
        ({"priority": 1.5}, "field 'priority'"),
        (
            {"retention": [{"start": 0, "end": None, "priority": 101, "duration_s": 1}]},
            r"field 'retention': retention_directives\[0\]: priority 101 is out of range",
        ),
        (
            {"retention": [{"start": 5, "end": 5, "priority": 1, "duration_s": 1}]},
            r"field 'retention': retention_directives\[0\]: start \(5\) must be before end",
        ),
        ({"colour": "red"}, "unknown field 'colour'"),
    ],
)
def test_mooncake_bad_line_names_line_and_field(tmp_path: Path, patch: dict[str, Any], match: str) -> None:
    bad = {**MOONCAKE[0], **patch}
    path = write_jsonl(tmp_path / "t.jsonl", [MOONCAKE[1], MOONCAKE[2], bad])
    with pytest.raises(WorkloadError, match=match) as info:
        load_mooncake(path)
    assert f"{path}:3:" in str(info.value)


def test_mooncake_missing_field_and_bad_json(tmp_path: Path) -> None:
    rec = {k: v for k, v in MOONCAKE[0].items() if k != "output_length"}
    with pytest.raises(WorkloadError, match=r":1: missing field 'output_length'"):
        load_mooncake(write_jsonl(tmp_path / "a.jsonl", [rec]))
    (tmp_path / "b.jsonl").write_text(json.dumps(MOONCAKE[0]) + "\n{not json\n")
    with pytest.raises(WorkloadError, match=r":2: not valid JSON"):
        load_mooncake(tmp_path / "b.jsonl")
    with pytest.raises(WorkloadError, match="not found"):
        load_mooncake(tmp_path / "missing.jsonl")


# --- Azure --------------------------------------------------------------------------------------------

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:16:46.6805900,10,0
"""


def test_azure_loader(tmp_path: Path) -> None:
    path = tmp_path / "az.csv"
    path.write_text(AZURE)
    reqs = load_azure(path, random.Random(0))
    assert [r.prompt_len for r in reqs] == [374, 396, 10]
    assert [r.output_len for r in reqs] == [44, 109, 0]
    assert reqs[0].arrival_s == 0.0
    assert reqs[1].arrival_s == pytest.approx(4.314579)
    assert reqs[2].arrival_s == pytest.approx(60.0)
    # Unique synthetic prompts, reproducible from the seed.
    assert reqs[0].prompt.materialize()[:16] != reqs[1].prompt.materialize()[:16]
    again = load_azure(path, random.Random(0))
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    half = load_azure(path, random.Random(0), limit=2, time_scale=2.0)
    assert [r.arrival_s for r in half] == pytest.approx([0.0, 8.629158])


def test_azure_csv_with_a_byte_order_mark_reads_as_without(tmp_path: Path) -> None:
    # a spreadsheet's "CSV UTF-8" starts with a BOM: its header read '\ufeffTIMESTAMP' and was refused
    plain, marked = tmp_path / "az.csv", tmp_path / "bom.csv"
    plain.write_text(AZURE)
    marked.write_bytes(b"\xef\xbb\xbf" + AZURE.encode())
    a, b = load_azure(plain, random.Random(0)), load_azure(marked, random.Random(0))
    assert [(r.arrival_s, r.prompt_len, r.output_len, r.prompt) for r in a] == [
        (r.arrival_s, r.prompt_len, r.output_len, r.prompt) for r in b
    ]


def test_azure_path_that_is_not_a_regular_file_is_named_so(tmp_path: Path) -> None:
    # a device never ends (/dev/zero) or waits for input (a terminal): refused by name (it said "not found")
    with pytest.raises(WorkloadError, match="/dev/zero is not a regular file or a pipe"):
        load_azure("/dev/zero", random.Random(0))
    with pytest.raises(WorkloadError, match="not found"):
        load_azure(tmp_path / "missing.csv", random.Random(0))


def test_azure_trace_read_from_a_pipe(tmp_path: Path) -> None:
    # `kvretain simulate - --workload azure < t.csv` / `cat t.csv | ...`: a pipe is read once, as the Mooncake
    # reader reads one (it was refused as "not a regular file")
    import os
    import threading

    fifo = tmp_path / "az.csv"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text(AZURE))
    writer.start()
    try:
        piped = load_azure(fifo, random.Random(0))
    finally:
        writer.join(timeout=10)
    plain = tmp_path / "plain.csv"
    plain.write_text(AZURE)
    want = load_azure(plain, random.Random(0))
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in piped] == [
        (r.arrival_s, r.prompt_len, r.output_len) for r in want
    ]


def test_azure_errors(tmp_path: Path) -> None:
    path = tmp_path / "az.csv"
    path.write_text(AZURE.replace(",396,", ",many,"))
    with pytest.raises(WorkloadError, match=r":3: column 'ContextTokens'"):
        load_azure(path, random.Random(0))
    path.write_text(AZURE.replace("2023-11-16 18:16:46.6805900", "yesterday"))
    with pytest.raises(WorkloadError, match=r":4: column 'TIMESTAMP'"):
        load_azure(path, random.Random(0))
    path.write_text("a,b,c\n")
    with pytest.raises(WorkloadError, match="header"):
        load_azure(path, random.Random(0))


HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZURE_MISTAKES = [
    # naive and aware times: a TypeError traceback where they were compared
    (
        "2023-11-16 18:15:46.6805900,100,10\n2023-11-16 18:15:47+00:00,100,10\n",
        r":3: column 'TIMESTAMP': '2023-11-16 18:15:47\+00:00' has a time zone but line 2's has none",
    ),
    (
        "2023-11-16 18:15:47+00:00,100,10\n\n2023-11-16 18:15:46,100,10\n",
        r":4: column 'TIMESTAMP': '2023-11-16 18:15:46' has no time zone but line 2's has one",
    ),
    # a field over csv's size limit: a _csv.Error traceback (not a ValueError)
    ('2023-11-16 18:15:46,"' + "1" * 200_000 + '",10\n', r":2: not a CSV row of the trace \(field larger"),
    # the header alone: 0 requests (simulate exited 0, export wrote an empty file, compare crashed plotting)
    ("", r"az.csv: no requests in the trace \(the header alone"),
    ("\n\n", r"az.csv: no requests in the trace"),
    # lengths beyond Mooncake's bound: 10^12 prompt tokens ran for minutes, memory growing
    (
        "2023-11-16 18:15:46,1000000000000,10\n",
        r":2: column 'ContextTokens': must be an integer in \[1, 16777216\]",
    ),
    (
        "2023-11-16 18:15:46,10,16777217\n",
        r":2: column 'GeneratedTokens': must be an integer in \[0, 16777216\]",
    ),
]


AZURE_IDS = ["naive-then-aware", "aware-then-naive", "oversized-field", "header-only", "blank-lines"]
AZURE_IDS += ["huge-context", "huge-output"]


@pytest.mark.parametrize(("body", "pattern"), AZURE_MISTAKES, ids=AZURE_IDS)
def test_azure_mistakes_are_workload_errors_naming_the_line(tmp_path: Path, body: str, pattern: str) -> None:
    path = tmp_path / "az.csv"
    path.write_text(HEAD + body)
    with pytest.raises(WorkloadError, match=pattern):
        load_azure(path, random.Random(0))


def test_azure_lengths_at_the_bound_are_read(tmp_path: Path) -> None:
    path = tmp_path / "az.csv"
    path.write_text(HEAD + "2023-11-16 18:15:46+01:00,16777216,16777216\n2023-11-16 18:15:47+00:00,1,0\n")
    reqs = load_azure(path, random.Random(0))
    assert [(r.prompt_len, r.output_len, r.arrival_s) for r in reqs] == [
        (16777216, 16777216, 0.0),
        (1, 0, 3601.0),
    ]


# --- priority rules -----------------------------------------------------------------------------------


def req(rid: str, block_ids: tuple[int, ...] | None = None, session: str | None = None) -> WorkloadRequest:
    return WorkloadRequest(rid, 0.0, TokenSeq.of([1, 2, 3]), 1, block_ids=block_ids, session_id=session)


def test_reference_rule() -> None:
    rule = PRIORITY_RULES.create("reference")
    assert rule(req("a", (0, 8, 9))) == 0  # hash_ids[1] % 4 == 0
    assert rule(req("b", (0, 9, 8))) == 1
    assert rule(req("c", (12,))) == 0  # one block: hash_ids[0]
    assert rule(req("d", (13,))) == 1
    with pytest.raises(WorkloadError, match="block_ids"):
        rule(req("e"))


def test_by_session_keeps_a_trace_conversation_without_session_id_in_one_class() -> None:
    # a Mooncake conversation names no session: its turns share hash_ids[1] (session_key), and each turn is
    # its own request id, so a rule keyed by request id split it across classes
    rule = PRIORITY_RULES.create("by-session", fraction=0.5)
    for conv in range(40):
        turns = [req(f"c{conv}-t{t}", (0, 1000 + conv, *range(5000 + t, 5000 + t + t + 1))) for t in range(8)]
        assert len({rule(r) for r in turns}) == 1
    classes = {rule(req(f"c{conv}", (0, 1000 + conv))) for conv in range(40)}
    assert classes == {0, 1}


def test_by_session_chooses_its_share_of_sequentially_named_sessions() -> None:
    # session names are often sequential (s0, s1, ...; a trace's conversations by their block ids): the share
    # chosen must be the fraction asked within sampling noise, whatever the names look like (CRC-32, linear in
    # its input, gave s0..s1999 6.95% at 10% and 44.6% at 50%)
    for keys in ([f"s{i}" for i in range(2000)], [f"conv-{i}" for i in range(2000)]):
        reqs = [req(k, session=k) for k in keys]
        for fraction in (0.1, 0.25, 0.5):
            share = sum(
                r.priority == 0
                for r in tag_priorities(reqs, PRIORITY_RULES.create("by-session", fraction=fraction))
            ) / len(keys)
            assert abs(share - fraction) <= 4 * (fraction * (1 - fraction) / len(keys)) ** 0.5, (
                keys[0],
                fraction,
                share,
            )
    convs = [req(f"c{i}", (0, 1000 + i)) for i in range(2000)]  # no session id: named by hash_ids[1]
    share = (
        sum(r.priority == 0 for r in tag_priorities(convs, PRIORITY_RULES.create("by-session", fraction=0.5)))
        / 2000
    )
    assert abs(share - 0.5) <= 4 * (0.25 / 2000) ** 0.5


def test_other_rules() -> None:
    reqs = [req(f"r{i}", session=f"s{i % 40}") for i in range(400)]
    by_session = tag_priorities(reqs, PRIORITY_RULES.create("by-session", fraction=0.25))
    per_session: dict[str | None, set[int]] = {}
    for r in by_session:
        per_session.setdefault(r.session_id, set()).add(r.priority)
    assert all(len(p) == 1 for p in per_session.values())  # a session keeps one class
    assert 0 < sum(p == {0} for p in per_session.values()) < 40
    rand = [r.priority for r in tag_priorities(reqs, PRIORITY_RULES.create("random", random.Random(1)))]
    assert rand == [
        r.priority for r in tag_priorities(reqs, PRIORITY_RULES.create("random", random.Random(1)))
    ]
    assert 50 < rand.count(0) < 150
    assert {r.priority for r in tag_priorities(reqs, PRIORITY_RULES.create("none"))} == {0}
    assert set(PRIORITY_RULES.names()) >= {"reference", "random", "by-session", "none"}


# --- multi-tenant -------------------------------------------------------------------------------------

SMALL = MultiTenantConfig(duration_s=120.0, chat_session_rate=0.1, batch_documents=10)


def test_multi_tenant_is_deterministic() -> None:
    a = generate_multi_tenant(SMALL, random.Random(5))
    b = generate_multi_tenant(SMALL, random.Random(5))
    assert a == b
    assert a != generate_multi_tenant(SMALL, random.Random(6))
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)


def test_multi_tenant_classes_draw_from_their_own_rngs() -> None:
    # each class has its own child rng: more chat sessions leave the agents and the batch jobs as they were
    def others(cfg: MultiTenantConfig) -> list[WorkloadRequest]:
        return [r for r in generate_multi_tenant(cfg, random.Random(5)) if r.priority != cfg.chat_priority]

    busier = dataclasses.replace(SMALL, chat_session_rate=0.3, chat_turns=(2, 3))
    assert others(busier) == others(SMALL)
    assert len(others(SMALL)) > 0


def test_multi_tenant_structure() -> None:
    reqs = generate_multi_tenant(SMALL, random.Random(3))
    by_id = {r.request_id: r for r in reqs}
    assert {r.priority for r in reqs} == {0, 1, 2}
    follow_ups = [r for r in reqs if r.after is not None]
    assert follow_ups
    for r in follow_ups:
        prev = by_id.get(r.after or "")
        assert prev is not None and prev.output is not None
        # The next turn's prompt = previous prompt + previous output + new message / tool result.
        ctx = prev.prompt + prev.output
        assert r.prompt.chunks[: len(ctx.chunks)] == ctx.chunks
        assert len(r.prompt) > len(ctx)
        assert r.arrival_s >= prev.arrival_s + r.think_s
        assert r.session_id == prev.session_id and r.priority == prev.priority
    for r in reqs:
        assert r.output is not None and len(r.output) == r.output_len
    agents = [r for r in reqs if r.priority == SMALL.agent_priority]
    for r in agents:
        assert r.retention is not None
        (d,) = r.retention
        assert d.start == 0 and d.end is None and 0 <= d.priority <= 100
        assert d.duration_s is not None and d.duration_s > SMALL.agent_tool_pause_s[1]
    # Every chat turn starts with the shared chat system prompt; batch requests share whole documents.
    chats = [r for r in reqs if r.priority == SMALL.chat_priority]
    assert len({r.prompt.chunks[0] for r in chats}) == 1
    # Later turns add retrieved passages: some follow-ups grow by more than the previous output + a message.
    by_chat = {r.request_id: r for r in chats}
    grow = [
        len(r.prompt) - len(by_chat[r.after].prompt) - by_chat[r.after].output_len for r in chats if r.after
    ]
    assert max(grow) > SMALL.chat_user_tokens[1] and min(grow) >= SMALL.chat_user_tokens[0]
    batch = [r for r in reqs if r.priority == SMALL.batch_priority]
    assert len({r.prompt.chunks[:2] for r in batch}) <= SMALL.batch_documents < len(batch)


def test_multi_tenant_working_set_exceeds_twice_default_kv_capacity() -> None:
    cat = builtin_catalog()
    capacity = CostModel(cat.model("llama-3-8b"), cat.gpu("h100-sxm")).kv_capacity_tokens()
    cfg = MultiTenantConfig()
    reqs = generate_multi_tenant(cfg, random.Random(0))
    assert 5_000 <= len(reqs) <= 8_000
    assert max(r.arrival_s for r in reqs) < cfg.duration_s + cfg.batch_job_spread_s
    ws = working_set(reqs)
    assert ws.peak_tokens > 3 * capacity
    assert ws.mean_tokens > 2 * capacity
    assert ws.reused_tokens > ws.distinct_tokens  # most prompt tokens are reusable context
    # Chat's own reusable context fits a protected share of the cache (so protection can pay).
    chat = working_set([r for r in reqs if r.priority == cfg.chat_priority])
    assert 0.15 * capacity < chat.mean_tokens < 0.5 * capacity
    assert chat.peak_tokens < 0.8 * capacity


def test_multi_tenant_chat_contexts_grow_from_modest_first_turns() -> None:
    cfg = MultiTenantConfig()
    reqs = [r for r in generate_multi_tenant(cfg, random.Random(0)) if r.priority == cfg.chat_priority]
    first = [r for r in reqs if r.after is None]
    later = [r for r in reqs if r.after is not None]
    assert len(later) > 4 * len(first)
    # A first turn is the shared system prompt plus a few thousand new tokens (rarely a pasted document) ...
    new_first = sorted(len(r.prompt) - cfg.chat_system_tokens for r in first)
    assert new_first[len(new_first) // 2] < 6_000
    # ... while the reusable context of later turns is several times longer (what an eviction throws away).
    by_id = {r.request_id: r for r in reqs}
    reusable = sorted(len(by_id[r.after].prompt) + by_id[r.after].output_len for r in later)  # type: ignore[index]
    assert reusable[len(reusable) // 2] > 2.5 * new_first[len(new_first) // 2]
    assert reusable[int(0.9 * len(reusable))] > 20_000


def test_multi_tenant_default_load_is_stable_on_one_replica() -> None:
    """The first 10 minutes of the defaults on the default replica: served as they arrive (no backlog)."""
    from kvretain.engine.sim.simulator import SimConfig, simulate

    cfg = MultiTenantConfig(duration_s=600.0)
    s = simulate(SimConfig(policy="lru"), generate_multi_tenant(cfg, random.Random(0)))
    assert s["simulated_s"] < cfg.duration_s + 30  # the last request finishes within 30 s of the traffic
    assert s["queue_p99_s"] < 2.0 and s["preemptions"] == 0
    assert 0.5 < s["busy_s"] / s["simulated_s"] < 0.95


def test_workload_registry() -> None:
    assert {"multi-tenant", "mooncake", "azure"} <= set(WORKLOADS.names())
    reqs = WORKLOADS.create("multi-tenant", rng=random.Random(0), limit=50, time_scale=2.0, duration_s=60.0)
    assert len(reqs) == 50
    with pytest.raises(WorkloadError, match="path"):
        WORKLOADS.create("mooncake", rng=random.Random(0))
    with pytest.raises(WorkloadError, match="no_such_option"):
        WORKLOADS.create("multi-tenant", rng=random.Random(0), no_such_option=1)


# --- template-drift -----------------------------------------------------------------------------------

SMALL_TPL = TemplateDriftConfig(duration_s=120.0, rate=2.0, active=10)


def _templates(reqs: list[WorkloadRequest]) -> set[Chunk]:
    """The templates the requests are on (a prompt's first chunk)."""
    return {r.prompt.chunks[0] for r in reqs}


def test_template_drift_is_deterministic_and_sorted() -> None:
    a = generate_template_drift(SMALL_TPL, random.Random(7))
    assert a == generate_template_drift(SMALL_TPL, random.Random(7))
    assert a != generate_template_drift(SMALL_TPL, random.Random(8))
    assert 150 < len(a) < 400  # ~240 calls opening a session, and their follow-ups
    arrivals = [r.arrival_s for r in a]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0 and arrivals[-1] < SMALL_TPL.duration_s
    assert all(r.retention is None and r.output is not None and len(r.output) == r.output_len for r in a)
    lo, hi = SMALL_TPL.template_tokens
    assert all(lo <= c.length <= hi for c in _templates(a))


def test_template_drift_draws_are_split_by_aspect() -> None:
    # the follow-ups draw from the sessions' rng: without them, the calls that open a session (arrival,
    # template, input) are the same
    base = generate_template_drift(SMALL_TPL, random.Random(7))
    alone = generate_template_drift(dataclasses.replace(SMALL_TPL, followup_prob=0.0), random.Random(7))
    assert all(r.after is None for r in alone) and len(alone) < len(base)
    firsts = [(r.request_id, r.arrival_s, r.prompt.chunks[0], r.priority) for r in base if r.after is None]
    assert firsts == [(r.request_id, r.arrival_s, r.prompt.chunks[0], r.priority) for r in alone]


def test_template_drift_premium_share_sets_the_priorities() -> None:
    # uniform popularity, many calls per template: nearly every template is used
    cfg = TemplateDriftConfig(duration_s=120.0, rate=10.0, active=300, zipf_s=0.0, premium_share=0.3)
    reqs = generate_template_drift(cfg, random.Random(1))
    priority: dict[Chunk, set[int]] = {}
    for r in reqs:
        priority.setdefault(r.prompt.chunks[0], set()).add(r.priority)
    assert len(priority) > 250
    assert all(len(p) == 1 for p in priority.values())  # a template's calls all have its priority
    premium = sum(1 for p in priority.values() if p == {cfg.important_priority})
    assert premium / len(priority) == pytest.approx(cfg.premium_share, abs=0.08)
    assert {r.priority for r in reqs} == {cfg.important_priority, cfg.other_priority}
    for share, expected in ((0.0, {cfg.other_priority}), (1.0, {cfg.important_priority})):
        some = generate_template_drift(dataclasses.replace(SMALL_TPL, premium_share=share), random.Random(1))
        assert {r.priority for r in some} == expected


def test_template_drift_retires_the_nearest_whole_number_of_templates() -> None:
    assert TemplateDriftConfig().retired_per_drift == 18  # 0.3 x 60 (17.999... in floating point)
    assert TemplateDriftConfig(active=5, drift_share=0.3).retired_per_drift == 2  # 1.5 rounds up
    assert TemplateDriftConfig(active=7, drift_share=0.3).retired_per_drift == 2  # 2.1 rounds down
    assert TemplateDriftConfig(active=7, drift_share=0.0).retired_per_drift == 0


@pytest.mark.parametrize(("share", "kept"), [(0.0, 5), (0.4, 3), (1.0, 0)])
def test_template_drift_replaces_a_share_of_the_active_templates(share: float, kept: int) -> None:
    # 5 active templates, uniform popularity, a drift every 30 s: ~60 calls a period use all 5
    cfg = TemplateDriftConfig(
        duration_s=120.0, rate=2.0, active=5, zipf_s=0.0, drift_s=30.0, drift_share=share
    )
    reqs = [r for r in generate_template_drift(cfg, random.Random(3)) if r.after is None]
    periods = [_templates([r for r in reqs if k * 30.0 <= r.arrival_s < (k + 1) * 30.0]) for k in range(4)]
    assert all(len(p) == 5 for p in periods)  # `active` templates in use in every period
    for before, after in zip(periods, periods[1:], strict=False):
        assert len(before & after) == kept  # a drift retires round(share * active) of them
    assert len(_templates(reqs)) == 5 + 3 * (5 - kept)  # those that retire never come back
    if share == 1.0:
        assert not periods[0] & periods[2]


def test_template_drift_first_drift_comes_at_drift_s_and_replaces_a_share_of_the_first_templates() -> None:
    # the templates' own rng draws the first templates before any drift, and no other aspect draws from it:
    # the same seed without drift (drift_share = 0) shows the calls on the first templates
    cfg = TemplateDriftConfig(
        duration_s=60.0, rate=4.0, active=5, zipf_s=0.0, drift_s=30.0, drift_share=0.4, followup_prob=0.3
    )
    drifting = generate_template_drift(cfg, random.Random(5))
    still = generate_template_drift(dataclasses.replace(cfg, drift_share=0.0), random.Random(5))
    first = _templates(still)
    assert len(first) == 5
    # before drift_s every request (follow-ups too) is the one it would be without drift
    before = [r for r in drifting if r.arrival_s < cfg.drift_s]
    assert len(before) > 60 and before == [r for r in still if r.arrival_s < cfg.drift_s]
    # from drift_s on, the calls on 2 of the first templates (round(0.4 x 5)) go to 2 new ones instead, one
    # each (the rank of the template it replaces); the others keep theirs
    opened = {r.request_id: r.prompt.chunks[0] for r in still if r.after is None}
    later = [r for r in drifting if r.after is None and r.arrival_s >= cfg.drift_s]
    changed: dict[Chunk, set[Chunk]] = {}  # a first template -> the templates its calls use instead
    for r in later:
        if r.prompt.chunks[0] != opened[r.request_id]:
            changed.setdefault(opened[r.request_id], set()).add(r.prompt.chunks[0])
    assert len(changed) == cfg.retired_per_drift == 2 and all(len(new) == 1 for new in changed.values())
    assert not set().union(*changed.values()) & first  # templates never used before
    assert len({r.prompt.chunks[0] for r in later} & first) == 3  # the first templates kept, still called
    assert not {r.prompt.chunks[0] for r in later} & set(changed)  # a retired template opens no session again


def test_template_drift_follow_ups_extend_the_previous_turn() -> None:
    cfg = TemplateDriftConfig(duration_s=300.0, rate=2.0, active=10, followup_prob=0.6, max_turns=3)
    reqs = generate_template_drift(cfg, random.Random(2))
    by_id = {r.request_id: r for r in reqs}
    sessions: dict[str | None, list[WorkloadRequest]] = {}
    for r in reqs:
        sessions.setdefault(r.session_id, []).append(r)
        if r.after is None:  # a first turn: its template and an input
            assert r.think_s == 0.0 and len(r.prompt.chunks) == 2 and r.request_id == f"{r.session_id}-turn-0"
            continue
        prev = by_id[r.after]
        assert prev.output is not None
        ctx = prev.prompt + prev.output  # the previous prompt and its output, then a new input
        assert (
            r.prompt.chunks[: len(ctx.chunks)] == ctx.chunks and len(r.prompt.chunks) == len(ctx.chunks) + 1
        )
        lo, hi = cfg.input_tokens
        assert lo <= len(r.prompt) - len(ctx) <= hi
        assert r.session_id == prev.session_id and r.priority == prev.priority
        j = int(prev.request_id.rsplit("-", 1)[1])
        assert r.request_id == f"{r.session_id}-turn-{j + 1}"
        assert cfg.followup_s[0] <= r.think_s <= cfg.followup_s[1]
        est = prev.arrival_s + prev.output_len * cfg.est_s_per_output_token + r.think_s
        assert r.arrival_s == pytest.approx(est)
    some = next(r for r in reqs if r.after is not None)
    prev = by_id[some.after or ""]
    assert prev.output is not None  # the tokens themselves: the previous prompt's are a prefix
    assert (
        some.prompt.materialize()[: len(prev.prompt) + prev.output_len]
        == (prev.prompt + prev.output).materialize()
    )
    # a session goes on with probability followup_prob after each turn, up to max_turns (few are cut)
    turns = Counter(len(s) for s in sessions.values())
    assert set(turns) == {1, 2, 3} and len(sessions) == sum(1 for r in reqs if r.after is None)
    assert turns[1] / len(sessions) == pytest.approx(1 - cfg.followup_prob, abs=0.06)
    assert turns[3] / len(sessions) == pytest.approx(cfg.followup_prob**2, abs=0.06)
    assert all(sid is not None and sid.startswith("tpl-") for sid in sessions)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("drift_share", 1.5, "drift_share must be a probability in [0, 1], got 1.5"),
        ("followup_prob", -0.1, "followup_prob must be a probability in [0, 1]"),
        ("premium_share", 2, "premium_share must be a probability in [0, 1]"),
        ("active", 0, "active must be >= 1, got 0"),
        ("max_turns", 0, "max_turns must be >= 1, got 0"),
        ("zipf_s", -1.0, "zipf_s must be >= 0"),
        ("rate", -4.0, "rate must be >= 0"),
        ("drift_s", 0.0, "drift_s must be > 0"),
        ("template_tokens", (5_000, 1_000), "template_tokens must be a range lo <= hi"),
        ("followup_s", (30.0, 2.0), "followup_s must be a range lo <= hi"),
        ("active", 2.5, "active must be a whole number"),
    ],
)
def test_template_drift_bad_option_names_the_field(option: str, value: object, message: str) -> None:
    with pytest.raises(WorkloadError) as err:
        WORKLOADS.create("template-drift", rng=random.Random(0), **{option: value})
    assert f"template-drift config: {message}" in str(err.value)


def test_template_drift_popularity_is_zipf_over_the_ranks() -> None:
    # no drift, zipf_s = 1 over 10 templates: the most popular draws 1 / H(10) = 34% of the sessions
    # (linear weights would give it 18%)
    cfg = TemplateDriftConfig(duration_s=600.0, rate=4.0, active=10, drift_share=0.0, followup_prob=0.0)
    reqs = generate_template_drift(cfg, random.Random(2))
    top = Counter(r.prompt.chunks[0] for r in reqs).most_common(1)[0][1] / len(reqs)
    assert 0.28 < top < 0.40


def test_template_drift_expects_no_follow_up_that_would_start_after_the_window() -> None:
    # a follow-up comes about 20 s after its predecessor (210 output tokens at 0.02 s, then 16 s): in a 10 s
    # window, every session is one call
    cfg = TemplateDriftConfig(duration_s=10.0, rate=4.0, followup_prob=1.0)
    size = cfg.expected_size()
    assert size.requests == 40.0 and size.chunk_refs == 40 * 2 + size.spans


def test_template_drift_unknown_option_and_trace_are_refused() -> None:
    with pytest.raises(WorkloadError, match=r"template-drift: unknown option 'drift_period' \(its options: "):
        WORKLOADS.create("template-drift", rng=random.Random(0), drift_period=10.0)
    with pytest.raises(WorkloadError, match="a first prompt needs at least one token"):
        TemplateDriftConfig(template_tokens=(0, 10), input_tokens=(0, 10))
    with pytest.raises(WorkloadError, match="is generated and reads no trace"):
        WORKLOADS.create("template-drift", rng=random.Random(0), path="t.jsonl")


def test_template_drift_is_registered_and_exported(tmp_path: Path) -> None:
    from kvretain.cli import main

    assert "template-drift" in WORKLOADS.names() and WORKLOADS.describe()["template-drift"]
    reqs = WORKLOADS.create("template-drift", rng=random.Random(0), limit=50, time_scale=2.0, duration_s=60.0)
    full = generate_template_drift(TemplateDriftConfig(duration_s=60.0), random.Random(0))
    assert len(reqs) == 50 and [r.arrival_s for r in reqs] == [2.0 * r.arrival_s for r in full[:50]]
    out = tmp_path / "tpl.jsonl"
    argv = ["workload", "export", "template-drift", "--out", str(out), "--option", "duration_s=120"]
    assert main(argv) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == len(generate_template_drift(TemplateDriftConfig(duration_s=120.0), random.Random(0)))
    assert all(r["hash_ids"] and r["session_id"].startswith("tpl-") and "retention" not in r for r in recs)
    # calls on one template share its full blocks: far fewer distinct blocks than lookups
    ids = [h for r in recs for h in r["hash_ids"]]
    assert len(set(ids)) < 0.5 * len(ids)
    assert len({r["hash_ids"][0] for r in recs}) <= TemplateDriftConfig().active


# --- working set --------------------------------------------------------------------------------------


def test_working_set_counts_live_reuse() -> None:
    shared = TokenSeq.seeded(1, 100)
    mk = [
        WorkloadRequest("a", 0.0, shared + TokenSeq.seeded(2, 10), 1),
        WorkloadRequest("b", 1.0, shared + TokenSeq.seeded(3, 20), 1),
        WorkloadRequest("c", 2.0, shared + TokenSeq.seeded(2, 10), 1),
    ]
    ws = working_set(mk)
    # Between 1 s and 2 s: the shared 100 tokens and a's 10 tokens await reuse.
    assert ws.peak_tokens == 110
    assert ws.distinct_tokens == 130
    assert ws.reused_tokens == 100 + 100 + 10
    assert Counter(len(c.materialize()) for c in mk[0].prompt.chunks) == Counter({100: 1, 10: 1})


def test_working_set_peak_time_is_when_the_peak_is_first_reached() -> None:
    x, y = TokenSeq.seeded(1, 10), TokenSeq.seeded(2, 10)
    mk = [
        WorkloadRequest("x0", 0.0, x, 1),
        WorkloadRequest("x1", 1.0, x, 1),  # x alive over [0, 1]
        WorkloadRequest("y0", 2.0, y, 1),
        WorkloadRequest("y1", 3.0, y, 1),  # y alive over [2, 3]: the same peak again
    ]
    ws = working_set(mk)
    assert (ws.peak_tokens, ws.peak_time_s) == (10, 0.0)
    assert ws.mean_tokens == pytest.approx(20 / 3)


def test_time_scale_scales_retention_durations_with_the_pauses() -> None:
    # --time-scale 3 tripled the agents' tool pauses (up to 30 s) but left their 12 s directive, sized to outlast
    # a pause: a load sweep changed how well retention covered the pauses, not only the load
    from kvretain.workloads.sources import WORKLOADS

    base = WORKLOADS.create("multi-tenant", rng=random.Random(4), limit=400)
    slow = WORKLOADS.create("multi-tenant", rng=random.Random(4), limit=400, time_scale=3.0)
    assert [r.request_id for r in base] == [r.request_id for r in slow]
    directed = 0
    for a, b in zip(base, slow, strict=True):
        assert b.arrival_s == pytest.approx(a.arrival_s * 3) and b.think_s == pytest.approx(a.think_s * 3)
        for da, db in zip(a.retention or (), b.retention or (), strict=True):
            directed += 1
            assert (db.start, db.end, db.priority) == (da.start, da.end, da.priority)
            assert db.duration_s == (None if da.duration_s is None else pytest.approx(da.duration_s * 3))
    assert directed > 0


def test_a_trace_at_a_time_scale_scales_its_retention_durations(tmp_path: Path) -> None:
    line = {
        "timestamp": 2000,
        "input_length": 1024,
        "output_length": 4,
        "hash_ids": [1, 2],
        "retention": {
            "directives": [{"start": 0, "priority": 90, "duration_s": 30}],
            "decode_priority": 80,
            "decode_duration_s": 10,
        },
    }
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (req,) = load_mooncake(path, time_scale=0.5)
    assert req.arrival_s == 1.0
    assert req.retention is not None and req.retention[0].duration_s == 15.0
    assert req.decode_duration_s == 5.0
