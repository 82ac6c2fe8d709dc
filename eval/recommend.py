"""Which KV-cache format to deploy in a serving engine, measured offline: `experiments/recommend.py`.

For one model and one engine (vllm, llama.cpp, sglang, trtllm) this lists every KV format the engine offers,
refuses the ones the engine would refuse for this model (head_dim not a multiple of its block, ...) or that
kvquant does not reproduce (with the reason), adds the skip-layer variants the engine allows (vLLM's
`--kv-cache-dtype-skip-layers`: the two boundary layers, and on hybrid models the sliding-window layers) and
kvquant's own recipes at comparable bits for contrast, and runs them all through the one run harness
(`kvquant.eval.runner.run`: resume, lock, progress, report and plots) in `prefill` mode (what an engine
does: the prompt computed in full precision, stored quantized, the continuation decoded) and in `cache`
mode (every token decoded through the quantized cache). It then ranks the candidates and prints the
command that deploys the pick.

The pick: the engine format (or skip-layer variant) with the fewest bytes per token whose prefill-mode drift
interval lies within +-tolerance in every bucket; when none does, the one with the lowest KL. kvquant's
recipes are never the pick (no engine runs them); the report says what the best of them would gain.

With `export` (`--export DIR`, vLLM only) the per-layer FP8 k_scale / v_scale are computed on calibration text
(other documents of the corpus than the evaluation's; llm-compressor's max|x| / 448, `kvquant.export`),
written
as vLLM loads them (DIR/kv_scales.safetensors, DIR/kv_cache_scheme.json) and scored as the row
`fp8 (calibrated)`: the scheme `vllm:fp8,calib=DIR/kv_scales.safetensors`, whose codecs divide by exactly
the scales in that file, beside vLLM's default scale 1.0 (`fp8`). An existing DIR/kv_scales.safetensors is
used as it is (a rerun, a shard or a torchrun rank evaluates the same file).

Formats that follow another engine's arithmetic stand in for an engine whose own is not reproduced here
(SGLang's and TensorRT-LLM's FP8 are scored with vLLM's saturating E4M3 write, TensorRT-LLM's NVFP4 with
ggml's block): their rows say `proxy`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .config import ANSWER_ROOM, RunConfig, RunError, Shard, model_facts

__all__ = [
    "ENGINES",
    "GPUS",
    "Candidate",
    "Plan",
    "Recommendation",
    "Skipped",
    "candidates_for",
    "recommend",
]

logger = logging.getLogger(__name__)

ENGINES = ("vllm", "llama.cpp", "sglang", "trtllm")
# memory of a named GPU (bytes, as vendors state them); the KV budget is a fraction of it less the weights
GPUS: dict[str, float] = {
    "h200": 141e9, "h100": 80e9, "a100-80g": 80e9, "a100-40g": 40e9, "l40s": 48e9, "rtx4090": 24e9,
    "b200": 180e9,
}
GPU_UTILIZATION = 0.92  # vLLM's gpu_memory_utilization default (vllm/config/cache.py)
DEFAULT_TOLERANCE = 0.01  # drift interval within +-1% in every bucket
# kvquant recipes shown for contrast, by the nominal bits they compare with; the last of each is kvquant's
# best at those bits on the default model (docs/results.md, "The research recipes": 4.5 and 3.5 bits)
KVQUANT_RECIPES: dict[int, tuple[str, ...]] = {
    8: ("k=int8-channel-g64,v=int8-head",),
    4: ("k=int4-channel-g64,v=int4-g64", "int4-g64-rot",
        "k=int4-channel-g64-rot,v=int4-g64-rot,sink=4,window=128"),
    3: ("k=int4-channel-g64-rot,v=int2-g64-rot,sink=4,window=128",),
}
# the recipes each engine's table shows: llama.cpp's 8- and 4-bit block types against all of 8 and 4; vLLM's
# int4_per_token_head and TurboQuant presets (3 to 6 bits) against kvquant's best at 8, 4.5 and 3.5 bits
ENGINE_RECIPES: dict[str, tuple[str, ...]] = {
    "vllm": (KVQUANT_RECIPES[8][-1], KVQUANT_RECIPES[4][-1], KVQUANT_RECIPES[3][-1]),
    "llama.cpp": KVQUANT_RECIPES[8] + KVQUANT_RECIPES[4],
    "sglang": KVQUANT_RECIPES[8],
    "trtllm": KVQUANT_RECIPES[8] + KVQUANT_RECIPES[4][:2],
}


@dataclass(frozen=True)
class Candidate:
    """One row to measure: a kvquant scheme string, what the engine calls it, and how to deploy it."""

    scheme: str
    label: str  # as the engine names it: `fp8`, `q8_0 / q4_0`, `fp8 skip 0,29`
    kind: str  # "engine" | "skip-layers" | "kvquant"
    deploy: str | None = None  # the exact command (None for kvquant's recipes)
    note: str = ""  # e.g. "proxy: vLLM's arithmetic"


@dataclass(frozen=True)
class Skipped:
    label: str
    reason: str


@dataclass(frozen=True)
class Plan:
    """What `recommend` measures for one model and engine."""

    engine: str
    model_name: str
    candidates: tuple[Candidate, ...]
    skipped: tuple[Skipped, ...]


@dataclass(frozen=True)
class Recommendation:
    plan: Plan
    rows: list[dict]  # one per candidate (ranked), the summary's `all` rows of both modes merged
    pick: Candidate | None
    better: str  # what kvquant's best recipe would gain, one sentence (or "")
    table: str  # the ranked markdown table
    out: Path
    seconds: float = 0.0
    run_dirs: dict[str, Path] = field(default_factory=dict)
    part_only: bool = False  # a shard's (or a torchrun rank's) part was measured: nothing ranked yet
    exported: str = ""  # with --export: where the calibrated scales are and what they are, one line


# ------------------------------------------------------------------------------------------ candidates


def _deploy(engine: str, model: str, gguf: str | None, name: str, k: str | None = None,
            skip: Sequence[int] = ()) -> str:
    if engine == "vllm":
        cmd = f"vllm serve {model} --kv-cache-dtype {name}"
        return cmd + (f" --kv-cache-dtype-skip-layers {','.join(map(str, skip))}" if skip else "")
    if engine == "llama.cpp":
        return f"llama-server -m {gguf or model + '.gguf'} -ctk {k or name} -ctv {name} -fa on"
    if engine == "sglang":
        return f"python -m sglang.launch_server --model-path {model} --kv-cache-dtype {name}"
    return f"trtllm-serve {model} --kv_cache_dtype {name}"  # trtllm: the LLM API's KvCacheConfig(dtype=...)


def _llama_cpp(model: str, gguf: str | None) -> list[Candidate]:
    """llama.cpp's cache types as it runs them (Hadamard-rotated Q/K/V when head_dim % 64 == 0, its default
    since April 2026), and q8_0 / q4_0 without the rotation (LLAMA_ATTN_ROT_DISABLE=1) for contrast."""
    out = [Candidate(f"llama.cpp:{t}", t, "engine", _deploy("llama.cpp", model, gguf, t))
           for t in ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")]
    out.append(Candidate("llama.cpp:k=q8_0,v=q4_0", "q8_0 / q4_0", "engine",
                         _deploy("llama.cpp", model, gguf, "q4_0", k="q8_0")))
    out += [Candidate(f"llama.cpp:{t}-norot", f"{t}, no rotation", "engine",
                      "LLAMA_ATTN_ROT_DISABLE=1 " + _deploy("llama.cpp", model, gguf, t))
            for t in ("q8_0", "q4_0")]
    return out


VLLM_TURBOQUANT = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")


def candidates_for(engine: str, model: str | None = None, facts=None, scales: str | None = None) -> Plan:
    """The formats `engine` offers for this model, its skip-layer variants and kvquant's contrast recipes,
    each checked against the model's shape (read from its config file, nothing loaded); refusals name the
    rule. scales: a vLLM k/v scales file (`--export`): adds `fp8 (calibrated)`, vllm:fp8 reading it."""
    from kvquant.scheme import ENGINE_REFUSED, SchemeError, parse_scheme

    if engine not in ENGINES:
        raise RunError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    facts = facts or model_facts(model)
    name, gguf = _model_names(model)
    cands: list[Candidate] = []
    skipped: list[Skipped] = []
    if engine == "vllm":
        from kvquant.codecs.engine_vllm import vllm_cache_scheme

        for n in ("fp8", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"):
            cands.append(Candidate(f"vllm:{n}", n, "engine", _deploy("vllm", name, gguf, n)))
        if scales is not None:
            folder = Path(scales).parent
            cands.append(Candidate(
                f"vllm:fp8,calib={scales}", "fp8 (calibrated)", "engine",
                _deploy("vllm", name, gguf, "fp8") + f"  # the checkpoint with {folder}'s scales merged in",
                note=f"k_scale / v_scale of {scales}",
            ))
        if facts.layers is not None:  # as vLLM serves them: its two boundary layers at each end unquantized
            for n in VLLM_TURBOQUANT:
                served = vllm_cache_scheme(n, facts.layers)
                if served == "fp16":  # so few layers that vLLM quantizes none of them
                    skipped.append(Skipped(n, f"vLLM keeps all {facts.layers} layers unquantized"))
                    continue
                cands.append(Candidate(served, n, "engine", _deploy("vllm", name, gguf, n),
                                       note="boundary layers kept FP"))
        for n in VLLM_TURBOQUANT[1:2]:  # contrast: what the preset would give on every layer (not servable)
            cands.append(Candidate(f"vllm:{n}", f"{n} on every layer", "kvquant",
                                   note="contrast: vLLM always keeps the boundary layers"))
        refused = [(k, v) for k, v in ENGINE_REFUSED.items() if k.startswith("vllm:")]
        skipped += [Skipped(k.partition(":")[2], v) for k, v in refused]
    elif engine == "llama.cpp":
        cands += _llama_cpp(name, gguf)
    elif engine == "sglang":
        for n in ("fp8_e4m3", "fp8_e5m2"):
            cands.append(Candidate(f"vllm:{n}", n, "engine", _deploy("sglang", name, gguf, n),
                                   note="proxy: vLLM's saturating per-tensor write"))
        skipped.append(Skipped("fp4_e2m1", "SGLang's FP4 E2M1 in 16-element blocks is not reproduced"))
    else:
        cands.append(Candidate("vllm:fp8", "fp8", "engine", _deploy("trtllm", name, gguf, "fp8"),
                               note="proxy: vLLM's saturating per-tensor write"))
        cands.append(Candidate("nvfp4", "nvfp4", "engine", _deploy("trtllm", name, gguf, "nvfp4"),
                               note="proxy: ggml's NVFP4 block, per-tensor scale 1.0"))
    layers = facts.layers
    if engine == "vllm" and layers is not None and layers >= 3:
        for c in [c for c in cands if c.kind == "engine" and c.scheme == "vllm:fp8"]:
            skip = (0, layers - 1)
            body = f"1-{layers - 2}" if layers > 3 else "1"
            scheme = f"layers=0:fp16+{body}:{c.scheme}+{layers - 1}:fp16"
            cands.append(Candidate(scheme, f"{c.label} skip 0,{layers - 1}", "skip-layers",
                                   _deploy("vllm", name, gguf, c.label, skip=skip)))
        if facts.sliding_layers:
            sl = set(facts.sliding_layers)
            ranges = "+".join(f"{i}:{'fp16' if i in sl else 'vllm:fp8'}" for i in range(layers))
            cands.append(Candidate(f"layers={ranges}", "fp8 skip sliding_window", "skip-layers",
                                   _deploy("vllm", name, gguf, "fp8")
                                   + " --kv-cache-dtype-skip-layers sliding_window"))
    cands += [Candidate(r, f"kvquant {r}", "kvquant") for r in ENGINE_RECIPES[engine]]
    kept = []
    for c in cands:
        try:
            scheme = parse_scheme(c.scheme)
            if facts.layers is not None:
                scheme.check_num_layers(facts.layers)
            if facts.head_dim is not None:
                scheme.check_head_dim(facts.head_dim)
        except SchemeError as e:
            skipped.append(Skipped(c.label, f"refused for this model ({facts.source}): {e}"))
            continue
        kept.append(c)
    return Plan(engine, name, tuple(kept), tuple(skipped))


def _model_names(model: str | None) -> tuple[str, str | None]:
    """(what a deploy command names the model, the GGUF file when there is one)."""
    from kvquant.models import KNOWN_MODELS, check_model_path

    try:
        src = check_model_path(model)
    except (FileNotFoundError, ValueError) as e:
        raise RunError(str(e)) from None
    gguf = str(Path(src.folder) / src.gguf) if src.gguf else None
    if model is None:
        return "HuggingFaceTB/SmolLM2-135M-Instruct", gguf
    known = KNOWN_MODELS.get(str(model))
    return (known.hub_id if known is not None and known.hub_id else str(model)), gguf


# ----------------------------------------------------------------------------------------------- running


def _fmt_pct(x) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:+.2f}%"


def _interval(r: dict, name: str) -> str:
    v, lo, hi = r.get(name), r.get(f"{name}_lo"), r.get(f"{name}_hi")
    if v is None or not math.isfinite(v):
        return "n/a"
    if lo is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return _fmt_pct(v)
    return f"{_fmt_pct(v)} [{100 * lo:+.2f}, {100 * hi:+.2f}]"


def _within(rows: list[dict], tol: float) -> bool:
    """Every bucket's drift interval (the value, where no interval) inside +-tol."""
    if not rows:
        return False
    for r in rows:
        lo, hi = r.get("drift_lo", math.nan), r.get("drift_hi", math.nan)
        if not (math.isfinite(lo) and math.isfinite(hi)):
            lo = hi = r.get("drift", math.nan)
        if not (math.isfinite(lo) and math.isfinite(hi)) or lo < -tol or hi > tol:
            return False
    return True


def recommend(
    engine: str,
    model: str | None = None,
    *,
    corpus: str | None = None,
    max_length: int | None = None,
    docs: int | None = None,
    chunk: int | None = None,
    out: str | None = None,
    gpu: str = "h200",
    weights_gb: float = 0.0,
    tolerance: float = DEFAULT_TOLERANCE,
    quick: bool = False,
    force: bool = False,
    device: str = "cpu",
    dtype: str = "float32",
    model_obj=None,
    tokenizer=None,
    shard: Shard | None = None,
    merge: bool = False,
    passkey: bool = False,
    export: str | None = None,
    passkey_length: int | None = None,
) -> Recommendation:
    """Measure every candidate of `candidates_for(engine, model)` in prefill and cache mode (two run
    directories under `out`, each resumable) and rank them. Raises RunError for bad input before any model
    is loaded.

    The sweep runs on the one run harness (`runner.run`), so it shards as every run does (docs/scale.md):
    under torchrun the ranks divide each run directory's points and rank 0 ranks the candidates; with
    shard (`--shard I/N`, a job array) this process measures its part of both runs and ranks nothing
    (`part_only`); merge (`--merge`) measures nothing and ranks from every shard's results. passkey: also a
    passkey grid in prefill mode (one length, depths 0, 0.5, 1, one trial; its own run directory), whose
    exact-match rate becomes a column of the table (not a criterion of the pick); passkey_length: its prompt
    length (default: the run's length, the longest context measured, less the answer's room where the run
    fills the model's positions; at least 128 tokens). export: a folder for vLLM's
    calibrated FP8 k_scale / v_scale (module docstring), scored as the row `fp8 (calibrated)`."""
    from .runner import run

    _check_target(gpu, tolerance)
    scales = _check_export(export, engine)
    facts = model_facts(model)
    plan = candidates_for(engine, model, facts, scales=None if scales is None else str(scales))
    if not plan.candidates:
        raise RunError(f"{engine} offers no format kvquant can measure for this model: "
                       + "; ".join(f"{s.label}: {s.reason}" for s in plan.skipped))
    if quick:
        max_length = max_length or 1024
        chunk = chunk or 256
        docs = docs or 1
    length = max_length or facts.positions or 8192
    pk_length = passkey_prompt_length(length, passkey_length, facts.positions) if passkey else None
    plan = _drop_idle(plan, pk_length or length)  # pk_length <= length
    corpus = corpus or ("shakespeare" if length > 16384 else "wikipedia")
    default = _slug(f"{engine}-{Path(plan.model_name).name}-{length}" + ("-quick" if quick else ""))
    root = Path(out) if out else Path("runs") / "recommend" / default
    t0 = time.perf_counter()
    summaries: dict[str, list[dict]] = {}
    run_dirs: dict[str, Path] = {}
    configs = _sweep_configs(
        tuple(c.scheme for c in plan.candidates), root, pk_length, model=model, corpus=corpus, length=length,
        chunk=chunk, docs=docs, device=device, dtype=dtype, force=force, shard=shard, merge=merge,
    )
    exported = ""
    if scales is not None:
        exported = _export_scales(scales, configs["prefill"], model_obj, tokenizer, quick=quick, merge=merge)
    for name, config in configs.items():
        run_dir, summary = run(config, model=model_obj, tokenizer=tokenizer)
        summaries[name], run_dirs[name] = summary, run_dir
    if not all(summaries.values()):  # a shard's or a torchrun rank's part: the report is --merge's / rank 0's
        seconds = time.perf_counter() - t0
        return Recommendation(plan, [], None, "", "", root, seconds, run_dirs, part_only=True,
                              exported=exported)
    retrieval = summaries.pop("passkey", None)
    rows = _merge(plan, summaries)
    prompt = configs["prefill"].prefill_length
    _decoded_only(rows, prompt)
    if retrieval is not None:
        _add_passkey(rows, retrieval, pk_length)
    ranked, pick, better = _rank(rows, tolerance, facts, gpu, weights_gb, length)
    table = _table(ranked, plan, gpu, length, tolerance, prompt)
    rec = Recommendation(plan, ranked, pick, better, table, root, time.perf_counter() - t0, run_dirs,
                         exported=exported)
    _write(rec)
    return rec


def passkey_prompt_length(length: int, requested: int | None, positions: int | None) -> int:
    """The passkey column's prompt length: `requested` (default the run's `length`, the longest context
    measured), at most the run's length and the model's positions less the answer's room, at least 128."""
    if requested is not None and requested < 128:
        raise RunError(f"--passkey-length {requested}: a passkey prompt needs at least 128 tokens")
    longest = positions - ANSWER_ROOM if positions else length  # the answer's tokens need positions too
    return max(min(length, requested or length, longest), 128)


EXPORT_DOCS, EXPORT_LENGTH = 8, 2048  # calibration text of --export (experiments/export_scales.py's defaults)


def _drop_idle(plan: Plan, length: int) -> Plan:
    """The plan less the kvquant recipes that quantize nothing at `length` (a window of 128 tokens at
    --max-length 64), listed as skipped with the reason; the run harness would refuse them."""
    from kvquant.scheme import parse_scheme

    from .config import quantizes_nothing

    kept, skipped = [], list(plan.skipped)
    for c in plan.candidates:
        reason = quantizes_nothing(parse_scheme(c.scheme), length) if c.kind == "kvquant" else None
        if reason is None:
            kept.append(c)
        else:
            skipped.append(Skipped(c.label, reason))
    return dataclasses.replace(plan, candidates=tuple(kept), skipped=tuple(skipped))


def _check_export(export: str | None, engine: str) -> Path | None:
    """The scales file --export names (DIR/kv_scales.safetensors), or None; RunError before any model loads
    for an engine that does not read vLLM's k_scale / v_scale or a DIR that is a file."""
    if export is None:
        return None
    from kvquant.export import SCALES_FILE

    if engine != "vllm":
        raise RunError(f"--export writes vLLM's FP8 k_scale / v_scale and scores them; it takes --engine "
                       f"vllm, not {engine}")
    folder = Path(export)
    if folder.exists() and not folder.is_dir():
        raise RunError(f"--export {export} is a file; name a folder for kv_scales.safetensors")
    return folder / SCALES_FILE


def _export_scales(path: Path, config: RunConfig, model_obj, tokenizer, *, quick: bool, merge: bool) -> str:
    """Compute vLLM's per-layer FP8 scales on calibration text apart from the documents `config` evaluates,
    and write them to `path` (unless it exists: then those are the scales scored). Returns one line for the
    report. The model is loaded here (and freed) unless model_obj is given."""
    from kvquant.eval.calibration import calibration_documents

    from kvquant.export import describe, kv_absmax, load_kv_scales, save_kv_scales, scales_from_absmax

    from .harness import load_model
    from .runner import evaluation_titles

    if path.is_file():
        return f"scored the existing {path}: {describe(load_kv_scales(path))}"
    if merge:
        raise RunError(f"--merge scores {path}, which does not exist: the shards' --export writes it")
    model, tok, _ = load_model(config, model_obj, tokenizer)
    titles = evaluation_titles(config, tok)
    docs, length = (2 if quick else EXPORT_DOCS), min(EXPORT_LENGTH, config.max_length)
    text = calibration_documents(tok, config.corpus, docs, length, exclude_from=None, exclude_titles=titles)
    k_amax, v_amax = kv_absmax(model, [t.to(next(model.parameters()).device) for t in text.ids])
    scales = scales_from_absmax(k_amax, v_amax)
    meta = {"model": config.model or "SmolLM2-135M-Instruct (embedded)", "corpus": config.corpus,
            "documents": text.titles, "tokens": text.tokens, "observer": "minmax (max|x| / fp8 max)",
            "excluded": titles}
    save_kv_scales(scales, path.parent, metadata=meta)
    logger.info("wrote %s: %s", path, describe(scales))
    return (f"wrote {path} from {len(text.ids)} calibration documents ({text.tokens:,} tokens, none of the "
            f"evaluated ones): {describe(scales)}")


def _check_target(gpu: str, tolerance: float) -> None:
    """Refuse an unknown --gpu or a --tolerance that is not a positive fraction (before any model loads)."""
    if gpu not in GPUS:
        raise RunError(f"unknown --gpu {gpu!r}; known: {', '.join(GPUS)}")
    if not (math.isfinite(tolerance) and tolerance > 0):
        raise RunError(f"--tolerance {tolerance} must be a positive fraction, e.g. 0.01 for 1%")


def _sweep_configs(schemes: tuple, root: Path, passkey: int | None, *, model: str | None, corpus: str,
                   length: int, chunk: int | None, docs: int | None, device: str, dtype: str, force: bool,
                   shard: Shard | None, merge: bool) -> dict[str, RunConfig]:
    """The sweep's runs, one directory under `root` each: prefill and cache mode over `length` tokens, and
    with a passkey length a passkey grid at that length in prefill mode (depths 0, 0.5, 1, one trial)."""
    configs = {
        mode: RunConfig(
            schemes=schemes, model=model, corpus=corpus, mode=mode, max_length=length, chunk=chunk, docs=docs,
            device=device, dtype=dtype, out=str(root / mode), force=force, shard=shard, merge=merge,
        )
        for mode in ("prefill", "cache")
    }
    if passkey is not None:
        configs["passkey"] = RunConfig(
            schemes=schemes, model=model, corpus=corpus, mode="prefill", task="passkey",
            lengths=(passkey,), depths=(0.0, 0.5, 1.0), trials=1, chunk=chunk,
            device=device, dtype=dtype, out=str(root / "passkey"), force=force, shard=shard, merge=merge,
        )
    return configs


def _add_passkey(rows: list[dict], retrieval: list[dict], length: int) -> None:
    """Each candidate's passkey exact-match rate over the depths at `length` (prefill mode), as `passkey`
    (the run directory may also hold other lengths' points, measured earlier: not these)."""
    overall = {r["scheme"]: r for r in retrieval if str(r["length"]) == str(length) and r["depth"] == "all"}
    for row in rows:
        r = overall.get(row["label"], {})
        row["passkey"] = r.get("exact_match", math.nan) if r.get("status", "ok") == "ok" else math.nan
        row["passkey_length"] = length


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in text).strip("-")


def _labels(plan: Plan) -> dict[str, Candidate]:
    from .config import resolve_schemes

    parsed = resolve_schemes([c.scheme for c in plan.candidates])
    return {p.label: c for p, c in zip(parsed, plan.candidates, strict=True)}


def _merge(plan: Plan, summaries: dict[str, list[dict]]) -> list[dict]:
    """One dict per candidate: its prefill and cache `all` rows and per-bucket rows."""
    by_label = _labels(plan)
    out = []
    for label, cand in by_label.items():
        row: dict = {"candidate": cand, "label": label}
        for mode, summary in summaries.items():
            mine = [r for r in summary if r["scheme"] == label and r["mode"] == mode]
            row[mode] = next((r for r in mine if r["bucket"] == "all"), None)
            row[f"{mode}_buckets"] = [r for r in mine if r["bucket"] != "all"]
        out.append(row)
    return out


def _decoded_only(rows: list[dict], prompt: int) -> None:
    """Prefill mode's numbers over the decoded tokens only: the buckets inside the P-token prompt went through
    the FP forward (zero error by construction, not a measurement) leave `prefill_buckets`, and `prefill_kl`
    / `prefill_kl_p99` are the decoded buckets' (KL token-weighted; p99 the largest of theirs, exact when
    one bucket is decoded, as with the default P = half the length). The `all` row's KL averages the
    prompt's zeros in, halving it at the default P."""
    for r in rows:
        decoded = [b for b in r.get("prefill_buckets", []) if int(b["bucket_end"]) > prompt]
        r["prefill_buckets"] = decoded
        weights = [int(b.get("tokens", 0) or 0) for b in decoded]
        kl = sum(float(b.get("kl", math.nan)) * w for b, w in zip(decoded, weights, strict=True))
        r["prefill_kl"] = kl / sum(weights) if sum(weights) else math.nan
        r["prefill_kl_p99"] = max((float(b.get("kl_p99", math.nan)) for b in decoded), default=math.nan)


def _rank(rows, tol, facts, gpu, weights_gb, length):
    from kvquant import memory
    from kvquant.scheme import parse_scheme

    shape = None
    if facts.layers and facts.kv_heads and facts.head_dim:
        shape = memory.KVShape(facts.layers, facts.kv_heads, facts.head_dim, facts.sliding_window,
                               tuple(facts.sliding_layers or ()))
    budget = int(GPUS[gpu] * GPU_UTILIZATION - weights_gb * 1e9)
    for r in rows:
        p = r.get("prefill") or {}
        r["ok"] = p.get("status") == "ok" and _within(r["prefill_buckets"], tol)
        r["kl"] = r["prefill_kl"]  # the decoded tokens' (`_decoded_only`)
        r["bytes"] = p.get("bytes_per_token", math.nan)
        r["requests"] = None
        if shape is not None and budget > 0:
            try:
                scheme = parse_scheme(r["candidate"].scheme)
                r["requests"] = memory.capacity(shape, scheme, budget, length).requests
            except Exception as e:  # noqa: BLE001 - capacity is a report column; the run's numbers stand
                logger.warning("capacity of %s not computed: %s", r["label"], e)
    def key(r):
        kl = r["kl"] if math.isfinite(r["kl"]) else math.inf
        return (not r["ok"], r["bytes"] if r["ok"] else kl, kl)
    ranked = sorted(rows, key=key)
    engine_rows = [r for r in ranked if r["candidate"].kind != "kvquant"]
    pick_row = next((r for r in engine_rows if r["ok"]), None)
    if pick_row is None and engine_rows:
        pick_row = min(engine_rows, key=lambda r: r["kl"] if math.isfinite(r["kl"]) else math.inf)
    pick = pick_row["candidate"] if pick_row else None
    better = ""
    if pick_row is not None:
        ours = [r for r in ranked if r["candidate"].kind == "kvquant" and r["ok"]
                and r["bytes"] < pick_row["bytes"]]
        closer = [r for r in ranked if r["candidate"].kind == "kvquant" and r["bytes"] <= pick_row["bytes"]
                  and math.isfinite(r["kl"]) and r["kl"] < pick_row["kl"]]
        if ours:
            b = min(ours, key=lambda r: r["bytes"])
            extra = ""
            if b["requests"] is not None and pick_row["requests"] is not None:
                extra = (f", {b['requests']:,} instead of {pick_row['requests']:,} requests of {length:,} "
                         f"tokens on {gpu}")
            better = (f"kvquant's `{b['candidate'].scheme}` stays within ±{100 * tol:g}% too at "
                      f"{b['bytes']:,.0f} B/token instead of {pick_row['bytes']:,.0f} "
                      f"({pick_row['bytes'] / b['bytes']:.2f}x the capacity{extra}), if the engine had it.")
        elif closer:
            b = min(closer, key=lambda r: r["kl"])
            better = (f"kvquant's `{b['candidate'].scheme}` would cut KL from {pick_row['kl']:.5f} to "
                      f"{b['kl']:.5f} at {b['bytes']:,.0f} B/token (pick: {pick_row['bytes']:,.0f}), "
                      "if the engine had it.")
        else:
            better = "None of kvquant's recipes measured here beats the pick at the same or fewer bytes."
    return ranked, pick, better


def _table(ranked, plan: Plan, gpu: str, length: int, tol: float, prompt: int) -> str:
    buckets = []
    for r in ranked:
        for b in r["prefill_buckets"]:
            if b["bucket"] not in buckets:
                buckets.append(b["bucket"])
    passkey = next((r["passkey_length"] for r in ranked if "passkey" in r), None)
    decoded = f" (decoded after {prompt:,})" if prompt else ""
    head = (["#", "format", "kind", "bits"] + [f"prefill drift {b}" for b in buckets]
            + [f"prefill KL{decoded}", "KL p99", "cache drift", "cache KL",
               *([f"passkey exact ({passkey:,} tok)"] if passkey else []),
               "B/token", f"requests ({gpu}, {length:,} tok)", f"within ±{100 * tol:g}%"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(ranked, 1):
        c = r["candidate"]
        p, ca = r.get("prefill") or {}, r.get("cache") or {}
        per = {b["bucket"]: _interval(b, "drift") for b in r["prefill_buckets"]}
        label = c.label + (f" ({c.note})" if c.note else "")
        cells = [str(i), label, c.kind, f"{p.get('effective_bits', math.nan):.2f}"]
        cells += [per.get(b, "n/a") for b in buckets]
        cells += [f"{r['kl']:.5f}", f"{r['prefill_kl_p99']:.4f}",
                  _interval(ca, "drift"), f"{ca.get('kl', math.nan):.5f}"]
        if passkey:
            pk = r.get("passkey", math.nan)
            cells.append("n/a" if not math.isfinite(pk) else f"{pk:.2f}")
        cells += [f"{r['bytes']:,.0f}", "n/a" if r["requests"] is None else f"{r['requests']:,}",
                  "yes" if r["ok"] else "no"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report_text(rec: Recommendation) -> str:
    """What `experiments/recommend.py` prints (and writes to recommendation.md)."""
    plan = rec.plan
    lines = [f"# {plan.engine} KV-cache recommendation for {plan.model_name}", "", rec.table, ""]
    if plan.skipped:
        lines.append("Not measured:")
        lines += [f"- {s.label}: {s.reason}" for s in plan.skipped]
        lines.append("")
    if rec.pick is not None:
        lines += ["Deploy:", "", f"    {rec.pick.deploy}", ""]
    if rec.exported:
        lines += [f"Calibrated FP8 scales: {rec.exported}. To serve them, copy kv_scales.safetensors into "
                  "the checkpoint folder (names added to model.safetensors.index.json if it has one) and "
                  "merge kv_cache_scheme.json's quantization_config into config.json (docs/engines.md).", ""]
    if rec.better:
        lines += [rec.better, ""]
    lines.append("Runs (resumable; report.md and plots inside): "
                 + ", ".join(f"{m}: {d}" for m, d in rec.run_dirs.items())
                 + f"  ({rec.seconds:.0f} s)")
    return "\n".join(lines)


def _write(rec: Recommendation) -> None:
    rec.out.mkdir(parents=True, exist_ok=True)
    (rec.out / "recommendation.md").write_text(report_text(rec) + "\n", encoding="utf-8")
    data = {
        "engine": rec.plan.engine, "model": rec.plan.model_name,
        "pick": None if rec.pick is None else {"scheme": rec.pick.scheme, "label": rec.pick.label,
                                               "deploy": rec.pick.deploy},
        "ranked": [
            {"scheme": r["candidate"].scheme, "label": r["candidate"].label, "kind": r["candidate"].kind,
             "within": r["ok"], "kl": r["kl"], "bytes_per_token": r["bytes"], "requests": r["requests"],
             **({"passkey_exact": r["passkey"], "passkey_length": r["passkey_length"]}
                if "passkey" in r else {})}
            for r in rec.rows
        ],
        "skipped": [{"label": s.label, "reason": s.reason} for s in rec.plan.skipped],
    }
    (rec.out / "recommendation.json").write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
    _write_csv(rec.out / "recommendation.csv", rec.rows)


def _write_csv(path: Path, rows: list[dict]) -> None:
    """The ranked table as numbers: one row per candidate and mode-bucket (prefill buckets, then each mode's
    whole-document `all` row), drift with its interval, KL, bytes per token and the verdict."""
    import csv

    cols = ["rank", "label", "kind", "scheme", "mode", "bucket", "drift", "drift_lo", "drift_hi", "kl",
            "kl_p99", "effective_bits", "bytes_per_token", "requests", "within"]
    with path.open("w", newline="", encoding="utf-8") as f:
        out = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        out.writeheader()
        for i, r in enumerate(rows, 1):
            c = r["candidate"]
            base = {"rank": i, "label": c.label, "kind": c.kind, "scheme": c.scheme,
                    "bytes_per_token": r["bytes"], "requests": r["requests"], "within": r["ok"]}
            parts = [("prefill", b) for b in r.get("prefill_buckets", [])]
            parts += [(m, r.get(m)) for m in ("prefill", "cache") if r.get(m)]
            for mode, m in parts:
                out.writerow(base | {k: m.get(k) for k in cols if k in m} | {"mode": mode})
