"""The stream buffer: the states of the micro-batches an engine computed ahead of training.

    <stream dir>/mb-r<rank>-<seq>.safetensors     one micro-batch, the seq-th this rank loads

With `extract.mode: online` and `extract.backend: vllm` (eaglet/engines/vllm/stream.py) nothing of
the states is stored but these files: the engine's side writes each micro-batch whole
(a temporary file renamed into place), training's side reads it once and deletes it. Tensors
(the samples' rows concatenated, as a store shard holds them): `aux` [N, n_aux*H] and
`final` [N, H] in the store dtype (float8_e4m3fn with `aux_scale` [N, n_aux] and
`final_scale` [N, 1], float32), `input_ids` int32 [N], `loss_mask` uint8 [N]. Metadata:
`format`, `rank`, `seq`, `sample_ids` and `lens` (JSON lists). The files are transient: a
restarted run deletes what a killed one left and asks the engine again.
"""

from __future__ import annotations

import json
from pathlib import Path
import torch
from safetensors import SafetensorError, safe_open

from ..errors import CorruptDataError
from .store import FP8, write_safetensors

FORMAT = "eaglet-stream-1"
HEADER_BYTES = 4096  # a bound on an entry's safetensors header (its metadata lists the sample ids)


STREAM_DIR = "stream"  # in the train stage's folder, when extract.stream_dir is not set


def buffer_folder(stream_dir: str | None, train_dir: Path) -> Path:
    """Where the buffer lives: extract.stream_dir, else <train stage folder>/stream."""
    return Path(stream_dir) if stream_dir else train_dir / STREAM_DIR

def entry_name(rank: int, seq: int) -> str:
    return f"mb-r{rank}-{seq:09d}.safetensors"


def entry_bytes(tokens: int, samples: int, n_aux: int, hidden: int, dtype: torch.dtype) -> int:
    """At least the size of an entry of `tokens` tokens (a bound the buffer reserves)."""
    per_token = (n_aux + 1) * hidden * torch.empty((), dtype=dtype).element_size() + 4 + 1
    if dtype == FP8:
        per_token += (n_aux + 1) * 4
    return tokens * per_token + HEADER_BYTES + 24 * samples


def connector_itemsize(target_dtype: str) -> int:
    """Bytes per value of the states vLLM's connector files hold: the dtype the engine computes
    in, target.dtype (a server's own: set target.dtype to what it runs); "auto" runs a float32
    checkpoint in 16 bits too, as vLLM does."""
    return 4 if target_dtype == "float32" else 2


def micro_batch_bytes(tokens: int, samples: int, n_aux: int, hidden: int, dtype: torch.dtype,
                      connector_bytes: int = 2) -> int:
    """What one micro-batch holds of the buffer at most: its entry, and the connector files of
    its requests (vLLM writes the n_aux + 1 states, `connector_bytes` a value: `connector_itemsize`,
    with the token ids) until they are converted."""
    connector = tokens * ((n_aux + 1) * hidden * connector_bytes + 8) + 4096 * samples
    return entry_bytes(tokens, samples, n_aux, hidden, dtype) + connector


def write_entry(folder: Path, rank: int, seq: int, sample_ids: list[int], lens: list[int],
                tensors: dict[str, torch.Tensor]) -> tuple[Path, int]:
    """One micro-batch's entry, whole or not at all; returns (path, bytes). Neither fsynced nor
    hashed: a restarted run never reads what a killed one left, and this run reads it once."""
    path = folder / entry_name(rank, seq)
    meta = {"format": FORMAT, "rank": str(rank), "seq": str(seq), "sample_ids": json.dumps([int(i) for i in sample_ids]),
            "lens": json.dumps([int(n) for n in lens])}
    _, size = write_safetensors(path, {k: ([v.contiguous()], list(v.shape)) for k, v in tensors.items()}, meta,
                                fsync=False, digest=False)
    return path, size


def read_entry(path: Path) -> tuple[list[int], list[int], dict[str, torch.Tensor]]:
    """(sample ids, lens, tensors) of an entry; a file that is not one is a CorruptDataError."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise CorruptDataError(f"stream buffer {path}: not an eaglet stream entry (format "
                                       f"{meta.get('format')!r})")
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iteration)
        ids, lens = json.loads(meta["sample_ids"]), json.loads(meta["lens"])
    except (SafetensorError, OSError, KeyError, ValueError) as e:
        raise CorruptDataError(f"stream buffer {path}: unreadable ({type(e).__name__}: {e})",
                               fix="rerun the same command: the buffer is computed again") from e
    if sum(lens) != int(tensors["input_ids"].shape[0]):
        raise CorruptDataError(f"stream buffer {path}: {sum(lens)} tokens listed, {tensors['input_ids'].shape[0]} held")
    return ids, lens, tensors


def clear_entries(folder: Path, rank: int) -> int:
    """Delete this rank's entries and temporaries (what a killed run left); returns how many."""
    found = [*folder.glob(f"mb-r{rank}-*.safetensors"), *folder.glob(f".mb-r{rank}-*.tmp")]
    for f in found:
        f.unlink(missing_ok=True)
    return len(found)
