"""Every error a user can cause ends in one line `eaglet: ...` with its documented exit code
(eaglet/errors.py), never a traceback: the CLI driven through each case."""

import subprocess
import sys

import pytest
import yaml

from eaglet import cli
from eaglet.errors import EXIT_INTERNAL, EXIT_INTERRUPTED, ConfigError, CorruptDataError, InputError, ResumeError
from eaglet.testing import tiny


def _config(tmp_path, **sections):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"run": {"dir": str(tmp_path / "run")}, **sections}))
    return str(path)


def _run(capsys, *argv):
    """(exit code, the last line on stderr, everything printed): fails on any traceback."""
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, out + err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    return rc, (lines[-1] if lines else ""), out + err


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny.save_target(tmp_path_factory.mktemp("target") / "t", family="llama", template="llama3")


def _one_line(line, code, rc, *named):
    assert rc == code, line
    assert line.startswith("eaglet: "), line
    for name in named:
        assert name in line, (name, line)


def test_exit_codes_are_the_documented_ones():
    assert (ConfigError.exit_code, InputError.exit_code, CorruptDataError.exit_code, ResumeError.exit_code) == (2, 4, 5, 6)
    doc = cli.__doc__ + sys.modules["eaglet.errors"].__doc__
    for code in ("0", "1", "2", "3", "4", "5", "6", "7", "70", "130"):
        assert f" {code} " in doc.replace("\n", " ")


def test_missing_data_file(tmp_path, capsys, target):
    cfg = _config(tmp_path, target={"path": str(target)}, prepare={"data": [str(tmp_path / "nope.jsonl")]})
    rc, line, _ = _run(capsys, "prepare", cfg)
    _one_line(line, 4, rc, "prepare.data", "not found", "nope.jsonl")


def test_a_folder_given_as_a_data_file(tmp_path, capsys, target):
    (tmp_path / "data").mkdir()
    cfg = _config(tmp_path, target={"path": str(target)}, prepare={"data": [str(tmp_path / "data")]})
    rc, line, _ = _run(capsys, "run", cfg)
    _one_line(line, 4, rc, "prepare.data", "folder", str(tmp_path / "data"))


@pytest.mark.parametrize("content, named", [
    ("", "no record"),
    ("\n\n  \n", "no record"),
    ('{"conversations": [{"from": "human", "value": ""}]}\n{"nothing": 1}\n', "no usable record"),
])
def test_data_files_without_a_usable_record(tmp_path, capsys, target, content, named):
    data = tmp_path / "d.jsonl"
    data.write_text(content)
    cfg = _config(tmp_path, target={"path": str(target)}, prepare={"data": [str(data)]})
    rc, line, _ = _run(capsys, "prepare", cfg)
    _one_line(line, 4, rc, "d.jsonl", named)


@pytest.mark.parametrize("command", ["prepare", "run"])
def test_a_missing_target_folder(tmp_path, capsys, command):
    data = tiny.write_jsonl(tmp_path / "d.jsonl", tiny.make_conversations(2))
    cfg = _config(tmp_path, target={"path": str(tmp_path / "gone")}, prepare={"data": [str(data)]})
    rc, line, out = _run(capsys, command, cfg)
    _one_line(line, 4, rc, "target.path", "not found", str(tmp_path / "gone"))
    assert "Repo id" not in out


def test_the_doctor_on_a_missing_target_folder(tmp_path, capsys):
    cfg = _config(tmp_path, target={"path": str(tmp_path / "gone")})
    rc = cli.main(["doctor", cfg])
    out, err = capsys.readouterr()
    assert rc == 1 and "Traceback" not in out + err and "Repo id" not in out + err
    assert any("FAIL" in ln and "target.path" in ln and "not found" in ln for ln in out.splitlines()), out


def test_config_errors_name_the_key(tmp_path, capsys):
    cfg = _config(tmp_path, train={"ttt_stesp": 3})
    rc, line, _ = _run(capsys, "train", cfg)
    _one_line(line, 2, rc, "ttt_stesp", "ttt_steps")


def test_export_before_train(tmp_path, capsys, target):
    data = tiny.write_jsonl(tmp_path / "d.jsonl", tiny.make_conversations(2))
    cfg = _config(tmp_path, target={"path": str(target)}, prepare={"data": [str(data)]})
    rc, line, _ = _run(capsys, "export", cfg)
    _one_line(line, 4, rc, "stage export needs stage prepare", "has not run", "eaglet prepare CONFIG")


def test_interrupt_and_unexpected_errors_are_one_line(tmp_path, capsys, monkeypatch):
    cfg = _config(tmp_path)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_stage", interrupted)
    rc, line, _ = _run(capsys, "vocab", cfg)
    _one_line(line, EXIT_INTERRUPTED, rc, "interrupted", "rerun the same command to resume")

    def bug(*a, **k):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(cli, "run_stage", bug)
    rc, line, _ = _run(capsys, "vocab", cfg)
    _one_line(line, EXIT_INTERNAL, rc, "unexpected ZeroDivisionError: division by zero", "--debug")
    # --debug: the traceback too, and the same last line
    assert cli.main(["--debug", "vocab", cfg]) == EXIT_INTERNAL
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1] == line


def test_a_real_process_prints_one_line_and_no_traceback(tmp_path):
    cfg = _config(tmp_path, target={"path": str(tmp_path / "no-such-model")},
                  prepare={"data": [str(tiny.write_jsonl(tmp_path / "d.jsonl", tiny.make_conversations(2)))]})
    p = subprocess.run([sys.executable, "-m", "eaglet.cli", "prepare", cfg, "--skip-preflight"],
                       capture_output=True, text=True, timeout=300)
    assert "Traceback" not in p.stderr + p.stdout, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    _one_line(last, 4, p.returncode, "target.path", "not found", "no-such-model")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run trained 4 steps (a checkpoint every 2), and the --set flags it was made with."""
    from conftest import tiny_pipeline_upto_vocab, train_on_copy

    tmp = tmp_path_factory.mktemp("cli")
    base = tiny_pipeline_upto_vocab(tmp, 12, 3, [
        "vocab.size=128", "train.max_tokens=256", "train.ttt_steps=2", "train.max_steps=4", "train.ckpt_every=2",
        "train.eval_every=0", "train.tensorboard=false", "train.device=cpu"])
    run, _ = train_on_copy(tmp, base, "trained")
    return run, base


def _flags(run, base, *extra):
    return [a for s in [f"run.dir={run}", *base, *extra] for a in ("--set", s)]


def test_a_refused_resume(tmp_path, capsys, trained):
    import shutil

    run, base = trained
    shutil.copytree(run, tmp_path / "run")
    cfg = _config(tmp_path)
    rc, line, _ = _run(capsys, "train", cfg, *_flags(tmp_path / "run", base, "train.ttt_steps=3"))
    _one_line(line, 6, rc, "train.ttt_steps: 2 -> 3", "--force")


def test_a_corrupt_shard(tmp_path, capsys, trained):
    import shutil

    run, base = trained
    shutil.copytree(run, tmp_path / "run")
    shard = sorted((tmp_path / "run" / "extract").glob("shard-*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x40
    shard.write_bytes(bytes(raw))
    cfg = _config(tmp_path)
    rc, line, _ = _run(capsys, "train", cfg, *_flags(tmp_path / "run", base), "--force")
    _one_line(line, 5, rc, shard.name, "eaglet extract CONFIG --force")


# ---- a failed command leaves no folder behind -----------------------------------------------------

def _tree(folder):
    """Every path under `folder`, relative, with a '/' after each folder."""
    return sorted(str(p.relative_to(folder)) + ("/" if p.is_dir() else "") for p in folder.rglob("*"))


def _failing(case, work, target):
    """(command, config sections, exit code) of a command that fails before any stage runs."""
    data = str(tiny.write_jsonl(work / "d.jsonl", tiny.make_conversations(2)))
    (work / "broken.jinja").write_text("{% for x %}\n")
    return {
        "a target folder not found": ("run", {"target": {"path": str(work / "gone")}, "prepare": {"data": [data]}}, 4),
        "target.path not set": ("run", {"prepare": {"data": [data]}}, 2),
        "a preflight FAIL": ("run", {"target": {"path": str(target), "chat_template": "broken.jinja"},
                                     "prepare": {"data": [data]}}, 3),
        "a data file not found": ("prepare", {"target": {"path": str(target)}, "prepare": {"data": ["nope.jsonl"]}}, 4),
        "a stage run before the one it needs": ("export", {"target": {"path": str(target)}, "prepare": {"data": [data]}}, 4),
        "a config value out of range": ("run", {"train": {"ckpt_every": 0}}, 2),
    }[case]


CASES = ["a target folder not found", "target.path not set", "a preflight FAIL", "a data file not found",
         "a stage run before the one it needs", "a config value out of range"]


@pytest.mark.parametrize("case", CASES)
def test_a_command_that_fails_before_any_stage_leaves_no_run_folder(tmp_path, capsys, target, case):
    work = tmp_path / "work"
    work.mkdir()
    command, sections, code = _failing(case, work, target)
    path = work / "run.yaml"
    path.write_text(yaml.safe_dump({"run": {"dir": "runs/x"}, **sections}))  # runs/ and runs/x are new
    before = _tree(work)
    rc, line, _ = _run(capsys, command, path)
    assert (rc, line.startswith("eaglet: ")) == (code, True), line
    assert _tree(work) == before, case


@pytest.mark.parametrize("case", ["a preflight FAIL", "a stage run before the one it needs"])
def test_a_failed_command_leaves_an_existing_run_folder_as_it_was(tmp_path, capsys, target, case):
    work = tmp_path / "work"
    (work / "runs" / "x" / "train").mkdir(parents=True)  # an empty stage folder made before: it stays
    (work / "runs" / "x" / "notes.txt").write_text("mine")
    command, sections, code = _failing(case, work, target)
    path = work / "run.yaml"
    path.write_text(yaml.safe_dump({"run": {"dir": "runs/x"}, **sections}))
    before = _tree(work)
    rc, line, _ = _run(capsys, command, path)
    assert rc == code, line
    assert _tree(work) == before


def test_a_command_that_fails_after_a_stage_ran_keeps_its_work(tmp_path, capsys, target):
    data = tiny.write_jsonl(tmp_path / "d.jsonl", tiny.make_conversations(4))
    cfg = _config(tmp_path, target={"path": str(target)}, prepare={"data": [str(data)]},
                  extract={"layers": [1, 99]})  # extract's preflight fails, after prepare ran
    rc, line, _ = _run(capsys, "run", cfg)
    assert rc == 3, line
    kept = _tree(tmp_path / "run")
    assert "prepare/manifest.json" in kept and ".fingerprints.json" in kept, kept
    assert not any(p.startswith("extract") for p in kept), kept
