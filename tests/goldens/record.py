"""Invariance goldens (issue 19, "Invariance, tested"): what the current code computes, recorded once, so that
a refactor can show every number stayed bit-identical. `tests/test_invariance.py` recomputes each artifact
with the functions below and compares it to the stored JSON.

Re-record (ONLY when a change of numbers is intended, and say so in the commit message):

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 .venv/bin/python tests/goldens/record.py          # everything
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 .venv/bin/python tests/goldens/record.py kv logits  # some parts

Parts (one JSON file each, in this folder):

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

The goldens were first recorded on commit bacfcec (before the issue-19 refactor) from a pristine `git archive`
of it, so that edits in flight in the working tree could not leak in.
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


def main(argv: list[str]) -> None:
    parts = argv or list(PARTS)
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise SystemExit(f"unknown part(s) {bad}; choose from {PARTS}")
    model_ids = load() if {"kv", "logits"} & set(parts) else None
    for part in parts:
        data = compute(part, model_ids)
        (HERE / f"{part}.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"recorded {HERE / (part + '.json')}")


if __name__ == "__main__":
    main(sys.argv[1:])
