"""What the stages' input hashes hold of the target model: its identity, cheaply.

A target replaced in place (another model, tokenizer or chat template in the same folder)
must rerun the stages that depend on it, so the pipeline hashes, per stage:

    tokenizer_identity   prepare: the tokenizer's files (and target.tokenizer's folder), whole
    model_identity       extract: config, generation config, remote code, the weight index,
                         and per weight file its name, size and a sample of its bytes

Weights are not read whole (a 1T target is terabytes): a sample of 64 KiB at the start, the
middle and the end of each file tells another checkpoint of the same shapes (a fine-tune)
from the original, at three reads per file. Modification times are not used: a copied
folder is the same target.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from ..config import TargetSection
from ..utils import file_fingerprint
from .load import local_folder

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json")
MODEL_NAMES = ("config.json", "generation_config.json")
SAMPLE_BYTES = 64 * 1024


def sampled_digest(path: Path, sample: int = SAMPLE_BYTES) -> str:
    """sha256 of a large file's size and three `sample`-byte reads (start, middle, end)."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for at in sorted({0, max(0, size // 2 - sample // 2), max(0, size - sample)}):
            f.seek(at)
            h.update(f.read(sample))
    return h.hexdigest()


def _files(folder: Path, cache: Path | None, names: tuple[str, ...], suffixes: tuple[str, ...] = ()) -> dict[str, str]:
    out = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and (p.name in names or p.name.endswith(suffixes)):
            out[p.name] = file_fingerprint(p, cache)
    return out


def tokenizer_identity(tcfg: TargetSection, cache: Path | None = None) -> dict[str, Any]:
    """The tokenizer files prepare renders with (the target's own, or target.tokenizer's)."""
    where = tcfg.tokenizer or tcfg.path
    folder = local_folder(where, tcfg.revision)
    if folder is None:
        return {"path": where, "found": False}
    return {"files": _files(folder, cache, TOKENIZER_NAMES, (".model",))}


def model_identity(tcfg: TargetSection, cache: Path | None = None) -> dict[str, Any]:
    """The target's config, remote code, weight index, and its weight files' names, sizes and
    sampled bytes."""
    folder = local_folder(tcfg.path, tcfg.revision)
    if folder is None:
        return {"path": tcfg.path, "found": False}
    weights = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES):
            weights[p.name] = sampled_digest(p)
    if tcfg.gguf_file and Path(tcfg.gguf_file).is_absolute() and Path(tcfg.gguf_file).is_file():
        weights[tcfg.gguf_file] = sampled_digest(Path(tcfg.gguf_file))
    return {
        "files": _files(folder, cache, MODEL_NAMES, (".index.json", ".py")),
        "weights": weights,
    }
