"""What training reads, in which order: the held-out split, packing, the epoch plan, and the
loading of one micro-batch from a `StateSource` (eaglet/engines/base.py): extract's store, or an
online store's states from the engine that wrote it (`open_states` asks the engine registry).

Every rank computes the same plan from the seed; the trainer (eaglet/training/loop.py) hands
its micro-batches to the ranks. `VocabMaskCache` keeps the out-of-vocabulary mask's verdict
of every sample after its first teacher pass, so later epochs skip the full-vocabulary logits.
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import Config
from ..distributed import all_gather_object, dist_env
from ..draft import draft_type
from ..draft.step import Batch, HostRows, send_rows
from ..engines import store_engine
from ..engines.base import StateSource
from ..engines.states import is_online
from ..formats.store import dequantize_states, open_verified
from ..utils import to_device
from .build import aux_columns, train_seed


def split_ids(sample_ids: np.ndarray, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train ids, eval ids): a fixed share held out, chosen by the seed, sorted."""
    perm = np.random.default_rng([seed, 7]).permutation(np.asarray(sample_ids, dtype=np.int64))
    n_eval = int(round(len(perm) * eval_fraction)) if eval_fraction > 0 else 0
    if eval_fraction > 0 and len(perm) > 1:
        n_eval = min(max(n_eval, 1), len(perm) - 1)
    return np.sort(perm[n_eval:]), np.sort(perm[:n_eval])


def pack(ids: np.ndarray, lengths: dict[int, int], max_tokens: int) -> list[list[int]]:
    """Greedy packing in the given order: consecutive samples share a micro-batch while they fit."""
    batches, cur, used = [], [], 0
    for i in ids.tolist():
        n = min(lengths[i], max_tokens)
        if cur and used + n > max_tokens:
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        batches.append(cur)
    return batches


def epoch_plan(train_ids: np.ndarray, lengths: dict[int, int], max_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    order = np.random.default_rng([seed, epoch]).permutation(train_ids)
    return pack(order, lengths, max_tokens)


class VocabMaskCache:
    """The out-of-vocabulary mask's verdict per sample (per token: is the target's
    full-vocabulary argmax a draft token), kept from the sample's first teacher pass on.

    The target's states, its head and the draft vocabulary do not change during a run, so
    neither does the verdict: a micro-batch whose samples are all known runs the teacher over
    the draft columns only (a quarter of the full-vocabulary product at the 8B dims, a fifth at
    Kimi-K2.5's; about 4% of the step). Verdicts come back from the device without the host
    waiting for it (a copy into pinned memory, taken once its event has passed); several
    ranks share theirs at the logging steps (`share`, a collective), so a sample that another
    rank saw is known here too. Held as bits: 125 MB of host memory per billion tokens. Not
    kept in checkpoints (a resumed run finds the verdicts again)."""

    def __init__(self, enabled: bool):
        self.enabled, self.sharing = enabled, dist_env().active
        self.known: dict[int, tuple[int, np.ndarray]] = {}  # sample id -> (tokens, bits)
        self.fresh: dict[int, tuple[int, np.ndarray]] = {}  # found here since the last share (several ranks)
        self.pending: list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor, torch.cuda.Event | None]] = []

    def lookup(self, b: Batch) -> torch.Tensor | None:
        """b's verdict [1, N] on b's device, if every sample of it is known."""
        self.poll()
        if not self.enabled or not b.sample_ids or any(i not in self.known for i in b.sample_ids):
            return None
        parts = []
        for i, n in zip(b.sample_ids, b.lens, strict=True):
            count, bits = self.known[i]
            if count != n:  # cut differently (another max_tokens): find it again
                return None
            parts.append(np.unpackbits(bits, count=n))
        return to_device(torch.from_numpy(np.concatenate(parts).astype(np.bool_)).unsqueeze(0), b.input_ids.device)

    def record(self, b: Batch, in_vocab: torch.Tensor | None) -> None:
        """Keep the verdict the teacher found for b (a device tensor [1, N]), once it is on the host."""
        if not self.enabled or in_vocab is None or b.in_vocab is not None or not b.sample_ids:
            return
        cuda = in_vocab.device.type == "cuda"
        host = torch.empty(in_vocab.shape[1], dtype=torch.bool, pin_memory=cuda)
        host.copy_(in_vocab[0], non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        self.pending.append((b.sample_ids, b.lens, host, event))

    def poll(self) -> None:
        """Take in the verdicts whose copies have finished (never waits)."""
        waiting = []
        for ids, lens, host, event in self.pending:
            if event is not None and not event.query():
                waiting.append((ids, lens, host, event))
                continue
            flags, at = host.numpy(), 0
            for i, n in zip(ids, lens, strict=True):
                self.known[i] = (n, np.packbits(flags[at:at + n]))
                if self.sharing:
                    self.fresh[i] = self.known[i]
                at += n
        self.pending = waiting

    def share(self) -> None:
        """Every rank's new verdicts to every rank (all ranks call it together)."""
        if not self.enabled or not self.sharing:
            return
        self.poll()
        for got in all_gather_object(self.fresh):
            self.known.update(got)
        self.fresh = {}


def open_states(cfg: Config, upstream: dict[str, Path], train_dir: Path, rank: int = 0, planned: bool = True
                ) -> StateSource:
    """What training reads: extract's store, every shard checked first (`open_verified`, a
    collective under torchrun), or, when extract ran online, states computed as training goes
    by the engine that wrote the store (its `state_source`: the HF engine's target beside the
    draft, the vLLM engine's stream). `planned`: the reader hands over the micro-batches it will
    load, in order, before the first (`start`, as the Trainer does); a reader in an order of its
    own gets states computed on demand (an engine that needs the plan refuses it)."""
    store = open_verified(upstream["extract"])
    if not is_online(store):
        return store
    if "prepare" not in upstream:
        raise ValueError(f"online states need the prepare stage's folder ({upstream['extract']} is an online store)")
    return store_engine(store.meta).state_source(cfg, store, upstream["prepare"], train_dir, rank, planned)


def batch_seed(seed: int, ids: list[int] | tuple[int, ...]) -> int:
    """The seed of a micro-batch's host preparation (DraftType.host_rows): a hash of the run's
    train seed and the micro-batch's sample ids, so the same micro-batch gets the same rows
    whether the run was resumed or not, on any rank."""
    text = f"{seed}:{','.join(str(int(i)) for i in ids)}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & (2**63 - 1)


@dataclass
class HostBatch:
    """One micro-batch before it goes to the device (`send_batch`): its tensors on the host, in
    pinned memory when bound for a GPU (read from an offline store), or on the device (states
    computed online); `rows` the draft type's host preparation (`DraftType.host_rows`), packed."""

    ids: tuple[int, ...]
    lens: tuple[int, ...]
    tensors: dict[str, torch.Tensor]
    rows: HostRows | None


def read_batch(store: StateSource, ids: list[int], max_tokens: int, pin: bool, cfg: Config | None = None,
               kind: Any = None) -> HostBatch:
    """The samples `ids` packed into one micro-batch, each cut to max_tokens, up to the copy to the
    device: the store's reads and the host's copies (into pinned memory when `pin`). With `cfg`,
    as train.algorithm's type (or `kind`, a DraftType) reads it: the captured states it takes
    (`aux_columns`, chosen on the host) and its `host_rows` (Batch.rows); without, every state
    and no rows."""
    if kind is not None and cfg is None:
        raise ValueError("read_batch: a draft type reads the batch as the config says; pass cfg with kind")
    kind = kind if kind is not None or cfg is None else draft_type(cfg.train.algorithm)
    columns = None if kind is None else aux_columns(store, kind, cfg)

    def cat(pieces: list[torch.Tensor]) -> torch.Tensor:
        """[1, N]: host pieces concatenated straight into pinned memory when bound for a GPU
        (one host copy, then `to_device`); device pieces (online states) on their device."""
        if pieces[0].device.type != "cpu":
            return torch.cat(pieces).unsqueeze(0) if len(pieces) > 1 else pieces[0][None]
        shape = (sum(int(x.shape[0]) for x in pieces), *pieces[0].shape[1:])
        return torch.cat(pieces, out=torch.empty(shape, dtype=pieces[0].dtype, pin_memory=pin))[None]

    def chosen(key: str, piece: torch.Tensor) -> torch.Tensor:
        """The type's columns of a state (or of its fp8 scales): [T, n_aux * H] or [T, n_aux]."""
        if columns is None or key not in ("aux", "aux_scale"):
            return piece
        index = torch.tensor(columns, device=piece.device)
        raw = piece.view(torch.uint8) if piece.element_size() == 1 else piece  # fp8: moved as bytes
        return raw.unflatten(-1, (len(store.layers), -1)).index_select(1, index).flatten(1).view(piece.dtype)

    # a store's samples one part each (an fp8 one's states as stored, dequantized on the device);
    # one forward of the target, or one entry of a stream: one part, packed
    lens, parts = store.read_parts(list(ids), max_tokens)
    keys = ("aux", "final", "input_ids", "loss_mask") + (("aux_scale", "final_scale") if "aux_scale" in parts[0] else ())
    tensors = {k: cat([chosen(k, p[k]) for p in parts]) for k in keys}
    tensors["docs"] = cat([torch.full((n,), d) for d, n in enumerate(lens)])
    tensors["positions"] = cat([torch.arange(n) for n in lens])
    rows = None
    if kind is not None:  # from the mask on the host: online states keep one (their device mask may only lose rows)
        mask, docs = tensors["loss_mask"], tensors["docs"]
        host_mask = mask if mask.device.type == "cpu" else cat([p["loss_mask_host"] for p in parts])
        rows = HostRows.pack(kind.host_rows(host_mask.bool(), docs, cfg, batch_seed(train_seed(cfg), ids)))
    return HostBatch(tuple(int(i) for i in ids), tuple(lens), tensors, rows)


def send_batch(h: HostBatch, device: torch.device) -> Batch:
    """`read_batch`'s micro-batch on `device`: over the bus in the stored dtypes (bf16 states: half
    the bytes of fp32; fp8 a quarter, dequantized there), converted on the device (the same values)."""

    def sent(key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = to_device(h.tensors[key], device)
        return t.to(dtype) if dtype is not None else t

    rows = send_rows(h.rows, device)
    if "aux_scale" in h.tensors:
        aux = dequantize_states(sent("aux"), sent("aux_scale"), torch.float32)
        final = dequantize_states(sent("final"), sent("final_scale"), torch.bfloat16)
    else:
        aux, final = sent("aux", torch.float32), sent("final")
    return Batch(aux, final, sent("input_ids", torch.int64), sent("loss_mask", torch.bool), sent("positions"),
                 sent("docs"), sum(h.lens), sample_ids=h.ids, lens=h.lens, rows=rows)


def load_batch(store: StateSource, ids: list[int], max_tokens: int, device: torch.device, cfg: Config | None = None,
               kind: Any = None) -> Batch:
    """The samples `ids` packed into one micro-batch on `device`, each cut to max_tokens; with
    `cfg` (and `kind`), as `read_batch` reads them for that draft type."""
    return send_batch(read_batch(store, ids, max_tokens, device.type == "cuda", cfg, kind), device)


class Prefetch:
    """Reads an offline store's micro-batches ahead, on one thread, in the order training will
    load them (`Trainer.planned_loads`), while the device works on the current one.

    At the widest targets a micro-batch is hundreds of MB of states (235 MB for 4,096 tokens of a
    DeepSeek-V3-width store), whose reads and host copy took as long as the GPU's step: done
    between steps, they leave the GPU idle that long. `take(ids)` returns the read of `ids`, the
    next one planned; a load off the plan is read at once (the thread's reads wait). An error of
    a read (a corrupt shard) is raised by the `take` of its micro-batch. `depth` micro-batches
    are held ahead, in pinned memory on a GPU."""

    def __init__(self, read: Callable[[list[int]], HostBatch], plan: Iterable[list[int]], depth: int,
                 device: torch.device | None = None):
        self._read, self.depth = read, depth
        self._plan: Iterator[list[int]] = iter(plan)  # taken as needed: a long run's plan is never held whole
        self._ahead: deque[tuple[list[int], Future[HostBatch]]] = deque()
        self._lock = threading.Lock()  # one reader of the store at a time
        # The thread's pinned memory from this rank's GPU: its index (torch.device("cuda") has none,
        # and set_device refuses that), read here, where it is current.
        gpu = None if device is None or device.type != "cuda" else \
            device.index if device.index is not None else torch.cuda.current_device()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eaglet-prefetch",
                                        initializer=torch.cuda.set_device if gpu is not None else None,
                                        initargs=(gpu,) if gpu is not None else ())
        self.off_plan = 0
        self._fill()

    def _locked_read(self, ids: list[int]) -> HostBatch:
        with self._lock:
            return self._read(ids)

    def _fill(self) -> None:
        while len(self._ahead) < self.depth:
            ids = next(self._plan, None)
            if ids is None:
                return
            ids = list(ids)
            self._ahead.append((ids, self._pool.submit(self._locked_read, ids)))

    def take(self, ids: list[int]) -> HostBatch:
        if self._ahead and self._ahead[0][0] == list(ids):
            _, fut = self._ahead.popleft()
            self._fill()
            return fut.result()
        self.off_plan += 1
        return self._locked_read(list(ids))

    def close(self) -> None:
        for _, fut in self._ahead:
            fut.cancel()
        self._ahead.clear()
        self._plan = iter(())
        self._pool.shutdown(wait=True)
