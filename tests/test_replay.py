"""Greedy chain acceptance by replay (eaglet.engines.hf.replay) against the decoder itself.

The reference is `speculative_generate`: for a draft trained until it agrees with the target
part of the time, the replay's accepted count per verification and its new tokens must be the
decoder's, prompt by prompt, with and without an EOS that cuts the output short; the same for
greedy EAGLE-2 trees (replay_tree). The batched,
left-padded greedy continuations must be the batch-1 greedy decode's. Tree replay runs its
prompts in lockstep batches; it must give the per-prompt replay's results (the decoder's own
`draft_tree`, `reference_replay_tree`) at every batch size, greedy and sampled, also where
candidates tie exactly. A draft vocabulary smaller than the target's (d2t non-zero) replays
as the decoder decodes it, chains and trees, and a sampled chain's chances place the draft's
distribution on the target vocabulary as the decoder does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eaglet.draft.eagle3.model import DraftConfig, Eagle3Draft
from eaglet.draft.eagle3 import tree_batch
from eaglet.draft.eagle3.propose import Eagle3Proposer
from eaglet.draft.eagle3.replay import reference_replay_tree
from eaglet.engines.hf.replay import agreement_runs, continuations, replay_chain, replay_tree, side_of, target_side
from eaglet.engines.hf.decode import SpecSettings, TargetRunner, acceptance_stats, plain_generate, \
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
    assert continuations(target, PROMPTS[:2], 5, batch=1) == [s[: len(p) + 5] for p, s in
                                                                      zip(PROMPTS[:2], side.sequences)]


@pytest.mark.parametrize("eos", [False, True], ids=["no-eos", "eos"])
def test_replay_gives_the_decoders_accepted_counts(target, setup, eos):
    side, draft = setup
    tr, dr = TargetRunner(target, AUX), Eagle3Proposer(draft)
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


@pytest.mark.parametrize("eos", [False, True], ids=["no-eos", "eos"])
def test_tree_replay_gives_the_decoders_accepted_counts(target, setup, eos):
    """Greedy trees: the decoder's own tree drafting, followed along the known continuation
    instead of verified by the target, gives the decoder's accepted counts and tokens."""
    side, draft = setup
    tr, dr = TargetRunner(target, AUX), Eagle3Proposer(draft)
    stop = sorted({s[len(p) + NEW // 2 + 3] for p, s in zip(PROMPTS, side.sequences)}) if eos else []
    s = SpecSettings("tree", max_new_tokens=NEW, tree_top_k=2, tree_depth=K, tree_total_tokens=5)
    runs = replay_tree(draft, side, top_k=2, depth=K, total_tokens=5, eos=stop)
    all_accepted = []
    for p, (accepted, tokens) in zip(PROMPTS, runs, strict=True):
        g = speculative_generate(tr, dr, p, s, stop)
        assert (accepted, tokens) == (g.accepted, g.tokens)
        all_accepted += accepted
    assert len(set(all_accepted)) >= 3 and min(all_accepted) < 2 < K == max(all_accepted)  # several lengths
    chain = [a for accepted, _ in replay_chain(draft, side, eos=stop, attn_impl="naive") for a in accepted]
    assert acceptance_stats(all_accepted, K)["tau"] > acceptance_stats(chain, K)["tau"]  # a tree holds more
    with pytest.raises(ValueError, match="hold 44 tokens: too few for 40 new tokens and a tree of depth 5"):
        replay_tree(draft, side, depth=5)
    assert replay_tree(draft, side, top_k=2, depth=5, total_tokens=5, max_new_tokens=39)  # 39 + 5 fit in 44


def reduced_vocab(draft: Eagle3Draft, keep: list[int]) -> Eagle3Draft:
    """`draft` with a draft vocabulary of the target ids `keep` (sorted): its lm_head rows of them,
    d2t mapping draft id i to keep[i], as the vocab stage's draft has."""
    import dataclasses

    cfg = dataclasses.replace(draft.config, draft_vocab_size=len(keep))
    d = Eagle3Draft(cfg)
    state = {k: v for k, v in draft.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    d.load_state_dict(state, strict=False)
    ids = torch.tensor(keep)
    with torch.no_grad():
        d.lm_head.weight.copy_(draft.lm_head.weight[ids])
        d.d2t.copy_(ids - torch.arange(len(keep)))
        d.t2d.zero_()
        d.t2d[ids] = True
    return d.eval()


@pytest.fixture(scope="module")
def reduced(target, setup):
    """The partly trained draft with a draft vocabulary of 48 of the 512 target ids: two thirds of
    the tokens its continuations hold (the others never proposed) and ids the continuations do not
    hold, so draft id i maps to target id i + d2t[i], d2t non-zero throughout."""
    side, draft = setup
    held = sorted({t for p, s in zip(PROMPTS, side.sequences) for t in s[len(p):]})
    keep = [t for i, t in enumerate(held) if i % 3 != 2]
    keep = sorted(keep + [t for t in range(470, 512) if t not in held][: 48 - len(keep)])
    d = reduced_vocab(draft, keep)
    assert d.config.draft_vocab_size == 48 and (d.d2t != 0).all() and set(held) - set(keep)
    return d


@pytest.mark.parametrize("eos", [False, True], ids=["no-eos", "eos"])
def test_replay_of_a_reduced_draft_vocabulary_maps_through_d2t(target, setup, reduced, eos):
    """A draft vocabulary smaller than the target's (d2t non-zero, as every trained draft's): the
    replay's accepted counts and tokens are the decoder's, for chains and trees, prompt by prompt;
    a continuation's token outside the draft vocabulary is never accepted."""
    side, _ = setup
    tr, dr = TargetRunner(target, AUX), Eagle3Proposer(reduced)
    stop = sorted({s[len(p) + NEW // 2 + 3] for p, s in zip(PROMPTS, side.sequences)}) if eos else []
    chain = replay_chain(reduced, side, eos=stop, attn_impl="naive")
    tree = replay_tree(reduced, side, top_k=2, depth=K, total_tokens=5, eos=stop)
    counts = []
    for p, c, t in zip(PROMPTS, chain, tree, strict=True):
        g = speculative_generate(tr, dr, p, SpecSettings("chain", chain_tokens=K, max_new_tokens=NEW), stop)
        assert c == (g.accepted, g.tokens)
        g = speculative_generate(tr, dr, p, SpecSettings("tree", max_new_tokens=NEW, tree_top_k=2, tree_depth=K,
                                                         tree_total_tokens=5), stop)
        assert t == (g.accepted, g.tokens)
        counts += c[0]
    # the comparison means something: several accepted lengths, some none, some the whole chain
    assert len(set(counts)) >= 3 and 0 in counts and max(counts) >= 2


@pytest.fixture(scope="module")
def sampled_side(target):
    return target_side(target, AUX, PROMPTS, NEW, K, batch=3, temperature=1.0, seed=5)


def test_a_sampled_chains_chances_of_a_reduced_draft_vocabulary(reduced, sampled_side):
    """At temperature 1 with a reduced draft vocabulary: each step's chance is min(1, q(y) / p(y)),
    q the draft's distribution placed on the target vocabulary through d2t as the decoder places it
    (`draft_q_on_target`), so a continuation's token outside the draft vocabulary has chance 0."""
    from eaglet.engines.hf.decode import draft_q_on_target

    side, d = sampled_side, reduced
    d2t = d.draft_to_target(torch.arange(d.config.draft_vocab_size))
    got = agreement_runs(d, side, K, attn_impl="naive")
    positive = 0
    for seq, aux, p_y, chance in zip(side.sequences, side.aux, side.p_token, got, strict=True):
        ids, n = torch.tensor(seq)[None], len(seq)
        want = torch.zeros(n, K, dtype=torch.float64)
        with torch.no_grad():
            steps = list(d.reference_ttt_steps(aux[None], ids, num_steps=K, attn_impl="naive"))
        for j, logits in enumerate(steps):
            for t in range(n - 2 - j):
                q = draft_q_on_target(torch.softmax(logits[0, t].double(), -1), d2t, d.config.vocab_size)
                want[t, j] = min(1.0, float(q[seq[t + 2 + j]] / p_y[t + 2 + j]))
        torch.testing.assert_close(chance, want, rtol=1e-4, atol=1e-9)  # packed or not: fp32 logits round apart
        positive += int((want > 0).sum())
        assert not want[[t for t in range(n - 2) if not d.t2d[seq[t + 2]]], 0].any()
    assert positive > 50


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_batched_tree_replay_is_the_per_prompt_replay(setup, sampled_side, temperature, monkeypatch):
    """Prompts of different lengths in lockstep batches of 1, 2, 3 (a full batch and one of 1) and
    all 4, with and without an EOS, for trees of several shapes: the per-prompt replay's accepted
    counts and tokens, prompt by prompt; no batch holds more prompts than asked."""
    side, draft = setup
    if temperature > 0:
        side = sampled_side
    stop = sorted({s[len(p) + NEW // 2 + 3] for p, s in zip(PROMPTS, side.sequences)})
    sizes = []
    run = tree_batch.TreeBatch.run
    monkeypatch.setattr(tree_batch.TreeBatch, "run", lambda self, *a: sizes.append(len(self.prompts)) or run(self, *a))
    counts, cut = set(), 0
    for top_k, total, eos in ((2, 5, []), (3, 7, stop), (10, 60, stop)):
        ref = reference_replay_tree(draft, side, top_k, K, total, eos=eos)
        for batch in (1, 2, 3, len(PROMPTS)):
            sizes.clear()
            assert replay_tree(draft, side, top_k, K, total, eos=eos, batch=batch) == ref, (top_k, total, eos, batch)
            assert max(sizes) == batch and sum(sizes) == len(PROMPTS)
        counts |= {a for accepted, _ in ref for a in accepted}
        cut += sum(len(tokens) < NEW for _, tokens in ref)
    # several accepted lengths (fewer on the tiny target's near-uniform samples); the EOS ended outputs early
    assert len(counts) >= (2 if temperature > 0 else 3) and cut >= 2
    with pytest.raises(ValueError, match="batch 0"):
        replay_tree(draft, side, depth=K, batch=0)


def test_ties_break_as_the_decoder_breaks_them(setup):
    """Exact ties decide these trees: twin draft tokens (2i and 2i + 1 with the same lm_head row)
    score exactly alike, so which twin a top-k takes and the kept order of equal scores (by pool
    index) shape the tree, and the batched replay must break them as draft_tree does. With d2t
    mapping both twins to one target token, siblings hold the same token and the path takes the
    first by score, as `follow` does."""
    import copy

    side, draft = setup
    twins, same_token = copy.deepcopy(draft), copy.deepcopy(draft)
    with torch.no_grad():
        twins.lm_head.weight[1::2] = twins.lm_head.weight[0::2]
        same_token.d2t[1::2] = -1  # draft id 2i + 1 proposes target token 2i
    for d in (twins, same_token):
        for top_k, total in ((3, 7), (5, 9)):
            ref = reference_replay_tree(d, side, top_k, K, total)
            assert len({a for accepted, _ in ref for a in accepted}) >= 3
            for batch in (1, len(PROMPTS)):
                assert replay_tree(d, side, top_k, K, total, batch=batch) == ref


def test_a_sampled_tree_replays_exactly_what_the_decoder_gave(target, setup):
    """At temperature 1 the output token decides a tree's path: replaying the decoder's own
    sampled output gives its accepted count for every cycle."""
    _, draft = setup
    tr, dr = TargetRunner(target, AUX), Eagle3Proposer(draft)
    s = SpecSettings("tree", temperature=1.0, max_new_tokens=NEW + K, tree_top_k=4, tree_depth=K, tree_total_tokens=12)
    counts = []
    for seed, p in enumerate(PROMPTS):
        g = speculative_generate(tr, dr, p, s, generator=torch.Generator().manual_seed(seed))
        side = side_of(target, AUX, [p], [p + g.tokens], NEW, K, temperature=1.0)
        [(accepted, tokens)] = replay_tree(draft, side, top_k=4, depth=K, total_tokens=12)
        assert accepted == g.accepted[: len(accepted)] and tokens == g.tokens[:NEW]
        counts += accepted
    assert len(set(counts)) >= 2 and 0 < sum(counts) < K * len(counts)  # some accepted, some not


def test_a_sampled_chains_acceptance_chances_are_the_decoders_rates(target, setup):
    """At temperature 1, given the decoder's sampled output, each chain step was accepted with
    the chance agreement_runs gives (min(1, q(y) / p(y))): over the decoder's own cycles the
    accepted steps match the chances' sum within 4 standard deviations; and a sampled side's
    replay draws them. The target's LM head is scaled by 10 (its greedy tokens, which the
    draft fits, unchanged): the tiny target's own distributions at temperature 1 are nearly
    uniform, p(y) the same everywhere, which would leave a wrong p unseen."""
    import copy

    _, draft = setup
    sharp = copy.deepcopy(target)
    with torch.no_grad():
        sharp.lm_head.weight.mul_(10.0)
    temp = 1.0
    tr, dr = TargetRunner(sharp, AUX), Eagle3Proposer(draft)
    s = SpecSettings("chain", chain_tokens=K, temperature=temp, max_new_tokens=NEW + K)
    trials = []  # (chance, accepted) of every draft step the decoder verified
    for seed in range(8):
        for p in PROMPTS:
            g = speculative_generate(tr, dr, p, s, generator=torch.Generator().manual_seed(seed))
            side = side_of(sharp, AUX, [p], [p + g.tokens], NEW, K, temperature=temp)
            [chance] = agreement_runs(draft, side, K, attn_impl="naive")
            Q = len(p)
            for a in g.accepted:
                if Q + K >= len(p) + NEW:
                    break
                for j in range(min(a + 1, K)):  # steps 0..a: accepted, then (unless a == K) the rejected one
                    trials.append((float(chance[Q - 1, j]), j < a))
                Q += a + 1
    # q(y) >= p(y): y cannot come from the residual, so it was the accepted draft token; q(y) = 0: never
    sure = [ok for r, ok in trials if r >= 1 - 1e-9]
    never = [ok for r, ok in trials if r <= 1e-12]
    assert len(sure) > 50 and all(sure) and not any(never)
    for lo, hi in ((1e-12, 0.2), (0.2, 1 - 1e-9)):  # between: as many accepted as the chances add up to
        some = [(r, ok) for r, ok in trials if lo < r < hi]
        surplus, var = sum(ok - r for r, ok in some), sum(r * (1 - r) for r, _ in some)
        assert len(some) > 100 and var > 10 and abs(surplus) < 4 * var ** 0.5, (lo, hi, surplus, var, len(some))
    sampled = target_side(sharp, AUX, PROMPTS, NEW, K, temperature=temp, seed=1)
    assert sampled.sequences != setup[0].sequences and len(sampled.p_token[0]) == len(sampled.sequences[0])
    runs = replay_chain(draft, sampled, attn_impl="naive")
    assert [t for _, t in runs] == [q[len(p):][:NEW] for p, q in zip(PROMPTS, sampled.sequences)]
    assert len({a for acc, _ in runs for a in acc}) >= 3


def test_replay_of_a_shorter_chain_and_fewer_tokens(target, setup):
    side, draft = setup
    tr, dr = TargetRunner(target, AUX), Eagle3Proposer(draft)
    s = SpecSettings("chain", chain_tokens=2, max_new_tokens=20)
    for p, (accepted, tokens) in zip(PROMPTS, replay_chain(draft, side, k=2, max_new_tokens=20, attn_impl="naive")):
        g = speculative_generate(tr, dr, p, s)
        assert (accepted, tokens) == (g.accepted, g.tokens)
    with pytest.raises(ValueError, match="k <= 4"):
        replay_chain(draft, side, k=5)


def test_the_eval_stage_replays_turn_by_turn_as_it_decodes(target, setup):
    """evaluate_items with eval.replay: the same records as decoding, second turns included
    (asked after the replayed answer), with the replay's settings and no speed or lossless;
    for chains and greedy trees."""
    from eaglet.config import EvalSection
    from eaglet.formats.eval_sets import EvalItem
    from eaglet.evaluation.inprocess import evaluate_items
    from eaglet.evaluation.results import setting_key
    from eaglet.testing.tiny import build_tokenizer

    _, draft = setup
    tok = build_tokenizer()
    items = [EvalItem("q1", "a", asks=("p0", "and more")), EvalItem("q2", "b", asks=("p2",))]

    def render(msgs):  # a first turn "pN" is PROMPTS[N] (which the draft fits); later text as char codes
        rest = [2 + (7 * i + ord(c)) % 500 for m in msgs[1:] for i, c in enumerate(m["content"])]
        return PROMPTS[int(msgs[0]["content"][1:])] + rest[-30:]

    out = {}
    for replay in (False, True):
        ecfg = EvalSection(method="chain", chain_tokens=K, max_new_tokens=24, baseline=False, lossless_check=False,
                           replay=replay)
        out[replay] = evaluate_items(target, tok, draft, AUX, items, ecfg, render, warmup=False, verbose=False)
    dec, rep = out[False], out[True]
    assert [r["item"] for r in rep["prompts"]] == [r["item"] for r in dec["prompts"]] and len(rep["prompts"]) == 3
    for a, b in zip(dec["prompts"], rep["prompts"]):
        assert (b["accepted_per_forward"], b["tokens"]) == (a["accepted_per_forward"], a["tokens"])
    assert sum(sum(r["accepted_per_forward"]) for r in rep["prompts"]) > 0
    assert rep["aggregate"]["tau"] == dec["aggregate"]["tau"] and rep["by_category"].keys() == {"a", "b"}
    assert rep["settings"]["replay"] is True and "lossless" not in rep["aggregate"]
    assert setting_key(EvalSection(replay=True)) == "heldout-chain7-greedy-replay"
    # a greedy tree replays too, as the tree decoder gives it; sampling does not
    trees = [evaluate_items(target, tok, draft, AUX, items, EvalSection(
        method="tree", tree_top_k=2, tree_depth=K, tree_total_tokens=5, max_new_tokens=24, baseline=False,
        lossless_check=False, replay=replay), render, warmup=False, verbose=False) for replay in (False, True)]
    for a, b in zip(trees[0]["prompts"], trees[1]["prompts"], strict=True):
        assert (b["accepted_per_forward"], b["tokens"]) == (a["accepted_per_forward"], a["tokens"])
    assert trees[1]["aggregate"]["tau"] == trees[0]["aggregate"]["tau"] > rep["aggregate"]["tau"]
    # at temperature 1: sampled continuations (seeded by the eval's seed), the same for the same seed
    hot = [evaluate_items(target, tok, draft, AUX, items, EvalSection(
        method=m, chain_tokens=K, tree_top_k=2, tree_depth=K, tree_total_tokens=5, temperature=1.0, max_new_tokens=24,
        baseline=False, lossless_check=False, replay=True), render, warmup=False, verbose=False, seed=seed)
        for m, seed in (("chain", 0), ("chain", 0), ("chain", 1), ("tree", 0))]
    assert hot[0]["prompts"] == hot[1]["prompts"] and hot[0]["prompts"] != hot[2]["prompts"]
    assert [r["tokens"] for r in hot[3]["prompts"]] == [r["tokens"] for r in hot[0]["prompts"]]  # a seed samples the same continuations, whatever the drafting
    assert [r["tokens"] for r in hot[0]["prompts"]] != [r["tokens"] for r in rep["prompts"]]
    assert all(len(r["tokens"]) == 24 for r in hot[0]["prompts"]) and hot[0]["settings"]["temperature"] == 1.0
