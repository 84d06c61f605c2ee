"""Fresh draws of the grid's generators (session 44): does ``unified``'s verdict against ``lru`` hold across
seeds no development step looked at?

    python bench/draws.py [--workloads NAME ...] [--seeds 100-119] [--capacities N ...] [--jobs N] [--json FILE]
    python bench/draws.py --workloads multi-tenant --seeds 100-109 --capacities 2972   # a quick look (~20 s)

The robustness grid (bench/robustness.py) holds each generated workload at a few seeds (0-4; held out 5-7), so
of a cell where class 0 ends below ``lru``'s it can only say whether that one loss is resolved. This bench asks
how often it happens: each workload (default: the grid's ``multi-tenant``, ``agent-pauses`` and
``retrieval-scan`` and the held-out ``template-drift``, at their default settings) at every seed of ``--seeds``
(default 100-119: no session before 44 ran any of these generators at a seed above 7), under the grid's four
priority rules, at ``--capacities`` (default the grid's 8, 500-32,000 blocks): 2,560 cells, ~25 min on 2
processes.
A cell is the grid's (``robustness.run_job``, kind ``cell``, policies ``lru`` and ``unified`` with the
defaults): both replays, the isolation reference, class 0 compared request by request; the same verdicts
(``robustness.analyse_cell``: target, floor, class 0 below lru; resolved at z <= -1.645, one-sided).

Printed: one row per configuration, workload x rule x capacity (cells; class 0 below lru, of them resolved;
class 0's ratio to lru's, lowest and median; the lowest overall ratio; targets met; class 0's hit-block
difference summed over the draws, with its pooled z), then every resolved loss and every floor miss.
Reading it: where ``unified`` and ``lru`` tie, a cell reads resolved about 5% of the time, so a handful of resolved
cells among many is what ties alone give; a systematic loss on one configuration shows in the pooled z (the
draws are independent, so their differences add and so do their variances) even where no single draw resolves it.
A trace is generated in the worker (``kvretain workload export NAME --seed S`` writes the same file) and not kept.

``--one-class`` adds the grid's one-class run of every trace at every capacity (every request at priority 0, no
directives: ``lru``, ``s3fifo``, ``arc``, ``unified``): acceptance 2 across the draws, one row per workload x
capacity (runs; ``unified`` below lru, of them resolved over every request; its ratio to lru's, lowest and median;
runs where it is at least the better of ``s3fifo`` and ``arc``; the pooled difference and z). ``--rules`` with no
rule runs those alone.

Last stdout line, JSON: ``{"cells": n, "min_overall_vs_lru": r, "cells_class0_target_met": k,
"cells_class0_below_lru": k, "cells_class0_below_lru_resolved": k, "min_class0_vs_lru": r, "configurations": k,
"configurations_class0_below_lru_resolved": k}``, with ``--one-class`` also ``"one_class_runs": n,
"one_class_min_vs_lru": r, "one_class_below_lru": k, "one_class_below_lru_resolved": k,
"one_class_configurations_below_lru_resolved": k, "one_class_at_least_rivals": k``.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import robustness as grid
from kvretain.cli_args import (
    DefaultsHelpFormatter,
    Parser,
    integer,
    script_main,
    summary_of,
)
from kvretain.workloads import WORKLOADS
from kvretain.workloads.export import write_mooncake

PROG = "draws"
WORKLOAD_NAMES = ("multi-tenant", "agent-pauses", "retrieval-scan", "template-drift")
SEEDS = (100, 119)
CAPACITIES = tuple(grid.CAPACITIES)
POLICIES = ("lru", "unified")
CHANCE = 0.05  # a tie reads resolved about this often (grid.RESOLVED_Z is one-sided at 5%)


@dataclass(frozen=True)
class Draw:
    """One trace: a workload at a seed, every rule at every capacity."""

    workload: str
    seed: int
    capacities: tuple[int, ...]
    rules: tuple[str, ...]
    rule_seed: int = 0  # the random session rules' seed (``--seed``, as the grid's)
    one_class: bool = False  # also the grid's one-class run at every capacity (``--one-class``)


def run_draw(draw: Draw) -> list[dict[str, Any]]:
    """The grid's cells of one draw, and its one-class runs (their ``kind`` says which; the trace written to a
    temporary file and read back through the one trace parser, as the grid reads its generated traces); the
    process's trace caches are emptied after."""
    with tempfile.TemporaryDirectory(prefix="kvretain-draws-") as tmp:
        path = Path(tmp) / f"{draw.workload}-s{draw.seed}.jsonl"
        write_mooncake(WORKLOADS.create(draw.workload, rng=random.Random(draw.seed)), path, grid.BLOCK_TOKENS)
        trace = grid.Trace(path.stem, str(path), native=True)
        try:
            cells = [
                grid.run_job(grid.Job("cell", trace, rule, cap, POLICIES, (), seed=draw.rule_seed))
                for rule in draw.rules
                for cap in draw.capacities
            ]
            if draw.one_class:
                one = tuple(grid.ONE_CLASS_POLICIES)
                cells += [
                    grid.run_job(grid.Job("one-class", trace, "one-class", cap, one, ()))
                    for cap in draw.capacities
                ]
        finally:
            grid._LOADED.clear()
            grid._TAGGED.clear()
    for c in cells:
        c["workload"], c["seed"] = draw.workload, draw.seed
    return cells


def seed_range(text: str) -> tuple[int, int]:
    """``A-B`` (inclusive) or ``A``: seeds >= 0, A <= B."""
    lo, sep, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise ValueError(f"argument --seeds: {text!r} is not A-B or A (integers >= 0)") from None
    if a < 0 or b < a:
        raise ValueError(f"argument --seeds: {text!r}: need 0 <= A <= B")
    return a, b


def pooled(cells: list[dict[str, Any]], key: str = "class0_paired") -> tuple[int, float | None]:
    """The hit-block difference (``unified - lru``: class 0's, or every request's with ``key`` ``paired``, a
    one-class run's) summed over the cells (independent draws of one configuration) and its z: the sum over the
    square root of the summed variances (None: no variance)."""
    ps = [c[key] for c in cells if c.get(key)]
    diff = sum(p["diff_hits"] for p in ps)
    var = sum(p["se_hits"] ** 2 for p in ps)
    return diff, (diff / math.sqrt(var) if var > 0 else None)


def groups(cells: list[dict[str, Any]]) -> dict[tuple[str, str, int], list[dict[str, Any]]]:
    """The cells by configuration: workload, rule, capacity (the draws of one configuration together)."""
    out: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for c in sorted(cells, key=lambda c: (c["workload"], c["rule"], c["capacity"], c["seed"])):
        out.setdefault((c["workload"], c["rule"], c["capacity"]), []).append(c)
    return out


def _row(cells: list[dict[str, Any]]) -> dict[str, str]:
    s = summarise(cells)
    diff, z = pooled(cells)
    c0 = [c["class0_vs_lru"] for c in cells if c["class0_vs_lru"] is not None]
    return {
        "cells": str(s["cells"]),
        "c0<lru (resolved)": f"{s['cells_class0_below_lru']} ({s['cells_class0_below_lru_resolved']})",
        "c0/lru min": grid._num(s["min_class0_vs_lru"], ".4f"),
        "c0/lru median": grid._num(statistics.median(c0) if c0 else None, ".4f"),
        "overall/lru min": grid._num(s["min_overall_vs_lru"], ".4f"),
        "target met": str(s["cells_class0_target_met"]),
        "c0 pooled diff (z)": f"{diff:+d} ({grid._num(z, '+.2f')})",
    }


def table(cells: list[dict[str, Any]]) -> str:
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault((c["workload"], c["rule"], c["capacity"]), []).append(c)
    rows = [
        {"workload": w, "rule": r, "blocks": str(cap), **_row(g)} for (w, r, cap), g in sorted(groups.items())
    ]
    return grid.format_table(rows)


def summarise(cells: list[dict[str, Any]]) -> dict[str, Any]:
    below = [c for c in cells if grid.MISS_CLASS0 in c["misses"]]
    zs = [pooled(g)[1] for g in groups(cells).values()]

    def mn(key: str) -> float | None:
        vals = [c[key] for c in cells if c[key] is not None]
        return grid.round_down(min(vals)) if vals else None

    return {
        "cells": len(cells),
        "min_overall_vs_lru": mn("overall_vs_lru"),
        "cells_class0_target_met": sum(1 for c in cells if c["class0_target_met"]),
        "cells_class0_below_lru": len(below),
        "cells_class0_below_lru_resolved": sum(1 for c in below if grid._resolved(c.get("class0_paired"))),
        "min_class0_vs_lru": mn("class0_vs_lru"),
        "configurations": len(zs),
        "configurations_class0_below_lru_resolved": sum(
            1 for z in zs if z is not None and z <= -grid.RESOLVED_Z
        ),
    }


def listing(cells: list[dict[str, Any]]) -> list[str]:
    """Every resolved class-0 loss and every floor miss, one line each."""
    out = []
    for c in sorted(cells, key=lambda c: (c["workload"], c["seed"], c["rule"], c["capacity"])):
        resolved = grid.MISS_CLASS0 in c["misses"] and grid._resolved(c.get("class0_paired"))
        if not resolved and grid.MISS_FLOOR not in c["misses"]:
            continue
        what = ", ".join(m for m in c["misses"] if m != grid.MISS_CLASS0 or resolved)
        out.append(
            f"  {c['workload']} seed {c['seed']} {c['rule']} {c['capacity']}: {what}; overall "
            f"{grid._num(c['overall_vs_lru'], '.4f')}x lru"
            + (f" ({grid.floor_shortfall(c.get('floor_paired'))})" if grid.MISS_FLOOR in c["misses"] else "")
            + f"; class 0 against lru: {grid.shortfall(c.get('class0_paired'))}"
        )
    return out


def one_class_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Acceptance 2's figures over the one-class runs: ``unified`` against ``lru`` (each run's paired verdict,
    and each configuration's pooled one) and against the better of ``s3fifo`` and ``arc``."""
    below = [r for r in runs if r["vs_lru"] is not None and r["vs_lru"] < 1.0]
    zs = [pooled(g, "paired")[1] for g in groups(runs).values()]
    ratios = [r["vs_lru"] for r in runs if r["vs_lru"] is not None]
    return {
        "one_class_runs": len(runs),
        "one_class_min_vs_lru": grid.round_down(min(ratios)) if ratios else None,
        "one_class_below_lru": len(below),
        "one_class_below_lru_resolved": sum(1 for r in below if grid._resolved(r.get("paired"))),
        "one_class_configurations_below_lru_resolved": sum(
            1 for z in zs if z is not None and z <= -grid.RESOLVED_Z
        ),
        "one_class_at_least_rivals": sum(1 for r in runs if _beats_rivals(r)),
    }


def _beats_rivals(run: dict[str, Any]) -> bool:
    return all(run["unified"]["overall"] >= run[p]["overall"] for p in ("s3fifo", "arc") if p in run)


def one_class_table(runs: list[dict[str, Any]]) -> str:
    rows = []
    for (w, _, cap), g in groups(runs).items():
        s = one_class_summary(g)
        diff, z = pooled(g, "paired")
        ratios = [r["vs_lru"] for r in g if r["vs_lru"] is not None]
        rows.append(
            {
                "workload": w,
                "blocks": str(cap),
                "runs": str(s["one_class_runs"]),
                "u<lru (resolved)": f"{s['one_class_below_lru']} ({s['one_class_below_lru_resolved']})",
                "u/lru min": grid._num(s["one_class_min_vs_lru"], ".4f"),
                "u/lru median": grid._num(statistics.median(ratios) if ratios else None, ".4f"),
                "u >= s3fifo, arc": str(s["one_class_at_least_rivals"]),
                "pooled diff (z)": f"{diff:+d} ({grid._num(z, '+.2f')})",
            }
        )
    return grid.format_table(rows)


def build_parser() -> Parser:
    ap = Parser(prog=PROG, description=summary_of(__doc__), formatter_class=DefaultsHelpFormatter)
    ap.add_argument(
        "--workloads",
        nargs="+",
        choices=[w for w in WORKLOADS.names() if w not in ("mooncake", "azure")],
        default=list(WORKLOAD_NAMES),
        metavar="NAME",
        help="generated workloads, at their default settings (default: the grid's three and template-drift)",
    )
    ap.add_argument(
        "--seeds", default=f"{SEEDS[0]}-{SEEDS[1]}", help="workload seeds, A-B inclusive or one seed A"
    )
    ap.add_argument(
        "--capacities",
        type=integer(1, what=" (blocks)"),
        nargs="+",
        default=list(CAPACITIES),
        help="pool sizes in blocks of 512 tokens",
    )
    ap.add_argument(
        "--rules",
        nargs="*",
        choices=["native", *grid.RULES],
        default=["native", *grid.RULES],
        help="priority rules (the grid's: the workload's own, and its three session rules; none: no two-class "
        "cells, with --one-class)",
    )
    ap.add_argument(
        "--one-class",
        action="store_true",
        help="also every trace relabelled to one class at every capacity (the grid's one-class run: lru, s3fifo, "
        "arc, unified): acceptance 2 across the draws",
    )
    grid.add_run_options(ap)
    grid.add_json_option(ap, "every cell and the summary to FILE")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar of the draws on stderr")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        lo, hi = seed_range(args.seeds)
        if not args.rules and not args.one_class:
            raise ValueError("argument --rules: no rule and no --one-class: nothing to run")
        if args.json:
            grid.check_json_output(args.json)
        grid.check_capacities(args.capacities, args.jobs)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    caps = tuple(dict.fromkeys(args.capacities))
    rules = tuple(dict.fromkeys(args.rules))
    names = tuple(dict.fromkeys(args.workloads))
    draws = [Draw(w, s, caps, rules, args.seed, args.one_class) for w in names for s in range(lo, hi + 1)]
    n_proc = min(args.jobs, len(draws))
    print(
        f"{PROG}: {len(draws)} traces ({', '.join(names)} at seeds {lo}-{hi}) x {len(rules)} rules x {len(caps)} "
        f"capacities = {len(draws) * len(rules) * len(caps)} cells"
        + (f", and {len(draws) * len(caps)} one-class runs" if args.one_class else "")
        + f", on {n_proc} processes",
        flush=True,
    )
    t0 = time.perf_counter()
    results = [
        c
        for got in grid.run_all(draws, n_proc, not args.no_progress, fn=run_draw, desc="traces")
        for c in got
    ]
    wall = time.perf_counter() - t0
    cells = [c for c in results if c["kind"] == "cell"]
    runs = [c for c in results if c["kind"] == "one-class"]
    for c in cells:
        grid.analyse_cell(c)
    for r in runs:
        r["vs_lru"] = grid.ratio(r["unified"]["overall"], r["lru"]["overall"])
    summary = summarise(cells)
    print(f"{len(draws)} traces in {wall / 60:.1f} min")
    if cells:
        lines = listing(cells)
        print(table(cells))
        print(
            f"\n{summary['cells']} cells: class 0 below lru on {summary['cells_class0_below_lru']}, resolved (z <= "
            f"-{grid.RESOLVED_Z}) on {summary['cells_class0_below_lru_resolved']}; ties alone read resolved on "
            f"about {CHANCE:.0%} of the cells they hold ({CHANCE * len(cells):.0f} of {len(cells)}). Resolved "
            f"losses and floor misses ({len(lines)}):"
        )
        for line in lines or ["  none"]:
            print(line)
        print(
            f"configurations (workload x rule x capacity) whose class 0 is below lru over all their draws, "
            f"resolved (pooled z <= -{grid.RESOLVED_Z}): {summary['configurations_class0_below_lru_resolved']} "
            f"of {summary['configurations']}"
        )
    if runs:
        one = one_class_summary(runs)
        summary.update(one)
        print("\n-- one class (every request priority 0, no directives): unified against lru, s3fifo and arc")
        print(one_class_table(runs))
        print(
            f"one class: unified below lru in {one['one_class_below_lru']} of {len(runs)} runs, resolved in "
            f"{one['one_class_below_lru_resolved']}; configurations (workload x capacity) below lru over their "
            f"draws, resolved: {one['one_class_configurations_below_lru_resolved']}; at least the better of "
            f"s3fifo and arc in {one['one_class_at_least_rivals']}"
        )
        for r in sorted(runs, key=lambda r: (r["workload"], r["capacity"], r["seed"])):
            if r["vs_lru"] is not None and r["vs_lru"] < 1.0 and grid._resolved(r.get("paired")):
                print(
                    f"  {r['workload']} seed {r['seed']} {r['capacity']}: {r['vs_lru']:.4f}x lru; "
                    f"{grid.shortfall(r.get('paired'))}"
                )
    print(
        "re-run one cell with every policy: kvretain workload export NAME --seed S --out F.jsonl && "
        "python bench/robustness.py --trace F.jsonl --capacities N"
    )
    if args.json:
        doc = {
            "config": {
                "seeds": [lo, hi],
                "capacities": list(caps),
                "rules": list(rules),
                "rule_seed": args.seed,
                "one_class": args.one_class,
            },
            "cells": cells,
            "one_class": runs,
            "wall_s": round(wall, 1),
            "summary": summary,
        }
        grid.write_json(args.json, doc)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(script_main(main))
