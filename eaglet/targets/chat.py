"""Rendering a conversation with the target's chat template, and its assistant loss mask.

The draft is trained only on what the target itself would generate: the tokens of each
assistant turn, including the token that ends the turn (`<|eot_id|>`, `<|im_end|>`, `</s>`),
and nothing of the system prompt, the user turns or the role headers. That mask must come
out right for *any* template, so it is derived from the template's own output, never from a
per-template pattern:

- a template with `{% generation %}` markers says where assistant text is; transformers
  turns that into a token mask (`return_assistant_tokens_mask=True`);
- any other template is rendered on growing prefixes of the conversation. For assistant
  turn i, P_i = render(messages[:i], add_generation_prompt=True) ends where the assistant
  starts writing and Q_i = render(messages[:i+1]) ends where its turn ends, so the
  characters [len(P_i), len(Q_i)) are that turn (less trailing whitespace, which the
  template adds between turns). Tokens of the full text overlapping those spans are masked.
  This needs both renders to be prefixes of the full text; a template that rewrites earlier
  turns (e.g. drops old reasoning) fails that check and is reported, not guessed at.
  Those renders cost a conversation's length each, so a sample cut to `max_length` tokens
  (`render_sample`) locates only the turns that start within the kept tokens: the whole
  conversation is rendered and tokenized once, and the ids and mask are the whole render's, cut.

A record whose content holds the text of a control token (`<|im_end|>` in a user turn) is
skipped as `control_text` (`find_control_text`, which says why).

`render_with_mask` is pure (tokenizer and messages in, ids and mask out); `process_record`
turns one dataset record into a sample or the reason it is skipped, so that `prepare` and
the doctor share exactly one path.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ConfigError, PrepareSection, TargetSection
from ..errors import InputError
from ..formats.datasets import RecordError, normalize_record
from .load import hub_kwargs, target_source

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")

Message = dict[str, str]

# Skip reasons of process_record besides the records' and the templates' own.
TOO_LONG = "too_long"
NO_ASSISTANT_TOKENS = "no_assistant_tokens"
CONTROL_TEXT = "control_text"


class ChatError(Exception):
    """A conversation that cannot be rendered with a mask; `reason` names the bad-record kind."""

    reason = "chat_error"


class TemplateError(ChatError):
    """The chat template raised (e.g. 'roles must alternate')."""

    reason = "template_error"


class MaskMismatch(ChatError):
    """A prefix render does not line up with the full render, so turn spans are unknown."""

    reason = "mask_mismatch"


def load_tokenizer(target: TargetSection) -> Any:
    """The target's tokenizer (from `target.tokenizer`, else `target.path`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_source(target, "tokenizer"), **hub_kwargs(target))


def resolve_chat_template(tokenizer: Any, target: TargetSection) -> str:
    """The template text in use: the file `target.chat_template`, else the tokenizer's own."""
    if target.chat_template:
        path = Path(target.chat_template)
        if not path.is_file():
            raise InputError(f"target.chat_template: file not found: {path}",
                             fix="correct the path (a relative one is taken against the config file's folder)")
        return path.read_text()
    try:
        return tokenizer.get_chat_template()
    except ValueError as e:  # no template, or several with no default
        name = target.tokenizer or target.path
        raise ConfigError(
            f"the tokenizer of {name} has no usable chat template ({e}); set target.chat_template to a Jinja template file"
        ) from None


def mask_method(chat_template: str) -> str:
    """'generation_markers' when the template marks assistant text itself, else 'prefix'."""
    return "generation_markers" if GENERATION_MARKER.search(chat_template) else "prefix"


def check_fast_tokenizer(tokenizer: Any) -> None:
    """Both mask methods map characters to tokens, which only fast tokenizers can do."""
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(
            f"{type(tokenizer).__name__} is not a fast (Rust) tokenizer; the loss mask needs character offsets "
            "(return_offsets_mapping). Provide a tokenizer.json for the target (target.tokenizer)."
        )


def render_with_mask(tokenizer: Any, messages: list[Message], chat_template: str | None = None) -> tuple[list[int], list[int]]:
    """Render `messages` with the chat template and mark the assistant tokens.

    Returns (input_ids, loss_mask) of equal length; loss_mask[t] is 1 for tokens of an
    assistant turn including its end-of-turn token. `chat_template` replaces the
    tokenizer's own. Raises TemplateError or MaskMismatch.
    """
    ids, mask, _ = render_sample(tokenizer, messages, chat_template)
    return ids, mask


def render_sample(tokenizer: Any, messages: list[Message], chat_template: str | None = None,
                  max_tokens: int | None = None) -> tuple[list[int], list[int], int]:
    """`render_with_mask` cut to its first `max_tokens` tokens, and the whole render's length.

    The same ids and mask as the whole render's, cut; but assistant turns that start after
    the cut are not located (each costs renders of the conversation up to it, so locating
    them all is quadratic in a record's turns, for tokens that are cut off anyway).
    """
    template = chat_template or _template_of(tokenizer)
    if mask_method(template) == "generation_markers":
        ids, mask = mask_by_generation_markers(tokenizer, template, messages)
        return ids[:max_tokens], mask[:max_tokens], len(ids)
    return _prefix_sample(tokenizer, template, messages, max_tokens)


def mask_by_generation_markers(tokenizer: Any, template: str, messages: list[Message]) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) from the template's own `{% generation %}` spans."""
    out = _apply(tokenizer, template, messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]


def mask_by_prefixes(tokenizer: Any, template: str, messages: list[Message]) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) from growing-prefix renders; works for any template."""
    ids, mask, _ = _prefix_sample(tokenizer, template, messages, None)
    return ids, mask


def _prefix_sample(tokenizer: Any, template: str, messages: list[Message],
                   max_tokens: int | None) -> tuple[list[int], list[int], int]:
    """`mask_by_prefixes` cut to `max_tokens`, locating only the turns that reach into the kept tokens."""
    full = _apply(tokenizer, template, messages, tokenize=False)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    total = len(ids)
    if max_tokens is not None and max_tokens < total:
        ids, offsets = ids[:max_tokens], offsets[:max_tokens]
        # A turn starting at or after the last kept token's end overlaps no kept token.
        until = max((end for _, end in offsets), default=0)
    else:
        until = None
    spans = assistant_spans(tokenizer, template, messages, full, until)
    return ids, spans_to_mask(offsets, spans), total


def assistant_spans(tokenizer: Any, template: str, messages: list[Message], full: str,
                    until: int | None = None) -> list[tuple[int, int]]:
    """Character spans [start, end) of the assistant turns in `full`, by growing prefixes; with
    `until`, those that start before that character (turns start in order: the first one at or
    after it ends the search)."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        through = _apply(tokenizer, template, messages[: i + 1], tokenize=False)
        start = _turn_start(tokenizer, template, messages, i, through)
        if not full.startswith(through):
            raise MaskMismatch(f"assistant turn {i}: the conversation up to this turn does not render as a prefix of the whole")
        if until is not None and start >= until:
            break
        end = len(through.rstrip())
        if end > start:
            spans.append((start, end))
    return spans


SENTINEL = "\u2063eaglet-assistant-turn\u2063"  # invisible separators: text no real turn contains


def _turn_start(tokenizer: Any, template: str, messages: list[Message], i: int, through: str) -> int:
    """Where assistant turn i's own text starts in `through` (the render of messages[:i+1]).

    Normally the end of the prompt rendered with add_generation_prompt. Some renders are not
    prefixes of each other, e.g. a template that injects a default system prompt only into a
    non-empty conversation, when the assistant speaks first (ShareGPT's split conversations
    often do). Then the turn is rendered with a sentinel as its content, and the text before
    the sentinel, which must be a prefix of `through`, locates the turn.
    """
    before = _apply(tokenizer, template, messages[:i], tokenize=False, add_generation_prompt=True)
    if through.startswith(before):
        return len(before)
    probe = _apply(tokenizer, template, messages[:i] + [{**messages[i], "content": SENTINEL}], tokenize=False)
    k = probe.find(SENTINEL)
    if k < 0 or not through.startswith(probe[:k]):
        raise MaskMismatch(
            f"assistant turn {i}: neither the prompt rendered with add_generation_prompt nor a sentinel render "
            "lines up with the turn's render"
        )
    return k


def spans_to_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose character range overlaps a span (both lists in order).

    Overlap rather than containment: a token that merges a separator with the first
    characters of the answer (" Hello" after "Assistant:") still produces answer text.
    """
    mask = [0] * len(offsets)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0] and end > start:
            mask[t] = 1
    return mask


# ---- control text in content ------------------------------------------------------------------

_CONTROL_PATTERNS: "weakref.WeakKeyDictionary[Any, re.Pattern | None]" = weakref.WeakKeyDictionary()


def control_tokens(tokenizer: Any) -> list[str]:
    """The texts the tokenizer turns into special (control) tokens wherever they appear in its
    input: its special added tokens (`<|im_end|>`, `<|eot_id|>`, `[INST]`, ...) and named ones.
    Added tokens that are not special (`<think>`, `<tool_call>`) are text a model writes itself."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts = {t.content for t in added.values() if getattr(t, "special", False)}
    texts |= set(getattr(tokenizer, "all_special_tokens", None) or [])
    return sorted((t for t in texts if t), key=lambda t: (-len(t), t))


def find_control_text(tokenizer: Any, messages: list[Message]) -> str | None:
    """Where the first control token's text is in a message's content, or None.

    Rendered into the conversation, such text is tokenized as the control token itself (by
    transformers and by serving engines alike): `<|im_end|>\n<|im_start|>assistant` in a user
    turn opens a fake assistant turn, and in an assistant turn it ends the turn where the
    target would stop, the text after it masked as the assistant's though the target never
    writes it. prepare skips such records (reason control_text) rather than train on them.
    """
    try:
        pattern = _CONTROL_PATTERNS[tokenizer]
    except KeyError:
        texts = control_tokens(tokenizer)
        pattern = re.compile("|".join(map(re.escape, texts))) if texts else None
        try:
            _CONTROL_PATTERNS[tokenizer] = pattern
        except TypeError:  # a tokenizer object that takes no weak reference: built again next time
            pass
    if pattern is None:
        return None
    for i, m in enumerate(messages):
        if hit := pattern.search(m["content"]):
            return (f"turn {i} ({m['role']}) holds {hit.group()!r} at character {hit.start()}, the text of a control "
                    "token: it would be tokenized as that token (a fake turn boundary), so the record is not trained on")
    return None


# ---- one record -> one sample -----------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """Everything that turns one record into a sample, besides the tokenizer (sent to workers)."""

    fmt: str
    chat_template: str
    max_length: int
    overflow: str
    min_loss_tokens: int
    multimodal: str = "drop"

    @classmethod
    def of(cls, p: PrepareSection, chat_template: str) -> "Settings":
        """The settings of the prepare section `p`, with the template in use."""
        return cls(p.format, chat_template, p.max_length, p.overflow, p.min_loss_tokens, p.multimodal)


@dataclass
class Outcome:
    """One record's result: a sample (input_ids, loss_mask) or a skip (reason, detail)."""

    row: int
    input_ids: np.ndarray | None = None
    loss_mask: np.ndarray | None = None
    truncated: bool = False
    reason: str = ""
    detail: str = ""


def process_record(row: int, item: dict[str, Any] | RecordError, tokenizer: Any, s: Settings) -> Outcome:
    """Normalise, check for control text, render, mask and size-check one record."""
    if isinstance(item, RecordError):
        return Outcome(row, reason=item.reason, detail=item.detail)
    try:
        messages = normalize_record(item, s.fmt, s.multimodal)
        if control := find_control_text(tokenizer, messages):
            return Outcome(row, reason=CONTROL_TEXT, detail=control)
        ids, mask, total = render_sample(tokenizer, messages, s.chat_template, s.max_length)
    except RecordError as e:
        return Outcome(row, reason=e.reason, detail=e.detail)
    except ChatError as e:
        return Outcome(row, reason=e.reason, detail=str(e))
    truncated = total > s.max_length
    if truncated and s.overflow == "drop":
        return Outcome(row, reason=TOO_LONG, detail=f"{total} tokens > prepare.max_length={s.max_length}")
    if sum(mask) < s.min_loss_tokens:
        where = " after truncation" if truncated else ""
        return Outcome(row, reason=NO_ASSISTANT_TOKENS,
                       detail=f"{sum(mask)} assistant tokens{where} < prepare.min_loss_tokens={s.min_loss_tokens}")
    return Outcome(row, np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8), truncated)


# ---- helpers ------------------------------------------------------------------------------------


def _template_of(tokenizer: Any) -> str:
    try:
        return tokenizer.get_chat_template()
    except ValueError as e:
        raise ConfigError(f"the tokenizer has no usable chat template: {e}") from None


def _apply(tokenizer: Any, template: str, messages: list[Message], **kwargs: Any) -> Any:
    """apply_chat_template, with anything the template raises turned into TemplateError."""
    try:
        if not messages:
            return _render_empty(tokenizer, template, **kwargs)
        return tokenizer.apply_chat_template(messages, chat_template=template, **kwargs)
    except Exception as e:  # a user's Jinja template can raise anything
        raise TemplateError(f"{type(e).__name__}: {e}") from e


def _render_empty(tokenizer: Any, template: str, add_generation_prompt: bool = False, **_: Any) -> str:
    """The generation prompt of an empty conversation (for a conversation the assistant opens).

    apply_chat_template refuses an empty list, so this calls the renderer it uses itself,
    with the same variables (the special tokens).
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _indices = render_jinja_template(
        conversations=[[]], chat_template=template, add_generation_prompt=add_generation_prompt,
        **tokenizer.special_tokens_map,
    )
    return rendered[0]


def generation_prompt(tokenizer: Any, template: str, conv: list[Message]) -> list[int]:
    """The token ids the target answers `conv` from: its chat template with the generation prompt."""
    text = tokenizer.apply_chat_template(conv, chat_template=template, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
