"""Training checkpoints: everything a resume needs, apart from the serving export.

    <train>/checkpoints/step-NNNNNNN/
        model.safetensors    the trained weights, full (unsharded), without the frozen embedding
        optimizer.pt         torch.save of the optimizer's state dict (read back with weights_only=True)
        rng.safetensors      torch_cpu, torch_cuda_{i}: the RNG states
        state.json           format_version, step, epoch, micro (the next micro-batch of the epoch
                             plan), fingerprint, settings, schedule, world_size, parallel, scheduler
        checksums.json       sha256 and size of each of the four files above

A checkpoint is written into a temporary folder, checksummed, fsynced and renamed, so a kill
leaves the newest complete one; `keep_last` of them (at least one) are kept. Reading verifies
the checksums and that every weight and optimizer value is finite: a checkpoint that fails is
named with the reason (CorruptCheckpointError) and `newest_intact` goes on to the one before.

Format version (eaglet/formats/version.py): state.json records CHECKPOINT_VERSION. A checkpoint
of another version, or of none, is not damaged but another eaglet's: `read_checkpoint` refuses it
in one line naming it and the command that starts training afresh (FormatVersionError), and
`newest_intact` does not pass over it to an older one, which that eaglet wrote too.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..errors import CorruptDataError
from ..utils import atomic_write_json, fsync_dir, sha256_file
from .version import CHECKPOINT_VERSION, KEY as VERSION_KEY, check_version, recorded_version

CKPT_DIR = "checkpoints"  # the folder of a run's checkpoints, in its train output folder
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.safetensors"
STATE_FILE = "state.json"
CHECKSUM_FILE = "checksums.json"
CHECKSUMMED = (MODEL_FILE, OPTIMIZER_FILE, RNG_FILE, STATE_FILE)


class CorruptCheckpointError(CorruptDataError):
    """A checkpoint that fails its checksums, cannot be read, or holds non-finite values."""

    def __init__(self, folder: Path, reason: str):
        self.folder, self.reason = folder, reason
        super().__init__(f"checkpoint {folder.name} is corrupt ({reason})")

    def __reduce__(self):  # raised across ranks: rebuilt from its own arguments
        return type(self), (self.folder, self.reason)


@dataclass
class Checkpoint:
    """A checkpoint read back: its state.json, and its weights and optimizer state when asked for."""

    folder: Path
    state: dict[str, Any]
    verified: bool  # this read checked its checksums and values (`read_checkpoint`'s `check`)
    model: dict[str, torch.Tensor] | None = None
    optimizer: dict[str, Any] | None = None

    @property
    def step(self) -> int:
        return int(self.state["step"])


def rng_state() -> dict[str, torch.Tensor]:
    """This process's RNG states (CPU and every CUDA device), as rng.safetensors holds them."""
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"torch_cuda_{i}"] = s
    return out


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    if torch.cuda.is_available():
        cuda = [state[k] for k in sorted(state) if k.startswith("torch_cuda_")]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def trainable_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpointed weights: everything but the frozen, target-copied embedding."""
    return {k: v.detach().contiguous() for k, v in state.items() if k != "embed_tokens.weight"}


# Beside the tensors' bytes (measured with torch 2.13): save_file's JSON header entry per tensor,
# torch.save's zip record and pickle per tensor, and the rng, state and checksum files.
SAFETENSORS_PER_TENSOR = 100
TORCH_SAVE_PER_TENSOR = 250
SMALL_FILES = 12 * 2**10


def safetensors_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of `save_file(state)` (meta tensors will do): each tensor in its dtype, and the header."""
    return sum(v.numel() * v.element_size() + SAFETENSORS_PER_TENSOR + len(k) for k, v in state.items())


def checkpoint_bytes(model_state: dict[str, torch.Tensor], optimized: list[torch.Tensor]) -> int:
    """Bytes of one checkpoint folder as `save_checkpoint` writes it (meta tensors will do):
    `trainable_state(model_state)` in its dtypes; AdamW's state of each tensor in `optimized`
    (two moments in the parameter's dtype and a float32 step); the small files."""
    optimizer = sum(2 * q.numel() * q.element_size() + 4 + 3 * TORCH_SAVE_PER_TENSOR for q in optimized)
    return safetensors_bytes(trainable_state(model_state)) + optimizer + SMALL_FILES


def _checksums(folder: Path, names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """{name: {"sha256", "bytes"}} of files in `folder`, hashed on one thread each (hashlib
    releases the GIL: a large optimizer.pt and model.safetensors are read side by side)."""
    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        digests = list(pool.map(lambda n: sha256_file(folder / n), names))
    return {n: {"sha256": d, "bytes": (folder / n).stat().st_size} for n, d in zip(names, digests)}


def save_checkpoint(folder: Path, step: int, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any],
                    sched_state: dict[str, Any], state: dict[str, Any], keep_last: int,
                    rng: dict[str, torch.Tensor] | None = None) -> Path:
    """Write checkpoint `step` atomically (a temporary folder, checksummed, renamed), keep the
    last `keep_last` (at least this one). `model_state` and `optim_state` are full (unsharded):
    see Parallel.full_state. `sched_state` is the scheduler's state_dict(), `rng` the RNG
    states (`rng_state()`; default: taken now): a write behind the loop passes both as they
    were at the step."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step-{step:07d}"
    tmp = folder / f".tmp-step-{step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(trainable_state(model_state), str(tmp / MODEL_FILE))
    torch.save(optim_state, tmp / OPTIMIZER_FILE)
    save_file(rng_state() if rng is None else rng, str(tmp / RNG_FILE))
    atomic_write_json(tmp / STATE_FILE, {**state, VERSION_KEY: CHECKPOINT_VERSION, "step": step, "scheduler": sched_state})
    atomic_write_json(tmp / CHECKSUM_FILE, {"files": _checksums(tmp, CHECKSUMMED)})
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    fsync_dir(folder)
    for old in checkpoints(folder)[max(keep_last, 1):]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoints(folder: Path) -> list[Path]:
    """The `step-*` checkpoint folders in `folder`, newest first (unfinished ones are `.tmp-*`)."""
    return sorted((p for p in folder.glob("step-*") if p.is_dir()), reverse=True)


def verify(folder: Path) -> None:
    """Check checkpoint `folder`'s files against its checksums.json; raises CorruptCheckpointError
    naming the first that does not match (or checksums.json itself, missing or unreadable)."""
    sums_path = folder / CHECKSUM_FILE
    if not sums_path.is_file():
        raise CorruptCheckpointError(folder, f"{CHECKSUM_FILE}: missing")
    try:
        want = json.loads(sums_path.read_text())["files"]
        want = {n: (want[n]["sha256"], int(want[n]["bytes"])) for n in CHECKSUMMED}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(folder, f"{CHECKSUM_FILE}: unreadable ({type(e).__name__})") from e
    present = []
    for name, (_, size) in want.items():
        path = folder / name
        if not path.is_file():
            raise CorruptCheckpointError(folder, f"{name}: missing")
        if path.stat().st_size != size:
            raise CorruptCheckpointError(folder, f"{name}: {path.stat().st_size} bytes, {size} written")
        present.append(name)
    got = _checksums(folder, tuple(present))
    for name in present:
        if got[name]["sha256"] != want[name][0]:
            raise CorruptCheckpointError(folder, f"{name}: sha256 mismatch")


def _first_nonfinite(obj: Any, where: str = "") -> str | None:
    """The name of the first floating tensor in `obj` (nested dicts and lists) with a NaN or inf."""
    if isinstance(obj, torch.Tensor):
        return where if obj.is_floating_point() and not bool(torch.isfinite(obj).all()) else None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        bad = _first_nonfinite(v, f"{where}.{k}" if where else str(k))
        if bad is not None:
            return bad
    return None


def _readable_state(folder: Path) -> dict[str, Any] | None:
    """state.json of checkpoint `folder`, or None where it cannot be read as a JSON object."""
    try:
        state = json.loads((folder / STATE_FILE).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return state if isinstance(state, dict) else None


_AFRESH = "start training afresh with `eaglet train CONFIG --force` (or remove {})"


def read_checkpoint(folder: Path, device: torch.device | str | None = None, check: bool = True) -> Checkpoint:
    """Checkpoint `folder`: its state, and with `device` its weights and optimizer state there.
    `check`: verify the checksums and that every weight and optimizer value is finite first (the
    rank that picked the checkpoint does; the others read what it checked). Raises
    CorruptCheckpointError naming the file and what is wrong, FormatVersionError for a checkpoint
    of another format version (also where its files do not pass this version's checks: what
    another eaglet wrote is refused as such, not as damaged)."""
    if check:
        try:
            verify(folder)
        except CorruptCheckpointError:  # another eaglet's checkpoint is refused as such, not as damaged
            check_version(recorded_version(folder / STATE_FILE), CHECKPOINT_VERSION, "the checkpoint", folder,
                          fix=_AFRESH.format(folder.parent))
            raise
    state = _readable_state(folder)
    if state is None or not isinstance(state.get("step"), int):
        raise CorruptCheckpointError(folder, f"{STATE_FILE}: unreadable")
    check_version(state.get(VERSION_KEY), CHECKPOINT_VERSION, "the checkpoint", folder,
                  fix=_AFRESH.format(folder.parent))
    ckpt = Checkpoint(folder, state, check)
    if device is None:
        return ckpt
    reads = [(MODEL_FILE, lambda p: load_file(str(p), device=str(device))),
             (OPTIMIZER_FILE, lambda p: torch.load(p, map_location=device, weights_only=True))]
    if check:
        reads.append((RNG_FILE, lambda p: load_file(str(p))))
    for name, read in reads:
        try:
            value = read(folder / name)
        except Exception as e:  # noqa: BLE001 - any failure to read a file is the file's damage
            raise CorruptCheckpointError(folder, f"{name}: unreadable ({type(e).__name__}: {str(e)[:120]})") from e
        bad = _first_nonfinite(value) if check else None
        if bad is not None:
            raise CorruptCheckpointError(folder, f"{name}: non-finite values in {bad}")
        if name == MODEL_FILE:
            ckpt.model = value
        elif name == OPTIMIZER_FILE:
            ckpt.optimizer = value
    return ckpt


def newest_intact(folder: Path, device: torch.device | str | None = None
                  ) -> tuple[Checkpoint | None, list[CorruptCheckpointError]]:
    """(the newest checkpoint in `folder` that reads back intact, with its weights on `device`,
    or None; the newer ones that did not, newest first). A checkpoint of another format version
    is refused (FormatVersionError), not passed over."""
    corrupt = []
    for path in checkpoints(folder):
        try:
            return read_checkpoint(path, device), corrupt
        except CorruptCheckpointError as e:
            corrupt.append(e)
    return None, corrupt


def restore_rng(folder: Path) -> None:
    """Set this process's RNG states to a checkpoint's."""
    _set_rng_state(load_file(str(folder / RNG_FILE)))
