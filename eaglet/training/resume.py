"""What a training run may resume: the fingerprint, the choice of checkpoint, refusal, fallback
to an older checkpoint, `--extend`, and `--force`'s move of the old run aside.

    fingerprint = run_fingerprint(model, store, d2t, cfg, world_size, device)
    chosen, checkpoint = choose_checkpoint(out_dir, fingerprint, resume_settings(cfg, world_size), ...)

A killed run started again continues from the newest intact checkpoint (a corrupt one is
named and passed over) and produces the same losses as an uninterrupted run. Checkpoints carry
a fingerprint of everything that sets the trajectory (the model, the data, the vocabulary,
run.seed, every train.* setting but RESUME_SAFE_KEYS, and the draft type's own section); a resume whose fingerprint differs
is refused with the keys that differ (ResumeError). `--force` starts afresh, the old run moved
to `previous-N/` (`move_aside`); `--extend` continues to a raised train.epochs or
train.max_steps, the learning rate decaying on from where it was (draft/step.py `lr_lambda`).
A checkpoint resumes on any world size with the same micro-batches per step (grad_accum x W),
and is refused with the grad_accum to use otherwise.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import Config, TrainSection, default_quiet_keys
from ..distributed import resolve_device
from ..draft.step import extend_schedule, lr_lambda, peak_lr
from ..errors import CorruptDataError, ResumeError
from ..formats.checkpoints import CKPT_DIR, Checkpoint, newest_intact
from ..formats.draft import FINAL_DIR
from ..formats.store import StoreReader
from ..utils import log
from .build import uses_bf16
from .metrics import LOG_FILE, TB_DIR

# The train.* settings a resume may change. They set what is logged, evaluated and kept, or how
# the same sums are computed: the device, the parallel strategy, compilation, the attention
# kernel and the teacher's chunking each move the numbers by float rounding only (tests hold
# each to its reference), where every other setting changes the trajectory itself. The
# precision is compared as resolved (bf16 or fp32), since `auto` follows the device;
# train.grad_accum as micro-batches per step (grad_accum x world size), which is what it sets.
RESUME_SAFE_KEYS = ("log_every", "eval_every", "eval_max_samples", "ckpt_every", "keep_last", "tensorboard",
                    "device", "parallel", "compile", "compile_cache", "attn_impl", "teacher_chunk", "prefetch",
                    "ckpt_async", "max_skipped_steps")
# The trajectory settings `eaglet train --extend` may raise: a longer schedule (choose_checkpoint).
EXTEND_KEYS = ("train.epochs", "train.max_steps")


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def _jsonable(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` as it reads back from state.json, so that a comparison with a checkpoint's holds."""
    return json.loads(json.dumps(obj, default=str))


def run_fingerprint(model: nn.Module, store: StoreReader, d2t: torch.Tensor, cfg: Config,
                world_size: int = 1, device: torch.device | None = None) -> dict[str, Any]:
    """What a checkpoint may only be resumed with: the model's shape, the data (and how it is
    cut into optimizer steps: micro-batches per step, not the world size), the vocabulary,
    run.seed, every train.* setting but RESUME_SAFE_KEYS (train.algorithm among them) and the
    draft type's own config section (`Config.type_section`)."""
    found = {f"model.{k}": v for k, v in model.config.to_dict().items()}
    found["data.store"] = store.meta.get("input_hash")
    found["data.samples"] = len(store)
    found["data.micro_batches_per_step"] = cfg.train.grad_accum * world_size
    found["vocab.d2t"] = _digest(d2t)
    found["run.seed"] = cfg.run.seed
    # Keys added to eaglet with hashed=UNLESS_DEFAULT (train.algorithm, train.draft_attention, ...) count
    # once set: at their defaults a checkpoint written before them resumes.
    quiet = default_quiet_keys("train")
    for k, v in cfg.section("train").items():
        if k not in RESUME_SAFE_KEYS and k != "grad_accum" and not (k in quiet and v == quiet[k]):
            found[f"train.{k}"] = v
    for k, v in (cfg.type_section(cfg.train.algorithm) or {}).items():
        found[f"{cfg.train.algorithm}.{k}"] = v
    found["train.lr"] = peak_lr(cfg.train, model.config.hidden_size)  # auto as the number it is at this width
    found["train.precision"] = "bf16" if uses_bf16(cfg.train, device or resolve_device(cfg.train.device)) else "fp32"
    return _jsonable(found)


def resume_settings(cfg: Config, world_size: int = 1) -> dict[str, Any]:
    """The settings a resume may change (RESUME_SAFE_KEYS and the world size), recorded in each
    checkpoint so that a resume can say which changed."""
    train = cfg.section("train")
    return _jsonable({**{f"train.{k}": train[k] for k in RESUME_SAFE_KEYS}, "world_size": world_size})


def fingerprint_diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{key: (old, new)} of the keys whose values differ. A key only one side has is its default on
    the other where it is a train key added with hashed=UNLESS_DEFAULT (`run_fingerprint` leaves
    those out at their defaults), else None."""
    quiet = {f"train.{k}": v for k, v in default_quiet_keys("train").items()}

    def value(fingerprint: dict[str, Any], k: str) -> Any:
        return fingerprint.get(k, quiet.get(k))

    return {k: (value(old, k), value(new, k)) for k in sorted(set(old) | set(new)) if value(old, k) != value(new, k)}


def _changes(diff: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())


def previous_dir(out_dir: Path) -> Path:
    """Where `--force` keeps the run it replaces: <train>/previous-N, N one above any there."""
    taken = [int(p.name.split("-", 1)[1]) for p in out_dir.glob("previous-*") if p.name.split("-", 1)[1].isdigit()]
    return out_dir / f"previous-{max(taken, default=0) + 1}"


def move_aside(out_dir: Path) -> Path | None:
    """`eaglet train --force`: move the run in `out_dir` (checkpoints, log, TensorBoard, final
    draft) into previous-N/, so that training starts from step 0 and nothing is deleted."""
    parts = [out_dir / n for n in (CKPT_DIR, LOG_FILE, TB_DIR, FINAL_DIR) if (out_dir / n).exists()]
    if not parts:
        return None
    dest = previous_dir(out_dir)
    dest.mkdir()
    for p in parts:
        p.rename(dest / p.name)
    log(f"[train] --force: the previous run is kept in {dest}; training from step 0")
    return dest


def _world_hint(state: dict[str, Any], fingerprint: dict[str, Any], world_size: int, grad_accum: int) -> str:
    """What to change when the checkpoint's micro-batches per step differ from this run's ('' when alike)."""
    old_m = state["fingerprint"].get("data.micro_batches_per_step")
    new_m, W = fingerprint["data.micro_batches_per_step"], world_size
    if old_m is None or old_m == new_m:
        return ""
    ws = state.get("world_size", 1)
    hint = (f"; the checkpoint was written by {ws} rank(s) x train.grad_accum {old_m // ws} = {old_m} "
            f"micro-batches per optimizer step, this run has {W} x {grad_accum} = {new_m}: ")
    if old_m % W == 0:
        return hint + f"to resume it on {W} rank(s), set train.grad_accum={old_m // W}"
    return hint + f"{old_m} micro-batches do not split over {W} ranks: resume on a world size that divides {old_m}"


def choose_checkpoint(out_dir: Path, fingerprint: dict[str, Any], settings: dict[str, Any], extend: bool,
                      where: torch.device | str, train_cfg: TrainSection, total_steps: int, world_size: int,
                      lr: float) -> tuple[dict[str, Any] | None, Checkpoint | None]:
    """Rank 0: the checkpoint in out_dir/checkpoints to resume, the newest intact one (read to
    `where`), checked against this run: (what every rank needs of it, the checkpoint with its
    weights), or (None, None) without one. Raises ResumeError when its fingerprint differs
    (`extend`: a longer schedule may continue) and CorruptDataError when none is intact.
    `settings`: this run's resume_settings; `lr`: the optimizer's peak rate."""
    ckpt_dir = out_dir / CKPT_DIR
    ckpt, corrupt = newest_intact(ckpt_dir, where)
    aside = previous_dir(out_dir)
    for i, e in enumerate(corrupt):
        nxt = (f"trying {corrupt[i + 1].folder.name}" if i + 1 < len(corrupt)
               else f"resuming from {ckpt.folder.name}" if ckpt is not None else "no older checkpoint")
        log(f"[train] {e.message}; {nxt}")
    if ckpt is None:
        if not corrupt:
            return None, None
        raise CorruptDataError(
            f"train: no intact checkpoint in {ckpt_dir} ("
            + ", ".join(f"{e.folder.name}: {e.reason}" for e in corrupt[:4]) + (", ..." if len(corrupt) > 4 else "")
            + ")", fix=f"start fresh with `eaglet train CONFIG --force` (the old run is kept in {aside}/)")
    name, state = ckpt.folder.name, ckpt.state
    diff = fingerprint_diff(state["fingerprint"], fingerprint)
    other = {k: v for k, v in diff.items() if k not in EXTEND_KEYS}
    segments = state.get("schedule") or [{"start": 0, "total": total_steps}]
    old_total, step = segments[-1]["total"], ckpt.step
    where_from = f"train: checkpoint {name} in {ckpt_dir}"
    force = f"--force to start fresh (the old run is kept in {aside}/)"
    if other or (diff and not extend):
        if other:
            only = " (--extend allows only train.epochs and train.max_steps to change)"
            fix = f"rerun with {force}, or restore the settings" + (only if extend or diff != other else "")
        elif total_steps > old_total:
            fix = f"rerun with --extend to continue to the longer schedule, or {force}"
        else:
            fix = f"restore the settings, or rerun with {force}"
        raise ResumeError(f"{where_from} was made with other settings ({_changes(diff)})"
                          + _world_hint(state, fingerprint, world_size, train_cfg.grad_accum), fix=fix)
    extended = total_steps != old_total
    if extended:
        if not extend or total_steps < step or total_steps < old_total:
            raise ResumeError(f"{where_from} is of a run of {old_total} steps; train.epochs and train.max_steps "
                              f"give {total_steps} now",
                              fix=f"raise train.epochs or train.max_steps and rerun with --extend, or {force}")
        segments = extend_schedule(train_cfg, segments, step, total_steps)
        log(f"[train] --extend: {old_total} -> {total_steps} steps; from step {step} the learning rate "
            f"decays on from {lr * lr_lambda(train_cfg, old_total, segments)(step - 1):.3g}")
    old_settings = {"world_size": state.get("world_size", 1), **state.get("settings", {})}
    changed = {k: [old_settings[k], v] for k, v in settings.items() if k in old_settings and old_settings[k] != v}
    if changed:
        log("[train] resuming with changed settings that leave the trajectory as it was: "
            + _changes({k: tuple(v) for k, v in changed.items()}))
    chosen = {"name": name, "state": {k: v for k, v in state.items() if k != "fingerprint"}, "segments": segments,
              "extended": extended, "changed": changed,
              "corrupt": {e.folder.name: e.reason for e in corrupt}}
    return chosen, ckpt


def restore_schedule(sched: torch.optim.lr_scheduler.LambdaLR, optimizer: torch.optim.Optimizer,
                     train_cfg: TrainSection, total_steps: int, segments: list[dict[str, Any]], extended: bool) -> None:
    """Give a resumed scheduler its function of `segments` back (its state_dict drops it); when
    the schedule was `extended`, the next step's rate is the new schedule's (the optimizer state
    holds the old one's)."""
    sched.lr_lambdas[0] = lr_lambda(train_cfg, total_steps, segments)
    if extended:
        lrs = [base * sched.lr_lambdas[0](sched.last_epoch) for base in sched.base_lrs]
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        sched._last_lr = lrs
