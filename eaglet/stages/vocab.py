"""The draft vocabulary: the most frequent loss-masked tokens, and the d2t/t2d maps.

    d2t[i] = used[i] - i      (int64; target id = draft id + d2t[draft id])
    t2d[t] = t in used        (bool over the full target vocabulary)

`used` is sorted ascending. When fewer distinct tokens were seen than the draft size, the
lowest unused target ids fill the rest, so the maps always have the configured size.
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import Config
from ..formats.prepared import PreparedData
from ..formats.vocab import save_vocab
from ..targets.load import hub_kwargs, target_source
from ..utils import log
from ..context import StageContext


def masked_token_counts(data: PreparedData, vocab_size: int) -> np.ndarray:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for s in data:
        ids = s.input_ids[s.loss_mask.astype(bool)]
        if ids.size and int(ids.max()) >= vocab_size:
            raise ValueError(
                f"prepared sample {s.sample_id} has token id {int(ids.max())} >= target vocabulary {vocab_size}: "
                "the tokenizer and the target model do not match"
            )
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


def build_maps(counts: np.ndarray, draft_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [N], t2d bool [V]) from per-token counts, N = min(draft_size, V)."""
    vocab_size = counts.shape[0]
    n = min(draft_size, vocab_size)
    # Most frequent first; ties broken by the lower id (stable sort on -counts).
    order = np.argsort(-counts, kind="stable")
    seen = order[counts[order] > 0][:n]
    if seen.size < n:
        unused = np.setdiff1d(np.arange(vocab_size), seen, assume_unique=True)[: n - seen.size]
        seen = np.concatenate([seen, unused])
    used = np.sort(seen)
    d2t = torch.from_numpy(used - np.arange(n)).to(torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.from_numpy(used)] = True
    return d2t, t2d


def coverage(counts: np.ndarray, t2d: torch.Tensor) -> float:
    total = counts.sum()
    return float(counts[t2d.numpy()].sum() / total) if total else 0.0


def target_vocab_size(cfg: Config) -> int:
    from transformers import AutoConfig

    target_cfg = AutoConfig.from_pretrained(target_source(cfg.target), **hub_kwargs(cfg.target))
    return int(target_cfg.get_text_config().vocab_size)


def run_vocab(cfg: Config, ctx: StageContext) -> dict:
    data = PreparedData(ctx.upstream["prepare"])
    vocab_size = target_vocab_size(cfg)
    counts = masked_token_counts(data, vocab_size)
    d2t, t2d = build_maps(counts, cfg.vocab.size)
    cov = coverage(counts, t2d)
    save_vocab(ctx.out_dir, d2t, t2d, counts)
    distinct = int((counts > 0).sum())
    log(f"[vocab] draft vocabulary {d2t.numel()} of {vocab_size}; {distinct} distinct masked tokens; coverage {cov:.4%}")
    return {
        "draft_vocab_size": int(d2t.numel()),
        "target_vocab_size": vocab_size,
        "distinct_masked_tokens": distinct,
        "masked_tokens": int(counts.sum()),
        "coverage": cov,
    }
