"""The vLLM engine: vLLM runs the target, in process or as a server (extract.vllm_server).

    extract.backend: vllm      # run from the venv that has vLLM (bash scripts/vllm_venv.sh)

Its entry points (eaglet/engines/base.py `Engine`), registered as "vllm" in
eaglet/engines/__init__.py: `run_extract` fills the store through vLLM's hidden-state path
(extract.py, capture.py); `state_source` streams an online store's states from the engine
through a bounded buffer (stream.py); `doctor` checks the installed or served vLLM, its
arguments and the vLLM eval (checks.py), and plans a run that streams from it and the draft's
KV cache once vLLM serves it (plan.py); the eval stage measures the exported draft (export
format "vllm") in vLLM with `run_eval` (eval.py, decode.py). Its API contracts (`CONTRACTS`,
contracts.py: stages "extract-vllm" and "eval-vllm") are checked only where vLLM is installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...checks.contracts import Contract
from ...checks.findings import Probe
from ...config import Config, EvalSection
from ...context import StageContext
from ...formats.buffer import buffer_folder
from ...formats.store import StoreReader
from .checks import check_vllm, check_vllm_eval, check_vllm_memory
from .contracts import CONTRACTS, EVAL_STAGE
from .eval import check_agreement, run_vllm_eval, vllm_stats, want_vllm
from .extract import run_extract_vllm
from .plan import check_draft_kv, check_stream
from .stream import StreamedStates

NAME = "vllm"
TITLE = "vLLM"
TARGET_IN_PROCESS = False
RUNS_TINY_ON_CPU = False
CONTRACT_STAGES = frozenset({"extract-vllm", EVAL_STAGE})
EXPORT_FORMAT = "vllm"


def run_extract(cfg: Config, ctx: StageContext) -> dict[str, Any]:
    return run_extract_vllm(cfg, ctx)


def state_source(cfg: Config, store: StoreReader, prepared: Path, train_dir: Path, rank: int,
                 planned: bool) -> StreamedStates:
    """The stream (it always needs the trainer's plan: `planned` readers only)."""
    return StreamedStates(store, prepared, cfg, buffer_folder(cfg.extract.stream_dir, train_dir), rank)


def doctor(probe: Probe) -> None:
    if probe.stage in (None, "extract", "train"):
        check_vllm(probe)
    if probe.stage in (None, "extract"):
        check_vllm_memory(probe)
    if probe.stage in (None, "eval"):
        check_vllm_eval(probe)
    if probe.stage in (None, "extract", "train"):
        check_stream(probe)  # with the served draft's KV cache next to the engine's
    if probe.stage in (None, "eval") and probe.cfg.eval.vllm != "off":
        check_draft_kv(probe, probe.cfg.eval.vllm_engine_args)  # the vLLM eval serves the draft


def contract_stages(cfg: Config, stages: set[str]) -> set[str]:
    """vLLM's own APIs where it runs the target: where it extracts, and where it streams in
    training (extract.mode online); its eval's (the draft type's serving rows) wherever the eval
    stage measures the export in vLLM (eval.vllm not off), whichever engine runs the target."""
    out = {"extract-vllm"} if cfg.extract.backend == NAME and ("extract" in stages or cfg.extract.mode == "online") \
        else set()
    return out | ({EVAL_STAGE} if "eval" in stages and cfg.eval.vllm != "off" else set())


def unchecked_contract(probe: Probe, contract: Contract) -> bool:
    """A row about vLLM itself, where no vLLM new enough is importable here (check_vllm says)."""
    return not probe.vllm_ready and contract.where.startswith(("vllm", "{vllm_"))


def wants_eval(ecfg: EvalSection) -> bool:
    return want_vllm(ecfg)


def run_eval(cfg: Config, ctx: StageContext, inputs: Any, eaglet_result: dict[str, Any] | None) -> dict[str, Any]:
    return run_vllm_eval(cfg, ctx, inputs, eaglet_result)


def eval_stats(result: dict[str, Any]) -> dict[str, Any]:
    return vllm_stats(result)


def check_eval_agreement(result: dict[str, Any], path: Path) -> None:
    check_agreement(result, path)
