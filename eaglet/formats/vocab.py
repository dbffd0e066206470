"""The draft vocabulary's file: `<vocab>/vocab.safetensors`, listed in `<vocab>/checksums.json`.

    d2t     int64 [N]   draft id -> target id offset: target id = draft id + d2t[draft id]
    t2d     bool  [V]   whether each target id is in the draft vocabulary
    counts  int64 [V]   loss-masked occurrences of each target id in the prepared data

Written by the vocab stage (eaglet/stages/vocab.py); read by training, which checks its size and
sha256 first (eaglet/formats/checked.py): a damaged file is CorruptDataError with REBUILD.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save

from .checked import CheckedFolder, write_files

VOCAB_FILE = "vocab.safetensors"
REBUILD = "rebuild it with `eaglet vocab CONFIG --force`"


def save_vocab(folder: str | Path, d2t: torch.Tensor, t2d: torch.Tensor, counts: np.ndarray) -> None:
    write_files(folder, {VOCAB_FILE: save({"d2t": d2t, "t2d": t2d, "counts": torch.from_numpy(counts)})})


def load_vocab(folder: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a vocab stage's folder, checked against its checksums.json."""
    checked = CheckedFolder(folder, REBUILD)
    t = checked.read(VOCAB_FILE, lambda p: load_file(str(p)))
    if "d2t" not in t or "t2d" not in t:
        raise checked.error(VOCAB_FILE, f"no d2t/t2d among its tensors {sorted(t)}")
    return t["d2t"], t["t2d"]
