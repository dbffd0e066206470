"""What every engine's online state source shares: the prepared samples in the place of a store.

An engine whose states are computed as training goes (`Engine.state_source`: the HF engine's
target beside the draft, eaglet/engines/hf/online.py; the vLLM engine's stream,
eaglet/engines/vllm/stream.py) subclasses `PreparedStates`: the sample ids and lengths come from
the prepared data, the meta, layers, dtype and the target's head from extract's online store,
and each engine writes `get_packed`, one micro-batch packed. The rest of engines/base.py's
`StateSource` has defaults here that a source which computes ahead replaces (`start`,
`progress`, `stats`, `close`). `is_online` and `split_source` tell an online store from an
offline one and give the ids training splits either way. Change this module when every online
source needs something new.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..formats.prepared import PreparedData
from ..formats.store import StoreReader, TargetHead, read_target_head


class PreparedStates:
    """What states read from the prepared data (not a store) share with `StoreReader`: the
    sample ids with tokens, their lengths, meta, layers, dtype and the target's head.

    `base` is extract's (online) store: its meta, layers and dtype, and the folder that holds
    head.safetensors and target_config.json."""

    computes_ahead = False  # engines/base.py StateSource: a source that computes a plan ahead says True
    prefetchable = False  # the states come from a device or an engine, not host reads a thread could overlap
    stats_key: str | None = None  # nothing for the train manifest unless a subclass says where

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

    def get_packed(self, sample_ids: list[int], max_tokens: int | None = None
                   ) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The samples `sample_ids`, each cut at `max_tokens`, as one packed micro-batch: their
        lengths, and each tensor their rows end to end (what training reads, `read_parts`)."""
        raise NotImplementedError

    def read_parts(self, sample_ids: list[int], max_tokens: int) -> tuple[list[int], list[dict[str, torch.Tensor]]]:
        """StateSource.read_parts: one part, the whole micro-batch packed (`get_packed`)."""
        lens, packed = self.get_packed(sample_ids, max_tokens)
        return lens, [packed]

    def get_many(self, sample_ids: list[int], max_tokens: int | None = None) -> list[dict[str, torch.Tensor]]:
        """`get_packed`, sample by sample (views)."""
        lens, tensors = self.get_packed(sample_ids, max_tokens)
        cuts = np.cumsum([0, *lens]).tolist()
        return [{k: v[a:b] for k, v in tensors.items()} for a, b in zip(cuts[:-1], cuts[1:])]

    def get(self, sample_id: int) -> dict[str, torch.Tensor]:
        return self.get_many([sample_id])[0]

    def start(self, loads: list[list[int]], max_tokens: int) -> None:
        """Nothing to start where nothing computes ahead."""

    def progress(self) -> dict[str, float]:
        return {}

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        """Nothing to stop where nothing computes ahead."""


def is_online(store: StoreReader) -> bool:
    return store.meta.get("mode") == "online"  # extract.mode, as the store records it


def split_source(upstream: dict[str, Path]) -> np.ndarray:
    """The sample ids training splits into train and held-out (no target needed)."""
    store = StoreReader(upstream["extract"], verify=False)
    if not is_online(store):
        return store.sample_ids
    data = PreparedData(upstream["prepare"])
    return np.sort(data.sample_ids[data.lengths > 0])
