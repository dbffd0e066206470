"""One evaluation's measurement by decoding: the target decodes each prompt speculatively with
the draft's proposer (its type's `proposer`; eaglet/engines/hf/decode.py) and, for the baseline and the lossless check, plainly;
each prompt gives a record (tau, acceptance per draft position, speeds, the lossless verdict)
and `Decoding.aggregate` sums records up. replaying.py measures the same counts by replay.
Change here what a record or an aggregate holds."""

from __future__ import annotations

import platform
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from ..config import EvalSection
from ..draft import draft_type_of
from ..engines.hf.decode import (
    SpecSettings,
    TargetRunner,
    acceptance_stats,
    new_cache,
    plain_generate,
    speculative_generate,
)
from ..utils import first_difference
from ..targets.load import eos_ids
from .context_length import of_records
from .progress import ProgressBar


def _top2_gap(runner: TargetRunner, tokens: Sequence[int]) -> float:
    """The target's top-1 minus top-2 logit after `tokens` (a small gap: a numerical near-tie)."""
    logits, _ = runner.forward(new_cache(), tokens, range(len(tokens)), capture=False, last_only=True)
    top = logits[-1].topk(2).values
    return float(top[0] - top[1])


class Decoding:
    """The target and draft of one evaluation, with its settings: decodes prompts into records."""

    def __init__(self, target: nn.Module, tokenizer: Any, draft: nn.Module, aux_layers: Sequence[int],
                 ecfg: EvalSection, seed: int, eos_token_ids: Sequence[int] | None, verbose: bool):
        self.runner = TargetRunner(target, aux_layers)
        _check_compatible(self.runner, draft, aux_layers)
        self.draft = draft.to(device=self.runner.device, dtype=self.runner.dtype).eval()
        self.drafter = draft_type_of(draft).proposer(self.draft)
        self.replay_note: str | None = None  # why eval.replay was not taken (the draft's type does not replay)
        self.s = SpecSettings.from_eval(ecfg)
        self.check = self.s.temperature <= 0 and ecfg.lossless_check
        self.run_plain = ecfg.baseline or self.check
        self.eos = list(eos_ids(target, tokenizer) if eos_token_ids is None else eos_token_ids)
        self.tokenizer, self.seed, self.verbose = tokenizer, seed, verbose
        self.done = 0  # prompts decoded so far: each one's seed is its index
        self.warm = False
        self.bar = ProgressBar()  # progress, while a phase runs (`phase`)
        self.running = {"tokens": 0, "forwards": 0, "checked": 0, "lossless": 0}  # for the bar's postfix

    @contextmanager
    def phase(self, desc: str, prompts: int) -> Iterator[None]:
        """A bar over the new tokens `prompts` prompts decode (speculative and plain: two per
        prompt token), with the prompt count and the running tau in its postfix; none unless
        verbose, and under torchrun only on rank 0."""
        self.bar = ProgressBar(desc, prompts, prompts * self.tokens_per_prompt(), self.verbose)
        try:
            yield
        finally:
            self.bar.close()
            self.bar = ProgressBar()

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
        """tau, acceptance per position (also by context length: context_length.py), speeds and the
        lossless verdict over `records`."""
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
            "by_context_length": of_records(records, s.num_positions),  # each turn's cycles by its prompt's length
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
            **({"replay_note": self.replay_note} if self.replay_note else {}),
        }


def _check_compatible(runner: TargetRunner, draft: nn.Module, aux_layers: Sequence[int]) -> None:
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


def _versions() -> dict[str, str]:
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
