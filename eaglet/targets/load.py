"""Loading the target model and finding the parts extraction hooks into.

`load_target` turns the `target` config section into a transformers model in eval mode;
`target_source` is what every read of the target's files (config, tokenizer, weights) is
given: an existing folder or a hub id in the local cache, else one line naming the key.
`TargetParts` names the pieces of a causal LM that the rest of eaglet uses: the decoder
stack (the base model without the LM head), its layer list, the final norm, the LM head
and the token embedding, and what the family's embedding and head compute besides a lookup
and a matmul. Its family's adapter (eaglet/targets/families.py) says where they are, including
multimodal wrappers whose text decoder sits under `language_model` (Kimi-K2.5).

Layer ids follow the EAGLE-3 convention (see EAGLE3_FACTS.md): id i is the hidden state
*entering* decoder layer i, which is `output_hidden_states[i]` in transformers.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import HUB_ID, ConfigError, TargetSection
from ..errors import InputError
from ..distributed import resolve_device
from ..utils import DTYPES
from .families import find_parts


def _is_unmapped_config(err: Exception) -> bool:
    return "Unrecognized configuration class" in str(err)


def model_from_config(hf_config: Any, **kwargs: Any) -> nn.Module:
    """A (random or meta) model of `hf_config`: its CausalLM class, else its image-text-to-text
    class (multimodal wrappers such as Kimi-K2.5 are not CausalLM classes in transformers)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        return AutoModelForCausalLM.from_config(hf_config, **kwargs)
    except ValueError as e:
        if not _is_unmapped_config(e):
            raise
        return AutoModelForImageTextToText.from_config(hf_config, **kwargs)


def build_meta_model(hf_config: Any, trust_remote_code: bool = False) -> nn.Module:
    """The target's module tree on the meta device: classes and shapes, no weights."""
    with torch.device("meta"):
        return model_from_config(hf_config, trust_remote_code=trust_remote_code)


def target_source(tcfg: TargetSection, key: str = "path") -> str:
    """The folder or cached hub id that target.`key` names ('path', or 'tokenizer', which falls
    back to path), checked before transformers sees it (which would say "Repo id must be in
    the form ..." for a missing folder). ConfigError when unset, InputError when not found."""
    if key == "tokenizer" and not tcfg.tokenizer:
        key = "path"
    name, value = f"target.{key}", getattr(tcfg, key) or ""
    if not value:
        raise ConfigError(f"{name} is not set", fix="set it to a local Hugging Face model folder, or a hub id already "
                          "in the local cache")
    if Path(value).is_dir():
        return value
    if Path(value).exists():
        raise InputError(f"{name}: {value} is a file, not a model folder",
                         fix=f"set {name} to the folder that holds it" + (" (and target.gguf_file to its name)"
                                                                         if value.endswith(".gguf") else ""))
    if local_folder(value, tcfg.revision) is not None:
        return value
    raise InputError(f"{name}: folder not found: {value} (a local model folder, or a hub id already in the local cache)",
                     fix=f"correct {name}; a relative path in a config file is taken against the file's folder")


def local_folder(value: str, revision: str | None = None) -> Path | None:
    """The local folder `value` names: itself when it is a folder, else a hub id's snapshot in
    the local hub cache at `revision` (no network); None when neither exists."""
    if not value:
        return None
    if Path(value).is_dir():
        return Path(value)
    if not HUB_ID.fullmatch(value):
        return None
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(value, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, or not a valid id: either way not there
        return None


def hub_kwargs(tcfg: TargetSection) -> dict[str, Any]:
    """The from_pretrained options every read of the target's files shares (config,
    tokenizer, weights): remote code only when opted in, a revision, a GGUF file."""
    kwargs: dict[str, Any] = {"trust_remote_code": tcfg.trust_remote_code}
    if tcfg.revision:
        kwargs["revision"] = tcfg.revision
    if tcfg.gguf_file:
        # transformers loads a relative gguf_file from the working directory when a file of that
        # name is there, before it looks in the model folder: name the folder's own file
        folder = Path(tcfg.path)
        inside = not Path(tcfg.gguf_file).is_absolute() and folder.is_dir()
        kwargs["gguf_file"] = str(folder.resolve() / tcfg.gguf_file) if inside else tcfg.gguf_file
    return kwargs


def load_target(tcfg: TargetSection, tp_plan: str | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """Load the target named by `tcfg` in eval mode; returns (model, info).

    Only the from_pretrained options that are set are passed. Without `device_map` the model
    is placed on `tcfg.device`: straight onto it when `accelerate` is installed (a large
    target never sits in host memory whole), else loaded on the CPU and moved.

    Under torchrun: `tp_plan` 'auto' (extract.tp_plan) loads the model split over all ranks with transformers'
    tensor-parallel plan (transformers places each shard on the rank's device; parameters
    become DTensors, layer inputs and outputs stay whole tensors). A `device_map` spreads one
    replica over a node's GPUs, so it needs one process per node.
    """
    from transformers import AutoModelForCausalLM

    source = target_source(tcfg)
    kwargs: dict[str, Any] = {"dtype": "auto" if tcfg.dtype == "auto" else DTYPES[tcfg.dtype], **hub_kwargs(tcfg)}
    if tcfg.attn_implementation is not None:
        kwargs["attn_implementation"] = tcfg.attn_implementation
    device = resolve_device(tcfg.device)
    move_after = False
    local_procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if tp_plan is not None and tcfg.device_map is not None:
        raise ValueError("extract.tp_plan and target.device_map exclude each other: set one")
    if tp_plan is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from transformers.distributed import DistributedConfig

        kwargs["distributed_config"] = DistributedConfig(tp_plan=tp_plan)
    elif tcfg.device_map is not None and local_procs > 1:
        raise ValueError(
            f"target.device_map {tcfg.device_map!r} with {local_procs} processes on this node: each would spread a "
            "replica over the same GPUs. Launch one process per node (torchrun --nproc-per-node 1), or use "
            "extract.tp_plan=auto to split the target over the ranks"
        )
    elif tcfg.device_map is not None:
        kwargs["device_map"] = tcfg.device_map
    elif device.type != "cpu" and importlib.util.find_spec("accelerate") is not None:
        kwargs["device_map"] = str(device)  # transformers needs accelerate for any device_map
    else:
        move_after = device.type != "cpu"

    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except ValueError as e:
        if not _is_unmapped_config(e):
            raise
        # A multimodal checkpoint (e.g. Kimi-K2.5) is not a CausalLM class in transformers;
        # its image-text-to-text class holds the same text decoder and LM head.
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(source, **kwargs)
    if move_after:
        model = model.to(device)
    model.eval()
    parts = TargetParts.of(model)
    text_cfg = model.config.get_text_config()
    info = {
        "class": type(model).__name__,
        "model_type": getattr(text_cfg, "model_type", None),
        "num_layers": parts.num_layers,
        "hidden_size": parts.hidden_size,
        "vocab_size": getattr(text_cfg, "vocab_size", None),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "device": str(parts.input_device),
        "device_map": getattr(model, "hf_device_map", None),
        "path": tcfg.path,
    }
    return model, info


@dataclass
class TargetParts:
    """The pieces of a causal LM that extraction (and later training) touch."""

    decoder: nn.Module  # base model: embeddings -> layers -> final norm, no LM head
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Module
    embed_tokens: nn.Module
    num_layers: int
    hidden_size: int
    family: Any = None  # eaglet.targets.families.Family
    embed_scale: float = 1.0  # the decoder's input is embed_tokens(ids) * embed_scale
    logit_scale: float = 1.0  # the model's logits are softcap(lm_head(final) * logit_scale)
    logit_softcap: float | None = None
    norm_offset: float = 0.0  # the final norm scales by (norm_offset + weight)

    @property
    def input_device(self) -> torch.device:
        """Where input ids go (the embedding's device, also under a device_map)."""
        return self.embed_tokens.weight.device

    @property
    def layer_input(self) -> str:
        """The decoder layer's parameter holding the residual stream (also its first positional one)."""
        return self.family.layer_input if self.family is not None else "hidden_states"

    def logits(self, final_BTH: torch.Tensor) -> torch.Tensor:
        """The model's own logits from its LM head's input (the stored teacher state)."""
        w = self.lm_head.weight
        logits = self.lm_head(final_BTH.to(device=w.device, dtype=w.dtype))
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def scaled_embedding(self, weight_VH: torch.Tensor) -> torch.Tensor:
        """The embedding table (`embed_tokens.weight`, or a gathered copy) as the first decoder
        layer receives its rows: times embed_scale, rounded as the target rounds it."""
        if self.embed_scale == 1.0:
            return weight_VH
        return weight_VH * torch.tensor(self.embed_scale, dtype=weight_VH.dtype, device=weight_VH.device)

    def plain_norm_weight(self, weight_H: torch.Tensor) -> torch.Tensor:
        """The final norm's weight (`norm.weight`) as a plain RMSNorm scale (Gemma's 1 + w)."""
        return weight_H if not self.norm_offset else weight_H + self.norm_offset

    @classmethod
    def of(cls, model: nn.Module) -> "TargetParts":
        """Find the parts through the model's family adapter (UnsupportedFamily, a ValueError,
        names the supported families when there is none)."""
        found = find_parts(model)
        text_cfg = model.config.get_text_config()
        num_layers = len(found.layers)
        declared = getattr(text_cfg, "num_hidden_layers", None)
        if isinstance(declared, int) and 0 < declared <= num_layers:
            num_layers = declared  # decoders run layers[:num_hidden_layers]; extra ones (MTP) never run
        hidden = getattr(text_cfg, "hidden_size", None) or found.embed_tokens.weight.shape[-1]
        embed_scale, logit_scale, softcap = found.family.scales(model.config)
        return cls(found.decoder, found.layers, found.norm, found.lm_head, found.embed_tokens, num_layers,
                   int(hidden), found.family, embed_scale, logit_scale, softcap, found.family.text_norm_offset)


def norm_eps(norm: nn.Module) -> float:
    """The epsilon of the target's final norm (1e-6 when the module names none)."""
    for name in ("variance_epsilon", "eps"):
        if hasattr(norm, name):
            return float(getattr(norm, name))
    return 1e-6


def eos_ids(target: nn.Module, tokenizer: Any = None) -> list[int]:
    """End-of-sequence ids: the generation config's (int or list) and the tokenizer's."""
    ids: set[int] = set()
    gen = getattr(target, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if eos is not None:
        ids |= {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)

