"""The DFlash export: speculators' `dflash` checkpoint format, which vLLM 0.25.0 serves.

Why this format: vLLM 0.25.0 loads DFlash from two formats, z-lab's (architectures
DFlashDraftModel, dflash_config) and speculators' (speculators_model_type "dflash", turned into
z-lab's by vllm/transformers_utils/configs/speculators/algos.py `update_dflash`); speculators
0.9.0 loads only its own (`DFlashDraftModel.from_pretrained`; z-lab checkpoints go through its
converter). So eaglet writes speculators' format, and both load the same folder:
`vllm serve TARGET --speculative-config '{"method": "dflash", "model": EXPORT,
"num_speculative_tokens": K}'` (with an attention backend that runs non-causal blocks).

config.json: speculators_model_type "dflash", transformer_layer_config (a Qwen3Config dict:
the draft's sizes, num_hidden_layers = draft layers, vocab_size = the target's vocabulary),
draft_vocab_size, target_hidden_size, block_size, mask_token_id,
aux_hidden_state_layer_ids, sample_from_anchor false, sliding_window_non_causal false,
speculators_config {algorithm dflash, greedy proposal with K speculative tokens, verifier}.

Target layers: speculators' aux_hidden_state_layer_ids are vLLM's aux ids, the HF
hidden_states indices eaglet keeps (`DFlashConfig.target_layers`), written unchanged; vLLM's
update_dflash writes them to eagle_aux_hidden_state_layer_ids (what its runner captures) and
i - 1 to dflash_config.target_layer_ids (z-lab's "output of layer i" ids).

Causality: update_dflash sets no dflash_config.causal, so vLLM 0.25.0 runs every speculators
DFlash draft with a non-causal block (speculators' full-attention layers are bidirectional
too). A draft trained with `causal` cannot be served from this format: `serving` refuses it.

Weights, named as speculators' DFlashDraftModel names them, which vLLM's
DFlashQwen3ForCausalLM.load_weights reads (it prefixes "model." to every name but lm_head,
stacks q/k/v_proj and gate/up_proj, renames d2t to draft_id_to_target_id, skips t2d): fc,
hidden_norm, layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
post_attention_layernorm, mlp.{gate,up,down}_proj}, norm, lm_head; d2t and t2d only when the
draft vocabulary is reduced (vLLM makes draft_id_to_target_id only then); embed_tokens only
with meta["include_embed"] (both share the target's otherwise).
speculators 0.9.0 replaces lm_head with the verifier's when the draft vocabulary is the full
one (its DFlash head is the frozen verifier head), so there a trained lm_head reaches vLLM only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..layers import rope_type
from .model import DFlashDraft

SPECULATORS_VERSION = "0.9.0"  # the speculators release this writer was checked against
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def qwen3_fields(draft: DFlashDraft, dtype_name: str) -> dict[str, Any]:
    """transformer_layer_config: the Qwen3Config both loaders build the draft's layers from."""
    c = draft.config
    scaling = dict(c.rope_scaling) if c.rope_scaling else None
    return {
        "model_type": "qwen3",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": {"rope_type": rope_type(scaling), **(scaling or {}), "rope_theta": c.rope_theta},
        "attention_bias": False,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name,
    }


def weight_names(draft: DFlashDraft, include_embed: bool = False) -> list[str]:
    """The draft's state-dict names the export writes (unchanged: eaglet's names are the format's)."""
    reduced = draft.config.draft_vocab_size != draft.config.vocab_size
    skip = {"embed_tokens.weight"} - ({"embed_tokens.weight"} if include_embed else set())
    if not reduced:
        skip |= {"d2t", "t2d"}
    return [n for n in draft.state_dict() if n not in skip]


def serving(draft: DFlashDraft, meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(config.json, weights) of the export. meta: verifier_name_or_path, verifier_architectures,
    num_speculative_tokens (default block_size - 1), include_embed (default false), dtype (a
    name in DTYPES, default bfloat16), aux_layer_ids (default the draft's target_layers)."""
    c = draft.config
    k = int(meta.get("num_speculative_tokens") or c.block_size - 1)
    ids = [int(i) for i in (meta.get("aux_layer_ids") or c.target_layers)]
    dtype_name = str(meta.get("dtype") or "bfloat16").removeprefix("torch.")
    problems = []
    if c.causal:
        problems.append("it was trained with a causal block, and vLLM 0.25.0 serves speculators' DFlash non-causal")
    if not 1 <= k < c.block_size:
        problems.append(f"num_speculative_tokens {k} is not within 1..block_size-1 = {c.block_size - 1}")
    if len(ids) != c.num_aux or len(set(ids)) != len(ids) or any(i < 1 for i in ids):
        problems.append(f"target layer ids {ids} must be {c.num_aux} distinct HF indices >= 1 (fc reads {c.num_aux})")
    if dtype_name not in DTYPES:
        problems.append(f"dtype {dtype_name!r} is not one of {sorted(DTYPES)}")
    if problems:
        raise ValueError("cannot export this DFlash draft: " + "; ".join(problems))
    state = draft.state_dict()
    if c.draft_vocab_size == c.vocab_size and bool(state["d2t"].any()):
        raise ValueError("draft_vocab_size == vocab_size but d2t is not the identity map")
    dtype = DTYPES[dtype_name]
    weights = {}
    for name in weight_names(draft, bool(meta.get("include_embed"))):
        t = state[name].detach().to("cpu")
        weights[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    config = {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": qwen3_fields(draft, dtype_name),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "block_size": c.block_size,
        "mask_token_id": c.mask_token_id,
        "aux_hidden_state_layer_ids": ids,
        "sample_from_anchor": False,
        "sliding_window_non_causal": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1, "accept_tolerance": 0.0}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": meta.get("verifier_name_or_path"),
                         "architectures": list(meta.get("verifier_architectures") or [])},
        },
        "torch_dtype": dtype_name,
    }
    return config, weights
