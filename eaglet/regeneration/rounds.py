"""`eaglet regenerate`'s rounds: the records of `prepare.data` read as prepare reads them
(`source_records`), in chunks of conversations whose assistant turns are replaced round by round
(round r: every conversation's r-th reply) by the engine's replies (the transformers engines,
eaglet/engines/hf/generate.py, or the server's, eaglet/regeneration/server.py). A conversation
is appended to the output and made durable as soon as it has no reply left to generate.
Change here how a conversation is cut (prepare.max_length, regenerate.max_turns) or counted."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ..config import Config, PrepareSection, RegenerateSection
from ..engines.hf.generate import batched_generate, continuous_generate
from ..engines.openai import Failure, OpenAIClient
from ..formats.datasets import RecordError, check_data_file, iter_records, normalize_record
from ..targets.chat import generation_prompt
from ..utils import log
from .output import REQUEST_FAILED
from .server import server_reply, strip_thinking


def source_records(cfg: Config) -> Iterator[tuple[str, int, Any]]:
    """(file, row, record or RecordError) of every `prepare.data` file, as prepare reads them."""
    for f in cfg.prepare.data:
        path = check_data_file(f)
        for row, item in iter_records(path, cfg.prepare.max_records):
            yield str(path), row, item


class Regenerator:
    """The rounds of one `eaglet regenerate` run: its engine (a transformers `model`, or a server's
    `client`), its settings and the running `stats`, which it counts into; it appends finished
    conversations to `out` and advances `bar` by them."""

    def __init__(self, out: Path, stats: dict[str, Any], bar: Any, t0: float, tokenizer: Any, template: Any,
                 rc: RegenerateSection, engine: str, model: Any, client: OpenAIClient | None, max_length: int,
                 generate_batch: int | None, static_len: int | None):
        self.out, self.stats, self.bar, self.t0 = out, stats, bar, t0
        self.tokenizer, self.template, self.eos_text = tokenizer, template, tokenizer.eos_token
        self.rc, self.engine, self.model, self.client = rc, engine, model, client
        self.max_length, self.generate_batch, self.static_len = max_length, generate_batch, static_len

    def run(self, records: Iterable[tuple[str, int, Any]], skipped_path: Path, rank: int, world: int,
            done: set[tuple[str, int]], batch_size: int, prepare: PrepareSection) -> None:
        """Regenerate `records` (`source_records`) in chunks of `batch_size` conversations: this
        shard's (every `world`-th from the `rank`-th) not `done` already; a record prepare could
        not read goes to `skipped_path` with its reason."""
        stats, flush, skip = self.stats, self.flush, self.skip
        batch: list[tuple[str, int, list[dict[str, str]]]] = []
        with skipped_path.open("a") as skipped:
            for i, (file, row, item) in enumerate(records):
                if i % world != rank or (file, row) in done:
                    continue
                stats["records"] += 1
                try:
                    if isinstance(item, RecordError):
                        raise item
                    msgs = normalize_record(item, prepare.format, prepare.multimodal)
                except RecordError as e:
                    skip(skipped, file, row, e.reason, e.detail)
                    stats["skipped"] += 1
                    continue
                batch.append((file, row, msgs))
                if len(batch) == batch_size:
                    flush(batch, skipped)
                    batch = []
            if batch:
                flush(batch, skipped)

    def skip(self, f: Any, file: str, row: int, reason: str, detail: str) -> None:
        """A line of the skipped file `f`: the record at `file`:`row` and why it was left out."""
        f.write(json.dumps({"source": {"file": file, "row": row}, "reason": reason, "detail": detail}) + "\n")

    def write_finished(self, batch: list[tuple[str, int, list[dict[str, str]]]], convs: list[list[dict[str, str]]],
                       finished: list[int]) -> None:
        """Append the finished conversations and make them durable (a kill loses no finished one)."""
        if not finished:
            return
        out, stats, bar, t0 = self.out, self.stats, self.bar, self.t0
        with out.open("a") as f:
            for k in finished:
                file, row, _ = batch[k]
                f.write(json.dumps({"messages": convs[k], "source": {"file": file, "row": row}}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        stats["written"] += len(finished)
        bar.update(len(finished))
        bar.set_postfix(tok_s=f"{stats['new_tokens'] / max(time.time() - t0, 1e-9):.0f}")

    def flush(self, batch: list[tuple[str, int, list[dict[str, str]]]], skipped: Any) -> None:
        """Regenerate a chunk round by round (round r: every conversation's r-th reply); each
        conversation is written as soon as it has no reply left to generate, and one whose
        request failed goes to `skipped` instead (REQUEST_FAILED: a rerun redoes it)."""
        stats, engine, client, rc, tokenizer = self.stats, self.engine, self.client, self.rc, self.tokenizer
        max_new_tokens, temperature, max_turns = rc.max_new_tokens, rc.temperature, rc.max_turns
        max_length = self.max_length
        skip, write_finished = self.skip, self.write_finished
        convs: list[list[dict[str, str]]] = [[] for _ in batch]  # rebuilt turn by turn
        pending = [list(msgs) for _, _, msgs in batch]
        turn = [0] * len(batch)
        generated = [0] * len(batch)
        written = [False] * len(batch)
        rounds = 0

        def end_here(k: int, reason: str) -> None:
            """The conversation ends at its last reply (the turns after it are dropped)."""
            if any(m["role"] == "assistant" for m in convs[k]):  # else prepare reports it
                while convs[k][-1]["role"] != "assistant":
                    convs[k].pop()
            turn[k] = len(pending[k])
            stats[reason] += 1
        while True:
            todo, prompts = [], []  # records with an assistant turn still to replace
            for k, msgs in enumerate(pending):
                while turn[k] < len(msgs) and (msgs[turn[k]]["role"] != "assistant" or not convs[k]):
                    if not convs[k] and msgs[turn[k]]["role"] == "assistant":
                        stats["kept_opening_assistant"] += 1  # it answers nothing: kept as it is
                    convs[k].append(msgs[turn[k]])
                    turn[k] += 1
                if turn[k] >= len(msgs):
                    continue
                if max_turns is not None and generated[k] >= max_turns:
                    end_here(k, "cut_at_max_turns")
                    continue
                ids = generation_prompt(tokenizer, self.template, convs[k])
                if len(ids) >= max_length:
                    # Training cuts every sample at prepare.max_length: a reply past it is never seen.
                    end_here(k, "cut_at_max_length")
                    continue
                todo.append(k)
                prompts.append(ids)
            waiting = set(todo)
            finished = [k for k in range(len(batch)) if not written[k] and k not in waiting]
            write_finished(batch, convs, finished)
            for k in finished:
                written[k] = True
            if not todo:
                break
            rounds += 1
            t_round, tokens_before = time.time(), stats["new_tokens"]
            replies: list[tuple[str, int, bool] | Failure]  # (text, new tokens, cut at max_new_tokens)
            if engine == "openai":
                sent = client.run(prompts if rc.api == "completions" else [convs[k] for k in todo], max_new_tokens,
                                  temperature)
                replies = [r if isinstance(r, Failure) else (server_reply(r, self.eos_text), r.tokens,
                                                             r.finish_reason == "length") for r in sent]
            else:
                if engine == "continuous":
                    made, redone = continuous_generate(self.model, tokenizer, prompts, max_new_tokens, temperature)
                    stats["redone"] += redone
                else:
                    made = batched_generate(self.model, tokenizer, prompts, max_new_tokens, temperature,
                                            self.generate_batch, self.static_len)
                # n counts the tokens before EOS: all max_new_tokens of them when no EOS came
                replies = [(text, n, n >= max_new_tokens) for text, n in made]
            failures, cut_before = [], stats["cut_at_max_new_tokens"]
            for k, r in zip(todo, replies):
                if isinstance(r, Failure):  # the conversation is not written; a rerun redoes it whole
                    file, row, _ = batch[k]
                    skip(skipped, file, row, REQUEST_FAILED, r.reason)
                    failures.append(f"{file}:{row}: {r.reason}")
                    turn[k], written[k] = len(pending[k]), True
                    stats["failed"] += 1
                    stats["bad_replies"] += r.bad_reply
                    continue
                text, n, cut = r
                stats["cut_at_max_new_tokens"] += cut  # kept: the target's own text, up to where it was cut
                convs[k].append({"role": "assistant", "content": strip_thinking(text) if rc.drop_thinking else text})
                turn[k] += 1
                generated[k] += 1
                stats["new_tokens"] += n
                stats["replies"] += 1
            dt = time.time() - t_round
            log(f"[regenerate] round {rounds}: {len(todo) - len(failures)} replies, "
                f"{stats['new_tokens'] - tokens_before} tokens in {dt:.1f}s "
                f"({(stats['new_tokens'] - tokens_before) / max(dt, 1e-9):.0f} tok/s); "
                f"{stats['written']} conversations written before this chunk"
                + (f"; {stats['cut_at_max_new_tokens'] - cut_before} replies cut at max_new_tokens {max_new_tokens} "
                   "(kept)" if stats["cut_at_max_new_tokens"] > cut_before else "")
                + (f"; {len(failures)} requests failed (first: {failures[0]})" if failures else ""))
