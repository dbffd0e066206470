"""Speculative decoding (eaglet.engines.hf.decode) against references on tiny fp32 targets.

- acceptance bookkeeping on hand-built sequences;
- tree masks / positions against an explicit ancestor walk; the draft's tree scores against
  a plain chain run along each path; the target's tree-verified logits against a plain
  forward of each branch (also after gathering the accepted path in the KV cache);
- lossless greedy decoding (chain and tree, full and subset draft vocabularies), and with an
  oracle draft that proposes the target's own tokens (in draft ids of a subset vocabulary too,
  which only the d2t mapping turns back into the target's): tau must hit its ceiling;
- rejection sampling: exact enumeration of the output distribution, and an end-to-end
  sampling run whose 3-token distribution matches the target's exact one;
- the cache-keyword detection (`cache` vs `past_key_values`).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from itertools import product

import numpy as np
import pytest
import torch

from eaglet.draft.eagle3.model import DraftConfig, Eagle3Draft
from eaglet.draft.eagle3.propose import Eagle3Proposer, draft_tree
from eaglet.engines.hf.decode import (
    SpecSettings,
    TargetRunner,
    Tree,
    accept_probability,
    acceptance_stats,
    ancestor_mask,
    cache_kwarg,
    chain_tree,
    keep_cache_rows,
    new_cache,
    pick_among_children,
    plain_generate,
    residual_distribution,
    speculative_generate,
    verify_chain_sampling,
)
from eaglet.utils import first_difference
from eaglet.testing.tiny import build_model

AUX = [2, 4, 5]


def make_draft(target, draft_vocab: int | None = None, seed: int = 1, cls=Eagle3Draft, **kw) -> Eagle3Draft:
    V = target.config.vocab_size
    cfg = DraftConfig.from_target_config(target.config, draft_vocab_size=draft_vocab or V)
    torch.manual_seed(seed)
    d = cls(cfg, **kw).eval()
    with torch.no_grad():
        d.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        if draft_vocab and draft_vocab < V:  # a random sorted subset of the target vocabulary
            used = torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:draft_vocab]).values
            d.d2t.copy_(used - torch.arange(draft_vocab))
            d.t2d.zero_()
            d.t2d[used] = True
    return d


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return build_model("llama", seed=0)


PROMPT = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 8, 77]


def start(tr: TargetRunner, dr: Eagle3Proposer, prompt: list[int]):
    """Prefill both sides; (hidden, draft logits, pending token, Q, target cache)."""
    cache = new_cache()
    dr.reset()
    logits, aux = tr.forward(cache, prompt, range(len(prompt)), last_only=True)
    pending = int(logits[-1].argmax())
    hidden, dlogits = dr.extend(aux, prompt[1:] + [pending], 0)
    return hidden, dlogits, pending, len(prompt), cache


# ---- bookkeeping ------------------------------------------------------------------------------


def test_acceptance_stats_on_hand_built_cycles():
    s = acceptance_stats([2, 0, 4, 1], num_positions=4)
    assert s["verify_forwards"] == 4
    assert s["tokens_from_verification"] == 3 + 1 + 5 + 2
    assert s["tau"] == pytest.approx(11 / 4)
    # position i reached when >= i accepted, accepted when > i
    assert s["position_reached"] == [4, 3, 2, 1]
    assert s["position_accepted"] == [3, 2, 1, 1]
    assert s["acceptance_rate"] == pytest.approx([3 / 4, 2 / 3, 1 / 2, 1.0])
    assert acceptance_stats([], 3)["tau"] is None
    assert acceptance_stats([3, 3], 3)["tau"] == 4.0 and acceptance_stats([3, 3], 3)["acceptance_rate"] == [1.0] * 3


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def _walk(parents, i):
    out = [i]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out


def test_ancestor_mask_against_walk():
    rng = np.random.default_rng(0)
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, 40)]
    m = ancestor_mask(parents)
    for i in range(40):
        expected = torch.zeros(40, dtype=torch.bool)
        expected[_walk(parents, i)] = True
        assert torch.equal(m[i], expected)
    with pytest.raises(ValueError):
        ancestor_mask([-1, 2, 0])


def test_draft_tree_structure_and_scores_against_plain_chain(target):
    """EAGLE-2 tree: parents first, depth = walk length, kept set = best total_tokens by score
    and closed under ancestors, and each node's score = the draft's log-probs summed along a
    plain (causal, cached) chain run of its path, so masks and positions in the draft's tree
    forward are right."""
    draft = make_draft(target)
    with torch.no_grad():
        draft.lm_head.weight.mul_(50)  # sharper draft distributions: scores differ clearly
    tr, dr = TargetRunner(target, AUX), Eagle3Proposer(draft)
    hidden, dlogits, pending, Q, _ = start(tr, dr, PROMPT)
    k, depth, total = 3, 4, 12
    tree = draft_tree(dr, hidden, dlogits, pending, Q, k, depth, total)
    assert dr.length == Q  # the tree's draft rows are dropped
    assert tree.size == total + 1 and tree.tokens[0] == pending
    assert max(tree.depths) == depth
    for i in range(1, tree.size):
        walk = _walk(tree.parents, i)
        assert tree.parents[i] < i
        assert tree.depths[i] == len(walk) - 1
        assert tree.scores[i] <= tree.scores[tree.parents[i]] + 1e-6
        # score from a plain chain run of the path, one cached row at a time
        path = [tree.tokens[j] for j in reversed(walk[:-1])]
        h, lg = hidden, dlogits
        ref = float(torch.log_softmax(lg, -1)[path[0]])
        for j in range(1, len(path)):
            hs, lgs = dr.step(h[None], [path[j - 1]], [Q + j])
            h, lg = hs[0], lgs[0]
            ref += float(torch.log_softmax(lg, -1)[path[j]])
        dr.cache.crop(Q)
        assert tree.scores[i] == pytest.approx(ref, abs=1e-4)
    # siblings are distinct tokens
    for i in range(tree.size):
        kids = [tree.tokens[c] for c in tree.children(i)]
        assert len(kids) == len(set(kids))
    # a bigger budget keeps a superset whose extra nodes score no better than the kept ones
    big = draft_tree(dr, hidden, dlogits, pending, Q, k, depth, 10_000)
    assert big.size == 1 + k + (depth - 1) * k * k
    kept = {tuple(reversed([tree.tokens[j] for j in _walk(tree.parents, i)])) for i in range(1, tree.size)}
    all_paths = {tuple(reversed([big.tokens[j] for j in _walk(big.parents, i)])): big.scores[i] for i in range(1, big.size)}
    assert kept <= set(all_paths)
    worst_kept = min(all_paths[p] for p in kept)
    assert all(s <= worst_kept + 1e-6 for p, s in all_paths.items() if p not in kept)


# ---- target side: tree verification and cache gathering ---------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2_sliding"])
def test_tree_verification_equals_plain_forward_per_branch(family, target):
    model = target if family == "llama" else build_model(
        "qwen2", seed=3, use_sliding_window=True, sliding_window=6, max_window_layers=2)
    tr = TargetRunner(model, AUX)
    parents = [-1, 0, 0, 1, 1, 2, 3, 5, 6, 6]
    depths = [len(_walk(parents, i)) - 1 for i in range(len(parents))]
    tokens = [11, 20, 21, 30, 31, 32, 40, 41, 50, 51]
    tree = Tree(tokens, parents, depths)
    cache = new_cache()
    Q = len(PROMPT)
    tr.forward(cache, PROMPT, range(Q), last_only=True)
    logits, aux = tr.forward(cache, tree.tokens, [Q + d for d in depths], tr.tree_mask(tree, Q))
    for i in range(tree.size):
        branch = PROMPT + [tokens[j] for j in reversed(_walk(parents, i))]
        ref_logits, ref_aux = tr.forward(new_cache(), branch, range(len(branch)))
        torch.testing.assert_close(logits[i], ref_logits[-1], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(aux[i], ref_aux[-1], atol=2e-5, rtol=1e-5)
    # keep prefix + the path to node 8 (depth 4), then decode one more token on that cache
    path = list(reversed(_walk(parents, 8)))
    keep_cache_rows(cache, torch.cat([torch.arange(Q), Q + torch.tensor(path)]))
    assert cache.get_seq_length() == Q + len(path)
    nxt, _ = tr.forward(cache, [77], [Q + len(path)])
    ref, _ = tr.forward(new_cache(), PROMPT + [tokens[j] for j in path] + [77], range(Q + len(path) + 1))
    torch.testing.assert_close(nxt[-1], ref[-1], atol=2e-5, rtol=1e-5)
    assert ref[-1].argmax() == nxt[-1].argmax()


def test_keep_cache_rows_prefix(target):
    tr = TargetRunner(target, AUX)
    cache = new_cache()
    tr.forward(cache, PROMPT, range(len(PROMPT)))
    keep_cache_rows(cache, 5)
    assert cache.get_seq_length() == 5
    a, _ = tr.forward(cache, [9], [5])
    b, _ = tr.forward(new_cache(), PROMPT[:5] + [9], range(6))
    torch.testing.assert_close(a[-1], b[-1], atol=2e-5, rtol=1e-5)


# ---- lossless greedy decoding -----------------------------------------------------------------

CHAIN = SpecSettings("chain", chain_tokens=4, max_new_tokens=48)
TREE = SpecSettings("tree", tree_top_k=3, tree_depth=4, tree_total_tokens=12, max_new_tokens=48)


@pytest.mark.parametrize("settings", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("draft_vocab", [None, 200], ids=["full_vocab", "subset_vocab"])
def test_lossless_with_random_draft(target, settings, draft_vocab):
    tr = TargetRunner(target, AUX)
    base = plain_generate(tr, PROMPT, settings.max_new_tokens)
    g = speculative_generate(tr, Eagle3Proposer(make_draft(target, draft_vocab)), PROMPT, settings)
    assert first_difference(g.tokens, base.tokens) is None
    assert len(g.tokens) == settings.max_new_tokens
    assert sum(a + 1 for a in g.accepted) + 1 >= len(g.tokens)


@pytest.mark.parametrize("family, kw", [
    ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=2)),  # some layers slide
    ("mistral", dict(sliding_window=6)),  # a sliding_window and no layer_types: every layer slides
], ids=["qwen2-some-layers", "mistral-every-layer"])
def test_lossless_with_sliding_window_layers(family, kw):
    """Window 6 < prompt: the chain runs under the model's own masks on a full DynamicCache; the
    tree's verification mask applies the window to the layers that slide ({full, sliding} mask
    dict for Qwen2, one windowed mask for Mistral), or its outputs differ."""
    model = build_model(family, seed=3, **kw)
    if family == "mistral":
        assert not getattr(model.config, "layer_types", None) and model.config.sliding_window == 6
    tr = TargetRunner(model, AUX)
    base = plain_generate(tr, PROMPT, 24).tokens
    for s in (SpecSettings("chain", chain_tokens=3, max_new_tokens=24),
              SpecSettings("tree", tree_top_k=3, tree_depth=3, tree_total_tokens=8, max_new_tokens=24)):
        g = speculative_generate(tr, Eagle3Proposer(make_draft(model)), PROMPT, s)
        assert g.tokens == base


class OracleDraft(Eagle3Draft):
    """A draft whose top token at every row is the target's own greedy token there: row at
    position p predicts position p+1, so it is boosted to oracle[p+1], in draft ids (`to_draft`:
    target id -> draft id, the test's own inverse of a subset vocabulary; none: the same ids),
    so over a subset its proposals are right only where the runner maps draft ids through d2t."""

    def __init__(self, cfg: DraftConfig, oracle: list[int], to_draft: dict[int, int] | None = None):
        super().__init__(cfg)
        self.oracle, self.to_draft = oracle, to_draft

    def forward_step(self, hidden_BTH, input_ids_BT, position_ids_BT, kv_cache=None, attn_mask_TS=None):
        h, logits = super().forward_step(hidden_BTH, input_ids_BT, position_ids_BT, kv_cache, attn_mask_TS)
        logits = logits.clone()
        for r, p in enumerate(position_ids_BT[0].tolist()):
            if p + 1 < len(self.oracle):
                t = self.oracle[p + 1]
                logits[0, r, t if self.to_draft is None else self.to_draft[t]] += 1000.0
        return h, logits


def _assert_at_ceiling(g, greedy: list[int], settings: SpecSettings) -> None:
    """Lossless, and every cycle accepted all its draft positions."""
    n, ceiling = settings.max_new_tokens, settings.num_positions + 1
    assert g.tokens == greedy[:n]
    assert g.accepted == [settings.num_positions] * len(g.accepted)
    assert acceptance_stats(g.accepted, settings.num_positions)["tau"] == ceiling
    assert g.verify_forwards == math.ceil((n - 1) / ceiling)


@pytest.mark.parametrize("settings", [CHAIN, TREE], ids=["chain", "tree"])
def test_oracle_draft_reaches_tau_ceiling(target, settings):
    tr = TargetRunner(target, AUX)
    n = settings.max_new_tokens
    greedy = plain_generate(tr, PROMPT, n + settings.num_positions + 2).tokens
    draft = make_draft(target, cls=OracleDraft, oracle=PROMPT + greedy)
    _assert_at_ceiling(speculative_generate(tr, Eagle3Proposer(draft), PROMPT, settings), greedy, settings)


def subset_oracle_draft(target, oracle: list[int], size: int = 160, seed: int = 4) -> tuple[OracleDraft, list[int]]:
    """(the oracle draft, its sorted target token list): every oracle token plus random others,
    none next to an oracle token (so an oracle token's offset differs from its neighbours'), with
    d2t[i] = used[i] - i as the vocab stage writes it."""
    V = target.config.vocab_size
    needed = set(oracle)
    near = needed | {t + 1 for t in needed} | {t - 1 for t in needed}
    others = [t for t in torch.randperm(V, generator=torch.Generator().manual_seed(seed)).tolist() if t not in near]
    used = sorted([*needed, *others[: size - len(needed)]])
    cfg = DraftConfig.from_target_config(target.config, draft_vocab_size=size)
    torch.manual_seed(seed)
    d = OracleDraft(cfg, oracle, {t: i for i, t in enumerate(used)}).eval()
    with torch.no_grad():
        d.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        d.d2t.copy_(torch.tensor(used) - torch.arange(size))
        d.t2d.zero_()
        d.t2d[used] = True
    return d, used


@pytest.mark.parametrize("settings", [CHAIN, TREE], ids=["chain", "tree"])
def test_subset_vocab_oracle_draft_reaches_tau_ceiling(target, settings):
    """The draft proposes the target's own greedy tokens in draft ids of a subset vocabulary
    with many different non-zero offsets: every proposal is accepted only when the runner maps
    draft id i to target id i + d2t[i] (ignored, inverted or shifted by one, tau falls to about
    1 while verification keeps the output lossless)."""
    tr = TargetRunner(target, AUX)
    n = settings.max_new_tokens
    greedy = plain_generate(tr, PROMPT, n + settings.num_positions + 2).tokens
    draft, used = subset_oracle_draft(target, PROMPT + greedy)
    d2t = draft.d2t.tolist()
    assert sum(o != 0 for o in d2t) > 0.9 * len(d2t)
    for t in set(greedy):  # a mapping that ignores d2t, or reads a neighbour's offset, gets this token wrong
        i = used.index(t)
        assert d2t[i] >= 2 and d2t[i] not in (d2t[i - 1], d2t[(i + 1) % len(d2t)]), (t, i)
    _assert_at_ceiling(speculative_generate(tr, Eagle3Proposer(draft), PROMPT, settings), greedy, settings)
    assert Eagle3Proposer(draft).draft_to_target.tolist() == used


class NoisyOracleDraft(OracleDraft):
    """The oracle token is top-1 at most positions, second (behind a wrong token) at some and
    not boosted at others: partial acceptance, and tree paths through non-first children."""

    def forward_step(self, hidden_BTH, input_ids_BT, position_ids_BT, kv_cache=None, attn_mask_TS=None):
        h, logits = Eagle3Draft.forward_step(self, hidden_BTH, input_ids_BT, position_ids_BT, kv_cache, attn_mask_TS)
        logits = logits.clone()
        for r, p in enumerate(position_ids_BT[0].tolist()):
            u = random.Random(p).random()  # a fixed irregular pattern over positions
            if p + 1 < len(self.oracle) and u > 0.1:
                right = self.oracle[p + 1]
                logits[0, r, right] += 10.0  # log-prob about 0 (top-1) or -1.3 (second)
                if u < 0.35:
                    logits[0, r, (right + 1) % logits.shape[-1]] += 11.0
        return h, logits


@pytest.mark.parametrize("settings", [CHAIN, TREE], ids=["chain", "tree"])
def test_partially_right_draft_is_lossless(target, settings):
    tr = TargetRunner(target, AUX)
    n = settings.max_new_tokens
    greedy = plain_generate(tr, PROMPT, n + settings.num_positions + 2).tokens
    draft = make_draft(target, cls=NoisyOracleDraft, oracle=PROMPT + greedy)
    g = speculative_generate(tr, Eagle3Proposer(draft), PROMPT, settings)
    assert g.tokens == greedy[:n]
    tau = acceptance_stats(g.accepted, settings.num_positions)["tau"]
    assert 1.5 < tau < settings.num_positions + 1
    assert len(set(g.accepted)) >= 3  # runs of several different lengths were accepted
    if settings.method == "tree":  # a second-ranked child was accepted: better than the chain
        chain = speculative_generate(tr, Eagle3Proposer(draft), PROMPT, replace(CHAIN, chain_tokens=settings.tree_depth))
        assert tau > acceptance_stats(chain.accepted, settings.num_positions)["tau"]


def test_chain_of_one_reproduces_greedy(target):
    tr = TargetRunner(target, AUX)
    s = SpecSettings("chain", chain_tokens=1, max_new_tokens=30)
    base = plain_generate(tr, PROMPT, 30)
    greedy = plain_generate(tr, PROMPT, 40).tokens
    for draft in (make_draft(target, 300), make_draft(target, cls=OracleDraft, oracle=PROMPT + greedy)):
        g = speculative_generate(tr, Eagle3Proposer(draft), PROMPT, s)
        assert g.tokens == base.tokens
    assert g.accepted == [1] * len(g.accepted)  # the oracle's single token is always right


def test_eos_stops_both_decoders(target):
    tr = TargetRunner(target, AUX)
    full = plain_generate(tr, PROMPT, 20).tokens
    eos = full[6]
    base = plain_generate(tr, PROMPT, 20, eos_token_ids=[eos])
    g = speculative_generate(tr, Eagle3Proposer(make_draft(target)), PROMPT, CHAIN, eos_token_ids=[eos])
    assert base.tokens == full[: full.index(eos) + 1] == g.tokens


@pytest.mark.parametrize("settings", [CHAIN, TREE], ids=["chain", "tree"])
def test_progress_hears_of_every_cycle_and_counts_the_tokens_the_output_keeps(target, settings):
    """The progress callback (eval's bar) is called after the prefill and after every cycle, and
    counts tokens as the output keeps them: a cycle that runs past max_new_tokens (the oracle
    accepts 5 tokens a cycle, 47 is no multiple of 5) or past an EOS counts only what is kept."""
    tr = TargetRunner(target, AUX)
    greedy = plain_generate(tr, PROMPT, 60).tokens
    oracle = make_draft(target, cls=OracleDraft, oracle=PROMPT + greedy)
    for draft, eos in ((oracle, []), (oracle, [greedy[8]]), (make_draft(target, 300), [])):
        calls: list[int] = []
        g = speculative_generate(tr, Eagle3Proposer(draft), PROMPT, settings, eos, progress=calls.append)
        assert len(calls) == 1 + g.verify_forwards and min(calls) >= 0
        assert sum(calls) == len(g.tokens)
    assert len(g.tokens) == settings.max_new_tokens  # the random draft ran to the end
    for eos in ([], [greedy[8]]):
        calls = []
        b = plain_generate(tr, PROMPT, 30, eos_token_ids=eos, progress=calls.append)
        assert calls == [1] * len(b.tokens)


# ---- sampling ---------------------------------------------------------------------------------


def test_rejection_sampling_output_is_target_distribution_exactly():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        p = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64) * 2, -1)
        q = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64) * 2, -1)
        q[2] = 0
        q = q / q.sum()  # a token the draft never proposes (outside its vocabulary)
        out = torch.zeros(6, dtype=torch.float64)
        r = residual_distribution(p, q)
        for x in range(6):
            a = accept_probability(p, q, x)
            out[x] += q[x] * a
            out += q[x] * (1 - a) * r
        torch.testing.assert_close(out, p)
    # deterministic children: P(child j accepted) and the fallback sum to p exactly
    p = torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=torch.float64)
    children = [1, 3]
    # accept 1 w.p. 0.4; else p -> [.1,0,.2,.3]/.6, accept 3 w.p. .5; else sample [.1,.2]/.3
    expected = torch.tensor([0.6 * 0.5 * 1 / 3, 0.4, 0.6 * 0.5 * 2 / 3, 0.6 * 0.5], dtype=torch.float64)
    torch.testing.assert_close(expected, p)
    counts = torch.zeros(4)
    gen = torch.Generator().manual_seed(1)
    for _ in range(10000):
        j, tok = pick_among_children(p, children, gen)
        assert (j is None) == (tok not in children)
        counts[tok] += 1
    torch.testing.assert_close(counts / counts.sum(), p.float(), atol=0.02, rtol=0)


def test_chain_rejection_sampler_statistically():
    gen = torch.Generator().manual_seed(2)
    p0 = torch.tensor([0.5, 0.1, 0.1, 0.3], dtype=torch.float64)
    p1 = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    q0 = torch.tensor([0.1, 0.6, 0.0, 0.3], dtype=torch.float64)
    counts = torch.zeros(4)
    accepted = 0
    n = 10000
    for _ in range(n):
        x = int(torch.multinomial(q0, 1, generator=gen))
        a, tok = verify_chain_sampling([p0, p1], [q0], [x], gen)
        counts[x if a == 1 else tok] += 1
        accepted += a
    torch.testing.assert_close(counts / n, p0.float(), atol=0.02, rtol=0)
    assert accepted / n == pytest.approx(float(torch.minimum(p0, q0).sum()), abs=0.02)


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_speculative_sampling_matches_target_distribution(method):
    """3 tokens sampled at T=1 from a 4-token-vocabulary target, many times: the joint
    distribution equals the target's exact one. (A sampler that accepts every draft token
    scores chi2 > 600 here; a correct one about the 23 degrees of freedom.)"""
    V, T, runs = 4, 1.0, 500
    target = build_model("llama", seed=5, vocab_size=V, num_hidden_layers=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(6)  # about 12 likely 3-token outcomes
    draft = make_draft(target, draft_vocab=3, seed=6)  # target token 1 only by resampling
    with torch.no_grad():
        draft.lm_head.weight.mul_(10)  # a draft distribution far from the target's
    prompt = [1, 3, 0, 2]
    exact = torch.zeros(V, V, V, dtype=torch.float64)
    with torch.no_grad():
        for a, b in product(range(V), repeat=2):
            lp = [torch.log_softmax(target(torch.tensor([prompt + seq])).logits[0, -1].double() / T, -1)
                  for seq in ([], [a], [a, b])]
            exact[a, b] = (lp[0][a] + lp[1][b] + lp[2]).exp()
    tr, dr = TargetRunner(target, [0, 1, 2]), Eagle3Proposer(draft)
    s = SpecSettings(method, chain_tokens=2, tree_top_k=2, tree_depth=2, tree_total_tokens=4,
                     temperature=T, max_new_tokens=3)
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(V, V, V, dtype=torch.float64)
    accepted = []
    for _ in range(runs):
        g = speculative_generate(tr, dr, prompt, s, generator=gen)
        counts[tuple(g.tokens)] += 1
        accepted.append(g.accepted[0])
    assert 0.2 * runs < sum(a > 0 for a in accepted) < runs  # both accept and reject paths ran
    expected = runs * exact
    cells = expected >= 5
    chi2 = float(((counts - expected) ** 2 / expected)[cells].sum())
    assert int(cells.sum()) >= 15
    assert chi2 < 60, f"chi2 {chi2:.1f} over {int(cells.sum())} cells"  # 23 dof: p ~ 5e-5 at 60
    assert 0.5 * float((counts / runs - exact).abs().sum()) < 0.2


# ---- transformers API detection ---------------------------------------------------------------


class _NewStyle(torch.nn.Module):
    """Forwards through the real model; takes the cache as `cache` (transformers 5.24)."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    @property
    def model(self):
        return self.inner.model

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None,
                logits_to_keep=0):
        kw = {cache_kwarg(self.inner): cache}
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=use_cache, logits_to_keep=logits_to_keep, **kw)


class _OldStyle(_NewStyle):
    """The same, taking the cache as `past_key_values` (transformers 5.17)."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None):
        return super().forward(input_ids, attention_mask, position_ids, cache=past_key_values, use_cache=use_cache)


def test_cache_kwarg_detection(target):
    assert cache_kwarg(_NewStyle(target)) == "cache"
    assert cache_kwarg(_OldStyle(target)) == "past_key_values"

    class Neither(torch.nn.Module):
        def forward(self, input_ids, kv=None):
            return input_ids

    with pytest.raises(TypeError, match="neither"):
        cache_kwarg(Neither())
    import inspect

    real = inspect.signature(type(target).forward).parameters
    assert cache_kwarg(target) in real
    # both calling conventions decode losslessly through the detected keyword
    base = plain_generate(TargetRunner(target, AUX), PROMPT, 16).tokens
    for wrapped in (_NewStyle(target), _OldStyle(target)):
        tr = TargetRunner(wrapped, AUX)
        assert tr.logits_to_keep == (type(wrapped) is _NewStyle)
        g = speculative_generate(tr, Eagle3Proposer(make_draft(target)), PROMPT, SpecSettings("tree", 3, 3, 3, 8, 0.0, 16))
        assert g.tokens == base


def test_tree_is_chain_helper():
    assert chain_tree(5, [1, 2, 3]).is_chain()
    assert chain_tree(5, [1, 2, 3]).depths == [0, 1, 2, 3]
    assert not Tree([1, 2, 3], [-1, 0, 0], [0, 1, 1]).is_chain()


# ---- the eval stage ---------------------------------------------------------------------------


def _eval_setup(tmp_path):
    from eaglet.config import Config
    from eaglet.context import StageContext
    from eaglet.formats.prepared import PreparedWriter
    from eaglet.testing.tiny import save_target
    from eaglet.formats.draft import FINAL_DIR, save_final

    target_dir = save_target(tmp_path / "target", num_hidden_layers=6)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    rng = np.random.default_rng(0)
    w = PreparedWriter(tmp_path / "prepare", ["data.jsonl"])
    for i in range(8):
        n, start = int(rng.integers(20, 30)), int(rng.integers(5, 12))
        w.add(rng.integers(20, 400, n), [0] * start + [1] * (n - start), 0, i)
    w.close()
    draft = make_draft(target, 300)
    save_final(tmp_path / "train" / FINAL_DIR, draft.state_dict(), draft.config, [1, 3, 4], "eagle3")
    cfg = Config()
    cfg.target.path = str(target_dir)
    cfg.train.eval_fraction = 0.5
    cfg.eval.num_prompts = 3
    cfg.eval.max_new_tokens = 12
    cfg.eval.method = "tree"
    cfg.eval.tree_top_k, cfg.eval.tree_depth, cfg.eval.tree_total_tokens = 3, 3, 8
    cfg.eval.device = "cpu"
    out = tmp_path / "eval"
    out.mkdir()
    ctx = StageContext("eval", out, tmp_path, "h", {"prepare": tmp_path / "prepare", "train": tmp_path / "train"})
    return cfg, ctx


def test_run_eval_writes_report_and_fails_on_a_lossless_mismatch(tmp_path, monkeypatch):
    from eaglet.evaluation import decoding
    from eaglet.stages import evaluate
    from eaglet.formats.prepared import PreparedData
    from eaglet.training.data import split_ids

    cfg, ctx = _eval_setup(tmp_path)
    stats = evaluate.run_eval(cfg, ctx)
    report = json.loads((ctx.out_dir / "eval.json").read_text())
    assert (ctx.out_dir / "eval.png").read_bytes()[:4] == b"\x89PNG"
    assert stats["lossless"] is True and report["aggregate"]["lossless"] is True
    assert stats["num_prompts"] == 3 and report["settings"]["dtype"] == "float32"
    # prompts: held-out ids in order, each cut before its first loss-masked token
    data = PreparedData(ctx.upstream["prepare"])
    held = split_ids(data.sample_ids, 0.5, cfg.run.seed)[1][:3].tolist()
    assert [r["sample_id"] for r in report["prompts"]] == held
    for r in report["prompts"]:
        s = data[r["sample_id"]]
        assert r["prompt_tokens"] == int(np.flatnonzero(s.loss_mask)[0])
        assert r["new_tokens"] <= 12 and r["tau"] >= 1
    agg = report["aggregate"]
    assert agg["verify_forwards"] == sum(r["verify_forwards"] for r in report["prompts"])
    assert len(agg["acceptance_rate"]) == 3 and agg["tau_ceiling"] == 4

    real = decoding.speculative_generate

    def corrupt(*args, **kwargs):  # a decoder that gets token 4 wrong
        g = real(*args, **kwargs)
        g.tokens[4] = (g.tokens[4] + 1) % 512
        return g

    monkeypatch.setattr(decoding, "speculative_generate", corrupt)
    with pytest.raises(evaluate.LosslessError, match=r"prompt 1 \(sample \d+\) at new token 4"):
        evaluate.run_eval(cfg, ctx)
    report = json.loads((ctx.out_dir / "eval.json").read_text())
    assert report["aggregate"]["lossless"] is False
    assert [m["position"] for m in report["aggregate"]["mismatches"]] == [4, 4, 4]


class _Bars:
    """A stand-in for tqdm that records every bar eval opens: its total, updates and postfixes."""

    made: list[_Bars] = []

    def __init__(self, total=0, desc="", **kwargs):
        self.total, self.desc, self.updates, self.postfix, self.closed = total, desc, [], {}, False
        _Bars.made.append(self)

    def update(self, n):
        self.updates.append(n)

    def reset(self, total=None):
        self.updates, self.total = [], self.total if total is None else total

    def set_postfix(self, postfix, refresh=True):
        self.postfix = dict(postfix)

    def close(self):
        self.closed = True

    @classmethod
    def write(cls, line, file=None):
        pass


def test_eval_feeds_a_bar_as_it_decodes_in_every_phase(tmp_path, monkeypatch):
    """The trained draft's decoding and the untrained reference each feed a bar as tokens are
    committed: the updates sum to the tokens produced (speculative and plain; the reference's
    continuations), the total ends equal to them (an EOS takes what it leaves undecoded off), and
    the postfix ends at the last prompt."""
    from eaglet.evaluation import progress
    from eaglet.stages import evaluate

    _Bars.made = []
    monkeypatch.setattr(progress, "tqdm", _Bars)
    cfg, ctx = _eval_setup(tmp_path)
    cfg.eval.reference_prompts = 2
    evaluate.run_eval(cfg, ctx)
    report = json.loads((ctx.out_dir / "eval.json").read_text())
    main, ref = _Bars.made
    assert (main.desc, ref.desc) == ("eval", "eval, untrained draft") and main.closed and ref.closed
    produced = sum(r["new_tokens"] + r["baseline_new_tokens"] for r in report["prompts"])
    assert sum(main.updates) == produced == main.total
    assert len(main.updates) > 2 * len(report["prompts"])  # as decoding goes, not once a prompt
    assert main.postfix["prompt"] == "3/3" and main.postfix["lossless"] == "3/3"
    k = cfg.eval.tree_depth
    assert sum(ref.updates) == 2 * (cfg.eval.max_new_tokens + k) == ref.total  # 2 prompts' continuations
    assert len(ref.updates) == cfg.eval.max_new_tokens + k and ref.postfix["prompts"] == "1-2/2"
    # eval.json: the untrained draft's tau per prompt (the plot's bars beside the trained ones), the prompt count
    assert [p["item"] for p in report["reference"]["prompts"]] == [r["item"] for r in report["prompts"][:2]]
    assert all(p["tau"] >= 1 for p in report["reference"]["prompts"])
    assert report["prompt_count"]["asked"] == report["prompt_count"]["used"] == 3


def test_an_eos_takes_what_it_leaves_undecoded_off_the_bar(target, monkeypatch):
    from eaglet.config import EvalSection
    from eaglet.evaluation import inprocess, progress

    _Bars.made = []
    monkeypatch.setattr(progress, "tqdm", _Bars)
    tr = TargetRunner(target, AUX)
    eos = plain_generate(tr, PROMPT, 20).tokens[5]
    ecfg = EvalSection(method="chain", chain_tokens=3, max_new_tokens=20, device="cpu")
    res = inprocess.evaluate_draft(target, None, make_draft(target, 300), AUX, [PROMPT, PROMPT[:-3]], ecfg,
                                   eos_token_ids=[eos])
    bar, = _Bars.made
    produced = sum(r["new_tokens"] + r["baseline_new_tokens"] for r in res["prompts"])
    assert produced < 2 * 2 * 20 and res["prompts"][0]["new_tokens"] <= 6  # the EOS stopped them early
    assert sum(bar.updates) == produced == bar.total and bar.postfix["prompt"] == "2/2"


def test_heldout_prompts_are_each_evaluated_once(tmp_path):
    """Conversations that open with the assistant's turn all cut to the same bare system
    prompt: the held-out set takes it once, then goes on to distinct prompts."""
    from eaglet.formats.prepared import PreparedData, PreparedWriter
    from eaglet.formats.eval_sets import SkippedPrompts, prompt_count
    from eaglet.evaluation.inputs import heldout_prompts, heldout_selection

    w = PreparedWriter(tmp_path, ["data.jsonl"])
    bare = [1, 5, 6, 7]  # the template's system prompt, then the assistant's turn at once
    for k in range(40):
        prompt = bare if k % 2 == 0 else [*bare, 20 + k, 21 + k]
        reply = [100 + k, 101 + k, 2]
        w.add(prompt + reply, [0] * len(prompt) + [1] * len(reply), 0, k)
    w.close()
    data = PreparedData(tmp_path)
    got = heldout_prompts(data, data.sample_ids, 0.5, 0, 8)
    prompts = [tuple(p) for _, p in got]
    assert len(prompts) == 8 == len(set(prompts))
    assert prompts.count(tuple(bare)) == 1
    every = heldout_prompts(data, data.sample_ids, 0.5, 0, 1000)  # all 20 held out
    assert sum(sid % 2 == 0 for sid, _ in every) == 1 and len(every) > 5
    # the count of what was passed over, and why fewer than asked, as eval.json and the summary say it
    got, counts = heldout_selection(data, data.sample_ids, 0.5, 0, 1000)
    assert got == every and counts == {"held_out": 20, "duplicates": 20 - len(every), "no_prompt": 0, "missing": 0}
    note = prompt_count("heldout", 1000, len(every), SkippedPrompts(), counts)["note"]
    assert note == f"1000 asked; train.eval_fraction holds out 20 samples: {20 - len(every)} were duplicates of others"
    assert prompt_count("heldout", len(every), len(every), SkippedPrompts(), counts)["note"] is None


def test_timed_decoding_splits_the_seconds_by_phase_and_changes_nothing(target):
    tr = TargetRunner(target, AUX)
    draft = make_draft(target, 300)
    plain = speculative_generate(tr, Eagle3Proposer(draft), PROMPT, CHAIN)
    timed = speculative_generate(tr, Eagle3Proposer(draft), PROMPT, CHAIN, timed=True)
    assert (timed.tokens, timed.accepted) == (plain.tokens, plain.accepted) and plain.phases == {}
    assert set(timed.phases) == {"draft", "verify", "accept", "prefill"}
    assert all(v >= 0 for v in timed.phases.values()) and timed.phases["verify"] > 0
    assert sum(timed.phases.values()) == pytest.approx(timed.seconds)


def test_the_demo_says_where_a_cycle_goes_when_decoding_is_slower():
    from eaglet.demo import cost_lines

    ev = {"tau": 1.2, "speedup": 0.6, "ms_per_cycle": {"draft": 30.0, "verify": 40.0, "accept": 2.0},
          "ms_per_plain_step": 36.0}
    text = "\n".join(cost_lines(ev, 3, "runs/demo"))
    assert "a cycle takes 72 ms for 1.20 tokens, a plain target step 36 ms" in text
    assert "verifying 4 tokens takes 40 ms (1.1 plain steps" in text and "drafting 3 tokens" in text
    assert cost_lines({**ev, "speedup": 1.3}, 3, "x") == [] and cost_lines({"tau": 1.0, "speedup": 0.5}, 3, "x") == []


def test_the_demo_summary_says_why_fewer_prompts_and_gives_the_lossless_verdict(capsys):
    from eaglet.config import load_config
    from eaglet.demo import _print_summary
    from eaglet.formats.eval_sets import SkippedPrompts, prompt_count

    cfg = load_config(None, ["run.dir=/r", "eval.chain_tokens=3", "eval.reference_prompts=8"])
    ev = {"tau": 1.23, "num_prompts": 6, "reference_tau": 1.0, "acceptance_rate": [0.2], "lossless": True,
          "prompt_count": prompt_count("heldout", 8, 6, SkippedPrompts(),
                                       {"held_out": 10, "duplicates": 4, "no_prompt": 0, "missing": 0})}
    _print_summary(cfg, {"run_dir": "/r", "stages": {}, "eval": ev})
    out = capsys.readouterr().out
    assert ("tau (chain of 3, greedy, 6 held-out prompts; 8 asked; train.eval_fraction holds out 10 samples: 4 were "
            "duplicates of others): trained 1.230, untrained 1.000 (on 6 of them)") in out
    assert "lossless: yes, the speculative output equals the target's own greedy output on all 6 prompts" in out
