"""Which keys each query of a DFlash forward sees: one mask definition, run densely or by flex.

A training (or replay) forward drafts M blocks of L rows at once. Its queries are the blocks'
rows, block j at rows j*L .. j*L+L-1; its keys are [the N context rows | the same M*L block rows].
Block j, anchored at packed row a_j, sees

    the context rows of its own document strictly before a_j   [start_j, a_j)
    its own block's rows                                        (causal: those up to its own)

and nothing else (no other block, no later context). `mask_rule` is that rule; the
dense path evaluates it per query chunk for a masked SDPA (any device, the reference on CPU),
and the flex path hands it to flex_attention as the mask_mod with a BlockMask drawn from the
same intervals (`BlockLayout.block_mask`). Documents are contiguous and anchors sorted (what
`loss.select_anchors` makes), so "same document, before the anchor" is the interval
[start_j, a_j), start_j the first row of a_j's document.

Change `mask_rule` (and `block_mask`'s intervals with it) to change what a block sees; the tests
hold both to a hand-built reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

SPARSE_BLOCK = 128  # flex_attention's block of queries and of keys (its default)
_compiled_flex: Callable[..., Any] | None = None


def flex(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask, scale: float) -> Tensor:
    """flex_attention, compiled for CUDA inputs (eager flex computes every score), every size
    symbolic (a packed micro-batch's length changes at every step); CPU inputs run eagerly."""
    global _compiled_flex
    kwargs = dict(block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if not q.is_cuda:
        return flex_attention(q, k, v, **kwargs)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex(q, k, v, **kwargs)


def mask_rule(anchors_M: Tensor, starts_M: Tensor, block_starts_M: Tensor, block_len: int, causal: bool
              ) -> Callable[[Tensor, Tensor], Tensor]:
    """allowed(q, kv): whether query row q sees key row kv (broadcasting index tensors), block j
    anchored at anchors_M[j], its document from starts_M[j], its rows at keys block_starts_M[j]..
    The one definition of the mask. It closes over tensors and the block length only, so that a
    compiled flex_attention sees each micro-batch's sizes as symbols, not as new constants."""

    def allowed(q: Tensor, kv: Tensor) -> Tensor:
        j = (q // block_len).clamp(max=anchors_M.shape[0] - 1)  # flex may ask about padding rows past Q
        context = (kv >= starts_M[j]) & (kv < anchors_M[j])
        own = kv - block_starts_M[j]
        block = (own >= 0) & (own < block_len)
        if causal:
            block = block & (own <= q - j * block_len)
        return context | block

    return allowed


class BlockLayout:
    """The rows of one forward: anchors_M (packed rows, ascending), starts_M (the first row of
    each anchor's document), N context rows, blocks of L rows, causal within a block or not."""

    def __init__(self, anchors_M: Tensor, starts_M: Tensor, num_context: int, block_len: int, causal: bool):
        self.anchors, self.starts = anchors_M, starts_M
        self.N, self.L, self.causal = num_context, block_len, causal
        self.M = anchors_M.numel()
        self.Q, self.KV = self.M * block_len, num_context + self.M * block_len
        block_starts = num_context + torch.arange(self.M, device=anchors_M.device) * block_len
        self.allowed = mask_rule(anchors_M, starts_M, block_starts, block_len, causal)
        self._block_mask: BlockMask | None = None

    def dense(self, first: int = 0, last: int | None = None) -> Tensor:
        """allowed() as a bool [rows, KV] for query rows first..last-1."""
        dev = self.anchors.device
        q = torch.arange(first, self.Q if last is None else last, device=dev)
        return self.allowed(q[:, None], torch.arange(self.KV, device=dev)[None, :])

    def block_mask(self) -> BlockMask:
        """The flex BlockMask of `allowed`, from each query tile's intervals: a key tile is listed
        when it meets the union of its queries' allowed intervals (partial: `allowed` decides
        inside it), and full when it lies inside their intersection (only in whole tiles)."""
        if self._block_mask is not None:
            return self._block_mask
        dev, n, L, N = self.anchors.device, SPARSE_BLOCK, self.L, self.N
        nq, nk = -(-self.Q // n), -(-self.KV // n)
        q_first = torch.arange(nq, device=dev) * n
        q_last = (q_first + n).clamp(max=self.Q) - 1
        j_first, j_last = q_first // L, q_last // L
        s = torch.arange(nk, device=dev) * n
        e = (s + n).clamp(max=self.KV)

        def meets(lo: Tensor, hi: Tensor) -> Tensor:  # key tile [s, e) meets [lo, hi) per query tile
            return (s[None] < hi[:, None]) & (e[None] > lo[:, None]) & (lo < hi)[:, None]

        def inside(lo: Tensor, hi: Tensor) -> Tensor:
            return (s[None] >= lo[:, None]) & (e[None] <= hi[:, None])

        a, st = self.anchors, self.starts
        listed = meets(st[j_first], a[j_last]) | meets(N + j_first * L, N + (j_last + 1) * L)
        full = inside(st[j_last], a[j_first])
        if not self.causal:
            full |= (j_first == j_last)[:, None] & inside(N + j_first * L, N + (j_first + 1) * L)
        full &= ((q_last - q_first + 1) == n)[:, None] & ((e - s) == n)[None]
        partial = listed & ~full

        def ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:  # count per query tile, indices (those first)
            tiles = tiles.to(torch.int32)[None, None]
            return (tiles.sum(-1, dtype=torch.int32),
                    torch.argsort(tiles, dim=-1, descending=True, stable=True).to(torch.int32))

        allowed = self.allowed

        def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
            return allowed(q, kv)

        self._block_mask = BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=n,
                                                    mask_mod=mask_mod, seq_lengths=(self.Q, self.KV))
        return self._block_mask


def block_attention(q_BHQD: Tensor, k_BKSD: Tensor, v_BKSD: Tensor, layout: BlockLayout, impl: str,
                    chunk: int = 1024) -> Tensor:
    """The blocks' attention over [context | blocks]: "flex" (flex_attention with the BlockMask)
    or "dense" (SDPA with `allowed` as a bool mask, `chunk` query rows at a time)."""
    scale = q_BHQD.shape[-1] ** -0.5
    if layout.Q == 0:
        return q_BHQD
    if impl == "flex":
        return flex(q_BHQD, k_BKSD, v_BKSD, layout.block_mask(), scale)
    if impl != "dense":
        raise ValueError(f"DFlash attention {impl!r}: expected flex or dense")
    gqa = q_BHQD.shape[1] != k_BKSD.shape[1]
    outs = []
    for first in range(0, layout.Q, chunk):
        last = min(first + chunk, layout.Q)
        mask = layout.dense(first, last)[None, None]
        outs.append(F.scaled_dot_product_attention(q_BHQD[:, :, first:last], k_BKSD, v_BKSD, attn_mask=mask,
                                                   scale=scale, enable_gqa=gqa))
    return torch.cat(outs, dim=2)


def resolve_impl(impl: str, device: torch.device) -> str:
    """"auto": flex on CUDA, dense elsewhere."""
    if impl == "auto":
        return "flex" if device.type == "cuda" else "dense"
    if impl not in ("flex", "dense"):
        raise ValueError(f"DFlash attention {impl!r}: expected auto, flex or dense")
    return impl

