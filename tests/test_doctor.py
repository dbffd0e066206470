"""`eaglet doctor` and the preflight: each check proven by planting the failure it exists for.

The healthy tiny target passes with no warn/FAIL; each planted failure turns exactly the
check that exists for it into a FAIL (or, for remote code, a warn) naming what is wrong.
The shadow run goes through every stage on tiny llama and qwen3 targets.
"""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest
import torch
import yaml

from eaglet import cli
from eaglet import pipeline
from eaglet.testing import tiny
from eaglet.config import load_config
from eaglet.checks.contracts import check_contracts
from eaglet.doctor import diagnose, preflight, run_doctor
from eaglet.errors import InputError, PreflightError
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
                              f"prepare.data=[{assets['data']}]", "vocab.size=128",
                              "export.verifier_name_or_path=org/tiny-target", *overrides])  # no local-path warn


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
    assert "[2, 4, 5] of L=8" in text
    n = re.search(r"found (\d+) of (\d+) match", text)
    assert n and n[1] == n[2] and int(n[1]) >= 19, text


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


def test_bad_records_in_the_sampled_rows_are_named_not_a_fail(tmp_path, assets):
    """Before, a lone surrogate among the 8 sampled records failed the data check (and so prepare's
    preflight, exit 3) naming no row, and deep nesting raised RecursionError. They are bad records:
    prepare skips them, so the doctor names the first one's file and row: an info line while they
    are a few (prepare counts them; the preflight stays quiet), a warn once they are most."""
    lines = [json.dumps(r) for r in tiny.make_conversations(6, seed=5)]
    lines[1] = '{"conversations": [{"from": "human", "value": "a\\ud800"}, {"from": "gpt", "value": "b"}]}'
    lines[2] = '{"conversations": ' + "[" * 5000 + "]" * 5000 + "}"
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(lines) + "\n")
    cfg = _cfg(tmp_path, assets, f"prepare.data=[{data}]")
    assert _bad(preflight(cfg, "prepare")) == []
    (f,) = [f for f in diagnose(cfg).findings if f.check == "loss mask bad.jsonl"]
    assert f.status == "info" and f.found.startswith("4 with ") and (
        "skipped invalid_unicode=1, too_deeply_nested=1; e.g. bad.jsonl:line 2: invalid_unicode: a lone surrogate "
        "\\ud800 (half of a UTF-16 pair, not a character) at conversations[0].value") in f.found
    lines[3] = lines[4] = lines[1]  # 4 of 6 skipped: most of the sample
    data.write_text("\n".join(lines) + "\n")
    (f,) = _bad(preflight(cfg, "prepare"))
    assert (f.status, f.check) == ("warn", "loss mask bad.jsonl") and f.found.startswith("2 with ")
    assert "skipped invalid_unicode=3, too_deeply_nested=1" in f.found and "skipped.jsonl" in f.fix


def test_a_default_config_with_a_local_target_has_no_export_verifier_warn(tmp_path, assets):
    """The vLLM export names a local target by its path unless export.verifier_name_or_path is set:
    that serves on this machine, so a default config gets an info line saying how to serve it
    elsewhere, not a warn (it warned on every run with a local target)."""
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", f"target.path={assets['llama']}",
                             "target.dtype=float32", f"prepare.data=[{assets['data']}]", "vocab.size=128"])
    lines = []
    assert run_doctor(cfg, out=lines.append) == 0
    assert [ln for ln in lines if ln.startswith(("warn", "FAIL"))] == []
    (line,) = [ln for ln in lines if " export verifier:" in ln]
    assert line.startswith("info") and str(assets["llama"]) in line and "export.verifier_name_or_path" in line
    # an MLA draft's export names no verifier: no line about one
    from eaglet.checks.findings import Probe
    from eaglet.doctor import check_export_verifier

    probe = Probe(load_config(None, [f"target.path={assets['llama']}", "train.draft_attention=mla"]), None)
    check_export_verifier(probe)
    assert probe.findings == []


def test_tokenizer_larger_than_model_vocabulary(tmp_path, assets):
    folder = tmp_path / "small_vocab"
    shutil.copytree(assets["llama"], folder)
    cfg_json = json.loads((folder / "config.json").read_text())
    cfg_json["vocab_size"] = 300  # the tokenizer has 512 tokens
    (folder / "config.json").write_text(json.dumps(cfg_json))
    bad = _bad(diagnose(_cfg(tmp_path, assets, f"target.path={folder}")).findings)
    assert [(f.status, f.check) for f in bad] == [("warn", "vocab sizes"), ("FAIL", "token ids data.jsonl")]
    assert "ids 300..511" in bad[0].fix and "target.tokenizer" in bad[1].fix


def _free(monkeypatch, free):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**15, 10**15 - free, free))


def test_disk_estimate_over_free_space(tmp_path, assets, monkeypatch):
    _free(monkeypatch, 10**5)
    store, train = _fails(_cfg(tmp_path, assets))
    assert store.check == "disk" and "tokens estimated from 8 sampled records" in store.found
    assert "0.1 MiB free" in store.found
    assert train.check == "disk (train)" and "the store and target head extract writes first" in train.found


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


def _host_free(monkeypatch, free):
    """No GPU, and `free` bytes of host memory available (the figure the machine would give)."""
    from eaglet import doctor

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(doctor, "host_free_bytes", lambda: free)


def test_host_memory_too_small_fails_on_the_cpu(tmp_path, assets, monkeypatch):
    """Without a GPU the stages run on the CPU: their plans are held to the host's available
    memory, a FAIL naming the setting to lower (they were an "info" line, whatever the size)."""
    _host_free(monkeypatch, 2**20)
    extract, train = _fails(_cfg(tmp_path, assets))
    assert (extract.check, train.check) == ("memory (extract)", "memory (train)")
    assert "host memory" in extract.expected and extract.found == "1.0 MiB available"
    assert "lower extract.batch_tokens (now 16384)" in extract.fix
    preset = "; or run with --preset cpu (sizes for a CPU; the keys the file sets still win: docs/config.md)"
    assert extract.fix.endswith(preset)
    assert train.fix == "lower train.max_tokens (now 8192) or train.ttt_steps (now 7)" + preset
    cpu = load_config(None, [f"run.dir={tmp_path / 'run'}", f"target.path={assets['llama']}",
                             f"prepare.data=[{assets['data']}]", "vocab.size=128"], preset="cpu")
    extract, train = _fails(cpu)  # 1 MiB holds no plan; the preset is no longer the fix to suggest
    assert train.fix == "lower train.max_tokens (now 1024) or train.ttt_steps (now 3)" and "preset" not in extract.fix


def _needs(monkeypatch):
    """{what: bytes} of each memory plan the doctor holds to the free memory, as it computes them."""
    from eaglet import doctor

    needs, real = {}, doctor._memory_finding

    def record(p, what, need, *args, **kwargs):
        needs[what] = need
        return real(p, what, need, *args, **kwargs)

    monkeypatch.setattr(doctor, "_memory_finding", record)
    return needs


@pytest.mark.parametrize("what", ["extract", "train"])
@pytest.mark.parametrize("share, status", [(1.01, "FAIL"), (0.95, "warn"), (0.85, "ok")])
def test_host_memory_within_a_tenth_of_the_plan_warns(tmp_path, assets, monkeypatch, what, share, status):
    """need > free: FAIL; need above 90% of free: warn; below: ok (extract's and train's plans, on
    the CPU)."""
    needs = _needs(monkeypatch)
    _host_free(monkeypatch, 10**15)
    cfg = _cfg(tmp_path, assets)
    diagnose(cfg)
    _host_free(monkeypatch, int(needs[what] / share))
    (f,) = [f for f in diagnose(cfg).findings if f.check == f"memory ({what})"]
    assert f.status == status, f.line()


def _smollm2_shaped(tmp_path, assets):
    """A target folder with SmolLM2-135M's config (576 wide, 30 layers, 49,152 tokens) and the tiny
    tokenizer: the doctor's plans read the config only, never the weights."""
    folder = tmp_path / "smollm2-shaped"
    shutil.copytree(assets["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_readme_config_on_a_23_gib_cpu_machine_fails_and_names_the_preset(tmp_path, assets, monkeypatch):
    """The README's "your model, your data" config (max_length 2048, the GPU-sized defaults) with
    SmolLM2 on a 23 GiB machine without a GPU: training's ~24.7 GiB is a FAIL naming the settings
    and the cpu preset; with --preset cpu the same file fits."""
    folder = _smollm2_shaped(tmp_path, assets)
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump({"run": {"dir": "runs/my-draft"}, "target": {"path": str(folder)},
                                    "prepare": {"data": [str(assets["data"])], "max_length": 2048},
                                    "train": {"epochs": 2}}))
    _host_free(monkeypatch, 23 * 2**30)
    (f,) = _fails(load_config(path))
    assert f.check == "memory (train)" and re.search(r"~24\.\d GiB of host memory", f.expected), f.line()
    assert "train.max_tokens (now 8192)" in f.fix and "--preset cpu" in f.fix
    fits = [f for f in diagnose(load_config(path, preset="cpu")).findings if f.check.startswith("memory")]
    assert [f.status for f in fits] == ["ok", "ok"], [f.line() for f in fits]


def test_a_teacher_chunk_past_the_micro_batch_costs_only_the_micro_batch(tmp_path, assets, monkeypatch):
    """The teacher takes train.teacher_chunk positions of a micro-batch at a time: a chunk larger
    than train.max_tokens holds max_tokens positions, not a trillion (a FAIL before)."""
    _host_free(monkeypatch, 4 * 2**30)
    fs = diagnose(_cfg(tmp_path, assets, "train.teacher_chunk=1000000000000")).findings
    (f,) = [f for f in fs if f.check == "memory (train)"]
    assert f.status == "ok" and f"teacher {8192 * 512 * 4 * 2 / 2**20:.1f} MiB" in f.expected, f.line()  # V 512


def test_train_preflight_stops_a_plan_the_host_cannot_hold(tmp_path, assets, monkeypatch):
    """train.ttt_steps 100000 on a 23 GiB machine: ~880 GiB of activations; the preflight of train
    stops it (exit 3) before any weight loads, naming the setting."""
    cfg = _cfg(tmp_path, assets, "train.ttt_steps=100000", "train.max_tokens=1024", "extract.selfcheck_samples=0")
    pipeline.run_all(cfg, upto="extract", preflight=False)  # train's preflight reads the target's config from the store
    _host_free(monkeypatch, 23 * 2**30)
    with pytest.raises(PreflightError, match=r"FAIL  memory \(train\): expected ~\d+\.\d GiB of host memory .*found "
                                             r"23\.0 GiB available; fix: lower train\.max_tokens \(now 1024\) or "
                                             r"train\.ttt_steps \(now 100000\)") as e:
        preflight(cfg, "train")
    assert e.value.exit_code == 3


def test_host_free_memory_reads_meminfo_and_a_cgroup_limit(monkeypatch):
    """MemAvailable, capped by a container's cgroup limit less its use."""
    from eaglet import doctor

    files = {"/proc/meminfo": "MemTotal: 100 kB\nMemAvailable:   2048 kB\n"}
    real = doctor.Path.read_text

    def read_text(self, *a, **k):
        if str(self) in files:
            return files[str(self)]
        if str(self).startswith("/sys/fs/cgroup"):
            raise FileNotFoundError(str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(doctor.Path, "read_text", read_text)
    assert doctor.host_free_bytes() == 2048 * 1024
    files.update({"/sys/fs/cgroup/memory.max": "1500000\n", "/sys/fs/cgroup/memory.current": "500000\n"})
    assert doctor.host_free_bytes() == 1000000
    files["/sys/fs/cgroup/memory.max"] = "max\n"  # no limit
    assert doctor.host_free_bytes() == 2048 * 1024


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
    import eaglet.engines.hf.extract as extract_mod

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


def test_the_shadow_names_its_own_cap_on_prepare_max_length(tmp_path, assets, monkeypatch, capsys):
    """The shadow renders at most SHADOW_MAX_LENGTH tokens a record: its first line names that cap
    where it cuts the config's prepare.max_length, and records it skips there are put down to the
    shadow's cap, not the config's (it printed '0 assistant tokens after truncation' for a config
    whose max_length held them)."""
    from eaglet import shadow

    monkeypatch.setattr(shadow, "SHADOW_MAX_LENGTH", 48)
    records = [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "a short reply"}]}
               for q in ["hi", " ".join(["word"] * 80), "what is two plus two", "hello", " ".join(["word"] * 80), "ok"]]
    data = tiny.write_jsonl(tmp_path / "long.jsonl", records)
    cfg = _cfg(tmp_path, assets, f"prepare.data=[{data}]", "prepare.report_examples=5")
    lines = []
    assert run_doctor(cfg, out=lines.append, more=shadow_findings) == 0, "\n".join(lines)
    (first,) = [ln for ln in lines if "shadow: tiny model:" in ln]
    assert "shadow settings: prepare.max_length 2048 -> 48 (the shadow's cap: a record whose assistant turn " \
           "starts later is skipped here, not in the real run)" in first
    (prep,) = [ln for ln in lines if "shadow: prepare:" in ln]
    assert prep.endswith("2 of 6 records skipped (no_assistant_tokens=2) at prepare.max_length 48 (the shadow's "
                         "cap, not the config's 2048)"), prep
    err = capsys.readouterr().err
    assert f"[prepare] skipped {data}:" not in err  # no line a record in the shadow
    assert "WARNING" not in err  # two steps train nothing: no warning that they did not (eval's untrained comparison)


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


# ---- each stage's preflight, and the contracts' rules --------------------------------------------

def _cli_config(tmp_path, cfg):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    return str(path)


def _stderr_line(capsys):
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("stage", ["prepare", "extract", "train", "eval", "regenerate"])
def test_every_stage_preflight_checks_its_contracts(tmp_path, assets, stage):
    findings = diagnose(_cfg(tmp_path, assets), stage).findings
    assert not [f.line() for f in findings if f.status == "FAIL"]
    (api,) = [f for f in findings if f.check == "API contracts"]
    assert re.match(r"\d+ of \d+ match", api.found) and not api.found.startswith("0 of")


def test_required_parameter_rule_on_every_family():
    """Every family's real classes pass every row, `passes` included (a rule too strict for a real
    class would stop every run); the same decoder layer with one more required parameter fails."""
    from types import SimpleNamespace

    from eaglet.engines import vllm as vllm_engine
    from eaglet.targets.families import FAMILIES, tiny_config
    from eaglet.targets.load import TargetParts, build_meta_model
    from transformers import PreTrainedTokenizerFast

    def forward(self, hidden_states, expert_bias, attention_mask=None, **kwargs):
        raise AssertionError("never run")

    def no_vllm(c):  # the vLLM engine's rows, as where vLLM is not installed
        return vllm_engine.unchecked_contract(SimpleNamespace(vllm_ready=False), c)

    for family in FAMILIES:
        model = build_meta_model(tiny_config(family))
        parts = TargetParts.of(model)
        layers = list(dict.fromkeys(type(m) for m in parts.layers))
        roles = {"decoder_layer": layers, "base_model": [type(parts.decoder)], "causal_lm": [type(model)],
                 "tokenizer": [PreTrainedTokenizerFast]}
        bad = [(r.target, r.problem) for r in check_contracts(roles, unchecked=no_vllm) if not r.ok]
        assert bad == [], (family, bad)
        planted = [type(f"Planted{c.__name__}", (c,), {"forward": forward}) for c in layers]
        bad = [r.problem for r in check_contracts({**roles, "decoder_layer": planted}, unchecked=no_vllm) if not r.ok]
        assert bad == ["requires expert_bias, which eaglet's call does not pass"] * len(layers), (family, bad)


def test_decoder_layer_with_an_extra_required_parameter(tmp_path, assets, monkeypatch):
    """The base model would call the layer without it: the doctor and extract's preflight FAIL
    before a weight loads (only the first parameter's name was checked)."""
    import eaglet.engines.hf.extract as extract_mod
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cfg = _cfg(tmp_path, assets)
    pipeline.run_stage(cfg, "prepare")

    def forward(self, hidden_states, router_state, attention_mask=None, **kwargs):
        raise AssertionError("never run: doctor only reads the signature")

    monkeypatch.setattr(LlamaDecoderLayer, "forward", forward)
    (f,) = _fails(cfg)
    assert "LlamaDecoderLayer.forward" in f.check and "requires router_state, which eaglet's call does not pass" in f.found
    loads = []
    monkeypatch.setattr(extract_mod, "load_target", lambda t: loads.append(t) or (_ for _ in ()).throw(SystemExit))
    with pytest.raises(PreflightError, match="(?s)LlamaDecoderLayer.forward.*router_state"):
        pipeline.run_stage(cfg, "extract")
    assert loads == []


def test_render_jinja_template_renamed_stops_prepare(tmp_path, assets, monkeypatch, capsys):
    """prepare had no preflight: it dropped records as template_error and went on."""
    from transformers.utils import chat_template_utils

    monkeypatch.setattr(chat_template_utils, "render_chat_template", chat_template_utils.render_jinja_template,
                        raising=False)
    monkeypatch.delattr(chat_template_utils, "render_jinja_template")
    cfg = _cfg(tmp_path, assets)
    with pytest.raises(PreflightError, match="(?s)preflight of `prepare`.*render_jinja_template: .*not found"):
        pipeline.run_stage(cfg, "prepare")
    assert not (cfg.run_dir / "prepare" / "manifest.json").exists()
    assert cli.main(["prepare", _cli_config(tmp_path, cfg)]) == 3
    line = _stderr_line(capsys)
    assert line.startswith("eaglet: preflight of `prepare` failed") and "render_jinja_template" in line


def test_cache_keyword_renamed_stops_eval_before_the_target_loads(tmp_path, assets, monkeypatch):
    import eaglet.evaluation.inputs as inputs_mod
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, kv_cache=None, use_cache=None,
                logits_to_keep=0, **kwargs):
        raise AssertionError("never run")

    monkeypatch.setattr(LlamaForCausalLM, "forward", forward)
    loads = []
    monkeypatch.setattr(inputs_mod, "load_target", lambda t: loads.append(t) or (_ for _ in ()).throw(SystemExit))
    with pytest.raises(PreflightError, match=r"(?s)preflight of `eval`.*LlamaForCausalLM.forward.*cache or past_key_values"):
        pipeline.run_stage(_cfg(tmp_path, assets), "eval", check_upstream=False)
    assert loads == []


def test_regenerate_contracts_follow_its_engine(tmp_path, assets, monkeypatch):
    """A broken generate stops the padded engine's preflight; a broken generate_batch stops only
    the continuous engine's (chosen by a flag of the command), before the target loads."""
    import eaglet.stages.regenerate as regen_mod
    from transformers import GenerationMixin

    loads = []
    monkeypatch.setattr(regen_mod, "load_target", lambda t: loads.append(t) or (_ for _ in ()).throw(SystemExit))
    cfg, out = _cfg(tmp_path, assets), tmp_path / "regen.jsonl"

    def generate_batch(self, inputs, generation_config=None, continuous_batching_config=None, show_progress=False,
                       **kwargs):  # progress_bar renamed
        raise AssertionError("never run")

    monkeypatch.setattr(GenerationMixin, "generate_batch", generate_batch)
    with pytest.raises(PreflightError, match="(?s)generate_batch.*no parameter progress_bar"):
        regen_mod.run_regenerate(cfg, out, engine="continuous")
    with pytest.raises(SystemExit):  # the padded engine does not call it: on to the (planted) load
        regen_mod.run_regenerate(cfg, out)
    assert len(loads) == 1

    def generate(self, inputs=None, generation_config=None, *, stream_id, **kwargs):  # a new required keyword
        raise AssertionError("never run")

    monkeypatch.setattr(GenerationMixin, "generate", generate)
    with pytest.raises(PreflightError, match="(?s)GenerationMixin.generate: .*requires stream_id"):
        regen_mod.run_regenerate(cfg, out)
    assert len(loads) == 1


def test_from_pretrained_that_does_not_accept_dtype(tmp_path, assets, monkeypatch):
    """Its source names "dtype" (the old text rule passed it), but a call with dtype= fails, as
    load_target's would after the weights' download and before any use."""
    from transformers import PreTrainedModel

    real = PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls, path, *args, torch_dtype=None, **kwargs):
        if "dtype" in kwargs:  # the older API: only torch_dtype
            raise TypeError("from_pretrained() got an unexpected keyword argument 'dtype'")
        return real(cls, path, *args, dtype=torch_dtype, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(from_pretrained))
    (f,) = _fails(_cfg(tmp_path, assets), "extract")
    assert f.check == "API transformers.PreTrainedModel.from_pretrained"
    assert "from_pretrained(dtype=torch.float16) raised TypeError" in f.found


def test_from_pretrained_that_drops_dtype(tmp_path, assets, monkeypatch):
    """The weights come back in the checkpoint's float32 although dtype=float16 was asked for."""
    from transformers import PreTrainedModel

    real = PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls, path, *args, **kwargs):
        kwargs.pop("dtype", None)  # "dtype" is not read
        return real(cls, path, *args, **kwargs).float()

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(from_pretrained))
    (f,) = _fails(_cfg(tmp_path, assets), "extract")
    assert "dtype= is not honoured" in f.found and "float32 parameters" in f.found


def test_flex_contract_only_where_training_uses_flex(tmp_path, assets, monkeypatch):
    import torch.nn.attention.flex_attention as fa

    def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False):
        raise AssertionError("never run")  # neither return_aux nor return_lse

    monkeypatch.setattr(fa, "flex_attention", flex_attention)
    assert _fails(_cfg(tmp_path, assets, "train.device=cpu"), "train") == []  # auto on a CPU: chunked attention
    (f,) = _fails(_cfg(tmp_path, assets, "train.device=cpu", "train.attn_impl=flex"), "train")
    assert f.check == "API torch.nn.attention.flex_attention.flex_attention" and "return_aux" in f.found


def test_missing_target_path_is_one_line(tmp_path, assets, capsys):
    missing = tmp_path / "no-such-model"
    cfg = _cfg(tmp_path, assets, f"target.path={missing}")
    lines = []
    assert run_doctor(cfg, out=lines.append) == 1
    fails = [ln for ln in lines if ln.startswith("FAIL")]
    assert len(fails) == 1 and f"target.path: folder not found: {missing}" in fails[0], "\n".join(lines)
    assert "Repo id" not in "\n".join(lines)
    with pytest.raises(InputError, match="target.path: folder not found"):  # the stage's own error, exit 4
        preflight(cfg, "prepare")
    assert cli.main(["prepare", _cli_config(tmp_path, cfg)]) == 4
    assert _stderr_line(capsys).startswith(f"eaglet: target.path: folder not found: {missing}")


def test_doctor_prints_each_resolved_path(tmp_path, assets):
    cfg = _cfg(tmp_path, assets, f"train.init_from={tmp_path / 'nothing.safetensors'}")
    (f,) = [f for f in diagnose(cfg).findings if f.check == "paths"]
    assert f"run.dir={(tmp_path / 'run').resolve()} (to be made)" in f.found
    assert f"target.path={assets['llama'].resolve()}" in f.found
    assert f"prepare.data[0]={assets['data'].resolve()}" in f.found
    assert f"train.init_from={tmp_path / 'nothing.safetensors'} (not found)" in f.found


def test_disk_estimate_counts_the_target_head(tmp_path, assets):
    """Against a real extract's bytes on disk: states, head.safetensors and target_config.json.
    A vocabulary of 8192 x 64 makes the head about 3/4 of it, as for SmolLM2 (226 of 250 MB)."""
    target = tiny.save_target(tmp_path / "wide_vocab", family="llama", template="llama3", vocab_size=8192)
    cfg = _cfg(tmp_path, assets, f"target.path={target}", "extract.selfcheck_samples=0")
    pipeline.run_stage(cfg, "prepare")
    (est,) = [f for f in diagnose(cfg).findings if f.check == "disk"]
    need = float(re.match(r"~([\d.]+) MiB to write", est.found)[1]) * 2**20
    head = float(re.search(r"head.safetensors ~([\d.]+) MiB", est.found)[1]) * 2**20
    pipeline.run_stage(cfg, "extract")
    folder = cfg.run_dir / "extract"
    written = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and f.name != "manifest.json")
    head_file = (folder / "head.safetensors").stat().st_size
    assert head_file > 0.6 * written
    # Within 5%: the line's 0.1 MiB rounding (1%), shard headers, index and checksum files.
    assert abs(need - written) < 0.05 * written, (need, written, est.found)
    assert abs(head - head_file) < 0.05 * 2**20 + 0.01 * head_file, (head, head_file)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_disk_estimate_of_the_states_in_each_store_dtype(tmp_path, assets, dtype):
    """The states' estimate against a real extract's shards: fp8 states with their float32 scales."""
    cfg = _cfg(tmp_path, assets, f"extract.store_dtype={dtype}", "extract.selfcheck_samples=0")
    pipeline.run_stage(cfg, "prepare")
    (est,) = [f for f in diagnose(cfg).findings if f.check == "disk"]
    per_token = int(re.search(r"tokens x ([\d,]+) B", est.found)[1].replace(",", ""))
    pipeline.run_stage(cfg, "extract")
    folder = cfg.run_dir / "extract"
    tokens = json.loads((folder / "index.json").read_text())["num_tokens"]
    shards = sum(f.stat().st_size for f in folder.glob("shard-*.safetensors"))
    assert abs(per_token * tokens - shards) < 0.05 * shards, (per_token, tokens, shards, est.found)


# ---- training's disk: checkpoints and the final draft ---------------------------------------------

def _mib(pattern, text):
    return float(re.search(pattern, text)[1]) * 2**20


def _train_disk(cfg, stage=None):
    (f,) = [f for f in diagnose(cfg, stage).findings if f.check == "disk (train)"]
    return f


def test_train_disk_thresholds_and_the_store_on_the_same_disk(tmp_path, assets, monkeypatch):
    """Before extract the doctor adds the store it will write to training's checkpoints and
    final draft, one budget for the one disk: FAIL above the free space, warn above 80% of it."""
    cfg = _cfg(tmp_path, assets)
    _free(monkeypatch, 10**15)
    f = _train_disk(cfg)
    need = _mib(r"^~([\d.]+) MiB at most at once", f.found)
    store = _mib(r"the store and target head extract writes first ~([\d.]+) MiB", f.found)
    (disk,) = [g for g in diagnose(cfg).findings if g.check == "disk"]
    assert store == _mib(r"~([\d.]+) MiB to write", disk.found)
    assert need == pytest.approx(_mib(r"together ~([\d.]+) MiB", f.found) + store, abs=0.1 * 2**20)
    assert f.status == "ok" and "train.keep_last 3 kept" in f.found and "train.ckpt_every 200" in f.found
    for free, status in ((0.97 * need, "FAIL"), (1.03 * need, "warn"), (0.97 * need / 0.8, "warn"),
                         (1.03 * need / 0.8, "ok")):
        _free(monkeypatch, int(free))
        f = _train_disk(cfg)
        assert f.status == status, (free / need, f.line())
    _free(monkeypatch, int(0.5 * need))
    line = _train_disk(cfg).line()
    assert line.startswith("FAIL  disk (train):") and f"run.dir {cfg.run_dir}" in line
    assert "fix: write or keep fewer checkpoints (train.keep_last 1: ~" in line and "train.ckpt_every above the steps the run takes" in line


@pytest.mark.parametrize("larger, target", [("checkpoint", {"intermediate_size": 2048}),
                                            ("final draft", {"vocab_size": 32768})])
def test_train_disk_estimate_against_a_real_run(tmp_path, assets, monkeypatch, larger, target):
    """The estimate against a real run's bytes on disk: one checkpoint (a wide MLP: trainable
    weights and AdamW moments outweigh the final draft) or the final draft (a wide vocabulary:
    its fp32 embedding outweighs a checkpoint), and the most the run held at once, measured
    as each checkpoint is made durable (the new one complete before the oldest beyond
    train.keep_last goes) and at the end (the kept ones beside the final draft)."""
    import eaglet.formats.checkpoints as checkpoints_mod

    folder = tiny.save_target(tmp_path / "target", family="llama", template="llama3", **target)
    cfg = _cfg(tmp_path, assets, f"target.path={folder}", "extract.selfcheck_samples=0", "train.device=cpu",
               "train.max_steps=3", "train.ckpt_every=1", "train.keep_last=2", "train.max_tokens=256",
               "train.ttt_steps=2", "train.eval_every=0", "train.tensorboard=false")
    for stage in ("prepare", "extract", "vocab"):
        pipeline.run_stage(cfg, stage)
    est = _train_disk(cfg, "train")
    assert est.status == "ok" and "3 written, train.max_steps 3 / train.ckpt_every 1" in est.found
    ckpt, final = _mib(r"checkpoints of ~([\d.]+) MiB each", est.found), _mib(r"final draft ~([\d.]+) MiB", est.found)
    peak = _mib(r"together ~([\d.]+) MiB", est.found)

    train = cfg.run_dir / "train"
    held = []  # bytes in the train folder each time a checkpoint (or its folder) is fsynced

    def du(path):
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

    real_fsync = checkpoints_mod.fsync_dir
    monkeypatch.setattr(checkpoints_mod, "fsync_dir", lambda d: (held.append(du(train)), real_fsync(d))[1])
    pipeline.run_stage(cfg, "train")
    held.append(du(train) - (train / "manifest.json").stat().st_size)
    kept = checkpoints_mod.checkpoints(train / "checkpoints")
    assert [c.name for c in kept] == ["step-0000003", "step-0000002"]
    one, last = du(kept[0]), du(train / "final")
    assert (one > last) == (larger == "checkpoint"), (one, last)
    # Within the line's 0.1 MiB rounding and 2%.
    assert abs(ckpt - one) < 0.05 * 2**20 + 0.02 * one, (ckpt, one, est.found)
    assert abs(final - last) < 0.05 * 2**20 + 0.02 * last, (final, last, est.found)
    assert abs(peak - max(held)) < 0.05 * 2**20 + 0.02 * max(held), (peak, held, est.found)
    assert abs(peak - (2 * one + max(one, last))) < 0.05 * 2**20 + 0.02 * peak  # keep_last 2, + one or the final

    again = _train_disk(cfg, "train")  # the checkpoints there now count against what the run adds
    assert f"beyond the {2 * one / 2**20:.1f} MiB of checkpoints there" in again.found
    peak = _mib(r"together ~([\d.]+) MiB", again.found)
    assert abs(peak - max(one, last)) < 0.05 * 2**20 + 0.02 * peak, (peak, one, last, again.found)


def test_train_preflight_stops_on_disk_before_training(tmp_path, assets, monkeypatch):
    import eaglet.stages.train as train_mod

    cfg = _cfg(tmp_path, assets, "extract.selfcheck_samples=0", "train.device=cpu", "train.max_steps=2")
    for stage in ("prepare", "extract", "vocab"):
        pipeline.run_stage(cfg, stage)
    builds = []
    monkeypatch.setattr(train_mod, "build_draft", lambda *a: builds.append(a) or (_ for _ in ()).throw(SystemExit))
    _free(monkeypatch, 10**5)
    with pytest.raises(PreflightError, match=r"(?s)preflight of `train`.*FAIL  disk \(train\):.*train.keep_last"):
        pipeline.run_stage(cfg, "train")
    assert builds == [] and not (cfg.run_dir / "train" / "checkpoints").exists()
    with pytest.raises(SystemExit):  # --skip-preflight: straight to the (planted) draft
        pipeline.run_stage(cfg, "train", preflight=False)
    assert len(builds) == 1


def test_engine_fed_plan_for_kimi_k25():
    """The doctor's plan for an engine-fed run, from examples/kimi-k25 (a local config.json with
    Kimi-K2.5's published values): the weights per GPU counted from the config (int4 experts
    with a bf16 scale per 32, the rest bf16) against the arithmetic done here, the MLA latent
    cache, what the engine leaves the draft, the hours, the buffer."""
    import re
    from pathlib import Path

    from eaglet.doctor import diagnose
    from eaglet.config import load_config

    path = Path(__file__).resolve().parent.parent / "examples" / "kimi-k25" / "eaglet.yaml"
    cfg = load_config(path, ["extract.vllm_server=null"])
    found = {f.check: f for f in diagnose(cfg, "train").findings}
    H, I, E, L = 7168, 2048, 384, 61
    experts = (L - 1) * E * 3 * H * I
    engine = found["engine memory (per GPU)"].found
    params = float(re.search(r"\(([\d.]+)B parameters", engine).group(1)) * 1e9
    weights = experts * (4 / 8 + 2 / 32) + (params - experts) * 2
    got = float(re.search(r"weights ([\d.]+) GiB", engine).group(1)) * 2**30
    assert got == pytest.approx(weights / 8, rel=0.01)
    assert "32.9B active" in engine and "MLA latent 512+64 x 61 layers" in engine
    assert f"{L * (512 + 64) * 2 / 1024:.1f} KiB a token" in engine
    assert f"{4 * H * 2 / 1024:.1f} KiB a token" in engine  # 3 + 1 states of 7168 in bf16
    assert found["stream buffer"].status == "ok"
    assert found["draft beside the engine (per GPU)"].status in ("info", "ok", "warn")
    assert "h with the draft on the engine's GPUs" in found["hours per 100k conversations"].found
    squeezed = {f.check: f for f in diagnose(load_config(path, ["extract.vllm_server=null",
                                                                "extract.vllm_engine_args={tensor_parallel_size: 8, gpu_memory_utilization: 0.95}"]),
                                             "train").findings}
    assert squeezed["draft beside the engine (per GPU)"].status == "FAIL"
    tiny_buffer = {f.check: f for f in diagnose(load_config(path, ["extract.stream_buffer_gb=0.1"]), "train").findings}
    assert tiny_buffer["stream buffer"].status == "FAIL" and tiny_buffer["stream buffer"].error is not None


PLAN_LINES = {"stream buffer", "engine memory (per GPU)", "draft beside the engine (per GPU)",
              "hours per 100k conversations", "disk (engine-fed)"}


def test_the_engine_fed_plan_is_the_vllm_engine_s(monkeypatch):
    """The plan of a run that streams from vLLM comes from the vLLM engine's `doctor`
    (eaglet/engines/vllm/plan.py), for the doctor and the extract and train preflights, not eval's;
    with that engine's doctor a no-op the lines are gone, and an online HF run has none."""
    from pathlib import Path

    import eaglet.engines.vllm as vllm_engine
    from eaglet.config import load_config
    from eaglet.doctor import diagnose

    path = Path(__file__).resolve().parent.parent / "examples" / "kimi-k25" / "eaglet.yaml"
    cfg = load_config(path, ["extract.vllm_server=null"])
    for stage in (None, "extract", "train"):
        assert PLAN_LINES <= {f.check for f in diagnose(cfg, stage).findings}, stage
    assert not PLAN_LINES & {f.check for f in diagnose(cfg, "eval").findings}
    assert not PLAN_LINES & {f.check for f in diagnose(load_config(path, ["extract.backend=hf"]), "train").findings}
    monkeypatch.setattr(vllm_engine, "doctor", lambda probe: None)
    assert not PLAN_LINES & {f.check for f in diagnose(cfg, "train").findings}
