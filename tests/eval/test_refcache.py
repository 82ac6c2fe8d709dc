"""The reference cache's key covers the model's full weights, the tokenizer, the text and the pass's settings
(issue 21): two checkpoints that differ only in an inner layer never share a reference."""

from __future__ import annotations

import copy
import hashlib
import os

import pytest
import torch
from kvquant.eval import measure, refcache
from kvquant.eval.runner import RunConfig, run
from tiny_models import make_tiny_model

import kvquant


def old_fingerprint(model) -> str:
    """The key before issue 21: the config and the first 4,096 values of the first and last parameters."""
    digest = hashlib.sha1(model.config.to_json_string(use_diff=False).encode())
    params = list(model.parameters())
    for p in (params[0], params[-1]):
        digest.update(p.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def inner_edit(model, scale: float = 1.5):
    """A copy of `model` whose layer-0 MLP down projection differs (embeddings and final norm kept, as a
    fine-tune that freezes them)."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight.mul_(scale)
    return other


def test_one_inner_weight_changes_the_digest(tmp_path):
    a = make_tiny_model()
    b = copy.deepcopy(a)
    with torch.no_grad():
        b.model.layers[1].self_attn.v_proj.weight[3, 5] += 1e-6  # one value of one inner tensor
    assert old_fingerprint(a) == old_fingerprint(b)  # what used to collide
    assert refcache.weights_digest(a) != refcache.weights_digest(b)
    assert refcache.model_fingerprint(a) != refcache.model_fingerprint(b)
    assert refcache.weights_digest(a) == refcache.weights_digest(copy.deepcopy(a))  # content, not identity
    # the dtype is part of the content: the same values at another dtype are other bytes
    assert refcache.weights_digest(a) != refcache.weights_digest(copy.deepcopy(a).to(torch.float64))


def test_tied_weights_are_hashed_once_but_named():
    model = make_tiny_model()
    state = refcache._unique_state(model)
    aliases = {name: alias for name, _, alias in state if alias is not None}
    assert aliases == {"lm_head.weight": "model.embed_tokens.weight"}


def test_the_digest_is_remembered_by_file_identity(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "ckpt"
    make_tiny_model(seed=3).save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    memo = tmp_path / "memo"
    hashed = []
    real = refcache._full_digest
    monkeypatch.setattr(refcache, "_full_digest", lambda state: (hashed.append(1), real(state))[1])
    first = refcache.weights_digest(model, memo)
    assert hashed == [1] and len(list(memo.glob("*.json"))) == 1
    assert refcache.weights_digest(model, memo) == first and hashed == [1]  # remembered: no second hash
    # the file touched (or replaced): its identity changes, so it is hashed again
    weights = next(folder.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert refcache.weights_digest(model, memo) == first and len(hashed) == 2
    # weights changed in memory after loading: the sample of every tensor no longer matches the files'
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.normal_()
    changed = refcache.weights_digest(model, memo)
    assert changed != first and len(hashed) == 3
    # a model built from the folder's config with fresh weights names the folder too, and is not trusted
    fresh = AutoModelForCausalLM.from_config(model.config)
    assert refcache.checkpoint_files(fresh) == refcache.checkpoint_files(model)
    assert refcache.weights_digest(fresh, memo) not in (first, changed)


def test_the_key_covers_text_tokenizer_and_settings(tmp_path, tokenizer):
    model = make_tiny_model()
    cache = refcache.ReferenceCache(tmp_path, model=model, tokenizer=tokenizer)
    ids = torch.arange(10).unsqueeze(0)
    base = cache.key(ids, torch.float32, [0, 5, 10], text="abc")
    others = [
        cache.key(ids, torch.float64, [0, 5, 10], text="abc"),
        cache.key(ids, torch.float32, [0, 4, 10], text="abc"),
        cache.key(ids, torch.float32, [0, 5, 10], text="abd"),
        cache.key(ids, torch.float32, [0, 5, 10], text="abc", layers="full"),
        cache.key(ids + 1, torch.float32, [0, 5, 10], text="abc"),
        refcache.ReferenceCache(tmp_path, model=model).key(ids, torch.float32, [0, 5, 10], text="abc"),
        refcache.ReferenceCache(tmp_path, model=inner_edit(model), tokenizer=tokenizer).key(
            ids, torch.float32, [0, 5, 10], text="abc"
        ),
    ]
    assert len({base, *others}) == 1 + len(others)
    assert cache.key(ids, torch.float32, [0, 5, 10], text="abc") == base


def test_a_second_checkpoint_never_reuses_the_firsts_reference(
    tmp_path, tiny_model, tokenizer, tiny_corpus, monkeypatch
):
    """End to end through run(): checkpoint B, a fine-tune of A that kept its embeddings and final norm,
    saved over A's folder. Before, B's run read A's reference from the cache (its key was the same: the
    config and the first values of the first and last parameters) and reported drift against A."""
    monkeypatch.setenv("KVQUANT_REFERENCE_CACHE", str(tmp_path / "reference"))
    folder = tmp_path / "ckpt"

    def save(model):
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return old_fingerprint(kvquant.load_model(str(folder))[0])

    a, b = folder, folder  # one path: the checkpoint in it changes
    old_a = save(tiny_model)

    def cfg(folder, out, **kw):
        return RunConfig(schemes=("int8",), corpus=str(tiny_corpus), max_length=300, chunk=128, docs=1,
                         model=str(folder), out=str(tmp_path / out), **kw)

    forwards = []
    real = measure._hidden
    monkeypatch.setattr(
        measure, "_hidden", lambda m, x, c: (forwards.append(type(c).__name__), real(m, x, c))[1]
    )
    _, first = run(cfg(a, "a1"))
    assert "DynamicCache" in forwards  # A's reference computed, and cached
    forwards.clear()
    assert save(inner_edit(tiny_model)) == old_a  # the key that used to collide
    _, second = run(cfg(b, "b1"))
    assert "DynamicCache" in forwards  # B's reference computed, not read from A's
    forwards.clear()
    _, truth = run(cfg(b, "b2", reference_cache=False))
    by = {(r["scheme"], r["bucket"]): r for r in truth}
    for r in second:
        assert r["ppl"] == pytest.approx(by[(r["scheme"], r["bucket"])]["ppl"], rel=1e-9)
        assert r["kl"] == pytest.approx(by[(r["scheme"], r["bucket"])]["kl"], rel=1e-6, abs=1e-12)
    ref_a = {r["bucket"]: r["ppl"] for r in first if r["scheme"] == "fp16"}
    ref_b = {r["bucket"]: r["ppl"] for r in second if r["scheme"] == "fp16"}
    assert ref_a != ref_b  # the inner layer matters: A's reference would have been wrong for B
    forwards.clear()
    other = tmp_path / "ckpt-a"  # A again, in another folder: its reference is found by content
    tiny_model.save_pretrained(other)
    tokenizer.save_pretrained(other)
    _, again = run(cfg(other, "a2"))
    assert forwards and "DynamicCache" not in forwards
    assert [r["ppl"] for r in again] == pytest.approx([r["ppl"] for r in first], rel=1e-9)
