"""EAGLE-3's multi-head latent attention (MLA) layer: `train.draft_attention: mla`.

The attention DeepSeek-V2/V3 and Kimi-K2 use, as vLLM's Eagle3DeepseekV2ForCausalLM builds it
for a draft (and SGLang's loader of that name): the rest of the EAGLE-3 draft (fc, the norms,
the MLP, the head, the vocabulary maps) is the dense draft's, and so is the first layer's
input, input_layernorm(embedding) ++ hidden_norm(h), 2H wide.

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))      [heads x (nope + rope)]   (q_lora_rank > 0)
           = q_proj(x)                                                          (q_lora_rank 0)
    latent, k_pe = kv_a_proj_with_mqa(x)                [kv_lora_rank | rope]: what a server caches
    k_nope, v    = kv_b_proj(kv_a_layernorm(latent))    [heads x (nope + v)]
    k      = k_nope ++ k_pe (one rope key shared by every head),  q = q_nope ++ q_pe
    out    = o_proj(softmax(q k^T * scale) v)           [heads x v -> H]

RoPE turns the rope dims only, in interleaved pairs (dims 2i and 2i+1: vLLM's is_neox_style
False, transformers' rope_interleave), so the weights need no permutation on export. The
softmax scale is (nope + rope)^-1/2, times mscale^2 with YaRN (mscale = 0.1 * mscale_all_dim *
ln(factor) + 1), as DeepSeek's attention has it: the queries carry that factor here, so the
attention code (attention.py) keeps its own (D^-1/2). The keys and values it gets are per head
(the values `v_head_dim` wide); a server caches the latent and k_pe, kv_lora_rank + rope values
a token and layer, instead of 2 x heads x head_dim.

The weights are named as vLLM and SGLang name them (q_a_proj, kv_a_proj_with_mqa, ...), whose
loaders fuse q_a_proj and kv_a_proj_with_mqa into one fused_qkv_a_proj.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..layers import RMSNorm, rope_type

# A linear product by module name (`casts.linear` bound to an unroll's once-cast weights); None:
# the module itself.
Project = Callable[[str, Tensor], Tensor] | None


def mla_sizes(target_config: Any, heads: int, head_dim: int) -> dict[str, int]:
    """The MLA sizes of a draft for a target (text) config: the target's own when it is an MLA
    model (kv_lora_rank set: DeepSeek-V2/V3, Kimi-K2), with its heads; a target without the
    queries' LoRA (q_lora_rank None: DeepSeek-V2-Lite) gets q_lora_rank 3 x kv_lora_rank, as
    DeepSeek-V3 has, since the engines serve an EAGLE-3 MLA layer with it only (their loaders fuse
    q_a_proj with kv_a_proj_with_mqa). Otherwise the DeepSeek-V3 proportions scaled to the
    target's head_dim d: nope d, rope d/2, v d, kv_lora_rank 4d, q_lora_rank 12d, its heads."""
    if getattr(target_config, "kv_lora_rank", None):
        c = target_config
        q_lora_rank = int(getattr(c, "q_lora_rank", None) or 3 * int(c.kv_lora_rank))
        return dict(mla_heads=int(c.num_attention_heads), q_lora_rank=q_lora_rank,
                    kv_lora_rank=int(c.kv_lora_rank), qk_nope_head_dim=int(c.qk_nope_head_dim),
                    qk_rope_head_dim=int(c.qk_rope_head_dim), v_head_dim=int(c.v_head_dim))
    return dict(mla_heads=heads, q_lora_rank=12 * head_dim, kv_lora_rank=4 * head_dim, qk_nope_head_dim=head_dim,
                qk_rope_head_dim=max(2, head_dim // 2), v_head_dim=head_dim)


def softmax_factor(scaling: dict[str, Any] | None) -> float:
    """mscale^2, the factor DeepSeek's attention puts on its softmax scale under YaRN (1 otherwise)."""
    if rope_type(scaling) != "yarn":
        return 1.0
    assert scaling is not None
    factor, m_all = float(scaling.get("factor") or 1.0), float(scaling.get("mscale_all_dim") or 0.0)
    m = 1.0 if factor <= 1 else 0.1 * m_all * math.log(factor) + 1.0
    return m * m


def apply_rope_interleaved(x: Tensor, cos_BTD: Tensor, sin_BTD: Tensor) -> Tensor:
    """RoPE on interleaved pairs (x[2i], x[2i+1]) turned by frequency i. cos/sin: the rotary
    tables as `layers.Rotary` gives them ([B, T, d], the d/2 frequencies twice over); x
    [B, H, T, d]."""
    half = x.shape[-1] // 2
    cos, sin = cos_BTD[:, None, :, :half], sin_BTD[:, None, :, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)


class MLAAttention(nn.Module):
    """MLA's projections (module doc); which keys a query sees is the `attend` callable's, as for
    the dense layer's `SelfAttention`, whose interface this has: `qkv`, `heads`, `merge_heads`,
    `out` and INPUT_LINEARS (the linears that read the layer's input, in the order `heads` takes
    their products; the fast unroll shares layer 0's embedding half of them between steps)."""

    def __init__(self, cfg: Any, in_features: int):
        super().__init__()
        H = cfg.hidden_size
        self.num_heads = self.num_kv_heads = cfg.mla_heads  # keys and values per head, made from one latent
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.head_dim = self.nope + self.rope  # the queries' and keys' width
        qk = self.num_heads * self.head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(in_features, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, qk, bias=False)
        else:
            self.q_proj = nn.Linear(in_features, qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(in_features, cfg.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, H, bias=False)
        self.INPUT_LINEARS = ("q_a_proj" if cfg.q_lora_rank else "q_proj", "kv_a_proj_with_mqa")
        self.q_factor = softmax_factor(cfg.rope_scaling)

    def heads(self, q_BTO: Tensor, kv_BTO: Tensor, cos_BTD: Tensor, sin_BTD: Tensor, project: Project = None
              ) -> tuple[Tensor, Tensor, Tensor]:
        """The INPUT_LINEARS' products [B,T,out] as heads: queries [B,H,T,nope+rope] (their
        RoPE and the YaRN softmax factor applied), keys likewise, values [B,H,T,v]. project:
        the later products' linear (q_b_proj, kv_b_proj) by name; None: the modules."""
        lin = project or (lambda name, x: getattr(self, name)(x))
        B, T, _ = q_BTO.shape
        H, nope, rope = self.num_heads, self.nope, self.rope
        if self.INPUT_LINEARS[0] == "q_a_proj":
            q_BTO = lin("q_b_proj", self.q_a_layernorm(q_BTO))
        q = q_BTO.view(B, T, H, nope + rope).transpose(1, 2)
        q_nope, q_pe = q.split([nope, rope], dim=-1)
        q = torch.cat([q_nope, apply_rope_interleaved(q_pe, cos_BTD, sin_BTD)], dim=-1)
        if self.q_factor != 1.0:
            q = q * self.q_factor
        latent, k_pe = kv_BTO.split([self.kv_lora_rank, rope], dim=-1)
        kv = lin("kv_b_proj", self.kv_a_layernorm(latent)).view(B, T, H, nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([nope, self.v_dim], dim=-1)
        k_pe = apply_rope_interleaved(k_pe.view(B, 1, T, rope), cos_BTD, sin_BTD)
        k = torch.cat([k_nope, k_pe.expand(B, H, T, rope)], dim=-1)
        return q, k, v

    def qkv(self, x_BTI: Tensor, cos_BTD: Tensor, sin_BTD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.heads(*(getattr(self, name)(x_BTI) for name in self.INPUT_LINEARS), cos_BTD, sin_BTD)

    def merge_heads(self, out_BHTV: Tensor) -> Tensor:
        """[B,H,T,v] -> [B,T,H*v], o_proj's input."""
        B, _, T, _ = out_BHTV.shape
        return out_BHTV.transpose(1, 2).reshape(B, T, self.num_heads * self.v_dim)

    def out(self, out_BHTV: Tensor) -> Tensor:
        return self.o_proj(self.merge_heads(out_BHTV))
