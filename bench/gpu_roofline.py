"""A catalog model's forward steps timed on a real GPU, beside the roofline cost model that prices them.

    PYTHONPATH=src python bench/gpu_roofline.py [--model llama-3-8b] [--gpu h200] [--out h200.toml]

The simulator prices a step with the roofline of :mod:`kvretain.engine.sim.costmodel`, derated by the GPU
entry's ``compute_efficiency`` and ``bandwidth_efficiency`` (0.6 and 0.7 in the catalog, picked inside the field
notes' "real engines reach 40-70% of these peaks"). This bench measures what they are on the GPU it runs on: a
dense decoder of the catalog model's shape (random weights in bf16; cuBLAS matmuls; PyTorch's fused attention
with grouped KV heads over a contiguous KV cache; RMSNorm and SwiGLU; the LM head on the sampled rows only;
decode steps captured and replayed as CUDA graphs, as vLLM runs them) is timed per step, alone on the GPU:

- prefill steps of one sequence, ``n`` new tokens after ``p`` cached (``p`` > 0: a prefix-cache hit whose KV
  is read, the case kvretain is about), and
- decode steps of ``B`` sequences at context ``C``.

Per point it prints the measured forward time, the catalog roofline's (without its fixed step overhead, which
covers the engine's scheduling and input preparation that this forward does not have), their ratio, the side
that bounds the step, and the fraction of that side's peak the step reached (the ideal roofline's time over
the measured one). The medians of that fraction over compute-bound and memory-bound points are this GPU's
measured efficiencies, to set beside the catalog's. It also fits the profiled cost model
(:mod:`kvretain.engine.sim.profiled`) to the points and writes its TOML with ``--out``: ``kvretain simulate
--gpu GPU --cost-model FILE`` then prices steps from these measurements (engine overhead not included).

What this is not: vLLM. It has no paged attention, no fused RoPE or activation kernels and no sampler; RoPE is
left out (an element-wise pass per layer). It is the hardware's answer for the model's shapes, which is what the
catalog's efficiencies stand for. ``--device cpu`` runs the same steps on the CPU, with small shapes from a
``--catalog`` file, to try the script where there is no GPU. Last line JSON: ``{"gpu": ..., "points": n,
"compute_efficiency": x, "bandwidth_efficiency": y, "catalog_compute_efficiency": .., ...}``.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvretain.cli_args import (
    DefaultsHelpFormatter,
    Parser,
    check_other_file,
    check_output_file,
    fail,
    integer,
    path_arg,
    summary_of,
)
from kvretain.cli_profile import int_list
from kvretain.engine.sim.catalog import CatalogError, GPUSpec, ModelSpec, builtin_catalog, load_catalog
from kvretain.engine.sim.costmodel import CostModel, chunk_counts
from kvretain.engine.sim.profiled import (
    COEFFICIENTS,
    Profile,
    StepCoefficients,
    StepPoint,
    cross_validated_errors,
    error_measurable,
    fit,
    median_relative_error,
    write_profile,
)
from kvretain.fileio import replaced

PROG = "gpu_roofline"
GRAPH_TOKENS = 512
"""Steps of at most this many tokens run as CUDA graph replays: vLLM captures graphs up to a largest batch size
(``max_cudagraph_capture_size``, 512 by default) and runs larger steps without them."""
MAX_KV_TOKENS = 1 << 18
"""Most KV tokens one decode point allocates (``B*C``): 34 GB on Llama-3-8B, under half an H200 beside the
weights; larger batches are left out rather than run out of memory."""


@dataclass(frozen=True)
class Step:
    """One measured step: a prefill chunk of ``new`` tokens after ``cached`` ones whose KV is there (``new`` 0:
    none), and ``decodes`` sequences generating one token each at ``context`` (the new token included)."""

    new: int = 0
    cached: int = 0
    decodes: int = 0
    context: int = 0

    @property
    def kind(self) -> str:
        return "mixed" if self.new and self.decodes else "prefill" if self.new else "decode"

    def chunks(self) -> list[tuple[int, int, bool]]:
        """``(n, p, sampled)`` per sequence, as the simulator's steps count them (a decode: ``(1, C - 1, True)``)."""
        head = [(self.new, self.cached, True)] if self.new else []
        return head + [(1, self.context - 1, True)] * self.decodes

    def counts(self) -> tuple[int, int, int, int]:
        """``(tokens, attention pairs, KV tokens read or written, sampled)``, as :class:`CostModel` counts them."""
        return chunk_counts(self.chunks())

    def label(self) -> str:
        parts = [f"prefill {self.new} after {self.cached}"] if self.new else []
        if self.decodes:
            parts.append(f"decode {self.decodes} x ctx {self.context}")
        return " + ".join(parts)


@dataclass(frozen=True)
class Row:
    """A step's measured time beside the roofline's."""

    step: Step
    seconds: float
    roofline_s: float  # the catalog's efficiencies, without the fixed step overhead
    ideal_s: float  # 100% of peak on both sides
    bound: str  # "compute" or "memory": the side the ideal roofline says bounds the step
    reached: float  # ideal_s / seconds: the fraction of the bounding side's peak the step reached
    graphed: bool = False  # timed as CUDA graph replays


def plan(
    prefill: Sequence[int],
    cached: Sequence[int],
    batches: Sequence[int],
    contexts: Sequence[int],
    mixed: Sequence[int] = (),
) -> list[Step]:
    """The steps to time: prefills of each ``n`` after no cache; ``n`` = the middle prefill size after each cached
    length; decodes of each batch at each context; and, for each batch in ``mixed``, the smallest and the middle
    prefill chunk in one step with that many decodes at the first context (chunked prefill, as vLLM batches it;
    0: none).
    Steps over :data:`MAX_KV_TOKENS` are left out."""
    steps = [Step(n, 0) for n in prefill]
    mid = sorted(prefill)[len(prefill) // 2] if prefill else 0
    steps += [Step(mid, p) for p in cached if p > 0 and mid]
    steps += [Step(0, 0, b, c) for b in batches for c in contexts]
    if prefill and contexts:
        steps += [Step(n, 0, b, contexts[0]) for b in mixed if b > 0 for n in sorted({min(prefill), mid})]
    return [s for s in steps if s.counts()[2] <= MAX_KV_TOKENS]


def analyse(
    steps: Sequence[Step],
    seconds: Sequence[float],
    model: ModelSpec,
    gpu: GPUSpec,
    graphed: Sequence[bool] | None = None,
) -> list[Row]:
    """Each step's measured ``seconds`` beside the catalog roofline of ``model`` on ``gpu`` (pure Python)."""
    cm = CostModel(model, gpu, tp=1)
    rows = []
    for k, (st, s) in enumerate(zip(steps, seconds, strict=True)):
        flops, nbytes = cm.step_work(*st.counts())
        t_c, t_m = flops / gpu.peak_flops, nbytes / gpu.mem_bandwidth
        roof = max(t_c / gpu.compute_efficiency, t_m / gpu.bandwidth_efficiency)
        ideal = max(t_c, t_m)
        g = bool(graphed[k]) if graphed is not None else False
        rows.append(Row(st, s, roof, ideal, "compute" if t_c >= t_m else "memory", ideal / s, g))
    return rows


def batching_gains(rows: Sequence[Row]) -> list[tuple[Step, float]]:
    """Each mixed step's time over the sum of its parts timed alone (its prefill chunk; its decodes): below 1,
    the one forward that runs both saves what the roofline's one ``max(compute, memory)`` says it does."""
    alone = {r.step: r.seconds for r in rows if r.step.kind != "mixed"}
    out = []
    for r in rows:
        st = r.step
        if st.kind == "mixed":
            p, d = alone.get(Step(st.new, st.cached)), alone.get(Step(0, 0, st.decodes, st.context))
            if p is not None and d is not None:
                out.append((st, r.seconds / (p + d)))
    return out


def fitted(rows: Sequence[Row]) -> tuple[tuple[StepPoint, ...], StepCoefficients | None]:
    """The rows as a profile's points and the profiled model fitted to them (None: fewer points than the
    model has coefficients)."""
    points = tuple(_point(r) for r in rows)
    return points, fit(points) if len(points) >= len(COEFFICIENTS) else None


def summary(
    rows: Sequence[Row],
    gpu: GPUSpec,
    fit_: tuple[tuple[StepPoint, ...], StepCoefficients | None] | None = None,
) -> dict[str, Any]:
    """The measured efficiencies (medians of ``reached`` per bounding side), the roofline's error and the fit's
    (``fit_``: :func:`fitted` of ``rows``, when the caller has it)."""

    def med(xs: list[float]) -> float | None:
        return round(statistics.median(xs), 4) if xs else None

    points, coef = fit_ if fit_ is not None else fitted(rows)
    ratios = [r.roofline_s / r.seconds for r in rows]
    return {
        "gpu": gpu.name,
        "points": len(rows),
        "compute_efficiency": med([r.reached for r in rows if r.bound == "compute"]),
        "bandwidth_efficiency": med([r.reached for r in rows if r.bound == "memory"]),
        "catalog_compute_efficiency": gpu.compute_efficiency,
        "catalog_bandwidth_efficiency": gpu.bandwidth_efficiency,
        "roofline_median_abs_rel_error": med([abs(x - 1.0) for x in ratios]),
        "roofline_over_measured_min": round(min(ratios), 4) if rows else None,
        "roofline_over_measured_max": round(max(ratios), 4) if rows else None,
        "mixed_over_parts": [round(g, 4) for _, g in batching_gains(rows)],
        # the fit's error on its own points (in-sample: optimistic, 0 for four points) and leave-one-out, as
        # ``kvretain profile`` reports it; neither for as many points as coefficients
        "fit_median_abs_rel_error": (
            round(median_relative_error(coef, points), 4) if coef and error_measurable(len(points)) else None
        ),
        "fit_loo_median_abs_rel_error": med(cross_validated_errors(points) or []) if coef else None,
    }


def _point(r: Row) -> StepPoint:
    tokens, pairs, _, sampled = r.step.counts()
    return StepPoint(tokens, pairs, sampled, r.seconds, r.step.kind)


def table(rows: Sequence[Row]) -> str:
    w = max([38] + [len(r.step.label()) + 2 for r in rows])
    head = f"{'step':<{w}}{'measured ms':>12}{'roofline ms':>12}{'roof/meas':>10}{'bound':>9}{'of peak':>9}{'graph':>7}"
    out = [head, "-" * len(head)]
    for r in rows:
        out.append(
            f"{r.step.label():<{w}}{r.seconds * 1e3:>12.3f}{r.roofline_s * 1e3:>12.3f}{r.roofline_s / r.seconds:>10.3f}"
            f"{r.bound:>9}{r.reached:>9.1%}{'yes' if r.graphed else 'no':>7}"
        )
    gains = batching_gains(rows)
    if gains:
        out.append("")
        out.append("mixed step / (its prefill alone + its decodes alone):")
        out += [f"  {st.label():<{w}}{g:>8.3f}" for st, g in gains]
    return "\n".join(out)


# --- measuring (PyTorch) ------------------------------------------------------------------------------------


class Decoder:
    """A dense decoder of ``model``'s shape with random weights, on ``device``: the forward of one step."""

    def __init__(self, model: ModelSpec, torch: Any, device: str, dtype: Any, seed: int) -> None:
        self.m, self.torch, self.device, self.dtype = model, torch, device, dtype
        gen = torch.Generator(device=device).manual_seed(seed)
        d, h, nq, nkv, f = model.d_model, model.head_dim, model.n_q_heads, model.n_kv_heads, model.ffn_dim

        def w(*shape: int) -> Any:
            t = torch.empty(*shape, device=device, dtype=dtype)
            return t.normal_(0.0, 0.02, generator=gen)

        self.layers = [
            (torch.ones(d, device=device, dtype=dtype), w(d, (nq + 2 * nkv) * h), w(nq * h, d),
             torch.ones(d, device=device, dtype=dtype), w(d, 2 * f), w(f, d))
            for _ in range(model.n_layers)
        ]  # fmt: skip
        self.embed = w(model.vocab_size, d)
        self.head = self.embed.t() if model.tied_embeddings else w(d, model.vocab_size)
        self.final_norm = torch.ones(d, device=device, dtype=dtype)
        self.attention: dict[str, str] = {}
        """How each kind of attention call ran: ``grouped-kv`` (fused, KV heads in place) or ``repeated-kv``."""

    def kv_cache(self, batch: int, length: int) -> list[tuple[Any, Any]]:
        m, t = self.m, self.torch
        shape = (batch, m.n_kv_heads, length, m.head_dim)
        return [
            (
                t.zeros(shape, device=self.device, dtype=self.dtype),
                t.zeros(shape, device=self.device, dtype=self.dtype),
            )
            for _ in range(m.n_layers)
        ]

    def _attend(self, q: Any, k: Any, v: Any, mask: Any, causal: bool) -> Any:
        """Attention with grouped KV heads read in place where a fused kernel takes them; else (the first call of
        each kind tells, before any graph is captured) the KV heads repeated to the query heads' count."""
        t = self.torch
        F = t.nn.functional
        kind = "prefix" if mask is not None else "causal" if causal else "decode"
        way = self.attention.get(kind)
        if way != "repeated-kv":
            try:
                with self._fused():
                    o = F.scaled_dot_product_attention(
                        q,
                        k,
                        v,
                        attn_mask=mask,
                        is_causal=causal,
                        enable_gqa=self.m.n_q_heads != self.m.n_kv_heads,
                    )
                self.attention[kind] = "grouped-kv"
                return o
            except RuntimeError:
                if way is not None:
                    raise
                self.attention[kind] = "repeated-kv"
        rep = self.m.n_q_heads // self.m.n_kv_heads
        with self._fused():
            return F.scaled_dot_product_attention(
                q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask, is_causal=causal
            )

    def _fused(self) -> Any:
        """On CUDA only the fused attention kernels (flash, memory-efficient, cuDNN): never the one that writes
        the whole score matrix to memory; on the CPU whatever PyTorch picks."""
        if not self.device.startswith("cuda"):
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(
            [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
        )

    def forward(self, ids: Any, groups: Sequence[Group]) -> Any:
        """Logits of each sequence's last token after one step: ``groups`` of sequences, each computing ``new``
        tokens after ``cached`` whose KV is in its ``cache`` (``ids``: the groups' tokens in order). The linear
        layers run over every token of the step at once; attention runs per group."""
        t, m = self.torch, self.m
        F = t.nn.functional
        d, h, nq, nkv = m.d_model, m.head_dim, m.n_q_heads, m.n_kv_heads
        x = self.embed[ids]  # (tokens, d)
        for li, (n1, wqkv, wo, n2, wgu, wd) in enumerate(self.layers):
            qkv = F.rms_norm(x, (d,), n1) @ wqkv
            outs = []
            off = 0
            for g in groups:
                rows = qkv[off : off + g.batch * g.new]
                off += g.batch * g.new
                q, k, v = rows.split((nq * h, nkv * h, nkv * h), dim=-1)
                kc, vc = g.cache[li]
                end = g.cached + g.new
                kc[:, :, g.cached : end] = k.view(g.batch, g.new, nkv, h).transpose(1, 2)
                vc[:, :, g.cached : end] = v.view(g.batch, g.new, nkv, h).transpose(1, 2)
                q = q.view(g.batch, g.new, nq, h).transpose(1, 2)
                o = self._attend(q, kc[:, :, :end], vc[:, :, :end], g.mask, g.new > 1 and not g.cached)
                outs.append(o.transpose(1, 2).reshape(g.batch * g.new, nq * h))
            x = x + (outs[0] if len(outs) == 1 else t.cat(outs)) @ wo
            gu = F.rms_norm(x, (d,), n2) @ wgu
            gate, up = gu.chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ wd
        lasts = []
        off = 0
        for g in groups:
            lasts.append(x[off : off + g.batch * g.new].view(g.batch, g.new, d)[:, -1])
            off += g.batch * g.new
        last = lasts[0] if len(lasts) == 1 else t.cat(lasts)
        return F.rms_norm(last, (d,), self.final_norm) @ self.head

    def group(self, batch: int, new: int, cached: int) -> Group:
        """``batch`` sequences computing ``new`` tokens each after ``cached``, with a KV cache of their own."""
        mask = None
        if (
            new > 1 and cached
        ):  # a chunk after a cached prefix: causal over the new tokens, the prefix visible
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(new, cached + new)
        return Group(batch, new, cached, self.kv_cache(batch, cached + new), mask)


@dataclass
class Group:
    """Sequences of one step that share a shape: ``batch`` of them, ``new`` tokens each after ``cached``."""

    batch: int
    new: int
    cached: int
    cache: list[tuple[Any, Any]]
    mask: Any = None


def measure(
    dec: Decoder,
    steps: Sequence[Step],
    repeats: int,
    graph_tokens: int,
    progress: Callable[[str], None],
) -> list[tuple[float, bool] | None]:
    """Median seconds of each step's forward over ``repeats`` timed runs after two warm-ups, and whether it ran
    as CUDA graph replays: on CUDA a step of at most ``graph_tokens`` tokens is captured once and replayed (as
    vLLM runs steps up to its largest captured size, 512 tokens by default), a larger one runs eagerly; times
    come from CUDA events. A step that fails (out of memory, a kernel PyTorch does not have) is None, said on
    stderr, and the others still run."""
    out: list[tuple[float, bool] | None] = []
    # one untimed step first: the libraries' one-time set-up (handles, workspaces) is no step's time
    if steps:
        with contextlib.suppress(RuntimeError, MemoryError):
            _time_step(dec, steps[0], 1, graph_tokens)
    for st in steps:
        progress(st.label())
        try:
            out.append(_time_step(dec, st, repeats, graph_tokens))
        except (RuntimeError, MemoryError) as exc:  # (torch.cuda.OutOfMemoryError is a RuntimeError)
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            print(f"  failed: {first[:200]}", file=sys.stderr, flush=True)
            out.append(None)
        if dec.device.startswith("cuda"):
            dec.torch.cuda.empty_cache()
    return out


def _time_step(dec: Decoder, st: Step, repeats: int, graph_tokens: int) -> tuple[float, bool]:
    t = dec.torch
    cuda = dec.device.startswith("cuda")
    groups = []
    if st.new:
        groups.append(dec.group(1, st.new, st.cached))
    if st.decodes:
        groups.append(dec.group(st.decodes, 1, st.context - 1))
    tokens = st.counts()[0]
    ids = t.randint(0, dec.m.vocab_size, (tokens,), device=dec.device)
    graphed = cuda and tokens <= graph_tokens
    with t.inference_mode():

        def run() -> Any:
            return dec.forward(ids, groups)

        call: Callable[[], Any] = run
        if graphed:
            side = t.cuda.Stream()
            side.wait_stream(t.cuda.current_stream())
            with t.cuda.stream(side):  # (warm-up before capture, on a side stream, as PyTorch asks)
                for _ in range(2):
                    run()
            t.cuda.current_stream().wait_stream(side)
            g = t.cuda.CUDAGraph()
            with t.cuda.graph(g):
                run()
            call = g.replay
        for _ in range(2):
            call()
        times = []
        for _ in range(repeats):
            if cuda:
                e0, e1 = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
                e0.record()
                call()
                e1.record()
                e1.synchronize()
                times.append(e0.elapsed_time(e1) / 1e3)
            else:
                c0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - c0)
    return statistics.median(times), graphed


def build_parser() -> Parser:
    """The command line (``--help`` shows every option's default)."""
    ap = Parser(prog=PROG, description=summary_of(__doc__), formatter_class=DefaultsHelpFormatter)
    ap.add_argument(
        "--model", default="llama-3-8b", help="catalog model whose shapes are run (default llama-3-8b)"
    )
    ap.add_argument(
        "--gpu", default="h200", help="catalog GPU entry the measurement is set beside (default h200)"
    )
    ap.add_argument(
        "--catalog",
        type=path_arg("a catalog TOML file"),
        help="extra models and GPUs (TOML file; default: the built-in catalog only)",
    )
    ap.add_argument("--device", default="cuda", help="torch device (default cuda; cpu to try the script)")
    ap.add_argument(
        "--prefill",
        type=int_list,
        default=[256, 512, 1024, 2048, 4096, 8192, 16384],
        help="new tokens of the prefill steps timed from an empty cache (comma-separated token counts)",
    )
    ap.add_argument(
        "--cached",
        type=int_list,
        default=[2048, 8192, 32768],
        help="cached tokens before a prefill of the middle --prefill size (comma-separated token counts)",
    )
    ap.add_argument(
        "--batches",
        type=int_list,
        default=[1, 4, 16, 64, 128, 256],
        help="sequences per decode step, each batch timed at each --contexts (comma-separated counts)",
    )
    ap.add_argument(
        "--contexts",
        type=int_list,
        default=[1024, 4096],
        help="context length of each decoding sequence (comma-separated token counts)",
    )
    ap.add_argument(
        "--mixed",
        type=int_list,
        default=[16, 64],
        help="decode batches run in one step with a prefill chunk (comma-separated sequence counts; 0: none)",
    )
    ap.add_argument(
        "--repeats", type=integer(1), default=10, help="timed runs per step, the median counts (a count)"
    )
    ap.add_argument(
        "--graph-tokens",
        type=integer(0),
        default=GRAPH_TOKENS,
        help=f"steps of at most this many tokens run as CUDA graph replays (default {GRAPH_TOKENS}; 0: none)",
    )
    ap.add_argument("--seed", type=integer(0), default=0, help="seed of the random weights (an integer >= 0)")
    ap.add_argument(
        "--out",
        help="write the fitted profile (TOML) here, for `kvretain simulate --cost-model` (a file; default: "
        "not written)",
    )
    ap.add_argument(
        "--json",
        dest="json_out",
        help="write the rows and the summary as JSON here (a file; default: not written)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    for opt, sizes in (
        ("--prefill", args.prefill),
        ("--batches", args.batches),
        ("--contexts", args.contexts),
    ):
        if 0 in sizes:  # (a 0 is no step: an empty forward, or a decode at context 0)
            return fail(PROG, f"argument {opt}: sizes must be >= 1, got {','.join(map(str, sizes))}")
    try:
        cat = load_catalog(args.catalog) if args.catalog else builtin_catalog()
        model, gpu = cat.model(args.model), cat.gpu(args.gpu)
    except (CatalogError, KeyError) as exc:
        return fail(PROG, str(exc).strip("'\""))
    for opt, path in (("--out", args.out), ("--json", args.json_out)):
        if path is not None:
            try:
                check_output_file(path, opt)
            except ValueError as exc:
                return fail(PROG, str(exc))
    if args.out is not None and args.json_out is not None:
        try:  # (the profile is written after the JSON: it would replace the rows and the summary)
            check_other_file(
                args.json_out,
                "--json",
                args.out,
                "the profile's own file (--out)",
                "the profile would replace the rows and the summary",
            )
        except ValueError as exc:
            return fail(PROG, str(exc))
    if model.tp != 1:
        return fail(
            PROG, f"argument --model: {model.name} runs at tp={model.tp}; this bench times one GPU (tp=1)"
        )
    steps = plan(args.prefill, args.cached, args.batches, args.contexts, args.mixed)
    if not steps:
        return fail(PROG, "no step to time: give --prefill or --batches and --contexts")
    if args.out is not None and len(steps) < len(COEFFICIENTS):
        return fail(
            PROG,
            f"argument --out: a profile fits {len(COEFFICIENTS)} coefficients; {len(steps)} steps are too few",
        )
    try:
        import torch
    except ImportError:
        return fail(PROG, "PyTorch is not importable here (run it with the Python that has torch)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        return fail(PROG, "argument --device: CUDA is not available here (--device cpu to try the script)")
    dtype = torch.bfloat16
    t0 = time.perf_counter()
    print(f"building {model.name} with random bf16 weights on {args.device} ...", file=sys.stderr, flush=True)
    dec = Decoder(model, torch, args.device, dtype, args.seed)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"

    def progress(what: str) -> None:
        print(f"  timing {what}", file=sys.stderr, flush=True)

    measured = measure(dec, steps, args.repeats, args.graph_tokens, progress)
    failed = [st for st, m in zip(steps, measured, strict=True) if m is None]
    done = [(st, m) for st, m in zip(steps, measured, strict=True) if m is not None]
    if not done:
        print(f"{PROG}: every step failed on {args.device}", file=sys.stderr)
        return 1
    rows = analyse([st for st, _ in done], [m[0] for _, m in done], model, gpu, [m[1] for _, m in done])
    print(f"{model.name} on {name} (catalog entry {gpu.name}), torch {torch.__version__}, "
          f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
    print(table(rows))
    points, coef = fitted(rows)
    summ = summary(rows, gpu, (points, coef))
    summ["device_name"] = name
    summ["torch"] = torch.__version__
    summ["attention"] = sorted(f"{k}:{v}" for k, v in dec.attention.items())
    summ["graph_tokens"] = args.graph_tokens
    summ["failed"] = [st.label() for st in failed]
    if args.json_out is not None:
        with replaced(args.json_out) as tmp:  # whole or not at all
            tmp.write_text(json.dumps({"rows": [_row_json(r) for r in rows], "summary": summ}, indent=1))
    print(json.dumps(summ))
    if args.out is not None:
        if coef is None:
            print(
                f"{PROG}: {len(points)} steps timed: too few to fit a profile, --out not written",
                file=sys.stderr,
            )
            return 1
        info: dict[str, Any] = {"engine": f"PyTorch {torch.__version__} forward (bench/gpu_roofline.py)", "model": model.name,
                "device": name, "what": "forward"}  # fmt: skip
        loo = summ["fit_loo_median_abs_rel_error"]  # (as kvretain profile writes it; rounded to 4 places)
        if loo is None:
            info["fit_error"] = f"not measurable: {len(points)} points for {len(COEFFICIENTS)} coefficients"
        else:
            info["loo_median_abs_rel_error"] = loo
        write_profile(args.out, Profile(coef, points, info))
    return 0


def _row_json(r: Row) -> dict[str, Any]:
    st = r.step
    return {
        "kind": st.kind,
        "new": st.new,
        "cached": st.cached,
        "decodes": st.decodes,
        "context": st.context,
        "graphed": r.graphed,
        "seconds": r.seconds,
        "roofline_s": r.roofline_s,
        "ideal_s": r.ideal_s,
        "bound": r.bound,
        "reached": r.reached if math.isfinite(r.reached) else None,
    }


if __name__ == "__main__":
    raise SystemExit(main())
