"""Training-step throughput of the draft on 1 GPU against N GPUs, under torchrun.

    torchrun --standalone --nproc-per-node 2 bench/scaling.py --out scaling.json --png scaling.png
    torchrun --standalone --nproc-per-node 2 bench/scaling.py --preset kimi-k2 --parallel fsdp
    torchrun --standalone --nproc-per-node 2 bench/scaling.py --device cpu --preset tiny --steps 3   # CPU smoke test (gloo)

The step is eaglet's own (`eaglet.draft.step.micro_batch` and `optimizer_step` on a draft wrapped by
`eaglet.draft.parallelize.parallelize`, compiled as `train.compile` says: `--compile`), on synthetic
inputs of fixed shape (`eaglet.testing.synthetic.synthetic_batch`: random captured states, tokens,
documents of `--doc-tokens`) and a random target head for the teacher. Reading the store is
left out. Weak scaling: every rank trains `--grad-accum` micro-batches of `--max-tokens`
tokens per optimizer step, so N ranks train N times the tokens per step, as `eaglet train`
does under torchrun.

Phase 1: rank 0 alone, unwrapped (strategy 'none'; the other ranks wait). Phase 2: all N
ranks with `--parallel`. Each phase runs `--warmup` untimed steps, then `--steps` timed ones.
Efficiency = tokens/s on N ranks / (N x tokens/s on one). Rank 0 prints one line per phase
and writes the JSON (and with --png a bar chart).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path
from typing import Any

import torch

from eaglet.config import Config, TrainSection
from eaglet.distributed import barrier, init_distributed
from eaglet.draft.eagle3.model import DraftConfig, Eagle3Draft
from eaglet.draft.parallelize import parallelize, resolve_strategy
from eaglet.draft.step import SkippedSteps, TeacherHead, lr_lambda, micro_batch, optimizer_step, peak_lr, resolve_compile
from eaglet.testing.synthetic import PRESETS, synthetic_batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b", help="Draft shape.")
    ap.add_argument("--max-tokens", type=int, default=None, help="Tokens per micro-batch (default 8192; tiny: 512).")
    ap.add_argument("--doc-tokens", type=int, default=None, help="Tokens per packed document (default max_tokens / 4).")
    ap.add_argument("--grad-accum", type=int, default=1, help="Micro-batches per optimizer step on each rank.")
    ap.add_argument("--ttt-steps", type=int, default=7, help="Training-time-test steps.")
    ap.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp", help="Strategy of phase 2.")
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto", help="As train.precision.")
    ap.add_argument("--attn-impl", default="auto", help="As train.attn_impl.")
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto", help="As train.compile.")
    ap.add_argument("--device", default="auto", help="'auto' (this rank's GPU when there is one) or 'cpu'.")
    ap.add_argument("--warmup", type=int, default=3, help="Untimed steps per phase.")
    ap.add_argument("--steps", type=int, default=10, help="Timed steps per phase.")
    ap.add_argument("--out", default="scaling.json", help="JSON written by rank 0.")
    ap.add_argument("--png", default=None, help="Also draw tokens/s on 1 and N ranks into this PNG.")
    return ap.parse_args(argv)


def _device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda", local_rank) if name == "cuda" else torch.device(name)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_phase(strategy: str, world: int, cfg: DraftConfig, tc: TrainSection, args: argparse.Namespace,
              device: torch.device, frozen: torch.dtype, rank: int) -> dict[str, Any]:
    """Build, wrap, warm up and time the training step; returns tokens/s over all `world` ranks."""
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    lm_head = (torch.randn(cfg.vocab_size, cfg.target_hidden_size) * 0.02).to(frozen)  # the target's, random
    teacher = TeacherHead(lm_head, norm_eps=cfg.rms_norm_eps, chunk=tc.teacher_chunk,
                          mask_out_of_vocab=tc.mask_out_of_vocab)
    par = parallelize(draft, teacher, strategy, device, frozen_dtype=frozen, compile=resolve_compile(tc.compile, device))
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=peak_lr(tc, cfg.hidden_size), betas=tuple(tc.betas), fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(tc, args.warmup + args.steps))
    use_bf16 = tc.precision == "bf16" or (tc.precision == "auto" and device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)
    batches = [synthetic_batch(cfg, tc.max_tokens, args.doc_tokens, device, frozen, seed=1000 * rank + a, head=lm_head,
                               ttt_steps=tc.ttt_steps)
               for a in range(tc.grad_accum)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    skipped = SkippedSteps(device)  # the trainer's count of steps skipped for a non-finite gradient

    def step() -> torch.Tensor:  # no host sync, as in the trainer between logging steps
        loss = torch.zeros((), device=device)
        for a, b in enumerate(batches):
            loss += micro_batch(par, b, Config(train=tc), autocast, sync=a == len(batches) - 1).total.detach()
        optimizer_step(par, opt, sched, tc, skipped=skipped)
        return loss

    def wait() -> None:  # phase 1 runs on rank 0 alone: no collective there
        _sync(device)
        if world > 1:
            barrier()

    for _ in range(args.warmup):
        step()
    wait()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        last_loss = step()
    wait()
    seconds = time.perf_counter() - t0
    last_loss = float(last_loss)
    tokens = args.steps * tc.grad_accum * tc.max_tokens * world
    return {
        "strategy": strategy,
        "ranks": world,
        "tokens_per_s": tokens / seconds,
        "step_ms": 1000 * seconds / args.steps,
        "memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "last_loss": last_loss,
        "finite": math.isfinite(last_loss),
    }


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    env = init_distributed()
    device = _device(args.device, env.local_rank)
    shape = PRESETS[args.preset]
    args.max_tokens = args.max_tokens or (512 if args.preset == "tiny" else 8192)
    args.doc_tokens = args.doc_tokens or max(args.max_tokens // 4, 1)
    cfg = DraftConfig(target_hidden_size=shape["hidden_size"], **shape)
    tc = TrainSection(max_tokens=args.max_tokens, grad_accum=args.grad_accum, ttt_steps=args.ttt_steps,
                      precision=args.precision, attn_impl=args.attn_impl, compile=args.compile, warmup_steps=1,
                      min_lr_ratio=1.0)
    frozen = torch.bfloat16 if device.type == "cuda" else torch.float32
    results: dict[str, Any] = {}
    if env.is_main:
        results["one"] = run_phase("none", 1, cfg, tc, args, device, frozen, env.rank)
        print(f"1 rank: {results['one']['tokens_per_s']:.0f} tokens/s, {results['one']['step_ms']:.1f} ms/step",
              flush=True)
    barrier()
    if env.active:
        results["all"] = run_phase(resolve_strategy(args.parallel, env.world_size), env.world_size, cfg, tc, args,
                                   device, frozen, env.rank)
    if not env.is_main:
        return None
    report: dict[str, Any] = {
        "preset": args.preset, "draft": cfg.to_dict(), "max_tokens": args.max_tokens, "doc_tokens": args.doc_tokens,
        "grad_accum": args.grad_accum, "ttt_steps": args.ttt_steps, "precision": args.precision,
        "world_size": env.world_size, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__, "warmup": args.warmup, "steps": args.steps, **results,
    }
    if "all" in results:
        report["efficiency"] = results["all"]["tokens_per_s"] / (env.world_size * results["one"]["tokens_per_s"])
        print(f"{env.world_size} ranks ({results['all']['strategy']}): {results['all']['tokens_per_s']:.0f} tokens/s, "
              f"{results['all']['step_ms']:.1f} ms/step; scaling efficiency {report['efficiency']:.1%}", flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if args.png and "all" in results:
        _plot(report, args.png)
    return report


def _plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = report["world_size"]
    one, many = report["one"]["tokens_per_s"], report["all"]["tokens_per_s"]
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    ax.bar(["1", str(n)], [one, many], color=["#888", "#2a6"])
    ax.plot([0, 1], [one, n * one], "k--", lw=1, label="linear")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("training tokens/s")
    ax.set_title(f"{report['preset']} draft, {report['all']['strategy']}: {report['efficiency']:.0%} efficiency",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)


if __name__ == "__main__":
    main()
