"""experiments/run.py as a user meets it: bad input fails at once with one line (exit 2) before torch or
transformers are imported; Ctrl-C writes what was measured, marks it partial and exits 130; a rerun says
what it resumes. No check depends on how fast the machine is: work is bounded by size, and the one wait
(for a subprocess to reach its first point) has a 20-minute limit that only catches a hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import run as cli  # experiments/run.py (tests/eval/conftest.py puts experiments/ on sys.path)
from kvquant.eval.config import RunConfig, RunError

REPO = Path(__file__).resolve().parents[2]
HANG_LIMIT_S = 20 * 60  # generous: only a hang reaches it
HEAVY = ("torch", "transformers", "lm_eval", "wandb", "datasets", "matplotlib")


@pytest.fixture(scope="module")
def bad_paths(tmp_path_factory) -> dict[str, Path]:
    """Files and folders that look like a model, corpus or run directory but are not."""
    root = tmp_path_factory.mktemp("bad")
    (root / "weights.bin").write_bytes(b"\0")
    (root / "fake.gguf").write_bytes(b"not a gguf")
    (root / "no-config").mkdir()
    (root / "config-only").mkdir()
    (root / "config-only" / "config.json").write_text("{}")
    (root / "no-tokenizer").mkdir()
    (root / "no-tokenizer" / "config.json").write_text("{}")
    (root / "no-tokenizer" / "model.safetensors").write_bytes(b"\0")
    (root / "table.csv").write_text("a,b\n")
    (root / "empty-corpus").mkdir()
    (root / "out-file").write_text("x")
    (root / "someones-folder").mkdir()
    (root / "someones-folder" / "notes.txt").write_text("mine")
    return {p.name: p for p in root.iterdir()}


def bad_cli_cases(p: dict[str, Path], corpus: Path) -> list[tuple[list[str], str]]:
    """(argv, what the one-line error must say): usage errors and inputs refused before any heavy import."""
    s = ["--scheme", "int4-g64", "--corpus", str(corpus)]
    return [
        ([], "name at least one scheme"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--scheme", "int5"], "Known schemes and presets"),
        (["--scheme", "int4-g64x"], "unknown option -g64x"),
        (["--schemes", "int8,kivi-9"], "kivi-9"),
        (["--scheme", "k=int4-g64"], "k= needs a matching v="),
        (["--scheme", "int4-g64,window=-1"], "window"),
        (["--scheme", "hf-quanto-int3"], "quanto: int2/int4"),
        (["--scheme", "hf-nope-int4"], "unknown peer backend 'nope'"),
        ([*s, "--max-length", "0"], "--max-length 0 must be at least 2"),
        ([*s, "--max-length", "1"], "--max-length 1 must be at least 2"),
        ([*s, "--max-length", "-5"], "--max-length -5 must be at least 2"),
        ([*s, "--max-length", "abc"], "invalid int value: 'abc'"),
        ([*s, "--chunk", "0"], "--chunk 0 must be at least 1"),
        ([*s, "--noise-floor", "--chunk", "1"], "--noise-floor needs --chunk >= 2"),
        ([*s, "--chunk", "-3"], "--chunk -3 must be at least 1"),
        ([*s, "--docs", "0"], "--docs 0 must be at least 1"),
        ([*s, "--tokens", "0"], "--tokens 0 must be at least 1"),
        ([*s, "--docs", "1", "--tokens", "100"], "not allowed with argument"),
        ([*s, "--mode", "slow"], "invalid choice: 'slow'"),
        ([*s, "--dtype", "float8"], "unknown dtype 'float8'"),
        ([*s, "--device", "tpu"], "unknown device 'tpu'"),
        ([*s, "--wandb", "maybe"], "invalid choice: 'maybe'"),
        ([*s, "--model", "/no/such/model"], "does not exist"),
        ([*s, "--model", str(p["weights.bin"])], "not a .gguf"),
        ([*s, "--model", str(p["fake.gguf"])], "not a GGUF file"),
        ([*s, "--model", str(p["no-config"])], "has no config.json"),
        ([*s, "--model", str(p["config-only"])], "no weights"),
        ([*s, "--model", str(p["no-tokenizer"])], "no tokenizer files"),
        (["--scheme", "int8", "--corpus", "wikipedai"], "did you mean 'wikipedia'"),
        (["--scheme", "int8", "--corpus", "/no/such.txt"], "does not exist"),
        (["--scheme", "int8", "--corpus", str(p["table.csv"])], "neither text"),
        (["--scheme", "int8", "--corpus", str(p["empty-corpus"])], "no .txt"),
        ([*s, "--out", str(p["out-file"])], "is a file"),
        ([*s, "--out", str(p["someones-folder"])], "not a kvquant run directory"),
    ]


_PROBE = """
import contextlib, io, json, sys
sys.path.insert(0, {experiments!r})
import run
out = []
for argv in json.loads(sys.stdin.read()):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = run.cli(argv)
        except SystemExit as e:  # argparse
            rc = e.code
    out.append([rc, err.getvalue()])
print(json.dumps({{"results": out, "heavy": [m for m in {heavy!r} if m in sys.modules]}}))
"""


def test_bad_cli_inputs_fail_at_once_without_heavy_imports(bad_paths, tiny_corpus):
    """Every case in one fresh interpreter: exit 2, a one-line message saying what is wrong, no traceback,
    and torch, transformers, lm-eval, wandb, datasets and matplotlib never imported."""
    cases = bad_cli_cases(bad_paths, tiny_corpus)
    assert len(cases) >= 30
    code = _PROBE.format(experiments=str(REPO / "experiments"), heavy=HEAVY)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps([argv for argv, _ in cases]),
        capture_output=True,
        text=True,
        timeout=HANG_LIMIT_S,
        cwd=bad_paths["someones-folder"].parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for (argv, want), (rc, err) in zip(cases, report["results"], strict=True):
        assert rc == 2, (argv, rc, err)
        assert want in err, (argv, err)
        assert "Traceback" not in err, (argv, err)
        first = err.strip().splitlines()[0]
        assert first.startswith("error: ") or ": error: " in first, (argv, err)
    assert report["heavy"] == []


def test_unknown_scheme_from_the_shell(tmp_path):
    """The script itself, as typed: one message, exit 2, and -X importtime shows no torch import."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", str(REPO / "experiments" / "run.py"), "--scheme", "int5"],
        capture_output=True,
        text=True,
        timeout=HANG_LIMIT_S,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    imports = [ln for ln in proc.stderr.splitlines() if ln.startswith("import time:")]
    messages = [ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:")]
    assert imports and not [ln for ln in imports if ln.split("|")[-1].strip() in ("torch", "transformers")]
    assert messages[0].startswith("error: bad scheme 'int5'") and "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing written


def test_flags_are_never_silently_replaced():
    parse = cli.build_parser().parse_args
    config = cli.config_from_args(parse(["--scheme", "int8"]))
    assert (config.max_length, config.chunk, config.docs) == (8192, 1024, None)
    quick = cli.config_from_args(parse(["--scheme", "int8", "--quick", "--max-length", "300"]))
    assert (quick.max_length, quick.chunk, quick.docs) == (300, 256, 1)  # an explicit flag wins over --quick
    with pytest.raises(RunError, match="--max-length 0 must be at least 2"):
        cli.config_from_args(parse(["--scheme", "int8", "--quick", "--max-length", "0"]))
    with pytest.raises(RunError, match="--chunk 0"):
        cli.config_from_args(parse(["--scheme", "int8", "--chunk", "0"]))


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the message for a device that is absent"
)
def test_unavailable_device_is_refused_before_loading(tmp_path, tiny_model_dir, tiny_corpus, capsys):
    argv = ["--scheme", "int8", "--model", str(tiny_model_dir), "--corpus", str(tiny_corpus)]
    argv += ["--max-length", "300"]  # within the tiny model's 2,048 positions (8,192 is refused first)
    assert cli.cli([*argv, "--device", "cuda", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device cuda: torch") and "sees no CUDA device; use --device cpu" in err
    assert "Traceback" not in err and not (tmp_path / "r").exists()


def test_ctrl_c_before_measuring_is_one_line(monkeypatch, tiny_corpus, capsys):
    import kvquant.eval.runner as runner

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run", interrupted)
    assert cli.cli(["--scheme", "int8", "--corpus", str(tiny_corpus)]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "interrupted; rerun the same command to resume (measured points are kept)"


# A real process and a real SIGINT. The child's ResultsFile.append blocks after its 3rd point (and says so
# in a marker file), so the signal always lands mid-run however fast or slow the machine is.
_CHILD = """
import signal, sys, time
from pathlib import Path
signal.signal(signal.SIGINT, signal.default_int_handler)  # ignored in a background job
sys.path.insert(0, {experiments!r})
import run
from kvquant.eval import results
append, marker = results.ResultsFile.append, Path({marker!r})
def blocking_append(self, row):
    append(self, row)
    if len(self.rows) == 3 and not marker.exists():
        marker.write_text("3")
        time.sleep({hang_limit})
results.ResultsFile.append = blocking_append
sys.exit(run.cli({argv!r}))
"""


def _start_and_interrupt(tmp_path: Path, argv: list[str]) -> subprocess.CompletedProcess:
    marker = tmp_path / "reached-3-points"
    code = _CHILD.format(
        experiments=str(REPO / "experiments"), marker=str(marker), argv=argv, hang_limit=HANG_LIMIT_S
    )
    env = {**os.environ, "TQDM_DISABLE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    deadline = time.monotonic() + HANG_LIMIT_S
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the child never reached its 3rd point"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=HANG_LIMIT_S)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow  # two fresh interpreters that import torch and transformers
def test_ctrl_c_writes_a_partial_run_and_a_rerun_resumes(tmp_path, tiny_model_dir, tiny_corpus):
    out = tmp_path / "run"
    argv = [
        "--model",
        str(tiny_model_dir),
        "--corpus",
        str(tiny_corpus),
        "--schemes",
        "int8,kivi-2",
        "--max-length",
        "300",
        "--chunk",
        "100",
        "--docs",
        "2",
        "--out",
        str(out),
    ]
    total = 2 * 3 * 2  # documents x (fp16 + 2 schemes) x buckets (0-256, 256-300)
    stopped = _start_and_interrupt(tmp_path, argv)
    assert stopped.returncode == 130, stderr_tail(stopped)
    assert "Traceback" not in stopped.stderr
    last = stopped.stderr.strip().splitlines()[-1]
    assert (
        last
        == f"interrupted: 3 of {total} points measured and written to {out}; rerun the same command to resume"
    )
    report = (out / "report.md").read_text()
    assert f"**partial: 3 of {total} points measured**" in report
    assert len((out / "results.jsonl").read_text().splitlines()) == 3
    assert (out / "drift_vs_length.png").is_file() and (out / "bytes_per_token.png").is_file()

    again = subprocess.run(
        [sys.executable, str(REPO / "experiments" / "run.py"), *argv],
        capture_output=True,
        text=True,
        timeout=HANG_LIMIT_S,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    assert again.returncode == 0, stderr_tail(again)
    assert f"resuming: 3 of {total} points already measured in {out}" in again.stderr
    assert "9 to measure in 2 document(s)" in again.stderr
    assert "1 of them were cut off and are recomputed from their first token" in again.stderr
    assert "partial" not in (out / "report.md").read_text()
    assert "| `kivi-2` |" in again.stdout  # the preset's name, not its expansion
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == total and len({(r["scheme"], r["doc"], r["bucket"]) for r in rows}) == total


def stderr_tail(proc) -> str:
    return proc.stderr[-3000:]


def test_config_types_and_values_api():
    with pytest.raises(TypeError, match="tuple of scheme strings.*not str 'int8'"):
        RunConfig(schemes="int8")
    with pytest.raises(TypeError, match="--max-length must be an int, not str '512'"):
        RunConfig(schemes=("int8",), max_length="512")
    with pytest.raises(TypeError, match="--chunk must be an int, not bool"):
        RunConfig(schemes=("int8",), chunk=True)
    with pytest.raises(RunError, match="give --docs or --tokens, not both"):
        RunConfig(schemes=("int8",), docs=1, tokens=10)
    assert RunConfig(schemes=["int8"]).schemes == ("int8",)
