"""bench/adversarial.py: a user's mistake is one line and status 2, ``--list`` names every trace, a tiny real
run (the first few hundred requests of two traces) writes a JSON file its last line agrees with, and the
figures depend neither on the run nor on ``--jobs`` (seconds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPT = BENCH / "adversarial.py"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import adversarial  # noqa: E402

SUMMARY_KEYS = [
    "cells",
    "min_overall_vs_lru",
    "cells_below_floor",
    "cells_class0_below_lru",
    "cells_class0_below_lru_resolved",
    "one_class_min_vs_lru",
    "one_class_below_lru",
]
# one trace with two classes, one with one class: every claim has a figure
TINY = ["c0-follows-lag50", "oneclass-stack", "--limit", "400", "--fractions", "0.2", "0.8", "--no-progress"]


def _run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=timeout, check=False
    )


def _refused(res: subprocess.CompletedProcess[str], says: str) -> None:
    """Exit status 2, nothing on stdout, one line on stderr that starts ``adversarial:`` and holds ``says``."""
    assert "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, (res.returncode, res.stderr)
    assert lines[0].startswith("adversarial: ") and says in lines[0], lines[0]
    assert res.stdout == "", res.stdout


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["no-such-trace"], "unknown trace 'no-such-trace'"),
        (["c0-scan", "--fractions", "0"], "argument --fractions"),
        (["c0-scan", "--fractions", "1.5"], "argument --fractions"),
        (["c0-scan", "--fractions", "nan"], "argument --fractions"),
        (["c0-scan", "--jobs", "0"], "argument --jobs"),
        (["c0-scan", "--limit", "-3"], "argument --limit"),
        (["c0-scan", "--json", ""], "argument --json"),
        (["c0-scan", "--json", "{missing}/out.json"], "does not exist"),
        (["c0-scan", "--json", "{folder}"], "it is a folder"),
    ],
)
def test_a_users_mistake_is_one_line_and_status_2(tmp_path: Path, argv: list[str], says: str) -> None:
    (tmp_path / "folder").mkdir()
    paths = {"missing": str(tmp_path / "missing"), "folder": str(tmp_path / "folder")}
    _refused(_run(*(a.format(**paths) for a in argv)), says)
    assert not (tmp_path / "missing").exists()


def test_list_names_every_trace_once() -> None:
    res = _run("--list")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    names = [line.split()[0] for line in res.stdout.splitlines()]
    assert names == list(adversarial.TRACES)
    assert len(names) == 31 and len(set(names)) == 31
    for line in res.stdout.splitlines():
        assert len(line.split(None, 1)) == 2, line  # a description on every line


def test_a_generator_gives_the_same_requests_twice() -> None:
    for name in ("c0-scan", "five-levels-s11", "c0-follows-lag200-s31", "oneclass-alt100-s41"):
        first = adversarial.generate(name)
        assert first == adversarial.generate(name), name
        assert len(first) >= 4000
        assert [r.hashes for r in adversarial.build(name, 50)] == [
            r.hashes for r in adversarial.build(name)[:50]
        ]


def _tiny(tmp_path: Path, *extra: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    out = tmp_path / "cells.json"
    res = _run(*TINY, "--json", str(out), *extra)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "\r" not in res.stderr  # no progress bar with --no-progress
    last = json.loads(res.stdout.strip().splitlines()[-1])
    return json.loads(out.read_text()), last, res.stdout


@pytest.mark.bench
def test_a_tiny_run_writes_cells_that_agree_with_its_last_line(tmp_path: Path) -> None:
    doc, last, text = _tiny(tmp_path)
    assert list(last) == SUMMARY_KEYS and doc["summary"] == last
    cells = doc["cells"]
    assert [(c["trace"], c["fraction"]) for c in cells] == [
        ("c0-follows-lag50", 0.2),
        ("c0-follows-lag50", 0.8),
        ("oneclass-stack", 0.2),
        ("oneclass-stack", 0.8),
    ]
    assert last["cells"] == len(cells) == 4
    for c in cells:
        assert c["requests"] == 400 and c["capacity"] == max(64, round(c["fraction"] * c["distinct"]))
        for p in adversarial.POLICIES:
            assert 0.0 <= c["overall"][p] <= 1.0
            assert c["hit_blocks"][p] == round(c["overall"][p] * c["blocks"])
        assert c["overall_diff_blocks"] == c["hit_blocks"]["unified"] - c["hit_blocks"]["lru"]
        assert c["paired_all"]["diff_hits"] == c["overall_diff_blocks"]
        assert 0.5 < c["overall_vs_lru"] < 2.0
        if c["trace"] == "c0-follows-lag50":
            assert c["classes"] == [0, 1] and 0.5 < c["class0_vs_lru"] < 2.0
            assert 0.5 < c["oneclass"]["vs_lru"] < 2.0
            assert c["class0_paired"]["diff_hits"] == (
                c["class0_hit_blocks"]["unified"] - c["class0_hit_blocks"]["lru"]
            )
        else:
            assert c["classes"] == [0] and "class0" not in c and "oneclass" not in c
        assert set(c["resolved"]) <= set(c["misses"]) <= {"a", "b", "c"}
    ratios = [c["overall_vs_lru"] for c in cells]
    assert last["min_overall_vs_lru"] == _round_down(min(ratios))  # (never up: 0.97996 is not 0.98)
    assert last["cells_below_floor"] == sum(r < 0.98 for r in ratios)
    c0 = [c["class0_vs_lru"] for c in cells if "class0" in c]
    assert last["cells_class0_below_lru"] == sum(r < 1.0 for r in c0)
    assert last["cells_class0_below_lru_resolved"] <= last["cells_class0_below_lru"]
    one = [c["oneclass"]["vs_lru"] if "oneclass" in c else c["overall_vs_lru"] for c in cells]
    assert last["one_class_min_vs_lru"] == _round_down(min(one))
    assert last["one_class_below_lru"] == sum(r < 1.0 for r in one)
    assert "== c0-follows-lag50:" in text and "== oneclass-stack:" in text


@pytest.mark.bench
def test_the_figures_do_not_depend_on_jobs(tmp_path: Path) -> None:
    runs = []
    for jobs in ("1", "2"):
        folder = tmp_path / f"jobs{jobs}"
        folder.mkdir()
        runs.append(_tiny(folder, "--jobs", jobs))
    (one, last1, _), (two, last2, _) = runs
    assert last1 == last2
    assert one["cells"] == two["cells"] and one["traces"] == two["traces"]


def _round_down(x: float) -> float:
    sys.path.insert(0, str(SCRIPT.parent))
    import robustness  # (the grid's rule, which the adversarial summary calls)

    return float(robustness.round_down(x))
