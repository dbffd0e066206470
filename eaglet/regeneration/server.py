"""engine openai of `eaglet regenerate`: an OpenAI-compatible server (`vllm serve`, SGLang) at
regenerate.url generates (eaglet/engines/openai.py speaks its wire format). Here: the checks of
its settings that need no server, opening the client (regenerate.model, or the one model the
server serves), the check that the server runs the target (`check_served_model`), and the text
a reply stores (`server_reply`, `strip_thinking`). Change here what is checked before any
request or how a server's reply is stored."""

from __future__ import annotations

import re
from typing import Any

from ..config import ConfigError, RegenerateSection
from ..engines.openai import OpenAIClient, Reply, ServerError, api_key_from_env
from ..errors import InputError, PreflightError
from ..utils import log


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def strip_thinking(text: str) -> str:
    """`text` without a leading <think>...</think> block: the text after the first </think>
    when what comes before it opens with <think> or, where the template's generation prompt
    opened it, holds no <think>. A reply without </think> (none, or cut inside its thinking
    by max_new_tokens) is kept whole."""
    head, close, tail = text.partition(THINK_CLOSE)
    if close and (head.lstrip().startswith(THINK_OPEN) or THINK_OPEN not in head):
        return tail.strip()
    return text


def server_reply(reply: Reply, eos_text: str | None) -> str:
    """The text a server's reply stores, as `reply_text` (eaglet/engines/hf/generate.py) decodes the
    transformers engines' own: up to
    the EOS text (which a server sends only when it ignores skip_special_tokens), stripped. A
    reasoning part the chat API split off is put back where a thinking template renders it."""
    text = reply.text
    if eos_text and eos_text in text:
        text = text[:text.index(eos_text)]
    text = text.strip()
    if reply.reasoning:
        text = f"{THINK_OPEN}\n{reply.reasoning.strip()}\n{THINK_CLOSE}\n\n{text}"
    return text


def check_server_settings(rc: RegenerateSection) -> str | None:
    """The checks of engine openai's settings that need no server; returns the API key (None: none)."""
    if not rc.url:
        raise ConfigError("regenerate.url: engine openai needs the server's base URL",
                          fix="set regenerate.url (or --url), e.g. http://HOST:8000")
    if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", rc.url):
        raise ConfigError(f"regenerate.url: {rc.url!r} is not an http(s) URL", fix="give one such as http://HOST:8000")
    return api_key_from_env(rc.api_key_env, "regenerate.api_key_env")


# Tokenized by the server and by the target's tokenizer (check_served_model): words, numbers, code,
# accents and three scripts, where tokenizers of different families part.
PROBE_TEXT = ("eaglet probe: The quick brown fox, 12,345.67 km/h (ca. 98.6%)! def f(x):\n\treturn x**2  "
              "# naïve café, Straße; 東京タワー, 北京; Ελληνικά; привет мир 🙂")


def _model_names(name: str) -> set[str]:
    """The names a model path or hub id goes by: its last part (and the name in a hub cache's
    models--ORG--NAME folder), lower case."""
    parts = [p for p in re.split(r"[\\/]", name.strip()) if p]
    names = {parts[-1].lower()} if parts else set()
    return names | {p.split("--")[-1].lower() for p in parts if p.startswith("models--")}


def check_served_model(client: OpenAIClient, tokenizer: Any, target: str) -> str:
    """Before any request: that the server runs the target. Its tokenizer's ids for PROBE_TEXT
    must be the target's (`client.tokenize`); a server without /tokenize is warned about, and its
    served model name must then be the target's (target.path's last part). PreflightError, one
    line, on a mismatch. Returns how it checked: 'tokenizer' or 'name'."""
    theirs = client.tokenize(PROBE_TEXT)
    named = bool(_model_names(client.model or "") & _model_names(target))
    if isinstance(theirs, list):
        ours = list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])
        if theirs != ours:
            at = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
            raise PreflightError(
                f"regenerate.url: the server at {client.url} does not run target.path's tokenizer: its model "
                f"{client.model!r} tokenizes a probe text into {len(theirs)} ids, {target} into {len(ours)}, the first "
                f"difference at position {at}", fix=f"serve the target (vllm serve {target}), or set target.path to "
                "the model the server runs")
        if not named:
            log(f"[regenerate] the server's model {client.model!r} is not named like target.path {target!r}, but its "
                "tokenizer matches the target's")
        return "tokenizer"
    log(f"[warning] regenerate: the server at {client.url} offers no tokenizer to compare with the target's ({theirs}); "
        "checking the served model's name only")
    if not named:
        raise PreflightError(
            f"regenerate.model: the server at {client.url} serves {client.model!r}, not named like target.path "
            f"{target!r}, and has no /tokenize to compare tokenizers", fix=f"serve the target (vllm serve {target}), or "
            "set regenerate.check_served_model=false if the server runs the target under another name")
    return "name"


def open_server(rc: RegenerateSection, api_key: str | None, tokenizer: Any = None, target: str | None = None
                ) -> OpenAIClient:
    """A client of the server at regenerate.url, with regenerate.model or the one model it serves;
    with `tokenizer` (the target's) and regenerate.check_served_model, checked to run `target`."""
    client = OpenAIClient(rc.url, rc.api, rc.model, rc.concurrency, api_key, rc.request_timeout)
    try:
        served = client.served_models()
    except ServerError as e:
        raise InputError(f"regenerate.url: {e}", fix="start the server (vllm serve MODEL --port 8000), or set "
                                                     "regenerate.url to where it runs") from None
    if rc.model is None:
        if len(served) != 1:
            raise ConfigError(f"regenerate.model: the server at {client.url} serves {len(served)} models "
                              f"({', '.join(served) or 'none'})",
                              fix="set regenerate.model (or --model) to one of them")
        client.model = served[0]
    elif rc.model not in served:
        raise ConfigError(f"regenerate.model: {rc.model!r} is not served at {client.url} (it serves "
                          f"{', '.join(served) or 'none'})", fix="set regenerate.model to one of them")
    if tokenizer is not None and rc.check_served_model:
        check_served_model(client, tokenizer, target or "")
    elif tokenizer is not None:
        log(f"[regenerate] not checking that the server at {client.url} runs the target "
            "(regenerate.check_served_model false)")
    return client
