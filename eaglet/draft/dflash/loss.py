"""DFlash training: the anchors of a packed micro-batch, and the block loss.

Anchors (`select_anchors`, on the host): a packed row a is a candidate when the token after it
is trained (loss_mask[a+1]) and its whole block a..a+B-1 lies in a's document. Each document
keeps at most `max_anchors` of its candidates, drawn at random with a generator seeded by
`seed` (the same micro-batch of the same run gets the same anchors, resumed or not), sorted.

Alignment (block anchored at a; slot k = 1..B-1):

    input            slot 0 the token x[a], slots 1.. the mask token, at positions pos[a] + k
    predicts         x[a+k]
    teacher          row a+k-1 of teacher_BTV (the target's distribution there predicts x[a+k])
    counted when     loss_mask[a+k] and in_vocab[a+k-1] and a+k is in a's document

Slot 0 is the pending token itself and is not trained. Loss: soft cross-entropy against the
teacher (eaglet/draft/loss.py's soft CE), slot k weighted w_k = exp(-(k-1)/gamma), total =
sum_k w_k * (summed CE of slot k) / (counted slots of all k): the weighted mean over every
counted (block, slot), as speculators normalises it. Accuracy, per SEAM.md: a slot is right
when it is counted and the draft's argmax is the teacher's; correct_k counts the blocks whose
slots 1..k are all right, counts_k those whose slots 1..k-1 are right and whose slot k is
counted, so prod_k acc_k is the share of blocks a verifier accepts to depth k.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ...errors import ConfigError
from ..loss import PositionLoss, chunked_soft_ce, compiled_soft_ce


def dflash_settings(cfg: Any) -> Any:
    """The config's `dflash` section (block_size, layers, gamma, max_anchors, mask_token_id,
    causal, target_layers): the one place this package reads it."""
    settings = getattr(cfg, "dflash", None)
    if settings is None:
        raise ConfigError("train.algorithm dflash needs a `dflash:` section in the config")
    return settings


def slot_weights(block_size: int, gamma: float) -> list[float]:
    """w_k = exp(-(k-1)/gamma) of slots k = 1..block_size-1."""
    return [math.exp(-(k - 1) / gamma) for k in range(1, block_size)]


def document_starts(doc_ids_T: Tensor) -> Tensor:
    """Per row, the first row of its document (documents contiguous)."""
    rows = torch.arange(doc_ids_T.numel(), device=doc_ids_T.device)
    first = torch.ones_like(doc_ids_T, dtype=torch.bool)
    first[1:] = doc_ids_T[1:] != doc_ids_T[:-1]
    return torch.where(first, rows, 0).cummax(0).values


def select_anchors(loss_mask_BT: Tensor, doc_ids_BT: Tensor, block_size: int, max_anchors: int, seed: int
                   ) -> dict[str, Tensor]:
    """{"anchors": the packed rows anchoring a block (ascending int64), "starts": the first row
    of each one's document}, of a [1, T] micro-batch (host tensors; the module header's rule)."""
    mask, docs = loss_mask_BT.reshape(-1).bool(), doc_ids_BT.reshape(-1)
    T = mask.numel()
    n = max(T - block_size + 1, 0)  # rows whose block fits in the sequence
    a = torch.arange(n)
    candidate = mask[1 : n + 1] & (docs[block_size - 1 : block_size - 1 + n] == docs[:n])
    rows = a[candidate]
    g = torch.Generator().manual_seed(int(seed))
    key = torch.rand(T, generator=g, dtype=torch.float64)[rows]
    # Rank the candidates of each document by their random key; keep the first max_anchors.
    doc_rank = torch.unique(docs[rows], return_inverse=True)[1].to(torch.float64)
    order = torch.argsort(doc_rank + key)  # by document, then by key (key < 1)
    ranked_docs = doc_rank[order]
    first = torch.ones_like(ranked_docs, dtype=torch.bool)
    first[1:] = ranked_docs[1:] != ranked_docs[:-1]
    index = torch.arange(order.numel())
    rank = index - torch.where(first, index, 0).cummax(0).values if order.numel() else index
    anchors = rows[order[rank < max_anchors]].sort().values
    return {"anchors": anchors, "starts": document_starts(docs)[anchors]}


def slot_targets(anchors_M: Tensor, num_slots: int, loss_mask_BT: Tensor, in_vocab_BT: Tensor, doc_ids_BT: Tensor
                 ) -> tuple[Tensor, Tensor]:
    """(teacher rows [M, K] = a+k-1, counted [M, K]) of slots k = 1..K (the module header's rule)."""
    T = loss_mask_BT.shape[-1]
    target = anchors_M[:, None] + torch.arange(1, num_slots + 1, device=anchors_M.device)
    inside = target < T
    target = target.clamp(max=T - 1)
    mask, in_vocab, docs = loss_mask_BT.reshape(-1).bool(), in_vocab_BT.reshape(-1).bool(), doc_ids_BT.reshape(-1)
    counted = inside & mask[target] & in_vocab[target - 1] & (docs[target] == docs[anchors_M][:, None])
    return target - 1, counted


def block_loss(logits_MKV: Tensor, anchors_M: Tensor, teacher_BTV: Tensor, in_vocab_BT: Tensor, loss_mask_BT: Tensor,
               doc_ids_BT: Tensor, gamma: float, compiled: bool = False) -> PositionLoss:
    """The loss of a micro-batch's blocks. logits_MKV: slots 1..K of each block
    (`DFlashDraft.block_logits`); teacher_BTV: the target's probabilities over the draft
    vocabulary per row; compiled: the soft CE through torch.compile."""
    M, K, _ = logits_MKV.shape
    rows, counted = slot_targets(anchors_M, K, loss_mask_BT, in_vocab_BT, doc_ids_BT)
    teacher_top = teacher_BTV.reshape(-1, teacher_BTV.shape[-1]).argmax(-1)[rows]
    with torch.no_grad():
        right = counted & (logits_MKV.argmax(-1) == teacher_top)
        run = right.long().cumprod(1)  # slots 1..k all right
        before = torch.cat([torch.ones_like(run[:, :1]), run[:, :-1]], dim=1)
    soft_ce = compiled_soft_ce() if compiled else chunked_soft_ce
    losses, sums, correct, counts, counted_total = [], [], [], [], 0
    for k, w in enumerate(slot_weights(K + 1, gamma)):
        loss, _, n = soft_ce(logits_MKV[:, k][None], teacher_BTV, counted[:, k][None], teacher_top[:, k][None],
                             rows[:, k])
        losses.append(loss)
        sums.append(w * loss * n)
        counted_total = counted_total + n
        correct.append(run[:, k].sum())
        counts.append((before[:, k] * counted[:, k]).sum())
    total = torch.stack(sums).sum() / counted_total.clamp(min=1)
    return PositionLoss(total, losses, correct, counts, in_vocab_BT)
