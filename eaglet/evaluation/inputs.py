"""An evaluation's inputs: its prompts (the run's held-out samples, `heldout_selection`, their
later turns, `heldout_conversations`, or eval.prompts' items, eaglet/formats/eval_sets.py), the
tokenizer's rendering of them, and the
draft and target it loads (`load_eval_models`; eval.draft read as its engine's loader reads it,
`read_eval_draft`). The eval stage puts them together in an `EvalInputs`; change here which
prompts an evaluation takes or how its models load."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from ..config import Config, EvalSection
from ..distributed import resolve_device
from ..engines.states import split_source
from ..errors import InputError
from ..formats.draft import FINAL_DIR, load_final
from ..formats.datasets import RecordError, iter_records, normalize_record
from ..formats.eval_sets import (HELDOUT, HELDOUT_TURNS, EvalItem, Message, SkippedPrompts, later_turn, named_items,
                                 no_heldout_error, prompt_count)
from ..formats.loaders import ENGINES, PROBLEMS
from ..formats.prepared import PreparedData
from ..formats.serving import Loaded, draft_model, load_draft
from ..targets.chat import generation_prompt, load_tokenizer, resolve_chat_template
from ..targets.families import default_layers, family_of
from ..targets.load import TargetParts, load_target
from ..training.data import split_ids
from ..utils import log


@dataclass
class EvalInputs:
    """What an evaluation runs on: its prompt set, draft and target (None when not loaded), the
    prompt rendering, and what the result records of them."""

    items: list[EvalItem]
    draft: nn.Module | None  # None: not loaded (the vLLM eval alone)
    aux_layers: list[int]
    target: Any
    tokenizer: Any
    info: dict[str, Any]
    dtype: str
    render: Callable[[list[dict[str, str]]], list[int]]
    draft_source: str  # the final/ folder or the export folder the draft came from
    skipped: SkippedPrompts = field(default_factory=SkippedPrompts)  # eval.prompts records passed over
    prompt_count: dict[str, Any] = field(default_factory=dict)  # eval_sets.prompt_count: asked, used, why fewer


def resolve_eval_dtype(ecfg: EvalSection) -> str:
    """'auto': float32 on CPU (the lossless check needs it), bfloat16 on a GPU."""
    if ecfg.dtype != "auto":
        return ecfg.dtype
    return "bfloat16" if resolve_device(ecfg.device).type == "cuda" else "float32"


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


def heldout_conversations(data: PreparedData, split_sample_ids: np.ndarray, eval_fraction: float, seed: int,
                          num_prompts: int, fmt: str = "auto", multimodal: str = "drop"
                          ) -> tuple[list[tuple[int, list[Message]]], dict[str, int]]:
    """(sample id, conversation) of the first `num_prompts` held-out samples (the split of
    `heldout_selection`) whose conversation has two user turns or more (eval_sets.later_turn),
    each read back in full from the record prepare made it of (its source file and row,
    normalised as prepare normalised it: not cut at prepare.max_length), each conversation once.
    With the held-out samples passed over, counted by why (`held_out`: the split's;
    `one_user_turn`; `duplicates`; `missing`: not in the prepared data; `no_record`: its record
    no longer there or readable). A source file that is gone is an InputError naming it."""
    _, eval_ids = split_ids(split_sample_ids, eval_fraction, seed)
    row_of = {int(sid): i for i, sid in enumerate(data.sample_ids.tolist())}
    counts = {"held_out": len(eval_ids), "duplicates": 0, "one_user_turn": 0, "missing": 0, "no_record": 0}
    where: list[tuple[int, int, int] | None] = []  # (sample id, source file, row) in the split's order
    for sid in eval_ids.tolist():
        sample = data[row_of[sid]] if sid in row_of else None
        where.append(None if sample is None else (int(sid), sample.source_file, sample.source_row))
    records = _source_records(data.files, {(w[1], w[2]) for w in where if w is not None})
    out, seen = [], set()
    for w in where:
        if len(out) >= num_prompts:
            break
        if w is None:
            counts["missing"] += 1
            continue
        try:
            messages = normalize_record(records[w[1], w[2]], fmt, multimodal) if (w[1], w[2]) in records else None
        except RecordError:
            messages = None
        if messages is None:
            counts["no_record"] += 1
            continue
        if later_turn(messages) is None:
            counts["one_user_turn"] += 1
            continue
        key = tuple((m["role"], m["content"]) for m in messages)
        if key in seen:
            counts["duplicates"] += 1
            continue
        seen.add(key)
        out.append((w[0], messages))
    return out, counts


def _source_records(files: list[str], wanted: set[tuple[int, int]]) -> dict[tuple[int, int], Any]:
    """The records at (file index, row) `wanted` of prepare's source `files`, each file read up to
    the last row wanted from it."""
    out: dict[tuple[int, int], Any] = {}
    for f, path in enumerate(files):
        rows = {r for g, r in wanted if g == f}
        if not rows:
            continue
        last = max(rows)
        if not Path(path).is_file():
            raise InputError(f"eval.prompts heldout_turns reads the held-out conversations back from prepare's "
                             f"source files, and {path} is gone",
                             fix="put the file back where prepare read it, or set eval.prompts to heldout")
        for row, rec in iter_records(path):
            if row in rows and not isinstance(rec, RecordError):
                out[(f, row)] = rec
            if row >= last:
                break
    return out


def eval_items(cfg: Config, upstream: dict[str, Any]) -> tuple[list[EvalItem], SkippedPrompts, dict[str, Any]]:
    """The prompt set of an evaluation over the run whose stage folders are `upstream`: its items
    (eval.prompts, else the run's held-out samples), the eval.prompts records passed over, and
    `prompt_count` (asked, used, why fewer); a WARNING line names what was passed over."""
    ecfg = cfg.eval
    held: dict[str, int] = {}  # the held-out samples passed over, by why (heldout_selection)

    def split() -> tuple[PreparedData, np.ndarray]:
        data = PreparedData(upstream["prepare"])
        # Split the ids that training split (the extract store's, which may lack set-aside
        # samples), so that the held-out prompts are exactly the ones training never saw.
        return data, split_source(upstream) if "extract" in upstream else data.sample_ids

    def heldout() -> list[tuple[int, list[int]]]:
        data, split_ids_from = split()
        named, counts = heldout_selection(data, split_ids_from, cfg.train.eval_fraction, cfg.run.seed,
                                          ecfg.num_prompts)
        held.update(counts)
        if not named:  # before the target loads
            raise no_heldout_error(len(split_ids_from), counts["held_out"], cfg.train.eval_fraction, HELDOUT)
        return named

    def heldout_turns() -> list[tuple[int, list[Message]]]:
        data, split_ids_from = split()
        named, counts = heldout_conversations(data, split_ids_from, cfg.train.eval_fraction, cfg.run.seed,
                                              ecfg.num_prompts, cfg.prepare.format, cfg.prepare.multimodal)
        held.update(counts)
        if not named:
            raise no_heldout_error(len(split_ids_from), counts["held_out"], cfg.train.eval_fraction, HELDOUT_TURNS)
        return named

    items, skipped = named_items(ecfg.prompts, ecfg.num_prompts, heldout, cfg.prepare.format, cfg.prepare.multimodal,
                                 heldout_turns)
    count = prompt_count(ecfg.prompts, ecfg.num_prompts, len(items), skipped, held or None)
    if warning := skipped.warning():  # before the target loads
        log(f"[eval] WARNING: {warning}")
    return items, skipped, count


def prompt_renderer(cfg: Config) -> tuple[Any, Callable[[list[dict[str, str]]], list[int]]]:
    """The target's tokenizer and the rendering of a conversation into the prompt's token ids
    (the target's chat template, ending with its generation prompt)."""
    tokenizer = load_tokenizer(cfg.target)
    template = resolve_chat_template(tokenizer, cfg.target)
    render = lambda messages: generation_prompt(tokenizer, template, messages)
    return tokenizer, render


def load_eval_models(cfg: Config, upstream: dict[str, Any], dtype: str
                     ) -> tuple[nn.Module, list[int], nn.Module, dict[str, Any], str]:
    """The draft (eval.draft, else the run's trained one in `upstream`'s train/final/) and the target
    in `dtype` on eval.device: (draft, aux layer ids, target, the target's info, the folder the draft
    came from). The draft is read and checked (checksums, finite weights, eval.draft's loader
    format) before the target loads."""
    ecfg = cfg.eval
    if ecfg.draft:
        exported = read_eval_draft(ecfg.draft)
    else:
        source = str(upstream["train"] / FINAL_DIR)
        draft, aux_layers = load_final(upstream["train"] / FINAL_DIR)
    log(f"[eval] loading the target {cfg.target.path} ({dtype} on {resolve_device(ecfg.device)})")
    target, info = load_target(replace(cfg.target, device=ecfg.device, dtype=dtype))
    if ecfg.draft:
        draft, aux_layers, source = exported_draft(exported, target)
    return draft, list(aux_layers), target, info, source


def read_eval_draft(path: str, own: bool = False) -> Loaded:
    """eval.draft read (`load_draft`: checked against its checksums.json where eaglet wrote it,
    every weight finite) and holding what its engine's loader reads
    (eaglet/formats/loaders.py), so that eval measures the draft the engine would serve;
    raises CorruptDataError or InputError naming the file and what is wrong. `own`: the run's own
    export (an engine eval's draft without eval.draft), which must have its checksums.json."""
    loaded = load_draft(path, finite=True, own=own)
    meta = loaded[2]
    problems = PROBLEMS[meta["algorithm"]][meta["format"]](meta["folder"])
    if problems:
        what, fix = ((f"the run's export {meta['folder']}", "export it again: `eaglet export CONFIG --force`") if own
                     else (f"eval.draft {meta['folder']}", "export the draft again (`eaglet export CONFIG`), or name "
                                                          "another in eval.draft"))
        raise InputError(f"{what} would not load as {ENGINES[meta['algorithm']][meta['format']]} loads it: " + "; ".join(problems),
                         fix=fix)
    return loaded


def exported_draft(loaded: Loaded, target: nn.Module) -> tuple[nn.Module, list[int], str]:
    """An export folder's draft (`read_eval_draft`), with the target's (scaled) embedding where the
    export has none."""
    parts = TargetParts.of(target)
    fam = family_of(target.config)
    scale = fam.scales(target.config)[0] if fam is not None else 1.0
    draft, meta = draft_model(loaded, embed=parts.embed_tokens.weight.detach().float().cpu() * scale)
    aux = meta.get("aux_layer_ids") or default_layers(parts.num_layers)
    return draft, list(aux), meta["folder"]
