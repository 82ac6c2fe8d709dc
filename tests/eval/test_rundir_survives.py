"""Run directories that survive concurrency, corruption and --force (issue 21's reproducers, each small):
a second process is refused with the holder's pid; torn, foreign, duplicated and edited results.jsonl lines
are detected on resume; --force removes only kvquant's files; SIGTERM writes the partial report as Ctrl-C;
the serving simulation resumes measuring only the rows missing. Tiny model, a stub tokenizer, 300 tokens."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvquant.eval import results as res
from kvquant.eval import serve
from kvquant.eval.runner import RunConfig, RunError, RunInterrupted, run

LENGTH = 300
POINTS = 4  # 1 document x (reference + int8) x 2 buckets (0-256, 256-300)


class StubTokenizer:
    """Text -> ids without a vocabulary file (one id per word, hashed into the tiny model's vocabulary)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + sum(map(ord, w)) * 7919 % 5000 for w in text.split()]}


TOK = StubTokenizer()


def cfg(out, corpus, **kw) -> RunConfig:
    base = dict(schemes=("int8",), corpus=str(corpus), max_length=LENGTH, chunk=128, docs=1, out=str(out))
    return RunConfig(**(base | kw))


def go(config, model):
    return run(config, model=model, tokenizer=TOK)


@pytest.fixture(scope="module")
def done(tmp_path_factory, tiny_model, tiny_corpus):
    """A finished run: (its directory, results.jsonl bytes, summary.csv text)."""
    out = tmp_path_factory.mktemp("rundir") / "run"
    go(cfg(out, tiny_corpus), tiny_model)
    return out, (out / "results.jsonl").read_bytes(), (out / "summary.csv").read_text()


def copy_run(done, tmp_path) -> Path:
    import shutil

    out = tmp_path / "run"
    shutil.copytree(done[0], out)
    return out


def appended(monkeypatch) -> list[dict]:
    """Rows kvquant writes from now on (through ResultsFile.append)."""
    written, real = [], res.ResultsFile.append
    monkeypatch.setattr(res.ResultsFile, "append", lambda self, r: (written.append(r), real(self, r))[1])
    return written


def valid_rows(path: Path) -> list[dict]:
    return res.ResultsFile(path).rows


# ------------------------------------------------------------------------------------------------ the lock

# the first writer of a run directory: it holds the lock and has written its config.json, as runner does
_HOLDER = """
import sys, time
from pathlib import Path
from kvquant.eval.results import RunLock
lock = RunLock(sys.argv[1]).acquire()
(Path(sys.argv[1]) / "config.json").write_text('{"identity": {}}')
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_process_is_refused_with_the_holders_pid(tmp_path, tiny_model, tiny_corpus):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        with pytest.raises(RunError, match=rf"in use by another kvquant process \(pid {holder.pid} on ") as e:
            go(cfg(out, tiny_corpus), tiny_model)
        assert time.monotonic() - t0 < 60  # refused at once, not after waiting for the holder
        assert "rerun to resume" in str(e.value) and "--out" in str(e.value)
        assert not (out / "results.jsonl").exists()
    finally:
        holder.kill()  # kill -9: the kernel drops its lock, the stale lock file blocks nobody
        holder.wait()
    with pytest.raises(RunError, match="different configuration"):  # the lock is free: the next check
        go(cfg(out, tiny_corpus), tiny_model)
    go(cfg(out, tiny_corpus, force=True), tiny_model)  # the holder's files are kvquant's: --force clears them
    assert len(valid_rows(out / "results.jsonl")) == POINTS
    assert json.loads((out / res.LOCK_NAME).read_text())["pid"] == os.getpid()


def test_serve_refuses_a_locked_directory(tmp_path):
    out = tmp_path / "serve"
    out.mkdir()
    with res.RunLock(out):  # another open file description: flock refuses it even in this process
        config = serve.ServeConfig(schemes=("fp16",), requests=2, context=32, out=str(out))
        busy = rf"in use by another kvquant process \(pid {os.getpid()} "
        with pytest.raises(serve.ServeError, match=busy):
            serve.run(config, model=None, tokenizer=None)


# ------------------------------------------------------------------------------------------ corrupt lines


def _without_measured_memory(summary_csv: str) -> list[dict]:
    """summary.csv rows without the columns the process measures (resident memory varies between runs)."""
    import csv
    import io

    measured = ("mem_held_per_token", "mem_peak")
    rows = csv.DictReader(io.StringIO(summary_csv))
    return [{k: v for k, v in r.items() if k not in measured} for r in rows]


def test_torn_last_line_is_measured_again_on_its_own_line(done, tmp_path, tiny_model, tiny_corpus, caplog):
    out = copy_run(done, tmp_path)
    lines = done[1].splitlines(keepends=True)
    (out / "results.jsonl").write_bytes(b"".join(lines[:-1]) + lines[-1][:25])  # kill -9 mid-write
    with caplog.at_level(logging.WARNING):
        go(cfg(out, tiny_corpus), tiny_model)
    warned = [r for r in caplog.records if "results.jsonl" in r.getMessage()]
    # read when the run resumes and again for the summary: the same warning each time, never a traceback
    assert warned and len({r.getMessage() for r in warned}) == 1 and len(warned) <= 2
    assert "line 4: not JSON" in warned[0].getMessage() and not any(r.exc_info for r in warned)
    text = (out / "results.jsonl").read_bytes()
    assert text.splitlines()[3] == lines[-1][:25]  # the torn text stays alone on its line ...
    rows = valid_rows(out / "results.jsonl")
    assert len(rows) == POINTS and len(text.splitlines()) == POINTS + 1  # ... and the point has its own
    # the point measured again gives the same numbers; only the process's measured memory differs
    assert _without_measured_memory((out / "summary.csv").read_text()) == _without_measured_memory(done[2])
    assert "partial" not in (out / "report.md").read_text()


FOREIGN = [b"null\n", b"42\n", b"{}\n", b"{}", b"[1, 2]\n", b'"text"\n', b"\xff\xfe\n", b'{"scheme": [1]}\n']


@pytest.mark.parametrize("last", FOREIGN)
def test_a_foreign_last_line_is_ignored(done, tmp_path, tiny_model, tiny_corpus, last, caplog, monkeypatch):
    out = copy_run(done, tmp_path)
    (out / "results.jsonl").write_bytes(done[1] + last)
    written = appended(monkeypatch)
    with caplog.at_level(logging.WARNING):
        go(cfg(out, tiny_corpus), tiny_model)  # no traceback
    assert written == []  # every point is there
    assert any("line 5" in r.getMessage() and "ignored" in r.getMessage() for r in caplog.records)
    assert (out / "summary.csv").read_text() == done[2]


def test_duplicated_rows_leave_the_summary_unchanged(done, tmp_path, tiny_model, tiny_corpus, monkeypatch):
    out = copy_run(done, tmp_path)
    (out / "results.jsonl").write_bytes(done[1] + done[1])  # two processes' worth of the same points
    written = appended(monkeypatch)
    go(cfg(out, tiny_corpus), tiny_model)
    assert written == [] and len(valid_rows(out / "results.jsonl")) == POINTS
    assert (out / "summary.csv").read_text() == done[2]


def test_a_conflicting_duplicate_is_logged_the_first_kept(done, tmp_path, tiny_model, tiny_corpus, caplog):
    out = copy_run(done, tmp_path)
    row = json.loads(done[1].splitlines()[1])
    row["nll_sum"] *= 2  # a different measurement of the same point, with a valid digest
    with (out / "results.jsonl").open("a") as f:
        f.write(res.encode_row(row) + "\n")
    with caplog.at_level(logging.WARNING):
        go(cfg(out, tiny_corpus), tiny_model)
    assert "1 conflicting duplicate point(s), the first kept" in caplog.text
    assert (out / "summary.csv").read_text() == done[2]


def test_an_edited_row_is_detected_and_measured_again(
    done, tmp_path, tiny_model, tiny_corpus, caplog, monkeypatch
):
    out = copy_run(done, tmp_path)
    lines = done[1].decode().splitlines()
    row = json.loads(lines[1])
    assert res.CHECK_FIELD in row
    row["nll_sum"] += 1.0  # edited by hand, the digest kept
    lines[1] = json.dumps(row)
    (out / "results.jsonl").write_text("\n".join(lines) + "\n")
    written = appended(monkeypatch)
    with caplog.at_level(logging.WARNING):
        go(cfg(out, tiny_corpus), tiny_model)
    assert "line 2: checksum mismatch (edited or damaged)" in caplog.text
    assert [(r["scheme"], r["bucket"]) for r in written] == [(row["scheme"], row["bucket"])]
    assert (out / "summary.csv").read_text() == done[2]  # the edit changed nothing reported


def test_rows_written_before_digests_still_load(done, tmp_path, tiny_model, tiny_corpus, monkeypatch):
    out = copy_run(done, tmp_path)
    old = [{k: v for k, v in json.loads(x).items() if k != res.CHECK_FIELD} for x in done[1].splitlines()]
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    written = appended(monkeypatch)
    go(cfg(out, tiny_corpus), tiny_model)
    assert written == [] and (out / "summary.csv").read_text() == done[2]


# -------------------------------------------------------------------------------------------------- --force


def test_force_refuses_a_folder_with_foreign_files_deletes_nothing(done, tmp_path, tiny_model, tiny_corpus):
    out = copy_run(done, tmp_path)
    (out / "notes.txt").write_text("mine")
    (out / "photos").mkdir()
    (out / "photos" / "a.jpg").write_bytes(b"\xff\xd8")
    (out / "tokens" / "readme.txt").write_text("mine too")
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    with pytest.raises(RunError, match="kvquant did not write") as e:
        go(cfg(out, tiny_corpus, schemes=("int4-g64",), force=True), tiny_model)
    message = str(e.value)
    assert "notes.txt" in message and "photos/" in message and "tokens/readme.txt" in message
    assert "nothing was deleted" in message and "delete" not in message.replace("nothing was deleted", "")
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
    assert (out / "results.jsonl").read_bytes() == done[1]


def test_a_folder_that_is_not_a_run_is_refused_untouched(tmp_path, tiny_model, tiny_corpus):
    from kvquant.eval import harness

    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(RunError, match="not a kvquant run directory.*notes.txt") as e:
        go(cfg(other, tiny_corpus, force=True), tiny_model)
    for force in (False, True):  # without --force config.check_out refuses first; the run directory too
        with pytest.raises(RunError, match="not a kvquant run directory.*notes.txt") as e:
            harness.prepare_dir(other, {"identity": {}}, {}, force)
        assert "pass --force" not in str(e.value)
    assert [p.name for p in other.iterdir()] == ["notes.txt"]  # not even a lock file


def test_force_over_a_pure_kvquant_folder_starts_over(done, tmp_path, tiny_model, tiny_corpus, monkeypatch):
    out = copy_run(done, tmp_path)
    (out / "config.tmp").write_text("{")  # what an atomic write cut short leaves: kvquant's too
    written = appended(monkeypatch)
    go(cfg(out, tiny_corpus, schemes=("int4-g64",), force=True), tiny_model)
    assert len(written) == POINTS and not (out / "config.tmp").exists()
    assert json.loads((out / "config.json").read_text())["schemes"] == ["int4-g64"]
    assert {r["scheme"] for r in valid_rows(out / "results.jsonl")} == {"fp16", "int4-g64"}
    assert res.foreign_files(out) == []


# ----------------------------------------------------------------------------------------------- SIGTERM


def test_sigterm_writes_the_partial_report_as_ctrl_c(tmp_path, tiny_model, tiny_corpus, monkeypatch):
    out = tmp_path / "run"
    real, rows = res.ResultsFile.append, []

    def append_then_term(self, row):
        real(self, row)
        rows.append(row)
        if len(rows) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # as `timeout` sends it

    monkeypatch.setattr(res.ResultsFile, "append", append_then_term)
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RunInterrupted) as stop:
        go(cfg(out, tiny_corpus, docs=2), tiny_model)
    assert signal.getsignal(signal.SIGTERM) is previous  # the handler is restored
    assert (stop.value.progress.measured, stop.value.progress.total) == (2, 2 * POINTS)
    assert "**partial: 2 of 8 points measured**" in (out / "report.md").read_text()
    assert (out / "summary.csv").is_file() and (out / "drift_vs_length.png").is_file()
    monkeypatch.setattr(res.ResultsFile, "append", real)
    go(cfg(out, tiny_corpus, docs=2), tiny_model)  # and the same command resumes
    assert len(valid_rows(out / "results.jsonl")) == 2 * POINTS


# ------------------------------------------------------------------------------------------------- serving


def _serve_config(out: Path, **kw) -> serve.ServeConfig:
    base = dict(
        schemes=("fp16",), requests=2, context=32, reply=2, policies=("lru",), fit_fp16_requests=1,
        fit_max=4, out=str(out),
    )
    return serve.ServeConfig(**(base | kw))


def test_serve_resumes_after_kill_9_measuring_only_missing_rows(tmp_path, tiny_model, monkeypatch):
    out = tmp_path / "serve"
    config = _serve_config(out)
    _, first = serve.run(config, model=tiny_model, tokenizer=TOK)
    assert len(first) == 3  # off/none, radix/none, radix/lru
    lines = (out / "results.jsonl").read_bytes().splitlines(keepends=True)
    kept = [n for n, x in enumerate(lines) if json.loads(x)["kind"] == "row"][0] + 1
    cut = lines[:kept] + lines[kept : kept + 3] + [lines[kept + 3][:17]]  # row 2 half written, torn
    (out / "results.jsonl").write_bytes(b"".join(cut))
    (out / "summary.csv").unlink()
    simulated = []
    real = serve.simulate
    monkeypatch.setattr(serve, "simulate", lambda *a, **k: (simulated.append(a[-1]), real(*a, **k))[1])
    _, second = serve.run(config, model=tiny_model, tokenizer=TOK)
    assert [(d["prefix_cache"], d["policy"]) for d in simulated] == [("radix", "none"), ("radix", "lru")]
    assert second[0] == first[0]  # the kept row, as measured
    assert [(r["scheme"], r["prefix_cache"], r["policy"]) for r in second] == [
        (r["scheme"], r["prefix_cache"], r["policy"]) for r in first
    ]
    done = serve.completed(out)
    assert len(done) == 3 and len({r["attempt"] for r in done.values()}) == 3
    assert (out / "summary.csv").is_file() and "partial" not in (out / "report.md").read_text()
    simulated.clear()
    serve.run(config, model=tiny_model, tokenizer=TOK)  # complete: nothing measured
    assert simulated == []


def test_serve_force_removes_only_its_files(tmp_path, tiny_model):
    out = tmp_path / "serve"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(serve.ServeError, match="not a kvquant run directory.*notes.txt"):
        serve.check_config(_serve_config(out, force=True))
    (out / "notes.txt").unlink()
    config = _serve_config(out, policies=())
    serve.run(config, model=tiny_model, tokenizer=TOK)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(serve.ServeError, match="kvquant did not write \\(notes.txt\\); nothing was deleted"):
        serve.run(_serve_config(out, policies=(), force=True), model=tiny_model, tokenizer=TOK)
    assert (out / "notes.txt").is_file() and (out / "results.jsonl").is_file()
    (out / "notes.txt").unlink()
    _, summary = serve.run(_serve_config(out, policies=(), force=True), model=tiny_model, tokenizer=TOK)
    assert len(summary) == 2 and len(serve.completed(out)) == 2
