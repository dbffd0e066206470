"""The fast TTT unroll: the same logits as the model's reference unroll, with less work.

    unroll = use_fast_unroll(model, compile=True)     # model(...) now runs it; parallelize does this

`Eagle3Draft.reference_ttt_steps` (eaglet/draft/eagle3/model.py) runs every step over every row, each
with its own products. This unroll, installed on the model from outside as `model.unroll`,
computes the same logits (tests hold it to the reference) and skips what they do not need:

- Shared embedding products (`embeds_once`). Step j's tokens are step 0's shifted j rows on,
  so layer 0's q/k/v products of their embeddings are step 0's shifted too: made once
  (`embed_projection`, the first H input columns of the weights) and gathered per step. At
  k = 7 that removes 6 of 7 of those products, forward and backward.
- The rows each step needs. `head_rows`: per step, the LM head runs over the rows its loss can
  count only (`loss.head_rows`; the LM head is about a third of a step's products at the 8B
  dims). `active_rows`: from step 1 on a row's keys and values reach only its own query, so
  those steps run over the rows some later step counts (`loss.active_rows`) alone, gathered
  into one [1, n] sequence whose step-0 attention reads the full step-0 keys.
- Once-cast weights (`casts`): under autocast every step uses each linear weight cast once,
  and the weight-gradient GEMMs accumulate the steps' gradients (eaglet/draft/casts.py).
- Host time: each step's positions, RoPE tables and gather indices are made once per unroll
  (a few kernels, not a few per step: at the 8B dims a step is a couple of milliseconds of GPU
  work, so the host's time per step counts).
- Compiled pieces (`compile`): each layer's two halves around the attention call, layer 0's
  embedding products, the head and the diagonal merge, each function compiled on its own
  (eaglet/draft/compiling.py): once the sizes that follow the data are symbolic, a new
  packing compiles nothing (the attention call has its own compile,
  `attention.compile_flex_attention`).

Under FSDP2 (`sharded`) each decoder layer is an FSDP unit, sharded outside its own forward:
the unroll runs those layers through their forward (where FSDP2 gathers them), without cast
copies or shared embedding products, and `compile` compiles the layers' own halves instead.
lm_head, whole in the root unit's forward, is still cast once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import TTTAttend, merge_diagonal_stacked
from ..casts import Weights, cast_linears, linear, sharded
from ..compiling import compile_piece
from .mla import MLAAttention
from .model import MLP, DecoderLayer, Eagle3Draft, SelfAttention, shift_ids

Casts = Literal["accumulate", "sum", "per_product"]
CASTS = ("accumulate", "sum", "per_product")
Attention = SelfAttention | MLAAttention
# The products of a layer's INPUT_LINEARS (q, k, v; MLA's q_a and kv_a), one tensor each.
Products = tuple[Tensor, ...]


# ---- the pieces of a step, over given weights --------------------------------------------------
# `w`: the linear weights to use instead of the parameters (`cast_linears`: the unroll's
# once-cast copies), None: the parameters themselves.


def projections(attn: Attention, x_BTI: Tensor, w: Weights | None = None, cols: tuple[int, int] | None = None,
                bias: bool = True) -> Products:
    """The products [B,T,out] of the attention's INPUT_LINEARS (cols, bias: `casts.linear`'s)."""
    return tuple(linear(getattr(attn, name), name, x_BTI, w, cols, bias) for name in attn.INPUT_LINEARS)


def qkv(attn: Attention, x_BTI: Tensor, cos_BTD: Tensor, sin_BTD: Tensor, w: Weights | None = None,
        cols: tuple[int, int] | None = None, plus: Products | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """`attn.qkv` over `w`. cols, plus: x is the weights' input columns `cols`, and `plus` the
    products of the other columns, added (layer 0's embedding products)."""
    products = projections(attn, x_BTI, w, cols)
    if plus is not None:
        products = tuple(p + e for p, e in zip(products, plus, strict=True))
    project = None if w is None else partial(_project, attn, w)
    return attn.heads(*products, cos_BTD, sin_BTD, project)


def _project(attn: Attention, w: Weights, name: str, x: Tensor) -> Tensor:
    """The attention's linear `name` over `w` (MLA's q_b_proj and kv_b_proj)."""
    return linear(getattr(attn, name), name, x, w)


def attn_inputs(layer: DecoderLayer, h_BTH: Tensor, embeds_BTH: Tensor | Products, cos: Tensor, sin: Tensor,
                w: Weights | None = None, embed_rows: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`DecoderLayer.attn_inputs` over `w`. Layer 0 takes the token embeddings, or their half
    of the input linears' products (`embed_projection`) ready made; embed_rows: of those
    products, h's rows take these flat rows (shaped as h's rows)."""
    if layer.first:
        normed = layer.hidden_norm(h_BTH)
        residual = normed if layer.norm_before_residual else h_BTH
        if isinstance(embeds_BTH, tuple):
            H = normed.shape[-1]
            if embed_rows is not None:  # [B', T'] flat rows of the products, shaped as h's rows
                embeds_BTH = tuple(take_rows(p, embed_rows) for p in embeds_BTH)
            return *qkv(layer.self_attn, normed, cos, sin, w, cols=(H, 2 * H), plus=embeds_BTH), residual
        # Embedding first, hidden second: the order every EAGLE-3 loader expects.
        x = torch.cat([layer.input_layernorm(embeds_BTH), normed], dim=-1)
    else:
        residual, x = h_BTH, layer.input_layernorm(h_BTH)
    return *qkv(layer.self_attn, x, cos, sin, w), residual


def embed_projection(layer: DecoderLayer, embeds_BTH: Tensor, w: Weights | None = None) -> Products:
    """Layer 0's input-linear products of input_layernorm(embeddings) alone, without the
    biases: their half of the weights' input columns (the first H)."""
    assert layer.first, "only layer 0 reads the token embeddings"
    return projections(layer.self_attn, layer.input_layernorm(embeds_BTH), w, (0, embeds_BTH.shape[-1]), bias=False)


def mlp(m: MLP, x: Tensor, w: Weights | None = None) -> Tensor:
    gate, up = linear(m.gate_proj, "gate_proj", x, w), linear(m.up_proj, "up_proj", x, w)
    return linear(m.down_proj, "down_proj", F.silu(gate) * up, w)


def attn_output(layer: DecoderLayer, out_BHTD: Tensor, residual_BTH: Tensor, w: Weights | None = None) -> Tensor:
    """`DecoderLayer.attn_output` over `w`."""
    attn = layer.self_attn
    h = residual_BTH + linear(attn.o_proj, "o_proj", attn.merge_heads(out_BHTD), w)
    return h + mlp(layer.mlp, layer.post_attention_layernorm(h), w)


def head(model: Eagle3Draft, h_BTH: Tensor, w: Weights | None = None, rows: Tensor | None = None
         ) -> tuple[Tensor, Tensor]:
    """`Eagle3Draft.head` over `w`; rows: the logits of those rows (flat b*T + t) only,
    [1, len(rows), draft_vocab]."""
    normed = model.norm(h_BTH)
    x = normed if rows is None else take_rows(normed, rows[None])
    return (normed if model.config.norm_output else h_BTH), linear(model.lm_head, "lm_head", x, w)


def take_rows(x_BT: Tensor, rows: Tensor) -> Tensor:
    """The flat rows b*T + t of x [B, T, ...] that `rows` holds, shaped as rows: [*rows.shape, ...]."""
    return x_BT.flatten(0, 1).index_select(0, rows.flatten()).view(*rows.shape, *x_BT.shape[2:])


def unroll_linears(model: Eagle3Draft) -> list[nn.Module]:
    """The linears the unroll casts once (the layers', lm_head): those that can have an
    `UnrollCopy`. Not fc, which runs once per unroll on the captured states."""
    return [m for layer in model.layers for m in layer.modules() if isinstance(m, nn.Linear)] + [model.lm_head]


# The dims of each compiled piece's arguments that follow the data (B, the packed tokens or the
# rows a step runs over, the TTT steps stacked), marked symbolic before the first compile
# (compiling.compile_piece): a new packing then compiles nothing, and the model's sizes stay fixed.
_ROWS = {"h_BTH": (0, 1), "embeds_BTH": (0, 1), "cos": (0, 1), "sin": (0, 1), "embed_rows": (0, 1)}
DATA_DIMS: dict[Callable[..., Any], dict[str, tuple[int, ...]]] = {
    attn_inputs: _ROWS,
    attn_output: {"out_BHTD": (0, 2), "residual_BTH": (0, 1)},
    embed_projection: {"embeds_BTH": (0, 1)},
    head: {"h_BTH": (0, 1), "rows": (0,)},
    merge_diagonal_stacked: {"q_BHTD": (0, 2), "out0_BHTD": (0, 2), "lse0_BHT": (0, 2), "k_JBKTD": (0, 1, 3),
                             "v_JBKTD": (0, 1, 3), "rows": (0,)},
}
LAYER_DATA_DIMS = {"attn_inputs": {k: _ROWS[k] for k in ("h_BTH", "embeds_BTH", "cos", "sin")},
                   "attn_output": DATA_DIMS[attn_output]}  # DecoderLayer's own halves (FSDP2)


# ---- the unroll --------------------------------------------------------------------------------


class FastUnroll:
    """The fast TTT unroll of one draft, `model` (module doc). Called with
    `Eagle3Draft.reference_ttt_steps`' arguments, it yields the same logits.

    embeds_once: share layer 0's embedding products between the steps (False: each step makes
    its own). casts: under autocast, 'accumulate' casts each linear weight once and accumulates
    its gradient in the GEMMs, 'sum' casts once and lets autograd sum the steps' gradients,
    'per_product' leaves the casts to autocast in each product."""

    def __init__(self, model: Eagle3Draft, embeds_once: bool = True, casts: Casts = "accumulate",
                 compile: bool = False, sharded: bool = False, **compile_kwargs: Any):
        if casts not in CASTS:
            raise ValueError(f"casts {casts!r}: expected one of {CASTS}")
        self.model, self.embeds_once, self.casts = model, embeds_once, casts

        def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
            return compile_piece(fn, DATA_DIMS[fn], **compile_kwargs) if compile else fn

        # Each function compiled itself, then bound to its module (compiling.py says why)
        layers = list(model.layers)
        inputs, outputs = compiled(attn_inputs), compiled(attn_output)
        self.inputs = [partial(inputs, layer) for layer in layers]
        self.outputs = [partial(outputs, layer) for layer in layers]
        self.embed_projection = partial(compiled(embed_projection), layers[0])
        self.head = partial(compiled(head), model)
        # None: ttt_attention's reference merge of the diagonal keys; compiled: the stacked one
        self.merge: Callable[..., Tensor] | None = compiled(merge_diagonal_stacked) if compile else None
        if compile and sharded:  # FSDP2 runs these layers through their own forward: compile its halves
            for layer in layers:
                for half, dims in LAYER_DATA_DIMS.items():
                    setattr(layer, half, compile_piece(getattr(layer, half), dims, **compile_kwargs))

    def cast_weights(self, dtype: torch.dtype) -> tuple[list[Weights | None], Weights | None] | None:
        """The linear weights every step uses (per layer, lm_head's), cast to `dtype` once
        (eaglet/draft/casts.py); None with casts 'per_product'. A layer FSDP2 shards gets None:
        its products keep autocast's casts."""
        if self.casts == "per_product":
            return None
        accumulate, model = self.casts == "accumulate", self.model
        return ([cast_linears(layer.named_modules(), dtype, accumulate) for layer in model.layers],
                cast_linears([("lm_head", model.lm_head)], dtype, accumulate))

    def __call__(
        self,
        aux_BTA: Tensor,
        input_ids_BT: Tensor,
        position_ids_BT: Tensor | None = None,
        doc_ids_BT: Tensor | None = None,
        num_steps: int = 3,
        attn_impl: str = "auto",
        head_rows: Sequence[Tensor] | None = None,
        active_rows: Tensor | None = None,
    ) -> Iterator[Tensor]:
        """Yield the draft logits of steps 0..num_steps-1 (`Eagle3Draft.reference_ttt_steps`).
        head_rows: step j yields the logits of head_rows[j] only, [1, len, draft_vocab].
        active_rows: with head_rows, the rows steps 1.. run over (flat b*T + t, ascending;
        `loss.active_rows`, which holds head_rows[1:])."""
        model = self.model
        B, T = input_ids_BT.shape
        dev = input_ids_BT.device
        if position_ids_BT is None:
            position_ids_BT = torch.arange(T, device=dev).expand(B, T)
        if head_rows is None or num_steps < 2:
            active_rows = None
        attend = TTTAttend(len(model.layers), doc_ids_BT, T, dev, attn_impl, self.merge)
        hidden = model.project_aux(aux_BTA)
        lowp = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else None
        weights = self.cast_weights(lowp) if lowp is not None and num_steps > 1 else None
        # Not under FSDP2, whose layer 0 is sharded outside its own forward.
        layer_sharded = [sharded(layer.self_attn.o_proj.weight) for layer in model.layers]
        once = self.embeds_once and not layer_sharded[0]
        ids0 = shift_ids(input_ids_BT, 1)  # row t of step 0 reads token t + 1
        if once:
            embed_qkv = self.embed_projection(model.embed_tokens(ids0).to(hidden.dtype),
                                              None if weights is None else weights[0][0])
        # The steps from 1 on run over `seq` (flat rows b*T + t, shaped as their sequence):
        # every row, or the active rows as one [1, n] sequence. Row t of step j reads what row
        # min(t + j, T - 1) of step 0 read (token t + 1 + j; the pad token past the end): its
        # tokens, or their embedding products, are gathered from step 0's by `src[j - 1]`.
        # Step 0 gathers by the identity (`every`), so that layer 0's compiled inputs are one
        # graph whatever the step.
        every = torch.arange(B * T, device=dev).view(B, T)
        seq = every if active_rows is None else active_rows[None]
        t, ahead = seq % T, torch.arange(1, num_steps, device=dev)[:, None, None]  # j = 1..k-1
        src = seq - t + (t + ahead).clamp(max=T - 1)  # [k-1, *seq.shape]
        rope0 = model.rope(position_ids_BT + 1, hidden.dtype)
        later_rope = model.rope(take_rows(position_ids_BT, seq) + 1 + ahead, hidden.dtype)  # position + 1 + j
        if active_rows is not None:  # where head_rows[j] sit among the active rows
            assert head_rows is not None
            later_heads = torch.searchsorted(active_rows, torch.cat(list(head_rows[1:]))).split(
                [len(r) for r in head_rows[1:]])
        for j in range(num_steps):
            if j == 0:
                ids, plus, plus_rows, rope = (None, embed_qkv, every, rope0) if once else (ids0, None, None, rope0)
                rows = None if head_rows is None else head_rows[0]
            else:
                if j == 1 and active_rows is not None:  # the active rows only, as one [1, n] sequence
                    attend.rows, hidden = active_rows, take_rows(hidden, seq)
                ids = None if once else take_rows(ids0, src[j - 1])
                plus, plus_rows = (embed_qkv, src[j - 1]) if once else (None, None)
                rope = later_rope[0][j - 1], later_rope[1][j - 1]
                rows = None if head_rows is None else head_rows[j] if active_rows is None else later_heads[j - 1]
            embeds = plus if ids is None else model.embed_tokens(ids).to(hidden.dtype)
            cos, sin = rope
            h = hidden
            for i, layer in enumerate(model.layers):
                if layer_sharded[i]:  # FSDP2: through the layer's forward, where its shards are gathered
                    h = layer(h, embeds, cos, sin, partial(attend, i))
                else:
                    w = None if weights is None else weights[0][i]
                    q, k, v, residual = self.inputs[i](h, embeds, cos, sin, w, plus_rows)
                    h = self.outputs[i](attend(i, q, k, v), residual, w)
            hidden, logits = self.head(h, None if weights is None else weights[1], rows)
            yield logits


def use_fast_unroll(model: Eagle3Draft, **options: Any) -> FastUnroll:
    """Install a `FastUnroll(model, **options)` as `model.unroll`: the training call runs it."""
    model.unroll = FastUnroll(model, **options)
    return model.unroll
