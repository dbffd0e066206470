"""eval.replay: an evaluation's accepted counts by replay instead of decoding
(eaglet/engines/hf/replay.py), the records and aggregate of decoding.py without speed or
lossless figures; for A/Bs over many prompts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..engines.hf.replay import replay_chain, replay_tree, target_side
from .decoding import Decoding


class Replaying(Decoding):
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
            runs = replay_tree(self.draft, side, s.tree_top_k, s.tree_depth, s.tree_total_tokens, eos=self.eos)
        else:
            runs = replay_chain(self.draft, side, eos=self.eos, seed=seed)
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
