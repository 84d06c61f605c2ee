"""Retention API: directive validation and its messages, RFC/TRT spellings, PriorityMapping, block plans."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvretain.core.retention import (
    DEFAULT_RETENTION_PRIORITY,
    BlockRetention,
    PriorityMapping,
    RetentionConfig,
    RetentionDirective,
    RetentionError,
    validate_directive_list,
)


def parse(*directives: object) -> RetentionConfig:
    return RetentionConfig.from_request_fields(directives)  # type: ignore[arg-type]


# ---------------------------------------------------------------- directive validation


def test_retention_error_is_a_value_error() -> None:
    assert issubclass(RetentionError, ValueError)


def test_valid_directives_are_sorted_by_start() -> None:
    cfg = parse({"start": 32, "end": None, "priority": 10}, {"start": 0, "end": 32, "priority": 90})
    assert [(d.start, d.end, d.priority) for d in cfg.directives] == [(0, 32, 90), (32, None, 10)]
    assert not cfg.is_default
    assert RetentionConfig().is_default


@pytest.mark.parametrize(
    ("directives", "pattern"),
    [
        # two ranges that overlap, in either order: both ranges and the fix are named
        (
            [{"start": 0, "end": 20, "priority": 80}, {"start": 10, "end": 30, "priority": 20}],
            r"overlap: \[0, 20\) and \[10, 30\); make the ranges disjoint",
        ),
        (
            [{"start": 10, "end": 30, "priority": 20}, {"start": 0, "end": 20, "priority": 80}],
            r"overlap: \[0, 20\) and \[10, 30\)",
        ),
        # an open-ended range overlaps anything after it
        (
            [{"start": 0, "end": None, "priority": 80}, {"start": 100, "end": 120, "priority": 20}],
            r"overlap: \[0, None\) and \[100, 120\)",
        ),
        # an overlap hidden behind a range in between (non-adjacent in input order)
        (
            [
                {"start": 0, "end": 100, "priority": 80},
                {"start": 200, "end": 300, "priority": 20},
                {"start": 50, "end": 60, "priority": 20},
            ],
            r"overlap: \[0, 100\) and \[50, 60\)",
        ),
    ],
)
def test_overlapping_ranges_are_rejected(directives: list[dict[str, object]], pattern: str) -> None:
    with pytest.raises(RetentionError, match=pattern):
        parse(*directives)


def test_touching_ranges_do_not_overlap() -> None:
    cfg = parse({"start": 0, "end": 16, "priority": 80}, {"start": 16, "end": 32, "priority": 20})
    assert len(cfg.directives) == 2


@pytest.mark.parametrize(
    ("priority", "pattern"),
    [
        (101, r"retention_directives\[1\]: priority 101 is out of range; use an integer in \[0, 100\]"),
        (-1, r"retention_directives\[1\]: priority -1 is out of range"),
        (
            50.0,
            r"retention_directives\[1\]: priority must be an integer in \[0, 100\], got 50.0; pass e\.g\.",
        ),
        ("80", r"retention_directives\[1\]: priority must be an integer .* got '80'"),
        (True, r"retention_directives\[1\]: priority must be an integer .* got True"),
        (None, r"retention_directives\[1\]: priority must be an integer .* got None"),
    ],
)
def test_bad_priority_names_the_directive_and_the_fix(priority: object, pattern: str) -> None:
    with pytest.raises(RetentionError, match=pattern):
        parse({"start": 0, "end": 16, "priority": 50}, {"start": 16, "end": 32, "priority": priority})


def test_priority_bounds_are_inclusive() -> None:
    cfg = parse({"start": 0, "end": 16, "priority": 0}, {"start": 16, "priority": 100})
    assert [d.priority for d in cfg.directives] == [0, 100]


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        (
            "duration_s",
            -1,
            r"retention_directives\[0\]: duration_s must be >= 0 seconds, got -1; use a non-neg",
        ),
        ("duration", -0.5, r"retention_directives\[0\]: duration must be >= 0 seconds, got -0\.5"),
        ("duration_s", math.nan, r"retention_directives\[0\]: duration_s must be >= 0 seconds, got nan"),
        (
            "duration_s",
            "30",
            r"retention_directives\[0\]: duration_s must be a number .* got '30'; pass e\.g\.",
        ),
        ("duration", True, r"retention_directives\[0\]: duration must be a number"),
        (
            "duration_ms",
            "5",
            r"retention_directives\[0\]: duration_ms must be a number of milliseconds .* got '5'",
        ),
        ("duration_ms", False, r"retention_directives\[0\]: duration_ms must be a number"),
        (
            "duration_ms",
            -1000,
            r"retention_directives\[0\]: duration_ms must be >= 0 milliseconds, got -1000;",
        ),
        (
            "duration_ms",
            math.nan,
            r"retention_directives\[0\]: duration_ms must be >= 0 milliseconds, got nan",
        ),
    ],
)
def test_bad_duration(field: str, value: object, pattern: str) -> None:
    with pytest.raises(RetentionError, match=pattern):
        parse({"start": 0, "end": 16, "priority": 50, field: value})


def test_zero_and_infinite_durations_are_valid() -> None:
    cfg = parse({"start": 0, "end": 16, "priority": 50, "duration_s": 0}, {"start": 16, "priority": 50})
    assert cfg.directives[0].duration_s == 0.0
    d = RetentionDirective(0, None, 50, math.inf)
    assert d.duration_s == math.inf


@pytest.mark.parametrize(
    ("raw", "pattern"),
    [
        (
            {"start": 20, "end": 10, "priority": 50},
            r"retention_directives\[0\]: start \(20\) must be before end \(10\)",
        ),
        (
            {"start": 10, "end": 10, "priority": 50},
            r"start \(10\) must be before end \(10\); use end > start",
        ),
        (
            {"start": -1, "end": 10, "priority": 50},
            r"retention_directives\[0\]: start must be a non-negative",
        ),
        ({"start": 1.5, "end": 10, "priority": 50}, r"start must be a non-negative token index, got 1\.5"),
        (
            {"start": 0, "end": "10", "priority": 50},
            r"retention_directives\[0\]: end must be a token index or null",
        ),
        ({"start": 0, "end": True, "priority": 50}, r"end must be a token index or null, got True"),
    ],
)
def test_bad_ranges(raw: dict[str, object], pattern: str) -> None:
    with pytest.raises(RetentionError, match=pattern):
        parse(raw)


def test_unknown_fields_are_listed_with_the_allowed_ones() -> None:
    with pytest.raises(
        RetentionError,
        match=r"retention_directives\[2\]: unknown field\(s\) \['prio', 'ttl'\]; allowed: start, end, priority",
    ):
        parse(
            {"start": 0, "end": 1, "priority": 1},
            {"start": 1, "end": 2, "priority": 1},
            {"start": 2, "prio": 5, "ttl": 3},
        )


def test_missing_priority() -> None:
    with pytest.raises(
        RetentionError, match=r"retention_directives\[0\]: missing field 'priority' \(an integer"
    ):
        parse({"start": 0, "end": 16})


def test_directive_must_be_an_object_and_the_list_a_list() -> None:
    with pytest.raises(RetentionError, match=r"retention_directives\[1\]: expected an object"):
        parse({"start": 0, "priority": 1}, [0, 16, 50])
    with pytest.raises(RetentionError, match="retention_directives must be a list of objects"):
        RetentionConfig.from_request_fields("0:16:50")  # type: ignore[arg-type]
    with pytest.raises(RetentionError, match="retention_directives must be a list of objects"):
        RetentionConfig.from_request_fields(42)  # type: ignore[arg-type]
    # one directive where a list of them goes: its keys were read as directives ("got 'start'"), and an empty
    # object passed as no directives at all (RetentionConfig itself refuses a mapping)
    for one in ({"start": 0, "end": 16, "priority": 90}, {}):
        with pytest.raises(RetentionError, match="retention_directives must be a list of objects"):
            RetentionConfig.from_request_fields(one)  # type: ignore[arg-type]


def test_direct_construction_errors_say_retention_directive() -> None:
    with pytest.raises(RetentionError, match=r"^retention directive: priority 200 is out of range"):
        RetentionDirective(0, None, 200)


def test_config_level_errors() -> None:
    with pytest.raises(RetentionError, match=r"decode_priority: priority 101 is out of range"):
        RetentionConfig(decode_priority=101)
    with pytest.raises(RetentionError, match=r"retention config: decode_duration_s must be >= 0"):
        RetentionConfig(decode_duration_s=-3)
    with pytest.raises(RetentionError, match=r"retention_scope must be a string, got 7"):
        RetentionConfig(scope=7)  # type: ignore[arg-type]
    cfg = RetentionConfig.from_request_fields(
        None, scope="session-1", decode_priority=90, decode_duration_s=5
    )
    assert (cfg.scope, cfg.decode_priority, cfg.decode_duration_s) == ("session-1", 90, 5.0)
    assert not cfg.is_default


def test_an_empty_scope_is_refused_as_the_trace_loader_and_the_access_limits_refuse_it() -> None:
    # an empty owner id made every request that sent one the owner of the others' levels (each could lower what
    # another set); a trace line's empty retention_scope and an API key's empty scope were already refused
    with pytest.raises(RetentionError, match=r"retention_scope must be a non-empty string.*omit it"):
        RetentionConfig(scope="")
    with pytest.raises(RetentionError, match=r"retention_scope must be a non-empty string"):
        RetentionConfig.from_request_fields([{"start": 0, "priority": 80}], scope="")
    assert RetentionConfig(scope=" s ").scope == " s "


# ---------------------------------------------------------------- spellings


def test_rfc_spelling_duration_seconds() -> None:
    (d,) = validate_directive_list([{"start": 0, "end": 64, "priority": 90, "duration": 30}])
    assert (d.start, d.end, d.priority, d.duration_s) == (0, 64, 90, 30.0)


def test_kvretain_spelling_duration_s() -> None:
    (d,) = validate_directive_list([{"start": 0, "end": None, "priority": 90, "duration_s": 2.5}])
    assert (d.end, d.duration_s) == (None, 2.5)


def test_trt_spelling_token_range_and_milliseconds() -> None:
    (d,) = validate_directive_list(
        [{"token_start": 16, "token_end": 48, "priority": 70, "duration_ms": 1500}]
    )
    assert (d.start, d.end, d.priority, d.duration_s) == (16, 48, 70, 1.5)
    (d,) = validate_directive_list(
        [{"token_start": 16, "token_end": None, "priority": 70, "duration_ms": None}]
    )
    assert (d.start, d.end, d.duration_s) == (16, None, None)


@pytest.mark.parametrize(
    ("raw", "pattern"),
    [
        (
            {"token_start": 20, "token_end": 10, "priority": 50},
            r": token_start \(20\) must be before token_end \(10\)",
        ),
        ({"start": 20, "token_end": 10, "priority": 50}, r": start \(20\) must be before token_end \(10\)"),
        ({"token_start": 20, "end": 10, "priority": 50}, r": token_start \(20\) must be before end \(10\)"),
    ],
)
def test_empty_range_names_the_fields_as_spelt(raw: dict[str, object], pattern: str) -> None:
    # TensorRT-LLM's spellings are named as the client gave them, both ends of the range (token_end was
    # named 'end' when the range was empty)
    with pytest.raises(RetentionError, match=pattern):
        parse(raw)


def test_start_defaults_to_zero_and_end_to_open() -> None:
    (d,) = validate_directive_list([{"priority": 60}])
    assert (d.start, d.end, d.duration_s) == (0, None, None)


def test_covers() -> None:
    d = RetentionDirective(16, 32, 50)
    assert d.covers(0, 17) and d.covers(31, 48) and d.covers(16, 32)
    assert not d.covers(0, 16) and not d.covers(32, 48)
    assert RetentionDirective(16, None, 50).covers(1000, 1016)


# ---------------------------------------------------------------- PriorityMapping


@pytest.mark.parametrize(
    ("request_priority", "retention"),
    [(0, 35), (1, 25), (2, 15), (3, 5), (4, 0), (100, 0), (-1, 45), (-6, 95), (-7, 100), (-1000, 100)],
)
def test_default_mapping_is_linear_and_clamped(request_priority: int, retention: int) -> None:
    assert PriorityMapping().retention_for(request_priority) == retention


def test_mapping_with_another_normal_class() -> None:
    m = PriorityMapping(normal=1, step=10)
    assert [m.retention_for(p) for p in (0, 1, 2)] == [45, 35, 25]
    flat = PriorityMapping(step=0, base=50)
    assert [flat.retention_for(p) for p in (-5, 0, 5)] == [50, 50, 50]


def test_mapping_table_overrides_the_formula() -> None:
    m = PriorityMapping(table=((0, 80), (1, 35)))
    assert [m.retention_for(p) for p in (0, 1, 2, -1)] == [80, 35, 15, 45]


def test_parse_key_value_spec() -> None:
    m = PriorityMapping.parse("normal=1,step=10")
    assert (m.normal, m.step, m.base, m.table) == (1, 10, DEFAULT_RETENTION_PRIORITY, ())
    assert PriorityMapping.parse(" normal = 2 , base=50 ") == PriorityMapping(normal=2, base=50)
    assert PriorityMapping.parse("") == PriorityMapping()
    assert PriorityMapping.parse("   ") == PriorityMapping()


def test_parse_table_spec() -> None:
    m = PriorityMapping.parse("0:80,1:35")
    assert m.table == ((0, 80), (1, 35))
    assert [m.retention_for(p) for p in (0, 1)] == [80, 35]
    assert PriorityMapping.parse("-1:100, 2:0").table == ((-1, 100), (2, 0))


def test_a_table_and_the_formula_in_one_spec() -> None:
    # a table alone leaves the priorities it does not list to the default formula: 0:80,1:35,2:10 mapped -1 (more
    # important than 0) to 45, below 0's 80, and no spec could change that ("normal=1,0:80" was refused)
    alone = PriorityMapping.parse("0:80,1:35,2:10")
    assert [alone.retention_for(p) for p in (-1, 0, 1, 2, 3)] == [45, 80, 35, 10, 5]
    both = PriorityMapping.parse("0:80,1:35,2:10,normal=1,step=35,base=35")
    assert both == PriorityMapping(normal=1, step=35, base=35, table=((0, 80), (1, 35), (2, 10)))
    assert [both.retention_for(p) for p in (-1, 0, 1, 2, 3)] == [100, 80, 35, 10, 0]
    assert PriorityMapping.parse("step=0, base=20, 0:90") == PriorityMapping(
        step=0, base=20, table=((0, 90),)
    )


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        ("speed=3", r"priority mapping key 'speed': use normal=, step=, base= or a table entry"),
        ("normal=x", r"priority mapping normal='x': expected an integer"),
        ("normal=1.5", r"priority mapping normal='1\.5': expected an integer"),
        ("step=-1", r"step must be >= 0"),
        ("base=101", r"priority mapping base: priority 101 is out of range"),
        ("0:80,1", r"priority mapping key '1': use .* a table entry 'request_priority:retention_priority'"),
        ("0:eighty", r"priority mapping entry '0:eighty'"),
        ("0:101", r"table entry for request priority 0: priority 101 is out of range"),
    ],
)
def test_parse_bad_specs(spec: str, pattern: str) -> None:
    with pytest.raises(RetentionError, match=pattern):
        PriorityMapping.parse(spec)


# ---------------------------------------------------------------- block_plan

BS = 16


def test_plan_without_directives_is_the_mapped_priority_forever() -> None:
    assert RetentionConfig().block_plan(4, BS, 64, 25) == ([25, 25, 25, 25], [None] * 4)


def test_plan_directive_covers_its_blocks() -> None:
    cfg = parse({"start": 16, "end": 48, "priority": 90, "duration": 30})
    # tokens 16..47 are blocks 1 and 2; blocks 0 and 3 keep the mapped priority
    assert cfg.block_plan(4, BS, 64, 35) == ([35, 90, 90, 35], [None, 30.0, 30.0, None])


def test_plan_partial_coverage_counts_the_block() -> None:
    cfg = parse({"start": 20, "end": 21, "priority": 70})
    assert cfg.block_plan(3, BS, 48, 35)[0] == [35, 70, 35]


def test_plan_open_ended_directive_runs_to_the_end_of_the_prompt() -> None:
    cfg = parse({"start": 32, "priority": 60, "duration_ms": 2000})
    assert cfg.block_plan(4, BS, 64, 35) == ([35, 35, 60, 60], [None, None, 2.0, 2.0])


def test_plan_lower_directive_replaces_mapped_priority() -> None:
    cfg = parse({"start": 0, "end": 16, "priority": 5})
    assert cfg.block_plan(2, BS, 32, 45)[0] == [5, 45]


@pytest.mark.parametrize(("first", "second"), [(80, 20), (20, 80)])
def test_plan_block_straddling_two_directives_takes_the_higher(first: int, second: int) -> None:
    cfg = parse(
        {"start": 0, "end": 24, "priority": first, "duration": 1},
        {"start": 24, "end": 64, "priority": second, "duration": 2},
    )
    prios, durs = cfg.block_plan(4, BS, 64, 35)
    # block 1 holds tokens 16..31: 16..23 from the first directive, 24..31 from the second
    assert prios == [first, max(first, second), second, second]
    assert durs[1] == (1.0 if first > second else 2.0)


def test_plan_straddle_tie_takes_the_longer_duration() -> None:
    cfg = parse(
        {"start": 0, "end": 24, "priority": 60, "duration": 5},
        {"start": 24, "end": 40, "priority": 60},
        {"start": 40, "end": 48, "priority": 60, "duration": 9},
    )
    _, durs = cfg.block_plan(3, BS, 48, 35)
    # block 1 (16..31): 5 s vs forever -> forever; block 2 (32..47): forever vs 9 s -> forever
    assert durs == [5.0, None, None]
    cfg2 = parse(
        {"start": 0, "end": 24, "priority": 60, "duration": 5}, {"start": 24, "priority": 60, "duration": 9}
    )
    assert cfg2.block_plan(2, BS, 32, 35)[1] == [5.0, 9.0]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 30),
            st.integers(1, 40),
            st.integers(0, 100),
            st.one_of(st.none(), st.sampled_from([1.0, 5.0, 9.0])),
        ),
        max_size=4,
    ),
    st.booleans(),
    st.integers(0, 6),
    st.integers(1, 100),
)
def test_plan_each_prompt_block_takes_its_highest_directive(
    spans: list[tuple[int, int, int, float | None]], open_end: bool, num_blocks: int, prompt: int
) -> None:
    """Against a per-block reading of the rule: a prompt block overlapped by directives (disjoint token ranges,
    several may share a block) takes the highest priority among them, on a tie the longest duration (None:
    forever); any other block the mapped one and no duration."""
    ranges: list[tuple[int, int | None, int, float | None]] = []
    at = 0
    for gap, n, p, d in spans:
        ranges.append((at + gap, at + gap + n, p, d))
        at += gap + n
    if open_end and ranges:
        ranges[-1] = (ranges[-1][0], None, ranges[-1][2], ranges[-1][3])
    directives = [{"start": a, "end": e, "priority": p, "duration": d} for a, e, p, d in ranges]
    prios, durs = parse(*directives).block_plan(num_blocks, BS, prompt, 35)
    for i in range(num_blocks):
        lo, hi = i * BS, min((i + 1) * BS, prompt)  # the block's prompt tokens
        over = [
            (p, math.inf if d is None else d)
            for a, e, p, d in ranges
            if lo < hi and a < hi and (e is None or e > lo)
        ]
        best = max(over) if over else (35, math.inf)
        assert (prios[i], math.inf if durs[i] is None else durs[i]) == best, (i, ranges)


def test_plan_decode_blocks_take_the_decode_priority() -> None:
    cfg = RetentionConfig.from_request_fields(
        [{"start": 0, "priority": 90}], decode_priority=10, decode_duration_s=4
    )
    # prompt of 40 tokens: blocks 0..2 (block 2 holds prompt tokens 32..39 and generated ones), 3..4 decode
    assert cfg.block_plan(5, BS, 40, 35) == ([90, 90, 90, 10, 10], [None, None, None, 4.0, 4.0])


def test_a_decode_priority_alone_needs_a_plan() -> None:
    # the generated tokens' blocks ask the decode priority, not the mapped one: releases must resolve a plan
    cfg = RetentionConfig(decode_priority=10)
    assert cfg.needs_plan
    assert cfg.block_plan(3, 16, 20, 35) == ([35, 35, 10], [None, None, None])
    assert not RetentionConfig(decode_duration_s=5.0).needs_plan  # the mapped priority for a while: no plan


def test_plan_decode_defaults_to_the_mapped_priority() -> None:
    cfg = RetentionConfig.from_request_fields([{"start": 0, "end": 16, "priority": 90}])
    assert cfg.block_plan(4, BS, 32, 25) == ([90, 25, 25, 25], [None] * 4)


def test_plan_ignores_directives_beyond_the_prompt() -> None:
    cfg = parse({"start": 100, "end": 200, "priority": 90})
    assert cfg.block_plan(3, BS, 48, 35)[0] == [35, 35, 35]


@pytest.mark.parametrize("raw", [{"start": 40, "priority": 90}, {"start": 44, "end": 47, "priority": 90}])
def test_plan_ignores_a_directive_past_a_prompt_that_ends_inside_a_block(raw: dict[str, Any]) -> None:
    # a 40-token prompt ends inside block 2 (tokens 32..47): a range from token 40 on covers no prompt token, so it
    # leaves block 2 at the mapped priority (and its generated tokens to the decode priority's rules)
    assert parse(raw).block_plan(4, BS, 40, 35) == ([35, 35, 35, 35], [None] * 4)


def test_plan_with_fewer_blocks_than_the_prompt() -> None:
    cfg = parse({"start": 0, "priority": 90})
    assert cfg.block_plan(2, BS, 64, 35)[0] == [90, 90]
    assert cfg.block_plan(0, BS, 64, 35) == ([], [])


# ---------------------------------------------------------------- BlockRetention (what a release asks for)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        # -1 is the rules' UNSET (unified read it as the weight of 100); 150 indexed past the weights
        (
            {"priorities": [50, -1], "durations": [None, None]},
            r"priorities\[1\]: priority -1 is out of range",
        ),
        ({"priorities": [150], "durations": [None]}, r"priorities\[0\]: priority 150 is out of range"),
        (
            {"priorities": [50, 50.5], "durations": [None, None]},
            r"priorities\[1\]: priority must be an integer",
        ),
        ({"priorities": ["80"], "durations": [None]}, r"priorities\[0\]: priority must be an integer"),
        # a NaN duration never lapsed
        ({"priorities": [80, 80], "durations": [None, math.nan]}, r"durations\[1\] must be >= 0 seconds"),
        ({"priorities": [80], "durations": [-1.0]}, r"durations\[0\] must be >= 0 seconds"),
        ({"priorities": [80], "durations": ["5"]}, r"durations\[0\] must be a number of seconds or null"),
        ({"priorities": [80], "durations": [[5]]}, r"durations\[0\] must be a number of seconds or null"),
        ({"base_priority": -1}, r"BlockRetention: base_priority: priority -1 is out of range"),
        ({"base_priority": 101}, r"BlockRetention: base_priority: priority 101 is out of range"),
        ({"base_priority": 35.0}, r"base_priority: priority must be an integer .* base_priority=80"),
    ],
)
def test_block_retention_refuses_what_the_rules_cannot_rank(kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(RetentionError, match=pattern):
        BlockRetention(**kwargs)


def test_block_retention_accepts_the_whole_range() -> None:
    empty = BlockRetention()
    assert (empty.priorities, empty.durations, empty.base_priority) == ((), (), DEFAULT_RETENTION_PRIORITY)
    edges = BlockRetention(
        [0, 100, 35], [None, 0.0, math.inf], "s", -3, 0
    )  # inf: no expiry, as a directive's
    assert (edges.priorities, edges.durations) == ((0, 100, 35), (None, 0.0, math.inf))
    assert (edges.scope, edges.request_priority, edges.base_priority) == ("s", -3, 0)
    top = BlockRetention([100] * 3, [1, 2.5, None], None, 0, 100)  # an int duration is seconds too
    assert (top.priorities, top.durations, top.base_priority) == ((100, 100, 100), (1, 2.5, None), 100)
    # durations left out beside priorities: no expiry for each block (stored, one per priority)
    assert BlockRetention([0, 100]).durations == (None, None)


_WINDOW = range(-400, 401)  # (wide enough: a formula's threshold is within 20 + 100 of 0 here)


@settings(max_examples=400, deadline=None)
@given(
    normal=st.integers(-20, 20),
    step=st.integers(0, 5),
    base=st.integers(0, 100),
    table=st.dictionaries(st.integers(-30, 30), st.integers(0, 100), max_size=4),
    cap=st.integers(0, 100),
    at_least=st.none() | st.integers(-30, 30),
    prio=st.integers(-40, 40),
)
def test_the_priority_a_retention_cap_allows_is_the_brute_force_one(
    normal: int, step: int, base: int, table: dict[int, int], cap: int, at_least: int | None, prio: int
) -> None:
    # the access limits walked 256 priorities up from 0: a mapping whose threshold lies beyond (normal=300) or
    # below 0 (README's table 0:80,1:35,2:10 with a cap of 50 allows -1) was refused
    m = PriorityMapping(normal=normal, step=step, base=base, table=tuple(table.items()))
    ok = [p for p in _WINDOW if m.retention_for(p) <= cap and (at_least is None or p >= at_least)]
    try:
        got = m.most_important_within(cap, at_least)
    except RetentionError:
        assert not ok
    else:
        if got is None:  # every priority below the table and the window is within
            assert at_least is None and all(
                m.retention_for(p) <= cap for p in range(-400, min(table, default=0))
            )
        else:
            assert ok and got == ok[0]
    try:
        near = m.nearest_within(cap, prio, at_least)
    except RetentionError:
        assert not ok
    else:
        lo = prio if at_least is None else max(prio, at_least)
        best = min(ok, key=lambda p: (abs(p - lo), -p))  # nearest; the less important one on a tie
        assert near == best


def test_readmes_table_with_a_cap_allows_the_formula_below_it() -> None:
    m = PriorityMapping.parse("0:80,1:35,2:10")
    assert m.most_important_within(50) == -1  # (-1 maps to 45 by the formula; 0 is the table's 80)
    assert m.nearest_within(50, 0) == 1  # (0 maps to 80: the nearest within is 1, less important on the tie)
    assert PriorityMapping(normal=300, step=1).most_important_within(10) == 325
    with pytest.raises(RetentionError, match="no request priority maps"):
        PriorityMapping(step=0).most_important_within(30)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"decode_priority": "80"}, "pass e.g. decode_priority=80"),
        ({"decode_duration_s": "5"}, "pass e.g. decode_duration_s=30"),
    ],
)
def test_decode_field_errors_name_the_decode_field(fields: dict[str, Any], says: str) -> None:
    # the examples named a directive's fields (priority=80, duration_s=30), which this call does not take
    with pytest.raises(RetentionError, match=re.escape(says)):
        RetentionConfig(**fields)
