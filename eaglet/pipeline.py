"""Stages, manifests and `eaglet run`.

Each stage writes into `<run.dir>/<stage>/` and, when it finishes, a `manifest.json` there:
the resolved config, the hash of the stage's inputs, library versions, timings and stats.
A stage's inputs are its own config sections, the fingerprints of files it reads, what it
reads of the target (prepare its tokenizer files, extract its config and weights:
eaglet/targets/identity.py), and the input hash of the stage before it, so a change anywhere
reruns that stage and all after it.
`eaglet run` skips a stage whose manifest is complete with the same input hash (`input_hash`,
the one hash scheme) and whose outputs are still there.

Outputs: each stage's format modules list what they write, with its sha256 taken as it was
written, in a checksums.json beside it (eaglet/formats/checked.py); the manifest records those
files (`outputs`: relative path -> sha256 and bytes; `Stage.outputs` says where they are). The
plan checks that each is there with its size (no file is read: a terabyte store is not hashed to
plan a run), so a stage whose output is missing or cut runs again, and a stage that needs it
alone is refused (CorruptDataError, with the command that rebuilds it). The sha256 is checked
where a file is read.

Format version: each manifest records MANIFEST_VERSION (eaglet/formats/version.py). A stage folder
whose manifest is of another version, or has none, is refused in one line naming the folder and
`eaglet run CONFIG --force` (`--force` on the stage itself runs it afresh over it): what an
older eaglet wrote is never read as today's, nor kept up to date by a second hash scheme.

Under torchrun every rank runs this same code: `extract` and `train` run on all ranks
(they split the work, see eaglet/draft/parallelize.py); the other stages run on rank 0 while the
others wait; rank 0 alone writes manifests. run.dir must be one folder all ranks see.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import platform
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from .doctor import preflight as run_preflight
from .draft import draft_type
from .config import Config, TargetSection
from .distributed import broadcast_object, dist_env, init_distributed, run_on_main
from .draft import draft_type
from .errors import CorruptDataError, InputError, ResumeError
from .evaluation.context_length import context_length_text
from .formats.checked import listed, outputs_problem
from .formats.version import KEY as VERSION_KEY, MANIFEST_VERSION, check_version
from .formats.datasets import check_data_files
from .formats.draft import FINAL_DIR
from .formats.eval_sets import NAMED_SETS
from .context import StageContext
from .targets.identity import model_identity, tokenizer_identity
from .utils import atomic_write_text, file_fingerprint, log

MANIFEST = "manifest.json"
FINGERPRINTS = ".fingerprints.json"  # in run.dir: the input files' hashes by (path, size, mtime)


@dataclass(frozen=True)
class Stage:
    name: str
    sections: tuple[str, ...]  # config sections that are this stage's inputs
    entry: str  # "module:function", imported only when the stage runs
    input_files: Callable[[Config], list[tuple[str, str]]] = lambda cfg: []  # (config key, file)
    distributed: bool = False  # under torchrun every rank runs it (else rank 0 alone)
    target: Callable[[TargetSection, Path], dict[str, Any]] | None = None  # what it reads of the target
    # The stages before it that it reads (None: all); its input hash chains to the last of them.
    needs: Callable[[Config], tuple[str, ...]] | None = None
    # Its outputs, as its manifest lists them (eaglet/formats/checked.py `listed`): the folders
    # (relative to its own) whose checksums.json lists what later stages read (the store's shards,
    # which have sidecars, are not listed).
    outputs: Callable[[Config], tuple[str, ...]] = lambda cfg: ()
    # Settings outside its sections that decide what it writes (the draft types' own sections).
    more: Callable[[Config], dict[str, Any]] = lambda cfg: {}

    def function(self) -> Callable[[Config, StageContext], dict[str, Any]]:
        mod, fn = self.entry.split(":")
        return getattr(importlib.import_module(mod), fn)


def _prepare_files(cfg: Config) -> list[tuple[str, str]]:
    # the data files as prepare checks them (found, readable kinds, none listed twice), before any is hashed
    files = [("prepare.data", str(p)) for p in check_data_files(cfg.prepare.data)]
    if cfg.target.chat_template:
        files.append(("target.chat_template", cfg.target.chat_template))
    return files


def _init_files(cfg: Config) -> list[tuple[str, str]]:
    """train.init_from: a draft file, or every file of a draft folder."""
    src = Path(cfg.train.init_from) if cfg.train.init_from else None
    if src is None or not src.exists():
        return []
    files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
    return [("train.init_from", str(p)) for p in files]


def _fingerprint(key: str, path: str, cache: Path) -> str:
    p = Path(path)
    if not p.is_file():
        what = "is a folder, not a file" if p.is_dir() else "file not found"
        raise InputError(f"{key}: {what}: {p}", fix="correct the path in the config (or --set " + key + "=...)")
    return file_fingerprint(p, cache)


def _eval_files(cfg: Config) -> list[tuple[str, str]]:
    """eval.draft's files (a draft from elsewhere) and eval.prompts when it is a file."""
    files = []
    if cfg.eval.draft:
        folder = Path(cfg.eval.draft)
        if not folder.is_dir():
            raise InputError(f"eval.draft: not a folder: {folder}", fix="name an export folder (config.json and model.safetensors)")
        files += [("eval.draft", str(p)) for p in sorted(folder.rglob("*")) if p.is_file()]
    if cfg.eval.prompts not in NAMED_SETS:
        files.append(("eval.prompts", cfg.eval.prompts))
    return files


def _eval_needs(cfg: Config) -> tuple[str, ...]:
    """The run's own draft needs every stage; a draft from elsewhere (eval.draft) only prepare's
    held-out split, or nothing for MT-bench or a prompts file."""
    if not cfg.eval.draft:
        return ("prepare", "extract", "vocab", "train", "export")
    return ("prepare",) if cfg.eval.prompts == "heldout" else ()


def _types_sections(cfg: Config, names: list[str]) -> dict[str, Any]:
    """The sections the draft types `names` keep their own keys in (a type without one adds nothing)."""
    return {name: cfg.type_section(name) for name in names if cfg.type_section(name) is not None}


def _extract_more(cfg: Config) -> dict[str, Any]:
    """What decides the extracted layers besides extract.*: the keys of train.algorithm's and
    extract.draft_types' own sections that choose their layers (a type's LAYER_KEYS: dflash.layers,
    dflash.target_layers), so that another block size trains from the same store."""
    keys = {}
    for name, section in _types_sections(cfg, [cfg.train.algorithm, *cfg.extract.draft_types]).items():
        chosen = {k: section[k] for k in getattr(draft_type(name), "LAYER_KEYS", ())}
        if chosen:
            keys[name] = chosen
    return {"draft_type_layers": keys} if keys else {}


def _train_more(cfg: Config) -> dict[str, Any]:
    """The trained type's own section (dflash.*, peagle.*); EAGLE-3's keys are train.*."""
    sections = _types_sections(cfg, [cfg.train.algorithm])
    if not sections:
        return {}
    return {"draft_type_sections": sections, "algorithm": cfg.train.algorithm}


def _here(cfg: Config) -> tuple[str, ...]:
    """The stage folder's own checksums.json."""
    return (".",)


STAGES: list[Stage] = [
    Stage("prepare", ("target", "prepare"), "eaglet.stages.prepare:run_prepare",
          _prepare_files, target=tokenizer_identity, outputs=_here),
    Stage("extract", ("target", "extract"), "eaglet.stages.extract:run_extract", distributed=True,
          target=model_identity, outputs=_here, more=_extract_more),
    Stage("vocab", ("vocab",), "eaglet.stages.vocab:run_vocab", outputs=_here),
    Stage("train", ("train",), "eaglet.stages.train:run_train", _init_files, distributed=True,
          outputs=lambda cfg: (FINAL_DIR,), more=_train_more),
    Stage("export", ("export", "target"), "eaglet.stages.export:run_export",
          outputs=lambda cfg: tuple(f for f in cfg.export.formats
                                    if f in draft_type(cfg.train.algorithm).SERVING_FORMATS)),
    Stage("eval", ("eval",), "eaglet.stages.evaluate:run_eval", _eval_files, needs=_eval_needs),
]
STAGE_NAMES = [s.name for s in STAGES]
# Stages that load a model or render templates: the doctor's cheap checks of their own
# contracts run first (eaglet/doctor.py `preflight`).
PREFLIGHT_STAGES = ("prepare", "extract", "train", "eval")


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("eaglet", "torch", "transformers", "safetensors", "tokenizers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def input_hash(inputs: dict[str, Any]) -> str:
    """The hash of a stage's inputs (`stage_inputs`): the one scheme eaglet uses. A change to it,
    or to what `stage_inputs` gathers, reruns every stage of existing runs once; nothing maps an
    old hash onto a new one."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def stage_inputs(cfg: Config, stage: Stage, previous_hash: str | None) -> dict[str, Any]:
    """Everything the stage's output depends on, as a JSON-able dict (hashed by `input_hash`)."""
    cache = cfg.run_dir / FINGERPRINTS
    inputs = {
        "stage": stage.name,
        "config": {s: cfg.hashed_section(s) for s in stage.sections},
        "files": {p: _fingerprint(key, p, cache) for key, p in stage.input_files(cfg)},
        "previous": previous_hash,
        "seed": cfg.run.seed,
    }
    if stage.target is not None:
        inputs["target"] = stage.target(cfg.target, cache)
    more = stage.more(cfg)
    if more:  # absent when empty: a run of the defaults keeps the hash it had before draft types
        inputs["more"] = more
    return inputs


def read_manifest(stage_dir: Path) -> dict[str, Any] | None:
    path = stage_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


@dataclass(frozen=True)
class Plan:
    """The stages up to one, with their input hashes, and each one's manifest as the plan found
    it (None: none); `damaged`, by stage, the first output its manifest lists that is missing or
    not its size ("<path>: <why>")."""
    stages: list[tuple[Stage, str, dict[str, Any]]]
    manifests: dict[str, dict[str, Any] | None]
    damaged: dict[str, str]

    def current(self, name: str, h: str) -> bool:
        """Whether stage `name`'s manifest was written for the inputs whose hash is `h`."""
        old = self.manifests.get(name)
        return old is not None and old.get("input_hash") == h


def check_manifest(cfg: Config, name: str, manifest: dict[str, Any] | None) -> None:
    """Refuse (FormatVersionError) a stage folder whose manifest is of another format version, or
    has none: its files are another eaglet's, which this one does not read."""
    if manifest is not None:
        check_version(manifest.get(VERSION_KEY), MANIFEST_VERSION, f"stage {name}'s manifest", cfg.run_dir / name,
                      fix=f"start afresh with `eaglet run CONFIG --force` (or `eaglet {name} CONFIG --force`, or "
                          f"remove {cfg.run_dir / name})")


def _damaged(cfg: Config, manifests: dict[str, dict[str, Any] | None]) -> dict[str, str]:
    """Stage -> its first listed output that is missing or not its size (sizes only); a manifest
    of this format lists its outputs (one that does not is refused, `check_manifest`)."""
    out = {}
    for stage in STAGES:
        m = manifests.get(stage.name)
        if not m or m.get(VERSION_KEY) != MANIFEST_VERSION:
            continue
        problem = outputs_problem(cfg.run_dir / stage.name, m.get("outputs") or {})
        if problem is not None:
            out[stage.name] = problem
    return out


def _stage_plan(cfg: Config, upto: str) -> Plan:
    plan, manifests, hashes = [], {}, {}
    for stage in STAGES:
        needs = _needs(cfg, stage)
        inputs = stage_inputs(cfg, stage, hashes[needs[-1]] if needs else None)
        h = input_hash(inputs)
        plan.append((stage, h, inputs))
        hashes[stage.name] = h
        manifests[stage.name] = read_manifest(cfg.run_dir / stage.name)
        if stage.name == upto:
            break
    # rank 0's view of the files, so that every rank decides alike
    damaged = broadcast_object(_damaged(cfg, manifests) if dist_env().is_main else None)
    return Plan(plan, manifests, damaged)


def _needs(cfg: Config, stage: Stage) -> tuple[str, ...]:
    """The stages before `stage` that it reads, in order."""
    before = tuple(STAGE_NAMES[: STAGE_NAMES.index(stage.name)])
    return before if stage.needs is None else tuple(n for n in before if n in stage.needs(cfg))


def _holds_no_file(folder: Path) -> bool:
    return not any(not p.is_dir() for p in folder.rglob("*"))


def _remove_empty(folder: Path) -> None:
    """Remove `folder` and the folders in it, if none holds a file (a link counts as one)."""
    if not folder.is_dir() or folder.is_symlink() or not _holds_no_file(folder):
        return
    for sub in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True) + [folder]:
        try:
            sub.rmdir()
        except OSError:  # something appeared in it meanwhile: it stays
            return


@contextmanager
def _nothing_left_on_failure(cfg: Config) -> Iterator[None]:
    """A command that fails leaves the folders it made only where they hold a file (a stage's
    partial work, which a rerun resumes): a failure before any stage ran (a config error, a
    preflight FAIL, a missing input) leaves run.dir as it was, or absent. The input-hash cache,
    which planning writes, goes when this command made it and no stage folder it made holds a
    file. Nothing that existed before is removed."""
    run_dir = cfg.run_dir.absolute()
    made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # the deepest first
    stage_dirs = [run_dir / s.name for s in STAGES if not (run_dir / s.name).exists()]
    cache_made = not (run_dir / FINGERPRINTS).exists()
    try:
        yield
    except BaseException:
        if dist_env().is_main:
            if cache_made and all(not d.is_dir() or _holds_no_file(d) for d in stage_dirs):
                (run_dir / FINGERPRINTS).unlink(missing_ok=True)
            for folder in stage_dirs + made:
                _remove_empty(folder)
        raise


def run_stage(cfg: Config, name: str, force: bool = False, check_upstream: bool = True,
              preflight: bool = True, extend: bool = False) -> dict[str, Any]:
    """Run one stage (if it is not up to date) and return its manifest. `preflight`: run the
    doctor's cheap checks first for the stages in PREFLIGHT_STAGES (see eaglet/doctor.py).
    Failing, it leaves no empty folder it made (`_nothing_left_on_failure`)."""
    with _nothing_left_on_failure(cfg):
        return _run_stage(cfg, name, force, check_upstream, preflight, extend)


def _run_stage(cfg: Config, name: str, force: bool, check_upstream: bool, preflight: bool,
               extend: bool) -> dict[str, Any]:
    init_distributed(cfg.run.dist_timeout_minutes)
    plan = _stage_plan(cfg, name)
    run_dir = cfg.run_dir
    upstream = {}
    needed = _needs(cfg, plan.stages[-1][0])
    for stage, h, inputs in plan.stages[:-1]:
        if stage.name not in needed:
            continue
        if check_upstream:
            check_manifest(cfg, stage.name, plan.manifests[stage.name])
        if check_upstream and not plan.current(stage.name, h):
            why = "has not run" if plan.manifests[stage.name] is None else \
                "is out of date (its inputs changed since it ran)"
            raise InputError(f"stage {name} needs stage {stage.name}, which {why} in {run_dir / stage.name}",
                             fix=f"run `eaglet {stage.name} CONFIG` first, or `eaglet run CONFIG` for every stage")
        if check_upstream and stage.name in plan.damaged:
            raise CorruptDataError(f"stage {name} needs stage {stage.name}'s output "
                                   f"{run_dir / stage.name}/{plan.damaged[stage.name]}",
                                   fix=f"run `eaglet {stage.name} CONFIG`, which writes it again, or `eaglet run "
                                       "CONFIG`")
        upstream[stage.name] = run_dir / stage.name
    stage, h, inputs = plan.stages[-1]
    return _execute(cfg, plan, stage, h, inputs, upstream, force, preflight, extend)


def _execute(cfg: Config, plan: Plan, stage: Stage, h: str, inputs: dict[str, Any], upstream: dict[str, Path],
             force: bool, preflight: bool = True, extend: bool = False) -> dict[str, Any]:
    env = dist_env()
    out_dir = cfg.run_dir / stage.name
    old = plan.manifests[stage.name]  # the stages before it, run since the plan was made, write only their own
    if not force:
        check_manifest(cfg, stage.name, old)
    up_to_date = not force and plan.current(stage.name, h) and old.get("status") == "complete"
    if up_to_date and stage.name in plan.damaged:
        log(f"[{stage.name}] output {out_dir}/{plan.damaged[stage.name]}; running the stage again")
        up_to_date = False
    if broadcast_object(up_to_date):  # rank 0 decides, before it removes anything
        log(f"[{stage.name}] up to date ({out_dir}), skipped")
        return old
    if preflight and stage.name in PREFLIGHT_STAGES:
        run_on_main(run_preflight, cfg, stage.name)  # raises PreflightError before any weights load

    def start() -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / MANIFEST).unlink(missing_ok=True)  # an incomplete stage has no manifest

    run_on_main(start)
    ctx = StageContext(stage.name, out_dir, cfg.run_dir, h, upstream, force=force, extend=extend)
    log(f"[{stage.name}] running -> {out_dir}" + (f" on {env.world_size} ranks" if env.active and stage.distributed
                                                 else " on rank 0" if env.active else ""))
    t0 = time.time()

    def finish(stats: dict[str, Any]) -> dict[str, Any]:
        manifest = {
            "stage": stage.name,
            VERSION_KEY: MANIFEST_VERSION,
            "status": "complete",
            "input_hash": h,
            "inputs": inputs,
            "config": cfg.to_dict(),
            "versions": library_versions(),
            "host": platform.node(),
            "pid": os.getpid(),
            "world_size": env.world_size,
            "started": t0,
            "seconds": round(time.time() - t0, 3),
            "stats": stats,
            "outputs": listed(out_dir, stage.outputs(cfg)),
        }
        atomic_write_text(out_dir / MANIFEST, json.dumps(manifest, indent=2, default=str))
        log(f"[{stage.name}] done in {manifest['seconds']:.1f}s")
        return manifest

    try:
        if stage.distributed:
            stats = stage.function()(cfg, ctx)
            return run_on_main(finish, stats)
        return run_on_main(lambda: finish(stage.function()(cfg, ctx)))
    except ResumeError:
        # Refused before the stage changed anything: its outputs are still those the old
        # manifest describes, so the stages after it stay usable.
        if old is not None and old.get("status") == "complete":
            run_on_main(atomic_write_text, out_dir / MANIFEST, json.dumps(old, indent=2, default=str))
        raise


def run_all(cfg: Config, upto: str | None = None, force: bool = False, preflight: bool = True,
            extend: bool = False) -> list[dict[str, Any]]:
    """`eaglet run`: every stage in order, skipping those up to date (`extend`: train's --extend).
    Failing, it leaves no empty folder it made (`_nothing_left_on_failure`)."""
    with _nothing_left_on_failure(cfg):
        return _run_all(cfg, upto, force, preflight, extend)


def _run_all(cfg: Config, upto: str | None, force: bool, preflight: bool, extend: bool) -> list[dict[str, Any]]:
    init_distributed(cfg.run.dist_timeout_minutes)
    manifests, upstream = [], {}
    plan = _stage_plan(cfg, upto or STAGE_NAMES[-1])
    for stage, h, inputs in plan.stages:
        manifests.append(_execute(cfg, plan, stage, h, inputs, dict(upstream), force, preflight, extend))
        upstream[stage.name] = cfg.run_dir / stage.name
    return manifests


def lossless_verdict(cfg: Config, ev: dict[str, Any]) -> str:
    """The eval's lossless check in one phrase, on how many prompts, from its stats; or why it did not run."""
    n, bad = ev.get("num_prompts"), ev.get("lossless_mismatches")
    if ev.get("lossless") is True:
        return f"lossless: yes, the speculative output equals the target's own greedy output on all {n} prompts"
    if ev.get("lossless") is False:
        return (f"lossless: NO, {bad if bad is not None else 'some'} of {n} prompts differ from the target's own greedy "
                f"output (near-ties outside float32; eval/{ev.get('result')}: mismatches)")
    e = cfg.eval
    why = ("eval.replay decodes nothing" if e.replay else "sampled decoding (eval.temperature > 0) has no "
           "token-for-token check" if e.temperature > 0 else "eval.lossless_check is off")
    return f"lossless: not checked ({why})"


def run_summary(cfg: Config, manifests: list[dict[str, Any]]) -> str:
    """What a user who just ran the pipeline (or its export or eval) wants to see: tau and the
    acceptance per draft position, the lossless verdict, why fewer prompts than eval.num_prompts
    asked for, eval.prompts records skipped, where the exports are, and the commands that serve
    them."""
    by = {m["stage"]: m.get("stats") or {} for m in manifests}
    lines = [f"eaglet: {cfg.run_dir}"]
    ev = by.get("eval")
    if ev:
        e, v = cfg.eval, ev.get("vllm") or {}
        drafting = f"chain of {e.chain_tokens}" if e.method == "chain" else "tree"
        if ev.get("tau") is not None:
            ref = f" (untrained draft {ev['reference_tau']:.3f})" if ev.get("reference_tau") is not None else ""
            if ev.get("trained_no_better_than_untrained"):
                ref += ": WARNING, no better than the untrained draft on the same prompts"
            lines.append(f"  tau, {drafting}, {ev.get('num_prompts')} prompts ({e.prompts}): {ev['tau']:.3f}{ref}")
            lines.append("  acceptance per draft position: "
                         + ", ".join("-" if a is None else f"{a:.2f}" for a in ev.get("acceptance_rate") or []))
        if note := (ev.get("prompt_count") or {}).get("note"):
            lines.append(f"  prompts: {ev['prompt_count']['used']} ({note})")
        if ev.get("tau") is not None:
            lines.append(f"  {lossless_verdict(cfg, ev)}")
        if v.get("mean_acceptance_length") is not None:
            rel = f" ({v['relative_difference']:+.1%} against eaglet's)" if v.get("relative_difference") is not None else ""
            speed = ", ".join(f"{b.replace('_', ' ')} {s:.2f}x" for b, s in (v.get("speedup") or {}).items() if s)
            lines.append(f"  in vLLM: mean acceptance length {v['mean_acceptance_length']:.3f}{rel}; speedup {speed}")
        for c, t in (ev.get("tau_by_category") or {}).items():
            lines.append(f"    {c:<12} {t:.3f}")
        if ev.get("by_context_length"):
            lines.append(f"  tau by context length (prompt tokens, earlier turns included): "
                         f"{context_length_text(ev['by_context_length'])}")
        if skipped := ev.get("skipped_prompts"):
            counts = ", ".join(f"{r}={n}" for r, n in skipped.items())
            lines.append(f"  skipped {sum(skipped.values())} record(s) of eval.prompts ({counts}); the first are "
                         f"in {ev.get('result') or ev.get('vllm_result')} (skipped_prompts)")
        lines.append(f"  results: {cfg.run_dir / 'eval'}")
    for fmt, x in (by.get("export") or {}).items():
        if isinstance(x, dict) and "path" in x:
            lines.append(f"  {fmt} export: {x['path']}")
            if x.get("serve_command"):
                lines.append(f"    serve: {x['serve_command']}")
    return "\n".join(lines)
