"""A P-EAGLE export read back (serving.py's speculators `peagle` format): its config.json and
weights, which eaglet/formats/serving.py reads and checks as files, turned into a PeagleConfig and
a state dict under eaglet's names (`from_serving`), the format told by `serving_format`; and the
logits by which the export stage holds a draft read back to the trained one (`reload_logits`).

Everything but the mask slot is EAGLE-3's speculators format, so it is read by EAGLE-3's reader
(eaglet/draft/eagle3/read_export.py) with the two places where vLLM's `peagle` path reads the
config otherwise: a missing norm_before_residual is false (algos.py update_peagle; eagle3's
reads true), and fc_norm / norm_output are not read at all (a config that sets them is refused
by PeagleConfig, since vLLM would serve the draft without them). mask_token_id (vLLM's
`pard_token`) is required, as vLLM requires it; mask_hidden must hold num_aux x
target_hidden_size values (vLLM copies it into a buffer of that size, and refuses a parallel
drafting checkpoint without it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..eagle3.read_export import from_serving as eagle3_from_serving
from .model import PeagleConfig, PeagleDraft
from .serving import FORMATS

MODEL_TYPE = "peagle"  # speculators_model_type


def serving_format(config: dict[str, Any], weights: dict[str, Tensor] | None = None) -> str | None:
    """"vllm" for a speculators `peagle` config.json, else None (not P-EAGLE's)."""
    return FORMATS[0] if config.get("speculators_model_type") == MODEL_TYPE else None


def from_serving(config: dict[str, Any], weights: dict[str, Tensor], fmt: str, folder: Path
                 ) -> tuple[PeagleConfig, dict[str, Tensor], list[str], dict[str, Any]]:
    """(the draft config, the state dict under eaglet's names, the names missing from it, meta)
    of a P-EAGLE export (module header). meta as EAGLE-3's: aux_layer_ids, verifier_name_or_path,
    verifier_architectures, num_speculative_tokens. A ValueError names what does not fit."""
    if fmt not in FORMATS:
        raise ValueError(f"a P-EAGLE export is in the {FORMATS} format, not {fmt!r}")
    if config.get("mask_token_id") is None:
        raise ValueError(f"{folder}: a peagle config.json needs mask_token_id (vLLM reads it as pard_token)")
    if "mask_hidden" not in weights:
        raise ValueError(f"{folder}: no mask_hidden weight (vLLM refuses a parallel-drafting checkpoint without it)")
    as_eagle3 = {**config, "speculators_model_type": "eagle3",
                 "norm_before_residual": config.get("norm_before_residual", False)}
    as_eagle3.pop("fc_norm", None)
    as_eagle3.pop("norm_output", None)
    eagle_weights = {name: t for name, t in weights.items() if name != "mask_hidden"}
    base, state, missing, meta = eagle3_from_serving(as_eagle3, eagle_weights, fmt, folder)
    k = int(meta.get("num_speculative_tokens") or 1)
    cfg = PeagleConfig(**base.to_dict(), mask_token_id=int(config["mask_token_id"]), num_depths=k)
    mask = weights["mask_hidden"]
    width = cfg.num_aux * cfg.target_hidden_size
    if mask.numel() != width:
        raise ValueError(f"{folder}: mask_hidden {tuple(mask.shape)} holds {mask.numel()} values, not num_aux "
                         f"{cfg.num_aux} x target_hidden_size {cfg.target_hidden_size} = {width}")
    state["mask_hidden"] = mask.reshape(width)
    return cfg, state, missing, meta


@torch.no_grad()
def reload_logits(draft: PeagleDraft) -> list[Tensor]:
    """The draft's logits on one fixed random input, every row at depth 0 and at depths 1 and 2
    (the mask slots), by which export compares a reloaded export with the trained draft."""
    g = torch.Generator().manual_seed(0)
    c = draft.config
    aux = torch.randn(1, 16, c.num_aux * c.target_hidden_size, generator=g)
    ids = torch.randint(0, c.vocab_size, (1, 16), generator=g)
    rows = torch.arange(16)
    return draft.depth_forward(aux, ids, depth_rows=[None, rows, rows], attn_impl="naive")
