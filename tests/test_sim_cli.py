"""``kvretain simulate`` / ``kvretain compare``: JSON shape, table, trace input, report folder, errors."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest

from kvretain.cli import main

KEYS = {
    "policy",
    "requests",
    "simulated_s",
    "wall_s",
    "output_tokens_per_s",
    "request_throughput_rps",
    "hit_rate",
}
KEYS |= {"recomputed_tokens", "preemptions", "classes"}
CLASS_KEYS = {"requests", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "e2e_mean_s", "e2e_p99_s"}
CLASS_KEYS |= {"hit_rate", "recomputed_tokens", "preemptions", "slo_attainment", "request_throughput_rps"}
SMALL = ["--limit", "60", "--kv-blocks", "2000", "--no-progress"]


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(["simulate", *argv, "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    obj = json.loads(out[0])
    assert isinstance(obj, dict)
    return obj


def test_simulate_json_shape_and_determinism(capsys: pytest.CaptureFixture[str]) -> None:
    a = run_json(capsys, "--policy", "lru", *SMALL)
    assert set(a) >= KEYS and a["policy"] == "lru" and a["requests"] == 60
    classes = a["classes"]
    assert isinstance(classes, dict) and set(classes) <= {"0", "1", "2"}
    for c in classes.values():
        assert set(c) >= CLASS_KEYS
    b = run_json(capsys, "--policy", "lru", *SMALL)
    a.pop("wall_s")
    b.pop("wall_s")
    assert a == b


def test_simulate_front_end_times(capsys: pytest.CaptureFixture[str]) -> None:
    base = run_json(capsys, "--policy", "lru", "--open-loop", *SMALL)
    fe = run_json(
        capsys,
        "--policy",
        "lru",
        "--open-loop",
        "--frontend-in-s",
        "0.01",
        "--frontend-out-s",
        "0.005",
        *SMALL,
    )
    for c, got in fe["classes"].items():  # type: ignore[union-attr]
        # open loop and the same spacing of arrivals: the engine runs the same steps 10 ms later
        assert got["ttft_p50_s"] == pytest.approx(base["classes"][c]["ttft_p50_s"] + 0.015)  # type: ignore[index]
        assert got["tpot_p50_s"] == pytest.approx(base["classes"][c]["tpot_p50_s"])  # type: ignore[index]
    assert main(["simulate", "--frontend-in-s", "-1", *SMALL]) == 2
    assert "--frontend-in-s" in capsys.readouterr().err


def test_simulate_table_and_trace_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "policy unified" in out and "ttft_p99_s" in out
    lines = [
        {
            "timestamp": i * 500,
            "input_length": 1600,
            "output_length": 20,
            "hash_ids": [0, i % 3, 10 + i, 50 + i],
        }
        for i in range(12)
    ]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    obj = run_json(capsys, str(trace), "--priority-rule", "reference", "--replicas", "2", "--no-progress")
    assert obj["requests"] == 12 and set(obj["classes"]) == {"0", "1"}  # type: ignore[arg-type]


def test_compare_writes_a_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rep"
    argv = ["compare", *SMALL, "--policies", "lru,unified", "--budgets", "0.3,0.8", "--out", str(out)]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [r["label"] for r in summary] == ["lru", "unified", "unified-b0.3", "unified-b0.8"]
    assert all(set(r) >= KEYS for r in summary)
    assert (out / "runs.csv").read_text().count("\n") == 5
    assert "| run |" in (out / "summary.md").read_text()
    assert (out / "ttft_by_class.png").stat().st_size > 0 and (out / "frontier.png").stat().st_size > 0
    capsys.readouterr()


def test_simulate_and_compare_report_request_throughput(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # vLLM bench serve's "Request throughput (req/s)": finished requests over the span output_tokens_per_s
    # divides by; in --json, the table's first lines, and compare's runs.csv and summary.md
    obj = run_json(capsys, "--policy", "lru", *SMALL)
    rps = obj["request_throughput_rps"]
    assert isinstance(rps, float) and rps > 0
    assert math.isclose(rps, obj["requests"] / obj["simulated_s"], rel_tol=1e-5)  # type: ignore[operator]
    assert main(["simulate", "--policy", "lru", *SMALL]) == 0
    assert f" tok/s, {rps:.2f} req/s; hit rate" in capsys.readouterr().out
    out = tmp_path / "rep"
    assert main(["compare", *SMALL, "--policies", "lru", "--budgets", "0.5", "--out", str(out)]) == 0
    capsys.readouterr()
    rows = list(csv.DictReader((out / "runs.csv").open()))
    summary = json.loads((out / "summary.json").read_text())
    assert [float(r["request_throughput_rps"]) for r in rows] == [
        r["request_throughput_rps"] for r in summary
    ]
    md = (out / "summary.md").read_text()
    assert "| run | out tok/s | req/s | hit |" in md
    assert (
        f"| lru | {summary[0]['output_tokens_per_s']:.0f} | {summary[0]['request_throughput_rps']:.2f} |"
        in md
    )


def test_compare_labels_budgets_that_print_alike_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 0.1234567 and 0.1234568 are two budgets (two runs), both labelled unified-b0.123457 (six digits): two rows
    # of one name in every table, and no telling which was which
    out = tmp_path / "rep"
    argv = ["compare", "--limit", "5", "--kv-blocks", "400", "--no-progress", "--policies", "lru"]
    assert main([*argv, "--budgets", "0.1234567,0.1234568,0.5", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    labels = ["lru", "unified-b0.1234567", "unified-b0.1234568", "unified-b0.5"]
    assert [r["label"] for r in summary] == labels
    assert [r["budget"] for r in summary[1:]] == [0.1234567, 0.1234568, 0.5]
    assert [line.split(",")[0] for line in (out / "runs.csv").read_text().splitlines()[1:]] == labels
    md = (out / "summary.md").read_text()
    assert all(f"| {label} |" in md for label in labels)
    capsys.readouterr()


def test_bad_input_gives_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--model", "gpt-9", *SMALL]) == 2
    assert "unknown model 'gpt-9'" in capsys.readouterr().err
    bad = tmp_path / "x.txt"
    bad.write_text("")
    assert main(["simulate", str(bad)]) == 2
    assert "--workload" in capsys.readouterr().err
    assert main(["simulate", "--slo", "0=fast", *SMALL]) == 2
    assert "ttft_s:tpot_s" in capsys.readouterr().err


def test_policy_settings_pass_through_and_simulation_defaults() -> None:
    from kvretain.cli import build_parser
    from kvretain.cli_sim import SIM_POLICY_DEFAULTS, sim_config

    args = build_parser().parse_args(["simulate"])
    pc = sim_config(args, "unified").policy_config
    # one set of defaults: core's PolicyConfig, as replay and the plugin use it (issue 10, deliverable 6)
    from kvretain.core.policy import PolicyConfig

    assert pc == SIM_POLICY_DEFAULTS == PolicyConfig(block_size=16)
    argv = "simulate --protect-threshold 50 --cost-scale-tokens 28000 --isolation-goal 0"
    argv += " --priority-weight 2 --budget 0.5 --priority-mapping 0:60,1:35,2:10"
    args = build_parser().parse_args(argv.split())
    cfg = sim_config(args, "unified")
    pc = cfg.policy_config
    assert (pc.protect_threshold, pc.cost_scale_tokens, pc.isolation_goal) == (50, 28000.0, None)
    assert (pc.priority_weight, pc.budget) == (2.0, 0.5)
    assert [cfg.mapping.retention_for(p) for p in (0, 1, 2)] == [60, 35, 10]


def test_simulate_reports_rejected_requests_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    # issue 11, defect 2: `--kv-blocks 1` ended in an uncaught RuntimeError without a summary
    obj = run_json(capsys, "--limit", "5", "--kv-blocks", "1", "--no-progress")
    assert obj["requests"] == 0 and obj["rejected"] == 5
    rejections = obj["rejections"]
    assert isinstance(rejections, list) and len(rejections) == 5
    assert all("but the replica has only 1" in r["reason"] for r in rejections)
    assert main(["simulate", "--limit", "5", "--kv-blocks", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "rejected at admission: 5 requests (the first 3; --json lists all)" in out
    assert out.count("but the replica has only 1") == 3


def test_simulate_max_model_len_cuts_outputs_and_rejects_long_prompts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # --max-model-len N: a request ends holding N tokens, a prompt of N or more is rejected (vLLM 0.33); without
    # it, the same run as before the option existed
    base = run_json(capsys, "--policy", "lru", *SMALL)
    # (no request reaches it; 32,000 tokens: what SMALL's 2,000 blocks of 16 hold)
    none = run_json(capsys, "--policy", "lru", *SMALL, "--max-model-len", "32000")
    for obj in (base, none):
        obj.pop("wall_s")
    assert none == base and base["rejected"] == 0
    cut = run_json(capsys, "--policy", "lru", *SMALL, "--max-model-len", "2000")
    rejections = cut["rejections"]
    assert isinstance(rejections, list) and cut["rejected"] == len(rejections) > 0
    assert all("prompt tokens reach max_model_len (2,000)" in r["reason"] for r in rejections)
    assert cut["requests"] + cut["rejected"] == 60
    assert cut["output_tokens"] < base["output_tokens"]  # type: ignore[operator]
    assert "--max-model-len N" in _help(capsys, "compare")
    text = " ".join(_help(capsys, "simulate").split())
    assert "vLLM's default: the model's context length; kvretain's default: unbounded" in text


@pytest.mark.parametrize(
    ("argv", "pool"),
    [
        (
            ["simulate", "--kv-blocks", "100", "--max-model-len", "1601"],
            r"\(--kv-blocks\) has 100: .* is 1,600 ",
        ),
        (
            ["simulate", "--max-model-len", "100000000"],
            r"\(from the cost model: --model, --gpu, --tp and --gpu-mem-util\) has [\d,]+: ",
        ),
        (["compare", "--kv-blocks", "10", "--max-model-len", "161"], r"\(--kv-blocks\) has 10: .* is 160 "),
        (  # (compare's own pool, sized on the protected requests' working set once the workload is read)
            ["compare", "--limit", "200", "--max-model-len", "100000"],
            r"\(compare's, the peak working set of the protected requests; pass --kv-blocks to choose\) has ",
        ),
    ],
)
def test_a_max_model_len_the_kv_cache_cannot_hold_is_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], pool: str
) -> None:
    # vLLM 0.33 refuses to start when its KV cache cannot hold one request of max_model_len tokens: so do simulate
    # and compare, before any run, naming the option, the pool and the largest max_model_len it holds
    out = tmp_path / "rep"
    extra = ["--out", str(out)] if argv[0] == "compare" else []
    limit = [] if "--limit" in argv else ["--limit", "5"]
    assert main([*argv, *limit, "--no-progress", *extra]) == 2
    got, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert got == "" and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"kvretain {argv[0]}: error: argument --max-model-len: one request of "), (
        lines[0]
    )
    assert re.search(pool, lines[0]) and "the largest max_model_len it holds is" in lines[0], lines[0]
    assert lines[0].endswith(
        "(vLLM refuses to start with a KV cache that cannot hold one request of max_model_len tokens)"
    )
    assert not out.exists()


def test_a_max_model_len_the_kv_cache_just_holds_runs(capsys: pytest.CaptureFixture[str]) -> None:
    # 100 blocks of 16 tokens hold 1,600: vLLM starts, and so does simulate (1,601 is refused above)
    obj = run_json(capsys, "--kv-blocks", "100", "--max-model-len", "1600", "--limit", "5", "--no-progress")
    assert obj["requests"] + obj["rejected"] == 5  # type: ignore[operator]


def _help(capsys: pytest.CaptureFixture[str], command: str) -> str:
    assert main([command, "--help"]) == 0
    return capsys.readouterr().out


def test_simulate_lists_three_rejected_requests_whole(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--limit", "3", "--kv-blocks", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "rejected at admission: 3 requests\n" in out and "the first 3" not in out
    assert out.count("but the replica has only 1") == 3


@pytest.mark.parametrize("command", ["simulate", "compare"])
def test_a_result_json_cannot_hold_is_one_line_not_invalid_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    # --json printed `Infinity` (not JSON) when a time overflowed; whatever the bounds on the inputs leave, a
    # non-finite number is refused by name: nothing on stdout, no report folder
    from kvretain.engine.sim.simulator import Simulation

    summary = Simulation.summary

    def overflowed(self: Simulation) -> dict[str, object]:
        obj = summary(self)
        obj["ttft_mean_s"] = float("inf")
        return obj

    monkeypatch.setattr(Simulation, "summary", overflowed)
    rep = tmp_path / "rep"
    argv = ["simulate", "--json"] if command == "simulate" else ["compare", "--budgets", "0.5"]
    argv += [] if command == "simulate" else ["--out", str(rep)]
    assert main([*argv, "--limit", "5", "--kv-blocks", "200", "--no-progress"]) == 2
    out, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]  # compare says first what it runs
    assert out == "" and err.count("\n") == (1 if command == "simulate" else 2) and "Traceback" not in err
    where = "ttft_mean_s" if command == "simulate" else "0.ttft_mean_s"  # compare: a list of runs
    assert last.endswith(f"error: cannot write the results as JSON: {where} is inf (not a finite number)")
    assert not rep.exists()


def test_simulate_and_compare_read_a_trace_exported_with_block_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the reader's error said "see --block-tokens", but only replay had that option
    trace = tmp_path / "bt16.jsonl"
    argv = ["workload", "export", "multi-tenant", "--out", str(trace), "--block-tokens", "16", "--limit", "5"]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(["simulate", str(trace), "--no-progress"]) == 2
    assert "(one per 512-token block; see --block-tokens)" in capsys.readouterr().err
    obj = run_json(capsys, str(trace), "--block-tokens", "16", "--kv-blocks", "2000", "--no-progress")
    assert obj["requests"] == 5
    rep = tmp_path / "rep"
    argv = ["compare", str(trace), "--block-tokens", "16", "--policies", "lru", "--budgets", "0.5"]
    assert main([*argv, "--kv-blocks", "2000", "--no-progress", "--out", str(rep)]) == 0
    assert [r["requests"] for r in json.loads((rep / "summary.json").read_text())] == [5, 5]
    capsys.readouterr()
    # a workload without hash ids: the option would be ignored, so it is refused
    assert main(["simulate", "--block-tokens", "16", "--limit", "5", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --block-tokens: tokens per hash id of a Mooncake trace" in err


def test_a_class_without_a_figure_gets_no_bar_not_a_zero() -> None:
    # a class whose requests were all rejected has no mean TTFT: its bar was drawn at 0, the best ratio of the
    # chart; now there is none (NaN), and a reference without the figure leaves the whole class without bars
    from kvretain.cli_sim import _bar_values

    lru = {"label": "lru", "classes": {"0": {"ttft_mean_s": 2.0}, "1": {"ttft_mean_s": None}}}
    uni = {"label": "unified", "classes": {"0": {"ttft_mean_s": None}, "1": {"ttft_mean_s": 1.0}}}
    rel = _bar_values([lru, uni], lru, "0", "ttft_mean_s")
    assert rel[0] == 1.0 and math.isnan(rel[1])
    assert all(math.isnan(v) for v in _bar_values([lru, uni], lru, "1", "ttft_mean_s"))
    assert _bar_values([lru, uni], None, "1", "ttft_mean_s")[1] == 1.0


def test_the_class_table_says_its_requests_are_the_finished_ones(capsys: pytest.CaptureFixture[str]) -> None:
    # the JSON's per-class "requests" counts finished requests (rejected ones apart); the table's header said
    # "requests", which read as every request sent (review 34)
    assert main(["simulate", "--policy", "lru", *SMALL]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(ln for ln in lines if ln.startswith("class"))
    assert header.split()[:3] == ["class", "finished", "rejected"]
    rows = [ln.split() for ln in lines[lines.index(header) + 2 :] if ln.strip()]
    assert sum(int(r[1]) for r in rows) == 60  # every request of the run finished, none rejected


def test_simulate_tells_a_gzip_mooncake_trace_by_its_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the trace reader reads .jsonl.gz; simulate's format guess knew .jsonl and .csv only (review 34)
    import gzip

    line = '{"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [1]}\n'
    trace = tmp_path / "t.jsonl.gz"
    trace.write_bytes(gzip.compress((line * 3).encode()))
    assert main(["simulate", str(trace), "--kv-blocks", "200", "--no-progress", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 3
    assert main(["simulate", str(tmp_path / "t.csv.gz"), "--no-progress"]) == 2
    assert "cannot tell the trace format" in capsys.readouterr().err


def test_simulate_and_compare_do_not_offer_the_offline_oracle(capsys: pytest.CaptureFixture[str]) -> None:
    # `simulate --help` listed belady among --policy's choices, and every run of it was refused (an offline oracle,
    # replay only); typed, it is still refused with that reason, and replay still offers it
    for argv in (["simulate", "--help"], ["compare", "--help"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "belady" not in out, out
    assert main(["simulate", "--policy", "nope"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err and "'lru'" in err and "belady" not in err, err
    assert main(["compare", "--policies", "lru,nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown eviction policy 'nope'; choose from: arc, lfu, lru" in err and "belady" not in err, err
    for argv in (["simulate", "--policy", "belady"], ["compare", "--policies", "lru,belady"]):
        assert main([*argv, "--limit", "5", "--no-progress"]) == 2
        assert "policy 'belady' is an offline oracle" in capsys.readouterr().err
    assert main(["replay", "--help"]) == 0
    assert "belady" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "option", "said"),
    [
        (
            ["--max-model-len", "100", "--max-num-batched-tokens", "50", "--no-chunked-prefill"],
            "--max-num-batched-tokens",
            "max_num_batched_tokens (50) is smaller than max_model_len (100) without chunked prefill",
        ),
        (
            ["--max-model-len", "100", "--max-num-seqs", "300", "--max-num-batched-tokens", "256"],
            "--max-num-batched-tokens",
            "max_num_batched_tokens (256) must be at least max_num_seqs (300)",
        ),
    ],
)
@pytest.mark.parametrize("command", ["simulate", "compare"])
def test_vllms_budget_refusals_name_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, argv: list[str], option: str, said: str
) -> None:
    # SchedulerConfig refuses what vLLM's verify_max_model_len refuses; the line named max_num_batched_tokens,
    # the field, not the option (every other refusal of simulate and compare begins "argument --OPTION:")
    out = tmp_path / "rep"
    extra = ["--out", str(out)] if command == "compare" else []
    assert main([command, *argv, "--limit", "5", "--no-progress", *extra]) == 2
    got, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert got == "" and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"kvretain {command}: error: argument {option}: {said}"), lines[0]
    assert not out.exists()
