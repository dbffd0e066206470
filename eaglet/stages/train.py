"""The `train` stage: the EAGLE-3 draft with training-time test, over the extracted store.

    eaglet train CONFIG            # or as a stage of `eaglet run`

Inputs: the hidden-state store and target head (extract), the d2t/t2d maps (vocab).
Each micro-batch packs whole samples into one sequence of at most `train.max_tokens`
tokens (documents separated by doc ids, positions restarting per document). The teacher is
the target's LM head on the stored final state, restricted to the draft vocabulary.

Everything a resume needs is in a checkpoint folder written atomically every
`train.ckpt_every` steps: trainable weights, optimizer and scheduler state, the data
position and the RNG states, with checksums (eaglet/formats/checkpoints.py). The loop waits
for a copy of them in host memory only, and a thread writes it while training goes on
(eaglet/training/checkpoint_writer.py, train.ckpt_async); the run ends, or fails, only once
the last is on disk. A killed run
started again continues from the newest intact checkpoint (a corrupt one is named and passed
over) and produces the same losses as an uninterrupted run. Checkpoints carry a fingerprint
of everything that sets the trajectory (the model, the data, the vocabulary, run.seed and
every train.* setting but RESUME_SAFE_KEYS); a resume whose fingerprint differs is refused
with the keys that differ (ResumeError). `--force` starts afresh, the old run moved to
`previous-N/`; `--extend` continues to a raised train.epochs or train.max_steps, the learning
rate decaying on from where it was (draft/step.py `lr_lambda`).

A step whose gradient norm is not finite is skipped (draft/step.py `optimizer_step`: the
weights and AdamW's state stay as they were; the schedule and the data go on), counted on the
device and read on logging steps and before each checkpoint; more than
`train.max_skipped_steps` in a row, or a weight that is not finite before a checkpoint, stop
training with a DivergedError (exit 7) naming the step and the likely cause, so neither a
checkpoint nor `final/` ever holds a non-finite weight.

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
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import torch
from tqdm import tqdm

from ..config import Config, TrainSection
from ..distributed import barrier, init_distributed, resolve_device, run_on_main
from ..draft.compiling import CompileWatch, use_compile_cache
from ..draft.model import DraftConfig, Eagle3Draft
from ..draft.parallelize import parallelize, resolve_strategy
from ..draft.step import (AUTO_LR_WIDTH, Batch, SkippedSteps, Sums, TeacherHead, all_finite, build_optimizer,
                          extend_schedule, forward_loss, freeze_survivors, lr_lambda, micro_batch, noisy_states,
                          optimizer_step, peak_lr, resolve_compile)
from ..errors import CorruptDataError, DivergedError, ResumeError
from ..formats.checkpoints import newest_intact, read_checkpoint, restore_rng, rng_state, save_checkpoint
from ..formats.draft import FINAL_DIR, save_final
from ..formats.pypi import default_cache
from ..formats.serving import load_draft
from ..formats.store import StoreReader, TargetHead, read_target_config
from ..formats.vocab import load_vocab
from ..targets.families import text_config_from_dict
from ..utils import atomic_write_text, log
from ..training.checkpoint_writer import CheckpointWriter, host_snapshot
from ..context import StageContext
from ..engines.hf.online import AheadStates, OnlineStates
from ..engines.vllm.stream import StreamedStates
from ..training.data import (Prefetch, VocabMaskCache, epoch_plan, open_states, pack, read_batch, send_batch,
                         split_ids)

CKPT_DIR = "checkpoints"
LOG_FILE = "log.jsonl"
TB_DIR = "tb"


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
        torch.manual_seed(train_seed(cfg))
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


# The train.* settings a resume may change. They set what is logged, evaluated and kept, or how
# the same sums are computed: the device, the parallel strategy, compilation, the attention
# kernel and the teacher's chunking each move the numbers by float rounding only (tests hold
# each to its reference), where every other setting changes the trajectory itself. The
# precision is compared as resolved (bf16 or fp32), since `auto` follows the device;
# train.grad_accum as micro-batches per step (grad_accum x world size), which is what it sets.
RESUME_SAFE_KEYS = ("log_every", "eval_every", "eval_max_samples", "ckpt_every", "keep_last", "tensorboard",
                    "device", "parallel", "compile", "compile_cache", "attn_impl", "teacher_chunk", "prefetch",
                    "ckpt_async", "max_skipped_steps")
# The trajectory settings `eaglet train --extend` may raise: a longer schedule (Trainer._pick).
EXTEND_KEYS = ("train.epochs", "train.max_steps")
# Fingerprint keys of checkpoints written before every trajectory setting was in the fingerprint.
_OLD_KEYS = {"data.grad_accum": "data.micro_batches_per_step", "data.max_tokens": "train.max_tokens",
             "data.eval_fraction": "train.eval_fraction", "data.seed": "run.seed"}

# Trajectory settings added since checkpoints held the train.* settings, with the value a
# checkpoint without them was trained with (so it resumes under the defaults).
_ADDED_KEYS = {"train.accept_loss": "none", "train.accept_weight": 1.0, "train.state_noise": 0.0, "train.seed": None}


def train_seed(cfg: Config) -> int:
    """The seed of the draft's initialisation, its micro-batch order and its noise: train.seed,
    else run.seed (which alone sets the held-out split)."""
    return cfg.run.seed if cfg.train.seed is None else cfg.train.seed


def uses_bf16(tc: TrainSection, device: torch.device) -> bool:
    return tc.precision == "bf16" or (tc.precision == "auto" and device.type == "cuda")


def _jsonable(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` as it reads back from state.json, so that a comparison with a checkpoint's holds."""
    return json.loads(json.dumps(obj, default=str))


def fingerprint(model: Eagle3Draft, store: StoreReader, d2t: torch.Tensor, cfg: Config,
                world_size: int = 1, device: torch.device | None = None) -> dict[str, Any]:
    """What a checkpoint may only be resumed with: the model's shape, the data (and how it is
    cut into optimizer steps: micro-batches per step, not the world size), the vocabulary,
    run.seed and every train.* setting but RESUME_SAFE_KEYS."""
    fp = {f"model.{k}": v for k, v in model.config.to_dict().items()}
    fp["data.store"] = store.meta.get("input_hash")
    fp["data.samples"] = len(store)
    fp["data.micro_batches_per_step"] = cfg.train.grad_accum * world_size
    fp["vocab.d2t"] = _digest(d2t)
    fp["run.seed"] = cfg.run.seed
    for k, v in cfg.section("train").items():
        if k not in RESUME_SAFE_KEYS and k != "grad_accum":
            fp[f"train.{k}"] = v
    fp["train.lr"] = peak_lr(cfg.train, model.config.hidden_size)  # auto as the number it is at this width
    fp["train.precision"] = "bf16" if uses_bf16(cfg.train, device or resolve_device(cfg.train.device)) else "fp32"
    return _jsonable(fp)


def resume_settings(cfg: Config, world_size: int = 1) -> dict[str, Any]:
    """The settings a resume may change (RESUME_SAFE_KEYS and the world size), recorded in each
    checkpoint so that a resume can say which changed."""
    train = cfg.section("train")
    return _jsonable({**{f"train.{k}": train[k] for k in RESUME_SAFE_KEYS}, "world_size": world_size})


def old_fingerprint(fp: dict[str, Any]) -> bool:
    """Whether `fp` was written before the fingerprint held the train.* settings."""
    return not any(k.startswith("train.") for k in fp)


def fingerprint_diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{key: (old, new)} of the keys whose values differ. An old fingerprint (`old_fingerprint`)
    is compared on the keys it has."""
    before = old_fingerprint(old)
    old = {**({} if before else _ADDED_KEYS), **{_OLD_KEYS.get(k, k): v for k, v in old.items()}}
    keys = set(old) if before else set(old) | set(new)
    return {k: (old.get(k), new.get(k)) for k in sorted(keys) if old.get(k) != new.get(k)}


def _changes(diff: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())


def previous_dir(out_dir: Path) -> Path:
    """Where `--force` keeps the run it replaces: <train>/previous-N, N one above any there."""
    taken = [int(p.name.split("-", 1)[1]) for p in out_dir.glob("previous-*") if p.name.split("-", 1)[1].isdigit()]
    return out_dir / f"previous-{max(taken, default=0) + 1}"


def set_aside(out_dir: Path) -> Path | None:
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


# ---- the loop -------------------------------------------------------------------------------------

class MetricLog:
    """log.jsonl (+ TensorBoard when installed). A resume keeps the lines of the steps up to the
    checkpoint's and drops, with a log line, those that do not parse (a kill mid-write)."""

    def __init__(self, folder: Path, resume_step: int, tensorboard: bool, enabled: bool = True):
        self.path = folder / LOG_FILE
        self.enabled = enabled
        self.tb = None
        self.kept: list[dict[str, Any]] = []
        if not enabled:  # ranks other than 0
            return
        kept: list[tuple[str, dict[str, Any]]] = []
        if resume_step and self.path.is_file():  # drop lines of steps the resume will redo
            kept, dropped = _log_lines(self.path.read_bytes(), resume_step)
            if dropped:  # a kill in the middle of a write: the checkpoint, not the log, is the state
                log(f"[train] {self.path}: dropped {dropped} line{'s' if dropped > 1 else ''} that do not parse (a "
                    "write cut short by a kill); their metrics are lost, the training state is the checkpoint's")
        elif self.path.is_file():
            self.path.unlink()
        atomic_write_text(self.path, "".join(ln + "\n" for ln, _ in kept), fsync=False)
        self.kept = [rec for _, rec in kept]
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(folder / TB_DIR), purge_step=resume_step + 1 if resume_step else None)
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


def _log_lines(data: bytes, upto: int) -> tuple[list[tuple[str, dict[str, Any]]], int]:
    """log.jsonl's records of steps up to `upto`, each with its line, and the number of lines
    dropped because they are not a record (cut short, or garbage)."""
    kept, dropped = [], 0
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            line = raw.decode()
            rec = json.loads(line)
            step = int(rec["step"])
        except (ValueError, KeyError, TypeError, IndexError, RecursionError):  # UnicodeDecodeError, JSONDecodeError too
            dropped += 1
            continue
        if step <= upto:
            kept.append((line, rec))
    return kept, dropped


def _memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def reads_ahead(store: Any, tc: TrainSection, device: torch.device) -> bool:
    """Whether a thread reads the store's micro-batches ahead (`Prefetch`): an offline store,
    train.prefetch > 0, training on a GPU. On a CPU the reads would share the cores with the
    step they should hide behind, and land in fresh pageable memory, which in a thread faults
    in page by page (bench/load_ahead.py: slower than reading in the loop on a 2-core VM)."""
    return isinstance(store, StoreReader) and tc.prefetch > 0 and device.type == "cuda"


BEHIND = 0.05  # share of a logging interval spent waiting for the stream that the log calls out


def _say_if_compiling(step: int, graphs: int, gave_up: int, warmed: bool, show: bool) -> None:
    """Log torch.compile's work past the warm-up: `graphs` made once `warmed` (after the first
    logging interval: shapes the compiled pieces had not met), and any function it gave up on
    (`gave_up`: eager from then on)."""
    if not show:
        return
    if gave_up:
        log(f"[train] step {step}: torch.compile reached its recompile limit for {gave_up} function(s) of the step, "
            "which run eager from now on (slower); TORCH_LOGS=recompiles names them and says why")
    elif warmed and graphs:
        log(f"[train] step {step}: torch.compile made {graphs} more graph(s) since the last log line, for shapes it "
            "had not met; TORCH_LOGS=recompiles says which")


def _say_if_behind(rec: dict[str, Any], seconds: float, show: bool) -> None:
    """Log that the engine fell behind when training waited for its states (a stream run's record)."""
    if show and seconds > 0 and rec.get("stream_wait_s", 0) > BEHIND * seconds:
        busy = max(seconds - rec["stream_wait_s"], 1e-9)  # training's own time: its rate were it never kept waiting
        log(f"[train] step {rec['step']}: the engine is behind: training waited {rec['stream_wait_s']:.1f} s of the "
            f"last {seconds:.1f} s for states; the engine computes {rec['engine_tokens_per_s']:.0f} tokens/s, "
            f"training could take {rec['tokens_per_s'] * seconds / busy:.0f} (raise the engine's share of the GPUs, "
            "or extract.stream_buffer_gb to ride out its pauses)")


class Trainer:
    def __init__(self, cfg: Config, store: StoreReader, model: Eagle3Draft, head: TargetHead, out_dir: Path):
        self.cfg, self.tc, self.store, self.out_dir = cfg, cfg.train, store, out_dir
        self.env = init_distributed(cfg.run.dist_timeout_minutes)
        self.device = resolve_device(self.tc.device)
        strategy = resolve_strategy(self.tc.parallel, self.env.world_size)
        # The pure draft; self.par.module is what the training forward calls (see eaglet/draft/parallelize.py).
        teacher = TeacherHead.from_head(head, self.tc.teacher_chunk, self.tc.mask_out_of_vocab)
        compiled = resolve_compile(self.tc.compile, self.device)
        if compiled:
            folder, warm = use_compile_cache(self.tc.compile_cache, default_cache() / "compile")
            if self.env.is_main:
                log(f"[train] compile cache: {folder} ({'holds earlier compiles' if warm else 'empty'})")
        self.par = parallelize(model, teacher, strategy, self.device, frozen_dtype=head.lm_head.dtype, env=self.env,
                               compile=compiled)
        head.lm_head = head.norm = None  # taken over by the teacher: under fsdp a full copy would stay alive
        self.model = model
        use_bf16 = uses_bf16(self.tc, self.device)
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=use_bf16)
        self.lengths = dict(zip(store.sample_ids.tolist(), store.lengths.tolist()))
        self.train_ids, self.eval_ids = split_ids(store.sample_ids, self.tc.eval_fraction, cfg.run.seed)
        if len(self.train_ids) == 0:
            raise ValueError("train: no training samples (is the store empty, or train.eval_fraction 1?)")
        self.eval_ids = self.eval_ids[: self.tc.eval_max_samples]
        self.held_out = pack(self.eval_ids, self.lengths, self.tc.max_tokens)  # every evaluation's micro-batches
        # States computed ahead of the loop, from the plan of its loads: a stream, or the target's own process
        self.stream = store if isinstance(store, (StreamedStates, AheadStates)) else None
        self.micro_per_step = self.tc.grad_accum * self.env.world_size
        batches = len(epoch_plan(self.train_ids, self.lengths, self.tc.max_tokens, train_seed(cfg), 0))
        self.steps_per_epoch = max(batches // self.micro_per_step, 1)
        total = self.steps_per_epoch * self.tc.epochs
        self.total_steps = min(total, self.tc.max_steps) if self.tc.max_steps else total
        self.opt = build_optimizer(self.model, self.tc, strategy, self.device, use_bf16, self.par.compiled)
        if self.tc.lr == "auto":  # build_optimizer resolved it from the draft's width
            log(f"[train] train.lr auto: {self.opt.defaults['lr']:.3g} for hidden size {model.config.hidden_size}")
        self.schedule: list[dict[str, Any]] = [{"start": 0, "total": self.total_steps}]  # lr_lambda's segments
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(self.tc, self.total_steps))
        self._picked = None  # rank 0: the checkpoint _pick chose, its weights read
        self.vocab_mask = VocabMaskCache(enabled=self.tc.mask_out_of_vocab)
        self.compile_watch = CompileWatch() if self.par.compiled else None
        # One micro-batch up to its copy to the device, as every load reads it (directly, or
        # through `prefetch`, run()'s reader ahead of an offline store on a GPU).
        self.read = partial(read_batch, store, max_tokens=self.tc.max_tokens, pin=self.device.type == "cuda",
                            ttt_steps=self.tc.ttt_steps)
        self.prefetch: Prefetch | None = None
        self.writer = CheckpointWriter(self.tc.ckpt_async and self.env.is_main)
        self.skipped: SkippedSteps | None = None  # the loop's count of steps skipped for a non-finite gradient

    def _load(self, ids: list[int]) -> Batch:
        """Micro-batch `ids` on this rank's device, with its head rows and, when every sample
        of it was seen before, the out-of-vocabulary mask's verdict (`VocabMaskCache`)."""
        b = send_batch(self.prefetch.take(ids) if self.prefetch is not None else self.read(ids), self.device)
        b.in_vocab = self.vocab_mask.lookup(b)
        return b

    def micro_batches(self, epoch: int, start: int) -> Iterator[tuple[int, int, list[int]]]:
        """The global micro-batch stream (the same on every rank): (epoch, index in its plan, sample ids)."""
        while True:
            plan = epoch_plan(self.train_ids, self.lengths, self.tc.max_tokens, train_seed(self.cfg), epoch)
            # Packing another permutation can give a different number of micro-batches than
            # epoch 0's plan, from which steps_per_epoch was counted: never index past it.
            usable = min(self.steps_per_epoch * self.micro_per_step, len(plan))
            for i in range(start, usable):
                yield epoch, i, plan[i]
            epoch, start = epoch + 1, 0

    def rank_steps(self, step: int, epoch: int, start: int) -> Iterator[tuple[int, list[tuple[int, int, list[int]]]]]:
        """The optimizer steps after `step` (the next micro-batch being plan[start] of `epoch`):
        (the step's number, this rank's grad_accum micro-batches as (epoch, index in its plan,
        sample ids)). Micro-batch j of a step (j = a*W + rank) is this rank's, and the epoch and
        index are those of the step's last micro-batch over all ranks: where a checkpoint after
        the step resumes."""
        data = self.micro_batches(epoch, start)
        W, r = self.env.world_size, self.env.rank
        while step < self.total_steps:
            mine = []
            for _ in range(self.tc.grad_accum):
                share = [next(data) for _ in range(W)]
                mine.append((share[-1][0], share[-1][1], share[r][2]))
            step += 1
            yield step, mine

    def eval_batches(self) -> list[list[int]]:
        """This rank's held-out micro-batches at an evaluation, in order: r, r+W, ..., the last
        repeated by a rank past the end (see `evaluate`)."""
        n, W, r = len(self.held_out), self.env.world_size, self.env.rank
        return [self.held_out[min(first + r, n - 1)] for first in range(0, n, W)]

    def evaluates_at(self, step: int) -> bool:
        return bool(self.tc.eval_every and step % self.tc.eval_every == 0) or step == self.total_steps

    def planned_loads(self, step: int, epoch: int, start: int) -> Iterator[list[int]]:
        """Every micro-batch this rank loads from `step` to the end, in the order `_loop` and
        `evaluate` load them (both follow rank_steps), made as they are asked for: what a stream
        computes ahead, and what Prefetch reads ahead."""
        for step, mine in self.rank_steps(step, epoch, start):
            yield from (ids for _, _, ids in mine)
            if self.evaluates_at(step):
                yield from self.eval_batches()

    def evaluate(self) -> dict[str, float] | None:
        """Held-out metrics; rank r evaluates micro-batches r, r+W, ... and the sums are reduced.

        Compiled, the forwards run with autograd on, as training's do, and nothing of their
        graph is kept (`Sums` detaches): torch.compile's graphs are guarded on the grad mode, so
        a no-grad evaluation compiled every piece again, forward only (30 s at the end of a
        SmolLM2-width run on the H200, a tenth of it). Eager, and under fsdp (whose forward
        with autograd on sets up its backward's resharding), they run without autograd."""
        if len(self.eval_ids) == 0:
            return None
        self.model.eval()
        sums = Sums()
        W, r = self.env.world_size, self.env.rank
        with torch.set_grad_enabled(self.par.compiled and self.par.strategy != "fsdp"):
            for k, ids in enumerate(self.eval_batches()):
                # Under fsdp every forward is a collective: a rank past the end repeats the last
                # batch without counting it, so all ranks run as many forwards.
                b = self._load(ids)
                out = forward_loss(self.par, self.model, b, self.tc, self.autocast)
                self.vocab_mask.record(b, out.in_vocab)
                if k * W + r < len(self.held_out):
                    sums.add(out)
                del out  # its autograd graph, when recorded
                self.par.reshard_frozen()
        self.model.train()
        sums.all_reduce(self.tc.ttt_steps, self.device, self.tc.accept_loss != "none")
        return sums.metrics()

    def _pick(self, ckpt_dir: Path, fp: dict[str, Any], settings: dict[str, Any], extend: bool,
              where: torch.device | str) -> dict[str, Any] | None:
        """Rank 0: the checkpoint to resume, the newest intact one, checked against this run (its
        weights stay in self._picked); what every rank needs of it, or None without one."""
        ckpt, corrupt = newest_intact(ckpt_dir, where)
        aside = previous_dir(self.out_dir)
        for i, e in enumerate(corrupt):
            nxt = (f"trying {corrupt[i + 1].folder.name}" if i + 1 < len(corrupt)
                   else f"resuming from {ckpt.folder.name}" if ckpt is not None else "no older checkpoint")
            log(f"[train] {e.message}; {nxt}")
        if ckpt is None:
            if not corrupt:
                return None
            raise CorruptDataError(
                f"train: no intact checkpoint in {ckpt_dir} ("
                + ", ".join(f"{e.folder.name}: {e.reason}" for e in corrupt[:4]) + (", ..." if len(corrupt) > 4 else "")
                + ")", fix=f"start fresh with `eaglet train CONFIG --force` (the old run is kept in {aside}/)")
        name, state = ckpt.folder.name, ckpt.state
        if not ckpt.verified:
            log(f"[train] warning: checkpoint {name} has no checksums (an older eaglet wrote it): resuming it "
                "unverified")
        if old_fingerprint(state["fingerprint"]):
            log(f"[train] warning: checkpoint {name} records only the model, data and vocabulary: the other train "
                "settings cannot be compared")
        diff = fingerprint_diff(state["fingerprint"], fp)
        other = {k: v for k, v in diff.items() if k not in EXTEND_KEYS}
        segments = state.get("schedule") or [{"start": 0, "total": self.total_steps}]
        old_total, step = segments[-1]["total"], ckpt.step
        where_from = f"train: checkpoint {name} in {ckpt_dir}"
        force = f"--force to start fresh (the old run is kept in {aside}/)"
        if other or (diff and not extend):
            if other:
                only = " (--extend allows only train.epochs and train.max_steps to change)"
                fix = f"rerun with {force}, or restore the settings" + (only if extend or diff != other else "")
            elif self.total_steps > old_total:
                fix = f"rerun with --extend to continue to the longer schedule, or {force}"
            else:
                fix = f"restore the settings, or rerun with {force}"
            raise ResumeError(f"{where_from} was made with other settings ({_changes(diff)})"
                              + self._world_hint(state, fp), fix=fix)
        extended = self.total_steps != old_total
        if extended:
            if not extend or self.total_steps < step or self.total_steps < old_total:
                raise ResumeError(f"{where_from} is of a run of {old_total} steps; train.epochs and train.max_steps "
                                  f"give {self.total_steps} now",
                                  fix=f"raise train.epochs or train.max_steps and rerun with --extend, or {force}")
            segments = extend_schedule(self.tc, segments, step, self.total_steps)
            log(f"[train] --extend: {old_total} -> {self.total_steps} steps; from step {step} the learning rate "
                f"decays on from {self.opt.defaults['lr'] * lr_lambda(self.tc, old_total, segments)(step - 1):.3g}")
        old_settings = {"world_size": state.get("world_size", 1), **state.get("settings", {})}
        changed = {k: [old_settings[k], v] for k, v in settings.items() if k in old_settings and old_settings[k] != v}
        if changed:
            log("[train] resuming with changed settings that leave the trajectory as it was: "
                + _changes({k: tuple(v) for k, v in changed.items()}))
        self._picked = ckpt
        return {"name": name, "state": {k: v for k, v in state.items() if k != "fingerprint"}, "segments": segments,
                "extended": extended, "changed": changed, "verified": ckpt.verified,
                "corrupt": {e.folder.name: e.reason for e in corrupt}}

    def _resume(self, ckpt_dir: Path, fp: dict[str, Any], settings: dict[str, Any], extend: bool
                ) -> dict[str, Any] | None:
        """Load the newest intact checkpoint in `ckpt_dir` (refused when the fingerprint differs,
        see _pick); returns what was resumed, with step, epoch and micro, or None without one."""
        where = "cpu" if self.par.strategy == "fsdp" else self.device
        picked = run_on_main(self._pick, ckpt_dir, fp, settings, extend, where)  # rank 0 reads and checks
        if picked is None:
            return None
        folder, state = ckpt_dir / picked["name"], picked["state"]
        model_state, optim_state = {}, {}  # fsdp: rank 0 reads, the others receive
        if self.env.is_main:
            model_state, optim_state = self._picked.model, self._picked.optimizer
            self._picked = None
        elif self.par.strategy != "fsdp":
            ckpt = read_checkpoint(folder, where, check=False)
            model_state, optim_state = ckpt.model, ckpt.optimizer
        self.par.load_full_state(self.opt, model_state, optim_state)
        del model_state, optim_state
        self.sched.load_state_dict(state["scheduler"])
        self.schedule = picked["segments"]
        self.sched.lr_lambdas[0] = lr_lambda(self.tc, self.total_steps, self.schedule)  # state_dict drops the function
        if picked["extended"]:  # the next step's rate by the new schedule (the optimizer state holds the old one's)
            lrs = [base * self.sched.lr_lambdas[0](self.sched.last_epoch) for base in self.sched.base_lrs]
            for group, lr in zip(self.opt.param_groups, lrs):
                group["lr"] = lr
            self.sched._last_lr = lrs
        restore_rng(folder)
        ws = state.get("world_size", 1)
        log(f"[train] resumed from {folder} at step {state['step']}"
            + (f" (written by {ws} ranks, now {self.env.world_size})" if ws != self.env.world_size else ""))
        return {"from_step": state["step"], "checkpoint": picked["name"], "epoch": state["epoch"],
                "micro": state["micro"] - 1, "changed": picked["changed"], "verified": picked["verified"],
                "corrupt": picked["corrupt"], "schedule": self.schedule}

    def _world_hint(self, state: dict[str, Any], fp: dict[str, Any]) -> str:
        old = state["fingerprint"]
        old_m = old.get("data.micro_batches_per_step", old.get("data.grad_accum"))
        new_m, W = fp["data.micro_batches_per_step"], self.env.world_size
        if old_m == new_m:
            return ""
        ws = state.get("world_size", 1)
        hint = (f"; the checkpoint was written by {ws} rank(s) x train.grad_accum {old_m // ws} = {old_m} "
                f"micro-batches per optimizer step, this run has {W} x {self.tc.grad_accum} = {new_m}: ")
        if old_m % W == 0:
            return hint + f"to resume it on {W} rank(s), set train.grad_accum={old_m // W}"
        return hint + f"{old_m} micro-batches do not split over {W} ranks: resume on a world size that divides {old_m}"

    def save(self, ckpt_dir: Path, step: int, state: dict[str, Any]) -> None:
        """A checkpoint of this step, written by rank 0 (every rank gathers its part under fsdp):
        behind the loop (self.writer.background) from copies that the next steps leave as they are."""
        run_on_main(self.writer.wait)  # the write before on disk first; its failure raised on every rank
        model_state, optim_state = self.par.full_state(frozen=False), self.par.full_optimizer_state(self.opt)
        if self.env.is_main:
            state = {**state, "world_size": self.env.world_size, "parallel": self.par.strategy}
            sched, rng = self.sched.state_dict(), rng_state()  # this step's, whenever the write runs
            if self.writer.background:  # copies the next steps leave as they are
                model_state, optim_state, sched, state = host_snapshot(self.model, self.opt, model_state, optim_state,
                                                                       sched, state)
            self.writer.submit(ckpt_dir / f"step-{step:07d}", partial(
                save_checkpoint, ckpt_dir, step, model_state, optim_state, sched, state, self.tc.keep_last, rng))
        barrier()

    def _loop(self, step: int, epoch: int, micro: int, first_step: int, metrics: MetricLog, bar: Any,
              fp: dict[str, Any], settings: dict[str, Any]) -> tuple[int, dict[str, float] | None]:
        """The optimizer steps from `step` to total_steps; returns (step, the last evaluation)."""
        tc, env, ckpt_dir = self.tc, self.env, self.out_dir / CKPT_DIR
        sums, t_log, last_eval = Sums(), time.perf_counter(), None
        self.skipped = SkippedSteps(self.device, step + 1)
        steps = self.rank_steps(step, epoch, micro + 1)
        for step, mine in steps:
            for a, (epoch, micro, ids) in enumerate(mine):  # the last one's epoch and micro: the checkpoint's
                b = self._load(ids)
                out = micro_batch(self.par, b, tc, self.autocast, sync=a == len(mine) - 1)
                self.vocab_mask.record(b, out.in_vocab)
                sums.add(out, b.tokens)
            lr = optimizer_step(self.par, self.opt, self.sched, tc, skipped=self.skipped)
            bar.update(1)
            ran = step - first_step  # steps this process has run (a resumed run compiles again)
            if ran & (ran - 1) == 0:  # a power of two: the steps that compile, then ever more rarely
                freeze_survivors()
            saves = step % tc.ckpt_every == 0 or step == self.total_steps
            if step % tc.log_every == 0 or step == self.total_steps:
                skipped = self._check_health(step, b, weights=saves)
                sums.all_reduce(tc.ttt_steps, self.device, tc.accept_loss != "none")
                self.vocab_mask.share()
                rec = sums.metrics()
                dt = time.perf_counter() - t_log
                rec.update(step=step, epoch=epoch, lr=lr, tokens=int(sums.tokens), tokens_per_s=sums.tokens / dt,
                           memory_gib=_memory_gib(self.device))
                if skipped["new"]:
                    rec["skipped_steps"] = skipped["new"]
                if self.stream is not None:
                    rec.update(self.stream.progress())
                    _say_if_behind(rec, dt, env.is_main)
                if self.compile_watch is not None:
                    rec["compile_graphs"], gave_up = self.compile_watch.since_last()
                    _say_if_compiling(step, rec["compile_graphs"], gave_up, warmed=ran > tc.log_every, show=env.is_main)
                metrics.write({"split": "train", **rec})
                bar.set_postfix(loss=f"{rec['loss']:.3f}", acc0=f"{rec['acc_0']:.2f}", tau=f"{rec['sim_tau']:.2f}")
                sums, t_log = Sums(), time.perf_counter()
            if self.evaluates_at(step):
                last_eval = self.evaluate()
                freeze_survivors()
                graphs = None
                if self.compile_watch is not None:  # evaluation runs training's graphs: none expected
                    graphs, gave_up = self.compile_watch.since_last()  # and the steps' since the last look
                    _say_if_compiling(step, graphs, gave_up, warmed=ran > tc.log_every, show=env.is_main)
                if last_eval is not None:
                    metrics.write({"split": "eval", "step": step, **last_eval,
                                   **({"compile_graphs": graphs} if graphs is not None else {})})
            if saves:
                if step % tc.log_every and step != self.total_steps:  # not looked at above
                    self._check_health(step, b, weights=True)
                # The next micro-batch is plan[micro + 1] of `epoch` (or the next epoch's first).
                self.save(ckpt_dir, step, {"epoch": epoch, "micro": micro + 1, "fingerprint": fp,
                                           "settings": settings, "schedule": self.schedule,
                                           "total_steps": self.total_steps})
        return step, last_eval

    def _check_health(self, step: int, b: Batch, weights: bool) -> dict[str, int]:
        """The steps skipped for a non-finite gradient norm since the last look (SkippedSteps.look:
        one sync, on a logging or checkpoint step); raises DivergedError when more than
        train.max_skipped_steps were skipped in a row, or, before a checkpoint (`weights`), when a
        trained weight is not finite, so that neither a checkpoint nor final/ ever holds one.
        Every rank decides alike: the counts are the same on each, the weight check all-reduced."""
        tc = self.tc
        seen = self.skipped.look()
        stop = seen["longest"] > tc.max_skipped_steps
        if seen["new"] and not stop and self.env.is_main:
            log(f"[train] step {step}: {seen['new']} step(s) skipped, the gradient norm not finite (the first at step "
                f"{seen['first']}; {seen['total']} skipped in this run; train.max_skipped_steps allows "
                f"{tc.max_skipped_steps} in a row); the logged loss counts them")
        if stop:
            cause, fix = self._likely_cause(b)
            raise DivergedError(
                f"train: the gradient norm was not finite at {seen['longest']} optimizer steps in a row, more than "
                f"train.max_skipped_steps {tc.max_skipped_steps} (steps {seen['from']} to {seen['to']}; stopped at "
                f"step {step}); likely cause: {cause}", fix=fix)
        if weights and not all_finite(self.par):
            cause, fix = self._likely_cause(b, weights_bad=True)
            raise DivergedError(f"train: a trained weight is not finite at step {step}, so no checkpoint of it is "
                                f"written; likely cause: {cause}", fix=fix)
        return seen

    def _likely_cause(self, b: Batch, weights_bad: bool | None = None) -> tuple[str, str]:
        """(what most likely made the gradient or a weight non-finite, how to fix it), from the
        weights and the last micro-batch `b`. Every rank calls it (the weight check is a collective)."""
        tc = self.tc
        lr = self.opt.defaults["lr"]
        auto = AUTO_LR_WIDTH / self.model.config.hidden_size
        kept = any((self.out_dir / CKPT_DIR).glob("step-*"))
        again = "then rerun train" + (" with --force (a changed setting refuses a resume of the checkpoints there)"
                                      if kept else "")
        lower_lr = (f"lower train.lr (now {lr:g}; auto gives {auto:.3g} at hidden size "
                    f"{self.model.config.hidden_size}) or raise train.warmup_steps (now {tc.warmup_steps}), {again}")
        if weights_bad if weights_bad is not None else not all_finite(self.par):
            return (f"the updates overflowed the weights (train.lr {lr:g}, train.weight_decay {tc.weight_decay:g})",
                    lower_lr)
        states = [name for name, t in (("captured", b.aux), ("final", b.final)) if not bool(torch.isfinite(t).all())]
        if states:
            return (f"the target's {' and '.join(states)} states of samples {list(b.sample_ids)[:8]} are not finite "
                    f"(the target overflows in target.dtype {self.cfg.target.dtype}?)",
                    "extract again with target.dtype bfloat16 or float32 (eaglet extract CONFIG --force), or leave "
                    "those records out of prepare.data")
        if tc.state_noise > 0 and (tc.state_noise > 1 or not bool(torch.isfinite(
                noisy_states(b.aux, self.model.config.num_aux, tc.state_noise)).all())):
            return (f"train.state_noise {tc.state_noise:g} (noise of {tc.state_noise:g} times each state's RMS)",
                    f"lower train.state_noise (a fraction of the RMS; docs/quality.md measured 0.05), {again}")
        return (f"the loss overflowed with finite weights and input states: the learning rate (train.lr {lr:g}) is too "
                "high for this draft", lower_lr)

    def run(self, fp: dict[str, Any], settings: dict[str, Any] | None = None, extend: bool = False) -> dict[str, Any]:
        """Train to `total_steps`, resuming from the newest intact checkpoint. `settings`: this
        run's resume_settings; `extend`: `eaglet train --extend` (a longer schedule may continue)."""
        tc, ckpt_dir, env = self.tc, self.out_dir / CKPT_DIR, self.env
        settings = settings if settings is not None else {}
        step, epoch, micro = 0, 0, -1
        resumed = self._resume(ckpt_dir, fp, settings, extend)
        if resumed is not None:
            step, epoch, micro = resumed["from_step"], resumed["epoch"], resumed.pop("micro")
            resumed.pop("epoch")
        first_step = step
        metrics = MetricLog(self.out_dir, step, tc.tensorboard, enabled=env.is_main)
        if resumed is not None and step >= self.total_steps:
            log(f"[train] {resumed['checkpoint']} is the end of the run ({step} of {self.total_steps} steps): nothing "
                "to train" + ("; writing the manifest again with the changed settings" if resumed["changed"] else ""))
        self.model.train()
        log(f"[train] {len(self.train_ids)} train / {len(self.eval_ids)} eval samples; {self.steps_per_epoch} steps "
            f"per epoch; {self.total_steps} steps; device {self.device}"
            + (f"; {self.par.strategy} over {env.world_size} ranks, {self.micro_per_step} micro-batches per step; "
               f"held per rank: {self.par.held_parameters()}" if env.active else ""))
        bar = tqdm(total=self.total_steps, initial=step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not env.is_main)
        stream = self.stream
        if stream is not None:  # the engine (or the target's process) starts computing this rank's micro-batches
            stream.start(list(self.planned_loads(step, epoch, micro + 1)), tc.max_tokens)
        elif reads_ahead(self.store, tc, self.device):  # a thread reads the store ahead
            self.prefetch = Prefetch(self.read, self.planned_loads(step, epoch, micro + 1), tc.prefetch, self.device)
        try:
            step, last_eval = self._loop(step, epoch, micro, first_step, metrics, bar, fp, settings)
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
            last_eval = next(({k: v for k, v in r.items() if k not in ("split", "step")} for r in reversed(metrics.kept)
                              if r.get("split") == "eval"), None)
        stats = {"steps": step, "total_steps": self.total_steps, "started_at_step": first_step, "steps_run": steps_run,
                 "eval": last_eval, "world_size": env.world_size, "parallel": self.par.strategy,
                 "held_parameters_rank0": self.par.held_parameters(),
                 "skipped_steps": self.skipped.since if self.skipped is not None else 0}
        if resumed is not None:
            stats["resumed"] = resumed
        if stream is not None:
            stats[stream.STATS_KEY] = stream.stats()
        return stats


# ---- the stage ------------------------------------------------------------------------------------

def run_train(cfg: Config, ctx: StageContext) -> dict[str, Any]:
    env = init_distributed(cfg.run.dist_timeout_minutes)
    if ctx.force:
        run_on_main(set_aside, ctx.out_dir)
    # every shard checked before the first step, on threads and split over the ranks: a bad one
    # is named, with its repair command, before any step
    store = open_states(cfg, ctx.upstream, ctx.out_dir, env.rank)
    d2t, t2d = load_vocab(ctx.upstream["vocab"])
    device = resolve_device(cfg.train.device)
    head = store.target_head(device)
    model = build_draft(cfg, store, d2t, t2d, head)
    head.embed = None  # copied into the draft; the host copy is not needed any more
    fp = fingerprint(model, store, d2t, cfg, env.world_size, device)
    trainer = Trainer(cfg, store, model, head, ctx.out_dir)
    stats = trainer.run(fp, resume_settings(cfg, env.world_size), extend=ctx.extend)
    state = trainer.par.full_state()
    if env.is_main:
        save_final(ctx.out_dir / FINAL_DIR, state, model.config, store.layers)
    barrier()
    stats["parameters_trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if isinstance(store, (OnlineStates, AheadStates)):
        stats["online_nonfinite_samples"] = store.nonfinite
    return stats
