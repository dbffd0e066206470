"""Throughput of `eaglet regenerate`'s padded engine: KV cache kind x prompts per call.

    python bench/regen_throughput.py --target DIR --data SHAREGPT.json --prompts 2048 \
        --variants dynamic:1024,static:256,static:1024 --out regen-throughput.json

Takes the first user turn of the first --prompts usable records of --data (rendered with the
target's chat template, as regenerate renders them), and for each variant `cache:batch`
generates --new-tokens greedy tokens for every prompt with `batched_generate` (prompts sorted
longest first, as regenerate does). A static cache is sized per call, as in regenerate: the
smallest of a few doubling sizes that holds the call's prompts and replies, up to --max-length +
--new-tokens; `cache_sizes` lists the sizes the variant's calls took. The first call of a variant
is timed apart (a static cache compiles the decoding step there); tokens/s counts the reply
tokens up to EOS over the remaining calls, and so includes the compiling for each smaller cache
size that they reach. Prints one line per variant and saves the JSON (`--prompts-out`: the
prompts too).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from eaglet.config import load_config
from eaglet.engines.hf.generate import batched_generate, static_cache_len
from eaglet.formats.datasets import RecordError, normalize_record
from eaglet.regeneration.rounds import source_records
from eaglet.targets.chat import generation_prompt, load_tokenizer, resolve_chat_template
from eaglet.targets.load import load_target
from eaglet.utils import atomic_write_json, log


def first_turn_prompts(cfg, tokenizer, n: int) -> list[list[int]]:
    template = resolve_chat_template(tokenizer, cfg.target)
    prompts: list[list[int]] = []
    for _file, _row, item in source_records(cfg):
        if isinstance(item, RecordError):  # a record prepare would report: not a prompt here
            continue
        try:
            msgs = normalize_record(item, cfg.prepare.format, cfg.prepare.multimodal)
        except RecordError:
            continue
        first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
        if not first:
            continue
        ids = generation_prompt(tokenizer, template, msgs[:first])
        if len(ids) < cfg.prepare.max_length:
            prompts.append(ids)
        if len(prompts) == n:
            break
    return prompts


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--prompts", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=2048,
                    help="prepare.max_length (+ --new-tokens: the largest static cache)")
    ap.add_argument("--variants", default="dynamic:1024,static:256,static:1024")
    ap.add_argument("--set", action="append", default=[], help="Extra config override (e.g. target.dtype=float32).")
    ap.add_argument("--out", type=Path, default=Path("regen-throughput.json"))
    ap.add_argument("--prompts-out", type=Path, default=None,
                    help="Also write the prompts taken (token ids, in --data's order) to this JSON file.")
    args = ap.parse_args(argv)
    cfg = load_config(None, [f"target.path={args.target}", f"prepare.data=[{args.data}]",
                             f"prepare.max_length={args.max_length}", *args.set])
    tokenizer = load_tokenizer(cfg.target)
    tokenizer.padding_side = "left"
    prompts = first_turn_prompts(cfg, tokenizer, args.prompts)
    if args.prompts_out:
        atomic_write_json(args.prompts_out, {"prompts": prompts})
    model, info = load_target(cfg.target)
    model.eval()
    res = {"target": info["class"], "device": str(info["device"]), "prompts": len(prompts),
           "prompt_tokens": sum(map(len, prompts)), "new_tokens": args.new_tokens, "torch": torch.__version__,
           "variants": []}
    log(f"[regen-bench] {len(prompts)} prompts ({res['prompt_tokens']} tokens) on {info['device']}")
    for spec in args.variants.split(","):
        kind, batch = spec.split(":")
        batch = int(batch)
        static_len = args.max_length + args.new_tokens if kind == "static" else None
        order = sorted(prompts, key=len, reverse=True)
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        t0 = time.perf_counter()
        first = batched_generate(model, tokenizer, order[:batch], args.new_tokens, 0.0, batch, static_len)
        sync()
        t1 = time.perf_counter()
        rest = batched_generate(model, tokenizer, order[batch:], args.new_tokens, 0.0, batch, static_len)
        sync()
        t2 = time.perf_counter()
        tokens = sum(n for _, n in rest)
        row = {"variant": spec, "first_call_s": round(t1 - t0, 2), "first_call_tokens": sum(n for _, n in first),
               "seconds": round(t2 - t1, 2), "tokens": tokens, "calls": -(-len(rest) // batch),
               "tokens_per_s": round(tokens / (t2 - t1), 1) if rest else None,
               "cache_sizes": sorted({static_cache_len(len(order[a]), args.new_tokens, static_len)
                                      for a in range(0, len(order), batch)}) if static_len else None,
               "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None}
        res["variants"].append(row)
        log(f"[regen-bench] {spec}: {row['tokens_per_s']} tok/s over {row['calls']} calls "
            f"(first call {row['first_call_s']} s)")
        atomic_write_json(args.out, res)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return res


if __name__ == "__main__":
    main()
