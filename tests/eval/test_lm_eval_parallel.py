"""lm-eval at scale: data-parallel ranks (torchrun / accelerate launch, gloo on the CPU) give one process's
metrics and samples; batch size N gives batch 1's numbers; the model splits across devices by a map.

Everything runs on the tiny random Llama (the eval conftest's folder, with the real tokenizer), offline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvquant.eval.lm_eval_model import KVQuantLM, _batches
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "eval" / "tasks"
HANG_LIMIT_S = 30 * 60  # catches a hang (a rank waiting forever at a gather), never a slow machine
# nats per request between batch N and batch 1 (or ranks holding other batch partners): MKL's sgemm rounds a
# row by the class of the product's row count, so a 1-token scoring forward (1 row at batch 1, B rows at
# batch B) takes another kernel. Measured: <= 1.6e-5 here, 4.1e-5 on the default model (docs/scale.md).
# Under _RowByRowGemm the same runs are equal bit for bit (test_batched_scores_are_batch_1s_bits).
ATOL = 1e-4

CONTEXT = "The cache of keys and values grows with every token, so long documents"
REQUESTS = [
    (CONTEXT, " need memory."),  # one prefix, three continuations of different lengths (right padding)
    (CONTEXT, " fit in four bits per value and a scale per group."),
    (CONTEXT, " grow"),
    ("Quantization", " keeps"),
    ("One two three four five six seven eight nine ten eleven twelve", " thirteen fourteen"),
    ("The cache of keys and values grows", " with every token"),  # same prefix length as the next, distinct
    ("Two words and three words", " more"),
    ("Two words", " less or more"),
]
ROLLING = "the quantized cache keeps four bits per value and a scale per group " * 6  # ~80 tokens


def make_lm(path, scheme="fp16", chunk=5, **kw) -> KVQuantLM:
    return KVQuantLM(pretrained=str(path), scheme=scheme, chunk=chunk, device="cpu", max_length=32, **kw)


def scores(lm: KVQuantLM):
    ll = lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(REQUESTS)],
                          disable_tqdm=True)
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (ROLLING,), 0)],
                                       disable_tqdm=True)
    return ll, rolling


def test_batches_group_equal_prefix_lengths():
    prefixes = [(1, 2), (1, 2), (3,), (1, 2), (4, 5), (), (7, 8)]
    assert _batches(prefixes, 1) == [[i] for i in range(7)]
    groups = _batches(prefixes, 3)
    assert sorted(i for g in groups for i in g) == list(range(7))
    for g in groups:
        assert len(g) <= 3 and len({len(prefixes[i]) for i in g}) == 1
    assert [0, 1, 3] in groups  # equal prefixes sit together


@pytest.mark.parametrize("scheme", ["fp16", "kivi-2", "int2-g32,window=8"])
def test_batched_scores_equal_batch_1(tiny_model_dir, scheme):
    """Padded requests through one cache (right padding, shared and distinct prefixes, rolling windows) give
    batch 1's log-likelihoods and greedy flags."""
    (ll1, roll1), (ll4, roll4) = scores(make_lm(tiny_model_dir, scheme)), scores(
        make_lm(tiny_model_dir, scheme, batch_size=4)
    )
    for (a, a_greedy), (b, b_greedy) in zip(ll1, ll4, strict=True):
        assert abs(a - b) <= ATOL and a_greedy == b_greedy
    assert abs(roll1[0] - roll4[0]) <= ATOL


class _RowByRowGemm(TorchDispatchMode):
    """Every matrix product computed one row of its output at a time, so each row takes one GEMM kernel
    whatever the batch. MKL's sgemm picks its kernel by the row count (on this AVX-512 Xeon a row rounds
    alike within {1}, {2-15} and {16+} rows: benchmarks/row_invariance.py), so without this, batch N and
    batch 1 round the same row differently; with it, any difference left is kvquant's own."""

    _ROWS = {torch.ops.aten.mm.default: 0, torch.ops.aten.addmm.default: 1}
    _aten = torch.ops.aten
    _REFUSED = {_aten.baddbmm.default, _aten.addbmm.default, _aten.mv.default, _aten.addmv.default,
                _aten._scaled_dot_product_flash_attention_for_cpu.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._ROWS:  # mm(a, b) / addmm(bias, a, b): a (M, K)
            i = self._ROWS[func]
            a = args[i]
            return torch.cat([func(*args[:i], a[m : m + 1], *args[i + 1 :], **kwargs) for m in range(len(a))])
        if func is torch.ops.aten.bmm.default:  # (N, M, K) @ (N, K, P): one (1, K) @ (K, P) per row
            a, b = args
            return torch.stack([torch.cat([torch.ops.aten.mm.default(a[n, m : m + 1], b[n])
                                           for m in range(a.shape[1])]) for n in range(a.shape[0])])
        if func in self._REFUSED:
            raise NotImplementedError(f"_RowByRowGemm does not split {func}; add it before trusting a result")
        return func(*args, **kwargs)


@pytest.mark.parametrize("scheme", ["fp16", "int2-g32", "int2-g32,window=8", "int4-g32,sink=4",
                                    "k=int4-channel-g32-rot,v=int4-g32-rot,sink=4,window=8"])
def test_batched_scores_are_batch_1s_bits(tiny_model_dir, scheme):
    """With every GEMM row-invariant, batch 4 (shared and distinct prefixes, right padding, windows pushed by
    pads, rolling windows) gives batch 1's log-likelihoods bit for bit: the padding and prefix sharing change
    no number, and ATOL above covers the GEMM kernels alone. (Before the attention merged its partial
    softmaxes one batch row at a time, int2-g32,window=8 differed here by 1.5e-5.)"""
    one, four = make_lm(tiny_model_dir, scheme), make_lm(tiny_model_dir, scheme, batch_size=4)
    with _RowByRowGemm():
        (ll1, roll1), (ll4, roll4) = scores(one), scores(four)
    assert ll4 == ll1 and roll4 == roll1


def test_batched_quantized_scores_still_differ_from_fp16(tiny_model_dir):
    fp16, _ = scores(make_lm(tiny_model_dir, "fp16", batch_size=4))
    int2, _ = scores(make_lm(tiny_model_dir, "int2-g32", batch_size=4))
    assert max(abs(a[0] - b[0]) for a, b in zip(fp16, int2, strict=True)) > 1e-2


def test_generation_runs_one_at_a_time_at_any_batch_size(tiny_model_dir):
    req = [Instance("generate_until", {}, (c, {"until": ["\n\n"], "max_gen_toks": 5}), i)
           for i, c in enumerate([CONTEXT, "Quantization keeps"])]
    one = make_lm(tiny_model_dir, "int4-g32", chunk=4).generate_until(req, disable_tqdm=True)
    four = make_lm(tiny_model_dir, "int4-g32", chunk=4, batch_size=4)
    assert four.generate_until(req, disable_tqdm=True) == one and four.batch_size_per_gpu == 4


@pytest.mark.parametrize(
    "args, error, match",
    [
        ({"batch_size": "auto"}, ValueError, "batch_size='auto'.*integer batch size"),
        ({"batch_size": 0}, ValueError, "batch_size=0 must be a positive integer"),
        ({"device_map": "nowhere.json"}, FileNotFoundError, "neither a strategy"),
        ({"device_map": {"model": "disk"}}, ValueError, "offloading to disk"),
        ({"parallelize": True}, ValueError, "takes device_map=auto"),
    ],
)
def test_bad_batch_and_map_args(args, error, match):
    from kvquant.eval.lm_eval_cli import check_model_args

    with pytest.raises(error, match=match):
        check_model_args(args)


def test_device_map_model_arg(tmp_path, tiny_model_dir):
    """device_map=FILE in --model_args: the model loads through the map, pages sit on each layer's device,
    and the numbers are the unmapped model's."""
    from kvquant import models

    layers = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
    dmap = {"model.embed_tokens": "cpu", **{f"model.layers.{i}": "cpu" for i in range(layers)},
            "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    (tmp_path / "map.json").write_text(json.dumps(dmap))
    args = f"pretrained={tiny_model_dir},scheme=int4-g32,chunk=5,max_length=32"
    lm = get_model("kvquant").create_from_arg_string(
        f"{args},device_map={tmp_path / 'map.json'}",
        {"device": "cpu", "batch_size": 2},
    )
    assert str(lm.device) == "cpu" and lm.batch_size_per_gpu == 2
    want = make_lm(tiny_model_dir, "int4-g32").loglikelihood(
        [Instance("loglikelihood", {}, r, i) for i, r in enumerate(REQUESTS[:3])], disable_tqdm=True
    )
    got = lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(REQUESTS[:3])],
                           disable_tqdm=True)
    assert all(abs(a[0] - b[0]) <= ATOL for a, b in zip(got, want, strict=True))
    cache = lm.new_cache()
    lm._feed(cache, [[5, 6, 7, 8, 9, 10]])
    assert models.check_pages_placed(lm.model, cache) == dict.fromkeys(range(layers), "cpu")


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TQDM_DISABLE": "1",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled",
            "PYTHONPATH": str(REPO)}


def _tool(name: str, module: str) -> list[str]:
    exe = shutil.which(name, path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", module]


def _samples(out: Path) -> tuple[dict, dict]:
    """(metrics, {doc_id: [(log-likelihood, greedy) per choice]}) of an lm-eval output folder. A rank with
    fewer docs pads with copies of its last request, which lm-eval appends to that request's resps: the
    first response is the request's own."""
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    rows = [json.loads(line) for line in next(out.rglob("samples_kvquant_mmlu_*.jsonl")).open()]
    return results, {r["doc_id"]: [(float(c[0][0]), c[0][1]) for c in r["resps"]] for r in rows}


@pytest.mark.slow  # five fresh interpreters, each indexing lm-eval's built-in tasks (~1-2 min in all)
def test_scale_commands_give_one_process_metrics(tmp_path, tiny_model_dir):
    """docs/scale.md's lm-eval commands as written there, plus a tiny model and --limit 3 (uneven ranks):
    2 ranks under accelerate launch (gloo on the CPU) and one process with the model placed by a device-map
    file give the same responses, bit for bit, and metrics; 2 ranks under torchrun with batch size 2 give
    them within batched-GEMM rounding (a request's batch partners differ with the ranks) and equal metrics."""
    layers = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
    dmap = {"model.embed_tokens": "cpu", **{f"model.layers.{i}": "cpu" for i in range(layers)},
            "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    (tmp_path / "map.json").write_text(json.dumps(dmap))
    args = f"pretrained={tiny_model_dir},scheme=int4-g64,chunk=256"
    task = ["--include_path", str(TASKS), "--tasks", "kvquant_mmlu", "--limit", "3", "--log_samples"]
    entry = ["-m", "kvquant.eval.lm_eval_cli", "--model", "kvquant"]
    commands = {
        "torchrun": [*_tool("torchrun", "torch.distributed.run"), "--standalone", "--nproc-per-node", "2",
                     *entry, "--model_args", args, "--batch_size", "2", *task],
        "accelerate": [*_tool("accelerate", "accelerate.commands.launch"), "launch", "--multi_gpu",
                       "--num_processes", "2", *entry, "--model_args", args, *task],
        "device_map": [*_tool("kvquant-lm-eval", "kvquant.eval.lm_eval_cli"), "--model", "kvquant",
                       "--model_args", f"{args},device_map={tmp_path / 'map.json'}", "--device", "cpu",
                       *task],
    }
    procs = {
        name: subprocess.Popen([*cmd, "--output_path", str(tmp_path / name)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=_env())
        for name, cmd in commands.items()
    }
    try:
        logs = {name: p.communicate(timeout=HANG_LIMIT_S)[0] for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
    for name, p in procs.items():
        assert p.returncode == 0, (name, logs[name][-4000:])
    runs = {name: _samples(tmp_path / name) for name in commands}
    assert "Building contexts for kvquant_mmlu on rank 1" in logs["torchrun"] + logs["accelerate"]
    assert sorted(runs["device_map"][1]) == [0, 1, 2]
    assert runs["accelerate"] == runs["device_map"]
    (want_metrics, want), (metrics, got) = runs["device_map"], runs["torchrun"]
    assert metrics == want_metrics and sorted(got) == sorted(want)
    for doc, choices in want.items():
        for (a, a_greedy), (b, b_greedy) in zip(choices, got[doc], strict=True):
            assert abs(a - b) <= ATOL and a_greedy == b_greedy, (doc, a, b)
