"""Per-class and overall serving metrics of a finished simulation.

Latencies (seconds, on the client's clock), over the requests that finished: TTFT = first token - arrival;
TPOT = (last token - first token) / (tokens - 1) (a preemption's stall included, as vLLM's; none for one token);
ITL = each gap between two tokens of a request, pooled over the requests (as vLLM's benchmark);
e2e = finish - arrival; queueing = first schedule - the engine's receipt (arrival + the front end's
``frontend_in_s``). Each as mean, p50, p90, p99 (linear interpolation between order statistics, numpy's
default). A request meets its SLO when its TTFT and TPOT are within its class's targets (:class:`SLO`; with one
output token, its TTFT alone, as vLLM's benchmark takes that TPOT as 0 for goodput); SLO
attainment is over every request sent, a request rejected at admission missing its SLO (as goodput counts
requests in DistServe and vLLM's benchmark); request throughput (finished requests), goodput and output tokens
per second divide by the simulated span the caller passes (``Simulation.summary``: the first send of a finished
request to the last token received, the same span for every class), as vLLM 0.33's benchmark
(``vllm/benchmarks/serve.py``, ``calculate_metrics``: ``request_throughput = completed / dur_s``, a failed
request not completed, as a rejected one here).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from kvretain.sched.request import Request


@dataclass(frozen=True, slots=True)
class SLO:
    """Per-class latency targets: TTFT and TPOT in seconds."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            v = getattr(self, name)
            if (
                isinstance(v, bool) or not isinstance(v, int | float) or not v > 0
            ):  # (also NaN; inf: no target)
                raise ValueError(f"{name} must be > 0 seconds (inf: no target), got {v!r}")


DEFAULT_SLOS: Mapping[int, SLO] = {0: SLO(2.0, 0.1), 1: SLO(5.0, 0.2), 2: SLO(60.0, 0.5)}
"""Interactive chat (0), agents (1), batch (2 and beyond: the last entry applies to larger classes)."""


def parse_slos(spec: str) -> dict[int, SLO]:
    """``"0=2:0.1,1=5:0.2"``: class=ttft_s:tpot_s, comma separated."""
    out: dict[int, SLO] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            cls, _, rest = part.partition("=")
            ttft, _, tpot = rest.partition(":")
            key, t1, t2 = int(cls), float(ttft), float(tpot)
        except ValueError:
            raise ValueError(f"SLO entry {part!r}: expected 'class=ttft_s:tpot_s', e.g. '0=2:0.1'") from None
        try:
            slo = SLO(t1, t2)
        except ValueError as exc:
            raise ValueError(f"class {key}: {exc}") from None
        if key in out:
            raise ValueError(f"SLO entry {part!r}: class {key} is given twice")
        out[key] = slo
    return out


def check_slos(slos: Mapping[int, SLO]) -> None:
    """At least one class, each an integer with an :class:`SLO` (``ValueError`` otherwise)."""
    if not slos:
        raise ValueError("slos: at least one class's SLO (the last one applies to larger classes)")
    for cls, slo in slos.items():
        if isinstance(cls, bool) or not isinstance(cls, int) or not isinstance(slo, SLO):
            raise ValueError(f"slos: a request priority (int) to an SLO each, got {cls!r}: {slo!r}")


def slo_for(slos: Mapping[int, SLO], priority: int) -> SLO:
    if priority in slos:
        return slos[priority]
    below = [c for c in slos if c <= priority]
    return slos[max(below)] if below else slos[min(slos)]


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """``q`` in [0, 100]; linear interpolation (numpy's default). NaN for no values."""
    if not 0 <= q <= 100:  # (also NaN: past the ends it read outside the values, or raised IndexError)
        raise ValueError(f"percentile: q must be in [0, 100], got {q!r}")
    n = len(sorted_values)
    if n == 0:
        return math.nan
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _stats(prefix: str, values: Iterable[float | None]) -> dict[str, float | None]:
    return _order_stats(prefix, sorted(x for x in values if x is not None))


def _order_stats(prefix: str, v: Sequence[float]) -> dict[str, float | None]:
    """Mean and percentiles of ``v``, sorted."""
    if not v:
        return {f"{prefix}_{k}": None for k in ("mean_s", "p50_s", "p90_s", "p99_s")}
    return {
        f"{prefix}_mean_s": _r(sum(v) / len(v)),
        f"{prefix}_p50_s": _r(percentile(v, 50)),
        f"{prefix}_p90_s": _r(percentile(v, 90)),
        f"{prefix}_p99_s": _r(percentile(v, 99)),
    }


def _r(x: float) -> float:
    return round(x, 6)


def meets_slo(r: Request, slo: SLO) -> bool:
    ttft, tpot = r.ttft, r.tpot
    return ttft is not None and ttft <= slo.ttft_s and (tpot is None or tpot <= slo.tpot_s)


def itl_gaps(reqs: Iterable[Request]) -> list[float]:
    """Every gap between two tokens of a request, pooled over ``reqs`` and sorted (ITL, as vLLM's benchmark)."""
    return sorted(b - a for r in reqs for a, b in pairwise(r.token_times))


def latency_summary(
    reqs: Sequence[Request],
    slos: Mapping[int, SLO],
    simulated_s: float,
    rejected: int = 0,
    itls: Sequence[float] | None = None,
) -> dict[str, Any]:
    """Latency, SLO and throughput figures of ``reqs`` (finished requests) and ``rejected`` more that were
    refused at admission (they count in the SLO attainment, as misses); ``itls``: :func:`itl_gaps` of ``reqs``
    when the caller has them (millions of gaps: sorted once per class, merged for all)."""
    out: dict[str, Any] = {"requests": len(reqs)}
    out.update(_stats("ttft", [r.ttft for r in reqs]))
    out.update(_stats("tpot", [r.tpot for r in reqs]))
    # every gap between two tokens of a request, pooled over requests (vLLM's benchmark's ITL): a stall that a
    # request's mean (TPOT) averages away, a preemption's for one, shows in its tail
    out.update(_order_stats("itl", itl_gaps(reqs) if itls is None else itls))
    out.update(_stats("e2e", [r.e2e for r in reqs]))
    out.update(_stats("queue", [r.queueing_time for r in reqs]))
    good = [r for r in reqs if meets_slo(r, slo_for(slos, r.priority))]
    sent = len(reqs) + rejected
    out["slo_attainment"] = _r(len(good) / sent) if sent else None
    span = simulated_s if simulated_s > 0 else math.inf
    out["request_throughput_rps"] = _r(len(reqs) / span)  # (vLLM's "Request throughput (req/s)")
    out["goodput_rps"] = _r(len(good) / span)
    out["output_tokens"] = sum(r.num_output_tokens for r in reqs)
    out["output_tokens_per_s"] = _r(out["output_tokens"] / span)
    out["preemptions"] = sum(r.num_preemptions for r in reqs)
    return out
