"""The training loop: micro-batches to optimizer steps, evaluations, health checks, checkpoints.

    trainer = Trainer(cfg, store, model, head, out_dir)
    stats = trainer.run(fingerprint, resume_settings(cfg, world_size), extend=False)

Every `train.ckpt_every` steps the loop waits for a copy of the state a resume needs in host
memory only, and a thread writes it while training goes on (checkpoint_writer.py,
train.ckpt_async); the run ends, or fails, only once the last is on disk. What may be resumed
is resume.py's to decide; health.py stops a run that diverged.

Under torchrun the draft is wrapped by eaglet/draft/parallelize.py (`train.parallel`: ddp or
fsdp) and each rank trains its share of every step (plan.py). Per micro-batch the loss is the
mean over its counted rows, and the step's gradient is the mean over the step's micro-batches
(each rank divides by grad_accum, the gradient reduction averages over the ranks), reduced once
per step, on the last micro-batch. Rank 0 logs and writes checkpoints.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from ..config import Config, TrainSection
from ..distributed import barrier, init_distributed, resolve_device, run_on_main
from ..draft import draft_type
from ..draft.compiling import CompileWatch, use_compile_cache
from ..draft.parallelize import parallelize, resolve_strategy
from ..draft.step import (Batch, LossTotals, SkippedSteps, TeacherHead, build_optimizer, forward_loss,
                          freeze_survivors, lr_lambda, micro_batch, optimizer_step, resolve_compile)
from ..formats.checkpoints import read_checkpoint, restore_rng, rng_state, save_checkpoint
from ..formats.pypi import default_cache
from ..engines.base import StateSource
from ..formats.store import TargetHead
from ..utils import log
from .build import uses_bf16
from .checkpoint_writer import CheckpointWriter, host_snapshot
from .data import Prefetch, VocabMaskCache, read_batch, send_batch
from .health import check_health
from .metrics import MetricLog, memory_gib, say_if_behind, say_if_compiling
from .plan import StepPlan
from .resume import CKPT_DIR, choose_checkpoint, restore_schedule


def reads_ahead(store: StateSource, train_cfg: TrainSection, device: torch.device) -> bool:
    """Whether a thread reads the store's micro-batches ahead (`Prefetch`): an offline store,
    train.prefetch > 0, training on a GPU. On a CPU the reads would share the cores with the
    step they should hide behind, and land in fresh pageable memory, which in a thread faults
    in page by page (docs/performance.md, "Reading ahead")."""
    return store.prefetchable and train_cfg.prefetch > 0 and device.type == "cuda"


class Trainer:
    def __init__(self, cfg: Config, store: StateSource, model: nn.Module, head: TargetHead, out_dir: Path):
        self.cfg, self.train_cfg, self.store, self.out_dir = cfg, cfg.train, store, out_dir
        train_cfg = self.train_cfg
        self.kind = draft_type(train_cfg.algorithm)  # the draft type: its forward, loss and host rows
        self.env = init_distributed(cfg.run.dist_timeout_minutes)
        self.device = resolve_device(train_cfg.device)
        strategy = resolve_strategy(train_cfg.parallel, self.env.world_size)
        # The pure draft; self.parallel.module is what the training forward calls (see eaglet/draft/parallelize.py).
        teacher = TeacherHead.from_head(head, train_cfg.teacher_chunk, train_cfg.mask_out_of_vocab)
        compiled = resolve_compile(train_cfg.compile, self.device)
        if compiled:
            folder, warm = use_compile_cache(train_cfg.compile_cache, default_cache() / "compile")
            if self.env.is_main:
                log(f"[train] compile cache: {folder} ({'holds earlier compiles' if warm else 'empty'})")
        self.parallel = parallelize(model, teacher, strategy, self.device, frozen_dtype=head.lm_head.dtype,
                                    env=self.env, compile=compiled, kind=self.kind)
        head.lm_head = head.norm = None  # taken over by the teacher: under fsdp a full copy would stay alive
        self.model = model
        use_bf16 = uses_bf16(train_cfg, self.device)
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=use_bf16)
        self.plan = StepPlan(cfg, store.sample_ids, store.lengths, self.env.world_size, self.env.rank)
        # States computed ahead of the loop, from the plan of its loads: a stream, or the target's own process
        self.stream = store if store.computes_ahead else None
        self.opt = build_optimizer(self.model, train_cfg, strategy, self.device, use_bf16, self.parallel.compiled,
                                   self.kind.unroll_linears(model))
        if train_cfg.lr == "auto":  # build_optimizer resolved it from the draft's width
            log(f"[train] train.lr auto: {self.opt.defaults['lr']:.3g} for hidden size {model.config.hidden_size}")
        self.schedule: list[dict[str, Any]] = [{"start": 0, "total": self.plan.total_steps}]  # lr_lambda's segments
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(train_cfg, self.plan.total_steps))
        self._chosen = None  # rank 0: the checkpoint _choose_checkpoint chose, its weights read
        self.vocab_mask = VocabMaskCache(enabled=train_cfg.mask_out_of_vocab)
        self.compile_watch = CompileWatch() if self.parallel.compiled else None
        # One micro-batch up to its copy to the device, as every load reads it (directly, or
        # through `prefetch`, run()'s reader ahead of an offline store on a GPU).
        self.read = partial(read_batch, store, max_tokens=train_cfg.max_tokens, pin=self.device.type == "cuda",
                            cfg=cfg, kind=self.kind)
        self.prefetch: Prefetch | None = None
        self.writer = CheckpointWriter(train_cfg.ckpt_async and self.env.is_main)
        self.skipped: SkippedSteps | None = None  # the loop's count of steps skipped for a non-finite gradient

    def _load(self, ids: list[int]) -> Batch:
        """Micro-batch `ids` on this rank's device, with its type's host rows and, when every sample
        of it was seen before, the out-of-vocabulary mask's verdict (`VocabMaskCache`)."""
        b = send_batch(self.prefetch.take(ids) if self.prefetch is not None else self.read(ids), self.device)
        b.in_vocab = self.vocab_mask.lookup(b)
        return b

    def evaluate(self) -> dict[str, float] | None:
        """Held-out metrics; rank r evaluates micro-batches r, r+W, ... and the sums are reduced.

        Compiled, the forwards run with autograd on, as training's do, and nothing of their
        graph is kept (`LossTotals` detaches): torch.compile's graphs are guarded on the grad
        mode, so a no-grad evaluation would compile every piece again, forward only
        (docs/performance.md measured what that cost). Eager, and under fsdp (whose forward
        with autograd on sets up its backward's resharding), they run without autograd."""
        if len(self.plan.eval_ids) == 0:
            return None
        self.model.eval()
        totals = LossTotals()
        W, r = self.env.world_size, self.env.rank
        with torch.set_grad_enabled(self.parallel.compiled and self.parallel.strategy != "fsdp"):
            for k, ids in enumerate(self.plan.eval_batches()):
                # Under fsdp every forward is a collective: a rank past the end repeats the last
                # batch without counting it, so all ranks run as many forwards.
                b = self._load(ids)
                out = forward_loss(self.parallel, self.model, b, self.cfg, self.autocast)
                self.vocab_mask.record(b, out.in_vocab)
                if k * W + r < len(self.plan.held_out):
                    totals.add(out)
                del out  # its autograd graph, when recorded
                self.parallel.reshard_frozen()
        self.model.train()
        totals.all_reduce(self.kind.num_positions(self.cfg), self.device, self.train_cfg.accept_loss != "none")
        return totals.metrics()

    def _choose_checkpoint(self, fingerprint: dict[str, Any], settings: dict[str, Any], extend: bool,
                           where: torch.device | str) -> dict[str, Any] | None:
        """Rank 0: resume.choose_checkpoint for this run; its weights stay in self._chosen."""
        chosen, self._chosen = choose_checkpoint(self.out_dir, fingerprint, settings, extend, where, self.train_cfg,
                                                 self.plan.total_steps, self.env.world_size, self.opt.defaults["lr"])
        return chosen

    def _resume(self, fingerprint: dict[str, Any], settings: dict[str, Any], extend: bool) -> dict[str, Any] | None:
        """Load the newest intact checkpoint (refused when the fingerprint differs, see
        resume.choose_checkpoint); returns what was resumed, with step, epoch and micro, or None without one."""
        where = "cpu" if self.parallel.strategy == "fsdp" else self.device
        chosen = run_on_main(self._choose_checkpoint, fingerprint, settings, extend, where)  # rank 0 reads and checks
        if chosen is None:
            return None
        folder, state = self.out_dir / CKPT_DIR / chosen["name"], chosen["state"]
        model_state, optim_state = {}, {}  # fsdp: rank 0 reads, the others receive
        if self.env.is_main:
            model_state, optim_state = self._chosen.model, self._chosen.optimizer
            self._chosen = None
        elif self.parallel.strategy != "fsdp":
            ckpt = read_checkpoint(folder, where, check=False)
            model_state, optim_state = ckpt.model, ckpt.optimizer
        self.parallel.load_full_state(self.opt, model_state, optim_state)
        del model_state, optim_state
        self.sched.load_state_dict(state["scheduler"])
        self.schedule = chosen["segments"]
        restore_schedule(self.sched, self.opt, self.train_cfg, self.plan.total_steps, self.schedule, chosen["extended"])
        restore_rng(folder)
        ws = state.get("world_size", 1)
        log(f"[train] resumed from {folder} at step {state['step']}"
            + (f" (written by {ws} ranks, now {self.env.world_size})" if ws != self.env.world_size else ""))
        return {"from_step": state["step"], "checkpoint": chosen["name"], "epoch": state["epoch"],
                "micro": state["micro"] - 1, "changed": chosen["changed"],
                "corrupt": chosen["corrupt"], "schedule": self.schedule}

    def save(self, ckpt_dir: Path, step: int, state: dict[str, Any]) -> None:
        """A checkpoint of this step, written by rank 0 (every rank gathers its part under fsdp):
        behind the loop (self.writer.background) from copies that the next steps leave as they are."""
        run_on_main(self.writer.wait)  # the write before on disk first; its failure raised on every rank
        model_state = self.parallel.full_state(frozen=False)
        optim_state = self.parallel.full_optimizer_state(self.opt)
        if self.env.is_main:
            state = {**state, "world_size": self.env.world_size, "parallel": self.parallel.strategy}
            sched, rng = self.sched.state_dict(), rng_state()  # this step's, whenever the write runs
            if self.writer.background:  # copies the next steps leave as they are
                model_state, optim_state, sched, state = host_snapshot(self.model, self.opt, model_state, optim_state,
                                                                       sched, state)
            self.writer.submit(ckpt_dir / f"step-{step:07d}", partial(
                save_checkpoint, ckpt_dir, step, model_state, optim_state, sched, state, self.train_cfg.keep_last, rng))
        barrier()

    def _health(self, step: int, b: Batch, weights: bool) -> dict[str, int]:
        return check_health(self.skipped, step, b, weights, self.parallel, self.opt, self.cfg, self.out_dir,
                            self.env.is_main)

    def _loop(self, step: int, epoch: int, micro: int, first_step: int, metrics: MetricLog, bar: Any,
              fingerprint: dict[str, Any], settings: dict[str, Any]) -> tuple[int, dict[str, float] | None]:
        """The optimizer steps from `step` to total_steps; returns (step, the last evaluation)."""
        train_cfg, env, ckpt_dir, total_steps = self.train_cfg, self.env, self.out_dir / CKPT_DIR, self.plan.total_steps
        totals, t_log, last_eval = LossTotals(), time.perf_counter(), None
        self.skipped = SkippedSteps(self.device, step + 1)
        for step, rank_loads in self.plan.rank_steps(step, epoch, micro + 1):
            for a, (epoch, micro, ids) in enumerate(rank_loads):  # the last one's epoch and micro: the checkpoint's
                b = self._load(ids)
                out = micro_batch(self.parallel, b, self.cfg, self.autocast, sync=a == len(rank_loads) - 1)
                self.vocab_mask.record(b, out.in_vocab)
                totals.add(out, b.tokens)
            lr = optimizer_step(self.parallel, self.opt, self.sched, train_cfg, skipped=self.skipped)
            bar.update(1)
            ran = step - first_step  # steps this process has run (a resumed run compiles again)
            if ran & (ran - 1) == 0:  # a power of two: the steps that compile, then ever more rarely
                freeze_survivors()
            saves = step % train_cfg.ckpt_every == 0 or step == total_steps
            if step % train_cfg.log_every == 0 or step == total_steps:
                skipped = self._health(step, b, weights=saves)
                totals.all_reduce(self.kind.num_positions(self.cfg), self.device, train_cfg.accept_loss != "none")
                self.vocab_mask.share()
                rec = totals.metrics()
                dt = time.perf_counter() - t_log
                rec.update(step=step, epoch=epoch, lr=lr, tokens=int(totals.tokens), tokens_per_s=totals.tokens / dt,
                           memory_gib=memory_gib(self.device))
                if skipped["new"]:
                    rec["skipped_steps"] = skipped["new"]
                if self.stream is not None:
                    rec.update(self.stream.progress())
                    say_if_behind(rec, dt, env.is_main)
                if self.compile_watch is not None:
                    rec["compile_graphs"], gave_up = self.compile_watch.since_last()
                    say_if_compiling(step, rec["compile_graphs"], gave_up, warmed=ran > train_cfg.log_every,
                                     show=env.is_main)
                metrics.write({"split": "train", **rec})
                bar.set_postfix(loss=f"{rec['loss']:.3f}", acc0=f"{rec['acc_0']:.2f}", tau=f"{rec['sim_tau']:.2f}")
                totals, t_log = LossTotals(), time.perf_counter()
            if self.plan.evaluates_at(step):
                last_eval = self.evaluate()
                freeze_survivors()
                graphs = None
                if self.compile_watch is not None:  # evaluation runs training's graphs: none expected
                    graphs, gave_up = self.compile_watch.since_last()  # and the steps' since the last look
                    say_if_compiling(step, graphs, gave_up, warmed=ran > train_cfg.log_every, show=env.is_main)
                if last_eval is not None:
                    metrics.write({"split": "eval", "step": step, **last_eval,
                                   **({"compile_graphs": graphs} if graphs is not None else {})})
            if saves:
                if step % train_cfg.log_every and step != total_steps:  # not looked at above
                    self._health(step, b, weights=True)
                # The next micro-batch is plan[micro + 1] of `epoch` (or the next epoch's first).
                self.save(ckpt_dir, step, {"epoch": epoch, "micro": micro + 1, "fingerprint": fingerprint,
                                           "settings": settings, "schedule": self.schedule,
                                           "total_steps": total_steps})
        return step, last_eval

    def run(self, fingerprint: dict[str, Any], settings: dict[str, Any] | None = None,
            extend: bool = False) -> dict[str, Any]:
        """Train to `total_steps`, resuming from the newest intact checkpoint. `settings`: this
        run's resume_settings; `extend`: `eaglet train --extend` (a longer schedule may continue)."""
        train_cfg, env, plan = self.train_cfg, self.env, self.plan
        settings = settings if settings is not None else {}
        step, epoch, micro = 0, 0, -1
        resumed = self._resume(fingerprint, settings, extend)
        if resumed is not None:
            step, epoch, micro = resumed["from_step"], resumed["epoch"], resumed.pop("micro")
            resumed.pop("epoch")
        first_step = step
        metrics = MetricLog(self.out_dir, step, train_cfg.tensorboard, enabled=env.is_main)
        if resumed is not None and step >= plan.total_steps:
            log(f"[train] {resumed['checkpoint']} is the end of the run ({step} of {plan.total_steps} steps): nothing "
                "to train" + ("; writing the manifest again with the changed settings" if resumed["changed"] else ""))
        self.model.train()
        log(f"[train] {len(plan.train_ids)} train / {len(plan.eval_ids)} eval samples; {plan.steps_per_epoch} steps "
            f"per epoch; {plan.total_steps} steps; device {self.device}"
            + (f"; {self.parallel.strategy} over {env.world_size} ranks, {plan.micro_per_step} micro-batches per "
               f"step; held per rank: {self.parallel.held_parameters()}" if env.active else ""))
        bar = tqdm(total=plan.total_steps, initial=step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not env.is_main)
        stream = self.stream
        if stream is not None:  # the engine (or the target's process) starts computing this rank's micro-batches
            stream.start(list(plan.planned_loads(step, epoch, micro + 1)), train_cfg.max_tokens)
        elif reads_ahead(self.store, train_cfg, self.device):  # a thread reads the store ahead
            self.prefetch = Prefetch(self.read, plan.planned_loads(step, epoch, micro + 1), train_cfg.prefetch,
                                     self.device)
        try:
            step, last_eval = self._loop(step, epoch, micro, first_step, metrics, bar, fingerprint, settings)
            run_on_main(self.writer.wait)  # the last checkpoint on disk before final/ and the manifest
        finally:  # the bar ends its line first: an error is one line of its own
            bar.close()
            if stream is not None:
                stream.close()
            if self.prefetch is not None:
                self.prefetch.close()
                self.prefetch = None
            self.writer.close()  # on an error's way out too: a write in flight finishes, never half done
        metrics.close()
        steps_run = step - first_step  # optimizer steps this process took
        if last_eval is None and steps_run == 0:  # a finished run resumed: its last evaluation, from the log
            last_eval = metrics.last_eval()
        stats = {"steps": step, "total_steps": plan.total_steps, "started_at_step": first_step, "steps_run": steps_run,
                 "eval": last_eval, "world_size": env.world_size, "parallel": self.parallel.strategy,
                 "held_parameters_rank0": self.parallel.held_parameters(),
                 "skipped_steps": self.skipped.since if self.skipped is not None else 0}
        if resumed is not None:
            stats["resumed"] = resumed
        if self.store.stats_key:
            stats[self.store.stats_key] = self.store.stats()
        return stats
