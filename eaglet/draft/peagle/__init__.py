"""P-EAGLE (parallel drafting): an EAGLE-3 draft that proposes all k tokens of a cycle in one
forward, the slots after the first holding a mask token and a trained stand-in for the target's
states (model.py). Trained over sampled depths (loss.py), decoded by propose.py, exported in
the speculators `peagle` format that vLLM serves as eagle3 with parallel drafting (serving.py).

The module-level names are the draft-type entry points of eaglet/draft/base.py `DraftType`; the
settings come from the `peagle:` config section (model.py `peagle_settings`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .loss import host_rows, loss
from .model import PeagleConfig, PeagleDraft, auto_mask_token_id, peagle_settings
from .propose import PeagleProposer
from .read_export import from_serving, reload_logits, serving_format
from .replay import chain_hits
from .serving import FORMATS as SERVING_FORMATS
from .serving import serving

NAME = "peagle"
TITLE = "P-EAGLE"
SERVING_METHOD = "eagle3"  # with parallel_drafting: true (vLLM reads it from the speculators config)
# Added to vLLM's speculative config beside method, model and num_speculative_tokens: an explicit
# --speculative-config (the eval's, the serve command's) is not filled in from the export.
VLLM_SPECULATIVE = {"parallel_drafting": True}
# What its vLLM serving path needs of vLLM (eaglet/engines/vllm/contracts.py makes them contract
# rows, checked by the doctor for a config that trains this type): (where, params, why).
VLLM_SERVING_CONTRACTS = (
    ("vllm.config:SpeculativeConfig", ".parallel_drafting",
     "P-EAGLE: the eval's speculative config sets parallel_drafting (draft.peagle.VLLM_SPECULATIVE)"),
    ("vllm.transformers_utils.configs.speculators.algos:SUPPORTED_SPECULATORS_TYPES", "+peagle",
     "P-EAGLE: vLLM reads the export's speculators_model_type peagle"),
    ("vllm.transformers_utils.configs.speculators.algos:update_peagle", "$mask_token_id $pard_token",
     "P-EAGLE: the export's mask_token_id becomes the mask slots' token (pard_token)"),
    ("vllm.model_executor.models.registry:_SPECULATIVE_DECODING_MODELS", "+PeagleLlamaForCausalLM",
     "P-EAGLE: the class vLLM serves the export with (update_peagle names it; Eagle3LlamaForCausalLM)"),
    ("vllm.model_executor.models.llama_eagle3:Eagle3LlamaForCausalLM.load_weights", "$mask_hidden",
     "P-EAGLE: the export's mask_hidden weight loads into the mask slots' hidden state"),
    ("vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer", "$pard_token",
     "P-EAGLE: the proposer fills the mask slots with pard_token"),
)

__all__ = ["NAME", "TITLE", "SERVING_METHOD", "layers", "build", "from_config", "host_rows", "prepare_training",
           "shard_units", "unroll_linears", "num_positions", "loss", "serving", "serving_format", "from_serving",
           "reload_logits", "proposer", "chain_hits", "SERVING_FORMATS", "VLLM_SPECULATIVE", "VLLM_SERVING_CONTRACTS"]


def layers(num_target_layers: int, cfg: Any) -> list[int] | None:
    """EAGLE-3's target states: extract.layers as configured."""
    return None


def build(cfg: Any, target_config: Any, draft_vocab_size: int, num_aux: int) -> PeagleDraft:
    """A fresh draft of the target's shape with the `peagle:` section's layers, depths and mask
    token (auto: `auto_mask_token_id`); residual = the un-normed hidden state, as speculators'
    P-EAGLE recipe trains it (--no-norm-before-residual)."""
    s = peagle_settings(cfg)
    mask = s["mask_token_id"]
    draft_cfg = PeagleConfig.from_target_config(
        target_config, draft_vocab_size, num_layers=int(s["layers"]), num_aux=int(num_aux), num_depths=int(s["depths"]),
        mask_token_id=auto_mask_token_id(target_config) if mask is None else int(mask))
    return PeagleDraft(draft_cfg)


def from_config(draft_config: dict[str, Any]) -> PeagleDraft:
    """The draft a saved PeagleConfig.to_dict() describes, weights not loaded."""
    return PeagleDraft(PeagleConfig(**draft_config))


def prepare_training(draft: nn.Module, compile: bool, sharded: bool) -> None:
    """Nothing to install: the depths run through the reference TTT attention (EAGLE-3's fast
    unroll chains one step's output into the next, which no depth here does)."""


def shard_units(draft: nn.Module) -> list[nn.Module]:
    """The decoder layers, one FSDP2 unit each."""
    return list(draft.layers)


def unroll_linears(draft: nn.Module) -> list[nn.Module] | None:
    """None: the plain AdamW."""
    return None


def num_positions(cfg: Any) -> int:
    """One loss and accuracy per depth."""
    return int(peagle_settings(cfg)["depths"])


def proposer(draft: nn.Module) -> PeagleProposer:
    return PeagleProposer(draft)  # type: ignore[arg-type]
