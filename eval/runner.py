"""One evaluation run: check the inputs, pick documents, measure in lockstep, write the run directory.

`run(config)` is what `experiments/run.py` calls; tests call it with a model object. The cheap checks
(schemes, paths, values) live in `kvquant.eval.config`, which imports nothing heavy; this module imports
torch and transformers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import math
import random
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

import torch

import kvquant
from kvquant.scheme import SchemeError

from . import results as res
from .config import (
    DEFAULT_CHUNK,
    DEFAULT_DOCS,
    DEFAULT_MAX_LENGTH,
    DTYPE_NAMES,
    KV_DTYPE_BYTES,
    Progress,
    RunConfig,
    RunError,
    RunInterrupted,
    check_inputs,
    resolve_schemes,
)
from .data import CorpusError, Document, load_corpus
from .measure import (  # noqa: F401
    MODES,
    REFERENCE,
    Bucket,
    cache_nbytes,
    evaluate_document,
    make_buckets,
    noise_shift,
    steps,
)
from .refcache import ReferenceCache
from .schemes import EvalScheme, scheme_label

__all__ = [
    "RunConfig",
    "RunError",
    "RunInterrupted",
    "Progress",
    "run",
    "resolve_schemes",
    "check_device",
    "DEFAULT_DOCS",
    "DEFAULT_CHUNK",
    "DEFAULT_MAX_LENGTH",
]

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {alias: getattr(torch, name) for alias, name in DTYPE_NAMES.items()}
Point = tuple[str, str, int, str]  # (scheme label, mode, document id, bucket label), as ResultsFile keys rows


def check_device(device: str) -> None:
    """Refuse a device this torch cannot use, naming the fix (never fall back silently)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RunError(
                f"--device {device}: torch {torch.__version__} sees no CUDA device; use --device cpu"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise RunError(
                f"--device {device}: only {torch.cuda.device_count()} CUDA device(s); use cuda:0 .. "
                f"cuda:{torch.cuda.device_count() - 1}"
            )
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise RunError(f"--device {device}: MPS is not available here; use --device cpu")
    elif dev.type == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise RunError(f"--device {device}: no XPU device is available; use --device cpu")


def _versions(schemes) -> dict[str, str]:
    extra = sorted({s.package for s in schemes if s.package})
    names = ["torch", "transformers", "datasets", "kvquant", *extra]
    out = {}
    for n in names:
        try:
            out[n] = importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            out[n] = "not installed"
    return out


def _git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parent.parent
        r = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
        return r.stdout.strip() + ("+dirty" if dirty else "") if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _own_chunks(config: RunConfig, schemes) -> dict[str, int]:
    """Schemes that run in cache mode at a chunk other than config.chunk (a peer's default, 128)."""
    if "cache" not in config.modes:
        return {}
    return {s.label: config.chunk_for(s) for s in schemes if config.chunk_for(s) != config.chunk}


def _identity(
    config: RunConfig, labels: list[str], doc_ids: list[int], model_name: str, schemes=()
) -> dict:
    """What decides the numbers: two runs with equal identities may share a directory."""
    return {
        "schemes": labels,
        "model": model_name,
        "corpus": config.corpus,
        "modes": list(config.modes),
        "max_length": config.max_length,
        "chunk": config.chunk,
        **({"chunks": chunks} if (chunks := _own_chunks(config, schemes)) else {}),
        "docs": doc_ids,
        "seed": config.seed,
        "dtype": config.dtype_name,
        **({"prefill": config.prefill_length} if "prefill" in config.modes else {}),
    }


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "-" for c in text).strip("-")[:40]


def run_dir_for(config: RunConfig, identity: dict) -> Path:
    if config.out:
        return Path(config.out)
    digest = hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]
    model = _slug(Path(identity["model"]).name)
    corpus = _slug(Path(config.corpus).name)
    name = f"{model}-{corpus}-{config.mode}-L{config.max_length}-c{config.chunk}-{digest}"
    return Path("runs") / name


def _load_model(config: RunConfig, model=None, tokenizer=None):
    if model is not None:
        if tokenizer is None:
            raise RunError("a model object needs its tokenizer")
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        return model, tokenizer, name
    try:
        model, tokenizer = kvquant.load_model(config.model, dtype=DTYPES[config.dtype], device=config.device)
    except (OSError, ValueError) as e:  # a folder whose files transformers cannot read
        raise RunError(f"cannot load model {config.model or '(default)'}: {e}") from None
    name = config.model or "smollm2-135m-instruct (embedded default)"
    return model, tokenizer, name


def _check_model_fits(config: RunConfig, model, schemes: list[EvalScheme]):
    """The length within the model's positions and every group size dividing its head_dim; the KV shape."""
    text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    max_pos = getattr(text_cfg, "max_position_embeddings", None)
    if max_pos is not None and config.max_length > max_pos:
        raise RunError(f"--max-length {config.max_length} is beyond the model's {max_pos} positions")
    shape = kvquant.memory.KVShape.from_config(model.config)
    for s in schemes:
        try:
            s.check(shape)
        except SchemeError as e:
            raise RunError(f"scheme {s}: {e}") from None
    return shape


def _load_documents(config: RunConfig) -> list[Document]:
    try:
        return load_corpus(config.corpus)
    except CorpusError as e:
        raise RunError(str(e)) from None


def _select_documents(
    config: RunConfig, docs: list[Document], tokenizer
) -> tuple[list[int], dict[int, list[int]], list[str]]:
    """Document ids (corpus order index) long enough to fill max_length, seeded order, budget applied."""
    want = config.docs
    if want is None and config.tokens is not None:
        want = math.ceil(config.tokens / config.max_length)
    if want is None:
        want = DEFAULT_DOCS
    order = list(range(len(docs)))
    random.Random(config.seed).shuffle(order)
    chosen, ids, longest = [], {}, 0
    for i in order:
        toks = tokenizer(docs[i].text, add_special_tokens=True)["input_ids"]
        longest = max(longest, len(toks))
        if len(toks) >= config.max_length:
            chosen.append(i)
            ids[i] = toks[: config.max_length]
            if len(chosen) == want:
                break
    if not chosen:
        raise RunError(
            f"no document of corpus {config.corpus!r} ({len(docs)} documents) reaches --max-length "
            f"{config.max_length} tokens; the longest has {longest}. Lower --max-length or use a corpus of "
            "longer documents (e.g. --corpus shakespeare)"
        )
    if len(chosen) < want:
        logger.warning(
            "only %d of the %d requested documents reach %d tokens; using those",
            len(chosen),
            want,
            config.max_length,
        )
    return chosen, ids, [docs[i].title for i in chosen]


def stored_identity(config_json: dict, ignore: tuple[str, ...] = ()) -> dict:
    """The identity a run directory's config.json holds, less `ignore` (keys that no longer belong to it)."""
    return {k: v for k, v in config_json.get("identity", {}).items() if k not in ignore}


def _prepare_dir(
    run_dir: Path, config_json: dict, identity: dict, force: bool, ignore: tuple[str, ...] = ()
) -> res.RunLock:
    """Lock `run_dir` for this run and resume a run of the same configuration there; refuse another one, or
    a folder that is not a run, unless force, which starts over (also over a run of the same configuration)
    by removing only what kvquant wrote: a folder holding anything else is refused, and nothing deleted.
    Returns the held lock (`res.RunLock`): the caller releases it when the run ends. A second process into
    the same directory is refused here, naming the holder's pid. On resume config_json keeps the run's first
    commit and creation time, and lists in `resumed_git_commits` any other commit that resumed it (the
    report prints both). `ignore`: keys of a stored identity that no longer belong to it (a retrieval grid,
    which a run may grow)."""
    cfg_path = run_dir / "config.json"
    if run_dir.exists() and not run_dir.is_dir():
        raise RunError(f"--out {run_dir} is a file; name a folder for the run directory")
    # read-only refusals first: nothing (not even a lock file) is written into a folder that is not a run
    foreign = res.foreign_files(run_dir)
    if foreign and not cfg_path.is_file():
        raise RunError(
            f"{run_dir} exists and is not a kvquant run directory (it holds {res._listing(foreign)}); choose "
            "another --out (--force removes only files kvquant wrote, so it leaves such a folder alone)"
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = res.RunLock(run_dir).acquire()
    except res.RunDirError as e:
        raise RunError(str(e)) from None
    except OSError as e:
        raise RunError(f"cannot use {run_dir} as the run directory: {e.strerror or e}") from None
    try:
        _claim_dir(run_dir, cfg_path, config_json, identity, force, ignore)
    except BaseException:
        lock.release()
        raise
    return lock


def _claim_dir(run_dir: Path, cfg_path: Path, config_json: dict, identity: dict, force: bool, ignore) -> None:
    """_prepare_dir's work under the lock."""
    if cfg_path.is_file() and not force:
        try:
            old = json.loads(cfg_path.read_text(encoding="utf-8"))
            old_identity = stored_identity(old, ignore)
        except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
            raise RunError(
                f"{cfg_path} is unreadable ({type(e).__name__}); pass --force to start the run over, or "
                "--out to write elsewhere"
            ) from None
        if old_identity == identity:
            now = config_json.get("git_commit")
            resumed = list(old.get("resumed_git_commits", []))
            if now not in (old.get("git_commit"), *resumed):
                resumed.append(now)
            config_json.update(git_commit=old.get("git_commit"), created=old.get("created"))
            if resumed:
                config_json["resumed_git_commits"] = resumed
            _write_json(cfg_path, config_json)
            return  # resume
        raise RunError(
            f"{run_dir} holds a run with a different configuration "
            f"({_diff(old_identity, identity)});"
            " pass --force to replace it, or --out to write elsewhere"
        )
    if force:
        try:
            removed = res.clear_run_dir(run_dir)
        except res.RunDirError as e:
            raise RunError(str(e)) from None
        if removed:
            logger.warning("--force: removed %s from %s", ", ".join(removed), run_dir)
    _write_json(cfg_path, config_json)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)


def _diff(a: dict, b: dict) -> str:
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return "; ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys) or "unknown"


# ------------------------------------------------------------------------------------- points and progress


def _runs_in(mode: str, schemes: list[EvalScheme]) -> list[EvalScheme]:
    """The schemes measured in `mode` (each says which modes it supports; peers: cache only)."""
    base = mode.removesuffix("-shift")
    return [s for s in schemes if base in s.modes]


def expected_points(
    modes: Iterable[str], schemes: list[EvalScheme], doc_ids: list[int], buckets: list[Bucket]
) -> list[Point]:
    """Every point a complete run measures: the reference and each scheme, per mode, document and bucket."""
    return [
        (label, mode, doc, b.label)
        for mode in modes
        for doc in doc_ids
        for label in [REFERENCE, *(scheme_label(s) for s in _runs_in(mode, schemes))]
        for b in buckets
    ]


def progress_of(results: res.ResultsFile, points: list[Point]) -> Progress:
    """Points measured, and points that will not be because their scheme failed in that mode."""
    failed_runs = {(r["scheme"], r["mode"]) for r in results.rows if r.get("status") == "failed"}
    measured = sum(results.has(*p) for p in points)
    failed = sum(not results.has(*p) and (p[0], p[1]) in failed_runs for p in points)
    return Progress(measured, len(points), failed)


def _announce(run_dir: Path, results: res.ResultsFile, points: list[Point], titles: dict[int, str]) -> None:
    """Say what is already measured and what will be (logged; the CLI shows it)."""
    done = progress_of(results, points)
    todo = [p for p in points if not results.has(*p)]
    if not done.measured:
        logger.info("measuring %d points into %s", len(points), run_dir)
        return
    if not todo:
        logger.info("resuming: %s already measured in %s; nothing left to measure", done, run_dir)
        return
    docs = {mode: sorted({p[2] for p in todo if p[1] == mode}) for mode in dict.fromkeys(p[1] for p in todo)}
    where = "; ".join(
        f"{mode}: " + ", ".join(f"doc {d} ({titles.get(d, '?')})" for d in ds) for mode, ds in docs.items()
    )
    measured_docs = {(p[1], p[2]) for p in points if results.has(*p)}
    cut_off = {(p[1], p[2]) for p in todo} & measured_docs
    logger.info(
        "resuming: %s already measured in %s; %d to measure in %d document(s) (%s); %d of them were cut off "
        "and are recomputed from their first token; measured points are kept, not written twice",
        done,
        run_dir,
        len(todo),
        sum(len(ds) for ds in docs.values()),
        where,
        len(cut_off),
    )


# ------------------------------------------------------------------------------------------------- run


_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def display_names(schemes: list[EvalScheme], dtype_name: str | None = None) -> dict[str, str]:
    """Result label -> what plots and tables show: the preset name where one was used (`kivi-2`), and the
    reference named for what it is: `fp32 (reference)` when it computes in float32, `fp16` in float16."""
    names = {s.label: s.name for s in schemes}
    if dtype_name is not None:
        short = _SHORT.get(dtype_name, dtype_name)
        names[REFERENCE] = short if short == "fp16" else f"{short} (reference)"
    return names


def _config_json(
    config: RunConfig, identity: dict, schemes, model_name: str, buckets, documents, shape
) -> dict:
    return {
        "identity": identity,
        "schemes": identity["schemes"],
        "scheme_names": display_names(schemes, identity["dtype"]),
        "reference": REFERENCE,
        "model": model_name,
        "corpus": config.corpus,
        "mode": config.mode,
        "chunk": config.chunk,
        "max_length": config.max_length,
        "buckets": [b.label for b in buckets],
        "documents": documents,
        "seed": config.seed,
        "device": config.device,
        "dtype": identity["dtype"],
        "kv_dtype": config.kv_dtype_name,
        "prefill": config.prefill_length if "prefill" in config.modes else None,
        "noise_floor": config.noise_floor,
        "kv_shape": dataclasses.asdict(shape),
        "versions": _versions(schemes),
        "git_commit": _git_commit(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _warn_key_offsets(model, schemes) -> None:
    """Once per scheme: a warning (with a recommended scheme) when it quantizes keys per token although this
    model's keys carry large per-channel offsets (`kvquant.diagnose`; one 256-token probe, only if a scheme
    is at risk)."""
    from kvquant.diagnose import OffsetWarner

    warner = OffsetWarner()
    for s in schemes:
        scheme = getattr(s, "scheme", None)
        if isinstance(scheme, kvquant.Scheme):
            warner(model, scheme)


def run(config: RunConfig, *, model=None, tokenizer=None) -> tuple[Path, list[dict]]:
    """Run (or resume) an evaluation; returns (run directory, summary rows).

    Raises RunError for bad input, before any long work, and when another process holds the run directory
    (`results.RunLock`, held until the run ends). On Ctrl-C or SIGTERM, everything measured is written
    (results.jsonl, summary.csv, report.md and plots, the last two marked partial) and RunInterrupted
    (a KeyboardInterrupt) is raised. --task passkey|needle runs `retrieval.run_retrieval` instead."""
    if config.is_retrieval:
        from .retrieval import run_retrieval

        return run_retrieval(config, model=model, tokenizer=tokenizer)
    schemes = check_inputs(config, check_model=model is None)
    if model is None:
        check_device(config.device)
    docs = _load_documents(config)
    model, tokenizer, model_name = _load_model(config, model, tokenizer)
    shape = _check_model_fits(config, model, schemes)
    _warn_key_offsets(model, schemes)
    doc_ids, doc_tokens, titles = _select_documents(config, docs, tokenizer)
    identity = _identity(config, [scheme_label(s) for s in schemes], doc_ids, model_name, schemes)
    run_dir = run_dir_for(config, identity)
    buckets = make_buckets(config.max_length)
    documents = [
        {"id": i, "title": t, "tokens": len(doc_tokens[i])} for i, t in zip(doc_ids, titles, strict=True)
    ]
    config_json = _config_json(config, identity, schemes, model_name, buckets, documents, shape)
    lock = _prepare_dir(run_dir, config_json, identity, config.force)
    try:
        results = res.ResultsFile(run_dir / "results.jsonl")
        points = expected_points(config.modes, schemes, doc_ids, buckets)
        _announce(run_dir, results, points, dict(zip(doc_ids, titles, strict=True)))
        torch.manual_seed(config.seed)
        interrupted = False
        t0 = time.perf_counter()
        texts = {i: docs[i].text for i in doc_ids}
        with res.interrupt_on_sigterm():  # `timeout` or a scheduler's stop ends the run as Ctrl-C does
            try:
                _measure(
                    config, model, tokenizer, schemes, doc_ids, doc_tokens, texts, buckets, results, run_dir
                )
            except KeyboardInterrupt:
                interrupted = True
            finally:
                logger.info("measured in %.1f s", time.perf_counter() - t0)
                progress = progress_of(results, points)
                summary = _write_outputs(
                    run_dir, results.rows, schemes, model.config, config, config_json, progress
                )
    finally:
        lock.release()
    if interrupted:
        raise RunInterrupted(run_dir, progress)
    return run_dir, summary


def _measure(
    config: RunConfig,
    model,
    tokenizer,
    schemes,
    doc_ids,
    doc_tokens,
    texts: dict[int, str],
    buckets,
    results: res.ResultsFile,
    run_dir: Path,
) -> None:
    """Every mode and document in turn. A document with a missing point is measured from its first token
    (the reference and the schemes lacking points, in lockstep); only missing points are written. The
    reference's hidden states come from the reference cache when it holds them (keyed by the model's full
    weights, the tokenizer, the document's text and ids, the dtype and the chunking: `refcache`)."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    refs = _reference_cache(model, tokenizer) if config.reference_cache else None
    tokens = res.TokenStore(run_dir / "tokens")
    bar = tqdm(
        total=len(config.modes) * len(doc_ids) * config.max_length,
        desc="tokens (all modes, docs, schemes in lockstep)",
        unit="tok",
        dynamic_ncols=True,
    )
    failed: dict[tuple[str, str], str] = {}
    try:
        for mode in config.modes:
            base = mode.removesuffix("-shift")
            shifted = mode.endswith("-shift")
            prefill = config.prefill_length if base == "prefill" else None
            mode_schemes = _runs_in(mode, schemes)
            _record_skipped(results, mode, [s for s in schemes if s not in mode_schemes])
            for doc in tqdm(doc_ids, desc=f"documents ({mode})", leave=False, dynamic_ncols=True):
                todo = [
                    s
                    for s in mode_schemes
                    if (scheme_label(s), mode) not in failed
                    and not all(results.has(scheme_label(s), mode, doc, b.label) for b in buckets)
                ]
                if not todo and all(results.has(REFERENCE, mode, doc, b.label) for b in buckets):
                    bar.update(config.max_length)
                    continue
                ids = torch.tensor([doc_tokens[doc]], dtype=torch.long, device=device)
                # schemes with their own default chunk (peers: 128) run in their own lockstep, beside a
                # reference chunked alike (its KL partner; its results.jsonl rows come from the first group)
                for n, (chunk, group) in enumerate(_chunk_groups(config, base, todo)):
                    shift = noise_shift(chunk) if shifted else 0
                    stored, key = None, None
                    if refs is not None:
                        key = refs.key(
                            ids,
                            dtype,
                            steps(ids.shape[1], base, chunk, prefill, shift),
                            text=texts.get(doc),
                            layers="full" if base == "prefill" else "model",  # measure.make_cache
                        )
                        stored = refs.load(key)
                        if stored is not None:
                            logger.info("reference of doc %d (%s) read from the reference cache", doc, mode)
                    evaluate_document(
                        model,
                        ids,
                        group,
                        mode=base,
                        chunk=chunk,
                        buckets=buckets,
                        prefill=prefill,
                        shift=shift,
                        reference=stored,
                        on_reference=(lambda r, key=key: refs.save(key, r)) if refs is not None else None,
                        on_bucket=_bucket_writer(results, tokens, mode, doc),
                        on_error=_error_writer(results, failed, mode, doc),
                        progress=bar.update if n == 0 else None,
                    )
    finally:
        bar.close()


def _reference_cache(model, tokenizer) -> ReferenceCache | None:
    """The reference cache for this model, or None (with a warning) when its weights cannot be hashed."""
    from .refcache import WeightsUnhashable

    try:
        return ReferenceCache(model=model, tokenizer=tokenizer)
    except WeightsUnhashable as e:
        logger.warning("reference cache off for this run: %s", e)
        return None


def _chunk_groups(config: RunConfig, mode: str, todo: list[EvalScheme]) -> list[tuple[int, list[EvalScheme]]]:
    """(chunk, schemes) in cache mode, config.chunk's group first (it also writes the reference, even with no
    scheme of its own left to measure); one group at config.chunk in the other modes."""
    if mode != "cache":
        return [(config.chunk, todo)]
    groups: dict[int, list[EvalScheme]] = {config.chunk: []}
    for s in todo:
        groups.setdefault(config.chunk_for(s), []).append(s)
    return [(c, g) for c, g in groups.items() if g or c == config.chunk]


def _record_skipped(results: res.ResultsFile, mode: str, skipped: list[EvalScheme]) -> None:
    for s in skipped:
        if not results.has(scheme_label(s), mode, -1, "skipped"):
            results.append(
                {
                    "scheme": scheme_label(s),
                    "mode": mode,
                    "doc": -1,
                    "bucket": "skipped",
                    "status": "skipped",
                    "error": f"{s.label} runs in {'/'.join(s.modes)} mode only",
                }
            )


def _bucket_writer(results: res.ResultsFile, tokens: res.TokenStore, mode: str, doc: int):
    """evaluate_document's on_bucket: the point's per-token values, then one results.jsonl line per bucket
    not yet measured."""

    def on_bucket(label, bucket, st, nbytes, ntok):
        if results.has(label, mode, doc, bucket.label):
            return
        if label != REFERENCE:
            tokens.write(label, mode, doc, bucket.label, {k: v.numpy() for k, v in st.token_values().items()})
        results.append(
            {
                "scheme": label,
                "mode": mode,
                "doc": doc,
                "bucket": bucket.label,
                "bucket_start": bucket.start,
                "bucket_end": bucket.end,
                **st.row_sums(),
                "cache_bytes": nbytes,
                "cache_tokens": ntok,
                "status": "ok",
            }
        )

    return on_bucket


def _error_writer(results: res.ResultsFile, failed: dict[tuple[str, str], str], mode: str, doc: int):
    """evaluate_document's on_error: the scheme is recorded as failed and skipped for the rest of the run."""

    def on_error(label, e):
        failed[(label, mode)] = f"{type(e).__name__}: {e}"
        results.append(
            {
                "scheme": label,
                "mode": mode,
                "doc": doc,
                "bucket": None,
                "status": "failed",
                "error": failed[(label, mode)],
            }
        )

    return on_error


# ------------------------------------------------------------------------------------------------ outputs


def memory_of(schemes, model_config, kv_dtype: str) -> dict[str, res.Memory]:
    """Bytes at the storage dtype for the reference and every scheme (each through its protocol)."""
    shape = kvquant.memory.KVShape.from_config(model_config)
    dbytes = KV_DTYPE_BYTES[kv_dtype]
    values = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim
    fp = float(kvquant.memory.fp16_bytes_per_token(shape, dbytes))
    out = {REFERENCE: res.Memory(fp, lambda n: _fp_held(model_config, n, dbytes), values)}
    for s in schemes:
        out[scheme_label(s)] = res.Memory(
            s.bytes_per_token(shape, dbytes), lambda n, s=s: s.held_bytes(model_config, n, dbytes), values
        )
    return out


def _fp_held(model_config, n: int, dbytes: int) -> float:
    """The unquantized cache after n tokens: full layers hold n tokens, sliding-window layers their window."""
    shape = kvquant.memory.KVShape.from_config(model_config)
    per = 2 * shape.num_kv_heads * shape.head_dim * dbytes
    return float(sum(per * min(n, shape.window_of(i) or n) for i in range(shape.num_layers)))


def _summary(rows, schemes, model_config, config: RunConfig, run_dir: Path | None = None) -> list[dict]:
    tokens = res.TokenStore(run_dir / "tokens") if run_dir is not None else None
    return res.summarize(
        rows, memory_of(schemes, model_config, config.kv_dtype_name), REFERENCE, tokens, seed=config.seed
    )


def plot_info(config_json: dict, progress: Progress | None = None) -> res.PlotInfo:
    """What the plots' titles say, from config.json (so a PNG stands alone)."""
    model = config_json["model"].removesuffix(" (embedded default)")
    return res.PlotInfo(
        model=Path(model).name or model,
        corpus=Path(config_json["corpus"]).name or config_json["corpus"],
        documents=len(config_json["documents"]),
        max_length=config_json["max_length"],
        dtype=config_json["dtype"],
        chunk=config_json["chunk"],
        names=config_json.get("scheme_names", {}),
        partial=None if progress is None or progress.complete else str(progress),
        kv_dtype=config_json.get("kv_dtype", "float16"),
    )


INT8_TARGET = 0.001  # the int8 target: every bucket's drift interval within +-0.1%


def _targets(summary: list[dict], names: dict, bound: float = INT8_TARGET) -> list[str]:
    """Per scheme and mode: in how many buckets the drift interval lies within +-bound."""
    from . import metrics

    lines = []
    for mode in dict.fromkeys(r["mode"] for r in summary):
        for scheme in dict.fromkeys(r["scheme"] for r in summary if r["mode"] == mode):
            if scheme == REFERENCE:
                continue
            rows = [r for r in summary
                    if r["mode"] == mode and r["scheme"] == scheme and r["bucket"] != "all"]
            verdicts = [metrics.within(r, "drift", bound) for r in rows]
            judged = [v for v in verdicts if v is not None]
            if judged:
                lines.append(f"- `{names.get(scheme, scheme)}` ({mode}): drift interval within "
                             f"±{100 * bound:.1f}% in {sum(judged)} of {len(rows)} buckets")
    return lines


def _write_outputs(
    run_dir: Path, rows, schemes, model_config, config: RunConfig, config_json: dict, progress: Progress
) -> list[dict]:
    """summary.csv, report.md and plots from everything results.jsonl holds (also after an interruption,
    then marked partial)."""
    summary = _summary(rows, schemes, model_config, config, run_dir)
    res.write_summary(run_dir / "summary.csv", summary)
    info = plot_info(config_json, progress)
    names = config_json.get("scheme_names", {})
    ref_name = names.get(REFERENCE, REFERENCE)
    scheme_list = ", ".join(
        f"`{names[s]}` (`{s}`)" if names.get(s, s) != s else f"`{s}`" for s in config_json["schemes"]
    )
    partial = (
        [f"**partial: {progress} measured** (interrupted; rerun the same command to resume)", ""]
        if info.partial
        else []
    )
    kv = config_json.get("kv_dtype", "float16")
    prefill = f"; prefill P = {config_json['prefill']:,}" if config_json.get("prefill") else ""
    report = [
        f"# kvquant evaluation: {config_json['model']} on {config_json['corpus']}",
        "",
        *partial,
        f"- schemes: {scheme_list} (reference `{ref_name}`: unquantized, computing in "
        f"{config_json['dtype']})",
        f"- mode(s): {config_json['mode']}; chunk {config_json['chunk']}; "
        f"max length {config_json['max_length']}{prefill}; "
        f"{len(config_json['documents'])} documents",
        f"- bytes at {kv} K/V storage (--kv-dtype), whatever dtype the model computes in",
        *res.provenance_lines(config_json, progress),
        "",
        "drift = ppl / ppl_ref - 1 over the same tokens, with a 95% bootstrap interval (documents, then "
        "tokens); KL = mean KL(p_ref || p_scheme) per token; same top-1 = share of positions whose argmax "
        f"matches the reference; B/token = bytes held at the full length per token at {kv} (pages counted; "
        "cache.nbytes() at the run dtype is in summary.csv as bytes_per_token_measured); saving = reference "
        "bytes / scheme bytes at that dtype. Modes: cache = decode-exact, fake = K/V quantized inside one "
        "forward, prefill = FP prompt stored quantized, continuation decoded.",
        "",
        res.markdown_table(summary, names, kv),
        *_targets(summary, names),
        "",
        res.distribution_table(summary, names),
        res.known_shapes_table(schemes, kv_dtype=kv),
        "",
        "![drift vs length](drift_vs_length.png)",
        "",
        "![bytes per token](bytes_per_token.png)",
        "",
    ]
    (run_dir / "report.md").write_text("\n".join(report), encoding="utf-8")
    if summary:
        try:
            res.write_plots(run_dir, summary, info)
        except Exception as e:  # noqa: BLE001 - a plotting failure never loses results
            logger.warning("plots not written: %s", e)
    return summary
