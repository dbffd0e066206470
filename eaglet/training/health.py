"""Whether training is still sound: steps skipped for a non-finite gradient, and weights that are
not finite, with the likely cause and its fix.

A step whose gradient norm is not finite is skipped (draft/step.py `optimizer_step`: the
weights and AdamW's state stay as they were; the schedule and the data go on), counted on the
device and read on logging steps and before each checkpoint (`check_health`); more than
`train.max_skipped_steps` in a row, or a weight that is not finite before a checkpoint, stop
training with a DivergedError (exit 7) naming the step and the likely cause, so neither a
checkpoint nor `final/` ever holds a non-finite weight.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import Config
from ..draft.parallelize import Parallel
from ..draft.loss import noisy_states
from ..draft.step import AUTO_LR_WIDTH, Batch, SkippedSteps, all_finite
from ..errors import DivergedError
from ..utils import log
from .resume import CKPT_DIR


def check_health(skipped: SkippedSteps, step: int, b: Batch, weights: bool, parallel: Parallel,
                 optimizer: torch.optim.Optimizer, cfg: Config, out_dir: Path, show: bool) -> dict[str, int]:
    """The steps skipped for a non-finite gradient norm since the last look (SkippedSteps.look:
    one sync, on a logging or checkpoint step); raises DivergedError when more than
    train.max_skipped_steps were skipped in a row, or, before a checkpoint (`weights`), when a
    trained weight is not finite, so that neither a checkpoint nor final/ ever holds one.
    Every rank decides alike: the counts are the same on each, the weight check all-reduced.
    `b`: the last micro-batch; `show`: this rank logs (rank 0)."""
    train_cfg = cfg.train
    seen = skipped.look()
    stop = seen["longest"] > train_cfg.max_skipped_steps
    if seen["new"] and not stop and show:
        log(f"[train] step {step}: {seen['new']} step(s) skipped, the gradient norm not finite (the first at step "
            f"{seen['first']}; {seen['total']} skipped in this run; train.max_skipped_steps allows "
            f"{train_cfg.max_skipped_steps} in a row); the logged loss counts them")
    if stop:
        cause, fix = likely_cause(b, parallel, optimizer, cfg, out_dir)
        raise DivergedError(
            f"train: the gradient norm was not finite at {seen['longest']} optimizer steps in a row, more than "
            f"train.max_skipped_steps {train_cfg.max_skipped_steps} (steps {seen['from']} to {seen['to']}; stopped at "
            f"step {step}); likely cause: {cause}", fix=fix)
    if weights and not all_finite(parallel):
        cause, fix = likely_cause(b, parallel, optimizer, cfg, out_dir, weights_bad=True)
        raise DivergedError(f"train: a trained weight is not finite at step {step}, so no checkpoint of it is "
                            f"written; likely cause: {cause}", fix=fix)
    return seen


def likely_cause(b: Batch, parallel: Parallel, optimizer: torch.optim.Optimizer, cfg: Config, out_dir: Path,
                 weights_bad: bool | None = None) -> tuple[str, str]:
    """(what most likely made the gradient or a weight non-finite, how to fix it), from the
    weights and the last micro-batch `b`. Every rank calls it (the weight check is a collective).
    `weights_bad`: the weight check's answer when it was asked already."""
    train_cfg, draft_cfg = cfg.train, parallel.draft.config
    lr = optimizer.defaults["lr"]
    auto = AUTO_LR_WIDTH / draft_cfg.hidden_size
    kept = any((out_dir / CKPT_DIR).glob("step-*"))
    again = "then rerun train" + (" with --force (a changed setting refuses a resume of the checkpoints there)"
                                  if kept else "")
    lower_lr = (f"lower train.lr (now {lr:g}; auto gives {auto:.3g} at hidden size "
                f"{draft_cfg.hidden_size}) or raise train.warmup_steps (now {train_cfg.warmup_steps}), {again}")
    if weights_bad if weights_bad is not None else not all_finite(parallel):
        return (f"the updates overflowed the weights (train.lr {lr:g}, train.weight_decay {train_cfg.weight_decay:g})",
                lower_lr)
    states = [name for name, t in (("captured", b.aux), ("final", b.final)) if not bool(torch.isfinite(t).all())]
    if states:
        return (f"the target's {' and '.join(states)} states of samples {list(b.sample_ids)[:8]} are not finite "
                f"(the target overflows in target.dtype {cfg.target.dtype}?)",
                "extract again with target.dtype bfloat16 or float32 (eaglet extract CONFIG --force), or leave "
                "those records out of prepare.data")
    noise = train_cfg.state_noise
    if noise > 0 and (noise > 1 or not bool(torch.isfinite(noisy_states(b.aux, draft_cfg.num_aux, noise)).all())):
        return (f"train.state_noise {noise:g} (noise of {noise:g} times each state's RMS)",
                f"lower train.state_noise (a fraction of the RMS; docs/quality.md measured 0.05), {again}")
    return (f"the loss overflowed with finite weights and input states: the learning rate (train.lr {lr:g}) is too "
            "high for this draft", lower_lr)
