"""Invariance goldens (issue 19, "Invariance, tested"): what the current code computes, recorded once, so that
a refactor can show every number stayed bit-identical. `tests/test_invariance.py` recomputes each artifact
with the functions below and compares it to the stored JSON.

Re-record (ONLY when a change of numbers is intended, and say so in the commit message):

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 .venv/bin/python tests/goldens/record.py          # everything
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 .venv/bin/python tests/goldens/record.py kv logits  # some parts

Parts (one JSON file each, in this folder's `machine()` subfolder):

    kv       per-layer dequantized K/V that the real default model (SmolLM2-135M, fp32, CPU, one thread)
             leaves in `QuantizedCache` after one forward of a 64-token prompt, for SCHEMES: sha256 of the
             fp32 bytes of `cache.layers[i].keys` / `.values`, plus shape, sum, sum of |x| and max |x| (to
             see how far apart a mismatch is)
    logits   a greedy generate of 8 tokens through the cache (the same prompt): the tokens and the sha256 of
             every step's fp32 logits, for each of SCHEMES
    quick    `experiments/run.py --scheme int4-g64 --quick --no-reference-cache`: summary.csv's rows
    passkey  `experiments/run.py --task passkey --scheme int4-g64` on 256 tokens, depths 0 and 1, one trial
             (PASSKEY): summary.csv's rows
    serve    `experiments/serve.py --quick` with 3 requests, policies lru and sliding:48, no fit probe
             (SERVE): summary.csv's rows, minus wall-clock and resident-memory columns (VOLATILE)

Bit-identical is a property of one machine: the same code gives other float sums on another CPU (torch picks
its matrix-product kernels by instruction set and vendor: AVX2 on an AMD EPYC and AVX-512 on a Xeon round
differently). So each set of goldens is what REFERENCE_COMMIT computes on one kind of machine (`machine()`,
e.g. `AVX2-AuthenticAMD`), in a folder of that name here. On a kind of machine with no folder, the test
records the reference commit itself, once, from a pristine `git archive` (its own native op built; a few
minutes), into the user cache folder, and compares against that. An intended change of numbers moves
REFERENCE_COMMIT to the commit that makes it (say so in its message) and re-records the folders.

History: first recorded on bacfcec (before the issue-19 refactor) from a pristine archive; logits and passkey
re-recorded on 0ea7321 for issue 20's reassociated decode sums; by machine since 7151d10's successor; kv and
logits re-recorded on cab78b0 (prefill sums rotated values' outputs in their frame and applies R^T once: the
g16 `-rot` windowed scheme's K/V and logits change, its tokens do not; the rest stayed bit-identical) on
AVX512-GenuineIntel, and the AVX2-AuthenticAMD folder dropped (no such machine here to re-record it): on
one, the test records cab78b0 itself.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PY = sys.executable
# the code whose numbers the goldens are: the last landed commit before a change of numbers was intended
REFERENCE_COMMIT = "cab78b0"

PROMPT = (
    "The history of the Roman Empire begins with the founding of Rome, a small settlement on the Tiber."
    " Over centuries it grew into a republic governed by elected magistrates and a senate of aristocrats,"
    " and then, after civil wars, into an empire ruled by a single emperor whose power rested on the army."
    " Its provinces stretched from Britain to Egypt."
)
PROMPT_TOKENS = 64
NEW_TOKENS = 8
CALIB = "calib/smollm2-nuq.safetensors"
SCHEMES = [
    "int4-g64",
    "int8",
    "kivi-2",
    "k=int4-channel-g64-rot,v=int4-g64-rot,sink=4,window=16",
    "k=int4-channel-g16-rot,v=int4-g64-rot,sink=4,window=16",  # at 64 tokens g64 keys stay all FP; g16 not
    f"k=nuq3-channel-g64-prerope,v=nuq3-g64,calib={CALIB}",
    "fp8-e4m3-tensor",
    "k=int4-channel-g64-prerope,v=int4-g64",
    "layers=0-3:int8+4-29:int4-g64",
]
# columns of a summary.csv that measure time or depend on the machine, never compared
VOLATILE = (
    "mem_", "ttft", "seconds", "wall", "time", "tok_s", "tokens_per_s", "per_s", "elapsed", "rss", "_ms",
    "speed",
)


def sha(t) -> str:
    import torch

    return hashlib.sha256(t.detach().to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


def stats(t) -> dict:
    import torch

    t = t.detach().to(torch.float64)
    return {
        "shape": list(t.shape),
        "sum": float(t.sum()),
        "abs_sum": float(t.abs().sum()),
        "abs_max": float(t.abs().max()) if t.numel() else 0.0,
    }


def load():
    import torch

    import kvquant

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, tok = kvquant.load_model()
    return model, prompt_ids(tok)


def prompt_ids(tok):
    ids = tok(PROMPT, return_tensors="pt").input_ids[:, :PROMPT_TOKENS]  # (1, 64)
    assert ids.shape[1] == PROMPT_TOKENS, ids.shape
    return ids


def record_kv(model, ids) -> dict:
    """{scheme: [{"k": sha, "v": sha, "k_stats": .., "v_stats": ..} per layer]}"""
    import torch

    import kvquant

    out = {}
    with torch.no_grad():
        for scheme in SCHEMES:
            cache = kvquant.QuantizedCache(scheme, model.config)
            model(ids, cache=cache)
            rows = []
            for layer in cache.layers:
                k, v = layer.keys, layer.values  # (B, H_kv, T, D), decoded from the pages
                rows.append({"k": sha(k), "v": sha(v), "k_stats": stats(k), "v_stats": stats(v)})
            out[scheme] = rows
    return out


def record_logits(model, ids) -> dict:
    """{scheme: {"tokens": [...], "logits": [sha per step], "logits_sum": [...]}}"""
    import torch

    import kvquant

    out = {}
    with torch.no_grad():
        for scheme in SCHEMES:
            cache = kvquant.QuantizedCache(scheme, model.config)
            g = model.generate(
                ids,
                cache=cache,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            out[scheme] = {
                "tokens": g.sequences[0, PROMPT_TOKENS:].tolist(),
                "logits": [sha(x) for x in g.logits],
                "logits_sum": [float(x.double().sum()) for x in g.logits],
            }
    return out


def _csv_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [{k: v for k, v in r.items() if not any(s in k.lower() for s in VOLATILE)} for r in rows]


def _run(args: list[str], summary: str = "summary.csv") -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WANDB_MODE="disabled")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [PY, *args, "--out", str(out)]
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        if p.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
        return _csv_rows(out / summary)


def record_quick() -> list[dict]:
    return _run(["experiments/run.py", "--scheme", "int4-g64", "--quick", "--no-reference-cache"])


def record_passkey() -> list[dict]:
    return _run(PASSKEY)


def record_serve() -> list[dict]:
    return _run(SERVE)


# smaller than --quick (56 s and 91 s on the shared 2-core machine), the same code paths
PASSKEY = [
    "experiments/run.py", "--task", "passkey", "--scheme", "int4-g64", "--lengths", "256", "--depths", "0,1",
    "--trials", "1",
]
SERVE = ["experiments/serve.py", "--quick", "--requests", "3", "--policies", "lru,sliding:48",
         "--fit-fp16-requests", "0"]
PARTS = ("kv", "logits", "quick", "passkey", "serve")


def compute(part: str, model_ids=None):
    if part in ("kv", "logits"):
        model, ids = model_ids if model_ids is not None else load()
        return record_kv(model, ids) if part == "kv" else record_logits(model, ids)
    return {"quick": record_quick, "passkey": record_passkey, "serve": record_serve}[part]()


def machine() -> str:
    """The kind of machine a set of goldens holds for: torch's CPU kernel level and the CPU vendor."""
    import platform

    import torch

    vendor = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            ids = [line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")]
        vendor = ids[0] if ids else vendor
    except OSError:
        pass
    return f"{torch.backends.cpu.get_cpu_capability()}-{vendor}".replace(" ", "_")


def goldens_dir() -> Path:
    """This machine's goldens: the committed folder for its kind, else the reference commit's numbers
    recorded here once (`record_reference`)."""
    committed = HERE / machine()
    if all((committed / f"{p}.json").is_file() for p in PARTS):
        return committed
    from kvquant.models import cache_root

    cached = cache_root() / "goldens" / f"{REFERENCE_COMMIT}-{machine()}"
    if not all((cached / f"{p}.json").is_file() for p in PARTS):
        record_reference(cached)
    return cached


def record_reference(dest: Path) -> None:
    """Record REFERENCE_COMMIT's goldens on this machine into dest: a pristine `git archive` of it, its eval/
    and kernels/ in place (as its editable install maps them), its native op built, its record.py run."""
    import shutil

    archive = subprocess.run(["git", "-C", str(ROOT), "archive", REFERENCE_COMMIT], capture_output=True)
    if archive.returncode:
        raise RuntimeError(
            f"no goldens for this kind of machine ({machine()}) and the reference commit {REFERENCE_COMMIT} "
            f"cannot be read from git ({archive.stderr.decode()[-300:].strip()}): run the tests in a clone "
            f"with its history, or record them: git archive {REFERENCE_COMMIT} | tar -x -C TREE, then "
            "PYTHONPATH=TREE python TREE/tests/goldens/record.py"
        )
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="kvquant-goldens-") as tmp:
        tree = Path(tmp)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
        for sub in ("eval", "kernels"):
            (tree / "kvquant" / sub).symlink_to(Path("..") / sub)
        env["PYTHONPATH"] = str(tree)
        print(f"recording {REFERENCE_COMMIT}'s goldens for {machine()} (once; minutes)", file=sys.stderr)
        for args in (["-m", "kvquant.native", "build"], ["tests/goldens/record.py"]):
            p = subprocess.run([PY, *args], cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
            if p.returncode and args[0] != "-m":  # without a compiler the native op is absent in both trees
                raise RuntimeError(f"recording {REFERENCE_COMMIT}'s goldens failed:\n{p.stderr[-3000:]}")
        dest.mkdir(parents=True, exist_ok=True)
        recorded = tree / "tests" / "goldens"  # by machine in later commits, flat in 0ea7321
        recorded = recorded / machine() if (recorded / machine()).is_dir() else recorded
        for part in PARTS:
            shutil.copy(recorded / f"{part}.json", dest / f"{part}.json")


def main(argv: list[str]) -> None:
    parts = argv or list(PARTS)
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise SystemExit(f"unknown part(s) {bad}; choose from {PARTS}")
    model_ids = load() if {"kv", "logits"} & set(parts) else None
    out = HERE / machine()
    out.mkdir(exist_ok=True)
    for part in parts:
        data = compute(part, model_ids)
        (out / f"{part}.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"recorded {out / (part + '.json')}")


if __name__ == "__main__":
    main(sys.argv[1:])
