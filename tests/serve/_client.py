"""Request helpers of the serve tests (the official `openai` client)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class Reply:
    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def chat(
    client: Any,
    model: str,
    messages: list[dict[str, str]],
    *,
    priority: int | None = None,
    directives: list[dict[str, Any]] | None = None,
    scope: str | None = None,
    salt: str | None = None,
    max_tokens: int = 4,
    headers: dict[str, str] | None = None,
    xargs: dict[str, Any] | None = None,
) -> Reply:
    extra: dict[str, Any] = {}
    if priority is not None:
        extra["priority"] = priority
    xargs = dict(xargs or {})
    if directives is not None:
        xargs["retention_directives"] = json.dumps(directives)
    if scope is not None:
        xargs["retention_scope"] = scope
    if xargs:
        extra["vllm_xargs"] = xargs
    if salt is not None:
        extra["cache_salt"] = salt
    r = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        extra_body=extra,
        extra_headers=headers,
    )
    details = r.usage.prompt_tokens_details
    return Reply(
        text=r.choices[0].message.content or "",
        prompt_tokens=r.usage.prompt_tokens,
        cached_tokens=int(details.cached_tokens or 0) if details is not None else 0,
        completion_tokens=r.usage.completion_tokens,
    )


def user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def flood(
    client: Any, model: str, text: Any, tag: str, n: int = 16, words: int = 130, priority: int = 1
) -> float:
    """``n`` distinct priority-``priority`` prompts of ~``words`` tokens (5 blocks each), 3 at a time; returns the
    seconds taken.

    NOTE: 3 at a time hold 15 of the 31 blocks, leaving room for a protected 5-6 block conversation: a flood
    whose running requests need every block evicts protected blocks too (in use beats cached).
    """
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(3) as ex:
        list(
            ex.map(
                lambda i: chat(client, model, user(text(f"{tag}-{i}", words)), priority=priority), range(n)
            )
        )
    return time.monotonic() - t0


def metric_samples(srv: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the server's ``/metrics``: (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(srv.metrics_text()):
        for sample in fam.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric_value(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> Any:
    """The sample ``name`` with exactly ``labels``; ``None`` when there is none."""
    return samples.get((name, tuple(sorted(labels.items()))))


def metric_first(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> Any:
    """The first sample ``name`` whose labels include ``labels`` (whatever its other labels: engine, model);
    ``None`` when there is none."""
    want = labels.items()
    for (n, labs), value in samples.items():
        if n == name and want <= dict(labs).items():
            return value
    return None
