"""P-EAGLE's training objective: the sampled depth rows and the per-depth soft cross-entropy.

Alignment (anchor row t, depth d; eaglet/draft/peagle/model.py): the element runs at position
t+1+d and predicts x[t+2+d]. That is EAGLE-3's step d of row t (eaglet/draft/loss.py module
header), so the teacher row (t+1+d of teacher_BTV) and which elements count (`step_mask`:
loss_mask[t+2+d], in_vocab[t+1+d], the same document) are EAGLE-3's `step_loss` unchanged.
speculators 0.9.0 (models/peagle/core.py after eagle3/data.py shift_batch) reads the same teacher
row; it masks by the element's input token where eaglet, for every type, masks by the token
predicted.

Sampled depths (speculators 0.9.0 models/peagle/data.py generate_cod_sample_indices): depth 0
runs every row and counts those `step_mask` counts (n rows). Depth d >= 1 keeps
floor((n - d) * max(r**d, r_min)) rows, drawn at random from the pool of the rows depth d-1
kept whose depth-d element counts (depth 1's pool: the rows whose depth-1 element counts), all
of the pool when it is smaller; a depth that would keep none ends the sampling (it and every
later depth run over no rows). So depth d's rows are a subset of depth d-1's, and a row runs to
depth d only if its elements of depths 1..d all count. The draw is made on the host from
`seed` alone (`host_rows`), so a resumed run draws the same rows for the same micro-batch.

Loss: per depth the mean soft cross-entropy over its counted elements (eaglet/draft/loss.py's
soft CE), and total = their mean over all counted elements of all depths, as speculators'
loss averages over every sampled element: no position decay (train.gamma is EAGLE-3's), and no
acceptance term (train.accept_loss is EAGLE-3's; speculators' P-EAGLE has none). Accuracies: per depth, plain
(each depth is conditioned on the accepted prefix as EAGLE-3's steps are: its context is the
target's states up to the anchor).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..eagle3.loss import head_rows, step_loss
from ..loss import PositionLoss
from ..loss import chunked_soft_ce, compiled_soft_ce
from .model import peagle_settings


def depth_ratio(d: int, ratio: float, ratio_min: float) -> float:
    """The share of the depth-0 rows that depth d >= 1 keeps: max(ratio**d, ratio_min)."""
    return max(ratio**d, ratio_min)


def sample_depth_rows(loss_mask_BT: Tensor, doc_ids_BT: Tensor | None, depths: int, ratio: float, ratio_min: float,
                      seed: int) -> list[Tensor]:
    """Per depth the flat rows (b*T + t, int64, ascending) it runs over: depth 0 the rows it
    counts (its logits'), depth d >= 1 the sampled rows (module header). Host tensors in, host
    tensors out; the same seed draws the same rows."""
    counted = head_rows(loss_mask_BT, doc_ids_BT, depths)
    generator = torch.Generator().manual_seed(int(seed))
    rows = [counted[0]]
    n = counted[0].numel()
    pool = counted[1] if depths > 1 else counted[0][:0]
    for d in range(1, depths):
        size = int((n - d) * depth_ratio(d, ratio, ratio_min)) if n > d else 0
        if size <= 0:
            rows += [counted[0][:0]] * (depths - d)
            break
        if pool.numel() > size:
            pool = pool[torch.randperm(pool.numel(), generator=generator)[:size]].sort().values
        rows.append(pool)
        if d + 1 < depths:
            pool = pool[torch.isin(pool, counted[d + 1])]
    return rows


def host_rows(loss_mask_BT: Tensor, doc_ids_BT: Tensor, cfg: Any, seed: int) -> dict[str, Tensor]:
    """`sample_depth_rows` with the `peagle:` settings, keyed depth0, depth1, ... (Batch.rows)."""
    s = peagle_settings(cfg)
    rows = sample_depth_rows(loss_mask_BT.cpu(), doc_ids_BT.cpu(), s["depths"], s["down_sample_ratio"],
                             s["down_sample_ratio_min"], seed)
    return {f"depth{d}": r for d, r in enumerate(rows)}


def depth_rows_of(rows: dict[str, Tensor]) -> list[Tensor]:
    """Batch.rows (host_rows' dict) as the list depth_steps takes."""
    return [rows[f"depth{d}"] for d in range(len(rows))]


def depth_loss(
    logits_depths: Iterable[Tensor],
    teacher_BTN: Tensor,
    in_vocab_BT: Tensor,
    loss_mask_BT: Tensor,
    doc_ids_BT: Tensor | None,
    depth_rows: Sequence[Tensor],
    compiled: bool = False,
) -> PositionLoss:
    """The loss over all depths; `logits_depths` may be the draft's `depth_steps` generator
    (depth d's logits of the rows depth_rows[d])."""
    soft_ce = compiled_soft_ce() if compiled else chunked_soft_ce
    teacher_top = teacher_BTN.argmax(-1)
    losses, correct, counts = [], [], []
    for d, logits in enumerate(logits_depths):
        loss, c, n = step_loss(logits, d, teacher_BTN, in_vocab_BT, loss_mask_BT, doc_ids_BT, teacher_top, soft_ce,
                               depth_rows[d])
        losses.append(loss)
        correct.append(c)
        counts.append(n)
    assert losses, "no depths"
    total = sum(loss * n for loss, n in zip(losses, counts, strict=True)) / sum(counts).clamp(min=1)
    return PositionLoss(total, losses, correct, counts, in_vocab_BT, None)


def loss(module: Any, draft: Any, batch: Any, teacher_BTV: Tensor, in_vocab_BT: Tensor, cfg: Any,
         compiled: bool) -> PositionLoss:
    """The loss of one packed micro-batch (DraftType.loss). Its rows are Batch.rows (`host_rows`,
    drawn by the trainer); a batch without them (an evaluation's) draws them with seed 0."""
    rows = batch.rows
    if rows is None:
        rows = {k: v.to(batch.loss_mask.device) for k, v in host_rows(batch.loss_mask, batch.doc_ids, cfg, 0).items()}
    depth_rows = depth_rows_of(rows)
    logits = module(batch.aux, batch.input_ids, batch.position_ids, batch.doc_ids, depth_rows=depth_rows,
                    attn_impl=cfg.train.attn_impl)
    return depth_loss(logits, teacher_BTV, in_vocab_BT, batch.loss_mask, batch.doc_ids, depth_rows, compiled)
