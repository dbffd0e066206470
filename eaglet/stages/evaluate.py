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

`eval.replay` measures decoding by replay instead (eaglet/engines/replay.py): the same
accepted counts from the target's batched greedy continuations and, for a chain, one draft
unroll, for a tree the decoder's tree drafting without the target's forwards; for A/Bs over
many prompts. At a temperature the continuations are sampled from the target and the draft's
acceptances follow them (a tree's exactly, a chain's drawn with their chances). It gives no
speed or lossless figures.

`evaluate_draft` is the same measurement without the pipeline (demo, doctor).
"""

from __future__ import annotations

import gc
import io
import platform
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

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
from ..engines.replay import replay_chain, replay_tree, target_side
from ..errors import InputError, VerificationError
from ..formats.draft import FINAL_DIR, load_final
from ..formats.prepared import PreparedData
from ..formats.serving import Loaded, draft_model, load_draft
from ..formats.serving_engines import ENGINES, PROBLEMS
from ..targets.chat import generation_prompt, load_tokenizer, resolve_chat_template
from ..targets.families import default_layers, family_of
from ..targets.load import TargetParts, load_target
from ..utils import atomic_write_bytes, atomic_write_json, log
from .context import StageContext
from .eval_sets import EvalItem, SkippedPrompts, by_category, named_items, no_heldout_error, run_rounds, set_name
from .eval_vllm import check_agreement, run_vllm_eval, vllm_stats, want_vllm
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


class _Decoding:
    """The target and draft of one evaluation, with its settings: decodes prompts into records."""

    def __init__(self, target: nn.Module, tokenizer: Any, draft: Eagle3Draft, aux_layers: Sequence[int],
                 ecfg: EvalSection, seed: int, eos_token_ids: Sequence[int] | None, verbose: bool):
        self.runner = TargetRunner(target, aux_layers)
        _check_compatible(self.runner, draft, aux_layers)
        self.drafter = DraftRunner(draft.to(device=self.runner.device, dtype=self.runner.dtype).eval())
        self.s = SpecSettings.from_eval(ecfg)
        self.check = self.s.temperature <= 0 and ecfg.lossless_check
        self.run_plain = ecfg.baseline or self.check
        self.eos = list(eos_ids(target, tokenizer) if eos_token_ids is None else eos_token_ids)
        self.tokenizer, self.seed, self.verbose = tokenizer, seed, verbose
        self.done = 0  # prompts decoded so far: each one's seed is its index
        self.warm = False

    def warmup(self, prompt: Sequence[int]) -> None:
        """First calls allocate and pick kernels; keep them out of the timings."""
        short = replace(self.s, max_new_tokens=min(8, self.s.max_new_tokens))
        first = [int(t) for t in prompt]
        speculative_generate(self.runner, self.drafter, first, short, self.eos, torch.Generator().manual_seed(self.seed))
        if self.run_plain:
            plain_generate(self.runner, first, short.max_new_tokens, self.s.temperature, self.eos,
                           torch.Generator().manual_seed(self.seed))
        self.warm = True

    def decode(self, prompts: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
        records = []
        for prompt in prompts:
            records.append(self._one([int(t) for t in prompt], self.done))
            self.done += 1
        return records

    def _one(self, prompt: list[int], i: int) -> dict[str, Any]:
        s, runner = self.s, self.runner
        g = speculative_generate(runner, self.drafter, prompt, s, self.eos,
                                 torch.Generator().manual_seed(self.seed * 1_000_003 + i),
                                 timed=runner.device.type == "cpu")  # no device syncs to add on a CPU
        rec = self._record(i, prompt, g.tokens, g.accepted, g.seconds)
        if g.phases:
            rec["phase_seconds"] = {k: round(v, 5) for k, v in g.phases.items()}
        if self.run_plain:
            b = plain_generate(runner, prompt, s.max_new_tokens, s.temperature, self.eos,
                               torch.Generator().manual_seed(self.seed * 1_000_003 + i + 500_000))
            rec["baseline_new_tokens"] = len(b.tokens)
            rec["baseline_seconds"] = round(b.seconds, 4)
            rec["baseline_tokens_per_s"] = len(b.tokens) / b.seconds if b.seconds > 0 else None
            if rec["tokens_per_s"] and rec["baseline_tokens_per_s"]:
                rec["speedup"] = rec["tokens_per_s"] / rec["baseline_tokens_per_s"]
            if self.check:
                diff = first_difference(g.tokens, b.tokens)
                rec["lossless"] = diff is None
                rec["first_mismatch"] = diff
                if diff is not None:
                    rec["mismatch"] = {
                        "speculative": g.tokens[diff] if diff < len(g.tokens) else None,
                        "target": b.tokens[diff] if diff < len(b.tokens) else None,
                        "target_top2_logit_gap": _top2_gap(runner, prompt + b.tokens[:diff]),
                    }
        if self.verbose:
            line = f"[eval] prompt {i + 1}: {len(g.tokens)} tokens, tau {_fmt(rec['tau'])}, " \
                   f"{_fmt(rec['tokens_per_s'], 1)} tok/s"
            if self.run_plain:
                line += f" (plain {_fmt(rec.get('baseline_tokens_per_s'), 1)})"
            if self.check:
                line += ", lossless" if rec["lossless"] else f", MISMATCH at {rec['first_mismatch']}"
            log(line)
        return rec

    def _record(self, i: int, prompt: Sequence[int], tokens: Sequence[int], accepted: list[int],
                seconds: float) -> dict[str, Any]:
        """One prompt's record: its output, accepted counts, tau and per-position acceptance."""
        stats = acceptance_stats(accepted, self.s.num_positions)
        rec: dict[str, Any] = {
            "index": i,
            "prompt_tokens": len(prompt),
            "new_tokens": len(tokens),
            "verify_forwards": len(accepted),
            "tau": stats["tau"],
            "acceptance_rate": stats["acceptance_rate"],
            "accepted_per_forward": accepted,
            "seconds": round(seconds, 4),
            "tokens_per_s": len(tokens) / seconds if seconds > 0 else None,
            "tokens": list(tokens),
        }
        if self.tokenizer is not None:
            rec["text"] = self.tokenizer.decode(tokens)
        return rec

    def aggregate(self, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """tau, acceptance per position, speeds and the lossless verdict over `records`."""
        s = self.s
        total = acceptance_stats([a for r in records for a in r["accepted_per_forward"]], s.num_positions)
        taus = [r["tau"] for r in records if r["tau"] is not None]
        spec_tokens, spec_seconds = sum(r["new_tokens"] for r in records), sum(r["seconds"] for r in records)
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
        timed = [r["phase_seconds"] for r in records if r.get("phase_seconds")]
        if timed and total["verify_forwards"]:  # where a cycle's time goes (a CPU's decoding is timed by phase)
            agg["ms_per_cycle"] = {k: round(1000 * sum(t[k] for t in timed) / total["verify_forwards"], 2)
                                   for k in ("draft", "verify", "accept")}
        if self.run_plain:
            plain_tokens = sum(r["baseline_new_tokens"] for r in records)
            plain_seconds = sum(r["baseline_seconds"] for r in records)
            if plain_tokens:
                agg["ms_per_plain_step"] = round(1000 * plain_seconds / plain_tokens, 2)
            agg["baseline_seconds"] = round(plain_seconds, 4)
            agg["baseline_tokens_per_s"] = plain_tokens / plain_seconds if plain_seconds > 0 else None
            if agg["tokens_per_s"] and agg["baseline_tokens_per_s"]:
                agg["speedup"] = agg["tokens_per_s"] / agg["baseline_tokens_per_s"]
        if self.check:
            bad = [{"prompt": r["index"], "position": r["first_mismatch"], **r["mismatch"]}
                   for r in records if not r["lossless"]]
            agg["lossless"] = not bad
            agg["mismatches"] = bad
        return agg

    def settings(self) -> dict[str, Any]:
        return {
            **asdict(self.s),
            "lossless_check": bool(self.check),
            "baseline": bool(self.run_plain),
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "device": str(self.runner.device),
            "attn_implementation": self.runner.attn_impl,
            "cache_kwarg": self.runner.cache_kw,
            "eos_token_ids": self.eos,
            "seed": self.seed,
            "versions": _versions(),
        }


class _Replaying(_Decoding):
    """eval.replay: chains' or trees' accepted counts by replay (eaglet/engines/replay.py), all
    prompts of a call at once; no plain decode, so no speed or lossless figures. At a
    temperature the continuations are sampled from the target (seeded by the eval's seed) and
    the draft's acceptances given them: a tree's exactly, a chain's drawn once."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.check = self.run_plain = False

    def warmup(self, prompt: Sequence[int]) -> None:
        self.warm = True

    def decode(self, prompts: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
        s = self.s
        seed = self.seed * 1_000_003 + self.done  # this call's: a later call's prompts sample afresh
        side = target_side(self.runner.model, self.runner.aux_layers, prompts, s.max_new_tokens, s.num_positions,
                           temperature=s.temperature, seed=seed)
        if s.method == "tree":
            runs = replay_tree(self.drafter.draft, side, s.tree_top_k, s.tree_depth, s.tree_total_tokens, eos=self.eos)
        else:
            runs = replay_chain(self.drafter.draft, side, eos=self.eos, seed=seed)
        records = []
        for prompt, (accepted, tokens) in zip(prompts, runs, strict=True):
            records.append(self._record(self.done, prompt, tokens, accepted, 0.0))  # nothing decoded: no time
            self.done += 1
        if self.verbose:
            tau = acceptance_stats([a for r in records for a in r["accepted_per_forward"]], s.num_positions)["tau"]
            log(f"[eval] replayed {len(prompts)} prompts: tau {_fmt(tau)}")
        return records

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "replay": True}


def _decoding(target: nn.Module, tokenizer: Any, draft: Eagle3Draft, aux_layers: Sequence[int], ecfg: EvalSection,
              seed: int, eos_token_ids: Sequence[int] | None, verbose: bool) -> _Decoding:
    """The measurement `ecfg` asks for: decoding, or replay (eval.replay)."""
    return (_Replaying if ecfg.replay else _Decoding)(target, tokenizer, draft, aux_layers, ecfg, seed, eos_token_ids,
                                                      verbose)


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
    d = _decoding(target, tokenizer, draft, aux_layers, ecfg, seed, eos_token_ids, verbose)
    if warmup and prompts:
        d.warmup(prompts[0])
    records = d.decode(prompts)
    return {"settings": d.settings(), "prompts": records, "aggregate": d.aggregate(records)}


def evaluate_items(
    target: nn.Module,
    tokenizer: Any,
    draft: Eagle3Draft,
    aux_layers: Sequence[int],
    items: Sequence[EvalItem],
    ecfg: EvalSection,
    render: Callable[[list[dict[str, str]]], list[int]],
    *,
    seed: int = 0,
    warmup: bool = True,
    verbose: bool = True,
) -> dict[str, Any]:
    """evaluate_draft over eval items, turn by turn (eaglet/stages/eval_sets.py): a later turn is
    asked after the target's own answers (the speculative output, which greedy decoding keeps
    equal to the target's). Adds "by_category" when the items have categories."""
    d = _decoding(target, tokenizer, draft, aux_layers, ecfg, seed, None, verbose)

    def decode(prompts: list[list[int]], _items: list[EvalItem]) -> list[tuple[list[int], dict[str, Any]]]:
        if warmup and not d.warm and prompts:
            d.warmup(prompts[0])
        return [(r["tokens"], r) for r in d.decode(prompts)]

    records = run_rounds(items, render, lambda t: tokenizer.decode(t, skip_special_tokens=True), decode)
    result = {"settings": d.settings(), "prompts": records, "aggregate": d.aggregate(records)}
    groups = by_category(records)
    if groups:
        result["by_category"] = {c: d.aggregate(rs) for c, rs in groups.items()}
    return result


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


def plot_eval(result: dict[str, Any], vllm: dict[str, Any] | None = None) -> bytes:
    """eval.png. Left: acceptance at each draft position (accepted when reached), with how often
    each position was reached, against the untrained reference and vLLM's figures when there.
    Right: tau per category (or per prompt), on an axis that starts at 1 (no draft token
    accepted), with the untrained reference and the ceiling."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    agg, recs, st = result["aggregate"], result["prompts"], result["settings"]
    ref = result.get("reference")
    fig = Figure(figsize=(12, 4.4), dpi=110)
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    rates = [r if r is not None else 0.0 for r in agg["acceptance_rate"]]
    pos = np.arange(1, len(rates) + 1)
    width = 0.4 if vllm else 0.7
    bars = ax1.bar(pos - (width / 2 if vllm else 0), rates, width, color="tab:blue", label="eaglet (in process)")
    forwards = max(1, agg["verify_forwards"])
    labels = [f"{r:.2f}\n{n / forwards:.0%}" if n else "not\nreached" for r, n in zip(rates, agg["position_reached"])]
    ax1.bar_label(bars, labels=labels, fontsize=7)
    if vllm:
        vr = [r if r is not None else 0.0 for r in vllm["acceptance"]["acceptance_rate"]][: len(rates)]
        ax1.bar(pos[: len(vr)] + width / 2, vr, width, color="tab:orange", label="vLLM")
    if ref:
        rr = [r if r is not None else 0.0 for r in ref["acceptance_rate"]]
        ax1.plot(pos[: len(rr)], rr, "k_", markersize=18, mew=2, label="untrained draft")
    ax1.set_xlabel("draft position (label: acceptance, and the share of verifications that reached it)")
    ax1.set_ylabel("accepted / reached")
    ax1.set_ylim(0, 1.2)
    ax1.set_xticks(pos)
    ax1.legend(loc="upper right", fontsize=7)
    ax1.set_title("acceptance per draft position")

    ceiling = agg["tau_ceiling"]
    cats = result.get("by_category")
    if cats:
        names = list(cats)
        values = [cats[c]["tau"] or 1.0 for c in names]
        xs = np.arange(len(names))
        ax2.bar(xs - (0.2 if vllm else 0), [v - 1 for v in values], 0.4 if vllm else 0.7, bottom=1, color="tab:green",
                label="eaglet")
        if vllm and vllm.get("by_category"):
            vv = [(vllm["by_category"].get(c) or {}).get("mean_acceptance_length") or 1.0 for c in names]
            ax2.bar(xs + 0.2, [v - 1 for v in vv], 0.4, bottom=1, color="tab:orange", label="vLLM")
        ax2.set_xticks(xs, names, rotation=30, fontsize=8)
        ax2.set_xlabel("category")
    else:
        taus = [r["tau"] or 1.0 for r in recs]
        ax2.bar(range(len(taus)), [t - 1 for t in taus], bottom=1, color="tab:green", label="eaglet, per prompt")
        ax2.set_xlabel("prompt")
        ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    if agg["tau"] is not None:
        ax2.axhline(agg["tau"], color="k", linestyle="--", label=f"eaglet overall {agg['tau']:.2f}")
    if vllm and vllm["acceptance"].get("mean_acceptance_length"):
        ax2.axhline(vllm["acceptance"]["mean_acceptance_length"], color="tab:orange", linestyle="--",
                    label=f"vLLM overall {vllm['acceptance']['mean_acceptance_length']:.2f}")
    if ref and ref.get("tau") is not None:
        ax2.axhline(ref["tau"], color="tab:gray", linestyle="-.", label=f"untrained draft {ref['tau']:.2f}")
    top = max([agg["tau"] or 1.0] + [r["tau"] or 1.0 for r in recs]) if not cats else max(
        [c["tau"] or 1.0 for c in cats.values()])
    ax2.set_ylim(1, min(ceiling, top) * 1.15 + 0.05)
    ax2.set_ylabel(f"tau (tokens / verification; ceiling {ceiling})")
    ax2.legend(loc="upper right", fontsize=7)
    speed = f", speedup {agg['speedup']:.2f}x" if agg.get("speedup") else ""
    ax2.set_title(f"tau ({result.get('prompt_set', 'heldout')}, {st['method']}, T={st['temperature']}{speed})")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


# ---- the stage --------------------------------------------------------------------------------


@dataclass
class EvalInputs:
    items: list[EvalItem]
    draft: Eagle3Draft | None  # None: not loaded (the vLLM eval alone)
    aux_layers: list[int]
    target: Any
    tokenizer: Any
    info: dict[str, Any]
    dtype: str
    render: Callable[[list[dict[str, str]]], list[int]]
    draft_source: str  # the final/ folder or the export folder the draft came from
    skipped: SkippedPrompts = field(default_factory=SkippedPrompts)  # eval.prompts records passed over


def eval_inputs(cfg: Config, upstream: dict[str, Any], load_models: bool = True) -> EvalInputs:
    """The prompt set, draft, target and tokenizer of an evaluation over the run whose stage
    folders are `upstream` (the draft: eval.draft, else the run's trained one). Without
    `load_models` the target and the draft stay unloaded (None): the vLLM eval alone."""
    ecfg = cfg.eval

    def heldout() -> list[tuple[int, list[int]]]:
        data = PreparedData(upstream["prepare"])
        # Split the ids that training split (the extract store's, which may lack set-aside
        # samples), so that the held-out prompts are exactly the ones training never saw.
        split_ids_from = split_source(upstream) if "extract" in upstream else data.sample_ids
        named = heldout_prompts(data, split_ids_from, cfg.train.eval_fraction, cfg.run.seed, ecfg.num_prompts)
        if not named:  # before the target loads
            held = len(split_ids(split_ids_from, cfg.train.eval_fraction, cfg.run.seed)[1])
            raise no_heldout_error(len(split_ids_from), held, cfg.train.eval_fraction)
        return named

    items, skipped = named_items(ecfg.prompts, ecfg.num_prompts, heldout, cfg.prepare.format, cfg.prepare.multimodal)
    if warning := skipped.warning():  # before the target loads
        log(f"[eval] WARNING: {warning}")
    dtype = resolve_eval_dtype(ecfg)
    tokenizer = load_tokenizer(cfg.target)
    template = resolve_chat_template(tokenizer, cfg.target)
    render = lambda messages: generation_prompt(tokenizer, template, messages)
    if not load_models:  # vLLM reads the draft's folder (eval.draft, else the run's export): checked here first
        return EvalInputs(items, None, [], None, tokenizer, {"device": "vllm"}, dtype, render,
                          vllm_draft(cfg, upstream), skipped)
    # the draft is read and checked (checksums, finite weights, eval.draft's loader format) before the target loads
    if ecfg.draft:
        exported = read_eval_draft(ecfg.draft)
    else:
        source = str(upstream["train"] / FINAL_DIR)
        draft, aux_layers = load_final(upstream["train"] / FINAL_DIR)
    target, info = load_target(replace(cfg.target, device=ecfg.device, dtype=dtype))
    if ecfg.draft:
        draft, aux_layers, source = _exported_draft(exported, target)
    return EvalInputs(items, draft, list(aux_layers), target, tokenizer, info, dtype, render, source, skipped)


def read_eval_draft(path: str, own: bool = False) -> Loaded:
    """eval.draft read (`load_draft`: checked against its checksums.json where eaglet wrote it,
    every weight finite) and holding what its engine's loader reads
    (eaglet/formats/serving_engines.py), so that eval measures the draft the engine would serve;
    raises CorruptDataError or InputError naming the file and what is wrong. `own`: the run's own
    export (the vLLM eval's draft without eval.draft), read the same way."""
    loaded = load_draft(path, finite=True)
    meta = loaded[2]
    problems = PROBLEMS[meta["format"]](meta["folder"])
    if problems:
        what, fix = ((f"the run's export {meta['folder']}", "export it again: `eaglet export CONFIG --force`") if own
                     else (f"eval.draft {meta['folder']}", "export the draft again (`eaglet export CONFIG`), or name "
                                                          "another in eval.draft"))
        raise InputError(f"{what} would not load as {ENGINES[meta['format']]} loads it: " + "; ".join(problems),
                         fix=fix)
    return loaded


def vllm_draft(cfg: Config, upstream: dict[str, Any]) -> str:
    """The folder the vLLM eval hands vLLM as its draft, eval.draft or else the run's
    `<export>/vllm`, checked first (`read_eval_draft`: checksums, finite weights, its loader's
    format): vLLM would load a damaged file without a word."""
    if cfg.eval.draft:
        read_eval_draft(cfg.eval.draft)
        return cfg.eval.draft
    folder = Path(upstream["export"]) / "vllm"
    if not folder.is_dir():
        raise InputError(f"the vLLM eval serves the run's vLLM export, and there is none in {folder.parent}",
                         fix="add vllm to export.formats and run `eaglet export CONFIG`, or name an export in "
                             "eval.draft")
    read_eval_draft(str(folder), own=True)
    return str(folder)


def _exported_draft(loaded: Loaded, target: nn.Module) -> tuple[Eagle3Draft, list[int], str]:
    """An export folder's draft (`read_eval_draft`), with the target's (scaled) embedding where the
    export has none."""
    parts = TargetParts.of(target)
    fam = family_of(target.config)
    scale = fam.scales(target.config)[0] if fam is not None else 1.0
    draft, meta = draft_model(loaded, embed=parts.embed_tokens.weight.detach().float().cpu() * scale)
    aux = meta.get("aux_layer_ids") or default_layers(parts.num_layers)
    return draft, list(aux), meta["folder"]


def untrained_like(trained: Eagle3Draft, seed: int) -> Eagle3Draft:
    """A randomly initialised draft of `trained`'s shape with its target-copied embedding and
    vocabulary maps: the floor a trained draft is compared with."""
    torch.manual_seed(seed)
    untrained = Eagle3Draft(trained.config)
    untrained.reset_parameters()
    with torch.no_grad():
        for name in ("embed_tokens.weight", "d2t", "t2d"):
            untrained.state_dict()[name].copy_(trained.state_dict()[name])
    return untrained


def setting_key(ecfg: EvalSection, engine: str = "eaglet") -> str:
    """The name of one setting's result file: prompt set, drafting, temperature, engine."""
    draft = f"chain{ecfg.chain_tokens}" if ecfg.method == "chain" else \
        f"tree{ecfg.tree_top_k}x{ecfg.tree_depth}-{ecfg.tree_total_tokens}"
    temp = "greedy" if ecfg.temperature <= 0 else f"t{ecfg.temperature:g}"
    how = "-replay" if ecfg.replay and engine == "eaglet" else ""
    return f"{set_name(ecfg.prompts)}-{draft}-{temp}{how}" + ("" if engine == "eaglet" else f"-{engine}")


def run_eval(cfg: Config, ctx: StageContext) -> dict[str, Any]:
    ecfg = cfg.eval
    vllm_on = want_vllm(ecfg)
    if not ecfg.in_process and not vllm_on:
        raise InputError("eval.in_process is off and the vLLM eval does not run (eval.vllm)",
                         fix="set eval.in_process=true, or eval.vllm=on on a machine with vLLM and a GPU")
    if vllm_on and ecfg.in_process and not ecfg.draft:  # the export vLLM will serve, checked before the target loads
        vllm_draft(cfg, ctx.upstream)
    inp = eval_inputs(cfg, ctx.upstream, load_models=ecfg.in_process)
    result, stats, key = None, {}, setting_key(ecfg)
    if ecfg.in_process:
        result, stats = _in_process(cfg, ctx, inp, key)
    vllm = None
    if vllm_on:
        inp.target = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        vllm = run_vllm_eval(cfg, ctx, inp, result)
        atomic_write_json(ctx.out_dir / f"{setting_key(ecfg, 'vllm')}.json", vllm)
        if result is not None:  # the plot again, with vLLM's figures beside eaglet's
            _write_plot(ctx.out_dir, key, plot_eval(result, vllm))
        stats["vllm"] = vllm_stats(vllm)
        stats["vllm_result"] = f"{setting_key(ecfg, 'vllm')}.json"
    stats["skipped_prompts"] = inp.skipped.by_reason()  # eval.prompts records passed over, by reason
    if result is not None:
        _check_lossless(result, inp.dtype, ctx.out_dir / f"{key}.json")
    if vllm is not None and result is not None:
        check_agreement(vllm, ctx.out_dir / stats["vllm_result"])
    return stats


def _in_process(cfg: Config, ctx: StageContext, inp: EvalInputs, key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    ecfg = cfg.eval
    log(f"[eval] {len(inp.items)} prompts ({ecfg.prompts}), {ecfg.method}, T={ecfg.temperature}, "
        f"{inp.dtype} on {inp.info['device']}")
    result = evaluate_items(inp.target, inp.tokenizer, inp.draft, inp.aux_layers, inp.items, ecfg, inp.render,
                            seed=cfg.run.seed)
    for rec in result["prompts"]:
        if rec["item"].startswith("sample "):
            rec["sample_id"] = int(rec["item"].split()[1])
    result.update(target=inp.info, aux_layers=list(inp.aux_layers), prompt_set=ecfg.prompts, draft=inp.draft_source,
                  input_hash=ctx.input_hash, skipped_prompts=inp.skipped.to_json())
    if ecfg.reference_prompts:
        firsts = list(inp.items)[: ecfg.reference_prompts]
        # replay gives decoding's counts (sampled: drawn as decoding draws them) for less
        quiet = replace(ecfg, baseline=False, lossless_check=False, replay=True)
        log(f"[eval] the untrained reference draft on {len(firsts)} prompts")
        ref = evaluate_items(inp.target, inp.tokenizer, untrained_like(inp.draft, cfg.run.seed), inp.aux_layers,
                             [replace(it, asks=it.asks[:1]) for it in firsts], quiet, inp.render, seed=cfg.run.seed,
                             verbose=False)
        result["reference"] = {"draft": "untrained, same shape", **ref["aggregate"],
                               **against_untrained(result, ref)}
        if result["reference"]["trained_no_better"]:
            log(f"[eval] WARNING: the trained draft is no better than an untrained one of its shape on the same "
                f"{len(firsts)} prompt(s) (tau {_fmt(result['reference']['trained_tau'], 3)} against "
                f"{_fmt(result['reference']['tau'], 3)}): it learnt nothing; see the train stage's log.jsonl (loss, "
                "skipped_steps) and train.lr, or train longer")
    _write_result(ctx.out_dir, key, result)
    agg = result["aggregate"]
    stats = {k: agg.get(k) for k in ("num_prompts", "new_tokens", "verify_forwards", "tau", "tau_ceiling",
                                      "acceptance_rate", "tokens_per_s", "baseline_tokens_per_s", "speedup", "lossless",
                                      "ms_per_cycle", "ms_per_plain_step")}
    stats["result"] = f"{key}.json"
    if "reference" in result:
        stats["reference_tau"] = result["reference"]["tau"]
        stats["trained_no_better_than_untrained"] = result["reference"]["trained_no_better"]
    if "by_category" in result:
        stats["tau_by_category"] = {c: a["tau"] for c, a in result["by_category"].items()}
    return result, stats


def against_untrained(result: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """The trained draft's tau on the prompts the untrained reference decoded (their first turn,
    as the reference asks them), and whether it is no better there (`trained_no_better`: trained
    tau <= untrained tau). A draft that learnt something accepts more than a random one of its
    shape on the same prompts; one that did not (a diverged run, a run far too short) does not."""
    keys = {r["item"] for r in ref["prompts"]}
    same = [r for r in result["prompts"] if r["item"] in keys and r.get("turn", 1) == 1]
    tau = acceptance_stats([a for r in same for a in r["accepted_per_forward"]],
                           result["aggregate"]["tau_ceiling"] - 1)["tau"]
    untrained = ref["aggregate"]["tau"]
    return {"trained_tau": tau,
            "trained_no_better": tau is not None and untrained is not None and tau <= untrained}


def _check_lossless(result: dict[str, Any], dtype: str, path: Path) -> None:
    agg = result["aggregate"]
    if agg.get("lossless") is not False:
        return
    first = agg["mismatches"][0]
    where = f"prompt {first['prompt']} ({result['prompts'][first['prompt']]['item']}) at new token " \
            f"{first['position']} (target top-2 logit gap {first['target_top2_logit_gap']:.3g})"
    if dtype == "float32":
        raise LosslessError(f"lossless check failed in {len(agg['mismatches'])} prompt(s); first: {where}; see {path}")
    log(f"[eval] WARNING: greedy outputs differ in {len(agg['mismatches'])} prompt(s) in {dtype} "
        f"(first: {where}); expected from rounding near ties, checked strictly only in float32")


def _write_result(out_dir: Path, key: str, result: dict[str, Any]) -> None:
    """One result file per setting (`<key>.json`, kept when another setting runs), and the
    latest in-process result also as eval.json / eval.png."""
    atomic_write_json(out_dir / f"{key}.json", result)
    atomic_write_json(out_dir / EVAL_JSON, result)
    _write_plot(out_dir, key, plot_eval(result))


def _write_plot(out_dir: Path, key: str, png: bytes) -> None:
    atomic_write_bytes(out_dir / f"{key}.png", png)
    atomic_write_bytes(out_dir / EVAL_PNG, png)