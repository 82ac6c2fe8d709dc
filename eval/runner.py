"""One evaluation run: check the inputs, pick documents, measure in lockstep, write the run directory.

`run(config)` is what `experiments/run.py` calls; tests call it with a model object. The cheap checks
(schemes, paths, values) live in `kvquant.eval.config`, which imports nothing heavy; this module imports
torch and transformers.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import random
from collections.abc import Iterable
from pathlib import Path

import torch

import kvquant

from . import harness
from . import results as res
from .config import (
    DEFAULT_CHUNK,
    DEFAULT_DOCS,
    DEFAULT_MAX_LENGTH,
    DTYPE_NAMES,
    Progress,
    RunConfig,
    RunError,
    RunIncomplete,
    RunInterrupted,
    resolve_schemes,
    validate,
)
from .data import CorpusError, Document, load_corpus
from .harness import (  # noqa: F401 - the names callers of runner have always found here
    check_device,
    display_names,
    memory_of,
    progress_of,
    stored_identity,
)
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
from .schemes import EvalScheme

__all__ = [
    "RunConfig",
    "RunError",
    "RunInterrupted",
    "RunIncomplete",
    "Progress",
    "run",
    "resolve_schemes",
    "check_device",
    "evaluation_titles",
    "DEFAULT_DOCS",
    "DEFAULT_CHUNK",
    "DEFAULT_MAX_LENGTH",
]

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {alias: getattr(torch, name) for alias, name in DTYPE_NAMES.items()}
Point = tuple[str, str, int, str]  # (scheme label, mode, document id, bucket label), as ResultsFile keys rows


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


def run_dir_for(config: RunConfig, identity: dict) -> Path:
    if config.out:
        return Path(config.out)
    model = harness.slug(Path(identity["model"]).name)
    corpus = harness.slug(Path(config.corpus).name)
    stem = f"{model}-{corpus}-{config.mode}-L{config.max_length}-c{config.chunk}"
    return harness.default_run_dir(stem, identity)


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


def evaluation_titles(config: RunConfig, tokenizer) -> list[str]:
    """The titles of the documents `run(config)` evaluates (the same selection), e.g. to keep calibration
    text apart from them."""
    return _select_documents(config, _load_documents(config), tokenizer)[2]


# ------------------------------------------------------------------------------------- points and progress


def expected_points(
    modes: Iterable[str], schemes: list[EvalScheme], doc_ids: list[int], buckets: list[Bucket]
) -> list[Point]:
    """Every point a complete run measures: the reference and each scheme, per mode, document and bucket."""
    return [
        (label, mode, doc, b.label)
        for mode in modes
        for doc in doc_ids
        for label in [REFERENCE, *(s.label for s in harness.runs_in(mode, schemes))]
        for b in buckets
    ]


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
        **harness.provenance(schemes),
    }


def _warn_key_offsets(model, schemes, tokenizer=None, corpus=None) -> None:
    """Once per scheme: a warning (with a recommended scheme) when its key specs are predicted to collapse on
    this model's per-channel key offsets (`kvquant.diagnose.OffsetWarner`). The probe is the text
    `experiments/diagnose.py` reads (`data.probe_text_ids`, PROBE_TOKENS tokens of the corpus), so the two
    recommend the same scheme; it runs only if a scheme's keys are at risk."""
    from kvquant.diagnose import PROBE_TOKENS, OffsetWarner

    from .data import probe_text_ids

    def probe():
        if tokenizer is not None and corpus is not None:
            try:
                return probe_text_ids(tokenizer, corpus, PROBE_TOKENS)[0]
            except ValueError as e:
                logger.info("key-offset probe: %s; probing random token ids instead", e)
        from kvquant.diagnose import probe_ids

        return probe_ids(model.config)

    warner = OffsetWarner(probe=probe)
    for s in schemes:
        scheme = getattr(s, "scheme", None)
        if isinstance(scheme, kvquant.Scheme):
            warner(model, scheme)


def run(config: RunConfig, *, model=None, tokenizer=None) -> tuple[Path, list[dict]]:
    """Run (or resume) an evaluation; returns (run directory, summary rows).

    Raises RunError for bad input, before any long work, and when another process holds the run directory
    (`results.RunLock`, held until the run ends). On Ctrl-C or SIGTERM, everything measured is written
    (results.jsonl, summary.csv, report.md and plots, the last two marked partial) and RunInterrupted
    (a KeyboardInterrupt) is raised. --task passkey|needle runs `retrieval.run_retrieval` instead.

    Sharded (docs/scale.md): under torchrun (WORLD_SIZE > 1) each rank measures its part of the points
    still missing, on `cuda:LOCAL_RANK` (or the CPU), into its own results file, and rank 0 writes the
    summary, report and plots once every rank is done (the other ranks return no summary). With
    `config.shard` (--shard I/N, a job array) the process measures shard I's part of every point, skips what
    any results file holds, and writes no report; `config.merge` (--merge) measures nothing and writes the
    report from every shard's results. A report with points missing raises RunIncomplete after writing."""
    role = harness.role_of(config)
    harness.check_wandb(config.wandb)  # a W&B mode that cannot log is refused before any work
    if config.is_retrieval:
        from .retrieval import run_retrieval

        return run_retrieval(config, model=model, tokenizer=tokenizer)
    config = validate(config, check_model=model is None)  # the schemes parsed here, once
    schemes = list(config.parsed)
    device = harness.rank_device(config.device, role)
    if model is None:
        check_device(device)
    docs = _load_documents(config)
    model, tokenizer, model_name = harness.load_model(config, model, tokenizer, device)
    shape = harness.check_model_fits(config, model, schemes)
    if not config.merge:  # a merge runs no forward
        _warn_key_offsets(model, schemes, tokenizer, config.corpus)
    doc_ids, doc_tokens, titles = _select_documents(config, docs, tokenizer)
    identity = _identity(config, [s.label for s in schemes], doc_ids, model_name, schemes)
    run_dir = run_dir_for(config, identity)
    buckets = make_buckets(config.max_length)
    documents = [
        {"id": i, "title": t, "tokens": len(doc_tokens[i])} for i, t in zip(doc_ids, titles, strict=True)
    ]
    config_json = _config_json(config, identity, schemes, model_name, buckets, documents, shape)
    config_json["device"] = device
    if config.merge and not (run_dir / "config.json").is_file():
        raise RunError(
            f"--merge: {run_dir} holds no run (no config.json); run the shards (--shard I/N) first"
        )
    points = expected_points(config.modes, schemes, doc_ids, buckets)
    texts = {i: docs[i].text for i in doc_ids}
    titled = dict(zip(doc_ids, titles, strict=True))
    work = harness.Work(
        units=_units(points),
        points=points,
        points_of=lambda mine: [p for p in points if (p[1], p[2], p[0]) in mine],
        unit_done=lambda results, unit: _unit_done(results, unit, buckets),
        measure=lambda results, mine: _measure(
            config, model, tokenizer, schemes, doc_ids, doc_tokens, texts, buckets, results, run_dir, mine
        ),
        write_outputs=lambda rows, progress: _write_outputs(
            run_dir, rows, schemes, model.config, config, config_json, progress
        ),
        announce=lambda results, my_points: _announce(run_dir, results, my_points, titled),
    )
    return harness.execute(config, role, run_dir, config_json, identity, work)


# ------------------------------------------------------------------------------------------- work units

Unit = tuple[str, int, str]  # (mode, document id, scheme label): what one process measures of a document


def _units(points: list[Point]) -> list[Unit]:
    """The run's (mode, document, scheme) units in the order the run measures them."""
    return list(dict.fromkeys((p[1], p[2], p[0]) for p in points))


def _unit_done(results, unit: Unit, buckets) -> bool:
    mode, doc, label = unit
    return all(results.has(label, mode, doc, b.label) for b in buckets)


# ----------------------------------------------------------------------------------------------- measuring


def _measure(
    config: RunConfig,
    model,
    tokenizer,
    schemes,
    doc_ids,
    doc_tokens,
    texts: dict[int, str],
    buckets,
    results,
    run_dir: Path,
    mine: set[Unit] | None = None,
) -> None:
    """Every mode and document in turn. A document with a missing point is measured from its first token
    (the reference and the schemes lacking points, in lockstep); only missing points are written. The
    reference's hidden states come from the reference cache when it holds them (keyed by the model's full
    weights, the tokenizer, the document's text and ids, the dtype and the chunking: `refcache`).

    mine: the (mode, document, scheme) units this process measures (None: all). A scheme's numbers do not
    depend on which others run beside it, so any division gives each point the one-process run's numbers;
    a process measuring a scheme of a document whose reference another owns still computes (or reads) the
    reference for its KL, but writes no reference row. Memory is measured on the device around every forward
    (`_MemoryMeter`) and written with each document's last bucket."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    refs = _reference_cache(model, tokenizer) if config.reference_cache else None
    tokens = res.TokenStore(run_dir / "tokens")

    def owns(mode: str, doc: int, label: str) -> bool:
        return mine is None or (mode, doc, label) in mine

    pairs = {(m, d) for m in config.modes for d in doc_ids} if mine is None else {(m, d) for m, d, _ in mine}
    bar = tqdm(
        total=len(pairs) * config.max_length,
        desc="tokens (all modes, docs, schemes in lockstep)",
        unit="tok",
        dynamic_ncols=True,
    )
    failed: dict[tuple[str, str], str] = {}
    try:
        with _MemoryMeter(model, device) as meter:
            for mode in config.modes:
                base = mode.removesuffix("-shift")
                mode_schemes = harness.runs_in(mode, schemes)
                harness.record_skipped(results, mode, [s for s in schemes if s not in mode_schemes])
                for doc in tqdm(doc_ids, desc=f"documents ({mode})", leave=False, dynamic_ncols=True):
                    if (mode, doc) not in pairs:
                        continue  # another process's document
                    write_ref = owns(mode, doc, REFERENCE)
                    todo = [
                        s
                        for s in mode_schemes
                        if owns(mode, doc, s.label)
                        and (s.label, mode) not in failed
                        and not all(results.has(s.label, mode, doc, b.label) for b in buckets)
                    ]
                    if not todo and (
                        not write_ref or all(results.has(REFERENCE, mode, doc, b.label) for b in buckets)
                    ):
                        bar.update(config.max_length)
                        continue
                    ids = torch.tensor([doc_tokens[doc]], dtype=torch.long, device=device)
                    # schemes with their own default chunk (peers: 128) run in their own lockstep, beside a
                    # reference chunked alike (its KL partner; its rows come from the first group)
                    for n, (chunk, group) in enumerate(_chunk_groups(config, base, todo, write_ref)):
                        _measure_group(
                            config, model, dtype, mode, doc, ids, texts.get(doc), chunk, group, buckets, refs,
                            meter, results, tokens, failed, write_ref=write_ref and n == 0,
                            progress=bar.update if n == 0 else None,
                        )
    finally:
        bar.close()


def _measure_group(
    config: RunConfig, model, dtype, mode: str, doc: int, ids, text, chunk: int, group, buckets, refs,
    meter: _MemoryMeter, results, tokens: res.TokenStore, failed: dict, *, write_ref: bool, progress,
) -> None:
    """One evaluate_document call: the reference and `group` in lockstep on one document at one chunk, its
    rows written (the last bucket's with the memory measured once the document is done)."""
    base = mode.removesuffix("-shift")
    shift = noise_shift(chunk) if mode.endswith("-shift") else 0
    prefill = config.prefill_length if base == "prefill" else None
    stored, key = None, None
    if refs is not None:
        key = refs.key(
            ids,
            dtype,
            steps(ids.shape[1], base, chunk, prefill, shift),
            text=text,
            layers="full" if base == "prefill" else "model",  # measure.make_cache
        )
        stored = refs.load(key)
        if stored is not None:
            logger.info("reference of doc %d (%s) read from the reference cache", doc, mode)
    memory = meter.document([s.label for s in group], live_reference=stored is None)
    pending: list[dict] = []  # the last bucket's rows, written with the memory measured
    measured: dict[str, dict] = {}
    try:
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
            on_bucket=_bucket_writer(
                results, tokens, mode, doc, write_ref=write_ref, last=buckets[-1], pending=pending,
                memory=memory,
            ),
            on_error=_error_writer(results, failed, mode, doc, memory),
            progress=progress,
        )
        measured = memory.finish()
    finally:  # interrupted: the finished last-bucket rows are kept, without memory
        meter.end_document()
        for row in pending:
            results.append({**row, **measured.get(row["scheme"], {})})


class _MemoryMeter:
    """Memory measured on the device around the measured forwards (`kvquant.memprobe.MemoryProbe`).

    A forward pre-hook and hook on the model's decoder open and close one probe per forward; the forward's
    `cache` says whose forward it is (`_DocumentMemory.label_of`). While the meter is open the objects alive
    at its start are frozen out of the garbage collector (`gc.freeze`): every probe reading runs
    `gc.collect()`, which otherwise walks the whole model and library heap (0.4 s a call here)."""

    def __init__(self, model, device):
        self.decoder = model.get_decoder()
        self.device = torch.device(device)
        self._handles: list = []
        self._doc: _DocumentMemory | None = None

    def __enter__(self) -> _MemoryMeter:
        from kvquant.memprobe import MemoryProbeError

        gc.freeze()  # no collection first: a full one costs as much as the freeze saves on a short run
        try:
            self._probe().current()
        except MemoryProbeError as e:
            gc.unfreeze()
            logger.warning("memory not measured in this run: %s", e)
            return self
        self._handles = [
            self.decoder.register_forward_pre_hook(self._before, with_kwargs=True),
            self.decoder.register_forward_hook(self._after, with_kwargs=True, always_call=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        if not self._handles:
            return
        for h in self._handles:
            h.remove()
        self._handles = []
        gc.unfreeze()

    def _probe(self):
        from kvquant.memprobe import MemoryProbe

        return MemoryProbe(self.device)

    def document(self, labels: list[str], live_reference: bool) -> _DocumentMemory:
        """Start measuring one evaluate_document call over the schemes `labels` (in its order)."""
        self._doc = _DocumentMemory(self, labels, live_reference, active=bool(self._handles))
        return self._doc

    def end_document(self) -> None:
        if self._doc is not None:
            self._doc.close_open()
        self._doc = None

    def _before(self, module, args, kwargs) -> None:
        doc = self._doc
        if doc is None or not doc.active:
            return
        doc.close_open()
        label = doc.label_of(kwargs.get("cache", kwargs.get("past_key_values")))
        if label is not None:
            probe = self._probe()
            probe.__enter__()
            doc.open = (label, probe)

    def _after(self, module, args, kwargs, output) -> None:
        if self._doc is not None:
            self._doc.close_open()


class _DocumentMemory:
    """The memory of one document's runs: each run's highest forward peak, and at the end (`finish`) what
    its cache held, measured by dropping it.

    Whose forward: evaluate_document runs the reference (a DynamicCache, when it is computed here) and then
    each scheme in the order given, every chunk; a scheme's cache is met first in that order (a scheme whose
    cache could not be made is reported through on_error before any forward and is taken out). A
    DynamicCache met while the reference is read from the reference cache is a scheme's FP prefill (prefill
    mode), not probed. Each bucket's report (`check`) confirms the attribution: the cache attributed to a
    label must hold the bytes and tokens evaluate_document reports for it, or the document's memory is
    dropped with a warning; a confirmed kvquant cache's pages are then counted per device
    (`kvquant.models.nbytes_by_device`, recorded by `finish` as `nbytes_by_device`)."""

    def __init__(self, meter: _MemoryMeter, labels: list[str], live_reference: bool, active: bool):
        self.meter = meter
        self.pending = list(labels)
        self.live_reference = live_reference
        self.active = active
        self.caches: dict[str, object] = {}  # label -> its cache, kept alive until finish() drops it
        self.by_id: dict[int, str] = {}
        self.peaks: dict[str, int] = {}
        self.by_device: dict[str, dict[str, int]] = {}  # label -> its pages per device at its last bucket
        self.open: tuple[str, object] | None = None
        self.method = ""
        self.valid = True

    def label_of(self, cache) -> str | None:
        if cache is None:
            return None
        if id(cache) in self.by_id:
            return self.by_id[id(cache)]
        from transformers.cache_utils import DynamicCache

        if type(cache) is DynamicCache:
            if not self.live_reference or REFERENCE in self.caches:
                return None
            label = REFERENCE
        elif self.pending:
            label = self.pending.pop(0)
        else:
            return None
        self.by_id[id(cache)] = label
        self.caches[label] = cache
        return label

    def close_open(self) -> None:
        """Close the probe of the forward that just ended (or raised)."""
        if self.open is None:
            return
        label, probe = self.open
        self.open = None
        probe.__exit__(None, None, None)
        self.method = probe.reading.peak_method
        self.peaks[label] = max(self.peaks.get(label, 0), probe.peak)

    def failed(self, label: str) -> None:
        """A scheme reported failed: not measured (its cache is let go)."""
        if label in self.pending:
            self.pending.remove(label)
        self.caches.pop(label, None)
        self.peaks.pop(label, None)
        self.by_device.pop(label, None)

    def check(self, label: str, nbytes, ntok) -> None:
        cache = self.caches.get(label)
        if cache is None or nbytes is None or not self.valid:
            return
        if cache_nbytes(cache) != nbytes or cache.get_seq_length() != ntok:
            self.valid = False
            logger.warning(
                "memory of this document not recorded: the forward attributed to %s does not hold its "
                "cache's %s bytes over %s tokens (evaluate_document's order of forwards changed?)",
                label, nbytes, ntok,
            )
        elif isinstance(cache, kvquant.QuantizedCache):  # the reference's DynamicCache has no pages
            from kvquant.models import nbytes_by_device

            self.by_device[label] = nbytes_by_device(cache)  # sums to nbytes (checked just above)

    def finish(self) -> dict[str, dict]:
        """Per label: `metrics.MEMORY_FIELDS`, with every cache still alive at the end of the document, each
        then dropped in turn (what dropping it gives back is what it held); a kvquant cache's rows also get
        `nbytes_by_device` ({device: bytes of its pages there}, summing to the row's `cache_bytes`)."""
        self.close_open()
        if not self.active or not self.valid:
            self.caches.clear()
            return {}
        probe = self.meter._probe()
        device = self.meter.device
        kind = ("memory_allocated; peaks max_memory_allocated" if device.type == "cuda"
                else f"resident set after gc + malloc_trim; peaks {self.method or 'VmHWM'}")
        out: dict[str, dict] = {}
        for label in list(self.caches):
            cache = self.caches.pop(label)
            reserved = cache.reserved_bytes() if hasattr(cache, "reserved_bytes") else None
            before = probe.current()
            del cache
            out[label] = {
                "cache_reserved": reserved,
                "mem_held": before - probe.current(),
                "mem_peak": self.peaks.get(label),
                "mem_probe": f"{device}: {kind}",
            }
            if label in self.by_device:
                out[label]["nbytes_by_device"] = self.by_device[label]
        return out


def _reference_cache(model, tokenizer) -> ReferenceCache | None:
    """The reference cache for this model, or None (with a warning) when its weights cannot be hashed."""
    from .refcache import WeightsUnhashable

    try:
        return ReferenceCache(model=model, tokenizer=tokenizer)
    except WeightsUnhashable as e:
        logger.warning("reference cache off for this run: %s", e)
        return None


def _chunk_groups(
    config: RunConfig, mode: str, todo: list[EvalScheme], write_ref: bool = True
) -> list[tuple[int, list[EvalScheme]]]:
    """(chunk, schemes) in cache mode, config.chunk's group first (it also writes the reference, even with no
    scheme of its own left to measure, unless write_ref is False); one group at config.chunk in the other
    modes."""
    if mode != "cache":
        return [(config.chunk, todo)]
    groups: dict[int, list[EvalScheme]] = {config.chunk: []}
    for s in todo:
        groups.setdefault(config.chunk_for(s), []).append(s)
    return [(c, g) for c, g in groups.items() if g or (c == config.chunk and write_ref)]


def _bucket_writer(
    results,
    tokens: res.TokenStore,
    mode: str,
    doc: int,
    *,
    write_ref: bool = True,
    last=None,
    pending: list[dict] | None = None,
    memory: _DocumentMemory | None = None,
):
    """evaluate_document's on_bucket: the point's per-token values, then one results.jsonl line per bucket
    not yet measured (the reference's only when write_ref). The `last` bucket's rows go to `pending`, written
    by the caller once the document's memory is measured (`_DocumentMemory.finish`)."""

    def on_bucket(label, bucket, st, nbytes, ntok):
        if memory is not None:
            memory.check(label, nbytes, ntok)
        if results.has(label, mode, doc, bucket.label) or (label == REFERENCE and not write_ref):
            return
        if label != REFERENCE:
            tokens.write(label, mode, doc, bucket.label, {k: v.numpy() for k, v in st.token_values().items()})
        row = {
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
        if pending is not None and bucket == last:
            pending.append(row)
        else:
            results.append(row)

    return on_bucket


def _error_writer(results, failed: dict[tuple[str, str], str], mode: str, doc: int,
                  memory: _DocumentMemory | None = None):
    """evaluate_document's on_error: the scheme is recorded as failed and skipped for the rest of the run."""

    def on_error(label, e):
        if memory is not None:
            memory.failed(label)
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


def _summary(rows, schemes, model_config, config: RunConfig, run_dir: Path | None = None) -> list[dict]:
    tokens = res.TokenStore(run_dir / "tokens") if run_dir is not None else None
    memory = memory_of(schemes, model_config, config.kv_dtype_name, config.dtype_name)
    return res.summarize(rows, memory, REFERENCE, tokens, seed=config.seed)


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
        prefill=config_json.get("prefill"),  # only a prefill-mode column uses it
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


def _probe_of(rows) -> str | None:
    """How the run's memory was measured (`mem_probe` of its rows), for the report."""
    return next((r["mem_probe"] for r in rows if r.get("mem_probe")), None)


def _write_outputs(
    run_dir: Path, rows, schemes, model_config, config: RunConfig, config_json: dict, progress: Progress
) -> list[dict]:
    """summary.csv, report.md and plots from everything results.jsonl holds (also after an interruption,
    then marked partial)."""
    summary = _summary(rows, schemes, model_config, config, run_dir)
    names = config_json.get("scheme_names", {})
    for r in summary:  # the report's names in summary.csv too (the reference as "fp32 (reference)")
        r["name"] = names.get(r["scheme"], r["scheme"])
    res.write_summary(run_dir / "summary.csv", summary)
    info = plot_info(config_json, progress)
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
        res.memory_table(summary, names, _probe_of(rows), config_json["dtype"]),
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
