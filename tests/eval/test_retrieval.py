"""Retrieval under a quantized cache (kvquant.eval.retrieval): the probes are what they claim (exact length,
the key at its depth, one key per trial at every length), scoring through a cache equals free greedy decoding,
an unquantized scheme through kvquant's cache scores as the reference does, and `--task passkey|needle`
writes a run directory that resumes. On the tiny random model, with the real tokenizer."""

from __future__ import annotations

import csv
import dataclasses
import json

import pytest
import run as cli  # experiments/run.py (tests/eval/conftest.py puts experiments/ on sys.path)
import torch
from kvquant.eval import metrics
from kvquant.eval.config import RunConfig, RunError
from kvquant.eval.measure import REFERENCE
from kvquant.eval.retrieval import (
    _trials_per_cell,
    cell_label,
    filler_tokens,
    make_probe,
    score_probe,
    summarize_retrieval,
)
from kvquant.eval.runner import run
from kvquant.eval.schemes import parse_eval_scheme


@pytest.fixture(scope="module")
def filler(tokenizer, tiny_corpus) -> list[int]:
    return filler_tokens(tokenizer, str(tiny_corpus))


@pytest.mark.parametrize("task", ["passkey", "needle"])
def test_probe_holds_the_key_at_its_depth(task, tokenizer, filler):
    probes = {
        (L, d): make_probe(task, tokenizer, filler, L, d, trial=1, seed=3)
        for L in (160, 256)
        for d in (0.0, 0.5, 1.0)
    }
    answers = {p.answer for p in probes.values()}
    assert len(answers) == 1  # one key per trial, at every length and depth
    for (L, d), p in probes.items():
        assert len(p.ids) == L and p.cell == cell_label(L, d)
        text = tokenizer.decode(p.ids[p.needle_at :])
        key = p.answer.strip()
        assert key in text and key not in tokenizer.decode(p.ids[: p.needle_at])
        # the answer's ids are how the tokenizer reads the key after the question (no lone-space token)
        assert tokenizer.decode(list(p.ids) + list(p.answer_ids)).endswith(key)
        assert tokenizer.decode(p.answer_ids[:1]).strip()
    intro = probes[(256, 0.0)].needle_at
    assert probes[(160, 0.0)].needle_at == intro  # depth 0: right after the instruction
    for L in (160, 256):  # depth 1: right before the question; 0.5 in between
        assert probes[(L, 1.0)].needle_at > probes[(L, 0.5)].needle_at > intro
    other = make_probe(task, tokenizer, filler, 256, 0.5, trial=2, seed=3)
    assert other.ids != probes[(256, 0.5)].ids


def test_too_short_a_length_is_refused(tokenizer, filler):
    with pytest.raises(RunError, match="no room for filler"):
        make_probe("passkey", tokenizer, filler, 40, 0.5, 0)


def _free_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy decoding by full forwards, no cache: what `exact` must agree with."""
    out = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


def test_teacher_forced_scoring_is_greedy_decoding(tiny_model, tokenizer, filler):
    probe = make_probe("needle", tokenizer, filler, 160, 0.5, 0)
    greedy = _free_greedy(tiny_model, list(probe.ids), 3)
    hit = dataclasses.replace(probe, answer_ids=tuple(greedy))  # the model's own answer: an exact match
    out = score_probe(tiny_model, hit, None, chunk=64)
    assert out.exact and out.first_token and out.greedy_ids == tuple(greedy)
    assert out.cache_tokens == 160 + 2  # the prompt, then all answer tokens but the last fed back
    miss = dataclasses.replace(probe, answer_ids=(greedy[0], (greedy[1] + 1) % 512, greedy[2]))
    out = score_probe(tiny_model, miss, None, chunk=64)
    assert not out.exact and out.first_token and out.greedy_ids[:2] == tuple(greedy[:2])


@pytest.mark.parametrize("mode", ["cache", "fake", "prefill"])
def test_unquantized_cache_scores_as_the_reference(tiny_model, tokenizer, filler, mode):
    probe = make_probe("passkey", tokenizer, filler, 200, 0.5, 0)
    ref = score_probe(tiny_model, probe, None, mode=mode, chunk=48)
    fp = score_probe(tiny_model, probe, parse_eval_scheme("fp16"), mode=mode, chunk=48)
    q = score_probe(tiny_model, probe, parse_eval_scheme("int2-g32"), mode=mode, chunk=48)
    assert fp.greedy_ids == ref.greedy_ids
    assert fp.answer_logprob == pytest.approx(ref.answer_logprob, abs=1e-3)
    assert abs(q.answer_logprob - ref.answer_logprob) > 1e-4  # the quantized cache is read
    if mode != "fake":  # the fake-quant cache keeps exact K/V and quantizes what it returns
        assert q.cache_bytes < fp.cache_bytes


def test_prefill_probe_shares_one_fp_prompt_forward(tiny_model, tokenizer, filler, monkeypatch, tmp_path):
    """In prefill mode a probe's schemes store from one FP prompt forward (left unchanged by them), and the
    reference decodes on in it last: every outcome equals the probe scored alone, and the grid runs one
    prompt forward per probe."""
    from kvquant.eval import results as res
    from kvquant.eval import retrieval

    probe = make_probe("passkey", tokenizer, filler, 200, 0.5, 0)
    schemes = [parse_eval_scheme(n) for n in ("int2-g32", "int4-g32")]
    alone = [score_probe(tiny_model, probe, s, mode="prefill") for s in [*schemes, None]]
    prompt = retrieval.prompt_forward(tiny_model, probe)
    shared = [score_probe(tiny_model, probe, s, mode="prefill", prompt=prompt) for s in [*schemes, None]]
    assert shared == alone
    assert shared[0].answer_logprob != shared[1].answer_logprob  # the schemes really differ
    forwards = []
    real = retrieval.prompt_forward
    monkeypatch.setattr(retrieval, "prompt_forward", lambda m, p: (forwards.append(p.cell), real(m, p))[1])
    config = RunConfig(schemes=("int2-g32", "int4-g32"), task="passkey", mode="prefill", lengths=(200,),
                       depths=(0.0, 1.0), trials=1, chunk=64)
    results = res.RunResults(tmp_path)
    probes = {p.cell: p for p in (make_probe("passkey", tokenizer, filler, 200, d, 0) for d in (0.0, 1.0))}
    retrieval._measure(config, tiny_model, [parse_eval_scheme(n) for n in config.schemes], probes, results)
    assert sorted(forwards) == sorted(probes)  # one per probe, not one per (probe, scheme)
    assert len(results.rows) == 3 * len(probes)


def test_summary_pairs_points_with_the_reference():
    def row(scheme, length, depth, trial, exact, lp, greedy):
        return {
            "scheme": scheme,
            "mode": "cache",
            "doc": trial,
            "bucket": cell_label(length, depth),
            "task": "passkey",
            "length": length,
            "depth": depth,
            "trial": trial,
            "trials": 1,
            "exact": exact,
            "first_token": exact,
            "answer_logprob": lp,
            "answer_ids": [1, 2],
            "greedy_ids": greedy,
            "status": "ok",
        }

    rows = [
        row(REFERENCE, 256, 0.0, 0, 1, -1.0, [1, 2]),
        row(REFERENCE, 256, 0.0, 1, 0, -5.0, [3, 3]),
        row("int4", 256, 0.0, 0, 0, -2.0, [1, 4]),
        row("int4", 256, 0.0, 1, 0, -6.0, [3, 3]),
    ]
    summary = summarize_retrieval(rows)
    assert [r.keys() >= set(metrics.RETRIEVAL_KEY_COLUMNS) for r in summary]
    cell = next(r for r in summary if r["scheme"] == "int4" and r["depth"] == 0.0)
    assert cell["exact_match"] == 0 and cell["answer_logprob"] == -4.0 and cell["trials"] == 2
    assert cell["same_as_ref"] == 0.5 and cell["answer_logprob_delta"] == -1.0
    ref = next(r for r in summary if r["scheme"] == REFERENCE and r["length"] == "all")
    assert ref["exact_match"] == 0.5 and ref["same_as_ref"] == 1.0 and ref["answer_logprob_delta"] == 0.0
    assert metrics.format_value("answer_logprob_delta", -1.0) == "−1.00"


def test_trials_per_cell_is_plural_past_one():
    assert _trials_per_cell(1) == "1 trial per cell" and _trials_per_cell(3) == "3 trials per cell"


def test_config_checks():
    with pytest.raises(RunError, match="unknown task"):
        RunConfig(schemes=("int8",), task="haystack")
    with pytest.raises(RunError, match="--depths 1.5 must lie in"):
        RunConfig(schemes=("int8",), task="passkey", depths=(0, 1.5))
    with pytest.raises(RunError, match="--lengths 64 must be at least 128"):
        RunConfig(schemes=("int8",), task="needle", lengths=(64,))
    with pytest.raises(RunError, match="apply to --task passkey|needle"):
        RunConfig(schemes=("int8",), lengths=(512,))
    with pytest.raises(RunError, match="--trials 0"):
        RunConfig(schemes=("int8",), task="passkey", trials=0)
    parse = cli.build_parser().parse_args
    quick = cli.config_from_args(parse(["--scheme", "int8", "--task", "passkey", "--quick"]))
    assert (quick.grid_lengths, quick.grid_depths, quick.grid_trials) == ((256, 512), (0, 0.5, 1), 2)
    c = cli.config_from_args(parse(["--scheme", "int8", "--task", "needle", "--lengths", "1k,512"]))
    assert c.grid_lengths == (512, 1024) and c.chunk == 1024
    for argv, msg in (
        (["--max-length", "512"], "applies to --task ppl"),
        (["--lengths", "x"], "cannot read"),
    ):
        with pytest.raises(RunError, match=msg):
            cli.config_from_args(parse(["--scheme", "int8", "--task", "passkey", *argv]))
    with pytest.raises(RunError, match="apply to --task passkey"):
        cli.config_from_args(parse(["--scheme", "int8", "--depths", "0.5"]))


def test_peers_default_to_their_residual_as_chunk():
    peer, own = parse_eval_scheme("hf-quanto-int4"), parse_eval_scheme("int4-g64")
    default = RunConfig(schemes=("int8",))
    assert default.chunk == 1024 and not default.chunk_given
    assert (default.chunk_for(peer), default.chunk_for(own)) == (128, 1024)
    given = RunConfig(schemes=("int8",), chunk=512)
    assert (given.chunk_for(peer), given.chunk_for(own)) == (512, 512)


def test_retrieval_run_directory_and_resume(tmp_path, tiny_model, tokenizer, tiny_corpus, caplog):
    config = RunConfig(
        schemes=("int8", "int2-g32"),
        task="passkey",
        corpus=str(tiny_corpus),
        lengths=(160, 256),
        depths=(0.0, 1.0),
        trials=2,
        chunk=64,
        out=str(tmp_path / "run"),
    )
    run_dir, summary = run(config, model=tiny_model, tokenizer=tokenizer)
    for name in (
        "config.json",
        "results.jsonl",
        "summary.csv",
        "report.md",
        "heatmap-int8.png",
        "heatmap-int2-g32.png",
    ):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "heatmap-fp32-reference.png").is_file()
    lines = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    assert len(lines) == 3 * 2 * 2 * 2  # (reference + 2 schemes) x lengths x depths x trials
    assert all(r["status"] == "ok" and r["task"] == "passkey" for r in lines)
    with (run_dir / "summary.csv").open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == metrics.RETRIEVAL_COLUMNS
        rows = list(reader)
    ref_all = next(r for r in rows if r["scheme"] == REFERENCE and r["length"] == "all")
    assert float(ref_all["same_as_ref"]) == 1 and float(ref_all["trials"]) == 8
    int8 = next(r for r in rows if r["scheme"] == "int8" and r["length"] == "all")
    assert float(int8["saving"]) > 1.5
    report = (run_dir / "report.md").read_text()
    assert "| `int2-g32` |" in report and "![heatmap-int8](heatmap-int8.png)" in report
    assert "; 2 trials per cell (e.g. answer" in report
    config_json = json.loads((run_dir / "config.json").read_text())
    assert config_json["lengths"] == [160, 256] and config_json["chunks"]["int8"] == 64
    assert "lengths" not in config_json["identity"]  # the grid may grow

    caplog.set_level("INFO", logger="kvquant.eval.retrieval")
    run(config, model=tiny_model, tokenizer=tokenizer)  # resumes: nothing measured twice
    assert len((run_dir / "results.jsonl").read_text().splitlines()) == len(lines)
    assert "resuming: 24 of 24 points" in caplog.text


def test_a_retrieval_grid_grows_in_its_run_directory(tmp_path, tiny_model, tokenizer, tiny_corpus, caplog):
    """A run grown by another length measures only that length's points; the report covers the union, says
    which flags would fill the union's cross product, and a directory from before (grid in the identity)
    still resumes."""
    config = RunConfig(
        schemes=("int8",), task="passkey", corpus=str(tiny_corpus), lengths=(160,), depths=(0.0, 1.0),
        trials=2, chunk=64, out=str(tmp_path / "run"),
    )  # fmt: skip
    run_dir, _ = run(config, model=tiny_model, tokenizer=tokenizer)
    first = (run_dir / "results.jsonl").read_text().splitlines()
    assert len(first) == 2 * 2 * 2  # (reference + int8) x depths x trials
    # a directory written before the grid left the identity: its identity holds the grid
    cfg = json.loads((run_dir / "config.json").read_text())
    cfg["identity"] |= {"lengths": [160], "depths": [0.0, 1.0], "trials": 2}
    (run_dir / "config.json").write_text(json.dumps(cfg))

    caplog.set_level("INFO", logger="kvquant.eval.retrieval")
    grown = dataclasses.replace(config, lengths=(256,), depths=(0.5,), trials=1)
    _, summary = run(grown, model=tiny_model, tokenizer=tokenizer)
    lines = (run_dir / "results.jsonl").read_text().splitlines()
    assert lines[: len(first)] == first and len(lines) == len(first) + 2  # only L256-d0.5, trial 0
    assert "the run's grid grows to --lengths 160,256 --depths 0,0.5,1 --trials 2" in caplog.text
    cfg = json.loads((run_dir / "config.json").read_text())
    assert (cfg["lengths"], cfg["depths"], cfg["trials"]) == ([160, 256], [0.0, 0.5, 1.0], 2)
    cells = {(r["length"], r["depth"]) for r in summary if r["scheme"] == "int8" and r["depth"] != "all"}
    assert cells == {(160, 0.0), (160, 1.0), (256, 0.5)}
    report = (run_dir / "report.md").read_text()
    assert "1-2 trials per cell" in report
    # 3 of the union's 2 x 3 cells x 2 trials x 2 schemes = 24 points are measured
    flags = "--lengths 160,256 --depths 0,0.5,1 --trials 2"
    assert f"**partial: 10 of 24 points of the grid measured** (rerun with `{flags}` to measure" in report

    other = dataclasses.replace(grown, schemes=("int2-g32",))  # another run: refused, as before
    with pytest.raises(RunError, match="different configuration"):
        run(other, model=tiny_model, tokenizer=tokenizer)


def test_peer_runs_at_its_own_chunk_in_a_ppl_run(tmp_path, tiny_model, tokenizer, tiny_corpus, monkeypatch):
    """Without --chunk, a peer runs cache mode at its residual (128) in its own lockstep, kvquant's schemes at
    the run's chunk; the reference is written once per point."""
    pytest.importorskip("optimum.quanto")
    from kvquant.eval import runner

    calls = []
    real = runner.evaluate_document

    def spy(model, ids, schemes, **kw):
        calls.append((kw["chunk"], [s.label for s in schemes]))
        return real(model, ids, schemes, **kw)

    monkeypatch.setattr(runner, "evaluate_document", spy)
    config = RunConfig(
        schemes=("int8", "hf-quanto-int4"),
        corpus=str(tiny_corpus),
        max_length=300,
        docs=1,
        out=str(tmp_path / "run"),
    )
    run_dir, summary = run(config, model=tiny_model, tokenizer=tokenizer)
    assert calls == [(1024, ["int8"]), (128, ["hf-quanto-int4"])]
    assert json.loads((run_dir / "config.json").read_text())["identity"]["chunks"] == {"hf-quanto-int4": 128}
    lines = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    assert len([r for r in lines if r["scheme"] == REFERENCE]) == 2  # 2 buckets, written once
    peer = next(r for r in summary if r["scheme"] == "hf-quanto-int4" and r["bucket"] == "all")
    assert peer["status"] == "ok" and peer["kl"] > 0


def test_bad_retrieval_flags_fail_before_torch():
    """Exit 2 with one line, and torch never imported (experiments/run.py checks before its heavy imports)."""
    import subprocess
    import sys
    from pathlib import Path

    experiments = Path(__file__).resolve().parents[2] / "experiments"
    code = (
        f"import sys, contextlib, io; sys.path.insert(0, {str(experiments)!r}); import run\n"
        "err = io.StringIO()\n"
        "with contextlib.redirect_stderr(err):\n"
        "    rc = run.cli(sys.argv[1:])\n"
        "print(rc, 'torch' in sys.modules, err.getvalue().strip())"
    )
    for argv, want in (
        (["--task", "passkey", "--scheme", "int8", "--depths", "0,2"], "--depths 2 must lie in [0, 1]"),
        (["--task", "needle", "--scheme", "int8", "--lengths", "64"], "--lengths 64 must be at least 128"),
        (["--task", "needle", "--scheme", "int8", "--docs", "2"], "--docs applies to --task ppl"),
        (["--scheme", "int8", "--trials", "2"], "apply to --task passkey|needle"),
    ):
        proc = subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=600
        )
        rc, torch_loaded, message = proc.stdout.strip().split(" ", 2)
        assert (rc, torch_loaded) == ("2", "False") and want in message, (argv, proc.stdout, proc.stderr)


@pytest.mark.slow
def test_default_model_finds_the_passkey(default_model):
    """SmolLM2-135M repeats a passkey hidden mid-way in 256 tokens of Wikipedia, unquantized and through an
    int8 cache (measured: exact at 512 tokens for every depth and trial), with nearly the same log p."""
    model, tokenizer = default_model
    probe = make_probe("passkey", tokenizer, filler_tokens(tokenizer), 256, 0.5, 0)
    ref = score_probe(model, probe, None, chunk=128)
    int8 = score_probe(model, probe, parse_eval_scheme("int8"), chunk=128)
    assert ref.exact and int8.exact
    assert int8.answer_logprob == pytest.approx(ref.answer_logprob, abs=0.1)
