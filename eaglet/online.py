"""Online states: the target runs beside the draft in training instead of a store on disk.

    extract.mode: online       # in the run config

A store costs (n_aux + 1) x hidden x 2 bytes per token: 4.6 KB for a 576-wide target, 32 KB
for an 8B one, 57 KB for a 7168-wide MoE. The 24.6M tokens of ShareGPT's usable
conversations make 113 GB even for SmolLM2-135M. When the target fits on the training GPU
beside the draft and its forward is cheap next to the draft's training step (small and
mid-size targets), recomputing the states every epoch beats storing them.

In online mode the extract stage stores only the self-check's samples (so the same check
guards the captured states) and marks its store `mode: online`; `open_states` then gives
training an `OnlineStates`: the read interface of `StoreReader` (sample ids, lengths,
meta, `get`, `get_many`) whose states come from the same capture code extract uses, one
padded forward per packed micro-batch, on the target's device. Offline and online runs
of the same config see the same samples in the same order; their states agree to the
rounding of a differently composed batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import TargetSection
from .prepared import PreparedData
from .store import StoreReader

ONLINE = "online"


class OnlineStates:
    """The `StoreReader` interface over prepared data, states computed by the target on demand."""

    def __init__(self, base: StoreReader, prepared_folder: str | Path, target: TargetSection):
        from .extract import capture  # noqa: F401  (fail here, not mid-training, if it moved)
        from .target import TargetParts, load_target

        self.folder = base.folder  # head.safetensors and target_config.json live here
        self.meta: dict[str, Any] = dict(base.meta)
        self.layers: list[int] = list(base.layers)
        self.hidden_size = base.hidden_size
        self.dtype = base.dtype
        self.data = PreparedData(prepared_folder)
        order = np.argsort(self.data.sample_ids, kind="stable")
        self.sample_ids = self.data.sample_ids[order]
        self.lengths = self.data.lengths[order]
        keep = self.lengths > 0
        self.sample_ids, self.lengths = self.sample_ids[keep], self.lengths[keep]
        self._row = {int(s): int(i) for i, s in enumerate(self.data.sample_ids.tolist())}
        self.model, self.info = load_target(target)
        self.model.eval()
        self.parts = TargetParts.of(self.model)
        if self.parts.num_layers != int(self.meta["num_target_layers"]):
            raise ValueError(
                f"online states: target.path has {self.parts.num_layers} decoder layers but extract ran on "
                f"{self.meta['num_target_layers']} ({self.folder}); rerun extract for this target"
            )
        self.nonfinite = 0  # samples whose states were not finite (their loss mask is cleared)

    def __len__(self) -> int:
        return int(self.sample_ids.shape[0])

    @property
    def n_aux(self) -> int:
        return len(self.layers)

    def __contains__(self, sample_id: int) -> bool:
        return int(sample_id) in self._row

    def get(self, sample_id: int) -> dict[str, torch.Tensor]:
        return self.get_many([sample_id])[0]

    def get_many(self, sample_ids: list[int], max_tokens: int | None = None) -> list[dict[str, torch.Tensor]]:
        """Per sample: aux [T, n_aux*H], final [T, H] (store dtype, on the target's device),
        input_ids int32 [T], loss_mask uint8 [T]; T cut at `max_tokens` before the forward
        (states of a causal model's prefix do not depend on what follows)."""
        from .extract import capture, nonfinite_rows, pad_batch

        samples = []
        for sid in sample_ids:
            if int(sid) not in self._row:
                raise KeyError(f"sample {sid} is not in the prepared data {self.data.folder}")
            samples.append(self.data[self._row[int(sid)]])
        ids = [np.asarray(s.input_ids)[:max_tokens] for s in samples]
        masks = [np.asarray(s.loss_mask)[:max_tokens] for s in samples]
        input_ids, attn = pad_batch(ids)
        device = self.parts.input_device
        input_ids, attn = input_ids.to(device, non_blocking=True), attn.to(device, non_blocking=True)
        with torch.no_grad():  # not inference_mode: these tensors feed an autograd graph
            aux, final = capture(self.parts, self.layers, input_ids, attn, self.dtype)
            bad = nonfinite_rows(aux, final, attn).tolist()
        out = []
        for b, (seq, mask) in enumerate(zip(ids, masks)):
            n = len(seq)
            loss_mask = torch.as_tensor(mask, dtype=torch.uint8)
            if bad[b]:
                self.nonfinite += 1
                loss_mask = torch.zeros_like(loss_mask)
            out.append({"aux": aux[b, :n], "final": final[b, :n], "input_ids": torch.as_tensor(seq, dtype=torch.int32),
                        "loss_mask": loss_mask})
        return out


def is_online(store: StoreReader) -> bool:
    return store.meta.get("mode") == ONLINE


def open_states(upstream: dict[str, Path], target: TargetSection, verify: bool = True) -> StoreReader | OnlineStates:
    """What training reads: the extract stage's store, or online states when extract ran online."""
    store = StoreReader(upstream["extract"], verify=verify)
    if not is_online(store):
        return store
    if "prepare" not in upstream:
        raise ValueError(f"online states need the prepare stage's folder ({upstream['extract']} is an online store)")
    return OnlineStates(store, upstream["prepare"], target)


def split_source(upstream: dict[str, Path]) -> np.ndarray:
    """The sample ids training splits into train and held-out (no target needed)."""
    store = StoreReader(upstream["extract"], verify=False)
    if not is_online(store):
        return store.sample_ids
    data = PreparedData(upstream["prepare"])
    ids = np.sort(data.sample_ids[data.lengths > 0])
    return ids
