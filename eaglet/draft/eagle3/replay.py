"""EAGLE-3's half of replay (eaglet/engines/hf/replay.py, the target's half): the draft's
agreement with a known continuation along a chain (`chain_hits`) and the EAGLE-2 tree replay
(`replay_tree`). It takes the target's side as tensors and token lists (`ReplaySide`).

Greedy, the tokens a chain cycle accepts are the target's own greedy tokens, so every input the
draft sees on an accepted path is known before any decoding: the target's states along its greedy
continuation, and that continuation's tokens. A cycle that starts at row Q-1 (Q tokens committed,
see eaglet/engines/hf/decode.py) drafts step j from row Q-1 at position Q+j, attending to the
committed rows (the target's states) and to its own earlier steps. That is exactly what row Q-1
of the draft's TTT unroll computes at step j (model.py: step j of row t runs at position t+1+j,
over step 0's keys up to t and its own row's earlier steps). So one k-step unroll over every row
gives, for every row, how many steps in a row agree with the continuation (`chain_hits`); the
engine's `walk_cycles` walks the cycles from the prompt's end.

A greedy tree cycle accepts the target's greedy tokens too, but which nodes the tree holds
depends on the draft's scores of its off-path nodes, so `replay_tree` runs the decoder's own
tree drafting (`draft_tree`'s rules, the draft's KV cache kept across cycles) and, where the
decoder would verify with the target, follows the tree along the known continuation instead: no
target forward. It runs a batch of prompts in lockstep (tree_batch.py `TreeBatch`): per cycle
one draft forward per tree level for all of them, the trees' bookkeeping in tensors, one copy to
the host. It costs more than the chain's one unroll per draft, but far less than decoding.
`reference_replay_tree` is the same replay prompt by prompt with `draft_tree` itself, the
reference tests hold the batched one to (fp32, CPU): their results agree, their floats not always
to the last bit (a GEMM can round a row differently for another number of rows: on a CPU, 1 or
2 rows against more), so only a near-tie that close parts them. In bf16 on a GPU, where logits
tie far more often and top-k's choice among equals can depend on the shape, they can part now
and then.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from ..agreement import chain_agreement
from ..proposals import ReplaySide, cut_at_eos, follow
from .model import Eagle3Draft
from .propose import Eagle3Proposer, draft_tree
from .tree_batch import TreeBatch, too_short


def chain_hits(draft: Eagle3Draft, side: ReplaySide, k: int, max_tokens: int = 8192,
               attn_impl: str = "auto") -> list[Tensor]:
    """Per sequence, [len, k]: the chance that step j of row t's draft token is accepted as the
    continuation's token t+2+j (eaglet/draft/agreement.py `chain_agreement`), from one k-step
    TTT unroll over every row (module header)."""
    def steps(aux: Tensor, ids: Tensor, pos: Tensor, doc: Tensor, k: int) -> Iterable[Tensor]:
        return draft.reference_ttt_steps(aux, ids, pos, doc, num_steps=k, attn_impl=attn_impl)

    return chain_agreement(draft, side, k, max_tokens, steps)


def tree_new_tokens(side: ReplaySide, depth: int, max_new_tokens: int | None) -> int:
    """max_new_tokens (default: the side's), checked against what the side's continuations hold."""
    max_new_tokens = side.max_new_tokens if max_new_tokens is None else max_new_tokens
    if max_new_tokens > side.max_new_tokens or max_new_tokens + depth > side.max_new_tokens + side.k:
        raise ValueError(f"the target side's continuations hold {side.max_new_tokens + side.k} tokens: too few for "
                         f"{max_new_tokens} new tokens and a tree of depth {depth}")
    return max_new_tokens


@torch.no_grad()
def replay_tree(draft: Eagle3Draft, side: ReplaySide, top_k: int = 10, depth: int = 6, total_tokens: int = 60,
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
    max_new_tokens = tree_new_tokens(side, depth, max_new_tokens)
    if min(batch, top_k, depth, total_tokens) < 1:
        raise ValueError(f"batch {batch}, top_k {top_k}, depth {depth}, total_tokens {total_tokens}: each must be >= 1")
    out: list[tuple[list[int], list[int]]] = []
    for a in range(0, len(side.prompts), batch):
        members = range(a, min(a + batch, len(side.prompts)))
        out += TreeBatch(draft, side, members, top_k, depth, total_tokens).run(max_new_tokens, set(eos))
    return out


@torch.no_grad()
def reference_replay_tree(draft: Eagle3Draft, side: ReplaySide, top_k: int = 10, depth: int = 6,
                          total_tokens: int = 60, max_new_tokens: int | None = None, eos: Sequence[int] = ()
                          ) -> list[tuple[list[int], list[int]]]:
    """`replay_tree` prompt by prompt with the decoder's own proposer (`Eagle3Proposer`, `draft_tree`):
    the reference that tests hold the batched replay to (one forward per tree level per prompt)."""
    max_new_tokens = tree_new_tokens(side, depth, max_new_tokens)
    runner, stop = Eagle3Proposer(draft), set(eos)
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
                raise too_short(seq, len(prompt), max_new_tokens, depth)
            tree = draft_tree(runner, hidden, logits, int(seq[Q]), Q, top_k, depth, total_tokens)
            path = follow(tree, lambda node, at=Q + 1: int(seq[at + tree.depths[node]]))  # the continuation's next
            new = [int(t) for t in seq[Q + 1 : Q + len(path) + 2]]  # the accepted tokens and the bonus
            accepted.append(len(path))
            tokens += new
            hidden, logits = runner.extend(aux[Q : Q + len(path) + 1], new, Q)
            Q += len(path) + 1
        out.append((accepted, cut_at_eos(tokens, max_new_tokens, stop)))
    return out
