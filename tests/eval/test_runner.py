import csv
import json

import pytest
import run as cli  # experiments/run.py (tests/eval/conftest.py puts experiments/ on sys.path)
from kvquant.eval import results as res
from kvquant.eval.results import SUMMARY_COLUMNS
from kvquant.eval.runner import RunConfig, RunError, run

LENGTH = 300
SCHEMES = ("int8", "int2-g32")


def cfg(out, corpus, **kw) -> RunConfig:
    base = dict(schemes=SCHEMES, corpus=str(corpus), max_length=LENGTH, chunk=128, docs=2, out=str(out))
    base.update(kw)
    return RunConfig(**base)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model, tokenizer, tiny_corpus):
    """One uninterrupted run in both modes, shared by the checks on its files."""
    out = tmp_path_factory.mktemp("runs") / "full"
    run_dir, summary = run(cfg(out, tiny_corpus, mode="both"), model=tiny_model, tokenizer=tokenizer)
    return run_dir, summary


def test_run_directory_files(finished):
    run_dir, summary = finished
    for name in (
        "config.json",
        "results.jsonl",
        "summary.csv",
        "report.md",
        "drift_vs_length.png",
        "bytes_per_token.png",
    ):
        assert (run_dir / name).is_file(), name
    with (run_dir / "summary.csv").open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == SUMMARY_COLUMNS
        rows = list(reader)
    assert {(r["scheme"], r["mode"]) for r in rows} == {
        (s, m) for s in ("fp16", *SCHEMES) for m in ("cache", "fake")
    }
    ref = [r for r in rows if r["scheme"] == "fp16"]
    assert all(float(r["drift"]) == 0 and float(r["kl"]) == 0 and float(r["top1_agree"]) == 1 for r in ref)
    q2 = [r for r in rows if r["scheme"] == "int2-g32" and r["bucket"] == "all"]
    assert all(float(r["drift"]) != 0 and float(r["kl"]) > 0 for r in q2)
    cache8 = next(r for r in rows if r["scheme"] == "int8" and r["mode"] == "cache" and r["bucket"] == "all")
    # int8 per token at fp32: 1 byte per value + one fp32 scale per token and layer, for K and V
    assert float(cache8["bytes_per_token_formula"]) == 2 * 2 * (2 * 64 + 4)
    assert float(cache8["bytes_per_token_measured"]) == float(cache8["bytes_per_token_formula"])
    assert float(cache8["saving"]) == pytest.approx(
        2 * 2 * 2 * 64 * 4 / float(cache8["bytes_per_token_formula"])
    )
    config = json.loads((run_dir / "config.json").read_text())
    assert config["schemes"] == list(SCHEMES) and config["mode"] == "both" and "versions" in config
    report = (run_dir / "report.md").read_text()
    assert "| `int2-g32` |" in report and "llama-3-70b" in report
    lines = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 2 * 3 * 2  # modes x docs x (fp16 + 2 schemes) x buckets
    assert {"scheme", "mode", "doc", "bucket", "nll_sum", "tokens", "kl_sum", "top1", "status"} <= set(
        lines[0]
    )


def test_known_shapes_table():
    table = res.known_shapes_table([])
    # Llama-3-70B at FP16: 320 KiB per token; 100 requests x 4,096 tokens = 134.2 GB (125 GiB)
    assert "| llama-3-70b | `fp16` | 320.0 | 134.2 (125.0) | 1.00x |" in table


def test_resume_after_interruption(tmp_path, finished, tiny_model, tokenizer, tiny_corpus, monkeypatch):
    config = cfg(tmp_path / "r", tiny_corpus, mode="both")
    real_append, calls = res.ResultsFile.append, []

    def flaky(self, row):
        calls.append(row)
        if len(calls) == 7:
            raise KeyboardInterrupt
        real_append(self, row)

    monkeypatch.setattr(res.ResultsFile, "append", flaky)
    with pytest.raises(KeyboardInterrupt):
        run(config, model=tiny_model, tokenizer=tokenizer)
    kept = (tmp_path / "r" / "results.jsonl").read_text().splitlines()
    assert len(kept) == 6 and (tmp_path / "r" / "summary.csv").is_file()  # partial summary written
    monkeypatch.setattr(res.ResultsFile, "append", real_append)
    written = []
    monkeypatch.setattr(
        res.ResultsFile, "append", lambda self, row: (written.append(row), real_append(self, row))
    )
    _, summary = run(config, model=tiny_model, tokenizer=tokenizer)
    assert len(written) == 24 - 6  # measured points skipped
    assert not {(r["scheme"], r["mode"], r["doc"], r["bucket"]) for r in written} & {
        (json.loads(x)["scheme"], json.loads(x)["mode"], json.loads(x)["doc"], json.loads(x)["bucket"])
        for x in kept
    }
    full = {(r["scheme"], r["mode"], r["bucket"]): r for r in finished[1]}
    for r in summary:
        want = full[(r["scheme"], r["mode"], r["bucket"])]
        assert r["ppl"] == pytest.approx(want["ppl"], rel=1e-6) and r["kl"] == pytest.approx(
            want["kl"], abs=1e-9
        )
    # a third run finds everything measured
    written.clear()
    run(config, model=tiny_model, tokenizer=tokenizer)
    assert written == []


def test_force(tmp_path, tiny_model, tokenizer, tiny_corpus):
    out = tmp_path / "f"
    run(cfg(out, tiny_corpus, schemes=("int8",), docs=1), model=tiny_model, tokenizer=tokenizer)
    before = (out / "results.jsonl").read_text()
    with pytest.raises(RunError, match="different configuration.*--force"):
        run(cfg(out, tiny_corpus, schemes=("int4-g64",), docs=1), model=tiny_model, tokenizer=tokenizer)
    assert (out / "results.jsonl").read_text() == before  # nothing overwritten
    run(
        cfg(out, tiny_corpus, schemes=("int4-g64",), docs=1, force=True),
        model=tiny_model,
        tokenizer=tokenizer,
    )
    assert json.loads((out / "config.json").read_text())["schemes"] == ["int4-g64"]
    other = tmp_path / "not-a-run"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(RunError, match="not a kvquant run directory"):
        run(cfg(other, tiny_corpus, docs=1), model=tiny_model, tokenizer=tokenizer)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(schemes=("int5",)), "Known schemes"),
        (dict(max_length=4096), "beyond the model's 2048 positions"),
        (dict(max_length=2000), "reaches --max-length 2000"),
        (dict(model="/no/such/model"), "does not exist"),
        (dict(schemes=("int4-g48",)), "does not divide head_dim"),
    ],
)
def test_bad_inputs(tmp_path, tiny_model, tokenizer, tiny_corpus, kw, match):
    config = cfg(tmp_path / "x", tiny_corpus, **kw)
    with pytest.raises(RunError, match=match):
        if config.model:
            run(config)
        else:
            run(config, model=tiny_model, tokenizer=tokenizer)
    assert not (tmp_path / "x").exists()  # stopped before any work or file


def test_empty_corpus(tmp_path, tiny_model, tokenizer):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "empty.txt").write_text("\n")
    with pytest.raises(RunError, match="holds no text"):
        run(cfg(tmp_path / "x", tmp_path / "c"), model=tiny_model, tokenizer=tokenizer)


def test_cli_end_to_end(tmp_path, tiny_model_dir, tiny_corpus, capsys, monkeypatch):
    out = tmp_path / "cli"
    argv = [
        "--model",
        str(tiny_model_dir),
        "--corpus",
        str(tiny_corpus),
        "--schemes",
        "int8,k=int4-channel-g32,v=int4-g32,window=32",
        "--max-length",
        "256",
        "--chunk",
        "100",
        "--docs",
        "1",
        "--out",
        str(out),
        "--wandb",
        "offline",
    ]
    import kvquant.eval

    def broken_log_run(*a, **k):
        raise RuntimeError("no network")

    monkeypatch.setitem(
        __import__("sys").modules,
        "kvquant.eval.wandb_logger",
        type("M", (), {"log_run": staticmethod(broken_log_run)}),
    )
    assert kvquant.eval is not None
    assert cli.cli(argv) == 0  # a W&B failure is only a warning
    printed = capsys.readouterr().out
    assert "| `k=int4-channel-g32,v=int4-g32,window=32` |" in printed and "| `int8` |" in printed
    assert (out / "summary.csv").is_file()
    assert cli.cli(argv) == 0  # resumes: nothing left to measure
    assert (
        cli.cli(["--model", str(tmp_path / "missing"), "--scheme", "int8", "--out", str(tmp_path / "m")]) == 2
    )


def test_split_schemes_and_list(capsys):
    assert cli.split_schemes("int8,k=int4-channel-g64,v=int4-g64,sink=4,window=128,kivi-2") == [
        "int8",
        "k=int4-channel-g64,v=int4-g64,sink=4,window=128",
        "kivi-2",
    ]
    assert cli.cli(["--list-schemes"]) == 0
    out = capsys.readouterr().out
    assert "kivi-2" in out and "hf-quanto-int4" in out
