"""The draft types eaglet trains, one package each, by their `train.algorithm` name.

    from eaglet.draft import draft_type
    kind = draft_type(cfg.train.algorithm)
    draft = kind.build(cfg, target_config, draft_vocab_size, num_aux)

Each package (eaglet/draft/<type>/__init__.py) gives the entry points of eaglet/draft/base.py
`DraftType`. Adding a type is its package and one line in DRAFT_TYPES below; nothing above
the draft layer compares a type's name: it asks the type instead.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..errors import ConfigError
from . import dflash, eagle3, peagle

DRAFT_TYPES: dict[str, ModuleType] = {
    eagle3.NAME: eagle3,  # EAGLE-3: a chain drafted step by step, trained with training-time test
    dflash.NAME: dflash,  # DFlash: a block of mask tokens drafted in one forward over the target's context states
    peagle.NAME: peagle,  # P-EAGLE: EAGLE-3's draft proposing the whole chain in one forward (parallel drafting)
}


def draft_type(name: str) -> Any:
    """The draft package registered as `name` (a `DraftType`); a ConfigError for any other name."""
    if name not in DRAFT_TYPES:
        raise ConfigError(f"train.algorithm {name!r} is not a draft type eaglet trains: {', '.join(DRAFT_TYPES)}")
    return DRAFT_TYPES[name]


def draft_type_of(draft: Any) -> Any:
    """The package of a draft module (its class's ALGORITHM)."""
    return draft_type(type(draft).ALGORITHM)
