"""The step log hook (``KVRETAIN_STEP_LOG``): what it writes per engine step, read back, and its errors. The
hook is installed here on a stand-in scheduler class with vLLM's two method names and request fields (no vLLM
needed); the bench's fit of these records is tested in test_sim_fidelity_bench.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvretain.integrations.vllm import steplog
from kvretain.integrations.vllm._runtime import HOOK_ERRORS


class FakeScheduler:
    """vLLM's ``Scheduler`` as the hook sees it: ``schedule()`` advances ``num_computed_tokens`` by the scheduled
    tokens (as vLLM's ``_update_after_schedule`` does) and returns an output with ``num_scheduled_tokens``;
    ``update_from_output`` appends the sampled tokens and drops finished requests."""

    def __init__(self, plan: list[dict[str, int]], requests: dict[str, SimpleNamespace]) -> None:
        self.plan = plan
        self.requests = requests

    def schedule(self) -> Any:
        step = self.plan.pop(0)
        for rid, n in step.items():
            self.requests[rid].num_computed_tokens += n
        return SimpleNamespace(num_scheduled_tokens=step)

    def update_from_output(self, out: Any, model_output: Any) -> str:
        for rid in out.num_scheduled_tokens:
            r = self.requests[rid]
            if r.num_computed_tokens >= r.num_tokens:
                r.num_tokens += 1  # sampled one token
                if r.num_tokens >= r.stop:
                    del self.requests[rid]
        return "outputs"

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)


def req(prompt: int, cached: int, out_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(num_computed_tokens=cached, num_tokens=prompt, stop=prompt + out_tokens)


@pytest.fixture
def fake(tmp_path: Path) -> Any:
    own = {"schedule": FakeScheduler.schedule, "update_from_output": FakeScheduler.update_from_output}
    cls = type("Sched", (FakeScheduler,), own)  # the methods in the class's own dict, as vLLM's are
    log = tmp_path / "sub" / "steps.jsonl"
    steplog.install(log, cls)
    yield cls, log
    steplog.uninstall()


def test_records_each_step_batch_and_times(fake: Any) -> None:
    cls, log = fake
    # a: 100-token prompt, 64 cached (a prefix hit), 2 outputs; b: 40-token prompt, nothing cached, 1 output
    s = cls([{"a": 36}, {"a": 1, "b": 30}, {"b": 10}], {"a": req(100, 64, 2), "b": req(40, 0, 1)})
    for _ in range(3):
        assert s.update_from_output(s.schedule(), None) == "outputs"  # results pass through unchanged
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["reqs"] for x in lines] == [
        [[36, 64, 1]],  # the prompt's rest after the hit: completes it, samples
        [[1, 100, 1], [30, 0, 0]],  # a decodes at context 100; b's first chunk does not sample
        [[10, 30, 1]],  # b's last chunk samples (then b is done)
    ]
    assert [x["ids"] for x in lines] == [["a"], ["a", "b"], ["b"]]
    assert [x["more"] for x in lines] == [True, True, False]
    assert all(x["t0"] <= x["t1"] for x in lines) and lines[0]["t1"] <= lines[1]["t0"]
    recs = steplog.read_step_log(log)
    assert recs[1].reqs == ((1, 100, 1), (30, 0, 0)) and recs[2].more is False and recs[1].ids == ("a", "b")
    assert recs[0].seconds == pytest.approx(lines[0]["t1"] - lines[0]["t0"])


def test_async_scheduling_logs_every_step_with_its_own_times(fake: Any) -> None:
    # EngineCore.step_with_batch_queue (async scheduling, vLLM's default on GPUs) schedules the next batch before
    # it takes the last one's output: schedule, schedule, update, schedule, update, update. One pending slot lost
    # the first step and gave each line the previous step's requests with the next step's end (session 45).
    cls, log = fake
    s = cls([{"a": 36}, {"b": 30}, {"b": 10}], {"a": req(100, 64, 2), "b": req(40, 0, 3)})
    o1 = s.schedule()
    o2 = s.schedule()
    s.update_from_output(o1, None)
    o3 = s.schedule()
    s.update_from_output(o2, None)
    s.update_from_output(o3, None)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["ids"] for x in lines] == [["a"], ["b"], ["b"]]
    assert [x["reqs"] for x in lines] == [[[36, 64, 1]], [[30, 0, 0]], [[10, 30, 1]]]
    # each step's own t0 (the overlapping batches: the second was scheduled before the first ended)
    assert lines[0]["t0"] < lines[1]["t0"] < lines[0]["t1"] and lines[1]["t0"] < lines[2]["t0"]
    assert all(x["t0"] <= x["t1"] for x in lines)


def test_a_step_whose_output_never_comes_back_is_dropped_in_time(tmp_path: Path) -> None:
    log = steplog.StepLog(tmp_path / "steps.jsonl")
    for i in range(steplog.MAX_PENDING + 5):
        log.begin(float(i), [[1, 0, 1]], [f"r{i}"], step=i)
    assert len(log._pending) == steplog.MAX_PENDING
    log.end(True, step=steplog.MAX_PENDING + 4)  # (the newest is still there)
    assert json.loads((tmp_path / "steps.jsonl").read_text())["ids"] == [f"r{steplog.MAX_PENDING + 4}"]


def test_an_empty_step_writes_nothing_and_uninstall_restores(fake: Any) -> None:
    cls, log = fake
    s = cls([{}, {"a": 5}], {"a": req(5, 0, 3)})
    s.update_from_output(s.schedule(), None)
    assert not log.exists()  # opened lazily: a process that never schedules (the API server) writes no file
    s.update_from_output(s.schedule(), None)
    assert len(log.read_text().splitlines()) == 1
    steplog.uninstall()
    assert cls.__dict__["schedule"] is FakeScheduler.schedule
    assert cls.__dict__["update_from_output"] is FakeScheduler.update_from_output
    s2 = cls([{"a": 1}], {"a": req(5, 5, 3)})
    s2.update_from_output(s2.schedule(), None)
    assert len(log.read_text().splitlines()) == 1  # not logged any more


def test_a_hook_error_is_counted_never_raised(fake: Any) -> None:
    cls, _ = fake
    HOOK_ERRORS.reset()
    s = cls([{"ghost": 3}], {})
    s.requests = {"ghost": SimpleNamespace(num_computed_tokens=0)}  # no num_tokens: the hook cannot read it
    s.schedule()
    assert HOOK_ERRORS.snapshot() == {"steplog.schedule": 1}
    HOOK_ERRORS.reset()


def test_install_from_env_needs_the_variable() -> None:
    assert steplog.install_from_env({}) is False
    assert steplog.install_from_env({steplog.ENV_STEP_LOG: "  "}) is False


def test_a_step_log_that_cannot_be_written_is_refused_at_install(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # accepted at start, then every step's write failed (counted as a hook error, the open retried each step)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for bad in (blocker / "steps.jsonl", tmp_path):  # (a folder under a file; a folder)
        with pytest.raises(OSError):
            steplog.StepLog(bad)
        caplog.clear()
        assert steplog.install_from_env({steplog.ENV_STEP_LOG: str(bad)}) is False
        assert len(caplog.records) == 1 and "not installed" in caplog.records[0].getMessage()
        assert caplog.records[0].exc_info is None  # (one line, no traceback)


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("nope", "line 2: not JSON"),
        ('{"t0": 1, "t1": 2, "reqs": [[1, 2, 1]]}', "lacks more"),
        ('{"t0": 2, "t1": 1, "reqs": [[1, 2, 1]], "more": true}', "t1 1 is before t0 2"),
        ('{"t0": 1, "t1": 2, "reqs": [], "more": true}', "reqs must be a non-empty list"),
        ('{"t0": 1, "t1": 2, "reqs": [[0, 2, 1]], "more": true}', "[n >= 1, p >= 0, s in 0/1]"),
        ('{"t0": 1, "t1": 2, "reqs": [[1, 2, 2]], "more": true}', "[n >= 1, p >= 0, s in 0/1]"),
        ('{"t0": 1, "t1": 2, "reqs": [[1, 2, 1]], "more": 1}', "more must be true or false"),
        ('{"t0": "x", "t1": 2, "reqs": [[1, 2, 1]], "more": true}', "t0 must be a finite number"),
        ('{"t0": 1, "t1": 2, "reqs": [[1, 2, 1]], "ids": ["a", "b"], "more": true}', "one per reqs entry"),
        (
            '{"t0": 1, "t1": 2, "reqs": [[1, 2, 1], [3, 0, 0]], "ids": ["a"], "more": true}',
            "one per reqs entry",
        ),
    ],
)
def test_bad_lines_name_the_line_and_field(line: str, needle: str) -> None:
    good = '{"t0": 0.5, "t1": 0.6, "reqs": [[3, 0, 1]], "more": true}'
    with pytest.raises(ValueError, match="step log line 2") as e:
        steplog.parse_step_log([good, line])
    assert needle in str(e.value)


def test_a_step_of_no_measurable_time_and_blank_lines_read_back() -> None:
    # t1 == t0 (a step shorter than the clock's resolution) is a step, not an error; blank lines are skipped
    last = '{"t0": 2, "t1": 3, "reqs": [[1, 3, 1]], "ids": ["a"], "more": false}'
    recs = steplog.parse_step_log(
        ['{"t0": 1.5, "t1": 1.5, "reqs": [[3, 0, 1]], "more": true}', "", "  ", last]
    )
    assert [r.seconds for r in recs] == [0.0, 1.0] and recs[1].ids == ("a",)


def test_a_log_switched_off_by_a_second_install_writes_no_more_lines(fake: Any, tmp_path: Path) -> None:
    # a step in flight when the file was switched (a second install) ends on the old log: it is closed for good,
    # so the old file neither stays open nor gets the line
    cls, first = fake
    old = steplog._log
    assert old is not None
    old.begin(1.0, [[3, 0, 1]], ["a"], step="s1")
    old.end(True, step="s1")
    second = tmp_path / "second.jsonl"
    steplog.install(second, cls)
    assert old._fd is None
    old.begin(2.0, [[1, 3, 1]], ["a"], step="s2")
    old.end(False, step="s2")
    assert len(first.read_text().splitlines()) == 1 and not second.exists()


def test_installing_again_wraps_the_methods_once_and_another_class_gets_the_hook_alone(
    fake: Any, tmp_path: Path
) -> None:
    cls, log = fake
    # the same class again: the file switches, nothing is wrapped twice
    steplog.install(tmp_path / "again.jsonl", cls)
    s = cls([{"a": 5}], {"a": req(5, 0, 3)})
    s.update_from_output(s.schedule(), None)
    assert len((tmp_path / "again.jsonl").read_text().splitlines()) == 1 and not log.exists()
    own = {"schedule": FakeScheduler.schedule, "update_from_output": FakeScheduler.update_from_output}
    other = type("Other", (FakeScheduler,), own)
    steplog.install(tmp_path / "other.jsonl", other)
    assert cls.__dict__["schedule"] is FakeScheduler.schedule  # the first class is restored
    assert cls.__dict__["update_from_output"] is FakeScheduler.update_from_output
    steplog.uninstall()
    assert other.__dict__["schedule"] is FakeScheduler.schedule
    assert other.__dict__["update_from_output"] is FakeScheduler.update_from_output


def test_a_missing_file_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"step log .*nothing\.jsonl"):
        steplog.read_step_log(tmp_path / "nothing.jsonl")


def _append_steps(path: str, tag: str, count: int, start: Any) -> None:
    """One writer of :func:`test_processes_sharing_one_log_each_append_whole_lines`: ``count`` steps of long
    lines (3,000-30,000 requests a step: 40 KB to 400 KB, past any stdio or page-sized buffer)."""
    log = steplog.StepLog(path)
    start.wait()
    for i in range(count):
        n = 3000 * (1 + i % 10)
        log.begin(float(i), [[1, i, 1]] * n, [f"{tag}-{i}"] * n, step=i)
        log.end(True, step=i)
    log.close()


def test_processes_sharing_one_log_each_append_whole_lines(tmp_path: Path) -> None:
    # two servers given one KVRETAIN_STEP_LOG: every line either wrote lands whole (one write(2) of the whole
    # line on an O_APPEND descriptor), none cut into another's
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    path = tmp_path / "shared.jsonl"
    start = ctx.Event()
    procs = [ctx.Process(target=_append_steps, args=(str(path), t, 40, start)) for t in ("a", "b", "c")]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    recs = steplog.read_step_log(path)  # (every line parses)
    assert len(recs) == 120 and len({r.pid for r in recs}) == 3  # (each line names its writer)
    for tag in ("a", "b", "c"):
        mine = [r for r in recs if r.ids[0].startswith(f"{tag}-")]
        assert [r.ids[0] for r in mine] == [f"{tag}-{i}" for i in range(40)]
        assert all(len(set(r.ids)) == 1 and len(r.ids) == len(r.reqs) for r in mine)


def test_a_write_cut_short_is_finished_and_a_pid_is_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a write the kernel cuts short (a full disk, RLIMIT_FSIZE) is finished, not left half a line
    import os

    writes: list[int] = []
    real = os.write

    def short(fd: int, data: Any) -> int:
        writes.append(len(data))
        return real(fd, bytes(data[:100]))

    monkeypatch.setattr(steplog.os, "write", short)
    log = steplog.StepLog(tmp_path / "steps.jsonl")
    log.begin(1.0, [[3, 0, 1]] * 50, ["a"] * 50, step=1)
    log.end(False, step=1)
    log.close()
    assert len(writes) > 1
    (rec,) = steplog.read_step_log(tmp_path / "steps.jsonl")
    assert rec.pid == os.getpid() and len(rec.reqs) == 50
    assert steplog.parse_step_log(['{"t0": 1, "t1": 2, "reqs": [[1, 2, 1]], "more": true}'])[0].pid is None
    with pytest.raises(ValueError, match="pid must be a process id"):
        steplog.parse_step_log(['{"t0": 1, "t1": 2, "reqs": [[1, 2, 1]], "more": true, "pid": "x"}'])
