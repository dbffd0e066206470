"""Sampled replay against the sampling decoder on the demo's draft (SmolLM2-135M-Instruct, CPU, fp32).

    python check.py RUN_DIR TARGET_DIR N OUT.json

The first N MT-bench questions' first turns, 48 new tokens, temperature 1, chain of 3 and the
EAGLE-2 tree (top-k 10, depth 3, 60 tokens): eaglet's decoder (eval.replay false) and the replay
(eval.replay true), each at seeds 0 and 1. Each is one sample of the same law, so they should
agree within the spread between seeds.
"""
import json
import sys
import time
from pathlib import Path

from eaglet.config import EvalSection, TargetSection
from eaglet.formats.draft import FINAL_DIR, load_final
from eaglet.formats.eval_sets import mt_bench_items
from eaglet.evaluation.inprocess import evaluate_draft
from eaglet.targets.chat import generation_prompt, load_tokenizer, resolve_chat_template
from eaglet.targets.load import load_target

run, target_dir, n, out = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
draft, aux = load_final(run / "train" / FINAL_DIR)
ts = TargetSection(path=target_dir, dtype="float32")
model, _ = load_target(ts)
tok = load_tokenizer(ts)
template = resolve_chat_template(tok, ts)
prompts = [generation_prompt(tok, template, [{"role": "user", "content": it.asks[0]}]) for it in mt_bench_items(n)]
rows = []
for method in ("chain", "tree"):
    for replay in (False, True):
        for seed in (0, 1):
            e = EvalSection(method=method, chain_tokens=3, tree_depth=3, temperature=1.0, max_new_tokens=48,
                            baseline=False, lossless_check=False, replay=replay)
            t0 = time.perf_counter()
            res = evaluate_draft(model, tok, draft, aux, prompts, e, seed=seed, verbose=False)
            agg = res["aggregate"]
            rows.append({"method": method, "replay": replay, "seed": seed, "prompts": len(prompts), "tau": agg["tau"],
                         "acceptance_rate": agg["acceptance_rate"], "seconds": round(time.perf_counter() - t0, 1)})
            print(json.dumps(rows[-1]), flush=True)
out.write_text(json.dumps(rows, indent=1) + "\n")
