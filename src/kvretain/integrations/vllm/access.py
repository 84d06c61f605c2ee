"""Access limits on priorities, retention and cache salts: who may ask for what (pure Python, no vLLM import).

vLLM's OpenAI server lets any client ask for the most important request priority, any retention directive and
any ``retention_scope`` (so a client can lower another session's retention by naming its scope), and lets
clients share cached prefixes (prompt-cache timing is a known side channel between tenants).
:class:`AccessPolicy` checks one request body against the limits of the API key that sent it;
:mod:`kvretain.integrations.vllm.middleware` applies it inside vLLM's API server.

Configuration: JSON in ``KVRETAIN_API_KEYS`` or in the file named by ``KVRETAIN_API_KEYS_FILE``::

    {"mode": "refuse",                # or "clamp": over-limit values are lowered to the limit
     "max_directives": 1024, "max_duration_s": 604800,
     "keys": [
       {"key": "sk-alice", "name": "alice", "min_request_priority": 0, "max_retention_priority": 90,
        "max_duration_s": 600, "scopes": ["alice", "alice-*"], "cache_salt": "tenant-alice"},
       {"key": "sk-batch", "name": "batch", "min_request_priority": 1, "max_retention_priority": 35,
        "max_duration_s": 0, "scopes": [], "mode": "clamp"}]}

Per key: ``min_request_priority`` is the most important request priority it may ask for (lower value = more
important; a request without one gets this value, or 0 when the key has none), ``max_retention_priority`` the
highest directive priority (and of the retention a request priority maps to: it also bounds the request priority,
and a request without one whose default 0 maps above it gets the most important priority that does not; under a
table mapping, which need not be monotonic, a priority that maps above the cap is refused, or in clamp mode moved to
the nearest priority that maps within it, the less important one on a tie),
``max_duration_s`` the longest directive duration (a directive without duration never lapses, so it is over any
finite limit), ``scopes`` the retention scopes it owns (exact names, or prefixes ending in ``*``; ``["*"]``:
any), ``cache_salt`` the salt all its requests use (its cache is then shared with no key but those bound to the
same salt: a tenant's keys, an old and a new one while it rotates them; no other key may send it). A field left
out or ``null`` is not limited, except ``scopes`` (none owned unless listed). Without keys every client may ask
for everything; the global ``max_directives`` (at most the engine's own 1024) / ``max_duration_s`` limits still
hold.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvretain.core.retention import (
    MAX_DIRECTIVES,
    PriorityMapping,
    RetentionConfig,
    RetentionDirective,
    RetentionError,
    show_value,
)
from kvretain.integrations.vllm.config import (
    DECODE_DURATION_KEY,
    DECODE_PRIORITY_KEY,
    DIRECTIVES_KEY,
    ENV_KEYS,
    ENV_KEYS_FILE,
    ENV_MAPPING,
    RETENTION_KEYS,
    SCOPE_KEY,
    check_directive_count,
    load_json,
    misspelt_env_names,
    retention_from_extra_args,
    shown_field,
    unknown_fields_message,
    unknown_retention_fields,
)

MODES = ("refuse", "clamp")
PRIORITY_HEADER = "x-vllm-priority"
"""vLLM reads a request priority from this header before the body's (the check folds it into the body)."""

DEFAULT_MAX_DIRECTIVES = MAX_DIRECTIVES
"""The engine's own limit (:data:`~kvretain.core.retention.MAX_DIRECTIVES`, why 1024 there); ``max_directives``
may set a lower one, not a higher one (the engine would refuse those requests)."""
DEFAULT_MAX_DURATION_S = 7 * 24 * 3600.0
"""NOTE: an explicit duration over a week is more often a unit mistake (milliseconds given as seconds) than a
wish; a directive without a duration never lapses (it is still evicted, last, under pressure)."""
INT64 = (-(2**63), 2**63 - 1)


class AccessConfigError(ValueError):
    """The key file or variable is malformed (raised at server start)."""


class AccessDenied(Exception):
    """A request the limits refuse: ``status`` (400 malformed, 401 no key, 403 over a limit, 413 too large)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


SALT_MAX_CHARS = 128
SALT_FORBIDDEN = frozenset("@/\\\x00")
"""vLLM 0.33's rule for a ``cache_salt`` (``validate_cache_salt`` in its request protocol): a key's bound salt is
checked against it when the limits are loaded, since the server writes it into every request of the key."""


@dataclass(frozen=True)
class ApiKey:
    """One client key and its limits (``None``: not limited)."""

    key: str
    name: str
    min_request_priority: int | None = None
    max_retention_priority: int | None = None
    max_duration_s: float | None = None
    scopes: tuple[str, ...] = ()
    cache_salt: str | None = None
    mode: str | None = None
    """``refuse`` or ``clamp`` for this key (``None``: the policy's mode)."""

    def owns(self, scope: str) -> bool:
        return any(
            s == "*" or s == scope or (s.endswith("*") and scope.startswith(s[:-1])) for s in self.scopes
        )


@dataclass
class Decision:
    """The request body to forward (maybe rewritten) and what was clamped or filled in."""

    body: dict[str, Any]
    changed: bool = False
    notes: list[str] = field(default_factory=list)
    priority: int = 0
    """The request priority the request runs at."""


def _opt_int(raw: Mapping[str, Any], name: str, where: str, lo: int, hi: int) -> int | None:
    v = raw.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise AccessConfigError(f"{where}: {name} must be an integer in [{lo}, {hi}] or null, got {v!r}")
    return v


def _opt_duration(raw: Mapping[str, Any], name: str, where: str) -> float | None:
    v = raw.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise AccessConfigError(
            f"{where}: {name} must be a non-negative number of seconds or null, got {v!r}"
        )
    return float(v)


def _mode(raw: Mapping[str, Any], where: str, default: str | None) -> str | None:
    v = raw.get("mode", default)
    if v is not None and v not in MODES:
        raise AccessConfigError(f"{where}: mode must be one of {', '.join(MODES)}, got {v!r}")
    return None if v is None else str(v)


_KEY_FIELDS = {
    "key",
    "name",
    "min_request_priority",
    "max_retention_priority",
    "max_duration_s",
    "scopes",
    "cache_salt",
    "mode",
}


def _int64_within(mapping: PriorityMapping, cap: int, floor: int | None) -> tuple[bool, int | None]:
    """Whether some int64 request priority (at ``floor`` or above) maps to a retention within ``cap``, and the
    most important one (``None``: the cap sets no floor), by :meth:`PriorityMapping.most_important_within`."""
    try:
        p = mapping.most_important_within(cap, floor)
    except RetentionError:
        return False, None
    return p is None or p <= INT64[1], p


def _parse_key(raw: Any, i: int, source: str = ENV_KEYS) -> ApiKey:
    where = f"{source}: keys[{i}]"
    if not isinstance(raw, Mapping):
        raise AccessConfigError(f"{where}: expected an object with at least 'key', got {raw!r}")
    unknown = sorted(set(raw) - _KEY_FIELDS)
    if unknown:
        raise AccessConfigError(
            f"{where}: unknown field(s) {unknown}; allowed: {', '.join(sorted(_KEY_FIELDS))}"
        )
    key = raw.get("key")
    if not isinstance(key, str) or len(key) < 8:
        raise AccessConfigError(f"{where}: 'key' must be a string of at least 8 characters")
    # a key a client can send: HTTP headers are latin-1 (the server decodes them so) and the token is read
    # without surrounding whitespace; any other key would be accepted here and never match
    if not key.isascii() or not key.isprintable() or key != key.strip() or " " in key:
        raise AccessConfigError(
            f"{where}: 'key' must be printable ASCII without spaces (an HTTP header carries it; any other key "
            "could never be sent)"
        )
    name = raw.get("name", f"key#{i}")
    if not isinstance(name, str) or not name:
        raise AccessConfigError(f"{where}: 'name' must be a non-empty string")
    scopes = raw.get("scopes")
    if scopes is None:
        scopes = []  # (left out or null: none owned)
    if not isinstance(scopes, list) or not all(isinstance(s, str) and s for s in scopes):
        raise AccessConfigError(f"{where}: 'scopes' must be a list of non-empty strings")
    for s in scopes:
        if "*" in s[:-1]:
            raise AccessConfigError(
                f"{where}: scope {s!r}: '*' may only end a prefix (an exact name, a prefix ending in '*', or '*')"
            )
    salt = raw.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise AccessConfigError(f"{where}: 'cache_salt' must be a non-empty string or null")
    if salt is not None and (len(salt) > SALT_MAX_CHARS or any(c in SALT_FORBIDDEN for c in salt)):
        raise AccessConfigError(
            f"{where}: 'cache_salt' must be at most {SALT_MAX_CHARS} characters without '@', '/', '\\' or NUL "
            "(vLLM refuses any other salt: every request of the key would fail)"
        )
    return ApiKey(
        key=key,
        name=name,
        min_request_priority=_opt_int(raw, "min_request_priority", where, *INT64),
        max_retention_priority=_opt_int(raw, "max_retention_priority", where, 0, 100),
        max_duration_s=_opt_duration(raw, "max_duration_s", where),
        scopes=tuple(scopes),
        cache_salt=salt,
        mode=_mode(raw, where, None),
    )


@dataclass(frozen=True)
class AccessPolicy:
    """The keys (empty: open to every client) and the limits that hold for every request."""

    keys: tuple[ApiKey, ...] = ()
    mode: str = "refuse"
    max_directives: int = DEFAULT_MAX_DIRECTIVES
    max_duration_s: float = DEFAULT_MAX_DURATION_S
    mapping: PriorityMapping = field(default_factory=PriorityMapping)
    """The plugin's request-priority -> retention mapping (``KVRETAIN_PRIORITY_MAPPING``): a key's
    ``max_retention_priority`` also caps the retention its request priority maps to."""
    configured: bool = False
    """Whether the limits come from a configuration (``KVRETAIN_API_KEYS`` / ``_FILE``), which may list no keys."""

    def __post_init__(self) -> None:
        for k in self.keys:  # a cap no request priority can meet would refuse every request of the key
            cap = k.max_retention_priority
            if cap is None:
                continue
            if not _int64_within(self.mapping, cap, k.min_request_priority)[0]:
                raise AccessConfigError(
                    f"key {k.name!r}: max_retention_priority {cap}: no request priority"
                    + ("" if k.min_request_priority is None else f" of {k.min_request_priority} or above")
                    + f" maps to a retention within it under {ENV_MAPPING} (every request would be refused)"
                )

    @property
    def is_open(self) -> bool:
        return not self.keys

    @classmethod
    def from_json(
        cls, raw: Any, where: str = ENV_KEYS, mapping: PriorityMapping | None = None
    ) -> AccessPolicy:
        if not isinstance(raw, Mapping):
            raise AccessConfigError(f"{where}: expected a JSON object with 'keys', got {type(raw).__name__}")
        unknown = sorted(set(raw) - {"keys", "mode", "max_directives", "max_duration_s"})
        if unknown:
            raise AccessConfigError(
                f"{where}: unknown field(s) {unknown}; allowed: keys, mode, max_directives, max_duration_s"
            )
        keys_raw = raw.get("keys", [])
        if not isinstance(keys_raw, list):
            raise AccessConfigError(f"{where}: 'keys' must be a list of key objects")
        keys = tuple(_parse_key(k, i, where) for i, k in enumerate(keys_raw))
        seen: set[str] = set()
        for k in keys:
            if k.key in seen:
                raise AccessConfigError(f"{where}: key {k.name!r} is listed twice")
            seen.add(k.key)
        max_dir = _opt_int(raw, "max_directives", where, 0, MAX_DIRECTIVES)
        max_dur = _opt_duration(raw, "max_duration_s", where)
        return cls(
            keys=keys,
            mode=_mode(raw, where, "refuse") or "refuse",
            max_directives=DEFAULT_MAX_DIRECTIVES if max_dir is None else max_dir,
            max_duration_s=DEFAULT_MAX_DURATION_S if max_dur is None else max_dur,
            mapping=mapping or PriorityMapping(),
            configured=True,
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AccessPolicy:
        """From ``KVRETAIN_API_KEYS_FILE`` (a path) or ``KVRETAIN_API_KEYS`` (JSON); open when neither is set."""
        env = os.environ if environ is None else environ
        try:
            mapping = PriorityMapping.parse(env.get(ENV_MAPPING, ""))
        except RetentionError as exc:
            raise AccessConfigError(f"{ENV_MAPPING}: {exc}") from None
        path = env.get(ENV_KEYS_FILE, "").strip()
        text = env.get(ENV_KEYS, "").strip()
        for name, value in ((ENV_KEYS_FILE, path), (ENV_KEYS, text)):
            if not value and env.get(name):  # (set to blanks: a key file meant, not "no keys")
                raise AccessConfigError(f"{name} holds only blanks; name the limits there, or unset it")
        if path and text:
            raise AccessConfigError(f"set {ENV_KEYS_FILE} or {ENV_KEYS}, not both")
        if not path and not text:
            # a misspelt key variable (API_KEY_FILE for API_KEYS_FILE) left the server open to every client, a warning
            # among vLLM's start-up lines its only trace: keys were meant, so the server does not start
            for name, meant in misspelt_env_names(env).items():
                if meant in (ENV_KEYS, ENV_KEYS_FILE):
                    raise AccessConfigError(
                        f"{show_value(name)} is not a kvretain setting (did you mean {meant}?); without "
                        f"{meant} the server would be open to every client: fix the name, or unset it"
                    )
        where = ENV_KEYS
        if path:
            where = f"{ENV_KEYS_FILE}={path}"
            try:
                text = Path(path).read_text(encoding="utf-8-sig")
            except OSError as exc:
                raise AccessConfigError(f"{where}: cannot read it ({exc.strerror})") from None
            except UnicodeDecodeError as exc:
                raise AccessConfigError(
                    f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})"
                ) from None
        if path and not text.strip():  # (a key file named and empty is a mistake, not "no limits")
            raise AccessConfigError(
                f"{where}: the file is empty; write the limits' JSON object there, or unset {ENV_KEYS_FILE}"
            )
        if not text:
            return cls(mapping=mapping)
        try:
            raw = load_json(text.encode(), unique_keys=True)
        except ValueError as exc:
            raise AccessConfigError(f"{where}: not valid JSON ({exc})") from None
        return cls.from_json(raw, where, mapping)

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The key of an ``Authorization: Bearer KEY`` header; ``None`` on an open server. Raises 401."""
        if self.is_open:
            return None
        if not authorization:
            raise AccessDenied(401, "missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AccessDenied(401, "malformed Authorization header: use 'Authorization: Bearer <key>'")
        for k in self.keys:
            if _same(k.key, token):
                return k
        raise AccessDenied(401, "invalid API key")

    # ------------------------------------------------------------------ the check
    def check(self, body: Any, key: ApiKey | None, header_priority: str | None = None) -> Decision:
        """Check (and in clamp mode rewrite) a completions / chat-completions request body.

        Raises :class:`AccessDenied`: 400 for malformed priority or retention fields, 403 for a limit.
        """
        if not isinstance(body, dict):
            raise AccessDenied(400, "the request body must be a JSON object")
        clamp = (key.mode if key is not None and key.mode is not None else self.mode) == "clamp"
        d = Decision(body=dict(body))
        d.priority = self._request_priority(d, key, header_priority, clamp)
        self._retention(d, key, clamp)
        self._salt(d, key, clamp)
        return d

    def _request_priority(self, d: Decision, key: ApiKey | None, header: str | None, clamp: bool) -> int:
        body = d.body
        prio: Any
        if header is not None:
            try:
                prio = int(header)
            except ValueError:
                pass  # (vLLM ignores a header that is not an integer and reads the body's priority: so does this)
            else:
                body["priority"] = prio  # one place for the priority: the header is dropped when forwarded
                d.changed = True
        prio = body.get("priority")
        if prio is not None and (isinstance(prio, bool) or not isinstance(prio, int)):
            raise AccessDenied(
                400,
                f"priority must be an integer (lower = more important), got {show_value(prio)}",
                "priority",
            )
        if prio is not None and not INT64[0] <= prio <= INT64[1]:
            raise AccessDenied(
                400, f"priority {show_value(prio)} is outside the 64-bit integer range", "priority"
            )
        floor = key.min_request_priority if key is not None else None
        cap = key.max_retention_priority if key is not None else None
        if key is not None and cap is not None:
            floor = self._retention_floor(key, cap, floor)
        if floor is None:
            out = 0 if prio is None else int(prio)
        elif prio is None:
            # the key's default: its min_request_priority (documented), else vLLM's 0, never more important
            # than the floor. NOTE: not the floor itself when only max_retention_priority sets it: a cap of 90
            # allows priority -5 (85), and filling that in ran all of the key's plain traffic ahead of others'
            out = max(
                floor, 0 if key is None or key.min_request_priority is None else key.min_request_priority
            )
        elif prio < floor:
            if not clamp:
                raise AccessDenied(
                    403,
                    f"key {key.name!r} may ask for request priority {floor} or higher values "  # type: ignore[union-attr]
                    f"(lower = more important); got {prio}",
                    "priority",
                )
            d.notes.append(f"priority {prio} -> {floor}")
            out = floor
        else:
            out = int(prio)
        if key is not None and cap is not None and self.mapping.retention_for(out) > cap:
            # NOTE: the floor bounds a monotonic mapping; a table need not be one (0:35, 1:80, 2:35): a priority at
            # or above the floor may still map above the cap
            mapped = self.mapping.retention_for(out)
            if prio is not None and out == prio and not clamp:
                raise AccessDenied(
                    403,
                    f"key {key.name!r} may ask for retention priority up to {cap}; request priority {prio} "
                    f"maps to {mapped}",
                    "priority",
                )
            nearest = self._nearest_within(key, cap, out, floor)
            if prio is not None:
                d.notes.append(f"priority {out} (retention {mapped}) -> {nearest}")
            out = nearest
        if out != (0 if prio is None else prio):  # (a request without one runs at vLLM's 0 as it is)
            body["priority"] = out
            d.changed = True
        return out

    def _nearest_within(self, key: ApiKey, cap: int, prio: int, floor: int | None) -> int:
        """The request priority nearest ``prio`` (the less important one on a tie, never below ``floor``) whose
        mapped retention is within ``cap``: where clamp mode puts a priority that maps above the cap."""
        try:
            p = self.mapping.nearest_within(cap, prio, floor)
        except RetentionError:
            p = INT64[1] + 1
        if not INT64[0] <= p <= INT64[1]:
            raise AccessDenied(
                403,
                f"key {key.name!r}: no request priority near {prio} maps to a retention within {cap}",
                "priority",
            )
        return p

    def _retention_floor(self, key: ApiKey, cap: int, floor: int | None) -> int | None:
        """The most important request priority whose mapped retention is within ``cap`` (and ``floor``);
        ``None`` when the cap sets no floor. Checked at start (:meth:`__post_init__`): some priority exists."""
        exists, p = _int64_within(self.mapping, cap, floor)
        if not exists:
            raise AccessDenied(403, f"key {key.name!r}: no request priority maps to a retention within {cap}")
        return p

    def _retention(self, d: Decision, key: ApiKey | None, clamp: bool) -> None:
        body = d.body
        xargs = body.get("vllm_xargs")
        top = {f: body[f] for f in RETENTION_KEYS if f in body}
        misspelt = unknown_retention_fields(body, prefix_only=True)
        if misspelt:  # (a top-level field vLLM would drop with a debug line: the client meant retention)
            raise AccessDenied(
                400, unknown_fields_message(misspelt, "the request body"), shown_field(misspelt[0])
            )
        if xargs is None and not top:
            return
        if xargs is not None and not isinstance(xargs, dict):
            return  # vLLM's own validation answers (400 "vllm_xargs: Input should be a valid dictionary")
        xargs = dict(xargs or {})
        for f, v in top.items():  # a convenience: retention fields at the top level of the body
            if f in xargs:
                raise AccessDenied(
                    400, f"{f} is given both at the top level and in vllm_xargs; give it once", f
                )
            del body[f]
            if v is not None:  # null: not given (vLLM's vllm_xargs takes no null: it refuses the request)
                xargs[f] = v
        unknown = unknown_retention_fields(xargs)
        if unknown:
            raise AccessDenied(400, unknown_fields_message(unknown), shown_field(unknown[0]))
        raw = xargs.get(DIRECTIVES_KEY)
        if isinstance(raw, str):
            with contextlib.suppress(ValueError):  # (the plugin's parser below names the JSON error)
                parsed = load_json(raw)
                # NOTE: only a list replaces the string: anything else goes to the parser below as sent, which
                # refuses it as the engine would (a JSON string holding a JSON string was parsed twice, the
                # second time past the count below: 500 directives through a limit of 4)
                if isinstance(parsed, list):
                    raw = parsed
        if isinstance(raw, list):  # counted once parsed: a list carries no more than a JSON string
            try:
                check_directive_count(len(raw), self.max_directives)
            except RetentionError as exc:
                raise AccessDenied(400, str(exc), DIRECTIVES_KEY) from None
        try:
            cfg = retention_from_extra_args({**xargs, DIRECTIVES_KEY: raw} if raw is not None else xargs)
        except RetentionError as exc:
            raise AccessDenied(400, f"invalid retention request: {exc}", _field_named(str(exc))) from None
        if cfg is None:
            return
        # directives as a list inside vllm_xargs: vLLM's vllm_xargs takes no list of objects, so they are
        # forwarded as the JSON string it takes (as top-level ones are)
        changed = bool(top) or (raw is not None and not isinstance(xargs.get(DIRECTIVES_KEY), str))
        if cfg.scope is not None and key is not None and not key.owns(cfg.scope):
            owned = ", ".join(key.scopes) if key.scopes else "none"
            raise AccessDenied(
                403,
                f"key {key.name!r} does not own retention_scope {show_value(cfg.scope)} (it owns: {owned})",
                SCOPE_KEY,
            )
        out: list[RetentionDirective] = []
        for i, dv in enumerate(cfg.directives):
            new = self._limit_directive(dv, f"{DIRECTIVES_KEY}[{i}]", key, clamp, d)
            changed |= new is not dv
            out.append(new)
        decode_priority, decode_duration_s = cfg.decode_priority, cfg.decode_duration_s
        if decode_priority is not None or decode_duration_s is not None:
            # generated tokens' blocks: the same limits as a directive's range. A duration without a priority
            # (the mapped priority, which the priority floor already caps) is still a duration: its limits hold
            dv = RetentionDirective(
                0, None, 0 if decode_priority is None else decode_priority, decode_duration_s
            )
            new = self._limit_directive(dv, DECODE_PRIORITY_KEY, key, clamp, d, DECODE_DURATION_KEY)
            if new is not dv:
                changed = True
                decode_duration_s = new.duration_s
                if decode_priority is not None:
                    decode_priority = xargs[DECODE_PRIORITY_KEY] = new.priority
                if decode_duration_s is not None:  # (vLLM's vllm_xargs takes no null)
                    xargs[DECODE_DURATION_KEY] = decode_duration_s
        if changed:
            if cfg.directives:
                xargs[DIRECTIVES_KEY] = json.dumps([_as_json(x) for x in out])
            if cfg.scope is not None:
                xargs[SCOPE_KEY] = cfg.scope
            body["vllm_xargs"] = xargs
            d.changed = True
        # the plugin re-parses in the engine; a clamped list is checked again there
        RetentionConfig(tuple(out), decode_priority, decode_duration_s, cfg.scope)

    def _limit_directive(
        self,
        dv: RetentionDirective,
        where: str,
        key: ApiKey | None,
        clamp: bool,
        d: Decision,
        dur_where: str | None = None,
    ) -> RetentionDirective:
        """``dv`` within the limits (clamped, or refused); ``where`` names its priority in messages and notes,
        ``dur_where`` its duration when that is a field of its own (``None``: ``where``'s ``duration``)."""
        dw = where if dur_where is None else dur_where
        note = f"{where}.duration" if dur_where is None else dur_where
        dur = dv.duration_s
        # (an infinite duration never gets here: retention_from_extra_args refuses it, for the engine too)
        if dur is not None and dur > self.max_duration_s:
            if not clamp:
                # no expiry is the way out, but for a key with a duration limit (over it, no duration is refused too)
                limited = key is not None and key.max_duration_s is not None
                field_name = "duration" if dur_where is None else dur_where
                omit = "" if limited else f" (omit {field_name} to retain without expiry)"
                raise AccessDenied(
                    400,
                    f"{dw}: duration {dur:g} s is over this server's limit of {self.max_duration_s:g} s{omit}",
                    dw,
                )
            d.notes.append(f"{note} {dur:g} -> {self.max_duration_s:g}")
            dv = replace(dv, duration_s=self.max_duration_s)
            dur = self.max_duration_s
        if key is None:
            return dv
        cap = key.max_retention_priority
        if cap is not None and dv.priority > cap:
            if not clamp:
                raise AccessDenied(
                    403,
                    f"{where}: key {key.name!r} may ask for retention priority up to {cap}; got {dv.priority}",
                    where,
                )
            d.notes.append(
                f"{where if dur_where is not None else where + '.priority'} {dv.priority} -> {cap}"
            )
            dv = replace(dv, priority=cap)
        longest = key.max_duration_s
        if longest is not None and (dur is None or dur > longest):
            if not clamp:
                got = "no duration (never lapses)" if dur is None else f"{dur:g} s"
                raise AccessDenied(
                    403, f"{dw}: key {key.name!r} may retain for at most {longest:g} s; got {got}", dw
                )
            was = "none (never lapses)" if dur is None else f"{dur:g}"  # (as the other notes: 60, not 60.0)
            d.notes.append(f"{note} {was} -> {longest:g}")
            dv = replace(dv, duration_s=longest)
        return dv

    def _salt(self, d: Decision, key: ApiKey | None, clamp: bool) -> None:
        if key is None:
            return
        given = d.body.get("cache_salt")
        if key.cache_salt is None:
            owner = next((k for k in self.keys if k.cache_salt is not None and k.cache_salt == given), None)
            if owner is not None:  # a salt bound to another key: using it would share (and probe) that cache
                if not clamp:
                    raise AccessDenied(
                        403, f"key {key.name!r} may not use a cache_salt bound to another key", "cache_salt"
                    )
                del d.body["cache_salt"]
                d.changed = True
                d.notes.append("cache_salt of another key removed")
            return
        if given is not None and given != key.cache_salt and not clamp:
            raise AccessDenied(
                403,
                f"key {key.name!r} is bound to its own cache_salt; omit cache_salt (the server sets it)",
                "cache_salt",
            )
        if given != key.cache_salt:
            d.body["cache_salt"] = key.cache_salt
            d.changed = True


def _field_named(message: str) -> str:
    """The retention field a parser error is about (its message names it first), for the error's ``param``."""
    at = {f: message.find(f) for f in RETENTION_KEYS if f in message}
    return min(at, key=at.__getitem__) if at else DIRECTIVES_KEY


def _as_json(dv: RetentionDirective) -> dict[str, Any]:
    return {"start": dv.start, "end": dv.end, "priority": dv.priority, "duration": dv.duration_s}


def _same(a: str, b: str) -> bool:
    import hmac

    return hmac.compare_digest(a.encode(), b.encode())
