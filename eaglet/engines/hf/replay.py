"""Acceptance by replay: speculative decoding's accepted counts (chains, trees; greedy, sampled), undecoded.

    side = target_side(target_model, aux_layers, prompts, max_new_tokens, k)   # once per prompt set
    runs = replay_chain(draft, side, k, max_new_tokens, eos)                   # once per draft
    runs = replay_tree(draft, side, top_k, depth, total_tokens, max_new_tokens, eos, batch)   # EAGLE-2 tree
    side = target_side(target_model, aux_layers, prompts, max_new_tokens, k, temperature=1.0)   # sampled

Greedy, the tokens a chain cycle accepts are the target's own greedy tokens, so every input the
draft sees on an accepted path is known before any decoding: the target's states along its greedy
continuation, and that continuation's tokens. A cycle that starts at row Q-1 (Q tokens committed,
see eaglet/engines/hf/decode.py) drafts step j from row Q-1 at position Q+j, attending to the
committed rows (the target's states) and to its own earlier steps. That is exactly what row Q-1
of the draft's TTT unroll computes at step j (eaglet/draft/eagle3/model.py: step j of row t runs at
position t+1+j, over step 0's keys up to t and its own row's earlier steps). So one target forward
over prompt + continuation and one k-step unroll over every row give, for every row, how many
steps in a row agree with the continuation; walking the cycles from the prompt's end then gives
the decoder's accepted count per verification (tests hold it to `speculative_generate`).

The target's side is the cost, and it is the same for every draft: it is computed once and
reused, so an A/B of many drafts on hundreds of prompts takes a target pass and a few batched
draft forwards per draft. What replay does not give: speed (nothing is decoded) and the lossless
check.

Sampling at temperature T: the output of speculative sampling is distributed as the target's
own sampling, whatever the draft, so a side can hold one continuation sampled from the target
(`target_side(..., temperature=T)`) and the draft's acceptances are then drawn given it. Given
that a position outputs y, a chain's draft token there was accepted with probability
min(p(y), q(y)) / p(y) (the draft proposes y with q(y) and keeps it with min(1, p/q)); a tree's
child is accepted exactly when y is its token. So a sampled chain replays with one draw per
step, and a sampled tree replays exactly, on the same continuation for every draft.

A greedy tree cycle accepts the target's greedy tokens too, but which nodes the tree holds
depends on the draft's scores of its off-path nodes, so `replay_tree` runs the decoder's own
tree drafting (`draft_tree`'s rules, the draft's KV cache kept across cycles) and, where the
decoder would verify with the target, follows the tree along the known continuation instead: no
target forward. It runs a batch of prompts in lockstep (`TreeBatch`): per cycle one draft
forward per tree level for all of them, the trees' bookkeeping in tensors, one copy to the host.
It costs more than the chain's one unroll per draft, but far less than decoding.
`reference_replay_tree` is the same replay prompt by prompt with `draft_tree` itself, the
reference tests hold the batched one to (fp32, CPU): their results agree, their floats not always
to the last bit (a GEMM can round a row differently for another number of rows: on a CPU, 1 or
2 rows against more), so only a near-tie that close parts them. In bf16 on a GPU, where logits
tie far more often and top-k's choice among equals can depend on the shape, they can part now
and then.
On a GPU the continuations are decoded in batches; their bf16 rounding can part from batch-1
decoding near ties, as any batch shape does (every draft is replayed against the same ones).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...draft.eagle3.model import Attend, Eagle3Draft
from .decode import (DraftRunner, TargetRunner, cache_kwarg, cut_at_eos, draft_tree, follow, forward_params,
                      new_cache, uniform)


@dataclass
class TargetSide:
    """The target's half of a replay, shared by every draft replayed on these prompts."""

    prompts: list[list[int]]
    sequences: list[list[int]]  # prompt + greedy continuation (max_new_tokens + k tokens, EOS not stopping it)
    aux: list[Tensor]  # per sequence [len, num_aux*H], the captured states, on the CPU
    max_new_tokens: int
    k: int
    temperature: float = 0.0  # > 0: the continuations were sampled at this temperature
    p_token: list[Tensor] | None = None  # sampled: per sequence [len] fp64, p_T(token i | tokens < i) (row 0: 1)


@torch.no_grad()
def continuations(model: nn.Module, prompts: Sequence[Sequence[int]], n: int, batch: int = 64,
                  temperature: float = 0.0, generator: torch.Generator | None = None,
                  progress: Callable[[int], None] | None = None) -> list[list[int]]:
    """The target's continuation of each prompt, greedy, `n` tokens, not stopped at EOS:
    `batch` prompts at a time, left-padded, one forward per token with a KV cache.
    temperature > 0: sampled from softmax(logits / temperature) instead (on the CPU, from `generator`).
    progress: called with the batch's prompt count after each forward (the calls sum to n per
    prompt; no device sync)."""
    kw = cache_kwarg(model)
    if "logits_to_keep" in forward_params(model):
        kw_extra = {"logits_to_keep": 1}  # the prefill's logits of every position would take B x width x V
    else:
        kw_extra = {}
    device = next(model.parameters()).device
    out: list[list[int]] = []
    for a in range(0, len(prompts), batch):
        group = [list(map(int, p)) for p in prompts[a : a + batch]]
        width = max(len(p) for p in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for i, p in enumerate(group):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(device), mask.to(device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache, new = new_cache(), []
        for _ in range(n):
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{kw: cache},
                           **kw_extra).logits
            if temperature > 0:
                probs = torch.softmax(logits[:, -1].double().cpu() / temperature, -1)
                nxt = torch.multinomial(probs, 1, generator=generator).to(device)
            else:
                nxt = logits[:, -1].float().argmax(-1, keepdim=True)
            new.append(nxt)
            if progress is not None:
                progress(len(group))
            ids, pos = nxt, pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=-1)
        toks = torch.cat(new, dim=-1).tolist()
        out.extend(p + t for p, t in zip(group, toks, strict=True))
    return out


@torch.no_grad()
def target_side(model: nn.Module, aux_layers: Sequence[int], prompts: Sequence[Sequence[int]], max_new_tokens: int,
                k: int, batch: int = 64, temperature: float = 0.0, seed: int = 0,
                progress: Callable[[int], None] | None = None) -> TargetSide:
    """Greedy continuations of `prompts` and the target's captured states along them;
    temperature > 0: continuations sampled at that temperature (seeded), with each token's
    probability under the target (`p_token`), which a sampled chain's replay needs.
    progress: `continuations`' (max_new_tokens + k tokens per prompt)."""
    gen = torch.Generator().manual_seed(seed) if temperature > 0 else None
    seqs = continuations(model, prompts, max_new_tokens + k, batch, temperature, gen, progress)
    return side_of(model, aux_layers, prompts, seqs, max_new_tokens, k, temperature)


@torch.no_grad()
def side_of(model: nn.Module, aux_layers: Sequence[int], prompts: Sequence[Sequence[int]],
            sequences: Sequence[Sequence[int]], max_new_tokens: int, k: int, temperature: float = 0.0) -> TargetSide:
    """The target's side along given sequences (prompt + continuation of max_new_tokens + k
    tokens): its captured states and, temperature > 0, each token's probability at that temperature."""
    sampled = temperature > 0
    seqs = [list(map(int, s)) for s in sequences]
    runner = TargetRunner(model, aux_layers)
    aux, p_token = [], []
    for s in seqs:
        logits, a = runner.forward(new_cache(), s, range(len(s)), last_only=not sampled)
        assert a is not None
        aux.append(a.cpu())
        if sampled:
            logp = torch.log_softmax(logits[:-1].double() / temperature, -1)
            picked = logp.gather(-1, torch.tensor(s[1:], device=logp.device)[:, None])[:, 0].exp().cpu()
            p_token.append(torch.cat([torch.ones(1, dtype=torch.float64), picked]))
    return TargetSide([list(map(int, p)) for p in prompts], seqs, aux, max_new_tokens, k, temperature,
                      p_token if sampled else None)


@torch.no_grad()
def agreement_runs(draft: Eagle3Draft, side: TargetSide, k: int, max_tokens: int = 8192,
                   attn_impl: str = "auto") -> list[Tensor]:
    """Per sequence, [len, k]: the chance that step j of row t's draft token is accepted as the
    continuation's token t+2+j, for the rows and steps where that token exists. Greedy: 1 when
    the step drafts that token (as a target id), else 0. Sampled at temperature T: given that the
    output token is y, speculative sampling accepted the draft's token with probability
    min(p(y), q(y)) / p(y) = min(1, q(y) / p(y)) (p, q: the target's and the draft's
    distributions at T; q(y) = 0 outside the draft vocabulary)."""
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
    while i < count:  # pack whole sequences into [1, N] documents, as training packs samples
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
        for j, logits in enumerate(draft.reference_ttt_steps(aux, ids, pos, doc, num_steps=k, attn_impl=attn_impl)):
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


def walk_cycles(hits_LK: Tensor, sequence: Sequence[int], prompt_len: int, max_new_tokens: int,
                eos: Sequence[int] = (), generator: torch.Generator | None = None) -> tuple[list[int], list[int]]:
    """(accepted per verification, new tokens) of chain decoding, from `agreement_runs`'
    rows: the cycles `speculative_generate` runs, each starting where the last one ended. A
    step accepted with a chance strictly between 0 and 1 (sampling) draws from `generator`."""
    k = hits_LK.shape[1]
    stop = set(eos)
    Q = prompt_len
    tokens = [int(sequence[Q])]
    accepted: list[int] = []
    new = tokens
    while len(tokens) < max_new_tokens and not any(t in stop for t in new):
        if Q + k >= len(sequence):
            raise ValueError(f"continuation of {len(sequence) - prompt_len} tokens is too short for "
                             f"{max_new_tokens} new tokens and k = {k}")
        row = hits_LK[Q - 1].tolist()
        a = 0
        while a < k and (row[a] >= 1 or (row[a] > 0 and uniform(generator) < row[a])):
            a += 1
        new = [int(t) for t in sequence[Q + 1 : Q + a + 2]]
        accepted.append(a)
        tokens += new
        Q += a + 1
    return accepted, cut_at_eos(tokens, max_new_tokens, stop)


def _tree_new_tokens(side: TargetSide, depth: int, max_new_tokens: int | None) -> int:
    """max_new_tokens (default: the side's), checked against what the side's continuations hold."""
    max_new_tokens = side.max_new_tokens if max_new_tokens is None else max_new_tokens
    if max_new_tokens > side.max_new_tokens or max_new_tokens + depth > side.max_new_tokens + side.k:
        raise ValueError(f"the target side's continuations hold {side.max_new_tokens + side.k} tokens: too few for "
                         f"{max_new_tokens} new tokens and a tree of depth {depth}")
    return max_new_tokens


def _too_short(seq: Sequence[int], prompt_len: int, max_new_tokens: int, depth: int) -> ValueError:
    return ValueError(f"continuation of {len(seq) - prompt_len} tokens is too short for "
                      f"{max_new_tokens} new tokens and depth {depth}")


@torch.no_grad()
def replay_tree(draft: Eagle3Draft, side: TargetSide, top_k: int = 10, depth: int = 6, total_tokens: int = 60,
                max_new_tokens: int | None = None, eos: Sequence[int] = (), batch: int = 64
                ) -> list[tuple[list[int], list[int]]]:
    """Per prompt of `side`, (accepted per verification, new tokens) of EAGLE-2 tree decoding
    with `draft` (speculative_generate's tree settings: top_k, depth, total_tokens). On a side
    sampled at temperature T this is decoding at T exactly: the tree is drafted without
    sampling, and verification accepts a child exactly when the token it outputs is that
    child's (a rejected child's token is removed from what is sampled next), so the output
    token decides the path.

    `batch` prompts at a time run in lockstep (`TreeBatch`): one draft forward per tree level
    for all of them, so memory grows with `batch`, not with the side. The results are
    `reference_replay_tree`'s, prompt by prompt."""
    max_new_tokens = _tree_new_tokens(side, depth, max_new_tokens)
    if min(batch, top_k, depth, total_tokens) < 1:
        raise ValueError(f"batch {batch}, top_k {top_k}, depth {depth}, total_tokens {total_tokens}: each must be >= 1")
    out: list[tuple[list[int], list[int]]] = []
    for a in range(0, len(side.prompts), batch):
        members = range(a, min(a + batch, len(side.prompts)))
        out += TreeBatch(draft, side, members, top_k, depth, total_tokens).run(max_new_tokens, set(eos))
    return out


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

    def __init__(self, draft: Eagle3Draft, side: TargetSide, members: Sequence[int], top_k: int, depth: int,
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
                raise _too_short(self.seqs[b], len(self.prompts[b]), max_new_tokens, self.depth)
            a_dev = self.cycle(Q_dev, int(Q.max()), hidden, logits)
            a = a_dev.cpu()  # the cycle's one copy to the host
            for b, x in zip(live.tolist(), a.tolist(), strict=True):
                accepted[b].append(x)
            hidden, logits = self.extend(Q_dev, int(Q.max()), a_dev + 1, int(a.max()) + 1)
            Q, Q_dev = Q + a + 1, Q_dev + a_dev + 1
        return list(zip(accepted, tokens, strict=True))


@torch.no_grad()
def reference_replay_tree(draft: Eagle3Draft, side: TargetSide, top_k: int = 10, depth: int = 6,
                          total_tokens: int = 60, max_new_tokens: int | None = None, eos: Sequence[int] = ()
                          ) -> list[tuple[list[int], list[int]]]:
    """`replay_tree` prompt by prompt with the decoder's own `draft_tree` and `DraftRunner`:
    the reference that tests hold the batched replay to (one forward per tree level per prompt)."""
    max_new_tokens = _tree_new_tokens(side, depth, max_new_tokens)
    runner, stop = DraftRunner(draft), set(eos)
    out = []
    for prompt, seq, aux in zip(side.prompts, side.sequences, side.aux, strict=True):
        runner.reset()
        Q = len(prompt)  # rows committed; the pending token seq[Q] sits at position Q
        tokens = [int(seq[Q])]
        hidden, logits = runner.extend(aux[:Q], [*prompt[1:], seq[Q]], 0)
        accepted: list[int] = []
        new = tokens
        while len(tokens) < max_new_tokens and not any(t in stop for t in new):
            if Q + depth + 1 >= len(seq):
                raise _too_short(seq, len(prompt), max_new_tokens, depth)
            tree = draft_tree(runner, hidden, logits, int(seq[Q]), Q, top_k, depth, total_tokens)
            path = follow(tree, lambda node, at=Q + 1: int(seq[at + tree.depths[node]]))  # the continuation's next
            new = [int(t) for t in seq[Q + 1 : Q + len(path) + 2]]  # the accepted tokens and the bonus
            accepted.append(len(path))
            tokens += new
            hidden, logits = runner.extend(aux[Q : Q + len(path) + 1], new, Q)
            Q += len(path) + 1
        out.append((accepted, cut_at_eos(tokens, max_new_tokens, stop)))
    return out


def replay_chain(draft: Eagle3Draft, side: TargetSide, k: int | None = None, max_new_tokens: int | None = None,
                 eos: Sequence[int] = (), max_tokens: int = 8192, attn_impl: str = "auto", seed: int = 0
                 ) -> list[tuple[list[int], list[int]]]:
    """Per prompt of `side`, (accepted per verification, new tokens) of chain decoding with
    `draft`, k draft tokens a cycle (at most the side's k and max_new_tokens): greedy, or on a
    sampled side at its temperature (one draw of the acceptances, from `seed`, for the sampled
    continuation the side holds)."""
    k = side.k if k is None else k
    max_new_tokens = side.max_new_tokens if max_new_tokens is None else max_new_tokens
    if k > side.k or max_new_tokens > side.max_new_tokens:
        raise ValueError(f"the target side was made for k <= {side.k} and {side.max_new_tokens} new tokens")
    hits = agreement_runs(draft, side, k, max_tokens, attn_impl)
    gen = torch.Generator().manual_seed(seed)
    return [walk_cycles(h, s, len(p), max_new_tokens, eos, gen) for h, s, p in zip(hits, side.sequences, side.prompts,
                                                                                    strict=True)]
