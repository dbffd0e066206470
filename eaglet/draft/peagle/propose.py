"""P-EAGLE's proposer for in-process speculative decoding (batch 1): k tokens in one forward.

What vLLM 0.25.0 feeds its draft per cycle with parallel drafting (v1/spec_decode/
llm_base_proposer.py, set_inputs_first_pass; spec_decode/utils.py
copy_and_expand_eagle_inputs_kernel): the newly verified rows (target state at s, token x[s+1]),
the last of them the bonus token with the target's state before it, then k-1 slots holding the
mask token (`pard_token`) and fc(mask_hidden), at consecutive positions, all in one forward; the
k tokens are sampled at the bonus row and the mask slots, each from its own distribution.

Here a committed row is kept as EAGLE-3's decoder keeps it (row s: the target's states at s,
token x[s+1], position s+1) but reaches the KV cache only in the next `propose`, which runs the
rows committed since, the last one (the pending token `root`'s row) and the k-1 mask slots in
that one forward. The cache then keeps the committed rows except the last, which the next
forward runs again as context (its keys are the same; its logits are that cycle's first
proposal): so `propose` can run again with nothing committed in between and gives the same
proposals.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..eagle3.attention import KVCache
from .model import PeagleDraft


class PeagleProposer:
    """The draft's state for one request (eaglet/draft/base.py Proposer)."""

    def __init__(self, draft: PeagleDraft):
        self.draft = draft
        self.device = draft.fc.weight.device
        self.dtype = draft.fc.weight.dtype
        vocab = draft.config.draft_vocab_size
        self.draft_to_target = draft.draft_to_target(torch.arange(vocab, device=draft.d2t.device)).to(self.device)
        self.reset()

    def reset(self) -> None:
        self.cache = KVCache(len(self.draft.layers))
        self.pending_aux: list[Tensor] = []  # committed rows not in the cache yet: states [n, A] ...
        self.pending_tokens: list[int] = []  # ... and tokens x[s+1]

    @property
    def length(self) -> int:
        return self.cache.length + len(self.pending_tokens)

    def extend(self, aux_NA: Tensor, next_tokens: Sequence[int], first_row: int) -> None:
        """Commit rows first_row.. (the target's states at those positions, tokens x[s+1])."""
        if first_row != self.length:
            raise RuntimeError(f"draft holds {self.length} rows, extend starts at {first_row}")
        if aux_NA.shape[0] != len(next_tokens):
            raise ValueError(f"{aux_NA.shape[0]} rows of states for {len(next_tokens)} tokens")
        self.pending_aux.append(aux_NA.to(self.device, self.dtype))
        self.pending_tokens += [int(t) for t in next_tokens]

    @torch.no_grad()
    def logits(self, root: int, prefix: int, k: int) -> Tensor:
        """The draft logits [k, draft_vocab] (fp32; fp64 drafts stay fp64) of the k proposals after
        the pending token `root` at position `prefix`: row Q-1's and the k-1 mask slots'."""
        if prefix != self.length or not self.pending_tokens:
            raise RuntimeError(f"propose at position {prefix}: the draft holds {self.length} rows, "
                               f"{len(self.pending_tokens)} of them not yet run")
        if self.pending_tokens[-1] != root:
            raise RuntimeError(f"the last committed row's token is {self.pending_tokens[-1]}, not the root {root}")
        draft, start = self.draft, self.cache.length
        hidden = draft.project_aux(torch.cat(self.pending_aux)[None])
        ids = torch.tensor([self.pending_tokens], device=self.device)
        if k > 1:
            hidden = torch.cat([hidden, draft.mask_state().to(hidden.dtype).expand(1, k - 1, -1)], dim=1)
            ids = torch.cat([ids, ids.new_full((1, k - 1), draft.config.mask_token_id)], dim=1)
        positions = torch.arange(start + 1, prefix + max(k, 1), device=self.device)[None]
        _, logits = draft.forward_step(hidden, ids, positions, self.cache)
        self.cache.crop(prefix - 1)  # the committed rows but the last (module header)
        self.pending_aux = [self.pending_aux[-1][-1:]]
        self.pending_tokens = self.pending_tokens[-1:]
        out = logits[0, -k:] if k > 0 else logits[0, :0]
        return out if out.dtype == torch.float64 else out.float()

    def propose(self, root: int, prefix: int, k: int, temperature: float,
                generator: torch.Generator | None) -> tuple[list[int], list[Tensor]]:
        """k proposals (target ids) after `root` at position `prefix`: argmax at temperature 0,
        else each sampled from its own softmax(logits / T), returned too (CPU fp64)."""
        logits = self.logits(root, prefix, k)
        if temperature <= 0:
            return [int(self.draft_to_target[d]) for d in logits.argmax(-1).tolist()], []
        tokens, dists = [], []
        for row in logits:
            q = torch.softmax(row.double().cpu() / temperature, -1)
            tokens.append(int(self.draft_to_target[int(torch.multinomial(q, 1, generator=generator))]))
            dists.append(q)
        return tokens, dists
