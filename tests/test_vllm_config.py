"""The vLLM plugin's configuration and request parsing: pure Python, runs without vLLM installed."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvretain.core.policy import PolicyConfig
from kvretain.core.retention import MAX_DIRECTIVES, RetentionConfig, RetentionDirective, RetentionError
from kvretain.integrations.vllm.config import (
    PluginConfig,
    PluginConfigError,
    check_vllm_version,
    config_from_env,
    extra_args_for,
    parse_options,
    retention_from_extra_args,
    validation_message,
)


def test_off_unless_named() -> None:
    assert config_from_env({}) is None
    for off in ("", "off", "none", "0", "false"):
        assert config_from_env({"KVRETAIN_POLICY": off}) is None


def test_env_config() -> None:
    cfg = config_from_env(
        {
            "KVRETAIN_POLICY": "unified",
            "KVRETAIN_POLICY_OPTIONS": "budget=0.5, isolation_goal=none,protect_threshold=40",
            "KVRETAIN_PRIORITY_MAPPING": "0:80,1:20",
        }
    )
    assert cfg is not None and cfg.policy == "unified"
    pc = cfg.policy_config(16)
    assert (pc.budget, pc.isolation_goal, pc.protect_threshold, pc.block_size) == (0.5, None, 40, 16)
    assert cfg.mapping.retention_for(0) == 80 and cfg.mapping.retention_for(1) == 20


@pytest.mark.parametrize(
    ("env", "says"),
    [
        (
            {"KVRETAIN_POLICY": "belady"},
            r"^KVRETAIN_POLICY='belady': unknown policy; choose one of: unified, ",
        ),
        (
            {"KVRETAIN_POLICY": "unified", "KVRETAIN_POLICY_OPTIONS": "budget=2"},
            r"^KVRETAIN_POLICY_OPTIONS: budget must be a finite number in \[0, 1\] .*, got 2\.0$",
        ),
        (
            {"KVRETAIN_POLICY": "unified", "KVRETAIN_POLICY_OPTIONS": "bogus=1"},
            r"^KVRETAIN_POLICY_OPTIONS: bad entry 'bogus=1'; use key=value with keys adapt_frequency, budget, ",
        ),
        (
            {"KVRETAIN_POLICY": "unified", "KVRETAIN_POLICY_OPTIONS": "budget=lots"},
            r"^KVRETAIN_POLICY_OPTIONS: budget='lots' is not a number$",
        ),
        (
            {"KVRETAIN_POLICY": "unified", "KVRETAIN_PRIORITY_MAPPING": "0:x"},
            r"^KVRETAIN_PRIORITY_MAPPING: priority mapping entry '0:x': expected 'request_priority:retention_",
        ),
    ],
    ids=[
        "unknown-policy",
        "budget-out-of-range",
        "unknown-option",
        "budget-not-a-number",
        "mapping-not-ints",
    ],
)
def test_bad_env_config(env: dict[str, str], says: str) -> None:
    # the error names the variable, the entry and what is wrong with it (the server's log is all a user sees)
    with pytest.raises(PluginConfigError, match=says):
        config_from_env(env)


def test_parse_options_empty() -> None:
    assert parse_options("") == {}
    assert PluginConfig().policy == "unified"


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("protect_threshold=35.7", "must be a whole number"),  # (was cut to 35)
        ("frequency_cap=64.9", "must be a whole number"),  # (was cut to 64)
        ("adapt_frequency=0.5", "use true or false"),  # (kept as 0.5, taken as true)
        ("budget=0.8,budget=0.5", "given twice"),  # (the last one won)
        ("isolation_goal=", "has no value"),  # (taken as none: a fixed share, silently)
        ("budget=none", "needs a value"),
        ("priority_weight=inf", "must be finite"),
        ("budget=nan", "must be finite"),
    ],
)
def test_policy_options_are_read_as_their_types_or_refused(spec: str, words: str) -> None:
    with pytest.raises(PluginConfigError, match=words):
        parse_options(spec)


def test_policy_options_of_each_type() -> None:
    got = parse_options("adapt_frequency=false, frequency_cap=8, isolation_goal=none, budget=0.5")
    assert got == {"adapt_frequency": False, "frequency_cap": 8, "isolation_goal": None, "budget": 0.5}
    assert type(got["frequency_cap"]) is int
    assert parse_options("adapt_frequency=ON")["adapt_frequency"] is True
    assert parse_options("adapt_frequency=0")["adapt_frequency"] is False


def test_retention_fields() -> None:
    assert retention_from_extra_args(None) is None
    assert retention_from_extra_args({"other": 1}) is None
    d = [{"start": 0, "end": 64, "priority": 90, "duration": 30}]
    for raw in (d, json.dumps(d)):
        cfg = retention_from_extra_args({"retention_directives": raw, "retention_scope": "s"})
        assert cfg is not None and cfg.scope == "s"
        assert cfg.directives[0].priority == 90 and cfg.directives[0].duration_s == 30
    with pytest.raises(RetentionError, match="JSON"):
        retention_from_extra_args({"retention_directives": "[{"})
    msg = validation_message({"retention_directives": [{"start": 0, "priority": 101}]})
    assert msg is not None and "retention_directives[0]" in msg
    assert validation_message({"retention_directives": d}) is None


@pytest.mark.parametrize("form", ["list", "json"])
def test_the_engine_refuses_more_directives_than_the_limit_in_either_form(form: str) -> None:
    """A list was parsed whatever its length (only the access middleware counted, and only a JSON string): the
    engine took 20,000 directives from an offline caller or a list in ``vllm_xargs``."""

    def xargs(n: int) -> dict[str, object]:
        dirs = [{"start": 2 * i, "end": 2 * i + 1, "priority": 50} for i in range(n)]
        return {"retention_directives": dirs if form == "list" else json.dumps(dirs)}

    ret = retention_from_extra_args(xargs(MAX_DIRECTIVES))
    assert ret is not None and len(ret.directives) == MAX_DIRECTIVES
    with pytest.raises(RetentionError, match=f"{MAX_DIRECTIVES + 1} directives; at most {MAX_DIRECTIVES}"):
        retention_from_extra_args(xargs(MAX_DIRECTIVES + 1))
    assert "at most 1024" in (validation_message(xargs(20_000)) or "")


def test_decode_retention_fields() -> None:
    cfg = retention_from_extra_args({"retention_decode_priority": 10, "retention_decode_duration": 5})
    assert cfg is not None and (cfg.decode_priority, cfg.decode_duration_s, cfg.directives) == (10, 5.0, ())
    # the blocks of generated tokens only take it (a 40-token prompt of 16-token blocks: the fourth block on;
    # the third holds the prompt's last 8 tokens)
    prios, durs = cfg.block_plan(5, 16, 40, 35)
    assert (prios, durs) == ([35, 35, 35, 10, 10], [None, None, None, 5.0, 5.0])
    # a duration without a decode priority asks the mapped priority for a while: no plan, nothing that lapses
    alone = retention_from_extra_args({"retention_decode_duration": 5})
    assert alone is not None and not alone.needs_plan and cfg.needs_plan
    assert alone.block_plan(5, 16, 40, 35) == ([35] * 5, [None] * 5)
    for extra, says in [
        ({"retention_decode_priority": "80"}, "retention_decode_priority: priority must be an integer"),
        ({"retention_decode_priority": 80.0}, "pass e.g. retention_decode_priority=80"),
        ({"retention_decode_priority": 101}, "retention_decode_priority: priority 101 is out of range"),
        ({"retention_decode_duration": -1}, "retention_decode_duration must be >= 0"),
        ({"retention_decode_duration": "5"}, "retention_decode_duration must be a number of seconds"),
    ]:
        msg = validation_message(extra)
        assert msg is not None and says in msg, msg


DEEP = "[" * 100_000  # a JSON string that Python's parser gives up on with a RecursionError


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (
            {"retention_directives": [{"start": 0, "priority": 10**5000}]},
            "priority <an integer of 16610 bits> is out of range; use an integer in [0, 100]",
        ),
        ({"retention_directives": [{"start": 0, "priority": 50, "duration": 10**5000}]}, "is too large"),
        ({"retention_directives": [{"start": -(10**5000), "priority": 50}]}, "start must be a non-negative"),
        ({"retention_directives": "[" * 100_000}, "retention_directives: not valid JSON (nested too deeply)"),
    ],
)
def test_a_value_python_cannot_print_or_parse_is_a_clear_request_error(
    extra: dict[str, object], says: str
) -> None:
    # an integer of 5000 digits (str() refuses it: sys.int_max_str_digits) or JSON nested 10^5 deep (the parser
    # raises RecursionError): the request gets the field's message, not that error (a traceback in vLLM)
    msg = validation_message(extra)
    assert msg is not None and msg.startswith("invalid retention request: retention_directives")
    assert says in msg


def test_register_without_vllm_is_inert_and_lazy() -> None:
    code = (
        "import os, sys; os.environ.pop('KVRETAIN_POLICY', None);"
        "import kvretain.integrations.vllm as p; p.register(); p.register();"
        "assert not p.is_enabled() and p.stats()['enabled'] is False;"
        "assert 'vllm' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_empty_retention_scope_fails_validation() -> None:
    # it was taken as an owner id shared by every request that sent one (any of them could lower what another set)
    msg = validation_message(
        {"retention_scope": "", "retention_directives": '[{"start": 0, "priority": 80}]'}
    )
    assert msg is not None and "retention_scope must be a non-empty string" in msg, msg


def test_a_misspelt_retention_field_fails_validation() -> None:
    # without the access middleware (README's plain `vllm serve`) a typo such as retention_scop was silently
    # ignored by the engine: the request ran with no retention and the client never knew; the middleware
    # already refused it (400 "unknown retention field"), the plugin's own validation now does too
    msg = validation_message({"retention_scop": "alice", "retention_directives": "[]"})
    assert msg is not None and "unknown retention field(s) ['retention_scop']" in msg, msg
    assert "retention_scope" in msg  # names the known fields
    assert validation_message({"other_plugin_key": 1, "retention_scope": "s"}) is None
    assert validation_message({"retention_decode_priority": 10}) is None
    # TensorRT-LLM's name for the decode priority (README names it) and a capital letter passed and were ignored
    msg = validation_message({"decode_retention_priority": 80})
    assert msg is not None and "did you mean 'retention_decode_priority'?" in msg, msg
    assert validation_message({"Retention_scope": "s"}) is not None
    # TensorRT-LLM's decode duration (milliseconds) passed and was ignored: generated tokens kept their decode
    # priority forever instead of for the duration asked
    msg = validation_message({"retention_decode_priority": 10, "decode_duration_ms": 5000})
    assert msg is not None and "did you mean 'retention_decode_duration'?" in msg, msg


def test_a_message_names_three_misspelt_fields_and_counts_the_rest() -> None:
    three = {f"retention_x{i}": 1 for i in range(3)}
    msg = validation_message(three)
    assert (
        msg is not None and "['retention_x0', 'retention_x1', 'retention_x2'] in" in msg and "more" not in msg
    )
    msg = validation_message({**three, "retention_x3": 1})
    assert msg is not None and "'retention_x2'] and 1 more in vllm_xargs" in msg, msg


def test_the_plugin_names_its_policy_with_the_granularity_only_for_unified() -> None:
    assert PluginConfig().describe() == "unified (run granularity)"
    assert PluginConfig(granularity="block").describe() == "unified (block granularity)"
    assert PluginConfig(policy="lfu").describe() == "lfu"


@pytest.mark.parametrize(
    "retention",
    [
        RetentionConfig((RetentionDirective(0, 64, 90, 30.0), RetentionDirective(64, None, 10)), scope="s1"),
        RetentionConfig(decode_priority=80, decode_duration_s=12.0),
        RetentionConfig(decode_duration_s=3.0),
        RetentionConfig((RetentionDirective(16, 32, 0),), decode_priority=100, scope="t"),
    ],
)
def test_a_retention_config_round_trips_through_vllm_xargs(retention: RetentionConfig) -> None:
    args = extra_args_for(retention)
    assert args is not None
    # what a client sends as JSON in vllm_xargs (strings and numbers: vLLM takes no list of objects there)
    assert json.loads(json.dumps(args)) == args
    assert all(isinstance(v, str | int | float) for v in args.values())
    assert retention_from_extra_args(args) == retention


def test_no_retention_asks_nothing() -> None:
    assert extra_args_for(None) is None
    assert extra_args_for(RetentionConfig()) is None


def test_extra_args_that_are_not_a_mapping_carry_no_retention() -> None:
    # (what vLLM does with them is vLLM's business: the plugin neither reads nor refuses them)
    for extra in (["retention_scope", "s"], "retention_scope=s", 7):
        assert retention_from_extra_args(extra) is None  # type: ignore[arg-type]
        assert validation_message(extra) is None  # type: ignore[arg-type]


def _fake_interpreter(tmp_path: Path, reported: str, first: str = "") -> tuple[Path, Path]:
    """A stand-in for the server's Python: runs ``first``, writes the shell words ``reported`` to the returned
    file (whole, by a rename), then waits to be stopped."""
    seen = tmp_path / "seen"
    fake = tmp_path / "python"
    fake.write_text(
        f"#!/bin/sh\n{first}echo {reported} > {seen}.part\nmv {seen}.part {seen}\nexec sleep 60\n"
    )
    fake.chmod(0o755)
    return fake, seen


def _started_and_seen(server: object, seen: Path) -> str:
    """Start ``server`` and return the folder its stand-in interpreter reported."""
    server.start()  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while not (seen.exists() and seen.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return seen.read_text().strip()


def test_a_server_gets_a_private_ipc_folder_that_stop_removes(tmp_path: Path) -> None:
    """vLLM leaves its ZeroMQ IPC sockets in ``VLLM_RPC_BASE_PATH`` (default: the system's temporary folder)
    when its processes are killed: 20 per CI run piled up in /tmp. The launcher gives each server a private
    folder and removes it on stop; a folder the caller names is used and left alone. A stand-in for the
    interpreter records the folder and leaves a file in it."""
    from kvretain.integrations.vllm.launch import VLLMServer

    # The file goes in first, and the report lands whole (rename), so a test that reads the report finds the
    # file: reporting first raced the stop in CI.
    fake, seen = _fake_interpreter(tmp_path, '"$VLLM_RPC_BASE_PATH"', 'touch "$VLLM_RPC_BASE_PATH/left"\n')
    server = VLLMServer("model", python=str(fake), log_path=tmp_path / "log")
    rpc = Path(_started_and_seen(server, seen))
    assert rpc == server.rpc_dir and rpc.is_dir() and rpc.parent == Path(tempfile.gettempdir())
    server.stop(grace_s=5)
    assert not rpc.exists() and server.rpc_dir is None and server.proc is None

    mine = tmp_path / "mine"
    mine.mkdir()
    seen.unlink()
    server = VLLMServer(
        "model", python=str(fake), env={"VLLM_RPC_BASE_PATH": str(mine)}, log_path=tmp_path / "l"
    )
    try:
        assert _started_and_seen(server, seen) == str(mine) and server.rpc_dir is None
    finally:
        server.stop(grace_s=5)
    assert (mine / "left").exists()


def test_servers_do_not_inherit_the_callers_metrics_folder(monkeypatch, tmp_path: Path) -> None:
    """A caller that enabled the plugin in-process (or exported the variable) has KVRETAIN_METRICS_DIR set: every
    server it started published into that one folder and each server's /metrics summed the others' counts. Only
    ``env`` passes one now; unset, each server's API server makes its own."""
    from kvretain.integrations.vllm.launch import VLLMServer

    monkeypatch.setenv("KVRETAIN_METRICS_DIR", str(tmp_path / "callers"))
    fake, seen = _fake_interpreter(tmp_path, '"[$KVRETAIN_METRICS_DIR]"')
    server = VLLMServer("model", python=str(fake), log_path=tmp_path / "log")
    try:
        assert _started_and_seen(server, seen) == "[]"
    finally:
        server.stop(grace_s=5)
    seen.unlink()
    mine = str(tmp_path / "mine")
    server = VLLMServer(
        "model", python=str(fake), env={"KVRETAIN_METRICS_DIR": mine}, log_path=tmp_path / "l"
    )
    try:
        assert _started_and_seen(server, seen) == f"[{mine}]"
    finally:
        server.stop(grace_s=5)


def test_a_server_that_cannot_start_leaves_no_ipc_folder_and_cannot_start_twice(
    monkeypatch, tmp_path: Path
) -> None:
    """A start that fails (no such interpreter) removes the folder it made; a second start of a running server
    is refused with a clear error instead of leaking the first process."""
    from kvretain.integrations.vllm.launch import ServerError, VLLMServer

    tmp = tmp_path / "t"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    server = VLLMServer("model", python=str(tmp_path / "no-such-python"), log_path=tmp_path / "log")
    with pytest.raises(FileNotFoundError):
        server.start()
    assert server.rpc_dir is None and not any(tmp.iterdir())

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexec sleep 60\n")
    fake.chmod(0o755)
    server = VLLMServer("model", python=str(fake), log_path=tmp_path / "log")
    server.start()
    try:
        with pytest.raises(ServerError, match="started already"):
            server.start()
    finally:
        server.stop(grace_s=5)
    assert server.rpc_dir is None


def test_a_temporary_folder_too_long_for_a_socket_path_falls_back_to_tmp(monkeypatch, tmp_path: Path) -> None:
    """vLLM names each socket with a uuid (37 characters with its slash) and a unix socket path has at most 107:
    under a long temporary folder (macOS's is ~48 characters) the private folder goes to /tmp."""
    from kvretain.integrations.vllm import launch

    deep = tmp_path / ("d" * 80)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    made = launch._private_ipc_dir()
    assert made is not None
    try:
        assert made.parent == Path("/tmp")
        assert len(str(made / "12345678-1234-1234-1234-123456789012")) <= launch.UNIX_SOCKET_PATH_MAX
    finally:
        made.rmdir()


def test_a_temporary_folder_is_used_up_to_the_socket_path_limit_and_only_if_it_exists(monkeypatch) -> None:
    from kvretain.integrations.vllm import launch

    room = (
        launch.UNIX_SOCKET_PATH_MAX - len("/kvr-12345678") - launch._IPC_NAME
    )  # the longest folder that fits
    top = Path(tempfile.mkdtemp(prefix="kvr-len-", dir="/tmp"))
    try:
        for length, fits in ((room, True), (room + 1, False)):
            base = top / ("d" * (length - len(str(top)) - 1))
            base.mkdir()
            assert len(str(base)) == length
            monkeypatch.setattr(tempfile, "tempdir", str(base))
            made = launch._private_ipc_dir()
            assert made is not None and made.parent == (base if fits else Path("/tmp"))
            made.rmdir()
        monkeypatch.setattr(tempfile, "tempdir", str(top / "gone"))  # (no such folder)
        made = launch._private_ipc_dir()
        assert made is not None and made.parent == Path("/tmp")
        made.rmdir()
    finally:
        shutil.rmtree(top)


def test_a_server_that_exits_during_start_up_is_named_with_its_log_tail(tmp_path: Path) -> None:
    from kvretain.integrations.vllm.launch import ServerError, VLLMServer

    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\nfor i in $(seq 1 50); do echo "log line $i"; done\nexit 1\n')
    fake.chmod(0o755)
    server = VLLMServer("model", python=str(fake), log_path=tmp_path / "log")
    server.start()
    try:
        assert server.port > 0 and server.base_url == f"http://127.0.0.1:{server.port}"  # a free port taken
        with pytest.raises(ServerError, match="exited during start-up") as e:
            server.wait_ready(timeout_s=20)
    finally:
        server.stop(grace_s=5)
    shown = str(e.value).splitlines()[1:]
    assert shown == [f"log line {i}" for i in range(11, 51)]  # the last 40 lines


def test_a_server_not_ready_in_time_is_stopped(tmp_path: Path) -> None:
    from kvretain.integrations.vllm.launch import ServerError, VLLMServer

    fake, seen = _fake_interpreter(tmp_path, "up")  # runs, never answers /health
    server = VLLMServer("model", python=str(fake), log_path=tmp_path / "log")
    _started_and_seen(server, seen)
    proc, rpc = server.proc, server.rpc_dir
    assert proc is not None and rpc is not None
    t0 = time.monotonic()
    try:
        with pytest.raises(ServerError, match="not ready after 1 s"):
            server.wait_ready(timeout_s=1)
        waited = time.monotonic() - t0
        stopped = (server.proc, proc.poll() is not None, rpc.exists())
    finally:
        server.stop(grace_s=5)
    assert waited < 15 and stopped == (None, True, False)  # stopped before the error was raised


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # (a killed child no one has reaped yet is gone too)


def _ends(pid: int, within_s: float = 5.0) -> bool:
    """Whether process ``pid`` is gone within ``within_s`` seconds (polled)."""
    deadline = time.monotonic() + within_s
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _running(pid)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_stop_kills_what_outlives_the_api_server_in_its_process_group(tmp_path: Path) -> None:
    # the engine core may outlive the API server by a moment: a child that ignores SIGTERM stands in for it
    from kvretain.integrations.vllm.launch import VLLMServer

    child = tmp_path / "child"
    fake, seen = _fake_interpreter(
        tmp_path, "up", f"sh -c 'trap \"\" TERM; echo $$ > {child}; exec sleep 60' &\n"
    )
    server = VLLMServer("model", python=str(fake), log_path=tmp_path / "log")
    _started_and_seen(server, seen)
    deadline = time.monotonic() + 10
    while not (child.exists() and child.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(child.read_text())
    try:
        server.stop(grace_s=5)
        assert _ends(pid)
    finally:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_stop_kills_what_a_crashed_api_server_left_in_its_process_group(tmp_path: Path) -> None:
    """An API server that dies during start-up without stopping its engine core (killed: the OOM killer, a
    crash; vLLM's engine core does not watch its parent) leaves it running with the model in memory; stop()
    ended the group only while its leader was alive, so the engine core outlived the failed start."""
    from kvretain.integrations.vllm.launch import ServerError, VLLMServer

    child = tmp_path / "child"
    fake = tmp_path / "python"
    fake.write_text(
        f"#!/bin/sh\nsh -c 'trap \"\" TERM; echo $$ > {child}.part; mv {child}.part {child}; exec sleep 60' &\n"
        f"while [ ! -s {child} ]; do sleep 0.05; done\nexit 1\n"
    )
    fake.chmod(0o755)
    server = VLLMServer("model", python=str(fake), log_path=tmp_path / "log")
    server.start()
    pid = 0
    try:
        with pytest.raises(ServerError, match="exited during start-up"):
            server.wait_ready(timeout_s=20)
        pid = int(child.read_text())
        assert _running(pid)  # (the leader is gone, its engine core stand-in is not)
        server.stop(grace_s=5)
        assert _ends(pid)
    finally:
        server.stop(grace_s=5)
        if pid and _running(pid):
            os.kill(pid, signal.SIGKILL)


class _Stream:
    """An ``openai`` stream as ``launch``'s loop reads it: each chunk advances the (fake) clock by a second."""

    def __init__(self, clock: list[float], chunks: list[Any]) -> None:
        self.clock = clock
        self.chunks = chunks

    async def __aiter__(self) -> Any:
        for chunk in self.chunks:
            self.clock[0] += 1.0
            yield chunk


def test_a_streams_first_token_is_its_first_choice_for_completions_and_its_first_text_for_chats(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a completion's first token may decode to no text yet (it counts); a chat's first chunk is the role alone
    from kvretain.integrations.vllm import launch

    clock = [0.0]
    monkeypatch.setattr(launch, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    usage = SimpleNamespace(prompt_tokens=3, completion_tokens=2)

    def chunks(kind: str, texts: list[str]) -> list[Any]:
        if kind == "chat":
            made = [SimpleNamespace(delta=SimpleNamespace(content=t or None)) for t in texts]
        else:
            made = [SimpleNamespace(text=t) for t in texts]
        return [SimpleNamespace(usage=None, choices=[c]) for c in made] + [
            SimpleNamespace(usage=usage, choices=[])
        ]

    async def create(**kwargs: Any) -> _Stream:
        assert kwargs["stream"] and kwargs["extra_body"] == {"priority": 2, "ignore_eos": True}
        return _Stream(clock, chunks("chat" if "messages" in kwargs else "completion", ["", "a", "b"]))

    client = SimpleNamespace(completions=SimpleNamespace(create=create))
    client.chat = SimpleNamespace(completions=SimpleNamespace(create=create))
    got = asyncio.run(launch.stream_completion(client, "m", [1, 2, 3], 2, 2))
    assert (got.ttft, got.e2e, got.text, got.usage) == (1.0, 4.0, "ab", usage)
    clock[0] = 0.0
    got = asyncio.run(launch.stream_chat(client, "m", [{"role": "user", "content": "hi"}], 2, 2))
    assert (got.ttft, got.e2e, got.text, got.usage) == (2.0, 4.0, "ab", usage)


def test_a_chats_first_token_may_decode_to_no_text(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM streams a chat token that decodes to no text yet (a special token, part of a character) as a delta with
    # "content": "" and no role; vLLM's benchmark (_choice_has_streamed_output) takes the TTFT there, as vLLM's
    # engine does. stream_chat waited for the first non-empty text: a token late
    from kvretain.integrations.vllm import launch

    clock = [0.0]
    monkeypatch.setattr(launch, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    deltas = [
        SimpleNamespace(role="assistant", content=""),  # the opening chunk: no token
        SimpleNamespace(role=None, content=""),  # the first token, no text yet
        SimpleNamespace(role=None, content="a"),
    ]
    chunks = [SimpleNamespace(usage=None, choices=[SimpleNamespace(delta=d)]) for d in deltas]

    async def create(**kwargs: Any) -> _Stream:
        return _Stream(clock, chunks)

    client = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))
    got = asyncio.run(launch.stream_chat(client, "m", [{"role": "user", "content": "hi"}], 0, 2))
    assert (got.ttft, got.text) == (2.0, "a")


def test_a_server_takes_the_callers_environment_over_the_launchers_defaults(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # BASE_ENV was laid over os.environ: an exported VLLM_CPU_KVCACHE_SPACE=40 still started the server with 1
    from kvretain.integrations.vllm.launch import VLLMServer

    fake, seen = _fake_interpreter(tmp_path, '"$VLLM_CPU_KVCACHE_SPACE $HF_HUB_OFFLINE $KVRETAIN_POLICY"')
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "40")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("KVRETAIN_POLICY", "lru")
    server = VLLMServer(
        "model", python=str(fake), env={"KVRETAIN_POLICY": "unified"}, log_path=tmp_path / "log"
    )
    try:
        assert (
            _started_and_seen(server, seen) == "40 1 unified"
        )  # (the caller's, a default, the server's own)
    finally:
        server.stop(grace_s=5)


def test_a_misspelt_variable_is_named_with_the_one_meant() -> None:
    # KVRETAIN_POLICY_OPTION=budget=0.5 ran the defaults without a word
    from kvretain.integrations.vllm.config import ENV_NAMES, unknown_env_names

    env = {
        "KVRETAIN_POLICY": "unified",
        "KVRETAIN_POLICY_OPTION": "budget=0.5",
        "KVRETAIN_GRANULARTY": "block",
        "KVRETAIN_SOMETHING": "1",
        "OTHER_VARIABLE": "x",
    }
    lines = unknown_env_names(env)
    assert lines == [
        "'KVRETAIN_GRANULARTY' is not a kvretain setting and is ignored (did you mean KVRETAIN_GRANULARITY?)",
        "'KVRETAIN_POLICY_OPTION' is not a kvretain setting and is ignored (did you mean KVRETAIN_POLICY_OPTIONS?)",
        f"'KVRETAIN_SOMETHING' is not a kvretain setting and is ignored (known: {', '.join(ENV_NAMES)})",
    ]
    assert unknown_env_names(dict.fromkeys(ENV_NAMES, "")) == []


def test_every_kvretain_variable_read_is_a_known_name() -> None:
    # the list the warning checks against is the list of what is read: a name read anywhere in src is in it
    import re

    from kvretain.integrations.vllm.config import ENV_NAMES, TOOL_ENV_NAMES

    root = Path(__file__).resolve().parents[1]
    src = root / "src" / "kvretain"
    read = {m for p in src.rglob("*.py") for m in re.findall(r"KVRETAIN_[A-Z_]+[A-Z]", p.read_text())}
    assert read <= {*ENV_NAMES, *TOOL_ENV_NAMES}, sorted(read - {*ENV_NAMES, *TOOL_ENV_NAMES})
    # the project's scripts' own variables (a server they start inherits them): named, so no warning
    files = [
        *(root / "scripts").glob("*.sh"),
        *(root / "tests" / "serve").glob("*.py"),
        *(root / "bench").glob("*.py"),
    ]
    tools = {m for p in files for m in re.findall(r"KVRETAIN_[A-Z_]+[A-Z]", p.read_text())}
    assert tools <= {*ENV_NAMES, *TOOL_ENV_NAMES}, sorted(tools - {*ENV_NAMES, *TOOL_ENV_NAMES})
    assert not set(ENV_NAMES) & set(TOOL_ENV_NAMES)


def test_the_scripts_variables_are_not_called_misspellings() -> None:
    # a serve test's server inherited KVRETAIN_SERVE_MODEL and logged it as "not a kvretain setting"
    from kvretain.integrations.vllm.config import TOOL_ENV_NAMES, unknown_env_names

    assert unknown_env_names({"KVRETAIN_SERVE_MODEL": "m", "KVRETAIN_SKIP_VLLM": "1"}) == []
    assert unknown_env_names(dict.fromkeys(TOOL_ENV_NAMES, "1")) == []


def test_register_warns_about_a_misspelt_variable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import kvretain.integrations.vllm as plugin

    monkeypatch.delenv("KVRETAIN_POLICY", raising=False)
    monkeypatch.setenv("KVRETAIN_POLICY_OPTION", "budget=0.5")
    with caplog.at_level("WARNING", logger=plugin.logger.name):
        plugin.register()
    assert any("did you mean KVRETAIN_POLICY_OPTIONS?" in r.getMessage() for r in caplog.records)


def test_no_is_off_and_an_unknown_policy_says_how_to_turn_it_off() -> None:
    assert config_from_env({"KVRETAIN_POLICY": "no"}) is None
    with pytest.raises(
        PluginConfigError, match=r"choose one of: .* \(or off, or leave it unset: stock vLLM\)"
    ):
        config_from_env({"KVRETAIN_POLICY": "yes"})


def test_a_frequency_cap_the_run_queue_cannot_count_is_refused() -> None:
    # the run queue keeps use counts in a byte: frequency_cap=1000 was logged as set and counted to 255
    env = {"KVRETAIN_POLICY": "unified", "KVRETAIN_POLICY_OPTIONS": "frequency_cap=1000"}
    with pytest.raises(
        PluginConfigError, match=r"frequency_cap=1000 is over 255.*KVRETAIN_GRANULARITY=block"
    ):
        config_from_env(env)
    block = config_from_env({**env, "KVRETAIN_GRANULARITY": "block"})
    assert block is not None and block.policy_config(16).frequency_cap == 1000
    at_most = config_from_env({**env, "KVRETAIN_POLICY_OPTIONS": "frequency_cap=255"})
    assert at_most is not None and at_most.policy_config(16).frequency_cap == 255


def test_the_run_queues_own_defaults_apply_to_the_run_queue_alone_and_yield_to_options() -> None:
    # no ghost table in the run queue by default (RUN_QUEUE_DEFAULTS); the per-block queue keeps the policy's own
    assert PluginConfig().policy_config(16).ghost_factor == 0.0
    assert PluginConfig(granularity="block").policy_config(16).ghost_factor == PolicyConfig().ghost_factor > 0
    assert PluginConfig(policy="lfu").policy_config(16).ghost_factor == PolicyConfig().ghost_factor
    assert PluginConfig(options={"ghost_factor": 4.0}).policy_config(16).ghost_factor == 4.0


def test_a_decode_duration_of_zero_survives_extra_args_for() -> None:
    # 0 s: the decode priority lapses at release; dropped, it would never lapse
    cfg = RetentionConfig((), 80, 0.0)
    assert extra_args_for(cfg) == {"retention_decode_priority": 80, "retention_decode_duration": 0.0}
    back = retention_from_extra_args(extra_args_for(cfg))
    assert back is not None and back.decode_duration_s == 0.0


def test_the_policy_variable_is_read_in_any_case() -> None:
    cfg = config_from_env({"KVRETAIN_POLICY": " Unified "})
    assert cfg is not None and cfg.policy == "unified"
    assert config_from_env({"KVRETAIN_POLICY": "OFF"}) is None


@pytest.mark.parametrize("value", ["0", "false", "no", "off", ""])
def test_only_a_true_value_allows_an_unsupported_vllm(value: str) -> None:
    assert check_vllm_version("0.31.1", {"KVRETAIN_ALLOW_UNSUPPORTED_VLLM": value}) is not None
    assert check_vllm_version("0.31.1", {"KVRETAIN_ALLOW_UNSUPPORTED_VLLM": "yes"}) is None
