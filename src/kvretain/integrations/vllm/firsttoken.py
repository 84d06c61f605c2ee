"""When a streamed response's first token arrives: the one rule, for every reader of an OpenAI-compatible stream.

Its readers: the client loop (:func:`~kvretain.integrations.vllm.launch.stream_chat` and ``stream_completion``:
the serve tests, ``bench/vllm_serve.py``, ``bench/sim_fidelity.py``), which gets each chunk parsed by the
``openai`` client, and the server's latency middleware
(:class:`~kvretain.integrations.vllm.metrics.ClassLatency`), which reads the raw server-sent events as they leave
and parses each event's JSON itself (:class:`SSEFirstToken`). Both call :func:`chunk_has_token`, which reads a
chunk as a JSON object (``dict``) or as the client's parsed object (attributes; an absent field and ``null`` are
alike).

The rule is vLLM 0.33's benchmark's (``vllm/benchmarks/lib/endpoint_request_func.py``:
``_choice_has_streamed_output`` for chats, any choice for completions), over every choice of the chunk (``n`` > 1:
the first token of any choice):

- a chat choice (it has a ``delta``) carries a token when the delta has ``content``, ``reasoning`` (a reasoning
  parser's first tokens), ``reasoning_content`` (its older name, which vLLM's own chat CLI still reads),
  ``tool_calls`` (a tool parser's; at least one call: vLLM leaves an empty list out) or ``function_call``, or
  ``content`` ``""`` without a role: a token that decodes to no text yet (a special token, part of a
  character). The opening chunk of each choice carries the role with ``""``, and no token;
- a completion choice (no ``delta``) carries one when it has a ``text``, ``""`` included (the same token
  without text; vLLM sends no choice without a token, its chunked-prefill case skipped);
- no choice (the usage chunk, an error), ``[DONE]`` and a line that is not JSON carry none.

NOTE: where it differs from vLLM's benchmark, on chunks vLLM 0.33 does not send (``tests/test_vllm_firsttoken.py``
checks the two agree on those it does): every choice, where the benchmark reads the first; ``reasoning_content``
counts, which the benchmark does not read; a role is a role that is set, where the benchmark asks for the key (the
client's objects read an absent role as ``None``; vLLM leaves it out of every chunk but the opening one,
``exclude_unset``); a completion choice needs its ``text``, where the benchmark takes any choice (vLLM's always
has one).

Nothing here imports vLLM or the ``openai`` client."""

from __future__ import annotations

import json
from typing import Any

_TOKEN_FIELDS = ("content", "reasoning", "reasoning_content", "tool_calls", "function_call")
"""A chat delta with any of these (non-empty) carries a token."""

_NO_FIELDS = (str, int, float, list, type(None))
"""JSON values that are not objects: no fields (``bool`` is an ``int``)."""


def _field(obj: Any, key: str) -> Any:
    """``obj[key]`` of a JSON object, the attribute of a client's parsed object; ``None`` when absent."""
    if isinstance(obj, dict):
        return obj.get(key)
    return None if isinstance(obj, _NO_FIELDS) else getattr(obj, key, None)


def choice_has_token(choice: Any) -> bool:
    """Whether one choice of a streamed chunk carries a generated token (the module's rule)."""
    delta = _field(choice, "delta")
    if delta is None:
        return isinstance(_field(choice, "text"), str)
    for key in _TOKEN_FIELDS:
        if _field(delta, key):
            return True
    return _field(delta, "content") == "" and _field(delta, "role") is None


def chunk_has_token(chunk: Any) -> bool:
    """Whether a streamed chat or completion chunk (a parsed JSON object, or the ``openai`` client's chunk)
    carries a generated token in any of its choices."""
    choices = _field(chunk, "choices")
    return isinstance(choices, list) and any(choice_has_token(c) for c in choices)


def event_has_token(data: bytes | str) -> bool:
    """Whether one server-sent event's data (a chunk's JSON; ``[DONE]``, or anything else that is not JSON:
    none) carries a token."""
    try:
        chunk = json.loads(data)
    except (ValueError, RecursionError):  # (not JSON, not UTF-8, nested past the parser: no token read)
        return False
    return chunk_has_token(chunk)


class SSEFirstToken:
    """Reads a response's server-sent events as its body goes out, piece by piece: :meth:`feed` says whether a
    piece completed an event whose chunk carries a token (:func:`event_has_token`).

    An event ends at a blank line (``\\n`` or ``\\r\\n`` line ends), its ``data:`` lines joined by newlines, as
    the SSE standard reads them; an event split over pieces is read when its end arrives, and one the stream
    ends inside is not (as the standard discards it). Comments and other fields are skipped. vLLM sends each
    chunk as one piece, ``data: {...}\\n\\n``. Once it has said ``True`` it has done its work: the rest of
    that piece is not read."""

    __slots__ = ("_data", "_rest")

    def __init__(self) -> None:
        # the pieces of the line not ended yet, and the data lines of the event not ended yet: kept as lists,
        # joined once their line or event ends (a line or an event sent in many small pieces costs its length,
        # where joining each piece to what came before cost its length squared)
        self._rest: list[bytes] = []
        self._data: list[bytes] | None = None

    def feed(self, body: bytes) -> bool:
        if b"\n" not in body:
            if body:
                self._rest.append(body)
            return False
        if self._rest:
            self._rest.append(body)
            body = b"".join(self._rest)
        lines = body.split(b"\n")
        rest = lines.pop()
        self._rest = [rest] if rest else []
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                data, self._data = self._data, None
                if data is not None and event_has_token(b"\n".join(data)):
                    return True
            elif line.startswith(b"data:"):
                value = line[6:] if line.startswith(b"data: ") else line[5:]
                if self._data is None:
                    self._data = [value]
                else:
                    self._data.append(value)
        return False
