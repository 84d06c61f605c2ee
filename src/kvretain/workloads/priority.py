"""Priority tagging rules for traces that carry no priority labels: the one registry of both
``kvretain replay`` and ``kvretain simulate`` (``--priority-rule``).

A rule maps a request to its priority (lower = more important). ``PRIORITY_RULES`` maps a name to a factory
returning the rule; build one with :func:`make_rule` (``make_rule(name, requests, rng, **options)``: it hands
the workload and a seeded rng to the factories that take them; or ``PRIORITY_RULES.create(name, **options)``)
and apply it with :func:`tag_priorities`. A rule reads only a request's scalar fields (``request_id``,
``arrival_s``, ``prompt_len``, ``output_len``, ``priority``, ``session_id``, ``cache_salt``,
``block_ids``): the replay applies it to trace records
(:class:`~kvretain.workloads.mooncake.TraceRecord`), which have those fields and no tokens.

Session rules pick whole conversations. A request's conversation is ``session_key(r)``: its ``session_id``
when the workload names one, else, for a Mooncake trace, the reference rule's key (``hash_ids[1]``, the
conversation's first own block after the shared system prompt; ``hash_ids[0]`` for one-block requests).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from kvretain.registry import Registry
from kvretain.workloads.request import WorkloadError, WorkloadRequest

PriorityRule = Callable[[WorkloadRequest], int]

PRIORITY_RULES: Registry[PriorityRule] = Registry("priority rule")

KEEP = "keep"
"""The ``--priority-rule`` choice that keeps the trace's own ``priority`` field (default 0)."""

R = TypeVar("R")


def rule_choices() -> list[str]:
    """The ``--priority-rule`` choices: ``keep`` and every registered rule."""
    return [KEEP, *PRIORITY_RULES.names()]


def session_key(r: WorkloadRequest) -> str | int:
    """The conversation ``r`` belongs to (see the module docstring); ``request_id`` when nothing names one."""
    if r.session_id is not None:
        return r.session_id
    ids = r.block_ids
    if ids:
        return _trace_session_id(ids)
    return r.request_id


def _trace_session_id(ids: Sequence[int]) -> int:
    return ids[1] if len(ids) > 1 else ids[0]


def _takes(name: str) -> Mapping[str, inspect.Parameter]:
    """What the factory of the rule registered as ``name`` takes (nothing for ``keep``)."""
    return {} if name == KEEP else inspect.signature(PRIORITY_RULES.get(name)).parameters


def rule_draws(name: str) -> bool:
    """Whether the rule registered as ``name`` draws from a seeded ``rng`` (``random``, ``random-sessions``): the
    only use of ``--seed`` on a trace that draws nothing else."""
    return "rng" in _takes(name)


def check_seed_read(seed: int, rule: str) -> None:
    """A ``ValueError`` naming ``--seed`` when a trace run would not read a seed other than the default 0: a
    Mooncake trace draws nothing but its priority rule's draws (``replay``, ``simulate``, ``workload export``: as
    every option a run does not read is refused)."""
    if seed != 0 and not rule_draws(rule):
        raise ValueError(
            f"argument --seed: with a trace it seeds the priority rule's draws, and --priority-rule {rule} draws "
            "none (random and random-sessions do)"
        )


def make_rule(
    name: str,
    requests: Sequence[Any] | None = None,
    rng: random.Random | None = None,
    **options: Any,
) -> PriorityRule | None:
    """The rule registered as ``name`` (``None`` for ``keep``), handing ``requests`` (the whole workload:
    workload requests or trace records) and ``rng`` to factories that take them; a rule that needs the
    workload raises :class:`WorkloadError` without it."""
    if name == KEEP:
        return None
    params = _takes(name)
    if "requests" in params:
        if requests is None:
            raise WorkloadError(f"priority rule {name!r} needs the whole workload (requests)")
        options["requests"] = requests
    if "rng" in params:
        options["rng"] = rng if rng is not None else random.Random(0)
    return PRIORITY_RULES.create(name, **options)


def tag_priorities(requests: Iterable[R], rule: PriorityRule) -> list[R]:
    """Copies of ``requests`` (in order; workload requests or trace records), ``priority`` set by ``rule``."""
    return [dataclasses.replace(r, priority=rule(r)) for r in requests]  # type: ignore[type-var, arg-type]


@PRIORITY_RULES.register("reference")
def reference_rule(important: int = 0, other: int = 1) -> PriorityRule:
    """Mooncake reference rule: important when hash_ids[1] % 4 == 0 (hash_ids[0] for one-block requests).

    The rule of ``shared/traces/README.md``: keys on the conversation's first own block, so all turns of a
    conversation share a class (about a quarter of conversations are important). Needs ``block_ids``.
    """

    def rule(r: WorkloadRequest) -> int:
        ids = r.block_ids
        if not ids:
            raise WorkloadError(f"request {r.request_id}: the reference priority rule needs block_ids")
        return important if _trace_session_id(ids) % 4 == 0 else other

    return rule


@PRIORITY_RULES.register("random")
def random_rule(
    rng: random.Random, fraction: float = 0.25, important: int = 0, other: int = 1
) -> PriorityRule:
    """Each request important with probability ``fraction``, drawn from the seeded ``rng`` in call order."""
    _check_fraction(fraction)
    return lambda r: important if rng.random() < fraction else other


@PRIORITY_RULES.register("by-session")
def by_session_rule(fraction: float = 0.25, important: int = 0, other: int = 1) -> PriorityRule:
    """Important for a stable ``fraction`` of conversations: the first 8 bytes of BLAKE2b of ``session_key`` (a
    trace's conversation without a ``session_id`` is named by its block ids, as every session rule names it),
    the same in every process.

    NOTE: a cryptographic hash, not CRC-32: session names are often sequential (``s0``, ``s1``, ...), and CRC-32,
    linear in its input, chose 6.95% of ``s0``..``s1999`` at a fraction of 10% and 44.6% at 50%."""
    _check_fraction(fraction)
    cut = fraction * 2**64

    def rule(r: WorkloadRequest) -> int:
        digest = hashlib.blake2b(str(session_key(r)).encode(), digest_size=8).digest()
        return important if int.from_bytes(digest, "big") < cut else other

    return rule


@PRIORITY_RULES.register("random-sessions")
def random_sessions_rule(
    rng: random.Random | None = None, fraction: float = 0.1, important: int = 0, other: int = 1
) -> PriorityRule:
    """Whole conversations (``session_key``) important with probability ``fraction``, one draw per session.

    Draws come from the seeded ``rng`` (default ``Random(0)``) in order of first appearance, so a workload
    in arrival order always gets the same sessions; every turn of a session shares its class.
    """
    _check_fraction(fraction)
    draw = rng or random.Random(0)
    chosen: dict[str | int, bool] = {}

    def rule(r: WorkloadRequest) -> int:
        key = session_key(r)
        pick = chosen.get(key)
        if pick is None:
            pick = chosen[key] = draw.random() < fraction
        return important if pick else other

    return rule


@PRIORITY_RULES.register("longest")
def longest_rule(
    requests: Sequence[WorkloadRequest], fraction: float = 0.25, important: int = 0, other: int = 1
) -> PriorityRule:
    """The longest conversations are the important ones: the top ``fraction`` of sessions (``session_key``),
    ranked by number of turns, then total prompt tokens.

    ``round(fraction * sessions)`` sessions are chosen, Python's ``round``: a half goes to the even count (0.25 of
    10 sessions picks 2, of 6 picks 2, of 2 picks none); ties at the cut are broken by first appearance.
    """
    _check_fraction(fraction)
    turns: Counter[str | int] = Counter()
    tokens: Counter[str | int] = Counter()
    for r in requests:
        key = session_key(r)
        turns[key] += 1
        tokens[key] += r.prompt_len
    ranked = sorted(turns, key=lambda k: (-turns[k], -tokens[k]))  # stable: first appearance breaks ties
    top = set(ranked[: round(fraction * len(ranked))])
    return lambda r: important if session_key(r) in top else other


@PRIORITY_RULES.register("none")
def no_rule(priority: int = 0) -> PriorityRule:
    """Every request gets the same priority (default 0): no priority classes."""
    return lambda r: priority


def _check_fraction(fraction: float) -> None:
    if not 0 <= fraction <= 1:
        raise WorkloadError(f"fraction must be in [0, 1], got {fraction}")
