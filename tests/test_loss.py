"""Teacher targets, the shifted TTT loss (mask moves with the target), accuracies and the
simulated acceptance length, against hand computations and an explicit loop reference."""

import math

import pytest
import torch

from eaglet.draft.eagle3.loss import step_mask, ttt_loss
from eaglet.draft.loss import simulated_acceptance_length, teacher_targets
from eaglet.draft.eagle3.model import DraftConfig, Eagle3Draft

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def vocab_maps(used: list[int], V: int) -> tuple[torch.Tensor, torch.Tensor]:
    d2t = torch.tensor(used) - torch.arange(len(used))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


# ---- teacher ------------------------------------------------------------------------------


def test_teacher_restricts_renormalises_and_flags_out_of_vocab_by_hand():
    V, used = 6, [1, 3, 4]
    d2t, t2d = vocab_maps(used, V)
    W = torch.eye(V, dtype=torch.float64)  # logits = the final state itself
    final = torch.tensor([[[0.0, 2.0, 0.0, 1.0, 0.0, 0.0],    # argmax 1: a draft token
                           [5.0, 0.0, 0.0, 0.0, 1.0, 0.0]]],  # argmax 0: not a draft token
                         dtype=torch.float64)
    probs, in_vocab = teacher_targets(final, W, t2d, d2t)

    def softmax(z):
        e = [math.exp(v) for v in z]
        return [v / sum(e) for v in e]

    torch.testing.assert_close(probs[0, 0], torch.tensor(softmax([2.0, 1.0, 0.0]), dtype=torch.float64))
    torch.testing.assert_close(probs[0, 1], torch.tensor(softmax([0.0, 0.0, 1.0]), dtype=torch.float64))
    assert in_vocab.tolist() == [[True, False]]


def test_teacher_chunked_equals_unchunked():
    g = torch.Generator().manual_seed(0)
    V, H = 50, 16
    used = sorted(torch.randperm(V, generator=g)[:20].tolist())
    d2t, t2d = vocab_maps(used, V)
    final = torch.randn(3, 7, H, generator=g)
    W = torch.randn(V, H, generator=g)
    whole = teacher_targets(final, W, t2d, d2t, chunk=10_000)
    for chunk in (1, 4, 5):
        part = teacher_targets(final, W, t2d, d2t, chunk=chunk)
        torch.testing.assert_close(part[0], whole[0])  # fp32 matmuls of other shapes round differently
        assert torch.equal(part[1], whole[1])
    # against the direct full-vocabulary formula
    logits = final @ W.T
    torch.testing.assert_close(whole[0], logits[..., used].softmax(-1))
    assert torch.equal(whole[1], t2d[logits.argmax(-1)])
    assert 0 < whole[1].sum() < whole[1].numel()  # both cases occur


def test_teacher_over_draft_columns_only_gives_the_same_probs_and_no_mask():
    """train.mask_out_of_vocab false: the teacher computes only the draft vocabulary's rows of
    the LM head; the probabilities are the full-vocabulary path's (pre-norm state, softcap and
    scale included) and no row is flagged out of vocabulary."""
    g = torch.Generator().manual_seed(1)
    V, H = 60, 16
    used = sorted(torch.randperm(V, generator=g)[:25].tolist())
    d2t, t2d = vocab_maps(used, V)
    final = torch.randn(2, 9, H, generator=g) * 3
    W = torch.randn(V, H, generator=g)
    norm = torch.rand(H, generator=g) + 0.5
    for kw in ({}, {"norm_weight_H": norm}, {"logit_scale": 0.5, "logit_softcap": 2.0}):
        full = teacher_targets(final, W, t2d, d2t, chunk=4, **kw)
        draft_only = teacher_targets(final, W, t2d, d2t, chunk=4, full_vocab=False, **kw)
        torch.testing.assert_close(draft_only[0], full[0])
        assert draft_only[1].all() and not full[1].all()  # the full path does flag some rows


def test_teacher_prenorm_flag_applies_the_final_rmsnorm():
    g = torch.Generator().manual_seed(1)
    V, H, eps = 30, 8, 1e-5
    d2t, t2d = vocab_maps(list(range(0, 30, 3)), V)
    final = 5 * torch.randn(2, 4, H, generator=g, dtype=torch.float64)
    W = torch.randn(V, H, generator=g, dtype=torch.float64)
    w = 1 + torch.rand(H, generator=g, dtype=torch.float64)
    normed = w * final / torch.sqrt(final.pow(2).mean(-1, keepdim=True) + eps)
    want = teacher_targets(normed, W, t2d, d2t)
    got = teacher_targets(final, W, t2d, d2t, norm_weight_H=w, norm_eps=eps, chunk=3)
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1])
    assert (teacher_targets(final, W, t2d, d2t)[0] - want[0]).abs().max() > 1e-3


# ---- which (row, step) pairs count ---------------------------------------------------------


def counted(loss_mask, in_vocab, doc_ids, steps):
    """The (row, step) pairs of sample 0 that count."""
    return {
        (t, j) for j in range(steps) for t in step_mask(loss_mask, in_vocab, doc_ids, j)[0].nonzero().flatten().tolist()
    }


def test_loss_mask_shifts_with_the_target():
    """Only tokens 4 and 7 are trained. Step j at row t predicts token t+2+j, so token 4 is
    predicted by rows 2,1,0 at steps 0,1,2 and token 7 by rows 5,4,3,2 at steps 0..3. A loss
    that shifts the target but not the mask (EAGLE issue 317) would count rows 2 and 5 at
    every step."""
    T = 10
    loss_mask = torch.zeros(1, T, dtype=torch.bool)
    loss_mask[0, [4, 7]] = True
    in_vocab = torch.ones(1, T, dtype=torch.bool)
    assert counted(loss_mask, in_vocab, None, 4) == {(2, 0), (5, 0), (1, 1), (4, 1), (0, 2), (3, 2), (2, 3)}
    # the teacher at position t+1+j is out of the draft vocab: that pair drops, nothing else
    in_vocab[0, 6] = False  # the teacher predicting token 7
    assert counted(loss_mask, in_vocab, None, 4) == {(2, 0), (1, 1), (0, 2)}


def test_packed_documents_do_not_predict_across_the_boundary():
    T = 10
    doc = torch.tensor([[0] * 5 + [1] * 5])
    ones = torch.ones(1, T, dtype=torch.bool)
    got = counted(ones, ones, doc, 2)
    assert {t for t, j in got if j == 0} == {0, 1, 2, 5, 6, 7}  # row 3 -> token 5 is doc 1
    assert {t for t, j in got if j == 1} == {0, 1, 5, 6}


def reference_loss(logits_steps, teacher, in_vocab, loss_mask, gamma):
    """Loop over (row, step) with the alignment written out; -sum p log_softmax(z)."""
    B, T, _ = teacher.shape
    losses, accs = [], []
    for j, logits in enumerate(logits_steps):
        ce, hits, n = 0.0, 0, 0
        for b in range(B):
            for t in range(T):
                if t + 2 + j < T and loss_mask[b, t + 2 + j] and in_vocab[b, t + 1 + j]:
                    p = teacher[b, t + 1 + j]
                    ce += float(-(p * logits[b, t].detach().log_softmax(-1)).sum())
                    hits += int(logits[b, t].argmax() == p.argmax())
                    n += 1
        losses.append(ce / max(n, 1))
        accs.append(hits / max(n, 1))
    return sum(gamma**j * x for j, x in enumerate(losses)), losses, accs


def test_ttt_loss_matches_the_loop_reference_and_gradients_stay_on_counted_rows():
    g = torch.Generator().manual_seed(2)
    B, T, N, steps = 2, 12, 7, 3
    teacher = torch.randn(B, T, N, generator=g, dtype=torch.float64).softmax(-1)
    in_vocab = torch.rand(B, T, generator=g) > 0.2
    loss_mask = torch.rand(B, T, generator=g) > 0.3
    logits = [torch.randn(B, T, N, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
    # plant agreement on some rows so the accuracy is not trivially zero
    with torch.no_grad():
        for j, lg in enumerate(logits):
            lg[:, : T // 2 - j] += 10 * teacher[:, 1 + j : 1 + j + T // 2 - j]
    out = ttt_loss(iter(logits), teacher, in_vocab, loss_mask, gamma=0.8)
    want_total, want_losses, want_accs = reference_loss(logits, teacher, in_vocab, loss_mask, 0.8)
    assert float(out.total.detach()) == pytest.approx(want_total, rel=1e-12)
    assert [float(x.detach()) for x in out.losses] == pytest.approx(want_losses, rel=1e-12)
    assert [float(a) for a in out.accs()] == pytest.approx(want_accs, rel=1e-6)
    assert 0 < min(want_accs) and max(want_accs) < 1
    out.total.backward()
    for j, lg in enumerate(logits):
        live = torch.zeros(B, T, dtype=torch.bool)
        live[:, : T - 2 - j] = step_mask(loss_mask, in_vocab, None, j)
        assert torch.all(lg.grad[~live] == 0) and torch.all(lg.grad[live].abs().sum(-1) > 0)


def test_ttt_loss_consumes_the_draft_generator():
    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=16, target_hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=8, intermediate_size=32, vocab_size=40, draft_vocab_size=20)
    m = Eagle3Draft(cfg)
    B, T = 2, 9
    aux, ids = torch.randn(B, T, 48), torch.randint(0, 40, (B, T))
    teacher = torch.randn(B, T, 20).softmax(-1)
    ones = torch.ones(B, T, dtype=torch.bool)
    out = ttt_loss(m.ttt_steps(aux, ids, num_steps=3), teacher, ones, ones)
    assert [int(n) for n in out.counts] == [B * (T - 2), B * (T - 3), B * (T - 4)]
    out.total.backward()
    assert m.fc.weight.grad is not None and m.embed_tokens.weight.grad is None


def test_simulated_acceptance_length():
    assert simulated_acceptance_length([]) == 1.0
    assert simulated_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert simulated_acceptance_length([0.5, 0.5]) == pytest.approx(1.75)
    assert simulated_acceptance_length([0.8, 0.5, 0.0, 0.9]) == pytest.approx(1 + 0.8 + 0.4)


def reference_accept_terms(logits, teacher, in_vocab, loss_mask, kind, gamma, w):
    """(per step the mean acceptance term, the total with the soft CE), differentiable, written
    row by row: 1 - alpha = TV(p, q) = 0.5 * sum |p - q|; 'log_accept': -log(1 - TV)."""
    B, T, _ = teacher.shape
    terms, total = [], 0.0
    for j, lg in enumerate(logits):
        ce, acc, n = 0.0, 0.0, 0
        for b in range(B):
            for t in range(T):
                if t + 2 + j < T and loss_mask[b, t + 2 + j] and in_vocab[b, t + 1 + j]:
                    p = teacher[b, t + 1 + j]
                    ce = ce - (p * lg[b, t].log_softmax(-1)).sum()
                    tv = 0.5 * (p - lg[b, t].softmax(-1)).abs().sum()
                    acc = acc + (tv if kind == "tv" else -torch.log(1 - tv))
                    n += 1
        terms.append(acc / n)
        total = total + gamma**j * (ce / n + w * acc / n)
    return terms, total


@pytest.mark.parametrize("kind", ["tv", "log_accept"])
def test_acceptance_terms_against_the_total_variation_written_out(kind):
    """train.accept_loss: each step adds w * mean(1 - alpha) or w * mean(-log alpha), where
    1 - alpha is the total variation 0.5 * sum |p - q| (written out here, row by row); the soft
    CE per step is unchanged; the rows path (head_rows) gives the same total; the gradients of
    each step's term and of the total are autograd's through those formulas written out, and
    reach the counted rows only."""
    from eaglet.draft.eagle3.loss import head_rows

    g = torch.Generator().manual_seed(5)
    B, T, N, steps, w = 2, 11, 6, 3, 0.7
    teacher = torch.randn(B, T, N, generator=g, dtype=torch.float64).softmax(-1)
    in_vocab = torch.rand(B, T, generator=g) > 0.2
    loss_mask = torch.rand(B, T, generator=g) > 0.3
    logits = [torch.randn(B, T, N, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
    out = ttt_loss(iter(logits), teacher, in_vocab, loss_mask, gamma=0.8, accept_loss=kind, accept_weight=w)
    base_total, base_losses, _ = reference_loss(logits, teacher, in_vocab, loss_mask, 0.8)
    want = base_total
    for j, lg in enumerate(logits):
        terms = []
        for b in range(B):
            for t in range(T):
                if t + 2 + j < T and loss_mask[b, t + 2 + j] and in_vocab[b, t + 1 + j]:
                    tv = 0.5 * float((teacher[b, t + 1 + j] - lg[b, t].detach().softmax(-1)).abs().sum())
                    terms.append(tv if kind == "tv" else -math.log(1 - tv))
        want += 0.8**j * w * sum(terms) / len(terms)
        assert float(out.accept[j].detach()) == pytest.approx(sum(terms) / len(terms), rel=1e-10)
    assert float(out.total.detach()) == pytest.approx(want, rel=1e-10)
    assert [float(x.detach()) for x in out.losses] == pytest.approx(base_losses, rel=1e-12)
    # the gradients: of each step's term alone and of the total, against autograd through the
    # plain formulas (the total variation 0.5 * sum |p - q|, a log-softmax cross-entropy)
    ref_logits = [lg.detach().clone().requires_grad_() for lg in logits]
    ref_terms, ref_total = reference_accept_terms(ref_logits, teacher, in_vocab, loss_mask, kind, 0.8, w)
    for j in range(steps):
        assert out.accept[j].requires_grad, f"step {j}: the acceptance term has no gradient"
        got_g, = torch.autograd.grad(out.accept[j], logits[j], retain_graph=True)
        want_g, = torch.autograd.grad(ref_terms[j], ref_logits[j], retain_graph=True)
        assert want_g.abs().max() > 1e-3  # a gradient worth comparing
        torch.testing.assert_close(got_g, want_g, rtol=1e-9, atol=1e-12)
    got_g = torch.autograd.grad(out.total, logits, retain_graph=True)
    want_g = torch.autograd.grad(ref_total, ref_logits)
    for a, b in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    out.total.backward()
    for j, lg in enumerate(logits):
        live = torch.zeros(B, T, dtype=torch.bool)
        live[:, : T - 2 - j] = step_mask(loss_mask, in_vocab, None, j)
        assert torch.all(lg.grad[~live] == 0) and torch.all(lg.grad[live].abs().sum(-1) > 0)
    # the rows path: each step's logits of head_rows only
    rows = head_rows(loss_mask, None, steps)
    sub = [lg.detach().flatten(0, 1)[r][None] for lg, r in zip(logits, rows)]
    got = ttt_loss(iter(sub), teacher, in_vocab, loss_mask, gamma=0.8, head_rows=rows, accept_loss=kind,
                   accept_weight=w)
    assert float(got.total) == pytest.approx(want, rel=1e-10)


def test_state_noise_scales_with_each_states_own_rms():
    from eaglet.draft.loss import noisy_states

    g = torch.Generator().manual_seed(0)
    H, n = 64, 4000
    low, high = torch.randn(1, n, H, generator=g), 50 * torch.randn(1, n, H, generator=g)
    aux = torch.cat([low, high], dim=-1)
    torch.manual_seed(1)
    noisy = noisy_states(aux, 2, 0.1)
    d = (noisy - aux).unflatten(-1, (2, H))
    rms = aux.unflatten(-1, (2, H)).pow(2).mean(-1, keepdim=True).sqrt()
    ratio = (d / rms).std(dim=(0, 1, 3))  # the noise over each state's RMS, per state
    assert ratio.tolist() == pytest.approx([0.1, 0.1], rel=0.02)
    assert torch.equal(noisy_states(aux, 2, 0.0), aux)
