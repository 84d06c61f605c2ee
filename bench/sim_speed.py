"""Simulation speed on the whole Mooncake conversation trace (12,031 requests, one hour of traffic).

    python bench/sim_speed.py [TRACE] [--policy unified] [--replicas 6]

Reference priority rule, priority scheduling, Llama-3-8B on H100-SXM replicas behind the prefix-affinity
router, the eviction-policy settings of ``kvretain simulate`` (``SIM_POLICY_DEFAULTS``). Prints the
simulate summary, then as its last line JSON ``{"requests": n, "wall_s": s, "requests_per_wall_s": r}``
(target: under 60 s). ``wall_s`` covers loading the trace and simulating it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from kvretain.cli_args import (
    DefaultsHelpFormatter,
    Parser,
    add_limit_option,
    fail,
    integer,
    path_arg,
    script_main,
    summary_of,
)
from kvretain.cli_sim import SIM_POLICY_DEFAULTS, check_replicas_fit, check_router
from kvretain.core.policy import make_policy, policy_names
from kvretain.engine.sim.router import ROUTERS
from kvretain.engine.sim.simulator import SimConfig, Simulation
from kvretain.workloads import PRIORITY_RULES, load_mooncake, tag_priorities

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"
PROG = "sim_speed"
DEFAULT_ROUTER = "prefix-affinity"


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
    ap.add_argument(
        "--policy", default="unified", choices=policy_names(), help="eviction policy (default unified)"
    )
    ap.add_argument(
        "--replicas", type=integer(1), default=6, help="serving replicas behind the router (default 6)"
    )
    ap.add_argument(
        "--router",
        default=None,
        choices=ROUTERS.names(),
        help=f"router, 2 replicas or more (default {DEFAULT_ROUTER})",
    )
    add_limit_option(ap, "only the first N requests of the trace (default: all)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:  # (a router given with one replica changes nothing: kvretain simulate's and compare's rule)
        check_router(args.router, args.replicas)
    except ValueError as exc:
        return fail(PROG, str(exc))
    cfg = SimConfig(
        policy=args.policy,
        replicas=args.replicas,
        router=DEFAULT_ROUTER if args.router is None else args.router,
        policy_config=SIM_POLICY_DEFAULTS,  # the settings of `kvretain simulate`
    )
    try:  # a policy the simulator cannot run (one that needs the future): before the trace is read
        make_policy(cfg.policy, 1, cfg.policy_config)
    except ValueError as exc:
        return fail(PROG, f"argument --policy: {exc}")
    try:  # the replicas' pools in memory (kvretain simulate's bound): before the trace is read
        check_replicas_fit(cfg, [cfg.policy], "argument --replicas")
    except ValueError as exc:
        return fail(PROG, str(exc))
    t0 = time.perf_counter()
    try:  # (TraceError and WorkloadError are ValueErrors: they name the file, the line and the field)
        reqs = tag_priorities(load_mooncake(args.trace, limit=args.limit), PRIORITY_RULES.create("reference"))
    except ValueError as exc:
        return fail(PROG, f"argument trace: {exc}")
    summary = Simulation(cfg, reqs).run().summary()
    wall = time.perf_counter() - t0
    print(json.dumps(summary), file=sys.stderr)
    print(
        json.dumps(
            {
                "requests": len(reqs),
                "wall_s": round(wall, 2),
                "requests_per_wall_s": round(len(reqs) / wall, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(script_main(main))
