"""The `eval` stage: speculative decoding of held-out prompts with the trained draft.

    eaglet eval CONFIG            # or as the last stage of `eaglet run`

Prompts: the training run's held-out samples (`training/data.py` `split_ids` with train.eval_fraction and
run.seed, over the same sample ids training split), the first `eval.num_prompts` of them,
each cut where its first assistant turn starts (the first loss-masked token), so a prompt
ends with the chat template's generation prompt.

For each prompt the target decodes speculatively with the draft (eaglet.engines.hf.decode: a chain or
the EAGLE-2 tree, greedy or sampled) and, for the baseline, plainly with the same KV cache.
Reported per prompt and overall: tau (tokens per target verification forward), acceptance
rate per draft position, tokens/s of both decoders and the speedup, and at T=0 the lossless
check (the speculative output must equal the target's own greedy output token for token).

Outputs in the stage folder: `eval.json` (settings, per prompt, aggregate, the untrained
reference's tau per prompt, and `prompt_count`: the prompts eval.num_prompts asked for, the ones
the set gave and why fewer) and `eval.png` (the trained draft beside the untrained one:
acceptance per draft position and tau per prompt or category).

Progress: each phase that decodes (the trained draft's speculative and plain decoding, the
untrained reference's replay) feeds a tqdm bar over its new tokens as they are committed, with
the prompt it is at and the running tau and lossless count; a mismatch gets a line of its own,
and each phase ends with a summary line. The decoders hand over counts the host already holds:
no device sync is added. Under torchrun only rank 0 shows them.
A lossless failure in float32 raises after eval.json is written. In bf16/fp16 the
verification forward (many tokens at once) and plain decoding (one at a time) round
differently, so a near-tie can flip; mismatches are then reported, with the target's top-2
logit gap at the first differing position, but do not fail the stage.

`eval.replay` measures decoding by replay instead (eaglet/engines/hf/replay.py): the same
accepted counts from the target's batched greedy continuations and, for a chain, one draft
unroll, for a tree the decoder's tree drafting without the target's forwards; for A/Bs over
many prompts. At a temperature the continuations are sampled from the target and the draft's
acceptances follow them (a tree's exactly, a chain's drawn with their chances). It gives no
speed or lossless figures.

`evaluate_draft` is the same measurement without the pipeline (demo, doctor).

The in-process decoders are the HF engine's (eaglet/engines/hf/decode.py, replay.py). An engine
that serves an export format also measures the exported draft where it will run, after the
in-process eval: the registry's `eval_engine` says which (eval.vllm: the vLLM engine's
`run_eval`, eaglet/engines/vllm/eval.py; its result `<setting>-<engine>.json`).
"""

from __future__ import annotations

import gc
import io
import platform
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from ..config import Config, EvalSection
from ..distributed import dist_env, resolve_device
from ..draft.model import Eagle3Draft
from ..engines.hf.decode import (
    DraftRunner,
    SpecSettings,
    TargetRunner,
    acceptance_stats,
    first_difference,
    new_cache,
    plain_generate,
    speculative_generate,
)
from ..engines.hf.replay import replay_chain, replay_tree, target_side
from ..errors import InputError, VerificationError
from ..formats.draft import FINAL_DIR, load_final
from ..formats.prepared import PreparedData
from ..formats.serving import Loaded, draft_model, load_draft
from ..formats.loaders import ENGINES, PROBLEMS
from ..targets.chat import generation_prompt, load_tokenizer, resolve_chat_template
from ..targets.families import default_layers, family_of
from ..targets.load import TargetParts, load_target
from ..utils import atomic_write_bytes, atomic_write_json, log
from ..context import StageContext
from ..formats.eval_sets import (EvalItem, SkippedPrompts, by_category, named_items, no_heldout_error, prompt_count, run_rounds,
                        set_name)
from ..engines import eval_engine
from ..engines.states import split_source
from ..training.data import split_ids

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


class _Bar:
    """eval's progress, a tqdm bar as extract's and train's: the new tokens a phase decodes (its
    total shrinks by what a prompt's early EOS leaves undecoded), the prompt it is at and the
    running figures in its postfix. Shown when `show`, under torchrun on rank 0 only; without a
    `desc` (no phase running) it counts nothing."""

    def __init__(self, desc: str = "", prompts: int = 0, total: int = 0, show: bool = False):
        self.prompts = prompts
        self.shown = bool(desc) and show and dist_env().is_main
        self.tqdm = tqdm(total=total, desc=desc, unit="tok", dynamic_ncols=True, disable=not self.shown) if desc else None
        self.at: dict[str, str] = {}  # the prompt it is at and which decode
        self.postfix: dict[str, str] = {}  # the running figures

    def update(self, n: int) -> None:
        if self.tqdm is not None:
            self.tqdm.update(n)

    def warming_up(self, done: bool = False) -> None:
        """The warm-up runs (or ran: the clock starts again, so that the rate and the ETA leave it out)."""
        if self.tqdm is None:
            return
        if done:
            self.at.pop("decoding", None)
            self.tqdm.reset(total=self.tqdm.total)
        else:
            self.at["decoding"] = "warm-up"
        self.show_postfix()

    def prompt(self, i: int, what: str = "") -> None:
        """Prompt `i` (1-based, as the plot and the messages number them) starts; `what`: which decode."""
        self.at = {"prompt": f"{i}/{self.prompts}", **({"decoding": what} if what else {})}
        self.show_postfix()

    def batch(self, first: int, last: int, what: str) -> None:
        """Prompts `first` to `last` (1-based) run together (replay's batches); `what`: which part."""
        self.at = {"prompts": f"{first}-{last}/{self.prompts}", "decoding": what}
        self.show_postfix()

    def ended(self, undecoded: int) -> None:
        """A decode ended `undecoded` tokens short of max_new_tokens (an EOS): the total drops by them."""
        if self.tqdm is not None and undecoded > 0:
            self.tqdm.total -= undecoded
        self.show_postfix()

    def show_postfix(self) -> None:
        if self.tqdm is not None:
            self.tqdm.set_postfix({**self.at, **self.postfix}, refresh=False)

    def write(self, line: str) -> None:
        """A line above the bar (a mismatch), when the bar is shown."""
        if self.shown:
            tqdm.write(line, file=sys.stderr)

    def close(self) -> None:
        if self.tqdm is not None:
            self.tqdm.close()


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
        self.bar = _Bar()  # progress, while a phase runs (`phase`)
        self.running = {"tokens": 0, "forwards": 0, "checked": 0, "lossless": 0}  # for the bar's postfix

    @contextmanager
    def phase(self, desc: str, prompts: int) -> Iterator[None]:
        """A bar over the new tokens `prompts` prompts decode (speculative and plain: two per
        prompt token), with the prompt count and the running tau in its postfix; none unless
        verbose, and under torchrun only on rank 0."""
        self.bar = _Bar(desc, prompts, prompts * self.tokens_per_prompt(), self.verbose)
        try:
            yield
        finally:
            self.bar.close()
            self.bar = _Bar()

    def tokens_per_prompt(self) -> int:
        """The most new tokens the bar counts for one prompt."""
        return self.s.max_new_tokens * (2 if self.run_plain else 1)

    def warmup(self, prompt: Sequence[int]) -> None:
        """First calls allocate and pick kernels; keep them out of the timings."""
        short = replace(self.s, max_new_tokens=min(8, self.s.max_new_tokens))
        first = [int(t) for t in prompt]
        self.bar.warming_up()
        speculative_generate(self.runner, self.drafter, first, short, self.eos, torch.Generator().manual_seed(self.seed))
        if self.run_plain:
            plain_generate(self.runner, first, short.max_new_tokens, self.s.temperature, self.eos,
                           torch.Generator().manual_seed(self.seed))
        self.bar.warming_up(done=True)
        self.warm = True

    def decode(self, prompts: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
        records = []
        for prompt in prompts:
            records.append(self._one([int(t) for t in prompt], self.done))
            self.done += 1
        return records

    def _one(self, prompt: list[int], i: int) -> dict[str, Any]:
        s, runner, bar, run = self.s, self.runner, self.bar, self.running
        bar.prompt(i + 1, "speculative" if self.run_plain else "")
        g = speculative_generate(runner, self.drafter, prompt, s, self.eos,
                                 torch.Generator().manual_seed(self.seed * 1_000_003 + i),
                                 timed=runner.device.type == "cpu",  # no device syncs to add on a CPU
                                 progress=bar.update)
        bar.ended(s.max_new_tokens - len(g.tokens))
        run["tokens"] += sum(a + 1 for a in g.accepted)
        run["forwards"] += len(g.accepted)
        if run["forwards"]:
            bar.postfix["tau"] = f"{run['tokens'] / run['forwards']:.2f}"
        rec = self._record(i, prompt, g.tokens, g.accepted, g.seconds)
        if g.phases:
            rec["phase_seconds"] = {k: round(v, 5) for k, v in g.phases.items()}
        if self.run_plain:
            bar.prompt(i + 1, "plain")
            b = plain_generate(runner, prompt, s.max_new_tokens, s.temperature, self.eos,
                               torch.Generator().manual_seed(self.seed * 1_000_003 + i + 500_000),
                               progress=bar.update)
            bar.ended(s.max_new_tokens - len(b.tokens))
            rec["baseline_new_tokens"] = len(b.tokens)
            rec["baseline_seconds"] = round(b.seconds, 4)
            rec["baseline_tokens_per_s"] = len(b.tokens) / b.seconds if b.seconds > 0 else None
            if rec["tokens_per_s"] and rec["baseline_tokens_per_s"]:
                rec["speedup"] = rec["tokens_per_s"] / rec["baseline_tokens_per_s"]
            if self.check:
                diff = first_difference(g.tokens, b.tokens)
                rec["lossless"] = diff is None
                rec["first_mismatch"] = diff
                run["checked"] += 1
                run["lossless"] += diff is None
                bar.postfix["lossless"] = f"{run['lossless']}/{run['checked']}"
                if diff is not None:
                    rec["mismatch"] = {
                        "speculative": g.tokens[diff] if diff < len(g.tokens) else None,
                        "target": b.tokens[diff] if diff < len(b.tokens) else None,
                        "target_top2_logit_gap": _top2_gap(runner, prompt + b.tokens[:diff]),
                    }
                    bar.write(f"[eval] prompt {i + 1}: the speculative output differs from the target's own at new "
                              f"token {diff} (target top-2 logit gap {rec['mismatch']['target_top2_logit_gap']:.3g})")
        bar.show_postfix()
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
    """eval.replay: chains' or trees' accepted counts by replay (eaglet/engines/hf/replay.py), all
    prompts of a call at once; no plain decode, so no speed or lossless figures. At a
    temperature the continuations are sampled from the target (seeded by the eval's seed) and
    the draft's acceptances given them: a tree's exactly, a chain's drawn once."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.check = self.run_plain = False

    def warmup(self, prompt: Sequence[int]) -> None:
        self.warm = True

    def tokens_per_prompt(self) -> int:
        """The target's continuation of a prompt, the tokens the bar counts (EOS does not stop it)."""
        return self.s.max_new_tokens + self.s.num_positions

    def decode(self, prompts: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
        s, bar = self.s, self.bar
        seed = self.seed * 1_000_003 + self.done  # this call's: a later call's prompts sample afresh
        bar.batch(self.done + 1, self.done + len(prompts), "the target's continuations")
        side = target_side(self.runner.model, self.runner.aux_layers, prompts, s.max_new_tokens, s.num_positions,
                           temperature=s.temperature, seed=seed, progress=bar.update)
        bar.batch(self.done + 1, self.done + len(prompts), "the draft's replay")
        if s.method == "tree":
            runs = replay_tree(self.drafter.draft, side, s.tree_top_k, s.tree_depth, s.tree_total_tokens, eos=self.eos)
        else:
            runs = replay_chain(self.drafter.draft, side, eos=self.eos, seed=seed)
        records = []
        for prompt, (accepted, tokens) in zip(prompts, runs, strict=True):
            records.append(self._record(self.done, prompt, tokens, accepted, 0.0))  # nothing decoded: no time
            self.done += 1
        for r in records:
            self.running["tokens"] += sum(a + 1 for a in r["accepted_per_forward"])
            self.running["forwards"] += len(r["accepted_per_forward"])
        if self.running["forwards"]:
            bar.postfix["tau"] = f"{self.running['tokens'] / self.running['forwards']:.2f}"
        bar.show_postfix()
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
    desc: str = "eval",
) -> dict[str, Any]:
    """Speculative vs plain decoding of `prompts` (token id lists); returns
    {"settings", "prompts": [...], "aggregate"} (JSON-able). The draft is moved to the
    target's input device and dtype. `tokenizer` (optional) adds decoded texts and EOS ids.
    verbose: a progress bar named `desc` while it decodes, then a summary line.

    The plain decode runs when ecfg.baseline is set, or when the lossless check needs it
    (greedy with ecfg.lossless_check)."""
    d = _decoding(target, tokenizer, draft, aux_layers, ecfg, seed, eos_token_ids, verbose)
    with d.phase(desc, len(prompts)):
        if warmup and prompts:
            d.warmup(prompts[0])
        records = d.decode(prompts)
    result = {"settings": d.settings(), "prompts": records, "aggregate": d.aggregate(records)}
    if verbose:
        log(summary_line(result["aggregate"]))
    return result


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
    desc: str = "eval",
) -> dict[str, Any]:
    """evaluate_draft over eval items, turn by turn (eaglet/formats/eval_sets.py): a later turn is
    asked after the target's own answers (the speculative output, which greedy decoding keeps
    equal to the target's). Adds "by_category" when the items have categories. verbose: a
    progress bar named `desc` over every turn's decoding (no summary line: the caller's)."""
    d = _decoding(target, tokenizer, draft, aux_layers, ecfg, seed, None, verbose)

    def decode(prompts: list[list[int]], _items: list[EvalItem]) -> list[tuple[list[int], dict[str, Any]]]:
        if warmup and not d.warm and prompts:
            d.warmup(prompts[0])
        return [(r["tokens"], r) for r in d.decode(prompts)]

    with d.phase(desc, sum(it.turns for it in items)):
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


def summary_line(agg: dict[str, Any]) -> str:
    """One line for a finished evaluation: tau, the speeds and the lossless verdict."""
    line = (f"[eval] {agg['num_prompts']} prompt(s), {agg['new_tokens']} new tokens: tau {_fmt(agg['tau'])} "
            f"(ceiling {agg['tau_ceiling']})")
    if agg.get("tokens_per_s"):
        line += f"; speculative {_fmt(agg['tokens_per_s'], 1)} tok/s"
        if agg.get("baseline_tokens_per_s"):
            line += f", plain {_fmt(agg['baseline_tokens_per_s'], 1)} tok/s ({_fmt(agg.get('speedup'))}x)"
    if "lossless" in agg:
        bad = len(agg["mismatches"])
        line += (f"; lossless on all {agg['num_prompts']}" if not bad else
                 f"; NOT lossless: {bad} of {agg['num_prompts']} differ from the target's own output")
    return line


def _versions() -> dict[str, str]:
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


# ---- prompts ----------------------------------------------------------------------------------


def heldout_prompts(data: PreparedData, split_sample_ids: np.ndarray, eval_fraction: float, seed: int,
                    num_prompts: int) -> list[tuple[int, list[int]]]:
    """(sample id, prompt tokens) of the first `num_prompts` held-out samples that have an
    assistant turn after some prompt (`heldout_selection` without its counts)."""
    return heldout_selection(data, split_sample_ids, eval_fraction, seed, num_prompts)[0]


def heldout_selection(data: PreparedData, split_sample_ids: np.ndarray, eval_fraction: float, seed: int,
                      num_prompts: int) -> tuple[list[tuple[int, list[int]]], dict[str, int]]:
    """(sample id, prompt tokens) of the first `num_prompts` held-out samples that have an
    assistant turn after some prompt; each cut before its first loss-masked token, and each
    prompt once: conversations that open with the assistant's turn (a third of ShareGPT's)
    all cut to the template's bare system prompt, which would otherwise be evaluated again
    and again. With the held-out samples passed over on the way, counted by why
    (`held_out`: the split's; `duplicates`: a prompt taken already; `no_prompt`: no assistant
    turn after a prompt; `missing`: not in the prepared data)."""
    _, eval_ids = split_ids(split_sample_ids, eval_fraction, seed)
    row_of = {int(sid): i for i, sid in enumerate(data.sample_ids.tolist())}
    out, seen = [], set()
    counts = {"held_out": len(eval_ids), "duplicates": 0, "no_prompt": 0, "missing": 0}
    for sid in eval_ids.tolist():
        if len(out) >= num_prompts:
            break
        if sid not in row_of:
            counts["missing"] += 1
            continue
        sample = data[row_of[sid]]
        masked = np.flatnonzero(np.asarray(sample.loss_mask) > 0)
        if masked.size == 0 or masked[0] == 0:
            counts["no_prompt"] += 1
            continue
        prompt = tuple(np.asarray(sample.input_ids[: masked[0]], dtype=np.int64).tolist())
        if prompt in seen:
            counts["duplicates"] += 1
            continue
        seen.add(prompt)
        out.append((int(sid), list(prompt)))
    return out, counts


# ---- plot -------------------------------------------------------------------------------------


TRAINED, UNTRAINED, VLLM = "#1f77b4", "#ff7f0e", "#9467bd"  # blue, orange, purple: told apart in colour-blind sight too


def plot_eval(result: dict[str, Any], vllm: dict[str, Any] | None = None) -> bytes:
    """eval.png (`eval_figure`) as PNG bytes."""
    buf = io.BytesIO()
    eval_figure(result, vllm).savefig(buf, format="png")
    return buf.getvalue()


def eval_figure(result: dict[str, Any], vllm: dict[str, Any] | None = None) -> Any:
    """eval.png's figure: the trained draft beside the untrained one of its shape (and vLLM's figures when
    there), in the same colours on both panels. Left: acceptance at each draft position (accepted
    when reached; the axis is [0, 1]), grouped bars, with how often the trained draft reached each
    position. Right: tau per prompt (numbered from 1, as the messages number them) or per
    category, grouped bars from 0 with a line at 1 (plain decoding's one token per forward) and
    each draft's overall tau. The title gives both taus; the line under it the speedup, what it
    is, and the lossless verdict."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    agg, recs, st = result["aggregate"], result["prompts"], result["settings"]
    ref = result.get("reference")
    fig = Figure(figsize=(13, 5.4), dpi=110)
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    nan = float("nan")
    num = lambda xs: [nan if x is None else float(x) for x in xs]
    series = [("trained draft", TRAINED)] + ([("untrained draft", UNTRAINED)] if ref else []) + (
        [("vLLM, trained draft", VLLM)] if vllm else [])

    def grouped(ax: Any, xs: np.ndarray, columns: list[list[float]], labels: bool, top: float, base: float = 0.0,
                missing: str = "") -> None:
        """Side-by-side bars, one column of values per series (NaN: no bar, labelled `missing`),
        labelled with their values."""
        width = 0.8 / len(columns)
        for j, (values, (_, colour)) in enumerate(zip(columns, series)):
            x = xs + (j - (len(columns) - 1) / 2) * width
            # an edge in the bar's colour: a bar of height 0 still shows, as a line on the axis
            ax.bar(x, [0 if np.isnan(v) else v - base for v in values], width, bottom=base, color=colour,
                   edgecolor=[colour if not np.isnan(v) else "none" for v in values], linewidth=1.5)
            if not labels:
                continue
            for xi, v in zip(x, values):
                if np.isnan(v):
                    if missing:
                        ax.text(xi, base + 0.01 * (top - base), missing, ha="center", va="bottom", fontsize=6,
                                rotation=90, color=colour)
                    continue
                inside = v - base > 0.9 * (top - base)
                ax.text(xi, v - 0.01 * (top - base) if inside else v + 0.01 * (top - base), f"{v:.2f}", ha="center",
                        va="top" if inside else "bottom", fontsize=7, color="white" if inside else colour)

    # left: acceptance per draft position
    rates = num(agg["acceptance_rate"])
    pos = np.arange(1, len(rates) + 1)
    columns = [rates] + ([num(ref["acceptance_rate"])[: len(rates)]] if ref else [])
    if vllm:
        columns.append((num(vllm["acceptance"]["acceptance_rate"]) + [nan] * len(rates))[: len(rates)])
    columns = [c + [nan] * (len(rates) - len(c)) for c in columns]
    grouped(ax1, pos, columns, len(rates) <= 10, 1.0, missing="not reached")
    forwards = max(1, agg["verify_forwards"])
    ax1.set_xticks(pos, [f"{p}\n{n / forwards:.0%}" for p, n in zip(pos, agg["position_reached"])], fontsize=8)
    ax1.set_ylim(0, 1)
    ax1.set_xlabel("draft position (under it: the share of the trained draft's verifications that reached it)",
                   fontsize=9)
    ax1.set_ylabel("acceptance (accepted / reached)")
    ax1.set_title("acceptance per draft position")

    # right: tau per prompt or per category
    ceiling = agg["tau_ceiling"]
    cats = result.get("by_category")
    if cats:
        names = list(cats)
        xs = np.arange(1, len(names) + 1)
        columns = [num([cats[c]["tau"] for c in names])]
        if ref:
            columns.append(num([(ref.get("tau_by_category") or {}).get(c) for c in names]))
        if vllm:
            columns.append(num([((vllm.get("by_category") or {}).get(c) or {}).get("mean_acceptance_length")
                                for c in names]))
        ax2.set_xticks(xs, names, rotation=30, fontsize=8)
        ax2.set_xlabel("category")
        what = "category"
    else:
        xs = np.arange(1, len(recs) + 1)
        columns = [num([r["tau"] for r in recs])]
        if ref:
            ref_tau = {p["item"]: p["tau"] for p in ref.get("prompts", [])}
            columns.append(num([ref_tau.get(r["item"]) if r.get("turn", 1) == 1 else None for r in recs]))
        if vllm:
            columns.append([nan] * len(recs))  # vLLM's counters give no per-prompt figure
        if len(xs) <= 25:
            ax2.set_xticks(xs)
        else:
            ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax2.set_xlim(0.4, len(xs) + 0.6)
        covered = sum(not np.isnan(v) for v in columns[1]) if ref else len(recs)
        ax2.set_xlabel("prompt (numbered from 1, as eval's messages number them)"
                       + (f"\nthe untrained draft ran on the first {covered}" if covered < len(recs) else ""))
        what = "prompt"
    values = [v for c in columns for v in c if not np.isnan(v)]
    top = min(float(ceiling), max(values + [1.0]) * 1.2 + 0.1)
    grouped(ax2, xs, columns, len(xs) * len(columns) <= 24, top)
    lines = [ax2.axhline(1, color="0.3", linewidth=0.8, linestyle=":", label="1 = plain decoding (no draft token accepted)")]
    if agg["tau"] is not None:
        lines.append(ax2.axhline(agg["tau"], color=TRAINED, linestyle="--", linewidth=1,
                                 label=f"trained draft, all {agg['num_prompts']} prompts: {agg['tau']:.2f}"))
    if ref and ref.get("tau") is not None:
        lines.append(ax2.axhline(ref["tau"], color=UNTRAINED, linestyle="--", linewidth=1,
                                 label=f"untrained draft, its {ref['num_prompts']} prompts: {ref['tau']:.2f}"))
    if vllm and vllm["acceptance"].get("mean_acceptance_length"):
        mal = vllm["acceptance"]["mean_acceptance_length"]
        lines.append(ax2.axhline(mal, color=VLLM, linestyle="--", linewidth=1, label=f"vLLM overall: {mal:.2f}"))
    ax2.set_ylim(0, top)
    ax2.set_ylabel(f"tau (tokens per verification forward; ceiling {ceiling})")
    ax2.set_title(f"tau per {what}")

    drafting = f"chain of {st['chain_tokens']}" if st["method"] == "chain" else \
        f"tree {st['tree_top_k']}x{st['tree_depth']}, {st['tree_total_tokens']} tokens"
    temp = "greedy" if st["temperature"] <= 0 else f"T={st['temperature']:g}"
    title = f"{result.get('prompt_set', 'heldout')} prompts, {drafting}, {temp}: trained draft tau {_fmt(agg['tau'])}"
    if ref:
        title += f", untrained draft {_fmt(ref.get('tau'))}"
        if ref["num_prompts"] != agg["num_prompts"]:
            title += f" (on its {ref['num_prompts']} prompts: trained {_fmt(ref.get('trained_tau'))})"
    fig.suptitle(title, fontsize=11)
    notes = []
    if agg.get("speedup"):
        note = (f"speedup {agg['speedup']:.2f}x = speculative / plain decoding tokens/s ({agg['tokens_per_s']:.1f} / "
                f"{agg['baseline_tokens_per_s']:.1f}) on {st['device']}, {st['dtype']}")
        if agg["speedup"] < 1 and str(st["device"]).startswith("cpu"):
            note += ("; below 1 on a CPU, where verifying several tokens costs several plain steps (the run's summary "
                     "says where a cycle's time goes)")
        notes.append(note)
    if "lossless" in agg:
        bad = len(agg["mismatches"])
        notes.append(f"lossless: the output equals the target's own greedy output on all {agg['num_prompts']} prompts"
                     if not bad else f"NOT lossless: {bad} of {agg['num_prompts']} outputs differ from the target's "
                                     "own (eval.json: mismatches)")
    if notes:
        fig.text(0.5, 0.935, "\n".join(notes), ha="center", va="top", fontsize=8, color="0.25")
    patches = [Patch(color=c, label=n) for n, c in series]
    fig.legend(handles=patches + lines, loc="lower center", ncol=max(len(patches), (len(patches) + len(lines) + 1) // 2),
               fontsize=8, frameon=False)
    fig.subplots_adjust(left=0.06, right=0.985, bottom=0.23, top=0.86 - 0.04 * len(notes), wspace=0.2)
    return fig


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
    prompt_count: dict[str, Any] = field(default_factory=dict)  # eval_sets.prompt_count: asked, used, why fewer


def eval_inputs(cfg: Config, upstream: dict[str, Any], load_models: bool = True, served: Any = None) -> EvalInputs:
    """The prompt set, draft, target and tokenizer of an evaluation over the run whose stage
    folders are `upstream` (the draft: eval.draft, else the run's trained one). Without
    `load_models` the target and the draft stay unloaded (None): the eval in the engine `served`
    (eaglet/engines/base.py `Engine`: `eval_engine`) alone."""
    ecfg = cfg.eval
    held: dict[str, int] = {}  # the held-out samples passed over, by why (heldout_selection)

    def heldout() -> list[tuple[int, list[int]]]:
        data = PreparedData(upstream["prepare"])
        # Split the ids that training split (the extract store's, which may lack set-aside
        # samples), so that the held-out prompts are exactly the ones training never saw.
        split_ids_from = split_source(upstream) if "extract" in upstream else data.sample_ids
        named, counts = heldout_selection(data, split_ids_from, cfg.train.eval_fraction, cfg.run.seed,
                                          ecfg.num_prompts)
        held.update(counts)
        if not named:  # before the target loads
            raise no_heldout_error(len(split_ids_from), counts["held_out"], cfg.train.eval_fraction)
        return named

    items, skipped = named_items(ecfg.prompts, ecfg.num_prompts, heldout, cfg.prepare.format, cfg.prepare.multimodal)
    count = prompt_count(ecfg.prompts, ecfg.num_prompts, len(items), skipped, held or None)
    if warning := skipped.warning():  # before the target loads
        log(f"[eval] WARNING: {warning}")
    dtype = resolve_eval_dtype(ecfg)
    tokenizer = load_tokenizer(cfg.target)
    template = resolve_chat_template(tokenizer, cfg.target)
    render = lambda messages: generation_prompt(tokenizer, template, messages)
    if not load_models:  # the engine reads the draft's folder (eval.draft, else the run's export): checked here first
        return EvalInputs(items, None, [], None, tokenizer, {"device": served.NAME}, dtype, render,
                          served_draft(cfg, upstream, served), skipped, count)
    # the draft is read and checked (checksums, finite weights, eval.draft's loader format) before the target loads
    if ecfg.draft:
        exported = read_eval_draft(ecfg.draft)
    else:
        source = str(upstream["train"] / FINAL_DIR)
        draft, aux_layers = load_final(upstream["train"] / FINAL_DIR)
    log(f"[eval] loading the target {cfg.target.path} ({dtype} on {resolve_device(ecfg.device)})")
    target, info = load_target(replace(cfg.target, device=ecfg.device, dtype=dtype))
    if ecfg.draft:
        draft, aux_layers, source = _exported_draft(exported, target)
    return EvalInputs(items, draft, list(aux_layers), target, tokenizer, info, dtype, render, source, skipped, count)


def read_eval_draft(path: str, own: bool = False) -> Loaded:
    """eval.draft read (`load_draft`: checked against its checksums.json where eaglet wrote it,
    every weight finite) and holding what its engine's loader reads
    (eaglet/formats/loaders.py), so that eval measures the draft the engine would serve;
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


def served_draft(cfg: Config, upstream: dict[str, Any], served: Any) -> str:
    """The folder the eval in the engine `served` hands it as its draft, eval.draft or else the
    run's export in the engine's format (`<export>/<EXPORT_FORMAT>`), checked first
    (`read_eval_draft`: checksums, finite weights, its loader's format): an engine would load a
    damaged file without a word."""
    if cfg.eval.draft:
        read_eval_draft(cfg.eval.draft)
        return cfg.eval.draft
    fmt = served.EXPORT_FORMAT
    folder = Path(upstream["export"]) / fmt
    if not folder.is_dir():
        raise InputError(f"the {served.TITLE} eval serves the run's {fmt} export, and there is none in "
                         f"{folder.parent}", fix=f"add {fmt} to export.formats and run `eaglet export CONFIG`, or "
                                             "name an export in eval.draft")
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
    served = eval_engine(ecfg)  # the engine that measures the exported draft too (eval.vllm), or None
    if not ecfg.in_process and served is None:
        raise InputError("eval.in_process is off and the vLLM eval does not run (eval.vllm)",
                         fix="set eval.in_process=true, or eval.vllm=on on a machine with vLLM and a GPU")
    if served is not None and ecfg.in_process and not ecfg.draft:  # its export, checked before the target loads
        served_draft(cfg, ctx.upstream, served)
    inp = eval_inputs(cfg, ctx.upstream, load_models=ecfg.in_process, served=served)
    result, stats, key = None, {}, setting_key(ecfg)
    if ecfg.in_process:
        result, stats = _in_process(cfg, ctx, inp, key)
    engine_result = None
    if served is not None:
        inp.target = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        engine_result = served.run_eval(cfg, ctx, inp, result)
        atomic_write_json(ctx.out_dir / f"{setting_key(ecfg, served.NAME)}.json", engine_result)
        if result is not None:  # the plot again, with the engine's figures beside eaglet's
            _write_plot(ctx.out_dir, key, plot_eval(result, engine_result))
        stats[served.NAME] = served.eval_stats(engine_result)
        stats[f"{served.NAME}_result"] = f"{setting_key(ecfg, served.NAME)}.json"
    stats["skipped_prompts"] = inp.skipped.by_reason()  # eval.prompts records passed over, by reason
    stats["prompt_count"] = inp.prompt_count  # asked, used, and why fewer
    if result is not None:
        _check_lossless(result, inp.dtype, ctx.out_dir / f"{key}.json")
    if served is not None and result is not None:
        served.check_eval_agreement(engine_result, ctx.out_dir / stats[f"{served.NAME}_result"])
    return stats


def _in_process(cfg: Config, ctx: StageContext, inp: EvalInputs, key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    ecfg = cfg.eval
    note = inp.prompt_count.get("note")
    log(f"[eval] {len(inp.items)} prompts ({ecfg.prompts}{'; ' + note if note else ''}), {ecfg.method}, "
        f"T={ecfg.temperature}, {inp.dtype} on {inp.info['device']}")
    result = evaluate_items(inp.target, inp.tokenizer, inp.draft, inp.aux_layers, inp.items, ecfg, inp.render,
                            seed=cfg.run.seed)
    log(summary_line(result["aggregate"]))
    for rec in result["prompts"]:
        if rec["item"].startswith("sample "):
            rec["sample_id"] = int(rec["item"].split()[1])
    result.update(target=inp.info, aux_layers=list(inp.aux_layers), prompt_set=ecfg.prompts, draft=inp.draft_source,
                  input_hash=ctx.input_hash, skipped_prompts=inp.skipped.to_json(), prompt_count=inp.prompt_count)
    if ecfg.reference_prompts:
        firsts = list(inp.items)[: ecfg.reference_prompts]
        # replay gives decoding's counts (sampled: drawn as decoding draws them) for less
        quiet = replace(ecfg, baseline=False, lossless_check=False, replay=True)
        log(f"[eval] the untrained reference draft on {len(firsts)} prompts (by replay)")
        ref = evaluate_items(inp.target, inp.tokenizer, untrained_like(inp.draft, cfg.run.seed), inp.aux_layers,
                             [replace(it, asks=it.asks[:1]) for it in firsts], quiet, inp.render, seed=cfg.run.seed,
                             desc="eval, untrained draft")
        result["reference"] = {"draft": "untrained, same shape", **ref["aggregate"],
                               **against_untrained(result, ref),
                               "prompts": [{"item": r["item"], "tau": r["tau"]} for r in ref["prompts"]]}
        if "by_category" in ref:
            result["reference"]["tau_by_category"] = {c: a["tau"] for c, a in ref["by_category"].items()}
        log(f"[eval] untrained draft: tau {_fmt(result['reference']['tau'], 3)} on {len(firsts)} prompt(s), where "
            f"the trained draft's is {_fmt(result['reference']['trained_tau'], 3)}")
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
    if "mismatches" in agg:
        stats["lossless_mismatches"] = len(agg["mismatches"])
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
    where = f"prompt {first['prompt'] + 1} ({result['prompts'][first['prompt']]['item']}) at new token " \
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