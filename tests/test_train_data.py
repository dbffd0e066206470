"""Training data order: packing, the held-out split, the micro-batch stream, and the packed batch."""

from itertools import islice
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eaglet.stages.train import Trainer
from eaglet.stages.train_data import epoch_plan, pack, split_ids


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
                           tc=SimpleNamespace(max_tokens=512, grad_accum=1), steps_per_epoch=max(counts), micro_per_step=1)
    stream = list(islice(Trainer.micro_batches(fake, 0, 0), sum(counts)))
    seen = [(e, i) for e, i, _ in stream]
    assert len(seen) == len(set(seen)) == sum(counts)
    for e, i, batch in stream:
        assert batch == epoch_plan(ids, lengths, 512, 0, e)[i]


class _Samples:
    """A stand-in store: `get` as StoreReader's, from tensors in memory."""

    def __init__(self, lengths, H=4, n_aux=3, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.samples = {i: {"aux": torch.randn(n, n_aux * H, generator=g).to(torch.bfloat16),
                            "final": torch.randn(n, H, generator=g).to(torch.bfloat16),
                            "input_ids": torch.randint(0, 100, (n,), generator=g, dtype=torch.int32),
                            "loss_mask": (torch.rand(n, generator=g) > 0.5).to(torch.uint8)}
                        for i, n in enumerate(lengths)}

    def get(self, i):
        return self.samples[i]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the pinned host path)"))])
def test_load_batch_packs_documents_with_their_positions(device):
    from eaglet.stages.train_data import load_batch

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
    from eaglet.draft.loss import active_rows, head_rows

    b = load_batch(store, [2, 0, 1], max_tokens=7, device=torch.device(device), ttt_steps=3)
    want = head_rows(b.loss_mask.cpu(), b.doc_ids.cpu(), 3)
    assert [r.cpu().tolist() for r in b.head_rows] == [r.tolist() for r in want]
    assert b.active_rows.cpu().tolist() == active_rows(want).tolist()
    assert b.active_rows.device.type == device and 0 < len(b.active_rows) < b.tokens


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
