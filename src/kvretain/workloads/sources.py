"""The workload registry: every built-in workload behind one keyword signature.

``WORKLOADS.create(name, rng=..., path=..., limit=..., time_scale=..., **options)`` returns the requests
sorted by arrival. ``path`` is required by the trace loaders (:data:`TRACE_WORKLOADS`) and refused by the
generators; ``options`` are the loader's own keywords (``block_size`` for Mooncake) or, for a generator, its
config's fields (``MultiTenantConfig``, ``AgentPausesConfig``, ``RetrievalScanConfig``,
``TemplateDriftConfig``).
"""

from __future__ import annotations

import dataclasses
import functools
import random
import struct
from pathlib import Path
from typing import Any

from kvretain.registry import Registry
from kvretain.workloads.agent_pauses import AgentPausesConfig, generate_agent_pauses
from kvretain.workloads.azure import load_azure
from kvretain.workloads.mooncake import load_mooncake
from kvretain.workloads.multi_tenant import MultiTenantConfig, generate_multi_tenant
from kvretain.workloads.request import WorkloadError, WorkloadRequest
from kvretain.workloads.retrieval_scan import RetrievalScanConfig, generate_retrieval_scan
from kvretain.workloads.template_drift import TemplateDriftConfig, generate_template_drift

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
    """A generator's config from ``options`` (an unknown one is a ``WorkloadError`` naming it), checked to fit
    in memory before anything is generated (:func:`check_size`)."""
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in options if k not in known]
    if unknown:
        raise WorkloadError(f"{name}: unknown option {unknown[0]!r} (its options: {', '.join(known)})")
    config = cls(**options)
    check_size(name, config)
    return config


SAMPLE_DURATION_S = 600.0
"""Seconds of a generator's default workload measured by :func:`bytes_per_item`."""
SAMPLE_DOCUMENTS = 10_000
"""Documents added to that sample to measure one's bytes (:func:`bytes_per_item`)."""


def check_size(name: str, config: Any) -> None:
    """Raise :class:`~kvretain.core.memory.PoolTooLargeError` (a ``ValueError``) when the workload ``config``
    asks for (its ``expected_size()``) would not fit in the memory available: the rule of
    :func:`kvretain.core.memory.check_fits`, with the bytes per request, prompt chunk and document measured on
    a sample (:func:`bytes_per_item`). Settings within ``UNMEASURED_MULTIPLE`` x the defaults' size are not
    measured (:data:`kvretain.core.memory.UNMEASURED_MULTIPLE`)."""
    size, default = config.expected_size(), type(config)().expected_size()
    pairs = (
        (size.requests, default.requests),
        (size.chunk_refs, default.chunk_refs),
        (size.spans, default.spans),
    )
    from kvretain.core.memory import UNMEASURED_MULTIPLE, check_fits
    from kvretain.core.memory import human_count as _count  # (1e308 asks for a count of 300 digits)

    if all(v <= UNMEASURED_MULTIPLE * max(d, 1.0) for v, d in pairs):
        return

    per_request, per_ref, per_span = bytes_per_item(name)
    need = size.requests * per_request + size.chunk_refs * per_ref + size.spans * per_span
    count = f"about {_count(size.requests)} requests ({_count(size.chunk_refs)} prompt chunks"
    count += f", {_count(size.spans)} documents)" if size.spans else ")"
    per = f"{per_request:,.0f} bytes per request, {per_ref:,.0f} per prompt chunk"
    per += f", {per_span:,.0f} per document" if size.spans else ""
    unit = (
        "requests: a shorter duration_s, lower rates, shorter sessions or fewer documents (a limit cuts them "
    )
    unit += "after they are generated)"
    check_fits(need, f"{name} config", count, per, unit)


@functools.cache
def bytes_per_item(name: str) -> tuple[float, float, float]:
    """Bytes a generated workload takes per request, per prompt chunk reference and per document (a span made
    up front that requests share), measured on :data:`SAMPLE_DURATION_S` of the generator's default workload
    (peak traced allocation): a reference is a pointer; a document what :data:`SAMPLE_DOCUMENTS` more add; a
    request the rest."""
    cls, spans_field, _ = _CONFIGS[name]
    per_ref = float(struct.calcsize("P"))
    sample: dict[str, Any] = {"duration_s": SAMPLE_DURATION_S}
    requests, refs, peak = _measure(name, sample)
    spans, per_span = 0, 0.0
    if spans_field is not None:
        spans = getattr(cls(), spans_field)
        more_requests, more_refs, more_peak = _measure(
            name, {**sample, spans_field: spans + SAMPLE_DOCUMENTS}
        )
        more = more_peak - (more_refs - refs) * per_ref - (more_requests - requests) * peak / max(1, requests)
        per_span = max(0.0, more - peak) / SAMPLE_DOCUMENTS
    per_request = max(0.0, peak - refs * per_ref - spans * per_span) / max(1, requests)
    return per_request, per_ref, per_span


def _measure(name: str, options: dict[str, Any]) -> tuple[int, int, int]:
    """Requests, prompt chunk references and peak traced bytes of workload ``name`` with ``options``."""
    from kvretain.core.memory import peak_bytes

    cls, _, generate = _CONFIGS[name]

    def sample() -> tuple[int, int]:
        got = generate(cls(**options), random.Random(0))  # not WORKLOADS.create: no size check
        return len(got), sum(len(r.prompt.chunks) for r in got)

    peak, (requests, refs) = peak_bytes(sample)
    return requests, refs, peak


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


@WORKLOADS.register("template-drift")
def template_drift(
    rng: random.Random,
    path: str | Path | None = None,
    limit: int | None = None,
    time_scale: float = 1.0,
    **options: Any,
) -> Workload:
    """API calls on Zipf-popular prompt templates whose popular set drifts (launches replace retirements)."""
    _no_path(path, "template-drift")
    config = _config(TemplateDriftConfig, "template-drift", options)
    return generate_template_drift(config, rng, limit=limit, time_scale=time_scale)


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


_CONFIGS: dict[str, tuple[Any, str | None, Any]] = {
    "multi-tenant": (MultiTenantConfig, "batch_documents", generate_multi_tenant),
    "agent-pauses": (AgentPausesConfig, None, generate_agent_pauses),
    "retrieval-scan": (RetrievalScanConfig, "documents", generate_retrieval_scan),
    # its documents are the templates, made as they enter, `active` at a time (and as many more each drift)
    "template-drift": (TemplateDriftConfig, "active", generate_template_drift),
}
"""The generators: config class, the field that counts their documents, generator (:func:`bytes_per_item`)."""
