"""Training data order: packing, the held-out split, and the micro-batch stream."""

from itertools import islice
from types import SimpleNamespace

import numpy as np

from eaglet.train import Trainer, epoch_plan, pack, split_ids


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
    fake = SimpleNamespace(train_ids=ids, lengths=lengths, cfg=SimpleNamespace(run=SimpleNamespace(seed=0)),
                           tc=SimpleNamespace(max_tokens=512, grad_accum=1), steps_per_epoch=max(counts), micro_per_step=1)
    stream = list(islice(Trainer.micro_batches(fake, 0, 0), sum(counts)))
    seen = [(e, i) for e, i, _ in stream]
    assert len(seen) == len(set(seen)) == sum(counts)
    for e, i, batch in stream:
        assert batch == epoch_plan(ids, lengths, 512, 0, e)[i]
