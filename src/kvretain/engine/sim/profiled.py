"""A step-time cost model fitted to a real engine's measured steps (``kvretain profile`` writes its file).

One engine step of ``tokens`` tokens, ``pairs`` attention (query, key) pairs and ``sampled`` sequences that
emit a token is priced as::

    t = step_overhead_s + per_token_s * tokens + per_pair_s * pairs + per_sequence_s * sampled

``per_token_s`` is the linear layers' cost of a token, ``per_pair_s`` attention's cost of one (query, key)
pair, ``per_sequence_s`` what each sampled sequence adds (LM head row, sampler, output processing) and
``step_overhead_s`` the fixed cost of a step (scheduling, input preparation, kernel launches). The counts are
the roofline model's (:class:`~kvretain.engine.sim.costmodel.CostModel`): a prefill chunk of ``n`` tokens after
``p`` cached has ``n*p + n*(n+1)/2`` pairs, a decode with context ``C`` has ``C``.

The coefficients come from a fit of measured step times that minimizes the sum of absolute *relative* errors
(every point counts by its relative error: short decode steps and long prefills alike; absolute rather than
squared so that a few steps slowed by other processes on a shared machine do not pull the fit), solved as
iteratively reweighted least squares, and constrained to be >= 0: a negative coefficient would price some
step below zero. With four coefficients the constraint is met by fitting every subset of them and keeping the
best non-negative one.

The fit's error on the points it was fitted to (``median_abs_rel_error`` in the file) flatters it: the fit
passes exactly through as many points as it keeps coefficients (up to four), and through all of a four-point
profile (which then read 0.0%). ``kvretain profile`` reports the leave-one-out error as its figure
(:func:`cross_validated_errors`: each point predicted by a fit of the others), and none for four points.

Pure Python (no numpy): each iteration solves a 4x4 system. The file is TOML::

    [profile]          # what was measured: informational, and the fit errors
    [coefficients]     # the four seconds above
    [[point]]          # the measured steps (tokens, pairs, sampled, seconds[, step_seconds, kind]), to refit or plot

Any other top-level table or key, point field or coefficient is refused (a misspelling would go unread).
"""

from __future__ import annotations

import math
import statistics
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

from kvretain.engine.sim.catalog import GPUSpec, ModelSpec, is_finite
from kvretain.engine.sim.costmodel import CostModel, chunk_pairs
from kvretain.fileio import as_written, not_utf8, output_file

FORMAT = 1
COEFFICIENTS = ("step_overhead_s", "per_token_s", "per_pair_s", "per_sequence_s")
SECTIONS = ("profile", "coefficients", "point")
"""The top-level tables of a cost model file; any other name is refused (a misspelling)."""
POINT_FIELDS = ("kind", "tokens", "pairs", "sampled", "seconds", "step_seconds")
"""The fields of a ``[[point]]`` (``kind`` and ``step_seconds`` optional); any other is refused."""
INFO_COMMENTS = {
    "median_abs_rel_error": "  # on the points fitted (in-sample: optimistic)",
    "loo_median_abs_rel_error": "  # leave-one-out: each point predicted by a fit of the others",
}
"""The comments :func:`dumps` writes after these ``[profile]`` keys (what each error measures)."""
MAX_COEFFICIENT_S = 3600.0
"""Largest coefficient: an hour (for a step, a token, a pair or a sequence). A real engine's step takes
milliseconds to seconds, so a coefficient beyond an hour is a wrong file (a unit mistake gives at most 1,000x);
the bound keeps every step time and the run's sums finite (``1e308`` s per step overflowed them to ``inf``)."""


@dataclass(frozen=True)
class StepPoint:
    """One measured step: its work and its wall time in seconds."""

    tokens: int
    pairs: int
    sampled: int
    seconds: float
    kind: str = ""
    """What the step was (``prefill`` or ``decode``): for tables and plots only."""
    step_seconds: float | None = None
    """The whole engine step's time (``llm_engine.step()``: the engine core's step plus the output processing)
    when ``seconds`` is the engine core's own step (``kvretain profile --what core``): kept to compare, never
    fitted."""

    def __post_init__(self) -> None:
        for name in ("tokens", "pairs", "sampled"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"point {name} must be an integer >= 0, got {as_written(v)}")
        if self.tokens < 1:
            raise ValueError(f"point tokens must be >= 1, got {self.tokens}")
        if not (is_finite(self.seconds) and self.seconds > 0):
            raise ValueError(f"point seconds must be a number > 0, got {as_written(self.seconds)}")
        st = self.step_seconds
        if st is not None and not (is_finite(st) and st > 0):
            raise ValueError(f"point step_seconds must be a number > 0, got {as_written(st)}")

    def features(self) -> tuple[float, float, float, float]:
        """The step's counts in :data:`COEFFICIENTS` order (1 for the overhead)."""
        return (1.0, float(self.tokens), float(self.pairs), float(self.sampled))


def step_point(
    chunks: Iterable[tuple[int, int, int | bool]], seconds: float, step_seconds: float | None = None
) -> StepPoint:
    """The point of a measured step of ``chunks`` ``(n, p, s)``: ``n`` tokens computed after ``p`` whose KV was
    there, ``s`` true when the step samples for it (the simulator's ``ScheduledChunk`` counts; a decode is
    ``(1, context so far, 1)``), counted as the cost model counts them (:func:`~.costmodel.chunk_pairs`).
    ``kind``: ``decode`` when every chunk is a sampled single token, ``prefill`` when none is, else ``mixed``."""
    tokens = pairs = sampled = decodes = chunks_n = 0
    for n, p, s in chunks:
        tokens += n
        pairs += chunk_pairs(n, p)
        sampled += int(bool(s))
        decodes += int(n == 1 and bool(s))
        chunks_n += 1
    kind = "decode" if decodes == chunks_n else ("prefill" if decodes == 0 else "mixed")
    return StepPoint(tokens, pairs, sampled, seconds, kind, step_seconds)


@dataclass(frozen=True)
class StepCoefficients:
    """The fitted seconds of the model above (each in ``[0, MAX_COEFFICIENT_S]``)."""

    step_overhead_s: float
    per_token_s: float
    per_pair_s: float
    per_sequence_s: float

    def __post_init__(self) -> None:
        for name in COEFFICIENTS:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= MAX_COEFFICIENT_S:
                raise ValueError(
                    f"coefficient {name} must be a finite number >= 0 and at most {MAX_COEFFICIENT_S:g} seconds "
                    f"(MAX_COEFFICIENT_S), got {as_written(v)}"
                )
        if self.per_token_s == 0 and self.step_overhead_s == 0:
            raise ValueError(
                "coefficients step_overhead_s and per_token_s are both 0: every step would be free"
            )

    def as_tuple(self) -> tuple[float, float, float, float]:
        return (self.step_overhead_s, self.per_token_s, self.per_pair_s, self.per_sequence_s)

    def predict(self, tokens: int, pairs: int, sampled: int) -> float:
        c0, ct, cp, cs = self.as_tuple()
        return c0 + ct * tokens + cp * pairs + cs * sampled


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` by Gaussian elimination with partial pivoting; None when ``a`` is singular."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    scale = max((abs(v) for row in a for v in row), default=0.0)
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) <= 1e-13 * scale:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col and m[r][col] != 0.0:
                f = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] for i in range(n)]


def _weighted_lstsq(
    points: Sequence[StepPoint], active: Sequence[int], weights: Sequence[float]
) -> list[float] | None:
    """Least squares of ``t`` over the ``active`` features, residual ``i`` divided by ``t_i`` and weighted by
    ``weights[i]``: the coefficients of all four features (0 where inactive), None when degenerate.

    The features are scaled to unit size before the normal equations so that counts of 1 and of 10^6 pairs
    condition alike."""
    rows = [[p.features()[j] / p.seconds for j in active] for p in points]
    scale = [max(abs(r[k]) for r in rows) or 1.0 for k in range(len(active))]
    rows = [[r[k] / scale[k] for k in range(len(active))] for r in rows]
    k = len(active)
    pairs = list(zip(rows, weights, strict=True))
    ata = [[sum(w * r[i] * r[j] for r, w in pairs) for j in range(k)] for i in range(k)]
    atb = [sum(w * r[i] for r, w in pairs) for i in range(k)]  # target t/t = 1
    x = _solve(ata, atb)
    if x is None:
        return None
    coef = [0.0] * 4
    for i, j in enumerate(active):
        coef[j] = x[i] / scale[i]
    return coef


def _residuals(coef: Sequence[float], points: Sequence[StepPoint]) -> list[float]:
    return [sum(c * f for c, f in zip(coef, p.features(), strict=True)) / p.seconds - 1.0 for p in points]


_IRLS_ROUNDS = 40
_IRLS_FLOOR = 1e-6
"""Iterations of the L1 fit, and the smallest residual a weight divides by (so exact data keeps finite
weights). The best iterate is kept, so more rounds can only lower the sum of absolute errors."""


def _l1_fit(points: Sequence[StepPoint], active: Sequence[int]) -> tuple[list[float], float] | None:
    """The coefficients over ``active`` minimizing the sum of absolute relative residuals, by iteratively
    reweighted least squares (weights ``1/|r|``), and that sum; None when degenerate."""
    weights = [1.0] * len(points)
    best: tuple[list[float], float] | None = None
    for _ in range(_IRLS_ROUNDS):
        coef = _weighted_lstsq(points, active, weights)
        if coef is None:
            return best
        res = _residuals(coef, points)
        score = sum(abs(r) for r in res)
        if min(coef) >= 0 and (best is None or score < best[1]):
            best = (coef, score)
        weights = [1.0 / max(abs(r), _IRLS_FLOOR) for r in res]
    return best


def fit(points: Sequence[StepPoint]) -> StepCoefficients:
    """The non-negative least-absolute-relative-error fit of the four coefficients to ``points``.

    Raises ``ValueError`` with fewer points than coefficients or when no subset of coefficients fits.
    """
    if len(points) < len(COEFFICIENTS):
        raise ValueError(f"a fit needs at least {len(COEFFICIENTS)} points, got {len(points)}")
    best: tuple[float, list[float]] | None = None
    for size in range(len(COEFFICIENTS), 0, -1):
        for active in combinations(range(len(COEFFICIENTS)), size):
            if 0 not in active and 1 not in active:
                continue  # a model without overhead and per-token cost prices a prefill-only step at 0
            got = _l1_fit(points, active)
            if got is None:
                continue
            coef, score = got
            if best is None or score < best[0] * (1 - 1e-12):
                best = (score, coef)
    if best is None:
        raise ValueError("no non-negative fit of the step times: are the points all the same step?")
    return StepCoefficients(*best[1])


def relative_errors(coef: StepCoefficients, points: Iterable[StepPoint]) -> list[float]:
    """``|predicted - measured| / measured`` of each point."""
    return [abs(coef.predict(p.tokens, p.pairs, p.sampled) - p.seconds) / p.seconds for p in points]


def median_relative_error(coef: StepCoefficients, points: Sequence[StepPoint]) -> float:
    """The median absolute relative error of predicted step time over ``points``.

    Over the points ``coef`` was fitted to (in-sample) this is optimistic: a least-absolute-error fit of ``k``
    coefficients passes through ``k`` of its points (as a median is one of its sample's values), so ``k`` of the
    errors (up to four) are 0: all of them for four points and four coefficients.
    :func:`cross_validated_errors` measures the fit on points it did not see."""
    return statistics.median(relative_errors(coef, points))


def error_measurable(num_points: int) -> bool:
    """Whether a fit of ``num_points`` points has an error to measure: more points than coefficients (with as
    many, the fit needs every point to fix its coefficients, and leaving one out leaves too few to fit)."""
    return num_points > len(COEFFICIENTS)


def cross_validated_predictions(points: Sequence[StepPoint]) -> list[float] | None:
    """Each point's step time as predicted by the fit of the *other* points (leave-one-out), in the points'
    order; ``None`` when :func:`error_measurable` is false. One fit per point (the default grid of
    ``kvretain profile``: 24 fits of 23 points)."""
    if not error_measurable(len(points)):
        return None
    out = []
    for i, p in enumerate(points):
        coef = fit([*points[:i], *points[i + 1 :]])
        out.append(coef.predict(p.tokens, p.pairs, p.sampled))
    return out


def cross_validated_errors(points: Sequence[StepPoint]) -> list[float] | None:
    """Each point's ``|predicted - measured| / measured`` by the fit of the other points
    (:func:`cross_validated_predictions`): how far the fitted model is off on a step it was not fitted to,
    which is what the simulator asks of it. ``None`` when :func:`error_measurable` is false."""
    pred = cross_validated_predictions(points)
    if pred is None:
        return None
    return [abs(t - p.seconds) / p.seconds for t, p in zip(pred, points, strict=True)]


@dataclass(frozen=True)
class Profile:
    """A cost-model file's contents: the coefficients, the measured points and what was measured."""

    coefficients: StepCoefficients
    points: tuple[StepPoint, ...] = ()
    info: Mapping[str, Any] = field(default_factory=dict)
    """Strings and numbers describing the run (engine, model, device, block size...): informational."""

    def median_relative_error(self) -> float | None:
        """The in-sample median error of :attr:`coefficients` over :attr:`points` (:func:`median_relative_error`),
        ``None`` without more points than coefficients (:func:`error_measurable`: a fit of four points reads
        0.0%, whatever the engine does between them)."""
        if not error_measurable(len(self.points)):
            return None
        return median_relative_error(self.coefficients, self.points)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"cannot write {v!r} to TOML")
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    raise ValueError(f"cannot write {type(v).__name__} {v!r} to TOML")


def check_info(info: Mapping[str, Any], where: str = "cost model") -> None:
    """``ValueError`` naming ``where`` unless every ``[profile]`` value is printable text or a number: what a run
    prints and reports (the model and device a profile was measured on), nothing that moves the cursor."""
    for key, value in info.items():
        if isinstance(value, str):
            if not value.isprintable():
                raise ValueError(f"{where}: [profile] {key} must be printable text, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where}: [profile] {key} must be a string or a number, got {value!r}")


def dumps(profile: Profile) -> str:
    """The TOML text of ``profile`` (``[profile]`` info, ``[coefficients]``, one ``[[point]]`` per step);
    ``ValueError`` for info that :func:`loads` would refuse (:func:`check_info`)."""
    check_info(profile.info)
    lines = [
        "# kvretain cost model: measured step times and their fit (`kvretain simulate --cost-model FILE`)",
        "",
        "[profile]",
    ]
    lines.append(f"format = {FORMAT}")
    err = profile.median_relative_error()
    info = dict(profile.info)
    if err is not None:
        info["median_abs_rel_error"] = err
    else:  # (not measurable: a value read from a file of more points would be another fit's)
        info.pop("median_abs_rel_error", None)
    for k, v in info.items():
        if k == "format":
            continue
        lines.append(f"{k} = {_toml_value(v)}" + INFO_COMMENTS.get(k, ""))
    lines += ["", "[coefficients]  # seconds"]
    for name in COEFFICIENTS:
        lines.append(f"{name} = {_toml_value(float(getattr(profile.coefficients, name)))}")
    for p in profile.points:
        lines += [
            "",
            "[[point]]",
            f"kind = {_toml_value(p.kind)}",
            f"tokens = {p.tokens}",
            f"pairs = {p.pairs}",
            f"sampled = {p.sampled}",
            f"seconds = {_toml_value(float(p.seconds))}",
        ]
        if p.step_seconds is not None:
            lines.append(f"step_seconds = {_toml_value(float(p.step_seconds))}")
    return "\n".join(lines) + "\n"


def write_profile(path: str | Path, profile: Profile) -> None:
    with output_file(path) as fh:  # whole or not at all (standard output: in place)
        fh.write(dumps(profile))


def loads(text: str, where: str = "cost model") -> Profile:
    """The profile in TOML ``text``; ``ValueError`` naming ``where`` and the bad field otherwise."""
    try:
        data = tomllib.loads(text)
    except ValueError as e:  # (TOMLDecodeError, and an integer past Python's 4,300-digit limit)
        raise ValueError(f"{where}: not TOML: {e}") from None
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:  # (a misspelt [[points]] loaded no points, silently)
        raise ValueError(
            f"{where}: unknown top-level table(s) or key(s) {', '.join(unknown)}; a cost model file holds "
            "[profile], [coefficients] and [[point]]"
        )
    info = data.get("profile", {})
    if not isinstance(info, dict):
        raise ValueError(f"{where}: [profile] must be a table")
    fmt = info.get("format", FORMAT)
    if type(fmt) is not int or fmt != FORMAT:  # (true == 1 in Python)
        raise ValueError(f"{where}: [profile] format {fmt!r} is not {FORMAT}")
    check_info(info, where)
    coef = data.get("coefficients")
    if not isinstance(coef, dict):
        raise ValueError(f"{where}: no [coefficients] table (write one with `kvretain profile`)")
    missing = [n for n in COEFFICIENTS if n not in coef]
    if missing:
        raise ValueError(f"{where}: [coefficients] lacks {', '.join(missing)}")
    unknown = sorted(set(coef) - set(COEFFICIENTS))
    if unknown:
        raise ValueError(f"{where}: [coefficients] has unknown field(s) {', '.join(unknown)}")
    try:
        coefficients = StepCoefficients(**{n: coef[n] for n in COEFFICIENTS})
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    raw_points = data.get("point", [])
    if not isinstance(raw_points, list):
        raise ValueError(f"{where}: point must be an array of tables ([[point]])")
    points = []
    for i, p in enumerate(raw_points):
        try:
            if not isinstance(p, dict):
                raise ValueError("must be a table")
            extra = sorted(set(p) - set(POINT_FIELDS))
            if extra:
                raise ValueError(
                    f"has unknown field(s) {', '.join(extra)}; a point holds {', '.join(POINT_FIELDS)}"
                )
            kind = p.get("kind", "")
            if not (isinstance(kind, str) and kind.isprintable()):
                raise ValueError(f"kind must be text, got {as_written(kind)}")
            points.append(
                StepPoint(
                    p["tokens"],
                    p["pairs"],
                    p["sampled"],
                    p["seconds"],
                    kind,
                    p.get("step_seconds"),
                )
            )
        except KeyError as e:
            raise ValueError(f"{where}: point {i + 1} lacks {e.args[0]}") from None
        except ValueError as e:
            raise ValueError(f"{where}: point {i + 1}: {e}") from None
    return Profile(coefficients, tuple(points), {k: v for k, v in info.items() if k != "format"})


def load_profile(path: str | Path) -> Profile:
    """The profile in the TOML file at ``path``; ``ValueError`` naming the file and the bad field."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"cost model file {str(path)!r}: {not_utf8(e)}") from None
    except OSError as e:
        raise ValueError(f"cost model file {str(path)!r}: {e.strerror or e}") from None
    return loads(text, where=f"cost model file {str(path)!r}")


class ProfiledCostModel(CostModel):
    """Step times from a profile's coefficients; sizes (weights, KV bytes, capacity) from the catalog's
    ``model`` and ``gpu`` as the roofline model (pass ``--kv-blocks`` to match the profiled engine's pool)."""

    def __init__(self, model: ModelSpec, gpu: GPUSpec, tp: int | None, profile: Profile) -> None:
        super().__init__(model, gpu, tp)
        self.profile = profile
        self._c = profile.coefficients.as_tuple()

    def _roofline(self, tokens: int, pairs: int, kv_tokens: int, sampled: int) -> float:
        if tokens == 0:
            return 0.0
        c0, ct, cp, cs = self._c
        return c0 + ct * tokens + cp * pairs + cs * sampled
