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
nothing else. This is exactly what a KV-cached chain of drafts sees at inference time.
Since step j's tokens are step 0's shifted j rows on, the unroll makes layer 0's q/k/v
products of the token embeddings once and shifts them for each step (`embeds_once`): at
k = 7 that removes 6 of 7 of those products, forward and backward. And since from step 1 on a
row's states reach only its own row, the steps from 1 on can run over the rows some later step
trains on only (`ttt_steps`' active_rows), gathered into one sequence.

Three interchangeable attention implementations (`attn_impl`):
    "flex"    flex_attention with one T x T causal/document BlockMask for the step-0 keys,
              merged with the diagonal terms through the log-sum-exp; the mask and kernel
              shapes are the same at every step. Fast only when compiled (on GPU); CPU
              flex_attention has no backward.
    "chunked" the same merge with the step-0 part computed in query chunks in plain
              PyTorch (recomputed in backward): any device, memory O(chunk x T).
    "naive"   an explicit dense [T, (j+1)T] mask and softmax; the reference for tests.

`compile_draft` (applied from outside, by parallel.parallelize) torch.compiles the pieces of
a step around the attention call (each layer's `attn_inputs` / `attn_output`, the `head`,
the diagonal merge); the eager code is the reference that tests compare it with.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed
    DTensor = None

ATTN_IMPLS = ("auto", "flex", "chunked", "naive")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# Config attributes that mark a mixture-of-experts target / a multi-head latent attention
# (MLA: DeepSeek-V2/V3, Kimi-K2) target.
_MOE_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_intermediate_size")
_MLA_KEYS = ("kv_lora_rank", "q_lora_rank")


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

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
        """
        c = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        hidden = int(c.hidden_size)
        if any(getattr(c, k, None) is not None for k in _MLA_KEYS):
            head_dim = 128 if hidden % 128 == 0 else hidden // int(c.num_attention_heads)
            heads = hidden // head_dim
            kv_heads = 8 if heads % 8 == 0 else heads
        else:
            heads = int(c.num_attention_heads)
            kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
            head_dim = int(getattr(c, "head_dim", None) or hidden // heads)
        theta, scaling = _target_rope(c)
        fields: dict[str, Any] = dict(
            hidden_size=hidden,
            target_hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=draft_intermediate_size(c),
            vocab_size=int(c.vocab_size),
            draft_vocab_size=int(draft_vocab_size),
            rms_norm_eps=float(getattr(c, "rms_norm_eps", None) or 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(getattr(c, "max_position_embeddings", None) or 4096),
        )
        unknown = set(overrides) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise TypeError(f"unknown DraftConfig fields: {sorted(unknown)}")
        fields.update(overrides)
        return cls(**fields)


def is_moe_config(c: Any) -> bool:
    return any(getattr(c, k, None) for k in _MOE_KEYS)


def draft_intermediate_size(c: Any) -> int:
    """The draft's MLP width for a target text config (rule in DraftConfig.from_target_config)."""
    if not is_moe_config(c):
        return int(c.intermediate_size)
    if getattr(c, "intermediate_size_mlp", None):
        return int(c.intermediate_size_mlp)
    if getattr(c, "moe_intermediate_size", None) and getattr(c, "intermediate_size", None):
        return int(c.intermediate_size)
    return -(-4 * int(c.hidden_size) // 256) * 256


def _target_rope(c: Any) -> tuple[float, dict[str, Any] | None]:
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


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in fp32 (fp64 stays), cast back, then scale (HF's rounding)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = _acc(x)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


# A decoder layer's linear weights (and biases) as one TTT unroll uses them: the linear's own
# name ("q_proj", "q_proj.bias", ...) -> the weight cast to the autocast dtype, and, when the
# unroll's products accumulate their weight gradients themselves, "q_proj.grad" -> the buffer
# they accumulate into and "q_proj.link" -> the scalar that ties them to the hand-off of that
# buffer to the parameter. See `cast_linears`.
Weights = dict[str, Tensor]


def _accumulate_weight_grad(acc: Tensor, grad_out: Tensor, x: Tensor, col0: int = 0) -> None:
    x2 = x.reshape(-1, x.shape[-1])
    acc.narrow(1, col0, x2.shape[1]).addmm_(grad_out.reshape(-1, grad_out.shape[-1]).t(), x2)


def _accumulate_weight_grad_fake(acc: Tensor, grad_out: Tensor, x: Tensor, col0: int = 0) -> None:
    return None


# acc[:, col0 : col0 + in] += grad_out^T x over all rows: one GEMM whose epilogue adds into `acc`
# (beta = 1), written in place also when it is a band of acc's columns (a product that uses
# part of the weight's inputs). An opaque op, so that a compiled backward calls it in place on
# `acc` (inductor turns an in-place addmm_ on a graph input into an out-of-place addmm and a
# copy back). Defined through torch.library's low-level API, with one kernel for every backend:
# the backward calls it once per weight and TTT step (59 times a step at the 8B dims, k = 7), and
# `torch.library.custom_op`'s Python wrappers around each call (autograd, in-place views, its
# checks) cost tens of microseconds of host time each, which at the single-sequence 8B shape is
# time the GPU waits. No autograd formula: it runs in the backward, where grad mode is off.
ACCUMULATE_OP = "eaglet::accumulate_weight_grad_"
_EAGLET_LIB = torch.library.Library("eaglet", "FRAGMENT")  # the registrations live as long as this module
_EAGLET_LIB.define("accumulate_weight_grad_(Tensor(a!) acc, Tensor grad_out, Tensor x, int col0=0) -> ()")
_EAGLET_LIB.impl("accumulate_weight_grad_", _accumulate_weight_grad, "CompositeExplicitAutograd")
torch.library.register_fake(ACCUMULATE_OP, _accumulate_weight_grad_fake, lib=_EAGLET_LIB)
accumulate_weight_grad_ = torch.ops.eaglet.accumulate_weight_grad_.default


class _AccumulatingLinear(torch.autograd.Function):
    """F.linear(x, w, b) whose backward adds the weight gradient into `acc` in the GEMM that
    computes it, instead of handing it to autograd, which would sum the TTT steps' gradients of
    the shared weight with one full-size add per step. `link` (`_UnrollWeight`'s) gets a zero:
    the edge that makes the hand-off to the parameter wait for this product's backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, acc: Tensor, link: Tensor, b: Tensor | None, col0: int = 0
                ) -> Tensor:
        x = x.to(w.dtype)  # what autocast's linear does; the weight gradient needs it in w's dtype
        ctx.save_for_backward(x, w)
        # acc is not saved: the other steps' backward mutate it. col0: w is acc's columns col0...
        ctx.acc, ctx.col0, ctx.has_bias = acc, col0, b is not None
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, Tensor, Tensor | None, None]:
        x, w = ctx.saved_tensors
        accumulate_weight_grad_(ctx.acc, g, x, ctx.col0)
        gb = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias else None
        return g @ w, None, None, g.new_zeros(()), gb, None


class _UnrollWeight(torch.autograd.Function):
    """param -> (its copy in `dtype` for one TTT unroll, a scalar `link`). The products that
    use the copy add their weight gradients into `acc` (`_AccumulatingLinear`) and hand none
    to autograd; they hand a zero to `link`. This node, which therefore runs after all of
    them, hands `acc` to the parameter, cast to its dtype: where the gradient hooks of DDP
    and of gradient accumulation see it. (The copy itself is not differentiable: a compiled
    graph that gives it no gradient drops its edge, and with it the wait.)"""

    @staticmethod
    def forward(ctx: Any, param: Tensor, acc: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)  # no full-size zeros for the copy's (absent) gradient
        ctx.acc, ctx.param_dtype = acc, param.dtype
        w = param.to(dtype)
        ctx.mark_non_differentiable(w)
        return w, param.new_zeros((), dtype=dtype)

    @staticmethod
    def backward(ctx: Any, _w: Tensor | None, _link: Tensor | None) -> tuple[Tensor, None, None]:
        grad, ctx.acc = ctx.acc.to(ctx.param_dtype), None
        return grad, None, None


@dataclass
class UnrollCopy:
    """A linear weight's persistent low-precision copy for the TTT unroll, and the buffer its
    products accumulate the weight gradient into (zero between optimizer steps). Kept on the
    nn.Linear as `unroll_copy` by eaglet.optim.attach_unroll_copies; the optimizer
    (eaglet.optim.UnrollAdamW) reads `grad`, updates the parameter and writes `weight`."""

    weight: Tensor
    grad: Tensor
    version: int  # the parameter's version counter when `weight` was last made from it

    def fresh(self, param: Tensor) -> Tensor:
        """The copy, cast again first if the parameter was changed in place since (a checkpoint
        loaded, an initialisation): its version counter moved."""
        if param._version != self.version:
            with torch.no_grad():
                self.weight.copy_(param)
            self.version = param._version
        return self.weight


def _sharded(t: Tensor) -> bool:
    """A DTensor: FSDP2 holds a unit's parameters whole only inside that unit's own forward."""
    return DTensor is not None and isinstance(t, DTensor)


def cast_linears(modules: Iterable[tuple[str, nn.Module]], dtype: torch.dtype, accumulate: bool = True
                 ) -> Weights | None:
    """The weight (and bias) of every nn.Linear among `modules` ((path, module) pairs, as
    `named_modules()` gives them), cast to `dtype`, keyed by the last part of its path (unique
    within a decoder layer). None when they are sharded (an FSDP2 unit outside its forward):
    the products then cast as before.

    accumulate: where a weight gets a gradient, its products accumulate it into a zeroed
    buffer ("<name>.grad", in `dtype`) inside their weight-gradient GEMMs (`_AccumulatingLinear`),
    handed to the parameter once when the backward is done with the copy (`_UnrollWeight`).
    False: autograd sums the products' gradients of the copy, one add per product.

    A linear with an `unroll_copy` (`UnrollCopy`, set by eaglet.optim.attach_unroll_copies for
    the single-process optimizer) gives that persistent copy instead, re-cast only when the
    parameter changed since, and, with grad, its persistent accumulator: the products add into
    it, nothing is handed to the parameter (its .grad stays None), and the optimizer reads it.
    The "link" is then a fresh leaf that only keeps the products' backward running."""
    out: Weights = {}
    for name, mod in modules:
        if isinstance(mod, nn.Linear):
            if _sharded(mod.weight):
                return None
            key, weight = name.rsplit(".", 1)[-1], mod.weight
            kept: UnrollCopy | None = getattr(mod, "unroll_copy", None)
            if kept is not None and kept.weight.dtype == dtype:  # eaglet.optim's copy and accumulator
                out[key] = kept.fresh(weight)
                if torch.is_grad_enabled() and weight.requires_grad:
                    if not accumulate:
                        raise ValueError(f"{name}: its gradient goes to unroll_copy.grad; accumulate=False needs "
                                         "the plain optimizer (no unroll copies)")
                    out[key + ".grad"] = kept.grad
                    out[key + ".link"] = torch.zeros((), dtype=dtype, device=weight.device, requires_grad=True)
            elif accumulate and torch.is_grad_enabled() and weight.requires_grad and weight.dtype != dtype:
                out[key + ".grad"] = acc = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
                out[key], out[key + ".link"] = _UnrollWeight.apply(weight, acc, dtype)
            else:
                out[key] = weight.to(dtype)
            if mod.bias is not None:
                out[key + ".bias"] = mod.bias.to(dtype)
    return out


def _linear(mod: nn.Linear, name: str, x: Tensor, w: Weights | None, cols: tuple[int, int] | None = None,
            bias: bool = True) -> Tensor:
    """mod(x); with `w`, the same product through w's copy of the weights.
    cols (a, b): the product with the weight's input columns a..b-1 only (x has b - a
    features; a view of the weight, no copy); bias False: without the bias."""
    if w is None and cols is None and bias:
        return mod(x)  # the module itself, its hooks included (inference, and the layers FSDP2 shards)
    if w is None:
        weight, b, acc = mod.weight, mod.bias, None
    else:
        weight, b, acc = w[name], w.get(name + ".bias"), w.get(name + ".grad")
    if cols is not None:
        weight = weight[:, cols[0]:cols[1]]
    if not bias:
        b = None
    if acc is None:
        return F.linear(x, weight, b)
    return _AccumulatingLinear.apply(x, weight, acc, w[name + ".link"], b, 0 if cols is None else cols[0])


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor, w: Weights | None = None) -> Tensor:
        gate, up = _linear(self.gate_proj, "gate_proj", x, w), _linear(self.up_proj, "up_proj", x, w)
        return _linear(self.down_proj, "down_proj", F.silu(gate) * up, w)


class QKV(NamedTuple):
    q: Tensor
    k: Tensor
    v: Tensor


class SelfAttention(nn.Module):
    """Projections only; which keys a query sees is decided by the `attend` callable."""

    def __init__(self, cfg: DraftConfig, in_features: int):
        super().__init__()
        hd, b = cfg.head_dim, cfg.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(in_features, cfg.num_attention_heads * hd, bias=b)
        self.k_proj = nn.Linear(in_features, cfg.num_key_value_heads * hd, bias=b)
        self.v_proj = nn.Linear(in_features, cfg.num_key_value_heads * hd, bias=b)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=b)

    def projections(self, x_BTI: Tensor, w: Weights | None = None, cols: tuple[int, int] | None = None,
                    bias: bool = True) -> QKV:
        """The q, k and v products [B,T,out] (cols, bias: `_linear`'s)."""
        return QKV(*(_linear(mod, name, x_BTI, w, cols, bias)
                     for mod, name in ((self.q_proj, "q_proj"), (self.k_proj, "k_proj"), (self.v_proj, "v_proj"))))

    def qkv(self, x_BTI: Tensor, cos_BTD: Tensor, sin_BTD: Tensor, w: Weights | None = None,
            cols: tuple[int, int] | None = None, plus: QKV | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated queries [B,Hq,T,D], rotated keys and values [B,Hkv,T,D].
        cols, plus: x is the weights' input columns `cols`, and `plus` the products of the
        other columns, added (layer 0's products of the token embeddings, `DecoderLayer.embed_projection`)."""
        B, T, _ = x_BTI.shape
        q, k, v = self.projections(x_BTI, w, cols)
        if plus is not None:
            q, k, v = q + plus.q, k + plus.k, v + plus.v
        q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos_BTD, sin_BTD), apply_rope(k, cos_BTD, sin_BTD), v

    def out(self, out_BHTD: Tensor, w: Weights | None = None) -> Tensor:
        B, _, T, _ = out_BHTD.shape
        return _linear(self.o_proj, "o_proj", out_BHTD.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim), w)

    def forward(self, x_BTI: Tensor, cos_BTD: Tensor, sin_BTD: Tensor, attend: Callable[..., Tensor]) -> Tensor:
        return self.out(attend(*self.qkv(x_BTI, cos_BTD, sin_BTD)))


class DecoderLayer(nn.Module):
    """Layer 0 is EAGLE-3's: it also reads the token embedding (2H-wide q/k/v input)."""

    def __init__(self, cfg: DraftConfig, first: bool):
        super().__init__()
        H = cfg.hidden_size
        self.first, self.norm_before_residual = first, cfg.norm_before_residual
        if first:
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, 2 * H if first else H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(H, cfg.intermediate_size)

    def forward(
        self, h_BTH: Tensor, embeds_BTH: Tensor | QKV, cos: Tensor, sin: Tensor, attend: Callable[..., Tensor],
        w: Weights | None = None, embed_rows: Tensor | None = None,
    ) -> Tensor:
        q, k, v, residual = self.attn_inputs(h_BTH, embeds_BTH, cos, sin, w, embed_rows)
        return self.attn_output(attend(q, k, v), residual, w)

    # The layer in two halves around the attention call: the pieces that `compile_draft`
    # compiles (tensors in, tensors out, the same graph at every TTT step). `w`: the linear
    # weights to use instead of the parameters (`cast_linears`; the TTT unroll's once-cast copies).
    def attn_inputs(
        self, h_BTH: Tensor, embeds_BTH: Tensor | QKV, cos: Tensor, sin: Tensor, w: Weights | None = None,
        embed_rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(q, k, v, residual): the norms, the q/k/v projections and RoPE. Layer 0 takes the
        token embeddings, or their half of the q/k/v products (`embed_projection`) ready made;
        embed_rows: of those products, h's rows take these flat rows (shaped as h's rows)."""
        if self.first:
            normed = self.hidden_norm(h_BTH)
            residual = normed if self.norm_before_residual else h_BTH
            if isinstance(embeds_BTH, QKV):
                H = normed.shape[-1]
                if embed_rows is not None:  # [B', T'] flat rows of the products, shaped as h's rows
                    embeds_BTH = QKV(*(_take_rows(p, embed_rows) for p in embeds_BTH))
                return *self.self_attn.qkv(normed, cos, sin, w, cols=(H, 2 * H), plus=embeds_BTH), residual
            # Embedding first, hidden second: the order every EAGLE-3 loader expects.
            x = torch.cat([self.input_layernorm(embeds_BTH), normed], dim=-1)
        else:
            residual, x = h_BTH, self.input_layernorm(h_BTH)
        return *self.self_attn.qkv(x, cos, sin, w), residual

    def embed_projection(self, embeds_BTH: Tensor, w: Weights | None = None) -> QKV:
        """Layer 0's q/k/v products of input_layernorm(embeddings) alone, without the biases:
        their half of the weights' input columns (the first H)."""
        assert self.first, "only layer 0 reads the token embeddings"
        return self.self_attn.projections(self.input_layernorm(embeds_BTH), w, (0, embeds_BTH.shape[-1]), bias=False)

    def attn_output(self, out_BHTD: Tensor, residual_BTH: Tensor, w: Weights | None = None) -> Tensor:
        """o_proj, the residual, post_attention_layernorm and the MLP."""
        h = residual_BTH + self.self_attn.out(out_BHTD, w)
        return h + self.mlp(self.post_attention_layernorm(h), w)


# attend(layer_index, q_BHTD, k_BKTD, v_BKTD) -> out_BHTD; the TTT unroll and the KV cache
# each supply one, so the step function is shared by training and inference.
Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]


# ---- the draft ----------------------------------------------------------------------------


class Eagle3Draft(nn.Module):
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
        # Identity maps until the caller loads the vocabulary's.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        # Kept out of the buffers so that model.to(bfloat16) cannot round the frequencies.
        self._inv_freq, self.rope_scale = rope_inv_freq(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
        )
        self._inv_freq_on: dict[torch.device, Tensor] = {}
        # How the TTT attention folds in the diagonal keys: None is the reference
        # (_merge_diagonal); compile_draft puts a compiled merge_diagonal_stacked here.
        self.merge: Callable[..., Tensor] | None = None
        # The TTT unroll makes layer 0's q/k/v products of the token embeddings once and
        # shifts them for each step (`ttt_steps`); False: each step makes its own (the reference).
        self.embeds_once = True
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, std) linears, zero biases, unit norms (transformers' Llama init)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        nn.init.normal_(self.embed_tokens.weight, std=std)

    # ---- pieces ---------------------------------------------------------------------------

    def project_aux(self, aux_BTA: Tensor) -> Tensor:
        """fc over the captured target states, concatenated low..high: [B,T,num_aux*Ht] -> [B,T,H]."""
        if self.config.fc_norm:
            parts = aux_BTA.chunk(self.config.num_aux, dim=-1)
            aux_BTA = torch.cat([n(p) for n, p in zip(self.fc_norm, parts, strict=True)], dim=-1)
        return self.fc(aux_BTA)

    def rope(self, position_ids_BT: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, sin) [B,T,head_dim] computed in fp32 (as transformers does), then cast."""
        dev = position_ids_BT.device
        if dev not in self._inv_freq_on:
            self._inv_freq_on[dev] = self._inv_freq.to(dev)
        freqs = position_ids_BT[..., None].float() * self._inv_freq_on[dev]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.rope_scale).to(dtype), (emb.sin() * self.rope_scale).to(dtype)

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def step(
        self, hidden_BTH: Tensor, input_ids_BT: Tensor | None, position_ids_BT: Tensor | None, attend: Attend,
        weights: tuple[list[Weights | None], Weights | None] | None = None, embed_qkv: QKV | None = None,
        rows: Tensor | None = None, rope: tuple[Tensor, Tensor] | None = None, embed_rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One draft step: (hidden to feed the next step [B,T,H], logits [B,T,draft_vocab]).
        weights: (per layer, lm_head) copies of the linear weights to use (`cast_weights`).
        embed_qkv: layer 0's q/k/v products of the input tokens' embeddings, made beforehand
        (`DecoderLayer.embed_projection`); input_ids_BT is then not read. embed_rows: the
        hidden rows take these flat rows of embed_qkv's (gathered in layer 0's compiled inputs).
        rows: the logits of these rows only (flat indices b*T + t), [1, len(rows), draft_vocab].
        rope: (cos, sin) of the positions, made beforehand; position_ids_BT is then not read."""
        embeds = embed_qkv if embed_qkv is not None else self.embed_tokens(input_ids_BT).to(hidden_BTH.dtype)
        cos, sin = rope if rope is not None else self.rope(position_ids_BT, hidden_BTH.dtype)
        h = hidden_BTH
        for i, layer in enumerate(self.layers):
            h = layer(h, embeds, cos, sin, partial(attend, i), None if weights is None else weights[0][i], embed_rows)
        return self.head(h, None if weights is None else weights[1], rows)

    def head(self, h_BTH: Tensor, w: Weights | None = None, rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(hidden for the next step, logits [B,T,draft_vocab]) from the last layer's output;
        rows: the logits of those rows (flat b*T + t) only, [1, len(rows), draft_vocab]."""
        normed = self.norm(h_BTH)
        x = normed if rows is None else _take_rows(normed, rows[None])
        # EAGLE-3.1 (norm_output) feeds the normed state forward; EAGLE-3 the residual stream.
        return (normed if self.config.norm_output else h_BTH), _linear(self.lm_head, "lm_head", x, w)

    def cast_weights(self, dtype: torch.dtype, accumulate: bool = True) -> tuple[list[Weights | None], Weights | None]:
        """The linear weights every TTT step uses (the layers', lm_head's), cast to `dtype` once.

        Under autocast each step's product would cast the fp32 weight itself; compiled, every
        step's graph repeats that cast, and the backward turns each step's bf16 gradient into
        fp32 and adds it to the parameter's: per weight, 7 casts forward, 7 back and 6 fp32 adds
        at k = 7, all memory-bound and all as large as the weights. With one cast per unroll:
        - accumulate (the default): each step's weight-gradient GEMM adds into one bf16 buffer
          per weight (beta = 1: the add rides in the GEMM's epilogue), cast to fp32 once at the end;
        - accumulate False: the steps' gradients meet in the cast's own (bf16) gradient, summed
          by autograd with k - 1 full-size adds: the gradients eager autocast computes, which
          caches the cast the same way.
        Under FSDP2 the layers (units of their own, sharded here) keep casting in their
        products; lm_head, whole in the root unit's forward, is cast once."""
        return ([cast_linears(layer.named_modules(), dtype, accumulate) for layer in self.layers],
                cast_linears([("lm_head", self.lm_head)], dtype, accumulate))

    def unroll_linears(self) -> list[nn.Module]:
        """The linears `cast_weights` casts once per unroll (the layers', lm_head): those that
        can have an `UnrollCopy`. Not fc, which runs once per unroll on the captured states."""
        return [m for layer in self.layers for m in layer.modules() if isinstance(m, nn.Linear)] + [self.lm_head]

    # ---- training: the TTT unroll ---------------------------------------------------------

    def ttt_steps(
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
        head_rows: per step, the rows whose logits are wanted (flat indices b*T + t, the
            rows its loss can count: `loss.head_rows`); step j then yields [1, len, draft_vocab].
            The LM head is about a third of a step's products; a row that is not trained
            on (a prompt token, a document's last rows) needs none of it.
        active_rows: with head_rows, the rows steps 1..num_steps-1 run over (flat b*T + t,
            ascending; `loss.active_rows`: every row some step from 1 on counts, so it holds
            head_rows[1:]). From step 1 on, a row's keys and values are seen by its own query
            only (the diagonal), so a row that no later step counts needs no work from there
            on: those steps run over these rows alone, gathered into one [1, n] sequence whose
            step-0 attention reads the full step-0 keys (`ttt_attention`'s rows).
        A generator, so a caller can take each step's loss before the next step runs.
        """
        B, T = input_ids_BT.shape
        dev = input_ids_BT.device
        if position_ids_BT is None:
            position_ids_BT = torch.arange(T, device=dev).expand(B, T)
        impl = resolve_attn_impl(attn_impl, dev)
        block_mask = ttt_block_mask(doc_ids_BT, T, dev) if impl == "flex" else None
        kv: list[list[tuple[Tensor, Tensor]]] = [[] for _ in self.layers]

        if head_rows is None or num_steps < 2:
            active_rows = None
        step_rows: Tensor | None = None  # the rows the current step runs over (None: all)

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            kv[layer].append((k, v))
            ks, vs = [k for k, _ in kv[layer]], [v for _, v in kv[layer]]
            return ttt_attention(q, ks, vs, impl, doc_ids_BT=doc_ids_BT, block_mask=block_mask, merge=self.merge,
                                 rows=step_rows)

        hidden = self.project_aux(aux_BTA)
        lowp = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else None
        weights = self.cast_weights(lowp) if lowp is not None and num_steps > 1 else None
        # Step j's tokens are step 0's shifted j rows on, so layer 0's q/k/v products of their
        # embeddings are step 0's shifted too: made once (not under FSDP2, whose layer 0 is
        # sharded outside its own forward).
        once = self.embeds_once and not _sharded(self.layers[0].self_attn.q_proj.weight)
        ids0 = _shift_ids(input_ids_BT, 1)  # row t of step 0 reads token t + 1
        if once:
            embed_qkv = self.layers[0].embed_projection(self.embed_tokens(ids0).to(hidden.dtype),
                                                        None if weights is None else weights[0][0])
        # The steps from 1 on run over `seq` (flat rows b*T + t, shaped as their sequence):
        # every row, or the active rows as one [1, n] sequence. Row t of step j reads what row
        # min(t + j, T - 1) of step 0 read (token t + 1 + j; the pad token past the end): its
        # tokens, or their embedding products, are gathered from step 0's by `src[j - 1]`.
        # Step 0 gathers by the identity (`every`), so that layer 0's compiled inputs are one
        # graph whatever the step. These indices and every step's positions and RoPE tables are
        # made here, once per unroll (a few kernels, not a few per step: at the 8B dims a step is
        # a couple of milliseconds of GPU work, so the host's time per step counts).
        every = torch.arange(B * T, device=dev).view(B, T)
        seq = every if active_rows is None else active_rows[None]
        t, ahead = seq % T, torch.arange(1, num_steps, device=dev)[:, None, None]  # j = 1..k-1
        src = seq - t + (t + ahead).clamp(max=T - 1)  # [k-1, *seq.shape]
        rope0 = self.rope(position_ids_BT + 1, hidden.dtype)
        later_rope = self.rope(_take_rows(position_ids_BT, seq) + 1 + ahead, hidden.dtype)  # position + 1 + j
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
                    step_rows, hidden = active_rows, _take_rows(hidden, seq)
                ids = None if once else _take_rows(ids0, src[j - 1])
                plus, plus_rows = (embed_qkv, src[j - 1]) if once else (None, None)
                rope = later_rope[0][j - 1], later_rope[1][j - 1]
                rows = None if head_rows is None else head_rows[j] if active_rows is None else later_heads[j - 1]
            hidden, logits = self.step(hidden, ids, None, attend, weights, plus, rows, rope, plus_rows)
            yield logits

    def ttt_forward(self, *args: Any, **kwargs: Any) -> list[Tensor]:
        """All steps' logits as a list; the arguments are `ttt_steps`'."""
        return list(self.ttt_steps(*args, **kwargs))

    forward = ttt_forward  # module(...) is the training call (FSDP hooks run on forward)

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


def _shift_ids(ids_BT: Tensor, n: int) -> Tensor:
    """Row t gets token t + n; zeros past the end."""
    B, T = ids_BT.shape
    n = min(n, T)
    return torch.cat([ids_BT[:, n:], ids_BT.new_zeros(B, n)], dim=1)


def _take_rows(x_BT: Tensor, rows: Tensor) -> Tensor:
    """The flat rows b*T + t of x [B, T, ...] that `rows` holds, shaped as rows: [*rows.shape, ...]."""
    return x_BT.flatten(0, 1).index_select(0, rows.flatten()).view(*rows.shape, *x_BT.shape[2:])


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


# ---- TTT attention ------------------------------------------------------------------------

# The compiled flex_attention for CUDA inputs; `compile_flex_attention()` sets it (needed for
# speed on GPU). Its LSE API changed: older torch takes return_lse=True, newer return_aux.
_flex_compiled: Callable[..., Any] | None = None
_SPARSE_BLOCK = 128  # flex attention's block of queries and of keys (its default)
_FLEX_RETURNS_AUX = "return_aux" in inspect.signature(flex_attention).parameters


def compile_flex_attention(**compile_kwargs: Any) -> None:
    """Use torch.compile(flex_attention) for CUDA inputs from now on (CPU inputs stay eager)."""
    global _flex_compiled
    _flex_compiled = torch.compile(flex_attention, **compile_kwargs)


def compile_draft(model: Eagle3Draft, **compile_kwargs: Any) -> Eagle3Draft:
    """torch.compile the pieces of a TTT step, in place; returns the model.

    Compiled: each decoder layer's `attn_inputs` (norms, q/k/v, RoPE) and `attn_output`
    (o_proj, residual, norm, MLP), layer 0's `embed_projection` (once per unroll), the `head`
    (final norm, lm_head), and the merge of the diagonal keys into the step-0 attention
    (`merge_diagonal_stacked`). These are the memory-bound elementwise chains around the
    matrix products that eager mode runs as one kernel each. The attention call itself stays
    outside (flex_attention has its own compile, `compile_flex_attention`), so each piece is
    one graph whatever the TTT step: no recompilation per step, no graph breaks. Weights,
    state dict and export are untouched.
    """
    model.layers[0].embed_projection = torch.compile(model.layers[0].embed_projection, **compile_kwargs)
    for layer in model.layers:
        layer.attn_inputs = torch.compile(layer.attn_inputs, **compile_kwargs)
        layer.attn_output = torch.compile(layer.attn_output, **compile_kwargs)
    model.head = torch.compile(model.head, **compile_kwargs)
    model.merge = torch.compile(merge_diagonal_stacked, **compile_kwargs)
    return model


def _flex_attention(q: Tensor, *args: Any, **kwargs: Any) -> Any:
    fn = _flex_compiled if (_flex_compiled is not None and q.is_cuda) else flex_attention
    return fn(q, *args, **kwargs)


def resolve_attn_impl(attn_impl: str, device: torch.device) -> str:
    if attn_impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl {attn_impl!r}: expected one of {ATTN_IMPLS}")
    if attn_impl == "auto":
        return "flex" if device.type == "cuda" else "chunked"
    return attn_impl


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
    of steps 1..j. ks/vs: [B, Hkv, T, D] per step. Returns [B, Hq, T, D].

    merge: None folds the diagonal keys in with `_merge_diagonal` (the reference); else a
    function with `merge_diagonal_stacked`'s signature (compile_draft's compiled one).
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


def _acc(x: Tensor) -> Tensor:
    """Accumulation dtype: fp32, or fp64 when the inputs are (tests compare in fp64)."""
    return x if x.dtype == torch.float64 else x.float()


def _naive_ttt_attention(q: Tensor, ks: list[Tensor], vs: list[Tensor], mask_BTS: Tensor, scale: float) -> Tensor:
    group = q.shape[1] // ks[0].shape[1]
    k = _acc(torch.cat(ks, dim=2).repeat_interleave(group, dim=1))
    v = _acc(torch.cat(vs, dim=2).repeat_interleave(group, dim=1))
    scores = (_acc(q) @ k.transpose(-1, -2)) * scale
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
    scores = torch.einsum("bkgcd,bksd->bkgcs", _acc(q_BKGCD), _acc(k_BKSD)) * scale
    scores = scores.masked_fill(~allowed_BCS[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bkgcs,bksd->bkgcd", torch.exp(scores - lse[..., None]), _acc(v_BKSD))
    return out, lse


def _chunked_causal_attention(
    q_BHTD: Tensor, k_BKTD: Tensor, v_BKTD: Tensor, doc_ids_BT: Tensor | None, scale: float, chunk: int
) -> tuple[Tensor, Tensor]:
    """Causal (per-document) attention with its log-sum-exp, query chunk by query chunk.

    A chunk of rows [a, b) needs keys [0, b) only. With grad enabled each chunk is
    recomputed in backward, so at most one chunk's scores are alive at a time."""
    B, Hq, T, D = q_BHTD.shape
    Hk = k_BKTD.shape[1]
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
    return torch.cat(outs, dim=3).reshape(B, Hq, T, D), torch.cat(lses, dim=3).reshape(B, Hq, T)


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
    Hk = ks[0].shape[1]
    G = Hq // Hk
    q = _acc(q_BHTD).reshape(B, Hk, G, T, D)
    scores = [(q * _acc(k)[:, :, None]).sum(-1) * scale for k in ks]  # [B, Hk, G, T] each
    all_scores = torch.stack([_acc(lse0_BHT).reshape(B, Hk, G, T), *scores], dim=0)
    weights = torch.softmax(all_scores, dim=0)  # over {all step-0 keys, each diagonal key}
    out = weights[0, ..., None] * _acc(out0_BHTD).reshape(B, Hk, G, T, D)
    for w, v in zip(weights[1:], vs, strict=True):
        out = out + w[..., None] * _acc(v)[:, :, None]
    return out.reshape(B, Hq, T, D).to(q_BHTD.dtype)


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
    Hk = k_JBKTD.shape[2]
    G = Hq // Hk
    q = _acc(q_BHTD).reshape(B, Hk, G, T, D)
    scores = (q[None] * _acc(k_JBKTD)[:, :, :, None]).sum(-1) * scale  # [J, B, Hk, G, T]
    all_scores = torch.cat([_acc(lse0_BHT).reshape(1, B, Hk, G, T), scores], dim=0)
    weights = torch.softmax(all_scores, dim=0)
    out = weights[0, ..., None] * _acc(out0_BHTD).reshape(B, Hk, G, T, D)
    out = out + (weights[1:, ..., None] * _acc(v_JBKTD)[:, :, :, None]).sum(0)
    return out.reshape(B, Hq, T, D).to(q_BHTD.dtype)
