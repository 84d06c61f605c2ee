"""Mistakes a review of the command line found (session 28): each is one line on stderr, exit status 2, no
traceback; a setting that would make a file the readers refuse, or run out of memory, is refused up front."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvretain.cli import main


def one_line(capsys: pytest.CaptureFixture[str], *words: str) -> str:
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


SIM = ["simulate", "--workload", "multi-tenant", "--limit", "20", "--no-progress"]


@pytest.mark.parametrize("body", ["models = 1", "gpus = [1, 2]"])
def test_a_catalog_whose_tables_are_not_tables_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str
) -> None:
    cat = tmp_path / "c.toml"
    cat.write_text(body + "\n")
    assert main([*SIM, "--catalog", str(cat)]) == 2
    one_line(capsys, "--catalog", "must be a table of named entries")


@pytest.mark.parametrize("field", ["peak_flops = inf", "mem_bandwidth = nan"])
def test_a_gpu_entry_that_is_not_finite_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str
) -> None:
    cat = tmp_path / "c.toml"
    rest = {"peak_flops": "1e15", "mem_bandwidth": "3e12"}
    rest.pop(field.split(" ")[0])
    lines = ["[gpus.g]", field, *(f"{k} = {v}" for k, v in rest.items()), "mem_bytes = 68719476736"]
    cat.write_text("\n".join(lines) + "\n")
    assert main([*SIM, "--catalog", str(cat), "--gpu", "g"]) == 2
    one_line(capsys, "must be a finite number")


def test_a_gpu_so_slow_that_the_clock_would_overflow_is_refused_when_the_catalog_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # finite, positive and absurd: the steps were priced at inf, the table printed nan and inf (later: one
    # line after the run about the simulated clock; now the catalog's bounds refuse it before any run)
    cat = tmp_path / "c.toml"
    cat.write_text("[gpus.g]\npeak_flops = 1e-300\nmem_bandwidth = 1e-300\nmem_bytes = 68719476736\n")
    assert main([*SIM, "--catalog", str(cat), "--gpu", "g"]) == 2
    one_line(capsys, "GPU 'g'", "field 'peak_flops' must be in [1e+09, 1e+18] FLOP/s", "got 1e-300")


GPU_OK = {"peak_flops": "1e15", "mem_bandwidth": "3e12", "mem_bytes": "68719476736"}
MODEL_OK = {"n_layers": "2", "d_model": "64", "n_q_heads": "4", "n_kv_heads": "2", "head_dim": "16"}
MODEL_OK |= {"ffn_dim": "96", "vocab_size": "128"}


@pytest.mark.parametrize(
    ("table", "field", "value", "says"),
    [
        ("gpus", "peak_flops", "1e-300", "[1e+09, 1e+18] FLOP/s"),
        ("gpus", "peak_flops", "1e+30", "[1e+09, 1e+18] FLOP/s"),
        ("gpus", "mem_bandwidth", "0.001", "[1e+08, 1e+15] B/s"),
        ("gpus", "mem_bytes", "80", "[1048576, 1125899906842624] bytes"),
        ("gpus", "compute_efficiency", "1e-300", "[0.001, 1]"),
        ("gpus", "bandwidth_efficiency", "1e-09", "[0.001, 1]"),
        ("gpus", "step_overhead_s", "1e+300", "[0, 10] s"),
        ("gpus", "link_bandwidth", "1e-300", "[1e+06, 1e+15] B/s"),
        ("gpus", "allreduce_latency_s", "3600", "[0, 1] s"),
        ("models", "n_layers", "1000000000", "[1, 10000]"),
        ("models", "vocab_size", "99999999999", "[1, 16777216]"),
        ("models", "bytes_per_param", "1024", "[1, 8]"),
        ("models", "tp", "100000", "[1, 1024]"),
    ],
)
def test_an_implausible_catalog_number_is_one_line_naming_field_value_and_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], table: str, field: str, value: str, says: str
) -> None:
    # accepted before: peak_flops = 1e-300 reported "simulated 1.79e302 s" and e2e_mean_s inf, with status 0
    entry = {**(GPU_OK if table == "gpus" else MODEL_OK), field: value}
    cat = tmp_path / "c.toml"
    cat.write_text(f"[{table}.x]\n" + "".join(f"{k} = {v}\n" for k, v in entry.items()))
    pick = ["--gpu", "x"] if table == "gpus" else ["--model", "x"]
    assert main([*SIM, "--catalog", str(cat), *pick, "--kv-blocks", "100"]) == 2
    one_line(capsys, f"field {field!r} must be in {says} (a plausible range), got {value}")


def test_the_builtin_catalog_is_within_the_bounds() -> None:
    from kvretain.engine.sim.catalog import builtin_catalog

    cat = builtin_catalog()
    assert cat.models and cat.gpus


def test_standard_output_that_cannot_be_written_is_one_line() -> None:
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "kvretain", "policies"], stdout=full, stderr=subprocess.PIPE, text=True
        )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "cannot write to standard output" in done.stderr


@pytest.mark.parametrize("argv", [["--help"], ["replay", "--help"], ["--version"]])
def test_help_that_cannot_be_written_is_one_line_and_status_2(argv: list[str]) -> None:
    """argparse ignores a failed write of its help: ``--help >/dev/full`` printed nothing and exited 0."""
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "kvretain", *argv], stdout=full, stderr=subprocess.PIPE, text=True
        )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "cannot write to standard output" in done.stderr


def test_help_still_reaches_standard_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvretain replay") and "--policy" in out


@pytest.mark.parametrize(
    ("option", "words"),
    [
        ("chat_system_tokens=20000000", "at most 16,777,216 tokens"),
        ("chat_system_tokens=99999999999", "at most 16,777,216 tokens"),  # (generating it ran out of memory)
        ("batch_priority=99999999999999999999999", "int64 request priority"),
        (
            "chat_system_tokens=16777000",
            "each must be at most 16,777,216",
        ),  # each setting fits, the request not
    ],
)
def test_export_refuses_settings_whose_requests_the_readers_refuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, words: str
) -> None:
    out = tmp_path / "w.jsonl"
    argv = ["workload", "export", "multi-tenant", "--out", str(out), "--limit", "2", "--option", option]
    argv += ["--option", "batch_job_rate=0", "--option", "agent_rate=0"]
    assert main(argv) == 2
    one_line(capsys, words)
    assert not out.exists()


def test_a_setting_given_twice_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SIM, "--slo=0=0.001:0.001,0=100:100"]) == 2
    one_line(capsys, "class 0 is given twice")
    out = tmp_path / "w.jsonl"
    argv = ["workload", "export", "multi-tenant", "--out", str(out), "--option", "duration_s=1"]
    assert main([*argv, "--option", "duration_s=2"]) == 2
    one_line(capsys, "'duration_s' is given twice")


def test_trace_messages_name_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "t.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1], "session_id": "a'
    )  # (cut off)
    assert main(["replay", str(bad), "--capacity-blocks", "10"]) == 2
    assert " at at " not in one_line(capsys, "not valid JSON")
    folder = tmp_path / "adir"
    folder.mkdir()
    out = tmp_path / "w.jsonl"
    assert main(["workload", "export", "azure", "--trace", str(folder), "--out", str(out)]) == 2
    one_line(capsys, "is a folder")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["replay", "--policy", "lru", "--budget", "0.3"], ["--budget", "unified", "--policy lru"]),
        (["replay", "--policy", "s3fifo", "--ghost-factor", "2"], ["--ghost-factor", "unified and lfu"]),
        ([*SIM, "--policy", "lru", "--no-adapt-frequency"], ["--no-adapt-frequency", "--policy lru"]),
        ([*SIM, "--policy", "lfu", "--frequency-exponent", "1"], ["--frequency-exponent", "--policy lfu"]),
        (
            ["replay", "--policy", "arc", "--priority-mapping", "0:0,1:100"],
            ["--priority-mapping", "unified and priority", "--policy arc"],
        ),
        (
            [*SIM, "--policy", "lru", "--priority-mapping", "step=20"],
            ["--priority-mapping", "unified and priority", "--policy lru"],
        ),
        (
            ["compare", "--workload", "multi-tenant", "--policies", "lru,arc", "--isolation-goal", "0.5"],
            ["--isolation-goal", "--policies lru,arc", "--budgets runs set their own"],
        ),
    ],
)
def test_a_policy_setting_that_no_policy_run_reads_is_refused(
    capsys: pytest.CaptureFixture[str], argv: list[str], words: list[str]
) -> None:
    # it was ignored silently: `replay --policy lru --budget 0.3` ran plain lru as if the budget mattered
    assert main([*argv, "--capacity-blocks", "50"] if argv[0] == "replay" else argv) == 2
    one_line(capsys, *words)


def test_a_policy_setting_that_a_run_reads_is_taken(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["replay", "--policy", "lfu", "--ghost-factor", "2", "--capacity-blocks", "50", "--json"]) == 0
    )
    assert (
        main(["replay", "--policy", "unified", "--budget", "0.3", "--capacity-blocks", "50", "--json"]) == 0
    )
    assert main(["replay", "--policy", "all", "--budget", "0.3", "--capacity-blocks", "50", "--json"]) == 0
    out, _ = capsys.readouterr()
    assert out.count('"policy": "unified"') == 2 and '"policy": "lfu"' in out
    mapped = ["--priority-mapping", "0:0,1:100", "--capacity-blocks", "50", "--json"]
    assert main(["replay", "--policy", "priority", *mapped]) == 0
    out, _ = capsys.readouterr()
    assert main(["replay", "--policy", "priority", "--capacity-blocks", "50", "--json"]) == 0
    plain, _ = capsys.readouterr()
    assert json.loads(out)["classes"] != json.loads(plain)["classes"]  # (read: it reverses the classes)


def test_gpu_mem_util_where_it_sizes_nothing_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # --kv-blocks fixes the pool: --gpu-mem-util changed nothing (the JSON was byte-identical at 0.01 and 0.5)
    assert main([*SIM, "--kv-blocks", "3000", "--gpu-mem-util", "0.5"]) == 2
    one_line(capsys, "--gpu-mem-util", "--kv-blocks")
    # compare sizes its pool on the protected requests' peak working set unless --kv-blocks is given
    argv = ["compare", "--workload", "multi-tenant", "--limit", "200", "--no-progress"]
    argv += ["--out", str(tmp_path)]
    assert main([*argv, "--gpu-mem-util", "0.5"]) == 2
    one_line(capsys, "--gpu-mem-util", "peak working set")
    assert list(tmp_path.iterdir()) == []
    # where it sizes the pool it is read
    assert main([*SIM, "--json", "--gpu-mem-util", "0.5"]) == 0
    half = json.loads(capsys.readouterr().out)
    assert main([*SIM, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_blocks_per_replica"] > half["kv_blocks_per_replica"]


@pytest.mark.parametrize("command", ["simulate", "compare"])
def test_a_router_with_one_replica_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    # one replica takes every request whatever the router: `--router prefix-affinity` (or any) with --replicas 1
    # (the default) changed nothing (the JSON byte-identical across the four routers), as --gpu-mem-util with
    # --kv-blocks, and was read silently
    argv = [command, "--workload", "multi-tenant", "--limit", "20", "--no-progress"]
    argv += ["--json"] if command == "simulate" else ["--out", str(tmp_path / "r")]
    assert main([*argv, "--router", "prefix-affinity"]) == 2
    one_line(capsys, "--router", "--replicas")
    assert main([*argv, "--router", "round-robin", "--replicas", "1"]) == 2
    one_line(capsys, "--router", "--replicas")
    assert not (tmp_path / "r").exists()
    if command == "simulate":  # where there are replicas to choose between it is read; left out, no question
        assert main([*argv, "--router", "round-robin", "--replicas", "2"]) == 0
        assert json.loads(capsys.readouterr().out)["router"] == "round-robin"
        assert main(argv) == 0
        assert json.loads(capsys.readouterr().out)["router"] == "least-loaded"


def test_compare_says_which_bound_sized_its_pool(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # the pool is the protected requests' peak working set (an even share of it a replica), or the largest
    # request's blocks where that is more: "1,270 KV blocks per replica: the peak working set of the requests at
    # protected retention priority" named a peak of 128 blocks (43 a replica of 3) by the largest request's 1,270
    import math
    import random

    from kvretain.workloads import WORKLOADS, working_set

    reqs = WORKLOADS.create("multi-tenant", rng=random.Random(0), limit=200, time_scale=1.0)
    peak = math.ceil(working_set([r for r in reqs if r.priority == 0]).peak_tokens / 16)
    largest = max(math.ceil((len(r.prompt) + r.output_len) / 16) for r in reqs)
    assert largest > peak  # (the case)
    argv = [
        "compare",
        "--workload",
        "multi-tenant",
        "--limit",
        "200",
        "--policies",
        "lru",
        "--budgets",
        "0.5",
    ]
    argv += ["--no-progress", "--replicas", "3", "--out", str(tmp_path / "r")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"{largest:,} KV blocks per replica: the largest request's" in err, err
    assert (
        f"peak working set of the requests at protected retention priority ({math.ceil(peak / 3):,} blocks a replica)"
        in err
    )
    assert f"{largest:,} KV blocks per replica: the largest" in (tmp_path / "r" / "summary.md").read_text()


def test_compare_help_names_its_own_kv_blocks_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "KV blocks per replica (default: the peak working set" in text


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "--sessions", "5", "--capacity-blocks", "50", "--policy", "lru", "--json"],
        ["simulate", "--workload", "multi-tenant", "--no-progress", "--json"],
    ],
    ids=["replay", "simulate"],
)
def test_limit_reads_1e1_as_workload_export_does(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    # `--limit 1e1` was "invalid int value" here and 10 requests in `workload export`
    assert main([*argv, "--limit", "1e1"]) == 0
    a = json.loads(capsys.readouterr().out)
    assert main([*argv, "--limit", "10"]) == 0
    b = json.loads(capsys.readouterr().out)
    assert a["requests"] == b["requests"] == 10


def test_compare_report_counts_rejected_requests(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # every request rejected at admission (one KV block): the report said nothing of them but in summary.json
    import csv

    argv = ["compare", "--workload", "multi-tenant", "--limit", "20", "--no-progress", "--kv-blocks", "1"]
    assert main([*argv, "--policies", "lru", "--budgets", "0.5", "--out", str(tmp_path / "r")]) == 0
    rows = list(csv.DictReader((tmp_path / "r" / "runs.csv").open()))
    assert [(r["label"], r["requests"], r["rejected"]) for r in rows] == [
        ("lru", "0", "20"),
        ("unified-b0.5", "0", "20"),
    ]
    table = (tmp_path / "r" / "summary.md").read_text()
    assert "| preempt | rejected |" in table
    # no lookup: no hit ratio ("-"), and every request sent missed its SLO (0.000, not "-")
    assert "| lru | 0 | 0.00 | - | 0 | 0 | 20 | - | - | - | 0.000 |" in table


def test_a_time_scale_beyond_the_clocks_resolution_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # `--time-scale 1e16` ran, and every latency read 0 (a step's milliseconds rounded away at 1e19 s)
    assert main([*SIM, "--time-scale", "1e16"]) == 2
    one_line(capsys, "beyond 6.872e+10 s", "--time-scale")
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 1000, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n')
    assert main(["simulate", str(trace), "--no-progress", "--time-scale", "1e13"]) == 2
    one_line(capsys, "beyond 6.872e+10 s")
    assert main(["simulate", str(trace), "--no-progress", "--json", "--time-scale", "1e6"]) == 0
    assert json.loads(capsys.readouterr().out)["classes"]["0"]["ttft_mean_s"] > 0
    # Unix-epoch milliseconds, slowed down 6x: far inside the clock's resolution
    epoch = tmp_path / "epoch.jsonl"
    epoch.write_text(
        '{"timestamp": 1700000000000, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n'
    )
    assert main(["simulate", str(epoch), "--no-progress", "--json", "--time-scale", "6"]) == 0
    assert json.loads(capsys.readouterr().out)["classes"]["0"]["ttft_mean_s"] > 0


@pytest.mark.parametrize(
    ("argv", "prog"),
    [
        (["replay", "--bogus"], "kvretain replay"),
        (["simulate", "--limit", "3", "--bogus", "x"], "kvretain simulate"),
        (["workload", "export", "multi-tenant", "--out", "x.jsonl", "--bogus"], "kvretain workload export"),
    ],
)
def test_an_unknown_option_is_named_by_its_subcommand(
    capsys: pytest.CaptureFixture[str], argv: list[str], prog: str
) -> None:
    # "kvretain: error: unrecognized arguments: --bogus (see kvretain --help)": the help without the
    # subcommand's options
    assert main(argv) == 2
    line = one_line(capsys, "unrecognized arguments: --bogus")
    assert line.startswith(f"{prog}: error:") and line.endswith(f"(see {prog} --help)")
