"""Training-step throughput of eaglet's draft, or of speculators' for comparison, on one GPU.

    python bench/train_throughput.py --preset llama3-8b --tokens 8192 --doc-tokens 2048 --out t.json
    python bench/train_throughput.py --preset llama3-8b --tokens 2048 --breakdown --profile
    python bench/train_throughput.py --system speculators --preset kimi-k2 --tokens 4096
    python bench/train_throughput.py --preset tiny --device cpu --steps 2 --warmup 1       # CPU smoke test
    python bench/train_throughput.py --preset kimi-k2 --tokens 4096 --draft-attention mla  # Kimi-K2.5's MLA draft

eaglet: its own step (`eaglet.draft.step.micro_batch` = `forward_loss` + backward, then
`optimizer_step`) on a draft built by `eaglet.draft.parallelize.parallelize` as the Trainer
builds it (bf16 autocast over fp32 weights on CUDA, frozen embedding and teacher head in bf16,
`train.compile` and `train.attn_impl` as given), on synthetic inputs of the real shapes
(eaglet.testing.synthetic's presets and batches): random captured states and tokens, `--tokens`
per micro-batch made of documents of `--doc-tokens`, a random target head for the teacher.
speculators (`--system speculators`, needs the speculators 0.9.0 package): the step of
../shared/anchors/speculators_train_step.py (its Eagle3DraftModel forward with its TTT loop,
flex attention and loss, backward, clip, fused AdamW, bf16 autocast over fp32 weights),
built the same way at the same preset's shapes, in the same timing harness.

Timing: `--warmup` untimed steps (compilation happens there), then `--steps` timed ones
between two device synchronisations; nothing in a step waits for the device. Peak memory:
torch.cuda.max_memory_allocated over the timed steps.

FLOPs: the anchor script's `train_flops_per_token` (copied verbatim below; the figures are
comparable with its MFU): 6 x fc + k x 6 x (q, k, v, o, MLP, lm_head and causal attention
within a document) + 2 x H x draft_vocab for the teacher, in multiply-accumulates x 2.
It counts the teacher over the draft vocabulary only, as speculators computes it; eaglet's
teacher takes the full-vocabulary argmax (to mask rows whose target token is not a draft
token), 2 x H x (V - draft_vocab) more per token: reported as `gflop_per_token_full_teacher`,
not in the MFU. MFU = tokens/s x FLOPs per token / `--peak` (790 TFLOP/s: the bf16 matrix
rate measured on the H200s lent here).

--breakdown (eaglet): CUDA events around the phases of every timed step, averaged: teacher,
each TTT step's forward, each step's loss, backward, optimizer. Events do not synchronise.
--profile: torch.profiler over `--profile-steps` more steps; the top kernels by device time
are printed and saved in the JSON (`--trace FILE` also writes the Chrome trace).
--packed N (eaglet): N different micro-batches cycled, each of documents of varying lengths
around `--doc-tokens` packed into at most `--tokens` (eaglet.testing.synthetic.packed_doc_lens),
as real data gives: the warm-up then pays for every recompile real training meets. Each warm-up
step is timed (`warmup_step_s`), tokens/s counts the tokens present, and `graphs_in_timed_steps`
(dynamo's graph count over the timed steps) shows whether the warm-up made them all.
--dynamic (eaglet): how the compiled pieces meet sizes that follow the data. `marked`, eaglet's
setting: each piece's data dims symbolic from its first compile, the model's sizes fixed
(eaglet.draft.compiling.MARK_DATA_DIMS); `auto`: torch.compile's default, sizes symbolic once
they change (a second compile); `on`: dynamic=True, every size symbolic from the first compile.
--check (eaglet with compile on): the first step's losses against an eager copy of the draft.
--flops-only: the preset's FLOP figures alone, and every real preset's at 2048 and 4096 (nothing
built, nothing run).
--draft-attention mla (eaglet): the preset's draft with an MLA layer (train.draft_attention mla;
eaglet.testing.synthetic.draft_shape: an MLA target's own sizes, Kimi-K2.5's for kimi-k2, else
the default rule). Its FLOPs are `mla_flops_per_token` (the anchor formula's terms from the MLA
draft's own linears and heads), not the anchor's, so its MFU compares with the dense draft's.
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import json
import math
import platform
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch._dynamo.utils import counters

from eaglet.checks.sizing import draft_train_flops
from eaglet.config import Config, TrainSection
from eaglet.draft import compiling
from eaglet.draft.eagle3.attention import compile_flex_attention, resolve_attn_impl
from eaglet.draft.loss import compile_soft_ce
from eaglet.draft.eagle3.model import DraftConfig, Eagle3Draft
from eaglet.draft.parallelize import Parallel, parallelize
from eaglet.draft.step import (SkippedSteps, TeacherHead, build_optimizer, forward_loss, freeze_survivors, lr_lambda,
                               micro_batch, optimizer_step, resolve_compile)
from eaglet.draft.eagle3.training import ACTIVE_ROWS, HEAD_ROWS
from eaglet.draft.eagle3.unroll import unroll_linears, use_fast_unroll
from eaglet.testing.synthetic import (IN_VOCAB, LOSS_SHARE, PRESETS, draft_shape, packed_doc_lens,
                                      synthetic_batch, synthetic_loss_mask)

H200_BF16_PEAK = 790e12


def train_flops_per_token(d: dict[str, int], seq: int, k: int) -> float:
    """Verbatim from ../shared/anchors/speculators_train_step.py (keys: hidden, heads, kv,
    inter, draft_vocab; seq: tokens per document)."""
    H, I, Vd = d["hidden"], d["inter"], d["draft_vocab"]
    kvd = H // d["heads"] * d["kv"]
    fc = 3 * H * H
    step = 2 * H * H + 2 * (2 * H * kvd) + H * H + 3 * H * I + H * Vd  # q,k,v,o,mlp,lm_head MACs
    attn = seq / 2 * H * 2  # causal QK^T + AV MACs per token (diagonal extras ignored)
    teacher = H * Vd  # speculators' teacher covers draft-vocab rows only
    return 6 * fc + k * (6 * step + 6 * attn) + 2 * teacher


def mla_flops_per_token(shape: dict[str, Any], seq: int, k: int) -> float:
    """The anchor formula's terms for an MLA draft (`draft_shape(..., "mla")`): fc once and per
    TTT step the layer's linears and the LM head, 6 x their weights (eaglet.checks.sizing
    draft_train_flops over the draft built on the meta device), the causal attention within a
    document over its heads (queries and keys nope + rope wide, values v), and the teacher over
    the draft vocabulary, in multiply-accumulates x 2."""
    with torch.device("meta"):
        draft = Eagle3Draft(DraftConfig(target_hidden_size=shape["hidden_size"], **shape))
    attn = seq / 2 * shape["mla_heads"] * (shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"] + shape["v_head_dim"])
    return draft_train_flops(draft, k) + k * 6 * attn + 2 * shape["hidden_size"] * shape["draft_vocab_size"]


def anchor_dims(shape: dict[str, int]) -> dict[str, int]:
    """An eaglet.testing.synthetic preset in the anchor script's keys."""
    return dict(hidden=shape["hidden_size"], heads=shape["num_attention_heads"], kv=shape["num_key_value_heads"],
                inter=shape["intermediate_size"], vocab=shape["vocab_size"], draft_vocab=shape["draft_vocab_size"])


# eaglet's step with one of its fast paths taken out (or, --known-vocab-mask, a later epoch's
# teacher), for side-by-sides; each is reported in the JSON (None for speculators).
EAGLET_SWITCHES = {
    "--per-product-casts": "eaglet without the unroll's once-cast weights (FastUnroll casts 'per_product'): each "
                           "product casts its fp32 weight, as before; for a side-by-side of what the once-cast buys.",
    "--summed-weight-grads": "eaglet with autograd summing the TTT steps' weight gradients (k - 1 full-size adds per "
                             "weight) instead of the GEMMs accumulating them (FastUnroll casts 'sum').",
    "--clip-pass": "eaglet clipping with clip_grad_norm_ before the step instead of inside the fused AdamW "
                   "(eaglet.draft.step.optimizer_step clip_in_step=False).",
    "--per-step-embeds": "eaglet with each TTT step making layer 0's q/k/v products of its token embeddings "
                         "(FastUnroll embeds_once False) instead of making them once and shifting them.",
    "--all-head-rows": "eaglet with the LM head over every row of every step instead of the rows each step's loss "
                       "can count (Batch.rows' head rows: trained tokens within their document); the active rows come "
                       "from those, so TTT steps 1.. run over every row too (--all-step-rows).",
    "--all-step-rows": "eaglet with TTT steps 1.. over every row instead of the rows some step from 1 on counts "
                       "(Batch.rows' active rows); the LM head still over the counted rows.",
    "--known-vocab-mask": "eaglet with the out-of-vocabulary mask's verdicts known (training.data.VocabMaskCache, from a "
                          "run's second epoch on): the teacher over the draft columns only, the mask still applied.",
    "--plain-optimizer": "eaglet with torch's fused AdamW over fp32 gradients (train.unroll_optimizer false: the "
                         "unroll's bf16 gradients cast into .grad, the weights cast again each step) instead of "
                         "UnrollAdamW (eaglet/draft/optim.py); the flags above that change the casts or the clipping "
                         "imply it.",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", choices=["eaglet", "speculators"], default="eaglet")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b", help="Draft shape (eaglet.testing.synthetic.PRESETS).")
    ap.add_argument("--draft-attention", choices=["dense", "mla"], default="dense",
                    help="eaglet's draft layer (train.draft_attention): dense, or MLA at the preset target's own MLA "
                         "sizes (kimi-k2: Kimi-K2.5's) or the default rule's (eaglet.testing.synthetic.draft_shape).")
    ap.add_argument("--tokens", type=int, default=8192, help="Tokens per micro-batch (one packed sequence).")
    ap.add_argument("--doc-tokens", type=int, default=None, help="Tokens per document (default: --tokens, one document).")
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto", help="As train.compile (eaglet).")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend of the compiled pieces ('eager'/'aot_eager': capture only, to isolate).")
    ap.add_argument("--attn-impl", default="auto", help="As train.attn_impl (eaglet).")
    ap.add_argument("--loss-impl", choices=["eager", "fused"], default="eager", help="speculators' loss (anchor: eager).")
    ap.add_argument("--device", default="auto", help="'auto' (cuda when there is one) or 'cpu'.")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--peak", type=float, default=H200_BF16_PEAK, help="Peak FLOP/s for the MFU.")
    ap.add_argument("--breakdown", action="store_true", help="Per-phase CUDA-event times (eaglet).")
    ap.add_argument("--profile", action="store_true", help="torch.profiler: top kernels by device time.")
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="Also run N steps under cProfile: where the host's time in a step goes (the Python "
                         "functions and the ops it calls, by own time and by cumulative time).")
    ap.add_argument("--top", type=int, default=25, help="Kernels listed by --profile.")
    ap.add_argument("--trace", default=None, help="With --profile: also write the Chrome trace here.")
    ap.add_argument("--check", action="store_true", help="First step's losses against an eager copy (eaglet).")
    ap.add_argument("--packed", type=int, default=0, metavar="N",
                    help="Cycle N micro-batches of documents of varying lengths around --doc-tokens, packed into at "
                         "most --tokens (eaglet): real data's varying shapes.")
    ap.add_argument("--dynamic", choices=["marked", "auto", "on"], default="marked",
                    help="eaglet's compiled pieces: their data dims symbolic from the first compile (marked, eaglet's "
                         "setting), torch.compile's default (auto: sizes symbolic once they change) or dynamic=True "
                         "(on: every size symbolic from the first compile).")
    ap.add_argument("--flex-dynamic", choices=["on", "auto"], default="on",
                    help="the step-0 attention's compiled flex_attention: every size symbolic from the first compile "
                         "(on, eaglet's attention.FLEX_OPTIONS) or torch.compile's default (auto: compiled again at the "
                         "second packed length).")
    ap.add_argument("--flops-only", action="store_true",
                    help="Report the FLOP figures of the preset's step (--tokens, --doc-tokens, --ttt-steps) and stop: "
                         "nothing built or run.")
    ap.add_argument("--no-vocab-mask", action="store_true",
                    help="eaglet with train.mask_out_of_vocab false: the teacher over the draft columns only, "
                         "as speculators computes it (no full-vocabulary argmax).")
    for flag, text in EAGLET_SWITCHES.items():
        ap.add_argument(flag, action="store_true", help=text)
    ap.add_argument("--in-vocab", type=float, default=IN_VOCAB,
                    help="Share of the synthetic rows whose teacher argmax is a draft token (the rows the "
                         "out-of-vocabulary mask keeps; real data's is about the vocab stage's coverage).")
    ap.add_argument("--loss-share", type=float, default=LOSS_SHARE,
                    help="Share of the synthetic tokens trained on (loss mask 1), both systems "
                         "(eaglet.testing.synthetic.LOSS_SHARE: measured on the default ShareGPT data).")
    ap.add_argument("--out", default=None, help="Write the result JSON here.")
    args = ap.parse_args(argv)
    args.doc_tokens = args.doc_tokens or args.tokens
    return args


# ---- timing -----------------------------------------------------------------------------------------

class PhaseTimer:
    """Marks at named points of a step; `mean_ms()` averages each phase over the steps
    recorded. CUDA events on a GPU (nothing is synchronised), the wall clock on a CPU (where
    every op runs before the next starts); nothing at all when disabled."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.cuda = enabled, device.type == "cuda"
        self.steps: list[list[tuple[str, Any]]] = []

    def start_step(self) -> None:
        if self.enabled:
            self.steps.append([])
            self.mark("start")

    def mark(self, name: str) -> None:
        if self.enabled and self.steps:
            if self.cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
            else:
                ev = time.perf_counter()
            self.steps[-1].append((name, ev))

    def mean_ms(self) -> dict[str, float]:
        """Phase name -> mean ms; a phase runs from the previous mark to its own."""
        sums: dict[str, float] = {}
        for marks in self.steps:
            for (_, a), (name, b) in zip(marks, marks[1:]):
                sums[name] = sums.get(name, 0.0) + (a.elapsed_time(b) if self.cuda else 1000 * (b - a))
        return {k: v / max(len(self.steps), 1) for k, v in sums.items()}


class _TimedTeacher(nn.Module):
    def __init__(self, teacher: nn.Module, timer: PhaseTimer):
        super().__init__()
        self.teacher, self.timer = teacher, timer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.teacher(*args, **kwargs)
        self.timer.mark("teacher")
        return out


class _TimedSteps(nn.Module):
    """The training module with a mark after each TTT step's forward and each step's loss.
    It computes what the draft's forward computes (all steps' logits, then the losses over
    them, as forward_loss runs), through the `ttt_steps` generator to mark between steps."""

    def __init__(self, module: nn.Module, timer: PhaseTimer):
        super().__init__()
        self.module, self.timer = module, timer

    def forward(self, *args: Any, **kwargs: Any) -> Iterator[torch.Tensor]:
        if not (self.timer.enabled and isinstance(self.module, Eagle3Draft)):
            return self.module(*args, **kwargs)
        steps = []
        for j, logits in enumerate(self.module.ttt_steps(*args, **kwargs)):
            self.timer.mark(f"step{j}_forward")
            steps.append(logits)
        return self._losses_marked(steps)

    def _losses_marked(self, steps: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        for j, logits in enumerate(steps):
            yield logits  # ttt_loss takes step j's loss before asking for the next
            self.timer.mark(f"step{j}_loss")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class GCPauses:
    """The Python garbage collector's pauses while it is entered (gc.callbacks): time the host
    spent collecting instead of feeding the GPU, a diagnostic beside the host's time per step."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []  # (generation, ms)
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append((int(info["generation"]), 1000 * (time.perf_counter() - self._t0)))

    def __enter__(self) -> GCPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self, steps: int) -> dict[str, Any]:
        ms = [m for _, m in self.pauses]
        return {"collections": len(ms), "full_collections": sum(g == 2 for g, _ in self.pauses),
                "ms_per_step": sum(ms) / max(steps, 1), "max_ms": max(ms, default=0.0)}


def _timed_loop(step: Callable[[], Any], warmup: int, steps: int, device: torch.device,
                timer: PhaseTimer | None = None) -> dict[str, Any]:
    """Warm-up steps, then `steps` timed ones; with the host's time in each step call and the
    garbage collector's pauses (GCPauses) among the diagnostics."""
    t0 = time.perf_counter()
    warm_each = []
    for _ in range(warmup):
        t1 = time.perf_counter()
        step()
        _sync(device)
        warm_each.append(time.perf_counter() - t1)
    warm_s = time.perf_counter() - t0
    graphs = counters["stats"]["unique_graphs"]
    freeze_survivors()  # as the trainer has after its first steps
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if timer is not None:
        timer.steps.clear()
    host_ms = []
    with GCPauses() as pauses:
        t0 = time.perf_counter()
        for _ in range(steps):
            t1 = time.perf_counter()
            last = step()
            host_ms.append(1000 * (time.perf_counter() - t1))
        _sync(device)
    seconds = (time.perf_counter() - t0) / steps
    return {"step_ms": 1000 * seconds, "warmup_s": warm_s, "warmup_step_s": warm_each, "last_loss": float(last),
            "compile_times": _compile_times(),
            "graphs_in_timed_steps": counters["stats"]["unique_graphs"] - graphs,
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "host_ms_each": host_ms, "gc": pauses.summary(steps)}


def _compile_times() -> str | None:
    """torch.compile's time by phase (dynamo, AOT autograd, inductor), summed over the run so far."""
    try:
        from torch._dynamo.utils import compile_times
        return str(compile_times(repr="str", aggregate=True))
    except Exception:  # noqa: BLE001 - a torch without it, or another signature
        return None


def _profile(step: Callable[[], Any], n: int, device: torch.device, top: int, trace: str | None) -> dict[str, Any]:
    """torch.profiler over n steps: the top kernels (ops on CPU) by self device time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(n):
            step()
        _sync(device)
    if trace:
        prof.export_chrome_trace(trace)
    on_device = device.type == "cuda"
    rows = []
    for e in prof.key_averages():
        t = (getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)) if on_device \
            else e.self_cpu_time_total
        if t > 0:
            rows.append((t, e.key, e.count))
    rows.sort(reverse=True)
    total = sum(t for t, _, _ in rows)
    kernels = [{"name": k[:160], "ms_per_step": t / 1000 / n, "share": t / total if total else 0.0, "calls_per_step": c / n}
               for t, k, c in rows[:top]]
    print(f"profile: top {len(kernels)} {'kernels by device' if on_device else 'ops by CPU'} time "
          f"({total / 1000 / n:.1f} ms per step in all):", flush=True)
    for r in kernels:
        print(f"  {r['ms_per_step']:8.2f} ms {r['share']:6.1%} x{r['calls_per_step']:<5.0f} {r['name']}", flush=True)
    return {"total_ms_per_step": total / 1000 / n, "top": kernels,
            "table": prof.key_averages().table(sort_by="self_cuda_time_total" if on_device else "self_cpu_time_total",
                                               row_limit=top)}


def _host_profile(step: Callable[[], Any], n: int, device: torch.device, top: int) -> dict[str, Any]:
    """cProfile over n steps (the device synchronised before and after): the host's time per
    step, and the functions that take it, by own time and by cumulative time."""
    import cProfile
    import io
    import pstats

    _sync(device)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    host_s = time.perf_counter() - t0
    _sync(device)
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_cc, calls, own, cum, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = name if file == "~" else f"{Path(file).parent.name}/{Path(file).name}:{line}({name})"
        rows.append({"fn": where[-120:], "calls_per_step": calls / n, "own_ms": 1000 * own / n, "cum_ms": 1000 * cum / n})
    by_own = sorted(rows, key=lambda r: -r["own_ms"])[:top]
    by_cum = sorted(rows, key=lambda r: -r["cum_ms"])[:top]
    buf = io.StringIO()
    print(f"host profile: {1000 * host_s / n:.1f} ms of host time per step under cProfile; by own time:", file=buf)
    for r in by_own:
        print(f"  {r['own_ms']:8.2f} ms x{r['calls_per_step']:<6.0f} {r['fn']}", file=buf)
    print("by cumulative time:", file=buf)
    for r in by_cum:
        print(f"  {r['cum_ms']:8.2f} ms x{r['calls_per_step']:<6.0f} {r['fn']}", file=buf)
    print(buf.getvalue(), end="", flush=True)
    return {"host_ms_per_step": 1000 * host_s / n, "by_own": by_own, "by_cum": by_cum}


# ---- eaglet -----------------------------------------------------------------------------------------

def run_eaglet(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    shape = draft_shape(args.preset, args.draft_attention)
    cfg = DraftConfig(target_hidden_size=shape["hidden_size"], **shape)
    tc = TrainSection(max_tokens=args.tokens, ttt_steps=args.ttt_steps, attn_impl=args.attn_impl,
                      compile=args.compile, warmup_steps=1, min_lr_ratio=1.0,
                      mask_out_of_vocab=not args.no_vocab_mask)
    frozen = torch.bfloat16 if device.type == "cuda" else torch.float32
    compiled = resolve_compile(tc.compile, device)
    if args.dynamic == "on":
        compiling.PIECE_OPTIONS["dynamic"] = True
    compiling.MARK_DATA_DIMS = args.dynamic == "marked"
    if args.flex_dynamic == "auto":  # else compiled with attention.FLEX_OPTIONS at its first CUDA call
        compile_flex_attention(dynamic=None)
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    lm_head = (torch.randn(cfg.vocab_size, cfg.target_hidden_size) * 0.02).to(frozen)  # the target's, random
    reference = copy.deepcopy(draft) if args.check and compiled else None  # eager: no unroll installed yet
    teacher = TeacherHead(lm_head, norm_eps=cfg.rms_norm_eps, chunk=tc.teacher_chunk,
                          mask_out_of_vocab=tc.mask_out_of_vocab)
    if args.compile_backend == "inductor":
        par = parallelize(draft, teacher, "none", device, frozen_dtype=frozen, compile=compiled)
    else:  # the same pieces through another backend
        par = parallelize(draft, teacher, "none", device, frozen_dtype=frozen, compile=False)
        if compiled:
            use_fast_unroll(draft, compile=True, backend=args.compile_backend)
            compile_soft_ce(backend=args.compile_backend)
            par = replace(par, compiled=True)
    # the switches that take one of the unroll's fast paths out (EAGLET_SWITCHES), on the unroll installed
    draft.unroll.embeds_once = not args.per_step_embeds
    if args.per_product_casts:
        draft.unroll.casts = "per_product"  # the casts left to autocast in each product
    elif args.summed_weight_grads:
        draft.unroll.casts = "sum"  # cast once, autograd sums the steps' weight gradients
    # the trainer's optimizer for one process (UnrollAdamW under bf16, eaglet/draft/optim.py); torch's AdamW
    # with --plain-optimizer and with the flags that bring back a per-step cast or a separate clip
    plain = args.plain_optimizer or args.per_product_casts or args.summed_weight_grads or args.clip_pass
    opt = build_optimizer(draft, replace(tc, unroll_optimizer=not plain), "none", device, device.type == "cuda",
                          compiled, unroll_linears(draft))
    run_cfg = Config(train=tc)  # what the step reads: train.algorithm (eagle3) and train.*
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(tc, 10**6))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    packings = [packed_doc_lens(args.tokens, args.doc_tokens, seed=i) for i in range(args.packed)] or [None]
    batches = [synthetic_batch(cfg, sum(lens) if lens else args.tokens, args.doc_tokens, device, frozen, seed=1 + i,
                               head=lm_head, in_vocab=args.in_vocab, loss_share=args.loss_share,
                               ttt_steps=0 if args.all_head_rows else tc.ttt_steps, doc_lens=lens)
               for i, lens in enumerate(packings)]
    shares = []
    for b in batches:
        with torch.no_grad():
            known = par.teacher(b.final, draft.t2d, draft.d2t)[1]
        shares.append(float(known.float().mean()))
        if args.all_step_rows and b.rows is not None:
            del b.rows[ACTIVE_ROWS]
        if args.known_vocab_mask:  # the batch's verdicts known, as from a run's second epoch on (VocabMaskCache)
            b.in_vocab = known
    b, in_vocab_rows = batches[0], shares[0]  # the first micro-batch's figures below
    turn = itertools.cycle(batches)

    timer = PhaseTimer(args.breakdown, device)
    timed = replace(par, module=_TimedSteps(par.module, timer), teacher=_TimedTeacher(par.teacher, timer))

    skipped = SkippedSteps(device)  # the trainer's count of steps skipped for a non-finite gradient

    def step() -> torch.Tensor:  # no host sync, as in the trainer between logging steps
        timer.start_step()
        out = micro_batch(timed, next(turn), run_cfg, autocast, sync=True)
        timer.mark("backward")
        optimizer_step(par, opt, sched, tc, clip_in_step=not args.clip_pass, skipped=skipped)
        timer.mark("optimizer")
        return out.total.detach()

    check = None
    if reference is not None:
        check = _check_against_eager(reference, par, b, run_cfg, autocast, device, frozen)
        reference = None  # its device copy is freed before the timed steps
    res = _timed_loop(step, args.warmup, args.steps, device, timer)
    if args.breakdown:
        res["breakdown_ms"] = timer.mean_ms()
        _print_breakdown(res["breakdown_ms"], res["step_ms"])
        timer.enabled = False
    if args.profile:
        res["profile"] = _profile(step, args.profile_steps, device, args.top, args.trace)
    if args.host_profile:
        res["host_profile"] = _host_profile(step, args.host_profile, device, args.top)
    res.update(tokens_per_step=sum(x.tokens for x in batches) / len(batches), packed=args.packed,
               dynamic=args.dynamic if compiled else None, flex_dynamic=args.flex_dynamic,
               doc_lens=packings if args.packed else None)
    res.update(optimizer=type(opt).__name__, compile=compiled, compile_backend=args.compile_backend if compiled else None,
               attn_impl=resolve_attn_impl(tc.attn_impl, device), check=check,
               trainable_params_m=sum(p.numel() for g in opt.param_groups for p in g["params"]) / 1e6,
               in_vocab_rows=in_vocab_rows,
               loss_share=float(b.loss_mask.float().mean()),
               head_rows_share=None if b.rows is None else
               sum(len(b.rows[HEAD_ROWS.format(j)]) for j in range(tc.ttt_steps)) / (tc.ttt_steps * b.tokens),
               active_rows_share=None if b.rows is None or ACTIVE_ROWS not in b.rows else
               len(b.rows[ACTIVE_ROWS]) / b.tokens)
    return res


def _check_against_eager(reference: Eagle3Draft, par: Parallel, b: Any, run_cfg: Config, autocast: torch.autocast,
                         device: torch.device, frozen: torch.dtype) -> dict[str, Any]:
    """Losses of one forward of the compiled draft and of an eager copy with the same weights
    (read back once, before the timed steps)."""
    ref_par = parallelize(reference, par.teacher, "none", device, frozen_dtype=frozen, compile=False)
    reference.unroll.embeds_once, reference.unroll.casts = par.draft.unroll.embeds_once, par.draft.unroll.casts
    with torch.no_grad():
        want = forward_loss(ref_par, reference, b, run_cfg, autocast)
    got = forward_loss(par, par.module, b, run_cfg, autocast)  # with grad: the graphs training uses
    w = torch.stack([want.total] + want.losses).float().cpu()
    g = torch.stack([got.total] + got.losses).detach().float().cpu()
    del got, want, ref_par
    rel = ((g - w).abs() / w.abs().clamp(min=1e-6)).max().item()
    print(f"check: compiled vs eager losses {g.tolist()} vs {w.tolist()}: max relative difference {rel:.2e}", flush=True)
    return {"compiled": g.tolist(), "eager": w.tolist(), "max_rel_diff": rel}


def _print_breakdown(ms: dict[str, float], step_ms: float) -> None:
    fwd = sum(v for k, v in ms.items() if k.endswith("_forward"))
    loss = sum(v for k, v in ms.items() if k.endswith("_loss"))
    print(f"breakdown (ms per step, of {step_ms:.1f}): teacher {ms.get('teacher', 0):.1f}, TTT forward {fwd:.1f} "
          f"({', '.join(f'{ms[k]:.1f}' for k in ms if k.endswith('_forward'))}), loss {loss:.1f}, backward "
          f"{ms.get('backward', 0):.1f}, optimizer {ms.get('optimizer', 0):.1f}", flush=True)


# ---- speculators --------------------------------------------------------------------------------------

def run_speculators(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The anchor script's model, batch and step (its `main`), at this preset's shapes."""
    from transformers import LlamaConfig
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses.utils import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from importlib.metadata import version

    d = anchor_dims(PRESETS[args.preset])
    tl = LlamaConfig(vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"],
                     num_hidden_layers=1, num_attention_heads=d["heads"], num_key_value_heads=d["kv"],
                     max_position_embeddings=131072, rms_norm_eps=1e-5)
    # CPU flex_attention has no backward: speculators' dense eager mask there (smoke tests only)
    tl._attn_implementation = "simple_flex_attention" if device.type == "cuda" else "eager"
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=d["draft_vocab"], norm_before_residual=False,
        eagle_aux_hidden_state_layer_ids=[2, 16, 29],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=args.ttt_steps)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    torch.manual_seed(0)
    model = Eagle3DraftModel(cfg)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if torch.isnan(p).any():
                p.normal_(0, 0.02)
    model.lm_head.weight.requires_grad_(True)
    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    T, H, docs = args.tokens, d["hidden"], args.tokens // args.doc_tokens
    states = torch.bfloat16 if device.type == "cuda" else torch.float32  # no autocast on a CPU
    g = torch.Generator(device="cpu").manual_seed(0)
    batch = dict(
        hidden_states=torch.randn(1, T, 3 * H, generator=g).to(device, states),
        input_ids=torch.randint(0, d["vocab"], (1, T), generator=g).to(device),
        document_ids=torch.arange(docs).repeat_interleave(args.doc_tokens).unsqueeze(0).to(device),
        loss_mask=synthetic_loss_mask(T, args.doc_tokens, args.loss_share).to(device),
        position_ids=torch.arange(args.doc_tokens).repeat(docs).unsqueeze(0).to(device),
        verifier_last_hidden_states=torch.randn(1, T, H, generator=g).to(device, states),
    )
    loss_config = resolve_loss_config("kl_div", implementation=args.loss_impl)

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            _, loss, _ = model(**batch, ttt_steps=args.ttt_steps, ttt_step_loss_decay=0.8, loss_config=loss_config)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss.detach()

    res = _timed_loop(step, args.warmup, args.steps, device)
    if args.profile:
        res["profile"] = _profile(step, args.profile_steps, device, args.top, args.trace)
    if args.host_profile:
        res["host_profile"] = _host_profile(step, args.host_profile, device, args.top)
    res.update(speculators_version=version("speculators"), loss_impl=args.loss_impl,
               loss_share=float(batch["loss_mask"].float().mean()),
               trainable_params_m=sum(p.numel() for p in params) / 1e6)
    return res


# ---- main ----------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.packed and args.system != "eaglet":
        raise SystemExit("--packed: eaglet only")
    if args.draft_attention != "dense" and args.system != "eaglet":
        raise SystemExit("--draft-attention mla: eaglet only (speculators' EAGLE-3 draft is a Llama layer)")
    if args.tokens % args.doc_tokens:
        raise SystemExit(f"--tokens {args.tokens} is not a multiple of --doc-tokens {args.doc_tokens}")
    d = anchor_dims(PRESETS[args.preset])
    if args.draft_attention == "mla":
        shape = draft_shape(args.preset, "mla")
        flops, formula = mla_flops_per_token(shape, args.doc_tokens, args.ttt_steps), "mla_flops_per_token"
        d = {**d, **{k: shape[k] for k in ("mla_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                           "qk_rope_head_dim", "v_head_dim")}}
    else:
        flops, formula = train_flops_per_token(d, args.doc_tokens, args.ttt_steps), "anchor train_flops_per_token"
    extra = 2 * d["hidden"] * (d["vocab"] - d["draft_vocab"])
    figures = {"anchor_dims": d, "flop_per_token": flops, "gflop_per_token": flops / 1e9,
               "gflop_per_token_full_teacher": (flops + extra) / 1e9, "flops_formula": formula,
               "draft_attention": args.draft_attention}
    if args.flops_only:
        report = {"system": args.system, "preset": args.preset, "tokens": args.tokens, "doc_tokens": args.doc_tokens,
                  "ttt_steps": args.ttt_steps, **figures,
                  # every real preset's FLOPs per token at documents of 2048 and 4096 (one run for a table)
                  "presets": {name: {str(seq): train_flops_per_token(anchor_dims(shape), seq, args.ttt_steps)
                                     for seq in (2048, 4096)} for name, shape in PRESETS.items() if name != "tiny"}}
        print(f"{args.preset} ({args.draft_attention}) documents of {args.doc_tokens}, {args.ttt_steps} TTT steps: "
              f"{report['gflop_per_token']:.2f} GFLOP/token ({formula}), "
              f"{report['gflop_per_token_full_teacher']:.2f} with the full-vocabulary teacher", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        return report
    name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)  # set_device needs an index
        torch.cuda.set_device(device)
    res = run_eaglet(args, device) if args.system == "eaglet" else run_speculators(args, device)
    tok_s = res.get("tokens_per_step", args.tokens) / (res["step_ms"] / 1000)
    report = {
        "system": args.system, "preset": args.preset, "tokens": args.tokens, "doc_tokens": args.doc_tokens,
        "docs": args.tokens // args.doc_tokens, "ttt_steps": args.ttt_steps, "tokens_per_s": tok_s,
        "mask_out_of_vocab": not args.no_vocab_mask if args.system == "eaglet" else None,
        **{k: getattr(args, k) if args.system == "eaglet" else None
           for k in (f[2:].replace("-", "_") for f in EAGLET_SWITCHES)},
        "gflop_per_token": flops / 1e9, "mfu": tok_s * flops / args.peak, "peak_flops": args.peak,
        "gflop_per_token_full_teacher": (flops + extra) / 1e9, "flops_formula": figures["flops_formula"],
        "draft_attention": args.draft_attention, "draft_dims": figures["anchor_dims"],
        **res, "steps": args.steps, "warmup": args.warmup, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
    }
    mem = f", peak {report['peak_mem_gib']:.1f} GiB" if report["peak_mem_gib"] is not None else ""
    print(f"{args.system} {args.preset} {args.draft_attention} {args.tokens // args.doc_tokens}x{args.doc_tokens}: "
          f"{tok_s:,.0f} tokens/s, {report['step_ms']:.1f} ms/step{mem}, MFU {report['mfu']:.1%} "
          f"({report['gflop_per_token']:.2f} GFLOP/token, {formula}); warmup {report['warmup_s']:.1f} s; "
          f"loss {report['last_loss']:.4f}"
          + (f"; compile {report['compile']}, attention {report['attn_impl']}, in-vocabulary rows "
             f"{report['in_vocab_rows']:.0%}" if args.system == "eaglet" else ""),
          flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if not math.isfinite(report["last_loss"]):
        raise SystemExit("non-finite loss")
    return report


if __name__ == "__main__":
    main()
