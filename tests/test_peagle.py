"""P-EAGLE (eaglet/draft/peagle): the sampled-depth loss against a written-out reference (plain
loops over elements, a hand-built attention mask), the cached one-forward proposer against the
training forward and in a greedy decoder against a tiny target, the sampled depth rows (sizes,
subsets, seed), and the speculators `peagle` export as vLLM 0.25.0 reads it (its update_peagle
run where its source is unpacked) and as speculators 0.9.0 runs it (in .venv-speculators)."""

import importlib.util
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglet.draft import draft_type, draft_type_of
from eaglet.draft import peagle
from eaglet.draft.eagle3.loss import step_mask
from eaglet.draft.peagle.loss import depth_loss, depth_ratio, host_rows, sample_depth_rows
from eaglet.draft.peagle.model import PeagleConfig, PeagleDraft, auto_mask_token_id
from eaglet.engines.hf.decode import TargetRunner, keep_cache_rows, new_cache, plain_generate
from eaglet.formats.loaders import VLLM_KEYS, _match, config_value, vllm_parameters, vllm_target
from eaglet.testing.tiny import build_model

REPO = Path(__file__).resolve().parents[1]
SPECULATORS_PYTHON = REPO / ".venv-speculators" / "bin" / "python"
VLLM_ALGOS = Path("/work/wheels/vllm-src/vllm/transformers_utils/configs/speculators/algos.py")
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]


def tiny_draft(seed: int = 0, **kw) -> PeagleDraft:
    base = dict(hidden_size=32, target_hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=48, vocab_size=97, draft_vocab_size=40, rope_theta=5e5, rope_scaling=LLAMA3_ROPE,
                max_position_embeddings=512, rms_norm_eps=1e-5, num_layers=2, mask_token_id=7, num_depths=4)
    torch.manual_seed(seed)
    m = PeagleDraft(PeagleConfig(**{**base, **kw}))
    m.reset_parameters(std=0.3)  # large enough that every weight moves the logits
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
        c = m.config
        used = torch.randperm(c.vocab_size)[: c.draft_vocab_size].sort().values
        m.d2t.copy_(used - torch.arange(c.draft_vocab_size))
        m.t2d.zero_()
        m.t2d[used] = True
    return m


def packed_batch(T: int = 40, seed: int = 1, A: int = 96):
    """Two documents (positions restarting), a loss mask with holes, ids, states, teacher."""
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, T, A, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 97, (1, T), generator=g)
    split = T // 2
    docs = torch.cat([torch.zeros(split, dtype=torch.long), torch.ones(T - split, dtype=torch.long)])[None]
    pos = torch.cat([torch.arange(split), torch.arange(T - split)])[None]
    loss_mask = torch.rand(1, T, generator=g) > 0.15
    loss_mask[0, :3] = False
    in_vocab = torch.rand(1, T, generator=g) > 0.1
    teacher = torch.softmax(torch.randn(1, T, 40, generator=g, dtype=torch.float64) * 2, -1)
    return aux, ids, pos, docs, loss_mask, in_vocab, teacher


# ---- (a) the loss against a written-out reference ------------------------------------------------


def reference_loss(m: PeagleDraft, aux, ids, pos, docs, loss_mask, in_vocab, teacher, rows):
    """Every element (t, d) written out: its input, its position, the elements it sees (a dense
    mask built element by element), its teacher row and whether it counts; one plain forward
    through the draft's layers over all elements at once. Returns (total, [loss_d], [correct_d],
    [count_d])."""
    T = ids.shape[1]
    elements = [(t, 0) for t in range(T)] + [(int(r), d) for d in range(1, len(rows)) for r in rows[d]]
    E = len(elements)
    fc_states = m.fc(aux[0])
    mask_state = m.fc(m.mask_hidden)
    hidden = torch.stack([fc_states[t] if d == 0 else mask_state for t, d in elements])[None]
    tokens = torch.tensor([[(int(ids[0, t + 1]) if t + 1 < T else 0) if d == 0 else m.config.mask_token_id
                            for t, d in elements]])
    positions = torch.tensor([[int(pos[0, t]) + 1 + d for t, d in elements]])
    sees = torch.zeros(E, E, dtype=torch.bool)
    for i, (t, d) in enumerate(elements):
        for j, (u, e) in enumerate(elements):
            context = e == 0 and u <= t and docs[0, u] == docs[0, t]
            own_chain = u == t and 1 <= e <= d
            sees[i, j] = context or own_chain

    def attend(layer, q, k, v):
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        return scores.masked_fill(~sees, float("-inf")).softmax(-1) @ v

    _, logits = m.step(hidden, tokens, positions, attend)
    depths = len(rows)
    ce_sum = [torch.zeros((), dtype=torch.float64) for _ in range(depths)]
    correct, count = [0] * depths, [0] * depths
    for i, (t, d) in enumerate(elements):
        target = t + 2 + d  # the token this element predicts
        if target >= T or not (loss_mask[0, target] and in_vocab[0, t + 1 + d] and docs[0, target] == docs[0, t]):
            continue
        z, p = logits[0, i], teacher[0, t + 1 + d]
        ce_sum[d] = ce_sum[d] + torch.logsumexp(z, -1) - (p * z).sum()
        correct[d] += int(z.argmax() == p.argmax())
        count[d] += 1
    losses = [s / max(n, 1) for s, n in zip(ce_sum, count)]
    return sum(ce_sum) / max(sum(count), 1), losses, correct, count


@pytest.mark.parametrize("attn_impl", ["naive", "chunked"])
def test_loss_matches_written_out_reference(attn_impl):
    m = tiny_draft().double()
    aux, ids, pos, docs, loss_mask, in_vocab, teacher = packed_batch()
    rows = sample_depth_rows(loss_mask, docs, 4, 0.7, 0.2, seed=3)
    assert all(r.numel() > 0 for r in rows)
    got = depth_loss(m(aux, ids, pos, docs, depth_rows=rows, attn_impl=attn_impl), teacher, in_vocab, loss_mask,
                     docs, rows)
    trained = [(name, p) for name, p in m.named_parameters() if p.requires_grad]
    got_grads = torch.autograd.grad(got.total, [p for _, p in trained], allow_unused=True)
    total, losses, correct, count = reference_loss(m, aux, ids, pos, docs, loss_mask, in_vocab, teacher, rows)
    ref_grads = torch.autograd.grad(total, [p for _, p in trained], allow_unused=True)
    assert [int(n) for n in got.counts] == count and [int(c) for c in got.correct] == correct
    assert got.accept is None
    torch.testing.assert_close(got.total, total, rtol=1e-12, atol=1e-12)
    for a, b in zip(got.losses, losses):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for (name, _), a, b in zip(trained, got_grads, ref_grads, strict=True):
        if b is None:
            assert a is None or not a.any(), name
        else:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=lambda s, name=name: f"{name}: {s}")


def test_flex_attention_gives_the_reference_logits():
    """The GPU's attention (flex; eager and forward-only on a CPU) over two 128-row blocks."""
    m = tiny_draft().double()
    aux, ids, pos, docs, loss_mask, *_ = packed_batch(T=200)
    rows = sample_depth_rows(loss_mask, docs, 4, 0.7, 0.2, seed=3)
    with torch.no_grad():
        naive = m(aux, ids, pos, docs, depth_rows=rows, attn_impl="naive")
        flex = m(aux, ids, pos, docs, depth_rows=rows, attn_impl="flex")
    for a, b in zip(naive, flex, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_loss_runs_with_depths_that_keep_no_rows():
    """A micro-batch too short for the later depths: they run over no rows, count nothing, and
    mask_hidden still gets a (zero) gradient wherever some depth >= 1 ran."""
    m = tiny_draft().double()
    aux, ids, pos, docs, loss_mask, in_vocab, teacher = packed_batch(T=8)
    rows = sample_depth_rows(loss_mask, docs, 6, 0.7, 0.2, seed=0)
    assert rows[-1].numel() == 0
    got = depth_loss(m(aux, ids, pos, docs, depth_rows=rows, attn_impl="chunked"), teacher, in_vocab, loss_mask,
                     docs, rows)
    assert int(got.counts[-1]) == 0 and torch.isfinite(got.total)
    got.total.backward()
    assert m.mask_hidden.grad is not None


# ---- (b) the proposer ----------------------------------------------------------------------------


def test_cached_proposer_equals_training_forward():
    """propose at anchor t (rows 0..t committed, in two extends) gives the depth-d distributions
    of the training forward's row t; proposing again changes nothing; later anchors too."""
    m = tiny_draft(num_layers=3).double().eval()
    T, k = 30, 4
    aux, ids, pos, docs, *_ = packed_batch(T=T)
    pos, docs = torch.arange(T)[None], torch.zeros(1, T, dtype=torch.long)
    proposer = peagle.proposer(m)
    first = 0
    for t in (11, 12, 20):  # anchor row t: the pending token x[t+1] at position t+1
        rows = [None] + [torch.tensor([t])] * (k - 1)
        with torch.no_grad():
            train = m(aux, ids, pos, docs, depth_rows=rows, attn_impl="naive")
        train_logits = [train[0][0, t]] + [x[0, 0] for x in train[1:]]
        for a, b in ((first, (first + t + 1) // 2), ((first + t + 1) // 2, t + 1)):
            proposer.extend(aux[0, a:b], ids[0, a + 1:b + 1].tolist(), a)
        first = t + 1
        assert proposer.length == t + 1
        root = int(ids[0, t + 1])
        for temperature in (1.0, 0.5):  # twice: proposing again changes nothing
            tokens, dists = proposer.propose(root, t + 1, k, temperature, torch.Generator().manual_seed(0))
            assert len(tokens) == len(dists) == k
            for d in range(k):
                torch.testing.assert_close(dists[d], torch.softmax(train_logits[d] / temperature, -1), rtol=1e-10,
                                           atol=1e-12, msg=lambda s, d=d, t=t: f"anchor {t} depth {d}: {s}")
            greedy, none = proposer.propose(root, t + 1, k, 0.0, None)
            assert none == [] and greedy == [int(m.draft_to_target(z.argmax())) for z in train_logits]
            assert proposer.length == t + 1


def test_proposer_refuses_rows_out_of_order():
    proposer = peagle.proposer(tiny_draft())
    with pytest.raises(RuntimeError, match="extend starts at 3"):
        proposer.extend(torch.zeros(2, 96), [1, 2], 3)
    proposer.extend(torch.zeros(2, 96), [1, 2], 0)
    with pytest.raises(RuntimeError, match="not the root"):
        proposer.propose(5, 2, 3, 0.0, None)


def greedy_speculative(tr: TargetRunner, proposer, prompt: list[int], max_new: int, k: int):
    """A chain decoder at temperature 0 around the proposer: (tokens, accepted per cycle)."""
    cache = new_cache()
    proposer.reset()
    logits, aux = tr.forward(cache, prompt, range(len(prompt)))
    pending = int(logits[-1].argmax())
    tokens, accepted, Q = [pending], [], len(prompt)
    proposer.extend(aux, prompt[1:] + [pending], 0)
    while len(tokens) < max_new:
        drafts, _ = proposer.propose(pending, Q, k, 0.0, None)
        logits, aux = tr.forward(cache, [pending, *drafts], range(Q, Q + k + 1))
        best = logits.argmax(-1).tolist()
        n = 0
        while n < k and drafts[n] == best[n]:
            n += 1
        keep_cache_rows(cache, Q + n + 1)
        new = drafts[:n] + [best[n]]
        proposer.extend(aux[: n + 1], new, Q)
        Q, pending = Q + n + 1, best[n]
        tokens += new
        accepted.append(n)
    return tokens[:max_new], accepted


def test_greedy_decoding_with_the_proposer_is_the_targets_own():
    """build() on a tiny target, a few steps of `loss` on the target's own greedy continuation
    (every row at every depth), then a greedy chain decoder around the proposer: the target's
    greedy output exactly, with cycles that accept all k proposals (rows committed after
    accepted proposals, not only after the bonus)."""
    target = build_model("llama", seed=0)
    cfg = SimpleNamespace(peagle=SimpleNamespace(layers=2, depths=4, down_sample_ratio=1.0, down_sample_ratio_min=1.0,
                                                 mask_token_id=None), train=SimpleNamespace(attn_impl="chunked"))
    torch.manual_seed(0)
    draft = peagle.build(cfg, target.config, draft_vocab_size=target.config.vocab_size, num_aux=3)
    assert draft_type_of(draft) is peagle and draft.config.num_layers == 2 and draft.config.num_depths == 4
    assert draft.config.mask_token_id == auto_mask_token_id(target.config)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    tr = TargetRunner(target, [0, 1, 2])
    prompt = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 8, 77]
    want = plain_generate(tr, prompt, 24).tokens
    seq = prompt + want
    T = len(seq)
    logits, aux = tr.forward(new_cache(), seq, range(T))
    batch = SimpleNamespace(aux=aux[None], input_ids=torch.tensor([seq]), position_ids=torch.arange(T)[None],
                            doc_ids=torch.zeros(1, T, dtype=torch.long), loss_mask=torch.ones(1, T, dtype=torch.bool),
                            rows=None)
    teacher, in_vocab = torch.softmax(logits, -1)[None], torch.ones(1, T, dtype=torch.bool)
    opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=1e-2)
    first = None
    for _ in range(50):
        result = peagle.loss(draft, draft, batch, teacher, in_vocab, cfg, False)
        first = first if first is not None else float(result.total.detach())
        opt.zero_grad()
        result.total.backward()
        opt.step()
    assert float(result.total.detach()) < first and [int(n) for n in result.counts] == [T - 2 - d for d in range(4)]
    got, accepted = greedy_speculative(tr, peagle.proposer(draft.eval()), prompt, 24, k=4)
    assert got == want
    assert max(accepted) == 4


# ---- (c) the sampled depth rows ----------------------------------------------------------------


def test_sampled_depth_rows_follow_the_ratios_and_the_seed():
    T = 300
    g = torch.Generator().manual_seed(0)
    loss_mask = torch.rand(1, T, generator=g) > 0.1
    docs = torch.cat([torch.zeros(120, dtype=torch.long), torch.ones(180, dtype=torch.long)])[None]
    depths, r, r_min = 8, 0.7, 0.2
    rows = sample_depth_rows(loss_mask, docs, depths, r, r_min, seed=11)
    counted = [set(step_mask(loss_mask, torch.ones_like(loss_mask), docs, d).flatten().nonzero().flatten().tolist())
               for d in range(depths)]
    n = len(counted[0])
    assert rows[0].tolist() == sorted(counted[0])
    for d in range(1, depths):
        kept = rows[d].tolist()
        assert kept == sorted(set(kept)), "ascending, no repeats"
        assert set(kept) <= set(rows[d - 1].tolist()) or d == 1
        assert all(t in counted[e] for t in kept for e in range(1, d + 1)), "every depth 1..d of a kept row counts"
        pool = (counted[1] if d == 1 else set(rows[d - 1].tolist()) & counted[d])
        assert len(kept) == min(len(pool), int((n - d) * max(r**d, r_min)))
    assert [len(x) for x in rows[1:5]] == [int((n - d) * r**d) for d in range(1, 5)]  # the pool is larger there
    assert depth_ratio(6, r, r_min) == r_min
    again = sample_depth_rows(loss_mask, docs, depths, r, r_min, seed=11)
    other = sample_depth_rows(loss_mask, docs, depths, r, r_min, seed=12)
    assert all(torch.equal(a, b) for a, b in zip(rows, again))
    assert not all(torch.equal(a, b) for a, b in zip(rows, other))
    cfg = SimpleNamespace(peagle=SimpleNamespace(depths=depths, down_sample_ratio=r, down_sample_ratio_min=r_min))
    keyed = host_rows(loss_mask, docs, cfg, 11)
    assert list(keyed) == [f"depth{d}" for d in range(depths)]
    assert all(torch.equal(keyed[f"depth{d}"], rows[d]) for d in range(depths))
    assert peagle.num_positions(cfg) == depths and peagle.num_positions(SimpleNamespace()) == 8


def test_registered_with_every_entry_point():
    kind = draft_type("peagle")
    assert kind is peagle and (kind.NAME, kind.TITLE, kind.SERVING_METHOD) == ("peagle", "P-EAGLE", "eagle3")
    m = tiny_draft()
    assert isinstance(kind.from_config(m.config.to_dict()), PeagleDraft)
    assert kind.shard_units(m) == list(m.layers) and kind.unroll_linears(m) is None
    assert kind.layers(32, SimpleNamespace()) is None
    with pytest.raises(ValueError, match="fc_norm"):
        PeagleConfig(**{**m.config.to_dict(), "fc_norm": True})


# ---- (d) the export ------------------------------------------------------------------------------


def vllm_update_peagle():
    """vLLM 0.25.0's own update_peagle (algos.py imports nothing), or None where its source is absent."""
    if not VLLM_ALGOS.is_file():
        return None
    spec = importlib.util.spec_from_file_location("vllm_speculators_algos", VLLM_ALGOS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SUPPORTED_SPECULATORS_TYPES["peagle"]


META = dict(aux_layer_ids=[2, 4, 5], verifier_name_or_path="org/target", verifier_architectures=["LlamaForCausalLM"])


def test_export_is_what_vllm_reads():
    m = tiny_draft(norm_before_residual=True)
    config, weights = peagle.serving(m, {**META, "dtype": "float32"})
    # the keys validate_speculators_config and the draft's builder read (eaglet/formats/loaders.py)
    assert [k for k in VLLM_KEYS if config_value(config, k) is None] == []
    assert config["speculators_model_type"] == "peagle" and config["speculators_config"]["algorithm"] == "peagle"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == m.config.num_depths
    assert config["mask_token_id"] == 7 and config["norm_before_residual"] is True
    assert not config["fc_norm"] and not config["norm_output"] and not config["norm_before_fc"]
    json.dumps(config)
    # what vLLM builds from it: update_peagle (its own where its source is here)
    update = vllm_update_peagle()
    built = dict(config["transformer_layer_config"])
    if update is not None:
        update(config, built)
    else:  # as read from vLLM 0.25.0's algos.py
        built.update(draft_vocab_size=config["draft_vocab_size"], target_hidden_size=config["target_hidden_size"],
                     norm_before_residual=config["norm_before_residual"], norm_before_fc=False,
                     architectures=["PeagleLlamaForCausalLM"], pard_token=config["mask_token_id"],
                     eagle_aux_hidden_state_layer_ids=config["eagle_aux_hidden_state_layer_ids"])
    assert built["pard_token"] == m.config.mask_token_id
    assert built["architectures"] == ["PeagleLlamaForCausalLM"]
    assert built["norm_before_residual"] is True and built["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    # load_weights: mask_hidden into its buffer (num_aux * target_hidden values), the rest by name
    mask = weights.pop("mask_hidden")
    assert mask.shape == (1, 1, 3 * 32) and torch.equal(mask.flatten(), m.mask_hidden.detach())
    shapes = {k: tuple(v.shape) for k, v in weights.items()}
    problems, d2t = _match(shapes, vllm_parameters(built), vllm_target, "vLLM")
    assert problems == [] and d2t == {"d2t"}
    assert "embed_tokens.weight" not in weights
    assert peagle.serving(m, {**META, "num_speculative_tokens": 6})[0]["speculators_config"][
        "proposal_methods"][0]["speculative_tokens"] == 6


# Runs in .venv-speculators. argv[1]: {export, io, out}. Loads the export with speculators'
# PEagleDraftModel, makes its COD sampler return eaglet's elements (io's anchor/depth), runs its
# training forward and saves its logits (captured at lm_head).
SPECULATORS_CHILD = r"""
import json, sys
import torch
from importlib.metadata import version
from safetensors import safe_open
from safetensors.torch import load_file, save_file
import speculators.models.peagle.core as core
from speculators.losses.eager import kl_div_loss
from speculators.models.peagle.core import PEagleDraftModel

case = json.loads(sys.argv[1])
io = load_file(case["io"])
core.generate_cod_sample_indices = lambda **kw: (io["anchor"], io["depth"])
model = PEagleDraftModel.from_pretrained(case["export"], dtype=torch.float32).eval()
with safe_open(case["export"] + "/model.safetensors", "pt") as f:
    file = {k: f.get_tensor(k) for k in f.keys()}
state = model.state_dict()
captured = []
model.lm_head.register_forward_hook(lambda mod, args, out: captured.append(out.detach()))
T = io["input_ids"].shape[1]
with torch.no_grad():
    model(hidden_states=io["aux"], input_ids=io["input_ids"], document_ids=io["document_ids"],
          position_ids=io["position_ids"], loss_mask=torch.ones(1, T),
          verifier_last_hidden_states=torch.randn(1, T, model.config.transformer_layer_config.hidden_size),
          num_depths=case["depths"], loss_config={"kl_div": (kl_div_loss, 1.0)})  # no Triton here
save_file({"logits": captured[0][0].contiguous()}, case["out"])
print("REPORT " + json.dumps({
    "speculators": version("speculators"),
    "unexpected": sorted(set(file) - set(state)),
    "not_from_file": sorted(set(state) - set(file)),
    "differs_from_file": sorted(k for k in file if k in state and not torch.equal(state[k], file[k].to(state[k].dtype))),
    "mask_token_id": model.mask_token_id,
    "speculative_tokens": model.config.speculators_config.proposal_methods[0].speculative_tokens,
}))
"""


def write_verifier(folder: Path, m: PeagleDraft) -> None:
    """A local stand-in for the target: speculators reads its config and embedding / head / norm."""
    c = m.config
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
        "intermediate_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": False,
    }))
    save_file({"model.embed_tokens.weight": m.embed_tokens.weight.detach().clone(),
               "lm_head.weight": torch.randn(c.vocab_size, c.hidden_size), "model.norm.weight": torch.ones(c.hidden_size)},
              str(folder / "model.safetensors"))


@pytest.mark.skipif(not SPECULATORS_PYTHON.exists(),
                    reason="no .venv-speculators: `bash scripts/speculators_venv.sh` creates it (speculators 0.9.0)")
def test_speculators_runs_the_export_to_eaglet_logits(tmp_path):
    m = tiny_draft(seed=5).float()
    depths, T = 4, 64
    write_verifier(tmp_path / "verifier", m)
    config, weights = peagle.serving(m, {**META, "verifier_name_or_path": str(tmp_path / "verifier"),
                                         "dtype": "float32", "include_embed": True})
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text(json.dumps(config))
    save_file(weights, str(tmp_path / "export" / "model.safetensors"), metadata={"format": "pt"})
    aux, ids, pos, docs, loss_mask, *_ = packed_batch(T=T)
    aux = aux.float()
    rows = sample_depth_rows(loss_mask, docs, depths, 0.7, 0.2, seed=4)
    with torch.no_grad():
        ours = m(aux, ids, pos, docs, depth_rows=[None, *rows[1:]], attn_impl="naive")
    # speculators' element (anchor a, depth d) is eaglet's row a at depth d: it reads the batch
    # shifted by one token (eagle3/data.py shift_batch) and runs at position a + d, a constant
    # away from eaglet's pos[a] + 1 + d within a document.
    anchor = torch.cat([torch.arange(T), *rows[1:]])
    depth = torch.cat([torch.full((T,), 0), *[torch.full((len(r),), d) for d, r in enumerate(rows[1:], 1)]])
    save_file({"aux": aux, "input_ids": torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], 1), "document_ids": docs,
               "position_ids": pos + 1, "anchor": anchor, "depth": depth}, str(tmp_path / "io.safetensors"))
    case = {"export": str(tmp_path / "export"), "io": str(tmp_path / "io.safetensors"),
            "out": str(tmp_path / "out.safetensors"), "depths": depths}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([str(SPECULATORS_PYTHON), "-c", SPECULATORS_CHILD, json.dumps(case)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("REPORT ")).removeprefix("REPORT "))
    assert report["speculators"] == "0.9.0"
    assert report["unexpected"] == [] and report["differs_from_file"] == []
    assert report["not_from_file"] == ["verifier_lm_head.weight", "verifier_norm.weight"]  # training-only
    assert report["mask_token_id"] == 7 and report["speculative_tokens"] == m.config.num_depths
    got = load_file(case["out"])["logits"]
    torch.testing.assert_close(got, torch.cat([o[0] for o in ours]), rtol=1e-4, atol=1e-4)
