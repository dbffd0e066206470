"""A stand-in for Kimi-K2.5's remote code, for tests: the checkpoint's nesting around a real DeepSeek-V3.

The Kimi-K2.5 checkpoint ships its own `modeling_kimi_k25.py` (loaded with
trust_remote_code): `KimiK25ForConditionalGeneration` holds a vision tower, a projector and a
whole DeepSeek-V3 CausalLM under `language_model`, so the decoder is `language_model.model`
and the LM head `language_model.lm_head`, and the text config says model_type "kimi_k2". This
module has exactly that nesting and those names and weight names, around transformers' own
DeepseekV3ForCausalLM and a two-linear vision stand-in. `eaglet.testing.tiny.save_target(folder,
family="kimi_k25", remote_code=True)` copies it into a tiny target folder as
`modeling_kimi_k25.py`, with the auto_map of the real config.json, so loading the tiny target
takes trust_remote_code like the real one. It imports only torch and transformers (transformers
copies it into its module cache and imports it from there).
"""

from __future__ import annotations

from torch import nn
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, GenerationMixin, PreTrainedModel

try:
    from transformers import PreTrainedConfig
except ImportError:  # older name
    from transformers import PretrainedConfig as PreTrainedConfig

AUTO_MAP = {
    "AutoConfig": "modeling_kimi_k25.KimiK25Config",
    "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
    "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
}


class KimiK2Config(DeepseekV3Config):
    """Kimi-K2's text config: a DeepSeek-V3 config under its own model_type."""

    model_type = "kimi_k2"


class KimiK25Config(PreTrainedConfig):
    model_type = "kimi_k25"

    def __init__(self, text_config=None, vision_config=None, media_placeholder_token_id=163605, **kwargs):
        if text_config is None or isinstance(text_config, dict):
            text_config = KimiK2Config(**{k: v for k, v in (text_config or {}).items() if k != "model_type"})
        self.text_config = text_config
        self.vision_config = dict(vision_config or {"hidden_size": 32, "patch_size": 14})
        self.media_placeholder_token_id = media_placeholder_token_id
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    def to_dict(self):
        out = super().to_dict()
        out["text_config"] = self.text_config.to_dict()
        return out


class KimiK25ForConditionalGeneration(PreTrainedModel, GenerationMixin):
    config_class = KimiK25Config
    base_model_prefix = ""
    _supports_sdpa = True
    _no_split_modules = ["DeepseekV3DecoderLayer"]

    def __init__(self, config: KimiK25Config):
        super().__init__(config)
        v = config.vision_config
        self.vision_tower = nn.Linear(3 * v["patch_size"] ** 2, v["hidden_size"])  # MoonViT stand-in
        self.mm_projector = nn.Linear(v["hidden_size"], config.text_config.hidden_size)
        self.language_model = DeepseekV3ForCausalLM(config.text_config)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, pixel_values=None, use_cache=None, output_hidden_states=None,
                logits_to_keep=0, **kwargs):
        if past_key_values is not None:  # newer transformers name the KV cache `cache`
            kwargs["cache" if "cache" in kwargs or _names_cache() else "past_key_values"] = past_key_values
        if pixel_values is not None:  # image patches replace the placeholder tokens' embeddings
            inputs_embeds = self.get_input_embeddings()(input_ids)
            feats = self.mm_projector(self.vision_tower(pixel_values)).to(inputs_embeds.dtype)
            where = (input_ids == self.config.media_placeholder_token_id).unsqueeze(-1)
            inputs_embeds = inputs_embeds.masked_scatter(where, feats)
            input_ids = None
        return self.language_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   inputs_embeds=inputs_embeds, use_cache=use_cache,
                                   output_hidden_states=output_hidden_states, logits_to_keep=logits_to_keep, **kwargs)


def _names_cache() -> bool:
    import inspect

    return "cache" in inspect.signature(DeepseekV3ForCausalLM.forward).parameters


__all__ = ["KimiK2Config", "KimiK25Config", "KimiK25ForConditionalGeneration"]
