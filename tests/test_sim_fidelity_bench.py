"""bench/sim_fidelity.py's pure parts: the workload generator, the figures and ratios, the JSON last line (no
server: the real side is made here from the simulator's own records, scaled by known factors)."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest

from kvretain.engine.sim.profiled import Profile, StepCoefficients, load_profile, write_profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import sim_fidelity as sf

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "sim_fidelity.py"
SMALL = sf.WorkloadSpec(seed=3, sessions=3, turns=3, one_shot=6, horizon_s=60.0, think_s=2.0)


def test_workload_is_deterministic_in_its_seed() -> None:
    a, b = sf.make_workload(SMALL), sf.make_workload(SMALL)
    assert [w.request_id for w in a] == [w.request_id for w in b]
    assert [w.prompt.materialize() for w in a] == [w.prompt.materialize() for w in b]
    c = sf.make_workload(replace(SMALL, seed=4))
    assert [w.prompt.materialize() for w in a] != [w.prompt.materialize() for w in c]


def test_scaling_to_a_utilization_changes_times_only(tmp_path: Path) -> None:
    path = tmp_path / "cost.toml"
    write_profile(path, Profile(StepCoefficients(0.004, 2e-5, 1e-9, 1e-4)))
    limits = sf.Limits(blocks=64)
    lo = sf.scale_to_utilization(SMALL, limits, str(path), 0.01)
    hi = sf.scale_to_utilization(SMALL, limits, str(path), 0.02)
    assert SMALL.turns * (SMALL.think_s + 1) < hi.horizon_s < lo.horizon_s and replace(
        lo, horizon_s=0
    ) == replace(hi, horizon_s=0)
    a, b = sf.make_workload(lo), sf.make_workload(hi)
    assert sorted(w.prompt.materialize() for w in a) == sorted(w.prompt.materialize() for w in b)


def test_workload_shape() -> None:
    ws = sf.make_workload(SMALL)
    assert len(ws) == SMALL.requests == 3 * 3 + 6
    assert [w.arrival_s for w in ws] == sorted(w.arrival_s for w in ws)
    by_id = {w.request_id: w for w in ws}
    bs = SMALL.block_size
    c0 = [w for w in ws if w.priority == 0]
    c1 = [w for w in ws if w.priority == 1]
    assert len(c0) == 9 and len(c1) == 6
    system = c0[0].prompt.materialize()[: SMALL.system_blocks * bs]
    for w in ws:
        toks = w.prompt.materialize()
        assert all(sf.TOKEN_LO <= t < sf.TOKEN_HI for t in toks)
        assert w.output_len == SMALL.max_tokens[w.priority]
        if w.priority == 0:
            assert toks[: len(system)] == system  # one system prompt for every session
            assert len(toks) % bs == 0  # every piece of a session's prompt is whole blocks
        if w.after is not None:  # a later turn: the previous prompt, an answer, a question
            prev = by_id[w.after].prompt.materialize()
            assert toks[: len(prev)] == prev and len(toks) > len(prev) + SMALL.answer_blocks * bs
            assert SMALL.think_s * 0.5 <= w.think_s <= SMALL.think_s * 1.5
            assert w.session_id == by_id[w.after].session_id
    prefix = c1[0].prompt.materialize()[: SMALL.prefix_blocks * bs]
    assert all(w.prompt.materialize()[: len(prefix)] == prefix for w in c1)
    lo, hi = SMALL.document_tokens
    assert all(lo <= w.prompt_len - len(prefix) <= hi for w in c1)


def rec(rid: str, cls: int, ttft: float, tpot: float, prompt: int = 100, cached: int = 0) -> sf.Record:
    return sf.Record(rid, cls, ttft, tpot, ttft + 15 * tpot, prompt, cached, 16)


def test_figures_by_class() -> None:
    recs = [rec(f"a{i}", 0, t, 0.01 * (i + 1), cached=50) for i, t in enumerate([1.0, 2.0, 3.0, 4.0, 5.0])]
    recs.append(rec("b", 1, 9.0, 0.02, prompt=300, cached=30))
    f = sf.figures(recs)
    assert f[0].requests == 5 and f[0].ttft_p50 == 3.0 and f[0].ttft_p90 == pytest.approx(4.6)
    assert f[0].tpot_p50 == pytest.approx(0.03) and f[0].hit_ratio == 0.5
    assert f[0].e2e_mean == pytest.approx(3.0 + 15 * 0.03)
    assert f[1].hit_ratio == pytest.approx(0.1) and f[1].ttft_p50 == 9.0


def fig(ttft: float, tpot: float, hit: float) -> sf.ClassFigures:
    return sf.ClassFigures(10, ttft, ttft * 2, tpot, ttft + 1, hit)


def test_compare_finds_the_worst_cells_and_the_signs() -> None:
    real = {
        "lru": {0: fig(1.0, 0.02, 0.2), 1: fig(2.0, 0.02, 0.1)},
        "unified": {0: fig(0.5, 0.02, 0.5), 1: fig(3.0, 0.02, 0.05)},
    }
    sim = {
        "lru": {0: fig(1.1, 0.025, 0.21), 1: fig(1.0, 0.021, 0.1)},
        "unified": {0: fig(0.6, 0.02, 0.44), 1: fig(3.3, 0.019, 0.05)},
    }
    s = sf.compare(real, sim).summary
    assert s["ttft_p50_worst_ratio"] == 0.5 and s["ttft_p50_worst_at"] == "lru class 1"
    assert s["tpot_p50_worst_ratio"] == 1.25 and s["tpot_p50_worst_at"] == "lru class 0"
    assert (
        s["hit_ratio_worst_abs_diff"] == pytest.approx(0.06) and s["hit_ratio_worst_at"] == "unified class 0"
    )
    assert s["sign_agreement"] is True and s["class0_signs"]["ttft_p50"] == {"real": -1, "sim": -1}
    assert s["ttft_within_20pct"] == 3 and s["tpot_within_20pct"] == 3 and s["cells"] == 4
    assert s["acceptance"] is False
    flipped = dict(sim, unified={0: fig(1.2, 0.02, 0.44), 1: sim["unified"][1]})
    assert sf.compare(real, flipped).summary["sign_agreement"] is False


def test_the_simulator_side_and_the_json_last_line(tmp_path: Path) -> None:
    """The whole script with a saved "real" side: the simulator's own records with TTFT x2 and TPOT x0.5."""
    cost = tmp_path / "cost.toml"
    write_profile(cost, Profile(StepCoefficients(0.004, 2e-5, 1e-9, 1e-4)))
    limits = sf.Limits(blocks=64)
    ws = sf.make_workload(SMALL)
    sim = {p: sf.run_sim(ws, limits, p, str(cost)) for p in sf.POLICIES}
    for recs in sim.values():
        assert len(recs) == len(ws)
        assert all(
            r.prompt_tokens >= r.cached_tokens >= 0 and r.output_tokens == SMALL.max_tokens[r.cls]
            for r in recs
        )
        assert any(r.cached_tokens > 0 for r in recs if r.cls == 0)  # the shared system prompt hits
    real = {
        p: [asdict(replace(r, ttft=2 * r.ttft, tpot=None if r.tpot is None else r.tpot / 2)) for r in recs]
        for p, recs in sim.items()
    }
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"real_records": real, "spec": asdict(SMALL)}))  # the run's workload
    args = ["--real", str(saved), "--cost-model", str(cost), "--out", str(tmp_path / "out"), "--blocks", "64"]
    got = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    last = json.loads(got.stdout.strip().splitlines()[-1])
    assert last["ttft_p50_worst_ratio"] == 0.5 and last["tpot_p50_worst_ratio"] == 2.0
    assert last["hit_ratio_worst_abs_diff"] == 0.0 and last["requests"] == len(ws)
    assert last["acceptance"] is False and math.isfinite(last["wall_s"])
    assert "sim/real" in got.stdout


def test_sim_only_prints_a_table_with_units(tmp_path: Path) -> None:
    """``--sim-only``: the simulated figures per policy and class as a table whose columns name their units (it
    printed raw dicts of seconds)."""
    cost = tmp_path / "cost.toml"
    write_profile(cost, Profile(StepCoefficients(0.004, 2e-5, 1e-9, 1e-4)))
    small = ["--sessions", "2", "--turns", "2", "--one-shot", "4", "--utilization", "0", "--horizon-s", "20"]
    args = ["--sim-only", "--cost-model", str(cost), "--out", str(tmp_path / "out"), *small]
    got = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    lines = got.stdout.strip().splitlines()
    head = lines.index(next(line for line in lines if line.lstrip().startswith("policy")))
    cols = [
        "policy",
        "class",
        "requests",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "TPOT p50 ms",
        "e2e mean ms",
        "hit ratio",
    ]
    assert [c.strip() for c in lines[head].split("  ") if c.strip()] == cols
    rows = [line.split() for line in lines[head + 2 :]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (p, c, n) for p in sf.POLICIES for c, n in (("0", "4"), ("1", "4"))
    ]
    assert "{" not in got.stdout and "ClassFigures" not in got.stdout


# ---------------------------------------------------------------------------------------------- in-run fit
KNOWN = StepCoefficients(0.004, 2e-5, 1e-9, 1e-4)
BUSY = replace(SMALL, horizon_s=1.0, think_s=0.05)
"""Arrivals close enough together that steps batch requests (mixed prefill and decode steps)."""


def write_step_log(path: Path, steps: list[tuple[sf.Chunks, float]], idle_every: int = 7) -> None:
    """A server's step log of ``steps`` (chunks, seconds): back to back, with an idle wait of 1 s after every
    ``idle_every``-th step (``more`` false there) and a 0.1 ms busy-loop gap elsewhere, folded into the step
    before it."""
    t, lines = 100.0, []
    for i, (chunks, sec) in enumerate(steps):
        idle = i % idle_every == idle_every - 1
        work = sec if idle else sec - 1e-4  # a busy step's cycle: its own time plus the gap after it
        lines.append(
            json.dumps({"t0": t, "t1": t + work, "reqs": [list(c) for c in chunks], "more": not idle})
        )
        t += work + (1.0 if idle else 1e-4)
    path.write_text("\n".join(lines) + "\n")


def test_in_run_points_time_a_busy_step_to_the_next_one() -> None:
    from kvretain.integrations.vllm.steplog import parse_step_log

    recs = parse_step_log(
        [
            '{"t0": 1.0, "t1": 1.03, "reqs": [[1, 99, 1], [20, 0, 0]], "more": true}',
            '{"t0": 1.04, "t1": 1.06, "reqs": [[1, 100, 1]], "more": false}',
            '{"t0": 5.0, "t1": 5.02, "reqs": [[8, 0, 1]], "more": true}',
        ]
    )
    pts = sf.in_run_points(recs)
    assert [p.seconds for p in pts] == pytest.approx([0.04, 0.02, 0.02])  # to the next t0; then t1 - t0 twice
    assert [p.step_seconds for p in pts] == pytest.approx([0.03, 0.02, 0.02])
    assert (pts[0].tokens, pts[0].pairs, pts[0].sampled, pts[0].kind) == (21, 100 + 210, 1, "mixed")
    assert (pts[1].kind, pts[2].kind) == ("decode", "prefill")


def test_the_in_run_fit_recovers_known_coefficients(tmp_path: Path) -> None:
    """Steps the simulator schedules, priced by known coefficients, logged as a server would: the fit (the
    profile's own) gets the coefficients back and writes a cost-model file the simulator loads."""
    cost = tmp_path / "cost.toml"
    write_profile(cost, Profile(KNOWN))
    steps = sf.sim_steps(sf.make_workload(BUSY), sf.Limits(blocks=64), "lru", str(cost))
    assert len(steps) > 20 and any(len(ch) > 1 for ch, _ in steps)
    log = tmp_path / "steps-lru.jsonl"
    write_step_log(log, steps)
    path, prof = sf.fit_in_run([log], "lru", tmp_path)
    got = prof.coefficients
    for name in ("step_overhead_s", "per_token_s", "per_sequence_s"):
        assert getattr(got, name) == pytest.approx(getattr(KNOWN, name), rel=0.02), name
    assert prof.median_relative_error() == pytest.approx(0, abs=1e-3)
    assert load_profile(path).coefficients == got and len(load_profile(path).points) == len(steps)


def test_a_speed_scaled_profile_drops_the_unscaled_fit_s_leave_one_out_error(tmp_path: Path) -> None:
    # the leave-one-out error kvretain profile records is its fit's: the scaled file would have carried it over
    cost = tmp_path / "cost.toml"
    write_profile(cost, Profile(KNOWN, info={"model": "m", "loo_median_abs_rel_error": 0.05}))
    scaled = load_profile(sf.speed_scaled(str(cost), 1.5, tmp_path, "x"))
    assert scaled.info == {"model": "m", "speed_factor": 1.5}
    assert scaled.coefficients.per_token_s == pytest.approx(1.5 * KNOWN.per_token_s)


def test_stalled_steps_leave_the_fit_and_set_the_load_factor(tmp_path: Path) -> None:
    """Every 5th step 3x as long (another process got the core): the fit keeps the engine's coefficients and the
    one load factor makes the model's total busy time the run's."""
    cost = tmp_path / "cost.toml"
    write_profile(cost, Profile(KNOWN))
    steps = sf.sim_steps(sf.make_workload(BUSY), sf.Limits(blocks=64), "lru", str(cost))
    stalled = [(ch, t * (3.0 if i % 5 == 0 else 1.0)) for i, (ch, t) in enumerate(steps)]
    log = tmp_path / "steps-lru.jsonl"
    write_step_log(log, stalled, idle_every=10**9)
    _, prof = sf.fit_in_run([log], "lru", tmp_path)
    for name in ("step_overhead_s", "per_token_s", "per_sequence_s"):
        assert prof.info[f"fit_{name}"] == pytest.approx(getattr(KNOWN, name), rel=0.02), name
    busy = sum(t for _, t in stalled)
    assert prof.info["busy_s"] == pytest.approx(busy, rel=1e-3)  # the last step has no next one: 0.1 ms less
    assert prof.info["load_factor"] == pytest.approx(busy / sum(t for _, t in steps), rel=0.01)
    c = prof.coefficients
    assert sum(c.predict(p.tokens, p.pairs, p.sampled) for p in prof.points) == pytest.approx(busy, rel=1e-3)


def test_engine_tpots_from_the_logged_ids() -> None:
    from kvretain.integrations.vllm.steplog import StepRecord

    recs = [
        StepRecord(0.0, 0.1, ((20, 0, 1), (5, 0, 0)), True, ("a", "b")),
        StepRecord(0.1, 0.15, ((1, 20, 1), (5, 5, 1)), True, ("a", "b")),
        StepRecord(0.15, 0.3, ((1, 21, 1), (1, 10, 1)), True, ("a", "b")),
        StepRecord(0.3, 0.32, ((1, 11, 1),), False, ("b",)),
    ]
    assert sorted(sf.engine_tpots(recs)) == pytest.approx([0.085, 0.1])  # b: (0.32-0.15)/2; a: (0.3-0.1)/2
    # a's decode (steps 2-3) shares step 2 with b's prefill chunk; b's (steps 3-4) has none
    assert sf.interrupted_share([(r.ids, r.reqs) for r in recs]) == 0.5


def test_step_stats_count_prefill_and_decode() -> None:
    st = sf.step_stats([(((1, 10, 1), (1, 20, 1)), 0.01), (((1, 11, 1), (50, 0, 0)), 0.03)])
    assert st["steps"] == 2 and st["with_prefill"] == 1 and st["prefill_tokens_mean"] == 50
    assert st["decode_seqs_mean"] == 1.5 and st["decode_context_mean"] == pytest.approx(41 / 3)
    assert st["decode_step_ms_p50"] == pytest.approx(10) and st["prefill_step_ms_p50"] == pytest.approx(30)


def refit_saved_run(
    run: Path, real: dict[str, list[dict[str, Any]]], out: Path
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``--real RUN/results.json --calibrate in-run`` on a saved run of ``SMALL`` (its step logs in ``run``):
    the bench's output and its last JSON line."""
    saved = run / "results.json"
    saved.write_text(json.dumps({"real_records": real, "spec": asdict(SMALL)}))
    args = ["--real", str(saved), "--calibrate", "in-run", "--out", str(out), "--blocks", "64"]
    got = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    return got, json.loads(got.stdout.strip().splitlines()[-1])


def test_calibrate_in_run_cross_fits_from_saved_step_logs(tmp_path: Path) -> None:
    """``--real results.json --calibrate in-run``: the step logs next to the saved run are fitted and each
    policy is simulated with the other's fit; with "real" steps and records that are the simulator's own (same
    coefficients on both sides) every ratio is 1."""
    cost = tmp_path / "cost.toml"
    write_profile(cost, Profile(KNOWN))
    limits = sf.Limits(blocks=64)
    ws = sf.make_workload(SMALL)
    run = tmp_path / "run"
    run.mkdir()
    for p in sf.POLICIES:
        write_step_log(sf.step_log_path(run, p), sf.sim_steps(ws, limits, p, str(cost)))
    real = {p: [asdict(r) for r in sf.run_sim(ws, limits, p, str(cost))] for p in sf.POLICIES}
    got, last = refit_saved_run(run, real, tmp_path / "out")
    assert last["ttft_p50_worst_ratio"] == pytest.approx(1, abs=0.02)
    assert last["tpot_p50_worst_ratio"] == pytest.approx(1, abs=0.02)
    assert last["hit_ratio_worst_abs_diff"] <= 0.01 and last["acceptance"] is True
    assert last["own_fit"]["tpot_within_20pct"] == 4 and last["pooled_fit"]["acceptance"] is True
    # the other policy's fit, at this run's speed (the same here: 1x)
    assert last["cost_models"]["lru"].endswith("cost-model-inrun-unified-at-lru-speed.toml")
    assert load_profile(last["cost_models"]["lru"]).info["speed_factor"] == pytest.approx(1.0)
    assert last["steps"]["lru real"]["steps"] == last["steps"]["lru sim"]["steps"]
    assert "in-run fit of lru" in got.stdout and "decode seqs mean" in got.stdout


def test_the_cross_fit_carries_each_runs_speed(tmp_path: Path) -> None:
    """The host ran 1.5x slower during the stock run than during the plugin's (every step of it, decodes too):
    each policy is priced by the other run's model scaled by the ratio of the runs' decode-only step medians, so
    every ratio stays 1; the unscaled cross-fit (a diagnostic) prices each policy at the other run's speed and
    misses by the shift."""
    limits = sf.Limits(blocks=64)
    ws = sf.make_workload(SMALL)
    run = tmp_path / "run"
    run.mkdir()
    real = {}
    for p, coef in (("lru", StepCoefficients(*(1.5 * c for c in KNOWN.as_tuple()))), ("unified", KNOWN)):
        cost = tmp_path / f"cost-{p}.toml"
        write_profile(cost, Profile(coef))
        write_step_log(sf.step_log_path(run, p), sf.sim_steps(ws, limits, p, str(cost)))
        real[p] = [asdict(r) for r in sf.run_sim(ws, limits, p, str(cost))]
    assert sf.decode_step_p50(sf.step_log_path(run, "lru")) == pytest.approx(
        1.5 * sf.decode_step_p50(sf.step_log_path(run, "unified")), rel=0.01
    )
    _, last = refit_saved_run(run, real, tmp_path / "out")
    assert last["ttft_p50_worst_ratio"] == pytest.approx(1, abs=0.03)
    assert last["tpot_p50_worst_ratio"] == pytest.approx(1, abs=0.03)
    assert last["acceptance"] is True
    assert load_profile(last["cost_models"]["lru"]).info["speed_factor"] == pytest.approx(1.5, rel=0.01)
    unscaled = last["cross_fit_unscaled"]
    assert unscaled["acceptance"] is False and not 0.8 <= unscaled["tpot_p50_worst_ratio"] <= 1.2


def test_load_over_time_is_each_window_busy_time_over_the_model(tmp_path: Path) -> None:
    """Warm-up steps skipped; a window whose steps ran 2x the model's price gets 2, a window at it gets 1."""
    coef = StepCoefficients(0.01, 0.0, 0.0, 0.0)  # every step 10 ms
    lines, t = [], 0.0
    for i in range(2 * sf.WARMUPS + 40):
        sec = 0.02 if i >= 2 * sf.WARMUPS + 20 else 0.01  # the last 20 steps stretched 2x
        lines.append(json.dumps({"t0": t, "t1": t + sec, "reqs": [[1, 5, 1]], "more": True}))
        t += sec
    log = tmp_path / "steps.jsonl"
    log.write_text("\n".join(lines))
    assert sf.load_over_time(log, Profile(coef), window_s=0.2) == pytest.approx([1.0, 2.0, 2.0])


def test_ttft_parts_match_the_client_and_the_engine_by_request_id() -> None:
    """The client's send time and the engine's steps on one clock: the part before the first schedule and the
    part up to the end of the step that sampled the first token, per class; unmatched requests left out."""
    from kvretain.integrations.vllm.steplog import StepRecord

    def rec(rid: str, cls: int, sent: float | None) -> sf.Record:
        return sf.Record(rid, cls, 0.5, 0.01, 0.6, 40, 0, 2, sent)

    steps = [
        StepRecord(10.0, 10.2, ((20, 0, 0),), True, ("cmpl-c0-s001-t0-0-ab12",)),
        StepRecord(
            10.2, 10.3, ((20, 20, 1), (8, 0, 1)), True, ("cmpl-c0-s001-t0-0-ab12", "cmpl-c1-007-0-ff")
        ),
        StepRecord(10.3, 10.35, ((1, 40, 1),), False, ("cmpl-c0-s001-t0-0-ab12",)),
    ]
    got = sf.ttft_parts(
        [rec("c0-s001-t0", 0, 9.9), rec("c1-007", 1, 10.05), rec("c1-008", 1, 10.0), rec("c0-x", 0, None)],
        steps,
    )
    assert set(got) == {0, 1} and len(got[0]) == 1 and len(got[1]) == 1
    assert got[0][0] == pytest.approx((0.1, 0.3)) and got[1][0] == pytest.approx((0.15, 0.1))


def test_frontend_times_from_idle_sends_and_every_first_token() -> None:
    """The way in: only requests sent while the engine was idle (its last step had ended with nothing left)
    count, so a wait for a step in flight is not taken for the front end's; the way back: every request's TTFT
    less the engine's time to the end of the step that sampled its first token."""
    from kvretain.integrations.vllm.steplog import StepRecord

    def rec(rid: str, ttft: float, sent: float | None) -> sf.Record:
        return sf.Record(rid, 0, ttft, 0.01, ttft + 0.1, 40, 0, 2, sent)

    steps = [
        StepRecord(5.0, 5.1, ((8, 0, 1),), False, ("cmpl-warm-0-aa",)),  # then idle until 10.0
        StepRecord(10.0, 10.2, ((20, 0, 1),), True, ("cmpl-a-0-ab12",)),  # a: sent 9.990, idle engine
        StepRecord(10.2, 10.25, ((1, 20, 1),), True, ("cmpl-a-0-ab12",)),
        StepRecord(10.25, 10.4, ((1, 21, 1), (30, 0, 1)), False, ("cmpl-a-0-ab12", "cmpl-b-0-cd")),
        StepRecord(11.0, 11.1, ((10, 0, 1),), False, ("cmpl-c-0-ef",)),  # c: sent 10.980, idle engine
    ]
    records = [
        rec("a", 10.2 - 9.990 + 0.003, 9.990),
        rec("b", 10.4 - 10.1 + 0.005, 10.1),  # sent during a's step: its 150 ms wait is not the front end's
        rec("c", 11.1 - 10.980 + 0.004, 10.980),
        rec("unsent", 0.2, None),
    ]
    fin, fout = sf.frontend_times(records, steps)  # type: ignore[misc]
    assert fin == pytest.approx(0.015)  # a 10 ms, c 20 ms (b left out)
    assert fout == pytest.approx(0.004)  # 3, 5, 4 ms
    assert sf.frontend_times([rec("b", 0.3, 10.1)], steps) is None  # no request found the engine idle
    # y found the engine idle but x, sent before it, reached the engine first: y waited behind x's step, which
    # is not the front end's time
    steps2 = [
        StepRecord(5.0, 5.1, ((8, 0, 1),), False, ("cmpl-warm-0-aa",)),
        StepRecord(9.995, 10.2, ((20, 0, 1),), False, ("cmpl-x-0-a1",)),
        StepRecord(10.2, 10.3, ((20, 0, 1),), False, ("cmpl-y-0-b2",)),
    ]
    fin, _ = sf.frontend_times([rec("x", 0.223, 9.980), rec("y", 0.313, 9.990)], steps2)  # type: ignore[misc]
    assert fin == pytest.approx(0.015)  # x alone


def test_simulated_ttft_parts_split_as_the_real_ones(tmp_path: Path) -> None:
    """With a front end, the simulated TTFT splits as a real one: send to the first schedule (at least the way
    in), then to the end of the first token's step; the way back is in neither part."""
    cost = tmp_path / "cost.toml"
    write_profile(cost, Profile(KNOWN))
    limits = sf.Limits(blocks=64, frontend_in_s=0.010, frontend_out_s=0.003)
    ws = sf.make_workload(SMALL)
    parts: dict[int, list[tuple[float, float]]] = {}
    sf.sim_steps(ws, limits, "lru", str(cost), parts=parts)
    ttfts = {r.request_id: r.ttft for r in sf.run_sim(ws, limits, "lru", str(cost))}
    flat = [p for ps in parts.values() for p in ps]
    assert len(flat) == len(ws) and all(before >= 0.010 - 1e-9 for before, _ in flat)
    assert sorted(b + e + 0.003 for b, e in flat) == pytest.approx(sorted(ttfts.values()))


def test_host_shift_is_the_ratio_of_the_runs_decode_medians_with_a_note_above_the_tolerance() -> None:
    shift, note = sf.host_shift_note({"lru": 28.03, "unified": 19.21})
    assert shift == pytest.approx(28.03 / 19.21) and note is not None and "1.46x" in note
    shift, note = sf.host_shift_note({"lru": 39.8, "unified": 38.5})
    assert shift == pytest.approx(39.8 / 38.5) and note is None
    assert sf.host_shift_note({"lru": 30.0}) == (None, None)


def test_median_difference_interval_resolves_a_shift_and_not_noise() -> None:
    rng = random.Random(1)
    ids = [f"r{i}" for i in range(120)]
    a = {i: 0.100 + rng.gauss(0, 0.02) for i in ids}
    same = {i: 0.100 + rng.gauss(0, 0.02) for i in ids}
    faster = {i: 0.070 + rng.gauss(0, 0.02) for i in ids}
    lo, hi = sf.median_difference_interval(a, same)
    assert lo < 0.0 < hi  # the same distribution: the interval holds 0
    lo, hi = sf.median_difference_interval(a, faster)
    assert -0.045 < lo < hi < -0.015  # 30 ms faster: resolved, and around the true difference
    assert sf.median_difference_interval(a, faster) == (lo, hi)  # seeded
    # only the requests both runs served count
    assert sf.median_difference_interval({**a, "extra": 9.0}, faster) == (lo, hi)


def test_median_difference_interval_pairs_the_requests() -> None:
    # each request's latency is mostly its own size (spread 0.05-0.5 s); the second run is 10 ms faster on each,
    # with 2 ms of jitter: as two independent samples the shift is lost in the spread of sizes, as pairs it is not
    rng = random.Random(2)
    size = {f"r{i}": rng.uniform(0.05, 0.5) for i in range(120)}
    a = {i: s + rng.gauss(0, 0.002) for i, s in size.items()}
    b = {i: s - 0.010 + rng.gauss(0, 0.002) for i, s in size.items()}
    lo, hi = sf.median_difference_interval(a, b)
    assert -0.020 < lo < hi < 0.0
    unpaired_b = dict(zip(a, rng.sample(list(b.values()), len(b)), strict=True))  # the same values, unpaired
    lo, hi = sf.median_difference_interval(a, unpaired_b)
    assert lo < 0.0 < hi


def test_busy_machine_note_only_above_one_runnable_process_per_cpu() -> None:
    assert sf.busy_machine_note([1.02, 1.47, 1.21], cpus=2) is None
    assert sf.busy_machine_note([], cpus=2) is None
    note = sf.busy_machine_note([7.1, 6.0, 5.5], cpus=2)
    assert note is not None and "7.10 on 2 CPUs" in note


def _fidelity_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scale: float = 1.6, spec: sf.WorkloadSpec = SMALL
) -> Any:
    """``plot``'s figure (kept open) for ``spec``'s simulated records, the "real" side their TTFT x ``scale``."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    cost = tmp_path / "cost.toml"
    write_profile(cost, Profile(StepCoefficients(0.004, 2e-5, 1e-9, 1e-4)))
    ws = sf.make_workload(spec)
    sim = {p: sf.run_sim(ws, sf.Limits(blocks=64), p, str(cost)) for p in sf.POLICIES}
    real = {p: [replace(r, ttft=r.ttft * scale) for r in recs] for p, recs in sim.items()}
    kept: list[Any] = []
    monkeypatch.setattr(plt, "close", kept.append)
    assert sf.plot(tmp_path / "ttft_cdf.png", real, sim)
    return kept[0]


def test_the_cdf_axis_reads_at_several_ticks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TTFTs of 5-16 ms (half a decade): the log axis, ticked at 1, 2 and 5 per decade, had one label, "10"."""
    fig = _fidelity_figure(tmp_path, monkeypatch)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        lo, hi = ax.get_xlim()
        assert hi / lo < 10  # (the span the defect needs)
        shown = [
            t.get_text()
            for t in ax.get_xticklabels() + ax.get_xticklabels(minor=True)
            if t.get_text() and lo <= t.get_position()[0] <= hi and t.get_window_extent(renderer).width > 0
        ]
        assert len(shown) >= 3, shown


def test_the_cdf_legend_covers_no_curve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The legend sat in each panel's lower right, where the slower side's CDF starts: it hid the real server's
    curve below 30% of requests (TTFT x1.6 against the simulator's)."""
    spec = replace(SMALL, sessions=6, turns=4, one_shot=20)
    fig = _fidelity_figure(tmp_path, monkeypatch, spec=spec)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [leg.get_window_extent(renderer) for ax in fig.axes if (leg := ax.get_legend()) is not None]
    boxes += [leg.get_window_extent(renderer) for leg in fig.legends]
    assert boxes
    for ax in fig.axes:
        for line in ax.get_lines():
            ends = ax.transData.transform(line.get_path().vertices)  # (the steps as drawn)
            pts = [a + (b - a) * k / 20 for a, b in zip(ends, ends[1:], strict=False) for k in range(21)]
            for box in boxes:
                inside = [p for p in pts if box.x0 <= p[0] <= box.x1 and box.y0 <= p[1] <= box.y1]
                assert not inside, (line.get_label(), len(inside))
    assert all("TTFT CDF" in ax.get_title() for ax in fig.axes)


def test_a_policy_that_ran_as_the_other_stays_visible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both policies with the same TTFTs (a pool that never fills): the plugin's orange curves, drawn on top at
    the same width, hid stock lru's blue ones; the legend listed curves the panels did not show."""
    fig = _fidelity_figure(tmp_path, monkeypatch)
    for ax in fig.axes:
        width = {ln.get_label(): ln.get_linewidth() for ln in ax.get_lines()}
        for side in ("real", "sim"):
            assert width[f"stock lru, {side}"] > width[f"plugin unified, {side}"], width


def test_the_cdf_png_is_written_whole_or_not_at_all(tmp_path: Path, savefig_fails_half_way: None) -> None:
    """savefig wrote straight into OUT/ttft_cdf.png: a full disk or a Ctrl-C half-way left a truncated PNG in place
    of the earlier run's."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "ttft_cdf.png").write_bytes(b"the earlier run's")
    cost = tmp_path / "cost.toml"
    write_profile(cost, Profile(StepCoefficients(0.004, 2e-5, 1e-9, 1e-4)))
    recs = {p: sf.run_sim(sf.make_workload(SMALL), sf.Limits(blocks=64), p, str(cost)) for p in sf.POLICIES}
    with pytest.raises(OSError):
        sf.plot(out / "ttft_cdf.png", recs, recs)
    assert (out / "ttft_cdf.png").read_bytes() == b"the earlier run's"
    assert [p.name for p in out.iterdir()] == ["ttft_cdf.png"]
