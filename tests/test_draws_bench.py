"""bench/draws.py: the grid's cells over fresh seeds of a generator (one small draw end to end; the summary and
listing on cells built here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPT = BENCH / "draws.py"
KEYS = [
    "cells",
    "min_overall_vs_lru",
    "cells_class0_target_met",
    "cells_class0_below_lru",
    "cells_class0_below_lru_resolved",
    "min_class0_vs_lru",
    "configurations",
    "configurations_class0_below_lru_resolved",
]
ONE_KEYS = [
    "one_class_runs",
    "one_class_min_vs_lru",
    "one_class_below_lru",
    "one_class_below_lru_resolved",
    "one_class_configurations_below_lru_resolved",
    "one_class_at_least_rivals",
]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=300, check=False
    )


def _draws() -> Any:
    sys.path.insert(0, str(BENCH))
    import draws

    return draws


@pytest.mark.bench
def test_one_draw_gives_the_grids_cells_and_the_summary_last(tmp_path: Path) -> None:
    out = tmp_path / "d" / "draws.json"
    res = _run(
        "--workloads", "agent-pauses", "--seeds", "100-101", "--capacities", "500", "--rules", "native",
        "random-50%", "--jobs", "2", "--json", str(out), "--no-progress",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    last = json.loads(res.stdout.strip().splitlines()[-1])
    assert list(last) == KEYS and last["cells"] == 2 * 2  # 2 seeds x 2 rules x 1 capacity
    assert last["configurations"] == 2  # (each rule's two draws together)
    doc = json.loads(out.read_text())
    assert doc["summary"] == last and doc["config"]["seeds"] == [100, 101]
    assert sorted((c["seed"], c["rule"]) for c in doc["cells"]) == [
        (100, "native"), (100, "random-50%"), (101, "native"), (101, "random-50%"),
    ]  # fmt: skip
    cell = doc["cells"][0]
    # the grid's cell: both policies, the isolation reference, class 0 request by request, the verdicts
    assert {"lru", "unified", "isolation", "class0_paired", "class0_target", "misses"} <= set(cell)
    assert "s3fifo" not in cell and cell["workload"] == "agent-pauses"
    below = sum(1 for c in doc["cells"] if "class 0 < lru" in c["misses"])
    assert last["cells_class0_below_lru"] == below
    assert last["cells_class0_target_met"] == sum(1 for c in doc["cells"] if c["class0_target_met"])
    # the two seeds are two different traces (not one trace twice)
    seeds = {c["seed"]: c["lru"]["overall"] for c in doc["cells"] if c["rule"] == "native"}
    assert seeds[100] != seeds[101]
    assert "ties alone read resolved on about 5% of the cells" in res.stdout


@pytest.mark.parametrize("bad", ["9-3", "x", "-2", "1-y"])
def test_a_bad_seed_range_is_one_line_and_status_2(bad: str) -> None:
    res = _run("--seeds", bad, "--no-progress")
    assert res.returncode == 2
    assert res.stderr.strip().startswith("draws: error: argument --seeds") and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_seed_ranges() -> None:
    d = _draws()
    assert d.seed_range("100-129") == (100, 129) and d.seed_range("7") == (7, 7)


def _cell(seed: int, c0: float, diff: int, se: float, overall: float = 1.0) -> dict[str, Any]:
    d = _draws()
    cell = {
        "workload": "multi-tenant",
        "seed": seed,
        "rule": "native",
        "capacity": 2972,
        "lru": {"overall": 0.5, "class0": 0.5},
        "unified": {"overall": 0.5 * overall, "class0": c0},
        d.grid.ISO: 0.5,
        "class0_paired": dict(
            diff_hits=diff, base_hits=1000, se_hits=se, z=diff / se, differ=9, requests=100, z_bound=3.0
        ),
    }
    d.grid.analyse_cell(cell)
    return cell


def test_only_resolved_losses_and_floor_misses_are_listed() -> None:
    d = _draws()
    cells = [
        _cell(100, 0.49, -20, 10.0),  # resolved (z -2)
        _cell(101, 0.49, -10, 10.0),  # inside the noise (z -1)
        _cell(102, 0.55, 30, 10.0),  # above lru
        _cell(103, 0.55, 30, 10.0, overall=0.97),  # a floor miss
    ]
    s = d.summarise(cells)
    assert s["cells"] == 4 and s["cells_class0_below_lru"] == 2 and s["cells_class0_below_lru_resolved"] == 1
    assert s["min_class0_vs_lru"] == 0.98 and s["min_overall_vs_lru"] == 0.97
    lines = d.listing(cells)
    assert len(lines) == 2
    assert "seed 100" in lines[0] and "class 0 < lru" in lines[0] and lines[0].endswith(": resolved")
    assert "seed 103" in lines[1] and "overall < 0.98x lru" in lines[1] and "class 0 < lru" not in lines[1]
    row = d.table(cells).splitlines()[-1]
    assert "2 (1)" in row  # (one group: 4 cells, 2 below lru, 1 resolved)


def test_a_loss_no_draw_resolves_is_resolved_when_the_draws_are_pooled() -> None:
    # four draws of one configuration, each -10 hit blocks at z -1 (none resolved): together -40 at z -2
    d = _draws()
    cells = [_cell(100 + k, 0.49, -10, 10.0) for k in range(4)]
    assert d.pooled(cells) == (-40, pytest.approx(-2.0))
    s = d.summarise(cells)
    assert s["cells_class0_below_lru_resolved"] == 0
    assert s["configurations"] == 1 and s["configurations_class0_below_lru_resolved"] == 1
    assert d.table(cells).splitlines()[-1].rstrip().endswith("-40 (-2.00)")
    # gains and losses of the same size cancel: not a systematic loss
    mixed = [_cell(100, 0.49, -10, 10.0), _cell(101, 0.51, 10, 10.0)]
    assert d.pooled(mixed) == (0, 0.0) and d.summarise(mixed)["configurations_class0_below_lru_resolved"] == 0
    # two configurations (another capacity) are two rows
    other = {**_cell(104, 0.49, -10, 10.0), "capacity": 5384}
    assert d.summarise([*cells, other])["configurations"] == 2


@pytest.mark.bench
def test_one_class_runs_alone_give_acceptance_2s_figures(tmp_path: Path) -> None:
    out = tmp_path / "one.json"
    res = _run(
        "--workloads", "agent-pauses", "--seeds", "100-101", "--capacities", "500", "--rules", "--one-class",
        "--jobs", "2", "--json", str(out), "--no-progress",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    last = json.loads(res.stdout.strip().splitlines()[-1])
    assert list(last) == [*KEYS, *ONE_KEYS] and last["cells"] == 0 and last["one_class_runs"] == 2
    doc = json.loads(out.read_text())
    assert doc["cells"] == [] and len(doc["one_class"]) == 2 and doc["config"]["one_class"] is True
    run = doc["one_class"][0]
    assert {"lru", "s3fifo", "arc", "unified", "paired", "vs_lru"} <= set(run) and run["rule"] == "one-class"
    beats = sum(
        1
        for r in doc["one_class"]
        if r["unified"]["overall"] >= max(r["s3fifo"]["overall"], r["arc"]["overall"])
    )
    assert last["one_class_at_least_rivals"] == beats
    assert last["one_class_min_vs_lru"] == pytest.approx(min(r["vs_lru"] for r in doc["one_class"]), abs=1e-4)


def test_no_rule_and_no_one_class_is_one_line_and_status_2() -> None:
    res = _run("--rules", "--no-progress")
    assert res.returncode == 2 and "nothing to run" in res.stderr and "Traceback" not in res.stderr
