"""`eaglet doctor`: find what would break a run before it loads a single weight.

    eaglet doctor CONFIG            # seconds: config, tokenizer, adapter, sizes, disk, memory, APIs
    eaglet doctor CONFIG --shadow   # plus the whole pipeline on a tiny model of the target's family

The checks read the target's config and tokenizer and build the model's skeleton on the
meta device (no weights, no memory): that is enough to resolve eaglet's adapter for the
architecture, count parameters, check the captured layer ids and vocabulary sizes, and
inspect the exact classes whose signatures eaglet's hooks rely on (eaglet/checks/contracts.py).
Each finding is one line: status (ok, info, warn, FAIL), what was expected, what was found
and, when it is not ok, how to fix it. Any FAIL makes the exit code 1.

Every stage that loads a model or renders templates (prepare, extract, train, eval,
regenerate) runs its share of these checks (`preflight`, the stages of CHECKS) before
loading weights and stops on a FAIL; `--skip-preflight` turns that off.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .checks.contracts import CONTRACTS, check_contracts, describe, select_contracts
from .checks.findings import Finding, Probe, Report
from .checks.selfcheck import REF_MAX_TOKENS
from .checks.sizing import (
    DTYPE_BYTES,
    draft_need,
    gib,
    hidden_and_aux,
    peak_writes,
    quant_bits,
    target_dtype_bytes,
    train_disk,
    weight_bytes,
)
from .config import Config
from .distributed import resolve_device
from .draft import draft_type
from .engines import ENGINES, contract_stages, engine, engine_contracts
from .errors import ConfigError, EagletError, PreflightError
from .formats.buffer import buffer_folder
from .formats.datasets import check_data_file, iter_records, row_label
from .formats.loaders import speculators_verifier_problem
from .formats.store import HEAD_FILE, TARGET_CONFIG
from .targets.chat import (
    Settings,
    check_fast_tokenizer,
    load_tokenizer,
    mask_method,
    process_record,
    resolve_chat_template,
)
from .targets.families import ADD_FAMILY, UnsupportedFamily, extraction_layers, supported
from .targets.load import TargetParts, build_meta_model, hub_kwargs, local_folder, target_source
from .utils import log

TORCH_RANGE = ("2.11", "2.15")  # >= first, < second
TRANSFORMERS_MIN = "5.17"
DOCTOR_RECORDS = 8  # records per data file rendered by the mask check and the disk estimate


def streaming(cfg: Config) -> bool:
    """An online run whose states an engine outside eaglet's processes computes (and streams)."""
    return cfg.extract.mode == "online" and not engine(cfg.extract.backend).TARGET_IN_PROCESS


# ---- versions and API contracts ---------------------------------------------------------------

def check_versions(p: Probe) -> None:
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        tv, xv = version("torch"), version("transformers")
    except PackageNotFoundError as e:
        p.add("FAIL", "versions", "torch and transformers installed", f"missing: {e}", "pip install -e .")
        return
    t = Version(tv.split("+")[0])
    ok_t = Version(TORCH_RANGE[0]) <= t < Version(TORCH_RANGE[1])
    p.add("ok" if ok_t else "FAIL", "torch version", f">= {TORCH_RANGE[0]}, < {TORCH_RANGE[1]}", tv,
          f"pip install 'torch>={TORCH_RANGE[0]},<{TORCH_RANGE[1]}' (keep your CUDA build's index URL)")
    ok_x = Version(xv) >= Version(TRANSFORMERS_MIN)
    p.add("ok" if ok_x else "FAIL", "transformers version", f">= {TRANSFORMERS_MIN}", xv,
          f"pip install 'transformers>={TRANSFORMERS_MIN}'")


def check_api_contracts(p: Probe) -> None:
    import transformers

    roles: dict[str, list[type]] = {}
    if p.parts is not None:
        hooked = p.layers if p.layers is not None else range(p.parts.num_layers)
        roles["decoder_layer"] = list(dict.fromkeys(type(p.parts.layers[i]) for i in hooked))
        roles["base_model"] = [type(p.parts.decoder)]
        roles["causal_lm"] = [type(p.model)]
    roles["tokenizer"] = [type(p.tokenizer) if p.tokenizer is not None else transformers.PreTrainedTokenizerBase]
    roles.update(p.vllm_roles)
    rows = CONTRACTS + engine_contracts()  # the common table's and each engine's own
    stages = {s for c in rows for s in c.stages} if p.stage is None else {p.stage}
    # each engine's own rows where this config calls it (the HF engine's hooks or vLLM's own APIs,
    # for the engine that runs the target; vLLM's eval rows where the eval measures the export in it)
    stages = stages - contract_stages() | set().union(*(e.contract_stages(p.cfg, stages) for e in ENGINES.values()))

    def unchecked(c: Any) -> bool:  # an engine's own library, not installed here
        return any(e.unchecked_contract(p, c) for e in ENGINES.values())

    results = check_contracts(roles, stages, cfg=p.cfg, unchecked=unchecked, rows=rows)
    off = select_contracts(stages, p.cfg, unchecked, rows)[1]
    for r in results:
        if r.ok:
            continue
        p.add("FAIL", f"API {r.target}", f"{describe(r.contract.params, r.contract.passes)} (for {r.contract.why})",
              f"{r.problem}: {r.found}", r.contract.fix)
    n_ok = sum(r.ok for r in results)
    skipped = [k for k in ("decoder_layer", "base_model", "causal_lm") if k not in roles and stages & {"extract", "eval"}]
    p.add("ok" if n_ok == len(results) else "info", "API contracts", f"{len(results)} signatures as eaglet calls them",
          f"{n_ok} of {len(results)} match" + (f" (target classes not checked: {', '.join(skipped)})" if skipped else "")
          + (f"; {len(off)} not on this config's code path ({', '.join(sorted({c.where.split(':')[-1] for c in off}))})"
             if off else ""))


# ---- the target -------------------------------------------------------------------------------------

def _raw_config(path: str) -> dict[str, Any]:
    f = Path(path) / "config.json"
    try:
        return json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}


# made by eaglet when missing
_WRITTEN = ("run.dir", "regenerate.out", "extract.vllm_storage", "extract.stream_dir", "train.compile_cache")


def check_paths(p: Probe) -> None:
    """Each path of the config (`Config.paths`: a relative one in a config file is taken
    against the file's folder when the config is read), and whether it is there."""
    shown = []
    for label, v in p.cfg.paths():
        path = Path(v).expanduser()
        if path.exists():
            shown.append(f"{label}={path.resolve()}")
        else:
            shown.append(f"{label}={path.resolve()} (to be made)" if label in _WRITTEN else f"{label}={v} (not found)")
    p.add("info", "paths", "each path of the config as eaglet reads it", "; ".join(shown) or "none set")


def check_export_verifier(p: Probe) -> None:
    """The target as the vLLM export names it (speculators_config.verifier.name_or_path), which
    `vllm serve EXPORT` and speculators load. A local path serves on this machine (and wherever
    the same path holds the target): an info line, as the user chose no name. A warn only where
    the export would be wrong to serve: a local verifier folder that speculators cannot load a
    draft against (no safetensors checkpoint, as a GGUF target's folder; no embedding table)."""
    e = p.cfg.export
    if "vllm" not in e.formats or p.cfg.train.draft_attention == "mla":
        return  # an MLA draft's export is a flat config that names no verifier (draft/eagle3/serving_mla.py)
    verifier = e.verifier_name_or_path or p.cfg.target.path
    folder = local_folder(verifier, p.cfg.target.revision) if verifier else None
    problem = speculators_verifier_problem(folder) if folder is not None and folder.is_dir() else None
    expected = "the target as the serving machine names it"
    if problem:
        p.add("warn", "export verifier", f"{expected}, a checkpoint the draft loads against", problem,
              "set export.verifier_name_or_path to the target's hub id or a folder of its safetensors checkpoint "
              "(on the server)")
    elif e.verifier_name_or_path:  # set: the name the user means the server to use
        p.add("ok", "export verifier", expected, e.verifier_name_or_path)
    elif Path(p.cfg.target.path).is_absolute():
        p.add("info", "export verifier", expected,
              f"the local path {p.cfg.target.path} (target.path), which serves on this machine; to serve the "
              "export elsewhere, set export.verifier_name_or_path to the target's hub id (or its path there)")
    else:
        p.add("ok", "export verifier", expected, f"target.path {p.cfg.target.path or '(not set)'}")


def check_target_config(p: Probe) -> None:
    if p.stage == "train" and not streaming(p.cfg):
        return  # train reads the target's config from the store, except when it streams
    t = p.cfg.target
    try:
        target_source(t)
    except EagletError as e:  # not set, or a folder not found: one line, not transformers' hub-id error
        p.add("FAIL", "target config", "target.path: a model folder (or a hub id in the local cache)", e.message,
              e.fix or "", error=e)
        return
    raw = _raw_config(t.path)
    auto_map = raw.get("auto_map") or {}
    from transformers import AutoConfig

    try:
        p.hf_config = AutoConfig.from_pretrained(t.path, **hub_kwargs(t))
    except Exception as e:  # noqa: BLE001 - the message is the finding
        if auto_map and not t.trust_remote_code:
            p.add("FAIL", "target config", "a config class transformers has built in",
                  f"model_type {raw.get('model_type')!r} needs the repo's own code (auto_map: {auto_map})",
                  "set target.trust_remote_code: true (runs the model repo's Python code: only for a repo you trust)")
        else:
            p.add("FAIL", "target config", f"a readable config at {t.path}", f"{type(e).__name__}: {str(e)[:300]}",
                  "check target.path (a local model folder or a hub id already in the cache)")
        return
    p.text_config = p.hf_config.get_text_config()
    text_cfg = p.text_config
    p.add("ok", "target config", "readable", f"{type(p.hf_config).__name__} model_type={text_cfg.model_type} "
          f"layers={getattr(text_cfg, 'num_hidden_layers', '?')} hidden={getattr(text_cfg, 'hidden_size', '?')} "
          f"vocab={getattr(text_cfg, 'vocab_size', '?')}")
    if auto_map:
        classes = ", ".join(sorted(set(auto_map.values()) if isinstance(auto_map, dict) else []))[:200]
        if t.trust_remote_code:
            p.add("info", "remote code", "target.trust_remote_code: the repo's own code runs",
                  f"auto_map: {classes}")
        else:
            p.add("warn", "remote code", "the model repo's own code, which its config.json asks for (auto_map)",
                  f"not run: target.trust_remote_code is off, transformers' built-in {text_cfg.model_type} classes are used "
                  f"instead of {classes}",
                  "keep it off to use the built-in classes, or set target.trust_remote_code: true for a repo you trust")
    quant = getattr(p.hf_config, "quantization_config", None) or raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else type(quant).__name__
        bits = quant_bits(quant)
        estimate = ("the memory estimate counts its decoder-layer weights at that width" if bits else
                    "the memory estimate (parameters x target.dtype) is an upper bound")
        p.add("info", "quantization", "weights loaded as target.dtype",
              f"the checkpoint is quantized ({method}" + (f", {bits}-bit" if bits else "")
              + f"); transformers loads it with its quantizer; {estimate}")


def check_tokenizer(p: Probe) -> None:
    t = p.cfg.target
    try:
        p.tokenizer = load_tokenizer(t)
    except EagletError as e:
        if not t.tokenizer and any(f.check == "target config" and f.error is not None for f in p.findings):
            return  # target.path, already a FAIL
        p.add("FAIL", "tokenizer", f"a tokenizer at {t.tokenizer or t.path}", e.message, e.fix or "", error=e)
        return
    except Exception as e:  # noqa: BLE001
        p.add("FAIL", "tokenizer", f"a tokenizer at {t.tokenizer or t.path}", f"{type(e).__name__}: {str(e)[:300]}",
              "set target.tokenizer to the target's tokenizer folder")
        return
    try:
        check_fast_tokenizer(p.tokenizer)
    except Exception as e:  # noqa: BLE001
        p.add("FAIL", "tokenizer", "a fast (Rust) tokenizer: the loss mask needs character offsets",
              type(p.tokenizer).__name__, str(e))
        return
    try:
        p.template = resolve_chat_template(p.tokenizer, t)
    except Exception as e:  # noqa: BLE001
        p.add("FAIL", "chat template", "a chat template (the tokenizer's or target.chat_template)", str(e)[:300],
              "set target.chat_template to a Jinja template file", error=e if isinstance(e, EagletError) else None)
        return
    p.add("ok", "tokenizer", "fast, with a chat template",
          f"{type(p.tokenizer).__name__}, {len(p.tokenizer)} tokens; template from "
          f"{t.chat_template or 'the tokenizer'}; mask by {mask_method(p.template)}")


def check_architecture(p: Probe) -> None:
    if p.hf_config is None or (p.stage == "train" and not streaming(p.cfg)):
        return  # train reads the target's config from the store, except when it streams
    try:
        p.model = build_meta_model(p.hf_config, p.cfg.target.trust_remote_code)
    except Exception as e:  # noqa: BLE001
        p.add("FAIL", "architecture", f"a model class for {type(p.hf_config).__name__}",
              f"{type(e).__name__}: {str(e)[:300]}",
              "a config transformers cannot build a CausalLM (or image-text-to-text) model from is not supported")
        return
    try:
        p.parts = TargetParts.of(p.model)
    except UnsupportedFamily as e:
        p.add("FAIL", "architecture", "a family eaglet has an adapter for: " + "; ".join(supported()),
              e.reason,
              f"adding a family takes one module, {ADD_FAMILY}: one Family entry (where the decoder layers, final "
              "norm, LM head and embedding are; embedding scale and logit softcap) and its tiny test config")
        p.model = None
        return
    pt = p.parts
    kinds = sorted({type(m).__name__ for m in pt.layers[:pt.num_layers]})
    extra = [f"{k} {v:g}" for k, v in (("embed_scale", pt.embed_scale), ("logit_scale", pt.logit_scale)) if v != 1.0]
    extra += [f"logit_softcap {pt.logit_softcap:g}"] if pt.logit_softcap else []
    p.add("ok", "architecture", "decoder layers, final norm, LM head and embedding found",
          f"{pt.family.name} adapter: {type(p.model).__name__}: {type(pt.decoder).__name__} with {pt.num_layers} x "
          f"{'/'.join(kinds)}, norm {type(pt.norm).__name__}, hidden {pt.hidden_size}"
          + (f"; {', '.join(extra)} (reproduced by the draft's embedding and the teacher)" if extra else ""))


def check_layers(p: Probe) -> None:
    if p.parts is None or (p.stage == "train" and not streaming(p.cfg)):
        return
    L = p.parts.num_layers
    try:
        p.layers = extraction_layers(p.cfg, L)
    except ValueError as e:
        p.add("FAIL", "captured layers", f"distinct ids in 0..{L - 1} (the state entering that decoder layer)",
              str(e), f"set extract.layers to ids in 0..{L - 1}, or leave it unset for [2, L//2, L-3]")
        return
    p.add("ok", "captured layers", f"distinct ids in 0..{L - 1}", f"{p.layers} of L={L}"
          + (" (EAGLE-3 default)" if p.cfg.extract.layers is None else ""))


def check_draft_type(p: Probe) -> None:
    """The trained draft type's own word on the config (its optional `config_problems`): settings
    it cannot honour, such as a chain longer than a DFlash block, FAIL before any weight loads."""
    kind = draft_type(p.cfg.train.algorithm)
    problems = getattr(kind, "config_problems", lambda cfg: [])(p.cfg)
    attention = p.cfg.train.draft_attention
    if attention not in getattr(kind, "ATTENTIONS", ("dense",)):
        problems = [*problems, (f"train.draft_attention {attention}: {kind.TITLE}'s draft has dense attention only",
                                "set train.draft_attention: dense, or train.algorithm: eagle3")]
    for what, fix in problems:
        p.add("FAIL", "draft type", f"settings {kind.TITLE} honours", what, fix,
              error=ConfigError(f"{what}; {fix}"))
    if not problems:
        p.add("ok", "draft type", f"settings {kind.TITLE} honours", f"train.algorithm {kind.NAME}")


def check_vocab(p: Probe) -> None:
    if p.text_config is None:
        return
    V = getattr(p.text_config, "vocab_size", None)
    if p.parts is not None:
        rows = int(p.parts.lm_head.weight.shape[0])
        emb = int(p.parts.embed_tokens.weight.shape[0])
        if rows != V or emb != V:
            p.add("warn", "vocab sizes", f"LM head and embedding rows = config vocab_size {V}",
                  f"LM head {rows}, embedding {emb}", "the draft's t2d map is sized by config vocab_size")
            V = rows
    if p.tokenizer is not None and V:
        n = len(p.tokenizer)
        if n > V:  # a FAIL once a rendered record holds such an id (check_records)
            p.add("warn", "vocab sizes", f"tokenizer ids < model vocabulary {V}", f"tokenizer has {n} tokens",
                  f"ids {V}..{n - 1} would index past the embedding: use the target's own tokenizer (target.tokenizer)")
        else:
            p.add("ok", "vocab sizes", f"tokenizer ids < model vocabulary {V}",
                  f"tokenizer {n}" + (f" (model vocabulary padded by {V - n})" if n < V else ""))
    size = p.cfg.vocab.size
    if V and size > V:
        p.add("warn", "draft vocab", f"vocab.size <= target vocabulary {V}", f"{size} (will be capped at {V})",
              f"set vocab.size <= {V}")
    elif size < 1:
        p.add("FAIL", "draft vocab", "vocab.size >= 1", str(size), "set vocab.size (default 32000)")
    elif V:
        p.add("ok", "draft vocab", f"vocab.size <= target vocabulary {V}", str(size))


# ---- data: masks and the token count -------------------------------------------------------------

def check_records(p: Probe) -> None:
    """The first records of each file through prepare's own per-record path."""
    from collections import Counter

    pc = p.cfg.prepare
    if not pc.data:
        p.add("FAIL", "data", "prepare.data lists input files", "none", "set prepare.data")
        return
    if p.tokenizer is None or p.template is None:
        return
    settings = Settings.of(pc, p.template)
    for f in pc.data:
        try:
            path = check_data_file(f)
        except Exception as e:  # noqa: BLE001
            p.add("FAIL", f"data {f}", "a readable .jsonl/.json/.parquet file", str(e), "fix prepare.data",
                  error=e if isinstance(e, EagletError) else None)
            continue
        reasons: Counter = Counter()
        read = ok = tokens = loss = nbytes = max_id = 0
        current, example = None, ""  # the row being processed; the first skipped one, named in the finding
        try:
            for row, item in iter_records(path, DOCTOR_RECORDS):
                read += 1
                current = row
                if isinstance(item, dict):
                    nbytes += len(json.dumps(item, ensure_ascii=False).encode()) + 1
                out = process_record(row, item, p.tokenizer, settings)
                current = None
                if out.reason:
                    reasons[out.reason] += 1
                    example = example or f"; e.g. {row_label(path.name, row)}: {out.reason}: {out.detail[:200]}"
                    continue
                ok += 1
                max_id = max(max_id, int(out.input_ids.max()))
                tokens += len(out.input_ids)
                loss += int(out.loss_mask.sum())
        except Exception as e:  # noqa: BLE001 - a file or a tokenizer that fails outright
            at = f" at {row_label(path.name, current)}" if current is not None else ""
            p.add("FAIL", f"data {path.name}", "records that read and render", f"{type(e).__name__}{at}: {e}",
                  "check the file; if it is fine, the tokenizer or template API (see the API lines)")
            continue
        p.sampled.append({"path": str(path), "read": read, "ok": ok, "tokens": tokens, "bytes": nbytes})
        V = getattr(p.text_config, "vocab_size", None)
        if V and max_id >= V:
            p.add("FAIL", f"token ids {path.name}", f"ids < model vocabulary {V}",
                  f"id {max_id} in the first {read} records",
                  "the tokenizer does not match the model: use the target's own tokenizer (target.tokenizer)")
        skipped = ", ".join(f"{k}={v}" for k, v in sorted(reasons.items()))
        if ok == 0:
            template_reasons = {"no_assistant_tokens", "mask_mismatch", "template_error", "chat_error"}
            by_template = bool(template_reasons & set(reasons))
            fix = ("the chat template yields no assistant tokens for these records: check target.chat_template "
                   "renders assistant turns, as prefixes of the whole conversation"
                   if by_template else
                   "check prepare.format and the record layout (ShareGPT conversations or OpenAI messages)")
            # A template (or the library rendering it) that fails every record stops prepare before
            # it renders the whole file; records that are bad as data are prepare's to count and
            # report over the whole file (it refuses a file without one usable record).
            status = "FAIL" if by_template or p.stage != "prepare" else "warn"
            p.add(status, f"loss mask {path.name}", f"assistant tokens in the first {read} records",
                  f"none: every record skipped ({skipped or 'no records'}){example}", fix)
        elif reasons:
            # Most of the sample skipped is worth a look before prepare runs; a few (a ShareGPT record
            # whose assistant turn starts past prepare.max_length) prepare skips and counts itself.
            most = 2 * (read - ok) > read
            p.add("warn" if most else "info", f"loss mask {path.name}",
                  f"assistant tokens in {'most' if most else 'all'} of the first {read} records",
                  f"{ok} with {loss} of {tokens} tokens masked; skipped {skipped}{example}"
                  + ("" if most else " (prepare skips such records and lists each in its skipped.jsonl)"),
                  "check the reasons: prepare would skip most records, listing each in its skipped.jsonl")
        else:
            p.add("ok", f"loss mask {path.name}", f"assistant tokens in the first {read} records",
                  f"{loss} of {tokens} tokens are assistant tokens")


def _estimate_tokens(p: Probe) -> tuple[int | None, str]:
    """Tokens extract will store: prepare's manifest when it exists, else an estimate
    from the sampled records scaled by the file sizes."""
    m = p.cfg.run_dir / "prepare" / "manifest.json"
    if m.is_file():
        try:
            return int(json.loads(m.read_text())["stats"]["tokens"]), "counted by prepare"
        except (KeyError, ValueError, TypeError):
            pass
    if not p.sampled:
        return None, ""
    total = 0.0
    for s in p.sampled:
        if s["read"] == 0:
            continue
        path = Path(s["path"])
        if path.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            records = pq.ParquetFile(path).metadata.num_rows
        else:
            records = path.stat().st_size / max(s["bytes"] / s["read"], 1)
        if p.cfg.prepare.max_records is not None:
            records = min(records, p.cfg.prepare.max_records)
        total += records * s["tokens"] / s["read"]
    return int(total), f"estimated from {sum(s['read'] for s in p.sampled)} sampled records and the file sizes"


def _head_bytes(p: Probe, H: int) -> tuple[int, int]:
    """(head.safetensors, target_config.json) as extract writes them (formats.store.write_target_head):
    embed_tokens [V, H], lm_head [V, H] (two copies also for a tied target) and norm [H] in the
    target's dtype; the text config as JSON."""
    V = getattr(p.text_config, "vocab_size", None) or 0
    rows = (int(p.parts.embed_tokens.weight.shape[0]) + int(p.parts.lm_head.weight.shape[0]) if p.parts is not None
            else 2 * V)
    config = len(json.dumps(p.text_config.to_dict(), indent=1, default=str)) if p.text_config is not None else 0
    return (rows * H + H) * target_dtype_bytes(p), config


def _existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (where a folder eaglet will make lands)."""
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def _store_need(p: Probe) -> tuple[int, str] | None:
    """(bytes extract still has to write into run.dir/extract, what they are): the states
    (none in online mode) and the target head, less what is there already; None without a
    hidden size and a token count."""
    H, n_aux = hidden_and_aux(p)
    tokens, source = _estimate_tokens(p)
    if H is None or tokens is None:
        return None
    store_bytes = DTYPE_BYTES[p.cfg.extract.store_dtype]
    fp8 = p.cfg.extract.store_dtype == "float8_e4m3fn"  # one float32 scale per token and state besides
    per_token = (n_aux + 1) * (H * store_bytes + (4 if fp8 else 0)) + 4 + 1  # states + int32 id + uint8 mask
    states = tokens * per_token
    head, config = _head_bytes(p, H)
    online = p.cfg.extract.mode == "online"  # the head only: training runs the target for the states
    store = p.cfg.run_dir / "extract"
    have = sum(f.stat().st_size for f in store.glob("shard-*.safetensors")) if store.is_dir() and not online else 0
    have_head = sum(f.stat().st_size for f in (store / HEAD_FILE, store / TARGET_CONFIG) if f.is_file())
    need = (0 if online else max(states - have, 0)) + max(head + config - have_head, 0)
    head_part = (f"{HEAD_FILE} ~{gib(head)} (embedding and LM head, {target_dtype_bytes(p)} B a value) + "
                 f"{TARGET_CONFIG} {config / 1024:.1f} KiB")
    states_part = (f"{tokens:,} tokens x {per_token:,} B: {n_aux}+1 states x {H} x {p.cfg.extract.store_dtype}"
                   + (" + a float32 scale each" if fp8 else "") + f"; tokens {source}")
    what = (f"~{gib(need)} to write: "
            + (f"{head_part}; online mode stores no states (an offline store would add ~{gib(states)}: {states_part})"
               if online else f"states ~{gib(states)} ({states_part}) + {head_part}")
            + (f"; {gib(have + have_head)} already stored" if have + have_head else ""))
    return need, what


def check_disk(p: Probe) -> None:
    found = _store_need(p)
    if found is None:
        p.add("info", "disk", "a token count to size the store", "none (no prepare manifest and no sampled records)")
        return
    need, what = found
    where = _existing(p.cfg.run_dir)
    free = shutil.disk_usage(where).free
    fix = ("free space or set run.dir on a larger disk; or extract.mode: online (no store, for a target that fits "
           "beside the draft); or fewer tokens (prepare.max_records, prepare.max_length) or a smaller store (extract.store_dtype: bfloat16, or float8_e4m3fn: half of it)")
    status = "FAIL" if need > free else "warn" if need > 0.8 * free else "ok"
    p.add(status, "disk", "the hidden-state store and the target head fit on run.dir's disk",
          f"{what}; {gib(free)} free on {where}", fix)


def check_train_disk(p: Probe) -> None:
    """Training's checkpoints and final draft against the free space of run.dir/train's disk,
    with what is still to be written on that disk before them: the store (before extract), the
    stream buffer (an engine-fed run)."""
    if p.stage is None and p.parts is None:
        return  # the doctor could not resolve the architecture (already a FAIL)
    d = train_disk(p)
    if d is None:
        p.add("info", "disk (train)", "the target's config", "none yet (run extract first)")
        return
    t, e = p.cfg.train, p.cfg.extract
    where = _existing(p.cfg.run_dir / "train")
    device = os.stat(where).st_dev
    before, parts = 0, []
    store = _store_need(p)
    if store is not None and store[0] > 0 and os.stat(_existing(p.cfg.run_dir / "extract")).st_dev == device:
        before += store[0]
        parts.append(f"the store and target head extract writes first ~{gib(store[0])}")
    if streaming(p.cfg) and os.stat(_existing(buffer_folder(e.stream_dir, p.cfg.run_dir / "train"))).st_dev == device:
        before += int(float(e.stream_buffer_gb) * 1e9)
        parts.append(f"the stream buffer <= {e.stream_buffer_gb:g} GB (extract.stream_buffer_gb)")
    need, free = d["peak"] + before, shutil.disk_usage(where).free
    saves = (f"{d['saves']} written, train.max_steps {t.max_steps} / train.ckpt_every {t.ckpt_every}"
             if d["saves"] is not None else f"one every train.ckpt_every {t.ckpt_every} steps")
    kept = (f"train.keep_last {t.keep_last}: all kept" if d["saves"] is not None and d["saves"] <= t.keep_last
            else f"train.keep_last {t.keep_last} kept and one more while the next is written")
    found = (f"~{gib(need)} at most at once: checkpoints of ~{gib(d['ckpt'])} each ({d['trainable'] / 1e6:.1f}M "
             f"trainable params in {d['dtypes']} and AdamW's two moments; {saves}; {kept}) and the final draft "
             f"~{gib(d['final'])} ({d['params'] / 1e6:.1f}M params in {d['dtypes']}), together ~{gib(d['peak'])}"
             + (f" beyond the {gib(sum(d['have']))} of checkpoints there" if d["have"] else "")
             + "".join(f"; + {x}" for x in parts) + f"; {gib(free)} free on {where} (run.dir {p.cfg.run_dir})")
    fewer = []
    if t.keep_last > 1:
        one_kept = peak_writes(d["have"], d["ckpt"], d["final"], d["saves"], 1) + before
        fewer.append(f"train.keep_last 1: ~{gib(one_kept)}")
    if d["saves"] is None or d["saves"] > 1:
        one_saved = peak_writes(d["have"], d["ckpt"], d["final"], 1, t.keep_last) + before
        fewer.append(f"train.ckpt_every {f'>= {t.max_steps}' if t.max_steps else 'above the steps the run takes'}, "
                     f"one checkpoint at the end: ~{gib(one_saved)}")
    fix = (f"write or keep fewer checkpoints ({'; '.join(fewer)}), or " if fewer else "") + \
        "free space or set run.dir on a larger disk"
    status = "FAIL" if need > free else "warn" if need > 0.8 * free else "ok"
    p.add(status, "disk (train)", "the checkpoints and the final draft fit on run.dir/train's disk", found, fix)


# ---- memory (GPU, or the host's when a stage runs on the CPU) --------------------------------------

def _devices(device: str, device_map: str | None) -> list[Any]:
    import torch

    if not torch.cuda.is_available():
        return []
    if device_map is not None:
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    d = resolve_device(device)
    return [torch.device("cuda", d.index or 0)] if d.type == "cuda" else []


def _free_on(devices: list[Any]) -> int:
    import torch

    return sum(torch.cuda.mem_get_info(d)[0] for d in devices)


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def host_free_bytes() -> int | None:
    """Host memory a new process can still take: /proc/meminfo's MemAvailable (free memory plus
    the page cache the kernel can drop), capped by the cgroup's limit less its use where the
    process runs in a container; else the free pages; None where none of these can be read."""
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if free is None:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    for limit, used in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2, v1
                        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        cap, use = _read_int(limit), _read_int(used)
        if cap is not None and use is not None and cap < 2**60:  # v1 writes "no limit" as a huge number
            free = max(cap - use, 0) if free is None else min(free, max(cap - use, 0))
            break
    return free


def _memory_status(need: int, free: int) -> str:
    """FAIL when the plan does not fit, warn within 10% of the free memory (the estimates are rough)."""
    return "FAIL" if need > free else "warn" if need > 0.9 * free else "ok"


def _memory_finding(p: Probe, what: str, need: int, breakdown: str, devices: list[Any], fix: str,
                    host_fix: str | None = None) -> None:
    """A GPU's free memory against `need` on `devices`; without a GPU, the host's (`host_free_bytes`),
    where the stage then runs. host_fix: the fix on the CPU, where it differs from `fix`."""
    if not devices:
        free = host_free_bytes()
        expected = f"~{gib(need)} of host memory ({breakdown}): no GPU, {what} runs on the CPU"
        if free is None:
            p.add("info", f"memory ({what})", expected, "this system's available memory could not be read")
            return
        fix = host_fix or fix
        if p.cfg.run.preset != "cpu":  # the sizes the demo runs with on a CPU (eaglet/config.py PRESETS)
            fix += "; or run with --preset cpu (sizes for a CPU; the keys the file sets still win: docs/config.md)"
        p.add(_memory_status(need, free), f"memory ({what})", expected, f"{gib(free)} available", fix)
        return
    free = _free_on(devices)
    names = ", ".join(str(d) for d in devices)
    p.add(_memory_status(need, free), f"GPU memory ({what})", f"~{gib(need)} ({breakdown})",
          f"{gib(free)} free on {names}", fix)


def check_extract_memory(p: Probe) -> None:
    """The target's memory in extract where it runs in eaglet's processes (an engine that sizes
    its own says so in its `doctor`)."""
    if not engine(p.cfg.extract.backend).TARGET_IN_PROCESS:
        return
    if p.model is None or p.parts is None:
        return
    e, text_cfg = p.cfg.extract, p.text_config
    b = target_dtype_bytes(p)
    weights = weight_bytes(p, b)
    H, n_aux = hidden_and_aux(p)
    inter = max(getattr(text_cfg, "intermediate_size", 0) or 0,
                (getattr(text_cfg, "moe_intermediate_size", 0) or 0) * (getattr(text_cfg, "num_experts_per_tok", 0) or 0))
    acts = e.batch_tokens * ((10 * H + 3 * inter) * b + (n_aux + 1) * H * DTYPE_BYTES[e.store_dtype])
    V = int(p.parts.lm_head.weight.shape[0])
    check = REF_MAX_TOKENS * (V * 4 + (p.parts.num_layers + 1) * H * b) if e.selfcheck_samples > 0 else 0
    need = weights + acts + check
    lower = f"lower extract.batch_tokens (now {e.batch_tokens})"
    _memory_finding(p, "extract", need,
                    f"weights {gib(weights)} + activations {gib(acts)} for extract.batch_tokens={e.batch_tokens} "
                    f"+ self-check {gib(check)}; rough",
                    _devices(p.cfg.target.device, p.cfg.target.device_map),
                    f"spread the target with target.device_map: auto, or {lower}",
                    f"{lower}" + (f"; the weights alone take {gib(weights)}: a machine with more memory, or a GPU"
                                  if weights > 0.5 * need else "")
                    + (", or extract.selfcheck_samples 0" if check > 0.25 * need else ""))


def check_train_memory(p: Probe) -> None:
    import torch

    if p.stage is None and p.parts is None:
        return  # the doctor could not resolve the architecture (already a FAIL)
    found = draft_need(p, target_beside=p.cfg.extract.mode == "online" and not streaming(p.cfg))
    if found is None:
        p.add("info", "memory (train)", "the target's config", "none yet (run extract first)")
        return
    need, breakdown, _, _ = found
    t = p.cfg.train
    dev = resolve_device(t.device) if t.device != "auto" else None
    devices = [] if not torch.cuda.is_available() or (dev is not None and dev.type != "cuda") else \
        [torch.device("cuda", (dev.index or 0) if dev is not None else 0)]
    if streaming(p.cfg) and devices:  # the engine's share of the GPU is its own: its doctor compares the rest
        return
    _memory_finding(p, "train", need, breakdown, devices,
                    f"lower train.max_tokens (now {t.max_tokens}) or train.ttt_steps (now {t.ttt_steps})")


# ---- running the checks -------------------------------------------------------------------------------

def check_engines(p: Probe) -> None:
    """Every engine's own checks (eaglet/engines/<name>/__init__.py `doctor`): each decides
    whether this config uses it (extract.backend, eval.vllm)."""
    for e in ENGINES.values():
        e.doctor(p)


# (check, stages whose preflight runs it); the doctor runs every check, in this order. Each
# stage that loads a model or renders templates checks what it reads and its own contracts:
# prepare the tokenizer, its template and the first records; eval and regenerate the target as
# they load it (eval its skeleton's classes too, for the KV-cache and hook contracts).
_TARGET = ("prepare", "extract", "eval", "regenerate")
CHECKS: list[tuple[Callable[[Probe], None], tuple[str, ...]]] = [
    (check_versions, ("prepare", "extract", "train", "eval", "regenerate")),
    (check_paths, ()),
    (check_export_verifier, ()),
    (check_target_config, (*_TARGET, "train")),
    (check_tokenizer, _TARGET),
    (check_architecture, ("extract", "eval", "train")),
    (check_layers, ("extract", "eval", "train")),
    (check_draft_type, ("train", "eval")),
    (check_vocab, ("extract",)),
    (check_records, ("prepare",)),
    (check_engines, ("extract", "train", "eval")),
    (check_api_contracts, ("prepare", "extract", "train", "eval", "regenerate")),
    (check_disk, ("extract",)),
    (check_train_disk, ("train",)),
    (check_extract_memory, ("extract",)),
    (check_train_memory, ("train",)),
]


def diagnose(cfg: Config, stage: str | None = None) -> Probe:
    """Run the checks of `stage` (None: all of them); a check that crashes is itself a FAIL."""
    p = Probe(cfg, stage)
    for check, stages in CHECKS:
        if stage is not None and stage not in stages:
            continue
        try:
            check(p)
        except Exception as e:  # noqa: BLE001 - the doctor reports, it does not crash
            p.add("FAIL", check.__name__.removeprefix("check_"), "the check to run",
                  f"it raised {type(e).__name__}: {str(e)[:300]}", "report this as an eaglet bug")
    return p


def preflight(cfg: Config, stage: str) -> list[Finding]:
    """The cheap checks before `stage` loads weights; raises PreflightError on any FAIL, or, when
    every FAIL is the user's own input (a folder not found), the first of those errors as the
    stage itself would raise it (its message and exit code)."""
    t0 = time.time()
    findings = diagnose(cfg, stage).findings
    bad = [f for f in findings if f.status in ("warn", "FAIL")]
    for f in bad:
        log(f"[{stage}] preflight {f.line()}")
    fails = [f for f in findings if f.status == "FAIL"]
    log(f"[{stage}] preflight: {len(findings)} checks in {time.time() - t0:.1f}s, {len(fails)} failed")
    if fails and all(f.error is not None for f in fails):
        raise fails[0].error  # type: ignore[misc]
    if fails:
        raise PreflightError(
            f"preflight of `{stage}` failed ({len(fails)} of {len(findings)} checks):\n"
            + "\n".join(f.line() for f in fails)
            + "\n(run `eaglet doctor CONFIG` for every check; --skip-preflight runs the stage anyway)"
        )
    return findings


def run_doctor(cfg: Config, out: Callable[[str], None] = print,
               more: Callable[[Probe, Report], None] | None = None) -> int:
    """`eaglet doctor`: print one line per finding; 1 when any FAILed, else 0. `more`: further
    checks run after these, on what they learnt, reporting through the same lines (the shadow
    run: eaglet/shadow.py `shadow_findings`)."""
    t0 = time.time()
    p = diagnose(cfg)
    for f in p.findings:
        out(f.line())
    out(f"doctor: {len(p.findings)} checks in {time.time() - t0:.1f}s")
    if more is not None:
        def report(status: str, check: str, expected: str, found: str, fix: str) -> None:
            p.add(status, check, expected, found, fix)
            out(p.findings[-1].line())

        more(p, report)
    counts = {s: sum(f.status == s for f in p.findings) for s in ("ok", "info", "warn", "FAIL")}
    out(f"doctor: {', '.join(f'{v} {k}' for k, v in counts.items())} in {time.time() - t0:.1f}s")
    return 1 if counts["FAIL"] else 0
