"""The `train` stage: the EAGLE-3 draft with training-time test, over the extracted store.

    eaglet train CONFIG            # or as a stage of `eaglet run`

Inputs: the hidden-state store and target head (extract), the d2t/t2d maps (vocab).
Each micro-batch packs whole samples into one sequence of at most `train.max_tokens`
tokens (documents separated by doc ids, positions restarting per document). The teacher is
the target's LM head on the stored final state, restricted to the draft vocabulary.

Everything a resume needs is in a checkpoint folder written atomically every
`train.ckpt_every` steps: trainable weights, optimizer and scheduler state, the data
position and the RNG states. A killed run started again continues from the last
checkpoint and produces the same losses as an uninterrupted run. Checkpoints carry a
fingerprint of the model, data and vocabulary; a resume whose fingerprint differs is
refused with the keys that differ.

Outputs in the stage folder: `log.jsonl` (one line per logged step, eval lines with
"split": "eval"), TensorBoard events in `tb/`, `checkpoints/step-NNNNNNN/`, and
`final/` (draft config + weights) that export reads.

Under torchrun (`torchrun --nproc-per-node 8 -m eaglet.cli train CONFIG`) the draft is
wrapped by eaglet/draft/parallelize.py (`train.parallel`: ddp or fsdp). Every rank computes the same
epoch plan; an optimizer step takes grad_accum x W consecutive micro-batches of it, and
micro-batch j of the step goes to rank j % W. So W ranks with grad_accum A train exactly
what one process with grad_accum A x W trains: per micro-batch the loss is the mean over
its counted rows, and the step's gradient is the mean over the step's micro-batches
(each rank divides by A, the gradient reduction averages over W). Gradients are reduced
once per step, on the last micro-batch. Rank 0 logs and writes checkpoints; a checkpoint
resumes on any world size with the same micro-batches per step (grad_accum x W), and is
refused with the grad_accum to use otherwise.
"""

from __future__ import annotations

import hashlib
import json
import resource
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from tqdm import tqdm

from ..config import Config
from ..distributed import barrier, init_distributed, resolve_device
from ..draft.attention import compile_flex_attention, resolve_attn_impl
from ..draft.model import DraftConfig, Eagle3Draft
from ..draft.parallelize import parallelize, resolve_strategy
from ..draft.step import (Batch, Sums, TeacherHead, build_optimizer, forward_loss, freeze_survivors, lr_lambda,
                          micro_batch, optimizer_step, resolve_compile)
from ..formats.checkpoints import latest_checkpoint, read_state, read_weights, restore_rng, save_checkpoint
from ..formats.draft import FINAL_DIR, save_final
from ..formats.serving import load_draft
from ..formats.store import StoreReader, TargetHead, open_verified, read_target_config
from ..formats.vocab import load_vocab
from ..targets.families import text_config_from_dict
from ..utils import log
from .context import StageContext
from .online import OnlineStates, is_online
from .train_data import VocabMaskCache, epoch_plan, load_batch, pack, split_ids

CKPT_DIR = "checkpoints"


# ---- the draft and its teacher -------------------------------------------------------------------

def build_draft(cfg: Config, store: StoreReader, d2t: torch.Tensor, t2d: torch.Tensor, head: TargetHead) -> Eagle3Draft:
    tc = cfg.train
    if tc.init_from:
        dcfg, state, _meta = load_draft(tc.init_from)
        model = Eagle3Draft(dcfg)
        missing, unexpected = model.load_state_dict(state, strict=False)
        bad = [k for k in missing if k not in ("embed_tokens.weight", "d2t", "t2d")]
        if bad or unexpected:
            raise ValueError(f"train.init_from {tc.init_from}: missing {bad}, unexpected {list(unexpected)}")
        if not torch.equal(model.d2t, d2t):
            log(f"[train] init_from {tc.init_from}: its draft vocabulary differs from this run's; using this run's")
    else:
        hf = text_config_from_dict(read_target_config(store.folder))
        dcfg = DraftConfig.from_target_config(
            hf, draft_vocab_size=int(d2t.numel()), num_layers=tc.draft_layers, fc_norm=tc.fc_norm,
            norm_output=tc.norm_output, num_aux=store.n_aux,
        )
        torch.manual_seed(cfg.run.seed)
        model = Eagle3Draft(dcfg)
        model.reset_parameters()
        if tc.init_head_from_target:
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


# ---- what a checkpoint may be resumed with --------------------------------------------------------

def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def fingerprint(model: Eagle3Draft, store: StoreReader, d2t: torch.Tensor, cfg: Config,
                world_size: int = 1) -> dict[str, Any]:
    """What a checkpoint may only be resumed with: the model's shape, the data (and how it is
    cut into optimizer steps: micro-batches per step, not the world size), the vocabulary."""
    fp = {f"model.{k}": v for k, v in model.config.to_dict().items()}
    fp["data.store"] = store.meta.get("input_hash")
    fp["data.samples"] = len(store)
    fp["data.max_tokens"] = cfg.train.max_tokens
    fp["data.eval_fraction"] = cfg.train.eval_fraction
    fp["data.seed"] = cfg.run.seed
    fp["data.micro_batches_per_step"] = cfg.train.grad_accum * world_size
    fp["vocab.d2t"] = _digest(d2t)
    return fp


def fingerprint_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    if "data.grad_accum" in old:  # written before torchrun support, by one process
        old = {**old, "data.micro_batches_per_step": old["data.grad_accum"]}
        old.pop("data.grad_accum")
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


# ---- the loop -------------------------------------------------------------------------------------

class MetricLog:
    """log.jsonl (+ TensorBoard when installed)."""

    def __init__(self, folder: Path, resume_step: int, tensorboard: bool, enabled: bool = True):
        self.path = folder / "log.jsonl"
        self.enabled = enabled
        self.tb = None
        if not enabled:  # ranks other than 0
            return
        kept = []
        if resume_step and self.path.is_file():  # drop lines of steps the resume will redo
            kept = [ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln)["step"] <= resume_step]
        elif self.path.is_file():
            self.path.unlink()
        self.path.write_text("".join(ln + "\n" for ln in kept))
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(folder / "tb"), purge_step=resume_step + 1 if resume_step else None)
            except ImportError:
                log("[train] tensorboard not installed: logging to log.jsonl only")

    def write(self, rec: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            prefix = rec.get("split", "train")
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(f"{prefix}/{k}", v, rec["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class Trainer:
    def __init__(self, cfg: Config, store: StoreReader, model: Eagle3Draft, head: TargetHead, out_dir: Path):
        self.cfg, self.tc, self.store, self.out_dir = cfg, cfg.train, store, out_dir
        self.env = init_distributed(cfg.run.dist_timeout_minutes)
        self.device = resolve_device(self.tc.device)
        strategy = resolve_strategy(self.tc.parallel, self.env.world_size)
        # The pure draft; self.par.module is what the training forward calls (see eaglet/draft/parallelize.py).
        teacher = TeacherHead.from_head(head, self.tc.teacher_chunk, self.tc.mask_out_of_vocab)
        self.par = parallelize(model, teacher, strategy, self.device, frozen_dtype=head.lm_head.dtype, env=self.env,
                               compile=resolve_compile(self.tc.compile, self.device))
        head.lm_head = head.norm = None  # taken over by the teacher: under fsdp a full copy would stay alive
        self.model = model
        use_bf16 = self.tc.precision == "bf16" or (self.tc.precision == "auto" and self.device.type == "cuda")
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=use_bf16)
        self.lengths = dict(zip(store.sample_ids.tolist(), store.lengths.tolist()))
        self.train_ids, self.eval_ids = split_ids(store.sample_ids, self.tc.eval_fraction, cfg.run.seed)
        if len(self.train_ids) == 0:
            raise ValueError("train: no training samples (is the store empty, or train.eval_fraction 1?)")
        self.eval_ids = self.eval_ids[: self.tc.eval_max_samples]
        self.micro_per_step = self.tc.grad_accum * self.env.world_size
        batches = len(epoch_plan(self.train_ids, self.lengths, self.tc.max_tokens, cfg.run.seed, 0))
        self.steps_per_epoch = max(batches // self.micro_per_step, 1)
        total = self.steps_per_epoch * self.tc.epochs
        self.total_steps = min(total, self.tc.max_steps) if self.tc.max_steps else total
        if resolve_attn_impl(self.tc.attn_impl, self.device) == "flex":
            compile_flex_attention()  # flex_attention is only fast compiled (shapes vary: dynamic)
        self.opt = build_optimizer(self.model, self.tc, strategy, self.device, use_bf16, self.par.compiled)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(self.tc, self.total_steps))
        self.vocab_mask = VocabMaskCache(enabled=self.tc.mask_out_of_vocab)

    def _load(self, ids: list[int]) -> Batch:
        """Micro-batch `ids` on this rank's device, with its head rows and, when every sample
        of it was seen before, the out-of-vocabulary mask's verdict (`VocabMaskCache`)."""
        b = load_batch(self.store, ids, self.tc.max_tokens, self.device, self.tc.ttt_steps)
        b.in_vocab = self.vocab_mask.lookup(b)
        return b

    def micro_batches(self, epoch: int, start: int) -> Iterator[tuple[int, int, list[int]]]:
        """The global micro-batch stream (the same on every rank): (epoch, index in its plan, sample ids)."""
        while True:
            plan = epoch_plan(self.train_ids, self.lengths, self.tc.max_tokens, self.cfg.run.seed, epoch)
            # Packing another permutation can give a different number of micro-batches than
            # epoch 0's plan, from which steps_per_epoch was counted: never index past it.
            usable = min(self.steps_per_epoch * self.micro_per_step, len(plan))
            for i in range(start, usable):
                yield epoch, i, plan[i]
            epoch, start = epoch + 1, 0

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        """Held-out metrics; rank r evaluates micro-batches r, r+W, ... and the sums are reduced."""
        if len(self.eval_ids) == 0:
            return None
        self.model.eval()
        sums = Sums()
        batches = pack(self.eval_ids, self.lengths, self.tc.max_tokens)
        W, r = self.env.world_size, self.env.rank
        for first in range(0, len(batches), W):
            # Under fsdp every forward is a collective: a rank past the end repeats the last
            # batch without counting it, so all ranks run as many forwards.
            j = first + r
            b = self._load(batches[min(j, len(batches) - 1)])
            out = forward_loss(self.par, self.model, b, self.tc, self.autocast)
            self.vocab_mask.record(b, out.in_vocab)
            if j < len(batches):
                sums.add(out)
            self.par.reshard_frozen()
        self.model.train()
        sums.all_reduce(self.tc.ttt_steps, self.device)
        return sums.metrics()

    def _resume(self, last: Path, fp: dict[str, Any]) -> tuple[int, int, int]:
        """Load checkpoint `last` (refused when the fingerprint differs); returns (step, epoch, micro)."""
        state = read_state(last)
        diff = fingerprint_diff(state["fingerprint"], fp)
        if diff:
            raise RuntimeError(
                f"train: refusing to resume from {last}: the model, data or vocabulary changed:\n  "
                + "\n  ".join(diff) + self._world_hint(state, fp)
                + f"\nuse a new run.dir, or delete {last.parent} to start over"
            )
        main_only = self.par.strategy == "fsdp" and not self.env.is_main  # fsdp: rank 0 reads, the others receive
        model_state, optim_state = {}, {}
        if not main_only:
            where = "cpu" if self.par.strategy == "fsdp" else self.device
            model_state, optim_state = read_weights(last, where)
        self.par.load_full_state(self.opt, model_state, optim_state)
        self.sched.load_state_dict(state["scheduler"])
        self.sched.lr_lambdas[0] = lr_lambda(self.tc, self.total_steps)  # state_dict drops the function
        restore_rng(last)
        ws = state.get("world_size", 1)
        log(f"[train] resumed from {last} at step {state['step']}"
            + (f" (written by {ws} ranks, now {self.env.world_size})" if ws != self.env.world_size else ""))
        return state["step"], state["epoch"], state["micro"] - 1

    def _world_hint(self, state: dict[str, Any], fp: dict[str, Any]) -> str:
        old = state["fingerprint"]
        old_m = old.get("data.micro_batches_per_step", old.get("data.grad_accum"))
        new_m, W = fp["data.micro_batches_per_step"], self.env.world_size
        if old_m == new_m:
            return ""
        ws = state.get("world_size", 1)
        hint = (f"\nthe checkpoint was written by {ws} rank(s) x train.grad_accum {old_m // ws} = {old_m} micro-batches "
                f"per optimizer step; this run has {W} x {self.tc.grad_accum} = {new_m}. ")
        if old_m % W == 0:
            return hint + f"To resume it on {W} rank(s), set train.grad_accum={old_m // W}."
        return hint + f"{old_m} micro-batches do not split over {W} ranks: resume on a world size that divides {old_m}."

    def save(self, ckpt_dir: Path, step: int, state: dict[str, Any]) -> None:
        """A checkpoint, written by rank 0 (every rank gathers its part under fsdp)."""
        model_state, optim_state = self.par.full_state(), self.par.full_optimizer_state(self.opt)
        if self.env.is_main:
            save_checkpoint(ckpt_dir, step, model_state, optim_state, self.sched,
                            {**state, "world_size": self.env.world_size, "parallel": self.par.strategy},
                            self.tc.keep_last)
        barrier()

    def run(self, fp: dict[str, Any]) -> dict[str, Any]:
        tc, ckpt_dir, env = self.tc, self.out_dir / CKPT_DIR, self.env
        step, epoch, micro = 0, 0, -1
        last = latest_checkpoint(ckpt_dir)
        if last is not None:
            step, epoch, micro = self._resume(last, fp)
        first_step = step
        metrics = MetricLog(self.out_dir, step, tc.tensorboard, enabled=env.is_main)
        self.model.train()
        log(f"[train] {len(self.train_ids)} train / {len(self.eval_ids)} eval samples; {self.steps_per_epoch} steps "
            f"per epoch; {self.total_steps} steps; device {self.device}"
            + (f"; {self.par.strategy} over {env.world_size} ranks, {self.micro_per_step} micro-batches per step; "
               f"held per rank: {self.par.held_parameters()}" if env.active else ""))
        bar = tqdm(total=self.total_steps, initial=step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not env.is_main)
        sums = Sums()
        t_log = time.perf_counter()
        data = self.micro_batches(epoch, micro + 1)
        last_eval = None
        A, W = tc.grad_accum, env.world_size
        while step < self.total_steps:
            for a in range(A):
                # Micro-batch j of the step (j = a*W + rank) is this rank's: take W from the stream.
                share = [next(data) for _ in range(W)]
                epoch, micro, _ = share[-1]
                b = self._load(share[env.rank][2])
                out = micro_batch(self.par, b, tc, self.autocast, sync=a == A - 1)
                self.vocab_mask.record(b, out.in_vocab)
                sums.add(out, b.tokens)
            lr = optimizer_step(self.par, self.opt, self.sched, tc)
            step += 1
            bar.update(1)
            ran = step - first_step  # steps this process has run (a resumed run compiles again)
            if ran & (ran - 1) == 0:  # a power of two: the steps that compile, then ever more rarely
                freeze_survivors()
            if step % tc.log_every == 0 or step == self.total_steps:
                sums.all_reduce(tc.ttt_steps, self.device)
                self.vocab_mask.share()
                rec = sums.metrics()
                dt = time.perf_counter() - t_log
                rec.update(step=step, epoch=epoch, lr=lr, tokens_per_s=sums.tokens / dt,
                           memory_gib=_memory_gib(self.device))
                metrics.write({"split": "train", **rec})
                bar.set_postfix(loss=f"{rec['loss']:.3f}", acc0=f"{rec['acc_0']:.2f}", tau=f"{rec['sim_tau']:.2f}")
                sums, t_log = Sums(), time.perf_counter()
            if (tc.eval_every and step % tc.eval_every == 0) or step == self.total_steps:
                last_eval = self.evaluate()
                freeze_survivors()
                if last_eval is not None:
                    metrics.write({"split": "eval", "step": step, **last_eval})
            if step % tc.ckpt_every == 0 or step == self.total_steps:
                # The next micro-batch is plan[micro + 1] of `epoch` (or the next epoch's first).
                self.save(ckpt_dir, step, {"epoch": epoch, "micro": micro + 1, "fingerprint": fp})
        bar.close()
        metrics.close()
        return {"steps": step, "total_steps": self.total_steps, "eval": last_eval, "world_size": W,
                "parallel": self.par.strategy, "held_parameters_rank0": self.par.held_parameters()}


# ---- the stage ------------------------------------------------------------------------------------

def open_store(folder: Path) -> StoreReader:
    """The store, every shard checked before the first step, on threads and split over the ranks
    (formats.store.open_verified): a bad shard is named, with its repair command, before any step."""
    return open_verified(folder)


def run_train(cfg: Config, ctx: StageContext) -> dict[str, Any]:
    env = init_distributed(cfg.run.dist_timeout_minutes)
    store = open_store(ctx.upstream["extract"])
    if is_online(store):  # the target runs here, beside the draft (eaglet/stages/online.py)
        store = OnlineStates(store, ctx.upstream["prepare"], cfg.target)
    d2t, t2d = load_vocab(ctx.upstream["vocab"])
    device = resolve_device(cfg.train.device)
    head = store.target_head(device)
    model = build_draft(cfg, store, d2t, t2d, head)
    head.embed = None  # copied into the draft; the host copy is not needed any more
    fp = fingerprint(model, store, d2t, cfg, env.world_size)
    trainer = Trainer(cfg, store, model, head, ctx.out_dir)
    stats = trainer.run(fp)
    state = trainer.par.full_state()
    if env.is_main:
        save_final(ctx.out_dir / FINAL_DIR, state, model.config, store.layers)
    barrier()
    stats["parameters_trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if isinstance(store, OnlineStates):
        stats["online_nonfinite_samples"] = store.nonfinite
    return stats
