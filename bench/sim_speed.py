"""Simulation speed on the whole Mooncake conversation trace (12,031 requests, one hour of traffic).

    python bench/sim_speed.py [TRACE] [--policy unified] [--replicas 6]

Reference priority rule, priority scheduling, Llama-3-8B on H100-SXM replicas behind the prefix-affinity
router, the eviction-policy settings of ``kvretain simulate`` (``SIM_POLICY_DEFAULTS``). Prints the
simulate summary, then as its last line JSON ``{"requests": n, "wall_s": s, "requests_per_wall_s": r}``
(target: under 60 s). ``wall_s`` covers loading the trace and simulating it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvretain.cli_sim import SIM_POLICY_DEFAULTS
from kvretain.engine.sim.simulator import SimConfig, Simulation
from kvretain.workloads import PRIORITY_RULES, load_mooncake, tag_priorities

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE))
    ap.add_argument("--policy", default="unified")
    ap.add_argument("--replicas", type=int, default=6)
    ap.add_argument("--router", default="prefix-affinity")
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    reqs = tag_priorities(load_mooncake(args.trace, limit=args.limit), PRIORITY_RULES.create("reference"))
    cfg = SimConfig(
        policy=args.policy,
        replicas=args.replicas,
        router=args.router,
        policy_config=SIM_POLICY_DEFAULTS,  # the settings of `kvretain simulate`
    )
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
    raise SystemExit(main())
