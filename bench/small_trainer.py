"""`eaglet train` at SmolLM2-135M-Instruct's width on a random target: where the real trainer's
steps go beside the draft's own step (bench/train_throughput.py --preset smollm2-135m).

    python bench/small_trainer.py --out /tmp/st --mode online --steps 300
    python bench/small_trainer.py --out /tmp/st --mode offline --steps 300 --host-profile 60

Builds a Llama with SmolLM2-135M-Instruct's shape (30 layers, hidden 576, 9 heads, 3 KV heads,
intermediate 1536, vocabulary 49152), random bf16 weights, with a small chat tokenizer (its
vocabulary a subset of the model's), then `eaglet run --until train` on synthetic conversations
with the A/B's training shape (8,192-token micro-batches, TTT 7, 32k draft vocabulary), the
states computed online (the target beside the draft, as bench/ab.py trains) or read from an
offline store. Prints and saves (OUT/small-MODE.json) training's tokens/s per logging interval
and the graphs compiled in each. --host-profile N: the train stage runs again for N steps on
the filled compile cache under cProfile, and the functions by own and cumulative host time
are printed (the draft step alone is bench/train_throughput.py --host-profile).

The synthetic conversations are shorter than ShareGPT's (many documents per micro-batch).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import shutil
import time
from pathlib import Path

import torch

from eaglet import pipeline
from eaglet.config import load_config
from eaglet.testing import tiny
from eaglet.utils import atomic_write_json, log

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
               rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
SMOKE = dict(SMOLLM2, vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@torch.no_grad()
def build_target(out: Path, dims: dict, device: str, seed: int = 0) -> Path:
    """A random bf16 Llama of these dims, saved with a small chat tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    if (out / "config.json").is_file():
        return out
    tok = tiny.build_tokenizer("chatml", vocab_size=2048, seed=seed)
    cfg = LlamaConfig(**dims, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(device)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def intervals(run_dir: Path) -> dict:
    rows = [json.loads(x) for x in (run_dir / "train" / "log.jsonl").read_text().splitlines()]
    tr = [r for r in rows if r["split"] == "train"]
    return {"steps_logged": [r["step"] for r in tr], "tokens_per_s": [round(r["tokens_per_s"]) for r in tr],
            "seconds_per_interval": [round(r["tokens"] / r["tokens_per_s"], 2) for r in tr],
            "compile_graphs": [r.get("compile_graphs") for r in tr], "loss": [r["loss"] for r in tr]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--mode", choices=["online", "offline"], default="online", help="extract.mode")
    ap.add_argument("--conversations", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--host-profile", type=int, default=0, metavar="N")
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--smoke", action="store_true", help="Small dims on the CPU: checks this script only.")
    ap.add_argument("--set", action="append", default=[], help="Extra config override (after this script's own).")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    dev = "cuda" if cuda else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    target = build_target(args.out / "target", SMOKE if args.smoke else SMOLLM2, dev)
    data = tiny.write_jsonl(args.out / "data.jsonl", tiny.make_conversations(args.conversations, seed=1, max_turns=8))
    run_dir = args.out / f"run-{args.mode}"

    def config(steps: int):
        return load_config(None, [
            f"run.dir={run_dir}", f"target.path={target}", "target.dtype=bfloat16", f"prepare.data=[{data}]",
            f"target.device={dev}", f"train.device={dev}", f"eval.device={dev}", f"extract.mode={args.mode}",
            "vocab.size=32000", "train.max_tokens=8192", "train.ttt_steps=7", f"train.max_steps={steps}",
            f"train.epochs={steps}", f"train.log_every={args.log_every}", "train.warmup_steps=10",
            "train.tensorboard=false", "train.eval_every=0", "train.keep_last=1",
            "extract.selfcheck_min_cosine=0.98", "extract.selfcheck_min_top1=0.5", *args.set])

    res: dict = {"mode": args.mode, "torch": torch.__version__, "overrides": args.set,
                 "device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    cfg = config(args.steps)
    pipeline.run_all(cfg, upto="vocab")
    t0 = time.time()
    pipeline.run_all(cfg, upto="train")
    res["train_s"] = round(time.time() - t0, 1)
    res["train"] = intervals(run_dir)
    log(f"[small] {args.mode}: {res['train_s']} s; tokens/s by interval {res['train']['tokens_per_s']}")
    if args.host_profile:
        shutil.rmtree(run_dir / "train")
        prof = cProfile.Profile()
        prof.enable()
        pipeline.run_all(config(args.host_profile), upto="train")
        prof.disable()
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
            print(f"host profile, {args.host_profile} steps, by {key}:\n" + buf.getvalue().split("\n", 6)[-1])
        res["profiled"] = intervals(run_dir)
    atomic_write_json(args.out / f"small-{args.mode}.json", res)


if __name__ == "__main__":
    main()
