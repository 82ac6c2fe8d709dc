"""The one run harness (`kvquant.eval.harness`): a toy task's work divided among job-array shards and merged
equals one process, a resume at another world size measures only what is missing, W&B modes that cannot log
are refused before any work (every task: perplexity, retrieval, serving), and a report outside a git
checkout is written. No model: the toy task measures arithmetic."""

from __future__ import annotations

import json

import pytest
from kvquant.eval import harness
from kvquant.eval import results as res
from kvquant.eval.config import Progress, RunConfig, RunError, RunIncomplete, Shard

MODES = ("cache",)
DOCS = (0, 1, 2)
LABELS = ("fp16", "int8", "int4-g64")


class Toy:
    """A task supplying only what it measures: a point (label, mode, doc, "all") per unit; its value is a
    function of the point alone, as a real point's numbers are."""

    def __init__(self, run_dir):
        self.run_dir = run_dir
        self.measured: list = []
        self.points = [(label, mode, doc, "all") for mode in MODES for doc in DOCS for label in LABELS]

    def work(self) -> harness.Work:
        return harness.Work(
            units=self.points,
            points=self.points,
            points_of=lambda mine: [p for p in self.points if p in mine],
            unit_done=lambda results, p: results.has(*p),
            measure=self.measure,
            write_outputs=self.write_outputs,
        )

    def measure(self, results, mine) -> None:
        for p in self.points:
            if p in mine and not results.has(*p):
                self.measured.append(p)
                label, mode, doc, bucket = p
                results.append({"scheme": label, "mode": mode, "doc": doc, "bucket": bucket, "status": "ok",
                                "value": len(label) * 10 + doc})

    def write_outputs(self, rows, progress: Progress) -> list[dict]:
        summary = sorted(({"scheme": r["scheme"], "doc": r["doc"], "value": r["value"]} for r in rows
                          if r.get("status") == "ok"), key=lambda r: (r["scheme"], r["doc"]))
        (self.run_dir / "report.md").write_text(f"{progress}\n{json.dumps(summary)}\n")
        return summary


def go(tmp, name: str, **kw):
    run_dir = tmp / name
    config = RunConfig(schemes=("int8",), out=str(run_dir), **kw)
    toy = Toy(run_dir)
    identity = {"toy": 1}
    role = harness.role_of(config)
    return harness.execute(config, role, run_dir, {"identity": identity}, identity, toy.work()), toy


def test_shards_then_merge_equal_one_process(tmp_path):
    (one_dir, one), toy = go(tmp_path, "one")
    assert len(toy.measured) == 9 and len(one) == 9
    parts = []
    for i in (1, 0):  # any order
        (_, part), toy = go(tmp_path, "arr", shard=Shard(i, 2))
        assert part == [] and not (tmp_path / "arr" / "report.md").exists()  # a shard writes no report
        parts.append(set(toy.measured))
    assert sorted(map(len, parts)) == [4, 5] and not parts[0] & parts[1]  # a partition of the 9 points
    (_, merged), toy = go(tmp_path, "arr", merge=True)
    assert toy.measured == [] and merged == one
    assert sorted(p.name for p in res.results_files(tmp_path / "arr")) == [
        "results.shard-0-of-2.jsonl", "results.shard-1-of-2.jsonl"]


def test_a_merge_with_a_shard_missing_writes_a_partial_report_and_says_so(tmp_path):
    go(tmp_path, "arr", shard=Shard(0, 3))
    with pytest.raises(RunIncomplete, match="3 of 9"):
        go(tmp_path, "arr", merge=True)
    assert (tmp_path / "arr" / "report.md").read_text().startswith("3 of 9")


def test_a_resume_at_another_world_size_measures_only_what_is_missing(tmp_path):
    go(tmp_path, "r", shard=Shard(1, 3))
    (_, summary), toy = go(tmp_path, "r")  # one process now: the other two thirds
    assert len(toy.measured) == 6 and len(summary) == 9
    (_, again), toy = go(tmp_path, "r", shard=Shard(0, 2))
    assert toy.measured == []  # everything is there, whatever the division


def test_units_in_order():
    assert harness.units_in_order([("a", "m", 0, "x"), ("a", "m", 0, "y"), ("b", "m", 0, "x")],
                                  lambda p: (p[1], p[2], p[0])) == [("m", 0, "a"), ("m", 0, "b")]


# ---------------------------------------------------------------------------------------------------- W&B


@pytest.fixture
def no_credentials(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("")
    monkeypatch.setenv("NETRC", str(netrc))
    return netrc


def test_wandb_modes_that_cannot_log_are_refused(no_credentials, monkeypatch):
    harness.check_wandb("disabled")
    harness.check_wandb("offline")  # wandb is installed here; offline needs no account
    with pytest.raises(RunError, match="wandb login.*--wandb offline"):
        harness.check_wandb("online")
    no_credentials.write_text("machine api.wandb.ai login user password abc\n")
    harness.check_wandb("online")
    monkeypatch.setattr(harness.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RunError, match="pip install wandb"):
        harness.check_wandb("offline")


@pytest.mark.parametrize("task", ["ppl", "passkey"])
def test_run_py_refuses_wandb_online_before_any_work(task, no_credentials, monkeypatch, capsys):
    import kvquant.eval.runner as runner
    import run as cli  # experiments/run.py

    with pytest.raises(RunError, match="no W&B credentials"):  # the API, before loading anything
        runner.run(RunConfig(schemes=("int8",), task=task, wandb="online"))

    def no_run(*a, **k):
        raise AssertionError("the run started")

    monkeypatch.setattr(runner, "run", no_run)
    assert cli.cli(["--task", task, "--scheme", "int8", "--wandb", "online"]) == 2
    assert "--wandb online: no W&B credentials" in capsys.readouterr().err


def test_serve_refuses_wandb_online_before_any_work(no_credentials):
    from kvquant.eval.serve import ServeConfig, ServeError, check_config

    with pytest.raises(ServeError, match="no W&B credentials"):
        check_config(ServeConfig(schemes=("int8",), wandb="online"))


def test_log_wandb_failure_is_a_warning(tmp_path, caplog):
    harness.log_wandb(tmp_path, "disabled")  # nothing, not even a read
    harness.log_wandb(tmp_path / "missing", "offline")  # no config.json: logged as a warning
    assert "W&B logging failed (local results are intact" in caplog.text


def test_report_outside_a_git_checkout():
    lines = res.provenance_lines({"versions": {"torch": "2"}, "git_commit": None}, Progress(1, 1))
    assert "commit unknown (not a git checkout)" in lines[1]
