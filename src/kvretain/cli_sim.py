"""``kvretain simulate`` and ``kvretain compare``: the serving simulator on the command line.

``add_subcommands(subparsers)`` is called by :func:`kvretain.cli.build_parser`. Choices come from the
registries (eviction policies, queue policies, routers, workloads, priority rules, cost models).
"""

from __future__ import annotations

import argparse
import csv
import math
import random
import sys
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from kvretain.cli_args import (
    MAX_BLOCK_TOKENS,
    add_block_tokens_option,
    add_limit_option,
    add_policy_options,
    add_priority_mapping_option,
    check_policy_options_used,
    integer,
    json_text,
    names_of,
    number,
    option_error,
    path_arg,
    policy_config,
    printable,
    shares,
    slo_spec,
    trace_arg,
)
from kvretain.core.memory import check_pool_fits
from kvretain.core.policy import PolicyConfig, make_policy, policy_names
from kvretain.engine.sim.catalog import Catalog, builtin_catalog, load_catalog
from kvretain.engine.sim.costmodel import COST_MODELS, CostModel, is_cost_model_file
from kvretain.engine.sim.metrics import DEFAULT_SLOS, parse_slos
from kvretain.engine.sim.router import ROUTERS
from kvretain.engine.sim.simulator import DEFAULT_GPU_MEM_UTIL, MAX_FRONTEND_S, SimConfig, Simulation
from kvretain.fileio import StagedFolder
from kvretain.sched.config import SchedulerConfig, pool_too_small
from kvretain.sched.queue import QUEUE_POLICIES
from kvretain.workloads import WORKLOADS, WorkloadRequest, tag_priorities, working_set
from kvretain.workloads.priority import check_seed_read, make_rule, rule_choices

_SUFFIX_WORKLOAD = {".jsonl": "mooncake", ".csv": "azure"}

SIM_POLICY_DEFAULTS = PolicyConfig()
"""Eviction-policy settings of ``kvretain simulate`` / ``compare`` (each overridable by a flag): core's
``PolicyConfig`` defaults, the same as ``kvretain replay`` and the vLLM plugin (one set of defaults; the
plugin's run queue differs only in its ghost table, measured in docs/history.md)."""


# ---------------------------------------------------------------------------------------------- args
def cost_model_option(text: str) -> str:
    """``--cost-model``: a registered name, or a profile file (``kvretain profile``) read and checked now."""
    if is_cost_model_file(text):
        from kvretain.engine.sim.profiled import load_profile

        try:
            load_profile(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text
    if text == "profiled":
        raise argparse.ArgumentTypeError(
            "'profiled' needs its file: pass --cost-model FILE.toml (kvretain profile)"
        )
    if text not in COST_MODELS:
        raise argparse.ArgumentTypeError(
            f"invalid choice {text!r} (choose from {', '.join(COST_MODELS.names())}, or a FILE.toml)"
        )
    return text


def _choices_help(docs: dict[str, str]) -> str:
    """``name: doc; ...`` from a registry's descriptions, escaped for argparse's %-formatting of help."""
    return "; ".join(f"{k}: {v.rstrip('.')}" for k, v in docs.items()).replace("%", "%%")


def sim_policy_names() -> list[str]:
    """The eviction policies the simulator runs, as simulate's and compare's choices list them: the registry's
    less those that cannot be built without knowing the future (belady, an offline oracle: replay only)."""
    names = []
    for name in policy_names():
        try:
            make_policy(name, 1, SIM_POLICY_DEFAULTS)
        except ValueError:
            continue
        names.append(name)
    return names


class _Offered(list[str]):
    """argparse choices that offer ``offered`` (usage, --help, the "invalid choice" error) and accept every one
    of ``accepted``: simulate's --policy does not offer belady, and ``--policy belady`` typed is refused by
    :func:`check_sim` with the reason (an offline oracle), not as an unknown name."""

    def __init__(self, offered: list[str], accepted: list[str]) -> None:
        super().__init__(offered)
        self._accepted = frozenset(accepted)

    def __contains__(self, name: object) -> bool:
        return name in self._accepted


_FRONTEND_WHY = " seconds (a front end takes milliseconds; MAX_FRONTEND_S)"


def _add_common(p: argparse.ArgumentParser, compare: bool = False) -> None:
    p.add_argument(
        "trace",
        nargs="?",
        type=trace_arg("a trace file, or omit it for a generated workload"),
        help="trace file (Mooncake .jsonl, .jsonl.gz or Azure .csv; '-': standard input, with --workload); "
        "omit for --workload",
    )
    p.add_argument(
        "--workload",
        choices=WORKLOADS.names(),
        default=None,
        help="workload (default: multi-tenant, or from the trace file's suffix)",
    )
    p.add_argument(
        "--priority-rule",
        default="keep",
        choices=rule_choices(),
        help="how trace requests get a priority (keep: the trace's own field, default 0)",
    )
    add_limit_option(p)
    add_block_tokens_option(
        p,
        None,
        "; a Mooncake .jsonl trace only, as `workload export --block-tokens` wrote it",
    )
    p.add_argument(
        "--time-scale",
        type=number(0.0, lo_open=True),
        default=1.0,
        help="multiply arrival and think times, and retention durations with them, by this (> 0; default 1)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed of the workload (default 0)")
    p.add_argument("--open-loop", action="store_true", help="ignore follow-up links: open-loop arrivals")
    p.add_argument(
        "--frontend-in-s",
        type=number(0.0, MAX_FRONTEND_S, what=_FRONTEND_WHY),
        default=0.0,
        help="seconds from a client's send to the engine seeing the request (HTTP, tokenization, the hop to the "
        "engine process; default 0: the engine driven directly)",
    )
    p.add_argument(
        "--frontend-out-s",
        type=number(0.0, MAX_FRONTEND_S, what=_FRONTEND_WHY),
        default=0.0,
        help="seconds from the step that sampled a token to the client receiving it (default 0)",
    )
    g = p.add_argument_group("scheduler")
    g.add_argument(
        "--scheduling",
        default="priority",
        choices=QUEUE_POLICIES.names(),
        help="queue policy (default priority)",
    )
    g.add_argument(
        "--max-num-batched-tokens", type=integer(1), default=8192, help="token budget per step (default 8192)"
    )
    g.add_argument(
        "--max-num-seqs", type=integer(1), default=256, help="most running requests per replica (default 256)"
    )
    g.add_argument(
        "--max-model-len",
        type=integer(1),
        default=None,
        metavar="N",
        help="context length, >= 1: a prompt of N tokens or more is rejected, a request ends when it holds N "
        "tokens, prompt and output, as in vLLM (vLLM's default: the model's context length; kvretain's "
        "default: unbounded, every request runs to its output length)",
    )
    g.add_argument("--no-chunked-prefill", action="store_true", help="disable chunked prefill")
    g.add_argument(
        "--waiting-preempts-running",
        action="store_true",
        help="let a waiting request preempt less important running ones (vLLM issue #40004)",
    )
    h = p.add_argument_group("hardware")
    h.add_argument("--model", default="llama-3-8b", help="model from the catalog (default llama-3-8b)")
    h.add_argument("--gpu", default="h100-sxm", help="GPU from the catalog (default h100-sxm)")
    h.add_argument(
        "--tp", type=integer(1, 1024), default=None, help="tensor parallelism, 1..1024 (default: the model's)"
    )
    h.add_argument(
        "--catalog",
        type=path_arg("a TOML file, or leave the option out"),
        default=None,
        help="TOML file adding models/GPUs to the catalog",
    )
    h.add_argument(
        "--cost-model",
        default="roofline",
        type=cost_model_option,
        metavar="{" + ",".join(COST_MODELS.names()) + "} or FILE.toml",
        help="how a step is priced (default roofline): " + _choices_help(COST_MODELS.describe()),
    )
    h.add_argument("--replicas", type=integer(1), default=1, help="replicas behind the router (default 1)")
    h.add_argument(
        "--router",
        default=None,  # (given or not: one replica leaves it nothing to choose, check_sim; SimConfig's default)
        choices=ROUTERS.names(),
        help=f"how requests are spread over replicas, 2 or more (default {SimConfig.router}): "
        + _choices_help(ROUTERS.describe()),
    )
    h.add_argument(
        "--kv-blocks",
        type=integer(1),
        default=None,
        help="KV blocks per replica (default: "
        + (
            "the peak working set of the requests at protected retention priority (a replica's even share, "
            "at least the largest request's blocks), or, with none, "
            if compare
            else ""
        )
        + "what the cost model leaves after the weights)",
    )
    h.add_argument(
        "--gpu-mem-util",
        type=number(0.0, 1.0, lo_open=True),
        default=None,
        help=f"GPU memory share for weights + KV, (0, 1] (default {DEFAULT_GPU_MEM_UTIL:g}); sizes the KV cache "
        "from the cost model, so not with --kv-blocks",
    )
    h.add_argument(
        "--block-size", type=integer(1, MAX_BLOCK_TOKENS), default=16, help="tokens per KV block (default 16)"
    )
    d = SIM_POLICY_DEFAULTS
    c = p.add_argument_group(
        "cache (unified's settings: core's PolicyConfig defaults, as replay and the plugin; the plugin's run queue "
        "keeps no ghost table)"
    )
    add_policy_options(c, d)
    add_priority_mapping_option(c)
    c.add_argument(
        "--slo",
        type=slo_spec,
        default=",".join(f"{k}={v.ttft_s:g}:{v.tpot_s:g}" for k, v in DEFAULT_SLOS.items()),
        help="per-class targets 'class=ttft_s:tpot_s,...': a request meets its SLO when its TTFT and TPOT are "
        "within them (with one output token: its TTFT; rejected at admission: missed; SLO attainment is over every "
        "request sent); a class not listed takes the nearest lower listed class's (default %(default)s)",
    )
    p.add_argument(
        "--no-progress", action="store_true", help="no progress bar (none either when not a terminal)"
    )


def _trace_workload(path: str) -> str | None:
    """The workload a trace file's name says it is (``.jsonl``, ``.jsonl.gz``: Mooncake; ``.csv``: Azure)."""
    p = Path(path)
    suffix = Path(p.stem).suffix if p.suffix == ".gz" else p.suffix
    name = _SUFFIX_WORKLOAD.get(suffix)
    return None if name == "azure" and p.suffix == ".gz" else name  # (the Azure reader takes plain CSV)


def load_workload(args: argparse.Namespace) -> tuple[list[WorkloadRequest], str]:
    name = args.workload
    if name is None:
        name = "multi-tenant" if args.trace is None else _trace_workload(args.trace)
        if name is None:
            raise ValueError(
                f"cannot tell the trace format of {args.trace!r} (.jsonl or .jsonl.gz: mooncake, .csv: azure): "
                "pass --workload"
            )
    options: dict[str, Any] = {}
    if args.block_tokens is not None:
        if name != "mooncake":
            raise ValueError(
                f"argument --block-tokens: tokens per hash id of a Mooncake trace; workload {name!r} has none"
            )
        options["block_size"] = args.block_tokens
    if args.trace is not None and name == "mooncake":  # (an Azure trace draws its prompts from the seed)
        check_seed_read(args.seed, args.priority_rule)
    rng = random.Random(args.seed)
    reqs = WORKLOADS.create(
        name, rng=rng, path=args.trace, limit=args.limit, time_scale=args.time_scale, **options
    )
    rule = make_rule(args.priority_rule, reqs, random.Random(args.seed + 1))
    if rule is not None:
        reqs = tag_priorities(reqs, rule)
    return reqs, name if args.trace is None else f"{name}:{args.trace}"


def sim_config(args: argparse.Namespace, policy: str) -> SimConfig:
    return SimConfig(
        model=args.model,
        gpu=args.gpu,
        tp=args.tp,
        cost_model=args.cost_model,
        replicas=args.replicas,
        router=SimConfig.router if args.router is None else args.router,
        kv_blocks=args.kv_blocks,
        gpu_mem_utilization=DEFAULT_GPU_MEM_UTIL if args.gpu_mem_util is None else args.gpu_mem_util,
        block_size=args.block_size,
        policy=policy,
        policy_config=policy_config(args, SIM_POLICY_DEFAULTS, args.block_size),
        mapping=args.priority_mapping,
        sched=SchedulerConfig(
            policy=args.scheduling,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            enable_chunked_prefill=not args.no_chunked_prefill,
            waiting_preempts_running=args.waiting_preempts_running,
            max_model_len=args.max_model_len,
        ),
        closed_loop=not args.open_loop,
        frontend_in_s=args.frontend_in_s,
        frontend_out_s=args.frontend_out_s,
        slos=parse_slos(args.slo),
        catalog=_catalog(args.catalog),
    )


def _catalog(path: str | None) -> Catalog | None:
    """``--catalog``'s file read (its errors name the option), or None."""
    if path is None:
        return None
    try:
        return load_catalog(path)
    except ValueError as e:
        raise ValueError(f"argument --catalog: {e}") from None


SCHED_OPTIONS = ("max_num_batched_tokens", "max_num_seqs", "max_model_len")
"""The ``SchedulerConfig`` fields set by options of the same names (``--max-num-batched-tokens``...): its errors
(vLLM's start-up refusals of a budget against ``max_model_len`` / ``max_num_seqs``) name them first."""


FRONTIER_SETS = ("budget", "isolation_goal", "priority_weight")
"""The unified settings that ``compare``'s fixed-budget runs set themselves."""


def check_router(router: str | None, replicas: int) -> None:
    """Refuse a ``--router`` given (``router`` not None) with one replica: every router sends it every request,
    so the flag changes nothing (``simulate``, ``compare`` and ``bench/sim_speed.py``)."""
    if router is not None and replicas == 1:
        raise ValueError(
            f"argument --router: chooses among replicas, and --replicas {replicas} leaves one (any router "
            "sends it every request); pass --replicas 2 or more, or leave --router out"
        )


def check_sim(args: argparse.Namespace) -> None:
    """Checks that need several options, before anything runs (``simulate`` and ``compare``): the policy
    settings together, every policy usable online, and pools that fit in memory."""
    if args.gpu_mem_util is not None and args.kv_blocks is not None:
        raise ValueError(
            "argument --gpu-mem-util: sizes the KV cache from the cost model, which --kv-blocks sets; give one"
        )
    check_router(args.router, args.replicas)
    policies = [args.policy] if args.command == "simulate" else [*args.policies, "unified"]
    flag = "--policy" if args.command == "simulate" else "--policies"
    if args.command == "simulate":
        check_policy_options_used(args, policies, flag)
    else:  # (the --budgets runs read every unified setting but these, which they set themselves)
        check_policy_options_used(
            args, args.policies, flag, FRONTIER_SETS, " (the --budgets runs set their own)"
        )
    try:
        cfgs = [sim_config(args, p) for p in policies]
    except ValueError as exc:  # (PolicyConfig's, or SchedulerConfig's vLLM start-up refusals)
        raise ValueError(
            option_error(exc, [*(f.name for f in fields(PolicyConfig)), *SCHED_OPTIONS])
        ) from None
    for cfg in cfgs:
        try:
            make_policy(cfg.policy, 1, cfg.policy_config)
        except ValueError as exc:
            raise ValueError(f"argument {flag}: {exc}") from None
    cfg = cfgs[0]
    blocks = cfg.blocks_per_replica(_cost_model(cfg, args.tp is not None))
    if blocks < 1:  # only from the cost model (--kv-blocks is >= 1): the room left holds no whole block
        tokens = cfg.cost().kv_capacity_tokens(cfg.gpu_mem_utilization)
        raise ValueError(
            f"argument --block-size: a KV block of {cfg.block_size:,} tokens is larger than the {tokens:,} tokens "
            f"of KV room {cfg.model} leaves on {cfg.gpu} at --gpu-mem-util {cfg.gpu_mem_utilization:g}; use a "
            "smaller --block-size (or pass --kv-blocks)"
        )
    what = (
        "argument --kv-blocks" if args.kv_blocks is not None else "--kv-blocks (default: from the cost model)"
    )
    check_replicas_fit(cfg, policies, what)
    if args.command == "simulate" or args.kv_blocks is not None:  # (compare's own pool: checked once sized)
        check_max_model_len(cfg, blocks, pool_source(args))


def pool_source(args: argparse.Namespace) -> str:
    """Where a replica's KV blocks come from, as errors name it: ``--kv-blocks``, or the cost model."""
    if args.kv_blocks is not None:
        return "--kv-blocks"
    return "from the cost model: --model, --gpu, --tp and --gpu-mem-util"


def check_max_model_len(cfg: SimConfig, blocks: int, source: str) -> None:
    """``--max-model-len`` against a replica's pool of ``blocks`` (``source``: where its size comes from), before
    any run: vLLM's start-up refusal of a KV cache that cannot hold one request of ``max_model_len`` tokens
    (``kvretain.sched.config.pool_too_small``), one line naming the option. Nothing without the option."""
    limit = cfg.sched.max_model_len
    if limit is not None:
        reason = pool_too_small(limit, blocks, cfg.block_size, f"a replica's KV cache ({source})")
        if reason is not None:
            raise ValueError(f"argument --max-model-len: {reason}")


def _cost_model(cfg: SimConfig, tp_given: bool) -> CostModel:
    """``cfg``'s cost model, with a model or GPU the catalog does not hold, or a ``--tp`` the model cannot be
    split by, named by its option (they said "unknown model 'x'" and "tp=3 must ... divide n_q_heads=32")."""
    cat = cfg.catalog or builtin_catalog()
    for flag, find, name in (("--model", cat.model, cfg.model), ("--gpu", cat.gpu, cfg.gpu)):
        try:
            find(name)
        except KeyError as e:
            raise ValueError(f"argument {flag}: {e.args[0]}") from None
    try:
        return cfg.cost()
    except ValueError as e:
        if not tp_given:  # (a catalog's own tp is checked where the catalog is read)
            raise
        raise ValueError(f"argument --tp: {e} (model {cfg.model})") from None


def check_replicas_fit(
    cfg: SimConfig,
    policies: Sequence[str],
    what: str,
    at_once: int = 1,
    replicas_what: str = "argument --replicas",
) -> None:
    """A ``ValueError`` (``PoolTooLargeError``) naming ``what`` when the KV pools of ``cfg.replicas`` replicas
    (``cfg``'s blocks per replica, under the most demanding of ``policies``) would not fit in memory, times
    ``at_once`` simulations run together: checked before any run, as ``--replicas 100000`` grew memory until
    the machine gave out. When one replica's pool fits, the message names ``replicas_what`` instead (the
    replicas are too many, not the blocks). ``kvretain simulate``/``compare``'s check, and the bench scripts'
    that simulate."""
    blocks = cfg.blocks_per_replica(cfg.cost())
    pools_are = "replicas" if at_once == 1 else f"replicas ({at_once} simulations at once)"
    check_pool_fits(
        blocks,
        list(policies),
        cfg.policy_config,
        what=what,
        pools=cfg.replicas * at_once,
        pools_are=pools_are,
        pools_what=replicas_what,
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


def _cell(stats: dict[str, Any], col: str) -> str:
    """A class's figure for the terminal table: TPOTs (a few ms) in milliseconds, the rest as :func:`_fmt`."""
    if col.endswith("_ms"):
        v = stats.get(col[:-3] + "_s")
        return "-" if v is None else f"{v * 1000:.1f}"
    return _fmt(stats.get(col))


def print_table(obj: dict[str, Any]) -> None:
    print(
        f"policy {obj['policy']} ({obj['scheduling']} scheduling), {obj['requests']} requests finished, "
        f"{obj['replicas']} x {obj['model']} on {obj['gpu']}, {obj['kv_blocks_per_replica']} KV blocks each"
        + (
            ""
            if obj["step_times_of"] == f"{obj['model']} on {obj['gpu']}"
            else f"; step times of {obj['step_times_of']}"
        )
    )
    print(
        f"simulated {obj['simulated_s']:.1f} s in {obj['wall_s']:.1f} s; output {obj['output_tokens_per_s']:.0f} "
        f"tok/s, {obj['request_throughput_rps']:.2f} req/s; hit rate {_fmt(obj['hit_rate'])}; "
        f"recomputed {obj['recomputed_tokens']} tokens; "
        f"{obj['preemptions']} preemptions ({obj['resumes']} resumes hit {obj['resume_hit_tokens']} tokens, "
        f"not in the hit rate); SLO attainment {_fmt(obj['slo_attainment'])}"
    )
    rej = obj["rejections"]
    if rej:
        shown = "" if len(rej) <= 3 else " (the first 3; --json lists all)"
        print(f"rejected at admission: {len(rej)} requests{shown}")
        for r in rej[:3]:
            print(f"  {r['reason']}")
    from kvretain.cli import controller_line, format_table

    for i, st in enumerate(obj.get("policy_stats", ())):
        line = controller_line(st)
        if line is not None:
            print(f"replica {i} {line}" if len(obj["policy_stats"]) > 1 else line)
    cols = ["class", "requests", "rejected", "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms"]
    cols += ["e2e_mean_s"]
    cols += ["e2e_p99_s", "queue_p99_s", "hit_rate", "recomputed_tokens", "evicted_blocks", "slo_attainment"]
    rows = [{"class": c, **{k: _cell(v, k) for k in cols[1:]}} for c, v in obj["classes"].items()]
    # (the JSON's "requests" are the finished ones: sent = finished + rejected; the header says which)
    heads = {"requests": "finished"}
    rows = [{heads.get(k, k): v for k, v in row.items()} for row in rows]
    print(format_table(rows, [heads.get(k, k) for k in cols]))


def cmd_simulate(args: argparse.Namespace) -> int:
    reqs, source = load_workload(args)
    cfg = sim_config(args, args.policy)
    show = not args.json and not args.no_progress and sys.stderr.isatty()
    obj = _run(cfg, reqs, show, args.policy).summary()
    obj["workload"] = source
    if args.json:
        print(json_text(obj))
    else:
        print_table(obj)
    return 0


# ---------------------------------------------------------------------------------------------- compare
def protected_peak_blocks(reqs: Sequence[WorkloadRequest], cfg: SimConfig) -> int:
    """KV blocks per replica that hold the peak reuse working set (:func:`working_set`) of the requests whose
    request priority maps to a protected retention priority (``>= protect_threshold``; class 0 by default),
    and never fewer than the largest request needs (a smaller pool could not serve it); 0 when no request is
    protected."""
    peak = protected_peak_share(reqs, cfg)
    if not peak:
        return 0
    bs = cfg.block_size
    return max(peak, max(-(-(len(r.prompt) + r.output_len) // bs) for r in reqs))


def protected_peak_share(reqs: Sequence[WorkloadRequest], cfg: SimConfig) -> int:
    """The peak reuse working set of the protected requests (:func:`protected_peak_blocks`) in blocks, an even
    share of it per replica; 0 when no request is protected."""
    threshold = cfg.policy_config.protect_threshold
    protected = [r for r in reqs if cfg.mapping.retention_for(r.priority) >= threshold]
    if not protected:
        return 0
    return math.ceil(working_set(protected).peak_tokens / cfg.block_size / cfg.replicas)


def budget_text(b: float) -> str:
    """A fixed budget as its run's label and the frontier plot name it: ``:g`` (``0.2``, ``1``), or every digit
    where six would not tell two budgets apart (``0.1234567`` and ``0.1234568``, both ``0.123457``)."""
    text = f"{b:g}"
    return text if float(text) == b else repr(b)


def cmd_compare(args: argparse.Namespace) -> int:
    reqs, source = load_workload(args)
    policies, budgets = args.policies, args.budgets
    base = sim_config(args, "unified")
    where = "--kv-blocks" if args.kv_blocks is not None else "the cost model's, from --model, --gpu and --tp"
    capacity = f"{base.blocks_per_replica(base.cost()):,} KV blocks per replica ({where})"
    pool_from = pool_source(args)
    if args.kv_blocks is None:
        # NOTE: the cost model's capacity holds the protected class's whole working set with room to spare,
        # so no budget would matter. A pool of exactly the protected class's peak working set makes the
        # budget the share of that peak it may keep: each budget then buys class 0 hits with the others'.
        blocks = protected_peak_blocks(reqs, base)
        if blocks > 0 and args.gpu_mem_util is not None:
            raise ValueError(
                "argument --gpu-mem-util: compare sizes the pool on the protected requests' peak working set "
                f"({blocks:,} blocks), not from the cost model; pass --kv-blocks to choose it"
            )
        if blocks > 0:
            check_pool_fits(
                blocks,
                [*policies, "unified"],
                base.policy_config,
                "compare's KV capacity",
                pools=base.replicas,
                pools_what="argument --replicas",
            )
            base = replace(base, kv_blocks=blocks)
            peak = protected_peak_share(reqs, base)
            what = "the peak working set of the requests at protected retention priority"
            share = "" if base.replicas == 1 else " a replica"
            if blocks > peak:  # (protected_peak_blocks: never fewer than the largest request needs)
                what = f"the largest request's, more than {what} ({peak:,} blocks{share})"
            elif base.replicas > 1:
                what += f" (an even share of it over {base.replicas} replicas)"
            capacity = f"{blocks:,} KV blocks per replica: {what}"
            capacity += " (pass --kv-blocks to choose)"
            pool_from = (
                "compare's, the peak working set of the protected requests; pass --kv-blocks to choose"
            )
    check_max_model_len(base, base.blocks_per_replica(base.cost()), pool_from)
    runs: list[tuple[str, SimConfig]] = [
        (p, replace(sim_config(args, p), kv_blocks=base.kv_blocks)) for p in policies
    ]
    for b in budgets:
        try:
            pc = replace(
                base.policy_config,
                budget=b,
                isolation_goal=None,
                priority_weight=args.frontier_priority_weight,
            )
        except ValueError as exc:  # (the weight with the other settings: PolicyConfig's bound on the values)
            raise ValueError(f"argument --frontier-priority-weight: {exc}") from None
        runs.append((f"unified-b{budget_text(b)}", replace(base, policy_config=pc)))
    stage = _report_folder(args.out)  # before any output: a bad --out is one line
    try:
        return _compare_runs(args, stage, reqs, runs, (source, capacity))
    finally:  # an error or a Ctrl-C on the way: no half-written report left (nor a new empty folder)
        stage.discard()


def _compare_runs(
    args: argparse.Namespace,
    stage: StagedFolder,
    reqs: Sequence[WorkloadRequest],
    runs: Sequence[tuple[str, SimConfig]],
    about: tuple[str, str],
) -> int:
    """``compare``'s runs, their report written into ``stage`` and committed to ``--out`` at the end."""
    source, capacity = about
    print(f"compare: {len(runs)} runs of {source}, {capacity}", file=sys.stderr)
    from tqdm import tqdm

    results: list[dict[str, Any]] = []
    ttfts: dict[str, dict[str, list[float]]] = {}
    bar_off = True if args.no_progress else None  # None: no bar when stderr is not a terminal
    for label, cfg in tqdm(runs, desc="compare", unit="run", file=sys.stderr, disable=bar_off):
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
    out = stage.path
    markdown = _markdown(results, source, capacity, args.frontier_priority_weight)
    summary = json_text(results, indent=1)  # before writing: a value JSON cannot hold is one line, no report
    try:
        (out / "summary.json").write_text(summary + "\n")
        _write_csv(out / "runs.csv", results)
        (out / "summary.md").write_text(markdown)
        plots = _plots(out, results, ttfts, args.policies)
        stage.commit()
    except OSError as e:  # checked before the runs; the disk may still fill up meanwhile
        raise ValueError(f"--out {args.out}: cannot write the report ({_os_reason(e)})") from None
    files = ["summary.json", "summary.md", "runs.csv", *plots]
    print(f"wrote {', '.join(files)} to {printable(str(stage.target))}/ for {len(results)} runs")
    print(markdown)
    return 0


REPORT_FILES = ("summary.json", "summary.md", "runs.csv", "frontier.png", "ttft_by_class.png")
"""What ``compare`` writes to ``--out`` (the plots with matplotlib)."""


def _report_folder(path: str) -> StagedFolder:
    """The report folder's stage, made before any run (a path under a file is the user's mistake, not a
    crash); the report is built in it and moved to ``path`` only once whole."""
    if not path:  # Path("") is the current folder: an unset variable would scatter the report there
        raise ValueError("argument --out: an empty path (pass a folder name)")
    try:
        return StagedFolder(path, REPORT_FILES)
    except OSError as e:
        raise ValueError(f"--out {path}: cannot create the report folder ({_os_reason(e)})") from None


def _os_reason(e: OSError) -> str:
    """An ``OSError``'s reason with the path it names (the report's own file, or the folder staged beside
    ``--out``, may be the one at fault)."""
    reason = e.strerror or str(e)
    return f"{reason}: {e.filename}" if e.filename else reason


_CSV_COLS = [
    "label",
    "policy",
    "budget",
    "requests",
    "rejected",
    "simulated_s",
    "output_tokens_per_s",
    "request_throughput_rps",
    "hit_rate",
]
_CSV_COLS += ["recomputed_tokens", "preemptions", "slo_attainment", "goodput_rps", "ttft_p99_s"]
_CLASS_COLS = [
    "requests",
    "rejected",
    "ttft_p50_s",
    "ttft_p99_s",
    "e2e_mean_s",
    "hit_rate",
    "recomputed_tokens",
]


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


def _markdown(results: Sequence[dict[str, Any]], source: str, capacity: str, frontier_weight: float) -> str:
    classes = _classes(results)
    head = ["run", "out tok/s", "req/s", "hit", "recomputed", "preempt", "rejected"]
    head += [f"c{c} {k}" for c in classes for k in ("ttft mean", "ttft p99", "hit", "SLO")]
    lines = [
        f"# kvretain compare: {printable(source)}",
        "",
        f"{capacity}. `unified-bX`: unified with a fixed protection budget X and priority weight "
        f"{frontier_weight:g}. TTFT (s), recomputed tokens and preemptions: lower is better; hit ratios and "
        "SLO attainment: higher is better.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in results:
        hit = r["hit_rate"]
        cells = [r["label"], f"{r['output_tokens_per_s']:.0f}", f"{r['request_throughput_rps']:.2f}"]
        cells += ["-" if hit is None else f"{hit:.4f}"]
        cells += [str(r["recomputed_tokens"]), str(r["preemptions"]), str(r["rejected"])]
        for c in classes:
            st = r["classes"].get(c, {})
            cells += [_fmt(st.get(k)) for k in ("ttft_mean_s", "ttft_p99_s", "hit_rate", "slo_attainment")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _stat(r: dict[str, Any], c: str, key: str) -> float | None:
    """Class ``c``'s figure ``key`` in run ``r`` (``None``: the run has none, e.g. every request rejected)."""
    v = r["classes"].get(c, {}).get(key)
    return None if v is None else float(v)


def _bar_values(
    results: Sequence[dict[str, Any]], ref: dict[str, Any] | None, c: str, key: str
) -> list[float]:
    """Class ``c``'s bars of ``key`` across ``results``, relative to run ``ref``'s (``None``: as they are).

    NOTE: a run without the figure (or a reference without it) gets no bar (NaN), not a bar of 0: a class whose
    requests were all rejected read as a TTFT ratio of 0, the best of the chart."""
    base = 1.0 if ref is None else _stat(ref, c, key)
    return [v / base if base and v is not None else math.nan for v in (_stat(r, c, key) for r in results)]


CDF_COLUMNS = 4
"""Panels in a row of the TTFT CDF figure (one a class)."""
LEGEND_COLUMNS = 4
"""Classes in a row of the bar panels' legends."""
LEGEND_CLASSES = 20
"""Most classes the bar panels list in a legend; more are told apart by a colour scale."""

NOTE: dict[str, Any] = {"ha": "center", "va": "center", "fontsize": 10, "color": "0.35"}
"""How a panel with nothing to draw says why."""


def _why_none(results: Sequence[dict[str, Any]], c: str) -> str:
    """Why class ``c`` has no TTFT in any of ``results``: its requests rejected at admission (the pool or the
    token budget holds none of them), or none sent."""
    rejected = max((int(r["classes"].get(c, {}).get("rejected") or 0) for r in results), default=0)
    return f"({rejected:,} rejected at admission: see summary.md)" if rejected else "(none sent)"


def _plots(
    out: Path,
    results: Sequence[dict[str, Any]],
    ttfts: dict[str, dict[str, list[float]]],
    policies: Sequence[str],
) -> list[str]:
    """Write the report's figures; returns the names written (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize
        from matplotlib.ticker import ScalarFormatter

        from kvretain.plotting import plain_log_ticks
    except ImportError:
        print(
            "matplotlib missing: no plots written (pip install matplotlib, or pip install -e '.[plots]')",
            file=sys.stderr,
        )
        return []

    def plain(axis: Any) -> None:  # no offset notation ("+1.928e2"): the numbers as they are
        fmt = ScalarFormatter(useOffset=False)
        fmt.set_scientific(False)
        axis.set_major_formatter(fmt)

    classes = _classes(results)
    c0 = classes[0] if classes else "0"
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    # one colour a class in the bars: the default cycle has 10, and class 10's bars were class 0's blue
    if len(classes) <= len(colors):
        shades = list(colors)
    elif len(classes) <= 20:
        shades = [plt.get_cmap("tab20")(k) for k in range(len(classes))]
    else:
        shades = [plt.get_cmap("turbo")(k / (len(classes) - 1)) for k in range(len(classes))]
    # (in budget order: the line joins neighbouring budgets, whatever order --budgets gave them in)
    front = sorted(
        (r for r in results if r["label"].startswith("unified-b")), key=lambda r: float(r["budget"])
    )
    anchors = [r for r in results if r["label"] in policies]
    written: list[str] = []

    # 1. TTFT distribution per class
    # NOTE: in rows of at most CDF_COLUMNS panels: a trace with a dozen priorities drew one row 6,000 px wide
    cols = max(1, min(len(classes), CDF_COLUMNS))
    rows = max(1, math.ceil(len(classes) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax in axes.flat[len(classes) :]:  # (the last row's spare places)
        ax.set_visible(False)
    for ax, c in zip(axes.flat, classes, strict=False):
        for i, label in enumerate(policies):
            v = sorted(ttfts.get(label, {}).get(c, []))
            if v:  # the empirical CDF: a step at each request, flat between (no TTFT between two samples)
                shares = [(k + 1) / len(v) for k in range(len(v))]
                # wide to narrow in drawing order: a policy whose TTFTs are another's (unified often runs as
                # lru) leaves the earlier one's line showing on both sides of its own
                lw = 1.2 + 0.9 * (len(policies) - 1 - i)
                # (a step line of one point draws nothing: a lone TTFT gets a marker, large to small as the
                # lines, so that a later policy's marker on the same TTFT rings an earlier one's, not hides it)
                one = {"marker": "o", "ms": 5.0 + 3.0 * (len(policies) - 1 - i)} if len(v) == 1 else {}
                ax.step(v, shares, where="post", label=label, color=colors[i % len(colors)], lw=lw, **one)
        ax.set_xscale("log")
        plain_log_ticks(ax.xaxis)
        ax.set_title(f"class {c}: TTFT CDF")
        ax.set_xlabel("TTFT (s, log scale; further left is better)")
        ax.set_ylabel("share of requests")
        # NOTE: a share runs from 0 to 1: left to matplotlib, a class with one request (its lone point at 1.0)
        # got an axis of 0.96-1.04, shares above 1 and none of the scale below
        ax.set_ylim(0.0, 1.05)
        plain(ax.yaxis)
        if not ax.get_lines():  # every request of the class rejected in every run: say so, not a bare frame
            ax.text(
                0.5,
                0.5,
                f"no class {c} request finished\n{_why_none(results, c)}",
                **NOTE,
                transform=ax.transAxes,
            )
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft_by_class.png", dpi=100)
    plt.close(fig)
    written.append("ttft_by_class.png")

    # 2. the trade-off: what class 0 gains against what the lowest class pays, and every class's share
    low = classes[-1] if classes else "0"  # the least important class: it pays for the protection

    def paid(r: dict[str, Any]) -> float:
        return (_stat(r, low, "recomputed_tokens") or 0.0) / 1e6

    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(18, 5))
    if front:
        xs = [paid(r) for r in front]
        ys = [_stat(r, c0, "ttft_mean_s") for r in front]
        left.plot(xs, ys, "o-", color="0.45", ms=11, mfc="none", zorder=2, label="unified, fixed budget b")
        # one label per distinct point (budgets with the same result share it), on the side away from its
        # nearest neighbour, with a leader line, so that labels neither overlap nor point at the wrong marker
        spots: dict[tuple[float, float], list[str]] = {}
        for r, x, y in zip(front, xs, ys, strict=True):
            if y is not None:
                spots.setdefault((x, y), []).append(budget_text(r["budget"]))
        pts = list(spots) + [(paid(r), _stat(r, c0, "ttft_mean_s") or 0.0) for r in anchors]
        span_x = (max(p[0] for p in pts) - min(p[0] for p in pts)) or 1.0
        span_y = (max(p[1] for p in pts) - min(p[1] for p in pts)) or 1.0
        for (x, y), names in spots.items():
            near = min(
                (q for q in pts if q != (x, y)),
                key=lambda q: ((q[0] - x) / span_x) ** 2 + ((q[1] - y) / span_y) ** 2,
                default=(x - 1.0, y - 1.0),
            )
            dx, dy = (-1 if near[0] > x else 1), (-1 if near[1] > y else 1)
            left.annotate(
                "b=" + ", ".join(names),
                (x, y),
                xytext=(16 * dx, 16 * dy - (4 if dy < 0 else 0)),
                textcoords="offset points",
                ha="left" if dx > 0 else "right",
                fontsize=8,
                color="0.25",
                arrowprops={"arrowstyle": "-", "color": "0.6", "lw": 0.6},
            )
    for i, r in enumerate(anchors):  # large to small, as the CDF's lines: a coinciding one rings the next
        left.plot(
            [paid(r)],
            [_stat(r, c0, "ttft_mean_s")],
            "D",
            ms=7 + 3 * (len(anchors) - 1 - i),
            mec="black",
            zorder=3,
            color=colors[i % len(colors)],
            label=r["label"],
        )
    if all(_stat(r, c0, "ttft_mean_s") is None for r in results):  # nothing to place on either axis
        left.text(
            0.5,
            0.5,
            f"no class {c0} request finished\n{_why_none(results, c0)}",
            **NOTE,
            transform=left.transAxes,
        )
    left.set_xlabel(f"class {low}: recomputed prompt tokens (millions; lower is better)")
    left.set_ylabel(f"class {c0} mean TTFT (s; lower is better)")
    if low != c0:
        left.set_title(f"what class {c0} gains against what class {low} pays")
    else:  # one class: it gains and pays alike ("what class 0 gains against what class 0 pays")
        left.set_title(f"class {c0}: mean TTFT against recomputed tokens")
    left.margins(0.2)  # room for the labels inside the axes
    lo, hi = left.get_xlim()
    if (
        lo < 0 <= hi
    ):  # a count of tokens: no negative scale (every run recomputing none centred the axis on 0)
        left.set_xlim(-0.05 * hi if hi > 0 else -0.05, hi if hi > 0 else 1.0)
    plain(left.xaxis)
    plain(left.yaxis)
    left.grid(alpha=0.3)
    left.legend(fontsize=8)

    def bars(ax: Any, key: str, relative: bool) -> None:
        ref = anchors[0] if anchors else results[0]
        width = 0.8 / max(1, len(classes))
        for j, c in enumerate(classes):
            vals = _bar_values(results, ref if relative else None, c, key)
            xs = [i + (j - (len(classes) - 1) / 2) * width for i in range(len(results))]
            ax.bar(xs, vals, width, label=f"class {c}", color=shades[j])
            # (a bar of 0 and no bar at all both draw nothing: each is said)
            for x, v in zip(xs, vals, strict=True):
                if math.isnan(v) or v == 0:
                    ax.text(
                        x,
                        0,
                        "n/a" if math.isnan(v) else "0",
                        rotation=90 if math.isnan(v) else 0,
                        ha="center",
                        va="bottom",
                        fontsize=7,
                        color="0.4" if math.isnan(v) else shades[j],
                    )
        ax.set_xticks(range(len(results)), [r["label"] for r in results], rotation=30, ha="right", fontsize=8)
        if relative:
            ax.axhline(1.0, color="black", lw=0.8)
        plain(ax.yaxis)
        # (a dozen classes in one legend row ran over the neighbouring panels: rows of LEGEND_COLUMNS, each row
        # more room above the bars for it; beyond LEGEND_CLASSES a colour scale, as a legend of 300 entries ran
        # off the figure)
        listed = len(classes) <= LEGEND_CLASSES
        legend_rows = math.ceil(len(classes) / LEGEND_COLUMNS) if classes and listed else 1
        top = max([1.0, *(h for b in ax.patches if not math.isnan(h := b.get_height()))])
        ax.set_ylim(0, (1.2 + 0.1 * (legend_rows - 1)) * top)
        ax.grid(alpha=0.3, axis="y")
        if listed:
            ax.legend(fontsize=8, ncol=min(len(classes), LEGEND_COLUMNS), loc="upper center")
        else:
            scale = ScalarMappable(Normalize(0, len(classes) - 1), plt.get_cmap("turbo"))
            bar = fig.colorbar(scale, ax=ax, pad=0.01)
            ends = [0, len(classes) - 1]
            bar.set_ticks(ends, labels=[f"class {classes[k]}" for k in ends])

    bars(mid, "hit_rate", relative=False)
    mid.set_ylabel("prefix-cache hit ratio (higher is better)")
    mid.set_title("each class's hit ratio")
    ref_label = (anchors[0] if anchors else results[0])["label"]
    bars(right, "ttft_mean_s", relative=True)
    right.set_ylabel(f"mean TTFT / {ref_label}'s (lower is better)")
    right.set_title(f"each class's mean TTFT relative to {ref_label}")
    fig.tight_layout()
    fig.savefig(out / "frontier.png", dpi=100)
    plt.close(fig)
    written.append("frontier.png")
    return written


# ---------------------------------------------------------------------------------------------- parser
def add_subcommands(sub: Any) -> None:
    """Register ``simulate`` and ``compare`` on the ``kvretain`` subparsers."""
    s = sub.add_parser("simulate", help="simulate serving a workload (default: the multi-tenant workload)")
    _add_common(s)
    s.add_argument(
        "--policy",
        default="unified",
        choices=_Offered(sim_policy_names(), policy_names()),
        help="eviction policy (default unified)",
    )
    s.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (latencies in seconds, keys ending _s: the client's TTFT and e2e, TPOT, ITL, the "
        "engine's queueing time; _p50/_p90/_p99 interpolated linearly as numpy's and vLLM's benchmark; "
        "request_throughput_rps (finished requests), goodput_rps and output_tokens_per_s per second of "
        "simulated_s, as vLLM's benchmark; 'requests': those that finished)",
    )
    s.set_defaults(func=cmd_simulate, check=check_sim)
    c = sub.add_parser(
        "compare",
        help="policies x protection budgets into a report folder",
        description="Run --policies as they are and unified with each fixed budget of --budgets on one "
        "workload; write summary.json, summary.md, runs.csv and plots (with matplotlib) to --out. Without "
        "--kv-blocks the pool holds the peak reuse working set of the requests at protected retention "
        "priority (class 0 by default), so that each budget trades class 0's hits against the others'.",
    )
    _add_common(c, compare=True)
    c.add_argument(
        "--policies",
        type=names_of(policy_names, "eviction policy", listed=sim_policy_names),
        default="lru,priority,unified",
        help="comma-separated eviction policies run as they are (default lru,priority,unified)",
    )
    c.add_argument(
        "--budgets",
        type=shares,
        default="0.1,0.2,0.4,0.6,0.8",
        help="unified with these fixed protection budgets, 0..1 (the frontier; default 0.1,0.2,0.4,0.6,0.8)",
    )
    c.add_argument(
        "--frontier-priority-weight",
        type=number(1.0),
        default=1.0,
        help="priority weight of the fixed-budget runs (default 1: no soft bias, so the budget alone "
        "protects; the policies of --policies keep --priority-weight)",
    )
    c.add_argument("--out", default="report", help="report folder (default ./report)")
    c.set_defaults(func=cmd_compare, check=check_sim)
