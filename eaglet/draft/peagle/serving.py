"""P-EAGLE's export: the speculators `peagle` format, as vLLM >= 0.22 serves it.

    config, weights = serving(draft, meta)

vLLM 0.25.0 (transformers_utils/configs/speculators/base.py, algos.py update_peagle) reads
speculators_model_type "peagle" as method "eagle3" with parallel_drafting, builds
PeagleLlamaForCausalLM (= its Eagle3LlamaForCausalLM) from transformer_layer_config plus
draft_vocab_size, target_hidden_size, norm_before_residual (missing: false), norm_before_fc
(missing: false) and eagle_aux_hidden_state_layer_ids, and turns mask_token_id into
`pard_token`, the token of the mask slots. It forwards neither fc_norm nor norm_output, so a
P-EAGLE draft has neither (model.py PeagleConfig). Its load_weights (model_executor/models/
llama_eagle3.py) copies `mask_hidden` (any shape of num_aux * target_hidden values) into the
buffer it runs through fc for every mask slot, and refuses a parallel-drafting checkpoint
without it; every other weight is named as EAGLE-3's speculators export names it (eaglet's own
names). speculators 0.9.0 (models/peagle/) loads the same files, its mask_hidden shaped
[1, 1, num_aux * hidden], which is the shape written here.

meta: aux_layer_ids (the target states, HF hidden_states indices as vLLM takes them),
verifier_name_or_path, verifier_architectures, and optionally num_speculative_tokens (default:
the depths it was trained with, PeagleConfig.num_depths), include_embed (default false: the engines share the target's embedding,
which the draft's frozen copy is) and dtype (a torch dtype or its name, default bfloat16).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...utils import DTYPES
from ..eagle3.serving import llama_fields
from .model import PeagleConfig, PeagleDraft

SPECULATORS_VERSION = "0.9.0"  # the speculators release this writer was checked against
FORMATS = ("vllm",)  # SGLang has no parallel-drafting EAGLE path: the speculators format alone


def transformer_layer_config(cfg: PeagleConfig, dtype_name: str) -> dict[str, Any]:
    """The LlamaConfig of the draft's layers (speculators' transformer_layer_config): EAGLE-3's
    (`llama_fields`), plus num_aux_hidden_states, which vLLM sizes fc and mask_hidden by."""
    return {**llama_fields(cfg, dtype_name), "num_aux_hidden_states": cfg.num_aux}


def serving_config(cfg: PeagleConfig, meta: dict[str, Any], dtype_name: str) -> dict[str, Any]:
    """config.json of the export (module header)."""
    ids = [int(i) for i in meta["aux_layer_ids"]]
    if len(ids) != cfg.num_aux or len(set(ids)) != len(ids) or min(ids) < 0:
        raise ValueError(f"aux layer ids {ids}: expected {cfg.num_aux} distinct ids >= 0")
    k = int(meta.get("num_speculative_tokens") or cfg.num_depths)
    if k < 1:
        raise ValueError("num_speculative_tokens (the tokens proposed per forward) must be >= 1")
    return {
        "architectures": ["PEagleSpeculator"],
        "speculators_model_type": "peagle",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": transformer_layer_config(cfg, dtype_name),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": ids,
        "norm_before_residual": cfg.norm_before_residual,  # written: speculators and vLLM differ on a default
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "mask_token_id": cfg.mask_token_id,
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "peagle",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1, "accept_tolerance": 0.0}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": meta["verifier_name_or_path"],
                         "architectures": list(meta.get("verifier_architectures") or [])},
        },
        "torch_dtype": dtype_name,
    }


def serving_weights(draft: PeagleDraft, dtype: torch.dtype, include_embed: bool = False) -> dict[str, Tensor]:
    """The weights under their checkpoint names (eaglet's, mask_hidden as [1, 1, A]); floating
    ones cast to `dtype`. d2t/t2d are left out for a full draft vocabulary (speculators then has
    no such buffers), embed_tokens unless include_embed."""
    cfg = draft.config
    skip = set() if include_embed else {"embed_tokens.weight"}
    if cfg.draft_vocab_size == cfg.vocab_size:
        if bool(draft.d2t.any()):
            raise ValueError("draft_vocab_size == vocab_size but d2t is not the identity map")
        skip |= {"d2t", "t2d"}
    out = {}
    for name, t in draft.state_dict().items():
        if name in skip:
            continue
        t = t.detach().to("cpu")
        if name == "mask_hidden":
            t = t.reshape(1, 1, -1)
        out[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    return out


def serving(draft: PeagleDraft, meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(config.json, weights) of the speculators `peagle` export (module header; meta's keys there)."""
    if meta.get("format", FORMATS[0]) not in FORMATS:
        raise ValueError(f"a P-EAGLE draft exports in the speculators format ({FORMATS[0]!r}) alone, not "
                         f"{meta['format']!r}: SGLang has no parallel-drafting EAGLE path")
    dtype = meta.get("dtype", torch.bfloat16)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"export dtype {dtype!r}: expected one of {list(DTYPES)}")
        dtype = DTYPES[dtype]
    dtype_name = str(dtype).removeprefix("torch.")
    config = serving_config(draft.config, meta, dtype_name)
    return config, serving_weights(draft, dtype, bool(meta.get("include_embed", False)))
