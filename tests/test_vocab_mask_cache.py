"""The out-of-vocabulary mask's verdicts kept per sample (eaglet.training.data.VocabMaskCache): after a
sample's first teacher pass, the teacher runs over the draft columns only, and training is
the same as when every pass computes the full-vocabulary argmax."""

import numpy as np
import pytest
import torch

import eaglet.draft.step as step_mod
from conftest import tiny_pipeline_upto_vocab, train_on_copy
from eaglet.training.data import VocabMaskCache
from eaglet.draft.step import Batch


def _batch(ids, lens):
    n = sum(lens)
    z = torch.zeros(1, n)
    return Batch(aux=z, final=z, input_ids=torch.zeros(1, n, dtype=torch.int64), loss_mask=z.bool(), position_ids=z,
                 doc_ids=z, tokens=n, sample_ids=tuple(ids), lens=tuple(lens))


def test_cache_round_trip():
    cache = VocabMaskCache(enabled=True)
    rng = np.random.default_rng(0)
    flags = torch.from_numpy(rng.random(5 + 11 + 3) < 0.7).unsqueeze(0)
    b = _batch([4, 9, 2], [5, 11, 3])
    assert cache.lookup(b) is None  # nothing known yet
    cache.record(b, flags)
    assert torch.equal(cache.lookup(b), flags)
    # the same samples packed in another order, with one it has not seen, cut shorter
    assert torch.equal(cache.lookup(_batch([2, 4], [3, 5])), torch.cat([flags[:, 16:], flags[:, :5]], dim=1))
    assert cache.lookup(_batch([2, 7], [3, 4])) is None
    assert cache.lookup(_batch([9], [8])) is None  # another cut of sample 9
    known = _batch([2], [3])
    known.in_vocab = flags[:, 16:]
    cache.record(known, ~flags[:, 16:])  # a batch that used a known verdict is not recorded again
    assert torch.equal(cache.lookup(_batch([2], [3])), flags[:, 16:])
    off = VocabMaskCache(enabled=False)
    off.record(b, flags)
    assert off.lookup(b) is None


@pytest.fixture(scope="module")
def store_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vmc")
    return tmp, tiny_pipeline_upto_vocab(tmp, 48, 5, [
        "run.seed=7", "extract.store_dtype=float32", "vocab.size=150", "train.epochs=3", "train.max_tokens=256",
        "train.ttt_steps=2", "train.log_every=1", "train.eval_every=4", "train.ckpt_every=1000",
        "train.attn_impl=chunked", "train.eval_fraction=0.15"])


def _train(tmp, base, name, monkeypatch, cached):
    calls = {"full": 0, "draft": 0, "masked": 0}
    real = step_mod.teacher_targets

    def counting(*a, full_vocab=True, **k):
        calls["full" if full_vocab else "draft"] += 1
        out = real(*a, full_vocab=full_vocab, **k)
        calls["masked"] += int((~out[1]).sum())
        return out

    with monkeypatch.context() as m:
        m.setattr(step_mod, "teacher_targets", counting)
        if not cached:
            m.setattr(VocabMaskCache, "lookup", lambda self, b: None)
        _, log = train_on_copy(tmp, base, name)
    return log, calls


def test_training_with_known_verdicts_is_training_without(store_run, monkeypatch):
    tmp, base = store_run
    want, plain = _train(tmp, base, "plain", monkeypatch, cached=False)
    got, cached = _train(tmp, base, "cached", monkeypatch, cached=True)
    assert plain["draft"] == 0 and plain["full"] == cached["full"] + cached["draft"]
    # epoch 0 and the first evaluation find the verdicts; epochs 1 and 2 and later evaluations reuse them
    assert cached["draft"] > cached["full"] > 0
    assert len(got) == len(want) > 6
    for g, w in zip(got, want):
        assert (g["split"], g["step"]) == (w["split"], w["step"])
        for k in ("loss", "loss_0", "loss_1", "acc_0", "acc_1", "counted"):
            assert g[k] == pytest.approx(w[k], rel=1e-6, abs=1e-7), (g["split"], g["step"], k)
    assert plain["masked"] > 0  # the mask does drop rows here (what the verdicts carry over)


def _share_worker(rank, world, init, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        cache = VocabMaskCache(enabled=True)
        mine = _batch([10 + rank], [6])
        cache.record(mine, torch.tensor([[True, False, True, True, False, rank == 1]]))
        cache.share()
        got = [cache.lookup(_batch([10 + r], [6])) for r in range(world)]
        torch.save([g.tolist() for g in got], f"{out}/{rank}.pt")
        cache.share()  # nothing new: still every rank's
        assert all(cache.lookup(_batch([10 + r], [6])) is not None for r in range(world))
    finally:
        dist.destroy_process_group()


def test_ranks_share_their_verdicts(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_share_worker, args=(2, f"file://{tmp_path}/pg", str(tmp_path)), nprocs=2)
    want = [[[True, False, True, True, False, False]], [[True, False, True, True, False, True]]]
    for rank in range(2):
        assert torch.load(tmp_path / f"{rank}.pt", weights_only=True) == want
