"""EAGLE-3's tree replay of a batch of prompts in lockstep (`TreeBatch`, eaglet/draft/eagle3/replay.py
says what replay is): the draft's KV cache for a batch (`SlotKVCache`) and the trees' bookkeeping
in tensors, on the draft's device; no target forward."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..proposals import ReplaySide, cut_at_eos
from .model import Attend, Eagle3Draft


def too_short(seq: Sequence[int], prompt_len: int, max_new_tokens: int, depth: int) -> ValueError:
    return ValueError(f"continuation of {len(seq) - prompt_len} tokens is too short for "
                      f"{max_new_tokens} new tokens and depth {depth}")




class SlotKVCache:
    """The draft's KV cache for a batch of prompts: per layer [B, Hkv, capacity, D]. Prompt b's
    committed rows sit at slots 0..Q_b-1 (its positions, as its own cache would hold them) and
    its tree rows right after; a forward writes its rows at given slots and reads through a
    bool mask, so prompts of different lengths share one tensor (a slot past Q_b is stale or
    padding: masked, then overwritten). Zeros at the start: a masked key's value is multiplied
    by zero, which a NaN would survive."""

    def __init__(self, num_layers: int, batch: int, capacity: int):
        self.k: list[Tensor | None] = [None] * num_layers
        self.v: list[Tensor | None] = [None] * num_layers
        self.batch, self.capacity = batch, capacity

    def attend(self, slots_BT: Tensor, allowed_BTS: Tensor, members: slice = slice(None)) -> Attend:
        """The draft's attend for T new rows of the prompts `members`: write each row's keys and
        values at its slot, then attend over slots [0, S) where allowed_BTS is True."""
        S = allowed_BTS.shape[-1]

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if self.k[layer] is None:
                shape = (self.batch, k.shape[1], self.capacity, k.shape[3])
                self.k[layer], self.v[layer] = k.new_zeros(shape), v.new_zeros(shape)
            keys, values = self.k[layer][members], self.v[layer][members]  # views: written in place
            at = slots_BT[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            keys.scatter_(2, at, k)
            values.scatter_(2, at, v)
            return F.scaled_dot_product_attention(q, keys[:, :, :S], values[:, :, :S], attn_mask=allowed_BTS[:, None],
                                                  enable_gqa=q.shape[1] != k.shape[1])

        return attend

    def keep(self, index_B: Tensor) -> None:
        """Keep the prompts at these batch indices (the others have finished)."""
        self.k = [None if k is None else k.index_select(0, index_B) for k in self.k]
        self.v = [None if v is None else v.index_select(0, index_B) for v in self.v]
        self.batch = len(index_B)


class TreeBatch:
    """Tree replay of a batch of prompts in lockstep, on the draft's device: every cycle drafts
    all running prompts' trees together, follows them along the continuations, and commits
    each prompt's accepted rows; finished prompts drop out.

    A tree has a fixed shape per level (k = min(top_k, draft vocabulary)): depth 1 holds the
    root's top k; each further level expands the k best nodes of the level before (its
    frontier, in one forward of B x k rows), each offering its top k children. So the pool of
    candidates is a [B, N] tensor, N = k + (depth - 1) k^2, laid out as `draft_tree` numbers
    it: depth 1, then each level's children, frontier rank r's child c at r k + c. The pool
    index grows with depth, so draft_tree's kept order (score desc, depth asc, index asc) is
    a stable descending sort of the scores. Frontier node r of level d runs at position
    Q + d - 1 in tree row (d - 2) k + r, seeing the prefix, its ancestors' rows and its own."""

    def __init__(self, draft: Eagle3Draft, side: ReplaySide, members: Sequence[int], top_k: int, depth: int,
                 total_tokens: int):
        self.draft, self.depth, self.total_tokens = draft, depth, total_tokens
        dev, dtype = draft.fc.weight.device, draft.fc.weight.dtype
        vd = draft.config.draft_vocab_size
        self.draft_to_target = draft.draft_to_target(torch.arange(vd, device=draft.d2t.device)).to(dev)
        self.k = min(top_k, vd)
        self.prompts = [side.prompts[i] for i in members]
        self.seqs = [side.sequences[i] for i in members]
        B, L = len(members), max(len(s) for s in self.seqs)
        seq_BL = torch.zeros(B, L, dtype=torch.long)
        for b, s in enumerate(self.seqs):
            seq_BL[b, : len(s)] = torch.tensor(s)
        self.seq_BL = seq_BL.to(dev)
        # fc over every row's target states, once; a cycle gathers the rows it commits
        self.hidden_BLH = torch.zeros(B, L, draft.config.hidden_size, device=dev, dtype=dtype)
        for b, i in enumerate(members):
            self.hidden_BLH[b, : len(self.seqs[b])] = draft.project_aux(side.aux[i].to(dev, dtype)[None])[0]
        self.row = torch.arange(B, device=dev)  # each running prompt's row of seq_BL and hidden_BLH
        # committed rows stay below L - depth - 1, a cycle's tree rows within (depth - 1) k after them
        self.cache = SlotKVCache(len(draft.layers), B, L + (depth - 1) * self.k)

    def forward(self, hidden_BTH: Tensor, ids_BT: Tensor, slots_BT: Tensor, positions_BT: Tensor,
                allowed_BTS: Tensor, members: slice = slice(None)) -> tuple[Tensor, Tensor]:
        """One draft step over T rows per prompt: (hidden [B, T, H], logits [B, T, draft_vocab] fp32)."""
        h, logits = self.draft.step(hidden_BTH, ids_BT, positions_BT, self.cache.attend(slots_BT, allowed_BTS, members))
        return h, logits.float()

    def prefill(self) -> tuple[Tensor, Tensor]:
        """Commit each prompt's rows (one forward per prompt: a prompt's logits are [P, vocabulary]);
        the last rows' (hidden [B, H], logits [B, draft_vocab])."""
        hs, ls = [], []
        for b, p in enumerate(self.prompts):
            rows = torch.arange(len(p), device=self.seq_BL.device)
            h, lg = self.forward(self.hidden_BLH[b : b + 1, : len(p)], self.seq_BL[b : b + 1, 1 : len(p) + 1],
                                 rows[None], rows[None] + 1, (rows[None, :] <= rows[:, None])[None], slice(b, b + 1))
            hs.append(h[0, -1])
            ls.append(lg[0, -1])
        return torch.stack(hs), torch.stack(ls)

    def extend(self, Q_B: Tensor, Q_max: int, n_B: Tensor, count: int) -> tuple[Tensor, Tensor]:
        """Commit rows Q..Q+n-1 of each prompt (the target's states, tokens x[s+1] at positions s+1),
        padded to `count` = max(n) rows; each prompt's last row's (hidden [B, H], logits [B, draft_vocab])."""
        L = self.seq_BL.shape[1]
        rows = Q_B[:, None] + torch.arange(count, device=Q_B.device)  # [B, count]; past n: padding, never read
        hidden = self.hidden_BLH[self.row[:, None], rows.clamp(max=L - 1)]
        ids = self.seq_BL[self.row[:, None], (rows + 1).clamp(max=L - 1)]
        allowed = torch.arange(Q_max + count, device=Q_B.device)[None, None, :] <= rows[:, :, None]
        h, lg = self.forward(hidden, ids, rows, rows + 1, allowed)
        last = torch.arange(len(n_B), device=Q_B.device), n_B - 1
        return h[last], lg[last]

    def draft_trees(self, Q_B: Tensor, Q_max: int, hidden_BH: Tensor, logits_BV: Tensor
                    ) -> tuple[Tensor, Tensor, Tensor]:
        """Every prompt's candidate pool: (scores, target tokens, parent pool index or -1), [B, N] each."""
        B, k, dev = len(Q_B), self.k, Q_B.device
        R = (self.depth - 1) * k  # tree rows
        rank = torch.arange(k, device=dev)
        top = torch.log_softmax(logits_BV, -1).topk(k)
        scores, tokens = [top.values], [self.draft_to_target[top.indices]]
        parents = [torch.full((B, k), -1, device=dev)]
        front = rank.expand(B, k)  # the frontier's pool indices, best first
        front_score, front_token = top.values, tokens[0]
        front_hidden = hidden_BH[:, None].expand(B, k, hidden_BH.shape[-1])
        above = torch.zeros(B, k, R, dtype=torch.bool, device=dev)  # the tree rows of each frontier node's ancestors
        for d in range(2, self.depth + 1):
            first = (d - 2) * k  # this level's first tree row
            above[:, rank, first + rank] = True  # and its own row
            S = Q_max + first + k
            rel = torch.arange(S, device=dev)[None, :] - Q_B[:, None]  # a slot's tree row; < 0: committed
            in_tree = (rel >= 0) & (rel < first + k)
            tree = above.gather(2, rel.clamp(0, R - 1)[:, None, :].expand(B, k, S)) & in_tree[:, None]
            slots = Q_B[:, None] + first + rank
            h, lg = self.forward(front_hidden, front_token, slots, (Q_B[:, None] + d - 1).expand(B, k),
                                 (rel < 0)[:, None] | tree)
            top = torch.log_softmax(lg, -1).topk(k)  # [B, k, k]
            base = sum(s.shape[1] for s in scores)
            scores.append((front_score[:, :, None] + top.values).flatten(1))  # child c of rank r at r k + c
            tokens.append(self.draft_to_target[top.indices].flatten(1))
            parents.append(front.repeat_interleave(k, dim=1))
            if d < self.depth:
                best = scores[-1].topk(k).indices  # the next frontier, best first
                up = best // k  # their parents' frontier ranks
                front = base + best
                front_score, front_token = scores[-1].gather(1, best), tokens[-1].gather(1, best)
                front_hidden = h.gather(1, up[:, :, None].expand(-1, -1, h.shape[-1]))
                above = above.gather(1, up[:, :, None].expand(-1, -1, R))
        return torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1)

    def cycle(self, Q_B: Tensor, Q_max: int, hidden_BH: Tensor, logits_BV: Tensor) -> Tensor:
        """Draft every prompt's tree, keep its best total_tokens nodes and follow them along the
        continuation (`follow`'s rule): the number of draft tokens accepted per prompt [B]."""
        score, token, parent = self.draft_trees(Q_B, Q_max, hidden_BH, logits_BV)
        B, N = score.shape
        n = min(self.total_tokens, N)
        kept = score.sort(dim=-1, descending=True, stable=True).indices[:, :n].sort(dim=-1).values
        score, token, parent = score.gather(1, kept), token.gather(1, kept), parent.gather(1, kept)
        node_of = torch.zeros(B, N, dtype=torch.long, device=kept.device)  # pool index -> kept node 1..n (root 0)
        node_of.scatter_(1, kept, torch.arange(1, n + 1, device=kept.device).expand(B, n))
        parent = torch.where(parent < 0, 0, node_of.gather(1, parent.clamp(min=0)))  # every kept node's parent is kept
        want = self.seq_BL[self.row[:, None], Q_B[:, None] + torch.arange(1, self.depth + 1, device=Q_B.device)]
        at = torch.zeros_like(Q_B)  # the node reached (0: the root)
        alive = torch.ones_like(Q_B, dtype=torch.bool)
        accepted = torch.zeros_like(Q_B)
        for d in range(self.depth):
            kids = (parent == at[:, None]) & (token == want[:, d : d + 1])
            # the first child by score, then kept order (as Tree.children sorts); one unless d2t repeats a token
            best = torch.where(kids, score, -torch.inf).amax(-1, keepdim=True)
            pick = (kids & (score == best)).to(torch.uint8).argmax(-1) + 1
            alive &= kids.any(-1)
            at = torch.where(alive, pick, at)
            accepted += alive
        return accepted

    def run(self, max_new_tokens: int, stop: set[int]) -> list[tuple[list[int], list[int]]]:
        """Replay every prompt of the batch: (accepted per verification, new tokens) each."""
        B = len(self.prompts)
        P = torch.tensor([len(p) for p in self.prompts])
        L = torch.tensor([len(s) for s in self.seqs])
        first_eos = torch.tensor([next((i for i in range(len(p), len(s)) if s[i] in stop), len(s))
                                  for p, s in zip(self.prompts, self.seqs, strict=True)])
        accepted: list[list[int]] = [[] for _ in range(B)]
        tokens: list[list[int]] = [[] for _ in range(B)]
        live, Q = torch.arange(B), P.clone()  # running prompts (batch index), rows committed (host)
        hidden, logits = self.prefill()
        Q_dev = Q.to(self.seq_BL.device)
        while True:
            done = (Q - P[live] + 1 >= max_new_tokens) | (first_eos[live] <= Q)  # new tokens: seq[P..Q]
            if done.any():
                for j in done.nonzero()[:, 0].tolist():
                    b = int(live[j])
                    tokens[b] = cut_at_eos(self.seqs[b][int(P[b]) : int(Q[j]) + 1], max_new_tokens, stop)
                keep = (~done).nonzero()[:, 0]
                live, Q = live[keep], Q[keep]
                if not len(live):
                    break
                index = keep.to(self.seq_BL.device)
                hidden, logits, Q_dev, self.row = hidden[index], logits[index], Q_dev[index], self.row[index]
                self.cache.keep(index)
            short = (Q + self.depth + 1 >= L[live]).nonzero()
            if len(short):
                b = int(live[short[0, 0]])
                raise too_short(self.seqs[b], len(self.prompts[b]), max_new_tokens, self.depth)
            a_dev = self.cycle(Q_dev, int(Q.max()), hidden, logits)
            a = a_dev.cpu()  # the cycle's one copy to the host
            for b, x in zip(live.tolist(), a.tolist(), strict=True):
                accepted[b].append(x)
            hidden, logits = self.extend(Q_dev, int(Q.max()), a_dev + 1, int(a.max()) + 1)
            Q, Q_dev = Q + a + 1, Q_dev + a_dev + 1
        return list(zip(accepted, tokens, strict=True))
