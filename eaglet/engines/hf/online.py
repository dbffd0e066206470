"""Online states: the target runs beside the draft in training instead of a store on disk.

    extract.mode: online       # in the run config

A store costs (n_aux + 1) x hidden x 2 bytes per token: 4.6 KB for a 576-wide target, 32 KB
for an 8B one, 57 KB for a 7168-wide MoE. The 24.6M tokens of ShareGPT's usable
conversations make 113 GB even for SmolLM2-135M. When the target fits on the training GPU
beside the draft and its forward is cheap next to the draft's training step (small and
mid-size targets), recomputing the states every epoch beats storing them.

In online mode the extract stage stores only the self-check's samples (so the same check
guards the captured states) and marks its store `mode: online`; training's `open_states`
(eaglet/training/data.py) then asks this engine for its state source (`state_source` in
eaglet/engines/hf/__init__.py) and gets an `OnlineStates`: a `StateSource`
(eaglet/engines/base.py; sample ids, lengths, meta, `get`, `get_many`; and `get_packed`, one
micro-batch packed, which training reads through `read_parts`) whose
states come from the same capture code extract uses, one padded forward per packed micro-batch,
on the target's device. Offline and online runs
of the same config see the same samples in the same order; their states agree to the
rounding of a differently composed batch.

On a GPU the target runs ahead of training in a process of its own (`AheadStates`,
extract.online_ahead): the trainer hands it the micro-batches it will load, in order
(`Trainer.planned_loads`), and the process computes them, at most online_ahead ahead, while
the draft trains. The states cross to the trainer as CUDA tensors shared between the two
processes (no copy). At a small target's width both the draft's step and the target's forward
are bound by the host's Python; in one process they run one after the other, in two at once.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...config import Config, TargetSection
from ...distributed import resolve_device
from ...errors import InputError
from .capture import capture, nonfinite_rows, pad_batch
from ...formats.store import FP8, StoreReader, capture_dtype, dequantize_states, quantize_states
from ...targets.load import TargetParts, load_target
from ...utils import child_context, pid_alive, to_device
from ..states import PreparedStates


class OnlineStates(PreparedStates):
    """A `StateSource` over prepared data, states computed by the target on demand, in the
    trainer's process (nothing ahead, nothing a thread could prefetch)."""

    stats_key = "online"  # its stats() in the train stage's manifest

    def __init__(self, base: StoreReader, prepared_folder: str | Path, target: TargetSection):
        super().__init__(base, prepared_folder)
        self.model, self.info = load_target(target)
        self.model.eval()
        self.parts = TargetParts.of(self.model)
        if self.parts.num_layers != int(self.meta["num_target_layers"]):
            raise ValueError(
                f"online states: target.path has {self.parts.num_layers} decoder layers but extract ran on "
                f"{self.meta['num_target_layers']} ({self.folder}); rerun extract for this target"
            )
        self._nonfinite: torch.Tensor | int = 0  # a device count: read only when asked (no sync per batch)

    @property
    def nonfinite(self) -> int:
        """Samples whose states were not finite (their loss mask was cleared)."""
        return int(self._nonfinite)

    def stats(self) -> dict[str, Any]:
        """For the train manifest (a device count read here: at the end of training)."""
        return {"nonfinite_samples": self.nonfinite}

    def get_packed(self, sample_ids: list[int], max_tokens: int | None = None
                   ) -> tuple[list[int], dict[str, torch.Tensor]]:
        """One padded forward of the target; packed, on its device: aux [N, n_aux*H], final [N, H]
        (store dtype), input_ids int32 [N], loss_mask uint8 [N]; each sample cut at `max_tokens`
        before the forward (states of a causal model's prefix do not depend on what follows).
        Nothing here waits for the device: a sample with non-finite states gets its loss mask
        cleared on it. loss_mask_host: the prepared loss mask on the host, before any clearing (a
        superset)."""
        samples = []
        for sid in sample_ids:
            if int(sid) not in self._row:
                raise KeyError(f"sample {sid} is not in the prepared data {self.data.folder}")
            samples.append(self.data[self._row[int(sid)]])
        ids = [np.asarray(s.input_ids)[:max_tokens] for s in samples]
        input_ids, attn = pad_batch(ids)
        loss_mask = torch.zeros(input_ids.shape, dtype=torch.uint8)
        for b, s in enumerate(samples):
            loss_mask[b, :len(ids[b])] = torch.from_numpy(np.asarray(s.loss_mask)[:max_tokens])
        host_mask = loss_mask
        device = self.parts.input_device
        input_ids, attn, loss_mask = (to_device(t, device) for t in (input_ids, attn, loss_mask))
        with torch.no_grad():  # not inference_mode: these tensors feed an autograd graph
            aux, final = capture(self.parts, self.layers, input_ids, attn, capture_dtype(self.dtype))
            if self.dtype == FP8:  # what an fp8 store would hold: quantized and back, on the device
                aux = dequantize_states(*quantize_states(aux, len(self.layers)), torch.bfloat16)
                final = dequantize_states(*quantize_states(final, 1), torch.bfloat16)
            bad = nonfinite_rows(aux, final, attn).to(device)
        loss_mask = loss_mask * (~bad)[:, None]
        self._nonfinite = self._nonfinite + bad.sum()
        lens = [len(seq) for seq in ids]

        def rows(t: torch.Tensor) -> torch.Tensor:  # the padded batch's real rows, end to end
            return torch.cat([t[b, :n] for b, n in enumerate(lens)])

        return lens, {"aux": rows(aux), "final": rows(final), "input_ids": rows(input_ids).to(torch.int32),
                      "loss_mask": rows(loss_mask), "loss_mask_host": rows(host_mask)}


WATCH_S = 1.0  # how often the target's process looks whether the trainer is still there


def online_ahead(cfg: Config) -> int:
    """extract.online_ahead resolved: None means 2 on a GPU, 0 on a CPU; 0 under tp_plan, whose
    forward is a collective of the trainer's ranks."""
    e = cfg.extract
    if e.tp_plan is not None:
        return 0
    if e.online_ahead is not None:
        return e.online_ahead
    return 2 if resolve_device(cfg.target.device).type == "cuda" else 0


class TargetStopped(InputError):
    """The target's process failed or ended before training had its states."""


class AheadStates(PreparedStates):
    """`OnlineStates` in a process of its own, computing the planned micro-batches ahead.

    The process starts here and loads the target while the trainer builds and compiles the
    draft. `start(loads, max_tokens)` hands it this rank's micro-batches in the order
    `get_packed` will ask for them; it computes each (the same `OnlineStates.get_packed` as in
    process) and sends it, holding at most `depth` that training has not taken. What is
    sent stays the process's memory, lent to the trainer: the process lives until `close`, and
    ends by itself once the trainer is gone."""

    computes_ahead = True  # the trainer hands it the plan (`start`) and logs its `progress`
    stats_key = "online_ahead"  # its stats() in the train stage's manifest

    def __init__(self, base: StoreReader, prepared_folder: str | Path, target: TargetSection, depth: int,
                 watch_pid: int | None = None):
        super().__init__(base, prepared_folder)
        if depth < 1:
            raise ValueError(f"AheadStates needs depth >= 1, got {depth}")
        self.depth = depth
        ctx = child_context(__name__)
        self._conn, child = ctx.Pipe()
        self._credits = ctx.Semaphore(depth)
        self._stop = ctx.Event()
        self._proc = ctx.Process(
            target=_ahead_main, name="eaglet-target", daemon=True,
            args=(child, self._credits, self._stop, watch_pid or os.getpid(), str(base.folder), str(prepared_folder),
                  target))
        self._proc.start()
        child.close()
        self.loads: list[list[int]] = []
        self._next = 0
        self._nonfinite = 0
        self._waited = self._waited_total = 0.0
        self._target_s = 0.0  # the process's seconds computing the micro-batches taken so far
        self._tokens = 0

    @property
    def nonfinite(self) -> int:
        """Samples whose states were not finite (their loss mask was cleared)."""
        return self._nonfinite

    def start(self, loads: list[list[int]], max_tokens: int) -> None:
        self.loads = [list(map(int, x)) for x in loads]
        try:
            self._conn.send(("plan", self.loads, int(max_tokens)))
        except OSError:  # the process already ended: get_packed says why
            pass

    def _message(self) -> tuple[Any, ...]:
        while True:
            try:
                while not self._conn.poll(WATCH_S):
                    if not self._proc.is_alive() and not self._conn.poll(0):
                        raise EOFError
                msg = self._conn.recv()
            except (EOFError, OSError):
                raise self._stopped(f"it ended (exit code {self._proc.exitcode})") from None
            if msg[0] == "error":
                raise self._stopped(msg[1])
            if msg[0] == "batch":
                return msg

    def _stopped(self, why: str) -> TargetStopped:
        return TargetStopped(
            f"online states: the target's process stopped before micro-batch {self._next} of {len(self.loads)} ({why})",
            fix="see the lines above; extract.online_ahead=0 runs the target in the trainer's process instead")

    def get_packed(self, sample_ids: list[int], max_tokens: int | None = None
                   ) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The next planned micro-batch, which must be `sample_ids` (cut at the plan's
        max_tokens): what `OnlineStates.get_packed` gives, on the target's device."""
        seq = self._next
        if seq >= len(self.loads):
            raise RuntimeError(f"online states: micro-batch {seq} asked for, but {len(self.loads)} were planned"
                               + ("" if self.loads else " (a reader in its own order: open_states(..., planned=False))"))
        t0 = time.perf_counter()
        _, got, ids, lens, tensors, nonfinite, seconds = self._message()
        self._credits.release()  # room for one more ahead
        wait = time.perf_counter() - t0
        self._waited += wait
        self._waited_total += wait
        self._next += 1
        self._nonfinite = nonfinite
        self._target_s += seconds
        self._tokens += sum(lens)
        if got != seq or ids != [int(i) for i in sample_ids]:
            raise RuntimeError(f"online states out of step: micro-batch {got} holds samples {ids}, training asked for "
                               f"{list(sample_ids)} as micro-batch {seq}")
        return lens, tensors

    def target_rate(self) -> float | None:
        """Tokens/s the target's process computes while it works (None before the first)."""
        return round(self._tokens / self._target_s, 1) if self._target_s > 0 else None

    def progress(self) -> dict[str, float]:
        """Since the last call: seconds training waited for the target; so far: its tokens/s."""
        out = {"states_wait_s": round(self._waited, 3), "target_tokens_per_s": self.target_rate() or 0.0}
        self._waited = 0.0
        return out

    def stats(self) -> dict[str, Any]:
        return {"ahead": self.depth, "micro_batches": len(self.loads), "consumed": self._next,
                "waited_s": round(self._waited_total, 2), "target_s": round(self._target_s, 2),
                "target_tokens_per_s": self.target_rate(), "nonfinite_samples": self.nonfinite}

    def close(self) -> None:
        """Stop the process (after training let go of what it lent)."""
        self._stop.set()
        self._credits.release()  # a process waiting for room sees the stop at once
        if self._proc.is_alive():
            self._proc.join(timeout=60)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()


def _ahead_main(conn: Any, credits: Any, stop: Any, trainer: int, base_folder: str, prepared_folder: str,
                target: TargetSection) -> None:
    """AheadStates' process: load the target, wait for the plan, compute and send each planned
    micro-batch when there is room, then stay (what it sent is its memory) until told to stop
    or the trainer is gone."""

    def wanted() -> bool:
        return not stop.is_set() and pid_alive(trainer)

    try:
        states = OnlineStates(StoreReader(base_folder, verify=False), prepared_folder, target)
        cuda = states.parts.input_device.type == "cuda"
        while not conn.poll(WATCH_S):
            if not wanted():
                return
        _, loads, max_tokens = conn.recv()
        for seq, ids in enumerate(loads):
            while not credits.acquire(timeout=WATCH_S):
                if not wanted():
                    return
            if not wanted():
                return
            t0 = time.perf_counter()
            lens, packed = states.get_packed(ids, max_tokens)
            nonfinite = states.nonfinite  # waits for the forward: what is sent is computed
            conn.send(("batch", seq, ids, lens, packed, nonfinite, time.perf_counter() - t0))
            del packed
            if cuda:
                torch.cuda.ipc_collect()  # memory the trainer let go of, back to this process
        while wanted():
            time.sleep(WATCH_S)
    except (EOFError, ConnectionError):  # the trainer closed its end of the pipe
        return
    except Exception as e:  # noqa: BLE001 - the trainer raises it (a missing file's OSError included)
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
            while wanted():  # the trainer reads the error before this process ends; a plan it is
                if conn.poll(WATCH_S):  # still sending (larger than the pipe holds) is taken, so its
                    conn.recv()  # send returns and its next get_packed raises the error
        except (EOFError, ConnectionError):
            return
