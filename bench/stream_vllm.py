"""Engine-fed training against an offline store, and an MLA target through vLLM against the HF backend.

    python bench/stream_vllm.py --out OUT                   # a GPU with vLLM (>= 0.25): both parts
    python bench/stream_vllm.py --out OUT --engine fake     # CPU: the same steps, eaglet.testing.fake_vllm as engine

Part `stream`: by default a target of SmolLM2-135M-Instruct's shape (30 layers, hidden 576,
tied embeddings; random weights and eaglet's tiny tokenizer) and tiny chat data; `--target
DIR --data FILE` take a real checkpoint folder (the demo's converted SmolLM2, say) and chat
data instead. (a) extract an offline vLLM store and train N steps from it; (b) train the same
N steps from the stream (in-process vLLM beside the draft on one GPU); (c) the stream in fp8.
Reported: the largest relative loss difference of (b) and (c) against (a), training tokens/s
(median of the logged steps after the first third, which compile), the median over those
steps of each step's rate against the store's at the same step (the same tokens: the paired
ratio, free of the spread that packing gives the rates), the engine's tokens/s, the buffer's
peak bytes against its bound, the time training waited. (d) `stream_thread`, only when
`--runs` names it: (b) with the engine's client in a thread of the trainer. `--runs` picks
which run now (the others are read from their run folders, so a run can be split over calls);
`--eval-prompts N` then evaluates (b) and (c) (chain of 7, greedy, N held-out prompts): tau
in bf16 against fp8 states.

Part `mla`: a DeepSeek-V3-architecture checkpoint (MLA with DeepSeek's head dims, MoE from
layer 1, random weights, a few layers) extracted through vLLM and through the HF backend:
the same token ids; per captured layer, the cosine of the aux states (layer 1's input is
computed by dense layers only; later ones follow random, near-tied routers, so a share of
tokens flips experts: reported); the teacher's top-1 agreement; then N steps trained from
the stream against the vLLM store.

Prints one table and writes OUT/stream_vllm.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from eaglet import pipeline
from eaglet.checks.selfcheck import teacher_argmax
from eaglet.config import load_config
from eaglet.formats.store import StoreReader
from eaglet.testing import tiny
from eaglet.utils import atomic_write_json, log

SMOLLM2 = dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, tie_word_embeddings=True, vocab_size=49152,
               max_position_embeddings=8192)
MLA = dict(num_hidden_layers=6, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256,
           num_attention_heads=8, num_key_value_heads=8, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
           qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
           n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=8192, tie_word_embeddings=False,
           topk_method="noaux_tc")  # vLLM 0.25 loads e_score_correction_bias only then; MLA needs kv rank + rope = 576
MLA_LAYERS = [1, 3, 5]  # 1: after the dense layer 0 only; 3, 5: after MoE layers


def _config(root: Path, name: str, target: Path, data: Path, args: argparse.Namespace, extra: list[str],
            steps: int | None = None, real: bool = False) -> Any:
    engine = (["extract.vllm_server=" + args.url] if args.url else
              [f"extract.vllm_engine_args={json.dumps(args.engine_args)}"])
    vocab = (["vocab.size=32000", f"prepare.max_records={args.conversations}"] if real else
             ["vocab.size=2048",
              "train.mask_out_of_vocab=false"])  # a random target's argmax falls anywhere in its 49k vocabulary
    return load_config(None, [
        f"run.dir={root / name}", "run.seed=0", f"target.path={target}", f"target.dtype={args.dtype}",
        f"prepare.data=[{data}]", "prepare.max_length=2048", "extract.backend=vllm", "extract.fsync=false",
        "extract.selfcheck_samples=4", f"extract.selfcheck_min_top1={args.min_top1}", *engine, *vocab,
        f"train.max_steps={steps or args.steps}", f"train.max_tokens={args.max_tokens}", "train.log_every=1",
        "train.eval_every=0", "train.ckpt_every=1000000", "train.tensorboard=false", "train.warmup_steps=5",
        f"train.device={args.device}", "eval.chain_tokens=7", "eval.max_new_tokens=128",
        f"eval.num_prompts={max(args.eval_prompts, 1)}", *extra])


def _log(cfg: Any) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in (cfg.run_dir / "train" / "log.jsonl").read_text().splitlines()]
    return [r for r in lines if r["split"] == "train"]


def _stats(cfg: Any, stage: str) -> dict[str, Any]:
    return json.loads((cfg.run_dir / stage / "manifest.json").read_text())["stats"]


def _later(rows: list[Any]) -> list[Any]:
    """The logged steps after the first third (which compile)."""
    return rows[len(rows) // 3:] or rows


def _rate(rows: list[dict[str, Any]]) -> float:
    return float(statistics.median(r["tokens_per_s"] for r in _later(rows)))


def _mean_rate(rows: list[dict[str, Any]]) -> float:
    """Tokens over time of the later steps: the slow ones weigh what they cost (the median does
    not see them)."""
    later = _later(rows)
    return sum(r["tokens"] for r in later) / sum(r["tokens"] / r["tokens_per_s"] for r in later)


def _paired(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float:
    """The median, over the later steps, of b's rate over a's at the same step."""
    return float(statistics.median(y["tokens_per_s"] / x["tokens_per_s"] for x, y in _later(list(zip(a, b)))))


def _loss_gap(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float:
    assert [r["step"] for r in a] == [r["step"] for r in b], "the runs logged other steps"
    return max(abs(x["loss"] - y["loss"]) / max(abs(x["loss"]), 1e-12) for x, y in zip(a, b))


def _run(cfg: Any, upto: str = "train") -> float:
    """The stages up to `upto` in a child process, so that each run's engine and CUDA memory
    are gone before the next starts. Returns its seconds."""
    t0 = time.perf_counter()
    proc = multiprocessing.get_context("spawn").Process(target=pipeline.run_all, args=(cfg,), kwargs={"upto": upto})
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise SystemExit(f"bench: the run in {cfg.run_dir} failed (exit {proc.exitcode}); its log is above")
    return time.perf_counter() - t0


def _target(out: Path, family: str, dims: dict[str, Any]) -> Path:
    """A random target of `dims` with eaglet's tiny tokenizer, saved once."""
    if (out / "config.json").is_file():
        return out
    return tiny.save_target(out, family=family, template="chatml",
                            tokenizer=tiny.build_tokenizer("chatml", vocab_size=2048), **dims)


def part_stream(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    real, target = args.real, args.target
    data = args.data or tiny.write_jsonl(root / "chats.jsonl",
                                         tiny.make_conversations(args.conversations, seed=1, max_turns=8))
    runs = {"store": [], "stream": ["extract.mode=online", f"extract.stream_buffer_gb={args.buffer_gb}"],
            "stream_fp8": ["extract.mode=online", f"extract.stream_buffer_gb={args.buffer_gb}",
                           "extract.store_dtype=float8_e4m3fn"],
            "stream_thread": ["extract.mode=online", f"extract.stream_buffer_gb={args.buffer_gb}",
                              "extract.stream_client_process=false"]}
    out: dict[str, Any] = {}
    logs = {}
    for name, extra in runs.items():
        cfg = _config(root, name, target, data, args, extra, real=real)
        if name in args.runs:
            out[name] = {"seconds": round(_run(cfg), 1)}
        elif (cfg.run_dir / "train" / "manifest.json").is_file():
            out[name] = {"seconds": None}  # trained by an earlier call
        else:
            continue
        logs[name] = _log(cfg)
        st = _stats(cfg, "train")
        out[name].update(train_tokens_per_s=round(_rate(logs[name]), 1),
                         mean_tokens_per_s=round(_mean_rate(logs[name]), 1), final_loss=logs[name][-1]["loss"],
                         steps=st["steps"])
        if name == "store":
            ex = _stats(cfg, "extract")
            out[name]["extract_tokens_per_s"] = ex["tokens_per_s"]
            out[name]["extract_tokens"] = ex["tokens"]
        else:
            s = st["stream"]
            out[name].update(engine_tokens_per_s=s["engine_tokens_per_s"], buffer_peak_bytes=s["buffer_peak_bytes"],
                             buffer_bound_bytes=s["buffer_bound_bytes"], dropped=s["dropped"],
                             waited_s=round(sum(r.get("stream_wait_s", 0.0) for r in logs[name]), 2),
                             selfcheck_top1=s["selfcheck"]["top1_agreement"])
            if "store" in logs:
                out[name]["loss_rel_diff_vs_store"] = _loss_gap(logs["store"], logs[name])
                out[name]["tokens_per_s_vs_store"] = round(out[name]["train_tokens_per_s"]
                                                           / out["store"]["train_tokens_per_s"], 3)
                out[name]["paired_vs_store"] = round(_paired(logs["store"], logs[name]), 3)
                out[name]["mean_vs_store"] = round(out[name]["mean_tokens_per_s"] / out["store"]["mean_tokens_per_s"], 3)
            if args.eval_prompts and name in ("stream", "stream_fp8"):
                _run(cfg, "eval")
                ev = _stats(cfg, "eval")
                out[name]["eval"] = {k: ev.get(k) for k in ("tau", "acceptance_rate", "num_prompts", "lossless")}
    return out


def _cosines(a: torch.Tensor, b: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Per captured layer, the cosine of each token's state ([T] each)."""
    xs, ys = a.float().chunk(n, dim=-1), b.float().chunk(n, dim=-1)
    return [torch.nn.functional.cosine_similarity(x, y, dim=-1) for x, y in zip(xs, ys)]


def part_mla(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    target = _target(root / "deepseek-v3-mla", "deepseek_v3", MLA)
    data = tiny.write_jsonl(root / "mla-chats.jsonl", tiny.make_conversations(args.mla_conversations, seed=2,
                                                                              max_turns=4))
    layers = f"extract.layers={MLA_LAYERS}"
    vcfg = _config(root, "mla-vllm", target, data, args, [layers])
    _run(vcfg, "extract")
    hcfg = _config(root, "mla-hf", target, data, args, [layers, "extract.backend=hf", "extract.selfcheck_samples=0"])
    _run(hcfg, "extract")
    a, b = StoreReader(vcfg.run_dir / "extract"), StoreReader(hcfg.run_dir / "extract")
    ha, hb = (r.target_head(torch.device("cpu")) for r in (a, b))
    heads = [{"lm_head": h.lm_head.float(), "norm": None if h.norm is None else h.norm.float()} for h in (ha, hb)]
    same_ids, agree, total = True, 0, 0
    cos: list[list[torch.Tensor]] = [[] for _ in MLA_LAYERS]
    for sid in a.sample_ids.tolist():
        x, y = a.get(sid), b.get(sid)
        same_ids &= bool(torch.equal(x["input_ids"], y["input_ids"]))
        for k, c in enumerate(_cosines(x["aux"], y["aux"], len(MLA_LAYERS))):
            cos[k].append(c)
        pa = teacher_argmax(x["final"].float(), heads[0], True, ha.norm_eps)
        pb = teacher_argmax(y["final"].float(), heads[1], False, hb.norm_eps)
        agree += int((pa == pb).sum())
        total += int(pa.numel())
    per_layer = {}
    for layer, cs in zip(MLA_LAYERS, cos):
        c = torch.cat(cs)
        per_layer[str(layer)] = {"min_cosine": round(float(c.min()), 5), "mean_cosine": round(float(c.mean()), 5),
                                 "share_below_0.99": round(float((c < 0.99).float().mean()), 4)}
    out = {"samples": len(a), "same_token_ids": same_ids, "aux_cosine": per_layer,
           "teacher_top1_agreement": round(agree / max(total, 1), 4),
           "vllm_selfcheck_top1": _stats(vcfg, "extract")["selfcheck"]["top1_agreement"],
           "vllm_version": _stats(vcfg, "extract").get("vllm_version")}
    if args.mla_steps:
        store = _config(root, "mla-vllm", target, data, args, [layers], args.mla_steps)
        stream = _config(root, "mla-stream", target, data, args, [layers, "extract.mode=online",
                                                                 f"extract.stream_buffer_gb={args.buffer_gb}"],
                         args.mla_steps)
        _run(store)
        _run(stream)
        out["stream_loss_rel_diff_vs_store"] = _loss_gap(_log(store), _log(stream))
        out["stream_selfcheck_top1"] = _stats(stream, "train")["stream"]["selfcheck"]["top1_agreement"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--parts", default="stream,mla")
    ap.add_argument("--engine", choices=["vllm", "fake"], default="vllm")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--mla-steps", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--conversations", type=int, default=1500)
    ap.add_argument("--mla-conversations", type=int, default=64)
    ap.add_argument("--buffer-gb", type=float, default=2.0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--target", type=Path, help="part stream: a checkpoint folder (default: a random SmolLM2 shape)")
    ap.add_argument("--data", type=Path, help="part stream: chat data for --target (default: tiny conversations)")
    ap.add_argument("--runs", default="store,stream,stream_fp8", help="part stream: the runs to run now")
    ap.add_argument("--eval-prompts", type=int, default=0, help="part stream: evaluate the streamed drafts")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    root = args.out / "work"
    root.mkdir(exist_ok=True)
    args.url = None
    args.runs = args.runs.split(",")
    if (args.target is None) != (args.data is None):
        raise SystemExit("bench: --target and --data go together")
    args.real = args.target is not None
    if "stream" in args.parts and not args.real:
        args.target = _target(root / "smollm2-shape", "llama", SMOLLM2)
    cuda = torch.cuda.is_available()
    args.device, args.dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    args.min_top1 = 0.9 if cuda else 0.99  # bf16 through two engines: near ties of a random model
    args.engine_args = {"enforce_eager": True, "gpu_memory_utilization": args.gpu_memory_utilization,
                        "skip_tokenizer_init": True, "max_num_seqs": 256}
    result: dict[str, Any] = {"engine": args.engine, "steps": args.steps, "max_tokens": args.max_tokens,
                              "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    with contextlib.ExitStack() as stack:
        if args.engine == "fake" and "stream" in args.parts:  # the stream part against the connector-format stand-in, as a server
            from transformers import AutoModelForCausalLM

            from eaglet.testing.fake_vllm import FakeServer, FakeVLLM

            model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
            L = model.config.num_hidden_layers
            args.url = stack.enter_context(FakeServer(FakeVLLM(model, root / "fake-states", [2, L // 2, L - 3, L]))).url
        t0 = time.perf_counter()
        if "stream" in args.parts:
            result["stream"] = part_stream(root, args)
            log(f"[bench] stream part: {json.dumps(result['stream'])}")
        if "mla" in args.parts and args.engine == "vllm":
            result["mla"] = part_mla(root, args)
            log(f"[bench] mla part: {json.dumps(result['mla'])}")
        result["seconds"] = round(time.perf_counter() - t0, 1)
    atomic_write_json(args.out / "stream_vllm.json", result)
    if "stream" in result:
        r = result["stream"]
        print(f"{'run':13} {'median tok/s':>12} {'vs store':>9} {'paired':>7} {'mean tok/s':>11} {'vs store':>9} "
              f"{'loss diff':>10} {'engine tok/s':>13} "
              f"{'buffer peak/bound':>18} {'waited s':>9} {'tau':>6}")
        for name, v in r.items():
            peak = (f"{v['buffer_peak_bytes'] / 1e9:.3f}/{v['buffer_bound_bytes'] / 1e9:.1f} GB"
                    if "buffer_peak_bytes" in v else "")
            tau = f"{v['eval']['tau']:.3f}" if v.get("eval") else ""
            print(f"{name:13} {v['train_tokens_per_s']:>12.0f} {v.get('tokens_per_s_vs_store', 1.0):>9.3f} "
                  f"{v.get('paired_vs_store', 1.0):>7.3f} {v['mean_tokens_per_s']:>11.0f} {v.get('mean_vs_store', 1.0):>9.3f} "
                  f"{v.get('loss_rel_diff_vs_store', 0.0):>10.2e} "
                  f"{v.get('engine_tokens_per_s') or 0:>13.0f} {peak:>18} {v.get('waited_s', 0.0):>9} {tau:>6}")
    if "mla" in result:
        print(json.dumps(result["mla"], indent=1))


if __name__ == "__main__":
    main()
