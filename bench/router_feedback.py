"""Does the router undo what each replica's reuse floor promises? ``lru`` against ``unified`` behind two prefix
routers, on one trace, in the serving simulator.

``unified``'s controller keeps each replica's pool near what plain LRU would hit *on the traffic that replica is
sent*. A router that routes by the replicas' cache state (``prefix-affinity``, as routers that follow the engines'
KV-cache events) lets the eviction policy decide the routing too: a prefix that protection evicted sends the
conversation's next turn to another replica, where it is computed and cached again, and no replica's reference
sees the cluster's loss. A router that routes by its own record of what it sent where (``prefix-memory``, as
SGLang's cache-aware router and vLLM production stack's prefix-aware router) does not. For each router this runs
``lru``, ``unified`` with the defaults and ``unified`` with the retention weights alone (``isolation_goal=None,
budget=0``: no protected tier), and counts the requests whose prefix no replica held when they were routed
(docs/results.md, "A public trace no session had").

    python bench/router_feedback.py [TRACE] [--replicas 8] [--rule reference] [--limit N] [--jobs 2] [--json F]

The trace's requests get their priority from ``--rule`` (the registry of ``kvretain simulate --priority-rule``);
priority scheduling, Llama-3-8B on H100 replicas (the catalog's roofline), the settings of ``kvretain simulate``.
Last line JSON: ``{"replicas": n, "routers": {router: {"unified_vs_lru_hits": r, "weights_vs_lru_hits": r,
"unified_vs_lru_recomputed": r, "lru_unmatched": n, "unified_unmatched": n}}}``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvretain.cli_args import (
    DefaultsHelpFormatter,
    Parser,
    add_limit_option,
    check_output_file,
    fail,
    integer,
    path_arg,
    summary_of,
)
from kvretain.cli_sim import SIM_POLICY_DEFAULTS
from kvretain.engine.sim.simulator import SimConfig, Simulation
from kvretain.workloads import PRIORITY_RULES, load_mooncake, tag_priorities

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"
PROG = "router_feedback"
ROUTERS = ("prefix-affinity", "prefix-memory")
SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {  # label -> (policy, PolicyConfig overrides)
    "lru": ("lru", {}),
    "unified": ("unified", {}),
    "weights": ("unified", {"isolation_goal": None, "budget": 0.0}),
}


def run_one(
    trace: str, rule: str, limit: int | None, replicas: int, router: str, label: str
) -> dict[str, Any]:
    """One simulation's summary, with ``unmatched``: the requests whose prefix no replica's cache held when the
    router placed them."""
    policy, over = SETTINGS[label]
    cfg = SimConfig(
        policy=policy,
        replicas=replicas,
        router=router,
        policy_config=dataclasses.replace(SIM_POLICY_DEFAULTS, **over),
    )  # (the scheduler's queue: priority, as ``kvretain simulate``'s default)
    reqs = tag_priorities(load_mooncake(trace, limit=limit), PRIORITY_RULES.create(rule))
    sim = Simulation(cfg, reqs)
    unmatched = [0]
    route = sim.router.route

    def counted(req: Any, reps: Any) -> int:
        if all(r.kv.prefix_match(req) == 0 for r in reps):
            unmatched[0] += 1
        return route(req, reps)

    sim.router.route = counted  # type: ignore[method-assign]
    out = sim.run().summary()
    out["unmatched"] = unmatched[0]
    return {"router": router, "setting": label, "summary": out}


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def table(router: str, runs: dict[str, dict[str, Any]]) -> str:
    """One router's runs, a row each: hits, recomputed tokens, unmatched requests, per class TTFT p99 and e2e."""
    base = runs["lru"]
    classes = sorted(base["classes"], key=int)
    head = ["setting", "hit ratio", "recomputed", "unmatched"] + [
        f"c{c} TTFT p99 / e2e / hit" for c in classes
    ]
    rows = []
    for label, s in runs.items():
        cells = [
            label,
            f"{s['hit_rate']:.4f} ({_ratio(s['hit_rate'], base['hit_rate'])}x)",
            f"{s['recomputed_tokens']:,} ({_ratio(s['recomputed_tokens'], base['recomputed_tokens'])}x)",
            f"{s['unmatched']:,}",
        ]
        for c in classes:
            k = s["classes"][c]
            cells.append(f"{k['ttft_p99_s']:.3f} s / {k['e2e_mean_s']:.3f} s / {k['hit_rate']:.3f}")
        rows.append(cells)
    width = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [f"-- {router}", "  ".join(h.ljust(w) for h, w in zip(head, width, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)) for r in rows]
    return "\n".join(lines)


def build_parser() -> Parser:
    """The command line (``--help`` shows every option's default)."""
    ap = Parser(prog=PROG, description=summary_of(__doc__), formatter_class=DefaultsHelpFormatter)
    ap.add_argument(
        "trace",
        nargs="?",
        type=path_arg("a Mooncake-format JSONL file"),
        default=str(DEFAULT_TRACE),
        help="a Mooncake-format trace (default: ../shared/traces/mooncake_conversation.jsonl)",
    )
    ap.add_argument("--replicas", type=integer(2), default=8, help="replicas behind the router (at least 2)")
    ap.add_argument(
        "--rule",
        default="reference",
        choices=[r for r in PRIORITY_RULES.names() if r != "none"],
        help="priority rule for the trace's requests",
    )
    add_limit_option(ap, "only the first N requests of the trace (default: all)")
    ap.add_argument("--jobs", type=integer(1), default=2, help="simulations run at once, one process each")
    ap.add_argument("--json", help="write every run's summary to this file as JSON (default: not written)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not Path(args.trace).is_file():
        why = "is a folder" if Path(args.trace).is_dir() else "not found"
        return fail(PROG, f"argument trace: {args.trace} {why} (pass a Mooncake-format JSONL file)")
    if args.json:
        try:
            check_output_file(args.json, "--json")
        except ValueError as exc:
            return fail(PROG, str(exc))
    try:  # (a bad line names the file, the line and the field): before the simulations start
        load_mooncake(args.trace, limit=1)
    except ValueError as exc:
        return fail(PROG, f"argument trace: {exc}")
    jobs = [(r, label) for r in ROUTERS for label in SETTINGS]
    t0 = time.perf_counter()
    done: dict[str, dict[str, dict[str, Any]]] = {r: {} for r in ROUTERS}
    with ProcessPoolExecutor(max_workers=min(args.jobs, len(jobs))) as pool:
        futs = [
            pool.submit(run_one, args.trace, args.rule, args.limit, args.replicas, r, label)
            for r, label in jobs
        ]
        for i, fut in enumerate(as_completed(futs), 1):
            res = fut.result()
            done[res["router"]][res["setting"]] = res["summary"]
            print(
                f"[{i}/{len(jobs)}] {res['router']} {res['setting']} done ({time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
            )
    out: dict[str, Any] = {"replicas": args.replicas, "routers": {}}
    for r in ROUTERS:
        runs = {label: done[r][label] for label in SETTINGS}
        print(table(r, runs))
        lru, uni, w = runs["lru"], runs["unified"], runs["weights"]
        out["routers"][r] = {
            "unified_vs_lru_hits": _ratio(uni["hit_rate"], lru["hit_rate"]),
            "weights_vs_lru_hits": _ratio(w["hit_rate"], lru["hit_rate"]),
            "unified_vs_lru_recomputed": _ratio(uni["recomputed_tokens"], lru["recomputed_tokens"]),
            "lru_unmatched": lru["unmatched"],
            "unified_unmatched": uni["unmatched"],
        }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "runs": done}, f, indent=1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
