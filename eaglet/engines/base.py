"""The engine interface: what every engine package (eaglet/engines/<name>/) provides, and what
training reads its states from.

An engine runs the target: transformers in eaglet's own process (`hf`), or vLLM in process or
as a server (`vllm`). `eaglet/engines/__init__.py` maps each `extract.backend` name to its
package; nothing outside the engine packages compares a backend name.

`StateSource` is what the trainer reads the target's states from, without knowing its kind:
an offline store (eaglet/formats/store.py `StoreReader`), or states an engine computes as
training goes (`Engine.state_source`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ..checks.findings import Probe
    from ..config import Config
    from ..context import StageContext
    from ..formats.store import StoreReader, TargetHead


class StateSource(Protocol):
    """The target's states of the prepared samples, as training reads them.

    The store-like facts (`sample_ids`, `lengths`, `n_aux`, `layers`, `folder`, `meta`,
    `target_head`) are the extract stage's store's. `computes_ahead`: the source computes the
    micro-batches of a plan ahead of the trainer, which hands it the plan (`start`) before its
    first read and logs its `progress`; `prefetchable`: reads are host I/O that a thread of the
    trainer may overlap with the step (an offline store)."""

    sample_ids: np.ndarray
    lengths: np.ndarray
    n_aux: int
    layers: list[int]
    folder: Path
    meta: dict[str, Any]
    computes_ahead: bool
    prefetchable: bool
    stats_key: str | None  # the key of `stats()` in the train manifest's stats (None: nothing to report)

    def __len__(self) -> int: ...

    def __contains__(self, sample_id: int) -> bool: ...

    def target_head(self, device: torch.device) -> TargetHead: ...

    def start(self, loads: list[list[int]], max_tokens: int) -> None:
        """The micro-batches this rank will read, in order (a no-op where nothing computes ahead)."""

    def read_parts(self, sample_ids: list[int], max_tokens: int) -> tuple[list[int], list[dict[str, torch.Tensor]]]:
        """(each sample's length after the cut to max_tokens, the tensors: one dict per sample, or
        one dict of the whole packed micro-batch)."""

    def progress(self) -> dict[str, float]:
        """Figures for the training log line (empty where nothing computes ahead)."""

    def stats(self) -> dict[str, Any]:
        """Figures for the train manifest, under `stats_key`."""

    def close(self) -> None: ...


class Engine(Protocol):
    """One engine package's entry points (each module-level in eaglet/engines/<name>/__init__.py)."""

    NAME: str

    def extract(self, cfg: Config, ctx: StageContext) -> dict[str, Any]:
        """The extract stage with this engine: capture the states of the prepared samples into the
        store (or, online, write the store's head and metadata only); returns the stage's stats."""

    def state_source(self, cfg: Config, store: StoreReader, prepared: Path, train_dir: Path, rank: int,
                     planned: bool) -> StateSource:
        """Training's states of an online store this engine wrote."""

    def doctor(self, probe: Probe) -> None:
        """The engine's own checks (installed version, API contracts, arguments) for probe.stage."""
