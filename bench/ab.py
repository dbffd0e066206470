"""A/B of training levers on one GPU: drafts trained on the same data, measured on the same prompts.

    python bench/ab.py --work W --target DIR --data FILE \
        --variant base --variant noise:train.state_noise=0.05 --seeds 0 1 [--steps 300] [--prompts 256]
    python bench/ab.py --work W --target DIR --data FILE --report      # ab.json and the table again

Each variant is `name` or `name:section.key=value,section.key=value` (its settings over the common
ones); `base` is the reference. Every draft trains for --steps steps on the first --records
records of --data (prepared once, in W/base; the states computed online), with train.seed set to
each --seed, so the seeds move the draft's initialisation and data order and nothing else.

Every draft is measured by replay (eaglet/engines/replay.py): tau of greedy chain decoding with
k = --k draft tokens, --max-new-tokens per prompt, exactly as decoding would give it, on --prompts
distinct opening user turns of the records after --records (no draft trained on them). The
target's side of the replay (greedy continuations and their states) is computed once and kept
in W/side/; each draft then costs one batched unroll. So an A/B separates a few percent within
one call: its figures are
  - per draft: tau, acceptance per position, the train log's simulated tau (train and held-out),
    train seconds and tokens/s;
  - per variant against base: the mean per-prompt difference of tau (averaged over the seeds)
    and its standard error over prompts, and the spread of tau between seeds.
Results accumulate in W/results/ (a draft already measured is not trained again), so one A/B
can span several calls; ab.json and ab.md hold the summary.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eaglet import pipeline
from eaglet.config import TargetSection, load_config
from eaglet.engines.replay import TargetSide, replay_chain, target_side
from eaglet.engines.specdec import acceptance_stats
from eaglet.formats.draft import FINAL_DIR, load_final
from eaglet.stages.eval_sets import opening_prompts
from eaglet.stages.evaluate import eos_ids
from eaglet.targets.chat import generation_prompt, load_tokenizer, resolve_chat_template
from eaglet.targets.load import load_target
from eaglet.utils import atomic_write_json, log

COMMON = [  # quality.sh's training settings (bench/quality.py), without its export and eval ones
    "prepare.max_length=2048", "prepare.num_workers=12", "target.dtype=bfloat16",
    "extract.mode=online", "extract.selfcheck_samples=8", "vocab.size=32000",
    "train.max_tokens=8192", "train.ttt_steps=7", "train.lr=0.0003", "train.warmup_steps=100",
    "train.log_every=50", "train.eval_every=0", "train.ckpt_every=100000", "train.eval_fraction=0.02",
    "train.tensorboard=false", "train.epochs=1000",
]
SHARED = ("prepare", "extract", "vocab")  # stages every draft shares: W/base's


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, sets = text.partition(":")
    return name, [s for s in sets.split(",") if s]


def _sets(args: argparse.Namespace, run: Path, extra: list[str] = ()) -> list[str]:
    return [f"run.dir={run}", f"target.path={args.target}", f"prepare.data=[{args.data}]",
            f"prepare.max_records={args.records}", f"train.max_steps={args.steps}", *COMMON, *(args.set or []),
            *extra]


def prepare_base(args: argparse.Namespace) -> None:
    pipeline.run_all(load_config(None, _sets(args, args.work / "base")), upto="vocab")


def train_draft(args: argparse.Namespace, name: str, sets: list[str], seed: int) -> Path:
    run = args.work / "runs" / f"{name}-s{seed}"
    run.mkdir(parents=True, exist_ok=True)
    for stage in SHARED:  # the same prepared data, states and vocabulary as every other draft
        link = run / stage
        if not link.exists():
            link.symlink_to(args.work / "base" / stage, target_is_directory=True)
    pipeline.run_all(load_config(None, _sets(args, run, [*sets, f"train.seed={seed}"])), upto="train")
    return run


def train_summary(run: Path) -> dict[str, Any]:
    manifest = json.loads((run / "train" / "manifest.json").read_text())
    recs = [json.loads(x) for x in (run / "train" / "log.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["split"] == "train"]
    evals = [r for r in recs if r["split"] == "eval"]
    rates = [r["tokens_per_s"] for r in train[1:] if r.get("tokens_per_s")]
    return {"steps": manifest["stats"].get("total_steps"), "seconds": manifest.get("seconds"),
            "tokens_per_s": statistics.median(rates) if rates else None,
            "sim_tau_train": train[-1].get("sim_tau") if train else None,
            "sim_tau_heldout": evals[-1].get("sim_tau") if evals else None,
            "acc_train": [train[-1].get(f"acc_{j}") for j in range(7)] if train else None}


# ---- the target's side, computed once --------------------------------------------------------


def side_key(args: argparse.Namespace) -> dict[str, Any]:
    return {"target": str(args.target), "data": str(args.data), "records": args.records, "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens, "k": args.k, "max_prompt_tokens": args.max_prompt_tokens}


def load_or_make_side(args: argparse.Namespace, aux_layers: list[int], target: Any, tok: Any) -> TargetSide:
    folder = args.work / "side"
    meta = folder / "side.json"
    key = {**side_key(args), "aux_layers": aux_layers}
    if meta.is_file():
        saved = json.loads(meta.read_text())
        if saved["key"] == key:
            aux = load_file(str(folder / "aux.safetensors"))
            return TargetSide(saved["prompts"], saved["sequences"], [aux[f"s{i}"] for i in range(len(saved["sequences"]))],
                              args.max_new_tokens, args.k)
        log(f"[ab] {meta}: made for other settings; making it again")
    tcfg = TargetSection(path=str(args.target))
    template = resolve_chat_template(tok, tcfg)
    prompts = opening_prompts(args.data, lambda msgs: generation_prompt(tok, template, msgs), args.records,
                              args.prompts, args.max_prompt_tokens)
    t0 = time.perf_counter()
    side = target_side(target, aux_layers, prompts, args.max_new_tokens, args.k, batch=args.batch)
    log(f"[ab] target side: {len(prompts)} prompts, {sum(map(len, side.sequences))} tokens in "
        f"{time.perf_counter() - t0:.1f} s")
    folder.mkdir(parents=True, exist_ok=True)
    save_file({f"s{i}": a.contiguous() for i, a in enumerate(side.aux)}, str(folder / "aux.safetensors"))
    atomic_write_json(meta, {"key": key, "prompts": side.prompts, "sequences": side.sequences})
    return side


def measure(draft: Any, side: TargetSide, eos: list[int], k: int, dev: torch.device, dtype: torch.dtype
            ) -> dict[str, Any]:
    t0 = time.perf_counter()
    runs = replay_chain(draft.to(dev, dtype).eval(), side, k=k, eos=eos)
    accepted = [a for acc, _ in runs for a in acc]
    agg = acceptance_stats(accepted, k)
    return {"tau": agg["tau"], "acceptance_rate": agg["acceptance_rate"], "position_reached": agg["position_reached"],
            "per_prompt": [acceptance_stats(acc, k)["tau"] for acc, _ in runs],
            "replay_s": round(time.perf_counter() - t0, 2)}


# ---- the summary ----------------------------------------------------------------------------


def summarize(results: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    base = results.get("base", {})
    for name, by_seed in results.items():
        taus = [r["tau"] for r in by_seed.values()]
        row: dict[str, Any] = {"seeds": sorted(by_seed), "tau": statistics.mean(taus),
                               "seed_sd": statistics.stdev(taus) if len(taus) > 1 else None,
                               "sim_tau_heldout": statistics.mean(r["train"]["sim_tau_heldout"] or 0 for r in by_seed.values()),
                               "tokens_per_s": statistics.mean(r["train"]["tokens_per_s"] or 0 for r in by_seed.values())}
        paired = sorted(set(by_seed) & set(base))
        if name != "base" and paired:
            per_prompt = [statistics.mean(by_seed[s]["per_prompt"][i] - base[s]["per_prompt"][i] for s in paired)
                          for i in range(len(base[paired[0]]["per_prompt"]))]
            ref = statistics.mean(base[s]["tau"] for s in paired)
            diff = statistics.mean(by_seed[s]["tau"] for s in paired) - ref
            se = statistics.stdev(per_prompt) / math.sqrt(len(per_prompt))
            row.update(paired_seeds=paired, diff=diff, rel_diff=diff / ref,
                       prompt_mean_diff=statistics.mean(per_prompt), se=se, rel_se=se / ref,
                       per_seed_diff=[by_seed[s]["tau"] - base[s]["tau"] for s in paired])
        out[name] = row
    return out


def table(summary: dict[str, Any], results: dict[str, dict[int, dict[str, Any]]]) -> str:
    lines = ["| variant | seeds | tau | seed sd | vs base | ± se (prompts) | acceptance 1..3 | sim tau (held-out) | tok/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in summary.items():
        first = next(iter(results[name].values()))["acceptance_rate"]
        acc = [statistics.mean(x["acceptance_rate"][j] or 0 for x in results[name].values())
               for j in range(min(3, len(first)))]
        vs = f"{100 * r['rel_diff']:+.1f}%" if "rel_diff" in r else ""
        se = f"{100 * r['rel_se']:.1f}%" if "rel_se" in r else ""
        sd = f"{r['seed_sd']:.3f}" if r["seed_sd"] is not None else ""
        lines.append(f"| {name} | {len(r['seeds'])} | {r['tau']:.3f} | {sd} | {vs} | {se} | "
                     f"{' '.join(f'{a:.2f}' for a in acc)} | {r['sim_tau_heldout']:.3f} | {r['tokens_per_s']:.0f} |")
    return "\n".join(lines)


def read_results(work: Path) -> dict[str, dict[int, dict[str, Any]]]:
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for p in sorted((work / "results").glob("*.json")):
        r = json.loads(p.read_text())
        out.setdefault(r["variant"], {})[int(r["seed"])] = r
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--variant", action="append", default=[], help="name[:section.key=value,...]")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--records", type=int, default=8000, help="records trained on; the prompts come after them")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--batch", type=int, default=64, help="prompts per batch of the greedy continuations")
    ap.add_argument("--set", action="append", help="a section.key=value for every draft")
    ap.add_argument("--report", action="store_true", help="only write ab.json and ab.md from W/results")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if not args.report:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        prepare_base(args)
        tok = load_tokenizer(TargetSection(path=str(args.target)))
        target = side = eos = None
        for text in args.variant:
            name, sets = parse_variant(text)
            for seed in args.seeds:
                out = args.work / "results" / f"{name}-s{seed}.json"
                if out.is_file():
                    log(f"[ab] {name} seed {seed}: measured already ({out})")
                    continue
                t0 = time.perf_counter()
                run = train_draft(args, name, sets, seed)
                draft, aux = load_final(run / "train" / FINAL_DIR)
                if side is None:
                    target, _ = load_target(TargetSection(path=str(args.target), dtype=str(dtype).removeprefix("torch."),
                                                          device=str(dev)))
                    side = load_or_make_side(args, list(aux), target, tok)
                    eos = eos_ids(target, tok)
                res = {"variant": name, "seed": seed, "sets": sets, "train": train_summary(run),
                       **measure(draft, side, eos, args.k, dev, dtype), "wall_s": round(time.perf_counter() - t0, 1)}
                atomic_write_json(out, res)
                log(f"[ab] {name} seed {seed}: tau {res['tau']:.3f} (sim tau held-out "
                    f"{res['train']['sim_tau_heldout']}), {res['wall_s']} s")
    results = read_results(args.work)
    summary = summarize(results)
    atomic_write_json(args.work / "ab.json", {"args": {k: str(v) for k, v in vars(args).items()},
                                              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                                              "summary": summary, "results": results})
    md = table(summary, results)
    (args.work / "ab.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
