"""W&B logging of a run directory: offline runs on disk, nothing at all when disabled.

The run directory is a small fake one built here (config.json, summary.csv, two PNGs), so these tests do not
depend on the evaluation code that normally writes it."""

from __future__ import annotations

import csv
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import yaml
from kvquant.eval import wandb_logger
from kvquant.eval.wandb_logger import SUMMARY_COLUMNS, log_run, read_summary
from PIL import Image

import kvquant

KIVI = "k=int2-channel-g32,v=int2-g32,window=128"  # the results label of the preset kivi-2
SCHEMES = {"fp16": 0.0, "int4-g64": 0.02, "int2-g32": 0.4, KIVI: 0.1}  # scheme -> drift at the last bucket
NAMES = {"fp16": "fp32 (reference)", KIVI: "kivi-2"}  # what the report shows (config.json scheme_names)
SHOWN = [NAMES.get(s, s) for s in SCHEMES]
BUCKETS = [(0, 512), (512, 1024)]
REPO = Path(__file__).resolve().parents[2]


def make_run_dir(root: Path) -> Path:
    run_dir = root / "smollm2-wikipedia-abc123"
    run_dir.mkdir()
    config = {
        "schemes": list(SCHEMES),
        "model": "smollm2-135m-instruct",
        "corpus": "wikipedia",
        "mode": "cache",
        "chunk": 256,
        "max_length": 1024,
        "documents": [{"id": 0, "title": "Anarchism", "tokens": 1024}],
        "versions": {"kvquant": "0.1.0", "torch": "2.13.0"},
        "reference": "fp16",
        "scheme_names": NAMES,  # the reference computing in float32, as on the CPU; a preset by its name
    }
    (run_dir / "config.json").write_text(json.dumps(config))
    with open(run_dir / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS)
        w.writeheader()
        for scheme, drift in SCHEMES.items():
            bpt = 5760.0 if scheme == "fp16" else 5760.0 / (4 if scheme == "int4-g64" else 7)
            if scheme == KIVI:
                bpt = 5760.0 / 6
            for label, (start, end) in [*(((f"{s}-{e}"), (s, e)) for s, e in BUCKETS), ("all", (0, 1024))]:
                d = drift * end / 1024
                w.writerow(
                    dict(
                        scheme=scheme,
                        mode="cache",
                        bucket=label,
                        bucket_start=start,
                        bucket_end=end,
                        tokens=end - start,
                        ppl=f"{20 * (1 + d):.6g}",
                        ppl_ref="20",
                        drift=f"{d:.6g}",
                        drift_lo=f"{d * 0.5:.6g}",
                        drift_hi=f"{d * 1.5:.6g}",
                        kl=f"{d / 10:.6g}",
                        kl_lo=f"{d / 20:.6g}",
                        kl_hi=f"{d / 5:.6g}",
                        top1_agree=f"{1 - d / 2:.6g}",
                        bytes_per_token_measured=bpt,
                        bytes_per_token_formula=bpt,
                        saving=f"{5760 / bpt:.6g}",
                        effective_bits=f"{16 * bpt / 5760:.6g}",
                        status="ok",
                    )
                )
        w.writerow(
            dict(
                scheme="int8",
                mode="cache",
                bucket="all",
                bucket_start=0,
                bucket_end=0,
                tokens=0,
                ppl="nan",
                ppl_ref="nan",
                drift="nan",
                kl="nan",
                top1_agree="nan",
                bytes_per_token_measured="nan",
                bytes_per_token_formula=2944,
                saving="1.95652",
                effective_bits="8.17",
                status="failed",
            )
        )
    for name in ("drift_vs_length", "bytes_per_token"):
        Image.new("RGB", (32, 24), "white").save(run_dir / f"{name}.png")
    return run_dir


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """Keep every W&B side file (settings, caches, artifacts staging) inside tmp_path; no network."""
    home = tmp_path / "wandb-home"
    for var, sub in [
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_DATA_DIR", "data"),
        ("WANDB_ARTIFACT_DIR", "artifacts"),
    ]:
        monkeypatch.setenv(var, str(home / sub))
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_GROUP"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield home
    import wandb

    wandb.teardown()  # wandb keeps process-wide settings read from the environment; start each test afresh


@pytest.fixture
def init_spy(monkeypatch):
    import wandb

    calls: list[dict] = []
    real_init = wandb.init

    def spy(**kwargs):
        calls.append(kwargs)
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", spy)
    return calls


def test_read_summary_parses_numbers_and_keeps_text(tmp_path):
    rows = read_summary(make_run_dir(tmp_path) / "summary.csv")
    first = rows[0]
    assert first["scheme"] == "fp16" and first["bucket"] == "0-512" and first["status"] == "ok"
    assert first["bucket_end"] == 512 and isinstance(first["bucket_end"], int)
    assert rows[-1]["ppl"] is None and rows[-1]["bytes_per_token_formula"] == 2944  # nan -> None


def test_read_summary_refuses_other_columns(tmp_path):
    path = tmp_path / "summary.csv"
    path.write_text("scheme,ppl\nfp16,20\n")
    with pytest.raises(ValueError, match="bytes_per_token_measured"):
        read_summary(path)


def test_disabled_writes_nothing(tmp_path, wandb_env):
    run_dir = make_run_dir(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    log_run(run_dir, "disabled", project="p", group="g")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert not (run_dir / "wandb").exists() and not wandb_env.exists()


def test_unknown_mode_names_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="online, offline, disabled"):
        log_run(make_run_dir(tmp_path), "upload")


def test_offline_writes_one_run_per_scheme_and_a_comparison(tmp_path, wandb_env, init_spy, monkeypatch):
    import wandb

    inits = init_spy
    titles: list[str] = []
    real_lines = wandb.plot.line_series

    def lines_spy(**kwargs):
        titles.append(kwargs["title"])
        return real_lines(**kwargs)

    monkeypatch.setattr(wandb.plot, "line_series", lines_spy)
    run_dir = make_run_dir(tmp_path)
    log_run(run_dir, "offline", project="kvq-test", group="g1")

    names = [i["name"] for i in inits]
    # the report's names: the reference as what it computes in, the preset by its name (not its expansion)
    assert names == [*SHOWN, "int8", "compare"]
    assert {i["group"] for i in inits} == {"g1"} and {i["project"] for i in inits} == {"kvq-test"}
    cfg = inits[1]["config"]
    assert cfg["scheme"] == "int4-g64" and cfg["num_documents"] == 1 and cfg["run"] == run_dir.name
    kivi = inits[3]["config"]
    assert (kivi["scheme"], kivi["scheme_label"], kivi["scheme_spec"]) == ("kivi-2", KIVI, KIVI)
    ref = inits[0]["config"]
    assert (
        ref["scheme"] == "fp32 (reference)" and ref["is_reference"] and ref["reference"] == "fp32 (reference)"
    )
    assert "scheme_names" not in ref and {i["job_type"] for i in inits[:-1]} == {"cache"}

    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == len(names)
    for run in runs:
        assert list(run.glob("*.wandb")), f"{run} holds no .wandb log"
    media = run_dir / "wandb"
    tables = {p.name.split("_")[0] for p in media.rglob("*.table.json")}
    assert {"buckets", "summary", "comparison"} <= tables
    images = {p.name.rsplit("_", 2)[0] for p in media.rglob("media/images/plots/*.png")}
    assert images == {"drift_vs_length", "bytes_per_token"}
    line = json.loads(next(media.rglob("drift_vs_length_table_*.table.json")).read_text())
    assert line["columns"] == ["step", "lineKey", "lineVal"]
    # each quantized scheme with its 95% interval; the reference (the zero line) left out, as in the report
    assert [1024, "int2-g32", 0.4] in line["data"] and [1024, "int2-g32 hi", 0.6] in line["data"]
    assert [1024, "kivi-2 lo", 0.05] in line["data"]
    keys = {d[1] for d in line["data"]}
    assert keys == {f"{n}{sfx}" for n in SHOWN[1:] for sfx in ("", " lo", " hi")}
    kl = json.loads(next(media.rglob("kl_vs_length_table_*.table.json")).read_text())
    assert [1024, "int2-g32", 0.04] in kl["data"] and [1024, "int2-g32 lo", 0.02] in kl["data"]
    comparison = json.loads(next(media.rglob("comparison_*.table.json")).read_text())
    assert comparison["columns"][:3] == ["scheme", "mode", "bucket"] and "kl_hi" in comparison["columns"]
    whole = {(r[0], r[2]): dict(zip(comparison["columns"], r, strict=True)) for r in comparison["data"]}
    assert whole[("kivi-2", "all")]["drift_lo"] == pytest.approx(0.05)
    bars = json.loads(next(media.rglob("bytes_per_token_table_*.table.json")).read_text())
    assert dict(bars["data"]) == pytest.approx(
        {"fp32 (reference)": 5760, "int4-g64": 1440, "int2-g32": 5760 / 7, "kivi-2": 960, "int8": 2944}
    )
    summary = json.loads(next(media.rglob("summary_*.table.json")).read_text())
    assert summary["columns"] == [*SUMMARY_COLUMNS, "scheme_label"]
    assert {r[0] for r in summary["data"]} == {*SHOWN, "int8"}  # shown names, the label beside them
    # offline summaries live only in the binary .wandb log (protobuf; strings stay readable)
    logs = b"".join(p.read_bytes() for p in media.rglob("run-*.wandb"))
    assert re.search(rb"all/drift[^0-9a-z]{1,6}0\.4(?![0-9])", logs)  # int2-g32's whole-document drift
    assert b"seq_len" in logs and b"kvq-test" in logs and b"all/kl_hi" in logs
    # the charts name the reference by its shown name. (Checked on the titles handed to W&B: in the log a
    # chart's title is a config record of wandb-core's ("visualize"), which one CI run found missing from a
    # finished offline log on a busy machine; not reproduced in 12 runs here.)
    assert titles == ["PPL drift vs fp32 (reference) by sequence length [95% interval]",
                      "KL vs fp32 (reference) (nats/token) by sequence length [95% interval]"]


def test_display_name_follows_the_report():
    config = {"reference": "fp16", "scheme_names": NAMES}
    assert wandb_logger.display_name("fp16", config) == "fp32 (reference)"
    assert wandb_logger.display_name(KIVI, config) == "kivi-2"
    assert wandb_logger.display_name("int8", config) == "int8"
    assert wandb_logger.display_name("fp16", {"reference": "fp16"}) == "fp16 (reference)"  # an old run dir


RETRIEVAL_COLUMNS = wandb_logger.RETRIEVAL_COLUMNS


def make_retrieval_dir(root: Path) -> Path:
    run_dir = root / "smollm2-passkey-abc123"
    run_dir.mkdir()
    config = {
        "task": "passkey",
        "schemes": ["fp16", "int4-g64", KIVI],
        "reference": "fp16",
        "scheme_names": NAMES,
        "lengths": [256, 512],
        "depths": [0.5],
        "trials": 2,
        "mode": "cache",
    }
    (run_dir / "config.json").write_text(json.dumps(config))
    exact = {"fp16": (1.0, 1.0), "int4-g64": (1.0, 0.5), KIVI: (0.5, 0.0)}
    with open(run_dir / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=RETRIEVAL_COLUMNS)
        w.writeheader()
        for scheme, (e256, e512) in exact.items():
            cells = [
                (256, "0.5", e256),
                (512, "0.5", e512),
                (256, "all", e256),
                (512, "all", e512),
                ("all", "all", (e256 + e512) / 2),
            ]
            for length, depth, e in cells:
                w.writerow(
                    dict(
                        task="passkey",
                        scheme=scheme,
                        mode="cache",
                        length=length,
                        depth=depth,
                        trials=2,
                        exact_match=e,
                        first_token_match=e,
                        answer_logprob=-1 + e,
                        answer_logprob_delta=e - 1,
                        same_as_ref=e,
                        bytes_per_token=100,
                        saving=2.0,
                        status="ok",
                    )
                )
    Image.new("RGB", (8, 8), "white").save(run_dir / "heatmap-kivi-2.png")
    return run_dir


def test_retrieval_runs_are_logged_by_length(tmp_path, wandb_env, init_spy):
    run_dir = make_retrieval_dir(tmp_path)
    log_run(run_dir, "offline", project="kvq-test")
    assert [i["name"] for i in init_spy] == ["fp32 (reference)", "int4-g64", "kivi-2", "compare"]
    assert {i["group"] for i in init_spy} == {run_dir.name}
    assert init_spy[2]["config"]["task"] == "passkey" and init_spy[2]["config"]["scheme"] == "kivi-2"
    media = run_dir / "wandb"
    line = json.loads(next(media.rglob("exact_match_vs_length_table_*.table.json")).read_text())
    assert [512, "int4-g64", 0.5] in line["data"] and [256, "kivi-2", 0.5] in line["data"]
    bars = json.loads(next(media.rglob("exact_match_table_*.table.json")).read_text())
    assert dict(bars["data"]) == pytest.approx({"fp32 (reference)": 1.0, "int4-g64": 0.75, "kivi-2": 0.25})
    assert {p.name.rsplit("_", 2)[0] for p in media.rglob("media/images/plots/*.png")} == {"heatmap-kivi-2"}
    logs = b"".join(p.read_bytes() for p in media.rglob("run-*.wandb"))
    assert b"all/exact_match" in logs and b"length" in logs


def make_serve_dir(root: Path) -> Path:
    from kvquant.eval.serve import SUMMARY_COLUMNS as SERVE_COLUMNS

    run_dir = root / "serve-abc123"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"kind": "serve", "schemes": ["fp16", "kivi-2"]}))
    with open(run_dir / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SERVE_COLUMNS)
        w.writeheader()
        for scheme, fit, peak in (("fp16", 4, 9000), ("kivi-2", 17, 2400)):
            for policy in ("lru", "none"):
                w.writerow(
                    {c: "" for c in SERVE_COLUMNS}
                    | dict(
                        scheme=scheme,
                        prefix_cache="True",
                        policy=policy,
                        requests=8,
                        ttft_mean_s=0.5,
                        peak_bytes=peak,
                        fit_requests=fit,
                        failed_requests=0,
                    )
                )
    return run_dir


def test_serve_runs_are_logged_per_scheme(tmp_path, wandb_env, init_spy):
    from kvquant.eval import serve

    run_dir = make_serve_dir(tmp_path)
    serve.log_to_wandb(run_dir, "offline", "kvq-test", None)  # what experiments/serve.py calls
    assert [i["name"] for i in init_spy] == ["fp16", "kivi-2", "compare"]
    assert {i["group"] for i in init_spy} == {run_dir.name} and init_spy[1]["config"]["task"] == "serve"
    media = run_dir / "wandb"
    bars = json.loads(next(media.rglob("fit_requests_table_*.table.json")).read_text())
    assert dict(bars["data"]) == {"fp16": 4, "kivi-2": 17}
    assert list(media.rglob("rows_*.table.json")) and list(media.rglob("summary_*.table.json"))


def test_run_py_logs_a_passkey_run(tmp_path, monkeypatch):
    """`--task passkey --wandb offline` reaches the W&B logger (it returned before it once)."""
    spec = importlib.util.spec_from_file_location("kvquant_run_cli2", REPO / "experiments" / "run.py")
    run_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_py)
    run_dir = make_retrieval_dir(tmp_path)
    import kvquant.eval.runner as runner

    monkeypatch.setattr(runner, "run", lambda config, model=None, tokenizer=None: (run_dir, []))
    logged = []
    monkeypatch.setattr(run_py, "log_to_wandb", lambda d, c: logged.append(d))
    config = run_py.config_from_args(
        run_py.build_parser().parse_args(["--task", "passkey", "--wandb", "offline"])
    )
    run_py.main(config)
    assert logged == [run_dir]


def test_lm_eval_runs_get_a_group_name_and_top_level_scheme(monkeypatch):
    from kvquant.eval import lm_eval_cli, lm_eval_model

    argv = [
        "run",
        "--model",
        "kvquant",
        "--model_args",
        "scheme=kivi-2,chunk=64",
        "--tasks",
        "kvquant_mmlu",
        "--wandb_args",
        "project=p",
    ]
    assert lm_eval_cli.wandb_defaults(argv) == {
        "WANDB_RUN_GROUP": "lm-eval kvquant_mmlu",
        "WANDB_NAME": "kivi-2",
    }
    assert lm_eval_cli.wandb_defaults(argv[:-2]) == {}  # no W&B run: nothing set
    semi = ["--model_args", "scheme=k=int4-channel-g64;v=int4-g64", "--wandb_args", "project=p"]
    assert lm_eval_cli.wandb_defaults(semi)["WANDB_NAME"] == "k=int4-channel-g64,v=int4-g64"

    class Run:  # the run lm-eval's WandbLogger started before the model was built
        def __init__(self):
            self.config = {}

    class Config(dict):
        def update(self, values, allow_val_change=False):
            super().update(values)

    run = Run()
    run.config = Config()
    fake_wandb = type(sys)("wandb")
    fake_wandb.run = run
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    lm = lm_eval_model.KVQuantLM.__new__(lm_eval_model.KVQuantLM)
    lm.scheme, lm.chunk, lm.kv_backend = kvquant.parse_scheme("kivi-2"), 64, "torch"
    lm._tag_wandb_run()
    assert run.config["scheme"] == "kivi-2" and run.config["scheme_spec"] == KIVI
    assert run.config["kv_chunk"] == 64


def test_under_a_sweep_agent_one_run_holds_the_swept_scheme_and_the_charts(
    tmp_path, wandb_env, init_spy, monkeypatch
):
    monkeypatch.setenv("WANDB_SWEEP_ID", "sweep42")  # what `wandb agent` sets for the process it starts
    monkeypatch.setenv("WANDB_RUN_ID", "agentrun1")
    run_dir = make_run_dir(tmp_path)
    log_run(run_dir, "offline")
    assert [i["name"] for i in init_spy] == ["int4-g64"]  # the first scheme that is not the fp16 reference
    assert init_spy[0]["project"] == "kvquant" and init_spy[0]["group"] == run_dir.name
    (run,) = (run_dir / "wandb").glob("offline-run-*")
    assert run.name.endswith("agentrun1")
    assert list(run.rglob("drift_vs_length_table_*.table.json")) and list(run.rglob("buckets_*.table.json"))


def test_sweep_config_invokes_run_py_with_swept_args():
    sweep = yaml.safe_load((REPO / "experiments" / "configs" / "sweep.yaml").read_text())
    assert sweep["program"] == "experiments/run.py"
    assert {"scheme", "max-length"} <= set(sweep["parameters"])
    assert "${args}" in sweep["command"] and "--wandb=online" in sweep["command"]
    schemes = sweep["parameters"]["scheme"]["values"]
    assert len(schemes) >= 3
    for scheme in schemes:
        kvquant.parse_scheme(scheme)  # every swept value is a valid scheme


def test_sweep_args_parse_with_run_py():
    """The flags a W&B agent builds from sweep.yaml (`--name=value`) are ones experiments/run.py accepts."""
    sweep = yaml.safe_load((REPO / "experiments" / "configs" / "sweep.yaml").read_text())
    spec = importlib.util.spec_from_file_location("kvquant_run_cli", REPO / "experiments" / "run.py")
    run_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_py)
    args = [
        f"--{k}={v['values'][-1] if 'values' in v else v['value']}" for k, v in sweep["parameters"].items()
    ]
    args += [a for a in sweep["command"] if a.startswith("--")]
    ns = run_py.build_parser().parse_args(args)
    assert ns.scheme == [sweep["parameters"]["scheme"]["values"][-1]] and ns.wandb == "online"


def test_cli_entry(tmp_path, wandb_env):
    run_dir = make_run_dir(tmp_path)
    wandb_logger.main([str(run_dir), "--mode", "disabled"])
    assert not (run_dir / "wandb").exists()
