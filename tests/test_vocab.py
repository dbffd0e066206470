"""Draft vocabulary and d2t/t2d maps from masked-token frequency."""

import numpy as np
import torch

from eaglet.formats.prepared import PreparedData, PreparedWriter
from eaglet.stages.vocab import build_maps, coverage, masked_token_counts


def test_counts_only_masked_tokens(tmp_path):
    w = PreparedWriter(tmp_path, ["f"], shard_samples=2)
    w.add([1, 2, 3, 3], [0, 1, 1, 0], 0, 1)
    w.add([3, 4, 4, 9], [1, 1, 1, 0], 0, 2)
    w.add([9, 9], [0, 0], 0, 3)
    w.close()
    counts = masked_token_counts(PreparedData(tmp_path), 10)
    assert counts.tolist() == [0, 0, 1, 2, 2, 0, 0, 0, 0, 0]


def test_maps_top_n_sorted_and_offsets():
    counts = np.array([0, 5, 0, 7, 1, 0, 3, 0])
    d2t, t2d = build_maps(counts, 3)
    used = [1, 3, 6]  # the three most frequent, sorted
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert (torch.arange(3) + d2t).tolist() == used
    assert t2d.nonzero().flatten().tolist() == used
    assert abs(coverage(counts, t2d) - 15 / 16) < 1e-12


def test_maps_fill_with_lowest_unused_ids_and_cap():
    counts = np.array([0, 0, 4, 0, 2, 0])
    d2t, t2d = build_maps(counts, 4)
    assert (torch.arange(4) + d2t).tolist() == [0, 1, 2, 4]
    assert coverage(counts, t2d) == 1.0
    d2t, t2d = build_maps(counts, 100)  # capped at the target vocabulary
    assert d2t.numel() == 6 and bool(t2d.all())


def test_ties_break_to_lower_id():
    counts = np.array([1, 1, 1, 1])
    d2t, _ = build_maps(counts, 2)
    assert (torch.arange(2) + d2t).tolist() == [0, 1]
