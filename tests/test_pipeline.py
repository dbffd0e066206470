"""Stage manifests and `eaglet run`'s skip/rerun rules, with stand-in stages."""

import json

import pytest

from eaglet import pipeline
from eaglet.config import load_config

CALLS: list[str] = []


def _stage(name):
    def fn(cfg, ctx):
        CALLS.append(name)
        if name == "b" and cfg.extract.batch_tokens == 13:
            raise RuntimeError("planted failure")
        (ctx.out_dir / "out.txt").write_text(name)
        return {"upstream": sorted(ctx.upstream)}
    return fn


@pytest.fixture
def stages(monkeypatch, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("{}\n")
    fake = [
        pipeline.Stage("a", ("prepare",), "unused:a", lambda cfg: list(cfg.prepare.data)),
        pipeline.Stage("b", ("extract",), "unused:b"),
        pipeline.Stage("c", ("vocab",), "unused:c"),
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


def test_failed_stage_leaves_no_manifest_and_is_rerun(stages):
    tmp_path, data = stages
    with pytest.raises(RuntimeError, match="planted"):
        pipeline.run_all(_cfg(tmp_path, data, "extract.batch_tokens=13"))
    assert not (tmp_path / "run" / "b" / "manifest.json").exists()
    CALLS.clear()
    pipeline.run_all(_cfg(tmp_path, data))
    assert CALLS == ["b", "c"]


def test_single_stage_needs_its_upstream(stages):
    tmp_path, data = stages
    with pytest.raises(RuntimeError, match="needs stage 'a'"):
        pipeline.run_stage(_cfg(tmp_path, data), "b")
    pipeline.run_stage(_cfg(tmp_path, data), "a")
    pipeline.run_stage(_cfg(tmp_path, data), "b")
    assert CALLS == ["a", "b"]
