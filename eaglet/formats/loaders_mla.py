"""What vLLM's and SGLang's loaders of an EAGLE-3 draft with MLA layers (Eagle3DeepseekV2ForCausalLM)
read from an export, written down as data as loaders.py writes down the Llama ones (same rules:
a tensor the loader would not load, a parameter it needs that no tensor fills, every shard of a
fused one, a missing d2t, a key it reads that is missing, an fc of the wrong width).

    vllm_mla_problems(folder) -> list[str]     # vLLM 0.25.0's Eagle3DeepseekV2ForCausalLM (VLLM_MLA_SOURCE)
    sglang_mla_problems(folder) -> list[str]   # SGLang's Eagle3DeepseekV2ForCausalLM (SGLANG_MLA_SOURCE)

loaders.py's EAGLE-3 rows call these for an export whose architectures name the class
(`is_mla_export`). What eaglet writes for them: eaglet/draft/eagle3/serving_mla.py.

Besides the Llama loaders' silent failures these loaders have their own:
- model_type: vLLM reads the config by it. kimi_k2 is a DeepseekV3Config
  (transformers_utils/config.py); deepseek_v3 and deepseek_v32 are rewritten by
  SpeculativeConfig.hf_config_override into DeepSeek's MTP model (DeepSeekMTPModel), which then
  loads none of the draft.
- q_lora_rank: a key left out reads as DeepseekV3Config's 1536; null is a plain q_proj, which
  vLLM 0.25's mapper cannot load (it stacks kv_a_proj_with_mqa into fused_qkv_a_proj
  regardless) and SGLang's layer cannot run (its forward reads fused_qkv_a_proj_with_mqa).
- RoPE: both layers turn the rope dict they read into deepseek_yarn whenever it is non-empty
  and read its factor and original_max_position_embeddings. transformers 5 gives every config
  a non-empty one ({"rope_type": "default", "rope_theta": ...} for plain RoPE; `rope_scaling`
  wins over `rope_parameters`), so a rope without them fails (KeyError 'factor'), and any rope
  type but yarn is computed as YaRN.
- the aux ids: vLLM reads the top-level eagle_aux_hidden_state_layer_ids (HF indices) first,
  else eagle_config's, which are SGLang's layer outputs (one less); SGLang reads eagle_config's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .loaders_common import (VLLM_VERSION, ParamMap, Shards, Target, config_value, d2t_problem, fc_problem,
                             match_weights, read_config, tensor_shapes)

VLLM_MLA_SOURCE = (
    "vLLM 0.25.0 vllm/model_executor/models/deepseek_eagle3.py (Eagle3DeepseekV2ForCausalLM.load_weights, "
    "DeepseekV2Eagle3Model.hf_to_vllm_mapper) with deepseek_v2.py (DeepseekV2MLAAttention), models/utils.py "
    "(WeightsMapper, AutoWeightsLoader), transformers_utils/config.py (kimi_k2) and config/speculative.py "
    "(hf_config_override, EAGLEConfig)"
)
SGLANG_MLA_SOURCE = (
    "sglang python/sglang/srt/models/deepseek_eagle3.py (Eagle3DeepseekV2ForCausalLM.load_weights) at commit "
    "5da6caea1ffb55813372e18045c509c9e181a97f, with deepseek_v2.py (DeepseekV2AttentionMLA's rope, "
    "set_eagle3_layers_to_capture: id + 1), read from the public source, not a release wheel"
)
MLA_ARCHS = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")  # one class in both engines
VLLM_MODEL_TYPE = "kimi_k2"
MTP_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")  # vLLM serves these as an MTP model instead
SGLANG_MODEL_TYPES = ("kimi_k2", "deepseek_v3", "deepseek_v32")  # DeepseekV3Config in SGLang (configs/__init__.py)
DEEPSEEK_V3_Q_LORA_RANK = 1536  # DeepseekV3Config's default, what a missing q_lora_rank reads as

# The DeepseekV3Config keys both layers are built from (a missing one is DeepSeek-V3's default).
MLA_KEYS = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "hidden_act",
            "rms_norm_eps", "vocab_size", "max_position_embeddings", "draft_vocab_size", "target_hidden_size")
VLLM_MLA_KEYS = (*MLA_KEYS, "num_aux_hidden_states")
SGLANG_MLA_KEYS = (*MLA_KEYS, "eagle_config.eagle_aux_hidden_state_layer_ids")

# vLLM: checkpoint name fragment -> (its parameter's fragment, shard) (hf_to_vllm_mapper, applied to every name).
VLLM_MLA_STACKED = {".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1),
                    ".q_a_proj": (".fused_qkv_a_proj", 0), ".kv_a_proj_with_mqa": (".fused_qkv_a_proj", 1)}
VLLM_MLA_SHARDS: Shards = {".fused_qkv_a_proj": (0, 1), ".gate_up_proj": (0, 1)}
# SGLang: gate/up stacked; q_a_proj and kv_a_proj_with_mqa concatenated in that order when both arrived.
SGLANG_MLA_STACKED = {".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}
SGLANG_FUSED = "fused_qkv_a_proj_with_mqa"
SGLANG_MLA_SHARDS: Shards = {f".{SGLANG_FUSED}": ("q_a_proj", "kv_a_proj_with_mqa"), ".gate_up_proj": (0, 1)}
LAYER = ("self_attn.kv_a_layernorm", "self_attn.kv_b_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj",
         "input_layernorm", "post_attention_layernorm")


def is_mla_export(config: dict[str, Any]) -> bool:
    """Whether a config.json is an MLA draft's: its architectures name Eagle3DeepseekV2ForCausalLM."""
    return bool(set(config.get("architectures") or []) & set(MLA_ARCHS))


def q_lora_rank(config: dict[str, Any]) -> int | None:
    """The q_lora_rank a DeepseekV3Config reads from config.json (None: a plain q_proj)."""
    return config["q_lora_rank"] if "q_lora_rank" in config else DEEPSEEK_V3_Q_LORA_RANK


def transformers_rope(config: dict[str, Any]) -> dict[str, Any]:
    """The rope dict transformers 5 gives the config (`config.rope_scaling`, = rope_parameters):
    rope_scaling if set, else rope_parameters, with the top-level rope_theta and rope_type default."""
    rope = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def rope_problems(config: dict[str, Any], engine: str) -> list[str]:
    """What the layer's deepseek_yarn makes of the export's rope (module doc)."""
    rope = transformers_rope(config)
    missing = [k for k in ("factor", "original_max_position_embeddings") if rope.get(k) is None]
    if missing:
        return [f"config.json rope {rope}: {engine}'s {MLA_ARCHS[0]} computes any rope as deepseek_yarn, which reads "
                f"{' and '.join(missing)} (KeyError); plain RoPE is YaRN with factor 1 there"]
    if rope["rope_type"] not in ("yarn", "deepseek_yarn"):
        return [f"config.json rope_type {rope['rope_type']!r}: {engine}'s {MLA_ARCHS[0]} computes it as DeepSeek's YaRN"]
    return []


def _common_problems(config: dict[str, Any], keys: tuple[str, ...], engine: str) -> list[str]:
    p = [f"config.json has no {k!r}, which {engine} reads" for k in keys if config_value(config, k) is None]
    if "q_lora_rank" not in config:
        p.append(f"config.json has no 'q_lora_rank' (null for a plain q_proj): {engine} reads it as DeepSeek-V3's "
                 f"{DEEPSEEK_V3_Q_LORA_RANK}")
    if config.get("rope_theta") is None and config_value(config, "rope_parameters.rope_theta") is None:
        p.append(f"config.json has neither 'rope_theta' nor 'rope_parameters', which {engine} reads")
    if config.get("architectures") and not is_mla_export(config):
        p.append(f"config.json architectures {config['architectures']} does not name {MLA_ARCHS[0]}")
    if config.get("hidden_act", "silu") != "silu":
        p.append(f"config.json hidden_act {config['hidden_act']!r}: {engine}'s DeepseekV2MLP takes silu only")
    return p + rope_problems(config, engine)


def _stacked(name: str, table: dict[str, tuple[str, Any]]) -> tuple[str, Any]:
    shard = None
    for fragment, (fused, part) in table.items():
        if fragment in name:
            name, shard = name.replace(fragment, fused, 1), part
    return name, shard


# ---- vLLM ---------------------------------------------------------------------------------------


def vllm_num_aux(config: dict[str, Any]) -> int:
    """fc's number of states in DeepseekV2Eagle3Model: num_aux_hidden_states, else eagle_config's ids, else 3."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return int(config.get("num_aux_hidden_states") or (len(ids) if ids else 3))


def vllm_mla_parameters(config: dict[str, Any]) -> ParamMap:
    """The parameters of vLLM's Eagle3DeepseekV2ForCausalLM built from `config`: embed_tokens
    optional (the target's is shared when the checkpoint has none), fc (fc_norm.{i} with fc_norm),
    per layer the MLA projections (fused_qkv_a_proj, q_a_layernorm, q_b_proj with a q_lora_rank;
    kv_a_proj_with_mqa and q_proj without), kv_a_layernorm, kv_b_proj, o_proj, gate_up_proj,
    down_proj and both norms, hidden_norm (every layer has one; layer 0 alone reads it), norm,
    lm_head. d2t goes into draft_id_to_target_id."""
    p: ParamMap = {"model.embed_tokens.weight": False, "model.fc.weight": True, "model.norm.weight": True,
                   "lm_head.weight": True}
    if config.get("fc_norm"):
        p.update({f"model.fc_norm.{i}.weight": True for i in range(vllm_num_aux(config))})
    attention = (("self_attn.fused_qkv_a_proj", "self_attn.q_a_layernorm", "self_attn.q_b_proj")
                 if q_lora_rank(config) is not None else ("self_attn.kv_a_proj_with_mqa", "self_attn.q_proj"))
    for i in range(int(config.get("num_hidden_layers") or 1)):
        pre = f"model.layers.{i}."
        p.update({f"{pre}{name}.weight": True for name in (*attention, *LAYER)})
        p[f"{pre}hidden_norm.weight"] = i == 0
    return p


def vllm_mla_target(name: str, params: ParamMap) -> Target:
    """Where Eagle3DeepseekV2ForCausalLM.load_weights puts checkpoint tensor `name`: t2d is dropped,
    d2t becomes draft_id_to_target_id, every other name but lm_head goes under `model.`, whose
    mapper reads `midlayer.` as `layers.0.` and stacks VLLM_MLA_STACKED."""
    if "t2d" in name or "rotary_emb.inv_freq" in name:
        return "ignored"
    if "d2t" in name:
        return "d2t"
    if "lm_head" not in name:
        name = "model." + name.replace("midlayer.", "layers.0.", 1)
    name, shard = _stacked(name, VLLM_MLA_STACKED)
    return (name, shard) if name in params else None


def vllm_mla_problems(folder: str | Path) -> list[str]:
    """Everything in the MLA export `folder` that vLLM's Eagle3DeepseekV2ForCausalLM (VLLM_MLA_SOURCE)
    would refuse, miss or read as a default; [] when it loads all of it as written."""
    engine = f"vLLM {VLLM_VERSION}"
    config, shapes = read_config(folder), tensor_shapes(folder)
    p = _common_problems(config, VLLM_MLA_KEYS, engine)
    if config.get("eagle_aux_hidden_state_layer_ids") is None:
        p.append(f"config.json has no top-level 'eagle_aux_hidden_state_layer_ids': {engine} would capture "
                 "eagle_config's ids, SGLang's layer outputs (one less), or its default [2, L//2, L-3]")
    model_type = config.get("model_type")
    if model_type in MTP_MODEL_TYPES:
        p.append(f"config.json model_type {model_type!r}: {engine} rewrites it to deepseek_mtp and serves "
                 f"DeepSeekMTPModel, not the draft (eaglet writes {VLLM_MODEL_TYPE}, a DeepseekV3Config there)")
    elif model_type is not None and model_type != VLLM_MODEL_TYPE:
        p.append(f"config.json model_type {model_type!r}: {engine} reads an MLA draft's config as a DeepseekV3Config "
                 f"under {VLLM_MODEL_TYPE}")
    if q_lora_rank(config) is None:
        p.append(f"config.json q_lora_rank null (a plain q_proj): {engine}'s mapper stacks kv_a_proj_with_mqa into "
                 "fused_qkv_a_proj, which such a layer lacks (ValueError at load)")
    matched, d2t, _ = match_weights(shapes, vllm_mla_parameters(config), vllm_mla_target, engine, VLLM_MLA_SHARDS)
    p += matched + d2t_problem(d2t, config.get("draft_vocab_size"), config.get("vocab_size"), engine)
    hidden = config.get("hidden_size")
    if isinstance(hidden, int):
        p += fc_problem(shapes, vllm_num_aux(config), int(config.get("target_hidden_size") or hidden), engine)
    return p


# ---- SGLang -------------------------------------------------------------------------------------


def sglang_mla_parameters(config: dict[str, Any]) -> ParamMap:
    """The parameters of SGLang's Eagle3DeepseekV2ForCausalLM built from `config`: its one layer is
    `model.midlayer` (MLA projections as vLLM's, q_a_proj and kv_a_proj_with_mqa fused into
    fused_qkv_a_proj_with_mqa), embed_tokens optional (shared from the target), fc (its bias with
    config `bias`), norm, lm_head unless tie_word_embeddings."""
    p: ParamMap = {"model.embed_tokens.weight": False, "model.fc.weight": True, "model.norm.weight": True}
    if config.get("bias"):
        p["model.fc.bias"] = True
    attention = ((f"self_attn.{SGLANG_FUSED}", "self_attn.q_a_layernorm", "self_attn.q_b_proj")
                 if q_lora_rank(config) is not None else ("self_attn.q_proj", "self_attn.kv_a_proj_with_mqa"))
    p.update({f"model.midlayer.{name}.weight": True for name in (*attention, *LAYER, "hidden_norm")})
    if not config.get("tie_word_embeddings"):
        p["lm_head.weight"] = True
    return p


def sglang_mla_target(name: str, params: ParamMap) -> Target:
    """Where SGLang's load_weights puts checkpoint tensor `name`: `layers.0.` read as `midlayer.`,
    d2t the hot-token map, t2d dropped, gate/up stacked, q_a_proj and kv_a_proj_with_mqa the two
    halves of fused_qkv_a_proj_with_mqa (with a q_lora_rank); a name it finds nowhere is skipped."""
    if name.startswith("layers.0."):
        name = name.replace("layers.0.", "midlayer.", 1)
    if "d2t" in name:
        return "d2t"
    if "t2d" in name or "rotary_emb.inv_freq" in name:
        return "ignored"
    name, shard = _stacked(name, SGLANG_MLA_STACKED)
    fused = any(SGLANG_FUSED in p for p in params)
    if fused and shard is None and ("q_a_proj" in name or "kv_a_proj_with_mqa" in name):
        shard = "q_a_proj" if "q_a_proj" in name else "kv_a_proj_with_mqa"
        name = name.replace(shard, SGLANG_FUSED)
    full = name if name in params else f"model.{name}"
    return (full, shard) if full in params else None


def sglang_mla_problems(folder: str | Path) -> list[str]:
    """Everything in the MLA export `folder` that SGLang's Eagle3DeepseekV2ForCausalLM (SGLANG_MLA_SOURCE)
    would skip, miss, refuse or read as a default; [] when it loads all of it as written."""
    engine = "SGLang"
    config, shapes = read_config(folder), tensor_shapes(folder)
    p = _common_problems(config, SGLANG_MLA_KEYS, engine)
    if config.get("model_type") not in (None, *SGLANG_MODEL_TYPES):
        p.append(f"config.json model_type {config['model_type']!r}: {engine} reads an MLA draft's config as a "
                 f"DeepseekV3Config under {' or '.join(SGLANG_MODEL_TYPES)}")
    if int(config.get("num_hidden_layers") or 1) != 1:
        p.append(f"config.json num_hidden_layers {config['num_hidden_layers']}: {engine}'s {MLA_ARCHS[0]} has one "
                 "layer (it raises)")
    if q_lora_rank(config) is None:
        p.append(f"config.json q_lora_rank null (a plain q_proj): {engine}'s layer reads {SGLANG_FUSED}, which such a "
                 "layer lacks")
    p += [f"config.json {key} is true: {engine}'s deepseek_eagle3 has no {key} and would serve the draft without it"
          for key in ("fc_norm", "norm_output", "norm_before_residual") if config.get(key)]
    if config.get("tie_word_embeddings"):
        p.append(f"config.json tie_word_embeddings is true: {engine} makes lm_head the embedding and drops the "
                 "draft's own lm_head.weight")
    matched, d2t, _ = match_weights(shapes, sglang_mla_parameters(config), sglang_mla_target, engine,
                                    SGLANG_MLA_SHARDS)
    p += matched + d2t_problem(d2t, config.get("draft_vocab_size"), config.get("vocab_size"), engine)
    hidden, ids = config.get("hidden_size"), config_value(config, "eagle_config.eagle_aux_hidden_state_layer_ids")
    if isinstance(hidden, int):
        p += fc_problem(shapes, len(ids) if ids else 3, int(config.get("target_hidden_size") or hidden), engine)
    return p


def sglang_capture_layers(config: dict[str, Any]) -> list[int] | None:
    """The HF hidden_states indices SGLang's DeepSeek-V2/V3 target captures for this draft: eagle_config's
    ids + 1 (set_eagle3_layers_to_capture); None: its default."""
    ids = config_value(config, "eagle_config.eagle_aux_hidden_state_layer_ids")
    return [int(i) + 1 for i in ids] if ids else None
