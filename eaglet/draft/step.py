"""One training step of the draft: the teacher, the draft type's forward and loss, the backward,
the optimizer step.

    micro_batch(parallel, batch, cfg, autocast, sync)   # forward + backward of one micro-batch
    optimizer_step(parallel, opt, sched, train_cfg, skipped)  # clip, step (skipped: non-finite), schedule, zero

The trainer (eaglet/training/loop.py) runs these over the epoch plan; the benchmarks
(bench/train_throughput.py, bench/scaling.py) run them over synthetic batches. A `Batch` is one
packed micro-batch on the device; `TeacherHead` is the target's LM head as a frozen module
(so that parallelize can shard it); `LossTotals` gathers a logging interval's metrics without a
host sync until they are printed. What is particular to a draft type (its forward, its loss,
the rows it prepares on the host) is its package's (`draft_type(cfg.train.algorithm)`).
"""

from __future__ import annotations

import gc
import math
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from ..config import Config, TrainSection
from ..distributed import all_reduce_sum, dist_env
from ..utils import to_device
from . import draft_type
from .loss import PositionLoss, simulated_acceptance_length, teacher_targets
from .optim import UnrollAdamW, attach_unroll_copies
from .parallelize import Parallel


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
    rows: dict[str, torch.Tensor] | None = None  # the draft type's host preparation (DraftType.host_rows), on the device


@dataclass
class HostRows:
    """A draft type's `host_rows` packed for the device: the tensors of each dtype flattened into
    one host tensor, so that they go over in one copy per dtype (`send_rows`)."""

    flat: dict[torch.dtype, Tensor]
    layout: list[tuple[str, torch.dtype, tuple[int, ...]]]  # (key, dtype, shape), in the dict's order

    @classmethod
    def pack(cls, rows: dict[str, Tensor] | None) -> HostRows | None:
        if rows is None:
            return None
        layout = [(key, t.dtype, tuple(t.shape)) for key, t in rows.items()]
        dtypes = list(dict.fromkeys(t.dtype for t in rows.values()))
        return cls({d: torch.cat([t.reshape(-1) for t in rows.values() if t.dtype == d]) for d in dtypes}, layout)


def send_rows(packed: HostRows | None, device: torch.device) -> dict[str, Tensor] | None:
    """`HostRows` on `device` (pinned on a GPU), one copy per dtype, as the dict the type made."""
    if packed is None:
        return None
    parts = {}
    for dtype, flat in packed.flat.items():
        shapes = [(key, shape) for key, d, shape in packed.layout if d == dtype]
        pieces = to_device(flat, device).split([math.prod(shape) for _, shape in shapes])
        parts.update({key: piece.view(shape) for (key, shape), piece in zip(shapes, pieces, strict=True)})
    return {key: parts[key] for key, _, _ in packed.layout}


class TeacherHead(nn.Module):
    """The target's LM head (and final norm, for a pre-norm store) as a frozen module whose
    forward is `teacher_targets`: a module, so that parallelize can shard it like any other."""

    def __init__(self, lm_head: Tensor, norm: Tensor | None = None, norm_eps: float = 1e-6, logit_scale: float = 1.0,
                 logit_softcap: float | None = None, chunk: int = 1024, mask_out_of_vocab: bool = True):
        """lm_head [V, H]; norm [H]: the final norm, for a teacher state stored before it (None:
        after it); logit_scale, logit_softcap: the target's own logits from its LM head's;
        chunk: positions per full-vocabulary chunk (train.teacher_chunk); mask_out_of_vocab:
        train.mask_out_of_vocab."""
        super().__init__()
        self.full_vocab = mask_out_of_vocab  # the mask needs the full-vocabulary argmax
        self.lm_head = nn.Parameter(lm_head, requires_grad=False)
        self.norm = nn.Parameter(norm, requires_grad=False) if norm is not None else None
        self.norm_eps, self.chunk = norm_eps, chunk
        self.logit_scale, self.logit_softcap = logit_scale, logit_softcap

    @classmethod
    def from_head(cls, head: Any, chunk: int = 1024, mask_out_of_vocab: bool = True) -> TeacherHead:
        """The teacher of the target's head as the store gives it (eaglet.formats.store.TargetHead:
        lm_head, norm, norm_eps, logit_scale, logit_softcap)."""
        return cls(head.lm_head, head.norm, head.norm_eps, head.logit_scale, head.logit_softcap, chunk,
                   mask_out_of_vocab)

    def forward(self, final_BTH: torch.Tensor, t2d: torch.Tensor, d2t: torch.Tensor,
                in_vocab: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(teacher probs over the draft vocabulary [B,T,N], in_vocab [B,T]). in_vocab: the
        mask's verdict when it is known already (`VocabMaskCache`): the draft columns only."""
        probs, found = teacher_targets(final_BTH, self.lm_head, t2d, d2t, self.chunk, self.norm, self.norm_eps,
                                       self.logit_scale, self.logit_softcap,
                                       full_vocab=self.full_vocab and in_vocab is None)
        return probs, found if in_vocab is None else in_vocab


def resolve_compile(setting: str, device: torch.device) -> bool:
    """`train.compile` -> whether to compile ('auto': on CUDA, where it pays; on a CPU the
    compilation takes longer than a small run)."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"train.compile {setting!r}: expected auto, on or off")
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def forward_loss(parallel: Parallel, module: nn.Module, b: Batch, cfg: Config, autocast: torch.autocast
                 ) -> PositionLoss:
    """The teacher for micro-batch `b`, then train.algorithm's forward and loss (`module`: the
    training wrapper, or the bare draft for evaluation). The draft in training mode
    (`draft.train()`) is trained: the type adds what only training adds (EAGLE-3: train.state_noise)."""
    teacher, in_vocab = parallel.teacher(b.final, parallel.draft.t2d, parallel.draft.d2t, in_vocab=b.in_vocab)
    with autocast:
        return draft_type(cfg.train.algorithm).loss(module, parallel.draft, b, teacher, in_vocab, cfg,
                                                    parallel.compiled)


def micro_batch(parallel: Parallel, b: Batch, cfg: Config, autocast: torch.autocast, sync: bool) -> PositionLoss:
    """Forward and backward of one micro-batch (loss / grad_accum); gradients are reduced
    across ranks only when `sync` (the step's last micro-batch)."""
    with parallel.grad_sync(sync):
        out = forward_loss(parallel, parallel.module, b, cfg, autocast)
        (out.total / cfg.train.grad_accum).backward()
    parallel.reshard_frozen()
    return out


def freeze_survivors() -> None:
    """Collect the garbage, then move every object that survives out of the collector's reach
    (gc.freeze). The first steps leave hundreds of thousands of long-lived objects (compiled
    graphs, guards, kernels); each full collection walks all of them, on the host, in the
    middle of a step, the GPU idle meanwhile (docs/performance.md, "Host time"), and under
    torchrun every rank waits for the one that collects.
    Later collections then walk only what was made since. The trainer calls this after the
    1st, 2nd, 4th, 8th, ... step it runs and after each evaluation (where new graphs appear),
    at the same points on every rank."""
    gc.collect()
    gc.freeze()


def grad_norm(params: Iterator[nn.Parameter] | list[nn.Parameter], more: list[torch.Tensor] | None = None
              ) -> torch.Tensor:
    """The total norm of the parameters' gradients, a device tensor (no sync). more: gradients
    held outside .grad (UnrollAdamW's bf16 accumulators), their norms taken in fp32."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]).float()
    if more:
        norm = torch.linalg.vector_norm(torch.stack([norm, *torch._foreach_norm(more, 2, dtype=torch.float32)]))
    return norm


def clip_divisor(params: Iterator[nn.Parameter] | list[nn.Parameter], max_norm: float,
                 more: list[torch.Tensor] | None = None, norm: torch.Tensor | None = None) -> torch.Tensor:
    """What dividing every gradient by clips them to total norm `max_norm`: clip_grad_norm_'s
    coefficient max_norm / (norm + 1e-6), capped at 1, inverted. A device tensor (no sync).
    more: as grad_norm's; norm: grad_norm's result, when taken already."""
    norm = grad_norm(params, more) if norm is None else norm
    return ((norm + 1e-6) / max_norm).clamp(min=1.0)


class SkippedSteps:
    """The optimizer steps skipped because their gradient norm was not finite, counted on the
    device: `flag` (in optimizer_step) adds a step without a host sync; `look` reads the counts
    (one sync: the trainer looks on logging steps and before checkpoints, where it syncs anyway).

    The flag is the total gradient norm's, after the gradients are reduced: the same on every
    rank (DDP's all-reduced gradients are the same bytes on each; FSDP2's norm is reduced over
    the shards), so every rank skips the same steps and the replicas never part. A non-finite
    loss gives a non-finite gradient; the loss itself is per rank, so it is not the flag.
    `run` counts the skipped steps in a row and `longest` the longest such run since the last
    look (`longest_end` its last step), so a run of skips between two looks is seen even if a
    good step ended it."""

    def __init__(self, device: torch.device, first_step: int = 1):
        z = lambda v=0: torch.full((), v, dtype=torch.int64, device=device)
        self.total, self.run, self.longest, self.longest_end, self.first = z(), z(), z(), z(-1), z(-1)
        self.step = first_step  # the number of the next step flagged (host)
        self.since = 0  # skipped steps counted by looks so far (host)

    def flag(self, norm: torch.Tensor) -> torch.Tensor:
        """The step's found_inf (float32 1.0 when `norm` is not finite, else 0.0; what torch's
        fused AdamW skips a step on), counted."""
        if hasattr(norm, "full_tensor"):  # a DTensor (fsdp): the norm over every rank's shards
            norm = norm.full_tensor()
        bad = ~torch.isfinite(norm.detach().float())
        n = bad.to(torch.int64)
        self.total += n
        self.run = (self.run + n) * n
        longer = bad & (self.run >= self.longest)
        self.longest = torch.where(longer, self.run, self.longest)
        self.longest_end = torch.where(longer, self.step, self.longest_end)
        self.first = torch.where(bad & (self.first < 0), self.step, self.first)
        self.step += 1
        return bad.float()

    def look(self) -> dict[str, int]:
        """{"total": skipped steps, "new": skipped since the last look, "run": skipped in a row
        now, "longest": the longest run in a row that reached past the last look, "from", "to":
        its first and last step, "first": the first step skipped since the last look (-1: none)}
        (one sync); the next look starts from here, the run in a row going on."""
        total, run, longest, end, first = torch.stack(
            [self.total, self.run, self.longest, self.longest_end, self.first]).tolist()
        new, self.since = total - self.since, total
        self.longest.copy_(self.run)
        self.longest_end.fill_(self.step - 1 if run else -1)
        self.first.fill_(-1)
        return {"total": total, "new": new, "run": run, "longest": longest, "from": end - longest + 1 if longest else -1,
                "to": end, "first": first}


AUTO_LR_WIDTH = 1.2e-3 * 576  # train.lr auto: the peak rate times the width, fixed where it was measured


def peak_lr(train_cfg: TrainSection, hidden_size: int) -> float:
    """train.lr as a number: auto is AUTO_LR_WIDTH / the draft's hidden size (1/width, as Adam's
    step on a wider layer moves its output more)."""
    return AUTO_LR_WIDTH / hidden_size if train_cfg.lr == "auto" else float(train_cfg.lr)


def build_optimizer(model: nn.Module, train_cfg: TrainSection, strategy: str, device: torch.device, bf16: bool,
                    compiled: bool, unroll_linears: list[nn.Module] | None = None) -> torch.optim.Optimizer:
    """AdamW over the draft's trainable parameters (on the device, before any forward). One
    process, one micro-batch a step, bf16, `train.unroll_optimizer` and a type with
    `unroll_linears` (DraftType.unroll_linears: the linears its unroll casts once per step):
    UnrollAdamW, which reads the unroll's bf16 gradient accumulators and writes its bf16 weight
    copies (eaglet/draft/optim.py); otherwise torch's, fused on the GPU."""
    params = [p for p in model.parameters() if p.requires_grad]
    adamw: dict[str, Any] = dict(lr=peak_lr(train_cfg, model.config.hidden_size), betas=tuple(train_cfg.betas),
                                 weight_decay=train_cfg.weight_decay)
    if (unroll_linears is not None and train_cfg.unroll_optimizer and strategy == "none" and bf16
            and train_cfg.grad_accum == 1):
        return UnrollAdamW(params, attach_unroll_copies(unroll_linears), compile=compiled, **adamw)
    return torch.optim.AdamW(params, fused=device.type == "cuda", **adamw)


def optimizer_step(parallel: Parallel, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
                   train_cfg: TrainSection, clip_in_step: bool = True, skipped: SkippedSteps | None = None) -> float:
    """Clip, step, advance the schedule, zero the gradients; returns the learning rate used.

    With a fused optimizer (the GPU's AdamW) the clipping rides in the step: the fused kernel
    divides each gradient by its `grad_scale` (the hook GradScaler unscales through) as it
    reads it, so clipping costs the norm's one read of the gradients instead of another read
    and write of all of them. Not under FSDP2 (DTensor gradients, whose norm clip_grad_norm_
    reduces across ranks). clip_in_step False: clip_grad_norm_ first, always.

    skipped: a step whose gradient norm is not finite leaves the weights and the optimizer's
    state (moments, step count) as they were, and is counted there (`SkippedSteps`); the
    schedule advances all the same (a skipped step is a step of the plan, its data used). A
    fused optimizer (torch's, UnrollAdamW) skips on the device through `found_inf`, no host
    sync; torch's unfused AdamW takes no found_inf and is built only off the GPU
    (build_optimizer), where reading the flag waits for nothing."""
    lr = sched.get_last_lr()[0]
    more = opt.accumulated_grads() if isinstance(opt, UnrollAdamW) else None  # gradients outside .grad
    if more is not None and train_cfg.grad_clip > 0 and not clip_in_step:
        raise ValueError("UnrollAdamW clips in its step (its gradients are not .grad, which clip_grad_norm_ reads)")
    fused = bool(opt.defaults.get("fused"))
    norm = None
    if train_cfg.grad_clip > 0 and clip_in_step and fused and parallel.strategy != "fsdp":
        norm = grad_norm(parallel.draft.parameters(), more)
        opt.grad_scale = clip_divisor(parallel.draft.parameters(), train_cfg.grad_clip, norm=norm)
    elif train_cfg.grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(parallel.draft.parameters(), train_cfg.grad_clip)
    elif skipped is not None:
        norm = grad_norm(parallel.draft.parameters(), more)
    found = skipped.flag(norm) if skipped is not None else None
    stepped = True
    try:
        if found is not None and fused:
            opt.found_inf = found
            opt.step()
        elif found is None or not bool(found):  # unfused: off the GPU, the flag read without a wait
            opt.step()
        else:
            stepped = False
    finally:
        opt.__dict__.pop("grad_scale", None)
        opt.__dict__.pop("found_inf", None)
    with warnings.catch_warnings():
        if not stepped:  # a first step skipped: the schedule's warning that opt.step() was never called
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
        sched.step()
    opt.zero_grad(set_to_none=True)
    return lr


def all_finite(parallel: Parallel) -> bool:
    """Whether every trained weight is finite, on every rank (its shards under fsdp; one
    all-reduce and one sync: the trainer asks before a checkpoint)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in parallel.draft.parameters() if p.requires_grad]
    bad = torch.stack([~torch.isfinite(p.detach()).all() for p in local]).sum().reshape(1)
    return int(all_reduce_sum(bad)) == 0


def lr_lambda(train_cfg: TrainSection, total_steps: int, segments: list[dict[str, Any]] | None = None):
    """The learning rate of step `step` (0-based) as a fraction of `train.lr`: linear warmup over
    `warmup_steps`, then cosine decay to `min_lr_ratio` at `total_steps`.

    `segments`: the schedule of a run lengthened by `eaglet train --extend` (kept in its
    checkpoints), in order: the first {"start": 0, "total": T0} is the schedule above for T0
    steps; each later {"start": S, "total": T, "from_ratio": r} holds from step S on, decaying
    with the same cosine from r, the ratio of step S-1 (the last one run before the extension),
    to min_lr_ratio at T: the steps already run keep their rate, and the rate never rises again.
    A segment without from_ratio (an extension before the warmup ended) is the first kind for T."""
    def base(step: int, total: int) -> float:
        if step < train_cfg.warmup_steps:
            return (step + 1) / train_cfg.warmup_steps
        span = max(total - train_cfg.warmup_steps, 1)
        progress = min((step - train_cfg.warmup_steps) / span, 1.0)
        return train_cfg.min_lr_ratio + (1 - train_cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    segs = segments or [{"start": 0, "total": total_steps}]

    def f(step: int) -> float:
        seg = next((s for s in reversed(segs) if s["start"] <= step), segs[0])
        if seg.get("from_ratio") is None:
            return base(step, seg["total"])
        before = seg["start"] - 1  # the step whose rate the segment starts from
        progress = min((step - before) / max(seg["total"] - before, 1), 1.0)
        floor = train_cfg.min_lr_ratio
        return floor + (seg["from_ratio"] - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def extend_schedule(train_cfg: TrainSection, segments: list[dict[str, Any]], step: int, total_steps: int
                    ) -> list[dict[str, Any]]:
    """`segments` (see lr_lambda) lengthened at `step` (the steps run so far) to `total_steps`."""
    if step <= train_cfg.warmup_steps:  # the decay has not begun: the schedule of the new total, as a fresh run has
        return [*segments, {"start": step, "total": total_steps}]
    ratio = lr_lambda(train_cfg, segments[-1]["total"], segments)(step - 1)
    return [*segments, {"start": step, "total": total_steps, "from_ratio": ratio}]


class LossTotals:
    """Per-position metric sums over micro-batches, kept as tensors (no host sync until `metrics`)."""

    def __init__(self) -> None:
        self.loss = self.total = self.correct = self.count = None
        self.accept: Tensor | None = None  # the acceptance term per step (train.accept_loss), when on
        self.n = 0
        self.tokens = 0

    def add(self, out, tokens: int = 0) -> None:
        vals = {"loss": torch.stack(out.losses).detach().float(), "total": out.total.detach().float(),
                "correct": torch.stack(out.correct), "count": torch.stack(out.counts)}
        if out.accept is not None:
            vals["accept"] = torch.stack(out.accept).detach().float()
        for k, v in vals.items():
            old = getattr(self, k)
            setattr(self, k, v if old is None else old + v)
        self.n += 1
        self.tokens += tokens

    def all_reduce(self, num_positions: int, device: torch.device, accept: bool = False) -> None:
        """Sum over ranks (two collectives; a no-op alone). A rank without micro-batches adds zeros.
        num_positions: the type's (DraftType.num_positions); accept: the acceptance term is on
        (every rank's sums then carry it)."""
        if not dist_env().active:
            return
        if self.loss is None:
            self.loss, self.total = torch.zeros(num_positions, device=device), torch.zeros((), device=device)
            self.correct = self.count = torch.zeros(num_positions, dtype=torch.int64, device=device)
            self.accept = torch.zeros(num_positions, device=device) if accept else None
        extra = [] if self.accept is None else [self.accept]
        floats = all_reduce_sum(torch.cat([self.loss, self.total.reshape(1), *extra]))
        ints = all_reduce_sum(torch.cat([self.correct, self.count,
                                         torch.tensor([self.n, self.tokens], device=self.correct.device)]))
        self.loss, self.total = floats[:num_positions], floats[num_positions]
        if self.accept is not None:
            self.accept = floats[num_positions + 1:]
        self.correct, self.count = ints[:num_positions], ints[num_positions:2 * num_positions]
        self.n, self.tokens = int(ints[-2]), int(ints[-1])

    def metrics(self) -> dict[str, float]:
        """Mean per-step losses over micro-batches, pooled accuracies, simulated tau (one sync)."""
        n = max(self.n, 1)
        losses = (self.loss / n).tolist()
        accs = (self.correct.double() / self.count.double().clamp(min=1)).tolist()
        out = {"loss": float(self.total) / n}
        out.update({f"loss_{j}": v for j, v in enumerate(losses)})
        out.update({f"acc_{j}": v for j, v in enumerate(accs)})
        if self.accept is not None:
            out.update({f"accept_term_{j}": v for j, v in enumerate((self.accept / n).tolist())})
        out["sim_tau"] = simulated_acceptance_length(accs)
        out["counted"] = int(self.count[0])
        return out
