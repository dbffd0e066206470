"""A stand-in for vLLM's hidden-state path, for tests and benchmarks on a machine without vLLM.

`FakeVLLM` answers as vLLM 0.33's `extract_hidden_states` method with the
`ExampleHiddenStatesConnector` does, computed with a transformers model: for layer ids
[a, b, ..., L] it takes the state entering each decoder layer (vLLM's hidden_states +
residual) and, for id L, the state after the last layer *before* the final norm. It writes
{"hidden_states" [T, n, H] (ids in increasing order), "token_ids" int64 [T]} with safetensors
to <storage>/req-N.safetensors next to its .lock file and returns the path as
kv_transfer_params["hidden_states_path"], with prompt logprobs when asked ({id: Logprob},
position 0 None). It has the engines' interface (run / read / discard / close).

`FakeServer` serves a `FakeVLLM` over HTTP as `vllm serve` does (/version, /v1/models,
/v1/completions with one prompt of token ids), so `extract.vllm_server` runs against it,
from this process or from torchrun ranks.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import save_file

from ..engines.vllm.capture import Result, read_states, remove_states


class FakeVLLM:
    """The connector's side of vLLM, computed with an HF model (see the module doc).

    corrupt: sample ids stored with other token ids (an engine that adds a BOS);
    unwritten: sample ids whose last two tokens' states stay zero (slots vLLM never wrote);
    final_layer: store this HF layer's state for id L instead of the pre-norm state;
    late_write: answer first, write under the held lock 0.2 s later (as vLLM's connector);
    corrupt_every: every k-th request without prompt logprobs is stored that way too;
    delay: seconds each request takes (a slow engine)."""

    def __init__(self, model: Any, storage: str | Path, layer_ids: list[int], corrupt: Any = (),
                 final_layer: int | None = None, unwritten: Any = (), late_write: bool = False, delay: float = 0.0,
                 corrupt_every: int = 0):
        self.model, self.storage, self.ids = model, Path(storage), list(layer_ids)
        self.num_layers = int(model.config.num_hidden_layers)
        self.late_write, self.delay, self.corrupt_every = late_write, delay, corrupt_every
        self.plain = 0  # requests without prompt logprobs so far
        self.corrupt, self.final_layer, self.calls, self.n = set(corrupt), final_layer, [], 0
        self.unwritten = set(unwritten)
        self.prompts: list[list[int]] = []  # every prompt asked for, in order
        self.read, self.discard = read_states, remove_states
        self.version, self.lock = "fake", threading.Lock()

    @classmethod
    def load(cls, target: str | Path, storage: str | Path, layer_ids: list[int], **kw: Any) -> FakeVLLM:
        """One over the float32 model of the checkpoint folder `target` (to build in another
        process: an HF model with its hooks does not pickle)."""
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval(), storage, layer_ids, **kw)

    @torch.inference_mode()
    def states(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        seen = []
        h = self.model.model.norm.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
        try:
            out = self.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        finally:
            h.remove()
        L = self.num_layers
        by_id = {i: out.hidden_states[i][0] for i in self.ids if i < L}
        by_id[L] = seen[0][0] if self.final_layer is None else out.hidden_states[self.final_layer][0]
        return torch.stack([by_id[i] for i in sorted(self.ids)], 1), out.logits[0].log_softmax(-1)

    def run(self, requests: list[tuple[int, Any]], prompt_logprobs: int | None) -> list[Result]:
        with self.lock:  # a server calls it from several threads
            return self._run(requests, prompt_logprobs)

    def _run(self, requests: list[tuple[int, Any]], prompt_logprobs: int | None) -> list[Result]:
        self.calls.append(len(requests))
        results = []
        for sid, ids in requests:
            ids = [int(i) for i in ids]
            self.prompts.append(ids)
            if self.delay:
                time.sleep(self.delay)
            hs, logp = self.states(ids)
            if sid in self.unwritten:
                hs = hs.clone()
                hs[-2:] = 0
            self.plain += not prompt_logprobs
            every = self.corrupt_every and not prompt_logprobs and self.plain % self.corrupt_every == 0
            stored = [7] + ids[:-1] if sid in self.corrupt or every else ids
            path = str(self.storage / f"req-{self.n}.safetensors")
            self.n += 1
            self.storage.mkdir(parents=True, exist_ok=True)
            payload = {"hidden_states": hs.contiguous(), "token_ids": torch.tensor(stored)}
            if self.late_write:
                fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                fcntl.flock(fd, fcntl.LOCK_EX)

                def write(path: str = path, payload: dict = payload, fd: int = fd) -> None:
                    time.sleep(0.2)
                    save_file(payload, path)
                    os.close(fd)  # releases the lock

                threading.Thread(target=write, daemon=True).start()
            else:
                Path(path + ".lock").touch()
                save_file(payload, path)
            pl = None
            if prompt_logprobs:
                pl = [None]
                for t in range(1, len(ids)):
                    top = logp[t - 1].topk(prompt_logprobs)
                    d = {int(i): SimpleNamespace(logprob=float(v), rank=r + 1)
                         for r, (v, i) in enumerate(zip(top.values, top.indices))}
                    d.setdefault(ids[t], SimpleNamespace(logprob=float(logp[t - 1, ids[t]]), rank=99))
                    pl.append(d)
            results.append(Result(sid, path, pl))
        return results

    def close(self) -> None:
        pass


class FakeServer:
    """`FakeVLLM` behind vLLM's OpenAI-style routes, on 127.0.0.1 (a context manager).

    `requests` holds every completion body received; `stop_after`: answer that many
    completions, then refuse with HTTP 503 (a server that went away mid-run)."""

    def __init__(self, fake: FakeVLLM, version: str = "0.33.0", model_id: str = "tiny",
                 stop_after: int | None = None):
        self.fake, self.requests, self.stop_after = fake, [], stop_after
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, obj: Any, code: int = 200) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._send({"version": version} if self.path == "/version" else {"data": [{"id": model_id}]})

            def do_POST(self) -> None:
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.fake.lock:
                    outer.requests.append(req)
                    refuse = outer.stop_after is not None and len(outer.requests) > outer.stop_after
                if refuse:
                    self._send({"error": "the engine is shut down"}, 503)
                    return
                (res,) = outer.fake.run([(-1, req["prompt"])], req.get("prompt_logprobs"))
                pl = None if res.prompt_logprobs is None else [
                    None if p is None else {str(k): {"logprob": v.logprob, "rank": v.rank} for k, v in p.items()}
                    for p in res.prompt_logprobs]
                self._send({"choices": [{"text": "", "prompt_logprobs": pl, "prompt_token_ids": req["prompt"]}],
                            "kv_transfer_params": {"hidden_states_path": res.path}})

            def log_message(self, *a: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            request_queue_size = 1024  # as a serving engine's listen backlog: many requests connect at once

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> FakeServer:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
