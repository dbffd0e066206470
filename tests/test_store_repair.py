"""The store checked before use and repaired by extract: training names a corrupt shard, with the
command that repairs it, before it reads a sample; `extract` on an existing store (a rerun, or
`--force` on a finished one) re-extracts exactly the samples of bad or missing shards, keeps
every other shard's file as it was, and ends bit for bit equal to the store it repairs."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

from conftest import tiny_pipeline_upto_vocab
from eaglet import cli, pipeline
from eaglet.config import load_config
from eaglet.formats.store import INDEX, StoreReader, open_verified

pytestmark = pytest.mark.usefixtures("one_thread")

# 24 samples in 8 shards of 2-5 samples; batches of up to 4 samples (padding: a sample's states
# depend on its batch mates, so only the same batch gives the same bits).
OVERRIDES = ["extract.shard_mb=0.15", "extract.max_batch_size=4", "extract.batch_tokens=512",
             "train.max_tokens=256", "train.ttt_steps=2", "train.log_every=1", "train.eval_every=0",
             "train.attn_impl=chunked", "train.tensorboard=false", "vocab.size=128"]


@pytest.fixture(scope="module")
def store_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("repair")
    base = tiny_pipeline_upto_vocab(tmp, 24, 3, OVERRIDES)
    index = json.loads((tmp / "run" / "extract" / INDEX).read_text())
    assert index["num_shards"] == 8 and index["num_samples"] == 24
    return tmp, base


def _copy(store_run, name):
    tmp, base = store_run
    run = tmp / name
    shutil.copytree(tmp / "run", run)
    return run, load_config(None, [f"run.dir={run}", *base])


def _flip(path, at=0.6):
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x10  # one bit of the states, the size unchanged
    path.write_bytes(bytes(data))


def _files(store):
    """name -> (inode, mtime, sha256) of every shard and sidecar: a rewritten file changes."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(store.glob("shard-*"))}


def _assert_same_store(a: StoreReader, b: StoreReader):
    assert a.sample_ids.tolist() == b.sample_ids.tolist()
    for sid in a.sample_ids.tolist():
        x, y = a.get(sid), b.get(sid)
        for key in ("aux", "final", "input_ids", "loss_mask"):
            assert torch.equal(x[key], y[key]), (sid, key)


def _shard(store, k):
    return json.loads((store / INDEX).read_text())["shards"][k]


def test_training_names_a_corrupt_shard_before_it_reads_a_sample(store_run, monkeypatch, capsys):
    tmp, base = store_run
    run, _ = _copy(store_run, "train-corrupt")
    store = run / "extract"
    bad = _shard(store, 5)
    _flip(store / bad["file"])
    reads = []
    real_get = StoreReader.get
    monkeypatch.setattr(StoreReader, "get", lambda self, sid: reads.append(sid) or real_get(self, sid))
    config = tmp / "train-corrupt.yaml"
    config.write_text(f"run: {{dir: {run}}}\n")
    sets = [a for s in base for a in ("--set", s)]
    capsys.readouterr()
    rc = cli.main(["train", str(config), *sets])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 5, err[-5:]
    assert err[-1] == (f"eaglet: store {store}: 1 of 8 shards corrupt ({bad['file']}: sha256 mismatch); repair it "
                       f"with `eaglet extract CONFIG --force` (re-extracts its {bad['samples']} samples)")
    assert reads == []  # found before any sample was read: no step ran
    log = run / "train" / "log.jsonl"
    assert not log.exists() or log.read_text().strip() == ""
    assert not list((run / "train").glob("checkpoints/step-*"))


@pytest.mark.parametrize("how", ["force", "interrupted"])
def test_extract_re_extracts_exactly_the_samples_of_a_corrupt_shard(store_run, capsys, how):
    tmp, _ = store_run
    run, cfg = _copy(store_run, f"flip-{how}")
    store = run / "extract"
    bad = _shard(store, 2)
    side = json.loads((store / bad["file"]).with_suffix(".json").read_text())
    before = _files(store)
    _flip(store / bad["file"])
    if how == "interrupted":  # a rerun of an extraction that was killed: no manifest, no index
        (store / "manifest.json").unlink()
        (store / INDEX).unlink()
    capsys.readouterr()
    stats = pipeline.run_stage(cfg, "extract", force=how == "force", preflight=False)["stats"]
    err = capsys.readouterr().err
    assert (f"[extract] store verified: 7 of 8 shards intact; re-extracting the {bad['samples']} samples of "
            f"1 bad shard") in err
    assert f"[extract] {bad['file']}: sha256 mismatch; deleted" in err
    assert stats["bad_shards"] == [bad["file"]] and stats["missing_shards"] == []
    assert stats["repaired_samples"] == bad["samples"]
    assert stats["resumed_samples"] == 24 - bad["samples"] and stats["samples"] == 24
    assert stats["new_tokens"] == sum(side["lengths"])  # only that shard's samples were stored anew
    after = _files(store)
    kept = {f: v for f, v in before.items() if not f.startswith(bad["file"].removesuffix(".safetensors"))}
    assert {f: after.get(f) for f in kept} == kept  # every other shard and sidecar untouched
    assert bad["file"] not in after
    repaired = open_verified(store)
    _assert_same_store(repaired, StoreReader(tmp / "run" / "extract"))

    # --force on an intact store checks it and changes nothing
    stats = pipeline.run_stage(cfg, "extract", force=True, preflight=False)["stats"]
    assert "[extract] store verified: 8 of 8 shards intact" in capsys.readouterr().err
    assert stats["bad_shards"] == [] and stats["repaired_samples"] == 0 and stats["new_tokens"] == 0
    assert _files(store) == after


@pytest.mark.parametrize("lost", ["shard", "shard and sidecar"])
def test_extract_re_extracts_the_samples_of_a_missing_shard(store_run, capsys, lost):
    tmp, _ = store_run
    run, cfg = _copy(store_run, f"missing-{lost.replace(' ', '-')}")
    store = run / "extract"
    gone = _shard(store, 6)
    before = _files(store)
    (store / gone["file"]).unlink()
    if lost == "shard and sidecar":
        (store / gone["file"]).with_suffix(".json").unlink()
    capsys.readouterr()
    stats = pipeline.run_stage(cfg, "extract", force=True, preflight=False)["stats"]
    err = capsys.readouterr().err
    assert (f"[extract] store verified: 7 of 8 shards intact; re-extracting the {gone['samples']} samples of "
            f"1 missing shard") in err
    assert stats["missing_shards"] == [gone["file"]] and stats["bad_shards"] == []
    assert stats["repaired_samples"] == gone["samples"] and stats["resumed_samples"] == 24 - gone["samples"]
    after = _files(store)
    stem = gone["file"].removesuffix(".safetensors")
    assert {f: after.get(f) for f in before if not f.startswith(stem)} == {
        f: v for f, v in before.items() if not f.startswith(stem)}
    _assert_same_store(open_verified(store), StoreReader(tmp / "run" / "extract"))


@pytest.mark.parametrize("how", ["deleted", "damaged"])
def test_a_lost_store_json_reruns_extract_which_keeps_every_shard(store_run, capsys, how):
    """store.json deleted or damaged: `eaglet run` sees the output gone or resized and runs
    extract again, which keeps every shard (index.json says they are these inputs'), writes
    store.json again and extracts nothing (it deleted every shard before)."""
    tmp, _ = store_run
    run, cfg = _copy(store_run, f"store-json-{how}")
    store = run / "extract"
    before = _files(store)
    if how == "deleted":
        (store / "store.json").unlink()
    else:
        (store / "store.json").write_text("{")
    capsys.readouterr()
    manifests = pipeline.run_all(cfg, upto="extract", preflight=False)
    err = capsys.readouterr().err
    assert f"[extract] output {store}/store.json: " in err and "running the stage again" in err, err
    assert "index.json describes these same inputs: keeping its 8 shard files and writing store.json again" in err
    assert "[extract] store verified: 8 of 8 shards intact" in err and "clearing" not in err
    stats = manifests[1]["stats"]
    assert stats["resumed_samples"] == 24 and stats["new_tokens"] == 0 and stats["samples"] == 24
    assert _files(store) == before
    _assert_same_store(open_verified(store), StoreReader(tmp / "run" / "extract"))


def test_an_extraction_cut_short_without_store_json_or_checksums_stops_in_one_line(store_run, capsys):
    """Killed mid-extraction (no index.json), then store.json and checksums.json lost: nothing
    says what the shards hold, so `eaglet extract` stops (exit 5) naming store.json and the shard
    files it keeps, and deletes none."""
    tmp, base = store_run
    run, _ = _copy(store_run, "cut-short-lost")
    store = run / "extract"
    for name in ("manifest.json", INDEX, "store.json", "checksums.json"):
        (store / name).unlink()
    before = _files(store)
    config = tmp / "cut-short-lost.yaml"
    config.write_text(f"run: {{dir: {run}}}\n")
    capsys.readouterr()
    rc = cli.main(["extract", str(config), *[a for s in base for a in ("--set", s)], "--skip-preflight"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 5 and line == (
        f"eaglet: store.json of the store in {store} is missing and no index.json says what its 8 shard files hold "
        f"(an extraction cut short, or index.json lost too); they are kept, unread; restore {store / 'store.json'} "
        f"(it describes the inputs the shards were extracted from), or delete {store} to extract afresh"), line
    assert _files(store) == before
