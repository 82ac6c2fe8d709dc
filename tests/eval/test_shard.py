"""Sharded runs: torchrun ranks (gloo, 2 processes), job arrays (--shard I/N + --merge), resume at another
world size, the run directory's locks, and memory measured on the device. Every command docs/scale.md shows
is run here, with the tiny model and small sizes appended."""

from __future__ import annotations

import csv
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import run as cli  # experiments/run.py (tests/eval/conftest.py puts experiments/ on sys.path)
from kvquant.eval import results as res
from kvquant.eval.config import RunConfig, RunError, Shard, parse_shard
from kvquant.eval.metrics import MEMORY_FIELDS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "scale.md"
RUN_PY = ROOT / "experiments" / "run.py"
# the commands of docs/scale.md, verbatim (test_docs_show_the_tested_commands keeps the two equal)
TORCHRUN = ("torchrun --standalone --nproc-per-node 2 experiments/run.py --schemes int8,int4-g64 "
            "--out runs/sweep")
SLURM = ("python experiments/run.py --schemes int8,int4-g64 --out runs/sweep "
         "--shard ${SLURM_ARRAY_TASK_ID}/${SLURM_ARRAY_TASK_COUNT}")
K8S = "python experiments/run.py --schemes int8,int4-g64 --out runs/sweep --shard ${JOB_COMPLETION_INDEX}/4"
MERGE = "python experiments/run.py --schemes int8,int4-g64 --out runs/sweep --merge"
RESUME = "python experiments/run.py --schemes int8,int4-g64 --out runs/sweep"
# retrieval grids shard through the same harness (docs/scale.md, "Retrieval grids")
PK_TORCHRUN = ("torchrun --standalone --nproc-per-node 2 experiments/run.py --task passkey "
               "--schemes int8,int4-g64 --out runs/passkey")
PK_SHARD = ("python experiments/run.py --task passkey --schemes int8,int4-g64 --out runs/passkey "
            "--shard ${JOB_COMPLETION_INDEX}/2")
PK_MERGE = "python experiments/run.py --task passkey --schemes int8,int4-g64 --out runs/passkey --merge"
PK_ONE = "python experiments/run.py --task passkey --schemes int8,int4-g64 --out runs/passkey"
POINTS = 2 * 3 * 2  # documents x (reference + 2 schemes) x buckets (300 tokens: 0-256, 256-300)


def tiny(model_dir, corpus, out) -> list[str]:
    """The flags appended to a documented command: the tiny model, small sizes, a temporary --out, and the
    reference computed in every run (a reference read from the reference cache holds no cache, so its rows
    carry no cache bytes: the runs compared would differ by what an earlier one left there)."""
    return ["--model", str(model_dir), "--corpus", str(corpus), "--max-length", "300", "--chunk", "128",
            "--docs", "2", "--out", str(out), "--no-reference-cache"]


def argv_of(command: str, env: dict[str, str] | None = None) -> list[str]:
    """A documented `python experiments/run.py ...` command's arguments, its ${VARS} expanded from env."""
    text = re.sub(r"\$\{(\w+)\}", lambda m: (env or {})[m[1]], command)
    words = shlex.split(text)
    assert words[:2] == ["python", "experiments/run.py"], command
    return words[2:]


def rows_of(run_dir: Path) -> dict[tuple, dict]:
    """Every measured row of a run directory (all results files), less what is measured anew each time."""
    out = {}
    for r in res.RunResults(run_dir).rows:
        out[res.ResultsFile.key(r)] = {k: v for k, v in r.items() if k not in MEMORY_FIELDS}
    return out


def summary_of(run_dir: Path) -> dict[tuple, dict]:
    memory_cols = {"bytes_per_token_reserved", "mem_held_per_token", "mem_peak"}
    with (run_dir / "summary.csv").open() as f:
        return {(r["scheme"], r["mode"], r["bucket"]): {k: v for k, v in r.items() if k not in memory_cols}
                for r in csv.DictReader(f)}


def torchrun(command: str, extra: list[str], *, wrapper: Path | None = None) -> subprocess.CompletedProcess:
    """A documented torchrun command (torchrun is `python -m torch.distributed.run`), run from the repository
    root with `extra` flags appended; `wrapper`: a script torchrun runs instead, handed run.py's path."""
    words = shlex.split(command)
    assert words[0] == "torchrun" and words[4] == "experiments/run.py", command
    script = [str(wrapper), words[4]] if wrapper else [words[4]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "KVQUANT_REFERENCE_CACHE": str(Path(extra[extra.index("--out") + 1]).parent / "reference-cache")}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *words[1:4], *script, *words[5:], *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=420,
    )


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_model_dir, tiny_corpus):
    """The reference: the sweep in one process (the reference pass computed, so its memory is measured)."""
    out = tmp_path_factory.mktemp("one") / "sweep"
    assert cli.cli([*argv_of(RESUME), *tiny(tiny_model_dir, tiny_corpus, out)]) == 0
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tiny_model_dir, tiny_corpus):
    """docs/scale.md's torchrun command: 2 CPU processes, gloo."""
    out = tmp_path_factory.mktemp("ranks") / "sweep"
    done = torchrun(TORCHRUN, tiny(tiny_model_dir, tiny_corpus, out))
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done


def test_docs_show_the_tested_commands():
    text = DOC.read_text()
    shown = [line.strip() for line in text.splitlines()  # run.py (lm-eval: test_lm_eval_parallel)
             if line.strip().startswith(("torchrun ", "python experiments/run.py"))
             and "experiments/run.py" in line]
    documented = [TORCHRUN, SLURM, K8S, MERGE, RESUME, PK_TORCHRUN, PK_SHARD, PK_MERGE, PK_ONE]
    assert sorted(shown) == sorted(documented)


def tiny_grid(model_dir, corpus, out) -> list[str]:
    """The flags appended to a documented retrieval command: the tiny model, a 2 x 2 x 2 grid."""
    return ["--model", str(model_dir), "--corpus", str(corpus), "--lengths", "160,192", "--depths", "0,1",
            "--trials", "2", "--chunk", "64", "--out", str(out)]


def grid_rows(run_dir: Path) -> dict[tuple, dict]:
    """Every measured retrieval row, less its wall-clock seconds."""
    return {res.ResultsFile.key(r): {k: v for k, v in r.items() if k != "seconds"}
            for r in res.RunResults(run_dir).rows}


def same_rows(a: Path, b: Path) -> None:
    """The two run directories' retrieval rows equal, point by point, field by field (failures named)."""
    ra, rb = grid_rows(a), grid_rows(b)
    assert sorted(ra) == sorted(rb)
    diff = {k: {f: (ra[k].get(f), rb[k].get(f)) for f in set(ra[k]) | set(rb[k])
                if ra[k].get(f) != rb[k].get(f)}
            for k in ra if ra[k] != rb[k]}
    assert not diff, f"{len(diff)} point(s) differ: {dict(list(diff.items())[:3])}"


def grid_summary(run_dir: Path) -> list[dict]:
    with (run_dir / "summary.csv").open() as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def grid_one(tmp_path_factory, tiny_model_dir, tiny_corpus):
    out = tmp_path_factory.mktemp("pk-one") / "passkey"
    assert cli.cli([*argv_of(PK_ONE), *tiny_grid(tiny_model_dir, tiny_corpus, out)]) == 0
    return out


def test_retrieval_job_array_and_merge_equal_one_process(tmp_path, grid_one, tiny_model_dir, tiny_corpus):
    out = tmp_path / "passkey"
    flags = tiny_grid(tiny_model_dir, tiny_corpus, out)
    assert cli.cli([*argv_of(PK_SHARD, {"JOB_COMPLETION_INDEX": "1"}), *flags]) == 0
    assert not (out / "report.md").exists()  # a task writes no report
    assert cli.cli([*argv_of(PK_MERGE), *flags]) == cli.EXIT_FAILED  # half the grid: partial, status 1
    assert "**partial: 12 of 24 points of the grid measured**" in (out / "report.md").read_text()
    assert cli.cli([*argv_of(PK_SHARD, {"JOB_COMPLETION_INDEX": "0"}), *flags]) == 0
    assert cli.cli([*argv_of(PK_MERGE), *flags]) == 0
    same_rows(out, grid_one)
    assert len(grid_rows(out)) == 24 and grid_summary(out) == grid_summary(grid_one)
    # one process resumes the sharded directory: everything is there, nothing is measured
    before = {p.name: p.read_bytes() for p in res.results_files(out)}
    assert cli.cli([*argv_of(PK_ONE), *flags]) == 0
    assert {p.name: p.read_bytes() for p in res.results_files(out)} == before


def test_retrieval_torchrun_ranks_equal_one_process(tmp_path, grid_one, tiny_model_dir, tiny_corpus):
    out = tmp_path / "passkey"
    done = torchrun(PK_TORCHRUN, tiny_grid(tiny_model_dir, tiny_corpus, out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in res.results_files(out)) == [
        "results.shard-0-of-2.jsonl", "results.shard-1-of-2.jsonl"]
    same_rows(out, grid_one)
    assert grid_summary(out) == grid_summary(grid_one)


def test_two_ranks_equal_one_process(one_process, two_ranks):
    out, done = two_ranks
    assert sorted(p.name for p in res.results_files(out)) == [
        "results.shard-0-of-2.jsonl", "results.shard-1-of-2.jsonl"]
    per_rank = [len(res.read_rows(p)[0]) for p in res.results_files(out)]
    assert per_rank == [POINTS // 2, POINTS // 2]  # each rank measured its half, nothing twice
    want, got = rows_of(one_process), rows_of(out)
    assert len(want) == POINTS and got.keys() == want.keys()
    assert [k for k in want if got[k] != want[k]] == []  # bit-identical: every field of every point
    assert summary_of(out) == summary_of(one_process)
    report = (out / "report.md").read_text()
    assert "partial" not in report and "**Memory: the formula" in report
    for rank in (0, 1):
        assert f"rank {rank}/2: 6 of the run's 12 points are this process's part" in done.stderr


def test_memory_columns_exist_and_are_positive(one_process):
    last = [r for r in res.RunResults(one_process).rows if r["bucket"] == "256-300"]
    assert {r["scheme"] for r in last} == {"fp16", "int8", "int4-g64"}
    for r in last:
        assert r["mem_held"] > 0 and r["mem_peak"] > 0, r
        assert r["mem_probe"].startswith("cpu: resident set")
        if r["scheme"] != "fp16":  # kvquant's pools hold at least their pages
            assert r["cache_reserved"] >= r["cache_bytes"] > 0
        else:
            assert r["cache_reserved"] is None  # a DynamicCache has no pools
    with (one_process / "summary.csv").open() as f:
        alls = [r for r in csv.DictReader(f) if r["bucket"] == "all"]
    for r in alls:
        assert float(r["mem_held_per_token"]) > 0 and float(r["mem_peak"]) > 0
        assert float(r["bytes_per_token_formula_run"]) == pytest.approx(float(r["bytes_per_token_measured"]))
        reserved, pages = float(r["bytes_per_token_reserved"]), float(r["bytes_per_token_measured"])
        assert math.isnan(reserved) if r["scheme"] == "fp16" else reserved >= pages
    report = (one_process / "report.md").read_text()
    assert "| scheme | B/token formula | B/token pages | B/token reserved | B/token measured |" in report
    assert "Measured with cpu: resident set after gc + malloc_trim" in report


KILLER = """
import os, runpy, signal, sys
from kvquant.eval import results as res

real, written = res.ResultsFile.append, []

def append(self, row):  # rank 1 dies by SIGKILL right after its first row: no cleanup, no report
    real(self, row)
    written.append(row)
    if os.environ["RANK"] == "1" and len(written) == 1:
        os.kill(os.getpid(), signal.SIGKILL)

res.ResultsFile.append = append
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_killed_rank_then_one_process_measures_only_what_is_missing(
    tmp_path, one_process, tiny_model_dir, tiny_corpus, monkeypatch
):
    out = tmp_path / "sweep"
    killer = tmp_path / "killer.py"
    killer.write_text(KILLER)
    done = torchrun(TORCHRUN, tiny(tiny_model_dir, tiny_corpus, out), wrapper=killer)
    assert done.returncode != 0  # torchrun reports the killed rank
    assert len(res.read_rows(out / "results.shard-1-of-2.jsonl")[0]) == 1
    before = rows_of(out)
    assert 1 <= len(before) < POINTS
    written = []
    real = res.ResultsFile.append
    monkeypatch.setattr(res.ResultsFile, "append", lambda self, row: (written.append(row), real(self, row)))
    assert cli.cli([*argv_of(RESUME), *tiny(tiny_model_dir, tiny_corpus, out)]) == 0  # 1 process resumes
    assert len(written) == POINTS - len(before)
    assert not {res.ResultsFile.key(r) for r in written} & before.keys()  # nothing measured twice
    assert rows_of(out) == rows_of(one_process)
    assert "partial" not in (out / "report.md").read_text()


def test_job_array_and_merge_equal_the_distributed_run(
    tmp_path, two_ranks, tiny_model_dir, tiny_corpus, capsys
):
    out = tmp_path / "sweep"
    flags = tiny(tiny_model_dir, tiny_corpus, out)
    env = {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "2"}
    assert cli.cli([*argv_of(SLURM, env), *flags]) == 0
    assert not (out / "report.md").exists()  # a task writes no report
    # a merge before every task is done: the report marked partial, status 1
    assert cli.cli([*argv_of(MERGE), *flags]) == cli.EXIT_FAILED
    assert "merge: 6 of 12 points measured" in capsys.readouterr().err
    assert "**partial: 6 of 12 points measured**" in (out / "report.md").read_text()
    assert cli.cli([*argv_of(SLURM, {**env, "SLURM_ARRAY_TASK_ID": "1"}), *flags]) == 0
    assert cli.cli([*argv_of(MERGE), *flags]) == 0
    assert "partial" not in (out / "report.md").read_text()
    assert rows_of(out) == rows_of(two_ranks[0])
    assert summary_of(out) == summary_of(two_ranks[0])
    # another world size resumes the same directory: everything is there, nothing is measured
    assert cli.cli([*argv_of(K8S, {"JOB_COMPLETION_INDEX": "1"}), *flags]) == 0
    assert sorted(p.name for p in res.results_files(out)) == [
        "results.shard-0-of-2.jsonl", "results.shard-1-of-2.jsonl"]  # the task found nothing to do
    # 4 tasks from scratch: parts cut across documents (a task measures schemes whose reference row
    # another task writes), the same numbers
    other = tmp_path / "four"
    flags = tiny(tiny_model_dir, tiny_corpus, other)
    for i in (3, 1, 0, 2):  # any order
        assert cli.cli([*argv_of(K8S, {"JOB_COMPLETION_INDEX": str(i)}), *flags]) == 0
    assert [len(res.read_rows(p)[0]) for p in res.results_files(other)] == [2, 4, 2, 4]
    assert cli.cli([*argv_of(MERGE), *flags]) == 0
    assert rows_of(other) == rows_of(two_ranks[0]) and summary_of(other) == summary_of(two_ranks[0])


def test_shard_parts_partition_the_points():
    for n in range(1, 7):
        for count in range(1, 5):
            items = list(range(n))
            parts = [Shard(i, count).part(items) for i in range(count)]
            assert [x for p in parts for x in p] == items  # contiguous, disjoint, complete
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert parse_shard(" 2 / 4 ") == Shard(2, 4) and str(Shard(2, 4)) == "2/4"
    for bad in ("2", "4/4", "-1/4", "a/b", "1/0"):
        with pytest.raises(RunError, match="--shard"):
            parse_shard(bad)


def test_sharding_refusals(tmp_path, tiny_model_dir, tiny_corpus, monkeypatch, capsys):
    with pytest.raises(RunError, match="--force"):
        RunConfig(schemes=("int8",), shard=Shard(0, 2), force=True)
    assert RunConfig(schemes=("int8",), task="passkey", merge=True).merge  # retrieval shards too (harness)
    with pytest.raises(RunError, match="without --shard"):
        RunConfig(schemes=("int8",), shard=Shard(0, 2), merge=True)
    from kvquant.eval import harness

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    role = harness.role_of(RunConfig(schemes=("int8",)))
    assert role.coordinated and role.shard == Shard(1, 2)
    assert harness.rank_device("cuda", role) == "cuda:1" and harness.rank_device("cpu", role) == "cpu"
    with pytest.raises(RunError, match="every rank on one device"):
        harness.rank_device("cuda:0", role)
    with pytest.raises(RunError, match="job arrays"):
        harness.role_of(RunConfig(schemes=("int8",), shard=Shard(0, 2)))
    monkeypatch.delenv("RANK")
    with pytest.raises(RunError, match="RANK is not set"):
        harness.role_of(RunConfig(schemes=("int8",)))
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert harness.role_of(RunConfig(schemes=("int8",), shard=Shard(1, 3))).shard == Shard(1, 3)
    # --merge into a directory no shard wrote
    assert cli.cli([*argv_of(MERGE), *tiny(tiny_model_dir, tiny_corpus, tmp_path / "none")]) == 2
    assert "holds no run (no config.json)" in capsys.readouterr().err


def test_lock_lets_the_shards_of_a_run_share_and_refuses_a_foreign_process(tmp_path):
    a = res.RunLock(tmp_path, res.shard_tag(0, 2)).acquire()
    b = res.RunLock(tmp_path, res.shard_tag(1, 2)).acquire()  # two shards side by side
    with pytest.raises(res.RunDirError, match="shard-1-of-2 is already being measured"):
        res.RunLock(tmp_path, res.shard_tag(1, 2)).acquire()
    pid = os.getpid()
    with pytest.raises(res.RunDirError, match=f"the shards of a sharded run: shard-0-of-2: pid {pid}"):
        res.RunLock(tmp_path).acquire()  # a one-process run (or --merge) waits for the shards
    assert a.shards_held() == ["shard-1-of-2"]
    b.release_shard()  # its part done (rank 0 waits for this)
    assert a.shards_held() == []
    a.release(), b.release()
    only = res.RunLock(tmp_path).acquire()
    with pytest.raises(res.RunDirError, match=f"in use by another kvquant process \\(pid {os.getpid()}"):
        res.RunLock(tmp_path, res.shard_tag(0, 2)).acquire()  # no shard beside a one-process run
    only.share(res.shard_tag(0, 2))  # torchrun's rank 0: claimed alone, then shared with its ranks
    res.RunLock(tmp_path, res.shard_tag(1, 2)).acquire().release()
    only.release()
    # --force keeps lock files and removes the shards' results
    (tmp_path / "results.shard-0-of-2.jsonl").write_text("")
    assert res.foreign_files(tmp_path) == []
    assert res.clear_run_dir(tmp_path) == ["results.shard-0-of-2.jsonl"]
    assert (tmp_path / ".kvquant.shard-1-of-2.lock").is_file()


def test_results_of_all_files_read_as_one(tmp_path, caplog):
    row = {"scheme": "int8", "mode": "cache", "doc": 0, "bucket": "0-256", "status": "ok", "nll_sum": 1.0}
    res.ResultsFile(tmp_path / "results.shard-0-of-2.jsonl").append({**row, "mem_held": 1})
    res.ResultsFile(tmp_path / "results.shard-1-of-3.jsonl").append({**row, "mem_held": 2})  # same numbers
    res.ResultsFile(tmp_path / "results.shard-2-of-3.jsonl").append({**row, "doc": 1})
    both = res.RunResults(tmp_path)
    assert len(both.rows) == 2
    assert both.has("int8", "cache", 0, "0-256") and both.has("int8", "cache", 1, "0-256")
    assert "different numbers" not in caplog.text  # measured memory differs, the point does not
    res.ResultsFile(tmp_path / "results.jsonl").append({**row, "nll_sum": 2.0})
    res.RunResults(tmp_path)
    assert "2 point(s) written twice with different numbers" in caplog.text  # results.jsonl is read first
    mine = res.RunResults(tmp_path, res.shard_tag(0, 2))
    mine.append({**row, "doc": 1})  # held by another file: not written again
    mine.append({**row, "doc": 2})
    assert len(res.read_rows(tmp_path / "results.shard-0-of-2.jsonl")[0]) == 2
