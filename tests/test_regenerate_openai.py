"""`eaglet regenerate --engine openai` against a local OpenAI-compatible server (the wire format
vLLM and SGLang speak), with no weights loaded here: the records, the loss mask prepare finds in
them, bounded concurrency, resume after the server fails, the row accounting, the API key kept
out of everything written, and the thinking part."""

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from eaglet import cli
from eaglet.config import ConfigError, dump_config, load_config
from eaglet.engines import openai as oa
from eaglet.errors import InputError
from eaglet.stages import regenerate as regen
from eaglet.targets.chat import Settings, process_record
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

    key: the Bearer key it requires (a wrong one: 401 quoting the Authorization header it got);
    fail_after: requests answered before every later one gets HTTP 500; flaky: the first attempt
    of every prompt gets 503; reject: words whose prompts (decoded, or the messages' contents)
    get HTTP 400 quoting the request's Authorization header; think: replies open with a <think>
    block (chat: in reasoning_content); delay: seconds per request."""

    def __init__(self, tok, models=("tiny",), key=None, fail_after=None, flaky=False, reject=(), think=False,
                 delay=0.0):
        self.tok, self.models, self.key, self.fail_after, self.flaky = tok, list(models), key, fail_after, flaky
        self.reject, self.think, self.delay = set(reject), think, delay
        self.lock = threading.RLock()  # _send takes it, sometimes inside _answer's hold
        self.in_flight = self.max_in_flight = self.answered = self.requests = 0
        self.bodies, self.auth, self.seen = [], [], set()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, obj):
                self._done()  # a request stops counting as in flight before its answer leaves: the client
                data = json.dumps(obj).encode()  # may send its next one the moment it reads this one
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self):
                got = self.headers.get("Authorization")
                server.auth.append(got)
                if server.key is not None and got != f"Bearer {server.key}":
                    self._send(401, {"error": f"invalid key in Authorization: {got}"})
                    return False
                return True

            def do_GET(self):
                if self.path == "/version":
                    return self._send(200, {"version": "fake"})
                if not self._authorized():
                    return None
                if self.path == "/v1/models":
                    return self._send(200, {"object": "list", "data": [{"id": m} for m in server.models]})
                return self._send(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not self._authorized():
                    return
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
                    return self._send(400, {"error": f"rejected; request headers: Authorization: "
                                                     f"{self.headers.get('Authorization')}"})
                tokens = len(server.tok(reply, add_special_tokens=False)["input_ids"]) + 1  # and the EOS
                thought = "Let me see the question."
                tail = "" if body.get("skip_special_tokens") is True else EOS  # as vLLM decodes
                if self.path == "/v1/completions":
                    text = (f"<think>\n{thought}\n</think>\n\n" if server.think else "") + reply + tail
                    choice = {"index": 0, "text": text, "finish_reason": "stop"}
                elif self.path == "/v1/chat/completions":
                    msg = {"role": "assistant", "content": reply}
                    if server.think:
                        msg["reasoning_content"] = thought
                    choice = {"index": 0, "message": msg, "finish_reason": "stop"}
                else:
                    return self._send(404, {"error": "not found"})
                with server.lock:
                    server.answered += 1
                self._send(200, {"choices": [choice], "usage": {"completion_tokens": tokens}})

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
                ids = regen.generation_prompt(tok, template, msgs[:i])
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
    manifest = json.loads(regen.manifest_path(out).read_text())
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
    failed = [r for r in _lines(str(out) + ".skipped.jsonl") if r["reason"] == regen.REQUEST_FAILED]
    assert len(failed) == s1["failed"]
    assert all(r["source"]["file"] == str(data) and "HTTP 500" in r["detail"]
               and f"{1 + oa.RETRIES} attempts" in r["detail"]
               for r in failed)
    assert srv.requests == srv.answered + s1["failed"] * (1 + oa.RETRIES) and srv.answered >= 5
    assert "requests failed (first: " in capsys.readouterr().err
    m1 = json.loads(regen.manifest_path(out).read_text())
    assert (m1["written"], m1["failed"], m1["skipped"]) == (s1["written"], s1["failed"], 1)

    srv2 = serve(flaky=True)  # every request's first attempt gets 503: retried, all answered
    s2 = regen.run_regenerate(cfg, out, engine="openai", url=srv2.url, concurrency=2, max_new_tokens=4)
    assert s2["records"] == s1["failed"] and s2["written"] == s1["failed"] and s2["failed"] == s2["skipped"] == 0
    assert srv2.requests == 2 * s2["replies"]
    rows = [r["source"]["row"] for r in _lines(out)]
    assert sorted(rows) == list(range(1, 9))  # each once
    m2 = json.loads(regen.manifest_path(out).read_text())  # this run's own figures
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
    from eaglet.engines.vllm import ServerEngine

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
    assert regen.strip_thinking("I think so.\n</think>\n\nYes.") == "Yes."
    assert regen.strip_thinking("<think>cut by max_new_tokens") == "<think>cut by max_new_tokens"
    assert regen.strip_thinking("Plain <think>x</think> reply") == "Plain <think>x</think> reply"


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
