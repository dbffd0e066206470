"""torch.compile for the training step's pieces, shaped for packed micro-batches.

    fn = compile_piece(fn)            # torch.compile(fn, dynamic=True), kwargs override

Two things make the default torch.compile a poor fit for training on packed data:

- Every size that follows the data varies from one micro-batch to the next: the packed tokens,
  the rows each TTT step's head and loss count, the rows steps 1.. run over. Left to itself,
  dynamo compiles each piece for the first micro-batch's sizes, then again with those sizes
  symbolic at the first micro-batch that differs: the warm-up pays for every piece twice.
  `dynamic=True` makes them symbolic from the first compile; the model's own sizes stay fixed,
  as dynamo specializes the sizes it meets in the parameters' shapes.
- dynamo keeps its graphs per code object, at most `recompile_limit` (8) of them, and past the
  limit runs the function eager without a word. Pieces compiled as `partial`s all sit behind
  one wrapper's code object, so their graphs share those 8: compile the function itself and
  bind its module afterwards (`partial(compile_piece(fn), module)`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

PIECE_OPTIONS: dict[str, Any] = {"dynamic": True}


def compile_piece(fn: Callable[..., Any], **compile_kwargs: Any) -> Callable[..., Any]:
    """torch.compile(fn) with `PIECE_OPTIONS` under `compile_kwargs` (e.g. a test's backend)."""
    return torch.compile(fn, **{**PIECE_OPTIONS, **compile_kwargs})
