"""The serving formats' files: a trained draft's export, as vLLM and SGLang load it, written and read back.

    export_draft(model, out_dir, "vllm" | "sglang", aux_layer_ids=..., ...)  -> out_dir
    load_draft(path) -> (draft config, state_dict, meta)     # either format, detected

What an export holds is its draft type's (`serving(draft, meta)` of eaglet/draft/<type>/: the
config.json and the weights under the names the engines load; EAGLE-3's formats:
eaglet/draft/eagle3/serving.py); this file owns the files. Each export is a folder with
config.json and model.safetensors (safetensors only: nothing here ever unpickles), and
checksums.json, their sha256 and size (eaglet/formats/checked.py; the engines ignore it).
`load_draft` checks an export's files against it where it has one (an export eaglet wrote; a
draft from elsewhere has none and is read as it is): a damaged file is CorruptDataError naming
it, as is a safetensors file that cannot be parsed; then the type whose format the config.json
is (`serving_format` of each registered type) turns it into a draft config and a state dict
(`from_serving`). eaglet/formats/loaders.py holds each engine's loader as data and the checks
the export stage runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes
from torch import Tensor, nn

from ..draft import DRAFT_TYPES, draft_type, draft_type_of
from ..errors import CorruptDataError
from ..utils import DTYPES
from .checked import CHECKSUMS, CheckedFolder, first_nonfinite, write_files

FORMATS = ("vllm", "sglang")
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
_PICKLES = ("pytorch_model.bin", "model.bin", "model.pt", "pytorch_model.bin.index.json")
REBUILD = "export it again: `eaglet export CONFIG --force` in the run that made it"


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}: expected one of {FORMATS}")


# ---- export -------------------------------------------------------------------------------


def export_draft(
    model: nn.Module,
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
    indices (eaglet's convention; the draft type's serving module says what each format writes).
    Floating weights are cast to `dtype` (a torch dtype or its name); d2t (int64) and t2d (bool) keep theirs. The
    weights are written first, then config.json, each atomically, then checksums.json."""
    _check_format(fmt)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"export dtype {dtype!r}: expected one of {list(DTYPES)}")
        dtype = DTYPES[dtype]
    meta = {"format": fmt, "aux_layer_ids": list(aux_layer_ids), "verifier_name_or_path": verifier_name_or_path,
            "verifier_architectures": verifier_architectures, "num_speculative_tokens": num_speculative_tokens,
            "include_embed": include_embed, "dtype": str(dtype).removeprefix("torch.")}
    config, weights = draft_type_of(model).serving(model, meta)
    tensors = {name: _cast(t, dtype) for name, t in weights.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / WEIGHTS_INDEX).unlink(missing_ok=True)  # a stale index would shadow the new file
    write_files(out, {WEIGHTS_FILE: safetensors_bytes(tensors, metadata={"format": "pt"}),
                      CONFIG_FILE: json.dumps(config, indent=1, default=str).encode()})
    return out


def _cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    t = t.detach().to("cpu")
    return (t.to(dtype) if t.is_floating_point() else t).contiguous()


# ---- load ---------------------------------------------------------------------------------


Loaded = tuple[Any, dict[str, Tensor], dict[str, Any]]  # (the type's draft config, state dict, meta)


def load_draft(path: str | Path, fix: str = REBUILD, finite: bool = False, own: bool = False) -> Loaded:
    """Read a draft export in either format (its type and format detected from config.json), its
    files checked against the folder's checksums.json when it has one (CorruptDataError, with
    `fix`, when not); `own`: an export this run wrote, which must have its checksums.json (a draft
    from elsewhere need not); `finite`: refuse a weight with a NaN or an inf too (CorruptDataError
    naming file and tensor).

    Returns (the draft config, state dict under eaglet's names, meta): the type's `from_serving`
    (EAGLE-3: eaglet/draft/eagle3/read_export.py). The state dict holds every weight of the
    draft except embed_tokens.weight when the checkpoint has none (meta["missing"] then lists
    it: copy the target's embedding in). Tensors keep their stored dtype.
    meta: algorithm (the draft type's name), format, aux_layer_ids (HF output_hidden_states
    indices, or None: the engines' default), verifier_name_or_path, verifier_architectures,
    num_speculative_tokens, dtype, missing, folder (the export folder read).
    `path` may also be a folder holding a vllm/ or sglang/ export (vllm/ is preferred)."""
    folder = resolve_folder(Path(path))
    checked = CheckedFolder(folder, fix, own=own)
    config = checked.json(CONFIG_FILE)
    weights = _read_weights(checked)
    kind, fmt = serving_type(config, weights)
    cfg, state, missing, meta = kind.from_serving(config, weights, fmt, folder)
    meta.update(algorithm=kind.NAME, format=fmt, missing=missing, dtype=_stored_dtype(weights), folder=str(folder))
    bad = first_nonfinite(state) if finite else None
    if bad is not None:
        file = folder / (WEIGHTS_FILE if (folder / WEIGHTS_FILE).is_file() else WEIGHTS_INDEX)
        stored = next(name for name, t in weights.items() if t is state[bad])  # as the checkpoint names it
        raise CorruptDataError(f"non-finite values in tensor {stored} of {file}",
                               fix="a diverged training wrote it: train the draft again with a lower train.lr")
    return cfg, state, meta


def load_draft_model(path: str | Path, embed: Tensor | None = None, fix: str = REBUILD
                     ) -> tuple[nn.Module, dict[str, Any]]:
    """(the draft, `load_draft`'s meta) of a draft export in either format, its weights in
    fp32, refused when one is not finite (`load_draft` with `finite`); `embed` ([V, H], the
    target's embedding as the draft takes it: a store's `target_head().embed`) fills in
    embed_tokens when the checkpoint has none."""
    return draft_model(load_draft(path, fix, finite=True), embed)


def draft_model(loaded: Loaded, embed: Tensor | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """`load_draft_model` of what `load_draft` read: the draft built by its type (`from_config`)."""
    cfg, state, meta = loaded
    state = dict(state)
    if "embed_tokens.weight" in meta["missing"]:
        if embed is None:
            raise ValueError(f"{meta['folder']}: the checkpoint has no embed_tokens.weight; pass the target's "
                             "embedding")
        state["embed_tokens.weight"] = embed
    draft = draft_type(meta["algorithm"]).from_config(cfg.to_dict())
    draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=True)
    return draft, meta


def serving_type(config: dict[str, Any], weights: dict[str, Tensor] | None = None) -> tuple[Any, str]:
    """(the draft type, the format) an export's config.json is in: the first registered type whose
    `serving_format` reads it; a ValueError naming what the config says when none does."""
    for kind in DRAFT_TYPES.values():
        fmt = getattr(kind, "serving_format", lambda *_: None)(config, weights)
        if fmt is not None:
            return kind, fmt
    titles = ", ".join(kind.TITLE for kind in DRAFT_TYPES.values())
    raise ValueError(f"config.json is no export of a draft type eaglet reads ({titles}): speculators_model_type "
                     f"{config.get('speculators_model_type')!r}, architectures {config.get('architectures')}")


def export_type(path: str | Path) -> Any:
    """The draft type of the export at `path` (`load_draft`'s folders), told by its config.json alone."""
    folder = resolve_folder(Path(path))
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{folder / CONFIG_FILE}: not readable as JSON ({e})") from e
    return serving_type(config)[0]


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


def _stored_dtype(weights: dict[str, Tensor]) -> str | None:
    floats = {str(t.dtype).removeprefix("torch.") for t in weights.values() if t.is_floating_point()}
    return floats.pop() if len(floats) == 1 else None
