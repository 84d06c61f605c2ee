"""``kvretain simulate`` and ``kvretain compare``: the serving simulator on the command line.

``add_subcommands(subparsers)`` is called by :func:`kvretain.cli.build_parser`. Choices come from the
registries (eviction policies, queue policies, routers, workloads, priority rules, cost models).
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvretain.core.policy import PolicyConfig, policy_names
from kvretain.core.retention import PriorityMapping
from kvretain.engine.sim.catalog import load_catalog
from kvretain.engine.sim.costmodel import COST_MODELS
from kvretain.engine.sim.metrics import DEFAULT_SLOS, parse_slos
from kvretain.engine.sim.router import ROUTERS
from kvretain.engine.sim.simulator import SimConfig, Simulation
from kvretain.sched.config import SchedulerConfig
from kvretain.sched.queue import QUEUE_POLICIES
from kvretain.workloads import PRIORITY_RULES, WORKLOADS, WorkloadRequest, tag_priorities
from kvretain.workloads.priority import make_rule

_SUFFIX_WORKLOAD = {".jsonl": "mooncake", ".csv": "azure"}

SIM_POLICY_DEFAULTS = PolicyConfig(priority_weight=8.0, budget=0.8)
"""Eviction-policy settings of ``kvretain simulate`` / ``compare`` (each overridable by a flag).

Core's ``PolicyConfig`` defaults, except ``priority_weight`` 8 instead of 2 and ``budget`` 0.8 instead of 0.95.
With the default request-priority mapping (priority 0 -> retention 35, 1 -> 25, 2 -> 15) and
``protect_threshold`` 35, only request priority 0 is protected (plus blocks under an explicit directive >= 35,
such as the agents' 80 for 12 s); the adaptive protected share (``isolation_goal`` 0.9) sizes itself to what
priority 0 needs, up to ``budget``. On the multi-tenant workload priority 0 stays below its goal, so the
share sits at the budget: 0.8 leaves a fifth of the pool to the other tenants (0.9 and 0.95 raised class-0
p99 TTFT at seed 0 without helping other seeds). Outside the protected tier, and when protected blocks
exceed their share, blocks compete on GreedyDual keys whose value is
``priority_weight ** ((retention - 35) / 10)`` times their use count: weight 8 makes a chat block worth 64x a
batch block of equal use (weight 2: 4x). Measured on the multi-tenant defaults in docs/results.md; the
Mooncake figures there use the same settings.
"""


# ---------------------------------------------------------------------------------------------- args
def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="?", help="trace file (Mooncake .jsonl or Azure .csv); omit for --workload")
    p.add_argument(
        "--workload",
        choices=WORKLOADS.names(),
        default=None,
        help="workload (default: multi-tenant, or from the trace file's suffix)",
    )
    p.add_argument(
        "--priority-rule",
        default="keep",
        choices=["keep", *PRIORITY_RULES.names()],
        help="how trace requests get a priority (keep: the trace's own field, default 0)",
    )
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival and think times")
    p.add_argument("--seed", type=int, default=0, help="random seed of the workload (default 0)")
    p.add_argument("--open-loop", action="store_true", help="ignore follow-up links: open-loop arrivals")
    g = p.add_argument_group("scheduler")
    g.add_argument("--scheduling", default="priority", choices=QUEUE_POLICIES.names(), help="queue policy")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget per step")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most running requests per replica")
    g.add_argument("--no-chunked-prefill", action="store_true", help="disable chunked prefill")
    g.add_argument(
        "--waiting-preempts-running",
        action="store_true",
        help="let a waiting request preempt less important running ones (vLLM issue #40004)",
    )
    h = p.add_argument_group("hardware")
    h.add_argument("--model", default="llama-3-8b", help="model from the catalog (default llama-3-8b)")
    h.add_argument("--gpu", default="h100-sxm", help="GPU from the catalog (default h100-sxm)")
    h.add_argument("--tp", type=int, default=None, help="tensor parallelism (default: the model's)")
    h.add_argument("--catalog", default=None, help="TOML file adding models/GPUs to the catalog")
    h.add_argument("--cost-model", default="roofline", choices=COST_MODELS.names())
    h.add_argument("--replicas", type=int, default=1, help="replicas behind the router (default 1)")
    h.add_argument("--router", default="least-loaded", choices=ROUTERS.names())
    h.add_argument("--kv-blocks", type=int, default=None, help="KV blocks per replica (default: cost model)")
    h.add_argument("--gpu-mem-util", type=float, default=0.9, help="memory share for weights + KV")
    h.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    c = p.add_argument_group("cache (defaults: SIM_POLICY_DEFAULTS, see the module docstring)")
    d = SIM_POLICY_DEFAULTS
    c.add_argument("--budget", type=float, default=d.budget, help="unified: max protected share")
    c.add_argument(
        "--isolation-goal",
        type=float,
        default=d.isolation_goal or 0.0,
        help="unified: adaptive protection goal (0: fixed budget)",
    )
    c.add_argument(
        "--protect-threshold",
        type=int,
        default=d.protect_threshold,
        help="unified: retention priority from which blocks are protected (default 35: request priority 0)",
    )
    c.add_argument(
        "--priority-weight",
        type=float,
        default=d.priority_weight,
        help=f"unified: value factor per +10 retention points (default {d.priority_weight:g})",
    )
    c.add_argument("--frequency-exponent", type=float, default=d.frequency_exponent)
    c.add_argument(
        "--cost-scale-tokens",
        type=float,
        default=d.cost_scale_tokens,
        help="unified: recompute-cost depth scale in tokens (0: off)",
    )
    c.add_argument(
        "--priority-mapping",
        default="",
        help="request -> retention priority: 'normal=0,step=10,base=35' (default: 0 -> 35, 1 -> 25, 2 -> 15) "
        "or a table '0:60,1:35'",
    )
    c.add_argument(
        "--slo",
        default=",".join(f"{k}={v.ttft_s:g}:{v.tpot_s:g}" for k, v in DEFAULT_SLOS.items()),
        help="per-class targets 'class=ttft_s:tpot_s,...' (larger classes take the last one)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def load_workload(args: argparse.Namespace) -> tuple[list[WorkloadRequest], str]:
    name = args.workload
    if name is None:
        name = "multi-tenant" if args.trace is None else _SUFFIX_WORKLOAD.get(Path(args.trace).suffix)
        if name is None:
            raise ValueError(f"cannot tell the trace format of {args.trace!r}: pass --workload")
    rng = random.Random(args.seed)
    reqs = WORKLOADS.create(name, rng=rng, path=args.trace, limit=args.limit, time_scale=args.time_scale)
    if args.priority_rule != "keep":
        reqs = tag_priorities(reqs, make_rule(args.priority_rule, reqs, random.Random(args.seed + 1)))
    return reqs, name if args.trace is None else f"{name}:{args.trace}"


def sim_config(args: argparse.Namespace, policy: str) -> SimConfig:
    return SimConfig(
        model=args.model,
        gpu=args.gpu,
        tp=args.tp,
        cost_model=args.cost_model,
        replicas=args.replicas,
        router=args.router,
        kv_blocks=args.kv_blocks,
        gpu_mem_utilization=args.gpu_mem_util,
        block_size=args.block_size,
        policy=policy,
        policy_config=replace(
            SIM_POLICY_DEFAULTS,
            budget=args.budget,
            isolation_goal=None if args.isolation_goal <= 0 else args.isolation_goal,
            protect_threshold=args.protect_threshold,
            priority_weight=args.priority_weight,
            frequency_exponent=args.frequency_exponent,
            cost_scale_tokens=args.cost_scale_tokens,
            block_size=args.block_size,
        ),
        mapping=PriorityMapping.parse(args.priority_mapping),
        sched=SchedulerConfig(
            policy=args.scheduling,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            enable_chunked_prefill=not args.no_chunked_prefill,
            waiting_preempts_running=args.waiting_preempts_running,
        ),
        closed_loop=not args.open_loop,
        slos=parse_slos(args.slo),
        catalog=load_catalog(args.catalog) if args.catalog else None,
    )


def _run(cfg: SimConfig, reqs: Sequence[WorkloadRequest], show: bool, desc: str) -> Simulation:
    sim = Simulation(cfg, reqs)
    if not show:
        return sim.run()
    from tqdm import tqdm

    with tqdm(total=len(reqs), desc=desc, unit="req", leave=False, file=sys.stderr, mininterval=0.5) as bar:

        def progress(n: int) -> None:
            bar.update(n)

        return sim.run(progress)


# ---------------------------------------------------------------------------------------------- simulate
def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def print_table(obj: dict[str, Any]) -> None:
    print(
        f"policy {obj['policy']} ({obj['scheduling']} scheduling), {obj['requests']} requests, "
        f"{obj['replicas']} x {obj['model']} on {obj['gpu']}, {obj['kv_blocks_per_replica']} KV blocks each"
    )
    print(
        f"simulated {obj['simulated_s']:.1f} s in {obj['wall_s']:.1f} s; output {obj['output_tokens_per_s']:.0f} "
        f"tok/s; hit rate {obj['hit_rate']:.3f}; recomputed {obj['recomputed_tokens']} tokens; "
        f"{obj['preemptions']} preemptions; SLO attainment {_fmt(obj['slo_attainment'])}"
    )
    from kvretain.cli import format_table

    cols = ["class", "requests", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "e2e_mean_s"]
    cols += ["e2e_p99_s", "queue_p99_s", "hit_rate", "recomputed_tokens", "evicted_blocks", "slo_attainment"]
    rows = [{"class": c, **{k: _fmt(v.get(k)) for k in cols[1:]}} for c, v in obj["classes"].items()]
    print(format_table(rows, cols))


def cmd_simulate(args: argparse.Namespace) -> int:
    reqs, source = load_workload(args)
    cfg = sim_config(args, args.policy)
    show = not args.json and not args.no_progress and sys.stderr.isatty()
    obj = _run(cfg, reqs, show, args.policy).summary()
    obj["workload"] = source
    if args.json:
        print(json.dumps(obj))
    else:
        print_table(obj)
    return 0


# ---------------------------------------------------------------------------------------------- compare
def cmd_compare(args: argparse.Namespace) -> int:
    reqs, source = load_workload(args)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    runs: list[tuple[str, SimConfig]] = [(p, sim_config(args, p)) for p in policies]
    base = sim_config(args, "unified")
    for b in budgets:
        pc = replace(base.policy_config, budget=b, isolation_goal=None)
        runs.append((f"unified-b{b:g}", replace(base, policy_config=pc)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm

    results: list[dict[str, Any]] = []
    ttfts: dict[str, dict[str, list[float]]] = {}
    for label, cfg in tqdm(runs, desc="compare", unit="run", file=sys.stderr, disable=args.no_progress):
        sim = _run(cfg, reqs, not args.no_progress and sys.stderr.isatty(), label)
        obj = sim.summary()
        obj["label"], obj["workload"] = label, source
        obj["budget"] = cfg.policy_config.budget if cfg.policy == "unified" else None
        results.append(obj)
        per: dict[str, list[float]] = {}
        for r in sim.finished:
            if r.ttft is not None:
                per.setdefault(str(r.priority), []).append(r.ttft)
        ttfts[label] = per
    (out / "summary.json").write_text(json.dumps(results, indent=1) + "\n")
    _write_csv(out / "runs.csv", results)
    (out / "summary.md").write_text(_markdown(results, source))
    _plots(out, results, ttfts, policies)
    print(f"wrote {out}/summary.json, summary.md, runs.csv and plots for {len(results)} runs")
    print((out / "summary.md").read_text())
    return 0


_CSV_COLS = ["label", "policy", "budget", "requests", "simulated_s", "output_tokens_per_s", "hit_rate"]
_CSV_COLS += ["recomputed_tokens", "preemptions", "slo_attainment", "goodput_rps", "ttft_p99_s"]
_CLASS_COLS = ["requests", "ttft_p50_s", "ttft_p99_s", "e2e_mean_s", "hit_rate", "recomputed_tokens"]


def _classes(results: Sequence[dict[str, Any]]) -> list[str]:
    return sorted({c for r in results for c in r["classes"]}, key=int)


def _write_csv(path: Path, results: Sequence[dict[str, Any]]) -> None:
    classes = _classes(results)
    cols = _CSV_COLS + [f"c{c}_{k}" for c in classes for k in _CLASS_COLS]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in results:
            row = [r.get(k) for k in _CSV_COLS]
            row += [r["classes"].get(c, {}).get(k) for c in classes for k in _CLASS_COLS]
            w.writerow(row)


def _markdown(results: Sequence[dict[str, Any]], source: str) -> str:
    classes = _classes(results)
    head = ["run", "out tok/s", "hit", "recomputed", "preempt"]
    head += [f"c{c} ttft p99" for c in classes] + [f"c{c} e2e mean" for c in classes]
    lines = [f"# kvretain compare: {source}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r["label"], f"{r['output_tokens_per_s']:.0f}", f"{r['hit_rate']:.4f}"]
        cells += [str(r["recomputed_tokens"]), str(r["preemptions"])]
        cells += [_fmt(r["classes"].get(c, {}).get("ttft_p99_s")) for c in classes]
        cells += [_fmt(r["classes"].get(c, {}).get("e2e_mean_s")) for c in classes]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _plots(
    out: Path,
    results: Sequence[dict[str, Any]],
    ttfts: dict[str, dict[str, list[float]]],
    policies: Sequence[str],
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plots (pip install 'kvretain[plots]')", file=sys.stderr)
        return
    classes = _classes(results)
    fig, axes = plt.subplots(1, len(classes), figsize=(5 * len(classes), 4), squeeze=False)
    for ax, c in zip(axes[0], classes, strict=True):
        for label in policies:
            v = sorted(ttfts.get(label, {}).get(c, []))
            if v:
                ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=label)
        ax.set_xscale("log")
        ax.set_title(f"class {c}: TTFT CDF")
        ax.set_xlabel("TTFT (s)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft_by_class.png", dpi=100)
    plt.close(fig)
    front = [r for r in results if r["label"].startswith("unified-b")]
    anchors = [r for r in results if r["label"] in policies]
    c0 = classes[0] if classes else "0"
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, name in (
        (axes[0], "output_tokens_per_s", "output tokens/s"),
        (axes[1], "hit_rate", "hit ratio"),
    ):
        xs = [r[key] for r in front]
        ys = [r["classes"].get(c0, {}).get("ttft_p99_s") for r in front]
        ax.plot(xs, ys, "o-", label="unified, budget varies")
        for r, x, y in zip(front, xs, ys, strict=True):
            ax.annotate(f"{r['budget']:g}", (x, y))
        for r in anchors:
            ax.plot([r[key]], [r["classes"].get(c0, {}).get("ttft_p99_s")], "s", label=r["label"])
        ax.set_xlabel(name)
        ax.set_ylabel(f"class {c0} p99 TTFT (s)")
        ax.legend()
    fig.suptitle("trade-off frontier")
    fig.tight_layout()
    fig.savefig(out / "frontier.png", dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- parser
def add_subcommands(sub: Any) -> None:
    """Register ``simulate`` and ``compare`` on the ``kvretain`` subparsers."""
    s = sub.add_parser("simulate", help="simulate serving a workload (default: the multi-tenant workload)")
    _add_common(s)
    s.add_argument("--policy", default="unified", choices=policy_names(), help="eviction policy")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=cmd_simulate)
    c = sub.add_parser("compare", help="policies x protection budgets into a report folder")
    _add_common(c)
    c.add_argument("--policies", default="lru,priority,unified", help="comma-separated eviction policies")
    c.add_argument("--budgets", default="0.1,0.2,0.4,0.6,0.8", help="unified fixed budgets (frontier)")
    c.add_argument("--out", default="report", help="report folder (default ./report)")
    c.set_defaults(func=cmd_compare)
