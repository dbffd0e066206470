"""The draft a run trains, and the settings that follow from the config alone.

    model = build_draft(cfg, store, d2t, t2d, head)   # fresh, or train.init_from's weights

The draft is the target's shape (eaglet/draft/eagle3/model.py `DraftConfig.from_target_config`) unless
train.init_from names a trained one; either way its embedding is the target's and its
vocabulary maps are this run's.
"""

from __future__ import annotations

import torch

from ..config import Config, TrainSection
from ..draft.eagle3.model import DraftConfig, Eagle3Draft
from ..formats.serving import load_draft
from ..formats.store import StoreReader, TargetHead, read_target_config
from ..targets.families import text_config_from_dict
from ..utils import log


def train_seed(cfg: Config) -> int:
    """The seed of the draft's initialisation, its micro-batch order and its noise: train.seed,
    else run.seed (which alone sets the held-out split)."""
    return cfg.run.seed if cfg.train.seed is None else cfg.train.seed


def uses_bf16(train_cfg: TrainSection, device: torch.device) -> bool:
    """Whether training autocasts to bf16: train.precision bf16, or auto on a GPU."""
    return train_cfg.precision == "bf16" or (train_cfg.precision == "auto" and device.type == "cuda")


def build_draft(cfg: Config, store: StoreReader, d2t: torch.Tensor, t2d: torch.Tensor, head: TargetHead) -> Eagle3Draft:
    """The draft to train: train.init_from's weights, else a fresh one of the target's shape
    (seeded by `train_seed`, its head optionally the target's rows: train.init_head_from_target),
    with the target's embedding and this run's d2t/t2d."""
    train_cfg = cfg.train
    if train_cfg.init_from:
        draft_cfg, state, _meta = load_draft(train_cfg.init_from)
        model = Eagle3Draft(draft_cfg)
        missing, unexpected = model.load_state_dict(state, strict=False)
        bad = [k for k in missing if k not in ("embed_tokens.weight", "d2t", "t2d")]
        if bad or unexpected:
            raise ValueError(f"train.init_from {train_cfg.init_from}: missing {bad}, unexpected {list(unexpected)}")
        if not torch.equal(model.d2t, d2t):
            log(f"[train] init_from {train_cfg.init_from}: its draft vocabulary differs from this run's; using this "
                "run's")
    else:
        hf = text_config_from_dict(read_target_config(store.folder))
        draft_cfg = DraftConfig.from_target_config(
            hf, draft_vocab_size=int(d2t.numel()), num_layers=train_cfg.draft_layers, fc_norm=train_cfg.fc_norm,
            norm_output=train_cfg.norm_output, num_aux=store.n_aux,
        )
        torch.manual_seed(train_seed(cfg))
        model = Eagle3Draft(draft_cfg)
        model.reset_parameters()
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
