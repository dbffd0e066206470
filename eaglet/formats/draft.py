"""The trained draft: what training leaves for export, eval and a later run's init.

    <train>/final/
        draft_config.json    {"draft": the DraftConfig fields, "aux_layers": the store's layer ids}
        model.safetensors    every weight of Eagle3Draft under its own names, the frozen
                             embedding in fp32 like the rest
        checksums.json       sha256 and size of the two (eaglet/formats/checked.py)

Written by the train stage (`save_final`, a temporary folder renamed); read by export, eval and
the demo (`load_final`), which check both files against checksums.json and refuse weights that
are not finite (a diverged training), naming the file and the tensor. The serving formats are
eaglet/formats/serving.py's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from ..draft.eagle3.model import DraftConfig, Eagle3Draft
from ..errors import CorruptDataError
from .checked import CheckedFolder, first_nonfinite, write_files

FINAL_DIR = "final"
DRAFT_CONFIG = "draft_config.json"
WEIGHTS_FILE = "model.safetensors"
DIVERGED = ("the training diverged: train again from step 0 with a lower train.lr, "
            "`eaglet train CONFIG --force --set train.lr=...`")


def rebuild(folder: Path) -> str:
    """How to write a final/ folder again: training resumes from its last checkpoint."""
    return f"remove {folder} and run `eaglet train CONFIG`, which writes it again from the last checkpoint"


def save_final(folder: Path, state: dict[str, torch.Tensor], draft_config: DraftConfig, aux_layers: list[int]) -> None:
    """The trained draft as export reads it: draft_config.json + model.safetensors (all weights,
    the frozen embedding in fp32 like the rest, whatever dtype training kept it in) and their
    checksums, hashed as they are written."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: (v.float() if k == "embed_tokens.weight" else v).detach().cpu().contiguous() for k, v in state.items()}
    meta = {"draft": draft_config.to_dict(), "aux_layers": list(aux_layers)}
    write_files(tmp, {WEIGHTS_FILE: save(state), DRAFT_CONFIG: json.dumps(meta, indent=1, default=str).encode()})
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def load_final(folder: str | Path) -> tuple[Eagle3Draft, list[int]]:
    """(the trained draft, its aux layer ids) from a final/ folder, its files checked against
    their checksums and its weights finite; raises CorruptDataError naming the file otherwise."""
    folder = Path(folder)
    checked = CheckedFolder(folder, rebuild(folder))
    meta = checked.json(DRAFT_CONFIG)
    state = checked.read(WEIGHTS_FILE, lambda p: load_file(str(p)))
    bad = first_nonfinite(state)
    if bad is not None:
        raise CorruptDataError(f"non-finite values in tensor {bad} of {folder / WEIGHTS_FILE}", fix=DIVERGED)
    try:
        model = Eagle3Draft(DraftConfig(**meta["draft"]))
        model.load_state_dict(state, strict=True)
        aux = [int(i) for i in meta["aux_layers"]]
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        why = f"does not describe {WEIGHTS_FILE}: {type(e).__name__}: {str(e)[:160]}"
        raise checked.error(DRAFT_CONFIG, why) from e
    return model, aux
