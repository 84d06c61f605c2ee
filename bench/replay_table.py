"""The replay table: every policy at 875 / 5,000 / 20,000 blocks on the Mooncake conversation trace.

Priorities come from the reference rule of ``shared/traces/README.md`` (class 0 = important). The isolation
reference is ``lru`` replaying only the class-0 requests in the same pool. The script also sweeps the
``unified`` protection budget (fixed, no isolation controller) to show the class-0 / overall frontier.

    python bench/replay_table.py [--trace ../shared/traces/mooncake_conversation.jsonl] [--no-frontier]

Last line: JSON ``{"capacities": {cap: {"iso_class0": h, policy: {"hit_rate", "class0", "class1"}}},
"frontier": {cap: [{"budget", "hit_rate", "class0"}]}, "checks": {...}}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvretain.core.policy import PolicyConfig, policy_names
from kvretain.replay import load_trace, replay
from kvretain.workloads.priority import make_rule

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"
ANCHORS = {875: 0.0437, 5000: 0.1118, 20000: 0.2878}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--capacities", type=int, nargs="*", default=[875, 5000, 20000])
    ap.add_argument("--no-frontier", action="store_true")
    args = ap.parse_args()
    reqs = load_trace(args.trace, rule=make_rule("reference"))
    iso = [r for r in reqs if r.priority == 0]
    out: dict = {"capacities": {}, "frontier": {}, "checks": {}}
    names = policy_names()
    print(f"{'cap':>6} {'policy':>9} {'overall':>8} {'class0':>8} {'class1':>8} {'wall_s':>7}")
    for cap in args.capacities:
        row: dict = {}
        ref = replay(iso, cap, "lru").hit_rate
        row["iso_class0"] = round(ref, 4)
        for name in names:
            t0 = time.perf_counter()
            res = replay(reqs, cap, name, PolicyConfig(block_size=512))
            wall = time.perf_counter() - t0
            c0, c1 = res.classes[0].hit_rate, res.classes[1].hit_rate
            row[name] = {
                "hit_rate": round(res.hit_rate, 4),
                "class0": round(c0, 4),
                "class1": round(c1, 4),
                "wall_s": round(wall, 2),
            }
            print(f"{cap:>6} {name:>9} {res.hit_rate:>8.4f} {c0:>8.4f} {c1:>8.4f} {wall:>7.2f}", flush=True)
        print(f"{cap:>6} {'iso-ref':>9} {'':>8} {ref:>8.4f}   (lru, class-0 requests only)", flush=True)
        out["capacities"][str(cap)] = row
        online = [n for n in names if n != "belady"]
        out["checks"][str(cap)] = {
            "lru_matches_anchor": abs(row["lru"]["hit_rate"] - ANCHORS.get(cap, row["lru"]["hit_rate"]))
            <= 0.002,
            "belady_at_least_online": all(row["belady"]["hit_rate"] >= row[n]["hit_rate"] for n in online),
            "priority_class0_vs_iso": round(row["priority"]["class0"] / ref, 3),
            "unified_class0_vs_iso": round(row["unified"]["class0"] / ref, 3),
            "unified_overall_vs_lru": round(row["unified"]["hit_rate"] / row["lru"]["hit_rate"], 3),
        }
        if not args.no_frontier:
            pts = []
            for budget in (0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 0.9, 1.0):
                res = replay(
                    reqs, cap, "unified", PolicyConfig(block_size=512, budget=budget, isolation_goal=None)
                )
                pts.append(
                    {
                        "budget": budget,
                        "hit_rate": round(res.hit_rate, 4),
                        "class0": round(res.classes[0].hit_rate, 4),
                    }
                )
                print(
                    f"{cap:>6} frontier budget={budget:.1f} overall={res.hit_rate:.4f} "
                    f"class0={res.classes[0].hit_rate:.4f}",
                    flush=True,
                )
            out["frontier"][str(cap)] = pts
            ok = [
                p["budget"]
                for p in pts
                if p["class0"] >= 0.9 * ref and p["hit_rate"] >= row["lru"]["hit_rate"]
            ]
            out["checks"][str(cap)]["fixed_budgets_meeting_both"] = ok
    print(json.dumps(out))


if __name__ == "__main__":
    main()
