"""The training step's fast paths against their eager references (CPU).

- chunked_soft_ce (eaglet's eager loss) gives the reference formula's loss, accuracy and
  gradient bit for bit, and keeps less for backward;
- teacher_targets without an fp32 copy of the full-vocabulary logits gives what the
  former formula (kept here as the reference) gives, bit for bit;
- merge_diagonal_stacked (the compiled path's merge) matches _merge_diagonal and the dense
  reference attention;
- compile_draft + the compiled soft CE: the same losses and gradients as eager, one graph
  per piece whatever the TTT step (torch.compile's "eager" backend: dynamo's capture and
  guards, fast; set EAGLET_PERF_FULL=1 to also run inductor's generated code, which
  takes about a minute to compile on a 2-core CPU the first time, seconds from its cache);
- one micro-batch's forward and backward runs no op that makes the host wait for the device.
"""

import collections
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import eaglet.loss as loss_mod
from eaglet.config import TrainSection
from eaglet.loss import chunked_soft_ce, masked_soft_ce, teacher_targets, ttt_loss
from eaglet.model import DraftConfig, Eagle3Draft, _merge_diagonal, compile_draft, merge_diagonal_stacked, ttt_attention
from eaglet.parallel import parallelize
from eaglet.train import Batch, TargetHead, TeacherHead, micro_batch

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = DraftConfig(hidden_size=32, target_hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  intermediate_size=64, vocab_size=300, draft_vocab_size=100)


def _ce_inputs(dtype, L=70, N=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(1, L, N, generator=g) * 3).to(dtype).requires_grad_(True)
    p = torch.softmax(torch.randn(1, L + 3, N, generator=g), -1)[:, 2:2 + L]  # a shifted slice, as in step_loss
    m = torch.rand(1, L, generator=g) > 0.3
    return logits, p, m, p.argmax(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_chunked_soft_ce_is_the_reference_bit_for_bit(dtype):
    logits, p, m, top = _ce_inputs(dtype)
    want = masked_soft_ce(logits, p, m, top)
    (want[0] * 0.37).backward()
    want_grad, logits.grad = logits.grad.clone(), None
    got = chunked_soft_ce(logits, p, m, top, chunk=16)  # several chunks and a short last one
    (got[0] * 0.37).backward()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(logits.grad, want_grad)


@pytest.mark.parametrize("how", ["chunked", "reference", "compiled"])
def test_soft_ce_takes_the_steps_rows_from_the_whole_logits(how):
    """A step's loss gets the step's whole logits [B, T, N] and uses the first L rows: the
    values and gradient of the reference on the slice, zeros for the rows past L, and (eager)
    the gradient written once, not by autograd's slice backward into a full-size zero tensor."""
    g = torch.Generator().manual_seed(3)
    B, T, L, N = 2, 30, 26, 17
    logits = (torch.randn(B, T, N, generator=g) * 3).requires_grad_(True)
    p = torch.softmax(torch.randn(B, L, N, generator=g), -1)
    m = torch.rand(B, L, generator=g) > 0.3
    top = p.argmax(-1)
    sliced = logits.detach()[:, :L].clone().requires_grad_(True)
    want = masked_soft_ce(sliced, p, m, top)
    want[0].backward()
    fn = {"chunked": lambda *a: chunked_soft_ce(*a, chunk=7), "reference": masked_soft_ce,
          "compiled": torch.compile(masked_soft_ce, backend="aot_eager")}[how]
    got = fn(logits, p, m, top)
    seen = []

    class Slices(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Slices():
        got[0].backward()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.grad[:, :L], sliced.grad, rtol=1e-6, atol=1e-7)
    assert torch.equal(logits.grad[:, L:], torch.zeros(B, T - L, N))
    if how == "chunked":
        assert "aten.slice_backward" not in seen, seen
    torch._dynamo.reset()


def _saved_bytes(fn):
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved[0]


def test_chunked_soft_ce_keeps_no_fp32_copy_of_bf16_logits():
    logits, p, m, top = _ce_inputs(torch.bfloat16, L=64, N=1000)
    ref = _saved_bytes(lambda: masked_soft_ce(logits, p, m, top))
    got = _saved_bytes(lambda: chunked_soft_ce(logits, p, m, top))
    fp32_copy = logits.numel() * 4
    assert ref >= fp32_copy  # autograd on the formula keeps float(logits) for logsumexp's backward
    # chunked: the bf16 logits (2 bytes each) and a row lse, plus the teacher slice that both keep
    assert got <= ref - fp32_copy // 2


def _old_teacher_targets(final, W, t2d, d2t, chunk=512, logit_scale=1.0, logit_softcap=None):
    """teacher_targets as it was: fp32 logits over the whole vocabulary, then argmax and gather."""
    B, T, H = final.shape
    x_NH = final.reshape(B * T, H)
    cols = torch.arange(d2t.numel()) + d2t
    probs, in_vocab = [], []
    for a in range(0, B * T, chunk):
        logits = (x_NH[a:a + chunk].to(W.dtype) @ W.T).float()
        if logit_scale != 1.0:
            logits = logits * logit_scale
        if logit_softcap:
            logits = torch.tanh(logits / logit_softcap) * logit_softcap
        in_vocab.append(t2d[logits.argmax(-1)])
        probs.append(logits[:, cols].softmax(-1))
    return torch.cat(probs).view(B, T, -1), torch.cat(in_vocab).view(B, T)


@pytest.mark.parametrize("dtype,scale,softcap", [(torch.bfloat16, 1.0, None), (torch.float32, 1.0, None),
                                                 (torch.bfloat16, 0.5, None), (torch.bfloat16, 1.0, 3.0)])
def test_teacher_targets_is_the_former_formula_bit_for_bit(dtype, scale, softcap):
    g = torch.Generator().manual_seed(3)
    V, N, H = 300, 100, 32
    W = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    final = torch.randn(2, 37, H, generator=g).to(dtype)
    used = torch.sort(torch.randperm(V, generator=g)[:N]).values
    d2t = used - torch.arange(N)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    final[0, :5] = final[0, 5]  # repeated rows, and bf16 ties between columns are common at this scale
    want = _old_teacher_targets(final, W, t2d, d2t, chunk=16, logit_scale=scale, logit_softcap=softcap)
    got = teacher_targets(final, W, t2d, d2t, chunk=16, logit_scale=scale, logit_softcap=softcap)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert 0 < int(got[1].sum()) < got[1].numel()  # both kinds of rows occur


def _qkv(T=24, J=4, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, T, 8, generator=g, dtype=dtype)
    ks = [torch.randn(2, 2, T, 8, generator=g, dtype=dtype) for _ in range(J)]
    vs = [torch.randn(2, 2, T, 8, generator=g, dtype=dtype) for _ in range(J)]
    return q, ks, vs


def test_merge_diagonal_stacked_matches_the_reference():
    q, ks, vs = _qkv()
    g = torch.Generator().manual_seed(1)
    out0, lse0 = torch.randn(2, 4, 24, 8, generator=g), torch.randn(2, 4, 24, generator=g)
    want = _merge_diagonal(q, out0, lse0, ks[1:], vs[1:], 8 ** -0.5)
    got = merge_diagonal_stacked(q, out0, lse0, torch.stack(ks[1:]), torch.stack(vs[1:]), 8 ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # and through ttt_attention, against the dense-mask reference, with documents
    q, ks, vs = _qkv(dtype=torch.float64)
    doc = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    dense = ttt_attention(q, ks, vs, "naive", doc_ids_BT=doc)
    stacked = ttt_attention(q, ks, vs, "chunked", doc_ids_BT=doc, chunk=7, merge=merge_diagonal_stacked)
    torch.testing.assert_close(stacked, dense, rtol=1e-10, atol=1e-10)


def _tiny_inputs(T=40, seed=1):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, T, 3 * CFG.target_hidden_size, generator=g)
    ids = torch.randint(0, CFG.vocab_size, (1, T), generator=g)
    pos, doc = (torch.arange(T) % 20)[None], (torch.arange(T) // 20)[None]
    final = torch.randn(1, T, CFG.target_hidden_size, generator=g)
    W = torch.randn(CFG.vocab_size, CFG.target_hidden_size, generator=g)
    return aux, ids, pos, doc, final, W


def _loss_and_grads(model, compiled=False, steps=4, T=40, bf16=False):
    """The TTT loss and gradients; bf16: the forward under CPU bf16 autocast (as training runs on a GPU)."""
    aux, ids, pos, doc, final, W = _tiny_inputs(T)
    teacher, in_vocab = teacher_targets(final, W, model.t2d, model.d2t)
    mask = torch.ones(1, T, dtype=torch.bool)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = ttt_loss(model(aux, ids, pos, doc, num_steps=steps, attn_impl="chunked"), teacher, in_vocab, mask, doc,
                       compiled=compiled)
    model.zero_grad(set_to_none=True)
    out.total.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_compiled(backend, monkeypatch, steps=4):
    graphs = collections.Counter()

    def counting(gm, example_inputs):  # a backend that counts the graphs dynamo hands it
        graphs["n"] += 1
        return gm.forward

    kw = {"backend": counting} if backend == "count" else {"backend": backend}
    torch.manual_seed(0)
    ref = Eagle3Draft(CFG)
    comp = Eagle3Draft(CFG)
    comp.load_state_dict(ref.state_dict())
    compile_draft(comp, **kw)
    monkeypatch.setattr(loss_mod, "_compiled_soft_ce", torch.compile(masked_soft_ce, **kw))
    want, want_g = _loss_and_grads(ref, False, steps)
    got, got_g = _loss_and_grads(comp, True, steps)
    torch.testing.assert_close(got.total, want.total, rtol=1e-6, atol=1e-6)
    for a, b in zip(got.losses + got.correct + got.counts, want.losses + want.correct + want.counts):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert got_g.keys() == want_g.keys()
    for k in want_g:
        torch.testing.assert_close(got_g[k], want_g[k], rtol=1e-5, atol=1e-5 * want_g[k].abs().max().item())
    return graphs, comp


def test_compile_draft_matches_eager_one_graph_per_piece(monkeypatch):
    torch._dynamo.reset()
    graphs, comp = _check_compiled("count", monkeypatch, steps=4)
    # attn_inputs, attn_output, head: one graph each for every step; the merge and the soft
    # CE, whose sizes change with the step, two each (the second with dynamic sizes)
    assert graphs["n"] == 3 + 2 + 2
    _loss_and_grads(comp, True, steps=4)  # the next micro-batch of the same shape compiles nothing
    assert graphs["n"] == 3 + 2 + 2
    torch._dynamo.reset()


def _linear_weight_shapes(model):
    return {tuple(m.weight.shape) for m in [*model.layers.modules(), model.lm_head] if isinstance(m, torch.nn.Linear)}


def test_unroll_casts_each_linear_weight_once(monkeypatch):
    """Under autocast the TTT unroll casts each linear weight once (Eagle3Draft.cast_weights)
    and every step uses that copy. Eager: exactly the loss and gradients of autocast's own
    cached casts. Compiled: no piece's graph takes an fp32 linear weight, which it would cast
    again at every step and whose gradient it would hand back in fp32 at every step (the
    memory-bound cost this removes); with the casts turned off the same check sees them."""
    torch.manual_seed(0)
    model = Eagle3Draft(CFG)
    got, got_g = _loss_and_grads(model, bf16=True)
    with monkeypatch.context() as m:
        m.setattr(model, "cast_weights", lambda dtype: None)  # autocast casts inside each product, cached
        want, want_g = _loss_and_grads(model, bf16=True)
    assert torch.equal(got.total, want.total)
    assert got_g.keys() == want_g.keys() and all(torch.equal(got_g[k], want_g[k]) for k in want_g)
    assert all(g.dtype == torch.float32 for g in got_g.values())

    shapes = _linear_weight_shapes(model)

    def fp32_weights_taken(cast):
        torch._dynamo.reset()
        seen = []

        def backend(gm, example_inputs):
            seen.extend(x for x in example_inputs if isinstance(x, torch.Tensor))
            return gm.forward

        comp = Eagle3Draft(CFG)
        comp.load_state_dict(model.state_dict())
        if not cast:
            comp.cast_weights = lambda dtype: None
        compile_draft(comp, backend=backend)
        out, grads = _loss_and_grads(comp, bf16=True)
        torch._dynamo.reset()
        return sum(x.dtype == torch.float32 and tuple(x.shape) in shapes for x in seen), out, grads

    n, out, grads = fp32_weights_taken(cast=True)
    assert n == 0
    torch.testing.assert_close(out.total, got.total, rtol=1e-5, atol=1e-5)
    for k in got_g:
        torch.testing.assert_close(grads[k], got_g[k], rtol=1e-3, atol=1e-3 * got_g[k].abs().max().item())
    assert fp32_weights_taken(cast=False)[0] > 0


def test_unroll_under_fsdp_casts_only_what_is_whole(tmp_path, monkeypatch):
    """Under FSDP2 (parallelize 'fsdp', one gloo rank here) each decoder layer is a unit of its
    own, sharded when the unroll starts: its products keep autocast's casts (a sharded weight in
    a product fails: "mixed torch.Tensor and DTensor"). lm_head, whole in the root unit's
    forward, is cast once. Loss and gradients are the plain model's."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = Eagle3Draft(CFG)
        want, want_g = _loss_and_grads(plain, bf16=True)
        draft = Eagle3Draft(CFG)
        draft.load_state_dict(plain.state_dict())
        head = TargetHead(lm_head=torch.zeros(CFG.vocab_size, CFG.target_hidden_size), norm=None, norm_eps=1e-6,
                          embed=None)
        par = parallelize(draft, TeacherHead(head, 16), "fsdp", torch.device("cpu"))
        casts = []
        cast = draft.cast_weights
        monkeypatch.setattr(draft, "cast_weights", lambda dtype: casts.append(cast(dtype)) or casts[-1])
        got, got_g = _loss_and_grads(par.module, bf16=True)
        ((layers, lm_head),) = casts
        assert layers == [None] * len(draft.layers) and set(lm_head) == {"lm_head"}
        assert torch.equal(got.total, want.total)
        assert got_g.keys() == want_g.keys()
        assert all(torch.equal(got_g[k].full_tensor(), want_g[k]) for k in want_g)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not os.environ.get("EAGLET_PERF_FULL"), reason="set EAGLET_PERF_FULL=1 (about a minute)")
def test_compile_draft_inductor_matches_eager(monkeypatch):
    torch._dynamo.reset()
    _check_compiled("inductor", monkeypatch, steps=3)
    torch._dynamo.reset()


SYNC_OPS = {"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.masked_select", "aten.unique",
            "aten._unique", "aten._unique2", "aten.unique_consecutive", "aten.is_nonzero", "aten.equal"}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        # boolean-mask indexing syncs too (its output size depends on the mask's contents)
        if str(func.overloadpacket) in ("aten.index", "aten.index_put_", "aten.index_put"):
            idx = args[1] if len(args) > 1 else []
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx):
                self.ops["bool-mask index"] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bf16", [False, True])  # bf16: autocast, the unroll's once-cast weights included
def test_micro_batch_makes_no_host_sync(bf16):
    torch.manual_seed(0)
    T = 64
    draft = Eagle3Draft(CFG)
    aux, ids, pos, doc, final, W = _tiny_inputs(T)
    head = TargetHead(lm_head=W, norm=None, norm_eps=1e-6, embed=None)
    par = parallelize(draft, TeacherHead(head, 16), "none", torch.device("cpu"))
    b = Batch(aux=aux, final=final, input_ids=ids, loss_mask=torch.ones(1, T, dtype=torch.bool), position_ids=pos,
              doc_ids=doc, tokens=T)
    tc = TrainSection(max_tokens=T, ttt_steps=3, attn_impl="chunked", precision="fp32")
    mode = _Ops()
    with mode:
        micro_batch(par, b, tc, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), sync=True)
    assert sum(mode.ops.values()) > 100  # the mode saw the step
    assert not {k: v for k, v in mode.ops.items() if k in SYNC_OPS or k == "bool-mask index"}
