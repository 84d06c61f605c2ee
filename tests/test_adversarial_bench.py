"""bench/adversarial.py: a user's mistake is one line and status 2, ``--list`` names every trace, a tiny real
run (the first few hundred requests of two traces) writes a JSON file its last line agrees with, and the
figures depend neither on the run nor on ``--jobs`` (seconds); session 43's fresh set (``--set fresh``): each
generator deterministic per seed, sized and in time order, and the shape its docstring publishes, checked on its
own output."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from itertools import pairwise
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


# ------------------------------------------------------------------- session 43's fresh set (--set fresh)
# Each generator's published shape, checked on its own output through the notes it can write (one per request).
FRESH_SIZES = (4000, 6000)
MAX_BLOCKS = 60  # a prompt's blocks, a flood's aside


def _fresh(gen: Any, seed: int, n: int) -> tuple[list[Any], list[dict[str, Any]]]:
    notes: list[dict[str, Any]] = []
    reqs = gen(seed=seed, n=n, notes=notes)
    assert len(notes) == len(reqs)
    return reqs, notes


def test_the_fresh_set_is_its_own_list_and_leaves_the_default_alone() -> None:
    res = _run("--set", "fresh", "--list")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    names = [line.split()[0] for line in res.stdout.splitlines()]
    assert names == list(adversarial.FRESH) and not set(names) & set(adversarial.TRACES)
    assert len(names) == 2 * len(adversarial.FRESH_SHAPES) >= 12  # two seeds a shape
    for shape, (_, seeds, _) in adversarial.FRESH_SHAPES.items():
        assert [f"{shape}-s{k}" for k in seeds] == [n for n in names if n.rsplit("-s", 1)[0] == shape]
    _refused(_run("branching-s51"), "unknown trace 'branching-s51'")  # not in the default set
    _refused(
        _run("--set", "fresh", "c0-scan"), "unknown trace 'c0-scan' (see adversarial --set fresh --list)"
    )
    _refused(_run("--set", "nope"), "argument --set")


def test_every_fresh_trace_is_seeded_sized_and_in_time_order() -> None:
    seen: dict[str, list[Any]] = {}
    for name in adversarial.FRESH:
        reqs = adversarial.generate(name)
        assert reqs == adversarial.generate(name), name
        assert FRESH_SIZES[0] <= len(reqs) <= FRESH_SIZES[1], name
        ts = [t for _, _, t in reqs]
        assert all(b > a for a, b in pairwise(ts)) and ts[0] > 0, name
        assert {p for _, p, _ in reqs} == {0, 1}, name
        long = [b for b, _, _ in reqs if not 4 <= len(b) <= MAX_BLOCKS]
        assert not long or name.startswith("summarize-floods"), name
        seen[name] = reqs
    for shape, (_, (s1, s2), _) in adversarial.FRESH_SHAPES.items():
        assert seen[f"{shape}-s{s1}"] != seen[f"{shape}-s{s2}"], shape


@pytest.mark.parametrize("seed", adversarial.FRESH_SHAPES["branching"][1])
def test_branching_sends_each_turn_as_branches_and_continues_one(seed: int) -> None:
    reqs, notes = _fresh(adversarial.g_branching, seed, 3000)
    turns: dict[tuple[int, int], list[int]] = {}
    for i, nt in enumerate(notes):
        turns.setdefault((nt["session"], nt["turn"]), []).append(i)
    complete = {k: v for k, v in turns.items() if v[-1] < len(reqs) - 1}  # (the last may be cut)
    for (sid, turn), idx in complete.items():
        assert idx == list(range(idx[0], idx[0] + len(idx))) and 2 <= len(idx) <= 8  # back to back
        ctx = notes[idx[0]]["context"]
        head = reqs[idx[0]][0][:ctx]
        suffixes = [reqs[i][0][ctx:] for i in idx]
        assert all(reqs[i][0][:ctx] == head for i in idx)  # the shared context
        assert all(1 <= len(s) <= 3 for s in suffixes)
        assert len({b for s in suffixes for b in s}) == sum(map(len, suffixes))  # each branch its own blocks
        assert len({reqs[i][1] for i in idx}) == 1
        if turn:
            prev = turns[(sid, turn - 1)]
            chosen = reqs[prev[notes[idx[0]]["follows"]]][0]
            assert len(chosen) < ctx and head[: len(chosen)] == chosen  # continues the chosen branch
    sessions = {nt["session"]: reqs[i][1] for i, nt in enumerate(notes)}
    share0 = sum(c == 0 for c in sessions.values()) / len(sessions)
    assert len(sessions) > 150 and 0.15 < share0 < 0.35


@pytest.mark.parametrize("seed", adversarial.FRESH_SHAPES["lora-tenants"][1])
def test_lora_tenants_read_one_corpus_under_disjoint_ids(seed: int) -> None:
    reqs, notes = _fresh(adversarial.g_lora_tenants, seed, 5000)
    copies: dict[tuple[int, int], list[int]] = {}
    for (blocks, prio, _), nt in zip(reqs, notes, strict=True):
        assert prio == (0 if nt["tenant"] == 0 else 1)  # class 0 is the premium tenant
        copy = blocks[3 : 3 + nt["doc_blocks"]]
        assert copies.setdefault((nt["tenant"], nt["doc"]), copy) == copy  # a tenant's copy is fixed
        assert 1 <= len(blocks) - 3 - len(copy) <= 3  # then a question
    tenants = sorted({t for t, _ in copies})
    assert tenants == [0, 1, 2, 3]
    shared = 0
    for doc in {d for _, d in copies}:
        mine = [copies[(t, doc)] for t in tenants if (t, doc) in copies]
        assert len({len(c) for c in mine}) == 1  # the same text ...
        assert len({b for c in mine for b in c}) == sum(map(len, mine))  # ... under disjoint ids
        shared += len(mine) > 1
    assert shared > 50  # documents many tenants read
    c0 = {b for b, p, _ in reqs if p == 0 for b in b}
    assert not c0 & {b for b, p, _ in reqs if p == 1 for b in b}
    share0 = sum(p == 0 for _, p, _ in reqs) / len(reqs)
    assert 0.15 < share0 < 0.25
    tops = [
        Counter(nt["doc"] for nt in notes if nt["tenant"] == t).most_common(10) for t in tenants
    ]  # a popularity of each tenant's own
    assert len({tuple(d for d, _ in top) for top in tops}) > 1


@pytest.mark.parametrize("seed", adversarial.FRESH_SHAPES["code-repo"][1])
def test_code_repo_commits_change_the_prefix_from_their_depth_on(seed: int) -> None:
    reqs, notes = _fresh(adversarial.g_code_repo, seed, 5000)
    versions: dict[int, list[int]] = {}
    depth: dict[int, int] = {}
    for (blocks, prio, _), nt in zip(reqs, notes, strict=True):
        prefix = blocks[: nt["prefix"]]
        assert 30 <= len(prefix) <= 50 and versions.setdefault(nt["version"], prefix) == prefix
        depth[nt["version"]] = nt["depth"]
        rest = len(blocks) - len(prefix)
        assert 3 <= rest <= 7 if prio == 0 else 5 <= rest <= 10  # a short suffix, a long file
    order = sorted(versions)  # (a version no request saw is missing)
    assert sum(w == v + 1 for v, w in pairwise(order)) > 10  # commits land in the trace
    before: set[int] = set()
    for v, w in pairwise(order):
        d, old, new = depth[w], versions[v], versions[w]
        assert new[d:] and not set(new[d:]) & (before | set(old))  # new blocks from the depth on
        assert w > v + 1 or new[:d] == old[:d]  # the same before it
        before |= set(old)
    assert len({depth[v] for v in order[1:]}) > 5  # at random depths
    share0 = sum(p == 0 for _, p, _ in reqs) / len(reqs)
    assert 0.55 < share0 < 0.75
    ts = [t for _, p, t in reqs if p == 0]
    gaps = [b - a for a, b in pairwise(ts)]
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert cv > 1.3  # bursty: a Poisson stream's is 1


@pytest.mark.parametrize("seed", adversarial.FRESH_SHAPES["diurnal-mix"][1])
def test_diurnal_mix_drifts_the_class_share_and_the_rate(seed: int) -> None:
    reqs, notes = _fresh(adversarial.g_diurnal_mix, seed, 5000)
    tenth = len(reqs) // 10

    def share0(part: list[Any]) -> float:
        return sum(p == 0 for _, p, _ in part) / len(part)

    assert share0(reqs[:tenth]) < 0.15 and share0(reqs[-tenth:]) < 0.15
    assert share0(reqs[len(reqs) // 2 - tenth // 2 : len(reqs) // 2 + tenth // 2]) > 0.35
    assert notes[0]["share0"] < notes[len(reqs) // 2]["share0"] > notes[-1]["share0"]
    hours = [(t % 86400) / 3600 for _, _, t in reqs]
    day = sum(12 <= h < 16 for h in hours)
    night = sum(0 <= h < 4 for h in hours)
    assert day > 2 * night > 0  # a day-like rate
    assert reqs[-1][2] > 86400  # over more than a day
    c0 = {b for b, p, _ in reqs if p == 0 for b in b}
    assert not c0 & {b for b, p, _ in reqs if p == 1 for b in b}  # each class its own working set


@pytest.mark.parametrize("seed", adversarial.FRESH_SHAPES["summarize-floods"][1])
def test_summarize_floods_bursts_one_off_prompts_sized_to_the_pool(seed: int) -> None:
    reqs, notes = _fresh(adversarial.g_summarize_floods, seed, 5000)
    kinds = Counter(nt["kind"] for nt in notes)
    assert set(kinds) == {"chat", "rag", "flood"} and kinds["chat"] + kinds["rag"] == 5000
    distinct = len({b for blocks, _, _ in reqs for b in blocks})  # (ids are behind one prefix each: hashes)
    pool = round(0.2 * distinct)
    others = Counter(
        b for (blocks, _, _), nt in zip(reqs, notes, strict=True) if nt["kind"] != "flood" for b in blocks
    )
    bursts: dict[int, list[int]] = {}
    for i, nt in enumerate(notes):
        if nt["kind"] == "flood":
            bursts.setdefault(nt["burst"], []).append(i)
    assert len(bursts) == 4
    instr = {reqs[i][0][0] for idx in bursts.values() for i in idx}
    assert len(instr) == 1  # one instruction block heads every flood prompt
    new: set[int] = set()
    for idx in bursts.values():
        assert idx == list(range(idx[0], idx[0] + len(idx)))  # back to back
        assert reqs[idx[-1]][2] - reqs[idx[0]][2] < 5.0  # a short burst
        assert all(reqs[i][1] == 1 and len(reqs[i][0]) > MAX_BLOCKS for i in idx)
        blocks = [b for i in idx for b in reqs[i][0][1:]]
        assert len(set(blocks)) == len(blocks) and not set(blocks) & (new | set(others))  # one-off
        new |= set(blocks)
        assert 0.29 <= len(blocks) / pool <= 0.91
    last: dict[int, list[int]] = {}
    for (blocks, prio, _), nt in zip(reqs, notes, strict=True):
        if nt["kind"] == "chat":
            assert prio == 0 and len(blocks) <= MAX_BLOCKS
            prev = last.get(nt["session"])
            assert prev is None or (
                len(prev) < len(blocks) and blocks[: len(prev)] == prev
            )  # a growing context
            last[nt["session"]] = blocks
        elif nt["kind"] == "rag":
            assert prio == 1


@pytest.mark.parametrize("seed", adversarial.FRESH_SHAPES["agent-loop"][1])
def test_agent_loop_grows_contexts_and_compacts_them(seed: int) -> None:
    reqs, notes = _fresh(adversarial.g_agent_loop, seed, 5000)
    shared = reqs[0][0][:12]
    assert all(blocks[:12] == shared for blocks, _, _ in reqs)  # the tool schema heads every prompt
    steps: dict[int, list[int]] = {}
    for i, nt in enumerate(notes):
        steps.setdefault(nt["task"], []).append(i)
    last_read = {x: i for i, (blocks, _, _) in enumerate(reqs) for x in blocks}
    dead: list[tuple[int, set[int]]] = []  # (from request i, blocks never read again)
    compactions = 0
    for idx in steps.values():
        assert [notes[i]["step"] for i in idx] == list(range(len(idx)))
        assert len({reqs[i][1] for i in idx}) == 1
        for a, b in pairwise(idx):
            old, cur, head = reqs[a][0], reqs[b][0], notes[b]["head"]
            assert cur[:head] == old[:head]
            if notes[b]["compacted"]:
                compactions += 1
                assert len(old) + 9 > MAX_BLOCKS and 3 <= len(cur) - head <= 6
                dead.append((b, set(old[head:])))
            else:
                assert 2 <= len(cur) - len(old) <= 9 and cur[: len(old)] == old  # a step adds to the context
    assert compactions > 20
    assert all(last_read[x] < i for i, gone in dead for x in gone)  # the history is never read again
    done = [idx for idx in steps.values() if idx[-1] < len(reqs) // 2]  # tasks over well before the end
    assert all(len(idx) <= 15 if reqs[idx[0]][1] == 0 else len(idx) >= 15 for idx in done)
