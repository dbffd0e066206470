"""Building blocks every draft type shares: the target-derived sizes (MoE width, RoPE), the
rotary embedding as transformers computes it, Llama's RMSNorm and SwiGLU MLP.

A draft type's model file (eaglet/draft/<type>/model.py) builds its layers from these; change
them only for a behaviour every type must get (the golden run and each type's reference tests
hold them)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# Config attributes that mark a mixture-of-experts target / a multi-head latent attention
# (MLA: DeepSeek-V2/V3, Kimi-K2) target.
MOE_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_intermediate_size")
MLA_KEYS = ("kv_lora_rank", "q_lora_rank")


def acc(x: Tensor) -> Tensor:
    """x in its accumulation dtype: fp32, or fp64 when the inputs are (tests compare in fp64)."""
    return x if x.dtype == torch.float64 else x.float()


def is_moe_config(c: Any) -> bool:
    return any(getattr(c, k, None) for k in MOE_KEYS)


def draft_intermediate_size(c: Any) -> int:
    """The draft's MLP width for a target text config (rule in DraftConfig.from_target_config)."""
    if not is_moe_config(c):
        return int(c.intermediate_size)
    if getattr(c, "intermediate_size_mlp", None):
        return int(c.intermediate_size_mlp)
    if getattr(c, "moe_intermediate_size", None) and getattr(c, "intermediate_size", None):
        return int(c.intermediate_size)
    return -(-4 * int(c.hidden_size) // 256) * 256


def target_rope(c: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) from transformers 5 `rope_parameters` or 4.x fields."""
    params = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    # transformers 5 keeps one dict per layer type for some models; take the full-attention one.
    if params and all(isinstance(v, dict) for v in params.values()):
        params = dict(params.get("full_attention") or next(iter(params.values())))
    theta = float(params.pop("rope_theta", None) or getattr(c, "rope_theta", None) or 10000.0)
    params.pop("partial_rotary_factor", None)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    return theta, (None if kind == "default" else {"rope_type": kind, **params})


# ---- rotary embedding ---------------------------------------------------------------------


def rope_type(scaling: dict[str, Any] | None) -> str:
    kind = "default" if not scaling else (scaling.get("rope_type") or scaling.get("type") or "default")
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    return kind


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position_embeddings: int
) -> tuple[Tensor, float]:
    """(inv_freq [head_dim/2] fp32, attention scaling) as transformers computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq, 1.0
    assert scaling is not None
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn (the transformers formula, DeepSeek's mscale variant included)
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = scaling.get("attention_factor")
    if attn is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def corr_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, float(attn)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BHTD: Tensor, cos_BTD: Tensor, sin_BTD: Tensor) -> Tensor:
    return x_BHTD * cos_BTD[:, None] + rotate_half(x_BHTD) * sin_BTD[:, None]


# ---- building blocks ----------------------------------------------------------------------


class Rotary:
    """A draft's rotary embedding: inv_freq and the attention scaling as transformers computes
    them (`rope_inv_freq`), kept out of the module's buffers so that model.to(bfloat16) cannot
    round the frequencies, copied once to each device it is asked for."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position_embeddings: int):
        self.inv_freq, self.scale = rope_inv_freq(head_dim, theta, scaling, max_position_embeddings)
        self._on: dict[torch.device, Tensor] = {}

    def __call__(self, position_ids_BT: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, sin) [B, T, head_dim] computed in fp32 (as transformers does), then cast."""
        dev = position_ids_BT.device
        if dev not in self._on:
            self._on[dev] = self.inv_freq.to(dev)
        freqs = position_ids_BT[..., None].float() * self._on[dev]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def add_vocabulary_maps(module: nn.Module, vocab_size: int, draft_vocab_size: int) -> None:
    """The draft's vocabulary maps as buffers, identity until the caller loads the run's: d2t
    [draft_vocab] (target id = draft id + d2t[draft id]) and t2d [vocab] (bool: in the draft vocabulary)."""
    module.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[:draft_vocab_size] = True
    module.register_buffer("t2d", t2d)


@torch.no_grad()
def init_draft_weights(module: nn.Module, embed: nn.Embedding, std: float = 0.02) -> None:
    """transformers' Llama init: Normal(0, std) linears and embedding, zero biases, unit norms."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)
    nn.init.normal_(embed.weight, std=std)


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in fp32 (fp64 stays), cast back, then scale (HF's rounding)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = acc(x)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def target_sizes(hf_config: Any, draft_vocab_size: int) -> dict[str, Any]:
    """The draft sizes every type takes from the target's (text) config: its hidden size (the
    draft reuses the target's embedding), heads, KV heads and head_dim (an MLA target, whose
    latent heads no dense layer can copy, gets 128-wide GQA heads: hidden / 128 of them and 8 KV
    heads), a dense MLP's width (`draft_intermediate_size`), its vocabulary, RMSNorm epsilon and
    RoPE (`target_rope`). eaglet/draft/eagle3/model.py `DraftConfig.from_target_config` says why."""
    c = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    hidden = int(c.hidden_size)
    if any(getattr(c, k, None) is not None for k in MLA_KEYS):
        head_dim = 128 if hidden % 128 == 0 else hidden // int(c.num_attention_heads)
        heads = hidden // head_dim
        kv_heads = 8 if heads % 8 == 0 else heads
    else:
        heads = int(c.num_attention_heads)
        kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(c, "head_dim", None) or hidden // heads)
    theta, scaling = target_rope(c)
    return dict(hidden_size=hidden, target_hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                head_dim=head_dim, intermediate_size=draft_intermediate_size(c), vocab_size=int(c.vocab_size),
                draft_vocab_size=int(draft_vocab_size), rms_norm_eps=float(getattr(c, "rms_norm_eps", None) or 1e-6),
                rope_theta=theta, rope_scaling=scaling,
                max_position_embeddings=int(getattr(c, "max_position_embeddings", None) or 4096))
