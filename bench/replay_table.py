"""The replay table: every policy at 875 / 5,000 / 20,000 blocks on the Mooncake conversation trace.

Priorities come from the reference rule of ``shared/traces/README.md`` (class 0 = important). The isolation
reference is ``lru`` replaying only the class-0 requests in the same pool. The script also sweeps the
``unified`` protection budget (fixed, no isolation controller) to show the class-0 / overall frontier.

    python bench/replay_table.py [--trace ../shared/traces/mooncake_conversation.jsonl] [--no-frontier]

Last line: JSON ``{"capacities": {cap: {"iso_class0": h, policy: {"hit_rate", "class0", "class1"}}},
"frontier": {cap: [{"budget", "hit_rate", "class0"}]}, "checks": {...}}``. A class the trace does not have is
``null`` there (``n/a`` in the table), and so is a ratio over a hit ratio of 0.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvretain.cli_args import DefaultsHelpFormatter, Parser, fail, integer, path_arg, script_main, summary_of
from kvretain.core.memory import PoolTooLargeError, check_pool_fits
from kvretain.core.policy import PolicyConfig, policy_names
from kvretain.replay import ReplayResult, TraceError, load_trace, replay
from kvretain.workloads.priority import make_rule

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"
ANCHORS = {875: 0.0437, 5000: 0.1118, 20000: 0.2878}
"""vLLM 0.33's LRU hit ratio on the Mooncake conversation trace at these capacities (shared/traces/README.md):
``checks.lru_matches_anchor`` compares lru with them on that trace (``null`` on another trace or capacity)."""


PROG = "replay_table"


def _class(res: ReplayResult, cls: int) -> float | None:
    """``res``'s hit ratio of class ``cls``; None when the trace has no request of that class."""
    st = res.classes.get(cls)
    return None if st is None else st.hit_rate


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def _ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` to 3 places; None when either is missing or ``b`` is 0 (no class 0, no hit at all)."""
    return None if a is None or not b else round(a / b, 3)


def _cell(x: float | None) -> str:
    return f"{x:>8.4f}" if x is not None else f"{'n/a':>8}"


def build_parser() -> Parser:
    """The command line (``--help`` shows every option's default)."""
    ap = Parser(prog=PROG, description=summary_of(__doc__), formatter_class=DefaultsHelpFormatter)
    ap.add_argument(
        "--trace",
        type=path_arg("a Mooncake-format JSONL file"),
        default=str(DEFAULT_TRACE),
        help="a Mooncake-format JSONL trace (default: ../shared/traces/mooncake_conversation.jsonl)",
    )
    ap.add_argument(
        "--capacities",
        type=integer(1, what=" (blocks)"),
        nargs="+",
        default=[875, 5000, 20000],
        help="pool sizes to replay at, in blocks of 512 tokens (one trace hash id each)",
    )
    ap.add_argument(
        "--no-frontier", action="store_true", help="skip the sweep of unified's protection budget"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_pool_fits(
            max(args.capacities), policy_names(), PolicyConfig(block_size=512), "argument --capacities"
        )
    except PoolTooLargeError as exc:
        return fail(PROG, str(exc))
    try:
        reqs = load_trace(args.trace, rule=make_rule("reference"))
    except TraceError as exc:
        return fail(PROG, f"argument --trace: {exc}")
    # the anchors are the conversation trace's (shared/traces/README.md), measured at ANCHORS' capacities
    anchored = Path(args.trace).name == DEFAULT_TRACE.name
    iso = [r for r in reqs if r.priority == 0]
    out: dict = {"capacities": {}, "frontier": {}, "checks": {}}
    names = policy_names()
    print(f"{'cap':>6} {'policy':>9} {'overall':>8} {'class0':>8} {'class1':>8} {'wall_s':>7}")
    for cap in args.capacities:
        row: dict = {}
        ref = replay(iso, cap, "lru").hit_rate if iso else None
        row["iso_class0"] = _round(ref)
        for name in names:
            t0 = time.perf_counter()
            res = replay(reqs, cap, name, PolicyConfig(block_size=512))
            wall = time.perf_counter() - t0
            c0, c1 = _class(res, 0), _class(res, 1)
            row[name] = {
                "hit_rate": round(res.hit_rate, 4),
                "class0": _round(c0),
                "class1": _round(c1),
                "wall_s": round(wall, 2),
            }
            print(f"{cap:>6} {name:>9} {res.hit_rate:>8.4f} {_cell(c0)} {_cell(c1)} {wall:>7.2f}", flush=True)
        print(f"{cap:>6} {'iso-ref':>9} {'':>8} {_cell(ref)}   (lru, class-0 requests only)", flush=True)
        out["capacities"][str(cap)] = row
        online = [n for n in names if n != "belady"]
        out["checks"][str(cap)] = {
            "lru_matches_anchor": abs(row["lru"]["hit_rate"] - ANCHORS[cap]) <= 0.002
            if cap in ANCHORS and anchored
            else None,  # (no anchor measured for this trace at this capacity: no check)
            "belady_at_least_online": all(row["belady"]["hit_rate"] >= row[n]["hit_rate"] for n in online),
            "priority_class0_vs_iso": _ratio(row["priority"]["class0"], ref),
            "unified_class0_vs_iso": _ratio(row["unified"]["class0"], ref),
            "unified_overall_vs_lru": _ratio(row["unified"]["hit_rate"], row["lru"]["hit_rate"]),
        }
        if not args.no_frontier:
            pts = []
            for budget in (0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 0.9, 1.0):
                res = replay(
                    reqs, cap, "unified", PolicyConfig(block_size=512, budget=budget, isolation_goal=None)
                )
                c0 = _class(res, 0)
                pts.append({"budget": budget, "hit_rate": round(res.hit_rate, 4), "class0": _round(c0)})
                print(
                    f"{cap:>6} frontier budget={budget:.1f} overall={res.hit_rate:.4f} class0={_cell(c0).strip()}",
                    flush=True,
                )
            out["frontier"][str(cap)] = pts
            ok = [
                p["budget"]
                for p in pts
                if ref is not None
                and p["class0"] is not None
                and p["class0"] >= 0.9 * ref
                and p["hit_rate"] >= row["lru"]["hit_rate"]
            ]
            out["checks"][str(cap)]["fixed_budgets_meeting_both"] = ok
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(script_main(main))
