"""The EAGLE-3 draft: TTT attention against a dense-mask reference, the whole unroll against
a KV-cached chain, layers against transformers' Llama layer, RoPE, names, target configs."""

import itertools
import warnings

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from eaglet.draft.eagle3 import attention as A
from eaglet.draft.eagle3 import model as M
from eaglet.draft.layers import is_moe_config, rope_inv_freq
from eaglet.draft.eagle3.model import DraftConfig, Eagle3Draft
from eaglet.draft.eagle3.attention import KVCache, ttt_attention, ttt_dense_mask

# CPU flex_attention runs unfused (eager); that is what these tests want.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

CUDA = torch.cuda.is_available()
DOCS = torch.tensor([[0] * 9 + [1] * 17 + [2] * 7, [5] * 33])  # packed, and one document


def tiny_config(**kw) -> DraftConfig:
    base = dict(
        hidden_size=32, target_hidden_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=48, vocab_size=97, draft_vocab_size=40, rope_theta=100.0,
    )
    return DraftConfig(**{**base, **kw})


def tiny_draft(seed: int = 0, **kw) -> Eagle3Draft:
    torch.manual_seed(seed)
    m = Eagle3Draft(tiny_config(**kw)).double()
    m.reset_parameters(std=0.3)  # large enough that attention visibly moves the logits
    return m


def qkv(steps: int, B=2, Hq=4, Hk=2, T=33, D=8, dtype=torch.float64, device="cpu", grad=True):
    g = torch.Generator().manual_seed(steps)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=dtype).to(device).requires_grad_(grad)  # noqa: E731
    return mk(B, Hq, T, D), [mk(B, Hk, T, D) for _ in range(steps)], [mk(B, Hk, T, D) for _ in range(steps)]


# ---- the reference pattern ---------------------------------------------------------------


def test_dense_reference_mask_is_the_ttt_rule():
    """Query (t, step j) sees step-0 key s iff s <= t in t's document, and step-i key s iff s == t."""
    B, T, steps = 2, 33, 3
    mask = ttt_dense_mask(DOCS, B, T, steps, torch.device("cpu"))
    for b, t, i, s in itertools.product(range(B), range(T), range(steps), range(T)):
        want = (s <= t and DOCS[b, s] == DOCS[b, t]) if i == 0 else s == t
        assert bool(mask[b, t, i * T + s]) == want


@pytest.mark.parametrize("impl", ["chunked", "flex"])
@pytest.mark.parametrize("steps", [1, 2, 3, 4])
@pytest.mark.parametrize("docs", [None, DOCS], ids=["one-doc", "packed"])
def test_ttt_attention_matches_dense_reference(impl, steps, docs):
    grad = impl != "flex"  # CPU flex_attention has no backward; the CUDA test below covers it
    q, ks, vs = qkv(steps, grad=grad)
    ref = ttt_attention(q, ks, vs, "naive", doc_ids_BT=docs)
    out = ttt_attention(q, ks, vs, impl, doc_ids_BT=docs, chunk=8)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    if grad:
        w = torch.randn_like(ref)
        g_ref = torch.autograd.grad((ref * w).sum(), [q, *ks, *vs])
        g_out = torch.autograd.grad((out * w).sum(), [q, *ks, *vs])
        for a, b in zip(g_out, g_ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _rows_case(q, ks, vs, rows):
    """The queries and the diagonal keys of `rows` only (flat b*T + t), as one sequence."""
    take = [A._full_to_rows(x, rows) for x in (q, *ks[1:], *vs[1:])]
    j = len(ks) - 1
    return take[0], [ks[0], *take[1:1 + j]], [vs[0], *take[1 + j:]]


@pytest.mark.parametrize("impl", ["chunked", "flex", "naive"])
@pytest.mark.parametrize("steps", [2, 4])
@pytest.mark.parametrize("docs", [None, DOCS], ids=["one-doc", "packed"])
def test_ttt_attention_over_some_rows_is_those_rows_of_the_whole(impl, steps, docs):
    """ttt_attention's rows (the TTT unroll's active rows from step 1 on): the queries and
    diagonal keys of some rows of two samples, gathered into one sequence, against the full
    step-0 keys, give those rows of the whole attention (values and gradients; the merge
    compiled or not)."""
    grad = impl != "flex"
    q, ks, vs = qkv(steps, grad=grad)
    B, _, T, _ = q.shape
    rows = torch.tensor([0, 3, 4, 5, 9, T - 1, T, T + 2, 2 * T - 2])
    ref = A._full_to_rows(ttt_attention(q, ks, vs, "naive", doc_ids_BT=docs), rows)
    for merge in (None, A.merge_diagonal_stacked):
        out = ttt_attention(*_rows_case(q, ks, vs, rows), impl, doc_ids_BT=docs, chunk=8, merge=merge, rows=rows)
        assert out.shape == (1, q.shape[1], len(rows), q.shape[3])
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        if grad:
            w = torch.randn_like(ref)
            g_ref = torch.autograd.grad((ref * w).sum(), [q, *ks, *vs], retain_graph=True)
            g_out = torch.autograd.grad((out * w).sum(), [q, *ks, *vs])
            for a, b in zip(g_out, g_ref, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _spans(T: int, cuts: list[int]) -> torch.Tensor:
    """Document ids [T]: a new document at each cut."""
    ids = torch.zeros(T, dtype=torch.int64)
    for c in cuts:
        ids[c:] += 1
    return ids


@pytest.mark.parametrize("T", [16, 33, 64, 100, 129])
def test_block_mask_from_document_spans_is_create_block_masks(T):
    """ttt_block_mask builds the BlockMask from each block's first and last document; it is the
    one create_block_mask makes by evaluating the mask everywhere (every index tensor, partial
    and full, kv and q side), for one document, and for packed layouts: documents cut at block
    edges, one token long, spanning blocks, T not a multiple of the block; and flex attention
    through it gives the reference's values."""
    from torch.nn.attention.flex_attention import create_block_mask

    g = torch.Generator().manual_seed(T)
    block = 16
    layouts = [None, _spans(T, [])[None]]
    for _ in range(6):  # two rows, random cuts, some on block edges, some adjacent (1-token documents)
        rows = []
        for _ in range(2):
            cuts = torch.randint(1, T, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g).tolist()
            cuts += [c for c in range(block, T, block) if torch.rand(1, generator=g) < 0.3]
            cuts += [c + 1 for c in cuts[:2] if c + 1 < T]
            rows.append(_spans(T, sorted(set(cuts))) + 7)
        layouts.append(torch.stack(rows))
    for docs in layouts:
        B = 1 if docs is None else docs.shape[0]
        got = A.ttt_block_mask(docs, T, torch.device("cpu"), block=block)
        if docs is None:
            want = create_block_mask(lambda b, h, q, k: q >= k, None, None, T, T, device="cpu", BLOCK_SIZE=block)
        else:
            want = create_block_mask(lambda b, h, q, k: (q >= k) & (docs[b, q] == docs[b, k]), B, None, T, T,
                                     device="cpu", BLOCK_SIZE=block)
        assert got.shape == want.shape and got.BLOCK_SIZE == want.BLOCK_SIZE
        for side in ("kv", "full_kv", "q", "full_q"):
            n_got, n_want = getattr(got, f"{side}_num_blocks"), getattr(want, f"{side}_num_blocks")
            i_got, i_want = getattr(got, f"{side}_indices"), getattr(want, f"{side}_indices")
            assert torch.equal(n_got, n_want), (side, docs)
            for idx in itertools.product(*(range(d) for d in n_got.shape)):  # the listed blocks, in order
                assert torch.equal(i_got[idx][: n_got[idx]], i_want[idx][: n_want[idx]]), (side, idx, docs)
        assert torch.equal(got.to_dense(), want.to_dense())
        q, ks, vs = qkv(1, B=B, T=T, grad=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = ttt_attention(q, ks, vs, "flex", doc_ids_BT=docs, block_mask=got)
        torch.testing.assert_close(out, ttt_attention(q, ks, vs, "naive", doc_ids_BT=docs), rtol=1e-10, atol=1e-10)


def test_reference_is_not_trivially_matched():
    """A plain causal mask over all steps' keys gives a different answer (the tests can fail)."""
    q, ks, vs = qkv(3, grad=False)
    T = q.shape[2]
    wrong = torch.ones(T, T, dtype=torch.bool).tril().repeat(1, 3)[None].expand(2, T, 3 * T)
    ref = ttt_attention(q, ks, vs, "naive")
    assert (A._naive_ttt_attention(q, ks, vs, wrong, q.shape[-1] ** -0.5) - ref).abs().max() > 1e-2


@pytest.mark.parametrize("returns_aux", [True, False])
def test_flex_lse_api_branches(monkeypatch, returns_aux):
    """Both flex_attention LSE APIs (return_aux=AuxRequest / return_lse) give the same result."""
    import inspect

    params = inspect.signature(torch.nn.attention.flex_attention.flex_attention).parameters
    if ("return_aux" if returns_aux else "return_lse") not in params:
        have, other = ("return_lse", "return_aux") if returns_aux else ("return_aux", "return_lse")
        pytest.skip(f"this torch's flex_attention has {have}, not {other}: eaglet uses {have} here, which the other "
                    "case tests; nothing to install")
    monkeypatch.setattr(A, "_FLEX_RETURNS_AUX", returns_aux)
    q, ks, vs = qkv(3, grad=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = ttt_attention(q, ks, vs, "flex", doc_ids_BT=DOCS)
    torch.testing.assert_close(out, ttt_attention(q, ks, vs, "naive", doc_ids_BT=DOCS), rtol=1e-10, atol=1e-10)


@pytest.mark.skipif(not CUDA, reason="needs CUDA (flex_attention backward)")
@pytest.mark.parametrize("docs", [None, "packed"])
def test_compiled_flex_on_cuda_matches_reference(docs):
    A.compile_flex_attention(dynamic=False)
    try:
        T = 300  # more than two 128-blocks, not a multiple of the block size
        doc_ids = torch.tensor([[0] * 100 + [1] * 150 + [2] * 50, [0] * 300]).cuda() if docs else None
        for steps in (1, 3, 4):
            q, ks, vs = qkv(steps, B=2, Hq=8, Hk=2, T=T, D=64, dtype=torch.float32, device="cuda")
            ref = ttt_attention(q, ks, vs, "naive", doc_ids_BT=doc_ids)
            out = ttt_attention(q, ks, vs, "flex", doc_ids_BT=doc_ids)
            torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)
            w = torch.randn_like(ref)
            g_ref = torch.autograd.grad((ref * w).sum(), [q, *ks, *vs], retain_graph=True)
            g_out = torch.autograd.grad((out * w).sum(), [q, *ks, *vs])
            for a, b in zip(g_out, g_ref, strict=True):
                torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)
            if steps > 1:  # the queries and diagonal keys of some rows only (the unroll's active rows)
                rows = torch.tensor([0, 5, 99, 100, 101, 299, 300, 450, 599], device="cuda")
                out = ttt_attention(*_rows_case(q, ks, vs, rows), "flex", doc_ids_BT=doc_ids, rows=rows)
                want = A._full_to_rows(ref, rows)
                torch.testing.assert_close(out, want, rtol=2e-4, atol=2e-4)
                w = torch.randn_like(want)
                g_ref = torch.autograd.grad((want * w).sum(), [q, *ks, *vs])
                g_out = torch.autograd.grad((out * w).sum(), [q, *ks, *vs])
                for a, b in zip(g_out, g_ref, strict=True):
                    torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)
    finally:
        A._flex_compiled = None


# ---- the whole unroll ---------------------------------------------------------------------


def batch(m: Eagle3Draft, B=2, T=33, seed=1):
    g = torch.Generator().manual_seed(seed)
    cfg = m.config
    aux = torch.randn(B, T, cfg.num_aux * cfg.target_hidden_size, generator=g, dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    pos = torch.arange(T).expand(B, T)
    return aux, ids, pos


MLA = dict(attention="mla", mla_heads=3, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=6)  # the MLA layer (mla.py): values narrower than keys


@pytest.mark.parametrize(
    "variant", [dict(), dict(fc_norm=True, norm_output=True, num_layers=2), dict(MLA, num_layers=2)],
    ids=["eagle3", "3.1+2layers", "mla+2layers"]
)
@pytest.mark.parametrize("docs", [None, DOCS], ids=["one-doc", "packed"])
def test_ttt_forward_impls_agree(variant, docs):
    m = tiny_draft(**variant)
    aux, ids, pos = batch(m)
    with torch.no_grad():
        ref = m.ttt_forward(aux, ids, pos, docs, num_steps=3, attn_impl="naive")
        flex = m.ttt_forward(aux, ids, pos, docs, num_steps=3, attn_impl="flex")
    for a, b in zip(flex, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    # chunked (the CPU training path): outputs and every parameter's gradient
    params = [p for p in m.parameters() if p.requires_grad]
    w = [torch.randn_like(r) for r in ref]

    def grads(impl):
        out = m.ttt_forward(aux, ids, pos, docs, num_steps=3, attn_impl=impl)
        return out, torch.autograd.grad(sum((o * wi).sum() for o, wi in zip(out, w, strict=True)), params)

    (out_c, g_c), (out_n, g_n) = grads("chunked"), grads("naive")
    for a, b in zip(out_c + list(g_c), out_n + list(g_n), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    assert not m.embed_tokens.weight.requires_grad


@pytest.mark.parametrize("num_layers,norm_output,attention", [(1, False, {}), (2, True, {}), (2, False, MLA)],
                         ids=["1", "2+norm_output", "mla+2"])
def test_ttt_rows_equal_a_kv_cached_chain_and_the_uncached_forward(num_layers, norm_output, attention):
    """Row t of TTT step j is what inference computes: prefill rows 0..t with the target's
    states and tokens shifted by one, then feed each step's hidden output and the next true
    token, one row at a time, through the KV cache. This pins token shift, positions
    (+1 per step) and the attention pattern to an independent causal implementation."""
    m = tiny_draft(num_layers=num_layers, norm_output=norm_output, **attention)
    aux, ids, _ = batch(m, B=2, T=14)
    pos = torch.arange(14).expand(2, 14) + 3  # an offset start: positions are relative anyway
    steps, t = 4, 6
    with torch.no_grad():
        ttt = m.ttt_forward(aux, ids, pos, num_steps=steps, attn_impl="naive")
        cache = KVCache(num_layers)
        h, logits = m.forward_step(m.project_aux(aux[:, : t + 1]), ids[:, 1 : t + 2], pos[:, : t + 1] + 1, cache)
        torch.testing.assert_close(logits, ttt[0][:, : t + 1], rtol=1e-9, atol=1e-9)
        chain_h, chain_ids, chain_pos = [m.project_aux(aux[:, : t + 1])], [ids[:, 1 : t + 2]], [pos[:, : t + 1] + 1]
        h = h[:, t : t + 1]
        for j in range(1, steps):
            tok, p = ids[:, t + 1 + j : t + 2 + j], pos[:, t : t + 1] + 1 + j
            chain_h.append(h)
            chain_ids.append(tok)
            chain_pos.append(p)
            h, logits = m.forward_step(h, tok, p, cache)
            torch.testing.assert_close(logits[:, 0], ttt[j][:, t], rtol=1e-9, atol=1e-9)
        assert cache.length == t + steps
        # the same chain in one uncached causal forward
        _, full = m.forward_step(torch.cat(chain_h, 1), torch.cat(chain_ids, 1), torch.cat(chain_pos, 1))
        torch.testing.assert_close(full[:, t + 1 :], torch.stack([ttt[j][:, t] for j in range(1, steps)], 1),
                                   rtol=1e-9, atol=1e-9)
        # rolling back the last step and redoing it gives the same answer
        cache.crop(t + steps - 1)
        _, again = m.forward_step(chain_h[-1], chain_ids[-1], chain_pos[-1], cache)
        torch.testing.assert_close(again[:, 0], ttt[steps - 1][:, t], rtol=1e-9, atol=1e-9)


def test_later_layers_are_transformers_llama_layers():
    """Layer 1 (num_layers=2) is a plain Llama decoder layer: same weights, same output as
    transformers' LlamaDecoderLayer with its own rotary embedding (llama3 scaling)."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    m = tiny_draft(num_layers=2, rope_scaling=scaling, max_position_embeddings=64).float()
    c = m.config
    hf_cfg = transformers.LlamaConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=64, rope_parameters={"rope_theta": c.rope_theta, **scaling},
        attn_implementation="eager",
    )
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    hf = LlamaDecoderLayer(hf_cfg, layer_idx=1)  # fp32: HF's RMSNorm always computes in fp32
    hf.load_state_dict(m.layers[1].state_dict())
    x = torch.randn(2, 11, c.hidden_size)
    pos = torch.arange(11).expand(2, 11) + 20
    cos, sin = LlamaRotaryEmbedding(hf_cfg)(x, pos)
    causal = torch.full((11, 11), float("-inf")).triu(1)[None, None]
    want = hf(x, attention_mask=causal, position_ids=pos, position_embeddings=(cos, sin))
    want = want[0] if isinstance(want, tuple) else want
    my_cos, my_sin = m.rope(pos, x.dtype)
    torch.testing.assert_close(my_cos, cos)
    got = m.layers[1](x, None, my_cos, my_sin, A.cached_attention)
    torch.testing.assert_close(got, want)
    assert (got - x).abs().max() > 0.1  # the layer did something
    m.to(torch.bfloat16)  # casting the model must not round the RoPE frequencies
    torch.testing.assert_close(m.rope(pos, torch.float32)[0], cos)


def test_first_layer_input_order_and_residual():
    """q/k/v read cat(input_layernorm(embed(token)), hidden_norm(h)), embedding first; the
    residual is the un-normed h (hidden_norm(h) with norm_before_residual)."""
    for nbr in (False, True):
        m = tiny_draft(norm_before_residual=nbr)
        layer, H = m.layers[0], m.config.hidden_size
        h = 3 * torch.randn(2, 5, H, dtype=torch.float64)
        emb = torch.randn(2, 5, H, dtype=torch.float64)
        seen = []
        layer.self_attn.q_proj.register_forward_hook(lambda mod, args, out, seen=seen: seen.append(args[0]))
        cos, sin = m.rope(torch.arange(5).expand(2, 5), h.dtype)
        layer(h, emb, cos, sin, A.cached_attention)
        torch.testing.assert_close(seen[0], torch.cat([layer.input_layernorm(emb), layer.hidden_norm(h)], -1))
        with torch.no_grad():
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        out = layer(h, emb, cos, sin, A.cached_attention)
        torch.testing.assert_close(out, layer.hidden_norm(h) if nbr else h)


def test_fc_norm_and_norm_output():
    m = tiny_draft(fc_norm=True)
    aux, ids, pos = batch(m, T=6)
    with torch.no_grad():
        for n in m.fc_norm:
            n.weight.uniform_(0.5, 2.0)
        parts = aux.chunk(3, -1)
        normed = torch.cat([n(p) for n, p in zip(m.fc_norm, parts, strict=True)], -1)
        torch.testing.assert_close(m.project_aux(aux), m.fc(normed))
        assert (m.project_aux(aux) - m.fc(aux)).abs().max() > 1e-3
        # EAGLE-3.1 feeds the final-normed state forward; EAGLE-3 the residual stream
        h0 = m.project_aux(aux)
        pre, logits = m.forward_step(h0, ids, pos)
        m.config.norm_output = True
        post, logits_post = m.forward_step(h0, ids, pos)
        torch.testing.assert_close(post, m.norm(pre))
        torch.testing.assert_close(logits_post, logits)
        torch.testing.assert_close(logits, m.lm_head(m.norm(pre)))


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 512},
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 256, "beta_fast": 32,
         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    ],
    ids=["default", "linear", "llama3", "yarn-deepseek", "yarn"],
)
def test_rope_matches_transformers(scaling):
    head_dim, theta, max_pos = 64, 50000.0, 4096
    hf_cfg = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=max_pos,
        rope_parameters={"rope_theta": theta, **(scaling or {"rope_type": "default"})},
    )
    want, want_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg, "cpu") if scaling else (None, 1.0)
    got, got_scale = rope_inv_freq(head_dim, theta, scaling, max_pos)
    if want is None:
        want = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    torch.testing.assert_close(got, want.float())
    assert got_scale == pytest.approx(want_scale)


def test_unsupported_rope_type_is_an_error():
    with pytest.raises(ValueError, match="longrope"):
        tiny_config(rope_scaling={"rope_type": "longrope", "factor": 2.0})


# ---- names and shapes ---------------------------------------------------------------------


def test_parameter_names_and_shapes_follow_the_speculators_format():
    m = Eagle3Draft(tiny_config())
    H, Ht, V, N, I = 32, 24, 97, 40, 48  # noqa: E741
    want = {
        "embed_tokens.weight": (V, H), "fc.weight": (H, 3 * Ht),
        "layers.0.hidden_norm.weight": (H,), "layers.0.input_layernorm.weight": (H,),
        "layers.0.self_attn.q_proj.weight": (4 * 8, 2 * H), "layers.0.self_attn.k_proj.weight": (2 * 8, 2 * H),
        "layers.0.self_attn.v_proj.weight": (2 * 8, 2 * H), "layers.0.self_attn.o_proj.weight": (H, 4 * 8),
        "layers.0.post_attention_layernorm.weight": (H,),
        "layers.0.mlp.gate_proj.weight": (I, H), "layers.0.mlp.up_proj.weight": (I, H),
        "layers.0.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,), "lm_head.weight": (N, H), "d2t": (N,), "t2d": (V,),
    }
    sd = m.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == want
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert [n for n, p in m.named_parameters() if not p.requires_grad] == ["embed_tokens.weight"]

    m = Eagle3Draft(tiny_config(fc_norm=True, num_layers=2, attention_bias=True))
    sd = m.state_dict()
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(sd) and sd["fc_norm.0.weight"].shape == (Ht,)
    assert "layers.1.hidden_norm.weight" not in sd
    assert sd["layers.1.self_attn.q_proj.weight"].shape == (4 * 8, H)  # H-wide input after layer 0
    assert sd["layers.0.self_attn.q_proj.bias"].shape == (4 * 8,)


# ---- sizes from target configs --------------------------------------------------------------


def test_from_llama_config():
    hf = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=704, num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
        rms_norm_eps=1e-5, max_position_embeddings=2048,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    )
    c = DraftConfig.from_target_config(hf, draft_vocab_size=300)
    assert (c.hidden_size, c.target_hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        256, 256, 8, 2, 32)
    assert (c.intermediate_size, c.vocab_size, c.draft_vocab_size, c.rms_norm_eps) == (704, 1000, 300, 1e-5)
    assert c.rope_theta == 500000.0 and c.rope_scaling["rope_type"] == "llama3"
    assert c.rope_scaling["original_max_position_embeddings"] == 1024 and "rope_theta" not in c.rope_scaling
    assert c.num_layers == 1 and not c.attention_bias
    c = DraftConfig.from_target_config(hf, 300, num_layers=2, fc_norm=True)
    assert c.num_layers == 2 and c.fc_norm
    with pytest.raises(TypeError, match="num_layer"):
        DraftConfig.from_target_config(hf, 300, num_layer=2)
    Eagle3Draft(DraftConfig.from_target_config(hf, 300))  # builds


def test_from_qwen3_config_keeps_its_head_dim():
    hf = transformers.Qwen3Config(hidden_size=128, intermediate_size=384, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=64, vocab_size=500)
    c = DraftConfig.from_target_config(hf, 100)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size) == (4, 2, 64, 384)
    assert c.rope_scaling is None
    m = Eagle3Draft(c)
    assert m.layers[0].self_attn.q_proj.weight.shape == (4 * 64, 2 * 128)


def test_from_deepseek_v3_config_dense_gqa_draft():
    hf = transformers.DeepseekV3Config(
        hidden_size=512, intermediate_size=1408, moe_intermediate_size=128, n_routed_experts=8,
        num_attention_heads=16, num_key_value_heads=16, vocab_size=800, num_hidden_layers=4,
        kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
    )
    c = DraftConfig.from_target_config(hf, 100)
    # MLA heads do not carry over: standard GQA, head_dim 128, 8 KV heads when they divide
    assert (c.head_dim, c.num_attention_heads, c.num_key_value_heads) == (128, 4, 4)
    assert c.intermediate_size == 1408  # the dense layers' width, not the expert width (128)
    big = transformers.DeepseekV3Config(hidden_size=7168, num_attention_heads=128, vocab_size=1000,
                                        num_hidden_layers=1)
    c = DraftConfig.from_target_config(big, 100)
    assert (c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size) == (128, 56, 8, 18432)


def test_moe_intermediate_size_rule():
    qwen_moe = transformers.Qwen3MoeConfig(hidden_size=256, intermediate_size=768, moe_intermediate_size=64,
                                           num_experts=8, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=64, vocab_size=300)
    assert DraftConfig.from_target_config(qwen_moe, 100).intermediate_size == 768
    mixtral = transformers.MixtralConfig(hidden_size=200, intermediate_size=200, num_local_experts=4,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    assert DraftConfig.from_target_config(mixtral, 100).intermediate_size == 1024  # 4 x 200 -> 256-multiple
    assert is_moe_config(mixtral) and not is_moe_config(transformers.LlamaConfig())


def test_multimodal_wrapper_uses_the_text_config():
    hf = transformers.Qwen2VLConfig(text_config=dict(hidden_size=128, intermediate_size=352, num_attention_heads=4,
                                                     num_key_value_heads=2, vocab_size=400))
    c = DraftConfig.from_target_config(hf, 50)
    assert (c.hidden_size, c.intermediate_size, c.vocab_size) == (128, 352, 400)
