"""The plan of an engine-fed run (extract.mode online, extract.backend vllm): vLLM computes the
target's states and streams them to training through a bounded buffer (stream.py).

Run by the engine's `doctor` (eaglet/engines/vllm/__init__.py) for `eaglet doctor` and the
preflights of extract and train: the buffer against two micro-batches, then, once the target's
skeleton is built, GPU memory per rank of the engine (weights, KV cache, the hidden-state cache)
with the trained draft's KV cache once served beside it (`check_draft_kv`, also the vLLM
eval's), what the engine leaves the draft on the same GPUs, the disk, and the hours per 100k
conversations (the draft's training FLOPs from its own linears, dense or MLA). The sizes come from eaglet/checks/sizing.py, which eaglet/doctor.py sizes its own plans with.
"""

from __future__ import annotations

import os

from ...checks.findings import Probe
from ...checks.sizing import (
    DTYPE_BYTES,
    FORWARD_REF,
    H200_BYTES,
    TRAIN_REF,
    dense_draft_flops,
    draft_need,
    draft_skeleton,
    draft_train_flops,
    gib,
    hidden_and_aux,
    mean_tokens,
    quant_bits,
    served_kv_bytes,
    target_dtype_bytes,
    target_kv_bytes,
    train_disk,
    weight_bytes,
)
from ...config import Config
from ...errors import ConfigError
from ...formats.buffer import buffer_folder, connector_itemsize, micro_batch_bytes
from ...utils import DTYPES


def streams(cfg: Config) -> bool:
    """The run streams its states from vLLM: extract.mode online with extract.backend vllm."""
    return cfg.extract.mode == "online" and cfg.extract.backend == "vllm"


def _stream_buffer(p: Probe) -> None:
    """The buffer must hold two micro-batches (one computed while the other trains); under
    torchrun the in-process engine cannot serve every rank."""
    e, train_cfg = p.cfg.extract, p.cfg.train
    hidden, n_aux = hidden_and_aux(p)
    one = micro_batch_bytes(train_cfg.max_tokens, 1, n_aux, hidden, DTYPES[e.store_dtype], connector_itemsize(p.cfg.target.dtype))
    bound = float(e.stream_buffer_gb) * 1e9
    where = buffer_folder(e.stream_dir, p.cfg.run_dir / "train")
    what = (f"two micro-batches of train.max_tokens {train_cfg.max_tokens} ({n_aux} + 1 states of width {hidden}, "
            f"{e.store_dtype}, with vLLM's connector files): {2 * one / 1e9:.3g} GB")
    if one > bound:
        fix = f"set extract.stream_buffer_gb to at least {2 * one / 1e9:.3g}, or lower train.max_tokens"
        p.add("FAIL", "stream buffer", what, f"extract.stream_buffer_gb {e.stream_buffer_gb}: not even one", fix,
              error=ConfigError(f"extract.stream_buffer_gb {e.stream_buffer_gb} holds {bound / 1e9:.3g} GB, and one "
                                f"micro-batch of train.max_tokens {train_cfg.max_tokens} needs {one / 1e9:.3g} GB of it",
                                fix=fix))
    elif 2 * one > bound:
        p.add("warn", "stream buffer", what, f"extract.stream_buffer_gb {e.stream_buffer_gb}: one; the engine waits "
              "for training", f"set extract.stream_buffer_gb to at least {2 * one / 1e9:.3g}")
    else:
        p.add("ok", "stream buffer", what, f"extract.stream_buffer_gb {e.stream_buffer_gb} in {where}: "
              f"{bound / one:.0f} micro-batches")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not e.vllm_server:
        p.add("FAIL", "stream engine", "under torchrun, one vLLM server for every rank", "the in-process engine",
              "start `vllm serve` with the command the doctor prints and set extract.vllm_server")


def check_stream(p: Probe) -> None:
    """An engine-fed run (extract.mode online, backend vllm): its buffer, then its plan: GPU
    memory per rank of the engine (weights, KV cache and the hidden-state cache vLLM fills for
    eaglet) and what it leaves the draft on the same GPUs; disk; the hours per 100k
    conversations from the reference rates (eaglet/checks/sizing.py) scaled by FLOPs."""
    import torch

    if not streams(p.cfg) or p.parts is None:
        return
    _stream_buffer(p)
    if p.model is None:
        return
    e, t = p.cfg.extract, p.cfg.train
    args = {**e.vllm_engine_args}
    gpus = int(args.get("tensor_parallel_size", 1)) * int(args.get("pipeline_parallel_size", 1)) * int(
        args.get("data_parallel_size", 1))
    util = float(args.get("gpu_memory_utilization", 0.9))
    if torch.cuda.is_available():
        mem, mem_from = float(torch.cuda.get_device_properties(0).total_memory), torch.cuda.get_device_name(0)
    else:
        mem, mem_from = H200_BYTES, "no GPU here: an H200's 141 GB assumed"
    text_cfg, H = p.text_config, p.parts.hidden_size
    _, n_aux = hidden_and_aux(p)
    b = target_dtype_bytes(p)
    params = sum(q.numel() for q in p.model.parameters())
    experts = sum(q.numel() for n, q in p.model.named_parameters() if ".experts." in n)
    quant = getattr(p.hf_config, "quantization_config", None) or getattr(text_cfg, "quantization_config", None)
    bits = quant_bits(quant) if quant else None
    if bits is not None and experts:  # a quantized MoE (Kimi-K2.5: int4 experts, a bf16 scale per 32 weights)
        weights = int(experts * (bits / 8 + 2 / 32) + (params - experts) * b)
    else:
        weights = weight_bytes(p, b)
    E, k = getattr(text_cfg, "n_routed_experts", None) or getattr(text_cfg, "num_experts", None), getattr(
        text_cfg, "num_experts_per_tok", None)
    active = params - (experts * (1 - k / E) if E and k else 0)
    tp = int(args.get("tensor_parallel_size", 1))
    kv, kv_what = target_kv_bytes(text_cfg, p.parts.num_layers, tp)  # MLA: the latent, whole on every rank
    hs = (n_aux + 1) * H * 2
    per_gpu_weights = weights / gpus
    cache = util * mem - per_gpu_weights - 0.05 * mem  # vLLM's activations and graphs: ~5%, rough
    mean, mean_from = mean_tokens(p)
    if cache <= 0:
        p.add("FAIL", "engine memory", f"weights {gib(per_gpu_weights)} per GPU within gpu_memory_utilization "
              f"{util} of {gib(mem)} ({mem_from})", f"{gib(util * mem)}",
              "more GPUs (tensor_parallel_size), or a higher gpu_memory_utilization")
        return
    tokens = cache / (kv + hs)
    p.add("info", "engine memory (per GPU)",
          f"vLLM on {gpus} GPU(s) at gpu_memory_utilization {util} of {gib(mem)} ({mem_from})",
          f"weights {gib(per_gpu_weights)} ({params / 1e9:.1f}B parameters, {active / 1e9:.1f}B active); KV cache "
          f"{kv / 1024:.1f} KiB a token ({kv_what}) and hidden-state cache {hs / 1024:.1f} KiB a token ({n_aux} + 1 "
          f"states of {H}) share the other {gib(cache)}: {tokens / 1e3:.0f}k tokens, {tokens / mean:.0f} requests of "
          f"{mean:.0f} tokens in flight (extract.vllm_requests {e.vllm_requests}); rough")
    check_draft_kv(p, args)
    found = draft_need(p, target_beside=False)  # the target runs in vLLM's processes
    if found is not None:
        need, breakdown, _, _ = found
        left = (1 - util) * mem
        status = "ok" if need <= 0.9 * left else "warn" if need <= left else "FAIL"
        if not torch.cuda.is_available():
            status = "info" if status == "ok" else status
        p.add(status, "draft beside the engine (per GPU)", f"~{gib(need)} ({breakdown})",
              f"{gib(left)} left by gpu_memory_utilization {util} of {gib(mem)}",
              "lower gpu_memory_utilization in extract.vllm_engine_args, or train.max_tokens")
        ref = dense_draft_flops(TRAIN_REF["hidden"], TRAIN_REF["inter"], TRAIN_REF["draft_vocab"], TRAIN_REF["kv"],
                                TRAIN_REF["ttt"])
        flops = draft_train_flops(draft_skeleton(p)[1], t.ttt_steps)  # the draft's own linears, dense or MLA
        train_rate = TRAIN_REF["tokens_per_s"] * ref / flops
        engine_rate = FORWARD_REF["tokens_per_s"] * FORWARD_REF["active_params"] / max(active, 1.0)
        tokens_100k = 1e5 * mean * t.epochs
        shared = tokens_100k * (1 / engine_rate + 1 / train_rate) / gpus / 3600
        apart = tokens_100k * max(1 / engine_rate, 1 / train_rate) / gpus / 3600
        p.add("info", "hours per 100k conversations",
              f"{mean:.0f} tokens each ({mean_from}) x train.epochs {t.epochs}, on {gpus} GPU(s)",
              f"{shared:.1f} h with the draft on the engine's GPUs (engine ~{engine_rate / 1e3:.1f}k tokens/s a GPU, "
              f"training ~{train_rate / 1e3:.1f}k: the two take turns), {apart:.1f} h on as many GPUs again for the "
              "draft; from rates measured on one H200 scaled by FLOPs (checks/sizing.py FORWARD_REF, TRAIN_REF): an estimate")
    d = train_disk(p)
    p.add("info", "disk (engine-fed)", "no store: the buffer, the head and the checkpoints",
          f"buffer <= {e.stream_buffer_gb:g} GB in {buffer_folder(e.stream_dir, p.cfg.run_dir / 'train')}; "
          + (f"checkpoints and the final draft ~{gib(d['peak'])} at most at once (train.keep_last {t.keep_last}: "
             "the disk (train) line checks them); " if d is not None else "")
          + "an offline store would be "
          f"{(n_aux + 1) * H * DTYPE_BYTES.get(e.store_dtype, 2) / 1e3:.1f} KB a token")


DRAFT_KV = "draft KV cache (served)"


def check_draft_kv(p: Probe, engine_args: dict) -> None:
    """The KV cache a token takes for the EAGLE-3 draft once vLLM serves it beside the target
    (`served_kv_bytes`: a dense draft's K and V, an MLA draft's latent), at the tensor
    parallelism of `engine_args`, beside the target's own; once per doctor run (the engine-fed
    plan gives it next to the engine's memory, the vLLM eval's check otherwise)."""
    if p.parts is None or p.cfg.train.algorithm != "eagle3" or any(f.check == DRAFT_KV for f in p.findings):
        return  # the architecture unresolved (a FAIL of its own), another draft type, or given already
    found = draft_skeleton(p)
    if found is None:
        return
    text_cfg, draft = found
    tp = int(engine_args.get("tensor_parallel_size", 1))
    total, per_gpu, what = served_kv_bytes(draft.config, tp)
    target, target_what = target_kv_bytes(text_cfg, p.parts.num_layers, tp)
    attention = f"train.draft_attention {draft.config.attention}"
    p.add("info", DRAFT_KV, f"the draft's KV cache in vLLM, a token in bf16 ({attention})",
          f"{total} B a token ({total / 1024:.2f} KiB: {what}); {per_gpu} B on each GPU at tensor_parallel_size "
          f"{tp}, beside the target's {target / 1024:.1f} KiB ({target_what})")
