"""kvretain as a vLLM 0.33 general plugin: priority-aware retention of vLLM's prefix cache.

Installed from a clone with ``pip install -e '.[vllm]'``; vLLM finds :func:`register` through the entry point
``vllm.general_plugins: kvretain``. The plugin is inert unless ``KVRETAIN_POLICY`` names a policy (see
:mod:`kvretain.integrations.vllm.config` for every variable)::

    KVRETAIN_POLICY=unified KVRETAIN_POLICY_OPTIONS="budget=0.8,isolation_goal=0.9" \\
        vllm serve MODEL --enable-prefix-caching --scheduling-policy priority

When enabled, the cached free blocks of vLLM's prefix cache are evicted in the policy's order (vLLM's block
ids are the policy's ids); each block carries the retention priority that its releasing request asks for:
the request ``priority`` through a :class:`~kvretain.core.retention.PriorityMapping`, or RFC #37003
``retention_directives`` / ``retention_scope`` in ``SamplingParams.extra_args``, durations measured with the
plugin clock (:func:`set_clock`). Invalid directives fail that request (``VLLMValidationError``), never
the engine. :func:`stats` gives per-priority hit and eviction counters.

Nothing here imports vLLM until the plugin is enabled.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from kvretain.integrations.vllm._runtime import COUNTERS, set_clock
from kvretain.integrations.vllm.config import (
    DIRECTIVES_KEY,
    ENV_GRANULARITY,
    ENV_MAPPING,
    ENV_OPTIONS,
    ENV_POLICY,
    SCOPE_KEY,
    PluginConfig,
    PluginConfigError,
    config_from_env,
    retention_from_extra_args,
    validation_message,
)

__all__ = [
    "DIRECTIVES_KEY",
    "ENV_GRANULARITY",
    "ENV_MAPPING",
    "ENV_OPTIONS",
    "ENV_POLICY",
    "SCOPE_KEY",
    "PluginConfig",
    "PluginConfigError",
    "config_from_env",
    "disable",
    "enable",
    "is_enabled",
    "register",
    "reset_stats",
    "retention_from_extra_args",
    "set_clock",
    "stats",
    "validation_message",
]

logger = logging.getLogger("kvretain.integrations.vllm")


def register() -> None:
    """vLLM general-plugin entry point. Idempotent; never raises; inert unless ``KVRETAIN_POLICY`` is set.

    vLLM calls it in every process (API server, engine core, workers); the patches matter in the engine core.
    """
    try:
        cfg = config_from_env()
    except Exception as exc:
        logger.error("kvretain vLLM plugin disabled: %s", exc)
        return
    if cfg is None:
        return
    try:
        enable(cfg)
    except Exception:
        logger.exception("kvretain vLLM plugin disabled: could not install it into this vLLM")
        with contextlib.suppress(Exception):
            disable()


def enable(config: PluginConfig | None = None) -> None:
    """Install the plugin with ``config`` (default: the ``unified`` policy) for KV cache pools built from now
    on. Raises when vLLM is missing or incompatible (:func:`register` catches and logs)."""
    from kvretain.integrations.vllm import _patches

    _patches.install(config or PluginConfig())
    _install_prometheus()


def disable() -> None:
    """Restore vLLM's own methods. Pools built while enabled keep their retention queue."""
    import sys

    mod = sys.modules.get("kvretain.integrations.vllm._patches")
    if mod is not None:
        mod.uninstall()


def is_enabled() -> bool:
    import sys

    mod = sys.modules.get("kvretain.integrations.vllm._patches")
    return mod is not None and mod.active() is not None


def stats() -> dict[str, Any]:
    """Per request-priority counters of this process (lower priority value = more important)::

    {"enabled": bool, "policy": name | None, "by_priority": {prio: {requests, query_tokens, hit_tokens,
     preempted_requests, preempted_hit_tokens, released_blocks, evicted_blocks}}}
    """
    import sys

    mod = sys.modules.get("kvretain.integrations.vllm._patches")
    cfg = mod.active() if mod is not None else None
    return {
        "enabled": cfg is not None,
        "policy": cfg.policy if cfg is not None else None,
        "by_priority": COUNTERS.snapshot(),
    }


def reset_stats() -> None:
    COUNTERS.reset()


_prometheus_installed = False


def _install_prometheus() -> None:
    """Expose the counters as ``kvretain_vllm_*{priority=...}`` on prometheus_client's default registry
    (when importable). vLLM serves /metrics from the API server process; with a separate engine-core
    process these appear only in that process's registry (use :func:`stats` there)."""
    global _prometheus_installed
    if _prometheus_installed:
        return
    try:
        from prometheus_client.core import REGISTRY, CounterMetricFamily
    except Exception:
        return

    class _Collector:
        def collect(self) -> Any:
            snap = COUNTERS.snapshot()
            for key, doc in (
                ("query_tokens", "prompt tokens looked up in the prefix cache"),
                ("hit_tokens", "prompt tokens served from the prefix cache"),
                ("evicted_blocks", "cached blocks evicted (by the priority of their last user)"),
            ):
                fam = CounterMetricFamily(f"kvretain_vllm_{key}", doc, labels=["priority"])
                for prio, c in snap.items():
                    fam.add_metric([str(prio)], float(c[key]))
                yield fam

    try:
        REGISTRY.register(_Collector())
        _prometheus_installed = True
    except Exception:
        logger.debug("kvretain: prometheus collector not registered", exc_info=True)
