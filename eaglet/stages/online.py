"""Online states: the target runs beside the draft in training instead of a store on disk.

    extract.mode: online       # in the run config

A store costs (n_aux + 1) x hidden x 2 bytes per token: 4.6 KB for a 576-wide target, 32 KB
for an 8B one, 57 KB for a 7168-wide MoE. The 24.6M tokens of ShareGPT's usable
conversations make 113 GB even for SmolLM2-135M. When the target fits on the training GPU
beside the draft and its forward is cheap next to the draft's training step (small and
mid-size targets), recomputing the states every epoch beats storing them.

In online mode the extract stage stores only the self-check's samples (so the same check
guards the captured states) and marks its store `mode: online`; `train_data.open_states` then gives
training an `OnlineStates`: the read interface of `StoreReader` (sample ids, lengths,
meta, `get`, `get_many`) whose states come from the same capture code extract uses, one
padded forward per packed micro-batch, on the target's device. Offline and online runs
of the same config see the same samples in the same order; their states agree to the
rounding of a differently composed batch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..config import TargetSection
from ..engines.hf import capture, nonfinite_rows, pad_batch
from ..formats.prepared import PreparedData
from ..formats.store import (FP8, StoreReader, TargetHead, capture_dtype, dequantize_states, quantize_states,
                             read_target_head)
from ..targets.load import TargetParts, load_target
from ..utils import to_device


class PreparedStates:
    """What states read from the prepared data (not a store) share with `StoreReader`: the
    sample ids with tokens, their lengths, meta, layers, dtype and the target's head.

    `base` is extract's (online) store: its meta, layers and dtype, and the folder that holds
    head.safetensors and target_config.json."""

    def __init__(self, base: StoreReader, prepared_folder: str | Path):
        self.folder, self.meta, self.layers, self.dtype = base.folder, base.meta, base.layers, base.dtype
        self.data = PreparedData(prepared_folder)
        order = np.argsort(self.data.sample_ids, kind="stable")
        keep = self.data.lengths[order] > 0
        self.sample_ids = self.data.sample_ids[order][keep]
        self.lengths = self.data.lengths[order][keep]
        self._row = {int(s): int(i) for i, s in enumerate(self.data.sample_ids.tolist())}

    def __len__(self) -> int:
        return int(self.sample_ids.shape[0])

    @property
    def n_aux(self) -> int:
        return len(self.layers)

    def __contains__(self, sample_id: int) -> bool:
        return int(sample_id) in self._row

    def target_head(self, device: torch.device) -> TargetHead:
        return read_target_head(self.folder, self.meta, device)


class OnlineStates(PreparedStates):
    """The `StoreReader` interface over prepared data, states computed by the target on demand."""

    def __init__(self, base: StoreReader, prepared_folder: str | Path, target: TargetSection):
        super().__init__(base, prepared_folder)
        self.model, self.info = load_target(target)
        self.model.eval()
        self.parts = TargetParts.of(self.model)
        if self.parts.num_layers != int(self.meta["num_target_layers"]):
            raise ValueError(
                f"online states: target.path has {self.parts.num_layers} decoder layers but extract ran on "
                f"{self.meta['num_target_layers']} ({self.folder}); rerun extract for this target"
            )
        self._nonfinite: torch.Tensor | int = 0  # a device count: read only when asked (no sync per batch)

    @property
    def nonfinite(self) -> int:
        """Samples whose states were not finite (their loss mask was cleared)."""
        return int(self._nonfinite)

    def get(self, sample_id: int) -> dict[str, torch.Tensor]:
        return self.get_many([sample_id])[0]

    def get_many(self, sample_ids: list[int], max_tokens: int | None = None) -> list[dict[str, torch.Tensor]]:
        """Per sample, on the target's device: aux [T, n_aux*H], final [T, H] (store dtype),
        input_ids int32 [T], loss_mask uint8 [T]; T cut at `max_tokens` before the forward
        (states of a causal model's prefix do not depend on what follows). Nothing here waits
        for the device: a sample with non-finite states gets its loss mask cleared on it.
        loss_mask_host: the prepared loss mask on the host, before any clearing (a superset)."""
        samples = []
        for sid in sample_ids:
            if int(sid) not in self._row:
                raise KeyError(f"sample {sid} is not in the prepared data {self.data.folder}")
            samples.append(self.data[self._row[int(sid)]])
        ids = [np.asarray(s.input_ids)[:max_tokens] for s in samples]
        input_ids, attn = pad_batch(ids)
        loss_mask = torch.zeros(input_ids.shape, dtype=torch.uint8)
        for b, s in enumerate(samples):
            loss_mask[b, :len(ids[b])] = torch.from_numpy(np.asarray(s.loss_mask)[:max_tokens])
        host_mask = loss_mask
        device = self.parts.input_device
        input_ids, attn, loss_mask = (to_device(t, device) for t in (input_ids, attn, loss_mask))
        with torch.no_grad():  # not inference_mode: these tensors feed an autograd graph
            aux, final = capture(self.parts, self.layers, input_ids, attn, capture_dtype(self.dtype))
            if self.dtype == FP8:  # what an fp8 store would hold: quantized and back, on the device
                aux = dequantize_states(*quantize_states(aux, len(self.layers)), torch.bfloat16)
                final = dequantize_states(*quantize_states(final, 1), torch.bfloat16)
            bad = nonfinite_rows(aux, final, attn).to(device)
        loss_mask = loss_mask * (~bad)[:, None]
        self._nonfinite = self._nonfinite + bad.sum()
        return [{"aux": aux[b, :len(seq)], "final": final[b, :len(seq)],
                 "input_ids": input_ids[b, :len(seq)].to(torch.int32), "loss_mask": loss_mask[b, :len(seq)],
                 "loss_mask_host": host_mask[b, :len(seq)]}
                for b, seq in enumerate(ids)]


def is_online(store: StoreReader) -> bool:
    return store.meta.get("mode") == "online"  # extract.mode, as the store records it


def split_source(upstream: dict[str, Path]) -> np.ndarray:
    """The sample ids training splits into train and held-out (no target needed)."""
    store = StoreReader(upstream["extract"], verify=False)
    if not is_online(store):
        return store.sample_ids
    data = PreparedData(upstream["prepare"])
    return np.sort(data.sample_ids[data.lengths > 0])
