"""A scheme's predictions scored against the reference's, one slice of positions at a time, without the
reference's logits.

For a linear LM head (logits z = W h, no bias, no soft-capping) the reference distribution p of a position
enters KL(p || q) through a few numbers. With lse(z) = log sum_i exp(z_i), log p_i = z_ref,i - lse_ref and
log q_i = z_q,i - lse_q, so

    KL = sum_i p_i (z_ref,i - z_q,i) - S (lse_ref - lse_q) = m . (h_ref - h_q) - S (lse_ref - lse_q)

where m = sum_i p_i W_i is the head's rows averaged under p (one hidden-size vector) and S = sum_i p_i (1 up
to rounding). A reference position is therefore kept as `ReferenceSlice`: its hidden state, m, S, lse, the
target's -log p and the argmax. Scoring a scheme still computes the scheme's logits (its -log q(target), lse
and argmax need them) but never the reference's again, and forms no vocabulary-sized product of the two:
stored with the reference cache, these make adding a scheme to a finished run cost the scheme's own forward
and LM head only.

The difference form is also the more exact one: h_ref - h_q is small and exact in float32 where the two
distributions are close, and the dot product runs in float64, where summing p_i (log p_i - log q_i) over the
vocabulary in float32 carries each logit's rounding. Heads that are not linear (Gemma-2's soft-capping)
keep the reference's log-probabilities for the slice and sum the KL over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvquant.quirks import final_logit_softcap

__all__ = [
    "STAT_FIELDS",
    "ReferenceSlice",
    "head_weight",
    "logits",
    "reference_slice",
    "score",
    "stored_slice",
]

STAT_FIELDS = ("nll", "top", "lse", "psum", "mean_row")  # what a reference cache file holds beside "hidden"


def _softcap(model) -> float | None:
    return final_logit_softcap(model.config)


def head_weight(model) -> torch.Tensor | None:
    """W (V, hidden) when the LM head is a bias-free linear map without soft-capping, else None."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or _softcap(model) is not None:
        return None
    return head.weight


def logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """(t, hidden) -> float32 logits (t, V), soft-capped where the model caps them."""
    z = model.get_output_embeddings()(hidden).float()
    cap = _softcap(model)
    return torch.tanh(z / cap) * cap if cap else z


@dataclass
class ReferenceSlice:
    """The reference at t prediction positions."""

    hidden: torch.Tensor  # (t, hidden) last hidden states
    nll: torch.Tensor  # (t,) float64: -log p(target)
    top: torch.Tensor  # (t,) int64: argmax of p
    lse: torch.Tensor | None = None  # (t,) float64: log-sum-exp of the logits (linear heads)
    psum: torch.Tensor | None = None  # (t,) float64: S = sum_i p_i
    mean_row: torch.Tensor | None = None  # (t, hidden) float32: m = sum_i p_i W_i
    logprobs: torch.Tensor | None = None  # (t, V): non-linear heads only, never stored

    def stats(self) -> dict[str, torch.Tensor]:
        """The stored fields (STAT_FIELDS) on the CPU; empty for a non-linear head."""
        if self.mean_row is None:
            return {}
        return {f: getattr(self, f).detach().to("cpu", copy=True) for f in STAT_FIELDS}


def _head(model, hidden: torch.Tensor, targets: torch.Tensor):
    """Logits (t, V), their log-sum-exp (t,) and -log p(target) (t,) float64 of hidden states (t, hidden)."""
    z = logits(model, hidden)  # (t, V)
    lse = torch.logsumexp(z, dim=-1)  # (t,)
    return z, lse, lse.double() - z.gather(-1, targets[:, None])[:, 0].double()


def reference_slice(model, hidden: torch.Tensor, targets: torch.Tensor) -> ReferenceSlice:
    """The reference at t positions: their last hidden states (t, hidden) and next tokens targets (t,)."""
    z, lse, nll = _head(model, hidden, targets)
    top = z.argmax(-1)
    w = head_weight(model)
    if w is None:
        return ReferenceSlice(hidden, nll, top, logprobs=z - lse[:, None])
    p = torch.exp(z - lse[:, None])  # (t, V)
    mean_row = p.to(w.dtype) @ w  # (t, hidden)
    return ReferenceSlice(hidden, nll, top, lse.double(), p.sum(-1, dtype=torch.float64), mean_row.float())


def stored_slice(stored: dict[str, torch.Tensor], a: int, b: int, device) -> ReferenceSlice:
    """Prediction positions a..b-1 of a stored reference (its "hidden" (1, L, hidden) and STAT_FIELDS)."""
    return ReferenceSlice(
        stored["hidden"][0, a:b].to(device), **{f: stored[f][a:b].to(device) for f in STAT_FIELDS}
    )


def score(
    model, ref: ReferenceSlice, hidden: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A scheme's -log q(target) (t,) float64, KL(p_ref || q) (t,) float64 (clamped at 0: rounding may dip
    below) and whether its argmax equals the reference's (t,) bool, from its hidden states (t, hidden)."""
    z, lse, nll = _head(model, hidden, targets)
    agree = z.argmax(-1) == ref.top
    if ref.mean_row is not None:
        delta = ref.hidden.double() - hidden.double()  # (t, hidden)
        kl = (ref.mean_row.double() * delta).sum(-1) - ref.psum * (ref.lse - lse.double())
    else:
        lp = z - lse[:, None]
        kl = (ref.logprobs.exp() * (ref.logprobs - lp)).sum(-1).double()
    return nll, kl.clamp_min(0), agree
