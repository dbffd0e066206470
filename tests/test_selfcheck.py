"""The extraction self-check, proven by planting each bug it exists for into extract.

Each plant wraps `eaglet.engines.hf.extract.capture` (the hooked, batched path); the self-check's
reference is the model's own unbatched forward, which the plant does not touch.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import eaglet.engines.hf.extract as extract_mod
from eaglet import pipeline
from eaglet.testing import tiny
from eaglet.config import Config, load_config
from eaglet.stages.extract import run_extract
from eaglet.context import StageContext
from eaglet.formats.prepared import PreparedWriter
from eaglet.checks.selfcheck import SelfCheckError, pick_samples
from eaglet.errors import InputError

LENGTHS = [23, 9, 31, 17, 5, 28, 12, 20]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny llama whose final norm has non-unit weights, so a missing norm changes top-1."""
    from transformers import AutoModelForCausalLM

    path = tiny.save_target(tmp_path_factory.mktemp("t") / "llama", family="llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        torch.manual_seed(1)
        model.model.norm.weight.uniform_(0.2, 2.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prep")
    rng = np.random.default_rng(0)
    w = PreparedWriter(folder, ["synthetic.jsonl"], shard_samples=100)
    for k, n in enumerate(LENGTHS):
        w.add(rng.integers(1, 500, n), np.ones(n, dtype=np.uint8), 0, k)
    w.close()
    return folder


def _extract(tmp_path, target, prepared, **extract):
    cfg = Config()
    cfg.target.path, cfg.target.dtype = str(target), "float32"
    cfg.extract.fsync, cfg.extract.store_dtype = False, "float32"
    cfg.extract.batch_tokens, cfg.extract.max_batch_size = 4096, 8  # every sample shares a batch
    cfg.extract.selfcheck_samples = len(LENGTHS)
    for k, v in extract.items():
        setattr(cfg.extract, k, v)
    out = tmp_path / "extract"
    out.mkdir(exist_ok=True)
    return run_extract(cfg, StageContext("extract", out, tmp_path, "h", {"prepare": prepared}))


def _plant(monkeypatch, transform):
    real = extract_mod.capture

    def planted(parts, layers, input_ids, attention_mask, dtype):
        return transform(real, parts, layers, input_ids, attention_mask, dtype)

    monkeypatch.setattr(extract_mod, "capture", planted)


def test_healthy_store_passes_and_is_reported(tmp_path, target, prepared):
    stats = _extract(tmp_path, target, prepared)
    sc = stats["selfcheck"]
    assert sc["samples"] == list(range(len(LENGTHS))) and sc["tokens"] == sum(LENGTHS)
    assert sc["top1_agreement"] == 1.0
    assert set(sc["states"]) == {"layer 2", "layer 4", "layer 5", "final"}
    assert all(s["cosine"] > 0.99999 and s["rel_error"] < 1e-4 for s in sc["states"].values())


def test_bf16_store_passes_default_thresholds(tmp_path, target, prepared):
    stats = _extract(tmp_path, target, prepared, store_dtype="bfloat16")
    assert stats["selfcheck"]["top1_agreement"] >= 0.99


def test_off_by_one_layer_is_caught(tmp_path, target, prepared, monkeypatch):
    _plant(monkeypatch, lambda real, parts, layers, *a: real(parts, [i + 1 for i in layers], *a))
    with pytest.raises(SelfCheckError, match=r"layer 2: cosine 0\.\d+ < extract\.selfcheck_min_cosine") as e:
        _extract(tmp_path, target, prepared)
    assert "layer 4" in str(e.value) and "layer 5" in str(e.value) and "final" not in str(e.value).split("\n")[1]


def test_pre_norm_teacher_is_caught(tmp_path, target, prepared, monkeypatch):
    def pre_norm(real, parts, layers, input_ids, attention_mask, dtype):
        seen = []
        h = parts.norm.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
        try:
            aux, _ = real(parts, layers, input_ids, attention_mask, dtype)
        finally:
            h.remove()
        return aux, seen[0].to(dtype)

    _plant(monkeypatch, pre_norm)
    with pytest.raises(SelfCheckError) as e:
        _extract(tmp_path, target, prepared)
    msg = str(e.value)
    assert "final: " in msg and "teacher top-1" in msg and "layer 2:" not in msg


def test_reordered_batch_rows_are_caught(tmp_path, target, prepared, monkeypatch):
    def reorder(real, *args):
        aux, final = real(*args)
        return aux.roll(1, dims=0), final.roll(1, dims=0)  # row b gets row b-1's states

    _plant(monkeypatch, reorder)
    with pytest.raises(SelfCheckError, match=r"layer 2: cosine .*(\n.*)*final: .*(\n.*)*teacher top-1"):
        _extract(tmp_path, target, prepared)


def test_wrong_scale_is_caught_although_the_cosine_is_one(tmp_path, target, prepared, monkeypatch):
    """Captured states 1.2 times too large point the right way (cosine 1) and keep the teacher's
    top-1 (the final state is untouched): only the relative error, 0.2 against the sqrt(2 x
    (1 - 0.999)) = 0.0447 that the cosine threshold allows, sees them."""
    def scaled(real, *args):
        aux, final = real(*args)
        return aux * 1.2, final

    _plant(monkeypatch, scaled)
    with pytest.raises(SelfCheckError) as e:
        _extract(tmp_path, target, prepared)
    problems = str(e.value).split("\n")[1:5]
    for name, line in zip(("layer 2", "layer 4", "layer 5"), problems):
        assert re.fullmatch(rf"  {name}: relative error 0\.2 > 0\.04472 \(sample \d+; max abs error [\d.e+-]+; "
                            rf"cosine 1\.000000: a wrong scale\) for the state entering decoder {name}", line), line
    assert not problems[3].startswith(("  final", "  teacher")), problems[3]


def test_selfcheck_off(tmp_path, target, prepared, monkeypatch):
    _plant(monkeypatch, lambda real, parts, layers, *a: real(parts, [i + 1 for i in layers], *a))
    stats = _extract(tmp_path, target, prepared, selfcheck_samples=0)
    assert stats["selfcheck"] == {"samples": []}


def test_failed_selfcheck_leaves_no_manifest_so_train_cannot_run(tmp_path, target, monkeypatch):
    data = tiny.write_jsonl(tmp_path / "data.jsonl", tiny.make_conversations(12, seed=2))
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", f"target.path={target}", "target.dtype=float32",
                             f"prepare.data=[{data}]", "extract.fsync=false", "vocab.size=64"])
    pipeline.run_stage(cfg, "prepare")

    def reorder(real, *args):
        aux, final = real(*args)
        return aux.flip(0), final.flip(0)

    _plant(monkeypatch, reorder)
    with pytest.raises(SelfCheckError):
        pipeline.run_stage(cfg, "extract", preflight=False)
    assert (tmp_path / "run" / "extract" / "index.json").is_file()  # the store is kept ...
    assert not (tmp_path / "run" / "extract" / "manifest.json").exists()  # ... but not handed on
    with pytest.raises(InputError, match="stage train needs stage extract, which has not run"):
        pipeline.run_stage(cfg, "train", preflight=False)


def test_pick_samples_is_seeded_and_bounded():
    ids = np.arange(100, 200)
    a = pick_samples(ids, 4, seed=0)
    assert a == pick_samples(ids, 4, seed=0) and len(set(a)) == 4 and a == sorted(a)
    assert pick_samples(ids, 4, seed=1) != a
    assert pick_samples(ids[:3], 4, seed=0) == [100, 101, 102]


def test_tokens_below_tells_a_few_moved_tokens_from_a_wrong_state(tmp_path, target, prepared, monkeypatch):
    """A state wrong at two tokens of one sample (what a flipped expert route does) fails the
    check with a small share of tokens below; the report says which share, per state."""
    def two_tokens(real, parts, layers, input_ids, attention_mask, dtype):
        out = real(parts, layers, input_ids, attention_mask, dtype)
        aux = out[0] if isinstance(out, tuple) else out
        aux[0, 1:3] = -aux[0, 1:3]  # the first row's tokens 1 and 2, every captured layer
        return out

    _plant(monkeypatch, two_tokens)
    with pytest.raises(SelfCheckError, match=r"of the tokens below") as e:
        _extract(tmp_path, target, prepared)
    shares = [float(x) / 100 for x in __import__("re").findall(r"; ([\d.]+)% of the tokens below", str(e.value))]
    assert len(shares) == 3 and all(abs(s - 2 / sum(LENGTHS)) < 6e-4 for s in shares)  # 2 tokens, 3 layers
    assert "routes tokens to experts" not in str(e.value)  # a dense target: no MoE hint


def test_moe_hint_only_for_mixture_of_experts_targets():
    from eaglet.checks.selfcheck import moe_hint

    assert moe_hint(tiny.tiny_config("llama")) == ""
    assert "routes tokens to experts" in moe_hint(tiny.tiny_config("deepseek_v3"))
    assert "routes tokens to experts" in moe_hint(tiny.tiny_config("qwen3_moe"))
