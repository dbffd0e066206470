"""The `eval` stage: speculative decoding of held-out prompts with the trained draft.

    eaglet eval CONFIG            # or as the last stage of `eaglet run`

Prompts: the training run's held-out samples (`training.data.split_ids` with train.eval_fraction and
run.seed, over the same sample ids training split), the first `eval.num_prompts` of them,
each cut where its first assistant turn starts (the first loss-masked token), so a prompt
ends with the chat template's generation prompt; eval.prompts picks another set (their later
turns, MT-bench, a file: eaglet/formats/eval_sets.py).

For each prompt the target decodes speculatively with the draft (eaglet.engines.hf.decode: a chain or
the EAGLE-2 tree, greedy or sampled) and, for the baseline, plainly with the same KV cache.
Reported per prompt and overall: tau (tokens per target verification forward), acceptance
rate per draft position (overall also by the prompt's context length: eaglet/evaluation/
context_length.py), tokens/s of both decoders and the speedup, and at T=0 the lossless
check (the speculative output must equal the target's own greedy output token for token).

Outputs in the stage folder: `eval.json` (settings, per prompt, aggregate, the untrained
reference's tau per prompt, and `prompt_count`: the prompts eval.num_prompts asked for, the ones
the set gave and why fewer) and `eval.png` (the trained draft beside the untrained one:
acceptance per draft position, tau per prompt or category, tau by context length).

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

The machinery lives in eaglet/evaluation/ (inputs, decoding, replaying, inprocess, results,
plot); the in-process decoders are the HF engine's (eaglet/engines/hf/decode.py, replay.py). An
engine that serves an export format also measures the exported draft where it will run, after
the in-process eval: the registry's `eval_engine` says which (eval.vllm: eaglet/engines/vllm/
eval.py; its result `<setting>-<engine>.json`). This module holds the stage: `run_eval`, its
inputs, the served draft, the files it writes and the lossless verdict.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch

from ..config import Config
from ..context import StageContext
from ..engines import eval_engine
from ..errors import InputError, VerificationError
from ..evaluation.inprocess import in_process
from ..evaluation.inputs import (EvalInputs, eval_items, load_eval_models, prompt_renderer, read_eval_draft,
                                 resolve_eval_dtype)
from ..evaluation.plot import plot_eval
from ..evaluation.results import setting_key
from ..utils import atomic_write_bytes, atomic_write_json, log

EVAL_JSON = "eval.json"
EVAL_PNG = "eval.png"


class LosslessError(VerificationError):
    """Greedy speculative decoding produced a token the target's own greedy decoding did not."""


def eval_inputs(cfg: Config, upstream: dict[str, Any], load_models: bool = True, served: Any = None) -> EvalInputs:
    """The prompt set, draft, target and tokenizer of an evaluation over the run whose stage
    folders are `upstream` (the draft: eval.draft, else the run's trained one). Without
    `load_models` the target and the draft stay unloaded (None): the eval in the engine `served`
    (eaglet/engines/base.py `Engine`: `eval_engine`) alone."""
    items, skipped, count = eval_items(cfg, upstream)
    dtype = resolve_eval_dtype(cfg.eval)
    tokenizer, render = prompt_renderer(cfg)
    if not load_models:  # the engine reads the draft's folder (eval.draft, else the run's export): checked here first
        return EvalInputs(items, None, [], None, tokenizer, {"device": served.NAME}, dtype, render,
                          served_draft(cfg, upstream, served), skipped, count)
    draft, aux_layers, target, info, source = load_eval_models(cfg, upstream, dtype)
    return EvalInputs(items, draft, list(aux_layers), target, tokenizer, info, dtype, render, source, skipped, count)


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
        result, stats = in_process(cfg, ctx, inp, key)
        _write_result(ctx.out_dir, key, result)
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
