"""The sliding-layer sink rule, before and after: are the sink tokens' K/V exact in cache mode and in fake
mode, on a tiny random Gemma-3 whose prompt is longer than its sliding window?

    python benchmarks/sliding_sink_rule.py                                   # this tree only
    python benchmarks/sliding_sink_rule.py --tree after=. --tree before=/tmp/kvq/before

Each `--tree NAME=ROOT` runs in its own interpreter with PYTHONPATH=ROOT (a source tree of kvquant, e.g. an
old commit extracted with `git archive <commit> | tar -x -C ROOT`), so its kvquant, eval and kernels are
the ones measured. The model, prompt and scheme are the same in every tree: Gemma3ForCausalLM from a small
Gemma3TextConfig (layers sliding, sliding, full, sliding; window 32; head_dim 64; MQA), random weights with
seed 0, a 96-token random prompt, one forward through kvquant.QuantizedCache (cache mode) and through
kvquant.eval.measure.FakeQuantCache (fake mode), scheme int4-g64,sink=4,window=16.

Reported per layer kind and mode: whether the K/V that attention read for the sink positions 0..3 equal the
K/V the layer was given (bit for bit), and their largest error; the fake-vs-cache logit difference, split at
the window (queries before position 32 still see the sink keys through a sliding layer's mask, later ones do
not), and each mode against the unquantized model. Writes benchmarks/results/sliding_sink_rule.md.

Shim: an editable install maps kvquant.eval and kvquant.kernels to this checkout's eval/ and kernels/; for
another tree the child loads them from that tree's folders instead (`_bind_subpackages`), so no module of
the checkout leaks into an old tree's run. FakeQuantCache(scheme, config) and LayerView.keys(dtype) have the
same signatures in every tree measured here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
OUT = REPO / "benchmarks" / "results" / "sliding_sink_rule.md"
SCHEME = "int4-g64,sink=4,window=16"
SINK, WINDOW, PROMPT = 4, 32, 96
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


# ---------------------------------------------------------------------------------------- child (one tree)


def _bind_subpackages(root: Path) -> None:
    """kvquant.eval and kvquant.kernels from root's eval/ and kernels/ (see the module docstring)."""
    for name, folder in (("kvquant.eval", root / "eval"), ("kvquant.kernels", root / "kernels")):
        if name in sys.modules or not (folder / "__init__.py").is_file():
            continue
        spec = importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


def _model():
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    import kvquant

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=WINDOW,
        layer_types=LAYER_TYPES, max_position_embeddings=512, pad_token_id=0,
    )
    model = Gemma3ForCausalLM(config).eval()
    model.set_attn_implementation(kvquant.ATTN_IMPLEMENTATION)
    return model


def _recorded(cache) -> tuple[object, dict]:
    """cache with its update wrapped: per layer, the (K, V) given (B, H, T, D) and what update returned."""
    seen: dict[int, tuple] = {}
    inner = cache.update

    def update(key_states, value_states, layer_idx, *args, **kwargs):
        k, v = inner(key_states, value_states, layer_idx, *args, **kwargs)
        seen[layer_idx] = (key_states.detach().clone(), value_states.detach().clone(), k, v)
        return k, v

    cache.update = update  # an instance attribute: the model calls cache.update(...)
    return cache, seen


def _sink_rows(seen: dict, mode: str) -> list[dict]:
    rows = []
    for i, kind in enumerate(LAYER_TYPES):
        k_in, v_in, k_out, v_out = seen[i]
        err = max((a[:, :, :SINK].float() - b[:, :, :SINK].float()).abs().max().item()
                  for a, b in ((k_in, k_out), (v_in, v_out)))
        exact = all(torch_equal(a[:, :, :SINK], b[:, :, :SINK]) for a, b in ((k_in, k_out), (v_in, v_out)))
        rows.append({"layer": i, "kind": kind.split("_")[0], "mode": mode, "exact": exact, "err": err})
    return rows


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a.float(), b.float()))


def child(save: Path) -> None:
    import torch
    from transformers import DynamicCache

    import kvquant

    root = Path(kvquant.__file__).resolve().parents[1]
    _bind_subpackages(root)
    from kvquant.eval.measure import FakeQuantCache

    assert Path(sys.modules["kvquant.eval.measure"].__file__).resolve().is_relative_to(root)
    torch.set_num_threads(1)
    model = _model()
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1))

    with torch.no_grad():
        ref = model(ids, cache=DynamicCache(config=model.config), use_cache=True).logits[0]
        cache, seen_c = _recorded(kvquant.QuantizedCache(SCHEME, model.config))
        out_c = model(ids, cache=cache, use_cache=True).logits[0]
        fake, seen_f = _recorded(FakeQuantCache(kvquant.parse_scheme(SCHEME), model.config))
        out_f = model(ids, cache=fake, use_cache=True).logits[0]
    seen_cache = {}
    for i, (k_in, v_in, view_k, view_v) in seen_c.items():  # LayerViews: decode what attention read
        assert view_k.start == 0, "one forward from position 0: the view holds the whole prompt"
        seen_cache[i] = (k_in, v_in, view_k.keys(torch.float32), view_v.values(torch.float32))
    rows = _sink_rows(seen_cache, "cache") + _sink_rows(seen_f, "fake")
    diff = (out_f - out_c).abs()  # (T, V)

    def stat(d):
        return [d.max().item(), d.mean().item()]

    result = {
        "root": str(root),
        "rows": rows,
        "fake_vs_cache_before_window": stat(diff[:WINDOW]),
        "fake_vs_cache_after_window": stat(diff[WINDOW:]),
        "cache_vs_fp": stat((out_c - ref).abs()),
        "fake_vs_fp": stat((out_f - ref).abs()),
    }
    torch.save({"cache": out_c, "fake": out_f, "fp": ref}, save)
    print(json.dumps(result))


# ------------------------------------------------------------------------------------- parent (the report)


def start_tree(root: Path, save: Path) -> subprocess.Popen:
    """One tree's child interpreter (the trees run side by side: each spends most of its time importing)."""
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, str(HERE), "--child", str(save)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tempfile.gettempdir())


def finish_tree(name: str, root: Path, proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"tree {name} ({root}) failed:\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    if Path(result["root"]) != root.resolve():
        raise SystemExit(f"tree {name}: imported kvquant from {result['root']}, not {root}")
    return result


def report(results: dict[str, dict], logits: dict[str, dict], command: str, note: str = "") -> str:
    kinds = [t.split("_")[0] for t in LAYER_TYPES]
    lines = [
        "# Sliding-layer sink rule: cache mode vs fake mode, before and after",
        "",
        f"Written by `{command}` (benchmarks/sliding_sink_rule.py; CPU, float32, seconds).",
        "",
        f"Tiny random Gemma-3 (Gemma3ForCausalLM, seed 0): layers {', '.join(kinds)}, sliding window "
        f"{WINDOW}, head_dim 64, 1 KV head; a {PROMPT}-token random prompt in one forward; "
        f"scheme `{SCHEME}`. "
        f"\"Sink exact\": the K/V attention read for positions 0..{SINK - 1} equal the K/V the layer was "
        "given, bit for bit (max error beside it).",
        "",
        "| tree | layer kind | sink exact, cache | sink exact, fake | max sink error cache / fake |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        for kind in ("sliding", "full"):
            by_mode = {m: [x for x in r["rows"] if (x["kind"], x["mode"]) == (kind, m)]
                       for m in ("cache", "fake")}
            ex = {m: all(x["exact"] for x in rows) for m, rows in by_mode.items()}
            err = {m: max(x["err"] for x in rows) for m, rows in by_mode.items()}
            n = len(by_mode["cache"])
            lines.append(f"| {name} | {kind} ({n}) | {ex['cache']} | {ex['fake']} | "
                         f"{err['cache']:.3g} / {err['fake']:.3g} |")
    lines += [
        "",
        "Logits, max / mean |difference| over the vocabulary and the positions named:",
        "",
        f"| tree | fake vs cache, positions < {WINDOW} | fake vs cache, positions >= {WINDOW} "
        "| cache vs FP | fake vs FP |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        cells = ("fake_vs_cache_before_window", "fake_vs_cache_after_window", "cache_vs_fp", "fake_vs_fp")
        lines.append(f"| {name} | " + " | ".join(f"{r[c][0]:.4g} / {r[c][1]:.3g}" for c in cells) + " |")
    names = list(results)
    if len(names) > 1:
        lines += ["", f"Against tree `{names[0]}` (max |logit difference|, all positions):", "",
                  "| tree | cache mode | fake mode | FP model |", "|---|---|---|---|"]
        base = logits[names[0]]
        for name in names[1:]:
            d = {m: (logits[name][m] - base[m]).abs().max().item() for m in ("cache", "fake", "fp")}
            lines.append(f"| {name} | {d['cache']:.4g} | {d['fake']:.4g} | {d['fp']:.4g} |")
    lines += ["", "Trees: " + "; ".join(f"`{n}` = {r['root']}" for n, r in results.items()), ""]
    if note:
        lines += [note, ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", default=[], metavar="NAME=ROOT",
                   help="a kvquant source tree to measure (repeatable; default: after=this checkout)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--note", default="", help="a paragraph for the report: what the trees are")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        return child(args.child)
    import torch

    trees = [t.split("=", 1) for t in args.tree] or [["after", str(REPO)]]
    results, logits = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        procs = {name: start_tree(Path(root), Path(tmp) / f"{name}.pt") for name, root in trees}
        for name, root in trees:
            results[name] = finish_tree(name, Path(root), procs[name])
            logits[name] = torch.load(Path(tmp) / f"{name}.pt")
    command = "python benchmarks/sliding_sink_rule.py " + " ".join(f"--tree {n}={r}" for n, r in trees)
    text = report(results, logits, command.strip() + (" --note ..." if args.note else ""), args.note)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
