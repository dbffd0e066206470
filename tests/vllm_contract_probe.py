"""Run inside the venv that has vLLM (tests/test_vllm_contracts.py starts it): the doctor's
vLLM checks on tiny targets, healthy and with planted contract breaks, as JSON.

    .venv-vllm/bin/python tests/vllm_contract_probe.py OUT.json

Each case patches the installed vLLM in this process the way a release would break it (a
renamed class, a removed config field, ...), runs the extract preflight (`diagnose(cfg,
"extract")`, which `eaglet doctor` runs too), records its warn/FAIL lines, and undoes the patch.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
import tempfile
import time
import typing
from pathlib import Path

from eaglet.testing import tiny
from eaglet.engines.vllm import capture as vllm_backend
from eaglet.config import load_config
from eaglet.engines.vllm.capture import CONNECTOR_MODULE as _HS
from eaglet.doctor import diagnose


MISSING = object()


@contextlib.contextmanager
def patched(obj, name, value):
    """obj.name = value (MISSING: deleted) for the duration."""
    old = obj.__dict__.get(name, MISSING) if isinstance(obj, type) else getattr(obj, name, MISSING)
    if value is MISSING:
        delattr(obj, name)
    else:
        setattr(obj, name, value)
    try:
        yield
    finally:
        if old is MISSING:
            if hasattr(obj, name):
                delattr(obj, name)
        else:
            setattr(obj, name, old)


@contextlib.contextmanager
def popped(d, key):
    value = d.pop(key)
    try:
        yield
    finally:
        d[key] = value


def main(out: str) -> None:
    root = Path(tempfile.mkdtemp(prefix="eaglet-vllm-probe-"))
    llama = tiny.save_target(root / "llama", family="llama")
    gemma = tiny.save_target(root / "gemma-arch", family="llama")  # a class vLLM serves without EAGLE-3 support
    config = json.loads((gemma / "config.json").read_text())
    (gemma / "config.json").write_text(json.dumps({**config, "architectures": ["Gemma3ForCausalLM"]}))

    def cfg(path=llama, *more):
        return load_config(None, [f"run.dir={root / 'run'}", f"target.path={path}", "extract.backend=vllm",
                                  "vocab.size=128", *more])

    t0 = time.time()
    import vllm  # noqa: F401 - timed apart from the checks
    from vllm.platforms import current_platform

    if not current_platform.device_type:
        # A CUDA build of vLLM on a machine without a GPU: these checks are for the GPU machine the
        # extraction will run on, so the probe names its device (the doctor's 'vLLM device' line,
        # and vLLM's CLI parser need one).
        current_platform.device_type = "cuda"

    hs = importlib.import_module(_HS)
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer
    import vllm.config.speculative as speculative

    def proposer_init(self, vllm_config, device):  # reads the layer ids under another key
        self.layer_ids = vllm_config.speculative_config.draft_model_config.hf_config.aux_layer_ids

    missing = MISSING
    cases = {
        "healthy": (cfg(), contextlib.nullcontext()),
        "connector class renamed": (cfg(), patched(hs, "ExampleHiddenStatesConnector", missing)),
        "load_hidden_states removed": (cfg(), patched(hs, "load_hidden_states", missing)),
        "connector unregistered": (cfg(), popped(KVConnectorFactory._registry, "ExampleHiddenStatesConnector")),
        "KVTransferConfig field removed": (cfg(), popped(KVTransferConfig.__dataclass_fields__,
                                                         "kv_connector_extra_config")),
        "EngineArgs field removed": (cfg(), popped(EngineArgs.__dataclass_fields__, "kv_transfer_config")),
        "speculative method removed": (cfg(), patched(speculative, "SpeculativeMethod",
                                                      typing.Literal["ngram", "eagle", "eagle3"])),
        "layer ids key renamed": (cfg(), patched(ExtractHiddenStatesProposer, "__init__", proposer_init)),
        "model class without EAGLE-3": (cfg(gemma), contextlib.nullcontext()),
        "vLLM too old": (cfg(), patched(vllm_backend, "installed_vllm_version", lambda: "0.24.0")),
        "unknown engine argument": (cfg(llama, "extract.vllm_engine_args={tensor_paralel_size: 2}"),
                                    contextlib.nullcontext()),
    }
    result = {"vllm_import_s": round(time.time() - t0, 2), "vllm_version": vllm_backend.installed_vllm_version(),
              "cases": {}}
    for name, (c, patch) in cases.items():
        t = time.time()
        with patch:
            findings = diagnose(c, "extract").findings
        result["cases"][name] = {
            "seconds": round(time.time() - t, 3),
            "bad": [f.line() for f in findings if f.status in ("warn", "FAIL")],
            "lines": [f.line() for f in findings],
        }
    result["classes"] = model_classes(["LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                                       "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration",
                                       "GptOssForCausalLM", "Gemma3ForCausalLM"])
    result["serve_command"] = parse_serve_command(cfg(llama, "extract.vllm_engine_args={tensor_parallel_size: 2, "
                                                      "enable_expert_parallel: true}"))
    Path(out).write_text(json.dumps(result, indent=1))


def model_classes(archs: list[str]) -> dict:
    """arch -> the {vllm_model} contract lines that fail for vLLM's class of it."""
    from vllm.model_executor.models import ModelRegistry

    from eaglet.checks.contracts import check_contracts
    from eaglet.engines.vllm.contracts import CONTRACTS as VLLM_CONTRACTS

    out = {}
    for arch in archs:
        results = check_contracts({"vllm_model": [ModelRegistry._try_load_model_cls(arch)]}, {"extract-vllm"},
                                  rows=VLLM_CONTRACTS)
        out[arch] = [r.target for r in results if "{vllm_model}" in r.contract.where and not r.ok]
    return out


def parse_serve_command(c) -> dict:
    """The doctor's `vllm serve` command, parsed by vLLM's own CLI parser, against the
    in-process engine's arguments."""
    import shlex

    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:  # the serve parser moved out of the OpenAI entrypoint after 0.25
        from vllm.entrypoints.common.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser

    line = next(f.found for f in diagnose(c, "extract").findings if f.check == "vllm serve command")
    words = shlex.split(line)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(words[2:])
    args.model = args.model_tag
    parsed = EngineArgs.from_cli_args(args)
    want = vllm_backend.engine_args(c, [2, 4, 5, 8], str(Path(c.run.dir) / "extract" / "vllm-states"),
                                    c.prepare.max_length)
    got = {k: getattr(parsed, k) for k in want}
    kv = got["kv_transfer_config"]
    got["kv_transfer_config"] = {k: getattr(kv, k) for k in want["kv_transfer_config"]}
    return {"command": line, "differ": sorted(k for k in want if got[k] != want[k]), "keys": sorted(want)}


if __name__ == "__main__":
    main(sys.argv[1])
