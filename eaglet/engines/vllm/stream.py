"""Engine-fed training: the serving engine computes each micro-batch's states ahead of the
trainer into a bounded buffer, and nothing else of them is ever on disk.

    extract: {mode: online, backend: vllm}     # in-process vLLM, or extract.vllm_server
             stream_buffer_gb: 8               # the buffer's bound, connector files included
             stream_dir: /dev/shm/eaglet       # where it lives (default <run.dir>/train/stream)

A 1T-parameter target neither fits beside the draft nor has a store within reach (57 KB a
token: 57 TB for 500k conversations of 2k tokens over 2-3 epochs), so its states come from
the engine that serves it, every epoch anew. `StreamedStates` is a `StateSource`
(eaglet/engines/base.py), what training reads. The trainer hands it, before its first step, the list of
micro-batches this rank will load, in order (`Trainer.planned_loads`: the epoch plans from
the resume position, and the held-out batches at each evaluation); a producer thread sends
their samples to the engine (each cut to train.max_tokens: a causal model's prefix states do
not depend on what follows) and waits while the bytes on disk (entries and the connector
files of the requests in flight) would pass the bound. The engine's client (vLLM's, or the
HTTP requests to a server) runs in a child process unless extract.stream_client_process is
false. Converter processes turn the connector's files into one buffer entry per micro-batch
(eaglet/formats/buffer.py; quantized when extract.store_dtype is fp8). `get_packed` takes the
next entry (read ahead while the step before trains), checks that it holds the samples asked
for, and deletes it. So a stream run sees the same samples in the same order as an offline
run of the same config, and a run killed at any moment resumes from its checkpoint exactly:
what a killed run left in the buffer is deleted and asked for again.

The self-check runs on this rank's first samples before the first step, with vLLM's prompt
logprobs, as it does for a store (eaglet/engines/vllm/extract.py). A sample the engine fails on
(other token ids, states that are not finite or never written) keeps its place with its loss
mask cleared and is counted (`dropped`). When the engine falls behind, the trainer logs
the time it waited and the engine's tokens/s against training's (`progress`).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from ...config import Config
from .capture import EngineProcess, LocalEngine, ServerEngine, engine_args
from ...errors import ConfigError, InputError
from ...formats.buffer import clear_entries, connector_itemsize, micro_batch_bytes, read_entry, write_entry
from ...formats.store import FP8, StoreReader, capture_dtype, quantize_states
from ...utils import child_context, log, pid_alive
from .extract import PROMPT_LOGPROBS, convert_result, judge_selfcheck
from ..states import PreparedStates

# Processes turning connector files into entries while the engine computes the next round: in
# threads, their many small torch calls contend for the GIL with a host-bound training loop
# (docs/streaming.md).
CONVERTERS = 2
CONVERTER_THREADS = 2  # torch's intra-op threads in each


class StreamStopped(InputError):
    """The engine stopped answering, or failed, before the stream's end."""


@dataclass
class EntryJob:
    """What a converter process needs to write one load's entry: each sample's (id, engine
    result, token ids, loss mask), the connector's layout, and the connector's read and
    discard helpers (module functions: they travel by name)."""
    buffer: Path
    rank: int
    seq: int
    samples: list[tuple[int, Any, np.ndarray, np.ndarray]]
    layer_ids: list[int]
    hidden: int
    n_aux: int
    dtype: torch.dtype
    read: Callable[[str], dict[str, torch.Tensor]]
    discard: Callable[[str], None]


def write_load(job: EntryJob) -> tuple[Path, int, float, list[tuple[int, str]]]:
    """One load's entry from its requests' connector files (which are removed), in a converter
    process: (path, bytes, seconds, [(sample, reason)] of those dropped). A sample the engine
    failed on keeps its place with zero states and its loss mask cleared."""
    t0 = time.perf_counter()
    engine, states = SimpleNamespace(read=job.read, discard=job.discard), capture_dtype(job.dtype)
    auxs, finals, tokens, masks, lens, dropped = [], [], [], [], [], []
    for sid, res, want, mask in job.samples:
        got = convert_result(engine, res, want, job.layer_ids, job.hidden, states)
        m = torch.from_numpy(mask)
        if isinstance(got, str):
            dropped.append((sid, got))
            got = (torch.zeros(len(want), job.n_aux * job.hidden, dtype=states),
                   torch.zeros(len(want), job.hidden, dtype=states))
            m = torch.zeros_like(m)
        auxs.append(got[0])
        finals.append(got[1])
        tokens.append(torch.from_numpy(want.astype(np.int32)))
        masks.append(m)
        lens.append(len(want))
    aux, final = torch.cat(auxs), torch.cat(finals)
    tensors = {"input_ids": torch.cat(tokens), "loss_mask": torch.cat(masks)}
    if job.dtype == FP8:
        (tensors["aux"], tensors["aux_scale"]), (tensors["final"], tensors["final_scale"]) = (
            quantize_states(aux, job.n_aux), quantize_states(final, 1))
    else:
        tensors["aux"], tensors["final"] = aux.to(job.dtype), final.to(job.dtype)
    if _trainer is not None and not pid_alive(_trainer):  # killed mid-job: what its restart reads is its own
        raise SystemExit(0)
    path, size = write_entry(job.buffer, job.rank, job.seq, [sid for sid, *_ in job.samples], lens, tensors)
    return path, size, time.perf_counter() - t0, dropped


_trainer: int | None = None  # in a converter: the trainer's pid (_converter_start)


def _converter_start(trainer: int) -> None:
    global _trainer
    _trainer = trainer
    torch.set_num_threads(CONVERTER_THREADS)
    threading.Thread(target=_exit_with, args=(trainer,), name="eaglet-converter-watch", daemon=True).start()


def _exit_with(pid: int, every: float = 1.0) -> None:
    """End this converter once the trainer `pid` is gone (killed). Nothing else would end it: a
    pool worker holds both ends of its own call queue, so a dead trainer never reads as EOF, and
    the fork server stays up while any of its children holds its alive pipe."""
    while pid_alive(pid):
        time.sleep(every)
    os._exit(0)


class StreamedStates(PreparedStates):
    """A `StateSource` over prepared data, states from the engine through a
    bounded buffer (see the module doc). `base` is extract's online store (its meta, layers,
    dtype, head.safetensors and target_config.json); `engine` (tests): anything with
    run/read/discard/close, else vLLM in process or at extract.vllm_server."""

    computes_ahead = True  # the trainer hands it the plan (`start`) and logs its `progress`
    stats_key = "stream"  # its stats() in the train stage's manifest

    def __init__(self, base: StoreReader, prepared_folder: str | Path, cfg: Config, folder: Path, rank: int = 0,
                 engine: Any = None):
        super().__init__(base, prepared_folder)
        self.cfg, self.ecfg, self.rank, self.engine = cfg, cfg.extract, rank, engine
        self.ids = [int(i) for i in self.meta["vllm_layer_ids"]]
        self.hidden = int(self.meta["hidden_size"])
        self.buffer = Path(folder)
        self.connector = self.buffer / f"connector-r{rank}"  # the in-process engine's files
        self.bound = int(float(self.ecfg.stream_buffer_gb) * 1e9)
        self.loads: list[list[int]] = []
        self.load_sizes: list[int] = []  # the buffer bytes each load holds at most (micro_batch_bytes)
        self.load_tokens: list[int] = []  # tokens of each load, each sample cut at max_tokens
        self.max_tokens = 0
        self.dropped: Counter[str] = Counter()
        self.selfcheck: dict[str, Any] | None = None
        self._cond = threading.Condition()
        self._ready: dict[int, tuple[Path, int]] = {}  # seq -> (entry, bytes)
        self._used = 0  # bytes on disk or reserved for requests in flight
        self._next = 0  # the seq get_packed hands out next
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self.peak_bytes = 0  # the largest _used seen
        self._waited = 0.0  # seconds get_packed waited since the last progress()
        self._engine_tokens, self._engine_s = 0, 0.0
        self._convert_s = 0.0  # converter-seconds spent writing entries
        self._t0 = self._t_last = 0.0  # the producer's start, the last entry written
        self._held_s = 0.0  # seconds the producer waited for room under the bound
        self._written_tokens = 0
        self._reader = ThreadPoolExecutor(1, thread_name_prefix=f"eaglet-stream-r{rank}-read")
        self._pool: ProcessPoolExecutor | None = None  # the converters, from start()
        self._ahead: tuple[int, Future] | None = None  # (seq, its read) begun while the one before trains

    # ---- sizes ------------------------------------------------------------------------------

    def _tokens(self, sid: int) -> int:
        return min(int(self.data.lengths[self._row[int(sid)]]), self.max_tokens)

    # ---- start and stop ---------------------------------------------------------------------

    def start(self, loads: list[list[int]], max_tokens: int) -> None:
        """Begin computing `loads` (this rank's micro-batches, in the order get_packed will be
        called): the bound is checked, what a killed run left is deleted, the engine starts
        and the self-check runs on the first samples before the producer does."""
        self.loads, self.max_tokens = [list(map(int, x)) for x in loads], int(max_tokens)
        if not self.loads:
            return
        self.load_tokens = [sum(self._tokens(i) for i in x) for x in self.loads]
        per_value = connector_itemsize(self.cfg.target.dtype)
        self.load_sizes = [micro_batch_bytes(t, len(x), self.n_aux, self.hidden, self.dtype, per_value)
                           for t, x in zip(self.load_tokens, self.loads)]
        need = max(self.load_sizes)
        k = self.load_sizes.index(need)
        if need > self.bound:
            raise ConfigError(
                f"extract.stream_buffer_gb {self.ecfg.stream_buffer_gb} holds {self.bound / 1e9:.3f} GB, and one "
                f"micro-batch ({self.load_tokens[k]} tokens of {len(self.loads[k])} samples) needs "
                f"{need / 1e9:.3f} GB of it", fix=f"set extract.stream_buffer_gb to at least {2 * need / 1e9:.3g} "
                "(two micro-batches: one computed while the other trains), or lower train.max_tokens")
        self.buffer.mkdir(parents=True, exist_ok=True)
        left = clear_entries(self.buffer, self.rank)
        if left:
            log(f"[stream] rank {self.rank}: deleted {left} entries a stopped run left in {self.buffer}; they are "
                "computed again")
        self._pool = ProcessPoolExecutor(CONVERTERS, child_context(__name__), _converter_start, (os.getpid(),))
        for _ in range(CONVERTERS):  # the converters start (fork) while the engine does
            self._pool.submit(os.getpid)
        if self.engine is None:
            self.engine = self._start_engine()
        self._check_first()
        self._thread = threading.Thread(target=self._produce, name=f"eaglet-stream-r{self.rank}", daemon=True)
        self._thread.start()

    def _start_engine(self) -> Any:
        e = self.ecfg
        if e.vllm_server:
            make = partial(ServerEngine, e.vllm_server, e.vllm_requests, api_key_env=e.vllm_server_api_key_env)
        else:
            longest = max(self._tokens(i) for load in self.loads for i in load)
            self.connector.mkdir(parents=True, exist_ok=True)
            for f in self.connector.iterdir():  # a killed run's connector files
                f.unlink()
            make = partial(LocalEngine, engine_args(self.cfg, self.ids, self.connector, longest))
        return EngineProcess(make, child_context(__name__)) if e.stream_client_process else make()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._reader.shutdown(wait=True)
        if self._thread is not None:
            self._thread.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self.engine is not None:
            self.engine.close()
        if self.loads:
            clear_entries(self.buffer, self.rank)

    # ---- the engine's side ------------------------------------------------------------------

    def _requests(self, ids: list[int]) -> list[tuple[int, np.ndarray]]:
        return [(i, np.asarray(self.data[self._row[i]].input_ids)[:self.max_tokens]) for i in ids]

    def _check_first(self) -> None:
        """The self-check on this rank's first extract.selfcheck_samples samples."""
        n = self.ecfg.selfcheck_samples
        first = list(dict.fromkeys(i for load in self.loads for i in load))[:n]
        if not first:
            return
        requests = self._requests(first)
        results = self.engine.run(requests, PROMPT_LOGPROBS)
        checked, reasons = [], Counter()
        for (sid, want), res in zip(requests, results):
            got = convert_result(self.engine, res, want, self.ids, self.hidden, capture_dtype(self.dtype))
            if isinstance(got, str):
                reasons[got] += 1
            else:
                checked.append((got[1], res.prompt_logprobs))
        if reasons["token_mismatch"] > len(first) // 2:
            where = f"the vLLM server at {self.ecfg.vllm_server}" if self.ecfg.vllm_server else "vLLM"
            raise InputError(f"stream: {where} computed other token ids than prepare produced for "
                             f"{reasons['token_mismatch']} of the first {len(first)} samples: it serves another model "
                             f"or tokenizer than target.path", fix="serve target.path (the doctor prints the command)")
        head = self.target_head(torch.device("cpu"))
        self.selfcheck = judge_selfcheck(checked, sorted(first), {"lm_head": head.lm_head, "norm": head.norm},
                                         head.norm_eps, self.ids, self.ecfg.selfcheck_min_top1)

    def _rounds(self) -> Any:
        """Consecutive loads sent together: up to extract.vllm_requests samples and half the
        bound (the engine fills one half while training reads the other), at least one load."""
        seq = 0
        while seq < len(self.loads):
            end, samples, need = seq, 0, 0
            while end < len(self.loads):
                b, n = self.load_sizes[end], len(self.loads[end])
                if end > seq and (samples + n > self.ecfg.vllm_requests or need + b > self.bound // 2):
                    break
                end, samples, need = end + 1, samples + n, need + b
            yield seq, end
            seq = end

    def _produce(self) -> None:
        """Rounds to the engine, in order; each round's entries are written by CONVERTERS
        processes while the engine computes the next round. A load's bytes stay reserved from
        its round's start until its entry is written, so the bound holds with conversions in
        flight."""
        self._t0 = time.perf_counter()
        try:
            for seq, end in self._rounds():
                reserved = sum(self.load_sizes[seq:end])
                with self._cond:
                    t = time.perf_counter()
                    while self._used + reserved > self.bound and not self._stop and self._error is None:
                        self._cond.wait()
                    self._held_s += time.perf_counter() - t
                    if self._stop or self._error is not None:
                        return
                    self._grow(reserved)
                t0 = time.perf_counter()
                flat = [i for s in range(seq, end) for i in self.loads[s]]
                results = iter(self.engine.run(self._requests(flat), None))
                self._engine_s += time.perf_counter() - t0
                self._engine_tokens += sum(self.load_tokens[seq:end])
                for s in range(seq, end):
                    self._pool.submit(write_load, self._job(s, [next(results) for _ in self.loads[s]])
                                      ).add_done_callback(partial(self._written, s))
        except BaseException as e:  # noqa: BLE001 - handed to the trainer, which raises it
            self._fail(e)

    def _written(self, seq: int, done: Future) -> None:
        """A converter finished load `seq`: its entry is ready (its reservation shrinks to the
        entry's size), or the stream has failed."""
        if done.cancelled():  # close() with conversions queued
            return
        if done.exception() is not None:
            self._fail(done.exception())
            return
        path, size, seconds, dropped = done.result()
        for sid, why in dropped:
            log(f"[stream] sample {sid} ({why}): its loss mask is cleared")
        with self._cond:
            self.dropped.update(why for _, why in dropped)
            self._used -= self.load_sizes[seq] - size
            self._ready[seq] = (path, size)
            self._convert_s += seconds
            self._written_tokens += self.load_tokens[seq]
            self._t_last = time.perf_counter()
            self._cond.notify_all()

    def _fail(self, e: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = e
            self._cond.notify_all()

    def _grow(self, nbytes: int) -> None:
        self._used += nbytes
        self.peak_bytes = max(self.peak_bytes, self._used)

    def _job(self, seq: int, results: list[Any]) -> EntryJob:
        samples = []
        for sid, res in zip(self.loads[seq], results):
            s = self.data[self._row[sid]]
            samples.append((sid, res, np.asarray(s.input_ids)[:self.max_tokens],
                            np.asarray(s.loss_mask)[:self.max_tokens].astype(np.uint8)))
        return EntryJob(self.buffer, self.rank, seq, samples, self.ids, self.hidden, self.n_aux, self.dtype,
                        self.engine.read, self.engine.discard)

    # ---- the trainer's side -----------------------------------------------------------------

    def get_packed(self, sample_ids: list[int], max_tokens: int | None = None
                   ) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The next micro-batch of the stream, which must be `sample_ids`, as its entry holds it:
        aux, final (raw fp8 with their scales for an fp8 stream), input_ids, loss_mask, on the
        host. The entry after it is read ahead (into memory, off the disk) while this one trains."""
        seq = self._next
        if seq >= len(self.loads):
            raise RuntimeError(f"stream: micro-batch {seq} asked for, but the stream holds {len(self.loads)}")
        t0 = time.perf_counter()
        ahead = self._ahead if self._ahead is not None and self._ahead[0] == seq else None
        ids, lens, t = ahead[1].result() if ahead else self._take(seq)
        self._waited += time.perf_counter() - t0
        self._next += 1
        self._ahead = (seq + 1, self._reader.submit(self._take, seq + 1)) if seq + 1 < len(self.loads) else None
        if ids != [int(i) for i in sample_ids]:
            raise RuntimeError(f"stream out of step: micro-batch {seq} holds samples {ids}, training asked for "
                               f"{list(sample_ids)}")
        return lens, t

    def _take(self, seq: int) -> tuple[list[int], list[int], dict[str, torch.Tensor]]:
        """Entry `seq` once it is written: read, deleted, its bytes given back to the bound."""
        with self._cond:
            while seq not in self._ready and self._error is None and not self._stop:
                if not self._cond.wait(timeout=600) and self._thread is not None and not self._thread.is_alive():
                    break
            if seq not in self._ready:
                raise self._stopped()
            path, size = self._ready.pop(seq)
        out = read_entry(path)
        path.unlink()
        with self._cond:
            self._used -= size
            self._cond.notify_all()
        return out

    def _stopped(self) -> BaseException:
        e = self._error
        where = f"the vLLM server at {self.ecfg.vllm_server}" if self.ecfg.vllm_server else "the vLLM engine"
        at = f"micro-batch {self._next} of {len(self.loads)} of rank {self.rank}'s stream"
        if isinstance(e, (ConfigError, InputError)) or (e is not None and not isinstance(e, Exception)):
            return e
        why = f"{type(e).__name__}: {e}" if e is not None else "its producer thread ended"
        return StreamStopped(f"stream: {where} stopped before {at} ({why})",
                             fix="bring the engine back and rerun the same command: training resumes from its newest "
                                 "checkpoint and asks again for what was not consumed")

    def progress(self) -> dict[str, float]:
        """Since the last call: seconds training waited for states; so far: what the engine
        side delivers in tokens/s (engine_rate), the buffer's peak bytes."""
        out = {"stream_wait_s": round(self._waited, 3), "buffer_peak_gb": round(self.peak_bytes / 1e9, 4),
               "engine_tokens_per_s": self.engine_rate() or 0.0}
        self._waited = 0.0
        return out

    def stats(self) -> dict[str, Any]:
        return {"micro_batches": len(self.loads), "consumed": self._next, "dropped": dict(self.dropped),
                "buffer_bound_bytes": self.bound, "buffer_peak_bytes": self.peak_bytes,
                "buffer_folder": str(self.buffer), "selfcheck": self.selfcheck,
                "engine_tokens_per_s": self.engine_rate(), "engine_seconds": round(self._engine_s, 2),
                "vllm_tokens_per_s": round(self._engine_tokens / self._engine_s, 1) if self._engine_s else None,
                "entry_seconds": round(self._convert_s, 2), "held_by_bound_s": round(self._held_s, 2)}

    def engine_rate(self) -> float | None:
        """What the engine side delivers, in tokens/s: tokens in written entries over the
        producer's time, less the time the bound held it back (None before the first entry).
        vLLM's own share is in stats(): engine_seconds against the converters' entry_seconds."""
        busy = self._t_last - self._t0 - self._held_s
        return round(self._written_tokens / busy, 1) if self._written_tokens and busy > 0 else None
