"""The export of an EAGLE-3 draft with MLA layers (eaglet/draft/eagle3/serving_mla.py) as vLLM 0.25's
and SGLang's Eagle3DeepseekV2ForCausalLM load it (eaglet/formats/loaders_mla.py).

The export is loaded as vLLM's loader reads it (loaders_mla's renames and fused shards) and run
through a forward written here from vLLM's deepseek_eagle3.py and DeepseekV2MLAAttention (the
fused q/kv-a split, the latent norms, interleaved RoPE on the rope dims with the cos/sin of
DeepseekScalingRotaryEmbedding built from the exported rope, the mscale^2 softmax factor, the
draft vocabulary scattered to the target's by d2t): it gives eaglet's logits, for plain RoPE
(written as YaRN with factor 1) and for a YaRN target. Read back, the export is the same draft;
the loader checks pass it whole and name each break of it.
"""

import json
import math
import shlex
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglet.config import load_config
from eaglet.draft.eagle3.mla import softmax_factor
from eaglet.draft.eagle3.model import DraftConfig, Eagle3Draft
from eaglet.draft.eagle3.serving import reload_logits
from eaglet.draft.layers import rope_inv_freq
from eaglet.formats.loaders import PROBLEMS, serve_commands
from eaglet.formats.loaders_common import read_config
from eaglet.formats.loaders_mla import (sglang_capture_layers, sglang_mla_parameters, sglang_mla_problems,
                                        sglang_mla_target, transformers_rope, vllm_mla_parameters, vllm_mla_problems,
                                        vllm_mla_target, vllm_num_aux)
from eaglet.formats.serving import draft_model, export_draft, load_draft

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = [2, 4, 5]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def mla_draft(rope_scaling=None, num_layers=1, **flags) -> Eagle3Draft:
    """A tiny MLA draft, weights float32-exact, random norms and a real reduced vocabulary."""
    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=32, target_hidden_size=48, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                      intermediate_size=64, vocab_size=96, draft_vocab_size=40, rope_theta=50000.0,
                      rope_scaling=rope_scaling, max_position_embeddings=256, num_layers=num_layers, attention="mla",
                      mla_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                      v_head_dim=6, **flags)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
        kept = torch.randperm(96)[:40].sort().values
        draft.d2t.copy_(kept - torch.arange(40))
        draft.t2d.zero_()
        draft.t2d[kept] = True
    return draft.eval()


def export(draft, folder, fmt="vllm", **kw):
    return export_draft(draft, folder, fmt, aux_layer_ids=kw.pop("ids", IDS), verifier_name_or_path="target",
                        verifier_architectures=["DeepseekV3ForCausalLM"], num_speculative_tokens=3,
                        include_embed=kw.pop("include_embed", False), dtype="float32")


# ---- vLLM's Eagle3DeepseekV2ForCausalLM, written from its source ------------------------------


def vllm_load(folder):
    """(config, parameters as vLLM's module holds them after load_weights, d2t): each tensor put
    where loaders_mla says vLLM's loader puts it, the shards of a fused one stacked in shard order."""
    config, parts, d2t = read_config(folder), {}, None
    params = vllm_mla_parameters(config)
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        target = vllm_mla_target(name, params)
        assert target is not None, name
        if target == "d2t":
            d2t = tensor
        elif target != "ignored":
            parts.setdefault(target[0], {})[target[1]] = tensor.double()
    weights = {p: torch.cat([s[k] for k in sorted(s)]) if None not in s else s[None] for p, s in parts.items()}
    return config, weights, d2t


def yarn_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def vllm_rope(config, positions):
    """(cos, sin [T, rope/2], softmax factor): deepseek_eagle3 turns the rope transformers gives it
    into deepseek_yarn; DeepseekScalingRotaryEmbedding's cache (float32) at `positions`;
    DeepseekV2MLAAttention's mscale(factor, mscale_all_dim)^2."""
    rope = transformers_rope(config)
    factor, old, base = rope["factor"], rope["original_max_position_embeddings"], rope["rope_theta"]
    dim = config["qk_rope_head_dim"]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)

    def correction(rotations):
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction(rope.get("beta_fast", 32))), 0)
    high = min(math.ceil(correction(rope.get("beta_slow", 1))), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    mask = (1 - ramp) * rope.get("extrapolation_factor", 1)
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - mask) + 1.0 / pos_freqs * mask
    scale = (yarn_mscale(factor, float(rope.get("mscale", 1))) / yarn_mscale(factor, float(rope.get("mscale_all_dim", 0)))
             * rope.get("attn_factor", 1))
    freqs = positions.float()[:, None] * inv_freq
    softmax = yarn_mscale(factor, float(rope.get("mscale_all_dim", False))) ** 2
    return (freqs.cos() * scale).double(), (freqs.sin() * scale).double(), softmax


def rope_gptj(x, cos, sin):
    """is_neox_style False: pairs (2i, 2i+1) turned by frequency i. x [T, heads, d]."""
    cos, sin = cos.repeat_interleave(2, dim=-1)[:, None], sin.repeat_interleave(2, dim=-1)[:, None]
    rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return x * cos + rotated * sin


def vllm_forward(folder, embed, aux, ids, positions):
    """(logits over the target vocabulary [T, V], the state fed to the next step) of one causal
    sequence through the export as vLLM loads and runs it."""
    c, w, d2t = vllm_load(folder)
    eps, T = c["rms_norm_eps"], ids.shape[0]
    H, nope, rp, vd = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]

    def norm(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w[name]

    def lin(x, name):
        return x @ w[name].T

    def attention(x, pre):
        q_c, kv_lora = lin(x, pre + "fused_qkv_a_proj.weight").split([c["q_lora_rank"], c["kv_lora_rank"] + rp], -1)
        q = lin(norm(q_c, pre + "q_a_layernorm.weight"), pre + "q_b_proj.weight").view(T, H, nope + rp)
        kv_c, k_pe = kv_lora.split([c["kv_lora_rank"], rp], -1)
        k_nope, v = lin(norm(kv_c, pre + "kv_a_layernorm.weight"), pre + "kv_b_proj.weight").view(T, H, nope + vd).split(
            [nope, vd], -1)
        q = torch.cat([q[..., :nope], rope_gptj(q[..., nope:], cos, sin)], -1)
        k = torch.cat([k_nope, rope_gptj(k_pe[:, None], cos, sin).expand(T, H, rp)], -1)
        scores = torch.einsum("thd,shd->hts", q, k) * (nope + rp) ** -0.5 * softmax
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        return lin(torch.einsum("hts,shv->thv", scores.softmax(-1), v).reshape(T, H * vd), pre + "o_proj.weight")

    cos, sin, softmax = vllm_rope(c, positions)
    if c.get("fc_norm"):
        aux = torch.cat([norm(a, f"model.fc_norm.{i}.weight") for i, a in enumerate(aux.chunk(vllm_num_aux(c), -1))], -1)
    h, residual = lin(aux, "model.fc.weight"), None
    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        if i == 0:
            normed = norm(h, pre + "hidden_norm.weight")
            residual = normed if c.get("norm_before_residual") else h
            x = torch.cat([norm(embed[ids], pre + "input_layernorm.weight"), normed], -1)
        else:
            residual = h + residual
            x = norm(residual, pre + "input_layernorm.weight")
        residual = attention(x, pre + "self_attn.") + residual
        gate, up = lin(norm(residual, pre + "post_attention_layernorm.weight"), pre + "mlp.gate_up_proj.weight").chunk(2, -1)
        h = lin(torch.nn.functional.silu(gate) * up, pre + "mlp.down_proj.weight")
    residual = h + residual
    normed = norm(residual, "model.norm.weight")
    logits = lin(normed, "lm_head.weight")
    draft_vocab = logits.shape[-1]
    targets = torch.arange(draft_vocab) + (d2t if d2t is not None else torch.zeros(draft_vocab, dtype=torch.long))
    full = logits.new_full((T, c["vocab_size"]), float("-inf"))
    full[:, targets] = logits
    return full, normed if c.get("norm_output") else residual


def eaglet_forward(draft, aux, ids, positions):
    """eaglet's (logits over the target vocabulary, next hidden) of the same causal sequence."""
    draft = draft.double()
    hidden, logits = draft.forward_step(draft.project_aux(aux[None]), ids[None], positions[None])
    full = logits.new_full((ids.shape[0], draft.config.vocab_size), float("-inf"))
    full[:, torch.arange(draft.config.draft_vocab_size) + draft.d2t] = logits[0]
    return full, hidden[0]


CASES = {  # name -> (draft settings, the formats that take it)
    "plain rope": ({}, ["vllm", "sglang"]),
    "yarn rope": ({"rope_scaling": YARN}, ["vllm", "sglang"]),
    "two layers, EAGLE-3.1 norms": ({"rope_scaling": YARN, "num_layers": 2, "fc_norm": True, "norm_output": True,
                                     "norm_before_residual": True}, ["vllm"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_loads_and_runs_the_export_as_eaglet_runs_the_draft(tmp_path, case):
    settings, formats = CASES[case]
    draft = mla_draft(**settings)
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(9, 3 * 48, generator=g, dtype=torch.float64)
    ids, positions = torch.randint(0, 96, (9,), generator=g), torch.arange(9) + 5
    embed = draft.embed_tokens.weight.detach().double()  # the target's, which the engine shares
    for fmt in formats:
        folder = export(draft, tmp_path / fmt, fmt)
        assert PROBLEMS["eagle3"][fmt](folder) == []
        theirs, their_hidden = vllm_forward(folder, embed, aux, ids, positions)
        ours, our_hidden = eaglet_forward(draft, aux, ids, positions)
        assert torch.equal(theirs.isinf(), ours.isinf())  # the same target ids (d2t)
        torch.testing.assert_close(theirs[~theirs.isinf()], ours[~ours.isinf()], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(their_hidden, our_hidden, atol=1e-5, rtol=1e-5)


def test_plain_rope_as_yarn_with_factor_one_is_plain_rope_in_eaglet():
    for dim, theta, length in [(8, 50000.0, 256), (64, 10000.0, 4096), (64, 1e6, 131072)]:
        yarn = {"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": length, "beta_fast": 32,
                "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
        plain, scale = rope_inv_freq(dim, theta, None, length)
        inv_freq, yarn_scale = rope_inv_freq(dim, theta, yarn, length)
        torch.testing.assert_close(inv_freq, plain, atol=0, rtol=1e-6)
        assert scale == yarn_scale == 1.0 and softmax_factor(yarn) == 1.0
    draft = mla_draft()
    as_yarn = Eagle3Draft(DraftConfig(**{**draft.config.to_dict(), "rope_scaling": dict(yarn, **{
        "original_max_position_embeddings": 256})}))
    as_yarn.load_state_dict(draft.state_dict())
    for ours, theirs in zip(reload_logits(draft), reload_logits(as_yarn.eval())):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rope", [None, YARN])
def test_the_export_reads_back_as_the_same_draft(tmp_path, rope):
    draft = mla_draft(rope_scaling=rope)
    folder = export(draft, tmp_path / "vllm")
    cfg, state, meta = load_draft(folder, own=True)
    assert cfg.to_dict() | {"head_dim": 8} == draft.config.to_dict()  # head_dim: a dense layer's, unused
    assert meta["aux_layer_ids"] == IDS and meta["missing"] == ["embed_tokens.weight"]
    back, _ = draft_model((cfg, state, meta), draft.embed_tokens.weight)
    for ours, theirs in zip(reload_logits(draft), reload_logits(back.eval())):
        assert torch.equal(ours, theirs)


def test_both_formats_write_the_same_files_which_sglang_loads_as_vllm_does(tmp_path):
    draft = mla_draft(rope_scaling=YARN)
    folders = {fmt: export(draft, tmp_path / fmt, fmt, include_embed=True) for fmt in ("vllm", "sglang")}
    for name in ("config.json", "model.safetensors"):
        assert (folders["vllm"] / name).read_bytes() == (folders["sglang"] / name).read_bytes()
    config = read_config(folders["sglang"])
    assert sglang_mla_problems(folders["sglang"]) == [] and sglang_capture_layers(config) == IDS
    assert config["eagle_aux_hidden_state_layer_ids"] == IDS  # vLLM's, read first
    _, vllm_weights, _ = vllm_load(folders["vllm"])
    params, sglang_weights = sglang_mla_parameters(config), {}
    for name, tensor in load_file(str(folders["sglang"] / "model.safetensors")).items():
        target = sglang_mla_target(name, params)
        if isinstance(target, tuple):
            sglang_weights.setdefault(target[0], {})[target[1]] = tensor.double()
    fused = sglang_weights.pop("model.midlayer.self_attn.fused_qkv_a_proj_with_mqa.weight")
    assert torch.equal(torch.cat([fused["q_a_proj"], fused["kv_a_proj_with_mqa"]]),  # SGLang's concatenation order
                       vllm_weights.pop("model.layers.0.self_attn.fused_qkv_a_proj.weight"))
    gate_up = sglang_weights.pop("model.midlayer.mlp.gate_up_proj.weight")
    assert torch.equal(torch.cat([gate_up[0], gate_up[1]]), vllm_weights.pop("model.layers.0.mlp.gate_up_proj.weight"))
    assert {k.replace("midlayer", "layers.0"): v[None] for k, v in sglang_weights.items()}.keys() == vllm_weights.keys()
    assert all(torch.equal(v[None], vllm_weights[k.replace("midlayer", "layers.0")]) for k, v in sglang_weights.items())


def test_the_export_stage_writes_checks_and_serves_an_mla_draft(tmp_path, capsys):
    from test_export import run_export_stage, tied_target

    from eaglet.formats.draft import FINAL_DIR, save_final

    tied_target(tmp_path)  # the target (a local folder) and the store; the trained draft an MLA one
    draft = mla_draft(rope_scaling=YARN)
    save_final(tmp_path / "train" / FINAL_DIR, draft.state_dict(), draft.config, IDS, "eagle3")
    result = run_export_stage(tmp_path)
    for fmt in ("vllm", "sglang"):
        assert read_config(result[fmt]["path"])["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
        assert result[fmt]["reload_max_logit_error"] < 1e-6
    assert json.loads(shlex.split(result["vllm"]["serve_command"])[-1])["method"] == "eagle3"
    err = capsys.readouterr().err
    assert "matches its engine's loader" in err and "export.verifier_name_or_path" not in err  # it names no verifier


def edited(folder, tmp_path, weights=None, config=None):
    """A copy of the export with `weights(tensors)` / `config(config dict)` applied."""
    out = tmp_path / "edited"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(folder, out)
    if weights:
        w = load_file(str(out / "model.safetensors"))
        weights(w)
        save_file(w, str(out / "model.safetensors"))
    if config:
        c = json.loads((out / "config.json").read_text())
        config(c)
        (out / "config.json").write_text(json.dumps(c))
    return out


def plain_rope_left_plain(c):
    c["rope_scaling"] = None
    c["rope_parameters"] = {"rope_type": "default", "rope_theta": c["rope_theta"]}


BREAKS = {  # what is broken -> (weights edit, config edit, what vLLM's line names, what SGLang's names)
    "kv_b_proj missing": (lambda w: w.pop("layers.0.self_attn.kv_b_proj.weight"), None,
                          "'model.layers.0.self_attn.kv_b_proj.weight'", "'model.midlayer.self_attn.kv_b_proj.weight'"),
    "q_a_proj missing": (lambda w: w.pop("layers.0.self_attn.q_a_proj.weight"), None, "(shards [0])",
                         "(shards ['q_a_proj'])"),
    "d2t missing": (lambda w: w.pop("d2t"), None, "no 'd2t'", "no 'd2t'"),
    "model_type deepseek_v3": (None, lambda c: c.update(model_type="deepseek_v3"), "DeepSeekMTPModel", None),
    "no top-level ids": (None, lambda c: c.pop("eagle_aux_hidden_state_layer_ids"),
                         "no top-level 'eagle_aux_hidden_state_layer_ids'", None),
    "no eagle_config ids": (None, lambda c: c.pop("eagle_config"), None,
                            "no 'eagle_config.eagle_aux_hidden_state_layer_ids'"),
    "plain rope left plain": (None, plain_rope_left_plain, "reads factor and original_max_position_embeddings",
                              "reads factor and original_max_position_embeddings"),
    "no q_lora_rank": (None, lambda c: c.pop("q_lora_rank"), "1536", "1536"),
    "two layers": (None, lambda c: c.update(num_hidden_layers=2), "is filled by no weight", "has one layer"),
}


@pytest.mark.parametrize("case", list(BREAKS))
def test_each_break_of_the_export_is_named_by_the_loader_it_breaks(tmp_path, case):
    weights, config, vllm_names, sglang_names = BREAKS[case]
    good = export(mla_draft(), tmp_path / "vllm")
    assert vllm_mla_problems(good) == [] and sglang_mla_problems(good) == []
    folder = edited(good, tmp_path, weights, config)
    for check, names in [(vllm_mla_problems, vllm_names), (sglang_mla_problems, sglang_names)]:
        problems = check(folder)
        if names is None:
            assert problems == [], problems
        else:
            assert any(names in p for p in problems), problems


@pytest.mark.parametrize("settings, fmt, says", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "vllm", "rope_type linear"),
    ({"rope_scaling": {**YARN, "attention_factor": 0.9}}, "vllm", "have no form in the keys DeepSeek's YaRN reads"),
    ({"rope_scaling": {k: v for k, v in YARN.items() if k != "mscale"}}, "sglang",
     "have no form in the keys DeepSeek's YaRN reads"),
    ({"q_lora_rank": 0}, "vllm", "q_lora_rank 0"),
    ({"num_layers": 2}, "sglang", "SGLang's deepseek_eagle3 has no num_layers=2"),
    ({"fc_norm": True}, "sglang", "SGLang's deepseek_eagle3 has no fc_norm"),
])
def test_what_the_engines_cannot_serve_is_refused_at_export(tmp_path, settings, fmt, says):
    settings = dict(settings)
    q_lora = settings.pop("q_lora_rank", None)
    draft = mla_draft(**settings)
    if q_lora is not None:
        draft = Eagle3Draft(DraftConfig(**{**draft.config.to_dict(), "q_lora_rank": q_lora}))
    with pytest.raises(ValueError, match=f"cannot export this draft as '{fmt}': .*{said(says)}"):
        export(draft, tmp_path / fmt, fmt)
    with pytest.raises(ValueError, match="aux layer ids .* 0 has none"):
        export(mla_draft(), tmp_path / "zero", ids=[0, 2, 4])


def said(text):
    return text.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")


def test_the_serve_command_names_the_method_and_the_vllm_rows_follow_the_attention(tmp_path):
    folder = export(mla_draft(), tmp_path / "vllm")
    command = serve_commands("eagle3", "moonshotai/Kimi-K2-Instruct", {"vllm": folder}, 3)["vllm"]
    assert '"method": "eagle3"' in command and str(folder) in command
    from eaglet.engines.vllm.contracts import CONTRACTS

    for attention, want, not_want in [("mla", "+Eagle3DeepseekV2ForCausalLM", "+Eagle3LlamaForCausalLM"),
                                      ("dense", "+Eagle3LlamaForCausalLM", "+Eagle3DeepseekV2ForCausalLM")]:
        cfg = load_config(None, [f"train.draft_attention={attention}"])
        on = {r.params for r in CONTRACTS if r.stages == ("eval-vllm",) and r.when(cfg)}
        assert want in on and not_want not in on, (attention, on)
    mla = load_config(None, ["train.draft_attention=mla"])
    on = {(r.where, r.params) for r in CONTRACTS if r.stages == ("eval-vllm",) and r.when(mla)}
    assert ("vllm.transformers_utils.config:_CONFIG_REGISTRY", "+kimi_k2") in on
    assert not any("speculators" in where for where, _ in on)
