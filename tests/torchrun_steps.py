"""Several eaglet commands in one torchrun job, so a test pays for starting the process group once.

    torchrun --standalone --nproc-per-node 2 tests/torchrun_steps.py \
        run a.yaml --until train --- cp run other --- rm other/extract/index.json --- bench --device cpu ...

Groups are separated by `---`. A group is `eaglet` CLI arguments, `cp SRC DST` (a folder
copied), `rm PATH...` (files deleted, as a kill would have left them), `bench ARGS`
(bench/scaling.py), or `skip STRATEGY fused|plain` (`check_skip`). Rank 0 copies and deletes
while the others wait. The job stops at the first group that fails.
"""

import runpy
import shutil
import sys
from pathlib import Path

import torch

from eaglet import cli
from eaglet.distributed import all_gather_object, barrier, dist_env, init_distributed

BENCH = Path(__file__).resolve().parent.parent / "bench" / "scaling.py"


def check_skip(strategy: str, optimizer: str) -> None:
    """Three optimizer steps of a tiny draft under `strategy` (ddp, fsdp) with torch's AdamW,
    fused (the GPU's path; the CPU has one too) or plain; step 2's gradient is made non-finite
    on rank 1 only: under ddp in its micro-batch's states (the all-reduce spreads it), under fsdp
    in one element of its gradient shard after the reduce-scatter (only the reduced norm shows
    it to rank 0). Every rank must skip step 2 (its weights and AdamW moments, its shards under
    fsdp, as they were), take steps 1 and 3, and count one skip; ddp's replicas stay equal."""
    from eaglet.config import Config, TrainSection
    from eaglet.draft.eagle3.model import DraftConfig, Eagle3Draft
    from eaglet.draft.parallelize import parallelize
    from eaglet.draft.step import SkippedSteps, TeacherHead, micro_batch, optimizer_step
    from eaglet.testing.synthetic import synthetic_batch

    rank, cpu = dist_env().rank, torch.device("cpu")
    cfg = DraftConfig(hidden_size=32, target_hidden_size=32, intermediate_size=64, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, vocab_size=64, draft_vocab_size=32)
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    head = torch.randn(cfg.vocab_size, cfg.target_hidden_size) * 0.5
    par = parallelize(draft, TeacherHead(head, chunk=16), strategy, cpu)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, fused=optimizer == "fused")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    tc = TrainSection(max_tokens=64, ttt_steps=2, attn_impl="chunked", precision="fp32", grad_clip=0.5)
    skipped = SkippedSteps(cpu)
    local = lambda t: (t.to_local() if hasattr(t, "to_local") else t).detach().clone()

    def held() -> list[torch.Tensor]:
        return [local(p) for p in params] + [local(s[k]) for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]

    for step in (1, 2, 3):
        b = synthetic_batch(cfg, 64, 32, cpu, torch.float32, seed=10 * step + rank, head=head, ttt_steps=2)
        if step == 2 and strategy == "ddp" and rank == 1:
            b.aux[0, 5, 0] = float("nan")
        micro_batch(par, b, Config(train=tc), torch.autocast("cpu", enabled=False), sync=True)
        if step == 2 and strategy == "fsdp" and rank == 1:
            params[-1].grad.to_local().view(-1)[0] = float("inf")
        before = held()
        optimizer_step(par, opt, sched, tc, skipped=skipped)
        kept = len(before) == len(held()) and all(torch.equal(x, y) for x, y in zip(before, held()))
        assert kept == (step == 2), f"{strategy} {optimizer} rank {rank} step {step}: the weights were " + (
            "left as they were" if kept else "changed")
    seen = skipped.look()
    assert (seen["total"], seen["from"], seen["to"]) == (1, 2, 2), (rank, seen)
    if strategy == "ddp":
        digests = all_gather_object([float(p.detach().double().sum()) for p in params])
        assert digests[0] == digests[1], "the DDP replicas parted"


def main(argv: list[str]) -> int:
    groups: list[list[str]] = [[]]
    for arg in argv:
        if arg == "---":
            groups.append([])
        else:
            groups[-1].append(arg)
    init_distributed()
    for group in groups:
        if group[0] in ("cp", "rm"):
            if dist_env().is_main and group[0] == "cp":
                shutil.copytree(group[1], group[2])
            elif dist_env().is_main:
                for path in group[1:]:
                    Path(path).unlink()
            barrier()
        elif group[0] == "skip":
            check_skip(group[1], group[2])
            barrier()
        elif group[0] == "bench":
            sys.argv = [str(BENCH), *group[1:]]
            runpy.run_path(str(BENCH), run_name="__main__")
        elif cli.main(group):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
