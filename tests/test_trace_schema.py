"""The one trace schema of ``kvretain replay`` and ``kvretain simulate`` (issue 11, defects 8-14).

Both commands read a trace through :func:`kvretain.workloads.mooncake.read_trace`: the same fields, the same
checks, the same order; priority rules come from one registry. Hostile files are in test_hostile_traces.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

import kvretain.cli
import kvretain.cli_sim
import kvretain.replay
from kvretain.cli import main
from kvretain.core.retention import RetentionConfig, RetentionDirective
from kvretain.engine.sim.request import SimRequest
from kvretain.replay import load_trace
from kvretain.workloads import (
    PRIORITY_RULES,
    TraceError,
    WorkloadError,
    load_mooncake,
    make_rule,
    tag_priorities,
)
from kvretain.workloads.mooncake import MAX_HASH_IDS, TraceRecord, read_trace
from kvretain.workloads.priority import rule_choices


def rec(ids: list[int], **kw: Any) -> dict[str, Any]:
    return {"timestamp": 0, "input_length": 512 * len(ids), "output_length": 2, "hash_ids": ids, **kw}


def write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def both(path: Path, **kw: Any) -> tuple[list[Any], list[Any]]:
    return load_trace(path, **kw), load_mooncake(path)


# ---------------------------------------------------------------------------------------------- defect 12
def test_replay_and_simulate_accept_the_same_fields(tmp_path: Path) -> None:
    """RFC #37003 spellings (``retention_directives``, ``retention_scope``, ``duration``), a retention object
    with a decode priority, session and salt: read alike by both (simulate rejected the RFC names)."""
    rows = [
        rec(
            [1, 2, 3],
            input_length=1400,
            priority=2,
            session_id="s1",
            cache_salt="t1",
            retention_directives=[{"start": 0, "end": 512, "priority": 80, "duration": 30}],
            retention_scope="s1",
        ),
        rec([1, 4], timestamp=7, retention={"directives": [], "decode_priority": 60, "decode_duration_s": 2}),
    ]
    replayed, simulated = both(write(tmp_path / "t.jsonl", rows))
    want = RetentionConfig((RetentionDirective(0, 512, 80, 30.0),), scope="s1")
    assert replayed[0].retention == want
    assert (replayed[0].priority, replayed[0].input_length) == (2, 1400)
    w = simulated[0]
    assert (w.priority, w.session_id, w.cache_salt, w.prompt_len) == (2, "s1", "t1", 1400)
    assert w.retention_config() == want
    assert SimRequest(w).retention == want
    decode = RetentionConfig(decode_priority=60, decode_duration_s=2.0)
    assert replayed[1].retention == decode and simulated[1].retention_config() == decode
    assert SimRequest(simulated[1]).retention == decode


def test_unknown_field_is_no_longer_dropped_by_replay(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [rec([1]), rec([2], prio=0)])
    for load in (load_trace, load_mooncake):
        with pytest.raises(
            TraceError, match=r"t\.jsonl:2: unknown field 'prio' \(did you mean 'priority'\?\)"
        ):
            load(path)


def test_replay_checks_hash_ids_against_input_length(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [rec([1, 2], input_length=512)])
    for load in (load_trace, load_mooncake):
        with pytest.raises(TraceError, match=r":1: field 'hash_ids' has 2 ids but input_length 512 needs 1"):
            load(path)
    # --block-tokens says how many tokens a hash id stands for
    assert len(load_trace(path, block_tokens=256)) == 1


def test_missing_required_field_in_both(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [{"hash_ids": [1]}])
    for load in (load_trace, load_mooncake):
        with pytest.raises(TraceError, match=r":1: missing field 'timestamp'"):
            load(path)


def test_blank_lines_and_a_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\ufeff" + json.dumps(rec([1])) + "\n\n   \n" + json.dumps(rec([2])) + "\n")
    records = read_trace(path)
    assert [r.line for r in records] == [1, 4]
    assert [r.request_id for r in load_mooncake(path)] == ["mooncake-1", "mooncake-4"]


def test_a_byte_order_mark_past_the_first_line_is_named(tmp_path: Path) -> None:
    # two files joined (`cat a.jsonl b.jsonl`), the second with a byte-order mark: the error said "not valid JSON
    # (Expecting value at column 1)", of a character no editor shows
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(rec([1])) + "\n\ufeff" + json.dumps(rec([2])) + "\n")
    with pytest.raises(TraceError, match=r"t\.jsonl:2: a byte-order mark \(U\+FEFF\) starts the line"):
        read_trace(path)


# ---------------------------------------------------------------------------------------------- defect 8
def test_out_of_order_timestamps_are_sorted_stably_in_both(tmp_path: Path) -> None:
    rows = [
        rec([1], timestamp=500),
        rec([2], timestamp=100),
        rec([3], timestamp=100),
        rec([4], timestamp=300),
    ]
    path = write(tmp_path / "t.jsonl", rows)
    replayed, simulated = both(path)
    assert [r.timestamp_s for r in replayed] == [0.1, 0.1, 0.3, 0.5]  # the replay's clock never runs back
    assert [w.request_id for w in simulated] == ["mooncake-2", "mooncake-3", "mooncake-4", "mooncake-1"]
    assert [r.line for r in read_trace(path)] == [2, 3, 4, 1]
    # the same requests in the same order: the replay's first request is the simulator's first
    assert [w.block_ids for w in simulated] == [(2,), (3,), (4,), (1,)]


def test_negative_timestamp_rejected_by_replay_too(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [rec([1], timestamp=-1)])
    for load in (load_trace, load_mooncake):
        with pytest.raises(TraceError, match=r":1: field 'timestamp' must be a number of milliseconds"):
            load(path)


def test_simulate_json_is_strict_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [rec([0, i + 1], timestamp=250 * i) for i in range(6)]
    path = write(tmp_path / "t.jsonl", rows)
    assert main(["simulate", str(path), "--json", "--no-progress", "--kv-blocks", "200"]) == 0

    def reject(name: str) -> None:
        raise AssertionError(f"{name} in the output")

    obj = json.loads(capsys.readouterr().out, parse_constant=reject)
    assert obj["requests"] == 6 and obj["simulated_s"] > 0


# ---------------------------------------------------------------------------------------------- defect 9
def test_limit_reads_that_many_requests(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [rec([i]) for i in range(5)])
    assert len(load_trace(path, limit=2)) == 2 and len(load_mooncake(path, limit=2)) == 2
    assert len(load_trace(path)) == 5
    for bad in (0, -1):
        for load in (load_trace, load_mooncake):
            with pytest.raises(
                WorkloadError, match=r"limit \(--limit\) must be a positive number of requests"
            ):
                load(path, limit=bad)


# ---------------------------------------------------------------------------------------------- defect 10
def test_overlapping_directives_fail_at_load_naming_the_line(tmp_path: Path) -> None:
    bad = rec([1, 2], retention=[{"start": 0, "end": 700, "priority": 80}, {"start": 600, "priority": 10}])
    path = write(tmp_path / "t.jsonl", [rec([1]), bad])
    for load in (load_trace, load_mooncake):
        with pytest.raises(TraceError, match=r"t\.jsonl:2: field 'retention': retention directives overlap"):
            load(path)


# ---------------------------------------------------------------------------------------------- defect 13
def test_caps_on_one_line(tmp_path: Path) -> None:
    n = MAX_HASH_IDS + 1
    path = write(tmp_path / "t.jsonl", [rec(list(range(n)), input_length=n)])
    with pytest.raises(TraceError, match=rf":1: field 'hash_ids' holds {n} ids; at most {MAX_HASH_IDS}"):
        load_trace(path, block_tokens=1)
    ok = write(tmp_path / "ok.jsonl", [rec(list(range(MAX_HASH_IDS)), input_length=MAX_HASH_IDS)])
    assert len(load_trace(ok, block_tokens=1)[0].hashes) == MAX_HASH_IDS


# ---------------------------------------------------------------------------------------------- defect 14
def test_one_priority_rule_registry() -> None:
    assert not hasattr(kvretain.cli, "PRIORITY_RULES")
    assert not hasattr(kvretain.replay, "reference_priority")
    parser = kvretain.cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    export = commands["workload"]._subparsers._group_actions[0].choices["export"]  # type: ignore[union-attr]
    for sub in (commands["replay"], commands["simulate"], commands["compare"], export):
        action = next(a for a in sub._actions if a.dest == "priority_rule")
        assert list(action.choices) == rule_choices() == ["keep", *PRIORITY_RULES.names()]
    assert kvretain.cli_sim.rule_choices is rule_choices


def test_every_registered_rule_applies_to_trace_records_and_workload_requests(tmp_path: Path) -> None:
    """A rule reads only scalar fields, so it tags the replay's records and the simulator's requests alike."""
    rows = [rec([0, i], session_id=f"s{i % 3}") for i in range(1, 13)]
    path = write(tmp_path / "t.jsonl", rows)
    for name in PRIORITY_RULES.names():
        records, workload = read_trace(path), load_mooncake(path)
        rule_a = make_rule(name, records, random.Random(5))
        rule_b = make_rule(name, workload, random.Random(5))
        assert rule_a is not None and rule_b is not None
        a = [r.priority for r in tag_priorities(records, rule_a)]
        b = [w.priority for w in tag_priorities(workload, rule_b)]
        assert a == b, name
    assert make_rule("keep") is None


def test_reference_rule_on_both_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [rec([0, i]) for i in range(1, 9)]
    path = write(tmp_path / "t.jsonl", rows)
    assert main(["replay", str(path), "--priority-rule", "reference", "--policy", "lru", "--json"]) == 0
    replayed = json.loads(capsys.readouterr().out)["classes"]
    argv = ["simulate", str(path), "--priority-rule", "reference", "--json", "--no-progress"]
    assert main([*argv, "--kv-blocks", "500"]) == 0
    simulated = json.loads(capsys.readouterr().out)["classes"]
    # hash_ids[1] % 4 == 0 for ids 4 and 8: two important requests, six others, in both
    assert {k: v["requests"] for k, v in replayed.items()} == {"0": 2, "1": 6}
    assert {k: v["requests"] for k, v in simulated.items()} == {"0": 2, "1": 6}


def test_trace_record_fields_for_rules(tmp_path: Path) -> None:
    (r,) = read_trace(write(tmp_path / "t.jsonl", [rec([3, 4], timestamp=1500, input_length=900)]))
    assert isinstance(r, TraceRecord)
    assert (r.request_id, r.block_ids, r.arrival_s, r.prompt_len, r.output_len) == (
        "mooncake-1",
        (3, 4),
        1.5,
        900,
        2,
    )


@pytest.mark.parametrize("input_length", [31, 32, 33, 17])
def test_a_trace_request_has_exactly_its_input_length_in_tokens(tmp_path: Path, input_length: int) -> None:
    from kvretain.workloads import load_mooncake

    ids = list(range(-(-input_length // 16)))
    line = {"timestamp": 0, "input_length": input_length, "output_length": 1, "hash_ids": ids}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (req,) = load_mooncake(path, block_size=16)
    assert req.prompt_len == input_length
