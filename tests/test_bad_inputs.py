"""Bad input, tried as a careful user would (issue 21): every case is refused before any work with an error
that names the problem and the fix; nothing is silently read as something else. Tables: input -> exception
type and a fragment of the message. The command-line cases run in one fresh interpreter, which must not
import torch or transformers before refusing."""

from __future__ import annotations

import importlib.util
import json
import math
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from kvquant.eval.config import RunConfig, RunError, check_calib_file, check_inputs, model_facts
from tiny_models import make_tiny_model

from kvquant.scheme import FP16, MAX_SEED, MAX_TOKENS, QuantSpec, Scheme, SchemeError, parse_scheme

REPO = Path(__file__).resolve().parents[1]
HANG_LIMIT_S = 20 * 60  # only a hang reaches it
HEAVY = ("torch", "transformers", "lm_eval", "wandb", "datasets", "matplotlib")
DEFAULT_POSITIONS = 8192  # the embedded SmolLM2-135M's context length (its GGUF header)


def _script(name: str):
    """experiments/<name>.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"kvquant_script_{name}", REPO / "experiments" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------ the scheme grammar

BAD_SCHEMES = [
    # duplicate items: the last one used to win silently
    ("k=int8,k=int4-g64,v=int8", "k= is given twice ('k=int8' and 'k=int4-g64')"),
    ("key=int8,k=int4-g64,v=int8", "k= is given twice"),
    ("k=int8,v=int8,value=int4-g64", "v= is given twice"),
    ("int8,sink=4,sink=8", "sink= is given twice"),
    ("int8,window=64,window=128", "window= is given twice"),
    ("nuq4-g64,calib=a.safetensors,calib=b.safetensors", "calib= is given twice"),
    ("layers=0:int8+1-29:int4-g64,layers=0:int8+1-29:int4-g64", "layers= is given twice"),
    # FP names that used to mean fp16
    ("bf16", "'bf16' is not a spec: unquantized K/V is written fp16"),
    ("fp32", "'fp32' is not a spec"),
    ("none", "'none' is not a spec"),
    ("int16", "'int16' is not a spec"),
    ("bf16-rot", "'bf16' is not a spec"),
    ("k=int8,v=fp32", "'fp32' is not a spec"),
    ("layers=0:int8+1-29:bf16", "'bf16' is not a spec"),
    # empty items
    ("int8,", "item 2 is empty (a trailing comma)"),
    (",int8", "item 1 is empty (a leading comma)"),
    ("k=int8,,v=int8", "item 2 is empty (two commas in a row)"),
    ("int8, ,window=4", "two commas in a row"),
    # numbers: non-ASCII digits, huge values, bounds with the reason
    ("int8,sink=²", "sink='²' is not a non-negative integer"),
    ("int8,window=³", "window='³' is not a non-negative integer"),
    ("int8,window=99999999999999999999999", "is too large"),
    ("int4-g64-rot99999999999999999999999", "11 or more digits"),
    ("int4-g64-rot2147483648", f"the seed must lie in 0..{MAX_SEED}"),
    ("int8,window=20000000", f"above the maximum {MAX_TOKENS:,} tokens"),
    ("int8,sink=16777217", "sink=16777217 is above the maximum"),
    ("int4-channel-g16777217", "group size 16777217 is above the maximum"),
    ("int4-g70000", "no model's head_dim is that large"),
    ("int4-g64-center16777217", "at most 16,777,216 tokens per offset"),
    ("layers=0:int8+1-99999999999:int4-g64", "bad layer range"),
    ("layers=0:int8+1-70000:int4-g64", "no model has that many layers"),
    # typos: a short answer with a suggestion
    ("kivi2", "Did you mean 'kivi-2'?"),
    ("KIVI4", "Did you mean 'kivi-4'?"),
    ("int8,sinc=4", "did you mean sink=?"),
    ("int8,windw=4", "did you mean window=?"),
]


@pytest.mark.parametrize("text, fragment", BAD_SCHEMES)
def test_bad_scheme_strings_are_refused_naming_the_fix(text, fragment):
    with pytest.raises(SchemeError) as e:
        parse_scheme(text)
    msg = str(e.value)
    assert fragment in msg, msg
    assert "--list-schemes" in msg  # the full grammar is one flag away


def test_a_scheme_typo_is_short():
    """`kivi2` once printed ~1,500 characters without a suggestion."""
    with pytest.raises(SchemeError) as e:
        parse_scheme("kivi2")
    msg = str(e.value)
    assert len(msg) < 500, len(msg)
    assert "Did you mean 'kivi-2'?" in msg and "A spec is" not in msg


@pytest.mark.parametrize(
    "text, calib",
    [
        ("nuq4-g64,calib=a b c.safetensors", "a b c.safetensors"),
        ("nuq4-g64, calib = My Dir/File.safetensors ", "My Dir/File.safetensors"),
    ],
)
def test_a_calib_path_keeps_its_spaces(text, calib):
    s = parse_scheme(text)
    assert s.calib == calib
    assert parse_scheme(str(s)) == s


BAD_SPEC_OBJECTS = [
    (dict(bits=4, rotate=MAX_SEED + 1), "the seed must lie in"),
    (dict(bits=4, rotate=-1), "non-negative integer seed"),
    (dict(bits=4, center=MAX_TOKENS + 1), "tokens per offset"),
    (dict(bits=4, granularity="channel", group_size=MAX_TOKENS + 1), "above the maximum"),
    (dict(bits=4, granularity="group", group_size=1 << 17), "head_dim"),
]


@pytest.mark.parametrize("kwargs, fragment", BAD_SPEC_OBJECTS)
def test_quantspec_bounds(kwargs, fragment):
    with pytest.raises(SchemeError, match=fragment):
        QuantSpec(**kwargs)


@pytest.mark.parametrize("what", ["sink", "window"])
def test_scheme_bounds(what):
    with pytest.raises(SchemeError, match=f"{what}={MAX_TOKENS + 1} is above the maximum"):
        Scheme(FP16, FP16, **{what: MAX_TOKENS + 1})


BAD_POSITIONS = [
    ("int4-channel-g100003", 8192, "lcm(16, 100003) = 1,600,048 tokens"),
    ("k=int4-channel-g4096,v=int4-g64", 2048, "longer than the model's 2,048 positions"),
    ("int4-g64-center3000", 2048, "center3000"),
    ("layers=0:int8+1:int4-channel-g48", 32, "lcm(16, 48) = 48 tokens"),
]


@pytest.mark.parametrize("text, positions, fragment", BAD_POSITIONS)
def test_check_positions_refuses_groups_the_model_cannot_fill(text, positions, fragment):
    with pytest.raises(SchemeError) as e:
        parse_scheme(text).check_positions(positions)
    assert fragment in str(e.value) and "use a group" in str(e.value)


@pytest.mark.parametrize("text", ["int4-channel-g64", "kivi-2", "int4-g64-center", "fp16", "int8"])
def test_check_positions_accepts_groups_that_fit(text):
    parse_scheme(text).check_positions(2048)


def test_check_positions_refuses_nonsense_lengths():
    with pytest.raises(TypeError, match="positive int"):
        parse_scheme("int8").check_positions(0)


# ------------------------------------------------------------------------- run configs and scheme files


@pytest.fixture(scope="module")
def calib_files(tmp_path_factory) -> dict[str, Path]:
    """Broken calibration files beside a good JSON sidecar (or a broken sidecar beside good tensors)."""
    root = tmp_path_factory.mktemp("calib")
    good_st = (REPO / "calib" / "smollm2-nuq.safetensors").read_bytes()
    good_js = (REPO / "calib" / "smollm2-nuq.json").read_text()
    files = {
        "truncated": (good_st[:-100], good_js),  # the last tensor cut short
        "cut-header": (good_st[:5000], good_js),
        "empty": (b"", good_js),
        "pickle": (pickle.dumps({"codebooks": list(range(100))}), good_js),
        "json-list": (good_st, "[1, 2, 3]"),
        "not-json": (good_st, "codebooks: yes"),
        "other-format": (good_st, json.dumps({"format": "something/2"})),
    }
    out = {}
    for name, (st, js) in files.items():
        (root / f"{name}.safetensors").write_bytes(st)
        (root / f"{name}.json").write_text(js)
        out[name] = root / f"{name}.safetensors"
    (root / "a-folder").mkdir()
    out["a-folder"] = root / "a-folder"
    out["no-json"] = root / "no-json.safetensors"
    out["no-json"].write_bytes(good_st)
    return out


BAD_CALIB = [
    ("truncated", "truncated: its tensors end at byte"),
    ("cut-header", "truncated: its header needs"),
    ("empty", "0 bytes, shorter than a safetensors header"),
    ("pickle", "no safetensors header length (a pickle?)"),
    ("json-list", "is not a kvquant calibration file (format 'list'"),
    ("not-json", "is not JSON"),
    ("other-format", "format 'something/2'"),
    ("a-folder", "is a directory; name the .safetensors file"),
    ("no-json", "no-json.json does not exist"),
]


@pytest.mark.parametrize("name, fragment", BAD_CALIB)
def test_broken_calibration_files_are_refused_before_any_model_work(calib_files, name, fragment):
    with pytest.raises(RunError) as e:
        check_calib_file(str(calib_files[name]))
    msg = str(e.value)
    assert fragment in msg and ("experiments/calibrate.py" in msg or "directory" in fragment), msg


@pytest.mark.parametrize("name", ["truncated", "a-folder"])
def test_check_inputs_checks_calib_files(calib_files, name, tmp_path):
    (tmp_path / "c.txt").write_text("text")
    with pytest.raises(RunError, match=f"calib={calib_files[name]}"):
        check_inputs(
            RunConfig(schemes=(f"nuq4-g64,calib={calib_files[name]}",), corpus=str(tmp_path / "c.txt"))
        )


def test_a_calib_file_for_a_scheme_without_codebooks_is_checked_too(tmp_path):
    """`/etc/passwd` as calib= of an int scheme used to fail mid-run."""
    with pytest.raises(RunError, match="passwd.safetensors does not exist"):
        check_inputs(RunConfig(schemes=("int8,calib=/etc/passwd",), corpus=str(tmp_path)), check_model=False)


def test_the_shipped_calibration_file_passes():
    check_calib_file(str(REPO / "calib" / "smollm2-nuq.safetensors"))


def test_the_calibration_format_matches():
    from kvquant.eval.config import CALIB_FORMAT

    from kvquant.calibration import FORMAT

    assert CALIB_FORMAT == FORMAT


BAD_RUN_CONFIGS = [
    (dict(seed=10**23), RunError, "--seed 100000000000000000000000 must lie in 0..4294967295"),
    (dict(seed=-1), RunError, "--seed -1 must lie in"),
    (dict(seed=1.5), TypeError, "--seed must be an int"),
    (dict(prefill=100), RunError, "--prefill 100 applies to prefill mode only"),
    (dict(prefill=100, mode="both"), RunError, "applies to prefill mode only"),
    (dict(max_length=100_000), RunError, "--max-length 100000 is beyond the model's 8192 positions"),
    (
        dict(schemes=("int8,window=100000",), max_length=300),
        RunError,
        "quantizes nothing at --max-length 300",
    ),
    (dict(schemes=("int8,sink=200,window=100",), max_length=300), RunError, "quantizes nothing"),
    (dict(schemes=("k=int4-channel-g512,v=int4-g64",), max_length=300), RunError, "whole groups of 512"),
    (dict(schemes=("int4-channel-g100003",)), RunError, "longer than the model's 8,192 positions"),
    (dict(schemes=("layers=0:int8+1-39:int4-g64",)), RunError, "covers 40 layers, but the model has 30"),
    (dict(out="/proc/kvquant-x"), RunError, "cannot create a folder in /proc"),
    (dict(out="x" * 300), RunError, "is 300 bytes, above the file system's 255"),
]


@pytest.mark.parametrize("kwargs, error, fragment", BAD_RUN_CONFIGS)
def test_run_config_refusals_come_before_loading(kwargs, error, fragment, tmp_path):
    (tmp_path / "c.txt").write_text("text")
    with pytest.raises(error) as e:
        check_inputs(RunConfig(**{"schemes": ("int8",), "corpus": str(tmp_path / "c.txt"), **kwargs}))
    assert fragment in str(e.value), str(e.value)


def test_fp16_and_a_short_window_are_not_refused(tmp_path):
    (tmp_path / "c.txt").write_text("text")
    schemes = check_inputs(
        RunConfig(
            schemes=("fp16", "int8,window=200", "kivi-2"), corpus=str(tmp_path / "c.txt"), max_length=300
        )
    )
    assert len(schemes) == 3


def test_model_facts_come_from_the_config_file_without_torch(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(
        json.dumps({"text_config": {"max_position_embeddings": 512, "num_hidden_layers": 4}})
    )
    (tmp_path / "m" / "model.safetensors").write_bytes(b"\0")
    (tmp_path / "m" / "tokenizer.json").write_text("{}")
    facts = model_facts(str(tmp_path / "m"))
    assert (facts.positions, facts.layers) == (512, 4)
    default = model_facts(None)
    assert (default.positions, default.layers) == (DEFAULT_POSITIONS, 30)
    assert model_facts(str(tmp_path / "missing")).positions is None  # check_model_path says why, elsewhere


# ---------------------------------------------------------------------------------- the command lines


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory, calib_files) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli")
    (root / "corpus.txt").write_text("a few words of text\n")
    return {
        "corpus": str(root / "corpus.txt"),
        "root": str(root),
        **{k: str(v) for k, v in calib_files.items()},
    }


def cli_cases(f: dict[str, str]) -> list[tuple[str, list[str], str]]:
    """(script, argv, what the error must say)."""
    c = ["--corpus", f["corpus"]]
    run = [
        (["--scheme", "int8", *c, "--seed", str(10**23)], "--seed 100000000000000000000000 must lie in 0.."),
        (["--scheme", "int8", *c, "--seed", "-3"], "--seed -3 must lie in"),
        (["--scheme", "int8", *c, "--out", "/proc/kvquant-x"], "cannot create a folder in /proc"),
        (["--scheme", "int8", *c, "--out", "r" * 300], "above the file system's 255"),
        (["--scheme", "int8", *c, "--max-length", "100000"], "beyond the model's 8192 positions"),
        (["--scheme", "int8", *c, "--prefill", "100"], "applies to prefill mode only"),
        (
            ["--scheme", "int8,window=100000", *c, "--max-length", "300"],
            "quantizes nothing at --max-length 300",
        ),
        (["--scheme", "int8,sink=²", *c], "sink='²' is not a non-negative integer"),
        (["--scheme", "int4-g64-rot99999999999999999999999", *c], "11 or more digits"),
        (["--scheme", "kivi2", *c], "Did you mean 'kivi-2'?"),
        (["--scheme", "bf16", *c], "'bf16' is not a spec"),
        (["--scheme", "int8,", *c], "a trailing comma"),
        (["--scheme", "k=int8,k=int4-g64,v=int8", *c], "k= is given twice"),
        (["--scheme", "int8,window=4,window=8", *c], "window= is given twice"),
        (["--scheme", "int4-channel-g100003", *c], "longer than the model's 8,192 positions"),
        (["--scheme", "layers=0:int8+1-39:int4-g64", *c], "the model has 30"),
        (["--scheme", f"nuq4-g64,calib={f['a-folder']}", *c], "is a directory"),
        (["--scheme", f"nuq4-g64,calib={f['truncated']}", *c], "truncated"),
        (["--scheme", f"nuq4-g64,calib={f['json-list']}", *c], "format 'list'"),
        (["--scheme", "int8,calib=/etc/passwd", *c], "passwd.safetensors does not exist"),
    ]
    out = f"{f['root']}/x.safetensors"
    calibrate = [
        (["--scheme", "nuq4-g64", "--out", out, "--docs", "0"], "--docs 0 must be at least 1"),
        (["--scheme", "nuq4-g64", "--out", out, "--max-samples", "0"], "--max-samples 0 must be at least 1"),
        (["--scheme", "nuq4-g64", "--out", out, "--length", "1"], "--length 1 must be at least 2"),
        (["--scheme", "int4-g64", "--out", out], "has no codebook (nuqN) spec"),
        (["--scheme", "nuq4-g64", "--out", out, "--seed", "-1"], "--seed -1 must lie in"),
        (["--scheme", "nuq4-g64", "--out", out, "--length", "100000"], "beyond the model's 8192 positions"),
        (["--scheme", "nuq4-g64", "--out", f"{f['root']}/x.bin"], "must end in .safetensors"),
        (["--scheme", "nuq4-g64,", "--out", out], "a trailing comma"),
        (["--scheme", "int2-g64-crot", "--out", out, "--rotation-steps", "0"],
         "--rotation-steps 0 must be at least 1"),
    ]
    allocate = [
        (["--budget-bits", "3", "--uniform-only", "--group", "0"], "--group 0 must be at least 1"),
        (["--budget-bits", "nan", "--uniform-only"], "--budget-bits nan must be in (0, 16]"),
        (["--budget-bits", "4", "--uniform-only", "--docs", "0"], "--docs 0 must be at least 1"),
        (["--budget-bits", "4", "--uniform-only", "--eval-docs", "-1"], "--eval-docs -1 must be at least 0"),
        (["--budget-bits", "4", "--key-candidates", "bf16"], "'bf16' is not a spec"),
    ]
    serve = [
        (["--threads", "-1"], "--threads -1 must lie in 0.."),
        (["--capacity", "--gpu-gb", "inf"], "--gpu-gb inf must be a finite number"),
        (["--capacity", "--gpu-gb", "nan"], "--gpu-gb nan must be a finite number"),
        (["--capacity", "--gpu-gb", "0"], "--gpu-gb 0.0 must be a finite number"),
        (["--capacity", "--weights-gb", "nan"], "--weights-gb nan"),
        (
            ["--capacity", "--context", "4096", "--shared-prefix", "9000"],
            "--shared-prefix 9000 must lie in 0",
        ),
        (["--capacity", "--weight-bits", "0"], "--weight-bits 0 must lie in 1..32"),
        (["--seed", "-5"], "--seed -5 must lie in"),
    ]
    diagnose = [
        (["--tokens", "100000"], "beyond the model's 8192 positions"),
        (["--k-candidates", "bf16"], "'bf16' is not a spec"),
        (["--v-candidates", "int4-g64,kivi2"], "kivi2"),
    ]
    return [
        *(("run", a, w) for a, w in run),
        *(("calibrate", a, w) for a, w in calibrate),
        *(("allocate", a, w) for a, w in allocate),
        *(("serve", a, w) for a, w in serve),
        *(("diagnose", a, w) for a, w in diagnose),
    ]


_PROBE = """
import contextlib, importlib.util, io, json, sys
sys.path.insert(0, {experiments!r})
entry = {{"run": "cli", "calibrate": "main", "allocate": "main", "serve": "cli", "diagnose": "cli"}}
out = []
for script, argv in json.loads(sys.stdin.read()):
    module = __import__(script)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = getattr(module, entry[script])(argv)
        except SystemExit as e:  # argparse
            rc = e.code
    out.append([rc, err.getvalue()])
print(json.dumps({{"results": out, "heavy": [m for m in {heavy!r} if m in sys.modules]}}))
"""


def test_bad_command_lines_fail_at_once_without_heavy_imports(cli_files):
    cases = cli_cases(cli_files)
    code = _PROBE.format(experiments=str(REPO / "experiments"), heavy=HEAVY)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps([[s, a] for s, a, _ in cases]),
        capture_output=True,
        text=True,
        timeout=HANG_LIMIT_S,
        cwd=cli_files["root"],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for (script, argv, want), (rc, err) in zip(cases, report["results"], strict=True):
        assert rc == 2, (script, argv, rc, err)
        assert want in err, (script, argv, err)
        assert "Traceback" not in err, (script, argv, err)
    assert report["heavy"] == []
    assert not (Path(cli_files["root"]) / "x.safetensors").exists()


# ------------------------------------------------------------------------------------------- lm-eval

BAD_MODEL_ARGS = [
    ({"scheme": "int8", "bogus": 1}, ValueError, "bogus= is not an argument of the kvquant model"),
    ({"scheme": "int4-g64", "chnk": 1024}, ValueError, "did you mean chunk=?"),
    ({"scheme": "int8", "max_lenght": 64}, ValueError, "did you mean max_length=?"),
    ({"pretrained": "/path/to/model"}, FileNotFoundError, "leave pretrained= out for the default"),
    ({"scheme": "int4-channel-g100003"}, SchemeError, "longer than the model's 8,192 positions"),
    ({"scheme": "layers=0:int8+1-39:int4-g64"}, SchemeError, "the model has 30"),
    ({"max_length": 100_000}, ValueError, "max_length=100000 is beyond the model's 8192 positions"),
    ({"scheme": "kivi2"}, SchemeError, "Did you mean 'kivi-2'?"),
    ({"scheme": "k=int8;k=int4-g64;v=int8"}, SchemeError, "k= is given twice"),
]


@pytest.mark.parametrize("args, error, fragment", BAD_MODEL_ARGS)
def test_lm_eval_model_args(args, error, fragment):
    from kvquant.eval.lm_eval_cli import check_model_args

    with pytest.raises(error) as e:
        check_model_args(args)
    assert fragment in str(e.value), str(e.value)


def test_lm_eval_broken_calib_file(calib_files):
    from kvquant.eval.lm_eval_cli import check_model_args

    with pytest.raises(ValueError, match="truncated"):
        check_model_args({"scheme": f"nuq4-g64,calib={calib_files['truncated']}"})


def test_lm_eval_known_args_follow_hflm():
    pytest.importorskip("lm_eval")
    import inspect

    from kvquant.eval.lm_eval_cli import KNOWN_MODEL_ARGS
    from lm_eval.models.huggingface import HFLM

    hflm = set(inspect.signature(HFLM.__init__).parameters) - {"self", "kwargs", "backend"}
    assert hflm <= set(KNOWN_MODEL_ARGS), sorted(hflm - set(KNOWN_MODEL_ARGS))


def test_lm_eval_defaults_to_cpu_without_cuda(monkeypatch, capsys):
    """The README command without --device: lm-eval's default cuda:0 used to fail after the model loaded."""
    import argparse

    import torch
    from kvquant.eval import lm_eval_cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = argparse.Namespace(device=None, config=None)
    lm_eval_cli._default_device(args)
    assert args.device == "cpu"
    assert "no CUDA device; running on --device cpu" in capsys.readouterr().err
    explicit = argparse.Namespace(device="cuda:0", config=None)
    lm_eval_cli._default_device(explicit)
    assert explicit.device == "cuda:0"  # an explicit choice is checked (and refused), never replaced


# ------------------------------------------------------------------------------------------- serving


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model(seed=3)


BAD_ENGINE_ARGS = [
    (dict(budget_bytes=math.nan), "budget_bytes must be a positive int"),
    (dict(budget_bytes=math.inf), "budget_bytes must be a positive int"),
    (dict(budget_bytes=0), "budget_bytes must be a positive int"),
    (dict(budget_bytes=-5), "budget_bytes must be a positive int"),
    (dict(block_size=0), "block_size must be a positive int"),
    (dict(block_size=16.0), "block_size must be a positive int"),
    (dict(capacity_tokens=0), "capacity_tokens must be a positive int"),
    (dict(prefill_chunk=0), "prefill_chunk must be a positive number"),
    (dict(prefill_chunk=2.5), "prefill_chunk must be a positive int"),
]


@pytest.mark.parametrize("kwargs, fragment", BAD_ENGINE_ARGS)
def test_engine_arguments(tiny, kwargs, fragment):
    from kvquant.serving import Engine

    with pytest.raises(ValueError, match=fragment):
        Engine(tiny, "int4-g32", **kwargs)


def test_token_ids_outside_the_vocabulary_are_refused(tiny):
    from kvquant.serving import Engine, Session

    chat = Session(Engine(tiny, "int4-g32"))
    vocab = tiny.config.vocab_size
    with pytest.raises(ValueError, match=f"token id {vocab} is outside the model's vocabulary"):
        chat.send([1, 2, vocab])
    with pytest.raises(ValueError, match="token id -1"):
        chat.engine.prefill(chat.cache, [-1, 2])


def test_a_cache_of_another_engine_is_refused(tiny):
    from kvquant.serving import Engine

    a, b = Engine(tiny, "int4-g32"), Engine(tiny, "int4-g32")
    cache = a.open()
    with pytest.raises(ValueError, match="not opened by this Engine"):
        b.prefill(cache, [1, 2, 3])
    a.close(cache)


# -------------------------------------------------------------------------------- a scheme that fails


class _WordTokenizer:
    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1 + sum(map(ord, w)) * 7919 % 5000 for w in text.split()]}


def test_a_scheme_that_fails_during_the_run_makes_run_py_exit_non_zero(tmp_path, monkeypatch, capsys):
    """A failure inside the run (here: building int4-g32's cache) is recorded in results.jsonl; the run
    finishes the other schemes and run.py exits 1 naming the scheme and the error."""
    from kvquant.eval import schemes as eval_schemes

    run = _script("run")
    make_cache = eval_schemes.KVQuantScheme.make_cache

    def broken(self, config, mode):
        if str(self.scheme) == "int4-g32":
            raise RuntimeError("codebook table missing (simulated)")
        return make_cache(self, config, mode)

    monkeypatch.setattr(eval_schemes.KVQuantScheme, "make_cache", broken)
    (tmp_path / "c.txt").write_text(" ".join(f"w{i % 97}" for i in range(400)))
    config = RunConfig(
        schemes=("int8", "int4-g32"),
        corpus=str(tmp_path / "c.txt"),
        max_length=64,
        chunk=32,
        docs=1,
        out=str(tmp_path / "run"),
        reference_cache=False,
    )
    rc = run.main(config, model=make_tiny_model(seed=4), tokenizer=_WordTokenizer())
    err = capsys.readouterr().err
    assert rc == run.EXIT_FAILED == 1
    assert "error: scheme int4-g32 (cache): RuntimeError: codebook table missing (simulated)" in err
    rows = [json.loads(x) for x in (tmp_path / "run" / "results.jsonl").read_text().splitlines()]
    assert any(r.get("scheme") == "int8" and r.get("status") == "ok" for r in rows)
    assert run.failed_schemes(tmp_path / "run") == [
        "int4-g32 (cache): RuntimeError: codebook table missing (simulated)"
    ]
    import csv

    summary = {r["scheme"]: r for r in csv.DictReader((tmp_path / "run" / "summary.csv").open())}
    failed = summary["int4-g32"]
    assert failed["status"] == "failed"
    assert failed["saving"] in ("", "nan") and failed["effective_bits"] in ("", "nan")  # no saving claimed


# ---- corpus files that cannot be read: refused with the file and the fix, at check time (no datasets)

BAD_CORPORA = [
    ("c.txt", b"\x7fELF\x02\x01\x01\x00\x00\x00binary", "is binary"),
    ("c.txt", "caf\u00e9 au lait, na\u00efve\n".encode("latin-1"), "is not UTF-8"),
    ("c.jsonl", b'{"text": "ok"', "first row is not JSON"),
    ("c.jsonl", b"[1, 2, 3]\n", "object with a 'text' field"),
    ("c.jsonl", b'{"title": "no text"}\n', "object with a 'text' field"),
    ("c.jsonl", b"\n\n", "is empty"),
]


@pytest.mark.parametrize("name, data, why", BAD_CORPORA, ids=[w for _, _, w in BAD_CORPORA])
def test_a_corpus_file_that_cannot_be_read_is_refused_before_work(tmp_path, name, data, why):
    from kvquant.eval.data import CorpusError, check_corpus

    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(CorpusError, match=why) as e:
        check_corpus(str(path))
    assert str(path) in str(e.value)


def test_a_utf8_corpus_file_passes_the_check(tmp_path):
    from kvquant.eval.data import check_corpus, load_corpus

    (tmp_path / "a.txt").write_text("caf\u00e9 au lait\n" * 3, encoding="utf-8")
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n', encoding="utf-8")
    check_corpus(str(tmp_path))
    assert len(load_corpus(str(tmp_path))) == 3
