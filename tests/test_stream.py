"""Engine-fed training (extract.mode online, backend vllm): the states come from a server in
vLLM's connector format through a bounded buffer, and training sees the same samples in the
same order, with the same losses, as an offline vLLM store of the same config. A sample the
engine fails on reaches training with its loss mask cleared; a bound that holds the producer
back keeps the bytes on disk within it while every micro-batch still arrives in order.

The engine is `eaglet.testing.fake_vllm.FakeServer` (vLLM's routes and connector files,
computed with the tiny HF target), so these run on the CPU; the real vLLM path on the GPU
is bench/stream_vllm.py."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from eaglet import pipeline
from eaglet.config import dump_config, load_config
from eaglet.engines.vllm.capture import EngineProcess
from eaglet.errors import ConfigError, InputError
from eaglet.formats.store import StoreReader
from eaglet.engines.vllm import stream as stream_mod
from eaglet.testing import tiny
from eaglet.testing.fake_vllm import FakeServer, FakeVLLM
from eaglet.utils import child_context

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS = [1, 2, 3]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    target = tiny.save_target(root / "target", family="llama", template="llama3")
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    data = tiny.write_jsonl(root / "data.jsonl", tiny.make_conversations(40, seed=3))
    return root, target, model, data


def _cfg(root, target, data, url, mode, name=None, extra=()):
    return load_config(None, [
        f"run.dir={root / (name or mode)}", "run.seed=7", f"target.path={target}", "target.dtype=float32",
        f"prepare.data=[{data}]", "extract.backend=vllm", f"extract.vllm_server={url}", f"extract.mode={mode}",
        "extract.store_dtype=float32", "extract.fsync=false", "extract.selfcheck_samples=3", "extract.vllm_requests=4",
        f"extract.layers={LAYERS}", "vocab.size=200", "train.max_steps=6", "train.max_tokens=256", "train.ttt_steps=2",
        "train.log_every=1", "train.eval_every=3", "train.warmup_steps=2", "train.lr=0.002",
        "train.attn_impl=chunked", "train.tensorboard=false", "train.ckpt_every=2", *extra,
    ])


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under `folder` now (files deleted while counted are skipped)."""
    total = 0
    for f in folder.rglob("*"):
        try:
            total += f.stat().st_size if f.is_file() else 0
        except FileNotFoundError:
            continue
    return total


def _engine(model, root, **kw):
    L = model.config.num_hidden_layers
    return FakeVLLM(model, root / "vllm-states", [*LAYERS, L], **kw)


def _log(cfg, split="train"):
    lines = [json.loads(x) for x in (cfg.run_dir / "train" / "log.jsonl").read_text().splitlines()]
    return [r for r in lines if r["split"] == split]


def _manifest(cfg, stage="train"):
    return json.loads((cfg.run_dir / stage / "manifest.json").read_text())


@pytest.fixture(scope="module")
def runs(assets):
    """An offline vLLM store and a stream run of the same config, against one server."""
    root, target, model, data = assets
    fake = _engine(model, root)
    out = {}
    with FakeServer(fake) as server:
        for mode in ("offline", "online"):
            cfg = _cfg(root, target, data, server.url, mode)
            pipeline.run_all(cfg, upto="train")
            out[mode] = cfg
        out["requests"] = list(server.requests)
    return out


def test_stream_training_reproduces_the_offline_losses(runs):
    off, on = runs["offline"], runs["online"]
    assert StoreReader(on.run_dir / "extract").meta["mode"] == "online"
    assert len(StoreReader(on.run_dir / "extract")) == 0  # no states stored
    for split in ("train", "eval"):
        a, b = _log(off, split), _log(on, split)
        assert [r["step"] for r in a] == [r["step"] for r in b] and a
        for x, y in zip(a, b):
            for k in ("loss", "loss_0", "loss_1"):
                assert y[k] == pytest.approx(x[k], rel=1e-5, abs=1e-6), f"{split} step {x['step']} {k}"
    stats = _manifest(on)["stats"]["stream"]
    assert stats["consumed"] == stats["micro_batches"] > 6  # every planned micro-batch, evaluations included
    assert stats["selfcheck"]["top1_agreement"] == 1.0 and len(stats["selfcheck"]["samples"]) == 3
    assert stats["dropped"] == {}
    assert not any((on.run_dir / "train" / "stream").glob("mb-*"))  # the buffer is emptied at the end
    rec = _log(on)[-1]
    assert {"stream_wait_s", "engine_tokens_per_s", "buffer_peak_gb"} <= set(rec)
    # what the engine side delivered (written tokens over the producer's busy time) cannot pass
    # vLLM's rate over its own time alone; the converters' seconds are counted
    assert 0 < stats["engine_tokens_per_s"] <= stats["vllm_tokens_per_s"]
    assert stats["entry_seconds"] > 0 and stats["engine_seconds"] > 0


def test_stream_asks_for_each_micro_batch_once_with_prompts_cut(runs):
    """Apart from the self-check's samples (with prompt logprobs), every request is a sample
    of a planned micro-batch, cut at train.max_tokens."""
    on = runs["online"]
    stats = _manifest(on)["stats"]["stream"]
    n_off = _manifest(runs["offline"], "extract")["stats"]["samples"]
    streamed = runs["requests"][n_off:]  # the offline run's requests come first
    assert sum("prompt_logprobs" in r for r in streamed) == 3
    assert max(len(r["prompt"]) for r in streamed) <= 256
    assert len(streamed) - 3 >= stats["micro_batches"]


def test_buffer_never_exceeds_its_bound(assets, tmp_path):
    """A slow trainer and a bound of a few micro-batches: a watcher polls the bytes on disk
    (the buffer's entries and the server's connector files) while training runs."""
    root, target, model, data = assets
    fake = _engine(model, tmp_path)
    mb = 256 * ((len(LAYERS) + 1) * 64 * 4 + 5 + (len(LAYERS) + 1) * 64 * 4 + 8) + 4096 * 8  # float32 states, both
    bound_gb = 3.2 * mb / 1e9
    peak = [0]
    stop = threading.Event()
    cfg = None

    def watch():
        while not stop.is_set():
            seen = folder_bytes(tmp_path / "vllm-states") + (
                folder_bytes(cfg.run_dir / "train" / "stream") if (cfg.run_dir / "train" / "stream").exists() else 0)
            peak[0] = max(peak[0], seen)
            time.sleep(0.002)

    with FakeServer(fake) as server:
        cfg = _cfg(root, target, data, server.url, "online", name="bounded",
                   extra=[f"extract.stream_buffer_gb={bound_gb}", "train.max_steps=10", "train.eval_every=0"])
        pipeline.run_all(cfg, upto="extract")
        t = threading.Thread(target=watch, daemon=True)
        t.start()
        try:
            pipeline.run_stage(cfg, "vocab")
            pipeline.run_stage(cfg, "train")
        finally:
            stop.set()
            t.join()
    stats = _manifest(cfg)["stats"]["stream"]
    assert 0 < peak[0] <= stats["buffer_bound_bytes"]
    assert stats["buffer_peak_bytes"] <= stats["buffer_bound_bytes"]
    # more than one micro-batch was ahead at some point, so the bound did the limiting: by the
    # stream's own count (the watcher polls, and on a busy machine can miss the moment)
    assert stats["buffer_peak_bytes"] > mb


def test_a_buffer_too_small_for_one_micro_batch_is_refused(assets, tmp_path):
    root, target, model, data = assets
    with FakeServer(_engine(model, tmp_path)) as server:
        cfg = _cfg(root, target, data, server.url, "online", name="tiny-buffer",
                   extra=["extract.stream_buffer_gb=0.00001"])
        with pytest.raises(ConfigError, match=r"extract.stream_buffer_gb 1e-05 .* one micro-batch"):
            pipeline.run_all(cfg, upto="vocab")  # the preflight, before any weights load
        pipeline.run_all(cfg, upto="vocab", preflight=False)
        with pytest.raises(ConfigError, match=r"extract.stream_buffer_gb 1e-05 .* one micro-batch"):
            pipeline.run_stage(cfg, "train", preflight=False)  # the stream checks it too, before the engine
        assert server.requests == []


def test_engine_failures_are_counted_and_masked(assets, tmp_path):
    """A sample whose states come back with other token ids keeps its place, its loss mask
    cleared, and is counted; the run goes on."""
    root, target, model, data = assets
    fake = _engine(model, tmp_path)
    with FakeServer(fake) as server:
        cfg = _cfg(root, target, data, server.url, "online", name="failing", extra=["train.max_steps=2"])
        pipeline.run_all(cfg, upto="vocab")
        fake.corrupt_every = 5
        pipeline.run_stage(cfg, "train", preflight=False)
    stats = _manifest(cfg)["stats"]["stream"]
    assert stats["dropped"].get("token_mismatch", 0) >= 1
    assert stats["consumed"] == stats["micro_batches"]


def _streamed(runs, folder: Path, engine, **extract) -> stream_mod.StreamedStates:
    """The stream run's StreamedStates over its prepared data, with `engine` in this process
    and extract settings changed."""
    cfg = runs["online"]
    cfg = dataclasses.replace(cfg, extract=dataclasses.replace(cfg.extract, **extract))
    return stream_mod.StreamedStates(StoreReader(cfg.run_dir / "extract"), cfg.run_dir / "prepare", cfg, folder,
                                     engine=engine)


def _prepared(s: stream_mod.StreamedStates, sid: int, max_tokens: int):
    """(input_ids, loss_mask) of a prepared sample, cut at max_tokens."""
    row = int(np.flatnonzero(s.data.sample_ids == sid)[0])
    rec = s.data[row]
    return np.asarray(rec.input_ids)[:max_tokens], np.asarray(rec.loss_mask)[:max_tokens].astype(bool)


def test_a_sample_the_engine_failed_on_reaches_training_with_its_loss_mask_cleared(assets, runs, tmp_path):
    """One sample comes back from the engine with other token ids: in the micro-batch training
    loads (load_batch) it keeps its place with zero states and no token of it counted; the
    others hold their prepared tokens and loss masks."""
    from eaglet.training.data import load_batch

    _, _, model, _ = assets
    fake = _engine(model, tmp_path / "engine")
    s = _streamed(runs, tmp_path / "buffer", fake)
    ids = [int(i) for i in s.sample_ids[:8]]
    loads = [ids[i : i + 2] for i in range(0, 8, 2)]
    # past the self-check's first three samples, one with tokens to train on
    bad = next(i for i in ids[3:] if _prepared(s, i, 256)[1].any())
    fake.corrupt = {bad}
    s.start(loads, 256)
    try:
        for load in loads:
            b = load_batch(s, load, 256, torch.device("cpu"))
            at = 0
            for sid, n in zip(load, b.lens, strict=True):
                want_ids, want_mask = _prepared(s, sid, 256)
                assert n == len(want_ids) and b.input_ids[0, at : at + n].tolist() == want_ids.tolist()
                mask, aux = b.loss_mask[0, at : at + n], b.aux[0, at : at + n]
                if sid == bad:
                    assert not mask.any() and not aux.any() and not b.final[0, at : at + n].any(), sid
                else:
                    assert mask.tolist() == want_mask.tolist() and aux.abs().amax(-1).min() > 0, sid
                at += n
        assert s.stats()["dropped"] == {"token_mismatch": 1}
    finally:
        s.close()


def disk_bytes(*folders: Path) -> int:
    """Bytes of the regular files under `folders` now, each file once (a file renamed while the
    folders are listed keeps its inode; one deleted is skipped)."""
    sizes = {}
    for folder in folders:
        for f in folder.rglob("*"):
            try:
                st = f.stat()
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                sizes[st.st_dev, st.st_ino] = st.st_size
    return sum(sizes.values())


class _HeldProbe(threading.Condition):
    """The stream's condition, marking when its producer waits for room with nothing in flight
    (every reserved micro-batch written): then only the consumer can free room."""

    def __init__(self, s: stream_mod.StreamedStates):
        super().__init__()
        self.s, self.held = s, threading.Event()

    def wait(self, timeout=None):
        s = self.s
        if threading.current_thread().name == f"eaglet-stream-r{s.rank}" and \
                s._used == sum(size for _, size in s._ready.values()):
            self.held.set()
        return super().wait(timeout)


def test_the_bound_holds_the_producer_back_until_training_reads(assets, runs, tmp_path):
    """A bound of about two micro-batches and a consumer that reads nothing until the producer
    is held by it: the entries and connector files on disk stay within the bound, fewer than all
    micro-batches are computed ahead, and the consumer then gets every micro-batch in order, the
    bytes on disk within the bound throughout."""
    from eaglet.formats.buffer import entry_bytes, micro_batch_bytes

    _, _, model, _ = assets
    fake = _engine(model, tmp_path / "engine")
    probe = _streamed(runs, tmp_path / "b0", fake)
    ids = [int(i) for i in probe.sample_ids[:24]]
    loads = [ids[i : i + 2] for i in range(0, 24, 2)]
    toks = [sum(len(_prepared(probe, i, 256)[0]) for i in load) for load in loads]
    dims = (probe.n_aux, probe.hidden, probe.dtype)
    bound = int(2.2 * max(micro_batch_bytes(t, 2, *dims, 4) for t in toks))  # float32 connector files
    assert sum(entry_bytes(t, 2, *dims) for t in toks) > 1.5 * bound  # all of them would not fit
    s = _streamed(runs, tmp_path / "buffer", fake, stream_buffer_gb=bound / 1e9)
    assert abs(s.bound - bound) <= 1
    s._cond = held = _HeldProbe(s)
    folders = (tmp_path / "buffer", tmp_path / "engine")
    entries = lambda: list((tmp_path / "buffer").glob("mb-r0-*.safetensors"))  # noqa: E731
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], disk_bytes(*folders))
            time.sleep(0.001)

    t = threading.Thread(target=watch, daemon=True)
    s.start(loads, 256)
    t.start()
    try:
        deadline = time.monotonic() + 120  # a guard: either comes within a second or two
        while not held.held.is_set() and len(entries()) < len(loads) and time.monotonic() < deadline:
            time.sleep(0.005)
        at_rest = disk_bytes(*folders)
        assert at_rest <= s.bound, f"{len(entries())} entries, {at_rest} bytes on disk, bound {s.bound}"
        assert held.held.is_set() and 2 <= len(entries()) < len(loads)  # the bound did the holding
        for load in loads:
            lens, got = s.get_packed(load, 256)  # raises unless the entry holds `load`
            want = np.concatenate([_prepared(s, i, 256)[0] for i in load])
            assert got["input_ids"].tolist() == want.tolist()
        assert s.stats()["consumed"] == len(loads) and s.stats()["buffer_peak_bytes"] <= s.bound
    finally:
        stop.set()
        t.join()
        s.close()
    assert 0 < peak[0] <= s.bound, (peak[0], s.bound)


def test_the_reservation_covers_the_connector_files_the_engine_writes(assets, runs, tmp_path):
    """A micro-batch's reservation holds the connector files its requests leave before they are
    converted: the engine writes states in target.dtype (float32 here, 4 bytes a value), so a
    reservation sized for 16-bit states would let the buffer outgrow its bound."""
    from eaglet.formats.buffer import connector_itemsize, entry_bytes, micro_batch_bytes

    _, _, model, _ = assets
    fake = _engine(model, tmp_path / "engine")
    s = _streamed(runs, tmp_path / "buffer", fake)
    assert s.cfg.target.dtype == "float32"
    load = [int(i) for i in s.sample_ids[:3]]
    requests = [(i, _prepared(s, i, 256)[0].tolist()) for i in load]
    fake.run(requests, None)
    written = disk_bytes(tmp_path / "engine")
    tokens = sum(len(ids) for _, ids in requests)
    dims = (len(load), s.n_aux, s.hidden, s.dtype)
    reserved = micro_batch_bytes(tokens, *dims, connector_itemsize(s.cfg.target.dtype)) - entry_bytes(tokens, *dims)
    assert written <= reserved, (written, reserved)
    s.start([load], 256)  # the stream reserves the same
    try:
        assert s.load_sizes == [micro_batch_bytes(tokens, *dims, 4)]
    finally:
        s.close()


def test_a_server_of_another_model_is_refused_at_the_start(assets, tmp_path):
    root, target, model, data = assets
    fake = _engine(model, tmp_path, corrupt=[-1])  # every request over HTTP comes as sample -1
    with FakeServer(fake) as server:
        cfg = _cfg(root, target, data, server.url, "online", name="other-model")
        pipeline.run_all(cfg, upto="vocab")
        with pytest.raises(InputError, match="serves another model or tokenizer"):
            pipeline.run_stage(cfg, "train", preflight=False)


def _cli(cfg_path: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "eaglet.cli", *args, str(cfg_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _write_cfg(cfg, path: Path) -> Path:
    path.write_text(dump_config(cfg))
    return path


def test_a_stream_that_stops_mid_run_is_one_line(assets, tmp_path):
    root, target, model, data = assets
    fake = _engine(model, tmp_path)
    with FakeServer(fake) as server:
        cfg = _cfg(root, target, data, server.url, "online", name="stops", extra=["train.max_steps=8"])
        pipeline.run_all(cfg, upto="vocab")
        server.stop_after = len(server.requests) + 3 + 10  # the self-check, then ten more samples
        p = _cli(_write_cfg(cfg, tmp_path / "c.yaml"), "train")
        out, _ = p.communicate(timeout=300)
    assert p.returncode == 4, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("eaglet: stream: the vLLM server at") and "stopped before micro-batch" in last, out
    assert "Traceback" not in out


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        up = todo.pop()
        kids = [c for c, pp in parent.items() if pp == up]
        out += kids
        todo += kids
    return out


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat")
    return not (state.exists() and state.read_text().rsplit(")", 1)[1].split()[0] == "Z")  # a zombie is gone


def test_kill_9_resumes_exactly(assets, tmp_path):
    """A stream run killed (SIGKILL) after its first checkpoint and started again ends with the
    losses of an uninterrupted stream run, and no process the killed one started outlives it."""
    root, target, model, data = assets
    fake = _engine(model, tmp_path, delay=0.02)
    with FakeServer(fake) as server:
        # the engine's client in a thread here, in a child process (the default) in the killed run
        whole = _cfg(root, target, data, server.url, "online", name="whole",
                     extra=["train.max_steps=8", "extract.stream_client_process=false"])
        pipeline.run_all(whole, upto="train")
        cut = _cfg(root, target, data, server.url, "online", name="killed", extra=["train.max_steps=8"])
        pipeline.run_all(cut, upto="vocab")
        path = _write_cfg(cut, tmp_path / "k.yaml")
        p = _cli(path, "train")
        ckpts = cut.run_dir / "train" / "checkpoints"
        deadline = time.time() + 240
        while not any(ckpts.glob("step-0000004")) and time.time() < deadline and p.poll() is None:
            time.sleep(0.05)
        assert p.poll() is None, p.communicate()[0]
        children = _descendants(p.pid)  # the fork server, the converters, the engine's client
        assert len(children) >= 3
        p.send_signal(signal.SIGKILL)
        p.wait()
        deadline = time.time() + 30
        while any(_exists(c) for c in children) and time.time() < deadline:
            time.sleep(0.2)
        assert not [c for c in children if _exists(c)], "processes of the killed trainer outlived it"
        left = list((cut.run_dir / "train" / "stream").glob("mb-*"))
        again = _cli(path, "train")
        out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out
    assert "resumed from" in out
    if left:
        assert "deleted" in out and "entries a stopped run left" in out
    a, b = _log(whole), _log(cut)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-6), x["step"]


def test_the_engine_process_answers_as_the_engine_here(assets, tmp_path):
    """EngineProcess runs the engine in a child: the same files and logprobs as the engine in
    this process; an engine error comes back as one line and the child goes on; the child
    closes its engine and exits once this side's end of the pipe is gone."""
    root, target, model, data = assets
    ids = [*LAYERS, model.config.num_hidden_layers]
    requests = [(5, np.arange(3, 20)), (9, np.arange(7, 15))]
    here = FakeVLLM(model, tmp_path / "here", ids).run(requests, 4)
    proc = EngineProcess(partial(FakeVLLM.load, target, tmp_path / "child", ids), child_context(stream_mod.__name__))
    try:
        there = proc.run(requests, 4)
        assert proc._proc.pid != os.getpid() and [r.sample_id for r in there] == [5, 9]
        for a, b in zip(here, there):
            assert Path(b.path).parent == tmp_path / "child"
            x, y = proc.read(a.path), proc.read(b.path)
            assert torch.equal(x["token_ids"], y["token_ids"]) and torch.equal(x["hidden_states"], y["hidden_states"])
            assert [sorted(d) if d else d for d in a.prompt_logprobs] == [sorted(d) if d else d for d in b.prompt_logprobs]
        with pytest.raises(RuntimeError, match=r"^IndexError: index out of range"):
            proc.run([(1, np.array([10 ** 6]))], None)  # a token id past the vocabulary
        assert len(proc.run(requests[:1], None)) == 1
    finally:
        proc._conn.close()  # as when this process dies: the child sees the pipe close
    proc._proc.join(timeout=60)
    assert proc._proc.exitcode == 0


@pytest.mark.slow
def test_two_gloo_ranks_read_their_own_shares(assets, tmp_path):
    """torchrun, two CPU ranks (gloo), grad_accum 1, against one server: the losses of one
    process with grad_accum 2, and between them the ranks ask for every micro-batch."""
    import shutil
    from collections import Counter

    root, target, model, data = assets
    fake = _engine(model, tmp_path)
    with FakeServer(fake) as server:
        one = _cfg(root, target, data, server.url, "online", name="one-rank",
                   extra=["train.max_steps=4", "train.grad_accum=2", "train.eval_every=0", "train.device=cpu"])
        pipeline.run_all(one, upto="vocab", preflight=False)
        before = len(server.requests)
        pipeline.run_stage(one, "train", preflight=False)
        ref = Counter(tuple(r["prompt"]) for r in server.requests[before:] if "prompt_logprobs" not in r)
        two = _cfg(root, target, data, server.url, "online", name="two-ranks",
                   extra=["train.max_steps=4", "train.grad_accum=1", "train.eval_every=0", "train.device=cpu"])
        for stage in ("prepare", "extract", "vocab"):
            shutil.copytree(one.run_dir / stage, two.run_dir / stage)
        path = _write_cfg(two, tmp_path / "two.yaml")
        before = len(server.requests)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               "-m", "eaglet.cli", "train", str(path), "--skip-preflight"], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        asked = server.requests[before:]
    got = Counter(tuple(r["prompt"]) for r in asked if "prompt_logprobs" not in r)
    assert sum("prompt_logprobs" in r for r in asked) == 2 * 3  # each rank's self-check
    assert not ref - got  # every micro-batch of the one-process run was asked for
    n_eval = sum(len(b) for b in [json.loads((one.run_dir / "train" / "manifest.json").read_text())["stats"]["eval"]
                                  and [0]])
    assert sum((got - ref).values()) <= max(n_eval, 8)  # only the held-out batch rank 1 repeats
    a, b = _log(one), _log(two)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), x["step"]
    assert _manifest(two)["stats"]["world_size"] == 2


def test_the_behind_line_gives_the_engine_rate_against_what_training_could_take(capsys):
    """Training waited 6 s of 10 and so ran at 40 tokens/s: alone it would take 100 tokens/s in
    its 4 busy seconds, which the line sets against the engine's 70. A wait within 5% is silent."""
    from eaglet.training.metrics import say_if_behind

    rec = {"step": 3, "stream_wait_s": 6.0, "engine_tokens_per_s": 70.0, "tokens_per_s": 40.0}
    say_if_behind(rec, 10.0, True)
    say_if_behind({**rec, "stream_wait_s": 0.4}, 10.0, True)
    out = capsys.readouterr()
    lines = [x for x in (out.out + out.err).splitlines() if "is behind" in x]
    assert len(lines) == 1, lines
    assert "waited 6.0 s of the last 10.0 s" in lines[0] and "computes 70 tokens/s" in lines[0]
    assert "training could take 100" in lines[0]
