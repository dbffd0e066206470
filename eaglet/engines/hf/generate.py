"""The target's replies to prompts through transformers, as `eaglet regenerate` runs it
(eaglet/stages/regenerate.py): `padded_generate` (one left-padded batch through `model.generate`,
the growing KV cache or a static one sized per call, `static_cache_len`), `batched_generate`
(padded batches of prompts of similar length) and `continuous_generate` (transformers'
continuous batching, `generate_batch`), with the choices their settings' 'auto' makes and the
batch size that fits a GPU's memory. Each reply is (text up to EOS, its new tokens). Change here
how the transformers engines generate; the OpenAI-server engine is eaglet/regeneration/server.py.
"""

from __future__ import annotations

from typing import Any

import torch

from ...targets.load import eos_ids
from ...utils import log
from .decode import cache_kwarg


FALLBACK_BATCH = 16  # prompts per padded batch when continuous batching left some unanswered


def reply_text(tokenizer: Any, tokens: list[int], eos: set[int]) -> tuple[str, int]:
    """A reply's text (its tokens up to the first EOS, decoded without special tokens, stripped) and
    how many tokens that is."""
    n = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokenizer.decode(tokens[:n], skip_special_tokens=True).strip(), n


STATIC_CACHE_BASE = 256  # the smallest static KV cache, in positions; the others double it


def static_cache_len(width: int, max_new_tokens: int, limit: int, base: int = STATIC_CACHE_BASE) -> int:
    """Positions of the static KV cache for a call of prompts `width` tokens wide: the smallest of
    base, 2 base, 4 base, ... that holds width + max_new_tokens, capped at `limit` (more is refused).

    Every decoding step attends over the whole cache, so one size for all calls (the limit) makes
    a call of short prompts pay for the longest; a size per width would make transformers
    recompile the decoding step for nearly every call. Doubling sizes bound both: at most
    log2(limit / base) + 2 sizes, each under twice what its call needs (or `base`)."""
    need = width + max_new_tokens
    if need > limit:
        raise ValueError(f"static KV cache of {limit} positions < prompt {width} + {max_new_tokens} new tokens")
    size = base
    while size < need:
        size *= 2
    return min(size, limit)


@torch.inference_mode()
def padded_generate(model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int,
                    temperature: float, static_len: int | None = None) -> list[tuple[str, int]]:
    """The target's reply to each prompt (token ids): (text, new tokens); one left-padded batch.

    static_len: use a static KV cache, of `static_cache_len(width, max_new_tokens, static_len)`
    positions, instead of a growing one: transformers then compiles the decoding step on a GPU
    (its auto-compile for static caches), once per cache size, instead of concatenating the
    cache every token; on a CPU the same cache runs eagerly. The cache is made here, not through
    `cache_implementation`: transformers makes each static cache at least as long as the longest
    it made before, so after the first (longest) call every call would attend over its length."""
    width = max(len(x) for x in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in prompts], device=device)
    sample = temperature > 0
    cache: dict[str, Any] = {}
    if static_len is not None:
        from transformers import StaticCache

        size = static_cache_len(width, max_new_tokens, static_len)
        cache = {cache_kwarg(model): StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=size)}
    out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                         do_sample=sample, temperature=temperature if sample else None, top_p=None, top_k=None,
                         pad_token_id=pad, **cache)
    eos = set(eos_ids(model, tokenizer))
    return [reply_text(tokenizer, row, eos) for row in out[:, width:].tolist()]


def batched_generate(model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                     batch_size: int, static_len: int | None = None) -> list[tuple[str, int]]:
    """`padded_generate` over batches of `batch_size` prompts of similar length (longest first:
    little padding, and an out-of-memory shows at once); replies in the prompts' order."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    replies: list[tuple[str, int] | None] = [None] * len(prompts)
    for a in range(0, len(order), batch_size):
        part = order[a:a + batch_size]
        for i, r in zip(part, padded_generate(model, tokenizer, [prompts[i] for i in part], max_new_tokens, temperature,
                                                  static_len)):
            replies[i] = r
    return replies  # type: ignore[return-value]


def continuous_generate(model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int,
                        temperature: float) -> tuple[list[tuple[str, int]], int]:
    """The same replies through transformers' continuous batching (`generate_batch`: a paged KV
    cache, requests join and leave the running batch, no padding, no waiting on the longest).

    `generate_batch` logs, rather than raises, a request that failed or went missing, and
    returns results in request order: each result is checked against its own prompt, and a
    missing or failed one is generated again with `padded_generate`. Returns (replies, redone).
    Not under inference_mode: the engine's thread updates tensors made here in place (an
    error in transformers 5.17 on a GPU); it disables gradients itself.
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig

    sample = temperature > 0
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = set(eos_ids(model, tokenizer))
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample, temperature=temperature if sample else None,
                           top_p=None, top_k=None, eos_token_id=sorted(eos), pad_token_id=pad)
    kwargs = {}
    if next(model.parameters()).device.type == "cuda":
        # Left to size itself, the paged cache takes ~all free GPU memory and the first batch's
        # logits then run out of it (seen on an H200): leave room.
        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(max_memory_percent=0.5)
    else:
        # Sized from free memory, the paged cache takes seconds to set up on a CPU: size it to the work.
        need = sum(len(p) + max_new_tokens for p in prompts)
        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
            num_blocks=max(4, -(-need // 256) + len(prompts)), max_batch_tokens=max(256, max(len(p) for p in prompts)))
    results = list(model.generate_batch(inputs=prompts, generation_config=gen, progress_bar=False, **kwargs).values())
    replies: list[tuple[str, int] | None] = [None] * len(prompts)
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        by_prompt.setdefault(tuple(p), []).append(i)
    for r in results:
        key = tuple(int(t) for t in r.prompt_ids)
        if r.error is not None or key not in by_prompt or not by_prompt[key]:
            continue  # matched to no prompt: its prompt is generated again below
        replies[by_prompt[key].pop(0)] = reply_text(tokenizer, [int(t) for t in r.generated_tokens], eos)
    redo = [i for i, r in enumerate(replies) if r is None]
    if redo:
        log(f"[regenerate] continuous batching returned no usable result for {len(redo)} of {len(prompts)} prompts; "
            "generating those with padded batches")
        again = batched_generate(model, tokenizer, [prompts[i] for i in redo], max_new_tokens, temperature,
                                 FALLBACK_BATCH)
        for i, r in zip(redo, again):
            replies[i] = r
    return replies, len(redo)  # type: ignore[return-value]


def resolve_engine(engine: str, model: Any) -> str:
    """'auto' is the padded engine everywhere: transformers' continuous batching was the slower on a
    GPU (docs/performance.md, regenerate's engines). ('openai' runs no model here:
    eaglet/regeneration/server.py.)"""
    if engine == "auto":
        return "generate"
    if engine == "continuous" and not hasattr(model, "generate_batch"):
        raise ValueError("regenerate --engine continuous: this transformers has no generate_batch; use --engine generate")
    return engine


def resolve_kv_cache(kv_cache: str) -> str:
    """'auto': the growing cache, the faster over a sorted chunk's calls (docs/performance.md,
    regenerate's engines); static is there to choose where its compile pays off."""
    if kv_cache not in ("auto", "static", "dynamic"):
        raise ValueError(f"regenerate --kv-cache {kv_cache!r}: expected auto, static or dynamic")
    return "dynamic" if kv_cache == "auto" else kv_cache


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of KV cache one token takes in transformers' cache (all layers, keys and values)."""
    c = model.config.get_text_config(decoder=True)
    size = next(model.parameters()).element_size()
    if getattr(c, "kv_lora_rank", None):  # MLA (DeepSeek-V2/V3, Kimi): the latent and the rope key, one "head"
        return c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * size
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * heads * 2 * head_dim * size


def auto_generate_batch(model: Any, positions: int, memory_fraction: float = 0.5, cap: int = 1024) -> int:
    """Prompts per padded batch on a GPU: the KV cache of `positions` per prompt in
    `memory_fraction` of the free memory (a multiple of 8, at most `cap`); 16 on a CPU."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return 16
    free, _ = torch.cuda.mem_get_info(device)
    n = int(free * memory_fraction) // (positions * kv_bytes_per_token(model))
    return max(1, min(cap, n // 8 * 8 or n))
