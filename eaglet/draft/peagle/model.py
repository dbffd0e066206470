"""The P-EAGLE draft: an EAGLE-3 draft that proposes all k tokens in one forward.

The architecture is EAGLE-3's (eaglet/draft/eagle3/model.py, imported, not copied) plus one
trained vector, `mask_hidden` (num_aux x target_hidden wide: a stand-in for the concatenated
target states, run through fc like them), and a mask token id (`mask_token_id`, written as
vLLM's `pard_token`). Depth 0 of an anchor row t is EAGLE-3's step 0: fc(target states at t),
the token x[t+1], position t+1, predicting x[t+2]. Depth d >= 1 of the same anchor takes the
mask token and fc(mask_hidden) at position t+1+d and predicts x[t+2+d]: every depth's input is
known up front, so no depth waits for another's output (speculators 0.9.0 models/peagle/core.py;
vLLM 0.25.0 v1/spec_decode/llm_base_proposer.py, parallel drafting).

Attention is the training-time test's (eaglet/draft/eagle3/attention.py): element (t, d) sees the
depth-0 elements of rows <= t in its document and its own row's elements of depths 1..d. Depth
d >= 1 runs over a sampled subset of the rows (loss.py `sample_depth_rows`, each depth's rows a
subset of the depth before's), so `DepthAttend` gathers the earlier depths' keys at the rows of
the current one before handing them to `ttt_attention`.

Change `peagle_settings` when the `peagle:` config section changes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..eagle3.attention import TTTAttend, ttt_attention
from ..eagle3.model import DraftConfig, Eagle3Draft, shift_ids

# The `peagle:` section's keys and their defaults (speculators 0.9.0 train/config/schema.py
# PEagleArgs: 8 depths, ratio 0.7 decaying to 0.2; AWS's published heads have 4 layers).
SETTINGS_DEFAULTS: dict[str, Any] = {
    "layers": 4,  # decoder layers in the draft
    "depths": 8,  # tokens proposed per forward (k), and the depths trained
    "down_sample_ratio": 0.7,  # depth d keeps about max(r**d, r_min) of the rows
    "down_sample_ratio_min": 0.2,
    "mask_token_id": None,  # None: `auto_mask_token_id` of the target's config
}


def peagle_settings(cfg: Any) -> dict[str, Any]:
    """The `peagle:` section of a Config as a dict, its defaults where it lacks a key (or the
    section is absent)."""
    section = getattr(cfg, "peagle", None)
    return {key: getattr(section, key, default) for key, default in SETTINGS_DEFAULTS.items()}


def auto_mask_token_id(target_config: Any) -> int:
    """The mask token when the config names none: the target's pad token, else its (first) end
    of sequence token, else its last vocabulary id. The embedding is the target's frozen one and
    the same at every mask slot, so any id the embedding table has works; fc(mask_hidden),
    trained, carries what the slot needs (speculators falls back to pad/eos the same way)."""
    c = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    for key in ("pad_token_id", "eos_token_id"):
        value = getattr(c, key, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None and 0 <= int(value) < int(c.vocab_size):
            return int(value)
    return int(c.vocab_size) - 1


@dataclass
class PeagleConfig(DraftConfig):
    """EAGLE-3's sizes plus the mask token. fc_norm and norm_output stay off: vLLM 0.25.0's
    speculators `peagle` path (algos.py update_peagle) forwards neither, and no depth feeds its
    output to another."""

    mask_token_id: int = 0
    num_depths: int = 8  # the depths trained: the tokens proposed per forward it was made for

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fc_norm or self.norm_output:
            raise ValueError("a P-EAGLE draft has no fc_norm or norm_output (vLLM's peagle format drops them)")
        if self.num_depths < 1:
            raise ValueError(f"num_depths {self.num_depths} < 1")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary (0..{self.vocab_size - 1})")


class PeagleDraft(Eagle3Draft):
    ALGORITHM = "peagle"  # its package in eaglet/draft/__init__.py DRAFT_TYPES

    config: PeagleConfig

    def __init__(self, cfg: PeagleConfig):
        super().__init__(cfg)
        # The pre-fc stand-in for the target states at every mask slot; flat here, [1, 1, A]
        # in the export (serving.py).
        self.mask_hidden = nn.Parameter(torch.empty(cfg.num_aux * cfg.target_hidden_size))
        nn.init.normal_(self.mask_hidden.data)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """EAGLE-3's initialisation; mask_hidden standard normal, as speculators starts it (the
        scale of a target state, not of a weight)."""
        super().reset_parameters(std)
        if hasattr(self, "mask_hidden"):
            nn.init.normal_(self.mask_hidden)

    def mask_state(self) -> Tensor:
        """fc(mask_hidden) [H]: the hidden state of every mask slot (vLLM: combine_hidden_states)."""
        return self.project_aux(self.mask_hidden[None, None])[0, 0]

    # ---- training: every depth in one unroll -----------------------------------------------

    def depth_steps(
        self,
        aux_BTA: Tensor,
        input_ids_BT: Tensor,
        position_ids_BT: Tensor | None = None,
        doc_ids_BT: Tensor | None = None,
        depth_rows: Sequence[Tensor | None] = (None,),
        attn_impl: str = "auto",
    ) -> Iterator[Tensor]:
        """Yield the logits of depths 0..len(depth_rows)-1.

        depth_rows[0]: the flat rows (b*T + t) whose depth-0 logits are wanted, or None for all
        ([B,T,V]); depth_rows[d >= 1]: the anchor rows depth d runs over, ascending, each
        depth's a subset of the depth before's (loss.py `sample_depth_rows`); depth d yields
        [1, len(rows), V]. Every row runs at depth 0: its keys are every later depth's context."""
        B, T = input_ids_BT.shape
        if position_ids_BT is None:
            position_ids_BT = torch.arange(T, device=input_ids_BT.device).expand(B, T)
        attend = DepthAttend(len(self.layers), doc_ids_BT, T, input_ids_BT.device, attn_impl)
        _, logits = self.step(self.project_aux(aux_BTA), shift_ids(input_ids_BT, 1), position_ids_BT + 1, attend)
        yield logits if depth_rows[0] is None else logits.flatten(0, 1).index_select(0, depth_rows[0])[None]
        mask_hidden = self.mask_state()
        flat_positions = position_ids_BT.flatten()
        for d, rows in enumerate(depth_rows[1:], start=1):
            assert rows is not None, "depths >= 1 need their rows"
            attend.set_depth_rows(rows)
            n = rows.numel()
            ids = torch.full((1, n), self.config.mask_token_id, dtype=input_ids_BT.dtype, device=rows.device)
            positions = (flat_positions.index_select(0, rows) + 1 + d)[None]
            _, logits = self.step(mask_hidden.expand(1, n, -1), ids, positions, attend)
            yield logits

    def depth_forward(self, *args: Any, **kwargs: Any) -> list[Tensor]:
        """All depths' logits as a list; the arguments are `depth_steps`'."""
        return list(self.depth_steps(*args, **kwargs))

    forward = depth_forward  # module(...) is the training call (DDP's and FSDP2's hooks run on forward)


class DepthAttend(TTTAttend):
    """TTTAttend over depths whose rows shrink: depth d's queries and new keys are of its rows
    only, and the keys of depths 1..d-1 (kept at their own rows) are gathered at depth d's rows
    before `ttt_attention` merges them in as the diagonal."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.depth_rows: list[Tensor] = []  # the rows of depths 1.. so far

    def set_depth_rows(self, rows: Tensor) -> None:
        self.depth_rows.append(rows)
        self.rows = rows

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.kv[layer].append((k, v))
        if self.rows is None:  # depth 0: causal over every row, per document
            return ttt_attention(q, [k], [v], self.impl, doc_ids_BT=self.doc_ids_BT, block_mask=self.block_mask)
        ks, vs = [self.kv[layer][0][0]], [self.kv[layer][0][1]]
        for (k_d, v_d), rows_d in zip(self.kv[layer][1:-1], self.depth_rows[:-1], strict=True):
            at = torch.searchsorted(rows_d, self.rows)  # the current rows' places among depth d's
            ks.append(k_d.index_select(2, at))
            vs.append(v_d.index_select(2, at))
        ks.append(k)
        vs.append(v)
        return ttt_attention(q, ks, vs, self.impl, doc_ids_BT=self.doc_ids_BT, block_mask=self.block_mask,
                             rows=self.rows)

