"""The `prepare` stage: chat datasets -> tokenized samples with assistant loss masks.

    eaglet prepare --config run.yaml        # or as the first stage of `eaglet run`

Reads every file of `prepare.data` (see eaglet.formats.datasets), renders each conversation with the
target's chat template and derives its loss mask (see eaglet.targets.chat), applies the
`max_length` overflow rule and writes the samples with `PreparedWriter` into the stage
folder. No record is silently lost: each one becomes a sample or a line of `skipped.jsonl`
({"file", "row", "reason", "detail"}), so records == samples + sum(skipped) in the stats; the
log gives one line per file and one of the skipped records' counts by reason with the path of
skipped.jsonl (`prepare.report_examples` also logs the first N skipped records one line each).
A file that yields no sample at all (empty, blank lines only, or no usable record) is an
error naming every such file with its counts by reason, once all files are read. Bad data
never stops the stage, but a reason that is not the data's (`template_error`: the template
call raised, most often because a library changed) does once it is most of the records read
(more than half, and at least STOP_MIN): it stops with the count, an example and the fix.

With `prepare.num_workers` > 0 rendering runs in a spawn-started process pool, each
worker loading the tokenizer once; results come back in input order, so sample ids and
the output do not depend on the number of workers.
"""

from __future__ import annotations

import json
import multiprocessing
from collections import Counter
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterator

from ..targets.chat import (Outcome, Settings, TemplateError, check_fast_tokenizer, load_tokenizer, mask_method,
                            process_record, resolve_chat_template)
from ..config import Config, ConfigError, TargetSection
from ..errors import InputError
from ..formats.datasets import Row, check_data_files, iter_records, row_label
from ..context import StageContext
from ..formats.prepared import PreparedWriter
from ..utils import log

SKIPPED = "skipped.jsonl"
# Records a worker receives per task, and tasks in flight per worker: the input is fed to
# the pool in windows so a huge file is never queued whole.
CHUNK = 32
WINDOW_CHUNKS_PER_WORKER = 8
# Skip reasons that are not the data's fault: prepare stops when one of them is more than half of
# the records read and at least STOP_MIN of them (a few records a template refuses do not stop it).
NOT_DATA_REASONS = (TemplateError.reason,)
STOP_MIN = 8


# ---- in process or in a pool --------------------------------------------------------------------

_WORKER: dict[str, Any] = {}  # a pool worker's tokenizer and settings, set once by _init_worker


def _init_worker(target: TargetSection, settings: Settings) -> None:
    _WORKER["tokenizer"] = load_tokenizer(target)
    _WORKER["settings"] = settings


def _process_in_worker(item: Row) -> Outcome:
    return process_record(item[0], item[1], _WORKER["tokenizer"], _WORKER["settings"])


Mapper = Callable[[Iterator[Row]], Iterator[Outcome]]


@contextmanager
def _mapper(tokenizer: Any, target: TargetSection, settings: Settings, num_workers: int) -> Iterator[Mapper]:
    """A function from rows to outcomes, in input order; with workers, backed by a pool."""
    if num_workers <= 0:
        yield lambda rows: (process_record(r, item, tokenizer, settings) for r, item in rows)
        return
    # spawn, not fork: the parent's tokenizer holds Rust thread pools that do not survive a fork.
    with multiprocessing.get_context("spawn").Pool(num_workers, _init_worker, (target, settings)) as pool:
        window = num_workers * CHUNK * WINDOW_CHUNKS_PER_WORKER

        def run(rows: Iterator[Row]) -> Iterator[Outcome]:
            while batch := list(islice(rows, window)):
                yield from pool.imap(_process_in_worker, batch, chunksize=CHUNK)

        yield run


# ---- the stage ------------------------------------------------------------------------------------

def _counts(c: Counter) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(c.items())) or "none"


def _check_not_data(reason: str, bad: Counter, records: int, example: str) -> None:
    """Stop when a reason that is not the data's is most of the records read so far."""
    if reason in NOT_DATA_REASONS and bad[reason] >= STOP_MIN and 2 * bad[reason] > records:
        raise InputError(
            f"prepare stopped: {bad[reason]} of the {records} records read failed with {reason}, which is not the "
            f"data's fault but the chat template's call (a library change, or a broken template), e.g. {example[:400]}",
            fix="run `eaglet doctor CONFIG` to find the changed library API, or correct target.chat_template")


def _log_skipped(skipped: Counter, records: int, path: Path) -> None:
    """The one line of skipped records: their counts by reason and the file listing each."""
    n = sum(skipped.values())
    if n:
        log(f"[prepare] skipped {n} of {records} records ({_counts(skipped)}), each listed with its reason in {path}")


def _no_sample_error(empty: list[dict], skipped_path: Path) -> InputError:
    """The error naming every file that gave no sample, with its counts by reason."""
    parts = [f"{f['path']}: no records (the file is empty or holds only blank lines)" if not f["records"] else
             f"{f['path']}: no usable record ({f['records']} read; skipped: {_counts(Counter(f['skipped']))})"
             for f in empty]
    fix = "fix the file" + ("s" if len(empty) > 1 else "") + " or remove " + ("them" if len(empty) > 1 else "it") + \
        " from prepare.data" + (f"; the reason of each skipped record is in {skipped_path}"
                                if any(f["records"] for f in empty) else "")
    return InputError("prepare.data: " + ", ".join(parts), fix=fix)


def run_prepare(cfg: Config, ctx: StageContext) -> dict[str, Any]:
    p = cfg.prepare
    if not p.data:
        raise ConfigError("prepare.data: no input files given", fix="list the chat files (.jsonl, .json, .parquet)")
    paths = check_data_files(p.data)  # every file checked before any is read

    tokenizer = load_tokenizer(cfg.target)
    check_fast_tokenizer(tokenizer)
    template = resolve_chat_template(tokenizer, cfg.target)
    method = mask_method(template)
    log(f"[prepare] loss mask from the chat template by: {method}")
    settings = Settings.of(p, template)

    writer = PreparedWriter(ctx.out_dir, [str(f) for f in p.data], p.shard_samples)
    skipped: Counter = Counter()  # of the files read so far, the current one included
    files, tokens, loss_tokens, truncated, reported, read = [], 0, 0, 0, 0, 0
    with open(ctx.out_dir / SKIPPED, "w") as skipped_out, _mapper(tokenizer, cfg.target, settings, p.num_workers) as mapper:
        for k, path in enumerate(paths):
            records, samples, file_skipped = 0, 0, Counter()
            for out in mapper(iter_records(path, p.max_records)):
                records += 1
                read += 1
                if out.reason:
                    file_skipped[out.reason] += 1
                    skipped[out.reason] += 1
                    skipped_out.write(json.dumps({"file": str(path), "row": out.row, "reason": out.reason, "detail": out.detail}) + "\n")
                    if reported < p.report_examples:
                        log(f"[prepare] skipped {row_label(path, out.row)}: {out.reason}: {out.detail}")
                        reported += 1
                    _check_not_data(out.reason, skipped, read, f"{row_label(path, out.row)}: {out.detail}")
                    continue
                writer.add(out.input_ids, out.loss_mask, k, out.row)
                samples += 1
                tokens += len(out.input_ids)
                loss_tokens += int(out.loss_mask.sum())
                truncated += out.truncated
            n = sum(file_skipped.values())
            log(f"[prepare] {path}: {records} records -> {samples} samples" + (f", {n} skipped" if n else ""))
            files.append({"path": str(path), "records": records, "samples": samples, "skipped": dict(file_skipped)})
    empty = [f for f in files if f["samples"] == 0]
    if empty:
        raise _no_sample_error(empty, ctx.out_dir / SKIPPED)
    index = writer.close()

    _log_skipped(skipped, read, ctx.out_dir / SKIPPED)
    return {
        "files": files,
        "records": sum(f["records"] for f in files),
        "samples": index["num_samples"],
        "tokens": tokens,
        "loss_tokens": loss_tokens,
        "truncated": truncated,
        "skipped": dict(skipped),
        "mask_method": method,
        "shards": len(index["shards"]),
    }
