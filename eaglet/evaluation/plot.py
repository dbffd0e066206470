"""eval.png: the trained draft beside the untrained one of its shape (and vLLM's figures when
there): acceptance per draft position, tau per prompt or category, and tau by context length
(`eval_figure`), in the colours below. Change here what the figure shows."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from .context_length import CONTEXT_BUCKETS
from .results import number_text


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
    each draft's overall tau. Third: tau by context length (the buckets of context_length.py the
    turns fill; under each, the trained draft's turns and cycles in it; vLLM's counters have no
    per-turn figure). The title gives both taus; the line under it the speedup, what it is, and
    the lossless verdict."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    agg, recs, st = result["aggregate"], result["prompts"], result["settings"]
    ref = result.get("reference")
    fig = Figure(figsize=(17, 5.4), dpi=110)
    FigureCanvasAgg(fig)
    ax1, ax2, ax3 = fig.subplots(1, 3, width_ratios=(1.0, 1.3, 0.8))
    nan = float("nan")
    num = lambda xs: [nan if x is None else float(x) for x in xs]
    series = [("trained draft", TRAINED)] + ([("untrained draft", UNTRAINED)] if ref else []) + (
        [("vLLM, trained draft", VLLM)] if vllm else [])

    def grouped(ax: Any, xs: np.ndarray, columns: list[list[float]], labels: bool, top: float, base: float = 0.0,
                missing: str | list[str] = "") -> None:
        """Side-by-side bars, one column of values per series (NaN: no bar, labelled `missing`, or
        the column's own label when a list), labelled with their values."""
        width = 0.8 / len(columns)
        for j, (values, (_, colour)) in enumerate(zip(columns, series)):
            absent = missing[j] if isinstance(missing, list) else missing
            x = xs + (j - (len(columns) - 1) / 2) * width
            # an edge in the bar's colour: a bar of height 0 still shows, as a line on the axis
            ax.bar(x, [0 if np.isnan(v) else v - base for v in values], width, bottom=base, color=colour,
                   edgecolor=[colour if not np.isnan(v) else "none" for v in values], linewidth=1.5)
            if not labels:
                continue
            for xi, v in zip(x, values):
                if np.isnan(v):
                    if absent:
                        ax.text(xi, base + 0.01 * (top - base), absent, ha="center", va="bottom", fontsize=6,
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

    # third: tau by context length
    lengths = agg.get("by_context_length") or {}
    ref_lengths = (ref or {}).get("by_context_length") or {}
    buckets = [b for b in CONTEXT_BUCKETS if b in lengths or b in ref_lengths]
    xs = np.arange(1, len(buckets) + 1)
    columns = [num([(lengths.get(b) or {}).get("tau") for b in buckets])]
    if ref:
        columns.append(num([(ref_lengths.get(b) or {}).get("tau") for b in buckets]))
    if vllm:
        columns.append([nan] * len(buckets))  # vLLM's counters give no per-turn figure
    values = [v for c in columns for v in c if not np.isnan(v)]
    top = min(float(ceiling), max(values + [1.0]) * 1.2 + 0.1)
    grouped(ax3, xs, columns, True, top, missing=[""] * (len(columns) - 1) + ["no per-turn counts"] if vllm else "")
    ax3.axhline(1, color="0.3", linewidth=0.8, linestyle=":")
    counted = [lengths.get(b) or {"turns": 0, "cycles": 0} for b in buckets]
    ax3.set_xticks(xs, [f"{b}\n{c['turns']} turn{'s' if c['turns'] != 1 else ''}, {c['cycles']} cycles"
                        for b, c in zip(buckets, counted)], fontsize=8)
    ax3.set_xlim(0.4, len(buckets) + 0.6)
    ax3.set_ylim(0, top)
    ax3.set_xlabel("prompt tokens, earlier turns included\n(under each: the trained draft's turns, cycles)", fontsize=9)
    ax3.set_title("tau by context length")

    drafting = f"chain of {st['chain_tokens']}" if st["method"] == "chain" else \
        f"tree {st['tree_top_k']}x{st['tree_depth']}, {st['tree_total_tokens']} tokens"
    temp = "greedy" if st["temperature"] <= 0 else f"T={st['temperature']:g}"
    title = (f"{result.get('prompt_set', 'heldout')} prompts, {drafting}, {temp}: "
             f"trained draft tau {number_text(agg['tau'])}")
    if ref:
        title += f", untrained draft {number_text(ref.get('tau'))}"
        if ref["num_prompts"] != agg["num_prompts"]:
            title += f" (on its {ref['num_prompts']} prompts: trained {number_text(ref.get('trained_tau'))})"
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
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.23, top=0.86 - 0.04 * len(notes), wspace=0.2)
    return fig
