"""Stage manifests and `eaglet run`'s skip/rerun rules, with stand-in stages."""

import json

import pytest

from eaglet import pipeline
from eaglet.config import load_config
from eaglet.errors import CorruptDataError, FormatVersionError, InputError, ResumeError
from eaglet.formats.checked import write_files
from eaglet.formats.version import MANIFEST_VERSION

CALLS: list[str] = []


def _stage(name):
    def fn(cfg, ctx):
        CALLS.append(name)
        if name == "b" and cfg.extract.batch_tokens == 13:
            raise RuntimeError("planted failure")
        if name == "b" and cfg.extract.batch_tokens == 14:
            raise ResumeError("planted refusal")
        write_files(ctx.out_dir, {"out.txt": name.encode() * 4})  # listed in its checksums.json
        return {"upstream": sorted(ctx.upstream)}
    return fn


@pytest.fixture
def stages(monkeypatch, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("{}\n")
    fake = [
        pipeline.Stage("a", ("prepare",), "unused:a", lambda cfg: [("prepare.data", p) for p in cfg.prepare.data],
                       outputs=pipeline._here),
        pipeline.Stage("b", ("extract",), "unused:b", outputs=pipeline._here),
        pipeline.Stage("c", ("vocab",), "unused:c", outputs=pipeline._here),
    ]
    monkeypatch.setattr(pipeline.Stage, "function", lambda self: _stage(self.name))
    monkeypatch.setattr(pipeline, "STAGES", fake)
    monkeypatch.setattr(pipeline, "STAGE_NAMES", ["a", "b", "c"])
    CALLS.clear()
    return tmp_path, data


def _cfg(tmp_path, data, *extra):
    return load_config(None, [f"run.dir={tmp_path / 'run'}", f"prepare.data=[{data}]", *extra])


def test_run_skips_up_to_date_and_reruns_downstream(stages):
    tmp_path, data = stages
    pipeline.run_all(_cfg(tmp_path, data))
    assert CALLS == ["a", "b", "c"]
    m = json.loads((tmp_path / "run" / "b" / "manifest.json").read_text())
    assert m["status"] == "complete" and m["stats"] == {"upstream": ["a"]}
    assert {"torch", "transformers", "eaglet"} <= set(m["versions"])
    assert m["config"]["extract"]["batch_tokens"] == 16384 and len(m["input_hash"]) == 64

    CALLS.clear()
    pipeline.run_all(_cfg(tmp_path, data))
    assert CALLS == []

    CALLS.clear()
    pipeline.run_all(_cfg(tmp_path, data, "extract.batch_tokens=1024"))
    assert CALLS == ["b", "c"]  # b's inputs changed: b and everything after it

    CALLS.clear()
    data.write_text('{"changed": 1}\n')  # an input file's content changed
    pipeline.run_all(_cfg(tmp_path, data, "extract.batch_tokens=1024"))
    assert CALLS == ["a", "b", "c"]


def test_keys_of_how_a_stage_runs_rerun_nothing(stages):
    """Keys marked hashed=False (extract.writer_threads) are left out of the one input hash:
    changing them reruns nothing; a key that decides what a stage writes reruns it and those after."""
    tmp_path, data = stages
    pipeline.run_all(_cfg(tmp_path, data, "extract.writer_threads=4"))
    CALLS.clear()
    pipeline.run_all(_cfg(tmp_path, data, "extract.writer_threads=2"))
    pipeline.run_stage(_cfg(tmp_path, data, "extract.fsync=false"), "c")
    assert CALLS == []
    pipeline.run_all(_cfg(tmp_path, data, "extract.batch_tokens=1024", "extract.writer_threads=3"))
    assert CALLS == ["b", "c"]
    b = json.loads((tmp_path / "run" / "b" / "manifest.json").read_text())
    assert "writer_threads" not in b["inputs"]["config"]["extract"] and b["config"]["extract"]["writer_threads"] == 3
    assert b["input_hash"] == pipeline.input_hash(b["inputs"])  # the one scheme, recomputable from the manifest


def test_failed_stage_leaves_no_manifest_and_is_rerun(stages):
    tmp_path, data = stages
    with pytest.raises(RuntimeError, match="planted"):
        pipeline.run_all(_cfg(tmp_path, data, "extract.batch_tokens=13"))
    assert not (tmp_path / "run" / "b" / "manifest.json").exists()
    CALLS.clear()
    pipeline.run_all(_cfg(tmp_path, data))
    assert CALLS == ["b", "c"]


def test_a_refused_resume_leaves_the_stage_as_it_was(stages):
    """A stage that refuses to resume changed nothing: its manifest stays, so with the old
    settings back every stage is up to date again."""
    tmp_path, data = stages
    pipeline.run_all(_cfg(tmp_path, data))
    before = (tmp_path / "run" / "b" / "manifest.json").read_text()
    with pytest.raises(ResumeError):
        pipeline.run_all(_cfg(tmp_path, data, "extract.batch_tokens=14"))
    assert (tmp_path / "run" / "b" / "manifest.json").read_text() == before
    CALLS.clear()
    pipeline.run_all(_cfg(tmp_path, data))
    assert CALLS == []


def test_single_stage_needs_its_upstream(stages):
    tmp_path, data = stages
    with pytest.raises(InputError, match="stage b needs stage a, which has not run in .*; run `eaglet a CONFIG` first"):
        pipeline.run_stage(_cfg(tmp_path, data), "b")
    pipeline.run_stage(_cfg(tmp_path, data), "a")
    pipeline.run_stage(_cfg(tmp_path, data), "b")
    assert CALLS == ["a", "b"]


def test_a_stage_whose_output_is_gone_or_cut_runs_again(stages, capsys):
    """The manifest lists the stage's outputs with their sizes and sha256; a listed file that is
    missing or not its size makes the stage run again (the stages after it, whose inputs did not
    change, stay up to date). The plan reads no file: a same-size change is found where the file
    is read (its sha256, eaglet/formats/checked.py)."""
    tmp_path, data = stages
    pipeline.run_all(_cfg(tmp_path, data))
    b = json.loads((tmp_path / "run" / "b" / "manifest.json").read_text())
    assert set(b["outputs"]) == {"out.txt", "checksums.json"} and b["outputs"]["out.txt"]["bytes"] == 4
    for name, damage in (("b", lambda p: p.unlink()), ("a", lambda p: p.write_text("a"))):
        CALLS.clear()
        capsys.readouterr()
        damage(tmp_path / "run" / name / "out.txt")
        pipeline.run_all(_cfg(tmp_path, data))
        assert CALLS == [name]
        assert f"[{name}] output {tmp_path / 'run' / name}/out.txt: " in capsys.readouterr().err
    CALLS.clear()
    (tmp_path / "run" / "c" / "out.txt").write_text("cccx")
    pipeline.run_all(_cfg(tmp_path, data))
    assert CALLS == []


def test_a_single_stage_is_refused_when_an_output_it_needs_is_gone(stages):
    """`eaglet b` alone, with a's checksums.json deleted: CorruptDataError (exit 5) naming the file
    and the command that makes it again; `eaglet a` then runs a again (it is not up to date)."""
    tmp_path, data = stages
    pipeline.run_all(_cfg(tmp_path, data))
    CALLS.clear()
    (tmp_path / "run" / "a" / "checksums.json").unlink()
    with pytest.raises(CorruptDataError, match=f"stage b needs stage a's output {tmp_path / 'run' / 'a'}/checksums.json: "
                                               "missing; run `eaglet a CONFIG`"):
        pipeline.run_stage(_cfg(tmp_path, data), "b")
    pipeline.run_stage(_cfg(tmp_path, data), "a")
    pipeline.run_stage(_cfg(tmp_path, data), "b")
    assert CALLS == ["a"]  # b was up to date once a's outputs were back


def test_the_manifest_records_its_format_version(stages):
    tmp_path, data = stages
    pipeline.run_all(_cfg(tmp_path, data))
    for name in "abc":
        m = json.loads((tmp_path / "run" / name / "manifest.json").read_text())
        assert m["format_version"] == MANIFEST_VERSION


@pytest.mark.parametrize("version", [None, 0, MANIFEST_VERSION + 1])
@pytest.mark.parametrize("command", ["run", "stage"])
def test_a_manifest_of_another_format_version_is_refused(stages, version, command):
    """A stage folder whose manifest is of another format version (None: written before
    versions, and listing no outputs) is refused in one line naming the folder and the command
    that starts afresh, by `eaglet run` and by a later stage that needs it; nothing runs, and
    `--force` runs it afresh."""
    tmp_path, data = stages
    pipeline.run_all(_cfg(tmp_path, data))
    path = tmp_path / "run" / "a" / "manifest.json"
    m = json.loads(path.read_text())
    if version is None:
        del m["format_version"], m["outputs"]
    else:
        m["format_version"] = version
    path.write_text(json.dumps(m))
    CALLS.clear()
    with pytest.raises(FormatVersionError) as e:
        if command == "run":
            pipeline.run_all(_cfg(tmp_path, data))
        else:
            pipeline.run_stage(_cfg(tmp_path, data), "b")
    was = ("has no format version (written before eaglet's formats had one)" if version is None
           else f"is format version {version}")
    assert e.value.line() == (f"stage a's manifest in {tmp_path / 'run' / 'a'} {was}; this eaglet reads version "
                              f"{MANIFEST_VERSION} and converts no other; start afresh with `eaglet run CONFIG --force` "
                              f"(or `eaglet a CONFIG --force`, or remove {tmp_path / 'run' / 'a'})")
    assert e.value.exit_code == 4 and CALLS == []
    pipeline.run_stage(_cfg(tmp_path, data), "a", force=True)
    assert json.loads(path.read_text())["format_version"] == MANIFEST_VERSION
    CALLS.clear()
    pipeline.run_all(_cfg(tmp_path, data))
    assert CALLS == []  # written afresh under the same input hash: b and c stay up to date


# ---- the target's identity in the input hashes ---------------------------------------------------

def _hashes(cfg):
    return {stage.name: h for stage, h, _ in pipeline._stage_plan(cfg, "eval").stages}


def test_keys_of_how_a_stage_runs_leave_its_hash_alone(tmp_path):
    """extract.online_ahead decides where training's target runs, not what extract writes: no
    value of it changes any stage's hash; a key of what extract writes does."""
    from eaglet.testing.tiny import save_target

    target = tmp_path / "target"
    save_target(target, "llama", seed=0)
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    sets = [f"run.dir={tmp_path / 'run'}", f"prepare.data=[{data}]", f"target.path={target}"]
    base = _hashes(load_config(None, sets))
    assert _hashes(load_config(None, [*sets, "extract.online_ahead=3"])) == base
    cfg = load_config(None, sets)
    assert "online_ahead" in cfg.section("extract") and "online_ahead" not in cfg.hashed_section("extract")
    changed = _hashes(load_config(None, [*sets, "extract.batch_tokens=1024"]))
    assert changed["extract"] != base["extract"] and changed["prepare"] == base["prepare"]


def test_draft_type_keys_rerun_what_they_decide_and_a_default_run_keeps_its_hash(tmp_path):
    """train.algorithm and extract.draft_types stay out of every hash while they hold their
    defaults: the inputs of a default run are those it had before draft types (the stage inputs
    hold no `more`, the sections no new key), so no store is extracted again. Another type reruns
    extract and train; its block size reruns train alone (the store holds the same layers); its
    layer count reruns extract too; extract.draft_types reruns extract."""
    from eaglet.testing.tiny import save_target

    target = tmp_path / "target"
    save_target(target, "llama", seed=0)
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    sets = [f"run.dir={tmp_path / 'run'}", f"prepare.data=[{data}]", f"target.path={target}"]
    cfg = load_config(None, sets)
    assert "algorithm" not in cfg.hashed_section("train") and "draft_types" not in cfg.hashed_section("extract")
    assert all("more" not in pipeline.stage_inputs(cfg, s, None) for s in pipeline.STAGES)
    base = _hashes(cfg)
    dflash = _hashes(load_config(None, [*sets, "train.algorithm=dflash"]))
    assert dflash["extract"] != base["extract"] and dflash["train"] != base["train"]
    assert dflash["prepare"] == base["prepare"] and dflash["vocab"] != base["vocab"]  # vocab chains to extract
    block = _hashes(load_config(None, [*sets, "train.algorithm=dflash", "dflash.block_size=8"]))
    assert block["extract"] == dflash["extract"] and block["train"] != dflash["train"]
    layers = _hashes(load_config(None, [*sets, "train.algorithm=dflash", "dflash.layers=2"]))
    assert layers["extract"] != dflash["extract"]
    union = _hashes(load_config(None, [*sets, "extract.draft_types=[dflash]"]))
    assert union["extract"] != base["extract"]


def test_a_target_replaced_in_place_reruns_what_reads_it(tmp_path):
    """Another model, tokenizer, chat template or fine-tuned weights in the same target folder
    change the input hash of the stage that reads them (and so of every stage after it);
    touching or copying files without changing them does not."""
    import os
    import shutil

    from eaglet.testing.tiny import save_target

    target = tmp_path / "target"
    save_target(target, "llama", seed=0)
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", f"prepare.data=[{data}]", f"target.path={target}"])
    base = _hashes(cfg)
    for f in target.iterdir():  # a copy keeps the contents: mtimes alone do not count
        os.utime(f, (1, 1))
    assert _hashes(cfg) == base

    def changed(mutate):
        shutil.rmtree(target)
        save_target(target, "llama", seed=0)
        assert _hashes(cfg) == base
        mutate()
        now = _hashes(cfg)
        return [name for name in base if now[name] != base[name]]

    after_prepare = ["prepare", "extract", "vocab", "train", "export", "eval"]
    after_extract = after_prepare[1:]
    # Llama -> Qwen3 in place: config, tokenizer and weights all change
    assert changed(lambda: (shutil.rmtree(target), save_target(target, "qwen3", template="llama3", seed=0))) \
        == after_prepare
    # another chat template in tokenizer_config.json / chat_template.jinja
    def template():
        files = [f for f in target.iterdir() if f.name in ("chat_template.jinja", "tokenizer_config.json")]
        assert files
        for f in files:
            f.write_text(f.read_text().replace("<|im_start|>", "<|im_begin|>"))
    assert changed(template) == after_prepare
    # fine-tuned weights: the same names, shapes and sizes, other values
    def finetune():
        from safetensors.torch import load_file, save_file

        for f in target.glob("*.safetensors"):
            w = load_file(str(f))
            save_file({k: v + 1e-3 for k, v in w.items()}, str(f), metadata={"format": "pt"})
    assert changed(finetune) == after_extract
    # the model's config
    def config():
        c = target / "config.json"
        c.write_text(c.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    assert changed(config) == after_extract


def test_the_run_summary_gives_tau_the_exports_and_their_serve_commands():
    from eaglet.config import load_config
    from eaglet.pipeline import run_summary

    cfg = load_config(None, ["run.dir=/r", "eval.chain_tokens=3", "eval.prompts=mt_bench"])
    text = run_summary(cfg, [
        {"stage": "export", "stats": {"vllm": {"path": "/r/export/vllm", "serve_command": "vllm serve T --x"}}},
        {"stage": "eval", "stats": {"tau": 1.43, "num_prompts": 80, "reference_tau": 1.0,
                                    "acceptance_rate": [0.32, None], "tau_by_category": {"math": 1.54},
                                    "vllm": {"mean_acceptance_length": 1.398, "relative_difference": -0.022,
                                             "speedup": {"batch_1": 0.97, "batch_16": 0.79}}}}])
    assert "tau, chain of 3, 80 prompts (mt_bench): 1.430 (untrained draft 1.000)" in text
    assert "acceptance per draft position: 0.32, -" in text and "math         1.540" in text
    assert "mean acceptance length 1.398 (-2.2% against eaglet's); speedup batch 1 0.97x, batch 16 0.79x" in text
    assert "vllm export: /r/export/vllm\n    serve: vllm serve T --x" in text


def test_the_run_summary_gives_the_lossless_verdict_and_why_fewer_prompts_than_asked():
    """`eaglet run` and `eaglet eval` end with the lossless verdict on how many prompts (or why it
    was not checked), and, when the prompt set gave fewer than eval.num_prompts, why."""
    from eaglet.config import load_config
    from eaglet.pipeline import run_summary
    from eaglet.formats.eval_sets import SkippedPrompts, prompt_count

    cfg = load_config(None, ["run.dir=/r", "eval.chain_tokens=3", "eval.num_prompts=8"])
    held = {"held_out": 8, "duplicates": 2, "no_prompt": 0, "missing": 0}
    stats = {"tau": 1.23, "num_prompts": 6, "acceptance_rate": [0.2, 0.1, 0.0], "lossless": True,
             "lossless_mismatches": 0, "result": "heldout-chain3-greedy.json",
             "prompt_count": prompt_count("heldout", 8, 6, SkippedPrompts(), held)}
    text = run_summary(cfg, [{"stage": "eval", "stats": stats}])
    assert "  prompts: 6 (8 asked; train.eval_fraction holds out 8 samples: 2 were duplicates of others)" in text
    assert ("  lossless: yes, the speculative output equals the target's own greedy output on all 6 prompts"
            in text.splitlines())
    text = run_summary(cfg, [{"stage": "eval", "stats": {**stats, "lossless": False, "lossless_mismatches": 2,
                                                           "prompt_count": prompt_count("heldout", 6, 6,
                                                                                        SkippedPrompts(), held)}}])
    assert "lossless: NO, 2 of 6 prompts differ from the target's own greedy output" in text
    assert "prompts:" not in text  # every prompt asked for is there
    sampled = load_config(None, ["run.dir=/r", "eval.temperature=0.7"])
    text = run_summary(sampled, [{"stage": "eval", "stats": {**stats, "lossless": None}}])
    assert "lossless: not checked (sampled decoding (eval.temperature > 0) has no token-for-token check)" in text
