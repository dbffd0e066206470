"""Greedy chain acceptance by replay (eaglet.engines.replay) against the decoder itself.

The reference is `speculative_generate`: for a draft trained until it agrees with the target
part of the time, the replay's accepted count per verification and its new tokens must be the
decoder's, prompt by prompt, with and without an EOS that cuts the output short. The batched,
left-padded greedy continuations must be the batch-1 greedy decode's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eaglet.draft.model import DraftConfig, Eagle3Draft
from eaglet.engines.replay import greedy_continuations, replay_chain, target_side
from eaglet.engines.specdec import DraftRunner, SpecSettings, TargetRunner, acceptance_stats, plain_generate, \
    speculative_generate
from eaglet.testing.tiny import build_model

AUX = [2, 4, 5]
K = 4
NEW = 40
PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 8, 77], [9, 8, 7, 6], [400, 2, 33, 19, 101, 5, 5, 260],
           [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return build_model("llama", seed=0)


def partly_trained_draft(target, side, steps: int) -> Eagle3Draft:
    """A draft fitted for `steps` Adam steps to the continuations' next tokens (hard labels,
    every TTT step): right on some rows and steps, wrong on others."""
    cfg = DraftConfig.from_target_config(target.config, draft_vocab_size=target.config.vocab_size)
    torch.manual_seed(3)
    d = Eagle3Draft(cfg)
    with torch.no_grad():
        d.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    opt = torch.optim.Adam([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        loss = 0.0
        for seq, aux in zip(side.sequences, side.aux):
            ids = torch.tensor(seq)[None]
            for j, logits in enumerate(d.reference_ttt_steps(aux[None], ids, num_steps=K, attn_impl="naive")):
                loss = loss + F.cross_entropy(logits[0, : len(seq) - 2 - j], ids[0, 2 + j:])
        loss.backward()
        opt.step()
    return d.eval()


@pytest.fixture(scope="module")
def setup(target):
    side = target_side(target, AUX, PROMPTS, NEW, K, batch=3)  # 3 + 1: two batches, the first padded
    return side, partly_trained_draft(target, side, 40)


def test_batched_continuations_are_the_batch1_greedy_decode(target, setup):
    side, _ = setup
    tr = TargetRunner(target, AUX)
    for p, seq in zip(PROMPTS, side.sequences):
        assert seq[: len(p)] == p
        assert seq[len(p):] == plain_generate(tr, p, NEW + K).tokens
    assert greedy_continuations(target, PROMPTS[:2], 5, batch=1) == [s[: len(p) + 5] for p, s in
                                                                      zip(PROMPTS[:2], side.sequences)]


@pytest.mark.parametrize("eos", [False, True], ids=["no-eos", "eos"])
def test_replay_gives_the_decoders_accepted_counts(target, setup, eos):
    side, draft = setup
    tr, dr = TargetRunner(target, AUX), DraftRunner(draft)
    # an EOS: a token each continuation produces somewhere in its second half (so outputs end early)
    stop = sorted({s[len(p) + NEW // 2 + 3] for p, s in zip(PROMPTS, side.sequences)}) if eos else []
    s = SpecSettings("chain", chain_tokens=K, max_new_tokens=NEW)
    runs = replay_chain(draft, side, eos=stop, attn_impl="naive")
    all_accepted = []
    for p, (accepted, tokens) in zip(PROMPTS, runs):
        g = speculative_generate(tr, dr, p, s, stop)
        assert accepted == g.accepted
        assert tokens == g.tokens
        all_accepted += accepted
        if eos:
            assert len(tokens) < NEW and tokens[-1] in stop
    # the comparison means something: cycles of several lengths, neither none nor all accepted
    assert len(set(all_accepted)) >= 3 and 0 in all_accepted
    tau = acceptance_stats(all_accepted, K)["tau"]
    assert 1.3 < tau < K + 1


def test_replay_of_a_shorter_chain_and_fewer_tokens(target, setup):
    side, draft = setup
    tr, dr = TargetRunner(target, AUX), DraftRunner(draft)
    s = SpecSettings("chain", chain_tokens=2, max_new_tokens=20)
    for p, (accepted, tokens) in zip(PROMPTS, replay_chain(draft, side, k=2, max_new_tokens=20, attn_impl="naive")):
        g = speculative_generate(tr, dr, p, s)
        assert (accepted, tokens) == (g.accepted, g.tokens)
    with pytest.raises(ValueError, match="k <= 4"):
        replay_chain(draft, side, k=5)
