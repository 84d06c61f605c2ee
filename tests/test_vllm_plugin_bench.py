"""``bench/vllm_plugin.py`` end to end on a small trace it makes itself: stock and plugin replays through vLLM
0.33's real scheduler agree run to run, and ``--hook-times`` says where the plugin's time per step goes. Run by
``scripts/test_vllm.sh`` in ``.venv-vllm``."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed in this environment; scripts/test_vllm.sh runs these tests in .venv-vllm",
)

from kvretain.workloads.agent_pauses import AgentPausesConfig, generate_agent_pauses
from kvretain.workloads.export import write_mooncake

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "vllm_plugin.py"


def _small_trace(tmp_path: Path) -> Path:
    trace = tmp_path / "small.jsonl"
    cfg = AgentPausesConfig(duration_s=120.0, agent_rate=0.2, steps=(2, 4))
    write_mooncake(generate_agent_pauses(cfg, random.Random(0)), trace)
    return trace


def _run(*args: str, tmpdir: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1] / "src")}
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
    )


def _bench(trace: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """The bench on ``trace`` with its own empty temporary folder, which it must leave empty (each child writes
    its model's config there)."""
    tmp = trace.parent / f"tmp-{len(list(trace.parent.glob('tmp-*')))}"
    tmp.mkdir()
    res = _run("--trace", str(trace), "--requests", "60", "--pool-blocks", "2048", *extra, tmpdir=tmp)
    assert res.returncode != 0 or not any(tmp.iterdir()), (
        f"left behind: {sorted(p.name for p in tmp.iterdir())}"
    )
    return res


def test_hook_times_name_each_hook_and_the_controller_inside_its_hooks(tmp_path: Path) -> None:
    res = _bench(_small_trace(tmp_path), "--repeats", "1", "--hook-times")
    assert res.returncode == 0, res.stderr[-2000:]
    last = json.loads(res.stdout.strip().splitlines()[-1])
    hooks = last["hook_us_per_step"]
    # every hook the run queue has is counted; a run that releases and looks up spends time in both
    arrival = "arrival (input processing, not in the step)"
    ctl_label = "of arrival and lookup: the protection controller"
    assert {"release", "lookup", "pop (eviction)", arrival, ctl_label} <= set(hooks)
    assert hooks["release"] > 0 and hooks["lookup"] > 0 and hooks[arrival] > 0
    # the controller runs inside the arrival and lookup hooks, and its parts inside the controller
    ctl = hooks[ctl_label]
    assert ctl <= hooks["lookup"] + hooks[arrival]
    parts = [v for k, v in hooks.items() if k.startswith("controller: ")]
    assert len(parts) == 3 and hooks["controller: spatial sample"] > 0 and sum(parts) <= ctl
    # input processing is timed apart from the step, for stock and plugin, and the whole cost set beside it
    assert last["plugin_input_us_per_step"] > last["stock_input_us_per_step"] > 0
    assert last["step_plus_input_vs_stock"] > 0
    assert "plugin hooks, CPU us per step" in res.stdout
    # the counted run is a third run: the timed runs (one of each) ran without the counters
    assert len(last["stock_step_ms_runs"]) == 1 and len(last["plugin_step_ms_runs"]) == 1
    timed = next(line for line in res.stdout.splitlines() if line.startswith("plugin counters: "))
    assert "hook_us_per_step" not in timed


def test_lockstep_pairs_replay_what_separate_runs_replay(tmp_path: Path) -> None:
    """The default pairing runs stock and plugin in turns of a few steps: it must not change what either replays
    (hit tokens, steps, preemptions equal to the sequential runs'), and its ratio is the pairs' median."""
    trace = _small_trace(tmp_path)
    lock = _bench(trace, "--repeats", "2", "--turn-steps", "3")  # (turns that end inside the replay)
    seq = _bench(trace, "--repeats", "1", "--sequential")
    assert lock.returncode == 0, lock.stderr[-2000:]
    assert seq.returncode == 0, seq.stderr[-2000:]
    a = json.loads(lock.stdout.strip().splitlines()[-1])
    b = json.loads(seq.stdout.strip().splitlines()[-1])
    assert a["pairing"] == "lockstep" and b["pairing"] == "sequential"
    for key in ("stock_hit_tokens", "plugin_hit_tokens", "stock_steps", "plugin_steps", "plugin_preemptions"):
        assert a[key] == b[key], key
    assert a["stock_steps"] > 10 and sum(a["plugin_hit_tokens"].values()) > 0
    pairs = a["step_time_vs_stock_pairs"]
    assert len(pairs) == 2 and abs(a["step_time_vs_stock"] - (pairs[0] + pairs[1]) / 2) <= 1e-4  # (rounded)
    assert "pair 1: plugin / stock step time" in lock.stdout
    assert len(b["step_time_vs_stock_pairs"]) == 1 and "pair 0" not in seq.stdout


def test_options_are_not_abbreviated() -> None:
    # the timed children get the parent's arguments less --hook-times: an abbreviation would slip through
    res = _run("--hook", "--trace", "/nonexistent.jsonl")
    assert res.returncode == 2 and "unrecognized arguments: --hook" in res.stderr


def test_bad_options_are_a_usage_error_before_any_child_starts() -> None:
    res = _run("--options", "bogus=1", "--trace", str(SCRIPT))
    assert res.returncode == 2 and "--options" in res.stderr and "bogus" in res.stderr
    assert "Traceback" not in res.stderr
    res = _run("--turn-steps", "0", "--trace", str(SCRIPT))
    assert res.returncode == 2 and "argument --turn-steps: must be an integer >= 1" in res.stderr


def test_stock_arrival_work_leaves_stock_replaying_what_it_replays(tmp_path: Path) -> None:
    """``--stock-arrival-work``: stock does the plugin's arrival work and discards it; what it replays (hits,
    steps, preemptions) is unchanged, and the JSON says the option was on."""
    trace = _small_trace(tmp_path)
    plain = _bench(trace, "--repeats", "1", "--sequential")
    worked = _bench(trace, "--repeats", "1", "--sequential", "--stock-arrival-work")
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert worked.returncode == 0, worked.stderr[-2000:]
    a = json.loads(plain.stdout.strip().splitlines()[-1])
    b = json.loads(worked.stdout.strip().splitlines()[-1])
    assert not a["stock_arrival_work"] and b["stock_arrival_work"]
    for key in ("stock_hit_tokens", "plugin_hit_tokens", "stock_steps", "stock_preemptions"):
        assert a[key] == b[key], key


def test_a_class_that_never_hits_has_no_ratio_and_the_last_line_is_json(tmp_path: Path) -> None:
    # 0/0 read Infinity: class 1 "infinitely better than stock", and the last line was not JSON
    res = _bench(_small_trace(tmp_path), "--priority-rule", "none", "--repeats", "1")
    assert res.returncode == 0, res.stderr[-2000:]
    last = json.loads(
        res.stdout.strip().splitlines()[-1], parse_constant=lambda c: pytest.fail(f"{c} in JSON")
    )
    assert last["class1_hit_tokens_vs_stock"] is None
    assert last["class0_hit_tokens_vs_stock"] is not None
