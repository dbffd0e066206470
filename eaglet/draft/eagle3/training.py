"""EAGLE-3's training entry points (eaglet/draft/base.py `DraftType`): the draft a run builds,
what each micro-batch prepares on the host, the fast paths, and the loss.

The trainer reaches these through `eaglet.draft.draft_type("eagle3")`; EAGLE-3 keeps its keys
in train.* (draft_layers, draft_attention and mla_*, fc_norm, norm_output, ttt_steps, gamma,
accept_loss, state_noise).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ...config import Config
from ..loss import PositionLoss, noisy_states
from .loss import active_rows, head_rows, ttt_loss
from .model import DraftConfig, Eagle3Draft
from .unroll import unroll_linears as _unroll_linears
from .unroll import use_fast_unroll

HEAD_ROWS = "head_rows_{}"  # Batch.rows key of step j's head rows
ACTIVE_ROWS = "active_rows"  # Batch.rows key of the rows steps 1.. run over


def layers(num_target_layers: int, cfg: Config) -> list[int] | None:
    """None: the states extract.layers names (default [2, L//2, L-3], the low, mid and high)."""
    return None


def draft_config(cfg: Config, target_config: Any, draft_vocab_size: int, num_aux: int) -> DraftConfig:
    """The draft's sizes: the target's (`DraftConfig.from_target_config`) with train.draft_layers,
    train.fc_norm, train.norm_output and the attention (train.draft_attention; an MLA layer's
    sizes from train.mla_*, each None the target's or the default rule's)."""
    t = cfg.train
    mla = dict(mla_heads=t.mla_heads, q_lora_rank=t.mla_q_lora_rank, kv_lora_rank=t.mla_kv_lora_rank,
               qk_nope_head_dim=t.mla_qk_nope_head_dim, qk_rope_head_dim=t.mla_qk_rope_head_dim,
               v_head_dim=t.mla_v_head_dim) if t.draft_attention == "mla" else {}
    return DraftConfig.from_target_config(
        target_config, draft_vocab_size=draft_vocab_size, num_layers=t.draft_layers, fc_norm=t.fc_norm,
        norm_output=t.norm_output, num_aux=num_aux, attention=t.draft_attention, **mla)


def build(cfg: Config, target_config: Any, draft_vocab_size: int, num_aux: int) -> Eagle3Draft:
    """A fresh draft of `draft_config`'s sizes, its parameters initialised from torch's current seed."""
    model = Eagle3Draft(draft_config(cfg, target_config, draft_vocab_size, num_aux))
    model.reset_parameters()
    return model


def from_config(draft_config: dict[str, Any]) -> Eagle3Draft:
    """The draft a saved `DraftConfig.to_dict()` describes, weights not loaded."""
    return Eagle3Draft(DraftConfig(**draft_config))


def host_rows(loss_mask_BT: Tensor, doc_ids_BT: Tensor, cfg: Config, seed: int) -> dict[str, Tensor]:
    """`step_rows` of train.ttt_steps steps. Nothing random: `seed` is not used."""
    return step_rows(loss_mask_BT, doc_ids_BT, cfg.train.ttt_steps)


def step_rows(loss_mask_BT: Tensor, doc_ids_BT: Tensor, num_steps: int) -> dict[str, Tensor]:
    """Per TTT step the rows its loss can count (`loss.head_rows`, keys HEAD_ROWS), and the rows
    steps 1.. run over (`loss.active_rows`, ACTIVE_ROWS), from the batch's host tensors (nonzero
    on the device would make it wait)."""
    rows = head_rows(loss_mask_BT, doc_ids_BT, num_steps)
    return {**{HEAD_ROWS.format(j): r for j, r in enumerate(rows)}, ACTIVE_ROWS: active_rows(rows)}


def prepare_training(draft: nn.Module, compile: bool, sharded: bool) -> None:
    """The fast TTT unroll (eaglet/draft/eagle3/unroll.py) as the draft's training call, its
    pieces compiled when `compile`."""
    use_fast_unroll(draft, compile=compile, sharded=sharded)


def shard_units(draft: nn.Module) -> list[nn.Module]:
    """The decoder layers."""
    return list(draft.layers)


def unroll_linears(draft: nn.Module) -> list[nn.Module]:
    """The linears the unroll casts once per unroll (the layers', lm_head): UnrollAdamW's."""
    return _unroll_linears(draft)


def num_positions(cfg: Config) -> int:
    """One loss and accuracy per TTT step."""
    return cfg.train.ttt_steps


def loss(module: nn.Module, draft: nn.Module, batch: Any, teacher_BTV: Tensor, in_vocab_BT: Tensor, cfg: Config,
         compiled: bool) -> PositionLoss:
    """The TTT unroll of `module` over `batch` (a step.Batch: the step imports the draft types,
    so not they it) and its loss (`ttt_loss`). A draft in training mode reads its states with
    train.state_noise added."""
    train_cfg = cfg.train
    noise = train_cfg.state_noise
    aux = batch.aux
    if draft.training and noise > 0:
        with torch.autocast(aux.device.type, enabled=False):  # the noise in fp32, as outside autocast
            aux = noisy_states(aux, draft.config.num_aux, noise)
    rows = batch.rows
    steps_rows = None if rows is None else tuple(rows[HEAD_ROWS.format(j)] for j in range(train_cfg.ttt_steps))
    active = None if rows is None else rows.get(ACTIVE_ROWS)
    steps = module(aux, batch.input_ids, batch.position_ids, batch.doc_ids, num_steps=train_cfg.ttt_steps,
                   attn_impl=train_cfg.attn_impl, head_rows=steps_rows, active_rows=active)
    return ttt_loss(steps, teacher_BTV, in_vocab_BT, batch.loss_mask, batch.doc_ids, train_cfg.gamma,
                    compiled=compiled, head_rows=steps_rows, accept_loss=train_cfg.accept_loss,
                    accept_weight=train_cfg.accept_weight)
