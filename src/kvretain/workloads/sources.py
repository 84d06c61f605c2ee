"""The workload registry: every built-in workload behind one keyword signature.

``WORKLOADS.create(name, rng=..., path=..., limit=..., time_scale=..., **options)`` returns the requests
sorted by arrival. ``path`` is required by the trace loaders and ignored by generators; ``options`` are the
loader's own keywords (``block_size`` for Mooncake) or, for ``multi-tenant``, ``MultiTenantConfig`` fields.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from kvretain.registry import Registry
from kvretain.workloads.azure import load_azure
from kvretain.workloads.mooncake import load_mooncake
from kvretain.workloads.multi_tenant import MultiTenantConfig, generate_multi_tenant
from kvretain.workloads.request import WorkloadError, WorkloadRequest

Workload = list[WorkloadRequest]

WORKLOADS: Registry[Workload] = Registry("workload")


def _need(path: str | Path | None, name: str) -> str | Path:
    if path is None:
        raise WorkloadError(f"workload {name!r} needs a trace path")
    return path


@WORKLOADS.register("multi-tenant")
def multi_tenant(
    rng: random.Random,
    path: str | Path | None = None,
    limit: int | None = None,
    time_scale: float = 1.0,
    **options: Any,
) -> Workload:
    """Chat (priority 0), agents with retention directives (1) and batch document jobs (2) on one replica."""
    try:
        config = MultiTenantConfig(**options)
    except TypeError as e:
        raise WorkloadError(f"multi-tenant: {e}") from None
    return generate_multi_tenant(config, rng, limit=limit, time_scale=time_scale)


@WORKLOADS.register("mooncake")
def mooncake(
    rng: random.Random,
    path: str | Path | None = None,
    limit: int | None = None,
    time_scale: float = 1.0,
    block_size: int = 512,
) -> Workload:
    """Replay a Mooncake JSONL trace (prefix sharing through hash ids)."""
    return load_mooncake(_need(path, "mooncake"), block_size=block_size, limit=limit, time_scale=time_scale)


@WORKLOADS.register("azure")
def azure(
    rng: random.Random,
    path: str | Path | None = None,
    limit: int | None = None,
    time_scale: float = 1.0,
) -> Workload:
    """Replay an Azure 2023 CSV trace (arrivals and lengths; unique synthetic prompts)."""
    return load_azure(_need(path, "azure"), rng, limit=limit, time_scale=time_scale)
