"""EAGLE-3's training loss: training-time test over the draft's unrolled steps. Pure tensor functions.

Alignment (row t of the draft's step j; see eaglet/draft/eagle3/model.py):

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
top-1 agreement of draft and teacher. total = sum_j gamma^j * (loss_j + w * accept_j), where
accept_j is the optional acceptance-targeting term (train.accept_loss). Both pieces are the
shared ones of eaglet/draft/loss.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial

import torch
from torch import Tensor

from ..loss import PositionLoss, accept_term, chunked_soft_ce, compiled_accept_term, compiled_soft_ce


def step_mask(loss_mask_BT: Tensor, in_vocab_BT: Tensor, doc_ids_BT: Tensor | None, step: int) -> Tensor:
    """Which rows of step `step` count: bool [B, L], L = T - 2 - step (row t < L)."""
    T = loss_mask_BT.shape[1]
    L = max(T - 2 - step, 0)
    m = loss_mask_BT[:, 2 + step : 2 + step + L].bool() & in_vocab_BT[:, 1 + step : 1 + step + L].bool()
    if doc_ids_BT is not None:
        m = m & (doc_ids_BT[:, :L] == doc_ids_BT[:, 2 + step : 2 + step + L])
    return m


def head_rows(loss_mask_BT: Tensor, doc_ids_BT: Tensor | None, num_steps: int) -> list[Tensor]:
    """Per step, the flat row indices b*T + t (int64, ascending) that `step_mask` can count
    whatever the out-of-vocabulary verdict: the rows whose logits the loss needs. Made on the
    host from the batch's host tensors (nonzero would make a device wait)."""
    T = loss_mask_BT.shape[1]
    ones = torch.ones_like(loss_mask_BT, dtype=torch.bool)
    out = []
    for j in range(num_steps):
        b, t = step_mask(loss_mask_BT, ones, doc_ids_BT, j).nonzero(as_tuple=True)
        out.append(b * T + t)
    return out


def active_rows(rows: Sequence[Tensor]) -> Tensor:
    """The rows TTT steps 1.. must run over, given each step's `head_rows`: every row that some
    step from 1 on counts (ascending). From step 1 on, a row's states reach only that row's
    later steps, so the others' work there is wasted (`Eagle3Draft.ttt_steps`' active_rows)."""
    return torch.cat(list(rows[1:])).unique() if len(rows) > 1 else rows[0].new_zeros(0)




def step_loss(
    logits_BTN: Tensor,
    step: int,
    teacher_BTN: Tensor,
    in_vocab_BT: Tensor,
    loss_mask_BT: Tensor,
    doc_ids_BT: Tensor | None = None,
    teacher_top_BT: Tensor | None = None,
    soft_ce: Callable[..., tuple[Tensor, Tensor, Tensor]] = chunked_soft_ce,
    rows: Tensor | None = None,
    accept: Callable[..., Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor] | tuple[Tensor, Tensor, Tensor, Tensor]:
    """(mean soft CE, correct, count) of one step, aligned as the module header says, and
    with `accept` (`accept_term` with its kind bound) that term's mean as a fourth.

    teacher_top_BT: the teacher's argmax per position (computed here when not given);
    soft_ce: `chunked_soft_ce`, `masked_soft_ce` or `compiled_soft_ce()`;
    rows: the logits [1, len(rows), N] are of these rows only (flat b*T + t, `head_rows`)."""
    m = step_mask(loss_mask_BT, in_vocab_BT, doc_ids_BT, step)
    L = m.shape[1]
    if teacher_top_BT is None:
        teacher_top_BT = teacher_BTN.argmax(-1)
    if rows is not None:  # row t of step j reads the teacher at t + 1 + j: flat index r + 1 + j
        T = loss_mask_BT.shape[1]
        src = rows + (1 + step)
        m_rows = m[rows // T, rows % T].unsqueeze(0)
        top_rows = teacher_top_BT.flatten().index_select(0, src).unsqueeze(0)
        if accept is None:  # the soft CE gathers the teacher rows itself (compiled, in place)
            return soft_ce(logits_BTN, teacher_BTN, m_rows, top_rows, src)
        p_rows = teacher_BTN.flatten(0, 1).index_select(0, src).unsqueeze(0)  # once, for both terms
        return (*soft_ce(logits_BTN, p_rows, m_rows, top_rows), accept(logits_BTN, p_rows, m_rows))
    p = teacher_BTN[:, 1 + step : 1 + step + L]
    top = teacher_top_BT[:, 1 + step : 1 + step + L]
    out = soft_ce(logits_BTN, p, m, top)  # the first L rows of the logits: sliced inside (see masked_soft_ce)
    return out if accept is None else (*out, accept(logits_BTN, p, m))


def ttt_loss(
    logits_steps: Iterable[Tensor],
    teacher_BTN: Tensor,
    in_vocab_BT: Tensor,
    loss_mask_BT: Tensor,
    doc_ids_BT: Tensor | None = None,
    gamma: float = 0.8,
    compiled: bool = False,
    head_rows: Sequence[Tensor] | None = None,
    accept_loss: str = "none",
    accept_weight: float = 1.0,
) -> PositionLoss:
    """The TTT loss over all steps; `logits_steps` may be the draft's `ttt_steps` generator.
    compiled: the soft CE through torch.compile (`compiled_soft_ce`); else `chunked_soft_ce`.
    head_rows: the rows each step's logits are of, when the draft was given them.
    accept_loss, accept_weight: the acceptance term (`accept_term`) and its weight, added to
    each step's soft CE in `total` (`losses` stay the soft CE, so logs compare across runs)."""
    losses, correct, counts, accepts = [], [], [], []
    total: Tensor | float = 0.0
    teacher_top = teacher_BTN.argmax(-1)  # once, not once per step: the steps see shifted rows of it
    soft_ce = compiled_soft_ce() if compiled else chunked_soft_ce
    accept = None
    if accept_loss != "none":
        accept = partial(compiled_accept_term() if compiled else accept_term, kind=accept_loss)
    for j, logits in enumerate(logits_steps):
        loss, c, n, *extra = step_loss(logits, j, teacher_BTN, in_vocab_BT, loss_mask_BT, doc_ids_BT, teacher_top,
                                       soft_ce, None if head_rows is None else head_rows[j], accept)
        total = total + gamma**j * (loss + accept_weight * extra[0] if extra else loss)
        losses.append(loss)
        correct.append(c)
        counts.append(n)
        accepts.extend(extra)
    assert isinstance(total, Tensor), "no steps"
    return PositionLoss(total, losses, correct, counts, in_vocab_BT, accepts or None)
