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
wrapped by eaglet/parallel.py (`train.parallel`: ddp or fsdp). Every rank computes the same
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

import gc
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
from torch import nn

from .config import Config, TrainSection
from .loss import TTTLoss, active_rows, head_rows, simulated_acceptance_length, teacher_targets, ttt_loss
from .model import DraftConfig, Eagle3Draft, compile_flex_attention, resolve_attn_impl
from .parallel import (Parallel, all_gather_object, all_reduce_sum, barrier, dist_env, init_distributed, parallelize,
                       resolve_strategy)
from .pipeline import StageContext
from .extract import HEAD_FILE, TARGET_CONFIG, to_device
from .online import OnlineStates, is_online
from .optim import UnrollAdamW, attach_unroll_copies
from .store import CorruptShardError, StoreReader
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
    sample_ids: tuple[int, ...] = ()  # the packed samples, in order
    lens: tuple[int, ...] = ()  # their lengths (after the max_tokens cut)
    in_vocab: torch.Tensor | None = None  # [1, N] bool: the out-of-vocabulary mask's verdict, when known
    head_rows: tuple[torch.Tensor, ...] | None = None  # per TTT step, the rows the loss can count (loss.head_rows)
    active_rows: torch.Tensor | None = None  # the rows TTT steps 1.. run over (loss.active_rows)


def device_head_rows(loss_mask_BT: torch.Tensor, doc_ids_BT: torch.Tensor, num_steps: int, device: torch.device
                     ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """(`loss.head_rows`, `loss.active_rows`) of host tensors, made on the host and sent in one
    copy (pinned on a GPU)."""
    rows = head_rows(loss_mask_BT, doc_ids_BT, num_steps)
    rows.append(active_rows(rows))
    *sent, active = to_device(torch.cat(rows), device).split([len(r) for r in rows])
    return tuple(sent), active


class VocabMaskCache:
    """The out-of-vocabulary mask's verdict per sample (per token: is the target's
    full-vocabulary argmax a draft token), kept from the sample's first teacher pass on.

    The target's states, its head and the draft vocabulary do not change during a run, so
    neither does the verdict: a micro-batch whose samples are all known runs the teacher over
    the draft columns only (a quarter of the full-vocabulary product at the 8B dims, a fifth at
    Kimi-K2.5's; about 4% of the step). Verdicts come back from the device without the host
    waiting for it (a copy into pinned memory, taken once its event has passed); several
    ranks share theirs at the logging steps (`share`, a collective), so a sample that another
    rank saw is known here too. Held as bits: 125 MB of host memory per billion tokens. Not
    kept in checkpoints (a resumed run finds the verdicts again)."""

    def __init__(self, enabled: bool):
        self.enabled, self.sharing = enabled, dist_env().active
        self.known: dict[int, tuple[int, np.ndarray]] = {}  # sample id -> (tokens, bits)
        self.fresh: dict[int, tuple[int, np.ndarray]] = {}  # found here since the last share (several ranks)
        self.pending: list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor, torch.cuda.Event | None]] = []

    def lookup(self, b: Batch) -> torch.Tensor | None:
        """b's verdict [1, N] on b's device, if every sample of it is known."""
        self.poll()
        if not self.enabled or not b.sample_ids or any(i not in self.known for i in b.sample_ids):
            return None
        parts = []
        for i, n in zip(b.sample_ids, b.lens, strict=True):
            count, bits = self.known[i]
            if count != n:  # cut differently (another max_tokens): find it again
                return None
            parts.append(np.unpackbits(bits, count=n))
        return to_device(torch.from_numpy(np.concatenate(parts).astype(np.bool_)).unsqueeze(0), b.input_ids.device)

    def record(self, b: Batch, in_vocab: torch.Tensor | None) -> None:
        """Keep the verdict the teacher found for b (a device tensor [1, N]), once it is on the host."""
        if not self.enabled or in_vocab is None or b.in_vocab is not None or not b.sample_ids:
            return
        cuda = in_vocab.device.type == "cuda"
        host = torch.empty(in_vocab.shape[1], dtype=torch.bool, pin_memory=cuda)
        host.copy_(in_vocab[0], non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        self.pending.append((b.sample_ids, b.lens, host, event))

    def poll(self) -> None:
        """Take in the verdicts whose copies have finished (never waits)."""
        waiting = []
        for ids, lens, host, event in self.pending:
            if event is not None and not event.query():
                waiting.append((ids, lens, host, event))
                continue
            flags, at = host.numpy(), 0
            for i, n in zip(ids, lens, strict=True):
                self.known[i] = (n, np.packbits(flags[at:at + n]))
                if self.sharing:
                    self.fresh[i] = self.known[i]
                at += n
        self.pending = waiting

    def share(self) -> None:
        """Every rank's new verdicts to every rank (all ranks call it together)."""
        if not self.enabled or not self.sharing:
            return
        self.poll()
        for got in all_gather_object(self.fresh):
            self.known.update(got)
        self.fresh = {}


def load_batch(store: StoreReader | OnlineStates, ids: list[int], max_tokens: int, device: torch.device,
               ttt_steps: int = 0) -> Batch:
    """The samples `ids` packed into one micro-batch on `device`, each cut to max_tokens;
    ttt_steps > 0: with the rows each TTT step's loss can count (Batch.head_rows)."""
    if isinstance(store, OnlineStates):
        parts = store.get_many(ids, max_tokens)  # one forward of the target for the whole micro-batch
    else:
        parts = [store.get(i) for i in ids]
    cut = [{k: v[:max_tokens] for k, v in p.items()} for p in parts]
    lens = [int(p["input_ids"].shape[0]) for p in cut]

    def cat(pieces: list[torch.Tensor]) -> torch.Tensor:
        """[1, N]: host pieces concatenated straight into pinned memory when bound for a GPU
        (one host copy, then `to_device`); device pieces (online states) on their device."""
        if pieces[0].device.type != "cpu":
            return torch.cat(pieces).unsqueeze(0)
        shape = (sum(int(x.shape[0]) for x in pieces), *pieces[0].shape[1:])
        return torch.cat(pieces, out=torch.empty(shape, dtype=pieces[0].dtype, pin_memory=device.type == "cuda"))[None]

    def send(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        # Over the bus in the stored dtype (bf16 states: half the bytes of fp32), converted
        # on the device (the same values).
        t = to_device(t, device)
        return t.to(dtype) if dtype is not None else t

    def stored(key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return send(cat([p[key] for p in cut]), dtype)

    docs = cat([torch.full((n,), d) for d, n in enumerate(lens)])
    mask = cat([p["loss_mask"] for p in cut])
    rows, active = None, None
    if ttt_steps > 0:  # from the mask on the host: online states keep one (their device mask may only lose rows)
        host_mask = mask if mask.device.type == "cpu" else cat([p["loss_mask_host"] for p in cut])
        rows, active = device_head_rows(host_mask.bool(), docs, ttt_steps, device)
    return Batch(stored("aux", torch.float32), stored("final"), stored("input_ids", torch.int64), send(mask, torch.bool),
                 send(cat([torch.arange(n) for n in lens])), send(docs), sum(lens),
                 sample_ids=tuple(int(i) for i in ids), lens=tuple(lens), head_rows=rows,
                 active_rows=active)


# ---- the target's head and the draft -------------------------------------------------------------

@dataclass
class TargetHead:
    """The target's tensors that training uses. run_train hands them on and drops them here:
    `embed` is copied into the draft, `lm_head` and `norm` are taken over by the TeacherHead."""

    lm_head: torch.Tensor | None  # [V, H]
    norm: torch.Tensor | None  # final norm weight when the stored final state is pre-norm
    norm_eps: float
    embed: torch.Tensor | None  # [V, H], as the target's first layer receives it (embed_scale applied)
    logit_scale: float = 1.0  # the target's logits: softcap(lm_head(final) * logit_scale)
    logit_softcap: float | None = None


def load_head(store: StoreReader, device: torch.device) -> TargetHead:
    """The target's head; with the final norm when the store's final state is before it
    (store.json final_state "pre_norm", the vLLM backend), so the teacher's logits are the
    target's own either way."""
    t = load_file(str(store.folder / HEAD_FILE))
    final_state = store.meta.get("final_state", "post_norm")
    if final_state not in ("post_norm", "pre_norm"):
        raise ValueError(f"{store.folder}: store final_state {final_state!r} is neither 'post_norm' nor 'pre_norm'")
    pre_norm = final_state == "pre_norm"
    return TargetHead(
        lm_head=t["lm_head"].to(device),
        norm=t["norm"].to(device) if pre_norm else None,
        norm_eps=float(store.meta.get("norm_eps", 1e-6)),
        embed=t["embed_tokens"],
        logit_scale=float(store.meta.get("logit_scale") or 1.0),
        logit_softcap=store.meta.get("logit_softcap"),
    )


class TeacherHead(nn.Module):
    """The target's LM head (and final norm, for a pre-norm store) as a frozen module whose
    forward is `teacher_targets`: a module, so that parallelize can shard it like any other."""

    def __init__(self, head: TargetHead, chunk: int, mask_out_of_vocab: bool = True):
        super().__init__()
        self.full_vocab = mask_out_of_vocab  # the mask needs the full-vocabulary argmax
        self.lm_head = nn.Parameter(head.lm_head, requires_grad=False)
        self.norm = nn.Parameter(head.norm, requires_grad=False) if head.norm is not None else None
        self.norm_eps, self.chunk = head.norm_eps, chunk
        self.logit_scale, self.logit_softcap = head.logit_scale, head.logit_softcap

    @classmethod
    def for_training(cls, head: TargetHead, tc: TrainSection) -> TeacherHead:
        """The teacher as `train.*` sets it up (chunk, out-of-vocabulary mask)."""
        return cls(head, tc.teacher_chunk, tc.mask_out_of_vocab)

    def forward(self, final_BTH: torch.Tensor, t2d: torch.Tensor, d2t: torch.Tensor,
                in_vocab: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(teacher probs over the draft vocabulary [B,T,N], in_vocab [B,T]). in_vocab: the
        mask's verdict when it is known already (`VocabMaskCache`): the draft columns only."""
        probs, found = teacher_targets(final_BTH, self.lm_head, t2d, d2t, self.chunk, self.norm, self.norm_eps,
                                       self.logit_scale, self.logit_softcap,
                                       full_vocab=self.full_vocab and in_vocab is None)
        return probs, found if in_vocab is None else in_vocab


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


def trainable_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpointed weights: everything but the frozen, target-copied embedding."""
    return {k: v.detach().contiguous() for k, v in state.items() if k != "embed_tokens.weight"}


def save_checkpoint(folder: Path, step: int, model_state: dict[str, torch.Tensor], optim_state: dict[str, Any],
                    sched: torch.optim.lr_scheduler.LRScheduler, state: dict[str, Any], keep_last: int) -> Path:
    """Write checkpoint `step` atomically (a temporary folder renamed), keep the last `keep_last`.
    `model_state` and `optim_state` are full (unsharded): see Parallel.full_state."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step-{step:07d}"
    tmp = folder / f".tmp-step-{step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(trainable_state(model_state), str(tmp / "model.safetensors"))
    torch.save(optim_state, tmp / "optimizer.pt")
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


class Sums:
    """Per-step metric sums over micro-batches, kept as tensors (no host sync until `metrics`)."""

    def __init__(self) -> None:
        self.loss = self.total = self.correct = self.count = None
        self.n = 0
        self.tokens = 0

    def add(self, out, tokens: int = 0) -> None:
        vals = {"loss": torch.stack(out.losses).detach().float(), "total": out.total.detach().float(),
                "correct": torch.stack(out.correct), "count": torch.stack(out.counts)}
        for k, v in vals.items():
            old = getattr(self, k)
            setattr(self, k, v if old is None else old + v)
        self.n += 1
        self.tokens += tokens

    def all_reduce(self, num_steps: int, device: torch.device) -> None:
        """Sum over ranks (two collectives; a no-op alone). A rank without micro-batches adds zeros."""
        if not dist_env().active:
            return
        if self.loss is None:
            self.loss, self.total = torch.zeros(num_steps, device=device), torch.zeros((), device=device)
            self.correct = self.count = torch.zeros(num_steps, dtype=torch.int64, device=device)
        floats = all_reduce_sum(torch.cat([self.loss, self.total.reshape(1)]))
        ints = all_reduce_sum(torch.cat([self.correct, self.count,
                                         torch.tensor([self.n, self.tokens], device=self.correct.device)]))
        self.loss, self.total = floats[:num_steps], floats[num_steps]
        self.correct, self.count = ints[:num_steps], ints[num_steps:2 * num_steps]
        self.n, self.tokens = int(ints[-2]), int(ints[-1])

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


def resolve_compile(setting: str, device: torch.device) -> bool:
    """`train.compile` -> whether to compile ('auto': on CUDA, where it pays; on a CPU the
    compilation takes longer than a small run)."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"train.compile {setting!r}: expected auto, on or off")
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def forward_loss(par: Parallel, module: nn.Module, b: Batch, tc: TrainSection, autocast: torch.autocast) -> TTTLoss:
    """The teacher for micro-batch `b`, then the draft's TTT unroll (`module`: the training
    wrapper, or the bare draft for evaluation) and its loss."""
    teacher, in_vocab = par.teacher(b.final, par.draft.t2d, par.draft.d2t, in_vocab=b.in_vocab)
    with autocast:
        steps = module(b.aux, b.input_ids, b.position_ids, b.doc_ids, num_steps=tc.ttt_steps, attn_impl=tc.attn_impl,
                       head_rows=b.head_rows, active_rows=b.active_rows)
        return ttt_loss(steps, teacher, in_vocab, b.loss_mask, b.doc_ids, tc.gamma, compiled=par.compiled,
                        head_rows=b.head_rows)


def micro_batch(par: Parallel, b: Batch, tc: TrainSection, autocast: torch.autocast, sync: bool) -> TTTLoss:
    """Forward and backward of one micro-batch (loss / grad_accum); gradients are reduced
    across ranks only when `sync` (the step's last micro-batch)."""
    with par.grad_sync(sync):
        out = forward_loss(par, par.module, b, tc, autocast)
        (out.total / tc.grad_accum).backward()
    par.reshard_frozen()
    return out


def freeze_survivors() -> None:
    """Collect the garbage, then move every object that survives out of the collector's reach
    (gc.freeze). The first steps leave hundreds of thousands of long-lived objects (compiled
    graphs, guards, kernels); each full collection walks all of them, on the host, in the
    middle of a step: one took 392 ms at the 8B bench shape on the H200 (a 63 ms step),
    the GPU idle meanwhile, and under torchrun every rank waits for the one that collects.
    Later collections then walk only what was made since. The trainer calls this after the
    1st, 2nd, 4th, 8th, ... step it runs and after each evaluation (where new graphs appear),
    at the same points on every rank."""
    gc.collect()
    gc.freeze()


def clip_divisor(params: Iterator[nn.Parameter] | list[nn.Parameter], max_norm: float,
                 more: list[torch.Tensor] | None = None) -> torch.Tensor:
    """What dividing every gradient by clips them to total norm `max_norm`: clip_grad_norm_'s
    coefficient max_norm / (norm + 1e-6), capped at 1, inverted. A device tensor (no sync).
    more: gradients held outside .grad (UnrollAdamW's bf16 accumulators), their norms taken in fp32."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]).float()
    if more:
        norm = torch.linalg.vector_norm(torch.stack([norm, *torch._foreach_norm(more, 2, dtype=torch.float32)]))
    return ((norm + 1e-6) / max_norm).clamp(min=1.0)


def build_optimizer(model: Eagle3Draft, tc: TrainSection, strategy: str, device: torch.device, bf16: bool,
                    compiled: bool) -> torch.optim.Optimizer:
    """AdamW over the draft's trainable parameters (on the device, before any forward). One
    process, one micro-batch a step, bf16 and `train.unroll_optimizer`: UnrollAdamW, which reads
    the unroll's bf16 gradient accumulators and writes its bf16 weight copies (eaglet/optim.py);
    otherwise torch's, fused on the GPU."""
    params = [p for p in model.parameters() if p.requires_grad]
    adamw: dict[str, Any] = dict(lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay)
    if tc.unroll_optimizer and strategy == "none" and bf16 and tc.grad_accum == 1:
        return UnrollAdamW(params, attach_unroll_copies(model.unroll_linears()), compile=compiled, **adamw)
    return torch.optim.AdamW(params, fused=device.type == "cuda", **adamw)


def optimizer_step(par: Parallel, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
                   tc: TrainSection, clip_in_step: bool = True) -> float:
    """Clip, step, advance the schedule, zero the gradients; returns the learning rate used.

    With a fused optimizer (the GPU's AdamW) the clipping rides in the step: the fused kernel
    divides each gradient by its `grad_scale` (the hook GradScaler unscales through) as it
    reads it, so clipping costs the norm's one read of the gradients instead of another read
    and write of all of them. Not under FSDP2 (DTensor gradients, whose norm clip_grad_norm_
    reduces across ranks). clip_in_step False: clip_grad_norm_ first, always."""
    lr = sched.get_last_lr()[0]
    more = opt.accumulated_grads() if isinstance(opt, UnrollAdamW) else None  # gradients outside .grad
    if more is not None and tc.grad_clip > 0 and not clip_in_step:
        raise ValueError("UnrollAdamW clips in its step (its gradients are not .grad, which clip_grad_norm_ reads)")
    if tc.grad_clip > 0 and clip_in_step and opt.defaults.get("fused") and par.strategy != "fsdp":
        opt.grad_scale = clip_divisor(par.draft.parameters(), tc.grad_clip, more)
        try:
            opt.step()
        finally:
            del opt.grad_scale
    else:
        if tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(par.draft.parameters(), tc.grad_clip)
        opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return lr


class Trainer:
    def __init__(self, cfg: Config, store: StoreReader, model: Eagle3Draft, head: TargetHead, out_dir: Path):
        self.cfg, self.tc, self.store, self.out_dir = cfg, cfg.train, store, out_dir
        self.env = init_distributed(cfg.run.dist_timeout_minutes)
        self.device = resolve_device(self.tc.device)
        strategy = resolve_strategy(self.tc.parallel, self.env.world_size)
        # The pure draft; self.par.module is what the training forward calls (see parallel.py).
        self.par = parallelize(model, TeacherHead.for_training(head, self.tc), strategy, self.device,
                               frozen_dtype=head.lm_head.dtype, env=self.env,
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
        state = json.loads((last / "state.json").read_text())
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
            model_state = load_file(str(last / "model.safetensors"), device=str(where))
            optim_state = torch.load(last / "optimizer.pt", map_location=where, weights_only=True)
        self.par.load_full_state(self.opt, model_state, optim_state)
        self.sched.load_state_dict(state["scheduler"])
        self.sched.lr_lambdas[0] = lr_lambda(self.tc, self.total_steps)  # state_dict drops the function
        _set_rng_state(load_file(str(last / "rng.safetensors")))
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
        from tqdm import tqdm

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

def save_final(folder: Path, state: dict[str, torch.Tensor], draft_config: DraftConfig, store: StoreReader) -> None:
    """The trained draft as export reads it: draft_config.json + model.safetensors (all weights,
    the frozen embedding in fp32 like the rest, whatever dtype training kept it in)."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: (v.float() if k == "embed_tokens.weight" else v).detach().cpu().contiguous() for k, v in state.items()}
    save_file(state, str(tmp / "model.safetensors"))
    atomic_write_json(tmp / DRAFT_CONFIG, {"draft": draft_config.to_dict(), "aux_layers": store.layers})
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def load_final(folder: str | Path) -> tuple[Eagle3Draft, list[int]]:
    folder = Path(folder)
    meta = json.loads((folder / DRAFT_CONFIG).read_text())
    model = Eagle3Draft(DraftConfig(**meta["draft"]))
    model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    return model, meta["aux_layers"]


def open_store(folder: Path) -> StoreReader:
    """The store, its shards checked once: by the first read of each (one process), or up front
    with the shards split over the ranks (torchrun: every rank reads samples of every shard, so
    checking on first read would read the whole store once per rank)."""
    env = dist_env()
    if not env.active:
        return StoreReader(folder)
    store = StoreReader(folder, verify=False)
    bad = [b for part in all_gather_object(store.verify_all((env.rank, env.world_size))["bad"]) for b in part]
    if bad:
        raise CorruptShardError(f"store {folder}: {len(bad)} bad shards: "
                                + "; ".join(f"{b['file']}: {b['error']}" for b in bad[:5]))
    return store


def run_train(cfg: Config, ctx: StageContext) -> dict[str, Any]:
    env = init_distributed(cfg.run.dist_timeout_minutes)
    store = open_store(ctx.upstream["extract"])
    if is_online(store):  # the target runs here, beside the draft (eaglet/online.py)
        store = OnlineStates(store, ctx.upstream["prepare"], cfg.target)
    d2t, t2d = load_vocab(ctx.upstream["vocab"])
    device = resolve_device(cfg.train.device)
    head = load_head(store, device)
    model = build_draft(cfg, store, d2t, t2d, head)
    head.embed = None  # copied into the draft; the host copy is not needed any more
    fp = fingerprint(model, store, d2t, cfg, env.world_size)
    trainer = Trainer(cfg, store, model, head, ctx.out_dir)
    stats = trainer.run(fp)
    state = trainer.par.full_state()
    if env.is_main:
        save_final(ctx.out_dir / FINAL_DIR, state, model.config, store)
    barrier()
    stats["parameters_trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if isinstance(store, OnlineStates):
        stats["online_nonfinite_samples"] = store.nonfinite
    return stats
