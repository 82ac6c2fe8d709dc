import csv
import json
import logging

import pytest
import run as cli  # experiments/run.py (tests/eval/conftest.py puts experiments/ on sys.path)
import torch
from kvquant.eval import results as res
from kvquant.eval.results import SUMMARY_COLUMNS
from kvquant.eval.runner import RunConfig, RunError, RunInterrupted, run

import kvquant

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
    # a module fixture is set up before the autouse one that points the reference cache away from the user's
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVQUANT_REFERENCE_CACHE", str(tmp_path_factory.getbasetemp() / "reference-cache"))
        run_dir, summary = run(cfg(out, tiny_corpus, mode="both"), model=tiny_model, tokenizer=tokenizer)
    return run_dir, summary


def test_run_directory_files(finished, tiny_model):
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
    report = (run_dir / "report.md").read_text()
    assert {r["name"] for r in ref} == {"fp32 (reference)"} and "fp32 (reference)" in report  # one name
    q2 = [r for r in rows if r["scheme"] == "int2-g32" and r["bucket"] == "all"]
    assert all(float(r["drift"]) != 0 and float(r["kl"]) > 0 for r in q2)
    cache8 = next(r for r in rows if r["scheme"] == "int8" and r["mode"] == "cache" and r["bucket"] == "all")
    # int8 per token at the FP16 storage dtype (--kv-dtype default): 1 byte per value + one FP16 scale per
    # token and layer, for K and V
    assert float(cache8["bytes_per_token_formula"]) == 2 * 2 * (2 * 64 + 2)
    # measured at the end of a 300-token document at the run dtype: whole pages, as the formula counts them
    held = kvquant.memory.cache_bytes(tiny_model.config, "int8", LENGTH, dtype=torch.float32)
    assert float(cache8["bytes_per_token_measured"]) == pytest.approx(held / LENGTH, rel=1e-5)
    # saving: FP16 reference bytes over int8's pages, both at FP16 storage
    held16 = kvquant.memory.cache_bytes(tiny_model.config, "int8", LENGTH, dtype=torch.float16)
    assert float(cache8["saving"]) == pytest.approx(2 * 2 * 2 * 64 * 2 / (held16 / LENGTH), rel=1e-5)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["schemes"] == list(SCHEMES) and config["mode"] == "both" and "versions" in config
    report = (run_dir / "report.md").read_text()
    assert "| `int2-g32` |" in report and "llama-3-70b" in report
    lines = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 2 * 3 * 2  # modes x docs x (fp16 + 2 schemes) x buckets
    assert {"scheme", "mode", "doc", "bucket", "nll_sum", "ref_nll_sum", "dp_sum", "tokens", "kl_sum", "top1",
            "status"} <= set(
        lines[0]
    )
    # memory measured on the device rides on each document's last bucket: held and peak in both modes (fake
    # mode's FakeQuantCache holds exact K/V), the pools' reserve for kvquant's QuantizedCache only
    for x in lines:
        if x["bucket"] != "256-300":
            assert "mem_held" not in x
        elif x["scheme"] != "fp16":  # (a reference read from the reference cache is not run: not measured)
            assert x["mem_held"] > 0 and x["mem_peak"] > 0 and x["mem_probe"].startswith("cpu: ")
            reserved = x["cache_reserved"]
            assert reserved >= x["cache_bytes"] if x["mode"] == "cache" else reserved is None
    fake8 = next(r for r in rows if r["scheme"] == "int8" and r["mode"] == "fake" and r["bucket"] == "all")
    assert fake8["mem_held_per_token"] == "nan" and float(fake8["mem_peak"]) > 0  # no cache of its own
    assert float(cache8["bytes_per_token_reserved"]) >= float(cache8["bytes_per_token_measured"])
    assert "**Memory: the formula, the pages, the pools, and what the device held**" in report


def test_known_shapes_table():
    table = res.known_shapes_table([])
    # Llama-3-70B at FP16: 320 KiB per token; 100 requests x 4,096 tokens = 134.2 GB (125 GiB)
    assert "| llama-3-70b | `fp16` | 320.0 | 134.2 (125.0) | 1.00x |" in table


def test_known_shapes_table_with_a_per_layer_scheme():
    """A layers= scheme written for a 30-layer model has no figure for 32- or 80-layer shapes: the table says
    so (it used to raise after a whole run had been measured, losing its report)."""
    from kvquant.eval.schemes import parse_eval_scheme

    scheme = parse_eval_scheme("layers=0-1:int8+2-29:int4-g64")
    table = res.known_shapes_table([scheme, parse_eval_scheme("int4-g64")])
    no_figure = "| llama-3-70b | `layers=0-1:int8+2-29:int4-g64` | — (its layers= ranges are for another"
    assert no_figure in table
    assert "| llama-3-70b | `int4-g64` | 90.0 |" in table


def test_resume_after_interruption(
    tmp_path, finished, tiny_model, tokenizer, tiny_corpus, monkeypatch, caplog
):
    config = cfg(tmp_path / "r", tiny_corpus, mode="both")
    real_append, calls = res.ResultsFile.append, []

    def flaky(self, row):
        calls.append(row)
        if len(calls) == 7:
            raise KeyboardInterrupt
        real_append(self, row)

    monkeypatch.setattr(res.ResultsFile, "append", flaky)
    with pytest.raises(RunInterrupted) as stop:  # a KeyboardInterrupt, after everything was written
        run(config, model=tiny_model, tokenizer=tokenizer)
    assert isinstance(stop.value, KeyboardInterrupt)
    assert (stop.value.progress.measured, stop.value.progress.total) == (6, 24)
    assert str(stop.value).startswith("interrupted: 6 of 24 points measured and written to ")
    kept = (tmp_path / "r" / "results.jsonl").read_text().splitlines()
    assert len(kept) == 6 and (tmp_path / "r" / "summary.csv").is_file()  # partial summary written
    assert "**partial: 6 of 24 points measured**" in (tmp_path / "r" / "report.md").read_text()
    assert (tmp_path / "r" / "drift_vs_length.png").is_file()
    monkeypatch.setattr(res.ResultsFile, "append", real_append)
    written = []
    monkeypatch.setattr(
        res.ResultsFile, "append", lambda self, row: (written.append(row), real_append(self, row))
    )
    first = json.loads((tmp_path / "r" / "config.json").read_text())
    import kvquant.eval.harness as harness

    monkeypatch.setattr(harness, "git_commit", lambda: "b" * 40)  # resumed by a later commit
    with caplog.at_level(logging.INFO, logger="kvquant.eval.runner"):
        _, summary = run(config, model=tiny_model, tokenizer=tokenizer)
    again = json.loads((tmp_path / "r" / "config.json").read_text())
    assert again["git_commit"] == first["git_commit"] and again["created"] == first["created"]
    assert again["resumed_git_commits"] == ["b" * 40]
    assert f"(resumed at {'b' * 40})" in (tmp_path / "r" / "report.md").read_text()
    said = caplog.text
    assert "resuming: 6 of 24 points already measured in" in said
    assert "18 to measure in 3 document(s)" in said and "0 of them were cut off" in said
    assert "partial" not in (tmp_path / "r" / "report.md").read_text()
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
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvquant.eval.runner"):
        run(config, model=tiny_model, tokenizer=tokenizer)
    assert written == []
    assert "resuming: 24 of 24 points already measured" in caplog.text and "nothing left" in caplog.text


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
    # --force over a run of the same configuration starts over too (it used to resume silently)
    (out / "results.jsonl").write_text("")
    run(
        cfg(out, tiny_corpus, schemes=("int4-g64",), docs=1, force=True),
        model=tiny_model,
        tokenizer=tokenizer,
    )
    assert (out / "results.jsonl").read_text().strip()  # measured again, not "nothing left to measure"
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


# ------------------------------------------------------------------------------------------------- plots


def _summary_rows(with_band: bool) -> list[dict]:
    """Two modes, two schemes and the reference, buckets up to 32k; optional intervals on drift and KL."""
    rows = []
    ends = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
    for scheme, k in (("fp16", 0.0), ("int4-g64", 0.01), ("k=int2-channel-g32,v=int2-g32,window=128", 0.05)):
        for mode, scale in (("cache", 1.0), ("fake", 3.0)):
            for start, end in zip([0, *ends[:-1]], ends, strict=True):
                d = k * scale * end.bit_length()
                kl = k * end / 1e4
                band = dict(drift_lo=d - k, drift_hi=d + k, kl_lo=kl / 2, kl_hi=kl * 2) if with_band else {}
                rows.append(
                    dict(
                        scheme=scheme,
                        mode=mode,
                        bucket=f"{start}-{end}",
                        bucket_start=start,
                        bucket_end=end,
                        drift=d,
                        kl=kl,
                        kl_p99=10 * kl,
                        **band,
                    )
                )
            rows.append(
                dict(
                    scheme=scheme,
                    mode=mode,
                    bucket="all",
                    bucket_start=0,
                    bucket_end=32768,
                    drift=k,
                    bytes_per_token=5760 / (1 + 10 * k) if mode == "cache" else float("nan"),
                    bytes_per_token_formula=5760 / (1 + 10 * k),
                    saving=1 + 10 * k,
                )
            )
    return rows


INFO = res.PlotInfo(
    model="smollm2-135m-instruct",
    corpus="shakespeare",
    documents=4,
    max_length=32768,
    dtype="float32",
    chunk=1024,
    names={"k=int2-channel-g32,v=int2-g32,window=128": "kivi-2"},
)


def test_drift_plot_stands_alone():
    import dataclasses

    import matplotlib

    matplotlib.use("Agg")
    fig = res.plot_drift(_summary_rows(with_band=True), dataclasses.replace(INFO, partial="9 of 48 points"))
    title = fig._suptitle.get_text()
    assert "smollm2-135m-instruct · shakespeare · 4 documents × 32,768 tokens · float32" in title
    assert "PARTIAL: 9 of 48 points measured" in title
    a, b, ka, kb = fig.axes  # drift on top, KL below; one column per mode
    assert a.get_title() == "mode: cache, chunk 1,024" and b.get_title() == "mode: fake"
    assert a.get_ylim() == b.get_ylim() and a.get_shared_y_axes().joined(a, b)  # one y-scale for both modes
    assert ka.get_yscale() == "log" and ka.get_shared_y_axes().joined(ka, kb) and a.get_xscale() == "log"
    assert ka.get_ylabel().startswith("KL(fp16 (reference) || scheme)")
    means = [ln for ln in ka.get_lines() if ln.get_linestyle() == "-"]
    assert len(means) == 2 and len(ka.get_lines()) == 4  # mean and dashed p99 per scheme, no reference
    assert list(means[0].get_ydata()) == pytest.approx([0.01 * e / 1e4 for e in (256, 512, 1024, 2048, 4096,
                                                                                   8192, 16384, 32768)])
    assert len(ka.collections) == 2  # the KL intervals
    fig.canvas.draw()
    ticks = [t.get_text() for t in ka.get_xticklabels()]  # the columns share x; labelled at the bottom
    assert ticks == ["256", "512", "1k", "2k", "4k", "8k", "16k", "32k"]
    assert [t.get_text() for t in a.get_legend().get_texts()] == ["int4-g64", "kivi-2"]  # preset name
    assert len(a.collections) == 2  # one interval band per scheme
    plain = res.plot_drift(_summary_rows(with_band=False), INFO)
    assert len(plain.axes[0].collections) == 0 and "PARTIAL" not in plain._suptitle.get_text()


def test_prefill_plot_leaves_out_the_prompt_buckets_exact_by_construction():
    """In prefill mode the prompt goes through the FP forward: its buckets' 0% is not a measurement, so the
    drift plot shades the prompt's span instead of drawing points there (only the decoded buckets)."""
    import dataclasses

    import matplotlib

    matplotlib.use("Agg")
    rows = [dict(r, mode="prefill") for r in _summary_rows(with_band=True) if r["mode"] == "cache"]
    fig = res.plot_drift(rows, dataclasses.replace(INFO, prefill=16384))
    ax, kax = fig.axes
    assert ax.get_title() == "mode: prefill, decoded after a 16,384-token prompt"
    curves = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]  # not the zero axis
    assert len(curves) == 2 and all(list(ln.get_xdata()) == [32768] for ln in curves)
    assert len(ax.patches) == 1 and ax.patches[0].get_x() == 256  # the shaded prompt span, 256 .. 16k
    xs, ys = ax.containers[0].lines[2][0].get_segments()[0].T  # one point: its interval as an error bar
    assert list(xs) == [32768, 32768]
    assert list(ys) == pytest.approx([100 * (0.16 - 0.01), 100 * (0.16 + 0.01)])
    fig.canvas.draw()
    assert "16k" in [t.get_text() for t in kax.get_xticklabels()]
    whole = res.plot_drift(rows, INFO)  # no prompt length known: every bucket drawn, as before
    curves = [ln for ln in whole.axes[0].get_lines() if not ln.get_label().startswith("_")]
    assert len(curves) == 2 and all(len(ln.get_xdata()) == 8 for ln in curves)


def test_drift_plot_names_its_reference():
    """The y-axis and title name the run's reference as config.json's scheme_names does (fp32 on the CPU)."""
    import dataclasses

    import matplotlib

    matplotlib.use("Agg")
    fig = res.plot_drift(_summary_rows(with_band=False), INFO)
    assert fig.axes[0].get_ylabel() == "perplexity drift vs fp16 (reference) (%)"
    fp32 = dataclasses.replace(INFO, names={**INFO.names, "fp16": "fp32 (reference)"})
    fig = res.plot_drift(_summary_rows(with_band=False), fp32)
    assert fig.axes[0].get_ylabel() == "perplexity drift vs fp32 (reference) (%)"
    assert fig._suptitle.get_text().startswith("Perplexity drift and KL vs fp32 (reference) by position\n")
    assert "FP16" not in fig._suptitle.get_text()


def test_a_long_scheme_name_is_shortened_in_plots_only():
    """recommend's `fp8 skip sliding_window` on Gemma spells 18 layers (~190 characters): whole in the
    legend, it left the axes a sliver; the plot shows its head and tail, the names mapping keeps it whole."""
    long = "layers=" + "+".join(f"{i}:{'vllm:fp8_e4m3' if i % 6 == 5 else 'fp16'}" for i in range(18))
    short = INFO.name(long)
    assert len(short) == res.PLOT_LABEL_CHARS and short.startswith("layers=0:fp16+1:fp16")
    assert short.endswith("17:vllm:fp8_e4m3") and "…" in short
    assert INFO.name("k=int4-channel-g64-rot,v=int4-g64-rot,sink=4,window=128").endswith("window=128")
    assert INFO.name("k=int2-channel-g32,v=int2-g32,window=128") == "kivi-2"


def test_bytes_plot_stands_alone():
    import matplotlib

    matplotlib.use("Agg")
    fig = res.plot_bytes(_summary_rows(with_band=False), INFO)
    ax = fig.axes[0]
    assert fig._suptitle.get_text().startswith("KV-cache bytes per token\nsmollm2-135m-instruct")
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["fp16 (reference)", "int4-g64\n1.10× smaller", "kivi-2\n1.50× smaller"]
    values = sorted(t.get_text() for t in ax.texts)  # bar_label writes one text per bar
    assert values == sorted(["5,760", "5,236", "3,840"] * 2)
    assert min(t.get_fontsize() for t in ax.get_xticklabels()) >= 9
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "held at the full length (pages counted)", "formula (steady state)"]  # nothing measured: no bar
    assert ax.get_ylabel() == "KV-cache bytes per token (at float16 K/V storage)"


def test_bytes_plot_shows_what_the_process_held_beside_the_count():
    """Where the run measured the memory the process held for each cache, a third bar per scheme shows it
    (at the run's dtype, reserve included), so a reserve or dtype gap is visible next to the pages counted."""
    import matplotlib

    matplotlib.use("Agg")
    rows = _summary_rows(with_band=False)
    held = {"fp16": 11_530.0, "int4-g64": 10_600.0, "k=int2-channel-g32,v=int2-g32,window=128": 7_900.0}
    for r in rows:
        r["mem_held_per_token"] = held.get(r["scheme"], float("nan"))
    ax = res.plot_bytes(rows, INFO).axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[2] == "held by the process, measured (at float32, reserve included)", legend
    two_dtypes = "KV-cache bytes per token\n(counted at float16 K/V storage, measured at float32)"
    assert ax.get_ylabel() == two_dtypes
    assert {"11,530", "10,600", "7,900"} <= {t.get_text() for t in ax.texts}
    assert len(ax.patches) == 3 * 3  # three bars for each of the three schemes


@pytest.mark.parametrize(
    "n, label", [(256, "256"), (300, "300"), (1024, "1k"), (32768, "32k"), (1536, "1.5k")]
)
def test_position_label(n, label):
    assert res.position_label(n) == label


def test_report_and_table_use_preset_names(tmp_path, tiny_model, tokenizer, tiny_corpus):
    run_dir, summary = run(
        cfg(tmp_path / "k", tiny_corpus, schemes=("kivi-2",), docs=1), model=tiny_model, tokenizer=tokenizer
    )
    report = (run_dir / "report.md").read_text()
    assert "`kivi-2` (`k=int2-channel-g32,v=int2-g32,window=128`)" in report  # named, and expanded once
    assert "| `kivi-2` |" in report and "| `k=int2-channel-g32" not in report
    assert json.loads((run_dir / "config.json").read_text())["scheme_names"] == {
        "k=int2-channel-g32,v=int2-g32,window=128": "kivi-2",
        "fp16": "fp32 (reference)",  # the reference named for what it computes in
    }


def test_drift_plot_tells_apart_more_schemes_than_colours():
    """Past matplotlib's 10 colours a scheme keeps its colour's twin apart by its marker, and a long legend
    sits beside the panel (the figure widens for it) instead of over the lines."""
    import matplotlib

    matplotlib.use("Agg")
    base = [r for r in _summary_rows(with_band=False) if r["mode"] == "cache"]
    one = [r for r in base if r["scheme"] == "int4-g64"]
    rows = [r for r in base if r["scheme"] == "fp16"] + [
        dict(r, scheme=f"int4-g{i}") for i in range(12) for r in one
    ]
    fig = res.plot_drift(rows, INFO)
    ax = fig.axes[0]
    curves = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]
    assert len(curves) == 12
    assert curves[0].get_color() == curves[10].get_color()  # the colour cycle repeats ...
    assert curves[0].get_marker() != curves[10].get_marker()  # ... the marker does not
    anchor = ax.get_legend().get_bbox_to_anchor().transformed(ax.transAxes.inverted())
    assert anchor.x0 > 1.0  # beside the axes, not over them
    small = res.plot_drift(base, INFO)  # the same single mode, three schemes: the legend stays inside
    assert fig.get_figwidth() > small.get_figwidth()
    assert (
        small.axes[0].get_legend().get_bbox_to_anchor().transformed(small.axes[0].transAxes.inverted()).x0
        <= 0
    )
