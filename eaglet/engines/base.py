"""The engine interface: what every engine package (eaglet/engines/<name>/) provides, and what
training reads its states from.

An engine runs the target: transformers in eaglet's own process (`hf`), or vLLM in process or
as a server (`vllm`). `eaglet/engines/__init__.py` maps each `extract.backend` name to its
package; nothing outside the engine packages compares a backend name. Change these protocols
when every engine must give something new (then each package, and docs/development.md's
"Adding an engine"); tests/test_engines.py checks that every registered engine gives them.

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

    from ..checks.contracts import Contract
    from ..checks.findings import Probe
    from ..config import Config, EvalSection
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
    """One engine package's entry points (each module-level in eaglet/engines/<name>/__init__.py).

    The constants are what the rest of eaglet asks of an engine instead of comparing its name:
    the doctor sizes the target's memory only where it runs in eaglet's own processes
    (`TARGET_IN_PROCESS`), the shadow run keeps the engine only where it runs a tiny model on a
    CPU (`RUNS_TINY_ON_CPU`), and the eval stage measures the exported draft in an engine that
    serves an export format (`EXPORT_FORMAT`)."""

    NAME: str  # the extract.backend name, as eaglet/engines/__init__.py registers it
    TITLE: str  # the engine's name in messages ("vLLM")
    TARGET_IN_PROCESS: bool  # the target runs in eaglet's processes (False: the engine sizes its own memory)
    RUNS_TINY_ON_CPU: bool  # a tiny model of the target's family runs in it on a CPU (the shadow run)
    CONTRACT_STAGES: frozenset[str]  # the stages of eaglet/checks/contracts.py rows only this engine calls
    CONTRACTS: list[Contract]  # its own API contracts (rows in eaglet/checks/contracts.py's form), beside the common table's
    EXPORT_FORMAT: str | None  # the export format it serves a draft from (formats/serving.py), None: none

    def run_extract(self, cfg: Config, ctx: StageContext) -> dict[str, Any]:
        """The extract stage with this engine: capture the states of the prepared samples into the
        store (or, online, write the store's head and metadata only); returns the stage's stats."""

    def state_source(self, cfg: Config, store: StoreReader, prepared: Path, train_dir: Path, rank: int,
                     planned: bool) -> StateSource:
        """Training's states of an online store this engine wrote."""

    def doctor(self, probe: Probe) -> None:
        """The engine's own checks (installed version, arguments, memory) for probe.stage (None:
        every stage's); each check decides whether the config uses the engine."""

    def contract_stages(self, cfg: Config, stages: set[str]) -> set[str]:
        """The rows of eaglet/checks/contracts.py (by their stage, within CONTRACT_STAGES) that
        the pipeline stages `stages` call of this engine for `cfg`: where it runs the target
        (extract.backend), and where the eval measures the export in it (vLLM's eval rows)."""

    def unchecked_contract(self, probe: Probe, contract: Contract) -> bool:
        """Whether `contract` is a row about this engine's own library that cannot be checked
        here (the library is not installed): left out of the doctor's contract lines."""

    def wants_eval(self, ecfg: EvalSection) -> bool:
        """Whether the eval stage measures the exported draft in this engine too (an error when
        the config asks for it and it cannot run here)."""

    def run_eval(self, cfg: Config, ctx: StageContext, inputs: Any, eaglet_result: dict[str, Any] | None
                 ) -> dict[str, Any]:
        """The exported draft's speculative decoding in this engine over the eval prompts
        (eaglet/stages/evaluate.py EvalInputs), against the in-process result; the result file."""

    def eval_stats(self, result: dict[str, Any]) -> dict[str, Any]:
        """`run_eval`'s figures for the eval stage's manifest."""

    def check_eval_agreement(self, result: dict[str, Any], path: Path) -> None:
        """Raise when `run_eval`'s result disagrees with eaglet's own measurement."""
