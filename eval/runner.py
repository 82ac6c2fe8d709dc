"""One evaluation run: check the inputs, pick documents, measure in lockstep, write the run directory.

`run(config)` is what `experiments/run.py` calls; tests call it with a model object.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import math
import random
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import kvquant
from kvquant.scheme import Scheme, SchemeError

from . import results as res
from .data import load_corpus
from .measure import MODES, REFERENCE, cache_nbytes, evaluate_document, make_buckets  # noqa: F401
from .schemes import EvalScheme, PeerScheme, parse_eval_scheme, scheme_label

__all__ = [
    "RunConfig",
    "RunError",
    "run",
    "resolve_schemes",
    "DEFAULT_DOCS",
    "DEFAULT_CHUNK",
    "DEFAULT_MAX_LENGTH",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH = 8192
DEFAULT_CHUNK = 1024
DEFAULT_DOCS = 2
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


class RunError(ValueError):
    """Bad input, found before any long work."""


@dataclass(frozen=True)
class RunConfig:
    schemes: tuple[str, ...]
    model: str | None = None  # None: the embedded default
    corpus: str = "wikipedia"
    mode: str = "cache"  # cache | fake | both
    max_length: int = DEFAULT_MAX_LENGTH
    chunk: int = DEFAULT_CHUNK
    docs: int | None = None
    tokens: int | None = None
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    out: str | None = None
    force: bool = False
    wandb: str = "disabled"
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def modes(self) -> tuple[str, ...]:
        return MODES if self.mode == "both" else (self.mode,)


def resolve_schemes(names) -> list[EvalScheme]:
    """Parse and de-duplicate; unknown names raise RunError with the known ones."""
    out, seen = [], set()
    for n in names:
        try:
            s = parse_eval_scheme(n)
        except SchemeError as e:
            raise RunError(str(e)) from None
        if isinstance(s, PeerScheme):
            try:
                s.check_available()
            except SchemeError as e:
                raise RunError(str(e)) from None
        if scheme_label(s) not in seen:
            seen.add(scheme_label(s))
            out.append(s)
    return out


def _versions(schemes) -> dict[str, str]:
    names = ["torch", "transformers", "datasets", "kvquant"] + sorted(
        {s.package for s in schemes if isinstance(s, PeerScheme)}
    )
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


def _identity(config: RunConfig, labels: list[str], doc_ids: list[int], model_name: str) -> dict:
    """What decides the numbers: two runs with equal identities may share a directory."""
    return {
        "schemes": labels,
        "model": model_name,
        "corpus": config.corpus,
        "modes": list(config.modes),
        "max_length": config.max_length,
        "chunk": config.chunk,
        "docs": doc_ids,
        "seed": config.seed,
        "dtype": str(DTYPES[config.dtype]).removeprefix("torch."),
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
    except (FileNotFoundError, ValueError) as e:
        raise RunError(str(e)) from None
    name = config.model or "smollm2-135m-instruct (embedded default)"
    return model, tokenizer, name


def _select_documents(config: RunConfig, tokenizer) -> tuple[list[int], dict[int, list[int]], list[str]]:
    """Document ids (corpus order index) long enough to fill max_length, seeded order, budget applied."""
    from .data import CorpusError

    try:
        docs = load_corpus(config.corpus)
    except CorpusError as e:
        raise RunError(str(e)) from None
    if config.docs is not None and config.docs < 1 or config.tokens is not None and config.tokens < 1:
        raise RunError("--docs and --tokens must be positive")
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


def _prepare_dir(run_dir: Path, config_json: dict, identity: dict, force: bool) -> None:
    cfg_path = run_dir / "config.json"
    if cfg_path.is_file():
        old = json.loads(cfg_path.read_text())
        if old.get("identity") == identity:
            return  # resume
        if not force:
            raise RunError(
                f"{run_dir} holds a run with a different configuration "
                f"({_diff(old.get('identity', {}), identity)});"
                " pass --force to replace it, or --out to write elsewhere"
            )
    elif run_dir.exists() and any(run_dir.iterdir()) and not force:
        raise RunError(
            f"{run_dir} exists and is not a kvquant run directory; pass --force or choose another --out"
        )
    if force and run_dir.exists():
        logger.warning("--force: replacing %s", run_dir)
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = cfg_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(config_json, indent=2, default=str))
    tmp.replace(cfg_path)


def _diff(a: dict, b: dict) -> str:
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return "; ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys) or "unknown"


def run(config: RunConfig, *, model=None, tokenizer=None) -> tuple[Path, list[dict]]:
    """Run (or resume) an evaluation; returns (run directory, summary rows)."""
    from tqdm.auto import tqdm

    if config.mode not in (*MODES, "both"):
        raise RunError(f"unknown mode {config.mode!r}; known: cache, fake, both")
    if config.dtype not in DTYPES:
        raise RunError(f"unknown dtype {config.dtype!r}; known: {', '.join(DTYPES)}")
    if config.chunk < 1:
        raise RunError(f"--chunk {config.chunk} must be at least 1")
    schemes = resolve_schemes(config.schemes)
    if not schemes:
        raise RunError("name at least one scheme (--scheme int4-g64); see --list-schemes")
    model, tokenizer, model_name = _load_model(config, model, tokenizer)
    text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    max_pos = getattr(text_cfg, "max_position_embeddings", None)
    if max_pos is not None and config.max_length > max_pos:
        raise RunError(f"--max-length {config.max_length} is beyond the model's {max_pos} positions")
    shape = kvquant.memory.KVShape.from_config(model.config)
    for s in schemes:
        if isinstance(s, Scheme):
            try:
                s.check_head_dim(shape.head_dim)
            except SchemeError as e:
                raise RunError(f"scheme {s}: {e}") from None
    doc_ids, doc_tokens, titles = _select_documents(config, tokenizer)
    labels = [scheme_label(s) for s in schemes]
    identity = _identity(config, labels, doc_ids, model_name)
    run_dir = run_dir_for(config, identity)
    buckets = make_buckets(config.max_length)
    config_json = {
        "identity": identity,
        "schemes": labels,
        "reference": REFERENCE,
        "model": model_name,
        "corpus": config.corpus,
        "mode": config.mode,
        "chunk": config.chunk,
        "max_length": config.max_length,
        "buckets": [b.label for b in buckets],
        "documents": [
            {"id": i, "title": t, "tokens": len(doc_tokens[i])} for i, t in zip(doc_ids, titles, strict=True)
        ],
        "seed": config.seed,
        "device": config.device,
        "dtype": identity["dtype"],
        "kv_shape": dataclasses.asdict(shape),
        "versions": _versions(schemes),
        "git_commit": _git_commit(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    _prepare_dir(run_dir, config_json, identity, config.force)
    results = res.ResultsFile(run_dir / "results.jsonl")
    torch.manual_seed(config.seed)
    device = next(model.parameters()).device

    total_steps = len(config.modes) * len(doc_ids) * config.max_length
    bar = tqdm(
        total=total_steps,
        desc="tokens (all modes, docs, schemes in lockstep)",
        unit="tok",
        dynamic_ncols=True,
    )
    failed: dict[tuple[str, str], str] = {}
    try:
        for mode in config.modes:
            mode_schemes = [s for s in schemes if not (isinstance(s, PeerScheme) and mode != "cache")]
            for s in schemes:
                if s not in mode_schemes and not results.has(scheme_label(s), mode, -1, "skipped"):
                    results.append(
                        {
                            "scheme": scheme_label(s),
                            "mode": mode,
                            "doc": -1,
                            "bucket": "skipped",
                            "status": "skipped",
                            "error": "peer schemes run in cache mode only",
                        }
                    )
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

                def on_bucket(label, bucket, st, nbytes, ntok, mode=mode, doc=doc):
                    if results.has(label, mode, doc, bucket.label):
                        return
                    results.append(
                        {
                            "scheme": label,
                            "mode": mode,
                            "doc": doc,
                            "bucket": bucket.label,
                            "bucket_start": bucket.start,
                            "bucket_end": bucket.end,
                            "nll_sum": st.nll,
                            "tokens": st.tokens,
                            "kl_sum": st.kl,
                            "top1": st.top1,
                            "cache_bytes": nbytes,
                            "cache_tokens": ntok,
                            "status": "ok",
                        }
                    )

                def on_error(label, e, mode=mode, doc=doc):
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

                evaluate_document(
                    model,
                    ids,
                    todo,
                    mode=mode,
                    chunk=config.chunk,
                    buckets=buckets,
                    on_bucket=on_bucket,
                    on_error=on_error,
                    progress=bar.update,
                )
    finally:
        bar.close()
        _write_outputs(run_dir, results.rows, schemes, model.config, DTYPES[config.dtype], config_json)
    summary = _summary(results.rows, schemes, model.config, DTYPES[config.dtype])
    return run_dir, summary


def _summary(rows, schemes, model_config, dtype) -> list[dict]:
    shape = kvquant.memory.KVShape.from_config(model_config)
    dbytes = torch.empty((), dtype=dtype).element_size()
    formula = {REFERENCE: float(kvquant.memory.fp16_bytes_per_token(shape, dtype))}
    for s in schemes:
        formula[scheme_label(s)] = (
            s.bytes_per_token(shape, dbytes)
            if isinstance(s, PeerScheme)
            else kvquant.memory.bytes_per_token(shape, s, dtype)
        )
    values = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim
    return res.summarize(rows, formula, formula[REFERENCE], values, REFERENCE)


def _write_outputs(run_dir: Path, rows, schemes, model_config, dtype, config_json) -> None:
    """summary.csv, report.md and plots from everything results.jsonl holds (also after an interruption)."""
    summary = _summary(rows, schemes, model_config, dtype)
    res.write_summary(run_dir / "summary.csv", summary)
    table = res.markdown_table(summary)
    report = [
        f"# kvquant evaluation: {config_json['model']} on {config_json['corpus']}",
        "",
        f"- schemes: {', '.join(f'`{s}`' for s in config_json['schemes'])} (reference `fp16`: unquantized, "
        f"{config_json['dtype']})",
        f"- mode(s): {config_json['mode']}; chunk {config_json['chunk']}; "
        f"max length {config_json['max_length']}; "
        f"{len(config_json['documents'])} documents",
        f"- git {config_json['git_commit']}; "
        + ", ".join(f"{k} {v}" for k, v in config_json["versions"].items()),
        "",
        "drift = ppl / ppl_fp16 - 1 over the same tokens; KL = mean KL(p_fp16 || p_scheme) per token; "
        "top-1 = share of positions whose argmax matches FP16; B/token = cache bytes per token at the run "
        "dtype (measured in cache mode at the full length, formula in fake mode); saving = FP16 bytes / "
        "scheme bytes.",
        "",
        table,
        res.known_shapes_table(schemes),
        "",
        "![drift vs length](drift_vs_length.png)",
        "",
        "![bytes per token](bytes_per_token.png)",
        "",
    ]
    (run_dir / "report.md").write_text("\n".join(report), encoding="utf-8")
    if summary:
        try:
            res.write_plots(run_dir, summary)
        except Exception as e:  # noqa: BLE001 - a plotting failure never loses results
            logger.warning("plots not written: %s", e)
