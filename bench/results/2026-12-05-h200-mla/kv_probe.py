"""vLLM's KV cache a token for a target alone, or with an exported eaglet draft: the cache groups
vLLM's engine made (each layer's spec and its bytes a token), read from the engine core, which
runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0). One engine a call; the result is added
under NAME to the JSON at --out (made if absent), so one file holds the target and its drafts:

    python3 kv_probe.py --target DIR --name target --out kv.json
    python3 kv_probe.py --target DIR --draft EXPORT/vllm --name mla --out kv.json

A layer whose index is at least the target's num_hidden_layers (or in a group vLLM marks as
EAGLE's) is the draft's. When the engine cannot start with the draft, the error is recorded
under NAME instead (whether vLLM serves that draft beside that target is itself a result).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import traceback
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, its scheduler readable


def cache_layers(llm: Any, target_layers: int) -> dict[str, Any]:
    """Per layer of the engine's KV cache config: its spec and bytes a token (page bytes over
    block size); the sums of the target's and the draft's layers."""
    core = llm.llm_engine.engine_core.engine_core
    config = core.scheduler.kv_cache_config
    layers = []
    for group in config.kv_cache_groups:
        specs = getattr(group.kv_cache_spec, "kv_cache_specs", None) or {n: group.kv_cache_spec for n in group.layer_names}
        for name in group.layer_names:
            spec = specs[name]
            index = re.search(r"layers\.(\d+)\.", name)
            draft = bool(getattr(group, "is_eagle_group", False)) or (index is not None and int(index[1]) >= target_layers)
            layers.append({"layer": name, "draft": draft, "spec": type(spec).__name__,
                           "bytes_per_token": spec.page_size_bytes / spec.block_size, "block_size": spec.block_size,
                           "num_kv_heads": getattr(spec, "num_kv_heads", None),
                           "head_size": getattr(spec, "head_size", None), "dtype": str(getattr(spec, "dtype", ""))})
    return {"num_blocks": config.num_blocks, "layers": layers,
            "target_bytes_per_token": sum(x["bytes_per_token"] for x in layers if not x["draft"]),
            "draft_bytes_per_token": sum(x["bytes_per_token"] for x in layers if x["draft"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", default=None, help="An eaglet export folder (its vllm/ format); none: the target alone.")
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    args = ap.parse_args()

    from eaglet.engines.vllm.decode import VllmDecoder
    from eaglet.engines.vllm.eval import draft_decoder

    target_layers = json.loads((Path(args.target) / "config.json").read_text())["num_hidden_layers"]
    engine = {"target": args.target, "max_model_len": args.max_model_len, "dtype": "bfloat16", "tokenizer": None,
              "trust_remote_code": False, "revision": None,
              "engine_args": {"gpu_memory_utilization": args.gpu_memory_utilization,
                              "enforce_eager": True}}  # no CUDA graphs to capture: the cache is the same
    result: dict[str, Any] = {"draft": args.draft, "k": args.k}
    try:
        dec = draft_decoder(args.draft, args.k, engine) if args.draft else VllmDecoder(**engine)
        if args.draft:
            draft_config = json.loads((Path(args.draft) / "config.json").read_text())
            result["draft_architectures"] = draft_config.get("architectures")
        result.update(cache_layers(dec.llm, target_layers))
        tokens, seconds, counts = dec.generate([[1, 2, 3, 4]], 16, 1)  # it decodes, with the draft if any
        result["decoded_tokens"], result["spec_counts"] = len(tokens[0]), counts.summary() if args.draft else None
        dec.close()
    except Exception as e:  # noqa: BLE001 - the engine refusing the draft is a result
        result["error"] = f"{type(e).__name__}: {e}"[:2000]
        result["traceback"] = traceback.format_exc()[-4000:]
    found = json.loads(args.out.read_text()) if args.out.is_file() else {}
    found[args.name] = result
    args.out.write_text(json.dumps(found, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("layers", "traceback")}, indent=1))


if __name__ == "__main__":
    main()
