"""kvretain as a vLLM 0.33 general plugin: priority-aware retention of vLLM's prefix cache.

Installed from a clone with ``pip install -e '.[vllm]'``; vLLM finds :func:`register` through the entry point
``vllm.general_plugins: kvretain``. The plugin is inert unless ``KVRETAIN_POLICY`` names a policy (see
:mod:`kvretain.integrations.vllm.config` for every variable; ``KVRETAIN_STEP_LOG``, which only logs the engine's
steps, is :mod:`kvretain.integrations.vllm.steplog`'s)::

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
from typing import Any

from kvretain.integrations.vllm._runtime import COUNTERS, HOOK_ERRORS, logger, set_clock
from kvretain.integrations.vllm.config import (
    DECODE_DURATION_KEY,
    DECODE_PRIORITY_KEY,
    DIRECTIVES_KEY,
    ENV_ALLOW_VERSION,
    ENV_GRANULARITY,
    ENV_MAPPING,
    ENV_OPTIONS,
    ENV_POLICY,
    RETENTION_KEYS,
    SCOPE_KEY,
    SUPPORTED_VLLM,
    PluginConfig,
    PluginConfigError,
    check_vllm_version,
    config_from_env,
    retention_from_extra_args,
    unknown_env_names,
    validation_message,
)

__all__ = [
    "DECODE_DURATION_KEY",
    "DECODE_PRIORITY_KEY",
    "DIRECTIVES_KEY",
    "ENV_ALLOW_VERSION",
    "ENV_GRANULARITY",
    "ENV_MAPPING",
    "ENV_OPTIONS",
    "ENV_POLICY",
    "RETENTION_KEYS",
    "SCOPE_KEY",
    "SUPPORTED_VLLM",
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


def register() -> None:
    """vLLM general-plugin entry point. Idempotent; never raises; inert unless ``KVRETAIN_POLICY`` is set.

    vLLM calls it in every process (API server, engine core, workers); the patches matter in the engine core.
    What it installed, or why it refused, is logged through vLLM's own logger (see ``_runtime.LOGGER_NAME``).
    ``KVRETAIN_STEP_LOG=FILE`` also logs every engine step (:mod:`kvretain.integrations.vllm.steplog`), with
    or without a policy.
    """
    from kvretain.integrations.vllm import steplog

    steplog.install_from_env()
    for line in unknown_env_names():
        logger.warning("kvretain: %s", line)
    try:
        cfg = config_from_env()
    except Exception as exc:
        logger.error("kvretain vLLM plugin disabled: %s", exc)
        return
    if cfg is None:
        return
    try:
        enable(cfg)
    except PluginConfigError as exc:
        logger.error("kvretain vLLM plugin disabled: %s", exc)
        return
    except Exception:
        logger.exception("kvretain vLLM plugin disabled: could not install it into this vLLM")
        with contextlib.suppress(Exception):
            disable()
        return


def enable(config: PluginConfig | None = None) -> None:
    """Install the plugin with ``config`` (default: the ``unified`` policy) for KV cache pools built from now
    on. Raises :class:`PluginConfigError` for a vLLM version it does not support (see ``SUPPORTED_VLLM``;
    ``KVRETAIN_ALLOW_UNSUPPORTED_VLLM=1`` overrides), other exceptions when vLLM is missing or incompatible
    (:func:`register` catches and logs both)."""
    import vllm

    cfg = config or PluginConfig()
    version = str(getattr(vllm, "__version__", "unknown"))
    refused = check_vllm_version(version)
    if refused is not None:
        raise PluginConfigError(refused)
    from kvretain.integrations.vllm import _patches

    was = _patches.active()
    _patches.install(cfg)
    _install_prometheus()
    if was != cfg:
        supported = version.split("+", 1)[0] in SUPPORTED_VLLM
        log = logger.info if supported else logger.warning
        log(
            "kvretain vLLM plugin enabled in vLLM %s%s: %s eviction policy for prefix-cache pools built from now "
            "on (options %s, priority mapping %s)",
            version,
            "" if supported else f" (unsupported, allowed by {ENV_ALLOW_VERSION})",
            cfg.describe(),
            cfg.options or "default",
            cfg.mapping,
        )


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
     preempted_requests, preempted_query_tokens, preempted_hit_tokens, released_blocks, evicted_blocks}},
     "hook_errors": {hook: count}}

    The first ``_runtime.MAX_PRIORITY_CLASSES`` (64) priorities seen are counted apart, later ones together under
    the key ``"other"`` (a client picks its priority: it must not grow the counters without bound).

    Each ``by_priority`` entry is a :class:`kvretain.core.stats.ClassStats` (the core's counting rules) under
    the plugin's names (``_runtime.STATS_KEYS``). ``requests`` / ``query_tokens`` / ``hit_tokens`` count each
    request's first lookup (its admission); a resume after preemption looks the cache up again and is counted
    apart (``preempted_*``, the core's ``resume*``), as vLLM's own prefix-cache metrics do; an eviction is
    charged to the block's last releaser. ``hook_errors``: errors swallowed inside the plugin's hooks (see
    ``_patches``).
    """
    import sys

    mod = sys.modules.get("kvretain.integrations.vllm._patches")
    cfg = mod.active() if mod is not None else None
    return {
        "enabled": cfg is not None,
        "policy": cfg.policy if cfg is not None else None,
        "by_priority": COUNTERS.snapshot(),
        "hook_errors": HOOK_ERRORS.snapshot(),
    }


def reset_stats() -> None:
    COUNTERS.reset()
    HOOK_ERRORS.reset()


def _install_prometheus() -> None:
    """Per-priority series in vLLM's /metrics, engine core in-process or not (see
    :mod:`kvretain.integrations.vllm.metrics`)."""
    from kvretain.integrations.vllm import metrics

    metrics.install()
