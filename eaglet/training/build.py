"""The draft a run trains, and the settings that follow from the config alone.

    model = build_draft(cfg, store, d2t, t2d, head)   # fresh, or train.init_from's weights

The draft is train.algorithm's type (`draft_type(...).build`: the target's shape) unless
train.init_from names a trained one (`from_config`); either way its embedding is the target's
and its vocabulary maps are this run's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import Config, TrainSection
from ..draft import draft_type
from ..engines.base import StateSource
from ..errors import ConfigError, InputError
from ..formats.serving import load_draft
from ..formats.store import StoreReader, TargetHead, read_target_config
from ..targets.families import text_config_from_dict, type_layers
from ..utils import log


def train_seed(cfg: Config) -> int:
    """The seed of the draft's initialisation, its micro-batch order and its noise: train.seed,
    else run.seed (which alone sets the held-out split)."""
    return cfg.run.seed if cfg.train.seed is None else cfg.train.seed


def uses_bf16(train_cfg: TrainSection, device: torch.device) -> bool:
    """Whether training autocasts to bf16: train.precision bf16, or auto on a GPU."""
    return train_cfg.precision == "bf16" or (train_cfg.precision == "auto" and device.type == "cuda")


def aux_columns(store: StateSource, kind: Any, cfg: Config) -> list[int] | None:
    """Which of the store's captured states draft type `kind` reads (indices into store.layers,
    in the type's order), or None: all of them, as stored. A store without one of the type's
    layers is an InputError naming extract.layers and extract.draft_types."""
    wanted = type_layers(kind, cfg, int(store.meta["num_target_layers"]))
    held = list(store.layers)
    if wanted == held:
        return None
    missing = [i for i in wanted if i not in held]
    if missing:
        raise InputError(
            f"train.algorithm {kind.NAME} reads the target's layers {wanted}, the store {store.folder} holds {held} "
            f"(not {missing})", fix=f"add them to extract.layers, or {kind.NAME} to extract.draft_types, and extract "
            "again (eaglet extract CONFIG --force)")
    return [held.index(i) for i in wanted]


def read_layers(store: StateSource, cfg: Config) -> list[int]:
    """The target layers train.algorithm's draft reads from `store` (its aux columns, in order):
    what its saved draft records as its captured layers."""
    columns = aux_columns(store, draft_type(cfg.train.algorithm), cfg)
    return list(store.layers) if columns is None else [store.layers[i] for i in columns]


def build_draft(cfg: Config, store: StoreReader, d2t: torch.Tensor, t2d: torch.Tensor, head: TargetHead) -> nn.Module:
    """The draft to train: train.init_from's weights, else a fresh one of the target's shape
    (seeded by `train_seed`, reading the store's states its type takes, its head optionally the
    target's rows: train.init_head_from_target), with the target's embedding and this run's d2t/t2d."""
    train_cfg = cfg.train
    kind = draft_type(train_cfg.algorithm)
    if train_cfg.init_from:
        draft_cfg, state, meta = load_draft(train_cfg.init_from)
        made_as = meta.get("algorithm", kind.NAME)
        if made_as != kind.NAME:
            raise ConfigError(f"train.init_from {train_cfg.init_from} is a {made_as} draft, train.algorithm is "
                              f"{kind.NAME}", fix=f"set train.algorithm={made_as}, or name a {kind.NAME} draft")
        model = kind.from_config(draft_cfg.to_dict())
        missing, unexpected = model.load_state_dict(state, strict=False)
        bad = [k for k in missing if k not in ("embed_tokens.weight", "d2t", "t2d")]
        if bad or unexpected:
            raise ValueError(f"train.init_from {train_cfg.init_from}: missing {bad}, unexpected {list(unexpected)}")
        if not torch.equal(model.d2t, d2t):
            log(f"[train] init_from {train_cfg.init_from}: its draft vocabulary differs from this run's; using this "
                "run's")
    else:
        hf = text_config_from_dict(read_target_config(store.folder))
        columns = aux_columns(store, kind, cfg)
        torch.manual_seed(train_seed(cfg))
        model = kind.build(cfg, hf, int(d2t.numel()), store.n_aux if columns is None else len(columns))
        if train_cfg.init_head_from_target:
            # The draft predicts what the target's head would from a state of the same width,
            # so the target's head rows for the draft vocabulary are a head start over random.
            with torch.no_grad():
                used = torch.arange(d2t.numel()) + d2t
                model.lm_head.weight.copy_(head.lm_head[used.to(head.lm_head.device)].to(model.lm_head.weight))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(head.embed.to(model.embed_tokens.weight.dtype))
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
    return model
