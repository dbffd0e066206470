"""The EAGLE-3 draft model: one pure module that takes tensors and returns tensors.

Train, eval and export all use this file. It loads no files, knows nothing of the target
model object or of distributed training; the caller copies the target's token embedding
into `embed_tokens` and the vocabulary maps into `d2t`/`t2d`.

Architecture (Llama-style, weights named as the speculators/vLLM format names them, so
export is close to an identity map):

    fc            Linear(num_aux * H_target -> H)       over concat(low, mid, high) states
    fc_norm.{i}   RMSNorm(H_target) per captured state  (EAGLE-3.1, optional)
    layers.0      hidden_norm(h) ++ input_layernorm(embed(token)) -> 2H wide q/k/v,
                  residual = h; post_attention_layernorm + SwiGLU mlp
    layers.{i>0}  plain Llama decoder layers (H-wide attention input), as speculators
                  and vLLM build them
    norm, lm_head RMSNorm(H), Linear(H -> draft_vocab)

Training-time test (TTT) unrolls `num_steps` steps over a whole sequence at once. Row t of
step j takes the token x[t+1+j] (the input shifted by one more each step), the hidden
state of step j-1 (step 0: fc of the target's states at row t), and the position
position[t] + 1 + j, i.e. the position of its input token. Its query sees the step-0 keys
of rows <= t in the same document, and its own row's keys of steps 1..j (the "diagonal");
nothing else (eaglet/draft/eagle3/attention.py). This is exactly what a KV-cached chain of drafts
sees at inference time. `reference_ttt_steps` is that unroll written out plainly: the
reference that tests hold the fast unroll to. Training installs the fast one from outside
(eaglet/draft/eagle3/unroll.py: shared embedding products, the rows each step needs, once-cast
weights, compiled pieces) as `unroll`, and the training call (`forward`) runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from .attention import KVCache, TTTAttend, cached_attention
from .mla import MLAAttention, mla_sizes
from ..layers import (MLP, RMSNorm, Rotary, add_vocabulary_maps, apply_rope, init_draft_weights, rope_type,
                     target_sizes)


ATTENTIONS = ("dense", "mla")
MLA_FIELDS = ("mla_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


# ---- config -------------------------------------------------------------------------------


@dataclass
class DraftConfig:
    """Sizes and switches of the draft. `to_dict()` / `DraftConfig(**d)` round-trip it."""

    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (embed_tokens rows, t2d length)
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None: plain RoPE; else {"rope_type": ..., ...}
    max_position_embeddings: int = 4096
    num_layers: int = 1
    num_aux: int = 3  # captured target states concatenated into fc's input
    fc_norm: bool = False  # EAGLE-3.1: RMSNorm each captured state before fc
    norm_output: bool = False  # EAGLE-3.1: feed the post-norm state to the next step
    norm_before_residual: bool = False  # speculators/vLLM option: residual = hidden_norm(h)
    attention_bias: bool = False
    # The decoder layers' attention: "dense" (Llama's, the fields above) or "mla" (multi-head
    # latent attention, mla.py, sized by the fields below; head_dim and the KV heads unused).
    attention: str = "dense"
    mla_heads: int = 0
    q_lora_rank: int = 0  # 0: a plain q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.num_layers < 1 or self.num_aux < 1:
            raise ValueError("num_layers and num_aux must be >= 1")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} > vocab_size {self.vocab_size}")
        rope_type(self.rope_scaling)  # validates
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention {self.attention!r}: expected one of {ATTENTIONS}")
        if self.attention == "mla":
            sizes = {k: getattr(self, k) for k in MLA_FIELDS}
            if min(sizes["mla_heads"], sizes["kv_lora_rank"], sizes["qk_nope_head_dim"], sizes["v_head_dim"]) < 1 \
                    or sizes["q_lora_rank"] < 0 or sizes["qk_rope_head_dim"] < 2 or sizes["qk_rope_head_dim"] % 2:
                raise ValueError(f"MLA sizes {sizes}: heads, kv_lora_rank, qk_nope_head_dim and v_head_dim must be "
                                 ">= 1, qk_rope_head_dim even and >= 2, q_lora_rank >= 0")

    @property
    def rope_dim(self) -> int:
        """The width RoPE turns: a dense head's, MLA's rope dims."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    def to_dict(self) -> dict[str, Any]:
        """The fields; a dense draft's without the MLA ones, so that it reads as the configs
        written before MLA drafts (a checkpoint's fingerprint among them)."""
        d = asdict(self)
        if self.attention == "dense":
            for k in ("attention", *MLA_FIELDS):
                del d[k]
        return d

    @classmethod
    def from_target_config(cls, hf_config: Any, draft_vocab_size: int, **overrides: Any) -> DraftConfig:
        """Sizes from the target's (text) config; `overrides` replace any field.

        - hidden_size = target_hidden_size = the target's hidden size (the draft reuses the
          target's token embedding, so the widths must agree).
        - Attention: the target's heads, KV heads and head_dim (config.head_dim when set,
          else hidden / heads). MLA targets (DeepSeek-V2/V3, Kimi-K2: the config has
          kv_lora_rank) have latent q/k heads that a Llama layer cannot copy; their draft
          uses standard GQA with head_dim 128, hidden / 128 heads and 8 KV heads (as in
          SpecForge's DeepSeek-V3 draft: 56 x 128 with 8 KV heads for hidden 7168). 128 and
          not hidden / target_heads (= 56 for DeepSeek-V3) because attention kernels (flash,
          flex, vLLM's backends) want power-of-two-friendly head sizes.
        - intermediate_size: a dense target's own. The draft is always dense, so for an MoE
          target (config has n_routed_experts / num_experts / num_local_experts /
          moe_intermediate_size) the rule is, in order:
            1. `intermediate_size_mlp` when present (Llama 4's dense-layer width);
            2. `intermediate_size` when the config also has a separate per-expert
               `moe_intermediate_size` (DeepSeek-V2/V3, Kimi-K2, Qwen2/3-MoE: there
               intermediate_size is the dense/first-layers width, e.g. 18432 for V3);
            3. otherwise (Mixtral, GPT-OSS: intermediate_size is one expert's width, as
               small as hidden for GPT-OSS) 4 x hidden, rounded up to a multiple of 256.
        - RoPE: the target's theta and scaling (default, linear, llama3 and yarn are
          supported; override rope_scaling=None for others).
        - attention_bias stays False: the draft is a fresh Llama layer whatever the target's
          biases are (vLLM's Eagle3 Llama layer reads attention_bias from the draft config).
        - attention "mla": the MLA sizes are the target's own for an MLA target, else DeepSeek-V3's
          proportions at the target's head_dim (`mla.mla_sizes`); an override of None keeps the
          default.
        """
        fields = target_sizes(hf_config, draft_vocab_size)
        unknown = set(overrides) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise TypeError(f"unknown DraftConfig fields: {sorted(unknown)}")
        if overrides.get("attention") == "mla":
            c = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
            heads = int(c.num_attention_heads)
            fields.update(mla_sizes(c, heads, int(getattr(c, "head_dim", None) or int(c.hidden_size) // heads)))
        fields.update({k: v for k, v in overrides.items() if v is not None or k not in MLA_FIELDS})
        return cls(**fields)


class SelfAttention(nn.Module):
    """Projections only; which keys a query sees is decided by the `attend` callable.
    INPUT_LINEARS: the linears that read the layer's input, in the order `heads` takes their
    products (MLA's layer, mla.py, has the same interface)."""

    INPUT_LINEARS = ("q_proj", "k_proj", "v_proj")

    def __init__(self, cfg: DraftConfig, in_features: int):
        super().__init__()
        hd, b = cfg.head_dim, cfg.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(in_features, cfg.num_attention_heads * hd, bias=b)
        self.k_proj = nn.Linear(in_features, cfg.num_key_value_heads * hd, bias=b)
        self.v_proj = nn.Linear(in_features, cfg.num_key_value_heads * hd, bias=b)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=b)

    def heads(self, q_BTO: Tensor, k_BTO: Tensor, v_BTO: Tensor, cos_BTD: Tensor, sin_BTD: Tensor,
              project: Any = None) -> tuple[Tensor, Tensor, Tensor]:
        """The q, k, v products [B,T,out] as heads: rotated queries [B,Hq,T,D], rotated keys
        and values [B,Hkv,T,D]. project: unused (MLA's later products)."""
        B, T, _ = q_BTO.shape
        q = q_BTO.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = k_BTO.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v_BTO.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos_BTD, sin_BTD), apply_rope(k, cos_BTD, sin_BTD), v

    def qkv(self, x_BTI: Tensor, cos_BTD: Tensor, sin_BTD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.heads(self.q_proj(x_BTI), self.k_proj(x_BTI), self.v_proj(x_BTI), cos_BTD, sin_BTD)

    def merge_heads(self, out_BHTD: Tensor) -> Tensor:
        """[B,Hq,T,D] -> [B,T,Hq*D], o_proj's input."""
        B, _, T, _ = out_BHTD.shape
        return out_BHTD.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)

    def out(self, out_BHTD: Tensor) -> Tensor:
        return self.o_proj(self.merge_heads(out_BHTD))


class DecoderLayer(nn.Module):
    """Layer 0 is EAGLE-3's: it also reads the token embedding (2H-wide q/k/v input)."""

    def __init__(self, cfg: DraftConfig, first: bool):
        super().__init__()
        H = cfg.hidden_size
        self.first, self.norm_before_residual = first, cfg.norm_before_residual
        if first:
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        attention = MLAAttention if cfg.attention == "mla" else SelfAttention
        self.self_attn = attention(cfg, 2 * H if first else H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(H, cfg.intermediate_size)

    def forward(self, h_BTH: Tensor, embeds_BTH: Tensor, cos: Tensor, sin: Tensor, attend: Callable[..., Tensor]
                ) -> Tensor:
        q, k, v, residual = self.attn_inputs(h_BTH, embeds_BTH, cos, sin)
        return self.attn_output(attend(q, k, v), residual)

    # The layer in two halves around the attention call.
    def attn_inputs(self, h_BTH: Tensor, embeds_BTH: Tensor, cos: Tensor, sin: Tensor
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(q, k, v, residual): the norms, the q/k/v projections and RoPE."""
        if self.first:
            normed = self.hidden_norm(h_BTH)
            residual = normed if self.norm_before_residual else h_BTH
            # Embedding first, hidden second: the order every EAGLE-3 loader expects.
            x = torch.cat([self.input_layernorm(embeds_BTH), normed], dim=-1)
        else:
            residual, x = h_BTH, self.input_layernorm(h_BTH)
        return *self.self_attn.qkv(x, cos, sin), residual

    def attn_output(self, out_BHTD: Tensor, residual_BTH: Tensor) -> Tensor:
        """o_proj, the residual, post_attention_layernorm and the MLP."""
        h = residual_BTH + self.self_attn.out(out_BHTD)
        return h + self.mlp(self.post_attention_layernorm(h))


# attend(layer_index, q_BHTD, k_BKTD, v_BKTD) -> out_BHTD; the TTT unroll and the KV cache
# each supply one, so the step function is shared by training and inference.
Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]


# ---- the draft ----------------------------------------------------------------------------


class Eagle3Draft(nn.Module):
    ALGORITHM = "eagle3"  # its package in eaglet/draft/__init__.py DRAFT_TYPES

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # copied from the target, frozen
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_aux))
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, H, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, first=i == 0) for i in range(cfg.num_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        add_vocabulary_maps(self, cfg.vocab_size, cfg.draft_vocab_size)  # identity until the caller loads the run's
        self.rope = Rotary(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        # A faster TTT unroll of this draft installed from outside (eaglet/draft/eagle3/unroll.py):
        # called with `reference_ttt_steps`' arguments, it yields the same logits.
        self.unroll: Callable[..., Iterator[Tensor]] | None = None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, std) linears, zero biases, unit norms (transformers' Llama init)."""
        init_draft_weights(self, self.embed_tokens, std)

    # ---- pieces ---------------------------------------------------------------------------

    def project_aux(self, aux_BTA: Tensor) -> Tensor:
        """fc over the captured target states, concatenated low..high: [B,T,num_aux*Ht] -> [B,T,H]."""
        if self.config.fc_norm:
            parts = aux_BTA.chunk(self.config.num_aux, dim=-1)
            aux_BTA = torch.cat([n(p) for n, p in zip(self.fc_norm, parts, strict=True)], dim=-1)
        return self.fc(aux_BTA)

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def step(self, hidden_BTH: Tensor, input_ids_BT: Tensor, position_ids_BT: Tensor, attend: Attend
             ) -> tuple[Tensor, Tensor]:
        """One draft step: (hidden to feed the next step [B,T,H], logits [B,T,draft_vocab])."""
        embeds = self.embed_tokens(input_ids_BT).to(hidden_BTH.dtype)
        cos, sin = self.rope(position_ids_BT, hidden_BTH.dtype)
        h = hidden_BTH
        for i, layer in enumerate(self.layers):
            h = layer(h, embeds, cos, sin, partial(attend, i))
        return self.head(h)

    def head(self, h_BTH: Tensor) -> tuple[Tensor, Tensor]:
        """(hidden for the next step, logits [B,T,draft_vocab]) from the last layer's output."""
        normed = self.norm(h_BTH)
        # EAGLE-3.1 (norm_output) feeds the normed state forward; EAGLE-3 the residual stream.
        return (normed if self.config.norm_output else h_BTH), self.lm_head(normed)

    # ---- training: the TTT unroll ---------------------------------------------------------

    def reference_ttt_steps(
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
        """Yield the draft logits [B,T,draft_vocab] of steps 0..num_steps-1.

        aux_BTA: the target's captured states at each position, concatenated (low..high).
        input_ids_BT: the sample's tokens; row t of step j reads token t+1+j (zero past the
            end; those rows predict nothing and the loss skips them).
        position_ids_BT: each token's position (restarting per packed document); default
            arange. Row t of step j runs at position_ids[t] + 1 + j, the position of its
            input token, as official EAGLE-3 (position_ids + step) and speculators
            (positions + 1 per step) do.
        doc_ids_BT: document id per token for packed sequences (None: one document).
        head_rows: per step, the rows whose logits are wanted (flat indices b*T + t, the rows
            its loss can count: `loss.head_rows`); step j then yields [1, len, draft_vocab].
        active_rows: the rows steps 1.. must be right for (`loss.active_rows`); every row
            is computed here, so they change nothing (the fast unroll computes only those).
        A generator, so a caller can take each step's loss before the next step runs.
        """
        B, T = input_ids_BT.shape
        if position_ids_BT is None:
            position_ids_BT = torch.arange(T, device=input_ids_BT.device).expand(B, T)
        attend = TTTAttend(len(self.layers), doc_ids_BT, T, input_ids_BT.device, attn_impl)
        hidden = self.project_aux(aux_BTA)
        for j in range(num_steps):
            hidden, logits = self.step(hidden, shift_ids(input_ids_BT, 1 + j), position_ids_BT + 1 + j, attend)
            if head_rows is not None:
                logits = logits.flatten(0, 1).index_select(0, head_rows[j])[None]
            yield logits

    def ttt_steps(self, *args: Any, **kwargs: Any) -> Iterator[Tensor]:
        """The TTT unroll training runs: the installed fast one (`unroll`), else the reference;
        the arguments are `reference_ttt_steps`'."""
        if self.unroll is not None:
            return self.unroll(*args, **kwargs)
        return self.reference_ttt_steps(*args, **kwargs)

    def ttt_forward(self, *args: Any, **kwargs: Any) -> list[Tensor]:
        """All steps' logits as a list; the arguments are `reference_ttt_steps`'."""
        return list(self.ttt_steps(*args, **kwargs))

    forward = ttt_forward  # module(...) is the training call (DDP's and FSDP2's hooks run on forward)

    # ---- inference ------------------------------------------------------------------------

    def forward_step(
        self,
        hidden_BTH: Tensor,
        input_ids_BT: Tensor,
        position_ids_BT: Tensor,
        kv_cache: KVCache | None = None,
        attn_mask_TS: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Inference step over T new rows, causal among them and over everything cached.

        First call: hidden = project_aux(target states) for rows 0..t, tokens shifted by one
        (row s gets token s+1, at the position of token s+1). Each later chain step: one row
        whose hidden is the previous call's hidden output at its last row, whose token is the
        previous draft token, at the next position.

        attn_mask_TS: optional bool [T, S] (True = attend) over all S = cached + T keys; it
        replaces the causal pattern, e.g. for the rows of an EAGLE-2 draft tree, which see
        the prefix and their own ancestors only.
        """

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if kv_cache is not None:
                k, v = kv_cache.append(layer, k, v)
            return cached_attention(q, k, v, attn_mask_TS)

        out = self.step(hidden_BTH, input_ids_BT, position_ids_BT, attend)
        if kv_cache is not None:
            kv_cache.advance(input_ids_BT.shape[1])
        return out


def shift_ids(ids_BT: Tensor, n: int) -> Tensor:
    """Row t gets token t + n; zeros past the end."""
    B, T = ids_BT.shape
    n = min(n, T)
    return torch.cat([ids_BT[:, n:], ids_BT.new_zeros(B, n)], dim=1)
