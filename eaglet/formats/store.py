"""The hidden-state store: what `extract` writes and training reads (the one module of its format).

A store folder holds

    store.json                      format, format_version, input hash, hidden size, layer ids,
                                    dtype: what the shards mean (`store_meta`; a store made for
                                    other inputs or in another format version is cleared, never
                                    one whose store.json is lost)
    shard-r{rank}-{k:06d}.safetensors
        aux        [N, n_aux*H]  store dtype  states entering the `layers`, concatenated low..high
        final      [N, H]        store dtype  the teacher state: after the final norm (what the LM head
                                    sees; store.json final_state "post_norm", the HF backend)
                                    or before it ("pre_norm", the vLLM backend: training applies it)
        input_ids  [N]           int32
        loss_mask  [N]           uint8
        aux_scale  [N, n_aux]    float32      (float8_e4m3fn stores only) each token's scale per state:
        final_scale [N, 1]       float32      state = fp8 value x scale (`quantize_states`)
        offsets    [S+1]         int64        sample s is rows offsets[s]:offsets[s+1]
        sample_id  [S]           int64        prepared-data sample ids
    shard-r{rank}-{k:06d}.json      sidecar: file, sha256, samples, tokens, sample_ids, lengths, bytes
    index.json                      written last, when extraction completed: all shards, totals
                                    and the samples dropped (with reasons)
    head.safetensors                the target's embed_tokens [V, H] (as its first decoder layer
                                    receives it: times the family's embed_scale), lm_head [V, H]
                                    and final norm [H] (as a plain RMSNorm scale): the draft's
                                    frozen embedding and the teacher (`write_target_head`)
    target_config.json              the target's text config (the draft's sizes)
    checksums.json                  sha256 and size of store.json, head.safetensors,
                                    target_config.json and index.json (eaglet/formats/checked.py),
                                    each added as its file is written (`update_sums`) and checked
                                    where it is read

Both extraction backends write through `StoreWriter` and `write_target_head`; training and
online states read through `StoreReader` and `read_target_head`.

Crash safety: a shard is written to a temporary file, fsynced and renamed; only then is its
sidecar written (atomically). A shard counts as done only when its sidecar exists, so a
process killed at any instant leaves done shards plus debris (tmp files, a shard without a
sidecar) that the next `StoreWriter` deletes; their samples are extracted again.

store.json is read by extraction alone, index.json by every reader (verified against
checksums.json). Format version (eaglet/formats/version.py): store.json, and so index.json's
meta, record STORE_VERSION. A reader refuses a store of another version, or of none, in one line
naming its folder and `eaglet extract CONFIG --force` (FormatVersionError); an extraction finds
another version's store.json different from the one it writes, like a store made for other
inputs, and clears the store (its shards cannot be resumed as this format's). A
store.json lost or damaged (missing, unparsable, or not the sha256 checksums.json recorded) never
clears the shards: where index.json, or the sha256 recorded for store.json, says they were made
for these same inputs, they are kept and store.json written again; where nothing says what they
hold (an extraction cut short, checksums.json lost too), extraction stops (CorruptDataError)
and keeps them (`prepare_folder`).

Checked before use: training checks every shard (size, sha256, header) before its first step
(`open_verified`), spread over threads and torchrun ranks, so a flipped byte is named before
any step, with the command that repairs it; the reader then does not hash a shard again. An
extraction that finds a store (a rerun after a kill, or `--force` on a finished one) checks
its finished shards the same way and deletes the bad ones (`resume_folder`); their samples,
and those of shards index.json listed that are gone, are extracted again.

Writing overlaps the forward: `StoreWriter.add` buffers samples and hands each full shard to
background writer threads through a bounded queue (the forward loop waits when it is full).
A shard is streamed from the samples' own tensors into the file and its checksum, in the
layout safetensors.torch.save writes, without first being concatenated in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import struct
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save
from tqdm import tqdm

from ..distributed import all_gather_object, barrier, dist_env, run_on_main
from ..errors import CorruptDataError
from .version import KEY as VERSION_KEY, STORE_VERSION, check_version, recorded_version
from ..utils import DTYPES, atomic_write_bytes, atomic_write_json, atomic_writer, log, sha256_file
from .checked import CHECKSUMS, CheckedFolder, digest, read_sums, size_problem, update_sums, write_file, write_sums

FORMAT = "eaglet-store-v1"
STORE_META = "store.json"
INDEX = "index.json"
_SHARD_RE = re.compile(r"^shard-r(\d+)-(\d{6})\.safetensors$")
_STATE_KEYS = ("aux", "final")
HEAD_FILE = "head.safetensors"
TARGET_CONFIG = "target_config.json"
POST_NORM, PRE_NORM = "post_norm", "pre_norm"  # store.json final_state: the teacher state after / before the final norm


REPAIR = "repair it with `eaglet extract CONFIG --force`"
AFRESH = "extract it afresh with `eaglet extract CONFIG --force`"
PROGRESS_BYTES = 1 << 30  # a check of at least this much data shows a progress bar


class CorruptShardError(CorruptDataError):
    """A shard does not match its sidecar (checksum, size or contents). The message names the file."""


def verify_threads() -> int:
    """Threads that check shards in one process: min(8, this rank's share of the host's CPUs).
    Hashing and reads release the GIL, so threads overlap; past a few the disk is the limit."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cpus // max(1, dist_env().local_world_size)))


def shard_stem(rank: int, k: int) -> str:
    return f"shard-r{rank}-{k:06d}"


def _is_store_file(name: str) -> bool:
    """Files the store owns (and may delete); anything else in the folder is left alone."""
    if name in (STORE_META, INDEX) or name.startswith("shard-r"):
        return True
    # atomic_write_bytes temporaries: ".<name>.<random>.tmp"
    return name.endswith(".tmp") and (name.startswith(".shard-r") or name.startswith(f".{INDEX}.")
                                      or name.startswith(f".{STORE_META}."))


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3",
              torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8"}

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value


def quantize_states(x: torch.Tensor, n_states: int) -> tuple[torch.Tensor, torch.Tensor]:
    """States [..., n_states*H] as float8_e4m3fn with one float32 scale per token and state
    ([..., n_states]): each token's state is divided by its largest magnitude / 448, so every
    state uses e4m3's whole range (3 mantissa bits: a relative error under 1/16 per value).
    Runs where `x` is (on the GPU in extraction)."""
    lead = x.shape[:-1]
    v = x.float().reshape(*lead, n_states, -1)
    scale = v.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX
    q = (v / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(*lead, -1), scale


def capture_dtype(store_dtype: torch.dtype) -> torch.dtype:
    """The dtype a store's states are taken in: its own, or bfloat16 for fp8 (then quantized)."""
    return torch.bfloat16 if store_dtype == FP8 else store_dtype


def dequantize_states(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`quantize_states` undone: [..., n_states*H] in `dtype`, where `q` is."""
    lead, n = scale.shape[:-1], scale.shape[-1]
    v = q.reshape(*lead, n, -1).to(torch.float32) * scale.to(q.device, torch.float32)[..., None]
    return v.reshape(*lead, -1).to(dtype)


def write_safetensors(path: str | Path, tensors: dict[str, tuple[list[torch.Tensor], list[int]]],
                      metadata: dict[str, str], fsync: bool = True, digest: bool = True) -> tuple[str | None, int]:
    """Write a safetensors file atomically from tensors given in row pieces; returns (sha256, bytes),
    the sha256 None when `digest` is off (a file read back once and deleted: the stream buffer).

    `tensors[name] = (pieces, shape)`: the pieces (CPU, one dtype) concatenated along dim 0
    make a tensor of `shape`. They are streamed to the file and the hash without being
    concatenated in memory first (a shard is extract.shard_mb, 256 MiB by default). The layout is the one
    safetensors.torch.save writes: 8-byte header length, JSON header padded with spaces to
    a multiple of 8, then the data ordered by dtype size (largest first) and name.
    """
    path = Path(path)
    order = sorted(tensors, key=lambda n: (-tensors[n][0][0].element_size(), n))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in order:
        pieces, shape = tensors[name]
        dtype = pieces[0].dtype
        if any(p.dtype != dtype for p in pieces) or sum(p.numel() for p in pieces) != int(np.prod(shape)):
            raise ValueError(f"{path.name}: pieces of tensor {name!r} do not make one {dtype} tensor of shape {shape}")
        nbytes = sum(p.numel() for p in pieces) * pieces[0].element_size()
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    sha = hashlib.sha256() if digest else None
    with atomic_writer(path, fsync) as f:
        for block in (struct.pack("<Q", len(head)), head):
            if sha is not None:
                sha.update(block)
            f.write(block)
        for name in order:
            for piece in tensors[name][0]:
                block = memoryview(piece.contiguous().reshape(-1).view(torch.uint8).numpy())
                if sha is not None:
                    sha.update(block)  # hashlib and file writes release the GIL for large blocks
                f.write(block)
        size = f.tell()
    return (sha.hexdigest() if sha is not None else None), size


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None


def described(meta: dict[str, Any]) -> dict[str, Any]:
    """store.json's content for `meta` (`store_meta`): the format's name and version first."""
    return {"format": FORMAT, VERSION_KEY: STORE_VERSION, **meta}


def _meta_bytes(meta: dict[str, Any]) -> bytes:
    """store.json as written: the same meta gives the same bytes (and sha256)."""
    return json.dumps(meta, indent=1, default=str).encode()


def _read_listed(folder: Path, name: str, sums: dict[str, dict[str, Any]]) -> tuple[Any, str | None]:
    """(the JSON of file `name`, None), or (None, why it cannot be used: "missing", or what is
    damaged), checked against `sums` (checksums.json's entries) where they list it."""
    path = folder / name
    want = sums.get(name)
    problem = size_problem(path, want) if want is not None else (None if path.is_file() else "missing")
    if problem is not None:
        return None, problem
    try:
        data = path.read_bytes()
        if want is not None and digest(data)["sha256"] != want["sha256"]:
            return None, f"sha256 differs from its {CHECKSUMS}: changed since it was written"
        return json.loads(data), None
    except (OSError, ValueError, RecursionError) as e:
        return None, f"not readable: {type(e).__name__}"


# ---- what the states are: store.json, head.safetensors, target_config.json ---------------------------

def store_meta(input_hash: str, hidden_size: int, layers: list[int], dtype: str, final_state: str,
               num_target_layers: int, target_class: str, norm_eps: float, mode: str, **more: Any) -> dict[str, Any]:
    """store.json's description of the states (the writer adds the format, `described`): the extract stage's
    input hash, the target's hidden size, the captured layer ids (n_aux of them), the store
    dtype's config name, final_state (POST_NORM or PRE_NORM), the target's decoder layers and
    class, its final norm's epsilon and extract.mode. `more`: a backend's own keys (the HF
    backend: family, embed_scale, logit_scale, logit_softcap, how the teacher's logits come
    from the final state; the vLLM backend: backend, vllm_layer_ids)."""
    if final_state not in (POST_NORM, PRE_NORM):
        raise ValueError(f"store final_state {final_state!r}: expected {POST_NORM!r} or {PRE_NORM!r}")
    return {"input_hash": input_hash, "hidden_size": int(hidden_size), "n_aux": len(layers), "layers": list(layers),
            "dtype": dtype, "final_state": final_state, "num_target_layers": int(num_target_layers),
            "target_class": target_class, "norm_eps": float(norm_eps), "mode": mode, **more}


def write_target_head(folder: str | Path, embed_tokens: torch.Tensor, lm_head: torch.Tensor, norm: torch.Tensor,
                      text_config: dict[str, Any]) -> None:
    """head.safetensors and target_config.json. embed_tokens [V, H]: the embedding as the target's
    first decoder layer receives it (embed_scale applied); lm_head [V, H]; norm [H]: the final
    norm as a plain RMSNorm scale (Gemma's 1 + w). Tensors may share storage (a tied target)."""
    folder = Path(folder)
    # clone(): a target with tied embeddings has one tensor for embed_tokens and lm_head.
    tensors = {"embed_tokens": embed_tokens, "lm_head": lm_head, "norm": norm}
    sums = {HEAD_FILE: write_file(folder / HEAD_FILE, save({k: v.detach().to("cpu").clone().contiguous()
                                                            for k, v in tensors.items()})),
            TARGET_CONFIG: write_file(folder / TARGET_CONFIG, json.dumps(text_config, indent=1, default=str).encode())}
    update_sums(folder, sums, fix=REPAIR)  # beside store.json's entry (and index.json's, once written)


def read_target_config(folder: str | Path) -> dict[str, Any]:
    """The target's text config as extract saved it (target_config.json), checked against the
    folder's checksums.json."""
    return CheckedFolder(folder, REPAIR).json(TARGET_CONFIG)


@dataclass
class TargetHead:
    """The target's tensors that training uses (`read_target_head`). The trainer hands them on
    and drops them: `embed` is copied into the draft, `lm_head` and `norm` go to the teacher."""

    lm_head: torch.Tensor | None  # [V, H]
    norm: torch.Tensor | None  # final norm weight when the stored final state is pre-norm
    norm_eps: float
    embed: torch.Tensor | None  # [V, H], as the target's first layer receives it (embed_scale applied)
    logit_scale: float = 1.0  # the target's logits: softcap(lm_head(final) * logit_scale)
    logit_softcap: float | None = None


def read_target_head(folder: str | Path, meta: dict[str, Any], device: torch.device) -> TargetHead:
    """The target's head from a store `folder` described by `meta` (store.json); with the final
    norm when the stored final state is before it (PRE_NORM, the vLLM backend), so that the
    teacher's logits are the target's own either way. lm_head and norm go to `device`."""
    checked = CheckedFolder(folder, REPAIR)  # size and sha256 first: a flipped bit is named, not trained on
    t = checked.read(HEAD_FILE, lambda p: load_file(str(p)))
    if not {"embed_tokens", "lm_head", "norm"} <= set(t):
        raise checked.error(HEAD_FILE, f"its tensors {sorted(t)} lack embed_tokens, lm_head or norm")
    final_state = meta.get("final_state", POST_NORM)
    if final_state not in (POST_NORM, PRE_NORM):
        raise ValueError(f"{folder}: store final_state {final_state!r} is neither {POST_NORM!r} nor {PRE_NORM!r}")
    return TargetHead(
        lm_head=t["lm_head"].to(device),
        norm=t["norm"].to(device) if final_state == PRE_NORM else None,
        norm_eps=float(meta.get("norm_eps", 1e-6)),
        embed=t["embed_tokens"],
        logit_scale=float(meta.get("logit_scale") or 1.0),
        logit_softcap=meta.get("logit_softcap"),
    )


# ---- writer ---------------------------------------------------------------------------------------

@dataclass
class _Piece:
    sample_id: int
    aux: torch.Tensor  # [T, n_aux*H]
    final: torch.Tensor  # [T, H]
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # uint8 [T]
    aux_scale: torch.Tensor | None = None  # float32 [T, n_aux] (fp8 stores)
    final_scale: torch.Tensor | None = None  # float32 [T, 1]


@dataclass
class StoreCheck:
    """What an extraction found in its store folder (`prepare_folder`, `resume_folder`)."""

    removed: int = 0  # unfinished files deleted (what a killed run leaves)
    intact: int = 0  # finished shards that passed the check
    bad: list[dict[str, Any]] = field(default_factory=list)  # {file, error, samples}: deleted
    missing: list[dict[str, Any]] = field(default_factory=list)  # {file, samples}: finished once, now gone

    @property
    def redo_samples(self) -> int:
        """Samples of bad and missing shards: no longer stored, so extracted again."""
        return sum(int(b["samples"]) for b in self.bad + self.missing)

    def summary(self) -> str | None:
        """One line for the log, or None for a folder without finished shards."""
        total = self.intact + len(self.bad) + len(self.missing)
        if not total:
            return None
        line = f"store verified: {self.intact} of {total} shards intact"
        if self.bad or self.missing:
            what = " and ".join(f"{n} {kind}" for n, kind in ((len(self.bad), "bad"), (len(self.missing), "missing"))
                                if n)
            line += (f"; re-extracting the {self.redo_samples} samples of {what} "
                     f"shard{'s' if len(self.bad) + len(self.missing) > 1 else ''}")
        return line

    def stats(self) -> dict[str, Any]:
        """What the extract stage's manifest records of it."""
        return {"verified_shards": self.intact + len(self.bad), "bad_shards": [b["file"] for b in self.bad],
                "missing_shards": [m["file"] for m in self.missing], "repaired_samples": self.redo_samples}

    def report(self) -> None:
        """Its lines in the log (rank 0 prints them)."""
        if self.removed:
            log(f"[extract] removed {self.removed} unfinished files of an interrupted run")
        if self.summary():
            log(f"[extract] {self.summary()}")


def prepare_folder(folder: str | Path, meta: dict[str, Any], fsync: bool = True) -> StoreCheck:
    """Make `folder` ready for writers of `meta`; returns the unfinished files removed and the
    shards that were finished once (listed in index.json, or a sidecar left without its
    shard) and are gone: their samples are no longer stored.

    A store made for other inputs or in another format version (store.json differs) is
    deleted; the index is removed (it
    is valid again only when this extraction completes) and dropped from checksums.json;
    debris of any rank (temporary files, a shard without its sidecar, a sidecar without its
    shard) is removed. Under torchrun rank 0 runs this alone, before any rank opens a writer.
    Shards' checksums are not read here (`resume_folder` checks them).

    A store.json missing or damaged (unparsable, or not what checksums.json recorded) never
    clears the shards: where index.json describes these inputs, or the sha256 checksums.json
    recorded for store.json is that of today's, they are kept and store.json is written again;
    where index.json describes other inputs, the store is cleared as for an intact store.json
    that differs; where nothing says what the shards hold, CorruptDataError names store.json
    and the shard files kept.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    meta = described(meta)

    def same(m: Any) -> bool:  # made for these inputs, in this format
        return m == meta

    try:
        sums, damaged_sums = read_sums(folder, REPAIR) or {}, False
    except CorruptDataError:  # written again below; the head's entries when extraction writes the head
        sums, damaged_sums = {}, True
        log(f"[extract] {folder / CHECKSUMS} is damaged: writing it again (the store's files are listed as they "
            "are written)")
    old, old_why = _read_listed(folder, STORE_META, sums)
    if old_why is None and not isinstance(old, dict):
        old, old_why = None, "not readable: not a store description"
    index, _ = _read_listed(folder, INDEX, sums)
    index_meta = index.get("meta") if isinstance(index, dict) else None
    files = [p for p in folder.iterdir() if _is_store_file(p.name)]
    shards = [p for p in files if _SHARD_RE.match(p.name)]
    listed: dict[str, int] = {}  # shards known to have been finished -> their samples
    if same(index_meta):
        listed = {str(sh["file"]): int(sh["samples"]) for sh in index.get("shards", []) if isinstance(sh, dict)}

    def differs(m: dict[str, Any]) -> str:
        if m.get("input_hash") != meta.get("input_hash"):
            return f"input hash {str(m.get('input_hash'))[:12]} -> {str(meta.get('input_hash'))[:12]}"
        return "changed " + ", ".join(k for k in sorted(set(m) | set(meta)) if m.get(k) != meta.get(k))

    lost = "missing" if old_why == "missing" else f"damaged ({old_why})"
    clear = None  # why the files go
    if old_why is not None and any(p.name != STORE_META for p in files):
        recorded = sums.get(STORE_META, {}).get("sha256")
        if same(index_meta) or recorded == digest(_meta_bytes(meta))["sha256"]:
            if shards:
                basis = INDEX if same(index_meta) else f"the sha256 its {CHECKSUMS} recorded for it"
                log(f"[extract] {STORE_META} of the store in {folder} is {lost}, but {basis} describes these same "
                    f"inputs: keeping its {len(shards)} shard files and writing {STORE_META} again")
        elif isinstance(index_meta, dict):  # index.json says what the shards hold: another extraction's
            clear = f"{STORE_META} {lost}; its {INDEX}: {differs(index_meta)}"
        elif shards:  # an extraction cut short: nothing left says what the shards hold
            raise CorruptDataError(
                f"{STORE_META} of the store in {folder} is {lost} and no {INDEX} says what its {len(shards)} shard "
                f"files hold (an extraction cut short, or {INDEX} lost too); they are kept, unread",
                fix=f"restore {folder / STORE_META} (it describes the inputs the shards were extracted from), or "
                    f"delete {folder} to extract afresh")
        else:  # debris only: nothing is lost
            clear = f"no readable {STORE_META}"
    elif old_why is None and old != meta:
        clear = differs(old)
    if clear is not None and files:
        listed = {}
        log(f"[extract] store in {folder} was made for other inputs ({clear}); clearing {len(files)} files")
        for p in files:
            p.unlink(missing_ok=True)
    # checksums.json never lists index.json while it is gone, nor an old store.json while the new one is written
    rewrite = old != meta or STORE_META not in sums
    keep = {n: w for n, w in sums.items() if n != INDEX and not (rewrite and n == STORE_META)}
    if keep != sums or damaged_sums:
        write_sums(folder, keep, fsync)
    (folder / INDEX).unlink(missing_ok=True)
    if rewrite:
        keep[STORE_META] = write_file(folder / STORE_META, _meta_bytes(meta), fsync)
        write_sums(folder, keep, fsync)

    removed = 0
    for p in sorted(folder.iterdir()):
        if p.name.endswith(".tmp") and _is_store_file(p.name):
            p.unlink(missing_ok=True)
            removed += 1
    for p in sorted(folder.glob("shard-r*.safetensors")):
        if _SHARD_RE.match(p.name) and _valid_sidecar(p) is None:
            p.unlink()
            p.with_suffix(".json").unlink(missing_ok=True)
            removed += 1
    for side in sorted(folder.glob("shard-r*.json")):
        if not side.with_suffix(".safetensors").is_file():
            record = _read_json(side)  # written only after its shard: that shard was finished, then lost
            if isinstance(record, dict) and isinstance(record.get("samples"), int):
                listed.setdefault(side.with_suffix(".safetensors").name, record["samples"])
            side.unlink()
            removed += 1
    finished = {p.name for p in folder.glob("shard-r*.safetensors") if p.with_suffix(".json").is_file()}
    missing = [{"file": f, "samples": n} for f, n in sorted(listed.items()) if f not in finished]
    return StoreCheck(removed=removed, missing=missing)


def shard_problem(folder: str | Path, side: dict[str, Any], n_aux: int, hidden: int, checksum: bool = True
                  ) -> str | None:
    """Why the shard that sidecar `side` describes cannot be used, in a few words, or None when
    it matches its sidecar: the file exists, has its size, its sha256 (`checksum`), and its
    header, sample ids and offsets are the sidecar's."""
    path = Path(folder) / side["file"]
    if not path.is_file():
        return "shard file missing"
    size = path.stat().st_size
    if size != side["bytes"]:
        return f"{size} bytes, sidecar says {side['bytes']} (truncated or overwritten)"
    if checksum and sha256_file(path) != side["sha256"]:
        return "sha256 mismatch"
    try:
        with safe_open(str(path), framework="pt") as f:
            sid = f.get_tensor("sample_id")
            off = f.get_tensor("offsets")
            aux_shape, final_shape = f.get_slice("aux").get_shape(), f.get_slice("final").get_shape()
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a bad file
        return f"not a readable safetensors file ({e})"
    tokens = side["tokens"]
    offsets = np.concatenate([[0], np.cumsum(np.asarray(side["lengths"], dtype=np.int64))]).tolist()
    if (sid.tolist() != side["sample_ids"] or off.tolist() != offsets
            or aux_shape != [tokens, n_aux * hidden] or final_shape != [tokens, hidden]):
        return "contents do not match its sidecar"
    return None


def check_shards(folder: str | Path, sides: list[dict[str, Any]], n_aux: int, hidden: int,
                 threads: int | None = None, part: tuple[int, int] = (0, 1)) -> list[dict[str, Any]]:
    """Check shards `sides[part[0]::part[1]]` (sidecars) with `shard_problem` on `threads`
    threads (default `verify_threads()`); returns the bad ones as {file, error, samples}, in
    the order of `sides`. A bar shows progress when the share is PROGRESS_BYTES or more."""
    my_share = list(sides[part[0]::part[1]])
    total = sum(int(s["bytes"]) for s in my_share)
    errors: dict[str, str] = {}
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="verify store", dynamic_ncols=True,
               disable=total < PROGRESS_BYTES or not dist_env().is_main)
    with ThreadPoolExecutor(max_workers=max(1, threads or verify_threads()), thread_name_prefix="eaglet-verify") as pool:
        futures = {pool.submit(shard_problem, folder, s, n_aux, hidden): s for s in my_share}
        for fut in as_completed(futures):
            side = futures[fut]
            problem = fut.result()
            if problem is not None:
                errors[side["file"]] = problem
            bar.update(int(side["bytes"]))
    bar.close()
    return [{"file": s["file"], "error": errors[s["file"]], "samples": int(s["samples"])} for s in my_share
            if s["file"] in errors]


def check_shards_all_ranks(folder: str | Path, sides: list[dict[str, Any]], n_aux: int, hidden: int,
                           threads: int | None = None) -> list[dict[str, Any]]:
    """`check_shards` over every rank (a collective under torchrun: rank r checks shards
    r, r+W, ...); every rank gets all the bad shards."""
    env = dist_env()
    bad = all_gather_object(check_shards(folder, sides, n_aux, hidden, threads, (env.rank, env.world_size)))
    order = {s["file"]: k for k, s in enumerate(sides)}
    return sorted((b for part in bad for b in part), key=lambda b: order[b["file"]])


def _delete_shards(folder: Path, bad: list[dict[str, Any]], missing: list[dict[str, Any]]) -> None:
    for b in bad:
        (folder / b["file"]).unlink(missing_ok=True)
        (folder / b["file"]).with_suffix(".json").unlink(missing_ok=True)
        log(f"[extract] {b['file']}: {b['error']}; deleted, its {b['samples']} samples are extracted again")
    for m in missing:
        log(f"[extract] {m['file']}: finished once, now missing; its {m['samples']} samples are extracted again")


def resume_folder(folder: str | Path, meta: dict[str, Any], fsync: bool = True,
                  threads: int | None = None) -> StoreCheck:
    """Make `folder` ready for an extraction of `meta` that keeps what is intact: `prepare_folder`
    (on rank 0), then every finished shard checked (`check_shards_all_ranks`)
    and the bad ones deleted, shard and sidecar, so that their samples count as not done. A
    collective under torchrun: every rank calls it, before any rank opens a writer; all get the
    same result."""
    folder = Path(folder)
    found = run_on_main(prepare_folder, folder, meta, fsync)
    sides = list(finished_shards(folder).values())
    bad = check_shards_all_ranks(folder, sides, int(meta["n_aux"]), int(meta["hidden_size"]), threads)
    run_on_main(_delete_shards, folder, bad, found.missing)
    barrier()  # the bad shards are gone before any rank reads what is done
    check = StoreCheck(removed=found.removed, intact=len(sides) - len(bad), bad=bad, missing=found.missing)
    check.report()
    return check


def _valid_sidecar(shard: Path) -> dict[str, Any] | None:
    """The sidecar of a finished shard, or None when the shard is unfinished."""
    side = _read_json(shard.with_suffix(".json"))
    if not isinstance(side, dict) or side.get("file") != shard.name or side.get("bytes") != shard.stat().st_size:
        return None
    return side


def finished_shards(folder: str | Path) -> dict[str, dict[str, Any]]:
    """file name -> sidecar of every finished shard in `folder`, of all ranks, sorted by name.
    Raises CorruptShardError when a sample id is in two shards."""
    records: dict[str, dict[str, Any]] = {}
    seen: set[int] = set()
    for p in sorted(Path(folder).glob("shard-r*.safetensors")):
        side = _valid_sidecar(p) if _SHARD_RE.match(p.name) else None
        if side is None:
            continue
        ids = [int(i) for i in side["sample_ids"]]
        dup = seen.intersection(ids)
        if dup:
            raise CorruptShardError(f"{p.name}: sample ids {sorted(dup)[:5]} are also in another shard of {folder}")
        seen.update(ids)
        records[p.name] = side
    return records


def write_index(folder: str | Path, meta: dict[str, Any], records: dict[str, dict[str, Any]],
                dropped: list[dict[str, Any]], fsync: bool = True) -> dict[str, Any]:
    """Write index.json over the shards in `records` (file -> sidecar) and the samples dropped
    (`StoreWriter.drop`), and add it to the folder's checksums.json; returns the index. The last file of an
    extraction: its presence means complete."""
    shards = [{k: records[f][k] for k in ("file", "sha256", "samples", "tokens", "bytes")} for f in sorted(records)]
    index = {
        "format": FORMAT,
        "meta": described(meta),
        "shards": shards,
        "num_shards": len(shards),
        "num_samples": sum(s["samples"] for s in shards),
        "num_tokens": sum(s["tokens"] for s in shards),
        "bytes": sum(s["bytes"] for s in shards),
        "dropped_counts": dict(Counter(s["reason"] for s in dropped)),
        "dropped": sorted(dropped, key=lambda s: s["sample_id"]),
    }
    sums = write_file(Path(folder) / INDEX, json.dumps(index, indent=1).encode(), fsync=fsync)
    update_sums(folder, {INDEX: sums}, fix=REPAIR, fsync=fsync)
    return index


class StoreWriter:
    """Appends samples to a store folder; resumes a store left by an interrupted run.

    `meta` describes the states (input_hash, hidden_size, n_aux, layers, dtype, final_state);
    if the folder's store.json differs, the old store is deleted first.

    Data-parallel extraction: one writer per rank, each writing shards named with its
    `rank`. Rank 0 calls `prepare_folder` alone, then every rank opens a writer with
    `prepare=False`, which only reads the finished shards (of all ranks: a sample stored by
    any rank in an earlier run, of any world size, counts as done). Each rank then calls
    `close(index=False)` and rank 0 writes the one index with `write_index`.
    """

    def __init__(self, folder: str | Path, meta: dict[str, Any], shard_bytes: int,
                 queue_size: int = 2, fsync: bool = True, rank: int = 0, threads: int = 4, prepare: bool = True):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.meta = described(meta)
        self.dtype = DTYPES[self.meta["dtype"]]
        self.hidden = int(self.meta["hidden_size"])
        self.n_aux = int(self.meta["n_aux"])
        self.aux_width = self.n_aux * self.hidden
        self.shard_bytes = max(1, int(shard_bytes))
        self.fsync = fsync
        self.rank = rank
        removed = 0
        if prepare:
            removed = prepare_folder(self.folder, meta, fsync).removed
        elif _read_json(self.folder / STORE_META) != self.meta:
            raise RuntimeError(f"{self.folder / STORE_META} does not describe rank {rank}'s states: ranks disagree "
                               "on the inputs, or prepare_folder did not run first")
        self._records: dict[str, dict[str, Any]] = finished_shards(self.folder)  # file -> sidecar of done shards
        self._done: set[int] = {int(i) for side in self._records.values() for i in side["sample_ids"]}
        if self._records or removed:
            log(f"[extract] resuming store {self.folder}: {len(self._records)} shards / {len(self._done)} samples done, "
                f"{removed} unfinished files removed")
        self.resumed_shards = len(self._records)
        self._next_k = 1 + max((int(_SHARD_RE.match(f).group(2)) for f in self._records
                                if int(_SHARD_RE.match(f).group(1)) == rank), default=-1)
        self._buf: list[_Piece] = []
        self._buf_bytes = 0
        self.dropped_samples: list[dict[str, Any]] = []
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._closed = False
        # Writer threads (hashing and file writes release the GIL, so several overlap). Daemons:
        # a process that dies mid-write leaves only debris that the next open removes.
        self._threads = [threading.Thread(target=self._work, name=f"eaglet-store-writer-{t}", daemon=True)
                         for t in range(max(1, threads))]
        for t in self._threads:
            t.start()

    def done_ids(self) -> set[int]:
        """Sample ids already stored in finished shards (skip them on resume)."""
        return set(self._done)

    # ---- adding ------------------------------------------------------------------------------
    def add(self, sample_id: int, aux: torch.Tensor, final: torch.Tensor,
            input_ids: torch.Tensor | np.ndarray, loss_mask: torch.Tensor | np.ndarray,
            aux_scale: torch.Tensor | None = None, final_scale: torch.Tensor | None = None) -> None:
        """Buffer one sample (CPU tensors: aux [T, n_aux*H], final [T, H] in the store dtype).
        An fp8 store takes them quantized with their scales (`quantize_states`, done on the GPU
        by extraction), or in a wider dtype, and then quantizes them here."""
        self._raise_if_failed()
        if self._closed:
            raise RuntimeError("StoreWriter is closed")
        sample_id = int(sample_id)
        if sample_id in self._done:
            raise ValueError(f"sample {sample_id} is already in the store")
        ids = torch.as_tensor(input_ids).to(torch.int32).reshape(-1)
        mask = torch.as_tensor(loss_mask).to(torch.uint8).reshape(-1)
        n = ids.shape[0]
        if tuple(aux.shape) != (n, self.aux_width) or tuple(final.shape) != (n, self.hidden) or mask.shape[0] != n:
            raise ValueError(
                f"sample {sample_id}: shapes aux {tuple(aux.shape)}, final {tuple(final.shape)}, ids {n}, "
                f"mask {mask.shape[0]} do not match T={n}, n_aux*H={self.aux_width}, H={self.hidden}"
            )
        if self.dtype == FP8 and aux.dtype != FP8 and final.dtype != FP8:
            (aux, aux_scale), (final, final_scale) = quantize_states(aux, self.n_aux), quantize_states(final, 1)
        if aux.dtype != self.dtype or final.dtype != self.dtype:
            raise ValueError(f"sample {sample_id}: states are {aux.dtype}/{final.dtype}, the store holds {self.dtype}")
        if self.dtype == FP8 and (aux_scale is None or final_scale is None or tuple(aux_scale.shape) != (n, self.n_aux)
                                  or tuple(final_scale.shape) != (n, 1)):
            raise ValueError(f"sample {sample_id}: fp8 states need their scales, aux_scale [{n}, {self.n_aux}] and "
                             f"final_scale [{n}, 1]")
        if aux.device.type != "cpu" or final.device.type != "cpu":
            raise ValueError(f"sample {sample_id}: states must be on the CPU")
        if self.dtype == FP8:
            aux_scale, final_scale = aux_scale.to(torch.float32).contiguous(), final_scale.to(torch.float32).contiguous()
        self._done.add(sample_id)
        self._buf.append(_Piece(sample_id, aux, final, ids, mask, aux_scale, final_scale))
        self._buf_bytes += aux.nbytes + final.nbytes + 5 * n + (4 * n * (self.n_aux + 1) if self.dtype == FP8 else 0)
        if self._buf_bytes >= self.shard_bytes:
            self._flush()

    def drop(self, sample_id: int, reason: str) -> None:
        """Record a sample that is not stored: its states were empty or not finite, or its engine
        failed on it (listed with the reason in index.json; retried by a resumed run)."""
        self.dropped_samples.append({"sample_id": int(sample_id), "reason": reason})

    def _flush(self) -> None:
        if not self._buf:
            return
        item = (self._next_k, self._buf)
        self._next_k += 1
        self._buf, self._buf_bytes = [], 0
        while True:  # wait for room, but notice a writer thread that has failed
            self._raise_if_failed()
            try:
                self._queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"store writer thread failed: {self._error!r}") from self._error

    # ---- background thread ----------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is not None:
                continue  # keep draining so the producer never blocks on a dead consumer
            try:
                record = self._write_shard(*item)
                with self._lock:
                    self._records[record["file"]] = record
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                self._error = e

    def _write_shard(self, k: int, pieces: list[_Piece]) -> dict[str, Any]:
        lengths = [p.input_ids.shape[0] for p in pieces]
        tokens = int(sum(lengths))
        parts = {  # name -> (pieces, shape); written straight from the pieces, never concatenated
            "aux": ([p.aux for p in pieces], [tokens, self.aux_width]),
            "final": ([p.final for p in pieces], [tokens, self.hidden]),
            "input_ids": ([p.input_ids for p in pieces], [tokens]),
            "loss_mask": ([p.loss_mask for p in pieces], [tokens]),
            "offsets": ([torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)], [len(pieces) + 1]),
            "sample_id": ([torch.tensor([p.sample_id for p in pieces], dtype=torch.int64)], [len(pieces)]),
        }
        if self.dtype == FP8:
            parts["aux_scale"] = ([p.aux_scale for p in pieces], [tokens, self.n_aux])
            parts["final_scale"] = ([p.final_scale for p in pieces], [tokens, 1])
        stem = shard_stem(self.rank, k)
        name = f"{stem}.safetensors"
        digest, size = write_safetensors(self.folder / name, parts, {"format": FORMAT}, fsync=self.fsync)
        record = {
            "file": name,
            "sha256": digest,
            "samples": len(pieces),
            "tokens": tokens,
            "bytes": size,
            "sample_ids": [p.sample_id for p in pieces],
            "lengths": [int(n) for n in lengths],
        }
        atomic_write_json(self.folder / f"{stem}.json", record, fsync=self.fsync)
        return record

    # ---- finishing --------------------------------------------------------------------------------
    def close(self, index: bool = True) -> dict[str, Any]:
        """Write the last shard and wait for the writers; then write index.json (`index`) over
        this writer's shards. Returns the index, or (index=False) this writer's shard records."""
        self._raise_if_failed()
        self._flush()
        self._stop()
        self._raise_if_failed()
        with self._lock:
            records = dict(self._records)
        if not index:
            return records
        return write_index(self.folder, self.meta, records, self.dropped_samples, self.fsync)

    def abort(self) -> None:
        """Stop after the shards already queued (they are complete and count on resume);
        the partly filled buffer is dropped and no index is written."""
        self._buf, self._buf_bytes = [], 0
        self._stop()
        if self._error is not None:
            log(f"[extract] store writer had failed: {self._error!r}")

    def _stop(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:  # one stop signal per thread, each after the shards queued before it
            while any(t.is_alive() for t in self._threads):
                try:
                    self._queue.put(None, timeout=0.2)
                    break
                except queue.Full:
                    continue
        for t in self._threads:
            t.join()


# ---- reader ---------------------------------------------------------------------------------------

class StoreReader:
    """Random access to a finished store by sample id; shards are memory-mapped.

    Each shard's size and sha256 are checked against its sidecar the first time it is opened
    (`verify=False` skips the checksum), unless `verify_all` or `verify` checked it already:
    training opens the store with `open_verified`, which checks every shard up front.
    """

    def __init__(self, folder: str | Path, verify: bool = True):
        self.folder = Path(folder)
        checked = CheckedFolder(self.folder, REPAIR)
        if not (self.folder / INDEX).is_file() and not checked.lists(INDEX):  # an extraction not finished
            raise FileNotFoundError(f"no finished store in {self.folder} (missing {INDEX}); run `eaglet extract`")
        try:
            index = checked.json(INDEX)  # size and sha256 first
        except CorruptDataError:  # another eaglet's index is refused as such, not as damaged
            check_version(recorded_version(self.folder / INDEX, "meta"), STORE_VERSION, "the store", self.folder,
                          fix=AFRESH)
            raise
        try:
            self.meta: dict[str, Any] = dict(index["meta"])
            # the version before anything else of it is read (FormatVersionError is none of those caught)
            check_version(self.meta.get(VERSION_KEY), STORE_VERSION, "the store", self.folder, fix=AFRESH)
            self.layers: list[int] = [int(i) for i in self.meta["layers"]]
            self.hidden_size = int(self.meta["hidden_size"])
            self.dtype = DTYPES[self.meta["dtype"]]
            entries = [(str(sh["file"]), str(sh["sha256"]), int(sh["samples"])) for sh in index["shards"]]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise checked.error(INDEX, f"not a store index: {type(e).__name__}: {e}") from e
        self.index = index
        self.hash_on_open = verify
        self.shards: list[dict[str, Any]] = []
        ids, shard_of, row, lengths = [], [], [], []
        for k, (file, sha, samples) in enumerate(entries):
            side = _read_json(self.folder / file.replace(".safetensors", ".json"))
            if not isinstance(side, dict) or side.get("sha256") != sha:
                raise CorruptShardError(f"store {self.folder}: {file}: sidecar missing or not matching {INDEX}",
                                        fix=f"{REPAIR} (re-extracts its {samples} samples)")
            self.shards.append(side)
            n = len(side["sample_ids"])
            ids.append(np.asarray(side["sample_ids"], dtype=np.int64))
            lengths.append(np.asarray(side["lengths"], dtype=np.int64))
            shard_of.append(np.full(n, k, dtype=np.int32))
            row.append(np.arange(n, dtype=np.int64))
        cat = (lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dt))
        all_ids, all_len = cat(ids, np.int64), cat(lengths, np.int64)
        order = np.argsort(all_ids, kind="stable")
        self.sample_ids = all_ids[order]  # ascending
        self.lengths = all_len[order]  # aligned with sample_ids
        self._shard_of = cat(shard_of, np.int32)[order]
        self._row = cat(row, np.int64)[order]
        if len(self.sample_ids) > 1 and (np.diff(self.sample_ids) == 0).any():
            dup = self.sample_ids[1:][np.diff(self.sample_ids) == 0]
            raise CorruptShardError(f"store {self.folder}: sample ids stored twice: {dup[:5].tolist()}",
                                    fix="extract it again with `eaglet extract CONFIG` after deleting the folder")
        self._offsets = [np.concatenate([[0], np.cumsum(np.asarray(s["lengths"], dtype=np.int64))]) for s in self.shards]
        self._handles: dict[int, Any] = {}
        self._verified: set[int] = set()  # shards whose checksum a verify_all or verify checked

    def __len__(self) -> int:
        return int(self.sample_ids.shape[0])

    @property
    def n_aux(self) -> int:
        return len(self.layers)

    def target_head(self, device: torch.device) -> TargetHead:
        """The target's head this store's states were taken with (`read_target_head`)."""
        return read_target_head(self.folder, self.meta, device)

    def __contains__(self, sample_id: int) -> bool:
        i = int(np.searchsorted(self.sample_ids, sample_id))
        return i < len(self) and int(self.sample_ids[i]) == int(sample_id)

    @property
    def scaled(self) -> bool:
        """Whether the states are fp8 with per-token scales (`quantize_states`)."""
        return self.dtype == FP8

    # ---- what training reads: engines/base.py StateSource ---------------------------------------
    computes_ahead = False  # read on demand: nothing is computed ahead of the trainer
    prefetchable = True  # reads are host I/O: a thread of the trainer may read ahead (training/data.py Prefetch)
    stats_key: str | None = None  # nothing for the train manifest

    def start(self, loads: list[list[int]], max_tokens: int) -> None:
        """Nothing to start: every sample is on disk."""

    def read_parts(self, sample_ids: list[int], max_tokens: int) -> tuple[list[int], list[dict[str, torch.Tensor]]]:
        """Each sample's length cut to max_tokens, and its tensors (one dict per sample, views of
        the memory-mapped shards); an fp8 store's states as stored, fp8 with their scales, which
        training dequantizes on its device."""
        parts = [{k: v[:max_tokens] for k, v in self.get(i, raw=self.scaled).items()} for i in sample_ids]
        return [int(p["input_ids"].shape[0]) for p in parts], parts

    def progress(self) -> dict[str, float]:
        return {}

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        """Nothing to stop (the shards' memory maps close with the reader)."""

    def get(self, sample_id: int, raw: bool = False) -> dict[str, torch.Tensor]:
        """aux [T, n_aux*H], final [T, H] (store dtype), input_ids int32 [T], loss_mask uint8 [T].
        An fp8 store's states come dequantized to bfloat16, or with `raw` as stored, fp8 with
        aux_scale [T, n_aux] and final_scale [T, 1] (training dequantizes them on its device)."""
        i = int(np.searchsorted(self.sample_ids, sample_id))
        if i >= len(self) or int(self.sample_ids[i]) != int(sample_id):
            raise KeyError(f"sample {sample_id} is not in the store {self.folder}")
        k, j = int(self._shard_of[i]), int(self._row[i])
        handle = self._open(k)
        a, b = int(self._offsets[k][j]), int(self._offsets[k][j + 1])
        names = ("aux", "final", "input_ids", "loss_mask") + (("aux_scale", "final_scale") if self.scaled else ())
        out = {name: handle.get_slice(name)[a:b] for name in names}
        if self.scaled and not raw:
            out["aux"] = dequantize_states(out["aux"], out.pop("aux_scale"), torch.bfloat16)
            out["final"] = dequantize_states(out["final"], out.pop("final_scale"), torch.bfloat16)
        return out

    def _open(self, k: int) -> Any:
        if k not in self._handles:
            self._check(k, checksum=self.hash_on_open and k not in self._verified)
            self._handles[k] = safe_open(str(self.folder / self.shards[k]["file"]), framework="pt")
        return self._handles[k]

    def _check(self, k: int, checksum: bool = True) -> None:
        """Raise CorruptShardError unless shard k matches its sidecar."""
        problem = shard_problem(self.folder, self.shards[k], self.n_aux, self.hidden_size, checksum)
        if problem is not None:
            raise CorruptShardError(f"store {self.folder}: {self.shards[k]['file']}: {problem}",
                                    fix=f"{REPAIR} (re-extracts its {self.shards[k]['samples']} samples)")

    def verify_all(self, part: tuple[int, int] = (0, 1), threads: int | None = None) -> dict[str, Any]:
        """Check every shard (size, sha256, header) on `threads` threads; returns {shards, ok,
        bad: [{file, error, samples}], samples, tokens}. `part` (i, n): only shards i, i+n, ...
        (n ranks share the work). The shards that pass are not hashed again when opened."""
        bad = check_shards(self.folder, self.shards, self.n_aux, self.hidden_size, threads, part)
        failed = {b["file"] for b in bad}
        ks = range(part[0], len(self.shards), part[1])
        self._verified.update(k for k in ks if self.shards[k]["file"] not in failed)
        return {
            "shards": len(ks),
            "ok": len(ks) - len(bad),
            "bad": bad,
            "samples": len(self),
            "tokens": int(self.lengths.sum()),
        }

    def verify(self, threads: int | None = None) -> StoreReader:
        """Check every shard before the store is used, or raise one CorruptShardError naming the
        bad shards and the command that repairs them. A collective under torchrun: the ranks
        share the shards (`check_shards_all_ranks`), each on `threads` threads."""
        t0 = time.perf_counter()
        size = sum(int(s["bytes"]) for s in self.shards)
        env = dist_env()
        bad = check_shards_all_ranks(self.folder, self.shards, self.n_aux, self.hidden_size, threads)
        if bad:
            shown = ", ".join(f"{b['file']}: {b['error']}" for b in bad[:3])
            if len(bad) > 3:
                shown += f", and {len(bad) - 3} more"
            samples = sum(b["samples"] for b in bad)
            raise CorruptShardError(f"store {self.folder}: {len(bad)} of {len(self.shards)} shards corrupt ({shown})",
                                    fix=f"{REPAIR} (re-extracts {'its' if len(bad) == 1 else 'their'} {samples} "
                                        "samples)")
        self._verified = set(range(len(self.shards)))
        log(f"[store] {self.folder}: {len(self.shards)} shards ({size / 2**30:.2f} GiB) verified in "
            f"{time.perf_counter() - t0:.1f} s ({threads or verify_threads()} threads"
            + (f" on each of {env.world_size} ranks)" if env.active else ")"))
        return self


def open_verified(folder: str | Path, threads: int | None = None) -> StoreReader:
    """A finished store with every shard checked before it is used (`StoreReader.verify`): a
    10-TB store is read once, by many threads (and ranks), and not hashed again on first read.
    A collective under torchrun."""
    return StoreReader(folder).verify(threads)
