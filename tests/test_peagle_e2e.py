"""P-EAGLE through the pipeline on a tiny target: a run killed after a checkpoint resumes to the
uninterrupted run's losses and final weights, bit for bit; the export is read back to the trained
draft's logits (its type's reload_logits, mask slots included) and loads as vLLM's loader reads
it, with no SGLang export; the eval stage's greedy output equals the target's (the lossless check)
and its chain is replayed exactly.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import killed_copy, tiny_pipeline_upto_vocab, train_on_copy
from eaglet import pipeline
from eaglet.config import load_config
from eaglet.draft import peagle
from eaglet.formats.draft import FINAL_DIR, load_final
from eaglet.formats.loaders import PROBLEMS
from eaglet.formats.serving import load_draft_model

pytestmark = pytest.mark.usefixtures("one_thread")

OVERRIDES = ["run.seed=0", "train.algorithm=peagle", "peagle.layers=1", "peagle.depths=3", "peagle.down_sample_ratio=0.8",
             "extract.store_dtype=float32", "vocab.size=512", "train.max_tokens=256", "train.log_every=1",
             "train.eval_every=0", "train.ckpt_every=2", "train.keep_last=20", "train.max_steps=6",
             "train.warmup_steps=1", "train.lr=0.003", "train.tensorboard=false", "train.device=cpu",
             "train.compile=off", "export.dtype=float32", "export.speculative_tokens=3",
             "export.verifier_name_or_path=org/tiny", "eval.num_prompts=2", "eval.max_new_tokens=10",
             "eval.chain_tokens=3", "eval.reference_prompts=0", "eval.dtype=float32"]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """(tmp, overrides, the uninterrupted run: 6 steps, a checkpoint every 2)."""
    tmp = tmp_path_factory.mktemp("peagle_e2e")
    base = tiny_pipeline_upto_vocab(tmp, 16, 7, OVERRIDES)
    run, _ = train_on_copy(tmp, base, "clean")
    return tmp, base, run


def _train_log(run):
    recs = [json.loads(x) for x in (run / "train" / "log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k.startswith(("loss", "acc")) or k == "step"}
            for r in recs if r["split"] == "train"]


def test_a_killed_run_resumes_to_the_same_losses_and_weights(clean, tmp_path):
    tmp, base, ref = clean
    run = killed_copy(ref, tmp_path / "run", after=2)
    pipeline.run_stage(load_config(None, [f"run.dir={run}", *base]), "train", preflight=False)
    want = _train_log(ref)
    assert len(want) == 6 and {"loss_0", "loss_2"} <= set(want[0])  # one loss per depth
    assert _train_log(run) == want
    a, b = (load_file(str(r / "train" / FINAL_DIR / "model.safetensors")) for r in (run, ref))
    assert a.keys() == b.keys() and "mask_hidden" in a
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_export_reads_back_as_the_draft_and_eval_is_lossless(clean, capfd):
    tmp, base, ref = clean
    cfg = load_config(None, [f"run.dir={ref}", *base])
    stats = pipeline.run_stage(cfg, "export", preflight=False)["stats"]
    assert list(stats) == ["vllm"] and stats["vllm"]["reload_max_logit_error"] < 1e-4
    assert "parallel_drafting" in stats["vllm"]["serve_command"] and not (ref / "export" / "sglang").exists()
    folder = ref / "export" / "vllm"
    assert PROBLEMS["peagle"]["vllm"](folder) == []
    trained, _ = load_final(ref / "train" / FINAL_DIR)
    back, meta = load_draft_model(folder, embed=trained.embed_tokens.weight)
    assert meta["algorithm"] == "peagle"
    for a, b in zip(peagle.reload_logits(trained.eval()), peagle.reload_logits(back.eval()), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)

    ev = pipeline.run_stage(cfg, "eval", preflight=False)["stats"]
    assert ev["lossless"] is True and ev["lossless_mismatches"] == 0 and ev["num_prompts"] == 1
    assert ev["acceptance_rate"][0] > 0 and ev["tau"] > 1  # proposals accepted: the output is not the bonus tokens alone
    replayed = pipeline.run_stage(load_config(None, [f"run.dir={ref}", *base, "eval.replay=true"]), "eval",
                                  preflight=False)["stats"]
    err = capfd.readouterr().err
    assert replayed["tau"] == ev["tau"] and "decoding=the draft's replay" in err and "replay skipped" not in err
