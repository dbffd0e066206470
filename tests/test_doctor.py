"""`eaglet doctor` and the preflight: each check proven by planting the failure it exists for.

The healthy tiny target passes with no warn/FAIL; each planted failure turns exactly the
check that exists for it into a FAIL (or, for remote code, a warn) naming what is wrong.
The shadow run goes through every stage on tiny llama and qwen3 targets.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
import yaml

from eaglet import cli
from eaglet import pipeline
from eaglet.testing import tiny
from eaglet.config import load_config
from eaglet.checks.doctor import diagnose, run_doctor
from eaglet.errors import PreflightError
from eaglet.shadow import shadow_findings


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor")
    return {
        "llama": tiny.save_target(root / "llama", family="llama", template="llama3"),
        "qwen3": tiny.save_target(root / "qwen3", family="qwen3", template="chatml"),
        "data": tiny.write_jsonl(root / "data.jsonl", tiny.make_conversations(24, seed=5)),
    }


def _cfg(tmp_path, assets, *overrides, family="llama"):
    return load_config(None, [f"run.dir={tmp_path / 'run'}", f"target.path={assets[family]}", "target.dtype=float32",
                              f"prepare.data=[{assets['data']}]", "vocab.size=128", *overrides])


def _bad(findings):
    return [f for f in findings if f.status in ("warn", "FAIL")]


def _fails(cfg, stage=None):
    return [f for f in diagnose(cfg, stage).findings if f.status == "FAIL"]


def test_healthy_target_passes_in_seconds(tmp_path, assets):
    lines = []
    t0 = time.time()
    assert run_doctor(_cfg(tmp_path, assets), out=lines.append) == 0
    assert time.time() - t0 < 20
    assert all(ln.split()[0] in ("ok", "info", "doctor:") for ln in lines), "\n".join(lines)
    text = "\n".join(lines)
    for check in ("torch version", "transformers version", "target config", "tokenizer", "architecture",
                  "captured layers", "vocab sizes", "draft vocab", "loss mask", "API contracts", "disk",
                  "memory (extract)", "memory (train)"):
        assert f" {check}" in text, check  # "memory (extract)" reads "GPU memory (extract)" on a GPU
    assert "[2, 4, 5] of L=8" in text and "22 of 22 match" in text


def test_decoder_layer_signature_changed(tmp_path, assets, monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    def forward(self, x, attention_mask=None, **kwargs):  # hidden_states renamed: the hook would miss it
        raise AssertionError("never run: doctor only reads the signature")

    monkeypatch.setattr(LlamaDecoderLayer, "forward", forward)
    (f,) = _fails(_cfg(tmp_path, assets))
    assert "LlamaDecoderLayer.forward" in f.check and "hidden_states" in f.line() and "['x']" in f.found


def test_captured_layers_out_of_range(tmp_path, assets):
    (f,) = _fails(_cfg(tmp_path, assets, "extract.layers=[2, 4, 8]"))
    assert f.check == "captured layers" and "[8]" in f.found and "0..7" in f.fix


def test_template_without_assistant_tokens(tmp_path, assets):
    template = tmp_path / "no_assistant.jinja"  # renders assistant turns as nothing
    template.write_text("{% for m in messages %}{% if m['role'] != 'assistant' %}<|im_start|>{{ m['role'] }}\n"
                        "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}")
    (f,) = _fails(_cfg(tmp_path, assets, f"target.chat_template={template}"))
    assert f.check.startswith("loss mask") and "no_assistant_tokens=8" in f.found and "chat template" in f.fix


def test_tokenizer_larger_than_model_vocabulary(tmp_path, assets):
    folder = tmp_path / "small_vocab"
    shutil.copytree(assets["llama"], folder)
    cfg_json = json.loads((folder / "config.json").read_text())
    cfg_json["vocab_size"] = 300  # the tokenizer has 512 tokens
    (folder / "config.json").write_text(json.dumps(cfg_json))
    bad = _bad(diagnose(_cfg(tmp_path, assets, f"target.path={folder}")).findings)
    assert [(f.status, f.check) for f in bad] == [("warn", "vocab sizes"), ("FAIL", "token ids data.jsonl")]
    assert "ids 300..511" in bad[0].fix and "target.tokenizer" in bad[1].fix


def test_disk_estimate_over_free_space(tmp_path, assets, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 10**5, 10**5))
    (f,) = _fails(_cfg(tmp_path, assets))
    assert f.check == "disk" and "tokens estimated from 8 sampled records" in f.found and "0.1 MiB free" in f.found


def test_disk_estimate_uses_prepare_counts(tmp_path, assets):
    cfg = _cfg(tmp_path, assets)
    stats = pipeline.run_stage(cfg, "prepare")["stats"]
    est = [f for f in diagnose(cfg).findings if f.check == "disk"][0]
    assert f"{stats['tokens']:,} tokens" in est.found and "counted by prepare" in est.found
    assert f"{stats['tokens'] * (4 * 64 * 2 + 5) / 2**20:.1f} MiB" in est.found


def test_gpu_memory_too_small(tmp_path, assets, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (2**20, 80 * 2**30))
    fails = _fails(_cfg(tmp_path, assets))
    assert [f.check for f in fails] == ["GPU memory (extract)", "GPU memory (train)"]
    assert "1.0 MiB free on cuda:0" in fails[0].found and "batch_tokens" in fails[0].fix


def test_unsupported_architecture(tmp_path, assets):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=512)).save_pretrained(folder)
    for f in assets["llama"].iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, folder)
    (f,) = _fails(_cfg(tmp_path, assets, f"target.path={folder}"))
    assert f.check == "architecture" and "GPT2LMHeadModel" in f.found
    assert "Llama" in f.expected and "DeepSeek-V3" in f.expected and "eaglet/targets/families.py" in f.fix


def test_removed_kwarg_in_a_contract(tmp_path, assets, monkeypatch):
    from transformers import PreTrainedTokenizerBase

    real = PreTrainedTokenizerBase.apply_chat_template

    def apply_chat_template(self, conversation, chat_template=None, add_generation_prompt=False, tokenize=True,
                            return_dict=True, **kwargs):  # return_assistant_tokens_mask gone (swallowed by kwargs)
        return real(self, conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                    tokenize=tokenize, return_dict=return_dict, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "apply_chat_template", apply_chat_template)
    (f,) = _fails(_cfg(tmp_path, assets))
    assert "apply_chat_template" in f.check and "no parameter return_assistant_tokens_mask" in f.found


def test_old_library_versions(tmp_path, assets, monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda pkg: {"transformers": "4.57.0", "torch": "2.8.0"}.get(pkg) or real(pkg))
    fails = _fails(_cfg(tmp_path, assets), "train")
    assert [(f.check, f.found) for f in fails] == [("torch version", "2.8.0"), ("transformers version", "4.57.0")]


def test_remote_code_is_named(tmp_path, assets):
    folder = tmp_path / "remote"
    shutil.copytree(assets["llama"], folder)
    cfg_json = json.loads((folder / "config.json").read_text())
    cfg_json["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    (folder / "config.json").write_text(json.dumps(cfg_json))
    (f,) = _bad(diagnose(_cfg(tmp_path, assets, f"target.path={folder}")).findings)
    assert f.status == "warn" and f.check == "remote code" and "modeling_custom.CustomForCausalLM" in f.found
    assert "target.trust_remote_code" in f.fix

    cfg_json["model_type"] = "custom_unknown"  # a model type transformers does not have: it needs the repo's code
    (folder / "config.json").write_text(json.dumps(cfg_json))
    fails = _fails(_cfg(tmp_path, assets, f"target.path={folder}"))
    assert fails[0].check == "target config" and "target.trust_remote_code: true" in fails[0].fix


def test_preflight_stops_extract_before_loading_weights(tmp_path, assets, monkeypatch):
    import eaglet.stages.extract as extract_mod

    cfg = _cfg(tmp_path, assets, "extract.layers=[2, 9]")
    pipeline.run_stage(cfg, "prepare")
    loads = []
    monkeypatch.setattr(extract_mod, "load_target", lambda t: loads.append(t) or (_ for _ in ()).throw(SystemExit))
    with pytest.raises(PreflightError, match=r"captured layers.*\[9\]"):
        pipeline.run_stage(cfg, "extract")
    assert loads == []
    with pytest.raises(SystemExit):  # --skip-preflight: straight to the (planted) weight load
        pipeline.run_stage(cfg, "extract", preflight=False)
    assert len(loads) == 1

    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert cli.main(["extract", str(path)]) == 3  # a preflight FAIL is a clean error
    assert cli.main(["doctor", str(path)]) == 1
    assert cli.build_parser().parse_args(["run", str(path), "--skip-preflight"]).skip_preflight


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_shadow_run(tmp_path, assets, family):
    lines = []
    t0 = time.time()
    rc = run_doctor(_cfg(tmp_path, assets, family=family), out=lines.append, more=shadow_findings)
    seconds = time.time() - t0
    assert rc == 0, "\n".join(lines)
    shadow = [ln for ln in lines if "shadow:" in ln]
    stages = [s for s in pipeline.STAGE_NAMES]
    for name in ["tiny model", *stages, "total"]:
        assert any(ln.startswith("ok") and f"shadow: {name}:" in ln for ln in shadow), (name, shadow)
    cls = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    assert f"found {cls} ({family}), 8 layers" in "\n".join(shadow)
    assert seconds < 60
