"""Extraction against transformers' own outputs, batching, NaN handling and resume (CPU, fp32)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import eaglet.engines.hf.extract as extract_mod
from eaglet.config import Config
from eaglet.engines.hf.capture import pad_batch
from eaglet.engines.hf.extract import plan_batches
from eaglet.stages.extract import run_extract
from eaglet.context import StageContext
from eaglet.formats.prepared import PreparedData, PreparedWriter
from eaglet.formats.store import INDEX, StoreReader
from eaglet.targets.load import TargetParts, load_target
from eaglet.targets.families import default_layers, resolve_layers
from eaglet.testing.tiny import save_target

NUM_LAYERS = 8  # default layers [2, 4, 5]: three distinct states
POISON = 511  # a token id the random samples never use


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    return {fam: save_target(root / fam, family=fam, num_hidden_layers=NUM_LAYERS) for fam in ("llama", "qwen3")}


def _prepare(folder, lengths, seed=0, poison=None):
    """Prepared data with random tokens in [1, 500); sample `poison` starts with POISON."""
    rng = np.random.default_rng(seed)
    w = PreparedWriter(folder, ["synthetic.jsonl"], shard_samples=5)
    for k, n in enumerate(lengths):
        ids = rng.integers(1, 500, n)
        if k == poison:
            ids[0] = POISON
        w.add(ids, rng.integers(0, 2, n), 0, k)
    w.close()
    return folder


def _run_config(target):
    cfg = Config()
    cfg.target.path = str(target)
    cfg.target.dtype = "float32"
    cfg.target.device = "cpu"  # the references below run on the CPU; bitwise equality needs the same device
    cfg.extract.store_dtype = "float32"
    cfg.extract.fsync = False
    return cfg


def _run(tmp_path, target, prep, name="extract", input_hash="h1", **extract):
    cfg = _run_config(target)
    for k, v in extract.items():
        setattr(cfg.extract, k, v)
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    stats = run_extract(cfg, StageContext("extract", out, tmp_path, input_hash, {"prepare": prep}))
    return stats, out


LENGTHS = [5, 37, 12, 40, 3, 22, 22, 9, 31, 17, 1]


def test_default_layers():
    assert default_layers(32) == [2, 16, 29]  # Llama-3.1-8B, as in EAGLE-3
    assert default_layers(61) == [2, 30, 58]
    assert default_layers(7) == [2, 3, 4]
    with pytest.raises(ValueError, match=r"L=6.*set extract\.layers"):
        default_layers(6)  # L//2 == L-3: no three distinct states
    assert resolve_layers([1, 7], 8) == [1, 7]
    with pytest.raises(ValueError, match=r"extract\.layers.*\[8\].*L=8"):
        resolve_layers([2, 8], 8)
    with pytest.raises(ValueError, match="duplicate"):
        resolve_layers([2, 2], 8)
    with pytest.raises(ValueError, match=r"extract\.layers.*L=2"):
        default_layers(2)


def test_plan_batches_budget():
    lengths = [5, 100, 12, 40, 3, 22, 22, 9]
    batches = plan_batches(lengths, batch_tokens=50, max_batch_size=3)
    assert sorted(p for b in batches for p in b) == list(range(len(lengths)))
    assert batches[0] == [1]  # longer than the budget: alone
    for b in batches:
        longest = max(lengths[p] for p in b)
        assert len(b) <= 3 and (len(b) == 1 or len(b) * longest <= 50)
        assert [lengths[p] for p in b] == sorted((lengths[p] for p in b), reverse=True)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_states_equal_output_hidden_states(tmp_path, targets, family):
    prep = _prepare(tmp_path / "prep", LENGTHS)
    stats, out = _run(tmp_path, targets[family], prep, batch_tokens=90, max_batch_size=4, shard_mb=0.01)
    layers = [2, 4, 5]
    assert stats["layers"] == layers and stats["samples"] == len(LENGTHS) and stats["dropped"] == {}
    assert stats["tokens"] == sum(LENGTHS) and stats["shards"] > 1
    reader = StoreReader(out)
    assert reader.layers == layers and reader.meta["final_state"] == "post_norm"

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(targets[family], dtype=torch.float32).eval()
    H = model.config.hidden_size
    data = PreparedData(prep)
    batches = plan_batches(data.lengths.tolist(), 90, 4)
    assert any(len(b) > 1 for b in batches)  # real batches with padding
    checked = 0
    with torch.inference_mode():
        for batch in batches:
            ids, mask = pad_batch([data[i].input_ids for i in batch])
            ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
            assert len(ref.hidden_states) == NUM_LAYERS + 1
            for b, i in enumerate(batch):
                s, n = data[i], int(data.lengths[i])
                got = reader.get(s.sample_id)
                assert np.array_equal(got["input_ids"].numpy(), s.input_ids)
                assert np.array_equal(got["loss_mask"].numpy(), s.loss_mask)
                for j, layer in enumerate(layers):  # state entering layer i == hidden_states[i], bitwise
                    assert torch.equal(got["aux"][:, j * H:(j + 1) * H], ref.hidden_states[layer][b, :n]), (i, layer)
                assert torch.equal(got["final"], ref.hidden_states[-1][b, :n])
                # the stored final state is what the LM head sees: it reproduces the model's logits
                torch.testing.assert_close(model.lm_head(got["final"]), ref.logits[b, :n], rtol=1e-5, atol=1e-5)
                # and, looser, the same sample run alone without padding
                alone = model(input_ids=torch.as_tensor(s.input_ids, dtype=torch.int64)[None],
                              output_hidden_states=True, use_cache=False)
                for j, layer in enumerate(layers):
                    torch.testing.assert_close(got["aux"][:, j * H:(j + 1) * H], alone.hidden_states[layer][0],
                                               rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(model.lm_head(got["final"]), alone.logits[0], rtol=1e-4, atol=1e-4)
                checked += 1
    assert checked == len(LENGTHS)


def test_batched_equals_one_by_one(tmp_path, targets):
    """Each sample comes back under its own id whatever batch and row it ran in."""
    lengths = [7, 30, 2, 30, 18, 11, 25, 4, 30, 9]
    prep = _prepare(tmp_path / "prep", lengths, seed=3)
    _, one = _run(tmp_path, targets["llama"], prep, name="one", max_batch_size=1)
    _, many = _run(tmp_path, targets["llama"], prep, name="many", batch_tokens=4096, max_batch_size=8)
    r1, rn = StoreReader(one), StoreReader(many)
    assert r1.sample_ids.tolist() == rn.sample_ids.tolist() == list(range(len(lengths)))
    assert rn.lengths.tolist() == lengths
    for sid in range(len(lengths)):
        a, b = r1.get(sid), rn.get(sid)
        assert torch.equal(a["input_ids"], b["input_ids"])
        torch.testing.assert_close(a["aux"], b["aux"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a["final"], b["final"], rtol=1e-4, atol=1e-4)


def test_nonfinite_sample_is_dropped(tmp_path, targets, monkeypatch):
    """NaN in one sample of a batch: that sample is dropped and counted; its batch mates are stored."""
    real_load = extract_mod.load_target

    def poisoned_load(tcfg):
        model, info = real_load(tcfg)

        def hook(module, args, output):
            rows = args[0][:, 0] == POISON
            output[rows, 1] = float("nan")  # one token of the poisoned sample's embedding
            return output

        TargetParts.of(model).embed_tokens.register_forward_hook(hook)
        return model, info

    monkeypatch.setattr(extract_mod, "load_target", poisoned_load)
    prep = _prepare(tmp_path / "prep", [12, 12, 12, 12, 6], poison=2)
    stats, out = _run(tmp_path, targets["qwen3"], prep, batch_tokens=4096, max_batch_size=8)
    assert stats["dropped"] == {"nonfinite": 1}
    assert stats["samples"] == 4
    reader = StoreReader(out)
    assert reader.sample_ids.tolist() == [0, 1, 3, 4]
    index = json.loads((out / INDEX).read_text())
    assert index["dropped"] == [{"sample_id": 2, "reason": "nonfinite"}]
    for sid in reader.sample_ids.tolist():
        assert torch.isfinite(reader.get(sid)["aux"]).all()


def test_resume_after_crash(tmp_path, targets, monkeypatch):
    """A crashed extraction resumes, keeping its finished shards."""
    lengths = [int(n) for n in np.random.default_rng(7).integers(2, 40, 24)]
    prep = _prepare(tmp_path / "prep", lengths, seed=7)
    # batch size 1: each sample's states do not depend on which run or batch computed them
    opts = dict(max_batch_size=1, shard_mb=0.03)
    _, ref = _run(tmp_path, targets["llama"], prep, name="ref", **opts)

    real_capture = extract_mod.capture
    calls = []

    def crashing_capture(*args, **kwargs):
        calls.append(1)
        if len(calls) == 15:
            raise RuntimeError("killed (injected)")
        return real_capture(*args, **kwargs)

    monkeypatch.setattr(extract_mod, "capture", crashing_capture)
    with pytest.raises(RuntimeError, match="injected"):
        _run(tmp_path, targets["llama"], prep, name="store", **opts)
    monkeypatch.setattr(extract_mod, "capture", real_capture)
    out = tmp_path / "store"
    assert not (out / INDEX).exists()
    shards = sorted(out.glob("shard-r0-*.safetensors"))
    assert len(shards) >= 3 and all(p.with_suffix(".json").exists() for p in shards)
    # debris of a kill: the last shard renamed into place but its sidecar not written, a stray tmp
    shards[-1].with_suffix(".json").unlink()
    stray = out / ".shard-r0-000042.safetensors.ab12cd.tmp"
    stray.write_bytes(b"\0" * 100)
    finished = [json.loads(p.with_suffix(".json").read_text()) for p in shards[:-1]]
    done = sum(side["samples"] for side in finished)

    stats, _ = _run(tmp_path, targets["llama"], prep, name="store", **opts)
    assert stats["resumed_samples"] == done and 0 < done < len(lengths)
    assert json.loads((out / "store.json").read_text())["input_hash"] == "h1"
    assert stats["new_tokens"] == sum(lengths) - sum(sum(side["lengths"]) for side in finished)
    assert stats["samples"] == len(lengths) and stats["tokens"] == sum(lengths)
    assert not stray.exists()
    sidecars = [json.loads(p.read_text()) for p in out.glob("shard-r0-*.json")]
    all_ids = [i for side in sidecars for i in side["sample_ids"]]
    assert sorted(all_ids) == list(range(len(lengths)))  # every sample exactly once
    a, b = StoreReader(ref), StoreReader(out)
    assert b.verify_all()["bad"] == []
    for sid in range(len(lengths)):
        ga, gb = a.get(sid), b.get(sid)
        for key in ("aux", "final", "input_ids", "loss_mask"):
            assert torch.equal(ga[key], gb[key]), (sid, key)

    # a rerun with everything done does no forward and keeps the store
    stats2, _ = _run(tmp_path, targets["llama"], prep, name="store", **opts)
    assert stats2["resumed_samples"] == len(lengths) and stats2["new_tokens"] == 0


def test_killed_at_random_points_resumes_bit_for_bit(tmp_path, monkeypatch):
    """Killed after k batches (10 k at random), the rerun's store equals an uninterrupted run's
    bit for bit: it recomputes whole batches of the uninterrupted plan, not a new plan over the
    samples left. bf16 states of padded batches of changing size: a sample's bits depend on its
    batch mates, so any other batching shows."""
    target = save_target(tmp_path / "qwen3-4", family="qwen3", num_hidden_layers=4)  # small: 21 runs
    lengths = [int(n) for n in np.random.default_rng(11).integers(2, 48, 40)]
    prep = _prepare(tmp_path / "prep", lengths, seed=11)
    opts = dict(batch_tokens=96, max_batch_size=6, shard_mb=0.03, store_dtype="bfloat16", layers=[1, 2, 3],
                selfcheck_samples=0)
    plan = plan_batches(lengths, 96, 6)
    assert len(plan) > 12 and len({len(b) for b in plan}) > 2
    loaded = extract_mod.load_target(_run_config(target).target)  # loaded once
    monkeypatch.setattr(extract_mod, "load_target", lambda tcfg, **kw: loaded)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls; and every run with the reference's kernels
    try:
        _, ref = _run(tmp_path, target, prep, name="ref", **opts)
        a = StoreReader(ref)
        real_capture = extract_mod.capture
        differ = {}
        for k in sorted(np.random.default_rng(5).choice(np.arange(2, len(plan)), 10, replace=False).tolist()):
            calls = []

            def crashing_capture(*args, calls=calls, k=k, **kwargs):
                calls.append(1)
                if len(calls) > k:
                    raise RuntimeError("killed (injected)")
                return real_capture(*args, **kwargs)

            monkeypatch.setattr(extract_mod, "capture", crashing_capture)
            with pytest.raises(RuntimeError, match="injected"):
                _run(tmp_path, target, prep, name=f"killed-{k}", **opts)
            monkeypatch.setattr(extract_mod, "capture", real_capture)
            out = tmp_path / f"killed-{k}"
            kept = {p.name: p.read_bytes() for p in out.glob("shard-r0-*")}
            done = sum(json.loads(p.read_text())["samples"] for p in out.glob("shard-r0-*.json"))
            assert 0 < done < len(lengths), k
            stats, _ = _run(tmp_path, target, prep, name=f"killed-{k}", **opts)
            assert stats["resumed_samples"] == done and stats["samples"] == len(lengths), k
            assert all((out / name).read_bytes() == data for name, data in kept.items()), k  # finished shards kept
            b = StoreReader(out)
            assert b.sample_ids.tolist() == a.sample_ids.tolist()
            differ[k] = [sid for sid in a.sample_ids.tolist()
                         if not all(torch.equal(a.get(sid)[key], b.get(sid)[key]) for key in ("aux", "final"))]
    finally:
        torch.set_num_threads(threads)
    assert differ == {k: [] for k in differ}  # every resumed store bit for bit the uninterrupted one's


def test_multimodal_wrapper(tmp_path):
    """A Llava-style checkpoint: not a CausalLM class; the decoder is model.language_model."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    text = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                       num_attention_heads=2, num_key_value_heads=2)
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              image_size=28, patch_size=14)
    LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision, image_token_index=510)
                                  ).save_pretrained(tmp_path / "llava")
    cfg = Config()
    cfg.target.path = str(tmp_path / "llava")
    cfg.target.dtype = "float32"
    cfg.target.device = "cpu"
    model, info = load_target(cfg.target)
    assert info["class"] == "LlavaForConditionalGeneration" and info["num_layers"] == 6
    parts = TargetParts.of(model)
    assert parts.decoder is model.model.language_model and parts.hidden_size == 32
    ids, mask = pad_batch([np.arange(1, 9), np.arange(3, 7)])
    with torch.inference_mode():
        aux, final = extract_mod.capture(parts, [2, 3], ids, mask, torch.float32)
        ref = parts.decoder(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        head_logits = parts.lm_head(final)
    assert torch.equal(aux[..., :32], ref.hidden_states[2]) and torch.equal(aux[..., 32:], ref.hidden_states[3])
    torch.testing.assert_close(head_logits, logits, rtol=1e-5, atol=1e-5)

    with pytest.raises(ValueError, match="Linear"):
        TargetParts.of(torch.nn.Linear(2, 2))
