"""bench/sensitivity.py: the knob settings, the module-constant override in pool workers, and the CLI end to end
on tiny generated traces (seconds)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvretain.core.policies import protection
from kvretain.workloads import WORKLOADS
from kvretain.workloads.agent_pauses import AgentPausesConfig, generate_agent_pauses
from kvretain.workloads.export import write_mooncake

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import robustness as grid
import sensitivity as sens

BENCH = Path(__file__).resolve().parents[1] / "bench"

FIGURES = sens.FIGURES  # the grid's acceptance figures, per setting


def test_settings_scale_each_knob_with_the_documented_exceptions() -> None:
    got = {s.key: s for s in sens.make_settings(sens.KNOBS)}
    assert next(iter(got)) == "default" and len(got) == 1 + 2 * len(sens.KNOBS)
    assert got["max_reuse_loss=0.5x"].value == 0.01 and got["max_reuse_loss=2x"].value == 0.04
    # the goal's tolerance 1 - goal is scaled, not the goal
    assert got["isolation_goal=0.5x"].value == 0.95 and got["isolation_goal=2x"].value == 0.8
    # a share of the pool: 2 x 0.95 is clamped to 1
    assert got["budget=0.5x"].value == 0.475 and got["budget=2x"].value == 1.0
    assert "clamped" in got["budget=2x"].note
    assert got["SHARDS_SAMPLE=0.5x"].value == protection.SHARDS_SAMPLE // 2
    assert isinstance(got["SHARDS_SAMPLE=2x"].value, int)
    assert got["WINDOW_TURNOVERS=2x"].constants == (("WINDOW_TURNOVERS", 2 * protection.WINDOW_TURNOVERS),)
    assert got["WINDOW_TURNOVERS=2x"].overrides == () and got["budget=2x"].constants == ()
    # the warm-up's scale: 2x is the controller's own shadow size
    assert got["WARMUP_SCALE=2x"].constants == (("WARMUP_SCALE", 2 * protection.WARMUP_SCALE),)


def test_protection_constants_are_restored_and_checked() -> None:
    before = protection.WINDOW_TURNOVERS
    with sens.protection_constants({"WINDOW_TURNOVERS": 99.0}):
        assert protection.WINDOW_TURNOVERS == 99.0
    assert before == protection.WINDOW_TURNOVERS
    with pytest.raises(ValueError, match="BIAS_STEPS"), sens.protection_constants({"BIAS_STEPS": 1}):
        pass


def test_module_constants_reach_the_pool_workers_and_move_the_figures(tmp_path: Path) -> None:
    path = tmp_path / "agents.jsonl"
    write_mooncake(WORKLOADS.create("agent-pauses", rng=random.Random(0), duration_s=300.0), path, 512)
    trace = grid.Trace("agents", str(path), native=True)
    job = grid.Job("policies", trace, "native", 200, ("unified",), ())
    settings = [(), (("WINDOW_TURNOVERS", 64.0),), (("SHARDS_SAMPLE", 16),)]
    jobs = [sens.SensJob(str(i), job, c) for i, c in enumerate(settings)]
    before = {k: getattr(protection, k) for k in sens.CONSTANTS}
    out = {r["setting"]: r for r in grid.run_all(jobs, 2, False, fn=sens.run_sens)}
    default = out["0"]
    assert default["constants_seen"] == before
    assert out["1"]["constants_seen"]["WINDOW_TURNOVERS"] == 64.0
    assert out["2"]["constants_seen"]["SHARDS_SAMPLE"] == 16
    # each override changes what unified does in the worker (the hit ratios are deterministic)
    assert out["1"]["unified"] != default["unified"] and out["2"]["unified"] != default["unified"]
    assert {k: getattr(protection, k) for k in sens.CONSTANTS} == before  # this process untouched


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / "sensitivity.py"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.bench
def test_sensitivity_cli_table_json_and_a_knob_that_moves_a_figure(tmp_path: Path) -> None:
    trace = tmp_path / "tiny.jsonl"
    cfg = AgentPausesConfig(duration_s=200.0, agent_rate=0.1, steps=(2, 4))
    write_mooncake(generate_agent_pauses(cfg, random.Random(0)), trace)
    out = tmp_path / "sens.json"
    res = _run(
        "--quick",
        "--trace",
        str(trace),
        "--capacities",
        "16",
        "48",
        "--knobs",
        "budget",
        "WINDOW_TURNOVERS",
        "--jobs",
        "2",
        "--json",
        str(out),
        "--out",
        str(tmp_path / "report"),
        "--no-progress",
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    last = json.loads(lines[-1])
    keys = ["default", "budget=0.5x", "budget=2x", "WINDOW_TURNOVERS=0.5x", "WINDOW_TURNOVERS=2x"]
    assert list(last) == ["cells", "settings"] and last["cells"] == 2 * 2  # 2 capacities x 2 rules
    assert list(last["settings"]) == keys
    assert all(list(s) == list(FIGURES) for s in last["settings"].values())
    assert any(line.lstrip().startswith("budget") and "clamped to 1" in line for line in lines)
    # half the budget must change the figures on this trace (at 16 blocks the default's protection costs reuse)
    assert last["settings"]["budget=0.5x"] != last["settings"]["default"]
    # one-class runs: the default and WINDOW_TURNOVERS (the balance reads it), not budget
    assert last["settings"]["budget=2x"]["one_class_min_vs_lru"] is None
    assert last["settings"]["WINDOW_TURNOVERS=2x"]["one_class_min_vs_lru"] is not None
    doc = json.loads(out.read_text())
    assert doc["summary"] == last
    assert [s["key"] for s in doc["settings"]] == keys
    assert all(len(doc["cells"][k]) == 4 for k in keys)
    cell = doc["cells"]["WINDOW_TURNOVERS=2x"][0]
    assert {"lru", "unified", "isolation", "class0_target", "misses"} <= set(cell)
    assert cell["constants_seen"]["WINDOW_TURNOVERS"] == 2 * protection.WINDOW_TURNOVERS
    assert all(c["unified"] for c in doc["one_class"]["default"]) and doc["one_class"]["budget=2x"] == []


@pytest.mark.bench
def test_sensitivity_through_ray_gives_the_process_pools_figures_with_the_overrides_in_the_workers(
    tmp_path: Path,
) -> None:
    pytest.importorskip("ray", reason="the ray extra is not installed")
    trace = tmp_path / "tiny.jsonl"
    cfg = AgentPausesConfig(duration_s=200.0, agent_rate=0.1, steps=(2, 4))
    write_mooncake(generate_agent_pauses(cfg, random.Random(0)), trace)
    docs = []
    for name, backend in (("pool", []), ("ray", ["--ray", "local"])):
        out = tmp_path / f"{name}.json"
        argv = ["--quick", "--trace", str(trace), "--capacities", "16", "48", "--knobs", "WINDOW_TURNOVERS"]
        res = _run(
            *argv, "--jobs", "2", *backend, "--json", str(out), "--out", str(tmp_path), "--no-progress"
        )
        assert res.returncode == 0, res.stderr
        docs.append(json.loads(out.read_text()))
    pool, ray = docs
    assert ray["summary"] == pool["summary"]
    for key, cells in pool["cells"].items():
        order = sorted(cells, key=lambda c: (c["rule"], c["capacity"]))
        assert sorted(ray["cells"][key], key=lambda c: (c["rule"], c["capacity"])) == order, key
    seen = {c["constants_seen"]["WINDOW_TURNOVERS"] for c in ray["cells"]["WINDOW_TURNOVERS=2x"]}
    assert seen == {2 * protection.WINDOW_TURNOVERS}  # the module constant overridden in the Ray worker


def test_bad_knob_is_one_line_and_status_2(tmp_path: Path) -> None:
    res = _run("--quick", "--trace", str(tmp_path / "none.jsonl"), "--knobs", "no_such_knob")
    assert res.returncode == 2 and res.stdout == ""
    assert len(res.stderr.strip().splitlines()) == 1 and "no_such_knob" in res.stderr
    res = _run("--held-out", "--trace", str(tmp_path / "mine.jsonl"))
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [
        "sensitivity: error: --held-out and --trace exclude each other"
    ]


@pytest.mark.bench
def test_sensitivity_reads_a_trace_of_16_token_hash_ids_with_block_tokens(tmp_path: Path) -> None:
    """The knob sensitivity runs the grid's cells on ``--trace`` files as the grid does; a file of 16 tokens an id
    was refused with a pointer to ``--block-tokens``, an option this bench did not have."""
    trace = tmp_path / "tiny16.jsonl"
    cfg = AgentPausesConfig(duration_s=200.0, agent_rate=0.1, steps=(2, 4))
    write_mooncake(generate_agent_pauses(cfg, random.Random(0)), trace, 16)
    out = tmp_path / "sens.json"
    argv = ["--quick", "--trace", str(trace), "--knobs", "budget", "--no-one-class", "--no-progress"]
    res = _run(*argv, "--capacities", "400", "--out", str(tmp_path / "report"))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    res = _run(
        *argv, "--block-tokens", "16", "--capacities", "400", "--json", str(out), "--out", str(tmp_path)
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(out.read_text())
    assert (
        doc["config"]["block_tokens"] == 16 and json.loads(res.stdout.strip().splitlines()[-1])["cells"] == 2
    )
