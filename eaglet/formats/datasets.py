"""Reading chat datasets: file readers and record normalisation, used by `prepare`.

Three file kinds, chosen by extension:

    .jsonl     one JSON record per line; rows are line numbers (1-based)
    .json      one JSON array of records, read *streaming* so a file of many GB is never
               held in memory; rows are element indices (0-based)
    .parquet   read in row batches with pyarrow; rows are row indices (0-based)

Every reader yields `(row, record_or_error)`: a record that cannot be read (a malformed
line, a broken array) comes out as a `RecordError` in its place instead of stopping the
run, so `prepare` can count it, report it by file and row, and go on. So does a record that
reads but that no later step could handle (`check_record`): text with a lone surrogate
(`"\ud800"`, which JSON's escapes allow but no UTF-8 encoder or tokenizer takes), or nesting
deeper than MAX_DEPTH (past Python's recursion limit, decoding, printing or sending it to a
worker would raise; a .json array skips such an element by its brackets and reads on). Records are then
normalised by `normalize_record` from the ShareGPT (`conversations` of {from, value}) or
OpenAI (`messages` of {role, content}) shape into plain `[{"role", "content"}]` lists; a
content given as a list of parts ({type: text, text}, {type: image_url, ...}) becomes its text
parts joined by newlines, or the record is skipped as multimodal (`prepare.multimodal`).

A file that cannot be read at all (missing, a folder, not the kind its extension says) is an
InputError naming it, raised before any record of any file is read (`check_data_files`).
"""

from __future__ import annotations

import json
import re
from itertools import islice
from pathlib import Path
from typing import Any, Iterator

from ..config import ConfigError
from ..errors import InputError

EXTENSIONS = (".jsonl", ".json", ".parquet")

# Bad-record reasons, as counted in prepare's stats and written to skipped.jsonl.
MALFORMED_JSON = "malformed_json"
NOT_A_CONVERSATION = "not_a_conversation"
UNKNOWN_ROLE = "unknown_role"
EMPTY_CONTENT = "empty_content"
CONTENT_NOT_TEXT = "content_not_text"
MULTIMODAL_CONTENT = "multimodal_content"
NO_ASSISTANT_TURN = "no_assistant_turn"
INVALID_UNICODE = "invalid_unicode"
TOO_DEEPLY_NESTED = "too_deeply_nested"

# Containers within containers a record may have (a conversation needs 5: record, turns, turn,
# content parts, part); far below the depth where Python's recursion limit stops repr or pickle.
MAX_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")  # json combines valid pairs, so any left is a lone one

SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
    "system": "system",
}
OPENAI_ROLES = {"user": "user", "assistant": "assistant", "system": "system"}

Message = dict[str, str]
Row = tuple[int, "dict[str, Any] | RecordError"]


class RecordError(Exception):
    """A record that cannot become a sample; `reason` is one of the fixed reason strings."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason, detail)  # both in args, so it survives pickling to and from workers
        self.reason = reason
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}" if self.detail else self.reason


_TOO_DEEP_TO_DECODE = f"nested deeper than Python's JSON decoder reads (records may nest {MAX_DEPTH} levels)"


def check_record(record: Any) -> Any:
    """`record`, or the RecordError that stands for it: a lone surrogate in any string (a key
    too), or containers nested deeper than MAX_DEPTH. Walked without recursion."""
    if not isinstance(record, (dict, list)):
        return _bad_text(record, ()) or record
    stack: list[tuple[Any, int, tuple]] = [(record, 0, ())]  # (container, its depth, its path)
    while stack:
        value, depth, path = stack.pop()
        if depth == MAX_DEPTH:
            return RecordError(TOO_DEEPLY_NESTED, f"more than {MAX_DEPTH} levels of lists and objects at {_path(path)}")
        for k, v in (value.items() if isinstance(value, dict) else enumerate(value)):
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1, path + (k,)))
            elif bad := _bad_text(v, path, k):
                return bad
            if bad := _bad_text(k, path, k):
                return bad
    return record


def _bad_text(value: Any, path: tuple, key: Any = None) -> RecordError | None:
    """The invalid_unicode error of a string with a lone surrogate (at path + key), else None."""
    if isinstance(value, str) and not value.isascii() and (m := _SURROGATE.search(value)):
        where = _path(path if key is None else path + (key,))
        return RecordError(INVALID_UNICODE, f"a lone surrogate {ascii(m.group())[1:-1]} (half of a UTF-16 pair, "
                                            f"not a character) at {where}")
    return None


def _path(path: tuple) -> str:
    """'conversations[0].value' for ('conversations', 0, 'value'), cut short when deep."""
    text = "".join(f"[{k}]" if isinstance(k, int) else f".{ascii(k)[1:-1]}" for k in path[:8]).lstrip(".")
    return (text + ("..." if len(path) > 8 else "")) or "the record itself"


# ---- readers ----------------------------------------------------------------------------------

def check_data_file(path: str | Path) -> Path:
    """The file exists and has an extension we can read; raise otherwise, naming it."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"prepare.data: {p} is a folder, not a data file",
                         fix=f"list its files ({', '.join(EXTENSIONS)}) in prepare.data one by one")
    if p.suffix.lower() not in EXTENSIONS:
        raise ConfigError(
            f"prepare.data: {p}: unknown file type '{p.suffix}' "
            f"(expected {', '.join(EXTENSIONS)}; a .json file must hold one JSON array, use .jsonl for one record per line)"
        )
    if not p.is_file():
        raise InputError(f"prepare.data: input file not found: {p}",
                         fix="correct the path (a relative one is taken against the config file's folder)")
    return p


def check_data_files(paths: list[str]) -> list[Path]:
    """`check_data_file` of each, and no file listed twice (also not by two spellings of it:
    its samples would count twice)."""
    checked, seen = [], {}
    for f in paths:
        p = check_data_file(f)
        real = p.resolve()
        if real in seen:
            same = f" (the same file as {seen[real]})" if str(seen[real]) != str(p) else ""
            raise ConfigError(f"prepare.data: {p} is listed twice{same}", fix="list each file once")
        seen[real] = p
        checked.append(p)
    return checked


def row_label(path: str | Path, row: int) -> str:
    """'data.jsonl:line 3', 'data.json:element 2', 'data.parquet:row 0': a row as its reader counts it."""
    kind = {".jsonl": "line", ".json": "element"}.get(Path(path).suffix.lower(), "row")
    return f"{path}:{kind} {row}"


def iter_records(path: str | Path, max_records: int | None = None) -> Iterator[Row]:
    """(row, record or RecordError) for every record of `path`, at most `max_records`."""
    p = check_data_file(path)
    suffix = p.suffix.lower()
    rows = read_jsonl(p) if suffix == ".jsonl" else read_json_array(p) if suffix == ".json" else read_parquet(p)
    return rows if max_records is None else islice(rows, max_records)


def read_jsonl(path: str | Path) -> Iterator[Row]:
    """One record per line; blank lines are not records (a trailing newline is common)."""
    with open(path, "rb") as f:  # bytes, so a line of invalid UTF-8 is one bad record, not a crash
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                yield lineno, RecordError(MALFORMED_JSON, str(e))
            except RecursionError:
                yield lineno, RecordError(TOO_DEEPLY_NESTED, _TOO_DEEP_TO_DECODE)
            else:
                yield lineno, check_record(record)


def read_parquet(path: str | Path, batch_size: int = 1024) -> Iterator[Row]:
    """Rows as dicts, one row batch in memory at a time (nested lists/structs become lists/dicts)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = 0
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:  # empty, cut short, not Parquet, or a schema nested too deep
        fix = ("its columns are nested deeper than pyarrow reads: drop or flatten the deep columns" if "deeply nested"
               in str(e) else "check the file, or give it the extension of its format (.jsonl, .json)")
        raise InputError(f"prepare.data: {path}: not a readable Parquet file ({e})", fix=fix) from None
    with pf:
        for batch in pf.iter_batches(batch_size=batch_size):
            for record in batch.to_pylist():
                yield row, check_record(record)
                row += 1


def read_json_array(path: str | Path, chunk_chars: int = 1 << 20) -> Iterator[Row]:
    """The elements of a file holding one JSON array, decoded one at a time.

    The file is read in chunks of `chunk_chars` characters; each element is decoded with
    `JSONDecoder.raw_decode` from the buffer, which grows when an element runs past its end.
    If the array is broken (bad JSON, missing comma, file cut short) the rest of the file
    cannot be read reliably: one RecordError at the element where it broke stands for the
    rest, and reading stops.
    """
    return _JsonArrayStream(Path(path), chunk_chars).rows()


_BRACKET = re.compile(r'[\[\]{}"]')  # what _skip_element looks for outside a string
_STRING_STOP = re.compile(r'["\\]')  # and inside one


class _JsonArrayStream:
    """State of one streaming read: the text buffer, the read position and the file."""

    def __init__(self, path: Path, chunk_chars: int):
        self.path = path
        self.chunk_chars = chunk_chars
        self.buf = ""
        self.pos = 0  # next unread character of buf
        self.consumed = 0  # characters dropped from the front of buf, for absolute offsets
        self.eof = False
        self.decoder = json.JSONDecoder()

    def _read_more(self, want: int) -> bool:
        """Append at least `want` more characters (fewer at the end of the file); False at EOF."""
        if self.eof:
            return False
        # Drop what has been consumed, so the buffer holds only the element being decoded.
        self.consumed += self.pos
        self.buf = self.buf[self.pos:]
        self.pos = 0
        text = self.f.read(max(want, self.chunk_chars))
        if not text:
            self.eof = True
            return False
        self.buf += text
        return True

    def _skip_ws(self) -> str:
        """Skip whitespace; return the next character ('' at the end of the file)."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._read_more(self.chunk_chars):
                return ""

    def _decode(self) -> Any:
        """Decode the element at `pos`, reading more text while the element may be incomplete."""
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                # An error near the end of the buffer, or inside a string that runs to the end,
                # may only mean the element continues in the next chunk; any other error is
                # real, because JSON needs no more than a few characters of lookahead.
                maybe_cut = e.pos >= len(self.buf) - 16 or e.msg.startswith("Unterminated string")
                if maybe_cut and self._read_more(len(self.buf)):  # double the buffer: linear total work
                    continue
                raise
            if end == len(self.buf) and self._read_more(self.chunk_chars):
                continue  # a number at the buffer's end may have more digits in the next chunk
            self.pos = end
            return value

    def _skip_element(self) -> bool:
        """Move `pos` past the list or object that starts there by counting its brackets (outside
        strings), for an element too deeply nested to decode; False if the file ends first."""
        depth, in_string = 0, False
        while True:
            if self.pos >= len(self.buf) and not self._read_more(self.chunk_chars):
                return False
            m = (_STRING_STOP if in_string else _BRACKET).search(self.buf, self.pos)
            if m is None:
                self.pos = len(self.buf)
                continue
            c = m.group()
            if c == "\\":
                if m.end() == len(self.buf):  # the escaped character is in the next chunk
                    self.pos = m.start()
                    if not self._read_more(self.chunk_chars):
                        return False
                    continue
                self.pos = m.end() + 1
                continue
            self.pos = m.end()
            if c == '"':
                in_string = not in_string
            elif c in "[{":
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    return True

    def _broken(self, index: int, what: str, at: int | None = None) -> Row:
        """The one bad record that stands for element `index` and everything after it."""
        offset = self.consumed + (self.pos if at is None else at)
        return index, RecordError(
            MALFORMED_JSON, f"JSON array broken at element {index} (character {offset}): {what}; rest of file not read"
        )

    def rows(self) -> Iterator[Row]:
        with open(self.path, encoding="utf-8-sig") as self.f:
            index = 0
            try:
                first = self._skip_ws()
                if first != "[":
                    found = repr(first) if first else "an empty file"
                    raise InputError(
                        f"prepare.data: {self.path}: a .json file must hold one JSON array (found {found}); "
                        f"use the .jsonl extension for one record per line"
                    )
                self.pos += 1
                if self._skip_ws() == "]":
                    self.pos += 1
                else:
                    while True:
                        try:
                            value = check_record(self._decode())
                        except json.JSONDecodeError as e:  # its line/column count from the buffer, not the file
                            yield self._broken(index, e.msg, at=e.pos)
                            return
                        except RecursionError:
                            if not self._skip_element():
                                yield self._broken(index, "the file ends inside a too deeply nested element")
                                return
                            value = RecordError(TOO_DEEPLY_NESTED, _TOO_DEEP_TO_DECODE)
                        yield index, value
                        index += 1
                        sep = self._skip_ws()
                        self.pos += 1
                        if sep == "]":
                            break
                        if sep != ",":
                            self.pos -= 1
                            found = "end of file" if sep == "" else repr(sep)
                            yield self._broken(index, f"expected ',' or ']' after element {index - 1}, found {found}")
                            return
                        if self._skip_ws() == "]":  # a trailing comma before ']' is not JSON
                            yield self._broken(index, "trailing comma before ']'")
                            return
                if self._skip_ws() != "":
                    yield self._broken(index, "unexpected data after the closing ']'")
            except UnicodeDecodeError as e:
                yield self._broken(index, f"not valid UTF-8: {e}")


# ---- records ----------------------------------------------------------------------------------

def normalize_record(record: Any, fmt: str = "auto", multimodal: str = "drop",
                     need_assistant: bool = True) -> list[Message]:
    """A ShareGPT or OpenAI record -> [{"role": user|assistant|system, "content": str}].

    Raises RecordError(not_a_conversation | unknown_role | empty_content | content_not_text |
    multimodal_content | no_assistant_turn). `fmt` is 'auto' (decided by which key the record
    has), 'sharegpt' or 'openai'; `multimodal` ('drop' or 'text') is prepare.multimodal.
    `need_assistant` off: a conversation without an assistant turn is fine (an eval prompt).
    """
    if not isinstance(record, dict):
        raise RecordError(NOT_A_CONVERSATION, f"record is a {type(record).__name__}, not an object")
    if fmt == "auto":
        fmt = "sharegpt" if "conversations" in record else "openai" if "messages" in record else ""
        if not fmt:
            raise RecordError(NOT_A_CONVERSATION, f"no 'conversations' or 'messages' key (keys: {sorted(record)[:10]})")
    list_key, role_key, content_key, roles = (
        ("conversations", "from", "value", SHAREGPT_ROLES) if fmt == "sharegpt" else ("messages", "role", "content", OPENAI_ROLES)
    )
    turns = record.get(list_key)
    if not isinstance(turns, list) or not turns:
        raise RecordError(NOT_A_CONVERSATION, f"'{list_key}' is missing, empty or not a list ({fmt} format)")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RecordError(NOT_A_CONVERSATION, f"turn {i} is a {type(turn).__name__}, not an object")
        role = roles.get(turn.get(role_key)) if isinstance(turn.get(role_key), str) else None
        if role is None:
            raise RecordError(UNKNOWN_ROLE, f"turn {i}: {role_key}={turn.get(role_key)!r} (known: {sorted(roles)})")
        content = _text(turn.get(content_key), f"turn {i} ({role}): {content_key}", multimodal)
        messages.append({"role": role, "content": content})
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise RecordError(NO_ASSISTANT_TURN, f"{len(messages)} turns, none from the assistant")
    return messages


def _is_parts(content: Any) -> bool:
    """A list of typed parts, as OpenAI's chat format writes multimodal (or split) content."""
    return isinstance(content, list) and bool(content) and all(
        isinstance(p, dict) and isinstance(p.get("type"), str) for p in content)


def _text(content: Any, where: str, multimodal: str) -> str:
    """The text of one turn's content (a string, or a list of parts), or the reason it has none."""
    if _is_parts(content):
        texts = [p.get("text") for p in content if p["type"] == "text"]
        if not all(isinstance(t, str) for t in texts):
            raise RecordError(CONTENT_NOT_TEXT, f"{where}: a text part without a string 'text' ({_short(content)})")
        others = sorted({p["type"] for p in content if p["type"] != "text"})
        if others and (multimodal == "drop" or not texts):
            keep = "; prepare.multimodal=text keeps the text parts" if texts else ", no text part"
            raise RecordError(MULTIMODAL_CONTENT, f"{where}: parts of type {', '.join(others)}{keep}")
        content = "\n".join(texts)
    elif content is not None and not isinstance(content, str) and content != []:
        raise RecordError(CONTENT_NOT_TEXT, f"{where}={_short(content)} is of type {type(content).__name__}, not text")
    # Missing, None or whitespace-only content counts as empty: templates often trim it to nothing.
    if not isinstance(content, str) or not content.strip():
        raise RecordError(EMPTY_CONTENT, f"{where}={_short(content)}")
    return content


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
