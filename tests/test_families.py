"""Every target family of eaglet/targets/families.py on a tiny random model of its own transformers class.

Per family (and for Kimi-K2.5 both nestings: transformers' class, and a checkpoint-style
remote-code wrapper loaded with trust_remote_code):
- the states extraction captures in a padded batch equal the model's own output_hidden_states
  of each sample alone, and the embedding table extraction saves gives output_hidden_states[0];
- the teacher (the LM head's input, through the LM head and the family's logit softcap)
  gives the model's own logits, also through train's teacher_targets with the saved head;
- `eaglet doctor` passes, and so does its shadow run (every stage on a tiny model of the
  family); ten training steps on the shadow's store end below a run of the same batches at a
  zero learning rate, on the last training batches and on the held-out batch;
- the draft is a dense Llama layer whose sizes follow DraftConfig.from_target_config's rule.
A family whose classes the installed transformers lacks is skipped, with the reason.
"""

from __future__ import annotations

import json
import shutil
from functools import partial

import numpy as np
import pytest
import torch

from eaglet import pipeline
from eaglet.testing import tiny
from eaglet.config import Config, load_config
from eaglet.doctor import run_doctor
from eaglet.shadow import shadow_findings
from eaglet.engines.hf.capture import capture, head_meta, pad_batch, save_target_head
from eaglet.formats.store import HEAD_FILE
from eaglet.targets.families import FAMILIES, UnsupportedFamily, family_of, markdown_table
from eaglet.draft.loss import teacher_targets
from eaglet.draft.layers import draft_intermediate_size
from eaglet.draft.eagle3.model import DraftConfig
from eaglet.targets.load import TargetParts, load_target
from eaglet.targets.families import resolve_layers

pytestmark = pytest.mark.usefixtures("one_thread")

# (family key, remote-code wrapper)
VARIANTS = [(k, False) for k in FAMILIES] + [("kimi_k25", True)]
IDS = [k + ("-remote" if remote else "") for k, remote in VARIANTS]
LENGTHS = (29, 14, 7)  # longer than the tiny sliding windows / attention chunks (8)
# The vocabulary padded past the tokenizer's 512 (as real models pad it): the Qwen2 tokenizer
# class adds <|endoftext|> when it loads the tiny tokenizer.
VOCAB = 520


def _skip_unavailable(key: str, remote: bool = False) -> None:
    fam = FAMILIES[key]
    if remote:  # the remote-code wrapper needs only its language model's classes
        fam = FAMILIES[fam.wraps]
    if not fam.available():
        import transformers

        missing = [c for c in fam.required_classes() if not hasattr(transformers, c)]
        pytest.skip(f"{fam.name}: transformers {transformers.__version__} has no {', '.join(missing)}")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    tok = tiny.build_tokenizer("chatml")
    return {"root": root, "tok": tok, "targets": {},
            "data": tiny.write_jsonl(root / "data.jsonl", tiny.make_conversations(24, seed=5))}


def _target(assets, key: str, remote: bool):
    """The tiny target's folder (model and tokenizer), written once per module."""
    _skip_unavailable(key, remote)
    name = key + ("-remote" if remote else "")
    if name not in assets["targets"]:
        assets["targets"][name] = tiny.save_target(assets["root"] / name, family=key, remote_code=remote,
                                                   tokenizer=assets["tok"], vocab_size=VOCAB)
    return assets["targets"][name]


def _load(folder, remote: bool):
    cfg = Config()
    cfg.target.path, cfg.target.dtype, cfg.target.device = str(folder), "float32", "cpu"
    cfg.target.trust_remote_code = remote
    return load_target(cfg.target)


@pytest.mark.parametrize("key,remote", VARIANTS, ids=IDS)
def test_capture_and_teacher_equal_the_models_own(tmp_path, assets, key, remote):
    model, _ = _load(_target(assets, key, remote), remote)
    parts = TargetParts.of(model)
    assert parts.family.key in (key, "deepseek_v3")  # a Kimi-K2 config is a DeepSeek-V3 one
    if key == "kimi_k25":
        nested = model.language_model.model if remote else model.model.language_model
        assert parts.decoder is nested
    _check_capture_and_teacher(model, parts, tmp_path)
    if FAMILIES[key].embed_scale:
        assert parts.embed_scale == pytest.approx(parts.hidden_size ** 0.5)


def test_gemma3_multimodal_class(tmp_path):
    """Gemma-3's image-text-to-text class (decoder at model.language_model) applies no final
    softcap even when its text config has one: the adapter follows the class."""
    import transformers as T

    torch.manual_seed(0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = T.Gemma3Config(text_config=tiny.tiny_config("gemma3").to_dict(), vision_config=vision, mm_tokens_per_image=4,
                         boi_token_index=500, eoi_token_index=501, image_token_index=502)
    model = T.Gemma3ForConditionalGeneration(cfg).eval()
    parts = TargetParts.of(model)
    assert parts.family.key == "gemma3" and parts.decoder is model.model.language_model
    assert parts.embed_scale == 8.0 and parts.logit_softcap is None and cfg.text_config.final_logit_softcapping
    _check_capture_and_teacher(model, parts, tmp_path)


def _check_capture_and_teacher(model, parts, tmp_path) -> None:
    layers = resolve_layers(None, parts.num_layers)
    rng = np.random.default_rng(0)
    samples = [rng.integers(1, 500, n) for n in LENGTHS]
    ids, mask = pad_batch(samples)
    save_target_head(parts, model, tmp_path)
    from safetensors.torch import load_file

    head = load_file(str(tmp_path / HEAD_FILE))
    meta = head_meta(parts)
    H = parts.hidden_size
    with torch.inference_mode():
        aux, final = capture(parts, layers, ids, mask, torch.float32)
        for b, n in enumerate(LENGTHS):
            ref = model(input_ids=ids[b:b + 1, :n], output_hidden_states=True, use_cache=False)
            for j, i in enumerate(layers):  # the state entering decoder layer i, padded batch vs alone
                torch.testing.assert_close(aux[b, :n, j * H:(j + 1) * H], ref.hidden_states[i][0],
                                           rtol=1e-4, atol=1e-5)
            # what the draft's frozen embedding gives is what the target's first layer gets
            torch.testing.assert_close(head["embed_tokens"][ids[b, :n]], ref.hidden_states[0][0], rtol=0, atol=0)
            logits = parts.logits(final[b:b + 1, :n])
            torch.testing.assert_close(logits, ref.logits, rtol=1e-4, atol=1e-5)
            # train's teacher from the saved head: the model's own distribution (full draft vocabulary)
            V = ref.logits.shape[-1]
            probs, in_vocab = teacher_targets(final[b:b + 1, :n], head["lm_head"], torch.ones(V, dtype=torch.bool),
                                              torch.zeros(V, dtype=torch.int64), logit_scale=meta["logit_scale"],
                                              logit_softcap=meta["logit_softcap"])
            torch.testing.assert_close(probs, ref.logits.float().softmax(-1), rtol=1e-4, atol=1e-6)
            assert bool(in_vocab.all())
            if parts.logit_softcap:  # the softcap matters: the bare head is not the model's logits
                assert (parts.lm_head(final[b:b + 1, :n]) - ref.logits).abs().max() > 1e-4
    if parts.embed_scale != 1.0:
        assert not torch.equal(head["embed_tokens"], parts.embed_tokens.weight)


def _rule_intermediate(key: str, tc: dict) -> int:
    """The draft's MLP width, by DraftConfig.from_target_config's rule, spelled out per family."""
    if key == "llama4":
        return tc["intermediate_size_mlp"]  # the dense layers' width (intermediate_size is an expert's)
    if key == "gpt_oss":
        return 256  # experts only (intermediate_size is an expert's): 4 x H rounded up to 256
    return tc["intermediate_size"]  # dense targets, and MoE targets' dense (first / mlp_only) layers


@pytest.mark.parametrize("key,remote", VARIANTS, ids=IDS)
def test_doctor_shadow_run_and_training(tmp_path, assets, key, remote, monkeypatch):
    """The doctor and its shadow run (every stage) pass; then more steps on the shadow's store lower the loss."""
    import eaglet.stages.evaluate
    from eaglet.shadow import shadow_config
    from eaglet.formats.draft import FINAL_DIR, load_final

    # eval's figure is a third of a shadow run's time here and has nothing per family (test_specdec draws it)
    monkeypatch.setattr(eaglet.stages.evaluate, "plot_eval", lambda result: b"")

    folder = _target(assets, key, remote)
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", f"target.path={folder}", "target.dtype=float32",
                             f"target.trust_remote_code={str(remote).lower()}", f"prepare.data=[{assets['data']}]",
                             "vocab.size=128", "train.ttt_steps=2", "export.verifier_name_or_path=org/tiny-target"])
    lines: list[str] = []
    rc = run_doctor(cfg, out=lines.append, more=partial(shadow_findings, keep=tmp_path / "shadow"))
    text = "\n".join(lines)
    assert rc == 0, text
    assert not [ln for ln in lines if ln.startswith(("warn", "FAIL"))], text
    assert f"found {FAMILIES[key].name if key != 'kimi_k2' else 'DeepSeek-V3'} adapter" in text
    for stage in [*pipeline.STAGE_NAMES, "total"]:
        assert any(ln.startswith("ok") and f"shadow: {stage}:" in ln for ln in lines), (stage, text)

    scfg, _ = shadow_config(cfg, tmp_path / "shadow", tmp_path / "shadow" / "target", 8)
    t = scfg.train
    t.max_steps, t.epochs, t.warmup_steps, t.log_every, t.ckpt_every = 10, 10, 1, 1, 10
    train_dir = tmp_path / "shadow" / "run" / "train"
    runs = {}
    # The reference: the same run (seed, batches, order) at a learning rate too small to move an
    # fp32 weight (train.lr must be > 0), so each step's loss is the untrained draft's on that batch.
    for name, lr in (("trained", 3e-3), ("reference", 1e-30)):
        t.lr = lr
        shutil.rmtree(train_dir)  # a fresh run, not a resume of the shadow's two steps (or of the other run)
        pipeline.run_stage(scfg, "train", force=True, preflight=False)
        log = [json.loads(ln) for ln in (train_dir / "log.jsonl").read_text().splitlines()]
        runs[name] = ([r["loss"] for r in log if r["split"] == "train"], [r["loss"] for r in log if r["split"] == "eval"])
    (losses, held), (ref, ref_held) = runs["trained"], runs["reference"]
    assert len(losses) == len(ref) == 10 and len(held) == len(ref_held) == 1, runs
    assert losses[0] == ref[0], runs  # step 1 is before any update: the two runs see the same batches
    # A random target's teacher is nearly flat, so the loss falls by little; compared on the same
    # batches, batch noise cancels. Measured over the 13 variants: the reference's own losses spread
    # by up to 0.009 from batch to batch; the trained run is 0.020-0.035 below it on each of the last
    # three batches and 0.021-0.034 below it on the held-out batch. A run that does not learn is 0 below.
    margin = 0.01
    assert all(r - x > margin for x, r in zip(losses[-3:], ref[-3:])), runs
    assert ref_held[0] - held[0] > margin, runs

    draft, _ = load_final(train_dir / FINAL_DIR)  # dense: a Llama MLP of the rule's width, no experts
    tc = json.loads((tmp_path / "shadow" / "run" / "extract" / "target_config.json").read_text())
    assert draft.config.intermediate_size == _rule_intermediate(key, tc)
    assert not [n for n, _ in draft.named_parameters() if "expert" in n or "gate." in n]


def _draft_sizes(config) -> tuple[int, int, int, int]:
    d = DraftConfig.from_target_config(config, draft_vocab_size=min(32000, config.vocab_size))
    return d.num_attention_heads, d.num_key_value_heads, d.head_dim, d.intermediate_size


def test_draft_size_rule_on_real_sizes():
    """The documented rule on the families' real (default) sizes: MLA -> 128-wide heads, H/128
    of them, 8 KV heads; MoE -> the dense layers' width, else 4 x H rounded up to 256."""
    import transformers as T

    cases = {
        "DeepseekV3Config": (T.DeepseekV3Config, (56, 8, 128, 18432)),  # DeepSeek-V3 / Kimi-K2: H 7168
        "DeepseekV2Config": (T.DeepseekV2Config, None),
        "Qwen3MoeConfig": (T.Qwen3MoeConfig, None),
        "GptOssConfig": (T.GptOssConfig, None),
        "Llama4TextConfig": (T.Llama4TextConfig, (40, 8, 128, 16384)),  # intermediate_size_mlp
        "LlamaConfig": (T.LlamaConfig, (32, 32, 128, 11008)),
    }
    for name, (cls, want) in cases.items():
        c = cls()
        got = _draft_sizes(c)
        if want is not None:
            assert got == want, name
        assert got[3] == draft_intermediate_size(c)
    c = T.GptOssConfig()  # experts only: 4 x 2880 = 11520 (a multiple of 256)
    assert _draft_sizes(c)[3] == 11520 and c.intermediate_size == 2880
    c = T.Qwen3MoeConfig(intermediate_size=6144, moe_intermediate_size=768)  # Qwen3-30B-A3B
    assert _draft_sizes(c)[3] == 6144
    c = T.DeepseekV2Config(hidden_size=2048, num_attention_heads=16, intermediate_size=10944)  # V2-Lite
    assert _draft_sizes(c) == (16, 8, 128, 10944)


def test_unsupported_family_names_the_supported_ones_and_the_module():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedFamily) as e:
        TargetParts.of(model)
    msg = str(e.value)
    assert "gpt2" in msg and "eaglet/targets/families.py" in msg
    assert all(f.name in msg for f in FAMILIES.values())
    assert family_of(GPT2Config()) is None and family_of(tiny.tiny_config("qwen3")).key == "qwen3"


def test_kimi_k2_model_type():
    """Kimi-K2's checkpoints say model_type "kimi_k2" (their remote code's DeepSeek-V3 config):
    its adapter finds the parts, and train reads its saved text config through DeepseekV3Config."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from eaglet.targets.families import text_config_from_dict
    from eaglet.testing.remote_kimi_k25 import KimiK2Config

    sizes = {k: v for k, v in tiny.tiny_config("kimi_k2").to_dict().items() if k != "model_type"}
    model = DeepseekV3ForCausalLM(KimiK2Config(**sizes))
    parts = TargetParts.of(model)
    assert parts.family.key == "kimi_k2" and parts.decoder is model.model and parts.num_layers == 8
    saved = model.config.to_dict()
    assert saved["model_type"] == "kimi_k2"
    back = text_config_from_dict(saved)
    assert type(back) is DeepseekV3Config and back.kv_lora_rank == 32 and back.first_k_dense_replace == 1
    assert _draft_sizes(back) == _draft_sizes(tiny.tiny_config("kimi_k2"))


def test_the_families_page_has_the_generated_table():
    from pathlib import Path

    page = (Path(__file__).parent.parent / "docs" / "families.md").read_text()
    assert markdown_table() in page, "regenerate the table: python -m eaglet.targets.families"
