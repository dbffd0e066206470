"""Checkpoints written behind the training loop (train.ckpt_async).

    writer = CheckpointWriter(background=True)
    snap = host_snapshot(model, opt, model_state, optim_state, sched_state, state)   # in the loop
    writer.submit(folder, partial(save_checkpoint, ..., *snap, ...))                 # returns at once
    writer.wait()                                                                    # before final/

A checkpoint holds fp32 weights and AdamW's two moments, so at a large draft's width writing
and checksumming it in the loop stops training for a long while (docs/performance.md,
"Checkpoints"). Here the loop waits only for a host copy of the step's state; one thread writes it with `save_checkpoint`
unchanged (eaglet/formats/checkpoints.py owns the format), one write at a time, so the host
holds at most one snapshot. A write that failed is raised at the next `submit` or `wait`,
naming its folder; a kill mid-write leaves a `.tmp-step-*` folder, which resume passes over.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..utils import log


def _host_copy(obj: Any, live: set[int]) -> Any:
    """`obj` (a state dict: nested dicts, lists and tensors) with every tensor on the CPU and
    apart from training's: one on another device, or sharing its storage with one of `live`
    (the data pointers of the draft's weights and the optimizer's state), is copied."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu" and obj.untyped_storage().data_ptr() not in live:
            return obj
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _host_copy(v, live) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host_copy(v, live) for v in obj)
    return obj


def _storage(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor (fsdp): this rank's shard
    return local.untyped_storage().data_ptr()


def host_snapshot(model: nn.Module, opt: torch.optim.Optimizer, model_state: dict[str, torch.Tensor],
                  optim_state: dict[str, Any], sched_state: dict[str, Any], state: dict[str, Any]
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(model_state, optim_state, sched_state, state) as the next steps leave them: every tensor
    on the GPU or sharing storage with the model's weights or the optimizer's state copied to
    the CPU (on a CPU run full_state is the weights themselves), the dicts deep-copied. Under
    fsdp the gathered CPU tensors are already apart and kept."""
    opt_tensors = (v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    live = {_storage(t) for t in (*model.parameters(), *model.buffers(), *opt_tensors)}
    return (_host_copy(model_state, live), _host_copy(optim_state, live),
            copy.deepcopy(sched_state), copy.deepcopy(state))


class CheckpointWriter:
    """Rank 0's checkpoint writes, one at a time: on a thread behind the loop (`background`) or
    in the caller. `submit` waits for the write before it first, so the host holds at most one
    snapshot; a write that failed is raised by the next `wait` (or `submit`), naming its folder."""

    def __init__(self, background: bool):
        self.background = background
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[Path, Future] | None = None

    def submit(self, folder: Path, write: Callable[[], Any]) -> None:
        """Write checkpoint `folder` with `write()`, here or (background) on the thread."""
        self.wait()
        if not self.background:
            write()
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="eaglet-checkpoint")
        self._pending = (folder, self._pool.submit(write))

    def wait(self) -> None:
        """Until the write in flight is done; raises its failure. (Interrupted, it stays pending.)"""
        if self._pending is None:
            return
        folder, future = self._pending
        error = future.exception()
        self._pending = None
        if error is not None:
            raise RuntimeError(f"train: writing checkpoint {folder} failed ({type(error).__name__}: {error}); the "
                               "checkpoints before it are as they were: a rerun resumes from the newest") from error

    def close(self) -> None:
        """Wait for the write in flight and end the thread. On an error's way out: a failed
        write is logged, the error on its way stays the one raised."""
        try:
            self.wait()
        except RuntimeError as e:
            log(f"[train] {e}")
        finally:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None
