"""torchrun's process group: this process's rank, collectives, and its device.

    torchrun --nproc-per-node 8 -m eaglet.cli train CONFIG              # one node, 8 GPUs
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
             --rdzv-endpoint HOST:29500 -m eaglet.cli run CONFIG         # two nodes, shared run.dir

Without torchrun every function here is a no-op over one rank (rank 0 of 1), so a plain
`eaglet train` runs the same code. How the stages split their work over the ranks is said
where they do it (eaglet/pipeline.py, eaglet/stages/extract.py, eaglet/training/loop.py); how
the draft is wrapped for DDP or FSDP2, in eaglet/draft/parallelize.py.
"""

from __future__ import annotations

import atexit
import gc
import os
import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """This process's place among torchrun's ranks (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        """More than one rank: collectives do something."""
        return self.world_size > 1


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(timeout_minutes: float = 60.0) -> DistEnv:
    """Join torchrun's process group (once; a no-op without torchrun) and return this rank's place.

    Backend: gloo for CPU tensors, plus NCCL for CUDA tensors when there are GPUs (each rank
    then uses cuda:LOCAL_RANK). `timeout_minutes` bounds any wait in a collective, such as
    ranks waiting for rank 0 to finish a stage that only it runs.
    """
    if env_world_size() > 1 and not dist.is_initialized():
        backend = "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            backend = "cpu:gloo,cuda:nccl"
        dist.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes))
        atexit.register(_destroy_at_exit)
    return dist_env()


_KEEP_AT_EXIT = False


def _destroy_at_exit() -> None:
    """The group destroyed while the interpreter is whole. Left to the interpreter's teardown,
    gloo's worker threads can abort a rank whose work is done ("terminate called without an
    active exception", SIGABRT), and NCCL warns that it was never destroyed. Garbage is
    collected first: a DDP wrapper left in a reference cycle holds the group, and freed after
    it, as the group's last holder, it would join gloo's threads holding the GIL."""
    if dist.is_initialized() and not _KEEP_AT_EXIT:
        gc.collect()
        dist.destroy_process_group()


def keep_group_at_exit() -> None:
    """After a failure: leave the group to the process's end. A rank that failed may hold
    collectives its peers never matched, which destroying the group could wait on."""
    global _KEEP_AT_EXIT
    _KEEP_AT_EXIT = True


def dist_env() -> DistEnv:
    if not (dist.is_available() and dist.is_initialized()):
        return DistEnv()
    return DistEnv(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")),
                   int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def barrier() -> None:
    """Wait for every rank. A CPU all-reduce (gloo), so it works the same with and without GPUs."""
    if dist_env().active:
        dist.all_reduce(torch.zeros(1))


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over ranks, in place; returns it."""
    if dist_env().active:
        dist.all_reduce(t)
    return t


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """`obj` of rank `src`, on every rank."""
    if not dist_env().active:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order."""
    env = dist_env()
    if not env.active:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def run_on_main(fn, *args: Any, **kwargs: Any) -> Any:
    """Run `fn` on rank 0 only; every rank gets its result, or raises its exception's type and
    message (so no rank waits forever for one that failed)."""
    env = dist_env()
    if not env.active:
        return fn(*args, **kwargs)
    result, error, sent = None, None, None
    if env.is_main:
        try:
            result = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = e
            try:
                pickle.dumps(e)
                sent = e
            except Exception:  # noqa: BLE001 - an exception that does not pickle travels as text
                sent = RuntimeError(f"rank 0: {type(e).__name__}: {e}")
    result, sent = broadcast_object((result, sent))
    if error is not None:
        raise error
    if sent is not None:
        raise sent
    return result


def resolve_device(device: str) -> torch.device:
    """'auto' -> cuda when present, else cpu; anything else as torch reads it. Under torchrun
    'auto' and 'cuda' mean this rank's GPU, cuda:LOCAL_RANK."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and env_world_size() > 1:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(device)
