"""An EAGLE-3 export read back (serving.py's formats, either one, and checkpoints from elsewhere
in them: speculators', official EAGLE-3 / SGLang, Eagle3DeepseekV2ForCausalLM's for an MLA
draft): its config.json and weights, which eaglet/formats/serving.py reads and checks as files,
turned into a DraftConfig and a state dict under eaglet's names (`from_serving`), the format told
by `serving_format`."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from ..layers import target_rope
from .model import DraftConfig
from .serving import CHECKPOINT_NAME, FORMATS, draft_shapes
from .serving_mla import is_mla_config, is_plain_rope

SGLANG_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def serving_format(config: dict[str, Any], weights: dict[str, Tensor] | None = None) -> str | None:
    """The format ("vllm", "sglang") an export's config.json (and weight names) is EAGLE-3's in,
    or None: speculators' eagle3 (speculators_model_type), or the official EAGLE-3 / SGLang
    architectures (or its `midlayer.` weights)."""
    if "speculators_model_type" in config:
        return "vllm" if config["speculators_model_type"] == "eagle3" else None
    if is_mla_config(config):
        return "vllm"  # an MLA draft's export is the same for both formats (serving_mla.py)
    if set(config.get("architectures") or []) & set(SGLANG_ARCHS) or any(k.startswith("midlayer.") for k in weights or {}):
        return "sglang"
    return None


def from_serving(config: dict[str, Any], weights: dict[str, Tensor], fmt: str, folder: Path
                 ) -> tuple[DraftConfig, dict[str, Tensor], list[str], dict[str, Any]]:
    """(the draft config, the state dict under eaglet's names, the names missing from it, meta) of
    an export in `fmt` (`serving_format`'s). The state dict holds every weight of
    Eagle3Draft(cfg) except embed_tokens.weight when the checkpoint has none (then `missing`);
    d2t/t2d are the identity when absent from a full-vocabulary draft. meta: aux_layer_ids (HF
    output_hidden_states indices, or None: the engines' default [2, L//2, L-3]),
    verifier_name_or_path, verifier_architectures, num_speculative_tokens. A ValueError names
    what does not fit (tensors as `fmt` names them)."""
    read = _from_mla if is_mla_config(config) else _from_speculators if fmt == "vllm" else _from_sglang
    cfg, meta = read(config, weights)
    state, missing = _map_back(cfg, weights, fmt, folder)
    return cfg, state, missing, meta


def _from_speculators(config: dict[str, Any], weights: dict[str, Tensor]) -> tuple[DraftConfig, dict[str, Any]]:
    tl = dict(config.get("transformer_layer_config") or {})
    if not tl:
        raise ValueError("speculators config has no transformer_layer_config")
    if tl.get("model_type", "llama") != "llama":
        raise ValueError(f"transformer_layer_config model_type {tl.get('model_type')!r}: eaglet drafts are llama")
    if config.get("norm_before_fc"):
        raise ValueError("norm_before_fc (one RMSNorm over the concatenated states) is not an eaglet draft")
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    hidden = int(tl["hidden_size"])
    target_hidden = int(config.get("target_hidden_size") or hidden)
    cfg = _llama_draft_config(
        tl,
        draft_vocab_size=int(config.get("draft_vocab_size") or tl["vocab_size"]),
        target_hidden_size=target_hidden,
        num_layers=int(tl.get("num_hidden_layers", 1)),
        num_aux=_num_aux(weights, target_hidden, ids),
        fc_norm=bool(config.get("fc_norm", False)),
        norm_output=bool(config.get("norm_output", False)),
        # vLLM (the engine this format is for) reads a missing key as true.
        norm_before_residual=bool(config.get("norm_before_residual", True)),
    )
    spec = config.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    verifier = spec.get("verifier") or {}
    meta = {
        "aux_layer_ids": [int(i) for i in ids] if ids else None,
        "verifier_name_or_path": verifier.get("name_or_path"),
        "verifier_architectures": list(verifier.get("architectures") or []),
        "num_speculative_tokens": methods[0].get("speculative_tokens"),
    }
    return cfg, meta


def _from_sglang(config: dict[str, Any], weights: dict[str, Tensor]) -> tuple[DraftConfig, dict[str, Any]]:
    if int(config.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"EAGLE-3/SGLang checkpoint with num_hidden_layers={config['num_hidden_layers']}: "
                         "only the one-layer (midlayer) form is an eaglet draft")
    eagle_ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top_ids = config.get("eagle_aux_hidden_state_layer_ids")
    # SGLang's ids (eagle_config) are layer outputs: HF index = id + 1. vLLM's top-level key is
    # already an HF index. SGLang ignores the top-level key, so eagle_config decides.
    ids = [int(i) + 1 for i in eagle_ids] if eagle_ids else ([int(i) for i in top_ids] if top_ids else None)
    hidden = int(config["hidden_size"])
    target_hidden = int(config.get("target_hidden_size") or hidden)  # official EAGLE-3: absent
    cfg = _llama_draft_config(
        config,
        draft_vocab_size=int(config.get("draft_vocab_size") or config["vocab_size"]),
        target_hidden_size=target_hidden,
        num_layers=1,
        num_aux=_num_aux(weights, target_hidden, ids),
    )
    meta = {"aux_layer_ids": ids, "verifier_name_or_path": None, "verifier_architectures": [],
            "num_speculative_tokens": None}
    return cfg, meta


def _from_mla(config: dict[str, Any], weights: dict[str, Tensor]) -> tuple[DraftConfig, dict[str, Any]]:
    """An MLA draft's export (serving_mla.py; an Eagle3DeepseekV2ForCausalLM config from elsewhere
    too). Its aux ids: the top-level key (vLLM's, HF indices) first, else eagle_config's + 1; its
    RoPE: plain where the export wrote plain RoPE as YaRN with factor 1."""
    if config.get("hidden_act", "silu") != "silu" or config.get("bias"):
        raise ValueError("MLA draft config with a hidden_act other than silu or an fc bias: not an eaglet draft")
    top_ids = config.get("eagle_aux_hidden_state_layer_ids")
    eagle_ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = [int(i) for i in top_ids] if top_ids else ([int(i) + 1 for i in eagle_ids] if eagle_ids else None)
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    target_hidden = int(config.get("target_hidden_size") or hidden)
    theta, scaling = target_rope(SimpleNamespace(**config))
    nope, rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
    cfg = DraftConfig(
        hidden_size=hidden, target_hidden_size=target_hidden, num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=nope + rope, intermediate_size=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
        draft_vocab_size=int(config.get("draft_vocab_size") or config["vocab_size"]),
        rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6), rope_theta=theta,
        rope_scaling=None if is_plain_rope(scaling) else scaling,
        max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
        num_layers=int(config.get("num_hidden_layers", 1)), num_aux=_num_aux(weights, target_hidden, ids),
        fc_norm=bool(config.get("fc_norm", False)), norm_output=bool(config.get("norm_output", False)),
        norm_before_residual=bool(config.get("norm_before_residual", False)),  # both engines' default here
        attention="mla", mla_heads=heads, q_lora_rank=int(config.get("q_lora_rank") or 0),
        kv_lora_rank=int(config["kv_lora_rank"]), qk_nope_head_dim=nope, qk_rope_head_dim=rope,
        v_head_dim=int(config["v_head_dim"]),
    )
    meta = {"aux_layer_ids": ids, "verifier_name_or_path": None, "verifier_architectures": [],
            "num_speculative_tokens": None}
    return cfg, meta


def _llama_draft_config(c: dict[str, Any], **fields: Any) -> DraftConfig:
    """DraftConfig from a LlamaConfig dict (either spelling of RoPE) plus eagle fields."""
    unsupported = {
        f"hidden_act {c.get('hidden_act')!r}": c.get("hidden_act", "silu") != "silu",
        "mlp_bias": bool(c.get("mlp_bias")),
        "an fc bias": bool(c.get("bias")),
    }
    bad = [what for what, is_bad in unsupported.items() if is_bad]
    if bad:
        raise ValueError(f"draft config has {', '.join(bad)}: not an eaglet (Llama, SwiGLU, no-bias) draft")
    heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    theta, scaling = target_rope(SimpleNamespace(**c))
    return DraftConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or hidden // heads),
        intermediate_size=int(c["intermediate_size"]),
        vocab_size=int(c["vocab_size"]),
        rms_norm_eps=float(c.get("rms_norm_eps") or 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(c.get("max_position_embeddings") or 4096),
        attention_bias=bool(c.get("attention_bias", False)),
        **fields,
    )


def _num_aux(weights: dict[str, Tensor], target_hidden: int, ids: list[int] | None) -> int:
    fc = weights.get("fc.weight")
    if fc is None:
        raise ValueError("checkpoint has no fc.weight")
    n, rem = divmod(int(fc.shape[1]), target_hidden)
    if rem or (ids and len(ids) != n):
        raise ValueError(f"fc.weight {tuple(fc.shape)} does not take {len(ids) if ids else 'k'} states "
                         f"of width target_hidden_size={target_hidden}")
    return n


def _map_back(
    cfg: DraftConfig, weights: dict[str, Tensor], fmt: str, folder: Path
) -> tuple[dict[str, Tensor], list[str]]:
    """Rename checkpoint tensors to eaglet's names (either format's spelling of layer 0: vLLM's
    loader also reads `midlayer.`), checking names and shapes against Eagle3Draft(cfg).
    Errors name tensors as `fmt` names them."""
    shapes = draft_shapes(cfg)
    ours = {CHECKPOINT_NAME[fmt](name): name for fmt in FORMATS for name in shapes}
    unexpected = sorted(k for k in weights if k not in ours)
    state = {ours[k]: t for k, t in weights.items() if k in ours}
    if cfg.draft_vocab_size == cfg.vocab_size and not ({"d2t", "t2d"} & set(state)):
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    missing = [n for n in shapes if n not in state]
    rename = CHECKPOINT_NAME[fmt]
    required = [rename(n) for n in missing if n != "embed_tokens.weight"]
    wrong = [f"{rename(n)} {tuple(t.shape)} (expected {shapes[n]})"
             for n, t in state.items() if tuple(t.shape) != shapes[n]]
    if required or unexpected or wrong:
        parts = [f"missing {required}" if required else "", f"unexpected {unexpected}" if unexpected else "",
                 f"wrong shapes {wrong}" if wrong else ""]
        raise ValueError(f"{folder}: weights do not match the draft its config.json describes: "
                         + "; ".join(p for p in parts if p))
    return {n: state[n] for n in shapes if n in state}, missing
