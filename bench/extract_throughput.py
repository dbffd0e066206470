"""Extraction throughput: eaglet's capture + device-to-host copy + checksummed store write,
against a plain forward of the same target, and the store write on its own.

    python bench/extract_throughput.py --out extract.json                       # 8B-shaped Llama, 32 layers
    python bench/extract_throughput.py --layers 8 --batches 4 --dir /local/tmp  # shorter
    python bench/extract_throughput.py --preset tiny --device cpu --batches 2    # CPU smoke test

The target is a Llama of the preset's shape (llama3-8b: hidden 4096, 32 heads / 8 KV,
intermediate 14336, vocabulary 128256; `--layers` decoder layers, default 32) with random
weights, built on the meta device and materialised on the GPU in bf16 (no checkpoint to
read). Inputs: `--batches` batches of `--batch-size` random sequences of `--seq` tokens.

Three timings, each over the same batches after one untimed warm-up batch:
- forward: the base model's forward (what extract runs: no LM head), nothing kept;
- extract: eaglet's own loop (`extract.extract_samples`: hooks capture the states entering
  the aux layers into one buffer, non-finite check, non-blocking copies to pinned host
  memory, the previous batch handed to the StoreWriter while the next forward runs) and
  the StoreWriter's background threads (sha256 + safetensors + fsync, `--writer-threads`),
  until `close()` returns: every shard on disk. Tokens/s end to end, the ratio to forward,
  and where the loop's host thread waited (`host_waits`: pinned allocations, copies, the
  writer's full queue, and the shards still to write after the last forward);
- write: the StoreWriter alone, fed host tensors of the same sizes: its bandwidth (GB/s)
  and the tokens/s that bandwidth is worth at the store's bytes per token.
The store goes to `--dir` (a temporary folder on local disk by default), deleted after each part.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eaglet.config import ExtractSection
from eaglet.formats.store import POST_NORM, StoreWriter, store_meta
from eaglet.engines.hf.extract import extract_samples
from eaglet.targets.families import resolve_layers
from eaglet.targets.load import TargetParts, norm_eps
from eaglet.testing.synthetic import SyntheticSamples
from eaglet.utils import DTYPES

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=512,
                 num_hidden_layers=8),
    "llama3-8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                      vocab_size=128256, num_hidden_layers=32, rope_theta=500000.0),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    ap.add_argument("--layers", type=int, default=None, help="Decoder layers (default: the preset's, 32 for 8B).")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq", type=int, default=None, help="Tokens per sequence (default 2048; tiny: 64).")
    ap.add_argument("--batches", type=int, default=8, help="Timed batches per part.")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dir", default=None, help="Parent folder of the temporary stores (local disk).")
    ap.add_argument("--no-fsync", action="store_true", help="Skip fsync (not what extract does by default).")
    ap.add_argument("--writer-threads", type=int, default=ExtractSection.writer_threads)
    ap.add_argument("--writer-queue", type=int, default=ExtractSection.writer_queue)
    ap.add_argument("--shard-mb", type=float, default=ExtractSection.shard_mb)
    ap.add_argument("--parts", default="forward,extract,write", help="Which timings, comma-separated.")
    ap.add_argument("--store-dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn"],
                    help="extract.store_dtype of the timed extraction (float8_e4m3fn: quantized on the device).")
    ap.add_argument("--out", default=None, help="Write the result JSON here.")
    args = ap.parse_args(argv)
    args.seq = args.seq or (64 if args.preset == "tiny" else 2048)
    return args


def build_target(preset: str, layers: int | None, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A LlamaForCausalLM of the preset's shape with random weights: built on the meta device,
    materialised on `device`, weights N(0, 0.02), norms 1 (a few seconds even for 8B)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(PRESETS[preset])
    if layers:
        shape["num_hidden_layers"] = layers
    theta = shape.pop("rope_theta", 10000.0)
    config = LlamaConfig(**shape, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=theta,
                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(dtype)  # the dtype first: never an fp32 copy on the device
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    # non-persistent buffers (RoPE's inv_freq) are not materialised by to_empty: rebuild them
    rot = model.model.rotary_emb
    model.model.rotary_emb = type(rot)(config=model.config).to(device)
    model.eval()
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _meta(parts: TargetParts, layers: list[int], dtype: str) -> dict[str, Any]:
    return store_meta("bench", parts.hidden_size, layers, dtype, POST_NORM, parts.num_layers,
                      type(parts.decoder).__name__, norm_eps(parts.norm), "offline")


def _writer(folder: Path, meta: dict[str, Any], args: argparse.Namespace) -> StoreWriter:
    return StoreWriter(folder, meta, shard_bytes=int(args.shard_mb * 2**20), queue_size=args.writer_queue,
                       fsync=not args.no_fsync, threads=args.writer_threads)


def time_forward(parts: TargetParts, data: SyntheticSamples, B: int, device: torch.device) -> float:
    """Seconds for the base model's forward over all of `data`, in batches of B."""
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for a in range(0, len(data), B):
            ids = torch.from_numpy(data.ids[a:a + B]).to(device, torch.int64, non_blocking=True)
            parts.decoder(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    _sync(device)
    return time.perf_counter() - t0


def time_extract(parts: TargetParts, layers: list[int], data: SyntheticSamples, B: int, folder: Path,
                 args: argparse.Namespace) -> tuple[float, int, dict[str, float]]:
    """Seconds for eaglet's extract loop over `data` until the writer has every shard on disk,
    the bytes written, and where the loop's host thread waited (`extract_samples`'s `waits`, plus
    'close_s': from the last batch handed over to the last shard on disk)."""
    meta = _meta(parts, layers, args.store_dtype)
    writer = _writer(folder, meta, args)
    waits: dict[str, float] = {}
    _sync(parts.input_device)
    t0 = time.perf_counter()
    try:
        tokens = extract_samples(data, list(range(len(data))), parts, layers, DTYPES[args.store_dtype], writer,
                                 batch_tokens=B * args.seq, max_batch_size=B, show=False, waits=waits)
        t1 = time.perf_counter()
        records = writer.close(index=False)
    except BaseException:
        writer.abort()
        raise
    seconds = time.perf_counter() - t0
    waits["close_s"] = time.perf_counter() - t1
    return seconds, sum(r["bytes"] for r in records.values()) if tokens else 0, waits


def time_write(parts: TargetParts, layers: list[int], n: int, seq: int, folder: Path,
               args: argparse.Namespace) -> tuple[float, int]:
    """Seconds for the StoreWriter alone to take n samples of seq tokens (host tensors made
    beforehand, the shapes extract hands it) and have them on disk."""
    H, A = parts.hidden_size, len(layers) * parts.hidden_size
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(seq, A, generator=g).to(torch.bfloat16)
    final = torch.randn(seq, H, generator=g).to(torch.bfloat16)
    ids, mask = np.zeros(seq, dtype=np.int32), np.ones(seq, dtype=np.uint8)
    writer = _writer(folder, _meta(parts, layers, "bfloat16"), args)
    t0 = time.perf_counter()
    try:
        for i in range(n):  # the same tensors for every sample: only the write is timed
            writer.add(i, aux, final, ids, mask)
        records = writer.close(index=False)
    except BaseException:
        writer.abort()
        raise
    return time.perf_counter() - t0, sum(r["bytes"] for r in records.values())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    parts_wanted = set(args.parts.split(","))
    t0 = time.perf_counter()
    model = build_target(args.preset, args.layers, device, dtype)
    parts = TargetParts.of(model)
    build_s = time.perf_counter() - t0
    layers = resolve_layers(None, parts.num_layers)
    B, n = args.batch_size, args.batch_size * args.batches
    data = SyntheticSamples(n, args.seq, model.config.vocab_size, seed=1)
    warm = SyntheticSamples(B, args.seq, model.config.vocab_size, seed=2)
    tokens = n * args.seq
    root = Path(tempfile.mkdtemp(prefix="eaglet-extract-bench-", dir=args.dir))
    # states (bf16: 2 B a value; fp8: 1 B and a float32 scale per state) + int32 id + uint8 mask
    fp8 = args.store_dtype == "float8_e4m3fn"
    bytes_per_token = (len(layers) + 1) * (parts.hidden_size * (1 if fp8 else 2) + (4 if fp8 else 0)) + 5
    report: dict[str, Any] = {
        "preset": args.preset, "layers": parts.num_layers, "aux_layers": layers, "hidden_size": parts.hidden_size,
        "batch_size": B, "seq": args.seq, "batches": args.batches, "tokens": tokens, "dtype": str(dtype),
        "store_dtype": args.store_dtype, "store_bytes_per_token": bytes_per_token, "fsync": not args.no_fsync, "writer_threads": args.writer_threads,
        "writer_queue": args.writer_queue, "shard_mb": args.shard_mb, "build_s": build_s, "dir": str(root),
        "device": str(device), "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
    }
    print(f"target: Llama {args.preset} x {parts.num_layers} layers, random {dtype} weights, built in {build_s:.1f} s; "
          f"{args.batches} batches of {B} x {args.seq} tokens; store {bytes_per_token / 1024:.1f} KB/token "
          f"in {root}", flush=True)
    try:
        time_forward(parts, warm, B, device)  # warm-up: kernels, allocator
        if "forward" in parts_wanted:
            s = time_forward(parts, data, B, device)
            report["forward"] = {"seconds": s, "tokens_per_s": tokens / s}
            print(f"forward (base model, no capture): {tokens / s:,.0f} tokens/s", flush=True)
        if "extract" in parts_wanted:
            time_extract(parts, layers, warm, B, root / "warm", args)  # warm-up: pinned memory, threads
            shutil.rmtree(root / "warm", ignore_errors=True)
            s, nbytes, waits = time_extract(parts, layers, data, B, root / "extract", args)
            shutil.rmtree(root / "extract", ignore_errors=True)
            report["extract"] = {"seconds": s, "tokens_per_s": tokens / s, "bytes": nbytes,
                                 "gb_per_s": nbytes / s / 1e9, "host_waits": {k: round(v, 3) for k, v in waits.items()}}
            if "forward" in report:
                report["extract"]["vs_forward"] = report["forward"]["seconds"] / s
            print(f"extract (capture + copy + checksummed write{'' if not args.no_fsync else ', no fsync'}): "
                  f"{tokens / s:,.0f} tokens/s, {nbytes / s / 1e9:.2f} GB/s written"
                  + (f", {report['extract']['vs_forward']:.2f}x the forward" if "forward" in report else ""),
                  flush=True)
            print("  host waits: " + ", ".join(f"{k} {v:.2f}" for k, v in waits.items()), flush=True)
        if "write" in parts_wanted:
            s, nbytes = time_write(parts, layers, n, args.seq, root / "write", args)
            shutil.rmtree(root / "write", ignore_errors=True)
            report["write"] = {"seconds": s, "bytes": nbytes, "gb_per_s": nbytes / s / 1e9,
                               "tokens_per_s_worth": nbytes / s / bytes_per_token}
            print(f"write only (StoreWriter, {args.writer_threads} threads): {nbytes / s / 1e9:.2f} GB/s = "
                  f"{nbytes / s / bytes_per_token:,.0f} tokens/s worth", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    bad = [k for k in ("forward", "extract", "write") if k in report and not math.isfinite(report[k]["seconds"])]
    if bad:
        raise SystemExit(f"bad timings: {bad}")
    return report


if __name__ == "__main__":
    main()
