"""The export of an EAGLE-3 draft whose layers are MLA (config.attention "mla", mla.py): the
config.json that vLLM's and SGLang's Eagle3DeepseekV2ForCausalLM read. serving.py writes it, with
the weights under eaglet's own names, for either format; read_export.py reads it back.

One export serves both engines, so the "vllm" and "sglang" exports of an MLA draft are the same
files (only which drafts each format refuses differs: `mla_export_problems`).

- vLLM 0.25 (models/deepseek_eagle3.py): not the speculators format (its eagle3 path builds only
  Llama and Qwen3 layers) but a flat config whose architectures name Eagle3DeepseekV2ForCausalLM,
  read as a DeepseekV3Config under model_type kimi_k2 (transformers_utils/config.py). Not
  deepseek_v3: SpeculativeConfig.hf_config_override turns a draft of that model_type into
  DeepSeek's MTP module. Its loader prefixes `model.` to every name but lm_head, reads
  `midlayer.` as `layers.0.`, stacks q_a_proj and kv_a_proj_with_mqa into fused_qkv_a_proj
  (shards 0, 1) and gate/up into gate_up_proj. The target captures before the top-level
  eagle_aux_hidden_state_layer_ids (eaglet's HF hidden_states indices, unchanged); fc takes
  num_aux_hidden_states states of target_hidden_size; fc_norm, norm_output and
  norm_before_residual (missing: false) are read as the dense draft's are.
- SGLang (models/deepseek_eagle3.py): the same config (SGLang also registers kimi_k2 as a
  DeepseekV3Config); one layer, read under `layers.0.` or `midlayer.`; q_a_proj and
  kv_a_proj_with_mqa concatenated into fused_qkv_a_proj_with_mqa; eagle_config ids are layer
  outputs, id - 1 (DeepSeek-V2's set_eagle3_layers_to_capture adds 1), as the Llama export writes
  them; fc's width from their count; no fc_norm, norm_output or norm_before_residual.
- RoPE: both engines' layer turns any rope dict it reads into DeepSeek's YaRN (deepseek_yarn)
  and reads its factor, and transformers 5 gives every config one ({"rope_type": "default",
  ...} for plain RoPE). So a plain-RoPE draft is written as YaRN with factor 1, which computes
  plain RoPE exactly (interpolated and extrapolated frequencies are the same, every mscale is
  1); a YaRN draft's rope is written with the keys those engines read (factor,
  original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim), checked to
  give eaglet's own frequencies, cos/sin factor and softmax factor; linear or llama3 scaling has
  no deepseek_yarn form and is refused.
- No MoE keys: the engines' Eagle3DeepseekV2 layer always builds a dense MLP and reads none of
  them (DeepseekV3Config's defaults stand in for the absent keys).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..layers import rope_inv_freq, rope_type
from .mla import softmax_factor
from .model import DraftConfig

MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
MLA_ARCHITECTURES = (MLA_ARCHITECTURE, "Eagle3DeepseekV3ForCausalLM")  # both engines register both for one class
MLA_MODEL_TYPE = "kimi_k2"


def is_mla_config(config: dict[str, Any]) -> bool:
    """Whether an export's config.json is an MLA draft's (its architectures name the class)."""
    return bool(set(config.get("architectures") or []) & set(MLA_ARCHITECTURES))


def deepseek_rope(cfg: DraftConfig) -> tuple[dict[str, Any] | None, str | None]:
    """(the rope dict the export writes, None) or (None, why the draft's RoPE has no DeepSeek-YaRN
    form that computes it). Module doc: plain RoPE becomes YaRN with factor 1."""
    kind = rope_type(cfg.rope_scaling)
    if kind == "default":
        return {"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": cfg.max_position_embeddings,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}, None
    if kind != "yarn":
        return None, (f"rope_type {kind}: the engines' {MLA_ARCHITECTURE} computes every RoPE as DeepSeek's YaRN, "
                      f"which has no {kind} scaling (train a dense draft: train.draft_attention dense)")
    s = dict(cfg.rope_scaling or {})
    old = int(s["original_max_position_embeddings"])
    m, m_all = s.get("mscale"), s.get("mscale_all_dim")
    written = {"rope_type": "yarn", "factor": float(s.get("factor") or cfg.max_position_embeddings / old),
               "original_max_position_embeddings": old, "beta_fast": s.get("beta_fast") or 32,
               "beta_slow": s.get("beta_slow") or 1, "mscale": float(m) if m and m_all else 1.0,
               "mscale_all_dim": float(m_all or 0.0)}
    ours = rope_inv_freq(cfg.rope_dim, cfg.rope_theta, s, cfg.max_position_embeddings)
    theirs = rope_inv_freq(cfg.rope_dim, cfg.rope_theta, written, cfg.max_position_embeddings)
    if not (torch.equal(ours[0], theirs[0]) and math.isclose(ours[1], theirs[1], rel_tol=1e-12)
            and math.isclose(softmax_factor(s), softmax_factor(written), rel_tol=1e-12)):
        return None, (f"YaRN rope {s}: its frequencies, cos/sin factor or softmax factor have no form in the keys "
                      f"DeepSeek's YaRN reads ({', '.join(k for k in written if k != 'rope_type')})")
    return written, None


def is_plain_rope(scaling: dict[str, Any] | None) -> bool:
    """Whether a rope dict read back computes plain RoPE: none, default, or YaRN with factor 1 and no
    attention factor of its own (what `deepseek_rope` writes for plain RoPE)."""
    kind, scaling = rope_type(scaling), scaling or {}
    return kind == "default" or (kind == "yarn" and float(scaling.get("factor") or 0) == 1.0
                                 and scaling.get("attention_factor") is None)


def mla_export_problems(cfg: DraftConfig, fmt: str, ids: list[int]) -> list[str]:
    """Why an MLA draft cannot be exported in `fmt` as the engines load it (module doc); [] when it can."""
    p = []
    if any(i < 1 for i in ids):
        p.append(f"aux layer ids {ids}: the MLA export also writes SGLang's ids (id - 1, a layer output); 0 has none")
    if not cfg.q_lora_rank:
        p.append("q_lora_rank 0 (a plain q_proj): vLLM 0.25 stacks kv_a_proj_with_mqa into fused_qkv_a_proj, which "
                 "such a layer lacks, and SGLang's layer reads fused_qkv_a_proj_with_mqa (set train.mla_q_lora_rank)")
    problem = deepseek_rope(cfg)[1]
    if problem:
        p.append(problem)
    if fmt == "sglang":
        unsupported = {f"num_layers={cfg.num_layers} (its one layer)": cfg.num_layers != 1, "fc_norm": cfg.fc_norm,
                       "norm_output": cfg.norm_output, "norm_before_residual": cfg.norm_before_residual}
        p += [f"SGLang's deepseek_eagle3 has no {what}" for what, bad in unsupported.items() if bad]
    return p


def mla_config(cfg: DraftConfig, ids: list[int], dtype_name: str) -> dict[str, Any]:
    """The config.json of the MLA export (module doc), the same for both formats."""
    rope, problem = deepseek_rope(cfg)
    if rope is None:
        raise ValueError(problem)
    return {
        "architectures": [MLA_ARCHITECTURE],
        "model_type": MLA_MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.mla_heads,
        "num_key_value_heads": cfg.mla_heads,
        "q_lora_rank": cfg.q_lora_rank or None,  # null: a plain q_proj (absent would read as DeepSeek-V3's 1536)
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope,
        "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
        "rope_interleave": True,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "num_aux_hidden_states": cfg.num_aux,
        "eagle_aux_hidden_state_layer_ids": ids,  # vLLM: HF hidden_states indices, read first
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True},
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "norm_before_residual": cfg.norm_before_residual,
        "torch_dtype": dtype_name,
    }
