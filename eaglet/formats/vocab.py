"""The draft vocabulary's file: `<vocab>/vocab.safetensors`.

    d2t     int64 [N]   draft id -> target id offset: target id = draft id + d2t[draft id]
    t2d     bool  [V]   whether each target id is in the draft vocabulary
    counts  int64 [V]   loss-masked occurrences of each target id in the prepared data

Written by the vocab stage (eaglet/stages/vocab.py); read by training.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save

from ..utils import atomic_write_bytes

VOCAB_FILE = "vocab.safetensors"


def save_vocab(folder: str | Path, d2t: torch.Tensor, t2d: torch.Tensor, counts: np.ndarray) -> None:
    atomic_write_bytes(Path(folder) / VOCAB_FILE, save({"d2t": d2t, "t2d": t2d, "counts": torch.from_numpy(counts)}))


def load_vocab(folder: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a vocab stage's folder."""
    t = load_file(str(Path(folder) / VOCAB_FILE))
    return t["d2t"], t["t2d"]
