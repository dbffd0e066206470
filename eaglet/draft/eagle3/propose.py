"""EAGLE-3's proposer for in-process speculative decoding (eaglet/draft/base.py `Proposer`):
the draft with its KV cache kept across cycles, drafting a chain step by step (`propose`) or
an EAGLE-2 dynamic tree (`propose_tree`, the decoder's eval.method tree).

Indexing (as in model.py): the draft's row s takes the target's state at position s and
token s+1, at position s+1, and predicts token s+2. With Q tokens committed and the pending
token x[Q], the last committed row is row Q-1 and its output predicts x[Q+1]; a proposal at
depth d sits at position Q+d. The proposals' own rows are dropped after each cycle (the cache
cropped back to Q); the accepted positions are then committed with the *target's* states.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..proposals import Tree
from .attention import KVCache
from .model import Eagle3Draft


class Eagle3Proposer:
    """The draft with its KV cache kept across cycles (one row per committed position), and the
    last committed row's output, which the next proposals start from."""

    def __init__(self, draft: Eagle3Draft):
        self.draft = draft
        self.device = draft.fc.weight.device
        self.dtype = draft.fc.weight.dtype
        self.cache = KVCache(len(draft.layers))
        vd = draft.config.draft_vocab_size
        self.draft_to_target = draft.draft_to_target(torch.arange(vd, device=draft.d2t.device)).to(self.device)
        self.last: tuple[Tensor, Tensor] | None = None  # the last committed row's (hidden, logits)

    def reset(self) -> None:
        self.cache = KVCache(len(self.draft.layers))
        self.last = None

    @property
    def length(self) -> int:
        return self.cache.length

    @torch.no_grad()
    def extend(self, aux_NA: Tensor, next_tokens: Sequence[int], first_row: int) -> tuple[Tensor, Tensor]:
        """Commit rows first_row.. (target states aux_NA, tokens x[s+1], positions s+1); returns
        the last row's (hidden [H], logits [draft_vocab] fp32), which predict the next token."""
        n = aux_NA.shape[0]
        if self.cache.length != first_row:
            raise RuntimeError(f"draft cache holds {self.cache.length} rows, expected {first_row}")
        hidden = self.draft.project_aux(aux_NA.to(self.device, self.dtype)[None])
        ids = torch.tensor([list(next_tokens)], device=self.device)
        pos = torch.arange(first_row + 1, first_row + 1 + n, device=self.device)[None]
        h, logits = self.draft.forward_step(hidden, ids, pos, self.cache)
        self.last = h[0, -1], logits[0, -1].float()
        return self.last

    @torch.no_grad()
    def step(self, hidden_NH: Tensor, tokens: Sequence[int], positions: Sequence[int],
             mask_NS: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Uncommitted rows (draft proposals): (hidden [N, H], logits [N, draft_vocab] fp32)."""
        ids = torch.tensor([list(tokens)], device=self.device)
        pos = torch.tensor([list(positions)], device=self.device)
        h, logits = self.draft.forward_step(hidden_NH[None], ids, pos, self.cache, mask_NS)
        return h[0], logits[0].float()

    def _last(self) -> tuple[Tensor, Tensor]:
        if self.last is None:
            raise RuntimeError("the draft proposes after the prompt's rows are committed (extend)")
        return self.last

    def propose(self, root: int, prefix: int, k: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> tuple[list[int], list[Tensor]]:
        """k chained draft tokens (target ids) after the pending token `root` (at position `prefix`).

        Greedy: argmax; T > 0: sampled from softmax(logits / T), with each step's draft
        distribution (over the draft vocabulary, CPU fp64)."""
        hidden, logits = self._last()
        tokens, qs = [], []
        for i in range(k):
            if i > 0:
                h, lg = self.step(hidden[None], [tokens[-1]], [prefix + i])
                hidden, logits = h[0], lg[0]
            if temperature > 0:
                q = torch.softmax(logits.double().cpu() / temperature, -1)
                d = int(torch.multinomial(q, 1, generator=generator))
                qs.append(q)
            else:
                d = int(logits.argmax())
            tokens.append(int(self.draft_to_target[d]))
        self.cache.crop(prefix)
        return tokens, qs

    def propose_tree(self, root: int, prefix: int, top_k: int, depth: int, total_tokens: int) -> Tree:
        """The EAGLE-2 dynamic tree after the pending token `root` (`draft_tree`)."""
        hidden, logits = self._last()
        return draft_tree(self, hidden, logits, root, prefix, top_k, depth, total_tokens)


def draft_tree(
    runner: Eagle3Proposer, hidden: Tensor, logits: Tensor, root: int, prefix: int,
    top_k: int, depth: int, total_tokens: int,
) -> Tree:
    """EAGLE-2 dynamic tree after the pending token `root` (at position `prefix`).

    Depth 1: the top_k tokens of the root's draft distribution, scored by log-prob. Each
    further depth: the top_k nodes of the previous depth (by cumulative log-prob) run through
    the draft in one forward (each row sees the prefix and its own ancestors' rows), each
    offers its top_k children, scored parent score + log-prob. After `depth` levels the best
    `total_tokens` of all candidates are kept, ordered by (score desc, depth asc): a child's
    score never exceeds its parent's, so the kept set contains every kept node's ancestors.

    Compared with official EAGLE's `topK_genrate`: its `depth` counts the forwards after
    the root's, so its longest path is depth + 1 (`depth` here is the longest path); its
    `total_token` counts the root (`total_tokens` here does not: N = total_tokens + 1).
    """
    k = min(top_k, logits.shape[-1])
    # candidate pool; parent -1 = the root
    tok: list[int] = []
    parent_of: list[int] = []
    dep: list[int] = []
    score: list[float] = []
    anc: list[set[int]] = []  # ancestors-or-self among pool nodes
    row_of: dict[int, int] = {}  # pool node -> its draft-cache row (expanded nodes)
    hid_of: dict[int, Tensor] = {}  # expanded pool node -> its output hidden

    def add(parent: int, d: int, draft_ids: Tensor, scores: Tensor) -> list[int]:
        new = []
        for did, s in zip(draft_ids.tolist(), scores.tolist()):
            i = len(tok)
            tok.append(int(runner.draft_to_target[did]))
            parent_of.append(parent)
            dep.append(d)
            score.append(float(s))
            anc.append((anc[parent] if parent >= 0 else set()) | {i})
            new.append(i)
        return new

    logp = torch.log_softmax(logits, -1)
    top = logp.topk(k)
    frontier = add(-1, 1, top.indices, top.values)
    for d in range(2, depth + 1):
        rows_before = runner.length - prefix
        tree_rows = [n for n, _ in sorted(row_of.items(), key=lambda kv: kv[1])]
        mask = torch.zeros(len(frontier), prefix + rows_before + len(frontier), dtype=torch.bool)
        mask[:, :prefix] = True
        for r, node in enumerate(frontier):
            for c, other in enumerate(tree_rows):
                mask[r, prefix + c] = other in anc[node]
            mask[r, prefix + rows_before + r] = True
        h_in = torch.stack([hid_of[parent_of[n]] if parent_of[n] >= 0 else hidden for n in frontier])
        h_out, lg = runner.step(h_in, [tok[n] for n in frontier], [prefix + d - 1] * len(frontier), mask)
        for r, node in enumerate(frontier):
            row_of[node] = rows_before + r
            hid_of[node] = h_out[r]
        lp = torch.log_softmax(lg, -1).topk(k)  # [F, k]
        cum = torch.tensor([score[n] for n in frontier], device=lp.values.device)[:, None] + lp.values
        candidates: list[int] = []
        for r, node in enumerate(frontier):
            candidates += add(node, d, lp.indices[r], cum[r])
        best = torch.tensor([score[c] for c in candidates]).topk(min(k, len(candidates))).indices.tolist()
        frontier = [candidates[b] for b in best]
    runner.cache.crop(prefix)

    kept = sorted(range(len(tok)), key=lambda i: (-score[i], dep[i], i))[:total_tokens]
    kept.sort(key=lambda i: (dep[i], i))  # parents before children
    where = {node: j + 1 for j, node in enumerate(kept)}
    return Tree(
        tokens=[root] + [tok[i] for i in kept],
        parents=[-1] + [0 if parent_of[i] < 0 else where[parent_of[i]] for i in kept],
        depths=[0] + [dep[i] for i in kept],
        scores=[0.0] + [score[i] for i in kept],
    )
