"""The one run harness every evaluation task runs on: perplexity (`runner`), retrieval (`retrieval`), the
recommendation sweep (`recommend`, through `runner.run`) and serving (`serve`, for the parts its own row
format allows).

What is shared, and lives only here:

- the run directory: `default_run_dir` (runs/<stem>-<digest of the identity>), `prepare_dir` (lock, claim,
  resume a run of the same identity, refuse another, --force removing only kvquant's files), `write_json`;
- identity and provenance: `stored_identity`, `diff`, `provenance` (versions, git commit, creation time);
- points and resume: `runs_in`, `record_skipped`, `progress_of` over `results.RunResults` (checksummed,
  append-only rows, one file per shard);
- sharding (docs/scale.md): `Role` (one process, a job-array task `--shard I/N`, or a torchrun rank),
  `Group` (torch.distributed's gloo group of the ranks), `open_dir`, `wait_for_shards`, and `execute`, which
  divides a task's work units among the processes, measures this process's part, and has the one process
  that reports (no shard, torchrun's rank 0, or `--merge`) write summary, report and plots;
- reporting helpers common to the tasks: `display_names`, `memory_of`;
- W&B: `check_wandb` (refuses a mode that cannot log, before any work) and `log_wandb` (after the results
  are on disk; a failure is a warning, never an error).

A task supplies only what it measures, as a `Work`: its units, its points, how it measures a set of units,
and how it writes its outputs. Importing it imports neither torch nor transformers (experiments/serve.py
checks its flags through it first); the functions that need them import them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import subprocess
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import results as res
from .config import (
    DTYPE_NAMES,
    KV_DTYPE_BYTES,
    Progress,
    RunConfig,
    RunError,
    RunIncomplete,
    RunInterrupted,
    Shard,
)
from .schemes import EvalScheme

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------ devices, model


def check_device(device: str) -> None:
    """Refuse a device this torch cannot use, naming the fix (never fall back silently)."""
    import torch

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


def load_model(config: RunConfig, model=None, tokenizer=None, device: str | None = None):
    """(model, tokenizer, the name the run records): the given model object, or config.model loaded."""
    import torch

    import kvquant

    if model is not None:
        if tokenizer is None:
            raise RunError("a model object needs its tokenizer")
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        return model, tokenizer, name
    try:
        model, tokenizer = kvquant.load_model(
            config.model, dtype=getattr(torch, DTYPE_NAMES[config.dtype]), device=device or config.device,
            device_map=config.device_map,  # each layer (and its pages) on its device; inputs go to the first
        )
    except (OSError, ValueError) as e:  # a folder whose files transformers cannot read
        raise RunError(f"cannot load model {config.model or '(default)'}: {e}") from None
    name = config.model or "smollm2-135m-instruct (embedded default)"
    return model, tokenizer, name


def check_model_fits(config: RunConfig, model, schemes: list[EvalScheme]):
    """The length within the model's positions and every group size dividing its head_dim; the KV shape."""
    import kvquant
    from kvquant.quirks import max_positions
    from kvquant.scheme import SchemeError

    max_pos = max_positions(model.config)
    if max_pos is not None and config.max_length > max_pos:
        raise RunError(f"--max-length {config.max_length} is beyond the model's {max_pos} positions")
    shape = kvquant.memory.KVShape.from_config(model.config)
    for s in schemes:
        try:
            s.check(shape)
        except SchemeError as e:
            raise RunError(f"scheme {s}: {e}") from None
    return shape


# ------------------------------------------------------------------------------- identity and provenance


def versions(schemes=()) -> dict[str, str]:
    extra = sorted({s.package for s in schemes if getattr(s, "package", None)})
    out = {}
    for n in ["torch", "transformers", "datasets", "kvquant", *extra]:
        try:
            out[n] = importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            out[n] = "not installed"
    return out


def git_commit() -> str | None:
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


def provenance(schemes=()) -> dict:
    """What config.json records of where the numbers came from (the report prints it: provenance_lines)."""
    return {
        "versions": versions(schemes),
        "git_commit": git_commit(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "-" for c in text).strip("-")[:40]


def identity_digest(identity: dict) -> str:
    return hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]


def default_run_dir(stem: str, identity: dict) -> Path:
    """runs/<stem>-<8 hex digits of the identity>: equal identities, one directory (a rerun resumes)."""
    return Path("runs") / f"{stem}-{identity_digest(identity)}"


def stored_identity(config_json: dict, ignore: tuple[str, ...] = ()) -> dict:
    """The identity a run directory's config.json holds, less `ignore` (keys that no longer belong to it)."""
    return {k: v for k, v in config_json.get("identity", {}).items() if k not in ignore}


def diff(a: dict, b: dict) -> str:
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return "; ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys) or "unknown"


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp")  # per process: the shards of a run may race
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)


# ------------------------------------------------------------------------------------------ run directory


def prepare_dir(
    run_dir: Path,
    config_json: dict,
    identity: dict,
    force: bool,
    ignore: tuple[str, ...] = (),
    shard: str | None = None,
) -> res.RunLock:
    """Lock `run_dir` for this run and resume a run of the same configuration there; refuse another one, or
    a folder that is not a run, unless force, which starts over (also over a run of the same configuration)
    by removing only what kvquant wrote: a folder holding anything else is refused, and nothing deleted.
    Returns the held lock (`res.RunLock`): the caller releases it when the run ends. A second process into
    the same directory is refused here, naming the holder's pid. On resume config_json keeps the run's first
    commit and creation time, and lists in `resumed_git_commits` any other commit that resumed it (the
    report prints both). `ignore`: keys of a stored identity that no longer belong to it (a retrieval grid,
    which a run may grow). shard: a shard's tag (`Shard.tag`): the lock is shared with the run's other shards
    (`res.RunLock`), and config.json is written as any of them may (each through its own temporary)."""
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
    lock = lock_dir(run_dir, shard)
    try:
        _claim_dir(run_dir, cfg_path, config_json, identity, force, ignore)
    except BaseException:
        lock.release()
        raise
    return lock


def lock_dir(run_dir: Path, shard: str | None = None, error: type[Exception] = RunError) -> res.RunLock:
    """Create `run_dir` and take its lock (`res.RunLock`); a holder or an unusable folder raises `error`."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        return res.RunLock(run_dir, shard).acquire()
    except res.RunDirError as e:
        raise error(str(e)) from None
    except OSError as e:
        raise error(f"cannot use {run_dir} as the run directory: {e.strerror or e}") from None


def clear_for_force(run_dir: Path, error: type[Exception] = RunError) -> None:
    """--force: remove what kvquant wrote in run_dir (`res.clear_run_dir`), saying what."""
    try:
        removed = res.clear_run_dir(run_dir)
    except res.RunDirError as e:
        raise error(str(e)) from None
    if removed:
        logger.warning("--force: removed %s from %s", ", ".join(removed), run_dir)


def _claim_dir(run_dir: Path, cfg_path: Path, config_json: dict, identity: dict, force: bool, ignore) -> None:
    """prepare_dir's work under the lock."""
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
            write_json(cfg_path, config_json)
            return  # resume
        raise RunError(
            f"{run_dir} holds a run with a different configuration "
            f"({diff(old_identity, identity)});"
            " pass --force to replace it, or --out to write elsewhere"
        )
    if force:
        clear_for_force(run_dir)
    write_json(cfg_path, config_json)


# ------------------------------------------------------------------------------------- points and progress


def runs_in(mode: str, schemes: list[EvalScheme]) -> list[EvalScheme]:
    """The schemes measured in `mode` (each says which modes it supports; peers: cache only)."""
    base = mode.removesuffix("-shift")
    return [s for s in schemes if base in s.modes]


def record_skipped(results, mode: str, skipped: list[EvalScheme]) -> None:
    """One `skipped` row per scheme that does not run in `mode` (written once per run directory)."""
    for s in skipped:
        if not results.has(s.label, mode, -1, "skipped"):
            results.append(
                {
                    "scheme": s.label,
                    "mode": mode,
                    "doc": -1,
                    "bucket": "skipped",
                    "status": "skipped",
                    "error": f"{s.label} runs in {'/'.join(s.modes)} mode only",
                }
            )


Point = tuple  # (scheme label, mode, doc, bucket): how results files key a row


def progress_of(results, points: Sequence[Point]) -> Progress:
    """Points measured, and points that will not be because their scheme failed in that mode."""
    failed_runs = {(r["scheme"], r["mode"]) for r in results.rows if r.get("status") == "failed"}
    measured = sum(results.has(*p) for p in points)
    failed = sum(not results.has(*p) and (p[0], p[1]) in failed_runs for p in points)
    return Progress(measured, len(points), failed)


# ------------------------------------------------------------------------------------------- reporting

_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def display_names(schemes: list[EvalScheme], dtype_name: str | None = None) -> dict[str, str]:
    """Result label -> what plots and tables show: the preset name where one was used (`kivi-2`), and the
    reference named for what it is: `fp32 (reference)` when it computes in float32, `fp16` in float16."""
    from .measure import REFERENCE

    names = {s.label: s.name for s in schemes}
    if dtype_name is not None:
        short = _SHORT.get(dtype_name, dtype_name)
        names[REFERENCE] = short if short == "fp16" else f"{short} (reference)"
    return names


def memory_of(
    schemes: list[EvalScheme], model_config, kv_dtype: str, run_dtype: str | None = None
) -> dict[str, res.Memory]:
    """Bytes at the storage dtype for the reference and every scheme (each through its protocol); with
    run_dtype (float32, ...) also held at the dtype the run computes and stores in (beside nbytes())."""
    import kvquant

    from .measure import REFERENCE

    shape = kvquant.memory.KVShape.from_config(model_config)
    dbytes = KV_DTYPE_BYTES[kv_dtype]
    rbytes = KV_DTYPE_BYTES[run_dtype] if run_dtype else None
    values = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim
    fp = float(kvquant.memory.fp16_bytes_per_token(shape, dbytes))
    out = {REFERENCE: res.Memory(
        fp, lambda n: fp_held(model_config, n, dbytes), values,
        (lambda n: fp_held(model_config, n, rbytes)) if rbytes else None,
    )}
    for s in schemes:
        out[s.label] = res.Memory(
            s.bytes_per_token(shape, dbytes), lambda n, s=s: s.held_bytes(model_config, n, dbytes), values,
            (lambda n, s=s: s.held_bytes(model_config, n, rbytes)) if rbytes else None,
        )
    return out


def fp_held(model_config, n: int, dbytes: int) -> float:
    """The unquantized cache after n tokens: full layers hold n tokens, sliding-window layers their window."""
    import kvquant

    shape = kvquant.memory.KVShape.from_config(model_config)
    per = 2 * shape.num_kv_heads * shape.head_dim * dbytes
    return float(sum(per * min(n, shape.window_of(i) or n) for i in range(shape.num_layers)))


# ------------------------------------------------------------------------------------------------ W&B


def check_wandb(mode: str) -> None:
    """Refuse, before any work, a W&B mode that cannot log here: `online` or `offline` without the wandb
    package, `online` without credentials (WANDB_API_KEY, or `wandb login`'s netrc entry)."""
    if mode == "disabled":
        return
    if importlib.util.find_spec("wandb") is None:
        raise RunError(f"--wandb {mode}: the wandb package is not installed; pip install wandb, or pass "
                       "--wandb disabled")
    if mode == "online" and not _wandb_credentials():
        raise RunError("--wandb online: no W&B credentials (set WANDB_API_KEY or run `wandb login`); or log "
                       "locally with --wandb offline and `wandb sync` the run later")


def _wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def log_wandb(run_dir: Path, mode: str, project: str | None = None, group: str | None = None) -> None:
    """Log a finished (or partial) run directory to W&B (`wandb_logger.log_run`), whatever its task. After
    the results are on disk: any W&B failure is a warning, never an error."""
    if mode == "disabled":
        return
    try:
        from .wandb_logger import log_run

        log_run(run_dir, mode, project=project, group=group)
    except Exception as e:  # noqa: BLE001 - W&B never touches local results or the exit code
        logger.warning(
            "W&B logging failed (local results are intact in %s): %s: %s", run_dir, type(e).__name__, e
        )


# ------------------------------------------------------------------------------------------------ sharding


@dataclass(frozen=True)
class Role:
    """This process's part: the whole run (shard None), a job-array task (--shard I/N, coordinated False) or
    a torchrun rank (coordinated: the ranks meet at a barrier, divide what is missing and rank 0 reports)."""

    shard: Shard | None = None
    coordinated: bool = False
    local_rank: int = 0

    @property
    def tag(self) -> str | None:
        return self.shard.tag if self.shard is not None else None

    @property
    def who(self) -> str:
        return "rank" if self.coordinated else "shard"

    @property
    def reports(self) -> bool:
        """Whether this process writes summary, report and plots: no shard, or torchrun's rank 0 (a job
        array's shards leave that to --merge)."""
        return self.shard is None or (self.coordinated and self.shard.index == 0)


def role_of(config: RunConfig) -> Role:
    """torchrun's (or accelerate's) ranks from RANK / WORLD_SIZE / LOCAL_RANK, else config.shard."""
    world = os.environ.get("WORLD_SIZE", "").strip()
    if not world or int(world) <= 1:
        return Role(config.shard)
    if config.shard is not None or config.merge:
        raise RunError(
            f"--shard/--merge are for job arrays; under torchrun (WORLD_SIZE={world}) the ranks divide the "
            "run among themselves and rank 0 writes the report: drop --shard/--merge"
        )
    try:
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    except (KeyError, ValueError):
        raise RunError(
            f"WORLD_SIZE={world} but RANK is not set: launch with torchrun (docs/scale.md)"
        ) from None
    return Role(Shard(rank, int(world)), True, local)


def rank_device(device: str, role: Role) -> str:
    """Each torchrun rank binds its own device: `cuda` -> `cuda:LOCAL_RANK`; the CPU stays the CPU."""
    if not role.coordinated or not device.startswith("cuda"):
        return device
    if device != "cuda":
        raise RunError(
            f"--device {device} under torchrun would put every rank on one device: pass --device cuda, and "
            "each rank binds cuda:LOCAL_RANK"
        )
    return f"cuda:{role.local_rank}"


class Group:
    """torch.distributed's process group of the torchrun ranks (gloo: a barrier and one broadcast, on any
    device), created here unless the launcher made one; nothing without coordination."""

    def __init__(self, role: Role):
        self.role = role
        self._own = False

    def __enter__(self) -> Group:
        if self.role.coordinated:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo")
                self._own = True
        return self

    def __exit__(self, *exc) -> None:
        if self._own:
            import torch.distributed as dist

            dist.destroy_process_group()

    @property
    def rank(self) -> int:
        return self.role.shard.index if self.role.shard is not None else 0

    def barrier(self) -> None:
        if self.role.coordinated:
            import torch.distributed as dist

            dist.barrier()

    def share(self, message: str | None) -> str | None:
        """Rank 0's message (an error, or None) on every rank."""
        if not self.role.coordinated:
            return message
        import torch.distributed as dist

        box = [message]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def open_dir(
    run_dir: Path, config_json: dict, identity: dict, force: bool, role: Role, group: Group,
    ignore: tuple[str, ...] = (),
) -> res.RunLock:
    """Lock and claim the run directory for this process's part. torchrun: rank 0 claims it alone (the
    exclusive lock, then shared with its ranks) and tells the others whether it could; they then lock their
    own shards and check the directory holds this run."""
    if not role.coordinated:
        return prepare_dir(run_dir, config_json, identity, force, ignore, shard=role.tag)
    if group.rank == 0:
        try:
            lock = prepare_dir(run_dir, config_json, identity, force, ignore)
            try:
                lock.share(role.tag)
            except (res.RunDirError, OSError) as e:
                lock.release()
                raise RunError(str(e)) from None
        except BaseException as e:
            group.share(f"rank 0 could not open the run directory: {e}")
            raise
        group.share(None)
        return lock
    refused = group.share(None)
    if refused:
        raise RunError(refused)
    try:
        lock = res.RunLock(run_dir, role.tag).acquire()
    except res.RunDirError as e:
        raise RunError(str(e)) from None
    try:
        stored = stored_identity(json.loads((run_dir / "config.json").read_text(encoding="utf-8")), ignore)
    except (OSError, ValueError) as e:
        lock.release()
        raise RunError(f"{run_dir}/config.json unreadable after rank 0 wrote it: {e}") from None
    if stored != identity:
        lock.release()
        raise RunError(f"rank {group.rank}'s configuration differs from rank 0's ({diff(stored, identity)})")
    return lock


def wait_for_shards(lock: res.RunLock, role: Role, poll: float = 0.2) -> None:
    """Rank 0: wait until no other rank holds its shard's lock (done, or dead: the kernel drops a dead
    process's lock, so this never waits on a killed rank). Interruptible (SIGTERM, Ctrl-C)."""
    said = time.monotonic()
    while True:
        busy = [t for t in lock.shards_held() if t.endswith(f"-of-{role.shard.count}")]
        if not busy:
            return
        if time.monotonic() - said > 30:
            logger.info("rank 0 waits for %s to finish", ", ".join(busy))
            said = time.monotonic()
        time.sleep(poll)


# ------------------------------------------------------------------------------------------ the driver


@dataclass(frozen=True)
class Work:
    """What a task supplies to `execute`: the rest is the harness's.

    units: the run's units of work in the order they are measured (a unit is what one process measures
    whole: a (mode, document, scheme) of a perplexity run, a point of a retrieval grid); they are divided
    among the processes. points: every results key a complete run holds (its progress). points_of(units):
    the points those units measure. unit_done(results, unit): all its points are measured. measure(results,
    units): measure those units, appending rows. write_outputs(rows, progress): summary rows, with
    summary.csv, report.md and plots written. announce(results, points): say what is measured and what
    will be (optional)."""

    units: Sequence[Hashable]
    points: Sequence[Point]
    points_of: Callable[[set], list[Point]]
    unit_done: Callable[[object, Hashable], bool]
    measure: Callable[[object, set], None]
    write_outputs: Callable[[list[dict], Progress], list[dict]]
    announce: Callable[[object, list[Point]], None] | None = None


def execute(
    config: RunConfig, role: Role, run_dir: Path, config_json: dict, identity: dict, work: Work,
    ignore: tuple[str, ...] = (),
) -> tuple[Path, list[dict]]:
    """Run (or resume) `work` in `run_dir` as this process's role says; returns (run directory, summary rows;
    empty for a process that does not report).

    The directory is locked for the run's life. One process measures every unit not yet measured; torchrun's
    ranks (each having read the same results) divide what is missing alike; a job-array shard measures its
    part of every unit, skipping what any results file holds, and writes no report; `config.merge` measures
    nothing and writes the report from every shard's rows. On Ctrl-C or SIGTERM everything measured is
    written (report marked partial) and RunInterrupted is raised; a report with points missing after a merge
    or a torchrun run raises RunIncomplete after writing."""
    with Group(role) as group:
        lock = open_dir(run_dir, config_json, identity, config.force, role, group, ignore)
        try:
            return _execute_locked(config, role, group, lock, run_dir, work)
        finally:
            lock.release()


def _my_units(config: RunConfig, role: Role, group: Group, results, work: Work) -> list:
    if config.merge:
        return []
    if role.coordinated:  # every rank has read the same results: they divide what is missing alike
        todo = [u for u in work.units if not work.unit_done(results, u)]
        group.barrier()
        return role.shard.part(todo)
    if role.shard is not None:
        return role.shard.part(list(work.units))
    return list(work.units)


def _execute_locked(
    config: RunConfig, role: Role, group: Group, lock: res.RunLock, run_dir: Path, work: Work
) -> tuple[Path, list[dict]]:
    import torch

    results = res.RunResults(run_dir, role.tag)
    mine = set(_my_units(config, role, group, results, work))
    my_points = work.points_of(mine)
    if not config.merge:
        if role.shard is not None:
            logger.info("%s %s: %d of the run's %d points are this process's part", role.who, role.shard,
                        len(my_points), len(work.points))
        if work.announce is not None:
            work.announce(results, my_points)
    torch.manual_seed(config.seed)
    interrupted = False
    t0 = time.perf_counter()
    summary: list[dict] = []
    with res.interrupt_on_sigterm():  # `timeout` or a scheduler's stop ends the run as Ctrl-C does
        try:
            if mine:
                work.measure(results, mine)
            lock.release_shard()  # this shard's part is done (rank 0 waits on the others' locks)
            if role.reports and role.coordinated:
                wait_for_shards(lock, role)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            if mine:
                logger.info("measured in %.1f s", time.perf_counter() - t0)
            if role.reports:
                results = res.RunResults(run_dir, role.tag)  # every process's rows, as they are now
                progress = progress_of(results, work.points)
                summary = work.write_outputs(results.rows, progress)
            else:
                progress = progress_of(results, my_points)
    if interrupted:
        raise RunInterrupted(run_dir, progress)
    if role.reports and not progress.complete and (config.merge or role.coordinated):
        why = "--merge" if config.merge else f"a rank of {role.shard.count} stopped before its part was done"
        raise RunIncomplete(run_dir, progress, why)
    if role.shard is not None and not role.coordinated:
        logger.info(
            "shard %s done (%s of its part measured) in %s; when every shard is done, run the same command "
            "with --merge instead of --shard to write the report", role.shard, progress, run_dir
        )
    return run_dir, summary


def units_in_order(points: Iterable[Point], unit: Callable[[Point], Hashable]) -> list:
    """The distinct units of `points`, in the order the points come."""
    return list(dict.fromkeys(unit(p) for p in points))
