"""The shadow run: the whole pipeline on a tiny random model of the target's own family.

`eaglet doctor CONFIG --shadow` shrinks the target's config (same model_type and class,
same layer kinds, MoE routing, attention kind and wrapper nesting; 64-wide, 8 layers,
a few experts; the vocabulary is kept so the target's own tokenizer works), builds a random
model from it, and runs prepare, extract (with its self-check), vocab, two train steps,
export (which reloads every format) and eval of train.algorithm's draft type, then train,
export and eval of each further type of extract.draft_types on the same store (`TYPE_STAGES`),
on a few of the user's records (16, at most 2,048 tokens each: its first line names the cap
where it cuts prepare.max_length) in a temporary run folder. Every external call eaglet makes for this family is reached in well
under a minute on a CPU, before the real run loads its weights.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from . import pipeline
from .checks.findings import Probe, Report
from .config import Config
from .draft import draft_type
from .engines import engine, tiny_cpu_engine
from .targets.load import TargetParts, model_from_config

SHADOW_LAYERS = 8  # >= 8: the default layer ids [2, L//2, L-3] are distinct
SHADOW_RECORDS = 16  # records read per data file
# prepare.max_length's default, so a default config's records render as in the real run (a cap
# of 256 cut ShareGPT records before their first reply). A SmolLM2 shadow on 16 ShareGPT records,
# 2 busy cores: 14-16 s in all at 2048 (extract 7-8 s), 8 s at 256 (extract 1.3 s).
SHADOW_MAX_LENGTH = 2048
# The stages that a draft type of extract.draft_types runs again on the shadow's store.
TYPE_STAGES = ("train", "export", "eval")

# Width keys set to min(value, small); each keeps the relation the model code needs
# (heads x head_dim need not equal hidden in these families; head counts stay divisible).
_SMALL = {
    "hidden_size": 64, "intermediate_size": 128, "intermediate_size_mlp": 128, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "num_attention_heads": 4, "head_dim": 16,
    # MLA (DeepSeek-V2/V3, Kimi-K2)
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    # experts and routing
    "n_routed_experts": 8, "num_experts": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 3,
    # linear-attention hybrids (Qwen3-Next)
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    # vision towers (shrunk when a wrapper has one)
    "depth": 1, "out_hidden_size": 64, "projection_hidden_size": 64, "vision_hidden_size": 64,
}


def _shrink_level(c: dict[str, Any], num_layers: int) -> None:
    """Shrink one config level in place."""
    old_heads, old_kv = c.get("num_attention_heads"), c.get("num_key_value_heads")
    old_layers = c.get("num_hidden_layers")
    for key, small in _SMALL.items():
        v = c.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > small:
            c[key] = small
    if isinstance(old_kv, int) and isinstance(old_heads, int):
        c["num_key_value_heads"] = c["num_attention_heads"] if old_kv == old_heads else min(old_kv, 2)
    if isinstance(c.get("n_group"), int) and isinstance(c.get("topk_group"), int):
        c["topk_group"] = min(c["topk_group"], c["n_group"])
    if isinstance(old_layers, int) and old_layers > num_layers:
        c["num_hidden_layers"] = num_layers
        for key, v in list(c.items()):
            if isinstance(v, list) and len(v) == old_layers:  # per-layer lists (layer_types, no_rope_layers, ...)
                kept = v[:num_layers]
                if all(isinstance(t, (str, int)) for t in v):  # keep every layer kind present
                    missing = [t for t in dict.fromkeys(v) if t not in kept]
                    for j, t in enumerate(missing[:num_layers - 1]):
                        kept[num_layers - 1 - j] = t
                c[key] = kept
        for key in ("mlp_only_layers", "moe_layers", "full_attention_layers"):
            if isinstance(c.get(key), list):
                c[key] = [i for i in c[key] if isinstance(i, int) and i < num_layers]
        if isinstance(c.get("max_window_layers"), int):
            c["max_window_layers"] = min(c["max_window_layers"], num_layers)
    for key in ("rope_parameters", "rope_scaling"):  # multimodal RoPE sections must sum to head_dim / 2
        rope = c.get(key)
        if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list) and c.get("num_attention_heads"):
            half = (c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]) // 2
            old = rope["mrope_section"]
            new = [max(1, v * half // sum(old)) for v in old]
            new[0] += half - sum(new)
            rope["mrope_section"] = new


def _drop_derived(c: dict[str, Any], obj: Any) -> None:
    """Drop values a dataclass config derives itself (DeepSeek's head_dim, qk_head_dim), so
    they are derived again from the shrunk sizes; other configs are left as they are. Kept
    too: what the class's own __init__ names (a remote-code config such as Kimi-K2.5's takes
    its sub-configs as __init__ arguments) and the aliases of its attribute_map (Qwen3-MoE
    saves num_experts as num_local_experts: dropped, the tiny model had the default 128)."""
    if dataclasses.is_dataclass(obj):
        declared = {f.name for f in dataclasses.fields(obj)}
        declared |= set(inspect.signature(type(obj).__init__).parameters)
        aliases = getattr(type(obj), "attribute_map", None) or {}
        declared |= set(aliases) | set(aliases.values())
        for key in [k for k in c if k not in declared and k not in ("model_type", "auto_map")]:
            del c[key]


def shrink_config(hf_config: Any, num_layers: int = SHADOW_LAYERS) -> Any:
    """A config of the same class and model_type with small sizes (see module doc)."""
    d = hf_config.to_dict()
    text = hf_config.get_text_config()
    sub_keys = [k for k, v in d.items() if isinstance(v, dict) and "model_type" in v]
    text_key = next((k for k in sub_keys if getattr(hf_config, k, None) is text), None)
    for k in sub_keys:
        _shrink_level(d[k], num_layers if k == text_key else 1)
        _drop_derived(d[k], getattr(hf_config, k, None))
    top_layers = num_layers if text_key is None else 1
    _shrink_level(d, top_layers)
    _drop_derived(d, hf_config)
    if text_key is not None:  # keep the wrapper's own cross-references to the text width
        for k in ("projection_hidden_size",):
            if k in d and d[k] is not None:
                d[k] = d[text_key].get("hidden_size", d[k])
    for k in ("quantization_config", "_name_or_path", "dtype", "torch_dtype"):
        d.pop(k, None)
    return type(hf_config).from_dict(d)


def build_tiny_model(hf_config: Any, trust_remote_code: bool = False, seed: int = 0) -> Any:
    """A random float32 model of the shrunk config; the final norm gets random weights so a
    teacher state without the final norm changes the top-1 token (ones would only rescale)."""
    torch.manual_seed(seed)
    model = model_from_config(shrink_config(hf_config), dtype=torch.float32, trust_remote_code=trust_remote_code)
    with torch.no_grad():
        norm = TargetParts.of(model).norm
        if getattr(norm, "weight", None) is not None:
            norm.weight.uniform_(0.5, 1.5)
    return model.eval()


def _scaled_layers(layers: list[int] | None, old: int, new: int) -> list[int] | None:
    """The user's explicit layer ids moved proportionally onto `new` layers (None: default)."""
    if layers is None or old <= new:
        return layers
    scaled = [min(new - 1, round(i * new / old)) for i in layers]
    return scaled if len(set(scaled)) == len(scaled) else None


def shadow_config(cfg: Config, root: Path, target_dir: Path, num_target_layers: int) -> tuple[Config, list[str]]:
    """The user's config pointed at the tiny target and made small; returns (config, notes)."""
    s = copy.deepcopy(cfg)
    notes = []
    s.run.dir = str(root / "run")
    t = s.target
    t.path, t.tokenizer, t.gguf_file, t.revision = str(target_dir), None, None, None
    t.dtype, t.device, t.device_map = "float32", "cpu", None
    if t.attn_implementation and t.attn_implementation not in ("sdpa", "eager"):
        notes.append(f"target.attn_implementation {t.attn_implementation!r} -> 'sdpa' (CPU)")
        t.attn_implementation = "sdpa"
    p = s.prepare
    if p.max_length > SHADOW_MAX_LENGTH:  # first: a record skipped at this cap is the shadow's, not the config's
        notes.insert(0, f"prepare.max_length {p.max_length} -> {SHADOW_MAX_LENGTH} (the shadow's cap: a record "
                        "whose assistant turn starts later is skipped here, not in the real run)")
    p.max_records = min(p.max_records or SHADOW_RECORDS, SHADOW_RECORDS)
    p.max_length, p.num_workers, p.report_examples = min(p.max_length, SHADOW_MAX_LENGTH), 0, 0
    e = s.extract
    if not engine(e.backend).RUNS_TINY_ON_CPU:
        cpu = tiny_cpu_engine()
        notes.append(f"extract.backend {e.backend} -> {cpu} (a tiny CPU model; the doctor checks "
                     f"{engine(e.backend).TITLE}'s APIs itself)")
        e.backend, e.vllm_server, e.vllm_engine_args = cpu, None, {}
    e.layers = _scaled_layers(e.layers, num_target_layers, min(num_target_layers, SHADOW_LAYERS))
    e.batch_tokens, e.shard_mb, e.writer_threads, e.fsync = min(e.batch_tokens, 2048), 1.0, 1, False
    if e.store_dtype != "float32":
        notes.append(f"extract.store_dtype {e.store_dtype} -> float32 (a strict self-check on a random model)")
        e.store_dtype = "float32"
    e.selfcheck_samples = max(e.selfcheck_samples, 4)
    s.vocab.size = min(s.vocab.size, 1024)
    tr = s.train
    tr.max_steps, tr.epochs, tr.grad_accum = 2, 1, min(tr.grad_accum, 2)
    tr.max_tokens, tr.warmup_steps, tr.log_every = min(tr.max_tokens, 512), 1, 1
    tr.eval_every, tr.ckpt_every, tr.tensorboard, tr.device = 0, 2, False, "cpu"
    tr.eval_max_samples = min(tr.eval_max_samples, 4)
    if tr.attn_impl == "flex":
        notes.append("train.attn_impl flex -> auto (CPU flex_attention has no backward)")
        tr.attn_impl = "auto"
    # The real target's name, not the tiny one's temporary folder: the export checks the verifier
    # the real export would name (and says nothing of a folder that is gone after the shadow).
    s.export.verifier_name_or_path = cfg.export.verifier_name_or_path or cfg.target.path or None
    if tr.init_from:
        notes.append(f"train.init_from {tr.init_from} not used (its sizes are the real target's)")
        tr.init_from = None
    ev = s.eval
    ev.num_prompts, ev.max_new_tokens, ev.device, ev.dtype = 1, 16, "cpu", "auto"
    ev.reference_prompts = 0  # two steps train nothing: the untrained comparison would only warn that they did not
    if ev.vllm != "off":
        notes.append(f"eval.vllm {ev.vllm} -> off (the shadow run's eval is eaglet's own)")
        ev.vllm, ev.in_process = "off", True
    return s, notes


def shadow_findings(p: Probe, report: Report, keep: Path | None = None) -> None:
    """The doctor's further check (`eaglet doctor --shadow`): the shadow run on what the
    doctor's checks found (the target's config, tokenizer and adapter), when they found it all."""
    if p.hf_config is None or p.tokenizer is None or p.parts is None:
        report("FAIL", "shadow", "the target's config, tokenizer and adapter", "not all resolved (see above)",
               "fix the FAIL lines above first")
        return
    run_shadow(p.cfg, p.hf_config, p.tokenizer, p.parts.num_layers, report, keep=keep)


def run_shadow(cfg: Config, hf_config: Any, tokenizer: Any, num_target_layers: int, report: Report,
               keep: Path | None = None) -> None:
    """Build the tiny target, run every stage, and `report(status, check, expected, found, fix)`
    one line per step. `keep`: write into this folder and leave it (default: a temp folder)."""
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="eaglet-shadow-"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is fastest, and immune to a busy machine
    try:
        t0 = time.time()
        target_dir = root / "target"
        try:
            model = build_tiny_model(hf_config, cfg.target.trust_remote_code, seed=cfg.run.seed)
            model.save_pretrained(target_dir)
            tokenizer.save_pretrained(target_dir)
        except Exception as e:  # noqa: BLE001 - any failure here is the finding
            report("FAIL", "shadow: tiny model", f"a small {type(hf_config).__name__} builds from the target's config",
                   f"{type(e).__name__}: {e}", "report it with the target's config.json; eaglet/shadow.py _SMALL "
                   "lists the sizes it shrinks")
            return
        n_params = sum(p.numel() for p in model.parameters())
        scfg, notes = shadow_config(cfg, root, target_dir, num_target_layers)
        report("ok", "shadow: tiny model", f"{type(model).__name__} like the target",
               f"{type(model).__name__} ({hf_config.get_text_config().model_type}), "
               f"{model.config.get_text_config().num_hidden_layers} layers, {n_params / 1e6:.1f}M params in "
               f"{time.time() - t0:.1f}s" + (f"; shadow settings: {'; '.join(notes)}" if notes else ""), "")
        if not _run_stages(scfg, pipeline.STAGE_NAMES, "", model, cfg, report):
            return
        for kind in further_types(scfg):  # the store holds their layers: each trains, exports and evaluates
            if not _run_stages(type_config(scfg, kind.NAME), TYPE_STAGES, f" ({kind.TITLE})", model, cfg, report):
                return
        report("ok", "shadow: total", "under a minute on a CPU", f"{time.time() - t0:.1f}s", "")
    finally:
        torch.set_num_threads(threads)
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)


def further_types(cfg: Config) -> list[Any]:
    """The draft types of extract.draft_types besides train.algorithm's, once each, in order."""
    names = dict.fromkeys(n for n in cfg.extract.draft_types if n != cfg.train.algorithm)
    return [draft_type(n) for n in names]


def type_config(cfg: Config, name: str) -> Config:
    """The shadow's config training draft type `name` on the same store: train.algorithm alone
    changes, so prepare, extract and vocab stay current (the extract stage's inputs do not name
    train.algorithm; the store holds the union of train.algorithm's and extract.draft_types' layers)."""
    out = copy.deepcopy(cfg)
    out.train.algorithm = name
    return out


def _run_stages(scfg: Config, names: Sequence[str], label: str, model: Any, cfg: Config, report: Report) -> bool:
    """Run `names` in order with `scfg`, one report line each (`label` after the stage's name);
    False after the first that fails (its FAIL line reported)."""
    for name in names:
        t1 = time.time()
        try:
            m = pipeline.run_stage(scfg, name, force=True, preflight=False)
        except Exception as e:  # noqa: BLE001
            report("FAIL", f"shadow: {name}{label}", f"stage {name} runs on the tiny {type(model).__name__}",
                   f"{type(e).__name__}: {str(e)[:600]}",
                   f"the real run would fail the same way in `eaglet {name}`"
                   + (f" with train.algorithm {scfg.train.algorithm}" if label else ""))
            return False
        report("ok", f"shadow: {name}{label}", "completes",
               f"{time.time() - t1:.1f}s; {_summary(name, m['stats'], cfg, scfg)}", "")
    return True


def _summary(stage: str, stats: dict[str, Any], cfg: Config, scfg: Config) -> str:
    """A stage's line of the shadow run; prepare's skipped records with the shadow's own cap on
    prepare.max_length where it cut the config's."""
    if stage == "prepare":
        skipped, length = stats.get("skipped") or {}, scfg.prepare.max_length
        cap = f"the shadow's cap, not the config's {cfg.prepare.max_length}" if cfg.prepare.max_length > length \
            else "the config's"
        return f"{stats.get('samples')} samples, {stats.get('tokens')} tokens" + (
            f"; {sum(skipped.values())} of {stats.get('records')} records skipped "
            f"({', '.join(f'{k}={v}' for k, v in sorted(skipped.items()))}) at prepare.max_length {length} ({cap})"
            if skipped else "")
    if stage == "extract":
        sc = stats.get("selfcheck") or {}
        return f"{stats.get('samples')} samples, self-check top-1 {sc.get('top1_agreement', float('nan')):.2%}"
    if stage == "vocab":
        return f"draft vocab {stats.get('draft_vocab_size')}"
    if stage == "train":
        return f"{stats.get('steps')} steps"
    if stage == "export":
        return ", ".join(f"{fmt} reloaded (max logit error {v.get('reload_max_logit_error', 0):.1e})"
                         for fmt, v in stats.items() if isinstance(v, dict))
    return ", ".join(f"{k}={v}" for k, v in list(stats.items())[:4])
