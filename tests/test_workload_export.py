"""Workload export (Mooncake format), the agent-pauses and retrieval-scan generators, the session rules."""

from __future__ import annotations

import gzip
import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvretain.cli import main
from kvretain.core.hashing import BlockIdHasher
from kvretain.core.retention import RetentionDirective
from kvretain.replay import ReplayRequest, load_trace, replay, replay_requests
from kvretain.workloads import WORKLOADS, TokenSeq, WorkloadError, WorkloadRequest, load_mooncake
from kvretain.workloads.agent_pauses import AgentPausesConfig, generate_agent_pauses
from kvretain.workloads.export import block_pieces, mooncake_records, write_mooncake
from kvretain.workloads.mooncake import read_trace
from kvretain.workloads.multi_tenant import MultiTenantConfig, generate_multi_tenant
from kvretain.workloads.priority import make_rule, session_key
from kvretain.workloads.retrieval_scan import RetrievalScanConfig, generate_retrieval_scan

SMALL_MT = MultiTenantConfig(duration_s=300.0)
# a long window against the agents' lifetimes: few sessions cut short by the end of the window (a cut
# session loses the pause that would have crossed it, which biases the share of long pauses down)
SMALL_AGENTS = AgentPausesConfig(duration_s=1e7, agent_rate=2e-5)
SMALL_RAG = RetrievalScanConfig(duration_s=300.0, documents=50)


def _req(rid: str, prompt: TokenSeq, **kw: object) -> WorkloadRequest:
    return WorkloadRequest(rid, float(kw.pop("arrival_s", 0.0)), prompt, 4, **kw)  # type: ignore[arg-type]


# --- export ------------------------------------------------------------------------------------------


def test_block_ids_follow_token_identity_and_partial_blocks() -> None:
    system, doc = TokenSeq.seeded(1, 1000), TokenSeq.seeded(2, 300)
    a = _req("a", system + doc)  # 1,300 tokens: blocks of 512, 512, 276
    b = _req("b", system + doc + TokenSeq.seeded(3, 800), arrival_s=1.0)  # shares two full blocks
    c = _req("c", system, arrival_s=2.0, cache_salt="tenant")  # same tokens, other salt: no sharing
    d = _req("d", TokenSeq.seeded(1, 1000), arrival_s=3.0)  # same tokens as a's first 1,000: shares
    ra, rb, rc, rd = mooncake_records([a, b, c, d])
    assert len(ra["hash_ids"]) == 3 and len(rb["hash_ids"]) == 5
    assert rb["hash_ids"][:2] == ra["hash_ids"][:2] and rb["hash_ids"][2] != ra["hash_ids"][2]
    assert not set(rc["hash_ids"]) & set(ra["hash_ids"] + rb["hash_ids"])
    assert rd["hash_ids"][0] == ra["hash_ids"][0] and rd["hash_ids"][1] not in ra["hash_ids"]  # 488 vs 512
    # the pieces of each block are exactly its tokens
    seq = system + doc + TokenSeq.seeded(3, 800)
    toks = seq.materialize()
    for i, pieces in enumerate(block_pieces(seq, 512)):
        got: list[int] = []
        for seed, off, n in pieces:
            got += TokenSeq.seeded(seed, off + n).materialize()[off:]  # type: ignore[arg-type]
        assert got == toks[i * 512 : (i + 1) * 512]


def test_export_to_a_gz_name_is_gzip_the_readers_read(tmp_path: Path) -> None:
    """A trace exported as ``x.jsonl.gz`` is compressed (it was plain text under a ``.gz`` name) and reads back
    as the plain export does."""
    reqs = generate_multi_tenant(SMALL_MT, random.Random(0))
    plain, packed = tmp_path / "mt.jsonl", tmp_path / "mt.jsonl.GZ"
    assert write_mooncake(reqs, plain) == write_mooncake(reqs, packed) == len(reqs)
    assert packed.read_bytes()[:2] == b"\x1f\x8b"
    assert gzip.decompress(packed.read_bytes()) == plain.read_bytes()
    assert (
        b"partial" not in packed.read_bytes()[:64]
    )  # (gzip names the file it holds: the target's, not a temporary's)
    assert load_trace(packed) == load_trace(plain)
    assert not list(tmp_path.glob(".*partial"))


def test_ids_shared_exactly_when_tokens_shared() -> None:
    reqs = generate_multi_tenant(MultiTenantConfig(duration_s=120.0), random.Random(2))
    by_block: dict[int, tuple[int, tuple[int, ...]]] = {}
    for r, rec in zip(sorted(reqs, key=lambda r: r.arrival_s), mooncake_records(reqs), strict=True):
        parent = -1
        for h, block in zip(rec["hash_ids"], r.prompt.blocks(512, partial=True), strict=True):
            content = (parent, block)  # by induction: an id stands for its whole prefix of tokens
            assert by_block.setdefault(h, content) == content
            parent = h
    assert len(set(by_block.values())) == len(by_block)  # no two ids for the same prefix


def test_export_round_trip_through_the_trace_schema(tmp_path: Path) -> None:
    """An export reads back through the one trace parser (``read_trace``, behind replay and simulate)."""
    reqs = generate_multi_tenant(SMALL_MT, random.Random(0))
    path = tmp_path / "mt.jsonl"
    assert write_mooncake(reqs, path) == len(reqs)
    ordered = sorted(reqs, key=lambda r: r.arrival_s)
    records = read_trace(path)
    assert [r.priority for r in records] == [r.priority for r in ordered]
    assert [r.input_length for r in records] == [r.prompt_len for r in ordered]
    assert [r.output_length for r in records] == [r.output_len for r in ordered]
    assert [r.session_id for r in records] == [r.session_id for r in ordered]
    assert [r.cache_salt for r in records] == [r.cache_salt for r in ordered]
    assert [r.timestamp_ms / 1000 for r in records] == pytest.approx([r.arrival_s for r in ordered], abs=1e-6)
    assert all(len(b.hash_ids) == -(-r.prompt_len // 512) for b, r in zip(records, ordered, strict=True))
    assert any(r.retention for r in ordered)
    assert [b.retention for b in records] == [r.retention_config() for r in ordered]
    wl = load_mooncake(path)
    assert [w.block_ids for w in wl] == [b.hash_ids for b in records]
    assert [w.retention for w in wl] == [r.retention or None for r in ordered]
    # the file holds exactly the records; the replay reads what the parser reads
    again = [json.loads(line) for line in path.read_text().splitlines()]
    assert again == list(mooncake_records(reqs))
    back = load_trace(path)
    assert back == replay_requests(records)
    assert replay(back, 300, "lru").hit_blocks > 0


def test_retention_scope_and_decode_settings_survive_export(tmp_path: Path) -> None:
    keep = (RetentionDirective(0, 512, 80, 12.0),)
    a = _req("a", TokenSeq.seeded(1, 600), retention=keep, retention_scope="s1", decode_priority=60)
    b = _req("b", TokenSeq.seeded(2, 600), arrival_s=1.0, retention_scope="s2", decode_duration_s=3.5)
    path = tmp_path / "r.jsonl"
    write_mooncake([a, b], path)
    ra, rb = read_trace(path)
    assert ra.retention == a.retention_config() and rb.retention == b.retention_config()
    wa, wb = load_mooncake(path)
    assert (wa.retention, wa.retention_scope, wa.decode_priority) == (keep, "s1", 60)
    assert (wb.retention, wb.retention_scope, wb.decode_duration_s) == (None, "s2", 3.5)


def test_an_empty_prompt_is_no_request_so_no_record() -> None:
    # (refused when the request is built since session 45, so no export meets one)
    with pytest.raises(WorkloadError, match="request e: the prompt must hold at least one token"):
        _req("e", TokenSeq.of([]))


def test_export_of_a_time_beyond_the_format_is_refused_not_infinity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # arrivals times --time-scale 1e306 overflowed to a timestamp `Infinity`: not JSON, no reader takes it
    out = tmp_path / "x.jsonl"
    argv = ["workload", "export", "multi-tenant", "--time-scale", "1e306", "--limit", "3", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # (refused where the request is made: beyond a microsecond's resolution, long before the format's 2**53 ms)
    assert len(err) == 1 and "arrival_s 1.035e+306" in err[0] and "beyond 6.872e+10 s" in err[0], err
    assert not out.exists()


def test_export_of_no_request_is_refused_not_an_empty_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # duration_s=0 wrote a 0-line trace that replay, simulate and compare then refuse ("no requests")
    out = tmp_path / "e.jsonl"
    assert main(["workload", "export", "multi-tenant", "--option", "duration_s=0", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "kvretain workload export: error: workload 'multi-tenant' --option duration_s=0 has no request: nothing to "
        "export (the trace readers refuse an empty file); use a longer duration_s or higher rates"
    ]
    assert not out.exists()


def test_workload_export_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "a.jsonl"
    argv = ["workload", "export", "agent-pauses", "--seed", "3", "--out", str(out)]
    assert main([*argv, "--option", "duration_s=300", "--option", "steps=[2,3]", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    lines = out.read_text().splitlines()
    assert summary["requests"] == len(lines) > 0
    expected = generate_agent_pauses(AgentPausesConfig(duration_s=300, steps=(2, 3)), random.Random(3))
    assert [json.loads(x) for x in lines] == list(mooncake_records(expected))
    assert main([*argv, "--option", "bogus=1"]) == 2
    assert main([*argv, "--option", "duration_s"]) == 2
    assert main(["workload", "export", "agent-pauses", "--out", str(tmp_path / "no" / "x.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(e.startswith("kvretain workload export: error:") for e in err)
    assert main(["workload", "list"]) == 0
    assert "retrieval-scan" in capsys.readouterr().out


def test_workload_without_its_command_names_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    # a bare `kvretain workload` said "the following arguments are required: workload_command": the parser's
    # internal name of the choice, which no --help shows
    assert main(["workload"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("kvretain workload: error: ") and "{export,list}" in err, err
    assert "workload_command" not in err, err


# --- generators -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "options"),
    [("agent-pauses", {"duration_s": 600.0}), ("retrieval-scan", {"duration_s": 120.0, "documents": 20})],
)
def test_generators_are_deterministic_per_seed(name: str, options: dict[str, float]) -> None:
    def recs(seed: int) -> list[dict[str, object]]:
        return list(mooncake_records(WORKLOADS.create(name, rng=random.Random(seed), **options)))

    assert recs(4) == recs(4)
    assert recs(4) != recs(5)


def test_agent_pauses_shape() -> None:
    cfg = SMALL_AGENTS
    reqs = generate_agent_pauses(cfg, random.Random(1))
    by_session: dict[str, list[WorkloadRequest]] = {}
    for r in reqs:
        assert r.session_id is not None and r.retention is None
        by_session.setdefault(r.session_id, []).append(r)
    pauses = []
    for steps in by_session.values():
        assert len({s.priority for s in steps}) == 1
        for prev, nxt in zip(steps, steps[1:], strict=False):
            # the context grows: the next prompt is this prompt, its tool call, and the tool result
            assert prev.output is not None
            n = len(prev.prompt.chunks) + len(prev.output.chunks)
            assert nxt.prompt.chunks[:n] == prev.prompt.chunks + prev.output.chunks
            assert len(nxt.prompt.chunks) == n + 1
            assert nxt.after == prev.request_id
            pauses.append(nxt.think_s)
    long = [p for p in pauses if p >= cfg.long_pause_s[0]]
    assert all(cfg.short_pause_s[0] <= p <= cfg.short_pause_s[1] for p in pauses if p < cfg.long_pause_s[0])
    assert all(p <= cfg.long_pause_s[1] for p in long)
    assert len(long) / len(pauses) == pytest.approx(cfg.long_pause_prob, abs=0.06)
    important = sum(1 for s in by_session.values() if s[0].priority == cfg.important_priority)
    assert important / len(by_session) == pytest.approx(cfg.important_share, abs=0.12)


def test_retrieval_scan_shape() -> None:
    cfg = SMALL_RAG
    reqs = generate_retrieval_scan(cfg, random.Random(2))
    scans = [r for r in reqs if r.priority == cfg.scan_priority]
    queries = [r for r in reqs if r.priority != cfg.scan_priority]
    expected = cfg.scan_rate / (cfg.scan_rate + cfg.query_rate)
    assert len(scans) / len(reqs) == pytest.approx(expected, abs=0.05)
    # a scan's document is read once: its chunk appears in no other request
    seen = Counter(c for r in reqs for c in r.prompt.chunks[1:2])
    assert all(seen[r.prompt.chunks[1]] == 1 for r in scans)
    # queries follow Zipf popularity: the most popular document is read far more than the median one
    docs = Counter(r.session_id for r in queries)
    assert docs["doc-0"] == max(docs.values()) and docs["doc-0"] > 3 * sorted(docs.values())[len(docs) // 2]
    share0 = sum(1 for r in queries if r.priority == cfg.interactive_priority) / len(queries)
    assert share0 == pytest.approx(cfg.interactive_share, abs=0.05)
    assert all(r.prompt.chunks[0] == reqs[0].prompt.chunks[0] for r in reqs)  # one shared system prompt


def test_generator_configs_reject_bad_values() -> None:
    with pytest.raises(WorkloadError, match="long_pause_prob"):
        AgentPausesConfig(long_pause_prob=1.5)
    with pytest.raises(WorkloadError, match="document_tokens"):
        RetrievalScanConfig(document_tokens=(10, 5))
    with pytest.raises(WorkloadError, match="a first prompt needs at least one token"):
        AgentPausesConfig(system_tokens=0, task_tokens=(0, 5))  # a first step could have an empty prompt
    AgentPausesConfig(system_tokens=0, task_tokens=(1, 5))  # one token is enough
    with pytest.raises(WorkloadError, match="retrieval-scan"):
        WORKLOADS.create("retrieval-scan", rng=random.Random(0), bogus=1)


@pytest.mark.parametrize(
    ("config", "field", "value", "reason"),
    [
        (AgentPausesConfig, "duration_s", "abc", "must be a number"),
        (AgentPausesConfig, "duration_s", float("inf"), "must be a finite number"),  # would never end
        (AgentPausesConfig, "agent_rate", float("nan"), "must be a finite number"),
        (AgentPausesConfig, "important_share", True, "must be a number"),
        (AgentPausesConfig, "important_priority", 0.5, "must be a whole number"),
        (AgentPausesConfig, "steps", (2, 3.5), "must be a whole number"),
        (AgentPausesConfig, "short_pause_s", (1.0,), "must be a range"),
        (MultiTenantConfig, "chat_session_rate", None, "must be a number"),
        (MultiTenantConfig, "batch_documents", 0, "must be >= 1"),
        (MultiTenantConfig, "agent_tool_pause_s", (5.0, 1.0), "must be a range lo <= hi"),
        (RetrievalScanConfig, "zipf_s", float("nan"), "must be a finite number"),
        (RetrievalScanConfig, "scan_rate", -1.0, "must be >= 0"),
        (RetrievalScanConfig, "interactive_share", 1.5, "must be a probability"),
        # a single token count (a shared prompt's) is >= 0 as a range's bounds are: a negative one was accepted
        # and failed only when generating, as a ValueError naming no setting ("length must be >= 0, got -5")
        (MultiTenantConfig, "chat_system_tokens", -5, "must be >= 0 tokens"),
        (MultiTenantConfig, "agent_system_tokens", -1, "must be >= 0 tokens"),
        (MultiTenantConfig, "batch_system_tokens", -1, "must be >= 0 tokens"),
        (AgentPausesConfig, "system_tokens", -5, "must be >= 0 tokens"),
        (RetrievalScanConfig, "system_tokens", -1, "must be >= 0 tokens"),
    ],
)
def test_generator_configs_name_the_bad_setting(config: type, field: str, value: object, reason: str) -> None:
    # every generator checks its settings by one rule (workloads.request.check_config): the kind of value its
    # default is, finite, then its own ranges; the message names the workload, the field and the value
    with pytest.raises(WorkloadError, match=rf"config: {field} {reason}.*got {re.escape(repr(value))}"):
        config(**{field: value})


def test_export_names_a_setting_of_the_wrong_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "x.jsonl")
    assert main(["workload", "export", "agent-pauses", "--out", out, "--option", "duration_s=abc"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "duration_s must be a number, got 'abc'" in err[0]
    assert not Path(out).exists()


# --- session rules ---------------------------------------------------------------------------------


def _mooncake_like(sessions: int, seed: int = 0) -> list[WorkloadRequest]:
    """Conversations as in the Mooncake trace: block 0 shared, the session's own first block at index 1."""
    rng = random.Random(seed)
    out = []
    nxt = 1
    for s in range(sessions):
        own = nxt
        nxt += 10
        for t in range(1 + s % 7):
            ids = (0, own, *range(own + 1, own + 2 + t))
            out.append(
                WorkloadRequest(
                    f"r{s}-{t}", rng.random(), TokenSeq.seeded(s, 512 * len(ids)), 1, block_ids=ids
                )
            )
    return sorted(out, key=lambda r: r.arrival_s)


def test_session_key_matches_the_reference_rule() -> None:
    reqs = _mooncake_like(40)
    ref = make_rule("reference")
    for r in reqs:
        key = session_key(r)
        assert r.block_ids is not None and key == r.block_ids[1]
        assert ref(r) == (0 if key % 4 == 0 else 1)  # type: ignore[operator]
    named = WorkloadRequest("x", 0.0, TokenSeq.seeded(1, 5), 1, session_id="s-1", block_ids=(3, 4))
    assert session_key(named) == "s-1"
    assert session_key(WorkloadRequest("y", 0.0, TokenSeq.seeded(1, 5), 1, block_ids=(9,))) == 9


def test_an_empty_session_id_still_names_the_session() -> None:
    # the trace format refuses an empty session_id; a WorkloadRequest built in memory may hold one, and it names
    # a conversation as any other id does (not "no session": the block ids or the request id)
    a, b = (
        WorkloadRequest(rid, 0.0, TokenSeq.seeded(1, 5), 1, session_id="", block_ids=(7, ids))
        for rid, ids in (("a", 1), ("b", 2))
    )
    assert session_key(a) == session_key(b) == ""
    rule = make_rule("random-sessions", [a, b], random.Random(0), fraction=0.5)
    assert rule is not None and rule(a) == rule(b)


@pytest.mark.parametrize("fraction", [0.1, 0.5])
def test_random_sessions_picks_that_share_of_whole_sessions(fraction: float) -> None:
    reqs = _mooncake_like(2000)
    rule = make_rule("random-sessions", reqs, random.Random(7), fraction=fraction)
    classes: dict[object, set[int]] = {}
    for r in reqs:
        classes.setdefault(session_key(r), set()).add(rule(r))
    assert all(len(c) == 1 for c in classes.values())  # every turn of a session in one class
    share = sum(1 for c in classes.values() if c == {0}) / len(classes)
    assert share == pytest.approx(fraction, abs=0.03)
    again = make_rule("random-sessions", reqs, random.Random(7), fraction=fraction)
    assert [again(r) for r in reqs] == [rule(r) for r in reqs]


def test_longest_rule_picks_the_longest_sessions() -> None:
    reqs = _mooncake_like(40)  # session s has 1 + s % 7 turns
    rule = make_rule("longest", reqs, fraction=0.25)
    turns = Counter(session_key(r) for r in reqs)
    chosen = {session_key(r) for r in reqs if rule(r) == 0}
    assert len(chosen) == 10
    assert min(turns[k] for k in chosen) >= max(turns[k] for k in turns if k not in chosen)
    with pytest.raises(WorkloadError, match="whole workload"):
        make_rule("longest")


def test_directive_survives_export() -> None:
    keep = (RetentionDirective(0, None, 80, 12.0),)
    (rec,) = mooncake_records([_req("a", TokenSeq.seeded(1, 600), retention=keep, session_id="s")])
    assert rec["retention"] == [{"start": 0, "end": None, "priority": 80, "duration_s": 12.0}]
    assert rec["session_id"] == "s" and rec["priority"] == 0


def test_re_exporting_a_mooncake_trace_names_the_option_of_the_tokens_it_is_read_at(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a trace of 16 tokens per id read at the default 512: the error said "see --block-tokens", which in
    # `workload export` sets the written trace's tokens per id, not the read one's
    first, again = tmp_path / "t16.jsonl", tmp_path / "again.jsonl"
    common = ["--limit", "4", "--block-tokens", "16"]
    assert main(["workload", "export", "multi-tenant", *common, "--out", str(first)]) == 0
    capsys.readouterr()
    reexport = ["workload", "export", "mooncake", "--trace", str(first), *common, "--out", str(again)]
    assert main(reexport) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--option block_size=N" in err[0] and "see --block-tokens" not in err[0], err
    assert main([*reexport, "--option", "block_size=16"]) == 0
    back = [json.loads(x) for x in again.read_text().splitlines()]
    assert [r["hash_ids"] for r in back] == [
        json.loads(x)["hash_ids"] for x in first.read_text().splitlines()
    ]


# --- review 34: what an export writes reads back --------------------------------------------------------


def test_export_to_a_closed_stdout_ends_quietly_with_141() -> None:
    # README: a reader of stdout that goes away ends a command quietly with 141; `workload export ... --out
    # /dev/stdout | head -1` printed "error: cannot write /dev/stdout: Broken pipe" and exited 2
    import os
    import subprocess
    import sys

    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src}
    cmd = [sys.executable, "-m", "kvretain", "workload", "export", "multi-tenant", "--limit", "50"]
    proc = subprocess.Popen(
        [*cmd, "--out", "/dev/stdout"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    assert proc.stdout is not None
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert (proc.returncode, err.decode()) == (141, "")


@pytest.mark.parametrize(
    "kw",
    [{"session_id": ""}, {"cache_salt": ""}, {"retention_scope": ""}, {"session_id": "x" * 5000}],
    ids=["empty-session", "empty-salt", "empty-scope", "long-session"],
)
def test_export_never_writes_a_line_the_reader_refuses(tmp_path: Path, kw: dict[str, str]) -> None:
    out = tmp_path / "t.jsonl"
    if "retention_scope" in kw:  # (refused as the request is made, as the core's RetentionConfig refuses it)
        with pytest.raises(WorkloadError, match="request a: retention_scope must be a non-empty string"):
            WorkloadRequest("a", 0.0, TokenSeq.seeded(1, 600), 1, **kw)  # type: ignore[arg-type]
        return
    req = WorkloadRequest("a", 0.0, TokenSeq.seeded(1, 600), 1, **kw)  # type: ignore[arg-type]
    try:
        write_mooncake([req], out)
    except WorkloadError as e:
        assert "request a: cannot be written in the trace format" in str(e)
        assert not out.exists()
        return
    read_trace(out)  # (before: a TraceError, the export had written a trace its own reader refuses)


def test_export_refuses_more_hash_ids_than_a_line_may_hold(tmp_path: Path) -> None:
    # a 70,000-token prompt at 1 token per id: 70,000 ids > MAX_HASH_IDS (65,536): was written, then unreadable
    out = tmp_path / "t.jsonl"
    with pytest.raises(WorkloadError, match="MAX_HASH_IDS"):
        write_mooncake([WorkloadRequest("a", 0.0, TokenSeq.seeded(1, 70_000), 1)], out, 1)
    assert not out.exists()


def test_a_bad_block_size_option_is_named_as_that_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n')
    argv = ["workload", "export", "mooncake", "--trace", str(trace), "--option", "block_size=0"]
    assert main([*argv, "--out", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "(--option block_size)" in err and "(--block-tokens)" not in err, err


def _export_trace(trace: Path, out: Path, *options: str) -> int:
    """``kvretain workload export mooncake --trace TRACE [OPTIONS] --out OUT``: its exit status."""
    return main(["workload", "export", "mooncake", "--trace", str(trace), *options, "--out", str(out)])


def test_re_exporting_a_trace_replays_as_the_trace(tmp_path: Path) -> None:
    # hash id 2 is request 1's partial last block and request 2's full block under the same parent: one block
    # to `kvretain replay` (a block is its chain of ids); the re-export numbered them apart (1 hit, not 2)
    trace, again, small = tmp_path / "t.jsonl", tmp_path / "again.jsonl", tmp_path / "small.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
    ]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert _export_trace(trace, again) == 0
    before, after = (replay(load_trace(p), 10, "lru") for p in (trace, again))
    assert after.hit_blocks == before.hit_blocks == 2
    # at another block size the blocks are the tokens' (88 tokens of id 2 are not its 512): 600 // 8 = 75 shared
    assert _export_trace(trace, small, "--block-tokens", "8") == 0
    assert replay(load_trace(small, block_tokens=8), 1000, "lru", block_tokens=8).hit_blocks == 75


def test_re_exporting_at_another_block_size_keys_blocks_by_their_tokens(tmp_path: Path) -> None:
    # at 400 tokens a block, the first block of [7, 8] (600 tokens) and of [7, 9, 10] (1,500) are the same 400
    # tokens of id 7; keying by the trace's id where the count of blocks happened to match numbered them apart
    # (the first version of the trace-id rule, review 34)
    trace, out = tmp_path / "t.jsonl", tmp_path / "o.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [7, 8]},
        {"timestamp": 1, "input_length": 1500, "output_length": 1, "hash_ids": [7, 9, 10]},
    ]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert _export_trace(trace, out, "--block-tokens", "400") == 0
    a, b = (json.loads(line)["hash_ids"] for line in out.read_text().splitlines())
    assert a[0] == b[0] and a[1] != b[1]


def test_longest_rule_breaks_a_tie_in_turns_by_more_prompt_tokens_and_rounds_the_count() -> None:
    # three two-turn sessions; "b" has the most prompt tokens, then "c": fraction 0.5 picks round(1.5) = 2
    def turn(rid: str, session: str, tokens: int) -> WorkloadRequest:
        return WorkloadRequest(rid, 0.0, TokenSeq.seeded(1, tokens), 1, session_id=session)

    reqs = [turn(f"{s}{t}", s, n) for s, n in (("a", 10), ("b", 30), ("c", 20)) for t in range(2)]
    rule = make_rule("longest", reqs, fraction=0.5)
    assert {r.session_id for r in reqs if rule(r) == 0} == {"b", "c"}
    one = make_rule("longest", reqs, fraction=0.2)  # round(0.6) = 1: the most tokens
    assert {r.session_id for r in reqs if one(r) == 0} == {"b"}


@pytest.mark.parametrize("fraction", [0.1, 0.25])
def test_by_session_rule_picks_about_that_share_of_sessions(fraction: float) -> None:
    # (CRC-32 of short sequential names is uneven over a few thousand: 7% of s0..s1999 for 0.1; even by 20,000)
    prompt = TokenSeq.seeded(1, 5)
    reqs = [WorkloadRequest(f"r{i}", 0.0, prompt, 1, session_id=f"s{i}") for i in range(20_000)]
    rule = make_rule("by-session", fraction=fraction)
    share = sum(rule(r) == 0 for r in reqs) / len(reqs)
    assert share == pytest.approx(fraction, abs=0.01)


def test_records_are_written_in_arrival_order() -> None:
    late = WorkloadRequest("late", 2.0, TokenSeq.seeded(1, 600), 1)
    early = WorkloadRequest("early", 1.0, TokenSeq.seeded(2, 600), 1)
    assert [r["timestamp"] for r in mooncake_records([late, early])] == [1000.0, 2000.0]


def test_an_equal_block_after_different_prefixes_gets_different_ids() -> None:
    # block 1 has the same tokens in both requests, block 0 differs: they share no prefix, so no id
    def prompt(first: int) -> TokenSeq:
        return TokenSeq.seeded(first, 16) + TokenSeq.seeded(99, 16)

    a, b = (WorkloadRequest(n, float(i), prompt(i + 1), 1) for i, n in enumerate("ab"))
    ra, rb = mooncake_records([a, b], block_size=16)
    assert ra["hash_ids"][0] != rb["hash_ids"][0] and ra["hash_ids"][1] != rb["hash_ids"][1]


def test_a_trace_written_at_another_block_size_shares_what_its_tokens_share(tmp_path: Path) -> None:
    """Read at 512 tokens an id and written at 256: a one-id request of 256 tokens is the first 256 tokens of id 7,
    the same block as the head of every other request of id 7 at that size; it took id 7's own key while the
    others took their pieces', and shared nothing (replay: 2 hit blocks of 7 where 3 are right). Written at the
    size it was read at, a partial block keeps its id's identity, as the replay keys it."""
    trace = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 1, "input_length": 512, "output_length": 4, "hash_ids": [7]},
        {"timestamp": 2, "input_length": 256, "output_length": 4, "hash_ids": [7]},
        {"timestamp": 3, "input_length": 1024, "output_length": 4, "hash_ids": [7, 8]},
    ]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = {}
    for tokens in (256, 512):
        out = tmp_path / f"x{tokens}.jsonl"
        argv = ["workload", "export", "mooncake", "--trace", str(trace), "--block-tokens", str(tokens)]
        assert main([*argv, "--out", str(out)]) == 0
        got[tokens] = [json.loads(x)["hash_ids"] for x in out.read_text().splitlines()]
    assert got[256] == [[0, 1], [0], [0, 1, 2, 3]]
    assert got[512] == [[0], [0], [0, 1]]


def test_exporting_a_mooncake_trace_refuses_a_seed_nothing_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a Mooncake trace draws nothing: --seed seeds only a drawing priority rule (as `replay` and `simulate` refuse
    # it); the export took --seed 3 with --priority-rule keep, wrote the trace and said "(seed 3)"
    trace, out = tmp_path / "t.jsonl", tmp_path / "x.jsonl"
    trace.write_text(
        json.dumps({"timestamp": 1, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]})
    )
    argv = ["workload", "export", "mooncake", "--trace", str(trace), "--seed", "3", "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --seed" in err[0] and "random-sessions" in err[0], err
    assert not out.exists()
    assert main([*argv, "--priority-rule", "random"]) == 0  # a rule that draws reads it
    assert main(["workload", "export", "mooncake", "--trace", str(trace), "--out", str(out)]) == 0


def test_re_exporting_a_trace_of_one_block_requests_replays_as_the_trace(tmp_path: Path) -> None:
    """Every request one hash id, none a whole block: the size the trace was read at was taken as its longest
    prompt (300), not 512, so the export at 512 keyed blocks by their tokens: id 7's 300 and 200 tokens became
    two blocks (1 hit of 3 where the trace's replay has 2)."""
    trace, again = tmp_path / "t.jsonl", tmp_path / "again.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 300, "output_length": 1, "hash_ids": [7]},
        {"timestamp": 1, "input_length": 200, "output_length": 1, "hash_ids": [7]},
        {"timestamp": 2, "input_length": 300, "output_length": 1, "hash_ids": [7]},
    ]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert _export_trace(trace, again) == 0
    assert [json.loads(x)["hash_ids"] for x in again.read_text().splitlines()] == [[0], [0], [0]]
    before, after = (replay(load_trace(p), 10, "lru") for p in (trace, again))
    assert after.hit_blocks == before.hit_blocks == 2
    # written at a size below the longest prompt, a block is its tokens (the 200 tokens are not the 300's block)
    small = tmp_path / "small.jsonl"
    assert _export_trace(trace, small, "--block-tokens", "250") == 0
    assert [json.loads(x)["hash_ids"] for x in small.read_text().splitlines()] == [[0, 1], [2], [0, 1]]


# --- round trips (properties) -------------------------------------------------------------------------

RT_BLOCK = 4  # tokens a block: small prompts span several blocks, partial ones included
RT_SEEDS = range(1, 9)  # their first 16 tokens are 128 distinct tokens: equal tokens are equal pieces


@st.composite
def _rt_request(draw: st.DrawFn, i: int) -> WorkloadRequest:
    parts = draw(st.lists(st.tuples(st.sampled_from(RT_SEEDS), st.integers(1, 16)), min_size=1, max_size=3))
    prompt = TokenSeq(())
    for seed, n in parts:
        prompt = prompt + TokenSeq.seeded(seed, n)
    cuts = sorted(draw(st.sets(st.integers(0, len(prompt)), max_size=4)))
    ranges = [(a, b) for a, b in zip(cuts[::2], cuts[1::2], strict=False) if a < b]
    retention = tuple(
        RetentionDirective(
            a,
            None if b == len(prompt) and draw(st.booleans()) else b,
            draw(st.integers(0, 100)),
            draw(st.none() | st.floats(0, 1e6)),
        )
        for a, b in ranges
    )
    return WorkloadRequest(
        f"r{i}",
        draw(st.integers(0, 10**9).map(lambda ms: ms / 1000) | st.floats(0, 1e6)),
        prompt,
        draw(st.integers(0, 50)),
        priority=draw(st.integers(-(2**63), 2**63 - 1) | st.integers(-2, 2)),
        retention=retention or None,
        session_id=draw(st.none() | st.sampled_from(["s0", "s1", "é 会话"])),
        cache_salt=draw(st.none() | st.sampled_from(["t0", "t1"])),
        retention_scope=draw(st.none() | st.sampled_from(["scope"])),
        decode_priority=draw(st.none() | st.integers(0, 100)),
        decode_duration_s=draw(st.none() | st.floats(0, 1e6)),
    )


@st.composite
def _rt_workload(draw: st.DrawFn) -> list[WorkloadRequest]:
    return [draw(_rt_request(i)) for i in range(draw(st.integers(1, 8)))]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=_rt_workload())
def test_an_export_reads_back_as_its_requests_and_replays_as_their_tokens(
    tmp_path: Path, reqs: list[WorkloadRequest]
) -> None:
    """Any workload, exported and read back: the same requests in arrival order (lengths, priorities, sessions,
    salts, retention; timestamps in ms, to the microsecond), and two requests share their first k hash ids exactly
    when they share their first k blocks of tokens under the same salt; so the export replays as the requests'
    own token blocks do."""
    path = tmp_path / "rt.jsonl"
    assert write_mooncake(reqs, path, RT_BLOCK) == len(reqs)
    records = read_trace(path, RT_BLOCK)
    ordered = sorted(reqs, key=lambda r: r.arrival_s)
    assert [(b.input_length, b.output_length, b.priority) for b in records] == [
        (r.prompt_len, r.output_len, r.priority) for r in ordered
    ]
    assert [(b.session_id, b.cache_salt) for b in records] == [(r.session_id, r.cache_salt) for r in ordered]
    assert [b.retention for b in records] == [r.retention_config() for r in ordered]
    for b, r in zip(records, ordered, strict=True):
        assert abs(b.timestamp_ms - r.arrival_s * 1000) <= 5e-4 + 1e-9 * r.arrival_s * 1000
        if r.arrival_s == round(r.arrival_s * 1000) / 1000:  # a whole number of milliseconds: exactly
            assert b.arrival_s == r.arrival_s
    # the ids are the blocks: a prefix of tokens (block by block, the partial last one included) and the salt
    content: dict[int, tuple[str | None, tuple[int, ...]]] = {}
    own: dict[tuple[str | None, tuple[int, ...]], int] = {}
    expected = []
    hasher = BlockIdHasher()
    for b, r in zip(records, ordered, strict=True):
        toks = tuple(r.prompt.materialize())
        ids = []
        for k, h in enumerate(b.hash_ids):
            block = (r.cache_salt, toks[: (k + 1) * RT_BLOCK])
            assert content.setdefault(h, block) == block  # one id, one content
            ids.append(own.setdefault(block, len(own)))
        expected.append(
            ReplayRequest(
                tuple(hasher.block_keys(ids)),
                b.timestamp_ms / 1000,
                b.input_length,
                r.priority,
                r.retention_config(),
            )
        )
    assert len(set(content.values())) == len(content)  # one content, one id
    back = load_trace(path, block_tokens=RT_BLOCK)
    for policy in ("lru", "priority", "unified"):
        want, got = (replay(x, 6, policy, block_tokens=RT_BLOCK, record_hits=True) for x in (expected, back))
        assert got.to_json() == want.to_json() and got.request_hits == want.request_hits


@st.composite
def _rt_trace(draw: st.DrawFn, max_ids: int) -> list[dict[str, object]]:
    """Trace lines of ids 0..5 (an id under another parent is another block), prompts of up to ``RT_BLOCK``
    tokens an id."""
    rows: list[dict[str, object]] = []
    for _ in range(draw(st.integers(1, 8))):
        ids = draw(st.lists(st.integers(0, 5), min_size=1, max_size=max_ids))
        row: dict[str, object] = {
            "timestamp": draw(st.integers(0, 10**6).map(lambda x: x / 8)),
            "input_length": draw(st.integers((len(ids) - 1) * RT_BLOCK + 1, len(ids) * RT_BLOCK)),
            "output_length": draw(st.integers(0, 9)),
            "hash_ids": ids,
            "priority": draw(st.integers(-2, 2)),
        }
        for key, values in (("session_id", ["s0", "s1"]), ("cache_salt", ["t0", "t1"])):
            if draw(st.booleans()):
                row[key] = draw(st.sampled_from(values))
        if draw(st.booleans()):
            row["retention"] = [{"start": 0, "end": draw(st.none() | st.integers(1, 3)), "priority": 90}]
        rows.append(row)
    return rows


@pytest.mark.parametrize("read_at", [RT_BLOCK, 512])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_re_exported_trace_replays_as_the_trace(tmp_path: Path, read_at: int, data: st.DataObject) -> None:
    """A Mooncake trace read (``load_mooncake``) and written at the tokens per id it was read at replays as the
    trace, request by request. At 512 every prompt is one id of at most 4 tokens (the size read at is no chunk's
    length: each chunk is a partial block)."""
    rows = data.draw(_rt_trace(4 if read_at == RT_BLOCK else 1))
    trace, again = tmp_path / "t.jsonl", tmp_path / "again.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    write_mooncake(load_mooncake(trace, read_at), again, read_at)
    before, after = (load_trace(p, block_tokens=read_at) for p in (trace, again))
    assert [(r.timestamp_s, r.input_length, r.priority, r.retention) for r in after] == [
        (r.timestamp_s, r.input_length, r.priority, r.retention) for r in before
    ]
    for policy in ("lru", "priority", "unified"):
        want, got = (replay(x, 5, policy, block_tokens=read_at, record_hits=True) for x in (before, after))
        assert got.to_json() == want.to_json() and got.request_hits == want.request_hits


def test_an_infinite_retention_duration_is_refused_by_name_not_by_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a duration of 1e300 s at --time-scale 1e10 is inf, which the core takes and JSON cannot hold: the export
    # ended "error: Out of range float values are not JSON compliant", naming no request and no field
    trace, out = tmp_path / "t.jsonl", tmp_path / "x.jsonl"
    directive = {"start": 0, "end": None, "priority": 80, "duration_s": 1e300}
    line = {
        "timestamp": 0,
        "input_length": 600,
        "output_length": 1,
        "hash_ids": [1, 2],
        "retention": [directive],
    }
    trace.write_text(json.dumps(line) + "\n")
    assert _export_trace(trace, out, "--time-scale", "1e10") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "request mooncake-1: retention directive 0's duration_s inf s" in err[0], err
    assert not out.exists()
    decode = _req("d", TokenSeq.seeded(1, 8), decode_priority=50, decode_duration_s=float("inf"))
    with pytest.raises(WorkloadError, match="request d: retention decode_duration_s inf s"):
        list(mooncake_records([decode]))
