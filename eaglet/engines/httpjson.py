"""JSON over HTTP to a server eaglet does not run: the one place eaglet makes such a call (the
OpenAI-compatible server of `regenerate --engine openai`, eaglet/engines/openai.py; the `vllm
serve` of `extract.vllm_server`, eaglet/engines/vllm/capture.py).

`call_json(url, body, api_key, timeout)` sends one request (GET without a body, POST with one)
and returns its JSON answer. Two promises the standard library's urlopen does not keep:

- `timeout` is a deadline on the whole call: connecting, sending, the status line, the headers
  and the body, across redirects. urlopen's timeout bounds each socket operation, so a server
  that trickles its answer (a byte now and then) never times out; here every read waits at most
  until the deadline and none starts after it (TimeoutError).
- The API key (`Authorization: Bearer ...`) goes to the URL's origin only (scheme, host and
  port): a redirect to another origin is followed without it; one within the origin keeps it.

Errors are urllib's (HTTPError with the server's answer, URLError), TimeoutError,
http.client.HTTPException, and ValueError for an answer that is not JSON. `describe` makes any
of them one line with the key `redact`ed. `warn_plain_http` says when a key would cross the
network unencrypted. The key itself is read from the environment (`api_key_from_env`) and is
never logged.
"""

from __future__ import annotations

import http.client
import io
import ipaddress
import json
import os
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from functools import partial
from typing import Any

from ..errors import ConfigError
from ..utils import log

QUOTE_CHARS = 300  # the most of a server's answer quoted in a message
BEARER = re.compile(r"(?i)(bearer\s+)[^\s\"',;]+")


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
    """`text` without the key (anywhere, bare or quoted) and without any bearer token (a server may
    echo the request's headers)."""
    if api_key:
        text = text.replace(api_key, "***")
    return BEARER.sub(r"\1***", text)


def quote(text: str, api_key: str | None, chars: int = QUOTE_CHARS) -> str:
    """`text` redacted, on one line, at most `chars` characters."""
    return " ".join(redact(text, api_key).split())[:chars]


def is_timeout(e: BaseException) -> bool:
    return isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError)


def describe(e: BaseException, timeout: float, api_key: str | None) -> str:
    """A failed call as one line: 'HTTP <code> <the answer>', 'no answer within <timeout> s', or
    the error; the key redacted."""
    if isinstance(e, urllib.error.HTTPError):
        try:
            body = e.read().decode(errors="replace")
        except (OSError, http.client.HTTPException):
            body = ""
        return f"HTTP {e.code} {quote(body, api_key)}".rstrip()
    if is_timeout(e):
        return f"no answer within {timeout:g} s"
    return quote(f"{type(e).__name__}: {getattr(e, 'reason', e)}", api_key)


def origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of `url`, the port made explicit."""
    u = urllib.parse.urlsplit(url)
    scheme = u.scheme.lower()
    return scheme, (u.hostname or "").lower(), u.port or {"http": 80, "https": 443}.get(scheme)


def is_local_host(host: str) -> bool:
    """localhost, 127.0.0.0/8 or ::1: a connection that never leaves this machine."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_plain_http(url: str, api_key: str | None, setting: str) -> bool:
    """Warn (one line, without the key) when `api_key` would go over plain http:// to a host other
    than this machine; True when it warned."""
    scheme, host, _ = origin(url)
    if not api_key or scheme != "http" or is_local_host(host):
        return False
    log(f"[warning] {setting}: the API key goes unencrypted over plain http:// to {host}: anyone on the way can "
        "read it; use https:// (or a tunnel to localhost)")
    return True


# ---- the deadline ---------------------------------------------------------------------------

def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the request's deadline passed")
    return left


class _DeadlineReader(io.RawIOBase):
    """The socket's reads, each waiting at most until the deadline, none starting after it."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock, self._raw, self._deadline = sock, sock.makefile("rb", buffering=0), deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        self._sock.settimeout(_left(self._deadline))
        return self._raw.readinto(b)

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


class _DeadlineSocket:
    """A connected socket whose sends and reads (http.client's only uses of it) end by the deadline."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock, self._deadline = sock, deadline

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def sendall(self, data: Any, *args: Any) -> None:
        self._sock.settimeout(_left(self._deadline))  # sendall's timeout is its whole duration
        self._sock.sendall(data, *args)

    def makefile(self, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if mode != "rb":
            raise ValueError(f"makefile({mode!r}): only 'rb' is supported")
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))


class _Deadline:
    def __init__(self, *args: Any, deadline: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.deadline = deadline

    def connect(self) -> None:
        self.timeout = _left(self.deadline)  # the TCP connect and a TLS handshake
        super().connect()
        self.sock = _DeadlineSocket(self.sock, self.deadline)


class _HTTPConnection(_Deadline, http.client.HTTPConnection):
    pass


class _HTTPSConnection(_Deadline, http.client.HTTPSConnection):
    pass


class _HTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(partial(_HTTPConnection, deadline=req.deadline), req)  # type: ignore[attr-defined]


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(partial(_HTTPSConnection, deadline=req.deadline), req,  # type: ignore[attr-defined]
                            context=self._context)


class _KeyStaysAtItsOrigin(urllib.request.HTTPRedirectHandler):
    """urllib's redirects, but the Authorization header only within the origin that was asked."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> urllib.request.Request | None:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None:
            new.deadline = req.deadline  # type: ignore[attr-defined]
            if origin(new.full_url) != origin(req.full_url):
                for held in (new.headers, new.unredirected_hdrs):
                    for k in [k for k in held if k.lower() == "authorization"]:
                        del held[k]
        return new


_OPENER = urllib.request.build_opener(_KeyStaysAtItsOrigin, _HTTPHandler, _HTTPSHandler)


def call_json(url: str, body: Any = None, api_key: str | None = None, timeout: float = 60.0) -> Any:
    """The JSON answer to one request to `url` (GET without `body`, POST of `body` as JSON), all of
    it within `timeout` seconds. Raises the errors the module doc lists."""
    headers = {**auth_headers(api_key), **({"Content-Type": "application/json"} if body is not None else {})}
    data = None if body is None else json.dumps(body, allow_nan=False).encode()
    req = urllib.request.Request(url, data=data, headers=headers)
    req.deadline = time.monotonic() + timeout  # type: ignore[attr-defined]
    with _OPENER.open(req, timeout=timeout) as r:
        return json.loads(r.read())
