"""The engines eaglet runs a target with, one package each, by their `extract.backend` name.

    from eaglet.engines import engine
    engine(cfg.extract.backend).run_extract(cfg, ctx)

Each package (eaglet/engines/<name>/__init__.py) gives the entry points of
eaglet/engines/base.py `Engine` as module-level functions and constants. Adding an engine is
its package and one line in ENGINES below (the command checks `extract.backend` against this
list as it reads the config: eaglet/cli.py); docs/development.md "Adding an engine" goes step by
step. Nothing outside the engine packages compares a backend name: it asks the engine instead.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..errors import ConfigError
from . import hf, vllm

ENGINES: dict[str, ModuleType] = {
    hf.NAME: hf,  # transformers in eaglet's own processes
    vllm.NAME: vllm,  # vLLM in process or as a server
}

STORE_DEFAULT = hf.NAME  # the engine of a store whose meta names none (the HF engine writes no `backend` key)


def engine(name: str) -> Any:
    """The engine package registered as `name` (an `Engine`); a ConfigError for any other name."""
    if name not in ENGINES:
        raise ConfigError(f"extract.backend {name!r} is not an engine eaglet has: {', '.join(ENGINES)}")
    return ENGINES[name]


def store_engine(meta: dict[str, Any]) -> Any:
    """The engine that wrote a store, from its meta (store.json)."""
    return engine(meta.get("backend", STORE_DEFAULT))


def engine_contracts() -> list[Any]:
    """Every engine's own API contracts (their packages' CONTRACTS), for the doctor to check
    beside eaglet/checks/contracts.py's common rows."""
    return [c for e in ENGINES.values() for c in e.CONTRACTS]


def contract_stages() -> frozenset[str]:
    """Every engine's own stages of eaglet/checks/contracts.py rows."""
    return frozenset().union(*(e.CONTRACT_STAGES for e in ENGINES.values()))


def eval_engine(ecfg: Any) -> Any:
    """The engine the eval stage measures the exported draft in (eval.vllm), or None."""
    return next((e for e in ENGINES.values() if e.wants_eval(ecfg)), None)


def tiny_cpu_engine() -> str:
    """The name of the first engine that runs a tiny model on a CPU (the shadow run's)."""
    return next(name for name, e in ENGINES.items() if e.RUNS_TINY_ON_CPU)
