"""bench/ab.py on a tiny target on the CPU: drafts of two variants trained on the shared prepared
data, each measured by replay on prompts after the training records, the target's side kept and
reused, the summary pairing each variant with base prompt by prompt. The replay's per-prompt tau
is held to real decoding of the same prompts with the same draft."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_script

pytestmark = pytest.mark.usefixtures("one_thread")
SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "ab.py"


def test_ab_trains_measures_by_replay_and_pairs_with_base(tmp_path):
    from eaglet.config import EvalSection, TargetSection
    from eaglet.formats.draft import FINAL_DIR, load_final
    from eaglet.stages.evaluate import evaluate_draft
    from eaglet.targets.chat import load_tokenizer
    from eaglet.targets.load import load_target
    from eaglet.testing import tiny

    target = tiny.save_target(tmp_path / "target", family="llama", template="llama3")
    data = tiny.write_jsonl(tmp_path / "data.jsonl", tiny.make_conversations(40, seed=3))
    work = tmp_path / "ab"
    args = ["--work", str(work), "--target", str(target), "--data", str(data), "--records", "30", "--prompts", "4",
            "--steps", "3", "--max-new-tokens", "10", "--k", "2", "--seeds", "0", "1",
            "--variant", "base", "--variant", "noise:train.state_noise=0.2",
            *(f"--set={s}" for s in ["target.dtype=float32", "prepare.num_workers=1", "vocab.size=128",
                                     "train.max_tokens=256", "train.ttt_steps=2", "train.device=cpu",
                                     "train.warmup_steps=1", "train.log_every=1", "train.eval_fraction=0.1"])]
    run_script(SCRIPT, args)
    out = json.loads((work / "ab.json").read_text())
    res, summary = out["results"], out["summary"]
    assert set(res) == {"base", "noise"} and all(set(r) == {"0", "1"} for r in res.values())
    for r in (x for v in res.values() for x in v.values()):
        assert len(r["per_prompt"]) == 4 and r["train"]["steps"] == 3
    assert {p.name for p in (work / "runs" / "noise-s1").iterdir()} >= {"prepare", "extract", "vocab", "train"}
    assert (work / "runs" / "noise-s1" / "prepare").is_symlink()
    noise = summary["noise"]
    want = sum(res["noise"][s]["tau"] - res["base"][s]["tau"] for s in ("0", "1")) / 2
    assert noise["diff"] == pytest.approx(want) and noise["se"] >= 0 and noise["paired_seeds"] == [0, 1]
    assert summary["base"]["seed_sd"] is not None and "diff" not in summary["base"]

    # the replay's per-prompt tau is what decoding the same prompts gives
    side = json.loads((work / "side" / "side.json").read_text())
    draft, aux = load_final(work / "runs" / "base-s1" / "train" / FINAL_DIR)
    model, _ = load_target(TargetSection(path=str(target), dtype="float32"))
    tok = load_tokenizer(TargetSection(path=str(target)))
    dec = evaluate_draft(model, tok, draft, aux, side["prompts"], EvalSection(method="chain", chain_tokens=2,
                         max_new_tokens=10, baseline=False, lossless_check=False), verbose=False)
    assert [p["tau"] for p in dec["prompts"]] == pytest.approx(res["base"]["1"]["per_prompt"])

    # a second call measures nothing again and reuses the target's side
    before = (work / "side" / "aux.safetensors").stat().st_mtime_ns
    run_script(SCRIPT, args)
    assert (work / "side" / "aux.safetensors").stat().st_mtime_ns == before
    assert "| noise | 2 |" in (work / "ab.md").read_text()
