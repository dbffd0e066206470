"""EAGLE-3: a draft that reads the target's low, mid and high states and drafts a chain one
step at a time, trained with training-time test (model.py has the architecture, training.py
the training entry points of eaglet/draft/base.py `DraftType`, loss.py the TTT loss)."""

from __future__ import annotations

from .training import (build, from_config, host_rows, layers, loss, num_positions, prepare_training, shard_units,
                       unroll_linears)

NAME = "eagle3"
TITLE = "EAGLE-3"
SERVING_METHOD = "eagle3"

__all__ = ["NAME", "TITLE", "SERVING_METHOD", "layers", "build", "from_config", "host_rows", "prepare_training",
           "shard_units", "unroll_linears", "num_positions", "loss"]
