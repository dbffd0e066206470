"""A chain draft's agreement with a known continuation, from its logits at every row and step:
the draft half of a chain replay (eaglet/engines/hf/replay.py) that every type whose step j of
row t can be computed for all rows at once shares (EAGLE-3's TTT unroll, P-EAGLE's depths).

    hits = chain_agreement(draft, side, k, max_tokens, steps)

`steps(aux_1NA, ids_1N, positions_1N, doc_ids_1N, k)` yields, for j = 0..k-1, the logits
[1, N, draft_vocab] of step j at every row t: the draft token that a cycle starting at row t
(the pending token x[t+1]) proposes j places on, which the continuation's token t+2+j accepts.
Each type's replay module says why its steps are exactly what its decoder proposes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from .proposals import ReplaySide

Steps = Callable[[Tensor, Tensor, Tensor, Tensor, int], Iterable[Tensor]]


@torch.no_grad()
def chain_agreement(draft: nn.Module, side: ReplaySide, k: int, max_tokens: int, steps: Steps) -> list[Tensor]:
    """Per sequence, [len, k]: the chance that step j of row t's draft token is accepted as the
    continuation's token t+2+j, for the rows and steps where that token exists. Greedy: 1 when
    the step drafts that token (as a target id), else 0. Sampled at temperature T: given that the
    output token is y, speculative sampling accepted the draft's token with probability
    min(p(y), q(y)) / p(y) = min(1, q(y) / p(y)) (p, q: the target's and the draft's
    distributions at T; q(y) = 0 outside the draft vocabulary). Whole sequences are packed into
    [1, N] documents of at most `max_tokens` (one longer sequence alone), as training packs them."""
    dev, dtype = draft.fc.weight.device, draft.fc.weight.dtype
    d2t = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device)).to(dev)
    T = side.temperature
    if T > 0:
        if side.p_token is None:
            raise ValueError("a sampled target side needs p_token")
        t2d = torch.full((draft.config.vocab_size,), -1, dtype=torch.long, device=dev)  # target id -> draft id
        t2d[d2t] = torch.arange(len(d2t), device=dev)
    out: list[Tensor] = []
    i, count = 0, len(side.sequences)
    while i < count:
        group, n = [], 0
        while i < count and (not group or n + len(side.sequences[i]) <= max_tokens):
            group.append(i)
            n += len(side.sequences[i])
            i += 1
        ids = torch.tensor([t for g in group for t in side.sequences[g]], device=dev)[None]
        aux = torch.cat([side.aux[g] for g in group]).to(dev, dtype)[None]
        pos = torch.cat([torch.arange(len(side.sequences[g])) for g in group]).to(dev)[None]
        doc = torch.cat([torch.full((len(side.sequences[g]),), j) for j, g in enumerate(group)]).to(dev)[None]
        hits = torch.zeros(n, k, dtype=torch.float64, device=dev)
        if T > 0:
            p_y = torch.cat([side.p_token[g] for g in group]).to(dev)
        for j, logits in enumerate(steps(aux, ids, pos, doc, k)):
            want = ids[0, 2 + j:]  # row t of step j predicts token t+2+j
            if T <= 0:
                hits[: n - 2 - j, j] = (d2t[logits[0, : n - 2 - j].argmax(-1)] == want).double()
                continue
            q = torch.softmax(logits[0, : n - 2 - j].double() / T, -1)
            d = t2d[want]
            q_y = torch.where(d >= 0, q.gather(-1, d.clamp(min=0)[:, None])[:, 0], 0.0)
            hits[: n - 2 - j, j] = (q_y / p_y[2 + j:]).clamp(max=1.0)
        hits, start = hits.cpu(), 0  # one copy to the host per pack
        for g in group:
            L = len(side.sequences[g])
            h = hits[start : start + L].clone()
            for j in range(k):  # rows whose token t+2+j lies in the next document
                h[max(L - 2 - j, 0):, j] = 0
            out.append(h)
            start += L
    return out
