"""Knob sensitivity of ``unified`` on the robustness grid (issue 10, deliverable 8): the grid's acceptance
figures with every knob at its default and at 0.5x and 2x it, one knob at a time.

    python bench/sensitivity.py [--capacities 500 5384 32000] [--traces NAME ...] [--jobs N | --ray ADDRESS] [--knobs K ...] [--json FILE]
    python bench/sensitivity.py --quick            # smoke test: bench/robustness.py's --quick grid

The traces, priority rules and capacities are bench/robustness.py's (imported, not copied: ``--mooncake``,
``--trace``, ``--block-tokens``, ``--held-out``, ``--quick``, ``--capacities``, ``--seed``, ``--out`` as there), and so are the cell analysis and
the summary. Per cell (trace x rule x capacity) ``lru`` and the isolation reference run once (they do not
depend on ``unified``'s knobs); ``unified`` runs once per setting. Per trace x capacity the one-class run
(every request priority 0) of ``lru`` once and of ``unified`` at the default and at the settings of
``ONE_CLASS_KNOBS`` (``--one-class-all``: every setting; ``--no-one-class``: none). ``--traces`` keeps only
the named grid traces. A ``SHARDS_SAMPLE`` setting at a pool no larger than both it and its default samples
every block, as the default does, so it is not rerun: the default's figures stand for it.

Knobs and their settings (0.5x and 2x the default, except where said):
  * ``PolicyConfig`` fields: ``max_reuse_loss``, ``isolation_goal``, ``priority_weight``, ``budget``,
    ``frequency_exponent``. ``isolation_goal`` is a fraction whose 2x is meaningless (1.8): its *tolerance*
    ``1 - goal`` is scaled instead (default 0.9: 0.95 at 0.5x, 0.8 at 2x). ``budget`` is a share of the pool:
    2x its default (1.9) is clamped to 1.0.
  * module constants of :mod:`kvretain.core.policies.protection`: ``WINDOW_TURNOVERS`` (the controller's
    window in pool turnovers), ``BALANCE_TURNOVERS`` (the recency/frequency balance's), ``SHARDS_SAMPLE`` (tracked blocks per shadow above which the shadows are
    sampled; it only changes pools larger than the smaller of the two settings), ``ONE_CLASS_Z`` (the
    balance's evidence threshold while all traffic has one retention priority: it moves one-class runs only) and
    ``WARMUP_SCALE`` (the warm-up shadows' size, as a share of the controller's, that chooses where the level
    starts; 2x is the controller's own size). They are set in the worker
    process, for the duration of one replay (:func:`protection_constants`), never by editing the module; the
    values each worker saw are in the results (``constants_seen``).

Per setting, over the cells: ``min_overall_vs_lru``, ``cells_below_floor`` (overall < 0.98x lru),
``min_class0_vs_lru``, ``cells_class0_below_lru``, ``cells_class0_target_met`` (the grid's definitions:
:func:`robustness.analyse_cell`), and ``one_class_min_vs_lru``. A terminal table, ``--json FILE`` (settings,
summaries, every cell), and the last stdout line: JSON ``{"cells": n, "settings": {"default": {...},
"max_reuse_loss=0.5x": {...}, ...}}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import robustness as grid
from kvretain.cli_args import DefaultsHelpFormatter, Parser, integer, path_arg, script_main, summary_of
from kvretain.core.policies import protection
from kvretain.core.policy import PolicyConfig
from kvretain.replay import TraceError
from kvretain.workloads import WorkloadError

CONSTANTS = ("WINDOW_TURNOVERS", "BALANCE_TURNOVERS", "SHARDS_SAMPLE", "ONE_CLASS_Z", "WARMUP_SCALE")
FIELDS = ("max_reuse_loss", "isolation_goal", "priority_weight", "budget", "frequency_exponent")
KNOBS = (*FIELDS, *CONSTANTS)
FACTORS = (0.5, 2.0)
# one-class runs (every request priority 0): by default only for the default setting and the knobs of the base
# order (frequency_exponent, BALANCE_TURNOVERS; max_reuse_loss and WINDOW_TURNOVERS, which also set the
# recency/frequency balance's window), to keep the pass short. The other knobs can move a one-class run too (every request then maps to
# retention 35, the protect threshold, so all traffic is protected traffic): --one-class-all measures them.
ONE_CLASS_KNOBS = (
    "max_reuse_loss",
    "frequency_exponent",
    "WINDOW_TURNOVERS",
    "BALANCE_TURNOVERS",
    "ONE_CLASS_Z",
)
FIGURES = (
    "min_overall_vs_lru",
    "cells_below_floor",
    "min_class0_vs_lru",
    "cells_class0_below_lru",
    "cells_class0_target_met",
    "one_class_min_vs_lru",
)


@dataclass(frozen=True)
class Setting:
    """One knob at one factor of its default (``knob == "default"``: every knob at its default)."""

    knob: str
    factor: float | None = None
    value: Any = None
    note: str = ""

    @property
    def key(self) -> str:
        return "default" if self.factor is None else f"{self.knob}={self.factor:g}x"

    @property
    def overrides(self) -> tuple[tuple[str, Any], ...]:
        return ((self.knob, self.value),) if self.knob in FIELDS else ()

    @property
    def constants(self) -> tuple[tuple[str, Any], ...]:
        return ((self.knob, self.value),) if self.knob in CONSTANTS else ()


def same_as_default(s: Setting, capacity: int) -> bool:
    """True where the setting replays exactly as the default by construction (not run, the default's figures
    are used): ``SHARDS_SAMPLE`` at pools no larger than both its value and its default, where both
    sample every block (rate 1)."""
    return s.knob == "SHARDS_SAMPLE" and capacity <= min(s.value, default_of(s.knob))


def default_of(knob: str) -> Any:
    return getattr(protection, knob) if knob in CONSTANTS else getattr(PolicyConfig(), knob)


def make_settings(knobs: Sequence[str]) -> list[Setting]:
    """The default setting, then each knob at each of :data:`FACTORS` (see the module docstring)."""
    out = [Setting("default")]
    for knob in knobs:
        d = default_of(knob)
        for f in FACTORS:
            note = ""
            if knob == "isolation_goal":
                value: Any = round(1.0 - f * (1.0 - d), 10)
                note = f"tolerance 1-goal {1.0 - d:g} x {f:g}"
            elif knob == "budget":
                value = min(1.0, round(f * d, 10))
                if f * d > 1.0:
                    note = f"{f:g}x = {f * d:g}, clamped to 1"
            elif isinstance(d, int):
                value = round(f * d)
            else:
                value = round(f * d, 10)
            out.append(Setting(knob, f, value, note))
    for s in out:
        PolicyConfig(**dict(s.overrides))  # validates (raises ValueError naming the field)
    return out


@contextmanager
def protection_constants(values: dict[str, Any]) -> Iterator[None]:
    """Sets module constants of :mod:`kvretain.core.policies.protection` in this process (the controller reads
    them when it is built), and restores them on exit."""
    unknown = set(values) - set(CONSTANTS)
    if unknown:
        raise ValueError(f"not a protection constant: {', '.join(sorted(unknown))}")
    saved = {k: getattr(protection, k) for k in values}
    try:
        for k, v in values.items():
            setattr(protection, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(protection, k, v)


@dataclass(frozen=True)
class SensJob:
    """One grid job (bench/robustness.py's), run under a setting's module constants."""

    setting: str  # Setting.key, or "reference" for the lru / isolation runs
    job: grid.Job
    constants: tuple[tuple[str, Any], ...] = ()


def run_sens(sj: SensJob, loaded: grid.Loaded | None = None) -> dict[str, Any]:
    """One job at its setting (``loaded``: its trace, when ``--ray`` ships it; else read in this process)."""
    with protection_constants(dict(sj.constants)):
        out = grid.run_job(sj.job, loaded)
        out["constants_seen"] = {k: getattr(protection, k) for k in CONSTANTS}
    out["setting"] = sj.setting
    return out


def make_jobs(
    traces: Sequence[grid.Trace],
    caps: Sequence[int],
    settings: Sequence[Setting],
    quick: bool,
    seed: int,
    one_class: Sequence[Setting],
) -> list[SensJob]:
    jobs = []
    for t in traces:
        for cap in caps:
            for rule in t.rules(quick):
                jobs.append(SensJob("reference", grid.Job("cell", t, rule, cap, ("lru",), (), seed=seed)))
                for s in settings:
                    if same_as_default(s, cap):
                        continue
                    job = grid.Job("policies", t, rule, cap, ("unified",), s.overrides, seed=seed)
                    jobs.append(SensJob(s.key, job, s.constants))
            if one_class:
                jobs.append(
                    SensJob("reference", grid.Job("one-class", t, "one-class", cap, ("lru",), (), seed=seed))
                )
                for s in one_class:
                    if same_as_default(s, cap):
                        continue
                    job = grid.Job("one-class", t, "one-class", cap, ("unified",), s.overrides, seed=seed)
                    jobs.append(SensJob(s.key, job, s.constants))
    return jobs


def job_cost(sj: SensJob, blocks: dict[grid.Trace, int]) -> float:
    j = sj.job
    return blocks[j.trace] * (
        sum(grid.COST[p] for p in j.policies) + (grid.COST[grid.ISO] if j.kind == "cell" else 0.0)
    )


def assemble(
    results: Sequence[dict[str, Any]], settings: Sequence[Setting], one_class: Sequence[str]
) -> dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """Per setting key: its cells (the reference cell with this setting's ``unified``, analysed as the grid
    does) and its one-class runs (with ``vs_lru``)."""
    refs = {
        (r["kind"], r["trace"], r["rule"], r["capacity"]): r for r in results if r["setting"] == "reference"
    }
    out: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {s.key: ([], []) for s in settings}
    results = list(results)
    for s in settings:  # the runs skipped as identical to the default: the default's figures
        if s.factor is not None:
            results += [
                {**r, "setting": s.key, "same_as_default": True}
                for r in results
                if r["setting"] == "default"
                and same_as_default(s, r["capacity"])
                and (r["kind"] != "one-class" or s.key in one_class)
            ]
    for r in results:
        if r["setting"] == "reference":
            continue
        cells, one = out[r["setting"]]
        if r["kind"] == "one-class":
            ref = refs[("one-class", r["trace"], r["rule"], r["capacity"])]
            c = {**ref, "unified": r["unified"], "setting": r["setting"]}
            c["constants_seen"] = r["constants_seen"]
            c["vs_lru"] = grid.ratio(c["unified"]["overall"], c["lru"]["overall"])
            one.append(c)
        else:
            ref = refs[("cell", r["trace"], r["rule"], r["capacity"])]
            c = {**ref, "unified": r["unified"], "setting": r["setting"]}
            c["constants_seen"] = r["constants_seen"]
            grid.analyse_cell(c)
            cells.append(c)
    return out


def summarise(cells: list[dict[str, Any]], one: list[dict[str, Any]]) -> dict[str, Any]:
    """The grid's summary (:func:`robustness.summarise`) plus the counts of cells below the floor and with
    class 0 below lru's (the grid's ``misses``)."""
    s = grid.summarise(cells, one)
    s["cells_below_floor"] = sum(1 for c in cells if grid.MISS_FLOOR in c["misses"])
    s["cells_class0_below_lru"] = sum(1 for c in cells if grid.MISS_CLASS0 in c["misses"])
    return {"cells": s["cells"], **{k: s[k] for k in FIGURES}}


def table(settings: Sequence[Setting], summaries: dict[str, dict[str, Any]]) -> str:
    rows = []
    for st in settings:
        s = summaries[st.key]
        n = s["cells"]
        rows.append(
            {
                "knob": st.knob,
                "setting": "-" if st.factor is None else f"{st.factor:g}x = {st.value:g}",
                "min u/lru": grid._num(s["min_overall_vs_lru"]),
                "cells <0.98x": str(s["cells_below_floor"]),
                "min u0/lru0": grid._num(s["min_class0_vs_lru"]),
                "cells c0<lru": str(s["cells_class0_below_lru"]),
                "c0 target met": f"{s['cells_class0_target_met']}/{n}",
                "one-class min u/lru": grid._num(s["one_class_min_vs_lru"]),
                "note": st.note or "",
            }
        )
    return grid.format_table(rows)


# ---------------------------------------------------------------------------------------------- main
def build_parser() -> Parser:
    """The command line (``--help`` shows every option's default)."""
    ap = Parser(prog="sensitivity", description=summary_of(__doc__), formatter_class=DefaultsHelpFormatter)
    ap.add_argument(
        "--mooncake",
        type=path_arg("a Mooncake-format JSONL file"),
        default=None,
        help=f"the Mooncake conversation trace (default {grid.DEFAULT_MOONCAKE}, skipped when it is missing)",
    )
    ap.add_argument(
        "--trace",
        action="append",
        default=[],
        type=path_arg("a Mooncake-format JSONL file"),
        help="use this Mooncake-format JSONL file instead of the grid's traces (repeatable; default: the grid's)",
    )
    grid.add_block_tokens_option(ap)
    ap.add_argument(
        "--quick", action="store_true", help="the grid's smoke test: 2 traces, 2 rules, 3 capacities"
    )
    ap.add_argument(
        "--held-out",
        action="store_true",
        help="the grid's held-out traces (robustness.HELD_OUT) instead of its default set",
    )
    ap.add_argument(
        "--capacities",
        type=integer(1, what=" (blocks)"),
        nargs="+",
        default=None,
        help="override the capacities: pool sizes in blocks of 512 tokens (default: the grid's 8, 3 with --quick)",
    )
    ap.add_argument(
        "--knobs",
        nargs="+",
        default=list(KNOBS),
        metavar="KNOB",
        help=f"the knobs to vary, a subset of {', '.join(KNOBS)} (default: all)",
    )
    ap.add_argument(
        "--traces",
        nargs="+",
        default=None,
        metavar="NAME",
        help="only these of the grid's traces (by name; default: all)",
    )
    one_class = ap.add_mutually_exclusive_group()
    one_class.add_argument("--no-one-class", action="store_true", help="skip the one-class runs")
    one_class.add_argument(
        "--one-class-all",
        action="store_true",
        help=f"one-class runs for every setting (default: the default and {', '.join(ONE_CLASS_KNOBS)})",
    )
    grid.add_run_options(ap)
    ap.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="run the jobs as Ray tasks, as robustness.py --ray does (local, auto, HOST:PORT or ray://HOST:PORT; "
        "default: local processes)",
    )
    ap.add_argument(
        "--out",
        type=path_arg("a folder name"),
        default="reports/robustness",
        help="folder for the generated traces (default reports/robustness)",
    )
    grid.add_json_option(ap, "the settings and every cell to FILE")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar of the jobs on stderr")
    return ap


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        bad = [k for k in args.knobs if k not in KNOBS]
        if bad:
            raise ValueError(f"--knobs: unknown {', '.join(bad)}; choose from {', '.join(KNOBS)}")
        grid.check_ray(args.ray)
        grid.check_block_tokens(args)
        caps = args.capacities or grid.capacities(args.quick, args.block_tokens)
        grid.check_capacities(caps, args.jobs, None, args.block_tokens)
        settings = make_settings(list(dict.fromkeys(args.knobs)))
        # the outputs, before the grid runs: a file or folder that cannot be written fails now, not after it
        if args.json:
            grid.check_json_output(args.json)
        if not args.trace:  # the generated traces
            grid.check_output_folder(args.out, "--out")
        traces = grid.prepare_traces(args, Path(args.out))
        if args.traces:
            names = [t.name for t in traces]
            unknown = [n for n in args.traces if n not in names]
            if unknown:
                raise ValueError(f"--traces: unknown {', '.join(unknown)}; the grid has {', '.join(names)}")
            traces = [t for t in traces if t.name in args.traces]
        blocks, per_block, note = grid.timing(traces)
    except (ValueError, TraceError, WorkloadError, OSError, grid.RayUnavailable) as exc:
        print(f"sensitivity: error: {exc}", file=sys.stderr)
        return 2
    one_class = (
        []
        if args.no_one_class
        else [s for s in settings if args.one_class_all or s.factor is None or s.knob in ONE_CLASS_KNOBS]
    )
    jobs = sorted(
        make_jobs(traces, caps, settings, args.quick, args.seed, one_class),
        key=lambda j: -job_cost(j, blocks),
    )
    total = sum(job_cost(j, blocks) for j in jobs) * per_block
    n_proc = min(args.jobs, len(jobs))
    print(note)
    print(
        f"sensitivity: {len(settings)} settings x {len(traces)} traces x {len(caps)} capacities "
        f"({', '.join(map(str, caps))}), {len(jobs)} replay jobs; expected ~{total / n_proc / 60:.1f} min on "
        f"{n_proc} processes ({total / 60:.1f} CPU-min)",
        flush=True,
    )
    t0 = time.perf_counter()
    if args.ray is not None:
        try:
            results = grid.run_ray(
                jobs, args.ray, args.jobs, not args.no_progress, fn=run_sens, trace_of=lambda sj: sj.job.trace
            )
        except grid.RayUnavailable as exc:
            print(f"sensitivity: error: {exc}", file=sys.stderr)
            return 2
    else:
        results = grid.run_all(jobs, n_proc, not args.no_progress, fn=run_sens)
    wall = time.perf_counter() - t0
    per_setting = assemble(results, settings, [s.key for s in one_class])
    summaries = {k: summarise(cells, one) for k, (cells, one) in per_setting.items()}
    n_cells = summaries["default"]["cells"]
    print(f"\nknob sensitivity of unified: {n_cells} cells per setting; ran {wall / 60:.1f} min")
    print(table(settings, summaries))
    last = {"cells": n_cells, "settings": {k: {f: s[f] for f in FIGURES} for k, s in summaries.items()}}
    if args.json:
        doc = {
            "config": {
                "capacities": caps,
                "block_tokens": args.block_tokens,
                "seed": args.seed,
                "knobs": args.knobs,
                "one_class": [s.key for s in one_class],
                "traces": {t.name: {"path": t.path, "rules": t.rules(args.quick)} for t in traces},
            },
            "settings": [
                {**dataclasses.asdict(s), "key": s.key, "summary": summaries[s.key]} for s in settings
            ],
            "cells": {k: cells for k, (cells, _) in per_setting.items()},
            "one_class": {k: one for k, (_, one) in per_setting.items()},
            "wall_s": round(wall, 1),
            "summary": last,
        }
        grid.write_json(args.json, doc)
    print(json.dumps(last))
    return 0


if __name__ == "__main__":
    raise SystemExit(script_main(main))
