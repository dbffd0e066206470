"""`eaglet run` end to end on a tiny target: every stage, skip on rerun, the vocab stage's maps
in both exports as the engines read them, and training that starts from an exported EAGLE-3
checkpoint of either format."""

import json

import pytest
import torch
from safetensors import safe_open

from eaglet import cli
from eaglet import pipeline
from eaglet.testing import tiny
from eaglet.training.build import build_draft
from eaglet.config import load_config
from eaglet.formats.serving import load_draft
from eaglet.formats.store import StoreReader
from eaglet.formats.vocab import load_vocab


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    target = tiny.save_target(root / "target", family="qwen3", template="chatml")
    data = tiny.write_jsonl(root / "data.jsonl", tiny.make_conversations(60, seed=5))
    sets = [f"run.dir={root / 'run'}", f"target.path={target}", "target.dtype=float32", f"prepare.data=[{data}]",
            "vocab.size=200", "train.max_steps=3", "train.max_tokens=256", "train.ttt_steps=2",
            "train.log_every=1", "train.tensorboard=false", "eval.num_prompts=2", "eval.max_new_tokens=8"]
    cfg_path = root / "config.yaml"
    cfg_path.write_text("{}\n")
    assert cli.main(["run", str(cfg_path), *sum((["--set", s] for s in sets), [])]) == 0
    return root, cfg_path, sets


def test_every_stage_has_a_manifest_and_reruns_are_skipped(finished_run):
    root, cfg_path, sets = finished_run
    started = {}
    for name in pipeline.STAGE_NAMES:
        m = json.loads((root / "run" / name / "manifest.json").read_text())
        assert m["status"] == "complete"
        started[name] = m["started"]
    for fmt in ("vllm", "sglang"):
        assert (root / "run" / "export" / fmt / "config.json").is_file()
    assert cli.main(["run", str(cfg_path), *sum((["--set", s] for s in sets), [])]) == 0
    for name in pipeline.STAGE_NAMES:
        assert json.loads((root / "run" / name / "manifest.json").read_text())["started"] == started[name]


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_exports_hold_the_vocab_stages_maps_as_the_engines_read_them(finished_run, fmt):
    """vLLM maps draft id i to target id i + d2t[i]; SGLang's hot token ids are d2t + arange;
    t2d marks the draft's target ids. The export's files (read raw) hold the vocab stage's maps,
    through train and its final draft, and the two agree."""
    root, _, _ = finished_run
    d2t, t2d = load_vocab(root / "run" / "vocab")
    assert d2t.numel() == 200 < t2d.numel() and int((d2t != 0).sum()) > 100  # a subset, mostly non-zero offsets
    with safe_open(str(root / "run" / "export" / fmt / "model.safetensors"), "pt") as f:
        got_d2t, got_t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert got_d2t.dtype == torch.int64 and got_t2d.dtype == torch.bool
    assert torch.equal(got_d2t, d2t) and torch.equal(got_t2d, t2d)
    assert torch.equal(torch.arange(got_d2t.numel()) + got_d2t, got_t2d.nonzero().flatten())


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_training_starts_from_an_exported_checkpoint(finished_run, fmt):
    root, _, sets = finished_run
    export = root / "run" / "export" / fmt
    cfg = load_config(None, [*sets, f"train.init_from={export}"])
    store = StoreReader(root / "run" / "extract")
    d2t, t2d = load_vocab(root / "run" / "vocab")
    head = store.target_head(torch.device("cpu"))
    model = build_draft(cfg, store, d2t, t2d, head)
    _, state, _ = load_draft(export)
    for k, v in state.items():
        assert torch.equal(model.state_dict()[k], v.to(model.state_dict()[k].dtype)), k
    assert torch.equal(model.embed_tokens.weight, head.embed)
