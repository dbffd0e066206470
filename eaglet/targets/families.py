"""Target families: one small adapter per architecture, in one registry.

Everything eaglet touches inside a target model is found through its family's adapter:

    decoder       dotted paths, tried in order from the loaded model, to the decoder stack
                  (embeddings -> layers -> final norm, no LM head). A CausalLM has it at `model`;
                  transformers' multimodal classes at `model.language_model`; remote-code
                  wrappers that hold a whole CausalLM (Kimi-K2.5's) at `language_model.model`.
    lm_head       dotted paths to the LM head (`lm_head`, or `language_model.lm_head`).
    layers, norm, embed_tokens   names inside the decoder stack.
    layer_input   the decoder layer's parameter that carries the residual stream; extraction's
                  pre-hooks read it as the first positional argument or by this keyword.
    embed_scale   the factor the decoder multiplies the embedding lookup by (Gemma: sqrt(H)),
                  so the draft's frozen embedding gives what the target's first layer sees.
    logit_scale, logit_softcap   what the CausalLM does to lm_head(final) (Gemma's final
                  tanh softcap; a Cohere-style logit_scale), so the teacher is the target's own
                  distribution.
    norm_offset   the final norm computes normed(x) * (offset + weight) (Gemma: 1).

A family is looked up by the loaded config's `model_type` (a wrapper's own first, then its
text config's). An architecture that is not here is refused with the list of families and a
pointer to this module: adding a family is adding one `Family` to `FAMILIES`, with a tiny
random config (`tiny_config`) that the tests in tests/test_families.py then run through
extraction, the self-check, the doctor's shadow run and a few training steps.

The draft is a dense Llama-style layer for every family; its sizes follow the rule in
`eaglet.draft.eagle3.model.DraftConfig.from_target_config` (MLA targets: head_dim 128, H/128 heads, 8 KV
heads; MoE targets: the dense layers' width, else 4 x H rounded up to 256).

    python -m eaglet.targets.families   # prints the table of docs/families.md
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..draft import draft_type
from ..errors import InputError

ADD_FAMILY = "eaglet/targets/families.py"

# Where decoders sit: a CausalLM, transformers' multimodal classes, remote-code wrappers.
DECODER_PATHS = ("model", "model.language_model", "language_model.model", "language_model")
HEAD_PATHS = ("lm_head", "language_model.lm_head")

# The tiny configs' shared sizes (64 wide, 8 layers: default captured layers [2, 4, 5]).
TINY_BASE: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=4096, tie_word_embeddings=False,
)


class UnsupportedFamily(InputError, ValueError):
    """The target's architecture has no adapter (or its parts are not where the adapter says).
    `reason`: the short form, without the list of families."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message


@dataclass(frozen=True)
class Family:
    key: str  # short id (tests, tiny configs)
    name: str  # as docs/families.md names it
    model_types: tuple[str, ...]  # config model_type(s) served (a wrapper's own or its text config's)
    hf_class: str  # the transformers class that loads it
    example: str  # a real checkpoint of the family, and its decoder layers (the table's layer ids)
    example_layers: int
    attention: str  # the table: attention kind
    mlp: str  # the table: dense or MoE, and which layers
    config_class: str  # transformers config class of `tiny`
    tiny: dict[str, Any] = field(default_factory=dict)  # overrides of TINY_BASE for the tests' random model
    wraps: str | None = None  # a multimodal wrapper: key of the family of its language model
    decoder: tuple[str, ...] = DECODER_PATHS
    lm_head: tuple[str, ...] = HEAD_PATHS
    layers: str = "layers"
    norm: str = "norm"
    embed_tokens: str = "embed_tokens"
    layer_input: str = "hidden_states"
    embed_scale: Callable[[Any], float] | None = None  # of the text config
    # of the loaded model's own config: Gemma3ForConditionalGeneration applies no final
    # softcap even when its text config has one, Gemma3ForCausalLM does
    logit_scale: Callable[[Any], float] | None = None
    logit_softcap: Callable[[Any], float | None] | None = None
    norm_offset: float = 0.0
    remote_code: str = ""  # the table: the checkpoint's own classes, when they differ from transformers'
    note: str = ""  # the table: what the tests cover beyond the common checks

    def available(self) -> bool:
        """Whether the installed transformers has the classes the tiny test model needs."""
        import transformers

        return all(hasattr(transformers, n) for n in self.required_classes())

    def required_classes(self) -> list[str]:
        inner = FAMILIES[self.wraps].required_classes() if self.wraps else []
        return inner + [self.hf_class, self.config_class]

    def scales(self, config: Any) -> tuple[float, float, float | None]:
        """(embed_scale, logit_scale, logit_softcap or None) of a model with this config."""
        f = FAMILIES[self.wraps] if self.wraps else self
        embed = float(f.embed_scale(config.get_text_config())) if f.embed_scale else 1.0
        logit = float(f.logit_scale(config)) if f.logit_scale else 1.0
        cap = f.logit_softcap(config) if f.logit_softcap else None
        return embed, logit, (float(cap) if cap else None)

    @property
    def text_norm_offset(self) -> float:
        return FAMILIES[self.wraps].norm_offset if self.wraps else self.norm_offset


def _dig(obj: Any, dotted: str) -> Any:
    for name in dotted.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def _softcap(c: Any) -> float | None:
    return getattr(c, "final_logit_softcapping", None)


def _sqrt_hidden(c: Any) -> float:
    return float(c.hidden_size) ** 0.5


_MLA = "MLA (multi-head latent attention)"
_DEEPSEEK_TINY = dict(
    num_key_value_heads=4,  # MLA: one KV head per query head
    kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
)

_LIST = [
    Family("llama3", "Llama 3.x", ("llama",), "LlamaForCausalLM", "Llama-3.1-8B-Instruct", 32,
           "GQA", "dense", "LlamaConfig",
           tiny=dict(max_position_embeddings=131072,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192})),
    Family("qwen2", "Qwen2 / Qwen2.5", ("qwen2",), "Qwen2ForCausalLM", "Qwen2.5-7B-Instruct", 28,
           "GQA, q/k/v biases", "dense", "Qwen2Config"),
    Family("qwen3", "Qwen3", ("qwen3",), "Qwen3ForCausalLM", "Qwen3-8B", 36,
           "GQA, q/k norms", "dense", "Qwen3Config", tiny=dict(head_dim=16)),
    Family("qwen3_moe", "Qwen3-MoE", ("qwen3_moe",), "Qwen3MoeForCausalLM", "Qwen3-30B-A3B", 48,
           "GQA, q/k norms", "MoE (mlp_only_layers dense)", "Qwen3MoeConfig",
           tiny=dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     mlp_only_layers=[0], norm_topk_prob=True)),
    Family("mistral", "Mistral", ("mistral",), "MistralForCausalLM", "Mistral-7B-Instruct-v0.3", 32,
           "GQA (head_dim may differ from H/heads; optional sliding window)", "dense", "MistralConfig",
           tiny=dict(head_dim=24, sliding_window=16)),
    Family("gemma3", "Gemma-3 (text)", ("gemma3_text", "gemma3"), "Gemma3ForCausalLM", "gemma-3-27b-it", 62,
           "GQA, 5 sliding-window : 1 global layers", "dense", "Gemma3TextConfig",
           # softcap 0.25 (Gemma-2 used 30): small enough to change a tiny random model's small logits
           tiny=dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16, final_logit_softcapping=0.25,
                     tie_word_embeddings=True),
           embed_scale=_sqrt_hidden, logit_softcap=_softcap, norm_offset=1.0,
           note="embedding x sqrt(H), (1 + w) norm and final logit softcap reproduced; tied embeddings; also "
                "the multimodal Gemma3ForConditionalGeneration (states and logits: it applies no softcap)"),
    Family("gpt_oss", "GPT-OSS", ("gpt_oss",), "GptOssForCausalLM", "gpt-oss-120b", 36,
           "GQA with sinks, alternating sliding-window / full", "MoE (every layer)", "GptOssConfig",
           tiny=dict(intermediate_size=64, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)),
    Family("deepseek_v2", "DeepSeek-V2", ("deepseek_v2",), "DeepseekV2ForCausalLM", "DeepSeek-V2", 60,
           _MLA, "MoE after first_k_dense_replace dense layers", "DeepseekV2Config",
           tiny={**_DEEPSEEK_TINY, "q_lora_rank": None, "first_k_dense_replace": 1}),
    Family("deepseek_v3", "DeepSeek-V3", ("deepseek_v3",), "DeepseekV3ForCausalLM", "DeepSeek-V3", 61,
           _MLA, "MoE after first_k_dense_replace dense layers", "DeepseekV3Config",
           tiny={**_DEEPSEEK_TINY, "first_k_dense_replace": 3, "n_group": 2, "topk_group": 1,
                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                     "beta_fast": 32, "beta_slow": 1}}),
    Family("kimi_k2", "Kimi-K2", ("kimi_k2",), "DeepseekV3ForCausalLM", "Kimi-K2-Instruct", 61,
           _MLA, "MoE after 1 dense layer", "DeepseekV3Config",
           tiny={**_DEEPSEEK_TINY, "num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 6,
                 "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "mscale": 1.0,
                                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                     "beta_fast": 1.0, "beta_slow": 1.0}},
           remote_code="model_type kimi_k2 is the checkpoint's remote code (modeling_deepseek.py, same nesting)",
           note="as a DeepSeek-V3 config of Kimi-K2's shape (1 dense layer, 1 expert group, yarn x32); "
                "model_type kimi_k2 through the Kimi-K2.5 remote-code test"),
    Family("kimi_k25", "Kimi-K2.5 (multimodal wrapper)", ("kimi_k25",), "Kimi_K25ForConditionalGeneration",
           "Kimi-K2.5", 61, _MLA, "MoE after 1 dense layer", "Kimi_K25Config", wraps="kimi_k2",
           decoder=("language_model.model", "model.language_model"),
           remote_code="the checkpoint's remote code KimiK25ForConditionalGeneration nests a DeepseekV3ForCausalLM "
                       "under language_model (decoder at language_model.model, head at language_model.lm_head)",
           note="both nestings: transformers' class (model.language_model) and a checkpoint-style remote-code "
                "wrapper (eaglet/testing/remote_kimi_k25.py: language_model.model, text model_type kimi_k2) loaded with "
                "trust_remote_code"),
    Family("llama4", "Llama-4 (text)", ("llama4_text", "llama4"), "Llama4ForCausalLM", "Llama-4-Scout-17B-16E", 48,
           "GQA, chunked attention, NoPE every 4th layer", "MoE on interleaved layers", "Llama4TextConfig",
           tiny=dict(intermediate_size=64, intermediate_size_mlp=128, head_dim=16, num_local_experts=4,
                     num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=8,
                     max_position_embeddings=131072,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                      "original_max_position_embeddings": 8192})),
]

FAMILIES: dict[str, Family] = {f.key: f for f in _LIST}
_BY_MODEL_TYPE: dict[str, Family] = {t: f for f in _LIST for t in f.model_types}


def supported() -> list[str]:
    return [f.name for f in FAMILIES.values()]


def _model_types(config: Any) -> list[str]:
    outer = getattr(config, "model_type", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return [t for t in dict.fromkeys([outer, getattr(text, "model_type", None)]) if t]


def family_of(config: Any) -> Family | None:
    """The adapter for a (possibly multimodal) config: its own model_type's, else its text config's."""
    for t in _model_types(config):
        if t in _BY_MODEL_TYPE:
            return _BY_MODEL_TYPE[t]
    return None


def unsupported_message(what: str) -> str:
    return (f"{what}: not a family eaglet supports. Supported: {'; '.join(supported())}. Adding a family is one "
            f"entry in {ADD_FAMILY} (FAMILIES: where its decoder layers, final norm, LM head and embedding are, "
            "and what its embedding and head compute besides a lookup and a matmul)")


@dataclass
class FoundParts:
    family: Family
    decoder: Any
    layers: Any
    norm: Any
    lm_head: Any
    embed_tokens: Any


def find_parts(model: Any) -> FoundParts:
    """The family's parts in `model`; UnsupportedFamily when it has no adapter or a part is not
    where the adapter says."""
    from torch import nn

    config = getattr(model, "config", None)
    fam = family_of(config) if config is not None else None
    if fam is None:
        what = f"{type(model).__name__} (" + (f"model_type {' / '.join(_model_types(config)) or '?'}"
                                              if config is not None else "no transformers config") + ")"
        raise UnsupportedFamily(unsupported_message(what), f"{what}: no adapter")
    decoder = next((d for d in (_dig(model, p) for p in fam.decoder)
                    if isinstance(d, nn.Module) and isinstance(getattr(d, fam.layers, None), nn.ModuleList)
                    and isinstance(getattr(d, fam.norm, None), nn.Module)), None)
    if decoder is None:
        raise UnsupportedFamily(
            f"cannot find the decoder layers of {type(model).__name__} ({fam.name} adapter): looked for a module "
            f"with `{fam.layers}` (a ModuleList) and `{fam.norm}` at {', '.join(fam.decoder)}; fix the adapter in "
            f"{ADD_FAMILY}")
    head = next((h for h in (_dig(model, p) for p in fam.lm_head) if isinstance(h, nn.Module)), None)
    if head is None and hasattr(model, "get_output_embeddings"):
        head = model.get_output_embeddings()
    if head is None:
        raise UnsupportedFamily(f"cannot find the LM head of {type(model).__name__} ({fam.name} adapter) at "
                                f"{', '.join(fam.lm_head)}; fix the adapter in {ADD_FAMILY}")
    embed = getattr(decoder, fam.embed_tokens, None)
    if not isinstance(embed, nn.Module):
        raise UnsupportedFamily(f"{type(decoder).__name__} has no `{fam.embed_tokens}` ({fam.name} adapter); fix "
                                f"the adapter in {ADD_FAMILY}")
    return FoundParts(fam, decoder, getattr(decoder, fam.layers), getattr(decoder, fam.norm), head, embed)


def text_config_from_dict(d: dict[str, Any]) -> Any:
    """A text config from its saved dict (extract's target_config.json), also for a model_type
    that only the checkpoint's remote code defines (Kimi-K2's "kimi_k2", also inside
    Kimi-K2.5): the family's transformers config class reads it then."""
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(**d)
    except ValueError:
        fam = _BY_MODEL_TYPE.get(d.get("model_type", ""))
        if fam is None or fam.wraps:
            raise
        import transformers

        cls = getattr(transformers, fam.config_class)
        return cls(**{k: v for k, v in d.items() if k != "model_type"})


# ---- captured layers ---------------------------------------------------------------------------------


def default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high states: the inputs of layers 2, L//2 and L-3.

    A target with fewer than 7 layers has no three distinct such ids: set extract.layers.
    """
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) < 3 or not ids[0] < ids[1] < ids[2]:
        raise ValueError(
            f"the default extract.layers [2, L//2, L-3] = {ids} for L={num_layers} decoder layers are not three "
            "distinct increasing ids; set extract.layers explicitly"
        )
    return validate_layers(ids, num_layers, default=True)


def validate_layers(layers: list[int], num_layers: int, default: bool = False) -> list[int]:
    """Check that every id is the input of an existing decoder layer (0 <= i < L), once each."""
    what = f"default extract.layers {layers}" if default else f"extract.layers {layers}"
    if not layers:
        raise ValueError(f"{what}: needs at least one layer id")
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"{what}: id(s) {bad} out of range for a target with L={num_layers} decoder layers "
            f"(valid 0..{num_layers - 1}; id i is the state entering layer i)"
        )
    if len(set(layers)) != len(layers):
        raise ValueError(f"{what}: duplicate layer ids")
    return list(layers)


def resolve_layers(layers: list[int] | None, num_layers: int) -> list[int]:
    """The configured ids (validated) or the EAGLE-3 default."""
    return default_layers(num_layers) if layers is None else validate_layers(list(layers), num_layers)


def type_layers(kind: Any, cfg: Any, num_layers: int) -> list[int]:
    """The target layers draft type `kind` (a DraftType) reads: its own `layers`, or extract.layers
    resolved when it leaves them to the config (None)."""
    own = kind.layers(num_layers, cfg)
    return resolve_layers(cfg.extract.layers, num_layers) if own is None else validate_layers(list(own), num_layers)


def extraction_layers(cfg: Any, num_layers: int) -> list[int]:
    """The layers extraction captures: those of train.algorithm's type, then those of each type in
    extract.draft_types that are not among them yet, in that order (train.algorithm eagle3 with
    no extra types: exactly extract.layers resolved). Training selects its type's columns."""
    out: list[int] = []
    for name in [cfg.train.algorithm, *cfg.extract.draft_types]:
        out += [i for i in type_layers(draft_type(name), cfg, num_layers) if i not in out]
    return out


# ---- tiny random configs (tests, examples) -----------------------------------------------------------


def tiny_config(key: str, vocab_size: int = 512, **overrides: Any) -> Any:
    """A tiny transformers config of family `key` (TINY_BASE + the family's `tiny` + overrides)."""
    import transformers

    fam = FAMILIES[key]
    if fam.wraps:
        return _tiny_wrapper_config(fam, vocab_size, **overrides)
    cls = getattr(transformers, fam.config_class)
    return cls(**{**TINY_BASE, "vocab_size": vocab_size, **fam.tiny, **overrides})


def _tiny_wrapper_config(fam: Family, vocab_size: int, **overrides: Any) -> Any:
    import transformers

    text = tiny_config(fam.wraps, vocab_size, **overrides).to_dict()
    if fam.key == "kimi_k25":
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      patch_size=14, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2)
        cls = getattr(transformers, fam.config_class)
        return cls(text_config=text, vision_config=vision, projection_hidden_size=text["hidden_size"],
                   tie_word_embeddings=False)
    raise ValueError(f"no tiny wrapper config for {fam.key}")


# ---- the table of docs/families.md -----------------------------------------------------------------------------------


TESTED = "states, logits, doctor + shadow, training"


def markdown_table() -> str:
    """The table of families of docs/families.md (regenerate with `python -m eaglet.targets.families`)."""
    rows = ["| family | transformers class | attention; MLP | default captured layers | tested |",
            "|---|---|---|---|---|"]
    for f in FAMILIES.values():
        cls = f"`{f.hf_class}`" + (f"; {f.remote_code}" if f.remote_code else "")
        tested = TESTED + (f"; {f.note}" if f.note else "")
        rows.append(f"| {f.name} | {cls} | {f.attention}; {f.mlp} | {f.example} (L={f.example_layers}): "
                    f"{default_layers(f.example_layers)} | {tested} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
