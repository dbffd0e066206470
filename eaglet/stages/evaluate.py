"""The `eval` stage: speculative decoding of held-out prompts with the trained draft.

    eaglet eval CONFIG            # or as the last stage of `eaglet run`

Prompts: the training run's held-out samples (`train_data.split_ids` with train.eval_fraction and
run.seed, over the same sample ids training split), the first `eval.num_prompts` of them,
each cut where its first assistant turn starts (the first loss-masked token), so a prompt
ends with the chat template's generation prompt.

For each prompt the target decodes speculatively with the draft (eaglet.engines.specdec: a chain or
the EAGLE-2 tree, greedy or sampled) and, for the baseline, plainly with the same KV cache.
Reported per prompt and overall: tau (tokens per target verification forward), acceptance
rate per draft position, tokens/s of both decoders and the speedup, and at T=0 the lossless
check (the speculative output must equal the target's own greedy output token for token).

Outputs in the stage folder: `eval.json` (settings, per prompt, aggregate) and `eval.png`.
A lossless failure in float32 raises after eval.json is written. In bf16/fp16 the
verification forward (many tokens at once) and plain decoding (one at a time) round
differently, so a near-tie can flip; mismatches are then reported, with the target's top-2
logit gap at the first differing position, but do not fail the stage.

`evaluate_draft` is the same measurement without the pipeline (demo, doctor).
"""

from __future__ import annotations

import io
import platform
from dataclasses import asdict, replace
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from ..config import Config, EvalSection
from ..distributed import resolve_device
from ..draft.model import Eagle3Draft
from ..engines.specdec import (
    DraftRunner,
    SpecSettings,
    TargetRunner,
    acceptance_stats,
    first_difference,
    new_cache,
    plain_generate,
    speculative_generate,
)
from ..errors import VerificationError
from ..formats.draft import FINAL_DIR, load_final
from ..formats.prepared import PreparedData
from ..targets.chat import load_tokenizer
from ..targets.load import load_target
from ..utils import atomic_write_bytes, atomic_write_json, log
from .context import StageContext
from .online import split_source
from .train_data import split_ids

EVAL_JSON = "eval.json"
EVAL_PNG = "eval.png"


class LosslessError(VerificationError):
    """Greedy speculative decoding produced a token the target's own greedy decoding did not."""


def resolve_eval_dtype(ecfg: EvalSection) -> str:
    """'auto': float32 on CPU (the lossless check needs it), bfloat16 on a GPU."""
    if ecfg.dtype != "auto":
        return ecfg.dtype
    return "bfloat16" if resolve_device(ecfg.device).type == "cuda" else "float32"


def eos_ids(target: nn.Module, tokenizer: Any = None) -> list[int]:
    """End-of-sequence ids: the generation config's (int or list) and the tokenizer's."""
    ids: set[int] = set()
    gen = getattr(target, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if eos is not None:
        ids |= {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


# ---- the measurement --------------------------------------------------------------------------


def _top2_gap(runner: TargetRunner, tokens: Sequence[int]) -> float:
    """The target's top-1 minus top-2 logit after `tokens` (a small gap: a numerical near-tie)."""
    logits, _ = runner.forward(new_cache(), tokens, range(len(tokens)), capture=False, last_only=True)
    top = logits[-1].topk(2).values
    return float(top[0] - top[1])


def evaluate_draft(
    target: nn.Module,
    tokenizer: Any,
    draft: Eagle3Draft,
    aux_layers: Sequence[int],
    prompts: Sequence[Sequence[int]],
    ecfg: EvalSection,
    *,
    seed: int = 0,
    eos_token_ids: Sequence[int] | None = None,
    warmup: bool = True,
    verbose: bool = True,
) -> dict[str, Any]:
    """Speculative vs plain decoding of `prompts` (token id lists); returns
    {"settings", "prompts": [...], "aggregate"} (JSON-able). The draft is moved to the
    target's input device and dtype. `tokenizer` (optional) adds decoded texts and EOS ids.

    The plain decode runs when ecfg.baseline is set, or when the lossless check needs it
    (greedy with ecfg.lossless_check)."""
    runner = TargetRunner(target, aux_layers)
    _check_compatible(runner, draft, aux_layers)
    draft = draft.to(device=runner.device, dtype=runner.dtype).eval()
    drafter = DraftRunner(draft)
    s = SpecSettings.from_eval(ecfg)
    greedy = s.temperature <= 0
    check = greedy and ecfg.lossless_check
    run_plain = ecfg.baseline or check
    eos = list(eos_ids(target, tokenizer) if eos_token_ids is None else eos_token_ids)
    if warmup and prompts:  # first calls allocate and pick kernels; keep them out of the timings
        short = replace(s, max_new_tokens=min(8, s.max_new_tokens))
        first = [int(t) for t in prompts[0]]
        speculative_generate(runner, drafter, first, short, eos, torch.Generator().manual_seed(seed))
        if run_plain:
            plain_generate(runner, first, short.max_new_tokens, s.temperature, eos, torch.Generator().manual_seed(seed))

    records, all_accepted = [], []
    spec_tokens = spec_seconds = plain_tokens = plain_seconds = 0.0
    for i, prompt in enumerate(prompts):
        prompt = [int(t) for t in prompt]
        g = speculative_generate(runner, drafter, prompt, s, eos, torch.Generator().manual_seed(seed * 1_000_003 + i))
        stats = acceptance_stats(g.accepted, s.num_positions)
        rec: dict[str, Any] = {
            "index": i,
            "prompt_tokens": len(prompt),
            "new_tokens": len(g.tokens),
            "verify_forwards": g.verify_forwards,
            "tau": stats["tau"],
            "acceptance_rate": stats["acceptance_rate"],
            "accepted_per_forward": g.accepted,
            "seconds": round(g.seconds, 4),
            "tokens_per_s": len(g.tokens) / g.seconds if g.seconds > 0 else None,
        }
        all_accepted += g.accepted
        spec_tokens += len(g.tokens)
        spec_seconds += g.seconds
        if run_plain:
            b = plain_generate(runner, prompt, s.max_new_tokens, s.temperature, eos,
                               torch.Generator().manual_seed(seed * 1_000_003 + i + 500_000))
            plain_tokens += len(b.tokens)
            plain_seconds += b.seconds
            rec["baseline_seconds"] = round(b.seconds, 4)
            rec["baseline_tokens_per_s"] = len(b.tokens) / b.seconds if b.seconds > 0 else None
            if rec["tokens_per_s"] and rec["baseline_tokens_per_s"]:
                rec["speedup"] = rec["tokens_per_s"] / rec["baseline_tokens_per_s"]
            if check:
                diff = first_difference(g.tokens, b.tokens)
                rec["lossless"] = diff is None
                rec["first_mismatch"] = diff
                if diff is not None:
                    rec["mismatch"] = {
                        "speculative": g.tokens[diff] if diff < len(g.tokens) else None,
                        "target": b.tokens[diff] if diff < len(b.tokens) else None,
                        "target_top2_logit_gap": _top2_gap(runner, prompt + b.tokens[:diff]),
                    }
        if tokenizer is not None:
            rec["text"] = tokenizer.decode(g.tokens)
        records.append(rec)
        if verbose:
            line = f"[eval] prompt {i + 1}/{len(prompts)}: {len(g.tokens)} tokens, tau {_fmt(rec['tau'])}, " \
                   f"{_fmt(rec['tokens_per_s'], 1)} tok/s"
            if run_plain:
                line += f" (plain {_fmt(rec.get('baseline_tokens_per_s'), 1)})"
            if check:
                line += ", lossless" if rec["lossless"] else f", MISMATCH at {rec['first_mismatch']}"
            log(line)

    total = acceptance_stats(all_accepted, s.num_positions)
    taus = [r["tau"] for r in records if r["tau"] is not None]
    agg: dict[str, Any] = {
        "num_prompts": len(records),
        "new_tokens": int(spec_tokens),
        "verify_forwards": total["verify_forwards"],
        "tau": total["tau"],
        "tau_ceiling": s.num_positions + 1,
        "tau_mean_over_prompts": float(np.mean(taus)) if taus else None,
        "acceptance_rate": total["acceptance_rate"],
        "position_reached": total["position_reached"],
        "position_accepted": total["position_accepted"],
        "seconds": round(spec_seconds, 4),
        "tokens_per_s": spec_tokens / spec_seconds if spec_seconds > 0 else None,
    }
    if run_plain:
        agg["baseline_seconds"] = round(plain_seconds, 4)
        agg["baseline_tokens_per_s"] = plain_tokens / plain_seconds if plain_seconds > 0 else None
        if agg["tokens_per_s"] and agg["baseline_tokens_per_s"]:
            agg["speedup"] = agg["tokens_per_s"] / agg["baseline_tokens_per_s"]
    if check:
        bad = [{"prompt": r["index"], "position": r["first_mismatch"], **r["mismatch"]} for r in records if not r["lossless"]]
        agg["lossless"] = not bad
        agg["mismatches"] = bad
    settings = {
        **asdict(s),
        "lossless_check": bool(check),
        "baseline": bool(run_plain),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "device": str(runner.device),
        "attn_implementation": runner.attn_impl,
        "cache_kwarg": runner.cache_kw,
        "eos_token_ids": eos,
        "seed": seed,
        "versions": _versions(),
    }
    return {"settings": settings, "prompts": records, "aggregate": agg}


def _check_compatible(runner: TargetRunner, draft: Eagle3Draft, aux_layers: Sequence[int]) -> None:
    c = draft.config
    vocab = int(runner.parts.lm_head.weight.shape[0])
    problems = []
    if c.num_aux != len(aux_layers):
        problems.append(f"the draft reads {c.num_aux} target states but aux_layers has {len(aux_layers)}")
    if c.target_hidden_size != runner.parts.hidden_size:
        problems.append(f"draft target_hidden_size {c.target_hidden_size} != target hidden size {runner.parts.hidden_size}")
    if c.vocab_size != vocab:
        problems.append(f"draft vocab_size {c.vocab_size} != the target's LM head rows {vocab}")
    bad = [i for i in aux_layers if not 0 <= i < runner.parts.num_layers]
    if bad:
        problems.append(f"aux layer ids {bad} out of range for {runner.parts.num_layers} decoder layers")
    if problems:
        raise ValueError("draft and target do not fit: " + "; ".join(problems))


def _fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _versions() -> dict[str, str]:
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


# ---- prompts ----------------------------------------------------------------------------------


def heldout_prompts(data: PreparedData, split_sample_ids: np.ndarray, eval_fraction: float, seed: int,
                    num_prompts: int) -> list[tuple[int, list[int]]]:
    """(sample id, prompt tokens) of the first `num_prompts` held-out samples that have an
    assistant turn after some prompt; each cut before its first loss-masked token, and each
    prompt once: conversations that open with the assistant's turn (a third of ShareGPT's)
    all cut to the template's bare system prompt, which would otherwise be evaluated again
    and again."""
    _, eval_ids = split_ids(split_sample_ids, eval_fraction, seed)
    row_of = {int(sid): i for i, sid in enumerate(data.sample_ids.tolist())}
    out, seen = [], set()
    for sid in eval_ids.tolist():
        if len(out) >= num_prompts:
            break
        if sid not in row_of:
            continue
        sample = data[row_of[sid]]
        masked = np.flatnonzero(np.asarray(sample.loss_mask) > 0)
        if masked.size == 0 or masked[0] == 0:
            continue
        prompt = tuple(np.asarray(sample.input_ids[: masked[0]], dtype=np.int64).tolist())
        if prompt not in seen:
            seen.add(prompt)
            out.append((int(sid), list(prompt)))
    return out


# ---- plot -------------------------------------------------------------------------------------


def plot_eval(result: dict[str, Any]) -> bytes:
    """eval.png: acceptance rate per draft position, and tau per prompt."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    agg, recs, st = result["aggregate"], result["prompts"], result["settings"]
    fig = Figure(figsize=(11, 4), dpi=110)
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    rates = [r if r is not None else 0.0 for r in agg["acceptance_rate"]]
    bars = ax1.bar(range(1, len(rates) + 1), rates, color="tab:blue")
    labels = [f"{r:.2f}\nof {n}" if n else "not\nreached" for r, n in zip(rates, agg["position_reached"])]
    ax1.bar_label(bars, labels=labels, fontsize=8)
    ax1.set_xlabel("draft position")
    ax1.set_ylabel("accepted / reached")
    ax1.set_ylim(0, 1.15)
    ax1.set_xticks(range(1, len(rates) + 1))
    ax1.set_title("acceptance rate per draft position")
    taus = [r["tau"] or 0.0 for r in recs]
    ax2.bar(range(len(taus)), taus, color="tab:green")
    if agg["tau"] is not None:
        ax2.axhline(agg["tau"], color="k", linestyle="--", label=f"overall tau {agg['tau']:.2f}")
    ax2.axhline(agg["tau_ceiling"], color="tab:red", linestyle=":", label=f"ceiling {agg['tau_ceiling']}")
    ax2.set_xlabel("prompt")
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_ylabel("tau (tokens / verification)")
    ax2.legend(loc="lower right", fontsize=8)
    speed = f", speedup {agg['speedup']:.2f}x" if agg.get("speedup") else ""
    ax2.set_title(f"tau per prompt ({st['method']}, T={st['temperature']}{speed})")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


# ---- the stage --------------------------------------------------------------------------------


def eval_inputs(cfg: Config, upstream: dict[str, Any]) -> tuple[list[tuple[int, list[int]]], Eagle3Draft, list[int], Any, Any, dict[str, Any], str]:
    """(held-out prompts as (sample id, tokens), trained draft, aux layers, target, tokenizer,
    target info, dtype) for an evaluation over the run whose stage folders are `upstream`."""
    ecfg = cfg.eval
    data = PreparedData(upstream["prepare"])
    # Split the ids that training split (the extract store's, which may lack set-aside
    # samples), so that the held-out prompts are exactly the ones training never saw.
    split_ids_from = data.sample_ids
    if "extract" in upstream:
        split_ids_from = split_source(upstream)
    if cfg.train.eval_fraction <= 0:
        raise ValueError("eval needs held-out prompts: train.eval_fraction is 0")
    named = heldout_prompts(data, split_ids_from, cfg.train.eval_fraction, cfg.run.seed, ecfg.num_prompts)
    if not named:
        raise ValueError("eval: no held-out sample has a prompt before its first assistant turn")
    draft, aux_layers = load_final(upstream["train"] / FINAL_DIR)
    dtype = resolve_eval_dtype(ecfg)
    target, info = load_target(replace(cfg.target, device=ecfg.device, dtype=dtype))
    tokenizer = load_tokenizer(cfg.target)
    return named, draft, list(aux_layers), target, tokenizer, info, dtype


def run_eval(cfg: Config, ctx: StageContext) -> dict[str, Any]:
    ecfg = cfg.eval
    named, draft, aux_layers, target, tokenizer, info, dtype = eval_inputs(cfg, ctx.upstream)
    log(f"[eval] {len(named)} prompts, {ecfg.method}, T={ecfg.temperature}, {dtype} on {info['device']}")
    result = evaluate_draft(target, tokenizer, draft, aux_layers, [p for _, p in named], ecfg, seed=cfg.run.seed)
    for rec, (sid, _) in zip(result["prompts"], named):
        rec["sample_id"] = sid
    result["target"] = info
    result["aux_layers"] = list(aux_layers)
    atomic_write_json(ctx.out_dir / EVAL_JSON, result)
    atomic_write_bytes(ctx.out_dir / EVAL_PNG, plot_eval(result))

    agg = result["aggregate"]
    if agg.get("lossless") is False:
        first = agg["mismatches"][0]
        where = f"prompt {first['prompt']} (sample {result['prompts'][first['prompt']]['sample_id']}) at new token " \
                f"{first['position']} (target top-2 logit gap {first['target_top2_logit_gap']:.3g})"
        if dtype == "float32":
            raise LosslessError(f"lossless check failed in {len(agg['mismatches'])} prompt(s); first: {where}; "
                                f"see {ctx.out_dir / EVAL_JSON}")
        log(f"[eval] WARNING: greedy outputs differ in {len(agg['mismatches'])} prompt(s) in {dtype} "
            f"(first: {where}); expected from rounding near ties, checked strictly only in float32")
    return {k: agg.get(k) for k in ("num_prompts", "new_tokens", "verify_forwards", "tau", "tau_ceiling",
                                     "acceptance_rate", "tokens_per_s", "baseline_tokens_per_s", "speedup", "lossless")}
