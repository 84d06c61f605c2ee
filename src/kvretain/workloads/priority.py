"""Priority tagging rules for traces that carry no priority labels: the one registry of both
``kvretain replay`` and ``kvretain simulate`` (``--priority-rule``).

A rule maps a request to its priority (lower = more important). ``PRIORITY_RULES`` maps a name to a factory
returning the rule; build one with :func:`make_rule` (or ``PRIORITY_RULES.create(name, **options)``) and
apply it with :func:`tag_priorities`. A rule reads only a request's scalar fields (``request_id``,
``arrival_s``, ``prompt_len``, ``output_len``, ``priority``, ``session_id``, ``cache_salt``,
``block_ids``): the replay applies it to trace records
(:class:`~kvretain.workloads.mooncake.TraceRecord`), which have those fields and no tokens. A factory that
takes an ``rng`` argument gets the caller's seeded ``random.Random``.
"""

from __future__ import annotations

import dataclasses
import inspect
import random
import zlib
from collections.abc import Callable, Iterable
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


def make_rule(name: str, rng: random.Random | None = None, **options: Any) -> PriorityRule | None:
    """The rule registered as ``name`` (``None`` for ``keep``); ``rng`` goes to factories that take one."""
    if name == KEEP:
        return None
    factory = PRIORITY_RULES.get(name)
    if "rng" in inspect.signature(factory).parameters:
        options["rng"] = rng if rng is not None else random.Random(0)
    return factory(**options)


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
        key = ids[1] if len(ids) > 1 else ids[0]
        return important if key % 4 == 0 else other

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
    """Important for a stable ``fraction`` of sessions: CRC-32 of ``session_id`` (else ``request_id``)."""
    _check_fraction(fraction)

    def rule(r: WorkloadRequest) -> int:
        key = r.session_id if r.session_id is not None else r.request_id
        return important if zlib.crc32(key.encode()) < fraction * 2**32 else other

    return rule


@PRIORITY_RULES.register("none")
def no_rule(priority: int = 0) -> PriorityRule:
    """Every request gets the same priority (default 0): no priority classes."""
    return lambda r: priority


def _check_fraction(fraction: float) -> None:
    if not 0 <= fraction <= 1:
        raise WorkloadError(f"fraction must be in [0, 1], got {fraction}")
