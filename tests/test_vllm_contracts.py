"""The doctor's vLLM contract checks against a real vLLM (the one in .venv-vllm).

vLLM pins its own torch, so it lives in its own venv (bash scripts/vllm_venv.sh, ~4 min,
~9.7 GB); these tests run tests/vllm_contract_probe.py there once and check its report. They
are skipped, saying why, where that venv does not exist (EAGLET_VLLM_PYTHON names another
Python that has vLLM). Every check inspects the installed vLLM (imports, signatures, fields,
registries): no engine starts and no GPU is needed.

Each planted break is one a vLLM release could make: it must turn exactly the contract line
that exists for it into a FAIL naming it, and nothing else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("EAGLET_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not VLLM_PYTHON.exists(), reason=f"no vLLM venv at {VLLM_PYTHON}: `bash scripts/vllm_venv.sh` builds it "
    "(or set EAGLET_VLLM_PYTHON to a python with vLLM)")]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("probe") / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_contract_probe.py"), str(out)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(out.read_text())
    print(f"vLLM import {result['vllm_import_s']} s; doctor extract checks per case: "
          + ", ".join(f"{k} {v['seconds']} s" for k, v in result["cases"].items()), file=sys.stderr)
    return result


def test_healthy_target_passes(report):
    case = report["cases"]["healthy"]
    assert case["bad"] == [], case["bad"]
    text = "\n".join(case["lines"])
    assert "ok    vLLM version" in text and f"found {report['vllm_version']}" in text
    assert "ok    vLLM model class: expected vLLM's class for LlamaForCausalLM" in text
    assert "ok    API contracts: expected 24 signatures as eaglet calls them; found 24 of 24 match" in text
    assert "found [2, 4, 5, 8]" in text  # eaglet's layers, then L


BREAKS = {  # case -> what its one FAIL line names
    "connector class renamed": "example_hidden_states_connector.ExampleHiddenStatesConnector: ",
    "load_hidden_states removed": "example_hidden_states_connector.load_hidden_states: ",
    "connector unregistered": "'ExampleHiddenStatesConnector' is not among its keys",
    "KVTransferConfig field removed": "API vllm.config.KVTransferConfig: ",
    "EngineArgs field removed": "no field kv_transfer_config",
    "speculative method removed": "'extract_hidden_states' is not among its Literal values",
    "layer ids key renamed": "its source never names 'eagle_aux_hidden_state_layer_ids'",
    "vLLM too old": "older than 0.25.0, eaglet's vLLM backend refuses it",
    "unknown engine argument": "'tensor_paralel_size' is not one (did you mean 'tensor_parallel_size'?)",
}


@pytest.mark.parametrize("case", list(BREAKS))
def test_planted_break_is_caught(report, case):
    (line,) = report["cases"][case]["bad"]
    assert line.startswith("FAIL") and BREAKS[case] in line, line
    if case == "KVTransferConfig field removed":
        assert "no field kv_connector_extra_config" in line


def test_model_class_without_aux_layers(report):
    bad = report["cases"]["model class without EAGLE-3"]["bad"]
    assert [ln.split(":")[0] for ln in bad] == [
        "FAIL  API vllm.model_executor.models.gemma3.Gemma3ForCausalLM.supports_eagle3",
        "FAIL  API vllm.model_executor.models.gemma3.Gemma3ForCausalLM.set_aux_hidden_state_layers"]
    classes = report["classes"]  # the installed vLLM's own classes, as they are
    assert classes["KimiK25ForConditionalGeneration"] == classes["DeepseekV3ForCausalLM"] == []
    assert classes["LlamaForCausalLM"] == classes["Qwen3MoeForCausalLM"] == classes["GptOssForCausalLM"] == []
    assert len(classes["Gemma3ForCausalLM"]) == 2


def test_serve_command_parses_to_the_in_process_arguments(report):
    """The doctor's `vllm serve` line, parsed by vLLM's own CLI parser, gives the engine the
    arguments the in-process engine gets."""
    serve = report["serve_command"]
    assert serve["differ"] == [], serve
    assert {"speculative_config", "kv_transfer_config", "tensor_parallel_size"} <= set(serve["keys"])
