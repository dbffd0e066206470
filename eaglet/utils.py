"""Small shared helpers: atomic writes, file hashing, logging, dtype names, host-to-device copies,
child processes."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float8_e4m3fn": torch.float8_e4m3fn}  # config names


def log(msg: str, all_ranks: bool = False) -> None:
    """A progress line on stderr. Under torchrun only rank 0 prints, unless `all_ranks`
    (then the line names its rank)."""
    rank = os.environ.get("RANK", "0")
    if rank == "0" and not all_ranks:
        print(msg, file=sys.stderr, flush=True)
    elif all_ranks:
        print(msg if os.environ.get("WORLD_SIZE", "1") == "1" else f"[rank {rank}] {msg}", file=sys.stderr, flush=True)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_writer(path: str | Path, fsync: bool = True) -> Iterator[BinaryIO]:
    """A binary file that appears at `path` whole, or not at all: written to a temporary file
    beside it, fsynced, and renamed over `path` when the block exits without an error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if fsync:
            fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes | memoryview, fsync: bool = True) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one."""
    with atomic_writer(path, fsync) as f:
        f.write(data)


def atomic_write_text(path: str | Path, text: str, fsync: bool = True) -> None:
    atomic_write_bytes(path, text.encode(), fsync=fsync)


def atomic_write_json(path: str | Path, obj: Any, fsync: bool = True) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, default=str), fsync=fsync)


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_fingerprint(path: str | Path, cache_file: Path | None = None) -> str:
    """Content hash of a file, cached by (path, size, mtime) so large inputs hash once."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"input file not found: {p}")
    st = p.stat()
    key = f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    cache: dict[str, str] = {}
    if cache_file is not None and cache_file.is_file():
        try:
            cache = json.loads(cache_file.read_text())
        except json.JSONDecodeError:
            cache = {}
    if key in cache:
        return cache[key]
    digest = sha256_file(p)
    if cache_file is not None:
        cache[key] = digest
        atomic_write_json(cache_file, cache, fsync=False)
    return digest


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without the host waiting for it: to a GPU from pinned memory
    (pinned here unless it is already), asynchronously. A copy from pageable memory would
    make the host wait."""
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return (host if host.is_pinned() else host.pin_memory()).to(device, non_blocking=True)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` still runs (a child's watch on the trainer that started it)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or its number taken by another user's process
        return False
    return True


def child_context(*preload: str) -> Any:
    """A multiprocessing context whose children fork from Python's fork server, a single-threaded
    process that has imported the `preload` modules (torch with them) once: no child forks the
    trainer, with its CUDA context and threads, and none pays torch's import again. The server is
    one per process: the first call that starts a child fixes what it preloaded."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where the token lists differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
