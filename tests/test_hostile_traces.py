"""Hostile trace files through ``kvretain replay`` and ``kvretain simulate`` (issue 11, acceptance 2).

Each case is a trace file whose second line (after a valid first line) is wrong in one way. Both commands
must answer with ONE line on stderr naming ``file:line`` and the field, exit status 2, nothing on stdout
(no partial report), no traceback and no file written. The CLI runs in-process (fast); a few cases also run
through a subprocess to show that no traceback reaches a user.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvretain.cli import main
from kvretain.workloads.mooncake import MAX_DIRECTIVES, MAX_LINE_BYTES, MAX_STRING_BYTES
from kvretain.workloads.request import MAX_TOKENS

GOOD: dict[str, Any] = {"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]}


def line(**fields: Any) -> str:
    """The good line with ``fields`` replaced (``...`` removes a field)."""
    obj = {**GOOD, **fields}
    return json.dumps({k: v for k, v in obj.items() if v is not ...})


def raw(text: str) -> str:
    """The good line with ``"timestamp": 0`` spelled as ``text`` (for non-JSON-serializable values)."""
    return line().replace('"timestamp": 0', f'"timestamp": {text}')


def directive(**kw: Any) -> dict[str, Any]:
    return {"start": 0, "end": 512, "priority": 80, **kw}


# (case id, second line of the trace (str, or bytes written as is), regex the error must match after
# "file:2: ")
LINE_CASES: list[tuple[str, str | bytes, str]] = [
    ("not-json", "{not json", r"not valid JSON"),
    ("array-line", "[1, 2]", r"expected a JSON object per line"),
    ("string-line", '"hello"', r"expected a JSON object per line"),
    ("missing-hash-ids", line(hash_ids=...), r"missing field 'hash_ids'"),
    ("missing-timestamp", line(timestamp=...), r"missing field 'timestamp'"),
    ("missing-input-length", line(input_length=...), r"missing field 'input_length'"),
    ("missing-output-length", line(output_length=...), r"missing field 'output_length'"),
    ("typo-prio", line(prio=0), r"unknown field 'prio' \(did you mean 'priority'\?\)"),
    ("unknown-field", line(colour="red"), r"unknown field 'colour'"),
    ("duplicate-field", line()[:-1] + ', "priority": 1, "priority": 2}', r"field 'priority' is given twice"),
    ("hash-ids-empty", line(hash_ids=[]), r"field 'hash_ids' must be a non-empty list"),
    ("hash-ids-string", line(hash_ids="1,2"), r"field 'hash_ids' must be a non-empty list"),
    ("hash-id-bool", line(hash_ids=[1, True]), r"field 'hash_ids' item 1 must be an integer"),
    ("hash-id-float", line(hash_ids=[1, 2.5]), r"field 'hash_ids' item 1 must be an integer"),
    (
        "hash-id-negative",
        line(hash_ids=[-1, 2]),
        r"field 'hash_ids' item 0 must be an integer in \[0, 2\*\*64\)",
    ),
    (
        "hash-id-2**64",
        line(hash_ids=[1, 2**64]),
        r"field 'hash_ids' item 1 must be an integer in \[0, 2\*\*64\)",
    ),
    (
        "hash-ids-mismatch",
        line(hash_ids=[1, 2, 3]),
        r"field 'hash_ids' has 3 ids but input_length 1024 needs 2",
    ),
    ("timestamp-nan", raw("NaN"), r"field 'timestamp' must be a number of milliseconds .*got NaN"),
    ("timestamp-infinity", raw("Infinity"), r"field 'timestamp' .*got Infinity"),
    ("timestamp-minus-infinity", raw("-Infinity"), r"field 'timestamp' .*got -Infinity"),
    ("timestamp-1e999", raw("1e999"), r"field 'timestamp' .*got 1e999"),
    ("timestamp-5000-digits", raw("9" * 5000), r"field 'timestamp' .*got a number of 5000 digits"),
    ("timestamp-negative", line(timestamp=-5), r"field 'timestamp' must be a number of milliseconds"),
    ("timestamp-beyond-2**53", line(timestamp=2**60), r"field 'timestamp' .*\[0, 2\*\*53\]"),
    ("timestamp-string", line(timestamp="now"), r"field 'timestamp' .*got 'now'"),
    ("input-length-zero", line(input_length=0, hash_ids=[1]), r"field 'input_length' must be an integer"),
    ("input-length-huge", line(input_length=MAX_TOKENS + 1), r"field 'input_length' must be an integer in"),
    ("input-length-float", line(input_length=1024.0), r"field 'input_length' must be an integer"),
    ("output-length-negative", line(output_length=-1), r"field 'output_length' must be an integer"),
    ("priority-float", line(priority=1.5), r"field 'priority' must be an int64"),
    ("priority-bool", line(priority=True), r"field 'priority' must be an int64"),
    ("priority-beyond-int64", line(priority=2**63), r"field 'priority' must be an int64"),
    (
        "retention-priority-101",
        line(retention=[directive(priority=101)]),
        r"field 'retention': .*priority 101",
    ),
    (
        "retention-overlap",
        line(retention=[directive(end=600), directive(start=500, end=None)]),
        r"field 'retention': retention directives overlap: \[0, 600\) and \[500, None\)",
    ),
    ("retention-number", line(retention=5), r"field 'retention' must be a list of directives or an object"),
    ("retention-object-unknown", line(retention={"ttl": 3}), r"field 'retention': unknown field 'ttl'"),
    ("directive-unknown", line(retention=[directive(colour=1)]), r"field 'retention': .*unknown field"),
    ("directive-not-object", line(retention=[7]), r"field 'retention': .*expected an object"),
    (
        "two-spellings",
        line(retention=[directive()], retention_directives=[directive()]),
        r"give 'retention' or its RFC #37003 spelling 'retention_directives', not both",
    ),
    (
        "too-many-directives",
        line(retention=[directive(start=i, end=i + 1) for i in range(MAX_DIRECTIVES + 1)]),
        rf"field 'retention' holds {MAX_DIRECTIVES + 1} directives; at most {MAX_DIRECTIVES}",
    ),
    (
        "duration-400-digits",
        line(retention=[directive(duration_s=10**400)]),
        r"field 'retention': directive 0: 'duration_s' .* is out of range",
    ),
    ("duration-negative", line(retention=[directive(duration_s=-1)]), r"field 'retention': .*duration_s"),
    (
        "duration-nan",
        line()[:-1] + ', "retention": [{"start": 0, "priority": 80, "duration_s": NaN}]}',
        r"field 'retention': .*duration_s must be a number of seconds or null, got NaN",
    ),
    ("decode-priority", line(retention={"decode_priority": 101}), r"field 'retention': decode_priority"),
    ("scope-number", line(retention_scope=5), r"field 'retention_scope' must be a non-empty string"),
    ("salt-empty", line(cache_salt=""), r"field 'cache_salt' must be a non-empty string"),
    ("salt-number", line(cache_salt=5), r"field 'cache_salt' must be a non-empty string"),
    ("salt-surrogate", line(cache_salt="\ud800"), r"field 'cache_salt' is not valid Unicode"),
    (
        "salt-too-long",
        line(cache_salt="x" * (MAX_STRING_BYTES + 1)),
        r"field 'cache_salt' is \d+ UTF-8 bytes",
    ),
    ("session-list", line(session_id=["a"]), r"field 'session_id' must be a non-empty string"),
    ("deep-nesting", '{"hash_ids": ' + "[" * 100_000 + "]" * 100_000 + "}", r"JSON nested too deeply"),
    ("not-utf8", line(session_id="s").encode().replace(b'"s"', b'"\xff\xfe"'), r"not UTF-8 text \(byte 0xff"),
    (
        "million-hash-ids",
        line(hash_ids=list(range(1_000_000)), input_length=512 * 1_000_000),
        rf"line longer than {MAX_LINE_BYTES} bytes",
    ),
]

COMMANDS: dict[str, list[str]] = {
    "replay": ["replay", "--json", "--policy", "lru"],
    "simulate": ["simulate", "--json", "--no-progress", "--kv-blocks", "64"],
}


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_clear_line(rc: int, out: str, err: str, pattern: str) -> str:
    assert rc == 2, (rc, err)
    assert out == "", "a partial report reached stdout"
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert len(lines[0]) < 600  # one readable line, not a dump of the input
    import re

    assert re.search(pattern, lines[0]), lines[0]
    return lines[0]


def write(path: Path, second: str | bytes) -> Path:
    first = (line() + "\n").encode()
    body = second if isinstance(second, bytes) else second.encode("utf-8", "surrogatepass")
    path.write_bytes(first + body + b"\n")
    return path


def snapshot(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(("case", "second", "pattern"), LINE_CASES, ids=[c[0] for c in LINE_CASES])
def test_hostile_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
    case: str,
    second: str | bytes,
    pattern: str,
) -> None:
    path = write(tmp_path / "bad.jsonl", second)
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    argv = COMMANDS[command]
    rc, out, err = run_cli([argv[0], str(path), *argv[1:]], capsys)
    msg = assert_one_clear_line(rc, out, err, pattern)
    assert f"{path}:2: " in msg  # names the file and the line
    assert snapshot(tmp_path) == before


def test_at_least_35_hostile_trace_files() -> None:
    assert len(LINE_CASES) + len(FILE_CASES) >= 35


# ---------------------------------------------------------------------------------------------- files
def _empty(tmp: Path) -> Path:
    p = tmp / "empty.jsonl"
    p.write_text("")
    return p


def _blank(tmp: Path) -> Path:
    p = tmp / "blank.jsonl"
    p.write_text("\n  \n\t\n")
    return p


def _directory(tmp: Path) -> Path:
    p = tmp / "dir.jsonl"
    p.mkdir()
    return p


def _missing(tmp: Path) -> Path:
    return tmp / "missing.jsonl"


def _unterminated_long_line(tmp: Path) -> Path:
    p = tmp / "long.jsonl"
    p.write_bytes(b"{" + b" " * (MAX_LINE_BYTES + 10))
    return p


FILE_CASES: list[tuple[str, Callable[[Path], Path], str]] = [
    ("empty-file", _empty, r"empty\.jsonl: no requests in the trace"),
    ("blank-lines-only", _blank, r"blank\.jsonl: no requests in the trace"),
    ("directory", _directory, r"dir\.jsonl is a directory, not a trace file"),
    ("missing", _missing, r"trace file not found: .*missing\.jsonl"),
    ("unterminated-long-line", _unterminated_long_line, r"long\.jsonl:1: line longer than"),
]


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(("case", "make", "pattern"), FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_hostile_file(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
    case: str,
    make: Callable[[Path], Path],
    pattern: str,
) -> None:
    path = make(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    argv = COMMANDS[command]
    rc, out, err = run_cli([argv[0], str(path), *argv[1:]], capsys)
    assert_one_clear_line(rc, out, err, pattern)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["replay", "{trace}", "--limit", "0"], r"argument --limit: must be an integer >= 1, got 0"),
        (["replay", "{trace}", "--limit", "-1"], r"argument --limit: must be an integer >= 1, got -1"),
        (["replay", "--limit", "0"], r"argument --limit: must be an integer >= 1, got 0"),
        (
            ["replay", "{trace}", "--block-tokens", "0"],
            r"--block-tokens.* must be an integer in \[1, 65536\], got 0",
        ),
        (
            ["replay", "{trace}", "--block-tokens", "-1"],
            r"--block-tokens.* must be an integer in \[1, 65536\], got -1",
        ),
        (["replay", "--block-tokens", "0"], r"--block-tokens.* must be an integer in \[1, 65536\], got 0"),
        (["simulate", "{trace}", "--limit", "0"], r"argument --limit: must be an integer >= 1, got 0"),
        (["simulate", "{trace}", "--time-scale", "inf"], r"--time-scale.* must be a finite number > 0"),
        (["simulate", "{trace}", "--time-scale", "nan"], r"--time-scale.* must be a finite number > 0"),
        (["simulate", "{trace}", "--time-scale", "0"], r"--time-scale.* must be a finite number > 0"),
    ],
)
def test_hostile_trace_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], pattern: str
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(line() + "\n")
    rc, out, err = run_cli([a.replace("{trace}", str(trace)) for a in argv], capsys)
    assert_one_clear_line(rc, out, err, pattern)


def test_compare_with_a_hostile_trace_writes_no_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path / "bad.jsonl", line(prio=1))
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli(["compare", str(path), "--no-progress", "--out", "report"], capsys)
    assert_one_clear_line(rc, out, err, r"bad\.jsonl:2: unknown field 'prio'")
    assert not (tmp_path / "report").exists()


@pytest.mark.parametrize(
    ("case", "second", "pattern"),
    [c for c in LINE_CASES if c[0] in {"timestamp-nan", "deep-nesting", "not-utf8", "duration-400-digits"}],
    ids=lambda v: v if isinstance(v, str) and len(v) < 30 else "",
)
def test_no_traceback_through_a_subprocess(
    tmp_path: Path, case: str, second: str | bytes, pattern: str
) -> None:
    path = write(tmp_path / "bad.jsonl", second)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for argv in (["replay", str(path), "--json"], ["simulate", str(path), "--json", "--no-progress"]):
        proc = subprocess.run(
            [sys.executable, "-m", "kvretain", *argv],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
            check=False,
        )
        assert_one_clear_line(proc.returncode, proc.stdout, proc.stderr, pattern)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


def test_compare_out_under_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(line() + "\n")
    (tmp_path / "file").write_text("x")
    rc, out, err = run_cli(
        ["compare", str(trace), "--no-progress", "--out", str(tmp_path / "file" / "r")], capsys
    )
    assert_one_clear_line(rc, out, err, r"--out .*file/r: cannot create the report folder")
    assert sorted(os.listdir(tmp_path)) == ["file", "t.jsonl"]
    assert "'file' is a file" in err or f"'{tmp_path / 'file'}' is a file" in err, err


@pytest.mark.parametrize("out", ["/dev/null", "/dev/null/r", "pipe", "pipe/r"])
def test_compare_out_at_a_device_or_pipe_says_it_is_no_folder(
    out: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `kvretain compare --out /dev/null` said "'/dev/null' is a file"
    monkeypatch.chdir(tmp_path)
    os.mkfifo("pipe")
    rc, out_text, err = run_cli(["compare", "--limit", "5", "--no-progress", "--out", out], capsys)
    kind = "a device" if out.startswith("/dev") else "a named pipe"
    at = out.removesuffix("/r")
    assert_one_clear_line(
        rc,
        out_text,
        err,
        rf"--out {out}: cannot create the report folder \('{at}' is {kind}, not a folder\)$",
    )


@pytest.mark.parametrize("junk", ["\u00a0", "\x0c", "\x1c", "\u2028", "\u3000"])
def test_a_line_of_non_json_whitespace_is_not_a_blank_line(tmp_path: Path, junk: str) -> None:
    # str.strip() took these for a blank line and skipped it silently; JSON's whitespace is " \t\r\n" only
    from kvretain.workloads import TraceError, read_trace

    trace = tmp_path / "t.jsonl"
    trace.write_text(f"{line()}\n{junk}\n{line()}\n", encoding="utf-8")
    with pytest.raises(TraceError, match=r"t\.jsonl:2"):
        read_trace(trace)


@pytest.mark.parametrize("cell", ["1_000", "\uff11\uff12", "+5"])
def test_azure_lengths_are_plain_decimal_integers(tmp_path: Path, cell: str) -> None:
    # int() reads "1_000", "+5" and full-width digits; a CSV length is plain ASCII digits
    import random

    from kvretain.workloads import WorkloadError, load_azure

    csv = tmp_path / "a.csv"
    csv.write_text(
        f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,{cell},5\n", encoding="utf-8"
    )
    with pytest.raises(WorkloadError, match="ContextTokens"):
        load_azure(csv, random.Random(0))


def test_a_gzip_compressed_trace_reads_as_the_plain_one(tmp_path: Path) -> None:
    # published traces ship as .gz; it was refused as "not UTF-8 text (byte 0x8b at column 2)"
    import gzip

    from kvretain.workloads import read_trace

    text = "".join(line(timestamp=t) + "\n" for t in (2, 0, 1))
    plain, packed = tmp_path / "t.jsonl", tmp_path / "t.jsonl.gz"
    plain.write_text(text)
    packed.write_bytes(gzip.compress(text.encode()))
    assert read_trace(packed) == read_trace(plain)
    assert [r.timestamp_ms for r in read_trace(packed, limit=2)] == [0.0, 2.0]


def test_a_cut_or_corrupt_gzip_trace_is_one_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import gzip

    data = gzip.compress("".join(line() + "\n" for _ in range(50)).encode())
    cut, bad = tmp_path / "cut.jsonl.gz", tmp_path / "bad.jsonl.gz"
    cut.write_bytes(data[: len(data) // 2])
    bad.write_bytes(data[:10] + b"\x00" * 20 + data[30:])
    for p in (cut, bad):
        assert main(["replay", str(p), "--capacity-blocks", "8"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{p}: cannot read the trace" in err[0], err


def _read_through_fifo(tmp_path: Path, feed: Callable[[Any], None]) -> list[Any]:
    """``read_trace`` of a named pipe that a thread writes with ``feed(file)`` (unbuffered binary)."""
    import threading

    from kvretain.workloads import read_trace

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def write() -> None:
        with open(fifo, "wb", buffering=0) as fh:
            feed(fh)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        return list(read_trace(fifo))
    finally:
        writer.join(10)
        fifo.unlink()


def test_a_trace_from_a_pipe_is_read(tmp_path: Path) -> None:
    # `kvretain workload export ... --out /dev/stdout | kvretain replay /dev/stdin`, `<(zcat T.gz)`: a pipe was
    # refused as "not a regular file"
    import gzip

    text = "".join(line(timestamp=t) + "\n" for t in range(3))
    for payload in (text.encode(), gzip.compress(text.encode())):

        def feed(fh: Any, data: bytes = payload) -> None:
            fh.write(data)

        assert [r.timestamp_ms for r in _read_through_fifo(tmp_path, feed)] == [0.0, 1.0, 2.0]


def test_a_gzip_trace_from_a_pipe_that_writes_one_byte_first_is_read(tmp_path: Path) -> None:
    # a peek at a pipe returns what its first write brought: one byte of the gzip magic read as "not UTF-8 text"
    # (the first version of the pipe reading, review 34)
    import gzip
    import time

    text = "".join(line(timestamp=t) + "\n" for t in range(3))
    for payload in (gzip.compress(text.encode()), text.encode()):

        def feed(fh: Any, data: bytes = payload) -> None:
            fh.write(data[:1])
            time.sleep(0.3)
            fh.write(data[1:])

        assert [r.timestamp_ms for r in _read_through_fifo(tmp_path, feed)] == [0.0, 1.0, 2.0]


def test_a_gzip_azure_trace_is_named_as_compressed(tmp_path: Path) -> None:
    # it was refused as "not UTF-8 text (byte 0x8b)": true, and no help (the published trace ships as CSV; a user
    # who compressed it, or fetched a .gz, learns what to do)
    import gzip
    import random

    from kvretain.workloads import WorkloadError, load_azure

    csv = tmp_path / "az.csv.gz"
    csv.write_bytes(
        gzip.compress(b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n")
    )
    with pytest.raises(WorkloadError, match=r"az\.csv\.gz: gzip-compressed, not text \(decompress it first"):
        load_azure(csv, random.Random(0))


@pytest.mark.parametrize("column", [1, 2])
def test_an_azure_length_of_thousands_of_digits_names_its_line_and_column(
    tmp_path: Path, column: int
) -> None:
    # int() refuses a string of more than 4,300 digits with Python's own ValueError ("Exceeds the limit (4300
    # digits) for integer string conversion ... use sys.set_int_max_str_digits()"): it reached the user without
    # the file, the line or the column
    import random

    from kvretain.workloads import WorkloadError, load_azure

    cells = ["374", "44"]
    cells[column - 1] = "9" * 5000
    csv = tmp_path / "a.csv"
    csv.write_text(
        f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,{','.join(cells)}\n",
        encoding="utf-8",
    )
    name = ["ContextTokens", "GeneratedTokens"][column - 1]
    with pytest.raises(
        WorkloadError, match=rf"a\.csv:2: column '{name}': must be an integer in .* 5000 digits"
    ):
        load_azure(csv, random.Random(0))


def test_a_path_the_system_cannot_look_up_is_a_trace_error(tmp_path: Path) -> None:
    # read_trace raises TraceError (its contract, what bench/replay_table.py catches); looking a name of more than
    # 255 bytes up raised the OSError "File name too long" from Path.is_dir(): a traceback out of replay_table.py
    from kvretain.workloads import TraceError, read_trace

    with pytest.raises(TraceError, match=r"cannot read the trace: File name too long"):
        read_trace(tmp_path / ("a" * 300))
    res = subprocess.run(
        [sys.executable, str(Path(__file__).parents[1] / "bench" / "replay_table.py"), "--trace", "a" * 300],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "File name too long" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_an_azure_path_the_system_cannot_look_up_is_a_workload_error(tmp_path: Path) -> None:
    # load_azure raises WorkloadError for a file it cannot read (its docstring); a name of more than 255 bytes
    # raised the OSError "File name too long" from Path.is_dir()
    import random

    from kvretain.workloads import WorkloadError, load_azure

    with pytest.raises(WorkloadError, match=r"cannot read the trace: File name too long"):
        load_azure(tmp_path / ("a" * 300), random.Random(0))


AZURE_CSV = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:50.99,396,109\n"
)


def test_replay_of_a_csv_trace_names_the_likely_cause(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `kvretain replay az.csv` (an Azure trace) said only "az.csv:1: not valid JSON (Expecting value at column 1)":
    # a first line that is no JSON and holds commas is named as CSV, with the commands that read an Azure CSV
    csv = tmp_path / "az.csv"
    csv.write_text(AZURE_CSV)
    rc, out, err = run_cli(["replay", str(csv)], capsys)
    msg = assert_one_clear_line(rc, out, err, rf"^kvretain replay: error: {csv}:1: not valid JSON")
    assert "looks like a CSV header" in msg and "Mooncake-format JSONL" in msg
    assert "`kvretain simulate TRACE --workload azure`" in msg
    assert "`kvretain workload export azure --trace TRACE --out TRACE.jsonl`" in msg
    # (the commands the hint gives do read it)
    assert main(["simulate", str(csv), "--workload", "azure", "--no-progress", "--json"]) == 0
    out_jsonl = tmp_path / "az.jsonl"
    assert main(["workload", "export", "azure", "--trace", str(csv), "--out", str(out_jsonl)]) == 0
    assert main(["replay", str(out_jsonl), "--capacity-blocks", "50", "--policy", "lru"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize(
    "first",
    [
        '{"timestamp": 0, "input_length": 1,',  # a cut JSON line: JSON, not CSV
        "[1, 2,",
        "timestamp input_length",  # no comma: no guess
    ],
)
def test_a_bad_first_line_that_is_no_csv_header_gets_no_csv_hint(first: str, tmp_path: Path) -> None:
    from kvretain.workloads import TraceError, read_trace

    path = tmp_path / "t.jsonl"
    path.write_text(first + "\n" + line() + "\n")
    with pytest.raises(TraceError, match=r"t\.jsonl:1: not valid JSON") as err:
        read_trace(path)
    assert "CSV" not in str(err.value)
