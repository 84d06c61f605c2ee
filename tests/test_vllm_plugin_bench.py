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


def test_hook_times_name_each_hook_and_the_controller_inside_the_lookup(tmp_path: Path) -> None:
    trace = tmp_path / "small.jsonl"
    cfg = AgentPausesConfig(duration_s=120.0, agent_rate=0.2, steps=(2, 4))
    write_mooncake(generate_agent_pauses(cfg, random.Random(0)), trace)
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1] / "src")}
    res = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--trace",
            str(trace),
            "--requests",
            "60",
            "--pool-blocks",
            "2048",
            "--repeats",
            "1",
            "--hook-times",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    last = json.loads(res.stdout.strip().splitlines()[-1])
    hooks = last["hook_us_per_step"]
    # every hook the run queue has is counted; a run that releases and looks up spends time in both
    assert {"release", "lookup", "pop (eviction)", "lookup: of which the protection controller"} <= set(hooks)
    assert hooks["release"] > 0 and hooks["lookup"] > 0
    # the controller runs inside the lookup hook
    assert hooks["lookup: of which the protection controller"] <= hooks["lookup"]
    assert "plugin hooks, CPU us per step" in res.stdout
    # the counted run is a third run: the timed runs (one of each) ran without the counters
    assert len(last["stock_step_ms_runs"]) == 1 and len(last["plugin_step_ms_runs"]) == 1
    timed = next(line for line in res.stdout.splitlines() if line.startswith("plugin counters: "))
    assert "hook_us_per_step" not in timed


def test_options_are_not_abbreviated() -> None:
    # the timed children get the parent's arguments less --hook-times: an abbreviation would slip through
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--hook", "--trace", "/nonexistent.jsonl"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 2 and "unrecognized arguments: --hook" in res.stderr
