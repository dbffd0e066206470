"""Stage `extract`: run the target over the prepared samples and store its hidden states.

    eaglet extract CONFIG
    torchrun --nproc-per-node 8 -m eaglet.cli extract CONFIG      # the HF engine, data or tensor parallel

The engine named by `extract.backend` runs the target and writes the store (eaglet/formats/store.py):
per token, the states entering the decoder layers of the extraction plan and the final state the
LM head reads. The plan (eaglet/targets/families.py `extraction_layers`) is the layers of
train.algorithm's draft type (EAGLE-3: `extract.layers`) and of each type in
`extract.draft_types`, so that one store trains several types; training reads its own type's. Each engine's `run_extract` says how: eaglet/engines/hf/extract.py (transformers in
eaglet's own processes, hooks on the decoder layers) and eaglet/engines/vllm/extract.py (vLLM in
process or as a server; the final state before the final norm, `final_state: pre_norm`). With
`extract.mode: online` the engine writes only the store's head, metadata and the self-check's
samples: training computes the rest (`Engine.state_source`). The engines are listed in
eaglet/engines/__init__.py; this module names none of them.
"""

from __future__ import annotations

from typing import Any

from ..config import Config
from ..context import StageContext
from ..engines import engine


def run_extract(cfg: Config, ctx: StageContext) -> dict[str, Any]:
    """Stage entry point: the configured engine's extract (its stats are the stage's)."""
    return engine(cfg.extract.backend).run_extract(cfg, ctx)
