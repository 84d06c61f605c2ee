"""The protection controller's state where a user reads results: ``kvretain replay`` and ``kvretain simulate``
report it in their JSON (``policy_stats``) and under their tables (issue 10, deliverable 2: "the controller's
state (target share, both estimates, which constraint binds) is in the stats"; before this only the policy's
``stats()`` and the plugin's gauges had it)."""

from __future__ import annotations

import json

import pytest

from kvretain.cli import controller_line, main

CONTROLLER_KEYS = {
    "protection_level",
    "protected_target",
    "protected_budget",
    "hit_ratio_window",
    "lru_hit_ratio_estimate",
    "protected_hit_ratio_window",
    "isolated_hit_ratio_estimate",
    "reuse_floor_binds",
    "isolation_goal_met",
    "isolation_goal",
}
SIM = ["--limit", "120", "--kv-blocks", "300", "--no-progress"]


def _json_lines(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[dict[str, object]]:
    assert main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]


def test_replay_json_carries_each_policys_state(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--sessions", "40", "--capacity-blocks", "60", "--no-progress", "--json"]
    (uni,) = _json_lines(capsys, [*argv, "--policy", "unified"])
    stats = uni["policy_stats"]
    assert isinstance(stats, dict) and set(stats) >= CONTROLLER_KEYS
    assert -1.0 <= stats["protection_level"] <= 1.0
    assert 0.0 <= stats["protected_target"] <= stats["protected_budget"]
    (lru,) = _json_lines(capsys, [*argv, "--policy", "lru"])
    assert lru["policy_stats"] == {}  # (the same key, empty: a policy without state)


def test_replay_table_prints_the_controller_under_unified_only(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", "--sessions", "40", "--capacity-blocks", "60", "--no-progress"]
    assert main([*argv, "--policy", "unified"]) == 0
    out = capsys.readouterr().out
    assert "unified controller: protection level" in out and "LRU estimate" in out
    assert main([*argv, "--policy", "lru"]) == 0
    assert "controller" not in capsys.readouterr().out


def test_simulate_reports_one_controller_a_replica(capsys: pytest.CaptureFixture[str]) -> None:
    (obj,) = _json_lines(capsys, ["simulate", "--policy", "unified", "--replicas", "2", *SIM, "--json"])
    per = obj["policy_stats"]
    assert isinstance(per, list) and len(per) == 2
    assert all(set(st) >= CONTROLLER_KEYS for st in per)
    assert main(["simulate", "--policy", "unified", "--replicas", "2", *SIM]) == 0
    out = capsys.readouterr().out
    assert "replica 0 controller:" in out and "replica 1 controller:" in out
    (one,) = _json_lines(capsys, ["simulate", "--policy", "lru", *SIM, "--json"])
    assert one["policy_stats"] == [{}]


def test_simulate_with_one_replica_prints_its_controller_unnumbered(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["simulate", "--policy", "unified", *SIM]) == 0
    out = capsys.readouterr().out
    assert "\ncontroller: protection level" in out and "replica 0" not in out


def test_the_line_says_which_constraint_binds_and_when_nothing_protected_was_seen() -> None:
    base = dict.fromkeys(CONTROLLER_KEYS, 0.0) | {"protection_level": 0.5, "protected_budget": 100.0}
    base["isolation_goal"] = 0.9
    assert controller_line({}) is None  # (a policy without a controller)
    quiet = controller_line(base)
    assert quiet is not None and "no protected hits measured yet" in quiet
    assert "the reuse floor has room" in quiet and "frequency exponent" not in quiet
    short = controller_line(base | {"reuse_floor_binds": 1.0, "protected_hit_ratio_window": 0.2})
    assert short is not None and "the reuse floor binds, short of the isolation goal" in short
    met = controller_line(base | {"isolation_goal_met": 1.0, "frequency_exponent_now": 0.25})
    assert met is not None and "isolation goal met" in met and "frequency exponent 0.250" in met
    assert "protection level +0.500" in met


def test_the_line_says_where_the_warm_up_started_the_level() -> None:
    base = dict.fromkeys(CONTROLLER_KEYS, 0.0) | {"protection_level": -0.25, "protected_budget": 100.0}
    base["isolation_goal"] = 0.9
    before = controller_line(base)  # (no start_level: before the first eviction, or a fixed share)
    assert before is not None and "started at" not in before
    top = controller_line(base | {"start_level": 1.0})
    bottom = controller_line(base | {"start_level": -1.0})
    assert top is not None and "protection level -0.250 (started at the top)," in top
    assert bottom is not None and "protection level -0.250 (started at the bottom)," in bottom
    assert controller_line(base | {"start_level": 0.0}) == before


def test_a_fixed_share_is_reported_as_one_not_as_a_controller_with_room(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # with no isolation goal the level never moves and no protected estimate is kept: the line said "the reuse
    # floor has room, no protected hits measured yet" and printed zeros for estimates nobody made
    argv = ["replay", "--sessions", "40", "--capacity-blocks", "60", "--no-progress", "--policy", "unified"]
    (uni,) = _json_lines(capsys, [*argv, "--json", "--isolation-goal", "none"])
    stats = uni["policy_stats"]
    assert isinstance(stats, dict) and stats["isolation_goal"] == 0.0
    (adaptive,) = _json_lines(capsys, [*argv, "--json"])
    assert isinstance(adaptive["policy_stats"], dict) and adaptive["policy_stats"]["isolation_goal"] == 0.9
    assert main([*argv, "--isolation-goal", "0"]) == 0
    out = capsys.readouterr().out
    assert (
        "unified controller: fixed protected share, 57 of 57 blocks (no isolation goal, no reuse floor)"
        in out
    )
    assert "reuse floor has room" not in out and "frequency exponent" in out  # (the balance still measures)
    assert main([*argv, "--isolation-goal", "0", "--no-adapt-frequency"]) == 0
    lines = [
        line for line in capsys.readouterr().out.splitlines() if "controller" in line or "window" in line
    ]
    assert len(lines) == 1 and "fixed protected share" in lines[0]  # (nothing measured: no window line)
