"""Export: both formats round-trip through load_draft to the same logits; the files hold what
each engine's loader reads (names, layer-id conventions); published-style checkpoints load;
the export stage on a tied-embedding target names it and its architectures and ends with the
serve commands; and speculators 0.9.0's own loader runs the vLLM export to eaglet's logits (in
.venv-speculators, made by scripts/speculators_venv.sh), for an untied and a tied target.
The checks against the engines' loaders themselves: tests/test_serving_engines.py."""

import importlib
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from eaglet.draft.eagle3.serving import name_map
from eaglet.formats.serving import export_draft, load_draft
from eaglet.draft.eagle3.model import DraftConfig, Eagle3Draft

REPO = Path(__file__).resolve().parents[1]
SPECULATORS_PYTHON = REPO / ".venv-speculators" / "bin" / "python"
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
EXPORT_ARGS = dict(verifier_name_or_path="org/target", verifier_architectures=["LlamaForCausalLM"],
                   num_speculative_tokens=3)

# CPU flex_attention runs unfused (eager); that is what these tests want.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def tiny_config(**kw) -> DraftConfig:
    base = dict(hidden_size=32, target_hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=48, vocab_size=97, draft_vocab_size=40, rope_theta=5e5, rope_scaling=LLAMA3_ROPE,
                max_position_embeddings=512, rms_norm_eps=1e-5)
    return DraftConfig(**{**base, **kw})


def tiny_draft(seed: int = 0, **kw) -> Eagle3Draft:
    torch.manual_seed(seed)
    m = Eagle3Draft(tiny_config(**kw))
    m.reset_parameters(std=0.3)  # large enough that every weight visibly moves the logits
    with torch.no_grad():
        for name, p in m.named_parameters():  # norms and biases away from their 1 / 0 init
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.2)
        c = m.config
        if c.draft_vocab_size < c.vocab_size:
            used = torch.randperm(c.vocab_size)[: c.draft_vocab_size].sort().values
            m.d2t.copy_(used - torch.arange(c.draft_vocab_size))
            m.t2d.zero_()
            m.t2d[used] = True
    return m


def inputs(cfg: DraftConfig, T: int = 24, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, T, cfg.num_aux * cfg.target_hidden_size, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    docs = torch.tensor([[0] * (T // 3) + [1] * (T - T // 3)])
    pos = torch.cat([torch.arange(T // 3), torch.arange(T - T // 3)])[None]
    return aux, ids, pos, docs


@torch.no_grad()
def logits(m: Eagle3Draft, steps: int = 3, T: int = 24) -> list[torch.Tensor]:
    aux, ids, pos, docs = inputs(m.config, T)
    return m.ttt_forward(aux, ids, pos, docs, num_steps=steps, attn_impl="naive")


def reload(path) -> tuple[Eagle3Draft, dict]:
    cfg, state, meta = load_draft(path)
    m = Eagle3Draft(cfg)
    m.load_state_dict(state, strict=True)
    return m, meta


# ---- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_round_trip_gives_the_same_draft_and_logits(tmp_path, fmt):
    m = tiny_draft()
    export_draft(m, tmp_path, fmt, aux_layer_ids=[2, 4, 5], include_embed=True, dtype=torch.float32, **EXPORT_ARGS)
    back, meta = reload(tmp_path)
    assert back.config == m.config
    assert meta["format"] == fmt and meta["aux_layer_ids"] == [2, 4, 5] and meta["missing"] == []
    for name, t in m.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    for got, want in zip(logits(back), logits(m), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_both_formats_read_back_identically(tmp_path):
    m = tiny_draft(seed=3)
    for fmt in ("vllm", "sglang"):
        export_draft(m, tmp_path / fmt, fmt, aux_layer_ids=[1, 3, 6], **EXPORT_ARGS)  # bf16, no embedding
    (cv, sv, mv), (cs, ss, ms) = load_draft(tmp_path / "vllm"), load_draft(tmp_path / "sglang")
    assert cv == cs == m.config
    assert sv.keys() == ss.keys() == set(m.state_dict()) - {"embed_tokens.weight"}
    for name in sv:
        assert sv[name].dtype == ss[name].dtype and torch.equal(sv[name], ss[name]), name
    assert sv["fc.weight"].dtype == torch.bfloat16 and sv["d2t"].dtype == torch.int64 and sv["t2d"].dtype == torch.bool
    assert mv["aux_layer_ids"] == ms["aux_layer_ids"] == [1, 3, 6]
    assert mv["missing"] == ms["missing"] == ["embed_tokens.weight"]
    assert mv["dtype"] == ms["dtype"] == "bfloat16"


def test_vllm_round_trip_of_every_speculators_feature(tmp_path):
    """EAGLE-3.1 norms, two layers, biases, 4 states of another width, a yarn RoPE and a
    full-vocabulary draft (whose identity d2t/t2d the export leaves out)."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    m = tiny_draft(seed=5, num_layers=2, num_aux=4, target_hidden_size=24, fc_norm=True, norm_output=True,
                   norm_before_residual=True, attention_bias=True, draft_vocab_size=97, rope_scaling=yarn)
    export_draft(m, tmp_path, "vllm", aux_layer_ids=[1, 3, 5, 8], include_embed=True, dtype="float32", **EXPORT_ARGS)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert not {"d2t", "t2d"} & set(f.keys())
    back, meta = reload(tmp_path)
    assert back.config == m.config and meta["aux_layer_ids"] == [1, 3, 5, 8]
    for got, want in zip(logits(back), logits(m), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---- what the files say ---------------------------------------------------------------------

# speculators 0.9.0 Eagle3DraftModel (models/eagle3/core.py, model_definitions.py) less the
# verifier_* weights it never saves; d2t/t2d are its vocabulary buffers.
SPECULATORS_NAMES = {
    "fc.weight", "layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight",
    "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight", "layers.0.post_attention_layernorm.weight",
    "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
}
# Official EAGLE-3 / SGLang llama_eagle3.py: model.midlayer, model.fc, model.norm, lm_head;
# d2t becomes hot_token_id, t2d is skipped.
SGLANG_NAMES = {
    "fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
}


@pytest.mark.parametrize("fmt,names", [("vllm", SPECULATORS_NAMES), ("sglang", SGLANG_NAMES)])
def test_weight_names_are_the_engines(tmp_path, fmt, names):
    m = tiny_draft()
    export_draft(m, tmp_path / "a", fmt, aux_layer_ids=[2, 4, 5], **EXPORT_ARGS)
    export_draft(m, tmp_path / "b", fmt, aux_layer_ids=[2, 4, 5], include_embed=True, **EXPORT_ARGS)
    with safe_open(str(tmp_path / "a" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == names
    with safe_open(str(tmp_path / "b" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == names | {"embed_tokens.weight"}
    assert set(name_map(m.config, fmt, include_embed=False).values()) == names


def test_layer_ids_and_fields_as_each_engine_reads_them(tmp_path):
    """Llama-3.1-8B (L=32): eaglet's HF indices [2, 16, 29]. vLLM captures before layer i:
    the same ids. SGLang's eagle_config ids are layer outputs, captured before id + 1."""
    m = tiny_draft()
    export_draft(m, tmp_path / "vllm", "vllm", aux_layer_ids=[2, 16, 29], **EXPORT_ARGS)
    export_draft(m, tmp_path / "sglang", "sglang", aux_layer_ids=[2, 16, 29], **EXPORT_ARGS)
    v = json.loads((tmp_path / "vllm" / "config.json").read_text())
    s = json.loads((tmp_path / "sglang" / "config.json").read_text())

    assert v["speculators_model_type"] == "eagle3" and v["architectures"] == ["Eagle3Speculator"]
    assert v["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]
    assert v["speculators_config"] == {
        "algorithm": "eagle3",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                              "accept_tolerance": 0.0}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]},
    }
    # vLLM reads a missing norm_before_residual as true: it must be written.
    assert (v["norm_before_residual"], v["norm_before_fc"], v["fc_norm"], v["norm_output"]) == (False,) * 4
    assert (v["draft_vocab_size"], v["target_hidden_size"]) == (40, 32)
    tl = v["transformer_layer_config"]
    assert (tl["model_type"], tl["num_hidden_layers"], tl["vocab_size"], tl["hidden_size"]) == ("llama", 1, 97, 32)
    assert (tl["head_dim"], tl["num_key_value_heads"], tl["intermediate_size"]) == (8, 2, 48)

    assert s["architectures"] == ["LlamaForCausalLMEagle3"] and s["num_hidden_layers"] == 1
    assert s["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 15, 28]
    assert s["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]
    assert (s["draft_vocab_size"], s["target_hidden_size"], s["tie_word_embeddings"]) == (40, 32, False)

    for c in (tl, s):  # RoPE in both spellings, read identically by transformers 5
        assert c["rope_theta"] == 5e5 and c["rope_scaling"] == LLAMA3_ROPE
        assert c["rope_parameters"] == {**LLAMA3_ROPE, "rope_theta": 5e5}
        legacy = {k: v for k, v in c.items() if k != "rope_parameters"}
        assert LlamaConfig(**legacy).rope_parameters == LlamaConfig(**c).rope_parameters


def test_sglang_export_refuses_what_sglang_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="fc_norm.*norm_output|num_layers=2"):
        export_draft(tiny_draft(num_layers=2, fc_norm=True, norm_output=True), tmp_path, "sglang",
                     aux_layer_ids=[2, 4, 5], **EXPORT_ARGS)
    with pytest.raises(ValueError, match="0 has none"):
        export_draft(tiny_draft(), tmp_path, "sglang", aux_layer_ids=[0, 4, 5], **EXPORT_ARGS)
    with pytest.raises(ValueError, match="num_aux=3"):
        export_draft(tiny_draft(), tmp_path, "vllm", aux_layer_ids=[2, 4], **EXPORT_ARGS)
    assert not (tmp_path / "config.json").exists()


# ---- reading published checkpoints ----------------------------------------------------------


def official_checkpoint(folder: Path, m: Eagle3Draft) -> None:
    """A checkpoint laid out as the official EAGLE-3 release (yuhuili/EAGLE3-LLaMA3.1-
    Instruct-8B): no target_hidden_size, head_dim or eagle_config, fp16, midlayer names written
    here by hand (not by eaglet's name map), d2t/t2d, no embedding."""
    c = m.config
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": c.hidden_size, "initializer_range": 0.02,
        "intermediate_size": c.intermediate_size, "max_position_embeddings": c.max_position_embeddings,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "rope_scaling": {"type": "llama3", **{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}},
        "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True,
        "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
    }
    sd = m.state_dict()
    weights = {"fc.weight": sd["fc.weight"], "norm.weight": sd["norm.weight"], "lm_head.weight": sd["lm_head.weight"],
               "d2t": sd["d2t"], "t2d": sd["t2d"]}
    for part in ("hidden_norm", "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        weights[f"midlayer.{part}.weight"] = sd[f"layers.0.{part}.weight"]
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.half() if v.is_floating_point() else v for k, v in weights.items()}, str(folder / "model.safetensors"))


def test_reads_an_official_eagle3_checkpoint(tmp_path):
    m = tiny_draft(seed=7)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.half().float())  # the checkpoint is fp16: compare against the rounded weights
    official_checkpoint(tmp_path / "official", m)
    cfg, state, meta = load_draft(tmp_path / "official")
    assert cfg == m.config  # target_hidden_size defaults to hidden_size, head_dim to hidden / heads
    assert meta["format"] == "sglang" and meta["aux_layer_ids"] is None and meta["dtype"] == "float16"
    assert meta["missing"] == ["embed_tokens.weight"]
    back = Eagle3Draft(cfg)
    missing, unexpected = back.load_state_dict(state, strict=False)
    assert missing == ["embed_tokens.weight"] and unexpected == []
    with torch.no_grad():
        back.embed_tokens.weight.copy_(m.embed_tokens.weight)  # the caller supplies the target's
    for got, want in zip(logits(back), logits(m), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_missing_weight_is_named(tmp_path):
    official_checkpoint(tmp_path / "c", tiny_draft())
    weights = load_file(str(tmp_path / "c" / "model.safetensors"))
    del weights["midlayer.mlp.down_proj.weight"], weights["d2t"]
    weights["midlayer.extra.weight"] = torch.zeros(1)
    save_file(weights, str(tmp_path / "c" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['d2t', 'midlayer.mlp.down_proj.weight'\].*unexpected "
                                         r"\['midlayer.extra.weight'\]"):
        load_draft(tmp_path / "c")


def test_a_pickled_checkpoint_is_refused_unopened(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not opened")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called"))
    with pytest.raises(FileNotFoundError, match="never unpickles"):
        load_draft(tmp_path)


def test_sglang_ids_read_from_eagle_config_and_vllm_ids_from_the_top(tmp_path):
    official_checkpoint(tmp_path / "s", tiny_draft())
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}  # as SpecForge writes them
    (tmp_path / "s" / "config.json").write_text(json.dumps(config))
    assert load_draft(tmp_path / "s")[2]["aux_layer_ids"] == [2, 16, 29]
    config.pop("eagle_config")
    config["eagle_aux_hidden_state_layer_ids"] = [2, 16, 29]  # vLLM's reading of the same file
    (tmp_path / "s" / "config.json").write_text(json.dumps(config))
    assert load_draft(tmp_path / "s")[2]["aux_layer_ids"] == [2, 16, 29]


# ---- the export stage -------------------------------------------------------------------------


def tied_target(root: Path) -> Eagle3Draft:
    """In `root`: a tiny Llama target with tied embeddings saved by transformers'
    save_pretrained (which stores its one table as model.embed_tokens.weight and no lm_head), a
    trained draft for it (train/final/, its frozen embedding the target's), and an extract store
    whose target_config.json has no architectures, as the vLLM and online extractions' may not."""
    from eaglet.formats.draft import FINAL_DIR, save_final
    from eaglet.formats.checked import write_files
    from eaglet.formats.store import INDEX, TARGET_CONFIG, described
    from eaglet.testing.tiny import build_model

    m = tiny_draft(seed=30)
    c = m.config
    target = build_model("llama", vocab_size=c.vocab_size, hidden_size=c.hidden_size, tie_word_embeddings=True)
    with torch.no_grad():
        target.model.embed_tokens.weight.copy_(m.embed_tokens.weight)
    target.save_pretrained(root / "target")
    save_final(root / "train" / FINAL_DIR, m.state_dict(), c, [2, 4, 5], "eagle3")
    (root / "extract").mkdir()
    meta = described({"layers": [2, 4, 5], "hidden_size": c.hidden_size, "dtype": "bfloat16"})
    write_files(root / "extract", {INDEX: json.dumps({"meta": meta, "shards": []}).encode(),
                                   TARGET_CONFIG: json.dumps({"model_type": "llama", "hidden_size": c.hidden_size}).encode()})
    return m


def run_export_stage(root: Path, *overrides: str) -> dict:
    from eaglet.config import load_config
    from eaglet.context import StageContext
    from eaglet.stages.export import run_export

    # float32: bf16 rounding of tiny_draft's large weights moves its logits by more than the stage allows
    cfg = load_config(None, [f"run.dir={root / 'run'}", f"target.path={root / 'target'}", "export.dtype=float32",
                             *overrides])
    out = root / "run" / "export"
    out.mkdir(parents=True, exist_ok=True)
    return run_export(cfg, StageContext("export", out, root / "run", "h", {"train": root / "train",
                                                                           "extract": root / "extract"}))


def test_export_stage_on_a_tied_target_names_it_and_ends_with_the_serve_commands(tmp_path, capsys):
    tied_target(tmp_path)
    with safe_open(str(tmp_path / "target" / "model.safetensors"), "pt") as f:
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()
    result = run_export_stage(tmp_path, "export.verifier_name_or_path=org/tiny-tied", "export.speculative_tokens=5")
    export = tmp_path / "run" / "export"
    v = json.loads((export / "vllm" / "config.json").read_text())
    # architectures from the target's config.json: the store's target config has none
    verifier = {"name_or_path": "org/tiny-tied", "architectures": ["LlamaForCausalLM"]}
    assert v["speculators_config"]["verifier"] == verifier
    assert result["vllm"]["path"] == str(export / "vllm") and result["sglang"]["path"] == str(export / "sglang")

    words = shlex.split(result["vllm"]["serve_command"])
    flag = words.index("--speculative-config")
    assert words[:3] == ["vllm", "serve", "org/tiny-tied"] and len(words) == flag + 2
    spec = {"method": "eagle3", "model": str(export / "vllm"), "num_speculative_tokens": 5}
    assert json.loads(words[flag + 1]) == spec
    words = shlex.split(result["sglang"]["serve_command"])
    assert words[:3] == ["python", "-m", "sglang.launch_server"]
    flags = dict(zip(words[3::2], words[4::2], strict=True))
    assert flags == {"--model-path": "org/tiny-tied", "--speculative-algorithm": "EAGLE3",
                     "--speculative-draft-model-path": str(export / "sglang"), "--speculative-num-steps": "5",
                     "--speculative-eagle-topk": "1", "--speculative-num-draft-tokens": "6"}
    err = capsys.readouterr().err
    assert err.rstrip().splitlines()[-2:] == [f"[export] serve with vLLM: {result['vllm']['serve_command']}",
                                              f"[export] serve with SGLang: {result['sglang']['serve_command']}"]
    assert "local path" not in err and "warning" not in err

    run_export_stage(tmp_path, "export.formats=[vllm]")  # no setting: the target's local path, with a note
    v = json.loads((export / "vllm" / "config.json").read_text())
    assert v["speculators_config"]["verifier"]["name_or_path"] == str(tmp_path / "target")
    err = capsys.readouterr().err
    assert "set export.verifier_name_or_path" in err and "warning" not in err  # it serves on this machine


def test_export_stage_fails_on_an_export_its_engine_would_not_load(tmp_path, monkeypatch):
    """A name map that the reader follows (so the logits round-trip) but SGLang does not: its
    `midlayer` rename would turn midlayers.0.* into names it has no parameter for."""
    serving = importlib.import_module("eaglet.draft.eagle3.serving")  # the module: the package's `serving` is its function

    tied_target(tmp_path)
    monkeypatch.setitem(serving.CHECKPOINT_NAME, "sglang", lambda n: n.replace("layers.0.", "midlayers.0."))
    with pytest.raises(RuntimeError, match=r"export sglang: .* SGLang 0\.5\.23's LlamaForCausalLMEagle3 .*"
                                           r"'midlayers\.0\.mlp\.down_proj\.weight'"):
        run_export_stage(tmp_path, "export.verifier_name_or_path=org/tiny-tied")


def test_export_warns_when_speculators_cannot_take_the_embedding_from_the_target(tmp_path, capsys):
    """A tied checkpoint that kept its table as lm_head.weight only (what safetensors' save_model
    keeps of two shared names): speculators raises KeyError 'embed_tokens.weight' on it."""
    tied_target(tmp_path)
    weights = load_file(str(tmp_path / "target" / "model.safetensors"))
    weights["lm_head.weight"] = weights.pop("model.embed_tokens.weight")
    save_file(weights, str(tmp_path / "target" / "model.safetensors"))
    run_export_stage(tmp_path, "export.formats=[vllm]")
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
    assert "no tensor named *embed_tokens.weight" in line and str(tmp_path / "target") in line


# ---- a third-party loader: speculators 0.9.0 --------------------------------------------------

# Runs in .venv-speculators. argv[1]: JSON list of {export, io, out}. Loads each export with
# speculators' Eagle3DraftModel.from_pretrained (its verifier is a local tiny target), reports
# the weights it did not take from the file, and runs its TTT forward on the same states,
# tokens and positions, capturing each step's logits at lm_head.
SPECULATORS_CHILD = r"""
import json, sys
import torch
from importlib.metadata import version
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from speculators.models import Eagle3DraftModel

reports = []
for case in json.loads(sys.argv[1]):
    model = Eagle3DraftModel.from_pretrained(case["export"], dtype=torch.float32).eval()
    with safe_open(case["export"] + "/model.safetensors", "pt") as f:
        file = {k: f.get_tensor(k) for k in f.keys()}
    state = model.state_dict()
    io = load_file(case["io"])
    T = io["input_ids"].shape[1]
    step_logits = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: step_logits.append(out.detach()))
    with torch.no_grad():
        model(hidden_states=io["aux"], input_ids=io["input_ids"], document_ids=io["document_ids"],
              position_ids=io["position_ids"], ttt_steps=case["steps"])
    hook.remove()
    save_file({f"step{j}": t.contiguous() for j, t in enumerate(step_logits)}, case["out"])
    cfg = model.config
    reports.append({
        "speculators": version("speculators"),
        "unexpected": sorted(set(file) - set(state)),
        "not_from_file": sorted(set(state) - set(file)),
        "differs_from_file": sorted(k for k in file if k in state and not torch.equal(state[k], file[k].to(state[k].dtype))),
        "aux_layer_ids": list(cfg.eagle_aux_hidden_state_layer_ids),
        "speculative_tokens": cfg.speculators_config.proposal_methods[0].speculative_tokens,
        "flags": [cfg.norm_before_residual, cfg.fc_norm, cfg.norm_output, cfg.norm_before_fc],
        "num_layers": len(model.layers),
        # its verifier_lm_head is the verifier's lm_head.weight, or its embedding when it has none
        # (a tied target): a tied target's table, restricted to the draft vocabulary
        "head_is_embedding": torch.equal(model.verifier_lm_head.weight, file["embed_tokens.weight"] if model.t2d
                                         is None else file["embed_tokens.weight"][model.t2d.bool()]),
    })
print("REPORT " + json.dumps(reports))
"""


def tiny_verifier(folder: Path, m: Eagle3Draft, num_layers: int = 8) -> None:
    """A local stand-in for the target: speculators reads its config (layer count, to check the
    aux ids) and its embedding / lm_head / final norm."""
    c = m.config
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
        "intermediate_size": 64, "num_hidden_layers": num_layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": False,
    }))
    save_file({"model.embed_tokens.weight": m.embed_tokens.weight.detach().clone(),
               "lm_head.weight": torch.randn(c.vocab_size, c.hidden_size), "model.norm.weight": torch.ones(c.hidden_size)},
              str(folder / "model.safetensors"))


SPECULATORS_CASES = {
    "eagle3": dict(kw={}, ids=[2, 4, 5]),
    "eagle3.1-two-layers": dict(kw=dict(num_layers=2, num_aux=4, fc_norm=True, norm_output=True,
                                        norm_before_residual=True, attention_bias=True), ids=[1, 3, 5, 8]),
}


@pytest.mark.skipif(not SPECULATORS_PYTHON.exists(),
                    reason="no .venv-speculators: `bash scripts/speculators_venv.sh` creates it (speculators 0.9.0)")
def test_speculators_loads_the_vllm_export_and_gives_eaglet_logits(tmp_path):
    # T = 128: speculators' flex-attention TTT masks grow by whole 128-row blocks per step.
    T, steps = 128, 3
    drafts = {}  # name -> (draft, its vLLM export)
    for i, (name, case) in enumerate(SPECULATORS_CASES.items()):
        m = tiny_draft(seed=10 + i, **case["kw"])
        tiny_verifier(tmp_path / name / "verifier", m)
        # include_embed: speculators 0.9.0 (with transformers 5) leaves an embedding absent from
        # the file uninitialised instead of copying the verifier's, so the check ships it.
        export_draft(m, tmp_path / name / "export", "vllm", aux_layer_ids=case["ids"], include_embed=True,
                     dtype=torch.float32, verifier_name_or_path=str(tmp_path / name / "verifier"),
                     verifier_architectures=["LlamaForCausalLM"], num_speculative_tokens=steps)
        drafts[name] = m, tmp_path / name / "export"
    # A tied target as transformers saves it, exported by the export stage (verifier: target.path).
    m = tied_target(tmp_path / "tied")
    result = run_export_stage(tmp_path / "tied", "export.formats=[vllm]", "export.include_embed=true",
                              f"export.speculative_tokens={steps}")
    drafts["tied"] = m, Path(result["vllm"]["path"])
    cases, expected = [], {}
    for i, (name, (m, export)) in enumerate(drafts.items()):
        aux, ids, pos, docs = inputs(m.config, T, seed=20 + i)
        # Each step's embedding products made in the step, the order speculators computes in:
        # fp32 rounding, amplified here to ~3e-4 at step 2, is not the format's to answer for
        # (the once-made products equal these in fp64: test_perf_paths).
        m.embeds_once = False
        expected[name] = logits_ref = m.ttt_forward(aux, ids, pos, docs, num_steps=steps, attn_impl="naive")
        assert len(logits_ref) == steps
        # speculators' step 0 reads input_ids as given and runs at position_ids; eaglet's row t
        # reads token t+1 at position pos[t]+1. Both shift one more token per step, zero-padded.
        save_file({"aux": aux, "input_ids": torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], 1),
                   "document_ids": docs, "position_ids": pos + 1}, str(tmp_path / name / "io.safetensors"))
        cases.append({"export": str(export), "io": str(tmp_path / name / "io.safetensors"),
                      "out": str(tmp_path / name / "out.safetensors"), "steps": steps})
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([str(SPECULATORS_PYTHON), "-c", SPECULATORS_CHILD, json.dumps(cases)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    reports = json.loads(line.removeprefix("REPORT "))
    tied_case = dict(kw={}, ids=[2, 4, 5])
    for (name, case), report, c in zip({**SPECULATORS_CASES, "tied": tied_case}.items(), reports, cases, strict=True):
        kw = case["kw"]
        assert report["head_is_embedding"] == (name == "tied"), name
        assert report["speculators"] == "0.9.0"
        assert report["unexpected"] == [], name
        assert report["not_from_file"] == ["verifier_lm_head.weight", "verifier_norm.weight"], name  # training-only
        assert report["differs_from_file"] == [], name
        assert report["aux_layer_ids"] == case["ids"] and report["speculative_tokens"] == steps
        assert report["flags"] == [kw.get("norm_before_residual", False), kw.get("fc_norm", False),
                                   kw.get("norm_output", False), False]
        assert report["num_layers"] == kw.get("num_layers", 1)
        got = load_file(c["out"])
        assert len(got) == steps
        for j in range(steps):
            torch.testing.assert_close(got[f"step{j}"], expected[name][j], rtol=1e-4, atol=1e-4,
                                       msg=lambda s, j=j, name=name: f"{name} step {j}: {s}")
