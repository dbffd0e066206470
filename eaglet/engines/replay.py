"""Acceptance by replay: speculative decoding's accepted counts (chains, trees; greedy, sampled), undecoded.

    side = target_side(target_model, aux_layers, prompts, max_new_tokens, k)   # once per prompt set
    runs = replay_chain(draft, side, k, max_new_tokens, eos)                   # once per draft
    runs = replay_tree(draft, side, top_k, depth, total_tokens, max_new_tokens, eos)   # EAGLE-2 tree
    side = target_side(target_model, aux_layers, prompts, max_new_tokens, k, temperature=1.0)   # sampled

Greedy, the tokens a chain cycle accepts are the target's own greedy tokens, so every input the
draft sees on an accepted path is known before any decoding: the target's states along its greedy
continuation, and that continuation's tokens. A cycle that starts at row Q-1 (Q tokens committed,
see eaglet/engines/specdec.py) drafts step j from row Q-1 at position Q+j, attending to the
committed rows (the target's states) and to its own earlier steps. That is exactly what row Q-1
of the draft's TTT unroll computes at step j (eaglet/draft/model.py: step j of row t runs at
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
tree drafting (`draft_tree`, the draft's KV cache kept across cycles) and, where the decoder
would verify with the target, follows the tree along the known continuation instead: no target
forward, one draft forward per tree level. It costs more than the chain's one unroll per draft,
but far less than decoding.
On a GPU the continuations are decoded in batches; their bf16 rounding can part from batch-1
decoding near ties, as any batch shape does (every draft is replayed against the same ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..draft.model import Eagle3Draft
from .specdec import (DraftRunner, TargetRunner, cache_kwarg, cut_at_eos, draft_tree, follow, forward_params,
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
                  temperature: float = 0.0, generator: torch.Generator | None = None) -> list[list[int]]:
    """The target's continuation of each prompt, greedy, `n` tokens, not stopped at EOS:
    `batch` prompts at a time, left-padded, one forward per token with a KV cache.
    temperature > 0: sampled from softmax(logits / temperature) instead (on the CPU, from `generator`)."""
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
            ids, pos = nxt, pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=-1)
        toks = torch.cat(new, dim=-1).tolist()
        out.extend(p + t for p, t in zip(group, toks, strict=True))
    return out


@torch.no_grad()
def target_side(model: nn.Module, aux_layers: Sequence[int], prompts: Sequence[Sequence[int]], max_new_tokens: int,
                k: int, batch: int = 64, temperature: float = 0.0, seed: int = 0) -> TargetSide:
    """Greedy continuations of `prompts` and the target's captured states along them;
    temperature > 0: continuations sampled at that temperature (seeded), with each token's
    probability under the target (`p_token`), which a sampled chain's replay needs."""
    gen = torch.Generator().manual_seed(seed) if temperature > 0 else None
    seqs = continuations(model, prompts, max_new_tokens + k, batch, temperature, gen)
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


@torch.no_grad()
def replay_tree(draft: Eagle3Draft, side: TargetSide, top_k: int = 10, depth: int = 6, total_tokens: int = 60,
                max_new_tokens: int | None = None, eos: Sequence[int] = ()) -> list[tuple[list[int], list[int]]]:
    """Per prompt of `side`, (accepted per verification, new tokens) of EAGLE-2 tree decoding
    with `draft` (speculative_generate's tree settings: top_k, depth, total_tokens). On a side
    sampled at temperature T this is decoding at T exactly: the tree is drafted without
    sampling, and verification accepts a child exactly when the token it outputs is that
    child's (a rejected child's token is removed from what is sampled next), so the output
    token decides the path."""
    max_new_tokens = side.max_new_tokens if max_new_tokens is None else max_new_tokens
    if max_new_tokens > side.max_new_tokens or max_new_tokens + depth > side.max_new_tokens + side.k:
        raise ValueError(f"the target side's continuations hold {side.max_new_tokens + side.k} tokens: too few for "
                         f"{max_new_tokens} new tokens and a tree of depth {depth}")
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
                raise ValueError(f"continuation of {len(seq) - len(prompt)} tokens is too short for "
                                 f"{max_new_tokens} new tokens and depth {depth}")
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
