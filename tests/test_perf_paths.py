"""The training step's fast paths against their eager references (CPU).

- chunked_soft_ce (eaglet's eager loss) gives the reference formula's loss, accuracy and
  gradient bit for bit, and keeps less for backward;
- teacher_targets without an fp32 copy of the full-vocabulary logits gives what the
  former formula (kept here as the reference) gives, bit for bit;
- merge_diagonal_stacked (the compiled path's merge) matches _merge_diagonal and the dense
  reference attention;
- the fast unroll (eaglet/draft/eagle3/unroll.py) gives the model's reference_ttt_steps' logits, loss
  and gradients, over every row and over the rows the loss counts (fp64);
- the fast unroll compiled (use_fast_unroll(compile=True)) + the compiled soft CE: the same
  losses and gradients as eager, one graph
  per piece whatever the TTT step (torch.compile's "eager" backend: dynamo's capture and
  guards, fast; set EAGLET_PERF_FULL=1 to also run inductor's generated code, which
  takes about a minute to compile on a 2-core CPU the first time, seconds from its cache);
- one micro-batch's forward and backward runs no op that makes the host wait for the device;
- the compiled flex_attention makes one graph over packed lengths, and a process that has not
  trained compiles it at its first GPU call.
"""

import collections
import copy
import os
import re
import shutil
import subprocess
import sys
import weakref
from functools import partial

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import eaglet.draft.eagle3.attention as attention
import eaglet.draft.compiling as compiling
import eaglet.draft.loss as loss_mod
from eaglet.config import Config, TrainSection
from eaglet.draft.eagle3.loss import ttt_loss
from eaglet.draft.eagle3.training import ACTIVE_ROWS, HEAD_ROWS, step_rows
from eaglet.draft.loss import chunked_soft_ce, masked_soft_ce, teacher_targets
from eaglet.draft.casts import cast_linears, linear
from eaglet.draft.eagle3.model import DecoderLayer, DraftConfig, Eagle3Draft
from eaglet.draft.step import Batch, HostRows, TeacherHead, micro_batch, optimizer_step, send_rows
from eaglet.draft.eagle3.unroll import FastUnroll, use_fast_unroll
from eaglet.draft.eagle3.attention import _merge_diagonal, merge_diagonal_stacked, ttt_attention
from eaglet.draft.parallelize import parallelize

pytestmark = pytest.mark.usefixtures("one_thread")

def device_head_rows(mask, docs, num_steps, device):
    """EAGLE-3's host rows as Batch.rows brings them to the device: (head rows per step, active rows)."""
    rows = send_rows(HostRows.pack(step_rows(mask, docs, num_steps)), device)
    return tuple(rows[HEAD_ROWS.format(j)] for j in range(num_steps)), rows[ACTIVE_ROWS]


CFG = DraftConfig(hidden_size=32, target_hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  intermediate_size=64, vocab_size=300, draft_vocab_size=100)
# The MLA layer's draft (eaglet/draft/eagle3/mla.py): values narrower than keys, a YaRN softmax factor.
MLA = dict(attention="mla", mla_heads=3, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=6, max_position_embeddings=512,
           rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 1.0,
                         "mscale_all_dim": 1.0})
MLA_CFG = DraftConfig(**{**CFG.to_dict(), **MLA})


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
    draft = getattr(model, "module", model)  # DDP's wrapper
    teacher, in_vocab = teacher_targets(final, W, draft.t2d, draft.d2t)
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
    use_fast_unroll(ref)
    use_fast_unroll(comp, compile=True, **kw)
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


def test_compiled_unroll_matches_eager_one_graph_per_piece(monkeypatch):
    torch._dynamo.reset()
    graphs, comp = _check_compiled("count", monkeypatch, steps=4)
    # embed_projection (once per unroll), attn_inputs, attn_output, head, the merge and the
    # soft CE: six functions, each its own graphs, symbolic in the sizes the steps change.
    # Some take a second graph for a size step 0 or 1 pins (the merge's one key step, step
    # 0's identity rows as many as its tokens): never more than two.
    assert 6 <= graphs["n"] <= 2 * 6
    n = graphs["n"]
    _loss_and_grads(comp, True, steps=4)  # the next micro-batch of the same shape compiles nothing
    assert graphs["n"] == n
    torch._dynamo.reset()


def _packed_batch(g, max_tokens, ttt_steps, aux_width, hidden, vocab):
    """A packed micro-batch of random documents (20 to 119 tokens each, up to max_tokens), as
    load_batch makes them, ~60% of the tokens trained."""
    lens = []
    while True:
        n = int(torch.randint(20, 120, (1,), generator=g))
        if sum(lens) + n > max_tokens:
            break
        lens.append(n)
    T = sum(lens)
    docs = torch.cat([torch.full((n,), d) for d, n in enumerate(lens)])[None]
    mask = torch.rand(1, T, generator=g) < 0.6
    rows = send_rows(HostRows.pack(step_rows(mask, docs, ttt_steps)), torch.device("cpu"))
    return Batch(torch.randn(1, T, aux_width, generator=g), torch.randn(1, T, hidden, generator=g),
                 torch.randint(0, vocab, (1, T), generator=g), mask, torch.cat([torch.arange(n) for n in lens])[None],
                 docs, T, lens=tuple(lens), rows=rows)


def _graphs_over_packings(monkeypatch, mark: bool):
    """The trainer's compiled step (parallelize(compile=True), micro_batch) over five packed
    micro-batches whose tokens, documents and trained rows all differ: the graph count after
    each, and the graphs per function. mark: compiling.MARK_DATA_DIMS."""
    made = []

    def counting(gm, example_inputs):  # records the frame (function) and attempt of each graph
        made.append(str(torch._guards.CompileContext.current_compile_id()))
        return gm.forward

    torch._dynamo.reset()
    monkeypatch.setitem(compiling.PIECE_OPTIONS, "backend", counting)
    monkeypatch.setattr(compiling, "MARK_DATA_DIMS", mark)
    monkeypatch.setattr(loss_mod, "_compiled_soft_ce", None)  # made again with the counting backend
    monkeypatch.setattr(loss_mod, "_compiled_accept_term", None)
    cfg = DraftConfig(**{**CFG.to_dict(), "num_layers": 3})
    torch.manual_seed(0)
    model = Eagle3Draft(cfg)
    teacher = TeacherHead(torch.randn(cfg.vocab_size, cfg.target_hidden_size), torch.ones(cfg.target_hidden_size))
    par = parallelize(model, teacher, "none", torch.device("cpu"), compile=True)
    tc = TrainSection(max_tokens=256, ttt_steps=4, attn_impl="chunked")
    g = torch.Generator().manual_seed(1)
    batches = [_packed_batch(g, tc.max_tokens, tc.ttt_steps, 3 * cfg.target_hidden_size, cfg.target_hidden_size,
                             cfg.vocab_size) for _ in range(5)]
    assert len({(b.tokens, len(b.lens), tuple(len(r) for r in b.rows.values())) for b in batches}) == 5
    after = []
    for b in batches:
        micro_batch(par, b, Config(train=tc), torch.autocast("cpu", enabled=False), sync=True)
        model.zero_grad(set_to_none=True)
        after.append(len(made))
    torch._dynamo.reset()
    assert tc.accept_loss == "log_accept"
    return after, collections.Counter(i.split("/")[0] for i in made), cfg.num_layers


def test_varied_packed_micro_batches_compile_in_the_first_one_only(monkeypatch):
    """Over packed micro-batches whose tokens, documents and trained rows all differ, the
    compiled step makes its graphs in the first micro-batch and none after: each piece's data
    dims (unroll.DATA_DIMS, loss.LOSS_DATA_DIMS) are symbolic from its first compile. Without
    the marks (torch.compile's default) the sizes that changed are made symbolic by a second
    round of compiles, in the first micro-batch (step 0 against the later steps' rows) and the
    second. Each of the seven functions (the layers' pieces, the soft cross-entropy and the
    default train.accept_loss's term) keeps its own graphs, a few per layer it runs in, far
    from its recompile limit (past it a function runs eager, as the pieces did when they were
    compiled as partials of one wrapper, whose graphs they shared: 3 functions, 12 graphs in one)."""
    after, per_function, layers = _graphs_over_packings(monkeypatch, mark=True)
    assert after[0] > 0 and after[1:] == [after[0]] * 4, after
    assert len(per_function) == 7 and max(per_function.values()) <= layers, per_function
    unmarked, unmarked_per_function, _ = _graphs_over_packings(monkeypatch, mark=False)
    assert unmarked[0] < unmarked[1] and unmarked[2:] == [unmarked[1]] * 3, unmarked
    assert unmarked[-1] > after[-1] and unmarked_per_function.keys() == per_function.keys()


def test_data_dims_name_the_pieces_arguments_and_the_layers_halves_compile_once():
    """compile_piece refuses data_dims naming no argument of its function, with the name. The
    layers' own halves, compiled for FSDP2 (FastUnroll sharded=True), mark their data dims
    too: a layer's forward at three sequence lengths makes its graphs at the first only."""
    with pytest.raises(TypeError, match=r"\['tokens'\], not arguments of"):
        compiling.compile_piece(lambda x: x, {"tokens": (0,)}, backend="eager")
    made = []

    def counting(gm, example_inputs):
        made.append(1)
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Eagle3Draft(CFG)
    use_fast_unroll(model, compile=True, sharded=True, backend=counting)
    layer, H = model.layers[0], CFG.hidden_size
    counts = []
    for T in (7, 11, 5):
        h, embeds = torch.randn(1, T, H), torch.randn(1, T, H)
        cos, sin = model.rope(torch.arange(T)[None], h.dtype)
        want = DecoderLayer.attn_inputs(layer, h, embeds, cos, sin)
        q, k, v, residual = layer.attn_inputs(h, embeds, cos, sin)
        assert all(torch.allclose(a, b) for a, b in zip((q, k, v, residual), want))
        layer.attn_output(torch.randn(1, CFG.num_attention_heads, T, CFG.head_dim), residual)
        counts.append(len(made))
    torch._dynamo.reset()
    assert counts == [2, 2, 2], counts  # two halves, compiled at the first length only


def _flex_graphs_over_lengths(monkeypatch, options):
    """Graphs eaglet's compiled flex_attention makes over four packed lengths (dynamo's capture
    and guards: the "eager" backend, so CPU tensors stand in for the GPU's)."""
    monkeypatch.setattr(attention, "FLEX_OPTIONS", options)
    monkeypatch.setattr(attention, "_flex_compiled", None)
    made = []

    def counting(gm, example_inputs):
        made.append(1)
        return gm.forward

    torch._dynamo.reset()
    attention.compile_flex_attention(backend=counting)
    counts = []
    for T in (300, 420, 517, 640):  # documents of varying lengths, as packed micro-batches are
        doc = torch.repeat_interleave(torch.arange(3), torch.tensor([T // 3, T // 2, T - T // 3 - T // 2]))[None]
        q, k, v = torch.randn(1, 4, T, 8), torch.randn(1, 2, T, 8), torch.randn(1, 2, T, 8)
        with torch.no_grad():
            attention._flex_compiled(q, k, v, block_mask=attention.ttt_block_mask(doc, T, q.device), scale=0.3,
                                     enable_gqa=True)
        counts.append(len(made))
    torch._dynamo.reset()
    return counts


def test_compiled_flex_attention_compiles_at_the_first_length_only(monkeypatch):
    """The step-0 attention's compiled flex_attention makes its one graph at the first packed
    length: the BlockMask carries the length as plain ints, which fix the length dims even
    when they are marked dynamic, so eaglet compiles it with every size symbolic
    (attention.FLEX_OPTIONS). torch.compile's default compiles again at the second length."""
    assert _flex_graphs_over_lengths(monkeypatch, attention.FLEX_OPTIONS) == [1, 1, 1, 1]
    assert _flex_graphs_over_lengths(monkeypatch, {}) == [1, 2, 2, 2]


def test_flex_attention_on_a_gpu_is_compiled_at_its_first_call(monkeypatch):
    """A process that never trained (eval, replay, decoding) still runs flex_attention compiled on
    a GPU: the first CUDA call compiles it, once, with FLEX_OPTIONS; CPU calls stay eager.
    (Eager flex_attention on a GPU computes the whole score matrix: a replay batch ran out of
    memory so.) A stand-in for a CUDA tensor, since this machine has none."""
    calls = []
    monkeypatch.setattr(attention, "_flex_compiled", None)
    monkeypatch.setattr(attention, "flex_attention", lambda q, *a, **k: ("eager", q))

    def fake_compile(fn, **options):
        calls.append((fn, options))
        return lambda q, *a, **k: ("compiled", q)

    monkeypatch.setattr(attention.torch, "compile", fake_compile)

    class OnGPU:
        is_cuda = True

    cpu, gpu = torch.zeros(1), OnGPU()
    assert attention._flex_attention(cpu)[0] == "eager" and not calls
    assert attention._flex_attention(gpu) == ("compiled", gpu)
    assert attention._flex_attention(gpu) == ("compiled", gpu)
    assert len(calls) == 1 and calls[0][1] == attention.FLEX_OPTIONS and calls[0][1]["dynamic"] is True


def _linear_weight_shapes(model):
    return {tuple(m.weight.shape) for m in [*model.layers.modules(), model.lm_head] if isinstance(m, torch.nn.Linear)}


@pytest.mark.parametrize("cfg", [CFG, MLA_CFG], ids=["dense", "mla"])
def test_unroll_casts_each_linear_weight_once(monkeypatch, cfg):
    """Under autocast the TTT unroll casts each linear weight once (FastUnroll.cast_weights)
    and every step uses that copy. Eager, with autograd summing the steps' gradients
    (accumulate=False): exactly the loss and gradients of autocast's own cached casts. With
    the GEMMs accumulating them (the default): the same loss, the same gradients for all but
    the linear weights, and those within bf16 rounding (one rounding per step instead of two).
    Compiled: no piece's graph takes an fp32 linear weight, which it would cast again at every
    step and whose gradient it would hand back in fp32 at every step (the memory-bound cost
    this removes); with the casts turned off the same check sees them. (The eager part with
    each step making its own layer-0 embedding products: autocast caches the cast of a whole
    weight, not of the column slice that the once-made products take.)"""
    torch.manual_seed(0)
    model = Eagle3Draft(cfg)
    unroll = use_fast_unroll(model, embeds_once=False, casts="per_product")  # autocast casts inside each product
    want, want_g = _loss_and_grads(model, bf16=True)
    unroll.casts = "sum"
    summed, summed_g = _loss_and_grads(model, bf16=True)
    unroll.casts = "accumulate"
    assert torch.equal(summed.total, want.total)
    assert summed_g.keys() == want_g.keys() and all(torch.equal(summed_g[k], want_g[k]) for k in want_g)
    got, got_g = _loss_and_grads(model, bf16=True)
    assert torch.equal(got.total, want.total)
    linear = {n + ".weight" for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)} - {"fc.weight"}
    assert got_g.keys() == want_g.keys() and linear < set(got_g)
    assert all(torch.equal(got_g[k], want_g[k]) for k in set(want_g) - linear)
    for k in linear:
        torch.testing.assert_close(got_g[k], want_g[k], rtol=0, atol=2 ** -7 * want_g[k].abs().max().item())
    assert any(not torch.equal(got_g[k], want_g[k]) for k in linear)  # the accumulating path did run
    assert all(g.dtype == torch.float32 for g in got_g.values())

    shapes = _linear_weight_shapes(model)

    def fp32_weights_taken(cast):
        torch._dynamo.reset()
        seen = []

        def backend(gm, example_inputs):
            seen.extend(x for x in example_inputs if isinstance(x, torch.Tensor))
            return gm.forward

        comp = Eagle3Draft(cfg)
        comp.load_state_dict(model.state_dict())
        # static sizes: which weights the graphs take does not depend on them, and tracing is faster
        use_fast_unroll(comp, compile=True, backend=backend, dynamic=False,
                        casts="accumulate" if cast else "per_product")
        out, grads = _loss_and_grads(comp, bf16=True)
        torch._dynamo.reset()
        return sum(x.dtype == torch.float32 and tuple(x.shape) in shapes for x in seen), out, grads

    unroll.embeds_once = True  # as the compiled drafts below make them
    got, got_g = _loss_and_grads(model, bf16=True)
    n, out, grads = fp32_weights_taken(cast=True)
    assert n == 0
    torch.testing.assert_close(out.total, got.total, rtol=1e-5, atol=1e-5)
    for k in got_g:
        torch.testing.assert_close(grads[k], got_g[k], rtol=1e-3, atol=1e-3 * got_g[k].abs().max().item())
    assert fp32_weights_taken(cast=False)[0] > 0


@pytest.mark.parametrize("bias", [False, True])
def test_accumulating_linear_gives_autograds_gradients(bias):
    """cast_linears' accumulating copies, in a precision where the sums can be compared (fp64
    parameters, fp32 copies): a weight used by three products and a second backward into the
    same .grad (gradient accumulation) give autograd's gradients for input, weight and bias;
    the parameter's post-accumulate hook (DDP's and FSDP's kind) fires once per backward."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 5, bias=bias).double()
    xs = [torch.randn(2, 3, 6, dtype=torch.float64) for _ in range(3)]

    def loss(use):
        h, total = xs[0].requires_grad_(), 0
        for j, x in enumerate(xs):
            y = use(h if j == 0 else x + h[..., :1])
            total = total + (y.square() * (j + 1)).sum()
            h = torch.tanh(y.sum(-1, keepdim=True)).expand_as(x)
        return total

    ref = copy.deepcopy(lin)
    for _ in range(2):
        loss(lambda x: torch.nn.functional.linear(x.float(), ref.weight.float(),
                                                  None if ref.bias is None else ref.bias.float())).backward()
    want_x = xs[0].grad.clone()
    xs[0].grad = None
    hooks = []
    lin.weight.register_post_accumulate_grad_hook(lambda p: hooks.append(p.grad.clone()))
    for _ in range(2):
        w = cast_linears([("proj", lin)], torch.float32)
        assert set(w) == {"proj", "proj.grad", "proj.link"} | ({"proj.bias"} if bias else set())
        loss(lambda x: linear(lin, "proj", x, w)).backward()
    assert len(hooks) == 2
    fp32 = {"rtol": 1e-5, "atol": 1e-5}  # the products run in fp32
    torch.testing.assert_close(xs[0].grad, want_x, **fp32)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, **fp32)
    torch.testing.assert_close(hooks[0] * 2, ref.weight.grad, **fp32)
    if bias:
        torch.testing.assert_close(lin.bias.grad, ref.bias.grad, **fp32)
    with torch.no_grad():  # no gradient, nothing to accumulate: a plain copy
        assert set(cast_linears([("proj", lin)], torch.float32)) == {"proj"} | ({"proj.bias"} if bias else set())


class _Adds(TorchDispatchMode):
    """Counts the elementwise adds whose result has one of `shapes`."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.n = shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func.overloadpacket) in ("aten.add", "aten.add_") and tuple(out.shape) in self.shapes:
            self.n += 1
        return out


def test_unroll_backward_adds_no_weight_sized_gradients(monkeypatch):
    """The point of accumulating in the GEMMs: the backward of a bf16 unroll runs no
    elementwise add as large as a linear weight. Summed by autograd, it runs at least k - 1
    per weight the steps share."""
    torch.manual_seed(0)
    model = Eagle3Draft(CFG)
    unroll = use_fast_unroll(model)
    shapes = _linear_weight_shapes(model)
    steps, shared = 4, sum(isinstance(m, torch.nn.Linear) for m in [*model.layers.modules(), model.lm_head])

    def adds_in_backward():
        aux, ids, pos, doc, final, W = _tiny_inputs(40)
        teacher, in_vocab = teacher_targets(final, W, model.t2d, model.d2t)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ttt_loss(model(aux, ids, pos, doc, num_steps=steps, attn_impl="chunked"), teacher, in_vocab,
                           torch.ones(1, 40, dtype=torch.bool), doc)
        model.zero_grad(set_to_none=True)
        with _Adds(shapes) as mode:
            out.total.backward()
        return mode.n

    assert adds_in_backward() == 0
    unroll.casts = "sum"
    assert adds_in_backward() >= (steps - 1) * shared


@pytest.mark.parametrize("T, steps", [(40, 4), (3, 5)])
def test_unroll_projects_the_embeddings_once(T, steps):
    """Step j's tokens are step 0's shifted j rows on, so the unroll makes layer 0's q/k/v
    products of the token embeddings once and shifts them (FastUnroll.embeds_once). In fp64:
    every row's logits (the rows past the end included, also with more steps than rows) and
    every gradient of the per-step reference, over two layers with q/k/v biases, two samples
    and packed documents; and the forward and backward run exactly 3 (k - 1) fewer
    [B*T, H] x [H, q+k+v] products' worth of FLOPs. Under bf16 autocast, with the GEMMs
    accumulating the weight gradients: the loss and each gradient as close to the fp64 ones as
    the per-step products' are."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = DraftConfig(**{**CFG.to_dict(), "num_layers": 2, "attention_bias": True})
    torch.manual_seed(0)
    model = Eagle3Draft(cfg).double()
    for p in model.parameters():  # biases and norm weights away from their zero / one inits
        torch.nn.init.normal_(p, 0.0 if p.ndim > 1 else 1.0, 0.1 if p.ndim > 1 else 0.3)
    unroll = use_fast_unroll(model)
    g = torch.Generator().manual_seed(2)
    aux = torch.randn(2, T, 3 * cfg.target_hidden_size, generator=g, dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (2, T), generator=g)
    pos, doc = (torch.arange(T) % 20).expand(2, T), (torch.arange(T) // 20).expand(2, T)

    def run(once, bf16=False):
        unroll.embeds_once = once
        model.zero_grad(set_to_none=True)
        with FlopCounterMode(display=False) as flops, torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            logits = model(aux.to(next(model.parameters()).dtype), ids, pos, doc, num_steps=steps,
                           attn_impl="chunked")
            loss = sum((x.double().log_softmax(-1)[..., :5].sum(-1) * x.new_tensor(range(T))).mean() * (j + 1)
                       for j, x in enumerate(logits))
            loss.backward()
        return logits, loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, \
            flops.get_total_flops()

    want, want_loss, want_g, want_flops = run(False)
    got, got_loss, got_g, got_flops = run(True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert got_g.keys() == want_g.keys() and "layers.0.input_layernorm.weight" in got_g
    for k in want_g:
        torch.testing.assert_close(got_g[k], want_g[k], rtol=1e-10, atol=1e-12)
    qkv_out = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    assert want_flops - got_flops == 3 * (steps - 1) * 2 * 2 * T * cfg.hidden_size * qkv_out

    model.float()
    errors = {}
    for once in (False, True):
        _, loss, grads, _ = run(once, bf16=True)
        assert grads.keys() == want_g.keys()
        errors[once] = [abs(loss.item() - want_loss.item()) / abs(want_loss.item())] + [
            ((grads[k].double() - want_g[k]).norm() / want_g[k].norm()).item() for k in want_g]
    # as close to fp64 as the per-step products are, quantity by quantity (bf16: ~2^-8 per rounding)
    assert all(a <= 1.5 * b + 2 ** -9 for a, b in zip(errors[True], errors[False], strict=True)), errors


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1", "mla", "mla-q_proj"])
def test_fast_unroll_is_the_reference_unroll(variant):
    """The fast unroll (FastUnroll, installed by use_fast_unroll) against the model's plain
    `reference_ttt_steps`, which test_model.py holds to a KV-cached chain: every step's logits
    over every row, then the TTT loss (per-step losses, accuracies, counts) and every gradient,
    with the rows each step's loss counts (loss.head_rows) and the steps from 1 on over the
    active rows only (loss.active_rows); the embedding products made once or per step; chunked
    and naive attention. fp64, two layers with q/k/v biases, two samples of differently packed
    documents (positions restarting per document, offset), a loss mask with holes. A token,
    position or row off by one anywhere in the fast unroll moves some step's logits. The MLA
    layer's draft too (its layer 0 shares its q_a / kv_a embedding products), with and
    without the queries' LoRA."""
    from eaglet.draft.eagle3.loss import active_rows, head_rows

    extra = {"eagle3": {}, "eagle3.1": dict(fc_norm=True, norm_output=True, norm_before_residual=True), "mla": MLA,
             "mla-q_proj": {**MLA, "q_lora_rank": 0}}[variant]
    cfg = DraftConfig(**{**CFG.to_dict(), "num_layers": 2, "attention_bias": True, **extra})
    torch.manual_seed(0)
    model = Eagle3Draft(cfg).double()
    for p in model.parameters():  # biases and norm weights away from their zero / one inits
        torch.nn.init.normal_(p, 0.0 if p.ndim > 1 else 1.0, 0.1 if p.ndim > 1 else 0.3)
    B, T, steps = 2, 40, 4
    g = torch.Generator().manual_seed(5)
    aux = torch.randn(B, T, 3 * cfg.target_hidden_size, generator=g, dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    doc = torch.zeros(B, T, dtype=torch.int64)
    doc[0, 13:], doc[0, 29:], doc[1, 22:] = 1, 2, 1  # documents of 13, 16, 11 and 22, 18 tokens
    pos = torch.empty_like(doc)
    for b in range(B):
        for d in doc[b].unique():
            at = doc[b] == d
            pos[b, at] = torch.arange(int(at.sum())) + 3 * b  # sample 1's documents start at position 3
    mask = torch.rand(B, T, generator=g) > 0.3  # holes: rows not trained on
    mask[0, 2:9] = False  # and a prompt span
    final = torch.randn(B, T, cfg.target_hidden_size, generator=g, dtype=torch.float64)
    W = torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=g, dtype=torch.float64)
    teacher, in_vocab = teacher_targets(final, W, model.t2d, model.d2t)
    rows = head_rows(mask, doc, steps)
    active = active_rows(rows)
    assert 0 < len(active) < B * T and all(0 < len(r) < B * T for r in rows)

    def run(fast, impl="chunked", **kw):
        model.unroll = fast
        model.zero_grad(set_to_none=True)
        logits = []

        def each():
            for x in model(aux, ids, pos, doc, num_steps=steps, attn_impl=impl, **kw):
                logits.append(x.detach().clone())
                yield x

        out = ttt_loss(each(), teacher, in_vocab, mask, doc, head_rows=kw.get("head_rows"))
        out.total.backward()
        return logits, out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    def same(got, want):
        (got_l, got, got_g), (want_l, want, want_g) = got, want
        for j, (a, b) in enumerate(zip(got_l, want_l, strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"step {j}: {m}")
        for a, b in zip([got.total] + got.losses + got.correct + got.counts,
                        [want.total] + want.losses + want.correct + want.counts, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert got_g.keys() == want_g.keys() and "layers.0.input_layernorm.weight" in got_g
        for k in want_g:
            torch.testing.assert_close(got_g[k], want_g[k], rtol=1e-10, atol=1e-12, msg=lambda m: f"{k}: {m}")

    fast = FastUnroll(model)
    want_all, want_rows = run(None), run(None, head_rows=rows)
    assert want_all[0][0].shape == (B, T, cfg.draft_vocab_size)
    for once in (True, False):
        fast.embeds_once = once
        same(run(fast), want_all)
        same(run(fast, head_rows=rows), want_rows)
        same(run(fast, head_rows=rows, active_rows=active), want_rows)
    same(run(fast, "naive", head_rows=rows, active_rows=active), run(None, "naive", head_rows=rows))


class _RowsCase:
    """The row-skipping tests' case: a draft in fp64 (eager, or compiled through aot_eager with
    the compiled soft CE) and a batch of two samples of two packed documents each, with prompt
    spans and the out-of-vocabulary mask on; `run` gives the TTT loss, the gradients and the
    FLOPs of one forward and backward."""

    B, T, steps = 2, 40, 4

    def __init__(self, cfg, how, monkeypatch, prompts):
        self.how, self.rows_of = how, partial(device_head_rows, num_steps=self.steps, device=torch.device("cpu"))
        torch.manual_seed(0)
        self.model = Eagle3Draft(cfg).double()
        for p in self.model.parameters():  # biases and norm weights away from their zero / one inits
            torch.nn.init.normal_(p, 0.0 if p.ndim > 1 else 1.0, 0.1 if p.ndim > 1 else 0.3)
        if how == "compiled":
            torch._dynamo.reset()
        use_fast_unroll(self.model, compile=how == "compiled", backend="aot_eager")
        if how == "compiled":
            monkeypatch.setattr(loss_mod, "_compiled_soft_ce", torch.compile(masked_soft_ce, backend="aot_eager"))
        B, T = self.B, self.T
        g = torch.Generator().manual_seed(4)
        self.aux = torch.randn(B, T, 3 * cfg.target_hidden_size, generator=g, dtype=torch.float64)
        self.ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
        self.pos, self.doc = (torch.arange(T) % 25).expand(B, T), (torch.arange(T) // 25).expand(B, T)
        self.mask = torch.ones(B, T, dtype=torch.bool)
        for b, start, end in prompts:
            self.mask[b, start:end] = False
        final = torch.randn(B, T, cfg.target_hidden_size, generator=g, dtype=torch.float64)
        W = torch.randn(cfg.vocab_size, cfg.target_hidden_size, generator=g, dtype=torch.float64)
        self.teacher, self.in_vocab = teacher_targets(final, W, self.model.t2d, self.model.d2t)
        assert 0 < self.in_vocab.float().mean() < 1

    def run(self, head_rows=None, active_rows=None, impl="chunked"):
        from torch.utils.flop_counter import FlopCounterMode

        m = self.model
        m.zero_grad(set_to_none=True)
        with FlopCounterMode(display=False) as flops:
            out = ttt_loss(m(self.aux, self.ids, self.pos, self.doc, num_steps=self.steps, attn_impl=impl,
                             head_rows=head_rows, active_rows=active_rows),
                           self.teacher, self.in_vocab, self.mask, self.doc, compiled=self.how == "compiled",
                           head_rows=head_rows)
            out.total.backward()
        return out, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}, \
            flops.get_total_flops()

    @staticmethod
    def assert_same(got, want):
        """Loss, per-step losses, accuracies, counts and gradients (fp64)."""
        (got, got_g, _), (want, want_g, _) = got, want
        for a, b in zip([got.total] + got.losses + got.correct + got.counts,
                        [want.total] + want.losses + want.correct + want.counts, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert got_g.keys() == want_g.keys()
        for k in want_g:
            torch.testing.assert_close(got_g[k], want_g[k], rtol=1e-10, atol=1e-12)

    def graphs_over_masks(self, keep, pick):
        """Compiled graphs after each of four random masks keeping `keep` of the tokens;
        pick(head_rows, active_rows) -> run's keyword arguments."""
        from torch._dynamo.utils import counters

        seen = []
        for seed in range(4):
            mask = torch.rand(self.B, self.T, generator=torch.Generator().manual_seed(seed)) < keep
            self.run(**pick(*self.rows_of(mask, self.doc)))
            seen.append(counters["stats"]["unique_graphs"])
        torch._dynamo.reset()
        return seen


@pytest.mark.parametrize("how", ["eager", "compiled"])
def test_head_rows_give_the_loss_and_gradients_of_every_row(how, monkeypatch):
    """The LM head over the rows each step's loss can count (loss.head_rows: trained tokens,
    within their document, not past its end) gives the loss, per-step losses, accuracies,
    counts and gradients of the head over every row (fp64; rows really dropped: a loss mask
    with prompt spans, two packed documents, two samples, the out-of-vocabulary mask on), and
    the forward and backward skip exactly the dropped rows' LM-head FLOPs. Compiled (dynamo,
    aot_eager): the same, the per-step row counts changing without a graph per count."""
    case = _RowsCase(CFG, how, monkeypatch, [(0, 3, 11), (1, 20, 33), (0, 25, 28), (1, 25, 28)])
    want = case.run()
    rows, _ = case.rows_of(case.mask, case.doc)
    got = case.run(rows)
    case.assert_same(got, want)
    dropped = case.B * case.T * case.steps - sum(len(r) for r in rows)
    assert dropped > case.B * case.T  # prompts, document ends and the steps' tails
    assert want[2] - got[2] == 3 * 2 * dropped * CFG.hidden_size * CFG.draft_vocab_size
    if how == "compiled":  # other masks, other row counts: no graph past the first dynamic one
        seen = case.graphs_over_masks(0.6, lambda rows, _: dict(head_rows=rows))
        assert seen[1] == seen[-1], seen


@pytest.mark.parametrize("how", ["eager", "compiled"])
def test_steps_after_the_first_run_over_the_rows_a_later_step_counts(how, monkeypatch):
    """TTT steps 1.. over the active rows only (loss.active_rows: the rows some step from 1 on
    counts), gathered into one sequence, give the loss, per-step losses, accuracies, counts and
    gradients of the steps over every row (fp64; two layers with q/k/v biases, two samples, two
    documents each, prompt spans, the out-of-vocabulary mask on; the embedding products made
    once or per step; chunked and naive attention), and the forward and backward skip exactly
    the dropped rows' linear products in steps 1... Compiled (aot_eager): the same, other
    masks (other active row counts) adding no graph after the first dynamic one."""
    from eaglet.draft.eagle3.loss import active_rows, step_mask

    cfg = DraftConfig(**{**CFG.to_dict(), "num_layers": 2, "attention_bias": True})
    case = _RowsCase(cfg, how, monkeypatch, [(0, 3, 13), (1, 12, 33), (0, 25, 29), (1, 25, 29)])
    B, T, steps = case.B, case.T, case.steps
    rows, active = case.rows_of(case.mask, case.doc)
    ones = torch.ones_like(case.mask)
    counted = torch.zeros(B, T, dtype=torch.bool)
    for j in range(1, steps):
        m = step_mask(case.mask, ones, case.doc, j)
        counted[:, : m.shape[1]] |= m
    assert active.tolist() == counted.flatten().nonzero().flatten().tolist() == active_rows(rows).tolist()
    dropped = B * T - len(active)
    assert 0.25 * B * T < dropped < 0.5 * B * T  # the prompts but the last rows before each answer, the documents' ends
    H, I = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for once in (True, False):
        case.model.unroll.embeds_once = once
        want, got = case.run(rows), case.run(rows, active)
        case.assert_same(got, want)
        # per dropped row and step: layer 0's q/k/v over its hidden half (both halves when each
        # step makes its own), layer 1's q/k/v, both layers' o_proj and MLP; forward and backward
        per_row = (1 if once else 2) * H * (q + 2 * kv) + H * (q + 2 * kv) + 2 * (q * H + 3 * H * I)
        assert want[2] - got[2] == 3 * 2 * (steps - 1) * dropped * per_row
    case.assert_same(case.run(rows, active, "naive"), want)  # the reference attention over the rows' full sequences
    case.mask[:] = False  # nothing trained on: the steps from 1 on run over no rows at all
    case.mask[:, 2] = True  # row 0 of step 0 trains on token 2
    rows, active = case.rows_of(case.mask, case.doc)
    assert len(active) == 0 and len(rows[0]) == B
    case.assert_same(case.run(rows, active), case.run(rows))
    if how == "compiled":  # other masks, other active row counts: no graph past the first dynamic one
        seen = case.graphs_over_masks(0.5, lambda rows, active: dict(head_rows=rows, active_rows=active))
        assert seen[1] == seen[-1], seen


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_unroll_under_fsdp_and_ddp_casts_what_is_whole(tmp_path, monkeypatch, strategy):
    """One gloo rank, parallelize's wrapping, bf16 autocast. Under FSDP2 each decoder layer is
    a unit of its own, sharded when the unroll starts: its products keep autocast's casts (a
    sharded weight in a product fails: "mixed torch.Tensor and DTensor"); lm_head, whole in
    the root unit's forward, is cast once and accumulates its gradient in its GEMMs. Under DDP
    every weight is whole: all of them do, and DDP's reducer gets the gradients their hand-off
    gives the parameters. Loss and gradients are those of the plain model casting the same
    weights, bit for bit."""
    import torch.distributed as dist

    # DDP's reducer holds the process group, and frees it holding the GIL: were it the last holder,
    # gloo's threads would be joined under the GIL (a hang seen once in the suite). So the wrapped
    # model goes first, while the group is still registered, and destroy_process_group frees it.
    def check():
        torch.manual_seed(0)
        plain = Eagle3Draft(CFG)
        unroll = use_fast_unroll(plain)
        if strategy == "fsdp":  # FSDP2's layer 0 is sharded outside its forward: each step projects its embeddings
            monkeypatch.setattr(unroll, "cast_weights", lambda dtype: (
                [None] * len(plain.layers), cast_linears([("lm_head", plain.lm_head)], dtype)))
            unroll.embeds_once = False
        want, want_g = _loss_and_grads(plain, bf16=True)
        draft = Eagle3Draft(CFG)
        draft.load_state_dict(plain.state_dict())
        teacher = TeacherHead(torch.zeros(CFG.vocab_size, CFG.target_hidden_size), chunk=16)
        par = parallelize(draft, teacher, strategy, torch.device("cpu"))
        casts = []
        cast = draft.unroll.cast_weights
        monkeypatch.setattr(draft.unroll, "cast_weights", lambda dtype: casts.append(cast(dtype)) or casts[-1])
        got, got_g = _loss_and_grads(par.module, bf16=True)
        ((layers, lm_head),) = casts
        assert set(lm_head) == {"lm_head", "lm_head.grad", "lm_head.link"}
        if strategy == "fsdp":
            assert layers == [None] * len(draft.layers)
        else:
            assert all("down_proj.grad" in w for w in layers)
        assert torch.equal(got.total, want.total)
        got_g = {k.removeprefix("module."): v for k, v in got_g.items()}
        assert got_g.keys() == want_g.keys()
        full = (lambda t: t.full_tensor()) if strategy == "fsdp" else (lambda t: t)
        assert all(torch.equal(full(got_g[k]), want_g[k]) for k in want_g)
        return weakref.ref(par)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        assert check()() is None
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not os.environ.get("EAGLET_PERF_FULL"), reason="set EAGLET_PERF_FULL=1 (about a minute)")
def test_compiled_unroll_inductor_matches_eager(monkeypatch):
    torch._dynamo.reset()
    _check_compiled("inductor", monkeypatch, steps=3)
    torch._dynamo.reset()


@pytest.mark.skipif(not os.environ.get("EAGLET_PERF_FULL"), reason="set EAGLET_PERF_FULL=1 (about a minute)")
def test_inductor_backward_accumulates_weight_grads_in_place():
    """Inductor's code for the bf16 unroll: the gradients of the eager unroll (within
    compiled-vs-eager rounding), and in every piece's backward each linear's weight gradient
    goes straight into the accumulator the piece was given (a graph input), not into a
    temporary copied back afterwards (what an in-place addmm_ in the backward becomes)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = Eagle3Draft(CFG)
    comp = Eagle3Draft(CFG)
    comp.load_state_dict(ref.state_dict())
    use_fast_unroll(ref)
    use_fast_unroll(comp, compile=True)
    want, want_g = _loss_and_grads(ref, bf16=True)
    (got, got_g), codes = run_and_get_code(_loss_and_grads, comp, bf16=True)
    torch._dynamo.reset()
    torch.testing.assert_close(got.total, want.total, rtol=1e-3, atol=1e-3)
    for k in want_g:
        torch.testing.assert_close(got_g[k], want_g[k], rtol=0, atol=2 ** -6 * want_g[k].abs().max().item())
    calls = re.findall(r"accumulate_weight_grad_\.default\((\w+)", "\n".join(codes))
    per_layer = sum(isinstance(m, torch.nn.Linear) for m in comp.layers[0].modules())
    # each piece compiled once; + layer 0's q/k/v over the embeddings (embed_projection) + lm_head
    assert len(calls) == per_layer * len(comp.layers) + 3 + 1
    assert all(re.fullmatch(r"primals_\d+", c) for c in calls), calls


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
    par = parallelize(draft, TeacherHead(W, chunk=16), "none", torch.device("cpu"))
    b = Batch(aux=aux, final=final, input_ids=ids, loss_mask=torch.ones(1, T, dtype=torch.bool), position_ids=pos,
              doc_ids=doc, tokens=T)
    tc = TrainSection(max_tokens=T, ttt_steps=3, attn_impl="chunked", precision="fp32")
    mode = _Ops()
    with mode:
        micro_batch(par, b, Config(train=tc), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), sync=True)
    assert sum(mode.ops.values()) > 100  # the mode saw the step
    assert not {k: v for k, v in mode.ops.items() if k in SYNC_OPS or k == "bool-mask index"}


@pytest.mark.parametrize("clip", [0.05, 1e4])  # clipping, and a norm under the limit
def test_clip_in_the_fused_step_is_clip_grad_norm(clip):
    """optimizer_step with a fused AdamW (the GPU's; CPU has one too) folds the clipping into
    the step (the kernel divides by grad_scale): the parameters and optimizer state of
    clip_grad_norm_ then step, over two steps, and the divisor is not left on the optimizer."""
    torch.manual_seed(0)
    tc = TrainSection(grad_clip=clip, lr=1e-2)
    models = [Eagle3Draft(CFG) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    pars = [parallelize(m, TeacherHead(torch.zeros(CFG.vocab_size, CFG.target_hidden_size), chunk=16), "none",
                        torch.device("cpu")) for m in models]
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=tc.lr, fused=True) for m in models]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0) for o in opts]
    for step in range(2):
        grads = {n: torch.randn_like(p) * (step + 1) for n, p in models[0].named_parameters() if p.requires_grad}
        for m in models:
            for n, p in m.named_parameters():
                if n in grads:
                    p.grad = grads[n].clone()
        for par, o, s, folded in zip(pars, opts, scheds, (True, False)):
            optimizer_step(par, o, s, tc, clip_in_step=folded)
        assert not hasattr(opts[0], "grad_scale")
    for (n, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=n)
    total = torch.cat([g.flatten() for g in grads.values()]).norm()
    assert (total > clip) == (clip < 1)  # the two cases are what they say


def _shapes_past_the_limit(fn):
    """fn over 12 distinct static shapes (the global recompile limit is 8)."""
    for n in range(1, 13):
        fn(torch.ones(n))


@pytest.mark.skipif(not compiling.takes_recompile_limit(), reason="this torch has no per-call recompile_limit")
def test_pieces_get_a_recompile_limit_of_their_own_and_the_watch_sees_a_give_up():
    """Where torch.compile takes recompile_limit per call (torch 2.13 on), compile_piece gives
    each piece PIECE_RECOMPILE_LIMIT: 12 shapes compile 12 graphs. A plain torch.compile stops
    at the global 8 and runs eager after: CompileWatch counts the graphs and that give-up."""
    torch._dynamo.reset()
    watch = compiling.CompileWatch()
    _shapes_past_the_limit(compiling.compile_piece(lambda x: x * 2, backend="eager", dynamic=False))
    assert watch.since_last() == (12, 0)
    _shapes_past_the_limit(torch.compile(lambda x: x * 3, backend="eager", dynamic=False))
    assert watch.since_last() == (8, 1)
    assert watch.since_last() == (0, 0)
    torch._dynamo.reset()


def test_compile_piece_passes_a_recompile_limit_only_to_a_torch_that_takes_one(monkeypatch):
    """torch 2.11 and 2.12's torch.compile have no recompile_limit argument: compile_piece then
    leaves it out and raises the global limit to PIECE_RECOMPILE_LIMIT; 2.13's gets it per call."""
    seen = []

    def old_compile(model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None,
                    disable=False):
        seen.append({"dynamic": dynamic, "backend": backend})
        return model

    def new_compile(model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None,
                    disable=False, recompile_limit=None):
        seen.append({"dynamic": dynamic, "backend": backend, "recompile_limit": recompile_limit})
        return model

    limits = []
    with torch._dynamo.config.patch(recompile_limit=8):  # restored on exit (a monkeypatch of it is not)
        for fake in (new_compile, old_compile):
            monkeypatch.setattr(compiling.torch, "compile", fake)
            assert compiling.compile_piece(abs, backend="eager") is abs
            limits.append(torch._dynamo.config.recompile_limit)
    assert limits == [8, compiling.PIECE_RECOMPILE_LIMIT]  # the global limit raised for the old one only
    assert seen == [{"dynamic": None, "backend": "eager", "recompile_limit": compiling.PIECE_RECOMPILE_LIMIT},
                    {"dynamic": None, "backend": "eager"}]


def capture_only(monkeypatch, tmp_path) -> None:
    """The trainer's compiled pieces and loss through dynamo's capture alone (backend eager), from
    a fresh dynamo: the graphs are counted as a GPU run makes them, at a CPU's cost. eaglet's cache
    (so the default compile cache) under tmp_path; the compile cache's variable, which the trainer
    sets, unset meanwhile and restored afterwards."""
    monkeypatch.delenv(compiling.CACHE_ENV, raising=False)
    monkeypatch.setenv("EAGLET_CACHE", str(tmp_path / "eaglet-cache"))
    monkeypatch.setitem(compiling.PIECE_OPTIONS, "backend", "eager")
    monkeypatch.setattr(loss_mod, "_compiled_soft_ce", None)
    monkeypatch.setattr(loss_mod, "_compiled_accept_term", None)
    torch._dynamo.reset()


def test_compiled_training_on_real_packing_makes_its_graphs_in_the_first_step(tmp_path, monkeypatch, capfd):
    """`eaglet train` compiled (dynamo's capture alone, backend eager) on a real store's packed
    micro-batches, which differ in tokens, documents and trained rows: the log's compile_graphs
    is the first step's alone, and nothing is said about compiling."""
    from conftest import tiny_pipeline_upto_vocab, train_on_copy

    base = tiny_pipeline_upto_vocab(tmp_path, 12, 3, [
        "run.seed=0", "extract.store_dtype=float32", "vocab.size=128", "train.max_tokens=192", "train.ttt_steps=2",
        "train.log_every=2", "train.eval_every=0", "train.ckpt_every=100", "train.tensorboard=false",
        "train.device=cpu", "train.eval_fraction=0", "train.compile=on", "train.max_steps=6"])  # no evaluation
    capture_only(monkeypatch, tmp_path)
    _, log = train_on_copy(tmp_path, base, "watched")
    torch._dynamo.reset()
    train = [r for r in log if r.get("split") == "train"]
    shapes = {r["tokens"] for r in train}
    assert len(train) == 3 and len(shapes) == 3, shapes
    assert train[0]["compile_graphs"] > 0 and [r["compile_graphs"] for r in train[1:]] == [0] * 2
    said = capfd.readouterr()
    assert "[train] done in" in said.err and "torch.compile" not in said.out + said.err


def test_compiled_evaluation_runs_the_training_graphs(tmp_path, monkeypatch, capfd):
    """A compiled run's held-out evaluations make no graph of their own (they run with autograd
    on, as the steps do: a no-grad evaluation compiled every piece again), their figures are an
    eager evaluation's, and they keep no autograd graph (the step after them trains as before)."""
    from conftest import tiny_pipeline_upto_vocab, train_on_copy

    sets = ["run.seed=0", "extract.store_dtype=float32", "vocab.size=128", "train.max_tokens=192",
            "train.ttt_steps=2", "train.log_every=1", "train.eval_every=2", "train.ckpt_every=100",
            "train.tensorboard=false", "train.device=cpu", "train.eval_fraction=0.2", "train.max_steps=6"]
    base = tiny_pipeline_upto_vocab(tmp_path, 12, 3, [*sets, "train.compile=on"])
    capture_only(monkeypatch, tmp_path)
    _, log = train_on_copy(tmp_path, base, "compiled")
    torch._dynamo.reset()
    evals = [r for r in log if r.get("split") == "eval"]
    assert [r["step"] for r in evals] == [2, 4, 6]
    assert [r["compile_graphs"] for r in evals] == [0, 0, 0]
    assert "torch.compile" not in capfd.readouterr().err
    _, eager = train_on_copy(tmp_path, base, "eager", "train.compile=off")
    eager_evals = [r for r in eager if r.get("split") == "eval"]
    for c, e in zip(evals, eager_evals, strict=True):
        assert c["loss"] == pytest.approx(e["loss"], rel=1e-4) and c["acc_0"] == pytest.approx(e["acc_0"], abs=1e-6)
    assert [r["loss"] for r in log if r.get("split") == "train"] == pytest.approx(
        [r["loss"] for r in eager if r.get("split") == "train"], rel=1e-4)


def test_compile_cache_folder_setting_then_environment_then_eaglet_cache(tmp_path, monkeypatch):
    """use_compile_cache: train.compile_cache wins, then $TORCHINDUCTOR_CACHE_DIR, then the
    default (eaglet's cache); the folder is made and set for inductor, and reported empty or not."""
    monkeypatch.delenv(compiling.CACHE_ENV, raising=False)
    default = tmp_path / "eaglet-cache" / "compile"
    assert compiling.use_compile_cache(None, default) == (default, False)
    assert os.environ[compiling.CACHE_ENV] == str(default.resolve()) and default.is_dir()
    monkeypatch.setenv(compiling.CACHE_ENV, str(tmp_path / "from-env"))
    assert compiling.use_compile_cache(None, default)[0] == tmp_path / "from-env"
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir
    monkeypatch.setenv(compiling.CACHE_ENV, default_cache_dir())  # as importing dynamo leaves it: unset
    assert compiling.use_compile_cache(None, default)[0] == default
    (default / "fxgraph").mkdir()
    assert compiling.use_compile_cache(str(default), tmp_path / "unused") == (default, True)
    assert os.environ[compiling.CACHE_ENV] == str(default.resolve())
    assert cache_dir() == str(default.resolve())  # where inductor itself will look


_CACHED_COMPILE = """
import sys, torch
from pathlib import Path
from torch._dynamo.utils import counters
from eaglet.draft.compiling import use_compile_cache
folder, warm = use_compile_cache(None, Path(sys.argv[1]))
torch.compile(lambda x: torch.nn.functional.silu(x) * 2 + 1)(torch.randn(64, 32))
print(warm, counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])
"""


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="inductor's CPU code needs a C++ compiler: install g++ (apt-get install g++)")
def test_a_second_process_finds_the_first_ones_compile_in_the_cache(tmp_path):
    """Inductor itself (not a mock): a process that points its cache at the folder an earlier
    one compiled into takes the graph from it (a cache hit, no compile), as a resumed run does;
    the folder is the default's, as dynamo's import has filled the variable with torch's own.
    About 15 s on a 2-core CPU, most of it the first process's C++ build."""
    env = {k: v for k, v in os.environ.items() if k != compiling.CACHE_ENV}
    runs = [subprocess.run([sys.executable, "-c", _CACHED_COMPILE, str(tmp_path / "compile")], env=env,
                           capture_output=True, text=True, timeout=300) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-2000:]
    assert [r.stdout.split() for r in runs] == [["False", "0", "1"], ["True", "1", "0"]]


def test_compiled_training_keeps_its_compile_cache_in_the_setting_or_eaglets_cache(tmp_path, monkeypatch, capfd):
    """A compiled run points inductor at train.compile_cache before it compiles, and says which
    folder and whether it held anything; unset (and no $TORCHINDUCTOR_CACHE_DIR), at
    <EAGLET_CACHE>/compile. An eager run leaves the variable alone."""
    from conftest import tiny_pipeline_upto_vocab, train_on_copy

    base = tiny_pipeline_upto_vocab(tmp_path, 8, 2, [
        "run.seed=0", "extract.store_dtype=float32", "vocab.size=128", "train.max_tokens=192", "train.ttt_steps=2",
        "train.log_every=2", "train.eval_every=0", "train.ckpt_every=100", "train.tensorboard=false",
        "train.device=cpu", "train.eval_fraction=0", "train.compile=on", "train.max_steps=2"])
    capture_only(monkeypatch, tmp_path)
    train_on_copy(tmp_path, base, "default")
    assert os.environ[compiling.CACHE_ENV] == str((tmp_path / "eaglet-cache" / "compile").resolve())
    assert f"[train] compile cache: {tmp_path / 'eaglet-cache' / 'compile'} (empty)" in capfd.readouterr().err
    mine = tmp_path / "mine"
    (mine / "fxgraph").mkdir(parents=True)
    train_on_copy(tmp_path, base, "set", f"train.compile_cache={mine}")
    torch._dynamo.reset()
    assert os.environ[compiling.CACHE_ENV] == str(mine.resolve())
    assert f"[train] compile cache: {mine} (holds earlier compiles)" in capfd.readouterr().err
    monkeypatch.delenv(compiling.CACHE_ENV)
    train_on_copy(tmp_path, base, "eager", "train.compile=off")
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    assert os.environ.get(compiling.CACHE_ENV) in (None, default_cache_dir())  # torch's, if anything's
    assert "compile cache" not in capfd.readouterr().err


def test_the_trainer_says_when_compiling_goes_on_or_gives_up(capfd):
    """After the first logging interval, graphs still made get a line naming the step and
    TORCH_LOGS; a function given up on gets one at any step; the warm-up's graphs none."""
    from eaglet.training.metrics import say_if_compiling

    say_if_compiling(1, 40, 0, warmed=False, show=True)
    say_if_compiling(9, 0, 0, warmed=True, show=True)
    say_if_compiling(9, 2, 1, warmed=True, show=False)  # not the main rank
    assert capfd.readouterr().err == ""
    say_if_compiling(7, 3, 0, warmed=True, show=True)
    say_if_compiling(2, 5, 1, warmed=False, show=True)
    err = capfd.readouterr().err.splitlines()
    assert err[0].startswith("[train] step 7: torch.compile made 3 more graph(s)") and "TORCH_LOGS" in err[0]
    assert err[1].startswith("[train] step 2: torch.compile reached its recompile limit for 1 function(s)")
    assert "eager" in err[1] and len(err) == 2
