"""Generation as a user runs it: prefill a Wikipedia prompt, then greedy decoding through each cache.

    python benchmarks/bench_generate.py                               # 1k / 4k / 8k, 64 steps, 1 thread
    python benchmarks/bench_generate.py --lengths 1024,4096 --steps 16
    python benchmarks/bench_generate.py --quick                       # 1k only, 8 steps (smoke run)
    python benchmarks/bench_generate.py --schemes int4-g64 --peers hf-quanto-int4 --memory subprocess

Caches: transformers' `DynamicCache` (the baseline every ratio is taken against), transformers' own
`QuantizedCache` with the quanto and HQQ backends (the peers of `kvquant.eval.schemes`, built by their
`make_cache`), and kvquant's `QuantizedCache` for each scheme. A peer that cannot run is a row saying why.

Per prompt length and cache (default model in float32, `torch.set_num_threads(--threads)`):
  prefill tok/s    one forward over the prompt (`logits_to_keep=1`), after a short warm-up (160 tokens,
                   2 steps) through a fresh cache of the same kind
  decode ms/step   median of --steps greedy steps, with the 10th-90th percentiles; wall time, and the
                   process CPU time (less inflated when other processes share the cores)
  ratios           prefill: tok/s over DynamicCache's; decode: DynamicCache's ms over this cache's
                   (< 1 = slower); measured in one process, lengths in turn, caches in the order given
  nbytes           kvquant's `cache.nbytes()` (pages held); for transformers' caches, bytes of the tensors
                   their layers reference (`kvquant.eval.measure.cache_nbytes`, plus the tensors inside
                   HQQ's (codes, meta) tuples, which that walk does not enter)
  reserved         kvquant's `cache.reserved_bytes()` (its page pools); – for the others
  held             resident memory the cache holds (kvquant.memprobe): RSS after prefill + decode with the
                   cache alive (outputs dropped, gc + malloc_trim), minus RSS after deleting the cache (gc +
                   trim). The difference is the cache alone: activations are freed before both readings,
                   and what stays after the first use of a code path (thread pools, oneDNN, quanto's
                   extension) is in both, after the warm-up.
  peak             highest RSS during the prefill (VmHWM, reset at its start) minus RSS just before the
                   cache was made: the cache plus the forward's activations
  saving, real     DynamicCache's held / this cache's held (nbytes' ratio in parentheses)

Memory readings: `--memory subprocess` (default) runs each cache's memory measurement in a fresh Python
process (same prompt, steps and warm-up), so no earlier cache leaves arenas or malloc thresholds behind;
`--memory inprocess` takes them in the timing process (each cache measured while no other is alive), which
is faster and gives the same held bytes (within 0.3 MiB, measured). Peaks are noisy in both modes: the same
DynamicCache prefill of 1k tokens peaks 122, then 86, then 85 MiB in one process, a cache run after quanto's
up to ~100 MiB higher than alone, and two fresh processes gave HQQ 201 and 55 MiB at 1k; read them as
+-100 MiB at 1k (benchmarks/results/bench_generate_before.md). The output names the mode. Timing is always
in one process.

Rows are appended to benchmarks/results/bench_generate.csv tagged with host, threads, torch version, git
commit and load average; progress goes to stderr, the markdown table to stdout (and to --md if given).
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BASELINE = "DynamicCache"
DEFAULT_LENGTHS = (1024, 4096, 8192)
DEFAULT_PEERS = ("hf-quanto-int4", "hf-hqq-int4")
DEFAULT_SCHEMES = ("int8", "int4-g64", "kivi-2", "k=int4-channel-g64-rot,v=int4-g64-rot,sink=4,window=128")
WARMUP_TOKENS = 160  # > the peers' residual length (128), so the warm-up runs their requantization path too
MiB = 1 << 20

logger = logging.getLogger("bench_generate")


# ------------------------------------------------------------------------------------------------- caches
@dataclass(frozen=True)
class CacheSpec:
    """One cache to benchmark: `name` as the table shows it, `kind` (baseline | peer | kvquant), and
    `make(config)` returning a fresh transformers Cache. `unavailable` (a reason) makes its row say so
    instead of running."""

    name: str
    kind: str
    make: Callable = field(compare=False, repr=False)
    unavailable: str | None = None


def baseline_spec() -> CacheSpec:
    def make(config):
        from transformers.cache_utils import DynamicCache

        return DynamicCache(config=config)

    return CacheSpec(BASELINE, "baseline", make)


def peer_spec(name: str) -> CacheSpec:
    """transformers' QuantizedCache through kvquant.eval's peer (`hf-quanto-int4`, `hf-hqq-int4`, ...)."""
    from kvquant.eval.schemes import PeerScheme, parse_eval_scheme

    from kvquant.scheme import SchemeError

    label = f"transformers QuantizedCache ({name})"
    try:
        peer = parse_eval_scheme(name)
        if not isinstance(peer, PeerScheme):
            raise SchemeError(f"{name!r} is not a peer (peers are named hf-<backend>-int<bits>[-gN])")
        label = f"transformers QuantizedCache, {peer.backend} int{peer.bits}"
        peer.check_available()
    except SchemeError as e:
        return CacheSpec(label, "peer", lambda config: None, unavailable=str(e))
    return CacheSpec(label, "peer", lambda config: peer.make_cache(config, "cache"))


def kvquant_spec(scheme: str, capacity: int | None = None) -> CacheSpec:
    import kvquant

    parsed = kvquant.parse_scheme(scheme)  # fails early, naming the known schemes
    kw = {} if capacity is None else {"capacity": capacity}
    label = f"kvquant {parsed.name or str(parsed)}" + ("" if capacity is None else f" (capacity={capacity})")
    return CacheSpec(label, "kvquant", lambda config: kvquant.QuantizedCache(parsed, config, **kw))


def cache_specs(schemes: Sequence[str], peers: Sequence[str], capacity: int | None = None) -> list[CacheSpec]:
    return [baseline_spec(), *(peer_spec(p) for p in peers), *(kvquant_spec(s, capacity) for s in schemes)]


def tensor_bytes(cache) -> int:
    """Bytes a cache holds: kvquant's `nbytes()`; else `kvquant.eval.measure.cache_nbytes` (the tensors its
    layers reference, quanto's packed tensors and HQQ's (codes, {scale, zero}) tuples included)."""
    from kvquant.eval.measure import cache_nbytes

    if hasattr(cache, "reserved_bytes"):
        return cache.nbytes()
    return cache_nbytes(cache)


# ------------------------------------------------------------------------------------------------- measuring
@dataclass
class Row:
    length: int
    cache: str
    kind: str
    status: str = "ok"  # ok | unavailable: ... | failed: ...
    prefill_s: float | None = None
    prefill_tok_s: float | None = None
    decode_ms_median: float | None = None
    decode_ms_p10: float | None = None
    decode_ms_p90: float | None = None
    prefill_cpu_s: float | None = None  # process CPU time of the prefill (less sensitive to other load)
    decode_cpu_ms_median: float | None = None
    nbytes: int | None = None
    reserved_bytes: int | None = None
    held_bytes: int | None = None  # RSS with the cache alive minus RSS after deleting it (trimmed)
    growth_bytes: int | None = None  # RSS with the cache alive minus RSS before it was made
    peak_prefill_bytes: int | None = None
    peak_method: str | None = None
    prefill_ratio: float | None = None
    decode_ratio: float | None = None
    decode_cpu_ratio: float | None = None
    saving_real: float | None = None
    saving_nbytes: float | None = None


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True)
class _Timings:
    prefill: float  # wall seconds
    prefill_cpu: float  # process CPU seconds
    steps: list[float]  # wall seconds per decode step
    steps_cpu: list[float]


def _generate(model, ids, cache, steps: int, probe=None):
    """Prefill ids (1, T) then `steps` greedy steps; (_Timings, the prefill's MemoryProbe or None).
    probe: a MemoryProbe class to wrap the prefill in (its peak), or None (timing only)."""
    import contextlib

    import torch

    pre = probe("cpu") if probe is not None else contextlib.nullcontext()
    with torch.inference_mode():
        with pre:
            t0, c0 = time.perf_counter(), time.process_time()
            out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            prefill, prefill_cpu = time.perf_counter() - t0, time.process_time() - c0
            token = out.logits[:, -1:].argmax(-1)  # (1, 1)
            del out  # its logits and hidden states: not the cache's
        wall, cpu = [], []
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.process_time()
            out = model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1:].argmax(-1)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            del out
    return _Timings(prefill, prefill_cpu, wall, cpu), (pre if probe is not None else None)


def warm_up(model, ids, spec: CacheSpec) -> None:
    """A short prefill and two steps through a fresh cache of this kind: loads code, thread pools, JITs."""
    cache = spec.make(model.config)
    _generate(model, ids[:, :WARMUP_TOKENS], cache, 2)
    del cache
    gc.collect()


def measure(model, ids, spec: CacheSpec, steps: int, memory: bool = True) -> Row:
    """One cache at one length: timings, the cache's own counts and (memory=True) resident memory."""
    from kvquant import memprobe

    row = Row(length=ids.shape[1], cache=spec.name, kind=spec.kind)
    if spec.unavailable:
        row.status = f"unavailable: {spec.unavailable}"
        return row
    try:
        warm_up(model, ids, spec)
        base = 0
        if memory:
            memprobe.malloc_trim()
            base = memprobe.rss_bytes()
        cache = spec.make(model.config)
        timing, pre = _generate(model, ids, cache, steps, memprobe.MemoryProbe if memory else None)
        row.nbytes = tensor_bytes(cache)
        row.reserved_bytes = cache.reserved_bytes() if hasattr(cache, "reserved_bytes") else None
        if memory:
            memprobe.malloc_trim()
            alive = memprobe.rss_bytes()
            del cache
            memprobe.malloc_trim()
            row.held_bytes = alive - memprobe.rss_bytes()
            row.growth_bytes = alive - base
            row.peak_prefill_bytes = pre.reading.peak_abs - base
            row.peak_method = pre.reading.peak_method
        else:
            del cache
    except Exception as e:  # a cache that fails is a row saying so, not a crash of the whole table
        logger.exception("%s at %d tokens failed", spec.name, ids.shape[1])
        row.status = f"failed: {type(e).__name__}: {e}"
        return row
    row.prefill_s, row.prefill_cpu_s = timing.prefill, timing.prefill_cpu
    row.prefill_tok_s = ids.shape[1] / timing.prefill
    ms = [t * 1e3 for t in timing.steps]
    if ms:
        row.decode_ms_median = statistics.median(ms)
        row.decode_ms_p10, row.decode_ms_p90 = _quantile(ms, 0.1), _quantile(ms, 0.9)
        row.decode_cpu_ms_median = statistics.median(t * 1e3 for t in timing.steps_cpu)
    return row


def add_ratios(rows: list[Row]) -> None:
    """Ratios against the DynamicCache row of the same length (in place)."""
    base = {r.length: r for r in rows if r.kind == "baseline" and r.status == "ok"}
    for r in rows:
        b = base.get(r.length)
        if b is None or r.status != "ok":
            continue
        r.prefill_ratio = r.prefill_tok_s / b.prefill_tok_s if b.prefill_tok_s else None
        if r.decode_ms_median and b.decode_ms_median:
            r.decode_ratio = b.decode_ms_median / r.decode_ms_median
        if r.decode_cpu_ms_median and b.decode_cpu_ms_median:
            r.decode_cpu_ratio = b.decode_cpu_ms_median / r.decode_cpu_ms_median
        if r.held_bytes and b.held_bytes and r.held_bytes > 0:
            r.saving_real = b.held_bytes / r.held_bytes
        if r.nbytes and b.nbytes:
            r.saving_nbytes = b.nbytes / r.nbytes


def run_bench(
    model,
    ids,
    lengths: Sequence[int],
    steps: int,
    specs: Sequence[CacheSpec],
    memory: str = "inprocess",
    worker: Callable[[CacheSpec, int], dict] | None = None,
) -> list[Row]:
    """Every cache at every length; ids (1, >= max(lengths)) is the prompt, cut to each length.

    memory: "inprocess" (readings taken in this process), "subprocess" (`worker(spec, length)` returns the
    memory fields measured in a fresh process) or "none" (timings and counts only).
    """
    if memory not in ("inprocess", "subprocess", "none"):
        raise ValueError(f"memory must be inprocess, subprocess or none, not {memory!r}")
    if memory == "subprocess" and worker is None:
        raise ValueError("memory='subprocess' needs a worker that measures one cache in a fresh process")
    if ids.shape[1] < max(lengths):
        raise ValueError(f"the prompt has {ids.shape[1]} tokens, fewer than the longest, {max(lengths)}")
    rows: list[Row] = []
    for length in lengths:
        for spec in specs:
            logger.info("%-60s %6d tokens, %d steps ...", spec.name, length, steps)
            t0 = time.perf_counter()
            row = measure(model, ids[:, :length], spec, steps, memory=memory == "inprocess")
            if memory == "subprocess" and row.status == "ok":
                try:
                    for k, v in worker(spec, length).items():
                        setattr(row, k, v)
                except Exception as e:  # the timings stand; the memory columns say why they are empty
                    logger.error("  memory measurement failed: %s", e)
                    row.peak_method = f"memory worker failed: {type(e).__name__}: {str(e)[:200]}"
            logger.info("  %s in %.0f s: %s", row.status, time.perf_counter() - t0, _brief(row))
            rows.append(row)
    add_ratios(rows)
    return rows


def _brief(r: Row) -> str:
    if r.status != "ok":
        return ""
    held = "-" if r.held_bytes is None else f"{r.held_bytes / MiB:.1f}"
    return (f"prefill {r.prefill_tok_s:.0f} tok/s, decode {r.decode_ms_median or 0:.0f} ms/step, "
            f"nbytes {r.nbytes / MiB:.1f} MiB, held {held} MiB")


# ------------------------------------------------------------------------------------------------- output
def _mib(x) -> str:
    return "–" if x is None else f"{x / MiB:.1f}"


def _ratio(x, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def markdown(rows: Sequence[Row], memory: str) -> str:
    head = ("| tokens | cache | prefill tok/s (vs Dynamic) | decode ms/step median [p10–p90] "
            "(vs Dynamic) | "
            "decode CPU ms/step (vs Dynamic) | `nbytes()` MiB | `reserved_bytes()` MiB | RSS held MiB | "
            "prefill peak MiB | saving, real (nbytes) |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        if r.status != "ok":
            lines.append(f"| {r.length} | {r.cache} | {r.status} | | | | | | | |")
            continue
        dec = "–" if r.decode_ms_median is None else (
            f"{r.decode_ms_median:,.1f} [{r.decode_ms_p10:,.1f}–{r.decode_ms_p90:,.1f}] "
            f"({_ratio(r.decode_ratio)})")
        saving = f"{_ratio(r.saving_real, 1)}× ({_ratio(r.saving_nbytes, 1)}×)"
        cpu = "–" if r.decode_cpu_ms_median is None else (
            f"{r.decode_cpu_ms_median:,.1f} ({_ratio(r.decode_cpu_ratio)})")
        lines.append(
            f"| {r.length} | {r.cache} | {r.prefill_tok_s:,.0f} ({_ratio(r.prefill_ratio)}) | {dec} | "
            f"{cpu} | {_mib(r.nbytes)} | {_mib(r.reserved_bytes)} | {_mib(r.held_bytes)} | "
            f"{_mib(r.peak_prefill_bytes)} | {saving} |"
        )
    modes = {
        "inprocess": "memory read in the timing process (each cache alone, gc + malloc_trim before each "
                     "reading)",
        "subprocess": "memory read in a fresh process per cache and length (same prompt, steps and warm-up)",
        "none": "memory not measured",
    }
    lines.append("")
    lines.append("Wall times are what a user waits; CPU times (process CPU seconds) are less inflated by "
                 "other load on a shared machine.")
    lines.append(f"RSS held = resident with the cache alive minus after deleting it; peak = VmHWM during the "
                 f"prefill minus RSS before the cache was made; {modes[memory]}. MiB = 2^20 bytes.")
    return "\n".join(lines)


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "kvquant"],
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


TAGS = ("time_utc", "host", "cpu", "threads", "torch", "transformers", "commit", "model", "dtype", "steps",
        "memory_mode", "load_before", "load_after", "note")


def csv_columns() -> list[str]:
    return list(TAGS) + [f.name for f in fields(Row)]


def check_csv(path: Path) -> None:
    """Refuse (before a long run) a CSV whose header is not this script's columns."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open(newline="") as f:
        header = next(csv.reader(f), [])
    want = csv_columns()
    if header != want:
        missing, extra = sorted(set(want) - set(header)), sorted(set(header) - set(want))
        raise SystemExit(
            f"{path} has other columns than this version of bench_generate writes (missing {missing}, "
            f"extra {extra}, or another order); pass --csv with a new file name"
        )


def write_csv(path: Path, rows: Sequence[Row], tags: dict) -> None:
    names = csv_columns()
    if list(tags) != list(TAGS):
        raise ValueError(f"CSV tags {list(tags)} differ from TAGS {list(TAGS)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=names)
        if new:
            w.writeheader()
        for r in rows:
            w.writerow({**tags, **asdict(r)})


# ------------------------------------------------------------------------------------------------- prompt
def wikipedia_prompt(tokenizer, tokens: int):
    """(1, tokens) ids of the first default-corpus article that long, else of the articles joined in order."""
    import torch
    from kvquant.eval.data import load_corpus

    docs = load_corpus("wikipedia")
    joined: list[int] = []
    for d in docs:
        ids = tokenizer(d.text)["input_ids"]
        if len(ids) >= tokens:
            logger.info("prompt: %d tokens of the Wikipedia article %r", tokens, d.title)
            return torch.tensor([ids[:tokens]])
        joined += ids
        if len(joined) >= tokens:
            break
    if len(joined) < tokens:
        raise ValueError(f"the Wikipedia corpus holds {len(joined)} tokens, fewer than {tokens}")
    logger.info("prompt: %d tokens of Wikipedia articles joined in corpus order", tokens)
    return torch.tensor([joined[:tokens]])


# ------------------------------------------------------------------------------------------------- CLI
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default=None, help="prompt tokens, comma-separated (default 1024,4096,8192)")
    p.add_argument("--steps", type=int, default=None, help="greedy decode steps (default 64)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--schemes", default=None,
                   help="kvquant schemes, comma-separated (k=/v=/sink=/window= items stay with their "
                        "scheme); "
                        f"default {','.join(DEFAULT_SCHEMES)}; 'none' for no kvquant row")
    p.add_argument("--peers", default=None,
                   help=f"transformers QuantizedCache peers (default {','.join(DEFAULT_PEERS)}); "
                        "'none' for none")
    p.add_argument("--capacity", type=int, default=None,
                   help="kvquant QuantizedCache(capacity=...) (default: the cache's own default)")
    p.add_argument("--model", default=None,
                   help="local HF folder or .gguf (default: the embedded SmolLM2-135M)")
    p.add_argument("--memory", choices=("inprocess", "subprocess", "none"), default="subprocess",
                   help="where memory is read: a fresh process per cache and length (default), the timing "
                        "process (faster; peaks depend on what ran before), or not at all")
    p.add_argument("--quick", action="store_true", help="1k only, 8 steps")
    p.add_argument("--csv", type=Path, default=RESULTS / "bench_generate.csv", help="append rows here")
    p.add_argument("--md", type=Path, default=None, help="also write the markdown table here")
    p.add_argument("--note", default="", help="free text stored with every CSV row (e.g. 'before')")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one memory measurement
    a = p.parse_args(argv)
    a.lengths = [int(x) for x in (a.lengths or ("1024" if a.quick else ",".join(map(str, DEFAULT_LENGTHS))))
                 .split(",") if x.strip()]
    a.steps = a.steps if a.steps is not None else (8 if a.quick else 64)
    if not a.lengths or min(a.lengths) < 1 or a.steps < 0 or a.threads < 1:
        p.error("--lengths must be positive integers, --steps >= 0, --threads >= 1")
    sys.path.insert(0, str(ROOT / "experiments"))
    from run import split_schemes

    a.schemes = [] if a.schemes == "none" else split_schemes(a.schemes or ",".join(DEFAULT_SCHEMES))
    a.peers = [] if a.peers == "none" else [x.strip() for x in (a.peers or ",".join(DEFAULT_PEERS)).split(",")
                                            if x.strip()]
    return a


def _setup(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    for noisy in ("transformers", "optimum", "hqq", "torchao"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def _spec_by_name(args, name: str) -> CacheSpec:
    for spec in cache_specs(args.schemes, args.peers, args.capacity):
        if spec.name == name:
            return spec
    raise ValueError(f"no cache named {name!r} among the requested ones")


def _worker_main(args) -> None:
    """Internal: measure one cache's memory in this fresh process and print its fields as one JSON line."""
    import torch

    import kvquant

    job = json.loads(args.worker)
    _setup(args.threads)
    model, _ = kvquant.load_model(args.model)
    ids = torch.load(job["ids"])[:, : job["length"]]
    row = measure(model, ids, _spec_by_name(args, job["cache"]), args.steps, memory=True)
    if row.status != "ok":
        raise SystemExit(f"memory worker: {row.status}")
    keys = ("held_bytes", "growth_bytes", "peak_prefill_bytes", "peak_method")
    print("BENCH_GENERATE_MEMORY " + json.dumps({k: getattr(row, k) for k in keys}))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return _worker_main(args)
    check_csv(args.csv)
    _setup(args.threads)
    import torch
    import transformers

    import kvquant

    load_before = load_average()
    logger.info("load average %s; loading the model ...", load_before)
    model, tokenizer = kvquant.load_model(args.model)
    ids = wikipedia_prompt(tokenizer, max(args.lengths))
    specs = cache_specs(args.schemes, args.peers, args.capacity)
    tmp = tempfile.TemporaryDirectory(prefix="bench_generate_")
    ids_file = Path(tmp.name) / "ids.pt"
    torch.save(ids, ids_file)

    def worker(spec: CacheSpec, length: int) -> dict:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker",
               json.dumps({"ids": str(ids_file), "length": length, "cache": spec.name}),
               "--steps", str(args.steps), "--threads", str(args.threads),
               "--schemes", ",".join(args.schemes) or "none", "--peers", ",".join(args.peers) or "none"]
        cmd += [] if args.capacity is None else ["--capacity", str(args.capacity)]
        cmd += [] if args.model is None else ["--model", args.model]
        logger.info("  memory in a fresh process ...")
        out = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in out.stdout.splitlines() if x.startswith("BENCH_GENERATE_MEMORY ")), None)
        if out.returncode or line is None:
            raise RuntimeError(f"memory worker for {spec.name} failed:\n{out.stderr[-2000:]}")
        return json.loads(line.split(" ", 1)[1])

    rows = run_bench(model, ids, args.lengths, args.steps, specs, memory=args.memory, worker=worker)
    tmp.cleanup()
    load_after = load_average()
    tags = {
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": git_commit(),
        "model": args.model or "SmolLM2-135M (default)",
        "dtype": "float32",
        "steps": args.steps,
        "memory_mode": args.memory,
        "load_before": load_before,
        "load_after": load_after,
        "note": args.note,
    }
    table = markdown(rows, args.memory)
    header = (f"bench_generate: {tags['model']}, float32, {args.threads} thread(s), {args.steps} greedy "
              "steps, "
              f"torch {tags['torch']}, transformers {tags['transformers']}, kvquant {tags['commit']}, host "
              f"{tags['host']}; load average {load_before} before, {load_after} after (1/5/15 min; "
              f"{os.cpu_count()} CPUs)")
    print(header + "\n\n" + table)
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(header + "\n\n" + table + "\n")
    write_csv(args.csv, rows, tags)
    logger.info("appended %d rows to %s", len(rows), args.csv)


if __name__ == "__main__":
    main()
