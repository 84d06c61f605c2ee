"""How many distinct prompt tokens a workload keeps "alive" at once: the KV it would like to keep.

A prompt is a chain of chunks (``TokenSeq.chunks``); each distinct chain prefix is one node of a trie, so
a shared system prompt or document counts once. A node is *alive* from one use until its next use (a
request arriving whose prompt contains it): holding exactly the alive nodes is what an ideal cache needs to
serve every reuse as a hit. The working set at time ``t`` is the token count of the alive nodes;
``peak_tokens`` is its maximum over the workload. Sharing is seen at chunk granularity: two prompts with
equal tokens but different chunking are not merged, which can only under-count sharing, never invent it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvretain.workloads.request import WorkloadRequest
from kvretain.workloads.tokens import Chunk


@dataclass(frozen=True, slots=True)
class WorkingSet:
    peak_tokens: int  # most tokens alive at once
    peak_time_s: float  # when the peak is first reached
    mean_tokens: float  # time average over [first arrival, last arrival]
    distinct_tokens: int  # distinct prompt tokens of the whole workload (at chunk granularity)
    reused_tokens: int  # prompt tokens an unbounded prefix cache would serve as hits


def working_set(requests: Iterable[WorkloadRequest]) -> WorkingSet:
    """Measure the reuse working set of ``requests`` (see the module docstring). O(total chunks)."""
    node_of: dict[tuple[int, Chunk], int] = {}
    last_use: list[float] = []
    events: list[tuple[float, int]] = []  # (time, +tokens / -tokens)
    distinct = reused = 0
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    for r in ordered:
        t = r.arrival_s
        parent = -1
        for c in r.prompt.chunks:
            key = (parent, c)
            node = node_of.get(key)
            if node is None:
                node = node_of[key] = len(last_use)
                last_use.append(t)
                distinct += c.length
            else:
                events.append((last_use[node], c.length))
                events.append((t, -c.length))
                last_use[node] = t
                reused += c.length
            parent = node
    if not ordered:
        return WorkingSet(0, 0.0, 0.0, 0, 0)
    events.sort()  # at equal times removals (negative) come first
    start, end = ordered[0].arrival_s, ordered[-1].arrival_s
    alive = peak = 0
    peak_t, prev_t, area = start, start, 0.0
    for t, delta in events:
        area += alive * (t - prev_t)
        prev_t = t
        alive += delta
        if alive > peak:
            peak, peak_t = alive, t
    mean = area / (end - start) if end > start else float(peak)
    return WorkingSet(peak, peak_t, mean, distinct, reused)
