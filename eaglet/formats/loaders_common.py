"""What every engine loader written down as data shares (eaglet/formats/loaders.py for the Llama
EAGLE-3, P-EAGLE and DFlash loaders, loaders_mla.py for the MLA EAGLE-3 ones): reading an export's
config.json and tensor shapes without loading a tensor, and matching each tensor to the
parameter a loader would put it in. Change it when every loader check needs something new."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors import safe_open

VLLM_VERSION = "0.25.0"  # the vLLM release whose loaders are written down
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"

ParamMap = dict[str, bool]  # a loader's parameter name -> whether a checkpoint tensor must fill it
Target = tuple[str, Any] | str | None  # (parameter, shard or None); "d2t"; "ignored" (t2d); None: no parameter
# A fused parameter's name fragment -> the shards a checkpoint must fill it with (q/k/v, gate/up, ...).
Shards = dict[str, tuple[Any, ...]]


def read_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable as JSON ({e})") from e


def tensor_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor of the export's safetensors (headers only)."""
    folder = Path(folder)
    if (folder / WEIGHTS_INDEX).is_file():
        files = sorted(set(json.loads((folder / WEIGHTS_INDEX).read_text())["weight_map"].values()))
    elif (folder / WEIGHTS_FILE).is_file():
        files = [WEIGHTS_FILE]
    else:
        raise FileNotFoundError(f"no {WEIGHTS_FILE} or {WEIGHTS_INDEX} in {folder}")
    out: dict[str, tuple[int, ...]] = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt", device="cpu") as f:
            out.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})  # noqa: SIM118
    return out


def config_value(config: dict[str, Any], dotted: str) -> Any:
    """config["a"]["b"][0] for "a.b.0"; None where any part is missing."""
    value: Any = config
    for part in dotted.split("."):
        if isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            return None
    return value


def match_weights(shapes: dict[str, tuple[int, ...]], params: ParamMap, target: Callable[[str, ParamMap], Target],
                  engine: str, shards: Shards) -> tuple[list[str], set[str], dict[str, set[Any]]]:
    """(problems, the tensors that are d2t, parameter -> the shards filled) of matching each tensor to
    `params` by `target`: a tensor that goes nowhere, and a needed parameter (each of its `shards`
    for a fused one) that no tensor fills."""
    filled: dict[str, set[Any]] = {}
    problems, d2t = [], set()
    for name in sorted(shapes):
        t = target(name, params)
        if t == "d2t":
            d2t.add(name)
        elif t is None:
            problems.append(f"weight {name!r}: {engine}'s loader has no parameter for it and would not load it")
        elif t != "ignored":
            filled.setdefault(t[0], set()).add(t[1])
    for param, needed in params.items():
        if not needed:
            continue
        parts = next((s for suffix, s in shards.items() if f"{suffix}." in param), (None,))
        lacking = [s for s in parts if s not in filled.get(param, set())]
        if lacking:
            what = f" (shards {lacking})" if lacking != [None] else ""
            problems.append(f"{engine}'s parameter {param!r}{what} is filled by no weight: it would stay as "
                            "initialised")
    return problems, d2t, filled


def fc_problem(shapes: dict[str, tuple[int, ...]], num_aux: int, target_hidden: int, engine: str) -> list[str]:
    fc = shapes.get("fc.weight")
    if fc is None or len(fc) != 2 or fc[1] == num_aux * target_hidden:
        return []
    return [f"weight 'fc.weight' {fc} takes {fc[1]} inputs; {engine} builds fc for {num_aux} states x "
            f"target_hidden_size {target_hidden} = {num_aux * target_hidden} from config.json"]


def d2t_problem(d2t: set[str], draft_vocab: Any, vocab: Any, engine: str) -> list[str]:
    if d2t or draft_vocab is None or vocab is None or int(draft_vocab) == int(vocab):
        return []
    return [f"no 'd2t' while draft_vocab_size {draft_vocab} < vocab_size {vocab}: {engine} would read each draft "
            "token id as the same target id"]
