"""`eaglet regenerate`: assistant turns replaced by the target's own greedy replies, resumable."""

import json

import pytest

import torch

from eaglet import cli
from eaglet.testing import tiny
from eaglet.targets.chat import load_tokenizer
from eaglet.config import load_config


def _greedy_reply(model, tok, messages, max_new_tokens):
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok(ids, add_special_tokens=False)["input_ids"]])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
    n = next((i for i, t in enumerate(out) if t == tok.eos_token_id), len(out))
    return tok.decode(out[:n], skip_special_tokens=True).strip()


def test_regenerate_replaces_answers_and_resumes(tmp_path):
    target = tiny.save_target(tmp_path / "target", template="chatml")
    records = tiny.make_conversations(6, seed=2, max_turns=2)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records) + "{broken\n")
    out = tmp_path / "regen.jsonl"
    sets = [f"target.path={target}", "target.dtype=float32", "target.device=cpu", f"prepare.data=[{data}]"]

    # A first run stopped after 4 records, then a full run: every record exactly once.
    args = ["regenerate", str(tmp_path / "none.yaml"), "--out", str(out), "--batch-size", "1", "--max-new-tokens", "6"]
    (tmp_path / "none.yaml").write_text("{}\n")
    assert cli.main([*args, *sum((["--set", s] for s in [*sets, "prepare.max_records=4"]), [])]) == 0
    assert len(out.read_text().splitlines()) == 4
    assert cli.main([*args, *sum((["--set", s] for s in sets), [])]) == 0
    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert sorted(r["source"]["row"] for r in lines) == list(range(1, 7))
    skipped = [json.loads(ln) for ln in (tmp_path / "regen.jsonl.skipped.jsonl").read_text().splitlines()]
    assert [(s["source"]["row"], s["reason"]) for s in skipped] == [(7, "malformed_json")]

    cfg = load_config(None, sets)
    tok = load_tokenizer(cfg.target)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for rec in lines:
        original = records[rec["source"]["row"] - 1]["conversations"]
        msgs = rec["messages"]
        assert [m["role"] for m in msgs] == [{"human": "user", "gpt": "assistant", "system": "system"}[t["from"]]
                                            for t in original]
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":  # the target's own reply to the conversation so far
                assert m["content"] == _greedy_reply(model, tok, msgs[:i], 6)
            else:
                assert m["content"] == original[i]["value"]


def test_continuous_engine_gives_the_padded_engines_replies_and_stops_at_max_length(tmp_path):
    target = tiny.save_target(tmp_path / "target", template="chatml")
    records = tiny.make_conversations(5, seed=4, max_turns=3)
    # ShareGPT has conversations that open with the assistant: that turn answers nothing and is kept.
    records.append({"conversations": [{"from": "gpt", "value": "Hello there."}, {"from": "human", "value": "Hi?"},
                                      {"from": "gpt", "value": "old reply"}]})
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "none.yaml").write_text("{}\n")
    sets = [f"target.path={target}", "target.dtype=float32", "target.device=cpu", f"prepare.data=[{data}]"]
    outs = {}
    for engine in ("generate", "continuous"):
        out = tmp_path / f"{engine}.jsonl"
        assert cli.main(["regenerate", str(tmp_path / "none.yaml"), "--out", str(out), "--engine", engine,
                         "--max-new-tokens", "5", *sum((["--set", s] for s in sets), [])]) == 0
        outs[engine] = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert outs["continuous"] == outs["generate"]
    opening = next(r["messages"] for r in outs["continuous"] if r["source"]["row"] == len(records))
    assert [m["role"] for m in opening] == ["assistant", "user", "assistant"]
    assert opening[0]["content"] == "Hello there." and opening[2]["content"] != "old reply"
    assert any(m["role"] == "assistant" for r in outs["continuous"] for m in r["messages"])

    # With a short max_length, a conversation ends at the last reply whose prompt fit.
    from eaglet.stages.regenerate import run_regenerate

    cfg = load_config(None, [*sets, "prepare.max_length=40"])
    stats = run_regenerate(cfg, tmp_path / "short.jsonl", max_new_tokens=5, engine="continuous")
    assert stats["cut_at_max_length"] > 0 and stats["redone"] == 0
    tok = load_tokenizer(cfg.target)
    for ln in (tmp_path / "short.jsonl").read_text().splitlines():
        msgs = json.loads(ln)["messages"]
        if any(m["role"] == "assistant" for m in msgs):
            assert msgs[-1]["role"] == "assistant"
            last_prompt = tok.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=False)
            assert len(tok(last_prompt, add_special_tokens=False)["input_ids"]) < 40


def test_finished_conversations_are_written_before_the_chunk_ends(tmp_path, monkeypatch):
    """A kill mid-chunk keeps every conversation already finished: each is written in the
    round where its last reply was generated, and a rerun redoes only the others."""
    from eaglet.engines.hf import generate
    from eaglet.stages import regenerate as regen

    target = tiny.save_target(tmp_path / "target", template="chatml")
    records = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]
                + [{"from": "human", "value": "more"}, {"from": "gpt", "value": "b"}] * (i % 3)} for i in range(6)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = load_config(None, [f"target.path={target}", "target.dtype=float32", "target.device=cpu",
                             f"prepare.data=[{data}]"])
    out = tmp_path / "out.jsonl"
    real, calls = generate.padded_generate, []

    def dies_in_round_two(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # a kill during the second round
        return real(*args, **kwargs)

    monkeypatch.setattr(generate, "padded_generate", dies_in_round_two)
    try:
        regen.run_regenerate(cfg, out, batch_size=6, max_new_tokens=3, engine="generate")
    except KeyboardInterrupt:
        pass
    first = [json.loads(ln)["source"]["row"] for ln in out.read_text().splitlines()]
    assert sorted(first) == [1, 4]  # the one-reply conversations, finished in round one
    monkeypatch.setattr(generate, "padded_generate", real)
    stats = regen.run_regenerate(cfg, out, batch_size=6, max_new_tokens=3, engine="generate")
    assert stats["resumed"] == 2 and stats["written"] == 4
    rows = [json.loads(ln)["source"]["row"] for ln in out.read_text().splitlines()]
    assert sorted(rows) == list(range(1, 7))

    # --max-turns 1: one round; every conversation ends after its first (regenerated) reply.
    calls.clear()
    monkeypatch.setattr(generate, "padded_generate", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    one = tmp_path / "one.jsonl"
    stats = regen.run_regenerate(cfg, one, batch_size=6, max_new_tokens=3, engine="generate", max_turns=1)
    assert len(calls) == 1 and stats["cut_at_max_turns"] == 4 and stats["replies"] == 6
    full = {json.loads(ln)["source"]["row"]: json.loads(ln)["messages"] for ln in out.read_text().splitlines()}
    for ln in one.read_text().splitlines():
        rec = json.loads(ln)
        assert [m["role"] for m in rec["messages"]] == ["user", "assistant"]
        assert rec["messages"] == full[rec["source"]["row"]][:2]  # the same first reply as the full run


def test_static_kv_cache_gives_the_dynamic_caches_replies(tmp_path):
    """The static cache (preallocated in a few sizes, compiled on a GPU) changes how replies are
    computed, not what they are: the same greedy replies as the growing cache."""
    from eaglet.stages.regenerate import run_regenerate

    target = tiny.save_target(tmp_path / "target", template="chatml")
    data = tiny.write_jsonl(tmp_path / "data.jsonl", tiny.make_conversations(9, seed=5, max_turns=3))
    sets = [f"target.path={target}", "target.dtype=float32", "target.device=cpu", f"prepare.data=[{data}]",
            "prepare.max_length=160"]
    outs = {}
    for kv in ("dynamic", "static"):
        stats = run_regenerate(load_config(None, sets), tmp_path / f"{kv}.jsonl", max_new_tokens=6, kv_cache=kv,
                               generate_batch=4)
        assert stats["kv_cache"] == kv and stats["replies"] > 9
        outs[kv] = [json.loads(ln) for ln in (tmp_path / f"{kv}.jsonl").read_text().splitlines()]
    assert outs["static"] == outs["dynamic"]


def test_static_cache_len_is_one_of_a_few_doubling_sizes_up_to_the_limit():
    """Each call's cache holds its prompts and replies, in at most log2(limit / 256) + 2 sizes
    over every width (so few compiled decoding steps), never past the limit, which refuses more."""
    import math

    from eaglet.engines.hf.generate import static_cache_len

    for new_tokens, limit in ((256, 2048 + 256), (6, 160 + 6), (512, 4096)):
        sizes = set()
        for width in range(1, limit - new_tokens + 1):
            n = static_cache_len(width, new_tokens, limit)
            assert width + new_tokens <= n <= limit
            sizes.add(n)
        assert len(sizes) <= math.log2(limit / 256) + 2
        with pytest.raises(ValueError, match=f"static KV cache of {limit} positions"):
            static_cache_len(limit - new_tokens + 1, new_tokens, limit)
    assert sorted({static_cache_len(w, 256, 2304) for w in range(1, 2049)}) == [512, 1024, 2048, 2304]
    assert static_cache_len(80, 256, 2304) == 512  # a call of short prompts: not 2304 positions per step


def test_calls_of_different_widths_get_their_own_static_cache_and_the_dynamic_caches_replies(monkeypatch):
    """Prompts of very different lengths, two per call: each call's static cache is sized to its
    own prompts (transformers alone would keep the first, longest call's size for all), and the
    replies are the growing cache's."""
    from eaglet.engines.hf.generate import batched_generate, static_cache_len
    from eaglet.targets.chat import generation_prompt
    from eaglet.engines.hf.decode import cache_kwarg

    model, tok = tiny.build_model(), tiny.build_tokenizer()
    tok.padding_side = "left"
    text = " ".join(c["conversations"][0]["value"] for c in tiny.make_conversations(6, seed=7))  # ~90 tokens
    prompts = [generation_prompt(tok, tok.chat_template, [{"role": "user", "content": content}])
               for content in [" ".join([text] * reps) for reps in (1, 8, 3, 7, 2)] + ["Hi?"]]
    widths = sorted(map(len, prompts), reverse=True)
    limit = 800  # under the 1024 that the longest call would take: that call gets the limit
    assert widths[0] + 6 <= limit and widths[2] + 6 > 256 and widths[4] + 6 <= 256

    sizes, generate = [], model.generate

    def recording(*args, **kwargs):
        sizes.append(kwargs[cache_kwarg(model)].layers[0].max_cache_len if cache_kwarg(model) in kwargs else None)
        return generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", recording)
    static = batched_generate(model, tok, prompts, 6, 0.0, 2, static_len=limit)
    assert sizes == [limit, 512, 256] == [static_cache_len(widths[i], 6, limit) for i in (0, 2, 4)]
    sizes.clear()
    assert static == batched_generate(model, tok, prompts, 6, 0.0, 2) and sizes == [None] * 3
    assert any(n for _, n in static)


def test_static_cache_too_short_is_refused():
    from eaglet.engines.hf.generate import padded_generate

    model = tiny.build_model()
    tok = tiny.build_tokenizer()
    with pytest.raises(ValueError, match="static KV cache of 8 positions"):
        padded_generate(model, tok, [[1, 2, 3, 4, 5]], max_new_tokens=4, temperature=0.0, static_len=8)


@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek_v2", "deepseek_v3", "gpt_oss"])
def test_kv_bytes_per_token_matches_the_cache_transformers_fills(family):
    """The batch sizing's estimate against the bytes a real forward leaves in its cache."""
    from transformers import DynamicCache

    from eaglet.engines.hf.generate import auto_generate_batch, kv_bytes_per_token
    from eaglet.engines.hf.decode import cache_kwarg

    model = tiny.build_model(family)
    n = 7  # under the tiny configs' sliding windows (8): every layer keeps every token
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.arange(2, 2 + n)[None], use_cache=True, **{cache_kwarg(model): cache})
    filled = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert kv_bytes_per_token(model) == filled // n
    assert auto_generate_batch(model, 100) == 16  # on a CPU


def test_regen_throughput_bench_counts_the_reply_tokens(tmp_path):
    """bench/regen_throughput.py on a tiny target: each variant counts exactly the reply tokens
    (up to EOS) that regenerate's own batched_generate gives for the same prompts (the script's
    own, --prompts-out)."""
    from pathlib import Path

    from conftest import run_script

    from eaglet.engines.hf.generate import batched_generate

    bench = Path(__file__).parent.parent / "bench" / "regen_throughput.py"
    target = tiny.save_target(tmp_path / "target", template="chatml")
    data = tiny.write_jsonl(tmp_path / "data.jsonl", tiny.make_conversations(10, seed=6, max_turns=2))
    sets = ["--set", "target.dtype=float32", "--set", "target.device=cpu"]
    run_script(bench, ["--target", str(target), "--data", str(data), "--prompts", "7", "--new-tokens", "5",
                       "--max-length", "256", "--variants", "dynamic:2,static:3", "--out", str(tmp_path / "r.json"),
                       "--prompts-out", str(tmp_path / "prompts.json"), *sets])
    res = json.loads((tmp_path / "r.json").read_text())  # written after each variant: the last has both
    assert [r["variant"] for r in res["variants"]] == ["dynamic:2", "static:3"] and res["prompts"] == 7
    cfg = load_config(None, [f"target.path={target}", f"prepare.data=[{data}]", "prepare.max_length=256",
                             "target.dtype=float32", "target.device=cpu"])
    tok = load_tokenizer(cfg.target)
    tok.padding_side = "left"
    taken = json.loads((tmp_path / "prompts.json").read_text())["prompts"]
    assert len(taken) == 7 and sum(map(len, taken)) == res["prompt_tokens"]
    prompts = sorted(taken, key=len, reverse=True)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for row, batch in zip(res["variants"], (2, 3)):
        ref = batched_generate(model, tok, prompts, 5, 0.0, 1)  # one prompt at a time: no padding at all
        assert row["first_call_tokens"] == sum(n for _, n in ref[:batch])
        assert row["tokens"] == sum(n for _, n in ref[batch:])
        assert row["calls"] == -(-(7 - batch) // batch)


def test_shards_split_the_records_and_resume_across_a_changed_split(tmp_path, monkeypatch):
    """Two shards (as two GPUs would run them) write every record once between them, with the
    replies of one unsharded run; a rerun with another split, or none, redoes nothing, and a
    shard stopped early is finished by a rerun under a different split."""
    from eaglet.regeneration.output import output_files, resolve_shard, shard_path
    from eaglet.stages.regenerate import run_regenerate

    target = tiny.save_target(tmp_path / "target", template="chatml")
    data = tiny.write_jsonl(tmp_path / "data.jsonl", tiny.make_conversations(7, seed=3, max_turns=2))
    with data.open("a") as f:
        f.write("{broken\n")  # row 8: shard 1 of 2 skips it, and only its skipped file holds it
    sets = [f"target.path={target}", "target.dtype=float32", "target.device=cpu", f"prepare.data=[{data}]"]
    cfg = load_config(None, sets)
    run = dict(max_new_tokens=4, engine="generate", generate_batch=4)

    def records(*files):
        return [json.loads(ln) for p in files for ln in p.read_text().splitlines()]

    def by_row(*files):
        return {r["source"]["row"]: r for r in records(*files)}

    def rows(*files):  # every record's row, repeats included
        return sorted(r["source"]["row"] for r in records(*files))

    run_regenerate(cfg, tmp_path / "whole.jsonl", **run)
    whole = by_row(tmp_path / "whole.jsonl")

    out = tmp_path / "regen.jsonl"
    s0 = run_regenerate(cfg, out, shard="0/2", **run)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's variables name the shard when --shard is not given
    s1 = run_regenerate(cfg, out, **run)
    assert s0["out"] == str(shard_path(out, 0, 2)) and s1["out"] == str(shard_path(out, 1, 2))
    assert {p.name: rows(p) for p in output_files(out)} == {"regen.shard-0-of-2.jsonl": [1, 3, 5, 7],
                                                            "regen.shard-1-of-2.jsonl": [2, 4, 6]}
    got = by_row(*output_files(out))
    assert got == whole
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    for shard in ("1/3", "1/2", None):
        stats = run_regenerate(cfg, out, shard=shard, **run)
        assert stats["written"] == stats["skipped"] == 0
    skipped = [ln for p in tmp_path.glob("regen*.skipped.jsonl") for ln in p.read_text().splitlines()]
    assert len(skipped) == 1 and json.loads(skipped[0])["source"]["row"] == 8

    # Shard 0 of 2 stopped after two records; a 3-way rerun finishes exactly the rest.
    part = tmp_path / "part.jsonl"
    run_regenerate(load_config(None, [*sets, "prepare.max_records=3"]), part, shard="0/2", **run)
    assert rows(shard_path(part, 0, 2)) == [1, 3]
    for r in range(3):
        run_regenerate(cfg, part, shard=f"{r}/3", **run)
    assert rows(*output_files(part)) == list(range(1, 8))  # and row 8 skipped
    assert resolve_shard(None) == (0, 1)
    for bad in ("2/2", "1", "a/b", "0/0"):
        with pytest.raises(ValueError, match="--shard"):
            resolve_shard(bad)


def test_replies_cut_at_max_new_tokens_are_counted_and_a_changed_resume_refused(tmp_path, monkeypatch):
    """The transformers engines count the replies that ended at max_new_tokens without an EOS (kept,
    as the server engine's finish_reason 'length'), from the generated rows themselves: an EOS at
    the last place is a finished reply. A rerun into the same output with another temperature or
    max_new_tokens is refused (exit 6) before the weights load."""
    from eaglet.engines.hf import generate
    from eaglet.errors import ResumeError
    from eaglet.regeneration.output import manifest_path
    from eaglet.stages import regenerate as regen

    target = tiny.save_target(tmp_path / "target", template="chatml")
    data = tiny.write_jsonl(tmp_path / "data.jsonl", tiny.make_conversations(8, seed=5, max_turns=1))
    cfg = load_config(None, [f"target.path={target}", "target.dtype=float32", "target.device=cpu",
                             f"prepare.data=[{data}]"])
    rows = {0: [7, 7, 7, 7, 7], 1: [7, 7, 7, 7, "eos"], 2: [7, "eos", "eos", "eos", "eos"]}  # by prompt length % 3
    lengths = []

    def fake(model, tokenizer, prompts, max_new_tokens, temperature, static_len=None):
        lengths.extend(len(p) for p in prompts)
        eos = tokenizer.eos_token_id
        return [generate.reply_text(tokenizer, [eos if t == "eos" else t for t in rows[len(p) % 3]], {eos}) for p in prompts]

    monkeypatch.setattr(generate, "padded_generate", fake)
    out = tmp_path / "out.jsonl"
    stats = regen.run_regenerate(cfg, out, max_new_tokens=5, engine="generate", generate_batch=4)
    assert stats["replies"] == len(lengths) == 8 and {n % 3 for n in lengths} == {0, 1, 2}
    assert stats["cut_at_max_new_tokens"] == sum(n % 3 == 0 for n in lengths)
    assert json.loads(manifest_path(out).read_text())["cut_at_max_new_tokens"] == stats["cut_at_max_new_tokens"]

    monkeypatch.setattr(regen, "load_target", lambda t: pytest.fail("the weights loaded before the refusal"))
    for changed in ({"temperature": 0.7}, {"max_new_tokens": 6}):
        with pytest.raises(ResumeError, match=f"regenerate.{next(iter(changed))}="):
            regen.run_regenerate(cfg, out, engine="generate", **{"max_new_tokens": 5, **changed})
