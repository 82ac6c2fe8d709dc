"""Calibration files: the codebooks of `nuqN` specs and the rotations of `-crot` specs, fitted offline on
calibration text; allocations (`budget=B`) resolved through them. No pickle anywhere.

A calibration is two files side by side:

    NAME.safetensors   tensors "codebook/<layer>/<k|v>/<spec>": (2^bits,) float32 levels, ascending, in about
                       [-1, 1]: the values a block normalized by its scale (and centre) is rounded to;
                       "rotation/<layer>/<k|v>/<spec>": (D, D) float32 orthogonal M of a -crot spec
                       (`kvquant.codecs.calibrot`: learned to preserve the attention output)
    NAME.json          metadata: model, its shape (layers, KV heads, head_dim), the schemes and specs fitted,
                       corpus, document titles, tokens, seed, samples per table, kvquant version, time

A scheme names the file with `calib=NAME.safetensors`; `kvquant.QuantizedCache` loads it once
(`safetensors.torch.load_file` and `json`) and hands each layer's codec its own table
(`Calibration.codebook`). The table key is the full spec string, so one file can hold tables for many specs
(`experiments/allocate.py` fits every candidate's) and a pre-RoPE spec has its own (its normalized keys
differ).

Fitting (`fit_codebook`): Lloyd-Max (1-D k-means) on a seeded random sample of the normalized values, from the
sample's quantiles, so the levels minimize the mean squared error of the normalized values. Running a model
over calibration text to fit every table (`calibrate`, `collect`) is `kvquant.fitting`'s: it asks the codecs
(this module sits below them, and `kvquant.codecs.calibrot` fits against `fit_codebook` and `Entry`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .calibfile import CalibrationError  # noqa: F401  (re-exported: raised by this module's readers)
from .calibfile import calib_paths as _paths
from .scheme import CALIBRATE_COMMAND, QuantSpec, Scheme, parse_spec
from .spec_types import CalibRotate, Codebook

if TYPE_CHECKING:  # torch is imported where it is used: `budget=B` parses through this module without it
    import torch

__all__ = [
    "Calibration",
    "CalibrationError",
    "Entry",
    "metadata",
    "spec_entries",
    "entries_for",
    "fit_codebook",
    "load_calibration",
    "merge_calibrations",
    "save_calibration",
]

FORMAT = "kvquant-calibration/1"


@dataclass(frozen=True)
class Entry:
    """One table: layer, role ("k" or "v"), the spec it serves and its kind: "codebook" ((2^bits,) levels of
    a nuqN spec) or "rotation" ((D, D) orthogonal matrix of a -crot spec, `kvquant.codecs.calibrot`)."""

    layer: int
    role: str
    spec: QuantSpec
    kind: str = "codebook"

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.layer}/{self.role}/{self.spec}"


def spec_tables(layer: int, role: str, spec: QuantSpec) -> list[Entry]:
    """The tables one spec needs at one layer and role: a rotation (-crot) and/or a codebook (nuqN)."""
    out = [Entry(layer, role, spec, "rotation")] if CalibRotate() in spec.transforms else []
    return out + ([Entry(layer, role, spec)] if isinstance(spec.family, Codebook) else [])


def entries_for(scheme: Scheme, num_layers: int) -> list[Entry]:
    """The tables a scheme needs on a model of num_layers layers (its codebook and calibrated-rotation
    specs, per layer and K/V)."""
    out = []
    for i in range(num_layers):
        s = scheme.for_layer(i)
        for role, spec in (("k", s.key), ("v", s.value)):
            out += spec_tables(i, role, spec)
    return out


@dataclass
class Calibration:
    """A loaded calibration: tables by name and the metadata."""

    path: str
    meta: dict
    tables: dict[str, torch.Tensor] = field(default_factory=dict)

    def codebook(self, layer: int, role: str, spec: QuantSpec) -> torch.Tensor:
        """(2^bits,) float32 levels of `spec` for `layer`'s K ("k") or V ("v")."""
        return self.table(Entry(layer, role, spec))

    def rotation(self, layer: int, role: str, spec: QuantSpec) -> torch.Tensor:
        """(D, D) float32 orthogonal matrix of the -crot `spec` for `layer`'s K ("k") or V ("v")."""
        return self.table(Entry(layer, role, spec, "rotation"))

    def table(self, entry: Entry) -> torch.Tensor:
        name, spec, layer, role = entry.name, entry.spec, entry.layer, entry.role
        if name not in self.tables:
            raise CalibrationError(
                f"calibration file {self.path} has no {entry.kind} for {spec} at layer {layer} "
                f"{role.upper()} "
                f"(it was fitted for {', '.join(self.meta.get('specs', [])) or 'other specs'}); run `"
                + CALIBRATE_COMMAND.format(scheme=spec)
                + "` for this scheme"
            )
        return self.tables[name]

    def check_model(self, shape, scheme: Scheme | None = None) -> None:
        """Refuse a file fitted on a model of another shape, or lacking a table the scheme needs."""
        got = (self.meta.get("num_layers"), self.meta.get("num_kv_heads"), self.meta.get("head_dim"))
        want = (shape.num_layers, shape.num_kv_heads, shape.head_dim)
        if got != want:
            raise CalibrationError(
                f"calibration file {self.path} was fitted on {self.meta.get('model')!r} with "
                f"(layers, KV heads, head_dim) = {got}, but this model has {want}; "
                "calibrate for this model: `"
                + CALIBRATE_COMMAND.format(scheme=str(scheme) if scheme is not None else "SCHEME")
                + "`"
            )
        if scheme is not None:
            for e in entries_for(scheme, shape.num_layers):
                self.table(e)

    def __repr__(self) -> str:
        return f"Calibration({self.path}: {len(self.tables)} tables, model {self.meta.get('model')!r})"


def load_calibration(path: str | os.PathLike):
    """Load NAME.safetensors + NAME.json (safetensors and json only: never pickle). A cache loads its file
    once (tens of KB), so nothing is memoized here. A file of vLLM FP8 k_scale / v_scale tensors
    (`experiments/export_scales.py`, `recommend.py --export`) loads as `kvquant.export.KVScales` instead: the
    scales the `vllm:fp8` codecs of the scheme divide by, layer by layer."""
    st, js = _paths(path)
    from .export import is_kv_scales_file, load_kv_scales  # torch is there already when a cache loads this

    if is_kv_scales_file(st):
        return load_kv_scales(st)
    for p in (st, js):
        if not p.is_file():
            raise CalibrationError(
                f"calibration file {p} does not exist; write it with `"
                + CALIBRATE_COMMAND.format(scheme="SCHEME").replace("calib/NAME.safetensors", str(st))
                + "` (SCHEME: the scheme without calib=)"
            )
    from safetensors.torch import load_file

    meta = json.loads(js.read_text())
    if meta.get("format") != FORMAT:
        raise CalibrationError(f"{js} is not a kvquant calibration file (format {meta.get('format')!r})")
    tables = {n: t.float() for n, t in load_file(str(st)).items()}
    return Calibration(str(path), meta, tables)


def save_calibration(
    path: str | os.PathLike, tables: dict[str, torch.Tensor], meta: dict
) -> tuple[Path, Path]:
    """Write NAME.safetensors (tables) and NAME.json (meta, plus the format tag and the table names)."""
    from safetensors.torch import save

    st, js = _paths(path)
    st.parent.mkdir(parents=True, exist_ok=True)
    # bytes written by Python (the umask's mode): save_file's files are owner-only (0600), unlike the .json
    st.write_bytes(save({n: t.detach().float().contiguous().cpu() for n, t in tables.items()}))
    meta = {"format": FORMAT, **meta, "tables": sorted(tables)}
    js.write_text(json.dumps(meta, indent=1) + "\n")
    return st, js


# ------------------------------------------------------------------------------------------------ fitting


def fit_codebook(
    values: torch.Tensor, bits: int, *, seed: int = 0, max_samples: int = 1_000_000
) -> torch.Tensor:
    """Lloyd-Max levels for `values` (any shape), i.e. 1-D k-means on the empirical distribution:
    (2^bits,) float32, strictly ascending.

    Exact Lloyd iterations on the sorted sample with prefix sums (each step: the cells are the midpoints
    between levels, a level moves to its cell's mean), from the sample's quantiles, until no level moves by
    more than 1e-7 or 200 steps. The same fixed point as `scipy.cluster.vq.kmeans2` from that start, at a
    small fraction of the cost (270 tables of 1M values fit in seconds rather than most of an hour on a
    shared CPU)."""
    import numpy as np
    import torch

    k = 1 << bits
    x = values.detach().flatten().float()
    x = x[torch.isfinite(x)]
    if x.numel() < k:
        raise ValueError(f"{x.numel()} calibration values cannot fit {k} levels")
    g = torch.Generator().manual_seed(seed)
    if x.numel() > max_samples:
        x = x[torch.randperm(x.numel(), generator=g)[:max_samples]]
    data = np.sort(x.double().numpy())
    csum = np.concatenate([[0.0], np.cumsum(data)])
    levels = np.quantile(data, (np.arange(k) + 0.5) / k)
    for _ in range(200):
        cuts = np.searchsorted(data, (levels[1:] + levels[:-1]) / 2)  # cell i: data[cuts[i-1]:cuts[i]]
        lo = np.concatenate([[0], cuts])
        hi = np.concatenate([cuts, [data.size]])
        n = hi - lo
        new = np.where(
            n > 0, (csum[hi] - csum[lo]) / np.maximum(n, 1), levels
        )  # an empty cell keeps its level
        done = np.abs(new - levels).max() < 1e-7
        levels = np.sort(new)
        if done:
            break
    levels = np.unique(levels.astype(np.float32))
    while levels.size < k:  # cells merged (point masses): add the midpoint of the widest gap
        edges = np.concatenate([[min(-1.0, levels[0] - 1.0)], levels, [max(1.0, levels[-1] + 1.0)]])
        i = int(np.diff(edges).argmax())
        levels = np.unique(np.append(levels, np.float32((edges[i] + edges[i + 1]) / 2)))
    return torch.tensor(levels, dtype=torch.float32)


def metadata(model_name: str, shape, schemes: Sequence[str], entries: Sequence[Entry], **extra) -> dict:
    """The JSON side of a calibration file."""
    from . import __version__

    return {
        "model": model_name,
        "num_layers": shape.num_layers,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "schemes": list(schemes),
        "specs": sorted({f"{e.role}:{e.spec}" for e in entries}),
        "kvquant_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **extra,
    }


def spec_entries(specs: Iterable[str | QuantSpec], role: str, num_layers: int) -> list[Entry]:
    """Entries for codebook and -crot specs at every layer (allocation candidates)."""
    return [e for s in map(parse_spec, specs) for i in range(num_layers) for e in spec_tables(i, role, s)]


# ------------------------------------------------------------------------------------------------ budget=B


def store_allocation(calib: str, budget: float, scheme: Scheme, **facts) -> Path:
    """Add (or replace) the allocation for `budget` in calib's JSON: what `budget=B,calib=FILE` resolves to.
    The scheme is stored without calib= (the file is where it lives); its tables must be in the file."""
    _, js = _paths(calib)
    meta = json.loads(js.read_text())
    held = set(meta.get("tables", []))
    missing = [e.name for e in entries_for(scheme, meta["num_layers"]) if e.name not in held]
    if missing:
        raise CalibrationError(
            f"{js} lacks {len(missing)} tables the allocation needs (first: {missing[0]}); calibrate its "
            "candidates into this file first"
        )
    plain = dataclasses.replace(scheme, calib=None)
    rows = [a for a in meta.get("allocations", []) if abs(float(a["budget_bits"]) - budget) > 1e-9]
    meta["allocations"] = sorted(
        [*rows, {"budget_bits": budget, "scheme": str(plain), **facts}], key=lambda a: a["budget_bits"]
    )
    js.write_text(json.dumps(meta, indent=1) + "\n")
    return js


def merge_calibrations(sources: Sequence[str | os.PathLike], out: str | os.PathLike) -> tuple[Path, Path]:
    """One file holding every table of `sources` (fitted on the same model): a scheme names one calib=
    file, so candidates fitted apart (nuqN codebooks, -crot rotations) are merged to be allocated together.
    A table two sources both hold must be equal; the JSON keeps the first source's model and shape, the union
    of specs and schemes, and each source's own metadata under "merged_from" (allocations are not carried)."""
    import torch

    if len(sources) < 2:
        raise CalibrationError(f"merging needs at least two calibration files, got {len(sources)}")
    loaded = [load_calibration(s) for s in sources]
    shape_keys = ("num_layers", "num_kv_heads", "head_dim")
    first = loaded[0]
    tables: dict[str, torch.Tensor] = {}
    for cal in loaded:
        if tuple(cal.meta.get(k) for k in shape_keys) != tuple(first.meta.get(k) for k in shape_keys):
            raise CalibrationError(f"{cal.path} was fitted on another model shape than {first.path}")
        for name, t in cal.tables.items():
            if name in tables and not torch.equal(tables[name], t):
                raise CalibrationError(f"{name} differs between the files merged ({cal.path}); keep one")
            tables[name] = t
    skip = {"format", "tables", "allocations", "schemes", "specs"}
    meta = {k: v for k, v in first.meta.items() if k in (*shape_keys, "model")}
    meta["schemes"] = sorted({s for cal in loaded for s in cal.meta.get("schemes", [])})
    meta["specs"] = sorted({s for cal in loaded for s in cal.meta.get("specs", [])})
    meta["merged_from"] = [
        {"path": str(cal.path), **{k: v for k, v in cal.meta.items() if k not in skip}} for cal in loaded
    ]
    return save_calibration(out, tables, meta)
