"""EAGLE-3's MLA layer (eaglet/draft/eagle3/mla.py, train.draft_attention: mla): its attention
against a written-out reference and against transformers' DeepSeek-V3 attention, its sizes from
the target's config, and the settings around it (config, doctor, resume).

The TTT unroll with the MLA layer against its plain reference and a KV-cached chain is in
tests/test_perf_paths.py (`test_fast_unroll_is_the_reference_unroll[mla*]`,
`test_unroll_casts_each_linear_weight_once[mla]`) and tests/test_model.py (`[mla+2]`,
`[mla+2layers]`), beside the dense layer's."""

import math

import pytest
import torch

from eaglet.config import Config, TrainSection
from eaglet.draft.eagle3.attention import cached_attention
from eaglet.draft.eagle3.mla import MLAAttention, mla_sizes, softmax_factor
from eaglet.draft.eagle3.model import DraftConfig, Eagle3Draft

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def mla_config(**kw) -> DraftConfig:
    base = dict(hidden_size=32, target_hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=48, vocab_size=97, draft_vocab_size=40, rope_theta=50.0, max_position_embeddings=256,
                attention="mla", mla_heads=3, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6,
                v_head_dim=5, num_layers=2)
    return DraftConfig(**{**base, **kw})


def mla_draft(seed=0, **kw) -> Eagle3Draft:
    torch.manual_seed(seed)
    m = Eagle3Draft(mla_config(**kw)).double()
    for p in m.parameters():  # norm weights away from one, so that a norm left out shows
        torch.nn.init.normal_(p, 0.0 if p.ndim > 1 else 1.0, 0.3)
    return m


def rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def written_out_attention(attn, x_TI, positions, inv_freq, cos_scale, eps, rope_scaling):
    """DeepSeek-V3's attention for one sequence, written out head by head and pair by pair:
    RoPE turns only the last `rope` dims of each query and of the one shared rope key, pair
    (2i, 2i+1) by angle position x inv_freq[i] (times the YaRN cos/sin scale); the scores are
    scaled by (nope + rope)^-1/2 and mscale^2 (YaRN's mscale_all_dim); causal."""
    H, nope, rope, vd = attn.num_heads, attn.nope, attn.rope, attn.v_dim
    T = x_TI.shape[0]
    if hasattr(attn, "q_a_proj"):
        q_all = rms(x_TI @ attn.q_a_proj.weight.T, attn.q_a_layernorm.weight, eps) @ attn.q_b_proj.weight.T
    else:
        q_all = x_TI @ attn.q_proj.weight.T
    kv_a = x_TI @ attn.kv_a_proj_with_mqa.weight.T
    latent, k_rope = kv_a[:, : attn.kv_lora_rank], kv_a[:, attn.kv_lora_rank:]
    kv_all = rms(latent, attn.kv_a_layernorm.weight, eps) @ attn.kv_b_proj.weight.T

    def turn(vec, p):
        out = vec.clone()
        for i in range(rope // 2):
            angle = float(p) * float(inv_freq[i])
            c, s = math.cos(angle) * cos_scale, math.sin(angle) * cos_scale
            a, b = vec[2 * i], vec[2 * i + 1]
            out[2 * i], out[2 * i + 1] = a * c - b * s, b * c + a * s
        return out

    keys_rope = [turn(k_rope[s], positions[s]) for s in range(T)]
    scale = (nope + rope) ** -0.5 * mscale_squared(rope_scaling)
    heads = []
    for h in range(H):
        q_h = q_all[:, h * (nope + rope):(h + 1) * (nope + rope)]
        kv_h = kv_all[:, h * (nope + vd):(h + 1) * (nope + vd)]
        rows = []
        for t in range(T):
            q = torch.cat([q_h[t, :nope], turn(q_h[t, nope:], positions[t])])
            scores = torch.stack([q @ torch.cat([kv_h[s, :nope], keys_rope[s]]) for s in range(t + 1)]) * scale
            rows.append(scores.softmax(0) @ kv_h[: t + 1, nope:])
        heads.append(torch.stack(rows))
    return torch.cat(heads, dim=-1) @ attn.o_proj.weight.T


def mscale_squared(rope_scaling):
    """DeepSeek's YaRN softmax factor, written out: (0.1 x mscale_all_dim x ln(factor) + 1)^2."""
    if not rope_scaling:
        return 1.0
    return (0.1 * rope_scaling["mscale_all_dim"] * math.log(rope_scaling["factor"]) + 1) ** 2


@pytest.mark.parametrize("rope_scaling", [None, YARN], ids=["default-rope", "yarn"])
@pytest.mark.parametrize("q_lora_rank", [24, 0], ids=["q-lora", "q_proj"])
@pytest.mark.parametrize("layer", [0, 1], ids=["first-2H", "later-H"])
def test_mla_attention_is_the_written_out_reference(rope_scaling, q_lora_rank, layer):
    """The layer's q/k/v heads through eaglet's causal attention and o_proj equal DeepSeek-V3's
    attention written out by hand (`written_out_attention`), for the first layer's 2H-wide input
    and a later layer's H-wide one, with and without the queries' LoRA, with default RoPE and
    with YaRN (its cos/sin scale and the mscale^2 on the softmax). Positions start at 5 (RoPE is
    not the identity). The written-out mscale^2 is checked against its formula."""
    m = mla_draft(rope_scaling=rope_scaling, q_lora_rank=q_lora_rank)
    attn, c = m.layers[layer].self_attn, m.config
    T, width = 7, (2 if layer == 0 else 1) * c.hidden_size
    x = torch.randn(1, T, width, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(T)[None] + 5
    cos, sin = m.rope(pos, torch.float64)
    with torch.no_grad():
        q, k, v = attn.qkv(x, cos, sin)
        got = attn.out(cached_attention(q, k, v))[0]
        want = written_out_attention(attn, x[0], pos[0], m.rope.inv_freq, m.rope.scale, c.rms_norm_eps, rope_scaling)
    # RoPE's tables are fp32 (as transformers makes them): ~1e-7 of each angle's cos and sin
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    assert q.shape == (1, 3, T, 14) and k.shape == (1, 3, T, 14) and v.shape == (1, 3, T, 5)
    if rope_scaling:
        assert attn.q_factor == pytest.approx((0.1 * math.log(4.0) + 1) ** 2) and m.rope.scale == 1.0
    else:
        assert attn.q_factor == 1.0


@pytest.mark.parametrize("rope_scaling", [None, YARN], ids=["default-rope", "yarn"])
def test_a_later_mla_layer_is_transformers_deepseek_v3_attention(rope_scaling):
    """A later layer's attention (H-wide input) is transformers' DeepseekV3Attention with the same
    weights, sizes and RoPE (rope_interleave, YaRN's mscale_all_dim): DeepSeek-V3's own code as a
    second reference, its rotary embedding included."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    m = mla_draft(rope_scaling=rope_scaling)
    c, attn = m.config, m.layers[1].self_attn
    rope = {"rope_type": "default", "rope_theta": c.rope_theta} if rope_scaling is None else \
        {**rope_scaling, "rope_theta": c.rope_theta}
    hf_cfg = DeepseekV3Config(hidden_size=c.hidden_size, num_attention_heads=c.mla_heads, num_key_value_heads=c.mla_heads,
                              q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
                              qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
                              v_head_dim=c.v_head_dim, rms_norm_eps=c.rms_norm_eps, rope_parameters=rope,
                              max_position_embeddings=c.max_position_embeddings, rope_interleave=True,
                              attention_bias=False, vocab_size=c.vocab_size)
    hf_cfg._attn_implementation = "eager"
    theirs = ds.DeepseekV3Attention(hf_cfg, layer_idx=0).double()
    missing, unexpected = theirs.load_state_dict(attn.state_dict(), strict=False)
    assert not missing and not unexpected
    T = 9
    x = torch.randn(1, T, c.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(T)[None] + 3
    rotary = ds.DeepseekV3RotaryEmbedding(hf_cfg)
    mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with torch.no_grad():
        want = theirs(x, position_embeddings=rotary(x, pos), attention_mask=mask)[0]
        cos, sin = m.rope(pos, torch.float64)
        got = attn.out(cached_attention(*attn.qkv(x, cos, sin)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)  # fp32 RoPE tables on both sides


def test_mla_sizes_follow_the_target():
    """An MLA target's own sizes and heads (Kimi-K2.5's: 64 heads, 1536/512, 128/64/128; a null
    q_lora_rank is 3 x kv_lora_rank, which the engines serve); a dense target's DeepSeek-V3 proportions at its head_dim;
    train.mla_* over either; the dense fields of a dense draft's config stay as they were."""
    from transformers import DeepseekV3Config, LlamaConfig

    kimi = DeepseekV3Config(hidden_size=7168, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512,
                            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=163840)
    cfg = DraftConfig.from_target_config(kimi, 32000, attention="mla")
    assert (cfg.mla_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
            cfg.v_head_dim) == (64, 1536, 512, 128, 64, 128)
    lite = DeepseekV3Config(hidden_size=2048, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512)
    assert mla_sizes(lite, 16, 128)["q_lora_rank"] == 3 * 512  # served with the queries' LoRA only
    smol = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)
    cfg = DraftConfig.from_target_config(smol, 32000, attention="mla", kv_lora_rank=None, v_head_dim=32)
    assert (cfg.mla_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
            cfg.v_head_dim) == (9, 768, 256, 64, 32, 32)
    assert cfg.rope_dim == 32 and Eagle3Draft(cfg).rope.inv_freq.shape == (16,)
    dense = DraftConfig.from_target_config(smol, 32000)
    assert "attention" not in dense.to_dict() and "kv_lora_rank" not in dense.to_dict()
    assert DraftConfig(**dense.to_dict()) == dense and DraftConfig(**cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="qk_rope_head_dim even"):
        mla_config(qk_rope_head_dim=5)
    with pytest.raises(ValueError, match="attention 'gqa'"):
        mla_config(attention="gqa")


def test_softmax_factor_is_deepseeks_yarn_mscale_squared():
    assert softmax_factor(None) == 1.0
    assert softmax_factor({**YARN, "factor": 1.0}) == 1.0  # no scaling: YaRN of factor 1 is plain RoPE
    assert softmax_factor({**YARN, "mscale_all_dim": 0}) == 1.0
    assert softmax_factor({**YARN, "factor": 64.0}) == pytest.approx((0.1 * math.log(64.0) + 1) ** 2)
    assert softmax_factor({"rope_type": "linear", "factor": 4.0}) == 1.0


def test_train_settings_build_the_mla_draft_and_the_doctor_refuses_it_elsewhere():
    """train.draft_attention mla builds the MLA layer with train.mla_* over the target's sizes;
    the doctor's draft-type check FAILs it for a type whose layers are dense (DFlash, P-EAGLE)."""
    from transformers import LlamaConfig

    from eaglet.checks.findings import Probe
    from eaglet.doctor import check_draft_type
    from eaglet.draft.eagle3.training import build

    cfg = Config(train=TrainSection(draft_attention="mla", mla_kv_lora_rank=40, mla_q_lora_rank=0))
    target = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                         intermediate_size=96)
    draft = build(cfg, target, 100, 3)
    attn = draft.layers[0].self_attn
    assert isinstance(attn, MLAAttention) and attn.kv_lora_rank == 40 and hasattr(attn, "q_proj")
    assert draft.config.qk_rope_head_dim == 8 and draft.config.mla_heads == 4

    cfg.train.mla_q_lora_rank = None
    for algorithm, fails in (("eagle3", False), ("dflash", True), ("peagle", True)):
        cfg.train.algorithm = algorithm
        p = Probe(cfg, None)
        check_draft_type(p)
        failed = [f for f in p.findings if f.status == "FAIL" and "draft_attention" in f.found]
        assert bool(failed) == fails, (algorithm, p.findings)


def test_resume_fingerprint_leaves_out_keys_added_at_their_defaults():
    """A checkpoint written before train.algorithm and train.draft_attention existed resumes: the
    fingerprint counts a key added with hashed=UNLESS_DEFAULT only once it is set."""
    from eaglet.training.resume import run_fingerprint

    class Store:
        meta = {"input_hash": "abc"}

        def __len__(self):
            return 3

    model = Eagle3Draft(mla_config(attention="dense"))
    fp = run_fingerprint(model, Store(), torch.zeros(4, dtype=torch.long), Config(), device=torch.device("cpu"))
    assert not {"train.algorithm", "train.draft_attention", "train.mla_heads"} & set(fp)
    assert "model.attention" not in fp and "train.ttt_steps" in fp
    set_ = Config(train=TrainSection(draft_attention="mla"))
    fp = run_fingerprint(Eagle3Draft(mla_config()), Store(), torch.zeros(4, dtype=torch.long), set_,
                         device=torch.device("cpu"))
    assert fp["train.draft_attention"] == "mla" and fp["model.attention"] == "mla"


def test_the_doctor_fails_an_mla_layer_no_engine_serves():
    """train.mla_q_lora_rank 0 (a plain q_proj) trains, but neither engine loads it: the doctor FAILs
    it before anything runs; unset, the draft takes the queries' LoRA."""
    from eaglet.checks.findings import Probe
    from eaglet.doctor import check_draft_type

    for q_lora, fails in ((0, True), (None, False), (64, False)):
        p = Probe(Config(train=TrainSection(draft_attention="mla", mla_q_lora_rank=q_lora)), None)
        check_draft_type(p)
        assert any(f.status == "FAIL" and "mla_q_lora_rank 0" in f.found for f in p.findings) == fails, p.findings

