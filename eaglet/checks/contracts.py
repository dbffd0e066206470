"""The external APIs eaglet calls, as one table, and the check that they are still there.

A library that renames a function or drops a keyword argument breaks a run only when the
call is reached, which on a large target is after a long model load. Every such call is a
row of `CONTRACTS`; `check_contracts` inspects the installed libraries in milliseconds, and
`eaglet doctor` (and the preflight of each stage that loads a model or renders templates:
prepare, extract, train, eval, regenerate) reports each broken row as one line. Adding a
contract is adding one row.

`where` is "module:Qualified.name", or "{role}.attr" for a class that depends on the target
(the roles the doctor fills in from a meta-device skeleton of the target model):

    {decoder_layer}   class(es) of the hooked decoder layers       (engines.hf.capture, specdec)
    {base_model}      the decoder stack without the LM head          (engines.hf.capture)
    {causal_lm}       the loaded model class                         (self-check, eval)
    {tokenizer}       the target tokenizer's class                   (prepare, chat.py, regenerate)
    {vllm_model}      the target's vLLM model class (backend vllm)   (engines.vllm)

`params` is a space-separated list of rules (self/cls not counted):

    name     a parameter of that name exists
    ^name    leading parameters, in order: "^a ^b" means the first two are a, b
    a|b      at least one of them exists (an API that was renamed between versions)
    name?    a parameter, or arrives through **kwargs (the signature has **kwargs)
    @probe   a behavioural probe (PROBES): for a keyword read from **kwargs, where the
             signature cannot say; e.g. @dtype loads a tiny model saved to a temporary folder
             with from_pretrained(dtype=float16) and checks its parameters' dtype
    $name    the code (of a function or a whole class) has the string literal "name" (comments
             and docstrings do not count): a key it reads or writes (a config key, a dict key of
             a file it saves). Only the vLLM rows use it: what vLLM reads from a config or
             writes into a file shows only when an engine runs on a GPU, so a literal in its
             code is the cheapest evidence there is; tests/test_vllm_backend.py runs the real
             engine where a GPU is.

and, on a class or a value rather than a callable:

    .name    a field of the class (dataclass, pydantic, msgspec or TypedDict field)
    +value   `value` is a member: of a Literal type, or a key of a dict, or an item of a list

`passes`: the parameters eaglet's call passes (or, for a decoder layer, the base model's call
of it), besides those the rules name, by name or, "#n", the first n by position: a parameter
without a default that is none of them nor *args/**kwargs FAILs (a new required parameter
breaks the call). None: not checked.

`when`: the contract applies only where its code path is taken, a predicate on the config
(flex attention only where train.attn_impl resolves to flex; continuous batching only for
regenerate.engine continuous); None: always. An engine's own rows carry a stage of its
own (its `CONTRACT_STAGES`: "extract" for the HF engine's hooks, "extract-vllm" for the vLLM
APIs of `extract.backend: vllm`); the engine package says which of them a config calls
(`contract_stages`) and which cannot be checked here (`unchecked_contract`: vLLM not
installed), and the doctor (doctor.check_api_contracts) passes that on.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import tempfile
import textwrap
import typing
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..config import Config
from ..distributed import resolve_device
from ..draft.eagle3.attention import resolve_attn_impl

PIN = "pip install 'torch>=2.11,<2.15' 'transformers>=5.17' (the versions eaglet is tested with)"


# ---- where a contract's code path is taken (Contract.when) ---------------------------------------

def train_attention(cfg: Config) -> str:
    """The TTT attention training will use (train.attn_impl on train.device, as the trainer resolves it)."""
    return resolve_attn_impl(cfg.train.attn_impl, resolve_device(cfg.train.device))


def flex_training(cfg: Config) -> bool:
    return train_attention(cfg) == "flex"


def chunked_training(cfg: Config) -> bool:
    return train_attention(cfg) == "chunked"


def continuous_regenerate(cfg: Config) -> bool:
    """regenerate.engine continuous ('auto' is the padded engine: engines.hf.generate.resolve_engine)."""
    return cfg.regenerate.engine == "continuous"


def padded_regenerate(cfg: Config) -> bool:
    """regenerate.engine generate or auto (engine openai runs no model here)."""
    return cfg.regenerate.engine in ("auto", "generate")


def static_cache_regenerate(cfg: Config) -> bool:
    """The padded engine with a static KV cache ('auto' is dynamic: engines.hf.generate.resolve_kv_cache)."""
    return padded_regenerate(cfg) and cfg.regenerate.kv_cache == "static"


@dataclass(frozen=True)
class Contract:
    where: str
    params: str  # rules, see the module doc; "" = the attribute only has to exist
    why: str  # what in eaglet needs it
    fix: str = PIN
    stages: tuple[str, ...] = ("extract",)  # stages whose preflight checks it; the doctor checks all
    passes: str | None = None  # what the call passes besides the rules' names; any other required parameter FAILs
    when: Callable[[Config], bool] | None = None  # applies only where this holds for the config (None: always)


# What a base model's call of its decoder layers passes (transformers 5.17 to 5.24): the state
# positionally, these by keyword.
_LAYER_CALL = "attention_mask position_ids position_embeddings cache past_key_values use_cache cache_position"
_REGEN_FIX = "use `eaglet regenerate --engine generate`, or pip install 'transformers>=5.17'"

CONTRACTS: list[Contract] = [
    # -- extract: capture with hooks on the target (eaglet/stages/extract.py, eaglet/targets/load.py)
    Contract("torch.nn:Module.register_forward_pre_hook", "^hook with_kwargs",
             "engines.hf.capture, specdec: pre-hooks with kwargs read the state entering each captured layer",
             stages=("extract", "eval"), passes=""),
    Contract("{decoder_layer}.forward", "^hidden_states",
             "engines.hf.capture, specdec: the hook reads hidden_states as args[0] or kwargs['hidden_states']; "
             "the base model calls the layer with the state and its own keywords only",
             fix="the decoder layer's first parameter must be hidden_states and it may require nothing the base model "
                 "does not pass: pin transformers, or adapt engines.hf.capture's hook for this model (eaglet/engines/hf/capture.py)",
             stages=("extract", "eval"), passes=_LAYER_CALL),
    Contract("{base_model}.forward", "input_ids attention_mask use_cache",
             "engines.hf.capture: the base model runs without the LM head and without a KV cache", passes=""),
    Contract("{causal_lm}.forward", "input_ids output_hidden_states?",
             "extract self-check: reference states from the model's own output_hidden_states and logits",
             passes="use_cache"),
    Contract("transformers:PreTrainedModel.from_pretrained", "@dtype",
             "target.load_target passes dtype= (older transformers only knew torch_dtype=)",
             stages=("extract", "eval", "regenerate"), passes="#1"),
    Contract("transformers:AutoModelForCausalLM.from_config", "",
             "doctor, targets.head: build the target's skeleton on the meta device (no weights)",
             stages=("extract", "extract-vllm", "eval")),
    Contract("transformers:AutoModelForImageTextToText.from_pretrained", "",
             "target.load_target: multimodal wrappers (Kimi-K2.5, Llava) are not CausalLM classes",
             stages=("extract", "eval", "regenerate")),
    Contract("transformers:PreTrainedConfig.get_text_config", "",
             "target, extract, train, eval: the text decoder's config inside a multimodal config",
             stages=("extract", "extract-vllm", "train", "eval", "regenerate")),
    Contract("safetensors:safe_open", "^filename ^framework device",
             "store, export: reading shards and weights lazily", stages=("extract", "extract-vllm", "train"),
             passes=""),
    Contract("safetensors.torch:save", "^tensors", "extract.save_target_head: the target head file",
             stages=("extract", "extract-vllm"), passes=""),
    # -- prepare: chat templates and loss masks (eaglet/targets/chat.py); regenerate's prompts
    Contract("{tokenizer}.apply_chat_template",
             "^conversation chat_template tokenize add_generation_prompt return_dict return_assistant_tokens_mask",
             "chat.render_with_mask: renders and, for {% generation %} templates, the assistant mask",
             stages=("prepare", "regenerate"), passes=""),
    Contract("{tokenizer}.get_chat_template", "", "chat.resolve_chat_template: the tokenizer's own template",
             stages=("prepare", "regenerate"), passes=""),
    Contract("{tokenizer}.__call__", "add_special_tokens return_offsets_mapping?",
             "chat.mask_by_prefixes: character offsets map assistant spans to tokens", stages=("prepare", "regenerate"),
             passes="#1"),
    Contract("transformers.utils.chat_template_utils:render_jinja_template",
             "conversations chat_template add_generation_prompt",
             "chat._render_empty: the generation prompt of an empty conversation (apply_chat_template refuses [])",
             stages=("prepare",), passes=""),
    # -- train: the draft's TTT attention (eaglet/draft/eagle3/attention.py) and its config
    Contract("torch.nn.attention.flex_attention:flex_attention",
             "^query ^key ^value block_mask scale enable_gqa return_aux|return_lse",
             "attention._flex_with_lse: flex attention with its log-sum-exp (return_aux in new torch, return_lse in old)",
             stages=("train",), passes="", when=flex_training),
    Contract("torch.nn.attention.flex_attention:BlockMask.from_kv_blocks",
             "^kv_num_blocks ^kv_indices ^full_kv_num_blocks ^full_kv_indices BLOCK_SIZE mask_mod seq_lengths",
             "attention.ttt_block_mask: the causal/document block mask of TTT step 0, from its blocks",
             stages=("train",), passes="", when=flex_training),
    Contract("torch.utils.checkpoint:checkpoint", "use_reentrant?",
             "attention._chunked_causal_attention: recompute attention chunks in backward", stages=("train",),
             passes="#1", when=chunked_training),
    Contract("transformers:AutoConfig.for_model", "^model_type",
             "families.text_config_from_dict (train.build_draft): the target config rebuilt from extract's "
             "target_config.json", stages=("train",), passes=""),
    # -- eval: speculative decoding with the target's KV cache (eaglet/engines/hf/decode.py)
    Contract("{causal_lm}.forward", "cache|past_key_values",
             "specdec: the target's KV-cache keyword (cache in transformers 5.24, past_key_values before)",
             stages=("eval",), passes="input_ids position_ids use_cache attention_mask logits_to_keep"),
    Contract("transformers:DynamicCache", "", "specdec: the target's KV cache, made empty", stages=("eval",),
             passes=""),
    # -- regenerate (eaglet/engines/hf/generate.py): the padded engine, or continuous batching
    Contract("transformers:GenerationMixin.generate", "input_ids? attention_mask? max_new_tokens? pad_token_id?",
             "regenerate's padded engine: model.generate on left-padded prompts", stages=("regenerate",),
             passes="do_sample temperature top_p top_k cache past_key_values", when=padded_regenerate),
    Contract("transformers:StaticCache", "config max_cache_len",
             "regenerate --kv-cache static: a preallocated cache sized per call", stages=("regenerate",), passes="",
             when=static_cache_regenerate, fix="use `eaglet regenerate --kv-cache dynamic`, or " + PIN),
    Contract("transformers:GenerationMixin.generate_batch", "^inputs generation_config progress_bar",
             "regenerate --engine continuous: transformers' continuous batching", stages=("regenerate",),
             fix=_REGEN_FIX, passes="continuous_batching_config", when=continuous_regenerate),
    Contract("transformers:ContinuousBatchingConfig", "num_blocks max_batch_tokens",
             "regenerate --engine continuous on a CPU: sizes the paged KV cache to the work", stages=("regenerate",),
             fix=_REGEN_FIX, passes="max_memory_percent", when=continuous_regenerate),
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


def _code_literals(obj: Any) -> set[str] | None:
    """The string literals of `obj`'s code (a function or a class), docstrings and other string
    statements left out (comments are not in the tree); None when its source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError):
        return None
    statements = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return {n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in statements}


def _probe_dtype(fn: Any) -> tuple[str, str]:
    """load_target's call, from_pretrained(folder, dtype=...), on a tiny float32 Llama saved to a
    temporary folder (a fraction of a second): its parameters must come back in float16. What
    from_pretrained reads from **kwargs is visible only in what it does."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=32)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its save and load bars would read as the target's
    try:
        with tempfile.TemporaryDirectory(prefix="eaglet-dtype-probe-") as folder:
            LlamaForCausalLM(config).to(torch.float32).save_pretrained(folder)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float16)
    except Exception as e:  # noqa: BLE001 - the message is the finding
        return "raised", f"from_pretrained(dtype=torch.float16) raised {type(e).__name__}: {str(e)[:200]}"
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    dtypes = sorted({str(q.dtype).removeprefix("torch.") for q in model.parameters()})
    found = f"a tiny model loaded with dtype=torch.float16 has {'/'.join(dtypes)} parameters"
    return found, "" if dtypes == ["float16"] else "dtype= is not honoured"


# name -> (what it checks, in words; the probe: the resolved object -> (found, problem or ''))
PROBES: dict[str, tuple[str, Callable[[Any], tuple[str, str]]]] = {
    "dtype": ("dtype= honoured (a tiny model loaded with dtype=float16 comes back in float16)", _probe_dtype),
}


def _names(rules: str) -> set[str]:
    """The parameter names the signature rules speak of."""
    out: set[str] = set()
    for r in rules.split():
        if r[0] not in "@$.+":
            out |= set(r.lstrip("^").rstrip("?").split("|"))
    return out


def _unpassed(params: list[inspect.Parameter], passes: str, rules: str) -> list[str]:
    """Parameters without a default, other than *args/**kwargs, that the call does not pass
    (`passes`: names, or "#n" for the first n positional parameters, besides the rules' names)."""
    names = _names(rules) | {t for t in passes.split() if not t.startswith("#")}
    n_pos = sum(int(t[1:]) for t in passes.split() if t.startswith("#"))
    positional = [q.name for q in params if q.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                        inspect.Parameter.POSITIONAL_OR_KEYWORD)][:n_pos]
    return [q.name for q in params if q.default is inspect.Parameter.empty and q.name not in names
            and q.name not in positional and q.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                            inspect.Parameter.VAR_KEYWORD)]


def _check_rules(fn: Any, rules: str, passes: str | None = None) -> tuple[str, str]:
    """(found signature, problem or '') for one callable, one rule string and what its call passes."""
    if not rules and passes is None:
        return "exists", ""
    if any(r[0] in ".+" for r in rules.split()):
        return _check_object_rules(fn, rules.split())
    found, problems = "", []
    for rule in rules.split():
        if rule[0] == "@":
            found, problem = PROBES[rule[1:]][1](fn)
            problems += [problem] if problem else []
    if all(r[0] == "@" for r in rules.split()) and passes is None:
        return found, "; ".join(problems)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        return f"no signature ({e})", "its signature cannot be read"
    params = [p for p in sig.parameters.values() if p.name not in ("self", "cls")]
    names = [p.name for p in params]
    has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    named = [p.name for p in params if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]
    found = _short_sig(sig) + (f"; {found}" if found else "")
    leading = [r[1:] for r in rules.split() if r.startswith("^")]
    if leading and named[: len(leading)] != leading:
        problems.append(f"leading parameters {named[:len(leading)]} instead of {leading}")
    literals = _code_literals(fn) if any(r[0] == "$" for r in rules.split()) else None
    for rule in rules.split():
        if rule[0] in "^@":
            continue
        if rule[0] == "$":
            if literals is None:
                problems.append("its source cannot be read")
            elif rule[1:] not in literals:
                problems.append(f"its source never names {rule[1:]!r}")
        elif rule.endswith("?"):
            if rule[:-1] not in names and not has_var_kw:
                problems.append(f"no parameter {rule[:-1]} and no **kwargs")
        elif "|" in rule:
            if not any(a in names for a in rule.split("|")):
                problems.append(f"none of the parameters {rule.split('|')}")
        elif rule not in names:
            problems.append(f"no parameter {rule}")
    if passes is not None:
        extra = _unpassed(params, passes, rules)
        if extra:
            problems.append(f"requires {', '.join(extra)}, which eaglet's call does not pass")
    return found, "; ".join(problems)


def describe(rules: str, passes: str | None = None) -> str:
    """A rule string (and `passes`) in words, for the doctor's lines."""
    if not rules:
        return "to exist" if passes is None else "no required parameter"
    words = []
    leading = [r[1:] for r in rules.split() if r.startswith("^")]
    if leading:
        words.append("first parameter(s) " + ", ".join(leading))
    for r in rules.split():
        if r.startswith("."):
            words.append(f"field {r[1:]}")
        elif r.startswith("+"):
            words.append(f"member {r[1:]!r}")
        elif r.startswith("@"):
            words.append(PROBES[r[1:]][0])
        elif r.startswith("$"):
            words.append(f"{r[1:]!r} as a string in its code")
        elif r.endswith("?"):
            words.append(f"{r[:-1]} (or **kwargs)")
        elif "|" in r:
            words.append(" or ".join(r.split("|")))
        elif not r.startswith("^"):
            words.append(r)
    if passes is not None:
        given = [f"the first {t[1:]} by position" if t.startswith("#") else t for t in passes.split()]
        words.append("no other required parameter" + (f" than {', '.join(given)}" if given else ""))
    if all(r[0] in ".+$@" for r in rules.split()) and passes is None:
        return ", ".join(words)
    return "parameters: " + ", ".join(words)


def select_contracts(stages: set[str] | None = None, cfg: Config | None = None,
                     unchecked: Callable[[Contract], bool] | None = None,
                     rows: Sequence[Contract] | None = None) -> tuple[list[Contract], list[Contract]]:
    """(the contracts to check, those off this config's code path): of `rows` (default
    CONTRACTS; the doctor adds each engine's own), those of `stages` (default all), less those
    `unchecked` names (an engine's library not installed here), whose `when` holds for `cfg`
    (None: every row)."""
    rows = [c for c in (CONTRACTS if rows is None else rows)
            if (stages is None or stages & set(c.stages)) and not (unchecked and unchecked(c))]
    on = [cfg is None or c.when is None or c.when(cfg) for c in rows]
    return [c for c, k in zip(rows, on) if k], [c for c, k in zip(rows, on) if not k]


def check_contracts(roles: dict[str, list[type]] | None = None, stages: set[str] | None = None,
                    cfg: Config | None = None, unchecked: Callable[[Contract], bool] | None = None,
                    rows: Sequence[Contract] | None = None) -> list[ContractResult]:
    """Check every contract (of `stages`, default all; not those `unchecked` names; `cfg`: only
    those on its code path). `roles` maps a role name to the classes it stands for; a role that
    is not given is skipped."""
    roles = roles or {}
    out = []
    for c in select_contracts(stages, cfg, unchecked, rows)[0]:
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
            found, problem = _check_rules(obj, c.params, c.passes)
            out.append(ContractResult(c, name, not problem, found, problem))
    return out
