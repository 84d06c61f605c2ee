"""The profiled cost model: the fit recovers known coefficients, the TOML round trip, ``simulate --cost-model
FILE`` prices steps with it, and bad files or options fail on one line with status 2."""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import subprocess
import sys
import types
from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvretain.cli import main
from kvretain.engine.sim.catalog import builtin_catalog
from kvretain.engine.sim.costmodel import COST_MODELS, make_cost_model
from kvretain.engine.sim.profiled import (
    Profile,
    ProfiledCostModel,
    StepCoefficients,
    StepPoint,
    cross_validated_errors,
    dumps,
    fit,
    load_profile,
    loads,
    median_relative_error,
    relative_errors,
    step_point,
    write_profile,
)


def model_dir(tmp_path: Path) -> str:
    """A folder that ``kvretain profile --model`` takes (one holding a ``config.json``), for a fake engine."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return str(model)


def profile_argv(tmp_path: Path, python: str, *rest: str) -> list[str]:
    """``kvretain profile`` on :func:`model_dir`'s folder with the measuring ``python`` (a fake), then ``rest``."""
    return ["profile", "--model", model_dir(tmp_path), "--python", python, *rest]


TRUE = StepCoefficients(step_overhead_s=0.02, per_token_s=3e-5, per_pair_s=2e-9, per_sequence_s=4e-4)


def grid_points(coef: StepCoefficients, noise: float = 0.0, seed: int = 0) -> list[StepPoint]:
    """The profiler's grid (prefills after cached prefixes, decode batches), priced by ``coef``."""
    rng = random.Random(seed)
    shapes = []
    for p in (0, 256, 768):
        for n in (32, 128, 512, 1024):
            shapes.append(("prefill", n, n * p + n * (n + 1) // 2, 1))
    for c in (32, 256, 1024):
        for b in (1, 4, 16, 32):
            shapes.append(("decode", b, b * (c + 2), b))
    out = []
    for kind, t, pairs, s in shapes:
        sec = coef.predict(t, pairs, s) * (1 + rng.uniform(-noise, noise))
        out.append(StepPoint(t, pairs, s, sec, kind))
    return out


def point_event(p: StepPoint, step: float = 1.5, median: float = 2.0) -> dict[str, object]:
    """The measuring module's ``point`` event for ``p``: its engine-core step takes ``p.seconds`` (fastest),
    the whole step ``step`` times that, the median steps ``median`` times the fastest."""
    ev: dict[str, object] = {"event": "point", "kind": p.kind, "tokens": p.tokens, "pairs": p.pairs}
    fastest = {"core": p.seconds, "step": step * p.seconds}
    ev |= {"sampled": p.sampled, "seconds": fastest, "label": f"{p.kind} {p.tokens}"}
    ev["median_seconds"] = {k: median * v for k, v in fastest.items()}
    return ev


def test_fit_recovers_known_coefficients_exactly() -> None:
    got = fit(grid_points(TRUE))
    for a, b in zip(got.as_tuple(), TRUE.as_tuple(), strict=True):
        assert a == pytest.approx(b, rel=1e-7)
    assert median_relative_error(got, grid_points(TRUE)) < 1e-9


def test_fit_with_noise_stays_close_and_nonnegative() -> None:
    pts = grid_points(TRUE, noise=0.05, seed=3)
    got = fit(pts)
    assert min(got.as_tuple()) >= 0
    assert got.step_overhead_s == pytest.approx(TRUE.step_overhead_s, rel=0.15)
    assert got.per_token_s == pytest.approx(TRUE.per_token_s, rel=0.15)
    assert median_relative_error(got, pts) < 0.05


def test_a_few_stalled_steps_do_not_pull_the_fit() -> None:
    # three steps slowed 5x-20x (another process held the CPU): the absolute-error fit keeps the others exact
    pts = grid_points(TRUE)
    for i, k in ((0, 5.0), (9, 20.0), (17, 8.0)):
        p = pts[i]
        pts[i] = StepPoint(p.tokens, p.pairs, p.sampled, p.seconds * k, p.kind)
    got = fit(pts)
    for a, b in zip(got.as_tuple(), TRUE.as_tuple(), strict=True):
        assert a == pytest.approx(b, rel=1e-3)
    assert median_relative_error(got, pts) < 1e-3


def test_fit_clamps_a_coefficient_the_data_wants_negative() -> None:
    # step times that fall with the number of sampled sequences: the unconstrained fit would price
    # per_sequence_s < 0; the fit drops that coefficient instead
    pts = [StepPoint(t, 0, s, 0.01 + 1e-4 * t - 1e-5 * s) for t in (8, 64, 256, 512) for s in (1, 8)]
    got = fit(pts)
    assert got.per_sequence_s == 0 and min(got.as_tuple()) >= 0


def four_points(noise: float) -> list[StepPoint]:
    """Two prefills and two decodes of the profiler's grid (as many points as coefficients), priced by ``TRUE``
    with ``noise``."""
    pts = grid_points(TRUE, noise=noise, seed=7)  # (a seed whose fit keeps all four coefficients > 0)
    return [pts[0], pts[11], pts[12], pts[23]]


def test_a_fit_of_four_points_reports_no_error() -> None:
    # four coefficients pass through four points: the error on them read 0.0% whatever the noise (here 20%)
    pts = four_points(0.2)
    prof = Profile(fit(pts), tuple(pts))
    assert max(relative_errors(prof.coefficients, pts)) < 1e-6  # (the defect: a perfect fit of noise)
    assert prof.median_relative_error() is None and cross_validated_errors(pts) is None
    text = dumps(prof)
    assert "median_abs_rel_error" not in text
    # one read from a file stays out too: it would be another fit's
    assert "median_abs_rel_error" not in dumps(replace(prof, info={"median_abs_rel_error": 0.0}))
    five = [*pts, grid_points(TRUE, noise=0.2, seed=7)[5]]
    assert Profile(fit(five), tuple(five)).median_relative_error() is not None


def test_the_leave_one_out_error_predicts_each_point_by_a_fit_of_the_others() -> None:
    exact = grid_points(TRUE)
    got = cross_validated_errors(exact)
    assert got is not None and max(got) < 1e-6  # (the model holds: every point is predicted)
    pts = grid_points(TRUE, noise=0.1, seed=7)
    loo = cross_validated_errors(pts)
    assert loo is not None and len(loo) == len(pts)
    for i in (0, 9, 23):
        others = fit([*pts[:i], *pts[i + 1 :]])
        assert loo[i] == pytest.approx(relative_errors(others, [pts[i]])[0], rel=1e-9)
    # the error on the fitted points flatters the fit: it passes through four of them (one per coefficient)
    coef = fit(pts)
    in_sample = relative_errors(coef, pts)
    assert sum(e < 1e-6 for e in in_sample) >= 4
    assert median_relative_error(coef, pts) < statistics.median(loo)


def test_fit_needs_enough_points() -> None:
    with pytest.raises(ValueError, match="at least 4 points"):
        fit(grid_points(TRUE)[:3])


def test_toml_round_trip(tmp_path: Path) -> None:
    pts = grid_points(TRUE, noise=0.02)
    prof = Profile(fit(pts), tuple(pts), {"engine": 'vllm "0.32"', "model": "/m/tiny", "block_size": 32})
    path = tmp_path / "cost.toml"
    write_profile(path, prof)
    back = load_profile(path)
    assert back.coefficients == prof.coefficients
    assert back.points == prof.points
    err = prof.median_relative_error()
    assert back.info == {**prof.info, "median_abs_rel_error": err}
    assert dumps(back) == dumps(prof)


def test_step_seconds_round_trip_and_checked() -> None:
    # the whole step's time kept beside the engine core's: written, read back, never fitted
    pts = [replace(p, step_seconds=1.5 * p.seconds) for p in grid_points(TRUE)]
    prof = Profile(fit(pts), tuple(pts))
    back = loads(dumps(prof))
    assert back.points == prof.points and back.points[0].step_seconds == pytest.approx(1.5 * pts[0].seconds)
    assert prof.coefficients.per_token_s == pytest.approx(TRUE.per_token_s, rel=1e-6)
    assert "step_seconds" not in dumps(Profile(prof.coefficients, tuple(grid_points(TRUE))))
    for bad in (0.0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="point step_seconds must be a number > 0"):
            StepPoint(8, 36, 1, 0.01, "prefill", bad)  # type: ignore[arg-type]


def fake_engine(tmp_path: Path, points: list[StepPoint] | None = None) -> Path:
    """A stand-in for the vLLM Python: prints the measuring module's lines for ``points`` (default: the grid's
    steps priced by ``TRUE``)."""
    lines = ['KVRETAIN-PROFILE {"event": "plan", "total": 1}']
    lines += ["KVRETAIN-PROFILE " + json.dumps(point_event(p)) for p in points or grid_points(TRUE)]
    data = tmp_path / "lines.txt"
    data.write_text("\n".join(lines) + "\n")
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\ncat {data}\n")
    fake.chmod(0o755)
    return fake


def test_profile_what_core_or_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the fake engine's whole steps take 1.5x its engine-core steps: --what core (the default) fits the core's
    # times and keeps the whole step's beside them; --what step fits the whole step's
    fake = fake_engine(tmp_path)
    argv = profile_argv(tmp_path, str(fake), "--no-progress", "--json")
    for what, factor in ((None, 1.0), ("core", 1.0), ("step", 1.5)):
        out = tmp_path / f"{what}.toml"
        assert (
            main([*argv, "--out", str(out), *(["--what", what] if what else []), "--statistic", "min"]) == 0
        )
        capsys.readouterr()
        prof = load_profile(out)
        assert prof.coefficients.per_token_s == pytest.approx(factor * TRUE.per_token_s, rel=1e-6)
        assert str(prof.info["measured"]).startswith("engine core" if factor == 1.0 else "whole")
        steps = [p.step_seconds for p in prof.points]
        if factor == 1.0:
            assert steps == pytest.approx([1.5 * p.seconds for p in prof.points])
        else:
            assert steps == [None] * len(steps)
    assert main([*argv, "--what", "engine"]) == 2
    assert "argument --what" in capsys.readouterr().err


def test_profiled_cost_model_prices_steps_with_the_coefficients() -> None:
    cat = builtin_catalog()
    model, gpu = cat.model("llama-3-8b"), cat.gpu("h100-sxm")
    cm = ProfiledCostModel(model, gpu, None, Profile(TRUE))
    # a prefill of 100 after 64 cached (finishing) plus two decodes at contexts 10 and 20
    t = cm.step_time(((100, 64, True),), (10, 20))
    assert t == pytest.approx(TRUE.predict(102, 100 * 64 + 5050 + 30, 3))
    assert cm.decode_step_time(2, 30) == pytest.approx(TRUE.predict(2, 30, 2))
    assert cm.step_time((), ()) == 0.0
    # sizes stay the catalog's
    assert cm.kv_bytes_per_token() == make_cost_model("roofline", model, gpu).kv_bytes_per_token()
    assert "profiled" in COST_MODELS
    with pytest.raises(ValueError, match="needs its file"):
        COST_MODELS.create("profiled", model, gpu)


def test_simulate_with_a_cost_model_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cost.toml"
    write_profile(path, Profile(TRUE))
    argv = ["simulate", "--limit", "30", "--kv-blocks", "2000", "--no-progress", "--json"]
    assert main([*argv, "--cost-model", str(path)]) == 0
    prof = json.loads(capsys.readouterr().out)
    assert main([*argv, "--cost-model", "roofline"]) == 0
    roof = json.loads(capsys.readouterr().out)
    assert prof["requests"] == roof["requests"] == 30
    assert prof["cost_model"] == str(path) and roof["cost_model"] == "roofline"
    # what the step times were measured on: the profile's run, not --model / --gpu (which size the KV cache)
    assert roof["step_times_of"] == "llama-3-8b on h100-sxm"
    assert prof["step_times_of"] == "profile: ? on ?"  # (this profile names neither)
    named = tmp_path / "named.toml"
    write_profile(named, Profile(TRUE, info={"model": "SmolLM2-135M", "device": "cpu"}))
    assert main([*argv, "--cost-model", str(named), "--model", "qwen2.5-7b"]) == 0
    assert json.loads(capsys.readouterr().out)["step_times_of"] == "profile: SmolLM2-135M on cpu"
    # a step costs >= 20 ms here against a few ms on an H100's roofline: the profiled run takes longer
    assert prof["simulated_s"] > roof["simulated_s"]
    slow = tmp_path / "slow.toml"
    write_profile(slow, Profile(StepCoefficients(0.04, 6e-5, 4e-9, 8e-4)))
    assert main([*argv, "--cost-model", str(slow)]) == 0
    assert json.loads(capsys.readouterr().out)["simulated_s"] > prof["simulated_s"]


BAD = {
    "missing.toml": None,
    "not-toml.toml": "this is = = not toml",
    "no-coef.toml": "[profile]\nformat = 1\n",
    "lacks.toml": "[coefficients]\nstep_overhead_s = 0.1\n",
    "negative.toml": "[coefficients]\nstep_overhead_s = 0.1\nper_token_s = -1.0\nper_pair_s = 0.0\n"
    "per_sequence_s = 0.0\n",
    "huge.toml": "[coefficients]\nstep_overhead_s = 1e308\nper_token_s = 1e308\nper_pair_s = 0.0\n"
    "per_sequence_s = 0.0\n",
    "text.toml": '[coefficients]\nstep_overhead_s = "fast"\nper_token_s = 1.0\nper_pair_s = 0.0\n'
    "per_sequence_s = 0.0\n",
    "unknown.toml": "[coefficients]\nstep_overhead_s = 0.1\nper_token_s = 1.0\nper_pair_s = 0.0\n"
    "per_sequence_s = 0.0\nper_block_s = 1.0\n",
    "badpoint.toml": "[coefficients]\nstep_overhead_s = 0.1\nper_token_s = 1.0\nper_pair_s = 0.0\n"
    "per_sequence_s = 0.0\n[[point]]\ntokens = 3\npairs = 1\nsampled = 1\nseconds = -2.0\n",
    "format.toml": "[profile]\nformat = 9\n",
    # a boolean where a number belongs: `seconds = true` was taken as a 1 s step, and the coefficient's message
    # spelt TOML's true as Python's True
    "boolpoint.toml": "[coefficients]\nstep_overhead_s = 0.1\nper_token_s = 1.0\nper_pair_s = 0.0\n"
    "per_sequence_s = 0.0\n[[point]]\ntokens = 3\npairs = 1\nsampled = 1\nseconds = true\n",
    "boolcoef.toml": "[coefficients]\nstep_overhead_s = false\nper_token_s = 1.0\nper_pair_s = 0.0\n"
    "per_sequence_s = 0.0\n",
}
WORDS = {
    "missing.toml": "No such file",
    "not-toml.toml": "not TOML",
    "no-coef.toml": "no [coefficients]",
    "lacks.toml": "lacks per_token_s",
    "negative.toml": "per_token_s must be a finite number >= 0",
    "huge.toml": "step_overhead_s must be a finite number >= 0 and at most 3600 seconds",
    "text.toml": "step_overhead_s must be",
    "unknown.toml": "unknown field(s) per_block_s",
    "badpoint.toml": "point 1: point seconds must be a number > 0",
    "format.toml": "format 9",
    "boolpoint.toml": "point 1: point seconds must be a number > 0, got true",
    "boolcoef.toml": "(MAX_COEFFICIENT_S), got false",
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_cost_model_files_fail_on_one_line(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / name
    if BAD[name] is not None:
        path.write_text(BAD[name] or "")
    with pytest.raises(ValueError, match=str(path.name)):
        load_profile(path)
    assert main(["simulate", "--limit", "5", "--no-progress", "--cost-model", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --cost-model" in err and WORDS[name] in err


def test_unknown_cost_model_name_lists_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--cost-model", "fancy", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "roofline" in err and "FILE.toml" in err


def test_loads_names_where() -> None:
    with pytest.raises(ValueError, match=r"^here: no"):
        loads("", where="here")


def test_profile_cli_errors_are_one_line(tmp_path: Path) -> None:
    # a missing model directory and a missing measuring Python: status 2, one line, nothing started
    for extra in (
        ["--model", str(tmp_path / "nope")],
        ["--model", model_dir(tmp_path), "--python", "/no/python"],
    ):
        r = subprocess.run(
            [sys.executable, "-m", "kvretain", "profile", *extra], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "argument --" in r.stderr
    argv = profile_argv(tmp_path, sys.executable, "--cached", "10")
    r = subprocess.run(
        [sys.executable, "-m", "kvretain", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "multiple of --block-size" in r.stderr


def test_profile_to_standard_output_writes_the_profile_alone_there(tmp_path: Path) -> None:
    # `kvretain profile ... --out /dev/stdout | ...`: its table, coefficients and "wrote" line went to stdout
    # after the TOML, which then did not parse
    import os
    import subprocess
    import sys
    import tomllib

    fake = fake_engine(tmp_path)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    argv = profile_argv(tmp_path, str(fake), "--no-progress")
    argv += ["--out", "/dev/stdout", "--plot", str(tmp_path / "p.png")]
    proc = subprocess.run(
        [sys.executable, "-m", "kvretain", *argv], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    prof = tomllib.loads(proc.stdout)
    assert prof["coefficients"]["per_token_s"] == pytest.approx(TRUE.per_token_s, rel=1e-6)
    assert "median |relative error|" in proc.stderr and "wrote /dev/stdout" in proc.stderr


def test_profile_command_fits_and_writes_with_a_fake_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a stand-in for the vLLM Python: prints the measuring module's lines for steps priced by TRUE
    lines = ['KVRETAIN-PROFILE {"event": "plan", "total": 1}', "some vLLM log line"]
    for p in grid_points(TRUE):
        lines.append("KVRETAIN-PROFILE " + json.dumps(point_event(p)))
    lines.append('KVRETAIN-PROFILE {"event": "info", "engine": "fake 1.0", "block_size": 32}')
    data = tmp_path / "lines.txt"
    data.write_text("\n".join(lines) + "\n")
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\ncat {data}\n")
    fake.chmod(0o755)
    out = tmp_path / "cost.toml"
    argv = profile_argv(tmp_path, str(fake), "--out", str(out), "--no-progress")
    assert main([*argv, "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["median_abs_rel_error"] < 1e-9 and obj["points"] == len(grid_points(TRUE))
    if obj["plot"] is not None:  # matplotlib importable
        assert Path(obj["plot"]).stat().st_size > 0
    prof = load_profile(out)
    assert prof.coefficients.per_token_s == pytest.approx(TRUE.per_token_s, rel=1e-6)
    assert prof.info["engine"] == "fake 1.0"
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "median |relative error| 0.0%" in table and "within the 10% target" in table
    # a measuring process that fails: one line with its last words, status 2
    fake.write_text("#!/bin/sh\necho 'RuntimeError: no vLLM here'\nexit 1\n")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "failed with status 1: RuntimeError: no vLLM here" in err


def _profile_refusing(tmp_path: Path, capsys: pytest.CaptureFixture[str], printed: str) -> str:
    """``kvretain profile`` with a measuring process that prints ``printed``: it must refuse (status 2); its
    standard error."""
    data = tmp_path / "lines.txt"
    data.write_text(printed)
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\ncat {data}\n")
    fake.chmod(0o755)
    argv = profile_argv(tmp_path, str(fake), "--out", str(tmp_path / "c.toml"))
    assert main(argv) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('{"event": "point", "label": "x"}', "no 'seconds' field"),
        ('{"event": "point", "label": "x", "tokens": "8", "pairs": 1, "sampled": 1, "kind": "prefill", '
         '"seconds": {"core": 0.01, "step": 0.02}, "median_seconds": {"core": 0.01, "step": 0.02}}',
         "point tokens must be an integer >= 0"),
        ('{"event": "point", "label": "x", "tokens": 8, "pairs": 1, "sampled": 1, "kind": "prefill", '
         '"seconds": [0.01], "median_seconds": [0.01]}', "list indices must be integers"),
        ("{not json", "not JSON"),
        ("[1, 2]", "not an object with an 'event' name"),
        ('{"event": "plan", "total": "many"}', "total must be an integer >= 0"),
        ('{"event": "plan", "total": true}', "total must be an integer >= 0, got True"),
    ],
    ids=["no-seconds", "tokens-a-string", "seconds-a-list", "not-json", "a-list", "total-a-string", "total-true"],
)  # fmt: skip
def test_a_malformed_measuring_line_is_one_line_that_says_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, says: str
) -> None:
    """A TypeError traceback, or a bare ``'seconds'``."""
    err = _profile_refusing(tmp_path, capsys, f"KVRETAIN-PROFILE {line}\n")
    assert err.count("\n") == 1 and err.startswith("kvretain profile: error: the measuring process"), err
    assert "malformed KVRETAIN-PROFILE line" in err and says in err, err


def test_a_long_malformed_measuring_line_is_shown_shortened(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _profile_refusing(
        tmp_path, capsys, "KVRETAIN-PROFILE {not json" + "x" * 300 + "\n"
    )  # (117 characters shown, then ...)
    assert err.count("\n") == 1 and "): {not json" + "x" * 108 + "... (is its kvretain this one?)" in err, err


@pytest.mark.parametrize(
    ("flag", "says"),
    [
        ("--contexts=-4", "argument --contexts: expected comma-separated integers >= 0, got '-4'"),
        ("--contexts=32,0", "arguments --new-tokens, --batch-sizes, --contexts: sizes must be >= 1"),
        ("--batch-sizes=0", "arguments --new-tokens, --batch-sizes, --contexts: sizes must be >= 1"),
    ],
)
def test_profile_sizes_below_one_are_refused_before_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, says: str
) -> None:
    assert main(profile_argv(tmp_path, sys.executable, flag)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_bare_profiled_and_a_hung_measurement_fail_on_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--cost-model", "profiled", "--no-progress"]) == 2
    assert "needs its file" in capsys.readouterr().err
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexec sleep 30\n")
    fake.chmod(0o755)
    argv = profile_argv(tmp_path, str(fake), "--timeout", "1", "--no-progress")
    assert main([*argv, "--out", str(tmp_path / "c.toml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ran past 1 s" in err


def test_profile_reports_the_leave_one_out_error_and_none_for_four_points(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the error reported was the fit's on its own points: 0.0% for any four points, the fit passing through
    # them all ("within the 10% target" of steps 20% off)
    out = tmp_path / "cost.toml"
    argv = profile_argv(
        tmp_path, str(fake_engine(tmp_path, four_points(0.2))), "--out", str(out), "--no-progress"
    )
    assert main([*argv, "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["loo_median_abs_rel_error"] is None and obj["median_abs_rel_error"] is None
    info = load_profile(out).info
    assert "median_abs_rel_error" not in info and "loo_median_abs_rel_error" not in info
    assert str(info["fit_error"]).startswith("not measurable: 4 points for 4 coefficients")
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert "0.0%" not in said.split("per_sequence_s")[1] and "target" not in said
    assert (
        "fit: 4 points for 4 coefficients: the fit needs every point to fix its coefficients, so its error "
        "cannot be measured" in said
    )
    assert "left out" not in said.splitlines()[0]
    # more points: the leave-one-out median is the figure (in the JSON, the file, the verdict), the flattering
    # in-sample one beside it
    pts = grid_points(TRUE, noise=0.1, seed=7)
    loo = statistics.median(cross_validated_errors(pts) or [])
    in_sample = median_relative_error(fit(pts), pts)
    argv = profile_argv(tmp_path, str(fake_engine(tmp_path, pts)), "--out", str(out), "--no-progress")
    assert main([*argv, "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["loo_median_abs_rel_error"] == pytest.approx(loo) and obj[
        "median_abs_rel_error"
    ] == pytest.approx(in_sample)
    info = load_profile(out).info
    assert info["loo_median_abs_rel_error"] == pytest.approx(loo) and "fit_error" not in info
    assert "median_abs_rel_error = " in out.read_text() and "# leave-one-out" in out.read_text()
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert (
        f"fit: median |relative error| {loo:.1%} leave-one-out (each point predicted by a fit of the other 23; "
        in said
    )
    assert f"{in_sample:.1%} on the points fitted, over 24 points" in said
    assert "left out" in said.splitlines()[0]


def test_the_profile_plot_names_the_leave_one_out_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from kvretain import cli_profile

    kept: list[Any] = []
    monkeypatch.setattr(plt, "close", kept.append)
    for pts, err, title in (
        (four_points(0.2), None, "SmolLM2-135M-Instruct\nerror not measurable (4 points, 4 coefficients)"),
        (grid_points(TRUE), 0.031, "SmolLM2-135M-Instruct\nmedian |error| 3.1% (leave-one-out)"),
    ):
        profile = Profile(fit(pts), tuple(pts), {"model": "/x/SmolLM2-135M-Instruct"})
        assert cli_profile._plot(str(tmp_path / "p.png"), pts, profile, err)
        fig = kept.pop()
        ax = fig.axes[0]
        assert ax.get_title() == f"kvretain profile: {title}"
        # the title inside the figure (one line of model and error ran past both edges)
        box = ax.title.get_window_extent(fig.canvas.get_renderer())
        assert box.x0 >= 0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height


def test_profile_statistic_and_cpus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --cpus goes to the measuring process; the fake engine's median steps take twice its fastest:
    # --statistic median fits those
    lines = ['KVRETAIN-PROFILE {"event": "plan", "total": 1}']
    for p in grid_points(TRUE):
        lines.append("KVRETAIN-PROFILE " + json.dumps(point_event(p)))
    data = tmp_path / "lines.txt"
    data.write_text("\n".join(lines) + "\n")
    fake = tmp_path / "python"
    spec = tmp_path / "spec.json"
    fake.write_text(f'#!/bin/sh\ncp "$3" {spec}\ncat {data}\n')  # argv: -m MODULE SPEC
    fake.chmod(0o755)
    argv = profile_argv(tmp_path, str(fake), "--no-progress", "--json")
    assert main([*argv, "--out", str(tmp_path / "c.toml"), "--cpus", "0"]) == 0
    capsys.readouterr()
    assert (
        json.loads(spec.read_text())["cpus"] == [0] and load_profile(tmp_path / "c.toml").info["cpus"] == "0"
    )
    for stat, factor in (("min", 1), ("median", 2)):
        out = tmp_path / f"{stat}.toml"
        assert main([*argv, "--out", str(out), "--statistic", stat]) == 0
        capsys.readouterr()
        prof = load_profile(out)
        assert prof.coefficients.per_token_s == pytest.approx(factor * TRUE.per_token_s, rel=1e-6)
        assert prof.info["statistic"].startswith("fastest" if stat == "min" else "median")


def test_step_point_counts_and_kind() -> None:
    # a decode is a sampled single token; a one-token chunk that does not finish its prompt is prefill work
    decode = step_point([(1, 9, True), (1, 4, 1)], 0.01)
    assert (decode.tokens, decode.pairs, decode.sampled, decode.kind) == (2, 10 + 5, 2, "decode")
    partial = step_point([(1, 9, False)], 0.01)
    assert (partial.tokens, partial.pairs, partial.sampled, partial.kind) == (1, 10, 0, "prefill")
    mixed = step_point([(3, 2, False), (1, 7, True)], 0.01, 0.02)
    assert (mixed.tokens, mixed.pairs, mixed.sampled, mixed.kind) == (4, 3 * 2 + 6 + 8, 1, "mixed")
    assert mixed.step_seconds == 0.02
    with pytest.raises(ValueError, match="point tokens must be >= 1"):
        StepPoint(0, 0, 0, 0.01)


def test_coefficients_refuse_only_a_free_step() -> None:
    # either the overhead or the per-token cost may be 0, not both
    assert StepCoefficients(0.0, 1e-5, 0.0, 0.0).predict(10, 0, 0) == pytest.approx(1e-4)
    assert StepCoefficients(0.01, 0.0, 0.0, 0.0).predict(10, 0, 0) == 0.01
    with pytest.raises(ValueError, match="both 0"):
        StepCoefficients(0.0, 0.0, 1e-9, 1e-4)


def test_fit_with_exactly_four_points() -> None:
    shapes = [(32, 528, 1), (1024, 1024 * 1025 // 2, 1), (4, 4 * 34, 4), (32, 32 * 1026, 32)]
    pts = [StepPoint(t, p, s, TRUE.predict(t, p, s)) for t, p, s in shapes]
    got = fit(pts)
    for a, b in zip(got.as_tuple(), TRUE.as_tuple(), strict=True):
        assert a == pytest.approx(b, rel=1e-6)


def test_fit_keeps_a_single_coefficient_when_every_pair_wants_one_negative() -> None:
    # time falls with tokens and every step samples one sequence (the same column as the overhead): only
    # a one-coefficient model is non-negative
    pts = [StepPoint(t, 0, 1, 0.01 - 1e-5 * t) for t in (8, 64, 256, 512)]
    got = fit(pts)
    assert got.per_token_s == 0 and got.per_pair_s == 0
    assert got.step_overhead_s + got.per_sequence_s > 0


def test_fit_never_drops_both_the_overhead_and_the_per_token_cost() -> None:
    # steps priced exactly by pairs and sampled sequences alone: that model would price a prefill chunk that
    # samples nothing at 0, so the fit keeps an overhead or a per-token cost instead
    shapes = [(32, 528, 1), (1024, 524_800, 1), (4, 136, 4), (32, 32_832, 32), (256, 32_896, 0)]
    pts = [StepPoint(t, p, s, 1e-9 * p + 1e-4 * s) for t, p, s in shapes]
    got = fit(pts)
    assert got.step_overhead_s > 0 or got.per_token_s > 0


class _FakeEngine:
    """vLLM's ``LLMEngine`` as the measuring module drives it, on a fake clock: a step prefills every new request
    whole (its cached part: the longest prefix of full blocks an earlier prompt held) and decodes the others,
    one token each; its engine-core step costs 10 ms plus 1 ms per token computed (500 ms more once ``slow``, 1 s
    more the first time a step has its shape), the whole step 2 ms more (the output processor). ``quirk``: what a
    wrong engine does instead."""

    def __init__(self, clock: list[float], block: int, quirk: str | None, max_model_len: int) -> None:
        self.clock = clock
        self.max_model_len = max_model_len
        self.block = block
        self.quirk = quirk
        self.slow = False
        self.model_config = SimpleNamespace(get_vocab_size=lambda: 1000)
        self.engine_core = SimpleNamespace(get_output=self._core_step)
        self.reqs: dict[str, tuple[list[int], int, list[int], list[int]]] = {}
        self.cached: set[tuple[int, ...]] = set()
        self.shapes: set[tuple[int, int]] = set()  # (tokens computed, requests) of the steps so far
        self.added: Counter[tuple[int, int]] = Counter()  # (prompt tokens, max_tokens) of the requests added

    def add_request(self, rid: str, prompt: dict[str, list[int]], params: Any) -> None:
        tokens = prompt["prompt_token_ids"]
        if not 1 <= len(tokens) <= self.max_model_len:  # (vLLM's VLLMValidationError)
            raise ValueError(
                f"maximum context length is {self.max_model_len}, the prompt has {len(tokens)} tokens"
            )
        self.reqs[rid] = (tokens, params.max_tokens, [], [])
        self.added[len(tokens), params.max_tokens] += 1

    def _core_step(self) -> list[Any]:
        outs, computed = [], 0
        for rid, (prompt, max_tokens, gen, hit) in list(self.reqs.items()):
            if not gen:
                full = range(self.block, len(prompt), self.block)  # (never the whole prompt)
                hit.append(max([k for k in full if tuple(prompt[:k]) in self.cached], default=0))
                if self.quirk != "no prefix cache":
                    self.cached.update(
                        tuple(prompt[:k]) for k in range(self.block, len(prompt) + 1, self.block)
                    )
                computed += len(prompt) - hit[0]
            else:
                computed += 1
            gen.append(7)
            done = len(gen) >= max_tokens + (self.quirk == "a token too many")
            out = SimpleNamespace(request_id=rid, finished=done, num_cached_tokens=hit[0])
            outs.append(SimpleNamespace(**vars(out), outputs=[SimpleNamespace(token_ids=list(gen))]))
            if done:
                del self.reqs[rid]
        first = (computed, len(outs)) not in self.shapes  # (a new shape's first call builds its kernels)
        self.shapes.add((computed, len(outs)))
        self.clock[0] += 0.010 + 0.001 * computed + (0.5 if self.slow else 0.0) + (1.0 if first else 0.0)
        return outs

    def step(self) -> list[Any]:
        outs = self._core_step() if self.quirk == "no engine core" else self.engine_core.get_output()
        self.clock[0] += 0.002
        return outs  # type: ignore[no-any-return]

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def abort_request(self, rids: list[str]) -> None:
        for rid in rids:
            if self.quirk == "aborts nothing":  # (it runs on for 50 more tokens)
                prompt, _, gen, hit = self.reqs[rid]
                self.reqs[rid] = (prompt, len(gen) + 50, gen, hit)
            else:
                del self.reqs[rid]


def _measure_on_a_fake_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quirk: str | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any], list[int]]:
    """Run the measuring module (``kvretain profile``'s half in vLLM's Python) on a :class:`_FakeEngine` whose
    second round's steps are 0.5 s slower (another process took the cores): its events, the ``LLM`` arguments
    (and ``engine``) and the cores it was given."""
    from kvretain.integrations.vllm import stepprofile

    clock = [0.0]
    monkeypatch.setattr(stepprofile, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    made: dict[str, Any] = {}

    def llm(**kwargs: Any) -> Any:
        made.update(kwargs)
        made["engine"] = _FakeEngine(clock, kwargs["block_size"], quirk, kwargs["max_model_len"])
        return SimpleNamespace(llm_engine=made["engine"])

    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams, fake.__version__ = llm, SimpleNamespace, "0.0-fake"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake)
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)  # (what the module sets for vLLM goes afterwards)
    monkeypatch.setenv("OMP_NUM_THREADS", "x")
    events: list[dict[str, Any]] = []
    real_emit = stepprofile.emit

    def emit(obj: dict[str, Any]) -> None:
        events.append(obj)
        if obj == {"event": "done", "what": "decode 2 8"}:  # the first round is over
            made["engine"].slow = True
        real_emit(obj)

    monkeypatch.setattr(stepprofile, "emit", emit)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []  # (Linux only)
    spec = {"model": "m", "block_size": 4, "prefill": [[8, 0], [4, 8]], "decode": [[2, 8]], "cpus": cpus}
    spec |= {"repeats": 3, "decode_steps": 2, "rounds": 2}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert stepprofile.main(str(tmp_path / "spec.json")) == 0
    return events, made, cpus


def test_the_measuring_module_times_each_shape_and_reports_its_fastest_and_median_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvretain.integrations.vllm.stepprofile import MARK

    events, made, cpus = _measure_on_a_fake_engine(tmp_path, monkeypatch)
    assert capsys.readouterr().out.splitlines() == [MARK + json.dumps(e) for e in events]
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and os.environ["HF_HUB_OFFLINE"] == "1"
    assert os.environ["OMP_NUM_THREADS"] == (str(len(cpus)) if cpus else "x")
    assert made["max_model_len"] == 16 and made["max_num_batched_tokens"] == 8192  # decode: 8 + 8 max_tokens
    assert made["enable_prefix_caching"] and made["block_size"] == 4 and made["max_num_seqs"] == 8
    # (prompt tokens, max_tokens): the warm-up; per round, each prefill shape once untimed and 3 times timed
    # (after one request that caches the 8-token prefix), the decode batch's 2 requests
    assert made["engine"].added == {(8, 4): 1, (12, 4): 4, (8, 1): 8, (9, 1): 2, (12, 1): 8, (8, 8): 4}
    assert events[0] == {"event": "plan", "total": 7} and events[-1]["engine"] == "vllm 0.0-fake"
    points = [e for e in events if e["event"] == "point"]
    # (label, tokens, pairs, sampled, fastest engine-core step)
    expected = [
        ("prefill n=8 p=0", 8, 36, 1, 0.018),  # pairs: each new token attends to what is before it and itself
        ("prefill n=4 p=8", 4, 4 * 8 + 10, 1, 0.014),
        ("decode b=2 c=8", 2, 21, 2, 0.012),  # contexts 2 x (8 + 2) and 2 x (8 + 3): 21 on average
    ]
    for point, (label, tokens, pairs, sampled, core) in zip(points, expected, strict=True):
        assert (point["label"], point["tokens"], point["pairs"], point["sampled"]) == (
            label,
            tokens,
            pairs,
            sampled,
        )
        assert point["seconds"] == pytest.approx({"core": core, "step": core + 0.002})
        assert point["median_seconds"] == pytest.approx({"core": core + 0.25, "step": core + 0.252})


@pytest.mark.parametrize(
    ("quirk", "error"),
    [
        ("no prefix cache", "prefill n=4 p=8: 0 tokens cached, not 8"),
        ("a token too many", "prefill n=8 p=0 did not finish in one step"),
        ("aborts nothing", "prefill n=8 p=0 did not finish in one step"),  # (round 2: a decode is left)
        ("no engine core", "did not call engine_core.get_output()"),
    ],
)
def test_the_measuring_module_refuses_an_engine_that_does_not_run_the_step_it_means(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quirk: str, error: str
) -> None:
    with pytest.raises(RuntimeError, match=re.escape(error)):
        _measure_on_a_fake_engine(tmp_path, monkeypatch, quirk)


def test_profile_writes_both_files_or_neither(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A plot that cannot be written (a full disk after the measurement) left the cost model behind, with an error
    naming the cost model's file; a cost model that cannot be written now takes back the plot this run made."""
    pytest.importorskip("matplotlib")
    import kvretain.cli_profile as cli_profile

    fake = fake_engine(tmp_path)
    argv = profile_argv(tmp_path, str(fake), "--no-progress", "--json")
    out, plot = tmp_path / "m.toml", tmp_path / "m.png"

    def full(path: str, *a: object, **k: object) -> bool:
        raise OSError(28, "No space left on device", path)

    monkeypatch.setattr(cli_profile, "_plot", full)
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvretain profile: error: cannot write {plot}: No space left on device"]
    assert not out.exists() and not plot.exists()
    monkeypatch.undo()

    def toml_full(path: object, profile: object) -> None:
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(cli_profile, "write_profile", toml_full)
    assert main([*argv, "--out", str(out)]) == 2
    assert f"cannot write {out}: No space left on device" in capsys.readouterr().err
    assert not out.exists() and not plot.exists()


@pytest.mark.parametrize("out", ["-", "/dev/stdout"])
def test_profile_to_standard_output_needs_a_plot_name(out: str, tmp_path: Path) -> None:
    """``--out -`` wrote files named '-' and '-.png'; ``--out /dev/stdout`` (standard output redirected to a file)
    made its default plot /dev/stdout.png. Both are refused before measuring (name the plot with --plot)."""
    import os
    import subprocess
    import sys

    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src}
    argv = [
        sys.executable,
        "-m",
        "kvretain",
        "profile",
        "--model",
        model_dir(tmp_path),
        "--python",
        sys.executable,
    ]
    with open(tmp_path / "stdout.txt", "w") as redirected:
        r = subprocess.run(
            [*argv, "--out", out], stdout=redirected, stderr=subprocess.PIPE, text=True, env=env
        )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "argument --out: '-' names no file" in r.stderr or "the plot has no default name" in r.stderr
    assert not Path("-").exists() and not Path("/dev/stdout.png").exists()


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("model = {a = 1}", "[profile] model must be a string or a number"),
        ("device = 1979-05-27T07:32:00Z", "[profile] device must be a string or a number"),
        ("format = true", "[profile] format True is not"),
        ('model = "\\u001b[31mred"', "[profile] model must be printable text"),
    ],
)
def test_a_cost_models_profile_table_holds_text_and_numbers(line: str, expected: str, tmp_path: Path) -> None:
    """[profile] fields are printed and reported (the model and device a run's steps were measured on): a table, a
    date or a boolean format loaded, and a string with a terminal escape reached the terminal raw."""
    text = dumps(
        Profile(fit(list(grid_points(TRUE))), tuple(grid_points(TRUE)), {"model": "m", "device": "d"})
    )
    key = line.split(" ", 1)[0]
    lines = [ln for ln in text.splitlines() if not ln.startswith(f"{key} =")]
    at = lines.index("[profile]") + 1
    bad = "\n".join([*lines[:at], line, *lines[at:]]) + "\n"
    with pytest.raises(ValueError, match=re.escape(expected)):
        loads(bad)
    loads(text)


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda t: t.replace("[[point]]", "[[points]]"), "unknown top-level table(s) or key(s) points"),
        (lambda t: "per_token_s = 1.0\n" + t, "unknown top-level table(s) or key(s) per_token_s"),
        (lambda t: t.replace("[coefficients]", "[coefficient]\n[coefficients]"), "coefficient"),
        (
            lambda t: t.replace("sampled = 1\n", "sampled = 1\nstep_second = 0.2\n", 1),
            "point 1: has unknown field(s) step_second",
        ),
        (lambda t: t.replace('kind = "prefill"', "kind = 5", 1), "point 1: kind must be text, got 5"),
        (lambda t: t.replace('kind = "prefill"', 'kind = "a\\u001b[31m"', 1), "point 1: kind must be"),
    ],
    ids=["points-typo", "top-level-key", "extra-table", "point-field-typo", "kind-a-number", "kind-escape"],
)
def test_a_cost_model_file_with_a_misspelt_or_unknown_key_is_refused(
    edit: Any, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A misspelt table or field was silently ignored: ``[[points]]`` loaded no points (no fit error reported),
    ``step_second`` no whole-step time, and ``kind = 5`` became the text "5"."""
    pts = grid_points(TRUE)
    text = dumps(Profile(fit(pts), tuple(pts), {"model": "m"}))
    loads(text)
    path = tmp_path / "c.toml"
    path.write_text(edit(text))
    with pytest.raises(ValueError, match=re.escape(expected)):
        load_profile(path)
    assert main(["simulate", "--limit", "5", "--no-progress", "--cost-model", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --cost-model" in err and expected in err, err


def test_the_profile_progress_bar_ends_at_its_total(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The measuring module plans one unit per shape and round plus the warm-up (its ``done`` events); the bar
    also counted each final ``point`` event, so it ran past its total (10 of 7 for 2 rounds of 3 shapes)."""
    events, _, _ = _measure_on_a_fake_engine(tmp_path, monkeypatch)
    capsys.readouterr()
    data = tmp_path / "lines.txt"
    events[-1:-1] = [point_event(p) for p in grid_points(TRUE)]  # (enough points to fit)
    data.write_text("".join(f"KVRETAIN-PROFILE {json.dumps(e)}\n" for e in events))
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\ncat {data}\n")
    fake.chmod(0o755)
    bars: list[Any] = []

    class Bar:
        def __init__(self, total: int, **_: Any) -> None:
            self.total, self.n = total, 0
            bars.append(self)

        def update(self, k: int) -> None:
            self.n += k

        def set_postfix_str(self, _: str) -> None:
            pass

        def close(self) -> None:
            pass

    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=Bar))
    argv = profile_argv(tmp_path, str(fake), "--out", str(tmp_path / "c.toml"))
    assert main([*argv, "--json"]) == 0
    assert [(b.n, b.total) for b in bars] == [(7, 7)]


def test_profile_never_writes_a_cost_model_file_that_simulate_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """[profile] text must be printable (loads' rule): a model folder with a tab in its name was measured, then
    written into a file that `simulate --cost-model` refused ("[profile] model must be printable text")."""
    pts = grid_points(TRUE)
    with pytest.raises(ValueError, match=r"\[profile\] model must be printable text"):
        dumps(Profile(fit(pts), tuple(pts), {"model": "/m/a\tb"}))
    model = tmp_path / "a\tb"
    model.mkdir()
    ran = tmp_path / "ran"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\ntouch {ran}\n")
    fake.chmod(0o755)
    out = tmp_path / "c.toml"
    assert main(["profile", "--model", str(model), "--python", str(fake), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --model:" in err and "printable" in err, err
    assert not ran.exists() and not out.exists()  # refused before measuring


def test_a_cost_model_file_named_in_capitals_is_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--cost-model COST.TOML`` (no folder in it) was taken for a model name: "invalid choice 'COST.TOML'"."""
    pts = grid_points(TRUE)
    write_profile(tmp_path / "COST.TOML", Profile(fit(pts), tuple(pts)))
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "--limit", "5", "--no-progress", "--cost-model", "COST.TOML", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cost_model"] == "COST.TOML"


def test_the_profile_plot_reads_in_milliseconds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step times of 23-44 ms (a small model on CPU): the log axes read "2x10^1", "3x10^1", "4x10^1" ms."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from kvretain import cli_profile
    from kvretain.engine.sim.profiled import Profile, StepPoint, fit, median_relative_error

    rng = random.Random(0)
    pts = [
        StepPoint(n, n * n // 2, 1, 0.020 + 0.0002 * n * rng.uniform(0.9, 1.1), "prefill")
        for n in (32, 64, 96, 128)
    ]
    pts += [
        StepPoint(b, b * 300, b, 0.022 + 0.001 * b * rng.uniform(0.9, 1.1), "decode") for b in (1, 4, 8, 16)
    ]
    coef = fit(pts)
    kept: list[Any] = []
    monkeypatch.setattr(plt, "close", kept.append)
    profile = Profile(coef, tuple(pts), {"model": "/m/SmolLM2-135M"})
    assert cli_profile._plot(str(tmp_path / "p.png"), pts, profile, median_relative_error(coef, pts))
    (ax,) = kept[0].axes
    kept[0].canvas.draw()
    for ticks in (
        ax.get_xticklabels() + ax.get_xticklabels(minor=True),
        ax.get_yticklabels() + ax.get_yticklabels(minor=True),
    ):
        shown = [t.get_text() for t in ticks if t.get_text()]
        assert "30" in shown and not any("10^" in s for s in shown), shown


@pytest.mark.parametrize("longest", [4, 5, 35, 67, 68, 1025, 2048])
def test_the_warm_up_fits_the_engines_max_model_len(longest: int) -> None:
    # `kvretain profile --new-tokens 32 --cached 0 --contexts 32 --decode-steps 1` sizes the engine at 35 tokens:
    # its warm-up sent 64-token prompts, which vLLM refused ("maximum context length is 35 tokens")
    from kvretain.integrations.vllm.stepprofile import warmup_requests

    reqs = warmup_requests(longest)
    assert len(reqs) == 5
    for prompt, new in reqs:
        assert prompt >= 1 and new >= 1 and prompt + new <= longest
    # a grid that fits them keeps the warm-up it had: one long prefill, four 64-token prompts
    if longest >= 68:
        assert reqs == [(longest - 8, 4)] + [(64, 4)] * 4


def test_a_grid_of_fewer_points_than_coefficients_is_refused_before_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # one prefill and one decode point measured for half a minute, then "a fit needs at least 4 points, got 2"
    ran = tmp_path / "ran"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\ntouch {ran}\n")
    fake.chmod(0o755)
    grid = ["--new-tokens", "32", "--cached", "0", "--batch-sizes", "1", "--contexts", "32"]
    argv = [
        "profile",
        "--model",
        str(tmp_path),
        "--python",
        str(fake),
        "--out",
        str(tmp_path / "c.toml"),
        *grid,
    ]
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the grid has 1 prefill and 1 decode points" in err, err
    assert "--new-tokens, --cached, --batch-sizes, --contexts" in err and not ran.exists()
    assert not (tmp_path / "c.toml").exists()


@pytest.mark.parametrize("config", [None, "config.json", "params.json"])
def test_a_model_folder_without_a_config_is_refused_before_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: str | None
) -> None:
    # vLLM refused it after ~10 s of start-up, and the last line shown was pydantic's "For further information
    # visit https://errors.pydantic.dev/..."
    model, ran = tmp_path / "model", tmp_path / "ran"
    model.mkdir()
    if config:
        (model / config).write_text("{}")
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\ntouch {ran}\n")
    fake.chmod(0o755)
    argv = ["profile", "--model", str(model), "--python", str(fake), "--out", str(tmp_path / "c.toml")]
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    if config:  # (the fake engine ran, and reported nothing)
        assert ran.exists() and "reported no measurements" in err, err
    else:
        assert not ran.exists() and "argument --model" in err and "holds no config.json or params.json" in err


@pytest.mark.parametrize(("b", "c"), [(1, 32), (16, 1024), (32, 1024), (64, 4096)])
def test_a_decode_points_requests_fit_the_engines_max_model_len(b: int, c: int) -> None:
    # `--batch-sizes 16 --contexts 1024`: the engine was sized at 1024 + 5 + 2 tokens, its 16 prefills took 3
    # chunked steps, and the first 8 requests reached max_model_len in the timed steps ("emitted 8 tokens, not 16")
    from kvretain.integrations.vllm.stepprofile import decode_max_tokens, engine_sizes

    longest, batch_tokens = engine_sizes([(32, 0)], [(b, c)], 5)
    assert c + decode_max_tokens(b, c, 5, batch_tokens) <= longest <= batch_tokens
