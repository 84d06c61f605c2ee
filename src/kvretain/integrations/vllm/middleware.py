"""ASGI middleware for vLLM's own ``--middleware`` option: access limits inside vLLM's API server (no proxy).

    KVRETAIN_API_KEYS_FILE=keys.json python -m vllm.entrypoints.openai.api_server --model M ... \\
        --middleware kvretain.integrations.vllm.middleware.AccessLimits

The limits (:mod:`kvretain.integrations.vllm.access`) are loaded when vLLM imports this module, so a broken key
file (or, with no key variable set, a misspelt one) stops the server at start instead of opening it; a server
without keys logs at start that priorities and retention are open to every client. With keys, every path but ``/health``, ``/ping``, ``/version``, ``/load``
and ``/metrics`` needs ``Authorization: Bearer KEY``, websockets included (``/v1/realtime``: unlimited keys only,
refused with close code 1008); completions and chat completions are checked (and maybe rewritten), other POST
endpoints are open to unlimited keys only (they could carry a priority unchecked). As vLLM's own API-key check,
paths are read without a ``--root-path`` prefix and CORS preflights (``OPTIONS``) pass.
Refusals carry the CORS headers vLLM's server puts on its endpoints' own errors (:func:`cors_of`), so a browser
page of an origin the server allows (``--allowed-origins``) can read why it was refused.
The global limits (directives, durations, body size) hold on every POST but ``/tokenize`` / ``/detokenize``: vLLM
also generates at ``/invocations``, ``/v1/responses``, ``/v1/messages``, ``/inference/v1/generate`` and more, so a
JSON body's retention fields (``vllm_xargs`` and top-level ones, ``sampling_params.extra_args``) are checked
wherever they come (:func:`check_elsewhere`). Form bodies (the audio endpoints' uploads) pass as they are; the
engine still refuses more than 1024 directives there.
Errors are OpenAI-shaped JSON: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvretain.integrations.vllm.access import (
    PRIORITY_HEADER,
    AccessConfigError,
    AccessDenied,
    AccessPolicy,
    ApiKey,
    Decision,
)
from kvretain.integrations.vllm.config import ENV_KEYS, ENV_KEYS_FILE, RETENTION_KEYS, load_json, route_path

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# NOTE: a child of vLLM's "vllm" logger, which vLLM configures: these lines appear in the server's own log.
logger = logging.getLogger("vllm.kvretain.access")

CHECKED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
"""The endpoints whose bodies get every limit of the key (priority floor, retention caps, scopes, salt)."""
FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/load", "/metrics"})
HARMLESS_POSTS = frozenset({"/tokenize", "/detokenize"})
MAX_BODY_BYTES = 8 * 1024 * 1024
"""NOTE: a 2,048-directive list is ~100 KB and a 128k-token prompt as text ~600 KB; 8 MiB leaves room for
token-id prompts of that length while bounding what one request makes the API server buffer and parse."""
DRAIN_BYTES = MAX_BODY_BYTES
"""What a refusal reads of a body it does not use before answering (:meth:`BodyReader.drain`): a body up to twice
:data:`MAX_BODY_BYTES` gets its 413; a larger one is cut off, as a proxy's lingering close bounds what it reads."""
_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    413: "RequestTooLarge",
}


def _announce(policy: AccessPolicy) -> None:
    if policy.is_open:
        logger.warning(
            "kvretain access limits: no API keys (%s): request priorities, retention directives, "
            "retention scopes and cache salts are open to every client",
            f"{ENV_KEYS_FILE} / {ENV_KEYS} unset"
            if not policy.configured
            else "the configuration lists none",
        )
    else:
        logger.info(
            "kvretain access limits: %d API key(s) (%s), mode %s, at most %d directives and %g s per request",
            len(policy.keys),
            ", ".join(k.name for k in policy.keys),
            policy.mode,
            policy.max_directives,
            policy.max_duration_s,
        )


try:
    POLICY = AccessPolicy.from_env()
    """The limits of this process, from the environment at import (vLLM imports the module while building its
    app)."""
except AccessConfigError as _exc:  # the server does not start: one line naming the setting, not a traceback
    raise SystemExit(f"kvretain access limits: {_exc}") from None
_announce(POLICY)


def _unlimited(key: ApiKey | None) -> bool:
    return key is None or (
        key.min_request_priority is None
        and key.max_retention_priority is None
        and key.max_duration_s is None
        and key.cache_salt is None
        and "*" in key.scopes
    )


async def error_response(send: Send, status: int, message: str, param: str | None = None) -> None:
    body = json.dumps(
        {"error": {"message": message, "type": _TYPES.get(status, "Error"), "param": param, "code": status}}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def cors_of(app: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]] | None:
    """The CORS middleware of the Starlette ``app`` (``scope["app"]``) as it was added: its class, arguments and
    keyword arguments (vLLM's server adds Starlette's ``CORSMiddleware`` with ``--allowed-origins``,
    ``--allow-credentials``, ``--allowed-methods``, ``--allowed-headers``); ``None`` where it has none.

    NOTE: Starlette runs the last middleware added outermost, and vLLM's ``init_entrypoints_middleware`` adds
    ``CORSMiddleware`` first and the ``--middleware`` ones last, so this middleware runs outside CORS and its
    refusals never pass through it: they are sent through a ``CORSMiddleware`` of the same settings instead, and
    get exactly the headers vLLM's endpoints' errors get (a disallowed origin: none). vLLM's own ``--api-key``
    check (``AuthenticationMiddleware``, also outside CORS) sends its 401 without them, so a browser cannot read
    it; a refusal here is readable (a page can tell a wrong key from a network error)."""
    cors = sys.modules.get("starlette.middleware.cors")  # (loaded when the app has one: nothing to import)
    if cors is None:
        return None
    for m in getattr(app, "user_middleware", ()):
        cls = getattr(m, "cls", None)
        if isinstance(cls, type) and issubclass(cls, cors.CORSMiddleware):
            return cls, tuple(m.args), dict(m.kwargs)
    return None


async def refuse(scope: Scope, receive: Receive, send: Send, exc: AccessDenied) -> None:
    """The OpenAI-shaped error of ``exc``, with the app's CORS headers (:func:`cors_of`)."""

    async def refusal(scope: Scope, receive: Receive, send: Send) -> None:
        await error_response(send, exc.status, exc.message, exc.param)

    cors = cors_of(scope.get("app"))
    if cors is None:
        await refusal(scope, receive, send)
    else:
        cls, args, kwargs = cors
        await cls(refusal, *args, **kwargs)(scope, receive, send)


class BodyReader:
    """A request's ``receive``, remembering whether the client has sent its whole body (or gone): a refusal
    answered before the body was read drains the rest first (:meth:`drain`)."""

    __slots__ = ("done", "receive")

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.done = False

    async def __call__(self) -> Message:
        msg = await self.receive()
        if msg["type"] == "http.disconnect" or not msg.get("more_body", False):
            self.done = True
        return msg

    async def read(self, limit: int) -> bytes:
        """The whole body, or :class:`AccessDenied` (413) once it is over ``limit`` bytes."""
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await self()
            if msg["type"] == "http.disconnect":
                raise ConnectionError("client disconnected")
            part = msg.get("body", b"")
            size += len(part)
            if size > limit:
                raise AccessDenied(413, f"request body over {limit} bytes")
            chunks.append(part)
            if self.done:
                return b"".join(chunks)

    async def drain(self, limit: int) -> None:
        """Read and drop what is left of the body, up to ``limit`` bytes.

        NOTE: a refusal sent while the client is still sending (a body over the limit, a bad key) is followed by
        the server closing the connection; with the rest of the body unread in the socket, the kernel answers
        the close with a reset, which can destroy the refusal before the client reads it (a client saw
        "connection reset" instead of 413 for a 9 MiB body). Reading the rest first, as a lingering close does,
        lets the refusal arrive; past ``limit`` (:data:`DRAIN_BYTES`) the connection is cut as before."""
        left = limit
        while not self.done and left > 0:
            msg = await self()
            left -= len(msg.get("body", b""))


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return bytes(v).decode("latin-1")
    return None


def check_elsewhere(policy: AccessPolicy, body: Any, key: ApiKey | None) -> Decision | None:
    """The limits on a POST body outside :data:`CHECKED_PATHS` (an unlimited key, or a server without keys):
    the retention fields it carries, where vLLM's endpoints read them (``vllm_xargs`` and the top-level fields of
    completions-like bodies: ``/invocations``, ``/v1/responses``, ``/v1/messages``; ``sampling_params.extra_args``
    of ``/inference/v1/generate``), and its ``cache_salt`` (a salt bound to another key is reserved on every
    endpoint that reads one, as on completions: sharing it would let this key probe that key's cache), get the
    same check as on completions; ``None``: nothing to check."""
    if not isinstance(body, dict):
        return None
    out: Decision | None = None
    if "vllm_xargs" in body or "cache_salt" in body or any(f in body for f in RETENTION_KEYS):
        out = policy.check(body, key)
    sp = (body if out is None else out.body).get("sampling_params")
    if isinstance(sp, dict) and isinstance(sp.get("extra_args"), dict):
        inner = policy.check({"vllm_xargs": sp["extra_args"]}, key)
        if inner.changed:
            if out is None:
                out = Decision(body=dict(body))
            out.body["sampling_params"] = {**sp, "extra_args": inner.body["vllm_xargs"]}
            out.changed = True
            out.notes.extend(inner.notes)
    return out


class AccessLimits:
    """The ASGI middleware (vLLM instantiates it as ``AccessLimits(app)``)."""

    def __init__(
        self, app: ASGIApp, policy: AccessPolicy | None = None, max_body_bytes: int = MAX_BODY_BYTES
    ):
        self.app = app
        self.policy = POLICY if policy is None else policy
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or (kind == "http" and scope.get("method") == "OPTIONS"):
            # (lifespan; a CORS preflight, which carries no credentials: as vLLM's own API-key check)
            await self.app(scope, receive, send)
            return
        # the route's path behind a path-prefix proxy (--root-path), as vLLM's own API-key check reads it
        path = route_path(scope)
        if kind == "websocket":
            await self._websocket(path, scope, receive, send)
            return
        checked = path in CHECKED_PATHS
        body_reader = BodyReader(receive)
        try:
            key = None if path in OPEN_PATHS else self.policy.authenticate(_header(scope, b"authorization"))
            if scope.get("method") != "POST" or path in HARMLESS_POSTS:
                await self.app(scope, receive, send)
                return
            if not checked:
                if not self.policy.is_open and not _unlimited(key):
                    raise AccessDenied(403, f"{path} is not open to limited API keys")
                ctype = (_header(scope, b"content-type") or "").split(";", 1)[0].strip().lower()
                if ctype in FORM_TYPES:
                    await self.app(scope, receive, send)
                    return
            raw = await body_reader.read(self.max_body_bytes)
            decision: Decision | None
            try:
                body = load_json(raw)
            except ValueError as exc:
                if checked:
                    raise AccessDenied(400, f"the request body is not valid JSON ({exc})") from None
                decision = None  # (vLLM answers it)
            else:
                if checked:
                    decision = self.policy.check(body, key, _header(scope, PRIORITY_HEADER.encode()))
                else:
                    decision = check_elsewhere(self.policy, body, key)
        except AccessDenied as exc:
            await body_reader.drain(DRAIN_BYTES)
            await refuse(scope, receive, send, exc)
            return
        except ConnectionError:
            return
        if decision is not None and decision.notes:
            logger.info(
                "kvretain access limits: %s clamped: %s", key.name if key else "-", "; ".join(decision.notes)
            )
        if decision is not None and decision.changed:
            raw = json.dumps(decision.body).encode()
        # the priority header was folded into the body (completions); elsewhere it goes on as it came
        dropped = (b"content-length", PRIORITY_HEADER.encode()) if checked else (b"content-length",)
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in dropped]
        headers.append((b"content-length", str(len(raw)).encode()))
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await self.app({**scope, "headers": headers}, replay, send)

    async def _websocket(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        """A websocket (vLLM's ``/v1/realtime``) needs a key as any path but the open ones, and, carrying no
        body to check, an unlimited one (as the POST endpoints other than completions); refused before it is
        accepted (the server answers 403)."""
        try:
            if path not in OPEN_PATHS:
                key = self.policy.authenticate(_header(scope, b"authorization"))
                if not self.policy.is_open and not _unlimited(key):
                    raise AccessDenied(403, f"{path} is not open to limited API keys")
        except AccessDenied as exc:
            logger.info("kvretain access limits: websocket %s refused: %s", path, exc.message)
            await receive()  # (websocket.connect)
            await send({"type": "websocket.close", "code": 1008, "reason": exc.message[:120]})
            return
        await self.app(scope, receive, send)
