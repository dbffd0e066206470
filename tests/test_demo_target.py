"""The demo's converted target folder (eaglet.demo.save_folder, gguf_to_folder) is a standard
tied checkpoint: the embedding stored once under the name the engines read, the config naming
its architecture, the logits of the model it came from, and the checkpoint head that the
vLLM backend reads from files."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from eaglet import demo
from eaglet.config import TargetSection
from eaglet.targets.head import read_checkpoint_head
from eaglet.testing import tiny


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo-target")
    src = tiny.save_target(root / "src", family="llama", template="chatml", tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    return root, model, tiny.build_tokenizer("chatml")


def test_a_tied_target_is_written_as_transformers_writes_it(tied):
    root, model, tok = tied
    out = demo.save_folder(model, tok, root / "plain")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert "_name_or_path" not in config and config["dtype"] == "bfloat16"

    again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(root / "src", dtype=torch.float32).eval()
    with torch.no_grad():
        for p in ref.parameters():  # the folder holds bf16 weights
            p.copy_(p.to(torch.bfloat16).float())
        ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
        assert torch.equal(again(ids).logits, ref(ids).logits)
    assert again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()

    head = read_checkpoint_head(TargetSection(path=str(out)))  # the vLLM backend's read of the files
    assert torch.equal(head.tensors["embed_tokens"].float(), again.model.embed_tokens.weight)
    assert torch.equal(head.tensors["lm_head"].float(), again.model.embed_tokens.weight)


def test_an_older_conversion_is_converted_again(tied, monkeypatch):
    """A folder an older eaglet wrote (no architectures, the embedding only as lm_head.weight)
    is replaced on the next fetch; a current one is kept as it is."""
    import transformers

    root, model, tok = tied
    old = root / "old"
    old.mkdir()
    (old / "config.json").write_text(json.dumps({"architectures": None, "model_type": "llama"}))
    (old / "model.safetensors").write_bytes(b"stale")
    calls = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: calls.append(k.get("gguf_file")) or model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)
    gguf = root / "m.gguf"
    assert demo.gguf_to_folder(gguf, old) == old and calls == [str(gguf.resolve())]  # never a bare name (below)
    assert json.loads((old / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    demo.gguf_to_folder(gguf, old)
    assert calls == [str(gguf.resolve())]  # up to date: not converted again



def test_the_demo_runs_with_the_cpu_preset_on_a_cpu(monkeypatch):
    """On a CPU the demo's sizes are the cpu preset's, the preset users get with --preset cpu: the
    demo names the preset (recorded in its manifests) and sets none of its keys itself, so the two
    cannot drift apart; on a GPU it runs with the defaults, which are sized for one."""
    from pathlib import Path

    from eaglet.config import PRESETS

    preset = {(s, k): v for s, values in PRESETS["cpu"].items() for k, v in values.items()}
    own = {tuple(text.split("=")[0].split(".")) for text in demo.CPU_SETTINGS}
    assert own and not own & set(preset)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = demo.demo_config(Path("/t"), Path("/d.json"), "/tmp/demo-run", [])
    assert cfg.run.preset == "cpu" and cfg.prepare.max_records == 300
    assert {(s, k): getattr(getattr(cfg, s), k) for s, k in preset} == preset
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = demo.demo_config(Path("/t"), Path("/d.json"), "/tmp/demo-run", [])
    assert cfg.run.preset is None and (cfg.train.ttt_steps, cfg.prepare.max_records) == (7, 20000)


def test_a_gguf_file_is_read_from_the_target_folder_not_the_working_directory(tmp_path, monkeypatch):
    """transformers loads a relative gguf_file from the working directory when a file of that name
    is there, before it looks in the model folder: eaglet names the folder's own file, so a file of
    the same name where eaglet runs is never loaded in its place (an absolute one is kept)."""
    from eaglet.targets.load import hub_kwargs

    folder, here = tmp_path / "model", tmp_path / "work"
    folder.mkdir()
    here.mkdir()
    (folder / "m.gguf").write_bytes(b"the target's")
    (here / "m.gguf").write_bytes(b"a decoy")
    monkeypatch.chdir(here)
    kw = hub_kwargs(TargetSection(path=str(folder), gguf_file="m.gguf"))
    assert kw["gguf_file"] == str(folder.resolve() / "m.gguf")
    assert hub_kwargs(TargetSection(path=str(folder), gguf_file=str(here / "m.gguf")))["gguf_file"] == str(here / "m.gguf")
