"""The shadow run (eaglet/shadow.py) of a config whose draft type is not EAGLE-3, with a further
type in extract.draft_types: train.algorithm's type runs every stage on the tiny target, then the
further type trains, exports and evaluates on the same store, each stage one line naming it."""

from __future__ import annotations

import pytest

from eaglet import pipeline, shadow
from eaglet.config import load_config
from eaglet.doctor import run_doctor
from eaglet.shadow import shadow_findings
from eaglet.testing import tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_shadow_runs_the_configs_type_and_each_further_type(tmp_path):
    target = tiny.save_target(tmp_path / "llama", family="llama", template="llama3")
    data = tiny.write_jsonl(tmp_path / "data.jsonl", tiny.make_conversations(16, seed=5))
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", f"target.path={target}", "target.dtype=float32",
                             f"prepare.data=[{data}]", "vocab.size=128", "export.verifier_name_or_path=org/tiny",
                             "train.algorithm=peagle", "extract.draft_types=[eagle3, peagle]", "peagle.layers=1",
                             "peagle.depths=3", "eval.chain_tokens=3"])
    assert [k.NAME for k in shadow.further_types(cfg)] == ["eagle3"]
    lines = []
    assert run_doctor(cfg, out=lines.append, more=shadow_findings) == 0, "\n".join(lines)
    ran = [ln for ln in lines if "shadow:" in ln]
    for name in pipeline.STAGE_NAMES:
        assert any(ln.startswith("ok") and f"shadow: {name}:" in ln for ln in ran), (name, ran)
    for name in shadow.TYPE_STAGES:
        assert any(ln.startswith("ok") and f"shadow: {name} (EAGLE-3):" in ln for ln in ran), (name, ran)
    (export_line,) = [ln for ln in ran if "shadow: export:" in ln]
    assert "vllm reloaded" in export_line and "sglang" not in export_line  # P-EAGLE's export: vLLM's alone
    (eagle3_export,) = [ln for ln in ran if "shadow: export (EAGLE-3):" in ln]
    assert "vllm reloaded" in eagle3_export and "sglang reloaded" in eagle3_export
    assert any("shadow: total" in ln for ln in ran)


def test_the_shadow_takes_an_mla_draft_through_every_stage_on_a_deepseek_v3_target(tmp_path):
    """train.draft_attention mla on a tiny DeepSeek-V3 target: the shadow runs every stage with the
    MLA draft (its sizes the target's own), exports it as Eagle3DeepseekV2ForCausalLM in both
    formats, reloads each (the engines' loaders as data checking it) and evaluates it in process,
    the lossless check included (in float32 a mismatch fails the stage)."""
    target = tiny.save_target(tmp_path / "ds", family="deepseek_v3", template="chatml")
    data = tiny.write_jsonl(tmp_path / "data.jsonl", tiny.make_conversations(16, seed=5))
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", f"target.path={target}", "target.dtype=float32",
                             f"prepare.data=[{data}]", "vocab.size=128", "export.verifier_name_or_path=org/tiny",
                             "train.draft_attention=mla", "eval.chain_tokens=3"])
    lines = []
    assert run_doctor(cfg, out=lines.append, more=shadow_findings) == 0, "\n".join(lines)
    ran = [ln for ln in lines if "shadow:" in ln]
    for name in pipeline.STAGE_NAMES:
        assert any(ln.startswith("ok") and f"shadow: {name}:" in ln for ln in ran), (name, ran)
    (export_line,) = [ln for ln in ran if "shadow: export:" in ln]
    assert "vllm reloaded" in export_line and "sglang reloaded" in export_line
    (eval_line,) = [ln for ln in ran if "shadow: eval:" in ln]
    assert eval_line.startswith("ok") and "tau=" in eval_line, eval_line  # float32: a lossless failure raises
