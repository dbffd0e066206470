"""The target's head read from its checkpoint files, without loading the model.

A 1T-parameter target served by vLLM never loads in eaglet's process; training still needs
its token embedding, LM head and final norm (the teacher). `read_checkpoint_head` builds the
model's skeleton on the meta device to learn the parts' names and shapes, then reads just
those tensors from the safetensors files by name: a few GB instead of the model's hundreds.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..config import TargetSection
from .load import TargetParts, build_meta_model, hub_kwargs, local_folder, norm_eps, target_source


def checkpoint_folder(tcfg: TargetSection) -> Path:
    return local_folder(target_source(tcfg), tcfg.revision)


def _checkpoint_keys(folder: Path) -> dict[str, Path]:
    """tensor name -> safetensors file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    keys: dict[str, Path] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            keys.update({k: f for k in h.keys()})
    if not keys:
        raise FileNotFoundError(f"no safetensors weights in {folder}: the vLLM backend reads the target's head from them")
    return keys


def _find_key(keys: dict[str, Path], module_name: str, shape: tuple[int, ...], what: str) -> str | None:
    """The checkpoint key of `module_name`.weight: the exact name, else the one key (outside the
    decoder layers) with the same last two name parts and the same shape."""
    name = f"{module_name}.weight"
    if name in keys:
        return name
    tail = name.split(".")[-2:]
    found = []
    for k, f in keys.items():
        if k.split(".")[-2:] == tail and ".layers." not in f".{k}":
            with safe_open(str(f), framework="pt") as h:
                if tuple(h.get_slice(k).get_shape()) == shape:
                    found.append(k)
    if len(found) > 1:
        raise ValueError(f"the target's {what}: several checkpoint tensors could be {name}: {found}")
    return found[0] if found else None


def _norm_multiplier(norm: torch.nn.Module, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The per-channel multiplier m of the final norm, norm(x) = m * x / rms(x): the weight for
    a Llama-style RMSNorm, 1 + weight for a Gemma-style one. Found by running the model's own norm
    class on the CPU, so training applies exactly that norm."""
    H = weight.shape[0]
    norm = copy.deepcopy(norm).to_empty(device="cpu").float()
    with torch.no_grad():
        norm.weight.copy_(weight.float())
        x = torch.randn(16, H, generator=torch.Generator().manual_seed(0))
        y = norm(x).float()
    base = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    m = (y * base).sum(0) / (base * base).sum(0)
    if not torch.allclose(y, base * m, rtol=1e-4, atol=1e-5):
        raise ValueError(f"the target's final norm {type(norm).__name__} is not m * x / rms(x) with eps {eps} (a "
                         "LayerNorm with a bias?): training cannot rebuild it; use extract.backend: hf")
    return m


@dataclass
class CheckpointHead:
    """What the vLLM backend's extract needs of the target, read without loading it."""

    text_config: dict[str, Any]
    num_layers: int
    hidden_size: int
    architecture: str
    tensors: dict[str, torch.Tensor]  # embed_tokens [V, H], lm_head [V, H], norm [H] (the multiplier)
    norm_eps: float


def read_checkpoint_head(tcfg: TargetSection) -> CheckpointHead:
    """The target's sizes, text config and head tensors from its config and checkpoint files
    (safetensors; a GGUF target needs the HF backend). The final norm comes as its plain
    multiplier (Gemma's 1 + w), as head.safetensors stores it."""
    from transformers import AutoConfig

    if tcfg.gguf_file:
        raise ValueError("extract.backend vllm reads safetensors checkpoints; target.gguf_file needs backend hf")
    hf_config = AutoConfig.from_pretrained(target_source(tcfg), **hub_kwargs(tcfg))
    model = build_meta_model(hf_config, tcfg.trust_remote_code)
    parts = TargetParts.of(model)
    names = {id(m): n for n, m in model.named_modules()}
    folder = checkpoint_folder(tcfg)
    keys = _checkpoint_keys(folder)
    tensors = {}
    for what, module in (("embed_tokens", parts.embed_tokens), ("lm_head", parts.lm_head), ("norm", parts.norm)):
        key = _find_key(keys, names[id(module)], tuple(module.weight.shape), what)
        if key is None and what == "lm_head":  # tied: the LM head is the embedding
            key = _find_key(keys, names[id(parts.embed_tokens)], tuple(module.weight.shape), what)
        if key is None:
            raise ValueError(f"the target's {what} ({names[id(module)]}.weight, shape {tuple(module.weight.shape)}) "
                             f"is not in its checkpoint {folder}")
        with safe_open(str(keys[key]), framework="pt") as h:
            tensors[what] = h.get_tensor(key)
    eps = norm_eps(parts.norm)
    w = tensors["norm"]
    m = _norm_multiplier(parts.norm, w, eps)
    for exact in (w, 1 + w.float()):  # Llama-style w, Gemma-style 1 + w: the exact values, not the fit
        if torch.allclose(m, exact.float(), rtol=1e-4, atol=1e-5):
            m = exact
            break
    tensors["norm"] = m
    text_cfg = hf_config.get_text_config()
    return CheckpointHead(text_cfg.to_dict(), parts.num_layers, parts.hidden_size,
                      (getattr(hf_config, "architectures", None) or [type(model).__name__])[0], tensors, eps)
