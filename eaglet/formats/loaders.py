"""What vLLM's and SGLang's EAGLE-3 loaders read from an export, and the commands that serve it
(P-EAGLE's too: vLLM's same loader with parallel drafting; SGLang has none).

    sglang_problems(folder) -> list[str]    # against SGLang's LlamaForCausalLMEagle3 (SGLANG_SOURCE)
    vllm_problems(folder) -> list[str]      # against vLLM's Eagle3LlamaForCausalLM (VLLM_SOURCE)
    PROBLEMS["eagle3"][fmt](folder)         # either, or an MLA draft's loader (loaders_mla.py)
    serve_commands("eagle3", target, {"vllm": folder, ...}, k) -> {"vllm": "vllm serve ...", "sglang": "python -m ..."}

Each loader's rows are keyed by the draft type they load (PROBLEMS, ENGINES, SERVE_COMMANDS:
its train.algorithm name), so that another draft type adds its own beside EAGLE-3's.

Neither engine runs on the machines eaglet is tested on, so each loader is written down here as
data, read from its source at a pinned release: the config keys it reads, the rename it applies
to a checkpoint name, and the parameters its module has for a given config. A loader matches
each checkpoint tensor to a parameter by that rename. SGLang skips a tensor that matches none
without a word (vLLM raises on most); both leave a parameter that no tensor fills as it was
made: without a `d2t`, vLLM reads draft id i as target id i and SGLang has no hot-token map, so
acceptance collapses while everything runs. A config key left out is filled by transformers'
LlamaConfig default, again without a word. So the checks fail on: a tensor the loader would not
load, a parameter it needs that no tensor fills (every shard of a stacked one: q/k/v,
gate/up), a missing d2t, a key it reads that is missing, and an fc whose width is not the one
the loader builds from the config.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors import safe_open

from .loaders_common import (CONFIG_FILE, VLLM_VERSION, WEIGHTS_FILE, WEIGHTS_INDEX, ParamMap,  # noqa: F401
                             Target, d2t_problem, fc_problem, match_weights, read_config, tensor_shapes)
from .loaders_common import config_value
from .loaders_mla import is_mla_export, sglang_mla_problems, vllm_mla_problems

SGLANG_VERSION = "0.5.23"
SGLANG_SOURCE = (
    "sglang v0.5.23 python/sglang/srt/models/llama_eagle3.py (LlamaForCausalLMEagle3.load_weights), read from the PyPI "
    "wheel sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl, sha256 "
    "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937 (its sglang/_version.py records no commit id)"
)
VLLM_SOURCE = (
    "vLLM 0.25.0 vllm/model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM.load_weights) after "
    "vllm/transformers_utils/configs/speculators/algos.py (update_eagle3) turns the speculators config into its config"
)

# (name fragment, the stacked parameter it goes into, its shard): both loaders.
STACKED = ((".q_proj", ".qkv_proj", "q"), (".k_proj", ".qkv_proj", "k"), (".v_proj", ".qkv_proj", "v"),
           (".gate_proj", ".gate_up_proj", 0), (".up_proj", ".gate_up_proj", 1))
SHARDS = {".qkv_proj": ("q", "k", "v"), ".gate_up_proj": (0, 1)}

# The LlamaConfig keys both loaders build the draft's layers from. Any left out is filled by
# transformers' default (hidden_size 4096, rms_norm_eps 1e-6, head_dim hidden // heads, ...).
LLAMA_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "num_hidden_layers", "vocab_size", "rms_norm_eps", "hidden_act", "max_position_embeddings")
# SGLang reads these beside them; the aux ids decide which target layers it captures.
SGLANG_KEYS = (*LLAMA_KEYS, "architectures", "draft_vocab_size", "target_hidden_size",
               "eagle_config.eagle_aux_hidden_state_layer_ids")
SGLANG_ARCH = "LlamaForCausalLMEagle3"
# vLLM reads the speculators config's top level beside transformer_layer_config's LlamaConfig;
# a missing norm_before_residual reads as true there.
VLLM_KEYS = ("speculators_model_type", "draft_vocab_size", "target_hidden_size", "norm_before_residual",
             "eagle_aux_hidden_state_layer_ids", "speculators_config.proposal_methods.0.speculative_tokens",
             "speculators_config.verifier.name_or_path", *(f"transformer_layer_config.{k}" for k in LLAMA_KEYS))
# vLLM's peagle path (update_peagle) reads these too: mask_token_id is required (its pard_token).
PEAGLE_KEYS = ("mask_token_id",)

# ---- what these loaders share ------------------------------------------------------------------


def _missing_keys(config: dict[str, Any], keys: tuple[str, ...], engine: str) -> list[str]:
    out = [f"config.json has no {k!r}, which {engine} reads" for k in keys if config_value(config, k) is None]
    tl = config.get("transformer_layer_config") if "speculators_model_type" in config else config
    if isinstance(tl, dict) and tl.get("rope_theta") is None and config_value(tl, "rope_parameters.rope_theta") is None:
        where = "transformer_layer_config." if tl is not config else ""
        out.append(f"config.json has neither {where}'rope_theta' nor {where}'rope_parameters', which {engine} reads")
    return out


def _match(shapes: dict[str, tuple[int, ...]], params: ParamMap, target: Callable[[str, ParamMap], Target],
           engine: str) -> tuple[list[str], set[str]]:
    """(problems, the tensors that are d2t) of matching each tensor to `params` by `target` (the
    Llama loaders' fused parameters: q/k/v, gate/up)."""
    problems, d2t, _ = match_weights(shapes, params, target, engine, SHARDS)
    return problems, d2t


def _stacked(name: str) -> tuple[str, Any]:
    for fragment, param, shard in STACKED:
        if fragment in name:
            return name.replace(fragment, param), shard
    return name, None


# ---- SGLang -------------------------------------------------------------------------------------

# SGLang's rename of legacy names, applied first (its load_weights' legacy_name_map).
SGLANG_LEGACY = {"midlayer": "layers.0", "aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1",
                 "aux_norm_high": "fc_norm.2"}


def sglang_parameters(config: dict[str, Any]) -> ParamMap:
    """The parameters of SGLang's LlamaForCausalLMEagle3 built from `config` (a config.json dict).

    embed_tokens is optional: SGLang replaces it by the target's (set_embed) unless
    target_hidden_size differs from hidden_size. Layer 0 normalises the embedding with
    input_layernorm and the hidden state with hidden_norm; a later layer adds the residual
    and normalises with hidden_norm alone, so its input_layernorm is never read."""
    eagle = config.get("eagle_config") or {}
    hidden = config.get("hidden_size")
    target_hidden = config.get("target_hidden_size", hidden)
    p: ParamMap = {"model.embed_tokens.weight": target_hidden != hidden, "model.fc.weight": True,
                   "model.norm.weight": True}
    if config.get("bias"):
        p["model.fc.bias"] = True
    if eagle.get("norm_before_fc", config.get("norm_before_fc", False)):
        p["model.input_norm.weight"] = True
    if config.get("fc_norm") or config.get("use_aux_norm"):
        p.update({f"model.fc_norm.{i}.weight": True for i in range(sglang_num_aux(config))})
    for i in range(int(config.get("num_hidden_layers") or 1)):
        pre = f"model.layers.{i}."
        p.update({pre + "self_attn.qkv_proj.weight": True, pre + "self_attn.o_proj.weight": True,
                  pre + "mlp.gate_up_proj.weight": True, pre + "mlp.down_proj.weight": True,
                  pre + "input_layernorm.weight": i == 0, pre + "hidden_norm.weight": True,
                  pre + "post_attention_layernorm.weight": True})
        if config.get("attention_bias") or config.get("bias"):  # o_proj only: its qkv is built without one
            p[pre + "self_attn.o_proj.bias"] = True
    if not config.get("tie_word_embeddings"):
        p["lm_head.weight"] = True
    return p


def sglang_num_aux(config: dict[str, Any]) -> int:
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return int(config.get("num_aux_hidden_states") or (len(ids) if ids else 3))


def sglang_target(name: str, params: ParamMap) -> Target:
    """Where SGLang's load_weights puts checkpoint tensor `name` (d2t becomes the hot-token map)."""
    for legacy, new in SGLANG_LEGACY.items():
        if legacy in name:
            name = name.replace(legacy, new)
    if "d2t" in name:
        return "d2t"
    if "t2d" in name:
        return "ignored"
    name, shard = _stacked(name)
    param = name if name in params else f"model.{name}"
    return (param, shard) if param in params else None


def sglang_problems(folder: str | Path) -> list[str]:
    """Everything in the export `folder` that SGLang's LlamaForCausalLMEagle3 (SGLANG_SOURCE) would
    skip, miss or read as a default; [] when it loads all of it as written."""
    engine = f"SGLang {SGLANG_VERSION}"
    config, shapes = read_config(folder), tensor_shapes(folder)
    problems = _missing_keys(config, SGLANG_KEYS, engine)
    if config.get("architectures") and SGLANG_ARCH not in config["architectures"]:
        problems.append(f"config.json architectures {config['architectures']} does not name {SGLANG_ARCH}, the "
                        f"class {engine} loads an EAGLE-3 draft with")
    if config.get("model_type", "llama") != "llama":
        problems.append(f"config.json model_type {config['model_type']!r}: {SGLANG_ARCH} reads a LlamaConfig")
    if config.get("tie_word_embeddings"):
        problems.append(f"config.json tie_word_embeddings is true: {engine} makes lm_head the embedding and drops "
                        "the draft's own lm_head.weight")
    if (config.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        problems.append(f"config.json eagle_config.use_aux_hidden_state is false: {engine} would feed no target "
                        "states through fc")
    params = sglang_parameters(config)
    matched, d2t = _match(shapes, params, sglang_target, engine)
    hidden = config.get("hidden_size")
    problems += matched + d2t_problem(d2t, config.get("draft_vocab_size"), config.get("vocab_size"), engine)
    if isinstance(hidden, int):
        problems += fc_problem(shapes, sglang_num_aux(config), int(config.get("target_hidden_size", hidden)), engine)
    return problems


# ---- vLLM ---------------------------------------------------------------------------------------


def vllm_draft_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config vLLM builds its Eagle3 draft from: transformer_layer_config plus the speculators
    top-level fields, as vLLM's update_eagle3 copies them (a missing norm_before_residual: true),
    or, for speculators_model_type peagle, as update_peagle does: a missing norm_before_residual
    is false, fc_norm and norm_output are not copied, mask_token_id becomes pard_token, and the
    speculative config gets parallel_drafting (which gives the model its mask_hidden buffer)."""
    parallel = config.get("speculators_model_type") == "peagle"
    c = dict(config.get("transformer_layer_config") or {})
    c["draft_vocab_size"] = config.get("draft_vocab_size")
    if config.get("target_hidden_size") is not None:
        c["target_hidden_size"] = config["target_hidden_size"]
    c["norm_before_residual"] = config.get("norm_before_residual", not parallel)
    c["norm_before_fc"] = config.get("norm_before_fc", False)
    for key in ("fc_norm", "norm_output"):
        c[key] = False if parallel else config.get(key, False)
    if parallel:
        c["pard_token"] = config.get("mask_token_id")
        c["parallel_drafting"] = True
    if config.get("eagle_aux_hidden_state_layer_ids"):
        c["eagle_aux_hidden_state_layer_ids"] = config["eagle_aux_hidden_state_layer_ids"]
    return c


def vllm_num_aux(c: dict[str, Any]) -> int:
    """fc's number of states: num_aux_hidden_states, else eagle_config's ids, else 3. The top-level
    eagle_aux_hidden_state_layer_ids decide which layers the target captures, not this."""
    ids = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return int(c.get("num_aux_hidden_states") or (len(ids) if ids else 3))


def vllm_parameters(c: dict[str, Any]) -> ParamMap:
    """The parameters of vLLM's Eagle3LlamaForCausalLM built from `c` (vllm_draft_config's dict).

    embed_tokens is optional (the target's is shared when the checkpoint has none). d2t goes
    into draft_id_to_target_id, zeros when absent (vllm_problems asks for it). Layer 0
    normalises the embedding with input_layernorm and the hidden state with hidden_norm; a
    later layer normalises its input with input_layernorm and never reads its hidden_norm."""
    eagle = c.get("eagle_config") or {}
    p: ParamMap = {"model.embed_tokens.weight": False, "model.norm.weight": True, "lm_head.weight": True}
    if eagle.get("use_aux_hidden_state", True):
        p["model.fc.weight"] = True
        if eagle.get("norm_before_fc", c.get("norm_before_fc", False)):
            p["model.input_norm.weight"] = True
        if c.get("fc_norm"):
            p.update({f"model.fc_norm.{i}.weight": True for i in range(vllm_num_aux(c))})
    bias = bool(c.get("attention_bias"))
    for i in range(int(c.get("num_hidden_layers") or 1)):
        pre = f"model.layers.{i}."
        p.update({pre + "self_attn.qkv_proj.weight": True, pre + "self_attn.o_proj.weight": True,
                  pre + "mlp.gate_up_proj.weight": True, pre + "mlp.down_proj.weight": True,
                  pre + "input_layernorm.weight": True, pre + "hidden_norm.weight": i == 0,
                  pre + "post_attention_layernorm.weight": True})
        if bias:
            p[pre + "self_attn.qkv_proj.bias"] = True
        if bias or c.get("bias"):
            p[pre + "self_attn.o_proj.bias"] = True
        if c.get("mlp_bias"):
            p.update({pre + "mlp.gate_up_proj.bias": True, pre + "mlp.down_proj.bias": True})
    if c.get("parallel_drafting"):
        p["mask_hidden"] = True  # a buffer load_weights copies into; it refuses a checkpoint without it
    return p


def vllm_target(name: str, params: ParamMap) -> Target:
    """Where vLLM's Eagle3 load_weights puts checkpoint tensor `name`: d2t becomes
    draft_id_to_target_id, t2d is dropped, everything but lm_head goes under `model.`, whose
    loader reads `midlayer.` as `layers.0.` and stacks q/k/v and gate/up."""
    if "t2d" in name:
        return "ignored"
    if "d2t" in name:
        return "d2t"
    if "mask_hidden" in name:  # without parallel drafting, skipped with a warning
        return ("mask_hidden", None) if "mask_hidden" in params else "ignored"
    if "lm_head" not in name:
        name = "model." + name.replace("midlayer.", "layers.0.")
    name, shard = _stacked(name)
    return (name, shard) if name in params else None


def vllm_problems(folder: str | Path, model_type: str = "eagle3") -> list[str]:
    """Everything in the speculators-format export `folder` that vLLM's Eagle3 loader (VLLM_SOURCE)
    would refuse, miss or read as a default; [] when it loads all of it as written. model_type:
    the speculators_model_type the draft type writes ("peagle": parallel drafting, PEAGLE_KEYS
    and a mask_hidden of fc's input width besides)."""
    engine = f"vLLM {VLLM_VERSION}"
    config, shapes = read_config(folder), tensor_shapes(folder)
    parallel = model_type == "peagle"
    problems = _missing_keys(config, VLLM_KEYS + (PEAGLE_KEYS if parallel else ()), engine)
    if config.get("speculators_model_type", model_type) != model_type:
        problems.append(f"config.json speculators_model_type {config['speculators_model_type']!r} is not {model_type}")
    c = vllm_draft_config({**config, "speculators_model_type": model_type})
    if c.get("model_type", "llama") != "llama":
        problems.append(f"transformer_layer_config model_type {c['model_type']!r}: eaglet's drafts are "
                        "Eagle3LlamaForCausalLM")
    matched, d2t = _match(shapes, vllm_parameters(c), vllm_target, engine)
    problems += matched + d2t_problem(d2t, c.get("draft_vocab_size"), c.get("vocab_size"), engine)
    hidden = c.get("hidden_size")
    if isinstance(hidden, int):
        width = vllm_num_aux(c) * int(c.get("target_hidden_size", hidden))
        problems += fc_problem(shapes, vllm_num_aux(c), int(c.get("target_hidden_size", hidden)), engine)
        mask = shapes.get("mask_hidden")
        if parallel and mask is not None and math.prod(mask) != width:
            problems.append(f"weight 'mask_hidden' {mask} holds {math.prod(mask)} values; {engine} copies it into a "
                            f"buffer of fc's input width {width}")
    return problems


# ---- DFlash: vLLM's DFlashQwen3ForCausalLM ------------------------------------------------------

DFLASH_VLLM_SOURCE = (
    "vLLM 0.25.0 vllm/model_executor/models/qwen3_dflash.py (DFlashQwen3ForCausalLM.load_weights, "
    "DFlashQwen3Model.load_weights) after vllm/transformers_utils/configs/speculators/algos.py (update_dflash)"
)
# The speculators dflash keys vLLM reads (speculators/base.py validate_speculators_config,
# algos.py update_dflash) beside transformer_layer_config's Qwen3Config.
DFLASH_VLLM_KEYS = ("speculators_model_type", "draft_vocab_size", "target_hidden_size", "mask_token_id",
                    "aux_hidden_state_layer_ids", "speculators_config.proposal_methods.0.speculative_tokens",
                    "speculators_config.verifier.name_or_path",
                    *(f"transformer_layer_config.{k}" for k in LLAMA_KEYS if k != "model_type"))


def dflash_vllm_parameters(c: dict[str, Any]) -> ParamMap:
    """The parameters of vLLM's DFlashQwen3ForCausalLM for transformer_layer_config `c`: per layer
    qkv_proj (stacked), o_proj, q_norm, k_norm, gate_up_proj (stacked), down_proj and both norms;
    fc, hidden_norm, norm, lm_head; embed_tokens and mask_embedding optional (the target's embedding
    is shared when the checkpoint has none). draft_id_to_target_id exists only for a reduced
    vocabulary (`d2t_problem` asks for d2t then)."""
    p: ParamMap = {"model.embed_tokens.weight": False, "model.mask_embedding": False, "model.fc.weight": True,
                   "model.hidden_norm.weight": True, "model.norm.weight": True, "lm_head.weight": True}
    for i in range(int(c.get("num_hidden_layers") or 1)):
        pre = f"model.layers.{i}."
        p.update({pre + name + ".weight": True for name in (
            "self_attn.qkv_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_up_proj",
            "mlp.down_proj", "input_layernorm", "post_attention_layernorm")})
    return p


def dflash_vllm_target(name: str, params: ParamMap) -> Target:
    """Where DFlashQwen3ForCausalLM.load_weights puts checkpoint tensor `name`: t2d is skipped, d2t
    becomes draft_id_to_target_id, every other name but lm_head goes under `model.`, q/k/v and
    gate/up stacked."""
    if "t2d" in name:
        return "ignored"
    if "d2t" in name:
        return "d2t"
    name, shard = _stacked(name if "lm_head" in name else "model." + name)
    return (name, shard) if name in params else None


def dflash_vllm_problems(folder: str | Path) -> list[str]:
    """Everything in the speculators dflash export `folder` that vLLM's DFlash loader
    (DFLASH_VLLM_SOURCE) would refuse, miss or read as a default; [] when it loads all of it."""
    engine = f"vLLM {VLLM_VERSION}"
    config, shapes = read_config(folder), tensor_shapes(folder)
    problems = _missing_keys(config, DFLASH_VLLM_KEYS, engine)
    if config.get("speculators_model_type") != "dflash":
        problems.append(f"config.json speculators_model_type {config.get('speculators_model_type')!r} is not dflash")
    c = dict(config.get("transformer_layer_config") or {})
    if c.get("model_type", "qwen3") != "qwen3":
        problems.append(f"transformer_layer_config model_type {c['model_type']!r}: vLLM builds DFlash from a Qwen3Config")
    matched, d2t = _match(shapes, dflash_vllm_parameters(c), dflash_vllm_target, engine)
    problems += matched + d2t_problem(d2t, config.get("draft_vocab_size"), c.get("vocab_size"), engine)
    ids = config.get("aux_hidden_state_layer_ids") or []
    if isinstance(c.get("hidden_size"), int) and ids:
        problems += fc_problem(shapes, len(ids), int(config.get("target_hidden_size") or c["hidden_size"]), engine)
    return problems


def peagle_vllm_problems(folder: str | Path) -> list[str]:
    """`vllm_problems` of a P-EAGLE export (speculators_model_type peagle)."""
    return vllm_problems(folder, "peagle")


def eagle3_vllm_problems(folder: str | Path) -> list[str]:
    """`vllm_problems`, or `vllm_mla_problems` (loaders_mla.py) for an MLA draft's export."""
    return (vllm_mla_problems if is_mla_export(read_config(folder)) else vllm_problems)(folder)


def eagle3_sglang_problems(folder: str | Path) -> list[str]:
    """`sglang_problems`, or `sglang_mla_problems` (loaders_mla.py) for an MLA draft's export."""
    return (sglang_mla_problems if is_mla_export(read_config(folder)) else sglang_problems)(folder)


# draft type (its train.algorithm name) -> serving format -> the check of its engine's loader / that loader.
# A draft type adds its rows here with its loaders.
PROBLEMS: dict[str, dict[str, Callable[[str | Path], list[str]]]] = {
    "eagle3": {"vllm": eagle3_vllm_problems, "sglang": eagle3_sglang_problems},
    "dflash": {"vllm": dflash_vllm_problems},
    "peagle": {"vllm": peagle_vllm_problems},  # SGLang has no parallel-drafting EAGLE path
}
ENGINES: dict[str, dict[str, str]] = {
    "eagle3": {"vllm": f"vLLM {VLLM_VERSION}'s Eagle3LlamaForCausalLM (Eagle3DeepseekV2ForCausalLM for an MLA draft)",
               "sglang": f"SGLang {SGLANG_VERSION}'s {SGLANG_ARCH} (SGLang's Eagle3DeepseekV2ForCausalLM for an MLA draft)"},
    "dflash": {"vllm": f"vLLM {VLLM_VERSION}'s DFlashQwen3ForCausalLM"},
    "peagle": {"vllm": f"vLLM {VLLM_VERSION}'s Eagle3LlamaForCausalLM with parallel drafting (PeagleLlamaForCausalLM)"},
}


# ---- the verifier as speculators reads it -------------------------------------------------------

# speculators 0.9.0 (model.py _load_verifier_weights, utils/loading.py load_model_layers): loading
# a speculators draft also opens the checkpoint of speculators_config.verifier.name_or_path and
# takes the tensor named embed_tokens.weight, or one whose name ends in it (a tied target's
# single model.embed_tokens.weight), or one of these aliases; none raises KeyError. lm_head
# falls back to the embedding when absent (a tied target).
SPECULATORS_EMBED_NAMES = ("embed_tokens.weight", "tok_embeddings.weight", "llm.embed.weight",
                           "backbone.embeddings.weight")


def speculators_verifier_problem(folder: str | Path) -> str | None:
    """Why speculators 0.9.0 could not load a draft whose verifier is the local `folder`, or None."""
    folder = Path(folder)
    if (folder / WEIGHTS_INDEX).is_file():
        names = list(json.loads((folder / WEIGHTS_INDEX).read_text())["weight_map"])
    elif (folder / WEIGHTS_FILE).is_file():
        with safe_open(str(folder / WEIGHTS_FILE), framework="pt", device="cpu") as f:
            names = list(f.keys())
    else:
        return f"{folder} has no {WEIGHTS_FILE} or {WEIGHTS_INDEX}, where speculators reads the target's embedding"
    if any(n.endswith(alias) for n in names for alias in SPECULATORS_EMBED_NAMES):
        return None
    return (f"{folder}'s checkpoint has no tensor named *embed_tokens.weight (its {len(names)} tensors include "
            f"{sorted(names)[:3]}): speculators cannot load a draft naming it (KeyError 'embed_tokens.weight'); a "
            "tied target keeps its one table as model.embed_tokens.weight, as transformers' save_pretrained writes it")


# ---- serving ------------------------------------------------------------------------------------


def serve_commands(algorithm: str, target: str, exports: dict[str, str | Path], num_speculative_tokens: int
                   ) -> dict[str, str]:
    """format -> the shell command that serves `target` (the hub id or path the server loads it
    by) with the export folder of that format as its draft of type `algorithm` (SERVE_COMMANDS'
    rows), a chain of `num_speculative_tokens` draft tokens per step."""
    return SERVE_COMMANDS[algorithm](target, exports, num_speculative_tokens)


def eagle3_serve_commands(target: str, exports: dict[str, str | Path], num_speculative_tokens: int) -> dict[str, str]:
    """`serve_commands` of an EAGLE-3 draft.

    vLLM 0.25 (config/speculative.py): --speculative-config takes SpeculativeConfig's fields as
    JSON: method "eagle3", model (the draft folder), num_speculative_tokens. SGLang 0.5.23
    (arg_groups/fields/spec.py): --speculative-algorithm EAGLE3, --speculative-draft-model-path,
    --speculative-num-steps k, --speculative-eagle-topk 1 (a chain) and
    --speculative-num-draft-tokens k + 1 (what SGLang sets it to whenever top-k is 1)."""
    k, q = int(num_speculative_tokens), shlex.quote
    out = {}
    if "vllm" in exports:
        spec = {"method": "eagle3", "model": str(exports["vllm"]), "num_speculative_tokens": k}
        out["vllm"] = f"vllm serve {q(target)} --speculative-config {q(json.dumps(spec))}"
    if "sglang" in exports:
        out["sglang"] = (f"python -m sglang.launch_server --model-path {q(target)} --speculative-algorithm EAGLE3 "
                         f"--speculative-draft-model-path {q(str(exports['sglang']))} --speculative-num-steps {k} "
                         f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")
    return out


def dflash_serve_commands(target: str, exports: dict[str, str | Path], num_speculative_tokens: int) -> dict[str, str]:
    """`serve_commands` of a DFlash draft: vLLM 0.25 --speculative-config with method "dflash" (its
    block runs non-causal: vLLM's FlashAttention backend, the default without FlashInfer, runs it;
    `--attention-backend FLASH_ATTN` forces it). SGLang serves no eaglet DFlash export."""
    if "vllm" not in exports:
        return {}
    spec = {"method": "dflash", "model": str(exports["vllm"]), "num_speculative_tokens": int(num_speculative_tokens)}
    return {"vllm": f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(json.dumps(spec))}"}


def peagle_serve_commands(target: str, exports: dict[str, str | Path], num_speculative_tokens: int) -> dict[str, str]:
    """`serve_commands` of a P-EAGLE draft: vLLM only, method eagle3 with parallel_drafting
    (SpeculativeConfig.parallel_drafting; vLLM fills it in itself only when the draft folder is
    served as the model, speculators/base.py), k tokens per forward."""
    k, q = int(num_speculative_tokens), shlex.quote
    if "vllm" not in exports:
        return {}
    spec = {"method": "eagle3", "model": str(exports["vllm"]), "num_speculative_tokens": k, "parallel_drafting": True}
    return {"vllm": f"vllm serve {q(target)} --speculative-config {q(json.dumps(spec))}"}


# draft type -> the serve commands of its exports (a draft type adds its row with its loaders)
SERVE_COMMANDS: dict[str, Callable[[str, dict[str, str | Path], int], dict[str, str]]] = {
    "eagle3": eagle3_serve_commands,
    "dflash": dflash_serve_commands,
    "peagle": peagle_serve_commands,
}
