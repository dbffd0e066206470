"""Files eaglet writes and reads back, checked before use: `checksums.json`, and the reads that
verify against it.

    <folder>/checksums.json    {"format": "eaglet-checksums-v1",
                                "files": {name: {"sha256": hex digest, "bytes": size}}}

A format module writes its files through `write_files` (or `write_file` and then `write_sums`
for files written one by one; `update_sums` for a folder whose files are written at different
times, the store's): each file atomically, its sha256 taken from the bytes in memory as they are
written (never read back to be hashed), then the folder's checksums.json. Its reader
opens the folder as a `CheckedFolder`, which checks a file's size and sha256 against
checksums.json before the file is parsed, and turns a file it cannot parse into
CorruptDataError too: a missing, cut, flipped or unparsable file is named in one line with the
command that rebuilds it (exit 5), never a library's exception.

Every folder eaglet writes has its checksums.json, so one without it, or a file it does not
list, is refused like a damaged file (an older eaglet's outputs are refused before they are read,
by their format version: eaglet/formats/version.py). Only a folder eaglet did not write, a draft
from elsewhere (`eval.draft`, `train.init_from`), is read without one: `CheckedFolder(own=False)`.
(The pipeline knows which folders must have one: each manifest lists its stage's outputs,
`listed` below, and a missing or resized file makes the stage out of date; see
eaglet/pipeline.py.)

The store's shards (sidecars) and the training checkpoints (their own checksums.json) are
checked by their own modules, formats/store.py and formats/checkpoints.py.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from ..errors import CorruptDataError
from ..utils import atomic_write_bytes, sha256_file

CHECKSUMS = "checksums.json"
FORMAT = "eaglet-checksums-v1"
T = TypeVar("T")


def digest(data: bytes | memoryview) -> dict[str, Any]:
    """{"sha256", "bytes"} of data about to be written."""
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(memoryview(data).cast("B"))}


def write_file(path: str | Path, data: bytes | memoryview, fsync: bool = True) -> dict[str, Any]:
    """Write `data` to `path` atomically; returns its {"sha256", "bytes"}, hashed from `data`."""
    atomic_write_bytes(path, data, fsync=fsync)
    return digest(data)


def write_sums(folder: str | Path, sums: Mapping[str, dict[str, Any]], fsync: bool = True) -> dict[str, Any]:
    """Write `folder`/checksums.json listing `sums` (file name -> {"sha256", "bytes"}); returns
    checksums.json's own {"sha256", "bytes"}."""
    data = json.dumps({"format": FORMAT, "files": {n: dict(sums[n]) for n in sorted(sums)}}, indent=1).encode()
    return write_file(Path(folder) / CHECKSUMS, data, fsync=fsync)


def read_sums(folder: str | Path, fix: str) -> dict[str, dict[str, Any]] | None:
    """The entries of `folder`/checksums.json (file name -> {"sha256", "bytes"}), or None where
    there is none; CorruptDataError naming it (with `fix`) when it cannot be read."""
    path = Path(folder) / CHECKSUMS
    if not path.is_file():
        return None
    try:
        sums = json.loads(path.read_bytes())["files"]
        return {str(n): {"sha256": str(w["sha256"]), "bytes": int(w["bytes"])} for n, w in sums.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CorruptDataError(f"damaged file {path} (not readable: {type(e).__name__})", fix=fix) from e


def update_sums(folder: str | Path, add: Mapping[str, dict[str, Any]] | None = None, drop: Iterable[str] = (),
                fix: str = "", fsync: bool = True) -> dict[str, dict[str, Any]]:
    """`folder`/checksums.json with the entries of `add` set and those named in `drop` removed,
    every other entry kept (read, merged, written again atomically; a folder without one gets
    one); returns the entries written. For a folder whose files are written at different times
    (the store: store.json as an extraction starts, the target's head, index.json as it ends).
    A checksums.json that cannot be read is CorruptDataError (with `fix`): its other entries are
    never guessed."""
    sums = read_sums(folder, fix) or {}
    gone = set(drop)
    sums = {n: w for n, w in sums.items() if n not in gone}
    sums.update({n: dict(w) for n, w in (add or {}).items()})
    write_sums(folder, sums, fsync)
    return sums


def write_files(folder: str | Path, files: Mapping[str, bytes | memoryview], fsync: bool = True
                ) -> dict[str, dict[str, Any]]:
    """Write each of `files` (name -> bytes) into `folder`, in order, then its checksums.json
    listing them; returns the sums."""
    folder = Path(folder)
    sums = {name: write_file(folder / name, data, fsync) for name, data in files.items()}
    write_sums(folder, sums, fsync)
    return sums


def size_problem(path: Path, want: Mapping[str, Any]) -> str | None:
    """Why `path` is not the file `want` ({"bytes"}) describes, by its size, or None."""
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    return None if size == int(want["bytes"]) else f"{size} bytes, {want['bytes']} written (cut or overwritten)"


def listed(folder: str | Path, subfolders: Iterable[str]) -> dict[str, dict[str, Any]]:
    """What a stage's manifest records of its outputs: each file the checksums.json of each of
    `subfolders` (relative to `folder`; "." is the folder itself) lists, with its sha256 and
    size, and checksums.json itself. Reads only the small checksums.json files. Raises
    RuntimeError (a writer's bug) when one is missing."""
    folder = Path(folder)
    out: dict[str, dict[str, Any]] = {}
    for sub in subfolders:
        path = folder / sub / CHECKSUMS
        try:
            data = path.read_bytes()
            files = json.loads(data)["files"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise RuntimeError(f"{path}: the stage finished without a readable {CHECKSUMS} ({e})") from e
        prefix = "" if sub in ("", ".") else f"{sub}/"
        out.update({prefix + name: dict(want) for name, want in files.items()})
        out[prefix + CHECKSUMS] = digest(data)
    return out


def outputs_problem(folder: str | Path, outputs: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The first of a manifest's `outputs` (`listed`) that is missing or not its size in
    `folder`, as "<relative path>: <why>", or None. Sizes only: no file is read."""
    for rel, want in outputs.items():
        problem = size_problem(Path(folder) / rel, want)
        if problem is not None:
            return f"{rel}: {problem}"
    return None


class CheckedFolder:
    """A folder of files one format wrote, read through its checksums.json.

    `fix` is how to rebuild the folder's files (appended to every error: "rebuild it with
    `eaglet vocab CONFIG --force`"). `own`: eaglet wrote the folder, so a checksums.json missing
    is CorruptDataError naming it; a folder eaglet may not have written (own=False: a draft from
    elsewhere) is read unverified without one, and `verified` is False."""

    def __init__(self, folder: str | Path, fix: str, own: bool = True):
        self.folder, self.fix, self.own = Path(folder), fix, own
        self.sums: dict[str, dict[str, Any]] | None = read_sums(self.folder, fix)

    @property
    def verified(self) -> bool:
        return self.sums is not None

    def lists(self, name: str) -> bool:
        """Whether checksums.json lists file `name` (written here, whether or not it is there now)."""
        return self.sums is not None and name in self.sums

    def error(self, name: str, why: str) -> CorruptDataError:
        """The one-line error for file `name` of this folder."""
        path = self.folder / name
        return CorruptDataError(f"missing file {path}" if why == "missing" else f"damaged file {path} ({why})",
                                fix=self.fix)

    def check(self, name: str) -> Path:
        """The path of file `name` after its size and sha256 matched checksums.json (streamed:
        a large file is not held in memory); raises CorruptDataError naming it otherwise (or
        checksums.json, missing from a folder eaglet wrote)."""
        path = self.folder / name
        if self.sums is None:
            if self.own:
                raise self.error(CHECKSUMS, "missing")
            if not path.is_file():
                raise self.error(name, "missing")
            return path
        want = self.sums.get(name)
        if want is None:
            raise self.error(name, f"not listed in its {CHECKSUMS}: written by another run")
        problem = size_problem(path, want)
        if problem is not None:
            raise self.error(name, problem)
        if sha256_file(path) != want["sha256"]:
            raise self.error(name, f"sha256 differs from its {CHECKSUMS}: changed since it was written")
        return path

    def read(self, name: str, parse: Callable[[Path], T]) -> T:
        """`parse(path)` of file `name` once it is checked; a file `parse` cannot read (a damaged
        safetensors header or JSON in a draft from elsewhere) is CorruptDataError too."""
        path = self.check(name)
        try:
            return parse(path)
        except Exception as e:  # noqa: BLE001 - every library error of a damaged file ends here
            raise self.error(name, f"not readable: {type(e).__name__}: {_short(e)}") from e

    def json(self, name: str) -> Any:
        return self.read(name, lambda p: json.loads(p.read_text()))


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:160]


def first_nonfinite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first floating tensor of `tensors` holding a NaN or an inf, or None."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None
