"""Acceptance by replay: speculative decoding's accepted counts (chains, trees; greedy, sampled), undecoded.

    side = target_side(target_model, aux_layers, prompts, max_new_tokens, k)   # once per prompt set
    runs = replay_chain(draft, side, k, max_new_tokens, eos)                   # once per draft
    runs = replay_tree(draft, side, top_k, depth, total_tokens, max_new_tokens, eos, batch)   # EAGLE-2 tree
    side = target_side(target_model, aux_layers, prompts, max_new_tokens, k, temperature=1.0)   # sampled

This file is the target's half (`TargetSide`, `continuations`, `walk_cycles`); the draft's half
belongs to its type: a type replays chains when its package gives `chain_hits(draft, side, k,
max_tokens, attn_impl)` and trees when it gives `replay_tree` (EAGLE-3 gives both:
eaglet/draft/eagle3/replay.py, which says why a replay gives decoding's counts). A type that
gives neither is measured by decoding (`replay_note`).

Greedy, the tokens a chain cycle accepts are the target's own greedy tokens, so every input the
draft sees on an accepted path is known before any decoding: the target's states along its greedy
continuation, and that continuation's tokens. So one target forward over prompt + continuation
and the draft's agreement with it along every row (`chain_hits`: per row, the steps that draft
the continuation's tokens) give, walking the cycles from the prompt's end (`walk_cycles`), the
decoder's accepted count per verification (tests hold it to `speculative_generate`).

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

On a GPU the continuations are decoded in batches; their bf16 rounding can part from batch-1
decoding near ties, as any batch shape does (every draft is replayed against the same ones).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...draft import draft_type_of
from ...draft.proposals import cut_at_eos
from .decode import TargetRunner, cache_kwarg, forward_params, new_cache, uniform


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


def _replay_entry(draft: nn.Module, entry: str) -> Callable[..., Any] | None:
    """The draft type's replay entry point `entry` (chain_hits, replay_tree), or None."""
    return getattr(draft_type_of(draft), entry, None)


def replay_note(draft: nn.Module, method: str) -> str | None:
    """None when the draft's type replays eval.method `method` (chain: its `chain_hits`; tree: its
    `replay_tree`); else the one-line note an evaluation records instead of replaying."""
    entry = "replay_tree" if method == "tree" else "chain_hits"
    if _replay_entry(draft, entry) is not None:
        return None
    return (f"replay skipped: the {draft_type_of(draft).TITLE} draft type offers no {method} replay "
            f"({entry}); measured by decoding")


def _entry(draft: nn.Module, entry: str) -> Callable[..., Any]:
    found = _replay_entry(draft, entry)
    if found is None:
        raise ValueError(f"the {draft_type_of(draft).TITLE} draft type offers no replay ({entry})")
    return found


def agreement_runs(draft: nn.Module, side: TargetSide, k: int, max_tokens: int = 8192,
                   attn_impl: str = "auto") -> list[Tensor]:
    """Per sequence, [len, k]: the chance that step j of row t's draft token is accepted as the
    continuation's token t+2+j (greedy: 1 or 0), as the draft's type computes it (its
    `chain_hits`, e.g. eaglet/draft/eagle3/replay.py)."""
    return _entry(draft, "chain_hits")(draft, side, k, max_tokens, attn_impl)


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


def replay_tree(draft: nn.Module, side: TargetSide, top_k: int = 10, depth: int = 6, total_tokens: int = 60,
                max_new_tokens: int | None = None, eos: Sequence[int] = (), batch: int = 64
                ) -> list[tuple[list[int], list[int]]]:
    """Per prompt of `side`, (accepted per verification, new tokens) of tree decoding with `draft`
    (speculative_generate's tree settings: top_k, depth, total_tokens), by its type's
    `replay_tree` (EAGLE-3's: eaglet/draft/eagle3/replay.py), `batch` prompts at a time."""
    return _entry(draft, "replay_tree")(draft, side, top_k, depth, total_tokens, max_new_tokens, eos, batch)


def replay_chain(draft: nn.Module, side: TargetSide, k: int | None = None, max_new_tokens: int | None = None,
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
