"""The DFlash draft type (eaglet/draft/dflash/) on tiny CPU models, fp64 where numbers are compared:

- the block loss against a written-out reference (a plain loop over anchors and slots, each
  block's attention built by hand from its document's earlier rows);
- the proposer's cached path against the training forward, and replay's hits against the proposer;
- flex attention (CPU, forward) against the dense masked SDPA, and the BlockMask's tiles against
  the one mask definition;
- the export against vLLM 0.25.0's qwen3_dflash loader (written down as data below, with its
  source lines) and its speculators config converter (algos.py, run from the unpacked source),
  and speculators 0.9.0 loading the export and giving eaglet's logits (in .venv-speculators);
- the anchors: inside their documents, at most max_anchors per document, the same per seed.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglet.draft import draft_type, draft_type_of
from eaglet.draft.dflash import DFlashConfig, DFlashDraft, block_hits, default_target_layers
from eaglet.draft.dflash.attention import SPARSE_BLOCK, BlockLayout, block_attention
from eaglet.draft.dflash.loss import block_loss, select_anchors
from eaglet.errors import ConfigError
from eaglet.formats import loaders

dflash = draft_type("dflash")
REPO = Path(__file__).resolve().parents[1]
SPECULATORS_PYTHON = REPO / ".venv-speculators" / "bin" / "python"
VLLM_ALGOS = Path("/work/wheels/vllm-src/vllm/transformers_utils/configs/speculators/algos.py")


def settings(**kw) -> SimpleNamespace:
    base = dict(block_size=4, layers=2, gamma=7.0, max_anchors=512, mask_token_id=None, causal=False,
                target_layers=None)
    return SimpleNamespace(dflash=SimpleNamespace(**{**base, **kw}))


def tiny_draft(seed: int = 0, draft_vocab: int = 40, causal: bool = False, block_size: int = 4,
               num_layers: int = 2) -> DFlashDraft:
    torch.manual_seed(seed)
    cfg = DFlashConfig(hidden_size=32, target_hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       intermediate_size=64, vocab_size=50, draft_vocab_size=draft_vocab, mask_token_id=49,
                       target_layers=[1, 3], num_aux=2, num_layers=num_layers, block_size=block_size, causal=causal)
    draft = DFlashDraft(cfg)
    with torch.no_grad():  # norms away from 1, a reduced vocabulary with a real map
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
        if draft_vocab < cfg.vocab_size:
            target_ids = torch.randperm(cfg.vocab_size)[:draft_vocab].sort().values
            draft.d2t.copy_(target_ids - torch.arange(draft_vocab))
            draft.t2d.zero_()
            draft.t2d[target_ids] = True
    return draft


def packed(T: int = 40, doc_lens=(15, 25), seed: int = 1, A: int = 64, vocab: int = 50):
    g = torch.Generator().manual_seed(seed)
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(doc_lens)])[None]
    pos = torch.cat([torch.arange(n) for n in doc_lens])[None]
    aux = torch.randn(1, T, A, generator=g, dtype=torch.float64)
    ids = torch.randint(0, vocab, (1, T), generator=g)
    loss_mask = torch.rand(1, T, generator=g) > 0.25
    return aux, ids, pos, docs, loss_mask


# ---- (a) the loss against a written-out reference ------------------------------------------------


def reference_block(draft: DFlashDraft, aux, ids, pos, docs, a: int, L: int) -> torch.Tensor:
    """Logits [L-1, V] of the block anchored at row a, every piece written out: its context is
    the rows c < a of a's document, its keys [context | block], its softmax by hand."""
    c = draft.config
    context_rows = [r for r in range(aux.shape[1]) if docs[0, r] == docs[0, a] and r < a]
    block_ids = torch.tensor([int(ids[0, a])] + [c.mask_token_id] * (L - 1))
    block_pos = int(pos[0, a]) + torch.arange(L)
    context = draft.hidden_norm(draft.fc(aux[0, context_rows]))
    h = draft.embed_tokens(block_ids).to(aux.dtype)

    def rotate(x, positions):  # x [T, heads, D]
        cos, sin = draft.rope(positions[None], x.dtype)
        half = x.shape[-1] // 2
        turned = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos[0][:, None] + turned * sin[0][:, None]

    group = c.num_attention_heads // c.num_key_value_heads
    for layer in draft.layers:
        att = layer.self_attn
        x = layer.input_layernorm(h)
        q = rotate(att.q_norm(att.q_proj(x).view(L, -1, c.head_dim)), block_pos)
        keys = torch.cat([rotate(att.k_norm(att.k_proj(context).view(len(context_rows), c.num_key_value_heads, c.head_dim)),
                                 pos[0, context_rows]),
                          rotate(att.k_norm(att.k_proj(x).view(L, c.num_key_value_heads, c.head_dim)), block_pos)])
        values = torch.cat([att.v_proj(context), att.v_proj(x)]).view(-1, c.num_key_value_heads, c.head_dim)
        out = torch.zeros(L, c.num_attention_heads, c.head_dim, dtype=aux.dtype)
        for i in range(L):
            seen = len(context_rows) + (i + 1 if c.causal else L)
            for head in range(c.num_attention_heads):
                kh = keys[:seen, head // group]
                weights = torch.softmax(kh @ q[i, head] / math.sqrt(c.head_dim), 0)
                out[i, head] = weights @ values[:seen, head // group]
        h = h + att.o_proj(out.reshape(L, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return draft.lm_head(draft.norm(h[1:]))


def reference_loss(draft, aux, ids, pos, docs, loss_mask, in_vocab, teacher, anchors, gamma):
    L, T = draft.config.block_size, ids.shape[1]
    weighted, counted_total = 0.0, 0
    correct, counts, sums, n_slot = [[0] * (L - 1) for _ in range(4)]
    for a in anchors.tolist():
        logits = reference_block(draft, aux, ids, pos, docs, a, L)
        run = True
        for k in range(1, L):
            t = a + k
            counted = t < T and bool(loss_mask[0, t]) and bool(in_vocab[0, t - 1]) and docs[0, t] == docs[0, a]
            if counted:
                p = teacher[0, t - 1]
                ce = -(p * torch.log_softmax(logits[k - 1], -1)).sum()
                weighted = weighted + math.exp(-(k - 1) / gamma) * ce
                sums[k - 1] = sums[k - 1] + ce
                n_slot[k - 1] += 1
                counted_total += 1
                counts[k - 1] += int(run)
            right = counted and int(logits[k - 1].argmax()) == int(p.argmax())
            run = run and right
            correct[k - 1] += int(run)
    losses = [s / max(n, 1) for s, n in zip(sums, n_slot)]
    return weighted / max(counted_total, 1), losses, correct, counts


@pytest.mark.parametrize("causal", [False, True])
def test_block_loss_matches_the_written_out_reference(causal):
    draft = tiny_draft(causal=causal).double()
    aux, ids, pos, docs, loss_mask = packed()
    g = torch.Generator().manual_seed(3)
    in_vocab = torch.rand(1, 40, generator=g) > 0.2
    # A sharp teacher whose argmax is often the draft's own: the block accuracies count real runs.
    teacher = torch.softmax(4 * torch.randn(1, 40, draft.config.draft_vocab_size, generator=g, dtype=torch.float64), -1)
    rows = dflash.host_rows(loss_mask, docs, settings(causal=causal), seed=5)
    with torch.no_grad():
        logits = draft.block_logits(aux, ids, pos, rows["anchors"], rows["starts"])
        for j, a in enumerate(rows["anchors"].tolist()):  # every third row's teacher: the draft's argmax
            for k in range(0, 3, 1 + j % 2):
                teacher[0, a + k] = torch.softmax(4 * logits[j, k], -1)
    batch = SimpleNamespace(aux=aux, input_ids=ids, position_ids=pos, doc_ids=docs, loss_mask=loss_mask, rows=rows)
    out = dflash.loss(draft, draft, batch, teacher, in_vocab, settings(causal=causal), compiled=False)
    total, losses, correct, counts = reference_loss(draft, aux, ids, pos, docs, loss_mask, in_vocab, teacher,
                                                    rows["anchors"], 7.0)
    torch.testing.assert_close(out.total, total, rtol=1e-10, atol=1e-12)
    for got, want in zip(out.losses, losses, strict=True):
        torch.testing.assert_close(got, torch.as_tensor(want, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    assert [int(c) for c in out.correct] == correct and [int(n) for n in out.counts] == counts
    assert correct[0] > 0 and counts[1] > 0  # the accuracy terms were exercised
    out.total.backward()
    assert draft.fc.weight.grad is not None and draft.embed_tokens.weight.grad is None


def test_a_micro_batch_without_anchors_has_a_zero_loss_that_backpropagates():
    draft = tiny_draft().double()
    aux, ids, pos, docs, _ = packed()
    no_loss = torch.zeros(1, 40, dtype=torch.bool)
    batch = SimpleNamespace(aux=aux, input_ids=ids, position_ids=pos, doc_ids=docs, loss_mask=no_loss, rows=None)
    teacher = torch.full((1, 40, 40), 1 / 40, dtype=torch.float64)
    out = dflash.loss(draft, draft, batch, teacher, torch.ones(1, 40, dtype=torch.bool), settings(), compiled=False)
    assert float(out.total.detach()) == 0 and [int(n) for n in out.counts] == [0, 0, 0]
    out.total.backward()


def test_reference_sees_the_difference_between_context_before_and_at_the_anchor():
    """The reference is sharp enough to catch a mask off by one row (the anchor's own state)."""
    draft = tiny_draft().double()
    aux, ids, pos, docs, _ = packed()
    with torch.no_grad():
        ref = reference_block(draft, aux, ids, pos, docs, 20, 4)
        aux2 = aux.clone()
        aux2[0, 20] += 1.0  # the anchor's own row is not context
        assert torch.equal(reference_block(draft, aux2, ids, pos, docs, 20, 4), ref)
        got = draft.block_logits(aux2, ids, pos, torch.tensor([20]), torch.tensor([15]))[0]
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


# ---- (b) the proposer's cached path is the training path -----------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_proposer_logits_equal_the_training_forward_and_replay_hits_equal_proposals(causal):
    draft = tiny_draft(causal=causal).double()
    aux, ids, _, _, _ = packed(T=18, doc_lens=(18,))
    pos = torch.arange(18)[None]
    proposer = dflash.proposer(draft)
    proposer.extend(aux[0, :5], ids[0, 1:6].tolist(), 0)
    proposer.extend(torch.randn(4, 64, dtype=torch.float64), [0] * 4, 5)  # a draft later rejected
    proposer.extend(aux[0, 5:12], ids[0, 6:13].tolist(), 5)  # replaces rows 5..8
    assert proposer.length == 12
    with torch.no_grad():
        for Q in (0, 7, 12):
            want = draft.block_logits(aux, ids, pos, torch.tensor([Q]), torch.tensor([0]))[0]
            context = [(k[:, :, :Q], v[:, :, :Q]) for k, v in proposer.cache]
            got = draft.cached_block_logits(int(ids[0, Q]), Q, 3, context)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
            tokens, qs = proposer.propose(int(ids[0, Q]), Q, 3, 0.0, None)
            assert tokens == draft.draft_to_target(want.argmax(-1)).tolist() and qs == []
    proposer.extend(aux[0, 12:], ids[0, 13:].tolist() + [0], 12)
    for k in (3, 2):
        hits = block_hits(draft, aux[0], ids[0], k, anchors_per_pass=5)
        for Q in range(18):
            tokens, _ = proposer.propose(int(ids[0, Q]), Q, k, 0.0, None)
            want = [Q + i < 18 and tokens[i - 1] == int(ids[0, Q + i]) for i in range(1, k + 1)]
            assert hits[Q].tolist() == want, Q
    tokens, qs = proposer.propose(int(ids[0, 7]), 7, 3, 0.8, torch.Generator().manual_seed(0))
    assert len(qs) == 3 and all(q.dtype == torch.float64 and abs(float(q.sum()) - 1) < 1e-9 for q in qs)
    assert set(tokens) <= set(draft.draft_to_target(torch.arange(40)).tolist())
    with pytest.raises(ValueError, match="eval.chain_tokens"):
        proposer.propose(1, 7, 4, 0.0, None)


def test_chain_hits_are_exact_for_a_draft_that_predicts_the_sequence():
    """hits[Q, i-1] compares slot i with token Q+i: planted in the draft's own greedy output."""
    draft = tiny_draft(draft_vocab=50).double()
    aux, ids, _, _, _ = packed(T=10, doc_lens=(10,))
    with torch.no_grad():
        logits = draft.block_logits(aux, ids, torch.arange(10)[None], torch.tensor([4]), torch.tensor([0]), 3)[0]
    ids[0, 5:7] = logits.argmax(-1)  # block at 4 drafts x[5], x[6]; it reads x[4] and rows < 4 only
    hits = block_hits(draft, aux[0], ids[0], 2)
    assert hits[4].tolist() == [True, True]


# ---- (c) flex and dense: one mask ---------------------------------------------------------------


def layout_case(causal: bool) -> BlockLayout:
    doc_lens = (70, 9, 150, 40)  # a document shorter than a block, tiles spanning documents
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(doc_lens)])[None]
    loss_mask = torch.ones_like(docs, dtype=torch.bool)
    rows = select_anchors(loss_mask, docs, 5, 30, seed=2)
    return BlockLayout(rows["anchors"], rows["starts"], docs.shape[1], 5, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_flex_and_dense_attention_agree_and_the_block_mask_follows_the_mask(causal):
    layout = layout_case(causal)
    assert layout.Q > 2 * SPARSE_BLOCK
    dense = layout.dense()
    bm = layout.block_mask()
    n = SPARSE_BLOCK
    for i in range(-(-layout.Q // n)):
        partial = set(bm.kv_indices[0, 0, i, : bm.kv_num_blocks[0, 0, i]].tolist())
        full = set(bm.full_kv_indices[0, 0, i, : bm.full_kv_num_blocks[0, 0, i]].tolist())
        assert not partial & full
        for j in range(-(-layout.KV // n)):
            tile = dense[i * n : (i + 1) * n, j * n : (j + 1) * n]
            if j in full:
                assert bool(tile.all()), (i, j)
            elif j not in partial:
                assert not bool(tile.any()), (i, j)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, layout.Q, 8, generator=g)
    k, v = (torch.randn(1, 2, layout.KV, 8, generator=g) for _ in range(2))
    want = block_attention(q, k, v, layout, "dense", chunk=100)
    try:
        got = block_attention(q, k, v, layout, "flex")
    except (NotImplementedError, RuntimeError) as e:  # a torch without CPU flex attention
        pytest.skip(f"flex_attention does not run on this CPU build: {e}")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compiled_flex_traces_one_graph_for_every_micro_batch_size():
    """The mask closes over tensors, not over each micro-batch's sizes: a compiled flex_attention
    (dynamic, as attention.flex compiles it on CUDA; the eager backend here) traces it once."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(flex_attention, backend="eager", dynamic=True)
    for i, doc_lens in enumerate([(300, 9, 500), (400, 700), (100, 17, 300, 40)]):
        docs = torch.cat([torch.full((n,), d) for d, n in enumerate(doc_lens)])[None]
        rows = select_anchors(torch.ones_like(docs, dtype=torch.bool), docs, 8, 20 + 7 * i, seed=i)
        layout = BlockLayout(rows["anchors"], rows["starts"], docs.shape[1], 8, False)
        q = torch.randn(1, 4, layout.Q, 16)
        k, v = torch.randn(1, 2, layout.KV, 16), torch.randn(1, 2, layout.KV, 16)
        out = compiled(q, k, v, block_mask=layout.block_mask(), scale=0.25, enable_gqa=True)
        torch.testing.assert_close(out, block_attention(q, k, v, layout, "dense"), rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


def test_dense_mask_is_the_documented_rule():
    layout = layout_case(causal=False)
    dense = layout.dense()
    for j in (0, 7, layout.M - 1):
        a, s = int(layout.anchors[j]), int(layout.starts[j])
        row = dense[j * 5 + 2]
        assert row[:layout.N].nonzero().flatten().tolist() == list(range(s, a))
        assert row[layout.N:].nonzero().flatten().tolist() == list(range(j * 5, j * 5 + 5))


# ---- (d) the export, against vLLM 0.25.0's loader and speculators 0.9.0 ---------------------------

def vllm_update_dflash():
    if not VLLM_ALGOS.exists():
        return None
    spec = importlib.util.spec_from_file_location("vllm_speculators_algos", VLLM_ALGOS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SUPPORTED_SPECULATORS_TYPES["dflash"]


@pytest.mark.parametrize("draft_vocab", [40, 50])
def test_export_matches_what_vllm_0_25_loads(draft_vocab):
    draft = tiny_draft(draft_vocab=draft_vocab, num_layers=3)
    config, weights = dflash.serving(draft, {"verifier_name_or_path": "/t", "verifier_architectures": ["Qwen3ForCausalLM"],
                                             "dtype": "float32"})
    reduced = draft_vocab < 50
    # every tensor goes into a parameter of vLLM's DFlashQwen3ForCausalLM, every needed parameter
    # (each shard of the stacked q/k/v and gate/up) is filled (eaglet/formats/loaders.py, as data)
    params = loaders.dflash_vllm_parameters(config["transformer_layer_config"])
    problems, d2t = loaders._match({n: tuple(w.shape) for n, w in weights.items()}, params,
                                   loaders.dflash_vllm_target, "vLLM")
    assert problems == [] and (d2t == {"d2t"}) == reduced
    assert {n for n, needed in params.items() if needed} >= {"model.layers.2.self_attn.qkv_proj.weight",
                                                              "model.fc.weight", "model.hidden_norm.weight"}
    assert ("t2d" in weights) == ("d2t" in weights) == reduced
    assert weights["fc.weight"].shape == (32, 2 * 32)  # vLLM: target_hidden_size * len(target_layer_ids)
    # the speculators keys vLLM reads (speculators/base.py validate_speculators_config, algos.py update_dflash)
    assert config["speculators_model_type"] == "dflash"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["speculators_config"]["verifier"]["name_or_path"] == "/t"
    assert config["mask_token_id"] == 49 and config["block_size"] == 4
    assert config["aux_hidden_state_layer_ids"] == [1, 3] and config["draft_vocab_size"] == draft_vocab
    update = vllm_update_dflash()
    if update is None:
        pytest.skip(f"no vLLM source at {VLLM_ALGOS}")
    hf = dict(config["transformer_layer_config"])
    update(config_dict=config, pre_trained_config=hf)
    assert hf["architectures"] == ["DFlashDraftModel"]
    assert hf["eagle_aux_hidden_state_layer_ids"] == [1, 3]  # what vLLM's runner captures: HF indices
    assert hf["dflash_config"] == {"mask_token_id": 49, "target_layer_ids": [0, 2]}  # z-lab's: HF - 1
    assert "causal" not in hf["dflash_config"]  # so vLLM 0.25.0 runs the block non-causal
    assert hf["num_hidden_layers"] == 3 and hf["model_type"] == "qwen3"


def test_export_refuses_what_vllm_would_serve_otherwise():
    with pytest.raises(ValueError, match="causal"):
        dflash.serving(tiny_draft(causal=True), {})
    with pytest.raises(ValueError, match="num_speculative_tokens 4"):
        dflash.serving(tiny_draft(), {"num_speculative_tokens": 4})
    with pytest.raises(ValueError, match="target layer ids"):
        dflash.serving(tiny_draft(), {"aux_layer_ids": [1, 2, 3]})


# Runs in .venv-speculators. argv[1]: JSON list of {export, io, out}. Loads each export with
# speculators' DFlashDraftModel.from_pretrained (its verifier a local tiny target) and runs its
# block forward at the given anchors (its random anchor choice replaced), eager attention.
SPECULATORS_CHILD = r"""
import json, sys
import torch
from importlib.metadata import version
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from speculators.models.attention import create_float_mask
from speculators.models.dflash import DFlashDraftModel, core

reports = []
for case in json.loads(sys.argv[1]):
    io = load_file(case["io"])
    core.select_anchors = lambda loss_mask, n, b: (io["anchors"], torch.ones_like(io["anchors"], dtype=torch.bool))
    model = DFlashDraftModel.from_pretrained(case["export"], dtype=torch.float64).eval()
    model._create_mask_fn = create_float_mask
    model.config.transformer_layer_config._attn_implementation = "eager"
    with safe_open(case["export"] + "/model.safetensors", "pt") as f:
        file = {k: f.get_tensor(k) for k in f.keys()}
    state = model.state_dict()
    T = io["input_ids"].shape[1]
    with torch.no_grad():
        _, logits, *_ = model._backbone_forward(
            hidden_states=io["aux"], input_ids=io["input_ids"], loss_mask=torch.ones(1, T),
            verifier_last_hidden_states=torch.zeros(1, T, model.hidden_size, dtype=torch.float64),
            document_ids=io["document_ids"], position_ids=io["position_ids"], max_anchors=io["anchors"].numel())
    save_file({"logits": logits.contiguous()}, case["out"])
    cfg = model.config
    reports.append({
        "speculators": version("speculators"),
        "unexpected": sorted(set(file) - set(state)),
        "not_from_file": sorted(set(state) - set(file)),
        "differs_from_file": sorted(k for k in file if k in state and not torch.equal(state[k], file[k].to(state[k].dtype))),
        "aux_layer_ids": list(cfg.aux_hidden_state_layer_ids),
        "mask_token_id": cfg.mask_token_id, "block_size": cfg.block_size,
        "speculative_tokens": cfg.speculators_config.proposal_methods[0].speculative_tokens,
    })
print("REPORT " + json.dumps(reports))
"""


def tiny_verifier(folder: Path, draft: DFlashDraft) -> None:
    """A local stand-in for the target: speculators reads its embedding (always, over the file's),
    its LM head (the draft's own when the vocabulary is full: speculators takes the verifier's
    there) and final norm."""
    c = draft.config
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": c.hidden_size,
        "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "vocab_size": c.vocab_size, "tie_word_embeddings": False}))
    head = draft.lm_head.weight.detach().clone() if c.draft_vocab_size == c.vocab_size else torch.randn(c.vocab_size, 32)
    save_file({"model.embed_tokens.weight": draft.embed_tokens.weight.detach().clone(), "lm_head.weight": head,
               "model.norm.weight": torch.ones(c.hidden_size)}, str(folder / "model.safetensors"))


@pytest.mark.skipif(not SPECULATORS_PYTHON.exists(),
                    reason="no .venv-speculators: `bash scripts/speculators_venv.sh` creates it (speculators 0.9.0)")
def test_speculators_loads_the_export_and_gives_eaglet_logits(tmp_path):
    aux, ids, pos, docs, loss_mask = packed()
    anchors = torch.tensor([0, 3, 11, 15, 16, 22, 30, 36])
    cases, expected = [], {}
    for name, vocab in (("reduced", 40), ("full", 50)):
        draft = tiny_draft(draft_vocab=vocab).double()
        tiny_verifier(tmp_path / name / "verifier", draft)
        config, weights = dflash.serving(draft, {"verifier_name_or_path": str(tmp_path / name / "verifier"),
                                                 "verifier_architectures": ["Qwen3ForCausalLM"], "dtype": "float32"})
        export = tmp_path / name / "export"
        export.mkdir()
        (export / "config.json").write_text(json.dumps(config))
        save_file({k: v.double() if v.is_floating_point() else v for k, v in weights.items()},
                  str(export / "model.safetensors"))
        with torch.no_grad():
            starts = torch.where(docs[0, anchors] == 0, 0, 15)
            expected[name] = draft.block_logits(aux, ids, pos, anchors, starts)
        save_file({"aux": aux, "input_ids": ids, "document_ids": docs, "position_ids": pos, "anchors": anchors},
                  str(tmp_path / name / "io.safetensors"))
        cases.append({"export": str(export), "io": str(tmp_path / name / "io.safetensors"),
                      "out": str(tmp_path / name / "out.safetensors")})
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([str(SPECULATORS_PYTHON), "-c", SPECULATORS_CHILD, json.dumps(cases)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    reports = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("REPORT ")).removeprefix("REPORT "))
    for (name, want), report, case in zip(expected.items(), reports, cases, strict=True):
        assert report["speculators"] == "0.9.0"
        assert report["unexpected"] == [] and report["differs_from_file"] == [], name
        # training-only weights, and the embedding it always takes from the verifier
        assert report["not_from_file"] == ["embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"]
        assert report["aux_layer_ids"] == [1, 3] and report["mask_token_id"] == 49 and report["block_size"] == 4
        assert report["speculative_tokens"] == 3
        got = load_file(case["out"])["logits"].view(len(anchors), 4, -1)[:, 1:]
        # Qwen3RMSNorm normalises in fp32 even in an fp64 model: agreement to fp32 rounding, not fp64's.
        assert float(want.abs().mean()) > 1e-2
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda s, name=name: f"{name}: {s}")


# ---- (e) anchors, layers and the registry ---------------------------------------------------------


def test_anchors_stay_in_their_documents_and_are_the_same_per_seed():
    doc_lens = (30, 3, 50, 17)
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(doc_lens)])[None]
    loss_mask = torch.rand(1, docs.shape[1], generator=torch.Generator().manual_seed(0)) > 0.3
    B, cap = 4, 9
    rows = dflash.host_rows(loss_mask, docs, settings(block_size=B, max_anchors=cap), seed=11)
    a = rows["anchors"]
    assert a.dtype == torch.int64 and torch.equal(a, a.sort().values) and len(a.unique()) == len(a)
    d = docs[0]
    assert bool((d[a + B - 1] == d[a]).all()) and bool(loss_mask[0, a + 1].all())
    starts = torch.tensor([sum(doc_lens[:i]) for i in range(len(doc_lens))])
    assert torch.equal(rows["starts"], starts[d[a]])
    per_doc = torch.bincount(d[a], minlength=len(doc_lens))
    candidates = [sum(1 for t in range(len(d) - B + 1) if d[t] == i and d[t + B - 1] == i and loss_mask[0, t + 1])
                  for i in range(len(doc_lens))]
    assert per_doc.tolist() == [min(n, cap) for n in candidates]  # every candidate up to the cap
    again = dflash.host_rows(loss_mask, docs, settings(block_size=B, max_anchors=cap), seed=11)
    other = dflash.host_rows(loss_mask, docs, settings(block_size=B, max_anchors=cap), seed=12)
    assert torch.equal(again["anchors"], a) and not torch.equal(other["anchors"], a)


def test_layers_follow_zlab_and_the_config():
    assert default_target_layers(36, 5) == [2, 10, 18, 26, 34]  # z-lab's Qwen3-8B [1, 9, 17, 25, 33], + 1
    assert default_target_layers(36, 1) == [19]
    assert dflash.layers(36, settings(layers=5)) == [2, 10, 18, 26, 34]
    assert dflash.layers(36, settings(target_layers=[3, 7])) == [3, 7]
    with pytest.raises(ConfigError, match="dflash.target_layers"):
        dflash.layers(36, settings(target_layers=[3, 37]))
    with pytest.raises(ConfigError, match="dflash"):
        dflash.layers(36, SimpleNamespace())


def test_build_records_the_mask_token_and_round_trips():
    target = SimpleNamespace(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             intermediate_size=64, vocab_size=50, num_hidden_layers=8, rms_norm_eps=1e-6,
                             rope_theta=10000.0, max_position_embeddings=256)
    draft = dflash.build(settings(), target, 40, 2)
    assert draft.config.mask_token_id == 49 and draft.config.target_layers == [2, 6]
    assert draft_type_of(draft) is dflash and dflash.num_positions(settings()) == 3
    again = dflash.from_config(json.loads(json.dumps(draft.config.to_dict())))
    assert again.config == draft.config and again.state_dict().keys() == draft.state_dict().keys()
    assert dflash.build(settings(mask_token_id=7), target, 40, 2).config.mask_token_id == 7
    with pytest.raises(ConfigError, match="mask_token_id"):
        dflash.build(settings(mask_token_id=50), target, 40, 2)
    with pytest.raises(ConfigError, match="concatenate 3"):
        dflash.build(settings(), target, 40, 3)
    assert dflash.shard_units(draft) == list(draft.layers) and dflash.unroll_linears(draft) is None
