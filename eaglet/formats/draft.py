"""The trained draft: what training leaves for export, eval and a later run's init.

    <train>/final/
        draft_config.json    {"algorithm": the draft type's name, "draft": its draft config's fields,
                             "aux_layers": the store's layer ids}
        model.safetensors    every weight of the draft under its own names, the frozen
                             embedding in fp32 like the rest
        checksums.json       sha256 and size of the two (eaglet/formats/checked.py)

Written by the train stage (`save_final`, a temporary folder renamed); read by export, eval and
the demo (`load_final`), which check both files against checksums.json and refuse weights that
are not finite (a diverged training), naming the file and the tensor, and rebuild the draft by
its type (eaglet/draft/__init__.py `draft_type(algorithm).from_config`). A draft_config.json
without "algorithm" was written before eaglet had draft types: an EAGLE-3 draft. The serving
formats are eaglet/formats/serving.py's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save
from torch import nn

from ..draft import DRAFT_TYPES, draft_type
from ..errors import CorruptDataError, InputError
from .checked import CheckedFolder, first_nonfinite, write_files

FINAL_DIR = "final"
DRAFT_CONFIG = "draft_config.json"
WEIGHTS_FILE = "model.safetensors"
WRITTEN_BEFORE_TYPES = "eagle3"  # the type of a draft_config.json without "algorithm" (all were EAGLE-3)
DIVERGED = ("the training diverged: train again from step 0 with a lower train.lr, "
            "`eaglet train CONFIG --force --set train.lr=...`")


def rebuild(folder: Path) -> str:
    """How to write a final/ folder again: training resumes from its last checkpoint."""
    return f"remove {folder} and run `eaglet train CONFIG`, which writes it again from the last checkpoint"


def save_final(folder: Path, state: dict[str, torch.Tensor], draft_config: Any, aux_layers: list[int],
               algorithm: str) -> None:
    """The trained draft as export reads it: draft_config.json (its type's name `algorithm`, its
    draft config's to_dict()) + model.safetensors (all weights, the frozen embedding in fp32 like
    the rest, whatever dtype training kept it in) and their checksums, hashed as they are written."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: (v.float() if k == "embed_tokens.weight" else v).detach().cpu().contiguous() for k, v in state.items()}
    meta = {"algorithm": algorithm, "draft": draft_config.to_dict(), "aux_layers": list(aux_layers)}
    write_files(tmp, {WEIGHTS_FILE: save(state), DRAFT_CONFIG: json.dumps(meta, indent=1, default=str).encode()})
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def load_final(folder: str | Path) -> tuple[nn.Module, list[int]]:
    """(the trained draft, its aux layer ids) from a final/ folder, its files checked against
    their checksums and its weights finite; raises CorruptDataError naming the file otherwise."""
    folder = Path(folder)
    checked = CheckedFolder(folder, rebuild(folder))
    meta = checked.json(DRAFT_CONFIG)
    state = checked.read(WEIGHTS_FILE, lambda p: load_file(str(p)))
    bad = first_nonfinite(state)
    if bad is not None:
        raise CorruptDataError(f"non-finite values in tensor {bad} of {folder / WEIGHTS_FILE}", fix=DIVERGED)
    algorithm = meta.get("algorithm", WRITTEN_BEFORE_TYPES)
    if algorithm not in DRAFT_TYPES:
        raise InputError(f"{folder / DRAFT_CONFIG} holds a {algorithm!r} draft, a draft type this eaglet does not "
                         f"have ({', '.join(DRAFT_TYPES)})", fix="read it with the eaglet that trained it")
    try:
        model = draft_type(algorithm).from_config(meta["draft"])
        model.load_state_dict(state, strict=True)
        aux = [int(i) for i in meta["aux_layers"]]
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        why = f"does not describe {WEIGHTS_FILE}: {type(e).__name__}: {str(e)[:160]}"
        raise checked.error(DRAFT_CONFIG, why) from e
    return model, aux
