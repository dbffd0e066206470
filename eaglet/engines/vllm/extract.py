"""`extract.backend: vllm`: the target runs in vLLM, the engine that serves the largest targets.

    eaglet extract CONFIG          # with extract.backend: vllm, run from the venv that has vLLM
                                   # (bash scripts/vllm_venv.sh), or with extract.vllm_server set

vLLM computes the states through its own hidden-state path (its `extract_hidden_states`
method and hidden-states connector: eaglet/engines/vllm/capture.py), in process or in a server.

eaglet asks for its captured layer ids plus L (= num_hidden_layers). vLLM's id i is the state
entering decoder layer i (hidden_states + residual: the HF output_hidden_states[i]
convention eaglet's HF backend stores), so the aux states are the same tensors. Id L is the
state after the last layer *before* the final norm: the store records
`final_state: pre_norm` and training applies the final norm before the LM head
(formats.store.read_target_head, draft.loss.teacher_targets). vLLM returns the states in
increasing layer order.

Each prompt runs once with max_tokens=1. The token ids vLLM stored must equal the ids prepare
produced; a sample whose ids differ is dropped ("token_mismatch"), never stored. So is one
with a token whose states are all zeros ("zero_states"): vLLM skips the extraction step for a
whole batch whose longest sequence + 1 exceeds max_model_len, leaving those cache slots
unwritten; eaglet sizes max_model_len to the longest sample + 1 and drops samples that do
not fit a max_model_len the user gives. States go into eaglet's own store (shards, index,
checksums, resume) exactly as the HF engine writes it.

Self-check at scale: the `extract.selfcheck_samples` samples run first, with vLLM's prompt
logprobs. The target's LM head applied to their stored final state (through training's own
teacher, final norm included) must pick vLLM's top token on at least
`extract.selfcheck_min_top1` of their tokens (a near tie within TIE_NATS counts as agreeing),
or the run stops before the rest is extracted.

The target's head (embedding, LM head, final norm) is read from its checkpoint files by
name, without loading the model (eaglet/targets/head.py): a 1T-parameter target needs only
these few GB here. The doctor checks every vLLM API eaglet uses (eaglet/engines/vllm/contracts.py,
stage "extract-vllm").
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from ...checks.selfcheck import TIE_NATS, SelfCheckError, logprob_agreement, pick_samples
from ...config import Config
from ...distributed import run_on_main
from .capture import (LocalEngine, Result, ServerEngine, TokenMismatch, engine_args, installed_vllm_version,
                            to_sample, vllm_layer_ids)
from ...formats.prepared import PreparedData
from ...formats.store import (PRE_NORM, StoreCheck, StoreWriter, capture_dtype, resume_folder, store_meta, write_index,
                             write_target_head)
from ...targets.families import extraction_layers
from ...targets.head import CheckpointHead, read_checkpoint_head
from ...utils import DTYPES, log
from ...context import StageContext

PROMPT_LOGPROBS = 5  # top tokens vLLM returns per prompt position in the self-check


# ---- the stage ------------------------------------------------------------------------------

def run_extract_vllm(cfg: Config, ctx: StageContext, engine: Any = None) -> dict[str, Any]:
    """Stage `extract` with backend vllm. `engine` (tests): anything with run/read/discard/close."""
    ecfg = cfg.extract
    if ecfg.mode == "online":  # the states come from the stream in training: none are stored here
        return run_on_main(_stream_store, cfg, ctx)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("extract.backend vllm runs in one process: vLLM spreads the target over GPUs itself "
                         "(extract.vllm_engine_args: tensor_parallel_size, enable_expert_parallel, ...); no torchrun")
    t0 = time.time()
    data = PreparedData(ctx.upstream["prepare"])
    head, layers, ids, meta, found, writer = _open_store(cfg, ctx)
    L, H = head.num_layers, head.hidden_size
    dtype = capture_dtype(DTYPES[ecfg.store_dtype])  # fp8: bfloat16 states, which the store writer quantizes
    storage = Path(ecfg.vllm_storage or ctx.out_dir / "vllm-states")
    storage.mkdir(parents=True, exist_ok=True)
    if not ecfg.vllm_storage:  # eaglet's own folder: files a killed run left are not needed
        for f in [*storage.glob("*.safetensors"), *storage.glob("*.safetensors.lock")]:
            f.unlink()
    done = writer.done_ids()
    lengths = data.lengths
    limit = int(ecfg.vllm_engine_args.get("max_model_len") or 2**62)  # vLLM refuses longer prompts (and their batch)
    usable = [i for i in range(len(data)) if 0 < lengths[i] < limit]
    for i in range(len(data)):
        if not 0 < lengths[i] < limit and int(data.sample_ids[i]) not in done:
            writer.drop(int(data.sample_ids[i]), "empty" if lengths[i] == 0 else "longer_than_max_model_len")
    max_len = int(max((lengths[i] for i in usable), default=1))
    picked = set(pick_samples(data.sample_ids[usable], ecfg.selfcheck_samples, cfg.run.seed))
    first = [i for i in usable if int(data.sample_ids[i]) in picked]
    # The rounds of an uninterrupted run; a resumed one sends each round that holds a sample
    # not stored whole again (its stored rows are discarded), so vLLM schedules the same requests.
    others = [i for i in usable if int(data.sample_ids[i]) not in picked]
    step = max(1, ecfg.vllm_requests)
    rounds = [r for r in (others[a:a + step] for a in range(0, len(others), step))
              if any(int(data.sample_ids[i]) not in done for i in r)]
    rest = [i for r in rounds for i in r]
    if not rest and all(int(data.sample_ids[i]) in done for i in first):
        first = []  # everything is stored: vLLM is not started (the check ran when these were extracted)
    log(f"[extract] vLLM backend: target {head.architecture} L={L} H={H}; vLLM layer ids {ids} (the last: the state "
        f"before the final norm); {len(rest) + len(first)} samples to run, {len(done)} already stored")
    stats = {"samples": 0, "tokens": 0, "dropped": 0}
    check: dict[str, Any] = {"samples": []}
    try:
        if engine is None and (first or rest):
            args = engine_args(cfg, ids, storage, max_len)
            engine = (ServerEngine(ecfg.vllm_server, ecfg.vllm_requests, api_key_env=ecfg.vllm_server_api_key_env)
                      if ecfg.vllm_server else LocalEngine(args))
        bar = tqdm(total=int(sum(lengths[i] for i in rest + first)), unit="tok", unit_scale=True, desc="extract",
                   dynamic_ncols=True)
        if first:
            check = _selfcheck_round(engine, data, first, done, head, ids, dtype, writer, ecfg, stats, bar)
        for rows in rounds:
            _round(engine, data, rows, done, ids, H, dtype, writer, stats, bar)
        bar.close()
        records = writer.close(index=False)
    except BaseException:
        writer.abort()
        raise
    finally:
        if engine is not None:
            engine.close()
    index = write_index(ctx.out_dir, meta, records, writer.dropped_samples, ecfg.fsync)
    seconds = time.time() - t0
    return {
        "samples": index["num_samples"], "tokens": index["num_tokens"], "resumed_samples": len(done),
        "new_tokens": stats["tokens"], **found.stats(), "dropped": index["dropped_counts"], "shards": index["num_shards"],
        "bytes": index["bytes"], "seconds": round(seconds, 3),
        "tokens_per_s": round(stats["tokens"] / seconds, 1) if seconds > 0 else None, "layers": layers,
        "hidden_size": H, "world_size": 1, "parallel": "vllm", "backend": "vllm", "vllm_layer_ids": ids,
        "vllm_version": getattr(engine, "version", None) or installed_vllm_version(), "selfcheck": check,
    }


def _open_store(cfg: Config, ctx: StageContext) -> tuple[CheckpointHead, list[int], list[int], dict[str, Any],
                                                         StoreCheck, StoreWriter]:
    """The store of a vLLM extraction begun: (the target's head read from its checkpoint files,
    eaglet's layers, vLLM's layer ids, the store's meta, what was found in the folder, the
    writer); the head and the target's config written beside it. Bad shards found are deleted,
    so that their samples are redone."""
    ecfg = cfg.extract
    head = read_checkpoint_head(cfg.target)
    layers = extraction_layers(cfg, head.num_layers)
    ids = vllm_layer_ids(layers, head.num_layers)
    meta = store_meta(ctx.input_hash, head.hidden_size, layers, ecfg.store_dtype, PRE_NORM, head.num_layers,
                      head.architecture, head.norm_eps, ecfg.mode, backend="vllm", vllm_layer_ids=ids)
    found = resume_folder(ctx.out_dir, meta, ecfg.fsync)
    writer = StoreWriter(ctx.out_dir, meta, shard_bytes=int(float(ecfg.shard_mb) * 2**20),
                         queue_size=ecfg.writer_queue, fsync=ecfg.fsync, threads=ecfg.writer_threads, prepare=False)
    write_target_head(ctx.out_dir, head.tensors["embed_tokens"], head.tensors["lm_head"], head.tensors["norm"],
                      head.text_config)
    return head, layers, ids, meta, found, writer


def _stream_store(cfg: Config, ctx: StageContext) -> dict[str, Any]:
    """extract.mode online: a store without states that describes them (layers, vLLM's layer
    ids, dtype, the pre-norm final state) beside the target's head and config; training's
    stream (eaglet/engines/vllm/stream.py) asks the engine for each micro-batch's states and runs
    the self-check on its first samples. No engine starts here."""
    head, layers, ids, meta, _, writer = _open_store(cfg, ctx)
    index = write_index(ctx.out_dir, meta, writer.close(index=False), [], cfg.extract.fsync)
    log(f"[extract] online through vLLM: target {head.architecture} L={head.num_layers} H={head.hidden_size}, vLLM "
        f"layer ids {ids}; no states stored: training streams them from the engine")
    return {"samples": index["num_samples"], "tokens": 0, "mode": "online", "backend": "vllm", "layers": layers,
            "hidden_size": head.hidden_size, "vllm_layer_ids": ids,
            "selfcheck": "on the stream's first samples, in train"}


def convert_result(engine: Any, res: Result, expected: np.ndarray, ids: list[int], H: int, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor] | str:
    """A request's (aux, final) for the token ids `expected`, or the reason its sample is
    dropped. The connector file is removed."""
    try:
        aux, final = to_sample(engine.read(res.path), expected, ids, H, dtype)
    except TokenMismatch as e:
        log(f"[extract] sample {res.sample_id} dropped: {e}")
        return "token_mismatch"
    finally:
        engine.discard(res.path)
    # One pass per tensor for both checks: a token's largest |state| is NaN or inf when any of its
    # states is (amax propagates NaN), and 0 when all are.
    peak_aux, peak_final = aux.abs().amax(-1), final.abs().amax(-1)
    if not (torch.isfinite(peak_aux).all() and torch.isfinite(peak_final).all()):
        return "nonfinite"
    if bool(((peak_aux == 0) & (peak_final == 0)).any()):
        # vLLM skips the extract "drafter" for a whole batch whose longest sequence does not fit
        # max_model_len: those tokens' cache slots are never written (zeros in a fresh cache).
        return "zero_states"
    return aux, final


def _round(engine: Any, data: PreparedData, rows: list[int], done: set[int], ids: list[int], H: int,
           dtype: torch.dtype, writer: StoreWriter, stats: dict[str, int], bar: Any) -> None:
    results = engine.run([(int(data.sample_ids[i]), data[i].input_ids) for i in rows], None)
    mismatched = 0
    for i, res in zip(rows, results):
        got = convert_result(engine, res, data[i].input_ids, ids, H, dtype)
        if res.sample_id in done:  # stored by an earlier run: sent again only with its round
            bar.update(int(data.lengths[i]))
            continue
        if isinstance(got, str):
            writer.drop(res.sample_id, got)
            stats["dropped"] += 1
            mismatched += got == "token_mismatch"
        else:
            s = data[i]
            writer.add(s.sample_id, got[0], got[1], s.input_ids, s.loss_mask)
            stats["samples"] += 1
            stats["tokens"] += len(s.input_ids)
        bar.update(int(data.lengths[i]))
    if mismatched > max(2, len(rows) // 2):
        raise RuntimeError(f"{mismatched} of {len(rows)} samples came back from vLLM with other token ids than prepare "
                           "produced: vLLM serves another model or tokenizer than target.path, or adds tokens to the "
                           "prompts; nothing of theirs was stored")


def _selfcheck_round(engine: Any, data: PreparedData, rows: list[int], done: set[int], head: CheckpointHead,
                     ids: list[int], dtype: torch.dtype, writer: StoreWriter, ecfg: Any, stats: dict[str, int],
                     bar: Any) -> dict[str, Any]:
    """Run the self-check samples with prompt logprobs; stop the run on a disagreement, else
    store those not stored yet."""
    results = engine.run([(int(data.sample_ids[i]), data[i].input_ids) for i in rows], PROMPT_LOGPROBS)
    checked, keep = [], []
    for i, res in zip(rows, results):
        got = convert_result(engine, res, data[i].input_ids, ids, head.hidden_size, dtype)
        if isinstance(got, str):
            if res.sample_id not in done:
                writer.drop(res.sample_id, got)
                stats["dropped"] += 1
            continue
        checked.append((got[1], res.prompt_logprobs))
        if res.sample_id not in done:
            keep.append((i, got))
    result = judge_selfcheck(checked, sorted(int(data.sample_ids[i]) for i in rows), head.tensors, head.norm_eps,
                             ids, ecfg.selfcheck_min_top1)
    for i, (aux, final) in keep:
        s = data[i]
        writer.add(s.sample_id, aux, final, s.input_ids, s.loss_mask)
        stats["samples"] += 1
        stats["tokens"] += len(s.input_ids)
    bar.update(int(sum(data.lengths[i] for i in rows)))
    return result


def judge_selfcheck(checked: list[tuple[torch.Tensor, Any]], samples: list[int], head: dict[str, torch.Tensor],
                    norm_eps: float, ids: list[int], min_top1: float) -> dict[str, Any]:
    """The self-check's verdict on (final state [T, H], vLLM's prompt logprobs) pairs: the
    target's LM head (final norm applied: the state of vLLM's id L is pre-norm) must pick
    vLLM's own top token on at least `min_top1` of their tokens, a near tie within TIE_NATS
    counting as agreeing; a SelfCheckError otherwise. `samples`: their ids, for the message."""
    totals = {"tokens": 0, "agree": 0, "exact": 0}
    for final, logprobs in checked:
        m = logprob_agreement(final, logprobs, head, True, norm_eps)
        for k in totals:
            totals[k] += m[k]
    top1 = totals["agree"] / max(totals["tokens"], 1)
    result = {"samples": samples, "tokens": totals["tokens"], "top1_agreement": top1,
              "exact_top1": totals["exact"] / max(totals["tokens"], 1), "min_top1": min_top1, "tie_nats": TIE_NATS,
              "reference": "vLLM prompt logprobs"}
    if totals["tokens"] and top1 < min_top1:
        raise SelfCheckError(
            f"extract self-check failed: the target's LM head applied to the stored final state (final norm applied: "
            f"the state vLLM returns for layer id {ids[-1]} is pre-norm) picks vLLM's own top token (prompt logprobs) "
            f"on {top1:.2%} of {totals['tokens']} tokens of samples {samples} < extract.selfcheck_min_top1 "
            f"{min_top1:.2%}. Nothing more is extracted. Likely causes: a server started with other "
            f"layer ids than {ids}, a vLLM model class that does not return the state after its last layer for id "
            f"{ids[-1]}, a checkpoint whose LM head or final norm differs from what vLLM serves.")
    log(f"[extract] self-check ok on {len(samples)} samples: LM head(stored final) matches vLLM's top token on "
        f"{top1:.2%} of {totals['tokens']} tokens ({result['exact_top1']:.2%} exactly)")
    return result
