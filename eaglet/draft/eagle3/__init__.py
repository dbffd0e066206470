"""EAGLE-3: a draft that reads the target's low, mid and high states and drafts a chain one
step at a time, trained with training-time test (model.py has the architecture, training.py
the training entry points of eaglet/draft/base.py `DraftType`, loss.py the TTT loss)."""

from __future__ import annotations

from typing import Any

from .model import Eagle3Draft
from .propose import Eagle3Proposer
from .read_export import from_serving, serving_format
from .replay import chain_hits, replay_tree
from .serving import reload_logits, serving
from .training import (build, from_config, host_rows, layers, loss, num_positions, prepare_training, shard_units,
                       unroll_linears)

NAME = "eagle3"
TITLE = "EAGLE-3"
SERVING_METHOD = "eagle3"
SERVING_FORMATS = ("vllm", "sglang")  # the formats `serving` writes (serving.py)
ATTENTIONS = ("dense", "mla")  # the train.draft_attention values its layers take (model.py, mla.py)
# What its vLLM serving path needs of vLLM (eaglet/engines/vllm/contracts.py makes them contract
# rows, checked by the doctor for a config that trains this type): (where, params, why).
VLLM_SERVING_CONTRACTS = (
    ("vllm.config.speculative:SpeculativeMethod", "+eagle3", "EAGLE-3: the speculative method the vLLM eval sets"),
    ("vllm.model_executor.models.registry:_SPECULATIVE_DECODING_MODELS", "+Eagle3LlamaForCausalLM",
     "EAGLE-3: the class vLLM serves the export with (update_eagle3 names it)"),
    ("vllm.transformers_utils.configs.speculators.algos:SUPPORTED_SPECULATORS_TYPES", "+eagle3",
     "EAGLE-3: vLLM reads the export's speculators_model_type eagle3"),
)
# An MLA draft (train.draft_attention: mla) is served by another class, from a flat config vLLM reads
# as a DeepseekV3Config (serving_mla.py): these rows replace the ones above for such a config.
VLLM_SERVING_CONTRACTS_BY_ATTENTION = {"mla": (
    ("vllm.config.speculative:SpeculativeMethod", "+eagle3",
     "EAGLE-3: the speculative method the vLLM eval sets for an MLA draft"),
    ("vllm.model_executor.models.registry:_SPECULATIVE_DECODING_MODELS", "+Eagle3DeepseekV2ForCausalLM",
     "EAGLE-3: the class vLLM serves an MLA draft's export with (its architectures)"),
    ("vllm.transformers_utils.config:_CONFIG_REGISTRY", "+kimi_k2",
     "EAGLE-3: vLLM reads an MLA draft's model_type kimi_k2 as a DeepseekV3Config"),
    ("vllm.model_executor.models.deepseek_eagle3:DeepseekV2Eagle3Model",
     "$num_aux_hidden_states $target_hidden_size $fc_norm $norm_output",
     "EAGLE-3: the MLA export's keys that size fc and choose its norms"),
    ("vllm.model_executor.models.deepseek_eagle3:DeepseekV2Eagle3DecoderLayer", "$norm_before_residual",
     "EAGLE-3: the MLA export's key that chooses the first layer's residual"),
)}

__all__ = ["NAME", "TITLE", "SERVING_METHOD", "layers", "build", "from_config", "host_rows", "prepare_training",
           "shard_units", "unroll_linears", "num_positions", "loss", "proposer", "serving", "from_serving",
           "serving_format", "reload_logits", "chain_hits", "replay_tree", "config_problems", "SERVING_FORMATS", "ATTENTIONS",
           "VLLM_SERVING_CONTRACTS", "VLLM_SERVING_CONTRACTS_BY_ATTENTION"]


def config_problems(cfg: Any) -> list[tuple[str, str]]:
    """(what, fix) for each setting an EAGLE-3 draft of this config cannot be served with: an MLA
    layer without the queries' LoRA (no engine loads it: serving_mla.py says why)."""
    t = cfg.train
    if t.draft_attention == "mla" and t.mla_q_lora_rank == 0:
        return [("train.mla_q_lora_rank 0: vLLM's and SGLang's EAGLE-3 MLA layers load the queries' LoRA "
                 "(q_a_proj fused with kv_a_proj_with_mqa) only, so the draft could not be served",
                 "leave train.mla_q_lora_rank unset (the target's, or 3 x kv_lora_rank) or set it above 0")]
    return []


def proposer(draft: Eagle3Draft) -> Eagle3Proposer:
    """The draft's proposal state for in-process speculative decoding (batch 1): a chain
    (`propose`) or the EAGLE-2 tree (`propose_tree`)."""
    return Eagle3Proposer(draft)
