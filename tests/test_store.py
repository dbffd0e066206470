"""The hidden-state store on synthetic tensors: round trip, corruption, resume debris, errors."""

from __future__ import annotations

import hashlib
import json
import pickle
import threading
import time

import pytest
import torch

import eaglet.formats.store as store_mod
from eaglet import cli
from eaglet.errors import CorruptDataError
from eaglet.formats.checked import CHECKSUMS
from eaglet.formats.store import (INDEX, STORE_META, CorruptShardError, StoreReader, StoreWriter, described,
                                  open_verified, prepare_folder, resume_folder, write_safetensors)
from eaglet.formats.version import STORE_VERSION

H, N_AUX = 8, 3


def _meta(dtype: str = "float32", input_hash: str = "h1") -> dict:
    return {"input_hash": input_hash, "hidden_size": H, "n_aux": N_AUX, "layers": [2, 4, 5],
            "dtype": dtype, "final_state": "post_norm"}


def _samples(n: int, dtype: torch.dtype = torch.float32, seed: int = 0, first_id: int = 0) -> dict[int, dict]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k in range(n):
        T = int(torch.randint(1, 30, (1,), generator=g))
        out[first_id + 3 * k] = {  # sparse, non-contiguous ids
            "aux": torch.randn(T, N_AUX * H, generator=g).to(dtype),
            "final": torch.randn(T, H, generator=g).to(dtype),
            "input_ids": torch.randint(0, 1000, (T,), generator=g, dtype=torch.int32),
            "loss_mask": torch.randint(0, 2, (T,), generator=g, dtype=torch.uint8),
        }
    return out


def _write(folder, samples: dict[int, dict], dtype: str = "float32", shard_bytes: int = 4000, **kw) -> dict:
    w = StoreWriter(folder, _meta(dtype, **kw), shard_bytes=shard_bytes, queue_size=1, fsync=False)
    for sid, s in samples.items():
        w.add(sid, s["aux"], s["final"], s["input_ids"], s["loss_mask"])
    return w.close()


def _assert_same(reader: StoreReader, samples: dict[int, dict]) -> None:
    assert sorted(reader.sample_ids.tolist()) == sorted(samples)
    for sid, s in samples.items():
        got = reader.get(sid)
        for key in ("aux", "final", "input_ids", "loss_mask"):
            assert got[key].dtype == s[key].dtype, key
            assert torch.equal(got[key], s[key]), (sid, key)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip(tmp_path, dtype):
    samples = _samples(25, getattr(torch, dtype))
    index = _write(tmp_path, samples, dtype)
    assert index["num_shards"] > 3  # several shards, so lookups cross shard boundaries
    assert index["num_samples"] == 25
    assert index["num_tokens"] == sum(s["input_ids"].shape[0] for s in samples.values())
    reader = StoreReader(tmp_path)
    assert len(reader) == 25
    assert reader.sample_ids.tolist() == sorted(samples)
    assert reader.lengths.tolist() == [samples[i]["input_ids"].shape[0] for i in sorted(samples)]
    _assert_same(reader, samples)
    report = reader.verify_all()
    assert report["ok"] == report["shards"] == index["num_shards"] and report["bad"] == []
    side = json.loads((tmp_path / "shard-r0-000000.json").read_text())
    assert side["file"] == "shard-r0-000000.safetensors"
    assert side["bytes"] == (tmp_path / side["file"]).stat().st_size
    with pytest.raises(KeyError):
        reader.get(1)  # ids are multiples of 3


def test_corrupted_shard_is_named(tmp_path):
    samples = _samples(25)
    _write(tmp_path, samples)
    reader = StoreReader(tmp_path)
    bad = reader.shards[1]
    path = tmp_path / bad["file"]
    data = bytearray(path.read_bytes())
    data[-20:-10] = bytes(b ^ 0xFF for b in data[-20:-10])  # flip payload bytes, size unchanged
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match=bad["file"]):
        reader.get(bad["sample_ids"][0])
    good = reader.shards[0]["sample_ids"][0]
    assert torch.equal(reader.get(good)["aux"], samples[good]["aux"])
    report = StoreReader(tmp_path).verify_all()
    assert [b["file"] for b in report["bad"]] == [bad["file"]]
    assert report["ok"] == report["shards"] - 1


def test_truncated_shard_is_named(tmp_path):
    _write(tmp_path, _samples(25))
    reader = StoreReader(tmp_path, verify=False)  # the size check runs even without checksums
    bad = reader.shards[2]
    path = tmp_path / bad["file"]
    path.write_bytes(path.read_bytes()[: bad["bytes"] // 2])
    with pytest.raises(CorruptShardError, match=f"{bad['file']}.*truncated"):
        reader.get(bad["sample_ids"][-1])
    assert [b["file"] for b in reader.verify_all()["bad"]] == [bad["file"]]


def test_reader_needs_finished_store(tmp_path):
    """An extraction not finished (index.json gone and unlisted: prepare_folder drops it from
    checksums.json as an extraction starts) is no store; a finished store's index.json deleted is
    a missing file, named with the command that writes it again."""
    _write(tmp_path, _samples(5))
    (tmp_path / INDEX).unlink()
    with pytest.raises(CorruptDataError) as e:
        StoreReader(tmp_path)
    assert e.value.line() == f"missing file {tmp_path / INDEX}; repair it with `eaglet extract CONFIG --force`"
    prepare_folder(tmp_path, _meta(), fsync=False)  # an extraction begun (then killed)
    assert INDEX not in json.loads((tmp_path / CHECKSUMS).read_text())["files"]
    with pytest.raises(FileNotFoundError, match=INDEX):
        StoreReader(tmp_path)


def test_resume_removes_debris_and_completes(tmp_path):
    samples = _samples(30)
    ref = tmp_path / "ref"
    _write(ref, samples)
    folder = tmp_path / "store"
    _write(folder, samples)
    # Make it look like a run killed mid-way: no index, the last shard written but its sidecar
    # not yet, a stray temporary, and a sidecar whose shard vanished.
    (folder / INDEX).unlink()
    shards = sorted(folder.glob("shard-r0-*.safetensors"))
    orphan = shards[-1]
    orphan.with_suffix(".json").unlink()
    lost = shards[-2]
    lost.unlink()
    tmp = folder / ".shard-r0-000099.safetensors.x1y2.tmp"
    tmp.write_bytes(b"partial")
    unrelated = folder / "manifest.json.notes"
    unrelated.write_text("keep me")

    w = StoreWriter(folder, _meta(), shard_bytes=4000, queue_size=1, fsync=False)
    done = w.done_ids()
    kept = [json.loads(p.with_suffix(".json").read_text()) for p in shards[:-2]]
    assert done == {i for side in kept for i in side["sample_ids"]}
    assert 0 < len(done) < len(samples)
    assert not orphan.exists() and not tmp.exists() and not lost.with_suffix(".json").exists()
    assert unrelated.exists()
    for sid, s in samples.items():
        if sid not in done:
            w.add(sid, s["aux"], s["final"], s["input_ids"], s["loss_mask"])
    with pytest.raises(ValueError, match="already in the store"):
        sid = next(iter(done))
        w.add(sid, samples[sid]["aux"], samples[sid]["final"], samples[sid]["input_ids"], samples[sid]["loss_mask"])
    index = w.close()
    assert index["num_samples"] == len(samples)
    reader = StoreReader(folder)
    assert len(reader) == len(samples)  # no duplicates (the reader also refuses them)
    _assert_same(reader, samples)
    assert reader.verify_all()["bad"] == []


def test_other_input_hash_clears_store(tmp_path):
    _write(tmp_path, _samples(10))
    (tmp_path / "manifest.json").write_text("{}")  # not the store's: must survive
    w = StoreWriter(tmp_path, _meta(input_hash="h2"), shard_bytes=4000, fsync=False)
    assert w.done_ids() == set()
    assert list(tmp_path.glob("shard-*")) == [] and not (tmp_path / INDEX).exists()
    assert (tmp_path / "manifest.json").exists()
    assert json.loads((tmp_path / "store.json").read_text())["input_hash"] == "h2"
    new = _samples(3, seed=5)
    for sid, s in new.items():
        w.add(sid, s["aux"], s["final"], s["input_ids"], s["loss_mask"])
    w.close()
    _assert_same(StoreReader(tmp_path), new)


def test_add_checks_shapes_and_dtype(tmp_path):
    w = StoreWriter(tmp_path, _meta(), shard_bytes=1 << 20, fsync=False)
    s = _samples(1)[0]
    with pytest.raises(ValueError, match="shapes"):
        w.add(0, s["aux"][:, :H], s["final"], s["input_ids"], s["loss_mask"])
    with pytest.raises(ValueError, match="store holds"):
        w.add(0, s["aux"].half(), s["final"].half(), s["input_ids"], s["loss_mask"])
    w.add(0, s["aux"], s["final"], s["input_ids"], s["loss_mask"])
    w.close()


def test_writer_thread_error_reaches_caller(tmp_path, monkeypatch):
    def fail(self, k, pieces):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(StoreWriter, "_write_shard", fail)
    w = StoreWriter(tmp_path, _meta(), shard_bytes=100, queue_size=1, fsync=False)
    with pytest.raises(RuntimeError, match="disk full") as info:
        for sid, s in _samples(50).items():  # far more shards than the queue holds: must not hang
            w.add(sid, s["aux"], s["final"], s["input_ids"], s["loss_mask"])
        w.close()
    assert isinstance(info.value.__cause__, OSError)
    assert not (tmp_path / INDEX).exists()
    w.abort()  # safe after a failure


def test_streamed_shard_is_byte_identical_to_safetensors_save(tmp_path):
    """The writer streams pieces into the file; the bytes must be what safetensors itself writes."""
    from safetensors.torch import save

    g = torch.Generator().manual_seed(1)
    aux = [torch.randn(n, 6, generator=g).bfloat16() for n in (3, 1, 4)]
    ids = [torch.randint(0, 99, (n,), generator=g, dtype=torch.int32) for n in (3, 1, 4)]
    tensors = {"aux": (aux, [8, 6]), "input_ids": (ids, [8]), "offsets": ([torch.tensor([0, 3, 4, 8])], [4]),
               "loss_mask": ([torch.ones(8, dtype=torch.uint8)], [8]), "final": ([torch.randn(8, 2, generator=g)], [8, 2])}
    digest, size = write_safetensors(tmp_path / "x.safetensors", tensors, {"format": "f"}, fsync=False)
    expected = save({k: torch.cat(v[0]) for k, v in tensors.items()}, metadata={"format": "f"})
    data = (tmp_path / "x.safetensors").read_bytes()
    assert data == expected and size == len(data) and digest == hashlib.sha256(data).hexdigest()
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]  # no temporary left
    with pytest.raises(ValueError, match="aux"):
        write_safetensors(tmp_path / "y.safetensors", {"aux": (aux, [9, 6])}, {}, fsync=False)


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) * 2 // 3] ^= 0x01  # one bit of the states, the size unchanged
    path.write_bytes(bytes(data))


def test_verify_names_every_bad_shard_and_the_repair_command(tmp_path, monkeypatch):
    _write(tmp_path, _samples(25))
    shards = StoreReader(tmp_path).shards
    a, b = shards[1], shards[3]
    _flip(tmp_path / a["file"])
    (tmp_path / b["file"]).write_bytes((tmp_path / b["file"]).read_bytes()[:100])
    with pytest.raises(CorruptShardError) as info:
        open_verified(tmp_path, threads=3)
    assert info.value.exit_code == 5
    assert info.value.line() == (
        f"store {tmp_path}: 2 of {len(shards)} shards corrupt ({a['file']}: sha256 mismatch, {b['file']}: 100 bytes, "
        f"sidecar says {b['bytes']} (truncated or overwritten)); repair it with `eaglet extract CONFIG --force` "
        f"(re-extracts their {a['samples'] + b['samples']} samples)")


def test_verified_store_is_hashed_once_on_several_threads(tmp_path, monkeypatch):
    samples = _samples(25)
    _write(tmp_path, samples)
    hashed = []
    real = store_mod.sha256_file

    def counting(path, *args):
        hashed.append((path.name, threading.current_thread().name))
        time.sleep(0.02)  # long enough that the pool's threads overlap
        return real(path, *args)

    monkeypatch.setattr(store_mod, "sha256_file", counting)
    reader = open_verified(tmp_path, threads=4)
    files = sorted(s["file"] for s in reader.shards)
    assert sorted(name for name, _ in hashed) == files  # every shard, once
    assert len({thread for _, thread in hashed}) > 1
    _assert_same(reader, samples)  # reading every sample hashes nothing again
    assert len(hashed) == len(files)
    lazy = StoreReader(tmp_path)  # without the check up front: each shard on its first read
    _assert_same(lazy, samples)
    assert len(hashed) == 2 * len(files)


def test_resume_folder_deletes_bad_shards_and_names_missing_ones(tmp_path):
    samples = _samples(25)
    _write(tmp_path, samples)
    shards = StoreReader(tmp_path).shards
    bad, gone, orphan = shards[0], shards[2], shards[4]
    _flip(tmp_path / bad["file"])
    for f in (gone["file"], gone["file"].replace(".safetensors", ".json"), orphan["file"]):
        (tmp_path / f).unlink()
    check = resume_folder(tmp_path, _meta(), fsync=False, threads=2)
    assert [b["file"] for b in check.bad] == [bad["file"]] and check.bad[0]["error"] == "sha256 mismatch"
    assert [m["file"] for m in check.missing] == [gone["file"], orphan["file"]]
    assert check.intact == len(shards) - 3 and check.redo_samples == bad["samples"] + gone["samples"] + orphan["samples"]
    assert check.summary() == (f"store verified: {len(shards) - 3} of {len(shards)} shards intact; re-extracting the "
                               f"{check.redo_samples} samples of 1 bad and 2 missing shards")
    assert not (tmp_path / bad["file"]).exists() and not (tmp_path / bad["file"]).with_suffix(".json").exists()
    w = StoreWriter(tmp_path, _meta(), shard_bytes=4000, fsync=False, prepare=False)
    lost = set(bad["sample_ids"]) | set(gone["sample_ids"]) | set(orphan["sample_ids"])
    assert w.done_ids() == set(samples) - lost
    for sid in sorted(lost):
        s = samples[sid]
        w.add(sid, s["aux"], s["final"], s["input_ids"], s["loss_mask"])
    w.close()
    _assert_same(open_verified(tmp_path), samples)
    again = resume_folder(tmp_path, _meta(), fsync=False)
    assert again.bad == again.missing == [] and again.summary().endswith("shards intact")


@pytest.mark.parametrize("version", [None, STORE_VERSION + 1])
def test_a_store_of_another_format_version_is_cleared_not_resumed(tmp_path, version, capsys):
    """An extraction over a store whose store.json is of another format version (None: none)
    clears it as it clears a store made for other inputs: its shards are not resumed as this
    format's."""
    _write(tmp_path, _samples(12))
    meta = json.loads((tmp_path / STORE_META).read_text())
    if version is None:
        del meta["format_version"]
    else:
        meta["format_version"] = version
    (tmp_path / STORE_META).write_text(json.dumps(meta, indent=1))
    (tmp_path / CHECKSUMS).unlink()  # what store.json says is read, not its checksum
    capsys.readouterr()
    check = resume_folder(tmp_path, _meta(), fsync=False)
    assert "was made for other inputs (changed format_version)" in capsys.readouterr().err
    assert sorted(tmp_path.glob("shard-r*")) == [] and check.intact == 0
    assert json.loads((tmp_path / STORE_META).read_text()) == described(_meta())


# ---- store.json and index.json: checksummed, and a lost store.json never costs the shards ----------------


def _shard_files(folder) -> dict:
    """name -> (inode, mtime) of every shard and sidecar: a file deleted or written again changes."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(folder.glob("shard-r*"))}


def _sums(folder) -> dict:
    return json.loads((folder / CHECKSUMS).read_text())["files"]


def test_store_json_and_index_json_are_listed_in_checksums_json_as_written(tmp_path):
    """store.json is listed as an extraction starts, index.json when it ends (and dropped when
    the next begins), each with the sha256 of its bytes."""
    _write(tmp_path, _samples(5))
    sums = _sums(tmp_path)
    assert set(sums) == {STORE_META, INDEX}
    for name in (STORE_META, INDEX):
        data = (tmp_path / name).read_bytes()
        assert sums[name] == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert json.loads((tmp_path / STORE_META).read_text()) == described(_meta())


def _differs(path):  # still JSON, and what it says is another input's: only its checksum tells
    path.write_text(path.read_text().replace(f'"hidden_size": {H}', f'"hidden_size": {H + 1}'))


def _unlisted_and_cut(path):  # checksums.json lost, store.json cut
    (path.parent / CHECKSUMS).unlink()
    path.write_bytes(path.read_bytes()[:-7])


STORE_JSON_DAMAGE = {
    "deleted": (lambda p: p.unlink(), "missing"),
    "cut": (lambda p: p.write_bytes(p.read_bytes()[:-7]), "damaged ("),
    "changed": (_differs, f"damaged (sha256 differs from its {CHECKSUMS}: changed since it was written)"),
    "cut, checksums.json lost": (_unlisted_and_cut, "damaged (not readable: JSONDecodeError)"),
}


@pytest.mark.parametrize("how", list(STORE_JSON_DAMAGE))
def test_a_lost_or_damaged_store_json_keeps_the_shards_index_json_describes(tmp_path, how, capsys):
    """store.json deleted or damaged: the shards index.json describes as these same inputs' are
    kept, store.json written again, and the extraction goes on (before, every shard was deleted,
    "made for other inputs (no readable store.json)": GPU-hours lost for a 300-byte file)."""
    samples = _samples(25)
    _write(tmp_path, samples)
    before = _shard_files(tmp_path)
    damage, lost = STORE_JSON_DAMAGE[how]
    damage(tmp_path / STORE_META)
    capsys.readouterr()
    check = resume_folder(tmp_path, _meta(), fsync=False)
    err = capsys.readouterr().err
    shards = len([f for f in before if f.endswith(".safetensors")])
    assert f"[extract] {STORE_META} of the store in {tmp_path} is {lost}" in err, err
    assert (f"but {INDEX} describes these same inputs: keeping its {shards} shard files and writing {STORE_META} "
            "again") in err
    assert "clearing" not in err
    assert _shard_files(tmp_path) == before  # not one shard or sidecar deleted or written again
    assert check.intact == shards and check.bad == check.missing == []
    assert json.loads((tmp_path / STORE_META).read_text()) == described(_meta())
    assert _sums(tmp_path)[STORE_META]["sha256"] == hashlib.sha256((tmp_path / STORE_META).read_bytes()).hexdigest()
    w = StoreWriter(tmp_path, _meta(), shard_bytes=4000, fsync=False, prepare=False)
    assert w.done_ids() == set(samples)
    w.close()
    _assert_same(open_verified(tmp_path), samples)


def test_a_store_json_lost_mid_extraction_is_written_again_from_the_sha256_recorded(tmp_path, capsys):
    """No index.json yet (an extraction cut short), store.json deleted: the sha256 checksums.json
    recorded for it is that of today's store.json, so the shards are these inputs' and are kept."""
    samples = _samples(25)
    _write(tmp_path, samples)
    prepare_folder(tmp_path, _meta(), fsync=False)  # a rerun begun, then killed: no index.json
    (tmp_path / STORE_META).unlink()
    before = _shard_files(tmp_path)
    capsys.readouterr()
    resume_folder(tmp_path, _meta(), fsync=False)
    err = capsys.readouterr().err
    assert (f"{STORE_META} of the store in {tmp_path} is missing, but the sha256 its {CHECKSUMS} recorded for it "
            f"describes these same inputs: keeping its") in err, err
    assert _shard_files(tmp_path) == before
    w = StoreWriter(tmp_path, _meta(), shard_bytes=4000, fsync=False, prepare=False)
    assert w.done_ids() == set(samples)
    w.close()


@pytest.mark.parametrize("also", ["checksums.json lost", "other inputs now"])
def test_a_lost_store_json_with_nothing_to_say_what_the_shards_hold_stops_and_keeps_them(tmp_path, also):
    """store.json lost mid-extraction and nothing else says what the shards hold (checksums.json
    lost too, or its sha256 is not today's store.json's): one line, exit 5, naming store.json,
    the shard files kept and what to do; not a file is deleted."""
    _write(tmp_path, _samples(25))
    prepare_folder(tmp_path, _meta(), fsync=False)  # no index.json
    (tmp_path / STORE_META).unlink()
    if also == "checksums.json lost":
        (tmp_path / CHECKSUMS).unlink()
    before = _shard_files(tmp_path)
    with pytest.raises(CorruptDataError) as e:
        resume_folder(tmp_path, _meta(input_hash="h2" if also == "other inputs now" else "h1"), fsync=False)
    shards = len([f for f in before if f.endswith(".safetensors")])
    code, line = cli._error_line(e.value)
    assert code == 5 and line == (
        f"{STORE_META} of the store in {tmp_path} is missing and no {INDEX} says what its {shards} shard files hold "
        f"(an extraction cut short, or {INDEX} lost too); they are kept, unread; restore {tmp_path / STORE_META} (it "
        f"describes the inputs the shards were extracted from), or delete {tmp_path} to extract afresh")
    assert _shard_files(tmp_path) == before
    # under torchrun rank 0 runs prepare_folder alone and run_on_main sends its exception, pickled, to every rank
    again = pickle.loads(pickle.dumps(e.value))
    assert type(again) is type(e.value) and cli._error_line(again) == (code, line)


def test_a_lost_store_json_beside_an_index_of_other_inputs_clears_the_store(tmp_path, capsys):
    """index.json says the shards are another extraction's: cleared, as an intact store.json of
    other inputs clears them."""
    _write(tmp_path, _samples(10))
    (tmp_path / STORE_META).unlink()
    capsys.readouterr()
    check = resume_folder(tmp_path, _meta(input_hash="h2"), fsync=False)
    err = capsys.readouterr().err
    assert f"made for other inputs ({STORE_META} missing; its {INDEX}: input hash h1 -> h2); clearing" in err, err
    assert list(tmp_path.glob("shard-*")) == [] and check.intact == 0


def test_a_damaged_checksums_json_is_written_again_by_the_extraction(tmp_path, capsys):
    samples = _samples(10)
    _write(tmp_path, samples)
    (tmp_path / CHECKSUMS).write_text("{")
    before = _shard_files(tmp_path)
    capsys.readouterr()
    resume_folder(tmp_path, _meta(), fsync=False)
    assert f"[extract] {tmp_path / CHECKSUMS} is damaged: writing it again" in capsys.readouterr().err
    assert _shard_files(tmp_path) == before and set(_sums(tmp_path)) == {STORE_META}
    w = StoreWriter(tmp_path, _meta(), shard_bytes=4000, fsync=False, prepare=False)
    w.close()
    assert set(_sums(tmp_path)) == {STORE_META, INDEX}
    _assert_same(open_verified(tmp_path), samples)


def _not_a_store_index(path):
    index = json.loads(path.read_text())
    del index["meta"]
    path.write_text(json.dumps(index))
    sums = json.loads((path.parent / CHECKSUMS).read_text())  # listed as it is now: only the reader sees it
    sums["files"][INDEX] = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "bytes": path.stat().st_size}
    (path.parent / CHECKSUMS).write_text(json.dumps(sums))


INDEX_DAMAGE = {
    "flipped": (lambda p: p.write_bytes(p.read_bytes().replace(b'"num_samples": 25', b'"num_samples": 26')),
                f"sha256 differs from its {CHECKSUMS}"),
    "cut": (lambda p: p.write_bytes(p.read_bytes()[:-1]), "bytes, "),
    "unparsable": (lambda p: p.write_bytes(b"[" + p.read_bytes()[1:]), f"sha256 differs from its {CHECKSUMS}"),
    "not a store index": (_not_a_store_index, "not a store index: KeyError: 'meta'"),
}


@pytest.mark.parametrize("how", list(INDEX_DAMAGE))
def test_a_damaged_index_json_is_named_with_the_repair_command(tmp_path, how):
    """index.json is checked against checksums.json before training reads it (a damaged one was
    "no finished store" or a KeyError before, exit 70)."""
    _write(tmp_path, _samples(25))
    damage, why = INDEX_DAMAGE[how]
    damage(tmp_path / INDEX)
    with pytest.raises(CorruptDataError) as e:
        StoreReader(tmp_path)
    code, line = cli._error_line(e.value)
    assert code == 5 and line.startswith(f"damaged file {tmp_path / INDEX} (") and why in line, line
    assert line.endswith("; repair it with `eaglet extract CONFIG --force`"), line


def test_an_index_json_its_checksums_json_does_not_list_is_refused(tmp_path):
    """Every store eaglet writes lists index.json in its checksums.json: one that does not is
    another run's, refused in one line (no unverified read)."""
    _write(tmp_path, _samples(25))
    sums = json.loads((tmp_path / CHECKSUMS).read_text())
    del sums["files"][INDEX]
    (tmp_path / CHECKSUMS).write_text(json.dumps(sums))
    with pytest.raises(CorruptDataError) as e:
        StoreReader(tmp_path)
    assert e.value.line() == (f"damaged file {tmp_path / INDEX} (not listed in its {CHECKSUMS}: written by another "
                              "run); repair it with `eaglet extract CONFIG --force`")
