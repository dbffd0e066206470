"""transformers as eaglet's engine: hooks on the decoder layers capture the target's states.

`capture` runs one forward of the base decoder model (not the CausalLM: no full-vocabulary
logits are built) with forward pre-hooks on the chosen decoder layers. Each hook copies the
state entering its layer into one [B, T, n_aux*H] buffer in the store dtype;
`output_hidden_states` would keep every layer's state alive at once (61 layers x 7168 wide is
gigabytes per batch). The final state is the base model's `last_hidden_state`, exactly the
tensor the CausalLM feeds its LM head (the final norm applied). The extract stage
(eaglet/engines/hf/extract.py) and online states (eaglet/engines/hf/online.py) both capture through
here; the self-check (eaglet/checks/selfcheck.py) compares the result with the model's own
unbatched forward. `save_target_head` writes what training needs of the target beside the
store (its embedding, LM head, final norm and text config).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from ...formats.store import write_target_head
from ...targets.load import TargetParts


def pad_batch(samples: Sequence[torch.Tensor | np.ndarray], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token id rows: (input_ids int64 [B, T], attention_mask int64 [B, T])."""
    longest = max(len(s) for s in samples)
    ids = torch.full((len(samples), longest), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(samples), longest), dtype=torch.int64)
    for b, s in enumerate(samples):
        ids[b, :len(s)] = torch.as_tensor(np.asarray(s), dtype=torch.int64)
        mask[b, :len(s)] = 1
    return ids, mask


def capture(parts: TargetParts, layers: Sequence[int], input_ids: torch.Tensor, attention_mask: torch.Tensor,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of the base model; returns (aux [B, T, n_aux*H], final [B, T, H]) in `dtype`.

    aux[..., j*H:(j+1)*H] is the state entering decoder layer layers[j]; final is the
    base model's last_hidden_state (post final norm). Hooks are removed before returning.
    """
    B, T = input_ids.shape
    H = parts.hidden_size
    aux_BTA: list[torch.Tensor | None] = [None]  # allocated by the first hook, on its device
    fired = [0] * len(layers)

    def make_hook(j: int, layer_id: int):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            hidden_BTH = args[0] if args else kwargs[parts.layer_input]
            if tuple(hidden_BTH.shape) != (B, T, H):
                raise RuntimeError(
                    f"decoder layer {layer_id} ({type(module).__name__}) got hidden_states of shape "
                    f"{tuple(hidden_BTH.shape)}, expected {(B, T, H)}"
                )
            if aux_BTA[0] is None:
                aux_BTA[0] = torch.empty((B, T, len(layers) * H), dtype=dtype, device=hidden_BTH.device)
            aux_BTA[0][..., j * H:(j + 1) * H].copy_(hidden_BTH)  # a copy: later in-place ops cannot alter it
            fired[j] += 1
        return hook

    handles = [parts.layers[i].register_forward_pre_hook(make_hook(j, i), with_kwargs=True)
               for j, i in enumerate(layers)]
    try:
        out = parts.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    if fired != [1] * len(layers):
        raise RuntimeError(f"decoder layers {list(layers)} ran {fired} times in one forward (expected once each)")
    final_BTH = getattr(out, "last_hidden_state", None)
    if final_BTH is None:
        final_BTH = out[0]
    if tuple(final_BTH.shape) != (B, T, H):
        raise RuntimeError(f"base model returned a final state of shape {tuple(final_BTH.shape)}, expected {(B, T, H)}")
    return aux_BTA[0], final_BTH.to(dtype)


def nonfinite_rows(aux_BTA: torch.Tensor, final_BTH: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """bool [B]: rows with a NaN/Inf state on any real (unpadded) token."""
    bad_BT = ~torch.isfinite(aux_BTA).all(-1)
    bad_BT |= ~torch.isfinite(final_BTH).all(-1).to(bad_BT.device)
    return (bad_BT & attention_mask.to(bad_BT.device).bool()).any(-1)


def to_host(t: torch.Tensor, events: list, waits: dict[str, float] | None = None) -> torch.Tensor:
    """Start a copy to (pinned) host memory; CPU tensors are returned as they are. `waits`
    adds the seconds spent allocating the pinned buffer under 'pin_alloc_s'."""
    if t.device.type != "cuda":
        return t
    t0 = time.perf_counter()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    if waits is not None:
        waits["pin_alloc_s"] = waits.get("pin_alloc_s", 0.0) + time.perf_counter() - t0
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    events.append(event)
    return host


# ---- the target's head, beside the store ----------------------------------------------------------

def _whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel (DTensor) weight gathered whole; a collective, so every rank calls it."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def save_target_head(parts: TargetParts, model: torch.nn.Module, folder: Path, write: bool = True) -> None:
    """What training needs of the target besides the store: its token embedding (copied into
    the draft, frozen), LM head and final norm (the teacher), and its text config (the
    draft's sizes). A few GB for the largest targets, against the model's hundreds.
    Under tensor parallelism every rank calls this (the weights are gathered) and the rank
    with `write` writes.

    The embedding is stored as the first decoder layer receives it (times the family's
    embed_scale: Gemma's sqrt(H)) and the norm as a plain weight (Gemma's 1 + w), so the
    draft and the teacher need no family knowledge; the head's logit scale and softcap go
    into the store's meta (`head_meta`)."""
    weights = {"embed_tokens": parts.embed_tokens.weight, "lm_head": parts.lm_head.weight, "norm": parts.norm.weight}
    if not write and not any(isinstance(w, DTensor) for w in weights.values()):
        return
    tensors = {k: _whole(v.detach()) for k, v in weights.items()}
    if not write:
        return
    write_target_head(folder, parts.scaled_embedding(tensors["embed_tokens"]), tensors["lm_head"],
                      parts.plain_norm_weight(tensors["norm"]), model.config.get_text_config().to_dict())


def head_meta(parts: TargetParts) -> dict[str, Any]:
    """The store meta that says how the teacher's logits come from the stored final state."""
    return {
        "family": parts.family.key if parts.family is not None else None,
        "embed_scale": parts.embed_scale,
        "logit_scale": parts.logit_scale,
        "logit_softcap": parts.logit_softcap,
    }
