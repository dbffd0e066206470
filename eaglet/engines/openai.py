"""An OpenAI-compatible server (vLLM's `vllm serve`, SGLang) as an engine: its HTTP wire format.

`OpenAIClient` sends one request per prompt, at most `concurrency` in flight (threads of the
standard library's urllib; no client package), to `/v1/completions` (the prompt as token ids,
which vLLM and SGLang take) or `/v1/chat/completions` (the messages), and returns each reply's
text, generated tokens (the server's `usage.completion_tokens`) and finish reason. A request is
retried on a connection error, HTTP 429 or a 5xx, `RETRIES` times with a doubling wait; one that
still fails, outlasts `timeout` (a deadline on the whole request, its answer's last byte
included), or gets another answer comes back as a `Failure` with its reason, and the others go
on. A reply whose text is not a string (`"text": null`, a number) is a `Failure` too (bad_reply),
never a reply. `tokenize` asks the server's tokenizer for a text's ids (vLLM's /tokenize,
SGLang's /v1/tokenize), to check it runs the target.

The HTTP itself (the deadline, the key kept to the server's origin across redirects, the
warning for a key over plain http://) is eaglet/engines/httpjson.py's, which eaglet/engines/vllm/capture.py
`ServerEngine` shares. The API key is read from the environment variable the config names
(`api_key_from_env`) and sent as `Authorization: Bearer ...`; it is never logged, and a server's
answer quoted in a reason is `redact`ed first. eaglet/regeneration/ drives the client.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .httpjson import api_key_from_env, call_json, describe, is_timeout, quote, redact, warn_plain_http

__all__ = ["OpenAIClient", "Reply", "Failure", "ServerError", "api_key_from_env", "redact", "wait_for_server"]

RETRIES = 3  # further attempts of a request after a connection error, HTTP 429 or a 5xx
BACKOFF_S = 0.5  # the wait before the first retry; it doubles for each next one


@dataclass
class Reply:
    text: str  # as the server returned it (special tokens skipped)
    tokens: int  # generated tokens: usage.completion_tokens
    reasoning: str | None = None  # api chat: message.reasoning_content, where the server splits it off
    finish_reason: str | None = None  # 'stop', 'length' (cut at max_tokens), ...; None where the server gave none


@dataclass
class Failure:
    reason: str  # one line
    bad_reply: bool = False  # the server answered, but not with a reply (its text not a string, ...)


class ServerError(Exception):
    """The server did not answer as an OpenAI-compatible one (its message is already redacted)."""


def _retryable(e: BaseException) -> bool:
    if isinstance(e, urllib.error.HTTPError):
        return e.code == 429 or e.code >= 500
    if is_timeout(e):
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
        warn_plain_http(self.url, api_key, "regenerate.url")

    def _call(self, route: str, body: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        """One request (GET without a body), all of it within `timeout` (default: the client's); its
        JSON answer. Raises httpjson's errors."""
        return call_json(self.url + route, body, self._key, self.timeout if timeout is None else timeout)

    def _describe(self, e: BaseException, timeout: float) -> str:
        return describe(e, timeout, self._key)

    def served_models(self, timeout: float = 30.0) -> list[str]:
        """The model names /v1/models lists. Raises ServerError when the server does not answer."""
        try:
            out = self._call("/v1/models", timeout=timeout)
            return [str(m["id"]) for m in out["data"]]
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as e:
            raise ServerError(f"no OpenAI-compatible answer from {self.url}/v1/models: "
                              f"{self._describe(e, timeout)}") from None

    def tokenize(self, text: str, timeout: float = 30.0) -> list[int] | str:
        """The served model's token ids for `text`, no special tokens added: vLLM's /tokenize
        ({"model", "prompt", "add_special_tokens"} -> {"tokens": [...]}), else SGLang's /v1/tokenize
        (the same request and answer). A str instead: why neither gave ids (no such endpoint, or an
        answer without them)."""
        why = []
        for route in ("/tokenize", "/v1/tokenize"):
            try:
                out = self._call(route, {"model": self.model, "prompt": text, "add_special_tokens": False}, timeout)
            except (OSError, http.client.HTTPException, ValueError) as e:
                why.append(f"{route}: {self._describe(e, timeout)}")
                continue
            ids = out.get("tokens") if isinstance(out, dict) else None
            if isinstance(ids, list) and ids and all(type(t) is int for t in ids):
                return ids
            why.append(f"{route}: no token ids in its answer {quote(json.dumps(out), self._key, 80)}")
        return "; ".join(why)

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
        reply = self.reply(out)
        if isinstance(reply, str):
            return Failure(f"{route}: bad reply: {reply}: {quote(json.dumps(out), self._key)}", bad_reply=True)
        return reply

    def reply(self, out: Any) -> Reply | str:
        """The Reply in a server's answer; a str instead: what is wrong with the answer (a reply's
        text that is not a string is never made one)."""
        choices = out.get("choices") if isinstance(out, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return "no choices[0]"
        choice = choices[0]
        usage = out.get("usage")
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if tokens is None:
            tokens = 0
        if type(tokens) is not int or tokens < 0:
            return f"usage.completion_tokens is {_shown(tokens)}, not a count"
        finish = choice.get("finish_reason")
        finish = finish if isinstance(finish, str) else None
        if self.api == "completions":
            text = choice.get("text")
            if not isinstance(text, str):
                return f"choices[0].text is {_shown(text)}, not a string"
            return Reply(text, tokens, finish_reason=finish)
        msg = choice.get("message")
        if not isinstance(msg, dict):
            return f"choices[0].message is {_shown(msg)}, not an object"
        content = msg.get("content")
        key = "reasoning_content" if msg.get("reasoning_content") is not None else "reasoning"  # vLLM's, its newer
        reasoning = msg.get(key)
        if reasoning is not None and not isinstance(reasoning, str):
            return f"choices[0].message.{key} is {_shown(reasoning)}, not a string"
        if content is None and reasoning:
            content = ""  # all of it reasoning (cut inside it by max_tokens): the reasoning is the reply
        if not isinstance(content, str):
            return f"choices[0].message.content is {_shown(content)}, not a string"
        return Reply(content, tokens, reasoning or None, finish)

    def run(self, prompts: list[Any], max_tokens: int, temperature: float) -> list[Reply | Failure]:
        """Every prompt's reply, in order, with at most `concurrency` requests in flight."""
        if not prompts:
            return []
        ex = ThreadPoolExecutor(min(self.concurrency, len(prompts)), thread_name_prefix="eaglet-openai")
        try:
            return list(ex.map(lambda p: self.complete(p, max_tokens, temperature), prompts))
        finally:  # interrupted: start no further request (those in flight end on their own)
            ex.shutdown(wait=False, cancel_futures=True)


def _shown(value: Any) -> str:
    return "null" if value is None else f"{json.dumps(value)[:40]} ({type(value).__name__})"


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
