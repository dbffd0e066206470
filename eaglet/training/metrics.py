"""What training reports: log.jsonl (and TensorBoard), and the messages the loop logs about
its own progress.

    metrics = MetricLog(out_dir, resume_step, tensorboard=True, enabled=env.is_main)
    metrics.write({"split": "train", "step": 10, "loss": 2.1, ...})   # one line per logged step

`say_if_compiling` names torch.compile's work past the warm-up, `say_if_behind` an engine that
keeps training waiting for its states; `memory_gib` is the peak memory a log line reports.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Any

import torch

from ..utils import atomic_write_text, log

LOG_FILE = "log.jsonl"
TB_DIR = "tb"

# The share of a logging interval spent waiting for streamed states above which the log says
# that the engine is behind. Raise it if the message shows for waits too short to matter.
BEHIND = 0.05


class MetricLog:
    """log.jsonl (+ TensorBoard when installed). A resume keeps the lines of the steps up to the
    checkpoint's and drops, with a log line, those that do not parse (a kill mid-write)."""

    def __init__(self, folder: Path, resume_step: int, tensorboard: bool, enabled: bool = True):
        self.path = folder / LOG_FILE
        self.enabled = enabled
        self.tb = None
        self.kept: list[dict[str, Any]] = []
        if not enabled:  # ranks other than 0
            return
        kept: list[tuple[str, dict[str, Any]]] = []
        if resume_step and self.path.is_file():  # drop lines of steps the resume will redo
            kept, dropped = log_lines(self.path.read_bytes(), resume_step)
            if dropped:  # a kill in the middle of a write: the checkpoint, not the log, is the state
                log(f"[train] {self.path}: dropped {dropped} line{'s' if dropped > 1 else ''} that do not parse (a "
                    "write cut short by a kill); their metrics are lost, the training state is the checkpoint's")
        elif self.path.is_file():
            self.path.unlink()
        atomic_write_text(self.path, "".join(ln + "\n" for ln, _ in kept), fsync=False)
        self.kept = [rec for _, rec in kept]
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(folder / TB_DIR), purge_step=resume_step + 1 if resume_step else None)
            except ImportError:
                log("[train] tensorboard not installed: logging to log.jsonl only")

    def write(self, rec: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            prefix = rec.get("split", "train")
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(f"{prefix}/{k}", v, rec["step"])

    def last_eval(self) -> dict[str, float] | None:
        """The metrics of the newest evaluation line kept from before a resume, or None."""
        return next(({k: v for k, v in r.items() if k not in ("split", "step")} for r in reversed(self.kept)
                     if r.get("split") == "eval"), None)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def log_lines(data: bytes, upto: int) -> tuple[list[tuple[str, dict[str, Any]]], int]:
    """log.jsonl's records of steps up to `upto`, each with its line, and the number of lines
    dropped because they are not a record (cut short, or garbage)."""
    kept, dropped = [], 0
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            line = raw.decode()
            rec = json.loads(line)
            step = int(rec["step"])
        except (ValueError, KeyError, TypeError, IndexError, RecursionError):  # UnicodeDecodeError, JSONDecodeError too
            dropped += 1
            continue
        if step <= upto:
            kept.append((line, rec))
    return kept, dropped


def memory_gib(device: torch.device) -> float:
    """The peak memory so far: allocated on a GPU, the process's resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def say_if_compiling(step: int, graphs: int, gave_up: int, warmed: bool, show: bool) -> None:
    """Log torch.compile's work past the warm-up: `graphs` made once `warmed` (after the first
    logging interval: shapes the compiled pieces had not met), and any function it gave up on
    (`gave_up`: eager from then on)."""
    if not show:
        return
    if gave_up:
        log(f"[train] step {step}: torch.compile reached its recompile limit for {gave_up} function(s) of the step, "
            "which run eager from now on (slower); TORCH_LOGS=recompiles names them and says why")
    elif warmed and graphs:
        log(f"[train] step {step}: torch.compile made {graphs} more graph(s) since the last log line, for shapes it "
            "had not met; TORCH_LOGS=recompiles says which")


def say_if_behind(rec: dict[str, Any], seconds: float, show: bool) -> None:
    """Log that the engine fell behind when training waited for its states (a stream run's record)."""
    if show and seconds > 0 and rec.get("stream_wait_s", 0) > BEHIND * seconds:
        busy = max(seconds - rec["stream_wait_s"], 1e-9)  # training's own time: its rate were it never kept waiting
        log(f"[train] step {rec['step']}: the engine is behind: training waited {rec['stream_wait_s']:.1f} s of the "
            f"last {seconds:.1f} s for states; the engine computes {rec['engine_tokens_per_s']:.0f} tokens/s, "
            f"training could take {rec['tokens_per_s'] * seconds / busy:.0f} (raise the engine's share of the GPUs, "
            "or extract.stream_buffer_gb to ride out its pauses)")
