"""The HF engine: transformers runs the target in eaglet's own process(es).

    extract.backend: hf        # the default

Its entry points (eaglet/engines/base.py `Engine`), registered as "hf" in
eaglet/engines/__init__.py: `run_extract` fills the store with hooks on the decoder layers
(extract.py, capture.py); `state_source` computes an online store's states beside the draft
(online.py). Its speculative decoding (decode.py, replay.py) is eaglet's own in-process eval,
which the eval stage runs itself; it serves no export, so `wants_eval` is False. Its API
contracts are the rows of stage "extract" in eaglet/checks/contracts.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...checks.contracts import Contract
from ...checks.findings import Probe
from ...config import Config, EvalSection
from ...context import StageContext
from ...formats.store import StoreReader
from ..states import PreparedStates
from .extract import run_extract_hf
from .online import AheadStates, OnlineStates, online_ahead

NAME = "hf"
TITLE = "transformers"
TARGET_IN_PROCESS = True
RUNS_TINY_ON_CPU = True
CONTRACT_STAGES = frozenset({"extract"})
# transformers' APIs are the common table's rows (eaglet/checks/contracts.py): training, eval and
# regenerate call transformers too, with any engine
CONTRACTS: list[Contract] = []
EXPORT_FORMAT = None


def run_extract(cfg: Config, ctx: StageContext) -> dict[str, Any]:
    return run_extract_hf(cfg, ctx)


def state_source(cfg: Config, store: StoreReader, prepared: Path, train_dir: Path, rank: int,
                 planned: bool) -> PreparedStates:
    """The target beside the draft: in a process of its own computing the plan ahead
    (extract.online_ahead, `planned` readers only), else in the trainer's process."""
    ahead = online_ahead(cfg) if planned else 0
    if ahead:
        return AheadStates(store, prepared, cfg.target, ahead)
    return OnlineStates(store, prepared, cfg.target)


def doctor(probe: Probe) -> None:
    """Nothing of its own: the doctor's target checks and memory estimates are this engine's."""


def contract_stages(cfg: Config, stages: set[str]) -> set[str]:
    return stages & CONTRACT_STAGES if cfg.extract.backend == NAME else set()  # the hooks, where it extracts


def unchecked_contract(probe: Probe, contract: Contract) -> bool:
    return False  # transformers is always installed


def wants_eval(ecfg: EvalSection) -> bool:
    return False


def run_eval(cfg: Config, ctx: StageContext, inputs: Any, eaglet_result: dict[str, Any] | None) -> dict[str, Any]:
    raise NotImplementedError("the HF engine's decoding is the eval stage's own in-process eval")


def eval_stats(result: dict[str, Any]) -> dict[str, Any]:
    return {}


def check_eval_agreement(result: dict[str, Any], path: Path) -> None:
    """Nothing to compare: the in-process eval is the reference."""
