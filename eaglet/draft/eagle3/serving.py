"""EAGLE-3's serving formats: the config.json and weights of an export (`serving`).
eaglet/formats/serving.py writes them, with their checksums, and reads them back as files;
read_export.py turns them into a draft again. The weights are renamed by one generated name
map per format (`name_map`: eaglet's state-dict names -> checkpoint names, built from
Eagle3Draft's own state dict), and read back through the inverse of the same map.

Formats
-------
"vllm": the speculators format (speculators 0.9.0 `Eagle3SpeculatorConfig`, served by vLLM
    through vllm/transformers_utils/configs/speculators). config.json: speculators_model_type
    "eagle3", architectures ["Eagle3Speculator"], transformer_layer_config (a LlamaConfig dict:
    the draft's sizes, vocab_size = the target's vocabulary, num_aux_hidden_states = num_aux,
    which vLLM sizes fc by: it does not count the top-level ids), draft_vocab_size,
    target_hidden_size, eagle_aux_hidden_state_layer_ids, norm_before_residual,
    norm_before_fc (always false), fc_norm, norm_output, embed_requires_grad,
    speculators_config {algorithm, proposal_methods [greedy, speculative_tokens k],
    default_proposal_method, verifier {name_or_path, architectures}}, speculators_version.
    Weights are named exactly as eaglet names them (eaglet's names follow speculators):
    fc, fc_norm.{i}, layers.{i}.*, norm, lm_head, d2t, t2d, embed_tokens (optional).
    norm_before_residual is always written: vLLM reads a missing key as *true*.
    speculators' own model sizes fc as num_aux * hidden_size, so it (not vLLM) needs
    target_hidden_size == hidden_size.
"sglang": the official EAGLE-3 / SGLang format (SGLang models/llama_eagle3.py,
    `LlamaForCausalLMEagle3`; vLLM maps that architecture to its Eagle3 Llama too).
    config.json: a flat LlamaConfig with num_hidden_layers 1, draft_vocab_size,
    target_hidden_size, eagle_config {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state}.
    Layer 0 is named `midlayer.*`; fc, norm, lm_head, d2t, t2d, embed_tokens (optional) keep
    their names. eaglet writes the form SGLang's loader has long read: one EAGLE-3 layer, a
    3-state fc without norms, no attention bias, residual = un-normed h, the pre-norm state fed
    to the next step. Drafts using num_layers > 1, fc_norm, norm_output, norm_before_residual,
    attention_bias or num_aux != 3 are refused for this format (older SGLang releases skip the
    weights of these without a word; 0.5.23 reads fc_norm, norm_output and the state count,
    but names a later layer's input norm hidden_norm).
"vllm" and "sglang" of a draft with MLA layers (config.attention "mla"): one flat config for both
    engines' Eagle3DeepseekV2ForCausalLM, the weights under eaglet's names (serving_mla.py).
Checked: eaglet/formats/loaders.py holds each engine's loader as data (pinned
    releases) and the checks the export stage runs on both formats.
Both: d2t/t2d are left out when the draft vocabulary is the whole target vocabulary (the maps
    are then the identity; speculators registers no such buffers then); embed_tokens is left
    out unless include_embed (the engines share the target's, which eaglet's frozen copy is).
    RoPE is written in both spellings: rope_theta + rope_scaling (transformers 4.x) and
    rope_parameters (transformers 5); transformers 5 reads them identically.

Which target states (aux layer ids) each engine means
-----------------------------------------------------
eaglet keeps HF `output_hidden_states` indices: id i is the state *entering* decoder layer i
(0 = embedding output); the EAGLE-3 default is [2, L//2, L-3].
- vLLM: the target collects `hidden_states + residual` before running layer idx for idx in
  aux_hidden_state_layers (models/llama.py, deepseek_v2.py), and takes those ids unchanged
  from the draft config's `eagle_aux_hidden_state_layer_ids` (top level first, else
  eagle_config's; gpu_model_runner `_get_eagle3_aux_layers_from_config`). Same indices as
  eaglet: written unchanged in both formats' top level.
- SGLang: reads only eagle_config["eagle_aux_hidden_state_layer_ids"] and captures before
  layer id + 1 (`set_eagle3_layers_to_capture`: "for the ith layer, it takes the output of
  the (i-1)th layer"): its ids are 0-based layer outputs, i.e. HF index - 1 (SpecForge's
  [1, L//2-1, L-4]). The sglang export writes eagle_config ids = eaglet ids - 1, and the
  top-level key with eaglet's ids for vLLM. With no ids at all both engines capture before
  [2, L//2, L-3] (meta["aux_layer_ids"] is then None: the caller resolves it with L).
- speculators: the same ids as vLLM (its default [2, L//2, L-3], validated within [0, L]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..layers import rope_type
from .model import DraftConfig, Eagle3Draft
from .serving_mla import mla_config, mla_export_problems

FORMATS = ("vllm", "sglang")
SPECULATORS_VERSION = "0.9.0"  # the speculators release this writer was checked against


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}: expected one of {FORMATS}")


# ---- the name maps ------------------------------------------------------------------------


def _speculators_name(name: str) -> str:
    """speculators (and so vLLM's speculators path) names every weight as eaglet does."""
    return name


def _sglang_name(name: str) -> str:
    """Official EAGLE-3 / SGLang: layer 0 is `midlayer`; everything else keeps its name."""
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


CHECKPOINT_NAME: dict[str, Callable[[str], str]] = {"vllm": _speculators_name, "sglang": _sglang_name}


def name_map(cfg: DraftConfig, fmt: str, include_embed: bool = True) -> dict[str, str]:
    """eaglet state-dict name -> checkpoint name for every tensor `fmt` stores for `cfg`.

    Generated from the state dict of Eagle3Draft(cfg) (built on the meta device). d2t/t2d are
    absent when the draft vocabulary is the whole target vocabulary; embed_tokens unless
    include_embed."""
    check_format(fmt)
    skip = set() if include_embed else {"embed_tokens.weight"}
    if cfg.draft_vocab_size == cfg.vocab_size:
        skip |= {"d2t", "t2d"}
    rename = _speculators_name if cfg.attention == "mla" else CHECKPOINT_NAME[fmt]  # MLA: one naming for both
    return {n: rename(n) for n in draft_shapes(cfg) if n not in skip}


def draft_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in Eagle3Draft(cfg).state_dict().items()}


# ---- export -------------------------------------------------------------------------------


def serving(draft: nn.Module, meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(config.json, the weights under their checkpoint names, uncast) of the export of `draft`
    in meta["format"] ("vllm" or "sglang"). meta: format, aux_layer_ids (HF output_hidden_states
    indices), verifier_name_or_path, verifier_architectures, num_speculative_tokens,
    include_embed, dtype (the weights' dtype name, written as torch_dtype). A ValueError says
    why `draft` cannot be exported so."""
    fmt = meta["format"]
    check_format(fmt)
    cfg = draft.config
    ids = [int(i) for i in meta["aux_layer_ids"]]
    problems = export_problems(cfg, fmt, ids, meta["num_speculative_tokens"])
    if problems:
        raise ValueError(f"cannot export this draft as {fmt!r}: " + "; ".join(problems))
    names = name_map(cfg, fmt, meta["include_embed"])
    state = draft.state_dict()
    if "d2t" not in names and bool(state["d2t"].any()):
        raise ValueError("draft_vocab_size == vocab_size but d2t is not the identity map")
    tensors = {ckpt: state[ours] for ours, ckpt in names.items()}
    if cfg.attention == "mla":
        config = mla_config(cfg, ids, meta["dtype"])
    elif fmt == "vllm":
        config = _speculators_config(cfg, ids, meta["verifier_name_or_path"], meta["verifier_architectures"],
                                     meta["num_speculative_tokens"], meta["dtype"])
    else:
        config = _sglang_config(cfg, ids, meta["dtype"])
    return config, tensors


def export_problems(cfg: DraftConfig, fmt: str, ids: list[int], k: int) -> list[str]:
    p = []
    if len(ids) != cfg.num_aux:
        p.append(f"{len(ids)} aux layer ids {ids} for a draft that concatenates num_aux={cfg.num_aux} states")
    if len(set(ids)) != len(ids) or any(i < 0 for i in ids):
        p.append(f"aux layer ids {ids} must be distinct and >= 0")
    if k < 1:
        p.append(f"num_speculative_tokens {k} < 1")
    if cfg.attention == "mla":
        return p + mla_export_problems(cfg, fmt, ids)
    if fmt == "sglang":
        if any(i < 1 for i in ids):
            p.append(f"aux layer ids {ids}: SGLang writes id - 1 (a layer output); 0 has none")
        unsupported = {
            f"num_layers={cfg.num_layers} (SGLang's EAGLE-3 module has one EAGLE-3 layer)": cfg.num_layers != 1,
            f"num_aux={cfg.num_aux} (SGLang's fc takes exactly 3 states)": cfg.num_aux != 3,
            "fc_norm": cfg.fc_norm,
            "norm_output": cfg.norm_output,
            "norm_before_residual": cfg.norm_before_residual,
            "attention_bias": cfg.attention_bias,
        }
        p += [f"SGLang's llama_eagle3 has no {what}" for what, bad in unsupported.items() if bad]
    return p


def llama_fields(cfg: DraftConfig, dtype_name: str) -> dict[str, Any]:
    """The LlamaConfig fields both formats carry (transformer_layer_config / top level)."""
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    rope_parameters = {"rope_type": rope_type(scaling), **(scaling or {}), "rope_theta": cfg.rope_theta}
    return {
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope_parameters,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name,
    }


def _speculators_config(
    cfg: DraftConfig, ids: list[int], verifier: str, archs: list[str], k: int, dtype_name: str
) -> dict[str, Any]:
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        # vLLM sizes fc by num_aux_hidden_states (else 3), not by the top-level ids' count
        "transformer_layer_config": {**llama_fields(cfg, dtype_name), "num_aux_hidden_states": cfg.num_aux},
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": ids,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": False,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1, "accept_tolerance": 0.0}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(archs)},
        },
        "torch_dtype": dtype_name,
    }


def _sglang_config(cfg: DraftConfig, ids: list[int], dtype_name: str) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **llama_fields(cfg, dtype_name),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": False,
        # SGLang: 0-based layer outputs (captures before id + 1). vLLM: the top-level key.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": ids,
    }


@torch.no_grad()
def reload_logits(draft: Eagle3Draft) -> list[Tensor]:
    """The draft's logits on one fixed random input (two TTT steps), by which export compares a
    reloaded export with the trained draft."""
    g = torch.Generator().manual_seed(0)
    c = draft.config
    aux = torch.randn(1, 16, c.num_aux * c.target_hidden_size, generator=g)
    ids = torch.randint(0, c.vocab_size, (1, 16), generator=g)
    return draft.ttt_forward(aux, ids, num_steps=2, attn_impl="naive")
