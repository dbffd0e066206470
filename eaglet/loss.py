"""Teacher distributions and the TTT loss of EAGLE-3 training. Pure tensor functions.

Alignment (row t of the draft's step j; see eaglet/model.py):

    input token          x[t+1+j]
    predicts             x[t+2+j]
    teacher              the target's distribution at position t+1+j (it predicts x[t+2+j])
    counted when         loss_mask[t+2+j]        the predicted token is a trained token
                     and in_vocab[t+1+j]         the target's argmax is in the draft vocab
                     and doc_ids[t+2+j] == doc_ids[t]   (packed sequences)

The loss mask moves with the target, one more position per step. Official EAGLE-3 once
shifted the target but not the mask (EAGLE issue 317); `step_mask` is the one place that
decides which (row, step) pairs count, and the tests pin it down.

Per step: soft cross-entropy against the teacher, averaged over the counted rows, and the
top-1 agreement of draft and teacher. total = sum_j gamma^j * loss_j.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def _acc(x: Tensor) -> Tensor:
    return x if x.dtype == torch.float64 else x.float()


@torch.no_grad()
def teacher_targets(
    final_BTH: Tensor,
    lm_head_weight_VH: Tensor,
    t2d_V: Tensor,
    d2t_N: Tensor,
    chunk: int = 512,
    norm_weight_H: Tensor | None = None,
    norm_eps: float = 1e-6,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """(teacher probs over the draft vocab [B,T,N] fp32, in_vocab bool [B,T]).

    final_BTH: the target's last hidden state. Pass `norm_weight_H` (the target's final
    RMSNorm weight) when it was stored before that norm; leave it None when it already has
    the norm applied (HF's last output_hidden_states entry usually does). Gemma-style
    (1 + w) norms: pass 1 + w.
    Full-vocabulary logits exist for `chunk` positions at a time only. They are computed in
    the lm_head weight's dtype, as the target computes its own, then softmaxed in fp32 over
    the draft columns (target id = draft id + d2t). in_vocab: the full-vocab argmax is a
    draft token (t2d). `logit_scale` and `logit_softcap` (tanh softcap, Gemma) turn the LM
    head's output into the target's own logits, as its CausalLM does.
    """
    B, T, H = final_BTH.shape
    x_NH = final_BTH.reshape(B * T, H)
    draft_cols = torch.arange(d2t_N.numel(), device=d2t_N.device) + d2t_N
    out_dtype = torch.float64 if final_BTH.dtype == torch.float64 else torch.float32
    probs = torch.empty(B * T, d2t_N.numel(), dtype=out_dtype, device=final_BTH.device)
    in_vocab = torch.empty(B * T, dtype=torch.bool, device=final_BTH.device)
    for a in range(0, B * T, chunk):
        x = x_NH[a : a + chunk]
        if norm_weight_H is not None:
            x32 = _acc(x)
            x = norm_weight_H * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm_eps)).to(x.dtype)
        logits = _acc(x.to(lm_head_weight_VH.dtype) @ lm_head_weight_VH.T)
        if logit_scale != 1.0:
            logits = logits * logit_scale
        if logit_softcap:
            logits = torch.tanh(logits / logit_softcap) * logit_softcap
        in_vocab[a : a + chunk] = t2d_V[logits.argmax(-1)]
        probs[a : a + chunk] = logits[:, draft_cols].softmax(-1)
    return probs.view(B, T, -1), in_vocab.view(B, T)


def step_mask(loss_mask_BT: Tensor, in_vocab_BT: Tensor, doc_ids_BT: Tensor | None, step: int) -> Tensor:
    """Which rows of step `step` count: bool [B, L], L = T - 2 - step (row t < L)."""
    T = loss_mask_BT.shape[1]
    L = max(T - 2 - step, 0)
    m = loss_mask_BT[:, 2 + step : 2 + step + L].bool() & in_vocab_BT[:, 1 + step : 1 + step + L].bool()
    if doc_ids_BT is not None:
        m = m & (doc_ids_BT[:, :L] == doc_ids_BT[:, 2 + step : 2 + step + L])
    return m


@dataclass
class TTTLoss:
    """Per-step sums and counts (tensors, so no host sync until someone asks)."""

    total: Tensor  # sum_j gamma^j * loss_j, differentiable
    losses: list[Tensor]  # mean soft CE over the counted rows of each step, differentiable
    correct: list[Tensor]  # rows where draft argmax == teacher argmax, per step
    counts: list[Tensor]  # counted rows per step

    def accs(self) -> list[Tensor]:
        return [c / n.clamp(min=1) for c, n in zip(self.correct, self.counts, strict=True)]


def step_loss(
    logits_BTN: Tensor,
    step: int,
    teacher_BTN: Tensor,
    in_vocab_BT: Tensor,
    loss_mask_BT: Tensor,
    doc_ids_BT: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(mean soft CE, correct, count) of one step, aligned as the module header says."""
    m = step_mask(loss_mask_BT, in_vocab_BT, doc_ids_BT, step)
    L = m.shape[1]
    logits = _acc(logits_BTN[:, :L])
    p = teacher_BTN[:, 1 + step : 1 + step + L]
    # Soft CE without materialising log-softmax: lse(z) - sum_v p_v z_v (sum_v p_v = 1).
    ce = torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)
    count = m.sum()
    loss = (ce * m).sum() / count.clamp(min=1)
    with torch.no_grad():
        correct = ((logits.argmax(-1) == p.argmax(-1)) & m).sum()
    return loss, correct, count


def ttt_loss(
    logits_steps: Iterable[Tensor],
    teacher_BTN: Tensor,
    in_vocab_BT: Tensor,
    loss_mask_BT: Tensor,
    doc_ids_BT: Tensor | None = None,
    gamma: float = 0.8,
) -> TTTLoss:
    """The TTT loss over all steps; `logits_steps` may be the draft's `ttt_steps` generator."""
    losses, correct, counts = [], [], []
    total: Tensor | float = 0.0
    for j, logits in enumerate(logits_steps):
        loss, c, n = step_loss(logits, j, teacher_BTN, in_vocab_BT, loss_mask_BT, doc_ids_BT)
        total = total + gamma**j * loss
        losses.append(loss)
        correct.append(c)
        counts.append(n)
    assert isinstance(total, Tensor), "no steps"
    return TTTLoss(total, losses, correct, counts)


def simulated_acceptance_length(accs: Sequence[float]) -> float:
    """1 + sum_k prod_{i<=k} acc_i: the expected tokens per verification of a chain whose
    step-k draft is accepted with probability acc_k given all earlier ones were."""
    tau, run = 1.0, 1.0
    for a in accs:
        run *= float(a)
        tau += run
    return tau
