"""`eaglet regenerate --engine openai` against a local OpenAI-compatible server (the wire format
vLLM and SGLang speak), with no weights loaded here: the records, the loss mask prepare finds in
them, bounded concurrency, resume after the server fails, the row accounting, the API key kept
out of everything written, and the thinking part."""

import json
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eaglet import cli
from eaglet.config import ConfigError, dump_config, load_config
from eaglet.engines import openai as oa
from eaglet.errors import InputError, PreflightError, ResumeError
from eaglet.regeneration import output, server
from eaglet.stages import regenerate as regen
from eaglet.targets.chat import Settings, generation_prompt, process_record
from eaglet.testing import tiny

KEY = "sk-test-Zq81secret"
WORDS = ["the blue cat", "a quick answer", "so it goes", "more words here", "one two"]
EOS = "<|im_end|>"


class _HangUpQuietServer(ThreadingHTTPServer):
    """A client that hangs up before its answer is written (a run stopped at its limit) is the
    tests' business, not a server error to print."""

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class Server:
    """An OpenAI-compatible server: /v1/models, /v1/completions (token-id prompts) and
    /v1/chat/completions. Each reply is a fixed function of its prompt (`reply_for`), encoded and
    decoded with the tiny tokenizer, its usage.completion_tokens the reply's tokens and the EOS.

    key: the Bearer key it requires (a wrong one: 401 quoting the key it got, bare, without
    "Bearer "); fail_after: requests answered before every later one gets HTTP 500; flaky: the
    first attempt of every prompt gets 503; reject: words whose prompts (decoded, or the messages'
    contents) get HTTP 400 quoting the request's Authorization header and the bare key; think:
    replies open with a <think> block (chat: in reasoning_content); delay: seconds per request.
    tokenize: /tokenize (vLLM's route) and /v1/tokenize (SGLang's) answer with the tiny
    tokenizer's ids ('same'), those ids + 1 ('other': another tokenizer), only /v1/tokenize
    ('sglang'), or not at all (None: 404). text: the reply's text (completions) or content (chat)
    in place of the real one (None: JSON null). length: the prompts (token ids, or messages)
    whose reply says finish_reason 'length'. trickle: seconds between the bytes of a completion's
    answer ('body': after its headers; 'headers': from its status line on). redirect: path -> URL
    that the path is redirected to (302)."""

    NO_TEXT = object()

    def __init__(self, tok, models=("tiny",), key=None, fail_after=None, flaky=False, reject=(), think=False,
                 delay=0.0, tokenize="same", text=NO_TEXT, length=lambda prompt: False, trickle=None, redirect=None):
        self.tok, self.models, self.key, self.fail_after, self.flaky = tok, list(models), key, fail_after, flaky
        self.reject, self.think, self.delay = set(reject), think, delay
        self.tokenize, self.text, self.length, self.trickle = tokenize, text, length, trickle
        self.redirect = dict(redirect or {})
        self.lock = threading.RLock()  # _send takes it, sometimes inside _answer's hold
        self.in_flight = self.max_in_flight = self.answered = self.requests = 0
        self.bodies, self.auth, self.seen, self.tokenize_calls = [], [], set(), []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, obj, trickle=None):
                self._done()  # a request stops counting as in flight before its answer leaves: the client
                data = json.dumps(obj).encode()  # may send its next one the moment it reads this one
                head = (f"HTTP/1.1 {code} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                        "Connection: close\r\n\r\n").encode()
                if trickle is None:
                    return self.wfile.write(head + data)
                step, what = trickle
                if what == "body":
                    self.wfile.write(head)
                    self.wfile.flush()
                for i in range(len(head) if what == "headers" else 0, len(head + data)):
                    time.sleep(step)  # a byte at a time: each read is quick, the whole answer is not
                    self.wfile.write((head + data)[i:i + 1])
                    self.wfile.flush()
                self.close_connection = True

            def _redirected(self):
                to = server.redirect.get(self.path)
                if to is None:
                    return False
                self.send_response(302)
                self.send_header("Location", to)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return True

            def _authorized(self):
                got = self.headers.get("Authorization")
                server.auth.append(got)
                if server.key is not None and got != f"Bearer {server.key}":
                    bare = (got or "").removeprefix("Bearer ")
                    self._send(401, {"error": f"invalid API key {bare}"})
                    return False
                return True

            def do_GET(self):
                if self.path == "/version":
                    return self._send(200, {"version": "fake"})
                if not self._authorized() or self._redirected():
                    return None
                if self.path == "/v1/models":
                    return self._send(200, {"object": "list", "data": [{"id": m} for m in server.models]})
                return self._send(404, {"error": "not found"})

            def _tokenize(self, body):
                if server.tokenize is None or (server.tokenize == "sglang" and self.path != "/v1/tokenize"):
                    return self._send(404, {"detail": "Not Found"})
                ids = server.tok(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
                ids = [i + 1 for i in ids] if server.tokenize == "other" else ids
                return self._send(200, {"count": len(ids), "max_model_len": 4096, "tokens": ids})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not self._authorized() or self._redirected():
                    return
                if self.path in ("/tokenize", "/v1/tokenize"):
                    with server.lock:
                        server.tokenize_calls.append((self.path, body))
                    return self._tokenize(body)
                with server.lock:
                    server.requests += 1
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                    server.bodies.append((self.path, body))
                    self._counted = True
                try:
                    time.sleep(server.delay)
                    self._answer(body)
                finally:
                    self._done()

            def _done(self):
                with server.lock:
                    if getattr(self, "_counted", False):
                        server.in_flight -= 1
                        self._counted = False

            def _answer(self, body):
                prompt = body.get("prompt", body.get("messages"))
                key = json.dumps(prompt)
                with server.lock:
                    first = key not in server.seen
                    server.seen.add(key)
                    if server.fail_after is not None and server.answered >= server.fail_after:
                        return self._send(500, {"error": "engine dead"})
                    if server.flaky and first:
                        return self._send(503, {"error": "overloaded"})
                reply = server.reply_for(prompt)
                text = " ".join(m["content"] for m in prompt) if self.path.endswith("chat/completions") \
                    else server.tok.decode(prompt)
                if any(w in text for w in server.reject):
                    got = self.headers.get("Authorization") or ""
                    return self._send(400, {"error": f"rejected; request headers: Authorization: {got}; the key "
                                                     f"{got.removeprefix('Bearer ')} may not ask this"})
                tokens = len(server.tok(reply, add_special_tokens=False)["input_ids"]) + 1  # and the EOS
                thought = "Let me see the question."
                tail = "" if body.get("skip_special_tokens") is True else EOS  # as vLLM decodes
                finish = "length" if server.length(prompt) else "stop"
                if self.path == "/v1/completions":
                    text = (f"<think>\n{thought}\n</think>\n\n" if server.think else "") + reply + tail
                    choice = {"index": 0, "text": text if server.text is Server.NO_TEXT else server.text,
                              "finish_reason": finish}
                elif self.path == "/v1/chat/completions":
                    msg = {"role": "assistant", "content": reply if server.text is Server.NO_TEXT else server.text}
                    if server.think:
                        msg["reasoning_content"] = thought
                    choice = {"index": 0, "message": msg, "finish_reason": finish}
                else:
                    return self._send(404, {"error": "not found"})
                with server.lock:
                    server.answered += 1
                self._send(200, {"choices": [choice], "usage": {"completion_tokens": tokens}},
                           trickle=server.trickle)

        self.httpd = _HangUpQuietServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True).start()

    def reply_for(self, prompt) -> str:
        """A reply determined by the prompt's length (token ids, or messages)."""
        n = len(prompt)
        return f"Answer {n}: {WORDS[n % len(WORDS)]}. Yes"

    def tokens(self, text: str) -> int:
        return len(self.tok(text, add_special_tokens=False)["input_ids"]) + 1

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer("chatml")


@pytest.fixture(scope="module")
def target(tmp_path_factory, tok):
    """A target folder without weights (its config and tokenizer): engine openai never loads them."""
    out = tmp_path_factory.mktemp("target")
    tok.save_pretrained(out)
    tiny.tiny_config(vocab_size=len(tok)).save_pretrained(out)
    return out


@pytest.fixture
def serve(tok):
    servers = []

    def start(**kw):
        servers.append(Server(tok, **kw))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


@pytest.fixture(autouse=True)
def _no_backoff(monkeypatch):
    monkeypatch.setattr(oa, "BACKOFF_S", 0.0)


def _cfg(target, data, *extra):
    return load_config(None, [f"target.path={target}", f"prepare.data=[{data}]", *extra])


def _lines(path):
    return [json.loads(ln) for ln in Path(path).read_text().splitlines()] if Path(path).is_file() else []


def _data(tmp_path, n, seed=2, max_turns=2, broken=False):
    data = tiny.write_jsonl(tmp_path / "data.jsonl", tiny.make_conversations(n, seed=seed, max_turns=max_turns))
    if broken:
        with data.open("a") as f:
            f.write("{broken\n")
    return data


def test_records_are_the_servers_replies_and_prepare_masks_exactly_them(tmp_path, target, tok, serve):
    srv = serve(delay=0.01)
    data = _data(tmp_path, 6, broken=True)
    cfg = _cfg(target, data)
    out = tmp_path / "regen.jsonl"
    stats = regen.run_regenerate(cfg, out, engine="openai", url=srv.url, concurrency=2, max_new_tokens=9)
    records = _lines(out)
    assert sorted(r["source"]["row"] for r in records) == list(range(1, 7))
    # Every request: the token ids of the conversation so far in the target's template, as the HF engines send.
    template = tok.chat_template
    want_prompts = []
    for rec in records:
        msgs = rec["messages"]
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                ids = generation_prompt(tok, template, msgs[:i])
                assert m["content"] == srv.reply_for(ids) and EOS not in m["content"]
                want_prompts.append(ids)
    assert sorted(b["prompt"] for _, b in srv.bodies) == sorted(want_prompts)
    assert all(b["model"] == "tiny" and b["max_tokens"] == 9 and b["temperature"] == 0.0
               and b["skip_special_tokens"] is True for _, b in srv.bodies)
    # prepare's loss mask is exactly the replies' tokens, each closed by the template's EOS.
    settings = Settings.of(cfg.prepare, template)
    for rec in records:
        o = process_record(rec["source"]["row"], rec, tok, settings)
        masked = [int(t) for t, m in zip(o.input_ids, o.loss_mask) if m]
        replies = [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
        assert masked == [t for r in replies for t in [*tok(r, add_special_tokens=False)["input_ids"], tok.eos_token_id]]
    # Accounting: the broken row skipped, nothing failed; the tokens are the server's usage.
    assert (stats["written"], stats["failed"], stats["skipped"], stats["records"]) == (6, 0, 1, 7)
    assert stats["new_tokens"] == sum(srv.tokens(srv.reply_for(b["prompt"])) for _, b in srv.bodies) > 0
    manifest = json.loads(output.manifest_path(out).read_text())
    assert manifest["written"] + manifest["failed"] + manifest["skipped"] == manifest["input"] == 7
    assert manifest["model"] == "tiny" and manifest["regenerate"]["engine"] == "openai"
    assert 1 < srv.max_in_flight <= 2  # concurrency 2: in parallel, never more


def test_concurrency_is_bounded_and_preflight_loads_no_weights(tmp_path, target, serve, monkeypatch):
    """The target folder has no weights, and the padded engine's contract (model.generate, here
    with a new required keyword) is none of engine openai's."""
    from transformers import GenerationMixin

    def generate(self, inputs=None, generation_config=None, *, stream_id, **kwargs):
        raise AssertionError("never run")

    monkeypatch.setattr(GenerationMixin, "generate", generate)
    monkeypatch.setattr(regen, "load_target", lambda t: pytest.fail("engine openai loaded the target"))
    srv = serve(delay=0.03)
    data = _data(tmp_path, 12, max_turns=1)
    stats = regen.run_regenerate(_cfg(target, data), tmp_path / "o.jsonl", preflight=True, engine="openai",
                                 url=srv.url, concurrency=3, max_new_tokens=4)
    assert stats["written"] == 12 and srv.requests == 12
    assert srv.max_in_flight == 3


def test_a_rerun_after_the_server_failed_finishes_without_duplicates(tmp_path, target, serve, capsys):
    data = _data(tmp_path, 8, max_turns=3, broken=True)
    cfg = _cfg(target, data)
    out = tmp_path / "regen.jsonl"
    srv = serve(fail_after=5)  # then HTTP 500 for good: each later request is tried 1 + RETRIES times
    s1 = regen.run_regenerate(cfg, out, engine="openai", url=srv.url, concurrency=2, max_new_tokens=4, batch_size=4)
    assert s1["failed"] > 0 and s1["written"] + s1["failed"] + s1["skipped"] == s1["records"] == 9
    failed = [r for r in _lines(str(out) + ".skipped.jsonl") if r["reason"] == output.REQUEST_FAILED]
    assert len(failed) == s1["failed"]
    assert all(r["source"]["file"] == str(data) and "HTTP 500" in r["detail"]
               and f"{1 + oa.RETRIES} attempts" in r["detail"]
               for r in failed)
    assert srv.requests == srv.answered + s1["failed"] * (1 + oa.RETRIES) and srv.answered >= 5
    assert "requests failed (first: " in capsys.readouterr().err
    m1 = json.loads(output.manifest_path(out).read_text())
    assert (m1["written"], m1["failed"], m1["skipped"]) == (s1["written"], s1["failed"], 1)

    srv2 = serve(flaky=True)  # every request's first attempt gets 503: retried, all answered
    s2 = regen.run_regenerate(cfg, out, engine="openai", url=srv2.url, concurrency=2, max_new_tokens=4)
    assert s2["records"] == s1["failed"] and s2["written"] == s1["failed"] and s2["failed"] == s2["skipped"] == 0
    assert srv2.requests == 2 * s2["replies"]
    rows = [r["source"]["row"] for r in _lines(out)]
    assert sorted(rows) == list(range(1, 9))  # each once
    m2 = json.loads(output.manifest_path(out).read_text())  # this run's own figures
    n = s1["failed"]
    assert (m2["input"], m2["written"], m2["failed"], m2["resumed"]) == (n, n, 0, 9 - n)
    whole = tmp_path / "whole.jsonl"
    regen.run_regenerate(cfg, whole, engine="openai", url=serve().url, max_new_tokens=4)
    assert sorted(map(json.dumps, _lines(whole))) == sorted(map(json.dumps, _lines(out)))


def test_a_request_that_times_out_fails_without_a_retry(tmp_path, target, serve):
    srv = serve(delay=0.4)
    data = _data(tmp_path, 2, max_turns=1)
    out = tmp_path / "regen.jsonl"
    stats = regen.run_regenerate(_cfg(target, data), out, engine="openai", url=srv.url, request_timeout=0.1)
    assert (stats["written"], stats["failed"], srv.requests) == (0, 2, 2)
    assert all(r["detail"] == "/v1/completions: no answer within 0.1 s" for r in _lines(str(out) + ".skipped.jsonl"))


def test_the_api_key_is_sent_and_written_nowhere(tmp_path, target, tok, serve, monkeypatch, capsys):
    monkeypatch.setenv("EAGLET_TEST_KEY", KEY)
    data = tiny.write_jsonl(tmp_path / "data.jsonl", [
        {"messages": [{"role": "user", "content": f"Tell me about {w}."}, {"role": "assistant", "content": "old"}]}
        for w in ("cats", "dogs", "birds", "fish")])
    cfg = _cfg(target, data, "regenerate.api_key_env=EAGLET_TEST_KEY")
    srv = serve(key=KEY, reject={"dogs"})  # row 2's request: HTTP 400 quoting the Authorization header
    out = tmp_path / "regen.jsonl"
    stats = regen.run_regenerate(cfg, out, engine="openai", url=srv.url, max_new_tokens=4)
    assert (stats["written"], stats["failed"]) == (3, 1)
    assert srv.auth and all(a == f"Bearer {KEY}" for a in srv.auth)  # /v1/models and every completion
    failed = _lines(str(out) + ".skipped.jsonl")
    assert failed[0]["source"]["row"] == 2 and "HTTP 400" in failed[0]["detail"] and "Bearer ***" in failed[0]["detail"]
    err = capsys.readouterr()
    written = [dump_config(cfg), err.out, err.err, *(p.read_text() for p in tmp_path.glob("regen.jsonl*"))]
    assert not [w for w in written if KEY in w]
    assert "Bearer ***" in err.err  # the failure's reason, redacted, in the round's line

    # A wrong key: the server's 401 quotes what it got, and the error does not.
    monkeypatch.setenv("EAGLET_TEST_KEY", "sk-wrong-Xy77secret")
    with pytest.raises(InputError, match="HTTP 401") as e:
        regen.run_regenerate(cfg, tmp_path / "x.jsonl", engine="openai", url=srv.url)
    assert "sk-wrong-Xy77secret" not in str(e.value) + "".join(capsys.readouterr()) and "\n" not in str(e.value)

    # No such variable: one line, naming the variable and the setting.
    monkeypatch.delenv("EAGLET_TEST_KEY")
    (tmp_path / "c.yaml").write_text("{}\n")
    code = cli.main(["regenerate", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "y.jsonl"), "--engine", "openai",
                     "--url", srv.url, "--api-key-env", "EAGLET_TEST_KEY", "--set", f"target.path={target}",
                     "--set", f"prepare.data=[{data}]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "regenerate.api_key_env" in err[0] and "EAGLET_TEST_KEY is not set" in err[0]


def test_extract_server_engine_sends_the_key_and_quotes_no_header(serve, tok, monkeypatch):
    from eaglet.engines.vllm.capture import ServerEngine

    monkeypatch.setenv("EAGLET_TEST_KEY", KEY)
    srv = serve(key=KEY, reject={"dogs"})
    engine = ServerEngine(srv.url, 2, api_key_env="EAGLET_TEST_KEY")
    assert engine.model == "tiny" and srv.auth == [f"Bearer {KEY}"]
    with pytest.raises(RuntimeError, match="HTTP 400") as e:
        engine._post(0, tok("About dogs", add_special_tokens=False)["input_ids"], None)
    assert srv.auth[-1] == f"Bearer {KEY}" and KEY not in str(e.value) and "Bearer ***" in str(e.value)
    assert oa.redact("Authorization: Bearer sk-other-1 and more", None) == "Authorization: Bearer *** and more"
    monkeypatch.delenv("EAGLET_TEST_KEY")
    with pytest.raises(ConfigError, match="extract.vllm_server_api_key_env: the environment variable EAGLET_TEST_KEY"):
        ServerEngine(srv.url, 2, api_key_env="EAGLET_TEST_KEY")


def test_thinking_kept_or_dropped_in_both_apis(tmp_path, target, tok, serve):
    srv = serve(think=True)
    data = _data(tmp_path, 3, max_turns=2)
    cfg = _cfg(target, data)
    contents = {}
    for api in ("completions", "chat"):
        for drop in (False, True):
            out = tmp_path / f"{api}-{drop}.jsonl"
            regen.run_regenerate(cfg, out, engine="openai", url=srv.url, api=api, drop_thinking=drop, max_new_tokens=8)
            contents[api, drop] = [[m["content"] for m in r["messages"] if m["role"] == "assistant"]
                                   for r in sorted(_lines(out), key=lambda r: r["source"]["row"])]
    kept = [c for r in contents["completions", False] for c in r]
    assert kept and all(c.startswith("<think>\nLet me see the question.\n</think>\n\nAnswer ") for c in kept)
    for api in ("completions", "chat"):
        assert all(c.startswith("Answer ") and "think>" not in c for r in contents[api, True] for c in r)
    # Chat: the server renders; the messages so far are sent, the reasoning put back as the template renders it.
    chat = [b for route, b in srv.bodies if route == "/v1/chat/completions"]
    assert chat and all(b["messages"][-1]["role"] == "user" and "prompt" not in b for b in chat)
    assert all(c.startswith("<think>\nLet me see the question.\n</think>\n\nAnswer ")
               for r in contents["chat", False] for c in r)
    # The template's generation prompt may open the block itself: the reply starts inside it.
    assert server.strip_thinking("I think so.\n</think>\n\nYes.") == "Yes."
    assert server.strip_thinking("<think>cut by max_new_tokens") == "<think>cut by max_new_tokens"
    assert server.strip_thinking("Plain <think>x</think> reply") == "Plain <think>x</think> reply"


def test_bad_settings_are_one_line_errors_naming_the_setting(tmp_path, target, serve, capsys):
    data = _data(tmp_path, 2, max_turns=1)
    cfg = _cfg(target, data)
    out = tmp_path / "o.jsonl"
    with pytest.raises(ConfigError, match="regenerate.url: engine openai needs"):
        regen.run_regenerate(cfg, out, engine="openai")
    with pytest.raises(ConfigError, match="regenerate.url: 'localhost:8000' is not an http"):
        regen.run_regenerate(cfg, out, engine="openai", url="localhost:8000")
    two = serve(models=("a", "b"))
    with pytest.raises(ConfigError, match=r"regenerate.model: the server at .* serves 2 models \(a, b\)"):
        regen.run_regenerate(cfg, out, engine="openai", url=two.url)
    with pytest.raises(ConfigError, match="regenerate.model: 'c' is not served"):
        regen.run_regenerate(cfg, out, engine="openai", url=two.url, model="c")
    assert regen.run_regenerate(cfg, out, engine="openai", url=two.url + "/v1/", model="b")["written"] == 2
    dead = serve()
    dead.close()
    with pytest.raises(InputError, match="regenerate.url: no OpenAI-compatible answer from"):
        regen.run_regenerate(cfg, tmp_path / "p.jsonl", engine="openai", url=dead.url)
    # The flags, a boolean one among them.
    (tmp_path / "c.yaml").write_text("{}\n")
    srv = serve(think=True)
    flags = ["--engine", "openai", "--url", srv.url, "--api", "chat", "--concurrency", "1", "--drop-thinking",
             "--request-timeout", "30", "--max-new-tokens", "5"]
    assert cli.main(["regenerate", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "q.jsonl"), *flags,
                     "--set", f"target.path={target}", "--set", f"prepare.data=[{data}]"]) == 0
    assert srv.max_in_flight == 1 and all(route == "/v1/chat/completions" for route, _ in srv.bodies)
    assert all("think" not in m["content"] for r in _lines(tmp_path / "q.jsonl") for m in r["messages"])
    code = cli.main(["regenerate", str(tmp_path / "c.yaml"), "--out", str(out), "--engine", "openai",
                     "--set", f"target.path={target}", "--set", f"prepare.data=[{data}]"])
    assert code == 2 and capsys.readouterr().err.strip().splitlines()[-1].startswith("eaglet: regenerate.url:")


def test_regen_openai_bench_reports_the_runs_figures(tmp_path, target, serve):
    from conftest import run_script

    srv = serve()
    data = _data(tmp_path, 5, max_turns=2)
    bench = Path(__file__).parent.parent / "bench" / "regen_openai.py"
    res_path = tmp_path / "r.json"
    run_script(bench, ["--url", srv.url, "--target", str(target), "--data", str(data), "--out",
                       str(tmp_path / "o.jsonl"), "--json", str(res_path), "--max-new-tokens", "6", "--wait", "5"])
    res = json.loads(res_path.read_text())
    assert (res["written"], res["failed"], res["skipped"], res["input"]) == (5, 0, 0, 5)
    assert srv.requests == 5  # --max-turns 1: the first replies only
    assert res["new_tokens"] == sum(srv.tokens(srv.reply_for(b["prompt"])) for _, b in srv.bodies)
    assert res["tokens_per_s"] > 0 and res["seconds"] > 0 and res["model"] == "tiny"


# ---- timeouts and replies -------------------------------------------------------------------

@pytest.mark.parametrize("trickle", ["body", "headers"])
def test_a_trickled_answer_ends_at_the_request_deadline(tmp_path, target, serve, tok, trickle):
    """request_timeout bounds the whole request: an answer that trickles in a byte every 20 ms (each
    read well within the timeout, the whole answer several seconds) fails at the deadline. The
    vLLM server client (extract.vllm_server) keeps the same deadline."""
    from eaglet.engines.vllm.capture import ServerEngine

    srv = serve(trickle=(0.02, trickle))
    data = _data(tmp_path, 2, max_turns=1)
    out = tmp_path / "regen.jsonl"
    stats = regen.run_regenerate(_cfg(target, data), out, engine="openai", url=srv.url, request_timeout=0.5)
    assert (stats["written"], stats["failed"], srv.requests) == (0, 2, 2)  # not retried
    assert [r["detail"] for r in _lines(str(out) + ".skipped.jsonl")] == ["/v1/completions: no answer within 0.5 s"] * 2
    engine = ServerEngine(srv.url, 1, timeout=0.5)  # its /version and /v1/models answer at once
    with pytest.raises(TimeoutError, match="no answer for sample 7 within 0.5 s"):
        engine._post(7, tok("About cats", add_special_tokens=False)["input_ids"], None)


@pytest.mark.parametrize("api,text,why", [
    ("completions", None, "choices[0].text is null, not a string"),
    ("completions", 12345, "choices[0].text is 12345 (int), not a string"),
    ("chat", 12345, "choices[0].message.content is 12345 (int), not a string"),
    ("chat", None, "choices[0].message.content is null, not a string"),  # and no reasoning either
])
def test_a_reply_that_is_not_text_is_counted_and_never_stored(tmp_path, target, serve, api, text, why):
    srv = serve(text=text)
    data = _data(tmp_path, 3, max_turns=1)
    out = tmp_path / "regen.jsonl"
    stats = regen.run_regenerate(_cfg(target, data), out, engine="openai", url=srv.url, api=api)
    assert (stats["written"], stats["failed"], stats["bad_replies"], stats["replies"]) == (0, 3, 3, 0)
    assert not out.is_file() or out.read_text() == ""
    failed = _lines(str(out) + ".skipped.jsonl")
    route = "/v1/completions" if api == "completions" else "/v1/chat/completions"
    assert len(failed) == 3 and all(r["reason"] == output.REQUEST_FAILED and r["detail"].startswith(
        f"{route}: bad reply: {why}: ") for r in failed)
    assert json.loads(output.manifest_path(out).read_text())["bad_replies"] == 3
    # A reply that is all reasoning (content null, cut inside its thinking) is a reply.
    assert oa.OpenAIClient("http://127.0.0.1:1", "chat").reply(
        {"choices": [{"message": {"content": None, "reasoning_content": "Hm"}, "finish_reason": "length"}]}
    ) == oa.Reply("", 0, "Hm", "length")


def test_replies_cut_at_max_new_tokens_are_kept_and_counted(tmp_path, target, serve, capsys):
    srv = serve(length=lambda prompt: len(prompt) % 2 == 0)  # the replies to even-length prompts are cut
    data = _data(tmp_path, 6, max_turns=2)
    out = tmp_path / "regen.jsonl"
    stats = regen.run_regenerate(_cfg(target, data), out, engine="openai", url=srv.url, max_new_tokens=9)
    cut = [b["prompt"] for _, b in srv.bodies if len(b["prompt"]) % 2 == 0]
    assert 0 < len(cut) < len(srv.bodies) == stats["replies"]
    assert stats["cut_at_max_new_tokens"] == len(cut) == json.loads(output.manifest_path(out).read_text())[
        "cut_at_max_new_tokens"]
    kept = [m["content"] for r in _lines(out) for m in r["messages"] if m["role"] == "assistant"]
    assert sorted(kept) == sorted(srv.reply_for(b["prompt"]) for _, b in srv.bodies)  # every reply kept
    err = capsys.readouterr().err
    assert f"{len(cut)} of them cut at max_new_tokens 9 (kept as the target wrote them)" in err


@pytest.mark.parametrize("flag,value,says", [
    ("--request-timeout", "1e300", "regenerate.request_timeout: 1e+300 is not in (0, 1000000]"),
    ("--request-timeout", "0", "regenerate.request_timeout: 0.0 is not in (0, 1000000]"),
    ("--concurrency", "100000", "regenerate.concurrency: 100000 is not in [1, 4096]"),
    ("--max-new-tokens", "10000000000", "regenerate.max_new_tokens: 10000000000 is not in [1, 1048576]"),
    ("--temperature", "1e308", "regenerate.temperature: 1e+308 is not in [0, 100]"),
    ("--batch-size", "100000000000", "regenerate.batch_size: 100000000000 is not in [1, 1048576]"),
])
def test_numbers_out_of_range_are_one_line_errors(tmp_path, target, serve, capsys, flag, value, says):
    srv = serve()
    data = _data(tmp_path, 1, max_turns=1)
    (tmp_path / "c.yaml").write_text("{}\n")
    code = cli.main(["regenerate", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "o.jsonl"), "--engine", "openai",
                     "--url", srv.url, flag, value, "--set", f"target.path={target}", "--set", f"prepare.data=[{data}]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert (code, len(err)) == (2, 1) and err[0].startswith(f"eaglet: {says}; set a value in ")
    assert srv.requests == 0


# ---- the server runs the target; a resume runs the same settings -----------------------------

def test_a_server_that_runs_another_model_is_refused_before_any_request(tmp_path, target, serve, capsys):
    data = _data(tmp_path, 2, max_turns=1)
    cfg = _cfg(target, data)
    out = tmp_path / "new" / "o.jsonl"
    other = serve(tokenize="other")  # another tokenizer's ids for the same text
    with pytest.raises(PreflightError, match=r"regenerate.url: the server at .* does not run target.path's tokenizer: "
                                             r"its model 'tiny' tokenizes a probe text into \d+ ids"):
        regen.run_regenerate(cfg, out, engine="openai", url=other.url)
    assert not out.parent.exists()  # a refused command leaves no folder behind
    assert other.requests == 0 and other.tokenize_calls[0] == (
        "/tokenize", {"model": "tiny", "prompt": server.PROBE_TEXT, "add_special_tokens": False})
    # SGLang's route: the same check.
    sglang = serve(tokenize="sglang", models=("an-alias",))
    assert regen.run_regenerate(cfg, out, engine="openai", url=sglang.url)["written"] == 2
    assert [p for p, _ in sglang.tokenize_calls] == ["/tokenize", "/v1/tokenize"]
    assert "not named like target.path" in capsys.readouterr().err  # a note only: its tokenizer matched

    # No /tokenize: a warning, then the served name must be the target's.
    bare = serve(tokenize=None, models=("some-other-model",))
    with pytest.raises(PreflightError, match="regenerate.model: the server at .* serves 'some-other-model', not named "
                                             "like target.path"):
        regen.run_regenerate(cfg, tmp_path / "p.jsonl", engine="openai", url=bare.url)
    assert "offers no tokenizer to compare with the target's (/tokenize: HTTP 404" in capsys.readouterr().err
    assert bare.requests == 0
    named = serve(tokenize=None, models=(f"/models/{Path(target).name}",))
    assert regen.run_regenerate(cfg, tmp_path / "q.jsonl", engine="openai", url=named.url)["written"] == 2
    assert regen.run_regenerate(cfg, tmp_path / "r.jsonl", engine="openai", url=bare.url,
                                check_served_model=False)["written"] == 2


def test_a_resume_with_other_settings_is_refused_also_after_a_kill(tmp_path, target, serve, capsys):
    """40 records at T=0 from one model and 160 at T=0.9 from another in one file would be two runs
    mixed: a rerun with another model, temperature or max_new_tokens is refused (exit 6), also when
    the first run was killed before its manifest was written."""
    data = _data(tmp_path, 6, max_turns=1)
    cfg = _cfg(target, data)
    out = tmp_path / "regen.jsonl"
    first = serve(fail_after=3)
    s1 = regen.run_regenerate(cfg, out, engine="openai", url=first.url, max_new_tokens=8, concurrency=1)
    assert s1["written"] == 3 and s1["failed"] == 3
    output.manifest_path(out).unlink()  # as a kill leaves it
    other = serve(models=("tiny-2",))  # the same tokenizer, another model
    for change, key in [({"temperature": 0.9}, "regenerate.temperature=0.0"),
                        ({"max_new_tokens": 16}, "regenerate.max_new_tokens=8"),
                        ({"url": other.url}, "regenerate.model='tiny'")]:
        settings = {"url": first.url, "max_new_tokens": 8, **change}
        with pytest.raises(ResumeError, match=f"regenerate.out: {out} holds records made with {re.escape(key)}; "
                                              "this run has .*: resuming would mix two runs in one output; rerun with"):
            regen.run_regenerate(cfg, out, engine="openai", **settings)
    assert other.requests == 0 and first.requests == 3 + 3 * (1 + oa.RETRIES)
    # The command: one line, exit 6, naming the key and how to start afresh.
    (tmp_path / "c.yaml").write_text("{}\n")
    code = cli.main(["regenerate", str(tmp_path / "c.yaml"), "--out", str(out), "--engine", "openai", "--url",
                     first.url, "--temperature", "0.9", "--max-new-tokens", "8", "--set", f"target.path={target}",
                     "--set", f"prepare.data=[{data}]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 6 and err[-1].startswith("eaglet: regenerate.out:") and "regenerate.temperature=0.0" in err[-1]
    assert "give a new --out" in err[-1]
    # The same settings resume (a new server of the same model), and finish the output.
    s2 = regen.run_regenerate(cfg, out, engine="openai", url=serve().url, max_new_tokens=8)
    assert (s2["resumed"], s2["written"]) == (3, 3) and sorted(r["source"]["row"] for r in _lines(out)) == list(
        range(1, 7))


# ---- the API key ------------------------------------------------------------------------------

def test_the_key_never_follows_a_redirect_to_another_origin(tmp_path, target, serve, tok, monkeypatch):
    """A 302 to another host (here another port: another origin) is followed without the key; a
    redirect within the server's origin keeps it. Both clients: regenerate's and extract.vllm_server's."""
    from eaglet.engines.vllm.capture import ServerEngine

    elsewhere = serve()  # takes no key: records what it is sent
    away = {"/v1/models": elsewhere.url + "/v1/models", "/v1/completions": elsewhere.url + "/v1/completions"}
    srv = serve(key=KEY, redirect={"/v1/moved": "/v1/models", "/v1/away": elsewhere.url + "/v1/models"})
    client = oa.OpenAIClient(srv.url, api_key=KEY)
    assert client._call("/v1/moved")["data"] == [{"id": "tiny"}]  # within the origin: the key goes along
    assert srv.auth == [f"Bearer {KEY}"] * 2
    assert client._call("/v1/away")["data"] == [{"id": "tiny"}] and elsewhere.auth == [None]
    monkeypatch.setenv("EAGLET_TEST_KEY", KEY)
    moving = serve(key=KEY, redirect=away)
    engine = ServerEngine(moving.url, 1, api_key_env="EAGLET_TEST_KEY")  # its /v1/models: from elsewhere
    with pytest.raises(RuntimeError):  # the POST redirected by a 302: a GET there, which answers 404
        engine._post(0, tok("About cats", add_special_tokens=False)["input_ids"], None)
    assert elsewhere.auth == [None] * 3
    # regenerate itself: the redirected /v1/models gets no key.
    data = _data(tmp_path, 1, max_turns=1)
    stats = regen.run_regenerate(_cfg(target, data, "regenerate.api_key_env=EAGLET_TEST_KEY"), tmp_path / "o.jsonl",
                                 engine="openai", url=moving.url)
    assert stats["failed"] == 1 and elsewhere.auth == [None] * 5  # /v1/models, and the completion's GET there


def test_a_key_over_plain_http_to_another_host_is_warned_about(capsys, monkeypatch):
    from eaglet.engines.vllm import capture as vllm

    for url, warned in [("http://gpu-7.example:8000", True), ("http://10.1.2.3:8000/v1", True),
                        ("https://gpu-7.example:8000", False), ("http://localhost:8000", False),
                        ("http://127.8.9.1:8000", False), ("http://[::1]:8000", False)]:
        oa.OpenAIClient(url, api_key=KEY)
        oa.OpenAIClient(url)  # no key: nothing to warn about
        err = capsys.readouterr().err
        assert (err.count("the API key goes unencrypted over plain http://") == 1) is warned and KEY not in err, url
    monkeypatch.setenv("EAGLET_TEST_KEY", KEY)
    monkeypatch.setattr(vllm, "server_version", lambda *a: (_ for _ in ()).throw(ConnectionError("no server here")))
    with pytest.raises(ConnectionError):
        vllm.ServerEngine("http://gpu-7.example:8000", 1, api_key_env="EAGLET_TEST_KEY")
    err = capsys.readouterr().err
    assert "[warning] extract.vllm_server: the API key goes unencrypted over plain http:// to gpu-7.example" in err
