"""Model and GPU catalogs for the cost model, stored as TOML.

Built-in entries live in ``catalog/models.toml`` and ``catalog/gpus.toml`` inside the package. Users add
their own with a TOML file of the same shape::

    [models.my-13b]
    n_layers = 40
    d_model = 5120
    n_q_heads = 40
    n_kv_heads = 40
    head_dim = 128
    ffn_dim = 13824
    vocab_size = 32000

    [gpus.my-gpu]
    peak_flops = 400e12
    mem_bandwidth = 2e12
    mem_bytes = 68719476736

and ``load_catalog(path)``, which returns the built-ins extended (and, for equal names, overridden) by the
file's entries. Names are matched case-insensitively (two entries of one file whose names differ only in case
are refused). Bad input raises ``CatalogError`` naming the file, the entry and the field.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

from kvretain.fileio import as_written, not_utf8


class CatalogError(ValueError):
    """A catalog file is missing, malformed, or an entry has a missing or bad field."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A dense decoder-only transformer (Llama-style: GQA attention, SwiGLU MLP)."""

    name: str
    n_layers: int
    d_model: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    bytes_per_param: int = 2  # bf16
    tp: int = 1  # default tensor parallelism of one replica
    tied_embeddings: bool = False  # True when the LM head reuses the input embedding matrix

    def __post_init__(self) -> None:
        if self.n_q_heads % self.n_kv_heads:
            raise CatalogError(f"model {self.name!r}: n_q_heads must be a multiple of n_kv_heads")


@dataclass(frozen=True, slots=True)
class GPUSpec:
    """One accelerator. Efficiencies scale the peaks to what a real engine reaches (field notes: 40-70%)."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    mem_bandwidth: float  # HBM bytes/s
    mem_bytes: int  # device memory
    compute_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.7
    step_overhead_s: float = 0.0005  # scheduling, launches, sampling: paid once per engine step
    link_bandwidth: float = 300e9  # per-GPU interconnect bytes/s, for tensor-parallel all-reduce
    allreduce_latency_s: float = 8e-6  # fixed latency of one all-reduce

    def ideal(self) -> GPUSpec:
        """The same GPU at 100% efficiency with no step overhead: the pure roofline of the field notes."""
        return replace(self, compute_efficiency=1.0, bandwidth_efficiency=1.0, step_overhead_s=0.0)


# Field name -> (accepted python types, required). ``name`` comes from the table key.
_MODEL_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "n_layers": ((int,), True),
    "d_model": ((int,), True),
    "n_q_heads": ((int,), True),
    "n_kv_heads": ((int,), True),
    "head_dim": ((int,), True),
    "ffn_dim": ((int,), True),
    "vocab_size": ((int,), True),
    "bytes_per_param": ((int,), False),
    "tp": ((int,), False),
    "tied_embeddings": ((bool,), False),
}
_GPU_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "peak_flops": ((int, float), True),
    "mem_bandwidth": ((int, float), True),
    "mem_bytes": ((int,), True),
    "compute_efficiency": ((int, float), False),
    "bandwidth_efficiency": ((int, float), False),
    "step_overhead_s": ((int, float), False),
    "link_bandwidth": ((int, float), False),
    "allreduce_latency_s": ((int, float), False),
}
_FRACTIONS = {"compute_efficiency", "bandwidth_efficiency"}
_NON_NEGATIVE = {"step_overhead_s", "allreduce_latency_s"}

# Field name -> (lowest, highest, unit): the physically plausible range of each number, checked when a catalog is
# read. Generous on purpose: from a phone's NPU or a small embedded model to devices and models years past
# today's, so that only a typo or a unit mistake (1e-300 FLOP/s, a size in GB where bytes are meant) is refused,
# not a real part. Past them the simulated clock ran to ~1e302 s and the means to inf, reported as a result.
_BOUNDS: dict[str, tuple[float, float, str]] = {
    # models: sizes of one transformer's shapes
    "n_layers": (1, 10_000, ""),  # today's largest stacks have ~100-200 layers
    "d_model": (1, 1 << 20, ""),  # today's widest models ~16-32k; 1M is far past any
    "n_q_heads": (1, 1 << 16, ""),  # 64-128 heads today
    "n_kv_heads": (1, 1 << 16, ""),  # (at most n_q_heads: ModelSpec checks the multiple)
    "head_dim": (1, 1 << 16, ""),  # 64-256 today
    "ffn_dim": (1, 1 << 22, ""),  # ~50-100k today; 4M is far past any
    "vocab_size": (1, 1 << 24, ""),  # ~250k today (multilingual); 16M covers byte-pair tables of any size
    "bytes_per_param": (1, 8, ""),  # int8/fp8 (1) to fp64 (8) weights
    "tp": (1, 1024, ""),  # tensor parallelism of one replica: 8-64 GPUs today
    # GPUs: one device's rates and sizes
    "peak_flops": (1e9, 1e18, " FLOP/s"),  # a microcontroller-class NPU ~1e9-1e12; a GPU today ~1e15-1e16
    "mem_bandwidth": (1e8, 1e15, " B/s"),  # LPDDR on a phone ~5e10; HBM today ~5e12-1e13
    "mem_bytes": (1 << 20, 1 << 50, " bytes"),  # 1 MiB (an embedded accelerator's SRAM) to 1 PiB; today ~1e11
    # the share of peak a step sustains: well under 0.1% is not a GPU at work
    "compute_efficiency": (1e-3, 1, ""),
    "bandwidth_efficiency": (1e-3, 1, ""),  # the same, of the memory bandwidth
    "step_overhead_s": (0, 10, " s"),  # per engine step: ~0.1-5 ms today; a 10 s step is no serving engine
    "link_bandwidth": (1e6, 1e15, " B/s"),  # 1 MB/s (slower than any network link) to 1 PB/s; NVLink ~1e12
    "allreduce_latency_s": (0, 1, " s"),  # ~5-50 us today; a second is slower than any interconnect
}
assert set(_BOUNDS) == (set(_MODEL_FIELDS) | set(_GPU_FIELDS)) - {"tied_embeddings"}
assert set(_MODEL_FIELDS) | {"name"} == {f.name for f in fields(ModelSpec)}
assert set(_GPU_FIELDS) | {"name"} == {f.name for f in fields(GPUSpec)}


@dataclass(frozen=True)
class Catalog:
    """Models and GPUs by lower-cased name."""

    models: Mapping[str, ModelSpec] = field(default_factory=dict)
    gpus: Mapping[str, GPUSpec] = field(default_factory=dict)

    def model(self, name: str) -> ModelSpec:
        try:
            return self.models[name.lower()]
        except KeyError:
            raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(self.models))}") from None

    def gpu(self, name: str) -> GPUSpec:
        try:
            return self.gpus[name.lower()]
        except KeyError:
            raise KeyError(f"unknown GPU {name!r}; known: {', '.join(sorted(self.gpus))}") from None

    def merged(self, other: Catalog) -> Catalog:
        """This catalog plus ``other``'s entries; ``other`` wins on equal names."""
        return Catalog({**self.models, **other.models}, {**self.gpus, **other.gpus})


def is_finite(value: object) -> bool:
    """A number (an int or a float, not a bool) that is finite and within a float's range: TOML integers have no
    bound, and ``math.isfinite`` of one past 1.8e308 raises ``OverflowError``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _bound(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _check_fields(
    where: str, raw: Any, schema: Mapping[str, tuple[tuple[type, ...], bool]]
) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise CatalogError(f"{where}: expected a table, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(schema))
    if unknown:
        raise CatalogError(f"{where}: unknown field {unknown[0]!r}; known fields: {', '.join(schema)}")
    out: dict[str, Any] = {}
    for key, (types, required) in schema.items():
        if key not in raw:
            if required:
                raise CatalogError(f"{where}: missing field {key!r}")
            continue
        value = raw[key]
        # bool is a subclass of int: reject it for numeric fields.
        ok = isinstance(value, types) and (bool in types or not isinstance(value, bool))
        if not ok:
            want = " or ".join(t.__name__ for t in types)
            raise CatalogError(f"{where}: field {key!r} must be {want}, got {as_written(value)}")
        if bool not in types:
            if not is_finite(value):
                raise CatalogError(f"{where}: field {key!r} must be a finite number, got {as_written(value)}")
            if key in _FRACTIONS and not 0 < value <= 1:
                raise CatalogError(f"{where}: field {key!r} must be in (0, 1], got {as_written(value)}")
            if key in _NON_NEGATIVE and value < 0:
                raise CatalogError(f"{where}: field {key!r} must be >= 0, got {as_written(value)}")
            if key not in _FRACTIONS | _NON_NEGATIVE and value <= 0:
                raise CatalogError(f"{where}: field {key!r} must be > 0, got {as_written(value)}")
            lo, hi, unit = _BOUNDS[key]
            if not lo <= value <= hi:
                raise CatalogError(
                    f"{where}: field {key!r} must be in [{_bound(lo)}, {_bound(hi)}]{unit} (a plausible range), "
                    f"got {as_written(value)}"
                )
        out[key] = value
    return out


def parse_catalog(data: Mapping[str, Any], source: str) -> Catalog:
    """A catalog from parsed TOML (``{"models": {...}, "gpus": {...}}``); ``source`` names it in errors."""
    unknown = sorted(set(data) - {"models", "gpus"})
    if unknown:
        raise CatalogError(f"{source}: unknown top-level table {unknown[0]!r}; expected 'models' or 'gpus'")
    for table in ("models", "gpus"):
        if not isinstance(data.get(table, {}), dict):
            raise CatalogError(
                f"{source}: {table!r} must be a table of named entries ([{table}.NAME]), "
                f"got {type(data[table]).__name__}"
            )
    for table in ("models", "gpus"):
        seen: dict[str, str] = {}
        for name in data.get(table, {}):
            if name.lower() in seen:  # (a TOML file may hold both; the catalog keeps one)
                raise CatalogError(
                    f"{source}: {table} {seen[name.lower()]!r} and {name!r} name the same entry (names are "
                    "matched case-insensitively)"
                )
            seen[name.lower()] = name
    models: dict[str, ModelSpec] = {}
    for name, raw in data.get("models", {}).items():
        values = _check_fields(f"{source}: model {name!r}", raw, _MODEL_FIELDS)
        try:
            models[name.lower()] = ModelSpec(name=name, **values)
        except CatalogError as e:
            raise CatalogError(f"{source}: {e}") from None
    gpus: dict[str, GPUSpec] = {}
    for name, raw in data.get("gpus", {}).items():
        values = _check_fields(f"{source}: GPU {name!r}", raw, _GPU_FIELDS)
        gpus[name.lower()] = GPUSpec(name=name, **values)
    return Catalog(models, gpus)


def _read_toml(text: str, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except ValueError as e:  # (TOMLDecodeError, and an integer past Python's 4,300-digit limit)
        raise CatalogError(f"{source}: invalid TOML: {e}") from None


def builtin_catalog() -> Catalog:
    """The catalogs shipped in ``kvretain/engine/sim/catalog/*.toml``."""
    cat = Catalog()
    folder = resources.files("kvretain.engine.sim").joinpath("catalog")
    for fname in ("models.toml", "gpus.toml"):
        source = f"built-in catalog {fname}"
        cat = cat.merged(parse_catalog(_read_toml(folder.joinpath(fname).read_text("utf-8"), source), source))
    return cat


def load_catalog(path: str | Path, base: Catalog | None = None) -> Catalog:
    """The built-in catalog (or ``base``) extended by the models and GPUs of the TOML file at ``path``."""
    p = Path(path)
    try:
        text = p.read_text("utf-8")
    except FileNotFoundError:
        raise CatalogError(f"catalog file not found: {p}") from None
    except IsADirectoryError:
        raise CatalogError(f"catalog file {p} is a folder (pass a TOML file)") from None
    except OSError as e:
        raise CatalogError(f"cannot read catalog file {p}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise CatalogError(f"{p}: {not_utf8(e)}") from None
    user = parse_catalog(_read_toml(text, str(p)), str(p))
    return (base if base is not None else builtin_catalog()).merged(user)
