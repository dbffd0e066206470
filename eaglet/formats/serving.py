"""The serving formats: a trained draft as vLLM and SGLang load it, and either format read back.

    export_draft(model, out_dir, "vllm" | "sglang", aux_layer_ids=..., ...)  -> out_dir
    load_draft(path) -> (DraftConfig, state_dict, meta)     # either format, detected

Each export is a folder with config.json and model.safetensors (safetensors only: nothing
here ever unpickles), and checksums.json, their sha256 and size (eaglet/formats/checked.py;
the engines ignore it). `load_draft` checks an export's files against it where it has one (an
export eaglet wrote; a draft from elsewhere has none and is read as it is): a damaged file is
CorruptDataError naming it, as is a safetensors file that cannot be parsed. The weights are
renamed by one generated name map per format (`name_map`: eaglet's state-dict names ->
checkpoint names, built from Eagle3Draft's own state dict), and read back through the inverse of
the same map.

Formats
-------
"vllm": the speculators format (speculators 0.9.0 `Eagle3SpeculatorConfig`, served by vLLM
    through vllm/transformers_utils/configs/speculators). config.json: speculators_model_type
    "eagle3", architectures ["Eagle3Speculator"], transformer_layer_config (a LlamaConfig dict:
    the draft's sizes, vocab_size = the target's vocabulary, num_aux_hidden_states = num_aux,
    which vLLM sizes fc by: it does not count the top-level ids), draft_vocab_size,
    target_hidden_size, eagle_aux_hidden_state_layer_ids, norm_before_residual,
    norm_before_fc (always false), fc_norm, norm_output, embed_requires_grad,
    speculators_config {algorithm, proposal_methods [greedy, speculative_tokens k],
    default_proposal_method, verifier {name_or_path, architectures}}, speculators_version.
    Weights are named exactly as eaglet names them (eaglet's names follow speculators):
    fc, fc_norm.{i}, layers.{i}.*, norm, lm_head, d2t, t2d, embed_tokens (optional).
    norm_before_residual is always written: vLLM reads a missing key as *true*.
    speculators' own model sizes fc as num_aux * hidden_size, so it (not vLLM) needs
    target_hidden_size == hidden_size.
"sglang": the official EAGLE-3 / SGLang format (SGLang models/llama_eagle3.py,
    `LlamaForCausalLMEagle3`; vLLM maps that architecture to its Eagle3 Llama too).
    config.json: a flat LlamaConfig with num_hidden_layers 1, draft_vocab_size,
    target_hidden_size, eagle_config {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state}.
    Layer 0 is named `midlayer.*`; fc, norm, lm_head, d2t, t2d, embed_tokens (optional) keep
    their names. eaglet writes the form SGLang's loader has long read: one EAGLE-3 layer, a
    3-state fc without norms, no attention bias, residual = un-normed h, the pre-norm state fed
    to the next step. Drafts using num_layers > 1, fc_norm, norm_output, norm_before_residual,
    attention_bias or num_aux != 3 are refused for this format (older SGLang releases skip the
    weights of these without a word; 0.5.23 reads fc_norm, norm_output and the state count,
    but names a later layer's input norm hidden_norm).
Checked: eaglet/formats/loaders.py holds each engine's loader as data (pinned
    releases) and the checks the export stage runs on both formats.
Both: d2t/t2d are left out when the draft vocabulary is the whole target vocabulary (the maps
    are then the identity; speculators registers no such buffers then); embed_tokens is left
    out unless include_embed (the engines share the target's, which eaglet's frozen copy is).
    RoPE is written in both spellings: rope_theta + rope_scaling (transformers 4.x) and
    rope_parameters (transformers 5); transformers 5 reads them identically.

Which target states (aux layer ids) each engine means
-----------------------------------------------------
eaglet keeps HF `output_hidden_states` indices: id i is the state *entering* decoder layer i
(0 = embedding output); the EAGLE-3 default is [2, L//2, L-3].
- vLLM: the target collects `hidden_states + residual` before running layer idx for idx in
  aux_hidden_state_layers (models/llama.py, deepseek_v2.py), and takes those ids unchanged
  from the draft config's `eagle_aux_hidden_state_layer_ids` (top level first, else
  eagle_config's; gpu_model_runner `_get_eagle3_aux_layers_from_config`). Same indices as
  eaglet: written unchanged in both formats' top level.
- SGLang: reads only eagle_config["eagle_aux_hidden_state_layer_ids"] and captures before
  layer id + 1 (`set_eagle3_layers_to_capture`: "for the ith layer, it takes the output of
  the (i-1)th layer"): its ids are 0-based layer outputs, i.e. HF index - 1 (SpecForge's
  [1, L//2-1, L-4]). The sglang export writes eagle_config ids = eaglet ids - 1, and the
  top-level key with eaglet's ids for vLLM. With no ids at all both engines capture before
  [2, L//2, L-3] (meta["aux_layer_ids"] is then None: the caller resolves it with L).
- speculators: the same ids as vLLM (its default [2, L//2, L-3], validated within [0, L]).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes
from torch import Tensor

from ..draft.layers import rope_type, target_rope
from ..draft.eagle3.model import DraftConfig, Eagle3Draft
from ..errors import CorruptDataError
from ..utils import DTYPES
from .checked import CHECKSUMS, CheckedFolder, first_nonfinite, write_files

FORMATS = ("vllm", "sglang")
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
SPECULATORS_VERSION = "0.9.0"  # the speculators release this writer was checked against
SGLANG_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_PICKLES = ("pytorch_model.bin", "model.bin", "model.pt", "pytorch_model.bin.index.json")
REBUILD = "export it again: `eaglet export CONFIG --force` in the run that made it"


# ---- the name maps ------------------------------------------------------------------------


def _speculators_name(name: str) -> str:
    """speculators (and so vLLM's speculators path) names every weight as eaglet does."""
    return name


def _sglang_name(name: str) -> str:
    """Official EAGLE-3 / SGLang: layer 0 is `midlayer`; everything else keeps its name."""
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


CHECKPOINT_NAME: dict[str, Callable[[str], str]] = {"vllm": _speculators_name, "sglang": _sglang_name}


def name_map(cfg: DraftConfig, fmt: str, include_embed: bool = True) -> dict[str, str]:
    """eaglet state-dict name -> checkpoint name for every tensor `fmt` stores for `cfg`.

    Generated from the state dict of Eagle3Draft(cfg) (built on the meta device). d2t/t2d are
    absent when the draft vocabulary is the whole target vocabulary; embed_tokens unless
    include_embed."""
    _check_format(fmt)
    skip = set() if include_embed else {"embed_tokens.weight"}
    if cfg.draft_vocab_size == cfg.vocab_size:
        skip |= {"d2t", "t2d"}
    rename = CHECKPOINT_NAME[fmt]
    return {n: rename(n) for n in _draft_shapes(cfg) if n not in skip}


def _draft_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in Eagle3Draft(cfg).state_dict().items()}


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}: expected one of {FORMATS}")


# ---- export -------------------------------------------------------------------------------


def export_draft(
    model: Eagle3Draft,
    out_dir: str | Path,
    fmt: str,
    *,
    aux_layer_ids: list[int],
    verifier_name_or_path: str,
    verifier_architectures: list[str],
    num_speculative_tokens: int,
    include_embed: bool = False,
    dtype: torch.dtype | str = torch.bfloat16,
) -> Path:
    """Write config.json + model.safetensors of `fmt` ("vllm" or "sglang") into out_dir.

    aux_layer_ids: the target states the draft was trained on, as HF output_hidden_states
    indices (eaglet's convention; the module header says what each format writes).
    Floating weights are cast to `dtype` (a torch dtype or its name); d2t (int64) and t2d (bool) keep theirs. The
    weights are written first, then config.json, each atomically, then checksums.json."""
    _check_format(fmt)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"export dtype {dtype!r}: expected one of {list(DTYPES)}")
        dtype = DTYPES[dtype]
    cfg = model.config
    ids = [int(i) for i in aux_layer_ids]
    problems = _export_problems(cfg, fmt, ids, num_speculative_tokens)
    if problems:
        raise ValueError(f"cannot export this draft as {fmt!r}: " + "; ".join(problems))
    names = name_map(cfg, fmt, include_embed)
    state = model.state_dict()
    if "d2t" not in names and bool(state["d2t"].any()):
        raise ValueError("draft_vocab_size == vocab_size but d2t is not the identity map")
    tensors = {ckpt: _cast(state[ours], dtype) for ours, ckpt in names.items()}
    dtype_name = str(dtype).removeprefix("torch.")
    if fmt == "vllm":
        config = _speculators_config(cfg, ids, verifier_name_or_path, verifier_architectures,
                                     num_speculative_tokens, dtype_name)
    else:
        config = _sglang_config(cfg, ids, dtype_name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / WEIGHTS_INDEX).unlink(missing_ok=True)  # a stale index would shadow the new file
    write_files(out, {WEIGHTS_FILE: safetensors_bytes(tensors, metadata={"format": "pt"}),
                      CONFIG_FILE: json.dumps(config, indent=1, default=str).encode()})
    return out


def _export_problems(cfg: DraftConfig, fmt: str, ids: list[int], k: int) -> list[str]:
    p = []
    if len(ids) != cfg.num_aux:
        p.append(f"{len(ids)} aux layer ids {ids} for a draft that concatenates num_aux={cfg.num_aux} states")
    if len(set(ids)) != len(ids) or any(i < 0 for i in ids):
        p.append(f"aux layer ids {ids} must be distinct and >= 0")
    if k < 1:
        p.append(f"num_speculative_tokens {k} < 1")
    if fmt == "sglang":
        if any(i < 1 for i in ids):
            p.append(f"aux layer ids {ids}: SGLang writes id - 1 (a layer output); 0 has none")
        unsupported = {
            f"num_layers={cfg.num_layers} (SGLang's EAGLE-3 module has one EAGLE-3 layer)": cfg.num_layers != 1,
            f"num_aux={cfg.num_aux} (SGLang's fc takes exactly 3 states)": cfg.num_aux != 3,
            "fc_norm": cfg.fc_norm,
            "norm_output": cfg.norm_output,
            "norm_before_residual": cfg.norm_before_residual,
            "attention_bias": cfg.attention_bias,
        }
        p += [f"SGLang's llama_eagle3 has no {what}" for what, bad in unsupported.items() if bad]
    return p


def _cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    t = t.detach().to("cpu")
    return (t.to(dtype) if t.is_floating_point() else t).contiguous()


def llama_fields(cfg: DraftConfig, dtype_name: str) -> dict[str, Any]:
    """The LlamaConfig fields both formats carry (transformer_layer_config / top level)."""
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    rope_parameters = {"rope_type": rope_type(scaling), **(scaling or {}), "rope_theta": cfg.rope_theta}
    return {
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope_parameters,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name,
    }


def _speculators_config(
    cfg: DraftConfig, ids: list[int], verifier: str, archs: list[str], k: int, dtype_name: str
) -> dict[str, Any]:
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        # vLLM sizes fc by num_aux_hidden_states (else 3), not by the top-level ids' count
        "transformer_layer_config": {**llama_fields(cfg, dtype_name), "num_aux_hidden_states": cfg.num_aux},
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": ids,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": False,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1, "accept_tolerance": 0.0}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(archs)},
        },
        "torch_dtype": dtype_name,
    }


def _sglang_config(cfg: DraftConfig, ids: list[int], dtype_name: str) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **llama_fields(cfg, dtype_name),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": False,
        # SGLang: 0-based layer outputs (captures before id + 1). vLLM: the top-level key.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": ids,
    }


# ---- load ---------------------------------------------------------------------------------


Loaded = tuple[DraftConfig, dict[str, Tensor], dict[str, Any]]


def load_draft(path: str | Path, fix: str = REBUILD, finite: bool = False, own: bool = False) -> Loaded:
    """Read an EAGLE-3 draft in either format (detected from config.json), its files checked
    against the folder's checksums.json when it has one (CorruptDataError, with `fix`, when not);
    `own`: an export this run wrote, which must have its checksums.json (a draft from elsewhere
    need not); `finite`: refuse a weight with a NaN or an inf too (CorruptDataError naming file
    and tensor).

    Returns (DraftConfig, state dict under eaglet's names, meta). The state dict holds every
    weight of Eagle3Draft(cfg) except embed_tokens.weight when the checkpoint has none
    (meta["missing"] then lists it: copy the target's embedding in); d2t/t2d are the identity
    when absent from a full-vocabulary draft. Tensors keep their stored dtype.
    meta: format, aux_layer_ids (HF output_hidden_states indices, or None: the engines'
    default [2, L//2, L-3]), verifier_name_or_path, verifier_architectures,
    num_speculative_tokens, dtype, missing, folder (the export folder read).
    `path` may also be a folder holding a vllm/ or sglang/ export (vllm/ is preferred)."""
    folder = resolve_folder(Path(path))
    checked = CheckedFolder(folder, fix, own=own)
    config = checked.json(CONFIG_FILE)
    weights = _read_weights(checked)
    fmt = detect_format(config, weights)
    if fmt == "vllm":
        cfg, meta = _from_speculators(config, weights)
    else:
        cfg, meta = _from_sglang(config, weights)
    state, missing = _map_back(cfg, weights, fmt, folder)
    meta.update(format=fmt, missing=missing, dtype=_stored_dtype(weights), folder=str(folder))
    bad = first_nonfinite(state) if finite else None
    if bad is not None:
        file = folder / (WEIGHTS_FILE if (folder / WEIGHTS_FILE).is_file() else WEIGHTS_INDEX)
        raise CorruptDataError(f"non-finite values in tensor {CHECKPOINT_NAME[fmt](bad)} of {file}",
                               fix="a diverged training wrote it: train the draft again with a lower train.lr")
    return cfg, state, meta


def load_draft_model(path: str | Path, embed: Tensor | None = None, fix: str = REBUILD
                     ) -> tuple[Eagle3Draft, dict[str, Any]]:
    """(the draft, `load_draft`'s meta) of an EAGLE-3 checkpoint in either format, its weights in
    fp32, refused when one is not finite (`load_draft` with `finite`); `embed` ([V, H], the
    target's embedding as the draft takes it: a store's `target_head().embed`) fills in
    embed_tokens when the checkpoint has none."""
    return draft_model(load_draft(path, fix, finite=True), embed)


def draft_model(loaded: Loaded, embed: Tensor | None = None) -> tuple[Eagle3Draft, dict[str, Any]]:
    """`load_draft_model` of what `load_draft` read."""
    cfg, state, meta = loaded
    state = dict(state)
    if "embed_tokens.weight" in meta["missing"]:
        if embed is None:
            raise ValueError(f"{meta['folder']}: the checkpoint has no embed_tokens.weight; pass the target's "
                             "embedding")
        state["embed_tokens.weight"] = embed
    draft = Eagle3Draft(cfg)
    draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=True)
    return draft, meta


def detect_format(config: dict[str, Any], weights: dict[str, Tensor] | None = None) -> str:
    if "speculators_model_type" in config:
        if config["speculators_model_type"] != "eagle3":
            raise ValueError(f"speculators model type {config['speculators_model_type']!r} is not eagle3")
        return "vllm"
    if set(config.get("architectures") or []) & set(SGLANG_ARCHS) or any(k.startswith("midlayer.") for k in weights or {}):
        return "sglang"
    raise ValueError(
        f"config.json is neither speculators' eagle3 (speculators_model_type) nor EAGLE-3/SGLang "
        f"(architectures {SGLANG_ARCHS}); got architectures {config.get('architectures')}"
    )


def resolve_folder(path: Path) -> Path:
    if (path / CONFIG_FILE).is_file() or (path / CHECKSUMS).is_file():
        return path
    for sub in FORMATS:
        if (path / sub / CONFIG_FILE).is_file():
            return path / sub
    raise FileNotFoundError(f"no {CONFIG_FILE} in {path} (nor in {path}/vllm or {path}/sglang)")


def _read_weights(checked: CheckedFolder) -> dict[str, Tensor]:
    folder = checked.folder
    if (folder / WEIGHTS_INDEX).is_file() or checked.lists(WEIGHTS_INDEX):
        files = sorted(set(checked.read(WEIGHTS_INDEX, lambda p: json.loads(p.read_text())["weight_map"].values())))
    elif (folder / WEIGHTS_FILE).is_file() or checked.lists(WEIGHTS_FILE):
        files = [WEIGHTS_FILE]
    else:
        pickles = [p for p in _PICKLES if (folder / p).exists()]
        hint = f" (found {pickles}: eaglet never unpickles; convert them to safetensors first)" if pickles else ""
        raise FileNotFoundError(f"no {WEIGHTS_FILE} or {WEIGHTS_INDEX} in {folder}{hint}")
    out: dict[str, Tensor] = {}
    for name in files:
        out.update(checked.read(name, _tensors))
    return out


def _tensors(path: Path) -> dict[str, Tensor]:
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)


def _from_speculators(config: dict[str, Any], weights: dict[str, Tensor]) -> tuple[DraftConfig, dict[str, Any]]:
    tl = dict(config.get("transformer_layer_config") or {})
    if not tl:
        raise ValueError("speculators config has no transformer_layer_config")
    if tl.get("model_type", "llama") != "llama":
        raise ValueError(f"transformer_layer_config model_type {tl.get('model_type')!r}: eaglet drafts are llama")
    if config.get("norm_before_fc"):
        raise ValueError("norm_before_fc (one RMSNorm over the concatenated states) is not an eaglet draft")
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    hidden = int(tl["hidden_size"])
    target_hidden = int(config.get("target_hidden_size") or hidden)
    cfg = _llama_draft_config(
        tl,
        draft_vocab_size=int(config.get("draft_vocab_size") or tl["vocab_size"]),
        target_hidden_size=target_hidden,
        num_layers=int(tl.get("num_hidden_layers", 1)),
        num_aux=_num_aux(weights, target_hidden, ids),
        fc_norm=bool(config.get("fc_norm", False)),
        norm_output=bool(config.get("norm_output", False)),
        # vLLM (the engine this format is for) reads a missing key as true.
        norm_before_residual=bool(config.get("norm_before_residual", True)),
    )
    spec = config.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    verifier = spec.get("verifier") or {}
    meta = {
        "aux_layer_ids": [int(i) for i in ids] if ids else None,
        "verifier_name_or_path": verifier.get("name_or_path"),
        "verifier_architectures": list(verifier.get("architectures") or []),
        "num_speculative_tokens": methods[0].get("speculative_tokens"),
    }
    return cfg, meta


def _from_sglang(config: dict[str, Any], weights: dict[str, Tensor]) -> tuple[DraftConfig, dict[str, Any]]:
    if int(config.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"EAGLE-3/SGLang checkpoint with num_hidden_layers={config['num_hidden_layers']}: "
                         "only the one-layer (midlayer) form is an eaglet draft")
    eagle_ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top_ids = config.get("eagle_aux_hidden_state_layer_ids")
    # SGLang's ids (eagle_config) are layer outputs: HF index = id + 1. vLLM's top-level key is
    # already an HF index. SGLang ignores the top-level key, so eagle_config decides.
    ids = [int(i) + 1 for i in eagle_ids] if eagle_ids else ([int(i) for i in top_ids] if top_ids else None)
    hidden = int(config["hidden_size"])
    target_hidden = int(config.get("target_hidden_size") or hidden)  # official EAGLE-3: absent
    cfg = _llama_draft_config(
        config,
        draft_vocab_size=int(config.get("draft_vocab_size") or config["vocab_size"]),
        target_hidden_size=target_hidden,
        num_layers=1,
        num_aux=_num_aux(weights, target_hidden, ids),
    )
    meta = {"aux_layer_ids": ids, "verifier_name_or_path": None, "verifier_architectures": [],
            "num_speculative_tokens": None}
    return cfg, meta


def _llama_draft_config(c: dict[str, Any], **fields: Any) -> DraftConfig:
    """DraftConfig from a LlamaConfig dict (either spelling of RoPE) plus eagle fields."""
    unsupported = {
        f"hidden_act {c.get('hidden_act')!r}": c.get("hidden_act", "silu") != "silu",
        "mlp_bias": bool(c.get("mlp_bias")),
        "an fc bias": bool(c.get("bias")),
    }
    bad = [what for what, is_bad in unsupported.items() if is_bad]
    if bad:
        raise ValueError(f"draft config has {', '.join(bad)}: not an eaglet (Llama, SwiGLU, no-bias) draft")
    heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    theta, scaling = target_rope(SimpleNamespace(**c))
    return DraftConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or hidden // heads),
        intermediate_size=int(c["intermediate_size"]),
        vocab_size=int(c["vocab_size"]),
        rms_norm_eps=float(c.get("rms_norm_eps") or 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(c.get("max_position_embeddings") or 4096),
        attention_bias=bool(c.get("attention_bias", False)),
        **fields,
    )


def _num_aux(weights: dict[str, Tensor], target_hidden: int, ids: list[int] | None) -> int:
    fc = weights.get("fc.weight")
    if fc is None:
        raise ValueError("checkpoint has no fc.weight")
    n, rem = divmod(int(fc.shape[1]), target_hidden)
    if rem or (ids and len(ids) != n):
        raise ValueError(f"fc.weight {tuple(fc.shape)} does not take {len(ids) if ids else 'k'} states "
                         f"of width target_hidden_size={target_hidden}")
    return n


def _map_back(
    cfg: DraftConfig, weights: dict[str, Tensor], fmt: str, folder: Path
) -> tuple[dict[str, Tensor], list[str]]:
    """Rename checkpoint tensors to eaglet's names (either format's spelling of layer 0: vLLM's
    loader also reads `midlayer.`), checking names and shapes against Eagle3Draft(cfg).
    Errors name tensors as `fmt` names them."""
    shapes = _draft_shapes(cfg)
    ours = {CHECKPOINT_NAME[fmt](name): name for fmt in FORMATS for name in shapes}
    unexpected = sorted(k for k in weights if k not in ours)
    state = {ours[k]: t for k, t in weights.items() if k in ours}
    if cfg.draft_vocab_size == cfg.vocab_size and not ({"d2t", "t2d"} & set(state)):
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    missing = [n for n in shapes if n not in state]
    rename = CHECKPOINT_NAME[fmt]
    required = [rename(n) for n in missing if n != "embed_tokens.weight"]
    wrong = [f"{rename(n)} {tuple(t.shape)} (expected {shapes[n]})"
             for n, t in state.items() if tuple(t.shape) != shapes[n]]
    if required or unexpected or wrong:
        parts = [f"missing {required}" if required else "", f"unexpected {unexpected}" if unexpected else "",
                 f"wrong shapes {wrong}" if wrong else ""]
        raise ValueError(f"{folder}: weights do not match the draft its config.json describes: "
                         + "; ".join(p for p in parts if p))
    return {n: state[n] for n in shapes if n in state}, missing


def _stored_dtype(weights: dict[str, Tensor]) -> str | None:
    floats = {str(t.dtype).removeprefix("torch.") for t in weights.values() if t.is_floating_point()}
    return floats.pop() if len(floats) == 1 else None
