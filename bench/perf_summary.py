"""Tables of bench/perf.sh's results: `python bench/perf_summary.py OUTDIR WORKDIR`.

Reads WORKDIR's per-part JSON (NAME.json from train_throughput.py / extract_throughput.py,
NAME.status.json from perf.sh) and writes OUTDIR/train.json, extract.json, profile.txt and
summary.md (also printed). Part names are perf.sh's.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

# (eaglet part, speculators part, shape, goal)
TRAIN_ROWS = [
    ("e8", "s8", "Llama-3.1-8B draft dims, 1 x 2048", ">= 33k tokens/s"),
    ("e8p", "s8p", "Llama-3.1-8B draft dims, 4 x 2048 packed", ">= 33k tokens/s"),
    ("ek", "sk", "Kimi-K2.5 draft dims, 1 x 4096", ">= 1.2x speculators, less memory"),
    ("e8p0", None, "8B packed, train.compile off", "(what compile buys)"),
    ("em8", "s8", "8B, 1 x 2048, train.mask_out_of_vocab false (teacher over the draft columns, as speculators)", ">= 33k tokens/s"),
    ("e8pm", "s8p", "8B packed, train.mask_out_of_vocab false", ">= 33k tokens/s"),
    ("ekm", "sk", "Kimi-K2.5 dims, train.mask_out_of_vocab false", ">= 1.2x speculators, less memory"),
    ("e8pc", "s8p", "8B packed, each product casting its weight (before the unroll's once-cast)", "(what the once-cast buys)"),
    ("e8s", "s8", "8B, 1 x 2048, weight gradients summed by autograd, separate clip pass (before the GEMMs "
     "accumulated them and AdamW clipped)", "(what those buy)"),
    ("e8c", "s8", "8B, 1 x 2048, the mask's verdicts known (a run's second epoch on)", ">= 33k tokens/s"),
    ("ekc", "sk", "Kimi-K2.5 dims, the mask's verdicts known (a run's second epoch on)", ">= 1.2x speculators, less memory"),
]
OPTIONAL = {"em8", "e8pm", "ekm", "e8pc", "e8s", "e8c", "ekc"}  # rows shown only when their eaglet part ran
ANCHORS = {"s8": "18.2k", "s8p": "28.1k", "sk": "12.8k (64 heads x 112)"}


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _cell(r: dict[str, Any] | None, status: dict[str, Any] | None) -> str:
    if r is None:
        if status is None:
            return "not run"
        if "skipped" in status:
            return f"skipped ({status['skipped']})"
        return f"failed (rc {status.get('rc')}{', time limit' if status.get('rc') in (124, 137) else ''})"
    mem = f", {r['peak_mem_gib']:.1f} GiB" if r.get("peak_mem_gib") is not None else ""
    return f"**{r['tokens_per_s'] / 1000:.1f}k** tok/s, {r['step_ms']:.0f} ms, MFU {r['mfu']:.0%}{mem}"


def _breakdown(name: str, r: dict[str, Any]) -> str:
    ms = r.get("breakdown_ms") or {}
    if not ms:
        return ""
    fwd = [v for k, v in ms.items() if k.endswith("_forward")]
    loss = [v for k, v in ms.items() if k.endswith("_loss")]
    return (f"- {name} ({r['step_ms']:.0f} ms/step): teacher {ms.get('teacher', 0):.1f}, TTT forward {sum(fwd):.1f} "
            f"({' / '.join(f'{v:.1f}' for v in fwd)}), loss {sum(loss):.1f}, backward {ms.get('backward', 0):.1f}, "
            f"optimizer {ms.get('optimizer', 0):.1f} ms")


def _shares(res: dict[str, Any], key: str, only: str | None = None) -> str | None:
    """The distinct values of `key` across the runs (of those with `only` set), as '95% / 21%'."""
    shares = sorted({round(v[key], 2) for v in res.values()
                     if isinstance(v, dict) and v.get(key) is not None and (only is None or v.get(only))})
    return " / ".join(f"{x:.0%}" for x in shares) if shares else None


def _data_notes(res: dict[str, Any]) -> str:
    """What the synthetic batches keep and train on, as the runs report it."""
    notes = ""
    kept = _shares(res, "in_vocab_rows", only="mask_out_of_vocab")
    if kept:
        notes += (f" eaglet's synthetic rows: {kept} with a teacher argmax in the draft vocabulary (kept by the "
                  "out-of-vocabulary mask), as on real data; speculators counts every row.")
    trained = _shares(res, "loss_share")
    if trained:
        notes += (f" Both systems' batches are trained on {trained} of their tokens (loss mask; the share measured "
                  "on the default ShareGPT data, eaglet.testing.synthetic LOSS_SHARE); eaglet's LM head runs over the "
                  "rows each step's loss can count, speculators' over every row.")
    return notes


def main(out_dir: str, work_dir: str) -> str:
    out, work = Path(out_dir), Path(work_dir)
    res = {p.stem: _load(p) for p in sorted(work.glob("*.json")) if not p.name.endswith(".status.json")}
    status = {p.name[: -len(".status.json")]: _load(p) for p in sorted(work.glob("*.status.json"))}
    train = [{"part": k, **v} for k, v in res.items() if isinstance(v, dict) and "tokens_per_s" in v]
    (out / "train.json").write_text(json.dumps(train, indent=1) + "\n")
    ext = res.get("ext")
    if ext is not None:
        (out / "extract.json").write_text(json.dumps(ext, indent=1) + "\n")
    prof = [(k, v["profile"]) for k, v in res.items() if isinstance(v, dict) and v.get("profile")]
    if prof:
        (out / "profile.txt").write_text("".join(
            f"== {k}: top kernels by device time, {p['total_ms_per_step']:.1f} ms per step in all\n{p['table']}\n"
            for k, p in prof))

    any_r = next((v for v in res.values() if isinstance(v, dict) and "device_name" in v), {})
    where = any_r.get("device_name") or any_r.get("device", "?")
    lines = ["# eaglet performance benchmarks (issue 7)", "",
             f"{where}, torch {any_r.get('torch', '?')}, {time.strftime('%Y-%m-%d %H:%M')}. "
             "Training: synthetic inputs of the real shapes, k = 7, bf16 autocast over fp32 weights; MFU from the "
             "anchor script's `train_flops_per_token` at 790 TFLOP/s; peak = max memory allocated. speculators 0.9.0: "
             "the anchor's step (eager loss) at the same shapes, in the same run."
             + _data_notes(res), "",
             "| shape | eaglet | speculators 0.9.0 (this run) | eaglet / speculators | goal | speculators, anchor README |",
             "|---|---|---|---|---|---|"]
    for e, s, shape, goal in TRAIN_ROWS:
        if e not in res and e not in status and (s is None or e in OPTIONAL or (s not in res and s not in status)):
            continue
        re_, rs = res.get(e), res.get(s) if s else None
        ratio = ""
        if re_ and rs:
            ratio = f"{re_['tokens_per_s'] / rs['tokens_per_s']:.2f}x"
            if re_.get("peak_mem_gib") and rs.get("peak_mem_gib"):
                ratio += f", memory {re_['peak_mem_gib'] / rs['peak_mem_gib']:.2f}x"
        spec = _cell(rs, status.get(s)) if s else "-"
        lines.append(f"| {shape} | {_cell(re_, status.get(e))} | {spec} | {ratio} | {goal} | {ANCHORS.get(s or '', '')} |")
    notes = [_breakdown(k, v) for k, v in res.items() if isinstance(v, dict) and v.get("system") == "eaglet"]
    notes = [n for n in notes if n]
    if notes:
        lines += ["", "eaglet step, per phase (CUDA events, mean over the timed steps):", *notes]
    checks = [(k, v["check"]) for k, v in res.items() if isinstance(v, dict) and v.get("check")]
    for k, c in checks:
        lines.append(f"- {k}: compiled vs eager losses, max relative difference {c['max_rel_diff']:.1e}")
    if ext is not None:
        lines += ["", f"## Extraction: {ext['preset']}-shaped Llama ({ext['layers']} layers, random weights), "
                      f"{ext['batches']} batches of {ext['batch_size']} x {ext['seq']} tokens, store "
                      f"{ext['store_bytes_per_token'] / 1024:.0f} KB/token, fsync {ext['fsync']}", "",
                  "| | tokens/s | vs forward | goal | anchor README |", "|---|---|---|---|---|"]
        if "forward" in ext:
            lines.append(f"| plain forward (base model) | {ext['forward']['tokens_per_s'] / 1000:.1f}k | 1.00 | | "
                         "~35k (8B, 32 layers, CausalLM) |")
        if "extract" in ext:
            x = ext["extract"]
            lines.append(f"| eaglet extract (capture, copy, checksummed write) | {x['tokens_per_s'] / 1000:.1f}k | "
                         f"{x.get('vs_forward', float('nan')):.2f} | >= 0.90 | |")
        if "write" in ext:
            w = ext["write"]
            lines.append(f"| store write alone ({ext['writer_threads']} threads) | {w['tokens_per_s_worth'] / 1000:.1f}k "
                         f"worth ({w['gb_per_s']:.2f} GB/s) | | | ~38k worth (1.26 GB/s) |")
    elif "ext" in status:
        lines += ["", f"Extraction: {_cell(None, status['ext'])}"]
    lines += ["", "Parts: " + ", ".join(f"{k} " + (f"rc {v.get('rc')} in {v.get('seconds')} s" if "rc" in v
                                                   else v.get("skipped", "?")) for k, v in status.items() if v)]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
