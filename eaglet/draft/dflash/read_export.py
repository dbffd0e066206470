"""A DFlash export read back (serving.py's format: speculators' `dflash`, which vLLM 0.25.0 and
speculators 0.9.0 load): its config.json and weights, which eaglet/formats/serving.py reads and
checks as files, turned into a DFlashConfig and a state dict under eaglet's names (which are the
format's), and the logits export compares the reloaded draft by."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .model import DFlashConfig, DFlashDraft


def serving_format(config: dict[str, Any], weights: dict[str, Tensor] | None = None) -> str | None:
    """"vllm" for speculators' dflash config (the one format eaglet writes DFlash in), else None."""
    return "vllm" if config.get("speculators_model_type") == "dflash" else None


def _rope(tl: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = dict(tl.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", None) or tl.get("rope_theta") or 10000.0)
    kind = params.pop("rope_type", None) or "default"
    scaling = tl.get("rope_scaling") or (None if kind == "default" else {"rope_type": kind, **params})
    return theta, scaling


def from_serving(config: dict[str, Any], weights: dict[str, Tensor], fmt: str, folder: Path
                 ) -> tuple[DFlashConfig, dict[str, Tensor], list[str], dict[str, Any]]:
    """(the draft config, the state dict, the names missing from it, meta) of a speculators dflash
    export. embed_tokens is missing unless the export ships it (copy the target's in); d2t/t2d
    are the identity when a full-vocabulary draft ships none. A ValueError names what does not fit."""
    tl = dict(config.get("transformer_layer_config") or {})
    if not tl:
        raise ValueError("speculators dflash config has no transformer_layer_config")
    if config.get("sample_from_anchor"):
        raise ValueError("sample_from_anchor: the anchor slot predicts too (DSpark's layout), not an eaglet DFlash draft")
    theta, scaling = _rope(tl)
    ids = [int(i) for i in config.get("aux_hidden_state_layer_ids") or []]
    vocab = int(tl["vocab_size"])
    cfg = DFlashConfig(
        hidden_size=int(tl["hidden_size"]), target_hidden_size=int(config.get("target_hidden_size") or tl["hidden_size"]),
        num_attention_heads=int(tl["num_attention_heads"]), num_key_value_heads=int(tl["num_key_value_heads"]),
        head_dim=int(tl.get("head_dim") or int(tl["hidden_size"]) // int(tl["num_attention_heads"])),
        intermediate_size=int(tl["intermediate_size"]), vocab_size=vocab,
        draft_vocab_size=int(config.get("draft_vocab_size") or vocab), mask_token_id=int(config["mask_token_id"]),
        target_layers=ids, num_aux=len(ids) or 1, num_layers=int(tl["num_hidden_layers"]),
        block_size=int(config["block_size"]), causal=False, rms_norm_eps=float(tl.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=scaling, max_position_embeddings=int(tl.get("max_position_embeddings", 4096)))
    expected = DFlashDraft(cfg).state_dict()
    state = {k: v for k, v in weights.items() if k in expected}
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise ValueError(f"{folder}: weights a DFlash draft has not: {unexpected[:5]}")
    if "d2t" not in state and cfg.draft_vocab_size == vocab:
        state["d2t"] = torch.zeros(vocab, dtype=torch.long)
        state["t2d"] = torch.ones(vocab, dtype=torch.bool)
    missing = sorted(set(expected) - set(state))
    bad = [k for k in missing if k != "embed_tokens.weight"]
    if bad:
        raise ValueError(f"{folder}: weights missing from the DFlash export: {bad[:5]}")
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(f"{folder}: tensor {name} is {tuple(t.shape)}, the config makes it {tuple(expected[name].shape)}")
    sc = config.get("speculators_config") or {}
    verifier = sc.get("verifier") or {}
    methods = sc.get("proposal_methods") or [{}]
    meta = {"aux_layer_ids": ids or None, "verifier_name_or_path": verifier.get("name_or_path"),
            "verifier_architectures": list(verifier.get("architectures") or []),
            "num_speculative_tokens": methods[0].get("speculative_tokens")}
    return cfg, state, missing, meta


def reload_logits(draft: DFlashDraft) -> list[Tensor]:
    """The draft's block logits on one fixed random input (two blocks of one document), by which
    export compares a reloaded export with the trained draft."""
    g = torch.Generator().manual_seed(0)
    c = draft.config
    n = 2 * c.block_size + 4
    aux = torch.randn(1, n, c.num_aux * c.target_hidden_size, generator=g)
    ids = torch.randint(0, c.vocab_size, (1, n), generator=g)
    anchors = torch.tensor([2, c.block_size + 3])
    logits = draft.block_logits(aux, ids, torch.arange(n)[None], anchors, torch.zeros_like(anchors), attn_impl="dense")
    return [logits]
