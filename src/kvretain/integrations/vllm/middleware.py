"""ASGI middleware for vLLM's own ``--middleware`` option: access limits inside vLLM's API server (no proxy).

    KVRETAIN_API_KEYS_FILE=keys.json python -m vllm.entrypoints.openai.api_server --model M ... \\
        --middleware kvretain.integrations.vllm.middleware.AccessLimits

The limits (:mod:`kvretain.integrations.vllm.access`) are loaded when vLLM imports this module, so a broken key
file stops the server at start instead of opening it; a server without keys logs at start that priorities and
retention are open to every client. With keys, every path but ``/health``, ``/ping``, ``/version``, ``/load``
and ``/metrics`` needs ``Authorization: Bearer KEY``; completions and chat completions are checked (and maybe
rewritten), other POST endpoints are open to unlimited keys only (they could carry a priority unchecked).
Errors are OpenAI-shaped JSON: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvretain.integrations.vllm.access import (
    ENV_KEYS,
    ENV_KEYS_FILE,
    PRIORITY_HEADER,
    AccessDenied,
    AccessPolicy,
    ApiKey,
)
from kvretain.integrations.vllm.config import load_json

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# NOTE: a child of vLLM's "vllm" logger, which vLLM configures: these lines appear in the server's own log.
logger = logging.getLogger("vllm.kvretain.access")

CHECKED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/load", "/metrics"})
HARMLESS_POSTS = frozenset({"/tokenize", "/detokenize"})
MAX_BODY_BYTES = 8 * 1024 * 1024
"""NOTE: a 2,048-directive list is ~100 KB and a 128k-token prompt as text ~600 KB; 8 MiB leaves room for
token-id prompts of that length while bounding what one request makes the API server buffer and parse."""
_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    413: "RequestTooLarge",
}


def _announce(policy: AccessPolicy) -> None:
    if policy.is_open:
        logger.warning(
            "kvretain access limits: no API keys (%s / %s unset): request priorities, retention directives, "
            "retention scopes and cache salts are open to every client",
            ENV_KEYS_FILE,
            ENV_KEYS,
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


POLICY = AccessPolicy.from_env()
"""The limits of this process, from the environment at import (vLLM imports the module while building its app)."""
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


async def read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ConnectionError("client disconnected")
        part = msg.get("body", b"")
        size += len(part)
        if size > limit:
            raise AccessDenied(413, f"request body over {limit} bytes")
        chunks.append(part)
        if not msg.get("more_body", False):
            return b"".join(chunks)


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return bytes(v).decode("latin-1")
    return None


class AccessLimits:
    """The ASGI middleware (vLLM instantiates it as ``AccessLimits(app)``)."""

    def __init__(
        self, app: ASGIApp, policy: AccessPolicy | None = None, max_body_bytes: int = MAX_BODY_BYTES
    ):
        self.app = app
        self.policy = POLICY if policy is None else policy
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        try:
            key = None if path in OPEN_PATHS else self.policy.authenticate(_header(scope, b"authorization"))
            if scope.get("method") != "POST":
                await self.app(scope, receive, send)
                return
            if path not in CHECKED_PATHS:
                if path not in HARMLESS_POSTS and not self.policy.is_open and not _unlimited(key):
                    raise AccessDenied(403, f"{path} is not open to limited API keys")
                await self.app(scope, receive, send)
                return
            raw = await read_body(receive, self.max_body_bytes)
            try:
                body = load_json(raw)
            except ValueError as exc:
                raise AccessDenied(400, f"the request body is not valid JSON ({exc})") from None
            decision = self.policy.check(body, key, _header(scope, PRIORITY_HEADER.encode()))
        except AccessDenied as exc:
            await error_response(send, exc.status, exc.message, exc.param)
            return
        except ConnectionError:
            return
        if decision.notes:
            logger.info(
                "kvretain access limits: %s clamped: %s", key.name if key else "-", "; ".join(decision.notes)
            )
        if decision.changed:
            raw = json.dumps(decision.body).encode()
        headers = [
            (k, v)
            for k, v in scope.get("headers", [])
            if k.lower() not in (b"content-length", PRIORITY_HEADER.encode())
        ]
        headers.append((b"content-length", str(len(raw)).encode()))
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await self.app({**scope, "headers": headers}, replay, send)
