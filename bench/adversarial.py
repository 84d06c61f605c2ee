"""Adversarial traffic for ``unified`` (session 36): synthetic traces of shapes the robustness grid
(bench/robustness.py) does not hold, each designed to break one of ``unified``'s claims against ``lru``:
(a) overall hit ratio at least 0.98x lru's, (b) class 0's hit ratio at least lru's class 0, (c) with one class
(every request at priority 0) overall at least lru's.

    python bench/adversarial.py [NAME ...] [--set adversarial|fresh] [--fractions F ...] [--jobs N] [--no-one-class]
                                [--json FILE]
    python bench/adversarial.py --list          # the trace names, one line each
    python bench/adversarial.py five-levels-s12 c0-follows-lag200 --no-progress
    python bench/adversarial.py --set fresh --jobs 2   # session 43's realistic shapes instead

Traces (``[NAME ...]``, default all; generators and seeds fixed when they were first run, in session 36,
before the controller change that session made; priority 0 is the important class):
  * ``c0-scan``: class 0 a scan (one-off documents behind a class prompt, 8% re-reads of its last 20);
    class 1 re-uses a 150-doc zipf working set.
  * ``swap``: class 0 re-uses set A and class 1 set B, swapped halfway; class 1 also sends one-off documents.
  * ``c0-bursts``: class 0 in rare bursts (40 requests every ~600, over 25 docs); heavy class 1 in between.
  * ``shared-sys``: a 24-block system prompt shared by both classes; class 0 flat over 1,500 docs (little
    reuse), class 1 zipf over 60 (much reuse).
  * ``five-levels``: priorities 0..4, equal shares, reuse increasing with the priority number (class 0 least).
  * ``five-levels-s11`` .. ``-s14``: five levels at seeds 11..14 (the variants' generator).
  * ``five-levels-rev``: five levels with reuse decreasing with the priority number (class 0 the most).
  * ``five-levels-c0rare`` / ``five-levels-c0heavy``: five levels with class 0 5% / 40% of the requests.
  * ``c0-follows-lag50`` / ``-lag200`` / ``-lag800`` (and ``-lag200-s31``, ``-s32``, ``-lag800-s31``, ``-s32``):
    class 0 reads, once, a document class 1 read about LAG requests earlier: its hits come only from
    content class 1 brought in.
  * ``c0-scan-heavy`` (and ``-s21``, ``-s22``): class 0 a heavy scan (60% of requests, 20-40 block one-offs);
    class 1 a zipf working set.
  * ``oneclass-stack``: one class: an LRU-stack-model stream plus hot-then-dead documents.
  * ``oneclass-phases``: one class: a 120-doc working set, 70% replaced every 600 requests.
  * ``oneclass-alt100`` / ``-alt300`` / ``-alt800`` (and ``-alt100-s41``, ``-s42``, ``-alt800-s41``, ``-s42``):
    one class alternating phases of 100/300/800 requests: frequency's traffic, then recency's.

``--set fresh`` (session 43: realistic shapes fixed before their first run): serving shapes an operator would
recognise, none built to break a claim, written and committed before any policy ran on them, each at two seeds
(``NAME-sK``; ``--set fresh --list``); the generators' docstrings give each shape in full:
  * ``branching-s51`` / ``-s52``: best-of-n / tree search: each turn sent as 2-8 parallel branches (the shared
    context, then 1-3 blocks of the branch's own); the next turn continues one chosen branch; class 0 ~25% of the
    sessions.
  * ``lora-tenants-s53`` / ``-s54``: one 300-document corpus read under 4 LoRA adapters / tenants (a tenant's
    copy of a document has its own block ids), zipf popularity per tenant; class 0 the premium tenant.
  * ``code-repo-s55`` / ``-s56``: a team's 30-50 block repo prefix changed by commits (a commit at a random depth
    changes every block from there on); class 0 bursty interactive completions, class 1 batch review jobs.
  * ``diurnal-mix-s57`` / ``-s58``: two classes with their own working sets, class 0's share 5% -> 50% -> 5%
    over the trace, arrivals at a day-like rate.
  * ``summarize-floods-s59`` / ``-s60``: class 0 multi-turn chat; class 1 light RAG and four short bursts of
    huge one-off summarization prompts (each burst 30-90% of the pool at 20% of the distinct blocks).
  * ``agent-loop-s61`` / ``-s62`` (the helper's own shape: agent serving, where a shared tool schema heads
    every prompt, contexts grow by tool results step by step and are compacted when long): class 0 interactive
    agents, class 1 longer background ones.
The default (``--set adversarial``) is session 36's set above, run and printed as before.

Each trace is replayed with ``lru``, ``unified`` (defaults), ``s3fifo`` and ``arc`` at pools sized as
``--fractions`` of its distinct blocks (``max(64, round(f * distinct))``). A trace with several classes is
also replayed relabelled to one class (``unified`` and ``lru``; ``--no-one-class`` skips it); a one-class
trace's own run is its one-class figure.

Printed per trace, one row per pool: overall ``unified`` / ``lru`` and the hit-block difference with its
paired z over requests (:func:`kvretain.core.policies.evidence.paired_difference`); class 0's ``unified`` /
``lru``, hit-block difference, requests that differ and z; the one-class ratio; ``s3fifo`` and ``arc``
overall; ``unified``'s ``protection_level`` at the end; the claims the cell misses. Then every miss, and
whether it is resolved (z <= -1.645, one-sided) or inside the noise: for (b) and (c) the paired difference against
``lru``, for (a) the per-request difference ``unified - 0.98 x lru``. Last stdout line, JSON:
``{"cells": n, "min_overall_vs_lru": r, "cells_below_floor": k, "cells_class0_below_lru": k,
"cells_class0_below_lru_resolved": k, "one_class_min_vs_lru": r, "one_class_below_lru": k}``.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
import random
import sys
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import robustness as grid
from kvretain.cli_args import (
    DefaultsHelpFormatter,
    Parser,
    check_output_file,
    integer,
    json_text,
    number,
    script_main,
    summary_of,
)
from kvretain.core.hashing import BlockIdHasher
from kvretain.core.policies.evidence import paired_difference
from kvretain.core.policy import PolicyConfig
from kvretain.replay import ReplayRequest, ReplayResult, replay

PROG = "adversarial"
BLOCK_TOKENS = 512
POLICIES = ("lru", "unified", "s3fifo", "arc")
PAIRED = ("lru", "unified")
FRACTIONS = (0.06, 0.2, 0.45, 0.8)
"""Pool sizes as shares of a trace's distinct blocks: a small pool to a large one."""
MIN_CAPACITY = 64
REUSE_FLOOR = grid.REUSE_FLOOR  # claim (a): overall at least 0.98x lru's
RESOLVED_Z = grid.RESOLVED_Z  # a shortfall is resolved at z <= -1.645 (one-sided, 5%)

Request = tuple[list[int], int, float]
"""A generated request: its block ids, priority, timestamp in seconds."""


# ------------------------------------------------------------------------------------------- generators
# Each generator returns a list of (block ids, priority, timestamp_s), drawn from its own random.Random(seed).
class Ids:
    """Fresh block ids, counting from 1."""

    def __init__(self) -> None:
        self.n = 1

    def take(self, k: int) -> list[int]:
        out = list(range(self.n, self.n + k))
        self.n += k
        return out


def zipf_sampler(rng: random.Random, n: int, s: float) -> Callable[[], int]:
    cum = list(accumulate(1.0 / (i + 1) ** s for i in range(n)))
    tot = cum[-1]
    return lambda: min(n - 1, bisect_left(cum, rng.random() * tot))


def docs(ids: Ids, rng: random.Random, n: int, lo: int, hi: int) -> list[list[int]]:
    return [ids.take(rng.randint(lo, hi)) for _ in range(n)]


def g_c0_scan(seed: int = 1) -> list[Request]:
    """Class 0 is a scan (one-off documents behind a 2-block class prompt); class 1 re-uses a working set."""
    rng = random.Random(seed)
    ids = Ids()
    s0, s1 = ids.take(2), ids.take(2)
    work = docs(ids, rng, 150, 6, 16)
    pick = zipf_sampler(rng, len(work), 0.9)
    recent0: list[list[int]] = []
    out: list[Request] = []
    t = 0.0
    for _ in range(5000):
        t += rng.expovariate(2.0)
        if rng.random() < 0.35:
            # mostly one-off; 8% re-read one of the last 20 class-0 documents
            if recent0 and rng.random() < 0.08:
                d = recent0[rng.randrange(len(recent0))]
            else:
                d = ids.take(rng.randint(8, 24))
                recent0 = [*recent0, d][-20:]
            out.append((s0 + d + ids.take(1), 0, t))
        else:
            out.append((s1 + work[pick()] + ids.take(rng.randint(1, 2)), 1, t))
    return out


def g_swap(seed: int = 2) -> list[Request]:
    """Drift: class 0 re-uses set A and class 1 set B; halfway they swap (class 1 re-uses A, class 0 B).
    Class 1 also sends one-off documents (30% of its requests)."""
    rng = random.Random(seed)
    ids = Ids()
    sysp = ids.take(2)
    set_a = docs(ids, rng, 100, 8, 16)
    set_b = docs(ids, rng, 100, 8, 16)
    pa, pb = zipf_sampler(rng, 100, 0.8), zipf_sampler(rng, 100, 0.8)
    out: list[Request] = []
    t, n = 0.0, 5000
    for i in range(n):
        t += rng.expovariate(2.0)
        first = i < n // 2
        if rng.random() < 0.4:
            d = set_a[pa()] if first else set_b[pb()]
            out.append((sysp + d + ids.take(rng.randint(1, 3)), 0, t))
        elif rng.random() < 0.3:
            out.append((sysp + ids.take(10), 1, t))
        else:
            d = set_b[pb()] if first else set_a[pa()]
            out.append((sysp + d + ids.take(rng.randint(1, 3)), 1, t))
    return out


def g_c0_bursts(seed: int = 3) -> list[Request]:
    """Class 0 in rare bursts (40 requests every ~600, over a 25-doc working set); heavy class-1 traffic in
    between (zipf over 400 docs, 20% one-off 20-block scans)."""
    rng = random.Random(seed)
    ids = Ids()
    s0, s1 = ids.take(2), ids.take(2)
    w0 = docs(ids, rng, 25, 10, 14)
    w1 = docs(ids, rng, 400, 6, 14)
    p0, p1 = zipf_sampler(rng, 25, 0.6), zipf_sampler(rng, 400, 0.9)
    out: list[Request] = []
    t = 0.0
    while len(out) < 6000:
        for _ in range(rng.randint(450, 750)):
            t += rng.expovariate(2.0)
            if rng.random() < 0.2:
                out.append((s1 + ids.take(20), 1, t))
            else:
                out.append((s1 + w1[p1()] + ids.take(rng.randint(1, 2)), 1, t))
        for _ in range(40):
            t += rng.expovariate(10.0)
            out.append((s0 + w0[p0()] + ids.take(1), 0, t))
    return out[:6000]


def g_shared_sys(seed: int = 4) -> list[Request]:
    """A 24-block system prompt shared by both classes, a 4-block class prompt, then per-class suffixes:
    class 0 from a flat 1,500-doc set (little reuse), class 1 from a 60-doc zipf set (much reuse)."""
    rng = random.Random(seed)
    ids = Ids()
    sysp = ids.take(24)
    c0p, c1p = ids.take(4), ids.take(4)
    d0 = docs(ids, rng, 1500, 4, 10)
    d1 = docs(ids, rng, 60, 4, 10)
    p1 = zipf_sampler(rng, 60, 1.0)
    out: list[Request] = []
    t = 0.0
    for _ in range(4000):
        t += rng.expovariate(2.0)
        if rng.random() < 0.4:
            out.append((sysp + c0p + d0[rng.randrange(1500)] + ids.take(rng.randint(1, 2)), 0, t))
        else:
            out.append((sysp + c1p + d1[p1()] + ids.take(rng.randint(1, 2)), 1, t))
    return out


def g_five_levels(seed: int = 5) -> list[Request]:
    """Priorities 0..4, equal request shares, reuse increasing with the priority number (class 0 the least)."""
    rng = random.Random(seed)
    ids = Ids()
    sizes, skews = [2000, 800, 300, 120, 50], [0.3, 0.6, 0.8, 1.0, 1.1]
    sets = [docs(ids, rng, n, 8, 16) for n in sizes]
    picks = [zipf_sampler(rng, n, s) for n, s in zip(sizes, skews, strict=True)]
    prompts = [ids.take(2) for _ in range(5)]
    out: list[Request] = []
    t = 0.0
    for _ in range(5000):
        t += rng.expovariate(2.0)
        p = rng.randrange(5)
        out.append((prompts[p] + sets[p][picks[p]()] + ids.take(1), p, t))
    return out


def _hot_or_stack(
    rng: random.Random,
    ids: Ids,
    hot: list[tuple[list[int], int]],
    stack: list[list[int]],
    i: int,
    life: tuple[int, int],
    p_hot: float,
    p_new: float,
    depth_mean: float,
) -> tuple[list[tuple[list[int], int]], list[int]]:
    """Request ``i`` of recency's traffic: one of three hot documents (each hammered for ``life`` requests, then
    dead; below ``p_hot``), a new document (below ``p_new``, or while the stack is empty), else a re-read from an
    LRU stack model at a geometric depth of mean ``depth_mean``. Returns the live hot documents and the read one
    (``stack``, most recent last, is updated in place)."""
    hot = [(d, end) for d, end in hot if end > i]
    while len(hot) < 3:
        hot.append((ids.take(rng.randint(6, 20)), i + rng.randint(*life)))
    u = rng.random()
    if u < p_hot:
        return hot, hot[rng.randrange(len(hot))][0]
    if u < p_new or not stack:
        d = ids.take(rng.randint(6, 20))
        stack.append(d)
        return hot, d
    depth = min(len(stack) - 1, int(rng.expovariate(1.0 / depth_mean)))
    d = stack.pop(len(stack) - 1 - depth)
    stack.append(d)
    return hot, d


def g_one_class_shift(seed: int = 6) -> list[Request]:
    """One class: an LRU-stack-model document stream (new documents, re-reads at geometric recency depth)
    plus hot-then-dead documents (a few docs hammered for ~150 requests, then never used again)."""
    rng = random.Random(seed)
    ids = Ids()
    stack: list[list[int]] = []  # most recent last
    hot: list[tuple[list[int], int]] = []
    out: list[Request] = []
    t = 0.0
    for i in range(5000):
        t += rng.expovariate(2.0)
        hot, d = _hot_or_stack(rng, ids, hot, stack, i, (100, 200), 0.3, 0.45, 60.0)
        out.append((d + ids.take(1), 0, t))
    return out


def g_one_class_phases(seed: int = 7) -> list[Request]:
    """One class: a working set of 120 docs that shifts phase by phase (every 600 requests 70% of it is
    replaced), zipf popularity re-drawn each phase, so last phase's favourites have high counts and no future."""
    rng = random.Random(seed)
    ids = Ids()
    ws = docs(ids, rng, 120, 6, 18)
    out: list[Request] = []
    t = 0.0
    pick = zipf_sampler(rng, 120, 1.0)
    for i in range(5000):
        if i and i % 600 == 0:
            rng.shuffle(ws)
            ws = ws[:36] + docs(ids, rng, 84, 6, 18)
            rng.shuffle(ws)
        t += rng.expovariate(2.0)
        out.append((ws[pick()] + ids.take(1), 0, t))
    return out


def g_five_levels_var(
    seed: int = 5, reverse: bool = False, shares: tuple[float, ...] = (0.2, 0.2, 0.2, 0.2, 0.2)
) -> list[Request]:
    """Five levels (variants): seeds, shares per level; ``reverse``: reuse decreasing with the priority number."""
    rng = random.Random(seed)
    ids = Ids()
    sizes, skews = [2000, 800, 300, 120, 50], [0.3, 0.6, 0.8, 1.0, 1.1]
    if reverse:
        sizes, skews = sizes[::-1], skews[::-1]
    sets = [docs(ids, rng, n, 8, 16) for n in sizes]
    picks = [zipf_sampler(rng, n, s) for n, s in zip(sizes, skews, strict=True)]
    prompts = [ids.take(2) for _ in range(5)]
    cum = list(accumulate(shares))
    out: list[Request] = []
    t = 0.0
    for _ in range(5000):
        t += rng.expovariate(2.0)
        p = min(4, bisect_left(cum, rng.random() * cum[-1]))
        out.append((prompts[p] + sets[p][picks[p]()] + ids.take(1), p, t))
    return out


def g_c0_follows(seed: int = 8, lag: float = 150.0, c0_share: float = 0.3) -> list[Request]:
    """Class 0's hits come only from content class 1 brought in: class 1 reads new documents (and re-reads
    recent ones), class 0 reads a document class 1 read about ``lag`` requests earlier, then never again."""
    rng = random.Random(seed)
    ids = Ids()
    sysp = ids.take(2)
    hist: list[list[int]] = []  # docs in the order class 1 first read them
    out: list[Request] = []
    t = 0.0
    for _ in range(5000):
        t += rng.expovariate(2.0)
        if hist and rng.random() < c0_share:
            back = min(len(hist) - 1, int(rng.expovariate(1.0 / lag * 2.0)))  # docs back (about lag/2 docs)
            d = hist[len(hist) - 1 - back]
            out.append((sysp + d + ids.take(rng.randint(1, 2)), 0, t))
        else:
            if rng.random() < 0.5 or not hist:
                d = ids.take(rng.randint(8, 20))
                hist.append(d)
            else:
                d = hist[len(hist) - 1 - min(len(hist) - 1, int(rng.expovariate(1.0 / 40.0)))]
            out.append((sysp + d + ids.take(rng.randint(1, 2)), 1, t))
    return out


def g_one_class_alt(seed: int = 9, period: int = 300) -> list[Request]:
    """One class alternating phases of ``period`` requests: F (a fresh 30-doc zipf hot set + one-off 20-block
    scans, frequency's traffic) and R (hot-then-dead docs and an LRU stack model, recency's)."""
    rng = random.Random(seed)
    ids = Ids()
    out: list[Request] = []
    t = 0.0
    stack: list[list[int]] = []
    hot: list[tuple[list[int], int]] = []
    hotset = docs(ids, rng, 30, 6, 16)
    pick = zipf_sampler(rng, 30, 1.0)
    for i in range(5000):
        t += rng.expovariate(2.0)
        phase_f = (i // period) % 2 == 0
        if i % period == 0 and phase_f:
            hotset = docs(ids, rng, 30, 6, 16)
        if phase_f:
            d = ids.take(20) if rng.random() < 0.5 else hotset[pick()]
        else:
            hot, d = _hot_or_stack(rng, ids, hot, stack, i, (60, 120), 0.35, 0.5, 40.0)
        out.append((d + ids.take(1), 0, t))
    return out


def g_c0_scan_heavy(seed: int = 10) -> list[Request]:
    """Class 0 a heavy scan (60% of requests, 20-40 block one-offs); class 1 a zipf working set."""
    rng = random.Random(seed)
    ids = Ids()
    s0, s1 = ids.take(2), ids.take(2)
    work = docs(ids, rng, 250, 6, 16)
    pick = zipf_sampler(rng, len(work), 0.7)
    out: list[Request] = []
    t = 0.0
    for _ in range(4000):
        t += rng.expovariate(2.0)
        if rng.random() < 0.6:
            out.append((s0 + ids.take(rng.randint(20, 40)), 0, t))
        else:
            out.append((s1 + work[pick()] + ids.take(1), 1, t))
    return out


# ----------------------------------------------------------- session 43: realistic shapes (the fresh set)
# Written and fixed before any policy ran on them (session 43): serving shapes an operator would recognise, none
# of them built to break a claim nor used to tune anything. Each takes ``seed``, ``n`` (its size: requests, or
# for summarize-floods the requests besides the floods) and ``notes``: a list that, when given, receives one dict
# per request saying where it came from (session, turn, tenant, repo version, ...), for the tests.
Note = dict[str, Any]


def _note(notes: list[Note] | None, **what: Any) -> None:
    if notes is not None:
        notes.append(what)


def _later(t: float, last: float) -> float:
    """``t``, or just after ``last`` where it is not later (timestamps strictly increase)."""
    return t if t > last else last + 1e-6


def g_branching(seed: int = 51, n: int = 5000, notes: list[Note] | None = None) -> list[Request]:
    """Best-of-n / tree search. A session (a 3-4 block class prompt and a 2-30 block problem) sends each turn as
    ``b`` parallel branches (2-8, fixed per session): the turn's context, then 1-3 blocks of the branch's own,
    back to back; its next turn continues one chosen branch (that branch's request + a 1-4 block user turn).
    Sessions of 1-4 turns, 24 at a time, a turn every ~2.5 s; class 0 is ~25% of the sessions."""
    rng = random.Random(seed)
    ids = Ids()
    prompts = (ids.take(4), ids.take(3))
    active: list[dict[str, Any]] = []
    out: list[Request] = []
    t, sid = 0.0, 0
    while len(out) < n:
        while len(active) < 24:
            cls = 0 if rng.random() < 0.25 else 1
            ctx = prompts[cls] + ids.take(rng.randint(2, 30))
            active.append(
                {
                    "id": sid,
                    "cls": cls,
                    "ctx": ctx,
                    "turns": rng.randint(1, 4),
                    "turn": 0,
                    "b": rng.randint(2, 8),
                }
            )
            sid += 1
        s = active[rng.randrange(len(active))]
        t += rng.expovariate(0.4)
        sufs = [ids.take(rng.randint(1, 3)) for _ in range(s["b"])]
        for j, suf in enumerate(sufs[: n - len(out)]):
            t += rng.uniform(0.001, 0.02)
            out.append((s["ctx"] + suf, s["cls"], t))
            _note(
                notes,
                session=s["id"],
                turn=s["turn"],
                branch=j,
                context=len(s["ctx"]),
                follows=s.get("follows"),
            )
        s["turn"] += 1
        s["follows"] = rng.randrange(s["b"])
        if s["turn"] >= s["turns"]:
            active.remove(s)
        else:
            s["ctx"] = s["ctx"] + sufs[s["follows"]] + ids.take(rng.randint(1, 4))
    return out


def g_lora_tenants(seed: int = 53, n: int = 5000, notes: list[Note] | None = None) -> list[Request]:
    """One 300-document corpus (8-40 blocks a document) read under 4 LoRA adapters / tenants: a tenant's copy of
    a document has its own block ids (the LoRA id or cache_salt enters every block hash, as in vLLM), behind
    the tenant's 3-block system prompt, then a 1-3 block question. Each tenant its own zipf (s 0.8-1.1) over its
    own ranking of the corpus (a shared popularity, perturbed per tenant); tenants' shares of the requests
    20 / 40 / 25 / 15%; class 0 is tenant 0 (the premium one), class 1 the others."""
    rng = random.Random(seed)
    ids = Ids()
    n_docs, shares = 300, (0.2, 0.4, 0.25, 0.15)
    lengths = [rng.randint(8, 40) for _ in range(n_docs)]
    sysp = [ids.take(3) for _ in shares]
    copies = [[ids.take(k) for k in lengths] for _ in shares]  # copies[tenant][doc]: same text, own ids
    ranks = [
        sorted(range(n_docs), key=lambda d: math.log(d + 1) + rng.gauss(0.0, 1.0)) for _ in shares
    ]  # ranks[tenant][i]: the tenant's i-th most popular document
    picks = [zipf_sampler(rng, n_docs, rng.uniform(0.8, 1.1)) for _ in shares]
    cum = list(accumulate(shares))
    out: list[Request] = []
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(2.0)
        ten = min(len(shares) - 1, bisect_left(cum, rng.random() * cum[-1]))
        d = ranks[ten][picks[ten]()]
        out.append((sysp[ten] + copies[ten][d] + ids.take(rng.randint(1, 3)), 0 if ten == 0 else 1, t))
        _note(notes, tenant=ten, doc=d, doc_blocks=lengths[d])
    return out


def g_code_repo(seed: int = 55, n: int = 5000, notes: list[Note] | None = None) -> list[Request]:
    """A team's repo context, a 30-50 block prefix, changed by commits (one a minute on average; a commit at a
    random depth, deeper more often, gives every block from there on new ids, the length moving by up to 2).
    Class 0 interactive completions in bursts (a developer's 5-25 requests ~0.4 s apart on one open file: the
    repo prefix, 2-6 blocks of the file from 150 (zipf 1.0), a fresh 1-block cursor suffix; ~65% of the
    requests); class 1 batch review jobs (10-40 files each, uniform over 1,500, ~1 s apart: the repo prefix, a
    1-block review instruction, a 4-9 block file)."""
    rng = random.Random(seed)
    ids = Ids()
    length = rng.randint(30, 50)
    versions = [ids.take(length)]
    depths = [0]
    hot = docs(ids, rng, 150, 2, 6)
    pick_hot = zipf_sampler(rng, len(hot), 1.0)
    files = docs(ids, rng, 1500, 4, 9)
    review = ids.take(1)
    # events: (time, order, kind, state); kinds: commit, burst (class 0), job (class 1)
    events: list[tuple[float, int, str, list[Any]]] = []
    order = 0

    def push(at: float, kind: str, state: list[Any]) -> None:
        nonlocal order
        heapq.heappush(events, (at, order, kind, state))
        order += 1

    push(rng.expovariate(1 / 60.0), "commit", [])
    push(rng.expovariate(0.1), "burst", [])
    push(rng.expovariate(0.032), "job", [])
    out: list[Request] = []
    last = 0.0
    while len(out) < n:
        at, _, kind, state = heapq.heappop(events)
        if kind == "commit":
            cur = versions[-1]
            depth = min(len(cur) - 1, int(len(cur) * rng.random() ** 0.5))
            new_len = min(50, max(30, depth + 1, len(cur) + rng.randint(-2, 2)))
            versions.append(cur[:depth] + ids.take(new_len - depth))
            depths.append(depth)
            push(at + rng.expovariate(1 / 60.0), "commit", [])
            continue
        if not state:  # a new burst or job: schedule the next one, and this one's requests
            push(at + rng.expovariate(0.1 if kind == "burst" else 0.032), kind, [])
            state = [rng.randint(5, 25), hot[pick_hot()]] if kind == "burst" else [rng.randint(10, 40), None]
        t = _later(at, last)
        prefix = versions[-1]
        if kind == "burst":
            out.append((prefix + state[1] + ids.take(1), 0, t))
        else:
            out.append((prefix + review + files[rng.randrange(len(files))], 1, t))
        _note(notes, version=len(versions) - 1, depth=depths[-1], prefix=len(prefix))
        last = t
        state[0] -= 1
        if state[0] > 0:
            push(t + rng.expovariate(2.5 if kind == "burst" else 1.0), kind, state)
    return out


def g_diurnal_mix(seed: int = 57, n: int = 5000, notes: list[Note] | None = None) -> list[Request]:
    """Two classes, each with its own working set behind a 3-block class prompt (class 0: 150 documents, zipf
    0.9; class 1: 400, zipf 0.8; 6-40 blocks a document; 15% of each class's requests a one-off 6-40 block
    document), then a 1-3 block question. Class 0's share of the requests drifts 5% -> 50% -> 5% over the
    trace (a raised cosine of the request index); arrivals at a day-like rate over two days (a raised cosine
    of the time of day, the peak at 14:00 six times the trough)."""
    rng = random.Random(seed)
    ids = Ids()
    day, r_lo, r_hi = 86400.0, n / (2 * 86400.0) / 3.5, 6 * n / (2 * 86400.0) / 3.5
    prompts = (ids.take(3), ids.take(3))
    sets = (docs(ids, rng, 150, 6, 40), docs(ids, rng, 400, 6, 40))
    picks = (zipf_sampler(rng, 150, 0.9), zipf_sampler(rng, 400, 0.8))
    out: list[Request] = []
    t = 0.0
    for i in range(n):
        while True:  # thinning: candidates at the peak rate, kept at rate(t) / peak
            t += rng.expovariate(r_hi)
            rate = r_lo + (r_hi - r_lo) * 0.5 * (1 - math.cos(2 * math.pi * (t / day - 2 / 24)))
            if rng.random() * r_hi < rate:
                break
        share0 = 0.05 + 0.45 * 0.5 * (1 - math.cos(2 * math.pi * i / n))
        cls = 0 if rng.random() < share0 else 1
        d = ids.take(rng.randint(6, 40)) if rng.random() < 0.15 else sets[cls][picks[cls]()]
        out.append((prompts[cls] + d + ids.take(rng.randint(1, 3)), cls, t))
        _note(notes, share0=share0)
    return out


def g_summarize_floods(seed: int = 59, n: int = 5000, notes: list[Note] | None = None) -> list[Request]:
    """Class 0 multi-turn chat: sessions (a 4-block system prompt, a 1-6 block first message) of 2-12 turns,
    each turn's prompt its whole context, each turn adding a 1-4 block exchange (at most 60 blocks), 60
    sessions at a time. Class 1 a light RAG stream (10% of those requests: 200 documents of 8-30 blocks, zipf
    0.9, a 1-2 block question) and 4 floods: bursts of one-off 80-330 block summarization prompts behind a
    1-block instruction, ~0.1 s apart, each burst's new blocks 30-90% of the pool at 20% of the trace's
    distinct blocks. ``n``: the requests besides the floods."""
    rng = random.Random(seed)
    ids = Ids()
    sysp, rag_p, instr = ids.take(4), ids.take(2), ids.take(1)
    rag = docs(ids, rng, 200, 8, 30)
    pick = zipf_sampler(rng, len(rag), 0.9)
    active: list[dict[str, Any]] = []
    base: list[tuple[list[int], int, Note]] = []  # the stream besides the floods
    sid = 0
    for _ in range(n):
        if rng.random() < 0.1:
            base.append((rag_p + rag[pick()] + ids.take(rng.randint(1, 2)), 1, {"kind": "rag"}))
            continue
        while len(active) < 60:
            active.append({"id": sid, "ctx": sysp + ids.take(rng.randint(1, 6)), "turns": rng.randint(2, 12)})
            sid += 1
        s = active[rng.randrange(len(active))]
        base.append((s["ctx"], 0, {"kind": "chat", "session": s["id"]}))
        s["turns"] -= 1
        grow = rng.randint(1, 4)
        if s["turns"] == 0 or len(s["ctx"]) + grow > 60:
            active.remove(s)
        else:
            s["ctx"] = s["ctx"] + ids.take(grow)
    # the floods: shares u of the 20% pool; F new blocks in all solves F = sum(u) x 0.2 x (D + F)
    n_bursts, pool_share = 4, 0.2
    shares = [rng.uniform(0.3, 0.9) for _ in range(n_bursts)]
    distinct = len({b for blocks, _, _ in base for b in blocks}) + len(instr)
    total = distinct / (1 - pool_share * sum(shares))
    at = sorted(rng.sample(range(n // 10, n), n_bursts))
    bursts: dict[int, list[list[int]]] = {}
    for u, pos in zip(shares, at, strict=True):
        left, prompts = round(u * pool_share * total), []
        while left > 0:
            size = min(rng.randint(80, 250), left)
            size = left if left - size < 80 else size
            prompts.append(instr + ids.take(size))
            left -= size
        bursts[pos] = prompts
    out: list[Request] = []
    t = 0.0
    for i, (blocks, cls, note) in enumerate(base):
        for j, p in enumerate(bursts.get(i, [])):
            t += rng.uniform(0.05, 0.15)
            out.append((p, 1, t))
            _note(notes, kind="flood", burst=at.index(i), prompt=j)
        t += rng.expovariate(2.0)
        out.append((blocks, cls, t))
        _note(notes, **note)
    return out


def g_agent_loop(seed: int = 61, n: int = 5000, notes: list[Note] | None = None) -> list[Request]:
    """Tool-using agents with context compaction: every task's prompt starts with a 12-block system prompt and
    tool schema shared by all, then a 4-block class toolset, a 2-8 block task; each step's prompt is the whole
    context, and each step adds the model's 1-block tool call and a 1-8 block tool result; past 60 blocks the
    context is compacted (the prefix, the task and a fresh 3-6 block summary; the history is never read
    again). Class 0 interactive agents (30% of the tasks, 5-15 steps), class 1 background agents (15-40
    steps); 40 tasks at a time, a step every ~0.5 s."""
    rng = random.Random(seed)
    ids = Ids()
    shared = ids.take(12)
    tools = (ids.take(4), ids.take(4))
    active: list[dict[str, Any]] = []
    out: list[Request] = []
    t, tid = 0.0, 0
    while len(out) < n:
        while len(active) < 40:
            cls = 0 if rng.random() < 0.3 else 1
            head = shared + tools[cls] + ids.take(rng.randint(2, 8))
            steps = rng.randint(5, 15) if cls == 0 else rng.randint(15, 40)
            active.append({"id": tid, "cls": cls, "head": head, "ctx": head, "steps": steps, "step": 0})
            tid += 1
        s = active[rng.randrange(len(active))]
        t += rng.expovariate(2.0)
        out.append((s["ctx"], s["cls"], t))
        _note(notes, task=s["id"], step=s["step"], head=len(s["head"]), compacted=s.get("compacted", False))
        s["step"] += 1
        s["compacted"] = False
        if s["step"] >= s["steps"]:
            active.remove(s)
            continue
        grown = s["ctx"] + ids.take(1) + ids.take(rng.randint(1, 8))
        if len(grown) > 60:
            grown = s["head"] + ids.take(rng.randint(3, 6))
            s["compacted"] = True
        s["ctx"] = grown
    return out


Generator = Callable[[], list[Request]]

TRACES: dict[str, tuple[Generator, str]] = {
    # (the order of the first run, session 36: the default run's order)
    "c0-scan": (
        g_c0_scan,
        "class 0 a scan (one-off docs, 8% re-reads of its last 20); class 1 re-uses a 150-doc zipf set",
    ),
    "swap": (
        g_swap,
        "class 0 re-uses set A, class 1 set B, swapped halfway; class 1 also sends 30% one-off docs",
    ),
    "c0-bursts": (
        g_c0_bursts,
        "class 0 in rare bursts (40 requests every ~600, 25 docs); heavy class 1 between (zipf 400 docs, 20% scans)",
    ),
    "shared-sys": (
        g_shared_sys,
        "a 24-block system prompt shared by both classes; class 0 flat over 1,500 docs, class 1 zipf over 60",
    ),
    "five-levels": (
        g_five_levels,
        "priorities 0..4, equal shares, reuse increasing with the priority number (class 0 the least)",
    ),
    "oneclass-stack": (
        g_one_class_shift,
        "one class: an LRU-stack-model stream plus hot-then-dead docs (hammered ~150 requests, then dead)",
    ),
    "oneclass-phases": (
        g_one_class_phases,
        "one class: a 120-doc zipf working set, 70% replaced every 600 requests, popularity re-drawn",
    ),
    **{
        f"five-levels-s{k}": (
            partial(g_five_levels_var, seed=k),
            f"five levels (equal shares, class 0 the least reuse), seed {k}",
        )
        for k in range(11, 15)
    },
    "five-levels-rev": (
        partial(g_five_levels_var, reverse=True),
        "five levels with reuse decreasing with the priority number (class 0 the most)",
    ),
    "five-levels-c0rare": (
        partial(g_five_levels_var, shares=(0.05, 0.2, 0.25, 0.25, 0.25)),
        "five levels, class 0 5% of the requests (the least reuse)",
    ),
    "five-levels-c0heavy": (
        partial(g_five_levels_var, shares=(0.4, 0.15, 0.15, 0.15, 0.15)),
        "five levels, class 0 40% of the requests (the least reuse)",
    ),
    **{
        f"c0-follows-lag{lag}": (
            partial(g_c0_follows, lag=float(lag)),
            f"class 0 reads once a doc class 1 read ~{lag} requests earlier (its only hits)",
        )
        for lag in (50, 200, 800)
    },
    **{
        f"oneclass-alt{p}": (
            partial(g_one_class_alt, period=p),
            f"one class alternating {p}-request phases: zipf hot set + scans, then hot-then-dead + LRU stack",
        )
        for p in (100, 300, 800)
    },
    "c0-scan-heavy": (
        g_c0_scan_heavy,
        "class 0 a heavy scan (60% of requests, 20-40 block one-offs); class 1 a 250-doc zipf set",
    ),
    **{
        f"c0-scan-heavy-s{k}": (partial(g_c0_scan_heavy, seed=k), f"c0-scan-heavy at seed {k}")
        for k in (21, 22)
    },
    **{
        f"c0-follows-lag200-s{k}": (
            partial(g_c0_follows, seed=k, lag=200.0),
            f"c0-follows-lag200 at seed {k}",
        )
        for k in (31, 32)
    },
    **{
        f"c0-follows-lag800-s{k}": (
            partial(g_c0_follows, seed=k, lag=800.0),
            f"c0-follows-lag800 at seed {k}",
        )
        for k in (31, 32)
    },
    **{
        f"oneclass-alt{p}-s{k}": (partial(g_one_class_alt, seed=k, period=p), f"oneclass-alt{p} at seed {k}")
        for p in (100, 800)
        for k in (41, 42)
    },
}
"""Trace name -> (generator, one-line description)."""

FRESH_SHAPES: dict[str, tuple[Callable[..., list[Request]], tuple[int, int], str]] = {
    "branching": (
        g_branching,
        (51, 52),
        "best-of-n: each turn sent as 2-8 branches (shared context + 1-3 own blocks), next turn continues one; "
        "class 0 25% of sessions",
    ),
    "lora-tenants": (
        g_lora_tenants,
        (53, 54),
        "a 300-doc corpus read under 4 LoRA tenants (own block ids per tenant), zipf per tenant; class 0 the "
        "premium tenant (20%)",
    ),
    "code-repo": (
        g_code_repo,
        (55, 56),
        "a 30-50 block repo prefix changed by commits at random depths; class 0 bursty completions, class 1 "
        "batch reviews of 1,500 files",
    ),
    "diurnal-mix": (
        g_diurnal_mix,
        (57, 58),
        "two classes with own working sets, class 0's share 5% -> 50% -> 5% over the trace; day-like arrival "
        "rate over two days",
    ),
    "summarize-floods": (
        g_summarize_floods,
        (59, 60),
        "class 0 multi-turn chat; class 1 light RAG and 4 bursts of one-off 80-330 block prompts, each 30-90% "
        "of the 20% pool",
    ),
    "agent-loop": (
        g_agent_loop,
        (61, 62),
        "tool-using agents: a shared 12-block tool prefix, contexts grown per step, compacted past 60 blocks; "
        "class 0 interactive",
    ),
}
"""Session 43's shapes: name -> (generator, its two seeds, one-line description)."""

FRESH: dict[str, tuple[Generator, str]] = {
    f"{shape}-s{k}": (partial(gen, seed=k), f"{what} (seed {k})")
    for shape, (gen, seeds, what) in FRESH_SHAPES.items()
    for k in seeds
}
"""The fresh set (``--set fresh``; session 43): trace name -> (generator, one-line description)."""

SETS: dict[str, dict[str, tuple[Generator, str]]] = {"adversarial": TRACES, "fresh": FRESH}
"""``--set`` -> its traces (``adversarial``, session 36's, is the default)."""


def generate(name: str) -> list[Request]:
    """The named trace's requests (block ids, priority, timestamp_s), from its own seeded ``random.Random``."""
    return (TRACES[name] if name in TRACES else FRESH[name])[0]()


def build(name: str, limit: int | None = None) -> list[ReplayRequest]:
    """The named trace as replay requests (``limit``: its first that many requests only)."""
    h = BlockIdHasher()
    reqs = generate(name)[:limit]
    return [
        ReplayRequest(tuple(h.block_keys(ids)), ts, len(ids) * BLOCK_TOKENS, prio) for ids, prio, ts in reqs
    ]


# --------------------------------------------------------------------------------------- one cell
@dataclass(frozen=True)
class Job:
    """One cell: a trace at one pool size."""

    trace: str
    index: int  # the trace's place in the run, for the output order
    fraction: float
    one_class: bool
    limit: int | None


_BUILT: dict[tuple[str, int | None], list[ReplayRequest]] = {}  # per process


def _requests(name: str, limit: int | None) -> list[ReplayRequest]:
    got = _BUILT.get((name, limit))
    if got is None:
        got = _BUILT[(name, limit)] = build(name, limit)
    return got


def _stats(res: ReplayResult) -> dict[str, float | None]:
    """A policy's end state, a number JSON cannot hold as None."""
    return {k: (v if math.isfinite(v) else None) for k, v in res.policy_stats.items()}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def run_cell(job: Job) -> dict[str, Any]:
    """The cell's figures (every policy's, the paired differences, the one-class run)."""
    reqs = _requests(job.trace, job.limit)
    distinct = len({h for r in reqs for h in r.hashes})
    cap = max(MIN_CAPACITY, round(job.fraction * distinct))
    cfg = PolicyConfig(block_size=BLOCK_TOKENS)
    runs = {
        p: replay(reqs, cap, p, cfg, block_tokens=BLOCK_TOKENS, record_hits=p in PAIRED) for p in POLICIES
    }
    prios = sorted({r.priority for r in reqs})
    u, lr = runs["unified"], runs["lru"]
    assert u.request_hits is not None and lr.request_hits is not None
    rec: dict[str, Any] = {
        "trace": job.trace,
        "index": job.index,
        "fraction": job.fraction,
        "requests": len(reqs),
        "distinct": distinct,
        "capacity": cap,
        "classes": prios,
        "overall": {p: r.hit_rate for p, r in runs.items()},
        "hit_blocks": {p: r.hit_blocks for p, r in runs.items()},
        "blocks": lr.blocks,
        "overall_vs_lru": _ratio(u.hit_rate, lr.hit_rate),
        "overall_diff_blocks": u.hit_blocks - lr.hit_blocks,
        "unified_stats": _stats(u),
        "paired_all": paired_difference(u.request_hits, lr.request_hits).to_json(),
        "floor_paired": grid.floor_paired(u.request_hits, lr.request_hits),
    }
    if len(prios) > 1:
        c0i = [i for i, r in enumerate(reqs) if r.priority == 0]
        rec["class0"] = {p: r.classes[0].hit_rate if 0 in r.classes else 0.0 for p, r in runs.items()}
        rec["class0_hit_blocks"] = {
            p: r.classes[0].hit_tokens // BLOCK_TOKENS if 0 in r.classes else 0 for p, r in runs.items()
        }
        rec["class0_vs_lru"] = _ratio(rec["class0"]["unified"], rec["class0"]["lru"])
        rec["class0_paired"] = paired_difference(
            [u.request_hits[i] for i in c0i], [lr.request_hits[i] for i in c0i]
        ).to_json()
        rec["per_class"] = {p: {c: round(r.classes[c].hit_rate, 5) for c in prios} for p, r in runs.items()}
        if job.one_class:
            one = [dataclasses.replace(r, priority=0, retention=None) for r in reqs]
            ou = replay(one, cap, "unified", cfg, block_tokens=BLOCK_TOKENS, record_hits=True)
            ol = replay(one, cap, "lru", cfg, block_tokens=BLOCK_TOKENS, record_hits=True)
            assert ou.request_hits is not None and ol.request_hits is not None
            rec["oneclass"] = {
                "unified": ou.hit_rate,
                "lru": ol.hit_rate,
                "vs_lru": _ratio(ou.hit_rate, ol.hit_rate),
                "diff_blocks": ou.hit_blocks - ol.hit_blocks,
                "paired": paired_difference(ou.request_hits, ol.request_hits).to_json(),
                "unified_stats": _stats(ou),
            }
    return rec


# ------------------------------------------------------------------------------------------ analysis
MISS_FLOOR = "a"  # overall < 0.98x lru
MISS_CLASS0 = "b"  # class 0 < lru's class 0
MISS_ONE = "c"  # one class: overall < lru


def resolved(p: dict[str, Any] | None) -> bool:
    """A paired difference (``to_json`` form) standing :data:`RESOLVED_Z` standard errors below 0 (from the
    hits and the standard error, not the rounded z)."""
    return p is not None and p["se_hits"] > 0 and p["diff_hits"] / p["se_hits"] <= -RESOLVED_Z


def one_class_of(c: dict[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    """A cell's one-class ratio to lru and its paired difference: the relabelled run's, or on a trace with one
    class the cell's own (None: a relabelled run skipped, ``--no-one-class``)."""
    if len(c["classes"]) <= 1:
        return c["overall_vs_lru"], c["paired_all"]
    one = c.get("oneclass")
    return (None, None) if one is None else (one["vs_lru"], one["paired"])


def analyse(c: dict[str, Any]) -> None:
    """Adds ``misses`` (claims missed: a, b, c) and ``resolved`` (the missed claims whose shortfall is
    resolved) to a cell."""
    misses, real = [], []
    if c["overall_vs_lru"] is not None and c["overall_vs_lru"] < REUSE_FLOOR:
        misses.append(MISS_FLOOR)
        if resolved(c["floor_paired"]):
            real.append(MISS_FLOOR)
    if c.get("class0_vs_lru") is not None and c["class0_vs_lru"] < 1.0:
        misses.append(MISS_CLASS0)
        if resolved(c["class0_paired"]):
            real.append(MISS_CLASS0)
    vs, paired = one_class_of(c)
    if vs is not None and vs < 1.0:
        misses.append(MISS_ONE)
        if resolved(paired):
            real.append(MISS_ONE)
    c["misses"] = misses
    c["resolved"] = real


def summarise(cells: list[dict[str, Any]]) -> dict[str, Any]:
    def mn(xs: list[float | None]) -> float | None:
        vals = [x for x in xs if x is not None]
        return grid.round_down(min(vals)) if vals else None

    return {
        "cells": len(cells),
        "min_overall_vs_lru": mn([c["overall_vs_lru"] for c in cells]),
        "cells_below_floor": sum(1 for c in cells if MISS_FLOOR in c["misses"]),
        "cells_class0_below_lru": sum(1 for c in cells if MISS_CLASS0 in c["misses"]),
        "cells_class0_below_lru_resolved": sum(1 for c in cells if MISS_CLASS0 in c["resolved"]),
        "one_class_min_vs_lru": mn([one_class_of(c)[0] for c in cells]),
        "one_class_below_lru": sum(1 for c in cells if MISS_ONE in c["misses"]),
    }


def _num(x: float | None, fmt: str = ".4f") -> str:
    return "-" if x is None else format(x, fmt)


def trace_table(cells: list[dict[str, Any]]) -> str:
    """One trace's rows, one per pool."""
    rows = []
    for c in cells:
        o, pa = c["overall"], c["paired_all"]
        row = {
            "pool": f"{c['capacity']} ({c['fraction']:g})",
            "lru": f"{o['lru']:.4f}",
            "unified": f"{o['unified']:.4f}",
            "u/lru": _num(c["overall_vs_lru"]),
            "diff blk": f"{c['overall_diff_blocks']:+d}",
            "z": f"{pa['z']:+.2f}",
        }
        if "class0" in c:
            c0, cp = c["class0"], c["class0_paired"]
            row.update(
                {
                    "c0 lru": f"{c0['lru']:.4f}",
                    "c0 uni": f"{c0['unified']:.4f}",
                    "c0 u/lru": _num(c["class0_vs_lru"]),
                    "c0 diff": f"{cp['diff_hits']:+d}",
                    "c0 differ": f"{cp['differ']}/{cp['requests']}",
                    "c0 z": f"{cp['z']:+.2f}",
                }
            )
        else:
            row.update(dict.fromkeys(("c0 lru", "c0 uni", "c0 u/lru", "c0 diff", "c0 differ", "c0 z"), "-"))
        row["1cls u/lru"] = _num(one_class_of(c)[0])
        row["s3fifo"] = f"{o['s3fifo']:.4f}"
        row["arc"] = f"{o['arc']:.4f}"
        row["level"] = _num(c["unified_stats"].get("protection_level"), "+.3f")
        row["misses"] = (
            " ".join(f"{m}:{'resolved' if m in c['resolved'] else 'noise'}" for m in c["misses"]) or "-"
        )
        rows.append(row)
    return grid.format_table(rows)


def _phrase(p: dict[str, Any], ref: str) -> str:
    verdict = "resolved" if resolved(p) else "inside the noise"
    differ = f", {p['differ']:,} of {p['requests']:,} requests differ" if "differ" in p else ""
    return f"{p['diff_hits']:+,} hit blocks against {ref}, z {p['z']:+.2f}{differ}: {verdict}"


def listing(cells: list[dict[str, Any]]) -> list[str]:
    """Every missed claim, cell by cell, with whether it is resolved."""
    out = []
    claims = (
        (MISS_FLOOR, f"(a) overall >= {REUSE_FLOOR:g}x lru's"),
        (MISS_CLASS0, "(b) class 0 >= lru's class 0"),
        (MISS_ONE, "(c) one class: overall >= lru's"),
    )
    for key, what in claims:
        bad = [c for c in cells if key in c["misses"]]
        real = sum(1 for c in bad if key in c["resolved"])
        out.append(
            f"{what}: missed on {len(bad)} of {len(cells)} cells, {real} resolved (z <= -{RESOLVED_Z}), "
            f"{len(bad) - real} inside the noise"
        )
        for c in bad:
            where = f"  {c['trace']} {c['capacity']} ({c['fraction']:g}):"
            if key == MISS_FLOOR:
                out.append(
                    f"{where} unified {c['overall']['unified']:.4f} vs lru {c['overall']['lru']:.4f} "
                    f"({c['overall_vs_lru']:.4f}x); {_phrase(c['floor_paired'], f'{REUSE_FLOOR:g}x lru')}"
                )
            elif key == MISS_CLASS0:
                c0 = c["class0"]
                out.append(
                    f"{where} class 0 unified {c0['unified']:.4f} vs lru {c0['lru']:.4f} "
                    f"({c['class0_vs_lru']:.4f}x); {_phrase(c['class0_paired'], 'lru')}"
                )
            else:
                vs, paired = one_class_of(c)
                assert vs is not None and paired is not None
                src = "relabelled" if len(c["classes"]) > 1 else "native"
                out.append(f"{where} one class ({src}) {vs:.4f}x lru; {_phrase(paired, 'lru')}")
    return out


# ---------------------------------------------------------------------------------------------- main
def build_parser() -> Parser:
    """The command line (``--help`` shows every option's default)."""
    ap = Parser(prog=PROG, description=summary_of(__doc__), formatter_class=DefaultsHelpFormatter)
    ap.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help="traces to run (default: all; --list names them)",
    )
    ap.add_argument(
        "--fractions",
        type=number(0.0, 1.0, lo_open=True, what=" (a share of the trace's distinct blocks)"),
        nargs="+",
        default=list(FRACTIONS),
        help="pool sizes as shares of each trace's distinct blocks, in (0, 1] (at least 64 blocks)",
    )
    ap.add_argument("--jobs", type=integer(1), default=1, help="worker processes over the cells, >= 1")
    ap.add_argument(
        "--no-one-class",
        action="store_true",
        help="skip the one-class relabelling of traces with several classes (a one-class trace's own run "
        "still counts for claim (c))",
    )
    ap.add_argument(
        "--limit",
        type=integer(1),
        default=None,
        metavar="N",
        help="keep only the first N requests of each trace (quick checks; default: all)",
    )
    grid.add_json_option(ap, "every cell and the summary to FILE")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (shown only on a terminal)")
    ap.add_argument(
        "--list", action="store_true", help="print the trace names with their descriptions and exit"
    )
    ap.add_argument(
        "--set",
        choices=list(SETS),
        default="adversarial",
        help="the traces: session 36's adversarial set, or session 43's realistic shapes fixed before their "
        "first run (fresh)",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    catalogue = SETS[args.set]
    try:
        unknown = [n for n in args.names if n not in catalogue]
        if unknown:
            see = f"{PROG} --list" if args.set == "adversarial" else f"{PROG} --set {args.set} --list"
            raise ValueError(f"unknown trace {unknown[0]!r} (see {see})")
        if args.list:  # (the names given, or all)
            shown = {n: catalogue[n] for n in args.names} or catalogue
            width = max(map(len, shown))
            for name, (_, what) in shown.items():
                print(f"{name:<{width}}  {what}")
            return 0
        if args.json:
            check_output_file(args.json, "--json")  # before the cells run, not after
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    names = list(dict.fromkeys(args.names)) or list(catalogue)
    fractions = list(dict.fromkeys(args.fractions))
    jobs = [
        Job(name, i, f, not args.no_one_class, args.limit) for i, name in enumerate(names) for f in fractions
    ]
    n_proc = min(args.jobs, len(jobs))
    print(
        f"{PROG}: {len(names)} traces x {len(fractions)} pools = {len(jobs)} cells on {n_proc} processes"
        + (f" (first {args.limit} requests of each trace)" if args.limit else ""),
        flush=True,
    )
    t0 = time.perf_counter()
    results = grid.run_all(jobs, n_proc, not args.no_progress and sys.stderr.isatty(), fn=run_cell)
    wall = time.perf_counter() - t0
    order = {f: k for k, f in enumerate(fractions)}
    cells = sorted(results, key=lambda c: (c["index"], order[c["fraction"]]))
    for c in cells:
        del c["index"]
        analyse(c)
    traces: dict[str, dict[str, Any]] = {}
    for name in names:
        mine = [c for c in cells if c["trace"] == name]
        first = mine[0]
        traces[name] = {
            "description": catalogue[name][1],
            "requests": first["requests"],
            "lookups": first["blocks"],
            "distinct": first["distinct"],
            "classes": first["classes"],
        }
        print(
            f"\n== {name}: {catalogue[name][1]}\n   {first['requests']} requests, {first['blocks']} block lookups, "
            f"{first['distinct']} distinct blocks, classes {','.join(map(str, first['classes']))}"
        )
        print(trace_table(mine))
    print(f"\nclaims of unified against lru ({len(cells)} cells, {wall:.0f} s):")
    for line in listing(cells):
        print(line)
    summary = summarise(cells)
    if args.json:
        doc = {
            "config": {
                "fractions": fractions,
                "one_class": not args.no_one_class,
                "limit": args.limit,
                "policies": list(POLICIES),
                "block_tokens": BLOCK_TOKENS,
                **({} if args.set == "adversarial" else {"set": args.set}),
            },
            "traces": traces,
            "cells": cells,
            "wall_s": round(wall, 1),
            "summary": summary,
        }
        try:
            Path(args.json).write_text(json_text(doc, indent=1) + "\n", encoding="utf-8")
        except (ValueError, OSError) as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(script_main(main))
