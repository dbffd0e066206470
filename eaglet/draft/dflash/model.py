"""The DFlash draft model: one pure module that takes tensors and returns tensors.

DFlash (block diffusion) drafts a whole block in one forward. The block is the embeddings of
[anchor token, mask x (L-1)] at the anchor's position and the L-1 after it; every draft layer
attends, from the block's rows only, over keys and values [context | block], where the context
is the target's captured states of the rows before the anchor. Slot k of the block predicts
the token k places after the anchor. Architecture (Qwen3 layers; weights named as speculators
and vLLM 0.25.0's qwen3_dflash name them, so export is near an identity map):

    fc, hidden_norm   Linear(num_aux * H_target -> H, no bias) over the concatenated target
                      states, then RMSNorm: the context features
    layers.{i}        Qwen3 decoder layers (input_layernorm, q/k/v/o_proj with per-head
                      q_norm/k_norm, post_attention_layernorm, SwiGLU mlp). Each projects the
                      context by its own k_proj/v_proj (no input_layernorm on the context),
                      k_norm, RoPE at the context's positions; queries come from the block only
    norm, lm_head     RMSNorm(H), Linear(H -> draft_vocab)
    embed_tokens      the target's, frozen (the caller copies it in); d2t/t2d the vocabulary
                      maps, as in eaglet/draft/eagle3/model.py

The block is bidirectional unless `causal` (vLLM 0.25.0 serves it non-causal unless the draft
config says otherwise). `mask_token_id` is a row of the target's embedding table.
`block_logits` is the training (and replay) forward over many anchors of a packed micro-batch
(eaglet/draft/dflash/attention.py says what each block sees); `context_kv` and
`cached_block_logits` are the same layers over a cache of the context's keys and values
(eaglet/draft/dflash/propose.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..layers import MLP, RMSNorm, Rotary, add_vocabulary_maps, apply_rope, init_draft_weights, rope_type, target_sizes
from .attention import BlockLayout, block_attention, resolve_impl


@dataclass
class DFlashConfig:
    """Sizes and switches of the draft. `to_dict()` / `DFlashConfig(**d)` round-trip it."""

    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (embed_tokens rows, t2d length)
    draft_vocab_size: int
    mask_token_id: int  # the target id whose embedding fills the block's mask slots
    target_layers: list[int] = field(default_factory=list)  # HF hidden_states indices read (0 = embeddings)
    num_aux: int = 1  # target states concatenated into fc's input
    num_layers: int = 5
    block_size: int = 16
    causal: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.num_layers < 1 or self.num_aux < 1 or self.block_size < 2:
            raise ValueError("num_layers and num_aux must be >= 1, block_size >= 2")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} > vocab_size {self.vocab_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is not a row of the {self.vocab_size}-row embedding")
        rope_type(self.rope_scaling)  # validates

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_target_config(cls, hf_config: Any, draft_vocab_size: int, **fields: Any) -> DFlashConfig:
        """Sizes from the target's (text) config, as EAGLE-3's DraftConfig takes them (the
        target's heads, KV heads, head_dim and RoPE; an MLA target gets 128-wide GQA heads; an
        MoE target a dense MLP, `draft_intermediate_size`); `fields` give the rest."""
        sizes = target_sizes(hf_config, draft_vocab_size)
        return cls(**{**sizes, **fields})


class Attention(nn.Module):
    """Qwen3's attention projections; which keys a query sees is the caller's `attend`."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        hd, H = cfg.head_dim, cfg.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(H, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(H, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(H, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def queries(self, x_BTH: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """[B, Hq, T, D]: q_proj, q_norm per head, RoPE."""
        B, T, _ = x_BTH.shape
        q = self.q_norm(self.q_proj(x_BTH).view(B, T, self.num_heads, self.head_dim)).transpose(1, 2)
        return apply_rope(q, cos, sin)

    def keys_values(self, x_BTH: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """([B, Hkv, T, D] x 2): k_proj, k_norm per head, RoPE; v_proj."""
        B, T, _ = x_BTH.shape
        k = self.k_norm(self.k_proj(x_BTH).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x_BTH).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def out(self, out_BHTD: Tensor) -> Tensor:
        B, _, T, _ = out_BHTD.shape
        return self.o_proj(out_BHTD.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


# attend(q_BHQD, k_BKSD, v_BKSD) -> out_BHQD over the keys [context | block]
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h_BQH: Tensor, context_kv: tuple[Tensor, Tensor], cos: Tensor, sin: Tensor, attend: Attend
                ) -> Tensor:
        """The block's rows h through one layer; context_kv: this layer's context keys/values."""
        x = self.input_layernorm(h_BQH)
        q = self.self_attn.queries(x, cos, sin)
        k, v = self.self_attn.keys_values(x, cos, sin)
        out = attend(q, torch.cat([context_kv[0], k], dim=2), torch.cat([context_kv[1], v], dim=2))
        h = h_BQH + self.self_attn.out(out)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(nn.Module):
    ALGORITHM = "dflash"  # its package in eaglet/draft/__init__.py DRAFT_TYPES

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # copied from the target, frozen
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        add_vocabulary_maps(self, cfg.vocab_size, cfg.draft_vocab_size)  # identity until the caller loads the run's
        self.rope = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, std) linears and embedding, unit norms (transformers' init)."""
        init_draft_weights(self, self.embed_tokens, std)

    # ---- pieces ---------------------------------------------------------------------------

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def context_kv(self, aux_BTA: Tensor, positions_BT: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Every layer's context keys and values [B, Hkv, T, D] of the target states aux_BTA at
        their positions: hidden_norm(fc(aux)), then the layer's k_proj/k_norm/RoPE and v_proj."""
        context = self.hidden_norm(self.fc(aux_BTA))
        cos, sin = self.rope(positions_BT, context.dtype)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]

    def blocks(self, block_ids_BQ: Tensor, positions_BQ: Tensor, context_kv: list[tuple[Tensor, Tensor]],
               attend: Attend) -> Tensor:
        """The block rows' last hidden states [B, Q, H] (before `norm`)."""
        dtype = context_kv[0][0].dtype
        h = self.embed_tokens(block_ids_BQ).to(dtype)
        cos, sin = self.rope(positions_BQ, dtype)
        for layer, kv in zip(self.layers, context_kv, strict=True):
            h = layer(h, kv, cos, sin, attend)
        return h

    # ---- training and replay: many blocks of a packed sequence ----------------------------

    def block_logits(self, aux_BTA: Tensor, input_ids_BT: Tensor, position_ids_BT: Tensor, anchors_M: Tensor,
                     starts_M: Tensor, block_len: int | None = None, attn_impl: str = "auto") -> Tensor:
        """Logits [M, L-1, draft_vocab] of slots 1..L-1 of the blocks anchored at packed rows
        anchors_M (ascending; B = 1), each seeing the context rows [starts_M[j], anchors_M[j]).
        Block j: [input_ids[a_j], mask x (L-1)] at positions position_ids[a_j] + 0..L-1.
        block_len: L (default the config's block_size)."""
        L = self.config.block_size if block_len is None else block_len
        M = anchors_M.numel()
        ids = torch.full((M, L), self.config.mask_token_id, dtype=input_ids_BT.dtype, device=input_ids_BT.device)
        ids[:, 0] = input_ids_BT[0, anchors_M]
        positions = position_ids_BT[0, anchors_M][:, None] + torch.arange(L, device=anchors_M.device)
        layout = BlockLayout(anchors_M, starts_M, aux_BTA.shape[1], L, self.config.causal)
        attend = partial(block_attention, layout=layout, impl=resolve_impl(attn_impl, aux_BTA.device))
        h = self.blocks(ids.view(1, M * L), positions.view(1, M * L), self.context_kv(aux_BTA, position_ids_BT),
                        attend)
        return self.lm_head(self.norm(h.view(M, L, h.shape[-1])[:, 1:]))

    forward = block_logits  # module(...) is the training call (DDP's and FSDP2's hooks run on forward)

    # ---- inference: one block over a cache of the context's keys and values ---------------

    def cached_block_logits(self, root: int, position: int, k: int, context_kv: list[tuple[Tensor, Tensor]]
                            ) -> Tensor:
        """Logits [k, draft_vocab] of slots 1..k of the block [root, mask x k] at positions
        position..position+k, over the cached context keys/values (all of them)."""
        dev = self.fc.weight.device
        ids = torch.full((1, k + 1), self.config.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0] = root
        positions = torch.arange(position, position + k + 1, device=dev)[None]
        S = context_kv[0][0].shape[2]
        mask = None
        if self.config.causal:
            mask = torch.ones(k + 1, S + k + 1, dtype=torch.bool, device=dev)
            mask[:, S:] = torch.ones(k + 1, k + 1, dtype=torch.bool, device=dev).tril()

        def attend(q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=q.shape[-1] ** -0.5,
                                                  enable_gqa=q.shape[1] != keys.shape[1])

        h = self.blocks(ids, positions, context_kv, attend)
        return self.lm_head(self.norm(h[0, 1:]))
