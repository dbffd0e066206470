"""DFlash: a block-diffusion draft that drafts a whole block in one forward, reading evenly
spread target layers as the context of every draft layer (model.py has the architecture,
loss.py the anchors and the objective, propose.py the decoding, serving.py the export).

The entry points of eaglet/draft/base.py `DraftType`. Settings come from the config's `dflash:`
section (`loss.dflash_settings`): block_size, layers (draft layers), gamma (slot weight decay),
max_anchors (per document), mask_token_id (None: the target vocabulary's last id, recorded
in the draft config), causal (the block; vLLM 0.25.0 serves it non-causal), target_layers
(None: z-lab's spread for `layers` draft layers).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ...errors import ConfigError
from ..loss import PositionLoss
from .loss import block_loss, dflash_settings, select_anchors
from .model import DFlashConfig, DFlashDraft
from .propose import DFlashProposer, block_hits, chain_hits
from .read_export import from_serving, reload_logits, serving_format
from .serving import serving

NAME = "dflash"
TITLE = "DFlash"
SERVING_METHOD = "dflash"
SERVING_FORMATS = ("vllm",)  # speculators' dflash format (serving.py); SGLang serves no eaglet DFlash export
LAYER_KEYS = ("layers", "target_layers")  # dflash.* keys that choose the target layers (the extract stage's inputs)
# What its vLLM serving path needs of vLLM (eaglet/engines/vllm/contracts.py makes them contract
# rows, checked by the doctor for a config that trains this type): (where, params, why), as read
# from vLLM 0.25.0's source.
VLLM_SERVING_CONTRACTS = (
    ("vllm.config.speculative:SpeculativeMethod", "+dflash",
     "DFlash: the eval's speculative config names method dflash (draft.dflash.SERVING_METHOD)"),
    ("vllm.transformers_utils.configs.speculators.algos:SUPPORTED_SPECULATORS_TYPES", "+dflash",
     "DFlash: vLLM reads the export's speculators_model_type dflash"),
    ("vllm.transformers_utils.configs.speculators.algos:update_dflash", "^config_dict ^pre_trained_config $aux_hidden_state_layer_ids $mask_token_id",
     "DFlash: turns the export's aux_hidden_state_layer_ids and mask_token_id into vLLM's dflash_config"),
    ("vllm.model_executor.models.registry:_SPECULATIVE_DECODING_MODELS", "+DFlashDraftModel",
     "DFlash: the architecture update_dflash names, served by DFlashQwen3ForCausalLM"),
    ("vllm.model_executor.models.qwen3_dflash:DFlashQwen3ForCausalLM.load_weights", "^weights",
     "DFlash: loads the export's weights under the names formats/loaders.py describes"),
)

__all__ = ["NAME", "TITLE", "SERVING_METHOD", "layers", "build", "from_config", "host_rows", "prepare_training",
           "shard_units", "unroll_linears", "num_positions", "loss", "serving", "proposer", "chain_hits", "block_hits", "SERVING_FORMATS", "VLLM_SERVING_CONTRACTS", "LAYER_KEYS", "config_problems",
           "default_target_layers", "DFlashConfig", "DFlashDraft", "DFlashProposer", "serving_format", "from_serving", "reload_logits"]


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default as HF hidden_states indices: one draft layer reads layer n//2; more read
    layers spread evenly from 1 to n-3 (rounded as Python rounds), z-lab's layer L being the
    output of 0-based layer L, i.e. HF index L+1."""
    n = num_target_layers
    if num_draft_layers == 1:
        zlab = [n // 2]
    else:
        zlab = [int(round(1 + i * (n - 4) / (num_draft_layers - 1))) for i in range(num_draft_layers)]
    return [i + 1 for i in zlab]


def layers(num_target_layers: int, cfg: Any) -> list[int]:
    """The target layers the draft reads (HF indices): dflash.target_layers, else z-lab's default."""
    s = dflash_settings(cfg)
    if s.target_layers is None:
        return default_target_layers(num_target_layers, int(s.layers))
    ids = [int(i) for i in s.target_layers]
    if not ids or len(set(ids)) != len(ids) or min(ids) < 1 or max(ids) > num_target_layers:
        raise ConfigError(f"dflash.target_layers {ids}: expected distinct HF hidden_states indices within "
                          f"1..{num_target_layers} (the target has {num_target_layers} layers)")
    return ids


def build(cfg: Any, target_config: Any, draft_vocab_size: int, num_aux: int) -> DFlashDraft:
    """A fresh draft of the target's shape (the caller seeds torch first)."""
    s = dflash_settings(cfg)
    c = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    vocab = int(c.vocab_size)
    mask = vocab - 1 if s.mask_token_id is None else int(s.mask_token_id)
    if not 0 <= mask < vocab:
        raise ConfigError(f"dflash.mask_token_id {mask} is not a token of the target's {vocab}-token vocabulary")
    target_layers = layers(int(c.num_hidden_layers), cfg)
    if len(target_layers) != num_aux:
        raise ConfigError(f"dflash reads {len(target_layers)} target layers {target_layers}, "
                          f"but the states given concatenate {num_aux}")
    config = DFlashConfig.from_target_config(
        c, draft_vocab_size, mask_token_id=mask, target_layers=target_layers, num_aux=num_aux,
        num_layers=int(s.layers), block_size=int(s.block_size), causal=bool(s.causal))
    return DFlashDraft(config)


def from_config(draft_config: dict[str, Any]) -> DFlashDraft:
    """The draft a saved config (`config.to_dict()`) describes, weights not loaded."""
    return DFlashDraft(DFlashConfig(**draft_config))


def host_rows(loss_mask_BT: Tensor, doc_ids_BT: Tensor, cfg: Any, seed: int) -> dict[str, Tensor]:
    """The micro-batch's sorted anchors and their documents' first rows (`loss.select_anchors`)."""
    s = dflash_settings(cfg)
    return select_anchors(loss_mask_BT, doc_ids_BT, int(s.block_size), int(s.max_anchors), seed)


def prepare_training(draft: nn.Module, compile: bool, sharded: bool) -> None:
    """Nothing to install: the training forward is `block_logits` (flex attention compiled on CUDA)."""


def shard_units(draft: nn.Module) -> list[nn.Module]:
    return list(draft.layers)


def unroll_linears(draft: nn.Module) -> None:
    return None


def num_positions(cfg: Any) -> int:
    return int(dflash_settings(cfg).block_size) - 1


def loss(module: nn.Module, draft: DFlashDraft, batch: Any, teacher_BTV: Tensor, in_vocab_BT: Tensor, cfg: Any,
         compiled: bool) -> PositionLoss:
    """The block loss of one packed micro-batch (loss.py). Its anchors are batch.rows' (made by
    host_rows); without them (an evaluation that made none) they are drawn here with seed 0."""
    rows = batch.rows
    if rows is None:
        rows = host_rows(batch.loss_mask.cpu(), batch.doc_ids.cpu(), cfg, 0)
    anchors, starts = (rows[key].to(batch.aux.device) for key in ("anchors", "starts"))
    logits = module(batch.aux, batch.input_ids, batch.position_ids, anchors, starts)
    return block_loss(logits, anchors, teacher_BTV, in_vocab_BT, batch.loss_mask, batch.doc_ids,
                      float(dflash_settings(cfg).gamma), compiled)


def config_problems(cfg: Any) -> list[tuple[str, str]]:
    """(what, fix) for each setting a DFlash draft of this config cannot honour: a chain or an
    export longer than the block drafts (block_size - 1 tokens), or the EAGLE-2 tree."""
    most = int(dflash_settings(cfg).block_size) - 1
    out = []
    for key, k in (("eval.chain_tokens", cfg.eval.chain_tokens), ("export.speculative_tokens", cfg.export.speculative_tokens)):
        if int(k) > most:
            out.append((f"{key} {k}: a DFlash draft of dflash.block_size {most + 1} drafts at most {most} tokens a cycle",
                        f"set {key} to at most {most}, or train with dflash.block_size {int(k) + 1}"))
    if cfg.eval.method != "chain":
        out.append((f"eval.method {cfg.eval.method}: a DFlash draft proposes a chain, no EAGLE-2 tree",
                    "set eval.method: chain"))
    return out


def proposer(draft: DFlashDraft) -> DFlashProposer:
    return DFlashProposer(draft)

