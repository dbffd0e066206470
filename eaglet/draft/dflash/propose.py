"""DFlash in in-process speculative decoding: the proposer (base.py `Proposer`) and replay's hits.

The proposer keeps, per draft layer, the context keys and values (after k_norm and RoPE) of
the committed rows, as vLLM 0.25.0 keeps them in the draft's KV cache
(`precompute_and_store_context_kv`). A proposal is one forward of the block [root, mask x k]
at positions prefix..prefix+k over the first `prefix` cached rows: slot i's argmax (or a
sample at temperature T) is the i-th drafted token. The block is k+1 rows long, as vLLM runs it
with k speculative tokens; with k = block_size - 1 it is the trained block, and
`DFlashDraft.block_logits` gives the same logits (tests/test_dflash.py holds them equal).

`block_hits` is the same drafting for every position of a target's greedy sequence at once
(replay): exact for greedy decoding, since a proposal depends only on the committed rows, the
root token and k.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ...errors import ConfigError
from .model import DFlashDraft


class DFlashProposer:
    """One request's context cache (batch 1)."""

    def __init__(self, draft: DFlashDraft):
        self.draft = draft
        self.device, self.dtype = draft.fc.weight.device, draft.fc.weight.dtype
        vd = draft.config.draft_vocab_size
        self.draft_to_target = draft.draft_to_target(torch.arange(vd, device=draft.d2t.device)).to(self.device)
        self.reset()

    def reset(self) -> None:
        c = self.draft.config
        empty = torch.zeros(1, c.num_key_value_heads, 0, c.head_dim, device=self.device, dtype=self.dtype)
        self.cache: list[tuple[Tensor, Tensor]] = [(empty, empty) for _ in range(c.num_layers)]

    @property
    def length(self) -> int:
        return self.cache[0][0].shape[2]

    @torch.no_grad()
    def extend(self, aux_NA: Tensor, next_tokens: Sequence[int], first_row: int) -> None:
        """Commit rows first_row.. (the target's states aux_NA at those positions); rows from
        first_row on that were committed before (a rejected draft's) are replaced. next_tokens:
        unused (the block reads the pending token at proposal time)."""
        if first_row > self.length:
            raise RuntimeError(f"draft cache holds {self.length} rows; cannot commit from row {first_row}")
        positions = torch.arange(first_row, first_row + aux_NA.shape[0], device=self.device)[None]
        new = self.draft.context_kv(aux_NA.to(self.device, self.dtype)[None], positions)
        self.cache = [(torch.cat([k[:, :, :first_row], nk], 2), torch.cat([v[:, :, :first_row], nv], 2))
                      for (k, v), (nk, nv) in zip(self.cache, new, strict=True)]

    @torch.no_grad()
    def propose(self, root: int, prefix: int, k: int, temperature: float,
                generator: torch.Generator | None) -> tuple[list[int], list[Tensor]]:
        """k proposals (target ids) after the pending token `root` at position `prefix`, from
        the first `prefix` committed rows; at temperature > 0 each slot is sampled from
        softmax(logits / T), returned too (draft vocabulary, CPU fp64)."""
        if not 1 <= k < self.draft.config.block_size:
            raise ConfigError(f"eval.chain_tokens {k}: a DFlash draft of block size {self.draft.config.block_size} "
                              f"drafts 1 to {self.draft.config.block_size - 1} tokens a cycle (train it with a larger "
                              "dflash.block_size, or set eval.chain_tokens lower)")
        if prefix > self.length:
            raise RuntimeError(f"draft cache holds {self.length} rows; a proposal at {prefix} needs them all")
        context = [(kk[:, :, :prefix], vv[:, :, :prefix]) for kk, vv in self.cache]
        logits = self.draft.cached_block_logits(root, prefix, k, context).float()
        if temperature <= 0:
            return [int(t) for t in self.draft_to_target[logits.argmax(-1)]], []
        qs = torch.softmax(logits.double().cpu() / temperature, -1)
        picks = [int(torch.multinomial(q, 1, generator=generator)) for q in qs]
        return [int(self.draft_to_target[d]) for d in picks], list(qs)


@torch.no_grad()
def block_hits(draft: DFlashDraft, aux_LA: Tensor, tokens_L: Sequence[int] | Tensor, k: int,
               anchors_per_pass: int = 256, attn_impl: str = "auto") -> Tensor:
    """bool [L, k]: row Q, column i-1 says whether the block [x[Q], mask x k] at position Q,
    over the target states of rows < Q, drafts token x[Q+i] at slot i (False where Q+i >= L).
    Batched forwards with anchors at every position (`anchors_per_pass` at a time). The
    decoder's cycle with Q tokens committed reads row Q (EAGLE-3's agreement_runs: row Q-1)."""
    dev, dtype = draft.fc.weight.device, draft.fc.weight.dtype
    ids = torch.as_tensor(tokens_L, device=dev).reshape(1, -1)
    L = ids.shape[1]
    aux = aux_LA.to(dev, dtype)[None]
    positions = torch.arange(L, device=dev)[None]
    to_target = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device)).to(dev)
    want = torch.cat([ids[0], ids.new_full((k,), -1)]).unfold(0, k, 1)[1 : L + 1]  # [L, k]: x[Q+1..Q+k]
    hits = torch.zeros(L, k, dtype=torch.bool, device=dev)
    for first in range(0, L, anchors_per_pass):
        anchors = torch.arange(first, min(first + anchors_per_pass, L), device=dev)
        logits = draft.block_logits(aux, ids, positions, anchors, torch.zeros_like(anchors), k + 1, attn_impl)
        hits[anchors] = to_target[logits.argmax(-1)] == want[anchors]
    return hits.cpu()


@torch.no_grad()
def chain_hits(draft: DFlashDraft, side: Any, k: int, max_tokens: int = 8192, attn_impl: str = "auto",
               anchors_per_pass: int = 256) -> list[Tensor]:
    """Replay's rows (eaglet/engines/hf/replay.py `agreement_runs`): per sequence of the target
    side, [len, k] float64, row Q-1 for the cycle with Q tokens committed (EAGLE-3's indexing),
    column i-1 the chance that slot i's draft token is accepted as the continuation's token
    x[Q+i]. Greedy: 1 when slot i drafts it, else 0 (`block_hits`). At temperature T (a side
    sampled at T): each slot's token is drawn from its own softmax(logits / T), so given the
    output token y it was accepted with probability min(1, q(y) / p(y)), as EAGLE-3's replay
    takes it (q(y) = 0 outside the draft vocabulary). max_tokens: unused (one sequence a pass)."""
    dev, dtype = draft.fc.weight.device, draft.fc.weight.dtype
    T = float(side.temperature)
    to_target = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device)).to(dev)
    if T > 0:
        if side.p_token is None:
            raise ValueError("a sampled target side needs p_token")
        to_draft = torch.full((draft.config.vocab_size,), -1, dtype=torch.long, device=dev)
        to_draft[to_target] = torch.arange(len(to_target), device=dev)
    out = []
    for seq, aux_LA, p_token in zip(side.sequences, side.aux, side.p_token or [None] * len(side.sequences)):
        L = len(seq)
        rows = torch.zeros(L, k, dtype=torch.float64)
        if T <= 0:
            rows[: L - 1] = block_hits(draft, aux_LA, seq, k, anchors_per_pass, attn_impl)[1:].double()
            out.append(rows)
            continue
        ids = torch.as_tensor(seq, device=dev)[None]
        aux = aux_LA.to(dev, dtype)[None]
        positions = torch.arange(L, device=dev)[None]
        want = torch.cat([ids[0], ids.new_full((k,), -1)]).unfold(0, k, 1)[1 : L + 1]  # [L, k]: x[Q+1..Q+k]
        p_y = torch.cat([p_token.to(dev).double(), torch.ones(k, dtype=torch.float64, device=dev)]).unfold(0, k, 1)[1:L + 1]
        for first in range(1, L, anchors_per_pass):
            anchors = torch.arange(first, min(first + anchors_per_pass, L), device=dev)
            q = torch.softmax(draft.block_logits(aux, ids, positions, anchors, torch.zeros_like(anchors), k + 1,
                                                 attn_impl).double() / T, -1)  # [M, k, Vd]
            w = want[anchors]
            d = torch.where(w >= 0, to_draft[w.clamp(min=0)], -1)
            q_y = torch.where(d >= 0, q.gather(-1, d.clamp(min=0)[..., None])[..., 0], 0.0)
            rows[anchors.cpu() - 1] = torch.where(w >= 0, (q_y / p_y[anchors]).clamp(max=1.0), 0.0).cpu()
        out.append(rows)
    return out
