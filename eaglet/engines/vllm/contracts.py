"""The vLLM engine's API contracts: the rows of eaglet/checks/contracts.py's table (same rules)
for what eaglet calls of vLLM, under stage "extract-vllm" (extraction and streaming through vLLM)
and "eval-vllm" (the vLLM eval serving the exported draft: what each draft type's serving path
needs, its VLLM_SERVING_CONTRACTS, on the code path of a config that trains that type). The
doctor checks them beside the common rows where vLLM is installed (`unchecked_contract` in this
package's __init__.py says where it is not); tests/test_vllm_contracts.py runs them against a real vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...checks.contracts import Contract
from ...config import Config
from ...draft import DRAFT_TYPES, draft_type
from .capture import CONNECTOR_MODULE as _HS

EVAL_STAGE = "eval-vllm"

# The oldest vLLM the backend accepts: load_hidden_states / cleanup_hidden_states exist from
# 0.22.0, but DeepSeek-V2/V3 (and Kimi-K2.5, which wraps it) return the state after the last
# layer for id L only from 0.25.0 (read from the 0.22-0.25 wheels' source). The contract test
# passes against 0.25.0 as well (VLLM_VERSION=0.25.0 VLLM_VENV=.venv-vllm25 scripts/vllm_venv.sh).
VLLM_MIN = "0.25.0"
VLLM_TESTED = "0.33.0"  # the vLLM the contract test (tests/test_vllm_contracts.py) runs against
VLLM_FIX = (f"install the vLLM eaglet is tested with into its own venv: VLLM_VERSION={VLLM_TESTED} bash "
            "scripts/vllm_venv.sh; or adapt eaglet/engines/vllm/extract.py to this vLLM")
CONTRACTS: list[Contract] = [
    Contract(where, params, why, fix=VLLM_FIX, stages=("extract-vllm",)) for where, params, why in [
        ("vllm.config.speculative:SpeculativeMethod", "+extract_hidden_states",
         "engines.vllm.speculative_config: the method that returns the states of the requested layer ids"),
        ("vllm.config:SpeculativeConfig", ".method .num_speculative_tokens .draft_model_config",
         "engines.vllm.speculative_config: the fields eaglet sets"),
        ("vllm.v1.spec_decode.extract_hidden_states:ExtractHiddenStatesProposer.__init__",
         "$eagle_aux_hidden_state_layer_ids",
         "engines.vllm.speculative_config: the layer ids, read from the draft hf_config under this key"),
        ("vllm.config:KVTransferConfig", ".kv_connector .kv_role .kv_connector_extra_config",
         "engines.vllm.kv_transfer_config: the fields eaglet sets"),
        ("vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory._registry",
         "+ExampleHiddenStatesConnector", "engines.vllm.kv_transfer_config: the connector's registered name"),
        (f"{_HS}:ExampleHiddenStatesConnector", "$shared_storage_path $hidden_states_path $hidden_states $token_ids",
         "engines.vllm: the connector writes hidden_states [T, n, H] and token_ids [T] under shared_storage_path and "
         "names the file in kv_transfer_params['hidden_states_path']"),
        (f"{_HS}:load_hidden_states", "^path", "engines.vllm: reads a request's file once its writer is done"),
        (f"{_HS}:cleanup_hidden_states", "^path", "engines.vllm: removes a request's file and lock once stored"),
        ("vllm.engine.arg_utils:EngineArgs", ".model .tokenizer .dtype .trust_remote_code .revision "
         ".speculative_config .kv_transfer_config .max_model_len .enable_prefix_caching",
         "engines.vllm.engine_args: the engine arguments eaglet sets"),
        ("vllm:LLM.__init__", "^model", "engines.vllm.LocalEngine: the in-process engine"),
        ("vllm:LLM.generate", "^prompts sampling_params use_tqdm", "engines.vllm.LocalEngine.run"),
        ("vllm:SamplingParams", ".max_tokens .temperature .detokenize .prompt_logprobs",
         "engines.vllm: one generated token per prompt; prompt logprobs for the self-check"),
        ("vllm.inputs:TokensPrompt", ".prompt_token_ids", "engines.vllm.LocalEngine.run: prompts as prepare's ids"),
        ("vllm.outputs:RequestOutput.__init__", "prompt_logprobs kv_transfer_params",
         "engines.vllm.LocalEngine.run: the file path and the self-check's logprobs"),
        ("vllm.logprobs:Logprob", ".logprob", "checks.selfcheck.logprob_agreement: vLLM's score of each top token"),
        ("vllm.entrypoints.openai.completion.protocol:CompletionRequest", ".prompt_logprobs .return_token_ids",
         "engines.vllm.ServerEngine (extract.vllm_server): the completion request eaglet sends"),
        ("vllm.entrypoints.openai.completion.protocol:CompletionResponse", ".kv_transfer_params",
         "engines.vllm.ServerEngine (extract.vllm_server): the file path in the response"),
        ("vllm.model_executor.models:ModelRegistry._try_load_model_cls", "^model_arch",
         "engines.vllm.checks: resolves the target's vLLM model class"),
        ("{vllm_model}.supports_eagle3", "",
         "the target's vLLM model class implements SupportsEagle3: it can return auxiliary hidden-state layers"),
        ("{vllm_model}.set_aux_hidden_state_layers", "^layers",
         "vLLM hands the requested layer ids to the target's model class through this method"),
    ]
]


def trains(kind: Any, attentions: tuple[str, ...] | None = None) -> Callable[[Config], bool]:
    """The `when` of a draft type's rows: the config's train.algorithm is that type (and, given
    `attentions`, its train.draft_attention one of them)."""
    return lambda cfg: draft_type(cfg.train.algorithm) is kind and (
        attentions is None or cfg.train.draft_attention in attentions)


def serving_contracts() -> list[Contract]:
    """Every registered draft type's VLLM_SERVING_CONTRACTS as rows of stage "eval-vllm", each on
    the code path of a config that trains that type; where the type has its own rows for an
    attention (VLLM_SERVING_CONTRACTS_BY_ATTENTION: EAGLE-3's MLA layers), those instead for a
    config that trains it with that train.draft_attention."""
    rows = []
    for kind in DRAFT_TYPES.values():
        variants: dict[str, tuple] = getattr(kind, "VLLM_SERVING_CONTRACTS_BY_ATTENTION", {})
        others = tuple(a for a in getattr(kind, "ATTENTIONS", ("dense",)) if a not in variants) if variants else None
        for attentions, table in [(others, getattr(kind, "VLLM_SERVING_CONTRACTS", ())),
                                  *(((a,), table) for a, table in variants.items())]:
            rows += [Contract(where, params, why, fix=VLLM_FIX, stages=(EVAL_STAGE,), when=trains(kind, attentions))
                     for where, params, why in table]
    return rows


CONTRACTS += serving_contracts()
