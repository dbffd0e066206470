"""The external APIs eaglet calls, as one table, and the check that they are still there.

A library that renames a function or drops a keyword argument breaks a run only when the
call is reached, which on a large target is after a long model load. Every such call of
eaglet's HF backend is a row of `CONTRACTS`; `check_contracts` inspects the installed
libraries' signatures in milliseconds, and `eaglet doctor` (and the preflight of `extract`
and `train`) reports each broken row as one line. Adding a contract is adding one row.

`where` is "module:Qualified.name", or "{role}.attr" for a class that depends on the target
(the roles the doctor fills in from a meta-device skeleton of the target model):

    {decoder_layer}   class(es) of the hooked decoder layers       (engines.hf.capture)
    {base_model}      the decoder stack without the LM head          (engines.hf.capture)
    {causal_lm}       the loaded model class                         (self-check, eval)
    {tokenizer}       the target tokenizer's class                   (prepare, chat.py)
    {vllm_model}      the target's vLLM model class (backend vllm)   (engines.vllm)

`params` is a space-separated list of rules on the signature (self/cls not counted):

    name     a parameter of that name exists
    ^name    leading parameters, in order: "^a ^b" means the first two are a, b
    a|b      at least one of them exists (an API that was renamed between versions)
    name?    a parameter, or arrives through **kwargs (the signature has **kwargs)
    ~name    read from **kwargs: the function's source mentions the string "name"
    $name    the source (of a function or a whole class) has the string literal "name": a
             key it reads or writes (a config key, a dict key of a file it saves)

and, on a class or a value rather than a callable:

    .name    a field of the class (dataclass, pydantic, msgspec or TypedDict field)
    +value   `value` is a member: of a Literal type, or a key of a dict, or an item of a list

Rows of stage "extract-vllm" are the vLLM APIs of `extract.backend: vllm`; the doctor checks
them (against the vLLM installed) only for that backend, see doctor.check_vllm.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import typing
from dataclasses import dataclass
from typing import Any

PIN = "pip install 'torch>=2.11,<2.15' 'transformers>=5.17' (the versions eaglet is tested with)"
# The oldest vLLM the backend accepts: load_hidden_states / cleanup_hidden_states exist from
# 0.22.0, but DeepSeek-V2/V3 (and Kimi-K2.5, which wraps it) return the state after the last
# layer for id L only from 0.25.0 (read from the 0.22-0.25 wheels' source). The contract test
# passes against 0.25.0 as well (VLLM_VERSION=0.25.0 VLLM_VENV=.venv-vllm25 scripts/vllm_venv.sh).
VLLM_MIN = "0.25.0"
VLLM_TESTED = "0.33.0"  # the vLLM the contract test (tests/test_vllm_contracts.py) runs against
VLLM_FIX = (f"install the vLLM eaglet is tested with into its own venv: VLLM_VERSION={VLLM_TESTED} bash "
            "scripts/vllm_venv.sh; or adapt eaglet/stages/extract_vllm.py to this vLLM")
_HS = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"


@dataclass(frozen=True)
class Contract:
    where: str
    params: str  # rules, see the module doc; "" = the attribute only has to exist
    why: str  # what in eaglet needs it
    fix: str = PIN
    stages: tuple[str, ...] = ("extract",)  # stages whose preflight checks it; the doctor checks all


CONTRACTS: list[Contract] = [
    # -- extract: capture with hooks on the target (eaglet/stages/extract.py, eaglet/targets/load.py)
    Contract("torch.nn:Module.register_forward_pre_hook", "^hook with_kwargs",
             "engines.hf.capture: pre-hooks with kwargs read the state entering each captured layer"),
    Contract("{decoder_layer}.forward", "^hidden_states",
             "engines.hf.capture: the hook reads hidden_states as args[0] or kwargs['hidden_states']",
             fix="the decoder layer's first parameter must be hidden_states: pin transformers, or adapt "
                 "engines.hf.capture's hook for this model (eaglet/engines/hf.py)"),
    Contract("{base_model}.forward", "input_ids attention_mask use_cache",
             "engines.hf.capture: the base model runs without the LM head and without a KV cache"),
    Contract("{causal_lm}.forward", "input_ids output_hidden_states?",
             "extract self-check: reference states from the model's own output_hidden_states and logits"),
    Contract("transformers:PreTrainedModel.from_pretrained", "~dtype",
             "target.load_target passes dtype= (older transformers only knew torch_dtype=)"),
    Contract("transformers:AutoModelForCausalLM.from_config", "",
             "doctor, targets.head: build the target's skeleton on the meta device (no weights)",
             stages=("extract", "extract-vllm")),
    Contract("transformers:AutoModelForImageTextToText.from_pretrained", "",
             "target.load_target: multimodal wrappers (Kimi-K2.5, Llava) are not CausalLM classes"),
    Contract("transformers:PreTrainedConfig.get_text_config", "",
             "target, extract, train: the text decoder's config inside a multimodal config",
             stages=("extract", "extract-vllm", "train")),
    Contract("safetensors:safe_open", "^filename ^framework device",
             "store, export: reading shards and weights lazily", stages=("extract", "extract-vllm", "train")),
    Contract("safetensors.torch:save", "^tensors", "extract.save_target_head: the target head file",
             stages=("extract", "extract-vllm")),
    # -- prepare: chat templates and loss masks (eaglet/targets/chat.py)
    Contract("{tokenizer}.apply_chat_template",
             "^conversation chat_template tokenize add_generation_prompt return_dict return_assistant_tokens_mask",
             "chat.render_with_mask: renders and, for {% generation %} templates, the assistant mask",
             stages=("prepare",)),
    Contract("{tokenizer}.get_chat_template", "", "chat.resolve_chat_template: the tokenizer's own template",
             stages=("prepare",)),
    Contract("{tokenizer}.__call__", "add_special_tokens return_offsets_mapping?",
             "chat.mask_by_prefixes: character offsets map assistant spans to tokens", stages=("prepare",)),
    Contract("transformers.utils.chat_template_utils:render_jinja_template",
             "conversations chat_template add_generation_prompt",
             "chat._render_empty: the generation prompt of an empty conversation (apply_chat_template refuses [])",
             stages=("prepare",)),
    # -- train: the draft's TTT attention (eaglet/draft/model.py) and its config
    Contract("torch.nn.attention.flex_attention:flex_attention",
             "^query ^key ^value block_mask scale enable_gqa return_aux|return_lse",
             "model._flex_with_lse: flex attention with its log-sum-exp (return_aux in new torch, return_lse in old)",
             stages=("train",)),
    Contract("torch.nn.attention.flex_attention:BlockMask.from_kv_blocks",
             "^kv_num_blocks ^kv_indices ^full_kv_num_blocks ^full_kv_indices BLOCK_SIZE mask_mod seq_lengths",
             "model.ttt_block_mask: the causal/document block mask of TTT step 0, from its blocks", stages=("train",)),
    Contract("torch.utils.checkpoint:checkpoint", "use_reentrant?",
             "model._chunked_causal_attention: recompute attention chunks in backward", stages=("train",)),
    Contract("transformers:AutoConfig.for_model", "^model_type",
             "families.text_config_from_dict (train.build_draft): the target config rebuilt from extract's target_config.json", stages=("train",)),
    # -- eval: speculative decoding with the target's KV cache (eaglet/engines/specdec.py)
    Contract("{causal_lm}.forward", "cache|past_key_values",
             "specdec: the target's KV-cache keyword (cache in transformers 5.24, past_key_values before)",
             stages=("eval",)),
    Contract("transformers:DynamicCache", "", "specdec: the target's KV cache", stages=("eval",)),
    # -- regenerate (eaglet/stages/regenerate.py), continuous engine
    Contract("transformers:GenerationMixin.generate_batch", "^inputs generation_config progress_bar",
             "regenerate --engine continuous: transformers' continuous batching", stages=("regenerate",),
             fix="use `eaglet regenerate --engine generate`, or pip install 'transformers>=5.17'"),
    Contract("transformers:ContinuousBatchingConfig", "num_blocks max_batch_tokens",
             "regenerate --engine continuous on a CPU: sizes the paged KV cache to the work", stages=("regenerate",),
             fix="use `eaglet regenerate --engine generate`, or pip install 'transformers>=5.17'"),
    # -- extract with backend vllm (eaglet/stages/extract_vllm.py): vLLM's native hidden-state path
    *[Contract(where, params, why, fix=VLLM_FIX, stages=("extract-vllm",)) for where, params, why in [
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
         "doctor.check_vllm: resolves the target's vLLM model class"),
        ("{vllm_model}.supports_eagle3", "",
         "the target's vLLM model class implements SupportsEagle3: it can return auxiliary hidden-state layers"),
        ("{vllm_model}.set_aux_hidden_state_layers", "^layers",
         "vLLM hands the requested layer ids to the target's model class through this method"),
    ]],
]


@dataclass
class ContractResult:
    contract: Contract
    target: str  # the resolved name that was checked
    ok: bool
    found: str  # the signature (or why it could not be read)
    problem: str = ""  # what is missing, when not ok


def _resolve_static(where: str) -> Any:
    module, _, attr = where.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _short_sig(sig: inspect.Signature, limit: int = 160) -> str:
    text = "(" + ", ".join(str(p).split(":")[0].split("=")[0].strip() for p in sig.parameters.values()) + ")"
    return text if len(text) <= limit else text[: limit - 4] + "...)"


def _field_names(obj: Any) -> set[str]:
    """Fields of a dataclass, pydantic model, msgspec struct or TypedDict (annotations over the MRO)."""
    if dataclasses.is_dataclass(obj):
        return {f.name for f in dataclasses.fields(obj)}
    if isinstance(getattr(obj, "model_fields", None), dict):
        return set(obj.model_fields)
    if isinstance(getattr(obj, "__struct_fields__", None), tuple):
        return set(obj.__struct_fields__)
    return {n for k in getattr(obj, "__mro__", (type(obj),)) for n in getattr(k, "__annotations__", {})}


def _members(obj: Any) -> tuple[set[Any], str]:
    """(members, what they are) of a Literal type (nested and Optional ones flattened), dict or collection."""
    if typing.get_origin(obj) is not None:
        out: set[Any] = set()
        for arg in typing.get_args(obj):
            out |= _members(arg)[0] if typing.get_origin(arg) is not None else {arg}
        return out, "Literal values"
    if isinstance(obj, dict):
        return set(obj), "keys"
    if isinstance(obj, (list, tuple, set, frozenset)):
        return set(obj), "items"
    return set(), f"no members (a {type(obj).__name__})"


def _check_object_rules(obj: Any, rules: list[str]) -> tuple[str, str]:
    fields = sorted(_field_names(obj)) if any(r.startswith(".") for r in rules) else []
    members, kind = _members(obj) if any(r.startswith("+") for r in rules) else (set(), "")
    problems = [f"no field {r[1:]}" for r in rules if r.startswith(".") and r[1:] not in fields]
    problems += [f"{r[1:]!r} is not among its {kind}" for r in rules if r.startswith("+") and r[1:] not in members]
    found = f"fields ({', '.join(fields)})" if fields else f"{len(members)} {kind}"
    return (found if len(found) <= 160 else found[:156] + "...)"), "; ".join(problems)


def _check_rules(fn: Any, rules: str) -> tuple[str, str]:
    """(found signature, problem or '') for one callable and one rule string."""
    if not rules:
        return "exists", ""
    if any(r[0] in ".+" for r in rules.split()):
        return _check_object_rules(fn, rules.split())
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        return f"no signature ({e})", "its signature cannot be read"
    params = [p for p in sig.parameters.values() if p.name not in ("self", "cls")]
    names = [p.name for p in params]
    has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    named = [p.name for p in params if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]
    found = _short_sig(sig)
    problems = []
    leading = [r[1:] for r in rules.split() if r.startswith("^")]
    if leading and named[: len(leading)] != leading:
        problems.append(f"leading parameters {named[:len(leading)]} instead of {leading}")
    for rule in rules.split():
        if rule.startswith("^"):
            continue
        if rule[0] in "~$":
            name = rule[1:]
            if rule[0] == "~" and name in names:
                continue
            try:
                src = inspect.getsource(fn)
            except (OSError, TypeError):
                src = ""
            if f'"{name}"' not in src and f"'{name}'" not in src:
                problems.append(f"does not read {name}= (not a parameter, and its source never mentions it)"
                                if rule[0] == "~" else f"its source never names {name!r}")
        elif rule.endswith("?"):
            if rule[:-1] not in names and not has_var_kw:
                problems.append(f"no parameter {rule[:-1]} and no **kwargs")
        elif "|" in rule:
            if not any(a in names for a in rule.split("|")):
                problems.append(f"none of the parameters {rule.split('|')}")
        elif rule not in names:
            problems.append(f"no parameter {rule}")
    return found, "; ".join(problems)


def describe(rules: str) -> str:
    """A rule string in words, for the doctor's lines."""
    if not rules:
        return "to exist"
    words = []
    leading = [r[1:] for r in rules.split() if r.startswith("^")]
    if leading:
        words.append("first parameter(s) " + ", ".join(leading))
    for r in rules.split():
        if r.startswith("."):
            words.append(f"field {r[1:]}")
        elif r.startswith("+"):
            words.append(f"member {r[1:]!r}")
        elif r.startswith("~"):
            words.append(f"{r[1:]}= read from **kwargs")
        elif r.startswith("$"):
            words.append(f"{r[1:]!r} named in its source")
        elif r.endswith("?"):
            words.append(f"{r[:-1]} (or **kwargs)")
        elif "|" in r:
            words.append(" or ".join(r.split("|")))
        elif not r.startswith("^"):
            words.append(r)
    if all(r[0] in ".+$" for r in rules.split()):
        return ", ".join(words)
    return "parameters: " + ", ".join(words)


def needs_vllm(c: Contract) -> bool:
    """A row about vLLM itself (checked only where vLLM is installed, see doctor.check_vllm)."""
    return c.where.startswith(("vllm", "{vllm_"))


def check_contracts(roles: dict[str, list[type]] | None = None, stages: set[str] | None = None,
                    vllm: bool = True) -> list[ContractResult]:
    """Check every contract (of `stages`, default all; `vllm` False: not the vLLM rows). `roles`
    maps a role name to the classes it stands for; a role that is not given is skipped."""
    roles = roles or {}
    out = []
    for c in CONTRACTS:
        if stages is not None and not stages & set(c.stages):
            continue
        if not vllm and needs_vllm(c):
            continue
        if c.where.startswith("{"):
            role, _, attr = c.where[1:].partition("}.")
            targets = [(f"{cls.__module__}.{cls.__qualname__}.{attr}", getattr(cls, attr, None))
                       for cls in roles.get(role, [])]
        else:
            try:
                targets = [(c.where.replace(":", "."), _resolve_static(c.where))]
            except (ImportError, AttributeError) as e:
                out.append(ContractResult(c, c.where.replace(":", "."), False, f"missing ({type(e).__name__}: {e})",
                                          "not found"))
                continue
        for name, obj in targets:
            if obj is None:
                out.append(ContractResult(c, name, False, "missing", "not found"))
                continue
            found, problem = _check_rules(obj, c.params)
            out.append(ContractResult(c, name, not problem, found, problem))
    return out
