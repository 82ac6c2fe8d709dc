"""A run directory: config.json, results.jsonl (append-only, one line per measured point), summary.csv,
report.md and plots. Summaries are recomputed from results.jsonl, so a resumed run reports everything.

What keeps a run directory sound (shared by `runner`, `retrieval` and `serve`):
- `RunLock`: an advisory lock (fcntl.flock) on `.kvquant.lock` in the directory, held for the run's life; a
  second process into the same directory is refused at once, naming the holder's pid. A killed holder's lock
  is released by the kernel, so a stale lock file never blocks. The writers of one sharded run (torchrun
  ranks, `--shard I/N` job-array tasks) hold it shared, each with an exclusive lock on its own
  `.kvquant.shard-I-of-N.lock`: they run side by side, the same shard twice is refused, and a one-process
  run (or `--merge`, `--force`) is refused while any shard writes, and holds everyone else off while it does.
- each writer appends to its own results file: `results.jsonl` (one process) or `results.shard-I-of-N.jsonl`
  (a shard); `RunResults` reads every results file of the directory as one (a point written in two files
  counts once), so a run resumed at another world size measures only what no file holds.
- every results.jsonl line carries `_sha`, a digest of the canonical JSON of the rest of its row: a line torn
  by a kill, a foreign line (`null`, `42`, `{}`) or an edited row is ignored on reading, with one warning,
  and its point is measured again; a line appended after a torn one starts on a line of its own. Rows
  written before the digest (no `_sha`) are still read. A point written twice counts once (the first; a
  conflicting duplicate is logged).
- `clear_run_dir` (--force) removes only what kvquant writes (`OWN_FILES`, `OWN_PATTERNS`, `OWN_DIRS`) and
  refuses a directory that holds anything else, naming it.
- `interrupt_on_sigterm`: SIGTERM (`timeout`, a scheduler) stops a run as Ctrl-C does, so the report and
  summary of the finished points are written.
"""

from __future__ import annotations

import contextlib
import csv
import fnmatch
import hashlib
import json
import logging
import math
import os
import socket
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from . import metrics

__all__ = [
    "LOCK_NAME",
    "OWN_FILES",
    "RunDirError",
    "RunLock",
    "RunResults",
    "results_files",
    "results_name",
    "shard_tag",
    "clear_run_dir",
    "foreign_files",
    "interrupt_on_sigterm",
    "read_rows",
    "encode_row",
    "Memory",
    "TokenStore",
    "distribution_table",
    "SUMMARY_COLUMNS",
    "ResultsFile",
    "summarize",
    "write_summary",
    "markdown_table",
    "known_shapes_table",
    "memory_table",
    "PlotInfo",
    "plot_bytes",
    "plot_drift",
    "position_label",
    "write_plots",
]

logger = logging.getLogger(__name__)

SUMMARY_COLUMNS = metrics.SUMMARY_COLUMNS  # declared once, in kvquant.eval.metrics


# ----------------------------------------------------------------------------------- the run directory

LOCK_NAME = ".kvquant.lock"
# what kvquant writes in a run directory: --force removes these and nothing else
OWN_FILES = frozenset(
    {
        "config.json",
        "results.jsonl",
        "summary.csv",
        "report.md",
        "drift_vs_length.png",
        "bytes_per_token.png",
        "serve.png",
        LOCK_NAME,
        "config.tmp",  # an atomic write cut short (config.json, summary.csv)
        "summary.tmp",
    }
)
# summary.csv of a serving run (kvquant.eval.serve), here so that the W&B logger reads it without serve
SERVE_SUMMARY_COLUMNS = (
    "scheme,prefix_cache,policy,requests,ttft_mean_s,ttft_after_first_s,computed_tokens,reused_tokens,"
    "hit_rate,ttft_hit_s,ttft_miss_s,peak_bytes,budget_bytes,evicted_pages,failed_requests,agreement,fit_requests,"
    "fit_formula,fit_budget_bytes,wall_s"
).split(",")
SHARD_RESULTS = "results.shard-*-of-*.jsonl"  # one results file per shard of a sharded run
SHARD_LOCKS = ".kvquant.shard-*-of-*.lock"  # each shard's own lock
# retrieval's heatmaps; the shards' results and locks; config.json written by a shard (per-pid temporary)
OWN_PATTERNS = ("heatmap-*.png", SHARD_RESULTS, SHARD_LOCKS, ".config.*.tmp")
# per-token values; W&B's files (it writes under dir=<run_dir>)
OWN_DIRS = MappingProxyType({"tokens": ("*.npz",), "wandb": ("*",)})
CHECK_FIELD = "_sha"  # each results.jsonl row's digest of the rest of it
_KEY_TYPES = MappingProxyType(
    {"scheme": (str,), "mode": (str,), "doc": (int,), "bucket": (str, type(None)), "status": (str,)}
)


class RunDirError(Exception):
    """A run directory that cannot be used as asked (in use by another process, or holding foreign files);
    callers re-raise it as their own input error (RunError, ServeError)."""


def _own(rel: Path) -> bool:
    parts = rel.parts
    if len(parts) == 1:
        return parts[0] in OWN_FILES or any(fnmatch.fnmatch(parts[0], p) for p in OWN_PATTERNS)
    patterns = OWN_DIRS.get(parts[0])
    return patterns is not None and any(fnmatch.fnmatch(parts[-1], p) for p in patterns)


def foreign_files(run_dir: Path) -> list[str]:
    """What `run_dir` holds that kvquant did not write, relative to it (a foreign folder once, as `name/`);
    empty for a missing directory. No torch: `config.check_out` may call it."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    out = []
    for entry in sorted(run_dir.iterdir()):
        rel = entry.relative_to(run_dir)
        if entry.is_dir() and not entry.is_symlink():
            if entry.name not in OWN_DIRS:
                out.append(f"{entry.name}/")
                continue
            out += [str(p.relative_to(run_dir)) for p in sorted(entry.rglob("*"))
                    if not p.is_dir() and not _own(p.relative_to(run_dir))]
        elif not _own(rel):
            out.append(entry.name)
    return out


def _listing(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def clear_run_dir(run_dir: Path) -> list[str]:
    """--force: remove what kvquant wrote in `run_dir` (its lock file aside, held by the caller) and return
    the names removed. Raises RunDirError, deleting nothing, when the directory holds anything else."""
    import shutil

    run_dir = Path(run_dir)
    foreign = foreign_files(run_dir)
    if foreign:
        raise RunDirError(
            f"--force: {run_dir} holds {len(foreign)} file(s) kvquant did not write ({_listing(foreign)}); "
            "nothing was deleted. --force removes only kvquant's own files: move those elsewhere, or "
            "choose another --out"
        )
    removed = []
    for entry in sorted(run_dir.iterdir()):
        if entry.name == LOCK_NAME or fnmatch.fnmatch(entry.name, SHARD_LOCKS):
            continue  # held, or to be locked by another process: a lock file is never removed
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
        removed.append(entry.name)
    return removed


def shard_tag(index: int, count: int) -> str:
    """`shard-I-of-N`: how a shard's results file and lock are named."""
    return f"shard-{index}-of-{count}"


class RunLock:
    """An advisory lock on `<run_dir>/.kvquant.lock` (fcntl.flock, non-blocking), held from `acquire()` to
    `release()` (or as a context manager).

    shard=None: exclusive, the only writer of the directory. shard="shard-I-of-N" (`shard_tag`): shared with
    the other shards of the run, plus an exclusive lock on `.kvquant.shard-I-of-N.lock`: shards run side by
    side, the same shard twice is refused, and an exclusive holder refuses (and is refused by) every shard.
    `share(shard)` turns a held exclusive lock into a shard's (torchrun's rank 0 claims the directory
    exclusively, then shares it with its other ranks). The lock files hold their holder's pid, host, start and
    command line, which a refused process names. The kernel drops a lock when its holder dies, even by
    kill -9; the files stay (removing one would let two processes lock two different files)."""

    def __init__(self, run_dir: Path, shard: str | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.shard = shard
        self._fd: int | None = None
        self._shard_fd: int | None = None

    def shard_path(self, shard: str) -> Path:
        return self.run_dir / f".kvquant.{shard}.lock"

    def acquire(self) -> RunLock:
        try:
            import fcntl
        except ImportError:  # not POSIX: nothing to lock with
            logger.warning("no fcntl here: %s is not locked against a second process", self.path.parent)
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shard else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError:
            holder = self._holders(fd)
            os.close(fd)
            raise self._refusal(holder) from None
        self._fd = fd
        if self.shard is None:
            self._write_info(fd)
            return self
        try:
            self._lock_shard(self.shard)
        except BaseException:
            self.release()
            raise
        return self

    def share(self, shard: str) -> RunLock:
        """Turn the held exclusive lock into shard `shard`'s: its own lock first, then the directory's
        shared."""
        import fcntl

        if self._fd is None or self.shard is not None:
            raise RuntimeError("RunLock.share: hold the exclusive lock first")
        self._lock_shard(shard)
        fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        self.shard = shard
        return self

    def _lock_shard(self, shard: str) -> None:
        import fcntl

        fd = os.open(self.shard_path(shard), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = self._holder(fd)
            os.close(fd)
            raise RunDirError(
                f"{self.run_dir}: {shard} is already being measured by another process ({holder}); each "
                "shard runs once at a time: wait for it, or stop it and rerun to resume"
            ) from None
        self._write_info(fd)
        self._shard_fd = fd

    def _refusal(self, holder: str) -> RunDirError:
        return RunDirError(
            f"{self.path.parent} is in use by another kvquant process ({holder}); wait for it to "
            "finish or stop it, then rerun to resume (its measured points are kept), or pass another "
            "--out to run beside it"
        )

    @staticmethod
    def _write_info(fd: int) -> None:
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "argv": sys.argv,
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)

    def shards_held(self) -> list[str]:
        """The shards whose lock another process holds now (tags, e.g. `shard-1-of-2`), by trying each."""
        import fcntl

        held = []
        for path in sorted(self.run_dir.glob(SHARD_LOCKS)):
            tag = path.name.removeprefix(".kvquant.").removesuffix(".lock")
            if tag == self.shard:
                continue
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:
                held.append(tag)
            finally:
                os.close(fd)
        return held

    def _holders(self, fd: int) -> str:
        """Who holds the directory: the shards running in it, else the exclusive holder."""
        shards = self.shards_held()
        if shards:
            infos = []
            for tag in shards:
                try:
                    sfd = os.open(self.shard_path(tag), os.O_RDONLY)
                except OSError:
                    continue
                try:
                    infos.append(f"{tag}: {self._holder(sfd)}")
                finally:
                    os.close(sfd)
            return "the shards of a sharded run: " + "; ".join(infos)
        return self._holder(fd)

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            info = json.loads(os.pread(fd, 1 << 16, 0).decode())
            return f"pid {info['pid']} on {info['host']}, since {info['since']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "pid unknown: it has just started"

    def release_shard(self) -> None:
        """Drop this shard's own lock (its part is done) and keep the directory's shared lock."""
        if self._shard_fd is None:
            return
        import fcntl

        fcntl.flock(self._shard_fd, fcntl.LOCK_UN)
        os.close(self._shard_fd)
        self._shard_fd = None

    def release(self) -> None:
        self.release_shard()
        if self._fd is None:
            return
        import fcntl

        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire() if self._fd is None else self

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """Inside the block SIGTERM raises KeyboardInterrupt once (later ones are logged while the finished
    points are written), so `timeout` or a scheduler's stop leaves the same report and summary as Ctrl-C.
    The previous handler is restored on leaving. Outside the main thread signals cannot be caught: no-op."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = []

    def on_term(signum, frame):
        if fired:
            logger.warning("SIGTERM again: still writing what was measured")
            return
        fired.append(signum)
        logger.warning("SIGTERM: stopping; writing what was measured (as Ctrl-C does)")
        raise KeyboardInterrupt("SIGTERM")

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _canonical(row: Mapping) -> bytes:
    return json.dumps(row, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def row_digest(row: Mapping) -> str:
    """The digest a results.jsonl line carries: sha256 of the row's canonical JSON (sorted keys, no spaces;
    `_sha` itself excluded), 16 hex digits."""
    return hashlib.sha256(_canonical({k: v for k, v in row.items() if k != CHECK_FIELD})).hexdigest()[:16]


def encode_row(row: Mapping) -> str:
    """One results.jsonl line (no newline): the row and its digest."""
    body = {k: v for k, v in row.items() if k != CHECK_FIELD}
    return json.dumps({**body, CHECK_FIELD: row_digest(body)})


def _parse_line(raw: bytes, required: Mapping[str, tuple[type, ...]] | None) -> tuple[dict | None, str]:
    """(row, "") or (None, why the line is not one)."""
    try:
        row = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None, "not JSON (torn by a kill, or foreign)"
    if not isinstance(row, dict) or not row:
        return None, f"not a row ({raw[:20].decode('utf-8', 'replace')!r})"
    for name, types in (required or {}).items():
        if name not in row or not isinstance(row[name], types) or isinstance(row[name], bool):
            return None, f"not a row (no valid {name!r})"
    sha = row.pop(CHECK_FIELD, None)
    if sha is not None and sha != row_digest(row):
        return None, "checksum mismatch (edited or damaged)"
    return row, ""


def read_rows(
    path: Path,
    key: Callable[[dict], tuple] | None = None,
    required: Mapping[str, tuple[type, ...]] | None = None,
) -> tuple[list[dict], bool]:
    """The rows of a results.jsonl file, in order, and whether its last line is torn (no final newline).

    Lines that are not rows (not JSON, not an object, lacking a `required` field of the right type) or whose
    `_sha` does not match are skipped; rows with the same `key` after the first are dropped (identical ones
    silently, conflicting ones logged). All of it is said in one warning per file."""
    data = path.read_bytes() if path.is_file() else b""
    rows: list[dict] = []
    bad: list[str] = []
    seen: dict[tuple, dict] = {}
    conflicts: list[str] = []
    for n, raw in enumerate(data.split(b"\n"), 1):
        raw = raw.strip()
        if not raw:
            continue
        row, why = _parse_line(raw, required)
        if row is None:
            bad.append(f"line {n}: {why}")
            continue
        if key is not None:
            k = key(row)
            if k in seen:
                if seen[k] != row:
                    conflicts.append(f"line {n}: {k}")
                continue
            seen[k] = row
        rows.append(row)
    if bad or conflicts:
        parts = []
        if bad:
            parts.append(f"{len(bad)} line(s) ignored ({_listing(bad, 5)})")
        if conflicts:
            parts.append(
                f"{len(conflicts)} conflicting duplicate point(s), the first kept ({_listing(conflicts, 5)})"
            )
        logger.warning("%s: %s; points without a valid row are measured again", path, "; ".join(parts))
    return rows, bool(data) and not data.endswith(b"\n")


class ResultsFile:
    """results.jsonl: appended and flushed (fsync) line by line, so an interrupted run keeps every point.

    Each line carries its digest (`encode_row`); `read_rows` skips torn, foreign and edited lines and counts
    each point once. Rows in `rows` are as written, without the digest."""

    def __init__(self, path: Path):
        self.path = path
        self.rows, self._torn_tail = read_rows(path, self._dedup_key, _KEY_TYPES)
        self._done = {self.key(r) for r in self.rows if r.get("status") == "ok"}
        self._keys = {self._dedup_key(r) for r in self.rows}

    @staticmethod
    def key(row: dict) -> tuple:
        return row["scheme"], row["mode"], row["doc"], row["bucket"]

    @classmethod
    def _dedup_key(cls, row: dict) -> tuple:
        # a measured point once; a failed or skipped record once per point and status (a resume repeats them)
        return (*cls.key(row), row["status"] if row["status"] != "ok" else "ok")

    def has(self, scheme: str, mode: str, doc: int, bucket: str) -> bool:
        return (scheme, mode, doc, bucket) in self._done

    def append(self, row: dict) -> None:
        """Write `row` (flushed, fsync'd) unless its point (or, failed or skipped, its record) is already
        there: a results file never holds a point twice by kvquant's hand."""
        row = {k: v for k, v in row.items() if k != CHECK_FIELD}
        key = self._dedup_key(row)
        if key in self._keys:
            logger.debug("%s: %s already recorded; not written again", self.path, key)
            return
        with self.path.open("a", encoding="utf-8") as f:
            if self._torn_tail:  # never continue a torn line: the new row gets a line of its own
                f.write("\n")
            f.write(encode_row(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._torn_tail = False
        self.rows.append(row)
        self._keys.add(key)
        if row.get("status") == "ok":
            self._done.add(self.key(row))


RESULTS_NAME = "results.jsonl"


def results_name(shard: str | None = None) -> str:
    """The results file a writer appends to: results.jsonl, or results.shard-I-of-N.jsonl for a shard."""
    return RESULTS_NAME if shard is None else f"results.{shard}.jsonl"


def results_files(run_dir: Path) -> list[Path]:
    """Every results file of a run directory: results.jsonl first, then the shards' in name order."""
    run_dir = Path(run_dir)
    shards = sorted(p for p in run_dir.glob(SHARD_RESULTS) if p.is_file())
    return [p for p in [run_dir / RESULTS_NAME, *shards] if p.is_file()] or [run_dir / RESULTS_NAME]


MEASURED_ONLY = frozenset(metrics.MEMORY_FIELDS)  # fields that differ between two measurements of one point


class RunResults:
    """All results files of a run directory read as one (`results_files`), appending to the writer's own.

    `rows`, `has` and `append` behave as one `ResultsFile` holding every file's rows: a point found in an
    earlier file counts, later copies of it are dropped (a conflict in anything but the measured memory
    fields is logged), and `append` never writes a point any file holds."""

    def __init__(self, run_dir: Path, shard: str | None = None):
        run_dir = Path(run_dir)
        self.own = ResultsFile(run_dir / results_name(shard))
        self.path = self.own.path
        self.rows: list[dict] = []
        self._first: dict[tuple, dict] = {}  # dedup key -> the row that counts
        self._done: set[tuple] = set()
        conflicts = []
        for path in results_files(run_dir):
            rows = self.own.rows if path == self.own.path else read_rows(
                path, ResultsFile._dedup_key, _KEY_TYPES)[0]
            for r in rows:
                k = ResultsFile._dedup_key(r)
                if k in self._first:
                    if _without(self._first[k], MEASURED_ONLY) != _without(r, MEASURED_ONLY):
                        conflicts.append(f"{path.name}: {k}")
                    continue
                self._add(r)
        if conflicts:
            logger.warning("%s: %d point(s) written twice with different numbers, the first kept (%s)",
                           run_dir, len(conflicts), _listing(conflicts, 5))

    def _add(self, row: dict) -> None:
        self.rows.append(row)
        self._first[ResultsFile._dedup_key(row)] = row
        if row.get("status") == "ok":
            self._done.add(ResultsFile.key(row))

    def has(self, scheme: str, mode: str, doc: int, bucket: str) -> bool:
        return (scheme, mode, doc, bucket) in self._done

    def append(self, row: dict) -> None:
        row = {k: v for k, v in row.items() if k != CHECK_FIELD}
        if ResultsFile._dedup_key(row) in self._first:
            return
        self.own.append(row)
        self._add(row)


def _without(row: Mapping, keys) -> dict:
    return {k: v for k, v in row.items() if k not in keys}


@dataclass(frozen=True)
class Memory:
    """A scheme's bytes at the storage dtype (--kv-dtype): steady state per token, and held after n tokens
    (pages counted); values_per_token = 2 L H_kv d, for effective bits."""

    formula: float
    held: Callable[[int], float]
    values_per_token: int
    held_run: Callable[[int], float] | None = None  # held after n tokens at the run dtype (beside nbytes())


class TokenStore:
    """tokens/<mode>/doc<id>/<scheme digest>-<bucket>.npz: per-token values of one measured point
    (`measure.TOKEN_FIELDS`), written before its results.jsonl line, so a line never lacks its tokens."""

    def __init__(self, root: Path):
        self.root = root

    def path(self, scheme: str, mode: str, doc: int, bucket: str) -> Path:
        digest = hashlib.sha1(scheme.encode()).hexdigest()[:12]
        return self.root / mode / f"doc{doc}" / f"{digest}-{bucket}.npz"

    def write(self, scheme: str, mode: str, doc: int, bucket: str, values: Mapping) -> None:
        import numpy as np

        path = self.path(scheme, mode, doc, bucket)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.stem + ".tmp.npz")
        np.savez(tmp, **{k: np.asarray(v) for k, v in values.items()})
        tmp.replace(path)

    def read(self, scheme: str, mode: str, doc: int, bucket: str) -> dict | None:
        import numpy as np

        path = self.path(scheme, mode, doc, bucket)
        if not path.is_file():
            return None
        with np.load(path) as z:
            return {k: z[k] for k in z.files}


def _pooled(parts: list[dict]) -> dict:
    import numpy as np

    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def summarize(
    rows: Iterable[dict],
    memory: Mapping[str, Memory],
    reference: str = "fp16",
    tokens: TokenStore | None = None,
    seed: int = 0,
    n_boot: int | None = None,
) -> list[dict]:
    """summary.csv rows: per (scheme, mode, bucket) over documents, then one `all` row per (scheme, mode).

    Every metric is computed as `kvquant.eval.metrics` declares it: sums over documents, then the metric's
    aggregate; distributions and 95% bootstrap intervals (documents, then tokens) from the per-token values in
    `tokens`, when every document's are there. Drift compares with the reference over the same tokens. A mode
    `<m>-shift` (a second realization, --noise-floor) gives mode <m>'s rows their `drift_noise`."""
    from .stats import N_BOOT

    n_boot = n_boot or N_BOOT
    rows = list(rows)
    ok = [r for r in rows if r.get("status") == "ok"]
    ref = {(r["mode"], r["doc"], r["bucket"]): r for r in ok if r["scheme"] == reference}
    groups, failed, order = _grouped(rows, ok, reference)
    out = []
    for scheme, mode in order:
        mem = memory.get(scheme)
        ref_mem = memory.get(reference)
        base = _base_row(scheme, mode, mem, failed)
        bucket_rows = _rows_by_bucket(groups.get((scheme, mode), []), mode, ref)
        if not bucket_rows:
            out.append(_unmeasured_row(base, mem, ref_mem))
            continue
        keys = sorted(bucket_rows)
        for key in [*keys, None]:
            if key is None:
                bs, be, label = keys[0][0], keys[-1][1], "all"
                rs = [r for k in keys for r in bucket_rows[k]]
            else:
                bs, be, label = key
                rs = bucket_rows[key]
            row = _metric_row(base, (bs, be, label), rs, ref, tokens, reference, n_boot, seed)
            # bytes held at the end of the bucket (at the end of the document for `all`)
            _bytes_columns(row, rs if label != "all" else bucket_rows[keys[-1]], mode, max(int(be), 1),
                           mem, ref_mem)
            row["drift_noise"] = math.nan
            out.append(row)
    _noise(out)
    return out


def _base_row(scheme: str, mode: str, mem: Memory | None, failed: dict) -> dict:
    """The columns every summary row of (scheme, mode) shares: its bits from the memory formula and its
    status (a failed run's own status)."""
    formula = mem.formula if mem else math.nan
    return dict(
        scheme=scheme,
        mode=mode,
        bytes_per_token_formula=formula,
        effective_bits=formula * 8 / mem.values_per_token if mem else math.nan,
        status=failed[(scheme, mode)]["status"] if (scheme, mode) in failed else "ok",
    )


def _rows_by_bucket(rows: list[dict], mode: str, ref: dict) -> dict[tuple, list[dict]]:
    """(bucket_start, bucket_end, bucket) -> the rows measured in that bucket that the reference measured
    too (same mode, document and bucket)."""
    bucket_rows: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if (mode, r["doc"], r["bucket"]) in ref:
            bucket_rows[(r["bucket_start"], r["bucket_end"], r["bucket"])].append(r)
    return bucket_rows


def _unmeasured_row(base: dict, mem: Memory | None, ref_mem: Memory | None) -> dict:
    """The one `all` row of a (scheme, mode) with no bucket measured: every metric nan; a failed scheme also
    gets no bits or saving."""
    if base["status"] != "ok":  # nothing measured: no bits or saving for a scheme that failed
        base.update(bytes_per_token_formula=math.nan, effective_bits=math.nan)
        saving = math.nan
    else:
        saving = ref_mem.formula / mem.formula if mem and ref_mem else math.nan
    empty = {c: math.nan for c in metrics.SUMMARY_COLUMNS if c not in base}
    return empty | base | dict(bucket="all", bucket_start=0, bucket_end=0, docs=0, tokens=0, saving=saving)


def _metric_row(base: dict, bucket: tuple, rs: list[dict], ref: dict, tokens: TokenStore | None,
                reference: str, n_boot: int, seed: int) -> dict:
    """One summary row: `base` plus the bucket (start, end, label) and every bucket metric over the rows
    `rs`, with its 95% interval columns."""
    bs, be, label = bucket
    scheme, mode = base["scheme"], base["mode"]
    totals = {f: sum(_nan(r.get(f)) for r in rs) for f in metrics.ROW_SUMS}
    totals["ref_nll_sum"] = sum(ref[(mode, r["doc"], r["bucket"])]["nll_sum"] for r in rs)
    per_doc = _doc_tokens(rs, scheme, mode, tokens)
    pooled = _pooled(list(per_doc.values())) if per_doc else None
    row = dict(base, bucket=label, bucket_start=bs, bucket_end=be, docs=len({r["doc"] for r in rs}))
    for m in metrics.BUCKET_METRICS:
        row[m.name] = m.value(totals, pooled)
    _interval_columns(row, per_doc, reference, n_boot, seed)
    return row


def _interval_columns(row: dict, per_doc: dict, reference: str, n_boot: int, seed: int) -> None:
    """Set `row`'s `<metric>_lo` / `_hi`: bootstrap intervals over the documents' per-token values (seeded by
    scheme, mode and bucket), the value itself for the reference, nan without per-token values."""
    from .stats import bootstrap_intervals, seed_for

    scheme = row["scheme"]
    for m in metrics.INTERVAL_METRICS:
        row[f"{m.name}_lo"] = row[f"{m.name}_hi"] = math.nan
    if per_doc and scheme != reference:
        ci = bootstrap_intervals(
            [d["nll_diff"] for d in per_doc.values()],
            [d["kl"] for d in per_doc.values()],
            n_boot=n_boot,
            seed=seed_for(seed, scheme, row["mode"], row["bucket"]),
        )
        for name, (lo, hi) in ci.items():
            row[f"{name}_lo"], row[f"{name}_hi"] = lo, hi
    elif scheme == reference:
        for m in metrics.INTERVAL_METRICS:
            row[f"{m.name}_lo"] = row[f"{m.name}_hi"] = row[m.name]


def _grouped(rows: list[dict], ok: list[dict], reference: str
             ) -> tuple[dict[tuple, list[dict]], dict[tuple, dict], list[tuple]]:
    """(measured rows per (scheme, mode), the failed or skipped row per (scheme, mode), every (scheme, mode)
    in summary order: by mode, the reference first, then as first seen)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    order: list[tuple] = []
    for r in ok:
        k = (r["scheme"], r["mode"])
        if k not in order:
            order.append(k)
        groups[k].append(r)
    failed = {(r["scheme"], r["mode"]): r for r in rows if r.get("status") in ("failed", "skipped")}
    for k in failed:
        if k not in order:
            order.append(k)
    order.sort(key=lambda k: (k[1], k[0] != reference))
    return groups, failed, order


def _bytes_columns(row: dict, last: list[dict], mode: str, n: int, mem: Memory | None,
                   ref_mem: Memory | None) -> None:
    """A summary row's bytes per token: measured (pages held at the end of `last`'s bucket), the memory
    columns, the formulas at n tokens, and the saving against the reference's formula."""
    measured = [r["cache_bytes"] / r["cache_tokens"] for r in last
                if r.get("cache_bytes") is not None and r.get("cache_tokens")]
    row["bytes_per_token_measured"] = (
        sum(measured) / len(measured) if measured and mode != "fake" else math.nan
    )
    _memory_columns(row, last, mode)
    row["bytes_per_token_formula_run"] = (
        mem.held_run(n) / n if mem and mem.held_run and mode != "fake" else math.nan)
    row["bytes_per_token"] = mem.held(n) / n if mem else math.nan
    held_ref = ref_mem.held(n) if ref_mem else math.nan
    row["saving"] = held_ref / mem.held(n) if mem and mem.held(n) else math.nan


def _memory_columns(row: dict, last: list[dict], mode: str) -> None:
    """The measured memory of a summary row from its documents' last-bucket rows (`metrics.MEMORY_FIELDS`):
    reserve and held bytes per token averaged over documents, the highest forward peak; nan where none was
    measured (fake mode holds no cache of its own: its K/V are plain tensors)."""
    def per_token(field: str) -> float:
        vals = [r[field] / r["cache_tokens"] for r in last
                if r.get(field) is not None and r.get("cache_tokens")]
        return sum(vals) / len(vals) if vals and mode != "fake" else math.nan

    row["bytes_per_token_reserved"] = per_token("cache_reserved")
    row["mem_held_per_token"] = per_token("mem_held")
    peaks = [r["mem_peak"] for r in last if r.get("mem_peak") is not None]
    row["mem_peak"] = float(max(peaks)) if peaks else math.nan
    by_device = _by_device_per_token(last, mode)
    if by_device is not None:
        row[BY_DEVICE] = by_device


BY_DEVICE = "bytes_per_token_by_device"  # a summary row's pages per device (not a summary.csv column)


def _by_device_per_token(last: list[dict], mode: str) -> dict[str, float] | None:
    """{device: its pages' bytes per token, averaged over documents} from the last-bucket rows'
    `nbytes_by_device` (`kvquant.models.nbytes_by_device`, recorded with the measured memory); it sums to
    `bytes_per_token_measured`. None unless every document's row has it (fake mode holds no pages)."""
    if mode == "fake" or not last:
        return None
    if not all(r.get("nbytes_by_device") and r.get("cache_tokens") for r in last):
        return None
    devices = list(dict.fromkeys(d for r in last for d in r["nbytes_by_device"]))
    return {d: sum(r["nbytes_by_device"].get(d, 0) / r["cache_tokens"] for r in last) / len(last)
            for d in devices}


def _noise(out: list[dict]) -> None:
    """drift_noise of mode m's rows: |drift - drift of the same point in mode `m-shift`|."""
    shifted = {(r["scheme"], r["mode"].removesuffix("-shift"), r["bucket"]): r["drift"]
               for r in out if r["mode"].endswith("-shift")}
    for r in out:
        other = shifted.get((r["scheme"], r["mode"], r["bucket"]))
        if other is not None and not r["mode"].endswith("-shift"):
            r["drift_noise"] = abs(r["drift"] - other)


def _doc_tokens(rs: list[dict], scheme: str, mode: str, tokens: TokenStore | None) -> dict[int, dict] | None:
    """Per document, its per-token values over these rows' buckets (in position order); None if one is
    missing."""
    if tokens is None:
        return None
    parts: dict[int, list[tuple[int, dict]]] = defaultdict(list)
    for r in rs:
        t = tokens.read(scheme, mode, r["doc"], r["bucket"])
        if t is None:
            return None
        parts[r["doc"]].append((r["bucket_start"], t))
    return {doc: _pooled([t for _, t in sorted(ps, key=lambda x: x[0])]) for doc, ps in parts.items()}


def _nan(x) -> float:
    return float("nan") if x is None else float(x)


def write_summary(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()
                        if k in SUMMARY_COLUMNS})
    tmp.replace(path)


def _shown_modes(summary: list[dict]) -> list[str]:
    """Modes in tables and plots (a `-shift` realization only feeds the noise floor)."""
    return [m for m in dict.fromkeys(r["mode"] for r in summary) if not m.endswith("-shift")]


def _cell(r: dict | None, name: str) -> str:
    if r is None:
        return "–"
    m = metrics.metric(name)
    if m.interval:
        return metrics.format_interval(name, r.get(name), r.get(f"{name}_lo"), r.get(f"{name}_hi"))
    return metrics.format_value(name, r.get(name))


def markdown_table(
    summary: list[dict], names: Mapping[str, str] | None = None, kv_dtype: str = "float16"
) -> str:
    """scheme x bucket: drift with its 95% interval (and the noise floor where measured), then the whole
    document's KL with its interval, same top-1, bytes per token and saving at the storage dtype, bits.

    names: result label -> the name shown (a preset's name such as `kivi-2`; the reference's dtype)."""
    names = names or {}
    out = []
    for mode in _shown_modes(summary):
        rows = [r for r in summary if r["mode"] == mode]
        buckets = list(dict.fromkeys(r["bucket"] for r in rows if r["bucket"] != "all"))
        noisy = any(math.isfinite(float(r.get("drift_noise", math.nan))) for r in rows)
        run_cols = ["kl", "top1_agree", "bytes_per_token", "saving", "effective_bits"]
        head = (
            ["scheme"] + [f"drift {b}" for b in buckets] + [metrics.metric(c).title for c in run_cols]
        )
        noise = " ± noise floor (|drift − drift with shifted chunks|)" if noisy else ""
        out += [
            f"**mode: {mode}** — cells are perplexity drift vs the reference [95% bootstrap interval over "
            f"documents, then tokens]{noise}; KL and top-1 over the whole document; bytes at "
            f"{kv_dtype} K/V storage",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
        ]
        for scheme in dict.fromkeys(r["scheme"] for r in rows):
            by = {r["bucket"]: r for r in rows if r["scheme"] == scheme}
            cells = [f"`{names.get(scheme, scheme)}`"]
            for b in buckets:
                r = by.get(b)
                cell = _cell(r, "drift")
                if r is not None and math.isfinite(float(r.get("drift_noise", math.nan))):
                    cell += f" ±{100 * float(r['drift_noise']):.2f}"
                cells.append(cell)
            a = by.get("all", {})
            if a.get("status", "ok") != "ok":
                cells += [a["status"]] + [""] * (len(run_cols) - 1)
            else:
                cells += [_cell(a, c) + ("x" if c == "saving" else "") for c in run_cols]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def memory_table(summary: list[dict], names: Mapping[str, str] | None = None, probe: str | None = None,
                 dtype: str = "float32") -> str:
    """Per mode, the four views of a cache's memory side by side, at the run dtype, per token at the end of
    the document: the formula, the pages held (`nbytes()`), the pools (`reserved_bytes()`), and what the
    device gave back when the cache was dropped; then the highest forward's peak. `probe`: how memory was
    read."""
    names = names or {}
    cols = [m.name for m in metrics.MEMORY_METRICS]
    out = []
    for mode in _shown_modes(summary):
        rows = [r for r in summary if r["mode"] == mode and r["bucket"] == "all" and r.get("status") == "ok"]
        if not rows or not any(_finite_num(r.get(c)) for r in rows for c in cols):
            continue
        head = ["scheme", *(metrics.metric(c).title for c in cols), "measured / formula"]
        out += [f"**mode: {mode}** — memory at {dtype} (the run dtype), per token at the end of the document",
                "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            cells = [f"`{names.get(r['scheme'], r['scheme'])}`"]
            cells += [metrics.format_value(c, r.get(c)) for c in cols]
            held, formula = _num(r.get("mem_held_per_token")), _num(r.get("bytes_per_token_formula_run"))
            cells.append(f"{held / formula:.2f}x" if math.isfinite(held) and formula else "–")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        out += _by_device_table(rows, names)
    if not out:
        return ""
    how = f" Measured with {probe}." if probe else ""
    return "\n".join([
        "**Memory: the formula, the pages, the pools, and what the device held**" + how,
        "",
        "- formula: `kvquant.memory.cache_bytes` (a peer's own held-bytes formula), whole pages counted; "
        "pages: `cache.nbytes()`, what the cache's pages (and FP sink/window tokens) hold; reserved: "
        "`cache.reserved_bytes()`, the pools the cache allocated (pages plus their bounded growth reserve); "
        "measured: the device memory the cache alone gave back when dropped at the end of the document "
        "(CUDA: `torch.cuda.memory_allocated`; CPU: resident set size after gc and `malloc_trim`); forward "
        "peak: the "
        "highest one forward through the cache rose above its start (CUDA: `max_memory_allocated`, reset per "
        "forward; CPU: `VmHWM`).",
        "- When they differ, and why: reserved above pages is the pools' growth reserve (bounded, stated by "
        "`kvquant.plan`); measured above reserved is allocator rounding (CUDA 512-byte blocks) or, on the "
        "CPU, "
        "malloc fragments that `malloc_trim` cannot return (small caches read noisily: a page is 4 KiB, a "
        "huge page 2 MiB); measured below reserved means pool pages never written (`torch.empty` is not "
        "resident until touched). The CUDA caching allocator keeps freed blocks reserved (what `nvidia-smi` "
        "shows), which none of these columns count. The forward peak is activations and attention "
        "temporaries (a dequantized block; the LM head runs after it, so logits are not counted) on top "
        "of the cache's growth in that forward; it is not the cache. The reference read from the reference "
        "cache is not run, so not measured (`--no-reference-cache` measures it).",
        "",
        *out,
    ])


def _by_device_table(rows: list[dict], names: Mapping[str, str] | None = None) -> list[str]:
    """The lines of a short table of the pages each scheme holds per device (B/token and share), from the
    summary rows' `bytes_per_token_by_device`; none when the cache lives on one device (a model on one device,
    or the map put every layer on one)."""
    names = names or {}
    devices = list(dict.fromkeys(d for r in rows for d in r.get(BY_DEVICE) or {}))
    if len(devices) < 2:
        return []
    title = metrics.metric("bytes_per_token_measured").title
    out = [f"pages held per device ({title}, share of the scheme's pages)", "",
           "| scheme | " + " | ".join(f"`{d}`" for d in devices) + " |", "|" + "---|" * (len(devices) + 1)]
    for r in rows:
        by = r.get(BY_DEVICE)
        if not by:
            continue
        total = sum(by.values())
        cells = [f"`{names.get(r['scheme'], r['scheme'])}`"]
        for d in devices:
            v = by.get(d, 0.0)
            share = f" ({100 * v / total:.0f}%)" if total else ""
            cells.append(metrics.format_value("bytes_per_token_measured", v) + share)
        out.append("| " + " | ".join(cells) + " |")
    return [*out, ""]


def _finite_num(v) -> bool:
    return math.isfinite(_num(v))


DISTRIBUTION_COLUMNS = ("kl", "kl_median", "kl_p90", "kl_p99", "kl_p999", "kl_max", "dp_mean", "dp_rms",
                        "top1_agree")


def distribution_table(summary: list[dict], names: Mapping[str, str] | None = None,
                       reference: str = "fp16") -> str:
    """Per mode, scheme and bucket: the error distribution (per-token KL percentiles, Δp, same top-1)."""
    names = names or {}
    out = []
    for mode in _shown_modes(summary):
        rows = [r for r in summary if r["mode"] == mode and r["scheme"] != reference and r.get("tokens")]
        if not rows:
            continue
        head = ["scheme", "bucket", *(metrics.metric(c).title for c in DISTRIBUTION_COLUMNS)]
        out += [f"**mode: {mode}** — error distribution per token (KL in nats; Δp: change of the correct "
                "token's probability)", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            cells = [f"`{names.get(r['scheme'], r['scheme'])}`", r["bucket"]]
            cells += [metrics.format_value(c, r.get(c)) for c in DISTRIBUTION_COLUMNS]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def known_shapes_table(schemes: list, batch: int = 100, tokens: int = 4096, kv_dtype: str = "float16") -> str:
    """Bytes per token and the cache of `batch` requests of `tokens` tokens for well-known models, at the
    storage dtype (every scheme through its protocol's bytes_per_token)."""
    import kvquant

    dbytes = {"float16": 2, "bfloat16": 2, "float32": 4}[kv_dtype]
    lines = [
        f"**Well-known shapes at {kv_dtype} K/V ({batch} requests x {tokens:,} tokens)**",
        "",
        "| model | scheme | KiB/token | cache GB (GiB) | saving |",
        "|---|---|---|---|---|",
    ]
    for name, shape in kvquant.memory.KNOWN_SHAPES.items():
        fp = kvquant.memory.fp16_bytes_per_token(shape, dbytes)
        rows = [(_DTYPE_SHORT[kv_dtype], fp)]
        for s in schemes:
            try:
                rows.append((s.name, s.bytes_per_token(shape, dbytes)))
            except kvquant.SchemeError:  # per-layer specs written for another depth: no figure to give
                rows.append((s.name, None))
        for label, b in rows:
            if b is None:
                lines.append(f"| {name} | `{label}` | — (its layers= ranges are for another depth) | — | — |")
                continue
            total = b * batch * tokens
            lines.append(
                f"| {name} | `{label}` | {b / 1024:,.1f} | {total / 1e9:,.1f} ({total / 2**30:,.1f}) | "
                f"{fp / b:.2f}x |"
            )
    return "\n".join(lines) + "\n"


_DTYPE_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


@dataclass(frozen=True)
class PlotInfo:
    """What a plot says about its run, so the PNG stands alone: model, corpus, documents x length, dtype,
    the chunk of cache mode, display names of schemes (preset names), and whether the run is partial."""

    model: str
    corpus: str
    documents: int
    max_length: int
    dtype: str
    chunk: int | None = None
    names: Mapping[str, str] = field(default_factory=dict)
    partial: str | None = None  # "6 of 24 points" while the run is incomplete
    kv_dtype: str = "float16"  # the storage dtype bytes are reported at (--kv-dtype)
    prefill: int | None = None  # prefill mode's prompt length: its buckets are exact by construction

    def subtitle(self) -> str:
        docs = f"{self.documents} document{'s' if self.documents != 1 else ''}"
        return f"{self.model} · {self.corpus} · {docs} × {self.max_length:,} tokens · {self.dtype}"

    def name(self, label: str) -> str:
        """What a legend or tick shows for `label`: its display name, shortened in the middle past
        `PLOT_LABEL_CHARS` (a per-layer scheme spelled layer by layer would squeeze the axes to a sliver);
        tables and CSVs keep the whole name."""
        if label in self.names:
            full = self.names[label]
        else:
            full = "fp16 (reference)" if label == "fp16" else label
        if len(full) <= PLOT_LABEL_CHARS:
            return full
        tail = PLOT_LABEL_CHARS // 3
        return f"{full[: PLOT_LABEL_CHARS - tail - 1]}…{full[-tail:]}"


PLOT_LABEL_CHARS = 64  # longest scheme name a plot shows whole


def position_label(n: float) -> str:
    """256, 512, 1k, 2k, ... 32k (exact multiples of 1,024 in k; others as they are)."""
    n = int(n)
    if n >= 1024 and n % 1024 == 0:
        return f"{n // 1024}k"
    return f"{n / 1024:.1f}k" if n >= 1024 else str(n)


def _title(fig, what: str, info: PlotInfo | None) -> None:
    """The figure's title: what it shows, the run it comes from, and (in red) whether the run is partial."""
    lines = [what]
    if info is not None:
        lines.append(info.subtitle())
        if info.partial:
            lines.append(f"PARTIAL: {info.partial} measured (run interrupted; rerun to resume)")
    color = "firebrick" if info is not None and info.partial else "black"
    fig.suptitle("\n".join(lines), fontsize=11, color=color)


def _num(v) -> float:
    try:
        v = float(v)
    except (TypeError, ValueError):
        return math.nan
    return v if math.isfinite(v) else math.nan


def _band(row: dict, lo: str = "drift_lo", hi: str = "drift_hi") -> tuple[float, float] | None:
    """The interval of a point (default: its drift's, drift_lo and drift_hi), if the summary carries one."""
    a, b = _num(row.get(lo)), _num(row.get(hi))
    return (a, b) if math.isfinite(a) and math.isfinite(b) else None


def _positive(v: float) -> float:
    return v if v > 0 else math.nan  # a log axis cannot show 0


LINE_MARKERS = ("o", "s", "^", "D", "v")  # one per cycle of matplotlib's 10 default colours


def plot_drift(summary: list[dict], info: PlotInfo | None = None, reference: str = "fp16"):
    """Perplexity drift (top) and KL (bottom: mean, dashed p99) vs the reference by position (the axis and
    title name it: `info.name(reference)`), one column per mode, log-x; a shaded band where a point has an
    interval (`drift_lo`/`drift_hi`, `kl_lo`/`kl_hi` in its summary row)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    info = info or PlotInfo("", "", 0, 0, "")
    ref_name = info.name(reference)  # e.g. "fp32 (reference)" when the run computes in float32
    modes = _shown_modes(summary) or ["cache"]
    many = len({r["scheme"] for r in summary}) > 9  # > 8 beside the reference: legends beside the panels
    fig, axes = plt.subplots(
        2, len(modes), figsize=((12.0 if many else 6.5) * len(modes), 8.6), squeeze=False, sharey="row",
        sharex="col",
        layout="constrained", height_ratios=(1.2, 1.0),
    )
    ticks: set[int] = set()
    for col, mode in enumerate(modes):
        ax, kax = axes[0][col], axes[1][col]
        rows = [r for r in summary if r["mode"] == mode and r["bucket"] != "all" and r["scheme"] != reference]
        prompt = info.prefill if mode == "prefill" and info.prefill else 0
        if prompt:  # the prompt's buckets went through the FP forward: 0 drift by construction, not a result
            ends = [int(r["bucket_end"]) for r in rows]
            rows = [r for r in rows if int(r["bucket_end"]) > prompt]
            if ends:
                ticks.update(e for e in ends if e <= prompt)
                ax.axvspan(min(ends), prompt, color="grey", alpha=0.12, linewidth=0)
                kax.axvspan(min(ends), prompt, color="grey", alpha=0.12, linewidth=0)
                note = f"prompt ({prompt:,} tokens):\nFP forward, not plotted"
                ax.text(math.sqrt(min(ends) * prompt), 0.3, note, transform=ax.get_xaxis_transform(),
                        ha="center", va="center", fontsize=8, color="dimgrey")
        has_band = False
        schemes = list(dict.fromkeys(r["scheme"] for r in rows))
        for i, scheme in enumerate(schemes):
            pts = sorted((int(r["bucket_end"]), r) for r in rows if r["scheme"] == scheme)
            xs = [x for x, _ in pts]
            ticks.update(xs)
            marker = LINE_MARKERS[i // 10 % len(LINE_MARKERS)]  # colours repeat past 10: markers differ
            (line,) = ax.plot(xs, [100 * r["drift"] for _, r in pts], marker=marker, label=info.name(scheme))
            color = line.get_color()
            kax.plot(xs, [_positive(_num(r.get("kl"))) for _, r in pts], marker=marker, color=color)
            kax.plot(xs, [_positive(_num(r.get("kl_p99"))) for _, r in pts], ls="--", lw=1, color=color,
                     marker="_" if len(xs) == 1 else None)  # a lone p99 needs a marker to show
            bands_of = ((ax, "drift", 100), (kax, "kl", 1))
            for target, metric, scale in bands_of:
                bands = [_band(r, f"{metric}_lo", f"{metric}_hi") for _, r in pts]
                if bands[0] and len(xs) == 1:  # one point (prefill's decoded half): a band needs two
                    has_band = True
                    y = scale * _num(pts[0][1].get(metric))
                    lo, hi = scale * bands[0][0], scale * bands[0][1]
                    target.errorbar(xs, [y], yerr=[[max(y - lo, 0.0)], [max(hi - y, 0.0)]], fmt="none",
                                    ecolor=color, alpha=0.6, capsize=4)
                elif any(bands):
                    has_band = True
                    target.fill_between(
                        xs, [scale * b[0] if b else math.nan for b in bands],
                        [scale * b[1] if b else math.nan for b in bands], color=color, alpha=0.2, linewidth=0,
                    )
        ax.axhline(0, color="grey", lw=0.8)
        kax.set_xlabel("position (end of bucket, tokens)")
        chunk = f", chunk {info.chunk:,}" if mode == "cache" and info.chunk else ""
        decoded = f", decoded after a {prompt:,}-token prompt" if prompt else ""
        ax.set_title(f"mode: {mode}{chunk}{decoded}", fontsize=10)
        if rows:
            # many schemes: the legend beside the panel, where it hides no line and no prompt note
            beside = dict(loc="upper left", bbox_to_anchor=(1.01, 1.0)) if many else {}
            ax.legend(fontsize=8, title="shaded / bars: interval" if has_band else None, title_fontsize=8,
                      **beside)
            kax.set_yscale("log")
    axes[0][0].set_ylabel(f"perplexity drift vs {ref_name} (%)")
    axes[1][0].set_ylabel(f"KL({ref_name} || scheme), nats\nper token: mean (dashed: p99)")
    for ax in (a for row in axes for a in row):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(FixedLocator(sorted(ticks)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: position_label(x)))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.tick_params(labelsize=9)
    _title(fig, f"Perplexity drift and KL vs {ref_name} by position", info)
    return fig


def plot_bytes(summary: list[dict], info: PlotInfo | None = None):
    """KV-cache bytes per token per scheme: the pages held (cache mode) beside the formula, both counted at
    the --kv-dtype storage dtype, and, where the run measured it, the memory the process really held for the
    cache (RSS growth on the CPU, allocated bytes on CUDA: at the run's own dtype, pool reserve included);
    each bar labelled with its value and each scheme with its saving vs FP16."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    info = info or PlotInfo("", "", 0, 0, "")
    modes = list(dict.fromkeys(r["mode"] for r in summary))
    mode = "cache" if "cache" in modes else (modes[0] if modes else "cache")
    alls = [r for r in summary if r["bucket"] == "all" and r["mode"] == mode]
    reference = "fp16"  # the results key of the reference (measure.REFERENCE)
    fig, ax = plt.subplots(figsize=(max(9.0, 1.6 * len(alls) + 2.5), 5.2), layout="constrained")
    xs = list(range(len(alls)))
    series = [
        ("held at the full length (pages counted)", "bytes_per_token"),
        ("formula (steady state)", "bytes_per_token_formula"),
        (f"held by the process, measured (at {info.dtype}, reserve included)", "mem_held_per_token"),
    ]
    shown = [(label, [float(r.get(key, math.nan)) for r in alls]) for label, key in series]
    shown = [(label, values) for label, values in shown if any(math.isfinite(v) for v in values)]
    width = 0.8 / max(1, len(shown))
    for i, (label, values) in enumerate(shown):
        dx = (i - (len(shown) - 1) / 2) * width
        bars = ax.bar([x + dx for x in xs], values, width=width, label=label)
        ax.bar_label(bars, labels=[f"{v:,.0f}" if math.isfinite(v) else "" for v in values], fontsize=8)
    ticks = [
        info.name(r["scheme"]) + (f"\n{r['saving']:.2f}× smaller" if r["scheme"] != reference else "")
        for r in alls
    ]
    ax.set_xticks(xs, ticks, fontsize=9, rotation=20 if len(alls) > 5 else 0)
    measured = any(label == series[2][0] for label, _ in shown)  # two dtypes on one axis: say both
    if measured:
        ax.set_ylabel(
            f"KV-cache bytes per token\n(counted at {info.kv_dtype} K/V storage, measured at {info.dtype})"
        )
    else:
        ax.set_ylabel(f"KV-cache bytes per token (at {info.kv_dtype} K/V storage)")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:,.0f}"))
    ax.margins(y=0.12)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    _title(fig, "KV-cache bytes per token", info)
    return fig


def write_plots(run_dir: Path, summary: list[dict], info: PlotInfo | None = None) -> list[Path]:
    """drift_vs_length.png and bytes_per_token.png in run_dir."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, fig in (
        ("drift_vs_length.png", plot_drift(summary, info)),
        ("bytes_per_token.png", plot_bytes(summary, info)),
    ):
        path = run_dir / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def provenance_lines(config_json: dict, progress) -> list[str]:
    """The report's closing header lines, shared by every run kind: points measured (and failed), git commit
    and package versions."""
    failed = f" ({progress.failed} not measured: scheme failed)" if progress.failed else ""
    versions = ", ".join(f"{k} {v}" for k, v in config_json["versions"].items())
    resumed = [str(c) for c in config_json.get("resumed_git_commits") or ()]
    # None outside a git checkout (a pip-installed kvquant, a source archive): the report says so, not crash
    commit = config_json.get("git_commit") or "commit unknown (not a git checkout)"
    git = commit + (f" (resumed at {', '.join(resumed)})" if resumed else "")
    return [f"- points measured: {progress}{failed}", f"- git {git}; {versions}"]
