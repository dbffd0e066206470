"""`eaglet regenerate`'s output files and its resume: the file each shard writes
(`shard_path`, `resolve_shard`), every file an output has (`output_files`), the records already
done (`done_rows`), `<out>.manifest.json`, and `<out>.settings.json`, what decides the replies,
checked on a resume (`check_resume`). docs/formats.md describes the files; change here how they
are named, read back or checked."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from ..config import Config, RegenerateSection
from ..engines.openai import OpenAIClient
from ..errors import CorruptDataError, ResumeError
from ..utils import atomic_write_json, log


def shard_path(out: str | Path, rank: int, world: int) -> Path:
    """The file shard `rank` of `world` writes for the output `out`."""
    out = Path(out)
    return out.with_name(f"{out.stem}.shard-{rank}-of-{world}{out.suffix}")


def resolve_shard(shard: str | None) -> tuple[int, int]:
    """(rank, world) from `--shard R/N`, else from torchrun's RANK and WORLD_SIZE, else (0, 1)."""
    if shard is None:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    try:
        rank, world = (int(x) for x in shard.split("/"))
    except ValueError:
        raise ValueError(f"regenerate --shard {shard!r}: expected R/N, e.g. 0/4") from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"regenerate --shard {shard!r}: need N >= 1 and 0 <= R < N")
    return rank, world


def output_paths(out: Path) -> list[Path]:
    """`out` and every shard path of it that has a file (its records or its skipped records)."""
    name = re.compile(re.escape(out.stem) + r"\.shard-(\d+)-of-(\d+)" + re.escape(out.suffix) + r"(\.skipped\.jsonl)?")
    splits = {(int(m[2]), int(m[1])) for m in map(name.fullmatch, (p.name for p in out.parent.glob(f"{out.stem}.shard-*")))
              if m}  # (world, rank)
    return [out, *(shard_path(out, rank, world) for world, rank in sorted(splits))]


def output_files(out: str | Path) -> list[Path]:
    """Every file the output `out` has so far: itself and the shards of any split, in that order."""
    return [p for p in output_paths(Path(out)) if p.is_file()]


REQUEST_FAILED = "request_failed"  # a skipped file's reason for a record whose server request failed: redone


def done_rows(out: Path) -> set[tuple[str, int]]:
    """(file, row) of every record written or skipped in any file of the output `out` (a record
    whose request failed, REQUEST_FAILED, is not done: a rerun tries it again)."""
    done: set[tuple[str, int]] = set()
    paths = output_paths(out)
    for path in [*paths, *(p.with_name(p.name + ".skipped.jsonl") for p in paths)]:
        if not path.is_file():
            continue
        with path.open() as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    break  # a line cut by a kill: it and what follows are redone
                if rec.get("reason") != REQUEST_FAILED:
                    done.add((rec["source"]["file"], int(rec["source"]["row"])))
    return done


def manifest_path(out: str | Path) -> Path:
    """`<out>.manifest.json`: what the last run that finished on the output file `out` did."""
    out = Path(out)
    return out.with_name(out.name + ".manifest.json")


def truncate_partial_line(path: Path) -> None:
    """Drop a last line without its newline (a write cut by a kill)."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def settings_path(out: str | Path) -> Path:
    """`<out>.settings.json`: the settings that decide an output's replies (`output_settings`),
    written before its first record, so that a resume, also after a kill, is checked against them."""
    out = Path(out)
    return out.with_name(out.name + ".settings.json")


def output_settings(cfg: Config, rc: RegenerateSection, client: OpenAIClient | None) -> dict[str, Any]:
    """What decides the replies an output holds, by config key: the model (the target here, or the
    model a server serves), the API that renders the prompts, and the sampling."""
    return {"target.path": cfg.target.path, "regenerate.engine": "openai" if client else "transformers",
            "regenerate.model": client.model if client else None, "regenerate.api": rc.api if client else None,
            "regenerate.temperature": rc.temperature, "regenerate.max_new_tokens": rc.max_new_tokens,
            "regenerate.max_turns": rc.max_turns, "regenerate.drop_thinking": rc.drop_thinking}


def check_resume(out: Path, settings: dict[str, Any]) -> None:
    """Refuse (ResumeError) to add to an output whose records were made with other settings: the
    two runs would mix in one file. Records the settings when the output has none yet."""
    path = settings_path(out)
    written = any(p.stat().st_size > 0 for p in output_files(out))
    before = None
    if path.is_file():
        try:
            before = json.loads(path.read_text())
            if not isinstance(before, dict):
                raise ValueError("not an object")
        except ValueError as e:
            if written:
                raise CorruptDataError(f"regenerate.out: {path} is damaged ({e})",
                                       fix=f"delete it to record this run's settings for {out}, if they are "
                                           "the ones its records were made with") from None
            before = None
    if written and before is not None:
        differ = [k for k in settings if before.get(k) != settings[k]]
        if differ:
            was = ", ".join(f"{k}={before.get(k)!r}" for k in differ)
            now = ", ".join(f"{k}={settings[k]!r}" for k in differ)
            raise ResumeError(f"regenerate.out: {out} holds records made with {was}; this run has {now}: resuming "
                              "would mix two runs in one output",
                              fix=f"rerun with {was}, or give a new --out (or delete {out}* to start afresh)")
        return
    if written:
        log(f"[warning] regenerate: {out} has records but no {path.name} (not written by this regenerate): the settings they "
            "were made with cannot be checked; this run's are recorded")
    if before != settings:
        path.parent.mkdir(parents=True, exist_ok=True)  # the output's folder, made once nothing refused the run
        atomic_write_json(path, settings)
