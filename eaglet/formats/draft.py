"""The trained draft: what training leaves for export, eval and a later run's init.

    <train>/final/
        draft_config.json    {"draft": the DraftConfig fields, "aux_layers": the store's layer ids}
        model.safetensors    every weight of Eagle3Draft under its own names, the frozen
                             embedding in fp32 like the rest

Written by the train stage (`save_final`, a temporary folder renamed); read by export, eval and
the demo (`load_final`). The serving formats are eaglet/formats/serving.py's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..draft.model import DraftConfig, Eagle3Draft
from ..utils import atomic_write_json

FINAL_DIR = "final"
DRAFT_CONFIG = "draft_config.json"
WEIGHTS_FILE = "model.safetensors"


def save_final(folder: Path, state: dict[str, torch.Tensor], draft_config: DraftConfig, aux_layers: list[int]) -> None:
    """The trained draft as export reads it: draft_config.json + model.safetensors (all weights,
    the frozen embedding in fp32 like the rest, whatever dtype training kept it in)."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: (v.float() if k == "embed_tokens.weight" else v).detach().cpu().contiguous() for k, v in state.items()}
    save_file(state, str(tmp / WEIGHTS_FILE))
    atomic_write_json(tmp / DRAFT_CONFIG, {"draft": draft_config.to_dict(), "aux_layers": list(aux_layers)})
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def load_final(folder: str | Path) -> tuple[Eagle3Draft, list[int]]:
    """(the trained draft, its aux layer ids) from a final/ folder."""
    folder = Path(folder)
    meta = json.loads((folder / DRAFT_CONFIG).read_text())
    model = Eagle3Draft(DraftConfig(**meta["draft"]))
    model.load_state_dict(load_file(str(folder / WEIGHTS_FILE)), strict=True)
    return model, meta["aux_layers"]
