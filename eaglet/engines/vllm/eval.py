"""The vLLM eval: the exported draft measured where it will run, against eaglet's own measurement.

    eaglet eval CONFIG --set eval.vllm=on      # 'auto' (the default): when vLLM and a GPU are present

After the in-process eval, the same prompts (eaglet/formats/eval_sets.py: the same set, each
later turn asked after the engine's own answer) are decoded by vLLM, greedy, with the export
(`<run>/export/vllm`, or eval.draft) as its draft (served by its draft type's SERVING_METHOD, with
the type's VLLM_SPECULATIVE keys: P-EAGLE's parallel_drafting) and k = eval.chain_tokens:

1. acceptance: one pass per category (MT-bench) at the largest batch size, and one pass at
   batch 1, read from vLLM's own counters (eaglet/engines/vllm/decode.py);
2. speed: output tokens/s with the draft and without it (a second engine on the target alone),
   at each of eval.vllm_batch_sizes (1 and 16);
3. greedy identity: the outputs with and without the draft at the same batch size, and, as the
   control, the outputs without the draft at batch 1 and at the largest batch. bf16 kernels
   round differently with the batch shape, so the control says whether a difference is
   numerics (the control differs as often) or the speculative path;
4. agreement: vLLM's mean acceptance length at batch 1 against eaglet's tau; a relative
   difference over eval.vllm_tolerance fails the stage (after the result is written) with the
   figures per draft position and the likely cause.

The result goes to `<eval>/<setting>-vllm.json` next to the in-process one. It has no tau by
context length (`by_context_length` None, with the note why): vLLM counts acceptance per pass,
not per turn. A bar counts the
prompts decoded over all these passes, naming the pass in its postfix.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .checks import VLLM_EVAL_FIX, vllm_eval_blockers
from ...config import Config, EvalSection
from ...distributed import dist_env
from ...utils import first_difference
from .capture import installed_vllm_version
from .decode import SpecCounts, VllmDecoder
from ...errors import InputError, VerificationError
from ...utils import log
from ...context import StageContext
from ...formats.eval_sets import run_rounds
from ...formats.serving import export_type

MAX_DIVERGENCES = 10  # first divergences listed per comparison
NO_TURN_COUNTS = ("vLLM's counters sum a whole pass over many prompts: no turn's own accepted counts, so no tau "
                  "by context length here (the in-process result has it)")


class EngineAgreementError(VerificationError):
    """vLLM's acceptance with the exported draft differs from eaglet's by more than the tolerance."""


def want_vllm(ecfg: EvalSection) -> bool:
    """Whether the eval stage runs the vLLM eval: eval.vllm 'on' (an error when it cannot run),
    'auto' (when vLLM is installed, a GPU is present and the drafting is a greedy chain)."""
    if ecfg.vllm == "off":
        return False
    blockers = vllm_eval_blockers(ecfg)
    if ecfg.vllm == "on" and blockers:
        raise InputError("eval.vllm is on, but " + "; ".join(blockers), fix=VLLM_EVAL_FIX)
    return not blockers


def run_vllm_eval(cfg: Config, ctx: StageContext, inp: Any, eaglet_result: dict[str, Any] | None) -> dict[str, Any]:
    """The vLLM eval of `inp` (evaluate.EvalInputs; its target already freed) against the
    in-process `eaglet_result` (None: not run, no agreement check). Returns the JSON-able result."""
    ecfg = cfg.eval
    folder = ecfg.draft or str(ctx.upstream["export"] / "vllm")
    k, n_new = ecfg.chain_tokens, ecfg.max_new_tokens
    sizes = sorted(set(ecfg.vllm_batch_sizes))
    big = sizes[-1]
    firsts = [list(it.tokens) if it.tokens is not None else inp.render(it.messages([], 0)) for it in inp.items]
    turns = max(it.turns for it in inp.items)
    # a later turn adds the answer (<= n_new) and the next question (taken as <= 1024 tokens)
    engine = {"target": cfg.target.path, "max_model_len": max(map(len, firsts)) + turns * n_new + (turns - 1) * 1024 + k + 8,
              "dtype": inp.dtype if inp.dtype != "float32" else "auto", "tokenizer": cfg.target.tokenizer,
              "trust_remote_code": cfg.target.trust_remote_code, "revision": cfg.target.revision,
              "engine_args": dict(ecfg.vllm_engine_args)}
    tokenizer = inp.tokenizer
    text = lambda t: tokenizer.decode(t, skip_special_tokens=True)
    n_prompts = sum(it.turns for it in inp.items)

    dec = draft_decoder(folder, k, engine)
    dec.generate([inp.render([{"role": "user", "content": "Hello"}])], 8, 1)  # warm-up, not counted
    by_cat: dict[str, SpecCounts] = {}
    # every prompt is decoded once for the acceptance, then with and without the draft at each batch size
    bar = tqdm(total=n_prompts * (1 + 2 * len(sizes)), desc="eval, vLLM", unit="prompt", dynamic_ncols=True,
               disable=not dist_env().is_main)

    def generate(d: VllmDecoder, prompts: list[list[int]], batch: int, what: str):
        bar.set_postfix_str(what, refresh=True)
        out = d.generate(prompts, n_new, batch)
        bar.update(len(prompts))
        return out

    def decode(prompts: list[list[int]], items: list[Any]) -> list[tuple[list[int], dict[str, Any]]]:
        out: list[list[int] | None] = [None] * len(prompts)
        groups: dict[str, list[int]] = {}
        for i, it in enumerate(items):
            groups.setdefault(it.category or "all", []).append(i)
        for cat, idx in groups.items():
            toks, _, counts = generate(dec, [prompts[i] for i in idx], big, f"acceptance, {cat}, batch {big}")
            by_cat[cat] = by_cat.get(cat, SpecCounts()) + counts
            for i, t in zip(idx, toks):
                out[i] = t
        return [(t or [], {}) for t in out]

    try:
        records = run_rounds(inp.items, inp.render, text, decode)
        prompts = [r["prompt_token_ids"] for r in records]
        runs: dict[str, tuple[list[list[int]], float, SpecCounts]] = {}
        for b in sizes:
            runs[f"draft_b{b}"] = generate(dec, prompts, b, f"with the draft, batch {b}")
        dec.close()
        bar.set_postfix_str("starting an engine without the draft", refresh=True)
        plain = VllmDecoder(**engine)
        plain.generate([prompts[0]], 8, 1)
        for b in sizes:
            runs[f"plain_b{b}"] = generate(plain, prompts, b, f"without the draft, batch {b}")
        plain.close()
    finally:
        bar.close()

    speed = {}
    for b in sizes:
        d, p = runs[f"draft_b{b}"], runs[f"plain_b{b}"]
        dt, pt = _tokens_per_s(d), _tokens_per_s(p)
        speed[f"batch_{b}"] = {"draft_tokens_per_s": dt, "plain_tokens_per_s": pt, "speedup": dt / pt if pt else None,
                               "draft_seconds": round(d[1], 4), "plain_seconds": round(p[1], 4)}
    identity = {f"draft_vs_plain_b{b}": identity_report(runs[f"draft_b{b}"][0], runs[f"plain_b{b}"][0], records)
                for b in sizes}
    if len(sizes) > 1:
        identity[f"plain_b{sizes[0]}_vs_plain_b{big}"] = identity_report(runs[f"plain_b{sizes[0]}"][0],
                                                                          runs[f"plain_b{big}"][0], records)
    acc = runs[f"draft_b{sizes[0]}"][2].summary()
    result = {
        "engine": "vllm", "vllm_version": installed_vllm_version(), "draft": folder, "k": k,
        "max_new_tokens": n_new, "dtype": engine["dtype"], "num_prompts": len(records),
        "skipped_prompts": inp.skipped.to_json(), "prompt_count": inp.prompt_count,
        "acceptance": acc, "acceptance_batch": sizes[0],
        "acceptance_by_batch": {f"batch_{b}": runs[f"draft_b{b}"][2].summary() for b in sizes},
        "speed": speed, "greedy_identity": identity,
        "by_context_length": None, "by_context_length_note": NO_TURN_COUNTS,
        "agreement": None if eaglet_result is None else agreement(
            eaglet_result["aggregate"], acc, ecfg.vllm_tolerance, eaglet_dtype=eaglet_result["settings"]["dtype"],
            vllm_dtype=engine["dtype"]),
        "prompts": [{"item": r["item"], "category": r["category"], "turn": r["turn"],
                     "new_tokens": len(runs[f"draft_b{sizes[0]}"][0][i]),
                     "text": text(runs[f"draft_b{sizes[0]}"][0][i])} for i, r in enumerate(records)],
    }
    if len(by_cat) > 1 or "all" not in by_cat:
        result["by_category"] = {c: v.summary() for c, v in by_cat.items()}
        if eaglet_result is not None and "by_category" in eaglet_result:
            result["agreement_by_category"] = {
                c: {"eaglet_tau": eaglet_result["by_category"].get(c, {}).get("tau"),
                    "vllm_mean_acceptance_length": v["mean_acceptance_length"]}
                for c, v in result["by_category"].items()}
    return result


def draft_decoder(folder: str, k: int, engine: dict[str, Any]) -> VllmDecoder:
    """vLLM on the target with the export `folder` as its draft, k tokens per cycle, served as its
    draft type says: its SERVING_METHOD and its VLLM_SPECULATIVE keys (P-EAGLE: parallel_drafting)."""
    kind = export_type(folder)
    method, speculative = kind.SERVING_METHOD, dict(getattr(kind, "VLLM_SPECULATIVE", {}))
    log(f"[eval] vLLM: starting an engine with the draft {folder} ({method}"
        + "".join(f", {key}={value}" for key, value in speculative.items()) + f", k={k})")
    return VllmDecoder(draft=folder, method=method, k=k, speculative=speculative, **engine)


def _tokens_per_s(run: tuple[list[list[int]], float, SpecCounts]) -> float | None:
    tokens, seconds, _ = run
    return sum(len(t) for t in tokens) / seconds if seconds > 0 else None


def identity_report(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]], records: Sequence[dict[str, Any]]
                    ) -> dict[str, Any]:
    """How many outputs are equal token for token, and where the first ones part."""
    diffs = [(i, first_difference(list(x), list(y))) for i, (x, y) in enumerate(zip(a, b))]
    parted = [(i, d) for i, d in diffs if d is not None]
    return {"identical": len(diffs) - len(parted), "of": len(diffs),
            "first_divergences": [{"item": records[i]["item"], "turn": records[i]["turn"], "token": d}
                                  for i, d in parted[:MAX_DIVERGENCES]]}


def agreement(eaglet_agg: dict[str, Any], vllm_acc: dict[str, Any], tolerance: float, *,
              eaglet_dtype: str, vllm_dtype: str) -> dict[str, Any]:
    """eaglet's tau against vLLM's mean acceptance length: the relative difference, whether it is
    within `tolerance`, and when not, the likely cause read from the per-position rates."""
    e, v = eaglet_agg.get("tau"), vllm_acc.get("mean_acceptance_length")
    out: dict[str, Any] = {"eaglet_tau": e, "vllm_mean_acceptance_length": v, "tolerance": tolerance,
                           "eaglet_acceptance_rate": eaglet_agg.get("acceptance_rate"),
                           "vllm_acceptance_rate": vllm_acc.get("acceptance_rate"),
                           "eaglet_dtype": eaglet_dtype, "vllm_dtype": vllm_dtype}
    if e is None or v is None:
        out.update(relative_difference=None, ok=False,
                   cause="vLLM counted no drafts: the draft did not run (check the engine's log for the "
                         "speculative config it took)" if v is None else "eaglet measured no verification")
        return out
    rel = (v - e) / e
    out.update(relative_difference=rel, ok=abs(rel) <= tolerance)
    if not out["ok"]:
        out["cause"] = likely_cause(out["eaglet_acceptance_rate"] or [], out["vllm_acceptance_rate"] or [], tolerance)
    return out


def likely_cause(eaglet_rates: Sequence[float | None], vllm_rates: Sequence[float | None], tolerance: float) -> str:
    """Which draft position the two engines first part at, and what that points to."""
    for i, (a, b) in enumerate(zip(eaglet_rates, vllm_rates)):
        if a is None or b is None:
            continue
        if abs(a - b) > max(tolerance, 0.05):
            if i == 0:
                return (f"the first draft position already differs ({a:.3f} in eaglet, {b:.3f} in vLLM): vLLM's draft "
                        "does not see what eaglet's does - aux layer ids, the vocabulary maps (d2t), the embedding, "
                        "a norm or the dtype as vLLM loads the export")
            return (f"the positions agree up to {i}, then part at position {i + 1} ({a:.3f} in eaglet, {b:.3f} in "
                    "vLLM): the draft's later steps differ - how each engine feeds the draft its own state and "
                    "token for the next step, or its KV cache for drafted tokens")
    return "every draft position agrees within the tolerance: the tau gap comes from how often the positions " \
           "are reached (different continuations after a bf16 divergence, or cycles cut by max_new_tokens)"


def check_agreement(result: dict[str, Any], path: Path) -> None:
    """Raise EngineAgreementError when the vLLM eval's agreement check failed."""
    a = result["agreement"]
    if a["ok"]:
        return
    rel = "-" if a["relative_difference"] is None else f"{a['relative_difference']:+.1%}"
    raise EngineAgreementError(
        f"vLLM's mean acceptance length {_f(a['vllm_mean_acceptance_length'])} and eaglet's tau {_f(a['eaglet_tau'])} "
        f"differ by {rel} (tolerance {a['tolerance']:.0%}); {a['cause']}; see {path}")


def vllm_stats(result: dict[str, Any]) -> dict[str, Any]:
    """The vLLM eval's figures for the stage manifest."""
    a = result["agreement"] or {}
    return {"mean_acceptance_length": result["acceptance"]["mean_acceptance_length"], "eaglet_tau": a.get("eaglet_tau"),
            "relative_difference": a.get("relative_difference"), "agreement_ok": a.get("ok"),
            "acceptance_rate": result["acceptance"]["acceptance_rate"],
            "speedup": {b: s["speedup"] for b, s in result["speed"].items()},
            "identical": {c: f"{r['identical']}/{r['of']}" for c, r in result["greedy_identity"].items()},
            "tau_by_category": {c: s["mean_acceptance_length"] for c, s in result.get("by_category", {}).items()}}


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
