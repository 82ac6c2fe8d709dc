"""The lm-eval model `kvquant`: requests really pass through the quantized cache.

fp16 must reproduce stock HFLM (one prefill forward, no cache) within 1e-4 nats per request whatever the
chunking; int2-g32 must move the numbers. Everything runs on the tiny random Llama, offline."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from kvquant.eval.lm_eval_model import KVQuantLM, choice_agreement
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

import kvquant

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "eval" / "tasks"
HANG_LIMIT_S = 30 * 60  # a subprocess limit that only catches a hang, never a slow machine
ATOL = 1e-4  # nats per request: fp32 sums over different chunkings of the same attention

CONTEXT = "The cache of keys and values grows with every token, so long documents"
REQUESTS = [
    (CONTEXT, " need memory."),  # two continuations of one context: the second reuses the prefix cache
    (CONTEXT, " fit in four bits per value and a scale per group."),
    ("Quantization", " keeps"),
    ("One two three four five six seven eight nine ten eleven twelve", " thirteen fourteen"),
]
ROLLING = "the quantized cache keeps four bits per value and a scale per group " * 6  # ~80 tokens


def ll(requests):
    return [Instance("loglikelihood", {}, r, i) for i, r in enumerate(requests)]


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open an internet socket fails the test (Unix sockets stay allowed)."""
    real = socket.socket.connect

    def connect(self, address):
        if self.family == socket.AF_UNIX:
            return real(self, address)
        raise AssertionError(f"network access attempted: {address}")

    monkeypatch.setattr(socket.socket, "connect", connect)


@pytest.fixture(scope="module")
def stock(tiny_model_dir):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(tiny_model_dir), device="cpu", dtype="float32", batch_size=1, max_length=32)


def make_lm(path, scheme="fp16", chunk=5, **kw) -> KVQuantLM:
    return KVQuantLM(pretrained=str(path), scheme=scheme, chunk=chunk, device="cpu", max_length=32, **kw)


def test_registered():
    assert get_model("kvquant") is KVQuantLM


@pytest.mark.parametrize("chunk", [1, 5, 1024])
def test_fp16_matches_stock_hflm(tiny_model_dir, stock, chunk):
    got = make_lm(tiny_model_dir, "fp16", chunk).loglikelihood(ll(REQUESTS), disable_tqdm=True)
    want = stock.loglikelihood(ll(REQUESTS), disable_tqdm=True)
    for (g, g_greedy), (w, w_greedy) in zip(got, want, strict=True):
        assert abs(g - w) <= ATOL and g_greedy == w_greedy


def test_int2_changes_loglikelihoods(tiny_model_dir, stock):
    got = make_lm(tiny_model_dir, "int2-g32", chunk=5).loglikelihood(ll(REQUESTS), disable_tqdm=True)
    want = stock.loglikelihood(ll(REQUESTS), disable_tqdm=True)
    assert max(abs(g[0] - w[0]) for g, w in zip(got, want, strict=True)) > 1e-2


def test_rolling_runs_through_the_cache(tiny_model_dir, stock):
    req = [Instance("loglikelihood_rolling", {}, (ROLLING,), 0)]
    want = stock.loglikelihood_rolling(req, disable_tqdm=True)  # several 32-token windows
    fp16 = make_lm(tiny_model_dir, "fp16", chunk=7).loglikelihood_rolling(req, disable_tqdm=True)
    int2 = make_lm(tiny_model_dir, "int2-g32", chunk=7).loglikelihood_rolling(req, disable_tqdm=True)
    assert abs(fp16[0] - want[0]) <= ATOL
    assert abs(int2[0] - want[0]) > 1e-2


def test_generate_until_uses_the_cache(tiny_model_dir, stock, monkeypatch):
    req = [Instance("generate_until", {}, (CONTEXT, {"until": ["\n\n"], "max_gen_toks": 6}), 0)]
    lm = make_lm(tiny_model_dir, "fp16", chunk=4)
    caches = []
    new_cache = lm.new_cache
    monkeypatch.setattr(lm, "new_cache", lambda: caches.append(new_cache()) or caches[-1])
    out = lm.generate_until(req, disable_tqdm=True)
    assert out == stock.generate_until(req, disable_tqdm=True)  # greedy: same text as without a cache
    n_ctx = len(lm.tok_encode(CONTEXT))
    assert len(caches) == 1 and caches[0].get_seq_length() >= n_ctx + 4  # the context and generated tokens
    int2 = make_lm(tiny_model_dir, "int2-g32", chunk=4).generate_until(req, disable_tqdm=True)
    assert isinstance(int2[0], str)


@pytest.mark.parametrize(
    "args, error, match",
    [
        ("scheme=int5-g64", kvquant.SchemeError, r"int4-g64.*kivi-2"),  # lists the known schemes
        ("scheme=int4-g64,backend=cuda-magic", ValueError, "known backends: auto, triton, torch"),
        ("scheme=int4-g64,chunk=0", ValueError, "chunk=0 must be a positive integer"),
        ("scheme=int4-g64,dtype=float8", ValueError, "known dtypes"),
    ],
)
def test_bad_model_args_fail_clearly(tiny_model_dir, args, error, match):
    with pytest.raises(error, match=match):
        get_model("kvquant").create_from_arg_string(f"pretrained={tiny_model_dir},{args}", {"device": "cpu"})


def test_missing_model_path_fails_clearly(tmp_path, no_network):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="never downloads from the hub"):
        get_model("kvquant").create_from_arg_string(
            f"pretrained={missing},scheme=int4-g64", {"device": "cpu"}
        )


def test_scheme_with_commas_uses_semicolons(tiny_model_dir):
    lm = get_model("kvquant").create_from_arg_string(
        f"pretrained={tiny_model_dir},scheme=k=int4-channel-g64;v=int4-g64;window=8,chunk=16",
        {"device": "cpu"},
    )
    assert lm.scheme == kvquant.parse_scheme("k=int4-channel-g64,v=int4-g64,window=8") and lm.chunk == 16


def write_task(root: Path) -> Path:
    """A tiny offline multiple-choice task: a YAML and its data loader."""
    (root / "tiny_utils.py").write_text(
        textwrap.dedent("""
        import datasets

        def load(**_):
            rows = [{"q": f"{a} plus {b} is", "choices": [str(a + b), str(a + b + 1)], "label": 0}
                    for a, b in [(1, 2), (3, 4), (5, 6), (2, 2)]]
            return {"test": datasets.Dataset.from_list(rows)}
    """)
    )
    (root / "kvq_tiny.yaml").write_text(
        textwrap.dedent("""
        task: kvq_tiny
        custom_dataset: !function tiny_utils.load
        output_type: multiple_choice
        test_split: test
        doc_to_text: "{{q}}"
        doc_to_choice: "{{choices}}"
        doc_to_target: label
        metric_list:
          - metric: acc
        metadata:
          version: 1.0
    """)
    )
    return root


def task_manager(*paths: Path):
    from lm_eval.tasks import TaskManager

    # include_defaults=False: indexing lm-eval's thousands of built-in YAMLs takes ~20 s here
    return TaskManager(include_path=[str(p) for p in paths], include_defaults=False)


def test_simple_evaluate_end_to_end(tmp_path, tiny_model_dir, no_network):
    """A tiny local task and the shipped MMLU task, through lm_eval.simple_evaluate, with sockets blocked."""
    import lm_eval

    tm = task_manager(write_task(tmp_path), TASKS)
    runs = {}
    for scheme in ("fp16", "int2-g32"):
        out = lm_eval.simple_evaluate(
            model="kvquant",
            model_args=f"pretrained={tiny_model_dir},scheme={scheme},chunk=8",
            tasks=["kvq_tiny", "kvquant_mmlu"],
            limit=2 if scheme == "fp16" else 1,
            task_manager=tm,
            device="cpu",
            log_samples=True,
            bootstrap_iters=0,
        )
        for task in ("kvq_tiny", "kvquant_mmlu"):
            assert 0.0 <= out["results"][task]["acc,none"] <= 1.0
        assert out["config"]["model_args"].endswith("chunk=8")
        runs[scheme] = out["samples"]
    assert len(runs["fp16"]["kvq_tiny"]) == 2 and len(runs["fp16"]["kvquant_mmlu"][0]["resps"]) == 4
    assert choice_agreement(runs["fp16"]["kvq_tiny"], runs["fp16"]["kvq_tiny"]) == 1.0
    assert choice_agreement(runs["fp16"]["kvquant_mmlu"], runs["int2-g32"]["kvquant_mmlu"]) in (0.0, 1.0)


def test_shipped_tasks_load_offline(no_network):
    """The shipped YAMLs resolve against local data only (Wikipedia parsing takes ~20 s: a slow test)."""
    tasks = task_manager(TASKS).load(["kvquant_shakespeare", "kvquant_mmlu"])["tasks"]
    plays = list(tasks["kvquant_shakespeare"].test_docs())
    assert len(plays) == 38 and all(len(p["text"]) > 50_000 for p in plays)
    mmlu = tasks["kvquant_mmlu"].test_docs()
    assert len(mmlu) == 14042  # 14044 lines minus the two header rows in the middle of the file
    assert set(mmlu["label"]) == {0, 1, 2, 3} and "question" not in set(mmlu["question"])


@pytest.mark.slow
def test_wikipedia_task_loads_offline(no_network):
    tasks = task_manager(TASKS).load(["kvquant_wikipedia"])["tasks"]
    assert len(tasks["kvquant_wikipedia"].test_docs()) > 100


GUARD = """
import socket
_connect = socket.socket.connect
def connect(self, address):
    if self.family == socket.AF_UNIX:
        return _connect(self, address)
    raise OSError(f"network blocked by the kvquant test guard: {address}")
socket.socket.connect = connect
"""


@pytest.mark.slow  # a fresh interpreter, and the CLI indexes all of lm-eval's built-in tasks
def test_cli_runs_a_shipped_task_with_the_network_blocked(tmp_path, tiny_model_dir):
    """The shell command users type, in a subprocess whose sitecustomize blocks every internet socket."""
    (tmp_path / "guard").mkdir()
    (tmp_path / "guard" / "sitecustomize.py").write_text(GUARD)
    env = {
        **os.environ,
        "PYTHONPATH": str(tmp_path / "guard"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "TQDM_DISABLE": "1",
    }
    script = shutil.which("kvquant-lm-eval", path=str(Path(sys.executable).parent))
    cmd = [script] if script else [sys.executable, "-m", "kvquant.eval.lm_eval_cli"]
    cmd += [
        "--model",
        "kvquant",
        "--model_args",
        f"pretrained={tiny_model_dir},scheme=int4-g64,chunk=64",
        "--include_path",
        str(TASKS),
        "--tasks",
        "kvquant_mmlu",
        "--limit",
        "2",
        "--device",
        "cpu",
        "--output_path",
        str(tmp_path / "out"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_LIMIT_S, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "network blocked" not in proc.stderr
    assert "kvquant_mmlu" in proc.stdout and "acc" in proc.stdout
    assert list((tmp_path / "out").rglob("results_*.json"))


BAD_MODEL_ARGS = [
    ({"scheme": "int5"}, kvquant.SchemeError, "Known schemes"),
    ({"scheme": "k=int4-g64;v=int9"}, kvquant.SchemeError, "int9 is not supported"),
    ({"chunk": 0}, ValueError, "chunk=0 must be a positive integer"),
    ({"chunk": "64"}, TypeError, "chunk must be an int .*not str '64'"),
    ({"backend": "cuda-magic"}, ValueError, "known backends: auto, triton, torch"),
    ({"dtype": "float8"}, ValueError, "known dtypes"),
    ({"revision": "v2"}, ValueError, "revision= is not supported"),
    ({"pretrained": "/no/such/model"}, FileNotFoundError, "never downloads from the hub"),
]


@pytest.mark.parametrize("args, error, match", BAD_MODEL_ARGS)
def test_check_model_args(args, error, match):
    from kvquant.eval.lm_eval_cli import check_model_args

    with pytest.raises(error, match=match):
        check_model_args(args)


def test_backends_match_the_cache():
    from kvquant.eval.lm_eval_cli import BACKENDS

    try:
        from kvquant.backend import BACKENDS as known
    except ImportError:  # before the storage rewrite the names lived in kvquant.cache
        from kvquant.cache import BACKENDS as known
    assert tuple(BACKENDS) == tuple(known)


_LM_EVAL_PROBE = """
import contextlib, io, json, sys
from kvquant.eval.lm_eval_cli import cli
out = []
for argv in json.loads(sys.stdin.read()):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            cli(argv)
            rc = 0
        except SystemExit as e:
            rc = e.code
    out.append([rc, err.getvalue()])
heavy = [m for m in ("torch", "transformers", "lm_eval.models", "lm_eval.api.registry") if m in sys.modules]
print(json.dumps({"results": out, "heavy": heavy}))
"""


def test_cli_refuses_bad_model_args_before_heavy_imports(tmp_path):
    """kvquant-lm-eval parses with lm-eval's own (light) parser, then checks the kvquant model's arguments:
    one line, exit 2, and neither torch, transformers nor lm-eval's models imported."""
    base = ["--model", "kvquant", "--tasks", "kvquant_mmlu", "--model_args"]
    cases = [
        ([*base, "scheme=int5"], "kvquant-lm-eval: error: bad scheme 'int5'"),
        ([*base, "scheme=int4-g64,chunk=0"], "kvquant-lm-eval: error: chunk=0 must be a positive integer"),
        ([*base, "backend=gpu"], "kvquant-lm-eval: error: unknown backend 'gpu'"),
        ([*base, "dtype=float8"], "kvquant-lm-eval: error: unknown dtype 'float8'"),
        ([*base, f"pretrained={tmp_path / 'missing'}"], "kvquant-lm-eval: error: model path"),
        ([*base, "device_map=nowhere.json"], "kvquant-lm-eval: error: device map 'nowhere.json' is neither"),
        ([*base, "scheme=int4-g64", "--batch_size", "auto"], "kvquant-lm-eval: error: batch_size='auto'"),
        (["--model", "kvquant", "--bogus"], "unrecognized arguments: --bogus"),
    ]
    proc = subprocess.run(
        [sys.executable, "-c", _LM_EVAL_PROBE],
        input=json.dumps([argv for argv, _ in cases]),
        capture_output=True,
        text=True,
        timeout=HANG_LIMIT_S,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for (argv, want), (rc, err) in zip(cases, report["results"], strict=True):
        assert rc == 2 and want in err and "Traceback" not in err, (argv, rc, err)
    assert report["heavy"] == []


def test_installed_script_checks_before_importing():
    """The console script `kvquant-lm-eval` is the light entry point (set-up reinstalls it)."""
    script = shutil.which("kvquant-lm-eval", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("kvquant-lm-eval is not installed in this environment")
    assert "kvquant.eval.lm_eval_cli import cli" in Path(script).read_text()
