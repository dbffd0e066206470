"""Checkpoints written behind the loop (train.ckpt_async, eaglet/training/checkpoint_writer.py).

Each is held to a run that writes its checkpoints in the loop (train.ckpt_async=false), fp32
on the CPU, one thread: the same checkpoints bit for bit, also when the write is held back
until the loop has run several steps past it (on the CPU the draft's weights and its
optimizer state are the very tensors the next steps change); a write that fails or is killed
half way leaves a `.tmp-step-*` folder that resume passes over, and the failure is raised by
the run, before its final draft and manifest; a resume from such a run's checkpoint trains
what the uninterrupted run trains.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import killed_copy, tiny_pipeline_upto_vocab, train_on_copy
from eaglet import pipeline
from eaglet.config import load_config
from eaglet.formats import checkpoints as ck
from eaglet.training import loop

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = ["run.seed=0", "extract.store_dtype=float32", "vocab.size=128", "train.max_tokens=256", "train.ttt_steps=2",
        "train.log_every=1", "train.eval_every=4", "train.ckpt_every=2", "train.keep_last=20", "train.warmup_steps=2",
        "train.lr=0.001", "train.min_lr_ratio=0.1", "train.tensorboard=false", "train.device=cpu",
        "train.eval_fraction=0.1"]
TIMED = ("tokens_per_s", "memory_gib")  # log fields that measure the machine, not the training


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(tmp, overrides, {"on": a run writing behind the loop, "off": one writing in it}, the
    thread that ran each save_checkpoint of each): one epoch of 11 steps, a checkpoint every 2."""
    tmp = tmp_path_factory.mktemp("async_ckpt")
    base = tiny_pipeline_upto_vocab(tmp, 20, 7, BASE)
    threads, out = {}, {}
    real = loop.save_checkpoint
    for name in ("on", "off"):
        seen = threads[name] = []

        def recording(folder, step, *args, seen=seen):
            seen.append((step, threading.current_thread().name))
            return real(folder, step, *args)

        loop.save_checkpoint = recording
        try:
            out[name], _ = train_on_copy(tmp, base, name, f"train.ckpt_async={'true' if name == 'on' else 'false'}")
        finally:
            loop.save_checkpoint = real
    return tmp, base, out, threads


def _ckpts(run: Path) -> Path:
    return run / "train" / "checkpoints"


def _train(run: Path, base: list[str], *extra: str) -> dict:
    cfg = load_config(None, [f"run.dir={run}", *base, *extra])
    return pipeline.run_stage(cfg, "train", preflight=False)["stats"]


def _log(run: Path) -> list[dict]:
    recs = [json.loads(x) for x in (run / "train" / "log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMED} for r in recs]


def _same(a, b, where: str = "") -> None:
    """`a` and `b` (nested dicts, lists, tensors) are equal, tensors bit for bit in the same dtype."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}.{i}")
    else:
        assert a == b, where


def _same_checkpoint(a: Path, b: Path, settings_differ: bool = False) -> None:
    """Checkpoint folders `a` and `b` hold the same weights, optimizer, RNG and scheduler state,
    data position and fingerprint (their train.* settings too unless `settings_differ`)."""
    ck.verify(a), ck.verify(b)  # each raises CorruptCheckpointError on a mismatch
    for name in (ck.MODEL_FILE, ck.RNG_FILE):
        _same(load_file(str(a / name)), load_file(str(b / name)), f"{a.name}/{name}")
    _same(torch.load(a / ck.OPTIMIZER_FILE, weights_only=True), torch.load(b / ck.OPTIMIZER_FILE, weights_only=True),
          f"{a.name}/{ck.OPTIMIZER_FILE}")
    sa, sb = (json.loads((c / ck.STATE_FILE).read_text()) for c in (a, b))
    if settings_differ:
        sa.pop("settings"), sb.pop("settings")
    else:
        sa["settings"].pop("train.ckpt_async"), sb["settings"].pop("train.ckpt_async")
    assert sa == sb


def test_behind_the_loop_writes_what_the_loop_writes(runs):
    tmp, base, out, threads = runs
    on, off = out["on"], out["off"]
    steps = [2, 4, 6, 8, 10, 11]
    assert threads["on"] == [(s, "eaglet-checkpoint_0") for s in steps]  # each on the writer's thread
    assert threads["off"] == [(s, "MainThread") for s in steps]
    assert [p.name for p in ck.checkpoints(_ckpts(on))] == [p.name for p in ck.checkpoints(_ckpts(off))] \
        == [f"step-{s:07d}" for s in reversed(steps)]
    for c in ck.checkpoints(_ckpts(off)):
        _same_checkpoint(_ckpts(on) / c.name, c)
    assert _log(on) == _log(off)
    _same(load_file(str(on / "train" / "final" / "model.safetensors")),
          load_file(str(off / "train" / "final" / "model.safetensors")))
    state = json.loads((_ckpts(on) / "step-0000011" / ck.STATE_FILE).read_text())
    assert state["settings"]["train.ckpt_async"] is True
    assert not list(_ckpts(on).glob(".tmp-*"))


def _hold_back(monkeypatch, step: int, until: int) -> dict[int, int]:
    """Make checkpoint `step`'s write wait until the loop has taken `until` optimizer steps;
    returns {checkpoint step: optimizer steps taken when its write ran}, filled as they run."""
    real_write, real_step = loop.save_checkpoint, loop.optimizer_step
    taken, released, at_write = [], threading.Event(), {}

    def stepping(*args, **kw):
        lr = real_step(*args, **kw)
        taken.append(lr)
        if len(taken) == until:
            released.set()
        return lr

    def held_back(folder, s, *args):
        if s == step:
            assert released.wait(timeout=300), f"the loop did not run on while checkpoint {step} was pending"
        at_write[s] = len(taken)
        return real_write(folder, s, *args)

    monkeypatch.setattr(loop, "optimizer_step", stepping)
    monkeypatch.setattr(loop, "save_checkpoint", held_back)
    return at_write


def test_a_write_held_back_while_the_loop_runs_on_holds_its_own_step(runs, tmp_path, monkeypatch):
    """The write of step 4 waits until the loop has taken step 7: on the CPU the weights and the
    optimizer state it was given would by then be step 7's, were they not copies."""
    tmp, base, out, _ = runs
    at_write = _hold_back(monkeypatch, 4, until=7)
    run, _ = train_on_copy(tmp, base, tmp_path / "held", "train.ckpt_every=4")
    assert at_write[4] >= 7  # written after the loop took steps 5, 6 and 7
    assert at_write[8] >= 8 and at_write[11] == 11
    assert [p.name for p in ck.checkpoints(_ckpts(run))] == ["step-0000011", "step-0000008", "step-0000004"]
    for c in ck.checkpoints(_ckpts(run)):
        _same_checkpoint(c, _ckpts(out["off"]) / c.name, settings_differ=True)
    assert _log(run) == _log(out["off"])


@pytest.mark.parametrize("failing", [4, 11])
def test_a_failed_write_fails_the_run_before_its_final_draft_and_resume_passes_it_over(runs, tmp_path, monkeypatch,
                                                                                       failing):
    """The write of checkpoint `failing` fails half way (its checksums cannot be written): the
    run fails at its next checkpoint or at its end, naming the folder, with no final draft or
    manifest; the unfinished `.tmp-step-*` folder is passed over by the resume, which trains on
    to the uninterrupted run's weights."""
    tmp, base, out, _ = runs
    real = ck.atomic_write_json

    def full_disk(path, obj, *args, **kw):
        if Path(path).name == ck.CHECKSUM_FILE and Path(path).parent.name == f".tmp-step-{failing:07d}":
            raise OSError(28, "No space left on device")
        return real(path, obj, *args, **kw)

    monkeypatch.setattr(ck, "atomic_write_json", full_disk)
    run = tmp_path / "run"
    shutil.copytree(tmp / "run", run)
    folder = _ckpts(run) / f"step-{failing:07d}"
    with pytest.raises(RuntimeError) as e:
        _train(run, base)
    assert str(e.value) == (f"train: writing checkpoint {folder} failed (OSError: [Errno 28] No space left on "
                            "device); the checkpoints before it are as they were: a rerun resumes from the newest")
    newest = 2 if failing == 4 else 10
    assert [p.name for p in ck.checkpoints(_ckpts(run))][0] == f"step-{newest:07d}"  # none after the failed one
    assert (_ckpts(run) / f".tmp-step-{failing:07d}" / ck.MODEL_FILE).is_file()  # what the failed write left
    assert not (run / "train" / "final").exists() and not (run / "train" / "manifest.json").exists()

    monkeypatch.setattr(ck, "atomic_write_json", real)
    stats = _train(run, base)
    assert stats["resumed"]["from_step"] == newest and stats["resumed"]["corrupt"] == {}
    _same(load_file(str(run / "train" / "final" / "model.safetensors")),
          load_file(str(out["off"] / "train" / "final" / "model.safetensors")))
    assert _log(run) == _log(out["off"])


def test_an_interrupted_run_waits_for_the_write_in_flight(runs, tmp_path, monkeypatch):
    """Ctrl-C at step 5 while the write of step 4 is still held back: the run raises the
    KeyboardInterrupt only once checkpoint 4 is whole on disk."""
    tmp, base, out, _ = runs
    real_write, real_step = loop.save_checkpoint, loop.optimizer_step
    taken, released = [], threading.Event()

    def interrupted(*args, **kw):
        taken.append(real_step(*args, **kw))
        if len(taken) == 5:  # the write is let go a moment after the interrupt
            threading.Timer(0.5, released.set).start()
            raise KeyboardInterrupt
        return taken[-1]

    def held_back(folder, step, *args):
        if step == 4:
            assert released.wait(timeout=300)
        return real_write(folder, step, *args)

    monkeypatch.setattr(loop, "optimizer_step", interrupted)
    monkeypatch.setattr(loop, "save_checkpoint", held_back)
    run = tmp_path / "run"
    shutil.copytree(tmp / "run", run)
    with pytest.raises(KeyboardInterrupt):
        _train(run, base)
    assert released.is_set()
    assert [p.name for p in ck.checkpoints(_ckpts(run))] == ["step-0000004", "step-0000002"]
    _same_checkpoint(_ckpts(run) / "step-0000004", _ckpts(out["off"]) / "step-0000004")
    assert not list(_ckpts(run).glob(".tmp-*"))


def test_state_noise_held_back_write_records_its_own_steps_rng(runs, tmp_path, monkeypatch):
    """train.state_noise draws from the RNG states every step. A write of step 4 held back until
    the loop has taken step 5 still records step 4's states (taken at the step, not as it
    writes), so its checkpoints equal those of a run writing in the loop, RNG included."""
    tmp, base, _, _ = runs
    noise = ("train.state_noise=0.05", "train.max_steps=6", "train.ckpt_every=4")
    off, _ = train_on_copy(tmp, base, tmp_path / "noise-off", "train.ckpt_async=false", *noise)
    at_write = _hold_back(monkeypatch, 4, until=5)
    on, _ = train_on_copy(tmp, base, tmp_path / "noise-on", "train.ckpt_async=true", *noise)
    assert at_write[4] >= 5
    assert [p.name for p in ck.checkpoints(_ckpts(on))] == [p.name for p in ck.checkpoints(_ckpts(off))] \
        == ["step-0000006", "step-0000004"]
    for c in ck.checkpoints(_ckpts(off)):
        _same_checkpoint(_ckpts(on) / c.name, c)
    assert _log(on) == _log(off)


def test_resume_from_a_checkpoint_written_behind_the_loop(runs, tmp_path):
    tmp, base, out, _ = runs
    for name, extra, changed in (("same", [], {}),
                                 ("in_loop", ["train.ckpt_async=false"], {"train.ckpt_async": [True, False]})):
        run = killed_copy(out["on"], tmp_path / name, after=6)
        stats = _train(run, base, *extra)
        assert stats["resumed"]["from_step"] == 6 and stats["steps_run"] == 5
        assert stats["resumed"]["changed"] == changed
        _same(load_file(str(run / "train" / "final" / "model.safetensors")),
              load_file(str(out["off"] / "train" / "final" / "model.safetensors")))
        assert _log(run) == _log(out["off"])


# A training process whose write of checkpoint 4 stops for good before its checksums.
_STALLED = """
import sys, time
from pathlib import Path
from eaglet import pipeline
from eaglet.config import load_config
from eaglet.formats import checkpoints as ck
real = ck.atomic_write_json
def stalled(path, obj, *args, **kw):
    if Path(path).name == ck.CHECKSUM_FILE and Path(path).parent.name == ".tmp-step-0000004":
        time.sleep(3600)
    return real(path, obj, *args, **kw)
ck.atomic_write_json = stalled
pipeline.run_stage(load_config(None, sys.argv[1:]), "train", preflight=False)
"""


@pytest.mark.slow
def test_a_run_killed_mid_write_resumes_from_the_checkpoint_before(runs, tmp_path):
    """SIGKILL while the writer's thread is half way through checkpoint 4 (its files there, not
    its checksums): a `.tmp-step-0000004` folder is left, and the next run resumes from
    step-0000002 and trains what the uninterrupted run trains."""
    tmp, base, out, _ = runs
    run = tmp_path / "run"
    shutil.copytree(tmp / "run", run)
    script = tmp_path / "stalled.py"
    script.write_text(_STALLED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                        os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    err = tmp_path / "stderr.txt"
    with err.open("w") as f:
        proc = subprocess.Popen([sys.executable, str(script), f"run.dir={run}", *base], env=env,
                                stdout=subprocess.DEVNULL, stderr=f)
    half = _ckpts(run) / ".tmp-step-0000004" / ck.STATE_FILE
    t0 = time.time()
    while not half.is_file():
        if proc.poll() is not None:
            pytest.fail(f"ended (rc {proc.returncode}) before the kill: {err.read_text()[-2000:]}")
        if time.time() - t0 > 300:
            proc.kill()
            pytest.fail("timed out waiting for the write of checkpoint 4")
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert [p.name for p in ck.checkpoints(_ckpts(run))] == ["step-0000002"]
    assert sorted(p.name for p in _ckpts(run).iterdir()) == [".tmp-step-0000004", "step-0000002"]
    stats = _train(run, base)
    assert stats["resumed"]["from_step"] == 2 and stats["resumed"]["corrupt"] == {}
    _same(load_file(str(run / "train" / "final" / "model.safetensors")),
          load_file(str(out["off"] / "train" / "final" / "model.safetensors")))
    assert _log(run) == _log(out["off"])
    assert not list(_ckpts(run).glob(".tmp-*"))  # the next write of step 4 replaced it
