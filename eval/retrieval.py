"""Retrieval under a quantized KV cache: passkey and needle-in-a-haystack over a grid of lengths x depths.

A probe is a prompt of exactly `length` tokens: an instruction, filler text from a corpus (the embedded
Wikipedia articles by default), a key hidden at depth d of the filler (0: right after the instruction, 1:
just before the question), and a question whose answer is the key:

  passkey  "The pass key is 48213. Remember it. 48213 is the pass key." ... "What is the pass key? The pass
           key is " -> "48213" (a 5-digit number)
  needle   "The best thing to do in Lisbon is to ride the old yellow tram." ... "What is the best thing to do
           in Lisbon? The best thing to do in Lisbon is to" -> " ride the old yellow tram"

The key and the filler's offset depend on (seed, task, trial) only, so one trial hides the same key in the
same text at every length and depth; the cells differ only in where it sits and how much text surrounds it.

Scoring, per scheme and probe, through the real cache: the prompt goes through the scheme's cache as the mode
says (cache: decode-exact chunks of `chunk` tokens; fake: one forward with K/V fake-quantized; prefill: one
forward with FP attention, stored quantized), then the answer is decoded token by token through that cache,
teacher-forced: at each step the greedy token is recorded and the answer's token is fed. `exact` = every
greedy token equals the answer's (which is exactly what free greedy decoding of len(answer) tokens yields,
since the two paths agree until the first miss); `answer_logprob` = sum of log p(answer token). The reference
is the unquantized model at the run dtype through a plain DynamicCache, chunked alike; each scheme's point is
also compared with it (same greedy tokens, Δ log p), which matters when the model itself fails a cell.

Results follow the perplexity job's run-directory conventions, through the one run harness (`harness`:
config.json, results.jsonl flushed per point, summary.csv, report.md, plots: `heatmap-<scheme>.png`, depth x
length); reruns resume, and torchrun ranks or `--shard I/N` + `--merge` divide the grid's points. A point's
results.jsonl key is (scheme, mode, doc = trial, bucket = `L<length>-d<depth>`). The grid is not part of a
run's identity: rerunning into the same directory with other lengths, depths or trials measures only the new
points, and the report covers the union of the grids (a 16k-32k run grown by 2k-8k is one 2k-32k table).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import re
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from . import harness, metrics, scoring
from . import results as res
from .config import ANSWER_ROOM, Progress, RunConfig, RunError, validate
from .data import CorpusError, load_corpus
from .measure import REFERENCE, _hidden, cache_nbytes, fp_prompt, make_cache, steps, store_prefill
from .schemes import EvalScheme

__all__ = [
    "Probe",
    "Outcome",
    "make_probe",
    "filler_tokens",
    "score_probe",
    "prompt_forward",
    "run_retrieval",
    "summarize_retrieval",
    "summary_table",
    "plot_heatmap",
]

logger = logging.getLogger(__name__)

INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
    "memorize it. I will quiz you about it.\n\n"
)
PASSKEY = (
    " The pass key is {key}. Remember it. {key} is the pass key. ",
    "\n\nWhat is the pass key? The pass key is",
    " {key}",
)
CITIES = ("Lisbon", "Kyoto", "Nairobi", "Oslo", "Lima", "Hanoi", "Quebec", "Seville")
ACTIVITIES = (
    "ride the old yellow tram",
    "walk along the river at dawn",
    "eat grilled fish by the harbour",
    "climb the hill behind the cathedral",
    "visit the small museum of clocks",
    "swim in the cold northern lake",
    "buy bread from the corner bakery",
    "watch the sunset from the lighthouse",
)
NEEDLE = (
    " The best thing to do in {city} is to {activity}. ",
    "\n\nWhat is the best thing to do in {city}? The best thing to do in {city} is to",
    " {activity}",
)
FILLER_DOCS = 40  # corpus documents concatenated into the haystack (Wikipedia: ~250k tokens)


@dataclass(frozen=True)
class Probe:
    """One prompt of the grid: ids (exactly `length` tokens) and the answer the model should give."""

    task: str
    length: int
    depth: float
    trial: int
    ids: tuple[int, ...]
    answer: str
    answer_ids: tuple[int, ...]
    needle_at: int  # token index where the key's sentence starts

    @property
    def cell(self) -> str:
        """results.jsonl's `bucket` of this point."""
        return cell_label(self.length, self.depth)


def cell_label(length: int, depth: float) -> str:
    return f"L{length}-d{depth:g}"


@dataclass(frozen=True)
class Grid:
    """A retrieval run's grid: prompt lengths x key depths x trials per cell."""

    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    trials: int

    @classmethod
    def of(cls, config: RunConfig) -> Grid:
        return cls(tuple(config.grid_lengths), tuple(config.grid_depths), config.grid_trials)

    @classmethod
    def stored(cls, config_json: Mapping) -> Grid:
        """The grid a run directory's config.json records."""
        return cls(
            tuple(int(L) for L in config_json["lengths"]),
            tuple(float(d) for d in config_json["depths"]),
            int(config_json["trials"]),
        )

    def cells(self) -> list[tuple[int, float, int]]:
        """(length, depth, trial), shortest prompts first."""
        return [(L, d, t) for L in self.lengths for d in self.depths for t in range(self.trials)]

    def union(self, other: Grid) -> Grid:
        return Grid(
            tuple(sorted({*self.lengths, *other.lengths})),
            tuple(sorted({*self.depths, *other.depths})),
            max(self.trials, other.trials),
        )

    def flags(self) -> str:
        """The run.py flags that request this grid."""
        depths = ",".join(f"{d:g}" for d in self.depths)
        return f"--lengths {','.join(map(str, self.lengths))} --depths {depths} --trials {self.trials}"


GRID_KEYS = ("lengths", "depths", "trials")  # in config.json, not in the identity: a run's grid may grow


@dataclass(frozen=True)
class Outcome:
    """What one scheme did with one probe."""

    exact: bool
    first_token: bool
    answer_logprob: float  # sum over the answer's tokens, nats
    greedy_ids: tuple[int, ...]  # the greedy token at each answer step (teacher-forced)
    cache_bytes: int | None
    cache_tokens: int


def filler_tokens(tokenizer, corpus: str = "wikipedia", docs: int = FILLER_DOCS) -> list[int]:
    """The haystack: the corpus's first `docs` documents, tokenized and joined by blank lines."""
    try:
        documents = load_corpus(corpus)
    except CorpusError as e:
        raise RunError(str(e)) from None
    out: list[int] = []
    sep = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    for d in documents[:docs]:
        out += tokenizer(d.text, add_special_tokens=False)["input_ids"] + sep
    return out


def _key(task: str, seed: int, trial: int) -> tuple[random.Random, tuple[str, str, str]]:
    rng = random.Random(f"kvquant-retrieval:{seed}:{task}:{trial}")
    if task == "passkey":
        key = str(rng.randint(10000, 99999))
        return rng, tuple(t.format(key=key) for t in PASSKEY)
    city, activity = rng.choice(CITIES), rng.choice(ACTIVITIES)
    return rng, tuple(t.format(city=city, activity=activity) for t in NEEDLE)


def _ends_sentence(token: str) -> bool:
    t = token.replace("Ċ", "\n")  # byte-level BPE writes a newline as Ċ
    return t.rstrip(" Ġ").endswith((".", "!", "?")) or "\n" in t


def _split_answer(tokenizer, question: str, answer: str) -> tuple[list[int], list[int]]:
    """Question and answer ids as the tokenizer reads them together (as in the hidden sentence); a leading
    whitespace-only answer token (a byte-level BPE's lone space before digits) joins the question, so the
    answer starts with its first real token."""
    q = tokenizer(question, add_special_tokens=False)["input_ids"]
    qa = tokenizer(question + answer, add_special_tokens=False)["input_ids"]
    if qa[: len(q)] != q:  # the boundary merged into one token: tokenize apart
        return q, tokenizer(answer, add_special_tokens=False)["input_ids"]
    a = qa[len(q) :]
    while len(a) > 1 and not tokenizer.decode(a[:1]).strip():
        q, a = q + a[:1], a[1:]
    return q, a


def make_probe(
    task: str, tokenizer, filler: Sequence[int], length: int, depth: float, trial: int, seed: int = 0
) -> Probe:
    """The prompt of one grid cell and trial, exactly `length` tokens; the key's sentence is placed at the
    sentence boundary of the filler nearest to `depth` of it (at its very start for 0, its end for 1)."""
    if task not in ("passkey", "needle"):
        raise ValueError(f"unknown retrieval task {task!r}; known: passkey, needle")
    rng, (needle, question, answer) = _key(task, seed, trial)
    intro_ids = tokenizer(INTRO, add_special_tokens=True)["input_ids"]  # BOS where the model needs one
    needle_ids = tokenizer(needle, add_special_tokens=False)["input_ids"]
    question_ids, answer_ids = _split_answer(tokenizer, question, answer)
    budget = length - len(intro_ids) - len(needle_ids) - len(question_ids)
    if budget < 1:
        raise RunError(
            f"length {length} leaves no room for filler text ({length - budget} tokens of "
            f"instruction, key and question); use lengths of at least {length - budget + 64}"
        )
    if len(filler) < 2 * budget:
        raise RunError(f"the filler corpus holds {len(filler):,} tokens, too few for length {length}")
    start = rng.randrange(len(filler) - budget)  # fixed per trial: rng draws the same numbers at any length
    hay = list(filler[start : start + budget])
    target = round(depth * budget)
    if 0 < target < budget:
        pieces = tokenizer.convert_ids_to_tokens(hay)
        cuts = [i + 1 for i, t in enumerate(pieces[:-1]) if _ends_sentence(t)]
        if cuts:
            target = min(cuts, key=lambda c: (abs(c - target), c))
    ids = intro_ids + hay[:target] + needle_ids + hay[target:] + question_ids
    assert len(ids) == length, (len(ids), length)
    return Probe(
        task, length, float(depth), trial, tuple(ids), answer, tuple(answer_ids), len(intro_ids) + target
    )


@torch.inference_mode()
def prompt_forward(model, probe: Probe) -> tuple[object, torch.Tensor]:
    """Prefill mode's FP forward of a probe's whole prompt: its DynamicCache and the last position's hidden
    state (1, 1, hidden). Every scheme stores (quantizes) the same K/V from it, so one forward serves them."""
    ids = torch.tensor([probe.ids], dtype=torch.long, device=next(model.parameters()).device)
    fp_cache, hidden = fp_prompt(model, ids)
    return fp_cache, hidden[:, -1:]


@torch.inference_mode()
def score_probe(
    model, probe: Probe, scheme: EvalScheme | None, *, mode: str = "cache", chunk: int = 1024,
    prompt: tuple[object, torch.Tensor] | None = None,
) -> Outcome:
    """Feed the prompt through `scheme`'s cache (None: the reference, a DynamicCache) as `mode` says, then
    decode the answer token by token through the same cache, teacher-forced (see the module docstring).
    prompt: in prefill mode, `prompt_forward(model, probe)` computed once for the probe's schemes (a scheme
    stores from it and leaves it unchanged; the reference decodes on in it, so it must be the last user)."""
    device = next(model.parameters()).device
    ids = torch.tensor([probe.ids], dtype=torch.long, device=device)
    if mode == "prefill":
        # the whole prompt in one forward with FP attention among its tokens, then stored (quantized)
        fp_cache, hidden = prompt if prompt is not None else prompt_forward(model, probe)
        cache = fp_cache
        if scheme is not None:
            cache = make_cache(scheme, model.config, mode)
            store_prefill(cache, fp_cache)
    else:
        cache = make_cache(scheme, model.config, mode)
        bounds = steps(ids.shape[1], mode, chunk)
        for a, b in zip(bounds, bounds[1:], strict=False):
            hidden = _hidden(model, ids[:, a:b], cache)[:, -1:]
    answer = list(probe.answer_ids)
    total, greedy = 0.0, []
    for i, tok in enumerate(answer):
        lp = torch.log_softmax(scoring.logits(model, hidden[0, -1]), dim=-1)  # (vocab,)
        greedy.append(int(lp.argmax()))
        total += float(lp[tok])
        if i + 1 < len(answer):
            hidden = _hidden(model, torch.tensor([[tok]], dtype=torch.long, device=device), cache)
    return Outcome(
        exact=greedy == answer,
        first_token=greedy[0] == answer[0],
        answer_logprob=total,
        greedy_ids=tuple(greedy),
        cache_bytes=cache_nbytes(cache) if scheme is not None else None,
        cache_tokens=cache.get_seq_length(),
    )


# --------------------------------------------------------------------------------------------- the run


def _identity(config: RunConfig, schemes, model_name: str) -> dict:
    return {
        "task": config.task,
        "schemes": [s.label for s in schemes],
        "chunks": {s.label: config.chunk_for(s) for s in schemes} | {REFERENCE: config.chunk},
        "model": model_name,
        "corpus": config.corpus,
        "modes": list(config.modes),
        "seed": config.seed,
        "dtype": config.dtype_name,
    }


def run_dir_for(config: RunConfig, identity: dict) -> Path:
    if config.out:
        return Path(config.out)
    model = harness.slug(Path(identity["model"]).name)
    return harness.default_run_dir(f"{model}-{config.task}-{config.mode}", identity)


def _grown_grid(run_dir: Path, identity: dict, requested: Grid, force: bool) -> Grid:
    """The requested grid grown by the one `run_dir` already holds when it holds the same run (the same
    identity, the grid aside); else the requested grid."""
    cfg = run_dir / "config.json"
    if force or not cfg.is_file():
        return requested
    try:
        old = json.loads(cfg.read_text())
        held = Grid.stored(old)
    except (OSError, ValueError, KeyError, TypeError):
        return requested  # not a retrieval run: harness.prepare_dir refuses it
    if harness.stored_identity(old, GRID_KEYS) != identity:
        return requested  # another run: harness.prepare_dir refuses it
    grown = requested.union(held)
    if grown != requested:
        logger.info("%s holds %s; the run's grid grows to %s", run_dir, held.flags(), grown.flags())
    return grown


def run_retrieval(config: RunConfig, *, model=None, tokenizer=None) -> tuple[Path, list[dict]]:
    """Run (or resume) a retrieval grid; returns (run directory, summary rows). As `runner.run`, on the one
    harness (`harness.execute`): RunError before any long work, RunInterrupted after writing everything
    measured on Ctrl-C; torchrun ranks, `--shard I/N` and `--merge` divide the grid's points (each point's
    numbers are the one-process run's: a probe depends on (seed, task, trial, length, depth) only)."""
    if not config.is_retrieval:
        raise RunError(f"task {config.task!r} is not a retrieval task")
    role = harness.role_of(config)
    config = validate(config, check_model=model is None)  # the schemes parsed here, once
    schemes = list(config.parsed)
    device = harness.rank_device(config.device, role)
    if model is None:
        harness.check_device(device)
    model, tokenizer, model_name = harness.load_model(config, model, tokenizer, device)
    _check_lengths(config, model, schemes)
    filler = filler_tokens(tokenizer, config.corpus)
    requested = Grid.of(config)
    probes = {
        (L, d, t): make_probe(config.task, tokenizer, filler, L, d, t, config.seed)
        for L, d, t in requested.cells()
    }
    identity = _identity(config, schemes, model_name)
    run_dir = run_dir_for(config, identity)
    if config.merge and not (run_dir / "config.json").is_file():
        raise RunError(
            f"--merge: {run_dir} holds no run (no config.json); run the shards (--shard I/N) first"
        )
    grid = _grown_grid(run_dir, identity, requested, config.force)
    config_json = _config_json(config, identity, grid, schemes, probes)
    config_json["device"] = device
    asked = _points(requested, config.modes, schemes)  # the units: each point is measured on its own

    def announce(results, mine: list) -> None:
        done = sum(results.has(*p) for p in mine)
        if done:
            logger.info("resuming: %d of %d points already measured in %s", done, len(mine), run_dir)
        else:
            logger.info("measuring %d points (%s) into %s", len(mine), config.task, run_dir)

    work = harness.Work(
        units=asked,
        points=_points(grid, config.modes, schemes),  # progress is over the run's whole grid
        points_of=lambda mine: [p for p in asked if p in mine],
        unit_done=lambda results, p: results.has(*p),
        measure=lambda results, mine: _measure(config, model, schemes, probes, results, mine),
        write_outputs=lambda rows, progress: _write_outputs(
            run_dir, rows, schemes, model.config, config, config_json, progress
        ),
        announce=announce,
    )
    return harness.execute(config, role, run_dir, config_json, identity, work, ignore=GRID_KEYS)


def _check_lengths(config: RunConfig, model, schemes) -> None:
    longest = max(config.grid_lengths) + ANSWER_ROOM  # the answer's tokens follow the prompt
    from kvquant.quirks import max_positions

    max_pos = max_positions(model.config)
    if max_pos is not None and longest > max_pos:
        raise RunError(
            f"--lengths {max(config.grid_lengths)} (+ the answer) is beyond the model's {max_pos} positions"
        )
    harness.check_model_fits(
        dataclasses.replace(config, max_length=min(config.max_length, longest)), model, schemes
    )


def _points(grid: Grid, modes: Sequence[str], schemes) -> list[tuple]:
    return [
        (label, mode, t, cell_label(L, d))
        for mode in modes
        for L, d, t in grid.cells()
        for label in [REFERENCE, *(s.label for s in harness.runs_in(mode, schemes))]
    ]


def _measure(
    config: RunConfig, model, schemes, probes: dict, results: res.RunResults, mine: set | None = None
) -> None:
    """Cell by cell (short lengths first, so an interrupted grid is still a grid), every scheme then the
    reference on the same probe; each point is written as soon as it is measured. In prefill mode the
    prompt's FP forward runs once per probe (`prompt_forward`, outside the points' timing) and the reference,
    which decodes on in its cache, comes last. mine: the points this process measures (None: all)."""
    from tqdm.auto import tqdm

    failed: set[tuple[str, str]] = set()
    todo = [(mode, key) for mode in config.modes for key in probes]
    for mode, key in tqdm(todo, desc=f"{config.task} probes", unit="probe", dynamic_ncols=True):
        mode_schemes = harness.runs_in(mode, schemes)
        harness.record_skipped(results, mode, [s for s in schemes if s not in mode_schemes])
        probe = probes[key]
        prompt = None  # prefill mode: the probe's FP prompt forward, shared by its points
        for s in [*mode_schemes, None]:
            label = REFERENCE if s is None else s.label
            if mine is not None and (label, mode, probe.trial, probe.cell) not in mine:
                continue  # another process's point
            if (label, mode) in failed or results.has(label, mode, probe.trial, probe.cell):
                continue
            chunk = config.chunk if s is None else config.chunk_for(s)
            try:
                if mode == "prefill" and prompt is None:
                    prompt = prompt_forward(model, probe)
                t0 = time.perf_counter()
                out = score_probe(model, probe, s, mode=mode, chunk=chunk, prompt=prompt)
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001 - recorded; the other schemes go on
                logger.warning("scheme %s failed: %s: %s", label, type(e).__name__, e)
                failed.add((label, mode))
                results.append(
                    {
                        "scheme": label,
                        "mode": mode,
                        "doc": probe.trial,
                        "bucket": None,
                        "status": "failed",
                        "error": f"{type(e).__name__}: {e}",
                    }
                )
                continue
            results.append(_row(label, mode, probe, out, chunk, time.perf_counter() - t0))


def _row(label: str, mode: str, probe: Probe, out: Outcome, chunk: int, seconds: float) -> dict:
    return {
        "scheme": label,
        "mode": mode,
        "doc": probe.trial,
        "bucket": probe.cell,
        "task": probe.task,
        "length": probe.length,
        "depth": probe.depth,
        "trial": probe.trial,
        "needle_at": probe.needle_at,
        "answer": probe.answer,
        "answer_ids": list(probe.answer_ids),
        "greedy_ids": list(out.greedy_ids),
        "trials": 1,
        "exact": int(out.exact),
        "first_token": int(out.first_token),
        "answer_logprob": out.answer_logprob,
        "chunk": chunk if mode == "cache" else None,
        "cache_bytes": out.cache_bytes,
        "cache_tokens": out.cache_tokens,
        "seconds": round(seconds, 3),
        "status": "ok",
    }


def _config_json(config: RunConfig, identity: dict, grid: Grid, schemes, probes: dict) -> dict:
    example = probes[min(probes)]
    return {
        "identity": identity,
        "task": config.task,
        "schemes": identity["schemes"],
        "scheme_names": harness.display_names(schemes, identity["dtype"]),
        "reference": REFERENCE,
        "model": identity["model"],
        "corpus": config.corpus,
        "mode": config.mode,
        "chunk": config.chunk,
        "chunks": identity["chunks"],
        "lengths": list(grid.lengths),
        "depths": list(grid.depths),
        "trials": grid.trials,
        "seed": config.seed,
        "device": config.device,
        "dtype": identity["dtype"],
        "kv_dtype": config.kv_dtype_name,
        "example_answer": example.answer,
        **harness.provenance(schemes),
    }


# ------------------------------------------------------------------------------------------------ summary


def summarize_retrieval(
    rows, memory: Mapping[str, res.Memory] | None = None, reference: str = REFERENCE
) -> list[dict]:
    """summary.csv rows: per (scheme, mode, length, depth) over trials, then per (scheme, mode, length) over
    depths (depth `all`), then per (scheme, mode) (length and depth `all`); every metric as
    `metrics.RETRIEVAL_METRICS` declares it. same_as_ref / Δ log p pair each point with the reference's."""
    ok = [dict(r) for r in rows if r.get("status") == "ok" and r.get("task")]
    ref = {(r["mode"], r["bucket"], r["doc"]): r for r in ok if r["scheme"] == reference}
    task = ok[0]["task"] if ok else ""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in ok:
        groups[(r["scheme"], r["mode"])].append(r)
    failed = {(r["scheme"], r["mode"]): r["status"] for r in rows if r.get("status") in ("failed", "skipped")}
    order = list(dict.fromkeys([*groups, *failed]))
    order.sort(key=lambda k: (k[1], k[0] != reference))
    out = []
    for scheme, mode in order:
        rs = groups.get((scheme, mode), [])
        for r in rs:
            other = ref.get((mode, r["bucket"], r["doc"]))
            r["same_as_ref"] = math.nan if other is None else float(r["greedy_ids"] == other["greedy_ids"])
            r["logprob_delta"] = math.nan if other is None else r["answer_logprob"] - other["answer_logprob"]
        status = failed.get((scheme, mode), "ok")
        cells: dict[tuple, list[dict]] = defaultdict(list)
        for r in rs:
            cells[(r["length"], r["depth"])].append(r)
            cells[(r["length"], "all")].append(r)
            cells[("all", "all")].append(r)
        if not cells:
            cells[("all", "all")] = []
        lengths = sorted({k[0] for k in cells if k[0] != "all"})
        keys = [(L, d) for L in lengths for d in sorted(k[1] for k in cells if k[0] == L and k[1] != "all")]
        keys += [(L, "all") for L in lengths] + [("all", "all")]
        for length, depth in keys:
            part = cells[(length, depth)]
            totals = {f: sum(float(r[f]) for r in part) for f in metrics.RETRIEVAL_SUMS}
            row = {
                "task": task,
                "scheme": scheme,
                "mode": mode,
                "length": length,
                "depth": depth,
                "status": status,
            }
            for m in metrics.RETRIEVAL_METRICS:
                row[m.name] = m.value(totals, None) if part else math.nan
            mem, ref_mem = (memory or {}).get(scheme), (memory or {}).get(reference)
            n = max((r["length"] for r in part), default=0) + len(part[0]["answer_ids"]) if part else 0
            row["bytes_per_token"] = mem.held(n) / n if mem and n else math.nan
            row["saving"] = ref_mem.held(n) / mem.held(n) if mem and ref_mem and n else math.nan
            out.append(row)
    return out


def write_summary(path: Path, rows: list[dict]) -> None:
    import csv

    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=metrics.RETRIEVAL_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    tmp.replace(path)


def _finite(x) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def _fmt(name: str, x) -> str:
    return metrics.format_value(name, x)


def summary_table(summary: list[dict], names: Mapping[str, str] | None = None) -> str:
    """Per mode: scheme x length, cells `exact-match rate (mean log p)` over depths and trials; then overall
    exact match, log p, Δ log p and same-as-reference, bytes per token and saving at the longest length."""
    names = names or {}
    out = []
    for mode in dict.fromkeys(r["mode"] for r in summary):
        rows = [r for r in summary if r["mode"] == mode]
        lengths = sorted({r["length"] for r in rows if r["length"] != "all"})
        cols = ["exact_match", "answer_logprob", "answer_logprob_delta", "same_as_ref"]
        head = [
            "scheme",
            *(f"L={res.position_label(L)}" for L in lengths),
            *(metrics.metric(c).title for c in cols),
            "B/token",
            "saving",
        ]
        out += [
            f"**{rows[0]['task'] if rows else ''}, mode: {mode}** — per length: exact-match rate over depths "
            "and trials (mean log p(answer), nats); then over the whole grid; Δ log p and same-as-ref "
            "compare with the reference on the same prompts",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
        ]
        for scheme in dict.fromkeys(r["scheme"] for r in rows):
            by = {(r["length"], r["depth"]): r for r in rows if r["scheme"] == scheme}
            a = by.get(("all", "all"), {})
            cells = [f"`{names.get(scheme, scheme)}`"]
            for L in lengths:
                r = by.get((L, "all"))
                cells.append(
                    "–"
                    if r is None
                    else f"{_fmt('exact_match', r['exact_match'])} ({_fmt('answer_logprob', r['answer_logprob'])})"  # noqa: E501
                )
            if a.get("status", "ok") != "ok":
                cells += [a["status"]] + [""] * (len(cols) + 1)
            else:
                cells += [_fmt(c, a.get(c)) for c in cols]
                cells += [
                    metrics.format_value("bytes_per_token", a.get("bytes_per_token")),
                    _fmt("saving", a.get("saving")) + ("x" if _finite(a.get("saving")) else ""),
                ]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def grid_tables(summary: list[dict], names: Mapping[str, str] | None = None) -> str:
    """Per mode and scheme: depth x length, cells `exact-match rate / mean log p`."""
    names = names or {}
    out = []
    for mode in dict.fromkeys(r["mode"] for r in summary):
        for scheme in dict.fromkeys(r["scheme"] for r in summary if r["mode"] == mode):
            rows = [
                r
                for r in summary
                if r["mode"] == mode
                and r["scheme"] == scheme
                and r["length"] != "all"
                and r["depth"] != "all"
            ]
            if not rows:
                continue
            lengths = sorted({r["length"] for r in rows})
            depths = sorted({r["depth"] for r in rows})
            by = {(r["length"], r["depth"]): r for r in rows}
            out += [
                f"`{names.get(scheme, scheme)}` ({mode}): exact match / mean log p(answer)",
                "",
                "| depth | " + " | ".join(res.position_label(L) for L in lengths) + " |",
                "|" + "---|" * (len(lengths) + 1),
            ]
            for d in depths:
                cells = [f"{d:g}"]
                for L in lengths:
                    r = by.get((L, d))
                    cells.append(
                        "–"
                        if r is None
                        else f"{_fmt('exact_match', r['exact_match'])} / {_fmt('answer_logprob', r['answer_logprob'])}"  # noqa: E501
                    )
                out.append("| " + " | ".join(cells) + " |")
            out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------- plots


def _trials_per_cell(trials: int, summary: Sequence[dict] = ()) -> str:
    """`1 trial per cell`, `3 trials per cell`; `1-3 trials per cell` where the summary's cells differ (a grid
    grown by more trials in some cells)."""
    counts = sorted({int(r["trials"]) for r in summary if r["length"] != "all" and r["depth"] != "all"})
    if len(counts) > 1:
        return f"{counts[0]}-{counts[-1]} trials per cell"
    trials = counts[0] if counts else trials
    return f"{trials} trial{'s' if trials != 1 else ''} per cell"


def _slug(text: str) -> str:
    """A file-name part: `fp32 (reference)` -> `fp32-reference`."""
    return re.sub("-+", "-", "".join(c if c.isalnum() or c in "-._" else "-" for c in text)).strip("-")[:60]


def plot_heatmap(summary: list[dict], scheme: str, mode: str, title: str, logprob_range: tuple[float, float]):
    """One scheme's grid: depth (rows, 0 at the top) x length (columns); left panel colour = exact-match rate
    (0..1), right panel colour = mean log p(answer) on a range shared by every scheme of the run; each cell
    carries its value."""
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [
        r
        for r in summary
        if r["scheme"] == scheme and r["mode"] == mode and r["length"] != "all" and r["depth"] != "all"
    ]
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    by = {(r["length"], r["depth"]): r for r in rows}
    fig, axes = plt.subplots(
        1, 2, figsize=(4.0 + 1.6 * len(lengths), 1.6 + 0.55 * len(depths)), layout="constrained"
    )
    panels = (
        ("exact_match", "exact-match rate", (0.0, 1.0), "RdYlGn", "{:.2f}"),
        ("answer_logprob", "mean log p(answer), nats", logprob_range, "viridis", "{:.1f}"),
    )
    for ax, (key, label, (lo, hi), cmap, fmt) in zip(axes, panels, strict=True):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for (L, d), r in by.items():
            grid[depths.index(d), lengths.index(L)] = float(r[key])
        im = ax.imshow(grid, cmap=cmap, vmin=lo, vmax=hi, aspect="auto")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if math.isfinite(grid[i, j]):
                    frac = (grid[i, j] - lo) / (hi - lo) if hi > lo else 0.5
                    ax.text(
                        j,
                        i,
                        fmt.format(grid[i, j]),
                        ha="center",
                        va="center",
                        fontsize=9,
                        color="white" if (frac < 0.35 if key == "answer_logprob" else False) else "black",
                    )
        ax.set_xticks(range(len(lengths)), [res.position_label(L) for L in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("depth of the key (0 = start)")
        ax.set_title(label, fontsize=10)
        fig.colorbar(im, ax=ax, shrink=0.9)
    fig.suptitle(title, fontsize=11)
    return fig


def write_heatmaps(
    run_dir: Path, summary: list[dict], config_json: dict, progress: Progress | None = None
) -> list[Path]:
    """heatmap-<scheme>[-<mode>].png per scheme (the reference included)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = config_json.get("scheme_names", {})
    cells = [
        r
        for r in summary
        if r["length"] != "all" and r["depth"] != "all" and math.isfinite(float(r["answer_logprob"]))
    ]
    if not cells:
        return []
    lps = [float(r["answer_logprob"]) for r in cells]
    lp_range = (min(min(lps), -1.0), 0.0)
    modes = list(dict.fromkeys(r["mode"] for r in cells))
    model = Path(config_json["model"].removesuffix(" (embedded default)")).name
    partial = "" if progress is None or progress.complete else f"\nPARTIAL: {progress} measured"
    paths = []
    for mode in modes:
        for scheme in dict.fromkeys(r["scheme"] for r in cells if r["mode"] == mode):
            name = names.get(scheme, scheme)
            title = (
                f"{config_json['task']}: {name}, mode {mode}\n{model}, "
                f"{_trials_per_cell(config_json['trials'], summary)}, {config_json['dtype']}" + partial
            )
            fig = plot_heatmap(summary, scheme, mode, title, lp_range)
            suffix = "" if len(modes) == 1 else f"-{mode}"
            path = run_dir / f"heatmap-{_slug(name)}{suffix}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            paths.append(path)
    return paths


def _write_outputs(
    run_dir: Path, rows, schemes, model_config, config: RunConfig, config_json: dict, progress: Progress
) -> list[dict]:
    summary = summarize_retrieval(rows, harness.memory_of(schemes, model_config, config.kv_dtype_name))
    write_summary(run_dir / "summary.csv", summary)
    names = config_json.get("scheme_names", {})
    try:
        plots = write_heatmaps(run_dir, summary, config_json, progress)
    except Exception as e:  # noqa: BLE001 - a plotting failure never loses results
        logger.warning("plots not written: %s", e)
        plots = []
    chunks = ", ".join(f"`{names.get(k, k)}` {v}" for k, v in config_json["chunks"].items())
    partial = (
        [f"**partial: {progress} of the grid measured** (rerun with `{Grid.stored(config_json).flags()}` "
         "to measure the rest)", ""]
        if not progress.complete
        else []
    )
    report = [
        f"# kvquant retrieval: {config_json['task']} on {config_json['model']}",
        "",
        *partial,
        f"- filler text: {config_json['corpus']}; lengths {', '.join(map(str, config_json['lengths']))}; "
        f"depths {', '.join(f'{d:g}' for d in config_json['depths'])}; "
        f"{_trials_per_cell(config_json['trials'], summary)} (e.g. answer {config_json['example_answer']!r})",
        f"- mode(s): {config_json['mode']}; tokens per forward in cache mode: {chunks}",
        f"- reference `{names.get(REFERENCE, REFERENCE)}`: unquantized, computing in {config_json['dtype']}; "
        f"bytes at {config_json['kv_dtype']} K/V storage at the longest prompt",
        *res.provenance_lines(config_json, progress),
        "",
        "exact match = the greedy answer equals the key token for token; log p(answer) = its teacher-forced "
        "log-probability; Δ log p and same-as-ref compare with the reference on the same prompt, which is "
        "what counts where the model fails the task even unquantized.",
        "",
        summary_table(summary, names),
        grid_tables(summary, names),
        *(f"![{p.stem}]({p.name})\n" for p in plots),
    ]
    (run_dir / "report.md").write_text("\n".join(report), encoding="utf-8")
    return summary
