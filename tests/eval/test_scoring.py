"""Scoring against stored reference statistics (kvquant.eval.scoring): the KL of the difference form equals
the KL summed over the vocabulary in float64, for linear and soft-capped heads."""

from __future__ import annotations

import pytest
import torch
from kvquant.eval import scoring
from tiny_models import make_tiny_gemma


def _exact(model, h_ref, h_q, targets):
    """KL(p_ref || q), -log q(target) and argmax agreement in float64 over the whole vocabulary."""
    head = model.get_output_embeddings().weight.double()  # (V, hidden)
    cap = scoring._softcap(model)

    def lp(h):
        z = h.double() @ head.T
        return torch.log_softmax(torch.tanh(z / cap) * cap if cap else z, -1)

    a, b = lp(h_ref), lp(h_q)
    kl = (a.exp() * (a - b)).sum(-1)
    return kl, -b.gather(-1, targets[:, None])[:, 0], a.argmax(-1) == b.argmax(-1)


@pytest.mark.parametrize("softcap", [None, 5.0])
@torch.inference_mode()
def test_score_equals_the_kl_over_the_vocabulary(softcap):
    model = make_tiny_gemma(final_logit_softcapping=softcap)
    torch.manual_seed(1)
    h_ref = torch.randn(40, 64)
    targets = torch.randint(0, 512, (40,))
    ref = scoring.reference_slice(model, h_ref, targets)
    assert (scoring.head_weight(model) is None) == (softcap is not None)
    assert (ref.mean_row is None) == (softcap is not None) and (ref.logprobs is None) == (softcap is None)
    for scale in (1e-3, 0.1, 1.0):  # near the reference (int8-like) to far from it (int2-like)
        h_q = h_ref + scale * torch.randn_like(h_ref)
        nll, kl, agree = scoring.score(model, ref, h_q, targets)
        kl_x, nll_x, agree_x = _exact(model, h_ref, h_q, targets)
        assert kl.dtype == nll.dtype == torch.float64
        assert torch.allclose(kl, kl_x.clamp_min(0), rtol=1e-4, atol=2e-6), (scale, (kl - kl_x).abs().max())
        assert torch.allclose(nll, nll_x, atol=1e-5)
        assert torch.equal(agree, agree_x)
    # the reference against itself: KL 0 up to float32 rounding of the log-sum-exp
    _, kl, agree = scoring.score(model, ref, h_ref, targets)
    assert float(kl.max()) < 2e-6 and bool(agree.all())


@torch.inference_mode()
def test_stored_statistics_round_trip():
    model = make_tiny_gemma()
    h = torch.randn(12, 64)
    t = torch.randint(0, 512, (12,))
    ref = scoring.reference_slice(model, h, t)
    stats = ref.stats()
    assert sorted(stats) == sorted(scoring.STAT_FIELDS)
    stored = {"hidden": h[None], **stats}
    part = scoring.stored_slice(stored, 3, 9, "cpu")
    for f in scoring.STAT_FIELDS:
        assert torch.equal(getattr(part, f), getattr(ref, f)[3:9])
    assert torch.equal(part.hidden, h[3:9])
    # a soft-capped head keeps nothing to store: its reference is recomputed from the hidden states
    assert scoring.reference_slice(make_tiny_gemma(final_logit_softcapping=5.0), h, t).stats() == {}


def test_soft_capped_reference_is_reused_from_its_hidden_states():
    """Gemma-2-like heads store the hidden states only; reusing them gives the run's numbers again, and
    nothing is handed back to be stored a second time."""
    from kvquant.eval.measure import evaluate_document, make_buckets

    model = make_tiny_gemma(final_logit_softcapping=5.0)
    torch.manual_seed(2)
    ids = torch.randint(0, 512, (1, 48))
    kw = dict(mode="cache", chunk=16, buckets=make_buckets(48, edges=(0, 16, 48)))
    kept, again = [], []
    live = evaluate_document(model, ids, ["int4-g32"], on_reference=kept.append, **kw)
    assert len(kept) == 1 and sorted(kept[0]) == ["hidden"]
    reused = evaluate_document(model, ids, ["int4-g32"], reference=kept[0], on_reference=again.append, **kw)
    assert not again
    for b, st in live["int4-g32"].items():
        assert reused["int4-g32"][b].kl == pytest.approx(st.kl, rel=1e-9) and st.kl > 0
        assert reused["int4-g32"][b].nll == pytest.approx(st.nll, rel=1e-12)
