"""The doctor's plan for EAGLE-3's two attention layers (train.draft_attention dense and mla)
against what training writes, on a tiny DeepSeek-V3-architecture target run through prepare,
extract, vocab and train: the trainable parameters, the bytes of a checkpoint and of the final
draft, and the KV cache the draft takes once vLLM serves it (eaglet/checks/sizing.py,
eaglet/engines/vllm/plan.py). The training FLOPs come from the draft's own linears, which for a
dense draft is the reference formula the hours are scaled by; at Kimi-K2.5's dims each layer's
FLOPs, activations and served KV cache are checked against the arithmetic written out here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from eaglet import pipeline
from eaglet.checks.sizing import (TRAIN_REF, activation_bytes, dense_draft_flops, draft_need, draft_skeleton,
                                  draft_train_flops, gib, train_disk)
from eaglet.config import load_config
from eaglet.doctor import diagnose
from eaglet.draft.eagle3.training import from_config
from eaglet.testing import tiny

pytestmark = pytest.mark.usefixtures("one_thread")

KIMI = Path(__file__).resolve().parent.parent / "examples" / "kimi-k25" / "eaglet.yaml"
KV_LINE = "draft KV cache (served)"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla-plan")
    return {"target": tiny.save_target(root / "dsv3", family="deepseek_v3", template="chatml"),
            "data": tiny.write_jsonl(root / "data.jsonl", tiny.make_conversations(24, seed=5)), "root": root}


@pytest.fixture(scope="module", params=["dense", "mla"])
def trained(request, target):
    """One run per layer: the doctor's plan after vocab (every check), then two training steps
    with a checkpoint after each (both kept) and the final draft."""
    attention = request.param
    cfg = load_config(None, [f"run.dir={target['root'] / attention}", f"target.path={target['target']}",
                             "target.dtype=float32", f"prepare.data=[{target['data']}]", "vocab.size=128",
                             "export.verifier_name_or_path=org/tiny-target", "extract.selfcheck_samples=0",
                             "train.device=cpu", "train.max_steps=2", "train.ckpt_every=1", "train.keep_last=2",
                             "train.max_tokens=256", "train.ttt_steps=2", "train.eval_every=0",
                             "train.tensorboard=false", f"train.draft_attention={attention}"])
    for stage in ("prepare", "extract", "vocab"):
        pipeline.run_stage(cfg, stage)
    probe = diagnose(cfg)
    plan = {"findings": {f.check: f for f in probe.findings}, "disk": train_disk(probe),
            "need": draft_need(probe, target_beside=False)}
    pipeline.run_stage(cfg, "train")
    return attention, cfg, plan


def _du(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _final(cfg) -> tuple[dict, dict[str, int]]:
    """(the final draft's config as training wrote it, {tensor name: values} of its weights)."""
    final = cfg.run_dir / "train" / "final"
    meta = json.loads((final / "draft_config.json").read_text())
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    return meta, {k: int(torch.Size(s).numel()) for k, s in sizes.items()}


def test_the_plan_counts_the_parameters_training_optimizes(trained):
    """Trainable: AdamW's first moments in the last checkpoint; all parameters: the final
    draft's weights less its buffers (the vocabulary maps)."""
    attention, cfg, plan = trained
    last = cfg.run_dir / "train" / "checkpoints" / "step-0000002" / "optimizer.pt"
    moments = torch.load(last, weights_only=True)["state"]
    optimized = sum(s["exp_avg"].numel() for s in moments.values())
    assert plan["disk"]["trainable"] == plan["need"][3] == optimized
    meta, weights = _final(cfg)
    assert meta["draft"].get("attention", "dense") == attention
    names = {n for n, _ in from_config(meta["draft"]).named_parameters()}
    assert plan["disk"]["params"] == sum(v for k, v in weights.items() if k in names)
    assert f"{optimized / 1e6:.1f}M trainable params" in plan["findings"]["disk (train)"].found


def test_the_plan_s_checkpoint_and_final_bytes_are_what_training_wrote(trained):
    """Within 1%: the plan sizes the files' headers and small files from constants."""
    _, cfg, plan = trained
    train = cfg.run_dir / "train"
    for step in ("step-0000001", "step-0000002"):
        wrote = _du(train / "checkpoints" / step)
        assert abs(plan["disk"]["ckpt"] - wrote) <= 0.01 * wrote, (step, plan["disk"]["ckpt"], wrote)
    wrote = _du(train / "final")
    assert abs(plan["disk"]["final"] - wrote) <= 0.01 * wrote, (plan["disk"]["final"], wrote)


def served_kv_arithmetic(config: dict) -> int:
    """Bytes a token of the KV cache vLLM gives a draft of this config (bf16): an MLA layer's
    latent and rope key, else K and V of its KV heads; `config` a DraftConfig dict or an
    exported config.json (a dense draft's transformer_layer_config; an MLA draft's is flat)."""
    if "transformer_layer_config" in config or "num_hidden_layers" in config:  # exported
        layer = config.get("transformer_layer_config", config)
        layers, mla = layer["num_hidden_layers"], "kv_lora_rank" in layer
    else:
        layer = config
        layers, mla = layer["num_layers"], layer.get("attention") == "mla"
    if mla:
        return layers * (layer["kv_lora_rank"] + layer["qk_rope_head_dim"]) * 2
    return layers * 2 * layer["num_key_value_heads"] * layer["head_dim"] * 2


def test_the_served_kv_line_is_the_final_draft_config_s_arithmetic(trained):
    attention, cfg, plan = trained
    line = plan["findings"][KV_LINE]
    meta, _ = _final(cfg)
    got = int(re.search(r"(\d+) B a token", line.found).group(1))
    assert got == served_kv_arithmetic(meta["draft"]) == (80 if attention == "mla" else 256), line.line()
    assert f"train.draft_attention {attention}" in line.expected


@pytest.mark.parametrize("attention", ["dense", "mla"])
def test_the_served_kv_line_is_the_exported_config_s_arithmetic(tmp_path, target, attention):
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", f"target.path={target['target']}", "target.dtype=float32",
                             f"prepare.data=[{target['data']}]", "vocab.size=128", "extract.selfcheck_samples=0",
                             "export.verifier_name_or_path=org/tiny-target", "train.device=cpu", "train.max_steps=1",
                             "train.max_tokens=256", "train.ttt_steps=2", "train.eval_every=0",
                             "train.tensorboard=false", f"train.draft_attention={attention}"])
    pipeline.run_all(cfg, upto="export")
    exported = json.loads((cfg.run_dir / "export" / "vllm" / "config.json").read_text())
    line = {f.check: f for f in diagnose(cfg, "eval").findings}[KV_LINE]
    assert int(re.search(r"(\d+) B a token", line.found).group(1)) == served_kv_arithmetic(exported)


def test_the_served_kv_line_follows_the_vllm_eval(tmp_path, target):
    """The eval preflight gives it while the eval may run vLLM, not with eval.vllm off."""
    sets = [f"run.dir={tmp_path / 'run'}", f"target.path={target['target']}", f"prepare.data=[{target['data']}]",
            "vocab.size=128", "train.draft_attention=mla"]
    assert KV_LINE in {f.check for f in diagnose(load_config(None, sets), "eval").findings}
    assert KV_LINE not in {f.check for f in diagnose(load_config(None, [*sets, "eval.vllm=off"]), "eval").findings}


# ---- Kimi-K2.5 (examples/kimi-k25: its config.json alone, no weights) ------------------------------------

H, I, VD, HEADS = 7168, 18432, 32000, 64  # Kimi-K2.5's hidden, dense-layer MLP, eaglet's draft vocabulary, heads
Q_LORA, KV_LORA, NOPE, ROPE, V = 1536, 512, 128, 64, 128  # its MLA sizes, the MLA draft's by default


def _kimi(attention: str, *more: str):
    cfg = load_config(KIMI, ["extract.vllm_server=null", f"train.draft_attention={attention}", *more])
    probe = diagnose(cfg, "train")
    return cfg, probe, {f.check: f for f in probe.findings}


def test_training_flops_from_the_skeleton_equal_the_dense_formula_and_mla_s_own():
    """The draft's linears, 6 x their weights: a dense draft at the reference's dims gives the
    reference formula exactly, so the reference draft trains at the reference rate; an MLA
    draft's are its own projections (the hours line's rate follows them)."""
    _, dense, lines = _kimi("dense")
    reference = dense_draft_flops(TRAIN_REF["hidden"], TRAIN_REF["inter"], TRAIN_REF["draft_vocab"], TRAIN_REF["kv"],
                                  TRAIN_REF["ttt"])
    assert draft_train_flops(draft_skeleton(dense)[1], TRAIN_REF["ttt"]) == reference
    assert "training ~18.6k" in lines["hours per 100k conversations"].found
    _, mla, lines = _kimi("mla")
    attention = (2 * H * Q_LORA + Q_LORA * HEADS * (NOPE + ROPE) + 2 * H * (KV_LORA + ROPE)
                 + KV_LORA * HEADS * (NOPE + V) + HEADS * V * H)
    by_hand = 6.0 * 3 * H * H + 7 * 6.0 * (attention + 3 * H * I + H * VD)
    assert draft_train_flops(draft_skeleton(mla)[1], 7) == by_hand
    rate = TRAIN_REF["tokens_per_s"] * reference / by_hand
    assert f"training ~{rate / 1e3:.1f}k" in lines["hours per 100k conversations"].found


def test_activations_follow_the_layer_and_keep_the_dense_estimate():
    """Dense: ~16 H-wide and 4 I-wide values a token and step, as before MLA drafts; MLA: 12
    H-wide besides its attention's own widths. 4 bytes each: no GPU here (fp32)."""
    for attention in ("dense", "mla"):
        cfg, probe, lines = _kimi(attention)
        t, dcfg = cfg.train, draft_skeleton(probe)[1].config
        attn = 4 * H if attention == "dense" else (Q_LORA + (KV_LORA + ROPE) + KV_LORA + 2 * HEADS * (NOPE + ROPE)
                                                  + 2 * HEADS * V)
        by_hand = t.max_tokens * (t.ttt_steps * ((12 * H + attn + 4 * I) * 4 + 3 * VD * 4) + 3 * H * 4)
        assert activation_bytes(dcfg, t.max_tokens, t.ttt_steps, 3, 4) == by_hand
        assert f"activations {gib(by_hand)}" in lines["draft beside the engine (per GPU)"].expected
    assert gib(2048 * (7 * ((16 * H + 4 * I) * 4 + 3 * VD * 4) + 3 * H * 4)) == "15.4 GiB"  # docs/kimi-k25.md


def test_the_engine_fed_plan_gives_the_served_kv_next_to_the_engine_s():
    """At tensor_parallel_size 8: a dense draft's 8 KV heads are split over the ranks, MLA's
    latent is whole on each."""
    for attention, total, per_gpu in (("dense", 1 * 2 * 8 * 128 * 2, 1 * 2 * 1 * 128 * 2),
                                      ("mla", 1 * (KV_LORA + ROPE) * 2, 1 * (KV_LORA + ROPE) * 2)):
        _, probe, lines = _kimi(attention)
        checks = [f.check for f in probe.findings]
        assert checks[checks.index("engine memory (per GPU)") + 1] == KV_LINE
        assert checks.count(KV_LINE) == 1
        found = lines[KV_LINE].found
        assert found.startswith(f"{total} B a token") and f"{per_gpu} B on each GPU at tensor_parallel_size 8" in found
        assert f"the target's {61 * (512 + 64) * 2 / 1024:.1f} KiB" in found
