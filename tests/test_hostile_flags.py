"""Hostile flags and Python-API inputs (issue 11, defects 5-7): each gets its clear error.

CLI: one line on stderr naming the option, exit status 2, no traceback, nothing on stdout, no file written.
API: a ``ValueError`` (``RetentionError`` for the retention API) whose message names the field.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest

from kvretain.cli import main
from kvretain.core.hashing import BlockHasher, ExtraKeys
from kvretain.core.policy import PolicyConfig
from kvretain.core.retention import (
    PriorityMapping,
    RetentionConfig,
    RetentionDirective,
    RetentionError,
)

# (argv, what the one error line must contain): every case fails at parse time or in the checks that run
# before any simulation or replay.
CLI_CASES: list[tuple[str, str]] = [
    ("replay --priority-weight 0", "argument --priority-weight: must be a finite number >= 1"),
    ("replay --priority-weight -2", "argument --priority-weight: must be a finite number >= 1"),
    ("replay --priority-weight inf", "argument --priority-weight:"),
    ("replay --priority-weight nan", "argument --priority-weight:"),
    ("replay --frequency-exponent nan", "argument --frequency-exponent:"),
    ("replay --frequency-exponent -1", "argument --frequency-exponent:"),
    ("replay --cost-scale-tokens nan", "argument --cost-scale-tokens:"),
    ("replay --cost-scale-tokens 0.5", "argument --cost-scale-tokens: cost_scale_tokens must be"),
    ("replay --priority-weight 1e20", "argument --priority-weight/--frequency-exponent:"),
    ("replay --budget 1.5", "argument --budget: must be a finite number in [0, 1]"),
    ("replay --isolation-goal nan", "argument --isolation-goal:"),
    ("replay --block-tokens 0", "argument --block-tokens: must be an integer in [1, 65536]"),
    ("replay --block-tokens -1", "argument --block-tokens: must be an integer in [1, 65536]"),
    ("replay --capacity-blocks 0", "argument --capacity-blocks: must be an integer >= 1"),
    (
        "replay --capacity-blocks 1000000000000",
        "argument --capacity-blocks: 1,000,000,000,000 blocks need about",
    ),
    ("replay --sessions 0", "argument --sessions:"),
    ("replay --max-reuse-loss 1.5", "argument --max-reuse-loss: must be a finite number in [0, 1]"),
    ("replay --protect-threshold 101", "argument --protect-threshold: must be an integer in [0, 100]"),
    ("replay --frequency-cap 0", "argument --frequency-cap: must be an integer in [1, 65536]"),
    ("replay --frequency-cap 1e18", "argument --frequency-cap: must be an integer in [1, 65536]"),
    ("simulate --frequency-cap 65537", "argument --frequency-cap: must be an integer in [1, 65536]"),
    ("replay --ghost-factor -1", "argument --ghost-factor: must be a finite number in [0, 1000]"),
    ("simulate --max-reuse-loss nan", "argument --max-reuse-loss:"),
    ("simulate --frequency-cap 2.5", "argument --frequency-cap: expected an integer"),
    ("replay --priority-mapping step=1.5", "argument --priority-mapping: priority mapping step='1.5'"),
    ("simulate --priority-weight 0", "argument --priority-weight:"),
    ("simulate --priority-weight nan", "argument --priority-weight:"),
    ("simulate --frequency-exponent nan", "argument --frequency-exponent:"),
    ("simulate --cost-scale-tokens nan", "argument --cost-scale-tokens:"),
    ("simulate --protect-threshold 500", "argument --protect-threshold: must be an integer in [0, 100]"),
    ("simulate --protect-threshold -5", "argument --protect-threshold: must be an integer in [0, 100]"),
    ("simulate --kv-blocks 1e12", "argument --kv-blocks: 1,000,000,000,000 blocks need about"),
    ("simulate --kv-blocks 1000000000000", "argument --kv-blocks: 1,000,000,000,000 blocks need about"),
    ("simulate --kv-blocks 0", "argument --kv-blocks: must be an integer >= 1"),
    ("simulate --slo=", "argument --slo: expected 'class=ttft_s:tpot_s,...'"),
    ("simulate --slo 0=nan:0.1", "argument --slo: class 0: ttft_s must be > 0"),
    ("simulate --slo 0=2:-1", "argument --slo: class 0: tpot_s must be > 0"),
    ("simulate --frontend-out-s 1e308", "argument --frontend-out-s: must be a finite number in [0, 3600]"),
    ("compare --frontend-in-s 1e308", "argument --frontend-in-s: must be a finite number in [0, 3600]"),
    ("simulate --time-scale inf", "argument --time-scale: must be a finite number > 0"),
    ("simulate --time-scale 0", "argument --time-scale:"),
    ("simulate --gpu-mem-util 0", "argument --gpu-mem-util:"),
    ("simulate --gpu-mem-util 1.5", "argument --gpu-mem-util:"),
    ("simulate --replicas 0", "argument --replicas: must be an integer >= 1"),
    ("simulate --max-num-seqs 0", "argument --max-num-seqs:"),
    ("simulate --max-num-batched-tokens -8", "argument --max-num-batched-tokens:"),
    ("simulate --max-model-len 0", "argument --max-model-len: must be an integer >= 1, got 0"),
    ("simulate --max-model-len 1.5", "argument --max-model-len: expected an integer, got '1.5'"),
    ("compare --max-model-len nan", "argument --max-model-len: expected an integer, got 'nan'"),
    ("compare --max-model-len -4", "argument --max-model-len:"),
    ("simulate --block-size 0", "argument --block-size:"),
    ("simulate --block-size 1e9", "argument --block-size: must be an integer in [1, 65536]"),
    ("compare --block-size 1e9", "argument --block-size: must be an integer in [1, 65536]"),
    ("simulate --tp 0", "argument --tp:"),
    ("simulate --policy belady", "argument --policy: policy 'belady' is an offline oracle"),
    (
        "simulate --priority-mapping 0:80,0:10",
        "argument --priority-mapping: priority mapping: request priority 0",
    ),
    ("simulate --priority-mapping base=101", "argument --priority-mapping: priority mapping base"),
    ("compare --budgets abc", "argument --budgets: expected a number, got 'abc'"),
    ("compare --budgets=", "argument --budgets: expected comma-separated shares"),
    ("compare --budgets 0.2,1.5", "argument --budgets: must be a finite number in [0, 1]"),
    ("compare --budgets 0.2,0.2", "argument --budgets: a budget is listed twice"),
    ("compare --policies lru,bogus", "argument --policies: unknown eviction policy 'bogus'"),
    ("compare --policies lru,lru", "argument --policies: eviction policy listed twice"),
    ("compare --policies=", "argument --policies: expected at least one eviction policy"),
    ("compare --policies=,", "argument --policies: expected at least one eviction policy"),
    ("compare --policies belady", "argument --policies: policy 'belady' is an offline oracle"),
    ("compare --priority-weight -2", "argument --priority-weight:"),
]


@pytest.mark.parametrize(("argv", "expected"), CLI_CASES, ids=[a for a, _ in CLI_CASES])
def test_hostile_flag_gets_one_clear_line(
    argv: str,
    expected: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    from kvretain.engine.sim.simulator import Simulation

    def no_run(*a: object, **k: object) -> None:
        raise AssertionError("a run started before the bad option was rejected")

    monkeypatch.setattr(Simulation, "run", no_run)
    args = argv.split()
    if args[0] == "compare":
        args += ["--out", str(tmp_path / "rep")]
    assert main([*args, "--no-progress"] if args[0] != "replay" else args) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1, err
    assert lines[0].startswith(f"kvretain {args[0]}: error: ") and expected in lines[0], lines[0]
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # no report folder, no partial file


def test_replay_and_simulate_take_every_setting_an_operator_moves() -> None:
    # one option set (cli_args.add_policy_options) for replay, simulate and compare: the controller's two
    # constraints (isolation goal, reuse loss) can be loosened from every command, as from the plugin's
    # KVRETAIN_POLICY_OPTIONS, and the same flags give the same PolicyConfig
    from kvretain.cli import build_parser
    from kvretain.cli_args import policy_config
    from kvretain.cli_sim import SIM_POLICY_DEFAULTS

    flags = [
        "--budget", "0.5", "--isolation-goal", "0.8", "--max-reuse-loss", "0.1", "--protect-threshold", "60",
        "--priority-weight", "3", "--frequency-exponent", "0.5", "--frequency-cap", "8", "--no-adapt-frequency",
        "--cost-scale-tokens", "4096", "--ghost-factor", "2",
    ]  # fmt: skip
    want = PolicyConfig(
        budget=0.5,
        isolation_goal=0.8,
        max_reuse_loss=0.1,
        protect_threshold=60,
        priority_weight=3.0,
        frequency_exponent=0.5,
        frequency_cap=8,
        adapt_frequency=False,
        cost_scale_tokens=4096.0,
        ghost_factor=2.0,
        block_size=16,
    )
    for command in ("replay", "simulate", "compare"):
        args = build_parser(command).parse_args([command, *flags])
        assert policy_config(args, SIM_POLICY_DEFAULTS, 16) == want, command
        defaults = build_parser(command).parse_args([command])
        assert policy_config(defaults, PolicyConfig(), 16) == PolicyConfig(block_size=16), command


def test_no_isolation_goal_is_spelt_alike_on_every_form() -> None:
    # the command line said `--isolation-goal 0` and refused `none`; the plugin said `isolation_goal=none` and
    # refused 0: each spelling now means the fixed share on every form
    from kvretain.cli import build_parser
    from kvretain.cli_args import policy_config
    from kvretain.integrations.vllm.config import parse_options

    fixed = PolicyConfig(isolation_goal=None, block_size=16)
    for command in ("replay", "simulate", "compare"):
        for spelling in ("0", "none", "None"):
            args = build_parser(command).parse_args([command, "--isolation-goal", spelling])
            assert policy_config(args, PolicyConfig(), 16) == fixed, (command, spelling)
    for spelling in ("0", "none"):
        options = parse_options(f"isolation_goal={spelling}")
        assert PolicyConfig(block_size=16, **options) == fixed, spelling


def test_compare_rejects_a_bad_policy_before_any_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvretain.engine.sim.simulator import Simulation

    runs: list[object] = []
    real = Simulation.run

    def counted(self: Simulation, *a: object, **k: object) -> Simulation:
        runs.append(self)
        return real(self, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(Simulation, "run", counted)
    argv = [
        "compare",
        "--limit",
        "5",
        "--policies",
        "lru,bogus",
        "--out",
        str(tmp_path / "r"),
        "--no-progress",
    ]
    assert main(argv) == 2
    assert runs == [] and not (tmp_path / "r").exists()
    assert "--policies" in capsys.readouterr().err


# ---------------------------------------------------------------- Python API: PolicyConfig


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"priority_weight": 0.0}, "priority_weight"),
        ({"priority_weight": -2.0}, "priority_weight"),
        ({"priority_weight": math.inf}, "priority_weight"),
        ({"priority_weight": math.nan}, "priority_weight"),
        ({"priority_weight": 0.5}, "priority_weight"),
        ({"frequency_exponent": math.nan}, "frequency_exponent"),
        ({"frequency_exponent": -1.0}, "frequency_exponent"),
        ({"cost_scale_tokens": math.nan}, "cost_scale_tokens"),
        ({"cost_scale_tokens": math.inf}, "cost_scale_tokens"),
        ({"cost_scale_tokens": 1e-300}, "cost_scale_tokens"),
        ({"protect_threshold": 500}, "protect_threshold"),
        ({"protect_threshold": -5}, "protect_threshold"),
        ({"protect_threshold": 35.5}, "protect_threshold"),
        ({"budget": math.nan}, "budget"),
        ({"budget": "0.5"}, "budget"),
        ({"isolation_goal": math.nan}, "isolation_goal"),
        ({"max_reuse_loss": math.nan}, "max_reuse_loss"),
        ({"max_reuse_loss": math.inf}, "max_reuse_loss"),
        ({"max_reuse_loss": -0.1}, "max_reuse_loss"),
        ({"max_reuse_loss": 1.5}, "max_reuse_loss"),
        ({"max_reuse_loss": "0.1"}, "max_reuse_loss"),
        ({"ghost_factor": math.inf}, "ghost_factor"),
        ({"ghost_factor": math.nan}, "ghost_factor"),
        ({"frequency_cap": 0}, "frequency_cap"),
        ({"frequency_cap": 10**18}, "frequency_cap"),  # a list of 10^18 floats was built: a hang
        ({"frequency_cap": 65537}, "frequency_cap"),
        ({"block_size": 0}, "block_size"),
        ({"next_use": 3}, "next_use"),
        ({"priority_weight": 1e20}, "priority_weight"),
        ({"frequency_exponent": 200.0}, "frequency_exponent"),
    ],
)
def test_policy_config_rejects_hostile_values(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b|\b{field}\b"):
        PolicyConfig(**kwargs)  # type: ignore[arg-type]


def test_policy_config_edges_that_stay_valid() -> None:
    # each edge is accepted and kept as given (validation refuses or passes, it never clamps)
    cases: list[dict[str, float]] = [
        {"priority_weight": 1.0, "frequency_exponent": 0.0, "cost_scale_tokens": 0.0, "budget": 0.0},
        {"budget": 1, "protect_threshold": 0, "isolation_goal": 1.0, "cost_scale_tokens": 1.0},
        {"priority_weight": 8.0, "protect_threshold": 100},
        {"max_reuse_loss": 0.0},
        {"max_reuse_loss": 1},
        {"frequency_cap": 65536},
    ]
    for kwargs in cases:
        cfg = PolicyConfig(**kwargs)  # type: ignore[arg-type]
        assert {k: getattr(cfg, k) for k in kwargs} == kwargs


# ---------------------------------------------------------------- Python API: retention


def _directive(**fields: object) -> Callable[[], object]:
    return lambda: RetentionConfig.from_request_fields([fields])


API_CASES: list[tuple[str, Callable[[], object], str]] = [
    ("400-digit duration_s", _directive(priority=50, duration_s=10**400), r"duration_s 1000.* is too large"),
    ("400-digit duration", _directive(priority=50, duration=10**400), r"\bduration 1000.* is too large"),
    (
        "400-digit duration_ms",
        _directive(priority=50, duration_ms=10**400),
        r"duration_ms 1000.* is too large",
    ),
    (
        "400-digit priority",
        _directive(priority=10**400),
        r"priority 1000.*\(401 characters\) is out of range",
    ),
    (
        "mixed-type unknown keys",
        lambda: RetentionDirective.from_dict({"priority": 50, 1: "x", "ttl": 3}),  # type: ignore[dict-item]
        r"unknown field\(s\) \['ttl', 1\]",
    ),
    (
        "negative duration_ms",
        _directive(priority=50, duration_ms=-1),
        r"duration_ms must be >= 0 milliseconds, got -1;",
    ),
    (
        "NaN duration_ms",
        _directive(priority=50, duration_ms=math.nan),
        r"duration_ms must be >= 0 milliseconds, got nan",
    ),
    ("string duration", _directive(priority=50, duration="5"), r"\bduration must be a number of seconds"),
    (
        "start and token_start",
        _directive(priority=50, start=0, token_start=16),
        r"start and token_start are two",
    ),
    ("end and token_end", _directive(priority=50, end=16, token_end=32), r"end and token_end are two"),
    (
        "duration_s and duration_ms",
        _directive(priority=50, duration_s=1, duration_ms=1000),
        r"duration_s and duration_ms",
    ),
    (
        "duration and duration_s",
        _directive(priority=50, duration=1, duration_s=1),
        r"duration_s and duration are two",
    ),
    ("bad token_start named", _directive(priority=50, token_start=-1), r"token_start must be a non-negative"),
    (
        "PriorityMapping step 1.5",
        lambda: PriorityMapping(step=1.5),
        r"priority mapping: step must be an integer",
    ),  # type: ignore[arg-type]
    ("PriorityMapping step NaN", lambda: PriorityMapping(step=math.nan), r"step must be an integer"),  # type: ignore[arg-type]
    ("PriorityMapping normal NaN", lambda: PriorityMapping(normal=math.nan), r"normal must be an integer"),  # type: ignore[arg-type]
    (
        "PriorityMapping base 1.5",
        lambda: PriorityMapping(base=1.5),
        r"priority mapping base: priority must be an integer",
    ),  # type: ignore[arg-type]
    (
        "PriorityMapping table float",
        lambda: PriorityMapping(table=((0, 80.5),)),
        r"table entry for request priority 0",
    ),  # type: ignore[arg-type]
    ("PriorityMapping table not pairs", lambda: PriorityMapping(table=(1, 2)), r"table entry 1 must be a"),  # type: ignore[arg-type]
    (
        "PriorityMapping table twice",
        lambda: PriorityMapping(table=((0, 80), (0, 10))),
        r"request priority 0 appears twice",
    ),
    (
        "PriorityMapping.parse key twice",
        lambda: PriorityMapping.parse("step=0,step=10"),
        r"priority mapping key 'step' appears twice",
    ),
    (
        "PriorityMapping.parse(None)",
        lambda: PriorityMapping.parse(None),
        r"priority mapping must be a string",
    ),  # type: ignore[arg-type]
    ("PriorityMapping.parse(3)", lambda: PriorityMapping.parse(3), r"priority mapping must be a string"),  # type: ignore[arg-type]
    ("RetentionConfig of a string", lambda: RetentionConfig("abc"), r"retention directives must be a list"),  # type: ignore[arg-type]
    (
        "RetentionConfig of one dict",
        lambda: RetentionConfig({"priority": 50}),
        r"retention directives must be a list",
    ),  # type: ignore[arg-type]
    (
        "RetentionConfig of a bad dict",
        lambda: RetentionConfig([{"priority": 500}]),
        r"retention_directives\[0\]: priority 500",
    ),  # type: ignore[list-item]
    (
        "RetentionConfig of a number",
        lambda: RetentionConfig([7]),
        r"retention_directives\[0\]: expected an object",
    ),  # type: ignore[list-item]
    ("scope not a string", lambda: RetentionConfig(scope=["s"]), r"retention_scope must be a string"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("name", "call", "pattern"), API_CASES, ids=[c[0] for c in API_CASES])
def test_hostile_retention_input(name: str, call: Callable[[], object], pattern: str) -> None:
    with pytest.raises(RetentionError, match=pattern):
        call()


def test_retention_config_accepts_plain_dicts_as_directives() -> None:
    cfg = RetentionConfig(
        [{"start": 16, "priority": 90}, {"token_start": 0, "token_end": 16, "priority": 20}]
    )  # type: ignore[list-item]
    assert [(d.start, d.end, d.priority) for d in cfg.directives] == [(0, 16, 20), (16, None, 90)]
    assert cfg == RetentionConfig((RetentionDirective(0, 16, 20), RetentionDirective(16, None, 90)))


def test_huge_but_finite_durations_stay_valid() -> None:
    (d,) = RetentionConfig.from_request_fields([{"priority": 50, "duration_ms": 10**300}]).directives
    assert d.duration_s == pytest.approx(1e297)
    assert PriorityMapping(table=[(0, 80)]).retention_for(0) == 80  # type: ignore[arg-type]


# ---------------------------------------------------------------- Python API: hashing


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (lambda: ExtraKeys(cache_salt="x" * 65_535), r"cache_salt is 65,535 UTF-8 bytes; at most 65,511"),
        (lambda: ExtraKeys(cache_salt="é" * 40_000), r"cache_salt is 80,000 UTF-8 bytes"),
        (lambda: ExtraKeys(cache_salt="\ud800"), r"cache_salt is not valid Unicode"),
        (lambda: ExtraKeys(cache_salt=b"tenant"), r"cache_salt must be a string"),  # type: ignore[arg-type]
        (lambda: ExtraKeys(lora_id=2**64), r"lora_id must be a 64-bit integer"),
        (lambda: BlockHasher(2).hash_blocks([1, 2**63]), r"token id 9223372036854775808 does not fit"),
        (
            lambda: BlockHasher(2).hash_blocks([-(2**63) - 1, 0]),
            r"token id -9223372036854775809 does not fit",
        ),
        (lambda: BlockHasher(2).hash_blocks([1, "a"]), r"token ids must be integers, got str"),  # type: ignore[list-item]
        (lambda: BlockHasher(2).hash_block(None, [1, 2], b"x" * 70_000), r"extra keys are 70,000 bytes"),
    ],
)
def test_hostile_hash_input(call: Callable[[], object], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        call()


def test_largest_salt_and_token_ids_still_hash() -> None:
    h = BlockHasher(2)
    salt = ExtraKeys(cache_salt="s" * 65_511, lora_id=-(2**63))
    assert len(h.hash_blocks([-(2**63), 2**63 - 1], salt)) == 1


# ---------------------------------------------------------------- pool sizes that cannot fit (defect 6)
def test_pool_too_large_for_the_memory_available_is_refused_with_the_estimate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvretain.core.memory as memory

    per = memory.pool_bytes_per_block("unified")
    assert 50 < per < 5_000  # one slotted object per block, the policy's entries, the hash index
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 64 * 2**20)  # a 64 MiB machine
    memory.check_pool_fits(100_000, ["lru"], what="num_blocks")  # ~40 MB: fits
    with pytest.raises(
        memory.PoolTooLargeError, match=r"^--kv-blocks: 1,000,000 blocks x 2 replicas need about"
    ):
        memory.check_pool_fits(1_000_000, ["lru", "unified"], what="--kv-blocks", pools=2)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: None)  # the system does not say: no check
    memory.check_pool_fits(10**12, ["lru"])


def test_pool_check_counts_every_pool_and_the_most_demanding_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvretain.core.memory as memory

    per_block = {"lru": 10.0, "unified": 100.0}
    monkeypatch.setattr(memory, "pool_bytes_per_block", lambda p, config=None: per_block[p])
    n = 10_000
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: int(50 * n))
    memory.check_pool_fits(n, ["lru"], pools=4)  # 4 x 10 bytes a block: fits in 50
    with pytest.raises(memory.PoolTooLargeError, match="100 bytes per block under 'unified'"):
        memory.check_pool_fits(n, ["lru", "unified"])  # priced at the larger of the two
    with pytest.raises(memory.PoolTooLargeError, match=r"10,000 blocks x 6 replicas"):
        memory.check_pool_fits(n, ["lru"], pools=6)  # 60 bytes a block in all
    # with the setting of the number of pools named: it is what the message names when one pool fits
    with pytest.raises(
        memory.PoolTooLargeError,
        match=r"^--jobs: 10,000 blocks x 6 processes need .*; use fewer processes$",
    ):
        memory.check_pool_fits(
            n, ["lru"], what="--blocks", pools=6, pools_are="processes", pools_what="--jobs"
        )
    with pytest.raises(
        memory.PoolTooLargeError, match=r"^--blocks: 10,000 blocks x 6 processes .*fewer blocks$"
    ):
        memory.check_pool_fits(
            n, ["unified"], what="--blocks", pools=6, pools_are="processes", pools_what="--jobs"
        )
    # pools below the measured sample one by one still add up past it
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 1)
    memory.check_pool_fits(memory.SAMPLE_BLOCKS, ["lru"])
    with pytest.raises(memory.PoolTooLargeError):
        memory.check_pool_fits(memory.SAMPLE_BLOCKS, ["lru"], pools=2)


def test_available_memory_is_known_here() -> None:
    from kvretain.core.memory import available_memory_bytes

    avail = available_memory_bytes()
    if Path("/proc/meminfo").exists():  # Linux says: a number of bytes, never None
        assert isinstance(avail, int) and avail > 0
    else:
        assert avail is None or avail > 0


def test_available_memory_is_meminfo_capped_by_the_cgroup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from kvretain.core import memory

    root = tmp_path / "root"
    monkeypatch.setattr(memory, "Path", lambda p: root / str(p).lstrip("/"))  # /proc, /sys under tmp_path

    def files(**text: str) -> None:
        for name, body in text.items():
            path = root / {"meminfo": "proc/meminfo", "limit": "sys/fs/cgroup/memory.max"}.get(
                name, "sys/fs/cgroup/memory.current"
            )
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body)

    files(meminfo="MemTotal:       8000 kB\nMemFree:  10 kB\nMemAvailable:   2048 kB\n")
    assert memory.available_memory_bytes() == 2048 * 1024  # kB are KiB
    files(limit="1000000\n", current="400000\n")
    assert memory.available_memory_bytes() == 600_000  # the cgroup leaves less than the machine
    files(limit="max\n")  # no cgroup limit: the machine's figure
    assert memory.available_memory_bytes() == 2048 * 1024
    files(limit="9000000\n")
    assert memory.available_memory_bytes() == 2048 * 1024  # the machine leaves less than the cgroup
    (root / "proc" / "meminfo").unlink()

    def no_sysconf(name: str) -> int:
        raise ValueError(name)

    monkeypatch.setattr(os, "sysconf", no_sysconf)
    assert memory.available_memory_bytes() == 9_000_000 - 400_000  # only the cgroup says
    files(limit="max\n")
    assert memory.available_memory_bytes() is None  # nothing says
