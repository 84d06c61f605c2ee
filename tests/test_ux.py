"""Newcomer-facing behaviour (issue 11, defects 15, 17-19 and acceptance 5): dead code gone, docs and packaging
that describe what exists, help and hints that work, progress only on a terminal, honest compare reports and
plots, test scripts that say what they are doing."""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvretain.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--limit", "40", "--kv-blocks", "1500"]


# ---------------------------------------------------------------- 15: dead code
def test_dead_code_is_gone() -> None:
    import kvretain.core.retention as retention
    import kvretain.engine.sim.executor as executor
    from kvretain.core.block_pool import BlockPool
    from kvretain.core.kv_cache_manager import KVCacheManager
    from kvretain.sched.request import Request

    assert not hasattr(KVCacheManager, "cache_computed")
    assert not hasattr(retention, "DEFAULT_RETENTION")
    assert not hasattr(executor, "EXECUTORS")
    assert not hasattr(Request, "sort_key")
    assert not hasattr(BlockPool, "get_num_allocatable")


# ---------------------------------------------------------------- 17: a true map, no phantom extras
def test_architecture_map_names_only_modules_that_exist() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert "engine.torch" not in text and "`server`" not in text
    layers = text.split("\n\n")[1]
    assert "`workloads`" in layers and "`replay`" in layers
    for name in set(re.findall(r"`(kvretain(?:\.\w+)+)", text)):
        assert importlib.util.find_spec(name) is not None, (
            f"docs/architecture.md names {name}, which is missing"
        )


def test_pyproject_has_no_phantom_extras_and_an_spdx_license() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = meta["project"]
    assert set(project["optional-dependencies"]) == {"xxhash", "plots", "vllm", "ray", "dev"}
    assert project["license"] == "Apache-2.0"  # the SPDX form: no setuptools deprecation warning
    assert "setuptools>=77" in meta["build-system"]["requires"]  # the first that reads it
    assert "PyTorch engine" not in project["description"]


# ---------------------------------------------------------------- 18: newcomer friction
def test_install_hints_work_from_a_clone() -> None:
    texts = [(ROOT / "README.md").read_text(), *(p.read_text() for p in (ROOT / "src").rglob("*.py"))]
    for text in texts:
        assert "pip install 'kvretain[" not in text and "pip install kvretain[" not in text


def test_the_readme_counts_the_lines_of_the_listings_it_names() -> None:
    # the README said `kvretain workload list` prints seven lines; it printed six (one a workload)
    from kvretain.core.policy import policy_names
    from kvretain.workloads import WORKLOADS

    words = {6: "six", 7: "seven", 8: "eight", 9: "nine"}
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"`kvretain workload list`'s {words[len(WORKLOADS.names())]} lines" in readme
    assert f"`kvretain policies`' {words[len(policy_names())]}" in readme


def test_compare_report_folder_is_ignored_by_git() -> None:
    assert "/report/" in (ROOT / ".gitignore").read_text().splitlines()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_help_has_no_internal_text_and_every_option_has_help() -> None:
    parser = build_parser()
    subs = _subparsers(parser)
    assert set(subs) == {"replay", "policies", "simulate", "compare", "workload", "profile"}
    nested = {f"workload {k}": v for k, v in _subparsers(subs.pop("workload")).items()}
    assert set(nested) == {"workload export", "workload list"}
    for name, sub in {**subs, **nested}.items():
        text = sub.format_help()
        assert "SIM_POLICY_DEFAULTS" not in text and "docstring" not in text, name
        for action in sub._actions:
            assert action.help and action.help.strip(), f"kvretain {name} {action.option_strings} has no help"


def test_replay_loads_none_of_the_simulator() -> None:
    # `kvretain replay` / `policies` build only their own parsers: the simulator's modules stay unloaded
    code = (
        "import sys; from kvretain.cli import main; main(['policies']); "
        "print(sorted(m for m in sys.modules if m.startswith(('kvretain.engine', 'kvretain.cli_'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "['kvretain.cli_args']"
    assert set(_subparsers(build_parser("replay"))) == {"replay", "policies"}
    assert "simulate" in _subparsers(build_parser("simulate"))


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from kvretain import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvretain {__version__}"


def test_replay_has_no_progress(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--sessions", "3", "--policy", "lru", "--no-progress", "--json"]) == 0
    assert capsys.readouterr().err == ""


def test_no_progress_bar_when_stderr_is_not_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # capsys's stderr is not a terminal: neither compare's bar over the runs nor a run's bar may be drawn
    argv = ["compare", *SMALL, "--policies", "lru", "--budgets", "0.5", "--out", str(tmp_path / "r")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "%|" not in err and "run/s" not in err and "req/s" not in err, err


def test_compare_without_matplotlib_claims_no_plots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "r"
    argv = ["compare", *SMALL, "--policies", "lru", "--budgets", "0.5", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    wrote = next(line for line in captured.out.splitlines() if line.startswith("wrote"))
    assert "plots" not in wrote and ".png" not in wrote
    assert "no plots written" in captured.err and "pip install -e '.[plots]'" in captured.err
    assert sorted(p.name for p in out.iterdir()) == ["runs.csv", "summary.json", "summary.md"]


def test_compare_without_matplotlib_leaves_no_older_plots_in_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # a report written again into the same folder without matplotlib kept the earlier run's frontier.png and
    # ttft_by_class.png beside the new summary.json: plots of other runs, read as this report's
    pytest.importorskip("matplotlib")
    out = tmp_path / "r"
    argv = ["compare", *SMALL, "--policies", "lru", "--out", str(out), "--no-progress"]
    assert main([*argv, "--budgets", "0.5"]) == 0
    (out / "notes.txt").write_text("mine\n")
    assert {"frontier.png", "ttft_by_class.png"} <= {p.name for p in out.iterdir()}
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main([*argv, "--budgets", "0.2"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "runs.csv", "summary.json", "summary.md"]
    assert "unified-b0.2" in (out / "summary.md").read_text()
    capsys.readouterr()


# ---------------------------------------------------------------- 19: compare's report
def _fake_result(label: str, budget: float | None, c0_mean: float, paid: int) -> dict[str, Any]:
    return {
        "label": label,
        "budget": budget,
        "output_tokens_per_s": 192.8,  # identical everywhere: must not look like a trade-off
        "hit_rate": 0.5,
        "classes": {
            "0": {
                "ttft_mean_s": c0_mean,
                "ttft_p99_s": 3 * c0_mean,
                "recomputed_tokens": 10,
                "hit_rate": 0.2,
            },
            "2": {"ttft_mean_s": 1.0, "ttft_p99_s": 2.0, "recomputed_tokens": paid, "hit_rate": 0.7},
        },
    }


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """The matplotlib figures the code under test closes (drawn, not shown), in order: their axes are read back;
    closed after the test (kept open, they added up to matplotlib's warning of more than 20 open figures)."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    close = plt.close
    drawn: list[Any] = []
    monkeypatch.setattr(plt, "close", drawn.append)
    yield drawn
    for fig in drawn:
        close(fig)


def test_frontier_plot_is_honest(tmp_path: Path, figures: list[Any]) -> None:
    from matplotlib.ticker import ScalarFormatter

    from kvretain.cli_sim import _plots

    results = [
        _fake_result("lru", None, 3.0, 1_000_000),
        _fake_result("unified", None, 2.0, 1_100_000),
        _fake_result("unified-b0.1", 0.1, 2.5, 1_050_000),
        _fake_result("unified-b0.2", 0.2, 2.5, 1_050_000),  # same result as 0.1: one shared label
        _fake_result("unified-b0.8", 0.8, 1.5, 1_300_000),
    ]
    ttfts = {"lru": {"0": [0.5, 0.1, 0.3]}, "unified": {"0": [0.2, 0.4]}}
    assert _plots(tmp_path, results, ttfts, ["lru", "unified"]) == ["ttft_by_class.png", "frontier.png"]
    # the TTFT CDF is drawn in steps (a sloped line between two samples showed TTFTs no request had)
    cdf = [line for line in figures[0].axes[0].get_lines() if line.get_label() == "lru"]
    assert len(cdf) == 1 and cdf[0].get_drawstyle() == "steps-post"
    assert list(cdf[0].get_xdata()) == [0.1, 0.3, 0.5]
    left, mid, right = figures[-1].axes
    for ax in (left, mid, right):
        for axis in (ax.xaxis, ax.yaxis):
            fmt = axis.get_major_formatter()
            if isinstance(fmt, ScalarFormatter):
                assert not fmt.get_useOffset(), "offset notation hides the scale"
    assert "lower is better" in left.get_ylabel() and "lower is better" in left.get_xlabel()
    assert "higher is better" in mid.get_ylabel() and "lower is better" in right.get_ylabel()
    assert "class 2" in left.get_xlabel()  # the least important class pays
    assert sorted(t.get_text() for t in left.texts) == ["b=0.1, 0.2", "b=0.8"]
    # the anchors are drawn above the frontier line, so that a coinciding marker stays visible
    zorders = {line.get_label(): line.get_zorder() for line in left.lines}
    assert zorders["unified"] > zorders["unified, fixed budget b"]
    # what every class gets and pays
    for ax in (mid, right):
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["class 0", "class 2"]


def test_a_class_with_one_ttft_is_visible_in_the_cdf(tmp_path: Path, figures: list[Any]) -> None:
    # one request in a class (`compare --limit 5`): its CDF was a step line of one point, which draws nothing, so
    # the panel showed a legend over an empty plot
    from kvretain.cli_sim import _plots

    results = [_fake_result("lru", None, 3.0, 1_000_000), _fake_result("unified-b0.5", 0.5, 2.0, 1_100_000)]
    _plots(tmp_path, results, {"lru": {"0": [0.5], "2": [0.1, 0.3]}}, ["lru"])
    (one,) = [ln for ln in figures[0].axes[0].get_lines() if ln.get_label() == "lru"]
    assert list(one.get_xdata()) == [0.5] and one.get_marker() not in ("None", "", None)
    (two,) = [ln for ln in figures[0].axes[1].get_lines() if ln.get_label() == "lru"]
    assert list(two.get_xdata()) == [0.1, 0.3] and two.get_drawstyle() == "steps-post"


def test_a_lone_ttft_that_coincides_with_another_policys_stays_visible(
    tmp_path: Path, figures: list[Any]
) -> None:
    # `compare` of a one-request trace: lru, priority and unified each drew its lone TTFT as a marker of one size
    # at the same point, and only unified's (drawn last) showed
    from kvretain.cli_sim import _plots

    policies = ["lru", "priority", "unified"]
    results = [_fake_result(p, None, 3.0, 1_000_000) for p in policies]
    _plots(tmp_path, results, {p: {"0": [0.18], "2": [0.1, 0.3]} for p in policies}, policies)
    marks = {ln.get_label(): ln for ln in figures[0].axes[0].get_lines()}
    sizes = [marks[p].get_markersize() for p in policies]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 3, sizes


def test_a_dozen_classes_fit_the_report_figures(tmp_path: Path, figures: list[Any]) -> None:
    # `compare` of a trace with priorities 0-11: the TTFT CDFs were one row of 12 panels (6,000 px wide), the bar
    # panels' 12-column legends ran over the neighbouring panels and the bars (matplotlib warned on stderr that
    # tight_layout could not apply), and classes 10 and 11 had the bar colours of classes 0 and 1
    import warnings

    from matplotlib.colors import to_rgba

    from kvretain.cli_sim import _plots

    classes = [str(c) for c in range(12)]

    def result(label: str, budget: float | None, scale: float) -> dict[str, Any]:
        per = {
            c: {"ttft_mean_s": scale * (1 + k % 5), "recomputed_tokens": 1000 * k, "hit_rate": 0.05 * k}
            for k, c in enumerate(classes)
        }
        per["5"]["ttft_mean_s"] = (
            1.7 * scale * (1 + 5 % 5) * (2.0 if budget else 1.0)
        )  # a tall bar under the legend
        return {"label": label, "budget": budget, "output_tokens_per_s": 1.0, "hit_rate": 0.5, "classes": per}

    results = [result("lru", None, 1.0), result("unified", None, 1.0), result("unified-b0.5", 0.5, 1.0)]
    ttfts = {"lru": {c: [0.1, 0.2 * (k + 1)] for k, c in enumerate(classes)}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the tight_layout warning reached the user's terminal)
        _plots(tmp_path, results, ttfts, ["lru", "unified"])
    cdf = figures[0]
    shown = [ax for ax in cdf.axes if ax.get_visible()]
    assert [ax.get_title() for ax in shown] == [f"class {c}: TTFT CDF" for c in classes]
    width, height = cdf.get_size_inches()
    assert width <= 20 and width / height <= 3, (width, height)  # in rows, not one strip
    fig = figures[-1]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes[1:]:
        legend = ax.get_legend()
        box, panel = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert panel.x0 <= box.x0 and box.x1 <= panel.x1, (ax.get_title(), box, panel)
        bars = [b for b in ax.patches if b.get_height() > 0]
        assert not any(box.overlaps(b.get_window_extent(renderer)) for b in bars), ax.get_title()
        shades = {to_rgba(h.get_facecolor()) for h in legend.legend_handles}
        assert len(shades) == len(classes), ax.get_title()


def test_classes_beyond_a_legend_are_told_apart_by_a_colour_scale(tmp_path: Path, figures: list[Any]) -> None:
    # a trace whose requests each carry their own priority (300 classes): each bar panel's legend of 300 entries
    # ran off the figure over the panels beside it, and matplotlib's tight_layout warning reached stderr
    import warnings

    from kvretain.cli_sim import _plots

    classes = [str(c) for c in range(30)]

    def result(label: str, budget: float | None) -> dict[str, Any]:
        per = {
            c: {"ttft_mean_s": 1.0 + k, "recomputed_tokens": k, "hit_rate": 0.02 * k}
            for k, c in enumerate(classes)
        }
        return {"label": label, "budget": budget, "output_tokens_per_s": 1.0, "hit_rate": 0.5, "classes": per}

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _plots(tmp_path, [result("lru", None), result("unified-b0.5", 0.5)], {}, ["lru"])
    fig = figures[-1]
    _, mid, right, *scales = fig.axes
    assert mid.get_legend() is None and right.get_legend() is None
    assert len(scales) == 2  # a colour scale beside each bar panel, its ends named
    for scale in scales:
        assert [t.get_text() for t in scale.get_yticklabels()] == [
            f"class {classes[0]}",
            f"class {classes[-1]}",
        ]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [ax.get_tightbbox(renderer) for ax in fig.axes]
    width = fig.bbox.width
    assert all(b.x0 >= 0 and b.x1 <= width for b in boxes), [(b.x0, b.x1) for b in boxes]


def test_a_one_class_trade_off_panel_has_no_negative_tokens_and_a_plain_title(
    tmp_path: Path, figures: list[Any]
) -> None:
    # `compare` of a one-request trace: the panel was titled "what class 0 gains against what class 0 pays", and
    # with no run recomputing a token its axis of recomputed tokens ran from -0.06 to 0.06 million
    from kvretain.cli_sim import _plots

    def result(label: str, budget: float | None) -> dict[str, Any]:
        per = {"0": {"ttft_mean_s": 0.18, "recomputed_tokens": 0, "hit_rate": 0.0}}
        return {"label": label, "budget": budget, "output_tokens_per_s": 1.0, "hit_rate": 0.0, "classes": per}

    _plots(tmp_path, [result("lru", None), result("unified-b0.5", 0.5)], {"lru": {"0": [0.18]}}, ["lru"])
    left = figures[-1].axes[0]
    assert "pays" not in left.get_title() and "class 0" in left.get_title(), left.get_title()
    low, high = left.get_xlim()
    shown = [t for t in left.get_xticks() if low <= t <= high]
    assert shown and min(shown) == 0 and high > 0, (low, high, shown)  # (the markers at 0 stay inside)


def test_the_ttft_cdf_shows_shares_from_0_to_1(tmp_path: Path, figures: list[Any]) -> None:
    # a class with one finished request (`compare` of a one-request trace): its lone point at share 1.0 got an
    # axis of 0.96-1.04, shares above 1 and none of the scale below
    from kvretain.cli_sim import _plots

    results = [_fake_result("lru", None, 3.0, 1_000_000), _fake_result("unified-b0.5", 0.5, 2.0, 1_100_000)]
    _plots(tmp_path, results, {"lru": {"0": [0.5], "2": [0.1, 0.3, 0.7]}}, ["lru"])
    for ax in figures[0].axes:
        low, high = ax.get_ylim()
        assert low <= 0.0 and 1.0 <= high <= 1.1, (ax.get_title(), low, high)


def test_a_panel_with_no_finished_request_says_why(tmp_path: Path, figures: list[Any]) -> None:
    # `compare --kv-blocks 1`: every request rejected at admission, and the report's TTFT CDF and trade-off panels
    # were bare frames (a legend over nothing, in the trade-off panel), with no word of why
    from kvretain.cli_sim import _plots

    results = [_fake_result("lru", None, 3.0, 1_000_000), _fake_result("unified-b0.5", 0.5, 2.0, 1_100_000)]
    for r in results:
        r["classes"]["0"].update(ttft_mean_s=None, ttft_p99_s=None, hit_rate=None, rejected=7)
    _plots(tmp_path, results, {"lru": {"2": [0.1, 0.3]}}, ["lru"])
    c0, c2 = figures[0].axes
    assert [t.get_text() for t in c2.texts] == []  # (a panel with its line says nothing more)
    (note,) = [t.get_text() for t in c0.texts]
    assert "no class 0 request finished" in note and "7 rejected" in note, note
    left = figures[-1].axes[0]
    assert any("no class 0 request finished" in t.get_text() for t in left.texts), [
        t.get_text() for t in left.texts
    ]


def _tick_labels(fig: Any, ax: Any) -> list[tuple[str, Any]]:
    """The x tick labels a reader sees on ``ax`` (drawn, non-empty, inside the panel's width), left to right,
    with their boxes."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    panel = ax.get_window_extent(renderer)
    out = []
    for t in ax.get_xticklabels() + ax.get_xticklabels(minor=True):
        box = t.get_window_extent(renderer)
        if t.get_visible() and t.get_text() and box.x1 >= panel.x0 - 2 and box.x0 <= panel.x1 + 2:
            out.append((t.get_text(), box))
    return sorted(out, key=lambda tb: tb[1].x0)


def test_ttft_cdf_tick_labels_neither_overlap_nor_thin_out(tmp_path: Path, figures: list[Any]) -> None:
    # class 0's TTFTs within one decade (0.064-0.57 s, multi-tenant --limit 200): matplotlib labelled every minor
    # tick of the log axis in scientific notation and "3x10^-1" ran into "4x10^-1"
    from kvretain.cli_sim import _plots

    results = [_fake_result("lru", None, 3.0, 1_000_000), _fake_result("unified-b0.5", 0.5, 2.0, 1_100_000)]
    ttfts = {"lru": {"0": [0.064, 0.35, 0.57], "2": [0.0075, 0.3, 30.0]}}
    _plots(tmp_path, results, ttfts, ["lru"])
    for ax in figures[0].axes:
        labels = _tick_labels(figures[0], ax)
        assert len(labels) >= 3, [s for s, _ in labels]
        assert all(a.x1 <= b.x0 for (_, a), (_, b) in zip(labels, labels[1:], strict=False)), [
            s for s, _ in labels
        ]
        assert all("10^" not in s and "times" not in s for s, _ in labels), [s for s, _ in labels]


def test_a_policy_that_coincides_with_another_stays_visible(tmp_path: Path, figures: list[Any]) -> None:
    # `compare --limit 200`: unified ran as lru did (same TTFTs, same figures), and its green CDF line and
    # diamond, drawn the same size on top, hid lru's in every panel: the reference was in the legend only
    from kvretain.cli_sim import _plots

    same = {"0": [0.2, 0.3], "2": [0.1, 0.5, 0.9]}
    results = [
        _fake_result("lru", None, 3.0, 1_000_000),
        _fake_result("priority", None, 2.5, 1_050_000),
        _fake_result("unified", None, 3.0, 1_000_000),
        _fake_result("unified-b0.5", 0.5, 2.0, 1_100_000),
    ]
    policies = ["lru", "priority", "unified"]
    _plots(tmp_path, results, {"lru": same, "priority": same, "unified": same}, policies)
    for ax in figures[0].axes:
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        widths = [lines[p].get_linewidth() for p in policies]
        assert widths == sorted(widths, reverse=True) and len(set(widths)) == 3, (
            widths
        )  # drawn wide to narrow
    left = figures[-1].axes[0]
    marks = {ln.get_label(): ln for ln in left.get_lines()}
    sizes = [marks[p].get_markersize() for p in policies]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 3, sizes
    assert [marks[p].get_zorder() for p in policies] == [3, 3, 3]  # (in order: a later one is drawn on top)


def test_a_bar_of_zero_or_of_no_figure_is_marked(tmp_path: Path, figures: list[Any]) -> None:
    # `compare --limit 200`: class 0's hit ratio was 0 in every run, and the hit-ratio panel showed a legend entry
    # "class 0" with no bar anywhere, as it would for runs with no figure at all (NaN: no lookup, all rejected)
    from kvretain.cli_sim import _plots

    results = [
        _fake_result("lru", None, 3.0, 1_000_000),
        _fake_result("unified", None, 2.0, 1_100_000),
        _fake_result("unified-b0.5", 0.5, 2.0, 1_100_000),
    ]
    results[0]["classes"]["0"]["hit_rate"] = 0.0
    results[1]["classes"]["0"]["hit_rate"] = None
    results[2]["classes"]["0"]["ttft_mean_s"] = None
    _plots(tmp_path, results, {}, ["lru", "unified"])
    _, mid, right = figures[-1].axes
    zero = [b for b in mid.patches if b.get_height() == 0]
    assert len(zero) == 1
    marks = {t.get_text(): t.get_position() for t in mid.texts}
    assert set(marks) == {"0", "n/a"}
    assert marks["0"][0] == pytest.approx(zero[0].get_x() + zero[0].get_width() / 2)
    assert [t.get_text() for t in right.texts] == ["n/a"]  # unified-b0.5's class 0 has no mean TTFT


def test_frontier_line_follows_the_budgets_in_order(tmp_path: Path, figures: list[Any]) -> None:
    # `--budgets 0.8,0.1,0.4`: the line joined the points in the order given, a zigzag 0.8 -> 0.1 -> 0.4 that is
    # no frontier; the runs (tables, bars) keep the order given
    from kvretain.cli_sim import _plots

    results = [
        _fake_result("lru", None, 3.0, 1_000_000),
        _fake_result("unified-b0.8", 0.8, 1.5, 1_300_000),
        _fake_result("unified-b0.1", 0.1, 2.5, 1_050_000),
        _fake_result("unified-b0.4", 0.4, 2.0, 1_200_000),
    ]
    _plots(tmp_path, results, {}, ["lru"])
    left, mid, _ = figures[-1].axes
    (line,) = [ln for ln in left.get_lines() if ln.get_label() == "unified, fixed budget b"]
    assert list(line.get_xdata()) == [1.05, 1.2, 1.3] and list(line.get_ydata()) == [2.5, 2.0, 1.5]
    assert [t.get_text() for t in mid.get_xticklabels()] == [r["label"] for r in results]


def test_compare_capacity_derives_from_the_protected_working_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json
    import math

    from kvretain.cli_sim import load_workload, protected_peak_blocks, sim_config
    from kvretain.workloads import working_set

    argv = ["compare", "--limit", "600", "--policies", "lru", "--budgets", "0.9", "--no-progress"]
    args = build_parser().parse_args([*argv, "--out", str(tmp_path / "r")])
    reqs, _ = load_workload(args)
    cfg = sim_config(args, "unified")
    peak = math.ceil(working_set([r for r in reqs if r.priority == 0]).peak_tokens / cfg.block_size)
    largest = max(math.ceil((len(r.prompt) + r.output_len) / cfg.block_size) for r in reqs)
    expected = protected_peak_blocks(reqs, cfg)
    assert expected == max(peak, largest) and peak > 0
    assert protected_peak_blocks([r for r in reqs if r.priority != 0], cfg) == 0  # nothing protected
    assert main([*argv, "--out", str(tmp_path / "r")]) == 0
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert {r["kv_blocks_per_replica"] for r in summary} == {expected}
    assert "peak working set" in (tmp_path / "r" / "summary.md").read_text()
    by = {r["label"]: r for r in summary}
    # the pool is tight for class 0: protecting it buys it hits that lru's recency order loses
    assert by["unified-b0.9"]["classes"]["0"]["hit_rate"] > by["lru"]["classes"]["0"]["hit_rate"]
    capsys.readouterr()


# ---------------------------------------------------------------- acceptance 5: the test scripts talk
def _logical_lines(path: Path) -> list[str]:
    return re.sub(r"\\\n\s*", " ", path.read_text()).splitlines()


@pytest.mark.parametrize("script", ["test.sh", "test_vllm.sh"])
def test_every_slow_command_of_the_test_scripts_is_announced(script: str) -> None:
    slow = re.compile(r"-m venv|-m pip install|bin/mypy|-m pytest|ruff check")
    for line in _logical_lines(ROOT / "scripts" / script):
        code = line.split("#", 1)[0].strip()
        if slow.search(code):
            assert re.search(r"(^|\|\| |&& )(quiet_)?step \"", code), f"{script}: not announced: {code}"


def test_quiet_step_reports_while_a_step_runs() -> None:
    script = 'source scripts/steps.sh; quiet_step "napping" sleep 2.5; quiet_step "failing" sh -c "echo boom; exit 3"'
    proc = subprocess.run(
        ["bash", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "KVRETAIN_HEARTBEAT_S": "1"},
        check=False,
    )
    assert proc.returncode == 3
    assert "== napping" in proc.stdout and "... still napping (1 s)" in proc.stdout
    assert "boom" in proc.stdout and "failed (3)" in proc.stderr


def test_a_full_disk_is_said_before_a_virtual_environment_is_built() -> None:
    def need(gb: int, where: str = ".") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "scripts/need_disk.sh", str(gb), ".venv-vllm (test)", "KVRETAIN_SKIP_VLLM", where],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={"PATH": "/usr/bin:/bin"},
            check=False,
        )

    assert need(0).returncode == 0
    short = need(1 << 40)  # more than any disk
    assert short.returncode == 2
    assert "not enough free disk for .venv-vllm (test)" in short.stderr
    assert "KVRETAIN_SKIP_VLLM=1 skips this step" in short.stderr
    # where df cannot tell, the install goes on (and says what is wrong itself)
    assert need(1 << 40, "/no/such/dir").returncode == 0
    # both environments of the test command check before they install, and only when they build a new one (a
    # repair of an existing environment needs little space)
    for script in ("test_vllm.sh", "vllm_cpu_env.sh"):
        text = re.sub(r"\\\n\s*", " ", (ROOT / "scripts" / script).read_text())
        check, install = text.find("scripts/need_disk.sh"), text.find("pip install")
        assert 0 <= check < install, script
        assert re.search(r'\[ -x "\$VENV/bin/python" \] \|\|\s*bash scripts/need_disk.sh', text), script
