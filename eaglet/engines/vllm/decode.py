"""Speculative decoding inside vLLM: the target with an exported draft, and vLLM's own
acceptance counters.

    dec = VllmDecoder(target="MODEL", draft="RUN/export/vllm", method="eagle3", k=7, max_model_len=4096,
                      speculative={"parallel_drafting": True})   # the draft type's VLLM_SPECULATIVE, if any
    tokens, seconds, counts = dec.generate(prompts, max_tokens=256, batch=16)
    counts.summary()   # mean acceptance length and acceptance per position, as vLLM counts them

vLLM counts, per engine, the drafts it verified (`vllm:spec_decode_num_drafts`), the draft
tokens proposed and accepted, and the accepted tokens at each draft position
(`vllm:spec_decode_num_accepted_tokens_per_pos`), in its Prometheus registry;
`LLM.get_metrics()` reads them when the engine keeps statistics (`disable_log_stats=False`).
The counters only grow, so a call's figures are the difference of two readings.

vLLM's mean acceptance length is 1 + accepted / drafts: the draft tokens accepted per
verification plus the target's own token, the quantity eaglet's in-process eval calls tau
(eaglet/engines/hf/decode.py: the prefill is no verification in either). Its per-position
figure is accepted_i / drafts (how often position i was accepted at all); eaglet's is
accepted_i / reached_i (how often it was accepted when the one before it was). Both are given.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .capture import stop_llm

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class SpecCounts:
    """vLLM's speculative-decoding counters, summed over its engines."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __sub__(self, before: SpecCounts) -> SpecCounts:
        a, b = _aligned(self.accepted_per_pos, before.accepted_per_pos)
        return SpecCounts(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                          self.accepted - before.accepted, [x - y for x, y in zip(a, b)])

    def __add__(self, other: SpecCounts) -> SpecCounts:
        a, b = _aligned(self.accepted_per_pos, other.accepted_per_pos)
        return SpecCounts(self.drafts + other.drafts, self.draft_tokens + other.draft_tokens,
                          self.accepted + other.accepted, [x + y for x, y in zip(a, b)])

    def summary(self) -> dict[str, Any]:
        """JSON-able: the counters, vLLM's mean acceptance length and both per-position rates."""
        n, per = self.drafts, self.accepted_per_pos
        reached = [n] + per[:-1]
        return {
            "drafts": n,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted,
            "accepted_per_position": list(per),
            "mean_acceptance_length": 1 + self.accepted / n if n else None,
            "acceptance_per_position": [a / n if n else None for a in per],
            "acceptance_rate": [a / r if r else None for a, r in zip(per, reached)],
            "position_reached": reached,
        }


def _aligned(a: list[int], b: list[int]) -> tuple[list[int], list[int]]:
    """Two per-position vectors zero-padded to one length (an engine without a draft has none)."""
    n = max(len(a), len(b))
    return a + [0] * (n - len(a)), b + [0] * (n - len(b))


def spec_counts(metrics: Iterable[Any]) -> SpecCounts:
    """The counters out of `LLM.get_metrics()` (objects with `.name` and `.value`, or `.values`
    for the per-position vector); several engines' (labels) are summed. A metric that is not
    there counts 0: an engine without a draft has none."""
    out = SpecCounts()
    for m in metrics:
        name = getattr(m, "name", None)
        if name == DRAFTS:
            out.drafts += int(m.value)
        elif name == DRAFT_TOKENS:
            out.draft_tokens += int(m.value)
        elif name == ACCEPTED:
            out.accepted += int(m.value)
        elif name == ACCEPTED_PER_POS:
            out = out + SpecCounts(accepted_per_pos=[int(v) for v in m.values])
    return out


def speculative_config(draft: str, k: int, method: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's `speculative_config` for an eaglet export: its speculative method (the draft type's
    SERVING_METHOD), k draft tokens, and the type's own keys (`extra`: its VLLM_SPECULATIVE,
    e.g. P-EAGLE's parallel_drafting; they cannot replace the three)."""
    out = {"method": method, "model": str(draft), "num_speculative_tokens": int(k)}
    clash = sorted(set(extra or {}) & set(out))
    if clash:
        raise ValueError(f"a draft type's VLLM_SPECULATIVE may not set {clash}: eaglet sets them")
    return {**out, **(extra or {})}


class VllmDecoder:
    """vllm.LLM on the target, with the draft (`draft`: an export folder, served by vLLM's
    speculative `method` with the type's `speculative` keys) or without it; greedy."""

    def __init__(self, target: str, *, draft: str | None = None, method: str | None = None, k: int = 0,
                 speculative: dict[str, Any] | None = None,
                 max_model_len: int, dtype: str = "auto", tokenizer: str | None = None, trust_remote_code: bool = False,
                 revision: str | None = None, engine_args: dict[str, Any] | None = None):
        from vllm import LLM

        # A CUDA context made in this process before (the in-process eval's) cannot cross a fork.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        args: dict[str, Any] = {"model": target, "dtype": dtype, "trust_remote_code": trust_remote_code,
                                "max_model_len": int(max_model_len), "disable_log_stats": False,
                                **(engine_args or {})}
        if tokenizer:
            args["tokenizer"] = tokenizer
        if revision:
            args["revision"] = revision
        if draft is not None:
            if method is None:
                raise ValueError(f"the draft {draft} needs vLLM's speculative method that serves it")
            args["speculative_config"] = speculative_config(draft, k, method, speculative)
        self.args = args
        self.llm = LLM(**args)

    def counts(self) -> SpecCounts:
        return spec_counts(self.llm.get_metrics())

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int, batch: int
                 ) -> tuple[list[list[int]], float, SpecCounts]:
        """Greedy continuations of `prompts` (token ids), `batch` prompts per `generate` call;
        (new token ids per prompt, wall seconds, the counters' growth over these calls)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens), detokenize=False)
        before = self.counts()
        out: list[list[int]] = []
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch):
            chunk = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts[i:i + batch]]
            out += [list(o.outputs[0].token_ids) for o in self.llm.generate(chunk, params, use_tqdm=False)]
        seconds = time.perf_counter() - t0
        return out, seconds, self.counts() - before

    def close(self) -> None:
        """Stop the engine core now, so that the next engine of this process gets the GPU memory."""
        stop_llm(self.llm)
        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
