"""Resuming training: checkpoints checked before use, and no resume that would mix two runs.

A run killed after its checkpoint of step k is simulated by a copy of an uninterrupted run
without its later checkpoints, final/ and manifest (what the kill leaves; the log lines past
step k are dropped by the resume). Every resumed run is held to the uninterrupted one: the
same final weights, bit for bit (fp32 on the CPU, one thread, one process).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import struct
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import killed_copy, tiny_pipeline_upto_vocab, train_on_copy
from eaglet import pipeline
from eaglet.config import TrainSection, load_config
from eaglet.draft.eagle3.model import DraftConfig
from eaglet.draft.step import extend_schedule, lr_lambda
from eaglet.errors import ConfigError, CorruptDataError, DivergedError, FormatVersionError, ResumeError
from eaglet.formats import checkpoints as ck
from eaglet.training import loop, resume

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """(tmp, overrides, the uninterrupted run: one epoch of 11 steps, a checkpoint every 2)."""
    tmp = tmp_path_factory.mktemp("resume")
    base = tiny_pipeline_upto_vocab(tmp, 20, 7, [
        "run.seed=0", "extract.store_dtype=float32", "vocab.size=128", "train.max_tokens=256", "train.ttt_steps=2",
        "train.log_every=1", "train.eval_every=0", "train.ckpt_every=2", "train.keep_last=20",
        "train.warmup_steps=2", "train.lr=0.001", "train.min_lr_ratio=0.1", "train.tensorboard=false",
        "train.device=cpu", "train.eval_fraction=0.1"])
    run, _ = train_on_copy(tmp, base, "clean")
    return tmp, base, run


def _ckpts(run: Path) -> Path:
    return run / "train" / "checkpoints"


def _train(run: Path, base: list[str], *extra: str, **kw) -> dict:
    cfg = load_config(None, [f"run.dir={run}", *base, *extra])
    return pipeline.run_stage(cfg, "train", preflight=False, **kw)["stats"]


def _final(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "train" / "final" / "model.safetensors"))


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = _final(a), _final(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def _log(run: Path) -> list[dict]:
    recs = [json.loads(x) for x in (run / "train" / "log.jsonl").read_text().splitlines()]
    return [r for r in recs if r["split"] == "train"]


def _total(run: Path) -> int:
    return json.loads((run / "train" / "manifest.json").read_text())["stats"]["total_steps"]


def _flip_exponent_bit(path: Path) -> None:
    """Flip the top exponent bit of the first element of the first fp32 tensor of a safetensors file."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    name = next(k for k, v in header.items() if k != "__metadata__" and v["dtype"] == "F32")
    at = 8 + n + header[name]["data_offsets"][0] + 3  # little endian: the byte of sign and top exponent bits
    raw[at] ^= 0x40
    path.write_bytes(bytes(raw))


def _rewrite_checksums(folder: Path) -> None:
    """checksums.json made again for the files as they are now (a damage the checksums cannot see)."""
    files = {n: {"sha256": hashlib.sha256((folder / n).read_bytes()).hexdigest(), "bytes": (folder / n).stat().st_size}
             for n in ck.CHECKSUMMED}
    (folder / ck.CHECKSUM_FILE).write_text(json.dumps({"files": files}))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_in_place(path: Path) -> None:
    """One same-size change to a checkpoint file that its reader would take without a word (only
    the checksum sees it): the lowest bit of a weight, of an optimizer moment or of the RNG state, a
    digit of state.json's data position; the middle byte of any other file."""
    raw = bytearray(path.read_bytes())
    if path.name.endswith(".safetensors"):
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        name = sorted(k for k in header if k != "__metadata__")[0]
        at = 8 + n + header[name]["data_offsets"][0]  # little endian: the lowest mantissa bit of a float
    elif path.name == ck.OPTIMIZER_FILE:
        moment = torch.load(path, weights_only=True)["state"][0]["exp_avg"]
        at = bytes(raw).find(moment.numpy().tobytes())  # the tensor's bytes, stored as they are
        assert at > 0
    elif path.name == ck.STATE_FILE:
        at = bytes(raw).index(b'"micro": ') + len(b'"micro": ')  # 3 -> 2: another micro-batch to go on from
    else:
        at = len(raw) // 2
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))


CORRUPTIONS = {
    **{f"flipped_{name}": (lambda c, name=name: _flip_in_place(c / name), f"{name}: sha256 mismatch")
       for name in ck.CHECKSUMMED},
    "flipped_exponent_bit": (lambda c: _flip_exponent_bit(c / ck.MODEL_FILE), "model.safetensors: sha256 mismatch"),
    "truncated_optimizer": (lambda c: _truncate(c / ck.OPTIMIZER_FILE), "optimizer.pt: \\d+ bytes, \\d+ written"),
    "missing_rng": (lambda c: (c / ck.RNG_FILE).unlink(), "rng.safetensors: missing"),
    "unreadable_state": (lambda c: (c / ck.STATE_FILE).write_text("{\"step\": 6, "),
                         "state.json: \\d+ bytes, \\d+ written"),
    "missing_checksums": (lambda c: (c / ck.CHECKSUM_FILE).unlink(), "checksums.json: missing"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_newest_checkpoint_is_named_and_training_resumes_from_the_one_before(clean, kind, tmp_path, capfd):
    tmp, base, ref = clean
    run = killed_copy(ref, tmp_path / "run", after=6)
    damage, reason = CORRUPTIONS[kind]
    damage(_ckpts(run) / "step-0000006")
    stats = _train(run, base)
    err = capfd.readouterr().err
    assert f"[train] checkpoint step-0000006 is corrupt ({reason.split(':')[0]}" in err
    assert "); resuming from step-0000004" in err
    assert stats["resumed"]["from_step"] == 4 and stats["steps_run"] == _total(ref) - 4
    import re

    assert re.fullmatch(reason, stats["resumed"]["corrupt"]["step-0000006"])
    _same_weights(run, ref)


@pytest.mark.parametrize("name", ck.CHECKSUMMED)
def test_each_flip_is_one_only_the_checksums_see(clean, name, tmp_path):
    """The same-size flips above change what a resume would load, and read back without an error
    once the checksums are made again: without its checksum, the resume would take them."""
    six = tmp_path / "step-0000006"
    shutil.copytree(_ckpts(clean[2]) / "step-0000006", six)
    before = (six / name).read_bytes()
    _flip_in_place(six / name)
    assert (six / name).read_bytes() != before and (six / name).stat().st_size == len(before)
    with pytest.raises(ck.CorruptCheckpointError, match=f"{name}: sha256 mismatch"):
        ck.read_checkpoint(six, "cpu")
    _rewrite_checksums(six)
    ck.read_checkpoint(six, "cpu")


def test_non_finite_weights_or_optimizer_state_are_refused_like_corrupt_files(clean, tmp_path, capfd):
    tmp, base, ref = clean
    run = killed_copy(ref, tmp_path / "run", after=6)
    six, four = _ckpts(run) / "step-0000006", _ckpts(run) / "step-0000004"
    weights = load_file(str(six / ck.MODEL_FILE))
    name = sorted(k for k, v in weights.items() if v.is_floating_point())[0]
    weights[name].view(-1)[0] = float("nan")
    save_file(weights, str(six / ck.MODEL_FILE))
    _rewrite_checksums(six)
    optim = torch.load(four / ck.OPTIMIZER_FILE, weights_only=True)
    optim["state"][0]["exp_avg_sq"].view(-1)[1] = float("inf")
    torch.save(optim, four / ck.OPTIMIZER_FILE)
    _rewrite_checksums(four)
    stats = _train(run, base)
    err = capfd.readouterr().err
    assert (f"[train] checkpoint step-0000006 is corrupt (model.safetensors: non-finite values in {name}); "
            "trying step-0000004") in err
    assert ("[train] checkpoint step-0000004 is corrupt (optimizer.pt: non-finite values in state.0.exp_avg_sq); "
            "resuming from step-0000002") in err
    assert stats["resumed"]["from_step"] == 2
    _same_weights(run, ref)


def test_no_intact_checkpoint_is_one_error_naming_the_folder_and_the_fix(clean, tmp_path):
    tmp, base, ref = clean
    run = killed_copy(ref, tmp_path / "run", after=4)
    for p in ck.checkpoints(_ckpts(run)):
        _truncate(p / ck.MODEL_FILE)
    with pytest.raises(CorruptDataError) as e:
        _train(run, base)
    line = e.value.line()
    assert e.value.exit_code == 5 and "\n" not in str(e.value)
    assert line.startswith(f"train: no intact checkpoint in {_ckpts(run)} (step-0000004: model.safetensors: ")
    assert "step-0000002: model.safetensors: " in line
    assert line.endswith(f"start fresh with `eaglet train CONFIG --force` (the old run is kept in "
                         f"{run / 'train' / 'previous-1'}/)")


@pytest.mark.parametrize("version", [None, ck.CHECKPOINT_VERSION + 1])
def test_a_checkpoint_of_another_format_version_is_refused_not_passed_over(clean, tmp_path, version):
    """The newest checkpoint of another format version (None: none): one line naming it and the
    command that starts afresh, exit 4; not passed over to an older one, which that eaglet wrote too."""
    tmp, base, ref = clean
    run = killed_copy(ref, tmp_path / "run", after=6)
    six = _ckpts(run) / "step-0000006"
    state = json.loads((six / ck.STATE_FILE).read_text())
    if version is None:
        del state["format_version"]
    else:
        state["format_version"] = version
    (six / ck.STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(FormatVersionError) as e:
        _train(run, base)
    was = ("has no format version (written before eaglet's formats had one)" if version is None
           else f"is format version {version}")
    assert e.value.exit_code == 4 and e.value.line() == (
        f"the checkpoint in {six} {was}; this eaglet reads version {ck.CHECKPOINT_VERSION} and converts no other; "
        f"start training afresh with `eaglet train CONFIG --force` (or remove {_ckpts(run)})")


def test_keep_last_below_one_still_keeps_the_newest(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for step in (1, 2):
        ck.save_checkpoint(tmp_path, step, model.state_dict(), opt.state_dict(), sched.state_dict(),
                           {"fingerprint": {}}, 0)
    assert [p.name for p in ck.checkpoints(tmp_path)] == ["step-0000002"]
    assert ck.read_checkpoint(tmp_path / "step-0000002", "cpu").verified


# ---- settings changed between the runs --------------------------------------------------------------

def test_changed_trajectory_settings_are_refused_naming_each(clean, tmp_path):
    tmp, base, ref = clean
    run = killed_copy(ref, tmp_path / "run", after=6)
    with pytest.raises(ResumeError) as e:
        _train(run, base, "train.ttt_steps=3", "train.lr=0.003", "train.gamma=0.5", "train.log_every=2")
    assert e.value.exit_code == 6
    assert e.value.line() == (
        f"train: checkpoint step-0000006 in {_ckpts(run)} was made with other settings (train.gamma: 0.8 -> 0.5, "
        "train.lr: 0.001 -> 0.003, train.ttt_steps: 2 -> 3); rerun with --force to start fresh (the old run is kept "
        f"in {run / 'train' / 'previous-1'}/), or restore the settings")
    assert not (run / "train" / "final").exists()  # nothing trained


# ---- which settings a resume may change: every train.* key, from the config ------------------------

# The train.* settings a resume may change, as reviewed (eaglet/training/resume.py RESUME_SAFE_KEYS
# says why each leaves the trajectory as it was). Held here rather than read from resume.py, so that
# a key moved into RESUME_SAFE_KEYS by mistake fails: every other key of TrainSection, including
# one added later, must be refused.
REVIEWED_SAFE_KEYS = {"log_every", "eval_every", "eval_max_samples", "ckpt_every", "keep_last", "tensorboard",
                      "device", "parallel", "compile", "compile_cache", "attn_impl", "teacher_chunk", "prefetch",
                      "ckpt_async",
                      "max_skipped_steps"}  # when a diverging run stops; the steps it runs are the same
TRAIN_KEYS = [f.name for f in dataclasses.fields(TrainSection)]
# The key a changed setting shows up under in the fingerprint, where it is not train.<key>.
FINGERPRINT_NAME = {"grad_accum": "data.micro_batches_per_step"}
# Values the type alone does not give well.
VALUES = {"device": "cpu"}


def _changed_value(key: str) -> Any:
    """A valid value of train.`key` other than its default, found from its type (the first candidate
    that load_config accepts): a new key of a usual type needs nothing here."""
    default = getattr(TrainSection(), key)
    candidates: list[Any] = [VALUES[key]] if key in VALUES else []
    hint = typing.get_type_hints(TrainSection)[key]
    for arg in typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,):
        if typing.get_origin(arg) is typing.Literal:
            candidates += [c for c in typing.get_args(arg) if c != default]
        elif arg is bool:
            candidates.append(not default)
        elif arg is int:
            candidates += [1, 2] if default is None else [default + 1, default - 1]
        elif arg is float:
            candidates += [0.5, 0.25] if not isinstance(default, (int, float)) or default == 0 else [default / 2]
        elif arg is str:
            candidates.append("changed")
        elif typing.get_origin(arg) is list and isinstance(default, list):
            candidates.append([x * 0.9 for x in default])
    for value in candidates:
        try:
            cfg = load_config(None, [f"train.{key}={json.dumps(value)}"])
        except ConfigError:
            continue
        if getattr(cfg.train, key) != default:
            return value
    raise AssertionError(f"train.{key}: no changed valid value among {candidates}; add one to _changed_value")


class _Store:
    meta = {"input_hash": "0" * 64}

    def __len__(self) -> int:
        return 20


def _fingerprint(*overrides: str) -> dict:
    """resume.py's fingerprint of a run with `overrides` over the defaults (a fixed model, store and
    vocabulary, on the CPU), as a checkpoint records it; no training."""
    model = types.SimpleNamespace(config=DraftConfig(
        hidden_size=64, target_hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=256, draft_vocab_size=128))
    cfg = load_config(None, list(overrides))
    return resume.run_fingerprint(model, _Store(), torch.arange(128), cfg, 1, torch.device("cpu"))


def test_the_safe_keys_are_the_reviewed_ones():
    assert set(resume.RESUME_SAFE_KEYS) == REVIEWED_SAFE_KEYS
    assert REVIEWED_SAFE_KEYS <= set(TRAIN_KEYS)  # no stale name


@pytest.mark.parametrize("key", [k for k in TRAIN_KEYS if k not in REVIEWED_SAFE_KEYS])
def test_every_trajectory_setting_is_refused_on_resume(key):
    """Each train.* key but the reviewed safe ones, changed to another valid value, makes the
    checkpoint's fingerprint differ on that key (so choose_checkpoint refuses the resume, naming it)."""
    value = _changed_value(key)
    diff = resume.fingerprint_diff(_fingerprint(), _fingerprint(f"train.{key}={json.dumps(value)}"))
    name = FINGERPRINT_NAME.get(key, f"train.{key}")
    assert name in diff, f"train.{key} -> {value!r} is not in the fingerprint: a resume with it would be taken"
    assert set(diff) == {name}


@pytest.mark.parametrize("key", sorted(REVIEWED_SAFE_KEYS))
def test_every_safe_setting_is_accepted_on_resume_and_recorded(key):
    value = _changed_value(key)
    over = f"train.{key}={json.dumps(value)}"
    assert resume.fingerprint_diff(_fingerprint(), _fingerprint(over)) == {}
    before, after = resume.resume_settings(load_config(None, [])), resume.resume_settings(load_config(None, [over]))
    assert {k for k in before if before[k] != after[k]} == {f"train.{key}"}  # the resume names the change


def test_precision_is_compared_as_resolved():
    """On the CPU auto is fp32: auto -> fp32 is the same run, auto -> bf16 another."""
    assert resume.fingerprint_diff(_fingerprint(), _fingerprint("train.precision=fp32")) == {}
    assert resume.fingerprint_diff(_fingerprint(), _fingerprint("train.precision=bf16")) == {
        "train.precision": ("fp32", "bf16")}


def test_safe_settings_may_change_and_are_recorded(clean, tmp_path, capfd):
    tmp, base, ref = clean
    run = killed_copy(ref, tmp_path / "run", after=6)
    stats = _train(run, base, "train.log_every=2", "train.ckpt_every=3", "train.attn_impl=naive")
    assert stats["resumed"]["changed"] == {"train.log_every": [1, 2], "train.ckpt_every": [2, 3],
                                           "train.attn_impl": ["auto", "naive"]}
    assert ("[train] resuming with changed settings that leave the trajectory as it was: train.log_every: 1 -> 2"
            in capfd.readouterr().err)
    assert stats["started_at_step"] == 6 and stats["steps_run"] == _total(ref) - 6
    wa, wb = _final(run), _final(ref)  # the naive attention: the same sums in another order
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)
    state = ck.read_checkpoint(ck.checkpoints(_ckpts(run))[0]).state
    assert state["settings"]["train.log_every"] == 2


def test_force_keeps_the_old_run_aside_and_starts_from_step_zero(clean, tmp_path):
    tmp, base, ref = clean
    run = killed_copy(ref, tmp_path / "run", after=6)
    stats = _train(run, base, "train.lr=0.003", force=True)
    assert "resumed" not in stats and stats["started_at_step"] == 0 and stats["steps_run"] == stats["total_steps"]
    kept = run / "train" / "previous-1"
    assert [p.name for p in ck.checkpoints(kept / "checkpoints")][0] == "step-0000006"
    kept_log = [json.loads(x) for x in (kept / "log.jsonl").read_text().splitlines()]
    assert kept_log[:6] == _log(ref)[:6]  # the old run's log, as it was
    fresh, _ = train_on_copy(tmp, base, tmp_path / "fresh", "train.lr=0.003")
    losses = [(r["step"], r["loss"], r["lr"]) for r in _log(fresh)]
    assert [(r["step"], r["loss"], r["lr"]) for r in _log(run)] == losses
    _same_weights(run, fresh)
    _train(run, base, "train.max_steps=1", force=True)  # again: the next number, the first kept as it was
    assert (run / "train" / "previous-2" / "final").is_dir() and (kept / "checkpoints" / "step-0000006").is_dir()


def test_finished_run_refuses_a_changed_lr_and_takes_a_safe_change_without_training(clean, tmp_path, capfd):
    tmp, base, ref = clean
    run = tmp_path / "run"
    shutil.copytree(ref, run)
    total = _total(ref)
    with pytest.raises(ResumeError, match=r"train\.lr: 0\.001 -> 0\.0003\); rerun with --force"):
        _train(run, base, "train.lr=0.0003")
    stats = _train(run, base, "train.eval_every=5")
    assert stats["steps_run"] == 0 and stats["steps"] == total and stats["resumed"]["from_step"] == total
    assert stats["resumed"]["changed"] == {"train.eval_every": [0, 5]}
    assert stats["eval"] == json.loads((ref / "train" / "manifest.json").read_text())["stats"]["eval"]
    assert f"is the end of the run ({total} of {total} steps): nothing to train" in capfd.readouterr().err
    _same_weights(run, ref)


def test_extend_continues_from_the_checkpoint_and_its_learning_rate(clean, tmp_path):
    tmp, base, ref = clean
    total = _total(ref)
    run = tmp_path / "run"
    shutil.copytree(ref, run)
    with pytest.raises(ResumeError, match=r"train\.epochs: 1 -> 2\); rerun with --extend to continue to the longer "
                                          r"schedule, or --force to start fresh"):
        _train(run, base, "train.epochs=2")
    stats = _train(run, base, "train.epochs=2", extend=True)
    assert stats["resumed"]["from_step"] == total and stats["steps_run"] == stats["total_steps"] - total > total // 2
    log = _log(run)
    assert [r["step"] for r in log] == list(range(1, stats["total_steps"] + 1))  # the step count continues
    assert [r["loss"] for r in log[:total]] == [r["loss"] for r in _log(ref)]
    lrs = [r["lr"] for r in log]
    at = lrs[total - 1]  # the checkpoint's last step
    after = lrs[total:]
    assert all(b <= a for a, b in zip([at, *after], after))  # no jump back up: it decays on from there
    floor = 0.1 * 0.001  # train.min_lr_ratio x train.lr: where the longer schedule ends
    assert 0.9 * at < after[0] <= at and floor <= after[-1] < floor + 0.05 * (at - floor)

    # Killed during the extension, then resumed (the same command or plain): the same run.
    cut = 2 * ((total + 4) // 2)  # a checkpoint of the extension (one every 2 steps)
    for name, kw in (("killed_extend", {"extend": True}), ("killed_plain", {})):
        killed = killed_copy(run, tmp_path / name, after=cut)
        again = _train(killed, base, "train.epochs=2", **kw)
        assert again["resumed"]["from_step"] == cut and again["steps_run"] == stats["total_steps"] - cut
        assert [r["lr"] for r in _log(killed)] == lrs
        _same_weights(killed, run)


def test_extend_refuses_any_other_change(clean, tmp_path):
    tmp, base, ref = clean
    run = tmp_path / "run"
    shutil.copytree(ref, run)
    with pytest.raises(ResumeError, match=r"train\.epochs: 1 -> 2, train\.ttt_steps: 2 -> 3\); rerun with --force "
                                          r".*or restore the settings \(--extend allows only train\.epochs and "
                                          r"train\.max_steps to change\)"):
        _train(run, base, "train.epochs=2", "train.ttt_steps=3", extend=True)
    with pytest.raises(ResumeError, match=r"is of a run of \d+ steps; train\.epochs and train\.max_steps give 3 now"):
        _train(run, base, "train.max_steps=3", extend=True)


def test_extended_schedule():
    tc = load_config(None, ["train.warmup_steps=4", "train.min_lr_ratio=0.1"]).train
    old = lr_lambda(tc, 20)
    seg = extend_schedule(tc, [{"start": 0, "total": 20}], 12, 40)
    f = lr_lambda(tc, 40, seg)
    assert [f(s) for s in range(12)] == [old(s) for s in range(12)]  # the steps run keep their rates
    assert seg[-1]["from_ratio"] == old(11)
    assert old(11) > f(12) > f(25) > f(39) > 0.1 and f(40) == pytest.approx(0.1)
    early = lr_lambda(tc, 40, extend_schedule(tc, [{"start": 0, "total": 20}], 3, 40))
    fresh = lr_lambda(tc, 40)
    assert [early(s) for s in range(41)] == [fresh(s) for s in range(41)]  # still warming up: the new total's
    twice = extend_schedule(tc, seg, 30, 60)
    g = lr_lambda(tc, 60, twice)
    assert [g(s) for s in range(30)] == [f(s) for s in range(30)] and g(30) < f(29)


def test_a_key_only_one_fingerprint_has_differs():
    """A key the checkpoint's fingerprint lacks (or only it has) is a difference, whatever the
    other side's value: no default stands in for a missing key."""
    saved = {"train.lr": 1e-4, "train.gamma": 0.8}
    now = {**saved, "train.state_noise": 0.0}
    assert resume.fingerprint_diff(saved, saved) == {}
    assert resume.fingerprint_diff(saved, now) == {"train.state_noise": (None, 0.0)}
    assert resume.fingerprint_diff(now, saved) == {"train.state_noise": (0.0, None)}
    assert resume.fingerprint_diff(saved, {**saved, "train.gamma": 0.5}) == {"train.gamma": (0.8, 0.5)}


def test_each_quality_lever_alone_changes_the_draft(clean):
    """Each lever alone, against a run with neither (train.accept_loss none, state_noise 0): the
    acceptance term ('tv', and the default 'log_accept') moves the weights, so its gradient reaches
    them (with the term detached, or the draft's distribution detached inside it, the run trains the
    cross-entropy's weights bit for bit); the state noise alone moves them too."""
    tmp, base, plain = clean  # plain: the default accept_loss (log_accept), no noise
    neither, _ = train_on_copy(tmp, base, "neither", "train.accept_loss=none")
    w0 = _final(neither)
    for name, levers in (("tv", ["train.accept_loss=tv", "train.accept_weight=0.5"]),
                         ("noise", ["train.accept_loss=none", "train.state_noise=0.05"])):
        w = _final(train_on_copy(tmp, base, f"only_{name}", *levers)[0])
        assert any(not torch.equal(w0[k], w[k]) for k in w0), name
    w = _final(plain)
    assert any(not torch.equal(w0[k], w[k]) for k in w0), "log_accept"


def test_the_quality_levers_train_log_and_resume_bit_for_bit(clean, tmp_path):
    """train.accept_loss and train.state_noise in a real run: the logged loss is the soft CE plus
    the weighted acceptance term per step, and a run killed mid-way resumes to the uninterrupted
    run's weights bit for bit (the noise draws from the generator the checkpoint restores)."""
    tmp, base, plain = clean
    levers = [*base, "train.accept_loss=tv", "train.accept_weight=0.5", "train.state_noise=0.05"]
    run, log = train_on_copy(tmp, levers, "levers")
    recs = [r for r in log if r["split"] == "train"]
    assert recs
    for r in recs:
        terms = [r[f"accept_term_{j}"] for j in range(2)]
        assert all(0 < t < 1 for t in terms)
        assert r["loss"] == pytest.approx(sum(0.8**j * (r[f"loss_{j}"] + 0.5 * terms[j]) for j in range(2)), rel=1e-5)
    killed = killed_copy(run, tmp_path / "killed", after=6)
    _train(killed, levers)
    _same_weights(run, killed)


def test_train_seed_alone_changes_the_draft_not_the_split(clean):
    """train.seed: None or run.seed's value trains the run.seed draft bit for bit; another value
    another draft, from the same split (the held-out samples stay run.seed's)."""
    tmp, base, plain = clean
    same, _ = train_on_copy(tmp, base, "seed0", "train.seed=0")
    _same_weights(plain, same)
    other, _ = train_on_copy(tmp, base, "seed5", "train.seed=5")
    wa, wb = _final(plain), _final(other)
    assert any(not torch.equal(wa[k], wb[k]) for k in wa)
    def held_out_rows(run):  # the rows the final evaluation counted: the held-out samples' loss rows
        recs = [json.loads(x) for x in (run / "train" / "log.jsonl").read_text().splitlines()]
        return [r["counted"] for r in recs if r["split"] == "eval"][-1]

    assert held_out_rows(other) == held_out_rows(plain) > 0


# ---- a diverging run ---------------------------------------------------------------------------------


def _no_non_finite_checkpoint(run: Path) -> list[str]:
    """The checkpoints in `run`, each checked to hold only finite weights and optimizer state."""
    names = sorted(p.name for p in _ckpts(run).glob("step-*")) if _ckpts(run).is_dir() else []
    for name in names:
        for k, t in load_file(str(_ckpts(run) / name / ck.MODEL_FILE)).items():
            assert not t.is_floating_point() or torch.isfinite(t).all(), f"{name} {k}"
    return names


@pytest.mark.parametrize("setting, steps, cause", [
    ("train.lr=100000", "3 to 5", r"likely cause: the loss overflowed with finite weights and input states: the "
                                  r"learning rate \(train\.lr 100000\) is too high.*; lower train\.lr \(now 100000"),
    ("train.state_noise=1e308", "1 to 3", r"likely cause: train\.state_noise 1e\+308 .*; lower train\.state_noise"),
])
def test_a_diverging_run_stops_naming_the_steps_and_the_cause(clean, tmp_path, capfd, setting, steps, cause):
    """A learning rate of 1e5 (finite until the weights grow too large for the loss) or noise of
    1e308 times the states: the gradient norm is not finite from some step on; those steps are
    skipped (logged; the weights left as they were, so the checkpoints between are kept, all
    finite), and the third in a row, past train.max_skipped_steps 2, stops training
    (DivergedError, exit 7) naming them and the cause, with no final/."""
    tmp, base, _ = clean
    with pytest.raises(DivergedError, match=rf"train: the gradient norm was not finite at 3 optimizer steps in a row, "
                                            rf"more than train\.max_skipped_steps 2 \(steps {steps}; stopped at step "
                                            rf"{steps.split()[-1]}\); {cause}") as e:
        train_on_copy(tmp, base, tmp_path / "diverged", setting, "train.warmup_steps=0", "train.max_skipped_steps=2")
    assert e.value.exit_code == 7
    run = tmp_path / "diverged"
    first, stop = (int(x) for x in steps.split()[::2])
    assert _no_non_finite_checkpoint(run) == [f"step-{s:07d}" for s in range(2, stop, 2)]
    assert not (run / "train" / "final").exists() and not (run / "train" / "manifest.json").exists()
    if first > 1:
        log = [json.loads(x) for x in (run / "train" / "log.jsonl").read_text().splitlines()]
        assert [r.get("skipped_steps", 0) for r in log if r["split"] == "train"] == [0] * (first - 1) + [1, 1]
        assert f"step {first}: 1 step(s) skipped" in capfd.readouterr().err


@pytest.mark.parametrize("log_every", [2, 5])  # the checkpoint's step logged, or not
def test_a_non_finite_weight_is_never_checkpointed(clean, tmp_path, monkeypatch, log_every):
    """A weight made infinite by step 3's update (the steps after it then skipped, within a
    generous train.max_skipped_steps): the checkpoint of step 4 is refused (DivergedError), so the
    newest checkpoint is step 2's, finite, and there is no final/."""
    tmp, base, _ = clean
    real = loop.optimizer_step
    taken = []

    def overflowing(par, *args, **kw):
        lr = real(par, *args, **kw)
        taken.append(lr)
        if len(taken) == 3:
            with torch.no_grad():
                next(p for p in par.draft.parameters() if p.requires_grad).view(-1)[0] = float("inf")
        return lr

    monkeypatch.setattr(loop, "optimizer_step", overflowing)
    with pytest.raises(DivergedError, match=r"a trained weight is not finite at step 4, so no checkpoint of it is "
                                            r"written; likely cause: the updates overflowed the weights"):
        train_on_copy(tmp, base, tmp_path / "inf", "train.max_skipped_steps=100", f"train.log_every={log_every}")
    assert _no_non_finite_checkpoint(tmp_path / "inf") == ["step-0000002"]
    assert not (tmp_path / "inf" / "train" / "final").exists()


def test_a_log_cut_by_a_kill_mid_write_resumes_to_the_same_losses(clean, tmp_path, capfd):
    """A kill in the middle of a log.jsonl write leaves a partial last line (and a disk may leave
    garbage): the resume drops the lines that do not parse, says how many, and logs the same
    losses as the uninterrupted run (it died with exit 70, JSONDecodeError, before)."""
    tmp, base, ref = clean
    run = killed_copy(ref, tmp_path / "run", after=6)
    path = run / "train" / "log.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    upto = next(k for k, ln in enumerate(lines) if json.loads(ln)["step"] > 6)  # the first line past the checkpoint
    # garbage among the kept lines, then the first later line cut mid-way, as the kill left them
    path.write_bytes(b"".join(lines[:2]) + b"\xff\x00{garbage\n" + b"".join(lines[2:upto]) + lines[upto][:17])
    stats = _train(run, base)
    assert stats["resumed"]["from_step"] == 6
    err = capfd.readouterr().err
    assert f"[train] {path}: dropped 2 lines that do not parse (a write cut short by a kill)" in err
    kept = (ref / "train" / "log.jsonl").read_text().splitlines()[:upto]
    assert path.read_text().splitlines()[:upto] == kept  # the lines before the checkpoint kept as they were
    assert [(r["step"], r["loss"]) for r in _log(run)] == [(r["step"], r["loss"]) for r in _log(ref)]
    _same_weights(run, ref)
