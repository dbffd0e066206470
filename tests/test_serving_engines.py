"""The exports against the engines' loaders as eaglet/formats/loaders.py writes them down
(SGLang 0.5.23's LlamaForCausalLMEagle3, vLLM 0.25.0's Eagle3LlamaForCausalLM): every export
eaglet writes loads whole; a renamed, extra or missing weight, a missing d2t, a missing config
key or an fc of the wrong width each fail naming it. Also the doctor's line on the name the
vLLM export gives the target."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_export import EXPORT_ARGS, tiny_draft

from eaglet.doctor import check_export_verifier
from eaglet.checks.findings import Probe
from eaglet.config import load_config
from eaglet.formats.serving import export_draft
from eaglet.formats.loaders import sglang_problems, vllm_problems

CHECK = {"vllm": vllm_problems, "sglang": sglang_problems}
# eaglet's name of layer 0's down_proj in each format
DOWN = {"vllm": "layers.0.mlp.down_proj.weight", "sglang": "midlayer.mlp.down_proj.weight"}
RENAMED = {fmt: name.replace("down_proj", "down") for fmt, name in DOWN.items()}


def export(folder, fmt, **kw):
    args = dict(aux_layer_ids=kw.pop("ids", [2, 4, 5]), include_embed=kw.pop("include_embed", False), **EXPORT_ARGS)
    return export_draft(tiny_draft(**kw), folder, fmt, **args)


def edit(folder, weights=None, config=None):
    """Apply `weights(dict of tensors)` / `config(config dict)` to the export's files in place."""
    if weights:
        w = load_file(str(folder / "model.safetensors"))
        weights(w)
        save_file(w, str(folder / "model.safetensors"))
    if config:
        c = json.loads((folder / "config.json").read_text())
        config(c)
        (folder / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_every_export_loads_whole(tmp_path, fmt):
    variants = {"plain": {}, "embed": dict(include_embed=True), "full vocabulary": dict(draft_vocab_size=97)}
    if fmt == "vllm":  # what only the speculators format carries: 4 states of another width among them
        variants["eagle3.1"] = dict(num_layers=2, num_aux=4, target_hidden_size=24, fc_norm=True, norm_output=True,
                                    norm_before_residual=True, attention_bias=True, ids=[1, 3, 5, 8])
    for name, kw in variants.items():
        assert CHECK[fmt](export(tmp_path / name, fmt, **kw)) == [], name


BREAKS = {  # what is done to the export's weights or config (given the format) -> what the problems name
    "renamed weight": ("weights", lambda w, fmt: w.update({RENAMED[fmt]: w.pop(DOWN[fmt])}),
                       ["'{renamed}'", "'model.layers.0.mlp.down_proj.weight'"]),
    "extra weight": ("weights", lambda w, fmt: w.update({"layers.0.self_attn.q_proj.bias": torch.zeros(32)}),
                     ["'layers.0.self_attn.q_proj.bias'"]),
    "missing weight": ("weights", lambda w, fmt: w.pop("norm.weight"), ["'model.norm.weight'"]),
    "missing shard": ("weights", lambda w, fmt: w.pop(DOWN[fmt].replace("mlp.down_proj", "self_attn.k_proj")),
                      ["qkv_proj.weight' (shards ['k'])"]),
    "missing d2t": ("weights", lambda w, fmt: w.pop("d2t"), ["no 'd2t' while draft_vocab_size 40 < vocab_size 97"]),
    "missing key": ("config", lambda c, fmt: c.pop("draft_vocab_size"), ["'draft_vocab_size'"]),
}


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
@pytest.mark.parametrize("case", list(BREAKS))
def test_what_an_engine_would_skip_or_miss_is_named(tmp_path, fmt, case):
    folder = export(tmp_path, fmt)
    part, change, names = BREAKS[case]
    edit(folder, **{part: lambda d: change(d, fmt)})
    problems = CHECK[fmt](folder)
    text = "\n".join(problems)
    assert problems and len(problems) <= 2, text
    for name in names:
        assert name.format(renamed=RENAMED[fmt]) in text, (name, text)


# The tensors of an export that neither loader needs: t2d (both drop it) and embed_tokens (the
# target's own is used when the export has none). Every other tensor eaglet writes is required.
OPTIONAL = ("t2d", "embed_tokens.weight")
VARIANTS = {"vllm": {"plain": {}, "eagle3.1": dict(num_layers=2, num_aux=4, target_hidden_size=24, fc_norm=True,
                                                   norm_output=True, norm_before_residual=True, attention_bias=True,
                                                   ids=[1, 3, 5, 8])},
            "sglang": {"plain": {}}}
STACK = {"q_proj": ("qkv_proj", "'q'"), "k_proj": ("qkv_proj", "'k'"), "v_proj": ("qkv_proj", "'v'"),
         "gate_proj": ("gate_up_proj", "0"), "up_proj": ("gate_up_proj", "1")}


def _loader_name(name: str) -> str:
    """What a problem about missing tensor `name` names: the loader's parameter it fills (midlayer
    read as layers.0, under model. but lm_head, q/k/v and gate/up stacked, with the shard)."""
    if name == "d2t":
        return "no 'd2t'"
    name = name.replace("midlayer.", "layers.0.")
    param = name if name.startswith("lm_head") else f"model.{name}"
    for part, (stacked, shard) in STACK.items():
        if f".{part}." in param:
            return f"'{param.replace(part, stacked)}' (shards [{shard}])"
    return f"'{param}'"


@pytest.mark.parametrize("fmt, variant", [(f, v) for f in VARIANTS for v in VARIANTS[f]])
def test_removing_any_required_tensor_fails_the_loader_check(tmp_path, fmt, variant):
    """Each tensor of the export but OPTIONAL, taken out alone, is named by the engine's check:
    a required parameter the checker treats as optional (layer 0's hidden_norm, say) fails."""
    kw = VARIANTS[fmt][variant]
    whole = export(tmp_path / "whole", fmt, **kw)
    names = sorted(load_file(str(whole / "model.safetensors")))
    required = [n for n in names if not n.endswith(OPTIONAL)]
    assert len(required) > 10 and "d2t" in required
    missed = {}
    for i, name in enumerate(required):
        folder = shutil.copytree(whole, tmp_path / str(i))
        edit(folder, weights=lambda w: w.pop(name))
        problems = CHECK[fmt](folder)
        if len(problems) != 1 or _loader_name(name) not in problems[0]:
            missed[name] = problems
    assert missed == {}


def test_each_engine_reads_its_own_keys(tmp_path):
    """vLLM reads a missing norm_before_residual as true and sizes fc by num_aux_hidden_states;
    SGLang takes its aux ids (and state count) from eagle_config, and a tied config's lm_head is
    its embedding: the draft's own lm_head.weight would be dropped."""
    v = export(tmp_path / "vllm", "vllm")
    edit(v, config=lambda c: c.pop("norm_before_residual"))
    assert vllm_problems(v) == ["config.json has no 'norm_before_residual', which vLLM 0.25.0 reads"]
    v4 = export(tmp_path / "vllm4", "vllm", num_aux=4, ids=[1, 3, 5, 7])
    edit(v4, config=lambda c: c["transformer_layer_config"].pop("num_aux_hidden_states"))
    (p,) = vllm_problems(v4)
    assert "'fc.weight' (32, 128) takes 128 inputs; vLLM 0.25.0 builds fc for 3 states" in p
    s = export(tmp_path / "sglang", "sglang")
    edit(s, config=lambda c: c.pop("eagle_config"))
    missing = "config.json has no 'eagle_config.eagle_aux_hidden_state_layer_ids', which SGLang 0.5.23 reads"
    assert sglang_problems(s) == [missing]
    edit(s, config=lambda c: c.update(tie_word_embeddings=True, eagle_config={"eagle_aux_hidden_state_layer_ids":
                                                                              [1, 3, 4]}))
    problems = sglang_problems(s)
    assert any("tie_word_embeddings is true" in p for p in problems)
    assert any("'lm_head.weight'" in p and "no parameter" in p for p in problems), problems


def test_doctor_notes_a_local_verifier_path_and_warns_only_where_speculators_cannot_load_it(tmp_path):
    """A local target's path is what a default run's vLLM export names: an info line (it serves
    on this machine), with how to name it for a server elsewhere. A warn only where the export
    would be wrong to serve: a verifier folder speculators cannot load a draft against."""
    local = load_config(None, [f"target.path={tmp_path}"])
    p = Probe(local, None)
    check_export_verifier(p)
    (f,) = p.findings
    assert f.status == "warn" and "has no model.safetensors" in f.found  # an empty folder: no checkpoint
    save_file({"model.embed_tokens.weight": torch.zeros(4, 2)}, str(tmp_path / "model.safetensors"))
    p = Probe(local, None)
    check_export_verifier(p)
    (f,) = p.findings
    assert f.status == "info" and str(tmp_path) in f.found and "export.verifier_name_or_path" in f.found
    for overrides in (["export.verifier_name_or_path=org/target"], ["target.path=org/target"],
                      ["export.formats=[sglang]"]):
        p = Probe(load_config(None, [f"target.path={tmp_path}", *overrides]), None)
        check_export_verifier(p)
        assert [f.status for f in p.findings] in (["ok"], []), overrides
