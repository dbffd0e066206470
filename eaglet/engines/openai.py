"""An OpenAI-compatible server (vLLM's `vllm serve`, SGLang) as an engine: its HTTP wire format.

`OpenAIClient` sends one request per prompt, at most `concurrency` in flight (threads of the
standard library's urllib; no client package), to `/v1/completions` (the prompt as token ids,
which vLLM and SGLang take) or `/v1/chat/completions` (the messages), and returns each reply's
text and generated tokens (the server's `usage.completion_tokens`). A request is retried on a
connection error, HTTP 429 or a 5xx, `RETRIES` times with a doubling wait; one that still fails,
times out, or gets another answer comes back as a `Failure` with its reason, and the others go on.

The API key is read from the environment variable the config names (`api_key_from_env`) and sent
as `Authorization: Bearer ...`; it is never logged, and a server's answer quoted in a reason is
`redact`ed first. eaglet/stages/regenerate.py drives the client; eaglet/engines/vllm.py
`ServerEngine` sends the same header.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

RETRIES = 3  # further attempts of a request after a connection error, HTTP 429 or a 5xx
BACKOFF_S = 0.5  # the wait before the first retry; it doubles for each next one
QUOTE_CHARS = 300  # the most of a server's answer quoted in a reason
BEARER = re.compile(r"(?i)(bearer\s+)[^\s\"',;]+")


@dataclass
class Reply:
    text: str  # as the server returned it (special tokens skipped)
    tokens: int  # generated tokens: usage.completion_tokens
    reasoning: str | None = None  # api chat: message.reasoning_content, where the server splits it off


@dataclass
class Failure:
    reason: str  # one line


class ServerError(Exception):
    """The server did not answer as an OpenAI-compatible one (its message is already redacted)."""


def api_key_from_env(name: str | None, setting: str) -> str | None:
    """The key in the environment variable `name` (None: no key); `setting` names the config key
    in the error when the variable is not set. The error names the variable, never a value."""
    if not name:
        return None
    key = os.environ.get(name, "")
    if not key:
        raise ConfigError(f"{setting}: the environment variable {name} is not set",
                          fix=f"export {name} with the server's API key, or unset {setting}")
    return key


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def redact(text: str, api_key: str | None) -> str:
    """`text` without the key and without any bearer token (a server may echo the request's headers)."""
    if api_key:
        text = text.replace(api_key, "***")
    return BEARER.sub(r"\1***", text)


def _quote(text: str, api_key: str | None) -> str:
    return " ".join(redact(text, api_key).split())[:QUOTE_CHARS]


def _retryable(e: BaseException) -> bool:
    if isinstance(e, urllib.error.HTTPError):
        return e.code == 429 or e.code >= 500
    if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
        return False  # a generation that outlasted request_timeout would most likely outlast it again
    return isinstance(e, (urllib.error.URLError, ConnectionError, http.client.HTTPException))


class OpenAIClient:
    """Requests to the server at `url` (its base, e.g. http://HOST:8000). `model`: the served
    model name (None: the only one /v1/models lists). `api`: 'completions' (token-id prompts) or
    'chat' (messages)."""

    def __init__(self, url: str, api: str = "completions", model: str | None = None, concurrency: int = 64,
                 api_key: str | None = None, timeout: float = 600.0):
        if api not in ("completions", "chat"):
            raise ValueError(f"api {api!r}: expected completions or chat")
        url = url.rstrip("/")
        self.url = url.removesuffix("/v1")  # the base, also where an OpenAI client's base_url was given
        self.api, self.concurrency, self.timeout = api, concurrency, timeout
        self._key = api_key
        self.model = model

    def _call(self, route: str, body: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        """One request (GET without a body); its JSON answer. Raises urllib's errors."""
        headers = {**auth_headers(self._key), **({"Content-Type": "application/json"} if body is not None else {})}
        req = urllib.request.Request(self.url + route, data=None if body is None else json.dumps(body).encode(),
                                     headers=headers)
        with urllib.request.urlopen(req, timeout=self.timeout if timeout is None else timeout) as r:
            return json.loads(r.read())

    def _describe(self, e: BaseException, timeout: float) -> str:
        if isinstance(e, urllib.error.HTTPError):
            try:
                body = e.read().decode(errors="replace")
            except OSError:
                body = ""
            return f"HTTP {e.code} {_quote(body, self._key)}".rstrip()
        if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
            return f"no answer within {timeout:g} s"
        return _quote(f"{type(e).__name__}: {getattr(e, 'reason', e)}", self._key)

    def served_models(self, timeout: float = 30.0) -> list[str]:
        """The model names /v1/models lists. Raises ServerError when the server does not answer."""
        try:
            out = self._call("/v1/models", timeout=timeout)
            return [str(m["id"]) for m in out["data"]]
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as e:
            raise ServerError(f"no OpenAI-compatible answer from {self.url}/v1/models: "
                              f"{self._describe(e, timeout)}") from None

    def body(self, prompt: list[int] | list[dict[str, str]], max_tokens: int, temperature: float) -> dict[str, Any]:
        """The request for one prompt: token ids (api completions) or messages (api chat)."""
        key = "prompt" if self.api == "completions" else "messages"
        return {"model": self.model, key: prompt, "max_tokens": max_tokens, "temperature": temperature,
                "skip_special_tokens": True}

    def complete(self, prompt: list[int] | list[dict[str, str]], max_tokens: int,
                 temperature: float) -> Reply | Failure:
        """The reply to one prompt, retried as the module doc says; a Failure with its reason."""
        route = "/v1/completions" if self.api == "completions" else "/v1/chat/completions"
        body = self.body(prompt, max_tokens, temperature)
        for attempt in range(RETRIES + 1):
            try:
                out = self._call(route, body)
                break
            except (OSError, http.client.HTTPException, ValueError) as e:
                if not _retryable(e) or attempt == RETRIES:
                    tries = f" after {attempt + 1} attempts" if attempt else ""
                    return Failure(f"{route}{tries}: {self._describe(e, self.timeout)}")
                time.sleep(BACKOFF_S * 2**attempt)
        try:
            choice = out["choices"][0]
            tokens = int((out.get("usage") or {}).get("completion_tokens") or 0)
            if self.api == "completions":
                return Reply(str(choice["text"]), tokens)
            msg = choice["message"]
            reasoning = msg.get("reasoning_content") or msg.get("reasoning")  # vLLM's name, and its newer one
            return Reply(str(msg.get("content") or ""), tokens, str(reasoning) if reasoning else None)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError):
            return Failure(f"{route}: unexpected answer {_quote(json.dumps(out), self._key)}")

    def run(self, prompts: list[Any], max_tokens: int, temperature: float) -> list[Reply | Failure]:
        """Every prompt's reply, in order, with at most `concurrency` requests in flight."""
        if not prompts:
            return []
        ex = ThreadPoolExecutor(min(self.concurrency, len(prompts)), thread_name_prefix="eaglet-openai")
        try:
            return list(ex.map(lambda p: self.complete(p, max_tokens, temperature), prompts))
        finally:  # interrupted: start no further request (those in flight end on their own)
            ex.shutdown(wait=False, cancel_futures=True)


def wait_for_server(url: str, timeout: float, api_key: str | None = None, every: float = 2.0) -> list[str]:
    """The served model names, once /v1/models answers (a server loads its weights first);
    ServerError after `timeout` seconds without an answer."""
    client = OpenAIClient(url, api_key=api_key)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.served_models(timeout=min(30.0, max(1.0, timeout)))
        except ServerError as e:
            if time.monotonic() + every > deadline:
                raise ServerError(f"{e} (waited {timeout:g} s)") from None
        time.sleep(every)
