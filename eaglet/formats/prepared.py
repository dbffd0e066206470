"""The prepared-data format: tokenized samples with their loss masks.

`prepare` writes, `extract`, `vocab` and training read. A folder holds shards
`data-00000.safetensors`, ... each with flat tensors

    input_ids    int32  [N]     all samples' tokens, concatenated
    loss_mask    uint8  [N]     1 on tokens the draft is trained to predict (assistant turns)
    offsets      int64  [S+1]   sample s is tokens offsets[s]:offsets[s+1]
    sample_id    int64  [S]     global id, dense from 0 in prepare's order
    source_file  int32  [S]     index into index.json's "files"
    source_row   int64  [S]     line (JSONL, 1-based), element (JSON array, 0-based) or row (Parquet, 0-based)

and `index.json` lists the shards with their sample counts and the source files, and the format
version (PREPARED_VERSION, eaglet/formats/version.py: another version, or none, is refused in one
line naming the folder and AFRESH);
`checksums.json` (eaglet/formats/checked.py) the sha256 and size of every shard and of index.json,
taken as they are written. `PreparedData` checks each file against it before reading it, and
that a shard's offsets cut its tokens into its samples: a damaged file is CorruptDataError naming
it, with REBUILD.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from safetensors.numpy import load_file, save

from ..errors import CorruptDataError
from .checked import CHECKSUMS, CheckedFolder, write_file, write_sums
from .version import KEY as VERSION_KEY, PREPARED_VERSION, check_version, recorded_version

INDEX = "index.json"
REBUILD = "rebuild it with `eaglet prepare CONFIG --force`"
AFRESH = "prepare it afresh with `eaglet prepare CONFIG --force`"


@dataclass
class Sample:
    sample_id: int
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    source_file: int = -1
    source_row: int = -1


class PreparedWriter:
    """Accumulates samples and writes a shard every `shard_samples`."""

    def __init__(self, folder: str | Path, files: list[str], shard_samples: int = 50000):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        for old in [*self.folder.glob("data-*.safetensors"), self.folder / CHECKSUMS]:
            old.unlink(missing_ok=True)
        self.files = files
        self.shard_samples = shard_samples
        self.buf: list[Sample] = []
        self.shards: list[dict] = []
        self.sums: dict[str, dict] = {}  # file -> {"sha256", "bytes"} of each file written
        self.num_samples = 0

    def add(self, input_ids: np.ndarray | list[int], loss_mask: np.ndarray | list[int], source_file: int, source_row: int) -> int:
        sid = self.num_samples
        self.buf.append(Sample(sid, np.asarray(input_ids, dtype=np.int32), np.asarray(loss_mask, dtype=np.uint8), source_file, source_row))
        self.num_samples += 1
        if len(self.buf) >= self.shard_samples:
            self._flush()
        return sid

    def _flush(self) -> None:
        if not self.buf:
            return
        lengths = np.array([len(s.input_ids) for s in self.buf], dtype=np.int64)
        tensors = {
            "input_ids": np.concatenate([s.input_ids for s in self.buf]),
            "loss_mask": np.concatenate([s.loss_mask for s in self.buf]),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "sample_id": np.array([s.sample_id for s in self.buf], dtype=np.int64),
            "source_file": np.array([s.source_file for s in self.buf], dtype=np.int32),
            "source_row": np.array([s.source_row for s in self.buf], dtype=np.int64),
        }
        name = f"data-{len(self.shards):05d}.safetensors"
        self.sums[name] = write_file(self.folder / name, save(tensors))
        self.shards.append({"file": name, "samples": len(self.buf), "tokens": int(lengths.sum())})
        self.buf = []

    def close(self) -> dict:
        self._flush()
        index = {"format": "eaglet-prepared-v1", VERSION_KEY: PREPARED_VERSION, "files": self.files, "shards": self.shards, "num_samples": self.num_samples}
        self.sums[INDEX] = write_file(self.folder / INDEX, json.dumps(index, indent=1).encode())
        write_sums(self.folder, self.sums)
        return index


_SHARD_TENSORS = ("input_ids", "loss_mask", "offsets", "sample_id", "source_file", "source_row")


def _shard_problem(data: dict[str, np.ndarray], samples: int) -> str | None:
    """Why a shard's tensors are not `samples` samples as the format lays them out, or None (its
    checksum matched: this catches a writer's bug, not a flipped bit)."""
    missing = [n for n in _SHARD_TENSORS if n not in data]
    if missing:
        return f"no tensor {missing[0]}"
    off, tokens = data["offsets"], data["input_ids"].shape[0]
    if (off.shape != (samples + 1,) or any(data[n].shape != (samples,) for n in _SHARD_TENSORS[3:])
            or data["loss_mask"].shape != (tokens,)):
        return f"its tensors do not hold the {samples} samples index.json lists"
    if int(off[0]) != 0 or int(off[-1]) != tokens or bool((np.diff(off) < 0).any()):
        return f"its offsets do not cut its {tokens} tokens into samples"
    return None


class PreparedData:
    """Random access to prepared samples (loads shards on demand; samples are small)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not (self.folder / INDEX).is_file() and not (self.folder / CHECKSUMS).is_file():
            raise FileNotFoundError(f"no prepared data in {self.folder} (missing {INDEX}); run `eaglet prepare` first")
        self._checked = CheckedFolder(self.folder, REBUILD)
        try:
            self.index = self._checked.json(INDEX)
        except CorruptDataError:  # another eaglet's index is refused as such, not as damaged
            check_version(recorded_version(self.folder / INDEX), PREPARED_VERSION, "the prepared data", self.folder,
                          fix=AFRESH)
            raise
        found = self.index.get(VERSION_KEY) if isinstance(self.index, dict) else None
        check_version(found, PREPARED_VERSION, "the prepared data", self.folder, fix=AFRESH)
        try:
            self.files: list[str] = list(self.index["files"])
            shards = [(str(sh["file"]), int(sh["samples"])) for sh in self.index["shards"]]
        except (KeyError, TypeError, ValueError) as e:
            raise self._checked.error(INDEX, f"not a prepared-data index: {type(e).__name__}: {e}") from e
        self._shards: dict[int, dict[str, np.ndarray]] = {}
        starts, lengths, ids = [], [], []
        total = 0
        for k, (_, samples) in enumerate(shards):
            data = self._shard(k)
            off = data["offsets"]
            lengths.append(np.diff(off))
            ids.append(data["sample_id"])
            starts.append(total)
            total += samples
        self._shard_start = np.array(starts, dtype=np.int64)
        self.lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self.sample_ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)

    def _shard(self, k: int) -> dict[str, np.ndarray]:
        if k not in self._shards:
            sh = self.index["shards"][k]
            data = self._checked.read(sh["file"], lambda p: load_file(str(p)))
            problem = _shard_problem(data, int(sh["samples"]))
            if problem is not None:
                raise self._checked.error(sh["file"], problem)
            self._shards[k] = data
        return self._shards[k]

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __getitem__(self, i: int) -> Sample:
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = int(np.searchsorted(self._shard_start, i, side="right") - 1)
        data = self._shard(k)
        j = i - int(self._shard_start[k])
        a, b = int(data["offsets"][j]), int(data["offsets"][j + 1])
        return Sample(int(data["sample_id"][j]), data["input_ids"][a:b], data["loss_mask"][a:b],
                      int(data["source_file"][j]), int(data["source_row"][j]))

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self[i]

    def tensors(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids int64 [T], loss_mask bool [T]) of sample i."""
        s = self[i]
        return torch.from_numpy(s.input_ids.astype(np.int64)), torch.from_numpy(s.loss_mask.astype(bool))
