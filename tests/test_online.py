"""extract.mode: online: the target runs beside the draft in training, and the run sees the
same states, samples, order and losses as an offline run of the same config."""

import json

import pytest
import torch

from eaglet import pipeline
from eaglet.testing import tiny
from eaglet.config import load_config
from eaglet.stages.online import OnlineStates, split_source
from eaglet.stages.train_data import open_states
from eaglet.formats.store import StoreReader

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(root, target, data, mode, extra=()):
    return load_config(None, [
        f"run.dir={root / mode}", "run.seed=7", f"target.path={target}", "target.dtype=float32",
        f"prepare.data=[{data}]", "extract.store_dtype=float32", f"extract.mode={mode}", "extract.selfcheck_samples=3",
        "vocab.size=200", "train.max_steps=8", "train.max_tokens=384", "train.ttt_steps=2", "train.log_every=1",
        "train.eval_every=4", "train.warmup_steps=2", "train.lr=0.002", "train.attn_impl=chunked",
        "train.tensorboard=false", "eval.num_prompts=2", "eval.max_new_tokens=6", *extra,
    ])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("online")
    target = tiny.save_target(root / "target", family="llama", template="llama3")
    data = tiny.write_jsonl(root / "data.jsonl", tiny.make_conversations(50, seed=3))
    out = {}
    for mode in ("offline", "online"):
        cfg = _cfg(root, target, data, mode)
        pipeline.run_all(cfg, upto="eval")
        out[mode] = cfg
    return out


def _log(cfg, split):
    lines = [json.loads(x) for x in (cfg.run_dir / "train" / "log.jsonl").read_text().splitlines()]
    return [r for r in lines if r["split"] == split]


def test_online_store_holds_only_the_selfcheck_samples_and_passes_it(runs):
    off, on = StoreReader(runs["offline"].run_dir / "extract"), StoreReader(runs["online"].run_dir / "extract")
    assert on.meta["mode"] == "online" and off.meta["mode"] == "offline"
    assert len(on) == 3 and len(off) > 40
    manifest = json.loads((runs["online"].run_dir / "extract" / "manifest.json").read_text())
    assert len(manifest["stats"]["selfcheck"]["samples"]) == 3
    for sid in on.sample_ids.tolist():  # the same states as the offline store's
        a, b = on.get(sid), off.get(sid)
        for k in ("aux", "final", "input_ids", "loss_mask"):
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5)


def test_online_states_equal_the_offline_store(runs):
    up = {name: runs["online"].run_dir / name for name in pipeline.STAGE_NAMES}
    states = open_states(runs["online"], up, runs["online"].run_dir / "train")
    assert isinstance(states, OnlineStates)
    off = StoreReader(runs["offline"].run_dir / "extract")
    assert states.sample_ids.tolist() == off.sample_ids.tolist()
    assert states.lengths.tolist() == off.lengths.tolist()
    assert split_source(up).tolist() == off.sample_ids.tolist()
    ids = off.sample_ids[[0, 5, 9, 17]].tolist()
    got = states.get_many(ids, max_tokens=40)  # one padded forward, cut at 40 tokens
    for sid, g in zip(ids, got):
        want = off.get(sid)
        n = min(40, want["input_ids"].shape[0])
        assert g["aux"].shape[0] == n
        for k in ("aux", "final", "input_ids", "loss_mask"):
            torch.testing.assert_close(g[k], want[k][:n], rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"{sid} {k}: {m}")
        assert g["loss_mask_host"].device.type == "cpu" and torch.equal(g["loss_mask_host"], want["loss_mask"][:n])


def test_online_training_reproduces_the_offline_losses(runs):
    for split in ("train", "eval"):
        off, on = _log(runs["offline"], split), _log(runs["online"], split)
        assert [r["step"] for r in on] == [r["step"] for r in off] and on
        for a, b in zip(off, on):
            for k in ("loss", "loss_0", "loss_1"):
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), f"{split} step {a['step']} {k}"
    assert _log(runs["online"], "train")[-1]["loss"] < _log(runs["online"], "train")[0]["loss"]


def test_online_eval_uses_the_same_heldout_prompts(runs):
    ev = {m: json.loads((runs[m].run_dir / "eval" / "eval.json").read_text()) for m in runs}
    assert [p["sample_id"] for p in ev["online"]["prompts"]] == [p["sample_id"] for p in ev["offline"]["prompts"]]
    assert ev["online"]["aggregate"]["lossless"] is True


def test_doctor_counts_the_target_in_trainings_memory_when_online(tmp_path):
    from eaglet.checks.doctor import run_doctor

    target = tiny.save_target(tmp_path / "target", family="llama", template="llama3")
    data = tiny.write_jsonl(tmp_path / "data.jsonl", tiny.make_conversations(4, seed=3))
    found = {}
    for mode in ("offline", "online"):
        lines: list[str] = []
        run_doctor(_cfg(tmp_path, target, data, mode), out=lines.append)
        found[mode] = next(ln for ln in lines if "memory (train)" in ln)
    assert "the target beside it" in found["online"] and "the target beside it" not in found["offline"]
