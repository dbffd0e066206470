"""Training checkpoints: everything a resume needs, apart from the serving export.

    <train>/checkpoints/step-NNNNNNN/
        model.safetensors    the trained weights, full (unsharded), without the frozen embedding
        optimizer.pt         torch.save of the optimizer's state dict (read back with weights_only=True)
        rng.safetensors      torch_cpu, torch_cuda_{i}: the RNG states
        state.json           step, epoch, micro (the next micro-batch of the epoch plan),
                             fingerprint, world_size, parallel, scheduler

A checkpoint is written into a temporary folder, fsynced and renamed, so a kill leaves the
newest complete one; `keep_last` of them are kept.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..utils import atomic_write_json, fsync_dir

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.safetensors"
STATE_FILE = "state.json"


def _rng_state() -> dict[str, torch.Tensor]:
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


def save_checkpoint(folder: Path, step: int, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any],
                    sched: torch.optim.lr_scheduler.LRScheduler, state: dict[str, Any], keep_last: int) -> Path:
    """Write checkpoint `step` atomically (a temporary folder renamed), keep the last `keep_last`.
    `model_state` and `optim_state` are full (unsharded): see Parallel.full_state."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step-{step:07d}"
    tmp = folder / f".tmp-step-{step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(trainable_state(model_state), str(tmp / MODEL_FILE))
    torch.save(optim_state, tmp / OPTIMIZER_FILE)
    save_file(_rng_state(), str(tmp / RNG_FILE))
    atomic_write_json(tmp / STATE_FILE, {**state, "step": step, "scheduler": sched.state_dict()})
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    fsync_dir(folder)
    for old in sorted(p for p in folder.glob("step-*") if p.is_dir())[:-keep_last or None]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(folder: Path) -> Path | None:
    done = sorted(p for p in folder.glob("step-*") if (p / STATE_FILE).is_file())
    return done[-1] if done else None


def read_state(folder: Path) -> dict[str, Any]:
    """A checkpoint's state.json."""
    return json.loads((folder / STATE_FILE).read_text())


def read_weights(folder: Path, device: torch.device | str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(trained weights, optimizer state dict) of a checkpoint, on `device`."""
    model_state = load_file(str(folder / MODEL_FILE), device=str(device))
    optim_state = torch.load(folder / OPTIMIZER_FILE, map_location=device, weights_only=True)
    return model_state, optim_state


def restore_rng(folder: Path) -> None:
    """Set this process's RNG states to a checkpoint's."""
    _set_rng_state(load_file(str(folder / RNG_FILE)))
