"""extract.mode: online: the target runs beside the draft in training, and the run sees the
same states, samples, order and losses as an offline run of the same config."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from eaglet import pipeline
from eaglet.testing import tiny
from eaglet.config import TargetSection, load_config
from eaglet.engines.hf.online import AheadStates, OnlineStates, TargetStopped, online_ahead
from eaglet.engines.states import split_source
from eaglet.training.data import open_states
from eaglet.formats.store import StoreReader

pytestmark = pytest.mark.usefixtures("one_thread")


AHEAD = ["extract.online_ahead=2"]


def _cfg(root, target, data, mode, extra=(), name=None):
    return load_config(None, [
        f"run.dir={root / (name or mode)}", "run.seed=7", f"target.path={target}", "target.dtype=float32",
        f"prepare.data=[{data}]", "extract.store_dtype=float32", f"extract.mode={mode}", "extract.selfcheck_samples=3",
        "vocab.size=200", "train.max_steps=8", "train.max_tokens=384", "train.ttt_steps=2", "train.log_every=1",
        "train.eval_every=4", "train.warmup_steps=2", "train.lr=0.002", "train.attn_impl=chunked",
        "train.tensorboard=false", "train.ckpt_every=4", "eval.num_prompts=2", "eval.max_new_tokens=6", *extra,
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
    # the target in a process of its own, computing two micro-batches ahead (a GPU's default)
    out["ahead"] = _cfg(root, target, data, "online", AHEAD, name="ahead")
    pipeline.run_all(out["ahead"], upto="train")
    out["inputs"] = (root, target, data)
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
    # the trainer-facing protocol (engines/base.py StateSource): nothing ahead, the count for the manifest
    assert (states.computes_ahead, states.prefetchable, states.stats_key) == (False, False, "online")
    assert states.stats() == {"nonfinite_samples": 0} and states.progress() == {}
    lens, parts = states.read_parts(ids, 40)
    assert len(parts) == 1 and lens == [g["aux"].shape[0] for g in got]  # one part: the micro-batch packed


def _same_losses(runs, name, split):
    """Run `name`'s logged losses of `split` are the offline run's, step by step; its records."""
    off, got = _log(runs["offline"], split), _log(runs[name], split)
    assert [r["step"] for r in got] == [r["step"] for r in off] and got
    for a, b in zip(off, got):
        for k in ("loss", "loss_0", "loss_1"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), f"{split} step {a['step']} {k}"
    return got


def test_online_training_reproduces_the_offline_losses(runs):
    for split in ("train", "eval"):
        _same_losses(runs, "online", split)
    assert _log(runs["online"], "train")[-1]["loss"] < _log(runs["online"], "train")[0]["loss"]


def test_ahead_training_reproduces_the_offline_losses(runs):
    """The target's own process computes the same states for the same micro-batches, in order:
    the run's losses are the offline run's, at every logged step and evaluation."""
    _same_losses(runs, "ahead", "eval")
    ah = _same_losses(runs, "ahead", "train")
    assert all(r["states_wait_s"] >= 0 and r["target_tokens_per_s"] > 0 for r in ah)
    stats = json.loads((runs["ahead"].run_dir / "train" / "manifest.json").read_text())["stats"]
    ahead = stats["online_ahead"]
    assert ahead["ahead"] == 2 and ahead["consumed"] == ahead["micro_batches"] > 8  # 8 steps and two evaluations
    assert ahead["nonfinite_samples"] == 0  # AheadStates.stats(), under its stats_key


def test_ahead_run_resumes_exactly(runs, tmp_path):
    """A run stopped after its checkpoint of step 4 resumes with the target's process planning
    from there, and ends with the uninterrupted run's losses."""
    from conftest import killed_copy

    root, target, data = runs["inputs"]
    killed_copy(runs["ahead"].run_dir, root / "ahead-cut", after=4)
    again = _cfg(root, target, data, "online", AHEAD, name="ahead-cut")
    pipeline.run_all(again, upto="train")
    whole = _log(runs["ahead"], "train")
    stats = json.loads((again.run_dir / "train" / "manifest.json").read_text())["stats"]
    assert stats["resumed"]["from_step"] == 4
    resumed = {r["step"]: r for r in _log(again, "train")}
    for r in whole:
        if r["step"] > 4:
            assert resumed[r["step"]]["loss"] == pytest.approx(r["loss"], rel=1e-5), r["step"]


def _states(runs, depth=2, **kw):
    up = {name: runs["online"].run_dir / name for name in pipeline.STAGE_NAMES}
    base = StoreReader(up["extract"], verify=False)
    return AheadStates(base, up["prepare"], runs["online"].target, depth, **kw), up


def test_ahead_states_equal_the_in_process_states_and_keep_the_plan(runs):
    states, up = _states(runs, depth=1)
    inproc = open_states(runs["online"], up, runs["online"].run_dir / "train")
    ids = inproc.sample_ids.tolist()
    plan = [ids[0:3], ids[3:4], ids[4:9], ids[9:11]]
    try:
        states.start(plan, 40)
        for load in plan[:3]:
            got, want = states.get_many(load, 40), inproc.get_many(load, 40)
            assert len(got) == len(want)
            for g, w in zip(got, want):
                for k in ("aux", "final", "input_ids", "loss_mask", "loss_mask_host"):
                    torch.testing.assert_close(g[k], w[k], rtol=1e-5, atol=1e-5)
        with pytest.raises(RuntimeError, match="out of step"):
            states.get_many(plan[2], 40)  # not the next planned micro-batch
        assert states.stats()["consumed"] == 4 and states.stats()["target_s"] > 0
    finally:
        states.close()
    assert not states._proc.is_alive()


def test_open_states_computes_ahead_only_for_a_reader_that_plans(runs):
    """The Trainer hands over its plan; a reader in an order of its own (speculators' harness)
    gets the target in its process even where extract.online_ahead is set."""
    up = {name: runs["ahead"].run_dir / name for name in pipeline.STAGE_NAMES}
    planned = open_states(runs["ahead"], up, runs["ahead"].run_dir / "train")
    try:
        assert isinstance(planned, AheadStates)
        with pytest.raises(RuntimeError, match=r"0 were planned \(a reader in its own order"):
            planned.get_many(planned.sample_ids[:1].tolist())
    finally:
        planned.close()
    own = open_states(runs["ahead"], up, runs["ahead"].run_dir / "train", planned=False)
    assert isinstance(own, OnlineStates) and len(own.get_many(own.sample_ids[:2].tolist(), 16)) == 2


def test_ahead_process_failure_is_one_line(runs, tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    broken = TargetSection(path=str(tmp_path), dtype="float32")
    up = {name: runs["online"].run_dir / name for name in pipeline.STAGE_NAMES}
    states = AheadStates(StoreReader(up["extract"], verify=False), up["prepare"], broken, 2)
    # a long run's plan is larger than a pipe holds: handing it over returns even though the
    # process failed before it read anything
    ids = states.sample_ids.tolist()
    plan = [ids[:2]] + [ids[:5]] * 400000  # more than the pipe takes before the process reads it
    try:
        sender = threading.Thread(target=states.start, args=(plan, 40), daemon=True)
        sender.start()
        sender.join(timeout=120)
        assert not sender.is_alive(), "start() blocked on a process that failed"
        with pytest.raises(TargetStopped, match=r"target's process stopped before micro-batch 0 of 400001 \(") as e:
            states.get_many(states.sample_ids[:2].tolist(), 40)
        assert "\n" not in str(e.value).split(" (fix:")[0]
        assert "config" in str(e.value) and "exit code" not in str(e.value)  # the cause, from the process
    finally:
        states.close()
    assert not states._proc.is_alive()


def test_ahead_process_ends_when_the_trainer_is_gone(runs):
    """Nothing but the trainer would end the target's process: it watches the trainer's pid."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    states, _ = _states(runs, watch_pid=gone.pid)
    deadline = time.time() + 120
    while states._proc.is_alive() and time.time() < deadline:
        time.sleep(0.2)
    assert not states._proc.is_alive() and states._proc.exitcode == 0
    states.close()


def test_online_ahead_is_on_for_a_gpu_only_and_off_under_tp_plan(tmp_path):
    def cfg(*extra):
        return load_config(None, [f"run.dir={tmp_path}", "extract.mode=online", *extra])

    assert online_ahead(cfg("target.device=cpu")) == 0
    assert online_ahead(cfg("target.device=cuda")) == 2
    assert online_ahead(cfg("target.device=cpu", "extract.online_ahead=3")) == 3
    assert online_ahead(cfg("target.device=cuda", "extract.online_ahead=0")) == 0
    assert online_ahead(cfg("target.device=cuda", "extract.tp_plan=auto")) == 0


def test_online_eval_uses_the_same_heldout_prompts(runs):
    ev = {m: json.loads((runs[m].run_dir / "eval" / "eval.json").read_text()) for m in ("offline", "online")}
    assert [p["sample_id"] for p in ev["online"]["prompts"]] == [p["sample_id"] for p in ev["offline"]["prompts"]]
    assert ev["online"]["aggregate"]["lossless"] is True


def test_doctor_counts_the_target_in_trainings_memory_when_online(tmp_path):
    from eaglet.doctor import run_doctor

    target = tiny.save_target(tmp_path / "target", family="llama", template="llama3")
    data = tiny.write_jsonl(tmp_path / "data.jsonl", tiny.make_conversations(4, seed=3))
    found = {}
    for mode in ("offline", "online"):
        lines: list[str] = []
        run_doctor(_cfg(tmp_path, target, data, mode), out=lines.append)
        found[mode] = next(ln for ln in lines if "memory (train)" in ln)
    assert "the target beside it" in found["online"] and "the target beside it" not in found["offline"]
