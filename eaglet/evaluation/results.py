"""An evaluation's results: the name of a setting's result file (`setting_key`), the summary line
of a finished evaluation, and the trained draft's tau against the untrained reference's on the
same prompts (`against_untrained`). Change here how results are named, summed up or compared."""

from __future__ import annotations

from typing import Any

from ..config import EvalSection
from ..engines.hf.decode import acceptance_stats
from ..formats.eval_sets import set_name
from .context_length import context_length_text


def number_text(x: float | None, digits: int = 2) -> str:
    """`x` with `digits` decimals, or "-" when there is none (a figure not measured)."""
    return "-" if x is None else f"{x:.{digits}f}"


def summary_line(agg: dict[str, Any]) -> str:
    """One line for a finished evaluation: tau, the speeds, the lossless verdict and tau by context
    length (the buckets the prompts fill)."""
    line = (f"[eval] {agg['num_prompts']} prompt(s), {agg['new_tokens']} new tokens: tau {number_text(agg['tau'])} "
            f"(ceiling {agg['tau_ceiling']})")
    if agg.get("tokens_per_s"):
        line += f"; speculative {number_text(agg['tokens_per_s'], 1)} tok/s"
        if agg.get("baseline_tokens_per_s"):
            line += f", plain {number_text(agg['baseline_tokens_per_s'], 1)} tok/s ({number_text(agg.get('speedup'))}x)"
    if "lossless" in agg:
        bad = len(agg["mismatches"])
        line += (f"; lossless on all {agg['num_prompts']}" if not bad else
                 f"; NOT lossless: {bad} of {agg['num_prompts']} differ from the target's own output")
    if agg.get("by_context_length"):
        line += f"; tau by context length (prompt tokens): {context_length_text(agg['by_context_length'])}"
    return line


def setting_key(ecfg: EvalSection, engine: str = "eaglet") -> str:
    """The name of one setting's result file: prompt set, drafting, temperature, engine."""
    draft = f"chain{ecfg.chain_tokens}" if ecfg.method == "chain" else \
        f"tree{ecfg.tree_top_k}x{ecfg.tree_depth}-{ecfg.tree_total_tokens}"
    temp = "greedy" if ecfg.temperature <= 0 else f"t{ecfg.temperature:g}"
    how = "-replay" if ecfg.replay and engine == "eaglet" else ""
    return f"{set_name(ecfg.prompts)}-{draft}-{temp}{how}" + ("" if engine == "eaglet" else f"-{engine}")


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
