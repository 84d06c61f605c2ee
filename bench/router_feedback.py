"""Does the router undo what each replica's reuse floor promises? ``lru`` against ``unified`` behind two prefix
routers, on one trace, in the serving simulator.

``unified``'s controller keeps each replica's pool near what plain LRU would hit *on the traffic that replica is
sent*. A router that routes by the replicas' cache state (``prefix-affinity``, as routers that follow the engines'
KV-cache events) lets the eviction policy decide the routing too: a prefix that protection evicted sends the
conversation's next turn to another replica, where it is computed and cached again, and no replica's reference
sees the cluster's loss. A router that routes by its own record of what it sent where (``prefix-memory``, as
SGLang's cache-aware router and vLLM production stack's prefix-aware router) does not. For each router this runs
``lru``, ``unified`` with the defaults and ``unified`` with the retention weights alone (``isolation_goal=None,
budget=0``: no protected tier), and counts the requests (of at least one full block) whose prefix no replica held
when they were routed (docs/results.md, "A public trace no session had").

    python bench/router_feedback.py [TRACE] [--replicas 8] [--rule reference] [--seed 0] [--limit N] [--jobs 2]
                                    [--json F]

The trace's requests get their priority from ``--rule`` (as ``kvretain simulate --priority-rule``; it must make two
classes, one of them class 0, which ``unified`` protects);
priority scheduling, Llama-3-8B on H100 replicas (the catalog's roofline), the settings of ``kvretain simulate``.
Last line JSON: ``{"replicas": n, "routers": {router: {"unified_vs_lru_hits": r, "weights_vs_lru_hits": r,
"unified_vs_lru_recomputed": r, "lru_unmatched": n, "unified_unmatched": n}}}``.
"""

from __future__ import annotations

import dataclasses
import json
import random
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
    json_text,
    path_arg,
    script_main,
    summary_of,
)
from kvretain.cli_sim import SIM_POLICY_DEFAULTS, check_replicas_fit
from kvretain.engine.sim.replica import routing_blocks
from kvretain.engine.sim.simulator import SimConfig, Simulation
from kvretain.fileio import output_file
from kvretain.workloads import WorkloadRequest, load_mooncake, tag_priorities
from kvretain.workloads.priority import make_rule, rule_choices

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"
PROG = "router_feedback"
ROUTERS = ("prefix-affinity", "prefix-memory")
SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {  # label -> (policy, PolicyConfig overrides)
    "lru": ("lru", {}),
    "unified": ("unified", {}),
    "weights": ("unified", {"isolation_goal": None, "budget": 0.0}),
}


def requests(trace: str, rule: str, limit: int | None, seed: int) -> list[WorkloadRequest]:
    """The trace's requests with their priorities from ``rule`` (as ``kvretain simulate --priority-rule``, its
    random rules drawn from ``Random(seed + 1)``); a bad line or setting is a ``ValueError``."""
    reqs = load_mooncake(trace, limit=limit)
    tagger = make_rule(rule, reqs, random.Random(seed + 1))
    return reqs if tagger is None else tag_priorities(reqs, tagger)


def sim_config(replicas: int, router: str, label: str) -> SimConfig:
    """The simulator's settings of one run: setting ``label`` behind ``router``."""
    policy, over = SETTINGS[label]
    return SimConfig(
        policy=policy,
        replicas=replicas,
        router=router,
        policy_config=dataclasses.replace(SIM_POLICY_DEFAULTS, **over),
    )  # (the scheduler's queue: priority, as ``kvretain simulate``'s default)


def run_one(
    trace: str, rule: str, limit: int | None, seed: int, replicas: int, router: str, label: str
) -> dict[str, Any]:
    """One simulation's summary, with ``unmatched``: the requests with at least one full block whose prefix no
    replica's cache held when the router placed them."""
    cfg = sim_config(replicas, router, label)
    sim = Simulation(cfg, requests(trace, rule, limit, seed))
    unmatched = [0]
    route = sim.router.route
    bs = cfg.block_size

    def counted(req: Any, reps: Any) -> int:
        if routing_blocks(req, bs) and all(r.kv.prefix_match(req) == 0 for r in reps):
            unmatched[0] += 1
        return route(req, reps)

    sim.router.route = counted  # type: ignore[method-assign]
    out = sim.run().summary()
    out["unmatched"] = unmatched[0]
    return {"router": router, "setting": label, "summary": out}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r}x"


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(router: str, runs: dict[str, dict[str, Any]]) -> str:
    """One router's runs, a row each: hits, recomputed tokens, unmatched requests, per class TTFT p99, mean e2e
    and hit ratio."""
    base = runs["lru"]
    classes = sorted(base["classes"], key=int)
    head = ["setting", "hit ratio", "recomputed", "unmatched"] + [
        f"c{c} TTFT p99 / mean e2e / hit" for c in classes
    ]
    rows = []
    for label, s in runs.items():
        cells = [
            label,
            f"{_f(s['hit_rate'], '.4f')} ({_x(_ratio(s['hit_rate'], base['hit_rate']))})",
            f"{s['recomputed_tokens']:,} ({_x(_ratio(s['recomputed_tokens'], base['recomputed_tokens']))})",
            f"{s['unmatched']:,}",
        ]
        for c in classes:
            k = s["classes"].get(c, {})
            cells.append(
                f"{_f(k.get('ttft_p99_s'), '.3f')} s / {_f(k.get('e2e_mean_s'), '.3f')} s / "
                f"{_f(k.get('hit_rate'), '.3f')}"
            )
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
        choices=rule_choices(),
        help="how the trace's requests get a priority (as `kvretain simulate --priority-rule`; keep: the trace's "
        "own field)",
    )
    ap.add_argument(
        "--seed",
        type=integer(0),
        default=0,
        help="seed of the random priority rules (drawn from Random(seed + 1), as `kvretain simulate`)",
    )
    add_limit_option(ap, "only the first N requests of the trace (default: all)")
    ap.add_argument("--jobs", type=integer(1), default=2, help="simulations run at once, one process each")
    ap.add_argument(
        "--json",
        type=path_arg("a file name"),
        help="write every run's summary to this file as JSON (default: not written)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not Path(args.trace).is_file():
        why = "is a folder" if Path(args.trace).is_dir() else "not found"
        return fail(PROG, f"argument trace: {args.trace} {why} (pass a Mooncake-format JSONL file)")
    if args.json is not None:
        try:
            check_output_file(args.json, "--json")
        except ValueError as exc:
            return fail(PROG, str(exc))
    jobs = [(r, label) for r in ROUTERS for label in SETTINGS]
    try:  # the replicas' pools of the runs at once in memory (kvretain simulate's bound), before any is read
        cfg = sim_config(args.replicas, next(iter(ROUTERS)), "lru")
        check_replicas_fit(
            cfg, [p for p, _ in SETTINGS.values()], "argument --replicas", min(args.jobs, len(jobs))
        )
    except ValueError as exc:
        return fail(PROG, str(exc))
    try:  # the whole trace, tagged (a bad line names the file, the line and the field): before any simulation
        reqs = requests(args.trace, args.rule, args.limit, args.seed)
    except ValueError as exc:
        return fail(PROG, f"argument trace: {exc}")
    if len({r.priority for r in reqs}) < 2:
        return fail(
            PROG,
            f"argument --rule: {args.rule} gives the trace's requests one priority (pick a rule "
            "that makes two classes)",
        )
    if not any(r.priority == 0 for r in reqs):  # (two classes, neither the one unified protects)
        return fail(
            PROG,
            f"argument --rule: {args.rule} gives no request priority 0, the class unified protects (pick a rule "
            "that makes class 0 and another)",
        )
    del reqs
    t0 = time.perf_counter()
    done: dict[str, dict[str, dict[str, Any]]] = {r: {} for r in ROUTERS}
    with ProcessPoolExecutor(max_workers=min(args.jobs, len(jobs))) as pool:
        futs = [
            pool.submit(run_one, args.trace, args.rule, args.limit, args.seed, args.replicas, r, label)
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
    if args.json is not None:
        try:
            with output_file(
                args.json
            ) as f:  # (whole or not at all; a standard stream through its own descriptor)
                f.write(json_text({"config": vars(args), "runs": done}, indent=1) + "\n")
        except OSError as exc:  # (a full disk: checked writable before the runs, not for room)
            return fail(PROG, f"argument --json: cannot write {args.json!r}: {exc.strerror or exc}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(script_main(main))
