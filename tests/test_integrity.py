"""Every file eaglet writes and reads back is checked before use: a flipped bit, a damaged
safetensors header or JSON, a cut or a deleted file is named in one line, CorruptDataError
(exit 5), with the command that rebuilds it; a stage whose outputs are gone is not up to date;
a draft whose weights are not finite, or an eval.draft its engine would not load as written, is
refused. Files of a real tiny run (prepare to export), damaged one at a time."""

import hashlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_pipeline_upto_vocab
from eaglet import cli, pipeline
from eaglet.config import load_config
from eaglet.errors import CorruptDataError, InputError
from eaglet.formats import checked
from eaglet.formats.draft import load_final
from eaglet.formats.prepared import PreparedData
from eaglet.formats.serving import load_draft
from eaglet.formats.store import StoreReader, read_target_config
from eaglet.formats.vocab import load_vocab
from eaglet.evaluation.inputs import read_eval_draft

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = ["vocab.size=96", "train.max_tokens=256", "train.ttt_steps=2", "train.max_steps=2", "train.ckpt_every=2",
        "train.eval_every=0", "train.tensorboard=false", "train.device=cpu", "export.dtype=float32"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny run through export, and the overrides it was made with."""
    tmp = tmp_path_factory.mktemp("integrity")
    base = tiny_pipeline_upto_vocab(tmp, 12, 4, BASE)
    pipeline.run_all(load_config(None, [f"run.dir={tmp / 'run'}", *base]), upto="export")
    return tmp / "run", base


@pytest.fixture
def run(made, tmp_path):
    """A copy of the made run, to damage."""
    return shutil.copytree(made[0], tmp_path / "run")


def _head(run):
    return StoreReader(run / "extract", verify=False).target_head(torch.device("cpu"))


# file -> (the reader a later stage calls, the rebuild command its error must name)
READERS = {
    "prepare/data-00000.safetensors": (lambda run: PreparedData(run / "prepare"), "eaglet prepare CONFIG --force"),
    "prepare/index.json": (lambda run: PreparedData(run / "prepare"), "eaglet prepare CONFIG --force"),
    "extract/head.safetensors": (_head, "eaglet extract CONFIG --force"),
    "extract/target_config.json": (lambda run: read_target_config(run / "extract"), "eaglet extract CONFIG --force"),
    "extract/index.json": (lambda run: StoreReader(run / "extract", verify=False), "eaglet extract CONFIG --force"),
    "vocab/vocab.safetensors": (lambda run: load_vocab(run / "vocab"), "eaglet vocab CONFIG --force"),
    "train/final/model.safetensors": (lambda run: load_final(run / "train" / "final"), "eaglet train CONFIG"),
    "train/final/draft_config.json": (lambda run: load_final(run / "train" / "final"), "eaglet train CONFIG"),
    "export/vllm/model.safetensors": (lambda run: load_draft(run / "export" / "vllm"), "eaglet export CONFIG --force"),
    "export/vllm/config.json": (lambda run: load_draft(run / "export" / "vllm"), "eaglet export CONFIG --force"),
    "export/sglang/model.safetensors": (lambda run: load_draft(run / "export" / "sglang"),
                                        "eaglet export CONFIG --force"),
    "export/sglang/config.json": (lambda run: load_draft(run / "export" / "sglang"), "eaglet export CONFIG --force"),
}


def _data_offset(path, tensor):
    """Where tensor `tensor`'s bytes start in safetensors file `path`."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return 8 + n + json.loads(raw[8:8 + n])[tensor]["data_offsets"][0]


def _damage(path, how):
    """Damage file `path`: "flip" one bit of its data (a safetensors file's last byte, a tensor's;
    a JSON file's first digit made another: both still parse), "header" the opening brace of a
    safetensors header or of a JSON file (neither parses), "cut" its last byte, "gone" it."""
    raw = bytearray(path.read_bytes())
    if how == "gone":
        path.unlink()
        return
    if how == "cut":
        raw = raw[:-1]
    elif how == "header":
        raw[raw.index(b"{")] = ord("[")
    elif path.suffix == ".json":
        at = next(i for i, c in enumerate(raw) if chr(c).isdigit())
        raw[at] = ord("7") if raw[at] != ord("7") else ord("3")
    else:
        raw[-1] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["flip", "header", "cut", "gone"])
@pytest.mark.parametrize("name", list(READERS))
def test_a_damaged_file_is_named_with_the_command_that_rebuilds_it(run, name, how):
    """Each file a later stage reads, damaged four ways, is refused by that reader in one line:
    exit 5, the file's path, the command that rebuilds it. Before checksums, a flipped bit was
    read as data (a d2t flip ran through eval), a damaged header was SafetensorError or KeyError
    (exit 70), a missing file FileNotFoundError (exit 70)."""
    read, rebuild = READERS[name]
    read(run)  # intact: reads
    _damage(run / name, how)
    with pytest.raises(CorruptDataError) as e:
        read(run)
    code, line = cli._error_line(e.value)
    assert code == 5 and "\n" not in line, line
    assert str(run / name) in line and f"`{rebuild}" in line, line
    assert ("missing file" if how == "gone" else "damaged file") in line, line


@pytest.mark.parametrize("folder", sorted({n.rsplit("/", 1)[0] for n in READERS}))
def test_checksums_json_damaged_or_listing_another_run_is_refused(run, folder):
    """checksums.json itself: unreadable, or listing other sums than its files have, is refused."""
    name = next(n for n in READERS if n.rsplit("/", 1)[0] == folder)
    read, rebuild = READERS[name]
    sums = run / folder / "checksums.json"
    sums.write_text(sums.read_text()[:-5])
    with pytest.raises(CorruptDataError, match=f"damaged file {sums}.*{rebuild}"):
        read(run)


def test_the_manifests_list_every_output_with_its_sum_and_each_is_damaged_above(made):
    """Each manifest lists its stage's outputs with the sha256 and size they were written with;
    every listed file (but checksums.json, and the store's store.json, which only extraction
    reads: tests/test_store.py damages it) is one READERS damages, so an output added without a
    check fails here."""
    run, _ = made
    checked_here = set()
    for stage in ("prepare", "extract", "vocab", "train", "export", "eval"):
        outputs = json.loads((run / stage / "manifest.json").read_text())["outputs"] if stage != "eval" else {}
        for rel, want in outputs.items():
            data = (run / stage / rel).read_bytes()
            assert len(data) == want["bytes"], rel
            assert hashlib.sha256(data).hexdigest() == want["sha256"], rel
            if not rel.endswith("checksums.json") and (stage, rel) != ("extract", "store.json"):
                checked_here.add(f"{stage}/{rel}")
    assert checked_here == set(READERS)
    assert set(json.loads((run / "extract" / "manifest.json").read_text())["outputs"]) == {
        "store.json", "head.safetensors", "target_config.json", "index.json", "checksums.json"}  # shards: sidecars


def test_a_folder_eaglet_wrote_without_its_checksums_json_is_refused(run):
    """Every folder eaglet writes has its checksums.json: one without it is refused in one line
    naming it and the command that rebuilds it (no unverified read of eaglet's own outputs)."""
    (run / "vocab" / "checksums.json").unlink()
    with pytest.raises(CorruptDataError) as e:
        load_vocab(run / "vocab")
    assert e.value.line() == (f"missing file {run / 'vocab' / 'checksums.json'}; rebuild it with "
                              "`eaglet vocab CONFIG --force`")


def test_the_runs_own_export_without_its_checksums_json_is_refused_where_eval_serves_it(run):
    """The export an engine eval serves when eval.draft is unset is the run's own: without its
    checksums.json it is refused like any folder eaglet wrote (a draft from elsewhere need not
    have one)."""
    (run / "export" / "vllm" / "checksums.json").unlink()
    with pytest.raises(CorruptDataError) as e:
        read_eval_draft(str(run / "export" / "vllm"), own=True)
    assert e.value.line() == (f"missing file {run / 'export' / 'vllm' / 'checksums.json'}; export it again: "
                              "`eaglet export CONFIG --force` in the run that made it")
    read_eval_draft(str(run / "export" / "vllm"))  # the same folder named in eval.draft: read unverified


def test_a_damaged_header_in_a_draft_from_elsewhere_is_named_not_a_library_error(run, tmp_path):
    """A draft eaglet did not write (no checksums.json) is read unverified; a damaged header there
    is still CorruptDataError naming the file, not SafetensorError."""
    folder = tmp_path / "elsewhere"
    shutil.copytree(run / "export" / "vllm", folder)
    (folder / "checksums.json").unlink()
    _damage(folder / "model.safetensors", "header")
    with pytest.raises(CorruptDataError, match="damaged file .*model.safetensors .*not readable"):
        load_draft(folder)


def test_a_prepared_shard_with_broken_offsets_is_named(run):
    """A shard whose offsets do not cut its tokens (a writer's bug: its checksum matches) was an
    IndexError in extract."""
    path = run / "prepare" / "data-00000.safetensors"
    t = load_file(str(path))
    t["offsets"][3] = t["offsets"][-1] + 5
    save_file(t, str(path))
    checked.update_sums(run / "prepare", {path.name: checked.digest(path.read_bytes())})
    with pytest.raises(CorruptDataError, match="data-00000.safetensors .*offsets do not cut"):
        PreparedData(run / "prepare")


def _sets(run, base, *extra):
    return [a for s in [f"run.dir={run}", *base, *extra] for a in ("--set", s)]


def test_a_flipped_d2t_stops_train_with_exit_5(run, made, tmp_path, capsys):
    """The issue's first case through the command: one bit of d2t flipped."""
    path = run / "vocab" / "vocab.safetensors"
    d2t = load_file(str(path))["d2t"].clone()
    raw = bytearray(path.read_bytes())
    raw[_data_offset(path, "d2t") + 8 * 5] ^= 0x04  # the sixth draft id's offset, plus 4
    path.write_bytes(bytes(raw))
    assert not torch.equal(load_file(str(path))["d2t"], d2t)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}\n")
    rc = cli.main(["train", str(cfg), *_sets(run, made[1]), "--force", "--skip-preflight"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 5 and line.startswith(f"eaglet: damaged file {path} (sha256"), line
    assert line.endswith("rebuild it with `eaglet vocab CONFIG --force`"), line


def test_a_deleted_final_is_written_again_from_the_last_checkpoint(run, made, tmp_path, capsys):
    """`train/final/` deleted: `eaglet export` alone is refused naming it (it read as "up to date,
    skipped" before, then export failed with FileNotFoundError); `eaglet run` runs train again,
    which resumes from its last checkpoint and writes the same draft; export then reads it."""
    before = (run / "train" / "final" / "model.safetensors").read_bytes()
    shutil.rmtree(run / "train" / "final")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}\n")
    rc = cli.main(["export", str(cfg), *_sets(run, made[1])])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 5, line
    assert f"stage export needs stage train's output {run / 'train'}/final/" in line and ": missing" in line, line
    assert "run `eaglet train CONFIG`" in line, line

    manifests = pipeline.run_all(load_config(None, [f"run.dir={run}", *made[1]]), upto="export")
    err = capsys.readouterr().err
    assert f"[train] output {run / 'train'}/final/" in err and "missing; running the stage again" in err
    assert "[prepare] up to date" in err and "[vocab] up to date" in err
    assert manifests[3]["stats"]["steps_run"] == 0  # resumed at its last step: nothing trained again
    assert (run / "train" / "final" / "model.safetensors").read_bytes() == before
    assert load_final(run / "train" / "final")[0] is not None


def test_a_cut_output_makes_its_stage_run_again(run, made, capsys):
    """A listed output whose size changed (the plan reads no file: sizes only)."""
    path = run / "vocab" / "vocab.safetensors"
    path.write_bytes(path.read_bytes()[:-8])
    pipeline.run_all(load_config(None, [f"run.dir={run}", *made[1]]), upto="vocab")
    err = capsys.readouterr().err
    assert f"[vocab] output {run / 'vocab'}/vocab.safetensors: " in err and "running the stage again" in err
    load_vocab(run / "vocab")  # rebuilt


def test_non_finite_weights_in_the_trained_draft_are_refused_by_export_and_eval(run):
    """A diverged training's final/ (checksums intact): export and eval's own draft refuse it,
    naming the file and the tensor; before, export said "reloaded ... matches" and eval ran."""
    final = run / "train" / "final"
    from eaglet.formats.draft import save_final

    draft, aux = load_final(final)
    state = draft.state_dict()
    state["fc.weight"] = state["fc.weight"].clone()
    state["fc.weight"][0, 0] = float("nan")
    save_final(final, state, draft.config, aux, "eagle3")
    with pytest.raises(CorruptDataError) as e:
        load_final(final)
    code, line = cli._error_line(e.value)
    assert code == 5 and f"non-finite values in tensor fc.weight of {final / 'model.safetensors'}" in line, line
    assert "train.lr" in line


def test_eval_draft_with_a_flipped_exponent_or_inf_or_a_loader_problem_is_refused(run):
    """eval.draft: an exponent bit of fc.weight flipped in an export eaglet wrote (tau fell with
    no word before) fails its checksum; the same export without checksums.json (a draft from
    elsewhere) with an inf is refused naming the tensor; one its engine would not load as
    written (no d2t: the engine would draft from the wrong vocabulary) is refused too."""
    folder = run / "export" / "vllm"
    path = folder / "model.safetensors"
    read_eval_draft(str(folder))  # intact: reads
    raw = bytearray(path.read_bytes())
    raw[_data_offset(path, "fc.weight") + 3] ^= 0x20  # float32, little-endian: an exponent bit of fc.weight[0, 0]
    path.write_bytes(bytes(raw))
    assert torch.isfinite(load_file(str(path))["fc.weight"]).all()  # a finite weight, far off
    with pytest.raises(CorruptDataError, match=f"damaged file {path} \\(sha256"):
        read_eval_draft(str(folder))

    (folder / "checksums.json").unlink()
    t = load_file(str(path))
    t["fc.weight"][1, 2] = float("inf")
    save_file(t, str(path), metadata={"format": "pt"})
    with pytest.raises(CorruptDataError, match=f"non-finite values in tensor fc.weight of {path}"):
        read_eval_draft(str(folder))

    t["fc.weight"][1, 2] = 0.0
    save_file(t, str(path), metadata={"format": "pt"})
    read_eval_draft(str(folder))  # finite again: reads
    config = json.loads((folder / "config.json").read_text())
    del config["target_hidden_size"]  # eaglet's reader takes hidden_size; vLLM's LlamaConfig its own default
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=f"eval.draft {folder} would not load as vLLM .*'target_hidden_size'"):
        read_eval_draft(str(folder))
