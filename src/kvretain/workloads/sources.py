"""The workload registry: every built-in workload behind one keyword signature.

``WORKLOADS.create(name, rng=..., path=..., limit=..., time_scale=..., **options)`` returns the requests
sorted by arrival. ``path`` is required by the trace loaders (:data:`TRACE_WORKLOADS`) and refused by the
generators; ``options`` are the loader's own keywords (``block_size`` for Mooncake) or, for a generator, its
config's fields (``MultiTenantConfig``, ``AgentPausesConfig``, ``RetrievalScanConfig``).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from kvretain.registry import Registry
from kvretain.workloads.agent_pauses import AgentPausesConfig, generate_agent_pauses
from kvretain.workloads.azure import load_azure
from kvretain.workloads.mooncake import load_mooncake
from kvretain.workloads.multi_tenant import MultiTenantConfig, generate_multi_tenant
from kvretain.workloads.request import WorkloadError, WorkloadRequest
from kvretain.workloads.retrieval_scan import RetrievalScanConfig, generate_retrieval_scan

Workload = list[WorkloadRequest]

WORKLOADS: Registry[Workload] = Registry("workload")


TRACE_WORKLOADS = ("mooncake", "azure")
"""The workloads that read a trace file (``path``); the others are generated and take none."""


def _need(path: str | Path | None, name: str) -> str | Path:
    if path is None:
        raise WorkloadError(f"workload {name!r} needs a trace path")
    return path


def _no_path(path: str | Path | None, name: str) -> None:
    # NOTE: a trace passed with a generated workload is a mistake, not something to drop silently (the user
    # would read a generated workload's figures as the trace's)
    if path is not None:
        raise WorkloadError(
            f"workload {name!r} is generated and reads no trace file (got {str(path)!r}): drop the trace, or "
            f"choose a workload that reads one ({', '.join(TRACE_WORKLOADS)})"
        )


@WORKLOADS.register("multi-tenant")
def multi_tenant(
    rng: random.Random,
    path: str | Path | None = None,
    limit: int | None = None,
    time_scale: float = 1.0,
    **options: Any,
) -> Workload:
    """Chat (priority 0), agents with retention directives (1) and batch document jobs (2) on one replica."""
    _no_path(path, "multi-tenant")
    config = _config(MultiTenantConfig, "multi-tenant", options)
    return generate_multi_tenant(config, rng, limit=limit, time_scale=time_scale)


def _config(cls: Any, name: str, options: dict[str, Any]) -> Any:
    try:
        return cls(**options)
    except TypeError as e:
        raise WorkloadError(f"{name}: {e}") from None


def _loader_options(name: str, options: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """A trace loader's ``options`` over its ``defaults`` (an unknown one is a ``WorkloadError`` naming it)."""
    unknown = [k for k in options if k not in defaults]
    if unknown:
        known = ", ".join(defaults) or "none"
        raise WorkloadError(f"{name}: unknown option {unknown[0]!r} (its options: {known})")
    return {**defaults, **options}


@WORKLOADS.register("agent-pauses")
def agent_pauses(
    rng: random.Random,
    path: str | Path | None = None,
    limit: int | None = None,
    time_scale: float = 1.0,
    **options: Any,
) -> Workload:
    """Agent sessions with long tool-call pauses between steps over a growing context (no directives)."""
    _no_path(path, "agent-pauses")
    config = _config(AgentPausesConfig, "agent-pauses", options)
    return generate_agent_pauses(config, rng, limit=limit, time_scale=time_scale)


@WORKLOADS.register("retrieval-scan")
def retrieval_scan(
    rng: random.Random,
    path: str | Path | None = None,
    limit: int | None = None,
    time_scale: float = 1.0,
    **options: Any,
) -> Workload:
    """Queries over a Zipf-popular document pool, scanned by a stream of one-off documents."""
    _no_path(path, "retrieval-scan")
    config = _config(RetrievalScanConfig, "retrieval-scan", options)
    return generate_retrieval_scan(config, rng, limit=limit, time_scale=time_scale)


@WORKLOADS.register("mooncake")
def mooncake(
    rng: random.Random,
    path: str | Path | None = None,
    limit: int | None = None,
    time_scale: float = 1.0,
    **options: Any,
) -> Workload:
    """Replay a Mooncake JSONL trace (prefix sharing through hash ids)."""
    block_size = _loader_options("mooncake", options, {"block_size": 512})["block_size"]
    return load_mooncake(_need(path, "mooncake"), block_size=block_size, limit=limit, time_scale=time_scale)


@WORKLOADS.register("azure")
def azure(
    rng: random.Random,
    path: str | Path | None = None,
    limit: int | None = None,
    time_scale: float = 1.0,
    **options: Any,
) -> Workload:
    """Replay an Azure 2023 CSV trace (arrivals and lengths; unique synthetic prompts)."""
    _loader_options("azure", options, {})
    return load_azure(_need(path, "azure"), rng, limit=limit, time_scale=time_scale)
