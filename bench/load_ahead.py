"""What reading the store ahead (train.prefetch) hides of the host's loading.

    python bench/load_ahead.py --out /tmp/la.json                 # DeepSeek-V3 width, 4,096-token micro-batches
    python bench/load_ahead.py --hidden 4096 --tokens 8192 --step-ms 250

Writes a bf16 store of random states at `--hidden` with three captured layers and samples of
20-200 tokens (as `eaglet extract` would), packs them into micro-batches of `--tokens` in the
order an epoch does, and loads `--batches` of them the way training does (training.data.read_batch:
the store's reads and the host's copies into pinned memory; then send_batch: the copy to the
GPU, which the host only enqueues) after a stand-in for the device's step: the calling thread
waits `--step-ms` with the GIL released, as a host whose GPU is behind waits for it. Timed for
train.prefetch 0 (each micro-batch read when it is needed) and `--depth` (read ahead on a
thread), alternating, after a first pass that brings the store into the page cache. Prints and
saves the time per micro-batch after the first, the part of it the caller spent loading, and
the bytes per micro-batch.

Without a GPU (`--device cpu`) the batches go to the `meta` device (on the CPU send_batch would
convert them to fp32, which a GPU does on the device), and the reads land in fresh pageable
memory: in a thread each read then faults in its pages (about 4x a main-thread read's time on a
2-core VM), where a GPU's pinned memory comes from torch's caching host allocator. So the CPU's
figures say little about the GPU's. The stand-in lets the reading thread run freely while the
step waits; a real host also spends part of a step launching kernels.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from eaglet.config import load_config
from eaglet.distributed import resolve_device
from eaglet.formats.store import StoreReader, StoreWriter
from eaglet.training.data import Prefetch, epoch_plan, read_batch, send_batch
from eaglet.utils import atomic_write_json

N_AUX = 3


def write_store(folder: Path, hidden: int, tokens: int, seed: int = 0) -> dict[int, int]:
    """A store of random bf16 states with about `tokens` tokens; its sample lengths."""
    meta = {"input_hash": "bench", "hidden_size": hidden, "n_aux": N_AUX, "layers": [1, 2, 3],
            "num_target_layers": 8, "dtype": "bfloat16", "final_state": "post_norm"}
    w = StoreWriter(folder, meta, shard_bytes=1 << 30, fsync=False)
    g, lengths, total, i = np.random.default_rng(seed), {}, 0, 0
    while total < tokens:
        n = int(g.integers(20, 200))
        w.add(i, torch.randn(n, N_AUX * hidden).to(torch.bfloat16), torch.randn(n, hidden).to(torch.bfloat16),
              torch.randint(0, 1000, (n,), dtype=torch.int32), torch.ones(n, dtype=torch.uint8))
        lengths[i], total, i = n, total + n, i + 1
    w.close()
    return lengths


def run(store: StoreReader, plan: list[list[int]], tokens: int, step_s: float, depth: int,
        device: torch.device) -> tuple[float, float]:
    """(seconds per micro-batch, seconds of it the caller spent loading), after the first
    micro-batch (a run's first read has no step before it to hide behind)."""
    cuda = device.type == "cuda"
    cfg = load_config(None, ["train.ttt_steps=7", "extract.layers=[1, 2, 3]"])  # EAGLE-3 over the store's layers
    read = (lambda ids: read_batch(store, ids, max_tokens=tokens, pin=cuda, cfg=cfg))
    pre = Prefetch(read, plan, depth, device) if depth > 0 else None
    to, loading, t0 = device if cuda else torch.device("meta"), 0.0, 0.0
    try:
        for k, ids in enumerate(plan):
            if k == 1:
                t0, loading = time.perf_counter(), 0.0
            t1 = time.perf_counter()
            send_batch(pre.take(ids) if pre is not None else read(ids), to)
            loading += time.perf_counter() - t1
            time.sleep(step_s)  # the device's step: the host waits, the GIL released
        if cuda:
            torch.cuda.synchronize(device)
    finally:
        if pre is not None:
            pre.close()
    n = len(plan) - 1
    return (time.perf_counter() - t0) / n, loading / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch (train.max_tokens)")
    ap.add_argument("--batches", type=int, default=12, help="micro-batches per timed pass")
    ap.add_argument("--step-ms", type=float, default=150.0, help="the device's step (the bench's 147.8 ms at this shape)")
    ap.add_argument("--depth", type=int, default=2, help="train.prefetch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto", help="'auto' (cuda when there is one), 'cpu' or 'cuda'")
    ap.add_argument("--dir", type=Path, default=None, help="where to write the store (default: a temporary folder)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = resolve_device(args.device)
    folder = args.dir or Path(tempfile.mkdtemp(prefix="eaglet-load-ahead-"))
    try:
        lengths = write_store(folder, args.hidden, args.tokens * args.batches)
        store = StoreReader(folder)
        plan = epoch_plan(np.array(sorted(lengths)), lengths, args.tokens, seed=0, epoch=0)[: args.batches - 1]
        run(store, plan, args.tokens, 0.0, 0, device)  # the store into the page cache
        per = {0: [], args.depth: []}
        for _ in range(args.repeats):
            for depth in per:
                per[depth].append(run(store, plan, args.tokens, args.step_ms / 1000, depth, device))
        mib = statistics.mean(sum(lengths[i] for i in ids) for ids in plan) * (N_AUX + 1) * args.hidden * 2 / 2**20
        res = {"hidden": args.hidden, "tokens": args.tokens, "step_ms": args.step_ms, "micro_batches": len(plan),
               "mib_per_micro_batch": round(mib, 1), "torch": torch.__version__, "device": str(device), "runs": {}}
        for depth, got in per.items():
            wall = [1000 * w for w, _ in got]
            load = [1000 * x for _, x in got]
            res["runs"][f"prefetch {depth}"] = {"ms_per_micro_batch": [round(x, 1) for x in wall],
                                                "ms_loading": [round(x, 1) for x in load]}
            print(f"train.prefetch {depth}: {statistics.mean(wall):.1f} ms per micro-batch "
                  f"({', '.join(f'{x:.1f}' for x in wall)}), {statistics.mean(load):.1f} ms of it loading; "
                  f"the step alone {args.step_ms:.1f} ms; {mib:.0f} MiB a micro-batch")
        if args.out:
            atomic_write_json(args.out, res)
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
