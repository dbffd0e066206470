"""Training data order: packing, the held-out split, the micro-batch stream, and the packed batch."""

import json
import shutil
import threading
from itertools import islice
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eaglet.errors import CorruptDataError
from eaglet.formats.store import StoreReader
from eaglet.training.plan import StepPlan
from eaglet.training.data import epoch_plan, pack, split_ids


def test_split_is_fixed_by_seed_disjoint_and_complete():
    ids = np.arange(100)
    tr, ev = split_ids(ids, 0.1, seed=3)
    assert len(ev) == 10 and not set(tr) & set(ev) and sorted([*tr, *ev]) == list(range(100))
    tr2, ev2 = split_ids(ids, 0.1, seed=3)
    assert ev.tolist() == ev2.tolist()
    assert split_ids(ids, 0.1, seed=4)[1].tolist() != ev.tolist()


def test_pack_respects_budget_and_order():
    lengths = {0: 300, 1: 300, 2: 100, 3: 900, 4: 50}
    batches = pack(np.array([0, 1, 2, 3, 4]), lengths, 512)
    assert batches == [[0], [1, 2], [3], [4]]  # 3 is cut to 512 and goes alone


def test_micro_batch_stream_survives_epochs_with_fewer_batches():
    # Another permutation can pack into fewer micro-batches than epoch 0's plan: the stream
    # must move on to the next epoch instead of indexing past the plan.
    rng = np.random.default_rng(0)
    ids = np.arange(50)
    lengths = {i: int(rng.integers(10, 300)) for i in ids}
    counts = [len(epoch_plan(ids, lengths, 512, 0, e)) for e in range(6)]
    assert len(set(counts)) > 1
    fake = SimpleNamespace(train_ids=ids, lengths=lengths, cfg=SimpleNamespace(run=SimpleNamespace(seed=0), train=SimpleNamespace(seed=None)),
                           train_cfg=SimpleNamespace(max_tokens=512, grad_accum=1), steps_per_epoch=max(counts), micro_per_step=1)
    stream = list(islice(StepPlan.micro_batches(fake, 0, 0), sum(counts)))
    seen = [(e, i) for e, i, _ in stream]
    assert len(seen) == len(set(seen)) == sum(counts)
    for e, i, batch in stream:
        assert batch == epoch_plan(ids, lengths, 512, 0, e)[i]


def _config(ttt_steps, layers=(1, 2, 3)):
    """A config whose EAGLE-3 draft reads `_Samples`' layers, with `ttt_steps` TTT steps."""
    from eaglet.config import Config

    cfg = Config()
    cfg.train.ttt_steps, cfg.extract.layers = ttt_steps, list(layers)
    return cfg


class _Samples:
    """A stand-in store: `get` and `read_parts` as StoreReader's, from tensors in memory."""

    def __init__(self, lengths, H=4, n_aux=3, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.folder, self.layers, self.meta = "in memory", list(range(1, n_aux + 1)), {"num_target_layers": 8}
        self.samples = {i: {"aux": torch.randn(n, n_aux * H, generator=g).to(torch.bfloat16),
                            "final": torch.randn(n, H, generator=g).to(torch.bfloat16),
                            "input_ids": torch.randint(0, 100, (n,), generator=g, dtype=torch.int32),
                            "loss_mask": (torch.rand(n, generator=g) > 0.5).to(torch.uint8)}
                        for i, n in enumerate(lengths)}

    def get(self, i):
        return self.samples[i]

    def read_parts(self, ids, max_tokens):  # StoreReader's, as training reads it (a StateSource's)
        parts = [{k: v[:max_tokens] for k, v in self.get(i).items()} for i in ids]
        return [int(p["input_ids"].shape[0]) for p in parts], parts


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the pinned host path)"))])
def test_load_batch_packs_documents_with_their_positions(device):
    from eaglet.training.data import load_batch

    store = _Samples([5, 3, 9])
    b = load_batch(store, [2, 0, 1], max_tokens=7, device=torch.device(device))  # sample 2 cut at 7
    cut = [store.get(i) for i in (2, 0, 1)]
    cut = [{k: v[:7] for k, v in s.items()} for s in cut]
    assert b.tokens == 7 + 5 + 3
    torch.testing.assert_close(b.aux.cpu(), torch.cat([s["aux"] for s in cut])[None].float(), rtol=0, atol=0)
    assert torch.equal(b.final.cpu(), torch.cat([s["final"] for s in cut])[None])
    assert torch.equal(b.input_ids.cpu(), torch.cat([s["input_ids"] for s in cut])[None].long())
    assert torch.equal(b.loss_mask.cpu(), torch.cat([s["loss_mask"] for s in cut])[None].bool())
    assert b.position_ids.cpu().tolist() == [list(range(7)) + list(range(5)) + list(range(3))]
    assert b.doc_ids.cpu().tolist() == [[0] * 7 + [1] * 5 + [2] * 3]
    assert b.aux.device.type == device
    from eaglet.draft.eagle3.loss import active_rows, head_rows

    b = load_batch(store, [2, 0, 1], max_tokens=7, device=torch.device(device), cfg=_config(3))
    want = head_rows(b.loss_mask.cpu(), b.doc_ids.cpu(), 3)
    assert list(b.rows) == ["head_rows_0", "head_rows_1", "head_rows_2", "active_rows"]
    assert [b.rows[f"head_rows_{j}"].cpu().tolist() for j in range(3)] == [r.tolist() for r in want]
    assert b.rows["active_rows"].cpu().tolist() == active_rows(want).tolist()
    assert b.rows["active_rows"].device.type == device and 0 < len(b.rows["active_rows"]) < b.tokens


def test_freeze_survivors_collects_the_garbage_and_freezes_the_rest():
    """What survives the collection leaves the collector's reach (gc.freeze); what is garbage
    (a reference cycle) is collected first, not frozen for good."""
    import gc
    import weakref

    from eaglet.draft.step import freeze_survivors

    class Node:
        pass

    kept = [Node() for _ in range(1000)]
    cycle = Node()
    cycle.me = cycle
    dead = weakref.ref(cycle)
    del cycle
    gc.unfreeze()
    freeze_survivors()
    assert dead() is None
    assert gc.get_freeze_count() >= len(kept)


class _Failing(_Samples):
    def __init__(self, lengths, bad):
        super().__init__(lengths)
        self.bad = bad

    def get(self, i):
        if i == self.bad:
            raise CorruptDataError(f"store: sample {i}: shard checksum mismatch")
        return super().get(i)


def test_prefetch_reads_the_plan_ahead_on_its_thread_and_gives_what_load_batch_gives():
    """Prefetch reads the planned micro-batches in order on its own thread, at most `depth`
    ahead; each take gives what load_batch reads; a load off the plan is read at once, in the
    caller's thread, and the plan goes on; a read's error is raised by its micro-batch's take."""
    from eaglet.training.data import Prefetch, load_batch, read_batch, send_batch

    store = _Samples([5, 3, 9, 4, 6, 2, 7])
    plan = [[0, 1], [2], [3, 4, 5], [6], [1, 2]]
    reads, started = [], threading.Event()

    def read(ids):
        started.wait(5)  # nothing is read before the first take's check below
        reads.append((list(ids), threading.current_thread().name))
        return read_batch(store, ids, max_tokens=8, pin=False, cfg=_config(2))

    pre = Prefetch(read, plan, depth=2)
    try:
        assert reads == []
        started.set()
        for k, ids in enumerate(plan):
            if k == 2:  # off the plan: read here, now
                got = send_batch(pre.take([4]), torch.device("cpu"))
                # the thread may read on meanwhile (its reads are not ordered against this one)
                mine = [r for r, name in reads if name == threading.current_thread().name]
                assert mine == [[4]] and pre.off_plan == 1
                assert got.sample_ids == (4,)
            got = send_batch(pre.take(ids), torch.device("cpu"))
            want = load_batch(store, ids, max_tokens=8, device=torch.device("cpu"), cfg=_config(2))
            for key in ("aux", "final", "input_ids", "loss_mask", "position_ids", "doc_ids"):
                assert torch.equal(getattr(got, key), getattr(want, key)), (k, key)
            assert got.rows.keys() == want.rows.keys()
            assert all(torch.equal(got.rows[key], want.rows[key]) for key in want.rows)
            assert got.sample_ids == tuple(ids) and got.tokens == want.tokens
            planned = [r for r, name in reads if name.startswith("eaglet-prefetch")]
            assert planned == plan[:len(planned)] and len(planned) <= k + 1 + 2  # in order, at most 2 ahead
    finally:
        pre.close()
    assert [r for r, name in reads if name.startswith("eaglet-prefetch")] == plan

    bad = _Failing([5, 3, 9], bad=2)
    pre = Prefetch(lambda ids: read_batch(bad, ids, max_tokens=8, pin=False), [[0], [2], [1]], depth=2)
    try:
        assert pre.take([0]).ids == (0,)
        with pytest.raises(CorruptDataError, match="sample 2: shard checksum mismatch"):
            pre.take([2])
        assert pre.take([1]).ids == (1,)
    finally:
        pre.close()


def test_prefetch_thread_takes_the_index_of_the_gpu_it_reads_for(monkeypatch):
    """On a GPU the reading thread makes this rank's device current, by index: the trainer's
    single-GPU device is torch.device("cuda"), which has none (set_device refuses it), so the
    thread takes the device current where Prefetch is made. (A stand-in for CUDA's calls.)"""
    from torch.cuda._utils import _get_device_index

    from eaglet.training.data import Prefetch

    made_current = []

    def set_device(d):
        made_current.append((_get_device_index(d), threading.current_thread().name))

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for device, want in ((torch.device("cuda"), 3), (torch.device("cuda", 1), 1)):
        made_current.clear()
        pre = Prefetch(lambda ids: list(ids), [[0], [1]], depth=1, device=device)
        try:
            assert pre.take([0]) == [0] and pre.take([1]) == [1]
        finally:
            pre.close()
        assert [i for i, _ in made_current] == [want] and made_current[0][1].startswith("eaglet-prefetch")
    made_current.clear()
    pre = Prefetch(lambda ids: list(ids), [[0]], depth=1, device=torch.device("cpu"))
    assert pre.take([0]) == [0] and not made_current
    pre.close()


def test_training_reads_ahead_the_micro_batches_it_then_loads(tmp_path, monkeypatch):
    """A run with the store read ahead (train.prefetch, the default) logs the losses of a run
    reading each micro-batch when needed, bit for bit, evaluations between its steps, and took
    every load from the plan. (Reading ahead is for GPUs: here it is let run on the CPU.)"""
    from eaglet import pipeline
    from eaglet.config import load_config
    from eaglet.training import loop
    from eaglet.training import data as train_data
    from eaglet.testing import tiny

    assert not loop.reads_ahead(object.__new__(StoreReader), SimpleNamespace(prefetch=2), torch.device("cpu"))
    assert loop.reads_ahead(object.__new__(StoreReader), SimpleNamespace(prefetch=2), torch.device("cuda"))
    assert not loop.reads_ahead(object.__new__(StoreReader), SimpleNamespace(prefetch=0), torch.device("cuda"))
    monkeypatch.setattr(loop, "reads_ahead",
                        lambda store, train_cfg, device: isinstance(store, StoreReader) and train_cfg.prefetch > 0)

    off_plan = []
    close = train_data.Prefetch.close

    def counted_close(self):
        off_plan.append(self.off_plan)
        close(self)

    monkeypatch.setattr(train_data.Prefetch, "close", counted_close)
    target = tiny.save_target(tmp_path / "target", family="llama", template="chatml")
    data = tiny.write_jsonl(tmp_path / "data.jsonl", tiny.make_conversations(60, seed=3))
    common = [f"target.path={target}", "target.dtype=float32", "target.device=cpu", f"prepare.data=[{data}]",
              "prepare.max_length=128", "extract.store_dtype=float32", "vocab.size=128", "train.device=cpu",
              "train.max_steps=6", "train.max_tokens=256", "train.ttt_steps=2", "train.log_every=1",
              "train.eval_every=2", "train.tensorboard=false", "train.compile=off", "train.eval_fraction=0.2",
              "train.ckpt_every=2"]
    logs = {}
    for n in (0, 2):
        pipeline.run_all(load_config(None, [f"run.dir={tmp_path / f'run{n}'}", f"train.prefetch={n}", *common]),
                         upto="train")
        logs[n] = [json.loads(x) for x in (tmp_path / f"run{n}" / "train" / "log.jsonl").read_text().splitlines()]
    assert off_plan == [0]  # one run read ahead, and every load was the one planned
    drop = ("tokens_per_s", "memory_gib")

    def same(log):
        return [{k: v for k, v in r.items() if k not in drop} for r in log]

    assert same(logs[2]) == same(logs[0])
    assert {r["split"] for r in logs[2]} == {"train", "eval"}

    # resumed mid-run (its last checkpoints and the stage's manifest gone), the run reads ahead
    # from where the checkpoint left off: the same log again
    ckpts = tmp_path / "run2" / "train" / "checkpoints"
    kept = sorted(p.name for p in ckpts.iterdir() if p.is_dir())
    for name in kept[1:]:
        shutil.rmtree(ckpts / name)
    (tmp_path / "run2" / "train" / "manifest.json").unlink()
    pipeline.run_all(load_config(None, [f"run.dir={tmp_path / 'run2'}", "train.prefetch=2", *common]), upto="train")
    stats = json.loads((tmp_path / "run2" / "train" / "manifest.json").read_text())["stats"]
    assert 0 < stats["started_at_step"] < 6 and off_plan == [0, 0]
    resumed = [json.loads(x) for x in (tmp_path / "run2" / "train" / "log.jsonl").read_text().splitlines()]
    assert same(resumed) == same(logs[0])
