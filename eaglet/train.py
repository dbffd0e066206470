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
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .config import Config, TrainSection
from .loss import simulated_acceptance_length, teacher_targets, ttt_loss
from .model import DraftConfig, Eagle3Draft, compile_flex_attention, resolve_attn_impl
from .pipeline import StageContext
from .extract import HEAD_FILE, TARGET_CONFIG
from .store import StoreReader
from .target import resolve_device
from .utils import atomic_write_json, fsync_dir, log
from .vocab import load_vocab

CKPT_DIR = "checkpoints"
FINAL_DIR = "final"
DRAFT_CONFIG = "draft_config.json"


# ---- data ---------------------------------------------------------------------------------------

def split_ids(sample_ids: np.ndarray, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train ids, eval ids): a fixed share held out, chosen by the seed, sorted."""
    perm = np.random.default_rng([seed, 7]).permutation(np.asarray(sample_ids, dtype=np.int64))
    n_eval = int(round(len(perm) * eval_fraction)) if eval_fraction > 0 else 0
    if eval_fraction > 0 and len(perm) > 1:
        n_eval = min(max(n_eval, 1), len(perm) - 1)
    return np.sort(perm[n_eval:]), np.sort(perm[:n_eval])


def pack(ids: np.ndarray, lengths: dict[int, int], max_tokens: int) -> list[list[int]]:
    """Greedy packing in the given order: consecutive samples share a micro-batch while they fit."""
    batches, cur, used = [], [], 0
    for i in ids.tolist():
        n = min(lengths[i], max_tokens)
        if cur and used + n > max_tokens:
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        batches.append(cur)
    return batches


def epoch_plan(train_ids: np.ndarray, lengths: dict[int, int], max_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    order = np.random.default_rng([seed, epoch]).permutation(train_ids)
    return pack(order, lengths, max_tokens)


@dataclass
class Batch:
    aux: torch.Tensor  # [1, N, A]
    final: torch.Tensor  # [1, N, H]
    input_ids: torch.Tensor  # [1, N] int64
    loss_mask: torch.Tensor  # [1, N] bool
    position_ids: torch.Tensor  # [1, N]
    doc_ids: torch.Tensor  # [1, N]
    tokens: int


def load_batch(store: StoreReader, ids: list[int], max_tokens: int, device: torch.device) -> Batch:
    parts = [store.get(i) for i in ids]
    cut = [{k: v[:max_tokens] for k, v in p.items()} for p in parts]
    lens = [int(p["input_ids"].shape[0]) for p in cut]
    pos = torch.cat([torch.arange(n) for n in lens])
    doc = torch.cat([torch.full((n,), d) for d, n in enumerate(lens)])

    def cat(key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = torch.cat([p[key] for p in cut])
        t = t.to(dtype) if dtype is not None else t
        return t.unsqueeze(0).to(device, non_blocking=True)

    return Batch(cat("aux", torch.float32), cat("final"), cat("input_ids", torch.int64), cat("loss_mask", torch.bool),
                 pos.unsqueeze(0).to(device), doc.unsqueeze(0).to(device), sum(lens))


# ---- the target's head and the draft -------------------------------------------------------------

@dataclass
class TargetHead:
    lm_head: torch.Tensor  # [V, H]
    norm: torch.Tensor | None  # final norm weight when the stored final state is pre-norm
    norm_eps: float
    embed: torch.Tensor  # [V, H], as the target's first layer receives it (embed_scale applied)
    logit_scale: float = 1.0  # the target's logits: softcap(lm_head(final) * logit_scale)
    logit_softcap: float | None = None


def load_head(store: StoreReader, device: torch.device) -> TargetHead:
    t = load_file(str(store.folder / HEAD_FILE))
    pre_norm = store.meta.get("final_state", "post_norm") == "pre_norm"
    return TargetHead(
        lm_head=t["lm_head"].to(device),
        norm=t["norm"].to(device) if pre_norm else None,
        norm_eps=float(store.meta.get("norm_eps", 1e-6)),
        embed=t["embed_tokens"],
        logit_scale=float(store.meta.get("logit_scale") or 1.0),
        logit_softcap=store.meta.get("logit_softcap"),
    )


def build_draft(cfg: Config, store: StoreReader, d2t: torch.Tensor, t2d: torch.Tensor, head: TargetHead) -> Eagle3Draft:
    tc = cfg.train
    if tc.init_from:
        from .export import load_draft

        dcfg, state, _meta = load_draft(tc.init_from)
        model = Eagle3Draft(dcfg)
        missing, unexpected = model.load_state_dict(state, strict=False)
        bad = [k for k in missing if k not in ("embed_tokens.weight", "d2t", "t2d")]
        if bad or unexpected:
            raise ValueError(f"train.init_from {tc.init_from}: missing {bad}, unexpected {list(unexpected)}")
        if not torch.equal(model.d2t, d2t):
            log(f"[train] init_from {tc.init_from}: its draft vocabulary differs from this run's; using this run's")
    else:
        from .families import text_config_from_dict

        hf = text_config_from_dict(json.loads((store.folder / TARGET_CONFIG).read_text()))
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


# ---- schedule, checkpoints ------------------------------------------------------------------------

def lr_lambda(tc: TrainSection, total_steps: int):
    def f(step: int) -> float:
        if step < tc.warmup_steps:
            return (step + 1) / tc.warmup_steps
        span = max(total_steps - tc.warmup_steps, 1)
        progress = min((step - tc.warmup_steps) / span, 1.0)
        return tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def fingerprint(model: Eagle3Draft, store: StoreReader, d2t: torch.Tensor, cfg: Config) -> dict[str, Any]:
    """What a checkpoint may only be resumed with: the model's shape, the data, the vocabulary."""
    fp = {f"model.{k}": v for k, v in model.config.to_dict().items()}
    fp["data.store"] = store.meta.get("input_hash")
    fp["data.samples"] = len(store)
    fp["data.max_tokens"] = cfg.train.max_tokens
    fp["data.eval_fraction"] = cfg.train.eval_fraction
    fp["data.seed"] = cfg.run.seed
    fp["data.grad_accum"] = cfg.train.grad_accum
    fp["vocab.d2t"] = _digest(d2t)
    return fp


def fingerprint_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


def _rng_state() -> dict[str, torch.Tensor]:
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"torch_cuda_{i}"] = s
    return out


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    if torch.cuda.is_available():
        cuda = [state[k] for k in sorted(state) if k.startswith("torch_cuda_")]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def trainable_state(model: Eagle3Draft) -> dict[str, torch.Tensor]:
    """The checkpointed weights: everything but the frozen, target-copied embedding."""
    return {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "embed_tokens.weight"}


def save_checkpoint(folder: Path, step: int, model: Eagle3Draft, opt: torch.optim.Optimizer,
                    sched: torch.optim.lr_scheduler.LRScheduler, state: dict[str, Any], keep_last: int) -> Path:
    """Write checkpoint `step` atomically (a temporary folder renamed), keep the last `keep_last`."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step-{step:07d}"
    tmp = folder / f".tmp-step-{step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(trainable_state(model), str(tmp / "model.safetensors"))
    torch.save(opt.state_dict(), tmp / "optimizer.pt")
    save_file(_rng_state(), str(tmp / "rng.safetensors"))
    atomic_write_json(tmp / "state.json", {**state, "step": step, "scheduler": sched.state_dict()})
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    fsync_dir(folder)
    for old in sorted(p for p in folder.glob("step-*") if p.is_dir())[:-keep_last or None]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(folder: Path) -> Path | None:
    done = sorted(p for p in folder.glob("step-*") if (p / "state.json").is_file())
    return done[-1] if done else None


# ---- the loop -------------------------------------------------------------------------------------

class MetricLog:
    """log.jsonl (+ TensorBoard when installed)."""

    def __init__(self, folder: Path, resume_step: int, tensorboard: bool):
        self.path = folder / "log.jsonl"
        kept = []
        if resume_step and self.path.is_file():  # drop lines of steps the resume will redo
            kept = [ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln)["step"] <= resume_step]
        elif self.path.is_file():
            self.path.unlink()
        self.path.write_text("".join(ln + "\n" for ln in kept))
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(folder / "tb"), purge_step=resume_step + 1 if resume_step else None)
            except ImportError:
                log("[train] tensorboard not installed: logging to log.jsonl only")

    def write(self, rec: dict[str, Any]) -> None:
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


class Sums:
    """Per-step metric sums over micro-batches, kept as tensors (no host sync until `metrics`)."""

    def __init__(self) -> None:
        self.loss = self.total = self.correct = self.count = None
        self.n = 0

    def add(self, out) -> None:
        vals = {"loss": torch.stack(out.losses).detach().float(), "total": out.total.detach().float(),
                "correct": torch.stack(out.correct), "count": torch.stack(out.counts)}
        for k, v in vals.items():
            old = getattr(self, k)
            setattr(self, k, v if old is None else old + v)
        self.n += 1

    def metrics(self) -> dict[str, float]:
        """Mean per-step losses over micro-batches, pooled accuracies, simulated tau (one sync)."""
        n = max(self.n, 1)
        losses = (self.loss / n).tolist()
        accs = (self.correct.double() / self.count.double().clamp(min=1)).tolist()
        out = {"loss": float(self.total) / n}
        out.update({f"loss_{j}": v for j, v in enumerate(losses)})
        out.update({f"acc_{j}": v for j, v in enumerate(accs)})
        out["sim_tau"] = simulated_acceptance_length(accs)
        out["counted"] = int(self.count[0])
        return out


class Trainer:
    def __init__(self, cfg: Config, store: StoreReader, model: Eagle3Draft, head: TargetHead, out_dir: Path):
        self.cfg, self.tc, self.store, self.head, self.out_dir = cfg, cfg.train, store, head, out_dir
        self.device = resolve_device(self.tc.device)
        self.model = model.to(self.device)
        self.model.embed_tokens.weight.requires_grad_(False)
        use_bf16 = self.tc.precision == "bf16" or (self.tc.precision == "auto" and self.device.type == "cuda")
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=use_bf16)
        self.lengths = dict(zip(store.sample_ids.tolist(), store.lengths.tolist()))
        self.train_ids, self.eval_ids = split_ids(store.sample_ids, self.tc.eval_fraction, cfg.run.seed)
        if len(self.train_ids) == 0:
            raise ValueError("train: no training samples (is the store empty, or train.eval_fraction 1?)")
        self.eval_ids = self.eval_ids[: self.tc.eval_max_samples]
        batches = len(epoch_plan(self.train_ids, self.lengths, self.tc.max_tokens, cfg.run.seed, 0))
        self.steps_per_epoch = max(batches // self.tc.grad_accum, 1)
        total = self.steps_per_epoch * self.tc.epochs
        self.total_steps = min(total, self.tc.max_steps) if self.tc.max_steps else total
        if resolve_attn_impl(self.tc.attn_impl, self.device) == "flex":
            compile_flex_attention()  # flex_attention is only fast compiled (shapes vary: dynamic)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=self.tc.lr, betas=tuple(self.tc.betas), weight_decay=self.tc.weight_decay,
                                     fused=self.device.type == "cuda")
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(self.tc, self.total_steps))

    def _forward(self, b: Batch):
        teacher, in_vocab = teacher_targets(b.final, self.head.lm_head, self.model.t2d, self.model.d2t,
                                            self.tc.teacher_chunk, self.head.norm, self.head.norm_eps,
                                            self.head.logit_scale, self.head.logit_softcap)
        with self.autocast:
            steps = self.model(b.aux, b.input_ids, b.position_ids, b.doc_ids, num_steps=self.tc.ttt_steps,
                               attn_impl=self.tc.attn_impl)
            return ttt_loss(steps, teacher, in_vocab, b.loss_mask, b.doc_ids, self.tc.gamma)

    def micro_batches(self, epoch: int, start: int) -> Iterator[tuple[int, int, list[int]]]:
        while True:
            plan = epoch_plan(self.train_ids, self.lengths, self.tc.max_tokens, self.cfg.run.seed, epoch)
            # Packing another permutation can give a different number of micro-batches than
            # epoch 0's plan, from which steps_per_epoch was counted: never index past it.
            usable = min(self.steps_per_epoch * self.tc.grad_accum, len(plan))
            for i in range(start, usable):
                yield epoch, i, plan[i]
            epoch, start = epoch + 1, 0

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        if len(self.eval_ids) == 0:
            return None
        self.model.eval()
        sums = Sums()
        for ids in pack(self.eval_ids, self.lengths, self.tc.max_tokens):
            sums.add(self._forward(load_batch(self.store, ids, self.tc.max_tokens, self.device)))
        self.model.train()
        return sums.metrics()

    def run(self, fp: dict[str, Any]) -> dict[str, Any]:
        tc, ckpt_dir = self.tc, self.out_dir / CKPT_DIR
        step, epoch, micro = 0, 0, -1
        last = latest_checkpoint(ckpt_dir)
        if last is not None:
            state = json.loads((last / "state.json").read_text())
            diff = fingerprint_diff(state["fingerprint"], fp)
            if diff:
                raise RuntimeError(
                    f"train: refusing to resume from {last}: the model, data or vocabulary changed:\n  "
                    + "\n  ".join(diff) + f"\nuse a new run.dir, or delete {ckpt_dir} to start over"
                )
            self.model.load_state_dict({**load_file(str(last / "model.safetensors"), device=str(self.device)),
                                        "embed_tokens.weight": self.model.embed_tokens.weight}, strict=True)
            self.opt.load_state_dict(torch.load(last / "optimizer.pt", map_location=self.device, weights_only=True))
            self.sched.load_state_dict(state["scheduler"])
            self.sched.lr_lambdas[0] = lr_lambda(tc, self.total_steps)  # state_dict drops the function
            _set_rng_state(load_file(str(last / "rng.safetensors")))
            step, epoch, micro = state["step"], state["epoch"], state["micro"] - 1
            log(f"[train] resumed from {last} at step {step}")
        metrics = MetricLog(self.out_dir, step, tc.tensorboard)
        self.model.train()
        log(f"[train] {len(self.train_ids)} train / {len(self.eval_ids)} eval samples; {self.steps_per_epoch} steps "
            f"per epoch; {self.total_steps} steps; device {self.device}")
        from tqdm import tqdm

        bar = tqdm(total=self.total_steps, initial=step, desc="train", unit="step", dynamic_ncols=True)
        sums = Sums()
        t_log, tokens = time.perf_counter(), 0
        data = self.micro_batches(epoch, micro + 1)
        last_eval = None
        while step < self.total_steps:
            for _ in range(tc.grad_accum):
                epoch, micro, ids = next(data)
                b = load_batch(self.store, ids, tc.max_tokens, self.device)
                out = self._forward(b)
                (out.total / tc.grad_accum).backward()
                sums.add(out)
                tokens += b.tokens
            if tc.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip)
            lr = self.sched.get_last_lr()[0]
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            step += 1
            bar.update(1)
            if step % tc.log_every == 0 or step == self.total_steps:
                rec = sums.metrics()
                dt = time.perf_counter() - t_log
                rec.update(step=step, epoch=epoch, lr=lr, tokens_per_s=tokens / dt, memory_gib=_memory_gib(self.device))
                metrics.write({"split": "train", **rec})
                bar.set_postfix(loss=f"{rec['loss']:.3f}", acc0=f"{rec['acc_0']:.2f}", tau=f"{rec['sim_tau']:.2f}")
                sums, t_log, tokens = Sums(), time.perf_counter(), 0
            if (tc.eval_every and step % tc.eval_every == 0) or step == self.total_steps:
                last_eval = self.evaluate()
                if last_eval is not None:
                    metrics.write({"split": "eval", "step": step, **last_eval})
            if step % tc.ckpt_every == 0 or step == self.total_steps:
                # The next micro-batch is plan[micro + 1] of `epoch` (or the next epoch's first).
                save_checkpoint(ckpt_dir, step, self.model, self.opt, self.sched,
                                {"epoch": epoch, "micro": micro + 1, "fingerprint": fp}, tc.keep_last)
        bar.close()
        metrics.close()
        return {"steps": step, "total_steps": self.total_steps, "eval": last_eval}


# ---- the stage ------------------------------------------------------------------------------------

def save_final(folder: Path, model: Eagle3Draft, store: StoreReader) -> None:
    """The trained draft as export reads it: draft_config.json + model.safetensors (all weights)."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp / "model.safetensors"))
    atomic_write_json(tmp / DRAFT_CONFIG, {"draft": model.config.to_dict(), "aux_layers": store.layers})
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def load_final(folder: str | Path) -> tuple[Eagle3Draft, list[int]]:
    folder = Path(folder)
    meta = json.loads((folder / DRAFT_CONFIG).read_text())
    model = Eagle3Draft(DraftConfig(**meta["draft"]))
    model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    return model, meta["aux_layers"]


def run_train(cfg: Config, ctx: StageContext) -> dict[str, Any]:
    store = StoreReader(ctx.upstream["extract"])
    d2t, t2d = load_vocab(ctx.upstream["vocab"])
    device = resolve_device(cfg.train.device)
    head = load_head(store, device)
    model = build_draft(cfg, store, d2t, t2d, head)
    fp = fingerprint(model, store, d2t, cfg)
    trainer = Trainer(cfg, store, model, head, ctx.out_dir)
    stats = trainer.run(fp)
    save_final(ctx.out_dir / FINAL_DIR, trainer.model, store)
    stats["parameters_trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return stats
