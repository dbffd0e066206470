"""P-EAGLE's half of a chain replay (eaglet/engines/hf/replay.py, the target's half): the draft's
agreement with a known continuation (`chain_hits`).

A cycle that starts with Q tokens committed (the pending token x[Q] at position Q) proposes its
k tokens in one forward (propose.py): row Q-1 (the target's states at Q-1, token x[Q], position
Q) and k-1 mask slots at positions Q+1..Q+k-1, over the committed rows and the earlier slots.
Those inputs are the committed target states and the root token only, never an earlier
proposal, so on an accepted path (greedy: the target's own tokens) they are known before any
decoding. They are exactly depths 0..k-1 of anchor row Q-1 in training's forward (model.py
`depth_steps`: depth d of row t runs at position t+1+d over the depth-0 rows <= t and its own
row's depths 1..d). So one forward over every row at every depth gives each row's proposals,
and the replay of greedy chain decoding is exact. Sampled (temperature T), each proposal is
drawn from its own distribution, which no earlier draw changes, so speculative sampling
accepted it with min(1, q(y) / p(y)) given the output token y (eaglet/draft/agreement.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from ..agreement import chain_agreement
from ..proposals import ReplaySide
from .model import PeagleDraft


def chain_hits(draft: PeagleDraft, side: ReplaySide, k: int, max_tokens: int = 8192,
               attn_impl: str = "auto") -> list[Tensor]:
    """Per sequence, [len, k]: the chance that depth j of row t's proposal is accepted as the
    continuation's token t+2+j (eaglet/draft/agreement.py `chain_agreement`), from one forward
    over every row at depths 0..k-1 (module header)."""
    def steps(aux: Tensor, ids: Tensor, pos: Tensor, doc: Tensor, k: int) -> Iterable[Tensor]:
        every = torch.arange(ids.numel(), device=ids.device)
        for logits in draft.depth_steps(aux, ids, pos, doc, depth_rows=[None] + [every] * (k - 1),
                                        attn_impl=attn_impl):
            yield logits.reshape(1, ids.numel(), -1)

    return chain_agreement(draft, side, k, max_tokens, steps)
