"""A realistic-width random target through doctor, extract and a few train steps (issue 6).

    python bench/fullwidth.py --out /tmp/fw                       # DeepSeek-V3 width, 4 layers
    python bench/fullwidth.py --out /tmp/fw --layers 4 --experts 256

Builds a DeepSeek-V3-architecture model at full width (hidden 7168, MLA with q/kv LoRA ranks
1536/512, 128 heads, the first layer dense with intermediate 18432, the others MoE with
`--experts` routed experts of width 2048 plus one shared, 8 per token) but only `--layers`
decoder layers, random bf16 weights made directly on the GPU, saved as a checkpoint with a
small tokenizer (its vocabulary is a subset of the model's 129280). Then runs, in this
process: `eaglet doctor` (with its shadow run on a tiny model of the family), and
`eaglet run --until train` on synthetic chat data: prepare, extract (offline store, captured
layers 1..L-1 and the final state, with the self-check), vocab and `--steps` training steps
(as many epochs as they take). Prints and saves (OUT/fullwidth.json) the extraction and training
tokens/s (training's per logging interval, with the graphs compiled in it) and the peak GPU
memory of each stage.

It keeps one checkpoint (`train.keep_last=1`): with the 32k draft vocabulary it was run with on
an H200, one checkpoint is ~10.8 GiB (963M trainable fp32 parameters and two AdamW moments) and
the final draft ~7.0 GiB; with the default of 3 kept, the run outgrew the machine's 64 GiB disk
beside the 23 GB target and the store. The doctor's `disk (train)` line counts this, and the
train stage's preflight stops on it.

The training bench at the same draft shape, for the steady state the trainer should reach:

    python bench/train_throughput.py --preset deepseek-v3 --tokens 4096 --doc-tokens 128 --packed 16 \
        --loss-share 0.44 --in-vocab 0.25 --warmup 12 --steps 96

(the loss share of this script's conversations, and the share of a random target's argmax
tokens that fall in a 32k draft vocabulary: `--set vocab.size=32000`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from eaglet import pipeline
from eaglet.doctor import run_doctor
from eaglet.config import load_config
from eaglet.shadow import shadow_findings
from eaglet.testing import tiny
from eaglet.utils import atomic_write_json, log


FULL = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
            num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts_per_tok=8, n_group=8, topk_group=4)
# --smoke: the same structure small enough for a CPU (a check of this script, not a measurement).
SMOKE = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32,
             qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_experts_per_tok=2, n_group=2, topk_group=1)


def deepseek_v3_config(layers: int, experts: int, dims: dict):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(num_hidden_layers=layers, first_k_dense_replace=1, n_routed_experts=experts,
                            n_shared_experts=1, max_position_embeddings=4096, rms_norm_eps=1e-6,
                            tie_word_embeddings=False, **dims)


@torch.no_grad()
def build_target(out: Path, layers: int, experts: int, dims: dict, device: str, seed: int = 0) -> Path:
    """Random bf16 weights made on the GPU (meta init, then normal(0, 0.02)), saved with a tokenizer."""
    from transformers import AutoModelForCausalLM

    if (out / "config.json").is_file():
        return out
    tok = tiny.build_tokenizer("chatml", vocab_size=2048, seed=seed)
    cfg = deepseek_v3_config(layers, experts, dims)
    cfg.eos_token_id, cfg.pad_token_id = tok.eos_token_id, tok.pad_token_id
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.fill_(1.0 if "norm" in name else 0.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    # Buffers (rotary inv_freq) are left uninitialised: they are not saved, and loading recomputes them.
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out, max_shard_size="20GB")
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    log(f"[fullwidth] {n / 1e9:.2f}B parameters saved to {out}")
    return out


def compile_seconds() -> dict[str, float]:
    """torch.compile's time in this process by phase (dynamo's own metrics: tracing, the
    inductor compile, waiting for its kernels), where this torch reports them."""
    try:
        from torch._dynamo.utils import compile_times

        text = compile_times(repr="str", aggregate=True)
    except (ImportError, TypeError):
        return {}
    out = {}
    for line in str(text).splitlines()[2:]:
        name, _, value = line.rpartition(",")
        try:
            out[name.strip()] = round(float(value), 1)
        except ValueError:
            continue
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--conversations", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=4096, help="train.max_tokens")
    ap.add_argument("--log-every", type=int, default=10,
                    help="train.log_every: its log lines are the loop's only host syncs, so 1 (each step's time) "
                         "makes the host wait for every step and stops its loading from overlapping the GPU's work")
    ap.add_argument("--smoke", action="store_true", help="Small dims on the CPU: checks this script only.")
    ap.add_argument("--set", action="append", default=[], help="Extra config override (after this script's own).")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.smoke
    dev = "cuda" if cuda else "cpu"
    res: dict = {"layers": args.layers, "experts": args.experts, "torch": torch.__version__,
                 "device": torch.cuda.get_device_name(0) if cuda else "cpu", "dims": SMOKE if args.smoke else FULL}
    t0 = time.time()
    target = build_target(args.out / "target", args.layers, args.experts, res["dims"], dev)
    res["build_s"] = round(time.time() - t0, 1)
    data = tiny.write_jsonl(args.out / "data.jsonl", tiny.make_conversations(args.conversations, seed=1, max_turns=4))
    sets = [f"run.dir={args.out / 'run'}", f"target.path={target}", "target.dtype=bfloat16", f"prepare.data=[{data}]",
            f"target.device={dev}", f"train.device={dev}", f"eval.device={dev}",
            f"extract.layers={list(range(1, args.layers))}", "extract.batch_tokens=32768", "vocab.size=2048",
            f"train.max_steps={args.steps}", f"train.epochs={args.steps}", f"train.max_tokens={args.max_tokens}",
            f"train.log_every={args.log_every}",
            "train.warmup_steps=2", "train.lr=0.0003", "train.tensorboard=false", "train.eval_every=0",
            "train.keep_last=1", *args.set]
    res["overrides"] = args.set
    cfg = load_config(None, sets)
    lines: list[str] = []
    res["doctor_rc"] = run_doctor(cfg, out=lambda s: (lines.append(s), print(s)), more=shadow_findings)
    res["doctor"] = lines
    stages = {}
    for stage in ("prepare", "extract", "vocab", "train"):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t1 = time.time()
        pipeline.run_all(cfg, upto=stage)
        m = json.loads((cfg.run_dir / stage / "manifest.json").read_text())
        stages[stage] = {"seconds": round(time.time() - t1, 1), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                         "stats": {k: v for k, v in m["stats"].items() if k not in ("files", "selfcheck")}}
        if stage == "extract":
            stages[stage]["selfcheck"] = m["stats"]["selfcheck"]
    train_log = [json.loads(x) for x in (cfg.run_dir / "train" / "log.jsonl").read_text().splitlines()]
    tr = [r for r in train_log if r["split"] == "train"]
    stages["train"]["tokens_per_s"] = [round(r["tokens_per_s"]) for r in tr]
    stages["train"]["steps_logged"] = [r["step"] for r in tr]  # each figure is of the steps since the one before
    stages["train"]["seconds_per_interval"] = [round(r["tokens"] / r["tokens_per_s"], 2) for r in tr]
    stages["train"]["compile_graphs"] = [r.get("compile_graphs") for r in tr]
    stages["train"]["loss"] = [round(r["loss"], 4) for r in tr]
    res["stages"] = stages
    res["compile_seconds"] = compile_seconds()
    atomic_write_json(args.out / "fullwidth.json", res)
    print(json.dumps({k: v for k, v in res.items() if k != "doctor"}, indent=1))


if __name__ == "__main__":
    main()
