"""Attention for the draft: the training-time test's, and inference's over a KV cache.

TTT attention at step j: the query of row t sees the step-0 keys of rows <= t in its own
document (causal), and its own row's keys of steps 1..j (the "diagonal"); nothing else
(`ttt_dense_mask` draws the pattern). Three interchangeable implementations (`attn_impl`):

    "flex"    flex_attention over the step-0 keys with one T x T causal/document BlockMask
              (`ttt_block_mask`, made from each 128-token block's first and last document),
              merged with the diagonal terms through the log-sum-exp; the mask and kernel
              shapes are the same at every step. Compiled on GPU (`compile_flex_attention`,
              or at its first CUDA call); CPU flex_attention is eager and has no backward.
    "chunked" the same merge with the step-0 part computed in query chunks in plain PyTorch
              (recomputed in backward): any device, memory O(chunk x T).
    "naive"   an explicit dense [T, (j+1)T] mask and softmax: the reference for tests.

The diagonal keys fold in by `_merge_diagonal` (the reference) or `merge_diagonal_stacked`
(the keys stacked: one graph for every step, what the compiled unroll uses).

Inference (`cached_attention`, `KVCache`): new queries over everything cached, causal or
through an explicit mask (an EAGLE-2 draft tree's rows see the prefix and their ancestors).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint

from ..layers import acc

ATTN_IMPLS = ("auto", "flex", "chunked", "naive")


def resolve_attn_impl(attn_impl: str, device: torch.device) -> str:
    if attn_impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl {attn_impl!r}: expected one of {ATTN_IMPLS}")
    if attn_impl == "auto":
        return "flex" if device.type == "cuda" else "chunked"
    return attn_impl


# ---- TTT attention ------------------------------------------------------------------------

# The compiled flex_attention for CUDA inputs: `compile_flex_attention()` sets it, and the first
# CUDA call makes it when nothing has (eval, replay or decoding in a process that has not trained:
# eager flex_attention on a GPU computes the whole T x T score matrix, slowly and out of memory at
# a replay's batch). Its LSE API changed: older torch takes return_lse=True, newer return_aux.
_flex_compiled: Callable[..., Any] | None = None
_SPARSE_BLOCK = 128  # flex attention's block of queries and of keys (its default)
_FLEX_RETURNS_AUX = "return_aux" in inspect.signature(flex_attention).parameters
# Every size symbolic from the first compile. A packed micro-batch's length changes at every step,
# and the BlockMask carries it as plain ints (its seq_lengths) that fix the length dims even when
# they are marked dynamic; torch.compile's default compiles the first length, then all again at
# the second (a second compile in the training's second step: docs/performance.md has its
# cost). The kernel's head dim is specialised by the lowering all the same.
FLEX_OPTIONS: dict[str, Any] = {"dynamic": True}


def compile_flex_attention(**compile_kwargs: Any) -> None:
    """Use torch.compile(flex_attention) for CUDA inputs from now on (CPU inputs stay eager),
    with `FLEX_OPTIONS` under compile_kwargs."""
    global _flex_compiled
    _flex_compiled = torch.compile(flex_attention, **{**FLEX_OPTIONS, **compile_kwargs})


def _flex_attention(q: Tensor, *args: Any, **kwargs: Any) -> Any:
    if not q.is_cuda:
        return flex_attention(q, *args, **kwargs)
    if _flex_compiled is None:
        compile_flex_attention()
    assert _flex_compiled is not None
    return _flex_compiled(q, *args, **kwargs)


class TTTAttend:
    """The keys and values each layer's TTT steps have made so far, and a new step's attention
    over them (`ttt_attention`): an unroll's steps call it as attend(layer, q, k, v).

    rows: set from some step on, that step's queries and new keys are of these flat rows
    (b*T + t) only (the fast unroll's active rows); merge: `ttt_attention`'s."""

    def __init__(self, num_layers: int, doc_ids_BT: Tensor | None, T: int, device: torch.device,
                 attn_impl: str = "auto", merge: Callable[..., Tensor] | None = None):
        self.impl = resolve_attn_impl(attn_impl, device)
        self.doc_ids_BT, self.merge = doc_ids_BT, merge
        self.block_mask = ttt_block_mask(doc_ids_BT, T, device) if self.impl == "flex" else None
        self.rows: Tensor | None = None
        self.kv: list[list[tuple[Tensor, Tensor]]] = [[] for _ in range(num_layers)]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.kv[layer].append((k, v))
        ks, vs = [k for k, _ in self.kv[layer]], [v for _, v in self.kv[layer]]
        return ttt_attention(q, ks, vs, self.impl, doc_ids_BT=self.doc_ids_BT, block_mask=self.block_mask,
                             merge=self.merge, rows=self.rows)


def ttt_block_mask(doc_ids_BT: Tensor | None, T: int, device: torch.device,
                   block: int = _SPARSE_BLOCK) -> BlockMask:
    """BlockMask over the step-0 keys: causal, and within one document when doc_ids is given.

    doc_ids: each row's documents one contiguous span each, their ids ascending along the row
    (what the packer makes). The blocks come straight from each block's first and last
    document, a few small ops on [B, blocks, blocks]. `create_block_mask` gets the same
    BlockMask by evaluating the mask at every one of the T x T positions under vmap, whose host
    time, once per micro-batch, was milliseconds, at the 8B dims as long as a TTT step's GPU time.
    (A test checks the two agree on every layout it builds.)

    With ascending contiguous documents and key block j before query block i, some pair of the
    two blocks shares a document iff block j's last key and block i's first query do, and every
    pair does iff block j's first key and block i's last query do. A diagonal block is partial
    (causal), a block after the diagonal empty. A query block cut short by T (its padding is
    masked) is never full, as in `create_block_mask`."""
    if doc_ids_BT is None:
        doc_ids_BT = torch.zeros(1, T, dtype=torch.int64, device=device)

        def mask_mod(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            return q >= k
    else:

        def mask_mod(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
            return (q >= k) & (doc_ids_BT[b, q] == doc_ids_BT[b, k])

    n = -(-T // block)
    starts = torch.arange(n, device=device) * block
    first = doc_ids_BT[:, starts]  # [b, n]
    last = doc_ids_BT[:, (starts + block).clamp(max=T) - 1]
    ahead = torch.ones(n, n, dtype=torch.bool, device=device).tril(-1)  # key block j < query block i
    some = ahead & (last[:, None, :] == first[:, :, None]) | torch.eye(n, dtype=torch.bool, device=device)
    every = ahead & (first[:, None, :] == last[:, :, None])
    if T % block:
        every[:, -1] = False
    partial = (some & ~every)[:, None]  # [b, 1, n, n]
    full = every[:, None]

    def ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:  # count per query block, indices (those first)
        blocks = blocks.to(torch.int32)
        return blocks.sum(-1, dtype=torch.int32), torch.argsort(blocks, dim=-1, descending=True, stable=True).to(torch.int32)

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(T, T))


def ttt_dense_mask(doc_ids_BT: Tensor | None, B: int, T: int, num_steps: int, device: torch.device) -> Tensor:
    """The TTT pattern as an explicit bool mask [B, T, num_steps*T] (reference only)."""
    rows = torch.arange(T, device=device)
    step0 = (rows[:, None] >= rows[None, :]).expand(B, T, T)
    if doc_ids_BT is not None:
        step0 = step0 & (doc_ids_BT[:, :, None] == doc_ids_BT[:, None, :])
    diag = torch.eye(T, dtype=torch.bool, device=device).expand(B, T, T)
    return torch.cat([step0] + [diag] * (num_steps - 1), dim=-1)


def ttt_attention(
    q_BHTD: Tensor,
    ks: list[Tensor],
    vs: list[Tensor],
    impl: str,
    doc_ids_BT: Tensor | None = None,
    block_mask: BlockMask | None = None,
    chunk: int = 256,
    merge: Callable[..., Tensor] | None = None,
    rows: Tensor | None = None,
) -> Tensor:
    """Attention of step j = len(ks)-1: step-0 keys causally (per document) + own-row keys
    of steps 1..j. ks/vs: [B, Hkv, T, D] and [B, Hkv, T, Dv] per step (Dv: the values' width,
    D's unless the layer is MLA's). Returns [B, Hq, T, Dv].

    merge: None folds the diagonal keys in with `_merge_diagonal` (the reference); else a
    function with `merge_diagonal_stacked`'s signature (the compiled fast unroll's).
    rows: the queries and the diagonal keys (ks[1:], vs[1:]) are of these flat rows b*T + t
    only, as one sequence [1, H, n, D] (the TTT unroll's active rows); the step-0 keys are
    whole. The queries go to their rows of a zero [B, Hq, T, D] for the step-0 part, so that
    its kernel and mask are step 0's; the merge runs over the n rows. Returns [1, Hq, n, D]."""
    if rows is not None:
        B, _, T, _ = ks[0].shape
        if impl == "naive":  # the reference: every row, the other rows' queries and keys zero
            full = [_rows_to_full(x, rows, B, T) for x in (q_BHTD, *ks[1:], *vs[1:])]
            j = len(ks) - 1
            out = ttt_attention(full[0], [ks[0], *full[1:1 + j]], [vs[0], *full[1 + j:]], impl, doc_ids_BT)
            return _full_to_rows(out, rows)
        out0, lse0 = _step0_attention(_rows_to_full(q_BHTD, rows, B, T), ks[0], vs[0], impl, doc_ids_BT, block_mask,
                                      chunk)  # the merge takes the rows' results (inside its compiled graph)
    else:
        B, _, T, _ = q_BHTD.shape
        if impl == "naive":
            return _naive_ttt_attention(q_BHTD, ks, vs, ttt_dense_mask(doc_ids_BT, B, T, len(ks), q_BHTD.device),
                                        q_BHTD.shape[-1] ** -0.5)
        out0, lse0 = _step0_attention(q_BHTD, ks[0], vs[0], impl, doc_ids_BT, block_mask, chunk)
    if len(ks) == 1:
        return out0.to(q_BHTD.dtype)
    scale = q_BHTD.shape[-1] ** -0.5
    if merge is not None:
        return merge(q_BHTD, out0, lse0, torch.stack(ks[1:]), torch.stack(vs[1:]), scale, rows)
    return _merge_diagonal(q_BHTD, out0, lse0, ks[1:], vs[1:], scale, rows)


def _step0_attention(q_BHTD: Tensor, k_BKTD: Tensor, v_BKTD: Tensor, impl: str, doc_ids_BT: Tensor | None,
                     block_mask: BlockMask | None, chunk: int) -> tuple[Tensor, Tensor]:
    """(out, log-sum-exp) of the queries over the step-0 keys: causal, per document."""
    T, D = q_BHTD.shape[2:]
    if impl == "flex":
        if block_mask is None:
            block_mask = ttt_block_mask(doc_ids_BT, T, q_BHTD.device)
        return _flex_with_lse(q_BHTD, k_BKTD, v_BKTD, block_mask, D**-0.5)
    if impl == "chunked":
        return _chunked_causal_attention(q_BHTD, k_BKTD, v_BKTD, doc_ids_BT, D**-0.5, chunk)
    raise ValueError(f"attn_impl {impl!r}: expected one of {ATTN_IMPLS}")


def _rows_to_full(x_1HnD: Tensor, rows: Tensor, B: int, T: int) -> Tensor:
    """[1, H, n, D] of the flat rows `rows` -> [B, H, T, D], zero at the other rows."""
    _, H, _, D = x_1HnD.shape
    full = x_1HnD.new_zeros(H, B * T, D).index_copy(1, rows, x_1HnD[0])
    return full.view(H, B, T, D).transpose(0, 1)


def _full_to_rows(x_BHT: Tensor, rows: Tensor) -> Tensor:
    """[B, H, T, ...] -> its flat rows `rows`, [1, H, n, ...]."""
    return x_BHT.transpose(0, 1).flatten(1, 2).index_select(1, rows).unsqueeze(0)


def _naive_ttt_attention(q: Tensor, ks: list[Tensor], vs: list[Tensor], mask_BTS: Tensor, scale: float) -> Tensor:
    group = q.shape[1] // ks[0].shape[1]
    k = acc(torch.cat(ks, dim=2).repeat_interleave(group, dim=1))
    v = acc(torch.cat(vs, dim=2).repeat_interleave(group, dim=1))
    scores = (acc(q) @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask_BTS[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).to(q.dtype)


def _flex_with_lse(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask, scale: float) -> tuple[Tensor, Tensor]:
    gqa = q.shape[1] != k.shape[1]
    if _FLEX_RETURNS_AUX:
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = _flex_attention(
            q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True)
        )
        return out, aux.lse
    out, lse = _flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_lse=True)
    return out, lse


def _chunk_attention(
    q_BKGCD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, allowed_BCS: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    scores = torch.einsum("bkgcd,bksd->bkgcs", acc(q_BKGCD), acc(k_BKSD)) * scale
    scores = scores.masked_fill(~allowed_BCS[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bkgcs,bksd->bkgcd", torch.exp(scores - lse[..., None]), acc(v_BKSD))
    return out, lse


def _chunked_causal_attention(
    q_BHTD: Tensor, k_BKTD: Tensor, v_BKTD: Tensor, doc_ids_BT: Tensor | None, scale: float, chunk: int
) -> tuple[Tensor, Tensor]:
    """Causal (per-document) attention with its log-sum-exp, query chunk by query chunk.

    A chunk of rows [a, b) needs keys [0, b) only. With grad enabled each chunk is
    recomputed in backward, so at most one chunk's scores are alive at a time."""
    B, Hq, T, D = q_BHTD.shape
    Hk, Dv = k_BKTD.shape[1], v_BKTD.shape[-1]  # Dv: the values' width (MLA's differs from the keys')
    q = q_BHTD.reshape(B, Hk, Hq // Hk, T, D)
    rows = torch.arange(T, device=q.device)
    outs, lses = [], []
    for a in range(0, T, chunk):
        b = min(a + chunk, T)
        allowed = (rows[None, :b] <= rows[a:b, None])[None]
        if doc_ids_BT is not None:
            allowed = allowed & (doc_ids_BT[:, a:b, None] == doc_ids_BT[:, None, :b])
        args = (q[:, :, :, a:b], k_BKTD[:, :, :b], v_BKTD[:, :, :b], allowed, scale)
        if torch.is_grad_enabled() and (q.requires_grad or k_BKTD.requires_grad or v_BKTD.requires_grad):
            o, lse = checkpoint(_chunk_attention, *args, use_reentrant=False)
        else:
            o, lse = _chunk_attention(*args)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=3).reshape(B, Hq, T, Dv), torch.cat(lses, dim=3).reshape(B, Hq, T)


def _merge_diagonal(
    q_BHTD: Tensor, out0_BHTD: Tensor, lse0_BHT: Tensor, ks: list[Tensor], vs: list[Tensor], scale: float,
    rows: Tensor | None = None,
) -> Tensor:
    """Fold the own-row keys of steps 1..j into the step-0 result by log-sum-exp: each is
    one extra key per query, so its score is a per-row dot product, O(T*j*D).
    rows: q and the keys are of these flat rows only ([1, H, n, D]), the step-0 result of all."""
    if rows is not None:
        out0_BHTD, lse0_BHT = _full_to_rows(out0_BHTD, rows), _full_to_rows(lse0_BHT, rows)
    B, Hq, T, D = q_BHTD.shape
    Hk, Dv = ks[0].shape[1], out0_BHTD.shape[-1]
    G = Hq // Hk
    q = acc(q_BHTD).reshape(B, Hk, G, T, D)
    scores = [(q * acc(k)[:, :, None]).sum(-1) * scale for k in ks]  # [B, Hk, G, T] each
    all_scores = torch.stack([acc(lse0_BHT).reshape(B, Hk, G, T), *scores], dim=0)
    weights = torch.softmax(all_scores, dim=0)  # over {all step-0 keys, each diagonal key}
    out = weights[0, ..., None] * acc(out0_BHTD).reshape(B, Hk, G, T, Dv)
    for w, v in zip(weights[1:], vs, strict=True):
        out = out + w[..., None] * acc(v)[:, :, None]
    return out.reshape(B, Hq, T, Dv).to(q_BHTD.dtype)


def merge_diagonal_stacked(
    q_BHTD: Tensor, out0_BHTD: Tensor, lse0_BHT: Tensor, k_JBKTD: Tensor, v_JBKTD: Tensor, scale: float,
    rows: Tensor | None = None,
) -> Tensor:
    """`_merge_diagonal` with the j diagonal keys and values stacked on a leading dim: one
    graph for every step when compiled (j becomes a dynamic size), no per-key Python loop.
    The same values as `_merge_diagonal` up to the order of the final sum over keys."""
    if rows is not None:
        out0_BHTD, lse0_BHT = _full_to_rows(out0_BHTD, rows), _full_to_rows(lse0_BHT, rows)
    B, Hq, T, D = q_BHTD.shape
    Hk, Dv = k_JBKTD.shape[2], out0_BHTD.shape[-1]
    G = Hq // Hk
    q = acc(q_BHTD).reshape(B, Hk, G, T, D)
    scores = (q[None] * acc(k_JBKTD)[:, :, :, None]).sum(-1) * scale  # [J, B, Hk, G, T]
    all_scores = torch.cat([acc(lse0_BHT).reshape(1, B, Hk, G, T), scores], dim=0)
    weights = torch.softmax(all_scores, dim=0)
    out = weights[0, ..., None] * acc(out0_BHTD).reshape(B, Hk, G, T, Dv)
    out = out + (weights[1:, ..., None] * acc(v_JBKTD)[:, :, :, None]).sum(0)
    return out.reshape(B, Hq, T, Dv).to(q_BHTD.dtype)


# ---- inference: new queries over a KV cache -----------------------------------------------------

class KVCache:
    """Keys and values per layer, [B, Hkv, S, D], grown by concatenation; `crop` rolls back."""

    def __init__(self, num_layers: int):
        self.k: list[Tensor | None] = [None] * num_layers
        self.v: list[Tensor | None] = [None] * num_layers
        self.length = 0

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        old_k, old_v = self.k[layer], self.v[layer]
        if old_k is not None and old_v is not None:
            k, v = torch.cat([old_k[:, :, : self.length], k], dim=2), torch.cat([old_v[:, :, : self.length], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v

    def advance(self, n: int) -> None:
        self.length += n

    def crop(self, length: int) -> None:
        """Forget everything after the first `length` rows (rejected draft tokens)."""
        self.length = min(self.length, length)
        self.k = [None if k is None else k[:, :, :length] for k in self.k]
        self.v = [None if v is None else v[:, :, :length] for v in self.v]


def cached_attention(q_BHnD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, allowed_nS: Tensor | None = None) -> Tensor:
    """The n new queries are the last n of S rows; query i sees keys 0 .. S-n+i, or the
    keys that the bool mask `allowed_nS` [n, S] marks."""
    n, S = q_BHnD.shape[2], k_BKSD.shape[2]
    if allowed_nS is None:
        allowed = torch.arange(S, device=q_BHnD.device)[None, :] <= torch.arange(S - n, S, device=q_BHnD.device)[:, None]
    elif tuple(allowed_nS.shape) != (n, S):
        raise ValueError(f"attention mask of shape {tuple(allowed_nS.shape)}, expected {(n, S)}")
    else:
        allowed = allowed_nS.to(device=q_BHnD.device, dtype=torch.bool)
    return F.scaled_dot_product_attention(
        q_BHnD, k_BKSD, v_BKSD, attn_mask=allowed, enable_gqa=q_BHnD.shape[1] != k_BKSD.shape[1]
    )
