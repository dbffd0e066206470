"""The `train` stage: the draft of train.algorithm's type, over the extracted store.

    eaglet train CONFIG            # or as a stage of `eaglet run`
    torchrun --nproc-per-node 8 -m eaglet.cli train CONFIG

Inputs: the hidden-state store and target head (extract), the d2t/t2d maps (vocab). Each
micro-batch packs whole samples into one sequence of at most `train.max_tokens` tokens; the
teacher is the target's LM head on the stored final state, restricted to the draft vocabulary.
The machinery is in eaglet/training/: the draft (build.py), the loop (loop.py), which
micro-batches each rank trains (plan.py), what may resume (resume.py: `--force`, `--extend`),
a diverged run stopped (health.py), and what is logged (metrics.py).

Outputs in the stage folder: `log.jsonl` (one line per logged step, eval lines with
"split": "eval"), TensorBoard events in `tb/`, `checkpoints/step-NNNNNNN/`, and
`final/` (draft config + weights) that export reads.
"""

from __future__ import annotations

from typing import Any

from ..config import Config
from ..context import StageContext
from ..distributed import barrier, init_distributed, resolve_device, run_on_main
from ..draft import draft_type_of
from ..formats.draft import FINAL_DIR, save_final
from ..formats.vocab import load_vocab
from ..training.build import build_draft, read_layers
from ..training.data import open_states
from ..training.loop import Trainer
from ..training.resume import move_aside, resume_settings, run_fingerprint


def run_train(cfg: Config, ctx: StageContext) -> dict[str, Any]:
    env = init_distributed(cfg.run.dist_timeout_minutes)
    if ctx.force:
        run_on_main(move_aside, ctx.out_dir)
    # every shard checked before the first step, on threads and split over the ranks: a bad one
    # is named, with its repair command, before any step
    store = open_states(cfg, ctx.upstream, ctx.out_dir, env.rank)
    d2t, t2d = load_vocab(ctx.upstream["vocab"])
    device = resolve_device(cfg.train.device)
    head = store.target_head(device)
    model = build_draft(cfg, store, d2t, t2d, head)
    head.embed = None  # copied into the draft; the host copy is not needed any more
    fingerprint = run_fingerprint(model, store, d2t, cfg, env.world_size, device)
    trainer = Trainer(cfg, store, model, head, ctx.out_dir)
    stats = trainer.run(fingerprint, resume_settings(cfg, env.world_size), extend=ctx.extend)
    state = trainer.parallel.full_state()
    if env.is_main:
        save_final(ctx.out_dir / FINAL_DIR, state, model.config, read_layers(store, cfg), draft_type_of(model).NAME)
    barrier()
    stats["parameters_trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return stats
