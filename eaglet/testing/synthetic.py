"""Synthetic training batches shaped as real data, for the benchmarks and the tests.

`synthetic_batch` makes one packed micro-batch of the real shapes (`PRESETS`: the drafts of
Llama-3.1-8B and Kimi-K2.5, and a tiny one) with random captured states and tokens, a loss
mask with the share of trained tokens real chat data has (`LOSS_SHARE`), and, given the
teacher's LM head, final states whose teacher argmax is a draft token as often as on real data
(`IN_VOCAB`). bench/train_throughput.py and bench/scaling.py time the training step on them.
`SyntheticSamples` stands in for prepared data (random tokens of one length), for extraction.
`draft_shape` gives a preset's draft with either attention layer (train.draft_attention).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from ..draft.eagle3.mla import mla_sizes
from ..draft.eagle3.model import DraftConfig
from ..draft.eagle3.training import step_rows
from ..draft.step import Batch, HostRows, send_rows
from ..formats.prepared import Sample


# The share of rows whose teacher argmax is a draft token in the synthetic batches (`synthetic_batch`): a
# 32k draft vocabulary's coverage of real chat data is of this order (the vocab stage prints it).
IN_VOCAB = 0.95
# The share of tokens trained on (the assistant tokens, loss mask 1) in the synthetic batches:
# 0.784 measured on the embedded default data, the first 3000 ShareGPT records rendered with
# SmolLM2-135M-Instruct's chat template at prepare.max_length 2048 (2868 samples, 4.2M tokens;
# `eaglet prepare` and the sum of the prepared loss masks). Laid out as turns of TURN_TOKENS
# whose first (1 - share) tokens are the prompt.
LOSS_SHARE = 0.78
TURN_TOKENS = 512

# Draft shapes of real targets (DraftConfig.from_target_config of their configs) and a tiny one.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                 vocab_size=512, draft_vocab_size=128),
    # SmolLM2-135M-Instruct's (the embedded default and bench/ab.py's target).
    "smollm2-135m": dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         intermediate_size=1536, vocab_size=49152, draft_vocab_size=32000),
    "llama3-8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      intermediate_size=14336, vocab_size=128256, draft_vocab_size=32000),
    "kimi-k2": dict(hidden_size=7168, num_attention_heads=56, num_key_value_heads=8, head_dim=128,
                    intermediate_size=18432, vocab_size=163840, draft_vocab_size=32000),
    # DeepSeek-V3's draft (bench/fullwidth.py's target has its width): Kimi-K2.5's but for the target vocabulary.
    "deepseek-v3": dict(hidden_size=7168, num_attention_heads=56, num_key_value_heads=8, head_dim=128,
                        intermediate_size=18432, vocab_size=129280, draft_vocab_size=32000),
}


# The attention of the presets whose target is an MLA model (their configs' heads and ranks), which
# an MLA draft of the preset takes as its own; the other presets' MLA drafts follow
# eaglet/draft/eagle3/mla.py `mla_sizes`' rule from their heads and head_dim.
MLA_TARGETS: dict[str, dict[str, int]] = {
    "kimi-k2": dict(num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128),
    "deepseek-v3": dict(num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128),
}


def draft_shape(preset: str, attention: str = "dense") -> dict[str, Any]:
    """DraftConfig fields (target_hidden_size aside) of `preset`'s draft with a dense or an MLA
    layer (`attention`), the MLA sizes as DraftConfig.from_target_config picks them."""
    shape: dict[str, Any] = dict(PRESETS[preset])
    if attention == "mla":
        target = SimpleNamespace(**MLA_TARGETS.get(preset, {}))
        shape.update(attention="mla", **mla_sizes(target, shape["num_attention_heads"], shape["head_dim"]))
    return shape


def synthetic_loss_mask(tokens: int, doc_tokens: int, share: float = LOSS_SHARE) -> torch.Tensor:
    """[1, tokens] bool: each document in turns of TURN_TOKENS (or the document), the first
    1 - share of each turn a prompt (0), the rest the answer (1)."""
    turn = min(TURN_TOKENS, doc_tokens)
    return ((torch.arange(tokens) % doc_tokens) % turn >= round((1 - share) * turn)).unsqueeze(0)


def packed_doc_lens(max_tokens: int, mean_doc: int, seed: int) -> list[int]:
    """The documents of one micro-batch packed as the trainer packs real ones, of varying
    lengths: drawn log-normally around `mean_doc` (16 to max_tokens tokens), taken while the
    next one fits. Real micro-batches differ in tokens, documents and trained rows."""
    rng = np.random.default_rng(seed)
    lens: list[int] = []
    while True:
        n = int(np.clip(rng.lognormal(np.log(mean_doc), 0.7), 16, max_tokens))
        if lens and sum(lens) + n > max_tokens:
            return lens
        lens.append(min(n, max_tokens - sum(lens)))


def synthetic_batch(cfg: DraftConfig, tokens: int, doc_tokens: int, device: torch.device, frozen: torch.dtype,
           seed: int, head: torch.Tensor | None = None, in_vocab: float = IN_VOCAB, loss_share: float = LOSS_SHARE,
           ttt_steps: int = 0, doc_lens: list[int] | None = None) -> Batch:
    """One packed micro-batch of random inputs, as load_batch returns them (with the rows each
    TTT step's loss can count, and those steps 1.. run over, when ttt_steps > 0), trained on a
    share `loss_share` of its tokens (`synthetic_loss_mask`). Its documents: `tokens` in
    documents of `doc_tokens`, or those of `doc_lens` (`packed_doc_lens`; `tokens` their sum).

    With `head` (the target's LM head [V, H] the teacher uses), each row's final state is that
    head's row for a token picked per row, plus noise, so that the teacher's argmax is that
    token: a draft token (id < draft_vocab_size, the identity maps of a new draft) for a
    fraction `in_vocab` of the rows. The out-of-vocabulary mask then drops what it drops on real
    data (the vocab stage's coverage), not the ~80% of rows that random states would give: a
    backward whose gradients are mostly zero rows runs faster than on real data (the GEMMs draw
    less power), which flatters the step."""
    g = torch.Generator().manual_seed(seed)
    if doc_lens is None:
        docs, positions = torch.arange(tokens) // doc_tokens, torch.arange(tokens) % doc_tokens
        mask = synthetic_loss_mask(tokens, doc_tokens, loss_share)
    else:  # synthetic_loss_mask's turns, within each document of its own length
        if sum(doc_lens) != tokens:
            raise ValueError(f"doc_lens sum to {sum(doc_lens)} tokens, not {tokens}")
        lens = torch.tensor(doc_lens)
        docs = torch.arange(len(doc_lens)).repeat_interleave(lens)
        positions = torch.cat([torch.arange(n) for n in doc_lens])
        turn = lens.clamp(max=TURN_TOKENS).repeat_interleave(lens)
        mask = (positions % turn >= ((1 - loss_share) * turn).round()).unsqueeze(0)
    if head is None:
        final = torch.randn(1, tokens, cfg.target_hidden_size, generator=g)
    else:
        n, V = cfg.draft_vocab_size, cfg.vocab_size
        tok = torch.where(torch.rand(tokens, generator=g) < in_vocab, torch.randint(0, n, (tokens,), generator=g),
                          torch.randint(n, V, (tokens,), generator=g))
        rows = head[tok].float()
        final = (rows + 0.5 * rows.std() * torch.randn(rows.shape, generator=g)).unsqueeze(0)
    rows = send_rows(HostRows.pack(step_rows(mask, docs.unsqueeze(0), ttt_steps)), device) if ttt_steps > 0 else None
    return Batch(
        aux=torch.randn(1, tokens, cfg.num_aux * cfg.target_hidden_size, generator=g).to(device),
        final=final.to(device, frozen),
        input_ids=torch.randint(0, cfg.vocab_size, (1, tokens), generator=g).to(device),
        loss_mask=mask.to(device),
        position_ids=positions.unsqueeze(0).to(device),
        doc_ids=docs.unsqueeze(0).to(device),
        tokens=tokens,
        rows=rows,
    )


class SyntheticSamples:
    """`n` samples of `seq` random tokens below `vocab`, every token trained on: what extraction
    reads of `formats.prepared.PreparedData` (lengths, sample_ids, samples by position)."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.ids = rng.integers(0, vocab, size=(n, seq), dtype=np.int64).astype(np.int32)
        self.lengths = np.full(n, seq, dtype=np.int64)
        self.sample_ids = np.arange(n, dtype=np.int64)
        self.mask = np.ones(seq, dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> Sample:
        return Sample(int(self.sample_ids[i]), self.ids[i], self.mask)
