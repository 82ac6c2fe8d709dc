"""The serving simulation behind `experiments/serve.py`: requests sharing a system prompt, run on a shared
page store with and without prefix caching and under each eviction policy, for several schemes.

Workload: N requests = one system prompt of P tokens (a Wikipedia article's opening) + a message of its own
(a slice of another article), `context` tokens in all, then `reply` tokens. The reference is the FP16 model
without any cache machinery (transformers' DynamicCache): its greedy reply of each request. Every other run
decodes teacher-forced on that reply, so all runs hold the same tokens and `agreement` is the fraction of
reply positions where the run's greedy token equals the reference's.

Per (scheme, prefix cache on/off, policy) row: time to first token per request (prefill, lookup included),
tokens computed vs reused, prefix hit rate, bytes held over time (the store's pages at FP16, the deployment
dtype), peak bytes vs the budget, pages evicted, failed requests, agreement; for the no-eviction rows also
how many requests fit in a fixed budget (prefills admitted until the budget refuses), against the formula
(`kvquant.memory.capacity`).

Run directory (as `experiments/run.py`): config.json, results.jsonl (one line per request, per fit probe, per
timeline sample), summary.csv, report.md, serve.png.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from . import harness
from .config import WANDB_MODES, ParsedSchemes, RunError
from .results import SERVE_SUMMARY_COLUMNS

__all__ = ["SUMMARY_COLUMNS", "ServeConfig", "ServeError", "check_config", "run", "build_workload"]

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from kvquant.scheme import Scheme

SUMMARY_COLUMNS = SERVE_SUMMARY_COLUMNS


class ServeError(ValueError):
    """Bad input to the simulation, found before any long work."""


@dataclass(frozen=True)
class ServeConfig:
    """One serving simulation. `schemes` as given label its rows; `check_config` returns the copy holding them
    parsed (`parsed`, one Scheme per label), which every function past validation takes."""

    schemes: tuple[str, ...] = ("fp16", "int4-g64", "kivi-4")
    requests: int = 8
    context: int = 512  # prompt tokens per request (system prompt + message)
    shared_fraction: float = 0.5  # P / context
    reply: int = 16  # reply tokens per request
    index: str = "radix"  # prefix index when prefix caching is on: radix | hash
    policies: tuple[str, ...] = ("lru", "radix-lru", "sliding:128")
    concurrency: int = 2  # requests running at once in the eviction rows
    # the eviction rows' budget, between what the running requests of the same scheme's prefix-cache row
    # without a budget held at most (R) and that row's peak with every cached unit (P): R + f * (P - R), so
    # cached units must be evicted while the running requests always fit
    budget_fraction: float = 0.5
    fit_fp16_requests: int = 4  # the fit probe's budget: this many FP16 requests of `context` tokens
    fit_max: int = 48  # the fit probe stops here
    block_size: int = 16
    seed: int = 0
    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 1  # torch threads: on a shared 2-core machine one thread is several times faster
    out: str | None = None
    force: bool = False
    wandb: str = "disabled"
    extra: dict = field(default_factory=dict, compare=False)
    # set by `check_config` (ParsedSchemes.attach), never by hand; read it as `parsed` / `scheme_of`
    parsed_schemes: ParsedSchemes | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "parsed_schemes", ParsedSchemes.kept(self))

    @property
    def shared_tokens(self) -> int:
        return int(round(self.context * self.shared_fraction))

    @property
    def parsed(self) -> tuple[Scheme, ...]:
        """The schemes parsed by `check_config`, one per `schemes` item; ServeError when not validated."""
        if self.parsed_schemes is None:
            raise ServeError(
                "this ServeConfig holds no parsed schemes: validate it first "
                "(config = kvquant.eval.serve.check_config(config); serve.run does)"
            )
        return self.parsed_schemes.schemes

    def scheme_of(self, label: str) -> Scheme:
        """The parsed scheme of a row's `scheme` label (an item of `schemes`)."""
        return dict(zip(self.schemes, self.parsed, strict=True))[label]


def check_config(config: ServeConfig) -> ServeConfig:
    """Refuse bad values before torch is imported (schemes, policies, sizes, the run directory); the copy of
    `config` holding its schemes parsed (`config.parsed`). A config validated before is checked again without
    parsing a string again."""
    schemes = _parse_schemes(config)
    for name, value, low in (
        ("requests", config.requests, 1),
        ("context", config.context, 2),
        ("reply", config.reply, 1),
        ("concurrency", config.concurrency, 1),
        ("fit-fp16-requests", config.fit_fp16_requests, 0),
        ("block-size", config.block_size, 1),
    ):
        if not isinstance(value, int) or value < low:
            raise ServeError(f"--{name} must be an integer >= {low}, got {value!r}")
    if not 0 <= config.shared_fraction < 1:
        raise ServeError(f"--shared-fraction must be in [0, 1), got {config.shared_fraction}")
    if not 0 <= config.budget_fraction < 1:
        raise ServeError(f"--budget-fraction must be in [0, 1), got {config.budget_fraction}")
    if config.index not in ("radix", "hash"):
        raise ServeError(f"unknown --index {config.index!r}; known: radix, hash")
    for p in config.policies:
        _check_policy(p, config.index)
    if config.wandb not in WANDB_MODES:
        raise ServeError(f"unknown --wandb mode {config.wandb!r}; known: {', '.join(WANDB_MODES)}")
    try:
        harness.check_wandb(config.wandb)  # a mode that cannot log is refused before any work
    except RunError as e:
        raise ServeError(str(e)) from None
    if config.dtype not in ("float32", "float64", "bfloat16", "float16"):
        raise ServeError(f"--dtype must be float32, float64, bfloat16 or float16, got {config.dtype!r}")
    if config.out:
        _check_run_dir(Path(config.out), config)
    return ParsedSchemes.attach(config, schemes)


def _parse_schemes(config: ServeConfig) -> list[Scheme]:
    """Each of config.schemes parsed (its parsed copy's, when validated before); SchemeError as ServeError."""
    from kvquant.scheme import SchemeError, parse_scheme

    if not config.schemes:
        raise ServeError("name at least one scheme")
    held = config.parsed_schemes
    try:
        return [parse_scheme(s) for s in (held.schemes if held is not None else config.schemes)]
    except SchemeError as e:
        raise ServeError(str(e)) from None


def _settings(config: ServeConfig) -> dict:
    """The config's fields as config.json holds them, without the parsed schemes (the labels say them)."""
    fields = asdict(replace(config, parsed_schemes=None))
    del fields["parsed_schemes"]
    return fields


def identity(config: ServeConfig) -> dict:
    """What decides a serve run's rows: two runs with equal identities share a directory (resume)."""
    ident = {k: v for k, v in _settings(config).items() if k not in ("out", "force", "wandb", "extra")}
    return json.loads(json.dumps(ident, default=str))  # tuples as lists, as config.json holds them


def _check_run_dir(run_dir: Path, config: ServeConfig) -> None:
    """Read-only: refuse a --out that is a file, a folder that is not a serve run, one of another
    configuration (unless --force), or --force over a folder holding files kvquant did not write."""
    from . import results as res

    if run_dir.exists() and not run_dir.is_dir():
        raise ServeError(f"--out {run_dir} is a file; name a folder for the run directory")
    foreign = res.foreign_files(run_dir)
    cfg = run_dir / "config.json"
    if foreign and not cfg.is_file():
        raise ServeError(
            f"{run_dir} exists and is not a kvquant run directory (it holds {res._listing(foreign)}); "
            "choose another --out (--force removes only files kvquant wrote, so it leaves such a folder "
            "alone)"
        )
    if config.force:
        if foreign:
            raise ServeError(
                f"--force: {run_dir} holds {len(foreign)} file(s) kvquant did not write "
                f"({res._listing(foreign)}); nothing was deleted. --force removes only kvquant's own files: "
                "move those elsewhere, or choose another --out"
            )
        return
    if not cfg.is_file():
        return
    try:
        held = json.loads(cfg.read_text(encoding="utf-8"))
        held_identity = held["identity"] if held.get("kind") == "serve" else None
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, KeyError, TypeError):
        held_identity = None
    if held_identity is None:
        raise ServeError(
            f"{run_dir} holds another kind of run, or a serve run from before resumable rows; pass --force "
            "to replace it, or --out to write elsewhere"
        )
    want = identity(config)
    if held_identity != want:
        raise ServeError(
            f"{run_dir} holds a serve run with a different configuration "
            f"({harness.diff(held_identity, want)}); pass --force to replace it, or --out to write elsewhere"
        )


def _check_policy(name: str, index: str) -> None:
    """Checked before torch is imported (the CLI fails fast), so by name here; kvquant.paging.evict's
    registry makes the policy itself once the run starts."""
    import re

    text = name.strip().lower()
    if text in ("none", "lru") or re.fullmatch(r"sliding:[1-9]\d*", text):
        return
    if text == "radix-lru":
        if index != "radix":
            raise ServeError("the radix-lru policy needs --index radix")
        return
    raise ServeError(
        f"unknown eviction policy {name!r}; known: none, lru, radix-lru, sliding:W "
        "(W tokens, e.g. sliding:128)"
    )


# ------------------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Request:
    name: str
    prompt: list[int]  # system prompt + message
    shared: int  # tokens of the system prompt


def build_workload(tokenizer, n: int, context: int, shared: int, seed: int = 0) -> list[Request]:
    """n requests of `context` tokens: the first `shared` from one Wikipedia article, the rest from others."""
    import random

    from kvquant.eval.data import load_corpus

    docs = load_corpus("wikipedia")
    rng = random.Random(seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    system = tokenizer(docs[order[0]].text, add_special_tokens=False)["input_ids"][:shared]
    own = context - shared
    pool: list[list[int]] = []
    for i in order[1:]:
        ids = tokenizer(docs[i].text, add_special_tokens=False)["input_ids"]
        pool += [ids[j : j + own] for j in range(0, len(ids) - own + 1, max(own, 1) * 4)][:4]
        if len(pool) >= n:
            break
    if len(system) < shared or len(pool) < n:
        raise ServeError(f"the corpus is too short for {n} requests of {context} tokens")
    return [Request(f"request {k + 1}", system + pool[k], shared) for k in range(n)]


# ------------------------------------------------------------------------------------------ measuring


@dataclass
class RowResult:
    scheme: str
    prefix_cache: str
    policy: str
    budget_bytes: int | None
    requests: list[dict] = field(default_factory=list)
    timeline: list[dict] = field(default_factory=list)
    peak_bytes: int = 0
    running_peak_bytes: int = 0  # the most bytes the running requests' pages took (shared ones once)
    evicted_pages: int = 0
    hit_rate: float = 0.0
    wall_s: float = 0.0


def reference_replies(model, workload: list[Request], reply: int) -> list[list[int]]:
    """Greedy replies of the FP16 model with transformers' DynamicCache (no kvquant storage at all)."""
    import torch
    from transformers import DynamicCache

    out = []
    with torch.no_grad():
        for r in workload:
            cache = DynamicCache(config=model.config)
            logits = model(torch.tensor([r.prompt]), cache=cache, logits_to_keep=1).logits[0, -1]
            toks = [int(logits.argmax())]
            while len(toks) < reply:
                logits = model(torch.tensor([[toks[-1]]]), cache=cache).logits[0, -1]
                toks.append(int(logits.argmax()))
            out.append(toks)
    return out


def simulate(
    engine, workload: list[Request], refs: list[list[int]], concurrency: int, label: dict
) -> RowResult:
    """Run the requests `concurrency` at a time (admit one per tick, then one decoding step for each running
    request), teacher-forced on the reference replies."""
    from kvquant.paging import BudgetError

    row = RowResult(label["scheme"], label["prefix_cache"], label["policy"], engine.store.budget_bytes)
    pending, running = deque(range(len(workload))), []
    t0, tick = time.perf_counter(), 0
    store = engine.store
    while pending or running:
        if pending and len(running) < concurrency:
            k = pending.popleft()
            req, cache = workload[k], engine.open(workload[k].name)
            try:
                # the system prompt's end is a registration point when prefixes are cached (windowed schemes
                # resume only where their FP window was cached); without a prefix cache one forward
                bounds = [req.shared] if engine.index is not None else []
                pre = engine.prefill(cache, req.prompt, boundaries=bounds)
            except BudgetError as e:
                engine.close(cache)
                row.requests.append(dict(request=k, status="failed", error=str(e)))
                logger.warning("%s failed: %s", req.name, e)
            else:
                st = dict(k=k, cache=cache, ids=list(req.prompt), logits=pre.logits, pos=0, agree=0)
                st["stats"] = dict(
                    request=k,
                    status="ok",
                    ttft_s=pre.seconds,
                    reused=pre.hit.reused,
                    computed=pre.computed,
                    matched_units=pre.hit.matched_units,
                )
                running.append(st)
        for st in list(running):
            ref = refs[st["k"]]
            st["agree"] += int(st["logits"].argmax()) == ref[st["pos"]]
            st["pos"] += 1
            if st["pos"] == len(ref):
                engine.close(st["cache"], st["ids"])
                row.requests.append(st["stats"] | {"agreement": st["agree"] / len(ref)})
                running.remove(st)
                continue
            st["ids"].append(ref[st["pos"] - 1])
            try:
                st["logits"] = engine.step(st["cache"], ref[st["pos"] - 1])
            except BudgetError as e:
                engine.close(st["cache"])
                row.requests.append(st["stats"] | {"status": "failed", "error": str(e)})
                logger.warning("%s failed while decoding: %s", workload[st["k"]].name, e)
                running.remove(st)
        tick += 1
        index_bytes = engine.index.held_bytes() if engine.index is not None else 0
        running_bytes = store.caches_bytes([st["cache"] for st in running]) if running else 0
        row.running_peak_bytes = max(row.running_peak_bytes, running_bytes)
        row.timeline.append(
            dict(
                tick=tick,
                held_bytes=store.held_bytes(),
                pages=store.pages_in_use(),
                index_bytes=index_bytes,
                running_bytes=running_bytes,
                running=len(running),
            )
        )
    row.wall_s = time.perf_counter() - t0
    row.peak_bytes = store.peak_bytes
    row.evicted_pages = store.evicted_pages
    row.hit_rate = engine.index.hit_rate if engine.index is not None else 0.0
    row.requests.sort(key=lambda r: r["request"])
    return row


def fit_requests(
    model,
    scheme: Scheme,
    workload: list[Request],
    budget: int,
    prefix_cache: str | None,
    block_size: int,
    limit: int,
) -> int:
    """Requests admitted (prefilled and held) one after another until the budget refuses the next."""
    from kvquant.paging import BudgetError
    from kvquant.serving import Engine

    engine = Engine(
        model,
        scheme,
        prefix_cache=prefix_cache,
        policy="lru" if prefix_cache else "none",
        budget_bytes=budget,
        block_size=block_size,
    )
    held, n = [], 0
    try:
        for k in range(limit):
            req = workload[k % len(workload)]
            cache = engine.open(f"fit {k}")
            try:
                engine.prefill(cache, req.prompt, boundaries=[req.shared])
            except BudgetError:
                engine.close(cache)
                break
            held.append(cache)
            n += 1
    finally:
        for cache in held:
            engine.close(cache)
        if engine.index is not None:
            engine.index.clear()
        engine.store.check()
    return n


def _forcing_budget(row: RowResult, fraction: float, model, block_size: int) -> int:
    """R + fraction * (P - R) (see ServeConfig.budget_fraction), R with a margin of two FP16 pages per layer
    and sequence: the running requests were sampled once per tick, a forward may take a little more."""
    from kvquant import memory
    from kvquant.scheme import FP16, Scheme

    # two FP pages per layer, as each layer's plan sizes them at FP16 (the store's accounting dtype)
    fp16 = Scheme(FP16, FP16)
    margin = 2 * sum(p.page_bytes()[0] for p in memory.layer_plans(model.config, fp16, 2, block_size))
    running = row.running_peak_bytes + margin
    return int(running + fraction * max(row.peak_bytes - running, 0))


def paired_ttft(
    model, scheme: Scheme, workload: list[Request], index: str, block_size: int
) -> tuple[float, float]:
    """Median time to first token of requests 2..N as a prefix hit and as a miss, measured back to back
    (alternating which goes first), so that the ratio is not the load of a shared machine drifting between
    rows. Request 1 computes and caches the system prompt; hits reuse only that (misses are not
    registered)."""
    import statistics

    from kvquant.serving import Engine

    on = Engine(model, scheme, prefix_cache=index, block_size=block_size)
    off = Engine(model, scheme, prefix_cache=None, block_size=block_size)
    first = workload[0]
    cache = on.open()
    on.prefill(cache, first.prompt, boundaries=[first.shared])
    on.close(cache, first.prompt)
    hits, misses = [], []
    for k, req in enumerate(workload[1:]):
        for engine in (on, off) if k % 2 else (off, on):
            cache = engine.open()
            pre = engine.prefill(cache, req.prompt)
            engine.close(cache)
            (hits if engine is on else misses).append(pre.seconds)
    on.index.clear()
    for engine in (on, off):
        engine.store.check()
        assert engine.store.pages_in_use() == 0
    return statistics.median(hits), statistics.median(misses)


def _summary_row(
    row: RowResult, fit: tuple[int, int, int] | None, paired: tuple[float, float] | None = None
) -> dict:
    ok = [r for r in row.requests if r["status"] == "ok"]
    ttft = [r["ttft_s"] for r in ok]
    later = [r["ttft_s"] for r in ok if r["request"] > 0]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {
        "scheme": row.scheme,
        "prefix_cache": row.prefix_cache,
        "policy": row.policy,
        "requests": len(row.requests),
        "ttft_mean_s": mean(ttft),
        "ttft_after_first_s": mean(later),
        "computed_tokens": sum(r["computed"] for r in ok),
        "reused_tokens": sum(r["reused"] for r in ok),
        "hit_rate": row.hit_rate,
        "ttft_hit_s": paired[0] if paired else "",
        "ttft_miss_s": paired[1] if paired else "",
        "peak_bytes": row.peak_bytes,
        "budget_bytes": row.budget_bytes if row.budget_bytes is not None else "",
        "evicted_pages": row.evicted_pages,
        "failed_requests": len(row.requests) - len(ok),
        "agreement": mean([r["agreement"] for r in ok]),
        "fit_requests": fit[0] if fit else "",
        "fit_formula": fit[1] if fit else "",
        "fit_budget_bytes": fit[2] if fit else "",
        "wall_s": row.wall_s,
    }


# ----------------------------------------------------------------------------------------- the run


def _load(config: ServeConfig, model=None, tokenizer=None):
    import torch

    import kvquant

    if model is not None:
        return model, tokenizer
    return kvquant.load_model(config.model, dtype=getattr(torch, config.dtype), device=config.device)


def run_dir_for(config: ServeConfig) -> Path:
    if config.out:
        return Path(config.out)
    return harness.default_run_dir(
        f"serve-N{config.requests}-C{config.context}-P{config.shared_tokens}", identity(config)
    )


Point = tuple[str, str, str]  # (scheme, prefix cache, policy): one summary row


def plan(config: ServeConfig) -> list[Point]:
    """Every summary row a complete run measures, in order (a scheme's eviction rows after its prefix-cache
    row without a budget, whose peak sets their budget)."""
    rows = [("off", "none"), (config.index, "none")] + [(config.index, p) for p in config.policies]
    return [(scheme, prefix, policy) for scheme in config.schemes for prefix, policy in rows]


def completed(run_dir: Path) -> dict[Point, dict]:
    """The rows of points already measured in run_dir: each point's `row` line (the last of its lines, all
    written at once), the first if a point was written twice. Torn or foreign lines are skipped."""
    from . import results as res

    rows, _ = res.read_rows(run_dir / "results.jsonl", required={"kind": (str,)})
    done: dict[Point, dict] = {}
    for r in rows:
        if r["kind"] == "row" and isinstance(r.get("summary"), dict):
            done.setdefault((r.get("scheme"), r.get("prefix_cache"), r.get("policy")), r)
    return done


def _open_run_dir(run_dir: Path, config: ServeConfig):
    """Lock run_dir (refusing a second process), check it again under the lock, clear it on --force (only
    kvquant's files). Returns the held lock."""
    lock = harness.lock_dir(run_dir, error=ServeError)
    try:
        _check_run_dir(run_dir, config)
        if config.force:
            harness.clear_for_force(run_dir, error=ServeError)
    except BaseException:
        lock.release()
        raise
    return lock


def run(config: ServeConfig, *, model=None, tokenizer=None) -> tuple[Path, list[dict]]:
    """The whole simulation; returns (run directory, summary rows).

    Resumable as `experiments/run.py`: each summary row's lines (requests, timeline, fit probe, paired TTFT
    and the row itself) are appended at once, flushed and fsync'd; rerunning the same command (after Ctrl-C,
    SIGTERM or kill -9) measures only the rows missing. The directory is locked for the run's life."""
    config = check_config(config)  # the schemes parsed here, once
    import torch

    if config.threads:
        torch.set_num_threads(config.threads)
    run_dir = run_dir_for(config)
    lock = _open_run_dir(run_dir, config)
    try:
        return _run_locked(config, run_dir, model, tokenizer)
    finally:
        lock.release()


def _run_locked(config: ServeConfig, run_dir: Path, model, tokenizer) -> tuple[Path, list[dict]]:
    from . import results as res

    points = plan(config)
    done = completed(run_dir)
    todo = [p for p in points if p not in done]
    cfg_path = run_dir / "config.json"
    if done or cfg_path.is_file():
        logger.info(
            "resuming: %d of %d rows already measured in %s; %d to measure", len(points) - len(todo),
            len(points), run_dir, len(todo),
        )
    t_start = time.perf_counter()
    inputs = _Inputs.load(config, model, tokenizer) if todo else None
    harness.write_json(cfg_path, _config_record(config, cfg_path, len(todo)))
    results = run_dir / "results.jsonl"
    _, torn = res.read_rows(results, required={"kind": (str,)}) if results.is_file() else ([], False)
    summary: list[dict] = []
    unbudgeted: dict[str, RowResult] = {}  # per scheme: its prefix-cache row without a budget
    finished = False
    with res.interrupt_on_sigterm():  # SIGTERM ends the run as Ctrl-C does: what was measured is written
        try:
            for scheme, prefix, policy in points:
                held = done.get((scheme, prefix, policy))
                if held is not None:
                    summary.append(held["summary"])
                    if prefix != "off" and policy == "none":
                        unbudgeted[scheme] = RowResult(
                            scheme, prefix, policy, None, peak_bytes=int(held["peak_bytes"]),
                            running_peak_bytes=int(held["running_peak_bytes"]),
                        )
                    continue
                row, lines = _measure_point(config, inputs, (scheme, prefix, policy), unbudgeted)
                _append_lines(results, lines, torn)
                torn = False
                summary.append(lines[-1]["summary"])
            finished = True
        finally:
            if summary:
                write_outputs(run_dir, summary, config, None if finished else (len(summary), len(points)))
    logger.info("simulation took %.0f s", time.perf_counter() - t_start)
    return run_dir, summary


@dataclass
class _Inputs:
    """What every row of a serve run measures against: the model, the workload and its FP16 replies, the
    fit probe's requests and its byte budget (loaded only when a row is left to measure)."""

    model: object
    workload: list
    refs: list
    probe: list
    fit_budget: int

    @classmethod
    def load(cls, config: ServeConfig, model, tokenizer) -> _Inputs:
        from kvquant import memory

        model, tokenizer = _load(config, model, tokenizer)
        workload = build_workload(
            tokenizer, max(config.requests, 2), config.context, config.shared_tokens, config.seed
        )
        workload = workload[: config.requests]
        logger.info(
            "reference: FP16 greedy replies of %d requests (%d + %d tokens)",
            len(workload),
            config.context,
            config.reply,
        )
        refs = reference_replies(model, workload, config.reply)
        # the fit probe needs more distinct requests than the simulation
        probe = build_workload(
            tokenizer, config.fit_max, config.context, config.shared_tokens, config.seed + 1
        )
        from kvquant.scheme import FP16, Scheme

        fp16_request = memory.cache_bytes(
            model.config, Scheme(FP16, FP16), config.context, block_size=config.block_size
        )
        return cls(model, workload, refs, probe, config.fit_fp16_requests * fp16_request)


def _config_record(config: ServeConfig, cfg_path: Path, rows_left: int) -> dict:
    """config.json: the run's settings and provenance when new; a resumed run appends when and where."""
    import torch

    now = {
        "torch": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    if cfg_path.is_file():
        cfg_json = json.loads(cfg_path.read_text(encoding="utf-8"))
        cfg_json.setdefault("resumed", []).append(
            now | {"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows_left": rows_left,
                   "git_commit": harness.git_commit()}
        )
        return cfg_json
    return _settings(config) | {
        "kind": "serve",
        "identity": identity(config),
        "shared_tokens": config.shared_tokens,
        **now,
        **harness.provenance(),  # versions, git commit, created: as every run directory records them
        "bytes": "FP16 (deployment) bytes of pages held in the shared store",
    }


def _measure_point(
    config: ServeConfig, inputs: _Inputs, point: tuple[str, str, str], unbudgeted: dict[str, RowResult]
) -> tuple[RowResult, list[dict]]:
    """Simulate one (scheme, prefix cache, policy) row; its result lines, the `row` line last. A budgeted
    row's budget comes from its scheme's unbudgeted row (`unbudgeted`, which this fills in)."""
    from kvquant import memory
    from kvquant.serving import Engine

    name, prefix, policy = point  # name: the scheme as given, which labels its rows
    scheme = config.scheme_of(name)
    model, workload = inputs.model, inputs.workload
    label = dict(scheme=name, prefix_cache=prefix, policy=policy)
    budget = (
        None
        if policy == "none"
        else _forcing_budget(unbudgeted[name], config.budget_fraction, model, config.block_size)
    )
    logger.info("%s", label | {"budget_bytes": budget})
    engine = Engine(
        model,
        scheme,
        prefix_cache=None if prefix == "off" else prefix,
        policy=policy,
        budget_bytes=budget,
        block_size=config.block_size,
    )
    row = simulate(engine, workload, inputs.refs, config.concurrency, label)
    if prefix != "off" and policy == "none":
        unbudgeted[name] = row
    if engine.index is not None:
        engine.index.clear()
    engine.store.check()
    if engine.store.pages_in_use():
        raise RuntimeError(f"{engine.store.pages_in_use()} pages still in use after {label}")
    attempt = f"{os.getpid()}-{time.time_ns()}"  # the lines of this measurement of the point
    tag = label | {"attempt": attempt}
    lines: list[dict] = []
    fit = None
    if policy == "none" and config.fit_fp16_requests:
        share = 0 if prefix == "off" else config.shared_tokens
        measured = fit_requests(
            model,
            scheme,
            inputs.probe,
            inputs.fit_budget,
            None if prefix == "off" else prefix,
            config.block_size,
            config.fit_max,
        )
        formula = memory.capacity(
            model.config, scheme, inputs.fit_budget, config.context, share, block_size=config.block_size
        ).requests
        fit = (measured, formula, inputs.fit_budget)
        lines.append(
            tag | dict(kind="fit", measured=measured, formula=formula, budget_bytes=inputs.fit_budget)
        )
    paired = None
    if policy == "none" and prefix != "off" and len(workload) > 1:
        paired = paired_ttft(model, scheme, workload, prefix, config.block_size)
        lines.append(tag | {"kind": "ttft_pair", "hit_s": paired[0], "miss_s": paired[1]})
    lines += [tag | {"kind": "request"} | r for r in row.requests]
    lines += [tag | {"kind": "timeline"} | t for t in row.timeline]
    lines.append(
        tag
        | {
            "kind": "row",
            "summary": _summary_row(row, fit, paired),
            "peak_bytes": row.peak_bytes,
            "running_peak_bytes": row.running_peak_bytes,
        }
    )
    return row, lines


def _append_lines(path: Path, rows: list[dict], torn: bool) -> None:
    """One point's lines in one write, flushed and fsync'd (a kill leaves them whole or without their
    `row` line, and then the point is measured again); a newline first after a torn last line."""
    from . import results as res

    text = ("\n" if torn else "") + "".join(res.encode_row(r) + "\n" for r in rows)
    with path.open("a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


# ----------------------------------------------------------------------------------------- outputs


def write_outputs(
    run_dir: Path, summary: list[dict], config: ServeConfig, partial: tuple[int, int] | None = None
) -> None:
    """summary.csv, report.md and serve.png; partial = (rows measured, rows in all) when the run stopped
    early (the report says so and how to resume)."""
    with (run_dir / "summary.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in summary:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    head = (
        f"**partial: {partial[0]} of {partial[1]} rows measured** (interrupted; rerun the same command to "
        "resume)\n\n"
        if partial
        else ""
    )
    (run_dir / "report.md").write_text(head + markdown_table(summary, config) + "\n", encoding="utf-8")
    try:
        plot(run_dir, summary)
    except Exception as e:  # noqa: BLE001 - a plot never costs the results
        logger.warning("plot failed: %s", e)


def _fmt(x, spec: str) -> str:
    if x == "" or x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return format(x, spec)


def markdown_table(summary: list[dict], config: ServeConfig | None = None) -> str:
    """One line per row, then TTFT and capacity ratios within the run."""
    head = (
        "| scheme | prefix | policy | TTFT mean s | TTFT after 1st s | computed | reused | hit rate | "
        "peak MB | budget MB | evicted pages | failed | agreement | fit (measured / formula) |"
    )
    lines = [head, "|" + "---|" * 14]
    for r in summary:
        mb = lambda b: _fmt(b / 1e6 if b != "" else "", ".2f")  # noqa: E731
        fit = f"{r['fit_requests']} / {r['fit_formula']}" if r["fit_requests"] != "" else "–"
        if config is not None and r["fit_requests"] == config.fit_max:
            fit += " (probe cap)"
        lines.append(
            f"| {r['scheme']} | {r['prefix_cache']} | {r['policy']} | {_fmt(r['ttft_mean_s'], '.3f')} | "
            f"{_fmt(r['ttft_after_first_s'], '.3f')} | {r['computed_tokens']} | {r['reused_tokens']} | "
            f"{_fmt(r['hit_rate'], '.2f')} | {mb(r['peak_bytes'])} | {mb(r['budget_bytes'])} | "
            f"{r['evicted_pages']} | {r['failed_requests']} | {_fmt(r['agreement'], '.3f')} | {fit} |"
        )
    notes = []
    by = {(r["scheme"], r["prefix_cache"], r["policy"]): r for r in summary}
    schemes = list(dict.fromkeys(r["scheme"] for r in summary))
    for s in schemes:
        on = next((r for k, r in by.items() if k[0] == s and k[1] != "off" and k[2] == "none"), None)
        if on and on["ttft_hit_s"] != "":
            ratio = on["ttft_hit_s"] / on["ttft_miss_s"]
            notes.append(
                f"- {s}: TTFT of a prefix hit / a miss = {on['ttft_hit_s']:.3f} s / "
                f"{on['ttft_miss_s']:.3f} s = {ratio:.2f} (medians over requests 2..N, measured back to "
                f"back; in the rows {on['reused_tokens']} of {on['reused_tokens'] + on['computed_tokens']} "
                "prompt tokens were reused)"
            )
    fp = by.get(("fp16", "off", "none"))
    if fp and fp["fit_requests"]:
        for s in schemes:
            for k, r in by.items():
                if k[0] == s and k[2] == "none" and r["fit_requests"] != "":
                    notes.append(
                        f"- requests held in {r['fit_budget_bytes'] / 1e6:.1f} MB: {s} prefix {k[1]}: "
                        f"{r['fit_requests']} (formula {r['fit_formula']}), "
                        f"{r['fit_requests'] / fp['fit_requests']:.2f}x FP16 without sharing"
                    )
    return "\n".join(lines + [""] + notes)


def plot(run_dir: Path, summary: list[dict]) -> Path:
    """serve.png: bytes held over time, one panel per scheme (a line per prefix cache / policy, the budget
    dotted); and the paired time to first token of a prefix hit vs a miss per scheme."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from . import results as res

    lines, _ = res.read_rows(run_dir / "results.jsonl", required={"kind": (str,)})
    def measurement(r: dict) -> tuple:
        return r.get("scheme"), r.get("prefix_cache"), r.get("policy"), r.get("attempt")

    finished = {measurement(r) for r in completed(run_dir).values()}
    rows = [r for r in lines if measurement(r) in finished]  # a point's lines of its kept measurement
    schemes = list(dict.fromkeys(r["scheme"] for r in summary))
    fig, axes = plt.subplots(1, len(schemes) + 1, figsize=(5 * (len(schemes) + 1), 4.2), squeeze=False)
    for ax, scheme in zip(axes[0], schemes, strict=False):
        series: dict[str, list[tuple[int, int]]] = {}
        for r in rows:
            if r["kind"] == "timeline" and r["scheme"] == scheme:
                series.setdefault(f"{r['prefix_cache']} / {r['policy']}", []).append(
                    (r["tick"], r["held_bytes"])
                )
        for name, pts in series.items():
            ax.plot([t for t, _ in pts], [b / 1e6 for _, b in pts], label=name, lw=1.2)
        for r in summary:
            if r["scheme"] == scheme and r["budget_bytes"] != "":
                ax.axhline(
                    r["budget_bytes"] / 1e6, color="grey", ls=":", lw=0.8, label="budget (eviction rows)"
                )
                break
        ax.set_title(f"{scheme}: MB held (FP16 pages)")
        ax.set_ylabel("MB held")
        ax.set_xlabel("tick (an admission + a decoding step per running request)")
        ax.legend(fontsize=7)
    ax = axes[0][-1]
    paired = [r for r in summary if r["ttft_hit_s"] != ""]
    x = range(len(paired))
    ax.bar([i - 0.2 for i in x], [r["ttft_miss_s"] for r in paired], 0.4, label="miss")
    ax.bar([i + 0.2 for i in x], [r["ttft_hit_s"] for r in paired], 0.4, label="prefix hit")
    ax.set_xticks(list(x), [r["scheme"] for r in paired])
    ax.set_ylabel("median time to first token (s)")
    ax.set_title("TTFT, hit vs miss (back to back)")
    ax.legend()
    config = json.loads((run_dir / "config.json").read_text())
    fig.suptitle(
        f"serving simulation · {config.get('model') or 'SmolLM2-135M (default)'} · {config.get('requests')} "
        f"requests x {config.get('context')} tokens, {float(config.get('shared_fraction', 0)):.0%} "
        f"shared prefix · {config.get('dtype')} compute · lines: prefix cache / eviction policy",
        fontsize=10,
    )
    fig.tight_layout()
    path = run_dir / "serve.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def log_to_wandb(run_dir: Path, mode: str, project: str | None = None, group: str | None = None) -> None:
    """Log the run to W&B as every task's run directory is logged (`harness.log_wandb`): one run per scheme
    (named as given) and a `compare` run, in the run directory's group. "disabled" imports nothing; a W&B
    failure is a warning, never an error."""
    harness.log_wandb(run_dir, mode, project, group)


def capacity_table(
    model: str,
    gpu_gb: float,
    schemes: Sequence[str],
    context: int,
    shared_prefix: int,
    weight_bits: int = 16,
    weights_gb: float | None = None,
    block_size: int = 16,
) -> str:
    """The capacity calculator's table (for `experiments/serve.py capacity`)."""
    from kvquant import memory

    if model not in memory.KNOWN_SHAPES:
        raise ServeError(f"unknown model {model!r} for --capacity; known: {', '.join(memory.KNOWN_SHAPES)}")
    shape = memory.KNOWN_SHAPES[model]
    weights = (
        int(weights_gb * 1e9)
        if weights_gb is not None
        else memory.weights_bytes(memory.KNOWN_PARAMS[model], weight_bits)
    )
    kv = int(gpu_gb * 1e9) - weights
    if kv <= 0:
        raise ServeError(
            f"{model}'s weights take {weights / 1e9:.1f} GB at {weight_bits} bits, more than the "
            f"{gpu_gb:g} GB given: raise --gpu-gb (several GPUs), lower --weight-bits, or pass --weights-gb"
        )
    lines = [
        f"{model}: {gpu_gb:g} GB - weights {weights / 1e9:.1f} GB = {kv / 1e9:.1f} GB for the KV cache; "
        f"context {context} tokens, shared prefix {shared_prefix} tokens, pages of {block_size} tokens",
        "",
        "| scheme | bytes/request | shared bytes | requests (no sharing) | requests (prefix shared) |",
        "|---|---|---|---|---|",
    ]
    for s in schemes:
        c = memory.capacity(shape, s, kv, context, shared_prefix, block_size=block_size)
        lines.append(
            f"| {s} | {c.request_bytes / 1e6:,.1f} MB | {c.shared_bytes / 1e6:,.1f} MB | "
            f"{c.requests_unshared} | {c.requests} |"
        )
    return "\n".join(lines)
