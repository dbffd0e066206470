"""DFlash through eaglet's stages and its decoder, against the references a user relies on.

- Decoding: a DFlash draft fitted until it agrees with a tiny target part of the time, driven by
  the generic decoder (eaglet/engines/hf/decode.py `speculative_generate`) through its
  proposer, reproduces the target's greedy output (lossless), and replay (the same cycles
  walked over the target's continuation, eaglet/engines/hf/replay.py) gives the decoder's
  accepted counts and tokens, prompt by prompt.
- Training: a run killed after its checkpoint of step 4 resumes to the uninterrupted run's
  losses and final weights, as EAGLE-3's runs do (tests/test_resume.py).
- The pipeline: prepare, extract, vocab, train, export and eval with train.algorithm dflash; the
  store holds the DFlash layers, the export is speculators' dflash format that vLLM's loader
  takes (eaglet/formats/loaders.py), and eval's lossless check passes.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import killed_copy, tiny_pipeline_upto_vocab, train_on_copy
from eaglet import pipeline
from eaglet.config import load_config
from eaglet.draft import draft_type
from eaglet.draft.dflash import DFlashConfig, DFlashDraft
from eaglet.draft.dflash.loss import block_loss, select_anchors
from eaglet.errors import ConfigError
from eaglet.formats import loaders
from eaglet.engines.hf.decode import SpecSettings, TargetRunner, acceptance_stats, plain_generate, speculative_generate
from eaglet.engines.hf.replay import replay_chain, target_side
from eaglet.formats.serving import load_draft
from eaglet.testing.tiny import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

AUX = [2, 4]
K = 3
NEW = 30
PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 8, 77], [9, 8, 7, 6], [400, 2, 33, 19, 101, 5, 5, 260]]
dflash = draft_type("dflash")


@pytest.fixture(scope="module")
def target():
    return build_model("llama", seed=0)


def fitted_draft(target, side, steps: int) -> DFlashDraft:
    """A DFlash draft fitted for `steps` Adam steps to the continuations' tokens (one-hot teachers,
    blocks at every position): right on some slots, wrong on others."""
    c = target.config
    cfg = DFlashConfig.from_target_config(c, c.vocab_size, target_layers=AUX, num_aux=len(AUX), num_layers=1,
                                          block_size=K + 1, mask_token_id=c.vocab_size - 1)
    torch.manual_seed(3)
    d = DFlashDraft(cfg)
    d.reset_parameters()
    with torch.no_grad():
        d.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    opt = torch.optim.Adam([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for seq, aux in zip(side.sequences, side.aux):
            ids = torch.tensor(seq)[None]
            n = ids.shape[1]
            docs, mask = torch.zeros(1, n, dtype=torch.long), torch.ones(1, n, dtype=torch.bool)
            rows = select_anchors(mask, docs, K + 1, 10_000, seed=0)
            logits = d.block_logits(aux[None].float(), ids, torch.arange(n)[None], rows["anchors"], rows["starts"],
                                    attn_impl="dense")
            teacher = torch.nn.functional.one_hot(torch.cat([ids[0, 1:], ids[0, -1:]]), c.vocab_size).float()[None]
            total = total + block_loss(logits, rows["anchors"], teacher, mask, mask, docs, gamma=7.0).total
        total.backward()
        opt.step()
    return d.eval()


@pytest.fixture(scope="module")
def setup(target):
    side = target_side(target, AUX, PROMPTS, NEW, K, batch=3)
    return side, fitted_draft(target, side, 60)


def test_the_decoder_with_a_dflash_draft_is_lossless_and_replay_gives_its_cycles(target, setup):
    side, draft = setup
    runner = TargetRunner(target, AUX)
    settings = SpecSettings("chain", chain_tokens=K, max_new_tokens=NEW)
    runs = replay_chain(draft, side, attn_impl="dense")
    all_accepted = []
    for prompt, (accepted, tokens) in zip(PROMPTS, runs):
        g = speculative_generate(runner, dflash.proposer(draft), prompt, settings)
        assert g.tokens == plain_generate(runner, prompt, NEW).tokens  # lossless
        assert accepted == g.accepted and tokens == g.tokens  # replay walks the decoder's cycles
        all_accepted += accepted
    # the comparison means something: cycles of several lengths, neither none nor all accepted
    assert len(set(all_accepted)) >= 3 and 0 in all_accepted
    assert 1.3 < acceptance_stats(all_accepted, K)["tau"] < K + 1


def test_a_dflash_draft_refuses_a_chain_longer_than_its_block(setup):
    _, draft = setup
    with pytest.raises(ConfigError, match="eval.chain_tokens 4: a DFlash draft of block size 4"):
        dflash.proposer(draft).propose(5, 4, K + 1, 0.0, None)


# ---- the stages ---------------------------------------------------------------------------------

SETTINGS = ["train.algorithm=dflash", "dflash.block_size=4", "dflash.layers=2", "dflash.max_anchors=4", "train.max_steps=6",
            "train.ckpt_every=2", "train.log_every=1", "train.max_tokens=256", "train.compile=off",
            "train.eval_every=0", "export.formats=[vllm]", "eval.num_prompts=2", "eval.max_new_tokens=10",
            "eval.chain_tokens=3", "train.prefetch=0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dflash")
    base = tiny_pipeline_upto_vocab(tmp, 30, 0, SETTINGS)
    full, log = train_on_copy(tmp, base, "full")
    return tmp, base, full, log


def test_a_killed_dflash_run_resumes_to_the_same_losses_and_weights(runs, tmp_path):
    tmp, base, full, log = runs
    run = killed_copy(full, tmp_path / "killed", after=4)
    run, resumed_log = train_on_copy(tmp_path, base, "killed", fresh=False)
    stats = json.loads((run / "train" / "manifest.json").read_text())["stats"]
    assert stats["resumed"]["from_step"] == 4
    losses = [{k: v for k, v in r.items() if k.startswith(("loss", "acc_"))} for r in log if r["split"] == "train"]
    again = [{k: v for k, v in r.items() if k.startswith(("loss", "acc_"))} for r in resumed_log if r["split"] == "train"]
    assert again == losses and len(losses) == 6 and all(len(r) == 1 + 2 * 3 for r in losses)  # loss, loss_k, acc_k
    a, b = (load_file(str(r / "train" / "final" / "model.safetensors")) for r in (full, run))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dflash_runs_every_stage_and_its_export_is_what_vllm_loads(runs):
    tmp, base, full, _ = runs
    cfg = load_config(None, [f"run.dir={full}", *base])
    pipeline.run_all(cfg)
    store = json.loads((full / "extract" / "store.json").read_text())
    n = build_model("llama", seed=0).config.num_hidden_layers
    assert store["layers"] == dflash.layers(n, cfg)  # the store holds DFlash's layers, not EAGLE-3's
    assert loaders.dflash_vllm_problems(full / "export" / "vllm") == []
    _, _, meta = load_draft(full / "export" / "vllm", own=True)
    assert meta["algorithm"] == "dflash" and meta["aux_layer_ids"] == store["layers"]
    stats = json.loads((full / "eval" / "manifest.json").read_text())["stats"]
    assert stats["lossless"] is True and stats["lossless_mismatches"] == 0


def test_the_doctor_refuses_a_chain_longer_than_the_dflash_block_before_training():
    """eval.chain_tokens (or export.speculative_tokens) above block_size - 1, or an EAGLE-2 tree,
    FAILs the train stage's preflight in one line naming the key, before any weight loads."""
    from eaglet.doctor import diagnose

    def lines(*sets):
        return [f for f in diagnose(load_config(None, ["train.algorithm=dflash", *sets]), "train").findings
                if f.check == "draft type"]

    (ok,) = lines("dflash.block_size=8", "eval.chain_tokens=7", "export.speculative_tokens=7")
    assert ok.status == "ok"
    bad = lines("dflash.block_size=4", "eval.chain_tokens=4", "export.speculative_tokens=3", "eval.method=tree")
    assert [f.status for f in bad] == ["FAIL", "FAIL"]  # 4 is one past the block's 3; 3 is the most it drafts
    assert bad[0].found.startswith("eval.chain_tokens 4: a DFlash draft of dflash.block_size 4 drafts at most 3")
    assert "eval.method tree" in bad[1].found and isinstance(bad[0].error, ConfigError)
    (eagle3,) = [f for f in diagnose(load_config(None, ["eval.method=tree"]), "train").findings
                 if f.check == "draft type"]
    assert eagle3.status == "ok"  # EAGLE-3 drafts trees
