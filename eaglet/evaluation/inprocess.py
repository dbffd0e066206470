"""The in-process evaluation: the loops over prompts (`evaluate_draft` over token ids,
`evaluate_items` over eval items turn by turn) through the measurement eval.replay picks
(decoding.py or replaying.py), and `in_process`, the eval stage's in-process part: the trained
draft over the prompt set, then the untrained reference of its shape on the first prompts.
`evaluate_draft` is the measurement without the pipeline (demo, benchmarks)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..config import Config, EvalSection
from ..context import StageContext
from ..draft import draft_type_of
from ..engines.hf.replay import replay_note
from ..formats.eval_sets import EvalItem, by_category, run_rounds
from ..utils import log
from .decoding import Decoding
from .inputs import EvalInputs
from .replaying import Replaying
from .results import against_untrained, number_text, summary_line


def measurement(target: nn.Module, tokenizer: Any, draft: nn.Module, aux_layers: Sequence[int], ecfg: EvalSection,
                seed: int, eos_token_ids: Sequence[int] | None, verbose: bool) -> Decoding:
    """The measurement `ecfg` asks for: decoding, or replay (eval.replay) where the draft's type
    replays eval.method; where it does not, decoding, with the note saying so in its settings."""
    note = replay_note(draft, ecfg.method) if ecfg.replay else None
    d = (Replaying if ecfg.replay and note is None else Decoding)(target, tokenizer, draft, aux_layers, ecfg, seed,
                                                                  eos_token_ids, verbose)
    if note is not None:
        log(f"[eval] {note}")
        d.replay_note = note
    return d


def evaluate_draft(
    target: nn.Module,
    tokenizer: Any,
    draft: nn.Module,
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
    d = measurement(target, tokenizer, draft, aux_layers, ecfg, seed, eos_token_ids, verbose)
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
    draft: nn.Module,
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
    d = measurement(target, tokenizer, draft, aux_layers, ecfg, seed, None, verbose)

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


def untrained_like(trained: nn.Module, seed: int) -> nn.Module:
    """A randomly initialised draft of `trained`'s type and shape (its type's `from_config`, then
    the module's reset_parameters) with its target-copied embedding and vocabulary maps: the
    floor a trained draft is compared with."""
    torch.manual_seed(seed)
    untrained = draft_type_of(trained).from_config(trained.config.to_dict())
    untrained.reset_parameters()
    with torch.no_grad():
        for name in ("embed_tokens.weight", "d2t", "t2d"):  # the vocabulary maps where the type has them
            if name in trained.state_dict():
                untrained.state_dict()[name].copy_(trained.state_dict()[name])
    return untrained


def in_process(cfg: Config, ctx: StageContext, inp: EvalInputs, key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The in-process eval of `inp`: the trained draft over its prompts, then (eval.reference_prompts)
    the untrained reference by replay on the first of them. Returns (the result, which the stage
    writes as `<key>.json` and eval.json; the stage's stats, which name that file)."""
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
        if "replay_note" in ref["settings"]:
            result["reference"]["replay_note"] = ref["settings"]["replay_note"]
        if "by_category" in ref:
            result["reference"]["tau_by_category"] = {c: a["tau"] for c, a in ref["by_category"].items()}
        log(f"[eval] untrained draft: tau {number_text(result['reference']['tau'], 3)} on {len(firsts)} prompt(s), "
            f"where the trained draft's is {number_text(result['reference']['trained_tau'], 3)}")
        if result["reference"]["trained_no_better"]:
            log(f"[eval] WARNING: the trained draft is no better than an untrained one of its shape on the same "
                f"{len(firsts)} prompt(s) (tau {number_text(result['reference']['trained_tau'], 3)} against "
                f"{number_text(result['reference']['tau'], 3)}): it learnt nothing; see the train stage's log.jsonl "
                "(loss, skipped_steps) and train.lr, or train longer")
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
    stats["by_context_length"] = {b: {k: v[k] for k in ("turns", "cycles", "tau")}
                                  for b, v in agg["by_context_length"].items()}
    return result, stats
