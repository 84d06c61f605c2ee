"""A pytest plugin that runs vLLM's own tests with the kvretain plugin on: ``pytest -p kvretain.integrations.vllm.testing``.

With ``KVRETAIN_POLICY`` set (and the other variables of :mod:`kvretain.integrations.vllm.config`), the plugin is
enabled before any test module is imported, so every prefix-caching ``BlockPool`` the tests build gets the
retention queue; after every test each queue built during it runs its consistency check (``check()``), and a
broken queue fails the test. Without ``KVRETAIN_POLICY`` nothing is enabled (the stock run).

Lists, one entry a line (``#`` starts a comment), named by environment variables:

``KVRETAIN_SUITE_SKIP``
    a file of ``nodeid | reason`` lines: tests skipped in every run (e.g. they need a model config that cannot
    be had offline), reported with their reason.
``KVRETAIN_SUITE_XFAIL``
    a file of ``policy | nodeid | reason`` lines: tests expected to fail under that policy (``policy`` as in
    ``KVRETAIN_POLICY``, ``unified:block`` for the block granularity), marked ``xfail(strict=True)``: an
    expected failure that passes is an error too, so the list stays exact.

The summary line says which policy ran, how many retention queues were installed and how many checks passed.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

from kvretain.integrations.vllm.config import ENV_SUITE_SKIP, ENV_SUITE_XFAIL

ENV_SKIP = ENV_SUITE_SKIP
ENV_XFAIL = ENV_SUITE_XFAIL


def _read_list(path: str, fields: int) -> list[list[str]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip() if not line.lstrip().startswith("#") else ""
            if not line:
                continue
            parts = [p.strip() for p in line.split("|", fields - 1)]
            if len(parts) != fields or not all(parts):
                raise pytest.UsageError(f"{path}:{n}: expected {fields} fields separated by '|': {line!r}")
            rows.append(parts)
    return rows


class _Suite:
    def __init__(self, config: pytest.Config) -> None:
        from kvretain.integrations.vllm.config import config_from_env

        self.cfg = config_from_env()
        self.label = "stock" if self.cfg is None else self.cfg.policy
        if self.cfg is not None and self.cfg.policy == "unified":
            self.label = f"unified:{self.cfg.granularity}"
        self.skip: dict[str, str] = {}
        self.xfail: dict[str, str] = {}
        if os.environ.get(ENV_SKIP):
            self.skip = {nodeid: reason for nodeid, reason in _read_list(os.environ[ENV_SKIP], 2)}
        if os.environ.get(ENV_XFAIL):
            for policy, nodeid, reason in _read_list(os.environ[ENV_XFAIL], 3):
                if policy == self.label:
                    self.xfail[nodeid] = reason
        self.queues: list[Any] = []  # built during the current test (held until it is checked)
        self.installed = 0
        self.checks = 0
        self.unknown: list[str] = []

    def enable(self) -> None:
        if self.cfg is None:
            return
        import kvretain.integrations.vllm as plugin
        from kvretain.integrations.vllm import _patches

        plugin.enable(self.cfg)
        orig = _patches.install_queue

        def install_queue(pool: Any, cfg: Any) -> Any:
            q = orig(pool, cfg)
            self.queues.append(q)
            self.installed += 1
            return q

        _patches.install_queue = install_queue


_SUITE: _Suite | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _SUITE
    _SUITE = _Suite(config)
    _SUITE.enable()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    suite = _SUITE
    assert suite is not None
    seen = set()
    for item in items:
        reason = suite.skip.get(item.nodeid)
        if reason is not None:
            seen.add(item.nodeid)
            item.add_marker(pytest.mark.skip(reason=f"kvretain suite list: {reason}"))
            continue
        reason = suite.xfail.get(item.nodeid)
        if reason is not None:
            seen.add(item.nodeid)
            item.add_marker(pytest.mark.xfail(reason=f"{suite.label}: {reason}", strict=True))
    # entries that name no collected test (a renamed test, a typo) are reported, so the lists stay exact
    suite.unknown = sorted((set(suite.skip) | set(suite.xfail)) - seen)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if _SUITE is not None:
        _SUITE.queues.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """After the test body (its fixtures still alive): check every queue built in its setup or body."""
    suite = _SUITE
    try:
        result = yield  # (a failing test raises here: no check then)
        if suite is not None:
            for q in suite.queues:
                q.check()
                suite.checks += 1
        return result
    finally:
        if suite is not None:
            suite.queues.clear()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    suite = _SUITE
    if suite is None:
        return
    tr = terminalreporter
    if suite.cfg is None:
        tr.write_line(
            f"kvretain suite: stock vLLM (plugin not enabled); {len(suite.skip)} tests on the skip list"
        )
    else:
        tr.write_line(
            f"kvretain suite: policy {suite.label}: {suite.installed} retention queues installed, "
            f"{suite.checks} queue checks passed, {len(suite.xfail)} expected failures listed"
        )
    for nodeid in suite.unknown:
        tr.write_line(f"kvretain suite: listed test not collected: {nodeid}", yellow=True)
