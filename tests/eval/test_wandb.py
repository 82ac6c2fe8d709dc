"""W&B logging of a run directory: offline runs on disk, nothing at all when disabled.

The run directory is a small fake one built here (config.json, summary.csv, two PNGs), so these tests do not
depend on the evaluation code that normally writes it."""

from __future__ import annotations

import csv
import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml
from kvquant.eval import wandb_logger
from kvquant.eval.wandb_logger import SUMMARY_COLUMNS, log_run, read_summary
from PIL import Image

import kvquant

SCHEMES = {"fp16": 0.0, "int4-g64": 0.02, "int2-g32": 0.4}  # scheme -> drift at the last bucket
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
        "scheme_names": {"fp16": "fp32 (reference)"},  # a run computing in float32, as on the CPU
    }
    (run_dir / "config.json").write_text(json.dumps(config))
    with open(run_dir / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS)
        w.writeheader()
        for scheme, drift in SCHEMES.items():
            bpt = 5760.0 if scheme == "fp16" else 5760.0 / (4 if scheme == "int4-g64" else 7)
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
                        kl=f"{d / 10:.6g}",
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


def test_offline_writes_one_run_per_scheme_and_a_comparison(tmp_path, wandb_env, init_spy):
    inits = init_spy
    run_dir = make_run_dir(tmp_path)
    log_run(run_dir, "offline", project="kvq-test", group="g1")

    names = [i["name"] for i in inits]
    assert names == [*SCHEMES, "int8", "compare"]
    assert {i["group"] for i in inits} == {"g1"} and {i["project"] for i in inits} == {"kvq-test"}
    assert inits[1]["config"]["scheme"] == "int4-g64" and inits[1]["config"]["num_documents"] == 1

    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == len(names)
    for run in runs:
        assert list(run.glob("*.wandb")), f"{run} holds no .wandb log"
    media = run_dir / "wandb"
    tables = {p.name.split("_")[0] for p in media.rglob("*.table.json")}
    assert {"buckets", "summary"} <= tables
    images = {p.name.rsplit("_", 2)[0] for p in media.rglob("media/images/plots/*.png")}
    assert images == {"drift_vs_length", "bytes_per_token"}
    line = json.loads(next(media.rglob("drift_vs_length_table_*.table.json")).read_text())
    assert line["columns"] == ["step", "lineKey", "lineVal"]
    assert [1024, "int2-g32", 0.4] in line["data"] and {d[1] for d in line["data"]} == set(SCHEMES)
    bars = json.loads(next(media.rglob("bytes_per_token_table_*.table.json")).read_text())
    assert dict(bars["data"]) == pytest.approx(
        {"fp16": 5760, "int4-g64": 1440, "int2-g32": 5760 / 7, "int8": 2944}
    )
    # offline summaries live only in the binary .wandb log (protobuf; strings stay readable)
    logs = b"".join(p.read_bytes() for p in media.rglob("run-*.wandb"))
    assert re.search(rb"all/drift[^0-9a-z]{1,6}0\.4(?![0-9])", logs)  # int2-g32's whole-document drift
    assert b"seq_len" in logs and b"kvq-test" in logs
    assert b"PPL drift vs fp32 (reference) by sequence length" in logs  # the reference by its name


def test_under_a_sweep_agent_one_run_holds_the_swept_scheme_and_the_charts(tmp_path, wandb_env, init_spy,
                                                                            monkeypatch):
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
