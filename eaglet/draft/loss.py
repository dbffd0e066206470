"""The loss machinery every draft type shares. Pure tensor functions.

- `teacher_targets`: the target's distribution over the draft vocabulary at every row (the
  teacher), and whether its full-vocabulary argmax is a draft token (the out-of-vocabulary mask).
- The soft cross-entropy of a draft's logits against the teacher over counted rows
  (`masked_soft_ce`, the reference; `chunked_soft_ce`, eager and lean; `compiled_soft_ce`,
  torch.compile's fusion), and an acceptance-targeting term beside it (`accept_term`,
  train.accept_loss): with draft q and teacher p over the draft vocabulary, a sampled draft
  token is accepted with probability alpha = sum_v min(p_v, q_v) = 1 - TV(p, q); 'tv' adds
  1 - alpha, 'log_accept' adds -log alpha (the LK family's objective), the cross-entropy
  staying as a trust region.
- `PositionLoss`, what a type's `loss` returns, and `simulated_acceptance_length` of its accuracies.

Which rows each drafted position counts, and how the positions combine, is the type's
(EAGLE-3's training-time test: eaglet/draft/eagle3/loss.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .compiling import compile_piece


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
    full_vocab: bool = True,
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
    full_vocab=False: only the draft columns are computed (the LM head rows of the draft
    vocabulary, gathered once per call), and in_vocab is all True: the same probabilities
    without the full-vocabulary argmax, for training without the out-of-vocabulary mask.
    """
    B, T, H = final_BTH.shape
    x_NH = final_BTH.reshape(B * T, H)
    draft_cols = torch.arange(d2t_N.numel(), device=d2t_N.device) + d2t_N
    out_dtype = torch.float64 if final_BTH.dtype == torch.float64 else torch.float32
    probs = torch.empty(B * T, d2t_N.numel(), dtype=out_dtype, device=final_BTH.device)
    in_vocab = torch.empty(B * T, dtype=torch.bool, device=final_BTH.device)

    def target_logits(raw: Tensor) -> Tensor:  # the target's own logits, fp32 (fp64 stays)
        logits = _acc(raw)
        if logit_scale != 1.0:
            logits = logits * logit_scale
        if logit_softcap:
            logits = torch.tanh(logits / logit_softcap) * logit_softcap
        return logits

    if not full_vocab:
        draft_head_NH = lm_head_weight_VH[draft_cols]
        in_vocab.fill_(True)
    for a in range(0, B * T, chunk):
        x = x_NH[a : a + chunk]
        if norm_weight_H is not None:
            x32 = _acc(x)
            x = norm_weight_H * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm_eps)).to(x.dtype)
        if not full_vocab:
            probs[a : a + chunk] = target_logits(x.to(draft_head_NH.dtype) @ draft_head_NH.T).softmax(-1)
            continue
        raw = x.to(lm_head_weight_VH.dtype) @ lm_head_weight_VH.T  # [chunk, V] in the head's dtype
        # The full-vocabulary logits serve only the argmax. Without a scale or softcap the
        # argmax of the raw (bf16) logits is the same index: the cast to fp32 is exact and
        # keeps the order and the ties. So no fp32 copy of the full vocabulary is made; the
        # softmax takes the draft columns first and casts only those (elementwise ops
        # commute with the column gather: the same values as casting everything first).
        top = raw.argmax(-1) if logit_scale == 1.0 and not logit_softcap else target_logits(raw).argmax(-1)
        in_vocab[a : a + chunk] = t2d_V[top]
        probs[a : a + chunk] = target_logits(raw[:, draft_cols]).softmax(-1)
    return probs.view(B, T, -1), in_vocab.view(B, T)




@dataclass
class PositionLoss:
    """One micro-batch's loss and metrics per drafted position (a draft type's `loss`): sums and
    counts as tensors, so no host sync until someone asks. Position k's accuracy is
    correct[k] / counts[k]; the trainer logs loss_k, acc_k and sim_tau from them."""

    total: Tensor  # the objective, differentiable (EAGLE-3: sum_j gamma^j * loss_j)
    losses: list[Tensor]  # mean soft CE over the counted rows of each position, differentiable
    correct: list[Tensor]  # rows where draft argmax == teacher argmax, per position
    counts: list[Tensor]  # counted rows per position
    in_vocab: Tensor | None = None  # the out-of-vocabulary mask's verdict the loss used [B, T]
    accept: list[Tensor] | None = None  # the acceptance term of each position (train.accept_loss), when on

    def accs(self) -> list[Tensor]:
        return [c / n.clamp(min=1) for c, n in zip(self.correct, self.counts, strict=True)]


def noisy_states(aux_BTA: Tensor, num_aux: int, scale: float) -> Tensor:
    """aux plus Gaussian noise, each captured state's by `scale` times its own RMS per token
    (train.state_noise: the states of a deep layer are many times a shallow one's)."""
    parts = aux_BTA.unflatten(-1, (num_aux, -1)).float()
    rms = parts.pow(2).mean(-1, keepdim=True).sqrt()
    return (parts + torch.randn_like(parts) * (scale * rms)).to(aux_BTA.dtype).flatten(-2)



def masked_soft_ce(logits_BTN: Tensor, p_BLN: Tensor, m_BL: Tensor, top_BL: Tensor, src: Tensor | None = None
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """(mean soft CE over the rows where m, correct, count): the reference formula.

    logits_BTN: the step's logits, T >= L rows, of which the first L are the step's rows (the
    rest get a zero gradient). Slicing here rather than in the caller lets torch.compile write
    the whole gradient in its backward kernel, where autograd's slice backward would fill a
    full-size zero tensor and copy the rows into it, once per step.
    top_BL: the teacher's argmax per row (draft ids). Eager mode runs `chunked_soft_ce`
    instead (the same numbers in less memory); torch.compile fuses this one (`compiled_soft_ce`).
    src: the logits are of some rows only (EAGLE-3's `head_rows`); their teacher rows are these rows of
    p_BLN [B, T, N] flattened (gathered here, so that a compiled loss reads them in place).
    """
    if src is not None:
        p_BLN = p_BLN.flatten(0, 1).index_select(0, src).unsqueeze(0)
    logits = _acc(logits_BTN[:, : m_BL.shape[1]])
    # Soft CE without materialising log-softmax: lse(z) - sum_v p_v z_v (sum_v p_v = 1).
    ce = torch.logsumexp(logits, dim=-1) - (p_BLN * logits).sum(-1)
    count = m_BL.sum()
    loss = (ce * m_BL).sum() / count.clamp(min=1)
    with torch.no_grad():
        correct = ((logits.argmax(-1) == top_BL) & m_BL).sum()
    return loss, correct, count


ACCEPT_LOSSES = ("none", "tv", "log_accept")


def accept_term(logits_BTN: Tensor, p_BLN: Tensor, m_BL: Tensor, kind: str, src: Tensor | None = None) -> Tensor:
    """Mean over the rows where m of 1 - alpha ('tv') or -log alpha ('log_accept'), alpha =
    sum_v min(p_v, softmax(z)_v), the chance that a token sampled from the draft is accepted;
    the rows as `masked_soft_ce` takes them (first L rows of the logits, or `src` rows of p)."""
    if kind not in ACCEPT_LOSSES[1:]:
        raise ValueError(f"train.accept_loss {kind!r}: expected one of {ACCEPT_LOSSES}")
    if src is not None:
        p_BLN = p_BLN.flatten(0, 1).index_select(0, src).unsqueeze(0)
    q = _acc(logits_BTN[:, : m_BL.shape[1]]).softmax(-1)
    alpha = torch.minimum(q, p_BLN.to(q.dtype)).sum(-1)
    term = 1 - alpha if kind == "tv" else -torch.log(alpha.clamp(min=1e-12))
    return (term * m_BL).sum() / m_BL.sum().clamp(min=1)


class _SoftCE(torch.autograd.Function):
    """Per-row soft CE lse(z) - p.z over the first L rows of logits [B, T, N] (L = p's rows),
    `chunk` rows at a time, with the draft's argmax per row. Saves the logits in their own
    dtype (bf16 under autocast) and the row lse, where autograd on the reference formula
    saves an fp32 copy of the logits; temporaries are chunk-sized. The gradient is computed
    as autograd computes the reference's, g * exp(z - lse) - g * p, so the values are the
    same bit for bit; rows past L get zeros (no full-size zero tensor and copy)."""

    @staticmethod
    def forward(ctx: Any, logits_BTN: Tensor, p_BLN: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
        B, L, _ = p_BLN.shape
        acc_dtype = torch.float64 if logits_BTN.dtype == torch.float64 else torch.float32
        ce = torch.empty(B, L, dtype=acc_dtype, device=logits_BTN.device)
        lse = torch.empty(B, L, dtype=acc_dtype, device=logits_BTN.device)
        top = torch.empty(B, L, dtype=torch.int64, device=logits_BTN.device)
        for b in range(B):
            for a in range(0, L, chunk):
                e = min(a + chunk, L)
                z = _acc(logits_BTN[b, a:e])
                lse[b, a:e] = torch.logsumexp(z, dim=-1)
                ce[b, a:e] = lse[b, a:e] - (p_BLN[b, a:e] * z).sum(-1)
                top[b, a:e] = z.argmax(-1)
        ctx.save_for_backward(logits_BTN, p_BLN, lse)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(top)
        return ce, top

    @staticmethod
    def backward(ctx: Any, grad_ce: Tensor, _grad_top: Tensor | None) -> tuple[Tensor | None, None, None]:
        logits_BTN, p_BLN, lse = ctx.saved_tensors
        B, L, _ = p_BLN.shape
        grad = torch.empty_like(logits_BTN)
        grad[:, L:].zero_()
        for b in range(B):
            for a in range(0, L, ctx.chunk):
                e = min(a + ctx.chunk, L)
                z = _acc(logits_BTN[b, a:e])
                g = grad_ce[b, a:e, None]
                grad[b, a:e] = g * (z - lse[b, a:e, None]).exp() + (-g) * p_BLN[b, a:e]
        return grad, None, None


def chunked_soft_ce(
    logits_BTN: Tensor, p_BLN: Tensor, m_BL: Tensor, top_BL: Tensor, src: Tensor | None = None, chunk: int = 1024
) -> tuple[Tensor, Tensor, Tensor]:
    """`masked_soft_ce` through `_SoftCE`: the same values, no fp32 copy of the logits kept."""
    if src is not None:
        p_BLN = p_BLN.flatten(0, 1).index_select(0, src).unsqueeze(0)
    ce, draft_top = _SoftCE.apply(logits_BTN, p_BLN, chunk)
    count = m_BL.sum()
    loss = (ce * m_BL).sum() / count.clamp(min=1)
    correct = ((draft_top == top_BL) & m_BL).sum()
    return loss, correct, count


# The dims that follow the data (the rows a step's loss counts), symbolic from the first compile
# (compiling.compile_piece).
LOSS_DATA_DIMS = {"logits_BTN": (0, 1), "p_BLN": (0, 1), "m_BL": (0, 1), "src": (0,)}
_compiled_soft_ce: Callable[..., tuple[Tensor, Tensor, Tensor]] | None = None
_compiled_accept_term: Callable[..., Tensor] | None = None


def compile_soft_ce(**compile_kwargs: Any) -> None:
    """Make `compiled_soft_ce` (and the compiled `accept_term` beside it) compiling.compile_piece(fn,
    **compile_kwargs) from now on (e.g. another backend)."""
    global _compiled_soft_ce, _compiled_accept_term
    _compiled_soft_ce = compile_piece(masked_soft_ce, LOSS_DATA_DIMS | {"top_BL": (0, 1)}, **compile_kwargs)
    _compiled_accept_term = compile_piece(accept_term, LOSS_DATA_DIMS, **compile_kwargs)


def compiled_soft_ce() -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """torch.compile(masked_soft_ce), made once per process: on a GPU one fused kernel
    reads each row of logits and teacher for the forward, one more for the backward."""
    if _compiled_soft_ce is None:
        compile_soft_ce()
    assert _compiled_soft_ce is not None
    return _compiled_soft_ce


def compiled_accept_term() -> Callable[..., Tensor]:
    """torch.compile(accept_term), made once per process beside `compiled_soft_ce` (compile_soft_ce)."""
    if _compiled_accept_term is None:
        compile_soft_ce()
    assert _compiled_accept_term is not None
    return _compiled_accept_term


def simulated_acceptance_length(accs: Sequence[float]) -> float:
    """1 + sum_k prod_{i<=k} acc_i: the expected tokens per verification of a chain whose
    step-k draft is accepted with probability acc_k given all earlier ones were."""
    tau, run = 1.0, 1.0
    for a in accs:
        run *= float(a)
        tau += run
    return tau
