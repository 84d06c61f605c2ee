"""The ``kvretain`` command line: ``kvretain replay``, ``kvretain policies``; ``simulate`` and ``compare``
live in :mod:`kvretain.cli_sim`, ``workload export`` / ``workload list`` in :mod:`kvretain.cli_workload`.

Choices (policies, priority rules) are listed from the registries.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

from kvretain.core.policy import POLICIES, PolicyConfig, policy_names
from kvretain.core.retention import PriorityMapping, RetentionError
from kvretain.registry import Registry
from kvretain.replay import (
    ReplayRequest,
    ReplayResult,
    TraceError,
    load_trace,
    reference_priority,
    replay,
    synthetic_conversations,
)

PRIORITY_RULES: Registry[Any] = Registry("priority rule")
PRIORITY_RULES.add("keep", lambda: None, "keep the trace's own priority field (default 0)")
PRIORITY_RULES.add(
    "reference", lambda: reference_priority, "shared/traces README rule: hash_ids[1] % 4 == 0 -> 0"
)


def _progress(enabled: bool, desc: str) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    def wrap(it: Iterable[int]) -> Iterable[int]:
        return tqdm(it, desc=desc, unit="req", leave=False, mininterval=0.5, file=sys.stderr)

    return wrap


def _policy_config(args: argparse.Namespace, block_tokens: int) -> PolicyConfig:
    return PolicyConfig(
        budget=args.budget,
        isolation_goal=None if args.isolation_goal <= 0 else args.isolation_goal,
        priority_weight=args.priority_weight,
        frequency_exponent=args.frequency_exponent,
        cost_scale_tokens=args.cost_scale_tokens,
        block_size=block_tokens,
    )


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [
        max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)
    ]
    line = "  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join([line, sep, *body])


def _result_rows(results: Sequence[ReplayResult]) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        row: dict[str, Any] = {
            "policy": r.policy,
            "capacity": r.capacity_blocks,
            "requests": r.requests,
            "hit_rate": f"{r.hit_rate:.4f}",
        }
        for c, st in sorted(r.classes.items()):
            row[f"class {c} hit"] = f"{st.hit_rate:.4f}"
            row[f"class {c} evicted"] = st.evicted_blocks
        rows.append(row)
    return rows


def cmd_replay(args: argparse.Namespace) -> int:
    tagger = PRIORITY_RULES.create(args.priority_rule)
    requests: list[ReplayRequest]
    if args.trace is None:
        requests = synthetic_conversations(num_sessions=args.sessions, seed=args.seed)
        source = f"built-in synthetic conversations ({args.sessions} sessions, seed {args.seed})"
    else:
        requests = load_trace(args.trace, limit=args.limit, tagger=tagger)
        source = str(args.trace)
    policies = policy_names() if args.policy == "all" else [args.policy]
    mapping = PriorityMapping.parse(args.priority_mapping)
    results = []
    for name in policies:
        t0 = time.perf_counter()
        res = replay(
            requests,
            args.capacity_blocks,
            name,
            _policy_config(args, args.block_tokens),
            mapping,
            args.block_tokens,
            progress=_progress(not args.json and sys.stderr.isatty(), name),
        )
        wall = time.perf_counter() - t0
        results.append((res, wall))
    if args.json:
        objs = []
        for res, wall in results:
            obj = res.to_json()
            obj["wall_s"] = round(wall, 3)
            objs.append(obj)
        print(json.dumps(objs[0] if len(objs) == 1 else objs, indent=None if len(objs) == 1 else 1))
    else:
        print(f"replay of {source}: {len(requests)} requests, {args.capacity_blocks} blocks")
        rows = _result_rows([r for r, _ in results])
        for row, (_, wall) in zip(rows, results, strict=True):
            row["wall_s"] = f"{wall:.2f}"
        cols = list(dict.fromkeys(k for row in rows for k in row))
        print(format_table(rows, cols))
    return 0


def cmd_policies(args: argparse.Namespace) -> int:
    policy_names()
    for name, doc in POLICIES.describe().items():
        print(f"{name:10s} {doc}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvretain", description="Priority-aware KV cache retention for LLM serving."
    )
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser(
        "replay", help="block-level cache replay of a Mooncake-format trace (or a built-in workload)"
    )
    r.add_argument(
        "trace", nargs="?", help="Mooncake-format JSONL (omit for the built-in synthetic workload)"
    )
    r.add_argument("--capacity-blocks", type=int, default=600, help="pool size in trace blocks (default 600)")
    r.add_argument(
        "--policy", default="all", choices=[*policy_names(), "all"], help="eviction policy (default all)"
    )
    r.add_argument("--json", action="store_true", help="print one JSON object (a list with --policy all)")
    r.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    r.add_argument(
        "--priority-rule", default="keep", choices=PRIORITY_RULES.names(), help="how requests get a priority"
    )
    r.add_argument(
        "--priority-mapping",
        default="",
        help="request priority -> retention priority: 'normal=0,step=10,base=35' (default) or a table '0:60,1:35'",
    )
    r.add_argument("--block-tokens", type=int, default=512, help="tokens per trace block (Mooncake: 512)")
    r.add_argument("--sessions", type=int, default=400, help="built-in workload: number of sessions")
    r.add_argument("--seed", type=int, default=0, help="built-in workload: random seed")
    d = PolicyConfig()
    r.add_argument("--budget", type=float, default=d.budget, help="unified: max protected share of the pool")
    r.add_argument(
        "--isolation-goal",
        type=float,
        default=d.isolation_goal or 0.0,
        help="unified: adapt the protected share to keep this fraction of the isolated hit ratio (0: fixed budget)",
    )
    r.add_argument(
        "--priority-weight", type=float, default=d.priority_weight, help="unified: value x per +10 points"
    )
    r.add_argument(
        "--frequency-exponent", type=float, default=d.frequency_exponent, help="unified: uses ** this"
    )
    r.add_argument(
        "--cost-scale-tokens", type=float, default=d.cost_scale_tokens, help="unified: depth cost scale"
    )
    r.set_defaults(func=cmd_replay)

    pol = sub.add_parser("policies", help="list the eviction policies")
    pol.set_defaults(func=cmd_policies)

    from kvretain.cli_sim import add_subcommands
    from kvretain.cli_workload import add_subcommands as add_workload_subcommands

    add_subcommands(sub)
    add_workload_subcommands(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (TraceError, RetentionError, ValueError, KeyError) as exc:
        print(f"kvretain: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
