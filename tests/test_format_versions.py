"""Format versions (eaglet/formats/version.py): the store, a checkpoint and prepared data record
theirs; one of another version, or of none, is refused in one line naming its folder and the
command that writes it afresh, whether its checksums still match or not; this version's reads
back. (The manifest's: tests/test_pipeline.py.)"""

import json

import numpy as np
import pytest
import torch

from eaglet.errors import FormatVersionError
from eaglet.formats import checkpoints as ck
from eaglet.formats.checked import CHECKSUMS, digest, update_sums
from eaglet.formats.prepared import INDEX as PREPARED_INDEX, PreparedData, PreparedWriter
from eaglet.formats.store import INDEX as STORE_INDEX, StoreReader, StoreWriter, open_verified
from eaglet.formats.version import CHECKPOINT_VERSION, PREPARED_VERSION, STORE_VERSION

H = 4


def _store(folder):
    w = StoreWriter(folder, {"input_hash": "h", "hidden_size": H, "n_aux": 1, "layers": [1], "dtype": "float32",
                             "final_state": "post_norm"}, shard_bytes=1 << 20, queue_size=1, fsync=False)
    for sid in range(3):
        w.add(sid, torch.ones(2, H) * sid, torch.zeros(2, H), torch.arange(2, dtype=torch.int32),
              torch.ones(2, dtype=torch.uint8))
    w.close()
    return folder


def _checkpoint(folder):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return ck.save_checkpoint(folder / "checkpoints", 3, model.state_dict(), opt.state_dict(), sched.state_dict(),
                              {"fingerprint": {}}, 1)


def _prepared(folder):
    w = PreparedWriter(folder, ["a.jsonl"], shard_samples=2)
    for k in range(3):
        w.add(np.arange(4), np.ones(4), 0, k)
    w.close()
    return folder


def _store_meta(folder):
    return folder / STORE_INDEX, ("meta",)


def _state(folder):
    return folder / ck.STATE_FILE, ()


def _prepared_index(folder):
    return folder / PREPARED_INDEX, ()


# format -> (write one: its folder, the file and key path holding the version, read it back, what, the fix)
FORMATS = {
    "store": (_store, _store_meta, lambda f: open_verified(f), STORE_VERSION, "the store",
              "extract it afresh with `eaglet extract CONFIG --force`"),
    "checkpoint": (_checkpoint, _state, lambda f: ck.newest_intact(f.parent, "cpu"), CHECKPOINT_VERSION,
                   "the checkpoint", "start training afresh with `eaglet train CONFIG --force` (or remove {parent})"),
    "prepared": (_prepared, _prepared_index, lambda f: PreparedData(f), PREPARED_VERSION, "the prepared data",
                 "prepare it afresh with `eaglet prepare CONFIG --force`"),
}


def _set_version(path, keys, version, relist):
    data = json.loads(path.read_text())
    holder = data
    for key in keys:
        holder = holder[key]
    if version is None:
        del holder["format_version"]
    else:
        holder["format_version"] = version
    path.write_text(json.dumps(data))
    if relist:  # its checksums still match: only the version differs
        if path.name == ck.STATE_FILE:
            sums = json.loads((path.parent / ck.CHECKSUM_FILE).read_text())
            sums["files"][path.name] = {"sha256": digest(path.read_bytes())["sha256"], "bytes": path.stat().st_size}
            (path.parent / ck.CHECKSUM_FILE).write_text(json.dumps(sums))
        else:
            update_sums(path.parent, {path.name: digest(path.read_bytes())})


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_this_version_is_written_and_reads_back(tmp_path, fmt):
    write, where, read, version, _, _ = FORMATS[fmt]
    folder = write(tmp_path / fmt)
    path, keys = where(folder)
    holder = json.loads(path.read_text())
    for key in keys:
        holder = holder[key]
    assert holder["format_version"] == version
    read(folder)


@pytest.mark.parametrize("relist", [True, False], ids=["checksums match", "checksums differ"])
@pytest.mark.parametrize("version", [None, 0, 2], ids=["none", "older", "newer"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_another_version_is_refused_in_one_line(tmp_path, fmt, version, relist):
    write, where, read, want, what, fix = FORMATS[fmt]
    folder = write(tmp_path / fmt)
    if version == want:
        version += 1
    path, keys = where(folder)
    _set_version(path, keys, version, relist)
    with pytest.raises(FormatVersionError) as e:
        read(folder)
    was = ("has no format version (written before eaglet's formats had one)" if version is None
           else f"is format version {version}")
    assert e.value.exit_code == 4
    assert e.value.line() == (f"{what} in {folder} {was}; this eaglet reads version {want} and converts no other; "
                              + fix.format(parent=folder.parent))


def test_a_store_read_unverified_is_refused_too(tmp_path):
    """The reader online training opens (no shard checksums) checks the version as well."""
    folder = _store(tmp_path / "store")
    _set_version(folder / STORE_INDEX, ("meta",), None, relist=True)
    with pytest.raises(FormatVersionError):
        StoreReader(folder, verify=False)
    assert (folder / CHECKSUMS).is_file()


@pytest.mark.parametrize("fmt", ["store", "prepared"])
def test_an_output_from_before_checksums_and_versions_is_refused_by_its_version(tmp_path, fmt):
    """No checksums.json and no version (an eaglet before both): the version error, not 'damaged'."""
    write, where, read, _, what, _ = FORMATS[fmt]
    folder = write(tmp_path / fmt)
    path, keys = where(folder)
    _set_version(path, keys, None, relist=False)
    (folder / CHECKSUMS).unlink()
    with pytest.raises(FormatVersionError, match=f"^{what} in .* has no format version"):
        read(folder)
