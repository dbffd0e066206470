"""tau by context length (eaglet/evaluation/context_length.py) in the eval's result, summaries and
plot, and the later-turns set that gives long prompts (eval.prompts heldout_turns;
eaglet/formats/eval_sets.py later_turn, later_turn_prompts)."""

from types import SimpleNamespace

import numpy as np
import pytest

from eaglet.testing.tiny import write_jsonl


def _rec(prompt_tokens, accepted):
    return {"prompt_tokens": prompt_tokens, "accepted_per_forward": accepted, "tau": None, "new_tokens": 0,
            "seconds": 0.0}


# A made-up decode, 3 draft positions: each turn's prompt length and accepted count per cycle.
DECODE = [_rec(100, [3, 0]), _rec(511, [1]),              # <512: the last length before the edge
          _rec(512, [2, 2, 2]), _rec(2047, [0]),          # 512-2k: from the edge on
          _rec(9000, [3, 3, 3, 3, 3, 3])]                 # >=8k; 2k-8k has no turn
# Worked out by hand: a bucket's tau is (accepted + 1) summed over its cycles / its cycles
#   <512:   cycles 3, 0, 1  -> (4 + 1 + 2) / 3 = 7/3   (per turn it would be (2.5 + 2) / 2 = 2.25)
#           position 1 reached 3, accepted 2; position 2 reached 2 (3, 1), accepted 1; position 3 reached 1, accepted 1
#   512-2k: cycles 2, 2, 2, 0 -> (3 + 3 + 3 + 1) / 4 = 2.5 (per turn (3 + 1) / 2 = 2)
#   >=8k:   six cycles of 3 -> 4
EXPECTED = {
    "<512": {"turns": 2, "cycles": 3, "tau": 7 / 3, "acceptance_rate": [2 / 3, 1 / 2, 1.0], "position_reached": [3, 2, 1]},
    "512-2k": {"turns": 2, "cycles": 4, "tau": 2.5, "acceptance_rate": [0.75, 1.0, 0.0], "position_reached": [4, 3, 3]},
    ">=8k": {"turns": 1, "cycles": 6, "tau": 4.0, "acceptance_rate": [1.0, 1.0, 1.0], "position_reached": [6, 6, 6]},
}


def test_the_eval_aggregate_gives_tau_per_context_length_bucket_over_its_cycles():
    """Decoding.aggregate on the made-up decode: each bucket as worked out by hand, in bucket
    order, the empty one left out, and the buckets' cycles adding up to the aggregate's."""
    from eaglet.evaluation.context_length import CONTEXT_BUCKETS, CONTEXT_EDGES, context_bucket
    from eaglet.evaluation.decoding import Decoding

    assert [context_bucket(n) for n in (0, 511, 512, 2047, 2048, 8191, 8192)] == [
        "<512", "<512", "512-2k", "512-2k", "2k-8k", "2k-8k", ">=8k"]
    assert CONTEXT_EDGES == (512, 2048, 8192) and len(CONTEXT_BUCKETS) == 4
    decoding = SimpleNamespace(s=SimpleNamespace(num_positions=3), run_plain=False, check=False)
    agg = Decoding.aggregate(decoding, DECODE)
    got = agg["by_context_length"]
    assert list(got) == ["<512", "512-2k", ">=8k"]
    for bucket, want in EXPECTED.items():
        for key, value in want.items():
            assert got[bucket][key] == pytest.approx(value), (bucket, key)
    assert sum(b["cycles"] for b in got.values()) == agg["verify_forwards"]


def test_the_summaries_name_the_buckets_present():
    """The eval's log line and the run's summary give each bucket's tau and its turns."""
    from eaglet.config import load_config
    from eaglet.evaluation.results import summary_line
    from eaglet.pipeline import run_summary

    agg = {"num_prompts": 5, "new_tokens": 40, "tau": 3.0, "tau_ceiling": 4, "by_context_length": EXPECTED}
    line = summary_line(agg)
    assert line.endswith("; tau by context length (prompt tokens): <512 2.33 (2 turns), 512-2k 2.50 (2 turns), "
                         ">=8k 4.00 (1 turn)")
    cfg = load_config(None, ["run.dir=/r"])
    stats = {"tau": 3.0, "num_prompts": 5, "acceptance_rate": [0.5], "lossless": True, "lossless_mismatches": 0,
             "by_context_length": {b: {k: v[k] for k in ("turns", "cycles", "tau")} for b, v in EXPECTED.items()}}
    assert ("  tau by context length (prompt tokens, earlier turns included): <512 2.33 (2 turns), 512-2k 2.50 "
            "(2 turns), >=8k 4.00 (1 turn)") in run_summary(cfg, [{"stage": "eval", "stats": stats}]).splitlines()


def test_the_plot_draws_tau_by_context_length_with_each_buckets_turns_and_cycles():
    from matplotlib.colors import to_hex

    from eaglet.evaluation.plot import TRAINED, UNTRAINED, eval_figure

    result = {
        "settings": {"method": "chain", "chain_tokens": 3, "temperature": 0.0, "device": "cpu", "dtype": "float32"},
        "prompt_set": "heldout_turns", "prompts": [{"item": f"sample {i}", "turn": 1, "tau": 2.0} for i in range(5)],
        "aggregate": {"num_prompts": 5, "tau": 3.0, "tau_ceiling": 4, "verify_forwards": 13,
                      "acceptance_rate": [0.8, 0.7, 0.6], "position_reached": [13, 10, 9], "by_context_length": EXPECTED},
        "reference": {"num_prompts": 1, "tau": 1.0, "trained_tau": 2.0, "acceptance_rate": [0.0, None, None],
                      "prompts": [{"item": "sample 0", "tau": 1.0}],
                      "by_context_length": {"<512": {"turns": 1, "cycles": 2, "tau": 1.0}}},
    }
    fig = eval_figure(result)
    lengths = fig.axes[2]
    assert lengths.get_title() == "tau by context length"
    assert [t.get_text() for t in lengths.get_xticklabels()] == ["<512\n2 turns, 3 cycles", "512-2k\n2 turns, 4 cycles",
                                                                 ">=8k\n1 turn, 6 cycles"]
    heights = {}
    for p in lengths.patches:
        heights.setdefault(to_hex(p.get_facecolor()), []).append(round(p.get_height(), 3))
    assert heights[TRAINED] == [2.333, 2.5, 4.0] and heights[UNTRAINED] == [1.0, 0, 0]


# ---- the later-turns set ----------------------------------------------------------------------


def _conv(*turns):
    return {"conversations": [{"from": f, "value": v} for f, v in turns]}


RECORDS = [
    _conv(("human", "first"), ("gpt", "answer one"), ("human", "second"), ("gpt", "answer two")),
    _conv(("human", "only one question"), ("gpt", "its answer")),                       # one user turn: not a later turn
    _conv(("system", "be brief"), ("human", "a"), ("gpt", "b"), ("human", "c"), ("gpt", "d"), ("human", "e"),
          ("gpt", "f")),
    _conv(("human", "asks twice"), ("gpt", "x"), ("human", "the last, no answer yet")),  # ends with the question
]
# which turn each record asks, and its context: everything before its last user turn
WANT = [
    ([("user", "first"), ("assistant", "answer one")], "second"),
    None,
    ([("system", "be brief"), ("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")], "e"),
    ([("user", "asks twice"), ("assistant", "x")], "the last, no answer yet"),
]


def _pairs(messages):
    return [(m["role"], m["content"]) for m in messages]


def test_a_later_turn_is_the_last_user_turn_after_every_earlier_message():
    from eaglet.formats.datasets import normalize_record
    from eaglet.formats.eval_sets import heldout_turn_items, later_turn

    for rec, want in zip(RECORDS, WANT, strict=True):
        cut = later_turn(normalize_record(rec, need_assistant=False))
        assert (cut if cut is None else (_pairs(cut[0]), cut[1])) == want
    items = heldout_turn_items([(7 + i, normalize_record(r, need_assistant=False)) for i, r in enumerate(RECORDS)])
    assert [it.key for it in items] == ["sample 7", "sample 9", "sample 10"]
    assert _pairs(items[1].messages([], 0)) == [*WANT[2][0], ("user", "e")]  # what the target is asked


def test_later_turn_prompts_take_the_records_after_the_skipped_ones(tmp_path):
    """bench/ab.py's heldout_turns: the later turns of the records after `skip`, rendered with
    their context, distinct, none over max_tokens (a context counts towards it)."""
    from eaglet.formats.eval_sets import later_turn_prompts

    data = write_jsonl(tmp_path / "d.jsonl", [RECORDS[0], *RECORDS, RECORDS[2],
                                              _conv(("human", "q" * 40), ("gpt", "a"), ("human", "short"))])
    render = lambda msgs: [ord(c) for m in msgs for c in m["role"][0] + m["content"]]  # noqa: E731

    def asked(want):
        return render([{"role": r, "content": c} for r, c in want[0]] + [{"role": "user", "content": want[1]}])

    got = later_turn_prompts(data, render, skip=1, n=10, max_tokens=40)
    assert got == [asked(WANT[0]), asked(WANT[2]), asked(WANT[3])]  # the repeat and the over-long one passed over
    assert later_turn_prompts(data, render, skip=1, n=2, max_tokens=40) == got[:2]


def test_heldout_turns_reads_the_held_out_conversations_back_in_full(tmp_path):
    """eval.prompts heldout_turns: the held-out samples of the run's split, each read back from
    its source record (the prepared sample, cut short here, is not what is asked), those of one
    user turn and those whose record is gone counted; and no such sample is one line."""
    from eaglet.config import Config
    from eaglet.errors import InputError
    from eaglet.evaluation.inputs import eval_items
    from eaglet.formats.prepared import PreparedWriter
    from eaglet.training.data import split_ids

    src = write_jsonl(tmp_path / "src.jsonl", RECORDS)  # rows 1 to 4 (a .jsonl's rows are its line numbers)
    w = PreparedWriter(tmp_path / "prepare", [str(src)])
    for row in (1, 4, 3, 2, 99):  # samples 0 to 4; no row 99 in the file
        w.add([1, 2, 3, 4], [0, 0, 1, 1], 0, row)
    w.close()
    cfg = Config()
    cfg.train.eval_fraction, cfg.eval.prompts, cfg.eval.num_prompts = 0.99, "heldout_turns", 10
    assert split_ids(np.arange(5), 0.99, cfg.run.seed)[1].tolist() == [0, 2, 3, 4]  # the split this test expects
    items, _, count = eval_items(cfg, {"prepare": tmp_path / "prepare"})
    assert [it.key for it in items] == ["sample 0", "sample 2"]
    assert [(_pairs(it.context), it.asks) for it in items] == [(c, (a,)) for c, a in (WANT[0], WANT[2])]
    assert {k: count[k] for k in ("held_out", "one_user_turn", "no_record", "missing")} == {
        "held_out": 4, "one_user_turn": 1, "no_record": 1, "missing": 0}
    assert count["note"] == ("10 asked; train.eval_fraction holds out 4 samples: 1 was a conversation of one user "
                             "turn, 1 was without its source record")

    write_jsonl(src, [RECORDS[1]] * len(RECORDS))  # every conversation one turn long
    with pytest.raises(InputError, match=r"eval.prompts heldout_turns: none of the 4 held-out sample\(s\) .* is a "
                                         r"conversation of two user turns or more"):
        eval_items(cfg, {"prepare": tmp_path / "prepare"})
    src.unlink()
    with pytest.raises(InputError, match="src.jsonl is gone"):
        eval_items(cfg, {"prepare": tmp_path / "prepare"})
