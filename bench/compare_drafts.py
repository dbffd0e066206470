"""Two trained drafts of one target on the same prompts, compared prompt by prompt.

    python bench/compare_drafts.py RUN_A RUN_B --target DIR --data FILE --skip N --out OUT.json

An A/B of two runs (bf16 against fp8 states, one lever against another) differs by less than
the spread between prompts, so the two tau are compared on the same prompts: the mean of the
per-prompt differences and its standard error. The prompts are the opening user turns of the
records of --data after the first --skip (a run trained on the first N records has seen none
of them), each rendered with the target's chat template and generation prompt, each distinct,
at most --max-prompt-tokens long. Each draft is RUN/train/final. Prints a line per prompt and
the summary; writes OUT.json.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

import torch

from eaglet.config import EvalSection, TargetSection
from eaglet.formats.draft import load_final
from eaglet.formats.eval_sets import opening_prompts
from eaglet.evaluation.inprocess import evaluate_draft
from eaglet.targets.chat import generation_prompt, load_tokenizer, resolve_chat_template
from eaglet.targets.load import load_target
from eaglet.utils import atomic_write_json, log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_a", type=Path)
    ap.add_argument("run_b", type=Path)
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--skip", type=int, required=True, help="records the runs trained on (their prepare.max_records)")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--chain-tokens", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    tcfg = TargetSection(path=args.target, dtype=args.dtype)
    tokenizer = load_tokenizer(tcfg)
    template = resolve_chat_template(tokenizer, tcfg)
    prompts = opening_prompts(args.data, lambda msgs: generation_prompt(tokenizer, template, msgs), args.skip,
                              args.num_prompts, args.max_prompt_tokens)
    if len(prompts) < 2:
        raise SystemExit(f"compare_drafts: {len(prompts)} usable prompt(s) in {args.data} after record {args.skip}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, _ = load_target(TargetSection(path=args.target, dtype=args.dtype, device=device))
    ecfg = EvalSection(method="chain", chain_tokens=args.chain_tokens, max_new_tokens=args.max_new_tokens,
                       num_prompts=len(prompts), baseline=False, lossless_check=False, dtype=args.dtype)
    taus = {}
    for name, run in (("a", args.run_a), ("b", args.run_b)):
        draft, aux = load_final(run / "train" / "final")
        log(f"[compare] {name}: {run}")
        res = evaluate_draft(target, tokenizer, draft, aux, prompts, ecfg, verbose=False)
        taus[name] = [p["tau"] for p in res["prompts"]]
    diffs = [b - a for a, b in zip(taus["a"], taus["b"])]
    mean_a = statistics.mean(taus["a"])
    se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    summary = {"prompts": len(prompts), "tau_a": mean_a, "tau_b": statistics.mean(taus["b"]),
               "mean_diff": statistics.mean(diffs), "se_diff": se, "rel_diff": statistics.mean(diffs) / mean_a,
               "rel_se": se / mean_a, "b_lower": sum(d < 0 for d in diffs), "b_higher": sum(d > 0 for d in diffs)}
    for k, (a, b) in enumerate(zip(taus["a"], taus["b"])):
        print(f"prompt {k:3d} ({len(prompts[k]):4d} tokens): a {a:.3f}  b {b:.3f}  b-a {b - a:+.3f}")
    print(f"tau a {summary['tau_a']:.3f}, b {summary['tau_b']:.3f}; b - a = {summary['mean_diff']:+.4f} "
          f"± {se:.4f} (standard error), {100 * summary['rel_diff']:+.2f}% ± {100 * summary['rel_se']:.2f}%; "
          f"b lower on {summary['b_lower']}, higher on {summary['b_higher']} of {len(prompts)}")
    atomic_write_json(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
                                 "tau_a": taus["a"], "tau_b": taus["b"], "prompt_tokens": [len(p) for p in prompts]})


if __name__ == "__main__":
    main()
