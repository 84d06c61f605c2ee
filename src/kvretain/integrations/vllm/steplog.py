"""A per-step log of a running vLLM engine: each step's batch and its wall time, as JSONL (``KVRETAIN_STEP_LOG``).

Set ``KVRETAIN_STEP_LOG=FILE`` in a vLLM server's (or offline ``LLM``'s) environment and the engine-core process
appends one JSON line per engine step that scheduled tokens::

    {"t0": 12.345, "t1": 12.389, "reqs": [[n, p, s], ...], "ids": ["req-a", ...], "more": true, "pid": 4242}

- ``t0``: ``time.monotonic()`` when ``Scheduler.schedule`` began; ``t1``: when ``Scheduler.update_from_output``
  returned. Between them the engine core schedules, the model runs (in the worker process on a CPU server)
  and the scheduler takes the output: one step of ``EngineCore.step``.
- ``reqs``: one ``[n, p, s]`` per scheduled request: ``n`` tokens computed this step, ``p`` tokens before them
  whose KV was already there (prefix-cache hit or earlier chunks; for a decode its context so far), ``s`` 1
  when the step samples a token for it (a decode, or the chunk that completes its prompt), else 0. These are
  the simulator's chunk counts (:class:`kvretain.sched.output.ScheduledChunk`'s ``num_new_tokens``,
  ``num_computed_tokens``, ``samples``), so a step's cost-model features follow from them by the same rule.
- ``ids``: the requests' ids, in ``reqs``' order (vLLM's internal ids: the API server's request id plus a suffix).
- ``more``: whether the scheduler still had unfinished requests at ``t1``; then the busy loop goes straight on
  (reading new requests, sending outputs) to the next step, so the time until the next ``t0`` belongs to the
  engine's cycle too. With async scheduling (vLLM's batch queue, its default on GPUs) the next step is
  scheduled before the last one's output is taken: two steps overlap, and each line keeps its own ``t0`` and
  ``t1`` (the lines are in the order the steps' outputs were taken, which is the order they were scheduled).
- ``pid``: the engine-core process that wrote the line (absent in logs written before session 59).

Several processes may append to one file (two servers given one ``KVRETAIN_STEP_LOG``, a server restarted onto
its old log): each line lands whole, and ``pid`` tells their steps apart (the times are ``CLOCK_MONOTONIC``, one
clock for the whole host). The file is opened with ``O_APPEND`` and each line, encoded, goes in one ``write(2)``:
for a regular file POSIX sets the offset to the end "prior to each write" with "no intervening file modification
operation ... between changing the file offset and the write operation" (``write()``; its section 2.9.7 makes
writes to a regular file atomic with respect to each other), and Linux's local file systems hold the file's lock
over the whole write: two writers' lines cannot overlap or cut into each other, whatever their length
(``PIPE_BUF``, 4 KiB, bounds atomic writes to pipes and FIFOs, not to regular files). Its limits: a write the kernel cuts short (a full disk, ``RLIMIT_FSIZE``; Linux
also caps one write at 2,147,479,552 bytes) is finished by a second write that another writer's line may precede,
so that line breaks and :func:`read_step_log` names it; and NFS does not keep ``O_APPEND`` atomic between clients
(open(2)), so a log shared by servers on different hosts can lose or mix lines: give each host its own file.
(Python's buffered text file happened to make one ``write(2)`` per flushed line too, on CPython 3.11; that is an
implementation detail of its ``io`` layers, so the write is made explicitly.)

It changes nothing in scheduling or caching: it only wraps the two ``Scheduler`` methods to read their
arguments and results, so a stock run (no ``KVRETAIN_POLICY``) logs its steps unchanged. Installed by the
plugin's :func:`kvretain.integrations.vllm.register` in every process vLLM loads plugins in; only the engine
core schedules, so only it opens the file (lazily, on its first step; a line is flushed per step, so a server
stopped by a signal keeps every finished step). A hook error is counted and logged
(``stats()["hook_errors"]``), never raised into vLLM.

:func:`read_step_log` reads the file back (no vLLM needed).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvretain.integrations.vllm._runtime import HOOK_ERRORS, logger
from kvretain.integrations.vllm.config import (
    ENV_STEP_LOG,  # (the JSONL file the engine core appends its steps
)

#                                                              to; unset or empty: no log)

FORMAT_KEYS = ("t0", "t1", "reqs", "more")


@dataclass(frozen=True)
class StepRecord:
    """One logged engine step: its start and end (``time.monotonic()`` seconds), its chunks ``(n, p, s)`` and
    whether requests were left at its end."""

    t0: float
    t1: float
    reqs: tuple[tuple[int, int, int], ...]
    more: bool
    ids: tuple[str, ...] = ()
    """The requests' ids in ``reqs``' order (empty when the log has none)."""
    pid: int | None = None
    """The process that wrote the step (``None`` when the log has none)."""

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0


def composition(requests: Mapping[str, Any], num_scheduled_tokens: Mapping[str, int]) -> list[list[int]]:
    """``[[n, p, s], ...]`` of a step just scheduled, from the scheduler's request objects *after*
    ``schedule()`` (vLLM advances ``num_computed_tokens`` by the scheduled tokens inside it, so the tokens
    before this step are ``num_computed_tokens - n``; the step samples when that reaches ``num_tokens``, the
    prompt plus the outputs so far)."""
    out = []
    for rid, n in num_scheduled_tokens.items():
        r = requests[rid]
        done = int(r.num_computed_tokens)
        out.append([int(n), done - int(n), int(done >= int(r.num_tokens))])
    return out


MAX_PENDING = 8
"""Steps scheduled and not yet updated that the log holds (vLLM's batch queue holds two); a step whose output
never came back goes once this many are newer."""


class StepLog:
    """The open log of one process: :meth:`begin` after a schedule, :meth:`end` after its update."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self.clock = clock
        # checked here, when the plugin is installed: a path that cannot be written is an error at start, not a
        # failed write at every step (raises OSError); the file itself is opened at the first step (a process
        # that never schedules, vLLM's API server, writes none)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_dir() or not os.access(
            self.path if self.path.exists() else self.path.parent, os.W_OK
        ):
            raise PermissionError(f"cannot write {self.path}")
        self._fd: int | None = None
        self._closed = False
        # the steps scheduled and not yet updated, by their ``SchedulerOutput`` (its ``id``): one at a time in
        # ``EngineCore.step``; with async scheduling (``step_with_batch_queue``, vLLM's default on GPUs) the next
        # batch is scheduled before the last one's output is taken, and a single slot lost a step a cycle and gave
        # each line the previous step's end
        self._pending: dict[object, tuple[float, list[list[int]], list[str]]] = {}
        self._lock = threading.Lock()

    def begin(self, t0: float, reqs: list[list[int]], ids: list[str], step: object = None) -> None:
        """A step scheduled at ``t0`` (``step``: what :meth:`end` will be given for it, its scheduler output)."""
        if reqs:
            pending = self._pending
            pending[step] = (t0, reqs, ids)
            if len(pending) > MAX_PENDING:  # (outputs never updated: a failed step; the oldest go)
                del pending[next(iter(pending))]

    def end(self, more: bool, step: object = None) -> None:
        """The step ``step`` was updated (``more``: unfinished requests remain); its line is written."""
        pending = self._pending.pop(step, None)
        if pending is None:
            return
        t0, reqs, ids = pending
        rec = {"t0": t0, "t1": self.clock(), "reqs": reqs, "ids": ids, "more": bool(more), "pid": os.getpid()}
        data = (json.dumps(rec) + "\n").encode()  # (ASCII: json.dumps escapes the rest)
        with self._lock:
            if self._closed:  # (a later install took over)
                return
            if self._fd is None:  # kept open: one line a step, each reaching the file at once (no buffer)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o666)
            write_whole(self._fd, data)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def write_whole(fd: int, data: bytes) -> None:
    """``data`` appended to ``fd`` (opened ``O_APPEND``) in one ``write(2)``, which lands whole next to other
    processes' writes (the module's docstring); a write the kernel cuts short is finished by more (the line may
    then be split)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


_ORIGINALS: dict[str, Callable[..., Any]] = {}
_patched: type | None = None
_log: StepLog | None = None


def install(path: str | Path, scheduler_cls: type | None = None) -> StepLog:
    """Log the steps of every ``scheduler_cls`` (default: vLLM v1's ``Scheduler``) to ``path``. Idempotent for
    the same class (a second call switches the file)."""
    global _patched, _log
    log = StepLog(path)  # (first: a path that cannot be written is refused before anything is patched)
    if scheduler_cls is None:
        from vllm.v1.core.sched.scheduler import Scheduler

        scheduler_cls = Scheduler
    if _patched is not None and _patched is not scheduler_cls:
        uninstall()
    if _log is not None:
        _log.close()
    _log = log
    if _patched is scheduler_cls:
        return log
    orig_schedule = scheduler_cls.__dict__["schedule"]
    orig_update = scheduler_cls.__dict__["update_from_output"]

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic()
        out = orig_schedule(self, *args, **kwargs)
        cur = _log
        if cur is not None:
            try:
                n = out.num_scheduled_tokens
                cur.begin(t0, composition(self.requests, n), [str(r) for r in n], id(out))
            except Exception:
                HOOK_ERRORS.record("steplog.schedule", "kvretain step log: reading a scheduled step failed")
        return out

    def update_from_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        res = orig_update(self, *args, **kwargs)
        cur = _log
        if cur is not None:
            try:
                step = args[0] if args else kwargs["scheduler_output"]
                cur.end(self.get_num_unfinished_requests() > 0, id(step))
            except Exception:
                HOOK_ERRORS.record("steplog.update", "kvretain step log: writing a step failed")
        return res

    _ORIGINALS.update(schedule=orig_schedule, update_from_output=orig_update)
    setattr(scheduler_cls, "schedule", schedule)  # noqa: B010 (a class attribute mypy cannot see)
    setattr(scheduler_cls, "update_from_output", update_from_output)  # noqa: B010
    _patched = scheduler_cls
    return log


def uninstall() -> None:
    """Restore the scheduler's methods and close the log."""
    global _patched, _log
    if _patched is not None:
        for name, fn in _ORIGINALS.items():
            setattr(_patched, name, fn)
        _ORIGINALS.clear()
        _patched = None
    if _log is not None:
        _log.close()
        _log = None


def install_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """:func:`install` when ``KVRETAIN_STEP_LOG`` names a file; whether it did. Never raises (logs instead)."""
    path = (os.environ if environ is None else environ).get(ENV_STEP_LOG, "").strip()
    if not path:
        return False
    try:
        install(path)
    except OSError as exc:  # (a path that cannot be written: one line, at start)
        logger.error("kvretain step log (%s=%s) not installed: %s", ENV_STEP_LOG, path, exc)
        return False
    except Exception:
        logger.exception("kvretain step log (%s=%s) not installed", ENV_STEP_LOG, path)
        return False
    return True


def _record(obj: Any, where: str) -> StepRecord:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: not a JSON object")
    missing = [k for k in FORMAT_KEYS if k not in obj]
    if missing:
        raise ValueError(f"{where}: lacks {', '.join(missing)}")
    t0, t1 = obj["t0"], obj["t1"]
    for name, v in (("t0", t0), ("t1", t1)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ValueError(f"{where}: {name} must be a finite number, got {v!r}")
    if t1 < t0:
        raise ValueError(f"{where}: t1 {t1} is before t0 {t0}")
    reqs = obj["reqs"]
    if not isinstance(reqs, list) or not reqs:
        raise ValueError(f"{where}: reqs must be a non-empty list of [n, p, s]")
    chunks = []
    for r in reqs:
        if (
            not isinstance(r, list)
            or len(r) != 3
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)
            or r[0] < 1
            or r[1] < 0
            or r[2] not in (0, 1)
        ):
            raise ValueError(f"{where}: a reqs entry must be [n >= 1, p >= 0, s in 0/1], got {r!r}")
        chunks.append((r[0], r[1], r[2]))
    if not isinstance(obj["more"], bool):
        raise ValueError(f"{where}: more must be true or false, got {obj['more']!r}")
    ids = obj.get("ids", [])
    if (
        not isinstance(ids, list)
        or not all(isinstance(x, str) for x in ids)
        or len(ids) not in (0, len(chunks))
    ):
        raise ValueError(f"{where}: ids must be a list of strings, one per reqs entry")
    pid = obj.get("pid")
    if pid is not None and (not isinstance(pid, int) or isinstance(pid, bool) or pid < 0):
        raise ValueError(f"{where}: pid must be a process id, got {pid!r}")
    return StepRecord(float(t0), float(t1), tuple(chunks), obj["more"], tuple(ids), pid)


def parse_step_log(lines: Iterable[str], where: str = "step log") -> list[StepRecord]:
    """The records of JSONL ``lines`` (blank lines skipped); ``ValueError`` naming the line otherwise."""
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} line {i}: not JSON: {e}") from None
        out.append(_record(obj, f"{where} line {i}"))
    return out


def read_step_log(path: str | Path) -> list[StepRecord]:
    """The records of the step log at ``path``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"step log {str(path)!r}: {e}") from None
    return parse_step_log(text.splitlines(), where=f"step log {str(path)!r}")
