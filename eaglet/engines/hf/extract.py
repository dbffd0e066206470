"""The HF engine's capture for the store: the target in eaglet's own process(es), hooks on its
decoder layers, the states of the prepared samples written to extract's store.

    eaglet extract CONFIG                        # extract.backend: hf (the default)
    torchrun --nproc-per-node 8 -m eaglet.cli extract CONFIG

For every sample the store gets, per token, the states *entering* the decoder layers in
`extract.layers` (default 2, L//2, L-3; the HF `output_hidden_states[i]` convention) and the
final normed state that the LM head reads (the teacher; logits = lm_head(final)).

How, and why this way (the tiny test targets stand in for 8B..1T targets on many GPUs):
- The states are captured by hooks on the decoder layers in one forward of the base model,
  without full-vocabulary logits (eaglet/engines/hf/capture.py says how and why).
- Samples are sorted longest first and packed into right-padded batches under a token
  budget; outputs map back to sample ids by their row in the batch.
- Device-to-host copies go to pinned memory without blocking; a batch's rows are handed to
  the store one step later, while the next forward runs. The store writes shards on a
  background thread, so disk writes overlap the forward too.
- Killing the process at any instant is safe: the store resumes from its finished shards.
  A rerun (or `--force` on a finished store) first checks every finished shard and deletes
  the bad ones (formats.store.resume_folder). The batch plan is always the one over every
  wanted sample; a resumed run recomputes each batch of it that holds a sample not stored and
  stores only those samples, so every sample goes through the batch an uninterrupted run
  gives it and the store is bit for bit that run's.

Under torchrun the ranks split the batches (data parallel), or with `extract.tp_plan: auto`
split the target itself (tensor parallel); see `run_extract_hf`. Reached through the engine
registry (eaglet/engines/__init__.py) from the stage's entry point, eaglet/stages/extract.py;
change this module to change how the HF engine fills the store.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from tqdm import tqdm

from ...checks.selfcheck import pick_samples, run_selfcheck
from ...config import Config
from ...context import StageContext
from ...distributed import all_gather_object, all_reduce_sum, barrier, broadcast_object, init_distributed
from ...formats.prepared import PreparedData
from ...formats.store import (FP8, POST_NORM, StoreReader, StoreWriter, capture_dtype, finished_shards, quantize_states,
                              resume_folder, store_meta, write_index)
from ...targets.families import extraction_layers
from ...targets.load import TargetParts, load_target, norm_eps
from ...utils import DTYPES, log
from .capture import capture, head_meta, nonfinite_rows, pad_batch, save_target_head, to_host


def plan_batches(lengths: Sequence[int], batch_tokens: int, max_batch_size: int) -> list[list[int]]:
    """Positions into `lengths`, grouped into batches: longest first, each batch's
    size x longest length <= batch_tokens and size <= max_batch_size (a sample longer than
    the budget goes alone)."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    batches, i = [], 0
    while i < len(order):
        longest = max(1, int(lengths[order[i]]))
        size = max(1, min(max_batch_size, batch_tokens // longest))
        batches.append(order[i:i + size])
        i += size
    return batches


@dataclass
class _InFlight:
    """A batch whose outputs are on their way to the host."""

    rows: list[int]  # prepared-data positions, one per batch row
    lengths: list[int]
    aux: torch.Tensor  # host [B, T, n_aux*H]
    final: torch.Tensor  # host [B, T, H]
    bad: torch.Tensor  # host bool [B]
    events: list = field(default_factory=list)
    aux_scale: torch.Tensor | None = None  # host [B, T, n_aux] (fp8 stores)
    final_scale: torch.Tensor | None = None  # host [B, T, 1]
    keep: tuple = ()  # device tensors that must live until the copies finish


class WritesNothing:
    """The writer of a tensor-parallel rank other than 0: it computes every batch with the
    others, and rank 0 stores the (identical) states."""

    dropped_samples: list = []

    def add(self, *args: Any) -> None:
        pass

    def drop(self, *args: Any) -> None:
        pass


def run_extract_hf(cfg: Config, ctx: StageContext) -> dict[str, Any]:
    """The extract stage with the HF engine: states for every prepared sample not yet in the store.

    An existing store is checked first: bad shards are deleted, and their samples (and those
    of shards gone missing) are extracted again (`ctx.force` on a finished store comes here
    too: the pipeline skips a finished store only without it).

    Under torchrun, data parallel (the default): every rank loads the whole target, the
    batch plan over every wanted sample is made identically on every rank, and rank r runs
    batches r, r+W, r+2W, ... of those that hold a sample still to do: each sample goes
    through the same batch as in a one-rank or an uninterrupted run, so the stored states
    are the same, bit for bit. Each rank writes its own shards
    (shard-r{rank}-*); after all finish, rank 0 writes one index over all of them. A rerun
    resumes from every finished shard, whatever world size wrote it. With `extract.tp_plan`
    the ranks form one tensor-parallel group instead: all run every batch, rank 0 writes.
    """
    ecfg = cfg.extract
    env = init_distributed(cfg.run.dist_timeout_minutes)
    tensor_parallel = ecfg.tp_plan is not None and env.active
    data_rank, data_world = (0, 1) if tensor_parallel else (env.rank, env.world_size)
    writes = env.is_main or not tensor_parallel
    t0 = time.time()
    data = PreparedData(ctx.upstream["prepare"])
    model, info = load_target(cfg.target, tp_plan=ecfg.tp_plan) if tensor_parallel else load_target(cfg.target)
    parts = TargetParts.of(model)
    layers = extraction_layers(cfg, parts.num_layers)
    dtype = DTYPES[ecfg.store_dtype]
    how = (f"tensor parallel over {env.world_size} ranks" if tensor_parallel
           else f"data parallel over {env.world_size} ranks" if env.active else "")
    log(f"[extract] target {info['class']} L={parts.num_layers} H={parts.hidden_size} on {info['device']}; "
        f"layers {layers}; store {ecfg.store_dtype}" + (f"; {how}" if how else ""))
    meta = store_meta(ctx.input_hash, parts.hidden_size, layers, ecfg.store_dtype, POST_NORM, parts.num_layers,
                      info["class"], norm_eps(parts.norm), ecfg.mode, **head_meta(parts))
    # every rank: the shards' check is shared
    found = resume_folder(ctx.out_dir, meta, ecfg.fsync)
    # extract.writer_threads threads hash and write the shards (both release the GIL, so they
    # overlap): the disk, not one thread's hashing, sets the pace of the writes.
    writer: StoreWriter | WritesNothing = WritesNothing()
    if writes:
        writer = StoreWriter(ctx.out_dir, meta, shard_bytes=int(float(ecfg.shard_mb) * 2**20),
                             queue_size=ecfg.writer_queue, fsync=ecfg.fsync, rank=data_rank,
                             threads=ecfg.writer_threads, prepare=False)
    done = broadcast_object(writer.done_ids() if env.is_main else None)
    barrier()  # every rank has read the finished shards before any rank writes a new one
    save_target_head(parts, model, ctx.out_dir, write=env.is_main)
    try:
        wanted = list(range(len(data)))
        if ecfg.mode == "online":  # only what the self-check compares; training computes the rest
            picked = set(pick_samples(data.sample_ids[data.lengths > 0], ecfg.selfcheck_samples, cfg.run.seed))
            wanted = [i for i in wanted if int(data.sample_ids[i]) in picked]
        new_tokens = sum(int(data.lengths[i]) for i in wanted if int(data.sample_ids[i]) not in done)
        waits: dict[str, float] = {}
        forward_tokens = extract_samples(data, wanted, parts, layers, dtype, writer, ecfg.batch_tokens,
                                         ecfg.max_batch_size, data_rank, data_world, show=env.is_main, waits=waits,
                                         done=done)
        t_close = time.perf_counter()
        records = writer.close(index=False) if isinstance(writer, StoreWriter) else {}
        waits["close_s"] = time.perf_counter() - t_close
        waits = {k: round(v, 3) for k, v in waits.items()}
        if env.is_main and waits["loop_s"] > 0:
            log(f"[extract] host waits over {waits['loop_s']:.1f} s of forwards: store writer (disk) "
                f"{waits['writer_wait_s']:.1f} s, device-to-host copies {waits['copy_wait_s']:.1f} s, pinned buffers "
                f"{waits['pin_alloc_s']:.1f} s; the last shards took {waits['close_s']:.1f} s after the last forward")
    except BaseException:
        if isinstance(writer, StoreWriter):
            writer.abort()
        raise
    dropped = [s for part in all_gather_object(writer.dropped_samples) for s in part]
    if not tensor_parallel:  # tensor-parallel ranks all forward the same batches
        forward_tokens = int(all_reduce_sum(torch.tensor([forward_tokens], dtype=torch.int64))[0])
    barrier()  # every rank's shards are on disk
    index = broadcast_object(write_index(ctx.out_dir, meta, finished_shards(ctx.out_dir) if env.active else records,
                                         dropped, ecfg.fsync) if env.is_main else None)
    # Before the manifest: a store that disagrees with the model's own forward never reaches
    # train. Every rank checks (under tensor parallelism the reference forward is collective).
    check = run_selfcheck(model, parts, StoreReader(ctx.out_dir, verify=False), layers, ecfg.selfcheck_samples,
                          ecfg.selfcheck_min_cosine, ecfg.selfcheck_min_top1, seed=cfg.run.seed)
    if check["samples"]:
        log(f"[extract] self-check ok on {len(check['samples'])} samples: top-1 {check['top1_agreement']:.2%}, "
            f"least cosine {min(s['cosine'] for s in check['states'].values()):.6f}")
    seconds = time.time() - t0
    return {
        "samples": index["num_samples"],
        "tokens": index["num_tokens"],
        "resumed_samples": len(done),
        "new_tokens": new_tokens,  # of the samples stored by this run
        "forward_tokens": forward_tokens,  # through the target: with the stored batch mates of resumed batches
        **found.stats(),
        "dropped": index["dropped_counts"],
        "shards": index["num_shards"],
        "bytes": index["bytes"],
        "seconds": round(seconds, 3),
        "tokens_per_s": round(forward_tokens / seconds, 1) if seconds > 0 else None,
        "layers": layers,
        "hidden_size": parts.hidden_size,
        "world_size": env.world_size,
        "parallel": "tensor" if tensor_parallel else "data" if env.active else "none",
        "host_waits": waits,  # this rank's (rank 0's in the manifest)
        "selfcheck": check,
    }


def extract_samples(data: PreparedData, wanted: list[int], parts: TargetParts, layers: list[int], dtype: torch.dtype,
                    writer: StoreWriter | WritesNothing, batch_tokens: int, max_batch_size: int, rank: int = 0,
                    world_size: int = 1, show: bool = True, waits: dict[str, float] | None = None,
                    done: set[int] | frozenset[int] = frozenset()) -> int:
    """Forward this rank's share of the batches over `wanted` (prepared-data positions) and
    store the samples not in `done` (sample ids already stored). Returns the tokens this rank
    forwarded.

    The plan is `plan_batches` over all of `wanted` whatever is stored, the plan of an
    uninterrupted run; the batches that hold a sample not in `done` are recomputed whole
    (their stored rows are computed again and dropped), and this rank takes batches rank,
    rank + world_size, ... of those. So a sample's batch, and its states bit for bit, are the
    same in a one-rank, a W-rank, a resumed and a repaired run.

    `waits` (filled when given) says where the host thread that launches the forwards stood
    still, in seconds: 'pin_alloc_s' allocating pinned buffers, 'copy_wait_s' waiting for a
    batch's device-to-host copies (that is, for the GPU), 'writer_wait_s' handing rows to the
    store (blocked while its queue is full: the disk is behind), and 'loop_s' in all. Time the
    host stands still while a forward is queued costs nothing; past that, the GPU idles."""
    waits = {} if waits is None else waits
    for k in ("pin_alloc_s", "copy_wait_s", "writer_wait_s"):
        waits.setdefault(k, 0.0)
    t_loop = time.perf_counter()
    lengths = [int(data.lengths[i]) for i in wanted]
    for i, n in zip(wanted, lengths):
        if n == 0 and rank == 0 and int(data.sample_ids[i]) not in done:
            writer.drop(int(data.sample_ids[i]), "empty")
    todo = [i for i, n in zip(wanted, lengths) if n > 0]
    lengths = [n for n in lengths if n > 0]
    plan = plan_batches(lengths, batch_tokens, max_batch_size)
    redo = [b for b in plan if any(int(data.sample_ids[todo[p]]) not in done for p in b)]
    batches = redo[rank::world_size]
    todo_count = sum(int(data.sample_ids[todo[p]]) not in done for b in batches for p in b)
    device = parts.input_device
    bar = tqdm(total=sum(lengths[p] for b in batches for p in b), unit="tok", unit_scale=True, desc="extract",
               dynamic_ncols=True, disable=not show)
    stored = {"samples": 0, "dropped": 0}
    pending: _InFlight | None = None

    def finish(f: _InFlight) -> None:
        t0 = time.perf_counter()
        for ev in f.events:
            ev.synchronize()
        t1 = time.perf_counter()
        waits["copy_wait_s"] += t1 - t0
        for b, (i, n) in enumerate(zip(f.rows, f.lengths)):
            if int(data.sample_ids[i]) in done:
                continue  # stored by an earlier run; computed again only as a batch mate
            s = data[i]
            if bool(f.bad[b]):
                writer.drop(s.sample_id, "nonfinite")
                stored["dropped"] += 1
                continue
            scales = {} if f.aux_scale is None else {"aux_scale": f.aux_scale[b, :n], "final_scale": f.final_scale[b, :n]}
            writer.add(s.sample_id, f.aux[b, :n], f.final[b, :n], s.input_ids, s.loss_mask, **scales)
            stored["samples"] += 1
        waits["writer_wait_s"] += time.perf_counter() - t1
        bar.update(sum(f.lengths))
        bar.set_postfix(samples=f"{stored['samples']}/{todo_count}", dropped=stored["dropped"], refresh=False)

    parts.decoder.eval()
    try:
        with torch.inference_mode():
            for batch in batches:
                rows = [todo[p] for p in batch]
                ids, mask = pad_batch([data[i].input_ids for i in rows])
                ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
                aux, final = capture(parts, layers, ids, mask, capture_dtype(dtype))
                if isinstance(writer, WritesNothing):
                    bar.update(sum(lengths[p] for p in batch))
                    continue  # a tensor-parallel rank other than 0: rank 0 stores these states
                bad = nonfinite_rows(aux, final, mask)
                events: list = []
                scales: dict[str, torch.Tensor] = {}
                if dtype == FP8:  # quantized here on the device: half the bytes over the bus and to disk
                    aux, aux_scale = quantize_states(aux, len(layers))
                    final, final_scale = quantize_states(final, 1)
                    scales = {"aux_scale": to_host(aux_scale, events, waits),
                              "final_scale": to_host(final_scale, events, waits)}
                flight = _InFlight(rows, [lengths[p] for p in batch], to_host(aux, events, waits),
                                   to_host(final, events, waits), to_host(bad, events, waits), events,
                                   keep=(aux, final, bad, *scales.values()), **scales)
                if pending is not None:
                    finish(pending)  # the previous batch's rows, while this batch's copies run
                pending = flight
            if pending is not None:
                finish(pending)
    finally:
        bar.close()
        waits["loop_s"] = time.perf_counter() - t_loop
    return sum(lengths[p] for b in batches for p in b)
