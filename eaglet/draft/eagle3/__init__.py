"""EAGLE-3: a draft that reads the target's low, mid and high states and drafts a chain one
step at a time, trained with training-time test (model.py has the architecture)."""

from __future__ import annotations

from typing import Any

from .read_export import from_serving, serving_format
from .model import DraftConfig, Eagle3Draft
from .propose import Eagle3Proposer
from .replay import chain_hits, replay_tree
from .serving import reload_logits, serving

NAME = "eagle3"
TITLE = "EAGLE-3"
SERVING_METHOD = "eagle3"

__all__ = ["NAME", "TITLE", "SERVING_METHOD", "from_config", "proposer", "serving", "from_serving", "serving_format",
           "reload_logits", "chain_hits", "replay_tree"]


def from_config(draft_config: dict[str, Any]) -> Eagle3Draft:
    """The draft a saved draft config (`DraftConfig.to_dict()`) describes, weights not loaded."""
    return Eagle3Draft(DraftConfig(**draft_config))


def proposer(draft: Eagle3Draft) -> Eagle3Proposer:
    """The draft's proposal state for in-process speculative decoding (batch 1): a chain
    (`propose`) or the EAGLE-2 tree (`propose_tree`)."""
    return Eagle3Proposer(draft)
